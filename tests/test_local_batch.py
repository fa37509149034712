"""Client rounds trained together (pipeline/training/local_batch.py): runs of different methods whose rounds share
their micro-batches (same client, examples and seed) train as one stacked group, and each ends where it ends trained
alone: its adapter, losses, KD share and gate log (tiny BART, CPU, float32); so do rounds whose micro-batches
differ, in length or in size (padded to one shape); steps of other numbers of micro-batches train in groups of their
own."""

from __future__ import annotations

import traceback
import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from pipeline.training.client_training import gate_rows
from tests.test_federated import workspace, write_plan, ws  # noqa: F401  (fixtures)
from tests.test_local_training import CLIENT, _setup, _train

# one local method per loss: CE, selective KD, KD on every token, hard KD, CE with FedProx's proximal term
METHODS = ["fedavg", "fedselectkd", "fedkd", "hardkd", "fedprox"]


def _jobs(monkeypatch, batch_size: int = 2):
    """Each method's round trained alone (its result and adapter), and the job it made."""
    from pipeline.training import local_batch, set_engine

    made, alone = [], {}
    real = set_engine.batched

    def keep(job, run):
        made.append(job)
        return real(job, run)

    monkeypatch.setattr(set_engine, "batched", keep)
    for method in METHODS:
        plan, model, train, w0 = _setup(f"group-{method}-{batch_size}", method, lr=5e-3, batch_size=batch_size)
        generator = torch.Generator().manual_seed(len(alone))  # each run its own teacher
        model.load_adapter_state(
            "global", {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in w0.items()}
        )
        mu = plan.train.strategy_params["proximal_mu"] if plan.spec.proximal else 0.0
        result = _train(plan, model, train, proximal_reference=w0 if mu else None, proximal_mu=mu)
        alone[method] = (result, model.adapter_state("local"))
    monkeypatch.setattr(set_engine, "batched", real)
    return made, alone, local_batch


def test_runs_sharing_micro_batches_train_stacked_and_each_as_alone(ws, monkeypatch):
    jobs, alone, local_batch = _jobs(monkeypatch)
    assert len({job.group_key() for job in jobs}) == 1
    from pipeline.modeling.model import AdapterSummarizer

    computed, compute_prefix = [], AdapterSummarizer.compute_prefix  # patched on the class: the model is shared
    monkeypatch.setattr(
        AdapterSummarizer, "compute_prefix", lambda m, b: computed.append(len(b)) or compute_prefix(m, b)
    )
    before = dict(local_batch.STATS)
    outputs = local_batch.train_jobs(jobs)
    # the frozen prefix of a micro-batch the runs share: computed once, for its own rows (then repeated)
    assert computed == [len(b) for step in jobs[0].steps for b, _ in step]
    assert (
        local_batch.STATS["groups"] - before["groups"],
        local_batch.STATS["runs_stacked"] - before["runs_stacked"],
        local_batch.STATS["stacked_steps"] - before["stacked_steps"],  # one a micro-batch of the group
    ) == (
        1,
        len(METHODS),
        sum(len(step) for step in jobs[0].steps),
    )
    for method, job, out in zip(METHODS, jobs, outputs):
        result, state = alone[method]
        assert max(float((out.state[k] - state[k]).abs().max()) for k in state) <= 1e-6, method
        assert out.n_steps == result.n_steps
        losses = sum(float(o.loss) * o.n_tokens for _, o in out.outputs) / sum(o.n_tokens for _, o in out.outputs)
        assert losses == pytest.approx(result.train_loss, rel=1e-6), method
        if job.teacher is not None:
            log = gate_rows(out.outputs, CLIENT, 1)
            assert log["kd_applied"].tolist() == result.gate_log["kd_applied"].tolist(), method
            assert log["entropy"].to_numpy() == pytest.approx(result.gate_log["entropy"].to_numpy(), abs=1e-5)
        if method == "fedprox":
            assert out.proximal > 0 and out.proximal == pytest.approx(result.proximal, rel=1e-5)
    assert any(job.teacher is None for job in jobs) and any(job.masks is not None for job in jobs)


