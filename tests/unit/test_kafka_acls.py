"""The ACLs a deployment's broker gets (``launch.kafka_acls``); the broker enforcing them is
``tests/integration/test_kafka_security.py``."""

from __future__ import annotations

from kafka.admin import ACLOperation, ACLPermissionType, ACLResourcePatternType, ResourceType

from launch.kafka_acls import OPERATOR, QUEUE_SERVICE, REQUEST_LOG_DENIED, acls


def rules(principal: str) -> set[tuple]:
    return {
        (a.permission_type, a.operation, a.resource_pattern.resource_type,
         a.resource_pattern.resource_name, a.resource_pattern.pattern_type)
        for a in acls(["tierflow.", "tierflow-canary.", "tierflow."], "tierflow.request_log",
                      "tierflow-queue")
        if a.principal == principal
    }  # fmt: skip


def test_the_queue_service_owns_its_topics_and_groups_but_never_reads_or_erases_the_log():
    assert set(REQUEST_LOG_DENIED) == {
        ACLOperation.READ, ACLOperation.DELETE, ACLOperation.ALTER, ACLOperation.ALTER_CONFIGS
    }  # fmt: skip
    allow, deny = ACLPermissionType.ALLOW, ACLPermissionType.DENY
    prefixed, literal = ACLResourcePatternType.PREFIXED, ACLResourcePatternType.LITERAL
    topic, group, all_ = ResourceType.TOPIC, ResourceType.GROUP, ACLOperation.ALL
    assert rules(QUEUE_SERVICE) == {
        (allow, all_, topic, "tierflow.", prefixed),  # once, though named twice
        (allow, all_, topic, "tierflow-canary.", prefixed),
        (allow, all_, group, "tierflow-queue", prefixed),
        (allow, ACLOperation.WRITE, topic, "tierflow.request_log", literal),
        *((deny, op, topic, "tierflow.request_log", literal) for op in REQUEST_LOG_DENIED),
    }


def test_the_operator_reads_the_request_log_only() -> None:
    allow, literal = ACLPermissionType.ALLOW, ACLResourcePatternType.LITERAL
    assert rules(OPERATOR) == {
        (allow, op, ResourceType.TOPIC, "tierflow.request_log", literal)
        for op in (ACLOperation.READ, ACLOperation.DESCRIBE)
    }
