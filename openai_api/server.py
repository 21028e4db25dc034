"""The OpenAI-compatible service process (``tierflow openai-api``), behind Envoy:

    python -m openai_api.server --listen 127.0.0.1:8000 --queue-service 127.0.0.1:50051 \
        --model smollm2 --tiers config/tiers.toml

It loads only the model's tokenizer (for the chat template and the context length), never its
weights. uvicorn serves it (httptools parser); SIGTERM/SIGINT stop it gracefully.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import structlog
import uvicorn

from openai_api.app import OpenAIApi
from openai_api.config import OpenAIApiConfig
from openai_api.service_tiers import DEFAULT_SERVICE_TIERS, ServiceTiers
from openai_api.translate import ServedModel
from tierflow.addresses import parse_target
from tierflow.catalogue import load_model_info
from tierflow.heap import freeze_startup_heap
from tierflow.identity import (
    PLAINTEXT_WARNING,
    Identity,
    Role,
    TlsFiles,
    edge_only_server_context,
)
from tierflow.logging import configure_logging
from tierflow.tiers import load_tiers

log = structlog.get_logger("openai_api")


def build(config: OpenAIApiConfig) -> OpenAIApi:
    info = load_model_info(config.model)
    served = ServedModel(config.model_name, info.tokenizer, info.max_positions, int(time.time()))
    tiers = ServiceTiers(load_tiers(config.tiers_file), config.service_tiers)
    return OpenAIApi(config, served, tiers)


def _service_tier(text: str) -> tuple[str, str]:
    name, sep, tier = text.partition("=")
    if not sep or not name or not tier:
        raise argparse.ArgumentTypeError(f"expected SERVICE_TIER=TIER, got {text!r}")
    return name, tier


def parse_args(argv: list[str] | None = None) -> OpenAIApiConfig:
    defaults = OpenAIApiConfig()
    p = argparse.ArgumentParser(prog="tierflow openai-api", description=__doc__.split("\n")[0])
    p.add_argument("--listen", default=defaults.listen, help="host:port")
    p.add_argument("--queue-service", default=defaults.queue_service, help="host:port (gRPC)")
    p.add_argument("--model", default=defaults.model, help="the queue service's model")
    p.add_argument("--served-model-name", help="the model name clients send (default --model)")
    p.add_argument("--tiers", type=Path, help="tiers TOML (default $TIERFLOW_TIERS_FILE or config)")
    p.add_argument(
        "--service-tier",
        type=_service_tier,
        action="append",
        metavar="NAME=TIER",
        help="map an OpenAI service_tier to a tier (repeat; replaces the default "
        f"{', '.join(f'{k}={v}' for k, v in DEFAULT_SERVICE_TIERS.items())})",
    )
    p.add_argument("--chat-default-max-tokens", type=int, default=defaults.chat_default_max_tokens)
    p.add_argument(
        "--retry-after",
        type=int,
        default=defaults.retry_after_s,
        help="seconds, for a shed request (429) or an unreachable queue (503)",
    )
    p.add_argument(
        "--tls-dir",
        type=Path,
        help="mTLS: to the queue service as the openai-api identity, and on its own listener "
        "for the edge only (`tierflow certs`); default plaintext",
    )
    args = p.parse_args(argv)
    return OpenAIApiConfig(
        listen=args.listen,
        queue_service=args.queue_service,
        model=args.model,
        served_model_name=args.served_model_name,
        tiers_file=args.tiers,
        service_tiers=dict(args.service_tier) if args.service_tier else DEFAULT_SERVICE_TIERS,
        chat_default_max_tokens=args.chat_default_max_tokens,
        retry_after_s=args.retry_after,
        tls_dir=args.tls_dir,
    )


def main(argv: list[str] | None = None) -> int:
    configure_logging(json=True)
    config = parse_args(argv)
    try:
        if config.tls_dir is not None:  # a missing certificate: a clear error now
            TlsFiles.load(config.tls_dir, Identity(Role.OPENAI_API))
        api = build(config)
        host, port = parse_target(config.listen)
    except (OSError, ValueError) as exc:  # bad tiers file or mapping, unknown model
        log.error("openai api cannot start", error=str(exc))
        return 2
    server = uvicorn.Config(
        api.app(),
        host=host,
        port=port,
        loop="asyncio",
        http="httptools",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server.load()
    if config.tls_dir is not None:
        # Only Envoy may call: uvicorn does not show the app its peer's certificate, so the
        # handshake itself accepts the edge's certificate and no other.
        server.ssl = edge_only_server_context(config.tls_dir, Identity(Role.OPENAI_API))
    else:
        log.warning(PLAINTEXT_WARNING, listen=config.listen)
    log.info("startup heap frozen", gc_objects=freeze_startup_heap())  # (tierflow.heap)
    uvicorn.Server(server).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
