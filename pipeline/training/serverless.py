"""`single` (one adapter per client, own data) and `centralized` (one adapter on the pooled data, tested on every
client): the local trainer and the round rules of pipeline.training, without a server."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pandas as pd
import torch

from pipeline.common.schema import DataError
from pipeline.experiments.plans import Plan
from pipeline.experiments.settings import CacheConfig
from pipeline.training import checkpoints
from pipeline.training import client_training as local_training  # a module attribute: tests wrap train_local
from pipeline.training.client_data import client_data, client_names
from pipeline.training.history import TrainRecorder, history_row, training_rounds
from pipeline.training.set_engine import park
from pipeline.training.shared_model import initial_adapter_state, prefix_cache_for, shared_model

log = logging.getLogger("fedmeet.train")


def round_window(n_rows: int, window: int, rnd: int, seed: int) -> np.ndarray:
    """The pooled rows AdaCentralized trains on in round ``rnd`` (train.centralized_steps: largest_client): the
    ``window`` rows after the previous round's in one seeded permutation, wrapping around, so every example is
    used equally often and a resumed run picks the same rows."""
    order = np.random.default_rng(seed).permutation(n_rows)
    return order[((rnd - 1) * window + np.arange(min(window, n_rows))) % n_rows]


def run_serverless(plan: Plan, recorder: TrainRecorder, cache_settings: CacheConfig) -> list[dict[str, Any]]:
    """The federated methods' trainer and round structure without a server: every round each client's validation
    loss picks its best adapter, and the round is checkpointed (``checkpoint/local.pt``, resumed by a rerun).
    ``cache_settings``: RunSettings.cache, from the stage entry point. In a set, its units' training and its clients'
    validations execute at the set's round barrier with the other runs' clients (set_engine.park)."""
    names = client_names(plan)
    datas = {n: client_data(plan, n) for n in names}
    if unvalidated := [n for n in names if len(datas[n].valid) == 0]:
        raise DataError(f"{plan.paths['partition']}: client {unvalidated[0]!r} has no valid examples: no best round")
    model = shared_model(plan)
    cache = prefix_cache_for(plan, model, cache_settings)
    window = None
    unit_of = {n: "pooled" if plan.spec.pooled else n for n in names}  # the adapter each client is tested with
    if plan.spec.pooled:
        units = {"pooled": pd.concat([datas[n].train for n in names], ignore_index=True)}
        if plan.train.centralized_steps == "largest_client":
            window = max(len(datas[n].train) for n in names)
    else:
        units = {n: datas[n].train for n in names}

    ckpt_path = checkpoints.local_checkpoint_path(plan)
    if (ckpt := checkpoints.load_round_checkpoint(ckpt_path, plan)) is not None:
        adapters, progress, history = ckpt["adapters"], ckpt["progress"], ckpt["history"]
    else:
        history, adapters = [], {u: initial_adapter_state(plan) for u in units}  # a copy each
        progress = {n: checkpoints.initial_progress() for n in names}

    for rnd in training_rounds(plan, recorder, names, ckpt, history, log):

        def train(unit: str, rnd: int = rnd) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            train_df = units[unit]
            if window is not None:
                train_df = train_df.iloc[round_window(len(train_df), window, rnd, plan.seed)]
            model.load_adapter_state("local", adapters[unit])
            res = local_training.train_local(model, plan, train_df, client=unit, rnd=rnd, cache=cache)
            metrics = ("n_examples", "n_steps", "n_tokens", "train_loss", "ce", "kd", "kd_fraction")
            return model.adapter_state("local"), {k: getattr(res, k) for k in metrics}

        def validate(n: str) -> tuple[float, int]:
            model.load_adapter_state("local", adapters[unit_of[n]])
            return local_training.validation_loss(model, plan, datas[n].valid, cache=cache)

        trained: dict[str, dict[str, Any]] = {}
        for unit, (state, metrics) in zip(units, park(train, list(units))):
            adapters[unit], trained[unit] = state, metrics
        for n, (val, val_tokens) in zip(names, park(validate, names)):
            unit = unit_of[n]
            progress[n] = checkpoints.keep_best_and_final(
                checkpoints.client_output_dir(plan, n), plan, n, rnd, val, adapters[unit], progress[n]
            )
            validated = {"val_loss": val, "val_tokens": val_tokens, "best_round": progress[n]["best-round"]}
            history.append(history_row(rnd, n, 1) | trained[unit] | validated)
        checkpoints.save_round_checkpoint(
            ckpt_path, plan, rnd, {"adapters": adapters, "progress": progress, "history": history}
        )
    return history
