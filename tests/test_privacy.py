"""Example-level DP-SGD (pipeline/privacy/): the accountant against published numbers, per-example clipping
(hand-computed and on the real adapters), the noise's standard deviation, the noise-free unclipped control
against the non-private trainer, target_epsilon, the `privacy` params group, and a tiny federated run."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.common.config import ConfigError, from_dict
from pipeline.experiments.privacy import PrivacyConfig
from pipeline.privacy.accounting import ClientPrivacy, bound, client_privacy
from pipeline.privacy.example_dp import DPSGDSteps
from tests.errors import names
from tests.faults import killed_after_checkpoint
from tests.test_federated import CLIENT_SETTINGS, MODEL, TRAIN, workspace, ws  # noqa: F401  (fixtures)


def _setting(sigma: float = 0.0, c: float = 1.0, logical_batch: int = 2) -> ClientPrivacy:
    return ClientPrivacy(
        noise_multiplier=sigma,
        max_grad_norm=c,
        sample_rate=0.5,
        logical_batch=logical_batch,
        steps_per_epoch=1,
        delta=1e-5,
        accountant="rdp",
    )


# ------------------------------------------------------------------------------------------ accountant
# TensorFlow Privacy's README ("Select Parameters", MNIST tutorial): N=60000, batch 256, delta 1e-5, Poisson
# sampling, RDP orders 1.1..10.9 and 12..63, the classical conversion eps = min_a rdp(a) + log(1/delta)/(a-1).
PUBLISHED = [(1.1, 60, 3.01), (1.3, 15, 1.19), (0.7, 45, 7.10)]


@pytest.mark.parametrize("sigma,epochs,published", PUBLISHED)
def test_rdp_accountant_reproduces_tf_privacy_published_epsilons(sigma, epochs, published):
    from opacus.accountants.analysis.rdp import compute_rdp

    q, steps, delta = 256 / 60000, math.ceil(epochs * 60000 / 256), 1e-5
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
    classical = min(r + math.log(1 / delta) / (a - 1) for r, a in zip(rdp, orders))
    assert round(classical, 2) == published
    # What a client reports: the same RDP curve with opacus' tighter conversion (Balle et al. 2020), so a valid
    # bound at or below the published one, not far below it.
    reported = bound(sigma, q, steps, delta, "rdp")[0]
    assert 0.75 * published < reported <= published


def test_prv_accountant_agrees_with_rdp_within_its_slack():
    q, steps, delta = 256 / 60000, math.ceil(60 * 60000 / 256), 1e-5
    prv, rdp = bound(1.1, q, steps, delta, "prv")[0], bound(1.1, q, steps, delta, "rdp")[0]
    assert 0.7 * rdp < prv <= rdp  # PRV is the tighter accountant (Gopi et al. 2021)


def test_prv_without_a_finite_bound_reports_rdps_and_names_it(ws, caplog):
    """opacus' PRV accountant overflows at extreme settings (z 0.05, q 0.5, 5 steps here; z 0.1, q 0.5, 50 steps and
    z 0.5, q 0.5, 1000 steps too, slower): inf, which the records wrote as epsilon null, "no bound", though the
    mechanism is noisy and RDP bounds it. The run reports RDP's bound there (opacus' RDPAccountant called directly:
    never below a valid accountant's), names the accountant that gave it and says so in one log line. By hand: two
    clients at train.fraction_train 0.5, q = 1/2, 5 rounds at z = 0.05 (client-level DP); a client's 5 DP-SGD steps
    at z = 0.05, q = 1/2 (example-level), whose epsilon the records' epsilon_max is."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    from pipeline.federation.protocol import load_plan
    from pipeline.privacy.seam import client_level_summary, run_record
    from tests.test_client_dp import _with_privacy
    from tests.test_federated import write_plan

    (prv := PRVAccountant()).history = [(0.05, 0.5, 5)]
    (rdp := RDPAccountant()).history = [(0.05, 0.5, 5)]
    assert prv.get_epsilon(delta=1e-5) == math.inf  # the library's own
    expected = rdp.get_epsilon(delta=1e-5)
    assert 100 < expected < math.inf
    with caplog.at_level("WARNING"):
        assert bound(0.05, 0.5, 5, 1e-5, "prv")[0] == pytest.approx(expected, rel=1e-12)
    assert any("PRV" in r.message and "RDP" in r.message and "1e-05" in r.message for r in caplog.records)
    path = _with_privacy(
        write_plan("prv-overflow", "fedavg", rounds=5, fraction_train=0.5),
        {"mode": "client", "noise_multiplier": 0.05, "clipping_norm": 1.0, "accountant": "prv"},
    )
    history = [{"round": r, "client": c, "sampled": 0, "failed": 0} for r in range(1, 6) for c in ("A", "B")]
    out = client_level_summary(load_plan(path), history, {"A": {}, "B": {}})
    assert out["sample_rate"] == 0.5 and out["rounds_accounted"] == 5 and out["delta"] == 1e-5
    assert out["epsilon"] == pytest.approx(expected, rel=1e-12) and out["accountant"] == "rdp"
    # example-level DP: A's epsilon (the accountant's after its 5 steps, as its replies carry it) is epsilon_max
    path = _with_privacy(
        write_plan("prv-overflow-ex", "fedavg"), {"mode": "example", "noise_multiplier": 0.05, "accountant": "prv"}
    )
    dp = {"delta": 1e-5, "noise_multiplier": 0.05, "max_grad_norm": 1.0, "sample_rate": 0.5, "dp_examples": 1}
    rows = [{"round": 1, "client": "A", "dp_steps": 5, "epsilon": expected, "dp_clipped": 0} | dp]
    record = run_record(load_plan(path), rows, {"A": {}})["privacy"]
    assert (record["epsilon_max"], record["accountant"], record["delta_max"]) == (expected, "rdp", 1e-5)


