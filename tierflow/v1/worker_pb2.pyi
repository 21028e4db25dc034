from tierflow.v1 import serving_pb2 as _serving_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Assign(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "max_new_tokens", "sampling", "stop_at_eos", "tbt_slo_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_EOS_FIELD_NUMBER: _ClassVar[int]
    TBT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: _serving_pb2.SamplingParams
    stop_at_eos: bool
    tbt_slo_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_serving_pb2.SamplingParams, _Mapping]] = ..., stop_at_eos: _Optional[bool] = ..., tbt_slo_s: _Optional[float] = ...) -> None: ...

class AssignPacked(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Assign]
    def __init__(self, members: _Optional[_Iterable[_Union[Assign, _Mapping]]] = ...) -> None: ...

class PauseDecode(_message.Message):
    __slots__ = ("request_id", "drop_state")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DROP_STATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    drop_state: bool
    def __init__(self, request_id: _Optional[str] = ..., drop_state: _Optional[bool] = ...) -> None: ...

class Preempt(_message.Message):
    __slots__ = ("request_id", "drop_state")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DROP_STATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    drop_state: bool
    def __init__(self, request_id: _Optional[str] = ..., drop_state: _Optional[bool] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ControlMessage(_message.Message):
    __slots__ = ("assign", "preempt", "resume", "cancel", "drain", "assign_packed", "pause_decode")
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_PACKED_FIELD_NUMBER: _ClassVar[int]
    PAUSE_DECODE_FIELD_NUMBER: _ClassVar[int]
    assign: Assign
    preempt: Preempt
    resume: Resume
    cancel: Cancel
    drain: Drain
    assign_packed: AssignPacked
    pause_decode: PauseDecode
    def __init__(self, assign: _Optional[_Union[Assign, _Mapping]] = ..., preempt: _Optional[_Union[Preempt, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., assign_packed: _Optional[_Union[AssignPacked, _Mapping]] = ..., pause_decode: _Optional[_Union[PauseDecode, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("worker_id", "model", "device", "dtype", "num_layers", "max_positions", "chunk_size", "check", "memory_cap_bytes", "kv_slots", "max_batch_size", "slot_tokens", "preempt_budget_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    device: str
    dtype: str
    num_layers: int
    max_positions: int
    chunk_size: int
    check: str
    memory_cap_bytes: int
    kv_slots: int
    max_batch_size: int
    slot_tokens: int
    preempt_budget_ms: float
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., max_positions: _Optional[int] = ..., chunk_size: _Optional[int] = ..., check: _Optional[str] = ..., memory_cap_bytes: _Optional[int] = ..., kv_slots: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., slot_tokens: _Optional[int] = ..., preempt_budget_ms: _Optional[float] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("request_id", "tokens_done", "prompt_tokens", "layers_done", "num_layers", "chunk_end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DONE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_DONE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens_done: int
    prompt_tokens: int
    layers_done: int
    num_layers: int
    chunk_end: int
    def __init__(self, request_id: _Optional[str] = ..., tokens_done: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., layers_done: _Optional[int] = ..., num_layers: _Optional[int] = ..., chunk_end: _Optional[int] = ...) -> None: ...

class ResumePoint(_message.Message):
    __slots__ = ("chunk", "layer", "half", "tokens_done")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HALF_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DONE_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    layer: int
    half: int
    tokens_done: int
    def __init__(self, chunk: _Optional[int] = ..., layer: _Optional[int] = ..., half: _Optional[int] = ..., tokens_done: _Optional[int] = ...) -> None: ...

class Preempted(_message.Message):
    __slots__ = ("request_id", "resume_point", "held_bytes", "state_dropped", "latency_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_POINT_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    resume_point: ResumePoint
    held_bytes: int
    state_dropped: bool
    latency_ms: float
    def __init__(self, request_id: _Optional[str] = ..., resume_point: _Optional[_Union[ResumePoint, _Mapping]] = ..., held_bytes: _Optional[int] = ..., state_dropped: _Optional[bool] = ..., latency_ms: _Optional[float] = ...) -> None: ...

class WorkerFirstToken(_message.Message):
    __slots__ = ("request_id", "token_id", "prefill_busy_ms", "prompt_tokens", "pack_tokens", "pack_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BUSY_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACK_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    prefill_busy_ms: float
    prompt_tokens: int
    pack_tokens: int
    pack_size: int
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., prefill_busy_ms: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., pack_tokens: _Optional[int] = ..., pack_size: _Optional[int] = ...) -> None: ...

class WorkerToken(_message.Message):
    __slots__ = ("request_id", "token_id", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    index: int
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class DecodeStep(_message.Message):
    __slots__ = ("tokens", "step_ms", "slotted")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    SLOTTED_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[WorkerToken]
    step_ms: float
    slotted: bool
    def __init__(self, tokens: _Optional[_Iterable[_Union[WorkerToken, _Mapping]]] = ..., step_ms: _Optional[float] = ..., slotted: _Optional[bool] = ...) -> None: ...

class DecodeRejoined(_message.Message):
    __slots__ = ("request_id", "recomputed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    recomputed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., recomputed_tokens: _Optional[int] = ...) -> None: ...

class WorkerDone(_message.Message):
    __slots__ = ("request_id", "output_ids", "busy_ms", "preemptions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    BUSY_MS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    busy_ms: float
    preemptions: int
    def __init__(self, request_id: _Optional[str] = ..., output_ids: _Optional[_Iterable[int]] = ..., busy_ms: _Optional[float] = ..., preemptions: _Optional[int] = ...) -> None: ...

class WorkerCancelled(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class WorkerFailed(_message.Message):
    __slots__ = ("request_id", "error", "invalid_request")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INVALID_REQUEST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    error: str
    invalid_request: bool
    def __init__(self, request_id: _Optional[str] = ..., error: _Optional[str] = ..., invalid_request: _Optional[bool] = ...) -> None: ...

class Draining(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("suspended_bytes", "running_request_id")
    SUSPENDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    suspended_bytes: int
    running_request_id: str
    def __init__(self, suspended_bytes: _Optional[int] = ..., running_request_id: _Optional[str] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "progress", "preempted", "first_token", "token", "done", "cancelled", "failed", "heartbeat", "decode_step", "decode_rejoined", "draining")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_FIELD_NUMBER: _ClassVar[int]
    DECODE_REJOINED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    progress: Progress
    preempted: Preempted
    first_token: WorkerFirstToken
    token: WorkerToken
    done: WorkerDone
    cancelled: WorkerCancelled
    failed: WorkerFailed
    heartbeat: Heartbeat
    decode_step: DecodeStep
    decode_rejoined: DecodeRejoined
    draining: Draining
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., preempted: _Optional[_Union[Preempted, _Mapping]] = ..., first_token: _Optional[_Union[WorkerFirstToken, _Mapping]] = ..., token: _Optional[_Union[WorkerToken, _Mapping]] = ..., done: _Optional[_Union[WorkerDone, _Mapping]] = ..., cancelled: _Optional[_Union[WorkerCancelled, _Mapping]] = ..., failed: _Optional[_Union[WorkerFailed, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., decode_step: _Optional[_Union[DecodeStep, _Mapping]] = ..., decode_rejoined: _Optional[_Union[DecodeRejoined, _Mapping]] = ..., draining: _Optional[_Union[Draining, _Mapping]] = ...) -> None: ...
