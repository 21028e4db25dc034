"""The OpenAI error document, ``{"error": {"message", "type", "param", "code"}}``: part of the
edge contract, shared by the gateway (the 401s it answers on the OpenAI paths) and the
OpenAI-compatible service, so that every error a client of those paths sees has one shape."""

from __future__ import annotations

import json

# The error ``type`` per HTTP status, as OpenAI names them.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None):
    """The JSON document of an error answered with HTTP ``status``."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_json(status: int, message: str, *, code: str | None = None) -> str:
    return json.dumps(error_body(status, message, code=code))