@pytest.mark.parametrize("z, q, steps, delta", [(1e-6, 0.5, 100, 1e-5), (1.0, 0.01, 10, 1e-30)])
def test_prv_raising_at_extreme_settings_reports_rdps_bound_and_names_it(caplog, z, q, steps, delta):
    """opacus' PRV raises where it cannot bound epsilon at all: MemoryError at a tiny noise multiplier (its grid
    would take EiB), ValueError "Floating point errors will dominate" at a tiny delta (both valid settings). That
    ended a client's train reply after its round's training (every round of the run), or the server's round under
    client-level DP, naming neither the accountant nor the setting. The run reports RDP's bound there, as where PRV
    gives inf (opacus' RDPAccountant called directly), named and logged."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    (prv := PRVAccountant()).history = [(z, q, steps)]
    with pytest.raises((MemoryError, ValueError)):  # the library's own
        prv.get_epsilon(delta=delta)
    (rdp := RDPAccountant()).history = [(z, q, steps)]
    with caplog.at_level("WARNING"):
        assert bound(z, q, steps, delta, "prv") == (pytest.approx(rdp.get_epsilon(delta=delta), rel=1e-12), "rdp")
    assert any("PRV" in r.message and "RDP" in r.message and f"{delta:g}" in r.message for r in caplog.records)


DISCRETE_MEAN = RuntimeError("Discrete mean differs significantly from continuous mean.")  # opacus' PRV, q 1


def test_prv_discretisation_error_reports_rdps_bound(monkeypatch, caplog):
    """opacus' PRV raises RuntimeError "Discrete mean differs significantly" at q = 1 with a huge target epsilon
    (a genuine case runs for minutes, so PRV is made to raise it): bound() caught MemoryError and ValueError only, so
    it ended the run in a traceback. RDP's bound (opacus' RDPAccountant called directly) is reported, named."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    bound.cache_clear()
    monkeypatch.setattr(PRVAccountant, "get_epsilon", lambda self, **kw: (_ for _ in ()).throw(DISCRETE_MEAN))
    (rdp := RDPAccountant()).history = [(0.9, 1.0, 7)]
    with caplog.at_level("WARNING"):
        assert bound(0.9, 1.0, 7, 1e-5, "prv") == (pytest.approx(rdp.get_epsilon(delta=1e-5), rel=1e-12), "rdp")
    assert any("PRV" in r.message and "RDP" in r.message for r in caplog.records)


def test_prv_budget_too_low_stays_a_config_error_not_rdps_search(monkeypatch):
    """Under PRV, opacus' "The privacy budget is too low." is the user's target, not PRV's numerics: it stays the
    one-line ConfigError naming the target, and RDP's search is not run in its place (PRV's epsilon is made huge at
    every z here; a genuine case takes over 100 s)."""
    from opacus.accountants import PRVAccountant

    from pipeline.privacy.accounting import noise_for_target

    noise_for_target.cache_clear()
    monkeypatch.setattr(PRVAccountant, "get_epsilon", lambda self, **kw: 1e9)
    cfg = PrivacyConfig(mode="example", target_epsilon=2.5, delta=1e-5, accountant="prv")
    with pytest.raises(ConfigError, match=r"target_epsilon 2.5 cannot be met .*budget is too low"):
        client_privacy(in_plan(cfg), n_examples=16)


@pytest.mark.parametrize("delta, fault", [(1e-30, None), (1e-5, MemoryError("std::bad_alloc")), (1e-5, DISCRETE_MEAN)])
def test_prv_target_search_that_raises_uses_rdps_search_and_names_it(monkeypatch, caplog, delta, fault):
    """opacus' PRV noise search raises where bound() falls back to RDP: ValueError "Floating point errors will
    dominate" at a tiny delta (reported as a target epsilon that "cannot be met"), MemoryError at a tiny z (a
    traceback; a genuine one, target 1e3 at q 0.01, takes ~40 s and GBs, so opacus' PRV is made to raise it here).
    The search is then RDP's (opacus' own, called directly), named and logged once."""
    from opacus.accountants import PRVAccountant
    from opacus.accountants.utils import get_noise_multiplier

    from pipeline.privacy.accounting import noise_for_target

    noise_for_target.cache_clear()
    if fault is not None:
        monkeypatch.setattr(PRVAccountant, "get_epsilon", lambda self, **kw: (_ for _ in ()).throw(fault))
    # q = 8/64 and 3 x 8 steps: opacus' RDP search takes ~1 s here, ~6 s at q = 1/2
    search = {
        "target_epsilon": 2.5,
        "target_delta": delta,
        "sample_rate": 0.125,
        "steps": 24,
        "epsilon_tolerance": 0.01,
    }
    expected = get_noise_multiplier(**search, accountant="rdp")
    cfg = PrivacyConfig(mode="example", target_epsilon=2.5, delta=delta, accountant="prv")
    with caplog.at_level("WARNING"):
        assert client_privacy(in_plan(cfg), n_examples=64).noise_multiplier == expected
    assert (
        len([r for r in caplog.records if "PRV" in r.message and "RDP" in r.message and f"{delta:g}" in r.message]) == 1
    )


