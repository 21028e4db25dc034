"""The gateway: keys file parsing and validation, reloads, and Check() over a real grpc.aio server
(Envoy's own ext_authz API, from xds-protos), plus the process's SIGHUP and SIGTERM handling."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc
from structlog.testing import capture_logs

from gateway.authz import Authorizer, is_openai_path
from gateway.demo_keys import DEMO_KEYS
from gateway.keys import KeyStore, hash_key, load_keys, loads_keys
from launch.processes import REPO, free_port
from tests.integration.processes import start_gateway
from tierflow.tiers import load_tiers, loads_tiers

TIERS = loads_tiers(
    """
[tiers.critical]
rank = 0
ttft_slo_s = 1.0
[tiers.batch]
rank = 1
ttft_slo_s = 60.0
"""
)
KEY_A = "key-a-0123456789abcdef"
KEY_B = "key-b-0123456789abcdef"


def entry(name: str, key: str, tier: str) -> str:
    return f'[keys.{name}]\nsha256 = "{hash_key(key)}"\ntier = "{tier}"\n'


# ---------------------------------------------------------------- keys file


def test_hash_key_is_sha256_hex_and_refuses_unfit_keys():
    assert hash_key(KEY_A) == hashlib.sha256(KEY_A.encode()).hexdigest()
    for bad in ("short", "has a space in it!!", "ünïcode-key-0123456789", ""):
        with pytest.raises(ValueError, match="an API key must"):
            hash_key(bad)


def test_shipped_keys_file_hashes_the_demo_keys_to_their_tiers():
    table = load_keys(REPO / "config" / "keys.toml", load_tiers(REPO / "config" / "tiers.toml"))
    assert len(table) == 3
    for tier, key in DEMO_KEYS.items():
        assert table.lookup(key).tier == tier
    text = (REPO / "config" / "keys.toml").read_text()
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    for key in DEMO_KEYS.values():
        assert key not in body  # plaintext only in comments


def test_lookup():
    table = loads_keys(entry("a", KEY_A, "critical") + entry("b", KEY_B, "batch"), TIERS)
    assert table.lookup(KEY_A).tier == "critical" and table.lookup(KEY_A).name == "a"
    assert table.lookup(KEY_B).tier == "batch"
    assert table.lookup(KEY_A + "x") is None
    assert table.lookup("") is None and table.lookup(None) is None
    assert table.lookup(KEY_A).fingerprint == hash_key(KEY_A)[:8]


def test_a_key_has_weight_1_unless_the_file_gives_its_share():
    table = loads_keys(
        entry("a", KEY_A, "critical") + "weight = 2.5\n" + entry("b", KEY_B, "batch"), TIERS
    )
    assert table.lookup(KEY_A).weight == 2.5 and table.lookup(KEY_B).weight == 1.0


def test_upper_case_hash_is_accepted():
    text = f'[keys.a]\nsha256 = "{hash_key(KEY_A).upper()}"\ntier = "batch"\n'
    assert loads_keys(text, TIERS).lookup(KEY_A).tier == "batch"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (entry("a", KEY_A, "gold"), "tier 'gold' is not in the tier table (known tiers: critical"),
        (entry("a", KEY_A, "critical") + entry("b", KEY_A, "batch"), "same sha256"),
        (f'[keys.a]\nsha256 = "{KEY_A}"\ntier = "batch"\n', "sha256 must be 64 hex"),
        ('[keys.a]\nsha256 = "abc"\ntier = "batch"\n', "sha256 must be 64 hex"),
        (f'[keys.a]\nsha256 = "{hash_key(KEY_A)}"\n', "missing field(s) ['tier']"),
        (entry("a", KEY_A, "batch") + 'owner = "x"\n', "unknown field(s) ['owner']"),
        (entry("a", KEY_A, "batch") + "weight = 0\n", "weight must be a number in (0, 1000]"),
        (entry("a", KEY_A, "batch") + 'weight = "2"\n', "weight must be a number in (0, 1000]"),
        ("[keys.a]\nsha256 = ", "invalid TOML"),
        ("", "no [keys.<name>] tables"),
        (entry("a", KEY_A, "batch").replace("[keys.", "[key."), "unknown top-level key(s)"),
        ('[keys]\na = "x"\n', "must be a table"),
    ],
)
def test_invalid_keys_files_are_refused_clearly(text, message):
    with pytest.raises(ValueError) as err:
        loads_keys(text, TIERS, source="k.toml")
    assert message in str(err.value) and str(err.value).startswith("k.toml")
    assert KEY_A not in str(err.value)  # a pasted plaintext key never lands in an error


def test_a_tiers_table_in_the_same_file_is_tolerated():
    text = "[tiers.critical]\nrank = 0\nttft_slo_s = 1.0\n" + entry("a", KEY_A, "critical")
    assert loads_keys(text, TIERS).lookup(KEY_A).tier == "critical"


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="keys file not found"):
        load_keys("/nonexistent/keys.toml", TIERS)


# ---------------------------------------------------------------- reloads


def test_store_reloads_when_the_file_changes(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(entry("a", KEY_A, "critical"))
    store = KeyStore(path, TIERS, check_interval_s=0)
    assert store.lookup(KEY_A).tier == "critical" and store.lookup(KEY_B) is None
    path.write_text(entry("a", KEY_A, "batch") + entry("b", KEY_B, "critical"))
    assert store.lookup(KEY_A).tier == "batch"  # re-tiered
    assert store.lookup(KEY_B).tier == "critical"  # added
    replacement = tmp_path / "new.toml"
    replacement.write_text(entry("b", KEY_B, "critical"))
    replacement.replace(path)  # how editors and `mv` update a file: a new inode
    assert store.lookup(KEY_A) is None  # revoked
    assert store.lookup(KEY_B).tier == "critical"


def test_mtime_is_checked_at_most_every_interval(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(entry("a", KEY_A, "critical"))
    now = [0.0]
    store = KeyStore(path, TIERS, check_interval_s=1.0, clock=lambda: now[0])
    path.write_text(entry("a", KEY_A, "batch"))
    now[0] = 0.5
    assert store.lookup(KEY_A).tier == "critical"  # not looked at yet
    now[0] = 1.5
    assert store.lookup(KEY_A).tier == "batch"


def test_bad_reload_keeps_the_previous_keys_and_logs_an_error(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(entry("a", KEY_A, "critical"))
    store = KeyStore(path, TIERS, check_interval_s=0)
    with capture_logs() as logs:
        path.write_text(entry("a", KEY_A, "gold"))
        assert store.lookup(KEY_A).tier == "critical"
        assert store.lookup(KEY_A).tier == "critical"
        path.write_text("[keys.a]\nsha256 = ")  # broken TOML
        assert store.lookup(KEY_A).tier == "critical"
        assert store.reload() is False  # SIGHUP on a broken file: refused as well
        path.unlink()
        assert store.lookup(KEY_A).tier == "critical"
    errors = [e for e in logs if e["log_level"] == "error"]
    # One error per broken version (not one per lookup), plus the explicit reload.
    assert len(errors) == 4, errors
    assert "gold" in errors[0]["error"] and errors[0]["keys"] == 1
    assert all(e["event"] == "keys reload failed; keeping the previous keys" for e in errors)
    path.write_text(entry("b", KEY_B, "batch"))  # fixed: taken at once
    assert store.lookup(KEY_B).tier == "batch" and store.lookup(KEY_A) is None


def test_first_load_must_succeed(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(entry("a", KEY_A, "gold"))
    with pytest.raises(ValueError, match="gold"):
        KeyStore(path, TIERS)


# ---------------------------------------------------------------- Check() over gRPC


def check_request(
    headers: dict[str, str], *, raw: bool = False, path: str = "/tierflow.v1.Tierflow/Generate"
) -> external_auth_pb2.CheckRequest:
    http = attribute_context_pb2.AttributeContext.HttpRequest(id="123", method="POST", path=path)
    if raw:  # Envoy's encode_raw_headers form
        http.header_map.headers.extend(
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()
        )
    else:
        http.headers.update(headers)
    return external_auth_pb2.CheckRequest(
        attributes=attribute_context_pb2.AttributeContext(
            request=attribute_context_pb2.AttributeContext.Request(http=http)
        )
    )


def run_checks(tmp_path: Path, requests: list[external_auth_pb2.CheckRequest]):
    """Answers from a real grpc.aio server running the Authorizer, with the logs it wrote."""
    path = tmp_path / "keys.toml"
    path.write_text(entry("a", KEY_A, "critical") + entry("b", KEY_B, "batch"))

    async def go():
        server = grpc.aio.server()
        external_auth_pb2_grpc.add_AuthorizationServicer_to_server(
            Authorizer(KeyStore(path, TIERS)), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = external_auth_pb2_grpc.AuthorizationStub(channel)
                return [await stub.Check(r, timeout=10) for r in requests]
        finally:
            await server.stop(None)

    with capture_logs() as logs:
        replies = asyncio.run(go())
    return replies, logs


def headers_of(options) -> dict[str, tuple[str, int]]:
    return {o.header.key: (o.header.value, o.append_action) for o in options}


def test_check_allows_a_known_key_sets_the_tier_and_strips_the_key(tmp_path):
    spoofed = {"x-api-key": KEY_B, "x-tierflow-tier": "critical"}
    replies, logs = run_checks(
        tmp_path,
        [
            check_request({"x-api-key": KEY_A}),
            check_request(spoofed),
            check_request(spoofed, raw=True),
        ],
    )
    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    expected = [("critical", "a"), ("batch", "b"), ("batch", "b")]
    for reply, (tier, label) in zip(replies, expected, strict=True):
        assert reply.status.code == grpc.StatusCode.OK.value[0]
        assert reply.WhichOneof("http_response") == "ok_response"
        # SET (overwrite), so a client's own x-tierflow-tier never survives; the key's label
        # (never the key) for the request log; its share of the tier (1 unless the file says).
        assert headers_of(reply.ok_response.headers) == {
            "x-tierflow-tier": (tier, overwrite),
            "x-tierflow-key-id": (label, overwrite),
            "x-tierflow-key-weight": ("1", overwrite),
        }
        assert list(reply.ok_response.headers_to_remove) == ["x-api-key", "authorization"]
    allowed = [e for e in logs if e["event"] == "allowed"]
    assert [(e["tier"], e["key"], e["key_fp"]) for e in allowed] == [
        ("critical", "a", hash_key(KEY_A)[:8]),
        ("batch", "b", hash_key(KEY_B)[:8]),
        ("batch", "b", hash_key(KEY_B)[:8]),
    ]
    assert KEY_A not in repr(logs) and KEY_B not in repr(logs)


def test_check_denies_missing_and_unknown_keys_as_unauthenticated(tmp_path):
    unknown = "not-a-key-0123456789"
    replies, logs = run_checks(
        tmp_path,
        [
            check_request({"x-tierflow-tier": "critical"}),
            check_request({"x-api-key": unknown}),
            check_request({"x-api-key": ""}),
            check_request({"x-api-key": f"{KEY_A},{KEY_B}"}),  # two keys, joined by Envoy
        ],
    )
    for reply in replies:
        assert reply.status.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert reply.WhichOneof("http_response") == "denied_response"
        # 401: Envoy answers a gRPC client with grpc-status 16, a JSON client with 401.
        assert reply.denied_response.status.code == 401
        assert reply.denied_response.body == reply.status.message
    assert "missing API key" in replies[0].status.message
    assert replies[1].status.message == "unknown API key"
    denied = [e for e in logs if e["event"] == "denied"]
    assert [e["reason"] for e in denied] == ["no key", "unknown key", "no key", "unknown key"]
    assert denied[1]["key_fp"] == hashlib.sha256(unknown.encode()).hexdigest()[:8]
    assert unknown not in repr(logs) and KEY_A not in repr(logs)


def test_whitespace_around_a_key_is_ignored_on_every_path(tmp_path):
    """HTTP/1.1 (Envoy's codec) strips it before the gateway sees the header; HTTP/2 (gRPC, JSON
    over h2) passes it on: one rule for both, the key without its surrounding whitespace."""
    padded = [f" {KEY_A}", f"{KEY_A} ", f"\t{KEY_A}  ", f"  {KEY_A}\t"]
    replies, logs = run_checks(
        tmp_path,
        [check_request({"x-api-key": key}) for key in padded]
        + [check_request({"x-api-key": key}, raw=True) for key in padded]
        + [check_request({"x-api-key": "   "}), check_request({"x-api-key": f"{KEY_A} x"})],
    )
    assert [r.status.code for r in replies] == [0] * 8 + [16, 16]
    assert {r.ok_response.headers[0].header.value for r in replies[:8]} == {"critical"}
    assert [e["reason"] for e in logs if e["event"] == "denied"] == ["no key", "unknown key"]


def test_check_takes_a_bearer_key_and_answers_openai_paths_in_openai_shape(tmp_path):
    chat = "/v1/chat/completions"
    replies, logs = run_checks(
        tmp_path,
        [
            check_request({"authorization": f"Bearer {KEY_B}"}, path=chat),
            check_request({"authorization": f"bearer  {KEY_A} "}, raw=True),
            check_request({"authorization": f"Basic {KEY_A}"}, path=chat),
            check_request({"authorization": "Bearer not-a-key-0123456789"}, path="/v1/models"),
            check_request({"x-api-key": KEY_A, "authorization": "Bearer junk"}),
        ],
    )
    assert [r.status.code for r in replies] == [0, 0, 16, 16, 0]
    assert [r.ok_response.headers[0].header.value for r in replies if r.status.code == 0] == [
        "batch",
        "critical",
        "critical",  # x-api-key first
    ]
    for reply in replies[2:4]:
        denied = reply.denied_response
        assert denied.status.code == 401
        headers = {o.header.key: o.header.value for o in denied.headers}
        assert headers["content-type"] == "application/json"
        assert headers["www-authenticate"].startswith("Bearer")
        error = json.loads(denied.body)["error"]
        assert error["code"] == "invalid_api_key" and error["message"] == reply.status.message
    assert "missing API key" in replies[2].status.message
    assert replies[3].status.message == "unknown API key"
    assert KEY_A not in repr(logs) and KEY_B not in repr(logs)


def test_openai_paths():
    for path in ("/v1/chat/completions", "/v1/completions?x=1", "/v1/models", "/v1/models/m"):
        assert is_openai_path(path), path
    for path in ("/v1/generate", "/tierflow.v1.Tierflow/Generate", "/v1/completionsx", "/"):
        assert not is_openai_path(path), path


# ---------------------------------------------------------------- the process


def test_server_process_reloads_on_sighup_and_stops_on_sigterm(tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text(entry("a", KEY_A, "critical"))
    tiers = tmp_path / "tiers.toml"
    tiers.write_text("[tiers.critical]\nrank = 0\nttft_slo_s = 1.0\n")
    # A long mtime interval: only the SIGHUP can explain the reload below.
    proc, target = start_gateway(tmp_path, keys=keys, tiers=tiers, keys_check_interval=3600)

    def check(key: str) -> int:
        with grpc.insecure_channel(target) as channel:
            stub = external_auth_pb2_grpc.AuthorizationStub(channel)
            return stub.Check(check_request({"x-api-key": key}), timeout=10).status.code

    try:
        assert check(KEY_A) == 0 and check(KEY_B) == 16
        keys.write_text(entry("b", KEY_B, "critical"))
        proc.proc.send_signal(signal.SIGHUP)
        proc.wait_for_log("keys loaded", timeout=30)
        assert check(KEY_B) == 0 and check(KEY_A) == 16
        keys.write_text(entry("b", KEY_B, "gold"))  # a broken edit, then SIGHUP
        proc.proc.send_signal(signal.SIGHUP)
        proc.wait_for_log("keys reload failed; keeping the previous keys", timeout=30)
        assert check(KEY_B) == 0
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(30) == 0
        assert proc.wait_for_log("stopped", timeout=5)
    finally:
        proc.stop()
    assert KEY_A not in proc.log_path.read_text() and KEY_B not in proc.log_path.read_text()


def test_server_refuses_to_start_on_a_bad_keys_file(tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text(entry("a", KEY_A, "gold"))
    result = subprocess.run(
        [
            *(sys.executable, "-m", "gateway.server", "--listen", f"127.0.0.1:{free_port()}"),
            *("--keys", str(keys), "--tiers", str(REPO / "config" / "tiers.toml")),
            "--plaintext",
        ],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "gateway cannot start" in result.stderr and "tier 'gold'" in result.stderr
