"""Effects against the paper's and every main pair compared (pipeline.results.comparisons),
the round-budget flags (pipeline.results.readers) and the README's generated results block."""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pipeline.experiments.entries import Experiment, with_labels
from pipeline.results import claims, comparisons, readers
from pipeline.results.stats import BootstrapConfig
from pipeline.results.tables import ReportConfig
from tests.test_comparisons import _write_eval

ROOT = Path(__file__).resolve().parents[1]
CFG = BootstrapConfig(n_resamples=200, seed=0)
PUBLISHED_COLUMNS = [c for b in comparisons.BACKBONES for c in (f"published_{b}", f"vs_published_{b}")]


def _block(text: str) -> str:
    """The text between a markdown file's results markers (after the newline that follows the first)."""
    return text.split(claims.BEGIN, 1)[1].split(claims.END, 1)[0][1:]


# --- where the paper's difference sits against our interval ---------------------------------------------------


@pytest.mark.parametrize(
    "low, high, value, expected",
    [
        (-0.56, 0.62, 0.30, "contains"),
        (-0.56, 0.62, 0.62, "contains"),  # on the limit: not excluded
        (-0.56, 0.62, -0.56, "contains"),
        (-0.56, 0.62, 0.85, "excludes above"),
        (1.03, 3.10, 0.30, "excludes below"),
        (-0.56, 0.62, math.nan, ""),
        (-0.56, 0.62, None, ""),
        (math.nan, math.nan, 0.30, ""),  # no interval (a client of one meeting): nothing to place it against
    ],
)
def test_classify_places_the_published_value_against_the_interval(low, high, value, expected):
    assert comparisons.classify(low, high, value) == expected


def test_published_difference_is_the_client_average_of_table_iii():
    # BART-large, SelectKD - AdaSingle, avg ROUGE: hand-computed from METHOD.md section 9's cells
    sel = [(27.09 + 7.62 + 19.79) / 3, (34.70 + 15.19 + 25.37) / 3, (33.32 + 12.86 + 23.53) / 3]
    single = [(24.83 + 5.70 + 17.24) / 3, (32.38 + 13.08 + 23.24) / 3, (31.83 + 11.11 + 21.27) / 3]
    expected = sum(s - b for s, b in zip(sel, single)) / 3
    got = comparisons.published_difference("bart-large", "fedselectkd", "single", comparisons.AVERAGE, "avg_rouge")
    assert got == pytest.approx(expected) and round(got, 2) == 2.09
    # one client and one metric: the table's R-L is what our plain rougeL rows compare; rougeLsum has no paper value
    assert comparisons.published_difference(
        "bart-base", "centralized", "fedavg", "Academic", "rougeL"
    ) == pytest.approx(18.88 - 18.20)
    assert comparisons.published_difference("bart-base", "centralized", "fedavg", "Academic", "rougeLsum") is None
    assert comparisons.published_difference("bart-large", "fedprox", "single", comparisons.AVERAGE, "avg_rouge") is None


def _row(**kw) -> dict:
    base = {
        "study": "main",
        "study_b": "main",
        "client": comparisons.AVERAGE,
        "metric": "avg_rouge",
        "config_a": kw.get("method_a"),
        "config_b": kw.get("method_b"),
        "p_value": 0.5,
        "significant": False,
        "identical_fraction": math.nan,
        "mostly_identical": False,
        "mean_diff": 0.0,
        "n_seeds": 3,
        "n_examples": 244,
    }
    # the family adjustment is tested on its own (tests/test_stats.py); here a row's adjusted p is its own
    return base | {"p_holm": kw.get("p_value", base["p_value"])} | kw


def test_with_published_fills_only_the_papers_pairs_in_the_main_study():
    table = pd.DataFrame(
        [
            _row(method_a="fedselectkd", method_b="single", ci_low=-0.56, ci_high=0.62),
            _row(method_a="centralized", method_b="fedselectkd", ci_low=1.03, ci_high=3.10),
            _row(method_a="fedselectkd", method_b="fedkd", ci_low=-0.36, ci_high=0.48),
            _row(
                method_a="fedselectkd",
                method_b="single",
                ci_low=-0.5,
                ci_high=0.5,
                study="tau_sweep",
                config_a="fedselectkd tau=0.87",
            ),
        ]
    )
    out = comparisons.with_published(table)
    assert list(out.columns[-6:]) == PUBLISHED_COLUMNS
    assert list(out["vs_published_bart-large"]) == ["excludes above", "excludes below", "contains", ""]
    assert list(out["vs_published_bart-base"]) == ["excludes above", "excludes below", "excludes above", ""]
    assert math.isnan(out["published_led-large"].iloc[3])


# --- every pair of the main methods ---------------------------------------------------------------------------

MAIN = ("single", "centralized", "fedavg", "fedkd", "fedselectkd")


@pytest.fixture
def five_methods(tmp_path):
    eval_dir = tmp_path / "eval"
    planned = []
    for i, method in enumerate(MAIN):
        _write_eval(eval_dir, f"{method}-domain", float(i), f"{method} words")
        planned.append(
            Experiment(
                f"{method}-domain", method, "domain/seed0", 0, "main", tau=5.0 if method == "fedselectkd" else None
            )
        )
    _write_eval(eval_dir, "quantile", 4.5, "quantile words")
    planned.append(Experiment("quantile", "fedselectkd", "domain/seed0", 0, "tau_sweep", tau=0.87))
    return eval_dir, planned


def test_every_pair_of_the_main_methods_and_the_gate_variant_is_compared_once(five_methods):
    eval_dir, planned = five_methods
    configs = comparisons.configurations(planned, with_labels(planned))
    table, _ = comparisons.comparisons_table(configs, ["single", "fedavg", "fedkd"], eval_dir, CFG)
    avg = table[(table["client"] == comparisons.AVERAGE) & (table["metric"] == "avg_rouge")]
    main = avg[avg["study"] == "main"]
    pairs = [frozenset((r.method_a, r.method_b)) for r in main.itertuples()]
    assert len(pairs) == len(set(pairs))  # no pair twice, in either orientation
    assert set(pairs) == {frozenset(p) for p in itertools.combinations(MAIN, 2)}
    # AdaCentralized is A against every other method; the mean difference is A's shift minus B's
    central = main[main["method_a"] == "centralized"]
    assert set(central["method_b"]) == {"single", "fedavg", "fedkd", "fedselectkd"}
    shift = {m: float(i) for i, m in enumerate(MAIN)}
    for r in main.itertuples():
        assert r.mean_diff == pytest.approx(shift[r.method_a] - shift[r.method_b])
    # the gate variant against each main method, its own method's main configuration included
    gate = avg[avg["study"] == "tau_sweep"]
    assert sorted(gate["method_b"]) == sorted(MAIN)
    own = gate[gate["method_b"] == "fedselectkd"].iloc[0]
    assert own["study_b"] == "main" and own["mean_diff"] == pytest.approx(0.5)


# --- convergence from rounds files ----------------------------------------------------------------------------


def _rounds(path: Path, losses: dict[str, list[float]], metrics: dict | None = None) -> None:
    path.mkdir(parents=True)
    n = max(len(v) for v in losses.values())
    rows = [{"round": r + 1} | {f"{c}/val_loss": v[r] for c, v in losses.items() if r < len(v)} for r in range(n)]
    (path / "rounds.json").write_text(json.dumps(rows))
    if metrics is not None:
        (path / "metrics.json").write_text(json.dumps(metrics))


