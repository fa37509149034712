"""Example-level DP with a meaningful delta (issue 29 item 4): delta defaults to min(1e-5, 1/(10 n)), a delta of
1/n or more is refused before anything trains (exit 2, naming the key and the client), and every epsilon is
reported with its delta. The accountant is checked against an independent conversion and against PRV."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from tests.test_federated import workspace, ws  # noqa: F401  (fixtures)
from tests.test_privacy import _write_plan

# The privacy study (configs/privacy-study.yaml, default profile): n = 16 examples per client, logical batch 8,
# 3 rounds of 1 epoch: q = 1/2, 6 steps; the noise multipliers opacus chose for epsilon 8 / 3 / 1 at delta 1/16 in
# its first run (2026-11-23), before delta defaulted to min(1e-5, 1/(10 n)).
STUDY_Q, STUDY_STEPS, STUDY_SIGMAS = 0.5, 6, (0.64, 1.09, 2.08)


@functools.cache  # the study's 54 client-runs share 3 (sigma, q, steps, delta)
def _classical_rdp_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    """Mironov's RDP of the subsampled Gaussian (opacus' analytical RDP per order) with the classical conversion
    eps = min_a RDP(a) + log(1/delta) / (a - 1), which is looser than the Balle et al. conversion opacus uses."""
    from opacus.accountants.analysis.rdp import compute_rdp

    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
    return min(r + math.log(1 / delta) / (a - 1) for r, a in zip(rdp, orders))


@pytest.mark.parametrize("sigma,expected", [(0.64, 17.60), (1.09, 7.92), (2.08, 3.23)])
def test_the_study_sigmas_at_delta_1e_5_against_independent_accountants(sigma, expected):
    """At delta = 1e-5 the study's noise gives epsilon ~17.6 / 7.9 / 3.2, not 8 / 3 / 1 (which held at delta =
    1/16). The value sits between the PRV accountant's (tighter) and the classical RDP conversion's (looser)."""
    from pipeline.privacy.accounting import bound

    rdp = bound(sigma, STUDY_Q, STUDY_STEPS, 1e-5, "rdp")[0]
    prv = bound(sigma, STUDY_Q, STUDY_STEPS, 1e-5, "prv")[0]
    classical = _classical_rdp_epsilon(sigma, STUDY_Q, STUDY_STEPS, 1e-5)
    assert rdp == pytest.approx(expected, abs=0.01)
    assert prv <= rdp <= classical
    assert rdp - prv < 0.15 * rdp  # PRV is near-exact: RDP is at most 15 % above it here
    assert bound(sigma, STUDY_Q, STUDY_STEPS, 1 / 16, "rdp")[0] < rdp / 2  # what delta = 1/n hid


def test_the_committed_privacy_study_spent_each_target_at_delta_1e_5():
    """reports/privacy/study (the rerun at the default delta): every private client-run records delta <= 1e-5 and
    an epsilon that the classical RDP conversion, computed here from its recorded sigma, q and steps, bounds from
    above, and that does not exceed the run's target."""
    import json
    from pathlib import Path

    study = Path(__file__).resolve().parents[1] / "reports/privacy/study/train"
    runs = sorted(study.glob("*eps*/metrics.json"))
    assert len(runs) == 18  # 2 methods x 3 budgets x 3 seeds
    for path in runs:
        record = json.loads(path.read_text())
        target = record["privacy"]["target_epsilon"]
        assert record["privacy"]["delta_max"] <= 1e-5
        for client in record["clients"].values():
            dp = client["privacy"]
            assert dp["delta"] <= 1e-5 and (dp["sample_rate"], dp["steps"]) == (STUDY_Q, STUDY_STEPS)
            assert dp["epsilon"] <= target
            assert dp["epsilon"] <= _classical_rdp_epsilon(
                dp["noise_multiplier"], dp["sample_rate"], dp["steps"], dp["delta"]
            )
            assert dp["epsilon"] > 0.95 * target  # the noise was calibrated to the target, not far above it


