"""The local trainer: what one client does with its own data in one round (METHOD.md section 4), for the Flower
ClientApp and for `single` / `centralized` (docs/ARCHITECTURE.md, "Training and federation")."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import transformers

from pipeline.common.schema import read_parquet
from pipeline.datasets.postags import MASK_FIELDS, NounVerbMasks
from pipeline.experiments.plans import Plan
from pipeline.experiments.train_config import LossSettings, TrainConfig
from pipeline.modeling.batching import IGNORE_INDEX, Batch, make_batches
from pipeline.modeling.losses import KDConfig, LossOutput
from pipeline.modeling.model import AdapterSummarizer
from pipeline.training import local_batch, set_engine
from pipeline.training.local_batch import JobOutput, LocalJob, adamw_groups, proximal_term
from pipeline.training.privacy_hooks import PRIVACY as privacy
from pipeline.training.seeds import derived_seed

GATE_LOG_DTYPES = {
    "client": "string",
    "round": "int32",
    "example_id": "string",
    "position": "int32",
    "token_id": "int64",
    "entropy": "float32",
    "kd_applied": "bool",
}


def kd_config(plan: Plan) -> KDConfig:
    """The plan's loss: its method's KD mode, its tau (inf when none) and the `train` keys of the same names."""
    same_names = {f.name: getattr(plan.train, f.name) for f in dataclasses.fields(LossSettings)}
    return KDConfig(mode=plan.spec.kd_mode, tau=plan.tau if plan.tau is not None else float("inf"), **same_names)


@lru_cache(maxsize=2)
def _noun_verb_masks(path: str, mtime: float) -> NounVerbMasks:
    """Hard KD's masks of the target nouns and verbs (stage `postag`), read once per process and file version: the
    columns the masks read, as the stage writes them (a null noun flag is refused, not read as False)."""
    return NounVerbMasks(read_parquet(Path(path), "POS-tag file (stage `postag`)", MASK_FIELDS), path)


# A frame's batches made in this process, by what shapes them (kept with the frame and the tokenizer, so their ids
# are not reused). The runs of a set share a client's frames (pipeline.training.client_data): a client's examples
# are batched once a round for the runs of one seed, and once for every validation (and tokenised once a process:
# pipeline.modeling.batching.tokenize_pairs).
_KEPT: OrderedDict[tuple, tuple[pd.DataFrame, Any, list[Batch]]] = OrderedDict()
KEPT_ENTRIES = 64


def _batches(
    model: AdapterSummarizer, frame: pd.DataFrame, plan: Plan, shuffle: bool, seed: int, bucket: bool
) -> list[Batch]:
    """The frame's batches, kept and shared: read them, do not change them."""
    mcfg, tokenizer = plan.model_config, model.tokenizer
    key = (id(frame), id(tokenizer), mcfg.max_source_length, mcfg.max_target_length, model.decoder_start_token_id)
    key += (model.pad_token_id, plan.train.batch_size, shuffle, seed, bucket)
    if (kept := _KEPT.get(key)) is not None and kept[0] is frame and kept[1] is tokenizer:
        _KEPT.move_to_end(key)
        return kept[2]
    batches = make_batches(frame, model, mcfg, plan.train.batch_size, shuffle, seed, bucket)
    _KEPT[key] = (frame, tokenizer, batches)
    while len(_KEPT) > KEPT_ENTRIES:
        _KEPT.popitem(last=False)
    return batches


@dataclass
class LocalTrainResult:
    n_examples: int
    n_steps: int  # optimizer steps (FedNova's tau_i)
    n_tokens: int  # trained (non-padding) target tokens, summed over epochs
    train_loss: float  # token-weighted mean of the batch losses (without the proximal term)
    ce: float  # mean CE of the local path over trained tokens
    kd: float  # mean KL(q_g || q_l) over the tokens where KD was applied (0 if none)
    kd_fraction: float  # KD tokens / trained tokens
    proximal: float  # last value of mu/2 ||W - W_global||^2
    gate_log: pd.DataFrame = field(repr=False, default=None)
    # DP-SGD (privacy.mode example): the client's setting, and this call's per-example gradients and clipped ones
    privacy: Any = field(repr=False, default=None)  # pipeline.privacy.accounting.ClientPrivacy or None
    dp_examples: int = 0
    dp_clipped: int = 0


