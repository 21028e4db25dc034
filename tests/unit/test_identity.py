"""Identities (``tierflow/identity.py``), the local CA (``launch/certs.py``) and what the queue
service accepts from whom (``queue_service/trust.py``); the same over real sockets in
``tests/integration/test_mtls.py``."""

from __future__ import annotations

import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from launch.certs import STANDARD, ensure, export
from queue_service.trust import PLAINTEXT, Trust
from tierflow.identity import Identity, Role, TlsFiles


def test_an_identity_is_its_role_and_for_a_worker_its_id():
    assert Identity(Role.EDGE).common_name == "edge"
    assert Identity.worker("w0").common_name == "worker/w0"
    assert Identity.worker("w0").file_stem == "worker-w0"
    assert Identity.parse("worker/w0") == Identity.worker("w0")
    assert Identity.parse("openai-api") == Identity(Role.OPENAI_API)
    for stated in ("", "root", "worker", "edge/x", "worker/a/b", "worker/"):
        assert Identity.parse(stated) is None, stated
    with pytest.raises(ValueError, match="1-64"):
        Identity.worker("../etc")


def test_the_ca_issues_each_identity_once_and_reissues_what_another_ca_signed(tmp_path):
    wanted = [*STANDARD, Identity.worker("w0")]
    assert ensure(tmp_path, wanted) == wanted
    assert ensure(tmp_path, wanted) == []  # kept: valid and from this CA
    worker = x509.load_pem_x509_certificate((tmp_path / "worker-w0.pem").read_bytes())
    assert worker.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "worker/w0"
    # A service's certificate may serve and names its hosts; a worker's is a client's only, so
    # that it cannot stand in for the queue service.
    service = x509.load_pem_x509_certificate((tmp_path / "queue-service.pem").read_bytes())
    names = service.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "queue-service"} <= set(names.get_values_for_type(x509.DNSName))
    assert usages(service) == {"serverAuth", "clientAuth"} and usages(worker) == {"clientAuth"}
    with pytest.raises(x509.ExtensionNotFound):
        worker.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    for cert in (service, worker):  # what strict verification (Python 3.13) asks for
        cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier)
    assert stat.S_IMODE((tmp_path / "worker-w0.key").stat().st_mode) == 0o600
    # A leaf left from another CA is not trusted by this one's peers: issued again.
    other = tmp_path / "other"
    ensure(other, [Identity(Role.EDGE)])
    (tmp_path / "edge.pem").write_bytes((other / "edge.pem").read_bytes())
    assert ensure(tmp_path, wanted) == [Identity(Role.EDGE)]


def usages(cert: x509.Certificate) -> set[str]:
    return {u._name for u in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value}


def test_a_key_that_is_not_its_certificates_is_reissued_and_a_lone_ca_is_kept(tmp_path):
    ensure(tmp_path, [Identity(Role.EDGE), Identity(Role.OPERATOR)])
    (tmp_path / "edge.key").write_bytes((tmp_path / "operator.key").read_bytes())
    assert ensure(tmp_path, [Identity(Role.EDGE)]) == [Identity(Role.EDGE)]
    # A deployment's own CA (its certificate, not its key) is never replaced by a new one.
    (tmp_path / "ca.key").unlink()
    with pytest.raises(ValueError, match="without the other"):
        ensure(tmp_path, [Identity(Role.EDGE)])


def test_each_process_gets_a_directory_with_its_own_key_only(tmp_path):
    ensure(tmp_path, [*STANDARD, Identity.worker("w0")])
    own = export(tmp_path, Identity.worker("w0"))
    assert sorted(p.name for p in own.iterdir()) == ["ca.pem", "worker-w0.key", "worker-w0.pem"]
    assert (
        TlsFiles.load(own, Identity.worker("w0")).key == (tmp_path / "worker-w0.key").read_bytes()
    )
    assert stat.S_IMODE((own / "worker-w0.key").stat().st_mode) == 0o600
    openai = export(tmp_path, Identity(Role.OPENAI_API))
    assert sorted(p.name for p in openai.iterdir() if p.suffix == ".key") == ["openai-api.key"]
    assert (openai / "edge.pem").exists()  # its trust anchor, without the edge's key


def test_loading_an_identity_that_was_never_issued_says_what_to_run(tmp_path):
    ensure(tmp_path, STANDARD)
    with pytest.raises(FileNotFoundError, match="tierflow certs"):
        TlsFiles.load(tmp_path, Identity.worker("w7"))


class Peer:
    """A servicer context whose peer presented ``common_names`` (none: plaintext)."""

    def __init__(self, *common_names: str) -> None:
        self._names = [n.encode() for n in common_names]

    def auth_context(self) -> dict:
        return {"x509_common_name": self._names} if self._names else {}


MTLS = Trust(mtls=True)


def test_the_client_api_takes_the_edge_and_the_operator_only():
    for role in (Role.EDGE, Role.OPENAI_API, Role.OPERATOR):
        assert MTLS.refuses_client(Peer(role.value)) is None, role
    for peer in (Peer("worker/w0"), Peer("gateway"), Peer("queue-service"), Peer(), Peer("x")):
        assert "may not call the client API" in MTLS.refuses_client(peer)


def test_a_worker_attaches_under_the_id_its_certificate_names_only():
    assert MTLS.refuses_attach(Peer("worker/w0"), "w0") is None
    assert "only, not 'w0'" in MTLS.refuses_attach(Peer("worker/w1"), "w0")
    for peer in (Peer("operator"), Peer("edge"), Peer()):
        assert "not a worker" in MTLS.refuses_attach(peer, "w0")


def test_plaintext_trusts_every_peer():
    assert PLAINTEXT.refuses_client(Peer()) is None
    assert PLAINTEXT.refuses_attach(Peer(), "w0") is None
