"""Selective-KD loss against values worked out by hand (vocab 3, two sequences, three real tokens + padding).

Teacher q_g and student q_l are given as probabilities; logits = log p (softmax(log p) = p).
  token 1 (seq 0, pos 0): q_g = [1/2, 1/4, 1/4]  q_l = [1/4, 1/2, 1/4]  y = 0
      H  = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2 = 1.0397
      CE = -ln(1/4) = ln 4,  KL(q_g||q_l) = 1/2 ln 2 + 1/4 ln(1/2) + 1/4 ln 1 = 1/4 ln 2
  token 2 (seq 0, pos 1): q_g = [0.8, 0.1, 0.1]  q_l = [1/2, 1/4, 1/4]  y = 0
      H  = -(0.8 ln 0.8 + 0.2 ln 0.1) = 0.6390
      CE = ln 2,  KL = 0.8 ln 1.6 + 0.2 ln 0.4
  token 3 (seq 1, pos 0): q_g = [1/3, 1/3, 1/3]  q_l = [0.2, 0.2, 0.6]  y = 2
      H  = ln 3 = 1.0986
      CE = -ln 0.6,  KL = 1/3 (2 ln(5/3) + ln(5/9))
  seq 1, pos 1: padding (label -100) with arbitrary logits.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipeline.modeling import losses
from pipeline.modeling.losses import KDConfig, LossOutput, distillation_loss


def token_entropy(logits: torch.Tensor, log_base: str = "e") -> torch.Tensor:
    """H(softmax(logits)) over the last dimension, in nats ("e") or bits ("2"): the tests' reference entropy."""
    logp = F.log_softmax(logits.float(), dim=-1)
    h = -(logp.exp() * logp).sum(dim=-1)
    return h / math.log(2.0) if str(log_base) == "2" else h


L = math.log
H1, H2, H3 = 1.5 * L(2), -(0.8 * L(0.8) + 0.2 * L(0.1)), L(3)
CE1, CE2, CE3 = L(4), L(2), -L(0.6)
KL1, KL2, KL3 = 0.25 * L(2), 0.8 * L(1.6) + 0.2 * L(0.4), (2 * L(5 / 3) + L(5 / 9)) / 3
LAM = 0.2
# the example's three target tokens, packed: student q, teacher p, one-hot labels (the gradients' hand values)
Q = torch.tensor([[0.25, 0.5, 0.25], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6]])
P = torch.tensor([[0.5, 0.25, 0.25], [0.8, 0.1, 0.1], [1 / 3, 1 / 3, 1 / 3]])
ONEHOT = torch.tensor([[1.0, 0, 0], [1, 0, 0], [0, 0, 1]])


