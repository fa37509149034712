"""A local deployment of one experiment (a SuperLink and one SuperNode per client on 127.0.0.1, then ``flwr run``,
with TLS and SuperNode authentication if asked; docs/federation.md; its processes: pipeline.federation.processes, its
TLS files: pipeline.federation.tls), a run's status, and the ServerApp's run config from a params file. The training
side is imported inside the functions that need it: `python -m pipeline.federation status` starts without torch."""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.common import atomic, cli
from pipeline.common.config import from_dict
from pipeline.common.schema import DataError, read_json
from pipeline.experiments.settings import load_run_settings
from pipeline.federation.processes import HOST, FederationError, Process, ProcessGroup, free_port, port_open, wait_for
from pipeline.federation.tls import Certificates, make_node_key, make_self_signed_ca, tail
from pipeline.paths import PATHS
from pipeline.results.evaluation import EvaluateConfig
from pipeline.results.tracking import end_if_running

CONNECTION = "fedmeet-local"  # the name of the SuperLink connection in FLWR_HOME/config.toml
REPO_ROOT = Path(__file__).resolve().parents[2]  # the Flower app (pyproject.toml with [tool.flwr.app])
RUN_ID = re.compile(r"Successfully started run (\d+)")  # in the output of `flwr run`
REGISTERED = b"SuperNode ID:"  # in a SuperNode's log: the SuperLink gave it an id


@dataclass
class LocalhostConfig:
    plan: str  # relative to the working directory, as the SuperLink and the SuperNodes read it
    run_config: dict[str, str | int | float | bool] = field(default_factory=dict)  # the ServerApp's
    params: str | None = None  # params file of the run config's timeouts and decoding (unless set there)
    clients: list[str] | None = None  # the SuperNodes started, by client name (default: the plan's partition)
    tls: bool = False
    auth: bool = False  # SuperNode authentication: a key per client, registered before the run
    startup_timeout_s: float = 60.0
    run_timeout_s: float = 3600.0
    stop_timeout_s: float = 10.0


def parse_run_status(text: str, run_id: int | None = None) -> tuple[str, str, str]:
    """(run id, status, details) of ``run_id`` - else of the run submitted last - in ``flwr ls --format json``
    output; raises FederationError when the SuperLink did not list it."""
    try:
        listed = json.loads(text)
    except json.JSONDecodeError:
        raise FederationError(f"`flwr ls` gave no run list: {tail(text)}") from None
    if not listed.get("success"):  # flwr's JSON error: the SuperLink could not be asked at all
        raise FederationError(f"cannot reach the SuperLink: {tail(listed.get('error-message') or text)}")
    runs = [r for r in (listed.get("runs") or []) if run_id is None or str(r.get("run-id")) == str(run_id)]
    if not runs:
        raise FederationError(f"the SuperLink lists no run{'' if run_id is None else f' {run_id}'}: {tail(text)}")
    run = max(runs, key=lambda r: str(r.get("pending-at") or ""))  # Flower's run ids are random, not ordered
    details = str(run.get("status-details") or "")
    return str(run.get("run-id")), str(run.get("status", "")), "" if details == "N/A" else details  # N/A: none


def server_run_config(params_file: str, experiment: str) -> dict[str, str | float]:
    """The ServerApp's run-time settings from a params file: round and admission timeouts (with ``experiment``'s
    overrides) and the federated evaluation's decoding (its ``evaluate`` group, as JSON)."""
    settings = load_run_settings(params_file, experiment)  # a missing file is an error, never the defaults
    _, decoding = cli.read_params(params_file, evaluate=EvaluateConfig)  # "<file> evaluate.<key>", as every stage
    return {
        "round-timeout-s": settings.round_timeout_s,
        "admission-timeout-s": settings.admission_timeout_s,
        "decoding": json.dumps(asdict(decoding)),
    }


