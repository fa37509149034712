"""MLflow tracking: experiments open in the runs table with a description, runs name their origin (commit, dirty
tree, DVC experiment, plan hash, preset) and their ablation point, a resumed training continues its run, a run
whose process died is closed, artifact locations follow a copied checkout, evaluation logs client-average intervals.

Everything on tmp SQLite stores; trainings on the tiny BART workspace of tests/test_federated.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.errors import names
from tests.faults import killed_after_checkpoint
from tests.test_federated import MODEL, TRAIN, workspace, write_plan  # noqa: F401  (fixtures)


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty checkout-like root with its own store (no git: git-derived tags stay absent)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDMEET_ROOT", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    for var in ("DVC_EXP_NAME", "DVC_EXP_BASELINE_REV"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def _client():
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])


def _client_run(parent: str, client: str) -> str:
    """The run of ``client`` under the experiment's run ``parent``."""
    exp = _client().get_run(parent).info.experiment_id
    [run] = _client().search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent}' and tags.client = '{client}'")
    return run.info.run_id


def _use_checkout(root: Path, monkeypatch) -> None:
    monkeypatch.chdir(root)
    monkeypatch.setenv("FEDMEET_ROOT", str(root))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")


# ------------------------------------------------------------------------------------------ experiment view
@pytest.mark.slow
def test_new_and_existing_experiments_open_in_the_runs_table_with_a_description(store):
    from pipeline.results.evaluation import study_description
    from pipeline.results.tracking import experiment_id

    client = _client()
    old = client.create_experiment("tau_sweep")  # as an earlier fedmeet left it: no kind, no description
    assert experiment_id("tau_sweep") == old
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"
    assert "mlflow.note.content" not in client.get_experiment(old).tags  # training describes no study
    for study, section in (("tau_sweep", "7.6"), ("main", "7.1"), ("my-study", "7")):
        tags = client.get_experiment(experiment_id(study, study_description(study))).tags
        # The value MLflow 3.17's UI bundle maps to the model-training (runs table) view.
        assert tags["mlflow.experimentKind"] == "custom_model_development"
        assert f"`{study}`" in tags["mlflow.note.content"]
        assert f"METHOD.md section {section}" in tags["mlflow.note.content"]


# ------------------------------------------------------------------------------------------ run names
def _params(tau: float = 5.0, **entry) -> dict:
    return {
        "tau": tau,
        "model": dict(MODEL),
        "train": dict(TRAIN),
        "experiments": {
            "fedselectkd-domain": {"method": "fedselectkd", "partition": "domain/seed0", **entry},
            "fedavg-domain": {"method": "fedavg", "partition": "domain/seed0"},
        },
    }


def test_run_name_is_the_experiment_with_its_dvc_experiment(monkeypatch):
    from pipeline.results.tracking import run_name

    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    assert run_name("fedselectkd-domain") == "fedselectkd-domain"
    monkeypatch.setenv("DVC_EXP_NAME", "tau-three")  # what `dvc exp run -n tau-three -S tau=3` sets
    assert run_name("fedselectkd-domain") == "fedselectkd-domain [tau-three]"


def _git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout


def test_provenance_tags_from_git_and_dvc(tmp_path, monkeypatch):
    from pipeline.experiments.plans import read_plan
    from pipeline.planning import check_params, write_plans
    from pipeline.results.tracking import dvc_tags, git_state
    from pipeline.train import run_tags

    monkeypatch.chdir(tmp_path)
    for var in ("DVC_EXP_NAME", "DVC_EXP_BASELINE_REV"):
        monkeypatch.delenv(var, raising=False)
    _git(tmp_path, "init", "-q")
    Path("params.yaml").write_text(yaml.safe_dump(_params()))
    Path("dvc.lock").write_text("schema: '2.0'\n")
    _git(tmp_path, "add", "params.yaml", "dvc.lock")
    _git(tmp_path, "commit", "-qm", "base")
    base_rev = _git(tmp_path, "rev-parse", "HEAD").strip()

    Path("dvc.lock").write_text("schema: '2.0'\nstages: {}\n")  # `dvc repro` rewrites it: not a dirty tree
    assert git_state() == {"git.commit": base_rev, "mlflow.source.git.commit": base_rev, "git.dirty": "false"}
    assert dvc_tags() == {}

    # What `dvc exp run -S tau=3` leaves in its workspace, with DVC's variables set.
    Path("params.yaml").write_text(yaml.safe_dump(_params(tau=3.0)))
    _git(tmp_path, "commit", "-qam", "another commit after the baseline")  # HEAD moves; the baseline does not
    Path("params.yaml").write_text(yaml.safe_dump(_params(tau=3.0, lr=1.0e-4)))
    monkeypatch.setenv("DVC_EXP_NAME", "tau-three")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", base_rev)
    write_plans(check_params(yaml.safe_load(Path("params.yaml").read_text())), Path("models/plans"))
    plan_path = Path("models/plans/fedselectkd-domain.json")
    plan = read_plan(plan_path)
    tags = run_tags(plan)
    assert tags["git.commit"] == _git(tmp_path, "rev-parse", "HEAD").strip()
    assert tags["git.dirty"] == "true" and tags["git.changed"] == "params.yaml"
    assert tags["dvc.exp_name"] == "tau-three" and tags["dvc.baseline_rev"] == base_rev
    assert tags["plan_hash"] == plan.hash and len(tags["plan_hash"]) == 64
    assert "preset" not in tags  # the run profile is no part of training


