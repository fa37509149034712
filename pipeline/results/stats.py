"""Intervals for ROUGE's client average (mean over the fixed clients of each client's mean over its test examples):
one method's, and paired differences (seed s of A against seed s of B, example by example): docs/statistics.md."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import Field
from scipy import stats as sps

from pipeline.common.config import Fraction, config


@config(frozen=True)
class BootstrapConfig:  # the `bootstrap` params (shared by the evaluate and report stages)
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


def _one_seed(per_client: list[np.ndarray], cfg: BootstrapConfig) -> tuple[Interval, np.ndarray]:
    """The percentile interval of one seed's client average (per-client arrays [1, n_c]; p NaN) and its B
    example-bootstrap replicates."""
    rng = np.random.default_rng(cfg.seed)
    total = np.zeros(cfg.n_resamples)
    for a in per_client:
        idx = rng.integers(0, a.shape[1], size=(cfg.n_resamples, a.shape[1]))
        total += a[0, idx].mean(axis=1)
    reps, alpha = total / len(per_client), 1.0 - cfg.level
    low, high = np.quantile(reps, [alpha / 2, 1 - alpha / 2])
    observed = float(np.mean([a.mean() for a in per_client]))
    return Interval(observed, float(low), float(high), math.nan, sum(a.shape[1] for a in per_client), 1), reps


def _checked(per_client: list[np.ndarray]) -> int:
    """The number of seeds every client's [n_seeds, n_examples] array has."""
    if not per_client:
        raise ValueError("bootstrap: no client has scores")
    n_seeds = {a.shape[0] for a in per_client}
    if len(n_seeds) != 1 or 0 in n_seeds or any(a.shape[1] == 0 for a in per_client):
        raise ValueError("bootstrap: every client needs the same seeds and at least one example")
    return n_seeds.pop()


def _seeds_t(per_client: list[np.ndarray], cfg: BootstrapConfig) -> Interval:
    """The several-seeds t-interval of the client average and its two-sided p: variance = between-seed variance of
    the per-seed client averages / s + example-level variance of the seed-averaged scores - the seed x example
    residual both contain (residual mean square), floored at the larger of the first two; Welch-Satterthwaite df."""
    s, k = per_client[0].shape[0], len(per_client)
    by_seed = np.mean([a.mean(axis=1) for a in per_client], axis=0)  # [s]: each seed's client average
    n = np.array([a.shape[1] for a in per_client])
    # per client: the example-level variance of the seed-averaged mean, and the seed x example residual's share
    v_ex = sum(a.mean(axis=0).var(ddof=1) / a.shape[1] if a.shape[1] > 1 else 0.0 for a in per_client) / k**2
    resid = [a - a.mean(axis=0) - a.mean(axis=1, keepdims=True) + a.mean() for a in per_client]
    v_res = sum((r**2).sum() / ((s - 1) * max(r.shape[1] - 1, 1)) / (s * r.shape[1]) for r in resid) / k**2
    v_seed = by_seed.var(ddof=1) / s
    var = max(v_seed + v_ex - v_res, v_seed, v_ex)
    df_ex = max(int(n.sum()) - k, 1)
    df = var**2 / (v_seed**2 / (s - 1) + v_ex**2 / df_ex) if var > 0 else math.inf
    estimate, se = float(by_seed.mean()), math.sqrt(var)
    half = float(sps.t.ppf(0.5 + cfg.level / 2, df)) * se
    p = 1.0 if estimate == 0.0 else (0.0 if se == 0 else float(2 * sps.t.sf(abs(estimate) / se, df)))
    return Interval(estimate, estimate - half, estimate + half, p, int(n.sum()), s)


def mean_interval(per_client: list[np.ndarray], cfg: BootstrapConfig) -> Interval:
    """Interval of one method's client-average score; ``per_client``: one array [n_seeds, n_examples] a client."""
    arrays = [np.atleast_2d(np.asarray(a, dtype=float)) for a in per_client]
    if _checked(arrays) > 1:
        return dataclasses.replace(_seeds_t(arrays, cfg), p_value=math.nan)
    return _one_seed(arrays, cfg)[0]


def paired_difference(a_per_client: list[np.ndarray], b_per_client: list[np.ndarray], cfg: BootstrapConfig) -> Interval:
    """Interval and p-value of mean(A) - mean(B) on the client average; arrays [n_seeds, n_examples] a client,
    aligned: row s of A and of B are the same seed, column i the same test example."""
    diffs = []
    for a, b in zip(a_per_client, b_per_client, strict=True):
        a, b = np.atleast_2d(np.asarray(a, dtype=float)), np.atleast_2d(np.asarray(b, dtype=float))
        if a.shape != b.shape:
            raise ValueError(f"paired bootstrap: shapes differ {a.shape} vs {b.shape} (pair seeds and examples first)")
        diffs.append(a - b)
    if _checked(diffs) > 1:
        return _seeds_t(diffs, cfg)
    interval, reps = _one_seed(diffs, cfg)
    # one seed: p is the interval's dual, the smallest 1 - level at which it excludes 0
    p = max(1.0 / (1 + len(reps)), min(1.0, _level_excluding_zero(reps), _level_excluding_zero(-reps)))
    return dataclasses.replace(interval, p_value=p)


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
