"""Fault injection on the inputs of stage `ingest`: every damaged file of the four datasets ends in one stderr line
naming the file, the line or record and the problem, exit status 2, no traceback (issue 15, item 1)."""

from __future__ import annotations

import functools
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from reliability import (
    build_mirror,
    hmnet_rel,
    read_lines,
    run_inprocess,
    run_subprocess,
    write_lines,
    write_params,
)
from tqdm import tqdm

from pipeline import ingest
from pipeline.common.cli import EXIT_USAGE

# One file of each kind per dataset, its name as errors show it (relative to the data root), and where in its
# first record a text field, a list field and the record id live.
FILES = {
    "qmsum": dict(
        rel="qmsum/data/Academic/jsonl/test.jsonl",
        text=("meeting_transcripts", 0, "content"),
        list_field="general_query_list",
        key_field="specific_query_list",
        split="qmsum/Academic/test",
    ),
    "samsum": dict(
        rel="samsum/validation.json", text=("summary",), list_field=None, key_field="id", split="samsum/SAMSum/valid"
    ),
    "ami": dict(
        rel="ami/" + hmnet_rel("ami", "test", 3),
        text=("meeting", 0, "speaker"),
        list_field="summary",
        key_field="id",
        split="ami/AMI/test",
    ),
    "icsi": dict(
        rel="icsi/" + hmnet_rel("icsi", "dev", 0),
        text=("summary", 0),
        list_field="meeting",
        key_field="id",
        split="icsi/ICSI/valid",
    ),
}


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return build_mirror(tmp_path_factory.mktemp("template") / "data")


