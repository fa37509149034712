"""Parameters shared by every stage: :func:`load_params`, and :func:`from_dict` into a :func:`config` class (a strict
pydantic dataclass whose annotations, ``Literal`` choices and ``Field`` bounds are its checks; docs/backbone.md)."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args, get_type_hints

import pydantic.dataclasses
import yaml
from pydantic import ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ArgsKwargs

T = TypeVar("T")


# Strict: a YAML string, bool or float never passes for an integer ("96", true, 8.0), nor a bool for a number;
# an int passes for a float (YAML writes `lr: 1` for 1.0). Unknown keys are refused at every level, and so are .inf
# and .nan (an lr, std or temperature of inf trains into NaN) but where a field allows them (``allow_inf_nan=True``).
_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

# Bounds several groups share
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
Positive = Annotated[float, Field(gt=0.0)]
NonNegative = Annotated[float, Field(ge=0.0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
BelowOne = Annotated[float, Field(ge=0.0, lt=1.0)]  # a momentum or Adam's beta; the plateau test's relative improvement
TokenLength = Annotated[int, Field(ge=2)]  # room for the special tokens


class ConfigError(ValueError):
    """A bad parameter. The message names the key (``group.key``), the value and what is allowed."""


def config(cls: type[T] | None = None, /, **kwargs: Any) -> Any:
    """``@config`` / ``@config(frozen=True)``: a pydantic dataclass, strict. Still a dataclass (dataclasses.asdict,
    replace and fields work); built in code (``Cls(...)``, ``dataclasses.replace``) a bad value is a one-line
    :class:`ConfigError` naming ``Cls.key``, built by :func:`from_dict` one naming the params key."""

    def wrap(c: type[T]) -> type[T]:
        c = pydantic.dataclasses.dataclass(c, config=_STRICT, **kwargs)
        init = c.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kw: Any) -> None:
            try:
                init(self, *args, **kw)
            except ValidationError as exc:
                named = dict(zip((f.name for f in dataclasses.fields(c)), args)) | kw
                raise ConfigError(_one_line(c, named, c.__name__, exc)) from None

        c.__init__ = __init__
        return c

    return wrap if cls is None else wrap(cls)


def repo_root() -> Path:
    """The project root, the same for `dvc repro` and `dvc exp run` (queued/temp runs execute in a copy under
    ``<root>/.dvc/tmp/exps/``, whose results must still land in the one MLflow store at ``<root>``)."""
    if env := os.environ.get("FEDMEET_ROOT") or os.environ.get("DVC_ROOT"):
        root = Path(env).resolve()
    else:
        try:  # outside a git checkout git fails and prints nothing on stdout
            out = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True).stdout.strip()
        except OSError:  # no git
            out = ""
        root = Path(out) if out else Path.cwd().resolve()
    parts = root.parts
    for i in range(1, len(parts) - 3):
        if parts[i : i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return root


class UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses duplicate keys (plain YAML keeps the last one silently: a copied experiment entry left
    under the same name would drop the first)."""

    def construct_mapping(self, node, deep=False):
        seen = []  # a list: an unhashable key (``[lr]: 0.1``) reaches safe_load's own one-line error, below
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: safe_load merges it, written keys override
                continue
            if (key := self.construct_object(key_node, deep=deep)) in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.append(key)
        return super().construct_mapping(node, deep)


def load_params(path: str | os.PathLike) -> dict[str, Any]:
    """Read the params file a stage entry point names (DVC runs every stage at the project root)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: parameter file not found (run from the project root)")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader
    except OSError as exc:  # a folder (--params given a study folder), no permission to read
        raise ConfigError(f"{p}: not a readable parameter file ({exc.strerror})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level")
    return data


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


_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "literal_error", "finite_number"}


def _number(v: Any) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


def _allowed(cls: type, err: dict[str, Any], path: str) -> str:
    """What a key allows: its Literal choices, or its Field bounds (all of them when the field has several)."""
    if err["type"] == "literal_error":
        return f"one of {err['ctx']['expected']}"
    if err["type"] == "finite_number":
        return "a finite number"
    info = getattr(cls, "__pydantic_fields__", {}).get(path)  # None for an item of a list or a mapping
    bounds = [
        f"{op} {_number(getattr(m, name))}"
        for m in _metadata(info)
        for name, op in _BOUNDS.items()
        if getattr(m, name, None) is not None
    ]
    return " and ".join(bounds) or " and ".join(
        f"{op} {_number(err['ctx'][name])}" for name, op in _BOUNDS.items() if name in err["ctx"]
    )


def _metadata(info: FieldInfo | None) -> list[Any]:
    """A field's constraints, also those inside ``Annotated[...] | None`` (where pydantic keeps them in the type)."""
    if info is None:
        return []
    found = list(info.metadata)
    for arg in reversed(get_args(info.annotation)):  # one level: Python flattens an Annotated inside an Annotated
        for m in getattr(arg, "__metadata__", ()):
            found.extend(m.metadata if isinstance(m, FieldInfo) else [m])
    return found


def _expected(err: dict[str, Any]) -> str:
    """The type pydantic wanted, in fedmeet's words ("an integer", "a number", "true or false")."""
    if err["type"] == "bool_type":
        return "true or false"  # as YAML writes a boolean
    msg = err["msg"].replace("Input should be ", "").replace("valid ", "").replace("dictionary", "mapping")
    return msg.replace("a integer", "an integer").replace("a instance", "an instance")


