"""One client's local training (pipeline.training.client_training.train_local, METHOD.md section 4) on the tiny BART, as
a unit: what it counts, what its losses mean and what one optimizer step does.

Properties stated: with lr 0 the adapter does not move and the reported losses are the method's loss on the
training examples (CE = the validation CE of those examples; KD on every token with teacher = student gives KL 0
and (1 - lambda) CE; selective KD gates exactly the tokens whose teacher entropy is below tau, and the gate log
has one row per trained token saying so); steps and tokens follow batches, accumulation and epochs; a first AdamW
step moves every parameter with a gradient by lr and shrinks the decayed ones by lr x weight decay; accumulated
micro-batches give the step of the whole effective batch; the FedProx term is mu/2 ||W - W_global||^2; training
is a function of (seed, client, round).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

# imported here, not only in the tests: mutmut's fork server imports the test modules once
import pipeline.training.client_training  # noqa: F401
import pipeline.training.shared_model  # noqa: F401
from tests.errors import names
from tests.test_federated import workspace, write_plan, ws  # noqa: F401  (fixtures)

CLIENT = "Committee"  # 6 training examples in tests/test_federated.py's workspace


def _target_lengths(batch):
    from pipeline.modeling.batching import IGNORE_INDEX

    return (batch.labels != IGNORE_INDEX).sum(dim=1)


def _setup(name: str, method: str = "fedavg", **train):
    from pipeline.federation.protocol import load_plan
    from pipeline.training.client_data import client_data
    from pipeline.training.shared_model import initial_adapter_state, shared_model

    plan = load_plan(write_plan(name, method, **{"prefix_cache": False, **train}))
    model = shared_model(plan)
    w0 = initial_adapter_state(plan)
    model.load_adapter_state("local", w0)
    model.load_adapter_state("global", w0)
    return plan, model, client_data(plan, CLIENT).train, w0


def _train(plan, model, examples, rnd: int = 1, **kw):
    from pipeline.training.client_training import train_local

    return train_local(model, plan, examples, client=CLIENT, rnd=rnd, **kw)


def _target_tokens(model, plan, examples) -> list[int]:
    """Non-padding target tokens per example, from the tokenizer alone."""
    from pipeline.modeling.batching import IGNORE_INDEX, make_batches

    batches = make_batches(
        examples,
        model,
        plan.model_config,
        1,
        shuffle=False,
        seed=0,
    )
    return [int((b.labels != IGNORE_INDEX).sum()) for b in batches]


def _unchanged(model, w0) -> bool:
    state = model.adapter_state("local")
    return all(torch.equal(state[k], w0[k]) for k in w0)


# ----------------------------------------------------------------------------------------------- lr 0: the loss
def test_ce_training_reports_the_cross_entropy_of_its_examples(ws):
    from pipeline.training.client_training import GATE_LOG_DTYPES, validation_loss

    plan, model, train, w0 = _setup("local-ce", lr=0.0, local_epochs=2, batch_size=4)
    result = _train(plan, model, train)
    assert _unchanged(model, w0)  # lr 0 (and AdamW's decay is lr x wd): nothing moves
    val, tokens = validation_loss(model, plan, train)
    assert (result.n_examples, result.n_tokens) == (6, 2 * tokens) and tokens == sum(_target_tokens(model, plan, train))
    assert result.n_steps == 2 * math.ceil(6 / 4)  # two epochs of two batches
    assert result.train_loss == pytest.approx(val, rel=1e-5) and result.ce == pytest.approx(val, rel=1e-5)
    assert (result.kd, result.kd_fraction, result.proximal) == (0.0, 0.0, 0.0)
    assert list(result.gate_log.columns) == list(GATE_LOG_DTYPES) and len(result.gate_log) == 0  # no teacher, no log
    assert result.privacy is None and (result.dp_examples, result.dp_clipped) == (0, 0)
    # training leaves the adapter frozen and the model in evaluation mode
    assert not any(p.requires_grad for p in model.local_parameters()) and not model.training


def test_kd_on_every_token_with_the_teacher_equal_to_the_student_is_zero_kl(ws):
    from pipeline.training.client_training import validation_loss

    plan, model, train, w0 = _setup("local-kd", "fedkd", lr=0.0, batch_size=4)
    result = _train(plan, model, train)
    ce, tokens = validation_loss(model, plan, train)
    lam = plan.train.kd_lambda
    assert result.kd_fraction == 1.0 and abs(result.kd) < 1e-6
    assert result.ce == pytest.approx(ce, rel=1e-5)
    assert result.train_loss == pytest.approx((1 - lam) * ce, rel=1e-5)  # L_t = (1 - lambda) CE + lambda * 0
    assert len(result.gate_log) == tokens and result.gate_log["kd_applied"].all()


def _teacher_entropies(model, plan, examples) -> list[np.ndarray]:
    """H(q_g) of every target token of each example, from the global path's logits (an independent forward)."""
    from pipeline.modeling.batching import IGNORE_INDEX, make_batches

    out = []
    for b in make_batches(
        examples,
        model,
        plan.model_config,
        1,
        shuffle=False,
        seed=0,
    ):
        with torch.no_grad():
            logits = model.forward_path(b, "global")[0][b.labels[0] != IGNORE_INDEX].double()
        logp = torch.log_softmax(logits, -1)
        out.append((-(logp.exp() * logp).sum(-1)).numpy())
    return out


