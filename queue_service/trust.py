"""What the queue service accepts from whom, by the identity in the peer's certificate
(``tierflow/identity.py``).

- The client API (``Tierflow``): the edge's identities, Envoy and the OpenAI service, which set
  the tier and key headers after checking an API key, and the operator (the holder of the CA:
  ``tierflow generate``, the direct path of ``tierflow bench --stack``), whom the headers are
  trusted from as from the edge. Any other identity is refused, so no process that merely
  holds some certificate of the deployment (a worker's) can name a tier or a key.
- The worker control stream (``WorkerControl.Attach``): a worker identity only, and only for
  the worker id its certificate names. A second process cannot take over a worker id, and
  nothing but a worker receives prompts.

In development (``--plaintext``) there are no identities and every peer is trusted, as before
mTLS; the service logs a warning when it starts so.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from tierflow.identity import Identity, Role, peer_identity

CLIENT_ROLES = frozenset({Role.EDGE, Role.OPENAI_API, Role.OPERATOR})


@dataclass(frozen=True)
class Trust:
    mtls: bool  # False: plaintext development mode, every peer trusted

    def refuses_client(self, context: grpc.aio.ServicerContext) -> str | None:
        """Why the peer may not call the client API; None when it may."""
        if not self.mtls:
            return None
        peer = peer_identity(context)
        if peer is None or peer.role not in CLIENT_ROLES:
            return f"{_name(peer)} may not call the client API: only the edge and operators may"
        return None

    def refuses_attach(self, context: grpc.aio.ServicerContext, worker_id: str) -> str | None:
        """Why the peer may not attach as worker ``worker_id``; None when it may."""
        if not self.mtls:
            return None
        peer = peer_identity(context)
        if peer is None or peer.role is not Role.WORKER:
            return f"{_name(peer)} is not a worker: only a worker identity may attach"
        if peer != Identity.worker(worker_id):
            return f"{_name(peer)} may attach as worker {peer.name!r} only, not {worker_id!r}"
        return None


PLAINTEXT = Trust(mtls=False)  # development: no identities, every peer trusted


def _name(peer: Identity | None) -> str:
    return f"identity {peer.common_name!r}" if peer is not None else "a peer without an identity"
