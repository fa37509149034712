"""SecAgg+ on the adapters fedmeet's clients send: the aggregation error against its bound, the protocol's time and
bytes, with and without a client dropped mid-round (privacy.secure_aggregation, pipeline.privacy.secure_aggregation.py).

One train step of a round runs through the production path (SecureAggregator on the server, secure_aggregation_mod
and legacy_fit on the clients) over the in-process Grid, each client's training replaced by a fixed upload: the
adapter set of the shape (k adapters of width m on hidden size n, as pipeline.modeling.adapters builds them) moved
away from its initialisation as training would move it. Measured against the plain FedAvg of the same uploads
(Flower's strategy, and the exact float64 mean) and against the bound of
pipeline.privacy.secure_aggregation.aggregation_error_bound. Times are the whole protocol (key agreement, share
encryption, masking, unmasking) on one process, no training; the Grid's deep copies included.

    python -m benchmarks.secure_aggregation                 # default and bart-base adapters, 3 and 10 clients
    python -m benchmarks.secure_aggregation --clients 3     # -> reports/bench/secure_aggregation.json
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import write_json  # noqa: E402
from pipeline.experiments.privacy import SecAggConfig  # noqa: E402


def adapter_uploads(
    hidden: int, top_k: int, bottleneck: int, names: list[str], seed: int = 0, drift: float = 0.02
) -> dict[str, dict[str, np.ndarray]]:
    """One adapter set per client: the initial adapters plus Gaussian drift of std ``drift`` on every tensor
    (W_up leaves zero, LayerNorm weights leave 1), different per client."""
    from pipeline.modeling.adapters import AdapterConfig, AdapterSet

    base = AdapterSet(hidden, AdapterConfig(top_k=top_k, bottleneck=bottleneck, seed=seed), [None] * top_k).state()
    g = torch.Generator().manual_seed(seed + 1)
    return {n: {k: (v + drift * torch.randn(v.shape, generator=g)).numpy() for k, v in base.items()} for n in names}


def secure_round(
    uploads: dict[str, dict[str, np.ndarray]], weights: dict[str, int], cfg: SecAggConfig, crash: str | None = None
):
    """One SecAgg+ train step over the in-process Grid: each client's train handler replies ``uploads[name]``
    with weight ``weights[name]`` through the production mod and legacy-fit path; ``crash``: that client raises
    instead of replying (after the key exchange, as a client dying while it trains). Returns (the aggregator,
    its SecureRound, every reply the server received)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from pipeline.federation.engines import InProcessGrid, _set_server_identity
    from pipeline.federation.strategies.catalog import build_strategy
    from pipeline.privacy.accounting import secure_sum_problem
    from pipeline.privacy.secure_aggregation import SecureAggregator, legacy_fit, secure_aggregation_mod

    app = ClientApp()

    @app.train(mods=[secure_aggregation_mod])
    def train(msg, context):
        name = context.node_config["client-name"]

        def trained(m, _context):
            if name == crash:
                raise RuntimeError("simulated crash while training")
            return Message(
                RecordDict(
                    {
                        "arrays": ArrayRecord({k: Array(v) for k, v in uploads[name].items()}),
                        "metrics": MetricRecord({"num-examples": weights[name]}),
                    }
                ),
                reply_to=m,
            )

        return legacy_fit(msg, context, trained)

    _set_server_identity(1)
    names = list(uploads)
    grid = InProcessGrid(app, [{"client-name": n} for n in names])
    seen: list = []
    real_pull = grid.pull_messages

    def pull(ids):
        replies = list(real_pull(ids))
        seen.extend(replies)
        return replies

    grid.pull_messages = pull
    strategy = build_strategy("fedavg", {}, fraction_train=1.0, client_lr=1e-3)
    global_ = ArrayRecord({k: Array(np.zeros_like(v)) for k, v in uploads[names[0]].items()})
    messages = list(strategy.configure_train(1, global_, ConfigRecord({"plan": "-"}), grid))
    # the plan stage's check: every client from round 1, all sampled (the strategy's fraction_train 1.0)
    if problem := secure_sum_problem(cfg, len(names), len(names), 1.0):
        raise ValueError(problem)
    secure = SecureAggregator(cfg, max(weights.values()), timeout=600)
    return secure, secure.train_round(grid, messages, 1), seen


