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

from pipeline.losses import KDConfig, distillation_loss, hard_kd_loss, selective_kd_loss, token_entropy

L = math.log
H1, H2, H3 = 1.5 * L(2), -(0.8 * L(0.8) + 0.2 * L(0.1)), L(3)
CE1, CE2, CE3 = L(4), L(2), -L(0.6)
KL1, KL2, KL3 = 0.25 * L(2), 0.8 * L(1.6) + 0.2 * L(0.4), (2 * L(5 / 3) + L(5 / 9)) / 3
LAM = 0.2


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
        (1.07, [[True, True], [False, False]], ((1 - LAM) * (CE1 + CE2) + LAM * (KL1 + KL2) + CE3) / 3),  # H1 < tau < H3
        (2.0, [[True, True], [True, False]], ((1 - LAM) * (CE1 + CE2 + CE3) + LAM * (KL1 + KL2 + KL3)) / 3),
    ],
)
def test_selective_kd_matches_hand_computation(example, tau, expected_gate, expected_loss):
    student, teacher, labels = example
    out = distillation_loss(student, teacher, labels, KDConfig(mode="selective", lam=LAM, tau=tau))
    assert out.gate.tolist() == expected_gate
    assert out.loss.item() == pytest.approx(expected_loss, abs=1e-5)
    assert out.n_tokens == 3
    assert out.n_kd == sum(map(sum, expected_gate))
    assert out.ce_mean == pytest.approx((CE1 + CE2 + CE3) / 3, abs=1e-5)
    assert out.entropy[1, 1].item() == 0.0  # padding carries no entropy record


def test_kd_and_ce_modes(example):
    student, teacher, labels = example
    kd = distillation_loss(student, teacher, labels, KDConfig(mode="kd", lam=LAM, tau=0.0))
    assert kd.loss.item() == pytest.approx(((1 - LAM) * (CE1 + CE2 + CE3) + LAM * (KL1 + KL2 + KL3)) / 3, abs=1e-5)
    assert kd.kd_mean == pytest.approx((KL1 + KL2 + KL3) / 3, abs=1e-5)
    ce = distillation_loss(student, teacher, labels, KDConfig(mode="ce", tau=100.0))
    assert ce.loss.item() == pytest.approx((CE1 + CE2 + CE3) / 3, abs=1e-5)
    assert not ce.gate.any() and ce.kd_mean == 0.0
    # CE needs no teacher at all
    assert distillation_loss(student, None, labels, KDConfig(mode="ce")).loss.item() == pytest.approx(ce.loss.item())
    with pytest.raises(ValueError, match="teacher"):
        distillation_loss(student, None, labels, KDConfig(mode="kd"))


def test_hard_mode_uses_the_mask_only(example):
    student, teacher, labels = example
    mask = torch.tensor([[True, False], [True, True]])  # the padding position must stay off
    out = hard_kd_loss(student, teacher, labels, mask, lam=LAM)
    assert out.gate.tolist() == [[True, False], [True, False]]
    assert out.loss.item() == pytest.approx(((1 - LAM) * (CE1 + CE3) + LAM * (KL1 + KL3) + CE2) / 3, abs=1e-5)


def test_padding_is_excluded(example):
    student, teacher, labels = example
    cfg = KDConfig(mode="kd", lam=LAM)
    base = distillation_loss(student, teacher, labels, cfg).loss.item()
    student2, teacher2 = student.clone(), teacher.clone()
    student2[1, 1] = torch.tensor([9.0, -9.0, 3.0])
    teacher2[1, 1] = torch.tensor([-5.0, 7.0, 0.0])
    assert distillation_loss(student2, teacher2, labels, cfg).loss.item() == pytest.approx(base, abs=1e-6)


def test_sequence_normalisation(example):
    student, teacher, labels = example
    out = distillation_loss(student, teacher, labels, KDConfig(mode="ce", normalisation="sequences"))
    assert out.loss.item() == pytest.approx(((CE1 + CE2) / 2 + CE3) / 2, abs=1e-5)


def test_temperature_scales_kl_by_t_squared():
    # teacher uniform; student logits [2 ln 2, 0, 0] -> at T = 2 the tempered student is [1/2, 1/4, 1/4]
    teacher = torch.zeros(1, 1, 3)
    student = torch.tensor([[[2 * L(2), 0.0, 0.0]]])
    labels = torch.tensor([[0]])
    out = distillation_loss(student, teacher, labels, KDConfig(mode="kd", lam=1.0, temperature=2.0))
    kl_tempered = (L((1 / 3) / 0.5) + 2 * L((1 / 3) / 0.25)) / 3
    assert out.loss.item() == pytest.approx(4 * kl_tempered, abs=1e-5)


def test_kl_direction_student_to_teacher(example):
    student, teacher, labels = example
    out = distillation_loss(student[:1, :1], teacher[:1, :1], labels[:1, :1],
                            KDConfig(mode="kd", lam=1.0, kl_direction="student_to_teacher"))
    # KL(q_l || q_g) for token 1: 1/4 ln(1/2) + 1/2 ln 2 + 1/4 ln 1 = 1/4 ln 2
    assert out.loss.item() == pytest.approx(0.25 * L(2), abs=1e-6)


def test_only_student_gets_gradients(example):
    student, teacher, labels = example
    student = student.clone().requires_grad_(True)
    teacher = teacher.clone().requires_grad_(True)
    selective_kd_loss(student, teacher, labels, lam=LAM, tau=2.0).loss.backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert teacher.grad is None
    assert student.grad[1, 1].abs().sum() == 0  # padding contributes nothing


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="mode"):
        KDConfig(mode="selectve")
    with pytest.raises(ValueError, match="lam"):
        KDConfig(lam=1.5)