def accumulation_steps(batches: list[Batch], accum_steps: int, normalisation: str) -> list[list[tuple[Batch, float]]]:
    """``batches`` as optimizer steps (consecutive windows of ``accum_steps`` batches, the last one possibly shorter),
    each batch with its weight in its step: its target tokens (``tokens``) or sequences (``sequences``) over the
    window's, so accumulated micro-batch means add up to the mean over the effective batch."""
    pairs = [(b, per_example_loss_scale(b, normalisation)) for b in batches]  # integral: exact float sums
    windows = [pairs[start : start + accum_steps] for start in range(0, len(pairs), accum_steps)]
    return [[(b, n / sum(m for _, m in window)) for b, n in window] for window in windows]


def per_example_loss_scale(batch: Batch, normalisation: str, max_target_length: int = 1) -> float:
    """A DP-SGD micro-batch's weight (pipeline.privacy.example_dp): the factor turning ``distillation_loss``'s batch
    mean into the sum of per-example losses, each a function of its example alone (so clipping bounds its
    contribution): ``tokens``, sum_t L_t / max_target_length (a public denominator; the batch mean x N_tokens /
    T_max); ``sequences``, each example's token mean. With ``max_target_length`` 1: the batch's size, its target
    tokens or its sequences with a target token (what :func:`accumulation_steps` weighs a step's batches by)."""
    if normalisation == "tokens":
        return batch.target_tokens / max_target_length
    return float(int(((batch.labels != IGNORE_INDEX).sum(dim=1) > 0).sum()))


class Proximal:
    """FedProx's term ``mu/2 ||W - W_global||^2`` on the local adapter's parameters: as a loss term (the plain
    step) or as its gradient added after DP-SGD's noise (data-independent, outside the clipping)."""

    def __init__(self, params: list[torch.Tensor], reference: list[torch.Tensor], mu: float):
        self.params, self.reference, self.mu = params, reference, mu
        self.value = 0.0  # last value of the term

    def add_gradient(self) -> None:
        with torch.no_grad():
            self.value = float(proximal_term(self.params, self.reference, self.mu))
            for p, r in zip(self.params, self.reference, strict=True):
                p.grad.add_(self.mu * (p - r))