def test_convergence_counts_client_runs_whose_best_round_is_the_last(tmp_path):
    train = tmp_path / "train"
    _rounds(train / "a", {"X": [5.0, 4.0, 3.0], "Y": [5.0, 3.0, 4.0]})  # X best at 3 = last; Y at 2
    _rounds(train / "b", {"X": [5.0, 4.0, 3.9], "Y": [4.0, 4.0, 4.5]})  # X last; Y tie 1/2 -> earliest (1)
    # a record that states `converged` (the stop rule's verdict) is the run's verdict; its clients' rounds are their own
    _rounds(train / "c", {"X": [3.0, 2.0]}, {"converged": True, "clients": {"X": {"best_round": 2}}})
    planned = [
        Experiment("a", "fedavg", "domain/seed0", 0, "main"),
        Experiment("b", "fedavg", "domain/seed0", 1, "main"),
        Experiment("c", "single", "domain/seed0", 0, "other"),
        Experiment("gone", "single", "domain/seed0", 0, "main"),
    ]
    table = readers.convergence_table(planned, with_labels(planned), train)
    flags = {(r.experiment, r.client): (r.best_round, r.last_round, r.best_is_last) for r in table.itertuples()}
    assert flags == {
        ("a", "X"): (3, 3, True),
        ("a", "Y"): (2, 3, False),
        ("b", "X"): (3, 3, True),
        ("b", "Y"): (1, 3, False),
        ("c", "X"): (2, 2, True),  # best in its last round by 1.0, and the stop rule held there
    }
    assert readers.row_mark(table, "main", "fedavg", "X") == f"{readers.MARK} 2/2"
    assert readers.row_mark(table, "main", "fedavg", "Y") == ""
    assert readers.convergence_note(table, ["main"]).startswith(f"{readers.MARK} 2 of 4 client-runs")
    assert "(3)" in readers.convergence_note(table, ["main"])
    assert readers.convergence_note(table, ["other"]) == (
        f"{readers.MARK} 0 of 1 runs did not meet the stop rule by their round ceiling; 1 of 1 client-runs had their "
        "best validation round in their last round (2)."
    )
    assert readers.run_converged(train, "a") is False and readers.run_converged(train, "c") is True
    assert readers.run_converged(train, "gone") is None


def test_the_best_round_is_the_round_the_client_kept_not_its_lowest_received_loss(tmp_path):
    """A client's best round is the round of its adapter_best (what is evaluated), which its replies report and the
    train record keeps (clients.<c>.best_round); rounds.json holds only the losses the server received. By hand: X's
    round-2 evaluation reply was lost (its loss 3.0, the lowest: the round X kept, as its round-3 reply reports), its
    received losses are 5.0 (round 1) and 4.0 (round 3); so X's best round is 2 of 3 and X was not still improving,
    though its lowest received loss is in its last round. Y (5.0, 4.5, 4.0, all received) kept round 3 of 3."""
    run = tmp_path / "train" / "r"
    run.mkdir(parents=True)
    rows = [
        {"round": 1, "X/val_loss": 5.0, "Y/val_loss": 5.0},
        {"round": 2, "Y/val_loss": 4.5},  # X's reply lost
        {"round": 3, "X/val_loss": 4.0, "Y/val_loss": 4.0},
    ]
    (run / "rounds.json").write_text(json.dumps(rows))
    clients = {"X": {"best_round": 2, "best_val_loss": None}, "Y": {"best_round": 3, "best_val_loss": 4.0}}
    (run / "metrics.json").write_text(json.dumps({"rounds": 3, "converged": None, "clients": clients}))
    planned = [Experiment("r", "fedavg", "domain/seed0", 0, "main")]
    table = readers.convergence_table(planned, with_labels(planned), tmp_path / "train")
    got = list(zip(table["client"], table["best_round"], table["last_round"], table["best_is_last"]))
    assert got == [("X", 2, 3, False), ("Y", 3, 3, True)]
    assert readers.row_mark(table, "main", "fedavg", "X") == ""
    assert readers.row_mark(table, "main", "fedavg", None) == f"{readers.MARK} 1/2"


def test_a_client_whose_final_evaluation_reply_was_lost_is_judged_at_its_last_scored_round(tmp_path):
    """docs/statistics.md, Round budget: X's round-3 evaluation reply was lost (the run stopped at 3); its received
    losses 5.0, 4.0 and its kept round 2 (its round-2 reply) are its last scored: best 2 of its last 2, marked, since
    nothing shows round 3 was no better (had it been, X kept it). Y (5.0, 3.0, 3.5, all received) is best at 2 of 3.
    A record without rounds.json cannot tell a lost reply and takes the run's stopped_round (3) as X's last round."""
    run = tmp_path / "train" / "r"
    run.mkdir(parents=True)
    clients = {"X": {"best_round": 2}, "Y": {"best_round": 2}}
    (run / "metrics.json").write_text(json.dumps({"stopped_round": 3, "converged": None, "clients": clients}))
    planned = [Experiment("r", "fedavg", "domain/seed0", 0, "main")]

    def got():
        table = readers.convergence_table(planned, with_labels(planned), tmp_path / "train")
        return list(zip(table["client"], table["best_round"], table["last_round"], table["best_is_last"]))

    assert got() == [("X", 2, 3, False), ("Y", 2, 3, False)]
    rows = [
        {"round": 1, "X/val_loss": 5.0, "Y/val_loss": 5.0},
        {"round": 2, "X/val_loss": 4.0, "Y/val_loss": 3.0},
        {"round": 3, "X/eval_failed": 1, "Y/val_loss": 3.5},
    ]
    (run / "rounds.json").write_text(json.dumps(rows))
    assert got() == [("X", 2, 2, True), ("Y", 2, 3, False)]


def test_a_stop_rule_run_not_converged_by_its_ceiling_is_counted_as_a_run_not_as_every_client_best_last(tmp_path):
    """Under train.stop the record's `converged: false` says the client-average rule never held by the ceiling; it says
    nothing of each client's best round. By hand: run s (ceiling 3) X 5, 4, 3 (best 3 = last), Y 5, 3, 4 (best 2);
    run t converged at round 3 with X best at 3 by a hair, Y best at 1. So 1 of 2 runs did not meet the rule, 2 of 4
    client-runs had their best round last (X twice), and Y's row is unmarked."""
    train = tmp_path / "train"
    _rounds(train / "s", {"X": [5.0, 4.0, 3.0], "Y": [5.0, 3.0, 4.0]}, {"converged": False, "stopped_round": 3})
    _rounds(train / "t", {"X": [5.0, 4.0, 3.999], "Y": [4.0, 4.1, 4.1]}, {"converged": True, "stopped_round": 3})
    planned = [
        Experiment("s", "fedavg", "domain/seed0", 0, "main"),
        Experiment("t", "fedavg", "domain/seed0", 1, "main"),
    ]
    table = readers.convergence_table(planned, with_labels(planned), train)
    assert readers.row_mark(table, "main", "fedavg", "X") == f"{readers.MARK} 2/2"
    assert readers.row_mark(table, "main", "fedavg", "Y") == ""
    assert readers.convergence_note(table, ["main"]) == (
        f"{readers.MARK} 1 of 2 runs did not meet the stop rule by their round ceiling (3), so these numbers hold for "
        "this round budget only; 2 of 4 client-runs had their best validation round in their last round (3)."
    )
    assert (readers.run_converged(train, "s"), readers.run_converged(train, "t")) == (False, True)
    comparison = _row(method_a="centralized", method_b="single", mean_diff=1.7, ci_low=1.0, ci_high=2.4)
    text = claims.results_text(pd.DataFrame([comparison]), table)
    assert "2 of 4 client-runs had their best validation round" in text and "1 of 2 runs are not converged" in text


def test_the_evaluate_stage_reads_convergence_from_the_models_folder_long_rounds(tmp_path):
    """The evaluate stage tags its MLflow run from models/<exp>/ (run_converged(models_dir, ...)), whose rounds.json
    is the training history's long rows (round, client, val_loss, ...), not the report's wide columns."""
    run = tmp_path / "models" / "r"
    run.mkdir(parents=True)
    losses = {"X": [5.0, 4.0, 3.0], "Y": [5.0, 3.0, 4.0]}  # X best in round 3 of 3 (still improving), Y in round 2
    history = [
        {"round": r + 1, "client": c, "val_loss": v[r], "best_round": 1} for r in range(3) for c, v in losses.items()
    ]
    (run / "rounds.json").write_text(json.dumps(history))
    (run / "metrics.json").write_text(
        json.dumps({"converged": None, "clients": {"X": {"best_round": 3}}})
    )  # no stop rule
    f = readers.run_convergence(tmp_path / "models", "r")
    assert list(zip(f["client"], f["best_round"], f["last_round"], f["best_is_last"])) == [
        ("X", 3, 3, True),
        ("Y", 2, 3, False),
    ]
    assert readers.run_converged(tmp_path / "models", "r") is False  # X was still improving


