# The FastAPI gateway (serving/gateway): numpy, tritonclient and the web stack only; no torch,
# no ONNX Runtime, no Triton. Its settings come from SERVING_* variables (serving/gateway/settings.py).
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# The web stack and the text extra (client/text.py: the model's tokenizer) pinned as in pyproject.toml's `serving`
# extra (tests/gateway/test_compose.py checks
# they agree); that extra also holds the bundled Triton wheel, which a gateway does not need.
COPY pyproject.toml README.md /tmp/src/
COPY contract /tmp/src/contract
COPY export /tmp/src/export
COPY serving /tmp/src/serving
COPY client /tmp/src/client
RUN python -m pip install /tmp/src \
        "fastapi==0.165.0" \
        "uvicorn==0.54.0" \
        "pydantic-settings==2.16.3" \
        "prometheus-client==0.26.0" \
        "swagger-ui-bundle-v2==5.31.0" \
        "itsdangerous==2.2.0" \
        "orjson==3.13.0" \
        "uvloop==0.23.0" \
        "httptools==0.9.0" \
        "redis==8.1.0" \
        "tokenizers==0.23.3" \
        "jinja2==3.1.6" \
    && rm -rf /tmp/src

RUN useradd --uid 10001 --no-log-init --create-home --shell /usr/sbin/nologin serving
USER serving
WORKDIR /home/serving

EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
CMD ["python", "-m", "serving.gateway"]
