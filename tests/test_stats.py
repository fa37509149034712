"""Bootstrap intervals against hand-computed cases (pipeline.results.stats)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from pipeline.results.stats import (
    BootstrapConfig,
    Interval,
    bootstrap_method,
    holm,
    mean_interval,
    meetings,
    nested_interval,
    paired_difference,
)

CFG = BootstrapConfig(n_resamples=2000, seed=0)


def excludes_zero(r) -> bool:  # what the tables' significant column is before Holm's adjustment
    return bool(r.low > 0.0 or r.high < 0.0)


def test_identical_scores_give_zero_difference_and_p_one():
    a = [np.array([[10.0, 20.0, 30.0]]), np.array([[5.0, 7.0]])]
    r = paired_difference(a, [x.copy() for x in a], CFG)
    assert r.estimate == 0.0 and r.low == 0.0 and r.high == 0.0
    assert r.p_value == 1.0 and not excludes_zero(r)
    assert r.n_seeds == 1


def test_constant_shift_gives_that_shift_and_a_tight_interval():
    rng = np.random.default_rng(3)
    b = [rng.uniform(0, 40, size=(1, 12)), rng.uniform(0, 40, size=(1, 30))]
    a = [x + 1.5 for x in b]
    r = paired_difference(a, b, CFG)
    assert r.estimate == pytest.approx(1.5, abs=1e-12)
    assert r.low == pytest.approx(1.5, abs=1e-9) and r.high == pytest.approx(1.5, abs=1e-9)
    assert excludes_zero(r)
    assert r.p_value == pytest.approx(1 / (CFG.n_resamples + 1))  # the smallest p B replicates can show


def test_client_average_weighs_clients_equally_not_examples():
    # client 1: 2 examples, difference 4; client 2: 8 examples, difference 0 -> client average 2 (example mean 0.8)
    a = [np.array([[4.0, 4.0]]), np.zeros((1, 8))]
    b = [np.zeros((1, 2)), np.zeros((1, 8))]
    assert paired_difference(a, b, CFG).estimate == pytest.approx(2.0)
    assert mean_interval(a, CFG).estimate == pytest.approx(2.0)


def test_the_seed_of_the_resampling_fixes_the_output():
    rng = np.random.default_rng(0)
    a, b = [rng.normal(10, 3, size=(1, 20))], [rng.normal(10, 3, size=(1, 20))]  # one seed: the bootstrap
    r1 = paired_difference(a, b, BootstrapConfig(n_resamples=500, seed=7))
    r2 = paired_difference(a, b, BootstrapConfig(n_resamples=500, seed=7))
    r3 = paired_difference(a, b, BootstrapConfig(n_resamples=500, seed=8))
    assert r1 == r2
    assert (r1.low, r1.high) != (r3.low, r3.high)


def test_interval_matches_the_normal_approximation_for_a_large_sample():
    """For n = 400 paired differences ~ N(1, 2^2) the percentile interval approaches mean ± 1.96 * sd / sqrt(n)."""
    rng = np.random.default_rng(1)
    d = rng.normal(1.0, 2.0, size=400)
    r = paired_difference([d[None, :]], [np.zeros((1, 400))], BootstrapConfig(n_resamples=4000, seed=0))
    half = 1.96 * d.std(ddof=1) / np.sqrt(400)
    assert r.estimate == pytest.approx(d.mean())
    assert r.low == pytest.approx(d.mean() - half, abs=0.03)
    assert r.high == pytest.approx(d.mean() + half, abs=0.03)
    assert r.p_value < 0.001


def test_seed_variation_widens_the_interval():
    """Two seeds that disagree (differences +2 and -2 on every example): mean 0, standard error sd / sqrt(2) = 2,
    and a t quantile of 1 degree of freedom, the Cauchy's tan(0.475 pi) = 12.706: the interval is +-25.4."""
    a = [np.array([[2.0] * 10, [-2.0] * 10])]
    r = paired_difference(a, [np.zeros((2, 10))], CFG)
    assert r.estimate == 0.0 and r.n_seeds == 2
    assert r.high == pytest.approx(2.0 * np.tan(0.475 * np.pi)) and r.low == pytest.approx(-r.high)
    assert not excludes_zero(r) and r.p_value == 1.0


