"""Predicted prefill time, fitted from measurements.

Prefilling tokens [d, L) of an L-token prompt costs a linear part (projections and MLP, per
token) and a quadratic part (attention of each new token over everything before it), plus a
fixed overhead per run:

    t(L, d) = a * (L - d) + b * (L^2 - d^2) + c        a, b, c >= 0

The coefficients are fitted by non-negative least squares on measured (L, d, seconds) samples:
at start-up from the file ``tierflow calibrate`` writes, then online from each PrefillFinished
over a bounded window, so the predictor follows the machine it runs on. The fit minimises each
sample's error relative to its time, not in seconds: in seconds the long prompts' samples
outweigh the short ones' a thousandfold, and a calibration over 32-4096 tokens predicted a
47-token prompt, the top tier's kind, 40 % short of its measured time (admission let in work
that missed by that much; docs/results.md).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "tierflow.prefill_predictor"
FORMAT_VERSION = 1
MODEL = "a*(L-d) + b*(L^2-d^2) + c"

# Fallback until calibrated: a CPU that prefills 4096 tokens in ~7 s (a ~1.5 ms/token linear
# part, the quadratic part ~1.7 s at 4096). `tierflow calibrate` replaces these.
DEFAULT_COEFFICIENTS = (1.5e-3, 1.0e-7, 0.01)
MIN_RELATIVE_S = 1e-3  # samples shorter than this are weighed as if this long


@dataclass(frozen=True)
class PrefillSample:
    prompt_tokens: int  # L
    tokens_done: int  # d: tokens already computed when the measured run started
    seconds: float  # measured busy time to compute [d, L)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or not 0 <= self.tokens_done < self.prompt_tokens:
            raise ValueError(f"need 0 <= tokens_done < prompt_tokens, got {self}")
        if not math.isfinite(self.seconds) or self.seconds < 0:
            raise ValueError(f"seconds must be finite and >= 0, got {self.seconds!r}")


def _features(prompt_tokens: np.ndarray, tokens_done: np.ndarray) -> np.ndarray:
    L = prompt_tokens.astype(np.float64)
    d = tokens_done.astype(np.float64)
    return np.column_stack([L - d, L * L - d * d, np.ones_like(L)])


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a handful of columns.

    The NNLS optimum is the unconstrained least-squares solution on its own support, so trying
    every support (7 for 3 columns) and keeping the best feasible one is exact, and simpler and
    sturdier than an active-set loop. Columns are scaled first: L^2 is ~1e7 times the constant.
    """
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best = np.zeros(x.shape[1])
    best_residual = float(y @ y)
    for size in range(1, x.shape[1] + 1):
        for support in itertools.combinations(range(x.shape[1]), size):
            cols = list(support)
            coef, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if np.any(coef < 0):
                continue
            residual = float(np.sum((xs[:, cols] @ coef - y) ** 2))
            if residual < best_residual - 1e-15 * max(best_residual, 1.0):
                best_residual = residual
                best = np.zeros(x.shape[1])
                best[cols] = coef
    return best / scale