def test_rounds_with_other_micro_batches_train_stacked_padded_and_each_as_alone(ws, monkeypatch):
    """Rounds 1 and 2 of a client shuffle its examples differently: their micro-batches, of other lengths and (length
    buckets permuted: the odd example's batch elsewhere) other sizes, padded to one shape, train as one group, each
    run within float32 rounding of its round trained alone."""
    from pipeline.training import local_batch, set_engine

    made, alone = [], []
    real = set_engine.batched

    def keep(job, run):
        made.append(job)
        return real(job, run)

    monkeypatch.setattr(set_engine, "batched", keep)
    for rnd, method in ((1, "fedselectkd"), (2, "fedselectkd"), (3, "fedavg")):
        plan, model, train, w0 = _setup(f"padded-{method}", method, lr=5e-3, batch_size=2, bucket_by_length=True)
        # short and long targets (max_target_length 12): a micro-batch of one round is narrower than another's
        train = train.assign(target=[" ".join(t.split()[: 1 + 9 * (i % 2)]) for i, t in enumerate(train["target"])])
        train = train.iloc[: len(train) - 1 + len(train) % 2]  # an odd number: one micro-batch holds one example
        model.load_adapter_state("global", {k: v + 0.05 * rnd for k, v in w0.items()})
        result = _train(plan, model, train, rnd=rnd)
        alone.append((result, model.adapter_state("local")))
    monkeypatch.setattr(set_engine, "batched", real)
    ids = [[b.example_ids for step in job.steps for b, _ in step] for job in made]
    assert ids[0] != ids[1] != ids[2] and len({job.group_key() for job in made}) == 1
    widths = [[b.labels.shape[1] for step in job.steps for b, _ in step] for job in made]
    assert any(len(set(w)) > 1 for w in zip(*widths)), "no micro-batch needed padding: nothing here tests it"
    sizes = [[len(b) for step in job.steps for b, _ in step] for job in made]
    assert any(len(set(n)) > 1 for n in zip(*sizes)), "no micro-batch needed filling: nothing here tests it"
    before = local_batch.STATS["groups"]
    outputs = local_batch.train_jobs(made)
    assert local_batch.STATS["groups"] - before == 1
    for job, out, (result, state) in zip(made, outputs, alone):
        assert max(float((out.state[k] - state[k]).abs().max()) for k in state) <= 1e-6, job.rnd
        mean = sum(float(o.loss) * o.n_tokens for _, o in out.outputs) / sum(o.n_tokens for _, o in out.outputs)
        assert mean == pytest.approx(result.train_loss, rel=1e-5)
        if job.teacher is not None:
            log = gate_rows(out.outputs, CLIENT, job.rnd)
            assert log["kd_applied"].tolist() == result.gate_log["kd_applied"].tolist()


def test_rounds_with_other_numbers_of_steps_form_their_own_group(ws, monkeypatch):
    jobs, _, local_batch = _jobs(monkeypatch)
    other, _, _ = _jobs(monkeypatch, batch_size=3)  # fewer steps
    keys = {job.group_key() for job in jobs + other}
    assert len(keys) == 2
    before = local_batch.STATS["groups"]
    local_batch.train_jobs([jobs[0], other[0], jobs[1]])
    assert local_batch.STATS["groups"] - before == 2


def test_a_group_beyond_the_logits_budget_is_cut_into_groups_that_fit(ws, monkeypatch):
    jobs, alone, local_batch = _jobs(monkeypatch)
    vocabulary = jobs[0].model.backbone.get_output_embeddings().weight.shape[0]
    peak = max(int((b.labels != -100).sum()) for step in jobs[0].steps for b, _ in step)
    monkeypatch.setattr(local_batch, "LOGITS_BUDGET_BYTES", 2 * 4 * vocabulary * peak)  # two runs' logits
    before = dict(local_batch.STATS)
    outputs = local_batch.train_jobs(jobs)
    assert local_batch.STATS["groups"] - before["groups"] == 3  # 5 runs: 2 + 2 + 1
    for method, out in zip(METHODS, outputs):
        state = alone[method][1]
        assert max(float((out.state[k] - state[k]).abs().max()) for k in state) <= 1e-6, method


