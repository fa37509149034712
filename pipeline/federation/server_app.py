"""The ServerApp's federated round loop of one experiment (Flower Message API, flwr 1.41); why this loop and not
``Strategy.start``: docs/ARCHITECTURE.md."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from pipeline.experiments.plans import Plan
from pipeline.experiments.settings import CacheConfig, RunSettings
from pipeline.federation.admission import connected_nodes, identify_clients
from pipeline.federation.processes import FederationError
from pipeline.federation.protocol import (
    ARRAYS_KEY,
    EVAL_METRICS,
    METRICS_KEY,
    PLAN_HASH,
    GridView,
    client_settings_config,
    decode_global,
    decode_reply,
    encode_global,
    error_line,
    load_plan,
    metrics_row,
    misnamed,
    payload_bytes,
    replies_by_node,
    train_reply_metrics,
    train_reply_row,
    unanswered,
)
from pipeline.federation.strategies.catalog import build_strategy
from pipeline.federation.strategies.registry import restore_strategy_state, strategy_state
from pipeline.training import checkpoints
from pipeline.training.client_data import client_names
from pipeline.training.history import TrainRecorder, history_row, training_rounds
from pipeline.training.privacy_hooks import PRIVACY as privacy
from pipeline.training.seeds import derived_seed
from pipeline.training.set_engine import rng_state, set_rng_state
from pipeline.training.shared_model import initial_adapter_state
from pipeline.training.stopping import mean_val_loss_by_round, plateaued

log = logging.getLogger("fedmeet.federated")


def save_server_checkpoint(plan: Plan, rnd: int, state: dict[str, torch.Tensor], strategy, history: list[dict]) -> None:
    """The round's checkpoint; ``state``: the global adapter as tensors (torch.save writes their bytes as they are;
    NumPy arrays it pickles, ~7x slower a round)."""
    content = {"arrays": state, "strategy_state": strategy_state(strategy), "history": history, "rng": rng_state()}
    checkpoints.save_round_checkpoint(checkpoints.server_checkpoint_path(plan), plan, rnd, content)


def load_server_checkpoint(plan: Plan) -> dict[str, Any] | None:
    return checkpoints.load_round_checkpoint(checkpoints.server_checkpoint_path(plan), plan)


@dataclass
class _Round:
    """One round's exchange: where messages go, who they go to, each client's history row, and under client-level DP
    the round's C and what ``clipped`` records of each aggregated client."""

    grid: Grid
    strategy: Any
    rnd: int
    rows: dict[str, dict[str, Any]]
    node_names: dict[int, str]
    timeout: float
    client_level: Any = None
    clipping_norm: float | None = None
    clipped: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    misnamed: set[int] = field(default_factory=set)  # nodes answering as another client: forgotten after the round