class PrefillTimePredictor:
    """Seconds to prefill tokens [done, L) of an L-token prompt."""

    def __init__(
        self,
        a: float = DEFAULT_COEFFICIENTS[0],
        b: float = DEFAULT_COEFFICIENTS[1],
        c: float = DEFAULT_COEFFICIENTS[2],
        *,
        window: int = 256,
        min_samples: int = 8,
    ) -> None:
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples must be >= 1")
        for name, value in (("a", a), ("b", b), ("c", c)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"coefficient {name} must be finite and >= 0, got {value!r}")
        self._coef = (float(a), float(b), float(c))
        self.min_samples = min_samples
        self._samples: deque[PrefillSample] = deque(maxlen=window)
        self._reference: tuple[float, float, float] | None = None

    @property
    def coefficients(self) -> tuple[float, float, float]:
        return self._coef

    @property
    def calibrated(self) -> bool:
        """Fitted to measurements of this machine (a calibration file's or observed ones), not
        the fallback coefficients."""
        return len(self._samples) >= self.min_samples

    @property
    def reference_coefficients(self) -> tuple[float, float, float] | None:
        """The coefficients of its first calibration (a calibration file's, or its first
        online fit), kept while the online refit follows the machine: what a prefill costs on
        the worker as measured then, alone for ``tierflow calibrate``. Admission reckons a
        key's share of a tier in it (``fairness.SentRates``), so that what one key's requests
        count does not grow with the load that other keys put on the machine. None until
        calibrated."""
        return self._reference

    @property
    def window(self) -> int:
        return self._samples.maxlen or 0

    @property
    def samples(self) -> tuple[PrefillSample, ...]:
        return tuple(self._samples)

    def predict(self, prompt_tokens: int, tokens_done: int = 0) -> float:
        """Predicted seconds to compute tokens [tokens_done, prompt_tokens); 0 when none left."""
        if tokens_done >= prompt_tokens:
            return 0.0
        d = max(tokens_done, 0)
        a, b, c = self._coef
        return a * (prompt_tokens - d) + b * (prompt_tokens * prompt_tokens - d * d) + c

    def predict_partial(
        self, prompt_tokens: int, tokens_done: int, chunk_end: int, chunk_fraction: float
    ) -> float:
        """Like ``predict``, for a run stopped ``chunk_fraction`` of the way (in layers)
        through the chunk [tokens_done, chunk_end): that share of the chunk's work is done."""
        if chunk_fraction <= 0 or chunk_end <= tokens_done:
            return self.predict(prompt_tokens, tokens_done)  # no chunk under way (most calls)
        left = self.predict(prompt_tokens, tokens_done)
        a, b, _ = self._coef
        end = min(chunk_end, prompt_tokens)
        chunk = a * (end - tokens_done) + b * (end * end - tokens_done * tokens_done)
        return max(0.0, left - min(chunk_fraction, 1.0) * chunk)

    @staticmethod
    def partial_features(
        prompt_tokens: int, tokens_done: int, chunk_end: int, chunk_fraction: float
    ) -> tuple[float, float, float]:
        """(x, y, z) with ``predict_partial`` = a*x + b*y + c*z for any coefficients: the model
        is linear in them, so sums of features give sums of predictions under every refit."""
        n, d = prompt_tokens, max(tokens_done, 0)
        if d >= n:
            return (0.0, 0.0, 0.0)
        x, y = float(n - d), float(n * n - d * d)
        if chunk_fraction > 0 and chunk_end > d:
            share, end = min(chunk_fraction, 1.0), min(chunk_end, n)
            x -= share * (end - d)
            y -= share * (end * end - d * d)
        return (x, y, 1.0)

    def fit(self, samples: Iterable[PrefillSample]) -> PrefillTimePredictor:
        """Replace the window with ``samples`` (the newest ``window`` of them) and refit."""
        samples = list(samples)
        if not samples:
            raise ValueError("cannot fit the prefill predictor on no samples")
        self._samples.clear()
        self._samples.extend(samples)
        self._refit()
        return self

    def observe(self, sample: PrefillSample) -> None:
        """Add one measurement; refit once the window holds at least ``min_samples``."""
        self._samples.append(sample)
        if len(self._samples) >= self.min_samples:
            self._refit()

    def _refit(self) -> None:
        lengths = np.array([s.prompt_tokens for s in self._samples])
        done = np.array([s.tokens_done for s in self._samples])
        seconds = np.array([s.seconds for s in self._samples], dtype=np.float64)
        # Relative residuals: each row scaled by its own time (1 ms at least, so that a
        # near-zero sample cannot take over the fit).
        scale = 1.0 / np.maximum(seconds, MIN_RELATIVE_S)
        coef = _nnls(_features(lengths, done) * scale[:, None], seconds * scale)
        self._coef = (float(coef[0]), float(coef[1]), float(coef[2]))
        if self._reference is None and self.calibrated:
            self._reference = self._coef

    # ------------------------------------------------------------------ persistence

    def to_json(self) -> str:
        a, b, c = self._coef
        return json.dumps(
            {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "model": MODEL,
                "a": a,
                "b": b,
                "c": c,
                "window": self.window,
                "min_samples": self.min_samples,
                # [prompt_tokens, tokens_done, seconds]: kept so online refits continue from it
                "samples": [[s.prompt_tokens, s.tokens_done, s.seconds] for s in self._samples],
                **({"reference": list(self._reference)} if self._reference else {}),
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> PrefillTimePredictor:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a prefill predictor file (expected format {FORMAT!r})")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"prefill predictor format version {data.get('version')!r} is not supported "
                f"(this code reads version {FORMAT_VERSION})"
            )
        try:
            predictor = cls(
                float(data["a"]),
                float(data["b"]),
                float(data["c"]),
                window=int(data.get("window", 256)),
                min_samples=int(data.get("min_samples", 8)),
            )
            # Restore the window without refitting: the saved coefficients are authoritative.
            predictor._samples.extend(
                PrefillSample(int(L), int(d), float(s)) for L, d, s in data.get("samples", [])
            )
            if "reference" in data:
                a, b, c = (float(x) for x in data["reference"])
                predictor._reference = (a, b, c)
            elif predictor.calibrated:  # a file from before references were kept
                predictor._reference = predictor.coefficients
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid prefill predictor file: {exc!r}") from None
        return predictor

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically: a reader never sees half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json() + "\n", encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PrefillTimePredictor:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def __repr__(self) -> str:
        a, b, c = self._coef
        return (
            f"PrefillTimePredictor(a={a:.3g}, b={b:.3g}, c={c:.3g}, samples={len(self._samples)})"
        )
