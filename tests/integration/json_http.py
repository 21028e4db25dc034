"""JSON over HTTP/1.1 through the edge, the way a plain JSON client calls the API."""

from __future__ import annotations

import http.client
import json


def post_generate(
    port: int, key: str | None, body: dict, *, timeout: float = 120.0
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST ``body`` to /v1/generate on 127.0.0.1:``port`` with ``key`` (None: no key); returns
    the connection (the caller closes it) and the response, whose body is not read yet."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/v1/generate",
            body=json.dumps(body),
            headers={"content-type": "application/json"} | ({"x-api-key": key} if key else {}),
        )
        return conn, conn.getresponse()
    except BaseException:
        conn.close()
        raise
