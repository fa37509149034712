"""Client-level DP accounted for the sampling that runs (issue 29 item 5): each client joins a round independently
with probability q (Poisson), the clipped updates are summed over the expected count m = q N (a public
denominator), an empty sample releases the global plus the noise and is counted, and the epsilon recorded equals
opacus' RDP accountant of the Poisson-subsampled Gaussian computed here directly."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from tests.test_client_dp import _client_cfg, _global, _independent_epsilon, _reply
from tests.test_federated import workspace, ws  # noqa: F401  (fixtures)


def _opacus_rdp_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    """opacus' RDP analysis called directly (not through pipeline.privacy)."""
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
    return float(get_privacy_spent(orders=orders, rdp=rdp, delta=delta)[0])


class _Nodes:
    def __init__(self, n: int):
        self.ids = list(range(100, 100 + n))

    def get_node_ids(self):
        return list(self.ids)


def _fixed_wrapper(population: int, sampled: int, noise: float = 0.0):
    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.strategies.catalog import build_strategy
    from pipeline.privacy.accounting import federation_privacy
    from pipeline.privacy.client_dp import ClientLevelDP

    _set_server_identity(1)  # messages are created as the ServerApp's (as tests/test_client_dp.py does)
    cfg = _client_cfg(noise_multiplier=noise, clipping_norm=1.0)
    setting = federation_privacy(cfg, population=population, sampled=sampled, rounds=10)
    inner = build_strategy("fedavg", {}, fraction_train=sampled / population, client_lr=1e-3)
    return ClientLevelDP(inner, SimpleNamespace(privacy=cfg, seed=0), setting), setting


def test_poisson_sample_takes_each_client_independently_with_probability_q():
    from pipeline.privacy.client_dp import poisson_sample

    nodes = list(range(20))
    rng = np.random.default_rng(0)
    draws = [poisson_sample(nodes, 0.25, rng) for _ in range(4000)]
    counts = np.bincount([n for d in draws for n in d], minlength=20) / 4000
    assert np.all(np.abs(counts - 0.25) < 0.03)  # each client about q of the rounds (4000 draws: sd 0.007)
    sizes = np.array([len(d) for d in draws])
    assert abs(sizes.mean() - 5.0) < 0.1 and sizes.min() < 5 < sizes.max()  # the sample size varies
    assert poisson_sample(nodes, 1.0, rng) == nodes and poisson_sample(nodes, 0.0, rng) == []


def test_the_wrapper_configures_the_poisson_sample_and_an_empty_sample_configures_nobody(caplog):
    from flwr.app import ArrayRecord, ConfigRecord

    from pipeline.privacy.client_dp import SAMPLING_STREAM, poisson_sample

    strategy, setting = _fixed_wrapper(population=10, sampled=1)  # q = 0.1: P(empty) = 0.9^10 = 0.35
    assert setting.sample_rate == 0.1 and strategy.strategy.fraction_train == 1.0
    caplog.set_level("INFO", logger="fedmeet.federated")  # an empty round says so in the log
    grid, seen_empty, seen_many = _Nodes(10), False, False
    for rnd in range(1, 30):
        messages = list(strategy.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid))
        expected = poisson_sample(grid.ids, 0.1, np.random.default_rng([strategy.seed, rnd, SAMPLING_STREAM]))
        assert sorted(m.metadata.dst_node_id for m in messages) == expected
        seen_empty |= not messages
        seen_many |= len(messages) > 1
        said = f"round {rnd}: the Poisson sample of clients is empty: nothing to aggregate"
        assert any(r.getMessage() == said for r in caplog.records) == (not messages), rnd
    assert seen_empty and seen_many


def test_the_poisson_sample_follows_the_views_client_order_not_the_node_ids():
    """A SuperLink gives its nodes random ids (new ones after a restart): the server's view lists the nodes in client
    order, and the same (seed, round) must sample the same clients whatever their ids, as the strategies' sampling
    does (test_server_loop::test_sampling_does_not_depend_on_the_node_ids)."""
    from flwr.app import ArrayRecord, ConfigRecord

    strategy, _ = _fixed_wrapper(population=10, sampled=3)
    by_order, by_other_ids = _Nodes(10), _Nodes(10)
    by_other_ids.ids = [300 - i for i in range(10)]  # the same clients in the same order, ids falling
    for rnd in range(1, 30):
        picked = [
            sorted(
                grid.ids.index(m.metadata.dst_node_id)
                for m in strategy.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid)
            )
            for grid in (by_order, by_other_ids)
        ]
        assert picked[0] == picked[1], rnd