def grid(rows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A loss output's per-token rows laid out like ``labels`` [B, T] (0 / False on padding)."""
    return torch.zeros(labels.shape, dtype=rows.dtype).masked_scatter(labels != -100, rows)


def n_kd(out: LossOutput) -> int:
    """The gated tokens of a loss output (the trainers read them in one transfer a round)."""
    return int(out.gate_rows.sum())


def _logits(probs):
    return torch.tensor(probs, dtype=torch.float64).log().float()


@pytest.fixture
def example():
    teacher = _logits([[[0.5, 0.25, 0.25], [0.8, 0.1, 0.1]], [[1 / 3, 1 / 3, 1 / 3], [0.9, 0.05, 0.05]]])
    student = _logits([[[0.25, 0.5, 0.25], [0.5, 0.25, 0.25]], [[0.2, 0.2, 0.6], [0.1, 0.1, 0.8]]])
    labels = torch.tensor([[0, 0], [2, -100]])
    return student, teacher, labels


def test_hand_values_are_consistent():
    # the three entropies are distinct, so tau can sit below, between and above them
    assert H2 < H1 < H3
    assert H1 == pytest.approx(1.039720771, abs=1e-8)
    assert KL2 == pytest.approx(0.192745, abs=1e-6)


def test_token_entropy_nats_and_bits(example):
    _, teacher, _ = example
    h = token_entropy(teacher)
    assert h[0, 0].item() == pytest.approx(H1, abs=1e-5)
    assert h[0, 1].item() == pytest.approx(H2, abs=1e-5)
    assert h[1, 0].item() == pytest.approx(H3, abs=1e-5)
    assert token_entropy(teacher, "2")[0, 0].item() == pytest.approx(1.5, abs=1e-5)  # 1.5 bits


@pytest.mark.parametrize(
    "tau, expected_gate, expected_loss",
    [
        (0.5, [[False, False], [False, False]], (CE1 + CE2 + CE3) / 3),  # below every H: plain CE
        (0.8, [[False, True], [False, False]], (CE1 + (1 - LAM) * CE2 + LAM * KL2 + CE3) / 3),  # H2 < tau < H1
        (
            1.07,
            [[True, True], [False, False]],
            ((1 - LAM) * (CE1 + CE2) + LAM * (KL1 + KL2) + CE3) / 3,
        ),  # H1 < tau < H3
        (2.0, [[True, True], [True, False]], ((1 - LAM) * (CE1 + CE2 + CE3) + LAM * (KL1 + KL2 + KL3)) / 3),
    ],
)
def test_selective_kd_matches_hand_computation(example, tau, expected_gate, expected_loss):
    student, teacher, labels = example
    out = distillation_loss(student, teacher, labels, KDConfig(mode="selective", kd_lambda=LAM, tau=tau))
    assert grid(out.gate_rows, labels).tolist() == expected_gate
    assert out.loss.item() == pytest.approx(expected_loss, abs=1e-5)
    assert out.n_tokens == 3
    assert n_kd(out) == sum(map(sum, expected_gate))
    assert float(out.means(n_kd(out))[1]) == pytest.approx((CE1 + CE2 + CE3) / 3, abs=1e-5)
    assert out.entropy_rows.shape == (3,)  # one entropy a non-padding token: padding has none


def test_kd_and_ce_modes(example):
    student, teacher, labels = example
    kd = distillation_loss(student, teacher, labels, KDConfig(mode="kd", kd_lambda=LAM, tau=0.0))
    assert kd.loss.item() == pytest.approx(((1 - LAM) * (CE1 + CE2 + CE3) + LAM * (KL1 + KL2 + KL3)) / 3, abs=1e-5)
    assert float(kd.means(n_kd(kd))[2]) == pytest.approx((KL1 + KL2 + KL3) / 3, abs=1e-5)
    ce = distillation_loss(student, teacher, labels, KDConfig(mode="ce", tau=100.0))
    assert ce.loss.item() == pytest.approx((CE1 + CE2 + CE3) / 3, abs=1e-5)
    assert not ce.gate_rows.any() and float(ce.means(n_kd(ce))[2]) == 0.0
    # CE needs no teacher at all
    assert distillation_loss(student, None, labels, KDConfig(mode="ce")).loss.item() == pytest.approx(ce.loss.item())
    with pytest.raises(ValueError, match="teacher"):
        distillation_loss(student, None, labels, KDConfig(mode="kd"))


def test_hard_mode_uses_the_mask_only(example):
    student, teacher, labels = example
    mask = torch.tensor([[True, False], [True, True]])  # the padding position must stay off
    out = distillation_loss(student, teacher, labels, KDConfig(mode="hard", kd_lambda=LAM), hard_mask=mask)
    assert grid(out.gate_rows, labels).tolist() == [[True, False], [True, False]]
    assert out.loss.item() == pytest.approx(((1 - LAM) * (CE1 + CE3) + LAM * (KL1 + KL3) + CE2) / 3, abs=1e-5)


def test_padding_is_excluded(example):
    student, teacher, labels = example
    cfg = KDConfig(mode="kd", kd_lambda=LAM)
    base = distillation_loss(student, teacher, labels, cfg).loss.item()
    student2, teacher2 = student.clone(), teacher.clone()
    student2[1, 1] = torch.tensor([9.0, -9.0, 3.0])
    teacher2[1, 1] = torch.tensor([-5.0, 7.0, 0.0])
    assert distillation_loss(student2, teacher2, labels, cfg).loss.item() == pytest.approx(base, abs=1e-6)


def test_sequence_normalisation(example):
    student, teacher, labels = example
    out = distillation_loss(student, teacher, labels, KDConfig(mode="ce", loss_normalisation="sequences"))
    assert out.loss.item() == pytest.approx(((CE1 + CE2) / 2 + CE3) / 2, abs=1e-5)


def test_temperature_scales_kl_by_t_squared():
    # teacher uniform; student logits [2 ln 2, 0, 0] -> at T = 2 the tempered student is [1/2, 1/4, 1/4]
    teacher = torch.zeros(1, 1, 3)
    student = torch.tensor([[[2 * L(2), 0.0, 0.0]]])
    labels = torch.tensor([[0]])
    out = distillation_loss(student, teacher, labels, KDConfig(mode="kd", kd_lambda=1.0, kd_temperature=2.0))
    kl_tempered = (L((1 / 3) / 0.5) + 2 * L((1 / 3) / 0.25)) / 3
    assert out.loss.item() == pytest.approx(4 * kl_tempered, abs=1e-5)


def test_kl_direction_student_to_teacher(example):
    student, teacher, labels = example
    out = distillation_loss(
        student[:1, :1],
        teacher[:1, :1],
        labels[:1, :1],
        KDConfig(mode="kd", kd_lambda=1.0, kd_direction="student_to_teacher"),
    )
    # KL(q_l || q_g) for token 1: 1/4 ln(1/2) + 1/2 ln 2 + 1/4 ln 1 = 1/4 ln 2
    assert out.loss.item() == pytest.approx(0.25 * L(2), abs=1e-6)


def test_only_student_gets_gradients(example):
    student, teacher, labels = example
    student = student.clone().requires_grad_(True)
    teacher = teacher.clone().requires_grad_(True)
    distillation_loss(student, teacher, labels, KDConfig(kd_lambda=LAM, tau=2.0)).loss.backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert teacher.grad is None
    assert student.grad[1, 1].abs().sum() == 0  # padding contributes nothing


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="mode"):
        KDConfig(mode="selectve")
    with pytest.raises(ValueError, match="kd_lambda"):
        KDConfig(kd_lambda=1.5)


def _reference_loss(student, teacher, labels, cfg, hard_mask=None):
    """The loss of the module docstring written out with plain autograd ops on [B, T, V] (no packing, no fusion)."""
    valid = labels != -100
    logp_l = torch.log_softmax(student, -1)
    ce = -logp_l.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp_g = torch.log_softmax(teacher, -1)
    entropy = -(logp_g.exp() * logp_g).sum(-1) / (L(2) if cfg.entropy_log_base == "2" else 1.0)
    t = cfg.kd_temperature
    lt, gt = torch.log_softmax(student / t, -1), torch.log_softmax(teacher / t, -1)
    if cfg.kd_direction == "teacher_to_student":
        kl = (gt.exp() * (gt - lt)).sum(-1) * t * t
    else:
        kl = (lt.exp() * (lt - gt)).sum(-1) * t * t
    gate = {
        "ce": torch.zeros_like(valid),
        "kd": valid,
        "selective": (entropy < cfg.tau) & valid,
        "hard": (hard_mask if hard_mask is not None else valid) & valid,
    }[cfg.mode]
    per_token = torch.where(gate, (1 - cfg.kd_lambda) * ce + cfg.kd_lambda * kl, ce) * valid
    if cfg.loss_normalisation == "tokens":
        loss = per_token.sum() / valid.sum()
    else:
        loss = (per_token.sum(1) / valid.sum(1)).mean()
    return loss, entropy * valid, gate