@pytest.fixture
def root(template, tmp_path, monkeypatch) -> Path:
    """A fresh copy of the complete tiny mirror, the working directory a stage runs in, no progress bars."""
    shutil.copytree(template, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDMEET_DATA_ROOT", raising=False)
    monkeypatch.setattr(ingest, "tqdm", functools.partial(tqdm, disable=True))
    return tmp_path / "data"


def set_path(obj, path: tuple, value) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def del_path(obj, path: tuple) -> None:
    for key in path[:-1]:
        obj = obj[key]
    del obj[path[-1]]


def mutate_first_record(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        lines = read_lines(path)
        rec = json.loads(lines[0])
        out = edit(rec)
        lines[0] = (json.dumps(rec if out is None else out) + "\n").encode()
        write_lines(path, lines)

    return apply


def damage(kind: str, spec: dict) -> Callable[[Path], None]:
    """The file-level or record-level fault ``kind`` for a file described by ``spec``."""
    if kind == "not_utf8":
        return lambda p: write_lines(p, [read_lines(p)[0].replace(b'"', b'"\xff\xfe', 1)] + read_lines(p)[1:])
    if kind == "empty":
        return lambda p: write_lines(p, [])
    if kind == "truncated_line":  # the file ends in the middle of its first record
        return lambda p: write_lines(p, [read_lines(p)[0][: len(read_lines(p)[0]) // 2]])
    if kind == "list_not_object":
        return mutate_first_record(lambda rec: [rec])
    if kind == "null_text":
        return mutate_first_record(lambda rec: set_path(rec, spec["text"], None))
    if kind == "number_text":
        return mutate_first_record(lambda rec: set_path(rec, spec["text"], 7))
    if kind == "object_not_list":
        field = spec["list_field"] or "dialogue"
        return mutate_first_record(lambda rec: set_path(rec, (field,), {"x": 1}))
    if kind == "missing_field":
        return mutate_first_record(lambda rec: del_path(rec, (spec["key_field"],)))
    if kind == "extra_field":
        return mutate_first_record(lambda rec: set_path(rec, ("comment",), "x"))
    if kind == "duplicate":
        return lambda p: write_lines(p, [read_lines(p)[0].rstrip(b"\n") + b"\n"] * 2)
    raise AssertionError(kind)


EXPECTED = {  # kind -> the problem the message must state (regex), after "<file>:<line>"
    "not_utf8": r":1: not UTF-8 \(byte 0xff",
    "empty": r": no records \(empty or blank file\) for split {split}",
    "truncated_line": r":1: malformed JSON",
    "list_not_object": r":1: expected a JSON object, got \[\{{",
    "null_text": r":1: \S+: Input should be a valid string, got null$",
    "number_text": r":1: \S+: Input should be a valid string, got 7$",
    "object_not_list": r":1: \S+: Input should be a valid (list|string), got \{{\"x\": 1\}}$",
    "missing_field": r":1: {key_field}: Field required$",
    "extra_field": r":1: comment: Extra inputs are not permitted$",
    "duplicate": r":2: duplicate .*first at .*:1\)",
}
CASES = [(ds, kind) for ds in FILES for kind in EXPECTED]


def ingest_args(root: Path, dataset: str, **ingest_params) -> list[str]:
    params = write_params(root.parent / "params.yaml", root, **ingest_params)
    return [
        "--dataset",
        dataset,
        "--params",
        str(params),
        "--interim-dir",
        str(root.parent / "interim"),
        "--report-dir",
        str(root.parent / "reports"),
    ]


def assert_one_error_line(outcome, pattern: str) -> None:
    assert outcome.status == EXIT_USAGE, outcome.stderr
    assert "Traceback" not in outcome.stderr
    assert len(outcome.lines) == 1, outcome.stderr
    assert re.match(pattern, outcome.lines[0]), outcome.lines[0]


def expected_line(dataset: str, kind: str) -> str:
    spec = FILES[dataset]
    problem = EXPECTED[kind].format(split=re.escape(spec["split"]), key_field=spec["key_field"])
    return rf"error: {re.escape(spec['rel'])}{problem}"


@pytest.mark.parametrize("dataset, kind", CASES, ids=[f"{d}-{k}" for d, k in CASES])
def test_damaged_file_is_one_line_naming_file_line_and_problem(root, dataset, kind):
    spec = FILES[dataset]
    damage(kind, spec)(root / spec["rel"])
    outcome = run_inprocess(ingest.main, ingest_args(root, dataset))
    assert_one_error_line(outcome, expected_line(dataset, kind))
    assert not (root.parent / "interim" / f"{dataset}.parquet").exists()  # nothing half-done left behind


@pytest.mark.parametrize("dataset", FILES)
def test_truncated_or_missing_split_file(root, dataset):
    spec = FILES[dataset]
    path = root / spec["rel"]
    if path.suffix == ".gz":  # a download cut short: the gzip stream ends early
        path.write_bytes(path.read_bytes()[:-12])
        pattern = rf"error: {re.escape(spec['rel'])}:\d+: truncated or damaged file"
    else:
        path.unlink()
        rel_in_dataset = spec["rel"].split("/", 1)[1]
        pattern = (
            rf"error: .*{dataset}: local mirror of {dataset} is incomplete; missing \['{re.escape(rel_in_dataset)}'\]"
        )
    assert_one_error_line(run_inprocess(ingest.main, ingest_args(root, dataset)), pattern)


@pytest.mark.parametrize("dataset", FILES)
def test_absent_split_allowed_only_by_the_parameter(root, dataset):
    """An expected split that is missing (or an empty file) is an error unless ingest.allow_absent_splits names
    it; then the run succeeds, the split has no records and the report counts the allowed absence."""
    spec = FILES[dataset]
    directory = (root / spec["rel"]).parent
    # HMNet splits are many chunks: the split is absent when all of them are
    files = sorted(directory.glob("*.jsonl.gz")) if dataset in ("ami", "icsi") else [root / spec["rel"]]
    for f in files:
        f.unlink()
    outcome = run_inprocess(ingest.main, ingest_args(root, dataset))
    assert outcome.status == EXIT_USAGE and "incomplete; missing" in outcome.lines[0]
    outcome = run_inprocess(ingest.main, ingest_args(root, dataset, allow_absent_splits=[spec["split"]]))
    assert outcome.status == 0, outcome.stderr
    report = json.loads((root.parent / "reports" / f"ingest_{dataset}.json").read_text())
    domain, split = spec["split"].split("/")[1:]
    assert split not in report["counts"][domain]
    assert any(spec["split"] in note for note in report["notes"])


def test_records_skipped_by_design_are_counted_per_reason(root):
    path = root / "samsum" / "train.json"
    lines = read_lines(path)
    n = len(lines)
    extra = [
        json.dumps({"id": f"blank{i}", "dialogue": " \n", "summary": "nothing"}).encode() + b"\n" for i in range(3)
    ]
    write_lines(path, lines + extra)
    outcome = run_inprocess(ingest.main, ingest_args(root, "samsum"))
    assert outcome.status == 0, outcome.stderr
    report = json.loads((root.parent / "reports" / "ingest_samsum.json").read_text())
    # the fixture itself has one empty dialogue in train (test_ingest.py), plus the three added here
    assert report["skipped_by_reason"] == {"empty dialogue": 4}
    assert report["n_skipped"] == 4
    assert n > 0


# A new interpreter per case costs ~1.5 s here, so the full matrix runs in-process (same pipeline.common.cli.run path);
# these run the real command line, one per dataset and file kind, plus the debug switch.
SUBPROCESS_CASES = [("qmsum", "null_text"), ("samsum", "not_utf8"), ("ami", "duplicate"), ("icsi", "empty")]


@pytest.mark.slow
@pytest.mark.parametrize("dataset, kind", SUBPROCESS_CASES, ids=[f"{d}-{k}" for d, k in SUBPROCESS_CASES])
def test_command_line_error_is_one_line(root, dataset, kind):
    spec = FILES[dataset]
    damage(kind, spec)(root / spec["rel"])
    outcome = run_subprocess("pipeline.ingest", ingest_args(root, dataset), cwd=root.parent)
    assert_one_error_line(outcome, expected_line(dataset, kind))


@pytest.mark.slow
def test_debug_shows_the_traceback(root):
    spec = FILES["qmsum"]
    damage("null_text", spec)(root / spec["rel"])
    outcome = run_subprocess("pipeline.ingest", ingest_args(root, "qmsum"), cwd=root.parent, FEDMEET_DEBUG="1")
    assert outcome.status == 1
    assert "Traceback" in outcome.stderr and "DataError" in outcome.stderr


@pytest.mark.slow
@pytest.mark.shared_data
def test_real_qmsum_copy_with_null_content(shared_data, tmp_path):
    """The issue's hand test on a copy of the real QMSum files: a null turn content is named, not accepted."""
    shutil.copytree(shared_data / "qmsum", tmp_path / "data" / "qmsum")
    path = tmp_path / "data" / "qmsum" / "data" / "Committee" / "jsonl" / "val.jsonl"
    lines = read_lines(path)
    rec = json.loads(lines[4])
    rec["meeting_transcripts"][3]["content"] = None
    lines[4] = (json.dumps(rec) + "\n").encode()
    write_lines(path, lines)
    outcome = run_subprocess("pipeline.ingest", ingest_args(tmp_path / "data", "qmsum"), cwd=tmp_path)
    assert_one_error_line(
        outcome,
        r"error: qmsum/data/Committee/jsonl/val\.jsonl:5: meeting_transcripts\[3\]\.content: "
        r"Input should be a valid string, got null$",
    )