def test_several_seeds_of_constant_differences_are_the_one_sample_t_interval_of_the_seeds():
    """Per-seed differences 2.63, 1.02, 2.75 (the CPU study's AdaCentralized - SelectKD, issue 39): with nothing
    varying within a seed the interval is the seed-level t-interval (the issue's [-0.28, +4.54] from unrounded
    differences), and p the t test's."""
    from scipy import stats as sps

    d = np.array([2.63, 1.02, 2.75])
    a = [np.repeat(d[:, None], 7, axis=1), np.repeat(d[:, None], 4, axis=1)]
    r = paired_difference(a, [np.zeros_like(x) for x in a], CFG)
    assert (r.low, r.high) == pytest.approx(sps.t.interval(0.95, 2, loc=d.mean(), scale=sps.sem(d)))
    assert (round(r.low, 2), round(r.high, 2)) == (-0.27, 4.53)
    assert r.p_value == pytest.approx(sps.ttest_1samp(d, 0.0).pvalue)
    assert not excludes_zero(r) and r.p_value > 0.05


def test_unpaired_shapes_are_rejected():
    with pytest.raises(ValueError, match="shapes differ"):
        paired_difference([np.zeros((1, 3))], [np.zeros((1, 4))], CFG)


def test_p_is_below_one_minus_level_exactly_when_the_interval_excludes_zero():
    """The p-value is the percentile interval's dual, also on tied, skewed replicates (many identical summaries),
    where a p from replicates shifted to the null disagreed with the interval (p = 0.08 beside [-0.56, -0.01])."""
    rng = np.random.default_rng(5)
    checked = {True: 0, False: 0}
    for trial in range(300):
        n = int(rng.integers(3, 30))
        # Mostly zero differences (identical summaries) plus a few shifted ones: heavy ties near 0.
        d = np.where(rng.random((1, n)) < rng.uniform(0.3, 0.9), 0.0, rng.normal(rng.uniform(-2, 2), 2.0, (1, n)))
        r = paired_difference([d], [np.zeros_like(d)], BootstrapConfig(n_resamples=200, seed=trial))
        assert 1 / 201 <= r.p_value <= 1.0
        assert excludes_zero(r) == (r.p_value < 0.05), (trial, r)
        checked[excludes_zero(r)] += 1
    assert min(checked.values()) > 20  # both outcomes occurred


def test_p_is_twice_the_smaller_tail_of_the_replicates():
    """Hand-computed: differences (1, 1, -1) on one client; the 27 equally likely resamples have means
    1 (8), 1/3 (12), -1/3 (6), -1 (1): 7/27 of them are negative, so p is close to 2 x 7/27 = 0.52."""
    r = paired_difference([np.array([[1.0, 1.0, -1.0]])], [np.zeros((1, 3))], BootstrapConfig(n_resamples=20000))
    assert r.p_value == pytest.approx(14 / 27, abs=0.02)
    assert not excludes_zero(r)


def test_holm_adjusts_a_family_as_computed_by_hand():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> monotone: 0.06
    got = holm(np.array([0.01, 0.04, 0.03, 0.005]))
    np.testing.assert_allclose(got, [0.03, 0.06, 0.06, 0.02])
    # NaN is not counted (a family of 2 here) and stays NaN; adjusted p is capped at 1
    got = holm(np.array([0.02, np.nan, 0.7]))
    np.testing.assert_allclose(got, [0.04, np.nan, 0.7])
    assert holm(np.array([0.6, 0.9]))[0] == 1.0


def _duplicated(per_client, k):
    """Each example repeated k times, and the cluster ids that tie the copies together (distinct across clients)."""
    ids = [np.repeat(np.arange(a.shape[1]) + 1000 * c, k) for c, a in enumerate(per_client)]
    return [np.repeat(a, k, axis=1) for a in per_client], ids


@pytest.mark.parametrize("seeds", [1, 3])
def test_copies_of_one_example_in_one_cluster_count_as_that_example_once(seeds):
    """The cluster-robust variance sums within clusters: k copies of each example, clustered, give exactly the
    interval of the examples without copies (treated as independent, the copies would narrow it by about sqrt k)."""
    rng = np.random.default_rng(7)
    # an example effect every seed shares, so the example-level part dominates the variance
    a = [rng.normal(1.0, 5.0, n) + rng.normal(0.0, 0.5, (seeds, n)) for n in (20, 35)]
    b = [rng.normal(0.0, 0.5, (seeds, n)) for n in (20, 35)]
    plain = paired_difference(a, b, CFG)
    (a3, ids), (b3, _) = _duplicated(a, 3), _duplicated(b, 3)
    clustered = paired_difference(a3, b3, CFG, clusters=ids)
    assert (clustered.low, clustered.high, clustered.p_value) == pytest.approx((plain.low, plain.high, plain.p_value))
    naive = paired_difference(a3, b3, CFG)
    assert naive.high - naive.low < 0.7 * (plain.high - plain.low)
    # one example a cluster is the independent interval
    singletons = paired_difference(a, b, CFG, clusters=[np.arange(x.shape[1]) + 100 * c for c, x in enumerate(a)])
    assert (singletons.low, singletons.high) == pytest.approx((plain.low, plain.high))


