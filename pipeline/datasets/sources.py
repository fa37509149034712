"""Where each dataset's upstream files are (its reader module's registration says which), the first that works
(docs/data.md): a copy laid out like ../shared/data (``$FEDMEET_DATA_ROOT`` or ``ingest.data_root``), the files
already downloaded into ``<raw_dir>/<dataset>/``, the upstream addresses ``ingest.urls.<dataset>`` downloaded there."""

from __future__ import annotations

import os
import urllib.request
import zipfile
from dataclasses import field
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator
from tqdm import tqdm

from pipeline.common import atomic
from pipeline.common.config import config
from pipeline.common.schema import DataError
from pipeline.datasets.readers.catalog import DATASETS, dataset_names, dataset_spec
from pipeline.datasets.readers.upstream import absent_allowed

ENV_DATA_ROOT = "FEDMEET_DATA_ROOT"
DOWNLOAD_TIMEOUT_S = 120


@config
class IngestConfig:
    data_root: str = "data/raw"
    raw_dir: str = "data/raw"
    # every registered reader's dataset, and its pinned upstream address (the commits named in
    # ../shared/data/*/SOURCE.md)
    datasets: list[Annotated[str, AfterValidator(lambda name: dataset_spec(name).name)]] = field(
        default_factory=dataset_names
    )
    urls: dict[str, str] = field(default_factory=lambda: {name: spec.url for name, spec in DATASETS.items()})
    # Splits whose file may be missing or empty, as fnmatch patterns of "<dataset>/<domain>/<split>" (e.g.
    # "qmsum/Academic/test", "samsum/*/valid"); any other missing or empty split is an error.
    allow_absent_splits: list[str] = field(default_factory=list)


def resolve_source(dataset: str, cfg: IngestConfig) -> Path:
    """The directory holding ``dataset`` in its upstream layout, downloading it if needed."""
    mirror = Path(os.environ.get(ENV_DATA_ROOT) or cfg.data_root) / dataset  # an empty variable: unset
    files = dataset_spec(dataset).files()  # relative to <root>/<dataset>/ -> split key

    def missing(root: Path) -> list[str]:
        return [
            rel
            for rel, split_key in files.items()
            if not (root / rel).is_file() and not absent_allowed(split_key, cfg.allow_absent_splits)
        ]

    if mirror.is_dir():
        if absent := missing(mirror):
            # A half-present mirror is a broken copy, not a reason to silently fetch something else.
            raise DataError(
                f"{mirror}: local mirror of {dataset} is incomplete; missing {absent[:5]}"
                f"{' ...' if len(absent) > 5 else ''} ({len(absent)} files)"
            )
        return mirror
    raw = Path(cfg.raw_dir) / dataset
    if not raw.is_dir() or missing(raw):  # a split allowed absent is not fetched again on every run
        download(dataset, cfg, raw)
    return raw


def _how_to_fix(dataset: str, cfg: IngestConfig, problem: str) -> str:
    return (
        f"cannot read dataset {dataset!r}: {problem}. Run `dvc update data/raw/{dataset}.dvc` (a DVC import "
        f"of ../shared/data/{dataset}) or `dvc pull data/raw/{dataset}.dvc`; or set the environment variable "
        f"{ENV_DATA_ROOT} (or the params key `ingest.data_root`, now {cfg.data_root!r}) to a directory laid out "
        f"like ../shared/data (<root>/{dataset}/...), or set `ingest.urls.{dataset}` to a reachable copy of the "
        f"upstream files."
    )


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp:  # http(s):// and file:// alike
        return resp.read()


def download(dataset: str, cfg: IngestConfig, target: Path) -> None:
    """Download ``dataset`` from ``cfg.urls[dataset]`` into ``target`` keeping the upstream layout."""
    if not (base := cfg.urls.get(dataset)):
        raise DataError(_how_to_fix(dataset, cfg, f"no local mirror and no `ingest.urls.{dataset}`"))
    base = base.rstrip("/")
    spec = dataset_spec(dataset)
    try:
        if spec.download is not None:  # an upstream copy that is not the files one by one (SAMSum's zip)
            spec.download(base, target, _fetch, atomic.write_bytes, cfg.allow_absent_splits)
            return
        for rel, split_key in tqdm(spec.files().items(), desc=f"download {dataset}", unit="file"):
            if (target / rel).is_file():  # resume an interrupted download
                continue
            try:
                data = _fetch(f"{base}/{spec.upstream_path(rel)}")
            except OSError:  # URLError, HTTPError: a split allowed absent may be absent upstream too
                if not absent_allowed(split_key, cfg.allow_absent_splits):
                    raise
                continue
            atomic.write_bytes(target / rel, data)  # outside the try: a failed write is never taken for an absent split
    # URLError is an OSError; ValueError: urlopen's "unknown url type" (an address without http(s):// or file://)
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise DataError(_how_to_fix(dataset, cfg, f"download from {base} failed ({exc})")) from exc