# ------------------------------------------------------------------------------------------ dead runs
def _dead_pid() -> tuple[int, float]:
    import psutil

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(proc.pid).create_time()
    proc.wait()
    return proc.pid, started


@pytest.mark.slow
def test_a_run_whose_process_died_is_killed_at_the_next_start_of_that_experiment(store):
    from pipeline.results.tracking import TAG_HOST, TAG_PID, TAG_PID_START, RunLogger, experiment_id, owner_tags

    client = _client()
    exp = experiment_id("s")
    pid, started = _dead_pid()
    host = socket.gethostname()

    def running(experiment: str, owner: dict[str, str]) -> str:
        return client.create_run(exp, tags={"experiment": experiment, **owner}).info.run_id

    dead = running("a", {TAG_HOST: host, TAG_PID: str(pid), TAG_PID_START: f"{started:.3f}"})
    untagged = running("a", {})  # left by an older fedmeet: nothing will ever finish it
    # Our own pid with another start time: the pid was reused, the owner is gone.
    reused = running("a", {TAG_HOST: host, TAG_PID: str(os.getpid()), TAG_PID_START: "1.000"})
    alive = running("a", owner_tags())  # a live process (this one) still owns it
    elsewhere = running("a", {TAG_HOST: host + "-other", TAG_PID: str(pid), TAG_PID_START: "1.0"})
    other_experiment = running("b", {TAG_HOST: host, TAG_PID: str(pid), TAG_PID_START: f"{started:.3f}"})

    new = RunLogger.start("s", "a", {"x": 1}, {"experiment": "a"})
    status = {
        r: client.get_run(r).info.status
        for r in (dead, untagged, reused, alive, elsewhere, other_experiment, new.run_id)
    }
    assert status == {
        dead: "KILLED",
        untagged: "KILLED",
        reused: "KILLED",
        alive: "RUNNING",
        elsewhere: "RUNNING",
        other_experiment: "RUNNING",
        new.run_id: "RUNNING",
    }
    assert client.get_run(new.run_id).data.tags[TAG_PID] == str(os.getpid())


@pytest.mark.slow
def test_a_run_marked_killed_from_outside_closes_its_clients_runs_too(store):
    """The local command marks KILLED a deployed server's run its killed ServerApp left RUNNING (end_if_running);
    docs/mlflow.md: the run is closed "and its clients' runs". A client run left RUNNING is closed by nothing after:
    the next start marks only RUNNING experiment runs, and their clients."""
    from pipeline.results.tracking import RunLogger, end_if_running

    server = RunLogger.start("s", "a", {"x": 1}, {"experiment": "a"}, clients=("c1", "c2"))
    server._monitor.finish()  # the ServerApp dies: nothing ends its runs
    assert end_if_running(server.run_id, "interrupted")
    runs = [server.run_id, _client_run(server.run_id, "c1"), _client_run(server.run_id, "c2")]
    assert [_client().get_run(r).info.status for r in runs] == ["KILLED"] * 3
    assert not end_if_running(server.run_id, "again")


@pytest.mark.slow
def test_a_rerun_whose_killed_run_was_deleted_starts_a_new_run(store):
    """A killed run deleted by hand (the UI's Delete) before the rerun: MLflow refuses to update a deleted run, so the
    rerun must open a new active run (its id written to the run id file), not fail on reopening the deleted one."""
    from pipeline.results.tracking import RunLogger

    run_id_file = store / "mlflow_run_id"
    first = RunLogger.start("s", "a", {"x": 1}, {"experiment": "a"}, run_id_file, clients=("c1",))
    first.finish("KILLED")
    _client().delete_run(first.run_id)
    again = RunLogger.start("s", "a", {"x": 1}, {"experiment": "a"}, run_id_file, clients=("c1",))
    info = _client().get_run(again.run_id).info
    assert again.run_id != first.run_id and (info.status, info.lifecycle_stage) == ("RUNNING", "active")
    assert run_id_file.read_text() == again.run_id
    again.finish()


@pytest.mark.slow
def test_a_deleted_study_experiment_is_one_line_naming_it_and_the_store(store, capsys):
    """The study's MLflow experiment deleted in the UI: MLflow keeps its name, so no new one can be made and no run
    logged into it; the stage ends in one line naming the study and the store, not a traceback."""
    from pipeline.common.cli import run as run_cli
    from pipeline.results.tracking import RunLogger

    _client().delete_experiment(_client().create_experiment("gone"))

    def start(argv):
        RunLogger.start("gone", "a", {"x": 1}, {"experiment": "a"})

    assert run_cli(start, []) == 2
    names(capsys.readouterr().err.strip().splitlines()[-1], "error: ", "'gone'", "deleted", str(store / "mlflow.db"))