def test_a_client_without_examples_or_an_unmeetable_target_is_one_line_naming_it_and_its_steps():
    with pytest.raises(ConfigError, match=r"^client x: no training example$"):
        client_privacy(in_plan(PrivacyConfig(mode="example", noise_multiplier=1.0)), 0, "client x")
    cfg = PrivacyConfig(mode="example", target_epsilon=1e-3, accountant="rdp")
    with pytest.raises(ConfigError) as err:  # 3 rounds x 2 epochs x 64 / 8 steps
        client_privacy(in_plan(cfg, local_epochs=2), 64, "client x")
    assert str(err.value).startswith(
        "client x: privacy.target_epsilon 0.001 cannot be met with q=0.125 over 48 steps ("
    )


def test_epsilon_grows_with_steps_and_is_unbounded_without_noise():
    assert bound(1.0, 0.5, 0, 1e-3)[0] == 0.0
    assert bound(1.0, 0.5, 3, 1e-3)[0] < bound(1.0, 0.5, 6, 1e-3)[0]
    assert bound(0.0, 0.5, 3, 1e-3)[0] == math.inf


def test_target_epsilon_gives_a_noise_multiplier_within_the_target():
    accountant = "rdp"  # (the PRV search takes ~10 s here; PRV itself is checked above)
    cfg = PrivacyConfig(mode="example", target_epsilon=3.0, accountant=accountant)
    s = client_privacy(in_plan(cfg, local_epochs=2), n_examples=64)  # q = 8/64 (the search: ~6 s at q = 1/2, ~1 s here)
    assert (s.sample_rate, s.steps_per_epoch, s.delta) == (0.125, 8, 1e-5)
    planned = 3 * 2 * s.steps_per_epoch  # rounds x local epochs x steps per epoch
    eps = bound(s.noise_multiplier, 0.125, planned, 1e-5, accountant)[0]
    assert 2.98 <= eps <= 3.0  # opacus' search stops within 0.01 below the target
    assert bound(s.noise_multiplier, 0.125, planned - 16, 1e-5, accountant)[0] < eps  # a round fewer stays below it
    assert bound(0.9 * s.noise_multiplier, 0.125, planned, 1e-5, accountant)[0] > 3.0  # and the search is not loose


