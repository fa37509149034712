"""Stage `ingest`: read one dataset in its upstream format into the canonical table.

    python -m pipeline.ingest --dataset qmsum      # -> data/interim/qmsum.parquet, reports/data/ingest_qmsum.json

Readers raise DataError naming file, line and problem; records left out by design (empty SAMSum dialogue)
are counted in the report with their reason.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from pipeline.config import from_dict, load_params
from pipeline.schema import (
    DATASETS,
    QMSUM_DOMAINS,
    CanonicalRecord,
    DataError,
    IngestReport,
    Skipped,
    Turn,
    canonical_arrow_schema,
    normalise_split,
)
from pipeline.sources import HMNET_CHUNKS, HMNET_CORPUS, HMNET_PREFIX, SAMSUM_FILES, IngestConfig, resolve_source
from pipeline.timing import stage_timer


def _json_lines(path: Path, display: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for every non-blank line; malformed JSON names file and line."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{display}:{line_no}: malformed JSON ({exc.msg} at column {exc.colno})") from None


def _field(obj: Any, name: str, where: str, kind: type | tuple[type, ...] = object) -> Any:
    if not isinstance(obj, dict) or name not in obj:
        raise DataError(f"{where}: missing field {name!r}")
    value = obj[name]
    if not isinstance(value, kind):
        raise DataError(f"{where}: field {name!r} has type {type(value).__name__}, expected {kind}")
    return value


# ---------------------------------------------------------------------------------------------- QMSum
def qmsum_meeting_id(transcript: list[dict]) -> str:
    """QMSum's jsonl lines carry no meeting name, so a meeting is named by a hash of its transcript.

    The name is stable across mirrors and line orders (the Product train file was re-ordered, see
    SOURCE.md). The `examples` stage links Product/Academic meetings to their AMI/ICSI names.
    """
    text = json.dumps([[t["speaker"], t["content"]] for t in transcript], ensure_ascii=True)
    return "m" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:10]


def _parse_span(raw: Any, n_turns: int, where: str) -> tuple[int, int]:
    if not isinstance(raw, (list, tuple)) or len(raw) != 2:
        raise DataError(f"{where}: span {raw!r} is not a [start, end] pair")
    try:
        start, end = int(raw[0]), int(raw[1])
    except (TypeError, ValueError):
        raise DataError(f"{where}: span {raw!r} has a non-integer index") from None
    if start > end:
        raise DataError(f"{where}: span [{start}, {end}] is reversed")
    if start < 0 or end > n_turns:
        raise DataError(f"{where}: span [{start}, {end}] is out of range for a meeting of {n_turns} turns")
    return start, end


def read_qmsum(directory: Path, report: IngestReport) -> Iterator[CanonicalRecord]:
    for domain in QMSUM_DOMAINS:
        for upstream_split in ("train", "val", "test"):
            rel = f"data/{domain}/jsonl/{upstream_split}.jsonl"
            display = f"qmsum/{rel}"
            split = normalise_split(upstream_split, display)
            for line_no, meeting in _json_lines(directory / rel, display):
                where = f"{display}:{line_no}"
                transcript = _field(meeting, "meeting_transcripts", where, list)
                turns = [
                    Turn(str(_field(t, "speaker", f"{where}: meeting_transcripts[{i}]")),
                         str(_field(t, "content", f"{where}: meeting_transcripts[{i}]")))
                    for i, t in enumerate(transcript)
                ]
                meeting_id = qmsum_meeting_id(transcript)
                for query_type, key in (("general", "general_query_list"), ("specific", "specific_query_list")):
                    for qi, q in enumerate(_field(meeting, key, where, list)):
                        qwhere = f"{where}: meeting {meeting_id} {key}[{qi}]"
                        query = str(_field(q, "query", qwhere))
                        answer = str(_field(q, "answer", qwhere))
                        if query_type == "specific":
                            spans = [_parse_span(s, len(turns), qwhere)
                                     for s in _field(q, "relevant_text_span", qwhere, list)]
                            # End-exclusive slices, in the order given (this reproduces Table II's turn counts).
                            selected = [t for start, end in spans for t in turns[start:end]]
                            empty = sum(1 for start, end in spans if start == end)
                            if empty:
                                report.note("specific spans with start == end (empty slice, kept)", empty)
                            if not selected:
                                report.note("specific queries whose spans select no turn (kept, query only)")
                        else:
                            spans, selected = [], list(turns)
                        yield CanonicalRecord(
                            dataset="qmsum", domain=domain, split=split, meeting_id=meeting_id,
                            query_index=qi, query=query, query_type=query_type, turns=selected, spans=spans,
                            summary=answer, source_file=display, source_line=line_no,
                        )


# ---------------------------------------------------------------------------------------------- AMI / ICSI
def hmnet_speaker(turn: dict, where: str) -> str:
    """``"<role> <letter>"``, e.g. ``"PM B"`` or ``"Grad F"``.

    This is the form QMSum's Academic transcripts use for the same ICSI meetings ("Grad F", "PhD C"): the
    role carries meaning a summarizer can use ("the project manager said ..."), and the letter keeps two
    participants with the same role (common in ICSI) apart.
    """
    letter = str(_field(turn, "speaker", where))
    role = str(turn.get("role") or "").strip()
    return f"{role} {letter}" if role else letter


def read_hmnet(directory: Path, dataset: str, report: IngestReport) -> Iterator[CanonicalRecord]:
    corpus = HMNET_CORPUS[dataset]
    for upstream_split, n_chunks in HMNET_CHUNKS[dataset].items():
        split = normalise_split(upstream_split)
        for k in range(n_chunks):
            rel = f"{HMNET_PREFIX}ExampleRawData/meeting_summarization/{corpus}_proprec/{upstream_split}/split_{k}.jsonl.gz"
            display = f"{dataset}/{rel}"
            for line_no, meeting in _json_lines(directory / rel, display):
                where = f"{display}:{line_no}"
                meeting_id = str(_field(meeting, "id", where))
                mwhere = f"{where}: meeting {meeting_id}"
                turns = []
                for i, utt in enumerate(_field(meeting, "meeting", mwhere, list)):
                    twhere = f"{mwhere} meeting[{i}]"
                    if not str(utt.get("role") or "").strip():
                        report.note("turns without a role (speaker letter only)")
                    words = _field(_field(utt, "utt", twhere, dict), "word", f"{twhere}.utt", list)
                    turns.append(Turn(hmnet_speaker(utt, twhere), " ".join(map(str, words))))
                sentences = _field(meeting, "summary", mwhere, list)
                if not turns or not sentences:
                    raise DataError(f"{mwhere}: empty {'transcript' if not turns else 'summary'}")
                yield CanonicalRecord(
                    dataset=dataset, domain=corpus, split=split, meeting_id=meeting_id, query_index=-1,
                    query="", query_type="none", turns=turns, spans=[],
                    summary="\n".join(str(s).strip() for s in sentences),
                    source_file=display, source_line=line_no,
                )


# ---------------------------------------------------------------------------------------------- SAMSum
_TURN_SEP = re.compile(r"\r\n|\n")


def split_dialogue(dialogue: str, where: str, report: IngestReport) -> list[Turn]:
    """``Speaker: text`` lines -> turns, split at the first ``": "``.

    A few upstream lines lack the space (``"Phil:<file_photo>"``): those split at the first ``":"``. A line
    with no colon at all continues the previous turn. Both repairs are counted in the report.
    """
    turns: list[Turn] = []
    for line in _TURN_SEP.split(dialogue):
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


def read_samsum(directory: Path, report: IngestReport) -> Iterator[CanonicalRecord]:
    for name in SAMSUM_FILES:
        display = f"samsum/{name}"
        split = normalise_split(name.removesuffix(".json"), display)
        for line_no, rec in _json_lines(directory / name, display):
            where = f"{display}:{line_no}"
            rid = str(_field(rec, "id", where))
            rwhere = f"{where}: dialogue {rid}"
            dialogue = _field(rec, "dialogue", rwhere, str)
            summary = _field(rec, "summary", rwhere, str)
            if not dialogue.strip():
                report.skipped.append(Skipped(display, line_no, rid, "empty dialogue"))
                continue
            yield CanonicalRecord(
                dataset="samsum", domain="SAMSum", split=split, meeting_id=rid, query_index=-1, query="",
                query_type="none", turns=split_dialogue(dialogue, rwhere, report), spans=[], summary=summary,
                source_file=display, source_line=line_no,
            )


# ---------------------------------------------------------------------------------------------- stage
def ingest_dataset(dataset: str, directory: Path) -> tuple[pd.DataFrame, IngestReport]:
    """Read ``dataset`` from ``directory`` (its upstream layout) into the canonical table."""
    report = IngestReport(dataset=dataset, source=str(directory))
    if dataset == "qmsum":
        records = read_qmsum(directory, report)
    elif dataset in HMNET_CORPUS:
        records = read_hmnet(directory, dataset, report)
    elif dataset == "samsum":
        records = read_samsum(directory, report)
    else:
        raise DataError(f"unknown dataset {dataset!r}; expected one of {DATASETS}")
    rows = []
    for rec in tqdm(records, desc=f"ingest {dataset}", unit="rec", mininterval=2):
        report.count(rec)
        rows.append(rec.to_row())
    frame = pd.DataFrame(rows, columns=[f.name for f in canonical_arrow_schema()])
    return frame, report


def write_outputs(frame: pd.DataFrame, report: IngestReport, interim_dir: Path, report_dir: Path) -> None:
    interim_dir.mkdir(parents=True, exist_ok=True)
    report_dir.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(interim_dir / f"{report.dataset}.parquet", schema=canonical_arrow_schema(), index=False)
    (report_dir / f"ingest_{report.dataset}.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")


def read_interim(path: Path) -> pd.DataFrame:
    return pd.read_parquet(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, choices=DATASETS)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--interim-dir", default="data/interim")
    ap.add_argument("--report-dir", default="reports/data")
    args = ap.parse_args(argv)
    with stage_timer(f"ingest-{args.dataset}"):  # wall time, peak RSS -> reports/timing/
        cfg = from_dict(IngestConfig, load_params(args.params).get("ingest"), "ingest")
        if args.dataset not in cfg.datasets:
            raise DataError(f"dataset {args.dataset!r} is not in ingest.datasets {cfg.datasets}")
        directory = resolve_source(args.dataset, cfg)
        frame, report = ingest_dataset(args.dataset, directory)
        write_outputs(frame, report, Path(args.interim_dir), Path(args.report_dir))
        print(f"{args.dataset}: {report.n_records} records from {directory}; counts {report.counts}; "
              f"skipped {len(report.skipped)}")


if __name__ == "__main__":
    main()