def test_the_aggregate_is_the_sum_of_clipped_updates_over_the_expected_count():
    """m = 2 expected, 3 joined: W + (clip(d1) + clip(d2) + clip(d3)) / 2, not their mean (noise 0)."""
    from flwr.app import ArrayRecord, ConfigRecord

    strategy, _ = _fixed_wrapper(population=4, sampled=2)
    g = np.array([1.0, 1.0])
    strategy.configure_train(1, _global(g), ConfigRecord(), _Nodes(4))
    replies = [_reply(g + [3.0, 4.0], 1), _reply(g + [0.3, 0.4], 1), _reply(g + [0.0, 0.5], 1)]
    arrays, _ = strategy.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), g + (np.array([0.6, 0.8]) + [0.3, 0.4] + [0.0, 0.5]) / 2, rtol=1e-6)
    # as many as expected: the plain uniform mean, as before
    strategy.configure_train(2, _global(g), ConfigRecord(), _Nodes(4))
    two, _ = strategy.aggregate_train(2, replies[1:])
    assert isinstance(two, ArrayRecord)
    np.testing.assert_allclose(two["w"].numpy(), (g + [0.3, 0.4] + g + [0.0, 0.5]) / 2, rtol=1e-6)


@pytest.mark.parametrize("population,sampled,z,rounds", [(100, 10, 1.0, 8), (3, 2, 1.5, 5), (30, 30, 2.0, 4)])
def test_the_recorded_epsilon_is_opacus_rdp_of_poisson_sampling_over_every_round(population, sampled, z, rounds):
    """The server's recorded epsilon after round r (empty rounds included) against opacus' RDP analysis called here,
    and against the integer-order formula of Mironov et al. (tests/test_client_dp.py) within its slack."""
    from pipeline.privacy.accounting import federation_privacy
    from pipeline.privacy.client_dp import ClientLevelDP

    cfg = _client_cfg(noise_multiplier=z, clipping_norm=1.0, delta=1e-5)
    server = ClientLevelDP(
        SimpleNamespace(),
        SimpleNamespace(privacy=cfg, seed=0),
        federation_privacy(cfg, population=population, sampled=sampled, rounds=rounds),
    )
    q = sampled / population
    rows = {"a": {"round": rounds, "client": "a"}}
    server.record(rows, {"a": (1, 2.0)}, 1.0)
    eps = rows["a"]["epsilon"]
    assert eps == pytest.approx(_opacus_rdp_epsilon(q, z, rounds, 1e-5), rel=1e-9)
    if q < 1:
        assert eps <= _independent_epsilon(q, z, rounds, 1e-5) + 1e-9  # opacus' conversion is the tighter one
    else:  # no sampling: the Gaussian mechanism's RDP a / (2 z^2) per round, classical conversion
        assert eps <= min(rounds * a / (2 * z * z) + math.log(1e5) / (a - 1) for a in range(2, 64)) + 1e-9
    assert rows["a"]["sample_rate"] == q and rows["a"]["delta"] == 1e-5


def test_a_rounds_rows_carry_the_setting_and_no_epsilon_without_noise():
    """Each row of the round: its clip mark and norm, C, delta, z and q; with z = 0 the accountant's epsilon is inf,
    written as None (JSON has no inf; "no bound")."""
    from pipeline.privacy.accounting import federation_privacy
    from pipeline.privacy.client_dp import ClientLevelDP

    cfg = _client_cfg(noise_multiplier=0.0, clipping_norm=1.0)
    setting = federation_privacy(cfg, population=4, sampled=2, rounds=3)
    server = ClientLevelDP(SimpleNamespace(), SimpleNamespace(privacy=cfg, seed=0), setting)
    rows = {"a": {"round": 2, "client": "a"}, "b": {"round": 2, "client": "b"}}
    server.record(rows, {"a": (1, 2.0), "b": (0, None)}, 1.5)
    same = {"clipping_norm": 1.5, "epsilon": None, "delta": 1e-5, "noise_multiplier": 0.0, "sample_rate": 0.5}
    for client, (mark, norm) in {"a": (1, 2.0), "b": (0, None)}.items():
        expected = same | {"update_clipped": mark, "update_norm": norm}
        assert {k: rows[client][k] for k in expected} == expected, client


