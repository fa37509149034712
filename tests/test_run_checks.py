"""Checks around a deployed run (pipeline.federation.deployment's run config check, localhost's `local` and `status`
commands): run-config keys, types and signs named before any process starts, --auth without --tls refused, a run's
status read from what `flwr ls --format json` prints, an MLflow run left RUNNING by a killed ServerApp marked
KILLED. No processes: these run in the fast lane."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from pipeline.common.cli import run as run_cli
from pipeline.common.config import ConfigError, from_dict
from pipeline.federation import cli, localhost
from pipeline.federation.deployment import ServerRunConfig
from pipeline.federation.localhost import FederationError, close_left_running, parse_run_status
from tests.test_federated import workspace, ws  # noqa: F401,E402  (fixtures)

REPO = Path(__file__).resolve().parents[1]


def test_the_apps_run_config_is_what_the_server_app_reads():
    # pyproject.toml's [tool.flwr.app.config]: key -> the type of its default
    with open(REPO / "pyproject.toml", "rb") as fh:
        config = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    read = {info.alias or name: info.annotation for name, info in ServerRunConfig.__pydantic_fields__.items()}
    assert {k: type(v) for k, v in config.items()} == read


@pytest.mark.parametrize(
    "item, key",
    [
        ("evaluate_every=1", "evaluate_every"),
        ("round-timeout=5", "round-timeout"),
        ("evaluate-every='two'", "evaluate-every"),
        ("mlflow=3", "mlflow"),
        ("evaluate-every=-1", "evaluate-every"),
        ("round-timeout-s=-0.5", "round-timeout-s"),
        ("admission-timeout-s=-2", "admission-timeout-s"),
        ("cache-max-gb=-1.0", "cache-max-gb"),  # passed the server's check, refused only by each client
        ("plan=3", "plan"),
        ("""decoding='{"num_beams": 4'""", "decoding"),  # not JSON
        ("""decoding='{"num_beams": "x"}'""", "decoding"),
    ],
)
def test_a_bad_run_config_item_is_named_before_any_process_starts(tmp_path, monkeypatch, capsys, item, key):
    monkeypatch.chdir(tmp_path)  # no plan, no FLWR_HOME here: the check must come before both
    monkeypatch.setattr(localhost.ProcessGroup, "start", lambda *a, **k: pytest.fail("a process was started"))
    status = run_cli(cli.main, ["local", "--experiment", "fedavg-domain", "--run-config", item])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and (f".{key}" in err[0] or f"'{key}'" in err[0]), err
    assert not (tmp_path / ".flwr-local").exists()


@pytest.mark.parametrize(
    "flag, value",
    [("--run-timeout", "inf"), ("--run-timeout", "nan"), ("--startup-timeout", "nan"), ("--stop-timeout", "inf")],
)
def test_a_timeout_that_is_no_finite_number_is_refused_before_any_process_starts(ws, monkeypatch, capsys, flag, value):
    """--run-timeout inf or nan ended in a ValueError traceback (the local CA's validity in days); a startup (run,
    stop) timeout of nan waited for ever for a process that never got ready (no time is past nan)."""
    from tests.test_federated import write_plan

    plan = write_plan("timeout-flags", "fedavg")
    monkeypatch.setattr(localhost.ProcessGroup, "start", lambda *a, **k: pytest.fail("a process was started"))
    status = run_cli(cli.main, ["local", "--plan", plan, flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and flag in err[0], err


def test_good_run_config_values_pass_and_an_integer_is_a_number():
    from_dict(
        ServerRunConfig,
        {
            "evaluate-every": 2,
            "round-timeout-s": 30,
            "admission-timeout-s": 0.0,
            "mlflow": False,
            "plan": "models/plans/x.json",
        },
    )
    with pytest.raises(ConfigError, match="evaluate-every: expected an integer"):
        from_dict(ServerRunConfig, {"evaluate-every": 1.5})
    with pytest.raises(ConfigError, match="evaluate: expected true or false"):
        from_dict(ServerRunConfig, {"evaluate": "yes"})


def test_auth_without_tls_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    status = run_cli(cli.main, ["local", "--experiment", "fedavg-domain", "--auth"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "--auth" in err[0] and "TLS" in err[0]


def _flwr_ls_json(rows: list[tuple[int, str, str, str]]) -> str:
    """What `flwr ls --format json` prints, made by flwr 1.41's own formatter."""
    from flwr.cli.ls import _to_json
    from flwr.cli.run_utils import RunRow

    return _to_json(
        [
            RunRow(
                run_id=rid,
                federation_id="",
                fab_id="fedmeet/fedmeet",
                fab_version="1.0",
                fab_hash="h",
                status_text=status,
                details=details,
                elapsed="00:00:01",
                pending_at=pending,
                starting_at=pending,
                running_at=pending,
                finished_at=pending,
                network_traffic_inbound=0,
                network_traffic_outbound=0,
                compute_time_serverapp=0.0,
                compute_time_clientapp=0.0,
            )
            for rid, status, details, pending in rows
        ]
    )


