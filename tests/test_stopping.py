"""Training until convergence (params.yaml `train.stop`, pipeline.training.stopping): the rule on hand-made loss
sequences, its place in the plan, and tiny runs of both engines that stop by it and record the outcome.

Properties stated: a run ends after the first round at which each of the last `patience` client-average validation
losses improved on the best before it by less than `min_rel_improvement`, or at `max_rounds`; it records the round
it stopped at, its best round (lowest client average, first of equals) and converged = the rule held at its last
round (a run that reached the ceiling first is not converged). Disabled, plans are those of a fixed `train.rounds` and
no run stops early.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.test_federated import workspace, write_plan, ws  # noqa: F401  (fixtures)


def _stop(**kw):
    from pipeline.experiments.train_config import StopConfig

    return StopConfig(**{"enabled": True, "min_rel_improvement": 0.005, "patience": 3, "max_rounds": 40, **kw})


def _rows(rnd: int, mean: float) -> list[dict]:
    # two clients whose average is `mean` (the rule reads the client average, not one client)
    return [
        {"round": rnd, "client": "A", "val_loss": mean - 0.5},
        {"round": rnd, "client": "B", "val_loss": mean + 0.5},
    ]


def _run(means: list[float], stop) -> tuple[int, dict]:
    """A scripted run as the engines loop: before each round the rule is checked on the rounds so far; round r's
    validation gives the client average means[r - 1]. Returns the rounds trained and the recorded outcome."""
    from pipeline.training.stopping import convergence

    history: list[dict] = []
    for rnd in range(1, stop.max_rounds + 1):
        if convergence(history, stop)["converged"]:
            break
        history += _rows(rnd, means[rnd - 1])
    return max(r["round"] for r in history), convergence(history, stop)


def test_a_plateau_of_patience_rounds_stops_the_run_after_its_last_round():
    # best 8.0 at round 2; rounds 3-5 improve on it by less than 0.5 % (8.0 -> 7.97 is 0.375 %): stop after round 5
    trained, outcome = _run([10.0, 8.0, 8.1, 7.97, 8.05, 1.0, 1.0], _stop(patience=3))
    assert trained == 5
    assert outcome == {"stopped_round": 5, "best_round": 4, "converged": True}


def test_an_improvement_of_at_least_min_rel_restarts_the_count():
    # round 4 improves 8.0 -> 7.9 (1.25 % >= 0.5 %): the patience count starts again from round 5
    trained, outcome = _run([10.0, 8.0, 8.0, 7.9, 7.9, 7.9, 7.9, 7.0], _stop(patience=3))
    assert trained == 7
    assert outcome == {"stopped_round": 7, "best_round": 4, "converged": True}  # first of equal averages


def test_a_run_still_improving_stops_at_max_rounds_not_converged():
    trained, outcome = _run([10.0, 9.0, 8.0, 7.0, 6.0, 5.0], _stop(patience=2, max_rounds=4))
    assert trained == 4
    assert outcome == {"stopped_round": 4, "best_round": 4, "converged": False}


def test_max_rounds_before_the_rule_held_is_not_converged_even_with_an_earlier_best():
    # rounds 3-4 are worse than round 2, but patience 3 needs a third round: the ceiling comes first
    trained, outcome = _run([10.0, 8.0, 8.5, 9.0, 9.0], _stop(patience=3, max_rounds=4))
    assert trained == 4
    assert outcome == {"stopped_round": 4, "best_round": 2, "converged": False}


def test_a_rule_that_held_is_converged_although_the_last_round_is_best_by_a_hair():
    # each round improves, by less than 0.5 %: the rule stops the run; its last round is its best, by < 0.5 %
    trained, outcome = _run([10.0, 8.0, 7.99, 7.98, 7.97, 7.0], _stop(patience=3))
    assert trained == 5
    assert outcome == {"stopped_round": 5, "best_round": 5, "converged": True}


def test_the_projection_recovers_a_power_law_and_where_the_rule_ends_it():
    from benchmarks.stop_rule import power_law, projected_stop

    a, b, c = 4.0, 1.5, 0.5
    rounds = list(range(1, 11))
    stop = _stop(min_rel_improvement=0.001, patience=3, max_rounds=200)
    got = projected_stop(rounds, list(power_law(np.array(rounds), a, b, c)), stop, fit_rounds=6)
    assert (got["a"], got["b"], got["c"]) == pytest.approx((a, b, c), abs=1e-4)
    assert got["holdout_error"] < 1e-4
    # by hand: round r improves on r - 1 by (L(r-1) - L(r)) / L(r-1) (the curve falls, so r - 1 is the best before)
    loss = lambda r: a + b * r**-c  # noqa: E731
    rel = {r: (loss(r - 1) - loss(r)) / loss(r - 1) for r in range(2, 201)}
    expected = next(r for r in range(4, 201) if all(rel[k] < 0.001 for k in (r - 2, r - 1, r)))
    assert got["stop_round"] == expected
    assert got["gain_per_round"] == pytest.approx(loss(expected - 1) - loss(expected), rel=1e-3)
    assert got["remaining_gain"] == pytest.approx(loss(expected) - loss(200), rel=1e-3)
    assert got["gain_before"] == pytest.approx(loss(1) - loss(expected), rel=1e-3)
    # a ceiling before that round: the rule never holds, nothing is left after the ceiling
    early = projected_stop(
        rounds, list(power_law(np.array(rounds), a, b, c)), _stop(min_rel_improvement=0.001, max_rounds=expected - 1)
    )
    assert early["stop_round"] is None and early["remaining_gain"] == 0.0


def test_the_gpu_study_rule_ends_every_committed_cpu_curve_before_its_ceiling():
    """The rule configs/gpu-study.yaml sets, on the CPU study's curves continued by their fitted power laws
    (benchmarks/stop_rule.py, the numbers of docs/statistics.md): it ends every run before the ceiling, where the
    per-round gain is below 0.005 nats; the rule it replaced ended them where they still fell 0.015 nats a round."""
    from benchmarks.stop_rule import REPLACED, curves, gpu_study_stop, projected_stop

    runs = curves()
    # every run the CPU study declares (7 methods x 3 seeds), each with its rounds: none found would check nothing
    study = yaml.safe_load((Path(__file__).resolve().parents[1] / "reports/cpu-study/params.yaml").read_text())
    assert sorted(runs) == sorted(study["experiments"]) and len(runs) == 21
    assert all(len(rounds) == len(loss) >= 2 for rounds, loss in runs.values())
    new = [projected_stop(r, loss, gpu_study_stop()) for r, loss in runs.values()]
    old = [projected_stop(r, loss, REPLACED) for r, loss in runs.values()]
    assert all(f["stop_round"] is not None and f["gain_per_round"] < 0.005 for f in new)
    assert all(f["gain_per_round"] > 0.01 for f in old)


def test_disabled_never_stops_early_but_still_records_the_outcome():
    from pipeline.training.stopping import convergence

    history = [row for rnd, m in enumerate([10.0, 8.0, 8.5, 9.0, 9.5], 1) for row in _rows(rnd, m)]
    off = _stop(enabled=False, patience=2)
    assert not convergence(history, off)["converged"]
    # no rule, no verdict (the tables judge a fixed budget's client-runs by their rounds)
    assert convergence(history, off) == {"stopped_round": 5, "best_round": 2, "converged": None}


def test_the_rule_reads_the_client_average_and_clients_that_evaluated():
    from pipeline.training.stopping import mean_val_loss_by_round, plateaued, relative_improvements

    history = [
        {"round": 1, "client": "A", "val_loss": 2.0},
        {"round": 1, "client": "B", "val_loss": 4.0},
        {"round": 2, "client": "A", "val_loss": 1.0},
        {"round": 2, "client": "B"},  # B failed to evaluate
        {"round": 2, "client": "C", "val_loss": 5.0},
        {"round": 3, "client": "A", "val_loss": 1.0},
        {"round": 3, "client": "B", "val_loss": 3.0},
        {"round": 3, "client": "C", "val_loss": 5.0},
    ]
    # round 2 without B's loss is no client average (A and C alone would read 3.0, A alone 1.0)
    assert mean_val_loss_by_round(history) == [(1, 3.0), (2, pytest.approx(np.nan, nan_ok=True)), (3, 3.0)]
    assert mean_val_loss_by_round(history, exclude="C")[::2] == [(1, 3.0), (3, 2.0)]
    assert mean_val_loss_by_round(history, before=2) == [(1, 3.0)]
    assert relative_improvements([4.0, 3.0, 3.5, 2.4]) == pytest.approx([0.25, -1 / 6, 0.2])
    assert not plateaued([4.0, 4.0], 0.01, patience=2)  # two rounds after a first one needed
    assert plateaued([4.0, 4.0, 4.0], 0.01, patience=2)
    assert not plateaued([4.0, 4.0, 4.0], 0.0, patience=2)  # min_rel 0: any non-improvement counts, none did


def test_a_clients_later_row_without_a_loss_keeps_the_loss_it_set_that_round():
    """round_mean: a client's last SET value counts; a later row of it without val_loss (a fit row, a failed
    evaluation) does not erase it. By hand: A 2.0 (then a row without a loss), B 4.0 -> (2 + 4) / 2 = 3."""
    from pipeline.training.stopping import round_mean

    rows = [
        {"round": 1, "client": "A", "val_loss": 2.0},
        {"round": 1, "client": "A", "eval_failed": 1},
        {"round": 1, "client": "B", "bytes_up": 10},
        {"round": 1, "client": "B", "val_loss": 4.0},
    ]
    assert round_mean(rows) == 3.0


def test_a_late_client_s_run_counts_from_its_join():
    from pipeline.training.stopping import convergence

    stop = _stop(patience=1)
    before = [row for rnd in (1, 2, 3) for row in _rows(rnd, 5.0)]  # flat before the join: not a reason to stop
    assert not convergence(before, stop, late="SAMSum")["converged"]
    joined = before + [{"round": 4, "client": "A", "val_loss": 5.0}, {"round": 4, "client": "SAMSum", "val_loss": 9.0}]
    assert not convergence(joined, stop, late="SAMSum")["converged"]  # one round since the join
    joined += [{"round": 5, "client": "A", "val_loss": 5.0}, {"round": 5, "client": "SAMSum", "val_loss": 9.0}]
    assert convergence(joined, stop, late="SAMSum")["converged"]
    assert convergence(joined, stop, late="SAMSum") == {"stopped_round": 5, "best_round": 4, "converged": True}


def test_a_late_client_that_has_not_joined_after_a_hundred_rounds_still_holds_the_run():
    """Post-addition with a late join (join.max_round has no ceiling): 100 flat rounds of the first clients are no
    reason to stop while the late client has not joined; there is no stop series yet, hence no best round."""
    from pipeline.training.stopping import convergence

    history = [row for rnd in range(1, 101) for row in _rows(rnd, 5.0)]
    assert convergence(history, _stop(), late="SAMSum") == {
        "stopped_round": 100,
        "best_round": None,
        "converged": False,
    }


def test_a_run_without_a_recorded_round_stopped_at_round_zero_with_no_best_round():
    """The check the engines make before round 1, and the record of a run that recorded no round: nothing trained
    (round 0, not round 1), no best round, not converged."""
    from pipeline.training.stopping import convergence

    assert convergence([], _stop()) == {"stopped_round": 0, "best_round": None, "converged": False}


def test_join_admission_still_uses_the_same_test():
    from pipeline.experiments.train_config import JoinConfig
    from pipeline.federation.server_app import new_client_joins

    join = JoinConfig(min_rel_improvement=0.01, patience=2, max_round=10)
    history = [row for rnd, m in enumerate([10.0, 8.0, 7.95, 7.93], 1) for row in _rows(rnd, m)]
    history.append({"round": 2, "client": "SAMSum", "val_loss": 99.0})  # the late client's rows do not count
    assert not new_client_joins(4, history, "SAMSum", join)  # rounds 2-3: 20 %, 0.6 %
    assert new_client_joins(5, history, "SAMSum", join)  # rounds 3-4: 0.6 %, 0.25 %
    assert new_client_joins(10, [], "SAMSum", join)  # max_round


def test_stop_settings_are_checked():
    from pipeline.common.config import ConfigError, from_dict
    from pipeline.experiments.train_config import TrainConfig

    for bad in ({"patience": 0}, {"min_rel_improvement": 1.0}, {"max_rounds": 0}, {"rounds_max": 3}):
        with pytest.raises(ConfigError, match=r"train\.stop"):
            from_dict(TrainConfig, {"stop": bad}, "train")


def test_plan_holds_stop_only_when_enabled_and_its_ceiling_as_rounds(ws):
    off = json.loads(Path(write_plan("stop-off", "fedavg", rounds=2)).read_text())
    assert "stop" not in off["train"] and off["train"]["rounds"] == 2
    on = json.loads(
        Path(
            write_plan("stop-on", "fedavg", rounds=2, stop={"enabled": True, "patience": 2, "max_rounds": 6})
        ).read_text()
    )
    assert on["train"]["rounds"] == 6
    assert on["train"]["stop"] == {"enabled": True, "min_rel_improvement": 0.005, "patience": 2, "max_rounds": 6}
    assert {k: v for k, v in on["train"].items() if k not in ("stop", "rounds")} == {
        k: v for k, v in off["train"].items() if k != "rounds"
    }


@pytest.mark.parametrize("method", ["fedavg", "single"])
def test_a_tiny_run_with_the_rule_stops_early_and_records_it(ws, method):
    """min_rel_improvement 0.9 with patience 1: round 2 cannot improve the client average by 90 %, so the run
    ends after round 2 of at most 5, in both engines (Flower's server loop and the serverless one)."""
    import mlflow

    from pipeline.experiments.settings import RunSettings
    from pipeline.train import run_experiment

    name = f"stop-{method}"
    plan = write_plan(name, method, stop={"enabled": True, "min_rel_improvement": 0.9, "patience": 1, "max_rounds": 5})
    metrics = run_experiment(plan, settings=RunSettings())
    wide = json.loads(Path(f"reports/train/{name}/rounds.json").read_text())
    assert [r["round"] for r in wide] == [1, 2]
    means = [r["val_loss_mean"] for r in wide]
    best = 1 if means[0] <= means[1] else 2
    recorded = json.loads(Path(f"reports/train/{name}/metrics.json").read_text())
    assert {k: recorded[k] for k in ("stopped_round", "best_round", "converged")} == {
        "stopped_round": 2,
        "best_round": best,
        "converged": True,  # the rule ended it (round 2 improved by < 90 %), whichever round was best
    }
    assert recorded == json.loads(Path(f"models/{name}/metrics.json").read_text()) and metrics["stopped_round"] == 2
    for c in recorded["clients"].values():  # each client keeps its own best round
        assert c["best_round"] in (1, 2)

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    run = mlflow.search_runs(
        experiment_names=["tests"], filter_string=f"tags.experiment = '{name}'", output_format="list"
    )[0]
    assert run.data.tags["stopped_round"] == "2" and run.data.tags["best_round"] == str(best)
    assert run.data.tags["converged"] == "true"
    assert run.data.params["train.stop.patience"] == "1" and run.data.params["train.rounds"] == "5"


@pytest.mark.slow
def test_the_documented_stop_rule_table_is_the_projections_output():
    from benchmarks.stop_rule import BEGIN, END, gpu_study_stop, table

    text = (Path(__file__).resolve().parents[1] / "docs/statistics.md").read_text(encoding="utf-8")
    assert text.split(BEGIN, 1)[1].split(END, 1)[0].strip() == table(gpu_study_stop())


@pytest.mark.slow
def test_the_stop_rule_prose_is_the_projections_output():
    """docs/statistics.md's sentences after the table: the replaced rule ends runs still falling ~0.016 nats a round
    with over half their fall ahead; the 0.1 % rule where a round gains ~0.004 nats, ~0.08 nats (about a fifth)
    left; 0.05 % ends them at rounds 37-60 with ~0.03 nats left."""
    import dataclasses

    from benchmarks.stop_rule import REPLACED, curves, gpu_study_stop, projected_stop

    text = " ".join((Path(__file__).resolve().parents[1] / "docs/statistics.md").read_text(encoding="utf-8").split())
    runs = curves()

    def found(stop):
        return [projected_stop(r, loss, stop) for r, loss in runs.values()]

    old, new, half = (
        found(REPLACED),
        found(gpu_study_stop()),
        found(dataclasses.replace(gpu_study_stop(), min_rel_improvement=0.0005)),
    )
    median = lambda fs, key: float(np.median([f[key] for f in fs]))  # noqa: E731
    assert f"still fall about {median(old, 'gain_per_round'):.3f} nats a round" in text
    assert np.median([f["remaining_gain"] / f["gain_before"] for f in old]) > 0.5
    assert f"a round gains about {median(new, 'gain_per_round'):.3f} nats" in text
    assert f"is about {median(new, 'remaining_gain'):.2f} nats, about a fifth" in text
    assert 0.15 < np.median([f["remaining_gain"] / f["gain_before"] for f in new]) < 0.25
    rounds = [f["stop_round"] for f in half]
    left = median(half, "remaining_gain")
    assert f"0.05 %: ends them at rounds {min(rounds)}-{max(rounds)} with {left:.2f} nats left" in text


def test_a_fixed_budget_run_marks_only_the_clients_whose_best_round_is_their_last(ws):
    """Without train.stop (a fixed round budget, docs/statistics.md "Round budget") the tables judge each client-run
    by its own rounds: B's best validation round is 2 of 3, so it was not still improving; A's is 3 of 3. The train
    record states no stop-rule verdict for such a run, so the disabled rule's defaults (patience 3 cannot hold in
    3 rounds) do not mark every client."""
    from pipeline.experiments.plans import read_plan
    from pipeline.results.readers import run_convergence
    from pipeline.training.summary import record_run

    plan = read_plan(write_plan("fixed-budget", "single", rounds=3))
    losses = {"A": [5.0, 4.0, 3.0], "B": [5.0, 4.0, 4.5]}
    kept = {"A": [1, 2, 3], "B": [1, 2, 2]}  # the round of each client's adapter_best, which its replies report
    history = [
        {"round": r, "client": c, "val_loss": v[r - 1], "best_round": kept[c][r - 1]}
        for r in (1, 2, 3)
        for c, v in losses.items()
    ]
    metrics = record_run(plan, history, [])
    got = run_convergence(Path("reports/train"), "fixed-budget")
    assert dict(zip(got["client"], got["best_is_last"])) == {"A": True, "B": False}
    assert metrics["converged"] is None  # no rule, no verdict


def test_a_nan_round_is_never_the_best_and_does_not_hide_the_rounds_after_it(ws):
    """A diverged validation (NaN) is never best (pipeline.training.checkpoints.keep_best_and_final keeps no adapter
    of it): the run's best round and each round's "best before" pass over it, and each client's recorded best is
    the round whose adapter it kept (its replies report it: 0 until A has a finite loss), at that round's loss. By
    hand: A's losses NaN, 4.0, 3.5, 3.5, 3.5 and B's 5.0, 4.0, 3.5, 3.5, 3.5; the client averages NaN, 4.0, 3.5,
    3.5, 3.5 improve by 12.5 %, 0, 0 on the best before from round 3 on."""
    from pipeline.experiments.plans import read_plan
    from pipeline.training.stopping import convergence, relative_improvements
    from pipeline.training.summary import summarize

    nan = float("nan")
    losses = {"A": [nan, 4.0, 3.5, 3.5, 3.5], "B": [5.0, 4.0, 3.5, 3.5, 3.5]}
    kept = {"A": [0, 2, 3, 3, 3], "B": [1, 2, 3, 3, 3]}
    history = [
        {"round": r, "client": c, "val_loss": v[r - 1], "best_round": kept[c][r - 1]}
        for r in range(1, 6)
        for c, v in losses.items()
    ]
    assert relative_improvements([nan, 4.0, 3.5, 3.5, 3.5])[1:] == pytest.approx([0.125, 0.0, 0.0])
    # rounds 4 and 5 gained nothing on 3.5, round 3 gained 12.5 % >= 0.5 %: patience 2 holds at round 5, not 3
    assert convergence(history, _stop(patience=2)) == {"stopped_round": 5, "best_round": 3, "converged": True}
    assert not convergence(history, _stop(patience=3))["converged"]
    clients = summarize(read_plan(write_plan("nan-round", "single", rounds=5)), history, [])["clients"]
    assert (clients["A"]["best_round"], clients["A"]["best_val_loss"]) == (3, 3.5)
    assert (clients["B"]["best_round"], clients["B"]["best_val_loss"]) == (3, 3.5)


def test_a_round_missing_a_client_s_validation_loss_has_no_comparable_mean():
    """Every client the server knows has a row each round (sampled or not, absent or failed) and every admitted one
    is asked to evaluate (fraction_evaluate 1); a round where one of them has no validation loss averages other
    clients, whose levels differ. By hand: A at 2.0 and B at 6.0 in every round, B failing to evaluate in round 2:
    no client improved, so round 1 (mean 4.0) is the best, not round 2 (A alone, 2.0). A and B improving by 10 % a
    round, A absent in round 3: the client average fell 10 % (4.0, 3.6, 3.24); B alone (5.4) looks like no gain, and
    patience 1 at 5 % stopped the run and admitted a late client though every client improved."""
    from pipeline.experiments.train_config import JoinConfig
    from pipeline.federation.server_app import new_client_joins
    from pipeline.training.stopping import convergence, mean_val_loss_by_round

    flat = [{"round": r, "client": "A", "val_loss": 2.0} for r in (1, 2, 3)] + [
        {"round": r, "client": "B", **({"eval_failed": 1} if r == 2 else {"val_loss": 6.0})} for r in (1, 2, 3)
    ]
    assert convergence(flat, _stop(patience=1))["best_round"] == 1
    assert np.isnan(dict(mean_val_loss_by_round(flat))[2])
    improving = [
        {"round": r, "client": c, **({"absent": 1} if (r, c) == (3, "A") else {"val_loss": v * 0.9 ** (r - 1)})}
        for r in (1, 2, 3)
        for c, v in (("A", 2.0), ("B", 6.0))
    ]
    stop = _stop(patience=1, min_rel_improvement=0.05)
    assert not convergence(improving, stop)["converged"]
    assert not new_client_joins(4, improving, "New", JoinConfig(min_rel_improvement=0.05, patience=1, max_round=9))
    # the round after it compares with the best before (round 2), here another 10 %: still learning
    improving += [{"round": 4, "client": c, "val_loss": v * 0.9**3} for c, v in (("A", 2.0), ("B", 6.0))]
    assert not convergence(improving, stop)["converged"] and convergence(improving, stop)["best_round"] == 4


def test_the_projection_fits_a_run_with_a_round_without_a_client_average():
    """The rule's series has NaN in a round where a client's evaluation failed (c42645a); benchmarks.stop_rule.curves
    passes it to the power-law fit. The curve is still the other rounds' curve: by hand, both clients on
    a + b r^-c (A at 4.0 + 1.5 r^-0.5, B at 2.0 + 1.5 r^-0.5: mean 3.0 + 1.5 r^-0.5), B failing in round 3 (a
    fitted round) and round 8 (a held-out one)."""
    from benchmarks.stop_rule import projected_stop
    from pipeline.training.stopping import mean_val_loss_by_round

    history = [
        {"round": r, "client": c, **({"eval_failed": 1} if (r, c) in ((3, "B"), (8, "B")) else {"val_loss": a})}
        for r in range(1, 11)
        for c, a in (("A", 4.0 + 1.5 * r**-0.5), ("B", 2.0 + 1.5 * r**-0.5))
    ]
    series = mean_val_loss_by_round(history)
    assert np.isnan(series[2][1]) and np.isnan(series[7][1])
    got = projected_stop([r for r, _ in series], [m for _, m in series], _stop(max_rounds=200), fit_rounds=6)
    assert (got["a"], got["b"], got["c"]) == pytest.approx((3.0, 1.5, 0.5), abs=1e-4)
    assert got["holdout_error"] < 1e-4


def test_the_kd_fraction_to_the_best_round_is_undefined_where_no_token_was_trained_by_then(ws):
    """KD tokens / trained tokens over rounds 1..best: 0 / 0 is no fraction (null, as the KD usage ratio of a client
    without a word update: pipeline.results.kd_analysis), not 0 %. By hand: A never validates (best round 0) though
    it trained 100 tokens a round; B (client sampling) is first trained in round 2, its best round is round 1 (the
    round-0 adapter's 4.0); C trained 100 tokens at 20 % KD, then 50 at 80 %, best at round 2: 60 / 150 = 0.4."""
    from pipeline.experiments.plans import read_plan
    from pipeline.training.summary import summarize

    nan = float("nan")
    rows = [
        {"round": 1, "client": "A", "sampled": 1, "n_tokens": 100, "kd_fraction": 0.3, "val_loss": nan},
        {"round": 1, "client": "B", "sampled": 0, "val_loss": 4.0},
        {"round": 1, "client": "C", "sampled": 1, "n_tokens": 100, "kd_fraction": 0.2, "val_loss": 3.0},
        {"round": 2, "client": "A", "sampled": 1, "n_tokens": 100, "kd_fraction": 0.5, "val_loss": nan},
        {"round": 2, "client": "B", "sampled": 1, "n_tokens": 80, "kd_fraction": 0.25, "val_loss": 4.5},
        {"round": 2, "client": "C", "sampled": 1, "n_tokens": 50, "kd_fraction": 0.8, "val_loss": 2.0},
    ]
    kept = [0, 1, 1, 0, 1, 2]  # the round of each reply's client's adapter_best, which the reply reports
    history = [row | {"best_round": b} for row, b in zip(rows, kept, strict=True)]
    clients = summarize(read_plan(write_plan("kd-to-best", "fedselectkd", rounds=2)), history, [])["clients"]
    assert {c: clients[c]["best_round"] for c in "ABC"} == {"A": 0, "B": 1, "C": 2}
    assert clients["A"]["kd_fraction_to_best"] is None and clients["B"]["kd_fraction_to_best"] is None
    assert clients["C"]["kd_fraction_to_best"] == pytest.approx(0.4)


def test_a_clients_recorded_best_round_is_the_round_whose_adapter_it_kept_when_that_rounds_reply_was_lost(ws):
    """A client picks its best adapter by its own validation losses (checkpoints.keep_best_and_final) and reports
    that round with each later reply (server_app._evaluate: best_round); an evaluation reply lost or late (eval_failed,
    no val_loss in the server's row) leaves the server without that round's loss, not the client without its adapter.
    By hand: A's losses 4.0, 3.0 (reply lost), 3.5, 3.6: it kept round 2's adapter (its replies say 2), so the run's
    record says round 2, its loss unknown to the server, and the KD fraction to it covers rounds 1-2 (50 % of 200
    tokens), not round 3 at 3.5 over rounds 1-3. B, every reply received: its lowest loss, round 3."""
    from pipeline.experiments.plans import read_plan
    from pipeline.training.summary import summarize

    a = [(4.0, 1, 0.25), (None, None, 0.75), (3.5, 2, 0.5), (3.6, 2, 0.5)]  # (val_loss, best_round reported, kd)
    history = []
    for r, (val, best, kd) in enumerate(a, start=1):
        row = {"round": r, "client": "A", "sampled": 1, "n_tokens": 100, "kd_fraction": kd}
        history.append(row | ({"val_loss": val, "best_round": best} if val is not None else {"eval_failed": 1}))
        b_best = min(r, 3)
        history.append({"round": r, "client": "B", "val_loss": [5.0, 4.0, 3.0, 3.2][r - 1], "best_round": b_best})
    clients = summarize(read_plan(write_plan("lost-eval-best", "fedselectkd", rounds=4)), history, [])["clients"]
    assert (clients["A"]["best_round"], clients["A"]["best_val_loss"]) == (2, None)
    assert clients["A"]["kd_fraction_to_best"] == pytest.approx(0.5)
    assert (clients["B"]["best_round"], clients["B"]["best_val_loss"]) == (3, 3.0)


def test_the_mean_best_validation_loss_is_not_the_others_mean_where_a_clients_best_is_unknown(ws):
    """metrics.json's mean_best_val_loss is the client average of the best validation losses: where one client's is
    unknown (NaN in every round, or its best round's reply lost) the others' mean would stand in for it (a run whose
    client diverged read as good as its healthy clients), as the stop rule's client average refuses. By hand: A NaN
    in both rounds, B best 3.0: no mean; both known (A 2.0, B 3.0): 2.5."""
    from pipeline.experiments.plans import read_plan
    from pipeline.training.summary import summarize

    plan = read_plan(write_plan("mean-best", "fedselectkd", rounds=2))
    a_losses = {"nan": [float("nan")] * 2, "known": [2.0, 2.5]}
    for case, expected in (("nan", None), ("known", 2.5)):
        history = []
        for r in (1, 2):
            a_best = 0 if case == "nan" else 1
            history.append({"round": r, "client": "A", "val_loss": a_losses[case][r - 1], "best_round": a_best})
            history.append({"round": r, "client": "B", "val_loss": [3.0, 3.5][r - 1], "best_round": 1})
        assert summarize(plan, history, [])["mean_best_val_loss"] == expected, case
