"""The local certificate authority: ``tierflow certs`` creates it once and issues every
service's identity from it (``tierflow/identity.py`` says who is who and who accepts whom).

    tierflow certs                      # the CA and the standard identities, in the cache
    tierflow certs --worker w0 --worker w1
    python -m launch.certs --dir /ca --export --worker w0    # the same, where torch is not

The CA's key stays in the directory it was made in, next to the identities it issued. That is
a development and single-host CA, cached outside the clone like the Python environment; a
deployment brings its own (Kubernetes secrets, a mesh's CA) in the same file layout:
``ca.pem`` and, per identity, ``<stem>.pem`` and ``<stem>.key`` (``Identity.file_stem``).

Keys are ECDSA P-256: a thousand times faster to make than RSA, and what TLS 1.3 and gRPC's
BoringSSL prefer. A service's certificate (``SERVERS``) carries server and client
authentication and the names a peer dials it by (``localhost``, 127.0.0.1, ::1 and its compose
service name, which is its role); every other identity's is a client certificate only. Each
process gets a directory of its own (``export``): the CA's certificate and its own key, never
the CA's key or another identity's.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import ipaddress
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tierflow.identity import CA_FILE, Identity, Role

CA_KEY_FILE = "ca.key"
KAFKA_KEYSTORE = "keystore.pem"  # the broker's key and certificate, as Kafka's PEM keystore
CA_NAME = "tierflow local CA"
CA_DAYS = 3650
LEAF_DAYS = 365
RENEW_BEFORE = datetime.timedelta(days=30)  # a leaf closer than this to its end is reissued

# The identities that serve: their certificates may authenticate a server and name the hosts
# they are dialled by. The others (edge, operator, workers) are client certificates only.
SERVERS = frozenset({Role.QUEUE_SERVICE, Role.GATEWAY, Role.OPENAI_API, Role.KAFKA})

# What every standard deployment runs; workers are issued by id (``--worker``).
STANDARD = (
    Identity(Role.EDGE),
    Identity(Role.OPENAI_API),
    Identity(Role.GATEWAY),
    Identity(Role.QUEUE_SERVICE),
    Identity(Role.OPERATOR),
    Identity(Role.KAFKA),
)


# A CA signs certificates (and revocation lists), nothing else.
_CA_KEY_USAGE = x509.KeyUsage(
    **dict.fromkeys(("digital_signature", "key_cert_sign", "crl_sign"), True),
    **dict.fromkeys(
        ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
         "encipher_only", "decipher_only"),
        False,
    ),
)  # fmt: skip


def default_dir() -> Path:
    """Where ``tierflow certs``, ``tierflow up`` and the demo keep the CA: beside the cached
    Python environment (``scripts/bootstrap.sh``), outside any clone."""
    cache = os.environ.get("TIERFLOW_CACHE") or Path.home() / ".cache" / "tierflow"
    return Path(cache) / "certs"


@dataclass(frozen=True)
class Authority:
    """A CA that can issue identities: its key and certificate."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate


def ensure(directory: Path, identities: Iterable[Identity] = STANDARD) -> list[Identity]:
    """The CA in ``directory`` (made if absent) and each of ``identities`` issued by it, unless
    a valid one is there already. Returns the identities it issued now."""
    directory.mkdir(parents=True, exist_ok=True)
    # One ensure at a time per directory (tierflow up beside a bench): a lock file, not the
    # files themselves, so that readers never wait.
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        authority = _load_or_make_ca(directory)
        issued = []
        for identity in identities:
            if not _current(directory, identity, authority):
                issue(directory, identity, authority)
                issued.append(identity)
    return issued