def test_a_runs_status_and_its_cause_come_from_the_superlinks_run_list():
    text = _flwr_ls_json(
        [
            (
                93,
                "finished:failed",
                "ServerApp failed with exception: plan.json: client(s) ['Product'] never joined within 600s",
                "2026-01-02 10:00:00Z",
            ),
            (7, "finished:completed", "N/A", "2026-01-01 10:00:00Z"),
        ]
    )  # flwr 1.41's "no details"
    assert parse_run_status(text, 7) == ("7", "finished:completed", "")
    rid, status, details = parse_run_status(text)  # the run submitted last, whatever its (random) id
    assert (rid, status) == ("93", "finished:failed") and "['Product']" in details
    with pytest.raises(FederationError, match="lists no run 5"):
        parse_run_status(text, 5)
    with pytest.raises(FederationError):
        parse_run_status("Connection refused")


def test_the_status_command_exits_non_zero_for_a_failed_run(monkeypatch, capsys):
    import subprocess

    text = _flwr_ls_json([(93, "finished:failed", "ServerApp failed with exception: boom", "2026-01-02 10:00:00Z")])
    calls = []
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda argv, **kw: calls.append(argv) or subprocess.CompletedProcess(argv, 0, stdout=text, stderr=""),
    )
    assert run_cli(cli.main, ["status", "fedmeet"]) == 1
    assert capsys.readouterr().out.strip() == "run 93: finished:failed (ServerApp failed with exception: boom)"
    assert calls[0][1:] == ["ls", "fedmeet", "--format", "json"]


def test_a_killed_servers_mlflow_run_is_marked_killed_and_a_finished_one_left_alone(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from pipeline.experiments.plans import Plan
    from pipeline.experiments.train_config import TrainConfig
    from pipeline.training.checkpoints import mlflow_run_id_path

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("t")
    plan = Plan(
        experiment="fedavg-x",
        study="t",
        method="fedavg",
        partition="domain/seed0",
        seed=0,
        train=TrainConfig(),
        model={},
    )
    id_file = mlflow_run_id_path(plan)
    id_file.parent.mkdir(parents=True)
    running = client.create_run(exp).info.run_id
    id_file.write_text(running)
    close_left_running(tmp_path, plan, "interrupted")
    assert client.get_run(running).info.status == "KILLED"
    close_left_running(tmp_path, plan, "again")  # not RUNNING any more: left alone
    assert client.get_run(running).data.tags["fedmeet.end"] == "marked KILLED by the local command: interrupted"
    id_file.unlink()
    close_left_running(tmp_path, plan, "no run")  # no run id: nothing to mark


@pytest.mark.parametrize(
    "rc, key", [({"evaluate-every": -1}, "evaluate-every"), ({"round-timeout-s": "60"}, "round-timeout-s")]
)
def test_the_server_app_refuses_a_bad_run_config_before_anything_else(tmp_path, monkeypatch, rc, key):
    """The manual recipe's `flwr run` reaches the ServerApp without the local command's check: it names the key."""
    from flwr.app import Context, RecordDict

    from pipeline.federation.deployment import serve

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=key):
        serve(
            None,
            Context(
                run_id=1,
                node_id=0,
                node_config={},
                state=RecordDict(),
                run_config={"plan": "models/plans/none.json", **rc},
            ),
        )


