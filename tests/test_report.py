"""Stage `report` on synthetic evaluation results: seed aggregation, missing seeds, tables, figures, index."""

from __future__ import annotations

import json
import math
import os
import re

import pandas as pd
import pytest

from pipeline.experiments.entries import with_labels
from pipeline.paths import ProjectPaths
from pipeline.planning import declared
from pipeline.report import report_inputs
from pipeline.results import published
from pipeline.results.outputs import build_report
from pipeline.results.readers import collect_scores
from pipeline.results.tables import ReportConfig, ReportInputs, aggregate

CLIENTS = ("Academic", "Committee", "Product")


def client_scores(r1: float, r2: float, rl: float) -> dict[str, float]:
    return {"rouge1": r1, "rouge2": r2, "rougeL": rl, "rougeLsum": rl + 1.0, "avg_rouge": (r1 + r2 + rl) / 3, "n": 5}


# experiment -> (study, method, partition, seed, extra entry keys, {client: (r1, r2, rl)} or None = not evaluated)
EXPERIMENTS = {
    "fedavg-s0": (
        "main",
        "fedavg",
        "domain/seed0",
        0,
        {},
        {"Academic": (20, 4, 15), "Committee": (30, 10, 20), "Product": (28, 9, 19)},
    ),
    "fedavg-s1": (
        "main",
        "fedavg",
        "domain/seed1",
        1,
        {},
        {"Academic": (24, 6, 17), "Committee": (32, 12, 22), "Product": (30, 11, 21)},
    ),
    "fsk-s0": (
        "main",
        "fedselectkd",
        "domain/seed0",
        0,
        {},
        {"Academic": (25, 6, 18), "Committee": (34, 14, 24), "Product": (32, 12, 22)},
    ),
    "fsk-s1": (
        "main",
        "fedselectkd",
        "domain/seed1",
        1,
        {},
        {"Academic": (26, 7, 19), "Committee": (35, 15, 25), "Product": (33, 13, 23)},
    ),
    "fsk-s2": (
        "main",
        "fedselectkd",
        "domain/seed2",
        2,
        {},
        {"Academic": (27, 8, 20), "Committee": (36, 16, 26), "Product": (34, 14, 24)},
    ),
    "single-s0": ("main", "single", "domain/seed0", 0, {}, None),  # planned, never evaluated
    "tau3": (
        "tau_sweep",
        "fedselectkd",
        "domain/seed0",
        0,
        {"tau": 3.0},
        {"Academic": (21, 5, 16), "Committee": (31, 11, 21), "Product": (29, 10, 20)},
    ),
    "tau5": (
        "tau_sweep",
        "fedselectkd",
        "domain/seed0",
        0,
        {"tau": 5.0},
        {"Academic": (22, 5, 16), "Committee": (33, 12, 22), "Product": (30, 11, 21)},
    ),
    "iid-fedavg": (
        "iid",
        "fedavg",
        "iid/seed0",
        0,
        {},
        {"client0": (20, 5, 15), "client1": (21, 5, 15), "client2": (22, 5, 15)},
    ),
    "iid-fsk": (
        "iid",
        "fedselectkd",
        "iid/seed0",
        0,
        {},
        {"client0": (22, 6, 16), "client1": (23, 6, 16), "client2": (24, 6, 16)},
    ),
    "prox": (
        "server",
        "fedprox",
        "domain/seed0",
        0,
        {},
        {"Academic": (23, 5, 17), "Committee": (33, 12, 22), "Product": (31, 11, 21)},
    ),
    "post": (
        "new_client",
        "post_addition",
        "extreme/seed0",
        0,
        {},
        {"Academic": (24, 6, 18), "Committee": (34, 13, 23), "Product": (31, 12, 22), "SAMSum": (40, 15, 30)},
    ),
    "ext": (
        "extreme",
        "fedselectkd",
        "extreme/seed0",
        0,
        {},
        {"Academic": (22, 5, 17), "Committee": (33, 12, 22), "Product": (30, 11, 21), "SAMSum": (41, 16, 31)},
    ),
    "samp": (
        "sampling",
        "fedselectkd",
        "domain/seed0",
        0,
        {"fraction_train": 0.67},
        {"Academic": (24, 6, 18), "Committee": (33, 13, 23), "Product": (31, 12, 22)},
    ),
}