def test_selective_kd_gates_the_tokens_below_tau_and_logs_every_token(ws):
    from pipeline.federation.protocol import load_plan

    plan, model, train, w0 = _setup("local-sel-probe", "fedselectkd", lr=0.0, batch_size=4)
    # a teacher that differs from the student, so KL > 0 where KD applies
    g = torch.Generator().manual_seed(4)
    teacher = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    model.load_adapter_state("global", teacher)
    entropies = _teacher_entropies(model, plan, train)
    flat = np.concatenate(entropies)
    tau = float(np.median(flat))  # about half the tokens below it
    plan = load_plan(write_plan("local-sel", "fedselectkd", tau=tau, lr=0.0, batch_size=4, prefix_cache=False))
    result = _train(plan, model, train)
    log = result.gate_log
    assert len(log) == len(flat) == result.n_tokens
    # per example, in target order: position 0.. n-1, the teacher's entropy, gated iff H < tau
    ids = train["example_id"].tolist()
    for i, h in zip(ids, entropies):
        rows = log[log.example_id == i].sort_values("position")
        assert rows["position"].tolist() == list(range(len(h)))
        np.testing.assert_allclose(rows["entropy"].to_numpy(), h, rtol=1e-4, atol=1e-5)
        assert rows["kd_applied"].tolist() == (h < tau).tolist()
    assert result.kd_fraction == pytest.approx(float((flat < tau).mean()))
    assert 0 < result.kd_fraction < 1 and result.kd > 0
    # tolist: a missing client name would be <NA>, which pandas' all() skips
    assert log["client"].tolist() == [CLIENT] * len(log) and log["round"].tolist() == [1] * len(log)
    assert log.index.equals(pd.RangeIndex(len(log)))  # one table, rows numbered 0..n-1 across batches
    # the gate log's token ids are the example's target tokens
    from pipeline.modeling.batching import IGNORE_INDEX, make_batches

    for b in make_batches(
        train,
        model,
        plan.model_config,
        1,
        shuffle=False,
        seed=0,
    ):
        labels = b.labels[0][b.labels[0] != IGNORE_INDEX].tolist()
        assert log[log.example_id == b.example_ids[0]].sort_values("position")["token_id"].tolist() == labels


def test_the_gate_log_of_no_token_has_the_columns_and_types_of_one_with_tokens(ws):
    from pipeline.training.client_training import empty_gate_log

    plan, model, train, _ = _setup("local-gatelog", "fedkd", lr=0.0, batch_size=4)
    log = _train(plan, model, train).gate_log
    empty = empty_gate_log()
    assert len(empty) == 0 and list(empty.columns) == list(log.columns)
    assert empty.dtypes.to_dict() == log.dtypes.to_dict()
    assert pd.concat([empty, log], ignore_index=True).dtypes.to_dict() == log.dtypes.to_dict()


# ----------------------------------------------------------------------------------------------- steps and updates
@pytest.mark.parametrize(
    "batch_size, accum, epochs, steps", [(4, 1, 1, 2), (2, 2, 1, 2), (2, 3, 2, 2), (1, 4, 1, 2), (6, 1, 3, 3)]
)
def test_optimizer_steps_follow_batches_accumulation_and_epochs(ws, batch_size, accum, epochs, steps):
    plan, model, train, _ = _setup(
        f"local-steps-{batch_size}-{accum}-{epochs}",
        lr=0.0,
        batch_size=batch_size,
        grad_accum_steps=accum,
        local_epochs=epochs,
    )
    result = _train(plan, model, train)
    assert result.n_steps == steps == epochs * math.ceil(math.ceil(6 / batch_size) / accum)
    assert result.n_tokens == epochs * sum(_target_tokens(model, plan, train))


