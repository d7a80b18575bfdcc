from sluiceway.internal.v1 import scheduler_pb2 as _scheduler_pb2
from sluiceway.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrepareStructuredOutputsResponse(_message.Message):
    __slots__ = ("compile_seconds",)
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    compile_seconds: float
    def __init__(self, compile_seconds: _Optional[float] = ...) -> None: ...

class CopyBlocksRequest(_message.Message):
    __slots__ = ("source", "src_block_ids", "dst_block_ids")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    source: _scheduler_pb2.KvPoolHandle
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, source: _Optional[_Union[_scheduler_pb2.KvPoolHandle, _Mapping]] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CopyBlocksResponse(_message.Message):
    __slots__ = ("num_bytes", "seconds")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    seconds: float
    def __init__(self, num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "prompt_token_ids", "sampling", "request_id", "num_prompt_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _inference_pb2.SamplingParams
    request_id: str
    num_prompt_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_inference_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class ScheduledSequence(_message.Message):
    __slots__ = ("seq_id", "appended_token_ids", "num_computed_tokens", "num_new_tokens", "new_block_ids", "draft_token_ids", "num_draft_model_tokens", "append_last_sampled")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    APPENDED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_MODEL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPEND_LAST_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    appended_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_new_tokens: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_model_tokens: int
    append_last_sampled: bool
    def __init__(self, seq_id: _Optional[int] = ..., appended_token_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_new_tokens: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., num_draft_model_tokens: _Optional[int] = ..., append_last_sampled: _Optional[bool] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "new_sequences", "scheduled", "finished_seq_ids", "previous_step_id")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    scheduled: _containers.RepeatedCompositeFieldContainer[ScheduledSequence]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    previous_step_id: int
    def __init__(self, step_id: _Optional[int] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., scheduled: _Optional[_Iterable[_Union[ScheduledSequence, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., previous_step_id: _Optional[int] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprob", "top_token_ids", "top_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "sampled", "forward_seconds", "prepare_seconds", "sample_seconds", "step_seconds", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    forward_seconds: float
    prepare_seconds: float
    sample_seconds: float
    step_seconds: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., forward_seconds: _Optional[float] = ..., prepare_seconds: _Optional[float] = ..., sample_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "first_token_index", "logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    first_token_index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenLogprobs]
    def __init__(self, seq_id: _Optional[int] = ..., first_token_index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_inference_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...