@pytest.mark.parametrize("mode", ["ce", "kd", "selective", "hard"])
@pytest.mark.parametrize(
    "temperature, direction, normalisation",
    [
        (1.0, "teacher_to_student", "tokens"),
        (2.0, "teacher_to_student", "sequences"),
        (1.0, "student_to_teacher", "sequences"),
        (0.5, "student_to_teacher", "tokens"),
    ],
)
def test_fused_loss_equals_plain_autograd(mode, temperature, direction, normalisation, monkeypatch):
    """Loss, gradient w.r.t. the student logits, entropy and gate of the chunked, hand-differentiated loss equal
    plain autograd on random logits with padding, for [B, T, V] and packed [N, V] inputs and any chunk size."""
    g = torch.Generator().manual_seed(11)
    b, t, v = 3, 6, 40
    student = torch.randn(b, t, v, generator=g, dtype=torch.float64).float() * 3
    teacher = torch.randn(b, t, v, generator=g).float()  # H ~ 3.2 nats > tau ...
    teacher[0, :3] *= 6  # ... except on a few confident rows: the selective gate is mixed
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[1, 4:] = -100
    labels[2, 2:] = -100
    hard = torch.rand(b, t, generator=g) < 0.5
    cfg = KDConfig(
        mode=mode,
        kd_lambda=0.3,
        tau=3.0,
        kd_temperature=temperature,
        kd_direction=direction,
        loss_normalisation=normalisation,
    )
    ref_in = student.clone().requires_grad_(True)
    ref_loss, ref_entropy, ref_gate = _reference_loss(ref_in, teacher, labels, cfg, hard)
    ref_loss.backward()
    if mode == "selective":
        assert 0 < int(ref_gate.sum()) < int((labels != -100).sum())
    valid = labels != -100
    for packed, chunk in ((False, 128), (False, 2), (True, 5)):
        leaf = student.clone().requires_grad_(True)
        inputs = (leaf[valid], teacher[valid]) if packed else (leaf, teacher)
        monkeypatch.setattr(losses, "CHUNK_ROWS_HOST", chunk)  # the rows a chunk takes on a CPU
        out = distillation_loss(*inputs, labels, cfg, hard_mask=hard if mode == "hard" else None)
        (out.loss * 0.5).backward()  # a scaled loss (gradient accumulation) scales the gradient
        assert out.loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)
        torch.testing.assert_close(leaf.grad, 0.5 * ref_in.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out.entropy_rows, ref_entropy.detach()[valid], atol=1e-4, rtol=1e-5)
        assert torch.equal(out.gate_rows, ref_gate[valid])
        assert n_kd(out) == int(ref_gate.sum())


def test_packed_logits_must_match_the_labels(example):
    student, teacher, labels = example
    with pytest.raises(ValueError, match="packed"):
        distillation_loss(student.reshape(-1, 3), teacher.reshape(-1, 3), labels, KDConfig(mode="kd"))


def test_half_precision_logits_are_handled_in_float32(example):
    student, teacher, labels = example
    cfg = KDConfig(mode="kd", kd_lambda=LAM)
    ref_in = student.clone().requires_grad_(True)
    ref = distillation_loss(ref_in, teacher, labels, cfg)
    ref.loss.backward()
    half = student.to(torch.bfloat16).requires_grad_(True)
    out = distillation_loss(half, teacher.to(torch.bfloat16), labels, cfg)
    out.loss.backward()
    assert half.grad.dtype == torch.bfloat16
    assert out.loss.item() == pytest.approx(ref.loss.item(), abs=2e-2)
    torch.testing.assert_close(half.grad.float(), ref_in.grad, atol=1e-2, rtol=0)


def test_half_precision_gradient_chunks_are_written_whole_and_without_warnings(example, monkeypatch):
    """bfloat16 logits take a float32 chunk of the gradient, copied back: with chunks of 2 rows (three tokens: a
    chunk after the first) the gradient is (1 - lambda)(q - onehot(y)) / N + lambda (q - p) / N, and torch warns of no
    output it had to resize (mutation testing: a chunk buffer of the wrong shape was silently resized)."""
    import warnings

    student, teacher, labels = example
    monkeypatch.setattr(losses, "CHUNK_ROWS_HOST", 2)
    half = student.to(torch.bfloat16).requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distillation_loss(half, teacher.to(torch.bfloat16), labels, KDConfig(mode="kd", kd_lambda=LAM)).loss.backward()
    q, p, onehot = Q, P, ONEHOT
    expected = ((1 - LAM) * (q - onehot) + LAM * (q - p)) / 3
    torch.testing.assert_close(half.grad.float()[labels != -100], expected, atol=1e-2, rtol=0)


# ----------------------------------------------------------------------------------- portable gates
@pytest.mark.parametrize(
    "scale, tau, expected_gate, expected_threshold",
    [
        # V = 3: ln|V| = H3 (the uniform row). 0.9 ln 3 = 0.989 lies between H2 (0.639) and H1 (1.040).
        ("max_entropy", 0.9, [[False, True], [False, False]], 0.9 * L(3)),
        # 0.95 ln 3 = 1.044 lies between H1 and H3; the uniform row itself never passes (H3 = ln|V|, strict <).
        ("max_entropy", 0.95, [[True, True], [False, False]], 0.95 * L(3)),
        # quantiles of {H2, H1, H3} (linear interpolation): 0.5 -> H1, so only H2 < H1 passes; 0.75 -> (H1+H3)/2
        ("batch_quantile", 0.5, [[False, True], [False, False]], H1),
        ("batch_quantile", 0.75, [[True, True], [False, False]], (H1 + H3) / 2),
    ],
)
def test_portable_gates_match_hand_computation(example, scale, tau, expected_gate, expected_threshold):
    student, teacher, labels = example
    out = distillation_loss(
        student, teacher, labels, KDConfig(mode="selective", kd_lambda=LAM, tau=tau, tau_scale=scale)
    )
    assert grid(out.gate_rows, labels).tolist() == expected_gate
    assert float(out.threshold) == pytest.approx(expected_threshold, abs=1e-5)


def test_margin_gate_matches_hand_computation(example, monkeypatch):
    """kd_gate margin: top-1 minus top-2 teacher probability >= tau. Margins 1/2 - 1/4 = 0.25, 0.8 - 0.1 = 0.7 and 0
    (uniform): tau 0.5 distils token 2 only, whatever the chunking of the gate's own pass over the logits (mutation
    testing: the loss once gave the gate no chunk size, and no test ran this gate through the loss)."""
    student, teacher, labels = example
    for chunk in (128, 1):
        monkeypatch.setattr(losses, "CHUNK_ROWS_HOST", chunk)
        out = distillation_loss(student, teacher, labels, KDConfig(kd_gate="margin", kd_lambda=LAM, tau=0.5))
        assert grid(out.gate_rows, labels).tolist() == [[False, True], [False, False]]
        assert out.threshold == 0.5
        assert out.loss.item() == pytest.approx((CE1 + (1 - LAM) * CE2 + LAM * KL2 + CE3) / 3, abs=1e-5)


