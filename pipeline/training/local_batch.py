"""Local training of many clients' rounds at once (docs/ARCHITECTURE.md, "Training and federation"): every round of
a set's runs reaches :func:`train_jobs` together (pipeline.training.set_engine's barrier), and the jobs whose
micro-batches have the same sizes in the same steps train as one group: the top layers and the LM head run over R
run-major blocks with the R runs' adapters stacked (pipeline.modeling.adapter_stack), each run's loss, KD gate and
proximal term its own (a micro-batch's losses in one call: pipeline.modeling.losses.distillation_losses). Where the
runs' micro-batches coincide (the same client, examples and seed: batch order depends only on seed, client and
round) the frozen prefix is computed (or read from the cache) once and repeated; where they differ (another seed
or round) the blocks are the runs' own micro-batches padded to one shape (a shorter one filled with copies of its
first example whose labels are ignored), which changes a run's result by float32 rounding only. Jobs with another
number of steps or micro-batches form groups of their own, trained one after the other. The optimizer is one AdamW
over the stacked leaves, each run's own AdamW elementwise (jobs of a group share its settings: they are part of the
group's key). On CUDA the student's forward runs under bf16 autocast, the teacher's in float32
(:func:`stacked_logits`); the loss computes entropy, softmax and KL in float32 (pipeline.modeling.losses). Token ids
and labels stay on the host, where counts and row indices are read, and reach the device by asynchronous copies: a
micro-batch makes no host sync.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from pipeline.datasets.postags import NounVerbMasks
from pipeline.experiments.plans import Plan
from pipeline.experiments.train_config import TrainConfig
from pipeline.modeling import losses
from pipeline.modeling.adapter_stack import AdapterStack
from pipeline.modeling.batching import IGNORE_INDEX, Batch, stack_batches
from pipeline.modeling.losses import KDConfig, LossOutput
from pipeline.modeling.model import AdapterSummarizer, Prefix

log = logging.getLogger(__name__)
# what this process trained (and validated) batched: tests, benchmarks
STATS = {"groups": 0, "stacked_steps": 0, "runs_stacked": 0, "validation_groups": 0}
# A group's micro-batch holds every run's student logits ([target tokens, V]; the teacher's and the gradient about
# as much again each): groups are cut where this budget of float32 student logits would be exceeded (on a GPU, an
# eighth of its memory if that is more: an H100's 80 GB hold ~40 of the GPU study's jobs a group instead of ~8).
LOGITS_BUDGET_BYTES = 2 * 2**30


def logits_budget_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return LOGITS_BUDGET_BYTES
    return max(LOGITS_BUDGET_BYTES, torch.cuda.get_device_properties(device).total_memory // 8)


@dataclass
class LocalJob:
    """One client's local round, ready to train: its starting adapters, its teacher (two-path modes) and every
    epoch's optimizer steps, each a list of (micro-batch, its weight in the step)."""

    model: AdapterSummarizer
    plan: Plan
    client: str
    rnd: int
    kd: KDConfig | None  # None: a validation
    steps: list[list[tuple[Batch, float]]]
    masks: NounVerbMasks | None = None
    proximal: Any = None  # FedProx's term (pipeline.training.client_training.Proximal) or None
    cache: Any = None  # the prefix cache (pipeline.modeling.cache.PrefixCache) or None
    progress: bool = False  # show a progress bar over the steps
    # the model's adapters when the job is made: the local one it starts from, the teacher of a two-path mode
    local: dict[str, torch.Tensor] = field(init=False, repr=False)
    teacher: dict[str, torch.Tensor] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.local = self.model.adapter_state("local")
        self.teacher = self.model.adapter_state("global") if self.kd is not None and self.kd.mode != "ce" else None

    def group_key(self) -> tuple:
        """Jobs with equal keys have as many micro-batches in each step and the optimizer's settings: they train
        stacked (micro-batches of other sizes padded to one: another seed's order puts a short batch elsewhere)."""
        cfg = self.plan.train
        micro_batches = tuple(len(step) for step in self.steps)
        lengths = (self.plan.model.get("max_source_length"), self.plan.model.get("max_target_length"))
        return (
            id(self.model),
            id(self.cache),
            cfg.lr,
            cfg.weight_decay,
            cfg.decay_norm_and_bias,
            lengths,
            micro_batches,
        )


@dataclass
class JobOutput:
    state: dict[str, torch.Tensor]  # the trained local adapter (AdapterSet.state())
    outputs: list[tuple[Batch, LossOutput]] = field(repr=False)  # every micro-batch's loss, in step order
    n_steps: int
    proximal: float  # the last value of the proximal term (0 without)


