"""The broker's ACLs: which service may do what with tierflow's topics (docs/design.md, "Trust").

A broker started with mTLS (``scripts/kafka.sh`` with ``KAFKA_TLS_DIR``) denies every request
that no ACL allows. A principal is the common name of the client's certificate, so the
identities of ``tierflow certs`` are the principals:

* ``queue-service``: everything on its deployments' topics (the tier queues, replies, tier
  loads; it creates them) and in its consumer groups. It writes the request log, and may
  neither read it nor delete it, alter it or change its retention: DENYs, which Kafka weighs
  above any ALLOW (its prefix's ALLOW covers the request log too).
* ``operator`` (the ops tools: audit, compare, request-log dumps, the canary's verdict): reads
  and describes the request log; nothing on the tier topics, which hold tenants' prompts.
* anyone else (the edge, the gateway, workers, a certificate of another CA): nothing. Workers
  never touch Kafka; they reach the queue service over gRPC.

``grant`` connects as the broker's own identity, ``kafka``, the only super user. `tierflow up`
calls it; docker-compose runs it as an init step:

    python -m launch.kafka_acls --bootstrap kafka:9092 --tls-dir /certs \
        --topic-prefix tierflow. --request-log tierflow.request_log --group-prefix tierflow-queue
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from kafka import KafkaAdminClient
from kafka.admin import (
    ACL,
    ACLOperation,
    ACLPermissionType,
    ACLResourcePatternType,
    ResourcePattern,
    ResourceType,
)

from tierflow.identity import Identity, Role
from tierflow.kafka_settings import KafkaSettings

QUEUE_SERVICE = f"User:{Identity(Role.QUEUE_SERVICE).common_name}"
OPERATOR = f"User:{Identity(Role.OPERATOR).common_name}"
# What the queue service may not do to the request log, the audit's record: read tenants'
# history, or erase it (delete the topic, shorten its retention).
REQUEST_LOG_DENIED = (
    ACLOperation.READ, ACLOperation.DELETE, ACLOperation.ALTER, ACLOperation.ALTER_CONFIGS,
)  # fmt: skip


def acls(topic_prefixes: Iterable[str], request_log: str, group_prefix: str) -> list[ACL]:
    """The ACLs of a deployment whose topics start with one of ``topic_prefixes`` (the primary's
    and a canary's), whose request log is ``request_log`` and whose consumer groups start with
    ``group_prefix``."""

    def rule(principal, operation, permission, kind, name, pattern) -> ACL:
        resource = ResourcePattern(kind, name, pattern)
        return ACL(principal, "*", operation, permission, resource)

    allow, deny = ACLPermissionType.ALLOW, ACLPermissionType.DENY
    topic, group = ResourceType.TOPIC, ResourceType.GROUP
    prefixed, literal = ACLResourcePatternType.PREFIXED, ACLResourcePatternType.LITERAL
    granted = [
        rule(QUEUE_SERVICE, ACLOperation.ALL, allow, topic, prefix, prefixed)
        for prefix in dict.fromkeys(topic_prefixes)
    ]
    return [
        *granted,
        rule(QUEUE_SERVICE, ACLOperation.ALL, allow, group, group_prefix, prefixed),
        rule(QUEUE_SERVICE, ACLOperation.WRITE, allow, topic, request_log, literal),
        *(
            rule(QUEUE_SERVICE, operation, deny, topic, request_log, literal)
            for operation in REQUEST_LOG_DENIED
        ),
        rule(OPERATOR, ACLOperation.READ, allow, topic, request_log, literal),
        rule(OPERATOR, ACLOperation.DESCRIBE, allow, topic, request_log, literal),
    ]


def superuser(bootstrap: str, broker_tls_dir: Path) -> KafkaSettings:
    """A client of the broker at ``bootstrap`` as its super user: the ``kafka`` identity,
    whose files are in ``broker_tls_dir``."""
    return KafkaSettings(
        bootstrap=bootstrap, tls_dir=str(broker_tls_dir), tls_identity=Role.KAFKA.value
    )


def grant(
    admin_settings: KafkaSettings,
    *,
    topic_prefixes: Iterable[str],
    request_log: str,
    group_prefix: str,
) -> None:
    """Creates ``acls(...)`` on the broker, as its super user (``superuser``). Creating an ACL
    that exists already is a no-op."""
    admin = KafkaAdminClient(**admin_settings.admin_config())
    try:
        result = admin.create_acls(acls(topic_prefixes, request_log, group_prefix))
    finally:
        admin.close()
    if result["failed"]:
        raise RuntimeError(f"the broker refused ACLs: {result['failed']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launch.kafka_acls", description=__doc__.split("\n")[0]
    )
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--tls-dir", type=Path, required=True, help="the broker's own identity")
    p.add_argument("--topic-prefix", action="append", required=True, help="repeatable")
    p.add_argument("--request-log", required=True)
    p.add_argument("--group-prefix", required=True)
    args = p.parse_args(argv)
    grant(
        superuser(args.bootstrap, args.tls_dir), topic_prefixes=args.topic_prefix,
        request_log=args.request_log, group_prefix=args.group_prefix,
    )  # fmt: skip
    print(f"granted the ACLs of {', '.join(args.topic_prefix)} on {args.bootstrap}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