def test_the_local_command_knows_the_round_a_rerun_resumes_at(ws):
    """No server checkpoint: round 1; one after round 2 of this plan: round 3 (what the command prints)."""
    from pipeline.federation.localhost import LocalhostConfig, LocalhostFederation
    from pipeline.federation.protocol import load_plan
    from pipeline.training.checkpoints import save_round_checkpoint, server_checkpoint_path
    from tests.test_federated import write_plan

    path = write_plan("resume-round", "fedavg", rounds=4)
    fed = LocalhostFederation(LocalhostConfig(plan=path))
    assert fed.clients == ["Academic", "Committee", "Product"]
    assert fed._resume_hint().startswith("no round was checkpointed;") and "to start over" in fed._resume_hint()
    save_round_checkpoint(server_checkpoint_path(load_plan(path)), load_plan(path), 2, {})
    assert fed._resume_hint().startswith("the server checkpointed round 2 of 4 (")
    assert fed._resume_hint().endswith(
        f"rerun `python -m pipeline.federation local --plan {path}` to resume from round 3"
    )


def test_a_rerun_waits_for_its_own_supernode_not_for_the_id_an_earlier_run_logged(ws):
    """The local command's rerun (e.g. to resume) starts its SuperNodes with the logs of the earlier run in place:
    a SuperNode that has not connected yet must not pass for connected because the earlier run's log line says so."""
    import sys

    from pipeline.federation.localhost import LocalhostConfig, LocalhostFederation
    from tests.test_federated import write_plan

    fed = LocalhostFederation(LocalhostConfig(plan=write_plan("stale-log", "fedavg"), startup_timeout_s=1.0))
    (fed.procs.log_dir / "supernode-Academic.log").write_text("INFO :      SuperNode ID: 1234 (the earlier run)\n")
    proc = fed.procs.start("supernode-Academic", [sys.executable, "-c", "import time; time.sleep(30)"], fed.workdir)
    try:
        with pytest.raises(FederationError, match="did not happen within 1s"):
            fed.wait_registered(proc)
    finally:
        fed.procs.stop_all()


def test_each_supernode_logs_to_its_own_file_whatever_the_other_clients_names(ws, monkeypatch):
    """A SuperNode's log is supernode-<client>.log, a restart's supernode-<client>-<n>.log. Restarts were counted by
    the names that start with supernode-<client>, so those of other clients whose name extends it counted too: with
    clients A-1, AB and A, A's first log was supernode-A-2.log. Each process gets the first name of supernode-<client>,
    -1, -2, ... no process of the run has, so no two share a log (A's restart: A-1 is the client A-1's). Stand-in
    processes: no process starts."""
    from pipeline.federation.localhost import LocalhostConfig, LocalhostFederation, Process
    from tests.test_federated import write_plan

    fed = LocalhostFederation(LocalhostConfig(plan=write_plan("log-names", "fedavg"), clients=["A-1", "AB", "A"]))

    def start(name, argv, cwd):
        fed.procs.procs.append(proc := Process(name, None, fed.procs.log_dir / f"{name}.log"))
        return proc

    monkeypatch.setattr(fed.procs, "start", start)
    try:
        for client in ["A-1", "AB", "A", "A", "A-1", "AB", "A"]:  # the three, then restarts
            assert fed.start_supernode(client) is fed.supernodes[client]
        names = [p.name for p in fed.procs.procs]
    finally:
        fed.procs.procs.clear()  # stand-ins: nothing to stop
    expected = ["A-1", "AB", "A", "A-2", "A-1-1", "AB-1", "A-3"]
    assert names == [f"supernode-{n}" for n in expected]


def test_a_run_that_ends_with_its_superlink_dead_is_not_taken_for_finished(ws, tmp_path, capsys):
    """The SuperLink is killed and `flwr run` exits at once (before the next poll): the run stops with the round a
    rerun resumes at, whichever process is seen gone first."""
    import subprocess
    import sys

    from pipeline.federation.localhost import LocalhostConfig, LocalhostFederation, Process
    from tests.test_federated import write_plan

    fed = LocalhostFederation(LocalhostConfig(plan=write_plan("superlink-gone", "fedavg", rounds=2)))
    superlink, run = (subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE) for _ in range(2))
    superlink.wait(), run.wait()  # both gone before stream() looks
    fed.superlink = Process("superlink", superlink, tmp_path / "superlink.log")
    (tmp_path / "run.log").write_text("round 1\n")  # the run's log, as ProcessGroup.start opens it
    with pytest.raises(
        FederationError,
        match=r"the SuperLink stopped during the run \(status 0\); no round was "
        r"checkpointed",
    ):
        fed.stream(Process("flwr-run", run, tmp_path / "run.log"))
    assert capsys.readouterr().out == "round 1\n"  # what the run wrote is shown before the error


