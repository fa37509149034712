"""Where a training run keeps its state while it runs (``data/cache/runs/<exp>-<key>/``: ``clients/<client>/`` and
``checkpoint/``), its round checkpoints (tagged with the hashes of the plan, the training code, the backbone and the
data files) and the publishing of its outputs."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from pipeline.common import atomic
from pipeline.common.integrity import file_hash, read_record, sha256_dir
from pipeline.common.schema import DataError, read_json
from pipeline.experiments.plans import Plan
from pipeline.modeling.adapters import adapter_file, save_adapter

log = logging.getLogger("fedmeet.train")

TRAINED_FLAG = "trained"  # in a client checkpoint's progress: 0 while the client has not trained yet
DP_STEPS = "dp-steps"  # in a client checkpoint's progress: DP-SGD steps so far, so a resumed client keeps composing
DP_RELEASES = "client-dp-releases.json"  # in checkpoint_dir: client-level DP's releases of each round so far


def checkpoint_dir(plan: Plan) -> Path:
    """``<run dir>/checkpoint/``: everything a killed run resumes from (removed when the run finishes)."""
    return Path(plan.paths["out_dir"]) / "checkpoint"


def server_checkpoint_path(plan: Plan) -> Path:
    return checkpoint_dir(plan) / "server.pt"  # the federated server's: global adapter, strategy state, RNG, history


def local_checkpoint_path(plan: Plan) -> Path:
    return checkpoint_dir(plan) / "local.pt"  # single / centralized: every unit's adapter, progress, history


def mlflow_run_id_path(plan: Plan) -> Path:
    return checkpoint_dir(plan) / "mlflow_run_id"  # a resumed training continues its MLflow run


def client_output_dir(plan: Plan, client: str) -> Path:
    """A client's adapters and gate log (a deployed client may set its own: node config ``client-dir``)."""
    return Path(plan.paths["out_dir"]) / "clients" / client


def client_checkpoint_dir(plan: Plan, client: str) -> Path:
    """A client's round checkpoints (a deployed client may set its own: node config ``checkpoint-dir``)."""
    return checkpoint_dir(plan) / "clients" / client


@lru_cache(maxsize=1)
def code_hash() -> str:
    """The code a run's rounds are computed by: every source file of the package below its results (a checkpoint
    written by other training code is not resumed: it would mix two versions' rounds in one run)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*.py") if p.relative_to(package).parts[0] != "results"):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


INPUTS = ("backbone", "partition", "examples", "postags")  # the plan's paths a run trains on, besides the plan


@lru_cache(maxsize=32)
def _content_hash(path: Path, stats: tuple) -> str:
    """sha256 of a file, or of a model directory (its record's ``backbone_sha256``, which loading checks, else its
    content hash); once per process and version of the files (``stats``: their paths, mtimes and sizes)."""
    if path.is_file():
        return file_hash(path)
    return read_record(path).get("backbone_sha256") or sha256_dir(path)


def input_hash(path: str | Path) -> str:
    """What a run read at ``path`` (a file or a directory), "absent" when nothing is there."""
    p = Path(path).resolve()
    files = sorted(f for f in (p.rglob("*") if p.is_dir() else [p]) if f.is_file())
    stats = tuple((str(f), (st := f.stat()).st_mtime_ns, st.st_size) for f in files)
    return _content_hash(p, stats) if files else "absent"


def checkpoint_identity(plan: Plan) -> dict[str, str]:
    """What a round checkpoint must match to be resumed: the plan's configuration, the training code and what the
    run trains on besides the plan (the backbone, the partition, the examples: rebuilt or re-partitioned under the
    same plan, a killed run starts over rather than mixing two trainings)."""
    inputs = {f"{name}_hash": input_hash(plan.paths[name]) for name in INPUTS if name in plan.paths}
    return {"plan_hash": plan.hash, "code_hash": code_hash(), **inputs}


def save_round_checkpoint(path: Path, plan: Plan, rnd: int, state: dict[str, Any]) -> None:
    with atomic.replacing(path) as tmp:
        torch.save({**checkpoint_identity(plan), "round": rnd, **state}, tmp)


def load_round_checkpoint(path: Path, plan: Plan, start_over: bool = False) -> dict[str, Any] | None:
    """What :func:`save_round_checkpoint` wrote, or None: no checkpoint, or one of another identity (the warning
    names which part differs); a file torch cannot read raises DataError naming it (a deployed server reads its own),
    or with ``start_over`` (the in-process run) is None, with the warning naming it."""
    if not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=False)  # our own file, written by save_round_checkpoint
    except Exception as exc:  # noqa: BLE001 -- torch's UnpicklingError, RuntimeError (a cut zip), EOFError, ...
        why = f"unreadable round checkpoint ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
        if not start_over:
            raise DataError(f"{path}: {why}; delete it to start the run over") from None
        log.warning("%s: %s; starting over", path, why)
        return None
    for key, value in checkpoint_identity(plan).items():
        if state.get(key) != value:
            name = key.removesuffix("_hash")
            why = {"plan": "another configuration", "code": "other training code"}.get(name)
            why = why or f"another {name} ({plan.paths[name]} changed since)"
            log.warning("%s: checkpoint belongs to %s; starting over", path, why)
            return None
    return state


def has_valid_checkpoint(plan: Plan) -> bool:
    """Whether the experiment's outputs belong to an unfinished run of this plan and code (then they are resumed)."""
    path = next((p for p in (server_checkpoint_path(plan), local_checkpoint_path(plan)) if p.exists()), None)
    return path is not None and load_round_checkpoint(path, plan, start_over=True) is not None


