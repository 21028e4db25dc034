"""The stubs' staleness check (``launch.protogen --check``, part of `make test` via lint)."""

from __future__ import annotations

from launch.protogen import _comparable, main


def test_the_committed_stubs_match_the_protos():
    assert main(["--check"]) == 0


def test_a_newer_grpc_tools_release_is_not_a_stale_stub_but_another_proto_is():
    old = {"queue_pb2_grpc.py": b"import grpc\nGRPC_GENERATED_VERSION = '1.85.1'\nstub\n"}
    newer = {"queue_pb2_grpc.py": b"import grpc\nGRPC_GENERATED_VERSION = '1.85.4'\nstub\n"}
    changed = {"queue_pb2_grpc.py": b"import grpc\nGRPC_GENERATED_VERSION = '1.85.1'\nother\n"}
    assert _comparable(old) == _comparable(newer)
    assert _comparable(old) != _comparable(changed)
