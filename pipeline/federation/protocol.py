"""What travels between the ServerApp and the ClientApps (Flower Message API, flwr 1.41): the record keys, the
metrics a reply holds, the plan a message refers to, and the adapters as they go over the wire (compression)."""

from __future__ import annotations

import io
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.constant import SType
from flwr.serverapp import Grid
from flwr.supercore.differential_privacy import KEY_NORM_BIT

from pipeline.common.config import from_dict
from pipeline.experiments.plans import Plan, read_plan
from pipeline.experiments.settings import CacheConfig
from pipeline.federation.compression import SCALE_SUFFIX, decode_state, encode_state
from pipeline.federation.strategies.registry import NUM_EXAMPLES_KEY, NUM_STEPS_KEY
from pipeline.training.shared_model import initial_adapter_state

ARRAYS_KEY = "arrays"  # Flower strategies' default ArrayRecord key
CONFIG_KEY = "config"
METRICS_KEY = "metrics"
IDENTIFY = "query.identify"
START_OVER = "start-over"  # in the admission's query.identify: the run starts at round 1 (client_app.client_identify)
PLAN_HASH = "plan-hash"  # query.identify's: the server's plan (Plan.hash); its reply's: the node's (refused if other)

COUNT = (int, 0, math.inf)  # a count's type and bounds in a spec (metrics_row's): a whole number >= 0
# What a train reply's MetricRecord holds: counts and aggregate losses only (NUM_EXAMPLES_KEY: the FedAvg weight),
# each with its history row field (the LocalResult attribute it comes from, but for the weight) and type.
TRAIN_METRICS = {
    NUM_EXAMPLES_KEY: ("weight", *COUNT),
    "num-trained": ("n_examples", *COUNT),
    NUM_STEPS_KEY: ("n_steps", *COUNT),
    "num-tokens": ("n_tokens", *COUNT),
    "train-loss": ("train_loss", float),
    "ce": ("ce", float),
    "kd": ("kd", float),
    "kd-fraction": ("kd_fraction", float),
    "proximal": ("proximal", float),
}
# What an evaluate reply's MetricRecord holds besides NUM_EXAMPLES_KEY (client_app.client_evaluate), as TRAIN_METRICS;
# val-loss any float: a diverged client's NaN or inf is its report (a NaN round mean is never best: training.stopping).
EVAL_METRICS = {
    "val-loss": ("val_loss", float),
    "val-tokens": ("val_tokens", *COUNT),
    "best-round": ("best_round", *COUNT),
}
# Added under privacy.mode example: the client's DP-SGD report (pipeline.privacy.seam.account), each key as
# TRAIN_METRICS, bounded: finite (-1: an unbounded epsilon or max_grad_norm), delta and sampling rate in [0, 1].
FINITE = math.nextafter(math.inf, 0)  # the largest float: a bound that refuses inf (opacus' accountant never returns)
DP_METRICS = {
    "dp-epsilon": ("epsilon", float, -1, FINITE),
    "dp-delta": ("delta", float, 0, 1),
    "dp-noise-multiplier": ("noise_multiplier", float, 0, FINITE),
    "dp-max-grad-norm": ("max_grad_norm", float, -1, FINITE),
    "dp-sample-rate": ("sample_rate", float, 0, 1),
    "dp-steps": ("dp_steps", *COUNT),
    "dp-examples": ("dp_examples", *COUNT),
    "dp-clipped": ("dp_clipped", *COUNT),
}
# Added under privacy.mode client with client-side clipping: whether the update exceeded C before the mod clipped it.
CLIPPED_KEY = "dp-update-clipped"
# Added under SecAgg+: the upload coordinates its quantiser clipped to +-clipping_range.
SECAGG_CLIPPED_KEY = "secagg-clipped"


# A client's run-time settings (RunSettings.cache; none changes a result); a client never reads a params file.
CLIENT_SETTING_KEYS = {"cache-dir": "cache_dir", "cache-max-gb": "cache_max_gb"}


def client_settings_config(cache: CacheConfig) -> dict[str, str | float]:
    return {key: getattr(cache, name) for key, name in CLIENT_SETTING_KEYS.items()}


