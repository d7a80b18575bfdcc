"""The worker process's config. Each field is the flag of the same name (`sluiceway worker
--help`; `sluiceway.options`). Imports no torch: the CLI builds its parser from it."""

from __future__ import annotations

from dataclasses import dataclass

from sluiceway.argtypes import (
    QUANTIZATION_CHOICES,
    bounded_float,
    byte_size,
    non_negative_int,
    positive_int,
)
from sluiceway.options import (
    DEFAULT_SCHEDULER,
    LOG_FORMAT,
    LOG_LEVEL,
    MAX_MODEL_LEN,
    METRICS_HOST,
    MODEL,
    SERVED_MODEL_NAME,
    SPECULATIVE_CONFIG,
    TENSOR_PARALLEL_SIZE,
    ProcessConfig,
    metrics_port,
    option,
)


@dataclass(slots=True, kw_only=True)
class WorkerConfig(ProcessConfig):
    """One worker process: serves steps on `listen`, registers with `scheduler` (as
    `advertise`, default the bound address) as rank `rank` of model instance `worker_group`,
    and runs `model` on `device` with a KV pool of `kv_cache_memory` bytes (CPU) or
    `gpu_memory_utilization` of the GPU. `share_kv_pool`: the pool can be opened by peer
    workers (disaggregated prefill). `distributed_init_method`: the tensor-parallel
    rendezvous (tcp://HOST:PORT), needed when `tensor_parallel_size` > 1.

    Raises ValueError (naming the field) for a value out of its flag's range.
    """

    listen: str = option("127.0.0.1:0", "host:port (0 = a free port) or unix:PATH")
    advertise: str | None = option(None, "address the scheduler dials (default: --listen)")
    scheduler: str = option(DEFAULT_SCHEDULER, "scheduler address")
    worker_group: int = option(
        0,
        "which of the scheduler's model instances this worker belongs to (0; with "
        "--num-prefill-workers P on the scheduler, 0..P-1 prefill and the next ones decode)",
        type=non_negative_int,
    )
    share_kv_pool: bool = option(
        False,
        "allocate the KV pool so that peer workers can copy blocks out of it (POSIX "
        "shared memory on CPU, CUDA IPC on GPU); needed for disaggregated prefill",
    )
    rank: int = option(0, "tensor-parallel rank of this worker", type=non_negative_int)
    distributed_init_method: str | None = option(
        None,
        "torch.distributed rendezvous of the ranks, e.g. tcp://HOST:PORT (needed when "
        "--tensor-parallel-size > 1; default: none)",
    )
    tensor_parallel_size: int = TENSOR_PARALLEL_SIZE.field()
    model: str | None = MODEL.field()
    served_model_name: str | None = SERVED_MODEL_NAME.field()
    device: str = option(
        "auto", "auto: CUDA when torch sees a GPU, else CPU", choices=("auto", "cpu", "cuda")
    )
    dtype: str = option(
        "auto",
        "auto: bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16, else float32",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    quantization: str = option(
        "auto",
        "weights of a model converted from a GGUF file: gguf = kept in the file's quantized "
        "blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K), dequantized tile by tile in the GEMM: "
        "in bfloat16 the tokens of `none` bitwise, in float32 a fixed-order float32 GEMM; "
        "about a third of the weight memory (CPU with AVX512-BF16, the C++ kernels, one "
        "rank); gguf_a8 = the same blocks times int8 activations (each row quantized per 32 "
        "values, llama.cpp's CPU scheme; AVX512-VNNI dot products): faster decode at small "
        "batches, batch invariant, tokens of its own; none = the dequantized weights in "
        "--dtype; auto = gguf in bfloat16 where it can run, else none",
        choices=QUANTIZATION_CHOICES,
    )
    block_size: int = option(16, "tokens per KV block", type=positive_int)
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage (vLLM's flag): auto = the model's dtype; int8 = int8 values with a "
        "float32 scale per token and head (about 1.9x the blocks of bfloat16 in the same "
        "--kv-cache-memory, 3.8x float32's, at head_dim 64; attention reads half the bytes; "
        "with --attention-backend triton its batch-invariant kernel only); fp8_e4m3 = the "
        "same layout in float8 e4m3 (torch and cpu attention backends only)",
        choices=("auto", "int8", "fp8_e4m3"),
    )
    kv_cache_memory: int | None = option(
        None,
        "KV pool size on CPU, bytes or e.g. 4GiB (default 4GiB)",
        type=byte_size("no room for a KV block"),
    )
    gpu_memory_utilization: float = option(
        0.9,
        "fraction of GPU memory for weights, activations and the KV pool (CUDA)",
        type=bounded_float(0, 1, low_open=True),
    )
    num_threads: int | None = option(
        None,
        "torch CPU threads of the worker (default: every core; on a 2-core CPU 2 threads "
        "gave 617 vs 387 output tokens/s over 1, README Performance)",
        type=positive_int,
    )
    attention_backend: str = option(
        "auto",
        "paged attention and fused layer kernels: auto = Triton on CUDA, the C++ kernels "
        "(cpu) on CPU, the torch reference (torch) where those cannot be built",
        choices=("auto", "torch", "cpu", "triton"),
    )
    speculative_config: str = SPECULATIVE_CONFIG.field()  # (a draft_model's draft loads here)
    enforce_eager: bool = option(
        False, "never capture CUDA graphs for decode steps (vLLM's flag; CUDA only)"
    )
    max_model_len: int | None = MAX_MODEL_LEN.field()
    metrics_port: int = metrics_port(9402)
    metrics_host: str = METRICS_HOST.field()
    log_format: str = LOG_FORMAT.field()
    log_level: str = LOG_LEVEL.field()

    def __post_init__(self) -> None:
        self.check_options()
