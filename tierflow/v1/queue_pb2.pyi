from tierflow.v1 import serving_pb2 as _serving_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QueuedRequest(_message.Message):
    __slots__ = ("request_id", "tier", "prompt_ids", "max_new_tokens", "sampling", "stop_at_eos", "arrival_unix_ms", "deadline_unix_ms", "reply_to", "key_id", "requested_tier", "key_weight", "admission_predicted_ttft_s", "key_over_share")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_EOS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_TIER_FIELD_NUMBER: _ClassVar[int]
    KEY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    KEY_OVER_SHARE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tier: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: _serving_pb2.SamplingParams
    stop_at_eos: bool
    arrival_unix_ms: int
    deadline_unix_ms: int
    reply_to: str
    key_id: str
    requested_tier: str
    key_weight: float
    admission_predicted_ttft_s: float
    key_over_share: bool
    def __init__(self, request_id: _Optional[str] = ..., tier: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_serving_pb2.SamplingParams, _Mapping]] = ..., stop_at_eos: _Optional[bool] = ..., arrival_unix_ms: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., reply_to: _Optional[str] = ..., key_id: _Optional[str] = ..., requested_tier: _Optional[str] = ..., key_weight: _Optional[float] = ..., admission_predicted_ttft_s: _Optional[float] = ..., key_over_share: _Optional[bool] = ...) -> None: ...

class ReplyRecord(_message.Message):
    __slots__ = ("request_id", "event", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    event: _serving_pb2.GenerateEvent
    error: ReplyError
    def __init__(self, request_id: _Optional[str] = ..., event: _Optional[_Union[_serving_pb2.GenerateEvent, _Mapping]] = ..., error: _Optional[_Union[ReplyError, _Mapping]] = ...) -> None: ...

class ReplyError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class FinishedRequest(_message.Message):
    __slots__ = ("request_id", "tier", "key_id", "prompt_tokens", "output_tokens", "arrival_unix_ms", "finished_unix_ms", "ttft_ms", "tbt_ms", "preemptions", "status", "deployment", "policy", "slo_ms", "worker_id", "tbt_p99_ms", "tbt_slo_ms", "requested_tier")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_MS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SLO_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TBT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_TIER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tier: str
    key_id: str
    prompt_tokens: int
    output_tokens: int
    arrival_unix_ms: int
    finished_unix_ms: int
    ttft_ms: float
    tbt_ms: float
    preemptions: int
    status: str
    deployment: str
    policy: str
    slo_ms: float
    worker_id: str
    tbt_p99_ms: float
    tbt_slo_ms: float
    requested_tier: str
    def __init__(self, request_id: _Optional[str] = ..., tier: _Optional[str] = ..., key_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., arrival_unix_ms: _Optional[int] = ..., finished_unix_ms: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., tbt_ms: _Optional[float] = ..., preemptions: _Optional[int] = ..., status: _Optional[str] = ..., deployment: _Optional[str] = ..., policy: _Optional[str] = ..., slo_ms: _Optional[float] = ..., worker_id: _Optional[str] = ..., tbt_p99_ms: _Optional[float] = ..., tbt_slo_ms: _Optional[float] = ..., requested_tier: _Optional[str] = ...) -> None: ...

class TierCapacity(_message.Message):
    __slots__ = ("tier", "instance_id", "as_of_unix_ms", "workers", "committed_s", "switch_s", "margin", "coefficients", "calibrated", "counted_through_unix_ms", "keys", "error_s", "busy_share", "reference_coefficients")
    class CountedThroughUnixMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIER_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    AS_OF_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_S_FIELD_NUMBER: _ClassVar[int]
    SWITCH_S_FIELD_NUMBER: _ClassVar[int]
    MARGIN_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATED_FIELD_NUMBER: _ClassVar[int]
    COUNTED_THROUGH_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ERROR_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_SHARE_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    instance_id: str
    as_of_unix_ms: int
    workers: int
    committed_s: float
    switch_s: float
    margin: float
    coefficients: _containers.RepeatedScalarFieldContainer[float]
    calibrated: bool
    counted_through_unix_ms: _containers.ScalarMap[str, int]
    keys: _containers.RepeatedCompositeFieldContainer[KeyCapacity]
    error_s: float
    busy_share: float
    reference_coefficients: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tier: _Optional[str] = ..., instance_id: _Optional[str] = ..., as_of_unix_ms: _Optional[int] = ..., workers: _Optional[int] = ..., committed_s: _Optional[float] = ..., switch_s: _Optional[float] = ..., margin: _Optional[float] = ..., coefficients: _Optional[_Iterable[float]] = ..., calibrated: _Optional[bool] = ..., counted_through_unix_ms: _Optional[_Mapping[str, int]] = ..., keys: _Optional[_Iterable[_Union[KeyCapacity, _Mapping]]] = ..., error_s: _Optional[float] = ..., busy_share: _Optional[float] = ..., reference_coefficients: _Optional[_Iterable[float]] = ...) -> None: ...

class KeyCapacity(_message.Message):
    __slots__ = ("key_id", "weight", "committed_s", "error_s", "running_s", "over_share", "lead_s")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_S_FIELD_NUMBER: _ClassVar[int]
    RUNNING_S_FIELD_NUMBER: _ClassVar[int]
    OVER_SHARE_FIELD_NUMBER: _ClassVar[int]
    LEAD_S_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    weight: float
    committed_s: float
    error_s: float
    running_s: float
    over_share: bool
    lead_s: float
    def __init__(self, key_id: _Optional[str] = ..., weight: _Optional[float] = ..., committed_s: _Optional[float] = ..., error_s: _Optional[float] = ..., running_s: _Optional[float] = ..., over_share: _Optional[bool] = ..., lead_s: _Optional[float] = ...) -> None: ...