@pytest.mark.parametrize("seeds", [1, 3])
def test_a_client_of_one_meeting_or_one_example_gives_no_interval_and_no_test(seeds):
    """The examples' spread within a client needs two of its units (meetings, or examples without meetings): with one,
    G / (G - 1) is undefined. Before, that client's spread counted as 0: one seed gave a point interval with
    p = 1 / (B + 1), and clustering the examples narrowed the several-seeds interval instead of widening it."""
    rng = np.random.default_rng(5)
    a = [rng.normal(1.0, 3.0, (seeds, 5)), rng.normal(0.0, 3.0, (seeds, 6))]
    b = [np.zeros((seeds, 5)), np.zeros((seeds, 6))]
    one_meeting = [np.zeros(5), np.array([0, 0, 1, 1, 2, 2])]  # client 1: five queries of one meeting
    one_example = ([x[:, :1] for x in a], [x[:, :1] for x in b])  # one test example a client, no meetings
    for r in (paired_difference(a, b, CFG, clusters=one_meeting), paired_difference(*one_example, CFG)):
        assert np.isnan([r.low, r.high, r.p_value]).all() and not excludes_zero(r)
    r = paired_difference(a, b, CFG, clusters=one_meeting)
    assert r.estimate == pytest.approx((a[0].mean() + a[1].mean()) / 2) and r.n_seeds == seeds
    # one method's own interval (evaluate's mean_ci, the tables' average) neither: before, one seed gave a point
    # [m, m] and several seeds the seeds' t-interval alone, as if the meeting's queries were the whole population
    for r in (mean_interval(a, CFG, one_meeting), mean_interval(one_example[0], CFG)):
        assert np.isnan([r.low, r.high, r.p_value]).all() and r.n_seeds == seeds
    assert mean_interval(a, CFG, one_meeting).estimate == pytest.approx((a[0].mean() + a[1].mean()) / 2)
    r = nested_interval([[x[0] for x in a]], CFG, [one_meeting], paired=False)  # one seed's own test sets
    assert np.isnan([r.low, r.high]).all()


def test_cluster_ids_must_align_with_the_examples():
    a = [np.zeros((2, 4))]
    with pytest.raises(ValueError, match="3 cluster ids for 4 examples"):
        paired_difference(a, a, CFG, clusters=[np.array([0, 0, 1])])


def test_qmsum_queries_cluster_by_meeting_and_other_datasets_do_not():
    ids = [["qmsum/Academic/test/Bed003/q0", "qmsum/Academic/test/Bed003/q1", "qmsum/Academic/test/Bed008/q0"]]
    (got,) = meetings(ids)
    assert got.tolist() == ["qmsum/Academic/test/Bed003"] * 2 + ["qmsum/Academic/test/Bed008"]
    assert meetings([["samsum/test/13862856", "samsum/test/13729565"]]) is None


@pytest.mark.parametrize("seeds", [1, 3])
def test_a_meeting_whose_queries_several_clients_hold_is_one_cluster_across_them(seeds):
    """The iid partition splits each meeting's queries between the clients: the meeting is still one unit, so a
    second client holding the same meetings with the same scores brings no new evidence and the interval is the one
    client's (one seed: the same draws of meetings; several: up to the t's degrees of freedom). Resampled or summed
    within each client alone, the copy counted as independent and narrowed the interval by about sqrt 2."""
    rng = np.random.default_rng(11)
    ids = np.repeat([f"qmsum/Product/test/m{g}" for g in range(20)], 3)  # 20 meetings of 3 queries
    d = rng.normal(0.0, 4.0, 20)[None, np.repeat(np.arange(20), 3)] + rng.normal(1.0, 1.0, (seeds, 60))
    zero = np.zeros((seeds, 60))
    one = paired_difference([d], [zero], CFG, clusters=[ids])
    two = paired_difference([d, d.copy()], [zero, zero], CFG, clusters=[ids, ids.copy()])
    assert two.estimate == pytest.approx(one.estimate)
    assert two.high - two.low == pytest.approx(one.high - one.low, rel=0.03 if seeds > 1 else 1e-9)
    # queries of one meeting split between two clients (as the iid partition does): the same as one client's interval
    # of the meeting means' spread, not half its variance
    split = paired_difference(
        [d[:, ::2], d[:, 1::2]], [zero[:, ::2], zero[:, 1::2]], CFG, clusters=[ids[::2], ids[1::2]]
    )
    assert split.high - split.low > 0.85 * (one.high - one.low)


def test_beside_qmsum_queries_every_other_example_is_its_own_cluster():
    # a client of AMI or SAMSum examples beside QMSum's (the extreme and cluster partitions): only a query's id loses
    # its last part; a dialogue or meeting summary keeps its whole id, so two of them are never one cluster
    ids = [["qmsum/Academic/test/Bed003/q0", "samsum/test/13862856", "samsum/test/13729565", "ami/test/ES2004a"]]
    (got,) = meetings(ids)
    assert got.tolist() == ["qmsum/Academic/test/Bed003", *ids[0][1:]]


