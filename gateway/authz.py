"""Envoy's external authorization (``envoy.service.auth.v3.Authorization/Check``): key -> tier.

Envoy calls Check for every request before routing it. A known key, sent as ``x-api-key`` or
as ``Authorization: Bearer <key>`` (what OpenAI's clients send), is allowed, with header
mutations that Envoy applies to the request it forwards:

* ``x-tierflow-tier: <tier>`` is SET, overwriting any value the client sent: the tier comes
  from who sent the request, never from the request itself (the queue service trusts it).
* ``x-tierflow-key-id: <label>`` is SET to the key's label from the keys file (never the key),
  for the request log, tenant scoping and the edge's per-key rate limit.
* ``x-tierflow-key-weight: <weight>`` is SET to the key's share of its tier (``weight`` in the
  keys file, 1 by default): the scheduler's fair order between the keys of a tier.
* ``x-api-key`` and ``authorization`` are removed, so the key never reaches an upstream or its
  logs.

Envoy then re-evaluates the route (its ext_authz filter clears the route cache), so the per-tier
routes (timeouts, rate limits) match on the header set here. A missing or unknown key is denied
with HTTP 401, which Envoy answers to a gRPC client as grpc-status 16 (UNAUTHENTICATED); on the
OpenAI-compatible paths the 401 carries OpenAI's JSON error body instead of plain text.

Logs carry the tier, the key's label and a fingerprint (8 hex characters of its hash), never
the key.
"""

from __future__ import annotations

import grpc
import structlog
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.rpc import code_pb2, status_pb2

from gateway.keys import KeyStore, key_fingerprint
from gateway.metrics import GatewayMetrics
from tierflow.identity import Identity, Role, peer_identity
from tierflow.openai_errors import error_json
from tierflow.tiers import API_KEY_HEADER, KEY_ID_HEADER, KEY_WEIGHT_HEADER, TIER_HEADER

log = structlog.get_logger("gateway.authz")

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# RFC 9110 wants a challenge with a 401; there is no registered scheme for API-key headers.
_CHALLENGE = f'ApiKey realm="tierflow", header="{API_KEY_HEADER}"'
_BEARER_CHALLENGE = 'Bearer realm="tierflow"'
AUTHORIZATION_HEADER = "authorization"
# The OpenAI-compatible API's paths (openai_api/, routed to it by envoy/envoy.yaml).
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


def _header(http: attribute_context_pb2.AttributeContext.HttpRequest, name: str) -> str | None:
    """A request header from the CheckRequest: Envoy sends a plain map by default and a
    HeaderMap when ``encode_raw_headers`` is on; both are read. Names are lower-case."""
    value = http.headers.get(name)
    if value is not None:
        return value
    for entry in http.header_map.headers:
        if entry.key.lower() == name:
            return entry.value or entry.raw_value.decode("utf-8", "replace")
    return None


def presented_key(http: attribute_context_pb2.AttributeContext.HttpRequest) -> str | None:
    """The key in ``x-api-key``, else in ``Authorization: Bearer <key>``.

    Whitespace around the key is not part of it, on every path: HTTP/1.1's parser (Envoy's
    codec) drops it from a header value before this sees it, HTTP/2 (gRPC, JSON over h2)
    passes it on, so it is stripped here too. A key itself never contains whitespace
    (``gateway.keys.hash_key``), so nothing is lost."""
    key = (_header(http, API_KEY_HEADER) or "").strip()
    if key:
        return key
    scheme, _, credentials = (_header(http, AUTHORIZATION_HEADER) or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credentials.strip() or None


def is_openai_path(path: str) -> bool:
    path = path.split("?", 1)[0]
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS)


def allow(tier: str, key_id: str = "", weight: float = 1.0) -> external_auth_pb2.CheckResponse:
    set_headers = {TIER_HEADER: tier, KEY_WEIGHT_HEADER: f"{weight:g}"}
    if key_id:
        set_headers[KEY_ID_HEADER] = key_id
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.OK),
        ok_response=external_auth_pb2.OkHttpResponse(
            headers=[
                base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=name, value=value),
                    append_action=_OVERWRITE,
                )
                for name, value in set_headers.items()
            ],
            headers_to_remove=[API_KEY_HEADER, AUTHORIZATION_HEADER],
        ),
    )


def deny(message: str, *, openai: bool = False) -> external_auth_pb2.CheckResponse:
    # The HTTP status is what a JSON client sees; Envoy maps 401 to grpc-status UNAUTHENTICATED
    # for a gRPC client, with the body as grpc-message. OpenAI's clients get their error shape.
    headers = {"www-authenticate": _BEARER_CHALLENGE if openai else _CHALLENGE}
    if openai:
        headers["content-type"] = "application/json"
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.UNAUTHENTICATED, message=message),
        denied_response=external_auth_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=http_status_pb2.Unauthorized),
            headers=[
                base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=name, value=value), append_action=_OVERWRITE
                )
                for name, value in headers.items()
            ],
            body=error_json(401, message, code="invalid_api_key") if openai else message,
        ),
    )


class Authorizer(external_auth_pb2_grpc.AuthorizationServicer):
    """Answers Envoy's Check from a KeyStore."""

    def __init__(
        self, keys: KeyStore, metrics: GatewayMetrics | None = None, *, mtls: bool = False
    ) -> None:
        self.keys = keys
        self.metrics = metrics or GatewayMetrics("")
        # Under mTLS only Envoy may ask: to anyone else the gateway would be an oracle that
        # says which keys are valid and what tier each buys.
        self.mtls = mtls

    async def Check(
        self, request: external_auth_pb2.CheckRequest, context: grpc.aio.ServicerContext
    ) -> external_auth_pb2.CheckResponse:
        peer = peer_identity(context) if self.mtls else None
        if self.mtls and peer != Identity(Role.EDGE):
            who = f"identity {peer.common_name!r}" if peer else "a peer without an identity"
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{who} is not the edge")
        http = request.attributes.request.http
        presented = presented_key(http)
        where = {"method": http.method, "path": http.path, "envoy_request_id": http.id or None}
        openai = is_openai_path(http.path)
        if not presented:
            log.info("denied", reason="no key", **where)
            self.metrics.decided("", False, "no key")
            return deny(
                f"missing API key: send it in the {API_KEY_HEADER} header or as "
                "'Authorization: Bearer <key>'",
                openai=openai,
            )
        key = self.keys.lookup(presented)
        if key is None:
            # The fingerprint of an unknown key helps match a client's report to this line.
            log.info("denied", reason="unknown key", key_fp=key_fingerprint(presented), **where)
            self.metrics.decided("", False, "unknown key")
            return deny("unknown API key", openai=openai)
        log.info("allowed", tier=key.tier, key=key.name, key_fp=key.fingerprint, **where)
        self.metrics.decided(key.tier, True, "key")
        return allow(key.tier, key.name, key.weight)
