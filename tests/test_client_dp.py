"""Client-level DP across organisations (privacy.mode client: pipeline/privacy/client_dp.py, the setting and
accountant in pipeline/privacy/): the accountant against a published DP-FedAvg case, clipping of every
client's update (hand-computed, server and client side, and on the real adapters), the noise's standard deviation,
the adaptive split, the noise-free unclipped control against the non-private run, refusals, plans, and tiny
federated runs with a target epsilon and with adaptive clipping (resumed)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from pipeline.common.config import ConfigError, from_dict
from pipeline.experiments.privacy import PrivacyConfig
from pipeline.privacy.accounting import FederationPrivacy, federation_privacy

if TYPE_CHECKING:
    from flwr.app import ArrayRecord

from tests.faults import killed_after_checkpoint
from tests.test_federated import CLIENT_SETTINGS, MODEL, TRAIN, workspace, write_plan, ws  # noqa: F401  (fixtures)


def _client_cfg(**kw) -> PrivacyConfig:
    return PrivacyConfig(**{"mode": "client", "noise_multiplier": 1.0, "clipping_norm": 1.0, **kw})


# ------------------------------------------------------------------------------------------ accountant
def _rdp_poisson_gaussian(q: float, sigma: float, alpha: int) -> float:
    """RDP of order alpha (integer) of the Poisson-subsampled Gaussian mechanism, from the binomial expansion of
    Mironov, Talwar and Zhang (2019, section 3.3): log(sum_k C(a,k) (1-q)^(a-k) q^k exp((k^2-k) / (2 s^2))) /
    (a-1), summed in log space. Written here from the formula, independently of opacus."""
    logs = [
        math.lgamma(alpha + 1)
        - math.lgamma(k + 1)
        - math.lgamma(alpha - k + 1)
        + (alpha - k) * math.log1p(-q)
        + k * math.log(q)
        + (k * k - k) / (2 * sigma**2)
        for k in range(alpha + 1)
    ]
    top = max(logs)
    return (top + math.log(sum(math.exp(x - top) for x in logs))) / (alpha - 1)


def _independent_epsilon(q: float, sigma: float, rounds: int, delta: float) -> float:
    # RDP -> (eps, delta) with the conversion of Canonne, Kamath and Steinke / Balle et al. (2020) that
    # TF Privacy's get_privacy_spent uses: eps = rdp + log((a-1)/a) - (log delta + log a) / (a-1)
    orders = list(range(2, 64)) + [128, 256, 512]
    return min(
        rounds * _rdp_poisson_gaussian(q, sigma, a) + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
        for a in orders
    )


# TensorFlow Federated's tutorial "Differential Privacy in TFF" (federated_learning_with_differential_privacy,
# the DP-FedAvg of McMahan et al. 2018 on federated EMNIST): 3383 clients, 100 rounds, delta 1e-5, noise multiplier
# scaled with the clients per round (0.5 x m / 50); its binary search prints "To get (2, 1e-05)-DP, use 120
# clients with noise multiplier 1.2." - 120 is the smallest m whose epsilon is below 2, so 119 is above it.
TFF_CLIENTS, TFF_ROUNDS, TFF_DELTA, TFF_EPS = 3383, 100, 1e-5, 2.0


def test_accountant_reproduces_the_tff_dp_fedavg_tutorial():
    def ours(m: int) -> float:
        cfg = _client_cfg(noise_multiplier=0.5 * m / 50, delta=TFF_DELTA)
        setting = federation_privacy(cfg, population=TFF_CLIENTS, sampled=m, rounds=TFF_ROUNDS)
        assert setting.sample_rate == m / TFF_CLIENTS
        return setting.bound_after(TFF_ROUNDS)[0]

    for m in (119, 120):  # the published boundary, computed from the formula
        independent = _independent_epsilon(m / TFF_CLIENTS, 0.5 * m / 50, TFF_ROUNDS, TFF_DELTA)
        assert (independent < TFF_EPS) == (m == 120)
        # opacus' RDP accountant (fractional orders too, so at most a little tighter)
        assert independent - 0.01 <= ours(m) <= independent + 1e-9
    assert ours(120) <= TFF_EPS < ours(119)
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs/privacy.md").read_text(encoding="utf-8").split())
    delta = f"{TFF_DELTA:.0e}".replace("e-0", "e-")
    assert (
        f"({TFF_CLIENTS} clients, {TFF_ROUNDS} rounds, delta {delta}: 120 clients per round at z = "
        f"{0.5 * 120 / 50:g} give epsilon < {TFF_EPS:g}, 119 at z = {0.5 * 119 / 50:g} do not)"
    ) in docs


def test_target_epsilon_gives_the_noise_for_the_planned_rounds():
    cfg = _client_cfg(noise_multiplier=None, target_epsilon=TFF_EPS, delta=TFF_DELTA)
    s = federation_privacy(cfg, population=TFF_CLIENTS, sampled=120, rounds=TFF_ROUNDS)
    assert TFF_EPS - 0.01 <= s.bound_after(TFF_ROUNDS)[0] <= TFF_EPS
    assert s.noise_multiplier <= 1.2  # the tutorial's 1.2 reaches the target, so the search needs no more
    assert s.bound_after(60)[0] < s.bound_after(TFF_ROUNDS)[0]  # fewer rounds: less spent


def test_the_servers_setting_is_searched_over_the_plans_rounds_and_names_its_plan():
    """server_setting: N = 10 clients at train.fraction_train 1 (q = 1: opacus' search is instant there); a target
    epsilon 10 over the plan's 3 rounds gives opacus' own search's z (called here directly, RDP, to 0.01); a refusal
    names the plan's file, or its experiment without one."""
    from opacus.accountants.utils import get_noise_multiplier

    from pipeline.experiments.train_config import TrainConfig
    from pipeline.privacy.accounting import server_setting

    def plan(privacy: PrivacyConfig, source: str | None = "models/plans/x.json"):
        return SimpleNamespace(
            privacy=privacy, train=TrainConfig(rounds=3, fraction_train=1.0), source=source, experiment="x"
        )

    s = server_setting(plan(_client_cfg(noise_multiplier=None, target_epsilon=10.0)), 10)
    assert (s.sampled, s.sample_rate, s.delta) == (10, 1.0, 1e-5)
    expected = get_noise_multiplier(
        target_epsilon=10.0, target_delta=1e-5, sample_rate=1.0, steps=3, accountant="rdp", epsilon_tolerance=0.01
    )
    assert s.noise_multiplier == expected and s.update_noise_multiplier == expected
    for source, named in (("models/plans/x.json", "models/plans/x.json"), (None, "x")):
        with pytest.raises(ConfigError) as exc:
            server_setting(plan(_client_cfg(delta=0.2), source), 10)
        assert str(exc.value).startswith(f"{named}: privacy.delta 0.2 >= 1/10 ")


def test_every_round_is_accounted_at_the_same_multiplier_whatever_it_aggregated():
    s = federation_privacy(_client_cfg(noise_multiplier=1.0, delta=1e-5), population=100, sampled=10, rounds=5)
    # Poisson sampling with the public denominator 10: the sum's sensitivity is C, its noise z C, in every round
    # (an empty round too), so epsilon depends on the rounds run and nothing else
    assert s.bound_after(2)[0] > s.bound_after(1)[0] > s.bound_after(0)[0] == 0.0
    assert (
        0.9 * _independent_epsilon(0.1, 1.0, 2, 1e-5) < s.bound_after(2)[0] <= _independent_epsilon(0.1, 1.0, 2, 1e-5)
    )
    assert FederationPrivacy(0.0, 0.0, None, 1.0, 100, 10, 1e-5, "rdp").bound_after(1)[0] == math.inf
    # the setting's accountant: PRV's epsilon (opacus' PRVAccountant called here; about 1 s), named PRV
    from opacus.accountants import PRVAccountant

    (prv := PRVAccountant()).history = [(1.0, 0.5, 3)]
    eps, named = FederationPrivacy(1.0, 1.0, None, 1.0, 4, 2, 1e-5, "prv").bound_after(3)
    assert (eps, named) == (pytest.approx(prv.get_epsilon(delta=1e-5), rel=1e-9), "prv")


def test_adaptive_split_gives_the_configured_multiplier_for_updates_and_count_together():
    z, sigma_b = 0.4, 1.0
    z_u = (0.4**-2 - 1.0) ** -0.5  # hand: (6.25 - 1)^-1/2 = 0.43644
    cfg = _client_cfg(noise_multiplier=z, clipping="adaptive", clipping_norm=None, clipped_count_stddev=sigma_b)
    s = federation_privacy(cfg, population=30, sampled=10, rounds=3)
    # the count of clipped updates is a sum of 0/1 bits: sensitivity 1, so the round's multiplier is
    # (z_u^-2 + sigma_b^-2)^-1/2 = z
    assert s.update_noise_multiplier == pytest.approx(z_u) and s.clipping_norm == 0.1
    assert s.bound_after(3)[0] == pytest.approx(
        federation_privacy(_client_cfg(noise_multiplier=z), population=30, sampled=10, rounds=3).bound_after(3)[0],
        rel=1e-9,
    )
    # sigma_b = 2 (1 hides a power's sign): z_u = (6.25 - 0.25)^-1/2 = 6^-1/2, and the pair is z = 0.4 again
    wide = federation_privacy(
        _client_cfg(noise_multiplier=z, clipping="adaptive", clipped_count_stddev=2.0),
        population=30,
        sampled=10,
        rounds=3,
    )
    assert wide.update_noise_multiplier == pytest.approx(6**-0.5, rel=1e-12)
    assert wide.bound_after(3)[0] == pytest.approx(s.bound_after(3)[0], rel=1e-9)
    with pytest.raises(ValueError, match="clipped_count_stddev > it"):  # default sigma_b = 10 / 20 = 0.5
        federation_privacy(_client_cfg(noise_multiplier=0.6, clipping="adaptive"), population=30, sampled=10, rounds=3)
    with pytest.raises(ConfigError, match="clipped_count_stddev > it"):  # z = sigma_b: the count alone would spend z
        federation_privacy(_client_cfg(noise_multiplier=0.5, clipping="adaptive"), population=30, sampled=10, rounds=3)
    free = federation_privacy(
        _client_cfg(noise_multiplier=0.0, clipping="adaptive"), population=30, sampled=10, rounds=3
    )
    assert (free.noise_multiplier, free.update_noise_multiplier, free.count_stddev) == (0.0, 0.0, 0.5)  # no noise


# ------------------------------------------------------------------------------------------ the strategy
def _global(values) -> ArrayRecord:
    from flwr.app import Array, ArrayRecord

    return ArrayRecord({"w": Array(np.asarray(values, dtype=np.float32))})


def _reply(values, num_examples: int, extra: dict | None = None):
    from flwr.app import Message, MetricRecord, RecordDict

    from pipeline.federation.engines import _set_server_identity

    _set_server_identity(1)
    ins = Message(RecordDict(), dst_node_id=7, message_type="train")
    ins.metadata.__dict__["_message_id"] = "m"
    content = RecordDict(
        {
            "arrays": _global(values),
            "metrics": MetricRecord({"num-examples": num_examples, "num-steps": 1, **(extra or {})}),
        }
    )
    return Message(content, reply_to=ins)


def _wrapped(n_nodes: int, global_arrays, seed: int = 0, **privacy):
    """FedAvg in the DP strategy of a plan of experiment seed ``seed``, after configure_train of round 1 over
    ``n_nodes`` nodes."""
    from flwr.app import ConfigRecord

    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import InProcessGrid, _set_server_identity
    from pipeline.federation.strategies.catalog import build_strategy
    from pipeline.privacy.client_dp import ClientLevelDP

    _set_server_identity(1)
    cfg = _client_cfg(**privacy)
    setting = federation_privacy(cfg, population=n_nodes, sampled=n_nodes, rounds=1)
    strategy = ClientLevelDP(
        build_strategy("fedavg", {}, fraction_train=1.0, client_lr=1e-3),
        SimpleNamespace(privacy=cfg, seed=seed),
        setting,
    )
    grid = InProcessGrid(client_app, [{"client-name": f"c{i}"} for i in range(n_nodes)])
    messages = list(strategy.configure_train(1, global_arrays, ConfigRecord(), grid))
    assert len(messages) == n_nodes
    return strategy, messages


def test_server_side_clipping_bounds_each_update_and_weighs_clients_equally():
    g = np.array([1.0, 1.0])
    strategy, _ = _wrapped(2, _global(g), noise_multiplier=0.0, clipping_norm=1.0)
    # update (3, 4) has norm 5: clipped to (0.6, 0.8); (0.3, 0.4) has norm 0.5 < C: kept. Unequal num-examples:
    # FedAvg would weigh them 1:3; the mean the noise calibrates weighs each 1/2.
    big, small = _reply(g + [3.0, 4.0], 1), _reply(g + [0.3, 0.4], 3)
    arrays, _ = strategy.aggregate_train(1, [big, small])
    np.testing.assert_allclose(arrays["w"].numpy(), g + ([0.6, 0.8] + np.array([0.3, 0.4])) / 2, rtol=1e-6)
    assert strategy.strategy.weighted_by_key == "num-examples"  # restored for the evaluate replies


@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_round_of_k_of_m_expected_replies_moves_w_by_their_sum_over_m(k):
    """DP-FedAvg divides the sum of the k clipped updates by the expected count m, not by k: W + sum / m (W itself
    where nobody replied), in the global's dtype. By hand: m = 4, updates (1, 2), (3, 4) and (5, 6), none clipped."""
    g = np.array([1.0, -1.0])
    strategy, _ = _wrapped(4, _global(g), noise_multiplier=0.0, clipping_norm=100.0)
    updates = [np.array([1.0, 2.0]), np.array([3.0, 4.0]), np.array([5.0, 6.0])][:k]
    arrays, _ = strategy.aggregate_train(1, [_reply(g + u, 1) for u in updates])
    released = arrays["w"].numpy()
    assert released.dtype == np.float32
    np.testing.assert_allclose(released, g + sum(updates, np.zeros(2)) / 4, rtol=1e-6)


def test_the_strategy_logs_its_setting_with_its_delta(caplog):
    with caplog.at_level("INFO", logger="fedmeet.federated"):
        _wrapped(4, _global(np.zeros(2)), noise_multiplier=0.7, clipping_norm=0.5, delta=1e-3)
    assert "client-level DP, z=0.7, C=0.5, 4 of 4 clients per round, delta=0.001" in caplog.text


def test_a_reply_with_its_arrays_in_another_order_is_clipped_key_by_key():
    """An ArrayRecord is a mapping (FedAvg averages it key by key; the key checks compare sets), but server-side
    clipping took the decoded reply's update position by position against the global: with its keys in another order,
    W_i[b] - W[a] and W_i[a] - W[b] (norm 4.4 for an update of norm 3), clipped and written back, mixed the tensors."""
    from flwr.app import ArrayRecord

    from pipeline.federation.protocol import decode_reply
    from tests.test_federated import _reply as _arrays_reply

    plan = SimpleNamespace(train=SimpleNamespace(transfer_delta=False, transfer_dtype="fp32"))
    sent = {"a": torch.zeros(2), "b": torch.ones(2)}
    local = {"b": np.array([1.0, 4.0], dtype=np.float32), "a": np.array([0.0, 0.0], dtype=np.float32)}  # b moves 3
    strategy, _ = _wrapped(1, ArrayRecord.from_torch_state_dict(sent), noise_multiplier=0.0, clipping_norm=3.0)
    reply = _arrays_reply(local, {"num-examples": 1, "num-steps": 1})
    reply.content["arrays"] = decode_reply(reply.content["arrays"], plan, sent)
    assert strategy.clipped(reply, ArrayRecord.from_torch_state_dict(sent), 3.0) == (0, pytest.approx(3.0))
    arrays, _ = strategy.aggregate_train(1, [reply])  # within C: the reply itself
    assert {k: a.numpy().tolist() for k, a in arrays.items()} == {"a": [0.0, 0.0], "b": [1.0, 4.0]}


def test_the_wrapper_hands_the_round_evaluation_and_its_summary_to_its_strategy():
    """The round number reaches the inner strategy's aggregate_train (uniform weights on, then num-examples again);
    evaluation and the summary pass through unchanged."""
    from pipeline.privacy.client_dp import UNIFORM_WEIGHT_KEY, ClientLevelDP

    calls = []
    inner = SimpleNamespace(
        weighted_by_key="num-examples",
        aggregate_train=lambda *args: calls.append(("train", *args, inner.weighted_by_key)) or (None, "train metrics"),
        configure_evaluate=lambda *args: calls.append(("configure", *args)) or ["message"],
        aggregate_evaluate=lambda *args: calls.append(("aggregate", *args)) or "metrics",
        summary=lambda: calls.append(("summary",)),
    )
    cfg = _client_cfg(noise_multiplier=0.0)
    strategy = ClientLevelDP(inner, SimpleNamespace(privacy=cfg, seed=0), federation_privacy(cfg, 4, 4, 1))
    strategy._arrays = _global([1.0])  # as configure_train of the round leaves it
    arrays, metrics = strategy.aggregate_train(3, [])  # an empty sample, no noise: the global
    assert (arrays["w"].numpy().tolist(), metrics, inner.weighted_by_key) == ([1.0], "train metrics", "num-examples")
    assert strategy.configure_evaluate(3, "arrays", "config", "grid") == ["message"]
    assert strategy.aggregate_evaluate(3, ["reply"]) == "metrics"
    strategy.summary()
    assert calls == [
        ("train", 3, [], UNIFORM_WEIGHT_KEY),
        ("configure", 3, "arrays", "config", "grid"),
        ("aggregate", 3, ["reply"]),
        ("summary",),
    ]


def test_a_client_side_reply_is_within_c_up_to_its_float32_rounding_only():
    """The server's check of a client-clipped reply: its update's norm may pass C by 1e-6 C plus the float32 rounding
    of its coordinates (ulps, added in quadrature): here W = (1, 1), C = 1, coordinates in [1, 2) whose ulp is 2**-23,
    so the slack is 1e-6 + 2**-23 sqrt(2) = 1.17e-6. A norm of exactly C passes with its mark; a norm of 1.0001 C,
    100 times that slack above C, is not within C (None), whatever the reply's mark says."""
    g = np.array([1.0, 1.0])
    strategy, _ = _wrapped(1, _global(g), noise_multiplier=0.0, clipping_norm=1.0, clipping_side="client")
    at_c, above = _reply(g + [0.6, 0.8], 1, {"dp-update-clipped": 1}), _reply(g + [0.6001, 0.8001], 1)
    above.content["metrics"]["dp-update-clipped"] = 0
    assert strategy.clipped(at_c, _global(g), 1.0) == (1, pytest.approx(1.0, abs=1e-6))
    assert np.hypot(0.6001, 0.8001) - 1.0 > 50 * (1e-6 + 2**-23 * math.sqrt(2))
    assert strategy.clipped(above, _global(g), 1.0) is None
    assert strategy.clipped(_reply(g + [0.3, 0.4], 1), _global(g), 1.0) is None  # no mark: not within C either
    # the relative 1e-6 alone: W = 0, C = 1000, coordinates near 600 and 800 (ulp 2**-14: a slack of 8.6e-5); a
    # norm of 1000.0005 is within 1000 (1 + 1e-6) + 8.6e-5, though above 1000 (1 - 1e-6) + 8.6e-5
    w0, near = np.zeros(2), _reply([600.0003, 800.0004], 1, {"dp-update-clipped": 1})
    assert strategy.clipped(near, _global(w0), 1000.0) == (1, pytest.approx(1000.0005, abs=2e-4))


def test_client_side_mod_clips_the_reply_and_marks_it(ws, server_identity):
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

    from pipeline.privacy.client_dp import client_dp_mod

    path = write_plan("cdp-mod", "fedavg")
    plan_with = json.loads(Path(path).read_text())
    plan_with["privacy"] = _client_cfg(clipping_side="client", clipping_norm=1.0).plan_dict()
    Path(path).write_text(json.dumps(plan_with))
    g = np.array([1.0, 1.0])
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})

    def send(update):
        msg = Message(
            RecordDict({"arrays": _global(g), "config": ConfigRecord({KEY_CLIPPING_NORM: 1.0, "plan": path})}),
            dst_node_id=1,
            message_type="train",
        )
        msg.metadata.__dict__["_message_id"] = "x"
        return client_dp_mod(msg, context, lambda m, c: _reply(g + update, 5))

    big, small = send(np.array([3.0, 4.0])), send(np.array([0.3, 0.4]))
    np.testing.assert_allclose(big.content["arrays"]["w"].numpy(), g + [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(small.content["arrays"]["w"].numpy(), g + [0.3, 0.4], rtol=1e-6)
    assert (big.content["metrics"]["dp-update-clipped"], small.content["metrics"]["dp-update-clipped"]) == (1, 0)
    # An update of norm 0 is not clipped (C / 0 with the wire's Python float C, not cast to numpy, raises in Flower)
    unchanged = send(np.zeros(2))
    np.testing.assert_array_equal(unchanged.content["arrays"]["w"].numpy(), g)
    assert unchanged.content["metrics"]["dp-update-clipped"] == 0
    # SecAgg+'s masked-vector stage hands the handler Flower's legacy FitIns (clipped inside legacy_fit): it passes
    legacy = Message(
        RecordDict({"fitins.parameters": _global(g), "config": ConfigRecord({"plan": path})}),
        dst_node_id=1,
        message_type="train",
    )
    handed = []
    assert client_dp_mod(legacy, context, lambda m, c: handed.append(m) or "its reply") == "its reply"
    assert handed == [legacy]
    # client-side clipping: the server averages what the clients clipped, uniformly, and sends C in the train config
    strategy, messages = _wrapped(2, _global(g), noise_multiplier=0.0, clipping_norm=1.0, clipping_side="client")
    assert all(m.content["config"][KEY_CLIPPING_NORM] == 1.0 for m in messages)
    arrays, _ = strategy.aggregate_train(1, [big, small])
    np.testing.assert_allclose(arrays["w"].numpy(), g + [0.45, 0.6], rtol=1e-6)


# Adaptive clipping as the two tests below move C: Andrew et al.'s rule at lr 0.2, aiming to clip half the updates.
ADAPTIVE = {"clipping": "adaptive", "clip_norm_lr": 0.2, "target_clipped_quantile": 0.5}


def test_adaptive_clipping_moves_c_by_the_noisy_clipped_count():
    """Andrew et al.'s C <- C exp(lr ((clipped + N(0, sigma_b^2)) / m - target)): the count released to move C is
    noisy (its noise is what the accountant counts with z_u). By hand: 4 clients of update norms 0.5, 5, 6, 7 at C = 1
    (3 clipped), sigma_b = 0.8, lr 0.2, target 0.5; the count's noise is the first draw of the round's generator
    [seed, round], taken here from numpy directly."""
    g = np.zeros(2)
    strategy, _ = _wrapped(4, _global(g), noise_multiplier=0.5, clipping_norm=1.0, clipped_count_stddev=0.8, **ADAPTIVE)
    strategy.aggregate_train(1, [_reply([n, 0.0], 1) for n in (0.5, 5.0, 6.0, 7.0)])
    noise = np.random.default_rng([strategy.seed, 1]).normal(0.0, 0.8)
    assert abs(noise) > 0.05  # a draw that tells a noiseless count from this one
    assert strategy.clipping_norm == pytest.approx(math.exp(0.2 * ((3 + noise) / 4 - 0.5)), rel=1e-12)


@pytest.mark.parametrize("side", ["server", "client"])
def test_adaptive_clipping_settles_where_the_target_fraction_is_clipped(side):
    # Four clients whose updates have norms 0.5, 5, 6, 7 every round; target: clip half of them. Andrew et al.'s
    # rule C <- C exp(lr (clipped fraction - target)) grows C from 0.1 while 3 or 4 of 4 are clipped and stops in
    # [5, 6), where exactly 2 are (Flower 1.41's own sign would shrink C towards 0).
    from flwr.app import ConfigRecord
    from flwr.supercore.differential_privacy import KEY_NORM_BIT

    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import InProcessGrid, _set_server_identity
    from pipeline.federation.strategies.catalog import build_strategy
    from pipeline.privacy.client_dp import ClientLevelDP

    _set_server_identity(1)
    cfg = _client_cfg(noise_multiplier=0.0, clipping_norm=0.1, clipped_count_stddev=0.0, clipping_side=side, **ADAPTIVE)
    strategy = ClientLevelDP(
        build_strategy("fedavg", {}, fraction_train=1.0, client_lr=1e-3),
        SimpleNamespace(privacy=cfg, seed=0),
        federation_privacy(cfg, population=4, sampled=4, rounds=1),
    )
    grid = InProcessGrid(client_app, [{"client-name": f"c{i}"} for i in range(4)])
    g = np.zeros(2)
    norms = [0.5, 5.0, 6.0, 7.0]
    seen = []
    for rnd in range(1, 81):
        list(strategy.configure_train(rnd, _global(g), ConfigRecord(), grid))
        c = strategy.clipping_norm
        seen.append(c)
        # client side: what adaptiveclipping_mod would have sent back (clipped to C, with its norm bit)
        replies = [
            _reply([n, 0.0], 1) if side == "server" else _reply([min(n, c), 0.0], 1, {KEY_NORM_BIT: int(n > c)})
            for n in norms
        ]
        strategy.aggregate_train(rnd, replies)
    assert seen[1] == pytest.approx(0.1 * math.exp(0.2 * (1.0 - 0.5)))  # round 1 clipped all four
    assert 5.0 <= strategy.clipping_norm < 6.0 and all(5.0 <= c < 6.0 for c in seen[-10:])


@pytest.mark.parametrize(
    "clipping,sigma,c,expected_std",
    [
        # Flower's compute_stdv: the noise on the mean is z C / m (DP-FedAvg: N(0, (z C)^2) on the sum of m clipped
        # updates, then divided by m): 1.5 x 2 / 4
        ("fixed", 1.5, 2.0, 0.75),
        # adaptive: the update part z_u C / m with z_u = (0.4^-2 - 1^-2)^-1/2 (clipped_count_stddev 1): 0.43644 x 2 / 4
        ("adaptive", 0.4, 2.0, (0.4**-2 - 1.0) ** -0.5 * 2.0 / 4),
    ],
)
def test_noise_has_the_configured_standard_deviation(clipping, sigma, c, expected_std):
    from scipy import stats

    g = np.zeros(20000)
    privacy = dict(noise_multiplier=sigma, clipping_norm=c, clipping=clipping)
    if clipping == "adaptive":
        privacy["clipped_count_stddev"] = 1.0
    draws = []
    for rnd, seed in ((1, 0), (1, 0), (2, 0), (1, 1)):
        strategy, _ = _wrapped(4, _global(g), seed, **privacy)
        arrays, _ = strategy.aggregate_train(rnd, [_reply(g, 1) for _ in range(4)])  # zero updates: noise only
        draws.append(arrays["w"].numpy().astype(np.float64))
    a, again, b, other_seed = draws
    n = a.size
    assert abs(a.std() - expected_std) < 5 * expected_std / math.sqrt(2 * n)  # 5 standard errors of the std
    assert abs(a.mean()) < 5 * expected_std / math.sqrt(n)
    assert stats.kstest(a / expected_std, "norm").pvalue > 1e-3
    np.testing.assert_array_equal(a, again)  # seeded per (experiment seed, round): a resumed run draws the same
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(n)  # and a fresh draw every round
    assert abs(np.corrcoef(a, other_seed)[0, 1]) < 5 / math.sqrt(n)  # and for every experiment seed


# ------------------------------------------------------------------------------------------ params and plans
def test_privacy_group_validation_for_mode_client():
    ok = from_dict(PrivacyConfig, {"mode": "client", "target_epsilon": 3, "clipping_norm": 0.5}, "privacy")
    assert ok.enabled and ok.clipping_side == "server" and ok.clipping == "fixed"
    assert (
        from_dict(
            PrivacyConfig, {"mode": "client", "noise_multiplier": 1.0, "clipping": "adaptive"}, "privacy"
        ).clipping_norm
        is None
    )  # adaptive starts at 0.1 (federation_privacy)
    bad = [
        ({"mode": "client", "noise_multiplier": 1.0}, "clipping_norm must be set"),
        ({"mode": "client", "noise_multiplier": 1.0, "clipping_norm": math.inf}, "needs clipping fixed and noise"),
        (
            {"mode": "client", "noise_multiplier": 0.0, "clipping_norm": math.inf, "clipping": "adaptive"},
            "needs clipping fixed",
        ),
        (
            {"mode": "client", "noise_multiplier": 1.0, "clipping_norm": 1.0, "clipping_side": "both"},
            "privacy.clipping_side='both' is out of range; allowed: one of 'server' or 'client'",
        ),
        (
            {"mode": "client", "noise_multiplier": 1.0, "clipping_norm": 1.0, "clipping": "quantile"},
            "privacy.clipping='quantile' is out of range; allowed: one of 'fixed' or 'adaptive'",
        ),
        (
            {"mode": "client", "noise_multiplier": 1.0, "clipping_norm": -1.0},
            "privacy.clipping_norm=-1.0 is out of range; allowed: > 0",
        ),
        (
            {"mode": "client", "noise_multiplier": 1.0, "clipping": "adaptive", "target_clipped_quantile": 1.5},
            "privacy.target_clipped_quantile=1.5 is out of range; allowed: >= 0 and <= 1",
        ),
        (
            {"mode": "client", "noise_multiplier": 1.0, "clipping": "adaptive", "clip_norm_lr": 0.0},
            "privacy.clip_norm_lr=0.0 is out of range; allowed: > 0",
        ),
        (
            {"mode": "client", "noise_multiplier": 1.0, "clipping": "adaptive", "clipped_count_stddev": -1.0},
            "privacy.clipped_count_stddev=-1.0 is out of range; allowed: >= 0",
        ),
        ({"mode": "client", "clipping_norm": 1.0}, "exactly one of noise_multiplier and target_epsilon"),
    ]
    for raw, message in bad:
        with pytest.raises(ConfigError, match="^privacy") as exc:
            from_dict(PrivacyConfig, raw, "privacy")
        assert message in str(exc.value) and "\n" not in str(exc.value), (raw, str(exc.value))
    with pytest.raises(ValueError, match=r"^privacy: privacy.delta 0.5 >= 1/3 \(1 / the number of clients\)"):
        federation_privacy(_client_cfg(delta=0.5), population=3, sampled=3, rounds=2)
    with pytest.raises(ConfigError, match=r"^privacy: privacy.delta 0.25 >= 1/4 "):  # 1/N itself promises nothing
        federation_privacy(_client_cfg(delta=0.25), population=4, sampled=4, rounds=2)
    assert federation_privacy(_client_cfg(), population=100, sampled=10, rounds=2).delta == 1e-5


def _params(privacy: dict | None, **train) -> dict:
    return {"tau": 5.0, "model": dict(MODEL), "train": {**TRAIN, **train}, **({"privacy": privacy} if privacy else {})}


def test_the_plan_stage_checks_each_client_level_and_secagg_plan_from_its_clients_alone():
    """check_client_plans on resolved plans (the plan stage's and `presets check`'s): a plan with neither setting is
    skipped and the plans after it still checked; mode client's plans by federation_privacy over the plan's N
    clients, m = max(int(N x fraction_train), 1) and its rounds; SecAgg+'s by the clients of round 1 (a late
    new_client left out); each refusal names the file and the plan's experiment. By hand below."""
    from pipeline.privacy.accounting import check_client_plans

    def plan(name: str, privacy: dict | None = None, clients="abc", **train) -> dict:
        p = {"experiment": name, "clients": list(clients), "train": {"fraction_train": 1.0, "rounds": 2, **train}}
        return p | ({"privacy": privacy} if privacy is not None else {})

    def refusal(*plans: dict, file: str | None = None) -> str:  # None: the default, params.yaml
        with pytest.raises(ConfigError) as exc:
            check_client_plans({f"key-{i}": p for i, p in enumerate(plans)}, *([file] if file else []))
        return str(exc.value)

    dp = {"mode": "client", "noise_multiplier": 1.0, "clipping_norm": 1.0}
    plain, secure = plan("plain"), {"secure_aggregation": True}
    check_client_plans({"plain": plain, "ok": plan("ok", dp | {"delta": 0.3}), "sa": plan("sa", secure)})
    assert refusal(plain, plan("x", dp | {"delta": 0.4}), file="p.yaml") == (  # 0.4 >= 1/3
        "p.yaml experiments.x: privacy.delta 0.4 >= 1/3 (1 / the number of clients) promises nothing; set it well below"
    )
    # N counts a late new client (4 clients: 0.3 >= 1/4); round 1's sum does not ("b", "c": 2 uploads)
    assert refusal(plan("n", dp | {"delta": 0.3}, "abcd", new_client="d")).startswith("params.yaml experiments.n: ")
    check_client_plans({"sa": plan("sa", secure, "bcd", new_client="d")})
    assert refusal(plan("sa", secure, "cd", new_client="d")) == (
        "params.yaml experiments.sa: privacy.secure_aggregation needs at least 2 clients in every round's sum; "
        "1 clients x train.fraction_train 1.0 samples 1"
    )
    assert "0 clients x train.fraction_train 1.0" in refusal(
        {k: v for k, v in plan("s", secure).items() if k != "clients"}
    )
    # m = int(10 x 0.5) = 5: adaptive clipping's default count noise 5 / 20 = 0.25 is below z = 1
    adaptive = plan("a", {"mode": "client", "noise_multiplier": 1.0, "clipping": "adaptive"}, "abcdefghij")
    assert "(now 0.25; " in refusal(adaptive | {"train": {"fraction_train": 0.5, "rounds": 2}})
    assert refusal(plan("t", {"mode": "client", "target_epsilon": 1e-6, "clipping_norm": 1.0})) == (
        "params.yaml experiments.t: privacy.target_epsilon 1e-06 cannot be met with q=1 over 2 rounds "
        "(The privacy budget is too low.)"
    )
    text = refusal(plan("v", {"mode": "client", "noise_multiplier": 1.0}))  # a privacy group not resolved
    assert text.startswith("params.yaml experiments.v") and "clipping_norm must be set" in text


def test_mode_client_enters_plans_with_its_own_keys_and_refuses_what_it_cannot_protect():
    from pipeline.planning import parse_entry, resolve_plan

    def plan(method: str, privacy: dict | None, **train) -> dict:
        params = _params(privacy, **train)
        return resolve_plan(parse_entry("x", {"method": method, "partition": "domain/seed0"}, params), params)

    fixed = {
        "mode": "client",
        "target_epsilon": 3.0,
        "clipping_norm": 0.5,
        "max_grad_norm": 7.0,
        "target_clipped_quantile": 0.9,
    }
    for method in ("fedavg", "fedprox", "fedkd", "fedselectkd", "hardkd", "pre_addition"):
        p = plan(method, fixed)
        assert p["privacy"] == {
            "mode": "client",
            "noise_multiplier": None,
            "target_epsilon": 3.0,
            "delta": None,
            "accountant": "rdp",
            "clipping_side": "server",
            "clipping": "fixed",
            "clipping_norm": 0.5,
        }  # no DP-SGD key, no adaptive key
        assert {k: v for k, v in p.items() if k != "privacy"} == plan(method, None)
    adaptive = plan("fedavg", {**fixed, "clipping": "adaptive"})["privacy"]
    assert (adaptive["target_clipped_quantile"], adaptive["clip_norm_lr"], adaptive["clipped_count_stddev"]) == (
        0.9,
        0.2,
        None,
    )
    # the client-mode keys change neither mode none's nor mode example's plans
    example = {"mode": "example", "noise_multiplier": 1.0}
    assert plan("fedavg", {**example, "clipping_norm": 9.0, "clipping": "adaptive"}) == plan("fedavg", example)
    assert plan("fedavg", {"mode": "none", "clipping_norm": 9.0}) == plan("fedavg", None)

    refused = [
        ("single", {}, "trains each client alone"),
        ("centralized", {}, "pools every client's data"),
        ("fedopt", {}, "applies an optimiser"),
        ("fednova", {}, "rescales each update"),
        ("fedtrimmedavg", {}, "trimmed mean"),  # not an optimiser: its own reason, not fedopt's
        ("post_addition", {}, "population grows"),
        ("fedavg", {"transfer_dtype": "int8"}, "clipping_side client needs train.transfer_dtype fp32"),
    ]
    for method, train, message in refused:
        with pytest.raises(ConfigError) as exc:
            plan(method, {**fixed, "clipping_side": "client"}, **train)
        text = str(exc.value)
        assert text.startswith("params.yaml experiments.x: privacy.mode client: ") and message in text, text
        assert "\n" not in text
    plan("fedavg", fixed, transfer_dtype="int8")  # server-side clipping clips the decoded reply: lossy is fine


# ------------------------------------------------------------------------------------------ on the model
def _write_equal_partition(root: Path) -> None:
    """The three domain clients with 4 training examples each: FedAvg's size weights are then equal, so its mean
    is the uniform mean client-level DP takes and the two runs differ only by the DP strategy."""
    domain = json.loads((root / "data/partitions/domain/seed0.json").read_text())
    clients = {c: {**s, "train": s["train"][:4]} for c, s in domain["clients"].items()}
    out = root / "data/partitions/equal/seed0.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**domain, "scheme": "equal", "clients": clients}))


def _with_privacy(path: str, privacy: dict) -> str:
    plan = json.loads(Path(path).read_text())
    plan["privacy"] = from_dict(PrivacyConfig, privacy, "privacy").plan_dict()
    Path(path).write_text(json.dumps(plan, indent=2, sort_keys=True))
    return path


def _final_adapters(name: str) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {
        d.name: load_file(d / "adapter_final.safetensors") for d in sorted(Path(f"models/{name}/clients").iterdir())
    }


@pytest.mark.parametrize("side", ["server", "client"])
def test_no_noise_and_no_clipping_is_the_non_private_run(ws, side):
    from pipeline.train import run_experiment

    _write_equal_partition(ws)
    plain = run_experiment(write_plan(f"cdp-plain-{side}", "fedavg", "equal/seed0"), track=False)
    control = run_experiment(
        _with_privacy(
            write_plan(f"cdp-control-{side}", "fedavg", "equal/seed0"),
            {"mode": "client", "noise_multiplier": 0.0, "clipping_norm": math.inf, "clipping_side": side},
        ),
        track=False,
    )
    # the control went through the DP strategy: every update aggregated, none clipped, no bound
    assert control["privacy"]["updates_aggregated"] == 3 * TRAIN["rounds"]
    assert control["privacy"]["clipped_fraction"] == 0.0 and control["privacy"]["epsilon"] is None
    history = json.loads(Path(f"models/cdp-control-{side}/rounds.json").read_text())
    assert all(r["update_norm"] > 0 for r in history)  # what a C is chosen from
    a, b = _final_adapters(f"cdp-plain-{side}"), _final_adapters(f"cdp-control-{side}")
    for client in a:
        for k in a[client]:
            # equal up to float32 rounding of W + (W_i - W) in the server's clip
            torch.testing.assert_close(b[client][k], a[client][k], rtol=1e-5, atol=1e-6)
    for client, c in plain["clients"].items():
        assert control["clients"][client]["best_val_loss"] == pytest.approx(c["best_val_loss"], rel=1e-5)


def test_client_side_clipping_on_the_adapters_bounds_the_reply(ws):
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

    from pipeline.experiments.plans import read_plan
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.protocol import CLIPPED_KEY, TRAIN_METRICS
    from pipeline.privacy.client_dp import update_norm
    from pipeline.training.shared_model import initial_adapter_state

    path = _with_privacy(
        write_plan("cdp-reply", "fedselectkd"),
        {"mode": "client", "noise_multiplier": 1.0, "clipping_norm": 1.0, "clipping_side": "client"},
    )
    _set_server_identity(1)
    received = ArrayRecord.from_torch_state_dict(initial_adapter_state(read_plan(path)))
    replies = {}
    for c in (1e-4, 100.0):  # far below and far above a tiny model's round update
        context = Context(
            run_id=1, node_id=1000, node_config={"client-name": "Committee"}, state=RecordDict(), run_config={}
        )
        msg = Message(
            RecordDict(
                {
                    "arrays": received,
                    "config": ConfigRecord({"server-round": 1, "plan": path, KEY_CLIPPING_NORM: c, **CLIENT_SETTINGS}),
                }
            ),
            dst_node_id=1000,
            message_type="train",
        )
        msg.metadata.__dict__["_message_id"] = f"x{c}"
        replies[c] = client_app(msg, context).content
    small, large = replies[1e-4], replies[100.0]
    norm_small, norm_large = update_norm(small["arrays"], received), update_norm(large["arrays"], received)
    assert norm_small == pytest.approx(1e-4, rel=1e-3) and small["metrics"][CLIPPED_KEY] == 1
    assert 1e-4 < norm_large < 100.0 and large["metrics"][CLIPPED_KEY] == 0  # the same training, left as it was
    # what leaves the client: the adapter's tensors, the counts, and the one 0/1 count of client-level DP
    assert set(small["arrays"].keys()) == set(received.keys())
    assert set(small["metrics"].keys()) == set(TRAIN_METRICS) | {CLIPPED_KEY}
    # and its client's name, which it gave at admission (the server checks the node still answers as that client)
    assert {k: dict(v) for k, v in small.config_records.items()} == {"identity": {"client-name": "Committee"}}


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_federated_run_with_target_epsilon_reports_it(ws):
    import mlflow

    from pipeline.train import run_experiment

    name = "cdp-target"
    path = _with_privacy(
        write_plan(name, "fedavg", fraction_train=0.67),
        {"mode": "client", "target_epsilon": 8.0, "clipping_norm": 0.05},
    )
    metrics = run_experiment(path)
    p = metrics["privacy"]
    # 2 of 3 clients per round (q = 2/3), 2 rounds, both released: close to the target, never above
    assert 7.9 < p["epsilon"] <= 8.0 and p["epsilon_max"] == p["epsilon"]
    assert (p["mode"], p["delta"], p["sample_rate"], p["rounds_released"], p["updates_aggregated"]) == (
        "client",
        1e-5,
        pytest.approx(2 / 3),
        2,
        4,
    )
    assert p["clipping_norm"] == 0.05 and p["noise_multiplier"] > 0
    assert p["epsilon"] == pytest.approx(
        federation_privacy(
            _client_cfg(noise_multiplier=p["noise_multiplier"], clipping_norm=0.05), 3, 2, 2
        ).bound_after(2)[0]
    )
    history = json.loads(Path(f"models/{name}/rounds.json").read_text())
    per_round = {r["round"]: r["epsilon"] for r in history if "update_clipped" in r}
    # server side: every aggregated update's norm before clipping, clipped exactly when above C
    assert all(r["update_clipped"] == int(r["update_norm"] > 0.05) for r in history if "update_clipped" in r)
    # the run's clipped fraction: of its 4 aggregated updates, those whose norm was above C
    norms = [r["update_norm"] for r in history if "update_clipped" in r]
    assert len(norms) == 4 and p["clipped_fraction"] == sum(n > 0.05 for n in norms) / 4
    assert per_round[1] < per_round[2] == p["epsilon"]
    assert sum(c.get("privacy", {}).get("updates_aggregated", 0) for c in metrics["clients"].values()) == 4
    wide = json.loads(Path(f"reports/train/{name}/rounds.json").read_text())
    assert [w["epsilon"] for w in wide] == [per_round[1], per_round[2]]

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    run = mlflow.search_runs(experiment_names=["tests"], filter_string=f"tags.experiment = '{name}'").iloc[0]
    assert run["metrics.run/epsilon"] <= 8.0 and run["metrics.epsilon_max"] == run["metrics.run/epsilon"]
    for key in ("delta", "noise_multiplier", "clipping_norm", "clipped_fraction"):
        assert run[f"metrics.run/{key}"] == pytest.approx(p[key])
    client = mlflow.tracking.MlflowClient()
    # per round (the run's closing value is run/epsilon, not a second point at the last step)
    assert {(m.step, round(m.value, 9)) for m in client.get_metric_history(run["run_id"], "epsilon")} == {
        (1, round(per_round[1], 9)),
        (2, round(per_round[2], 9)),
    }


def test_adaptive_clipping_moves_c_by_the_clipped_fraction_and_a_resumed_run_keeps_it(ws, monkeypatch):
    from pipeline.train import run_experiment

    # No noise (count noise 0 too): C moves deterministically, C_2 = C_1 exp(lr (clipped fraction - target))
    privacy = {
        "mode": "client",
        "noise_multiplier": 0.0,
        "clipping": "adaptive",
        "clipping_norm": 1e-3,
        "clipped_count_stddev": 0.0,
        "target_clipped_quantile": 0.5,
        "clip_norm_lr": 0.2,
        "clipping_side": "client",
    }
    path = _with_privacy(write_plan("cdp-adaptive", "fedavg"), privacy)
    with killed_after_checkpoint(monkeypatch, rnd=1):
        run_experiment(path, track=False)
    run_experiment(path, track=False)
    history = json.loads(Path("models/cdp-adaptive/rounds.json").read_text())
    r1 = [r for r in history if r["round"] == 1]
    r2 = [r for r in history if r["round"] == 2]
    fraction = sum(r["update_clipped"] for r in r1) / len(r1)
    assert fraction == 1.0  # C = 0.001 clips every round-1 update of the tiny model
    assert {r["clipping_norm"] for r in r1} == {1e-3}
    # every update clipped, more than the target half: C grows (restored from the round-1 checkpoint)
    assert len(r2) == 3 and all(
        r["clipping_norm"] == pytest.approx(1e-3 * math.exp(0.2 * (fraction - 0.5))) for r in r2
    )


def test_a_reply_not_clipped_within_c_is_left_out(ws, monkeypatch):
    # Client-side clipping: the server checks every reply's update against C (it sees them, without secure
    # aggregation); a ClientApp without Flower's mod that claims "not clipped" sends its update as it is and is
    # not aggregated.
    from flwr.clientapp import ClientApp

    from pipeline.experiments.plans import read_plan
    from pipeline.experiments.settings import RunSettings
    from pipeline.federation import client_app as apps
    from pipeline.federation import engines
    from pipeline.federation.processes import FederationError
    from pipeline.federation.protocol import CLIPPED_KEY
    from pipeline.federation.server_app import load_server_checkpoint
    from pipeline.training.summary import summarize
    from tests.test_server_loop import Recorder

    unclipped = ClientApp()

    @unclipped.train()
    def train(msg, context):
        reply = apps.train_round(msg, context)  # no clipping mod
        reply.content["metrics"][CLIPPED_KEY] = 0
        return reply

    unclipped.evaluate()(apps.client_evaluate)
    unclipped.query("identify")(apps.client_identify)
    path = _with_privacy(
        write_plan("cdp-nomod", "fedavg"),
        {"mode": "client", "noise_multiplier": 1.0, "clipping_norm": 1e-3, "clipping_side": "client"},
    )
    monkeypatch.setattr(engines, "client_app", unclipped)
    # no reply is ever aggregated: the run is an error (nothing trained), its rounds in the server's checkpoint
    with pytest.raises(FederationError, match=r"cdp-nomod: no client update in any round.*not clipped within C"):
        engines.run_federated(path, RunSettings(), Recorder())
    history = load_server_checkpoint(read_plan(path))["history"]
    assert len(history) == 3 * TRAIN["rounds"] and all(r["failed"] == 1 and r["sampled"] == 1 for r in history)
    assert not any("update_clipped" in r for r in history)
    privacy = summarize(read_plan(path), history, [])["privacy"]
    # nothing released, yet every round ran its (Poisson) sampling and counts: the accountant over all rounds
    assert privacy["rounds_released"] == 0 and privacy["rounds_accounted"] == TRAIN["rounds"]
    assert privacy["epsilon"] == pytest.approx(
        federation_privacy(
            _client_cfg(noise_multiplier=1.0, clipping_norm=1e-3, clipping_side="client"),
            population=3,
            sampled=3,
            rounds=TRAIN["rounds"],
        ).bound_after(TRAIN["rounds"])[0]
    )


@pytest.mark.parametrize("killed, damaged", [(1, False), (2, False), (1, True)], ids=["1", "2", "1-record-damaged"])
def test_a_round_redone_after_a_kill_draws_fresh_noise_and_is_accounted_again(ws, monkeypatch, caplog, killed, damaged):
    """fedavg's evaluate step sends round r's noisy global to every client before the server checkpoint of round r:
    a server killed in between redoes round r on resuming, and a client that failed in the first attempt and not in
    the second made the two releases differ by its clipped update / m alone if they drew the same noise. Each
    release needs its own noise (their difference: N(0, 2 (z C / m)^2) per coordinate) and the accountant composes
    both (3 releases in 2 rounds: opacus' RDP at q = 1 over 3 steps, computed here directly). Round 1 too: the
    train stage restarts a run killed before its first checkpoint in a clean run directory; when the run's record
    (experiment.json) is damaged, whose releases they were cannot be read: they are kept and counted again."""
    from pipeline.experiments.plans import read_plan
    from pipeline.federation import client_app, server_app
    from pipeline.train import run_experiment
    from tests.faults import Killed
    from tests.test_client_sampling import _opacus_rdp_epsilon

    z, c, m = 1.0, 1e-3, 3  # every client every round (q = 1)
    name = f"cdp-redo-{killed}{'-damaged' if damaged else ''}"  # each case its own run: none finds another's files
    path = _with_privacy(write_plan(name, "fedavg"), {"mode": "client", "noise_multiplier": z, "clipping_norm": c})
    released, real_train, real_evaluate, attempt = [], client_app.train_round, server_app._evaluate, [1]

    def train(msg, context):
        if (
            attempt[0] == 1
            and context.node_config["client-name"] == "Committee"
            and msg.content["config"]["server-round"] == killed
        ):
            raise RuntimeError("fails in the first attempt of the killed round only")
        return real_train(msg, context)

    def evaluate(r, messages, downlink):
        real_evaluate(r, messages, downlink)  # the clients received round r's global
        if r.rnd == killed:
            released.append(np.concatenate([a.ravel() for a in downlink.to_numpy_ndarrays()]).astype(np.float64))
            if attempt[0] == 1:
                raise Killed("killed before the round's checkpoint")

    monkeypatch.setattr(client_app, "train_round", train)
    monkeypatch.setattr(server_app, "_evaluate", evaluate)
    with pytest.raises(Killed):
        run_experiment(path, track=False)
    if damaged:  # the killed run's own record, cut short
        (Path(read_plan(path).paths["out_dir"]) / "experiment.json").write_text('{"experiment": "cdp-re')
    attempt[0] = 2
    with caplog.at_level("WARNING"):
        run_experiment(path, track=False)
    assert ("unreadable" in caplog.text and "releases are kept" in caplog.text) == damaged
    difference = released[1] - released[0]
    assert difference.size > 1000 and np.linalg.norm(difference) > c / m, "the two releases differ without noise"
    assert difference.std() == pytest.approx(math.sqrt(2) * z * c / m, rel=0.1)
    privacy = json.loads(Path(f"reports/train/{name}/metrics.json").read_text())["privacy"]
    assert privacy["rounds_accounted"] == 3 and privacy["epsilon"] == pytest.approx(
        _opacus_rdp_epsilon(1.0, z, 3, 1e-5), rel=1e-6
    )


def test_a_kd_methods_round_redone_after_a_kill_in_its_evaluate_draws_what_it_drew_and_is_accounted_once(
    ws, monkeypatch
):
    """A KD method (fedkd: strategy fedavg, the local adapter kept) sends no global in its evaluate step: round r's
    release leaves only with round r + 1's train messages, after the server checkpoint of round r. A server killed
    in round 2's evaluate released nothing that anyone saw: the resumed run redoes round 2 as the uninterrupted run
    did it (the same sample and noise: the same global) and the accountant composes 2 rounds (opacus' RDP at q = 1
    over 2 steps, computed here directly), as docs/privacy.md says of fedavg's and fedprox's evaluate only."""
    from pipeline.federation import server_app
    from pipeline.train import run_experiment
    from tests.faults import Killed
    from tests.test_client_sampling import _opacus_rdp_epsilon

    z, c = 1.0, 1e-3
    path = _with_privacy(
        write_plan("cdp-kd-redo", "fedkd"), {"mode": "client", "noise_multiplier": z, "clipping_norm": c}
    )
    saved, real_save, real_evaluate, kill = [], server_app.save_server_checkpoint, server_app._evaluate, [False]

    def save(plan, rnd, state, strategy, history):
        if rnd == 2:
            saved.append(torch.cat([t.flatten().double() for t in state.values()]))
        real_save(plan, rnd, state, strategy, history)

    def evaluate(r, messages, downlink):
        real_evaluate(r, messages, downlink)
        if r.rnd == 2 and kill[0]:
            kill[0] = False
            raise Killed("killed before round 2's checkpoint")

    monkeypatch.setattr(server_app, "save_server_checkpoint", save)
    monkeypatch.setattr(server_app, "_evaluate", evaluate)
    run_experiment(path, track=False)  # uninterrupted (its run directory goes when it finishes)
    kill[0] = True
    with pytest.raises(Killed):
        run_experiment(path, track=False)
    run_experiment(path, track=False)
    assert len(saved) == 2 and torch.equal(saved[0], saved[1]), "the resumed run's round-2 global differs"
    privacy = json.loads(Path("reports/train/cdp-kd-redo/metrics.json").read_text())["privacy"]
    assert privacy["rounds_accounted"] == 2 and privacy["epsilon"] == pytest.approx(
        _opacus_rdp_epsilon(1.0, z, 2, 1e-5), rel=1e-6
    )


def test_the_privacy_docs_client_dp_benchmark_settings_are_its_json():
    """docs/privacy.md: the client-level DP benchmark is "FedAvg on the tiny BART of tests/tiny_models.py at 3, 30
    and 100 clients, every client or 10 a round, Poisson sampling of clients, C = the median round-1 update norm,
    server-side fixed clipping, RDP accountant, delta 1e-5, one seed": reports/privacy/client_dp.json's."""
    root = Path(__file__).resolve().parents[1]
    bench = json.loads((root / "reports/privacy/client_dp.json").read_text())
    docs = " ".join((root / "docs/privacy.md").read_text(encoding="utf-8").split())
    config, privacy = bench["config"], bench["privacy"]
    sizes, fewer = config["sizes"], {r["sampled"] for r in bench["runs"] if r["sampled"] < r["clients"]}
    assert bench["method"] == "fedavg" and bench["backbone"].startswith("tiny BART (tests/tiny_models.py")
    assert {r["clients"] for r in bench["runs"] if r["sampled"] == r["clients"]} == set(sizes) and len(fewer) == 1
    assert all(
        p["clipping_norm"] == pytest.approx(np.median(p["round1_update_norms"]), abs=1e-6)
        for p in bench["pools"].values()
    )
    assert (privacy["clipping_side"], privacy["clipping"], privacy["accountant"]) == ("server", "fixed", "rdp")
    assert isinstance(config["seed"], int)
    assert (
        f"FedAvg on the tiny BART of tests/tiny_models.py at {sizes[0]}, {sizes[1]} and {sizes[2]} clients, every "
        f"client or {fewer.pop()} a round, {privacy['sampling'].capitalize()} sampling of clients, C = the median "
        f"round-1 update norm, server-side fixed clipping, RDP accountant, delta {privacy['delta']:.0e}, one seed)"
    ).replace("e-05", "e-5") in docs