def test_the_recorded_bootstrap_method_names_the_unit_it_resampled():
    # metrics.json ci.method and the claims say what was drawn: test examples without clusters, meetings with them
    assert bootstrap_method(None).startswith("percentile bootstrap of the client average, test examples resampled")
    assert "meetings (with all their queries) resampled" in bootstrap_method(meetings([["qmsum/A/test/M1/q0"]]))


def test_an_interval_of_one_method_has_no_p_value():
    # a p-value tests a difference against 0: one method's mean (paired=False) has none, with or without seeds
    for scores in (np.arange(8.0), np.arange(16.0).reshape(2, 8)):
        assert math.isnan(mean_interval([scores], CFG).p_value)
        assert not math.isnan(mean_interval([scores - 3.5], CFG, paired=True).p_value)


def test_the_recorded_bootstrap_method_says_meetings_held_by_several_clients_are_drawn_for_all():
    within = meetings([["qmsum/Academic/test/Bed003/q0"], ["qmsum/Product/test/ES2004a/q0"]])
    across = meetings([["qmsum/Academic/test/Bed003/q0"], ["qmsum/Academic/test/Bed003/q1"]])
    assert "resampled within clients" in bootstrap_method(within)
    assert "within clients" not in bootstrap_method(across) and "for every client" in bootstrap_method(across)
    # the whole sentence metrics.json records (the words above inside another text would pass them)
    assert bootstrap_method(across) == (
        "percentile bootstrap of the client average, meetings (with all their queries) resampled once for every client"
        " (one seed: the choice of test meetings only)"
    )


def test_crossed_seeds_keep_the_intervals_they_had():
    """Seeds sharing their test examples (crossed): the numbers computed before nested_interval existed (commit
    ee488fd), per client clusters, clusters spanning clients, one seed, and one method's mean."""
    rng = np.random.default_rng(13)
    a = [rng.normal(20, 5, (3, n)) for n in (7, 9)]
    b = [rng.normal(19, 5, (3, n)) for n in (7, 9)]
    cl = [np.array(list("aabbccd")), np.array(list("eeffgghhi"))]
    joint = [np.array(list("aabbccd")), np.array(list("aabbcdddd"))]
    cfg = BootstrapConfig(n_resamples=1000, seed=0)
    est = 1.6375038088291156
    assert paired_difference(a, b, cfg, cl) == Interval(
        est, -1.525196270562193, 4.800203888220424, 0.2594250473807614, 3
    )
    assert paired_difference(a, b, cfg, joint) == Interval(
        est, -4.049738959838457, 7.324746577496688, 0.33953443779215275, 3
    )
    one = paired_difference([x[:1] for x in a], [x[:1] for x in b], cfg, cl)
    assert one == Interval(2.3491685401359046, -0.8238762204152075, 5.682508523014719, 0.12473067899783626, 1)
    m = mean_interval(a, cfg, cl)
    assert (m.estimate, m.low, m.high, m.n_seeds) == (20.945724807884346, 17.49660653155424, 24.394843084214454, 3)


