"""SecAgg+ (Bell et al., CCS 2020) through Flower 1.41's ``SecAggPlusWorkflow`` and ``secaggplus_mod``, which
exist only for Flower's legacy strategy API: the server runs a legacy strategy (:class:`SecureAggregator`), the client
turns its ``FitIns`` into the Message-API train call of every other round (:func:`legacy_fit`). docs/privacy.md."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import FedAvg
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid
from flwr.supercore.differential_privacy import KEY_NORM_BIT

from pipeline.experiments.privacy import SECAGG_MODULUS, SecAggConfig
from pipeline.federation.protocol import (
    ARRAYS_KEY,
    CLIPPED_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    SECAGG_CLIPPED_KEY,
    GridView,
    error_line,
    npy_header,
    payload_bytes,
    replies_by_node,
)
from pipeline.federation.strategies.registry import NUM_EXAMPLES_KEY

ARRAY_KEYS = "array-keys"  # FitIns config: the adapter's tensor names (legacy Parameters carry none), as JSON
FLOAT32_EPS = 2.0**-24  # unit roundoff of float32


def aggregation_error_bound(weights: Sequence[int], scale: int, cfg: SecAggConfig, max_abs: float) -> float:
    """Largest possible |SecAgg+ mean - plain FedAvg mean| of one coordinate, for the k clients in the sum, when no
    coordinate was clipped (Q = ``quantization_range``, c = ``clipping_range``, q_i = n_i * s, u = 2**-24):
    each client's integer is off (x_i q_i / Q + c) Q / (2c) by < 1 (stochastic rounding) plus Flower's float32
    quantiser (scale 2uc, shift 3uc, product 4uc; one more uc for second-order terms and the float64 unmasking),
    so its value error is < 2c/Q + 10uc; the server divides k of them by sum_i q_i / Q; the float32 cast of the mean
    (u m, m = the largest |upload|) and FedAvg's k float32 products ((k + 1) u m, one more u m second-order) add
    (k + 3) u m. Equal weights: about 2c/Q + 10uc (8.6e-6 with c = 8, Q = 2**22: 2c/Q is 3.8e-6 of it)."""
    k, total_q = len(weights), scale * sum(int(w) for w in weights)
    return k * (cfg.quantization_range / total_q) * upload_error(cfg) + (k + 3) * FLOAT32_EPS * max_abs


def keyed(keys, arrays: list[np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(a)) for k, a in zip(keys, arrays, strict=True)})


def upload_error(cfg: SecAggConfig) -> float:  # one coordinate's, of an upload of integer weight Q (2c/Q + 10uc)
    return 2 * cfg.clipping_range / cfg.quantization_range + 10 * FLOAT32_EPS * cfg.clipping_range


def secure_aggregation_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower's ``secaggplus_mod`` for a SecAgg+ round's messages; any other passes (one ClientApp for both)."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def is_legacy_fit(msg: Message) -> bool:
    """The masked-vector stage of SecAgg+ hands the train handler Flower's legacy ``FitIns`` layout."""
    return "fitins.parameters" in msg.content.array_records