def test_the_stream_echoes_and_returns_only_this_runs_output(tmp_path, capsys):
    """`flwr run` writes to its log, appended to an earlier run's: the stream echoes and returns this run's output
    only (not the earlier run id), a character whole though the run wrote it in two parts a poll apart."""
    import sys

    from pipeline.federation.localhost import RUN_ID, LocalhostConfig, LocalhostFederation
    from pipeline.federation.processes import ProcessGroup

    group = ProcessGroup(tmp_path / "logs", {"PATH": "/usr/bin:/bin"}, stop_timeout_s=2)
    (tmp_path / "logs" / "flwr-run.log").write_text("Successfully started run 1\n")
    split = "import sys, time\nout = sys.stdout.buffer\nout.write(b'Zo\\xc3'); out.flush(); time.sleep(0.6)\n"
    run = group.start(
        "flwr-run", [sys.executable, "-c", split + "out.write(b'\\xab\\nSuccessfully started run 2\\n')"], tmp_path
    )
    fed = object.__new__(LocalhostFederation)  # only what stream() reads
    fed.cfg, fed.superlink, fed.home = LocalhostConfig(plan="p.json", run_timeout_s=30), None, tmp_path
    try:
        streamed = fed.stream(run)
    finally:
        group.stop_all()
    assert streamed.stdout == "Zoë\nSuccessfully started run 2\n" == capsys.readouterr().out
    assert streamed.returncode == 0 and RUN_ID.search(streamed.stdout).group(1) == "2"


def test_a_process_reaped_before_the_stop_is_not_signalled_by_its_old_pid(tmp_path):
    """A group's process that ended and was reaped before stop_all (`flwr run` once the run ends: stream() polls it)
    has freed its pid, which the kernel may give to any new process (pid_max is 32768 on the reference machine): stop
    sent that one, and its process group, SIGTERM then SIGKILL. Simulated: the reaped pid taken by a process outside
    the group."""
    import subprocess

    from pipeline.federation.processes import ProcessGroup

    group = ProcessGroup(tmp_path / "logs", {"PATH": "/usr/bin:/bin"}, stop_timeout_s=2)
    proc = group.start("flwr-run", ["true"], tmp_path)
    proc.popen.wait()  # ended and reaped: its pid is free
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)  # a later process given that pid
    try:
        proc.popen.pid = other.pid
        group.stop_all()
        assert other.poll() is None, "stop_all signalled a process it did not start"
    finally:
        other.kill()
        other.wait()


def test_a_resumed_run_takes_no_earlier_runs_evaluations_every_n_rounds_for_its_own(ws):
    """reports/eval/<exp>/rounds.json of a finished run (evaluate-every=1) stayed while the plan's next run started
    over without an evaluation every N rounds (or was killed in its first one); resumed, that run took the earlier
    run's rounds as its own, and kept them beside its metrics.json."""
    from pipeline.federation.deployment import ROUNDS_EVAL, DeploymentRecorder
    from pipeline.federation.protocol import load_plan
    from pipeline.paths import PATHS
    from tests.test_federated import write_plan

    plan = load_plan(write_plan("stale-rounds-eval", "fedavg", rounds=4))
    saved = PATHS.eval_dir(plan.experiment) / ROUNDS_EVAL
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps({"experiment": plan.experiment, "rounds": [{"round": 1}, {"round": 2}]}))
    recorders = [DeploymentRecorder(None, None, "p", None, 0, 5.0) for _ in range(2)]
    recorders[0].started(plan, ["Academic"], 1)  # the next run starts over, is killed after round 2's checkpoint
    recorders[1].started(plan, ["Academic"], 3)  # and resumes at round 3
    for recorder in recorders:
        recorder.close()
    assert recorders[1].per_round == []


