"""Client-level DP across organisations (issue 19 item 2) at 3, 30 and 100 clients: epsilon and the utility cost.

    python -m benchmarks.client_dp                   # -> reports/privacy/client_dp.{json,png}
    python -m benchmarks.client_dp --sizes 3 30 --rounds 4 --out /tmp/cdp

Per client count N, a tiny federated workspace as benchmarks/scale.py builds it (tests/tiny_models.py: tiny BART,
a quantity Dir(50) partition of a synthetic QMSum-like pool) and FedAvg over R rounds:

- the non-private reference: FedAvg (size-weighted mean) sampling m clients per round;
- ``privacy.mode: client``, server-side fixed clipping at C, noise multiplier z in NOISE (z = 0: clipping and
  uniform weights alone), with the same sampling.

Sampling: every client every round (m = N, q = 1; the noise on the mean update is z C / N), and for N >= 30 also
m = 10 per round (q = 10 / N; the noise is z C / 10, the accountant amplifies by q). C is the median L2 norm of
the round-1 updates of up to 10 clients (trained from the round-0 adapter, as round 1 does): about half the
updates are clipped in round 1. Utility: the clients' mean validation loss after the last round (the global
adapter on each client's own valid split), minus the reference's, also as the share of the reference's progress
from the round-0 adapter it costs; and ``z sqrt(d) / m``, the norm of the noise vector over C (d adapter
parameters): what decides the cost, and why a real backbone's adapters (d in the millions) need far more clients
per round than the tiny one's (d = 1232). epsilon: the run's, delta 1e-5, RDP.

The accountant table needs no training: the z that reaches epsilon in {1, 3, 8} over 100 rounds at (N, m), and
the noise it puts on the mean update in units of C (z / m): the cost in utility follows that number.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import numpy as np  # noqa: E402

import pipeline.privacy.seam  # noqa: E402, F401 (registers privacy's mechanisms, as the train stage does)
from benchmarks.scale import BACKBONE, ScaleConfig, _in_workspace, make_workspace  # noqa: E402

SIZES = (3, 30, 100)
NOISE = (0.0, 0.3, 1.0, 3.0)
SAMPLED = 10  # clients per round in the sampled runs (N >= 30)
DELTA = 1e-5
# The accountant table: federations from 3 organisations to a cross-device population, 100 rounds.
TABLE_POINTS = ((3, 3), (30, 30), (30, 10), (100, 100), (100, 10), (1000, 100), (10000, 100))
TABLE_EPSILONS = (1.0, 3.0, 8.0)
TABLE_ROUNDS = 100


@dataclass
class ClientDPConfig:
    sizes: tuple[int, ...] = SIZES
    noise: tuple[float, ...] = NOISE
    # 8 rounds of 2 local epochs at lr 0.03: the tiny model's validation loss falls from ~6.0 to ~5.5 without
    # privacy (3 clients), so the noise has progress to spoil (the scale benchmark's lr 5e-3 barely moves it)
    rounds: int = 8
    lr: float = 3.0e-2
    local_epochs: int = 2
    train_per_client: int = 4  # pool size per split = this x clients (the scale benchmark's Dir(50) partition)
    eval_per_client: int = 2
    seed: int = 0
    threads: int = 1


def _scale_config(cfg: ClientDPConfig) -> ScaleConfig:
    return ScaleConfig(
        sizes=cfg.sizes,
        engines=("inprocess",),
        rounds=cfg.rounds,
        train_per_client=cfg.train_per_client,
        eval_per_client=cfg.eval_per_client,
        seed=cfg.seed,
    )


def measure_pool(root: Path, n: int, cfg: ClientDPConfig, backbone: Path) -> dict[str, Any]:
    """Before training: the median L2 norm of round-1 updates (up to 10 clients, each trained once from the
    round-0 adapter; C), the round-0 adapter's size d and the clients' mean validation loss under it."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from pipeline.experiments.plans import read_plan
    from pipeline.experiments.settings import CacheConfig
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.protocol import client_settings_config
    from pipeline.privacy.client_dp import update_norm
    from pipeline.training.client_data import client_data, client_names
    from pipeline.training.client_training import validation_loss
    from pipeline.training.shared_model import initial_adapter_state, shared_model

    path = make_workspace(
        root,
        n,
        "inprocess",
        _scale_config(cfg),
        backbone,
        name=f"norms-{n}",
        train={"lr": cfg.lr, "local_epochs": cfg.local_epochs},
    )
    with _in_workspace(root):
        plan = read_plan(path)
        _set_server_identity(1)
        initial = initial_adapter_state(plan)
        received = ArrayRecord.from_torch_state_dict(initial)
        model = shared_model(plan)
        model.load_adapter_state("local", initial)
        initial_loss = [validation_loss(model, plan, client_data(plan, c).valid)[0] for c in client_names(plan)]
        norms = []
        for i, name in enumerate(client_names(plan)[:10]):
            context = Context(
                run_id=1,
                node_id=1000 + i,
                node_config={"client-name": name},
                state=RecordDict(),
                run_config=client_settings_config(CacheConfig(cache_dir=str(root / "cache"))),
            )
            msg = Message(
                RecordDict({"arrays": received, "config": ConfigRecord({"server-round": 1, "plan": path})}),
                dst_node_id=1000 + i,
                message_type="train",
            )
            msg.metadata.__dict__["_message_id"] = f"norm{i}"
            norms.append(update_norm(client_app(msg, context).content["arrays"], received))
    return {
        "clipping_norm": round(float(np.median(norms)), 6),
        "round1_update_norms": [round(x, 6) for x in norms],
        "adapter_parameters": int(sum(v.numel() for v in initial.values())),
        "initial_val_loss_mean": float(np.mean(initial_loss)),
    }