def test_a_target_epsilon_at_the_default_delta_is_met_at_that_delta():
    from pipeline.experiments.privacy import PrivacyConfig
    from pipeline.privacy.accounting import bound, client_privacy
    from tests.test_privacy import in_plan

    s = client_privacy(in_plan(PrivacyConfig(mode="example", target_epsilon=3.0)), 16)
    assert s.delta == 1e-5 and s.delta <= 1 / (10 * 16)
    rdp = bound(s.noise_multiplier, 0.5, 6, 1e-5)[0]
    assert 2.98 <= rdp <= 3.0 and bound(s.noise_multiplier, 0.5, 6, 1e-5, "prv")[0] <= rdp  # PRV: tighter


def test_the_train_stage_refuses_a_delta_of_one_over_n_before_training_with_exit_2(ws, capsys):
    """Academic has 4 training examples, Committee 6: delta 0.2 is below 1/4 but not below 1/6. The train stage
    exits 2 naming privacy.delta and Committee, and nothing was trained."""
    from pathlib import Path

    from pipeline.common.cli import run as run_cli
    from pipeline.train import main

    path = _write_plan(
        "dp-delta-too-big", "fedavg", {"mode": "example", "noise_multiplier": 1.0, "delta": 0.2}, prefix_cache=False
    )
    status = run_cli(main, ["--experiment", "dp-delta-too-big", "--plans", str(Path(path).parent), "--no-mlflow"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1
    assert "privacy.delta" in err[0] and "'Committee'" in err[0] and "'Academic'" not in err[0]
    assert not Path("models/dp-delta-too-big").exists()


def test_the_run_record_and_mlflow_carry_each_epsilon_with_its_delta():
    from types import SimpleNamespace

    from pipeline.experiments.privacy import PrivacyConfig
    from pipeline.privacy.seam import mlflow_metrics, run_record

    plan = SimpleNamespace(privacy=PrivacyConfig(mode="example", target_epsilon=3.0))
    row = dict(epsilon=2.5, noise_multiplier=1.2, max_grad_norm=1.0, dp_examples=10, dp_clipped=5, sample_rate=0.5)
    history = [
        {"client": "A", "round": 1, "dp_steps": 2, "delta": 1e-5, **row},
        {"client": "B", "round": 1, "dp_steps": 2, "delta": 5e-6, **row, "epsilon": 2.9},
    ]
    clients = {"A": {}, "B": {}}
    record = run_record(plan, history, clients)
    assert (record["privacy"]["epsilon_max"], record["privacy"]["delta_max"]) == (2.9, 1e-5)
    assert (clients["A"]["privacy"]["delta"], clients["B"]["privacy"]["delta"]) == (1e-5, 5e-6)
    assert record["privacy"]["sampling"] == "poisson" and record["privacy"]["accountant"] == "rdp"
    out = mlflow_metrics({"clients": clients, **record})
    assert (out["A.run/delta"], out["B.run/epsilon"], out["B.run/delta"], out["delta_max"]) == (1e-5, 2.9, 5e-6, 1e-5)


def test_the_runs_privacy_summary_is_logged_under_its_own_keys_not_at_the_per_round_keys_last_step():
    from types import SimpleNamespace

    from pipeline.experiments.privacy import PrivacyConfig
    from pipeline.privacy.seam import mlflow_metrics, run_record
    from pipeline.training.history import round_metrics

    # A client's round 2 clipped none of 4 examples, round 1 two of 4: the round's 0.0, the run's 0.25 (2 of 8).
    plan = SimpleNamespace(privacy=PrivacyConfig(mode="example", target_epsilon=3.0))
    row = dict(client="A", delta=1e-5, noise_multiplier=1.2, max_grad_norm=1.0, dp_examples=4, sample_rate=0.5)
    history = [
        row | {"round": 1, "dp_steps": 2, "epsilon": 1.0, "dp_clipped": 2, "clipped_fraction": 0.5},
        row | {"round": 2, "dp_steps": 4, "epsilon": 1.5, "dp_clipped": 0, "clipped_fraction": 0.0},
    ]
    clients = {"A": {}}
    closing = mlflow_metrics({"clients": clients, **run_record(plan, history, clients)})
    assert closing["A.run/clipped_fraction"] == 0.25 and closing["A.run/epsilon"] == 1.5
    # logged at step stopped_round = 2: none of its keys may be one a round logs (two values at one step)
    assert not set(closing) & set(round_metrics([history[1]]))
    run = {"mode": "client", "epsilon": 2.0, "epsilon_max": 2.0, "clipping_norm": 1.0, "clipped_fraction": 0.25}
    client_round = {"client": "A", "round": 2, "update_clipped": 0, "clipping_norm": 1.0, "epsilon": 2.0}
    assert not set(mlflow_metrics({"clients": {}, "privacy": run})) & set(round_metrics([client_round]))


def test_privacy_points_carry_the_delta_of_each_epsilon(tmp_path):
    from pipeline.experiments.entries import Experiment
    from pipeline.paths import ProjectPaths
    from pipeline.results.figures import privacy_figure, privacy_points
    from pipeline.results.tables import ReportInputs

    planned = [
        Experiment("p0", "fedavg", "domain/seed0", 0, "privacy"),
        Experiment("d0", "fedavg", "domain/seed0", 0, "privacy", dp="DP-SGD ε≤3"),
        Experiment("d1", "fedavg", "domain/seed0", 1, "privacy", dp="DP-SGD ε≤3"),
    ]
    scores = pd.DataFrame(
        [{"experiment": e, "client": c, "avg_rouge": 5.0, "backbone": "tiny"} for e in ("p0", "d0", "d1") for c in "AB"]
    )
    for name, deltas in (("p0", None), ("d0", (1e-5, 4e-6)), ("d1", (2e-6, 3e-6))):
        d = tmp_path / "reports/train" / name
        d.mkdir(parents=True)
        clients = {
            c: {} if deltas is None else {"privacy": {"epsilon": 2.0, "delta": x, "noise_multiplier": 1.0}}
            for c, x in zip("AB", deltas or (0, 0))
        }
        d.joinpath("metrics.json").write_text(
            json.dumps({"clients": clients, "privacy": None if deltas is None else {"target_epsilon": 3}})
        )
    points = privacy_points(ReportInputs(planned), scores, ProjectPaths(tmp_path)).set_index("label")
    assert points.loc["fedavg DP-SGD ε≤3", "delta"] == 1e-5  # the largest over clients and seeds
    assert pd.isna(points.loc["fedavg", "delta"])
    privacy_figure(points.reset_index(), ProjectPaths(tmp_path))
    assert pd.read_csv(tmp_path / "reports/plots/privacy.csv")["delta"].max() == 1e-5


def test_the_committed_client_dp_table_is_the_benchmarks_json_and_its_sampling_is_poisson():
    # reports/privacy/client_dp.md is rendered from client_dp.json; docs quote neither by hand
    from benchmarks.client_dp import markdown

    root = Path(__file__).resolve().parents[1] / "reports/privacy"
    res = json.loads((root / "client_dp.json").read_text())
    assert res["privacy"]["sampling"] == "poisson" and res["privacy"]["delta"] == 1e-5
    assert (root / "client_dp.md").read_text() == markdown(res)


@pytest.mark.parametrize("study", ["reports/privacy/study", "reports/cpu-study"])
def test_a_committed_study_recomputes_exactly_from_its_per_example_scores(study, tmp_path):
    """Every committed comparisons table is what the current intervals give on the study's committed per-example
    scores and train records (`python -m pipeline.report rebuild`): a change of the statistics or a hand edit of a
    table fails here until the study folder is rebuilt."""
    import shutil

    from pipeline.report import rebuild_study

    src = Path(__file__).resolve().parents[1] / study
    copy = tmp_path / "study"
    shutil.copytree(src, copy)
    (copy / "README.md").unlink(missing_ok=True)  # the README block has its own check (tests/test_claims.py)
    rebuild_study(copy)
    committed = pd.read_csv(src / "comparisons.csv")
    rebuilt = pd.read_csv(copy / "comparisons.csv")
    pd.testing.assert_frame_equal(rebuilt, committed)
    # and every file the rebuild writes (the tables' markdown with their numbers and notes, the CSVs), byte for byte
    written = [p.relative_to(copy) for p in copy.rglob("*") if p.is_file()]
    differ = [str(p) for p in written if not (src / p).is_file() or (src / p).read_bytes() != (copy / p).read_bytes()]
    assert not differ, differ


def test_privacy_points_take_a_client_level_runs_budget_from_the_run(tmp_path):
    # privacy.mode client: clients.<c>.privacy holds only the client's aggregated updates (docs/privacy.md); the
    # budget, with its delta, is the run's `privacy`
    from pipeline.experiments.entries import Experiment
    from pipeline.paths import ProjectPaths
    from pipeline.results.figures import privacy_points
    from pipeline.results.tables import ReportInputs

    planned = [Experiment(f"c{s}", "fedavg", "quantity/seed0", s, "privacy", dp="client DP ε≤3") for s in (0, 1)]
    scores = pd.DataFrame(
        [{"experiment": e, "client": "A", "avg_rouge": 5.0, "backbone": "tiny"} for e in ("c0", "c1")]
    )
    for name, eps in (("c0", 2.0), ("c1", 2.5)):
        run = {"mode": "client", "target_epsilon": 3, "epsilon": eps, "epsilon_max": eps, "delta": 1e-5}
        d = tmp_path / "reports/train" / name
        d.mkdir(parents=True)
        d.joinpath("metrics.json").write_text(
            json.dumps(
                {
                    "clients": {"A": {"privacy": {"updates_aggregated": 2, "clipped_fraction": 0.5}}},
                    "privacy": run | {"noise_multiplier": 1.1, "clipping_norm": 1.0},
                }
            )
        )
    point = privacy_points(ReportInputs(planned), scores, ProjectPaths(tmp_path)).iloc[0]
    assert (point["epsilon"], point["delta"]) == (2.25, 1e-5)  # the mean over the seeds, at the run's delta
    assert (point["target_epsilon"], point["noise_multiplier"]) == (3, 1.1)


def test_the_privacy_figure_says_a_client_level_runs_epsilon_is_the_runs_not_the_largest_over_clients(
    tmp_path, monkeypatch
):
    # spent_epsilon: DP-SGD's is the largest of the clients' (each its own examples' budget); privacy.mode client's is
    # the run's guarantee for any one client's whole contribution (docs/privacy.md), not a maximum over anything
    from pipeline.experiments.entries import Experiment, privacy_label
    from pipeline.experiments.privacy import PrivacyConfig
    from pipeline.paths import ProjectPaths
    from pipeline.results import figures
    from pipeline.results.tables import ReportInputs

    labels = []
    monkeypatch.setattr(figures, "save", lambda fig, path: labels.append(fig.axes[0].get_xlabel()) or path)
    for mode, extra in (("client", {"clipping_norm": 1.0}), ("example", {})):
        dp = privacy_label(PrivacyConfig(mode=mode, target_epsilon=3, **extra))
        planned = [Experiment(f"{mode}0", "fedavg", "quantity/seed0", 0, "privacy", dp=dp)]
        scores = pd.DataFrame([{"experiment": f"{mode}0", "client": "A", "avg_rouge": 5.0, "backbone": "tiny"}])
        run = {"mode": mode, "target_epsilon": 3, "epsilon": 2.0, "delta": 1e-5, "noise_multiplier": 1.1}
        client = {"updates_aggregated": 2} if mode == "client" else {"epsilon": 2.0, "delta": 1e-5}
        d = tmp_path / "reports/train" / f"{mode}0"
        d.mkdir(parents=True)
        metrics = {"clients": {"A": {"privacy": client | {"noise_multiplier": 1.1}}}, "privacy": run}
        d.joinpath("metrics.json").write_text(json.dumps(metrics))
        points = figures.privacy_points(ReportInputs(planned), scores, ProjectPaths(tmp_path))
        figures.privacy_figure(points, ProjectPaths(tmp_path))
    client_level, example_level = labels
    assert "largest over clients" not in client_level and "the run's" in client_level
    assert "largest over clients" in example_level and "the run's" not in example_level