def test_a_first_adamw_step_moves_each_parameter_by_lr_and_decays_the_matrices(ws):
    """AdamW's first step: m = g, v = g^2, so the update is -lr g / (|g| + eps) = -lr sign(g) where g != 0, after
    p <- p (1 - lr wd) for the decayed parameters (the adapter matrices; not LayerNorm and biases). W_up = 0 at
    init, so W_down has no gradient in the first step and only decays."""
    lr, wd = 1e-3, 0.1
    plan, model, train, w0 = _setup("local-adamw", lr=lr, weight_decay=wd, batch_size=6)  # one batch, one step
    result = _train(plan, model, train)
    assert result.n_steps == 1
    new = model.adapter_state("local")
    for k, before in w0.items():
        after = new[k]
        decayed = before * (1 - lr * wd) if before.ndim == 2 else before  # the matrices only
        if ".down." in k:  # no gradient through W_up = 0: the decay alone
            torch.testing.assert_close(after, decayed, rtol=1e-6, atol=0)
            continue
        _assert_sign_step(after - decayed, lr, k)


def _assert_sign_step(step: torch.Tensor, lr: float, name: str) -> None:
    """Adam's first step: |step| = lr |g| / (|g| + 1e-8) <= lr, = lr up to rounding where |g| >> 1e-8."""
    step = step.abs()
    assert float(step.max()) <= lr * (1 + 1e-3), name
    moved = step[step > 0]
    assert moved.numel() > 0.5 * step.numel(), name  # most entries have a gradient
    assert float(moved.median()) == pytest.approx(lr, rel=1e-3), name


def test_norms_and_biases_decay_too_when_asked(ws):
    lr, wd = 1e-3, 0.5
    plan, model, train, w0 = _setup("local-decay-all", lr=lr, weight_decay=wd, batch_size=6, decay_norm_and_bias=True)
    _train(plan, model, train)
    new = model.adapter_state("local")
    # the LayerNorm gain: 1 before, decayed to 1 - lr wd, then moved by lr
    for k in ("layer0.norm.weight", "layer1.up.bias"):
        _assert_sign_step(new[k] - w0[k] * (1 - lr * wd), lr, k)


@pytest.mark.parametrize("method", ["fedavg", "fedprox"])
def test_accumulated_micro_batches_make_the_step_of_the_whole_batch(ws, method):
    """FedProx: the proximal term counts once a step, each micro-batch's share of it weighted as its loss is (a
    reference away from the start, so its gradient competes with the loss's in the first, sign-like, step)."""
    prox = {"proximal_mu": 1.0} if method == "fedprox" else {}
    plan, model, train, w0 = _setup(
        f"local-accum-whole-{method}", method, lr=1e-3, batch_size=6, grad_accum_steps=1, **prox
    )
    g = torch.Generator().manual_seed(3)
    reference = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    kw = {"proximal_reference": reference, "proximal_mu": 1.0} if prox else {}
    _train(plan, model, train, **kw)
    whole = model.adapter_state("local")
    plan2, model2, train2, _ = _setup(
        f"local-accum-parts-{method}", method, lr=1e-3, batch_size=2, grad_accum_steps=3, **prox
    )
    result = _train(plan2, model2, train2, **kw)
    assert result.n_steps == 1
    parts = model2.adapter_state("local")
    for k in whole:
        torch.testing.assert_close(parts[k], whole[k], rtol=0, atol=2e-6)
    assert not all(torch.equal(whole[k], w0[k]) for k in w0)


def test_training_is_a_function_of_seed_client_and_round(ws):
    plan, model, train, w0 = _setup("local-det", lr=5e-3, batch_size=2)
    runs = []
    for rnd in (1, 1, 2):
        model.load_adapter_state("local", w0)
        torch.manual_seed(rnd * 100)  # whatever the global RNG holds
        _train(plan, model, train, rnd=rnd)
        runs.append(model.adapter_state("local"))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in w0)
    assert not all(torch.equal(runs[0][k], runs[2][k]) for k in w0)  # another round: another batch order