def test_max_entropy_gate_in_bits_is_the_same_gate(example):
    student, teacher, labels = example
    nats = distillation_loss(student, teacher, labels, KDConfig(tau=0.9, tau_scale="max_entropy"))
    bits = distillation_loss(student, teacher, labels, KDConfig(tau=0.9, tau_scale="max_entropy", entropy_log_base="2"))
    assert nats.gate_rows.tolist() == bits.gate_rows.tolist()
    assert bits.threshold == pytest.approx(0.9 * math.log2(3), abs=1e-6)


def test_absolute_gate_reports_its_threshold_and_portable_tau_is_a_fraction(example):
    student, teacher, labels = example
    assert distillation_loss(student, teacher, labels, KDConfig(tau=0.8)).threshold == 0.8
    assert math.isnan(distillation_loss(student, teacher, labels, KDConfig(mode="kd")).threshold)
    with pytest.raises(ValueError, match="tau_scale"):
        KDConfig(tau=5.0, tau_scale="max_entropy")
    with pytest.raises(ValueError, match="tau_scale"):
        KDConfig(tau=0.5, tau_scale="entropy_rank")


def test_the_default_config_is_the_papers_lambda_and_tau(example):
    """METHOD.md: lambda 0.2, tau 5 nats. All three example tokens have H < 5, so all get KD."""
    student, teacher, labels = example
    out = distillation_loss(student, teacher, labels, KDConfig())
    assert grid(out.gate_rows, labels).tolist() == [[True, True], [True, False]] and out.threshold == 5.0
    expected = sum(0.8 * ce + 0.2 * kl for ce, kl in ((CE1, KL1), (CE2, KL2), (CE3, KL3))) / 3
    assert out.loss.item() == pytest.approx(expected, abs=1e-5)
    # keyword settings reach the config: tau 1.05 nats = 1.515 bits sits between H1 = 1.5 and H3 = 1.585 bits
    bits = distillation_loss(student, teacher, labels, KDConfig(kd_lambda=0.5, tau=1.55, entropy_log_base="2"))
    assert grid(bits.gate_rows, labels).tolist() == [[True, True], [False, False]]
    expected = (0.5 * (CE1 + KL1) + 0.5 * (CE2 + KL2) + CE3) / 3
    assert bits.loss.item() == pytest.approx(expected, abs=1e-5)
    mask = torch.tensor([[False, True], [True, True]])
    hard = distillation_loss(student, teacher, labels, KDConfig(mode="hard"), hard_mask=mask)
    assert grid(hard.gate_rows, labels).tolist() == [[False, True], [True, False]]  # the mask, never on padding
    assert hard.loss.item() == pytest.approx((CE1 + 0.8 * CE2 + 0.2 * KL2 + 0.8 * CE3 + 0.2 * KL3) / 3, abs=1e-5)
    seq = distillation_loss(
        student, teacher, labels, KDConfig(mode="hard", kd_lambda=1.0, loss_normalisation="sequences"), hard_mask=mask
    )
    assert seq.loss.item() == pytest.approx(((CE1 + KL2) / 2 + KL3) / 2, abs=1e-5)


@pytest.mark.parametrize("n_tokens", [2, 5, 9])
def test_max_entropy_threshold_depends_on_the_vocabulary_not_the_batch(n_tokens):
    g = torch.Generator().manual_seed(n_tokens)
    v = 7
    teacher = torch.randn(1, n_tokens, v, generator=g)
    labels = torch.zeros(1, n_tokens, dtype=torch.long)
    out = distillation_loss(teacher.clone(), teacher, labels, KDConfig(tau=0.5, tau_scale="max_entropy"))
    assert out.threshold == pytest.approx(0.5 * L(v), abs=1e-6)
    assert out.gate_rows.tolist() == (token_entropy(teacher) < 0.5 * L(v))[0].tolist()


def test_batch_quantile_gate_in_bits_is_the_same_gate(example):
    student, teacher, labels = example
    nats = distillation_loss(student, teacher, labels, KDConfig(tau=0.75, tau_scale="batch_quantile"))
    bits = distillation_loss(
        student, teacher, labels, KDConfig(tau=0.75, tau_scale="batch_quantile", entropy_log_base="2")
    )
    assert torch.equal(nats.gate_rows, bits.gate_rows)
    assert grid(bits.gate_rows, labels).tolist() == [[True, True], [False, False]]
    assert float(bits.threshold) == pytest.approx((H1 + H3) / 2 / L(2), abs=1e-5)  # the same quantile, in bits


@pytest.mark.parametrize("scale", [2.0, 3.0, 0.25])
def test_gradient_is_linear_in_the_upstream_gradient(example, scale):
    """d(c L)/dz = c dL/dz for any c (loss / grad_accum_steps, loss * 2 ...), c = 1 included as the reference."""
    student, teacher, labels = example
    grads = []
    for c in (1.0, scale):
        leaf = student.clone().requires_grad_(True)
        (distillation_loss(leaf, teacher, labels, KDConfig(mode="kd", kd_lambda=LAM)).loss * c).backward()
        grads.append(leaf.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], scale * grads[0], atol=1e-7, rtol=1e-6)


def test_ce_without_a_teacher_trains_the_student_with_the_ce_gradient(example):
    """mode "ce", no teacher logits: dL/dz = (q_l - onehot(y)) / N on real tokens, 0 on padding; nothing gated."""
    student, _, labels = example
    leaf = student.clone().requires_grad_(True)
    out = distillation_loss(leaf, None, labels, KDConfig(mode="ce"))
    out.loss.backward()
    q = torch.softmax(student, -1)
    expected = torch.zeros_like(q)
    for (b, t), y in (((0, 0), 0), ((0, 1), 0), ((1, 0), 2)):
        expected[b, t] = (q[b, t] - torch.nn.functional.one_hot(torch.tensor(y), 3)) / 3
    torch.testing.assert_close(leaf.grad, expected, atol=1e-6, rtol=1e-5)
    assert out.loss.item() == pytest.approx((CE1 + CE2 + CE3) / 3, abs=1e-5)
    assert (
        n_kd(out) == 0
        and not out.gate_rows.any()
        and not out.entropy_rows.any()
        and float(out.means(n_kd(out))[2]) == 0.0
    )


