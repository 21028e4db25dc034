from google.api import annotations_pb2 as _annotations_pb2
from google.rpc import code_pb2 as _code_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "max_new_tokens", "sampling", "request_id", "timeout_ms")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    max_new_tokens: int
    sampling: SamplingParams
    request_id: str
    timeout_ms: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("request_id", "queued", "progress", "first_token", "token", "done", "error", "waiting", "still_waiting")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    STILL_WAITING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    queued: Queued
    progress: PrefillProgress
    first_token: FirstToken
    token: Token
    done: Done
    error: StreamError
    waiting: Waiting
    still_waiting: StillWaiting
    def __init__(self, request_id: _Optional[str] = ..., queued: _Optional[_Union[Queued, _Mapping]] = ..., progress: _Optional[_Union[PrefillProgress, _Mapping]] = ..., first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., token: _Optional[_Union[Token, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ..., waiting: _Optional[_Union[Waiting, _Mapping]] = ..., still_waiting: _Optional[_Union[StillWaiting, _Mapping]] = ...) -> None: ...

class StillWaiting(_message.Message):
    __slots__ = ("waited_ms",)
    WAITED_MS_FIELD_NUMBER: _ClassVar[int]
    waited_ms: int
    def __init__(self, waited_ms: _Optional[int] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("tier", "position", "prompt_tokens", "deployment", "requested_tier")
    TIER_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_TIER_FIELD_NUMBER: _ClassVar[int]
    tier: str
    position: int
    prompt_tokens: int
    deployment: str
    requested_tier: str
    def __init__(self, tier: _Optional[str] = ..., position: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., deployment: _Optional[str] = ..., requested_tier: _Optional[str] = ...) -> None: ...

class Waiting(_message.Message):
    __slots__ = ("reason", "unavailable_in_ms")
    REASON_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_IN_MS_FIELD_NUMBER: _ClassVar[int]
    reason: str
    unavailable_in_ms: int
    def __init__(self, reason: _Optional[str] = ..., unavailable_in_ms: _Optional[int] = ...) -> None: ...

class PrefillProgress(_message.Message):
    __slots__ = ("tokens_done", "prompt_tokens", "preemptions")
    TOKENS_DONE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    tokens_done: int
    prompt_tokens: int
    preemptions: int
    def __init__(self, tokens_done: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "text", "ttft_ms")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    ttft_ms: float
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., ttft_ms: _Optional[float] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("token_id", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_wait_ms", "prefill_ms", "suspended_ms", "ttft_ms", "total_ms", "preemptions")
    QUEUE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    SUSPENDED_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    queue_wait_ms: float
    prefill_ms: float
    suspended_ms: float
    ttft_ms: float
    total_ms: float
    preemptions: int
    def __init__(self, queue_wait_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., suspended_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., preemptions: _Optional[int] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("usage", "timings", "text", "finish_reason")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    usage: Usage
    timings: Timings
    text: str
    finish_reason: str
    def __init__(self, usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: _code_pb2.Code
    message: str
    def __init__(self, code: _Optional[_Union[_code_pb2.Code, str]] = ..., message: _Optional[str] = ...) -> None: ...

class GetRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("request_id", "tier", "state", "usage", "timings", "text", "error", "requested_tier")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[RequestStatus.State]
        QUEUED: _ClassVar[RequestStatus.State]
        RUNNING: _ClassVar[RequestStatus.State]
        SUSPENDED: _ClassVar[RequestStatus.State]
        DONE: _ClassVar[RequestStatus.State]
        FAILED: _ClassVar[RequestStatus.State]
        CANCELLED: _ClassVar[RequestStatus.State]
        REJECTED: _ClassVar[RequestStatus.State]
    STATE_UNSPECIFIED: RequestStatus.State
    QUEUED: RequestStatus.State
    RUNNING: RequestStatus.State
    SUSPENDED: RequestStatus.State
    DONE: RequestStatus.State
    FAILED: RequestStatus.State
    CANCELLED: RequestStatus.State
    REJECTED: RequestStatus.State
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_TIER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tier: str
    state: RequestStatus.State
    usage: Usage
    timings: Timings
    text: str
    error: str
    requested_tier: str
    def __init__(self, request_id: _Optional[str] = ..., tier: _Optional[str] = ..., state: _Optional[_Union[RequestStatus.State, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., text: _Optional[str] = ..., error: _Optional[str] = ..., requested_tier: _Optional[str] = ...) -> None: ...
