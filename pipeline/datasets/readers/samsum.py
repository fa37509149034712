"""SAMSum (Gliwa et al. 2019): chat dialogues with summaries, one JSON-lines file per split (the mirror's
``{train,validation,test}.json``); upstream one zip whose members are ``samsum/<split>.json``."""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

from pipeline.common.schema import SPLIT_ALIASES, CanonicalRecord, DataError, IngestReport, Skipped, Turn
from pipeline.datasets.readers.registry import DatasetSpec, register_reader
from pipeline.datasets.readers.upstream import UpstreamRecord, _unique, absent_allowed, split_json_lines

SAMSUM_FILES = ("train.json", "validation.json", "test.json")


def samsum_files() -> dict[str, str]:
    return {name: f"samsum/SAMSum/{SPLIT_ALIASES[name.removesuffix('.json')]}" for name in SAMSUM_FILES}


class SamsumDialogue(UpstreamRecord):
    id: str
    dialogue: str
    summary: str


def split_dialogue(dialogue: str, where: str, report: IngestReport) -> list[Turn]:
    """``Speaker: text`` lines -> turns, split at the first ``": "``. A few upstream lines lack the space
    (``"Phil:<file_photo>"``): those split at the first ``":"``. A line with no colon at all continues the previous
    turn. Both repairs are counted in the report."""
    turns: list[Turn] = []
    for line in re.split(r"\r\n|\n", dialogue):
        if not line.strip():
            report.note("blank dialogue lines (dropped)")
            continue
        if ": " in line:
            speaker, content = line.split(": ", 1)
        elif ":" in line:
            speaker, content = line.split(":", 1)
            report.note("turns split at ':' without a following space")
        elif turns:
            turns[-1] = Turn(turns[-1].speaker, f"{turns[-1].content} {line.strip()}")
            report.note("lines without a speaker appended to the previous turn")
            continue
        else:
            raise DataError(f"{where}: first dialogue line has no 'Speaker:' prefix: {line[:60]!r}")
        turns.append(Turn(speaker.strip(), content.strip()))
    return turns


def read_samsum(directory: Path, report: IngestReport, allow_absent: list[str] = ()) -> Iterator[CanonicalRecord]:
    dialogues: dict[str, str] = {}
    for where, origin, rec in split_json_lines(directory, samsum_files(), allow_absent, report, SamsumDialogue):
        _unique(dialogues, rec.id, where, "dialogue id")
        if empty := [f"empty {key}" for key in ("dialogue", "summary") if not getattr(rec, key).strip()]:
            report.skipped.append(Skipped(origin["source_file"], origin["source_line"], rec.id, empty[0]))
            continue
        turns = split_dialogue(rec.dialogue, f"{where}: dialogue {rec.id}", report)
        yield CanonicalRecord(**origin, meeting_id=rec.id, turns=turns, summary=rec.summary)


def _download(base: str, target: Path, fetch, write, allow_absent: list[str]) -> None:
    """One zip upstream; its members samsum/{train,validation,test}.json are stored without the prefix. A member
    may be missing where ``ingest.allow_absent_splits`` lets its split be absent."""
    with zipfile.ZipFile(io.BytesIO(fetch(base))) as zf:
        for name, split_key in samsum_files().items():
            member = f"samsum/{name}"
            if member in zf.namelist():
                write(target / name, zf.read(member))
            elif not absent_allowed(split_key, allow_absent):
                raise DataError(f"{base}: zip has no member {member!r}")


SAMSUM_MIRROR = "https://raw.githubusercontent.com/Prathamesh1199/My_Dataset/c956de19db32c7cf9e60259d88cbab0d27e82ee6"
register_reader(DatasetSpec("samsum", read_samsum, samsum_files, _download, url=f"{SAMSUM_MIRROR}/samsum.zip"))
