"""Reading what earlier stages wrote, for the analyze and report stages. Every bad or missing input is a
:class:`DataError` whose message names the file and the problem in one line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from pipeline.common.schema import DataError
from pipeline.experiments import Experiment
from pipeline.results.scoring import TABLE_ROUGE_L, average_rouge

# The scores every evaluation carries per client, in the paper's order; average ROUGE is recomputed from the three,
# so records written under an earlier R-L choice read the same way.
METRICS: tuple[str, ...] = ("rouge1", "rouge2", TABLE_ROUGE_L, "avg_rouge")
# What tells one configuration from another in the scores tables.
GROUP_COLS = ("study", "label", "method", "scheme", "tau", "variant", "dp")
GATE_COLUMNS = ["client", "round", "example_id", "position", "token_id", "entropy", "kd_applied"]


def load_json(path: Path, what: str = "JSON file") -> Any:
    """The parsed content of ``path``; a missing file or invalid JSON is a one-line DataError."""
    if not path.is_file():
        raise DataError(f"{path}: {what} not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from err


def read_predictions(path: Path, keys: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """The ``keys`` of each record of the evaluate stage's predictions.jsonl, one tuple per line."""
    rows = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                rec = json.loads(line)
                rows.append(tuple(rec[k] for k in keys))
            except (json.JSONDecodeError, KeyError) as err:
                raise DataError(f"{path}:{line_no}: not a prediction record ({err!r})") from err
    return rows


def read_json(path: Path, what: str = "JSON file") -> dict[str, Any]:
    """A JSON object written by an earlier stage (``what`` names it in the error)."""
    data = load_json(path, what)
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object ({what})")
    return data


def read_eval_metrics(path: Path) -> dict[str, Any]:
    """The evaluate stage's metrics.json, every client with the tables' metrics."""
    data = read_json(path, "evaluation metrics")
    if not isinstance(data.get("clients"), dict):
        raise DataError(f"{path}: no 'clients' mapping of ROUGE scores")
    for client, scores in data["clients"].items():
        missing = [m for m in METRICS if m not in scores]
        if missing:
            raise DataError(f"{path}: client {client!r} lacks {missing}")
    return data


def eval_scores(path: Path) -> dict[str, dict[str, float]]:
    """Per client ROUGE (the tables' metrics) from the evaluate stage's metrics.json."""
    clients = read_eval_metrics(path)["clients"]
    if not clients:
        raise DataError(f"{path}: no client has ROUGE scores")
    return {str(c): {m: float(s[m]) for m in METRICS} for c, s in clients.items()}


def collect_scores(planned: Iterable[Experiment], labels: dict[str, str],
                   eval_dir: Path) -> tuple[pd.DataFrame, list[str]]:
    """One row per (evaluated experiment, client), and the planned experiments without an evaluation."""
    rows, missing = [], []
    for p in planned:
        path = eval_dir / p.name / "metrics.json"
        if not path.is_file():
            missing.append(p.name)
            continue
        metrics = read_eval_metrics(path)
        for client, scores in metrics["clients"].items():
            three = {m: float(scores[m]) for m in METRICS}
            rows.append({"experiment": p.name, "study": p.study, "label": labels[p.name], "method": p.method,
                         "scheme": p.scheme, "tau": p.tau, "variant": p.variant, "dp": getattr(p, "dp", ""),
                         "seed": p.seed, "backbone": metrics.get("backbone") or "unknown", "client": client,
                         **three, "avg_rouge": average_rouge(three), "n_examples": int(scores.get("n", 0))})
    columns = ["experiment", *GROUP_COLS, "seed", "backbone", "client", *METRICS, "n_examples"]
    return pd.DataFrame(rows, columns=columns), missing


def read_rounds(path: Path) -> pd.DataFrame:
    """Training rounds as long rows (round, client, train_loss, val_loss, ...) from ``reports/train/<exp>/rounds.json``
    (``<client>/<quantity>`` columns)."""
    rows = load_json(path, "training rounds")
    if not isinstance(rows, list) or any(not isinstance(r, dict) or "round" not in r for r in rows):
        raise DataError(f"{path}: expected a list of per-round rows, each with 'round'")
    long: dict[tuple[int, str], dict[str, Any]] = {}
    for r in rows:
        for key, value in r.items():
            if "/" in key:
                client, quantity = key.split("/", 1)
                long.setdefault((r["round"], client), {"round": r["round"], "client": client})[quantity] = value
    return pd.DataFrame(list(long.values()))


def best_rounds(path: Path) -> dict[str, int]:
    """Per client best round from the train stage's metrics.json (``clients.<client>.best_round``)."""
    clients = read_json(path, "train metrics").get("clients")
    if not isinstance(clients, dict) or not clients:
        raise DataError(f"{path}: no 'clients' mapping with per-client best rounds")
    bad = [c for c, rec in clients.items() if not isinstance(rec, dict) or rec.get("best_round") is None]
    if bad:
        raise DataError(f"{path}: client {bad[0]!r} has no 'best_round'")
    return {str(c): int(rec["best_round"]) for c, rec in clients.items()}


def read_gate_log(path: Path) -> pd.DataFrame:
    gate = pd.read_parquet(path)
    missing = sorted(set(GATE_COLUMNS) - set(gate.columns))
    if missing:
        raise DataError(f"{path}: gate log lacks column(s) {missing} (has {list(gate.columns)})")
    return gate[GATE_COLUMNS].astype({"example_id": str, "client": str, "kd_applied": bool})

