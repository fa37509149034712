"""The ClientApp's own rules (pipeline.federation.client_app): which client a node is, where its files go, what
a restarted client resumes from, and the privacy report it composes over its rounds. (The message handlers are
exercised through tests/test_federated.py and tests/test_privacy.py.)

Properties stated: a node is the client its node config names, else the partition's client at its partition id;
a restarted client resumes its local adapter only from a checkpoint of a round it trained, always from the latest
one before the round asked, and gets back its progress and DP-SGD step count; a run that starts over resumes nothing
an earlier run left on a client (told at admission, the client removes it), a resumed run each client's own
checkpoint; the reported epsilon is the accountant's epsilon after all the client's steps so far, -1 meaning
unbounded.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, Context, MetricRecord, RecordDict

# imported here, not only in the tests: mutmut's fork server imports the test modules once
import pipeline.federation.client_app  # noqa: F401
import pipeline.privacy.example_dp  # noqa: F401
from tests.errors import logs, names
from tests.test_federated import CLIENT_SETTINGS, workspace, write_plan, ws  # noqa: F401  (fixtures)


def _context(**node) -> Context:
    return Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config={})


def _plan(name: str = "client-rules"):
    from pipeline.federation.protocol import load_plan

    return load_plan(write_plan(name, "fedselectkd"))


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"layer0.w": torch.full((2, 2), value), "layer0.b": torch.tensor([value])}


# ----------------------------------------------------------------------------------------------- identity, files
def test_a_node_is_the_client_it_names(ws):
    from pipeline.federation.client_app import client_name

    assert client_name(_context(**{"client-name": "Product"})) == "Product"
    for context in (_context(plan="x.json"), _context(**{"client-name": ""})):
        with pytest.raises(ValueError) as err:
            client_name(context)
        names(err.value, "node_config", "'client-name'")


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
def _restore_client_state(context: Context, plan, name: str, rnd: int) -> None:
    """client_app._client_round for a message of round ``rnd`` of ``plan`` to client ``name``'s node."""
    from flwr.app import ConfigRecord, Message

    from pipeline.federation.client_app import _client_round
    from pipeline.federation.engines import _set_server_identity

    _set_server_identity(1)  # Flower stamps a message with the run's identity
    config = ConfigRecord({"server-round": rnd, "plan": plan.source})
    msg = Message(RecordDict({"config": config}), dst_node_id=7, message_type="train")
    assert _client_round(msg, context) == (plan, name, rnd)


def _checkpoints(plan, name: str, context: Context, rounds: dict[int, tuple[float, bool, int | None]]) -> None:
    from pipeline.federation.client_app import client_checkpoint_dir, client_dir
    from pipeline.modeling.adapters import adapter_file, save_adapter
    from pipeline.training.checkpoints import write_client_checkpoint

    for rnd, (value, trained, dp_steps) in sorted(rounds.items()):
        final = adapter_file(client_dir(plan, name, context), "final")  # what keep_best_and_final writes
        save_adapter(final, _state(value))
        progress = {"best-val-loss": value, "best-round": rnd}
        write_client_checkpoint(client_checkpoint_dir(plan, name, context), rnd, final, progress, trained, dp_steps)


def test_a_running_client_keeps_its_adapter_from_its_state(ws):
    from pipeline.federation.client_app import LOCAL_STATE_KEY, _local_adapter

    plan = _plan()
    context = _context(**{"client-name": "Academic"})
    _checkpoints(plan, "Academic", context, {1: (1.0, True, None)})  # an older checkpoint on disk
    context.state[LOCAL_STATE_KEY] = ArrayRecord.from_torch_state_dict(_state(7.0))
    _restore_client_state(context, plan, "Academic", 2)
    got = _local_adapter(context)
    assert all(torch.equal(got[k], v) for k, v in _state(7.0).items())


def test_a_restarted_client_resumes_from_its_latest_checkpoint_before_the_round(ws, caplog):
    from pipeline.federation.client_app import LOCAL_STATE_KEY, PROGRESS_KEY, _local_adapter
    from pipeline.privacy.seam import STEPS_KEY as PRIVACY_KEY

    plan = _plan("client-resume")
    first = _context(**{"client-name": "Committee"})
    _checkpoints(plan, "Committee", first, {2: (2.0, True, 8), 3: (3.0, True, 12)})
    restarted = _context(**{"client-name": "Committee"})
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        _restore_client_state(restarted, plan, "Committee", 4)
    got = _local_adapter(restarted)
    logs([r.getMessage() for r in caplog.records if r.name == "fedmeet.federated"], "Committee", "round-3")
    assert all(torch.equal(got[k], v) for k, v in _state(3.0).items())
    held = restarted.state[LOCAL_STATE_KEY].to_torch_state_dict()
    assert all(torch.equal(held[k], v) for k, v in _state(3.0).items())  # kept for the next messages
    assert dict(restarted.state[PROGRESS_KEY]) == {"best-val-loss": 3.0, "best-round": 3}
    assert int(restarted.state[PRIVACY_KEY]["steps"]) == 12
    # asked for round 3 (the server resumed after round 2): round 2's checkpoint, not round 3's
    again = _context(**{"client-name": "Committee"})
    _restore_client_state(again, plan, "Committee", 3)
    assert float(_local_adapter(again)["layer0.b"]) == 2.0 and int(again.state[PRIVACY_KEY]["steps"]) == 8


