"""Flower apps (Message API, flwr 1.41) and the engines that run them.

- ``client_app`` (``ClientApp``): ``query.identify`` answers the client's name; ``train`` loads the server's
  weights into the global adapter (AdaFedKD / SelectKD teacher) or into the local one (AdaFedAvg and the server
  algorithm baselines: the average overwrites the client adapter), trains the local adapter on the client's data
  and replies with the local adapter's tensors (ArrayRecord) and counts/metrics (MetricRecord) - nothing else,
  no text, no token ids. The local adapter persists across rounds in ``context.state`` (or is reset to the
  global weights with ``train.local_adapter: reset``). ``evaluate`` measures the validation loss of the
  client's adapter, keeps its best and final adapter and checkpoints the client's state on the client's disk;
  the gate log of section 4 is written there too (it is the client's own data).
- ``run_server`` (the body of ``@server_app.main()``): per round Flower's strategy samples clients
  (``configure_train``), the Grid delivers the messages, the strategy aggregates (``aggregate_train``: FedAvg
  weighted by ``num-examples``, FedProx, FedAvgM/FedAdam/FedYogi, FedNova), all admitted clients evaluate, and
  the server checkpoints (global adapter, round, RNG state, strategy state). A client that raises becomes an
  error reply, which Flower's strategies leave out of the aggregate; the run goes on. A rerun resumes after the
  last checkpointed round.
- FedAvg weights: ``num-examples`` is the client's full train size |D_i| (``train.weight_by: full``, the paper's
  ``|D_i| / |D|``) even when the CPU profile trains on a capped subsample (``max_train_examples_per_client``,
  a compute shortcut: the update is estimated from fewer examples, its weight stays the client's real share);
  ``weight_by: trained`` weights by the examples actually trained on instead.
- Transfer encoding (pipeline.federation.compression, ``train.transfer_dtype`` fp32 | fp16 | int8): the server encodes the
  global once per round and sends the same bytes to every client; the client decodes it, and replies with its
  local adapter encoded; the server decodes every reply to float32 before the strategy aggregates, so Flower's
  strategies and the server state stay full precision. With ``train.transfer_delta`` (lossy encodings only)
  the reply is the difference to the global the client received (both sides hold it bit for bit) and the
  downlink the difference to the round-0 adapter (every node derives it from the seed; a client that skipped
  rounds holds no earlier global): int8 of a LayerNorm weight near 1 would otherwise round with a step ~1/127.
  Bytes up/down are counted on the encoded messages.
- Engines: ``InProcessGrid`` delivers each Message to the same ClientApp object in this process, one client after
  the other (no Ray, no sockets; each node keeps its own Context); ``engine: ray`` runs the same apps in Flower's
  simulation runtime (``flwr.simulation.run_simulation``, Ray actors with ``ray_cpus_per_client`` /
  ``ray_gpus_per_client``). As a real federation the same objects are served by ``flower-superlink`` +
  ``flower-supernode --node-config "client-name='Academic' plan='models/plans/<exp>.json'"`` (see README).
"""
from __future__ import annotations

import copy
import json
import logging
import random
import time
import traceback
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.error import Error
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from pipeline.common import atomic
from pipeline.training import client as client_training
from pipeline.federation.compression import decode_state, encode_state
from pipeline.plan import Plan, plan_hash, read_plan
from pipeline.federation.strategies import NUM_EXAMPLES_KEY, NUM_STEPS_KEY, build_strategy, restore_strategy_state, strategy_state

log = logging.getLogger("fedmeet.federated")

ARRAYS_KEY = "arrays"  # Flower strategies' default ArrayRecord key
CONFIG_KEY = "config"
METRICS_KEY = "metrics"
LOCAL_STATE_KEY = "local-adapter"  # context.state: the client's local adapter (never leaves the client)
PROGRESS_KEY = "progress"  # context.state: best validation loss and its round
PRIVACY_KEY = "privacy"  # context.state: DP-SGD steps taken over all rounds so far (the accountant's history)
DP_STEPS = "dp-steps"  # in a client checkpoint's progress: the same count, so a resumed client keeps composing
TRAINED_FLAG = "trained"  # in a client checkpoint's progress: 0 while the client has not trained yet
IDENTIFY = "query.identify"

# What a train reply's MetricRecord holds: counts and aggregate losses only. NUM_EXAMPLES_KEY is the client's
# FedAvg weight (train.weight_by: its full train size |D_i|, or the examples trained this round); "num-trained"
# is the number of examples it trained on this round (fewer than |D_i| under max_train_examples_per_client).
TRAIN_METRIC_KEYS = (NUM_EXAMPLES_KEY, "num-trained", NUM_STEPS_KEY, "num-tokens", "train-loss", "ce", "kd",
                     "kd-fraction", "proximal")
