"""Regenerates the Python stubs of ``protos/`` (and Envoy's descriptor set) with one command.

    python -m launch.protogen           # rewrite tierflow/v1/*_pb2*.py(i)
    python -m launch.protogen --check   # exit 1 if the committed stubs are stale (CI)
    python -m launch.protogen --descriptor-set out.pb   # for Envoy's gRPC-JSON transcoder

The stubs land in ``tierflow/v1/`` because the proto package is ``tierflow.v1``: generated
imports (``from tierflow.v1 import serving_pb2``) then resolve without path tricks.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_PACKAGE = ROOT / "tierflow" / "v1"


def _include_dirs() -> list[str]:
    import google.api  # googleapis-common-protos: google/api/annotations.proto

    googleapis = Path(google.api.__path__[0]).parent.parent
    well_known = resources.files("grpc_tools") / "_proto"
    return [str(PROTO_DIR), str(googleapis), str(well_known)]


def _proto_files() -> list[str]:
    return sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))


def _run_protoc(args: list[str]) -> None:
    argv = ["protoc", *(f"-I{d}" for d in _include_dirs()), *args, *_proto_files()]
    if protoc.main(argv) != 0:
        raise SystemExit(f"protoc failed: {' '.join(argv)}")


def generate(out_root: Path) -> list[Path]:
    _run_protoc(
        [f"--python_out={out_root}", f"--grpc_python_out={out_root}", f"--pyi_out={out_root}"]
    )
    package = out_root / "tierflow" / "v1"
    (package / "__init__.py").write_text('"""Generated from protos/ by launch.protogen."""\n')
    return sorted(package.iterdir())


def write_descriptor_set(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    _run_protoc([f"--descriptor_set_out={path}", "--include_imports"])
    return path


# The grpc stubs name the grpcio-tools release that wrote them; a newer release of the same
# protos is not a stale stub (a fresh machine installs the newest, and `make test` checks).
_GENERATOR_LINE = re.compile(rb"^GRPC_GENERATED_VERSION = .*$", re.MULTILINE)


def _comparable(files: dict[str, bytes]) -> dict[str, bytes]:
    return {name: _GENERATOR_LINE.sub(b"", data) for name, data in files.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.protogen")
    parser.add_argument("--check", action="store_true", help="fail if stubs are stale")
    parser.add_argument("--descriptor-set", type=Path, help="write Envoy's descriptor set here")
    args = parser.parse_args(argv)
    if args.descriptor_set:
        write_descriptor_set(args.descriptor_set)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp))}
    if args.check:
        current = {p.name: p.read_bytes() for p in OUT_PACKAGE.glob("*") if p.is_file()}
        if _comparable(current) != _comparable(fresh):
            stale = sorted(
                set(current) ^ set(fresh) | {n for n in fresh if current.get(n) != fresh[n]}
            )
            print(
                f"stale generated stubs in {OUT_PACKAGE}: {stale}; run `make protos`",
                file=sys.stderr,
            )
            return 1
        return 0
    OUT_PACKAGE.mkdir(parents=True, exist_ok=True)
    for old in OUT_PACKAGE.glob("*"):
        if old.is_file():
            old.unlink()
    for name, data in fresh.items():
        (OUT_PACKAGE / name).write_bytes(data)
    print(f"wrote {len(fresh)} files to {OUT_PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
