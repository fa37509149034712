"""AMI and ICSI as HMNet (Zhu et al. 2020) ships them: each corpus split as numbered gzip jsonl chunks under
``hmnet/ExampleRawData/meeting_summarization/<CORPUS>_proprec/<split>/split_<k>.jsonl.gz``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pydantic import ConfigDict

from pipeline.common.schema import SPLIT_ALIASES, CanonicalRecord, DataError, IngestReport, Turn
from pipeline.datasets.readers.registry import DatasetSpec, register_reader
from pipeline.datasets.readers.upstream import UpstreamRecord, _unique, split_json_lines

# HMNet keeps each corpus split as numbered gzip chunks; the numbers of chunks are those of the pinned
# upstream commit (AMI 32/20/20, ICSI 32/10/6; see ../shared/data/{ami,icsi}/SOURCE.md).
HMNET_CORPUS = {"ami": "AMI", "icsi": "ICSI"}
HMNET_CHUNKS = {"ami": {"train": 32, "dev": 20, "test": 20}, "icsi": {"train": 32, "dev": 10, "test": 6}}
HMNET_PREFIX = "hmnet/"  # the mirror keeps the HMNet repository under <dataset>/hmnet/


class HMNetUtterance(UpstreamRecord):
    model_config = ConfigDict(extra="ignore")  # its other fields (POS, entity tags) are not read
    word: list[str]


class HMNetTurn(UpstreamRecord):
    speaker: str
    utt: HMNetUtterance
    role: str | None = None


class HMNetMeeting(UpstreamRecord):
    id: str
    meeting: list[HMNetTurn]
    summary: list[str]


def hmnet_files(dataset: str) -> dict[str, str]:
    """Each chunk file of ``dataset`` and its split key."""
    corpus = HMNET_CORPUS[dataset]
    return {
        f"{HMNET_PREFIX}ExampleRawData/meeting_summarization/{corpus}_proprec/{split}/split_{k}.jsonl.gz": (
            f"{dataset}/{corpus}/{SPLIT_ALIASES[split]}"
        )
        for split, n in HMNET_CHUNKS[dataset].items()
        for k in range(n)
    }


def read_hmnet(
    directory: Path, report: IngestReport, allow_absent: list[str], dataset: str
) -> Iterator[CanonicalRecord]:
    meetings: dict[str, str] = {}
    for where, origin, meeting in split_json_lines(directory, hmnet_files(dataset), allow_absent, report, HMNetMeeting):
        _unique(meetings, meeting.id, where, "meeting id")
        turns = []
        for utt in meeting.meeting:
            # "<role> <letter>", e.g. "PM B" or "Grad F": the form QMSum's Academic transcripts use for the same ICSI
            # meetings ("Grad F", "PhD C"). The role carries meaning a summarizer can use ("the project manager said
            # ..."), and the letter keeps two participants with the same role (common in ICSI) apart.
            if not (role := (utt.role or "").strip()):
                report.note("turns without a role (speaker letter only)")
            turns.append(Turn(f"{role} {utt.speaker}" if role else utt.speaker, " ".join(utt.utt.word)))
        # blank sentences only are no summary either (a target to train toward nothing and score 0 against)
        if not turns or not (summary := "\n".join(s.strip() for s in meeting.summary)).strip():
            raise DataError(f"{where}: meeting {meeting.id}: empty {'transcript' if not turns else 'summary'}")
        yield CanonicalRecord(**origin, meeting_id=meeting.id, turns=turns, summary=summary)


for _dataset in HMNET_CORPUS:
    register_reader(
        DatasetSpec(
            _dataset,
            read=lambda d, r, a, dataset=_dataset: read_hmnet(d, r, a, dataset),
            files=lambda dataset=_dataset: hmnet_files(dataset),
            upstream_path=lambda rel: rel[len(HMNET_PREFIX) :],  # the download address is the HMNet repository itself
            url="https://raw.githubusercontent.com/microsoft/HMNet/416966c63e3cb7a57dc59b4ce8fa76f11fd048be",
        )
    )