def adamw_groups(params, cfg: TrainConfig, matrix_ndim: int = 2) -> list[dict[str, Any]]:
    """AdamW parameter groups: weight decay on the adapter matrices only (``matrix_ndim`` dimensions: 3 for stacked
    leaves, a run's own matrix); LayerNorm weights and biases (every parameter with fewer dimensions) are not decayed
    unless ``train.decay_norm_and_bias``."""
    decay, no_decay = [], []
    for p in params:
        (decay if p.ndim >= matrix_ndim or cfg.decay_norm_and_bias else no_decay).append(p)
    return [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def proximal_term(params: list[torch.Tensor], reference: list[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's ``mu/2 ||W - W_global||^2`` over ``params`` and their global values ``reference``."""
    return 0.5 * mu * sum(((p - ref) ** 2).sum() for p, ref in zip(params, reference, strict=True))


def stacked_logits(
    model: AdapterSummarizer,
    prefix: Prefix,
    labels: torch.Tensor,
    source_mask: torch.Tensor,
    local: AdapterStack,
    teacher: AdapterStack | None,
    taught: int,
    bf16: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The packed logits of one micro-batch of every run of a group, ``prefix``, ``labels`` and ``source_mask`` (host)
    in R run-major blocks: the student's [sum of the runs' target tokens, V] (with gradients; under bf16 autocast if
    ``bf16``: the trainer's choice on CUDA), the teacher's for the first ``taught`` runs (under no_grad, float32: a
    bf16 teacher moves the gate: reports/bench/engine.md, section 3). Rows and masks are read on the host (no sync)."""
    device = prefix.decoder_hidden.device
    masks = model.top_masks(prefix, source_mask)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        student = model.path_logits(prefix, local, masks, labels)
    if teacher is None:
        return student, None
    rows = labels.shape[0] // local.runs * taught  # the taught runs' blocks lead (every run's: all rows, views)
    taught_prefix = Prefix(*(t[:rows] for t in vars(prefix).values()))
    taught_masks = masks if taught == local.runs else model.top_masks(taught_prefix, source_mask[:rows])
    with torch.no_grad():
        return student, model.path_logits(taught_prefix, teacher, taught_masks, labels[:rows])


def _micro_batch(jobs: list[LocalJob], s: int, m: int) -> tuple[Prefix, torch.Tensor, torch.Tensor, list[Batch]]:
    """Step ``s``'s micro-batch ``m`` of every job as R run-major blocks: the prefix (computed or read from the cache
    once when the jobs share the micro-batch, else for their micro-batches padded to one size), the labels (the rows
    that only fill a block ignored) and source mask (host), and each job's own rows (what its losses line up with)."""
    model, cache, runs = jobs[0].model, jobs[0].cache, len(jobs)
    batches = [job.steps[s][m][0] for job in jobs]
    shared = all(b.example_ids == batches[0].example_ids for b in batches)
    rows = max(len(b) for b in batches)  # a block's rows where they differ
    batch = batches[0] if shared else stack_batches(batches, model.pad_token_id, rows)
    prefix = cache.prefix_for(model, batch) if cache is not None else model.compute_prefix(batch)
    if shared:
        return prefix.repeat(runs), batch.labels.repeat(runs, 1), batch.attention_mask.repeat(runs, 1), batches
    labels = batch.labels.clone()
    for r, b in enumerate(batches):
        labels[r * rows + len(b) : (r + 1) * rows] = IGNORE_INDEX
    blocks = [batch.select(slice(r * rows, r * rows + len(b))) for r, b in enumerate(batches)]
    return prefix, labels, batch.attention_mask, blocks


def train_group(jobs: list[LocalJob]) -> list[JobOutput]:
    """Train ``jobs`` (one group: equal :meth:`LocalJob.group_key`) together, those with a teacher first (their
    teacher's rows then lead the packed rows: one loss call for the group). The loss is looked up per call
    (tests/reliability.py wraps it)."""
    order = sorted(range(len(jobs)), key=lambda r: jobs[r].teacher is None)
    jobs = [jobs[r] for r in order]
    model, cfg = jobs[0].model, jobs[0].plan.train
    device, template = model.device, model.adapter_sets["local"]
    runs = len(jobs)
    local = AdapterStack([j.local for j in jobs], template, device)
    taught = [r for r, j in enumerate(jobs) if j.teacher is not None]
    teacher = (
        AdapterStack([jobs[r].teacher for r in taught], template, device).requires_grad_(False) if taught else None
    )
    leaves = [local.parameter_of(k) for k in local.keys]  # in AdapterSet.state() order
    optimizer = torch.optim.AdamW(adamw_groups(leaves, cfg, 3), lr=cfg.lr)
    proximal = [torch.zeros(())] * runs
    outputs: list[list[tuple[Batch, LossOutput]]] = [[] for _ in jobs]
    STATS["groups"] += 1
    STATS["runs_stacked"] += runs
    bar = f"{jobs[0].client} round {jobs[0].rnd} ({runs} runs)"
    model.train(True)
    try:
        for s, step in enumerate(tqdm(jobs[0].steps, desc=bar, leave=False, disable=not any(j.progress for j in jobs))):
            optimizer.zero_grad(set_to_none=True)
            for m in range(len(step)):
                prefix, labels, source_mask, batches = _micro_batch(jobs, s, m)
                logits, teacher_logits = stacked_logits(
                    model, prefix, labels, source_mask, local, teacher, len(taught), device.type == "cuda"
                )
                hard = [  # hard KD exactly on target nouns and verbs; checks the tagged ids match
                    None if j.masks is None else torch.from_numpy(j.masks.batch(b.example_ids, b.labels))
                    for j, b in zip(jobs, batches)
                ]
                loss, outs = losses.distillation_losses(
                    logits, teacher_logits, [b.labels for b in batches], [j.kd for j in jobs], hard
                )
                weights = torch.tensor([job.steps[s][m][1] for job in jobs]).to(device, non_blocking=True)
                total = (loss * weights).sum()  # each run's loss weighted in its step
                for r, (job, out) in enumerate(zip(jobs, outs)):
                    if job.proximal is not None:
                        proximal[r] = proximal_term([p[r] for p in leaves], job.proximal.reference, job.proximal.mu)
                        total = total + proximal[r] * job.steps[s][m][1]
                    out.loss = out.loss.detach()
                    outputs[r].append((batches[r], out))
                total.backward()
                STATS["stacked_steps"] += 1
            optimizer.step()
    finally:
        model.train(False)
    trained = [
        JobOutput(state, outputs[r], len(jobs[0].steps), float(proximal[r].detach()))
        for r, state in enumerate(local.states())
    ]
    return [trained[order.index(r)] for r in range(runs)]


@torch.no_grad()
def validate_group(jobs: list[LocalJob]) -> list[tuple[float, int]]:
    """Each job's mean token CE of its local adapter on its micro-batches (teacher forcing, float32) and its number
    of tokens, the jobs' adapters stacked (one group)."""
    model, runs = jobs[0].model, len(jobs)
    local = AdapterStack([j.local for j in jobs], model.adapter_sets["local"], model.device).requires_grad_(False)
    sums: list[list[torch.Tensor]] = [[] for _ in jobs]
    counts = [0] * runs
    STATS["validation_groups"] += 1
    model.train(False)
    for s in range(len(jobs[0].steps)):
        prefix, labels, source_mask, _ = _micro_batch(jobs, s, 0)
        logits, _ = stacked_logits(model, prefix, labels, source_mask, local, None, 0, False)
        start = 0  # where the run's rows start in the packed logits
        for r, block in enumerate(labels.view(runs, -1, labels.shape[1])):  # each run's block of the (host) labels
            y = block[block != IGNORE_INDEX].to(model.device, non_blocking=True)  # its length: a shape, no sync
            student = logits[start : start + len(y)].float()
            sums[r].append(torch.nn.functional.cross_entropy(student, y, reduction="sum"))
            counts[r] += len(y)
            start += len(y)
    # read in one transfer (one host sync, not one a run and micro-batch); summed on the host in micro-batch order
    read = torch.stack([torch.stack(run_sums) for run_sums in sums]).tolist()
    return [(sum(read[r]) / max(counts[r], 1), counts[r]) for r in range(runs)]


def train_jobs(jobs: list[LocalJob]) -> list[JobOutput | Exception]:
    """Every job's output in order (an exception for each job of a group that failed), the jobs trained in groups
    (train_group looked up per call: tests/reliability.py wraps it)."""
    return _in_groups(jobs, train_group)


def validate_jobs(jobs: list[LocalJob]) -> list[tuple[float, int] | Exception]:
    """Every job's validation loss and tokens in order (:func:`validate_group`), the jobs in groups."""
    return _in_groups(jobs, validate_group)


def _in_groups(jobs: list[LocalJob], group_call) -> list:
    """``group_call``'s result for each job, the jobs of each :meth:`LocalJob.group_key` in consecutive groups whose
    largest micro-batch's student logits (float32, every run's target tokens) stay within :func:`logits_budget_bytes`
    (a job alone may exceed it)."""
    groups: dict[tuple, list[list[int]]] = {}
    used: dict[tuple, int] = {}  # the bytes of each key's last group
    for i, job in enumerate(jobs):
        key = job.group_key()
        vocabulary = job.model.backbone.get_output_embeddings().weight.shape[0]
        need = 4 * vocabulary * max(b.target_tokens for step in job.steps for b, _ in step)
        if key not in groups or used[key] + need > logits_budget_bytes(job.model.device):
            groups.setdefault(key, []).append([])
            used[key] = 0
        groups[key][-1].append(i)
        used[key] += need
    results: dict[int, JobOutput | Exception] = {}
    for members in (group for same in groups.values() for group in same):
        outs = _outputs_or_error(group_call, [jobs[i] for i in members])
        if len(members) > 1 and isinstance(outs[0], Exception):  # one job's error fails no other: each alone
            log.warning("a group of %d jobs failed (%s); each is trained alone", len(members), outs[0])
            outs = [_outputs_or_error(group_call, [jobs[i]])[0] for i in members]
        results.update(zip(members, outs))
    return [results[i] for i in range(len(jobs))]


def _outputs_or_error(group_call, group: list[LocalJob]) -> list:
    try:
        return group_call(group)
    except Exception as exc:  # noqa: BLE001 -- each job's caller raises it (its client's error reply)
        return [exc] * len(group)
