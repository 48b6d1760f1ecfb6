# Triton for GPU hosts: the NGC Triton image (Python backend, ONNX Runtime and TensorRT backends)
# plus ONNX Runtime for Python and this package, which the Python-backend models import.
#
# The tag is pinned. 24.12 is Triton 2.53 on Ubuntu 24.04 with Python 3.12, CUDA 12.6.3 and
# TensorRT 10.7. It is the release closest to the 2.51 our CPU tests run (the nvidia-pytriton
# wheel) whose Python can run this package: the Python backend's stub runs the image's own
# Python, and 24.10 (Triton 2.51) ships Python 3.10 while this package needs 3.11 or newer.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.12-py3
FROM ${TRITON_IMAGE}

# Installing into the image's Python is the point here (the stub imports from it), so PEP 668's
# guard against that is lifted for this build only.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONDONTWRITEBYTECODE=1

# onnxruntime-gpu 1.20.1 is built for CUDA 12 and cuDNN 9 and has the TensorRT 10 provider, which
# this image provides (newer onnxruntime-gpu releases move to CUDA 13). numpy < 2 as in pyproject.
RUN python3 -m pip install "numpy>=1.26,<2" "onnxruntime-gpu==1.20.1"

# Only what the models import at run time; `--no-deps`: numpy and ONNX Runtime are above, and the
# client's tritonclient is not needed inside the server.
COPY pyproject.toml README.md /tmp/src/
COPY export /tmp/src/export
COPY serving /tmp/src/serving
COPY client /tmp/src/client
RUN python3 -m pip install --no-deps /tmp/src && rm -rf /tmp/src

# Not root. The TensorRT engine caches (see export/triton_config.py and serving/triton_models)
# are created here so that volumes mounted on them start owned by this user.
RUN useradd --uid 10001 --no-log-init --create-home --shell /usr/sbin/nologin serving \
    && mkdir -p /tmp/triton-trt-cache /tmp/attention-serving-trt \
    && chown serving:serving /tmp/triton-trt-cache /tmp/attention-serving-trt
USER serving
WORKDIR /home/serving

EXPOSE 8000 8001 8002
# docker-compose.yml gives the command (model repository, control mode, restricted APIs)
CMD ["tritonserver", "--model-repository=/models", "--model-control-mode=none"]