# ----------------------------------------------------------------------------------- bad input: one clear line
def _raises_naming(*parts: str):
    """A ValueError whose message is one line naming each part (the field, its value, the shapes), worded freely."""
    import re

    return pytest.raises(ValueError, match="^[^\n]*" + "".join(f"(?=[^\n]*{re.escape(p)})" for p in parts))


def test_bad_config_messages_name_the_field_value_and_allowed_values():
    with _raises_naming("KDConfig.mode", "'selectve'", "'selective'"):
        KDConfig(mode="selectve")
    with _raises_naming("KDConfig.tau_scale", "'rank'", "'max_entropy'"):
        KDConfig(tau_scale="rank")
    with _raises_naming("KDConfig.kd_direction", "'both'", "'teacher_to_student'"):
        KDConfig(kd_direction="both")
    with _raises_naming("KDConfig.entropy_log_base", "10"):
        KDConfig(entropy_log_base=10)
    with _raises_naming("KDConfig.loss_normalisation", "'batch'", "'tokens'"):
        KDConfig(loss_normalisation="batch")
    assert KDConfig(entropy_log_base=2).entropy_log_base == "2"  # a number from YAML is read as the base's name
    with _raises_naming("KDConfig.kd_lambda", "-0.1"):
        KDConfig(kd_lambda=-0.1)
    assert KDConfig(kd_lambda=0.0).kd_lambda == 0.0 and KDConfig(kd_lambda=1.0).kd_lambda == 1.0  # both ends allowed
    with _raises_naming("KDConfig.kd_temperature", "0.0"):
        KDConfig(kd_temperature=0.0)
    with _raises_naming("KDConfig.tau", "0.0", "batch_quantile"):
        KDConfig(tau=0.0, tau_scale="batch_quantile")
    assert KDConfig(tau=1.0, tau_scale="max_entropy").tau == 1.0


def test_bad_batches_are_named(example):
    student, teacher, labels = example
    with _raises_naming("distillation_loss", "padding"):
        distillation_loss(student, teacher, torch.full_like(labels, -100), KDConfig())
    with _raises_naming("distillation_loss", "'kd'"):
        distillation_loss(student, None, labels, KDConfig(mode="kd"))
    with _raises_naming("distillation_loss", "'hard'", "hard_mask"):
        distillation_loss(student, teacher, labels, KDConfig(mode="hard"))
    with _raises_naming("hard_mask", "(2, 1)", "(2, 2)"):
        distillation_loss(student, teacher, labels, KDConfig(mode="hard"), hard_mask=torch.ones(2, 1))
    with _raises_naming("logits_local", "(2, 1, 3)", "(2, 2)"):
        distillation_loss(student[:, :1], teacher, labels, KDConfig())
    with _raises_naming("logits_global", "(1, 2, 3)", "(2, 2)"):
        distillation_loss(student, teacher[:1], labels, KDConfig())
    with _raises_naming("logits_global", "(2, 2)", "N = 3", "(4, 3)"):
        distillation_loss(student, teacher.reshape(4, 3), labels, KDConfig())


def test_hard_mask_may_be_given_as_zeros_and_ones(example):
    student, teacher, labels = example
    as_bool = distillation_loss(
        student, teacher, labels, KDConfig(mode="hard"), hard_mask=torch.tensor([[True, False], [True, True]])
    )
    as_int = distillation_loss(
        student, teacher, labels, KDConfig(mode="hard"), hard_mask=torch.tensor([[1, 0], [1, 1]])
    )
    assert torch.equal(as_int.gate_rows, as_bool.gate_rows)
    assert grid(as_int.gate_rows, labels).tolist() == [[True, False], [True, False]]
    assert as_int.loss.item() == as_bool.loss.item()


def test_unpadded_batches_and_empty_sequences_give_the_same_loss():
    """An unpadded [B, T, V] batch is the packed one; an all-padding sequence changes neither normalisation."""
    g = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    labels = torch.randint(0, 5, (2, 3), generator=g)
    for norm in ("tokens", "sequences"):
        cfg = KDConfig(mode="kd", kd_lambda=0.3, loss_normalisation=norm)
        full = distillation_loss(student, teacher, labels, cfg)
        packed = distillation_loss(student.reshape(6, 5), teacher.reshape(6, 5), labels, cfg)
        assert full.loss.item() == pytest.approx(packed.loss.item(), abs=1e-6)
        assert full.entropy_rows.shape == (6,) and full.n_tokens == 6
        padded_labels = torch.cat([labels, torch.full((1, 3), -100)])
        padded = distillation_loss(
            torch.cat([student, student[:1]]), torch.cat([teacher, teacher[:1]]), padded_labels, cfg
        )
        assert padded.loss.item() == pytest.approx(full.loss.item(), abs=1e-6)


def test_portable_tau_above_one_is_rejected():
    with _raises_naming("KDConfig.tau", "1.5", "max_entropy"):
        KDConfig(tau=1.5, tau_scale="max_entropy")


@pytest.mark.parametrize("chunk_rows", [1, 2, 4, 128])
def test_batch_quantile_threshold_is_the_quantile_of_all_token_entropies(chunk_rows, monkeypatch):
    """Whatever the chunking, the threshold is the tau-quantile of H(q_g) over every real token (9 tokens, V = 3)."""
    g = torch.Generator().manual_seed(5)
    teacher = torch.randn(1, 9, 3, generator=g) * torch.linspace(0.1, 4.0, 9).view(1, 9, 1)
    labels = torch.zeros(1, 9, dtype=torch.long)
    monkeypatch.setattr(losses, "CHUNK_ROWS_HOST", chunk_rows)
    out = distillation_loss(teacher.clone(), teacher, labels, KDConfig(tau=0.3, tau_scale="batch_quantile"))
    expected = torch.quantile(token_entropy(teacher)[0].double(), 0.3).item()
    assert float(out.threshold) == pytest.approx(expected, abs=1e-6)
    assert n_kd(out) == int((token_entropy(teacher) < expected).sum()) == 3  # 30 % of 9 tokens lie below


