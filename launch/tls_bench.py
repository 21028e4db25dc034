"""`tierflow bench --tls`: the time to first token that mTLS adds through the whole stack, as
the increment over plaintext in one run.

The same local stack (Kafka, the queue service, one worker, the gateway, the OpenAI service
and Envoy; ``launch.local_stack``) is started in turn with every hop into the queue service
and the gateway, and every Kafka client, over mTLS (the default; the broker enforcing its ACLs)
and all in plaintext. Rounds alternate which goes first.
Each start sends a few warm-up requests, then ``requests`` idle critical requests one at a
time through Envoy with the demo critical key: a one-token answer to a short prompt, timed
from send to the first token at the client. What differs between the two is only TLS on the
hops behind Envoy and to Kafka (the client reaches Envoy in plaintext either way).

Reported: n, p50 and p99 of each, and the increment (mTLS - plaintext) at p50 and p99 with
bootstrap 95 % intervals over requests (``scipy.stats.bootstrap``).
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from scipy.stats import bootstrap

from gateway.demo_keys import DEMO_KEYS
from launch.local_stack import LocalStack, StackConfig
from launch.stack_bench import ttft_ms
from tierflow.client import TierflowClient

MODES = ("mtls", "plaintext")


@dataclass(frozen=True)
class TlsBenchConfig:
    model: str = "tiny-llama"  # the hops are what is measured, not the model
    rounds: int = 4  # stack starts per mode, alternating which mode goes first
    requests: int = 100  # timed requests per start
    warmup: int = 10  # untimed requests per start (connections, caches)
    prompt_tokens: int = 16
    seed: int = 0


def measure_once(cfg: TlsBenchConfig, mode: str, rng: random.Random, work: Path) -> list[float]:
    """One stack start in ``mode``: the TTFTs (ms) of its timed requests."""
    tls_dir = work / "certs" if mode == "mtls" else None
    stack_cfg = StackConfig(
        model=cfg.model,
        log_dir=work / f"stack-{mode}",
        tls_dir=tls_dir,
        # Back to back, one key's requests would outrun its shipped bucket: what is measured
        # here is the hops, not the limit.
        rate_limits={"critical": (1000, 1000.0)},
    )
    prompts = [
        [rng.randrange(5, 4000) for _ in range(cfg.prompt_tokens)]
        for _ in range(cfg.warmup + cfg.requests)
    ]
    with LocalStack(stack_cfg) as stack:
        client = TierflowClient(stack.endpoints.envoy, api_key=DEMO_KEYS["critical"])
        try:
            samples = [ttft_ms(client, p) for p in prompts]
        finally:
            client.close()
    return samples[cfg.warmup :]


def increment_ci(mtls: list[float], plain: list[float], q: float) -> tuple[float, float, float]:
    """The q-th percentile of mTLS minus plaintext, and its bootstrap 95 % interval."""

    def statistic(a, b, axis=-1):
        return np.percentile(a, q, axis=axis) - np.percentile(b, q, axis=axis)

    point = float(statistic(np.asarray(mtls), np.asarray(plain)))
    result = bootstrap(
        (np.asarray(mtls), np.asarray(plain)), statistic, method="percentile",
        n_resamples=2000, random_state=np.random.default_rng(0),
    )  # fmt: skip
    low, high = result.confidence_interval
    return point, float(low), float(high)


def summarise(samples: dict[str, list[float]]) -> dict:
    mtls, plain = samples["mtls"], samples["plaintext"]
    out: dict = {
        mode: {
            "n": len(values),
            "p50_ms": float(np.percentile(values, 50)),
            "p99_ms": float(np.percentile(values, 99)),
        }
        for mode, values in samples.items()
    }
    for q in (50, 99):
        point, low, high = increment_ci(mtls, plain, q)
        out[f"increment_p{q}_ms"] = {"value": point, "ci95": [low, high]}
    return out


def run(cfg: TlsBenchConfig, console: Console) -> dict:
    rng = random.Random(cfg.seed)
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    order: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tierflow-tls-bench-") as tmp:
        for r in range(cfg.rounds):
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                console.print(f"round {r + 1}/{cfg.rounds}: {mode}")
                samples[mode] += measure_once(cfg, mode, rng, Path(tmp))
                order.append(mode)
    return {"config": cfg.__dict__, "run_order": order, "samples_ms": samples, **summarise(samples)}


def render(result: dict, console: Console) -> None:
    table = Table(title="TTFT through the whole stack (Envoy, gateway, queue service, worker)")
    for column in ("", "n", "p50 ms", "p99 ms"):
        table.add_column(column, justify="right")
    for mode in MODES:
        row = result[mode]
        table.add_row(mode, str(row["n"]), f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}")
    console.print(table)
    for q in (50, 99):
        inc = result[f"increment_p{q}_ms"]
        low, high = inc["ci95"]
        console.print(
            f"mTLS - plaintext at p{q}: {inc['value']:+.2f} ms (95 % bootstrap CI "
            f"{low:+.2f} .. {high:+.2f})"
        )


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        values = np.sort(result["samples_ms"][mode])
        ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=mode)
    ax.set_xlabel("TTFT through the stack (ms)")
    ax.set_ylabel("fraction of requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(cfg: TlsBenchConfig, json_path: Path | None, png_path: Path | None) -> dict:
    console = Console()
    result = run(cfg, console)
    render(result, console)
    if json_path:
        json_path.write_text(json.dumps(result, indent=2))
        console.print(f"wrote {json_path}")
    if png_path:
        plot(result, png_path)
        console.print(f"wrote {png_path}")
    return result