def test_a_client_that_never_trained_resumes_its_progress_but_no_adapter(ws):
    from pipeline.federation.client_app import LOCAL_STATE_KEY, PROGRESS_KEY, _local_adapter
    from pipeline.privacy.seam import STEPS_KEY as PRIVACY_KEY

    plan = _plan("client-untrained")
    context = _context(**{"client-name": "Product"})
    _restore_client_state(context, plan, "Product", 1)
    assert _local_adapter(context) is None
    assert list(context.state.keys()) == []  # nothing to restore
    _checkpoints(plan, "Product", context, {1: (5.0, False, None)})
    _restore_client_state(context, plan, "Product", 2)
    assert _local_adapter(context) is None
    assert LOCAL_STATE_KEY not in context.state and PRIVACY_KEY not in context.state  # no DP steps recorded
    assert dict(context.state[PROGRESS_KEY]) == {"best-val-loss": 5.0, "best-round": 1}


STEP = {"Academic": 1.0, "Committee": 2.0, "Product": 3.0, "SAMSum": 4.0}  # what a client's training adds


def _stub_training(monkeypatch) -> dict:
    """train_local replaced by a recorder of the adapters a round starts from ((client, round) -> local, teacher)
    that trains by adding STEP[client] to every weight of the local adapter (each round's start, by hand)."""
    from pipeline.federation import client_app
    from pipeline.training.client_training import LocalTrainResult, empty_gate_log

    seen: dict = {}

    def train_local(model, plan, examples, **kwargs):
        local = model.adapter_state("local")
        seen[kwargs["client"], kwargs["rnd"]] = (local, model.adapter_state("global"))
        model.load_adapter_state("local", {k: v + STEP[kwargs["client"]] for k, v in local.items()})
        return LocalTrainResult(len(examples), 1, 5, 1.0, 1.0, 0.0, 0.0, 0.0, gate_log=empty_gate_log())

    monkeypatch.setattr(client_app.local_training, "train_local", train_local)
    return seen


def _run_federation(path: str):
    """The ServerApp's round loop and the ClientApps over the in-process Grid, as a deployment runs them; a new
    Grid per call (a new run: every client's context starts empty, as each SuperNode's does)."""
    from pipeline.experiments.settings import RunSettings
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import InProcessGrid, _set_server_identity
    from pipeline.federation.protocol import load_plan
    from pipeline.federation.server_app import run_server
    from pipeline.training.client_data import client_names
    from tests.test_server_loop import Recorder

    grid = InProcessGrid(client_app, [{"client-name": n, "plan": path} for n in client_names(load_plan(path))])
    _set_server_identity(grid.run.run_id)
    _, history = run_server(grid, path, Recorder(), cache=RunSettings().cache, ckpt=None)
    return grid, history