def _one_line(cls: type, data: dict[str, Any], where: str, exc: ValidationError, sep: str = ".") -> str:
    """pydantic's errors as one line: unknown keys first (all of them, with the allowed ones), else a check across
    keys (a ``model_validator``'s message), else every bad value: ``where.key=<value> is out of range; allowed: ...``
    for a bound or a choice, ``where.key: expected <type>, got <type> <value>`` for a wrong type."""
    errors = exc.errors()
    # the keys as params write them
    fields = sorted(info.alias or name for name, info in cls.__pydantic_fields__.items())
    if unknown := sorted(str(e["loc"][-1]) for e in errors if e["type"] == "unexpected_keyword_argument"):
        return f"{where}: unknown key(s) {unknown}; allowed: {fields}"
    if missing := sorted(str(e["loc"][-1]) for e in errors if e["type"] == "missing"):
        return f"{where}: missing required key(s) {missing}"
    for err in errors:
        if err["type"] == "value_error" and not err["loc"]:  # a model_validator's: its message starts with the key
            text = " ".join(err["msg"].removeprefix("Value error, ").split())
            first = re.match(r"\w+", text)
            return f"{where}{sep if first and first.group() in fields else ': '}{text}"
    by_path: dict[str, tuple[Any, list[dict[str, Any]]]] = {}
    choices: dict[str, tuple[list[Any], str]] = {}  # list items outside a Literal, one entry per list
    for err in errors:
        is_key = "[key]" in err["loc"]  # a mapping's key (not its value) is out of range
        loc = err["loc"][: err["loc"].index("[key]") - 1] if is_key else err["loc"]
        path, value = _key_path(data, loc)
        if err["type"] == "literal_error" and re.search(r"\[\d+\]$", path):
            choices.setdefault(re.sub(r"\[\d+\]$", "", path), ([], err["ctx"]["expected"]))[0].append(value)
            continue
        by_path.setdefault(path, (value, []))[1].append(err | {"is_key": is_key})
    lines = [
        f"{where}{sep}{path}: unknown value(s) {values}; allowed: {expected}"
        for path, (values, expected) in choices.items()
    ]
    for path, (value, errs) in by_path.items():
        at = f"{where}{sep}{path}" if path else where
        ranges = [e for e in errs if e["type"] in _RANGE_ERRORS]
        if checked := [e for e in errs if e["type"] == "value_error"]:  # a field validator's message
            lines.append(f"{at}: {' '.join(checked[0]['msg'].removeprefix('Value error, ').split())}")
        elif ranges and ranges[0]["is_key"]:
            lines.append(f"{at}={value!r}: unknown key(s); allowed: {ranges[0]['ctx']['expected']}")
        elif ranges:
            lines.append(f"{at}={value!r} is out of range; allowed: {_allowed(cls, ranges[0], path)}")
        else:
            wanted = " or ".join(dict.fromkeys(_expected(e) for e in errs))
            lines.append(f"{at}: expected {wanted}, got {type(value).__name__} {value!r}")
    return "; ".join(lines)


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str = "", sep: str = ".") -> T:
    """Config class ``cls`` (:func:`config`) from ``data`` (a params group), nested config groups first; a bad
    key or value raises one-line :class:`ConfigError` naming ``where.key`` (``where key`` with ``sep`` " ": keys at
    a file's top level, ``params.yaml tau``) and what is allowed."""
    where = where or cls.__name__
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {type(data).__name__} {data!r}")
    data = dict(data or {})
    hints = get_type_hints(cls)
    for key, value in data.items():
        if isinstance(value, dict) and dataclasses.is_dataclass(hints.get(key)):
            data[key] = from_dict(hints[key], value, f"{where}{sep}{key}")
    built = cls.__new__(cls)
    try:  # what the dataclass's __init__ does, with the params key in the error
        cls.__pydantic_validator__.validate_python(ArgsKwargs((), data), self_instance=built)
    except ValidationError as exc:
        raise ConfigError(_one_line(cls, data, where, exc, sep)) from None
    return built


def group(params: dict[str, Any], name: str, file: str = "params.yaml") -> dict[str, Any]:
    """Params group ``name`` ({} when absent or null); anything but a mapping is a ConfigError naming it in ``file``."""
    value = params.get(name) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{file} {name}: expected a mapping of keys, got {type(value).__name__} {value!r}")
    return value


def flatten(d: dict[str, Any], prefix: str = "", whole: tuple[str, ...] = ()) -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}, a mapping named in ``whole`` (by its dotted key) kept as one value: every
    parameter as MLflow logs it, a preset's leaves as its overrides name them."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out |= flatten(v, key, whole) if isinstance(v, dict) and key not in whole else {key: v}
    return out


def check_lengths(backbone: Any, source: int, target: int, group: str = "model", tk: str = "max_target_length") -> None:
    """``group``'s max lengths fit the backbone's position tables (a longer input fails deep inside torch)."""
    for part, key, n in (("encoder", "max_source_length", source), ("decoder", tk, target)):
        c = getattr(backbone.config, part) if backbone.config.model_type == "encoder-decoder" else backbone.config
        limit = getattr(c, f"max_{part}_position_embeddings", None) or getattr(c, "max_position_embeddings", None)
        if limit and n > limit:  # no limit: relative positions (T5)
            raise ConfigError(f"{group}.{key}={n} is out of range; allowed: <= {limit} (the {part}'s positions)")