# Added under privacy.mode example (pipeline.training.privacy): the accountant's epsilon after all the client's steps so far
# (-1 = unbounded), its delta, sigma, C (-1 = no clipping), q, the cumulative steps, and this round's per-example
# gradients and how many of them were clipped.
PRIVACY_METRIC_KEYS = ("dp-epsilon", "dp-delta", "dp-noise-multiplier", "dp-max-grad-norm", "dp-sample-rate",
                       "dp-steps", "dp-examples", "dp-clipped")


def _lossy(plan: Plan) -> bool:
    return plan.train.transfer_dtype != "fp32"


def downlink_reference(plan: Plan) -> dict[str, torch.Tensor] | None:
    """The reference of a delta-encoded downlink: the round-0 adapter, which every node derives from the plan's
    seed on its own (a client that skipped rounds or joins late holds no earlier global, but it holds this)."""
    return client_training.initial_adapter_state(plan) if plan.train.transfer_delta and _lossy(plan) else None


def encode_global(state: dict[str, torch.Tensor], plan: Plan,
                  reference: dict[str, torch.Tensor] | None = None) -> ArrayRecord:
    """Server -> client: the global adapter as it travels (train.transfer_dtype; with train.transfer_delta, as
    the difference to ``reference`` = :func:`downlink_reference`)."""
    return ArrayRecord.from_torch_state_dict(encode_state(state, plan.train.transfer_dtype, reference=reference))


def decode_global(record: ArrayRecord, plan: Plan) -> dict[str, torch.Tensor]:
    """Client side: the float32 global from what the server sent."""
    return decode_state(record.to_torch_state_dict(), reference=downlink_reference(plan))


def encode_reply(local: dict[str, torch.Tensor], plan: Plan, received: dict[str, torch.Tensor]) -> ArrayRecord:
    """Client -> server: the local adapter as it travels; with train.transfer_delta (lossy encodings only: fp32
    is exact) as the difference to the global received this round, so the int8 scale follows the update."""
    reference = received if plan.train.transfer_delta and _lossy(plan) else None
    return ArrayRecord.from_torch_state_dict(encode_state(local, plan.train.transfer_dtype, reference=reference))