def _setting(key: str, msg: Message | None, context: Context) -> Any:
    """``key`` from the node config, else the run config, else the message's config; None where none sets it."""
    message_config = msg.content[CONFIG_KEY] if msg is not None and CONFIG_KEY in msg.content else {}
    for source in (context.node_config, context.run_config, message_config):
        if source.get(key) not in (None, ""):
            return source[key]
    return None


def client_cache_config(msg: Message | None, context: Context) -> CacheConfig:
    """A key none of the configs sets is an error (a client never runs on defaults it was not given)."""
    values = {name: _setting(key, msg, context) for key, name in CLIENT_SETTING_KEYS.items()}
    if missing := [key for key, name in CLIENT_SETTING_KEYS.items() if values[name] is None]:
        raise ValueError(
            f"client settings: {missing} set neither in the node config (--node-config "
            f'"{missing[0]}=..."), the run config nor the message'
        )
    return from_dict(CacheConfig, values, "client settings")  # its types checked there (an integer passes for a number)


class GridView:
    """What a strategy uses of ``grid`` (its node ids), showing only ``node_ids`` when given (a copy each call: a
    strategy sees only the admitted nodes, or the round's sample); SecAgg+'s workflow's view adds send_and_receive."""

    def __init__(self, grid: Grid, node_ids: list[int] | None = None):
        self._grid, self._node_ids = grid, None if node_ids is None else list(node_ids)

    def get_node_ids(self) -> list[int]:
        return self._grid.get_node_ids() if self._node_ids is None else list(self._node_ids)


@lru_cache(maxsize=256)  # every plan of a set (the GPU study's 30), whose clients read theirs every round
def _plan_cached(path: str, mtime: float) -> Plan:
    return read_plan(path)


def plan_path_of(msg: Message | None, context: Context) -> str:
    """The plan file a node runs: node config ``plan``, run config ``plan``, or the message's config."""
    if (plan := _setting("plan", msg, context)) is None:
        raise ValueError("no plan: set node_config 'plan', run_config 'plan', or send it in the message config")
    return str(plan)


def load_plan(path: str) -> Plan:
    """The plan at ``path``, read once per file version (none there: read_plan's FileNotFoundError)."""
    p = Path(path)
    return _plan_cached(str(p.resolve()), p.stat().st_mtime) if p.exists() else read_plan(p)


def delta_encoded(plan: Plan) -> bool:
    """Delta encoding applies: train.transfer_delta with a lossy encoding (fp32 is exact)."""
    return plan.train.transfer_delta and plan.train.transfer_dtype != "fp32"


def downlink_reference(plan: Plan) -> dict[str, torch.Tensor] | None:
    """The reference of a delta-encoded downlink: the round-0 adapter, which every node derives on its own."""
    return initial_adapter_state(plan) if delta_encoded(plan) else None


def encode_global(state: dict[str, torch.Tensor], plan: Plan) -> ArrayRecord:
    """Server -> client: the global adapter as it travels (delta encoding: against downlink_reference)."""
    return encode_reply(state, plan, downlink_reference(plan))


def decode_global(record: ArrayRecord, plan: Plan) -> dict[str, torch.Tensor]:
    """Client side: the float32 global from what the server sent."""
    return decode_state(record.to_torch_state_dict(), reference=downlink_reference(plan))


def encode_reply(local: dict[str, torch.Tensor], plan: Plan, received: dict[str, torch.Tensor] | None) -> ArrayRecord:
    """Client -> server: the local adapter as it travels (delta encoding: against the global received)."""
    return ArrayRecord.from_torch_state_dict(
        encode_state(local, plan.train.transfer_dtype, reference=received if delta_encoded(plan) else None)
    )


