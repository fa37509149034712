"""A scheme's partition made and checked (leakage guard, disjoint, complete; stage ``partition``:
pipeline/partition.py), its file, and its statistics: label counts per client, Jensen-Shannon divergences between
the clients' training label distributions (METHOD.md section 10) and their figure."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.common import atomic
from pipeline.common.schema import SPLITS, DataError
from pipeline.partitioning.schemes import SCHEMES, Partition, PartitionConfig, guard_leakage

EXAMPLE_COLUMNS_USED = ["example_id", "dataset", "domain", "split", "meeting_id", "target"]
JS_DEFINITION = (
    "0.5*KL(p||m) + 0.5*KL(q||m), m = (p+q)/2, in bits: the Jensen-Shannon DIVERGENCE, in [0, 1], between the "
    "clients' training label distributions (scipy.spatial.distance.jensenshannon(p, q, base=2) squared)"
)


def make_partition(examples: pd.DataFrame, scheme: str, seed: int, cfg: PartitionConfig) -> Partition:
    """Run ``scheme`` with ``seed``, apply the leakage guard and check the result is disjoint and complete."""
    part = SCHEMES[scheme](examples, cfg, np.random.default_rng(seed))
    guard_leakage(part, dict(zip(examples.example_id, examples.meeting_id)))
    check_partition(part, examples)
    return part


def check_partition(part: Partition, examples: pd.DataFrame) -> None:
    """Each example at most once among the clients, never both assigned and excluded, split kept, and every
    example of the domains the partition touches accounted for."""
    assigned = part.assigned()
    if dup := [i for i, n in Counter(assigned).items() if n > 1]:
        raise DataError(f"partition gives {len(dup)} example(s) to more than one client/split, e.g. {dup[0]}")
    if both := set(assigned) & set(part.excluded):
        raise DataError(f"{len(both)} example(s) are both assigned and excluded, e.g. {sorted(both)[0]}")
    split_of = dict(zip(examples.example_id, examples.split))
    for name, client in part.clients.items():
        for split in SPLITS:
            if wrong := [i for i in client[split] if split_of[i] != split]:
                raise DataError(f"client {name}: {wrong[0]} is a {split_of[wrong[0]]} example in its {split} set")
    accounted = set(assigned) | set(part.excluded)
    touched = examples.domain.isin(examples.domain[examples.example_id.isin(accounted)])
    if missing := set(examples.example_id[touched]) - accounted:
        raise DataError(
            f"{len(missing)} example(s) of the partitioned domains are neither assigned nor excluded, "
            f"e.g. {sorted(missing)[0]}"
        )


def excluded_counts(part: Partition) -> dict[str, Any]:
    return {"count": len(part.excluded), "by_reason": dict(sorted(Counter(part.excluded.values()).items()))}


def partition_json(part: Partition, scheme: str, seed: int, cfg: PartitionConfig) -> dict[str, Any]:
    params = asdict(getattr(cfg, scheme)) if hasattr(cfg, scheme) else {}
    excluded = excluded_counts(part) | {"example_ids": sorted(part.excluded)}
    return {"scheme": scheme, "seed": seed, "params": params, "clients": part.clients, "excluded": excluded}


def js_matrix(dists: list[np.ndarray]) -> list[list[float | None]]:
    from scipy.spatial.distance import jensenshannon  # lazy: importing scipy takes ~0.4 s

    return [
        [None if p.sum() == 0 or q.sum() == 0 else float(f"{jensenshannon(p, q, base=2) ** 2:.4g}") for q in dists]
        for p in dists
    ]


def partition_stats(part: Partition, examples: pd.DataFrame, scheme: str, seed: int) -> dict[str, Any]:
    domain_of = dict(zip(examples.example_id, examples.domain))
    label_of = part.labels  # every scheme labels its examples: the domain, or the cluster of scheme cluster
    labels = sorted({label_of[i] for i in part.assigned()})
    clients: dict[str, Any] = {}
    for name, c in part.clients.items():
        train_labels = Counter(label_of[i] for i in c["train"])
        clients[name] = {
            "sizes": {s: len(c[s]) for s in SPLITS},
            "train_label_counts": {lab: train_labels.get(lab, 0) for lab in labels},
            "label_counts": {s: dict(sorted(Counter(label_of[i] for i in c[s]).items())) for s in SPLITS},
            "domain_counts": {s: dict(sorted(Counter(domain_of[i] for i in c[s]).items())) for s in SPLITS},
        }
    matrix = js_matrix([np.array(list(c["train_label_counts"].values()), dtype=float) for c in clients.values()])
    off = [v for a, row in enumerate(matrix) for b, v in enumerate(row) if a < b and v is not None]
    return {
        "scheme": scheme,
        "seed": seed,
        "label": "cluster" if scheme == "cluster" else "domain",
        "labels": labels,
        "clients": clients,
        "js_divergence": {
            "definition": JS_DEFINITION,
            "clients": list(part.clients),
            "matrix": matrix,
            "mean_off_diagonal": float(f"{np.mean(off):.4g}") if off else None,  # 4 digits: iid's is ~1e-5
        },
        "n_assigned": len(part.assigned()),
        "excluded": excluded_counts(part),
    }


def plot_stats(stats: dict[str, Any], path: Path) -> None:
    import matplotlib  # lazy: ~0.2 s to import, pyplot more

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy, as above; after use("Agg")

    names = list(stats["clients"])
    fig, (ax_bar, ax_js) = plt.subplots(1, 2, figsize=(11, 4.2))
    bottom = np.zeros(len(names))
    for lab in stats["labels"]:
        counts = np.array([stats["clients"][n]["train_label_counts"][lab] for n in names], dtype=float)
        ax_bar.bar(names, counts, bottom=bottom, label=lab)
        bottom += counts
    ax_bar.set(title=f"training examples per client by {stats['label']}", ylabel="examples")
    ax_bar.legend(fontsize=7)
    ax_bar.tick_params(axis="x", rotation=30)
    m = np.array(stats["js_divergence"]["matrix"], dtype=float)  # None (a client without training labels): NaN
    im = ax_js.imshow(m, vmin=0, vmax=1, cmap="viridis")
    ax_js.set_xticks(range(len(names)), names, rotation=30)
    ax_js.set_yticks(range(len(names)), names)
    for (a, b), v in np.ndenumerate(m):
        if not np.isnan(v):
            ax_js.text(b, a, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.5 else "k")
    ax_js.set_title(f"Jensen-Shannon divergence ({stats['label']}, base 2)")
    fig.colorbar(im, ax=ax_js)
    fig.suptitle(f"partition {stats['scheme']}, seed {stats['seed']}")
    fig.tight_layout()
    atomic.savefig(fig, path, dpi=110, metadata={"Software": None})
    plt.close(fig)