@pytest.fixture
def project(tmp_path):
    params = {"tau": 5.0, "experiments": {}}
    for name, (study, method, partition, seed, extra, clients) in EXPERIMENTS.items():
        params["experiments"][name] = {"method": method, "partition": partition, "seed": seed, "study": study, **extra}
        if clients is None:
            continue
        d = tmp_path / "reports/eval" / name
        d.mkdir(parents=True)
        metrics = {
            "experiment": name,
            "method": method,
            "backbone": "facebook/bart-large",
            "clients": {c: client_scores(*v) for c, v in clients.items()},
        }
        (d / "metrics.json").write_text(json.dumps(metrics))
    # Predictions of the main study, seed 0 (case study, human evaluation).
    for name, method in (("fedavg-s0", "fedavg"), ("fsk-s0", "fedselectkd")):
        with (tmp_path / "reports/eval" / name / "predictions.jsonl").open("w") as fh:
            for c in CLIENTS:
                for i in range(3):
                    fh.write(
                        json.dumps(
                            {
                                "experiment": name,
                                "client": c,
                                "example_id": f"qmsum/{c}/test/m{i}/q0",
                                "domain": c,
                                "prediction": f"{method} says {c} {i}.",
                                "reference": f"gold {c} {i}.",
                            }
                        )
                        + "\n"
                    )
    # Training rounds of one experiment (learning curves), in the train stage's wide reports/train layout.
    rows = [
        {
            "round": r,
            **{
                f"{c}/{q}": v
                for k, c in enumerate(CLIENTS)
                for q, v in (("train_loss", 5.0 - r), ("val_loss", 5.5 - r * 0.5 - k))
            },
            "val_loss_mean": 0.0,
        }
        for r in (1, 2, 3)
    ]
    (tmp_path / "reports/train/fsk-s0").mkdir(parents=True)
    (tmp_path / "reports/train/fsk-s0/rounds.json").write_text(json.dumps(rows))
    (tmp_path / "reports/timing").mkdir(parents=True)
    for stage, seconds in (("train-fsk-s0", 12.5), ("train-dropped-exp", 99.0)):  # as pipeline.common.timing writes
        record = {"stage": stage, "seconds": seconds, "startup_seconds": 2.0, "peak_rss_mb": 800.0}
        record["finished_at"] = "2026-01-01T00:00:00+00:00"
        (tmp_path / f"reports/timing/{stage}.json").write_text(json.dumps(record))
    return tmp_path, params


def test_aggregate_mean_std_and_missing_seeds(project):
    root, params = project
    planned = declared(params)
    labels = with_labels(planned)
    scores, missing = collect_scores(planned, labels, root / "reports/eval")
    assert missing == ["single-s0"]
    agg = aggregate(scores, ReportInputs(planned, ReportConfig(expected_seeds=[0, 1, 2])))
    row = agg[(agg["study"] == "main") & (agg["method"] == "fedavg") & (agg["client"] == "Academic")].iloc[0]
    assert row["rouge1_mean"] == pytest.approx(22.0)
    assert row["rouge1_std"] == pytest.approx(math.sqrt(8.0))  # sample std of 20, 24
    assert row["rougeL_mean"] == pytest.approx(16.0)
    assert row["n_seeds"] == 2 and row["seeds"] == "0,1" and row["missing_seeds"] == "2"
    row = agg[(agg["study"] == "main") & (agg["method"] == "fedselectkd") & (agg["client"] == "Committee")].iloc[0]
    assert row["rouge2_mean"] == pytest.approx(15.0) and row["rouge2_std"] == pytest.approx(1.0)
    assert row["missing_seeds"] == ""
    # One seed: no std, seeds 1 and 2 missing.
    row = agg[(agg["study"] == "iid") & (agg["method"] == "fedavg") & (agg["client"] == "client1")].iloc[0]
    assert math.isnan(row["rouge1_std"]) and row["missing_seeds"] == "1,2"
    # tau varies within the sweep: two configurations, labelled apart.
    taus = agg[agg["study"] == "tau_sweep"]
    assert sorted(set(taus["label"])) == ["fedselectkd tau=3", "fedselectkd tau=5"]