def test_validations_of_several_adapters_run_stacked_each_its_adapters_cross_entropy(ws, monkeypatch):
    from pipeline.modeling.batching import IGNORE_INDEX, make_batches
    from pipeline.training import local_batch, set_engine
    from pipeline.training.client_training import validation_loss

    plan, model, examples, w0 = _setup("valid-stacked", batch_size=2)
    states = []
    for r in range(3):
        generator = torch.Generator().manual_seed(r)
        states.append({k: v + 0.3 * torch.randn(v.shape, generator=generator) for k, v in w0.items()})
    made, alone = [], []
    real = set_engine.batched
    monkeypatch.setattr(set_engine, "batched", lambda job, run: made.append(job) or real(job, run))
    for state in states:
        model.load_adapter_state("local", state)
        alone.append(validation_loss(model, plan, examples))
    monkeypatch.setattr(set_engine, "batched", real)
    before = local_batch.STATS["validation_groups"]
    together = local_batch.validate_jobs(made)
    assert local_batch.STATS["validation_groups"] - before == 1
    for (loss, tokens), (loss_alone, tokens_alone) in zip(together, alone):
        assert tokens == tokens_alone and loss == pytest.approx(loss_alone, rel=1e-6)
    # the last adapter's CE from the plain HF forward with the model's own adapter set, batch by batch
    model.load_adapter_state("local", states[-1])
    total, n = 0.0, 0
    for batch in make_batches(examples, model, plan.model_config, 2, False, 0):
        with torch.no_grad():
            logits = model.forward_path(batch, "local")
        valid = batch.labels != IGNORE_INDEX
        total += float(torch.nn.functional.cross_entropy(logits[valid], batch.labels[valid], reduction="sum"))
        n += int(valid.sum())
    assert together[-1] == (pytest.approx(total / n, rel=1e-5), n)
    assert len({loss for loss, _ in together}) == 3


def test_a_job_that_fails_in_a_group_fails_alone_and_the_others_train_as_alone(ws, monkeypatch):
    """One client's bad micro-batch (no target token) fails its own job only: the group is retrained job by job."""
    from pipeline.modeling.batching import IGNORE_INDEX, Batch

    jobs, alone, local_batch = _jobs(monkeypatch)
    bad = jobs[2]
    first, weight = bad.steps[0][0]
    empty = Batch(
        first.example_ids,
        first.input_ids,
        first.attention_mask,
        first.decoder_input_ids,
        torch.full_like(first.labels, IGNORE_INDEX),
    )
    bad.steps = [[(empty, weight), *bad.steps[0][1:]], *bad.steps[1:]]
    before = local_batch.STATS["groups"]
    outputs = local_batch.train_jobs(jobs)
    assert local_batch.STATS["groups"] - before == 1 + len(jobs)  # the failed group, then each job alone
    assert isinstance(outputs[2], ValueError) and "no non-padding target token" in str(outputs[2])
    for method, out in zip(METHODS, outputs):
        if out is outputs[2]:
            continue
        state = alone[method][1]
        assert max(float((out.state[k] - state[k]).abs().max()) for k in state) <= 1e-6, method


def test_the_logits_budget_is_an_eighth_of_a_large_gpu_and_two_gib_elsewhere(monkeypatch):
    from types import SimpleNamespace

    from pipeline.training import local_batch

    assert local_batch.logits_budget_bytes(torch.device("cpu")) == 2 * 2**30
    for total, budget in ((80 * 10**9, 10**10), (8 * 10**9, 2 * 2**30)):
        gpus = {torch.device("cuda", 1): SimpleNamespace(total_memory=total)}  # the model's GPU, not the current one
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, gpus=gpus: gpus[device])
        assert local_batch.logits_budget_bytes(torch.device("cuda", 1)) == budget