def test_the_local_command_prints_the_rouge_of_the_evaluation_its_run_wrote(ws, monkeypatch, capsys):
    """The closing line of `local` carries the client-average ROUGE of reports/eval/<exp>/metrics.json when the run
    wrote it (not recomputed), and none when the file is an earlier run's."""
    import os
    import time

    from pipeline.federation.localhost import LocalhostFederation
    from pipeline.federation.protocol import load_plan
    from pipeline.paths import PATHS
    from tests.test_federated import write_plan

    path = write_plan("local-rouge", "fedavg", rounds=1)
    plan = load_plan(path)
    evaluated = PATHS.eval_dir(plan.experiment) / "metrics.json"
    evaluated.parent.mkdir(parents=True, exist_ok=True)
    mean = {"rouge1": 31.5, "rouge2": 9.25, "rougeL": 24.0, "avg_rouge": 21.58}

    def run(cfg, age: float):
        fed = LocalhostFederation(cfg)
        # the run's start, a second back: a file's mtime comes from the kernel's coarse clock, which can stand a few
        # ms behind time.time(), so a file written at once could seem older than the run (CI failed once on it)
        since = time.time() - 1.0
        train = Path(plan.paths["reports_dir"]) / "metrics.json"
        train.parent.mkdir(parents=True, exist_ok=True)
        train.write_text(
            json.dumps(
                {
                    "experiment": plan.experiment,
                    "clients": {"Academic": {"best_round": 1, "best_val_loss": 0.5, "rounds_failed": 0}},
                }
            )
        )
        evaluated.write_text(json.dumps({"mean": mean}))
        os.utime(evaluated, (since - age, since - age))
        return fed.procs.log_dir, fed.check_outputs(since)

    monkeypatch.setattr(cli, "run_localhost", lambda cfg: run(cfg, age=-1.0))
    assert run_cli(cli.main, ["local", "--plan", path]) == 0
    assert json.loads(capsys.readouterr().out)["rouge"] == mean
    monkeypatch.setattr(cli, "run_localhost", lambda cfg: run(cfg, age=60.0))  # an earlier run's file
    assert run_cli(cli.main, ["local", "--plan", path]) == 0
    assert "rouge" not in json.loads(capsys.readouterr().out)


def test_status_reports_the_run_flwr_run_started_or_that_it_started_none(monkeypatch, capsys, tmp_path):
    import subprocess

    text = _flwr_ls_json(
        [
            (93, "finished:failed", "boom", "2026-01-02 10:00:00Z"),
            (7, "finished:completed", "N/A", "2026-01-01 10:00:00Z"),
        ]
    )
    calls = []
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda argv, **kw: calls.append(argv) or subprocess.CompletedProcess(argv, 0, stdout=text, stderr=""),
    )
    started = tmp_path / "run.json"
    started.write_text('{"success": true, "run-id": "7"}')  # what `flwr run --format json` prints
    assert run_cli(cli.main, ["status", "fedmeet", "--submitted", str(started)]) == 0
    assert capsys.readouterr().out.strip() == "run 7: finished:completed"  # not run 93, submitted later
    refused = tmp_path / "refused.json"
    refused.write_text('{"success": false, "error-message": "Invalid run configuration: admision-timeout-s"}')
    assert run_cli(cli.main, ["status", "fedmeet", "--submitted", str(refused)]) == 1
    assert capsys.readouterr().out.strip() == "no run started: Invalid run configuration: admision-timeout-s"
    assert len(calls) == 1  # the SuperLink is not asked about a run that never started