@pytest.mark.slow
def test_report_writes_tables_figures_and_index(project):
    root, params = project
    params = params | {"report": {"expected_seeds": [0, 1, 2], "human_eval_per_domain": 2}}
    index = build_report(report_inputs(params), ProjectPaths(root))
    reports = root / "reports"

    table = pd.read_csv(reports / "tables/main_bart-large.csv")
    r = table[(table["method"] == "fedavg") & (table["client"] == "Academic") & (table["metric"] == "R-1")].iloc[0]
    paper = published.MAIN_TABLE["bart-large"]["Academic"]["fedavg"].rouge1
    assert r["paper"] == pytest.approx(paper) and r["ours_mean"] == pytest.approx(22.0)
    assert r["diff"] == pytest.approx(22.0 - paper)
    md = (reports / "tables/main_bart-large.md").read_text()
    assert "AdaFedAvg" in md and "AdaFedSelectKD" in md and "missing 2" in md and f"{paper:.2f}" in md
    # AdaSingle was planned but never evaluated: its rows say so instead of disappearing.
    single = [line for line in md.splitlines() if line.startswith("| AdaSingle")]
    assert single and "missing" in single[0] and "missing 0,1,2" in single[0]

    for name, data in (("iid", "iid.csv"), ("learning_curves_main", "learning_curves/main--fedselectkd_tau=5.csv")):
        png = reports / "figures" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert len(pd.read_csv(reports / "plots" / data)) > 0
    curve = pd.read_csv(reports / "plots/learning_curves/main--fedselectkd_tau=5.csv")
    assert list(curve["round"]) == [1, 2, 3] and list(curve["Committee"]) == [4.0, 3.5, 3.0]
    assert curve["val_loss_mean"].iloc[0] == pytest.approx((5.0 + 4.0 + 3.0) / 3)
    # The tau sweep is drawn once, by the analyze stage (ROUGE and KD usage); the report only tabulates it.
    assert not (reports / "figures/tau_sweep.png").exists()
    assert "fedselectkd tau=3" in (reports / "tables/study_tau_sweep.md").read_text()

    for name in ("server", "new_client", "extreme", "sampling"):
        assert (reports / "figures" / f"{name}.png").stat().st_size > 5000
    server = pd.read_csv(reports / "plots/server.csv")
    # The study ran FedProx; FedAvg and SelectKD come from the main study; the paper's values sit beside them.
    assert set(server["label"]) == {"fedprox", "fedavg", "fedselectkd tau=5"}
    prox = server[(server["label"] == "fedprox") & (server["client"] == "Academic")].iloc[0]
    assert prox["paper_avg_rouge"] == published.SERVER_AVG_ROUGE["fedprox"]["Academic"]
    assert prox["avg_rouge_mean"] == pytest.approx((23 + 5 + 17) / 3)
    new = pd.read_csv(reports / "plots/new_client.csv")
    samsum = new[(new["label"] == "post_addition") & (new["client"] == "SAMSum")].iloc[0]
    assert samsum["paper_avg_rouge"] == published.NEW_CLIENT_AVG_ROUGE["post_addition"]["SAMSum"]
    # No pre_addition run: the extreme study's SelectKD run (the same computation) stands in, labelled so.
    pre = new[(new["label"] == "pre_addition (= fedselectkd of study extreme)") & (new["client"] == "SAMSum")].iloc[0]
    assert pre["avg_rouge_mean"] == pytest.approx((41 + 16 + 31) / 3)
    assert pre["paper_avg_rouge"] == published.NEW_CLIENT_AVG_ROUGE["pre_addition"]["SAMSum"]
    assert "pre_addition (= fedselectkd of study extreme)" in (reports / "tables/study_new_client.md").read_text()
    extreme = pd.read_csv(reports / "plots/extreme.csv")
    assert set(extreme["setting"]) == {"with SAMSum", "without SAMSum (main study)"}

    # Studies without experiments: no figure, and the index says so.
    assert not (reports / "figures/noniid.png").exists()
    readme = (reports / "README.md").read_text()
    assert "figure noniid" in readme and "`single-s0`" in readme and "missing seed 2" in readme
    assert "single-s0" in index["missing_experiments"]

    summary = json.loads((reports / "summary.json").read_text())
    assert summary["experiments_planned"] == 14 and summary["experiments_missing"] == 1
    assert summary["main"]["fedselectkd_tau=5"]["Academic"] == pytest.approx((26 + 7 + 19) / 3, abs=1e-3)
    # The headline DVC metrics: the main study only; fedselectkd over its 3 seeds, R-L = rougeL; no per-example
    # scores and no KD analysis here, so no interval and no KD usage (never invented).
    headline = json.loads((reports / "metrics.json").read_text())
    assert set(headline) == {"main"} and set(headline["main"]) == {"fedavg", "fedselectkd"}
    fsk = headline["main"]["fedselectkd"]
    assert fsk["rouge1"] == pytest.approx((26 + 35 + 33) / 3, abs=1e-3)
    assert fsk["rougeL"] == pytest.approx((19 + 25 + 23) / 3, abs=1e-3)
    assert fsk["avg_rouge"] == pytest.approx((52 / 3 + 25 + 23) / 3, abs=1e-3)
    assert fsk["clients"]["Committee"] == pytest.approx(25.0, abs=1e-3) and "avg_rouge_low" not in fsk

    case = (reports / "tables/case_study.md").read_text()
    for c in CLIENTS:
        assert f"## {c}" in case
    assert "fedavg says" in case and "fedselectkd says" in case and "**Gold:**" in case
    sheet = pd.read_csv(reports / "human_eval/sheets/sheet1.csv")
    assert len(sheet) == 2 * 3  # 2 examples per domain x 3 domains x 1 opponent
    timing = pd.read_csv(reports / "tables/timing.csv")
    assert list(timing["stage"]) == ["train-fsk-s0"] and timing["seconds"].iloc[0] == 12.5
    # The record of an experiment no longer in params.yaml stays on disk but out of the table, and is named.
    assert "train-dropped-exp" in readme and "train-dropped-exp" not in (reports / "tables/timing.md").read_text()