def test_the_run_record_names_the_sampling_and_the_accountant_and_counts_empty_rounds(ws):
    from pipeline.federation.protocol import load_plan
    from pipeline.privacy.seam import client_level_summary
    from tests.test_client_dp import _with_privacy
    from tests.test_federated import write_plan

    path = _with_privacy(
        write_plan("cdp-record", "fedavg", rounds=4, fraction_train=0.34),
        {"mode": "client", "noise_multiplier": 1.0, "clipping_norm": 1.0},
    )
    plan = load_plan(path)
    clients = ["Academic", "Committee", "Product"]
    history = []
    for rnd, joined in ((1, ["Academic"]), (2, []), (3, ["Product"]), (4, [])):  # rounds 2 and 4: empty samples
        for c in clients:
            row = {"round": rnd, "client": c, "sampled": int(c in joined), "failed": 0}
            if c in joined:
                row.update({"update_clipped": 0, "clipping_norm": 1.0})
            history.append(row)
    out = client_level_summary(plan, history, {c: {} for c in clients})
    assert (out["sampling"], out["accountant"]) == ("poisson", "rdp")
    assert (out["rounds_accounted"], out["rounds_empty"], out["rounds_released"]) == (4, 2, 2)
    q = 1 / 3  # max(int(3 x 0.34), 1) = 1 expected of 3
    assert out["sample_rate"] == pytest.approx(q) and out["delta"] == 1e-5
    assert out["epsilon"] == pytest.approx(_opacus_rdp_epsilon(q, 1.0, 4, 1e-5), rel=1e-9)  # all 4 rounds
    assert out["epsilon"] > _opacus_rdp_epsilon(q, 1.0, 2, 1e-5) and math.isfinite(out["epsilon"])


def test_an_empty_sample_releases_the_global_plus_the_noise():
    """DP-FedAvg (McMahan et al. 2018, Algorithm 1) adds N(0, (z C / m)^2) to the global every round, whoever
    joined. A global released unchanged after an empty sample tells that the sample was empty, which depends on who
    is in the population: of 3 clients at q = 1/3 the global stays with probability (2/3)^3 = 8/27, of the 2 others
    with (2/3)^2 = 4/9, a ratio of 1.5, while the accountant promises epsilon < ln 1.5 for the round at z = 20."""
    from flwr.app import ConfigRecord

    strategy, setting = _fixed_wrapper(population=3, sampled=1, noise=20.0)
    assert setting.bound_after(1)[0] < math.log(1.5)
    g = np.linspace(-1.0, 1.0, 20000)
    assert strategy.configure_train(1, _global(g), ConfigRecord(), _Nodes(0)) == []  # nobody joins
    arrays, _ = strategy.aggregate_train(1, [])
    assert arrays is not None, "the round released nothing: the unchanged global tells the sample was empty"
    noise = arrays["w"].numpy().astype(np.float64) - g.astype(np.float32)
    assert abs(noise.mean()) < 0.5 and noise.std() == pytest.approx(20.0 * 1.0 / 1, rel=0.03)  # z C / m


def test_under_secagg_an_empty_sample_releases_the_global_plus_the_noise():
    """As in the clear (the test above): SecAgg+ has no sum to unmask when nobody joined (its workflow halts), and
    the server still releases W + N(0, (z C / m)^2), not the global unchanged."""
    from flwr.app import ConfigRecord

    from pipeline.experiments.privacy import SecAggConfig
    from pipeline.federation.server_app import _Round, _train_secure
    from pipeline.privacy.secure_aggregation import SecureAggregator
    from tests.test_server_loop import CLIENT_DP, _secagg_plan

    strategy, _ = _fixed_wrapper(population=3, sampled=1, noise=20.0)
    g = np.linspace(-1.0, 1.0, 20000)
    assert strategy.configure_train(1, _global(g), ConfigRecord(), _Nodes(0)) == []
    grid = SimpleNamespace(run=SimpleNamespace(run_id=1), send_and_receive=lambda messages, timeout=None: [])
    secure = SecureAggregator(SecAggConfig(), 1, 5.0, clipped_bits=True)
    exchange = _Round(grid, strategy, 1, {}, {}, 5.0, client_level=strategy)
    arrays = _train_secure(secure, exchange, [], _secagg_plan(**CLIENT_DP))
    assert arrays is not None, "the round released nothing: the unchanged global tells the sample was empty"
    noise = arrays["w"].numpy().astype(np.float64) - g.astype(np.float32)
    assert noise.std() == pytest.approx(20.0, rel=0.03)  # z C / m


