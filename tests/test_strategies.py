"""Server aggregation (pipeline.federation.strategies) against METHOD.md section 5, without a federated run.

FedNova's update is checked against the formula worked out by hand and against its defining property (equal step
counts give FedAvg exactly, for any weights and updates); each server algorithm is checked to be the Flower strategy
with the paper's settings (every client evaluated, one node enough, weights = |D_i|).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_federated import _reply

N = "num-examples"
S = "num-steps"


def _strategy(name: str, fraction_train: float = 1.0, client_lr: float = 1e-3, **strategy_params):
    """``strategy_params``: the strategies' params.yaml `train` keys (proximal_mu, fedopt, ...)."""
    from pipeline.federation.strategies.catalog import build_strategy

    return build_strategy(name, strategy_params, fraction_train=fraction_train, client_lr=client_lr)


def _grid(n: int):
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import InProcessGrid, _set_server_identity

    _set_server_identity(1)  # the strategies create Messages, as a ServerApp does
    return InProcessGrid(client_app, [{"client-name": f"c{i}"} for i in range(n)])


def _fednova_after_sending(global_w: dict[str, np.ndarray]):
    from flwr.app import Array, ArrayRecord, ConfigRecord

    strategy = _strategy("fednova")
    list(strategy.configure_train(1, ArrayRecord({k: Array(v) for k, v in global_w.items()}), ConfigRecord(), _grid(2)))
    return strategy


def _error_reply():
    from flwr.app import Error, Message, RecordDict

    from pipeline.federation.engines import _set_server_identity

    _set_server_identity(1)
    ins = Message(RecordDict(), dst_node_id=7, message_type="train")
    ins.metadata.__dict__["_message_id"] = "e"
    return Message(Error(code=0, reason="client crashed"), reply_to=ins)


