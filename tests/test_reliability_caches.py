"""A damaged backbone directory is named, not loaded (issue 15, item 4; the prefix-cache entries' checksums are
tested in test_cache.py). Each case damages a copy of a tiny saved model and loads it the way every model stage
does (AdapterSummarizer.from_pretrained)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny

from pipeline.common.integrity import RECORD_NAME, ModelDirError, backbone_name, read_record, sha256_dir
from pipeline.modeling.adapters import AdapterConfig
from pipeline.modeling.model import AdapterSummarizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny backbone as the backbone stage leaves it: weights, tokenizer and the record of its sha256."""
    path = save_tiny("bart", tmp_path_factory.mktemp("backbone") / "backbone")
    (path / RECORD_NAME).write_text(json.dumps({"backbone_sha256": sha256_dir(path)}))
    return path


def cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {  # what is done -> what the message must say, after the damaged file's path
    "weights_cut_short": (
        lambda d: cut(d / "model.safetensors"),
        r"model.safetensors: damaged weights: .*incomplete metadata, file not fully covered",
    ),
    "weights_changed": (
        lambda d: flip_last_byte(d / "model.safetensors"),
        r"backbone: file contents differ from backbone_sha256 recorded in .*fedmeet_backbone.json",
    ),
    "config_garbled": (
        lambda d: (d / "config.json").write_text('{"model_type": "bart", '),
        r"config.json: damaged JSON",
    ),
    "config_missing": (lambda d: (d / "config.json").unlink(), r"config.json: missing"),
    "weights_missing": (lambda d: (d / "model.safetensors").unlink(), r"backbone: no weight file"),
    "record_not_an_object": (lambda d: (d / RECORD_NAME).write_text("[]"), r"fedmeet_backbone.json: not a JSON object"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_backbone_names_the_file(saved, tmp_path, damage):
    copy = tmp_path / "backbone"
    shutil.copytree(saved, copy)
    do, expected = DAMAGE[damage]
    do(copy)
    with pytest.raises(ModelDirError) as info:
        AdapterSummarizer.from_pretrained(copy, AdapterConfig(top_k=1, bottleneck=4))
    message = str(info.value)
    assert message.startswith(str(copy)), message
    assert re.search(expected, message), message
    assert "dvc repro backbone" in message  # and says how to fix it


def test_a_record_that_is_not_an_object_gives_the_fallback_name(tmp_path):
    """backbone_name reads the record of a directory not checked yet: valid JSON of another kind is no name."""
    (tmp_path / RECORD_NAME).write_text('["bart"]')
    assert backbone_name(tmp_path, "bart-fallback") == "bart-fallback"
    (tmp_path / RECORD_NAME).write_bytes(b'{"name": "\xff"}')  # not UTF-8: was a UnicodeDecodeError traceback
    assert backbone_name(tmp_path, "bart-fallback") == "bart-fallback"


RECORDS = {  # what is written as the record -> what read_record gives
    "absent": (None, {}),
    "a_directory": ("dir", {}),
    "not_an_object": (b'["bart"]', {}),
    "not_json": (b"{not json", {}),
    "not_utf8": (b'{"name": "\xff"}', {}),
    "an_object": (b'{"name": "bart"}', {"name": "bart"}),
}


@pytest.mark.parametrize("case", RECORDS)
def test_the_lenient_record_reader_gives_an_object_or_nothing(tmp_path, case):
    """read_record (backbone_name's and a run's input hash's reader); check_model_dir names each damage instead."""
    content, expected = RECORDS[case]
    if content == "dir":
        (tmp_path / RECORD_NAME).mkdir()
    elif content is not None:
        (tmp_path / RECORD_NAME).write_bytes(content)
    assert read_record(tmp_path) == expected


def test_the_undamaged_copy_loads(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "backbone")
    # Loaded means the saved weights, read here with safetensors itself, and the adapters on the top 1 of the
    # decoder layers config.json declares (first_adapted >= 0 held for a freshly initialised backbone too).
    from safetensors.torch import load_file

    model = AdapterSummarizer.from_pretrained(tmp_path / "backbone", AdapterConfig(top_k=1, bottleneck=4))
    config = json.loads((saved / "config.json").read_text())
    assert model.first_adapted == config["decoder_layers"] - 1
    state = model.backbone.state_dict()
    weights = load_file(saved / "model.safetensors")
    assert weights and all(torch.equal(state[name], tensor) for name, tensor in weights.items())
