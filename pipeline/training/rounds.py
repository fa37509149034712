"""The rules of a training run's rounds, shared by the federated engines (pipeline.federation: server loop and
client handlers) and by `single` / `centralized` (pipeline.training.serverless):

- outputs and checkpoints: where they live while the run runs (its run directory ``data/cache/runs/<exp>-<key>/``:
  ``clients/<client>/``, ``checkpoint/`` with ``server.pt`` or ``local.pt``, ``mlflow_run_id``,
  ``clients/<client>/round<NNN>.{safetensors,json}``), how a round checkpoint is written and read back (tagged
  with the plan's hash: a checkpoint of another configuration is not resumed), and how the finished outputs move
  to ``models/<exp>/`` (:func:`publish_outputs`);
- the best adapter: every round a client's validation loss is compared with its best so far; the adapter is
  saved as ``adapter_final`` and, when better, as ``adapter_best``;
- the rounds history: ``rounds.json`` (one row per round and client) and the DVC plot file, the per-round
  MLflow metrics, and the recorders that receive each finished round.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.common import atomic
from pipeline.modeling.adapter_io import adapter_file, save_adapter
from pipeline.experiments import Plan, plan_hash

log = logging.getLogger("fedmeet.train")
_federated_log = logging.getLogger("fedmeet.federated")  # the base Recorder's (an engine run without the stage)

ROUND_FIELDS = ("train_loss", "ce", "kd", "kd_fraction", "val_loss", "bytes_up", "bytes_down", "weight_share",
                "epsilon", "clipped_fraction")  # the last two under privacy.mode example only
SERVER_CHECKPOINT = "server.pt"  # the federated server's: global adapter, strategy state, RNG, history
LOCAL_CHECKPOINT = "local.pt"  # single / centralized: every unit's adapter, progress, history
TRAINED_FLAG = "trained"  # in a client checkpoint's progress: 0 while the client has not trained yet
DP_STEPS = "dp-steps"  # in a client checkpoint's progress: DP-SGD steps so far, so a resumed client keeps composing


# ----------------------------------------------------------------------------------------------- where
def checkpoint_dir(plan: Plan) -> Path:
    """``<run dir>/checkpoint/``: everything a killed run resumes from (removed when the run finishes)."""
    return Path(plan.paths["out_dir"]) / "checkpoint"


def publish_outputs(plan: Plan) -> Path:
    """Copy a finished run's outputs (adapters, rounds, metrics, the merged gate log, the plan) from its run
    directory into ``models/<exp>/``, replacing what was there as a whole; returns that directory. The run
    directory is left for the caller to remove: a kill before that resumes after the last round and publishes
    again."""
    import shutil

    source, target = Path(plan.paths["out_dir"]), Path(plan.paths["model_dir"])

    def run_only(directory: str, names: list[str]) -> set[str]:
        # the checkpoints, and the clients' per-round gate log parts (merged into gate_log.parquet by now)
        here = Path(directory)
        if here == source:
            return {"checkpoint"} & set(names)
        return {"gate_log"} & set(names) if here.parent == source / "clients" else set()

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = atomic.temp_dir_for(target)
    shutil.copytree(source, tmp, ignore=run_only, dirs_exist_ok=True)
    atomic.replace_dir(tmp, target)
    return target


def server_checkpoint_path(plan: Plan) -> Path:
    return checkpoint_dir(plan) / SERVER_CHECKPOINT


def local_checkpoint_path(plan: Plan) -> Path:
    return checkpoint_dir(plan) / LOCAL_CHECKPOINT


def mlflow_run_id_path(plan: Plan) -> Path:
    """The run id beside the checkpoint: a resumed training continues its MLflow run."""
    return checkpoint_dir(plan) / "mlflow_run_id"


def client_output_dir(plan: Plan, client: str) -> Path:
    """A client's adapters and gate log (a deployed client may set its own: node config ``client-dir``)."""
    return Path(plan.paths["out_dir"]) / "clients" / client


def client_checkpoint_dir(plan: Plan, client: str) -> Path:
    """A client's round checkpoints (a deployed client may set its own: node config ``checkpoint-dir``)."""
    return checkpoint_dir(plan) / "clients" / client