def run_point(
    root: Path, n: int, cfg: ClientDPConfig, backbone: Path, name: str, sampled: int, privacy: dict[str, Any] | None
) -> dict[str, Any]:
    """One training run; its epsilon, clipped fraction and the clients' mean final validation loss."""
    from pipeline.experiments.settings import RunSettings
    from pipeline.privacy.accounting import sampled_per_round
    from pipeline.train import run_experiment

    fraction = 1.0 if sampled == n else (sampled + 0.5) / n  # Flower samples int(n * fraction)
    assert sampled_per_round(n, fraction) == sampled
    path = make_workspace(
        root,
        n,
        "inprocess",
        _scale_config(cfg),
        backbone,
        name=name,
        train={"fraction_train": fraction, "lr": cfg.lr, "local_epochs": cfg.local_epochs},
        privacy=privacy,
    )
    t0 = time.perf_counter()
    with _in_workspace(root):
        metrics = run_experiment(path, track=False, settings=RunSettings())
    final = [c["final_val_loss"] for c in metrics["clients"].values()]
    p = metrics.get("privacy") or {}
    return {
        "name": name,
        "clients": n,
        "sampled": sampled,
        "sample_rate": sampled / n,
        "noise_multiplier": p.get("noise_multiplier"),
        "clipping_norm": p.get("clipping_norm"),
        "noise_std_on_mean": (p["noise_multiplier"] * p["clipping_norm"] / sampled) if p else 0.0,
        "epsilon": p.get("epsilon") if p else None,
        "delta": p.get("delta"),
        "clipped_fraction": p.get("clipped_fraction"),
        "final_val_loss_mean": float(np.mean(final)),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def accountant_table() -> list[dict[str, Any]]:
    """The z that reaches each epsilon over TABLE_ROUNDS rounds at (N, m), and z / m (noise on the mean per C)."""
    from pipeline.experiments.privacy import PrivacyConfig
    from pipeline.privacy.accounting import federation_privacy

    rows = []
    for n, m in TABLE_POINTS:
        for eps in TABLE_EPSILONS:
            cfg = PrivacyConfig(mode="client", target_epsilon=eps, clipping_norm=1.0, delta=DELTA)
            s = federation_privacy(cfg, population=n, sampled=m, rounds=TABLE_ROUNDS)
            rows.append(
                {
                    "clients": n,
                    "sampled": m,
                    "sample_rate": m / n,
                    "rounds": TABLE_ROUNDS,
                    "target_epsilon": eps,
                    "noise_multiplier": round(s.noise_multiplier, 4),
                    "noise_std_on_mean_per_c": round(s.noise_multiplier / m, 5),
                    "epsilon": round(s.bound_after(TABLE_ROUNDS)[0], 4),
                }
            )
    return rows


def bench(cfg: ClientDPConfig, work: Path | None = None, progress=print) -> dict[str, Any]:
    import torch

    from tests.tiny_models import save_tiny

    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    runs, norms = [], {}
    with tempfile.TemporaryDirectory(prefix="fedmeet-client-dp-") as tmp:
        base = Path(work or tmp)
        backbone = base / "backbone"
        if not backbone.exists():
            save_tiny("bart", backbone)
        for n in cfg.sizes:
            root = base / f"n{n}"
            pool = norms[n] = measure_pool(root, n, cfg, backbone)
            c, d = pool["clipping_norm"], pool["adapter_parameters"]
            for m in sorted({n} | ({SAMPLED} if n >= 3 * SAMPLED else set()), reverse=True):
                reference = run_point(root, n, cfg, backbone, f"ref-n{n}-m{m}", m, None)
                reference["reference"] = True
                runs.append(reference)
                for z in cfg.noise:
                    privacy = {"mode": "client", "noise_multiplier": z, "clipping_norm": c, "delta": DELTA}
                    point = run_point(root, n, cfg, backbone, f"dp-n{n}-m{m}-z{z}", m, privacy)
                    point["val_loss_increase"] = point["final_val_loss_mean"] - reference["final_val_loss_mean"]
                    # the share of the reference's progress from the round-0 adapter that the privacy cost
                    point["progress_lost"] = point["val_loss_increase"] / (
                        pool["initial_val_loss_mean"] - reference["final_val_loss_mean"]
                    )
                    # the noise vector's norm over the bound on one update: z C sqrt(d) / m against C
                    point["noise_norm_over_c"] = z * math.sqrt(d) / m
                    runs.append(point)
                    progress(
                        f"N={n} m={m} z={z}: epsilon {point['epsilon']}, val loss "
                        f"{point['final_val_loss_mean']:.4f} ({point['val_loss_increase']:+.4f})"
                    )
    return {
        "meta": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "seconds": round(time.perf_counter() - t0, 1),
        },
        "config": asdict(cfg),
        "backbone": BACKBONE,
        "method": "fedavg",
        "privacy": {
            "mode": "client",
            "clipping_side": "server",
            "clipping": "fixed",
            "delta": DELTA,
            "accountant": "rdp",
            "sampling": "poisson",
        },
        "pools": norms,
        "runs": runs,
        "accountant_table": accountant_table(),
    }


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in res["runs"]:
        if not r.get("reference"):
            groups.setdefault((r["clients"], r["sampled"]), []).append(r)
    for (n, m), rows in sorted(groups.items()):
        rows = sorted(rows, key=lambda r: r["noise_multiplier"])
        z = [r["noise_multiplier"] for r in rows]
        label = f"N={n}, m={m}"
        axes[0].plot(z, [r["val_loss_increase"] for r in rows], marker="o", label=label)
        bounded = [r for r in rows if r["epsilon"] is not None]
        axes[1].plot([r["noise_multiplier"] for r in bounded], [r["epsilon"] for r in bounded], marker="o", label=label)
    axes[0].axhline(0.0, color="grey", lw=0.8)
    axes[0].set(
        xlabel="noise multiplier z",
        ylabel="final validation loss - non-private",
        title=f"utility cost ({res['config']['rounds']} rounds)",
    )
    axes[1].set(
        xlabel="noise multiplier z",
        ylabel=f"epsilon (delta {DELTA:g})",
        yscale="log",
        title=f"epsilon after {res['config']['rounds']} rounds",
    )
    for eps in TABLE_EPSILONS:
        rows = [r for r in res["accountant_table"] if r["target_epsilon"] == eps]
        axes[2].plot(
            range(len(rows)), [r["noise_std_on_mean_per_c"] for r in rows], marker="o", label=f"epsilon {eps:g}"
        )
        axes[2].set_xticks(range(len(rows)), [f"{r['clients']}/{r['sampled']}" for r in rows], fontsize=8)
    axes[2].set(
        xlabel="clients N / sampled per round m",
        ylabel="noise std on the mean update / C",
        yscale="log",
        title=f"noise for a target epsilon, {TABLE_ROUNDS} rounds",
    )
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Client-level DP (server-side fixed clipping, C = median round-1 update norm), FedAvg on {res['backbone']}",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(res: dict[str, Any]) -> str:
    """The runs as a table (client_dp.md beside the JSON, so no document copies these numbers by hand)."""
    lines = [
        f"# Client-level DP, FedAvg on {res['backbone']}",
        "",
        f"Generated by `python -m benchmarks.client_dp` ({res['config']['rounds']} rounds, one seed; "
        f"{res['privacy']['clipping_side']}-side {res['privacy']['clipping']} clipping at C = the median "
        f"round-1 update norm; client sampling: {res['privacy']['sampling']}; RDP accountant, delta "
        f"{res['privacy']['delta']:g}; finished {res['meta']['finished_at']}).",
        "",
        "| clients N | per round m | z | epsilon | z sqrt(d) / m | val loss vs non-private (share of its progress) |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        if r.get("reference"):
            continue
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.3g}"
        lines.append(
            f"| {r['clients']} | {r['sampled']} | {r['noise_multiplier']:g} | {eps} | "
            f"{r['noise_norm_over_c']:.3g} | {r['val_loss_increase']:+.3f} ({r['progress_lost']:.0%}) |"
        )
    initial = [p["initial_val_loss_mean"] for p in res["pools"].values()]
    refs = [r["final_val_loss_mean"] for r in res["runs"] if r.get("reference")]
    lines += [
        "",
        f"Non-private runs: the clients' mean validation loss goes from {min(initial):.2f}-{max(initial):.2f} "
        f"(round-0 adapter) to {min(refs):.2f}-{max(refs):.2f}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--noise", type=float, nargs="+", default=list(NOISE))
    ap.add_argument("--rounds", type=int, default=ClientDPConfig.rounds)
    ap.add_argument("--out", type=Path, default=Path("reports/privacy"))
    args = ap.parse_args(argv)
    res = bench(ClientDPConfig(sizes=tuple(args.sizes), noise=tuple(args.noise), rounds=args.rounds))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "client_dp.json").write_text(json.dumps(res, indent=2) + "\n")
    (args.out / "client_dp.md").write_text(markdown(res))
    plot(res, args.out / "client_dp.png")
    print(f"client-level DP benchmark written to {args.out}/client_dp.json and .png in {res['meta']['seconds']:.0f} s")


if __name__ == "__main__":
    main()