def test_convergence_without_rounds_reads_the_metrics_summary(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.json").write_text(
        json.dumps(
            {
                "rounds": 8,
                "clients": {"X": {"best_round": 8, "rounds_trained": 8}, "Y": {"best_round": 5, "rounds_trained": 8}},
            }
        )
    )
    f = readers.run_convergence(tmp_path, "r")
    assert dict(zip(f["client"], f["best_is_last"])) == {"X": True, "Y": False}


def test_convergence_without_rounds_compares_the_best_round_with_the_last_round_not_a_count(tmp_path):
    # A sampling run (2 of 3 clients a round), 10 rounds, as training.summary records it: each client validates every
    # round but trains in 7 (rounds_trained). X's best validation round is round 10 of 10 (still improving), Y's
    # round 7 (three rounds after it did no better): rounds.json would say (10, 10, True) and (7, 10, False).
    run = tmp_path / "r"
    run.mkdir()
    clients = {"X": {"best_round": 10, "rounds_trained": 7}, "Y": {"best_round": 7, "rounds_trained": 7}}
    (run / "metrics.json").write_text(json.dumps({"rounds": 10, "stopped_round": 10, "clients": clients}))
    f = readers.run_convergence(tmp_path, "r")
    assert list(zip(f["client"], f["best_round"], f["last_round"], f["best_is_last"])) == [
        ("X", 10, 10, True),
        ("Y", 7, 10, False),
    ]


# --- the generated text ---------------------------------------------------------------------------------------


def test_results_text_renders_the_numbers_of_the_table():
    table = pd.DataFrame(
        [
            _row(
                method_a="fedkd",
                method_b="single",
                mean_diff=-0.05,
                ci_low=-0.71,
                ci_high=0.57,
                identical_fraction=0.18,
            ),
            _row(
                method_a="fedselectkd",
                method_b="single",
                mean_diff=0.02,
                ci_low=-0.56,
                ci_high=0.62,
                identical_fraction=0.23,
            ),
        ]
    )
    text = claims.results_text(table)
    assert "+0.02 [−0.56, +0.62]" in text and "−0.05 [−0.71, +0.57]" in text
    assert "+0.85 to +2.09" in text and "+0.57 and +0.62" in text  # the excluded published gains, our upper limits
    assert "18-23 %" in text
    moved = table.assign(ci_high=[0.90, 2.50])  # now the paper's SelectKD gain on BART-base (+1.40) is inside
    assert "+0.85 to +2.09" not in claims.results_text(moved)


def _tau3_row(**values):
    """A tau-sweep comparison: SelectKD at tau 3 against tau 5."""
    return _row(
        method_a="fedselectkd",
        method_b="fedselectkd",
        config_a="fedselectkd tau=3",
        config_b="fedselectkd tau=5",
        study="tau_sweep",
        **values,
    )


def test_a_selectkd_variant_of_another_study_is_not_called_a_gate_and_one_p_only_backs_a_supported_line():
    table = pd.DataFrame(
        [
            _row(
                method_a="fedselectkd",
                method_b="fedselectkd",
                config_a="fedselectkd tau=5",
                config_b="fedselectkd tau=5",
                study="sampling",
                mean_diff=0.75,
                ci_low=0.23,
                ci_high=1.31,
                p_value=0.01,
                significant=True,
            ),
            _tau3_row(mean_diff=-0.21, ci_low=-0.54, ci_high=0.03, p_value=0.2),
            _row(method_a="centralized", method_b="single", mean_diff=0.30, ci_low=-0.58, ci_high=1.19, p_value=0.855),
            _row(
                method_a="centralized",
                method_b="fedavg",
                mean_diff=2.17,
                ci_low=1.31,
                ci_high=3.05,
                p_value=0.001,
                significant=True,
            ),
        ]
    )
    lines = claims.results_text(table).splitlines()
    sampling = next(line for line in lines if "+0.75 [+0.23, +1.31]" in line)
    assert "gate" not in sampling and "sampling" in sampling
    tau = next(line for line in lines if "−0.21 [−0.54, +0.03]" in line)
    assert "gate** (tau=3)" in tau and "no difference detected" in tau
    pooling = next(line for line in lines if "+2.17 [+1.31, +3.05]" in line)
    assert "0.855" not in pooling  # the largest p of a line that is not supported is no evidence for it
    both = table.assign(significant=True, p_value=[0.01, 0.2, 0.004, 0.001], p_holm=[0.01, 0.2, 0.008, 0.002])
    pooled = next(line for line in claims.results_text(both).splitlines() if "+2.17 [+1.31, +3.05]" in line)
    assert "Holm p ≤ 0.008 each" in pooled  # the claims' p is the family-adjusted one


def test_a_comparison_with_fewer_seeds_than_the_claim_minimum_gives_numbers_only():
    rows = [
        _row(method_a="centralized", method_b="single", mean_diff=1.7, ci_low=1.0, ci_high=2.4, p_value=0.001),
        _row(method_a="centralized", method_b="fedavg", mean_diff=2.3, ci_low=0.2, ci_high=4.4, p_value=0.01),
    ]
    table = pd.DataFrame(rows).assign(significant=True, n_seeds=[3, 2])
    text = claims.results_text(table, cfg=ReportConfig(smoke=False, claim_min_seeds=3))
    line = next(x for x in text.splitlines() if "Pooling the data" in x)
    assert line.startswith("- **Pooling the data helps against some methods**")  # not "helps": FedAvg has 2 seeds
    assert "AdaCentralized − FedAvg +2.30 [+0.20, +4.40], 2 seeds: numbers only (paper" in line
    assert "The lead holds against AdaSingle (Holm p = 0.001) only." in text
    assert "Per client its lead holds vs AdaSingle on no client; vs FedAvg not tested (2 seeds)." in text
    one = claims.results_text(table.assign(n_seeds=[3, 1]), cfg=ReportConfig(smoke=False, claim_min_seeds=3))
    assert "+4.40], 1 seed: numbers only (paper" in one and "vs FedAvg not tested (1 seed)." in one  # singular
    # at 2 seeds a claim is allowed: both leads hold
    text = claims.results_text(table, cfg=ReportConfig(smoke=False, claim_min_seeds=2))
    assert "- **Pooling the data helps** (Holm p ≤ 0.010 each)" in text and "numbers only" not in text


def test_a_pooling_comparison_without_a_p_value_is_worded_not_a_crash():
    rows = [
        _row(method_a="centralized", method_b="single", mean_diff=0.3, ci_low=-0.2, ci_high=0.8, p_value=float("nan")),
        _row(method_a="centralized", method_b="fedavg", mean_diff=1.7, ci_low=1.0, ci_high=2.4, p_value=0.001),
    ]
    table = pd.DataFrame(rows).assign(significant=[False, True], n_seeds=3)  # a NaN p: e.g. one meeting a client
    line = next(x for x in claims.results_text(table).splitlines() if "Pooling the data" in x)
    assert line.startswith("- **Pooling the data helps against some methods**") and "≤" not in line


def test_a_comparison_with_fewer_seeds_than_the_claim_minimum_excludes_nothing_and_finds_nothing():
    """docs/statistics.md: a comparison with fewer than `report.claim_min_seeds` seeds states its numbers, no claim:
    neither that the paper's gain or gap is excluded nor that a gate makes no difference."""
    few = [
        # the paper's FedAvg - AdaSingle (+0.56 to +1.01) and AdaCentralized - FedAvg (+0.90 to +1.37, Table III) are
        # above and below these intervals on every backbone
        _row(method_a="fedavg", method_b="single", mean_diff=-0.4, ci_low=-1.0, ci_high=0.3),
        _row(method_a="centralized", method_b="fedavg", mean_diff=2.5, ci_low=2.0, ci_high=3.0),
        _tau3_row(mean_diff=0.5, ci_low=0.2, ci_high=0.8, p_value=0.01, significant=True),
    ]
    table = pd.DataFrame([*few, _row(method_a="fedkd", method_b="single")]).assign(n_seeds=[2, 2, 2, 3])
    allowed = claims.results_text(table, cfg=ReportConfig(smoke=False, claim_min_seeds=2))
    assert (
        "The paper's gains of FedAvg over AdaSingle" in allowed
        and "below every one of our unadjusted lower limits" in allowed
    )
    text = claims.results_text(table, cfg=ReportConfig(smoke=False, claim_min_seeds=3))
    for claim in ("excluded here", "below every one of our", "no difference detected", "ROUGE (Holm"):
        assert claim not in text
    gate = next(line for line in text.splitlines() if "(tau=3)" in line)
    assert gate.endswith("+0.50 [+0.20, +0.80]: 2 seeds: numbers only.")


