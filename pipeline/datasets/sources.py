"""Where each dataset's upstream files are, and how to fetch them when there is no local mirror.

Order of sources (first that works wins):
  (a) a copy laid out like ../shared/data: ``$FEDMEET_DATA_ROOT`` or ``ingest.data_root`` (data/raw, where each
      dataset is a DVC import of the mirror, data/raw/<dataset>.dvc);
  (b) the files already downloaded into ``<raw_dir>/<dataset>/`` (same layout as the mirror);
  (c) the upstream addresses ``ingest.urls.<dataset>``, downloaded into ``<raw_dir>/<dataset>/``;
otherwise a DataError says what to set.
"""
from __future__ import annotations

import io
import os
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from pipeline.common import atomic
from pipeline.common.schema import QMSUM_DOMAINS, DataError

ENV_DATA_ROOT = "FEDMEET_DATA_ROOT"
DOWNLOAD_TIMEOUT_S = 120

# HMNet keeps each corpus split as numbered gzip chunks; the numbers of chunks are those of the pinned
# upstream commit (AMI 32/20/20, ICSI 32/10/6; see ../shared/data/{ami,icsi}/SOURCE.md).
HMNET_CORPUS = {"ami": "AMI", "icsi": "ICSI"}
HMNET_CHUNKS = {"ami": {"train": 32, "dev": 20, "test": 20}, "icsi": {"train": 32, "dev": 10, "test": 6}}
HMNET_PREFIX = "hmnet/"  # the mirror keeps the HMNet repository under <dataset>/hmnet/
SAMSUM_FILES = ("train.json", "validation.json", "test.json")
SAMSUM_ZIP_DIR = "samsum/"  # members inside the upstream samsum.zip


@dataclass
class IngestConfig:
    data_root: str = "data/raw"
    raw_dir: str = "data/raw"
    datasets: list[str] = field(default_factory=lambda: ["qmsum", "samsum", "ami", "icsi"])
    urls: dict[str, str] = field(default_factory=dict)
    # Splits whose file may be missing or empty, as fnmatch patterns of "<dataset>/<domain>/<split>" (e.g.
    # "qmsum/Academic/test", "samsum/*/valid"); any other missing or empty split is an error.
    allow_absent_splits: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.datasets) - {"qmsum", "samsum", "ami", "icsi"})
        if unknown:
            raise ValueError(f"ingest.datasets: unknown dataset(s) {unknown}; allowed: ['ami', 'icsi', 'qmsum', "
                             f"'samsum']")


def qmsum_files() -> list[str]:
    return [f"data/{d}/jsonl/{s}.jsonl" for d in QMSUM_DOMAINS for s in ("train", "val", "test")]


def hmnet_files(dataset: str) -> list[str]:
    corpus = HMNET_CORPUS[dataset]
    return [
        f"{HMNET_PREFIX}ExampleRawData/meeting_summarization/{corpus}_proprec/{split}/split_{k}.jsonl.gz"
        for split, n in HMNET_CHUNKS[dataset].items()
        for k in range(n)
    ]


def expected_files(dataset: str) -> list[str]:
    """Files (relative to ``<root>/<dataset>/``) the reader needs, in the upstream layout."""
    if dataset == "qmsum":
        return qmsum_files()
    if dataset in HMNET_CORPUS:
        return hmnet_files(dataset)
    if dataset == "samsum":
        return list(SAMSUM_FILES)
    raise DataError(f"unknown dataset {dataset!r}; expected qmsum, samsum, ami or icsi")


def missing_files(directory: Path, dataset: str) -> list[str]:
    return [rel for rel in expected_files(dataset) if not (directory / rel).is_file()]