def plain_fedavg(uploads: dict[str, dict[str, np.ndarray]], weights: dict[str, int]) -> dict[str, np.ndarray]:
    """Flower's FedAvg (the plain run's strategy) over the same uploads."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.strategies.catalog import build_strategy

    _set_server_identity(1)
    replies = []
    for i, (name, state) in enumerate(uploads.items()):
        ins = Message(RecordDict(), dst_node_id=1000 + i, message_type="train")
        ins.metadata.__dict__["_message_id"] = f"m{i}"
        replies.append(
            Message(
                RecordDict(
                    {
                        "arrays": ArrayRecord({k: Array(v) for k, v in state.items()}),
                        "metrics": MetricRecord({"num-examples": weights[name]}),
                    }
                ),
                reply_to=ins,
            )
        )
    strategy = build_strategy("fedavg", {}, fraction_train=1.0, client_lr=1e-3)
    arrays, _ = strategy.aggregate_train(1, replies)
    return {k: a.numpy() for k, a in arrays.items()}


def weighted_mean(states: list[dict[str, np.ndarray]], weights: list[int]) -> dict[str, np.ndarray]:
    """The exact (float64) FedAvg of ``states``."""
    total = float(sum(weights))
    return {k: sum(w * s[k].astype(np.float64) for s, w in zip(states, weights)) / total for k in states[0]}


def max_diff(a: dict, b: dict) -> float:
    """max over every tensor and coordinate of |a - b|."""
    return max(float(np.abs(np.asarray(a[k], dtype=np.float64) - np.asarray(b[k], dtype=np.float64)).max()) for k in b)


def max_abs(states: list[dict[str, np.ndarray]]) -> float:
    return max(float(np.abs(v).max()) for s in states for v in s.values())


def measure(
    shape: str, hidden: int, top_k: int, bottleneck: int, n_clients: int, cfg: SecAggConfig, drop: bool
) -> dict:
    from pipeline.privacy.secure_aggregation import aggregation_error_bound

    names = [f"client{i}" for i in range(n_clients)]
    weights = {n: 50 + 37 * i for i, n in enumerate(names)}  # unequal sizes, so the weighting matters
    uploads = adapter_uploads(hidden, top_k, bottleneck, names)
    crash = names[1] if drop else None
    np.random.seed(0)  # Flower's stochastic rounding
    t0 = time.perf_counter()
    secure, result, _ = secure_round(uploads, weights, cfg, crash)
    secure_s = time.perf_counter() - t0
    assert result.arrays is not None, result.halted
    summed = [n for n in names if n != crash]
    t0 = time.perf_counter()
    plain = plain_fedavg({n: uploads[n] for n in summed}, weights)
    plain_s = time.perf_counter() - t0
    got = {k: a.numpy() for k, a in result.arrays.items()}
    states, w = [uploads[n] for n in summed], [weights[n] for n in summed]
    largest = max_abs(states)
    bound = aggregation_error_bound(w, secure.scale, cfg, largest)
    err_plain, err_exact = max_diff(got, plain), max_diff(got, weighted_mean(states, w))
    n_params = sum(v.size for v in uploads[names[0]].values())
    live = [o for n, o in result.nodes.items() if o.failed_stage is None]
    return {
        "shape": shape,
        "adapter_params": int(n_params),
        "clients": n_clients,
        "dropped": crash,
        "in_sum": len(result.in_sum),
        "threshold": result.threshold,
        "num_shares": result.num_shares,
        "max_abs_error_vs_plain_fedavg": err_plain,
        "max_abs_error_vs_exact_mean": err_exact,
        "bound": bound,
        "error_over_bound": err_plain / bound,
        "within_bound": err_plain <= bound and err_exact <= bound,
        "max_abs_upload": largest,
        "secure_round_s": secure_s,
        "plain_fedavg_s": plain_s,
        "bytes_up_per_client": int(np.mean([o.bytes_up for o in live])),
        "bytes_down_per_client": int(np.mean([o.bytes_down for o in live])),
        "fp32_adapter_bytes": int(4 * n_params),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[3, 10])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from benchmarks.common import minilm_config
    from pipeline.common.cli import read_params
    from pipeline.experiments.privacy import PrivacyConfig
    from pipeline.planning import ModelGroup

    _, privacy, model = read_params(args.params, privacy=PrivacyConfig, model=ModelGroup)
    cfg = privacy.secagg
    shapes = [
        ("default (MiniLM-L6 BERT2BERT)", minilm_config()["hidden_size"], model.top_k, model.bottleneck),
        ("bart-base", 768, 3, 1536),
    ]
    warm = adapter_uploads(8, 1, 4, ["a", "b", "c"])  # imports and first-call costs stay out of the timings
    secure_round(warm, {"a": 1, "b": 2, "c": 3}, cfg)
    rows = []
    for shape, hidden, k, m in shapes:
        for n in args.clients:
            for drop in (False, True):
                row = measure(shape, hidden, k, m, n, cfg, drop)
                rows.append(row)
                print(
                    f"{shape:32s} {n:3d} clients{' (1 dropped)' if drop else '':12s} max |secagg - fedavg| "
                    f"{row['max_abs_error_vs_plain_fedavg']:.3g} <= bound {row['bound']:.3g} "
                    f"({row['error_over_bound']:.2f}); {row['secure_round_s']:.2f} s vs plain "
                    f"{row['plain_fedavg_s']:.3f} s; up {row['bytes_up_per_client'] / 2**20:.1f} MiB/client "
                    f"(fp32 adapter {row['fp32_adapter_bytes'] / 2**20:.1f} MiB)",
                    flush=True,
                )
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "secure_aggregation.json", {"secagg": cfg.__dict__, "torch_threads": 1, "rows": rows})


if __name__ == "__main__":
    main()