def test_a_run_that_starts_over_resumes_nothing_an_earlier_run_left_on_a_client(ws, monkeypatch):
    """A deployed client keeps its round checkpoints on its own disk after a run (the server removes only its
    own). A later run of the plan that starts over (no server checkpoint: the run finished or failed, or its
    checkpoint is of other code or inputs) must train every client as a client with no checkpoint folder does:
    its first train round starts from the global it receives, its best round is one of this run, it has taken no
    DP-SGD step. Here the late client SAMSum, admitted at round 2 (train.join.max_round), finds a round-1 checkpoint
    of an earlier run (its local adapter, best validation loss 0, 40 DP-SGD steps; under other code, whose server
    checkpoint this run does not resume, that run admitted it at round 1), and Academic that run's record of the
    DP-SGD steps of its last reply. Before the fix SAMSum trained round 2 from the earlier adapter, reported best
    round 1, and SAMSum and Academic composed 40 steps they never took in this run."""
    import json

    import pipeline.privacy.seam  # noqa: F401  (registers privacy: a DP-SGD step count restored is kept)
    from pipeline.federation.client_app import DP_SENT, client_checkpoint_dir, client_dir
    from pipeline.federation.protocol import load_plan
    from pipeline.modeling.adapters import adapter_file, save_adapter
    from pipeline.training.checkpoints import write_client_checkpoint
    from pipeline.training.privacy_hooks import PRIVACY
    from pipeline.training.shared_model import initial_adapter_state

    path = write_plan("fresh-over-stale", "post_addition", "extreme/seed0", rounds=2, fraction_train=1.0)
    plan = load_plan(path)
    stale = {k: v + 7.0 for k, v in initial_adapter_state(plan).items()}
    earlier = _context()
    final = adapter_file(client_dir(plan, "SAMSum", earlier), "final")
    save_adapter(final, stale)
    progress = {"best-val-loss": 0.0, "best-round": 1}
    write_client_checkpoint(client_checkpoint_dir(plan, "SAMSum", earlier), 1, final, progress, True, 40)
    academic = client_checkpoint_dir(plan, "Academic", earlier)
    academic.mkdir(parents=True)
    (academic / DP_SENT).write_text(json.dumps([2, 40, 50]))

    seen = _stub_training(monkeypatch)
    grid, history = _run_federation(path)
    assert sorted(c for c, r in seen if r == 1) == ["Academic", "Committee", "Product"]
    local, received = seen["SAMSum", 2]
    assert all(torch.equal(local[k], received[k]) for k in received)  # not the earlier run's adapter
    assert all(torch.equal(received[k], seen["Academic", 2][1][k]) for k in received)  # the round's global
    samsum = [r for r in history if r["client"] == "SAMSum"]
    assert [(r["round"], r["best_round"]) for r in samsum] == [(2, 2)]  # its only round of this run
    assert [PRIVACY.dp_steps(c) for c in grid.contexts.values()] == [None] * 4  # no DP in this plan


def test_a_resumed_run_resumes_each_clients_own_checkpoint(ws, monkeypatch):
    """The other side: a run killed after round 1 and run again (new SuperNode contexts) resumes from the server
    checkpoint, and each client's round 2 starts from its own round-1 adapter: the round-0 adapter plus its STEP
    (the server, resuming, does not tell the clients to start over)."""
    from pipeline.federation.protocol import load_plan
    from pipeline.training.shared_model import initial_adapter_state
    from tests.faults import killed_after_checkpoint

    path = write_plan("resumed-own", "fedselectkd", rounds=2, fraction_train=1.0)
    initial = initial_adapter_state(load_plan(path))
    seen = _stub_training(monkeypatch)
    with killed_after_checkpoint(monkeypatch, rnd=1):
        _run_federation(path)
    _run_federation(path)
    for client in ("Academic", "Committee", "Product"):
        local, received = seen[client, 2]
        assert all(torch.equal(local[k], v + STEP[client]) for k, v in initial.items()), client
        assert not torch.equal(local["layer0.down.weight"], received["layer0.down.weight"])  # not the global


def test_a_node_restarted_with_its_node_id_serving_another_plan_trains_and_evaluates_nothing_for_the_run(
    ws, monkeypatch
):
    """docs/federation.md: a SuperNode serving another plan is refused, during the run too, whichever client it names.
    Under --auth a restarted SuperNode keeps its node id (its key), so the server does not identify it again: here
    Academic's node comes back after round 1 serving experiment B's plan (same client, same adapter shapes). Its
    round-2 train and evaluation messages are the run's (A's): it trains and scores nothing of B's for them; the
    round records Academic failed (left out of A's aggregate) and without a validation loss."""
    from pipeline.experiments.settings import RunSettings
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import InProcessGrid, _set_server_identity
    from pipeline.federation.server_app import run_server
    from tests.test_server_loop import Recorder

    path_a, path_b = write_plan("auth-plan-a", "fedavg", rounds=2), write_plan("auth-plan-b", "fedavg", rounds=2)
    grid = InProcessGrid(client_app, [{"client-name": n, "plan": path_a} for n in ("Academic", "Committee", "Product")])
    _set_server_identity(grid.run.run_id)
    academic = next(c for c in grid.contexts.values() if c.node_config["client-name"] == "Academic")

    class Restart(Recorder):
        def round_done(self, plan, entry, history):
            academic.node_config["plan"] = path_b  # restarted between rounds 1 and 2, the same node id

    seen = _stub_training(monkeypatch)
    _, history = run_server(grid, path_a, Restart(), cache=RunSettings().cache, ckpt=None)
    assert ("Academic", 1) in seen and ("Academic", 2) not in seen
    row = next(r for r in history if (r["round"], r["client"]) == (2, "Academic"))
    assert row["failed"] == 1 and "val_loss" not in row