def test_the_step_ratio_of_adacentralized_is_stated_per_client():
    table = pd.DataFrame([_row(method_a="centralized", method_b="single", mean_diff=1.7, ci_low=1.0, ci_high=2.4)])
    ratios = (("Academic", 69 / 14), ("Product", 69 / 38))
    text = claims.results_text(table, centralized_steps="epoch", step_ratios=ratios)
    assert "4.9x Academic's, 1.8x Product's optimizer steps a round" in text
    assert claims.LARGEST_CLIENT_STEPS in claims.results_text(table)


def test_replace_block_rewrites_only_between_the_markers():
    text = f"head\n{claims.BEGIN}\nold\n{claims.END}\ntail\n"
    new = claims.replace_block(text, "new line\n")
    assert new == f"head\n{claims.BEGIN}\nnew line\n{claims.END}\ntail\n"
    assert _block(new) == "new line\n"
    with pytest.raises(ValueError):
        claims.replace_block("no markers", "x")


def _claims_check(study: str, *files: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.report", "claims", study, *files, "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_committed_readme_blocks_equal_what_the_study_generates():
    """The READMEs' results blocks are what `python -m pipeline.report claims` renders from the committed
    comparisons.csv and train/ rounds files (README.md's and the GPU study's from reports/gpu-study, the CPU
    study's from reports/cpu-study): a number edited by hand, or a table that moved without the text, fails here."""
    _claims_check("reports/gpu-study", "README.md", "reports/gpu-study/README.md")
    _claims_check("reports/cpu-study", "reports/cpu-study/README.md")
    assert "56 of 60 client-runs" in _block((ROOT / "reports/cpu-study/README.md").read_text(encoding="utf-8"))
    for study in ("gpu-study", "cpu-study"):
        comp = pd.read_csv(ROOT / "reports" / study / "comparisons.csv")
        main = comp[
            (comp["study"] == "main") & (comp["client"] == comparisons.AVERAGE) & (comp["metric"] == "avg_rouge")
        ]
        assert {frozenset(p) for p in zip(main["method_a"], main["method_b"])} == {
            frozenset(p) for p in itertools.combinations(MAIN, 2)
        }
        assert set(PUBLISHED_COLUMNS) <= set(comp.columns)


def test_the_readmes_words_on_the_gpu_study_are_its_files():
    """README.md's paragraph above the block: the device, the seeds an arm, each run to its stop rule, the runs left
    unevaluated (FedAvg's and the quantile gate's), and the CPU study's round budget, from the committed files."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    gpu = ROOT / "reports/gpu-study"
    device = json.loads((gpu / "device/study.json").read_text())["device"]["gpu"].split(",")[0]
    assert f"run on a lent {device}." in text
    experiments = yaml.safe_load((gpu / "params.yaml").read_text())["experiments"]
    seeds: dict[str, list[int]] = {}
    for name, e in experiments.items():  # <arm>-s<seed>
        seeds.setdefault(name.rsplit("-s", 1)[0], []).append(e["seed"])
    assert {tuple(sorted(v)) for v in seeds.values()} == {(0, 1, 2, 3, 4)} and "five paired seeds" in text
    runs = {d.name: json.loads((d / "metrics.json").read_text()) for d in (gpu / "runs").iterdir()}
    assert set(runs) == set(experiments) and all(m["converged"] for m in runs.values())
    unevaluated = {n for n in experiments if not (gpu / "eval" / n / "metrics.json").is_file()}
    assert {n.rsplit("-s", 1)[0] for n in unevaluated} == {"fedavg-domain", "fedselectkd-quantile"}
    assert "fedavg-domain-s0" not in unevaluated  # FedAvg has fewer seeds than the others, the quantile gate none
    assert all(f"fedselectkd-quantile-s{s}" in unevaluated for s in range(5))
    rounds = yaml.safe_load((ROOT / "reports/cpu-study/params.yaml").read_text())["train"]["rounds"]
    assert f"`configs/cpu-study.yaml` ({rounds} rounds, runs still improving)" in text


def test_the_gpu_study_is_what_its_rebuild_writes_without_the_summaries(tmp_path):
    """reports/gpu-study holds no predictions.jsonl (the import removes them after its rebuild): a rebuild of the
    committed folder, its tables and its intervals removed, takes the identical fractions from its comparisons.csv
    and writes the same comparisons and tables, to the byte."""
    study = ROOT / "reports/gpu-study"
    assert not list(study.glob("eval/*/predictions.jsonl"))
    copy = tmp_path / "gpu-study"
    shutil.copytree(study, copy)
    for f in copy.glob("tables/*"):
        f.unlink()
    comp = pd.read_csv(copy / "comparisons.csv")  # what the rebuild computes gone; the identical fractions kept
    comp[["mean_diff", "ci_low", "ci_high", "p_value", "p_holm", "significant"]] = None
    comp.to_csv(copy / "comparisons.csv", index=False)
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.report", "rebuild", str(copy)], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    for f in (study / "comparisons.csv", *sorted(study.glob("tables/*"))):
        assert (copy / f.relative_to(study)).read_bytes() == f.read_bytes(), f


# --- the report stage and the study rebuild -------------------------------------------------------------------


def _study_folder(root: Path) -> dict:
    """A study laid out as reports/cpu-study is: params.yaml, eval/<exp>/per_example.parquet,
    train/<exp>/rounds.json."""
    params = {"tau": 5.0, "experiments": {}, "bootstrap": {"n_resamples": 200, "seed": 0}}
    for i, method in enumerate(MAIN):
        name = f"{method}-domain"
        params["experiments"][name] = {"method": method, "partition": "domain/seed0", "seed": 0, "study": "main"}
        _write_eval(root / "eval", name, float(i), f"{method} words")
        # AdaSingle still improving at its last round on Academic; every other client-run best at round 2 of 3
        _rounds(
            root / "train" / name,
            {"Academic": [5.0, 4.0, 3.0 if method == "single" else 4.5], "Product": [5.0, 4.0, 4.2]},
        )
    import yaml

    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return params


def test_report_stage_writes_every_main_pair_with_the_papers_differences(tmp_path):
    from pipeline.paths import ProjectPaths
    from pipeline.report import report_inputs
    from pipeline.results.outputs import build_report

    study = tmp_path / "study"
    params = _study_folder(study)
    (tmp_path / "reports").mkdir()
    (study / "eval").rename(tmp_path / "reports/eval")
    (study / "train").rename(tmp_path / "reports/train")
    for f in (tmp_path / "reports/eval").glob("*/predictions.jsonl"):
        f.unlink()  # the fixture's records lack the case study's fields; comparisons do not need them
    build_report(report_inputs(params | {"report": {"expected_seeds": [0]}}), ProjectPaths(tmp_path))
    tables = tmp_path / "reports/tables"
    comp = pd.read_csv(tables / "comparisons.csv")
    avg = comp[(comp["client"] == comparisons.AVERAGE) & (comp["metric"] == "avg_rouge")]
    assert {frozenset(p) for p in zip(avg["method_a"], avg["method_b"])} == {
        frozenset(p) for p in itertools.combinations(MAIN, 2)
    }
    row = avg[(avg["method_a"] == "fedselectkd") & (avg["method_b"] == "single")].iloc[0]
    assert row["mean_diff"] == pytest.approx(4.0)  # shifts 4 and 0
    assert row["published_bart-large"] == pytest.approx(
        comparisons.published_difference("bart-large", "fedselectkd", "single", comparisons.AVERAGE, "avg_rouge")
    )
    assert row["vs_published_bart-large"] == "excludes below"  # our [+4, +4] is above the paper's +2.09
    main_md = (tables / "study_main.md").read_text()
    assert f"{readers.MARK} 1 of 10 client-runs" in main_md
    single = [line for line in main_md.splitlines() if line.startswith("| single | tiny | Academic")]
    assert single and single[0].rstrip(" |").endswith(f"{readers.MARK} 1/1")
    assert "1 of 10 client-runs" in (tables / "results.md").read_text()


@pytest.mark.slow  # four stage CLIs in subprocesses: about 60 s on 2 cores, 120+ s under the fast lane's load
def test_rebuild_rewrites_a_study_folder_and_its_readme_block(tmp_path):
    _study_folder(tmp_path)
    (tmp_path / "README.md").write_text(f"# study\n\n{claims.BEGIN}\nstale\n{claims.END}\nkept\n")
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.report", "rebuild", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert len(pd.read_csv(tmp_path / "comparisons.csv")) == 10 * 3 * 5  # 10 pairs x (2 clients + average) x 5 metrics
    text = (tmp_path / "README.md").read_text()
    assert "stale" not in text and text.endswith(f"{claims.END}\nkept\n") and "1 of 10 client-runs" in text
    check = [sys.executable, "-m", "pipeline.report", "claims", str(tmp_path), str(tmp_path / "README.md"), "--check"]
    assert subprocess.run(check, cwd=ROOT, capture_output=True).returncode == 0
    (tmp_path / "README.md").write_text(text.replace("1 of 10", "0 of 10"))  # a number edited by hand
    assert subprocess.run(check, cwd=ROOT, capture_output=True).returncode == 1
    (tmp_path / "README.md").write_text("no block")
    assert subprocess.run(check, cwd=ROOT, capture_output=True).returncode == 2


# --- the MLflow tag -------------------------------------------------------------------------------------------


def test_imported_evaluation_tags_its_run_converged_from_the_train_record_beside_it(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from pipeline.common.cli import run as run_cli
    from pipeline.evaluate import main
    from tests.test_tracking import _eval_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDMEET_ROOT", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    records = []
    for name, academic in (("still-improving", [5.0, 4.0, 3.0]), ("settled", [5.0, 3.0, 4.0]), ("no-train", None)):
        metrics, d = _eval_dir(tmp_path, name)  # tmp/eval/<name>: its train record is tmp/train/<name>
        records.append(str(d / "metrics.json"))
        if academic is not None:
            _rounds(tmp_path / "train" / name, {"Academic": academic, "Committee": [5.0, 3.0, 3.5]})
    assert run_cli(main, ["import-eval", "--study", "imported", *records]) == 0
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("imported").experiment_id], "tags.experiment LIKE '%'")
    tags = {r.info.run_name: r.data.tags.get("converged") for r in runs}
    assert tags == {"still-improving": "false", "settled": "true", "no-train": None}


def _scaled(rows: list[dict], seeds: int, examples: int) -> pd.DataFrame:
    return pd.DataFrame([r | {"n_seeds": seeds, "n_examples": examples} for r in rows])


VERDICT_ROWS = [
    _row(
        method_a="fedavg",
        method_b="single",
        mean_diff=-1.87,
        ci_low=-2.55,
        ci_high=-1.15,
        p_value=0.001,
        significant=True,
    ),
    _row(
        method_a="fedselectkd",
        method_b="fedkd",
        mean_diff=0.58,
        ci_low=0.23,
        ci_high=0.85,
        p_value=0.002,
        significant=True,
    ),
]


def test_a_significant_loss_is_named_one_and_a_gain_a_gain():
    lines = claims.results_text(_scaled(VERDICT_ROWS, 3, 244)).splitlines()
    assert any(
        line.startswith("- **Federation, as run here, hurts**") and "−1.87 [−2.55, −1.15]" in line for line in lines
    )
    assert any(line.startswith("- **Selectivity helps**") for line in lines)
    assert "3 seeds and 244 test examples a comparison" in lines[0]
    # a loss that holds is named even beside a gain that holds (docs/statistics.md: it is named a loss)
    gain = _row(method_a="fedselectkd", method_b="single", mean_diff=1.2, ci_low=0.5, ci_high=1.9, significant=True)
    lines = claims.results_text(_scaled([*VERDICT_ROWS, gain], 3, 244)).splitlines()
    assert any(line.startswith("- **Federation, as run here, helps and hurts**") for line in lines)


@pytest.mark.parametrize(
    "smoke, seeds, examples, why",
    [(True, 3, 244, "smoke run"), (False, 1, 244, "1 seed and 244"), (False, 3, 24, "24 test examples")],
)
def test_a_smoke_run_or_too_small_a_study_states_numbers_but_no_claim(smoke, seeds, examples, why):
    text = claims.results_text(
        _scaled(VERDICT_ROWS, seeds, examples), cfg=ReportConfig(smoke=smoke, claim_min_seeds=2, claim_min_examples=100)
    )
    assert "No comparative claim" in text and why in text
    assert "−1.87 [−2.55, −1.15]" in text and "+0.58 [+0.23, +0.85]" in text  # the numbers stay
    assert "excluded" not in text and "inside our interval" not in text  # nor a verdict against the paper
    for verdict in ("helps", "hurts", "does not measurably help"):
        assert verdict not in text


def test_the_backbone_caveat_comes_from_the_records():
    backbone = {
        "name": "tiny",
        "parameters": 12_345_678,
        "evaluation": {"rouge1": 38.1, "examples": 818, "dataset": "samsum"},
    }
    kd = {"tau": 5.0, "tau_unit": "nats", "clients": {"A": {"kd_usage_ratio": 0.421}, "B": {"kd_usage_ratio": 0.5438}}}
    note = claims.backbone_note(backbone, kd)
    assert "`tiny` (12.3M parameters, ROUGE-1 38.10 on 818 samsum" in note
    assert "42-54 % of target words at tau = 5.0 nats, the paper's on 86-89 %" in note  # METHOD.md: 0.86-0.89
    # a record written before kd_analysis.json held the unit: the tau without one
    assert "of target words at tau = 5.0, the paper's" in claims.backbone_note(backbone, kd | {"tau_unit": None})
    assert claims.backbone_note(None, kd) == ""
    assert claims.results_text(_scaled(VERDICT_ROWS, 3, 244), backbone=note).splitlines()[1] == note


def test_the_default_profile_states_numbers_and_draws_no_claim():
    """params.yaml (the CPU smoke profile) sets report.smoke, and its committed results.md holds numbers only."""
    from pipeline.common.config import from_dict, load_params

    params = load_params(ROOT / "params.yaml")
    assert from_dict(ReportConfig, params.get("report"), "report").smoke
    text = (ROOT / "reports/tables/results.md").read_text(encoding="utf-8")
    assert "**No comparative claim**: a smoke run (`report.smoke: true`)" in text
    for verdict in ("helps", "hurts", "does not measurably help", "excluded", "inside our interval"):
        assert verdict not in text


def test_the_claims_say_how_many_runs_are_not_converged():
    """A run is not converged when any of its clients is (its best round was its last, or its record says the stop
    rule never held before the ceiling); the results text counts runs besides client-runs."""
    table = pd.DataFrame([_row(method_a="centralized", method_b="single", mean_diff=1.7, ci_low=1.0, ci_high=2.4)])
    convergence = pd.DataFrame(
        {
            "experiment": ["a-s0", "a-s0", "b-s0", "b-s0", "c-s0"],
            "client": ["A", "B", "A", "B", "A"],
            "best_round": [8, 5, 8, 8, 3],
            "last_round": [8, 8, 8, 8, 8],
            "best_is_last": [True, False, True, True, False],
            "converged": None,  # a fixed round budget
            "study": "main",
            "label": ["a", "a", "b", "b", "c"],
            "seed": 0,
        }
    )
    text = claims.results_text(table, convergence)
    assert "3 of 5 client-runs had their best validation round in their last round (8)" in text
    assert "2 of 3 runs are not converged" in text
    # what not converged means under each regime (a stop-rule run whose last round was its best by a hair is
    # converged: the GPU study's text had said "a client still improving at the last round" beside such runs)
    assert "(with the stop rule of `train.stop`: it never held before the round ceiling; with a fixed round " in text


def test_the_bound_on_every_holm_p_of_a_supported_line_is_never_below_the_largest():
    """'Holm p ≤ x each' must hold for every comparison of the line: x is the largest Holm p rounded up to three
    decimals (rounded to nearest, 0.0124 printed as 0.012, a bound the comparison does not meet)."""
    rows = [
        _row(method_a="centralized", method_b="single", mean_diff=1.7, ci_low=1.0, ci_high=2.4, p_value=0.0124),
        _row(method_a="centralized", method_b="fedavg", mean_diff=2.3, ci_low=0.2, ci_high=4.4, p_value=0.004),
    ]
    text = claims.results_text(pd.DataFrame(rows).assign(significant=True))
    assert "- **Pooling the data helps** (Holm p ≤ 0.013 each)" in text


def test_a_variant_whose_unadjusted_interval_excludes_zero_is_not_read_as_bounds_on_a_gain_and_a_loss():
    """docs/statistics.md: the printed intervals are unadjusted and may exclude 0 while the Holm p does not pass. A
    tau-sweep family holds many comparisons, so [+0.10, +0.80] with Holm p 0.12 is ordinary: the sentence must not
    call +0.10 'a loss' nor say only differences beyond the interval are excluded (0 is outside it too)."""
    row = _tau3_row(mean_diff=0.45, ci_low=0.10, ci_high=0.80, p_value=0.008, p_holm=0.12, significant=False)
    line = next(x for x in claims.results_text(pd.DataFrame([row])).splitlines() if "(tau=3)" in x)
    assert "+0.45 [+0.10, +0.80]" in line
    assert "a loss beyond +0.10" not in line and "not a smaller difference" not in line
    assert "Holm p = 0.120" in line and "excludes 0" in line
    # an interval around 0 keeps its reading
    around = _tau3_row(mean_diff=-0.21, ci_low=-0.54, ci_high=0.03, p_value=0.2, p_holm=0.6, significant=False)
    line = next(x for x in claims.results_text(pd.DataFrame([around])).splitlines() if "(tau=3)" in x)
    assert "excludes a gain above +0.03 or a loss beyond −0.54" in line


def test_a_headline_whose_every_comparison_has_too_few_seeds_claims_no_absence_either():
    """A comparison with fewer than `report.claim_min_seeds` seeds gives numbers only: no 'helps', and no 'does not
    measurably help' (as a variant's 'no difference detected' is not stated) when it is the headline's only row."""
    rows = [
        _row(method_a="centralized", method_b="single", mean_diff=1.7, ci_low=1.0, ci_high=2.4, p_value=0.001),
        _row(method_a="fedselectkd", method_b="fedkd", mean_diff=0.3, ci_low=-0.4, ci_high=1.0, p_value=0.4),
    ]
    table = pd.DataFrame(rows).assign(significant=[True, False], p_holm=[0.002, 0.4], n_seeds=[3, 2])
    line = next(x for x in claims.results_text(table).splitlines() if "SelectKD − FedKD" in x)
    assert "2 seeds: numbers only" in line
    assert "does not measurably help" not in line and "helps" not in line
    # with the seeds a claim needs, the same row's verdict is stated
    line = next(x for x in claims.results_text(table.assign(n_seeds=3)).splitlines() if "SelectKD − FedKD" in x)
    assert line.startswith("- **Selectivity does not measurably help**")