def _reference_loss(student, teacher, labels, cfg, hard_mask=None):
    """The loss of the module docstring written out with plain autograd ops on [B, T, V] (no packing, no fusion)."""
    valid = labels != -100
    logp_l = torch.log_softmax(student, -1)
    ce = -logp_l.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp_g = torch.log_softmax(teacher, -1)
    entropy = -(logp_g.exp() * logp_g).sum(-1) / (L(2) if cfg.log_base == "2" else 1.0)
    t = cfg.temperature
    lt, gt = torch.log_softmax(student / t, -1), torch.log_softmax(teacher / t, -1)
    if cfg.kl_direction == "teacher_to_student":
        kl = (gt.exp() * (gt - lt)).sum(-1) * t * t
    else:
        kl = (lt.exp() * (lt - gt)).sum(-1) * t * t
    gate = {"ce": torch.zeros_like(valid), "kd": valid, "selective": (entropy < cfg.tau) & valid,
            "hard": (hard_mask if hard_mask is not None else valid) & valid}[cfg.mode]
    per_token = torch.where(gate, (1 - cfg.lam) * ce + cfg.lam * kl, ce) * valid
    if cfg.normalisation == "tokens":
        loss = per_token.sum() / valid.sum()
    else:
        loss = (per_token.sum(1) / valid.sum(1)).mean()
    return loss, entropy * valid, gate


@pytest.mark.parametrize("mode", ["ce", "kd", "selective", "hard"])
@pytest.mark.parametrize("temperature, direction, normalisation", [
    (1.0, "teacher_to_student", "tokens"), (2.0, "teacher_to_student", "sequences"),
    (1.0, "student_to_teacher", "sequences"), (0.5, "student_to_teacher", "tokens"),
])
def test_fused_loss_equals_plain_autograd(mode, temperature, direction, normalisation):
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
    cfg = KDConfig(mode=mode, lam=0.3, tau=3.0, temperature=temperature, kl_direction=direction,
                   normalisation=normalisation)
    ref_in = student.clone().requires_grad_(True)
    ref_loss, ref_entropy, ref_gate = _reference_loss(ref_in, teacher, labels, cfg, hard)
    ref_loss.backward()
    if mode == "selective":
        assert 0 < int(ref_gate.sum()) < int((labels != -100).sum())
    valid = labels != -100
    for packed, chunk in ((False, 128), (False, 2), (True, 5)):
        leaf = student.clone().requires_grad_(True)
        inputs = (leaf[valid], teacher[valid]) if packed else (leaf, teacher)
        out = distillation_loss(*inputs, labels, cfg, hard_mask=hard if mode == "hard" else None, chunk_rows=chunk)
        (out.loss * 0.5).backward()  # a scaled loss (gradient accumulation) scales the gradient
        assert out.loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)
        torch.testing.assert_close(leaf.grad, 0.5 * ref_in.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out.entropy, ref_entropy.detach(), atol=1e-4, rtol=1e-5)
        assert torch.equal(out.gate, ref_gate)
        assert out.n_kd == int(ref_gate.sum())


def test_packed_logits_must_match_the_labels(example):
    student, teacher, labels = example
    with pytest.raises(ValueError, match="packed"):
        distillation_loss(student.reshape(-1, 3), teacher.reshape(-1, 3), labels, KDConfig(mode="kd"))


def test_half_precision_logits_are_handled_in_float32(example):
    student, teacher, labels = example
    cfg = KDConfig(mode="kd", lam=LAM)
    ref_in = student.clone().requires_grad_(True)
    ref = distillation_loss(ref_in, teacher, labels, cfg)
    ref.loss.backward()
    half = student.to(torch.bfloat16).requires_grad_(True)
    out = distillation_loss(half, teacher.to(torch.bfloat16), labels, cfg)
    out.loss.backward()
    assert half.grad.dtype == torch.bfloat16
    assert out.loss.item() == pytest.approx(ref.loss.item(), abs=2e-2)
    torch.testing.assert_close(half.grad.float(), ref_in.grad, atol=1e-2, rtol=0)


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
    out = distillation_loss(student, teacher, labels, KDConfig(mode="selective", lam=LAM, tau=tau, tau_scale=scale))
    assert out.gate.tolist() == expected_gate
    assert out.threshold == pytest.approx(expected_threshold, abs=1e-5)


def test_max_entropy_gate_in_bits_is_the_same_gate(example):
    student, teacher, labels = example
    nats = distillation_loss(student, teacher, labels, KDConfig(tau=0.9, tau_scale="max_entropy"))
    bits = distillation_loss(student, teacher, labels, KDConfig(tau=0.9, tau_scale="max_entropy", log_base="2"))
    assert nats.gate.tolist() == bits.gate.tolist()
    assert bits.threshold == pytest.approx(0.9 * math.log2(3), abs=1e-6)


def test_absolute_gate_reports_its_threshold_and_portable_tau_is_a_fraction(example):
    student, teacher, labels = example
    assert distillation_loss(student, teacher, labels, KDConfig(tau=0.8)).threshold == 0.8
    assert math.isnan(distillation_loss(student, teacher, labels, KDConfig(mode="kd")).threshold)
    with pytest.raises(ValueError, match="tau_scale"):
        KDConfig(tau=5.0, tau_scale="max_entropy")
    with pytest.raises(ValueError, match="tau_scale"):
        KDConfig(tau=0.5, tau_scale="entropy_rank")