def test_a_node_restarted_with_its_node_id_as_another_client_trains_and_evaluates_nothing_for_its_old_one(
    ws, monkeypatch, caplog
):
    """Under --auth a SuperNode restarted with another client-name keeps its node id, so the run's node map still
    holds it as its old client: here Academic's node comes back after round 1 as 'Committee'. Its round-2 train and
    evaluate replies name Committee: Academic's failure for the round, out of the aggregate (before, Committee's
    training went into the aggregate and the records as Academic's)."""
    from pipeline.experiments.settings import RunSettings
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import InProcessGrid, _set_server_identity
    from pipeline.federation.server_app import run_server
    from tests.test_server_loop import Recorder

    path = write_plan("auth-renamed", "fedavg", rounds=2)
    grid = InProcessGrid(client_app, [{"client-name": n, "plan": path} for n in ("Academic", "Committee", "Product")])
    _set_server_identity(grid.run.run_id)
    node, academic = next((n, c) for n, c in grid.contexts.items() if c.node_config["client-name"] == "Academic")

    class Restart(Recorder):
        def round_done(self, plan, entry, history):
            academic.node_config["client-name"] = "Committee"  # restarted between rounds 1 and 2, the same node id

    _stub_training(monkeypatch)
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        _, history = run_server(grid, path, Restart(), cache=RunSettings().cache, ckpt=None)
    row = next(r for r in history if (r["round"], r["client"]) == (2, "Academic"))
    why = f"node {node} answers as client 'Committee', admitted as 'Academic'"
    assert (row["failed"], row["error"], row["eval_failed"]) == (1, why, 1) and "val_loss" not in row
    assert [r["client"] for r in history if r["round"] == 2 and "weight_share" in r] == ["Committee", "Product"]


# ----------------------------------------------------------------------------------------------- privacy report
def _result(setting, steps: int, examples: int = 10, clipped: int = 3):
    from pipeline.training.client_training import LocalTrainResult

    return LocalTrainResult(
        n_examples=examples,
        n_steps=steps,
        n_tokens=0,
        train_loss=0.0,
        ce=0.0,
        kd=0.0,
        kd_fraction=0.0,
        proximal=0.0,
        privacy=setting,
        dp_examples=examples,
        dp_clipped=clipped,
    )


def _setting(noise: float, clip: float):
    from pipeline.privacy.accounting import ClientPrivacy

    return ClientPrivacy(
        noise_multiplier=noise,
        max_grad_norm=clip,
        sample_rate=0.1,
        logical_batch=4,
        steps_per_epoch=10,
        delta=1e-5,
        accountant="rdp",
    )


def test_the_reported_epsilon_composes_all_the_clients_steps(ws):
    from pipeline.privacy.accounting import bound
    from pipeline.privacy.seam import STEPS_KEY as PRIVACY_KEY
    from pipeline.privacy.seam import account

    setting = _setting(1.1, 0.5)
    context = _context()
    first = account(context, _result(setting, 10, examples=20, clipped=5))
    second = account(context, _result(setting, 7))
    assert first == {
        "dp-epsilon": pytest.approx(bound(1.1, 0.1, 10, 1e-5, "rdp")[0]),
        "dp-delta": 1e-5,
        "dp-noise-multiplier": 1.1,
        "dp-max-grad-norm": 0.5,
        "dp-sample-rate": 0.1,
        "dp-steps": 10,
        "dp-examples": 20,
        "dp-clipped": 5,
    }
    assert second["dp-steps"] == 17 and int(context.state[PRIVACY_KEY]["steps"]) == 17
    assert second["dp-epsilon"] == pytest.approx(bound(1.1, 0.1, 17, 1e-5, "rdp")[0])
    assert second["dp-epsilon"] > first["dp-epsilon"]  # composition: more steps, more privacy spent
    assert (second["dp-examples"], second["dp-clipped"]) == (10, 3)  # this round's counts only
    assert all(type(v) in (int, float) for v in second.values())
    assert type(second["dp-steps"]) is int and type(second["dp-clipped"]) is int


def test_no_noise_or_no_clipping_is_reported_as_unbounded(ws):
    from pipeline.privacy.seam import account

    m = account(_context(), _result(_setting(0.0, math.inf), 3))
    assert m["dp-epsilon"] == -1.0 and m["dp-max-grad-norm"] == -1.0 and m["dp-noise-multiplier"] == 0.0


def test_a_restarted_client_keeps_composing_from_its_checkpointed_steps(ws):
    from pipeline.privacy.seam import STEPS_KEY as PRIVACY_KEY
    from pipeline.privacy.seam import account

    context = _context()
    context.state[PRIVACY_KEY] = MetricRecord({"steps": 30})
    assert account(context, _result(_setting(1.0, 1.0), 5))["dp-steps"] == 35


def test_a_round_without_example_level_dp_reports_and_records_no_privacy(ws):
    from pipeline.privacy.seam import STEPS_KEY, account, dp_steps

    context = _context()
    assert account(context, _result(None, 4)) == {}
    assert STEPS_KEY not in context.state and dp_steps(context) is None  # the checkpoint records none


