"""Who a process is on the wire, and who its peer is: identities from certificates (mTLS).

Every service holds a certificate from the deployment's CA (``tierflow certs``,
``launch/certs.py``) whose common name is its identity: a role, and for a worker its id
(``worker/w0``). A server requires a client certificate from the same CA and reads the peer's
identity from it (``peer_identity``); what each role may do is decided where the call lands
(the queue service: ``queue_service/trust.py``). Nothing that merely reaches a port is trusted.

Files, in one directory: ``ca.pem`` (the CA's certificate, the only trust anchor) and, per
identity, ``<file_stem>.pem`` and ``<file_stem>.key``.
"""

from __future__ import annotations

import argparse
import enum
import re
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

CA_FILE = "ca.pem"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class Role(enum.StrEnum):
    EDGE = "edge"  # Envoy: calls the queue service, the gateway and the OpenAI service
    OPENAI_API = "openai-api"  # the OpenAI-compatible service: calls the queue service
    GATEWAY = "gateway"  # ext_authz: serves Envoy only
    QUEUE_SERVICE = "queue-service"
    WORKER = "worker"  # one per worker id: attaches to the queue service
    OPERATOR = "operator"  # the person holding the CA: tierflow generate, bench --stack, ops
    KAFKA = "kafka"  # the broker: serves the services' Kafka clients; its super user (ACLs)


@dataclass(frozen=True)
class Identity:
    role: Role
    name: str = ""  # a worker's id; empty for the services, of which each has one identity

    def __post_init__(self) -> None:
        if self.name and not _NAME.fullmatch(self.name):
            raise ValueError(f"an identity's name is 1-64 of [A-Za-z0-9._-], got {self.name!r}")
        if (self.role is Role.WORKER) != bool(self.name):
            raise ValueError("a worker identity names its worker id; no other identity has a name")

    @property
    def common_name(self) -> str:
        return f"{self.role.value}/{self.name}" if self.name else self.role.value

    @property
    def file_stem(self) -> str:
        return f"{self.role.value}-{self.name}" if self.name else self.role.value

    @classmethod
    def parse(cls, common_name: str) -> Identity | None:
        """The identity a certificate's common name states; None when it states none."""
        role, _, name = common_name.partition("/")
        try:
            return cls(Role(role), name)
        except ValueError:
            return None

    @classmethod
    def worker(cls, worker_id: str) -> Identity:
        return cls(Role.WORKER, worker_id)


@dataclass(frozen=True)
class TlsFiles:
    """An identity's key and certificate and the CA's certificate, as PEM bytes."""

    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, directory: Path, identity: Identity) -> TlsFiles:
        """From ``directory`` (``tierflow certs``); FileNotFoundError names what is missing."""
        stem = identity.file_stem
        paths = [directory / CA_FILE, directory / f"{stem}.pem", directory / f"{stem}.key"]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(
                f"no certificate for {identity.common_name}: missing {', '.join(missing)} "
                f"(create them with `tierflow certs --dir {directory}`)"
            )
        ca, cert, key = (p.read_bytes() for p in paths)
        return cls(ca, cert, key)

    def server_credentials(self) -> grpc.ServerCredentials:
        """A server that requires a client certificate issued by the CA."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client that presents its certificate and trusts only the CA."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def edge_only_server_context(directory: Path, server: Identity) -> ssl.SSLContext:
    """A TLS server context (for an HTTP server that cannot read its peer's certificate, such
    as uvicorn) that accepts one client only: the holder of the edge's certificate. The edge's
    certificate itself is the only trust anchor (partial chains allowed), so another identity
    of the same CA does not verify."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    stem = directory / server.file_stem
    ctx.load_cert_chain(f"{stem}.pem", f"{stem}.key")
    ctx.load_verify_locations(cafile=directory / f"{Identity(Role.EDGE).file_stem}.pem")
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return ctx


def client_context(directory: Path, identity: Identity) -> ssl.SSLContext:
    """A TLS client context (HTTPS) that presents ``identity`` and trusts only the CA."""
    ctx = ssl.create_default_context(cafile=directory / CA_FILE)
    stem = directory / identity.file_stem
    ctx.load_cert_chain(f"{stem}.pem", f"{stem}.key")
    return ctx


def open_channel(
    target: str,
    credentials: grpc.ChannelCredentials | None = None,
    options=None,
    *,
    server: Role = Role.QUEUE_SERVICE,
) -> grpc.Channel:
    """A channel to ``target``: over mTLS with ``credentials`` (an identity's,
    ``TlsFiles.channel_credentials``) to the service ``server`` only, else plaintext."""
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=pinned(options, server))


def pinned(options, server: Role = Role.QUEUE_SERVICE) -> list[tuple[str, object]]:
    """Channel ``options`` under which the server's certificate must name the service
    ``server`` (its role, which ``launch.certs`` puts in every server's names), whatever
    address was dialled: the CA signs every service's certificate, and without this a client
    that dials 127.0.0.1 would take the gateway's for the queue service's."""
    return [*(options or []), ("grpc.ssl_target_name_override", server.value)]


def peer_identity(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> Identity | None:
    """The identity the peer's certificate states; None for a plaintext peer (or one whose
    certificate names no identity). The TLS handshake has already checked the certificate
    against the CA."""
    names = context.auth_context().get("x509_common_name") or []
    parsed = [Identity.parse(n.decode("utf-8", "replace")) for n in names]
    return parsed[0] if len(parsed) == 1 else None


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-dir`` (mTLS with the CA and identities there) or ``--plaintext`` (development
    only): one of them, so that running without identities is always a stated choice."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--tls-dir",
        type=Path,
        help="mTLS: the directory of the CA and this process's identity (`tierflow certs`)",
    )
    group.add_argument(
        "--plaintext",
        action="store_true",
        help="development only: no TLS and no identities, so every peer is trusted",
    )


def add_port(
    server: grpc.aio.Server, listen: str, tls_dir: Path | None, identity: Identity, log
) -> int:
    """Listens on ``listen``: over mTLS as ``identity`` (its files in ``tls_dir``), or in
    plaintext with a warning when ``tls_dir`` is None. Returns the port (0: could not bind)."""
    if tls_dir is None:
        log.warning(PLAINTEXT_WARNING, listen=listen)
        return server.add_insecure_port(listen)
    return server.add_secure_port(listen, TlsFiles.load(tls_dir, identity).server_credentials())


PLAINTEXT_WARNING = (
    "plaintext: no TLS and no identities; any process that reaches this port is trusted "
    "(development only; give --tls-dir for mTLS)"
)