def decode_reply(record: ArrayRecord, plan: Plan, sent: dict[str, torch.Tensor]) -> ArrayRecord:
    """Server side: a reply's float32 local adapter as the strategy aggregates it; ``sent`` = this round's decoded
    global (as the client decoded it, bit for bit). Float32 arrays without a delta are that already (decoding and
    encoding again gives their bytes back). Arrays other than the adapter's (by key and the shape their bytes hold),
    of a dtype no encoding sends (torch cannot hold text or dates: its TypeError), or holding NaN or inf (which no
    client's encode_state sends; FedAvg would average it in), raise ValueError naming them."""
    held = {}  # what each Array's bytes hold, which the strategy reads (np.load), not the shape and dtype it declares
    for k, a in record.items():
        try:
            held[k] = npy_header(a.data if a.stype == SType.NUMPY else b"")
        except ValueError as exc:
            raise ValueError(f"its array {k!r} is not the .npy its bytes should be: {exc}") from None
    adapter = {k: tuple(v.shape) for k, v in sent.items()}
    shapes = {k: shape for k, (shape, _) in held.items() if not k.endswith(SCALE_SUFFIX)}
    if odd := sorted(k for k in shapes.keys() | adapter.keys() if shapes.get(k) != adapter.get(k)):
        raise ValueError(f"its arrays are not the adapter's (other keys or shapes): {odd[:4]}")
    if odd := {k: str(d) for k, (_, d) in held.items() if d not in (np.float32, np.float16, np.int8)}:
        raise ValueError(f"its arrays are not float32, float16 or int8 (native byte order): {sorted(odd.items())[:4]}")
    delta = delta_encoded(plan)
    # in the global's key order: client-level DP's clipping takes the update position by position against it
    if not delta and all(d == np.float32 and not k.endswith(SCALE_SUFFIX) for k, (_, d) in held.items()):
        out = record if list(record) == list(sent) else ArrayRecord({k: record[k] for k in sent})
    else:
        decoded = decode_state(record.to_torch_state_dict(), reference=sent if delta else None)
        out = ArrayRecord.from_torch_state_dict({k: decoded[k] for k in sent})
    if odd := [k for k, a in out.items() if not np.isfinite(a.numpy()).all()]:
        raise ValueError(f"its arrays hold NaN or inf: {odd[:4]}")
    return out


