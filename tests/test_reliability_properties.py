"""Property: every reader of stage `ingest`, fed mutated records, either parses them or raises DataError naming
the file and the line; never another exception (issue 15, item 1)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability import FIXTURES, hmnet_meeting, hmnet_rel, read_lines, write_lines

from pipeline.common.schema import DataError
from pipeline.datasets.readers.hmnet import HMNET_CHUNKS
from pipeline.ingest import ingest_dataset

# JSON values of every type, nested a little: what a damaged or foreign file may hold where a field belongs.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)

# A file per reader (relative to the dataset's directory) whose first record is mutated.
TARGETS = {
    "qmsum": "data/Academic/jsonl/train.jsonl",
    "samsum": "train.json",
    "ami": hmnet_rel("ami", "train", 0),
    "icsi": hmnet_rel("icsi", "test", 0),
}
ONE_CHUNK = {"train": 1, "dev": 1, "test": 1}


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> Path:
    """The fixtures with one HMNet chunk per split (the readers are patched to expect one)."""
    root = tmp_path_factory.mktemp("prop") / "data"
    shutil.copytree(FIXTURES / "qmsum", root / "qmsum")
    shutil.copytree(FIXTURES / "samsum", root / "samsum")
    for ds in ("ami", "icsi"):
        for split in ONE_CHUNK:
            path = root / ds / hmnet_rel(ds, split, 0)
            path.parent.mkdir(parents=True)
            write_lines(path, [(json.dumps(hmnet_meeting(f"{ds}-{split}-{i}")) + "\n").encode() for i in range(2)])
    return root


def paths_of(value, prefix=()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths_of(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths_of(v, prefix + (i,))
    return out


def mutate_record(data, rec):
    """One structural change: a value replaced by any JSON value, a key or item deleted, a key added."""
    path = data.draw(st.sampled_from(paths_of(rec)))
    op = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if not path:
        return data.draw(JSON) if op == "replace" else rec
    parent = rec
    for key in path[:-1]:
        parent = parent[key]
    if op == "replace":
        parent[path[-1]] = data.draw(JSON)
    elif op == "delete":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[data.draw(st.text(max_size=8))] = data.draw(JSON)
    else:
        parent.insert(data.draw(st.integers(0, len(parent))), data.draw(JSON))
    return rec


def mutate_bytes(data, line: bytes) -> bytes:
    """A byte-level fault: the line cut short or foreign bytes (often not UTF-8) spliced in."""
    at = data.draw(st.integers(0, len(line)))
    if data.draw(st.booleans()):
        return line[:at] + b"\n"
    return line[:at] + data.draw(st.binary(min_size=1, max_size=4)) + line[at:]


ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): \S")
EMPTY = re.compile(r"^(?P<file>[^:]+): no records \(empty or blank file\)")


@pytest.mark.parametrize("dataset", TARGETS)
@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_records_parse_or_raise_a_data_error_naming_file_and_line(mirror, dataset, data):
    path = mirror / dataset / TARGETS[dataset]
    original = path.read_bytes()
    lines = read_lines(path)
    try:
        rec = json.loads(lines[0])
        for _ in range(data.draw(st.integers(1, 3), label="structural mutations")):
            rec = mutate_record(data, rec)
        first = (json.dumps(rec) + "\n").encode()
        if data.draw(st.booleans(), label="byte fault"):
            first = mutate_bytes(data, first)
        write_lines(path, [first] + lines[1:])
        with mock.patch.dict(HMNET_CHUNKS, {"ami": ONE_CHUNK, "icsi": ONE_CHUNK}):
            try:
                frame, report = ingest_dataset(dataset, mirror / dataset)
            except DataError as exc:
                message = str(exc)
                m = ERROR.match(message) or EMPTY.match(message)
                assert m, f"DataError without file and line: {message!r}"
                assert m["file"] == f"{dataset}/{TARGETS[dataset]}", message
                assert "\n" not in message
                if "line" in m.groupdict():
                    # the damage is in line 1; a duplicate id is found on the next line
                    assert int(m["line"]) <= 2, message
            else:
                assert report.n_records == len(frame) > 0
                assert frame["summary"].map(lambda s: isinstance(s, str)).all()
                assert all(
                    isinstance(t["content"], str) and isinstance(t["speaker"], str)
                    for turns in frame["turns"]
                    for t in turns
                )
    finally:
        path.write_bytes(original)