# ----------------------------------------------------------------------------------------------- one training round
def _train_round(
    monkeypatch,
    name: str,
    method: str,
    *,
    node: dict,
    mu: float | None = None,
    local: dict[str, torch.Tensor] | None = None,
    handler: bool = False,
    n_trained: int = 2,
    edit_plan=None,
    **train,
):
    """One train_round with train_local replaced by a recorder of what it is given: the global the server sent
    is the round-0 adapter + 0.5, so every adapter state can be told apart. ``handler``: the message goes
    through the ClientApp's train handler (its privacy checks, then train_round), else to train_round itself (as
    a SecAgg+ round's masked stage does)."""
    import json

    from flwr.app import ConfigRecord, Message

    from pipeline.federation import client_app
    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.protocol import ARRAYS_KEY, CONFIG_KEY, encode_global, load_plan
    from pipeline.training.client_training import LocalTrainResult, empty_gate_log
    from pipeline.training.shared_model import initial_adapter_state

    _set_server_identity(1)  # Flower stamps a message with the run's identity
    path = write_plan(name, method, **train)
    if edit_plan is not None:
        Path(path).write_text(json.dumps(edit_plan(json.loads(Path(path).read_text())), indent=2, sort_keys=True))
    plan = load_plan(path)
    received = {k: v + 0.5 for k, v in initial_adapter_state(plan).items()}
    seen = {}

    def train_local(model, plan_, examples, **kwargs):
        seen.update(
            kwargs,
            examples=examples,
            local=model.adapter_state("local"),
            teacher=model.adapter_state("global") if plan_.spec.two_adapters else None,
        )
        gate = empty_gate_log()
        return LocalTrainResult(
            n_examples=n_trained,
            n_steps=1,
            n_tokens=5,
            train_loss=1.0,
            ce=1.0,
            kd=0.0,
            kd_fraction=0.0,
            proximal=0.0,
            gate_log=gate,
        )

    monkeypatch.setattr(client_app.local_training, "train_local", train_local)
    context = _context(**node)
    if local is not None:
        context.state[client_app.LOCAL_STATE_KEY] = ArrayRecord.from_torch_state_dict(local)
    config = {"server-round": 2, "plan": path, **CLIENT_SETTINGS} | ({"proximal-mu": mu} if mu is not None else {})
    msg = Message(
        RecordDict(
            {
                ARRAYS_KEY: encode_global(received, plan),
                CONFIG_KEY: ConfigRecord(config),
            }
        ),
        dst_node_id=7,
        message_type="train",
    )
    reply = client_app.client_train(msg, context) if handler else client_app.train_round(msg, context)
    return plan, received, seen, reply, context


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fedprox_pulls_towards_the_global_it_received_with_the_servers_mu_and_no_other_method_does(ws, monkeypatch):
    _, received, seen, _, _ = _train_round(
        monkeypatch, "round-prox", "fedprox", node={"client-name": "Product"}, mu=0.3
    )
    assert seen["proximal_mu"] == pytest.approx(0.3) and _same(seen["proximal_reference"], received)
    _, _, seen, _, _ = _train_round(monkeypatch, "round-prox-none", "fedprox", node={"client-name": "Product"})
    assert seen["proximal_mu"] == 0.0 and seen["proximal_reference"] is None  # no mu sent: plain local training
    _, _, seen, _, _ = _train_round(monkeypatch, "round-avg-mu", "fedavg", node={"client-name": "Product"}, mu=0.3)
    assert seen["proximal_mu"] == 0.0 and seen["proximal_reference"] is None  # FedAvg ignores a stray mu


def test_the_local_adapter_persists_for_kd_methods_and_is_replaced_by_the_global_otherwise(ws, monkeypatch):
    """AdaFedSelectKD keeps its own local adapter between rounds and learns from the global as the teacher;
    local_adapter=reset and AdaFedAvg start each round from the received global."""
    from pipeline.training.shared_model import initial_adapter_state

    own = {k: v - 1.0 for k, v in initial_adapter_state(_plan("round-own-ref")).items()}  # this client's own
    _, received, seen, _, _ = _train_round(
        monkeypatch, "round-keep", "fedselectkd", node={"client-name": "Product"}, local=own
    )
    assert _same(seen["local"], own) and _same(seen["teacher"], received) and seen["client"] == "Product"
    _, received, seen, _, _ = _train_round(
        monkeypatch, "round-reset", "fedselectkd", node={"client-name": "Product"}, local=own, local_adapter="reset"
    )
    assert _same(seen["local"], received) and _same(seen["teacher"], received)
    _, received, seen, _, _ = _train_round(
        monkeypatch, "round-fedavg", "fedavg", node={"client-name": "Academic"}, local=own
    )
    assert _same(seen["local"], received) and seen["teacher"] is None and seen["client"] == "Academic"