def issue(directory: Path, identity: Identity, authority: Authority) -> None:
    """Writes ``identity``'s key and certificate, signed by ``authority``. A server identity
    (``SERVERS``) may authenticate as a server and names the hosts it is dialled by; any other
    is a client certificate only, so that it cannot stand in for a service."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    server = identity.role in SERVERS
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + (
        [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.common_name)]))
        .issuer_name(authority.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(_authority_key_id(authority), critical=False)
    )
    if server:
        names = [x509.DNSName(h) for h in ("localhost", identity.role.value)]
        names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(authority.key, hashes.SHA256())
    stem = identity.file_stem
    _write_key(directory / f"{stem}.key", key)
    _write(directory / f"{stem}.pem", cert.public_bytes(serialization.Encoding.PEM))


def export(directory: Path, identity: Identity) -> Path:
    """A directory of ``identity``'s own: the CA's certificate and its key and certificate, and
    no other key (not the CA's, not another identity's), for the process that runs as it. The
    OpenAI service also gets the edge's certificate, its only trust anchor
    (``tierflow.identity.edge_only_server_context``)."""
    own = directory / "by-identity" / identity.file_stem
    own.mkdir(parents=True, exist_ok=True)
    stem = identity.file_stem
    _write(own / CA_FILE, (directory / CA_FILE).read_bytes())
    _write(own / f"{stem}.pem", (directory / f"{stem}.pem").read_bytes())
    _write(own / f"{stem}.key", (directory / f"{stem}.key").read_bytes(), 0o600)
    if identity.role is Role.OPENAI_API:  # it trusts the edge's certificate itself (no key)
        edge = Identity(Role.EDGE).file_stem
        _write(own / f"{edge}.pem", (directory / f"{edge}.pem").read_bytes())
    if identity.role is Role.KAFKA:  # a PEM keystore is one file: the key, then the chain
        keystore = (directory / f"{stem}.key").read_bytes() + (
            directory / f"{stem}.pem"
        ).read_bytes()
        _write(own / KAFKA_KEYSTORE, keystore, 0o600)
    return own


def _authority_key_id(authority: Authority) -> x509.AuthorityKeyIdentifier:
    return x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.key.public_key())


def _load_or_make_ca(directory: Path) -> Authority:
    key_path, cert_path = directory / CA_KEY_FILE, directory / CA_FILE
    if key_path.exists() != cert_path.exists():
        # A deployment's own CA (its certificate without its key) is never replaced.
        raise ValueError(
            f"{directory} has one of {CA_FILE} and {CA_KEY_FILE} without the other: "
            "issue with the CA that made it, or move both away to make a new CA"
        )
    if key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        if not isinstance(key, ec.EllipticCurvePrivateKey) or not _matches(cert, key):
            raise ValueError(f"{key_path} is not the key of {cert_path}")
        return Authority(key, cert)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_KEY_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return Authority(key, cert)


def _current(directory: Path, identity: Identity, authority: Authority) -> bool:
    """Whether ``identity``'s certificate is there, issued by this CA and not near its end."""
    cert_path = directory / f"{identity.file_stem}.pem"
    if not cert_path.exists() or not (directory / f"{identity.file_stem}.key").exists():
        return False
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(
        (directory / f"{identity.file_stem}.key").read_bytes(), password=None
    )
    return (
        cert.issuer == authority.cert.subject
        and cert.not_valid_after_utc - RENEW_BEFORE > _now()
        and _signed_by(cert, authority)
        and _matches(cert, key)
        and _has(cert, x509.AuthorityKeyIdentifier)  # strict verification (Python 3.13) needs it
    )


def _matches(cert: x509.Certificate, key) -> bool:
    return cert.public_key().public_numbers() == key.public_key().public_numbers()


def _has(cert: x509.Certificate, extension: type) -> bool:
    try:
        cert.extensions.get_extension_for_class(extension)
    except x509.ExtensionNotFound:
        return False
    return True


def _signed_by(cert: x509.Certificate, authority: Authority) -> bool:
    try:
        cert.verify_directly_issued_by(authority.cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """A private key, readable by its owner only."""
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write(path, pem, 0o600)


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Whole or not at all: a temporary file renamed over ``path``, so that a crash or a second
    ``ensure`` never leaves half a file (or a key beside another key's certificate)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # whatever the umask, and a stale file's mode
        f.write(data)
    os.replace(tmp, path)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, help="default: certs/ in the cache (~/.cache/tierflow)")
    parser.add_argument(
        "--worker", action="append", default=[], metavar="ID",
        help="also a worker's identity, bound to its worker id (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--export", action="store_true",
        help="also a directory per identity, <dir>/by-identity/<name>, holding only its own key "
        "(what each container mounts in docker-compose.yml)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """``tierflow certs``: ensures the CA and the identities, prints each one's state."""
    directory = args.dir or default_dir()
    try:
        identities = [*STANDARD, *(Identity.worker(w) for w in args.worker)]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    issued = ensure(directory, identities)
    for identity in identities:
        state = "issued" if identity in issued else "kept"
        print(f"{state:6} {identity.common_name:24} {directory / identity.file_stem}.pem")
        if args.export:
            print(f"{'':6} {'':24} {export(directory, identity)}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.certs", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