@pytest.mark.slow
def test_scoring_a_mistyped_logged_model_id_is_one_line_naming_it(store, capsys):
    """`python -m pipeline.evaluate model m-<id>` with an id the store does not hold: one line naming the id and the
    store, exit 2, not MLflow's traceback."""
    from pipeline.common.cli import run as run_cli
    from pipeline.results.tracking import download_model

    _client()  # the store exists, without that model
    assert run_cli(lambda argv: download_model("models:/m-0123456789abcdef", store / "x"), []) == 2
    names(capsys.readouterr().err.strip().splitlines()[-1], "error: ", "m-0123456789abcdef", str(store / "mlflow.db"))


@pytest.fixture
def ws(workspace, monkeypatch):  # noqa: F811
    _use_checkout(workspace, monkeypatch)
    for var in ("DVC_EXP_NAME", "DVC_EXP_BASELINE_REV"):
        monkeypatch.delenv(var, raising=False)
    return workspace


def _killed_then_rerun(monkeypatch, name: str, method: str, owner, attr: str, dying) -> tuple:
    """Train ``name`` with ``owner.attr`` replaced by ``dying`` (which raises tests.faults.Killed), then again with
    it restored: the experiment's one MLflow run after the kill, and after the rerun."""
    from pipeline.train import run_experiment
    from tests.faults import Killed

    path, real = write_plan(name, method), getattr(owner, attr)
    monkeypatch.setattr(owner, attr, dying(real))
    with pytest.raises(Killed):
        run_experiment(path)
    monkeypatch.setattr(owner, attr, real)
    client = _client()
    exp, query = client.get_experiment_by_name("tests").experiment_id, f"tags.experiment = '{name}'"
    [first] = client.search_runs([exp], query)
    run_experiment(path)
    [run] = client.search_runs([exp], query)  # one run: resumed, or the killed one deleted
    return first, run


@pytest.mark.slow
def test_resumed_training_continues_its_mlflow_run(ws, monkeypatch):
    from pipeline.training.history import TrainRecorder
    from tests.faults import Killed

    def dying(real_done):
        def done_then_die(self, plan, entry, history):
            real_done(self, plan, entry, history)
            if entry.round == 1:
                raise Killed("simulated kill after round 1")

        return done_then_die

    first, run = _killed_then_rerun(monkeypatch, "mlflow-resume", "fedavg", TrainRecorder, "round_done", dying)
    assert first.info.status == "KILLED"
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"  # the same run, not a second one
    assert run.data.tags["fedmeet.resumed"] == "true"
    academic = _client_run(run.info.run_id, "Academic")  # the same client run too
    assert _client().get_run(academic).info.status == "FINISHED"
    assert [m.step for m in _client().get_metric_history(academic, "val_loss")] == [1, 2]


@pytest.mark.slow
def test_a_rerun_after_a_kill_before_the_first_checkpoint_leaves_one_run(ws, monkeypatch):
    """Killed in round 1, before any checkpoint: the rerun starts over with a new run (nothing to resume), and the
    killed attempt, which holds no round, is deleted with its client runs, as a deployed server's retry does
    (docs/federation.md): the runs table holds one run of the experiment, not a dead attempt beside it."""
    from pipeline.federation import server_app
    from tests.faults import Killed

    def dying(_real):
        def die(*args, **kwargs):
            raise Killed("simulated kill in round 1, before its checkpoint")

        return die

    where = (server_app, "save_server_checkpoint")
    killed, run = _killed_then_rerun(monkeypatch, "mlflow-early", "fedavg", *where, dying)
    assert run.info.status == "FINISHED" and run.info.run_id != killed.info.run_id
    exp = _client().get_experiment_by_name("tests").experiment_id
    children = _client().search_runs([exp], f"tags.`mlflow.parentRunId` = '{killed.info.run_id}'")
    assert children == []  # the dead attempt's client runs are gone too


@pytest.mark.slow
def test_a_round_checkpointed_but_not_logged_before_a_kill_reaches_the_resumed_run(ws, monkeypatch):
    from pipeline.train import run_experiment

    path = write_plan("mlflow-gap", "fedavg")
    with killed_after_checkpoint(monkeypatch, rnd=1):  # before round 1's metrics were logged
        run_experiment(path)
    client = _client()
    exp = client.get_experiment_by_name("tests").experiment_id
    [killed] = client.search_runs([exp], "tags.experiment = 'mlflow-gap'")
    assert client.get_metric_history(_client_run(killed.info.run_id, "Academic"), "val_loss") == []

    run_experiment(path)  # resumes at round 2: round 1 is not trained again
    [run] = client.search_runs([exp], "tags.experiment = 'mlflow-gap'")
    rounds = json.loads(Path("models/mlflow-gap/rounds.json").read_text())
    expected = {r["round"]: r["val_loss"] for r in rounds if r["client"] == "Academic"}
    history = client.get_metric_history(_client_run(run.info.run_id, "Academic"), "val_loss")
    assert {m.step: m.value for m in history} == pytest.approx(expected) and len(history) == 2  # once each


