"""Parameters and paths shared by every stage.

Every stage reads the params file through :func:`load_params` and turns its own group into a typed
dataclass with :func:`from_dict`, before any work. pydantic validates the group against the dataclass's fields
and annotations (strict types, unknown keys refused: a new key needs only a new field, a new config class needs
nothing more), and :func:`from_dict` turns pydantic's errors and the dataclass's own range checks
(``__post_init__``) into one :class:`ConfigError` line naming the key: a typo in the params file or a preset is one
clear line instead of a silently ignored setting or a crash deep in a stage.

Defaults: the params file is the one place a value is chosen (DVC tracks it, users edit it); a dataclass default is
the params file's value for that key, so code and tests that build a config without the params file run what
`make repro` runs (tests/test_params_defaults.py holds every group to it).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError
from typing_extensions import TypedDict  # pydantic needs typing_extensions' TypedDict before Python 3.12

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


def load_params(path: str | os.PathLike) -> dict[str, Any]:
    """Read the params file a stage entry point names (DVC runs every stage at the project root)."""
    p = Path(path)
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


# Strict: a YAML string, bool or float never passes for an integer ("96", true, 8.0), nor a bool for a number;
# an int passes for a float (YAML writes `lr: 1` for 1.0). Unknown keys are refused at every level.
_STRICT = ConfigDict(strict=True, extra="forbid")


@functools.cache
def _schema(cls: type) -> type:
    """The keys of dataclass ``cls`` as a pydantic-validated TypedDict (every key optional: the dataclass's own
    defaults fill the missing ones; nested dataclasses become nested TypedDicts). A TypedDict, not the dataclass
    itself, because pydantic in strict mode accepts only instances for a dataclass."""
    hints = get_type_hints(cls)
    fields = {f.name: _schema(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else hints[f.name]
              for f in dataclasses.fields(cls) if f.init}
    schema = TypedDict(cls.__name__, fields, total=False)  # type: ignore[misc]
    schema.__pydantic_config__ = _STRICT  # type: ignore[attr-defined]
    return schema


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(_schema(cls))


def _as_mapping(value: Any) -> Any:
    """A nested dataclass instance given where a mapping is read (code building a config from parts)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_mapping(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    return value


def _key_path(data: Any, loc: tuple) -> tuple[str, Any]:
    """The part of pydantic's error location that names keys of ``data`` (``a.b[2]``; union branch tags such as
    ``int`` dropped) and the value found there."""
    path, node = "", data
    for part in loc:
        if isinstance(node, dict) and part in node:
            path, node = f"{path}.{part}" if path else str(part), node[part]
        elif isinstance(node, (list, tuple)) and isinstance(part, int) and 0 <= part < len(node):
            path, node = f"{path}[{part}]", node[part]
        else:
            break
    return path, node


def _allowed(cls: type, path: str) -> list[str]:
    """The keys of the (nested) dataclass at ``path`` inside ``cls``."""
    for part in filter(None, path.split(".")):
        cls = get_type_hints(cls)[part]
    return sorted(f.name for f in dataclasses.fields(cls) if f.init)


def _one_line(cls: type, data: dict[str, Any], where: str, exc: ValidationError) -> str:
    """pydantic's errors as one line: unknown keys first (all of them, with the allowed ones), else every type
    problem, each ``where.key: expected ..., got <type> <value>``."""
    unknown: dict[str, list[str]] = {}
    problems: dict[str, list[str]] = {}
    for err in exc.errors():
        if err["type"] == "extra_forbidden":
            parent, _ = _key_path(data, err["loc"][:-1])
            unknown.setdefault(parent, []).append(str(err["loc"][-1]))
            continue
        path, value = _key_path(data, err["loc"])
        # "Input should be a valid integer" -> "an integer" (the wording of the rest of fedmeet's messages)
        msg = re.sub(r"\ba ([aeiou])", r"an \1", err["msg"].replace("Input should be ", "").replace("valid ", ""))
        msg = "true or false" if err["type"] == "bool_type" else msg  # as YAML writes a boolean
        problems.setdefault(path, [f"got {type(value).__name__} {value!r}"])
        if msg not in problems[path]:
            problems[path].insert(-1, msg)
    if unknown:
        parent, keys = next(iter(unknown.items()))
        at = f"{where}.{parent}" if parent else where
        return f"{at}: unknown key(s) {sorted(keys)}; allowed: {_allowed(cls, parent)}"
    return "; ".join(f"{where}{'.' + path if path else ''}: expected {' or '.join(parts[:-1])}, {parts[-1]}"
                     for path, parts in problems.items())


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """A dataclass range check (from ``__post_init__``): ``key=value; allowed: ...``. :func:`from_dict` prefixes
    the group, so the line names the full key."""
    if not ok:
        raise ValueError(f"{key}={value!r} is out of range; allowed: {allowed}")


def _build(cls: type[T], data: dict[str, Any], where: str) -> T:
    """The dataclass from validated ``data``, nested ones first; a ``__post_init__`` range check that fails is a
    :class:`ConfigError` naming the (nested) group."""
    hints = get_type_hints(cls)
    kwargs = {key: _build(hints[key], value, f"{where}.{key}") if dataclasses.is_dataclass(hints[key]) else value
              for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:  # the dataclass's own range checks
        raise ConfigError(f"{where}: {' '.join(str(exc).split())}") from None


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str = "") -> T:
    """Build dataclass ``cls`` from ``data`` (a params group); nested dataclass fields are built too.

    pydantic checks keys and types against the dataclass's fields and annotations (:func:`_schema`); unknown keys,
    values of the wrong type and values the dataclass's ``__post_init__`` rejects raise one-line
    :class:`ConfigError` naming ``where.key`` and what is allowed.
    """
    where = where or cls.__name__
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {type(data).__name__} {data!r}")
    data = {key: _as_mapping(value) for key, value in (data or {}).items()}
    try:
        valid = _adapter(cls).validate_python(data)
    except ValidationError as exc:
        raise ConfigError(_one_line(cls, data, where, exc)) from None
    return _build(cls, valid, where)


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
