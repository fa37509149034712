"""Paired comparisons between methods (pipeline.results.comparisons) and their place in the study tables."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pipeline.common.schema import DataError
from pipeline.experiments.entries import Experiment, with_labels
from pipeline.results import comparisons, readers
from pipeline.results.readers import collect_scores
from pipeline.results.stats import BootstrapConfig
from pipeline.results.tables import ReportConfig, ReportInputs, aggregate, study_table_markdown

CFG = BootstrapConfig(n_resamples=1000, seed=0)
CLIENTS = {"Academic": 6, "Product": 10}


def _write_eval(eval_dir: Path, name: str, shift: float, texts: str, scale: float = 1.0) -> None:
    """A fake evaluation: per-example ROUGE = base + shift, summaries `texts` + the example id."""
    rows, preds = [], []
    for client, n in CLIENTS.items():
        for i in range(n):
            base = 10.0 + 3.0 * ((i * 7) % 5)  # varies over examples, identical across methods
            row = {"experiment": name, "client": client, "example_id": f"{client}/{i}", "domain": client}
            for m in ("rouge1", "rouge2", "rougeL", "rougeLsum"):
                row[m] = base * scale + shift
            row["avg_rouge"] = base * scale + shift
            rows.append(row)
            preds.append(
                {
                    "experiment": name,
                    "client": client,
                    "example_id": f"{client}/{i}",
                    "prediction": f"{texts} {i}",
                    "reference": "ref",
                }
            )
    d = eval_dir / name
    d.mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(d / "per_example.parquet", index=False)
    (d / "predictions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preds))
    per_client = {
        c: {
            m: float(np.mean([r[m] for r in rows if r["client"] == c]))
            for m in ("rouge1", "rouge2", "rougeL", "rougeLsum", "avg_rouge")
        }
        | {"n": CLIENTS[c]}
        for c in CLIENTS
    }
    (d / "metrics.json").write_text(json.dumps({"backbone": "tiny", "clients": per_client}))


@pytest.fixture
def evaluated(tmp_path):
    eval_dir = tmp_path / "eval"
    _write_eval(eval_dir, "single-domain", 0.0, "same words")
    _write_eval(eval_dir, "fedavg-domain", 0.0, "same words")  # identical summaries and scores to single
    _write_eval(eval_dir, "fedselectkd-domain", 2.0, "other words")  # +2 on every example
    _write_eval(eval_dir, "fedavg-iid", 0.0, "iid words")
    planned = [
        Experiment("single-domain", "single", "domain/seed0", 0, "main"),
        Experiment("fedavg-domain", "fedavg", "domain/seed0", 0, "main"),
        Experiment("fedselectkd-domain", "fedselectkd", "domain/seed0", 0, "main", tau=5.0),
        Experiment("fedavg-iid", "fedavg", "iid/seed0", 0, "iid"),
    ]
    return eval_dir, planned


def test_every_configuration_is_compared_with_its_baselines(evaluated):
    eval_dir, planned = evaluated
    configs = comparisons.configurations(planned, with_labels(planned))
    table, notes = comparisons.comparisons_table(configs, ["single", "fedavg", "fedkd"], eval_dir, CFG)
    assert list(table.columns[:12]) == [
        "study",
        "client",
        "method_a",
        "method_b",
        "config_a",
        "config_b",
        "study_b",
        "metric",
        "mean_diff",
        "ci_low",
        "ci_high",
        "p_value",
    ]
    avg = table[(table["client"] == comparisons.AVERAGE) & (table["metric"] == "avg_rouge")]
    pairs = {(r.config_a, r.config_b) for r in avg.itertuples()}
    sel_label = "fedselectkd tau=5"  # tau tells it apart within the study
    assert pairs == {("fedavg", "single"), (sel_label, "single"), (sel_label, "fedavg")}  # no reverse pairs
    sel = avg[(avg["config_a"] == sel_label) & (avg["config_b"] == "fedavg")].iloc[0]
    assert sel["mean_diff"] == pytest.approx(2.0) and sel["significant"]
    assert sel["n_examples"] == 16 and sel["n_seeds"] == 1 and sel["identical_fraction"] == 0.0
    same = avg[(avg["config_a"] == "fedavg") & (avg["config_b"] == "single")].iloc[0]
    assert same["mean_diff"] == 0.0 and same["p_value"] == 1.0 and not same["significant"]
    assert same["identical_fraction"] == 1.0 and same["mostly_identical"]
    # per client rows too, each with its own examples
    per_client = table[
        (table["config_a"] == sel_label)
        & (table["config_b"] == "fedavg")
        & (table["metric"] == "rouge1")
        & (table["client"] == "Academic")
    ].iloc[0]
    assert per_client["n_examples"] == 6 and per_client["mean_diff"] == pytest.approx(2.0)
    # no FedKD anywhere and no AdaSingle on the iid partition: said, not invented
    assert any("no fedkd run" in n for n in notes) and any("iid" in n and "no single run" in n for n in notes)


def test_study_table_marks_significance_and_warns_on_identical_summaries(evaluated):
    eval_dir, planned = evaluated
    configs = comparisons.configurations(planned, with_labels(planned))
    table, _ = comparisons.comparisons_table(configs, ["single", "fedavg"], eval_dir, CFG)
    labels = with_labels(planned)
    scores, _ = collect_scores(planned, labels, eval_dir)
    md = study_table_markdown(
        aggregate(scores, ReportInputs(planned, ReportConfig(expected_seeds=[0]))), "main", table, CFG, None
    )
    sel_rows = [line for line in md.splitlines() if line.startswith("| fedselectkd tau=5 | tiny | Academic")]
    assert sel_rows and "> single, > fedavg" in sel_rows[0]
    assert "(n=1)" in sel_rows[0] and "± 0.00" not in md
    comparison_rows = [line for line in md.splitlines() if line.startswith("| fedavg | single |")]
    assert comparison_rows and "⚠ 100%" in comparison_rows[0]
    assert "**+2.00**" in md
    # the marks are the Holm-adjusted test's (docs/statistics.md), which the column's description must say: a
    # comparison whose interval excludes 0 with Holm p >= 0.05 gets no mark
    held = (table["config_a"] == "fedselectkd tau=5") & (table["client"] == "Academic")
    md = study_table_markdown(
        aggregate(scores, ReportInputs(planned, ReportConfig(expected_seeds=[0]))),
        "main",
        table.assign(significant=table["significant"] & ~held, p_holm=table["p_holm"].where(~held, 0.2)),
        CFG,
        None,
    )
    assert "| – |" in next(line for line in md.splitlines() if line.startswith("| fedselectkd tau=5 | tiny | Academic"))
    assert "at Holm p < 0.05" in md and "with a paired interval excluding 0" not in md


def test_private_configurations_are_compared_with_the_same_method_without_privacy(tmp_path):
    eval_dir = tmp_path / "eval"
    _write_eval(eval_dir, "fa", 0.0, "plain words")
    _write_eval(eval_dir, "fa-dp", -1.5, "noisy words")  # DP costs 1.5 on every example
    _write_eval(eval_dir, "sel", 2.0, "sel words")
    _write_eval(eval_dir, "sel-dp", 1.0, "sel noisy")  # 1.0 below SelectKD without DP
    planned = [
        Experiment("fa", "fedavg", "domain/seed0", 0, "privacy"),
        Experiment("fa-dp", "fedavg", "domain/seed0", 0, "privacy", dp="DP-SGD ε≤3"),
        Experiment("sel", "fedselectkd", "domain/seed0", 0, "privacy", tau=5.0),
        Experiment("sel-dp", "fedselectkd", "domain/seed0", 0, "privacy", tau=5.0, dp="DP-SGD ε≤3"),
    ]
    labels = with_labels(planned)
    configs = comparisons.configurations(planned, labels)
    table, notes = comparisons.comparisons_table(configs, ["single", "fedavg", "fedkd"], eval_dir, CFG)
    avg = table[(table["client"] == comparisons.AVERAGE) & (table["metric"] == "avg_rouge")]
    diffs = {(r.config_a, r.config_b): r.mean_diff for r in avg.itertuples()}
    # each private configuration against its own method without privacy; the FedAvg baseline is the plain one
    assert diffs == pytest.approx(
        {
            ("fedavg DP-SGD ε≤3", "fedavg"): -1.5,
            ("fedselectkd tau=5", "fedavg"): 2.0,
            ("fedselectkd tau=5 DP-SGD ε≤3", "fedavg"): 1.0,
            ("fedselectkd tau=5 DP-SGD ε≤3", "fedselectkd tau=5"): -1.0,
        }
    )
    assert avg["significant"].all()
    # a private run without a plain counterpart in its study is said, not compared with something else
    lone = comparisons.Config("other", "fedkd DP-SGD ε≤1", "fedkd", "domain", ((0, "x"),), dp="DP-SGD ε≤1")
    table, notes = comparisons.comparisons_table([lone], [], eval_dir, CFG)
    assert table.empty
    assert (
        "other: fedkd DP-SGD ε≤1 has no run of fedkd without privacy on partition scheme 'domain' "
        "in its study to compare with"
    ) in notes


def test_baseline_prefers_the_same_study_then_main():
    a = comparisons.Config("sampling", "fedselectkd", "fedselectkd", "domain", ((0, "s"),))
    same_study = comparisons.Config("sampling", "fedavg", "fedavg", "domain", ((0, "fa-s"),))
    main = comparisons.Config("main", "fedavg", "fedavg", "domain", ((0, "fa"),))
    other = comparisons.Config("server", "fedavg", "fedavg", "domain", ((0, "fa2"),))
    wrong_partition = comparisons.Config("sampling", "fedavg x", "fedavg", "iid", ((0, "fa-i"),))
    assert comparisons.baseline_for(a, "fedavg", [other, main, same_study, wrong_partition]) == same_study
    assert comparisons.baseline_for(a, "fedavg", [other, main, wrong_partition]) == main
    assert comparisons.baseline_for(a, "single", [other, main]) is None
    private = comparisons.Config("sampling", "fedavg DP", "fedavg", "domain", ((0, "fa-dp"),), dp="DP")
    assert comparisons.baseline_for(a, "fedavg", [private, same_study]) == same_study  # never a private baseline


def test_p_values_print_rounded_down_so_a_significant_p_never_reads_0_050():
    from pipeline.results.comparisons import format_p

    assert format_p(0.0496) == "0.049"
    assert format_p(0.05) == "0.050"
    assert format_p(0.047) == "0.047"  # 0.047 * 1000 is 46.99999... in binary: still 0.047
    assert format_p(0.0009) == "< 0.001"
    assert format_p(1.0) == "1.000"
    assert format_p(float("nan")) == "–"


def test_holm_adjusts_within_each_study_scope_and_metric_and_decides_significance():
    rows = [
        {"study": "main", "client": comparisons.AVERAGE, "metric": "avg_rouge", "p_value": p}
        for p in (0.01, 0.02, 0.04)
    ] + [
        {"study": "tau_sweep", "client": comparisons.AVERAGE, "metric": "avg_rouge", "p_value": 0.03},
        {"study": "main", "client": "Product", "metric": "avg_rouge", "p_value": 0.03},
    ]
    out = comparisons.with_holm(pd.DataFrame(rows).assign(significant=True), BootstrapConfig())
    # main's client average: 0.01 x 3, 0.02 x 2, 0.04 x 1 -> 0.03, 0.04, 0.04; the other families have one member
    np.testing.assert_allclose(out["p_holm"], [0.03, 0.04, 0.04, 0.03, 0.03])
    assert out["significant"].tolist() == [True, True, True, True, True]
    worse = comparisons.with_holm(pd.DataFrame(rows[:3]).assign(p_value=[0.01, 0.03, 0.04]), BootstrapConfig())
    assert worse["significant"].tolist() == [True, False, False]  # 0.03 x 2 = 0.06: the interval alone no longer
    # a comparison without a test (NaN p: a client of one meeting) is not a member of the family, nor counted as one
    untested = comparisons.with_holm(pd.DataFrame(rows[:3]).assign(p_value=[0.01, 0.02, math.nan]), BootstrapConfig())
    np.testing.assert_allclose(untested["p_holm"], [0.02, 0.02, math.nan])
    section = comparisons.markdown_section(
        untested.assign(
            **dict.fromkeys(["config_a", "config_b", "study_b"], "main"),
            **dict.fromkeys(["mean_diff", "ci_low", "ci_high", "identical_fraction"], 0.0),
            mostly_identical=False,
            n_seeds=3,
            n_examples=244,
        ),
        "main",
        BootstrapConfig(),
    )
    assert "adjusted over the 2 comparisons below" in section


def test_the_committed_per_example_files_average_r1_r2_and_plain_rouge_l():
    """A user reading a committed per_example.parquet gets the average ROUGE the tables show."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(root.glob("reports/**/eval/*/per_example.parquet"))
    assert files
    for path in files:
        frame = pd.read_parquet(path)
        np.testing.assert_allclose(
            frame["avg_rouge"], frame[["rouge1", "rouge2", "rougeL"]].mean(axis=1), err_msg=str(path)
        )


def _scores(eval_dir: Path, name: str, scores: dict[str, dict[str, float]]) -> None:
    """A per_example.parquet of client -> example id -> score (every metric the same)."""
    rows = [
        {"client": c, "example_id": i, **dict.fromkeys(("rouge1", "rouge2", "rougeL", "rougeLsum", "avg_rouge"), v)}
        for c, by_id in scores.items()
        for i, v in by_id.items()
    ]
    (eval_dir / name).mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(eval_dir / name / "per_example.parquet", index=False)


def _read(eval_dir: Path):
    """compare's ``read``, as comparisons_table makes it."""
    return lambda file, run: file(eval_dir, run)


def _two_configs(runs: int) -> tuple[comparisons.Config, comparisons.Config]:
    a = comparisons.Config("iid", "A", "fedselectkd", "iid", tuple((s, f"a{s}") for s in range(runs)))
    return a, comparisons.Config("iid", "B", "fedavg", "iid", tuple((s, f"b{s}") for s in range(runs)))


def test_seeds_that_redraw_the_test_sets_use_each_seeds_full_test_set(tmp_path):
    """iid/seed{k}: each seed has its own test examples. Intersected over seeds, client X kept one example of its 4
    and 3; each seed's own: D_s = the client average of A - B on seed s's examples, estimate mean D_s, variance
    max(var(D_s) / S, sum_s v_s / S^2) (v_s: var(ddof=1) / n a client over 2^2), Welch-Satterthwaite df."""
    from scipy import stats as sps

    diffs = {  # seed -> client -> example -> A - B
        0: {"X": {"x1": 1.0, "x2": 3.0, "x3": 2.0, "x4": 6.0}, "Y": {"y1": 0.0, "y2": 2.0, "y3": 1.0}},
        1: {"X": {"x1": 4.0, "x5": -1.0, "x6": 2.0}, "Y": {"y4": 3.0, "y5": 1.0, "y6": 5.0, "y7": 2.0}},
        2: {"X": {"x7": 0.0, "x8": 2.0, "x1": 1.0}, "Y": {"y1": 2.0, "y8": 4.0}},
    }
    for s, by_client in diffs.items():
        _scores(tmp_path, f"a{s}", {c: {i: 10.0 + d for i, d in ex.items()} for c, ex in by_client.items()})
        _scores(tmp_path, f"b{s}", {c: dict.fromkeys(ex, 10.0) for c, ex in by_client.items()})
    rows = pd.DataFrame(comparisons.compare(*_two_configs(3), _read(tmp_path), CFG, []), columns=comparisons.COLUMNS)
    got = rows[(rows["client"] == comparisons.AVERAGE) & (rows["metric"] == "avg_rouge")].iloc[0]
    per_seed = [[np.array(list(ex.values())) for ex in by_client.values()] for by_client in diffs.values()]
    D = np.array([np.mean([x.mean() for x in xs]) for xs in per_seed])
    v_seed = D.var(ddof=1) / 3
    v_ex = sum(sum(x.var(ddof=1) / len(x) for x in xs) / 4 for xs in per_seed) / 9
    var = max(v_seed, v_ex)
    df = var**2 / (v_seed**2 / 2 + v_ex**2 / (sum(len(x) for xs in per_seed for x in xs) - 6))
    half = sps.t.ppf(0.975, df) * np.sqrt(var)
    assert got["mean_diff"] == pytest.approx(D.mean())
    assert (got["ci_low"], got["ci_high"]) == pytest.approx((D.mean() - half, D.mean() + half))
    assert (got["n_examples"], got["n_seeds"]) == (16, 3)  # 19 scores, x1..x8 and y1..y8 (x1, y1 in several seeds)


def test_a_client_some_seeds_lack_is_noted_and_the_client_average_left_out(tmp_path):
    for s in range(2):
        scores = {"X": {f"x{s}{i}": 10.0 + i for i in range(4)}} | ({"Y": {"y1": 3.0, "y2": 5.0}} if s == 0 else {})
        _scores(tmp_path, f"a{s}", scores)
        _scores(tmp_path, f"b{s}", {c: {i: v - 1.0 for i, v in ex.items()} for c, ex in scores.items()})
    notes: list[str] = []
    rows = pd.DataFrame(comparisons.compare(*_two_configs(2), _read(tmp_path), CFG, notes), columns=comparisons.COLUMNS)
    assert set(rows["client"]) == {"X", "Y"}  # Y from its one seed, X from both
    assert set(rows.loc[rows["client"] == "Y", "n_seeds"]) == {1} and set(
        rows.loc[rows["client"] == "X", "n_seeds"]
    ) == {2}
    assert notes == [
        "iid: A vs B: client Y has no paired test example in seed(s) 1; its rows use the other seeds, "
        "and no client average is given"
    ]


def test_seeds_on_one_test_split_keep_their_crossed_comparison(tmp_path):
    """The same examples in both seeds: the numbers compare gave before the nested design was told apart (ee488fd)."""
    rng = np.random.default_rng(2)
    for s in range(2):
        a = {c: {f"{c}{i}": float(v) for i, v in enumerate(rng.normal(20, 4, n))} for c, n in (("X", 5), ("Y", 7))}
        _scores(tmp_path, f"a{s}", a)
        _scores(tmp_path, f"b{s}", {c: {i: v - rng.normal(1.0, 2.0) for i, v in ex.items()} for c, ex in a.items()})
    rows = pd.DataFrame(comparisons.compare(*_two_configs(2), _read(tmp_path), CFG, []), columns=comparisons.COLUMNS)
    got = rows[(rows["client"] == comparisons.AVERAGE) & (rows["metric"] == "avg_rouge")].iloc[0]
    assert (got["mean_diff"], got["ci_low"], got["ci_high"], got["p_value"], got["n_examples"], got["n_seeds"]) == (
        1.0492403197584408,
        0.43538110863753043,
        1.663099530879351,
        0.0034479047533795383,
        12,
        2,
    )


def test_seeds_that_redraw_the_test_sets_count_each_test_example_once_for_the_claim_minimum(tmp_path):
    """iid/seed{k} on one pool of 40 test examples, dealt 20 + 20 anew each seed: 3 seeds hold 120 example scores
    but 40 test examples (by hand: the pool). The claim minimum (report.claim_min_examples, 100) asks how much test
    data a claim rests on (docs/statistics.md): 40, so no claim, however clear the +2."""
    from pipeline.results import claims

    pool = [f"qmsum/Product/test/m{i % 8}/{i}" for i in range(40)]
    rng = np.random.default_rng(0)
    for s in range(3):
        dealt = rng.permutation(pool)
        by_client = {"X": dealt[:20], "Y": dealt[20:]}
        _scores(
            tmp_path,
            f"b{s}",
            {c: {i: 10.0 + (int(i.rsplit("/")[-1]) % 5) for i in ids} for c, ids in by_client.items()},
        )
        _scores(
            tmp_path,
            f"a{s}",
            {
                c: {i: 12.0 + (int(i.rsplit("/")[-1]) % 5) + 0.1 * rng.normal() for i in ids}
                for c, ids in by_client.items()
            },
        )
    a = comparisons.Config("main", "fedselectkd", "fedselectkd", "iid", tuple((s, f"a{s}") for s in range(3)))
    b = comparisons.Config("main", "fedkd", "fedkd", "iid", tuple((s, f"b{s}") for s in range(3)))
    table = comparisons.with_holm(
        pd.DataFrame(comparisons.compare(a, b, _read(tmp_path), CFG, []), columns=comparisons.COLUMNS), CFG
    )
    avg = table[(table["client"] == comparisons.AVERAGE) & (table["metric"] == "avg_rouge")].iloc[0]
    assert avg["n_seeds"] == 3 and avg["n_examples"] == len(set(pool)) == 40
    x = table[(table["client"] == "X") & (table["metric"] == "avg_rouge")].iloc[0]
    assert x["n_examples"] == len(
        {
            i
            for s in range(3)
            for i in pd.read_parquet(tmp_path / f"a{s}" / "per_example.parquet").query("client == 'X'")["example_id"]
        }
    )
    text = claims.results_text(table, cfg=ReportConfig(smoke=False, claim_min_examples=100))
    assert "No comparative claim" in text and "40 test examples" in text and "helps" not in text


@pytest.mark.parametrize("fraction", [123 / 244, 0.5004, 0.5049, 0.51])
def test_a_flagged_share_of_identical_summaries_reads_above_the_threshold(fraction):
    """⚠ = more than 50 % the same text: 123 of 244 (50.4 %) is flagged, and a '⚠ 50%' beside that rule reads as
    a wrong flag; the share shown is above 50 %, and within 0.1 point of the true share."""
    row = dict.fromkeys(comparisons.COLUMNS, 0.0) | {"study": "main", "client": comparisons.AVERAGE}
    row |= {"metric": "avg_rouge", "config_a": "A", "config_b": "B", "study_b": "main", "significant": False}
    row |= {"identical_fraction": fraction, "mostly_identical": fraction > CFG.identical_warning}
    md = comparisons.markdown_section(pd.DataFrame([row]), "main", CFG)
    line = next(x for x in md.splitlines() if x.startswith("| A | B | +"))
    shown = float(line.split("⚠ ", 1)[1].split("%", 1)[0])
    assert 50.0 < shown and abs(shown - 100 * fraction) <= 0.1 + 1e-9


@pytest.mark.parametrize("cut", [0, 100])
def test_a_damaged_score_or_gate_table_is_one_line_naming_the_file(tmp_path, cut):
    """An empty or cut per_example.parquet ended `report rebuild` and the report stage in pyarrow's ArrowInvalid
    traceback (and a gate log the analyze stage's); now one DataError line naming the file."""
    _write_eval(tmp_path, "a", 0.0, "a")
    path = tmp_path / "a" / "per_example.parquet"
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: not a readable per-example score table \("):
        comparisons.per_example(tmp_path, "a")
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: not a readable gate log \("):
        readers.read_gate_log(path)
