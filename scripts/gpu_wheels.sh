#!/usr/bin/env bash
# Prepare .gpu/ for scripts/gpu_check.sh on a GPU machine that cannot download anything.
#
# Run HERE (a dev machine with the project's venv and access to the package index), from any
# folder:  bash scripts/gpu_wheels.sh
#
# Fills .gpu/ (ignored by git through .git/info/exclude; carry it to the device with
# carry: [".gpu"]) with
#   .gpu/wheels/     cp312 manylinux x86_64 wheels of what the GPU image (Python 3.12, torch
#                    CUDA build) lacks: the closure of sluiceway's runtime requirements
#                    less the image's packages (grpcio-status, googleapis-common-protos,
#                    structlog, gguf, fastapi and opentelemetry-api, pydantic, uvicorn,
#                    xgrammar ...), and protobuf + grpcio, all at the versions of this venv
#                    (the generated *_pb2.py need the protobuf 7 runtime, the *_pb2_grpc.py
#                    this grpcio); the first GPU run (2026-12-04) failed on each one missing;
#   .gpu/tokenizer/  SmolLM2's tokenizer files from the converted embedded model (the 98 MB
#                    GGUF itself stays here): tests/integration/test_cuda_parity.py builds a
#                    random model around them.
# and prints its size (it must stay well under the 64 MiB a device call carries).
#
# PYTHON: the interpreter whose package versions are pinned (default: .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
DEST=.gpu
MAX_MIB=40

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"

# What the GPU image lacks: the closure of sluiceway's runtime requirements in this venv, less
# the packages the image has (KINDS.md's list for nvidia-h200, read 2026-11-17), but with
# protobuf, grpcio and typing-extensions at this venv's versions whatever the image holds.
mapfile -t pins < <("$PYTHON" - <<'PY'
import importlib.metadata as md
import re

from packaging.requirements import Requirement

IMAGE_HAS = {
    "torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "uvloop",
    "prometheus-client", "ninja", "huggingface-hub", "hf-xet", "filelock", "fsspec",
    "jinja2", "markupsafe", "networkx", "sympy", "mpmath", "packaging", "pyyaml", "regex",
    "requests", "certifi", "charset-normalizer", "idna", "urllib3", "tqdm", "anyio", "h11",
    "click", "sniffio", "setuptools", "annotated-doc", "typer", "shellingham", "rich",
    "markdown-it-py", "mdurl", "pygments", "httpx", "httpcore", "xxhash", "psutil",
}
FORCE = {"protobuf", "grpcio", "typing-extensions"}


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


seen, todo = set(), ["sluiceway"]
while todo:
    name = todo.pop()
    for text in md.requires(name) or []:
        req = Requirement(text)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        dep = norm(req.name)
        if dep in seen or dep.startswith("nvidia-") or (dep in IMAGE_HAS and dep not in FORCE):
            continue
        seen.add(dep)
        todo.append(dep)
for dep in sorted(seen):
    print(f"{dep}=={md.version(dep)}")
PY
)
echo "gpu_wheels: pinned from $PYTHON: ${pins[*]}"

rm -rf "$DEST/wheels" "$DEST/tokenizer"  # one version of each wheel, no stale files
mkdir -p "$DEST/wheels" "$DEST/tokenizer"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 \
    -d "$DEST/wheels" "${pins[@]}"

model_dir=$("$PYTHON" -c "from sluiceway.model_files import resolve_model; print(resolve_model(None))")
copied=()
for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja \
    generation_config.json; do
    if [ -f "$model_dir/$f" ]; then
        cp "$model_dir/$f" "$DEST/tokenizer/$f"
        copied+=("$f")
    fi
done
if [ ! -f "$DEST/tokenizer/tokenizer.json" ]; then
    echo "gpu_wheels: no tokenizer.json in $model_dir" >&2
    exit 1
fi
echo "gpu_wheels: tokenizer files from $model_dir: ${copied[*]}"

ls -l "$DEST/wheels"
size_kib=$(du -sk "$DEST" | cut -f1)
echo "gpu_wheels: $DEST is $((size_kib / 1024)) MiB ($size_kib KiB); carry it with carry: [\".gpu\"]"
if [ "$size_kib" -gt $((MAX_MIB * 1024)) ]; then
    echo "gpu_wheels: $DEST exceeds $MAX_MIB MiB" >&2
    exit 1
fi