def test_only_the_loss_carries_a_gradient(example):
    student, teacher, labels = example
    out = distillation_loss(student.clone().requires_grad_(True), teacher, labels, KDConfig(mode="kd"))
    assert out.loss.requires_grad
    assert not out.entropy_rows.requires_grad and not out.gate_rows.requires_grad  # diagnostics, not part of the graph
    # the per-token CE and KL come out of the loss's own kernel: marked non-differentiable there (mutation testing: a
    # kernel that marked only one of them gave the other a gradient its backward would silently drop)
    assert not out.ce_rows.requires_grad and not out.kl_rows.requires_grad


def test_loss_chunks_are_small_on_a_cpu_and_large_elsewhere_within_their_memory_budget():
    from pipeline.modeling.losses import CHUNK_BYTES_DEVICE, chunk_rows_for

    assert chunk_rows_for(torch.zeros(3, 30522)) == 128
    rows = chunk_rows_for(torch.empty(3, 30522, device="meta"))  # any device but the CPU: a GPU's launches
    assert rows > 4000 and rows * 30522 * 4 <= CHUNK_BYTES_DEVICE
    assert chunk_rows_for(torch.empty(3, 10**9, device="meta")) == 128  # a huge vocabulary: never below 128


def test_loss_chunks_on_a_device_are_a_whole_number_of_rows():
    """2**29 bytes / (4 bytes x 30522 columns) = 4397.43 rows: 4397, an int (the kernel's range() step; mutation
    testing: a true division gave 4397.43..., which passed the bounds above)."""
    from pipeline.modeling.losses import chunk_rows_for

    rows = chunk_rows_for(torch.empty(3, 30522, device="meta"))
    assert type(rows) is int and rows == 4397


# ----------------------------------------------------------------------------------- several runs in one call
def _runs(g: torch.Generator, v: int = 40):
    """Seven runs' micro-batches (other sizes and widths, padding), their configurations (every gate, hard KD, both
    normalisations, plain CE beside a teacher and without one) and hard masks."""
    cfgs = [
        KDConfig(kd_lambda=0.3, tau=3.0),
        KDConfig(kd_lambda=0.5, tau=0.87, tau_scale="batch_quantile"),
        KDConfig(kd_lambda=0.2, tau=0.4, tau_scale="max_entropy", loss_normalisation="sequences"),
        KDConfig(mode="kd", kd_lambda=0.7),
        KDConfig(mode="hard", kd_lambda=0.4),
        KDConfig(mode="ce"),  # beside a teacher: its entropy, no gate
        KDConfig(mode="ce", loss_normalisation="sequences"),  # without one
    ]
    labels, hard = [], []
    for r in range(len(cfgs)):
        y = torch.randint(0, v, (2 + r % 3, 4 + r % 2), generator=g)
        y[-1, 1 + r % 3 :] = -100
        labels.append(y)
        hard.append(torch.rand(y.shape, generator=g) < 0.5)
    n = sum(int((y != -100).sum()) for y in labels)
    student = (torch.randn(n, v, generator=g) * 3).requires_grad_(True)
    teacher = torch.randn(n, v, generator=g) * torch.where(torch.rand(n, 1, generator=g) < 0.4, 6.0, 1.0)
    return student, teacher, labels, cfgs, hard


@pytest.mark.parametrize("chunk", [128, 3])
def test_several_runs_in_one_call_give_each_run_what_it_gives_alone_to_the_bit(chunk, monkeypatch):
    """distillation_losses (the stacked trainer's one call a micro-batch) on seven runs of every kind: each run's
    loss, per-token CE and KL, gate, entropy, threshold and gradient (its loss weighted as in a step) are exactly
    those of distillation_loss on that run alone."""
    from pipeline.modeling.losses import distillation_losses

    student, teacher, labels, cfgs, hard = _runs(torch.Generator().manual_seed(5))
    counts = [int((y != -100).sum()) for y in labels]
    starts = [sum(counts[:r]) for r in range(len(counts) + 1)]
    weights = [0.5 + r for r in range(len(cfgs))]
    taught = starts[6]  # the last run has no teacher
    monkeypatch.setattr(losses, "CHUNK_ROWS_HOST", chunk)
    loss, outs = distillation_losses(student, teacher[:taught], labels, cfgs, hard)
    (loss * torch.tensor(weights)).sum().backward()
    assert torch.equal(loss, torch.stack([out.loss for out in outs]))
    assert n_kd(outs[0]) > 0 and n_kd(outs[1]) > 0 and n_kd(outs[4]) > 0 and n_kd(outs[5]) == 0
    for r, (out, cfg) in enumerate(zip(outs, cfgs)):
        s, e = starts[r], starts[r + 1]
        leaf = student.detach()[s:e].clone().requires_grad_(True)
        alone = distillation_loss(leaf, teacher[s:e] if r < 6 else None, labels[r], cfg, hard[r])
        (alone.loss * weights[r]).backward()
        assert torch.equal(out.loss, alone.loss), r
        for name in ("ce_rows", "kl_rows", "gate_rows", "entropy_rows"):
            assert torch.equal(getattr(out, name), getattr(alone, name)), (r, name)
        assert out.n_tokens == alone.n_tokens and str(out.threshold) == str(alone.threshold), r
        assert torch.equal(student.grad[s:e], leaf.grad), r
    assert outs[5].entropy_rows.sum() > 0 and outs[6].entropy_rows.sum() == 0