def flwr(*args: str, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """A ``flwr`` CLI command (the CLI beside this interpreter, whatever PATH says), its output captured; one that
    does not end within ``timeout`` seconds (a SuperLink that never answers) is a FederationError."""
    cli = Path(sys.executable).parent / "flwr"
    try:
        argv = [str(cli) if cli.exists() else "flwr", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired:
        raise FederationError(f"`flwr {args[0]}` did not answer within {timeout:g}s: {' '.join(args)}") from None


def close_left_running(workdir: Path, plan, reason: str) -> None:
    """Mark KILLED the MLflow run of ``plan``'s server (its id beside the server checkpoint) if it is RUNNING."""
    from pipeline.training.checkpoints import mlflow_run_id_path  # lazy: torch (~1 s); `status` starts without it

    path = workdir / mlflow_run_id_path(plan)
    if path.exists():
        end_if_running(path.read_text().strip(), f"marked KILLED by the local command: {reason}")


def status_command(superlink: str | None, run_id: int | None, submitted: Path | None = None) -> int:
    """The manual recipe's check after ``flwr run`` (docs/federation.md): one line with the status of ``run_id``
    (else of the run submitted last) as ``flwr ls`` on ``superlink`` (a connection of FLWR_HOME/config.toml; None:
    its default) reports it; 0 only if it completed."""
    if submitted is not None:
        started = read_json(submitted, "the output of `flwr run --format json`")  # a one-line error if not an object
        if not (started.get("success") and started.get("run-id")):  # a refused run config, say
            print("no run started: " + " ".join(str(started.get("error-message") or "flwr run gave no run id").split()))
            return 1
        if not str(started["run-id"]).isdigit():  # a damaged file: one line naming it, not int()'s traceback
            raise DataError(f"{submitted}: run-id {started['run-id']!r} is not a run id")
        run_id = int(started["run-id"])
    run = ["--run-id", str(run_id)] if run_id is not None else []
    out = flwr("ls", *([superlink] if superlink else []), *run, "--format", "json", timeout=120)
    rid, status, details = parse_run_status(out.stdout, run_id)
    print(f"run {rid}: {status}" + (f" ({details})" if details else ""))
    return 0 if status == "finished:completed" else 1


def write_config_toml(path: Path, values: dict[str, str | int | float | bool], header: str = "") -> str:
    """A run config or node config file as Flower reads one (``flwr run --run-config F.toml``, ``flower-supernode
    --node-config F.toml``: any value comes back as given); JSON's strings, numbers and booleans are TOML's too.
    ``header``: the TOML before the values (a table's name)."""
    atomic.write_text(path, header + "".join(f"{k} = {json.dumps(v, ensure_ascii=False)}\n" for k, v in values.items()))
    return str(path)


def write_connection(home: Path, port: int, certificates: Certificates | None) -> None:
    """``$FLWR_HOME/config.toml`` with one SuperLink connection, the default of ``flwr run``."""
    security = {"root-certificates": str(certificates.ca.resolve())} if certificates else {"insecure": True}
    header = f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
    write_config_toml(home / "config.toml", {"address": f"{HOST}:{port}"} | security, header)


class LocalhostFederation(contextlib.AbstractContextManager):
    """SuperLink + SuperNodes of one deployment, usable as a context manager (everything stopped on exit)."""

    def __init__(self, cfg: LocalhostConfig):
        from pipeline.federation.deployment import ServerRunConfig  # lazy: torch, Flower (~2 s)
        from pipeline.federation.protocol import load_plan  # lazy, as above
        from pipeline.training.client_data import client_names  # lazy, as above (pandas)

        self.cfg = cfg
        if cfg.auth and not cfg.tls:  # Flower's SuperLink would only say "Invalid arguments provided to SuperLink"
            raise FederationError("--auth: SuperNode authentication needs TLS; add --tls")
        from_dict(ServerRunConfig, cfg.run_config, "--run-config").evaluate_config()  # before any process starts
        self.workdir = Path.cwd()
        self.plan = load_plan(str(self.workdir / cfg.plan))  # a missing file: load_plan's error, naming it
        params = {} if cfg.params is None else server_run_config(str(self.workdir / cfg.params), self.plan.experiment)
        self.run_config = params | cfg.run_config  # a --run-config value wins
        self.clients = list(cfg.clients or self.plan.clients or client_names(self.plan))
        self.home = (self.workdir / ".flwr-local" / self.plan.experiment).resolve()  # FLWR_HOME
        # Flower's entry points beside this interpreter (the project's venv) come first, whatever PATH says
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        env = dict(os.environ, FLWR_HOME=str(self.home), FLWR_TELEMETRY_ENABLED="0", PYTHONUNBUFFERED="1", PATH=path)
        self.procs = ProcessGroup(self.home / "logs", env, cfg.stop_timeout_s)
        self.port = free_port()
        days = 2 + int(cfg.run_timeout_s // 86400)  # valid for the whole run: `flwr ls` connects after it
        self.certificates = make_self_signed_ca(self.home / "certs", days) if cfg.tls else None
        self.keys: dict[str, tuple[Path, Path]] = {}
        self.superlink: Process | None = None
        self.supernodes: dict[str, Process] = {}

    def __exit__(self, *exc) -> None:
        self.procs.stop_all()

    def flwr(self, *args: str) -> subprocess.CompletedProcess:
        """A ``flwr`` CLI command on this deployment (its FLWR_HOME), within the startup timeout."""
        return flwr(*args, cwd=self.workdir, env=self.procs.env, timeout=self.cfg.startup_timeout_s)

    def start_supernode(self, name: str) -> Process:
        security = ["--root-certificates", str(self.certificates.ca)] if self.certificates else ["--insecure"]
        node_config = write_config_toml(self.home / f"node-{name}.toml", {"client-name": name, "plan": self.cfg.plan})
        argv = ["flower-supernode", *security, "--superlink", f"{HOST}:{self.port}", "--host", HOST]
        argv += ["--port", str(free_port()), "--node-config", node_config]
        if name in self.keys:  # SuperNode authentication: its private key
            argv += ["--auth-supernode-private-key", str(self.keys[name][0])]
        taken = {p.name for p in self.procs.procs}  # a log of its own: the first of supernode-<name>, -1, -2, ... free
        labels = (f"supernode-{name}" + (f"-{n}" if n else "") for n in range(len(taken) + 1))  # one is free
        proc = self.procs.start(next(label for label in labels if label not in taken), argv, self.workdir)
        self.supernodes[name] = proc
        return proc

    def wait_registered(self, proc: Process) -> None:
        """Until the SuperNode logs the id the SuperLink gave it."""
        what = f"{proc.name} connecting to the SuperLink"
        wait_for(lambda: REGISTERED in proc.log.read_bytes()[proc.offset :], self.cfg.startup_timeout_s, what, proc)

    def start(self) -> None:
        security = ["--insecure"]
        if c := self.certificates:
            security = ["--ssl-ca-certfile", str(c.ca), "--ssl-certfile", str(c.cert), "--ssl-keyfile", str(c.key)]
        argv = ["flower-superlink", *security, "--host", HOST, "--port", str(self.port)]
        # the app's dependencies are this environment's: no `uv sync` per run
        argv.append("--disable-runtime-dependency-installation")
        if self.cfg.auth:
            argv.append("--enable-supernode-auth")
        self.superlink = self.procs.start("superlink", argv, self.workdir)
        listening = f"the SuperLink listening on {HOST}:{self.port}"
        wait_for(lambda: port_open(self.port, self.superlink), self.cfg.startup_timeout_s, listening, self.superlink)
        write_connection(self.home, self.port, self.certificates)
        for name in self.clients if self.cfg.auth else []:  # SuperNode authentication: a registered key each
            self.keys[name] = make_node_key(self.home / "keys", name)
            out = self.flwr("supernode", "register", str(self.keys[name][1]), CONNECTION)
            if out.returncode != 0:
                raise FederationError(
                    f"registering the key of SuperNode {name} failed: {tail(out.stdout + out.stderr)}"
                )
        for proc in [self.start_supernode(name) for name in self.clients]:  # all started, then each waited for
            self.wait_registered(proc)

    def submit(self) -> Process:
        """``flwr run <app> <connection> --stream --run-config ...``, logged; <app> holds the FAB's files only:
        Flower walks every file under it before it filters them (a checkout's .venv: ~66k files, ~3.5 s CPU a run)."""
        app, pyproject = self.home / "app", REPO_ROOT / "pyproject.toml"
        shutil.rmtree(app, ignore_errors=True)
        include = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["fab-include"]
        for path in [pyproject, *(p for pattern in include for p in REPO_ROOT.glob(pattern))]:
            (copy := app / path.relative_to(REPO_ROOT)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, copy)
        run_config = write_config_toml(self.home / "run_config.toml", {"plan": self.cfg.plan, **self.run_config})
        argv = ["flwr", "run", str(app), CONNECTION, "--stream", "--run-config", run_config]
        return self.procs.start("flwr-run", argv, self.workdir)

    def stream(self, run: Process) -> subprocess.CompletedProcess:
        """Echo the run's output (its log) until it ends, the SuperLink dies or ``run_timeout_s`` passes; returns its
        status and output (``stdout``: this run's lines of its log, its stderr among them)."""
        deadline = time.monotonic() + self.cfg.run_timeout_s
        echo = codecs.getincrementaldecoder("utf-8")("replace")  # a character may be cut between two reads
        shown: list[str] = []  # the run's output: its log since it started, as echoed
        with open(run.log, "rb") as log:
            log.seek(run.offset)
            while True:  # its end counts only while the SuperLink lives: a run ended by its death is not finished
                ended = not run.alive()
                shown.append(echo.decode(log.read(), final=ended))  # once ended: all it wrote
                print(shown[-1], end="", flush=True)
                if self.superlink is not None and not self.superlink.alive():
                    stopped = f"the SuperLink stopped during the run (status {self.superlink.popen.returncode})"
                    raise FederationError(f"{stopped}; {self._resume_hint()}")
                if ended:
                    break
                if time.monotonic() > deadline:
                    late = f"the run did not finish within {self.cfg.run_timeout_s:.0f}s (--run-timeout)"
                    raise FederationError(f"{late}; {self._resume_hint()}")
                time.sleep(0.2)
        return subprocess.CompletedProcess(run.popen.args, run.popen.returncode, "".join(shown))

    def failed(self, what: str) -> FederationError:
        """The error of a run that ended with ``what``: where its logs are and where a rerun starts."""
        return FederationError(f"{what}; logs in {self.procs.log_dir}; {self._resume_hint()}")

    def _resume_hint(self) -> str:
        """Where a rerun starts: round 1, or the one after the server's last checkpointed round (a resumed run)."""
        from pipeline.training.checkpoints import load_round_checkpoint, server_checkpoint_path  # lazy: torch (~1 s)

        try:
            ckpt = load_round_checkpoint(self.workdir / server_checkpoint_path(self.plan), self.plan)
        except DataError as err:  # a damaged checkpoint: said beside the run's own error, never instead of it
            return str(err)
        command = f"python -m pipeline.federation local --plan {self.cfg.plan}"
        if ckpt is None:
            return f"no round was checkpointed; rerun `{command}` to start over"
        done = int(ckpt["round"])
        return (
            f"the server checkpointed round {done} of {self.plan.train.rounds} "
            f"({server_checkpoint_path(self.plan)}); rerun `{command}` to resume from round {done + 1}"
        )

    def check_outputs(self, since: float) -> dict:
        """The run's train metrics, or an error naming what is missing; with ``rouge``, the client-average ROUGE of
        the federated evaluation when this run wrote one."""
        metrics = self.workdir / self.plan.paths["reports_dir"] / "metrics.json"
        if not metrics.exists() or metrics.stat().st_mtime < since:
            raise self.failed(f"the run ended without writing {metrics}")
        evaluated = self.workdir / PATHS.eval_dir(self.plan.experiment) / "metrics.json"
        fresh = evaluated.exists() and evaluated.stat().st_mtime >= since
        return json.loads(metrics.read_text()) | ({"rouge": json.loads(evaluated.read_text())["mean"]} if fresh else {})


def run_localhost(cfg: LocalhostConfig) -> tuple[Path, dict]:
    """Start, run, stop: returns the folder of the processes' logs and the run's train metrics; raises
    FederationError otherwise (also when the ServerApp failed: ``flwr run`` exits 0 for that too)."""
    fed = LocalhostFederation(cfg)
    try:
        with fed:
            started = time.time()  # the ServerApp prints the round it starts at, in the run's stream
            fed.start()
            run = fed.stream(fed.submit())
            if run.returncode != 0:
                raise fed.failed(f"`flwr run` exited with status {run.returncode}")
            found = RUN_ID.search(run.stdout)
            if found is None:
                raise FederationError(f"`flwr run` printed no run id; logs in {fed.procs.log_dir}")
            # what the SuperLink says of the run
            listed = fed.flwr("ls", CONNECTION, "--run-id", found.group(1), "--format", "json")
            _, status, details = parse_run_status(listed.stdout, int(found.group(1)))
            if status != "finished:completed":
                cause = " ".join(details.split()) or "see superlink.log"  # "ServerApp failed with exception: ..."
                raise fed.failed(f"run {found.group(1)} {status}: {cause}")
            return fed.procs.log_dir, fed.check_outputs(started)
    except BaseException as exc:  # every process is stopped by now (LocalhostFederation.__exit__)
        try:
            # the ServerApp was killed before it could end its MLflow run: marked KILLED (a rerun resumes it)
            reason = "interrupted" if isinstance(exc, KeyboardInterrupt) else " ".join(str(exc).split())
            close_left_running(fed.workdir, fed.plan, reason)
        except Exception as closing:  # noqa: BLE001 -- the run's own error is the one to report
            print(f"warning: the MLflow run could not be marked KILLED: {closing}", file=sys.stderr)
        raise
