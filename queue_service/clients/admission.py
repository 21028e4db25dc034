"""Admission: turning a client's GenerateRequest into a request the system can queue, or a
precise gRPC status saying why not. Nothing here touches Kafka or the scheduler.

The tier never comes from the request body: it is the ``x-tierflow-tier`` metadata that the
edge (Envoy + the gateway's ext_authz) sets after checking the API key, overwriting whatever the
client sent. Without the edge (tests, a trusted network) the service trusts that header as is.

Request ids are scoped to the caller's key: the gateway sets ``x-tierflow-key-id`` (the key's
label, never the key) and the service names a request ``<label>/<request_id>`` everywhere
(Kafka, scheduler, workers, logs), so two keys that pick the same id hold two requests, and
one key never sees, joins or cancels another's. A client's id may not contain the separator
``/``, so a request without a key id (no edge), which keeps its id as it is, has a scope of
its own too: the names without a ``/``. No id a client can send names another scope's request.
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from dataclasses import dataclass

import grpc

from tierflow.tiers import KEY_ID_HEADER, KEY_WEIGHT_HEADER, MAX_KEY_WEIGHT, TIER_HEADER, TierTable
from tierflow.v1 import queue_pb2, serving_pb2

MAX_REQUEST_ID_LEN = 128
SCOPE_SEPARATOR = "/"
# The gateway's key labels (gateway/keys.py): never a "/", which separates scope and id.
_KEY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class AdmissionError(Exception):
    """A request refused before it is queued; carries the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class AdmissionLimits:
    max_prompt_tokens: int  # the served model's context minus room for one new token
    max_new_tokens: int = 4096
    max_timeout_ms: int = 3_600_000


@dataclass(frozen=True)
class Admitted:
    request_id: str
    tier: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    timeout_ms: int  # 0: none


def key_id_from_metadata(metadata: tuple[tuple[str, str | bytes], ...]) -> str:
    """The label of the key that sent the request ("" when it did not come through the edge)."""
    values = [v for k, v in metadata if k.lower() == KEY_ID_HEADER]
    if not values:
        return ""
    key_id = values[0].decode("utf-8", "replace") if isinstance(values[0], bytes) else values[0]
    if len(values) > 1 or not _KEY_ID.match(key_id):
        raise AdmissionError(
            grpc.StatusCode.INVALID_ARGUMENT, f"{KEY_ID_HEADER} must be one key label"
        )
    return key_id


def key_weight_from_metadata(metadata: tuple[tuple[str, str | bytes], ...]) -> float:
    """The key's share of its tier (1 when the request did not come through the edge)."""
    values = [v for k, v in metadata if k.lower() == KEY_WEIGHT_HEADER]
    if not values:
        return 1.0
    text = values[0].decode("utf-8", "replace") if isinstance(values[0], bytes) else values[0]
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if len(values) > 1 or not (0 < weight <= MAX_KEY_WEIGHT):
        raise AdmissionError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{KEY_WEIGHT_HEADER} must be one number in (0, {MAX_KEY_WEIGHT:g}]",
        )
    return weight


def scoped_request_id(key_id: str, request_id: str) -> str:
    """The service's name of a client's request: the id within its key's scope; without a key
    id, the id itself (``check_request_id`` keeps the separator out of a client's id, so the
    two never meet)."""
    return f"{key_id}{SCOPE_SEPARATOR}{request_id}" if key_id else request_id


def check_request_id(request_id: str) -> None:
    """A client's request id: printable, at most ``MAX_REQUEST_ID_LEN`` characters, and
    without the scope separator (an id with one could name another scope's request)."""
    if len(request_id) > MAX_REQUEST_ID_LEN or not request_id.isprintable():
        raise AdmissionError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request_id must be printable and at most {MAX_REQUEST_ID_LEN} characters",
        )
    if SCOPE_SEPARATOR in request_id:
        raise AdmissionError(
            grpc.StatusCode.INVALID_ARGUMENT, f"request_id must not contain {SCOPE_SEPARATOR!r}"
        )


def request_digest(record: queue_pb2.QueuedRequest) -> bytes:
    """What makes a retry the same request: its prompt and generation parameters (not its tier,
    deadline or arrival, nor who holds its stream)."""
    same = queue_pb2.QueuedRequest(
        prompt_ids=record.prompt_ids,
        max_new_tokens=record.max_new_tokens,
        sampling=record.sampling,
        stop_at_eos=record.stop_at_eos,
    )
    return hashlib.sha256(same.SerializeToString(deterministic=True)).digest()


def tier_from_metadata(metadata: tuple[tuple[str, str | bytes], ...], tiers: TierTable) -> str:
    values = [v for k, v in metadata if k.lower() == TIER_HEADER]
    if not values:
        raise AdmissionError(
            grpc.StatusCode.UNAUTHENTICATED,
            f"no {TIER_HEADER} header: requests must come through the edge with an API key",
        )
    if len(values) > 1:
        raise AdmissionError(grpc.StatusCode.INVALID_ARGUMENT, f"{TIER_HEADER} given twice")
    tier = values[0].decode() if isinstance(values[0], bytes) else values[0]
    if tier not in tiers:
        raise AdmissionError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"unknown tier {tier!r}; known tiers: {', '.join(tiers.names)}",
        )
    return tier


def admit(
    request: serving_pb2.GenerateRequest,
    tier: str,
    limits: AdmissionLimits,
    tokenize,
    vocab_size: int,
) -> Admitted:
    """Validate and tokenise. ``tokenize(text) -> list[int]`` is the served model's tokenizer."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    which = request.WhichOneof("prompt")
    if which == "text":
        if not request.text.strip():
            raise AdmissionError(invalid, "prompt is empty")
        prompt_ids = tuple(tokenize(request.text))
    elif which == "token_ids":
        prompt_ids = tuple(request.token_ids.ids)
        bad = [i for i in prompt_ids if i >= vocab_size]
        if bad:
            raise AdmissionError(invalid, f"token id {bad[0]} is outside the vocabulary")
    else:
        prompt_ids = ()
    if not prompt_ids:
        raise AdmissionError(invalid, "prompt is empty")
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else 1
    if not 1 <= max_new <= limits.max_new_tokens:
        raise AdmissionError(
            invalid, f"max_new_tokens must be in [1, {limits.max_new_tokens}], got {max_new}"
        )
    if len(prompt_ids) + max_new > limits.max_prompt_tokens + 1:
        raise AdmissionError(
            invalid,
            f"prompt of {len(prompt_ids)} tokens + {max_new} new tokens exceeds the model's "
            f"context of {limits.max_prompt_tokens + 1} tokens",
        )
    sampling = request.sampling
    temperature, top_p = sampling.temperature, sampling.top_p or 1.0
    if not (math.isfinite(temperature) and 0.0 <= temperature <= 100.0):
        raise AdmissionError(invalid, f"temperature must be in [0, 100], got {temperature}")
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise AdmissionError(invalid, f"top_p must be in (0, 1], got {top_p}")
    if request.timeout_ms > limits.max_timeout_ms:
        raise AdmissionError(
            invalid, f"timeout_ms {request.timeout_ms} is above {limits.max_timeout_ms}"
        )
    request_id = request.request_id or uuid.uuid4().hex
    check_request_id(request_id)
    return Admitted(
        request_id=request_id,
        tier=tier,
        prompt_ids=prompt_ids,
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        seed=sampling.seed,
        timeout_ms=request.timeout_ms,
    )