def test_report_with_nothing_evaluated(tmp_path):
    params = {"experiments": {"a": {"method": "fedavg", "partition": "domain/seed0", "study": "main"}}}
    (tmp_path / "reports/eval/old-experiment").mkdir(parents=True)
    index = build_report(report_inputs(params), ProjectPaths(tmp_path))
    assert index["missing_experiments"] == ["a"]
    assert index["ignored_evaluations"] == ["old-experiment"]
    assert "main table" in index["not_made"]
    assert (tmp_path / "reports/README.md").is_file()


def test_published_numbers_match_method_md():
    """pipeline.results.published transcribes METHOD.md section 9; re-read every number from the spec's text."""
    import re
    from pathlib import Path

    spec = Path(__file__).resolve().parents[2] / "shared/docs/METHOD.md"
    if not spec.is_file():
        pytest.skip(f"{spec} not found (the shared docs sit beside the repo)")
    text = spec.read_text().split("## 9. Published numbers", 1)[1]
    blocks = re.split(r"\n(BART-large|BART-base|LED-large)[^\n]*:\n", text)
    checked = 0
    for backbone, body in zip(blocks[1::2], blocks[2::2]):
        for line in body.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] not in CLIENTS:
                continue
            for method, cell in zip(published.METHOD_ORDER, cells[1:]):
                r1, r2, rl = (float(x) for x in cell.split("/"))
                ours = published.MAIN_TABLE[backbone.lower()][cells[0]][method]
                assert (ours.rouge1, ours.rouge2, ours.rougeL) == (r1, r2, rl), (backbone, cells[0], method)
                checked += 1
    assert checked == 3 * 3 * 5
    server = re.search(
        r"FedAvg\s+([\d./]+), FedOPT ([\d./]+), FedProx ([\d./]+), FedNova ([\d./]+),\s+SelectKD ([\d./]+)", text
    )
    for method, cell in zip(("fedavg", "fedopt", "fedprox", "fednova", "fedselectkd"), server.groups()):
        assert [published.SERVER_AVG_ROUGE[method][c] for c in CLIENTS] == [
            float(x) for x in cell.rstrip(".").split("/")
        ]
    post = re.search(r"post-addition ([\d./]+)", text).group(1)
    assert [published.NEW_CLIENT_AVG_ROUGE["post_addition"][c] for c in (*CLIENTS, "SAMSum")] == [
        float(x) for x in post.split("/")
    ]
    pre = re.search(r"pre-addition ([\d./]+)", text).group(1).rstrip(".")
    assert [published.NEW_CLIENT_AVG_ROUGE["pre_addition"][c] for c in (*CLIENTS, "SAMSum")] == [
        float(x) for x in pre.split("/")
    ]
    assert published.HUMAN_EVAL["fedavg"] == {"win": 52, "tie": 4, "loss": 4}
    assert published.backbone_key("facebook/bart-large") == "bart-large"
    assert published.backbone_key("allenai/led-large-16384") == "led-large"
    assert published.backbone_key("minilm-bert2bert") is None