# ----------------------------------------------------------------------------------------------- run checkpoints
def save_round_checkpoint(path: Path, plan: Plan, rnd: int, state: dict[str, Any]) -> None:
    """The checkpoint after round ``rnd``: ``state`` tagged with the plan's hash and the round."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.torch_save({"plan_hash": plan_hash(plan), "round": rnd, **state}, path)


def load_round_checkpoint(path: Path, plan: Plan) -> dict[str, Any] | None:
    """What :func:`save_round_checkpoint` wrote, or None: no checkpoint, or one of another configuration."""
    if not path.exists():
        return None
    state = torch.load(path, weights_only=False)  # our own file, written by save_round_checkpoint
    if state.get("plan_hash") != plan_hash(plan):
        log.warning("%s: checkpoint belongs to another configuration; starting over", path)
        return None
    return state


def has_valid_checkpoint(plan: Plan) -> bool:
    """Whether the experiment's outputs belong to an unfinished run of this plan (then they are resumed)."""
    for path in (server_checkpoint_path(plan), local_checkpoint_path(plan)):
        if path.exists():
            try:
                return torch.load(path, weights_only=False).get("plan_hash") == plan_hash(plan)
            except Exception:  # unreadable (killed mid-write before the atomic rename cannot happen, but be safe)
                return False
    return False


# ----------------------------------------------------------------------------------------------- best adapter
def initial_progress() -> dict[str, float]:
    """A client's progress before its first validation: no best round yet."""
    return {"best-val-loss": math.inf, "best-round": 0}


def keep_best_and_final(out: Path, plan: Plan, client: str, rnd: int, val_loss: float,
                        state: dict[str, torch.Tensor], progress: dict[str, float]) -> tuple[dict[str, float], bool]:
    """Save the round's adapter as ``adapter_final`` and, when its validation loss beats the client's best so
    far, as ``adapter_best``; returns the client's progress after this round and whether the round is its best."""
    meta = {"experiment": plan.experiment, "client": client, "round": str(rnd), "val_loss": f"{val_loss:.6f}"}
    is_best = val_loss < progress["best-val-loss"]
    if is_best:
        progress = {"best-val-loss": float(val_loss), "best-round": rnd}
        save_adapter(adapter_file(out, "best"), state, meta)
    save_adapter(adapter_file(out, "final"), state, meta)
    return progress, is_best


# ----------------------------------------------------------------------------------------------- client checkpoints
@dataclass
class ClientCheckpoint:
    """A client's checkpoint of one round: its progress, whether it had trained, its DP-SGD steps so far."""

    round: int
    progress: dict[str, float]
    trained: bool
    dp_steps: int | None
    adapter: Path


def _client_checkpoint_rounds(ckpt: Path) -> list[int]:
    return sorted(int(p.stem[len("round"):]) for p in ckpt.glob("round*.safetensors"))


def latest_client_checkpoint(ckpt: Path, before: int) -> ClientCheckpoint | None:
    """The client's latest checkpoint of a round before ``before``, or None."""
    earlier = [r for r in _client_checkpoint_rounds(ckpt) if r < before]
    if not earlier:
        return None
    last = earlier[-1]
    progress = json.loads((ckpt / f"round{last:03d}.json").read_text())
    trained = bool(progress.pop(TRAINED_FLAG, 1))
    dp_steps = int(progress.pop(DP_STEPS)) if DP_STEPS in progress else None
    return ClientCheckpoint(last, progress, trained, dp_steps, ckpt / f"round{last:03d}.safetensors")


def write_client_checkpoint(ckpt: Path, rnd: int, state: dict[str, torch.Tensor], progress: dict[str, float],
                            trained: bool, dp_steps: int | None) -> None:
    """Client-side checkpoint of round ``rnd`` (its adapter and progress); the previous round's stays until the
    server's checkpoint of this round exists, so a kill in between still finds a consistent state."""
    save_adapter(ckpt / f"round{rnd:03d}.safetensors", state)
    steps = {DP_STEPS: dp_steps} if dp_steps is not None else {}
    atomic.write_text(ckpt / f"round{rnd:03d}.json", json.dumps({**progress, TRAINED_FLAG: int(trained), **steps}))
    for old in _client_checkpoint_rounds(ckpt):
        if old < rnd - 1 or old > rnd:
            (ckpt / f"round{old:03d}.safetensors").unlink(missing_ok=True)
            (ckpt / f"round{old:03d}.json").unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------- history
@dataclass
class RoundLog:
    """What the server saw of one round (per client rows; no client data)."""

    round: int
    seconds: float
    rows: list[dict[str, Any]]
    aggregated: bool


