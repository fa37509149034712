"""The dataset registry: what a reader module declares about its upstream layout.

A reader module (pipeline/datasets/readers/<layout>.py) registers, per dataset it reads, a :class:`DatasetSpec`:
the reader (directory, report, allow_absent) -> canonical records, the files it needs relative to
``<root>/<dataset>/`` (how pipeline.datasets.sources checks a mirror and downloads), each with its split key
(``<dataset>/<domain>/<split>``, matched by ``ingest.allow_absent_splits``) and, where the upstream copy is not
those files one by one, how to download it. A new dataset is its module, its import in ``catalog``, its name in
params ``ingest.datasets`` (+ ``ingest.urls``), and a DVC import of its files (data/raw/<dataset>.dvc).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.common.schema import CanonicalRecord, IngestReport

Reader = Callable[[Path, IngestReport, list[str]], Iterator[CanonicalRecord]]
# download(base_url, target_dir, fetch(url) -> bytes, write(path, bytes)): an upstream copy that is not the files
# one by one (e.g. one zip); None: each expected file is fetched from ``base_url/<upstream_path(file)>``.
Download = Callable[[str, Path, Callable[[str], bytes], Callable[[Path, bytes], None]], None]


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    read: Reader
    # the expected files, relative to <root>/<dataset>/, in the upstream layout -> "<dataset>/<domain>/<split>"
    files: Callable[[], dict[str, str]]
    download: Download | None = None
    upstream_path: Callable[[str], str] = lambda rel: rel  # expected file -> its path under the download address


DATASETS: dict[str, DatasetSpec] = {}


def register_reader(spec: DatasetSpec) -> DatasetSpec:
    """Register dataset ``spec.name`` (the name params ingest.datasets uses)."""
    if spec.name in DATASETS:
        raise ValueError(f"dataset {spec.name!r} is registered twice")
    DATASETS[spec.name] = spec
    return spec