def test_privacy_points_pair_rouge_with_the_epsilon_each_run_spent(tmp_path):
    """ROUGE against epsilon: client average per seed, then mean and std over seeds; epsilon = the largest any
    client spent (inf without DP), from the train stage's metrics; the figure is drawn with its data beside it."""
    import math

    from pipeline.experiments.entries import Experiment
    from pipeline.results.figures import privacy_figure, privacy_points
    from pipeline.results.tables import ReportInputs

    planned = [
        Experiment("p0", "fedavg", "domain/seed0", 0, "privacy"),
        Experiment("p1", "fedavg", "domain/seed0", 1, "privacy"),
        Experiment("d0", "fedavg", "domain/seed0", 0, "privacy", dp="DP-SGD ε≤3"),
        Experiment("d1", "fedavg", "domain/seed0", 1, "privacy", dp="DP-SGD ε≤3"),
        Experiment("m0", "fedavg", "domain/seed0", 0, "main"),
    ]
    avg = {
        ("p0", "A"): 10.0,
        ("p0", "B"): 12.0,
        ("p1", "A"): 14.0,
        ("p1", "B"): 16.0,
        ("d0", "A"): 8.0,
        ("d0", "B"): 8.0,
        ("m0", "A"): 1.0,
        ("m0", "B"): 1.0,
    }  # d1 not evaluated
    scores = pd.DataFrame(
        [{"experiment": e, "client": c, "avg_rouge": v, "backbone": "tiny"} for (e, c), v in avg.items()]
    )
    for name, eps in (("p0", None), ("p1", None), ("d0", (2.5, 2.9)), ("d1", (2.0, 2.0))):
        d = tmp_path / "reports/train" / name
        d.mkdir(parents=True)
        clients = {
            c: {} if eps is None else {"privacy": {"epsilon": e, "noise_multiplier": 1.2}}
            for c, e in zip("AB", eps or (0, 0))
        }
        d.joinpath("metrics.json").write_text(
            json.dumps({"clients": clients, "privacy": None if eps is None else {"target_epsilon": 3}})
        )
    points = privacy_points(ReportInputs(planned), scores, ProjectPaths(tmp_path)).set_index("label")
    assert list(points.index) == ["fedavg", "fedavg DP-SGD ε≤3"]  # the main study's run is not part of it
    plain, dp = points.loc["fedavg"], points.loc["fedavg DP-SGD ε≤3"]
    assert (plain.avg_rouge_mean, plain.n_seeds, plain.epsilon) == (13.0, 2, math.inf)
    assert plain.avg_rouge_std == pytest.approx(math.sqrt(8.0))  # seeds at 11 and 15
    assert (dp.avg_rouge_mean, dp.n_seeds, dp.epsilon, dp.target_epsilon) == (8.0, 1, 2.9, 3)
    assert math.isnan(dp.avg_rouge_std)  # one seed: no spread
    fig = privacy_figure(points.reset_index(), ProjectPaths(tmp_path))
    assert os.path.getsize(fig) > 0 and len(pd.read_csv(tmp_path / "reports/plots/privacy.csv")) == 2


def test_a_timing_record_without_a_field_the_stage_timer_writes_is_refused_naming_file_and_field(tmp_path):
    from pipeline.common.schema import DataError
    from pipeline.results.tables import timing_table

    (tmp_path / "old.json").write_text(json.dumps({"stage": "postag", "seconds": 30.0, "peak_rss_mb": 500.0}))
    with pytest.raises(DataError, match=r"old\.json: not a stage timing record .*startup_seconds"):
        timing_table(tmp_path, set())


def test_timing_table_states_the_span_from_the_first_start_to_the_last_finish(tmp_path):
    from pipeline.results.tables import timing_markdown, timing_table

    # ingest started at 00:00:00 (2.5 s start-up, 10 s work); report finished a minute later (time zones as written)
    (tmp_path / "a.json").write_text(
        json.dumps(
            {
                "stage": "ingest",
                "seconds": 10.0,
                "startup_seconds": 2.5,
                "peak_rss_mb": 1.0,
                "finished_at": "2026-01-01T00:00:12.5+00:00",
            }
        )
    )
    (tmp_path / "b.json").write_text(
        json.dumps(
            {
                "stage": "report",
                "seconds": 5.0,
                "startup_seconds": 1.0,
                "peak_rss_mb": 1.0,
                "finished_at": "2026-01-01T01:01:00+01:00",
            }
        )
    )
    timing, _ = timing_table(tmp_path, set())
    assert re.search(r"\b60 s \(1\.0 min\)", timing_markdown(timing))


def test_the_main_table_calls_missing_only_the_seeds_never_evaluated(project):
    """The main table is over the seeds every method has (0, 1 here: FedAvg never ran seed 2); SelectKD's seed 2 is
    evaluated, left out of the table for FedAvg's sake, and not 'missing'."""
    from pipeline.results.outputs import write_tables
    from pipeline.results.tables import Made

    root, params = project
    write_tables(report_inputs(params | {"report": {"expected_seeds": [0, 1, 2]}}), root / "reports", Made())
    lines = (root / "reports/tables/main_bart-large.md").read_text().splitlines()
    fedavg, selectkd = (next(x for x in lines if x.startswith(f"| {m} ")) for m in ("AdaFedAvg", "AdaFedSelectKD"))
    assert fedavg.split("|")[-2].strip() == "2 (0,1), missing 2"
    assert selectkd.split("|")[-2].strip() == "2 (0,1) ↗ 3/3"  # its convergence mark, no 'missing 2'