def test_the_reply_weight_is_what_trained_unless_weighted_by_the_clients_data_size(ws, monkeypatch):
    """Under a train-size cap the FedAvg weight is the examples trained this round (issue 29 item 6); weight_by
    full makes it the client's full |D_i| (the paper's weight)."""
    from pipeline.training.client_data import client_data

    plan, _, seen, reply, _ = _train_round(
        monkeypatch,
        "round-weight-trained",
        "fedavg",
        node={"client-name": "Committee"},
        n_trained=1,
        max_train_examples_per_client=1,
    )
    assert plan.train.weight_by == "trained"  # the default
    assert reply.content["metrics"]["num-examples"] == 1 and reply.content["metrics"]["num-trained"] == 1
    plan, _, _, reply, _ = _train_round(
        monkeypatch,
        "round-weight-full",
        "fedavg",
        node={"client-name": "Committee"},
        n_trained=1,
        max_train_examples_per_client=1,
        weight_by="full",
    )
    available = client_data(plan, "Committee").n_train_available
    assert available > 1 and reply.content["metrics"]["num-examples"] == available


def test_a_kd_clients_gate_log_stays_on_its_disk_as_a_plain_table_and_it_trains_on_the_prefix_cache(ws, monkeypatch):
    import pyarrow.parquet as pq

    from pipeline.federation.client_app import client_dir
    from pipeline.training.client_training import empty_gate_log

    plan, _, seen, reply, context = _train_round(
        monkeypatch, "round-gate", "fedselectkd", node={"client-name": "Academic"}
    )
    out = client_dir(plan, "Academic", context) / "gate_log" / "round002.parquet"
    assert pq.read_schema(out).names == list(empty_gate_log().columns)  # no index column beside the gate rows
    assert set(reply.content["arrays"].keys()) == set(seen["local"].keys())  # only the adapter leaves
    assert seen["cache"] is not None and seen["cache"].root.name  # the plan's frozen-prefix cache (exact)


def test_a_client_refuses_to_send_its_adapter_in_the_clear_when_the_plan_asks_for_secure_aggregation(ws, monkeypatch):
    def secagg(plan):
        plan["privacy"] = {"mode": "none", "secure_aggregation": True}
        return plan

    with pytest.raises(ValueError) as err:
        _train_round(
            monkeypatch, "round-secagg", "fedavg", node={"client-name": "Product"}, edit_plan=secagg, handler=True
        )
    names(err.value, "round-secagg", "privacy.secure_aggregation")
    _, _, seen, reply, _ = _train_round(
        monkeypatch, "round-secagg-masked", "fedavg", node={"client-name": "Product"}, edit_plan=secagg
    )
    assert seen["client"] == "Product" and "arrays" in reply.content  # the masked path trains as usual
    # without secure aggregation the handler trains the same round in the clear
    _, _, seen, reply, _ = _train_round(
        monkeypatch, "round-plain", "fedavg", node={"client-name": "Product"}, handler=True
    )
    assert seen["client"] == "Product" and "arrays" in reply.content


def test_a_delta_encoded_reply_is_the_local_adapter_minus_the_global_it_received(ws, monkeypatch):
    """train.transfer_delta with a lossy dtype: the reply carries local - received, so the server, which holds
    what it sent, decodes the local adapter to within the int8 step."""
    from pipeline.federation.compression import decode_state
    from pipeline.training.shared_model import initial_adapter_state

    own = {k: v - 1.0 for k, v in initial_adapter_state(_plan("round-delta-ref")).items()}
    plan, received, seen, reply, _ = _train_round(
        monkeypatch,
        "round-delta",
        "fedselectkd",
        node={"client-name": "Product"},
        local=own,
        transfer_dtype="int8",
        transfer_delta=True,
    )
    decoded = decode_state(reply.content["arrays"].to_torch_state_dict(), reference=received)
    for k, v in seen["local"].items():
        step = float((v - received[k]).abs().max()) / 127
        assert torch.allclose(decoded[k], v, atol=step + 1e-6)