def test_a_ce_run_beside_a_teacher_before_a_distilling_run_and_two_runs_backward():
    """Two runs on the example's three tokens, both with teacher rows: plain CE first, then KD. Each run's loss,
    gate and gradient (its loss weighted 2 and 0.5) are the hand values: CE's (q - onehot(y)) / 3, KD's
    ((1 - lambda)(q - onehot(y)) + lambda (q - p)) / 3 (mutation testing: the gates' loop stopped at a CE run, and a
    backward of exactly two runs took their two weights for one; the seven-run tests end their taught runs with CE)."""
    from pipeline.modeling.losses import distillation_losses

    q, p, onehot, labels = Q, P, ONEHOT, torch.tensor([[0, 0], [2, -100]])
    student = torch.cat([q, q]).log().requires_grad_(True)
    cfgs = [KDConfig(mode="ce"), KDConfig(mode="kd", kd_lambda=LAM)]
    loss, outs = distillation_losses(student, torch.cat([p, p]).log(), [labels, labels], cfgs, [None, None])
    (loss * torch.tensor([2.0, 0.5])).sum().backward()
    ce_all, kl_all = CE1 + CE2 + CE3, KL1 + KL2 + KL3
    assert loss.tolist() == pytest.approx([ce_all / 3, ((1 - LAM) * ce_all + LAM * kl_all) / 3], abs=1e-5)
    assert outs[0].gate_rows.tolist() == [False] * 3 and outs[1].gate_rows.tolist() == [True] * 3
    assert outs[1].kl_rows.tolist() == pytest.approx([KL1, KL2, KL3], abs=1e-5)
    assert outs[0].entropy_rows.tolist() == pytest.approx([H1, H2, H3], abs=1e-5)
    expected = torch.cat([2.0 * (q - onehot) / 3, 0.5 * ((1 - LAM) * (q - onehot) + LAM * (q - p)) / 3])
    torch.testing.assert_close(student.grad, expected, atol=1e-6, rtol=1e-5)


