"""The ClientApp's own rules (pipeline.federation.client_app): which client a node is, where its files go, what
a restarted client resumes from, and the privacy report it composes over its rounds. (The message handlers are
exercised through tests/test_federated.py and tests/test_privacy.py.)

Properties stated: a node is the client its node config names, else the partition's client at its partition id;
a restarted client resumes its local adapter only from a checkpoint of a round it trained, always from the latest
one before the round asked, and gets back its progress and DP-SGD step count; the reported epsilon is the
accountant's epsilon after all the client's steps so far, -1 meaning unbounded.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, Context, MetricRecord, RecordDict

from tests.test_federated import workspace, write_plan, ws  # noqa: F401  (fixtures)

# imported here, not only in the tests: mutmut's fork server imports the test modules once
import pipeline.federation.client_app  # noqa: F401
import pipeline.training.privacy  # noqa: F401


def _context(**node) -> Context:
    return Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config={})


def _plan(name: str = "client-rules"):
    from pipeline.federation.protocol import load_plan

    return load_plan(write_plan(name, "fedselectkd"))


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"layer0.w": torch.full((2, 2), value), "layer0.b": torch.tensor([value])}


# ----------------------------------------------------------------------------------------------- identity, files
def test_a_node_is_the_client_it_names_else_the_partitions_client_at_its_id(ws):
    from pipeline.federation.client_app import client_name

    plan = _plan()
    assert client_name(plan, _context(**{"client-name": "Product", "partition-id": 0})) == "Product"
    # the simulation's partition ids follow the partition file's client order
    assert [client_name(plan, _context(**{"partition-id": i})) for i in range(3)] == [
        "Academic", "Committee", "Product"]
    assert client_name(plan, _context(**{"client-name": "", "partition-id": "2"})) == "Product"
    with pytest.raises(ValueError) as err:
        client_name(plan, _context(plan="x.json"))
    assert str(err.value) == "node_config has neither 'client-name' nor 'partition-id'"


def test_a_deployed_client_may_keep_its_files_elsewhere(ws, tmp_path):
    from pipeline.federation.client_app import client_checkpoint_dir, client_dir

    plan = _plan()
    out = Path(plan.paths["out_dir"])
    assert client_dir(plan, "Product", _context()) == out / "clients" / "Product"
    assert client_checkpoint_dir(plan, "Product", _context()) == out / "checkpoint" / "clients" / "Product"
    node = _context(**{"client-dir": str(tmp_path / "out"), "checkpoint-dir": str(tmp_path / "ckpt")})
    assert client_dir(plan, "Product", node) == tmp_path / "out"
    assert client_checkpoint_dir(plan, "Product", node) == tmp_path / "ckpt"


# ----------------------------------------------------------------------------------------------- resume
def _checkpoints(plan, name: str, context: Context, rounds: dict[int, tuple[float, bool, int | None]]) -> None:
    from pipeline.federation.client_app import client_checkpoint_dir
    from pipeline.training.rounds import write_client_checkpoint

    for rnd, (value, trained, dp_steps) in sorted(rounds.items()):
        write_client_checkpoint(client_checkpoint_dir(plan, name, context), rnd, _state(value),
                                {"best-val-loss": value, "best-round": rnd}, trained, dp_steps)


def test_a_running_client_keeps_its_adapter_from_its_state(ws):
    from pipeline.federation.client_app import LOCAL_STATE_KEY, _restore_client_state

    plan = _plan()
    context = _context(**{"client-name": "Academic"})
    _checkpoints(plan, "Academic", context, {1: (1.0, True, None)})  # an older checkpoint on disk
    context.state[LOCAL_STATE_KEY] = ArrayRecord.from_torch_state_dict(_state(7.0))
    got = _restore_client_state(context, plan, "Academic", 2)
    assert all(torch.equal(got[k], v) for k, v in _state(7.0).items())


def test_a_restarted_client_resumes_from_its_latest_checkpoint_before_the_round(ws, caplog):
    from pipeline.federation.client_app import LOCAL_STATE_KEY, PRIVACY_KEY, PROGRESS_KEY, _restore_client_state

    plan = _plan("client-resume")
    first = _context(**{"client-name": "Committee"})
    _checkpoints(plan, "Committee", first, {2: (2.0, True, 8), 3: (3.0, True, 12)})
    restarted = _context(**{"client-name": "Committee"})
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        got = _restore_client_state(restarted, plan, "Committee", 4)
    assert [r.getMessage() for r in caplog.records if r.name == "fedmeet.federated"] == [
        "client Committee: resumed local adapter from its round-3 checkpoint"]
    assert all(torch.equal(got[k], v) for k, v in _state(3.0).items())
    held = restarted.state[LOCAL_STATE_KEY].to_torch_state_dict()
    assert all(torch.equal(held[k], v) for k, v in _state(3.0).items())  # kept for the next messages
    assert dict(restarted.state[PROGRESS_KEY]) == {"best-val-loss": 3.0, "best-round": 3}
    assert int(restarted.state[PRIVACY_KEY]["steps"]) == 12
    # asked for round 3 (the server resumed after round 2): round 2's checkpoint, not round 3's
    again = _context(**{"client-name": "Committee"})
    got = _restore_client_state(again, plan, "Committee", 3)
    assert float(got["layer0.b"]) == 2.0 and int(again.state[PRIVACY_KEY]["steps"]) == 8


def test_a_client_that_never_trained_resumes_its_progress_but_no_adapter(ws):
    from pipeline.federation.client_app import LOCAL_STATE_KEY, PRIVACY_KEY, PROGRESS_KEY, _restore_client_state

    plan = _plan("client-untrained")
    context = _context(**{"client-name": "Product"})
    assert _restore_client_state(context, plan, "Product", 1) is None and len(context.state) == 0  # nothing yet
    _checkpoints(plan, "Product", context, {1: (5.0, False, None)})
    assert _restore_client_state(context, plan, "Product", 2) is None
    assert LOCAL_STATE_KEY not in context.state and PRIVACY_KEY not in context.state  # no DP steps recorded
    assert dict(context.state[PROGRESS_KEY]) == {"best-val-loss": 5.0, "best-round": 1}


# ----------------------------------------------------------------------------------------------- privacy report
def _result(setting, steps: int, examples: int = 10, clipped: int = 3):
    from pipeline.training.local import LocalTrainResult

    return LocalTrainResult(n_examples=examples, n_steps=steps, n_tokens=0, train_loss=0.0, ce=0.0, kd=0.0,
                            kd_fraction=0.0, proximal=0.0, privacy=setting, dp_examples=examples, dp_clipped=clipped)


def _setting(noise: float, clip: float):
    from pipeline.training.privacy import ClientPrivacy

    return ClientPrivacy(noise_multiplier=noise, max_grad_norm=clip, sample_rate=0.1, logical_batch=4,
                         steps_per_epoch=10, planned_steps=60, delta=1e-5, accountant="rdp", n_examples=40)


def test_the_reported_epsilon_composes_all_the_clients_steps(ws):
    from pipeline.federation.client_app import PRIVACY_KEY, _privacy_metrics
    from pipeline.training.privacy import epsilon

    setting = _setting(1.1, 0.5)
    context = _context()
    first = _privacy_metrics(context, _result(setting, 10, examples=20, clipped=5))
    second = _privacy_metrics(context, _result(setting, 7))
    assert first == {"dp-epsilon": pytest.approx(epsilon(1.1, 0.1, 10, 1e-5, "rdp")), "dp-delta": 1e-5,
                     "dp-noise-multiplier": 1.1, "dp-max-grad-norm": 0.5, "dp-sample-rate": 0.1, "dp-steps": 10,
                     "dp-examples": 20, "dp-clipped": 5}
    assert second["dp-steps"] == 17 and int(context.state[PRIVACY_KEY]["steps"]) == 17
    assert second["dp-epsilon"] == pytest.approx(epsilon(1.1, 0.1, 17, 1e-5, "rdp"))
    assert second["dp-epsilon"] > first["dp-epsilon"]  # composition: more steps, more privacy spent
    assert (second["dp-examples"], second["dp-clipped"]) == (10, 3)  # this round's counts only
    assert all(type(v) in (int, float) for v in second.values())
    assert type(second["dp-steps"]) is int and type(second["dp-clipped"]) is int


def test_no_noise_or_no_clipping_is_reported_as_unbounded(ws):
    from pipeline.federation.client_app import _privacy_metrics

    m = _privacy_metrics(_context(), _result(_setting(0.0, math.inf), 3))
    assert m["dp-epsilon"] == -1.0 and m["dp-max-grad-norm"] == -1.0 and m["dp-noise-multiplier"] == 0.0


def test_a_restarted_client_keeps_composing_from_its_checkpointed_steps(ws):
    from pipeline.federation.client_app import PRIVACY_KEY, _privacy_metrics

    context = _context()
    context.state[PRIVACY_KEY] = MetricRecord({"steps": 30})
    assert _privacy_metrics(context, _result(_setting(1.0, 1.0), 5))["dp-steps"] == 35


def test_a_secure_aggregation_round_trains_with_its_upload_masked(monkeypatch):
    """SecAgg+'s masked-vector stage calls _train_masked: the same round's training, its reply marked for the
    SecAgg+ mod to send only masked (an unmasked reply there would leak the client's adapter update)."""
    from pipeline.federation import client_app

    calls = []
    monkeypatch.setattr(client_app, "train_round",
                        lambda msg, context, masked: calls.append((msg, context, masked)) or "reply")
    msg, context = object(), object()
    assert client_app._train_masked(msg, context) == "reply"
    assert len(calls) == 1 and calls[0][0] is msg and calls[0][1] is context and calls[0][2] is True