def test_a_headline_whose_unadjusted_intervals_exclude_zero_but_no_holm_p_passes_says_so():
    """The GPU study's pooling line: AdaCentralized's unadjusted intervals were above 0 against AdaSingle, FedKD and
    SelectKD ([+0.15, +1.70], ...), none with Holm p < 0.05, under the headline "does not measurably help", which the
    intervals beside it contradict to a reader. Such a headline says the differences hold before the adjustment
    only; one whose intervals all hold 0 keeps "does not measurably help"."""
    rows = [
        _row(method_a="centralized", method_b="single", mean_diff=0.93, ci_low=0.15, ci_high=1.70, p_value=0.19),
        _row(method_a="centralized", method_b="fedkd", mean_diff=1.06, ci_low=0.28, ci_high=1.84, p_value=0.12),
        _row(method_a="fedselectkd", method_b="fedkd", mean_diff=-0.6, ci_low=-1.1, ci_high=-0.1, p_value=0.2),
        _row(method_a="fedkd", method_b="single", mean_diff=-0.13, ci_low=-0.47, ci_high=0.21, p_value=0.6),
    ]
    lines = claims.results_text(pd.DataFrame(rows)).splitlines()
    assert any(
        line.startswith("- **Pooling the data helps against some methods before Holm's adjustment only**")
        for line in lines
    )
    assert any(line.startswith("- **Selectivity hurts before Holm's adjustment only**") for line in lines)
    assert any(line.startswith("- **Federation, as run here, does not measurably help**") for line in lines)