class _DeviceValues(TorchFunctionMode):
    """Stands in for a GPU on the host: the tensors of :meth:`mark` and every tensor computed from them (an op's
    outputs, or the tensor an in-place op or an indexed assignment writes into) hold "device" values and say they
    are on CUDA (``is_cuda``); while ``recording``, each read of such values on the host (what makes the host wait
    for a GPU) is recorded with the line that made it. Tensors made from constants alone are not marked."""

    READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}
    READS |= {torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        self.marked: dict[int, weakref.ref] = {}  # id -> the tensor (a WeakSet would compare tensors with ==)
        self.reads: list[str] = []
        self.recording = True

    def mark(self, *tensors: torch.Tensor) -> None:
        self.marked.update((id(t), weakref.ref(t)) for t in tensors)

    def holds(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (ref := self.marked.get(id(t))) is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if self.holds(t)]
        if func == torch.Tensor.is_cuda.__get__ and inputs:  # a method-wrapper: made anew at each lookup
            return True
        if func in self.READS and inputs and self.recording:
            caller = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename)
            self.reads.append(f"{func.__name__} at {caller.filename.split('/')[-1]}:{caller.lineno}")
        out = func(*args, **kwargs)
        if inputs:
            written = [args[0]] if func.__name__.endswith("_") or func is torch.Tensor.__setitem__ else []
            self.mark(*(t for t in pytree.tree_leaves(out) + written if isinstance(t, torch.Tensor)))
        return out


def _device_values(monkeypatch) -> _DeviceValues:
    """A :class:`_DeviceValues` holding every prefix the frozen backbone computes (copies, as a GPU's: on the host
    ``.to()`` returns the batch's own attention mask) and every stack of adapters the batched trainer makes."""
    from pipeline.modeling.model import AdapterSummarizer, Prefix
    from pipeline.training import local_batch

    device, compute_prefix, stack = _DeviceValues(), AdapterSummarizer.compute_prefix, local_batch.AdapterStack

    def on_device(model, batch):
        prefix = Prefix(*(t.clone() for t in vars(compute_prefix(model, batch)).values()))
        device.mark(*vars(prefix).values())
        return prefix

    def on_device_stack(*args, **kwargs):
        adapters = stack(*args, **kwargs)
        device.mark(*adapters.parameters())
        return adapters

    monkeypatch.setattr(AdapterSummarizer, "compute_prefix", on_device)
    monkeypatch.setattr(local_batch, "AdapterStack", on_device_stack)
    return device


def test_a_round_of_the_batched_trainer_reads_nothing_back_from_the_device(ws, monkeypatch):
    """The batched trainer makes no host sync in a round's steps (module docstring): with the prefixes the frozen
    backbone computes and the stacked adapters marked as on a GPU (_DeviceValues: what is computed from them is too:
    attention masks, logits, losses, gates, the updated adapters), a stacked round of every method (KD gates, hard
    KD, FedProx) reads none of their values on the host until its last optimizer step is taken. The same mark
    catches a read: attention masks made from the prefix's own padding mask (HF's builders test it in an ``if``)."""
    jobs, _, local_batch = _jobs(monkeypatch)
    device = _device_values(monkeypatch)
    taken, adamw_step = [], torch.optim.AdamW.step

    def step(optimizer, *args, **kwargs):
        taken.append(adamw_step(optimizer, *args, **kwargs))
        device.recording = len(taken) < len(jobs[0].steps)  # the round's reads come after its last step

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    with device:
        outputs = local_batch.train_group(jobs)
        assert len(taken) == len(jobs[0].steps) > 1
        assert device.reads == []  # each: the read and its line
        assert all(device.holds(out.outputs[-1][1].loss) for out in outputs)  # the mark reached every run's loss
        device.recording = True
        model = jobs[0].model
        model.top_masks(model.compute_prefix(jobs[0].steps[0][0][0]))  # no host mask: the prefix's own is read
    assert device.reads and all(read.startswith("__bool__") for read in device.reads)


