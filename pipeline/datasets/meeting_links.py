"""Name QMSum's Product and Academic meetings after the AMI and ICSI meetings they are.

QMSum's jsonl files carry no meeting names, but its Product meetings ARE the 137 AMI meetings and its
Academic meetings ARE the 59 ICSI meetings (with a different split). The leakage guard needs one name per
meeting across datasets, so each QMSum meeting is matched to the HMNet transcript sharing the most word
5-grams (Jaccard similarity). The two tokenisations differ slightly, so the true match scores 0.17-0.35
while the runner-up stays below 0.005 on the shared data: a threshold far from both is safe, and a match
must also be one-to-one, otherwise the data are not what we think and we stop.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pipeline.common.schema import DataError

SHINGLE_WORDS = 5
_WORD = re.compile(r"[a-z0-9]+")


def shingles(contents: Iterable[str], n: int = SHINGLE_WORDS) -> set[str]:
    """Lower-cased alphanumeric word n-grams of a transcript (speaker names left out: they differ)."""
    words = _WORD.findall(" ".join(contents).lower())
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


@dataclass
class LinkResult:
    links: dict[str, str] = field(default_factory=dict)  # qmsum meeting id -> corpus meeting id
    scores: dict[str, float] = field(default_factory=dict)  # qmsum meeting id -> Jaccard of the match
    runner_up: float = 0.0  # highest second-best score seen (how close a wrong match came)
    unmatched: list[str] = field(default_factory=list)


def link_meetings(
    queries: Mapping[str, Iterable[str]], corpus: Mapping[str, Iterable[str]], min_jaccard: float
) -> LinkResult:
    """Match each meeting in ``queries`` (id -> turn contents) to one in ``corpus`` (id -> turn contents)."""
    corpus_sets = {cid: shingles(c) for cid, c in corpus.items()}
    index: dict[str, list[str]] = defaultdict(list)  # shingle -> corpus meetings containing it
    for cid, sh in corpus_sets.items():
        for s in sh:
            index[s].append(cid)
    result = LinkResult()
    owner: dict[str, str] = {}
    for qid, contents in queries.items():
        q = shingles(contents)
        shared = Counter(cid for s in q for cid in index.get(s, ()))
        ranked = sorted(
            ((inter / (len(q) + len(corpus_sets[cid]) - inter), cid) for cid, inter in shared.items()), reverse=True
        )
        if len(ranked) > 1:
            result.runner_up = max(result.runner_up, ranked[1][0])
        if not ranked or ranked[0][0] < min_jaccard:
            result.unmatched.append(qid)
            continue
        score, cid = ranked[0]
        if cid in owner:
            raise DataError(f"meetings {owner[cid]} and {qid} both match {cid} (Jaccard {score:.3f}); "
                            "the QMSum and HMNet transcripts do not correspond one-to-one")
        owner[cid] = qid
        result.links[qid] = cid
        result.scores[qid] = round(score, 4)
    return result