def decode_reply(record: ArrayRecord, plan: Plan, sent: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Server side: the float32 local adapter of a reply; ``sent`` = the decoded global of this round (what the
    client decoded too, bit for bit: the same bytes through the same function)."""
    reference = sent if plan.train.transfer_delta and _lossy(plan) else None
    return decode_state(record.to_torch_state_dict(), reference=reference)


# ================================================================================================ client side
@lru_cache(maxsize=8)
def _plan_cached(path: str, mtime: float) -> Plan:
    return read_plan(path)


def _plan_path(msg: Message | None, context: Context) -> str:
    for source in (context.node_config, context.run_config):
        if source.get("plan"):
            return str(source["plan"])
    if msg is not None and CONFIG_KEY in msg.content and msg.content[CONFIG_KEY].get("plan"):
        return str(msg.content[CONFIG_KEY]["plan"])
    raise ValueError("no plan: set node_config 'plan', run_config 'plan', or send it in the message config")


def _load_plan(path: str) -> Plan:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: plan file not found")
    return _plan_cached(str(p.resolve()), p.stat().st_mtime)


def client_name(plan: Plan, context: Context) -> str:
    """``node_config['client-name']`` (real federation, in-process engine) or the simulation's partition id."""
    if context.node_config.get("client-name"):
        return str(context.node_config["client-name"])
    if "partition-id" in context.node_config:
        names = client_training.client_names(plan)
        return names[int(context.node_config["partition-id"])]
    raise ValueError("node_config has neither 'client-name' nor 'partition-id'")


def client_dir(plan: Plan, name: str, context: Context) -> Path:
    return Path(context.node_config.get("client-dir") or Path(plan.paths["out_dir"]) / "clients" / name)


def client_checkpoint_dir(plan: Plan, name: str, context: Context) -> Path:
    return Path(context.node_config.get("checkpoint-dir")
                or Path(plan.paths["out_dir"]) / "checkpoint" / "clients" / name)


def _checkpoint_rounds(ckpt: Path) -> list[int]:
    return sorted(int(p.stem[len("round"):]) for p in ckpt.glob("round*.safetensors"))


def _restore_client_state(context: Context, plan: Plan, name: str, rnd: int) -> dict[str, torch.Tensor] | None:
    """The local adapter: from context.state, else (a resumed run) from the latest checkpoint before ``rnd``;
    None while the client has not trained yet (its first train round then starts from the current global)."""
    if LOCAL_STATE_KEY in context.state:
        return context.state[LOCAL_STATE_KEY].to_torch_state_dict()
    ckpt = client_checkpoint_dir(plan, name, context)
    earlier = [r for r in _checkpoint_rounds(ckpt) if r < rnd]
    if not earlier:
        return None
    last = earlier[-1]
    progress = json.loads((ckpt / f"round{last:03d}.json").read_text())
    trained = bool(progress.pop(TRAINED_FLAG, 1))
    if DP_STEPS in progress:
        context.state[PRIVACY_KEY] = MetricRecord({"steps": int(progress.pop(DP_STEPS))})
    context.state[PROGRESS_KEY] = MetricRecord(progress)
    if not trained:
        return None
    state = client_training.load_adapter(ckpt / f"round{last:03d}.safetensors")
    context.state[LOCAL_STATE_KEY] = ArrayRecord.from_torch_state_dict(state)
    log.info("client %s: resumed local adapter from its round-%d checkpoint", name, last)
    return state


client_app = ClientApp()


@client_app.query("identify")
def client_identify(msg: Message, context: Context) -> Message:
    plan = _load_plan(_plan_path(msg, context))
    return Message(RecordDict({"identity": ConfigRecord({"client-name": client_name(plan, context)})}), reply_to=msg)


@client_app.train()
def client_train(msg: Message, context: Context) -> Message:
    plan = _load_plan(_plan_path(msg, context))
    spec = plan.spec
    name = client_name(plan, context)
    config = msg.content[CONFIG_KEY]
    rnd = int(config["server-round"])
    received = decode_global(msg.content[ARRAYS_KEY], plan)
    model = client_training.shared_model(plan)

    local = _restore_client_state(context, plan, name, rnd)
    if spec.local_from_global or plan.train.local_adapter == "reset" or local is None:
        local = received  # AdaFedAvg: the average overwrites the client adapter; first round: start from it
    model.load_adapter_state("local", local)
    if spec.two_adapters:
        model.load_adapter_state("global", received)  # the teacher: the server's aggregate, never trained

    data = client_training.client_data(plan, name)
    mu = float(config.get("proximal-mu", 0.0)) if spec.proximal else 0.0
    result = client_training.train_local(
        model, plan, data.train, client=name, rnd=rnd,
        proximal_reference=received if mu > 0 else None, proximal_mu=mu,
        cache=client_training.prefix_cache_for(plan, model),
        progress=True,  # a full-data round takes minutes: show the client's batches (the bar clears itself)
    )
    new_local = model.adapter_state("local")
    context.state[LOCAL_STATE_KEY] = ArrayRecord.from_torch_state_dict(new_local)
    if spec.two_adapters:  # the gate log stays on the client's disk
        out = client_dir(plan, name, context) / "gate_log" / f"round{rnd:03d}.parquet"
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic.to_parquet(result.gate_log, out, index=False)

    # FedAvg's |D_i| is the client's data size; the CPU profile's cap (max_train_examples_per_client) only
    # shortens the local computation, so by default the weight stays the full size (train.weight_by).
    weight = data.n_train_available if plan.train.weight_by == "full" else result.n_examples
    metrics = MetricRecord({
        NUM_EXAMPLES_KEY: int(weight),
        "num-trained": int(result.n_examples),
        NUM_STEPS_KEY: int(result.n_steps),
        "num-tokens": int(result.n_tokens),
        "train-loss": float(result.train_loss),
        "ce": float(result.ce),
        "kd": float(result.kd),
        "kd-fraction": float(result.kd_fraction),
        "proximal": float(result.proximal),
    })
    if result.privacy is not None:
        metrics.update(_privacy_metrics(context, result))
    content = RecordDict({ARRAYS_KEY: encode_reply(new_local, plan, received), METRICS_KEY: metrics})
    return Message(content, reply_to=msg)


def _privacy_metrics(context: Context, result: client_training.LocalTrainResult) -> dict[str, float | int]:
    """Compose this round's DP-SGD steps with the client's earlier ones (context.state) and report the
    accountant's (epsilon, delta) so far, the setting, and the clipped per-example gradients of this round."""
    setting = result.privacy
    before = int(context.state[PRIVACY_KEY]["steps"]) if PRIVACY_KEY in context.state else 0
    total = before + int(result.n_steps)
    context.state[PRIVACY_KEY] = MetricRecord({"steps": total})
    eps = setting.epsilon(total)
    return {
        "dp-epsilon": float(eps) if eps != float("inf") else -1.0,  # -1: no bound (noise multiplier 0)
        "dp-delta": float(setting.delta),
        "dp-noise-multiplier": float(setting.noise_multiplier),
        "dp-max-grad-norm": float(setting.max_grad_norm) if setting.max_grad_norm != float("inf") else -1.0,
        "dp-sample-rate": float(setting.sample_rate),
        "dp-steps": int(total),
        "dp-examples": int(result.dp_examples),
        "dp-clipped": int(result.dp_clipped),
    }


@client_app.evaluate()
def client_evaluate(msg: Message, context: Context) -> Message:
    plan = _load_plan(_plan_path(msg, context))
    spec = plan.spec
    name = client_name(plan, context)
    rnd = int(msg.content[CONFIG_KEY]["server-round"])
    model = client_training.shared_model(plan)
    received = msg.content[ARRAYS_KEY] if ARRAYS_KEY in msg.content else ArrayRecord()

    local = _restore_client_state(context, plan, name, rnd)
    if spec.local_from_global:
        if len(received) == 0:
            raise ValueError(f"client {name}: method {spec.name} evaluates the global adapter but none was sent")
        local = decode_global(received, plan)
    # A client not sampled yet has no local adapter: it is scored with the round-0 adapter, which is NOT kept as
    # its state, so its first train round starts from the global of that round (as a joining client does).
    trained = local is not None
    if not trained:
        local = client_training.initial_adapter_state(plan)
    model.load_adapter_state("local", local)

    data = client_training.client_data(plan, name)
    if len(data.valid) == 0:
        raise ValueError(f"{plan.paths['partition']}: client {name!r} has no valid examples: no best round")
    val_loss, val_tokens = client_training.validation_loss(
        model, plan, data.valid, cache=client_training.prefix_cache_for(plan, model))

    progress = dict(context.state[PROGRESS_KEY]) if PROGRESS_KEY in context.state else {
        "best-val-loss": float("inf"), "best-round": 0}
    out = client_dir(plan, name, context)
    meta = {"experiment": plan.experiment, "client": name, "round": str(rnd), "val_loss": f"{val_loss:.6f}"}
    is_best = val_loss < progress["best-val-loss"]
    if is_best:
        progress = {"best-val-loss": float(val_loss), "best-round": rnd}
        client_training.save_adapter(out / "adapter_best.safetensors", local, meta)
    client_training.save_adapter(out / "adapter_final.safetensors", local, meta)
    if trained:
        context.state[LOCAL_STATE_KEY] = ArrayRecord.from_torch_state_dict(local)
    context.state[PROGRESS_KEY] = MetricRecord(progress)

    # Client-side checkpoint of this round (its adapter and progress); keep the previous one until the server's
    # checkpoint of this round exists, so a kill in between still finds a consistent state.
    ckpt = client_checkpoint_dir(plan, name, context)
    client_training.save_adapter(ckpt / f"round{rnd:03d}.safetensors", local)
    dp_steps = {DP_STEPS: int(context.state[PRIVACY_KEY]["steps"])} if PRIVACY_KEY in context.state else {}
    atomic.write_text(ckpt / f"round{rnd:03d}.json", json.dumps({**progress, TRAINED_FLAG: int(trained), **dp_steps}))
    for old in _checkpoint_rounds(ckpt):
        if old < rnd - 1 or old > rnd:
            (ckpt / f"round{old:03d}.safetensors").unlink(missing_ok=True)
            (ckpt / f"round{old:03d}.json").unlink(missing_ok=True)

    metrics = MetricRecord({
        NUM_EXAMPLES_KEY: len(data.valid),
        "val-loss": float(val_loss),
        "val-tokens": int(val_tokens),
        "best-round": int(progress["best-round"]),
        "is-best": int(is_best),
    })
    return Message(RecordDict({METRICS_KEY: metrics}), reply_to=msg)


@client_app.query("summarize")
def client_summarize(msg: Message, context: Context) -> Message:
    """Federated evaluation: ROUGE of the client's own adapter on its own test set (pipeline.federation.deployment)."""
    from pipeline.federation.deployment import summarize_test_set

    return summarize_test_set(msg, context)


# ================================================================================================ server side
@dataclass
class RoundLog:
    """What the server saw of one round (per client rows; no client data)."""

    round: int
    seconds: float
    rows: list[dict[str, Any]]
    aggregated: bool


class Recorder:
    """Receives each finished round (rounds.json, MLflow...). The base class only logs."""

    def started(self, plan: Plan, clients: list[str], start_round: int) -> None:
        log.info("%s: %d clients %s, rounds %d..%d", plan.experiment, len(clients), clients, start_round,
                 plan.train.rounds)

    def round_done(self, plan: Plan, entry: RoundLog, history: list[dict[str, Any]]) -> None:
        losses = ", ".join(f"{r['client']} {r.get('val_loss', float('nan')):.4f}" for r in entry.rows)
        log.info("%s round %d (%.1fs): val loss %s", plan.experiment, entry.round, entry.seconds, losses)


def server_checkpoint_path(plan: Plan) -> Path:
    return Path(plan.paths["out_dir"]) / "checkpoint" / "server.pt"


def save_server_checkpoint(plan: Plan, rnd: int, arrays: ArrayRecord, strategy, history: list[dict]) -> None:
    path = server_checkpoint_path(plan)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "plan_hash": plan_hash(plan),
        "round": rnd,
        "arrays": {k: a.numpy() for k, a in arrays.items()},
        "strategy_state": strategy_state(strategy),
        "history": history,
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
    }
    atomic.torch_save(state, path)


