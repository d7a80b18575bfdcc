from sluiceway.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AddRequestRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "parent_request_id", "output_token_ids", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PARENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _inference_pb2.SamplingParams
    parent_request_id: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_inference_pb2.SamplingParams, _Mapping]] = ..., parent_request_id: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "queue_seconds", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenLogprobs]
    finish_reason: _inference_pb2.FinishReason
    queue_seconds: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_inference_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_inference_pb2.FinishReason, str]] = ..., queue_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_inference_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class GetSchedulerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerInfo(_message.Message):
    __slots__ = ("ready", "model_id", "max_model_len", "block_size", "num_kv_blocks", "num_free_kv_blocks", "num_requests_running", "num_requests_waiting", "vocab_size", "kv_cache", "step_times")
    READY_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    model_id: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_requests_running: int
    num_requests_waiting: int
    vocab_size: int
    kv_cache: KvCacheStats
    step_times: _inference_pb2.StepTimes
    def __init__(self, ready: _Optional[bool] = ..., model_id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., num_requests_running: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., vocab_size: _Optional[int] = ..., kv_cache: _Optional[_Union[KvCacheStats, _Mapping]] = ..., step_times: _Optional[_Union[_inference_pb2.StepTimes, _Mapping]] = ...) -> None: ...

class KvCacheStats(_message.Message):
    __slots__ = ("utilization", "tokens_stored_total", "slots_allocated_total", "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total", "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total")
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_STORED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SLOTS_ALLOCATED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    utilization: float
    tokens_stored_total: int
    slots_allocated_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    num_preemptions_total: int
    spec_decode_num_drafts_total: int
    spec_decode_num_draft_tokens_total: int
    spec_decode_num_accepted_tokens_total: int
    def __init__(self, utilization: _Optional[float] = ..., tokens_stored_total: _Optional[int] = ..., slots_allocated_total: _Optional[int] = ..., prefix_cache_queries_total: _Optional[int] = ..., prefix_cache_hits_total: _Optional[int] = ..., num_preemptions_total: _Optional[int] = ..., spec_decode_num_drafts_total: _Optional[int] = ..., spec_decode_num_draft_tokens_total: _Optional[int] = ..., spec_decode_num_accepted_tokens_total: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("address", "rank", "model_id", "num_kv_blocks", "block_size", "max_model_len", "vocab_size", "worker_group", "tensor_parallel_size", "kv_pool", "worker_id", "batch_invariant", "has_draft_model", "draft_reads_model_kv")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_GROUP_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    HAS_DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_READS_MODEL_KV_FIELD_NUMBER: _ClassVar[int]
    address: str
    rank: int
    model_id: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    worker_group: int
    tensor_parallel_size: int
    kv_pool: KvPoolHandle
    worker_id: str
    batch_invariant: bool
    has_draft_model: bool
    draft_reads_model_kv: bool
    def __init__(self, address: _Optional[str] = ..., rank: _Optional[int] = ..., model_id: _Optional[str] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., worker_group: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., kv_pool: _Optional[_Union[KvPoolHandle, _Mapping]] = ..., worker_id: _Optional[str] = ..., batch_invariant: _Optional[bool] = ..., has_draft_model: _Optional[bool] = ..., draft_reads_model_kv: _Optional[bool] = ...) -> None: ...

class KvPoolHandle(_message.Message):
    __slots__ = ("shm_path", "cuda_ipc_handle", "shape", "dtype", "device_index", "owner")
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    shm_path: str
    cuda_ipc_handle: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device_index: int
    owner: str
    def __init__(self, shm_path: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device_index: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("max_model_len",)
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    max_model_len: int
    def __init__(self, max_model_len: _Optional[int] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("reset", "stored", "removed", "block_size")
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    def __init__(self, reset: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ...) -> None: ...