def run_server(
    grid: Grid,
    plan_path: str,
    recorder: TrainRecorder,
    round_timeout_s: float = RunSettings.round_timeout_s,
    admission_timeout_s: float | None = None,
    cache: CacheConfig | None = None,
    *,
    ckpt: dict[str, Any] | None,
) -> tuple[dict[str, torch.Tensor], list]:
    """The federated training loop of the experiment ``plan_path`` plans (the ServerApp's main).
    ``admission_timeout_s`` defaults to the round timeout; ``cache``, the clients' cache settings, goes with every
    message (the engines'; a deployed client has its own: protocol.client_cache_config); ``ckpt``: the caller's
    load_server_checkpoint, which the run resumes from (None: it starts over, each client told so at admission)."""
    plan = load_plan(plan_path)
    spec, t = plan.spec, plan.train
    if not spec.federated:
        raise ValueError(f"method {spec.name!r} is not federated")
    # the clients the plan declares (a deployed server holds no partition file), else (an older plan) the partition's
    declared = list(plan.clients) if plan.clients else client_names(plan)
    sizes: dict[str, dict[str, int]] = {}
    # the run's node -> client map, current each round (connected_nodes); a deployed evaluation asks these nodes only
    node_names = recorder.nodes = identify_clients(
        grid, plan_path, declared, admission_timeout_s or round_timeout_s, sizes, start_over=ckpt is None
    )
    privacy.check_run(plan, sizes)  # by the train sizes the clients reported (a deployed server has no partition)
    clients = sorted(node_names.values())
    late = t.new_client if spec.new_client == "post" else None
    if late is not None and late not in clients:
        raise ValueError(
            f"{plan.source or plan.experiment}: new client {late!r} (train.new_client) is not among "
            f"the clients {clients}"
        )

    strategy = build_strategy(spec.strategy, t.strategy_params, fraction_train=t.fraction_train, client_lr=t.lr)
    # privacy.mode client: Flower's DP wrapper around the strategy, also the round record (else None); SecAgg+
    strategy = (client_level := privacy.client_level(plan, strategy, len(declared))) or strategy
    secure = privacy.secure_aggregator(plan, clients, late, round_timeout_s, sizes)
    if ckpt is not None:  # its strategy state and random generators restored
        restore_strategy_state(strategy, ckpt["strategy_state"])
        set_rng_state(ckpt["rng"])
    # the global as CPU float32 tensors (replaced each time it changes), the checkpoint's as saved
    state = dict(ckpt["arrays"]) if ckpt is not None else initial_adapter_state(plan)
    history = list(ckpt["history"]) if ckpt is not None else []
    # Flower's strategies write into the config they get (server-round, proximal-mu): each message set gets its own
    config = {"plan": plan_path, PLAN_HASH: plan.hash, **(client_settings_config(cache) if cache else {})}
    # Whether the late client has joined (a resumed run reads it from the restored history).
    joined = any(r["client"] == late for r in history)

    for rnd in training_rounds(plan, recorder, clients, ckpt, history, log, late):
        if late is not None and not joined and new_client_joins(rnd, history, late, t.join):
            joined = True
            log.info(
                "%s: round %d: the existing clients have converged (or max_round): %s joins", plan.experiment, rnd, late
            )
        connected = connected_nodes(grid, plan_path, node_names, round_timeout_s, clients)
        admitted = [n for n, c in sorted(connected.items(), key=lambda nc: nc[1]) if c != late or joined]
        view = GridView(grid, admitted)  # a new client joins at its round
        # Flower samples the list (by client name, not random node ids) with `random`: seeded per round, resumable.
        random.seed(derived_seed(plan.seed, rnd, "sampling"))
        # The global goes encoded once; a lossy one's clients train from q(W), not W: their updates are against it
        # (fp32 too rounds a float64 W, Flower's FedAdam's, to the float32 the clients get).
        downlink = encode_global(state, plan)
        sent = decode_global(downlink, plan)  # as the clients decode it
        base = ArrayRecord.from_torch_state_dict(sent)
        # no node at all: nothing to configure (Flower's strategies would wait for one in a view that gets none); the
        # DP strategy draws an empty sample then and releases this round's global W plus its noise (it keeps W)
        messages = (
            list(strategy.configure_train(rnd, base, ConfigRecord(config), view)) if admitted or client_level else []
        )
        clipping_norm = strategy.clipping_norm if client_level else None  # this round's C (adaptive: it moves)
        # This round's history row per client: sampled (with its downlink bytes), admitted but not sampled, or absent
        # (its SuperNode gone, Flower marked it offline: recorded, not waited for; the late client waits for its round)
        sampled = {m.metadata.dst_node_id for m in messages}  # of the admitted nodes (the view shows no other)
        rows = {node_names[n]: history_row(rnd, node_names[n], int(n in sampled)) for n in admitted}
        for m in messages:
            m.content[ARRAYS_KEY] = downlink
            rows[node_names[m.metadata.dst_node_id]]["bytes_down"] += payload_bytes(m.content)
        for name in sorted(set(clients) - set(connected.values()) - (set() if joined else {late})):
            rows[name] = history_row(rnd, name, 0, absent=1)
        exchange = _Round(grid, strategy, rnd, rows, node_names, round_timeout_s, client_level, clipping_norm)
        if secure is None:
            new_arrays = _train_in_the_clear(exchange, messages, plan, base, sent)
        else:
            new_arrays = _train_secure(secure, exchange, messages, plan)

        # Each aggregated client's share of the FedAvg weight this round (|D_i| / |D| over the good replies; under
        # client-level DP each update weighs 1 / the expected count, whoever replied).
        good = [r for r in rows.values() if r["sampled"] and not r["failed"] and "weight" in r]
        total = sum(r["weight"] for r in good)
        for r in good:
            r["weight_share"] = 1 / client_level.setting.sampled if client_level is not None else r["weight"] / total
        if new_arrays is not None:
            # in the model's dtype: Flower's FedAdam returns a float64 W (it steps from current_arrays, the downlink)
            state = {k: v.to(state[k].dtype) for k, v in new_arrays.to_torch_state_dict().items()}
            if client_level is not None:
                client_level.record(rows, exchange.clipped, clipping_norm)
        else:
            log.warning("round %d: no client update; the global adapter stays as it was", rnd)

        # Every admitted client evaluates (its best round on its own valid set); only AdaFedAvg-style methods
        # evaluate the global adapter, the others their local one: nothing to send.
        eval_messages = (
            list(strategy.configure_evaluate(rnd, ArrayRecord(), ConfigRecord(config), view)) if admitted else []
        )
        eval_downlink = encode_global(state, plan) if (spec.local_from_global and eval_messages) else ArrayRecord()
        _evaluate(exchange, eval_messages, eval_downlink)

        history.extend(rows[c] for c in sorted(rows))
        save_server_checkpoint(plan, rnd, state, strategy, history)
    _refuse_untrained(plan.experiment, history)
    return state, history