def test_seeds_with_their_own_test_examples_use_the_between_seed_variance_floored_at_the_examples():
    """Nested design (a partition re-divided per seed): 3 seeds, 2 clients, other examples (and sizes) in every
    seed. D_s = seed s's client average of A - B; estimate mean D_s; variance max(var(D_s) / S, sum_s v_s / S^2),
    v_s the meeting-robust variance of D_s (client c: G / (G - 1) sum over meetings of the squared centred sums,
    over n_c^2; the clients' over k^2); Welch-Satterthwaite df against S - 1 and meetings - clients summed over
    seeds."""
    rng = np.random.default_rng(5)
    sizes = [(5, 7), (6, 4), (8, 5)]
    d = [[rng.normal(1.0 + s, 2.0, n) for n in ns] for s, ns in enumerate(sizes)]
    ids = [
        [np.array([f"qmsum/X/test/s{s}c{c}m{i // 2}/q{i}" for i in range(len(x))]) for c, x in enumerate(ds)]
        for s, ds in enumerate(d)
    ]
    clusters = [meetings(seed_ids) for seed_ids in ids]

    def robust(x, g):  # cluster-robust variance of a mean, written out
        groups = sorted(set(g))
        sums = np.array([(x - x.mean())[g == k].sum() for k in groups])
        return len(groups) / (len(groups) - 1) * (sums**2).sum() / len(x) ** 2

    D = np.array([np.mean([x.mean() for x in ds]) for ds in d])
    v = [
        sum(robust(x, np.array([i.rsplit("/", 1)[0] for i in g])) for x, g in zip(ds, gs)) / 4 for ds, gs in zip(d, ids)
    ]
    v_seed, v_ex = D.var(ddof=1) / 3, sum(v) / 9
    var = max(v_seed, v_ex)
    df_ex = sum(len({i.rsplit("/", 1)[0] for i in g}) for gs in ids for g in gs) - 2 * 3
    df = var**2 / (v_seed**2 / 2 + v_ex**2 / df_ex)
    half = sps.t.ppf(0.975, df) * np.sqrt(var)
    r = nested_interval(d, CFG, clusters)
    assert r.estimate == pytest.approx(D.mean())
    assert (r.low, r.high) == pytest.approx((D.mean() - half, D.mean() + half))
    assert r.p_value == pytest.approx(2 * sps.t.sf(abs(D.mean()) / np.sqrt(var), df))
    assert r.n_seeds == 3
    # the floor: seeds that agree exactly leave the examples' part
    same = [[x - x.mean() + 1.0 for x in ds] for ds in d]
    flat = nested_interval(same, CFG, clusters)
    v_flat = (
        sum(
            sum(robust(x, np.array([i.rsplit("/", 1)[0] for i in g])) for x, g in zip(ds, gs)) / 4
            for ds, gs in zip(same, ids)
        )
        / 9
    )
    assert flat.high - flat.low == pytest.approx(2 * sps.t.ppf(0.975, df_ex) * np.sqrt(v_flat))
    # one method's mean: no p; one seed: that seed's bootstrap, as paired_difference
    assert np.isnan(nested_interval(d, CFG, clusters, paired=False).p_value)
    one = paired_difference([x[None, :] for x in d[0]], [np.zeros((1, len(x))) for x in d[0]], CFG, clusters[0])
    assert nested_interval(d[:1], CFG, clusters[:1]) == one


def _robust_sum(rows: list[np.ndarray], labels: list[list]) -> tuple[float, int]:
    """Cluster-robust variance of the sum of the clients' means, summed over the rows (independent replications), and
    the number of groups G: per row, each group's sum over the clients of (value - that client's mean) / its size,
    squared and summed, times G / (G - 1) (docs/statistics.md: squared meeting sums, G / (G - 1))."""
    groups = sorted({label for client in labels for label in client})
    total = 0.0
    for r in range(rows[0].shape[0]):
        sums = dict.fromkeys(groups, 0.0)
        for x, client in zip(rows, labels):
            row = [float(v) for v in x[r]]
            mean = sum(row) / len(row)
            for value, label in zip(row, client):
                sums[label] += (value - mean) / len(row)
        total += sum(t * t for t in sums.values())
    return len(groups) / (len(groups) - 1) * total, len(groups)


def _seeds_t_by_hand(d: list[np.ndarray], clusters: list | None) -> tuple[tuple[float, ...], dict]:
    """The several-seeds interval of the client average of ``d`` (one [seeds, examples] array a client), written out
    from stats._seeds_t's docstring and docs/statistics.md: (estimate, low, high, p) and the variance's parts.
    v_seed: the per-seed client averages' variance (ddof 1) / s; v_ex: the cluster-robust variance of the
    seed-averaged scores' client average; v_res: the same of the seed x example residual (a - column mean - row mean
    + grand mean), over s (s - 1) (with one example a cluster: the two-way ANOVA's MS_res / (s n)); the variance
    v_seed + v_ex - v_res floored at max(v_seed, v_ex). Clusters are per client, or shared by all clients at once where
    an id is in several clients' arrays; df_ex = groups - clients, Welch-Satterthwaite df."""
    k, s = len(d), d[0].shape[0]
    labels = [[(c, i) for i in range(x.shape[1])] for c, x in enumerate(d)] if clusters is None else clusters
    shared = any(set(labels[i]).intersection(labels[j]) for i in range(k) for j in range(i + 1, k))
    units = [list(range(k))] if shared else [[c] for c in range(k)]
    by_seed = [sum(sum(x[j]) / x.shape[1] for x in d) / k for j in range(s)]
    estimate = sum(by_seed) / s
    v_seed = sum((b - estimate) ** 2 for b in by_seed) / (s - 1) / s
    seed_means = [np.array([[sum(x[:, i]) / s for i in range(x.shape[1])]]) for x in d]
    resid = []
    for x in d:
        rows, cols, grand = x.mean(axis=1), x.mean(axis=0), x.mean()
        resid.append(np.array([[x[j, i] - cols[i] - rows[j] + grand for i in range(x.shape[1])] for j in range(s)]))
    v_ex = v_res = 0.0
    n_groups = 0
    for unit in units:
        v, g = _robust_sum([seed_means[c] for c in unit], [labels[c] for c in unit])
        v_ex, n_groups = v_ex + v / k**2, n_groups + g
        v_res += _robust_sum([resid[c] for c in unit], [labels[c] for c in unit])[0] / (s * (s - 1)) / k**2
    var = max(v_seed + v_ex - v_res, v_seed, v_ex)
    df = var**2 / (v_seed**2 / (s - 1) + v_ex**2 / max(n_groups - k, 1))
    half, z = sps.t.ppf(0.975, df) * math.sqrt(var), abs(estimate) / math.sqrt(var)
    return (estimate, estimate - half, estimate + half, 2 * sps.t.sf(z, df)), dict(
        v_seed=v_seed, v_ex=v_ex, v_res=v_res, df=df
    )


