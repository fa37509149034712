"""The one-file strategy extension, shown on Flower's FedTrimmedAvg (pipeline/federation/strategies/fedtrimmedavg.py):
its aggregate against hand-computed values, its settings in its own plan only, its refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.common.config import ConfigError, load_params

ROOT = Path(__file__).resolve().parents[1]


def _reply(arrays: dict[str, np.ndarray], examples: int):
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    from pipeline.federation.engines import _set_server_identity

    _set_server_identity(1)
    ins = Message(RecordDict(), dst_node_id=7, message_type="train")
    ins.metadata.__dict__["_message_id"] = "m"
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            "metrics": MetricRecord({"num-examples": examples, "num-steps": 1}),
        }
    )
    return Message(content, reply_to=ins)


def _aggregate(beta: float, clients: list[tuple[list[float], int]]) -> np.ndarray:
    from pipeline.federation.strategies.catalog import build_strategy

    strategy = build_strategy("fedtrimmedavg", {"fedtrimmedavg": {"beta": beta}}, fraction_train=1.0, client_lr=1e-3)
    assert type(strategy).__name__ == "FedTrimmedAvg" and strategy.beta == beta
    replies = [_reply({"w": np.array(w, dtype=np.float32)}, n) for w, n in clients]
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays["w"].numpy()


def test_beta_034_of_three_clients_is_the_coordinate_wise_median_whatever_their_sizes():
    # coordinates (1, 2, 7) -> 2, (10, 0, 4) -> 4, (-3, 5, 4) -> 4; the example-weighted mean would be ~(2.0, 0.4, 4.9)
    out = _aggregate(0.34, [([1.0, 10.0, -3.0], 1), ([2.0, 0.0, 5.0], 100), ([7.0, 4.0, 4.0], 1)])
    np.testing.assert_array_equal(out, [2.0, 4.0, 4.0])


def test_beta_02_of_five_clients_cuts_one_reply_from_each_end():
    # per coordinate int(0.2 * 5) = 1 value cut from each end: (0, 1, 2, 3, 100) -> mean(1, 2, 3) = 2;
    # (-50, 4, 4, 7, 10) -> mean(4, 4, 7) = 5
    clients = [([0.0, 10.0], 3), ([100.0, -50.0], 3), ([1.0, 4.0], 3), ([3.0, 4.0], 3), ([2.0, 7.0], 3)]
    np.testing.assert_allclose(_aggregate(0.2, clients), [2.0, 5.0], rtol=1e-6)


def _with_trimmed_experiment(**trimmed) -> dict:
    params = copy.deepcopy(load_params(ROOT / "params.yaml"))
    params["train"]["fedtrimmedavg"] = {**params["train"]["fedtrimmedavg"], **trimmed}
    params["experiments"] = {
        "trimmed": {"method": "fedtrimmedavg", "partition": "domain/seed0", "seed": 0, "study": "server"},
        "avg": {"method": "fedavg", "partition": "domain/seed0", "seed": 0, "study": "main"},
        "prox": {"method": "fedprox", "partition": "domain/seed0", "seed": 0, "study": "server"},
    }
    return params


def test_its_settings_enter_its_own_plan_only(tmp_path):
    from pipeline.experiments.plans import read_plan
    from pipeline.planning import check_params, write_plans

    params = _with_trimmed_experiment()
    plans = {p.stem: json.loads(p.read_text()) for p in write_plans(check_params(params), tmp_path / "a")}
    assert plans["trimmed"]["train"]["fedtrimmedavg"] == {"beta": params["train"]["fedtrimmedavg"]["beta"]}
    assert not {"proximal_mu", "fedopt"} & set(plans["trimmed"]["train"])
    assert "fedtrimmedavg" not in plans["avg"]["train"] and "fedtrimmedavg" not in plans["prox"]["train"]
    assert plans["prox"]["train"]["proximal_mu"] == params["train"]["proximal_mu"]
    plan = read_plan(tmp_path / "a" / "trimmed.json")
    assert plan.spec.strategy == "fedtrimmedavg" and plan.spec.kd_mode == "ce" and not plan.spec.proximal
    assert plan.train.strategy_params == {"fedtrimmedavg": {"beta": params["train"]["fedtrimmedavg"]["beta"]}}
    # another beta changes the fedtrimmedavg plan and no other
    changed = {
        p.stem: p.read_text() for p in write_plans(check_params(_with_trimmed_experiment(beta=0.1)), tmp_path / "b")
    }
    before = {p.stem: p.read_text() for p in (tmp_path / "a").glob("*.json")}
    assert {name for name in before if before[name] != changed[name]} == {"trimmed"}


def test_a_bad_beta_is_refused_naming_the_key():
    from pipeline.planning import declared, resolve_plan

    params = _with_trimmed_experiment(beta=0.5)
    with pytest.raises(ConfigError) as err:
        resolve_plan(declared(params)[0], params)
    # the bad beta is the params file's own train group's (1b060b7: checked, and named, before any entry)
    assert str(err.value).startswith("params.yaml train.fedtrimmedavg.beta=0.5 is out of range")


def test_secure_aggregation_and_client_level_dp_refuse_it():
    from pipeline.experiments.methods import get_method
    from pipeline.experiments.privacy import AVERAGING_STRATEGIES, PrivacyConfig, secure_aggregation_refusal

    assert "fedtrimmedavg" not in AVERAGING_STRATEGIES and {"fedavg", "fedprox"} <= set(AVERAGING_STRATEGIES)
    assert "fedtrimmedavg" in secure_aggregation_refusal(get_method("fedtrimmedavg"), "fp32", PrivacyConfig())