def test_the_main_table_uses_the_seeds_every_method_has():
    from pipeline.results.outputs import shared_seeds

    scores = pd.DataFrame({"label": ["a"] * 3 + ["b"] * 2, "seed": [0, 1, 2, 0, 2]})
    assert shared_seeds(scores) == [0, 2]
    assert shared_seeds(scores.iloc[:0]) == []


def test_adacentralized_step_ratio_per_client_from_the_committed_cpu_study():
    """One pooled pass a round (1,095 examples, batch 8, 2 accumulation steps: 69 optimizer steps) against each
    client's own pass: Academic 218 examples (14 steps), Committee 284 (18), Product 593 (38)."""
    from pathlib import Path

    from pipeline.report import report_inputs
    from pipeline.results.readers import centralized_step_ratios

    study = Path(__file__).resolve().parents[1] / "reports/cpu-study"
    inp = report_inputs(study / "params.yaml")  # the study folder's params file, as `report rebuild` reads it
    got = dict(centralized_step_ratios(inp.planned, study / "train", inp.train))
    assert got == pytest.approx({"Academic": 69 / 14, "Committee": 69 / 18, "Product": 69 / 38})


@pytest.mark.parametrize("bad", [True, 2.0, "3", None])
def test_a_train_record_whose_example_count_is_no_integer_is_one_line_naming_it(tmp_path, bad):
    """n_train_examples sets AdaCentralized's step ratio: a JSON true is no 1 example, "3" no 3 (both were read)."""
    import json
    from types import SimpleNamespace

    from pipeline.common.schema import DataError
    from pipeline.results.readers import centralized_step_ratios

    planned, trains = [], {}
    for method, n in (("centralized", 40), ("single", 10)):
        (tmp_path / method).mkdir()
        clients = {"A": {"n_train_examples": n}, "B": {"n_train_examples": bad if method == "single" else n}}
        (tmp_path / method / "metrics.json").write_text(json.dumps({"clients": clients}))
        planned.append(SimpleNamespace(name=method, study="main", method=method, seed=0))
        trains[method] = {"batch_size": 5, "grad_accum_steps": 1}
    with pytest.raises(
        DataError, match=re.escape(f"{tmp_path / 'single' / 'metrics.json'}: client 'B' has no integer")
    ):
        centralized_step_ratios(planned, tmp_path, trains)
    json.dump({"clients": {"A": {"n_train_examples": 10}, "B": {}}}, (tmp_path / "single" / "metrics.json").open("w"))
    assert centralized_step_ratios(planned, tmp_path, trains) == (("A", 4.0),)  # B trained nothing: no ratio