def train_local(
    model: AdapterSummarizer,
    plan: Plan,
    examples: pd.DataFrame,
    *,
    client: str,
    rnd: int,
    proximal_reference: dict[str, torch.Tensor] | None = None,
    proximal_mu: float = 0.0,
    cache=None,
    progress: bool = False,
    redo: int | None = None,
) -> LocalTrainResult:
    """Train ``model``'s local adapter on ``examples`` for ``train.local_epochs`` epochs (deterministic in
    (plan.seed, client, rnd), and ``redo``: a redone round's DP-SGD steps so far, its samples and noise); for KD
    modes the global adapter must already hold the teacher weights. Without privacy the round trains with every
    other client round of the set's barrier (pipeline.training.local_batch); under the plan's ``privacy`` every step
    is a DP-SGD step, here (the caller composes them across rounds). ``cache`` (RunSettings.cache) changes no result."""
    cfg: TrainConfig = plan.train
    mcfg = plan.model_config
    kd = kd_config(plan)
    seed = derived_seed(plan.seed, client, rnd, "train")
    transformers.set_seed(seed)  # Python's, NumPy's and torch's generators
    local = model.adapter_sets["local"]
    local.requires_grad_(True)
    proximal = None
    if proximal_mu > 0.0:
        if proximal_reference is None:
            raise ValueError("train_local: proximal_mu > 0 needs the global weights (proximal_reference)")
        reference = [proximal_reference[k].to(model.device) for k in model.adapter_state("local")]  # parameter order
        proximal = Proximal(model.local_parameters(), reference, proximal_mu)
    masks = None
    if kd.mode == "hard":
        if not (postags := Path(plan.paths["postags"])).exists():
            raise FileNotFoundError(f"{postags}: POS tags not found (stage `postag`); method hardkd needs them")
        masks = _noun_verb_masks(str(postags), postags.stat().st_mtime)

    def dp_step(frame: pd.DataFrame) -> list[tuple[Batch, float]]:  # a DP-SGD step's sample, in order
        batches = make_batches(frame, model, mcfg, cfg.batch_size, False, 0, cfg.bucket_by_length)
        return [(b, per_example_loss_scale(b, kd.loss_normalisation, mcfg.max_target_length)) for b in batches]

    dp_seed = seed if redo is None else derived_seed(seed, "redo", redo)
    stepper = privacy.local_steps(plan, local, examples, dp_seed, client, dp_step, proximal)
    try:
        if stepper is None:
            local.requires_grad_(False)
            # each epoch's shuffled batches in windows of grad_accum_steps, each with its share of the step
            epochs = [
                _batches(model, examples, plan, True, derived_seed(seed, e), cfg.bucket_by_length)
                for e in range(cfg.local_epochs)
            ]
            steps = [s for b in epochs for s in accumulation_steps(b, cfg.grad_accum_steps, cfg.loss_normalisation)]
            job = LocalJob(model, plan, client, rnd, kd, steps, masks, proximal, cache, progress)
            done = set_engine.batched(job, local_batch.train_jobs)
            model.load_adapter_state("local", done.state)
            if job.teacher is not None:
                model.load_adapter_state("global", job.teacher)  # as the caller left it
        else:
            done = _private_round(model, plan, stepper, kd, masks, cache, proximal)
    finally:
        if stepper is not None:
            stepper.close()
        model.train(False)
        local.requires_grad_(False)
    sums = _round_sums([out for _, out in done.outputs])
    tokens = max(sums["tokens"], 1)
    return LocalTrainResult(
        n_examples=len(examples),
        n_steps=done.n_steps,
        n_tokens=sums["tokens"],
        train_loss=sums["loss"] / tokens,
        ce=sums["ce"] / tokens,
        kd=sums["kd"] / sums["kd_tokens"] if sums["kd_tokens"] else 0.0,
        kd_fraction=sums["kd_tokens"] / tokens,
        proximal=done.proximal,
        gate_log=gate_rows(done.outputs if kd.mode != "ce" else [], client, rnd),  # a CE round: an empty log
        privacy=stepper.setting if stepper is not None else None,
        dp_examples=stepper.examples if stepper is not None else 0,
        dp_clipped=stepper.clipped if stepper is not None else 0,
    )


def _private_round(model, plan, stepper, kd, masks, cache, proximal) -> JobOutput:
    """A DP-SGD round (privacy mode example: per-example gradients through the model's own local adapter), alone."""
    from pipeline.modeling.losses import distillation_loss  # looked up per call: tests/reliability.py wraps it

    cfg = plan.train
    optimizer = torch.optim.AdamW(adamw_groups(model.adapter_sets["local"].parameters(), cfg), lr=cfg.lr)
    model.train(True)
    outputs: list[tuple[Batch, LossOutput]] = []  # read once the round's steps are done (no host sync per step)
    n_steps = 0
    for epoch in range(cfg.local_epochs):
        for step in stepper.epoch(epoch):
            optimizer.zero_grad(set_to_none=True)
            for batch, weight in step:
                # KD exactly on target nouns and verbs (the loss moves it to the labels' device); checks the ids match
                hard_mask = None if masks is None else torch.from_numpy(masks.batch(batch.example_ids, batch.labels))
                prefix = cache.prefix_for(model, batch) if cache is not None else model.compute_prefix(batch)
                # packed: the LM head and the loss run only on the real (non-padding) target tokens
                logits_local, logits_global = model.forward_two_paths(
                    batch, prefix, packed=True, teacher=kd.mode != "ce"
                )
                labels = batch.labels.to(model.device)
                out = distillation_loss(logits_local, logits_global, labels, kd, hard_mask=hard_mask)
                stepper.backward(out.loss, weight)
                out.loss = out.loss.detach()
                outputs.append((batch, out))
            stepper.finish()
            optimizer.step()
            n_steps += 1
    return JobOutput(model.adapter_state("local"), outputs, n_steps, proximal.value if proximal is not None else 0.0)