def client_level_round(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The run-level privacy fields of one round under privacy.mode client, empty when it released nothing: one
    epsilon and C for the whole federation, and the fraction of the aggregated updates C clipped (the rows of the
    aggregated clients carry them; logged per run, not per client)."""
    released = [r for r in rows if "update_clipped" in r]
    if not released:
        return {}
    out = {"clipping_norm": released[0]["clipping_norm"],
           "clipped_fraction": sum(r["update_clipped"] for r in released) / len(released)}
    if released[0]["epsilon"] is not None:  # None: no noise, no bound
        out["epsilon"] = released[0]["epsilon"]
    return out


def round_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """One round's MLflow metrics from its rows (one per client)."""
    metrics: dict[str, float] = {}
    for row in rows:
        for key in ROUND_FIELDS + ("failed",):
            if row.get(key) is not None and not (key == "epsilon" and "update_clipped" in row):
                metrics[f"{row['client']}.{key}"] = float(row[key])
    metrics.update({k: float(v) for k, v in client_level_round(rows).items()})
    metrics["bytes_sent"] = float(sum(r.get("bytes_down", 0) for r in rows))
    metrics["bytes_received"] = float(sum(r.get("bytes_up", 0) for r in rows))
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    if vals:
        metrics["val_loss_mean"] = sum(vals) / len(vals)
    return metrics


def log_missing_rounds(logger, history: list[dict[str, Any]]) -> list[int]:
    """Log the rounds of ``history`` the MLflow run lacks: a kill between a round's checkpoint and its logging
    leaves that round to the resumed run, which does not train it again. Returns the rounds logged."""
    logged = {m.step for m in logger.metric_history("bytes_sent")}
    by_round: dict[int, list[dict[str, Any]]] = {}
    for row in history:
        by_round.setdefault(int(row["round"]), []).append(row)
    missing = sorted(set(by_round) - logged)
    for rnd in missing:
        logger.log_metrics(round_metrics(by_round[rnd]), step=rnd)
    return missing


def write_rounds(plan: Plan, history: list[dict[str, Any]]) -> None:
    """``models/<exp>/rounds.json`` (the history rows) and ``reports/train/<exp>/rounds.json`` (DVC plots: one row
    per round, a column per client and quantity)."""
    out_dir, reports_dir = Path(plan.paths["out_dir"]), Path(plan.paths["reports_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    reports_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_json(out_dir / "rounds.json", history, indent=1)
    wide: dict[int, dict[str, Any]] = {}
    by_round: dict[int, list[dict[str, Any]]] = {}
    for row in history:
        w = wide.setdefault(row["round"], {"round": row["round"]})
        by_round.setdefault(row["round"], []).append(row)
        for key in ROUND_FIELDS:
            if row.get(key) is not None and not (key == "epsilon" and "update_clipped" in row):
                w[f"{row['client']}/{key}"] = row[key]
    for rnd, rows in by_round.items():
        wide[rnd].update(client_level_round(rows))
    for w in wide.values():
        vals = [v for k, v in w.items() if k.endswith("/val_loss")]
        w["val_loss_mean"] = sum(vals) / len(vals) if vals else None
    atomic.write_json(reports_dir / "rounds.json", [wide[r] for r in sorted(wide)], indent=1)


class Recorder:
    """Receives each finished round (rounds.json, MLflow...). The base class only logs."""

    def started(self, plan: Plan, clients: list[str], start_round: int) -> None:
        _federated_log.info("%s: %d clients %s, rounds %d..%d", plan.experiment, len(clients), clients, start_round,
                            plan.train.rounds)

    def round_done(self, plan: Plan, entry: RoundLog, history: list[dict[str, Any]]) -> None:
        losses = ", ".join(f"{r['client']} {r.get('val_loss', float('nan')):.4f}" for r in entry.rows)
        _federated_log.info("%s round %d (%.1fs): val loss %s", plan.experiment, entry.round, entry.seconds, losses)


class TrainRecorder:
    """Per-round bookkeeping shared by both paths: rounds files, MLflow metrics, progress on the console."""

    def __init__(self, plan: Plan, logger=None):
        self.logger = logger
        self.round_seconds: list[float] = []
        self._bar = None

    def started(self, plan: Plan, clients: list[str], start_round: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=plan.train.rounds, initial=start_round - 1, desc=f"{plan.experiment} rounds",
                         unit="round")
        log.info("%s (%s): clients %s, starting at round %d of %d", plan.experiment, plan.method, clients,
                 start_round, plan.train.rounds)

    def round_done(self, plan: Plan, entry: RoundLog, history: list[dict[str, Any]]) -> None:
        self.round_seconds.append(entry.seconds)
        write_rounds(plan, history)
        if self.logger is not None:
            self.logger.log_metrics({"round_seconds": entry.seconds} | round_metrics(entry.rows), step=entry.round)
        if self._bar is not None:
            summary = " ".join(f"{r['client']}={r['val_loss']:.3f}" for r in entry.rows if r.get("val_loss") is not None)
            self._bar.set_postfix_str(f"val {summary}")
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
