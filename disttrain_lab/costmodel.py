"""The latency-bandwidth (alpha-beta) cost model of one message, fitted to measurements.

Sending ``n`` bytes from one rank to another takes about

    time(n) = alpha + beta * n

alpha (seconds) is the fixed cost of any message: software overhead, a network round of
handshakes.  beta (seconds per byte) is the inverse of bandwidth.  Small messages are
latency-bound (alpha dominates), large ones bandwidth-bound; the crossover is at
n = alpha / beta bytes.  Every collective's cost in later labs is a sum of such terms.

    >>> model = fit_alpha_beta([8, 8_000, 8_000_000], [50e-6, 52e-6, 1.7e-3])
    >>> print(model)            # alpha = 50 µs, beta = 0.206 ns/B (4.86 GB/s), ...
    >>> model.predict(1e6)      # seconds for a 1 MB message
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["AlphaBeta", "fit_alpha_beta"]


@dataclass(frozen=True)
class AlphaBeta:
    """time(n bytes) = alpha + beta * n."""

    alpha: float  # seconds per message (latency)
    beta: float  # seconds per byte (1 / bandwidth)

    def predict(self, nbytes):
        """Seconds to send ``nbytes`` (a number or a numpy array) as one message."""
        return self.alpha + self.beta * np.asarray(nbytes, dtype=float)

    @property
    def bandwidth(self) -> float:
        """Bytes per second for large messages (1 / beta)."""
        return float("inf") if self.beta <= 0 else 1.0 / self.beta

    @property
    def crossover_bytes(self) -> float:
        """Message size where latency and bandwidth cost the same (alpha / beta)."""
        return float("inf") if self.beta <= 0 else self.alpha / self.beta

    def __str__(self) -> str:
        return (
            f"alpha = {self.alpha * 1e6:.1f} µs, beta = {self.beta * 1e9:.3g} ns/B "
            f"({self.bandwidth / 1e9:.3g} GB/s), crossover at {self.crossover_bytes / 1e3:.3g} kB"
        )


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares fit of ``seconds = alpha + beta * nbytes``.

    Measured sizes usually span 1 B to megabytes, so a plain least-squares fit would be
    decided by the largest messages and say nothing about alpha.  We minimise the
    *relative* error instead (each point weighted by 1 / its time), so a 10 µs point
    counts as much as a 10 ms one.  At least two distinct sizes are needed.
    """
    n = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if n.shape != t.shape or n.ndim != 1:
        raise ValueError(f"nbytes and seconds must be two lists of the same length, got shapes {n.shape} and {t.shape}")
    if len(np.unique(n)) < 2:
        raise ValueError(f"fitting alpha and beta needs at least two different message sizes, got {n.tolist()}")
    if not np.all(t > 0):
        raise ValueError(f"every time must be > 0 seconds, got {t.tolist()}")
    weights = 1.0 / t
    design = np.stack([np.ones_like(n), n], axis=1) * weights[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, t * weights, rcond=None)
    return AlphaBeta(alpha=float(alpha), beta=float(beta))