def legacy_fit(msg: Message, context: Context, train: Callable[[Message, Context], Message]) -> Message:
    """The ``FitIns`` becomes the Message-API train message of ``train`` and its reply the ``FitRes`` that
    ``secaggplus_mod`` quantises and masks."""
    if RECORD_KEY_CONFIGS not in msg.content.config_records:
        raise ValueError(
            "a legacy FitIns outside SecAgg+: this client uploads its adapter only masked or as a Message-API reply"
        )
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    config = dict(fitins.config)
    keys = json.loads(str(config.pop(ARRAY_KEYS)))
    received = parameters_to_ndarrays(fitins.parameters)
    if len(keys) != len(received):
        raise ValueError(f"FitIns: {len(received)} arrays for {len(keys)} names")
    original = msg.content
    msg.content = RecordDict({ARRAYS_KEY: keyed(keys, received), CONFIG_KEY: ConfigRecord(config)})
    try:
        reply = train(msg, context)
    finally:
        msg.content = original
    if reply.has_error():  # e.g. the clipping mod found no clipping norm in the config
        raise RuntimeError(f"train reply: {error_line(reply)}")
    upload = [reply.content[ARRAYS_KEY][k].numpy() for k in keys]
    metrics = dict(reply.content[METRICS_KEY])
    # The setup stage stored the server's settings in the mod's state.
    sa = context.state.config_records[RECORD_KEY_STATE]
    weight = int(metrics[NUM_EXAMPLES_KEY])
    if CLIPPED_KEY in metrics:
        # client-level DP (client_dp_mod clipped the update): weight 1, and the clipped bit goes into the sum as
        # bit x c / 2 instead of the clear metrics (Flower's adaptive mod's norm bit is the same bit)
        weight = 1
        metrics.pop(KEY_NORM_BIT, None)
        upload.append(np.array([int(metrics.pop(CLIPPED_KEY)) * (float(sa["clipping_range"]) / 2)], dtype=np.float32))
    if weight > float(sa["max_weight"]):  # Flower only warns; its quantiser would clip the scaled update: a wrong mean
        raise RuntimeError(
            f"train reply: weight {weight} is above SecAgg+'s max_weight {sa['max_weight']:g}, sized by "
            "the train sizes the clients reported at admission"
        )
    # What the quantiser will clip: a clipped coordinate breaks the error bound, so the server is told how many,
    # never which.
    ratio = weight / float(sa["max_weight"])
    metrics[SECAGG_CLIPPED_KEY] = int(sum((np.abs(a) * ratio > float(sa["clipping_range"])).sum() for a in upload))
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(upload), weight, metrics)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)


@dataclass
class NodeOutcome:  # what the server learnt of one sampled client in a SecAgg+ round
    metrics: dict | None = None  # the train reply's metrics (in the clear), when it reached the masked-vector stage
    failed_stage: str | None = None  # the first stage it failed or did not answer in time
    error: str | None = None
    bytes_down: int = 0  # every stage: adapter arrays plus the protocol's keys, shares and masked vectors
    bytes_up: int = 0


@dataclass
class SecureRound:
    arrays: ArrayRecord | None  # the unmasked weighted mean; None when the protocol halted
    nodes: dict[int, NodeOutcome] = field(default_factory=dict)
    in_sum: set[int] = field(default_factory=set)  # the clients whose masked vector is in the sum
    threshold: int = 0
    num_shares: int = 0
    halted: str | None = None
    clipped_count: int | None = None  # client-level DP: how many updates in the sum were clipped


def _wire_bytes(content: RecordDict) -> int:
    values = [
        b for rec in content.config_records.values() for v in rec.values() for b in (v if isinstance(v, list) else [v])
    ]
    return payload_bytes(content) + sum(len(b) for b in values if isinstance(b, bytes))


