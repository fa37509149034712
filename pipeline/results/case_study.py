"""Generated summaries side by side: the evaluate stage's predictions per method, the examples' queries and
meetings, and the case study (one test example per domain, FedAvg's and SelectKD's summary beside the gold one)."""
from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import fields
from pathlib import Path
from typing import Iterable

import pandas as pd

from pipeline.results import published
from pipeline.results.human_eval import Prediction
from pipeline.results.readers import read_predictions
from pipeline.experiments import Experiment
from pipeline.results.scoring import TABLE_ROUGE_L, Scorer


def predictions_by_method(planned: Iterable[Experiment], eval_dir: Path, study: str = "main",
                          seed: int | None = None) -> tuple[dict[str, dict[str, Prediction]], int | None]:
    """method -> example_id -> Prediction for one study and seed (default: the lowest seed with predictions)."""
    avail = [p for p in planned if p.study == study and (eval_dir / p.name / "predictions.jsonl").is_file()]
    if not avail:
        return {}, None
    chosen_seed = min(p.seed for p in avail) if seed is None else seed
    out: dict[str, dict[str, Prediction]] = {}
    for p in sorted(avail, key=lambda p: p.name):
        if p.seed == chosen_seed and p.method not in out:
            rows = read_predictions(eval_dir / p.name / "predictions.jsonl", tuple(f.name for f in fields(Prediction)))
            out[p.method] = {pred.example_id: pred for pred in (Prediction(*r) for r in rows)}
    return out, chosen_seed


def example_info(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """example_id -> query, example_id -> meeting_id (empty when the examples file is absent)."""
    if not path.is_file():
        return {}, {}
    df = pd.read_parquet(path, columns=["example_id", "query", "meeting_id"])
    return dict(zip(df["example_id"], df["query"].fillna(""))), dict(zip(df["example_id"], df["meeting_id"]))


def case_study(preds: dict[str, dict[str, Prediction]], queries: dict[str, str], seed: int,
               methods: tuple[str, str] = ("fedavg", "fedselectkd")) -> str | None:
    """One test example per domain: FedAvg's and SelectKD's summary and the gold one (seeded choice)."""
    if not all(m in preds for m in methods):
        return None
    scorer = Scorer()
    common = sorted(set(preds[methods[0]]) & set(preds[methods[1]]))
    by_domain: dict[str, list[str]] = defaultdict(list)
    for ex in common:
        by_domain[preds[methods[0]][ex].domain].append(ex)
    rng = random.Random(f"case_study:{seed}")
    lines = ["# Case study", "",
             "One test example per domain, chosen at random (seeded, `report.case_study_seed`), summarised by each "
             "client's own model; ROUGE F1 x 100 of each summary against the gold one.", ""]
    for domain in sorted(by_domain):
        ex = rng.choice(by_domain[domain])
        gold = preds[methods[0]][ex].reference
        lines += [f"## {domain}", "", f"Example `{ex}`", ""]
        if queries.get(ex):
            lines += [f"**Query:** {queries[ex]}", ""]
        for m in methods:
            p = preds[m][ex]
            s = scorer.score(p.prediction, gold)
            lines += [f"**{published.PAPER_METHOD_NAMES.get(m, m)}** (R-1 {s['rouge1']:.1f}, R-2 {s['rouge2']:.1f}, "
                      f"R-L {s[TABLE_ROUGE_L]:.1f}; `{p.experiment}`): {p.prediction}", ""]
        lines += [f"**Gold:** {gold}", ""]
    return "\n".join(lines)
