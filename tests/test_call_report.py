"""tools/gpu_study/call_report.py: engine.md's section 5 is the one generated from the GPU study call's returned
files, and the log's round bars and step lines are read as the call wrote them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.gpu_study import call_report

pytestmark = pytest.mark.tools  # a developer tool under tools/

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("number, kept", [(5, "gpu-study-call"), (6, "gpu-study-call-2026-11-28b")])
def test_committed_section_is_the_one_generated_from_the_returned_files(number, kept, zone):
    text = (ROOT / "reports" / "bench" / "engine.md").read_text()
    committed = f"## {number}." + text.partition(f"## {number}.")[2].partition(f"\n## {number + 1}.")[0]
    folder = ROOT / "reports" / "bench" / kept
    assert committed.strip() == call_report.section(folder, number, f"reports/bench/{kept}").strip()
    assert "NVIDIA" in re.search(r"Device: ([^;]+);", committed).group(1)  # measured on the lent GPU


def test_round_ends_keeps_the_first_time_each_count_shows():
    log = (
        "a-s0 rounds:   0%|     | 0/60 [00:00<?, ?round/s]\n"
        "a-s0 rounds:   2%|     | 1/60 [00:57<56:03, 57.0s/round, val A=5.1]\n"
        "b-s1 rounds:   2%|     | 1/60 [01:02:05<1:00, 9.0s/round]\n"
        "a-s0 rounds:   2%|     | 1/60 [00:59<56:03, 57.0s/round, val A=5.1]\n"  # a redraw of the same count
        "a-s0 rounds:   3%|     | 2/60 [01:33<40:00, 46.0s/round]\n"
    )
    assert call_report.round_ends(log) == {"a-s0": {0: 0, 1: 57, 2: 93}, "b-s1": {1: 3725}}


def test_train_windows_from_the_recorded_start_or_else_the_budget_left():
    plan, train = {"step": "plan", "seconds": 6.0}, {"step": "train", "seconds": 387.0}
    log = "=== plan (393 s left)\n=== plan: ok in 6.0 s\n=== train (387 s left)\n"
    # one call without started_at (the first lease's): the budget less the packing reserve (20 s) is 550, so train
    # starts 163 s after the first sample
    call = {"budget_s": 570, "steps": [plan, train]}
    assert call_report.train_windows([call], log, 1000.0) == [(1163.0, 1550.0)]
    # a call and its resumed call, each step stamped: every train window, whatever the log says
    first = {"budget_s": 570, "steps": [plan, train | {"started_at": 50.0}]}
    resumed = {"budget_s": 200, "steps": [{"step": "train", "seconds": 100.0, "started_at": 900.0}]}
    assert call_report.train_windows([first, resumed], log, 0.0) == [(50.0, 437.0), (900.0, 1000.0)]


def test_the_train_steps_samples_become_two_tables(tmp_path):
    from benchmarks.gpu_profile import pyspy_top

    raw = tmp_path / "pyspy-train.txt"
    raw.write_text(
        "_bootstrap (threading.py:1);execute (pipeline/training/set_engine.py:150);mm (torch) 6\n"
        "_bootstrap (threading.py:1);save (pipeline/training/checkpoints.py:74);write (torch) 3\n"
        "_bootstrap (threading.py:1);wait (threading.py:300) 1\n"
    )
    tables = call_report._spy_tables(pyspy_top(raw, n=40))
    assert "10 samples" in tables
    assert "| `mm (torch)` | 6 | 60 |" in tables and "| `wait (threading.py:300)` | 1 | 10 |" in tables
    ours = tables.partition("| function (within)")[2]
    assert "| `execute (pipeline/training/set_engine.py:150)` | 6 | 60 |" in ours
    assert "| `save (pipeline/training/checkpoints.py:74)` | 3 | 30 |" in ours and "threading.py" not in ours


def test_a_round_without_a_client_average_is_the_stop_rules_nan_not_a_crash():
    """reports/train/<exp>/rounds.json's val_loss_mean is None in a round where a client had no validation loss (the
    stop rule's NaN, training.history.round_values). By hand, a run on 3.0 + 1.5 r^-0.5 for 12 rounds with round 5
    None: first 4.5, last 3.0 + 1.5 / sqrt(12); round 12 improved on round 11 by (L(11) - L(12)) / L(11); the power
    law fitted to rounds 1-9 (round 5 left out) is the curve, so the projection is where the rule holds on it."""
    from pipeline.experiments.train_config import StopConfig

    loss = lambda r: 3.0 + 1.5 * r**-0.5  # noqa: E731
    rows = [{"round": r, "val_loss_mean": None if r == 5 else loss(r)} for r in range(1, 13)]
    stop = StopConfig(enabled=True, min_rel_improvement=0.001, patience=3, max_rounds=200)
    (row,) = call_report.convergence_rows({"a-s0": rows}, stop)
    assert row["first"] == pytest.approx(4.5) and row["last"] == pytest.approx(loss(12))
    assert row["last_gain"] == pytest.approx((loss(11) - loss(12)) / loss(11))
    rel = {r: (loss(r - 1) - loss(r)) / loss(r - 1) for r in range(2, 201)}
    assert row["projected"] == [next(r for r in range(4, 201) if all(rel[k] < 0.001 for k in (r - 2, r - 1, r)))]
    assert row["holdout"] < 1e-4 and row["converged"] == 0


def test_a_call_cut_after_each_runs_first_round_is_reported_not_a_crash():
    """call_report is for any call, finished or cut (docs/gpu-lease.md); rounds.json is written as each round ends, so
    a call the budget cut in round 2 (the first round fills the prefix cache: 44-57 s on the lent H100, after ~170 s
    of steps before training) returns one round a run. The last round's gain (relative_improvements(s)[-1]) raised
    IndexError on it: no round before the first to gain on. By hand: rounds 1 only, losses 3.0 and 5.0: first = last
    = 4.0, no gain ('-'), not converged, nothing projected."""
    import yaml

    from tools.gpu_study import device

    params = device.merge_profile(
        yaml.safe_load((ROOT / "params.yaml").read_text()),
        yaml.safe_load((ROOT / "configs/gpu-study.yaml").read_text()),
    )
    study = {"budget_s": 300, "seconds": 290.0, "complete": False, "device": {"python": "3.12", "gpu": "G"}}
    study["steps"] = [{"step": "train", "status": "failed (timeout)", "started_at": 100.0, "seconds": 110.0}]
    rounds = {f"fedavg-domain-s{i}": [{"round": 1, "val_loss_mean": loss}] for i, loss in enumerate((3.0, 5.0))}
    text = call_report.markdown(study, "", [], rounds, params)
    assert "| fedavg-domain | 2 | 1 | 4.000 | 4.000 | - | 0 of 2 | - | - |" in text


def test_the_floor_weights_each_arms_flops_by_the_run_rounds_it_trained():
    """Section 5's ratio to the FLOP floor: the floor of a run-round is the mean over the run-rounds trained (a KD
    arm's round adds the teacher's forward), over the dense peak; none without the partition's sizes."""
    from tools.gpu_study.device import PROFILE, REPO, merged_params
    from tools.gpu_study.estimate import H100_PEAK, floor_flops_per_round

    params = merged_params(REPO, PROFILE)
    partition = {"clients": {"A": {"sizes": {"train": 10, "valid": 4}}, "B": {"sizes": {"train": 6, "valid": 2}}}}
    rounds = {"single-domain-s0": [{}, {}], "fedkd-domain-s0": [{}, {}, {}]}
    plain, kd = (floor_flops_per_round(16, 6, two, params) for two in (False, True))
    assert kd > plain > 0
    floor = call_report.floor_per_run_round(rounds, params, partition)
    assert floor["fp32"] == pytest.approx((2 * plain + 3 * kd) / 5 / H100_PEAK["fp32"])
    assert floor["bf16"] == pytest.approx((2 * plain + 3 * kd) / 5 / H100_PEAK["bf16"])
    assert call_report.floor_per_run_round(rounds, params, None) == {}