@pytest.mark.parametrize("text", [None, "{not json", "[7]", '"started"', '{"success": true, "run-id": "7x"}'])
def test_status_names_a_submitted_file_that_holds_no_run_in_one_line(tmp_path, capsys, text):
    """--submitted names what `flwr run --format json` printed; a missing file, invalid JSON, JSON other than an
    object (a list or a string raised AttributeError, a traceback) or a run id that is no number (int()'s ValueError,
    a traceback) is one line naming the file, no SuperLink asked."""
    submitted = tmp_path / "run.json"
    if text is not None:
        submitted.write_text(text)
    assert run_cli(cli.main, ["status", "fedmeet", "--submitted", str(submitted)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and str(submitted) in err, err


def test_status_says_when_it_cannot_reach_the_superlink():
    down = '{"success": false, "error-message": "Connection refused: 127.0.0.1:9093"}'
    with pytest.raises(FederationError, match="cannot reach the SuperLink: Connection refused"):
        parse_run_status(down)


def test_the_deployed_app_module_freezes_its_imports_and_keeps_collecting():
    """Flower loads pipeline.federation.deployment in a fresh process per message: its ~500k imported objects are
    frozen (no full collection scans them: ~1.4 s CPU of each message, docs/performance.md), and the collector is
    on again afterwards (a message's work is collected as usual)."""
    from tests.test_stage_entrypoints import _python

    enabled, frozen = map(
        int, _python("import gc, pipeline.federation.deployment\nprint(int(gc.isenabled()), gc.get_freeze_count())")
    )
    assert enabled == 1 and frozen > 300_000


@pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")  # Flower's own use of pathspec
def test_flwr_run_is_given_a_folder_that_builds_the_checkouts_fab(ws, monkeypatch):
    """`flwr run` walks every file under the app folder it is given before it filters them, so the local command hands
    it a copy of the FAB's files only; Flower builds the same FAB (names and bytes) from it as from the checkout."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    from pipeline.federation.localhost import REPO_ROOT, LocalhostConfig, LocalhostFederation
    from tests.test_federated import write_plan

    fed = LocalhostFederation(LocalhostConfig(plan=write_plan("app-folder", "fedavg", rounds=1)))
    started = []
    monkeypatch.setattr(fed.procs, "start", lambda name, argv, cwd: started.append(argv))
    fed.submit()
    app = Path(started[0][2])
    assert app != REPO_ROOT and app.is_dir()
    copy, checkout = (zipfile.ZipFile(io.BytesIO(build_fab_from_disk(p))) for p in (app, REPO_ROOT))
    names = sorted(checkout.namelist())
    assert sorted(copy.namelist()) == names and "pyproject.toml" in names
    assert any(n.startswith("pipeline/federation/") for n in names)
    assert all(copy.read(n) == checkout.read(n) for n in names)


def test_the_local_ca_and_certificate_outlive_the_run_timeout(ws, monkeypatch):
    """`local --tls --run-timeout T`: the throwaway CA and the SuperLink's certificate are made before the run and
    must stay valid until T has passed: after the run the launcher opens a new TLS connection (`flwr ls`), as a
    SuperNode does when it reconnects; they were valid for 2 days whatever T."""
    import ssl
    import time

    from tests.test_federated import write_plan

    monkeypatch.setattr(localhost.ProcessGroup, "start", lambda *a, **k: pytest.fail("a process was started"))
    plan = write_plan("ca-days", "fedavg", rounds=1)
    end = time.time() + 5 * 86400
    fed = localhost.LocalhostFederation(localhost.LocalhostConfig(plan, tls=True, run_timeout_s=5 * 86400))
    for cert in (fed.certificates.ca, fed.certificates.cert):
        assert ssl.cert_time_to_seconds(ssl._ssl._test_decode_cert(str(cert))["notAfter"]) >= end


def test_a_plan_in_the_run_config_of_the_local_command_is_refused_not_served_to_the_server_alone(monkeypatch, capsys):
    """The local command starts the SuperNodes on --plan / --experiment's plan and sends the ServerApp
    {plan: that, **--run-config}: a --run-config plan=... reached the ServerApp alone, which then refused every
    SuperNode as serving another plan and failed only after the admission timeout (600 s by default)."""
    monkeypatch.setattr(cli, "run_localhost", lambda cfg: pytest.fail(f"started with {cfg.run_config}"))
    argv = ["local", "--experiment", "fedavg-domain", "--run-config", "plan='models/plans/fedkd-domain.json'"]
    status = run_cli(cli.main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "--run-config 'plan'" in err[0] and "--plan" in err[0], err


def test_a_flwr_cli_call_that_outruns_its_timeout_ends_in_one_line(tmp_path, monkeypatch, capsys):
    """`flwr ls` (the status command, the local command's check after its run) and `flwr supernode register` wait
    at most a timeout for the CLI; a CLI that does not answer (a SuperLink that accepts but never replies) raised
    subprocess.TimeoutExpired, a traceback. The standard is one line naming the command and the wait."""
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "flwr").write_text("#!/bin/sh\nsleep 30\n")
    (bin_dir / "flwr").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))  # localhost.flwr runs the CLI beside it
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: real_run(*a, **kw | {"timeout": 0.5}))
    assert run_cli(cli.main, ["status", "fedmeet", "--run-id", "7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: `flwr ls` did not answer within ")