def test_the_claim_rule_states_the_level_the_comparisons_were_tested_at(tmp_path):
    """bootstrap.level sets the intervals and the test (comparisons.with_holm: significant = Holm p < 1 - level);
    at level 0.90 a lead with Holm p 0.08 is claimed, so the text must say 90 % intervals and Holm p < 0.1, not
    95 % and 0.05 (which that claim's own p contradicts)."""
    from pipeline.results import outputs, tables

    row = _row(method_a="centralized", method_b="single", mean_diff=1.7, ci_low=0.2, ci_high=3.2, p_value=0.08)
    for level, interval, rule in ((0.9, "90 %", "0.1"), (0.95, "95 %", "0.05")):
        table = comparisons.with_holm(pd.DataFrame([row]), BootstrapConfig(level=level))
        inp = tables.ReportInputs([], tables.ReportConfig(smoke=False), BootstrapConfig(level=level))
        text = outputs.results_text(inp, table, tmp_path / "comparisons.csv", tmp_path)
        assert f"its {interval} interval" in text and f"Holm-adjusted p < {rule} over" in text
        assert ("- **Pooling the data helps** (Holm p ≤ 0.080 each)" in text) == (level == 0.9)
        assert ("95 %" in text, "p < 0.05" in text) == (level == 0.95, level == 0.95)


def test_every_exclusion_the_text_draws_from_an_interval_says_the_interval_is_unadjusted():
    """docs/statistics.md: the intervals are the unadjusted 95 % ones, the claims' test Holm's. A sentence that
    excludes the paper's gains or gaps, or a variant's larger effects, by our limits must say they are unadjusted
    (per comparison), not read as a finding held over the family."""
    gaps = [
        _row(
            method_a="centralized", method_b=m, mean_diff=3.0, ci_low=2.0, ci_high=4.0, p_value=0.001, significant=True
        )
        for m in ("single", "fedavg", "fedkd", "fedselectkd")
    ]
    fed = [
        _row(method_a=m, method_b="single", mean_diff=-0.05, ci_low=-0.7, ci_high=0.5) for m in ("fedkd", "fedselectkd")
    ]
    variant = _tau3_row(mean_diff=-0.21, ci_low=-0.54, ci_high=0.03, p_value=0.2, p_holm=0.6)
    lines = claims.results_text(pd.DataFrame([*gaps, *fed, variant])).splitlines()
    excluding = [x for x in lines if any(w in x for w in ("excluded here", "below every one", "excludes a gain"))]
    assert len(excluding) == 3, excluding  # the paper's gains, its gaps, the variant's bounds
    for line in excluding:
        assert "unadjusted" in line, line


def test_a_client_where_adacentralized_is_significantly_below_is_not_said_to_hold_its_lead():
    """docs/statistics.md: a difference that passes downwards is a loss. AdaCentralized above AdaSingle on the client
    average and on Product, significantly below it on Committee (Holm p 0.01): the per-client line names Product
    as where its lead holds and Committee as a loss, not 'its lead holds vs AdaSingle on Committee, Product'."""
    avg = _row(method_a="centralized", method_b="single", mean_diff=1.7, ci_low=1.0, ci_high=2.4, p_value=0.001)
    clients = [
        _row(method_a="centralized", method_b="single", client=c, mean_diff=d, ci_low=d - 0.5, ci_high=d + 0.5)
        for c, d in (("Academic", 0.2), ("Committee", -1.5), ("Product", 2.5))
    ]
    table = pd.DataFrame([avg, *clients]).assign(
        p_value=[0.001, 0.6, 0.01, 0.001], p_holm=[0.001, 0.6, 0.01, 0.001], significant=[True, False, True, True]
    )
    line = next(x for x in claims.results_text(table).splitlines() if "Per client its lead holds" in x)
    lead = line.split("vs AdaSingle on ", 1)[1].split(" (", 1)[0].split(",", 1)[0].rstrip(".;")
    assert lead == "Product" and "Committee, Product" not in line
    assert "a loss on Committee" in line


