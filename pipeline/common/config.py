"""Parameters and paths shared by every stage.

Every stage reads ``params.yaml`` through :func:`load_params` and turns its own group into a typed
dataclass with :func:`from_dict`, before any work. It rejects unknown keys (derived from the dataclass's fields,
so a new key needs only a new field) and values of the wrong type (from the field's annotation), and turns the
dataclass's own range checks (``__post_init__``) into a :class:`ConfigError` naming the group: a typo in
params.yaml or a preset is one clear line instead of a silently ignored setting or a crash deep in a stage.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad parameter. The message names the key (``group.key``), the value and what is allowed."""


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
        raise ConfigError(f"{p}: parameter file not found (run from the project root)")
    try:
        with p.open(encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level")
    return data


def _type_name(typ: Any) -> str:
    return getattr(typ, "__name__", None) or str(typ).replace("typing.", "")


def type_problem(value: Any, typ: Any) -> str | None:
    """Why ``value`` does not fit the annotation ``typ`` (None when it fits). YAML gives ints where floats are
    meant (``lr: 1`` means 1.0), so an int fits a float; a bool fits neither an int nor a float."""
    if typ is None or typ is Any or isinstance(typ, TypeVar):
        return None
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if any(type_problem(value, a) is None for a in args):
            return None
        return f"expected {' or '.join(_type_name(a) for a in args)}, got {type(value).__name__} {value!r}"
    if origin is typing.Literal:
        return None if value in args else f"expected one of {list(args)}, got {value!r}"
    if dataclasses.is_dataclass(typ):
        return None if isinstance(value, (dict, typ)) else f"expected a mapping, got {type(value).__name__}"
    if typ is bool:
        return None if isinstance(value, bool) else f"expected true or false, got {type(value).__name__} {value!r}"
    if typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"expected an integer, got {type(value).__name__} {value!r}"
    if typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"expected a number, got {type(value).__name__} {value!r}"
    if typ is str:
        return None if isinstance(value, str) else f"expected a string, got {type(value).__name__} {value!r}"
    if origin in (list, tuple) or typ in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return f"expected a list, got {type(value).__name__} {value!r}"
        item = args[0] if args and (origin is list or (len(args) == 2 and args[1] is Ellipsis)) else None
        for i, v in enumerate(value):
            problem = type_problem(v, item)
            if problem:
                return f"item {i}: {problem}"
        return None
    if origin is dict or typ is dict:
        if not isinstance(value, dict):
            return f"expected a mapping, got {type(value).__name__} {value!r}"
        if len(args) == 2:
            for k, v in value.items():
                problem = type_problem(v, args[1])
                if problem:
                    return f"key {k!r}: {problem}"
        return None
    return None  # other annotations (Path, Any-like): the dataclass's own checks decide


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """A dataclass range check (from ``__post_init__``): ``key=value; allowed: ...``. :func:`from_dict` prefixes
    the group, so the line names the full key."""
    if not ok:
        raise ValueError(f"{key}={value!r} is out of range; allowed: {allowed}")


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; nested dataclass fields are built recursively.

    Unknown keys, values of the wrong type and values the dataclass's ``__post_init__`` rejects raise
    :class:`ConfigError` naming ``where.key`` and what is allowed.
    """
    where = where or cls.__name__
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {type(data).__name__} {data!r}")
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        typ = hints.get(key)
        problem = type_problem(value, typ)
        if problem:
            raise ConfigError(f"{where}.{key}: {problem}")
        if dataclasses.is_dataclass(typ) and isinstance(value, dict):
            value = from_dict(typ, value, f"{where}.{key}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:  # the dataclass's own range checks
        raise ConfigError(f"{where}: {' '.join(str(exc).split())}") from None


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
