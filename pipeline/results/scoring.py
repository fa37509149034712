"""ROUGE scoring shared by the `evaluate` stage and the `python -m pipeline.evaluate score` CLI (METHOD.md section 8).

Google's ``rouge-score`` with Porter stemming on one sentence per line, the closest Python equivalent of the QMSum
authors' ROUGE-1.5.5. Per-example F1 scores are averaged by us: the library's ``BootstrapAggregator`` resamples at
random."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from pipeline.common.schema import DataError

ROUGE_TYPES: tuple[str, ...] = ("rouge1", "rouge2", "rougeL", "rougeLsum")
# Which rouge-score variant the tables, figures and "average ROUGE" call ROUGE-L: plain rougeL, whose R-L / R-1 ratios
# match the paper's, rougeLsum's do not (docs/statistics.md, R-L; tests/test_scoring.py checks both).
TABLE_ROUGE_L = "rougeL"
# The paper's three reported metrics, in table order; "average ROUGE" (journal version) is their mean.
TABLE_METRICS: tuple[str, ...] = ("rouge1", "rouge2", TABLE_ROUGE_L)
# Every score an evaluation records per example and per client (per_example.parquet, metrics.json, MLflow).
SCORE_KEYS: tuple[str, ...] = (*ROUGE_TYPES, "avg_rouge")

# A sentence ends at . ! or ? (optionally followed by closing quotes/brackets) before whitespace; existing
# line breaks are sentence breaks too (e.g. AMI/ICSI summaries stored one sentence per line).
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\s*\n+\s*")
# Tokens like "Dr." or "e.g." end in a period without ending the sentence.
_ABBREVIATIONS = frozenset("mr mrs ms dr prof st vs etc e.g i.e cf approx no fig inc ltd jr sr mt".split())


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: a break after . ! ? + whitespace and at newlines, but not after a known abbreviation
    ("Dr.", "e.g.") or a single initial ("J."). Empty pieces are dropped."""
    sentences: list[str] = []
    pending, pos = "", 0  # pending: the text since the last break, held over an abbreviation
    for match in _SENTENCE_END.finditer(text):
        candidate = (pending + " " + text[pos : match.start()]).strip()
        pos = match.end()
        last_word = candidate.rsplit(None, 1)[-1] if candidate else ""
        stem = last_word.rstrip(".").lower()
        is_abbreviation = last_word.endswith(".") and (stem in _ABBREVIATIONS or (len(stem) == 1 and stem.isalpha()))
        if is_abbreviation and "\n" not in match.group(0):  # a line break ends a sentence even after one
            pending = candidate
        else:
            sentences.append(candidate)
            pending = ""
    sentences.append((pending + " " + text[pos:]).strip())
    return [s for s in sentences if s]


class Scorer:
    """rouge-score with Porter stemming on sentence-split text; F1 x 100 per example."""

    def __init__(self, use_stemmer: bool = True) -> None:
        from rouge_score import rouge_scorer  # imports nltk (~1 s): only where scores are computed

        self._scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=use_stemmer)

    def detail(self, prediction: str, reference: str) -> dict:
        """rouge-score's ``Score`` (precision, recall, fmeasure in [0, 1]) of every variant for one pair, each text as
        ROUGE-1.5.5 saw it: one sentence per line (the input of ``rougeLsum``)."""
        return self._scorer.score("\n".join(split_sentences(reference)), "\n".join(split_sentences(prediction)))

    def score(self, prediction: str, reference: str) -> dict[str, float]:
        """F1 x 100 of every variant in :data:`ROUGE_TYPES` for one pair."""
        return {name: 100.0 * d.fmeasure for name, d in self.detail(prediction, reference).items()}

    def score_pairs(self, predictions: Sequence[str], references: Sequence[str]) -> list[dict[str, float]]:
        """Per-example F1 x 100; ``predictions[i]`` is scored against ``references[i]``."""
        if len(predictions) != len(references):
            raise ValueError(f"{len(predictions)} predictions but {len(references)} references: they must pair up")
        return [self.score(p, r) for p, r in zip(predictions, references)]


def average_rouge(scores: dict[str, float]) -> float:
    """The journal version's "average ROUGE": mean of R-1, R-2 and R-L (R-L = :data:`TABLE_ROUGE_L`)."""
    return sum(scores[m] for m in TABLE_METRICS) / len(TABLE_METRICS)


def mean_scores(per_example: Iterable[dict[str, float]]) -> dict[str, float]:
    """Mean over examples of each variant (+ ``avg_rouge`` and the count ``n``); the corpus score we report."""
    rows = list(per_example)
    if not rows:
        return {**dict.fromkeys(SCORE_KEYS, math.nan), "n": 0}
    means = {name: sum(r[name] for r in rows) / len(rows) for name in ROUGE_TYPES}
    return means | {"avg_rouge": average_rouge(means), "n": len(rows)}


def client_scores(predictions: list[str], sub, n_test: int) -> tuple[list[dict[str, float]], dict[str, float]]:
    """ROUGE per example of a client's ``predictions`` on its test subsample ``sub`` (of ``n_test`` ids) and its entry
    of metrics.json (means, ``n_test``, how many subsampling left out), for the evaluate stage and a deployed client."""
    scores = Scorer().score_pairs(predictions, sub["target"].tolist())
    return scores, mean_scores(scores) | {"n_test": n_test, "skipped_by_subsampling": n_test - len(sub)}


def rouge_summary(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean F1 x 100 of each variant (+ avg_rouge, n) over line-aligned predictions and references."""
    return mean_scores(Scorer().score_pairs(predictions, references))


def read_lines(path: str | Path) -> list[str]:
    """One summary per line (trailing newline optional; a final empty line is not a summary)."""
    if not Path(path).is_file():
        raise DataError(f"{path}: file not found")
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as err:  # a file another tool wrote in Latin-1, say
        raise DataError(f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start})") from err
    return [line.rstrip("\r") for line in (lines[:-1] if lines[-1] == "" else lines)]


def score_files(pred_path: str | Path, ref_path: str | Path, use_stemmer: bool = True) -> dict[str, float]:
    """Mean ROUGE of two line-aligned files; the CLI behind ``python -m pipeline.evaluate score``."""
    predictions, references = read_lines(pred_path), read_lines(ref_path)
    if len(predictions) != len(references):
        raise DataError(
            f"line counts differ: {pred_path} has {len(predictions)} predictions, "
            f"{ref_path} has {len(references)} references (one summary per line in both)"
        )
    return mean_scores(Scorer(use_stemmer).score_pairs(predictions, references)) | {"rouge_l_in_tables": TABLE_ROUGE_L}