def test_a_params_file_with_a_bad_report_key_is_named_with_the_file(tmp_path):
    """report_inputs of a params file (the stage's --params, a study folder's params.yaml) names a bad value as every
    stage does, "<file> <group>.<key>"; the file's own experiments are what it plans."""
    import yaml

    from pipeline.common.config import ConfigError

    params = {"experiments": {}, "report": {"claim_min_seeds": 0}}
    (path := tmp_path / "study.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(ConfigError, match=re.escape(f"{path} report.claim_min_seeds")):
        report_inputs(path)
    path.write_text(yaml.safe_dump(params | {"report": {"expected_seeds": [0]}}))
    assert report_inputs(path).cfg.expected_seeds == [0]


def test_a_bar_figure_has_a_paper_column_only_where_the_paper_has_a_value_for_its_bars(tmp_path):
    from pipeline.results.figures import StudyFigure, bar_figure
    from pipeline.results.scoring import TABLE_METRICS

    def bars(client):
        row = {"method": "fedprox", "client": client, "label": "fedprox", "backbone": "tiny", "n_seeds": 2}
        row |= {"avg_rouge_mean": 20.0, "avg_rouge_std": 1.0, "missing_seeds": ""}
        return pd.DataFrame([row | {f"{m}_mean": 20.0 for m in TABLE_METRICS}])

    paths = ProjectPaths(tmp_path)
    paths.figures.mkdir(parents=True)
    paths.plots.mkdir(parents=True)
    # The paper lists FedProx, but only for Academic: the study's SAMSum bar has no paper value beside it.
    entry = StudyFigure(study="server", title="t", paper={"fedprox": {"Academic": 24.0}})
    bar_figure(bars("SAMSum"), entry, paths)
    assert "paper_avg_rouge" not in pd.read_csv(paths.plots / "server.csv").columns
    bar_figure(bars("Academic"), entry, paths)
    assert pd.read_csv(paths.plots / "server.csv")["paper_avg_rouge"].tolist() == [24.0]


def test_the_committed_study_folders_tables_do_not_say_the_bootstrap_is_within_clients():
    """acc63ac: an iid meeting's queries are resampled once for every client holding them (stats.spans_clients) and
    seeds that redraw the test sets floor the t-interval at the examples' spread, so 'a bootstrap over test examples
    within clients' misstates the intervals; reports/tables is rewritten by the report stage, the study folders
    (`python -m pipeline.report rebuild`) only when rebuilt: theirs must not say it either."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "reports"
    tables = sorted((root / "cpu-study" / "tables").glob("*.md")) + sorted((root / "privacy/study/tables").glob("*.md"))
    stale = [str(p.relative_to(root)) for p in tables if "bootstrap over test examples within clients" in p.read_text()]
    assert len(tables) >= 4 and stale == []


def test_a_bad_bootstrap_value_in_a_study_folders_params_is_one_line_naming_that_file(tmp_path):
    # `python -m pipeline.report rebuild <folder>` reads <folder>/params.yaml: its bad report value names the file,
    # and so must its bad bootstrap value (not a bare 'bootstrap.level', which reads as the repo's params.yaml)
    import yaml

    from pipeline.common.config import ConfigError
    from pipeline.report import main as report_main
    from tests.errors import names

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"experiments": {}, "bootstrap": {"level": "high"}}))
    with pytest.raises(ConfigError) as err:
        report_main(["rebuild", str(tmp_path)])
    names(err.value, str(tmp_path / "params.yaml"), "bootstrap.level", "high")


def test_the_round_budget_marks_count_the_runs_whose_scores_the_row_holds(tmp_path):
    # fedavg trained at seeds 0 and 1 but evaluated at seed 0 only; SelectKD trained and evaluated at 0 and 1. Seed 1's
    # runs had their best round last (still improving), seed 0's not. The study table's fedavg row is over seed 0:
    # 0 of its 1 seed (no mark), not 1 of 2; SelectKD's over 0 and 1: 1 of 2. The main table is over the shared seed
    # 0: no row has a mark and its note counts none of the 12 client-runs trained
    experiments = {}
    for method, seed, evaluated in (
        ("fedavg", 0, True),
        ("fedavg", 1, False),
        ("fedselectkd", 0, 1),
        ("fedselectkd", 1, 1),
    ):
        name = f"{method}-s{seed}"
        experiments[name] = {"method": method, "partition": f"domain/seed{seed}", "seed": seed, "study": "main"}
        val = (3.0, 2.0, 2.5) if seed == 0 else (3.0, 2.5, 2.0)  # best round 2 of 3, or 3 of 3
        rounds = [{"round": r + 1, **{f"{c}/val_loss": v for c in CLIENTS}} for r, v in enumerate(val)]
        (tmp_path / "reports/train" / name).mkdir(parents=True)
        (tmp_path / "reports/train" / name / "rounds.json").write_text(json.dumps(rounds))
        if evaluated:
            (d := tmp_path / "reports/eval" / name).mkdir(parents=True)
            scores = {c: client_scores(20 + seed, 5, 15) for c in CLIENTS}
            (d / "metrics.json").write_text(json.dumps({"experiment": name, "method": method, "clients": scores}))
    build_report(report_inputs({"tau": 5.0, "experiments": experiments}), ProjectPaths(tmp_path))
    study = (tmp_path / "reports/tables/study_main.md").read_text().splitlines()
    marks = {
        (r.split(" | ")[0].strip("| "), r.split(" | ")[2]): r.rsplit(" | ", 1)[1].strip(" |")
        for r in study
        if r.startswith(("| fedavg", "| fedselectkd"))
    }
    assert marks == {("fedavg", c): "–" for c in CLIENTS} | {("fedselectkd tau=5", c): "↗ 1/2" for c in CLIENTS}
    main = next((tmp_path / "reports/tables").glob("main_*.md")).read_text()
    assert "↗" not in main.split("## Paired comparisons")[0]


def test_the_results_texts_round_budget_counts_the_evaluated_runs(tmp_path):
    # The results text's comparisons are over the evaluated runs, as the tables' marks (d714659): fedavg seed 1,
    # trained (its 3 clients best in their last round) but never evaluated, is in no comparison and in no count.
    # By hand: fedavg 0 and SelectKD 0 evaluated, best in round 2 of 3 on Academic, 3 of 3 on Committee and Product:
    # 4 of 6 client-runs, 2 of 2 runs not converged (before: 6 of 9, 3 of 3).
    from pipeline.results.outputs import results_text
    from tests.test_claims import _row

    experiments = {}
    for method, seed in (("fedavg", 0), ("fedavg", 1), ("fedselectkd", 0)):
        name = f"{method}-s{seed}"
        experiments[name] = {"method": method, "partition": f"domain/seed{seed}", "seed": seed, "study": "main"}
        rounds = [
            {"round": r, **{f"{c}/val_loss": 3.0 - r + 2 * (r == 3 and c == "Academic") for c in CLIENTS}}
            for r in (1, 2, 3)
        ]
        (tmp_path / "train" / name).mkdir(parents=True)
        (tmp_path / "train" / name / "rounds.json").write_text(json.dumps(rounds))
        if seed == 0:
            (d := tmp_path / "eval" / name).mkdir(parents=True)
            (d / "metrics.json").write_text(json.dumps({"experiment": name, "clients": {}}))
    compared = pd.DataFrame([_row(method_a="fedselectkd", method_b="fedavg", ci_low=-1.0, ci_high=1.0, n_seeds=1)])
    inp = report_inputs({"tau": 5.0, "experiments": experiments})
    budget = next(
        r for r in results_text(inp, compared, tmp_path / "c.csv", tmp_path).splitlines() if "Round budget" in r
    )
    assert "evaluated runs" in budget
    assert "4 of 6 client-runs had their best validation round in their last round (3)" in budget
    assert "2 of 2 runs are not converged" in budget


@pytest.mark.parametrize("record", ["backbone.json", "analysis/kd_analysis.json"])
@pytest.mark.parametrize(("content", "problem"), [("{not json", "not valid JSON"), ("[1]", "expected a JSON object")])
def test_a_damaged_backbone_or_kd_record_is_one_line_naming_it(tmp_path, record, content, problem):
    """The results text reads both records; a damaged one was json's bare JSONDecodeError, naming no file."""
    from pipeline.common.schema import DataError
    from pipeline.results.outputs import results_text
    from tests.test_claims import _row

    (tmp_path / "analysis").mkdir()
    (tmp_path / record).write_text(content)
    compared = pd.DataFrame([_row(method_a="fedselectkd", method_b="fedavg", ci_low=-1.0, ci_high=1.0, n_seeds=1)])
    inp = report_inputs({"tau": 5.0, "experiments": {}})
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / record}: {problem}")):
        results_text(inp, compared, tmp_path / "c.csv", tmp_path)


