from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorInfo(_message.Message):
    __slots__ = ("model", "architecture", "dtype", "kv_dtype", "max_model_len", "block_size", "bytes_per_block", "num_device_blocks", "num_host_blocks", "device", "vocab_size", "eos_token_ids", "profile_json", "instance_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_JSON_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    dtype: str
    kv_dtype: str
    max_model_len: int
    block_size: int
    bytes_per_block: int
    num_device_blocks: int
    num_host_blocks: int
    device: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    profile_json: str
    instance_id: str
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., num_device_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., device: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., profile_json: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "num_output_tokens", "num_cached_tokens", "max_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    num_output_tokens: int
    num_cached_tokens: int
    max_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_output_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class BlockTableUpdate(_message.Message):
    __slots__ = ("request_id", "block_ids", "replace")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    replace: bool
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., replace: _Optional[bool] = ...) -> None: ...

class ScheduledTokens(_message.Message):
    __slots__ = ("request_id", "num_new_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_new_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., num_new_tokens: _Optional[int] = ...) -> None: ...

class BlockMapping(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "new_requests", "block_tables", "scheduled", "swap_out", "swap_in", "free_request_ids", "epoch")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    FREE_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    block_tables: _containers.RepeatedCompositeFieldContainer[BlockTableUpdate]
    scheduled: _containers.RepeatedCompositeFieldContainer[ScheduledTokens]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockMapping]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockMapping]
    free_request_ids: _containers.RepeatedScalarFieldContainer[str]
    epoch: int
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., block_tables: _Optional[_Iterable[_Union[BlockTableUpdate, _Mapping]]] = ..., scheduled: _Optional[_Iterable[_Union[ScheduledTokens, _Mapping]]] = ..., swap_out: _Optional[_Iterable[_Union[BlockMapping, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockMapping, _Mapping]]] = ..., free_request_ids: _Optional[_Iterable[str]] = ..., epoch: _Optional[int] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("request_id", "token_id", "logprob", "top")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[_common_pb2.TopLogprob, _Mapping]]] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("forward_s", "sample_s", "swap_wait_s", "total_s")
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_S_FIELD_NUMBER: _ClassVar[int]
    SWAP_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    forward_s: float
    sample_s: float
    swap_wait_s: float
    total_s: float
    def __init__(self, forward_s: _Optional[float] = ..., sample_s: _Optional[float] = ..., swap_wait_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled", "timings", "num_prefill_tokens", "num_decode_tokens", "prompt_logprobs", "forecasts")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORECASTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    timings: StepTimings
    num_prefill_tokens: int
    num_decode_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    forecasts: _containers.RepeatedCompositeFieldContainer[RemainingForecast]
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., num_prefill_tokens: _Optional[int] = ..., num_decode_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., forecasts: _Optional[_Iterable[_Union[RemainingForecast, _Mapping]]] = ...) -> None: ...

class RemainingForecast(_message.Message):
    __slots__ = ("request_id", "generated", "q10", "q50", "q90", "p_cap")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    Q10_FIELD_NUMBER: _ClassVar[int]
    Q50_FIELD_NUMBER: _ClassVar[int]
    Q90_FIELD_NUMBER: _ClassVar[int]
    P_CAP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generated: int
    q10: float
    q50: float
    q90: float
    p_cap: float
    def __init__(self, request_id: _Optional[str] = ..., generated: _Optional[int] = ..., q10: _Optional[float] = ..., q50: _Optional[float] = ..., q90: _Optional[float] = ..., p_cap: _Optional[float] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("request_id", "start", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start: int
    tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptLogprob]
    def __init__(self, request_id: _Optional[str] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[_common_pb2.PromptLogprob, _Mapping]]] = ...) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ("quick",)
    QUICK_FIELD_NUMBER: _ClassVar[int]
    quick: bool
    def __init__(self, quick: _Optional[bool] = ...) -> None: ...

class ProfileResult(_message.Message):
    __slots__ = ("profile_json",)
    PROFILE_JSON_FIELD_NUMBER: _ClassVar[int]
    profile_json: str
    def __init__(self, profile_json: _Optional[str] = ...) -> None: ...
