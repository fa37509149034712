"""Bootstrap intervals for ROUGE: one method's client average, and paired differences between two methods.

Both resample test examples *within* each client (the clients are fixed, not a sample) and report the client
average, the paper's headline number: the mean over clients of each client's mean over its examples.

Paired comparisons score both methods on the same resampled examples. Seeds are handled explicitly: the two
methods are paired seed by seed (seed s of A against seed s of B, on the seeds both have); with several seeds each
bootstrap replicate also redraws the seeds with replacement (a two-level bootstrap), so the interval covers
seed-to-seed variation as well as the choice of test examples. With one seed it covers the test examples only.

The interval is the percentile interval of the replicates (numpy's linear quantiles). The two-sided p-value is
that interval's dual: the smallest 1 - level at which the percentile interval, computed the same way, excludes 0.
So "the interval excludes 0" and "p < 1 - level" never disagree, which a p from replicates shifted to the null
does on skewed, tied replicates (many identical summaries). Identical scores give d = 0 and p = 1; B replicates
can show p no smaller than 1 / (1 + B).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import Field

from pipeline.common.config import Fraction, config


@config(frozen=True)
class BootstrapConfig:
    """The `bootstrap` params (shared by the evaluate and report stages)."""

    n_resamples: Annotated[int, Field(ge=100)] = 10000
    level: Annotated[float, Field(gt=0.5, lt=1.0)] = 0.95
    seed: int = 0
    # A comparison where more than this fraction of the paired summaries are identical text is flagged: its
    # difference (or its absence) says more about the training budget than about the methods.
    identical_warning: Fraction = 0.5


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    p_value: float  # two-sided, against 0 (NaN for a one-sample interval of a mean)
    n_examples: int
    n_seeds: int

    @property
    def significant(self) -> bool:
        """The interval excludes zero."""
        return bool(self.low > 0.0 or self.high < 0.0)


def _replicates(per_client: list[np.ndarray], cfg: BootstrapConfig) -> tuple[float, np.ndarray]:
    """(observed client average, B bootstrap replicates of it) for per-client arrays [n_seeds, n_examples_c]."""
    if not per_client:
        raise ValueError("bootstrap: no client has scores")
    n_seeds = {a.shape[0] for a in per_client}
    if len(n_seeds) != 1 or 0 in n_seeds or any(a.shape[1] == 0 for a in per_client):
        raise ValueError("bootstrap: every client needs the same seeds and at least one example")
    s = n_seeds.pop()
    rng = np.random.default_rng(cfg.seed)
    b = cfg.n_resamples
    # Seed weights: how often each seed is drawn in a replicate, / s (all ones with one seed).
    seed_w = np.ones((b, s)) if s == 1 else np.stack([np.bincount(r, minlength=s) for r in
                                                      rng.integers(0, s, size=(b, s))]) / s
    observed = float(np.mean([a.mean() for a in per_client]))
    total = np.zeros(b)
    for a in per_client:
        n = a.shape[1]
        idx = rng.integers(0, n, size=(b, n))
        means = a[:, idx].mean(axis=2)  # [s, b]: each seed's mean over the resampled examples
        total += (seed_w * means.T).sum(axis=1)
    return observed, total / len(per_client)


def _interval(observed: float, reps: np.ndarray, cfg: BootstrapConfig, p_value: float, n: int, s: int) -> Interval:
    alpha = 1.0 - cfg.level
    low, high = np.quantile(reps, [alpha / 2, 1 - alpha / 2])
    return Interval(observed, float(low), float(high), p_value, n, s)


def mean_interval(per_client: list[np.ndarray], cfg: BootstrapConfig) -> Interval:
    """Interval of one method's client-average score; ``per_client``: one array [n_seeds, n_examples] a client."""
    arrays = [np.atleast_2d(np.asarray(a, dtype=float)) for a in per_client]
    observed, reps = _replicates(arrays, cfg)
    return _interval(observed, reps, cfg, float("nan"), sum(a.shape[1] for a in arrays), arrays[0].shape[0])


def paired_difference(a_per_client: list[np.ndarray], b_per_client: list[np.ndarray],
                      cfg: BootstrapConfig) -> Interval:
    """Interval and p-value of mean(A) - mean(B) on the client average; arrays [n_seeds, n_examples] a client,
    aligned: row s of A and of B are the same seed, column i the same test example."""
    diffs = []
    for a, b in zip(a_per_client, b_per_client, strict=True):
        a, b = np.atleast_2d(np.asarray(a, dtype=float)), np.atleast_2d(np.asarray(b, dtype=float))
        if a.shape != b.shape:
            raise ValueError(f"paired bootstrap: shapes differ {a.shape} vs {b.shape} (pair seeds and examples first)")
        diffs.append(a - b)
    observed, reps = _replicates(diffs, cfg)
    p = max(1.0 / (1 + len(reps)), min(1.0, _level_excluding_zero(reps), _level_excluding_zero(-reps)))
    return _interval(observed, reps, cfg, p, sum(d.shape[1] for d in diffs), diffs[0].shape[0])


def _level_excluding_zero(reps: np.ndarray) -> float:
    """The alpha above which np.quantile(reps, alpha / 2) > 0: twice the fractional rank of 0 among the sorted
    replicates under linear interpolation (0 when every replicate is positive, 2 when none is)."""
    x = np.sort(reps)
    k = int(np.searchsorted(x, 0.0, side="right"))  # replicates <= 0
    if k == 0:
        return 0.0
    if k == len(x):
        return 2.0
    rank = k - 1 + (0.0 - x[k - 1]) / (x[k] - x[k - 1])
    return 2.0 * rank / (len(x) - 1)
