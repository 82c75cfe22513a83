from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class Slo(_message.Message):
    __slots__ = ("ttft_s", "tbt_s", "deadline_s")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TBT_S_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    tbt_s: float
    deadline_s: float
    def __init__(self, ttft_s: _Optional[float] = ..., tbt_s: _Optional[float] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("length", "source", "similarity", "neighbors")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SIMILARITY_FIELD_NUMBER: _ClassVar[int]
    NEIGHBORS_FIELD_NUMBER: _ClassVar[int]
    length: int
    source: str
    similarity: float
    neighbors: int
    def __init__(self, length: _Optional[int] = ..., source: _Optional[str] = ..., similarity: _Optional[float] = ..., neighbors: _Optional[int] = ...) -> None: ...