class _ObservedGrid(GridView):
    """Passes the workflow's messages on, noting per node what each stage sent, received and failed; a reply Flower's
    workflow cannot take (it would raise inside it, ending the run) is that client's failure in its stage, to Flower
    a client lost there. ``vector``: the masked vector's arrays' shapes (Flower's weight factor, then the upload's)."""

    def __init__(self, grid: Grid, vector: list[tuple[int, ...]], workflow: _Workflow):
        super().__init__(grid)
        self.nodes: dict[int, NodeOutcome] = {}
        self.vector, self.workflow = vector, workflow

    def _unreadable(self, stage: str, content: RecordDict) -> str | None:
        """Why Flower 1.41's workflow cannot take a client's reply of ``stage``, or None: the keys it reads there, the
        lists it zips of equal length, bytes where it forwards or decodes them (into a ConfigRecord of bytes, Shamir's
        combine), the masked vector integer arrays of the upload's shapes (it sums them modulo an integer), shares
        of nodes whose shares it collects (the round's keyed ones), one each."""
        try:
            c = content.config_records[RECORD_KEY_CONFIGS]
            if stage == Stage.SETUP:
                blobs = [c[Key.PUBLIC_KEY_1], c[Key.PUBLIC_KEY_2]]
            elif stage == Stage.SHARE_KEYS:
                blobs = [b for _, b in zip(c[Key.DESTINATION_LIST], c[Key.CIPHERTEXT_LIST], strict=True)]
            elif stage == Stage.COLLECT_MASKED_VECTORS:
                blobs = list(c[Key.MASKED_PARAMETERS])
            else:
                shares = list(zip(c[Key.NODE_ID_LIST], c[Key.SHARE_LIST], strict=True))
                if odd := [n for n, _ in shares if n not in self.workflow.state.sampled_node_ids]:
                    return f"it holds shares of nodes outside the round: {odd[:4]}"
                if len({n for n, _ in shares}) != len(shares):  # Shamir's combine: 'Duplicate share', a halt
                    return "it holds two shares of one node"
                blobs = [b for _, b in shares]
            if not all(isinstance(b, bytes) for b in blobs):
                return f"it holds a {stage} value that is not bytes"
            if stage == Stage.COLLECT_MASKED_VECTORS:
                heads = [npy_header(b) for b in blobs]
                if [shape for shape, _ in heads] != self.vector or any(d.kind not in "iu" for _, d in heads):
                    got = [f"{d}{list(shape)}" for shape, d in heads[:4]]
                    return f"its masked vector {got} is not integer arrays of the shapes {self.vector[:4]}"
        except (KeyError, TypeError, ValueError) as exc:
            return f"its reply cannot be read: {exc!r}"
        return None

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        stage = {m.metadata.dst_node_id: str(m.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]) for m in messages}
        for m in messages:
            self.nodes.setdefault(m.metadata.dst_node_id, NodeOutcome()).bytes_down += _wire_bytes(m.content)
        replies = replies_by_node(self._grid, messages, timeout)
        for node, outcome in ((node, self.nodes[node]) for node in stage):
            r = replies.get(node)
            bad = None if r is None or r.has_error() else self._unreadable(stage[node], r.content)
            if r is not None and not r.has_error() and bad is None:
                outcome.bytes_up += _wire_bytes(r.content)
                if stage[node] == Stage.COLLECT_MASKED_VECTORS:
                    # its vector is in the sum; metrics missing or malformed are _train_secure's to refuse (it
                    # halts the round); Flower converts the FitRes parts (a KeyError when one is missing) that no
                    # one reads (_Offer takes the unmasked sum, the weight is in the vector): it gets blank ones
                    outcome.metrics = dict(r.content.config_records.get("fitres.metrics", {}))
                    r.content["fitres.parameters"] = ArrayRecord()
                    r.content["fitres.metrics"] = ConfigRecord()
                    r.content["fitres.num_examples"] = MetricRecord({"num_examples": 0})
                    r.content["fitres.status"] = ConfigRecord({"code": Code.OK.value, "message": ""})
            elif outcome.failed_stage is None:  # the first stage it failed in, or did not answer in time in
                outcome.failed_stage = stage[node]
                outcome.error = bad or (error_line(r) if r is not None else f"no reply within {timeout}s")
            if bad is not None:
                del replies[node]
        return list(replies.values())


class _Offer(FedAvg):
    """The legacy strategy the workflow asks: it offers the round's sampled messages and takes the unmasked mean."""

    def __init__(self, offers: list[tuple[GridClientProxy, FitIns]]):
        super().__init__()
        self.offers = offers
        self.mean: list[np.ndarray] | None = None

    def configure_fit(self, server_round, parameters, client_manager):
        return self.offers

    def aggregate_fit(self, server_round, results, failures):
        self.mean = parameters_to_ndarrays(results[0][1].parameters)
        return results[0][1].parameters, {}


class _Workflow(SecAggPlusWorkflow):
    """Flower's workflow, keeping the round's protocol state (threshold, shares), and forgetting a client lost before
    its key shares went out, as a node and as a neighbour (docs/privacy.md, dropouts: Flower 1.41 asks for shares none
    holds, or removes masks none added). Exact: a client masks only with the neighbours whose shares it received."""

    def setup_stage(self, grid, context, state):
        self.state, self.unmask_error = state, None
        return super().setup_stage(grid, context, state)

    def collect_masked_vectors_stage(self, grid, context, state):
        state.sampled_node_ids = set(state.active_node_ids)  # those whose shares went out in the share-keys stage
        for neighbours in state.nid_to_neighbours.values():
            neighbours &= state.sampled_node_ids
        return super().collect_masked_vectors_stage(grid, context, state)

    def unmask_stage(self, grid, context, state):
        """A share or public key of the right form but wrong halts the round: whose it was, the server cannot tell.
        Flower 1.41 raises for one: ValueError (Shamir's combine, a key's PEM, a key of another curve), TypeError (an
        encrypted or non-EC public key), AttributeError (a non-EC private key: no exchange), AssertionError (a mask's
        seed of a length not a multiple of 4). Anything else (the grid's, the strategy's) is the server's fault."""
        try:
            return super().unmask_stage(grid, context, state)
        except (ValueError, TypeError, AttributeError, AssertionError) as exc:
            self.unmask_error = f"SecAgg+ could not unmask the sum: {type(exc).__name__}: {' '.join(str(exc).split())}"
            return False


