"""The best adapter: every round a client's validation loss is compared with its best so far; the adapter is saved
as ``adapter_final`` and, when better, as ``adapter_best`` (both engines: pipeline.federation.client_app and
pipeline.training.serverless)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from pipeline.modeling.adapter_io import adapter_file, save_adapter
from pipeline.experiments import Plan


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