# ------------------------------------------------------------------------------------------ the step
class _Lin(torch.nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.lin = torch.nn.Linear(d_in, d_out, bias=False)
        torch.nn.init.zeros_(self.lin.weight)

    def forward(self, x):
        return self.lin(x)


def test_clipping_bounds_each_example_hand_computed():
    # loss = sum_i w . x_i: the gradient of example i is x_i; ||x_1|| = 5 (clipped to C = 1), ||x_2|| = 0.5 (kept)
    m = _Lin(2, 1)
    step = DPSGDSteps(m, _setting(sigma=0.0, c=1.0, logical_batch=2), 0, None, None)
    try:
        x = torch.tensor([[[3.0, 4.0]], [[0.3, 0.4]]])  # [B=2, T=1, H=2], the adapters' layout
        m(x).sum().backward()
        norms = step.accumulate()
        step.finish()
        np.testing.assert_allclose(norms.numpy(), [5.0, 0.5], rtol=1e-6)
        # (3, 4) / (5 + 1e-6) + (0.3, 0.4), over the expected batch size 2
        expected = (torch.tensor([3.0, 4.0]) / (5.0 + 1e-6) + torch.tensor([0.3, 0.4])) / 2
        torch.testing.assert_close(m.lin.weight.grad[0], expected, rtol=1e-6, atol=1e-7)
        assert (step.clipped, step.examples) == (1, 2)
    finally:
        step.close()
    assert not hasattr(m.lin.weight, "grad_sample")


def test_micro_batches_of_a_step_are_clipped_per_example_and_summed():
    # the same two examples as two micro-batches of one step: same result as one batch of two
    m = _Lin(2, 1)
    step = DPSGDSteps(m, _setting(sigma=0.0, c=1.0, logical_batch=2), 0, None, None)
    try:
        for x in (torch.tensor([[[3.0, 4.0]]]), torch.tensor([[[0.3, 0.4]]])):
            m(x).sum().backward()
            step.accumulate()
        step.finish()
        expected = (torch.tensor([3.0, 4.0]) / (5.0 + 1e-6) + torch.tensor([0.3, 0.4])) / 2
        torch.testing.assert_close(m.lin.weight.grad[0], expected, rtol=1e-6, atol=1e-7)
    finally:
        step.close()


def test_noise_has_the_configured_standard_deviation():
    from scipy import stats

    sigma, c, batch = 1.5, 2.0, 4
    m = _Lin(100, 200)  # 20,000 coordinates
    step = DPSGDSteps(m, _setting(sigma=sigma, c=c, logical_batch=batch), 123, None, None)
    try:
        step.finish()  # an empty Poisson batch: the update is the noise alone
        a = m.lin.weight.grad.flatten().double().numpy().copy()
        step.finish()
        b = m.lin.weight.grad.flatten().double().numpy()
    finally:
        step.close()
    expected_std = sigma * c / batch  # 0.75
    n = a.size
    assert abs(a.std() - expected_std) < 5 * expected_std / math.sqrt(2 * n)  # 5 standard errors of the std
    assert abs(a.mean()) < 5 * expected_std / math.sqrt(n)
    assert stats.kstest(a / expected_std, "norm").pvalue > 1e-3
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(n)  # a fresh draw every step


# ------------------------------------------------------------------------------------------ params group
def test_privacy_group_validation():
    ok = from_dict(PrivacyConfig, {"mode": "example", "target_epsilon": 3}, "privacy")
    assert ok.enabled and ok.delta is None
    assert not from_dict(PrivacyConfig, {}, "privacy").enabled
    bad = [
        ({"mode": "central"}, "privacy.mode='central' is out of range; allowed: one of 'none', 'example' or 'client'"),
        ({"mode": "example"}, "exactly one of noise_multiplier and target_epsilon"),
        ({"mode": "example", "noise_multiplier": 1.0, "target_epsilon": 3}, "exactly one"),
        ({"mode": "none", "target_epsilon": 3}, "mode is 'none'"),
        ({"mode": "example", "noise_multiplier": 1.0, "max_grad_norm": math.inf}, "needs noise_multiplier 0"),
        ({"mode": "example", "noise_multiplier": -1.0}, "privacy.noise_multiplier=-1.0 is out of range; allowed: >= 0"),
        (
            {"mode": "example", "noise_multiplier": 1.0, "delta": 1.5},
            "privacy.delta=1.5 is out of range; allowed: > 0 and < 1",
        ),
        (
            {"mode": "example", "noise_multiplier": 1.0, "accountant": "gdp"},
            "privacy.accountant='gdp' is out of range; allowed: one of 'rdp' or 'prv'",
        ),
        ({"mode": "example", "noise_multiplier": 1.0, "secure_aggregaton": True}, "unknown key"),
    ]
    for raw, message in bad:
        with pytest.raises(ConfigError, match="^privacy") as exc:
            from_dict(PrivacyConfig, raw, "privacy")
        assert message in str(exc.value), (raw, str(exc.value))


def in_plan(cfg: PrivacyConfig, local_epochs: int = 1):
    """A plan of ``cfg`` whose clients take logical batches of 8 examples in 3 rounds of ``local_epochs`` epochs."""
    from types import SimpleNamespace

    from pipeline.experiments.train_config import TrainConfig

    train = TrainConfig(batch_size=8, grad_accum_steps=1, rounds=3, local_epochs=local_epochs)
    return SimpleNamespace(privacy=cfg, train=train)


def test_delta_defaults_to_at_most_1e_5_and_a_tenth_of_one_over_n_and_refuses_one_over_n():
    cfg = PrivacyConfig(mode="example", noise_multiplier=1.0)
    assert client_privacy(in_plan(cfg), 40).delta == 1e-5
    assert client_privacy(in_plan(cfg), 1).delta == 1e-5
    assert client_privacy(in_plan(cfg), 200_000).delta == pytest.approx(1 / 2_000_000)  # 1/(10 n) < 1e-5
    assert client_privacy(in_plan(PrivacyConfig(mode="example", noise_multiplier=1.0, delta=1e-6)), 40).delta == 1e-6
    for n, delta in ((40, 1 / 40), (40, 0.5), (4, 0.3)):  # 1/n itself and above: refused, naming key and client
        with pytest.raises(ValueError) as err:
            client_privacy(in_plan(PrivacyConfig(mode="example", noise_multiplier=1.0, delta=delta)), n, "client x")
        assert str(err.value).startswith("client x: privacy.delta ")
    assert client_privacy(in_plan(PrivacyConfig(mode="example", noise_multiplier=1.0, delta=0.024)), 40).delta == 0.024


def _params(privacy: dict | None, **train) -> dict:
    return {"tau": 5.0, "model": dict(MODEL), "train": {**TRAIN, **train}, **({"privacy": privacy} if privacy else {})}


def test_privacy_enters_federated_plans_only_and_only_when_on():
    from pipeline.planning import parse_entry, resolve_plan

    on = {"mode": "example", "target_epsilon": 3.0}
    off = {"mode": "none", "max_grad_norm": 2.0}
    for method in ("fedavg", "fedselectkd", "fedprox", "single", "centralized"):
        entry = parse_entry("x", {"method": method, "partition": "domain/seed0"}, _params(None))
        plain = resolve_plan(entry, _params(None))
        assert resolve_plan(entry, _params(off)) == plain  # mode none: the plan (and its hash) is unchanged
        private = resolve_plan(entry, _params(on))
        if method in ("single", "centralized"):
            assert private == plain
        else:
            assert private["privacy"] == {
                "mode": "example",
                "noise_multiplier": None,
                "target_epsilon": 3.0,
                "max_grad_norm": 1.0,
                "delta": None,
                "accountant": "rdp",
            }
    with pytest.raises(ConfigError, match="batch_quantile"):
        params = _params(on, tau_scale="batch_quantile")
        resolve_plan(
            parse_entry("x", {"method": "fedselectkd", "partition": "domain/seed0", "tau": 0.5}, params), params
        )


def test_params_yaml_privacy_group_is_declared_by_the_plan_stage_only():
    import yaml

    repo = Path(__file__).resolve().parents[1]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    cfg = from_dict(PrivacyConfig, params["privacy"], "params.yaml privacy")
    assert cfg.mode == "none"
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    readers = sorted(
        name for name, st in stages.items() if "privacy" in (st.get("params") or st.get("do", {}).get("params") or [])
    )
    assert readers == ["plan"]  # the train stages read their plan file, which carries the group


# ------------------------------------------------------------------------------------------ on the model
def _write_plan(name: str, method: str, privacy: dict | None, model: dict | None = None, **train) -> str:
    from pipeline.planning import parse_entry, resolve_plan

    params = _params(privacy, **train)
    params["model"].update(model or {})
    entry = parse_entry(
        name, {"method": method, "partition": "domain/seed0", "seed": 0, "study": "tests-privacy"}, params
    )
    path = Path("models/plans") / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(resolve_plan(entry, params), indent=2, sort_keys=True))
    return str(path)