def test_a_significant_loss_of_adacentralized_is_not_listed_where_its_lead_holds():
    """AdaCentralized significantly above AdaSingle (+1.7) and significantly below FedKD (−1.2): the head names a
    gain and a loss, and 'The lead holds against ...' names AdaSingle only (a loss is no lead)."""
    rows = [
        _row(method_a="centralized", method_b="single", mean_diff=1.7, ci_low=1.0, ci_high=2.4, p_value=0.001),
        _row(method_a="centralized", method_b="fedkd", mean_diff=-1.2, ci_low=-1.9, ci_high=-0.5, p_value=0.002),
    ]
    lines = claims.results_text(pd.DataFrame(rows).assign(significant=True)).splitlines()
    assert any(x.startswith("- **Pooling the data helps against some methods and hurts**") for x in lines)
    held = next(x for x in lines if "The lead holds against" in x)
    assert "AdaSingle" in held and "FedKD" not in held


def test_runs_are_said_not_to_have_separated_only_where_the_tables_flag_it():
    """docs/statistics.md: above bootstrap.identical_warning (50 %) the runs did not separate (⚠). With 0-2 % of the
    KD summaries the same text as AdaSingle's, 'many runs did not separate from local training' is false; with 60 %
    (flagged) it is what the tables say."""
    fed = [
        _row(method_a=m, method_b="single", mean_diff=0.1, ci_low=-0.5, ci_high=0.7, identical_fraction=f)
        for m, f in (("fedkd", 0.0), ("fedselectkd", 0.02))
    ]
    table = pd.DataFrame(fed).assign(mostly_identical=False)
    line = next(x for x in claims.results_text(table).splitlines() if "`identical_fraction`" in x)
    assert "0-2 % of the FedKD and SelectKD summaries" in line and "did not separate" not in line
    flagged = table.assign(identical_fraction=[0.3, 0.6], mostly_identical=[False, True])
    line = next(x for x in claims.results_text(flagged).splitlines() if "`identical_fraction`" in x)
    assert "30-60 %" in line and "did not separate" in line


def test_adacentralizeds_step_rule_and_batch_are_its_own_plans_not_params_train(tmp_path):
    """An entry's train overrides reach its plan (planning.resolve_plan), so the text must state how that run
    trained: centralized-domain overrides centralized_steps epoch and batch_size 4 under params' largest_client and
    batch 8. By hand: pooled 100 examples at batch 4 = 25 steps a round, Academic's 40 at AdaSingle's batch 8 = 5
    steps: 5.0x (params' batch 8 for both would say ceil(100/8) / 5 = 2.6x, and 'largest client')."""
    from pipeline.report import report_inputs
    from pipeline.results import outputs

    runs = {"centralized-domain": ("centralized", 100), "single-domain": ("single", 40)}
    params = {"train": {"centralized_steps": "largest_client", "batch_size": 8}, "report": {"smoke": False}}
    params["experiments"] = {}
    for name, (method, n) in runs.items():
        params["experiments"][name] = {"method": method, "partition": "domain/seed0", "study": "main"}
        (tmp_path / "train" / name).mkdir(parents=True)
        (tmp_path / "train" / name / "metrics.json").write_text(
            json.dumps({"clients": {"Academic": {"n_train_examples": n}}})
        )
    params["experiments"]["centralized-domain"] |= {"centralized_steps": "epoch", "batch_size": 4}
    row = _row(method_a="centralized", method_b="single", mean_diff=1.7, ci_low=1.0, ci_high=2.4)
    table = comparisons.with_holm(pd.DataFrame([row]), BootstrapConfig())
    text = outputs.results_text(report_inputs(params), table, tmp_path / "comparisons.csv", tmp_path)
    assert "(`train.centralized_steps: epoch`): 5.0x Academic's optimizer steps a round" in text
    assert claims.LARGEST_CLIENT_STEPS not in text


def test_per_client_comparisons_with_too_few_seeds_are_not_said_to_support_no_ordering():
    """docs/statistics.md: a comparison with fewer than `report.claim_min_seeds` seeds states its numbers, no claim.
    Here every per-client federated comparison has 2 seeds (FedAvg - AdaSingle on Product at Holm p 0.001), while
    AdaCentralized - AdaSingle has 3 (so the text draws claims): 'No per-client comparison ... holds (closest: ...
    Holm p = 0.001); no ordering among them is supported' would be a finding from rows that draw none."""
    rows = [
        _row(method_a="centralized", method_b="single", mean_diff=1.7, ci_low=1.0, ci_high=2.4, p_value=0.001),
        _row(method_a="fedavg", method_b="single", mean_diff=0.2, ci_low=-0.4, ci_high=0.8, p_value=0.4),
        _row(method_a="fedavg", method_b="single", client="Product", mean_diff=1.2, ci_low=0.9, ci_high=1.5)
        | {"p_value": 0.001, "p_holm": 0.001, "significant": True},
        _row(method_a="fedavg", method_b="single", client="Academic", mean_diff=0.1, ci_low=-0.9, ci_high=1.1),
    ]
    table = pd.DataFrame(rows).assign(n_seeds=[3, 2, 2, 2])
    text = claims.results_text(table)
    assert "no ordering among them is supported" not in text and "No per-client comparison" not in text
    assert "- Per-client comparisons among AdaSingle, FedAvg, FedKD and SelectKD, 2 seeds: numbers only." in text
    # with the seeds a claim needs, the Product difference holds
    text = claims.results_text(table.assign(n_seeds=3))
    assert "- Per-client federated comparisons that hold: FedAvg − AdaSingle on Product +1.20 [+0.90, +1.50]." in text


def test_the_kd_usage_the_caveat_states_is_a_share_of_target_words_not_tokens():
    """METHOD.md 7.9: the KD usage ratio is over target words (sub-word tokens mapped to words first), as the paper's
    86-89 % are. The paper's worked example: Product distils 7 of its 20 token updates in rounds 1-2 (35 %) but 3 of
    its 12 word updates (25 %); Academic in round 1 3 of 7 tokens (43 %), 3 of 4 words (75 %)."""
    from pipeline.results.kd_analysis import kd_usage, word_updates
    from tests.test_analyze import gate_log, postags_table

    words = word_updates(gate_log(), postags_table())
    usage = {c: kd_usage(words[words["client"] == c], best) for c, best in (("Product", 2), ("Academic", 1))}
    kd = {"tau": 5.0, "clients": usage}
    note = claims.backbone_note({"name": "tiny"}, kd)
    assert "distils on 25-75 % of target words at tau = 5.0, the paper's on 86-89 %" in note and "token" not in note


def test_per_client_comparisons_none_of_which_has_a_p_value_are_said_untestable_not_closest():
    """A client whose test examples are one meeting has no spread, so its paired interval and p are NaN
    (stats.mean_interval); when every tested per-client comparison is such a one, there is no closest comparison to
    name (pandas' idxmin raises on all-NaN, which ended the report stage) and no ordering is supported."""
    rows = [
        _row(method_a="centralized", method_b="single", mean_diff=1.7, ci_low=1.0, ci_high=2.4, p_value=0.001),
        _row(method_a="fedavg", method_b="single", mean_diff=0.2, ci_low=-0.4, ci_high=0.8, p_value=0.4),
        _row(method_a="fedavg", method_b="single", client="Product", mean_diff=1.2, ci_low=math.nan, ci_high=math.nan)
        | {"p_value": math.nan, "p_holm": math.nan},
    ]
    text = claims.results_text(pd.DataFrame(rows))
    assert (
        "- No per-client comparison among AdaSingle, FedAvg, FedKD and SelectKD has a p-value (each client's test "
        "set is one meeting or one example: its spread is unknown); no ordering among them is supported."
    ) in text
    assert "closest" not in text


