"""Canonical records -> model inputs (stage ``examples``: pipeline/examples.py), and the paper's Table II statistics.

Input text (METHOD.md section 2): ``query #SEP# transcript`` for QMSum, the dialogue for SAMSum (optionally
``query #SEP# dialogue``), the whole meeting for AMI and ICSI. The transcript is the turns rendered
``Speaker: content`` and joined with "\\n": a newline keeps turn boundaries visible to the model (BART's
byte-level BPE has a token for it) and costs one token per turn, like a space would."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import field, fields
from typing import Annotated, Any, Literal

import pandas as pd
from pydantic import Field
from tqdm import tqdm

from pipeline.common import schema
from pipeline.common.config import Fraction, config
from pipeline.common.schema import QMSUM_DOMAINS, SPLITS, DataError, Example, Turn, model_input

# The paper's Table II (METHOD.md section 2): per QMSum domain and split, n and the four averages.
PAPER_TABLE_II: dict[str, dict[str, dict[str, float]]] = {
    "Academic": {
        "train": {"n": 218, "avg_turns": 54.64, "avg_speakers": 4.35, "avg_words": 1049.8, "avg_summary_words": 46.22},
        "valid": {"n": 45, "avg_turns": 59.33, "avg_speakers": 4.09, "avg_words": 1156.53, "avg_summary_words": 50.67},
        "test": {"n": 49, "avg_turns": 46.45, "avg_speakers": 4.22, "avg_words": 912.00, "avg_summary_words": 43.82},
    },
    "Committee": {
        "train": {"n": 284, "avg_turns": 9.51, "avg_speakers": 3.26, "avg_words": 667.14, "avg_summary_words": 77.95},
        "valid": {"n": 67, "avg_turns": 9.13, "avg_speakers": 3.10, "avg_words": 607.9, "avg_summary_words": 73.67},
        "test": {"n": 66, "avg_turns": 10.85, "avg_speakers": 4.14, "avg_words": 713.26, "avg_summary_words": 69.94},
    },
    "Product": {
        "train": {"n": 593, "avg_turns": 68.61, "avg_speakers": 3.76, "avg_words": 898.04, "avg_summary_words": 65.09},
        "valid": {"n": 125, "avg_turns": 79.30, "avg_speakers": 3.90, "avg_words": 903.53, "avg_summary_words": 65.38},
        "test": {"n": 129, "avg_turns": 77.86, "avg_speakers": 3.93, "avg_words": 933.67, "avg_summary_words": 57.38},
    },
}
# Published sizes of the other corpora (METHOD.md section 2; SAMSum's count includes its one empty dialogue).
PAPER_SIZES = {
    "SAMSum": {"train": 14732, "valid": 818, "test": 819},
    "AMI": {"train": 97, "valid": 20, "test": 20},
    "ICSI": {"train": 43, "valid": 10, "test": 6},
}
STAT_KEYS = ("avg_turns", "avg_speakers", "avg_words", "avg_summary_words")
QueryTypes = Annotated[list[Literal["general", "specific"]], Field(min_length=1)]  # what ingest gives QMSum records
# QMSum's jsonl files carry no meeting names, but its Product meetings ARE the 137 AMI meetings and its Academic
# meetings ARE the 59 ICSI meetings (with a different split). The leakage guard needs one name per meeting across
# datasets, so each QMSum meeting is matched to the HMNet transcript sharing the most word 5-grams (Jaccard). The two
# tokenisations differ slightly, so the true match scores 0.17-0.35 while the runner-up stays below 0.005 on the
# shared data: a threshold far from both is safe, and a match must also be one-to-one, otherwise we stop.
SHINGLE_WORDS = 5
_WORD = re.compile(r"[a-z0-9]+")


def shingles(contents: Iterable[str]) -> set[str]:
    """Lower-cased alphanumeric word SHINGLE_WORDS-grams of a transcript (speaker names left out: they differ)."""
    words = _WORD.findall(" ".join(contents).lower())
    return {" ".join(words[i : i + SHINGLE_WORDS]) for i in range(len(words) - SHINGLE_WORDS + 1)}


def link_meetings(
    queries: Mapping[str, Iterable[str]], corpus: Mapping[str, Iterable[str]], min_jaccard: float
) -> tuple[dict[str, str], dict[str, Any]]:
    """Match each meeting in ``queries`` (id -> turn contents) to one in ``corpus`` (id -> turn contents): the links
    (query meeting id -> corpus meeting id) and their record: the unmatched, the lowest Jaccard of a match, and the
    highest second-best score seen (how close a wrong match came)."""
    corpus_sets = {cid: shingles(c) for cid, c in corpus.items()}
    index: dict[str, list[str]] = defaultdict(list)  # shingle -> corpus meetings containing it
    for cid, sh in corpus_sets.items():
        for s in sh:
            index[s].append(cid)
    owner: dict[str, str] = {}  # corpus meeting -> the query meeting linked to it
    scores, unmatched, runner_up = [], [], 0.0
    for qid, contents in queries.items():
        q = shingles(contents)
        shared = Counter(cid for s in q for cid in index.get(s, ()))
        ranked = sorted(
            ((inter / (len(q) + len(corpus_sets[cid]) - inter), cid) for cid, inter in shared.items()), reverse=True
        )
        runner_up = max(runner_up, ranked[1][0] if len(ranked) > 1 else 0.0)
        if not ranked or ranked[0][0] < min_jaccard:
            unmatched.append(qid)
            continue
        score, cid = ranked[0]
        if cid in owner:
            raise DataError(
                f"meetings {owner[cid]} and {qid} both match {cid} (Jaccard {score:.3f}); "
                "the QMSum and HMNet transcripts do not correspond one-to-one"
            )
        owner[cid] = qid
        scores.append(round(score, 4))
    return {qid: cid for cid, qid in owner.items()}, {
        "unmatched": unmatched,
        "min_score": min(scores, default=None),
        "max_runner_up_score": round(runner_up, 4),
    }


@config
class ExamplesConfig:
    sep_token: str = "#SEP#"
    qmsum_query_types: QueryTypes = field(default_factory=lambda: ["specific"])
    samsum_query: str = ""
    link_min_jaccard: Fraction = 0.05


def qmsum_links(interim: dict[str, pd.DataFrame], min_jaccard: float) -> tuple[dict[str, str], dict[str, Any]]:
    """QMSum meeting hash -> AMI/ICSI meeting name for Product/Academic (whole transcripts from general queries)."""
    links, report, qm = {}, {}, interim["qmsum"]
    for domain, corpus in schema.SHARED_MEETINGS.items():
        if corpus not in interim:
            report[domain] = {"linked_to": corpus, "status": f"{corpus} not ingested; meetings keep their hash names"}
            continue
        full = qm[(qm.domain == domain) & (qm.query_type == "general")].drop_duplicates("meeting_id")
        whole = {r.meeting_id: [t["content"] for t in r.turns] for r in full.itertuples()}  # a general query's turns
        queries = {m: whole.get(m, []) for m in qm.meeting_id[qm.domain == domain].unique()}  # none: unmatched
        other = interim[corpus]
        corpus_meetings = {r.meeting_id: [t["content"] for t in r.turns] for r in other.itertuples()}
        domain_links, record = link_meetings(queries, corpus_meetings, min_jaccard)
        links.update(domain_links)
        splits_q, splits_c = dict(zip(full.meeting_id, full.split)), dict(zip(other.meeting_id, other.split))
        report[domain] = {
            "linked_to": corpus,
            "meetings": len(queries),
            "linked": len(domain_links),
            **record,
            "same_split": sum(splits_q[q] == splits_c[c] for q, c in domain_links.items()),
        }
    return links, report


def build_examples(interim: dict[str, pd.DataFrame], cfg: ExamplesConfig) -> tuple[pd.DataFrame, dict[str, Any]]:
    """All examples, plus a report of the QMSum meeting links."""
    links, link_report = qmsum_links(interim, cfg.link_min_jaccard) if "qmsum" in interim else ({}, {})
    rows: list[Example] = []  # pandas reads dataclasses as rows
    for dataset, frame in interim.items():
        if dataset == "qmsum":
            frame = frame[frame.query_type.isin(cfg.qmsum_query_types)]
        for r in tqdm(frame.itertuples(index=False), total=len(frame), desc=f"examples {dataset}", mininterval=2):
            turns = [Turn(t["speaker"], t["content"]) for t in r.turns]
            meeting_id = links.get(r.meeting_id, r.meeting_id)
            if dataset == "qmsum":
                kind = "q" if r.query_type == "specific" else "g"
                example_id = f"qmsum/{r.domain}/{r.split}/{meeting_id}/{kind}{r.query_index}"
                query = r.query
            else:
                example_id = f"{dataset}/{r.split}/{meeting_id}"
                query = cfg.samsum_query if dataset == "samsum" else ""
            rows.append(
                Example(
                    example_id=example_id,
                    dataset=dataset,
                    domain=r.domain,
                    split=r.split,
                    meeting_id=meeting_id,
                    query=query,
                    query_type=r.query_type,
                    source=model_input(query, turns, cfg.sep_token),
                    target=r.summary,
                    n_turns=len(turns),
                    n_speakers=len({t.speaker for t in turns}),
                    n_words=sum(schema.spoken_word_count(t) for t in turns),
                    n_summary_words=schema.summary_word_count(r.summary),
                )
            )
    examples = pd.DataFrame(rows, columns=[f.name for f in fields(Example)])  # the columns also when empty
    if len(dup := examples.example_id[examples.example_id.duplicated()]):
        raise DataError(f"duplicate example ids, e.g. {dup.iloc[0]!r} ({len(dup)} duplicates)")
    return examples, link_report


def table_ii(examples: pd.DataFrame) -> dict[str, Any]:
    """dataset -> domain -> split -> {n, avg_turns, avg_speakers, avg_words, avg_summary_words}."""
    stats: dict[str, Any] = {}
    for (dataset, domain), rows in examples.groupby(["dataset", "domain"], sort=False):
        stats.setdefault(dataset, {})[domain] = {  # fixed split order for readers
            split: {"n": len(g), **{key: round(float(g[key.replace("avg", "n", 1)].mean()), 2) for key in STAT_KEYS}}
            for split in SPLITS
            if len(g := rows[rows.split == split])
        }
    return stats


def stats_markdown(
    stats: dict[str, Any], skipped: dict[str, dict[str, int]], links: dict[str, Any], query_types=("specific",)
) -> str:
    """``query_types``: examples.qmsum_query_types, the kinds of QMSum query the examples (and so the table) hold."""
    paper = "" if list(query_types) == ["specific"] else ", whose numbers count specific queries only"
    out = [
        "# Data statistics (ours / paper)",
        "",
        f"QMSum, {' and '.join(query_types)} queries (the paper's Table II{paper}). Words: summary = `str.split(' ')` "
        "(the paper's counter,",
        "reproduces Table II exactly); spoken = whitespace words of `speaker content` with `{...}` tags removed",
        "(the paper's counter is unknown).",
        "",
        "| domain | split | n | avg turns | avg speakers | avg words spoken | avg summary words |",
        "|---|---|---|---|---|---|---|",
    ]
    for domain in QMSUM_DOMAINS:
        for split in SPLITS:
            if ours := stats.get("qmsum", {}).get(domain, {}).get(split):
                paper = PAPER_TABLE_II[domain][split]
                cells = [f"{ours['n']} / {paper['n']}"] + [f"{ours[k]:.2f} / {paper[k]:.2f}" for k in STAT_KEYS]
                out.append(f"| {domain} | {split} | " + " | ".join(cells) + " |")
    out += [
        "",
        "Other corpora (ours; paper size where published):",
        "",
        "| dataset | split | n | paper n | avg turns | avg speakers | avg words spoken | avg summary words |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for by_domain in (stats[dataset] for dataset in stats if dataset != "qmsum"):
        for domain, by_split in by_domain.items():
            for split, s in by_split.items():
                cells = [s["n"], PAPER_SIZES.get(domain, {}).get(split, "")] + [f"{s[k]:.2f}" for k in STAT_KEYS]
                out.append(f"| {domain} | {split} | " + " | ".join(map(str, cells)) + " |")
    out += ["", "Records skipped at ingest (by design, with reason):", ""]
    out += [f"- {ds}: {n} x {reason}" for ds, by in skipped.items() for reason, n in by.items()] or ["- none"]
    out += ["", "QMSum meetings named after the AMI/ICSI meeting they are (5-gram Jaccard match):", ""]
    out += [f"- {domain}: {json.dumps(rep)}" for domain, rep in links.items()]
    return "\n".join(out) + "\n"