def _spy_grads(monkeypatch) -> list[list[torch.Tensor]]:
    """Record the gradients each AdamW step of the local trainer receives."""
    from pipeline.training import client_training as local_training

    seen: list[list[torch.Tensor]] = []

    class Spy(torch.optim.AdamW):
        def step(self, closure=None):
            seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
            return super().step(closure)

    monkeypatch.setattr(local_training.torch.optim, "AdamW", Spy)
    return seen


def _train_once(plan_path: str, client: str = "Committee"):
    from pipeline.experiments.plans import read_plan
    from pipeline.training.client_data import client_data
    from pipeline.training.client_training import train_local
    from pipeline.training.shared_model import initial_adapter_state, shared_model

    plan = read_plan(plan_path)
    model = shared_model(plan)
    initial = initial_adapter_state(plan)
    model.load_adapter_state("local", initial)
    model.load_adapter_state("global", initial)
    data = client_data(plan, client)
    mu = plan.train.strategy_params["proximal_mu"] if plan.spec.proximal else 0.0
    result = train_local(
        model, plan, data.train, client=client, rnd=1, proximal_reference=initial if mu else None, proximal_mu=mu
    )
    return result, model.adapter_state("local")


@pytest.mark.parametrize(
    "method,normalisation,max_target,epochs",
    [("fedselectkd", "sequences", 12, 1), ("fedselectkd", "tokens", 4, 1), ("fedprox", "sequences", 12, 2)],
)
def test_no_noise_and_no_clipping_is_the_non_private_step(ws, monkeypatch, method, normalisation, max_target, epochs):
    # q = 1 (batch >= the client's 6 examples): the Poisson batch is every example, as the one non-private batch.
    # With tokens the per-example loss divides by max_target_length: equal when every target fills it (4 tokens).
    # fedprox over 2 epochs: the second step's proximal gradient (large mu) enters after the noise, as in the loss.
    seen = _spy_grads(monkeypatch)
    common = dict(
        batch_size=8, loss_normalisation=normalisation, prefix_cache=False, local_epochs=epochs, proximal_mu=20.0
    )
    plain = _write_plan("dp-off", method, None, {"max_target_length": max_target}, **common)
    control = _write_plan(
        "dp-control",
        method,
        {"mode": "example", "noise_multiplier": 0.0, "max_grad_norm": math.inf},
        {"max_target_length": max_target},
        **common,
    )
    res_plain, state_plain = _train_once(plain)
    res_dp, state_dp = _train_once(control)
    assert len(seen) == 2 * epochs and res_plain.n_steps == res_dp.n_steps == epochs
    seen = [seen[:epochs], seen[epochs:]]
    if method == "fedprox":  # the proximal term did act in the second step
        assert res_dp.proximal > 0 and res_dp.proximal == pytest.approx(res_plain.proximal, rel=1e-4)
    assert res_dp.privacy.sample_rate == 1.0 and res_dp.dp_examples == 6 * epochs and res_dp.dp_clipped == 0
    for step_plain, step_dp in zip(*seen):
        for g_plain, g_dp in zip(step_plain, step_dp):
            # float32 sums in another order (one batch vs per-example sums): agree to rounding; the plain step's
            # adapters are a stack of one run (pipeline.training.local_batch): its leading run dimension goes
            torch.testing.assert_close(g_dp, g_plain.squeeze(0), rtol=1e-4, atol=1e-7)
    for k in state_plain:
        torch.testing.assert_close(state_dp[k], state_plain[k], rtol=1e-4, atol=1e-6)
    assert res_dp.train_loss == pytest.approx(res_plain.train_loss, rel=1e-6)