_MEETINGS = [np.array(["m0", "m0", "m1", "m1", "m2", "m2"]), np.array(["p0", "p0", "p0", "p1", "p2"])]
_SPREAD = [
    np.array([[6, 8, 2, 8, 8, 7], [7, 0, 1, 0, 8, 3], [3, 8, 2, 9, 3, 5]], dtype=float),
    np.array([[8, 7, 4, 3, 9], [8, 6, 8, 1, 0], [2, 9, 6, 3, 5]], dtype=float),
]


@pytest.mark.parametrize(
    ("d", "clusters", "decides"),
    [
        # a seed x example interaction beside seed and example effects: the residual both parts hold is taken off
        (
            [
                np.array([[8, 4, 12, 8], [4, 12, 8, 16], [9, 11, 13, 15]], dtype=float),
                np.array([[4, 2, 6], [3, 7, 7], [4, 6, 8]], dtype=float),
            ],
            None,
            "sum",
        ),
        # seed effects -3, 0, 3, a large interaction, small example effects: the sum less the residual falls below
        # the seeds' part, which floors it (estimate exactly 1: p is the t's there too)
        ([np.array([[-1, -5, 0, -6], [-2, 2, -1, 1], [3, 3, 4, 2]], dtype=float) + 1], None, "v_seed"),
        # large example effects, a large interaction, seeds that nearly agree: the examples' part floors it
        (
            [
                np.array([[-5, 1, 0, 9], [-9, -1, 4, 5], [-4, -3, 3, 6]], dtype=float),
                np.array([[2, -2], [-1, 2], [0, 1]], dtype=float),
            ],
            None,
            "v_ex",
        ),
        # meetings within each client (G / (G - 1) per client, df_ex 3 + 3 - 2), and the same scores with meetings
        # that two clients hold (one cluster across them: G = 4 for both, df_ex 4 - 2)
        (_SPREAD, _MEETINGS, "sum"),
        (_SPREAD, [_MEETINGS[0], np.array(["m0", "m1", "m2", "m2", "p"])], "v_seed"),
        # two clients holding the same two meetings: df_ex = 2 meetings - 2 clients, floored at 1
        (
            [
                np.array([[6, 5, -2], [7, 9, 2], [11, 10, 3]], dtype=float),
                np.array([[5, -2, -1], [9, 0, 1], [10, 5, 3]], dtype=float),
            ],
            [np.array(["m0", "m0", "m1"]), np.array(["m0", "m1", "m1"])],
            "sum",
        ),
        # three clients whose meetings span them (m0 in clients 1 and 3, m1 and m2 in 1 and 2, m3 in 2 and 3)
        (
            [
                np.array([[9, 6, 7, 8], [2, 3, 2, 0], [4, 5, 9, 1]], dtype=float),
                np.array([[9, 7, 4], [3, 6, 4], [2, 9, 2]], dtype=float),
                np.array([[7, 0, 8, 1], [5, 5, 9, 8], [0, 9, 8, 3]], dtype=float),
            ],
            [np.array(["m0", "m0", "m1", "m2"]), np.array(["m1", "m2", "m3"]), np.array(["m3", "m4", "m4", "m0"])],
            "sum",
        ),
    ],
    ids=[
        "interaction",
        "seeds-floor",
        "examples-floor",
        "meetings",
        "meetings-across-clients",
        "two-shared-meetings",
        "meetings-across-three-clients",
    ],
)
def test_several_seeds_interval_is_the_crossed_variance_written_out(d, clusters, decides):
    """Estimate, limits and p of the several-seeds interval against the variance computed by hand (loops over seeds,
    examples and clusters), in each regime of max(v_seed + v_ex - v_res, v_seed, v_ex): the residual's share, and
    each floor, decide the width here (the residual's share mis-scaled or its column means' sign flipped, or a floor
    dropped, moves the limits)."""
    (estimate, low, high, p), part = _seeds_t_by_hand(d, clusters)
    parts = {"sum": part["v_seed"] + part["v_ex"] - part["v_res"], "v_seed": part["v_seed"], "v_ex": part["v_ex"]}
    assert max(parts, key=parts.get) == decides and part["v_res"] > 0.0
    others = sorted(parts.values())
    assert others[-1] > 1.1 * others[-2]  # the case is no tie: the one that decides is clear of the rest
    b = [np.arange(x.size, dtype=float).reshape(x.shape) % 7 for x in d]
    r = paired_difference([x + y for x, y in zip(d, b)], b, CFG, clusters)
    assert (r.estimate, r.low, r.high, r.p_value, r.n_seeds) == pytest.approx(
        (estimate, low, high, p, len(d[0])), rel=1e-10
    )
    m = mean_interval(d, CFG, clusters)
    assert (m.estimate, m.low, m.high) == pytest.approx((estimate, low, high), rel=1e-12) and math.isnan(m.p_value)


