"""`python -m pipeline.federation`: a local deployment of one experiment (``local``: pipeline.federation.localhost),
a run's status (``status``) and what each role of a real federation holds (``kit``, docs/federation.md): the server's
kit (plan, backbone, its run config) and a site's (plus its own examples, partition and POS tags only), laid out as the
project root. pandas and the data readers are imported inside the functions: ``status`` starts without them."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import tomllib
from dataclasses import fields
from functools import partial
from pathlib import Path

from pipeline.common import atomic, cli
from pipeline.common.config import ConfigError
from pipeline.common.schema import DataError, read_parquet
from pipeline.experiments.plans import read_plan
from pipeline.federation.localhost import (
    LocalhostConfig,
    run_localhost,
    server_run_config,
    status_command,
    write_config_toml,
)
from pipeline.paths import PATHS

RUN_CONFIG = "run_config.toml"  # the server's kit: the ServerApp's run config


def _parse_run_config(items: list[str]) -> dict[str, str | int | float | bool]:
    """``key=value`` items; the value is read as TOML (``mlflow=false``, ``evaluate-every=2``), else as text."""
    out: dict[str, str | int | float | bool] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--run-config {item!r}: expected key=value")
        k, v = (x.strip() for x in item.split("=", 1))
        try:
            out[k] = tomllib.loads(f"x = {v}")["x"]
        except tomllib.TOMLDecodeError:
            out[k] = v.strip("'\"")
    return out


def write_kit(plan_path: str, out: Path, client: str | None = None, params: str = "params.yaml") -> list[Path]:
    """Copy what the server (``client`` None; its run config from the ``params`` file) or ``client``'s site holds
    (docs/federation.md) into ``out``, laid out as the project root; returns the paths written (relative to ``out``).
    The plan keeps its relative path, so the same run config works on every role."""
    # lazy: it imports pandas (~0.3 s); `status` starts without it
    from pipeline.training.client_data import read_examples, read_partition

    if Path(plan_path).is_absolute() or ".." in Path(plan_path).parts:  # laid out under ``out`` at its own path
        raise ConfigError(f"--plan {plan_path}: give the plan's path relative to the project root, inside it")
    if out.is_file() or out.resolve() == Path.cwd().resolve():  # mkdir's traceback, or the plan copied onto itself
        raise ConfigError(f"--out {out}: {'a file' if out.is_file() else 'the project root itself'}; give a folder")
    plan = read_plan(plan_path)
    if not plan.clients:
        raise DataError(
            f"{plan_path}: the plan declares no clients (not a federated plan, or written before plans "
            f"declared them: rerun the plan stage)"
        )
    if client is not None and client not in plan.clients:
        raise DataError(f"{plan_path}: no client {client!r} (clients: {plan.clients})")
    run_config = {"plan": plan_path, **server_run_config(params, plan.experiment)} if client is None else None
    backbone = Path(plan.paths["backbone"])
    if not backbone.is_dir():
        raise FileNotFoundError(f"{backbone}: backbone not found (stage `backbone`)")
    part_path, own = Path(plan.paths["partition"]), {}
    if client is not None:  # the site's files are read before anything is written: a bad one leaves no partial kit
        splits = (partition := read_partition(part_path, client))["clients"][client]
        ids = {str(i) for split in splits.values() for i in split}
        # only this client's ids: the other sites' example ids and the excluded ids stay with the data owner
        part = {k: partition[k] for k in ("scheme", "seed", "params") if k in partition} | {"clients": {client: splits}}
        readers = {Path(plan.paths["examples"]): read_examples} | (
            {Path(plan.paths["postags"]): partial(read_parquet, what="POS-tag file (stage `postag`)")}
            if "postags" in plan.paths
            else {}
        )
        for path, read in readers.items():  # this client's rows of the examples and the POS tags
            own[path] = (frame := read(path))[frame["example_id"].astype(str).isin(ids)]
    (out / plan_path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plan_path, out / plan_path)
    shutil.copytree(backbone, out / backbone, dirs_exist_ok=True)
    written = [Path(plan_path), backbone]
    if run_config is not None:
        write_config_toml(out / RUN_CONFIG, run_config)
        return [*written, Path(RUN_CONFIG)]

    atomic.write_text(out / part_path, json.dumps(part, indent=1))
    for path, frame in own.items():
        atomic.to_parquet(frame, out / path, index=False)
    return [*written, part_path, *own]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="A local deployment of one experiment (SuperLink and SuperNodes on "
        "127.0.0.1, then `flwr run`), a run's status, or what a site holds."
    )
    sub = ap.add_subparsers(dest="command", required=True)
    lo = sub.add_parser("local", help="SuperLink + one SuperNode per client on 127.0.0.1, then `flwr run`")
    which = lo.add_mutually_exclusive_group(required=True)
    which.add_argument("--experiment", help="a key of params.yaml `experiments` (plan models/plans/<exp>.json)")
    which.add_argument("--plan", help="a plan file (relative to the working directory)")
    lo.add_argument(
        "--run-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run config of the deployed ServerApp (evaluate, evaluate-every, mlflow, decoding, "
        "round-timeout-s, admission-timeout-s; the last three default to --params')",
    )
    cli.add_params(lo, "params file of the server's timeouts and decoding")
    lo.add_argument("--tls", action="store_true", help="TLS with a throwaway self-signed CA (under FLWR_HOME)")
    lo.add_argument("--auth", action="store_true", help="SuperNode authentication: a registered key per client")
    # LocalhostConfig's fields (its defaults where not given)
    lo.add_argument("--startup-timeout", type=float, dest="startup_timeout_s", help="seconds for each process to start")
    lo.add_argument("--run-timeout", type=float, dest="run_timeout_s", help="seconds for the whole run")
    lo.add_argument("--stop-timeout", type=float, dest="stop_timeout_s", help="seconds a process gets on SIGTERM")
    st = sub.add_parser("status", help="exit 0 if the SuperLink reports the run completed (else 1, with its status)")
    st.add_argument("superlink", nargs="?", help="a SuperLink connection of FLWR_HOME/config.toml (default: its own)")
    st.add_argument("--run-id", type=int, help="the run (default: the run submitted last)")
    st.add_argument("--submitted", type=Path, help="what `flwr run --format json` printed (its run, or none)")
    kit = sub.add_parser("kit", help="copy what the server (no --client) or one site holds into --out")
    kit.add_argument("--plan", required=True)
    kit.add_argument("--client", help="the site's client (default: the server's kit)")
    kit.add_argument("--out", required=True, type=Path)
    cli.add_params(kit, "the server's kit: run_config.toml's timeouts, decoding")
    args = ap.parse_args(argv)
    if args.command == "status":
        return status_command(args.superlink, args.run_id, args.submitted)
    if args.command == "kit":
        written = write_kit(args.plan, args.out, args.client, args.params)
        print(f"{args.client or 'server'}: wrote {', '.join(map(str, written))} under {args.out}")
        return 0

    plan = args.plan or str(PATHS.plans / f"{args.experiment}.json")
    given = {f.name: getattr(args, f.name) for f in fields(LocalhostConfig) if getattr(args, f.name, None) is not None}
    # nan or inf: no wait would ever end (no time is past nan), and the local CA's validity in days is no integer
    if bad := [f"--{k[:-2].replace('_', '-')}" for k, v in given.items() if k.endswith("_s") and not math.isfinite(v)]:
        raise ConfigError(f"{', '.join(bad)}: give a finite number of seconds")
    if "plan" in (run_config := _parse_run_config(args.run_config)):  # the ServerApp's plan would win, not the nodes'
        raise ConfigError("--run-config 'plan': give the plan as --plan or --experiment (the SuperNodes serve it too)")
    cfg = LocalhostConfig(**given | {"plan": plan, "run_config": run_config})
    # Ctrl-C / SIGTERM / SIGHUP (a closed terminal) unwind through LocalhostFederation.__exit__ (stops its processes)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)  # raises KeyboardInterrupt
    try:
        logs, metrics = run_localhost(cfg)
    except KeyboardInterrupt:
        print("interrupted: every process this command started was stopped", file=sys.stderr)
        return 130
    clients = {
        c: {k: v[k] for k in ("best_round", "best_val_loss", "rounds_failed")} for c, v in metrics["clients"].items()
    }
    summary = {"experiment": metrics.get("experiment", Path(plan).stem), "clients": clients}
    # the client-average ROUGE of the federated evaluation, as the ServerApp wrote it (reports/eval/<exp>/)
    rouge = {"rouge": metrics["rouge"]} if "rouge" in metrics else {}
    print(json.dumps(summary | rouge | {"logs": str(logs)}))
    return 0
