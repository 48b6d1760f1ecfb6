# The one-shot export of a deployment (compose service `export`): the PyTorch original, its ONNX
# variants and their parity ladder on the CPU, then the Triton model repository in the named volume
# mounted at /models, unless that volume already holds the model asked for (`python -m serving ensure`).
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# torch as pinned in pyproject.toml's `export` extra. The export runs on the CPU; PyPI's x86_64 wheel
# carries CUDA libraries (GBs) all the same: a build arg TORCH_INDEX naming PyTorch's CPU wheel index
# makes the image small. Then this package with its export extra and ONNX Runtime's CPU build (the
# parity ladder), as the tests run them.
ARG TORCH_INDEX=""
COPY pyproject.toml README.md /tmp/src/
COPY export /tmp/src/export
COPY serving /tmp/src/serving
COPY client /tmp/src/client
RUN python -m pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==2.13.0" \
    && python -m pip install "/tmp/src[export,cpu]" \
    && rm -rf /tmp/src

# Not root. An empty named volume mounted on /models takes this directory's owner.
RUN useradd --uid 10001 --no-log-init --create-home --shell /usr/sbin/nologin serving \
    && mkdir /models && chown serving:serving /models
USER serving
WORKDIR /home/serving

# docker-compose.yml gives the model (MODEL_CONFIG_JSON, MODEL_CONFIG or MODEL_PRESET)
ENTRYPOINT ["python", "-m", "serving", "ensure", "--for", "tensorrt", "--repository", "/models", "--artifacts", "/tmp/artifacts"]
CMD ["--preset", "seed"]