@dataclass
class ClientCheckpoint:
    round: int
    progress: dict[str, float]
    trained: bool
    dp_steps: int | None
    adapter: Path


def round_files(folder: Path, suffix: str) -> dict[int, Path]:
    """The ``round<N><suffix>`` files in ``folder`` by round N: ours only (a "round002-old" copy is none)."""
    named = ((p.stem[len("round") :], p) for p in folder.glob(f"round*{suffix}"))
    return {int(n): p for n, p in named if n.isdigit()}


def latest_client_checkpoint(ckpt: Path, before: int) -> ClientCheckpoint | None:
    """The client's latest complete checkpoint (its adapter and progress) of a round before ``before``, or None."""
    done = sorted(r for r in round_files(ckpt, ".safetensors") if r < before and (ckpt / f"round{r:03d}.json").exists())
    if not done:
        return None
    progress = read_json(ckpt / f"round{done[-1]:03d}.json", "client round checkpoint")
    trained = bool(progress.pop(TRAINED_FLAG, 1))
    dp_steps = int(progress.pop(DP_STEPS)) if DP_STEPS in progress else None
    return ClientCheckpoint(done[-1], progress, trained, dp_steps, ckpt / f"round{done[-1]:03d}.safetensors")


def write_client_checkpoint(
    ckpt: Path, rnd: int, adapter: Path, progress: dict[str, float], trained: bool, dp_steps: int | None
) -> None:
    """Client-side checkpoint of round ``rnd``: ``adapter`` (the client's final adapter of this round, linked, not
    written again) and its progress; the previous round's stays until the server's checkpoint of this round exists,
    so a kill in between still finds a consistent state."""
    atomic.link(adapter, ckpt / f"round{rnd:03d}.safetensors")
    steps = {DP_STEPS: dp_steps} if dp_steps is not None else {}
    atomic.write_text(ckpt / f"round{rnd:03d}.json", json.dumps({**progress, TRAINED_FLAG: int(trained), **steps}))
    for old in round_files(ckpt, ".safetensors"):
        if old < rnd - 1 or old > rnd:
            (ckpt / f"round{old:03d}.safetensors").unlink(missing_ok=True)
            (ckpt / f"round{old:03d}.json").unlink(missing_ok=True)


def initial_progress() -> dict[str, float]:
    return {"best-val-loss": math.inf, "best-round": 0}


def keep_best_and_final(
    out: Path,
    plan: Plan,
    client: str,
    rnd: int,
    val_loss: float,
    state: dict[str, torch.Tensor],
    progress: dict[str, float],
) -> dict[str, float]:
    """Save the round's adapter as ``adapter_final`` and, when its validation loss beats the client's best so
    far, as ``adapter_best`` (the same file: linked); returns the client's progress after this round."""
    meta = {"experiment": plan.experiment, "client": client, "round": str(rnd), "val_loss": f"{val_loss:.6f}"}
    save_adapter(adapter_file(out, "final"), state, meta)
    if val_loss < progress["best-val-loss"]:  # a NaN loss: never best
        progress = {"best-val-loss": float(val_loss), "best-round": rnd}
        atomic.link(adapter_file(out, "final"), adapter_file(out, "best"))
    return progress


def publish_outputs(plan: Plan) -> None:
    """Copy a finished run's outputs from its run directory into ``models/<exp>/``, replacing what was there as a
    whole. The caller removes the run directory: a kill before that publishes again."""
    source, target = Path(plan.paths["out_dir"]), Path(plan.paths["model_dir"])

    def run_only(directory: str, names: list[str]) -> set[str]:
        # the checkpoints, and the clients' per-round gate log parts (merged into gate_log.parquet by now)
        here = Path(directory)
        if here == source:
            return {"checkpoint"} & set(names)
        return {"gate_log"} & set(names) if here.parent == source / "clients" else set()

    tmp = atomic.temp_dir_for(target)
    shutil.copytree(source, tmp, ignore=run_only, dirs_exist_ok=True)
    atomic.replace_dir(tmp, target)
