"""Parameters and paths shared by every stage.

Every stage reads ``params.yaml`` through :func:`load_params` and turns its own group into a typed
dataclass with :func:`from_dict`, which rejects unknown keys so a typo in params.yaml or a preset is an
error instead of a silently ignored setting.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

import yaml

T = TypeVar("T")


def repo_root() -> Path:
    """The project root, the same for `dvc repro` and `dvc exp run` (queued/temp runs execute in a copy under
    ``<root>/.dvc/tmp/exps/``, whose results must still land in the one MLflow store at ``<root>``)."""
    root: Path | None = None
    for var in ("FEDMEET_ROOT", "DVC_ROOT"):
        if os.environ.get(var):
            root = Path(os.environ[var]).resolve()
            break
    if root is None:
        try:
            out = subprocess.run(
                ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
            ).stdout.strip()
            root = Path(out) if out else None
        except (OSError, subprocess.CalledProcessError):
            root = None
    root = root or Path.cwd().resolve()
    parts = root.parts
    for i in range(len(parts) - 3):
        if parts[i : i + 4] == (".dvc", "tmp", "exps", parts[i + 3]) and i > 0:
            return Path(*parts[:i])
    return root


def load_params(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Read params.yaml (default: ./params.yaml, where DVC runs every stage)."""
    p = Path(path) if path is not None else Path("params.yaml")
    if not p.exists():
        raise FileNotFoundError(f"{p}: parameter file not found (run from the project root)")
    with p.open() as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a mapping at the top level")
    return data


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; nested dataclass fields are built recursively.

    Unknown keys raise ``ValueError`` naming the key and where it was found.
    """
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where or cls.__name__}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        typ = hints.get(key)
        if dataclasses.is_dataclass(typ) and isinstance(value, dict):
            value = from_dict(typ, value, f"{where}.{key}" if where else key)
        kwargs[key] = value
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; used to log every parameter to MLflow."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out