def load_server_checkpoint(plan: Plan) -> dict[str, Any] | None:
    path = server_checkpoint_path(plan)
    if not path.exists():
        return None
    state = torch.load(path, weights_only=False)  # our own file, written by save_server_checkpoint
    if state.get("plan_hash") != plan_hash(plan):
        log.warning("%s: checkpoint belongs to another configuration; starting over", path)
        return None
    return state


class _NodeSubsetGrid(Grid):
    """A view of a Grid that shows the strategy only the admitted nodes (a new client joins at its round)."""

    def __init__(self, grid: Grid, node_ids: list[int]):
        self._grid = grid
        self._node_ids = list(node_ids)

    def set_run(self, run: Run) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Run:
        return self._grid.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._node_ids)

    def push_messages(self, messages):
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids):
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages, *, timeout=None):
        return self._grid.send_and_receive(messages, timeout=timeout)


def _identify(grid: Grid, plan_path: str, expected: int, timeout: float) -> dict[int, str]:
    """Ask every node for its client name (after waiting for ``expected`` nodes to connect, as SuperNodes
    and simulated nodes register asynchronously)."""
    deadline = time.monotonic() + timeout
    while len(node_ids := list(grid.get_node_ids())) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(node_ids)} of {expected} clients connected within {timeout:.0f}s")
        log.info("waiting for clients: %d of %d connected", len(node_ids), expected)
        time.sleep(1.0)
    names, failed = _ask_names(grid, plan_path, node_ids, timeout)
    if failed:
        node, reason = next(iter(failed.items()))
        raise RuntimeError(f"node {node} failed to identify: {reason}")
    if len(set(names.values())) != len(names):
        raise RuntimeError(f"two nodes claim the same client name: {names}")
    return names


