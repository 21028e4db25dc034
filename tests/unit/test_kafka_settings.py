"""tierflow.kafka_settings: topic names, validation, environment, and client configurations that
kafka-python accepts (it rejects unknown keys, so a typo here would only show up at run time)."""

from __future__ import annotations

import dataclasses

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

from tierflow.kafka_settings import KafkaSettings, reply_topic, tier_topic


def test_topic_names() -> None:
    assert tier_topic("tierflow.", "critical") == "tierflow.priority_critical"
    assert reply_topic("tierflow.", "qs-1") == "tierflow.reply_qs-1"
    settings = KafkaSettings(topic_prefix="x.")
    assert settings.tier_topic("batch") == "x.priority_batch"
    assert settings.reply_topic("a") == "x.reply_a"


@pytest.mark.parametrize("bad", ["has space", "slash/no", "colon:no", "é", "x" * 250])
def test_illegal_topic_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="legal Kafka topic"):
        reply_topic("", bad)


def test_settings_are_frozen_and_validated() -> None:
    settings = KafkaSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.bootstrap = "elsewhere:9092"  # type: ignore[misc]
    with pytest.raises(ValueError, match="partitions"):
        KafkaSettings(partitions=0)
    with pytest.raises(ValueError, match="integer"):
        KafkaSettings(partitions=True)  # bool is an int subclass; still a typo
    with pytest.raises(ValueError, match="heartbeat"):
        KafkaSettings(session_timeout_ms=6_000, heartbeat_interval_ms=3_000)
    with pytest.raises(ValueError, match="topic"):
        KafkaSettings(topic_prefix="bad prefix")
    with pytest.raises(ValueError, match="bootstrap"):
        KafkaSettings(bootstrap=" ")


def test_from_env_reads_tierflow_variables_and_keywords_win() -> None:
    env = {
        "TIERFLOW_KAFKA_BOOTSTRAP": "kafka:9092",
        "TIERFLOW_KAFKA_TOPIC_PREFIX": "prod.",
        "TIERFLOW_KAFKA_GROUP_ID": "qs",
        "TIERFLOW_KAFKA_PARTITIONS": "3",
        "TIERFLOW_KAFKA_REPLICATION_FACTOR": "",  # empty: the default
    }
    settings = KafkaSettings.from_env(env, group_id="override")
    assert settings.bootstrap == "kafka:9092"
    assert settings.topic_prefix == "prod."
    assert settings.group_id == "override"
    assert settings.partitions == 3
    assert settings.replication_factor == 1
    assert KafkaSettings.from_env({}) == KafkaSettings()
    with pytest.raises(ValueError, match="TIERFLOW_KAFKA_PARTITIONS"):
        KafkaSettings.from_env({"TIERFLOW_KAFKA_PARTITIONS": "many"})


def test_producer_is_durable_and_immediate() -> None:
    config = KafkaSettings().producer_config()
    assert config["acks"] == "all"
    assert config["enable_idempotence"] is True
    assert config["linger_ms"] == 0
    assert config["allow_auto_create_topics"] is False


def test_consumer_commits_only_by_hand_and_starts_at_the_oldest() -> None:
    settings = KafkaSettings(group_id="g")
    config = settings.consumer_config()
    assert config["enable_auto_commit"] is False
    assert config["auto_offset_reset"] == "earliest"
    assert config["group_id"] == "g"
    assert settings.consumer_config("other")["group_id"] == "other"
    assert settings.consumer_config(standalone=True)["group_id"] is None


def test_configs_only_use_keys_kafka_python_knows() -> None:
    settings = KafkaSettings()
    assert set(settings.producer_config()) <= set(KafkaProducer.DEFAULT_CONFIG)
    assert set(settings.consumer_config()) <= set(KafkaConsumer.DEFAULT_CONFIG)
    assert set(settings.admin_config()) <= set(KafkaAdminClient.DEFAULT_CONFIG)
    tls = KafkaSettings(tls_dir="/certs", tls_identity="operator")
    assert set(tls.producer_config()) <= set(KafkaProducer.DEFAULT_CONFIG)
    assert set(tls.consumer_config()) <= set(KafkaConsumer.DEFAULT_CONFIG)
    assert set(tls.admin_config()) <= set(KafkaAdminClient.DEFAULT_CONFIG)


def test_a_tls_dir_makes_every_client_present_its_identity_over_mtls() -> None:
    assert KafkaSettings().admin_config()["security_protocol"] == "PLAINTEXT"
    env = {"TIERFLOW_KAFKA_TLS_DIR": "/certs"}
    settings = KafkaSettings.from_env(env, tls_identity="queue-service")
    for config in (settings.producer_config(), settings.consumer_config()):
        assert config["security_protocol"] == "SSL"
        assert config["ssl_cafile"] == "/certs/ca.pem"
        assert config["ssl_certfile"] == "/certs/queue-service.pem"
        assert config["ssl_keyfile"] == "/certs/queue-service.key"
        assert config["ssl_check_hostname"] is True
    with pytest.raises(ValueError, match="tls_identity"):
        KafkaSettings(tls_dir="/certs")