def test_a_client_round_reads_its_results_from_the_device_in_a_few_transfers_whatever_its_length(ws, monkeypatch):
    """Once a client's round has trained, its losses, KD means and counts and its gate log are read from the device
    in as many transfers for a round of 2 local epochs as for one (they were up to six host syncs a micro-batch),
    and a validation's losses in one; the round's sums are those of the micro-batches read one by one, to the bit
    (hard KD: some tokens gated, others not)."""
    from pipeline.training import client_training

    reads, results, rounds, round_sums = [], [], [], client_training._round_sums
    for epochs in (1, 2):
        plan, model, train, _ = _setup(f"reads-{epochs}", "hardkd", local_epochs=epochs, batch_size=2)
        with monkeypatch.context() as patch, _device_values(patch) as device:
            patch.setattr(client_training, "_round_sums", lambda outputs: rounds.append(outputs) or round_sums(outputs))
            results.append(_train(plan, model, train))
            client_training.validation_loss(model, plan, train)
        reads.append(device.reads)
    assert results[1].n_steps == 2 * results[0].n_steps >= 6  # twice the micro-batches (one a step)
    assert len(reads[0]) == len(reads[1]) <= 8, reads
    assert any(read.startswith("tolist") for read in reads[0]), reads  # the mark reached the round's results
    for outputs in rounds:  # the sums of the values read one micro-batch at a time, to the bit
        one_by_one = dict(loss=0.0, ce=0.0, kd=0.0, tokens=0, kd_tokens=0)
        for out in outputs:
            n_kd = int(out.gate_rows.sum())
            one_by_one["loss"] += float(out.loss) * out.n_tokens
            one_by_one["ce"] += float(out.ce_rows.mean()) * out.n_tokens
            one_by_one["kd"] += (float(out.kl_rows[out.gate_rows].mean()) if n_kd else 0.0) * n_kd
            one_by_one["tokens"] += out.n_tokens
            one_by_one["kd_tokens"] += n_kd
        assert round_sums(outputs) == one_by_one and 0 < one_by_one["kd_tokens"] < one_by_one["tokens"]


def _tiny_model_and_batch(kind: str):
    """A tiny backbone's AdapterSummarizer (two top layers adapted) on the host and one batch of three examples."""
    from pipeline.modeling.adapters import AdapterConfig
    from pipeline.modeling.batching import collate, tokenize_pairs
    from pipeline.modeling.model import AdapterSummarizer
    from tests.test_model import FRAME, LENGTHS
    from tests.tiny_models import tiny

    backbone, tokenizer = tiny(kind)
    model = AdapterSummarizer(backbone, tokenizer, AdapterConfig(top_k=2, bottleneck=8, seed=0), "cpu")
    examples = tokenize_pairs(
        tokenizer, FRAME.assign(example_id=["a", "b", "c"]), LENGTHS, model.decoder_start_token_id
    )
    return model, collate(examples, model.pad_token_id, model.decoder_start_token_id)