def test_one_client_of_several_seeds_has_the_two_way_anova_variance_of_its_grand_mean():
    """Scores 10 + seed effect (-2, 0, 2) + example effect (-3, -1, 1, 3) + an interaction of +-3 (rows +-(3, -3, 3,
    -3) and 0): mean squares MS_seed = 4 x 4 = 16, MS_ex = 3 x 20 / 3 = 20, MS_res = 72 / 6 = 12, so the grand mean's
    variance is (16 + 20 - 12) / (3 x 4) = 2 (above the floor max(16, 20) / 12), Welch-Satterthwaite df
    4 / ((4/3)^2 / 2 + (5/3)^2 / 3), p that of 10 / sqrt 2."""
    d = np.array([[8, 4, 12, 8], [4, 12, 8, 16], [9, 11, 13, 15]], dtype=float)
    df = 4 / ((4 / 3) ** 2 / 2 + (5 / 3) ** 2 / 3)
    half = sps.t.ppf(0.975, df) * math.sqrt(2)
    r = paired_difference([d], [np.zeros_like(d)], CFG)
    assert (r.estimate, r.low, r.high) == pytest.approx((10.0, 10.0 - half, 10.0 + half), rel=1e-12)
    assert r.p_value == pytest.approx(2 * sps.t.sf(10 / math.sqrt(2), df), rel=1e-9)


def test_several_seeds_without_any_spread_give_the_point_itself():
    """Three seeds whose differences are one constant on every example (no seed, example or residual spread): the
    variance is 0 and the interval the point (a t of infinitely many degrees of freedom, not 0 / 0); p 0 for a shift
    (nothing varies: it is certain) and 1 for none (identical scores)."""
    b = [np.arange(15.0).reshape(3, 5) % 4, np.arange(24.0).reshape(3, 8) % 5]
    assert paired_difference([x + 1.5 for x in b], b, CFG) == Interval(1.5, 1.5, 1.5, 0.0, 3)
    assert paired_difference(b, [x.copy() for x in b], CFG) == Interval(0.0, 0.0, 0.0, 1.0, 3)


def test_seeds_with_their_own_test_examples_pool_a_meeting_across_the_clients_that_hold_it():
    """Nested design where each seed's two meetings are both split between the two clients (as the iid partition
    deals out a domain's queries): per seed a meeting is one cluster across the clients (G = 2 for both together, not
    2 for each), v_s the variance of the seed's client average over those pooled sums, df_ex = 2 - 2 per seed, 0 in
    all, floored at 1; otherwise as the nested interval's docstring: max(var(D_s) / S, sum_s v_s / S^2),
    Welch-Satterthwaite df."""
    per_seed = [
        [np.array([5.0, 7, -5]), np.array([7.0, 2, 2, 4])],
        [np.array([-1.0, 9, -5]), np.array([-1.0, 0, 3, 1])],
        [np.array([-4.0, -5, -5]), np.array([-5.0, -3, 9, -3])],
    ]
    ids = [("aab", "abbb"), ("cdd", "ccdc"), ("efe", "feff")]
    clusters = [[np.array(list(c)) for c in seed] for seed in ids]
    s, k = 3, 2
    d_s = [sum(sum(x) / len(x) for x in xs) / k for xs in per_seed]
    v_ex = sum(_robust_sum([x[None, :] for x in xs], [list(c) for c in seed])[0] for xs, seed in zip(per_seed, ids))
    v_ex /= k**2 * s**2
    estimate = sum(d_s) / s
    v_seed = sum((d - estimate) ** 2 for d in d_s) / (s - 1) / s
    assert v_seed > v_ex > 0.5 * v_seed  # both parts weigh in the df
    df = v_seed**2 / (v_seed**2 / (s - 1) + v_ex**2 / 1)
    half = sps.t.ppf(0.975, df) * math.sqrt(v_seed)
    r = nested_interval(per_seed, CFG, clusters)
    expected = (estimate, estimate - half, estimate + half, 2 * sps.t.sf(abs(estimate) / math.sqrt(v_seed), df))
    assert (r.estimate, r.low, r.high, r.p_value) == pytest.approx(expected, rel=1e-10)