@pytest.mark.parametrize(
    "seeds, examples, reason",
    [
        (5, 24, "fewer test examples than the 100 this profile needs for a claim (`report.claim_min_examples`)."),
        (1, 244, "fewer seeds than the 3 this profile needs for a claim (`report.claim_min_seeds`)."),
        (
            2,
            24,
            "fewer seeds than the 3 this profile needs for a claim (`report.claim_min_seeds`); fewer test examples "
            "than the 100 this profile needs for a claim (`report.claim_min_examples`).",
        ),
    ],
)
def test_a_too_small_study_names_only_the_minimum_it_falls_short_of(seeds, examples, reason):
    """A study folder with `report.claim_min_examples: 300` (reports/cpu-study's 3 seeds and 244 examples) read
    '3 seeds and 244 test examples, below the 3 seeds and 300 examples': 3 seeds are not below 3. The reason names
    each minimum the study is below, and no other."""
    cfg = ReportConfig(smoke=False, claim_min_seeds=3, claim_min_examples=100)
    text = claims.results_text(_scaled(VERDICT_ROWS, seeds, examples), cfg=cfg)
    line = next(x for x in text.splitlines() if "No comparative claim" in x)
    assert f"{claims._seeds(seeds)} and {examples} test examples: {reason} The differences" in line
    assert "below the" not in line


def test_comparisons_without_an_interval_print_no_nan_and_claim_no_absence():
    """A client whose test set is one meeting (reports/cpu-study with Academic's test examples cut to meeting Bed003)
    gives every client-average comparison a NaN interval and p (stats.mean_interval). The block read 'Pooling the
    data does not measurably help: AdaCentralized − AdaSingle +1.48 [+nan, +nan]', a gate variant 'excludes a gain
    above +nan', and the tables '[+nan, +nan]': nothing was measured, so no claim, and no 'nan' printed."""
    nan = math.nan
    rows = [
        _row(method_a=a, method_b=b, mean_diff=d, ci_low=nan, ci_high=nan, p_value=nan)
        for a, b, d in (("centralized", "single", 1.48), ("fedkd", "single", -0.14), ("fedselectkd", "fedkd", 0.06))
    ]
    table = pd.DataFrame([*rows, _tau3_row(mean_diff=0.04, ci_low=nan, ci_high=nan, p_value=nan)])
    text = claims.results_text(table, cfg=ReportConfig(smoke=False))
    assert "nan" not in text.lower()
    assert (
        "- **No comparative claim**: no client-average comparison has an interval (a client's test set is one "
        "meeting or one example: its spread is unknown). The differences, as numbers only (nor set against the "
        "paper's): AdaCentralized − AdaSingle +1.48; FedKD − AdaSingle −0.14; SelectKD − FedKD +0.06." in text
    )
    for verdict in ("helps", "does not measurably", "excluded", "no difference detected"):
        assert verdict not in text
    # a gate variant without an interval beside main comparisons with one: its numbers only
    main = _row(method_a="fedselectkd", method_b="fedkd", mean_diff=0.3, ci_low=-0.4, ci_high=1.0, p_value=0.4)
    text = claims.results_text(pd.DataFrame([main, table.iloc[-1].to_dict()]), cfg=ReportConfig(smoke=False))
    gate = next(x for x in text.splitlines() if "(tau=3)" in x)
    assert gate.endswith(
        "(tau=3) − SelectKD (tau=5): +0.04: no interval (a client's test set is one meeting or one "
        "example: its spread is unknown): numbers only."
    )
    section = comparisons.markdown_section(comparisons.with_holm(table, CFG), "main", CFG)
    assert "nan" not in section.lower() and "| centralized | single | +1.48 | – | – | – |" in section


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda text: "", "comparisons.csv: not a readable comparisons table: No columns to parse from file"),
        (lambda text: text.replace("n_seeds", "seeds", 1), "comparisons.csv: missing column(s) ['n_seeds']"),
        (lambda text: text[:3000], "comparisons.csv:9: significant = nan, not True or False"),  # cut mid-line
        # a blank flag: pandas read it NaN, and astype(bool) made it a significant comparison
        (lambda text: text.replace(",False,False,", ",,False,", 1), "comparisons.csv:2: significant = nan, not True"),
        (lambda text: text.replace(",49,3,", ",49,three,", 1), "comparisons.csv:2: n_seeds = 'three', not a number"),
    ],
)
def test_a_damaged_comparisons_table_is_one_line_naming_the_file_and_line(tmp_path, capsys, damage, message):
    """`report claims` of a study folder whose comparisons.csv is empty, lacks a column, was cut, or has a value of
    the wrong kind: pandas' EmptyDataError, a KeyError, or a silent misread (a blank `significant` read as True,
    a cut last row's missing fields as NaN) before; one line naming the file and its line, the README untouched."""
    from pipeline import report
    from pipeline.common import cli

    study = ROOT / "reports/cpu-study"
    for name in ("params.yaml", "README.md"):
        shutil.copy(study / name, tmp_path / name)
    (tmp_path / "comparisons.csv").write_text(damage((study / "comparisons.csv").read_text()))
    readme = (tmp_path / "README.md").read_bytes()
    assert cli.run(report.main, ["claims", str(tmp_path), str(tmp_path / "README.md")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {tmp_path / message}"), err
    assert (tmp_path / "README.md").read_bytes() == readme


@pytest.mark.parametrize(
    "edit, message",
    [
        # a JSON true read as round 1: the cpu-study's block said 55 of 60 client-runs best at their last round, not 56
        (
            lambda m, r: m["clients"]["Academic"].update(best_round=True),
            "metrics.json: client 'Academic': best_round = True, not a round",
        ),
        (
            lambda m, r: m["clients"]["Academic"].update(best_round="x"),
            "metrics.json: client 'Academic': best_round = 'x', not a round",
        ),
        # a string is true: a run of a fixed budget read as one whose stop rule held
        (lambda m, r: m.update(converged="false"), "metrics.json: converged = 'false', not true, false or null"),
        (
            lambda m, r: r[2].update({"Academic/val_loss": "n/a"}),
            "rounds.json: round 3, client 'Academic': val_loss = 'n/a', not a number",
        ),
        (
            lambda m, r: r[2].update({"round": None}),
            "rounds.json: row 2 is not a per-round row with an integer 'round'",
        ),
    ],
)
def test_a_damaged_train_record_is_one_line_naming_the_file_and_client(tmp_path, edit, message):
    """reports/cpu-study's train record of single-domain-s0, edited as a hand or a cut copy would: a ValueError from
    int() or float() deep in the convergence table, or a silent misread, before; one DataError line now."""
    from pipeline.common.schema import DataError

    src = ROOT / "reports/cpu-study/train/single-domain-s0"
    metrics, rounds = (json.loads((src / f).read_text()) for f in ("metrics.json", "rounds.json"))
    edit(metrics, rounds)
    run = tmp_path / "single-domain-s0"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps(metrics))
    (run / "rounds.json").write_text(json.dumps(rounds))
    with pytest.raises(DataError, match=f"^{re.escape(str(run / message))}$"):
        readers.run_convergence(tmp_path, "single-domain-s0")


def test_the_claim_rule_counts_every_comparison_holms_family_adjusted_over():
    """comparisons.FAMILY: the main study's client-average family holds its comparisons against another study's
    baseline too (baseline_for: a method the main study lacks on its scheme); the rule said 'over the study's 2
    client-average comparisons' where Holm's adjustment was over 3 (Holm p 0.04 for p 0.02 is 0.02 x 2, not x 1)."""
    rows = [
        _row(method_a="centralized", method_b="single", p_value=0.01),
        _row(method_a="fedkd", method_b="single", p_value=0.02),
        _row(method_a="centralized", method_b="fedavg", study_b="server", config_b="fedavg", p_value=0.03),
    ]
    table = comparisons.with_holm(pd.DataFrame([r | {"ci_low": -1.0, "ci_high": 1.0} for r in rows]), CFG)
    assert list(table["p_holm"]) == pytest.approx([0.03, 0.04, 0.04])
    assert "Holm-adjusted p < 0.05 over the study's 3 client-average comparisons" in claims.results_text(table)