@pytest.mark.parametrize(
    ("bases", "unit"),
    [
        (("2", "2"), " bits"),  # by hand: log base 2 -> an entropy in bits
        (("e", "e"), " nats"),  # base e -> nats
        (("e", "2"), ""),  # the runs' gates differ: no unit to give
        (("e", None), ""),  # a run of the record the params no longer declare: its base is unknown
    ],
)
def test_a_kd_record_older_than_its_tau_unit_takes_it_from_the_studys_params(tmp_path, bases, unit):
    # reports/cpu-study/analysis/kd_analysis.json was written before the record held tau_unit (e8ced03); the study
    # folder's params.yaml records each run's train.entropy_log_base, the unit of its absolute tau.
    from pipeline.results.outputs import results_text
    from tests.test_claims import _row

    experiments = {
        f"fedselectkd-s{seed}": {"method": "fedselectkd", "partition": "domain/seed0", "seed": seed, "study": "main"}
        | {"entropy_log_base": base}
        for seed, base in enumerate(bases)
        if base is not None
    }
    (tmp_path / "analysis").mkdir()
    (tmp_path / "backbone.json").write_text(json.dumps({"name": "tiny", "parameters": 1e6}))
    kd = {
        "tau": 5.0,
        "clients": {"Academic": {"experiments": ["fedselectkd-s0", "fedselectkd-s1"], "kd_usage_ratio": 0.5}},
    }
    (tmp_path / "analysis/kd_analysis.json").write_text(json.dumps(kd))
    compared = pd.DataFrame([_row(method_a="fedselectkd", method_b="fedavg", ci_low=-1.0, ci_high=1.0, n_seeds=1)])
    inp = report_inputs({"tau": 5.0, "experiments": experiments})
    text = results_text(inp, compared, tmp_path / "c.csv", tmp_path)
    assert f"50-50 % of target words at tau = 5.0{unit}, the paper's" in text


def test_the_committed_index_names_missing_seeds_in_the_right_number():
    """reports/README.md's list of configurations short of seeds (build_report): 'missing seed 2', 'missing seeds 1,2'
    (it said 'missing seed 1,2')."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "reports/README.md").read_text(encoding="utf-8")
    found = re.findall(r"\(missing seed(s?) ([\d,]+)\)", text)
    assert found
    assert all((plural == "s") == ("," in seeds) for plural, seeds in found), found