def _refuse_untrained(experiment: str, history: list[dict[str, Any]]) -> None:
    """Clients were asked to train and every one failed every time: nothing was trained, so nothing is published."""
    if (asked := [r for r in history if r["sampled"]]) and all(r["failed"] for r in asked):
        first = asked[0]
        raise FederationError(
            f"{experiment}: no client update in any round, every sampled client failed (the first: "
            f"{first['client']} in round {first['round']}: {first.get('error', 'no reason recorded')})"
        )


def _evaluate(r: _Round, messages: list[Message], downlink: ArrayRecord) -> None:
    """The evaluate step of a round: each reply's validation loss, tokens and best round into its client's row; a
    client whose reply failed, is malformed or did not come within the timeout is logged and marked ``eval_failed``
    (the strategy's aggregate of the replies' metrics is not used: not asked for)."""
    for m in messages:
        m.content[ARRAYS_KEY] = downlink
        r.rows[r.node_names[m.metadata.dst_node_id]]["bytes_down"] += payload_bytes(m.content)
    replies = replies_by_node(r.grid, messages, r.timeout)
    why = {r.node_names[n]: f"no reply within {r.timeout:.0f}s" for n in unanswered(messages, replies)}
    for node, reply in replies.items():
        row = r.rows[r.node_names[node]]
        if reply.has_error():
            why[row["client"]] = error_line(reply)
        elif wrong := misnamed(reply, node, row["client"]):
            why[row["client"]] = wrong
            r.misnamed.add(node)
        else:
            try:
                row.update(metrics_row(reply.content.metric_records.get(METRICS_KEY, {}), EVAL_METRICS))
            except ValueError as exc:
                why[row["client"]] = f"it cannot be decoded: {exc}"
    for name, reason in why.items():
        r.rows[name]["eval_failed"] = 1
        log.warning("round %d: client %s failed to evaluate: %s", r.rnd, name, reason)
    for node in r.misnamed:  # the round's last message sent: the next connected_nodes asks its name again
        del r.node_names[node]


def _left_out(r: _Round, row: dict[str, Any], why: str) -> None:
    """A sampled client's update is not in the round's aggregate: its row is marked failed, ``why`` its error unless
    the caller recorded one already (a failure's first line, a SecAgg+ stage's)."""
    row["failed"] = 1
    row.setdefault("error", why)
    log.warning("round %d: client %s is left out of the aggregate: %s", r.rnd, row["client"], why)