def test_each_examples_clipped_gradient_on_the_adapters_is_its_own_and_within_c(ws, monkeypatch):
    # Per-example gradients from opacus' hooks on the real adapter set equal each example trained alone (no
    # coupling through the batch: padding, packing, the KD gate), and after clipping none exceeds C.
    from pipeline.experiments.plans import read_plan
    from pipeline.modeling.batching import make_batches
    from pipeline.modeling.losses import distillation_loss
    from pipeline.training.client_data import client_data
    from pipeline.training.client_training import kd_config, per_example_loss_scale
    from pipeline.training.shared_model import initial_adapter_state, shared_model

    plan = read_plan(
        _write_plan("dp-pe", "fedselectkd", {"mode": "example", "noise_multiplier": 0.0}, prefix_cache=False)
    )
    model = shared_model(plan)
    initial = initial_adapter_state(plan)
    up = {k: (torch.randn_like(v) * 0.05 if ".up." in k else v) for k, v in initial.items()}  # nonzero W_up
    model.load_adapter_state("local", up)
    model.load_adapter_state("global", initial)
    data = client_data(plan, "Committee").train.iloc[:2]
    mcfg, kd = plan.model_config, kd_config(plan)

    def batch_of(df):
        return make_batches(df, model, mcfg, 2, False, 0)[0]

    params = model.local_parameters()
    for p in params:
        p.requires_grad_(True)
    model.train(True)  # opacus captures activations in training mode only (train_local trains in it)
    alone = []
    for i in range(2):
        b = batch_of(data.iloc[i : i + 1])
        ll, lg = model.forward_two_paths(b, packed=True)
        out = distillation_loss(ll, lg, b.labels, kd)
        grads = torch.autograd.grad(out.loss * per_example_loss_scale(b, "tokens", 12), params)
        alone.append(torch.cat([g.flatten() for g in grads]))
    c = 0.5 * float(min(a.norm() for a in alone))  # both examples get clipped
    step = DPSGDSteps(model.adapter_sets["local"], _setting(sigma=0.0, c=c, logical_batch=1), 0, None, None)
    try:
        b = batch_of(data)
        ll, lg = model.forward_two_paths(b, packed=True)
        out = distillation_loss(ll, lg, b.labels, kd)
        (out.loss * per_example_loss_scale(b, "tokens", 12)).backward()
        per_example = [torch.cat([p.grad_sample[i].flatten() for p in params]) for i in range(2)]
        for got, want in zip(per_example, alone):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
        norms = step.accumulate()
        step.finish()  # logical batch 1: p.grad is the sum of the clipped gradients
    finally:
        step.close()
        model.train(False)
        for p in params:
            p.requires_grad_(False)
    total = torch.cat([p.grad.flatten() for p in params])
    clipped = [a * min(1.0, c / (float(a.norm()) + 1e-6)) for a in alone]
    torch.testing.assert_close(total, clipped[0] + clipped[1], rtol=1e-4, atol=1e-7)
    assert all(float(x.norm()) <= c * (1 + 1e-5) for x in clipped) and step.clipped == 2
    np.testing.assert_allclose(norms.numpy(), [float(a.norm()) for a in alone], rtol=1e-4)


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_federated_run_with_target_epsilon_reports_it_per_client(ws):
    import mlflow

    from pipeline.train import run_experiment

    name = "dp-fedselectkd"
    # C = 1e-4: every per-example gradient of the tiny model is above it (at C = 1 none was: a fraction of 0)
    privacy = {"mode": "example", "target_epsilon": 3.0, "max_grad_norm": 1e-4}
    metrics = run_experiment(_write_plan(name, "fedselectkd", privacy))
    n_train = {"Academic": 4, "Committee": 6, "Product": 5}
    assert sorted(metrics["clients"]) == sorted(n_train)
    for client, c in metrics["clients"].items():
        p = c["privacy"]
        assert 2.9 < p["epsilon"] <= 3.0  # every round trained: the planned steps, so close to the target
        assert p["delta"] == 1e-5  # min(1e-5, 1 / (10 n))
        assert p["steps"] == TRAIN["rounds"] * math.ceil(n_train[client] / TRAIN["batch_size"])
        assert p["max_grad_norm"] == 1e-4 and p["noise_multiplier"] > 0
    assert metrics["privacy"]["epsilon_max"] <= 3.0
    assert json.loads(Path(f"reports/train/{name}/metrics.json").read_text())["privacy"]["mode"] == "example"
    history = json.loads(Path(f"models/{name}/rounds.json").read_text())
    for client in n_train:  # the run's clipped fraction: per-example gradients clipped over those seen, both rounds
        rows = [r for r in history if r["client"] == client and "dp_examples" in r]
        seen, clipped = sum(r["dp_examples"] for r in rows), sum(r["dp_clipped"] for r in rows)
        assert (
            len(rows) == 2 and seen > 0 and metrics["clients"][client]["privacy"]["clipped_fraction"] == clipped / seen
        )
    eps_by_round = {(r["client"], r["round"]): r["epsilon"] for r in history}
    for client in n_train:  # the accountant composes across rounds
        assert eps_by_round[(client, 1)] < eps_by_round[(client, 2)] == metrics["clients"][client]["privacy"]["epsilon"]

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    run = mlflow.search_runs(experiment_names=["tests-privacy"], filter_string=f"tags.experiment = '{name}'").iloc[0]
    children = mlflow.search_runs(
        experiment_names=["tests-privacy"],  # each client's run under the experiment's
        filter_string=f"tags.`mlflow.parentRunId` = '{run.run_id}'",
    ).set_index("tags.client")
    for client in n_train:
        assert children.loc[client, "metrics.run/epsilon"] <= 3.0
        for key in ("delta", "noise_multiplier", "max_grad_norm", "clipped_fraction"):
            assert not np.isnan(children.loc[client, f"metrics.run/{key}"])
    assert run["params.privacy.target_epsilon"] == "3.0"


