# Triton for GPU hosts: the NGC Triton image (Python backend, ONNX Runtime and TensorRT backends)
# plus ONNX Runtime for Python and this package, which the Python-backend models import.
#
# The tag is pinned. The Python-backend models run the image's own Python (3.12 on these Ubuntu
# 24.04 images; this package needs 3.11 or newer: 24.10, Triton 2.51 like our CPU tests, has 3.10)
# and ONNX Runtime 1.31, the version every parity test runs here: its CUDA build needs CUDA 13 and
# cuDNN 9, which 26.04 (CUDA 13.2.1) provides, and it runs the fused graph's opset-23 `Attention`
# op on CUDA. (onnxruntime-gpu for CUDA 12 stops at 1.26; 1.20, the last for 24.xx images, has no
# opset 23 and could serve only the plain fp32 graph.) Its TensorRT provider links TensorRT 10
# (libnvinfer.so.10): with an image whose TensorRT is 11 the runner logs that and uses CUDA.
# docs/gpu.md has what the static cache and CUDA graphs measured on an H100 with this ONNX Runtime.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:26.04-py3
FROM ${TRITON_IMAGE}

# Installing into the image's Python is the point here (the stub imports from it), so PEP 668's
# guard against that is lifted for this build only.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONDONTWRITEBYTECODE=1

# What the Python-backend models import at run time, pinned as in pyproject.toml: ONNX Runtime
# (GPU build), onnx (the runner's cache-copy kernels), llguidance (constrained decoding's token
# masks), and this package with its own dependencies
# (numpy < 2, tritonclient for the config schema and the supervisor's probe), psutil for the
# launcher. No torch: the `export` service builds the models.
COPY pyproject.toml README.md /tmp/src/
COPY contract /tmp/src/contract
COPY export /tmp/src/export
COPY serving /tmp/src/serving
COPY client /tmp/src/client
RUN python3 -m pip install "onnxruntime-gpu==1.31.1" "onnx==1.23.2" "safetensors==0.8.0" "psutil==7.2.2" "llguidance==1.9.1" /tmp/src && rm -rf /tmp/src

# Not root. The TensorRT engine caches (serving/triton/config.py and serving/engine/runner.py)
# are created here so that volumes mounted on them start owned by this user.
RUN useradd --uid 10001 --no-log-init --create-home --shell /usr/sbin/nologin serving \
    && mkdir -p /tmp/triton-trt-cache /tmp/attention-serving-trt \
    && chown serving:serving /tmp/triton-trt-cache /tmp/attention-serving-trt
USER serving
WORKDIR /home/serving

EXPOSE 8000 8001 8002
# Triton under the supervisor (restarts, reloads, restricted admin APIs); docker-compose.yml gives the same
CMD ["python3", "-m", "serving", "--no-gateway", "--tritonserver=/opt/tritonserver/bin/tritonserver", \
     "--model-repository=/models", "--triton-address=0.0.0.0", "--log=/dev/stdout"]
