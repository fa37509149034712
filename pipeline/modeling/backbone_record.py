"""The backbone's name as the backbone stage recorded it (``fedmeet_backbone.json`` beside the weights): the tag
and metric field that training, evaluation and the deployed server report."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.common.integrity import RECORD_NAME


def backbone_name(backbone_dir: str | Path, fallback: str) -> str:
    """``name`` in the backbone directory's record, else ``fallback`` (no record, an unreadable one, or no name
    in it): training falls back to the backbone path, evaluation to the loaded model's type."""
    record = Path(backbone_dir) / RECORD_NAME
    try:
        name = json.loads(record.read_text()).get("name") if record.is_file() else None
    except json.JSONDecodeError:
        return fallback
    return str(name) if name else fallback