def _ask_names(grid: Grid, plan_path: str, node_ids: list[int], timeout: float) -> tuple[dict[int, str],
                                                                                           dict[int, str]]:
    msgs = [Message(RecordDict({CONFIG_KEY: ConfigRecord({"plan": plan_path})}), dst_node_id=n,
                    message_type=IDENTIFY) for n in node_ids]
    names: dict[int, str] = {}
    failed: dict[int, str] = {}
    for reply in grid.send_and_receive(msgs, timeout=timeout):
        if reply.has_error():
            failed[reply.metadata.src_node_id] = reply.error.reason
        else:
            names[reply.metadata.src_node_id] = str(reply.content["identity"]["client-name"])
    return names, failed


def _connected_nodes(grid: Grid, plan_path: str, node_names: dict[int, str], timeout: float) -> dict[int, str]:
    """The known clients connected now. A node id not seen before is identified: a restarted SuperNode (a new
    id, unless SuperNode authentication keeps its key's id) takes its client's place from this round on;
    ``node_names`` is updated in place."""
    current = set(grid.get_node_ids())
    new = sorted(current - set(node_names))
    if new:
        names, failed = _ask_names(grid, plan_path, new, timeout)
        for node, reason in failed.items():
            log.warning("node %d connected but failed to identify; left out: %s", node, reason.splitlines()[0])
        known = set(node_names.values())
        for node, name in names.items():
            if name not in known:
                log.warning("node %d claims client %r, which is not in the plan; left out", node, name)
                continue
            for old in [o for o, n in node_names.items() if n == name]:
                del node_names[old]
            node_names[node] = name
            log.info("client %s (re)joined as node %d", name, node)
    return {n: c for n, c in node_names.items() if n in current}


def _senders(sent: list[Message], node_names: dict[int, str]):
    """reply -> client name. A SuperLink answers for an offline node itself (ErrorCode.NODE_UNAVAILABLE, sent from
    the SuperLink's id): such a reply is matched to the message it answers."""
    by_message = {m.metadata.message_id: node_names[m.metadata.dst_node_id] for m in sent}

    def sender(reply: Message) -> str:
        if reply.metadata.src_node_id in node_names:
            return node_names[reply.metadata.src_node_id]
        return by_message[reply.metadata.reply_to_message_id]

    return sender


def _payload_bytes(content: RecordDict) -> int:
    return sum(rec.count_bytes() for rec in content.array_records.values())