def test_the_device_path_without_a_host_sync_gives_the_hand_values(monkeypatch):
    """On a GPU the kernel does not ask the host whether a chunk has a gated token (``z_l.is_cuda``): it computes the
    KL of every chunk with teacher rows and must leave the rows without one alone. Simulated on the CPU (is_cuda
    reads True): a selective run (tau 0.8: token 2 only) beside a CE run without teacher rows, and CE with no teacher
    at all, give the hand values (mutation testing: kernels that took the teacherless rows for taught ones passed
    every CPU test and failed only on a GPU)."""
    from pipeline.modeling.losses import distillation_losses

    q, p, onehot, labels = Q, P, ONEHOT, torch.tensor([[0, 0], [2, -100]])
    two = torch.cat([q, q]).log().requires_grad_(True)
    alone = q.log().requires_grad_(True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    cfgs = [KDConfig(kd_lambda=LAM, tau=0.8), KDConfig(mode="ce")]
    loss, outs = distillation_losses(two, p.log(), [labels, labels], cfgs, [None, None])
    loss.sum().backward()
    ce_only = distillation_loss(alone, None, labels, KDConfig(mode="ce"))
    ce_only.loss.backward()
    monkeypatch.undo()
    ce_all = CE1 + CE2 + CE3
    assert loss.tolist() == pytest.approx([(CE1 + (1 - LAM) * CE2 + LAM * KL2 + CE3) / 3, ce_all / 3], abs=1e-5)
    assert outs[0].gate_rows.tolist() == [False, True, False] and not outs[1].gate_rows.any()
    assert outs[0].kl_rows[[0, 2]].tolist() == [0.0, 0.0] and not outs[1].kl_rows.any()
    taught = (q - onehot) / 3
    taught[1] = ((1 - LAM) * (q[1] - onehot[1]) + LAM * (q[1] - p[1])) / 3
    torch.testing.assert_close(two.grad, torch.cat([taught, (q - onehot) / 3]), atol=1e-6, rtol=1e-5)
    assert ce_only.loss.item() == pytest.approx(ce_all / 3, abs=1e-5)
    torch.testing.assert_close(alone.grad, (q - onehot) / 3, atol=1e-6, rtol=1e-5)


def test_runs_of_other_temperatures_in_one_call_are_each_computed_alone():
    """One kernel takes one temperature, direction and log base: runs that differ in them are computed one by one,
    with the same results as alone; a run that distils needs teacher rows, which lead."""
    from pipeline.modeling.losses import distillation_losses

    student, teacher, labels, _, hard = _runs(torch.Generator().manual_seed(6))
    cfgs = [
        KDConfig(
            mode="kd", kd_temperature=1.0 + r % 2, kd_direction=("teacher_to_student", "student_to_teacher")[r % 3 == 2]
        )
        for r in range(7)
    ]
    _, outs = distillation_losses(student, teacher, labels, cfgs, hard)
    start = 0
    for y, cfg, out in zip(labels, cfgs, outs):
        end = start + int((y != -100).sum())
        alone = distillation_loss(student.detach()[start:end], teacher[start:end], y, cfg)
        assert torch.equal(out.loss, alone.loss) and torch.equal(out.kl_rows, alone.kl_rows)
        start = end
    with pytest.raises(ValueError, match="needs the global"):
        distillation_losses(student, teacher[: start - int((labels[-1] != -100).sum())], labels, cfgs, hard)
    with pytest.raises(ValueError, match="not whole runs"):
        distillation_losses(student, teacher[:1], labels, cfgs, hard)


def test_two_kernels_in_one_call_give_every_kind_of_run_what_it_gives_alone():
    """Two kernels (one run at temperature 2 beside six at 1) take the one-by-one path too: every run, hard KD with
    its mask and plain CE without a teacher among them, gets its loss, rows and gradient as alone (mutation testing:
    a path taken only above two kernels, or one that dropped the hard masks, passed the test of four kernels)."""
    from pipeline.modeling.losses import distillation_losses

    student, teacher, labels, cfgs, hard = _runs(torch.Generator().manual_seed(7))
    cfgs[3] = KDConfig(mode="kd", kd_lambda=0.7, kd_temperature=2.0)
    counts = [int((y != -100).sum()) for y in labels]
    starts = [sum(counts[:r]) for r in range(len(counts) + 1)]
    loss, outs = distillation_losses(student, teacher[: starts[6]], labels, cfgs, hard)
    loss.sum().backward()
    assert n_kd(outs[3]) > 0 and n_kd(outs[4]) > 0
    for r, (out, cfg) in enumerate(zip(outs, cfgs)):
        s, e = starts[r], starts[r + 1]
        leaf = student.detach()[s:e].clone().requires_grad_(True)
        alone = distillation_loss(leaf, teacher[s:e] if r < 6 else None, labels[r], cfg, hard[r])
        alone.loss.backward()
        assert torch.equal(out.loss, alone.loss), r
        for name in ("ce_rows", "kl_rows", "gate_rows", "entropy_rows"):
            assert torch.equal(getattr(out, name), getattr(alone, name)), (r, name)
        assert torch.equal(student.grad[s:e], leaf.grad), r


def test_batch_quantile_gates_the_tau_share_of_tokens_below_the_quantile_of_the_entropies_it_compares():
    """tau 0.5 over three tokens of distinct H(q_g) (float64: 9.82, 6.33, 1.68 nats): the threshold is the median H and
    only the token below it is distilled; the median token is not below itself. On a full-size vocabulary two float32
    evaluations of H differ in their last digits: the quantile must be of the entropies the gate compares."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(1, 3, 30522, generator=g) * torch.tensor([1.0, 3.0, 6.0]).view(1, 3, 1)
    labels = torch.zeros(1, 3, dtype=torch.long)
    out = distillation_loss(teacher.clone(), teacher, labels, KDConfig(tau=0.5, tau_scale="batch_quantile"))
    logp = torch.log_softmax(teacher.double(), -1)
    h = -(logp.exp() * logp).sum(-1)[0]
    assert out.gate_rows.tolist() == (h == h.min()).tolist() == [False, False, True]
    assert n_kd(out) == 1
    assert float(out.threshold) == pytest.approx(float(h.median()), abs=1e-4)


def test_the_batch_quantile_gate_leaves_its_threshold_where_it_was_computed(example, monkeypatch):
    """On a GPU, reading the quantile on the host would wait for the device at every micro-batch of every run with
    that gate: the gate compares with the quantile as a tensor and reports it so (nothing here reads a float)."""
    student, teacher, labels = example
    reads = []
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append(t) or t.item())
    out = distillation_loss(student, teacher, labels, KDConfig(tau=0.75, tau_scale="batch_quantile"))
    assert reads == [] and isinstance(out.threshold, torch.Tensor)
    assert grid(out.gate_rows, labels).tolist() == [[True, True], [False, False]]


def test_selective_kd_with_the_hard_kd_mask_gate_fails_at_planning_naming_the_key():
    """train.kd_gate token_mask (a registered gate: hard KD's) has no mask to read under selective KD: every training
    step would fail (with "mode 'hard' needs hard_mask"); the plan's check of the loss settings refuses it."""
    from pipeline.common.config import ConfigError, from_dict

    where = "params.yaml experiments.nv-gate"
    with pytest.raises(ConfigError) as err:
        from_dict(KDConfig, {"tau": 5.0, "tau_scale": "absolute", "kd_gate": "token_mask"}, where)
    assert str(err.value).startswith(f"{where}.kd_gate='token_mask'") and "hardkd" in str(err.value)
    KDConfig(mode="hard", kd_gate="token_mask")  # hard KD's own gate
    KDConfig(kd_gate="every_token")  # distils every token: selective KD as FedKD, but it trains


class _OneDevice(TorchDispatchMode):
    """What a GPU checks of each operation, on any device: its tensors are on one device (a 0-dim host tensor
    aside, as CUDA allows); copies between devices and host indices (which CUDA moves) aside. PyTorch's meta device
    does not check it in every kernel (its gather takes a host index)."""

    MOVES = ("aten._to_copy.", "aten.copy_.", "aten.index.", "aten.index_put_.", "aten._index_put_impl_.")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not str(func).startswith(self.MOVES):
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if len(devices := {t.device for t in tensors if t.dim() or t.device.type != "cpu"}) > 1:
                raise RuntimeError(f"{func}: tensors on {sorted(map(str, devices))}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("teacher_on", ["meta", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tensor_the_loss_makes_is_on_the_logits_device(monkeypatch, dtype, teacher_on):
    """A tensor made or left on the host beside device logits (a ``device=`` or ``.to(dev)`` left out) fails only on
    a GPU, in the lease's study call; mutation testing found 29 such lines no CPU test could tell apart. Here the
    student's logits are on PyTorch's meta device (shapes, no data), read as on a GPU (``is_cuda``: the kernel's
    no-sync path, the device's chunking), every operation checked as a GPU checks it (:class:`_OneDevice`); the
    teacher's logits there or on the host (the loss moves them), the labels and hard masks on the host as a trainer
    passes them; seven runs (every gate, hard KD, both normalisations, CE beside a teacher and without one)."""
    from pipeline.modeling.losses import distillation_losses, teacher_entropy

    student, teacher, labels, cfgs, hard = _runs(torch.Generator().manual_seed(6))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    z_l = student.detach().to("meta", dtype).requires_grad_(True)
    with _OneDevice():
        loss, outs = distillation_losses(z_l, teacher.to(teacher_on, dtype), labels, cfgs, hard)
        loss.sum().backward()
        entropy = teacher_entropy(teacher.to("meta", dtype), "2", 5)
    made = [loss, z_l.grad, entropy] + [t for o in outs for t in (o.loss, o.ce_rows, o.kl_rows, o.gate_rows)]
    assert {t.device.type for t in made + [o.entropy_rows for o in outs]} == {"meta"}
    assert z_l.grad.shape == student.shape and z_l.grad.dtype == dtype


def test_the_one_device_check_refuses_what_a_gpu_refuses():
    """The check above is no weaker than a GPU's: a host index into device rows, device rows minus host rows."""
    rows = torch.zeros(3, 4, device="meta")
    with _OneDevice(), pytest.raises(RuntimeError, match=r"gather.*\['cpu', 'meta'\]"):
        rows.gather(-1, torch.zeros(3, 1, dtype=torch.long))
    with _OneDevice(), pytest.raises(RuntimeError, match=r"sub.*\['cpu', 'meta'\]"):
        rows - torch.ones(3, 4)
    with _OneDevice():  # what CUDA allows: a host scalar, a copy to the device, a host boolean index
        (rows * torch.tensor(2.0)).copy_(torch.ones(3, 4))[torch.tensor([True, False, True])]