@pytest.mark.slow
def test_a_kill_while_the_finished_training_is_recorded_closes_the_run_as_killed(ws, monkeypatch):
    """docs/mlflow.md: Ctrl-C or SIGTERM closes the run and its clients' runs as KILLED at once, also when it comes
    after the last round, while the outputs are recorded and uploaded; the rerun then finishes that same run."""
    from pipeline import train as train_stage

    path = write_plan("mlflow-closing", "fedavg")
    real = train_stage.log_run_outputs

    def upload_then_die(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the adapters are uploaded

    monkeypatch.setattr(train_stage, "log_run_outputs", upload_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_stage.run_experiment(path)
    monkeypatch.setattr(train_stage, "log_run_outputs", real)
    client = _client()
    exp = client.get_experiment_by_name("tests").experiment_id
    [run] = client.search_runs([exp], "tags.experiment = 'mlflow-closing'")
    assert run.info.status == "KILLED"
    assert client.get_run(_client_run(run.info.run_id, "Academic")).info.status == "KILLED"
    train_stage.run_experiment(path)
    [again] = client.search_runs([exp], "tags.experiment = 'mlflow-closing'")
    assert (again.info.run_id, again.info.status) == (run.info.run_id, "FINISHED")


def test_sigterm_closes_the_run_as_killed(ws, monkeypatch):
    import signal

    from pipeline import plan as plan_stage
    from pipeline import train as train_stage
    from pipeline.training.history import TrainRecorder

    params = {
        "tau": 5.0,
        "model": dict(MODEL),
        "train": dict(TRAIN),
        "experiments": {"sigterm": {"method": "single", "partition": "domain/seed0", "study": "tests"}},
    }
    Path("params.yaml").write_text(yaml.safe_dump(params))
    plan_stage.main(["--params", "params.yaml"])
    real_done = TrainRecorder.round_done

    def done_then_terminated(self, plan, entry, history):
        real_done(self, plan, entry, history)
        os.kill(os.getpid(), signal.SIGTERM)  # what `kill PID` does to the stage process

    monkeypatch.setattr(TrainRecorder, "round_done", done_then_terminated)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        train_stage.main(["--experiment", "sigterm"])
    assert stopped.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the stage's only while it trains
    client = _client()
    [run] = client.search_runs([client.get_experiment_by_name("tests").experiment_id], "tags.experiment = 'sigterm'")
    assert run.info.status == "KILLED"
    from pipeline.experiments.plans import read_plan
    from pipeline.training.checkpoints import mlflow_run_id_path

    run_id_file = mlflow_run_id_path(read_plan("models/plans/sigterm.json"))
    assert run_id_file.read_text() == run.info.run_id  # a rerun resumes it


@pytest.mark.slow
def test_artifacts_follow_a_copied_checkout(ws, tmp_path, monkeypatch):
    from mlflow.utils.file_utils import local_file_uri_to_path

    from pipeline.train import run_experiment

    first = tmp_path / "first"
    shutil.copytree(ws, first, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts", "models"))
    shutil.copytree(ws / "models" / "backbone", first / "models" / "backbone")
    _use_checkout(first, monkeypatch)
    run_experiment(write_plan("moved", "single"))
    client = _client()
    [old_run] = client.search_runs([client.get_experiment_by_name("tests").experiment_id], "tags.experiment = 'moved'")

    copy = tmp_path / "copy"
    shutil.copytree(first, copy)  # mlflow.db and mlartifacts/ travel with the checkout
    _use_checkout(copy, monkeypatch)
    run_experiment(write_plan("moved-again", "single"))
    client = _client()
    exp = client.get_experiment_by_name("tests")
    assert Path(local_file_uri_to_path(exp.artifact_location)) == copy / "mlartifacts" / "tests"
    [new_run] = client.search_runs([exp.experiment_id], "tags.experiment = 'moved-again'")
    adapters = copy / "mlartifacts" / "tests" / new_run.info.run_id / "artifacts" / "adapters" / "Academic"
    assert sorted(p.name for p in adapters.iterdir()) == ["adapter_best.safetensors", "adapter_final.safetensors"]
    assert not (first / "mlartifacts" / "tests" / new_run.info.run_id).exists()
    # The earlier run's artifacts are read from the copy too (the UI of the copy shows the copy's files).
    old = client.get_run(old_run.info.run_id)
    assert Path(local_file_uri_to_path(old.info.artifact_uri)).is_relative_to(copy)
    assert {a.path for a in client.list_artifacts(old.info.run_id, "adapters/Academic")} == {
        "adapters/Academic/adapter_best.safetensors",
        "adapters/Academic/adapter_final.safetensors",
    }
    # The original checkout's store still points at its own folder.
    _use_checkout(first, monkeypatch)
    exp_first = _client().get_experiment_by_name("tests")
    assert Path(local_file_uri_to_path(exp_first.artifact_location)) == first / "mlartifacts" / "tests"


@pytest.mark.slow
def test_a_store_outside_the_checkout_keeps_its_locations(store, tmp_path, monkeypatch):
    from pipeline.results.tracking import experiment_id

    shared = tmp_path / "shared-store"
    shared.mkdir()
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.setenv("FEDMEET_ROOT", str(checkout))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{shared / 'mlflow.db'}")
    elsewhere = (tmp_path / "other-checkout" / "mlartifacts" / "s").resolve()
    exp = _client().create_experiment("s", artifact_location=elsewhere.as_uri())
    assert experiment_id("s") == exp
    assert _client().get_experiment(exp).artifact_location == elsewhere.as_uri()


# ------------------------------------------------------------------------------------------ evaluation
def _eval_dir(tmp_path: Path, name: str) -> tuple[dict, Path]:
    d = tmp_path / "eval" / name
    d.mkdir(parents=True)
    clients = {
        c: {"rouge1": 20.0 + i, "rouge2": 5.0, "rougeL": 15.0, "rougeLsum": 16.0, "avg_rouge": 14.0, "n": 4}
        for i, c in enumerate(("Academic", "Committee"))
    }
    mean = {"rouge1": 20.5, "rouge2": 5.0, "rougeL": 15.0, "rougeLsum": 16.0, "avg_rouge": 14.0}
    ci = {k: {"low": v - 1.5, "high": v + 2.0} for k, v in mean.items()}
    metrics = {"experiment": name, "backbone": "tiny-bart", "clients": clients, "mean": mean, "mean_ci": ci}
    (d / "metrics.json").write_text(json.dumps(metrics))
    (d / "predictions.jsonl").write_text(json.dumps({"prediction": "a private summary"}) + "\n")
    return metrics, d


@pytest.mark.slow
def test_evaluation_logs_into_the_run_of_its_plan_with_intervals(store):
    from pipeline.experiments.plans import record_hash
    from pipeline.results.evaluation import EvaluateConfig, log_to_mlflow
    from pipeline.results.tracking import RunLogger

    record_tau3 = {"experiment": "sel", "study": "s", "method": "fedselectkd", "partition": "domain/seed0", "tau": 3.0}
    record_tau4 = {**record_tau3, "tau": 4.0}
    runs = {}
    for record in (record_tau3, record_tau4):  # tau=4 trained last: the newest run of experiment "sel"
        logger = RunLogger.start(
            "s",
            f"sel tau={record['tau']:g}",
            {},
            {"experiment": "sel", "plan_hash": record_hash(record)},
            clients=("Academic", "Committee"),
        )
        logger.finish()
        runs[record["tau"]] = logger
    metrics, d = _eval_dir(store, "sel")
    assert log_to_mlflow(record_tau3, metrics, d, EvaluateConfig()) == runs[3.0].run_id
    logged = _client().get_run(runs[3.0].run_id).data.metrics
    # Headline: client averages with the evaluation's intervals; ROUGE-L is the tables' (plain rougeL, 15.0).
    headline = {k.removeprefix("client_avg/"): v for k, v in logged.items() if k.startswith("client_avg/")}
    assert headline == {
        "ROUGE-1": 20.5,
        "ROUGE-1_ci_low": 19.0,
        "ROUGE-1_ci_high": 22.5,
        "ROUGE-2": 5.0,
        "ROUGE-2_ci_low": 3.5,
        "ROUGE-2_ci_high": 7.0,
        "ROUGE-L": 15.0,
        "ROUGE-L_ci_low": 13.5,
        "ROUGE-L_ci_high": 17.0,
        "avg_ROUGE": 14.0,
        "avg_ROUGE_ci_low": 12.5,
        "avg_ROUGE_ci_high": 16.0,
    }
    assert set(logged) == {f"client_avg/{k}" for k in headline}  # each client's scores are in its own run
    committee = _client().get_run(runs[3.0].children["Committee"]).data.metrics
    assert committee == {"rouge1": 21.0, "rouge2": 5.0, "rougeL": 15.0, "rougeLsum": 16.0, "avg_rouge": 14.0}
    for run_id in (runs[4.0].run_id, *runs[4.0].children.values()):
        assert not _client().get_run(run_id).data.metrics  # another plan's runs: nothing logged there
    # Privacy: the generated summaries stay on disk unless asked for.
    assert [a.path for a in _client().list_artifacts(runs[3.0].run_id, "eval")] == ["eval/metrics.json"]


@pytest.mark.slow
def test_a_federated_evaluation_asked_for_its_text_logs_its_scores_without_any(store):
    """The deployed federation's evaluation (pipeline.federation.deployment) holds no summaries: they stay on the
    clients. With ``log_text_to_mlflow`` (the params' evaluate group is its decoding) there is no predictions.jsonl to
    log, and the record still goes to MLflow (it was a FileNotFoundError before the run could finish)."""
    from pipeline.results.evaluation import EvaluateConfig, log_to_mlflow

    metrics, d = _eval_dir(store, "fed")
    (d / "predictions.jsonl").unlink()  # as deployment.write_eval_metrics leaves the folder: metrics.json alone
    run_id = log_to_mlflow({"experiment": "fed", "study": "s"}, metrics, d, EvaluateConfig(log_text_to_mlflow=True))
    assert _client().get_run(run_id).data.metrics["client_avg/ROUGE-1"] == 20.5
    assert [a.path for a in _client().list_artifacts(run_id, "eval")] == ["eval/metrics.json"]


@pytest.mark.slow
def test_a_federated_evaluation_no_client_answered_is_logged_without_headline_numbers(store):
    """Every client timed out on the federated evaluation (beam search over a whole test set can outlast the round
    timeout): metrics_record's client mean is None for each score, and the run is still logged (it was a TypeError
    in float(None) before the run was marked FINISHED)."""
    from pipeline.results.evaluation import EvaluateConfig, log_to_mlflow, metrics_record

    plan = SimpleNamespace(experiment="fed", method="fedavg", partition="domain/seed0", seed=0, study="s")
    plan.model_config = SimpleNamespace(max_source_length=512)
    metrics = metrics_record(plan, "tiny-bart", EvaluateConfig(), {}, {}) | {"failed_clients": {"node 1": "no reply"}}
    (d := store / "eval" / "fed").mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps(metrics))
    run_id = log_to_mlflow({"experiment": "fed", "study": "s"}, metrics, d, EvaluateConfig())
    assert not [k for k in _client().get_run(run_id).data.metrics if k.startswith("client_avg/")]


@pytest.mark.slow
def test_import_eval_logs_records_computed_without_mlflow(store, capsys):
    from pipeline.common.cli import run as run_cli
    from pipeline.evaluate import main

    metrics, d = _eval_dir(store, "offline")
    metrics["decoding"] = {"num_beams": 4, "batch_size": 8, "max_source_length": 512}
    (d / "metrics.json").write_text(json.dumps(metrics))
    assert run_cli(main, ["import-eval", "--study", "imported", str(d / "metrics.json")]) == 0
    client = _client()
    [run] = client.search_runs([client.get_experiment_by_name("imported").experiment_id], "tags.experiment = 'offline'")
    assert run.info.run_name == "offline"
    assert run.data.metrics["client_avg/ROUGE-1_ci_high"] == 22.5
    children = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'")
    assert {c.data.tags["client"]: c.data.metrics["rouge1"] for c in children} == {"Academic": 20.0, "Committee": 21.0}
    assert run.data.tags["evaluate.num_beams"] == "4"  # the record's own decoding settings, not the defaults
    assert [a.path for a in client.list_artifacts(run.info.run_id, "eval")] == ["eval/metrics.json"]
    (d / "broken.json").write_text(json.dumps({"experiment": "x"}))
    capsys.readouterr()
    assert run_cli(main, ["import-eval", str(d / "broken.json")]) == 2
    names(capsys.readouterr().err, str(d / "broken.json"), "'clients'", "'mean'")


@pytest.mark.slow
def test_import_eval_logs_into_the_training_run_its_record_names(store):
    """An evaluation computed without MLflow (`evaluate run --no-mlflow`) of a run trained with it goes into that
    training run, found by what the record says (experiment, method, partition, seed; it carries no plan): it was
    looked up by the hash of those four keys, which no plan has, so it always went into a new run beside its
    training's. Two training runs of one identity (ablation points of one name) name no run: a new one."""
    from pipeline.common.cli import run as run_cli
    from pipeline.evaluate import main
    from pipeline.results.tracking import RunLogger

    identity = {"method": "fedavg", "partition": "domain/seed0", "seed": "0", "study": "s"}
    trained = {}
    for name, seed, plan in (("offline", "0", "a"), ("offline", "1", "b"), ("swept", "0", "t3"), ("swept", "0", "t4")):
        tags = identity | {"experiment": name, "seed": seed, "plan_hash": plan}
        trained[plan] = RunLogger.start("s", name, {}, tags, clients=("Academic", "Committee"))
        trained[plan].finish()
    records = []
    for name in ("offline", "swept"):
        metrics, d = _eval_dir(store, name)
        (d / "metrics.json").write_text(json.dumps(metrics | identity | {"seed": 0}))  # as metrics_record writes it
        records.append(str(d / "metrics.json"))
    for _ in range(2):  # again: the first import's run of "swept" (no plan) is no third ablation point
        assert run_cli(main, ["import-eval", *records]) == 0
    client = _client()
    assert client.get_run(trained["a"].run_id).data.metrics["client_avg/ROUGE-1"] == 20.5
    assert client.get_run(trained["a"].children["Committee"]).data.metrics["rouge1"] == 21.0
    for plan in ("b", "t3", "t4"):  # another seed's run; the ablation points
        assert not client.get_run(trained[plan].run_id).data.metrics
    exp_id, old = client.get_experiment_by_name("s").experiment_id, {t.run_id for t in trained.values()}
    new = [r for r in client.search_runs([exp_id], "tags.experiment LIKE '%'") if r.info.run_id not in old]
    assert [(r.data.tags["experiment"], r.data.metrics["client_avg/ROUGE-1"]) for r in new] == [("swept", 20.5)] * 2


# ------------------------------------------------------------------------------------------ clients and models
@pytest.mark.slow
def test_each_client_has_a_run_and_its_best_adapter_is_a_logged_model_scored_by_the_evaluation(
    ws, monkeypatch, tmp_path, capsys
):
    import mlflow
    from safetensors.torch import load_file

    from pipeline.evaluate import main
    from pipeline.results.evaluation import EvaluateConfig
    from pipeline.results.experiment_evaluation import evaluate_experiments
    from pipeline.results.stats import BootstrapConfig
    from pipeline.train import run_experiment

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")  # MLflow's own setting (default 10 s)
    run_experiment(write_plan("models-fedavg", "fedavg"))
    cfg = EvaluateConfig(num_beams=1, max_target_length=8, min_target_length=2, batch_size=2)
    scores = evaluate_experiments(
        ["models-fedavg"], cfg, eval_dir=tmp_path / "eval", bootstrap=BootstrapConfig(n_resamples=100)
    )["models-fedavg"]["clients"]
    client = _client()
    exp = client.get_experiment_by_name("tests").experiment_id
    [parent] = client.search_runs([exp], "tags.experiment = 'models-fedavg'")
    assert any(k.startswith("system/") for k in parent.data.metrics)  # CPU, memory, disk of the training
    children = {
        r.data.tags["client"]: r
        for r in client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    }
    rounds = json.loads(Path("models/models-fedavg/rounds.json").read_text())
    partition = json.loads(Path("data/partitions/domain/seed0.json").read_text())["clients"]
    assert sorted(children) == sorted(partition) == sorted(scores)
    models = mlflow.search_logged_models(
        experiment_ids=[exp], filter_string="tags.experiment = 'models-fedavg'", output_format="list"
    )
    assert sorted(m.tags["client"] for m in models) == sorted(partition)
    for m in models:
        name, run = m.tags["client"], children[m.tags["client"]]
        assert run.info.status == "FINISHED" and m.source_run_id == run.info.run_id
        # per-round values without the client prefix, as rounds.json has them
        history = client.get_metric_history(run.info.run_id, "val_loss")
        assert {h.step: h.value for h in history} == pytest.approx(
            {r["round"]: r["val_loss"] for r in rounds if r["client"] == name}
        )
        # the model's metrics: its test ROUGE (the evaluation's) and its train split, each on its dataset
        by_key = {x.key: x for x in m.metrics}
        assert by_key["avg_rouge"].value == pytest.approx(scores[name]["avg_rouge"])
        assert by_key["avg_rouge"].dataset_name == f"domain/seed0/{name}/test"
        assert by_key["train_examples"].value == len(partition[name]["train"])
        [train] = [i.dataset for i in run.inputs.dataset_inputs if i.dataset.name.endswith("/train")]
        assert train.name == f"domain/seed0/{name}/train" and train.digest == by_key["train_examples"].dataset_digest
        # the model is the best adapter, nothing else of the client's (no text, no gate log)
        files = {f.path for f in client.list_logged_model_artifacts(m.model_id, f"adapters/{name}")}
        assert files == {f"adapters/{name}/adapter_best.safetensors"}
        folder = mlflow.artifacts.download_artifacts(f"models:/{m.model_id}", dst_path=str(tmp_path / name))
        got = load_file(Path(folder) / "adapters" / name / "adapter_best.safetensors")
        want = load_file(f"models/models-fedavg/clients/{name}/adapter_best.safetensors")
        assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)

    # `python -m pipeline.evaluate model models:/<id>` scores that adapter as the evaluation did
    params = tmp_path / "params.yaml"
    params.write_text(
        yaml.safe_dump(
            {
                "evaluate": {"num_beams": 1, "max_target_length": 8, "min_target_length": 2, "batch_size": 2},
                "bootstrap": {"n_resamples": 100},
            }
        )
    )
    m = models[0]
    capsys.readouterr()
    assert main(["model", f"models:/{m.model_id}", "--params", str(params)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["client"] == m.tags["client"] and out["avg_rouge"] == pytest.approx(scores[out["client"]]["avg_rouge"])
    assert out["n"] == scores[out["client"]]["n"]


# killed during A's upload (its model left PENDING), or during B's (A's already READY: not logged a second time)
@pytest.mark.parametrize("dies_at", [1, 2])
def test_a_rerun_after_a_kill_while_logging_models_leaves_one_model_per_client(store, monkeypatch, dies_at):
    from pipeline.results.tracking import RunLogger

    model_dir = store / "models" / "e"
    for c in ("A", "B"):
        (model_dir / "clients" / c).mkdir(parents=True)
        (model_dir / "clients" / c / "adapter_best.safetensors").write_bytes(c.encode())
    plan = {"experiment": "e", "method": "fedavg", "partition": "domain", "seed": 0, "study": "tests"}
    (model_dir / "experiment.json").write_text(json.dumps(plan))
    run_file = store / "run_id"
    logger = RunLogger.start("tests", "e", {}, {"experiment": "e"}, run_file, clients=("A", "B"))
    real = logger._client.log_model_artifact
    calls = iter(range(100))

    def dying(*args, **kwargs):
        if next(calls) == dies_at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(logger._client, "log_model_artifact", dying)
    with pytest.raises(KeyboardInterrupt):
        logger.log_adapter_models(model_dir)
    logger.finish("KILLED")
    logger = RunLogger.start("tests", "e", {}, {"experiment": "e"}, run_file, clients=("A", "B"))
    logger.log_adapter_models(model_dir)
    logger.finish()
    exp = _client().get_experiment_by_name("tests").experiment_id
    models = _client().search_logged_models([exp])
    assert sorted(m.tags["client"] for m in models) == ["A", "B"]
    assert all(str(m.status).endswith("READY") for m in models)


def test_a_store_that_is_no_sqlite_database_is_one_line_naming_it(store, capsys):
    """MLFLOW_TRACKING_URI naming a file that is no SQLite database (a typo, a damaged mlflow.db): before, SQLAlchemy's
    DatabaseError traceback from every command that logs to MLflow; now one line naming the store."""
    from pipeline.common.cli import run as run_cli
    from pipeline.results.tracking import experiment_id

    (store / "mlflow.db").write_text("not a database\n")
    assert run_cli(lambda argv: experiment_id("tests"), []) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(store / "mlflow.db") in err and "not a database" in err, err


def test_scoring_a_deployed_runs_global_model_is_refused_in_one_line(store):
    """docs/mlflow.md: `evaluate model` scores a client's LoggedModel on that client's test subsample. A deployed
    server's `<experiment>-global` (adapters/global/global_adapter.safetensors) has no client nor test set: it was
    downloaded, then the evaluation said the partition had no client with test examples."""
    from pipeline.common.config import ConfigError
    from pipeline.results.tracking import RunLogger, download_model

    model_dir = store / "models" / "e"
    (model_dir / "clients" / "A").mkdir(parents=True)
    (model_dir / "clients" / "A" / "adapter_best.safetensors").write_bytes(b"A")
    (model_dir / "global_adapter.safetensors").write_bytes(b"G")
    plan = {"experiment": "e", "method": "fedavg", "partition": "domain", "seed": 0, "study": "tests"}
    (model_dir / "experiment.json").write_text(json.dumps(plan))
    logger = RunLogger.start("tests", "e", {}, {"experiment": "e"}, clients=("A",))
    logger.log_adapter_models(model_dir, global_adapter=model_dir / "global_adapter.safetensors")
    logger.finish()
    with pytest.raises(ConfigError, match=f"{logger.models['global']}: .*global"):
        download_model(logger.models["global"], store / "x")
    assert download_model(logger.models["A"], store / "x")["client"] == "A"


def test_a_resumed_run_whose_tree_became_clean_drops_its_changed_files(store):
    from pipeline.results.tracking import RunLogger

    run_file = store / "run_id"
    dirty = {"experiment": "e", "git.dirty": "true", "git.changed": "params.yaml"}
    RunLogger.start("tests", "e", {}, dirty, run_file, clients=("A",)).finish("KILLED")
    logger = RunLogger.start("tests", "e", {}, {"experiment": "e", "git.dirty": "false"}, run_file, clients=("A",))
    logger.finish()
    tags = _client().get_run(logger.run_id).data.tags
    assert tags["git.dirty"] == "false" and "git.changed" not in tags


def test_the_mlflow_docs_system_metrics_interval_is_mlflows_default_we_keep():
    """docs/mlflow.md: system metrics "sampled every 10 s (`MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL` changes it)":
    RunLogger starts MLflow's monitor without an interval of its own, so MLflow's default applies."""
    import inspect
    from pathlib import Path

    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    from pipeline.results import tracking

    default = inspect.signature(SystemMetricsMonitor).parameters["sampling_interval"].default
    assert "sampling_interval" not in inspect.getsource(tracking)
    text = " ".join((Path(__file__).resolve().parents[1] / "docs/mlflow.md").read_text(encoding="utf-8").split())
    assert f"sampled every {default:g} s (`MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL` changes it)" in text


@pytest.mark.slow
def test_a_damaged_partition_file_is_one_line_naming_it_before_any_run_is_made(store, capsys):
    """RunLogger.start read the partition file by hand (json.loads(...)["clients"]), after it had made the run: a
    truncated file ended the train stage in a JSONDecodeError traceback and left a RUNNING run behind. It is now read
    by the partition reader first: one line naming the file, and no run in the store."""
    from pipeline.common.cli import run as run_cli
    from pipeline.results.tracking import RunLogger

    partition = store / "seed0.json"
    partition.write_text('{"clients": {"Academic": {"train": [1, 2], ')  # cut off mid-write

    def start(argv):
        RunLogger.start("s", "a", {"x": 1}, {"experiment": "a"}, partition=partition)

    assert run_cli(start, []) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    names(line, "error: ", str(partition))
    assert "Traceback" not in line
    study = _client().get_experiment_by_name("s")
    assert study is None or not _client().search_runs([study.experiment_id])