def test_another_client_or_experiment_seed_trains_on_another_batch_order(ws):
    """The batch order is drawn from (experiment seed, client, round): the same examples trained as another
    client, or under another experiment seed, take other steps (clients of one federation must not share it)."""
    import dataclasses

    from pipeline.training.client_training import train_local

    plan, model, train, w0 = _setup("local-det-who", lr=5e-3, batch_size=2)
    runs = {}
    for key, p, client in (
        ("base", plan, CLIENT),
        ("client", plan, "Product"),
        ("seed", dataclasses.replace(plan, seed=plan.seed + 1), CLIENT),
    ):
        model.load_adapter_state("local", w0)
        train_local(model, p, train, client=client, rnd=1)
        runs[key] = model.adapter_state("local")
    assert not all(torch.equal(runs["base"][k], runs["client"][k]) for k in w0)
    assert not all(torch.equal(runs["base"][k], runs["seed"][k]) for k in w0)


# ----------------------------------------------------------------------------------------------- FedProx
def test_the_proximal_term_is_half_mu_times_the_squared_distance_to_the_global(ws):
    mu = 0.5
    plan, model, train, w0 = _setup("local-prox", "fedprox", lr=0.0, batch_size=4, proximal_mu=mu)
    g = torch.Generator().manual_seed(2)
    reference = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    result = _train(plan, model, train, proximal_reference=reference, proximal_mu=mu)
    distance = sum(float(((w0[k].double() - reference[k].double()) ** 2).sum()) for k in w0)
    assert result.proximal == pytest.approx(mu / 2 * distance, rel=1e-5)
    plain = _train(plan, model, train)
    assert result.train_loss == pytest.approx(plain.train_loss, rel=1e-6)  # reported without the proximal term
    with pytest.raises(ValueError) as err:
        _train(plan, model, train, proximal_mu=mu)
    names(err.value, "proximal_mu", "proximal_reference")


def test_the_proximal_term_refuses_a_reference_that_does_not_match_the_parameters():
    """The adapter's parameters and its state's tensors are paired by position: one left over is an error, not a
    term silently computed over the shorter list."""
    from pipeline.training.local_batch import proximal_term

    with pytest.raises(ValueError):
        proximal_term([torch.ones(2), torch.ones(3)], [torch.zeros(2)], 1.0)
    assert float(proximal_term([torch.ones(2)], [torch.zeros(2)], 1.0)) == pytest.approx(1.0)


def test_the_proximal_gradient_pulls_towards_the_global(ws):
    """With a reference far from the adapter the proximal gradient mu (W - W_g) dominates: the first (sign) step
    moves every LayerNorm gain towards the reference."""
    mu, lr = 100.0, 1e-3
    plan, model, train, w0 = _setup("local-prox-grad", "fedprox", lr=lr, batch_size=6, proximal_mu=mu)
    reference = {k: v + (1.0 if k.endswith("norm.weight") else 0.0) for k, v in w0.items()}
    _train(plan, model, train, proximal_reference=reference, proximal_mu=mu)
    new = model.adapter_state("local")
    for k in w0:
        if k.endswith("norm.weight"):
            torch.testing.assert_close(new[k] - w0[k], torch.full_like(w0[k], lr), rtol=1e-3, atol=0)


# ----------------------------------------------------------------------------------------------- small rules, by hand
def _labelled(*rows):
    from pipeline.modeling.batching import Batch

    labels = torch.tensor(rows)
    ids = [f"e{i}" for i in range(len(rows))]
    return Batch(ids, labels.clamp(min=0), torch.ones_like(labels), labels.clamp(min=0), labels)


def test_the_dp_loss_scale_counts_target_tokens_over_t_max_or_non_empty_sequences():
    from pipeline.training.client_training import per_example_loss_scale

    batch = _labelled([5, 6, -100], [-100, -100, -100], [7, -100, -100])  # 3 tokens, 2 non-empty sequences
    assert per_example_loss_scale(batch, "tokens", max_target_length=4) == 3 / 4
    assert per_example_loss_scale(batch, "sequences", max_target_length=4) == 2.0


def test_accumulation_steps_weigh_only_sequences_with_a_target_token():
    from pipeline.training.client_training import accumulation_steps

    def weights(*args):  # each batch's weight in its step, in order
        return [w for step in accumulation_steps(*args) for _, w in step]

    b1 = _labelled([5, 6, -100], [-100, -100, -100])  # one sequence with targets, one empty
    b2 = _labelled([7, 8, 9])
    assert weights([b1, b2], 2, "sequences") == [0.5, 0.5]
    assert weights([b1, b2], 2, "tokens") == [0.4, 0.6]