def _round_sums(outputs: list[LossOutput]) -> dict[str, float]:
    """The round's token-weighted loss, CE and KD sums and token counts, read from the device in two transfers once
    the steps are done (not six host syncs a micro-batch), summed in step order (the float sums of a per-step
    reading, to the bit)."""
    sums = dict(loss=0.0, ce=0.0, kd=0.0, tokens=0, kd_tokens=0)
    n_kd = torch.stack([out.gate_rows.sum() for out in outputs]).tolist() if outputs else []
    means = torch.stack([out.means(k) for out, k in zip(outputs, n_kd)]).tolist() if outputs else []
    for out, k, (loss, ce, kd) in zip(outputs, n_kd, means):
        sums["loss"] += loss * out.n_tokens
        sums["ce"] += ce * out.n_tokens
        sums["kd"] += kd * k
        sums["tokens"] += out.n_tokens
        sums["kd_tokens"] += k
    return sums


def empty_gate_log() -> pd.DataFrame:
    return pd.DataFrame({column: pd.Series(dtype=dtype) for column, dtype in GATE_LOG_DTYPES.items()})


def gate_rows(outputs: list[tuple[Batch, LossOutput]], client: str, rnd: int) -> pd.DataFrame:
    """The gate log of a round, one row per trained target token, from each micro-batch's (batch, its loss's entropy
    and gate rows: no gradient) in step order; read from the device once (one frame for the round)."""
    if not outputs:
        return empty_gate_log()
    where = [np.nonzero((b.labels != IGNORE_INDEX).numpy()) for b, _ in outputs]  # the rows' tokens, row-major
    entropy = torch.cat([out.entropy_rows for _, out in outputs])
    gate = torch.cat([out.gate_rows for _, out in outputs])
    return pd.DataFrame(
        {
            "client": [client] * len(entropy),
            "round": rnd,
            "example_id": np.concatenate(
                [np.asarray(b.example_ids, dtype=object)[i] for (b, _), (i, _) in zip(outputs, where)]
            ),
            "position": np.concatenate([t for _, t in where]),
            "token_id": np.concatenate([b.labels.numpy()[i, t] for (b, _), (i, t) in zip(outputs, where)]),
            "entropy": entropy.cpu().numpy(),
            "kd_applied": gate.cpu().numpy(),
        }
    ).astype(GATE_LOG_DTYPES)


def validation_loss(model: AdapterSummarizer, plan: Plan, examples: pd.DataFrame, cache=None) -> tuple[float, int]:
    """Mean token CE of the local path on ``examples`` (teacher forcing, float32) and the number of tokens; at the
    set's barrier with every other validation of the round, adapters stacked (pipeline.training.local_batch)."""
    if len(examples) == 0:
        return float("nan"), 0
    steps = [[(b, 1.0)] for b in _batches(model, examples, plan, False, 0, False)]  # one micro-batch a step
    job = LocalJob(model, plan, "validation", 0, None, steps, cache=cache)
    return set_engine.batched(job, local_batch.validate_jobs)