def test_a_seed_whose_client_has_one_meeting_adds_nothing_to_the_nested_floor():
    """Nested design, seed 1's first client has its three queries on one meeting: within that seed its spread is
    unknown (G / (G - 1)), so it adds 0 to the floor's v_s and 0 to df_ex (1 meeting - 1 client), while the seeds'
    spread, which in this design holds each seed's draw of test examples, still counts it; no NaN (one seed alone
    has none: test_a_client_of_one_meeting_or_one_example_gives_no_interval_and_no_test). By hand: D_s = 4, 5, 4;
    per client G / (G - 1) x (squared meeting sums of the centred scores) / n^2: seed 0 16/9 and 27/16, seed 1 0
    and 1, seed 2 0 and 4; v_ex = their sum / (k^2 S^2); df_ex = (2 + 3 - 2) + (1 + 2 - 2) + (2 + 2 - 2) = 6."""
    per_seed = [
        [np.array([4.0, 6, 2]), np.array([1.0, 3, 5, 7])],
        [np.array([9.0, 5, 7]), np.array([2.0, 6, 4, 0])],
        [np.array([3.0, 1, 5]), np.array([8.0, 2, 4, 6])],
    ]
    clusters = [[np.array(list(c)) for c in seed] for seed in (("aab", "cdde"), ("fff", "gghh"), ("ijj", "kllk"))]
    estimate, v_seed = 13 / 3, (1 / 3) / 3
    v_ex = (16 / 9 + 27 / 16 + 0 + 1 + 0 + 4) / (4 * 9)
    assert v_ex > v_seed  # the floor binds: the one-meeting client's missing part shows in the width
    df = v_ex**2 / (v_seed**2 / 2 + v_ex**2 / 6)
    half = sps.t.ppf(0.975, df) * math.sqrt(v_ex)
    r = nested_interval(per_seed, CFG, clusters)
    expected = (estimate, estimate - half, estimate + half, 2 * sps.t.sf(estimate / math.sqrt(v_ex), df), 3)
    assert (r.estimate, r.low, r.high, r.p_value, r.n_seeds) == pytest.approx(expected, rel=1e-10)


_Z = np.zeros
_SAME_SEEDS = "bootstrap: every client needs the same seeds and at least one example"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: paired_difference([], [], CFG), "^bootstrap: no client has scores$"),
        (lambda: mean_interval([_Z((2, 3)), _Z((3, 3))], CFG), f"^{_SAME_SEEDS}$"),
        (lambda: mean_interval([_Z((2, 0)), _Z((2, 3))], CFG), f"^{_SAME_SEEDS}$"),
        (
            lambda: mean_interval([_Z((2, 3)), _Z((2, 3))], CFG, [np.arange(3)]),
            "^bootstrap: 1 cluster arrays for 2 clients$",
        ),
        (lambda: mean_interval([_Z((2, 3))], CFG, [np.array(5)]), "^bootstrap: 0 cluster ids for 3 examples$"),
        # a client in A that B lacks, a seed without its clusters: refused, not dropped
        (lambda: paired_difference([_Z((2, 3)), _Z((2, 3))], [_Z((2, 3))], CFG), "argument 2 is shorter"),
        (lambda: nested_interval([[np.ones(3)]] * 3, CFG, [None, None]), "argument 2 is shorter"),
    ],
    ids=["no-client", "other-seeds", "no-example", "clusters-per-client", "scalar-clusters", "b-lacks", "seed-lacks"],
)
def test_scores_that_do_not_fit_together_are_refused_with_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_one_seed_draws_meetings_for_all_clients_also_where_a_client_lacks_some():
    """One seed, meetings drawn once for both clients; client 1 holds m0 and m1 only, client 2 m1 to m3. Differences
    1 on every example of client 1 and 3 on client 2's: every replicate's client means are 1 and 3 (one that drew
    none of a client's meetings is left out), so the interval is the point 2 and p the smallest B replicates show."""
    a = [np.ones((1, 4)), np.full((1, 5), 3.0)]
    ids = [np.array(["m0", "m0", "m1", "m1"]), np.array(["m1", "m2", "m2", "m3", "m3"])]
    r = paired_difference(a, [np.zeros_like(x) for x in a], CFG, ids)
    assert (r.estimate, r.low, r.high, r.n_seeds) == (2.0, 2.0, 2.0, 1)
    assert 1 / (CFG.n_resamples + 1) <= r.p_value < 1 / (0.9 * CFG.n_resamples)