def npy_header(blob: bytes) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype np.load gives ``blob`` (or its ValueError), from the .npy header alone (it may declare
    terabytes), checked to be followed by exactly that many bytes: np.load of an integer one cannot fail."""
    f = io.BytesIO(blob)
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0), (3, 0)):
        raise ValueError(f"not a .npy format version np.load reads: {version}")
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(f)
    if len(blob) != f.tell() + math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{len(blob) - f.tell()} data bytes for {dtype}{list(shape)}")
    return shape, dtype


def replies_by_node(grid: Grid, messages: list[Message], timeout: float | None) -> dict[int, Message]:
    """Each reply (in the order they came) by the node its message went to: a SuperLink answers for an offline node
    itself, from its own id."""
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    node = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}  # ids: given when the grid sends them
    return {node[r.metadata.reply_to_message_id]: r for r in replies}


def unanswered(messages: list[Message], replies: dict[int, Message]) -> list[int]:
    """The nodes ``messages`` went to that ``replies`` (replies_by_node's) has no reply of, in the messages' order."""
    return [m.metadata.dst_node_id for m in messages if m.metadata.dst_node_id not in replies]


def misnamed(reply: Message, node: int, admitted: str) -> str | None:
    """Why a train or evaluate reply of ``node``, admitted as client ``admitted``, does not count: it names another
    client (under --auth a SuperNode restarted with another client-name keeps its node id); None if it names the same
    or none (SecAgg+'s train stages carry the protocol's records only: the round's evaluate reply names it)."""
    named = reply.content.config_records.get("identity", {}).get("client-name")
    return None if named in (None, admitted) else f"node {node} answers as client {named!r}, admitted as {admitted!r}"


def error_line(reply: Message) -> str:
    """A failed reply's reason, its first line (a client's is one line, docs/privacy.md), or its code if it has none."""
    return reply.error.reason.splitlines()[0] if reply.error.reason else f"code {reply.error.code}"


def payload_bytes(content: RecordDict) -> int:
    """A message's adapter bytes as encoded on the wire (bytes up/down)."""
    return sum(rec.count_bytes() for rec in content.array_records.values())


def metrics_row(m: MetricRecord | dict, spec: dict[str, tuple], what: str = "metrics") -> dict[str, Any]:
    """A reply's metrics ``spec`` names (key -> history row field or None, type[, lowest, highest]) as the row's fields;
    a key missing or a value not one number of its type (an int: whole) within the bounds given (both in: finite)
    raises ValueError naming it and ``what`` they are (a malformed reply: its failure)."""
    if odd := {key: m.get(key) for key, (_, *kind) in spec.items() if not _number(m.get(key), *kind)}:
        raise ValueError(f"its {what} lack or hold no single number of their type: {odd}")
    return {field: kind(m[key]) for key, (field, kind, *_) in spec.items() if field is not None}


def train_reply_metrics(content: RecordDict, plan: Plan) -> dict[str, Any]:
    """A train reply's metrics in the clear as train_reply_row reads them, the reply checked as Flower's strategies
    need every reply of a round (or they raise InconsistentMessageReplies, ending the run): one ArrayRecord
    ARRAYS_KEY and one MetricRecord METRICS_KEY. Else ValueError naming it."""
    records = (list(content.array_records), list(content.metric_records))
    if records != ([ARRAYS_KEY], [METRICS_KEY]):
        raise ValueError(f"its array and metric records are not [{ARRAYS_KEY!r}], [{METRICS_KEY!r}]: {records}")
    return train_reply_row(content.metric_records[METRICS_KEY], plan)


def train_reply_row(m: MetricRecord | dict, plan: Plan) -> dict[str, Any]:
    """A train reply's metrics (in the clear, or those SecAgg+'s FitRes carried) as its row's fields, its DP-SGD
    report read (-1: unbounded): the keys ``plan``'s replies hold and no other, each one number of its type:
    TRAIN_METRICS; DP_METRICS under example-level DP; SECAGG_CLIPPED_KEY under SecAgg+ (whose legacy_fit sends the
    clipping marks in the masked vector); in the clear under client-side clipping (no row fields) Flower's mod's
    KEY_NORM_BIT if adaptive, and CLIPPED_KEY (a reply without it is ClientLevelDP.clipped's: not clipped within C),
    each 0 or 1 (ClientLevelDP reads them with int()). Else, or unless it trained (num-examples, num-steps at least
    1: FedAvg divides by the weights' sum, FedNova by each client's steps; a client with an empty train split cannot
    even identify: client_data.read_partition), ValueError naming it."""
    p = plan.privacy
    spec = TRAIN_METRICS | (DP_METRICS if p is not None and p.mode == "example" else {})
    if p is not None and p.secure_aggregation:
        spec |= {SECAGG_CLIPPED_KEY: ("secagg_clipped", *COUNT)}
    elif p is not None and p.mode == "client" and p.clipping_side == "client":
        marks = ({KEY_NORM_BIT} if p.clipping == "adaptive" else set()) | ({CLIPPED_KEY} & m.keys())
        spec |= {key: (None, int, 0, 1) for key in sorted(marks)}
    if extra := sorted(m.keys() - spec.keys()):
        raise ValueError(f"its metrics hold keys the plan's replies do not: {extra}")
    row = metrics_row(m, spec)
    if row["weight"] < 1 or row["n_steps"] < 1:
        raise ValueError(f"it reports no training: num-examples {row['weight']}, num-steps {row['n_steps']}")
    if "epsilon" not in row:
        return row
    if odd := {field: row[field] for field in ("epsilon", "max_grad_norm") if -1 < row[field] < 0}:
        raise ValueError(f"its DP-SGD report holds a negative other than -1 (the mark of unbounded): {odd}")
    row |= {field: None for field in ("epsilon", "max_grad_norm") if row[field] < 0}
    return row | {"clipped_fraction": row["dp_clipped"] / row["dp_examples"] if row["dp_examples"] else 0.0}


def _number(value: Any, kind: type, *within: float) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or within and not within[0] <= value <= within[1]:
        return False
    return kind is float or float(value).is_integer()