def test_gate_rows_are_one_per_target_token_with_its_client_round_example_and_position():
    from pipeline.training.client_training import gate_rows

    batch = _labelled([3, -100], [4, 5])
    # a loss output's rows of its target tokens (labels 3, 4, 5), row-major
    out = SimpleNamespace(entropy_rows=torch.tensor([0.5, 1.5, 2.5]), gate_rows=torch.tensor([True, False, True]))
    later = _labelled([6, 7, -100])  # a second micro-batch of another shape: its rows follow the first's
    later_out = SimpleNamespace(entropy_rows=torch.tensor([3.0, 4.0]), gate_rows=torch.tensor([False, True]))
    parts = [(batch, out), (later, later_out)]
    rows = gate_rows(parts, "Academic", 7)
    assert rows["client"].tolist() == ["Academic"] * 5 and str(rows["client"].dtype) == "string"
    assert rows["round"].tolist() == [7] * 5
    assert rows["example_id"].tolist() == ["e0", "e1", "e1", "e0", "e0"]
    assert rows["position"].tolist() == [0, 0, 1, 0, 1]
    assert rows["token_id"].tolist() == [3, 4, 5, 6, 7] and rows["entropy"].tolist() == [0.5, 1.5, 2.5, 3.0, 4.0]
    assert rows["kd_applied"].tolist() == [True, False, True, False, True]
    assert gate_rows([], "Academic", 7).empty


# ----------------------------------------------------------------------------------------------- DP-SGD epochs
def _varied_targets() -> pd.DataFrame:
    """Ten examples whose targets are 1 to 7 words: token counts differ, none reaches max_target_length 48."""
    lengths = [5, 1, 7, 3, 6, 2, 4, 1, 6, 3]
    return pd.DataFrame(
        {
            "example_id": [f"e{i}" for i in range(10)],
            "source": [f"A: word {i} here." for i in range(10)],
            "target": [" ".join(["talk"] * n) + "." for n in lengths],
        }
    )


def test_a_dp_epoch_is_the_poisson_samples_each_cut_into_length_bucketed_micro_batches_with_their_scale(ws):
    """Every sampled example of a step is in exactly one of its micro-batches (an empty sample is an empty step),
    micro-batches hold at most batch_size examples padded with the model's pad id and bucketed by target length
    (train.bucket_by_length), each with the weight the trainer's cut gives it (its per-example loss scale)."""
    from types import SimpleNamespace

    from pipeline.federation.protocol import load_plan
    from pipeline.modeling.batching import IGNORE_INDEX, make_batches
    from pipeline.privacy.example_dp import DPSGDSteps, poisson_steps
    from pipeline.training.seeds import derived_seed
    from pipeline.training.shared_model import shared_model

    plan = load_plan(
        write_plan("dp-epoch", "fedavg", model={"max_target_length": 48}, prefix_cache=False, batch_size=2)
    )
    model = shared_model(plan)
    examples = _varied_targets()
    mcfg, setting = plan.model_config, SimpleNamespace(sample_rate=0.3, steps_per_epoch=8)
    assert max(_target_tokens(model, plan, examples)) < mcfg.max_target_length
    sampled = poisson_steps(len(examples), 0.3, 8, derived_seed(3, 0, "poisson"))  # epoch 0 of seed 3
    assert [] in sampled and any(len(idx) > 2 for idx in sampled)  # the seed gives an empty and a multi-batch step

    def micro_batches(frame):  # as train_local cuts a step's sample
        batches = make_batches(
            frame,
            model,
            mcfg,
            plan.train.batch_size,
            shuffle=False,
            seed=0,
            bucket_by_length=plan.train.bucket_by_length,
        )
        return [(b, float(len(b))) for b in batches]

    stepper = DPSGDSteps(torch.nn.Linear(1, 1), setting, 3, examples, micro_batches)
    steps = stepper.epoch(0)
    stepper.close()
    assert len(steps) == len(sampled)
    for idx, step in zip(sampled, steps):
        ids = [e for batch, _ in step for e in batch.example_ids]
        assert sorted(ids) == sorted(examples.iloc[idx]["example_id"].astype(str))
        assert all(len(batch.example_ids) <= 2 for batch, _ in step)
        lengths = [int(n) for batch, _ in step for n in _target_lengths(batch)]
        assert lengths == sorted(lengths)  # one bucket: sorted by target length
        for batch, scale in step:
            assert scale == len(batch.example_ids)
            padded = batch.labels == IGNORE_INDEX
            assert bool((batch.decoder_input_ids[:, 1:][padded[:, 1:]] == model.pad_token_id).all())