@settings(max_examples=25, deadline=None)
@given(
    weights=st.lists(st.integers(1, 50), min_size=1, max_size=4),
    steps=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
def test_fednova_with_equal_step_counts_is_fedavg(weights, steps, seed):
    """tau_i = tau for all i: d = sum p_i (W - W_i) / tau, tau_eff = tau, so W - tau_eff d = sum p_i W_i."""
    rng = np.random.default_rng(seed)
    w0 = {"a": rng.normal(size=3).astype(np.float32), "b": rng.normal(size=(2, 2)).astype(np.float32)}
    clients = [{k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in w0.items()} for _ in weights]
    nova = _fednova_after_sending(w0)
    replies = [_reply(c, {N: n, S: steps}) for c, n in zip(clients, weights)]
    arrays, _ = nova.aggregate_train(1, replies)
    p = np.array(weights, dtype=np.float64) / sum(weights)
    for key in w0:
        expected = sum(p_i * c[key].astype(np.float64) for p_i, c in zip(p, clients))
        got = arrays[key].numpy()
        assert got.dtype == np.float32 and got.shape == w0[key].shape
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_fednova_hand_computed_update_for_two_tensors_and_three_clients():
    # W = [1, -1], [2]; p = (2, 1, 1)/4; tau = (1, 2, 4); tau_eff = 2/4 + 2/4 + 4/4 = 2
    w0 = {"u": np.array([1.0, -1.0], dtype=np.float32), "v": np.array([2.0], dtype=np.float32)}
    clients = [
        {"u": np.array([0.0, 0.0], dtype=np.float32), "v": np.array([2.0], dtype=np.float32)},  # Delta = [1,-1],[0]
        {"u": np.array([3.0, -1.0], dtype=np.float32), "v": np.array([0.0], dtype=np.float32)},  # Delta = [-2,0],[2]
        {"u": np.array([1.0, 3.0], dtype=np.float32), "v": np.array([6.0], dtype=np.float32)},  # Delta = [0,-4],[-4]
    ]
    counts = [(2, 1), (1, 2), (1, 4)]
    nova = _fednova_after_sending(w0)
    arrays, _ = nova.aggregate_train(1, [_reply(c, {N: n, S: t}) for c, (n, t) in zip(clients, counts)])
    # d_u = 1/2 [1,-1]/1 + 1/4 [-2,0]/2 + 1/4 [0,-4]/4 = [0.25, -0.75]; W_u = [1,-1] - 2 d_u = [0.5, 0.5]
    # d_v = 0 + 1/4 * 2/2 + 1/4 * (-4)/4 = 0;                           W_v = [2]
    np.testing.assert_allclose(arrays["u"].numpy(), [0.5, 0.5], rtol=1e-6)
    np.testing.assert_allclose(arrays["v"].numpy(), [2.0], rtol=1e-6)


def test_fednova_update_is_relative_to_what_was_sent_this_round():
    # the same replies against a different global give a different result (W_new = W - tau_eff d depends on W)
    client = {"w": np.array([4.0], dtype=np.float32)}
    results = []
    for start in (0.0, 2.0):
        nova = _fednova_after_sending({"w": np.array([start], dtype=np.float32)})
        arrays, _ = nova.aggregate_train(
            1, [_reply(client, {N: 1, S: 2}), _reply({"w": np.array([start], dtype=np.float32)}, {N: 1, S: 2})]
        )
        results.append(float(arrays["w"].numpy()[0]))
    # equal steps: the mean of the client states, (4 + start) / 2
    assert results == pytest.approx([2.0, 3.0])


@pytest.mark.parametrize("metrics", [{N: 3}, {N: 3, S: 0}, {N: 3, S: -2}])
def test_fednova_rejects_a_reply_without_a_positive_step_count(metrics):
    nova = _fednova_after_sending({"w": np.array([0.0], dtype=np.float32)})
    with pytest.raises(ValueError, match="FedNova: reply without a positive 'num-steps' metric"):
        nova.aggregate_train(1, [_reply({"w": np.array([1.0], dtype=np.float32)}, metrics)] * 2)


def test_fednova_one_step_is_accepted_and_failed_replies_are_left_out():
    nova = _fednova_after_sending({"w": np.array([0.0], dtype=np.float32)})
    arrays, metrics = nova.aggregate_train(
        1, [_reply({"w": np.array([3.0], dtype=np.float32)}, {N: 2, S: 1}), _error_reply()]
    )
    np.testing.assert_allclose(arrays["w"].numpy(), [3.0])  # one good client: its state
    assert nova.aggregate_train(2, [_error_reply()]) == (None, None)  # nobody to aggregate


def test_fednova_reports_the_example_weighted_train_metrics():
    nova = _fednova_after_sending({"w": np.array([0.0], dtype=np.float32)})
    _, metrics = nova.aggregate_train(
        1,
        [
            _reply({"w": np.array([1.0], dtype=np.float32)}, {N: 1, S: 1, "train-loss": 2.0}),
            _reply({"w": np.array([1.0], dtype=np.float32)}, {N: 3, S: 5, "train-loss": 6.0}),
        ],
    )
    assert metrics["train-loss"] == pytest.approx((1 * 2.0 + 3 * 6.0) / 4)


@pytest.mark.parametrize(
    "name, optimizer",
    [
        ("fedavg", "sgdm"),
        ("fedprox", "sgdm"),
        ("fedopt", "sgdm"),
        ("fedopt", "adam"),
        ("fedopt", "yogi"),
        ("fedopt", "adagrad"),
        ("fednova", "sgdm"),
    ],
)
def test_every_client_evaluates_one_node_suffices_and_weights_are_train_sizes(name, optimizer):
    from flwr.app import Array, ArrayRecord, ConfigRecord

    strategy = _strategy(name, fraction_train=0.67, fedopt={"server_optimizer": optimizer})
    arrays = ArrayRecord({"w": Array(np.zeros(1, dtype=np.float32))})
    # 0.67 of 3 nodes -> int(2.01) = 2 trained; all 3 evaluate (each keeps its best adapter on its own valid set)
    assert len(list(strategy.configure_train(1, arrays, ConfigRecord(), _grid(3)))) == 2
    assert len(list(strategy.configure_evaluate(1, arrays, ConfigRecord(), _grid(3)))) == 3
    # a lone client (e.g. the only one admitted) still trains: max(int(0.67), min_train_nodes = 1) = 1
    assert len(list(strategy.configure_train(1, arrays, ConfigRecord(), _grid(1)))) == 1
    assert (strategy.min_train_nodes, strategy.min_evaluate_nodes, strategy.min_available_nodes) == (1, 1, 1)
    assert strategy.fraction_evaluate == 1.0 and strategy.weighted_by_key == "num-examples"


def test_server_algorithms_get_their_settings():
    from flwr.serverapp import strategy as fs

    prox = _strategy("fedprox", proximal_mu=0.01)
    assert type(prox) is fs.FedProx and prox.proximal_mu == 0.01
    assert type(_strategy("fedavg")) is fs.FedAvg
    sgdm = _strategy("fedopt", fedopt={"server_lr": 0.5, "server_momentum": 0.8})
    assert isinstance(sgdm, fs.FedAvgM) and (sgdm.server_learning_rate, sgdm.server_momentum) == (0.5, 0.8)
    cfg = {"server_optimizer": "adam", "server_lr": 0.05, "beta_1": 0.8, "beta_2": 0.95, "eps": 1e-4}
    adam = _strategy("fedopt", fedopt=cfg, client_lr=3e-4)
    assert type(adam) is fs.FedAdam
    assert (adam.eta, adam.eta_l, adam.tau, adam.beta_1, adam.beta_2) == (0.05, 3e-4, 1e-4, 0.8, 0.95)
    yogi = _strategy("fedopt", fedopt={"server_optimizer": "yogi", "beta_1": 0.7, "beta_2": 0.9})
    assert type(yogi) is fs.FedYogi and (yogi.beta_1, yogi.beta_2) == (0.7, 0.9)
    adagrad = _strategy("fedopt", fedopt={"server_optimizer": "adagrad", "server_lr": 0.2, "eps": 1e-2})
    assert type(adagrad) is fs.FedAdagrad and (adagrad.eta, adagrad.tau) == (0.2, 1e-2)
    assert type(_strategy("fednova")).__name__ == "FedNova"


def test_unknown_server_algorithms_are_rejected_by_name():
    with pytest.raises(
        ValueError,
        match="fedopt.server_optimizer='sgd' is out of range; allowed: one of 'sgdm', 'adam', 'yogi' or 'adagrad'",
    ):
        _strategy("fedopt", fedopt={"server_optimizer": "sgd"})
    with pytest.raises(ValueError, match="unknown server strategy 'fedsgd'"):
        _strategy("fedsgd")


@pytest.mark.parametrize(
    "train, message",
    [
        # the client adds the term only for mu > 0: a negative or NaN mu ran FedProx as plain FedAvg, silently
        ({"proximal_mu": -0.01}, r"train.proximal_mu=-0.01 is out of range; allowed: >= 0"),
        ({"proximal_mu": math.nan}, r"train.proximal_mu=nan is out of range; allowed: a finite number"),
        # FedAvgM applies momentum only when it is > 0: a negative one was dropped, silently
        ({"fedopt": {"server_momentum": -0.9}}, r"train.fedopt.server_momentum=-0.9 is out of range; allowed: >= 0"),
        ({"fedopt": {"server_momentum": 1.0}}, r"train.fedopt.server_momentum=1.0 is out of range; allowed: .*< 1"),
        ({"fedopt": {"server_lr": 0.0}}, r"train.fedopt.server_lr=0.0 is out of range; allowed: > 0"),
        ({"fedopt": {"beta_2": 1.5}}, r"train.fedopt.beta_2=1.5 is out of range; allowed: .*< 1"),
        ({"fedopt": {"eps": 0.0}}, r"train.fedopt.eps=0.0 is out of range; allowed: > 0"),  # Reddi et al.: tau > 0
    ],
)
def test_a_server_setting_outside_its_domain_is_refused_naming_the_key(train, message):
    from pipeline.common.config import ConfigError
    from pipeline.experiments.train_config import train_config

    with pytest.raises(ConfigError, match=message):
        train_config(train)


def test_strategy_state_is_a_snapshot_and_restores_exactly():
    from pipeline.federation.strategies.registry import restore_strategy_state, strategy_state

    strategy = _strategy("fedopt")
    strategy.current_arrays = {"w": np.array([1.0])}
    strategy.momentum_vector = [np.array([0.5])]
    state = strategy_state(strategy)
    assert set(state) == {"current_arrays", "momentum_vector"}  # FedAvgM's state (no m_t / v_t)
    strategy.momentum_vector[0][0] = 9.0  # the server goes on training: the checkpoint must not change
    assert state["momentum_vector"][0][0] == 0.5
    fresh = _strategy("fedopt")
    restore_strategy_state(fresh, state)
    assert fresh.momentum_vector[0][0] == 0.5 and fresh.current_arrays["w"][0] == 1.0
    with pytest.raises(ValueError, match="unexpected strategy state 'lr'"):
        restore_strategy_state(fresh, {"lr": 0.1})


def test_fednova_rejects_a_train_reply_without_arrays():
    """Train replies are checked like FedAvg's (each must carry its ArrayRecord) before any arithmetic."""
    from flwr.app import Message, MetricRecord, RecordDict
    from flwr.serverapp.exception import InconsistentMessageReplies

    from pipeline.federation.engines import _set_server_identity

    nova = _fednova_after_sending({"w": np.array([0.0], dtype=np.float32)})
    _set_server_identity(1)
    ins = Message(RecordDict(), dst_node_id=7, message_type="train")
    ins.metadata.__dict__["_message_id"] = "n"
    no_arrays = Message(RecordDict({"metrics": MetricRecord({N: 1, S: 1})}), reply_to=ins)
    with pytest.raises(InconsistentMessageReplies):
        nova.aggregate_train(1, [no_arrays, no_arrays])


def test_fednova_accumulates_in_float64_and_rounds_once():
    """Seven clients with uneven weights and steps on 1000 float32 values: the result is the float64 formula
    rounded once to float32, bit for bit (a float32 accumulation drifts by a few ulps)."""
    rng = np.random.default_rng(7)
    w0 = {"w": (rng.normal(size=1000) * 3).astype(np.float32)}
    weights, steps = [3, 5, 7, 11, 13, 17, 19], [1, 2, 3, 5, 8, 13, 21]
    clients = [{"w": (w0["w"] + rng.normal(size=1000) * 0.1).astype(np.float32)} for _ in weights]
    nova = _fednova_after_sending(w0)
    arrays, _ = nova.aggregate_train(1, [_reply(c, {N: n, S: t}) for c, n, t in zip(clients, weights, steps)])
    p = np.array(weights, dtype=np.float64) / sum(weights)
    w = w0["w"].astype(np.float64)
    d = sum(p_i * (w - c["w"]) / t for p_i, c, t in zip(p, clients, steps))
    expected = (w - float((p * np.array(steps)).sum()) * d).astype(np.float32)
    got = arrays["w"].numpy()
    assert got.dtype == np.float32 and np.array_equal(got, expected)


@pytest.mark.parametrize("optimizer", ["sgdm", "adam", "yogi", "adagrad"])
def test_params_server_lr_defaults_to_flowers_for_the_chosen_optimiser(optimizer):
    """params.yaml's fedopt group with only the optimiser switched: each server optimiser gets Flower's own default
    learning rate (FedAvgM 1.0, FedAdam/FedAdagrad eta 0.1, FedYogi 0.01), not sgdm's 1.0 (Adam's first step with
    eta 1 is ~0.74 per coordinate whatever the update's size)."""
    import inspect

    import yaml

    params = Path(__file__).resolve().parents[1] / "params.yaml"  # the repository's, whatever the working directory
    fedopt = yaml.safe_load(params.read_text())["train"]["fedopt"] | {"server_optimizer": optimizer}
    strategy = _strategy("fedopt", fedopt=fedopt)
    key = "server_learning_rate" if optimizer == "sgdm" else "eta"
    assert getattr(strategy, key) == inspect.signature(type(strategy)).parameters[key].default


def test_a_strategy_module_registers_a_declared_name_once(monkeypatch):
    """The extension point's guard rails (pipeline/federation/strategies/registry.py): a builder registers under a
    name declared in methods.STRATEGIES, once, and the decorator hands the builder back unchanged."""
    from pipeline.experiments.methods import STRATEGIES, StrategySpec
    from pipeline.federation.strategies.catalog import BUILDERS
    from pipeline.federation.strategies.registry import register_strategy

    def build(settings, common, client_lr):
        return None

    with pytest.raises(ValueError, match=r"strategy 'fedsomething' is not declared in .*methods\.STRATEGIES"):
        register_strategy("fedsomething")(build)
    assert "fedsomething" not in BUILDERS
    with pytest.raises(ValueError, match="strategy 'fedavg' is registered twice"):
        register_strategy("fedavg")(build)
    assert BUILDERS["fedavg"] is not build  # the first registration stands
    monkeypatch.setitem(STRATEGIES, "fedsomething", StrategySpec("fedsomething"))
    monkeypatch.setitem(BUILDERS, "fedsomething", None)  # so that the registration below is undone after the test
    del BUILDERS["fedsomething"]
    assert register_strategy("fedsomething")(build) is build
    assert BUILDERS["fedsomething"] is build