def test_told_the_run_starts_over_a_client_removes_an_earlier_runs_files_and_a_resumed_runs_client_keeps_them(
    ws, monkeypatch
):
    """The admission of a run that starts at round 1 tells each client so (START_OVER): it removes what an earlier
    run of the plan left (its gate-log rounds, adapters, round checkpoints, DP-SGD record); the admission of a
    resumed run, or of a restarted node during a run, keeps them, since they are this run's earlier rounds."""
    from flwr.app import ConfigRecord, Message

    from pipeline.federation.client_app import DP_SENT, client_checkpoint_dir, client_dir, client_identify
    from pipeline.federation.protocol import CONFIG_KEY, PLAN_HASH, START_OVER
    from pipeline.modeling.adapters import adapter_file

    plan, _, _, _, context = _train_round(monkeypatch, "gate-per-run", "fedselectkd", node={"client-name": "Academic"})
    _checkpoints(plan, "Academic", context, {1: (0.5, True, None)})
    (client_checkpoint_dir(plan, "Academic", context) / DP_SENT).write_text("[2, 3, 4]")
    out, ckpt = client_dir(plan, "Academic", context), client_checkpoint_dir(plan, "Academic", context)
    files = [out / "gate_log/round002.parquet", adapter_file(out, "final"), ckpt / "round001.json", ckpt / DP_SENT]

    def identify(start_over: bool) -> None:
        hash_ = plan.hash  # the admission's message names the server's plan by its hash too
        config = ConfigRecord(
            {"plan": f"models/plans/{plan.experiment}.json", START_OVER: start_over, PLAN_HASH: hash_}
        )
        client_identify(Message(RecordDict({CONFIG_KEY: config}), dst_node_id=7, message_type="query"), context)

    identify(start_over=False)
    assert all(f.exists() for f in files)
    identify(start_over=True)
    assert [f for f in files if f.exists()] == [] and list(ckpt.iterdir()) == []


def test_a_node_of_another_experiment_told_to_start_over_keeps_its_runs_files(ws, server_identity):
    """A SuperNode of experiment B (its node config names B's plan) stays connected to the SuperLink on which
    experiment A starts over: A's admission asks every connected node, this one too (then refuses it, or fails on two
    nodes claiming one client). It answers with its name and removes nothing of B's run: B's round checkpoints,
    DP-SGD record and adapters, which B resumes from (docs/federation.md: an earlier run *of the plan*)."""
    from flwr.app import ConfigRecord, Message

    from pipeline.federation.client_app import DP_SENT, client_checkpoint_dir, client_dir, client_identify
    from pipeline.federation.protocol import CONFIG_KEY, PLAN_HASH, START_OVER
    from pipeline.modeling.adapters import adapter_file

    plan_a, plan_b = _plan("start-over-a"), _plan("start-over-b")
    context = _context(**{"client-name": "Academic", "plan": f"models/plans/{plan_b.experiment}.json"})
    _checkpoints(plan_b, "Academic", context, {1: (0.5, True, 3)})
    ckpt = client_checkpoint_dir(plan_b, "Academic", context)
    (ckpt / DP_SENT).write_text("[2, 3, 4]")
    files = [adapter_file(client_dir(plan_b, "Academic", context), "final"), ckpt / "round001.json", ckpt / DP_SENT]
    config = ConfigRecord({"plan": f"models/plans/{plan_a.experiment}.json", START_OVER: True, PLAN_HASH: plan_a.hash})
    reply = client_identify(Message(RecordDict({CONFIG_KEY: config}), dst_node_id=7, message_type="query"), context)
    assert reply.content["identity"]["client-name"] == "Academic"
    assert [f for f in files if not f.exists()] == []


def test_a_site_whose_copy_of_the_plan_is_at_another_path_removes_its_earlier_run_when_the_run_starts_over(ws):
    """docs/federation.md: a run that starts over tells each client so at admission, and the client removes what an
    earlier run of the plan left. A site's SuperNode names its own copy of the plan (node config ``plan``: its kit's,
    on another machine or in another layout than the server's run config names), the same settings, the same plan
    hash: told by the admission (identify_clients, start_over), it removes its earlier run's files all the same."""
    import shutil

    from pipeline.federation.admission import identify_clients
    from pipeline.federation.client_app import DP_SENT, client_app, client_checkpoint_dir, client_dir
    from pipeline.federation.engines import InProcessGrid, _set_server_identity
    from pipeline.modeling.adapters import adapter_file

    plan = _plan("start-over-kit")
    server_path = f"models/plans/{plan.experiment}.json"
    site_path = Path("sites/Academic") / server_path  # the site's copy (kit), the same file content
    site_path.parent.mkdir(parents=True)
    shutil.copyfile(server_path, site_path)
    grid = InProcessGrid(client_app, [{"client-name": "Academic", "plan": str(site_path)}])
    _set_server_identity(grid.run.run_id)
    context = grid.contexts[1000]
    _checkpoints(plan, "Academic", context, {1: (0.5, True, 3)})
    ckpt = client_checkpoint_dir(plan, "Academic", context)
    (ckpt / DP_SENT).write_text("[2, 3, 4]")
    files = [adapter_file(client_dir(plan, "Academic", context), "final"), ckpt / "round001.json", ckpt / DP_SENT]
    assert identify_clients(grid, server_path, ["Academic"], timeout=5, start_over=True) == {1000: "Academic"}
    assert [f for f in files if f.exists()] == []