def test_hard_kd_distils_exactly_on_the_target_nouns_and_verbs_of_the_pos_tags(ws):
    """Method hardkd (METHOD.md's POS ablation): KD on the tokens stage `postag` tagged noun or verb, CE alone on
    the others, whatever the teacher's entropy; the workspace tags every even target position a noun."""
    plan, model, train, w0 = _setup("local-hard", "hardkd", lr=0.0, batch_size=4)
    g = torch.Generator().manual_seed(5)
    model.load_adapter_state("global", {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in w0.items()})
    log = _train(plan, model, train).gate_log
    assert len(log) > 0 and log["kd_applied"].tolist() == (log["position"] % 2 == 0).tolist()


def test_an_epoch_is_length_bucketed_batches_in_windows_weighted_by_their_share_of_target_tokens(ws):
    """Without privacy: batches of similar target length (train.bucket_by_length: the least padding a cut of
    the examples into batches of batch_size can have), grad_accum_steps of them per optimizer step, each weighted
    by its target tokens over its window's (train.loss_normalisation tokens)."""
    from pipeline.federation.protocol import load_plan
    from pipeline.training.client_training import _batches, accumulation_steps
    from pipeline.training.shared_model import shared_model

    plan = load_plan(
        write_plan(
            "epoch-buckets",
            "fedavg",
            model={"max_target_length": 48},
            prefix_cache=False,
            batch_size=2,
            grad_accum_steps=2,
        )
    )
    model, examples = shared_model(plan), _varied_targets()
    tokens = sorted(_target_tokens(model, plan, examples))
    least_padding = sum(max(pair) * len(pair) - sum(pair) for pair in (tokens[i : i + 2] for i in range(0, 10, 2)))
    steps = accumulation_steps(_batches(model, examples, plan, True, 3, plan.train.bucket_by_length), 2, "tokens")
    batches = [b for step in steps for b, _ in step]
    assert [len(step) for step in steps] == [2, 2, 1]  # 5 batches of 2: windows of 2
    assert sorted(e for b in batches for e in b.example_ids) == sorted(examples["example_id"])
    padding = sum(int(_target_lengths(b).max()) * len(b.example_ids) - int(_target_lengths(b).sum()) for b in batches)
    assert padding == least_padding
    for step in steps:
        n = [int(_target_lengths(b).sum()) for b, _ in step]
        assert [w for _, w in step] == pytest.approx([k / sum(n) for k in n])


@pytest.mark.parametrize("method", ["fedavg", "fedselectkd"])
def test_a_float16_prefix_cache_is_what_the_round_trains_on(ws, method):
    """model.cache_dtype float16 stores the frozen prefix rounded (half the disk): the round must train on those
    entries, so its losses differ from the exact float32 round by the rounding and no more."""
    from pipeline.experiments.settings import RunSettings
    from pipeline.federation.protocol import load_plan
    from pipeline.training.shared_model import prefix_cache_for

    exact, model, train, w0 = _setup(f"local-f32-{method}", method, lr=5e-3, batch_size=2)
    half = load_plan(
        write_plan(
            f"local-f16-{method}", method, model={"cache_dtype": "float16"}, lr=5e-3, batch_size=2, prefix_cache=True
        )
    )
    assert half.cache_dtype == "float16"
    losses = []
    for plan, cache in ((exact, None), (half, prefix_cache_for(half, model, RunSettings().cache))):
        model.load_adapter_state("local", w0)
        model.load_adapter_state("global", {k: v + 0.1 for k, v in w0.items()})
        result = _train(plan, model, train, cache=cache)
        losses.append((result.train_loss, result.ce))
    assert losses[0] != losses[1]
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)


def test_training_leaves_the_model_in_evaluation_mode_for_the_validation_that_follows(ws):
    plan, model, train, w0 = _setup("local-eval-mode", lr=5e-3, batch_size=2)
    _train(plan, model, train)
    assert not model.training and not any(m.training for m in model.modules())