def _read_as_gpu(monkeypatch, model) -> None:
    """``model`` moved to PyTorch's meta device (shapes, no values) and every tensor read as a GPU's (``is_cuda``);
    autocast left out (it refuses the meta device)."""
    import contextlib

    model.to("meta")
    monkeypatch.setattr(model, "device", torch.device("meta"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())


@pytest.mark.parametrize("kind", ["bart", "bert2bert"])
def test_a_stacked_step_keeps_every_tensor_on_the_device(monkeypatch, kind):
    """A tensor made or left on the host beside the device's (a ``device=`` or ``.to(device)`` left out) fails only
    on a GPU, inside a lease's study call. One step of the batched trainer, on PyTorch's meta device read as a GPU
    (``is_cuda``), every operation checked as CUDA checks it (tests/test_losses.py's ``_OneDevice``): two runs'
    stacked adapters made from host states (the first taught by a teacher stack), their packed logits from one prefix
    (the top layers' masks and rows read from the host's labels and source mask, as the trainer passes them), the
    loss, its backward and AdamW's step. Making a stack reads nothing of the device's adapters (it took their keys
    from ``AdapterSet.state()``, which copies every tensor to the host). The prefix is made on the host first (the
    HF encoder's mask builder reads values, which a meta tensor has not); autocast is left out (it refuses the meta
    device)."""
    from pipeline.modeling.adapter_stack import AdapterStack
    from pipeline.modeling.losses import KDConfig, distillation_losses
    from pipeline.modeling.model import Prefix
    from pipeline.training.local_batch import stacked_logits
    from tests.test_losses import _OneDevice

    model, batch = _tiny_model_and_batch(kind)
    prefix = model.compute_prefix(batch)
    states = [model.adapter_state("local"), model.adapter_state("global")]
    _read_as_gpu(monkeypatch, model)
    prefix = Prefix(*(t.to("meta") for t in vars(prefix).values())).repeat(2)
    with _OneDevice():
        local = AdapterStack(states, model.adapter_sets["local"], model.device)
        teacher = AdapterStack(states[1:], model.adapter_sets["local"], model.device).requires_grad_(False)
        optimizer = torch.optim.AdamW(list(local.parameters()), lr=1e-3)
        student, taught = stacked_logits(
            model, prefix, batch.labels.repeat(2, 1), batch.attention_mask.repeat(2, 1), local, teacher, 1, False
        )
        cfgs = [KDConfig(kd_lambda=0.5, tau=0.5), KDConfig(mode="ce")]
        loss, outs = distillation_losses(student, taught, [batch.labels] * 2, cfgs, [None, None])
        loss.sum().backward()
        optimizer.step()
    n_tokens = int((batch.labels != -100).sum())
    assert student.shape[0] == 2 * n_tokens and taught.shape[0] == n_tokens
    made = [student, taught, loss, *local.parameters(), *(p.grad for p in local.parameters())]
    assert {t.device.type for t in made + [o.gate_rows for o in outs]} == {"meta"}


def test_a_group_trains_every_tensor_on_the_models_device(ws, monkeypatch):
    """train_group as a whole on a device (not only its step, above): the stacked adapters and the teacher's, the
    steps' weights and the optimizer made on the model's device, the host's labels, masks and hard-KD masks moved
    there by what reads them. Four runs of one group (CE, selective KD, KD on every token, hard KD) on PyTorch's
    meta device read as a GPU (``is_cuda``), every operation checked as CUDA checks it (tests/test_losses.py's
    ``_OneDevice``); prefixes made on the host first (the HF encoder reads mask values), autocast left out; the
    trained states are the device's leaves (AdapterStack.states copies to the host, which meta cannot)."""
    import copy
    import dataclasses

    from pipeline.modeling.adapter_stack import AdapterStack
    from pipeline.modeling.model import Prefix
    from tests.test_losses import _OneDevice

    jobs, _, local_batch = _jobs(monkeypatch)
    jobs = [job for job in jobs if job.proximal is None]  # FedProx's reference is placed by its Proximal
    model = copy.deepcopy(jobs[0].model)
    jobs = [dataclasses.replace(job, model=model) for job in jobs]  # their adapters read from the copy, on the host
    prefixes = {
        tuple(b.example_ids): Prefix(*(t.to("meta") for t in vars(model.compute_prefix(b)).values()))
        for step in jobs[0].steps
        for b, _ in step
    }
    _read_as_gpu(monkeypatch, model)
    monkeypatch.setattr(model, "compute_prefix", lambda batch: prefixes[tuple(batch.example_ids)])
    monkeypatch.setattr(
        AdapterStack, "states", lambda self: [{k: self.parameter_of(k)[r] for k in self.keys} for r in range(self.runs)]
    )
    with _OneDevice():
        outputs = local_batch.train_group(jobs)
    assert {job.teacher is None for job in jobs} == {True, False} and any(job.masks is not None for job in jobs)
    made = [t for out in outputs for t in (*out.state.values(), *(o.loss for _, o in out.outputs))]
    assert made and {t.device.type for t in made} == {"meta"}


def test_jobs_of_another_model_cache_optimizer_length_or_steps_never_share_a_group():
    """A group trains with its first job's model, prefix cache, AdamW settings and length limits and steps through
    its micro-batches: a job differing in any of them has a group key of its own."""
    from types import SimpleNamespace

    from pipeline.training.local_batch import LocalJob

    class Model:  # what a job reads of its model when it is made
        def adapter_state(self, name):
            return {}

    def job(model, cache=None, lr=1e-3, decay=0.01, norms=False, lengths=(64, 12), steps=(2, 1)):
        train = SimpleNamespace(lr=lr, weight_decay=decay, decay_norm_and_bias=norms)
        plan = SimpleNamespace(train=train, model=dict(zip(("max_source_length", "max_target_length"), lengths)))
        return LocalJob(model, plan, "c", 1, None, [[(None, 1.0)] * n for n in steps], cache=cache)

    model = Model()
    same = job(model).group_key()
    assert job(model).group_key() == same
    others = [
        job(Model()),
        job(model, cache=object()),
        job(model, lr=2e-3),
        job(model, decay=0.0),
        job(model, norms=True),
        job(model, lengths=(32, 12)),
        job(model, lengths=(64, 8)),
        job(model, steps=(2, 2)),
        job(model, steps=(2,)),
    ]
    keys = [other.group_key() for other in others]  # the jobs (their models and caches) kept alive meanwhile
    assert same not in keys and len(set(keys)) == len(keys)


def test_a_failed_group_is_retrained_job_by_job_and_a_lone_job_that_fails_is_not_retried(caplog):
    """_in_groups: a group's call that raises is made again for each of its jobs alone (a group of two too), so
    one job's error fails no other, with one warning naming the group and its error; a job alone that fails is
    called once (retrying it would only repeat its error), its exception its result."""
    import logging
    from types import SimpleNamespace

    from pipeline.training import local_batch

    embeddings = SimpleNamespace(weight=torch.zeros(7, 2))
    model = SimpleNamespace(
        device=torch.device("cpu"), backbone=SimpleNamespace(get_output_embeddings=lambda: embeddings)
    )

    class Job:
        def __init__(self, name, key=0):
            self.name, self.key, self.model = name, key, model
            self.steps = [[(SimpleNamespace(target_tokens=3), 1.0)]]

        def group_key(self):
            return self.key

    calls = []

    def call(group):
        calls.append([job.name for job in group])
        if any(job.name == "bad" for job in group):
            raise RuntimeError("disk full")
        return [job.name.upper() for job in group]

    with caplog.at_level(logging.WARNING, logger=local_batch.__name__):
        out = local_batch._in_groups([Job("a"), Job("bad"), Job("lone", key=1)], call)
    assert calls == [["a", "bad"], ["a"], ["bad"], ["lone"]]
    assert out[0] == "A" and out[2] == "LONE" and isinstance(out[1], RuntimeError) and str(out[1]) == "disk full"
    assert [r.getMessage() for r in caplog.records] == ["a group of 2 jobs failed (disk full); each is trained alone"]
    calls.clear()
    out = local_batch._in_groups([Job("bad")], call)
    assert calls == [["bad"]] and isinstance(out[0], RuntimeError)


@pytest.mark.parametrize("bf16", [False, True])
def test_the_students_forward_is_bfloat16_exactly_when_asked_whatever_the_devices_autocast_default(bf16):
    """stacked_logits asks autocast for bfloat16 itself: CUDA's autocast default is float16, which would round the
    student's logits to 10 bits instead of bf16's 8-bit exponent range; without ``bf16`` no autocast at all. Here
    on the host, with the host's autocast default set to float16 as CUDA's is."""
    from pipeline.modeling.adapter_stack import AdapterStack
    from pipeline.training.local_batch import stacked_logits

    model, batch = _tiny_model_and_batch("bert2bert")  # its LM head ends in a Linear: the logits keep autocast's dtype
    local = AdapterStack([model.adapter_state("local")], model.adapter_sets["local"], "cpu")
    default = torch.get_autocast_dtype("cpu")
    torch.set_autocast_dtype("cpu", torch.float16)
    try:
        student, _ = stacked_logits(
            model, model.compute_prefix(batch), batch.labels, batch.attention_mask, local, None, 0, bf16
        )
    finally:
        torch.set_autocast_dtype("cpu", default)
    assert student.dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert student.shape[0] == int((batch.labels != -100).sum())


def test_adamw_decays_the_matrices_of_a_stack_and_of_the_models_own_adapters():
    """The batched trainer's optimizer (stacked leaves: a run's matrix has 3 dimensions, its LayerNorm weights and
    biases 2) and a DP round's (the model's own adapters, ``adamw_groups``'s default: 2 and 1) decay the adapter
    matrices only, unless ``decay_norm_and_bias``."""
    from pipeline.experiments.train_config import TrainConfig
    from pipeline.modeling.adapter_stack import AdapterStack
    from pipeline.modeling.adapters import AdapterConfig, AdapterSet
    from pipeline.training.local_batch import adamw_groups

    adapters = AdapterSet(16, AdapterConfig(top_k=2, bottleneck=4, seed=0), [None, None])
    stack = AdapterStack([adapters.state()] * 3, adapters, "cpu")
    cfg = TrainConfig(weight_decay=0.25)
    for params, matrix in ((list(adapters.parameters()), 2), (list(stack.parameters()), 3)):
        groups = adamw_groups(params, cfg) if matrix == 2 else adamw_groups(params, cfg, matrix)
        assert [g["weight_decay"] for g in groups] == [0.25, 0.0]
        assert sorted(p.ndim for p in groups[0]["params"]) == [matrix] * 4  # down and up, two layers
        assert sorted(p.ndim for p in groups[1]["params"]) == [matrix - 1] * 8  # biases and LayerNorms
    every = adamw_groups(list(adapters.parameters()), TrainConfig(weight_decay=0.25, decay_norm_and_bias=True))
    assert len(every[0]["params"]) == 12 and every[1]["params"] == []


def test_a_group_trains_in_training_mode_and_shows_its_bar_only_when_a_job_asks(ws, monkeypatch, capsys):
    """The top layers run in training mode (a real backbone's dropout; the tiny models have none, so only the mode
    tells) and the model is left in evaluation mode; a progress bar named by client, round and runs is drawn only
    when a job of the group asks for one (tqdm on stderr, captured here: not a terminal), and erased at the end."""
    from pipeline.modeling.model import AdapterSummarizer

    jobs, _, local_batch = _jobs(monkeypatch)
    modes, path_logits = [], AdapterSummarizer.path_logits
    monkeypatch.setattr(
        AdapterSummarizer, "path_logits", lambda m, *a, **k: modes.append(m.training) or path_logits(m, *a, **k)
    )
    capsys.readouterr()
    local_batch.train_group(jobs)
    assert modes and all(modes) and not jobs[0].model.training
    assert capsys.readouterr().err == ""
    jobs[1].progress = True
    local_batch.train_group(jobs)
    err = capsys.readouterr().err
    assert f"{CLIENT} round 1 ({len(jobs)} runs)" in err
    assert err.endswith("\r") and "\n" not in err  # erased when the group ends: the next group's bar takes its line
