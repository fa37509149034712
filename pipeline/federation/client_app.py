"""The ClientApp (Flower Message API, flwr 1.41): ``query.identify``, ``train`` (a reply holds tensors and counts
only, no text but the client's name) and ``evaluate``; pipeline.federation.deployment adds ``query.summarize``
(federated evaluation)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from pipeline.common import atomic
from pipeline.experiments.plans import Plan
from pipeline.federation.protocol import (
    ARRAYS_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    PLAN_HASH,
    START_OVER,
    TRAIN_METRICS,
    client_cache_config,
    decode_global,
    encode_reply,
    load_plan,
    plan_path_of,
)
from pipeline.federation.strategies.registry import NUM_EXAMPLES_KEY
from pipeline.modeling.adapters import adapter_file, load_adapter
from pipeline.training import checkpoints
from pipeline.training import client_training as local_training  # a module attribute: tests wrap train_local
from pipeline.training.client_data import client_data, read_partition
from pipeline.training.privacy_hooks import PRIVACY as privacy
from pipeline.training.set_engine import SetAborted
from pipeline.training.shared_model import initial_adapter_state, prefix_cache_for, shared_model

log = logging.getLogger("fedmeet.federated")

LOCAL_STATE_KEY = "local-adapter"  # context.state: the client's local adapter (never leaves the client)
PROGRESS_KEY = "progress"  # context.state: best validation loss and its round
# [round, DP-SGD steps before it, after it] of the client's last reply (it may die before that round's checkpoint)
DP_SENT = "dp-steps-sent.json"


def client_name(context: Context) -> str:
    """``node_config['client-name']`` (a SuperNode's --node-config, the in-process engine's node)."""
    if context.node_config.get("client-name"):
        return str(context.node_config["client-name"])
    raise ValueError("node_config has no 'client-name'")


def client_dir(plan: Plan, name: str, context: Context) -> Path:
    return Path(context.node_config.get("client-dir") or checkpoints.client_output_dir(plan, name))


def client_checkpoint_dir(plan: Plan, name: str, context: Context) -> Path:
    return Path(context.node_config.get("checkpoint-dir") or checkpoints.client_checkpoint_dir(plan, name))


def served_plan(msg: Message, context: Context) -> Plan:
    """The plan this node serves, refusing a message of the server's run of another plan (its config's plan hash): a
    SuperNode restarted under --auth keeps its node id, so the server does not identify it again."""
    plan = load_plan(plan_path_of(msg, context))
    if (theirs := msg.content.config_records.get(CONFIG_KEY, {}).get(PLAN_HASH)) not in (None, plan.hash):
        raise ValueError(f"{plan.source or plan.experiment}: this node serves another plan than the run's ({theirs})")
    return plan


def _client_round(msg: Message, context: Context) -> tuple[Plan, str, int]:
    """A train or evaluate message's plan (served_plan), client and round, the client's local adapter and progress put
    into context.state when it lacks them and a round checkpoint before the round has them (a resumed run: a run
    that starts over had the client discard an earlier run's)."""
    plan, name = served_plan(msg, context), client_name(context)
    rnd = int(msg.content[CONFIG_KEY]["server-round"])
    if LOCAL_STATE_KEY not in context.state:  # the first message (every later one: no checkpoint folder read)
        ckpt_dir = client_checkpoint_dir(plan, name, context)
        ckpt = checkpoints.latest_client_checkpoint(ckpt_dir, before=rnd)
        sent = json.loads((ckpt_dir / DP_SENT).read_text()) if (ckpt_dir / DP_SENT).exists() else [rnd, None, None]
        steps = [s for s in (ckpt and ckpt.dp_steps, sent[2]) if s is not None]
        privacy.restore_dp_steps(context, max(steps, default=None))  # every released update, a redone round's again
        if ckpt is not None:
            context.state[PROGRESS_KEY] = MetricRecord(ckpt.progress)
        if ckpt is not None and ckpt.trained:
            context.state[LOCAL_STATE_KEY] = ArrayRecord.from_torch_state_dict(load_adapter(ckpt.adapter))
            log.info("client %s: resumed local adapter from its round-%d checkpoint", name, ckpt.round)
    return plan, name, rnd


def _local_adapter(context: Context) -> dict[str, torch.Tensor] | None:
    """The local adapter context.state holds; None while the client has not trained yet."""
    return context.state[LOCAL_STATE_KEY].to_torch_state_dict() if LOCAL_STATE_KEY in context.state else None


def errors_stay_on_the_client(msg: Message, context: Context, call_next) -> Message:
    """The ClientApp's outermost mod (docs/privacy.md): a handler's exception becomes an error reply naming its
    class, the client, the message type and round only; its text and traceback, which may name files and example
    ids, go to the client's log (Flower's runtimes would send the text to the server as the error's reason)."""
    try:
        return call_next(msg, context)
    except Exception as exc:
        config = msg.content.config_records.get(CONFIG_KEY, {})  # a SecAgg+ stage's message: no "config"
        rnd = f" of round {config['server-round']}" if "server-round" in config else ""
        name = context.node_config.get("client-name") or f"node {msg.metadata.dst_node_id}"
        what = f"{type(exc).__name__} in client {name}'s {msg.metadata.message_type}{rnd}"
        log.error("%s: %s", what, exc, exc_info=not isinstance(exc, SetAborted))  # a stopped set: its own report
        error = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{what}; details in the client's log")
        return Message(error, reply_to=msg)


client_app = ClientApp(mods=[errors_stay_on_the_client])


@client_app.query("identify")
def client_identify(msg: Message, context: Context) -> Message:
    """Admission (admission.identify_clients): the client's name, the hash of the plan it serves (the server refuses
    another plan's node) and the sizes of its train and valid splits."""
    plan, name, config = load_plan(plan_path_of(msg, context)), client_name(context), msg.content[CONFIG_KEY]
    identity = ConfigRecord({"client-name": name, PLAN_HASH: plan.hash})
    # the plan the server runs only (its hash: a site's copy may lie elsewhere): another plan's node keeps its files
    if config.get(START_OVER) and config.get(PLAN_HASH) == identity[PLAN_HASH]:
        # the server starts its run at round 1: what an earlier run left goes (round checkpoints and DP-SGD record,
        # which a later round would resume; adapters; gate-log rounds)
        ckpt, out = client_checkpoint_dir(plan, name, context), client_dir(plan, name, context)
        for stale in [*ckpt.glob("round*"), ckpt / DP_SENT, *out.glob("adapter_*"), *out.glob("gate_log/round*")]:
            stale.unlink(missing_ok=True)
    splits = read_partition(plan.paths["partition"])["clients"].get(name)
    if splits is not None:  # else only the name: the server refuses a client outside the plan, naming it
        identity.update({"num-train": len(splits["train"]), "num-valid": len(splits["valid"])})
    return Message(RecordDict({"identity": identity}), reply_to=msg)


@client_app.train()
def client_train(msg: Message, context: Context) -> Message:
    """The train handler: train_round behind privacy's checks (pipeline.privacy.seam.client_train, when registered),
    inside its Flower mods (SecAgg+, client-level DP's clipping). train_round is looked up when a message comes, so a
    wrapper set on this module (tests, instrumentation) is the one that runs."""
    return privacy.client_train(msg, context, lambda m, c: train_round(m, c))


def train_round(msg: Message, context: Context) -> Message:
    """One training round of this client: the reply (adapter arrays, metrics; under SecAgg+ sent only masked)."""
    plan, name, rnd = _client_round(msg, context)
    received = decode_global(msg.content[ARRAYS_KEY], plan)
    model = shared_model(plan)
    # AdaFedAvg: the average overwrites the client adapter; first round (no local adapter yet): start from it
    from_global = plan.spec.local_from_global or plan.train.local_adapter == "reset"
    local = received if from_global or LOCAL_STATE_KEY not in context.state else _local_adapter(context)
    model.load_adapter_state("local", local)
    if plan.spec.two_adapters:
        model.load_adapter_state("global", received)  # the teacher: the server's aggregate, never trained

    data = client_data(plan, name)
    mu = float(msg.content[CONFIG_KEY].get("proximal-mu", 0.0)) if plan.spec.proximal else 0.0
    # its DP-SGD update of this round left before (a redo, maybe from another start): drawn afresh (docs/privacy.md)
    sent = client_checkpoint_dir(plan, name, context) / DP_SENT
    result = local_training.train_local(
        model,
        plan,
        data.train,
        client=name,
        rnd=rnd,
        proximal_reference=received if mu > 0 else None,
        proximal_mu=mu,
        cache=prefix_cache_for(plan, model, client_cache_config(msg, context)),
        progress=True,  # a full-data round takes minutes: show the client's batches (the bar clears itself)
        redo=privacy.dp_steps(context) if sent.exists() and json.loads(sent.read_text())[0] == rnd else None,
    )
    new_local = model.adapter_state("local")
    context.state[LOCAL_STATE_KEY] = ArrayRecord.from_torch_state_dict(new_local)
    if plan.spec.two_adapters:  # the gate log stays on the client's disk
        out = client_dir(plan, name, context) / "gate_log" / f"round{rnd:03d}.parquet"
        atomic.to_parquet(result.gate_log, out, index=False)

    # The weight follows what trained (train.weight_by: trained); "full" asks for the client's whole train size,
    # which differs only under the CPU profile's cap (max_train_examples_per_client).
    values = vars(result) | {"weight": data.n_train_available if plan.train.weight_by == "full" else result.n_examples}
    metrics = MetricRecord({key: kind(values[field]) for key, (field, kind, *_) in TRAIN_METRICS.items()})
    before = privacy.dp_steps(context) or 0
    metrics.update(privacy.account(context, result))  # example-level DP's (epsilon, delta) so far
    if (steps := privacy.dp_steps(context)) is not None:  # on disk before the reply leaves
        atomic.write_text(sent, json.dumps([rnd, before, steps]))
    content = RecordDict({ARRAYS_KEY: encode_reply(new_local, plan, received), METRICS_KEY: metrics})
    content["identity"] = ConfigRecord({"client-name": name})  # the server checks it: protocol.misnamed
    return Message(content, reply_to=msg)


@client_app.evaluate()
def client_evaluate(msg: Message, context: Context) -> Message:
    plan, name, rnd = _client_round(msg, context)
    model = shared_model(plan)
    # the server sends the global to the local_from_global methods only
    local = decode_global(msg.content[ARRAYS_KEY], plan) if plan.spec.local_from_global else _local_adapter(context)
    # A client not sampled yet has no local adapter: it is scored with the round-0 adapter, which is NOT kept as
    # its state, so its first train round starts from the global of that round (as a joining client does).
    trained = local is not None
    local = local if trained else initial_adapter_state(plan)
    model.load_adapter_state("local", local)

    data = client_data(plan, name)
    if len(data.valid) == 0:
        raise ValueError(f"{plan.paths['partition']}: client {name!r} has no valid examples: no best round")
    cache = prefix_cache_for(plan, model, client_cache_config(msg, context))
    val_loss, val_tokens = local_training.validation_loss(model, plan, data.valid, cache=cache)

    progress = dict(context.state[PROGRESS_KEY]) if PROGRESS_KEY in context.state else checkpoints.initial_progress()
    out = client_dir(plan, name, context)
    progress = checkpoints.keep_best_and_final(out, plan, name, rnd, val_loss, local, progress)
    if trained and plan.spec.local_from_global:  # the others' local adapter is in context.state already
        context.state[LOCAL_STATE_KEY] = ArrayRecord.from_torch_state_dict(local)
    context.state[PROGRESS_KEY] = MetricRecord(progress)
    ckpt_dir, final = client_checkpoint_dir(plan, name, context), adapter_file(out, "final")
    checkpoints.write_client_checkpoint(ckpt_dir, rnd, final, progress, trained, privacy.dp_steps(context))

    metrics = {NUM_EXAMPLES_KEY: len(data.valid), "val-loss": float(val_loss), "val-tokens": int(val_tokens)}
    metrics["best-round"] = int(progress["best-round"])
    identity = ConfigRecord({"client-name": name})
    return Message(RecordDict({METRICS_KEY: MetricRecord(metrics), "identity": identity}), reply_to=msg)
