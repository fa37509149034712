"""pytest plugin of `make reliability`: writes the fault classes tried, their cases and outcomes to a Markdown file.

    PYTHONPATH=tests python -m pytest -p reliability_report --reliability-report reports/reliability.md <tests>

A case is one collected test item (a parametrized case counts once per parameter set; a hypothesis test once,
with its generated examples counted by hypothesis itself). Tests outside the classes below are listed as "other".
"""

from __future__ import annotations

import platform
import time
from collections import defaultdict
from pathlib import Path

import pytest

from pipeline.common import atomic

# (fault class, what is done to the project, how a node id is recognised: file and optional test-name prefixes)
CLASSES = [
    (
        "Inputs: damaged dataset files",
        "Every file kind of QMSum (jsonl), SAMSum (json lines), AMI and ICSI (gzip jsonl chunks): bytes that are not "
        "UTF-8, empty file, file ending inside a record, gzip cut short, a list where an object belongs, null or a "
        "number where text belongs, an object where a list belongs, missing and extra fields, duplicate ids, a split "
        "file missing (allowed only by `ingest.allow_absent_splits`), records skipped by design counted per reason. "
        "Expected: one `error:` line naming file, line and problem, exit status 2, no traceback (traceback only with "
        "FEDMEET_DEBUG).",
        "test_reliability_inputs.py",
        (),
    ),
    (
        "Inputs: mutated records (property-based)",
        "hypothesis mutates the first record of each reader's file (any JSON value replacing any field, fields "
        "deleted or added, the line cut short or foreign bytes spliced in), 40 examples per reader. Expected: the "
        "records parse into well-typed rows, or DataError naming the file and line; never another exception.",
        "test_reliability_properties.py",
        (),
    ),
    (
        "Parameters",
        "One bad value per case in a copy of params.yaml, for every stage (unknown keys, wrong types, out-of-range "
        "values: tau <= 0, top_k 0 or beyond the decoder's layers, bottleneck 0, batch sizes 0, unknown method, "
        "partition scheme, backbone), run in an empty directory; stages run before the stage that makes their input. "
        "Expected: exit 2, one line naming the key and what is allowed (or the missing file), nothing written.",
        "test_reliability_params.py",
        (),
    ),
    (
        "Outputs written whole",
        "A scan of pipeline/ for writes that bypass pipeline/common/atomic.py; the ingest stage SIGKILLed inside the write of "
        "each of its outputs (FEDMEET_FAULT_KILL_WRITE), a directory output killed before its rename, `dvc repro` of a "
        "killed stage. Expected: the old output whole, the rerun succeeds and removes the killed run's temporaries, "
        "dvc.lock records only the complete file.",
        "test_reliability_outputs.py",
        (),
    ),
    (
        "Concurrent MLflow writers",
        "Two processes log runs (params, a metric per step, tags) to one fresh SQLite store at the same moment; two "
        "train stages (a federated and a local tiny training, 2 rounds) started together against one fresh store; a "
        "store that answers 'database is locked'. Expected: every run FINISHED with every param and each per-round "
        "metric once per round; locked calls retried, other errors raised at once.",
        "test_reliability_tracking.py",
        (),
    ),
    (
        "Caches and the backbone directory",
        "Prefix-cache entries truncated, a tensor byte flipped, the checksum stripped; backbone directory files cut "
        "short, changed or missing. Expected: a damaged cache entry is counted, removed and recomputed exactly; a "
        "damaged backbone names the file.",
        "test_cache.py",
        ("test_damaged_entry",),
    ),
    ("Caches and the backbone directory", "", "test_reliability_caches.py", ()),
    (
        "Resume after a kill",
        "A federated run stopped after a round's checkpoint and rerun; a 3-round, 3-client run (the train stage) "
        "SIGKILLed in turn inside local training before the first checkpoint and in round 2, right after aggregation, "
        "inside the server checkpoint write, between rounds, between a round's checkpoint and its recording, inside the "
        "final metrics.json write and inside the MLflow artifact upload, each rerun resuming what the last left, then "
        "run to its end. Expected: each rerun resumes after the last checkpointed round, and the run ends with the "
        "uninterrupted run's adapters (bit for bit), rounds.json, best rounds, gate log and MLflow metrics (each once "
        "per step; a run killed before its first checkpoint starts over and its MLflow run is marked KILLED).",
        "test_federated.py",
        ("test_killed_run_resumes",),
    ),
]


def classify(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    for title, _, filename, prefixes in CLASSES:
        if path.endswith(filename) and (not prefixes or name.startswith(prefixes)):
            return title
    return "other"


class Recorder:
    def __init__(self, out: Path):
        self.out = out
        self.outcomes: dict[str, str] = {}
        self.started = time.monotonic()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.outcomes[report.nodeid] = "skipped" if report.skipped else report.outcome
        elif report.when == "teardown" and report.failed:
            self.outcomes[report.nodeid] = "failed"

    @pytest.hookimpl
    def pytest_sessionfinish(self, session, exitstatus):
        by_class: dict[str, dict[str, str]] = defaultdict(dict)
        for nodeid, outcome in self.outcomes.items():
            by_class[classify(nodeid)][nodeid] = outcome
        seconds = time.monotonic() - self.started
        lines = [
            "# Reliability: faults tried on purpose",
            "",
            "Written by `make reliability` (tests/reliability_report.py); issue 15. Each class lists what was "
            "done to the project, what is expected, and the outcome of every case.",
            "",
            f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, Python {platform.python_version()}, "
            f"{len(self.outcomes)} cases in {seconds:.0f} s.",
            "",
            "| Fault class | Cases | Passed | Failed | Skipped |",
            "|---|---:|---:|---:|---:|",
        ]
        titles = list(dict.fromkeys(c[0] for c in CLASSES)) + ["other"]
        for title in titles:
            cases = by_class.get(title, {})
            if cases:
                counts = {k: sum(v == k for v in cases.values()) for k in ("passed", "failed", "skipped")}
                lines.append(
                    f"| {title} | {len(cases)} | {counts['passed']} | {counts['failed']} | {counts['skipped']} |"
                )
        for title in titles:
            cases = by_class.get(title, {})
            if not cases:
                continue
            lines += ["", f"## {title}", ""]
            lines += [d for t, d, _, _ in CLASSES if t == title and d]
            lines += [""] + [f"- `{nodeid}`: {outcome}" for nodeid, outcome in sorted(cases.items())]
        atomic.write_text(self.out, "\n".join(lines) + "\n")


def pytest_addoption(parser):
    parser.addoption("--reliability-report", default=None, help="write the fault classes and outcomes here")


def pytest_configure(config):
    out = config.getoption("--reliability-report")
    if out:
        config.pluginmanager.register(Recorder(Path(out)), "reliability-recorder")