@pytest.mark.slow
def test_a_resumed_client_keeps_composing_its_steps(ws, monkeypatch):
    # The in-process engine's contexts die with the killed run: the step count must come back from the client's
    # checkpoint, or round 2 would report the epsilon of one round.
    from pipeline.train import run_experiment

    path = _write_plan("dp-resume", "fedavg", {"mode": "example", "noise_multiplier": 1.0})
    with killed_after_checkpoint(monkeypatch, rnd=1):
        run_experiment(path, track=False)
    metrics = run_experiment(path, track=False)
    for client, n in {"Academic": 4, "Committee": 6, "Product": 5}.items():
        per_round = math.ceil(n / TRAIN["batch_size"])
        p = metrics["clients"][client]["privacy"]
        assert p["steps"] == 2 * per_round
        assert p["epsilon"] == pytest.approx(bound(1.0, min(1.0, TRAIN["batch_size"] / n), 2 * per_round, 1e-5)[0])


def test_private_reply_adds_only_the_privacy_counts_and_composes_rounds(ws):
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from pipeline.experiments.plans import read_plan
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.protocol import TRAIN_METRICS
    from pipeline.training.shared_model import initial_adapter_state

    # under privacy.mode example: the accountant's (epsilon, delta) so far (-1 = unbounded), sigma, C, q, the
    # cumulative steps, and this round's per-example gradients and how many of them were clipped
    privacy_keys = (
        "dp-epsilon",
        "dp-delta",
        "dp-noise-multiplier",
        "dp-max-grad-norm",
        "dp-sample-rate",
        "dp-steps",
        "dp-examples",
        "dp-clipped",
    )
    # C = 1e-4: every per-example gradient of the tiny model is above it, so each one seen is counted clipped
    path = _write_plan("dp-reply", "fedselectkd", {"mode": "example", "noise_multiplier": 1.0, "max_grad_norm": 1e-4})
    plan = read_plan(path)
    _set_server_identity(1)
    initial = initial_adapter_state(plan)
    context = Context(
        run_id=1, node_id=1000, node_config={"client-name": "Committee"}, state=RecordDict(), run_config={}
    )
    replies = []
    for rnd in (1, 2):
        msg = Message(
            RecordDict(
                {
                    "arrays": ArrayRecord.from_torch_state_dict(initial),
                    "config": ConfigRecord({"server-round": rnd, "plan": path, **CLIENT_SETTINGS}),
                }
            ),
            dst_node_id=1000,
            message_type="train",
        )
        msg.metadata.__dict__["_message_id"] = f"x{rnd}"
        replies.append(client_app(msg, context).content["metrics"])
    per_round = math.ceil(6 / TRAIN["batch_size"])  # Committee: 6 examples, q = 4/6
    for rnd, m in enumerate(replies, start=1):
        assert set(m.keys()) == set(TRAIN_METRICS) | set(privacy_keys)
        assert all(isinstance(v, (int, float)) for v in m.values())
        assert m["dp-steps"] == rnd * per_round and m["num-steps"] == per_round
        assert m["dp-epsilon"] == pytest.approx(bound(1.0, 4 / 6, rnd * per_round, 1e-5)[0])
        assert (m["dp-delta"], m["dp-noise-multiplier"], m["dp-max-grad-norm"]) == (pytest.approx(1e-5), 1.0, 1e-4)
        assert 0 < m["dp-clipped"] == m["dp-examples"]
    assert replies[0]["dp-epsilon"] < replies[1]["dp-epsilon"]


def test_a_client_that_dies_after_its_reply_composes_that_round_and_a_redone_round_again(ws):
    """A SuperNode may die after its train reply reached the aggregate and before its round's checkpoint (written
    at evaluate); restarted (a fresh context), it must still count that round's steps: the update was released. A
    round the whole run redoes after a kill is another release, drawn afresh (the test after this one): it counts
    again."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from pipeline.experiments.plans import read_plan
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import _set_server_identity
    from pipeline.training.shared_model import initial_adapter_state

    path = _write_plan("dp-restart", "fedselectkd", {"mode": "example", "noise_multiplier": 1.0})
    initial = ArrayRecord.from_torch_state_dict(initial_adapter_state(read_plan(path)))
    _set_server_identity(1)

    def train_in_a_fresh_context(rnd: int) -> int:  # no eval: the node dies right after its reply
        context = Context(
            run_id=1, node_id=1000, node_config={"client-name": "Committee"}, state=RecordDict(), run_config={}
        )
        config = ConfigRecord({"server-round": rnd, "plan": path, **CLIENT_SETTINGS})
        msg = Message(RecordDict({"arrays": initial, "config": config}), dst_node_id=1000, message_type="train")
        msg.metadata.__dict__["_message_id"] = f"x{rnd}"
        return client_app(msg, context).content["metrics"]["dp-steps"]

    per_round = math.ceil(6 / TRAIN["batch_size"])  # Committee: 6 examples
    assert train_in_a_fresh_context(1) == per_round
    assert train_in_a_fresh_context(2) == 2 * per_round  # round 1's released steps compose
    assert train_in_a_fresh_context(2) == 3 * per_round  # round 2 redone: released again


def test_a_round_redone_from_another_start_draws_fresh_noise_and_counts_again(ws, monkeypatch):
    """A client whose evaluate failed after its train reply has no checkpoint of that round: when the server is killed
    in the next round after the client's reply and redoes that round, the restarted client trains it from its older
    checkpoint, another start than the update it released. Drawn with the same samples and noise, the two releases
    of the round share their noise; each release must draw its own and be composed: 3 updates of 2 steps each."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from pipeline.experiments.plans import read_plan
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import _set_server_identity
    from pipeline.privacy import example_dp
    from pipeline.training.shared_model import initial_adapter_state

    path = _write_plan("dp-redo", "fedselectkd", {"mode": "example", "noise_multiplier": 1.0})
    initial = ArrayRecord.from_torch_state_dict(initial_adapter_state(read_plan(path)))
    _set_server_identity(1)
    seeds, real_init = [], example_dp.DPSGDSteps.__init__

    def init_spy(self, module, setting, seed, *args):
        seeds.append(seed)  # the DP-SGD samples' and noise's seeds are derived from it alone
        real_init(self, module, setting, seed, *args)

    def train(rnd: int, context):  # the global of round 0 each time (the server's is not the point here)
        config = ConfigRecord({"server-round": rnd, "plan": path, **CLIENT_SETTINGS})
        msg = Message(RecordDict({"arrays": initial, "config": config}), dst_node_id=1000, message_type="train")
        msg.metadata.__dict__["_message_id"] = f"r{rnd}-{len(seeds)}"
        reply = client_app(msg, context).content
        return reply["metrics"]["dp-steps"], np.concatenate([a.ravel() for a in reply["arrays"].to_numpy_ndarrays()])

    def context():
        config = {"client-name": "Committee"}
        return Context(run_id=1, node_id=1000, node_config=config, state=RecordDict(), run_config={})

    monkeypatch.setattr(example_dp.DPSGDSteps, "__init__", init_spy)
    first = context()
    train(1, first)  # its evaluate of round 1 fails: no round-1 checkpoint
    _, released = train(2, first)
    steps, redone = train(2, context())  # the server redoes round 2: a fresh context
    assert not np.array_equal(released, redone)  # two releases of round 2
    assert seeds[2] != seeds[1], "the redone round drew the samples and noise of the release it redid"
    assert steps == 3 * math.ceil(6 / TRAIN["batch_size"])  # Committee: 6 examples, batch 4; every release counts