def _may_be_absent(dataset: str, rel: str, cfg: IngestConfig) -> bool:
    """Whether ``ingest.allow_absent_splits`` lets the expected file ``rel`` be missing."""
    import fnmatch

    from pipeline.common.schema import normalise_split

    if dataset == "qmsum":  # data/<Domain>/jsonl/<split>.jsonl
        parts = rel.split("/")
        key = f"qmsum/{parts[1]}/{normalise_split(parts[3].removesuffix('.jsonl'))}"
    elif dataset == "samsum":
        key = f"samsum/SAMSum/{normalise_split(rel.removesuffix('.json'))}"
    else:  # .../<CORPUS>_proprec/<split>/split_<k>.jsonl.gz
        parts = rel.split("/")
        key = f"{dataset}/{HMNET_CORPUS[dataset]}/{normalise_split(parts[-2])}"
    return any(fnmatch.fnmatchcase(key, pat) for pat in cfg.allow_absent_splits)


def data_root(cfg: IngestConfig) -> Path:
    return Path(os.environ.get(ENV_DATA_ROOT) or cfg.data_root)


def resolve_source(dataset: str, cfg: IngestConfig, allow_download: bool = True) -> Path:
    """The directory holding ``dataset`` in its upstream layout, downloading it if needed."""
    mirror = data_root(cfg) / dataset
    if mirror.is_dir():
        missing = [rel for rel in missing_files(mirror, dataset) if not _may_be_absent(dataset, rel, cfg)]
        if missing:
            # A half-present mirror is a broken copy, not a reason to silently fetch something else.
            raise DataError(f"{mirror}: local mirror of {dataset} is incomplete; missing {missing[:5]}"
                            f"{' ...' if len(missing) > 5 else ''} ({len(missing)} files)")
        return mirror
    raw = Path(cfg.raw_dir) / dataset
    if raw.is_dir() and not missing_files(raw, dataset):
        return raw
    if not allow_download:
        raise DataError(_how_to_fix(dataset, cfg, f"{mirror} does not exist and downloading is disabled"))
    download(dataset, cfg, raw)
    return raw


def _how_to_fix(dataset: str, cfg: IngestConfig, problem: str) -> str:
    return (f"cannot read dataset {dataset!r}: {problem}. Run `dvc update data/raw/{dataset}.dvc` (a DVC import "
            f"of ../shared/data/{dataset}) or `dvc pull data/raw/{dataset}.dvc`; or set the environment variable "
            f"{ENV_DATA_ROOT} "
            f"(or the params key `ingest.data_root`, now {cfg.data_root!r}) to a directory laid out like "
            f"../shared/data (<root>/{dataset}/...), or set `ingest.urls.{dataset}` to a reachable copy of "
            f"the upstream files.")


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp:  # http(s):// and file:// alike
        return resp.read()


def _write_atomic(path: Path, data: bytes) -> None:
    atomic.write_bytes(path, data)


def download(dataset: str, cfg: IngestConfig, target: Path) -> None:
    """Download ``dataset`` from ``cfg.urls[dataset]`` into ``target`` keeping the upstream layout."""
    base = cfg.urls.get(dataset)
    if not base:
        raise DataError(_how_to_fix(dataset, cfg, f"no local mirror and no `ingest.urls.{dataset}`"))
    base = base.rstrip("/")
    try:
        if dataset == "samsum":
            # One zip upstream; its members samsum/{train,validation,test}.json are stored without the prefix.
            with zipfile.ZipFile(io.BytesIO(_fetch(base))) as zf:
                for name in tqdm(SAMSUM_FILES, desc=f"extract {dataset}", unit="file"):
                    member = SAMSUM_ZIP_DIR + name
                    if member not in zf.namelist():
                        raise DataError(f"{base}: zip has no member {member!r}")
                    _write_atomic(target / name, zf.read(member))
            return
        for rel in tqdm(expected_files(dataset), desc=f"download {dataset}", unit="file"):
            if (target / rel).is_file():
                continue  # resume an interrupted download
            upstream_rel = rel[len(HMNET_PREFIX):] if rel.startswith(HMNET_PREFIX) else rel
            _write_atomic(target / rel, _fetch(f"{base}/{upstream_rel}"))
    except (urllib.error.URLError, OSError, zipfile.BadZipFile) as exc:
        raise DataError(_how_to_fix(dataset, cfg, f"download from {base} failed ({exc})")) from exc
