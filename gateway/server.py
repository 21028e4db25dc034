"""The gateway process: Envoy's ext_authz service, with gRPC health and reflection.

    python -m gateway.server --listen 127.0.0.1:50052 --keys config/keys.toml \
        --tiers config/tiers.toml

SIGHUP re-reads the keys file now (it is also re-read when it changes); a broken file is
refused and the keys in force stay. SIGTERM/SIGINT stop gracefully: health turns NOT_SERVING,
no new calls, in-flight Checks get a grace period.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

import grpc
import structlog
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.authz import Authorizer
from gateway.config import GatewayConfig
from gateway.keys import KeyStore
from gateway.metrics import GatewayMetrics
from tierflow.heap import freeze_startup_heap, time_collections
from tierflow.identity import Identity, Role, add_port, add_tls_arguments
from tierflow.logging import configure_logging
from tierflow.metrics import add_metrics_arguments, serve_metrics
from tierflow.tiers import load_tiers

log = structlog.get_logger("gateway")

AUTHZ_SERVICE = external_auth_pb2.DESCRIPTOR.services_by_name["Authorization"].full_name


class Gateway:
    """Builds the servicers and the server; ``run`` serves until SIGTERM/SIGINT."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.tiers = load_tiers(config.tiers_file)
        self.keys = KeyStore(
            config.keys_file, self.tiers, check_interval_s=config.keys_check_interval_s
        )
        self.metrics = GatewayMetrics(config.deployment)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server()
        external_auth_pb2_grpc.add_AuthorizationServicer_to_server(
            Authorizer(self.keys, self.metrics, mtls=config.tls_dir is not None), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                AUTHZ_SERVICE,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        self.port = add_port(
            self.server, config.listen, config.tls_dir, Identity(Role.GATEWAY), log
        )
        if self.port == 0:
            raise OSError(f"cannot listen on {config.listen}")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        await self.server.start()
        endpoint = serve_metrics(
            self.metrics.registry, self.config.metrics_port, self.config.metrics_host
        )
        for service in ("", AUTHZ_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "gateway ready",
            port=self.port,
            keys=len(self.keys.table),
            keys_file=str(self.config.keys_file),
            tiers=list(self.tiers.names),
            metrics_port=endpoint.port if endpoint else None,
        )
        await stopping.wait()
        log.info("stopping")
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.grace_s)
        if endpoint is not None:
            endpoint.close()
        log.info("stopped")

    def _on_sighup(self) -> None:
        log.info("SIGHUP: reloading keys", keys_file=str(self.config.keys_file))
        self.keys.reload()


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m gateway.server", description=__doc__.split("\n")[0])
    p.add_argument("--listen", default=GatewayConfig.listen, help="host:port (port 0: any free)")
    p.add_argument("--keys", type=Path, default=GatewayConfig.keys_file, help="keys TOML file")
    p.add_argument("--tiers", type=Path, help="tiers TOML (default $TIERFLOW_TIERS_FILE or config)")
    p.add_argument(
        "--keys-check-interval",
        type=float,
        default=GatewayConfig.keys_check_interval_s,
        help="seconds between looks at the keys file's mtime (0: at every Check)",
    )
    p.add_argument("--deployment", default=GatewayConfig.deployment, help="metrics label")
    add_metrics_arguments(p)
    add_tls_arguments(p)
    args = p.parse_args(argv)
    return GatewayConfig(
        listen=args.listen,
        keys_file=args.keys,
        tiers_file=args.tiers,
        keys_check_interval_s=args.keys_check_interval,
        deployment=args.deployment,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        tls_dir=args.tls_dir,
    )


async def serve(config: GatewayConfig) -> None:
    # Built inside the running loop: a grpc.aio server binds to the loop it was created on.
    gateway = Gateway(config)  # loads the keys and the tiers
    log.info("startup heap frozen", gc_objects=freeze_startup_heap())  # (tierflow.heap)
    time_collections(gateway.metrics.registry, config.deployment)
    await gateway.run()


def main(argv: list[str] | None = None) -> int:
    configure_logging(json=True)
    config = parse_args(argv)
    try:
        asyncio.run(serve(config))
    except (OSError, ValueError) as exc:  # bad keys/tiers file or certificate, port taken
        log.error("gateway cannot start", error=str(exc))
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
