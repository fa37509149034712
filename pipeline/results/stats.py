"""Intervals for ROUGE's client average (mean over the fixed clients of each client's mean over its test examples):
one method's, and paired differences (seed s of A against seed s of B, example by example): docs/statistics.md."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
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
    n_seeds: int


def _checked(
    per_client: list[np.ndarray], clusters: list[np.ndarray] | None
) -> tuple[int, list[np.ndarray], list[np.ndarray] | None]:
    """The number of seeds every client's [n_seeds, n_examples] array has; per client each example's group as
    0..G-1 (every example its own group without ``clusters``); and where a group spans clients (an id in several
    clients' ``clusters``: a meeting whose queries the iid partition split between them), each example's group as
    0..G-1 over all clients, else None."""
    if not per_client:
        raise ValueError("bootstrap: no client has scores")
    n_seeds = {a.shape[0] for a in per_client}
    if len(n_seeds) != 1 or 0 in n_seeds or any(a.shape[1] == 0 for a in per_client):
        raise ValueError("bootstrap: every client needs the same seeds and at least one example")
    if clusters is None:
        return n_seeds.pop(), [np.arange(a.shape[1]) for a in per_client], None
    if len(clusters) != len(per_client):
        raise ValueError(f"bootstrap: {len(clusters)} cluster arrays for {len(per_client)} clients")
    out = []
    for a, c in zip(per_client, clusters, strict=True):
        c = np.asarray(c)
        if c.shape != (a.shape[1],):
            raise ValueError(f"bootstrap: {c.shape[0] if c.ndim else 0} cluster ids for {a.shape[1]} examples")
        out.append(np.unique(c, return_inverse=True)[1].ravel())
    if not spans_clients(clusters):
        return n_seeds.pop(), out, None
    codes = np.unique(np.concatenate([np.asarray(c) for c in clusters]), return_inverse=True)[1].ravel()
    return n_seeds.pop(), out, np.split(codes, np.cumsum([g.size for g in out])[:-1])


def spans_clients(clusters: list) -> bool:
    """Whether a group id is in several clients' ``clusters`` (a meeting whose queries the iid partition split)."""
    return len(np.unique(np.concatenate([np.asarray(c) for c in clusters]))) < sum(len(np.unique(c)) for c in clusters)


def _replicates(
    per_client: list[np.ndarray], groups: list[np.ndarray], cfg: BootstrapConfig, joint: list[np.ndarray] | None = None
) -> np.ndarray:
    """The B bootstrap replicates of one seed's client average (per-client arrays [1, n_c]): each client's groups
    (its examples, or its meetings) drawn with replacement, the replicate's client mean = the drawn groups' score sum
    over their example count; with ``joint`` (groups that span clients) the groups of all clients drawn once for all
    (a replicate where a client drew none of its own is left out)."""
    rng = np.random.default_rng(cfg.seed)
    total, n_all = np.zeros(cfg.n_resamples), 0 if joint is None else int(max(j.max() for j in joint)) + 1
    shared = rng.integers(0, n_all, size=(cfg.n_resamples, n_all)) if n_all else None
    for a, g in zip(per_client, joint or groups, strict=True):
        sums, sizes = np.bincount(g, weights=a[0], minlength=n_all), np.bincount(g, minlength=n_all).astype(float)
        idx = rng.integers(0, len(sums), size=(cfg.n_resamples, len(sums))) if shared is None else shared
        with np.errstate(invalid="ignore"):
            total += sums[idx].sum(axis=1) / sizes[idx].sum(axis=1)
    return total[~np.isnan(total)] / len(per_client)


def _cluster_variance(xs: list[np.ndarray], gs: list[np.ndarray]) -> float:
    """Cluster-robust variance of the sum of the means of each ``x`` [..., n] (rows: independent replications
    summed): the squared group sums of the centred values (over n), G / (G - 1) small-sample factor, an id in several
    ``gs`` one group; of one ``x`` with one example a group, var(ddof=1) / n."""
    n, n_groups = xs[0].shape[-1], int(max(g.max() for g in gs)) + 1
    if n_groups < 2:
        return 0.0
    sums = 0.0
    for x, g in zip(xs, gs, strict=True):
        centred = np.atleast_2d(x - x.mean(axis=-1, keepdims=True)) * (n / x.shape[-1])  # each x's mean weighs 1
        sums = sums + np.stack([np.bincount(g, weights=row, minlength=n_groups) for row in centred])
    return float((sums**2).sum() / n**2 * n_groups / (n_groups - 1))


def _seeds_t(
    per_client: list[np.ndarray], groups: list[np.ndarray], cfg: BootstrapConfig, joint: list[np.ndarray] | None = None
) -> Interval:
    """The several-seeds t-interval of the client average and its two-sided p: variance = between-seed variance of
    the per-seed client averages / s + example-level variance of the seed-averaged scores - the seed x example
    residual both contain, floored at the larger of the first two; Welch-Satterthwaite df. The example-level parts
    are cluster-robust over ``groups`` (examples of one meeting are not independent), or over ``joint`` where groups
    span clients, with df = groups - clients."""
    s, k = per_client[0].shape[0], len(per_client)
    by_seed = np.mean([a.mean(axis=1) for a in per_client], axis=0)  # [s]: each seed's client average
    means = [a.mean(axis=0) for a in per_client]
    resid = [a - a.mean(axis=0) - a.mean(axis=1, keepdims=True) + a.mean() for a in per_client]
    # per client, or all at once where groups span clients: the example-level variance of the seed-averaged mean, and
    # the seed x example residual's share
    units = [([m], [r], [g]) for m, r, g in zip(means, resid, groups)] if joint is None else [(means, resid, joint)]
    v_ex = sum(_cluster_variance(m, g) for m, _, g in units) / k**2
    v_res = sum(_cluster_variance(r, g) / ((s - 1) * s) for _, r, g in units) / k**2
    v_seed = by_seed.var(ddof=1) / s
    var = max(v_seed + v_ex - v_res, v_seed, v_ex)
    df_ex = max(sum(int(max(x.max() for x in g)) + 1 for _, _, g in units) - k, 1)
    return _t(float(by_seed.mean()), var, (v_seed, s - 1), (v_ex, df_ex), s, cfg)


def _t(estimate: float, var: float, seed: tuple, ex: tuple, s: int, cfg: BootstrapConfig) -> Interval:
    """t-interval and two-sided p of ``estimate`` with variance ``var``, Welch-Satterthwaite df from its seed and
    example parts (variance, df): var^2 / (v_seed^2 / df_seed + v_ex^2 / df_ex)."""
    df = var**2 / (seed[0] ** 2 / seed[1] + ex[0] ** 2 / ex[1]) if var > 0 else math.inf
    se = math.sqrt(var)
    half = float(sps.t.ppf(0.5 + cfg.level / 2, df)) * se
    p = 1.0 if estimate == 0.0 else (0.0 if se == 0 else float(2 * sps.t.sf(abs(estimate) / se, df)))
    return Interval(estimate, estimate - half, estimate + half, p, s)


def nested_interval(
    per_seed: list[list[np.ndarray]], cfg: BootstrapConfig, clusters: list, paired: bool = True, crossed: bool = False
) -> Interval:
    """The client average's interval where each seed has its own test examples (a partition re-divided per seed):
    ``per_seed[s]`` one 1-D array a client (A - B on seed s's examples, or with ``paired=False`` one method's
    scores), the same clients in every seed; ``clusters[s]`` as for :func:`paired_difference`. One seed: as
    :func:`paired_difference` / :func:`mean_interval`. Several: D_s the seed's client average, estimate mean D_s,
    variance max(var(D_s, ddof=1) / S, sum_s v_s / S^2), v_s D_s's cluster-robust variance within its seed; the
    t of :func:`_seeds_t` (df_seed S - 1, df_ex the seeds' groups - clients summed); docs/statistics.md. With
    ``crossed`` every seed has the same test examples (a fixed test split): each client's seeds stacked
    [n_seeds, n_examples] into :func:`mean_interval`, seeds crossed with examples."""
    arrays = [[np.atleast_2d(np.asarray(x, dtype=float)) for x in xs] for xs in per_seed]
    if crossed or len(arrays) == 1:
        return mean_interval([np.vstack(x) for x in zip(*arrays)], cfg, clusters[0], paired)
    by_seed, v_ex, df_ex = [], 0.0, 0
    for xs, cl in zip(arrays, clusters, strict=True):
        groups, joint = _checked(xs, cl)[1:]
        units = [([x], [g]) for x, g in zip(xs, groups)] if joint is None else [(xs, joint)]
        v_ex += sum(_cluster_variance(x, g) for x, g in units) / len(xs) ** 2 / len(arrays) ** 2
        df_ex += sum(int(max(x.max() for x in g)) + 1 for _, g in units) - len(xs)
        by_seed.append(np.mean([x.mean() for x in xs]))
    s = len(arrays)
    v_seed = float(np.var(by_seed, ddof=1)) / s
    r = _t(float(np.mean(by_seed)), max(v_seed, v_ex), (v_seed, s - 1), (v_ex, max(df_ex, 1)), s, cfg)
    return r if paired else dataclasses.replace(r, p_value=math.nan)


def mean_interval(
    per_client: list[np.ndarray], cfg: BootstrapConfig, clusters: list[np.ndarray] | None = None, paired: bool = False
) -> Interval:
    """Interval of one method's client-average score, or with ``paired`` of paired differences A - B and its p (as
    :func:`paired_difference`); ``per_client``: one array [n_seeds, n_examples] a client; ``clusters``: as for
    :func:`paired_difference`."""
    arrays = [np.atleast_2d(np.asarray(a, dtype=float)) for a in per_client]
    seeds, groups, joint = _checked(arrays, clusters)
    observed = float(np.mean([a.mean() for a in arrays]))
    if any(g.max() == 0 for g in groups):  # a client of one meeting (or example): its spread is unknown
        return Interval(observed, *[math.nan] * 3, seeds)
    if seeds > 1:
        r = _seeds_t(arrays, groups, cfg, joint)
        return r if paired else dataclasses.replace(r, p_value=math.nan)
    reps, alpha = _replicates(arrays, groups, cfg, joint), 1.0 - cfg.level
    low, high = np.quantile(reps, [alpha / 2, 1 - alpha / 2])  # the percentile interval
    # one seed: p is the interval's dual, the smallest 1 - level at which it excludes 0
    p = max(1.0 / (1 + len(reps)), min(1.0, _level_excluding_zero(reps), _level_excluding_zero(-reps)))
    return Interval(observed, float(low), float(high), p if paired else math.nan, 1)


def paired_difference(
    a_per_client: list[np.ndarray],
    b_per_client: list[np.ndarray],
    cfg: BootstrapConfig,
    clusters: list[np.ndarray] | None = None,
) -> Interval:
    """Interval and p-value of mean(A) - mean(B) on the client average; arrays [n_seeds, n_examples] a client,
    aligned: row s of A and of B are the same seed, column i the same test example. ``clusters``: one array of
    group ids a client, aligned with its examples (QMSum: the meeting), making the example part of the variance
    cluster-robust (one seed: groups resampled); None: every example its own. A client of one: NaN, no test."""
    diffs = []
    for a, b in zip(a_per_client, b_per_client, strict=True):
        a, b = np.atleast_2d(np.asarray(a, dtype=float)), np.atleast_2d(np.asarray(b, dtype=float))
        if a.shape != b.shape:
            raise ValueError(f"paired bootstrap: shapes differ {a.shape} vs {b.shape} (pair seeds and examples first)")
        diffs.append(a - b)
    return mean_interval(diffs, cfg, clusters, paired=True)


def holm(p_values: np.ndarray) -> np.ndarray:
    """Holm's step-down adjustment of a family of p-values (NaN stays NaN and is not counted): the i-th smallest
    p times (m - i + 1), made non-decreasing, capped at 1. Reject where the adjusted p < alpha: the family-wise
    error rate is at most alpha."""
    p = np.asarray(p_values, dtype=float)
    out = np.full(p.shape, math.nan)
    ok = np.flatnonzero(~np.isnan(p))
    order = ok[np.argsort(p[ok], kind="stable")]
    m = len(order)
    out[order] = np.minimum(1.0, np.maximum.accumulate(p[order] * (m - np.arange(m))))
    return out


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


def meetings(ids_per_client: Iterable[Iterable[str]]) -> list[np.ndarray] | None:
    """Per client, the meeting of each test example, the cluster of the paired intervals (pipeline.results.stats):
    a QMSum query's id is ``qmsum/<domain>/<split>/<meeting>/<query>``, so queries on one meeting share everything
    before the last slash; any other example (one summary a dialogue or meeting) is its own cluster. None when no
    example is a QMSum query: the examples are independent."""
    ids = [[str(i) for i in client] for client in ids_per_client]
    if not any(i.startswith("qmsum/") for client in ids for i in client):
        return None
    return [np.array([i.rsplit("/", 1)[0] if i.startswith("qmsum/") else i for i in client]) for client in ids]


def bootstrap_method(clusters: list[np.ndarray] | None) -> str:
    """How the evaluate stage's intervals resampled (clusters: :func:`meetings`), in words: metrics.json ci.method."""
    unit, what = ("test examples",) * 2 if clusters is None else ("meetings (with all their queries)", "test meetings")
    where = "once for every client" if clusters is not None and spans_clients(clusters) else "within clients"
    return f"percentile bootstrap of the client average, {unit} resampled {where} (one seed: the choice of {what} only)"