class SecureAggregator:
    """Runs the train step of a round through SecAgg+; ``max_weight``: the largest FedAvg weight a client can report
    (1 under client-level DP, where every upload ends with its clipped bit: ``clipped_bits``)."""

    def __init__(self, cfg: SecAggConfig, max_weight: int, timeout: float, clipped_bits: bool = False):
        self.cfg, self.clipped_bits, self.timeout = cfg, clipped_bits, timeout
        if max_weight < 1:
            raise ValueError("secure aggregation: no client has a training example")
        if cfg.quantization_range < max_weight:
            raise ValueError(
                f"privacy.secagg.quantization_range {cfg.quantization_range} is below the largest client "
                f"weight {max_weight}: Flower's integer weights would round; raise it"
            )
        self.scale = cfg.quantization_range // max_weight  # s: Flower's integer weight of a client is n_i * s exactly

    def train_round(self, grid: Grid, messages: list[Message], rnd: int) -> SecureRound:
        run_id, offers = grid.run.run_id, []
        keys = list(messages[0].content[ARRAYS_KEY].keys()) if messages else []  # every message carries the global
        for m in messages:
            config = {**dict(m.content[CONFIG_KEY]), ARRAY_KEYS: json.dumps(keys)}
            fit_ins = FitIns(compat.arrayrecord_to_parameters(m.content[ARRAYS_KEY], keep_input=True), config)
            offers.append((GridClientProxy(m.metadata.dst_node_id, grid, run_id), fit_ins))
        strategy = _Offer(offers)
        server = Context(run_id=run_id, node_id=SUPERLINK_NODE_ID, node_config={}, state=RecordDict(), run_config={})
        context = LegacyContext(server, strategy=strategy, client_manager=SimpleClientManager())
        context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: rnd})
        context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()  # the offers carry the global
        workflow = _Workflow(
            self.cfg.num_shares,
            self.cfg.reconstruction_threshold,
            max_weight=self.cfg.quantization_range / self.scale,
            clipping_range=float(self.cfg.clipping_range),
            quantization_range=self.cfg.quantization_range,
            modulus_range=SECAGG_MODULUS,
            timeout=self.timeout,
        )
        shapes = [tuple(messages[0].content[ARRAYS_KEY][k].shape) for k in keys] if messages else []
        observed = _ObservedGrid(grid, [(1,), *shapes, *[(1,)] * self.clipped_bits], workflow)
        workflow(observed, context)

        in_sum = {n for n, o in observed.nodes.items() if o.metrics is not None}
        # the workflow always runs its setup stage, which keeps the round's state
        out = SecureRound(None, observed.nodes, in_sum, workflow.state.threshold, workflow.state.num_shares)
        if strategy.mean is None:
            out.halted = workflow.unmask_error or (
                f"SecAgg+ could not unmask the sum: {len(in_sum)} of {len(messages)} sampled clients "
                f"uploaded, reconstruction threshold {out.threshold} of {out.num_shares} shares"
            )
            return out
        mean = list(strategy.mean)  # the observer's shapes: one per adapter tensor, then the clipped bit
        if self.clipped_bits:  # how many of the summed uniformly weighted uploads were clipped, from the unmasked
            # mean of their bit coordinate (bit x c / 2): off an integer by about 4 summed / Q, far less than 1/2
            bit_mean = float(np.asarray(mean.pop(), dtype=np.float64).reshape(-1)[0])
            count = bit_mean * len(in_sum) / (self.cfg.clipping_range / 2)
            out.clipped_count = min(max(int(round(count)), 0), len(in_sum))
        dtype = messages[0].content[ARRAYS_KEY][keys[0]].numpy().dtype
        out.arrays = keyed(keys, [np.asarray(a, dtype=dtype) for a in mean])
        return out