def test_dp_sgd_draws_its_samples_and_noise_per_client_round_and_epoch_and_counts_its_clipped_examples(ws, monkeypatch):
    """Each (experiment seed, client, round) has its own Poisson samples - another in each local epoch - and its
    own noise stream; the same triple draws the same again. The logical batch is batch_size x grad_accum_steps,
    and with a tiny C every per-example gradient is clipped and counted."""
    from pipeline.federation.protocol import load_plan
    from pipeline.privacy import example_dp as privacy
    from pipeline.training.client_data import client_data
    from pipeline.training.client_training import train_local
    from pipeline.training.shared_model import initial_adapter_state, shared_model

    samples, noise_seeds = [], []
    real_steps, real_init = privacy.poisson_steps, privacy.DPSGDSteps.__init__

    def steps_spy(*args):
        out = real_steps(*args)
        samples[-1].append(out)
        return out

    def init_spy(self, module, setting, seed, *args):
        noise_seeds.append(seed)  # the noise generator's seed is derived from it alone
        real_init(self, module, setting, seed, *args)

    monkeypatch.setattr(privacy, "poisson_steps", steps_spy)
    monkeypatch.setattr(privacy.DPSGDSteps, "__init__", init_spy)
    plan = load_plan(
        _write_plan(
            "dp-streams",
            "fedavg",
            {"mode": "example", "noise_multiplier": 1.0, "max_grad_norm": 1e-6},
            batch_size=2,
            grad_accum_steps=2,
            local_epochs=2,
            prefix_cache=False,
        )
    )
    model, examples = shared_model(plan), client_data(plan, "Committee").train
    results = []
    for client, rnd in (("Committee", 1), ("Committee", 1), ("Product", 1), ("Committee", 2)):
        samples.append([])
        model.load_adapter_state("local", initial_adapter_state(plan))
        results.append(train_local(model, plan, examples, client=client, rnd=rnd))
    again, other_client, other_round = samples[1], samples[2], samples[3]
    assert samples[0] == again and noise_seeds[0] == noise_seeds[1]
    assert samples[0][0] != samples[0][1]  # epoch 2 draws anew
    assert samples[0] != other_client and samples[0] != other_round
    assert len({noise_seeds[0], noise_seeds[2], noise_seeds[3]}) == 3
    first = results[0]
    assert first.privacy.logical_batch == 4 and first.privacy.sample_rate == pytest.approx(4 / len(examples))
    assert first.dp_examples == sum(len(idx) for epoch in samples[0] for idx in epoch) > 0
    assert first.dp_clipped == first.dp_examples  # C = 1e-6: every per-example gradient is clipped


def test_a_delta_of_one_over_n_or_more_is_refused_naming_the_key_the_plan_and_the_client(ws):
    """delta >= 1/n promises nothing: the trainer refuses it for the client it does not fit, and says which plan
    and which client, as a federation's log must."""
    from pipeline.federation.protocol import load_plan
    from pipeline.training.client_data import client_data
    from pipeline.training.client_training import train_local
    from pipeline.training.shared_model import shared_model

    plan = load_plan(
        _write_plan(
            "dp-big-delta", "fedavg", {"mode": "example", "noise_multiplier": 1.0, "delta": 0.2}, prefix_cache=False
        )
    )
    six = client_data(plan, "Committee").train  # 6 examples: 0.2 >= 1/6
    assert len(six) == 6
    with pytest.raises(ValueError) as err:
        train_local(shared_model(plan), plan, six, client="Committee", rnd=1)
    names(err.value, str(plan.source), "'Committee'", "privacy.delta")
