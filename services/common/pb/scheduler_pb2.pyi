from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "priority", "slo", "prediction", "resume_from", "model", "subscription")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    priority: int
    slo: _common_pb2.Slo
    prediction: _common_pb2.Prediction
    resume_from: int
    model: str
    subscription: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., priority: _Optional[int] = ..., slo: _Optional[_Union[_common_pb2.Slo, _Mapping]] = ..., prediction: _Optional[_Union[_common_pb2.Prediction, _Mapping]] = ..., resume_from: _Optional[int] = ..., model: _Optional[str] = ..., subscription: _Optional[str] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("subscription",)
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    def __init__(self, subscription: _Optional[str] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[TokenEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[TokenEvent, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "queue_time_s", "ttft_s", "e2e_s", "num_preemptions", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    queue_time_s: float
    ttft_s: float
    e2e_s: float
    num_preemptions: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., queue_time_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("request_id", "index", "token_id", "logprob", "time", "finished", "finish_reason", "usage", "error", "prediction", "top_logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_id: int
    logprob: float
    time: float
    finished: bool
    finish_reason: str
    usage: Usage
    error: str
    prediction: _common_pb2.Prediction
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptLogprob]
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., time: _Optional[float] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[str] = ..., prediction: _Optional[_Union[_common_pb2.Prediction, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PromptLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorStats(_message.Message):
    __slots__ = ("address", "up", "num_device_blocks", "free_device_blocks", "num_host_blocks", "free_host_blocks", "running", "swapped", "cached_device_blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    CACHED_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    up: bool
    num_device_blocks: int
    free_device_blocks: int
    num_host_blocks: int
    free_host_blocks: int
    running: int
    swapped: int
    cached_device_blocks: int
    def __init__(self, address: _Optional[str] = ..., up: _Optional[bool] = ..., num_device_blocks: _Optional[int] = ..., free_device_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., free_host_blocks: _Optional[int] = ..., running: _Optional[int] = ..., swapped: _Optional[int] = ..., cached_device_blocks: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("policy", "waiting", "running", "swapped", "finished", "aborted", "preemptions", "executors", "model", "max_model_len", "max_kv_tokens", "outstanding_work_s", "shard", "num_shards")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_WORK_S_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    waiting: int
    running: int
    swapped: int
    finished: int
    aborted: int
    preemptions: int
    executors: _containers.RepeatedCompositeFieldContainer[ExecutorStats]
    model: str
    max_model_len: int
    max_kv_tokens: int
    outstanding_work_s: float
    shard: int
    num_shards: int
    def __init__(self, policy: _Optional[str] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., swapped: _Optional[int] = ..., finished: _Optional[int] = ..., aborted: _Optional[int] = ..., preemptions: _Optional[int] = ..., executors: _Optional[_Iterable[_Union[ExecutorStats, _Mapping]]] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., max_kv_tokens: _Optional[int] = ..., outstanding_work_s: _Optional[float] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ...) -> None: ...
