"""Reading what earlier stages wrote, for the analyze and report stages. Every bad or missing input is a
:class:`DataError` whose message names the file and the problem in one line."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.common.schema import DataError, read_json, read_parquet
from pipeline.experiments.entries import Experiment
from pipeline.results.scoring import TABLE_METRICS, TABLE_ROUGE_L, average_rouge

# The scores every evaluation carries per client, in the paper's order; average ROUGE is recomputed from the three,
# so records written under an earlier R-L choice read the same way.
METRICS: tuple[str, ...] = ("rouge1", "rouge2", TABLE_ROUGE_L, "avg_rouge")
# What tells one configuration from another in the scores tables.
GROUP_COLS = ("study", "label", "method", "scheme", "tau", "variant", "dp")
GATE_COLUMNS = ["client", "round", "example_id", "position", "token_id", "entropy", "kd_applied"]


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


def read_eval_metrics(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """The evaluate stage's metrics.json, every client with the tables' metrics, and per client those metrics (average
    ROUGE recomputed from the three: the tables and the analysis read a record alike)."""
    data = read_json(path, "evaluation metrics")
    if not isinstance(data.get("clients"), dict):
        raise DataError(f"{path}: no 'clients' mapping of ROUGE scores")
    for client, scores in data["clients"].items():
        if missing := [m for m in METRICS if not isinstance(scores, dict) or m not in scores]:
            raise DataError(f"{path}: client {client!r} lacks {missing}")
        # null, a bool: hand edits; `n` (the scores table's n_examples, 0 where absent) a count
        kinds = {m: ((int, float), "a number") for m in TABLE_METRICS} | {"n": ((int,), "a count")}
        if bad := [(m, what) for m, (ok, what) in kinds.items() if type(scores.get(m, 0)) not in ok]:
            raise DataError(f"{path}: client {client!r} has {bad[0][0]} = {scores[bad[0][0]]!r}, not {bad[0][1]}")
    three = {str(c): {m: float(s[m]) for m in TABLE_METRICS} for c, s in data["clients"].items()}
    return data, {c: t | {"avg_rouge": average_rouge(t)} for c, t in three.items()}


def collect_scores(
    planned: Iterable[Experiment], labels: dict[str, str], eval_dir: Path
) -> tuple[pd.DataFrame, list[str]]:
    """One row per (evaluated experiment, client), and the planned experiments without an evaluation."""
    rows, missing = [], []
    for p in planned:
        path = eval_dir / p.name / "metrics.json"
        if not path.is_file():
            missing.append(p.name)
            continue
        metrics, scores = read_eval_metrics(path)
        config = [labels[p.name] if c == "label" else getattr(p, c, "") for c in GROUP_COLS]
        for client, table in scores.items():
            run = (p.name, *config, p.seed, metrics.get("backbone") or "unknown", client)
            rows.append((*run, *table.values(), int(metrics["clients"][client].get("n", 0))))
    columns = ["experiment", *GROUP_COLS, "seed", "backbone", "client", *METRICS, "n_examples"]
    return pd.DataFrame(rows, columns=columns), missing


def read_rounds(path: Path) -> pd.DataFrame:
    """Training rounds as long rows (round, client, train_loss, val_loss, ...) from ``reports/train/<exp>/rounds.json``
    (``<client>/<quantity>`` columns), or from ``models/<exp>/rounds.json`` (the history's own long rows)."""
    rows = read_json(path, "training rounds", list)
    if bad := [i for i, r in enumerate(rows) if not isinstance(r, dict) or type(r.get("round")) is not int]:
        raise DataError(f"{path}: row {bad[0]} is not a per-round row with an integer 'round'")  # a null: NaN
    if rows and all("client" in r for r in rows):
        return pd.DataFrame(rows)
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
    if bad := [c for c, rec in clients.items() if not isinstance(rec, dict) or type(rec.get("best_round")) is not int]:
        raise DataError(f"{path}: client {bad[0]!r} has no integer 'best_round'")  # a JSON true is no round 1
    return {str(c): rec["best_round"] for c, rec in clients.items()}


def read_gate_log(path: Path) -> pd.DataFrame:
    gate = read_parquet(path, "gate log")
    if missing := sorted(set(GATE_COLUMNS) - set(gate.columns)):
        raise DataError(f"{path}: gate log lacks column(s) {missing} (has {list(gate.columns)})")
    return gate[GATE_COLUMNS].astype({"example_id": str, "client": str, "kd_applied": bool})


# Did a run's clients converge within their round budget (docs/statistics.md, "Round budget"), from ``reports/train/
# <exp>/``: each client-run's best round (metrics.json's ``best_round``) and last round (``rounds.json``, else
# ``stopped_round``), its ``converged``.
CONVERGENCE_COLUMNS = ["experiment", "client", "best_round", "last_round", "best_is_last", "converged"]
MARK = "↗"  # the tables' mark of a row with a client-run still improving at its last round


def run_convergence(train_dir: Path, experiment: str) -> pd.DataFrame:
    """Per client of ``experiment``: best and last round, whether they are the same, the run's stated verdict. The
    best round is the one the client kept (its adapter_best, which is evaluated): the train record's ``best_round``,
    which a lost evaluation reply leaves out of rounds.json's losses; a client without it (a record of rounds alone)
    has the round of its lowest val_loss, the earliest on a tie; the last round: its last with a val_loss."""
    metrics_path, rounds_path = (train_dir / experiment / f for f in ("metrics.json", "rounds.json"))
    metrics = read_json(metrics_path, "train metrics") if metrics_path.is_file() else {}
    clients = metrics.get("clients") or {}
    kept = {str(c): v["best_round"] for c, v in clients.items() if isinstance(v, dict) and v.get("best_round")}
    stated = metrics.get("converged")  # the stop rule's verdict (train.stop), when the run had one
    wrong = [(metrics_path, f"client {c!r}: best_round", b, "a round") for c, b in kept.items() if type(b) is not int]
    wrong += [(metrics_path, "converged", stated, "true, false or null")] * (type(stated) not in (bool, type(None)))
    if rounds_path.is_file():  # a client's rows with a val_loss, lowest first (a record without val_loss: none)
        rounds = read_rounds(rounds_path).reindex(columns=["round", "client", "val_loss"]).dropna(subset=["val_loss"])
        text = rounds[~rounds["val_loss"].map(type).isin([int, float])].itertuples()  # "5.2", true: no loss
        wrong += [
            (rounds_path, f"round {r.round}, client {r.client!r}: val_loss", r.val_loss, "a number") for r in text
        ]
    if wrong:  # a JSON true is no round 1 (best_rounds), a "false" no verdict
        raise DataError("{}: {} = {!r}, not {}".format(*wrong[0]))
    if rounds_path.is_file():
        known = rounds.sort_values(["val_loss", "round"]).groupby("client", sort=True)
        found = {str(c): (int(kept.get(str(c)) or g["round"].iloc[0]), int(g["round"].max())) for c, g in known}
    else:
        found = {c: (int(b), int(metrics.get("stopped_round") or metrics.get("rounds") or b)) for c, b in kept.items()}
    rows = [(experiment, c, best, last, best == last, stated) for c, (best, last) in sorted(found.items())]
    return pd.DataFrame(rows, columns=CONVERGENCE_COLUMNS)


def convergence_table(planned: Iterable[Any], labels: dict[str, str], train_dir: Path) -> pd.DataFrame:
    """Every planned experiment's client-runs (objects with name, study, seed), with study and label."""
    frames = [
        f.assign(study=p.study, label=labels[p.name], seed=int(p.seed))
        for p in planned
        if not (f := run_convergence(train_dir, p.name)).empty
    ]
    if not frames:
        return pd.DataFrame(columns=[*CONVERGENCE_COLUMNS, "study", "label", "seed"])
    return pd.concat(frames, ignore_index=True)


def run_verdicts(table: pd.DataFrame) -> pd.Series:
    """Per experiment: converged, as its record states (train.stop), else no client's best round is its last."""
    runs = table.groupby("experiment")
    stated = runs["converged"].first()  # the first non-null: None for a fixed round budget
    return stated.where(stated.notna(), ~runs["best_is_last"].any()).astype(bool)


def run_converged(train_dir: Path, experiment: str) -> bool | None:
    """The run's MLflow tag ``converged`` (:func:`run_verdicts`; None: no train record)."""
    f = run_convergence(train_dir, experiment)
    return None if f.empty else bool(run_verdicts(f).iloc[0])


def row_mark(table: pd.DataFrame | None, study: str, label: str, client: str | None) -> str:
    """'↗ 2/3': how many client-runs of (study, label), or of one ``client``, had their best round last ('' if none)."""
    if table is None or table.empty:
        return ""
    sub = table[(table["study"] == study) & (table["label"] == label)]
    sub = sub[sub["client"] == client] if client is not None else sub
    flagged = int(sub["best_is_last"].fillna(False).astype(bool).sum())
    return f"{MARK} {flagged}/{len(sub)}" if flagged else ""


def convergence_note(table: pd.DataFrame | None, studies: Iterable[str], labels: Iterable[str] | None = None) -> str:
    """The tables' note: how many runs of the stop rule did not meet it by their round ceiling, and how many
    client-runs had their best validation round in their last round ('' if none of either)."""
    if table is None or table.empty:
        return ""
    sub = table[table["study"].isin(list(studies))]
    sub = sub[sub["label"].isin(list(labels))] if labels is not None else sub
    flagged, stop = sub[sub["best_is_last"].astype(bool)], sub.dropna(subset=["converged"])
    unmet = stop[~stop["converged"].astype(bool)].groupby("experiment")["last_round"].max()  # at their ceilings
    if flagged.empty and unmet.empty:
        return ""
    lasts = sorted({int(r) for r in flagged["last_round"]})
    best = f"{len(flagged)} of {len(sub)} client-runs had their best validation round in their last round"
    best += f" ({', '.join(map(str, lasts))})" if lasts else ""
    if stop.empty:  # a fixed round budget: a client-run whose best round is its last was still improving
        return f"{MARK} {best}: they were still improving when training stopped, so these numbers hold for this round budget only."
    ceilings, runs = ", ".join(map(str, sorted(set(unmet)))), stop["experiment"].nunique()
    budget = f" ({ceilings}), so these numbers hold for this round budget only" if ceilings else ""
    return f"{MARK} {len(unmet)} of {runs} runs did not meet the stop rule by their round ceiling{budget}; {best}."


def centralized_step_ratios(
    planned: Iterable[Any], train_dir: Path, trains: dict[str, dict[str, Any]]
) -> tuple[tuple[str, float], ...]:
    """Per client, AdaCentralized's optimizer steps a round over the client's own, when AdaCentralized makes one
    pass over the pooled data a round (train.centralized_steps: epoch): ceil(ceil(n / batch) / accumulation) steps
    for n training examples (each run's batch_size and grad_accum_steps: ``trains``, its plan's `train` by name),
    from the train records of the main study's lowest seed that has both an AdaCentralized and an AdaSingle record
    (() when none has)."""
    steps: dict[tuple[int, str], dict[str, int]] = {}  # (seed, method): each client's optimizer steps a round
    for p in planned:
        path = train_dir / p.name / "metrics.json"
        if p.study == "main" and p.method in ("centralized", "single") and path.is_file():
            t, clients = trains[p.name], read_json(path, "train metrics").get("clients") or {}
            if bad := [c for c, rec in clients.items() if type(rec.get("n_train_examples", 0)) is not int]:
                raise DataError(f"{path}: client {bad[0]!r} has no integer 'n_train_examples'")  # a JSON true is no 1
            steps[(int(p.seed), p.method)] = {
                c: math.ceil(math.ceil(rec["n_train_examples"] / t["batch_size"]) / t["grad_accum_steps"])
                for c, rec in clients.items()
                if rec.get("n_train_examples")
            }
    seeds = sorted(s for s, m in steps if m == "centralized" and (s, "single") in steps)
    if not seeds:
        return ()
    central, local = steps[(seeds[0], "centralized")], steps[(seeds[0], "single")]
    return tuple((client, central[client] / local[client]) for client in sorted(central.keys() & local.keys()))