def _train_in_the_clear(
    r: _Round, messages: list[Message], plan: Plan, base: ArrayRecord, sent: dict[str, torch.Tensor]
) -> ArrayRecord | None:
    """The train step of a plain round from the global ``base`` (as the clients decode it; ``sent``: its tensors, the
    delta-encoded replies' reference); under client-level DP each decoded update is checked against this round's C
    and ``r.clipped`` gets (clipped or not, its norm) per client."""
    replies = replies_by_node(r.grid, messages, r.timeout)
    left_out: set[int] = set()  # misnamed, decoded badly, or (client-level DP) not within C
    for node, reply in replies.items():
        row = r.rows[r.node_names[node]]
        if reply.has_error():
            row["error"] = error_line(reply)
            _left_out(r, row, f"it failed: {row['error']}")
            continue
        row["bytes_up"] = payload_bytes(reply.content)  # as encoded on the wire
        if why := misnamed(reply, node, row["client"]):
            r.misnamed.add(node)
        else:  # the strategy aggregates float32 states: decode the reply in place (a delta against `sent`)
            try:
                metrics = train_reply_metrics(reply.content, plan)
                reply.content[ARRAYS_KEY] = decode_reply(reply.content[ARRAYS_KEY], plan, sent)
                update = r.client_level.clipped(reply, base, r.clipping_norm) if r.client_level else (0, 0.0)
                why = None if update is not None else f"its update is not clipped within C={r.clipping_norm:g}"
            except (KeyError, ValueError) as exc:
                why = f"it cannot be decoded: {exc}"
        if why is not None:
            left_out.add(id(reply))
            _left_out(r, row, why)
            continue
        r.clipped[row["client"]] = update  # read under client-level DP only
        row.update(metrics)
    for node in unanswered(messages, replies):
        _left_out(r, r.rows[r.node_names[node]], f"no reply within {r.timeout:.0f}s (train.round_timeout_s)")
    return r.strategy.aggregate_train(r.rnd, [reply for reply in replies.values() if id(reply) not in left_out])[0]


def _train_secure(secure, r: _Round, messages: list[Message], plan: Plan) -> ArrayRecord | None:
    """The train step of a SecAgg+ round (``secure``: privacy's SecureAggregator, built by its seam); under client-level
    DP the noise is added to the unmasked mean here, and ``r.clipped`` gets each summed client's share of the clipped
    count (whose updates, the server does not learn). A summed client whose metrics cannot be decoded (not those of
    ``plan``'s replies: protocol.train_reply_row) fails the round: its masked vector cannot be taken out of the sum,
    which is not released (the global stays, as when the protocol halts)."""
    result, undecodable = secure.train_round(r.grid, messages, r.rnd), []
    for node, outcome in result.nodes.items():
        row = r.rows[r.node_names[node]]
        row["bytes_down"], row["bytes_up"] = outcome.bytes_down, outcome.bytes_up
        try:
            if outcome.metrics is not None:  # the dict SecAgg+'s FitRes carried
                row.update(train_reply_row(outcome.metrics, plan))
        except ValueError as exc:
            row["error"] = f"it cannot be decoded: {exc}"
            undecodable += [row["client"]] if node in result.in_sum else []
    if undecodable and result.arrays is not None:
        result.arrays = None
        result.halted = f"not released: the SecAgg+ sum holds the update of {undecodable}, which cannot be decoded"
    for node, outcome in result.nodes.items():
        row = r.rows[r.node_names[node]]
        stage_error = f"SecAgg+ {outcome.failed_stage}: {outcome.error}" if outcome.failed_stage else None
        if result.arrays is None or node not in result.in_sum:
            row.setdefault("error", stage_error or result.halted)
            _left_out(r, row, row["error"] if node in result.in_sum else f"not in the SecAgg+ sum: {row['error']}")
        elif stage_error:  # its masked vector is in the sum; the others' shares unmasked it
            row["secagg_error"] = stage_error
    summed = len(result.in_sum)
    if result.arrays is not None and summed < len(messages):
        log.info(
            f"round {r.rnd}: SecAgg+ unmasked the sum of {summed} of {len(messages)} sampled clients "
            f"(threshold {result.threshold} of {result.num_shares} shares)"
        )
    # none summed or released: W and the noise, as in the clear
    if result.arrays is None and r.client_level is not None:
        return r.strategy.release_secure_mean(r.rnd, None, 0, 0)
    if result.arrays is None or result.clipped_count is None:
        return result.arrays
    for node in result.in_sum:
        r.clipped[r.node_names[node]] = (result.clipped_count / summed, None)
    return r.strategy.release_secure_mean(r.rnd, result.arrays, result.clipped_count, summed)


def new_client_joins(rnd: int, history: list[dict[str, Any]], late: str, join) -> bool:
    """Whether the late client is admitted in round ``rnd`` (train.join): at ``join.max_round``, or earlier once
    the other clients' mean validation loss has plateaued."""
    if rnd >= join.max_round:
        return True
    losses = [m for _, m in mean_val_loss_by_round(history, before=rnd, exclude=late)]
    return plateaued(losses, join.min_rel_improvement, join.patience)