def test_an_evaluate_reply_holds_the_metrics_the_server_reads_and_no_other(ws):
    """An evaluate reply (client_evaluate) is Flower's weight and what the server records of it (server_app._evaluate:
    the validation loss, its tokens and the client's best round), each a number; nothing else leaves the client."""
    from flwr.app import ConfigRecord, Message

    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.protocol import ARRAYS_KEY, CONFIG_KEY, METRICS_KEY, encode_global, load_plan
    from pipeline.training.shared_model import initial_adapter_state

    path = write_plan("client-eval-reply", "fedavg")
    plan = load_plan(path)
    _set_server_identity(1)
    content = {
        ARRAYS_KEY: encode_global(initial_adapter_state(plan), plan),  # fedavg's clients evaluate the global
        CONFIG_KEY: ConfigRecord({"server-round": 1, "plan": path, **CLIENT_SETTINGS}),
    }
    msg = Message(RecordDict(content), dst_node_id=7, message_type="evaluate")
    reply = client_app(message=msg, context=_context(**{"client-name": "Product"}))
    assert not reply.has_error(), reply.error
    metrics = dict(reply.content.metric_records[METRICS_KEY])
    assert sorted(metrics) == ["best-round", "num-examples", "val-loss", "val-tokens"]
    assert metrics["best-round"] == 1 and metrics["num-examples"] > 0 and metrics["val-tokens"] > 0


# ----------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("message_type", ["train", "evaluate"])
def test_a_failing_client_tells_the_server_the_error_class_only_and_its_own_log_the_text(ws, caplog, message_type):
    """docs/privacy.md: what leaves a client on a failure is the exception's class, the client, the message type
    and round; the exception's text (here a DataError naming the partition file, the examples file and a record id)
    and its traceback go to the client's log. The deployed ClientApp as a SuperNode's flwr-clientapp runs it
    (flwr.supernode.runtime.run_clientapp: ``client_app(message=..., context=...)``, whose own error reply would
    carry ``str(exc)``), on a partition naming a record its examples file lacks."""
    import json

    from flwr.app import ConfigRecord, Message
    from flwr.common.constant import ErrorCode

    from pipeline.federation.client_app import client_app  # pipeline.apps' (pyproject.toml's) ClientApp
    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.protocol import ARRAYS_KEY, CONFIG_KEY, encode_global, load_plan
    from pipeline.training.shared_model import initial_adapter_state
    from tests.test_federated import _write_partition

    clients = json.loads(Path("data/partitions/domain/seed0.json").read_text())["clients"]
    clients["Product"]["train"].append("ES2002a.leak-17")
    clients["Product"]["valid"].append("ES2002a.leak-17")
    _write_partition(ws, "leaky", clients)
    path = write_plan("client-error", "fedavg", partition="leaky/seed0")
    plan = load_plan(path)
    _set_server_identity(1)
    content = {
        ARRAYS_KEY: encode_global(initial_adapter_state(plan), plan),
        CONFIG_KEY: ConfigRecord({"server-round": 2, "plan": path, **CLIENT_SETTINGS}),
    }
    msg = Message(RecordDict(content), dst_node_id=7, message_type=message_type)
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        reply = client_app(message=msg, context=_context(**{"client-name": "Product"}))
    assert reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    names(reply.error.reason, "DataError", "Product", message_type, "round 2", "client's log")
    assert not [p for p in ("leak-17", "examples.parquet", "leaky") if p in reply.error.reason]
    errors = [r for r in caplog.records if r.name == "fedmeet.federated" and r.levelno == logging.ERROR]
    logs(
        [r.getMessage() for r in errors if r.exc_info], "Product", "DataError", "'ES2002a.leak-17'", "examples.parquet"
    )


def test_a_delivery_stopped_with_its_set_logs_one_line_not_a_traceback(caplog):
    """When one run of a set fails, every other run's parked deliveries end with SetAborted: the set reports the
    failure once, so each of those is one ERROR line without a traceback, while a client's own error keeps its."""
    from flwr.app import Context, Message

    from pipeline.federation.client_app import errors_stay_on_the_client
    from pipeline.federation.engines import _set_server_identity
    from pipeline.training.set_engine import SetAborted

    _set_server_identity(1)
    context = Context(run_id=1, node_id=7, node_config={"client-name": "Product"}, state=RecordDict(), run_config={})
    for exc in (SetAborted("run a: another run of its set failed; the set stops"), ValueError("bad")):

        def call_next(msg, ctx, exc=exc):
            raise exc

        msg = Message(RecordDict({}), dst_node_id=7, message_type="train")
        with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
            assert errors_stay_on_the_client(msg, context, call_next).has_error()
    aborted, own = [r for r in caplog.records if r.name == "fedmeet.federated" and r.levelno == logging.ERROR]
    assert "SetAborted" in aborted.getMessage() and not aborted.exc_info
    assert "ValueError" in own.getMessage() and own.exc_info is not None
