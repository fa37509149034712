"""Checks that a model directory (``models/backbone``) is whole before it is loaded: transformers fails on a damaged
one with messages that name no file ("MetadataIncompleteBuffer"), :func:`check_model_dir` names the file and the
problem; and the backbone stage's record read leniently (:func:`read_record`) with its name (:func:`backbone_name`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from pipeline.common.schema import DataError

RECORD_NAME = "fedmeet_backbone.json"  # what the backbone stage writes beside the weights
FIX = "rebuild it with `dvc repro backbone` (or `python -m pipeline.backbone`)"


class ModelDirError(DataError):
    """A damaged model directory; the message names the file."""


def file_hash(path: Path, algorithm: str = "sha256") -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, algorithm).hexdigest()


def sha256_dir(path: Path) -> str:
    """Content hash of a directory (the backbone's identity): sha256 over (relative path, file sha256), sorted."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        if not (rel == RECORD_NAME or rel.startswith(".") or "/." in rel):  # the record and hidden files left out
            h.update(rel.encode() + b"\0" + file_hash(f).encode() + b"\n")
    return h.hexdigest()


def check_model_dir(path: str | Path) -> None:
    """Raise :class:`ModelDirError` naming the first damaged file of the model directory ``path``."""
    d = Path(path)
    if not (d / "config.json").is_file():
        raise ModelDirError(f"{d / 'config.json'}: missing; {d} is not a complete model directory; {FIX}")
    for f in sorted(d.glob("*.json")):
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelDirError(f"{f}: damaged JSON ({exc}); {FIX}") from None
        if f.name == RECORD_NAME and not isinstance(data, dict):  # valid JSON, of another kind
            raise ModelDirError(f"{f}: not a JSON object (the backbone stage writes one); {FIX}")
    weights = sorted(d.glob("*.safetensors"))
    for f in weights:
        try:  # safetensors' own header check: a file cut short, padded or with a garbled header
            with safe_open(f, "np"):
                pass
        except SafetensorError as exc:
            raise ModelDirError(f"{f}: damaged weights: {exc}; {FIX}") from None
    if not weights and not any(d.glob("*.bin")):
        raise ModelDirError(f"{d}: no weight file (*.safetensors or *.bin); {FIX}")
    recorded = read_record(d).get("backbone_sha256")
    if recorded and sha256_dir(d) != recorded:
        raise ModelDirError(
            f"{d}: file contents differ from backbone_sha256 recorded in {d / RECORD_NAME} (a file was "
            f"changed or damaged after the backbone stage wrote it); {FIX}"
        )


def read_record(directory: str | Path) -> dict:
    """The backbone stage's record in ``directory``; {} when absent, not UTF-8, not JSON or not an object."""
    try:
        data = json.loads((Path(directory) / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: not UTF-8 or not JSON
        return {}
    return data if isinstance(data, dict) else {}


def backbone_name(backbone_dir: str | Path, fallback: str) -> str:
    """``name`` in the backbone directory's record (the tag and metric field that training, evaluation and the
    deployed server report), else ``fallback`` (no record, an unreadable one, or no name in it): training falls back
    to the backbone path, evaluation to the loaded model's type."""
    name = read_record(backbone_dir).get("name")
    return str(name) if name else fallback