def test_a_failed_reply_is_left_out_and_the_round_still_releases_its_aggregate_and_noise():
    """A round with nothing released tells that a sampled client failed, i.e. that somebody was in the secret
    Poisson sample (as an empty sample would, test above). The failed reply is not aggregated (k counts the others,
    as a client that timed out) and the round releases W + sum of clipped updates / m + N(0, (z C / m)^2)."""
    from flwr.app import ConfigRecord, Error, Message

    def failed():
        return Message(Error(code=0, reason="RuntimeError in client c's train"), reply_to=_reply([0.0], 1))

    strategy, _ = _fixed_wrapper(population=4, sampled=2)  # m = 2, no noise: the sum over m exactly
    g = np.array([1.0, 1.0])
    strategy.configure_train(1, _global(g), ConfigRecord(), _Nodes(4))
    arrays, _ = strategy.aggregate_train(1, [_reply(g + [3.0, 4.0], 1), failed(), _reply(g + [0.3, 0.4], 1)])
    assert arrays is not None, "the round released nothing: that tells a sampled client failed"
    np.testing.assert_allclose(arrays["w"].numpy(), g + (np.array([0.6, 0.8]) + [0.3, 0.4]) / 2, rtol=1e-6)
    strategy, _ = _fixed_wrapper(population=3, sampled=1, noise=20.0)  # m = 1, the noise z C / m = 20
    g, update = np.linspace(-1.0, 1.0, 20000), np.full(20000, 0.005)  # norm 0.71 < C
    strategy.configure_train(1, _global(g), ConfigRecord(), _Nodes(3))
    arrays, _ = strategy.aggregate_train(1, [failed(), _reply(g + update, 1)])
    noise = arrays["w"].numpy().astype(np.float64) - (g + update).astype(np.float32)
    assert abs(noise.mean()) < 0.5 and noise.std() == pytest.approx(20.0, rel=0.03)


def test_a_redone_rounds_noise_is_drawn_from_its_own_stream(tmp_path):
    """A round released once already (then killed) draws its n-th redo's noise from [seed, round, 2, n], not the
    first release's [seed, round] again (the same noise on another sum: the two releases' difference in the clear),
    and counts the release. Round 1 released once, an empty sample, z = C = m = 1: the global plus N(0, 1), drawn
    here from numpy's generator."""
    import json

    from flwr.app import ConfigRecord

    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.strategies.catalog import build_strategy
    from pipeline.privacy.accounting import federation_privacy
    from pipeline.privacy.client_dp import ClientLevelDP

    _set_server_identity(1)
    cfg = _client_cfg(noise_multiplier=1.0, clipping_norm=1.0)
    (releases := tmp_path / "releases.json").write_text('{"1": 1}')
    inner = build_strategy("fedavg", {}, fraction_train=1.0, client_lr=1e-3)
    setting = federation_privacy(cfg, population=3, sampled=1, rounds=2)
    strategy = ClientLevelDP(inner, SimpleNamespace(privacy=cfg, seed=0), setting, releases)
    assert strategy.configure_train(1, _global(np.zeros(5)), ConfigRecord(), _Nodes(0)) == []
    arrays, _ = strategy.aggregate_train(1, [])
    expected = np.random.default_rng([strategy.seed, 1, 2, 1]).normal(0.0, 1.0, 5).astype(np.float32)
    np.testing.assert_array_equal(arrays["w"].numpy(), expected)
    assert json.loads(releases.read_text()) == {"1": 2}
