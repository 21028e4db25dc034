"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status its clients act on (the SDKs raise a class per status and retry 429 and 5xx).

The document itself is ``tierflow.openai_errors`` (the gateway answers its 401s with it too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from tierflow.openai_errors import error_body


@dataclass
class OpenAIError(Exception):
    """A request refused or failed; rendered as ``error_body`` with ``status`` and ``headers``."""

    status: int
    message: str
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        return error_body(self.status, self.message, code=self.code, param=self.param)


def bad_request(message: str, *, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, code="invalid_request", param=param)


# The queue service's statuses (docs/api.md, "Error codes") as OpenAI statuses.
_FROM_GRPC: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "tier_not_allowed"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict"),
    grpc.StatusCode.ABORTED: (409, "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "queue_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def from_grpc(code: grpc.StatusCode, details: str | None, *, retry_after_s: int) -> OpenAIError:
    """The OpenAI error for a failed Generate call. A shed request (RESOURCE_EXHAUSTED) and an
    unreachable queue (UNAVAILABLE) say when to retry."""
    status, error_code = _FROM_GRPC.get(code, (500, "internal_error"))
    message = details or code.name.lower()
    if code is grpc.StatusCode.UNAVAILABLE:
        message = f"the request queue is unavailable: {message}"
    headers = {"retry-after": str(retry_after_s)} if status in (429, 503) else {}
    return OpenAIError(status, message, code=error_code, headers=headers)
