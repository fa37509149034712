"""The set engine (pipeline/training/set_engine.py, pipeline.train.run_set): a run trained inside a set computes what
it computes alone (adapters, best and stop rounds, rounds file, test summaries), and a set killed mid-way resumes to
the uninterrupted result. Tiny BART, CPU, float32 (the workspace of tests/test_federated.py)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from tests.faults import killed_after_checkpoint
from tests.test_federated import _final_adapters, workspace, write_plan, ws  # noqa: F401  (fixtures)

# Runs of different lengths, so the set's barrier loses members while others go on: a stop rule that ends selective
# KD early (converged), FedAvg's fixed 3 rounds, and a serverless run (single) that never parks.
STOP_EARLY = {"enabled": True, "min_rel_improvement": 0.5, "patience": 1, "max_rounds": 4}


def _plans() -> list[Path]:
    return [
        Path(write_plan("set-kd", "fedselectkd", stop=STOP_EARLY)),
        Path(write_plan("set-avg", "fedavg", rounds=3)),
        Path(write_plan("set-single", "single", rounds=2)),
    ]


def _outcome(name: str) -> dict:
    """What a finished run published: its adapters, rounds file, per-client best and stop rounds, test summaries."""
    from pipeline.experiments.plans import read_plan
    from pipeline.modeling.adapters import load_adapter
    from pipeline.results.evaluation import EvaluateConfig, generate_per_run
    from pipeline.training.client_data import read_examples, read_partition
    from pipeline.training.shared_model import shared_model

    plan = read_plan(f"models/plans/{name}.json")
    metrics = json.loads(Path(f"reports/train/{name}/metrics.json").read_text())
    model = shared_model(plan)
    examples = read_examples(plan.paths["examples"])
    cfg = EvaluateConfig(num_beams=2, max_target_length=8, min_target_length=1)
    summaries = {}
    for client, splits in read_partition(plan.paths["partition"])["clients"].items():
        best = Path(f"models/{name}/clients/{client}/adapter_best.safetensors")
        if not best.exists():  # a serverless run has one model
            continue
        sources = examples.loc[splits["test"], "source"].tolist()
        summaries[client] = generate_per_run(model, [load_adapter(best)], [sources], cfg, 32, f"{name} {client}")[0]
    return {
        "adapters": _final_adapters(name),
        "rounds": json.loads(Path(f"models/{name}/rounds.json").read_text()),
        "best": {c: m["best_round"] for c, m in metrics["clients"].items()},
        "stopped": metrics["stopped_round"],
        "summaries": summaries,
    }


def _clear(names: list[str]) -> None:
    for name in names:
        for d in (Path("models") / name, Path("reports/train") / name):
            shutil.rmtree(d, ignore_errors=True)


def _max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[c][k] - b[c][k]).abs().max()) for c in a for k in a[c])


def _assert_same(alone: dict, together: dict) -> None:
    for name in alone:
        a, t = alone[name], together[name]
        assert {c: sorted(s) for c, s in a["adapters"].items()} == {c: sorted(s) for c, s in t["adapters"].items()}
        assert _max_abs_diff(a["adapters"], t["adapters"]) <= 1e-5, name
        assert a["best"] == t["best"] and a["stopped"] == t["stopped"], name
        assert a["summaries"] == t["summaries"], name
        drop = ("seconds",)  # wall time is the one thing a round's record may differ in
        strip = [[{k: v for k, v in r.items() if k not in drop} for r in x["rounds"]] for x in (a, t)]
        assert strip[0] == strip[1], name


def test_a_run_trained_in_a_set_equals_the_run_trained_alone(ws):
    from pipeline.train import run_set
    from pipeline.training import local_batch

    plans = _plans()
    names = [p.stem for p in plans]
    alone = {}
    for plan in plans:
        run_set([plan], track=False)
        alone[plan.stem] = _outcome(plan.stem)
    assert alone["set-kd"]["stopped"] < 4, "the stop rule must end selective KD before its last round"
    assert alone["set-avg"]["stopped"] == 3
    _clear(names)
    before = dict(local_batch.STATS)
    metrics = run_set(plans, track=False)
    assert sorted(metrics) == sorted(names)
    # the two federated runs share seed, clients and batches: their rounds trained as one group, stacked
    groups, runs = (local_batch.STATS[k] - before[k] for k in ("groups", "runs_stacked"))
    assert runs > groups > 0
    _assert_same(alone, {n: _outcome(n) for n in names})


@pytest.mark.slow
def test_a_set_killed_mid_way_resumes_to_the_uninterrupted_result(ws, monkeypatch):
    from pipeline.train import run_set

    plans = _plans()[:2]
    names = [p.stem for p in plans]
    run_set(plans, track=False)
    uninterrupted = {n: _outcome(n) for n in names}
    _clear(names)
    with killed_after_checkpoint(monkeypatch, rnd=1):  # the set dies once a run has written its round-1 checkpoint
        run_set(plans, track=False)
    assert not any(Path("models", n).exists() for n in names)  # nothing published before a run ends
    run_set(plans, track=False)
    _assert_same(uninterrupted, {n: _outcome(n) for n in names})


def test_a_failing_run_stops_its_set_and_closes_the_others(ws, monkeypatch):
    """A run that raises stops the set as a killed process would: the error surfaces, the other runs unwind from
    the barrier (their MLflow runs closed as KILLED), nothing is published."""
    import mlflow

    from pipeline.federation import server_app
    from pipeline.train import run_set

    plans = [Path(write_plan("fail-a", "fedavg")), Path(write_plan("fail-b", "fedavg"))]

    def broken(plan, *args, **kwargs):
        if plan.experiment == "fail-b":
            raise RuntimeError("disk full")
        return real(plan, *args, **kwargs)

    real = server_app.save_server_checkpoint
    monkeypatch.setattr(server_app, "save_server_checkpoint", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        run_set(plans)
    assert not Path("models/fail-a").exists() and not Path("models/fail-b").exists()
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    runs = mlflow.search_runs(experiment_names=["tests"], filter_string="tags.experiment = 'fail-a'")
    assert runs["status"].tolist() == ["KILLED"]
    assert not [t for t in threading.enumerate() if t.name.startswith("run-fail-")]  # every run's thread ended


def test_sigterm_stops_the_whole_set_and_closes_every_run_as_killed(ws, monkeypatch):
    """`kill PID` while one run of a set works and another waits at the barrier: both MLflow runs close as KILLED,
    the stage exits 143, and a rerun resumes them (their run ids stay beside the checkpoints)."""
    import signal

    import mlflow

    from pipeline import train as train_stage
    from pipeline.training.history import TrainRecorder

    write_plan("term-a", "fedavg")
    write_plan("term-b", "fedselectkd")
    real_done = TrainRecorder.round_done

    def done_then_terminated(self, plan, entry, history):
        real_done(self, plan, entry, history)
        if plan.experiment == "term-b":  # term-a has finished its round 1 and waits at the barrier
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(TrainRecorder, "round_done", done_then_terminated)
    with pytest.raises(SystemExit) as stopped:
        train_stage.main(["--experiment", "term-a", "--experiment", "term-b"])
    assert stopped.value.code == 128 + signal.SIGTERM
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    for name in ("term-a", "term-b"):
        runs = mlflow.search_runs(experiment_names=["tests"], filter_string=f"tags.experiment = '{name}'")
        assert runs["status"].tolist() == ["KILLED"], name
    assert not [t for t in threading.enumerate() if t.name.startswith("run-term-")]


@pytest.mark.slow
def test_runs_of_other_seeds_and_serverless_runs_killed_in_a_set_resume_to_each_alone(ws, monkeypatch):
    """Other seeds' rounds train in padded groups and serverless runs resume from their own checkpoint: a set of
    them, killed once a run has written its round-1 checkpoint and rerun, ends with what each computes alone."""
    from pipeline.train import run_set
    from pipeline.training import local_batch

    plans = [
        Path(write_plan("seed-kd", "fedselectkd", rounds=3)),
        Path(write_plan("seed-single", "single", rounds=3)),
        Path(write_plan("seed-pooled", "centralized", rounds=3, local_epochs=2)),
        Path(write_plan("seed-avg", "fedavg", rounds=2)),  # seed 0: its clients' rounds stack padded with seed-kd's
    ]
    for plan in plans[:2]:  # seed 1: other batch orders than the seed-0 runs beside them
        plan.write_text(json.dumps(json.loads(plan.read_text()) | {"seed": 1}, indent=2, sort_keys=True))
    alone = {}
    for plan in plans:
        run_set([plan], track=False)
        alone[plan.stem] = _outcome(plan.stem)
    _clear([p.stem for p in plans])
    padded = []
    stack = local_batch.stack_batches
    monkeypatch.setattr(local_batch, "stack_batches", lambda bs, pad, rows: padded.append(rows) or stack(bs, pad, rows))
    with killed_after_checkpoint(monkeypatch, rnd=1):
        run_set(plans, track=False)
    run_set(plans, track=False)
    assert padded  # seed-kd's and seed-avg's rounds of a client trained in one group
    _assert_same(alone, {p.stem: _outcome(p.stem) for p in plans})
