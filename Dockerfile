# syntax=docker/dockerfile:1
# fedmosaic serving image: the OpenAI-compatible API over one frozen base model with hot-swapped adapters.
#
#   docker build -t fedmosaic .                                      # CPU (default)
#   docker build -t fedmosaic:cuda --build-arg TORCH_VARIANT=cu126 .  # CUDA: PyTorch's wheels for that CUDA
#                                                                     # (run with --gpus all; host driver)
#   docker run -p 8000:8000 -v ~/.cache/fedmosaic:/models:ro -v "$PWD/runs/quickstart":/adapters:ro fedmosaic
#
# Only the serve extra is installed (no training, no demo). Model weights and adapters are never baked in:
# mount a model cache prepared on the host (`fedmosaic models prepare smollm2` writes
# ~/.cache/fedmosaic/smollm2-135m-instruct) or any Hugging Face model folder (`--model /models/<folder>`) at
# /models, and a run directory or adapter folders at /adapters. /health answers 503 with the reason until
# the model is loaded.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS builder
# cpu, or a CUDA tag of https://download.pytorch.org/whl/ such as cu126
ARG TORCH_VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY constraints.txt pyproject.toml README.md ./
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" torch==2.13.0
COPY models ./models
COPY adapters ./adapters
COPY routing ./routing
COPY serving ./serving
COPY fedmosaic ./fedmosaic
RUN pip install -c constraints.txt '.[serve]'

FROM ${BASE_IMAGE} AS runtime
RUN groupadd --system --gid 10001 fedmosaic \
 && useradd --system --uid 10001 --gid fedmosaic --create-home --home-dir /home/fedmosaic fedmosaic \
 && mkdir -p /models /adapters && chown 10001:10001 /models /adapters
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    FEDMOSAIC_CACHE_DIR=/models \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/fedmosaic
VOLUME ["/models", "/adapters"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["fedmosaic", "serve", "--host", "0.0.0.0", "--port", "8000", "--adapter-root", "/adapters"]
CMD ["/adapters"]