def test_each_local_epoch_reshuffles_the_batches(ws, monkeypatch):
    from pipeline.training import client_training as local

    seeds = []
    real = local._batches

    def spy(model, examples, plan, shuffle, seed, bucket):
        seeds.append((plan.train.loss_normalisation, seed))
        return real(model, examples, plan, shuffle, seed, bucket)

    monkeypatch.setattr(local, "_batches", spy)
    plan, model, train, w0 = _setup("local-epochs-shuffle", lr=5e-3, batch_size=2, local_epochs=3)
    _train(plan, model, train)
    assert len({seed for _, seed in seeds}) == 3 and {n for n, _ in seeds} == {"tokens"}


def test_the_rounds_kd_is_the_token_weighted_mean_of_its_examples_kd(ws):
    """With lr 0 nothing moves, so each example trained alone reports its own KD; the round over all of them
    reports their mean weighted by target tokens (AdaFedKD: KD on every token)."""
    plan, model, train, w0 = _setup("local-kd-mean", "fedkd", lr=0.0, batch_size=2)
    g = torch.Generator().manual_seed(6)
    model.load_adapter_state("global", {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in w0.items()})
    whole = _train(plan, model, train)
    alone = [_train(plan, model, train.iloc[[i]]) for i in range(len(train))]
    assert len({round(r.kd, 6) for r in alone}) > 1  # the examples differ
    assert whole.kd == pytest.approx(sum(r.kd * r.n_tokens for r in alone) / sum(r.n_tokens for r in alone), rel=1e-5)


def test_step_matched_centralized_windows_use_every_pooled_example_equally():
    from pipeline.training.serverless import round_window

    # 7 pooled rows, the largest client has 3: 7 rounds x 3 rows use each row exactly 3 times, 3 distinct a round
    windows = [round_window(7, 3, rnd, seed=5) for rnd in range(1, 8)]
    assert all(len(set(w.tolist())) == 3 for w in windows)
    assert np.bincount(np.concatenate(windows), minlength=7).tolist() == [3] * 7
    assert round_window(7, 3, 4, seed=5).tolist() == windows[3].tolist()  # a resumed round picks the same rows
    assert sorted(round_window(7, 7, 1, seed=6).tolist()) == list(range(7))  # window = all rows: one epoch
    assert sorted(round_window(4, 9, 2, seed=0).tolist()) == [0, 1, 2, 3]  # a window past the data: all of it once


def test_max_lengths_beyond_the_backbones_positions_are_one_config_error_not_a_torch_crash(ws):
    from pipeline.common.config import ConfigError
    from pipeline.federation.protocol import load_plan
    from pipeline.training.shared_model import shared_model

    model = shared_model(load_plan(write_plan("len-ok", "fedavg", model={"max_source_length": 256})))
    # the tiny BART's position table is 256 long (tests/tiny_models.py): 256 tokens run, 257 crash inside torch
    for n, runs in ((256, True), (257, False)):
        ids = torch.full((1, n), 5)
        try:
            model.backbone(input_ids=ids, decoder_input_ids=ids[:, :4])
        except IndexError:
            assert not runs
        else:
            assert runs
    for key in ("max_source_length", "max_target_length"):
        with pytest.raises(ConfigError, match=rf"^model\.{key}=257 is out of range; allowed: <= 256"):
            shared_model(load_plan(write_plan(f"len-{key}", "fedavg", model={key: 257})))


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda t, p: p.write_bytes(p.read_bytes()[:-20]), "not a readable"),  # cut short
        (lambda t, p: t.drop(columns="is_noun_or_verb").to_parquet(p, index=False), "is_noun_or_verb"),
        # a null noun flag read as False would train CE alone on that token without a word
        (lambda t, p: t.astype({"is_noun_or_verb": object}).assign(is_noun_or_verb=None).to_parquet(p), "null"),
    ],
)
def test_a_damaged_pos_tag_file_is_one_line_naming_it_before_a_hard_kd_round(ws, damage, problem):
    from pipeline.common.schema import DataError
    from pipeline.paths import PATHS

    plan, model, train, _ = _setup("local-hard-damaged", "hardkd", lr=0.0)
    path = ws / PATHS.postags
    kept = path.read_bytes()
    try:
        damage(pd.read_parquet(path), path)
        with pytest.raises(DataError) as err:
            _train(plan, model, train)
        names(err.value, str(PATHS.postags), problem)
    finally:
        path.write_bytes(kept)