def run_server(grid: Grid, plan: Plan, plan_path: str, recorder: Recorder | None = None) -> tuple[ArrayRecord, list]:
    """The federated training loop of one experiment (the ServerApp's main)."""
    recorder = recorder or Recorder()
    spec = plan.spec
    t = plan.train
    if not spec.federated:
        raise ValueError(f"method {spec.name!r} is not federated")

    expected = len(client_training.client_names(plan))
    node_names = _identify(grid, plan_path, expected, t.round_timeout_s)
    clients = sorted(node_names.values())
    late = t.new_client if spec.new_client == "post" else None
    if late is not None and late not in clients:
        raise ValueError(f"{plan.paths['partition']}: new client {late!r} (train.new_client) is not among the "
                         f"clients {clients}")

    strategy = build_strategy(spec.strategy, fraction_train=t.fraction_train,
                              proximal_mu=t.proximal_mu, fedopt=t.fedopt, client_lr=t.lr)
    ckpt = load_server_checkpoint(plan)
    if ckpt is not None:
        start = int(ckpt["round"]) + 1
        arrays = ArrayRecord({k: _array(v) for k, v in ckpt["arrays"].items()})
        restore_strategy_state(strategy, ckpt["strategy_state"])
        history = list(ckpt["history"])
        random.setstate(ckpt["rng"]["python"])
        np.random.set_state(ckpt["rng"]["numpy"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        log.info("%s: resuming after round %d", plan.experiment, start - 1)
    else:
        start = 1
        arrays = ArrayRecord.from_torch_state_dict(client_training.initial_adapter_state(plan))
        history = []
    recorder.started(plan, clients, start)
    initial = downlink_reference(plan)
    # The round the late client joined, if it has (a resumed run reads it from the restored history).
    joined_at = min((r["round"] for r in history if r["client"] == late), default=None)

    for rnd in range(start, t.rounds + 1):
        t0 = time.perf_counter()
        if late is not None and joined_at is None and new_client_joins(rnd, history, late, t.join):
            joined_at = rnd
            log.info("%s: round %d: the existing clients have converged (or max_round): %s joins", plan.experiment,
                     rnd, late)
        connected = _connected_nodes(grid, plan_path, node_names, t.round_timeout_s)
        admitted = [n for n, c in connected.items() if c != late or joined_at is not None]
        view = _NodeSubsetGrid(grid, sorted(admitted))
        # Flower samples with the `random` module: seed it per round so sampling is reproducible and resumable.
        random.seed(client_training.derived_seed(plan.seed, rnd, "sampling"))
        messages = list(strategy.configure_train(rnd, arrays, ConfigRecord({"plan": plan_path}), view))
        # The strategy keeps the exact global (FedOpt/FedNova take their update relative to it); the wire carries
        # it encoded once (train.transfer_dtype), and `sent` is what every client decodes from it - the
        # reference of the clients' delta-encoded replies.
        downlink = encode_global(arrays.to_torch_state_dict(), plan, reference=initial)
        sent = decode_state(downlink.to_torch_state_dict(), reference=initial)  # = the clients' decode_global
        for m in messages:
            m.content[ARRAYS_KEY] = downlink
        rows = {node_names[m.metadata.dst_node_id]: {
            "round": rnd, "client": node_names[m.metadata.dst_node_id], "sampled": 1, "failed": 0,
            "bytes_down": _payload_bytes(m.content), "bytes_up": 0} for m in messages}
        for n in admitted:
            rows.setdefault(node_names[n], {"round": rnd, "client": node_names[n], "sampled": 0, "failed": 0,
                                            "bytes_down": 0, "bytes_up": 0})
        for name in sorted(set(clients) - set(connected.values()) - ({late} if joined_at is None else set())):
            # a client whose SuperNode is gone (Flower marked it offline): recorded, not waited for
            rows[name] = {"round": rnd, "client": name, "sampled": 0, "failed": 0, "absent": 1,
                          "bytes_down": 0, "bytes_up": 0}
        replies = list(grid.send_and_receive(messages, timeout=t.round_timeout_s))
        sender = _senders(messages, node_names)
        undecodable: set[int] = set()
        for reply in replies:
            row = rows[sender(reply)]
            if reply.has_error():
                row["failed"] = 1
                row["error"] = reply.error.reason.splitlines()[0] if reply.error.reason else f"code {reply.error.code}"
                log.warning("round %d: client %s failed and is left out of the aggregate: %s", rnd, row["client"],
                            reply.error.reason)
                continue
            row["bytes_up"] = _payload_bytes(reply.content)  # as encoded on the wire
            # The strategy aggregates float32 states: decode the reply in place (a delta against `sent`).
            try:
                reply.content[ARRAYS_KEY] = ArrayRecord.from_torch_state_dict(
                    decode_reply(reply.content[ARRAYS_KEY], plan, sent))
            except (KeyError, ValueError) as exc:
                row["failed"] = 1
                undecodable.add(id(reply))
                log.warning("round %d: reply of client %s cannot be decoded and is left out of the aggregate: %s",
                            rnd, row["client"], exc)
                continue
            m = reply.content[METRICS_KEY]
            row.update({
                "weight": int(m[NUM_EXAMPLES_KEY]), "n_examples": int(m["num-trained"]),
                "n_steps": int(m[NUM_STEPS_KEY]),
                "n_tokens": int(m["num-tokens"]), "train_loss": float(m["train-loss"]), "ce": float(m["ce"]),
                "kd": float(m["kd"]), "kd_fraction": float(m["kd-fraction"]), "proximal": float(m["proximal"]),
            })
            if "dp-epsilon" in m:
                row.update(privacy_row(m))
        answered = {sender(r) for r in replies}
        for name, row in rows.items():
            if row["sampled"] and name not in answered:
                row["failed"] = 1
                row["error"] = f"no reply within {t.round_timeout_s:.0f}s (train.round_timeout_s)"
                log.warning("round %d: no reply from client %s within the timeout", rnd, name)

        # Each aggregated client's share of the FedAvg weight this round (|D_i| / |D| over the good replies).
        total_weight = sum(r["weight"] for r in rows.values() if r["sampled"] and not r["failed"] and "weight" in r)
        for r in rows.values():
            if r["sampled"] and not r["failed"] and "weight" in r:
                r["weight_share"] = r["weight"] / total_weight
        new_arrays, _ = strategy.aggregate_train(rnd, [r for r in replies if id(r) not in undecodable])
        aggregated = new_arrays is not None
        if aggregated:
            arrays = new_arrays
        else:
            log.warning("round %d: no client update; the global adapter stays as it was", rnd)

        # Every admitted client evaluates (its best round is chosen on its own valid set). Only AdaFedAvg-style
        # methods evaluate the global adapter itself; the others evaluate their local adapter: nothing to send.
        eval_arrays = arrays if spec.local_from_global else ArrayRecord()
        eval_messages = list(strategy.configure_evaluate(rnd, eval_arrays, ConfigRecord({"plan": plan_path}), view))
        if spec.local_from_global and eval_messages:
            eval_downlink = encode_global(arrays.to_torch_state_dict(), plan, reference=initial)
            for m in eval_messages:
                m.content[ARRAYS_KEY] = eval_downlink
        for m in eval_messages:
            rows[node_names[m.metadata.dst_node_id]]["bytes_down"] += _payload_bytes(m.content)
        eval_replies = list(grid.send_and_receive(eval_messages, timeout=t.round_timeout_s))
        eval_sender = _senders(eval_messages, node_names)
        for reply in eval_replies:
            row = rows[eval_sender(reply)]
            if reply.has_error():
                row["eval_failed"] = 1
                log.warning("round %d: client %s failed to evaluate: %s", rnd, row["client"], reply.error.reason)
                continue
            m = reply.content[METRICS_KEY]
            row.update({"val_loss": float(m["val-loss"]), "val_tokens": int(m["val-tokens"]),
                        "best_round": int(m["best-round"])})
        if eval_replies and any(not r.has_error() for r in eval_replies):
            strategy.aggregate_evaluate(rnd, eval_replies)

        round_rows = [rows[c] for c in sorted(rows)]
        history.extend(round_rows)
        save_server_checkpoint(plan, rnd, arrays, strategy, history)
        recorder.round_done(plan, RoundLog(rnd, time.perf_counter() - t0, round_rows, aggregated), history)
    return arrays, history


def privacy_row(m: MetricRecord) -> dict[str, Any]:
    """A train reply's DP-SGD report as a history row's fields (-1 on the wire = unbounded: None here)."""
    def bounded(key: str) -> float | None:
        return None if float(m[key]) < 0 else float(m[key])

    examples, clipped = int(m["dp-examples"]), int(m["dp-clipped"])
    return {"epsilon": bounded("dp-epsilon"), "delta": float(m["dp-delta"]),
            "noise_multiplier": float(m["dp-noise-multiplier"]), "max_grad_norm": bounded("dp-max-grad-norm"),
            "sample_rate": float(m["dp-sample-rate"]), "dp_steps": int(m["dp-steps"]), "dp_examples": examples,
            "dp_clipped": clipped, "clipped_fraction": clipped / examples if examples else 0.0}


def new_client_joins(rnd: int, history: list[dict[str, Any]], late: str, join) -> bool:
    """Whether the late client is admitted in round ``rnd``, from the rounds before it (train.join): at
    ``join.max_round`` at the latest, earlier once the other clients' mean validation loss improved by less than
    ``join.min_rel_improvement`` of the best earlier round in each of the last ``join.patience`` rounds."""
    if rnd >= join.max_round:
        return True
    by_round: dict[int, list[float]] = {}
    for row in history:
        if row["round"] < rnd and row["client"] != late and "val_loss" in row:
            by_round.setdefault(int(row["round"]), []).append(float(row["val_loss"]))
    means = [float(np.mean(by_round[r])) for r in sorted(by_round)]
    if len(means) < join.patience + 1:
        return False  # a round's improvement needs an earlier round to compare with
    improvements = []
    for i in range(1, len(means)):
        best_before = min(means[:i])
        improvements.append((best_before - means[i]) / abs(best_before) if best_before else 0.0)
    return all(imp < join.min_rel_improvement for imp in improvements[-join.patience:])


def _array(value: np.ndarray):
    from flwr.app import Array

    return Array(np.asarray(value))


def make_server_app(plan_path: str, recorder: Recorder | None = None, result: dict | None = None) -> ServerApp:
    """A ServerApp bound to one plan (engines); ``result`` receives the final arrays and history."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        arrays, history = run_server(grid, _load_plan(plan_path), plan_path, recorder)
        if result is not None:
            result.update(arrays=arrays, history=history)

    return app


# The ServerApp `flwr run` / a SuperLink loads: the plan comes from the run config
# (`[tool.flwr.app.config] plan = "models/plans/<exp>.json"` or `flwr run . --run-config "plan='...'"`).
server_app = ServerApp()


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
    # Records what the train stage records (rounds, metrics, MLflow, global adapter) and evaluates on the
    # clients (pipeline.federation.deployment).
    from pipeline.federation.deployment import serve

    serve(grid, context)


# ================================================================================================ engines
class InProcessGrid(Grid):
    """Flower's Grid, delivering each Message to ``client_app`` in this process, one node after the other.

    Each node has its own Context (node_config: client name, plan; state: the client's private state), kept
    across rounds as a SuperNode keeps it. Messages are deep-copied in both directions, so client and server
    share no objects; a ClientApp exception becomes an error reply (ErrorCode.CLIENT_APP_RAISED_EXCEPTION),
    as Flower's runtimes report it.
    """

    def __init__(self, client_app: ClientApp, node_configs: list[dict[str, Any]], run_id: int = 1):
        self.client_app = client_app
        self._run = Run.create_empty(run_id)
        self.contexts: dict[int, Context] = {}
        for i, node_config in enumerate(node_configs):
            node_id = 1000 + i
            self.contexts[node_id] = Context(run_id=run_id, node_id=node_id, node_config=dict(node_config),
                                             state=RecordDict(), run_config={})
        self._pending: dict[str, Message] = {}

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            if msg.metadata.dst_node_id not in self.contexts:
                raise ValueError(f"message to unknown node {msg.metadata.dst_node_id}")
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self._pending[msg.metadata.message_id] = copy.deepcopy(msg)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = []
        for mid in message_ids:
            msg = self._pending.pop(mid)
            context = self.contexts[msg.metadata.dst_node_id]
            try:
                reply = self.client_app(msg, context)
            except Exception as exc:  # the client failed: Flower reports this as an error reply
                reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
                log.warning("node %d raised %s: %s", msg.metadata.dst_node_id, type(exc).__name__, exc)
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)
            replies.append(copy.deepcopy(reply))
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(list(self.push_messages(messages)))


def _set_server_identity(run_id: int) -> None:
    # Flower's runtimes set the identity of the process running the ServerApp; Message() reads it.
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID


def run_inprocess(plan_path: str, recorder: Recorder | None = None, client_app_: ClientApp | None = None) -> dict:
    """Run the experiment's ServerApp and ClientApps in this process; returns {arrays, history}."""
    plan = _load_plan(plan_path)
    names = client_training.client_names(plan)
    grid = InProcessGrid(client_app_ or client_app, [{"client-name": n, "plan": plan_path} for n in names])
    _set_server_identity(grid.run.run_id)
    result: dict = {}
    app = make_server_app(plan_path, recorder, result)
    app(grid=grid, context=Context(run_id=grid.run.run_id, node_id=SUPERLINK_NODE_ID, node_config={},
                                   state=RecordDict(), run_config={"plan": plan_path}))
    result["contexts"] = grid.contexts
    return result


def run_ray(plan_path: str, recorder: Recorder | None = None) -> dict:
    """Run the same apps in Flower's simulation runtime on Ray (one virtual SuperNode per client)."""
    from flwr.simulation import run_simulation

    plan = _load_plan(plan_path)
    names = client_training.client_names(plan)
    result: dict = {}
    backend_config = {"client_resources": {"num_cpus": plan.train.ray_cpus_per_client,
                                           "num_gpus": plan.train.ray_gpus_per_client}}
    _set_server_identity(1)
    run_simulation(server_app=make_server_app(plan_path, recorder, result), client_app=client_app,
                   num_supernodes=len(names), backend_config=backend_config)
    if "history" not in result:
        raise RuntimeError("the Ray simulation ended without a result (see the Flower log above)")
    return result


def run_federated(plan_path: str, recorder: Recorder | None = None) -> dict:
    plan = _load_plan(plan_path)
    if plan.train.engine == "ray":
        return run_ray(plan_path, recorder)
    return run_inprocess(plan_path, recorder)
