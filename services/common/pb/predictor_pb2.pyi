from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PredictRequest(_message.Message):
    __slots__ = ("model", "prompts", "temperature")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompts: _containers.RepeatedScalarFieldContainer[str]
    temperature: float
    def __init__(self, model: _Optional[str] = ..., prompts: _Optional[_Iterable[str]] = ..., temperature: _Optional[float] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("predictions",)
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    predictions: _containers.RepeatedCompositeFieldContainer[_common_pb2.Prediction]
    def __init__(self, predictions: _Optional[_Iterable[_Union[_common_pb2.Prediction, _Mapping]]] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("request_id", "prompt", "true_length", "censored")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TRUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CENSORED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    true_length: int
    censored: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., true_length: _Optional[int] = ..., censored: _Optional[bool] = ...) -> None: ...

class ObserveRequest(_message.Message):
    __slots__ = ("model", "observations", "temperature")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    model: str
    observations: _containers.RepeatedCompositeFieldContainer[Observation]
    temperature: float
    def __init__(self, model: _Optional[str] = ..., observations: _Optional[_Iterable[_Union[Observation, _Mapping]]] = ..., temperature: _Optional[float] = ...) -> None: ...

class ObserveResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...
