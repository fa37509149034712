"""Did a run's clients converge within their round budget (docs/statistics.md, "Round budget"), from
``reports/train/<exp>/``: a ``converged`` stated in ``metrics.json``; else ``rounds.json``; else ``best_round``."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from pipeline.results.readers import load_json, read_rounds

COLUMNS = ["experiment", "client", "best_round", "last_round", "best_is_last"]
MARK = "↗"  # the tables' mark of a row with a client-run still improving at its last round


def best_and_last_rounds(path: Path) -> dict[str, tuple[int, int]]:
    """{client: (round of its lowest val_loss, the earliest on a tie; its last round with one)} from rounds.json."""
    rounds = read_rounds(path)
    if "val_loss" not in rounds:
        return {}
    known = rounds.dropna(subset=["val_loss"]).sort_values(["val_loss", "round"])
    return {str(c): (int(g["round"].iloc[0]), int(g["round"].max())) for c, g in known.groupby("client", sort=True)}


def run_convergence(train_dir: Path, experiment: str) -> pd.DataFrame:
    """Per client of ``experiment``: best and last round, whether they are the same (None: stated without rounds)."""
    run = train_dir / experiment
    metrics_path, rounds_path = run / "metrics.json", run / "rounds.json"
    metrics = load_json(metrics_path) if metrics_path.is_file() else {}
    clients = metrics.get("clients") or {}
    found = best_and_last_rounds(rounds_path) if rounds_path.is_file() else {
        c: (int(v["best_round"]), int(v.get("rounds_trained") or metrics.get("rounds") or v["best_round"]))
        for c, v in clients.items() if isinstance(v, dict) and v.get("best_round")}
    rows = []
    for client in sorted(set(found) | {c for c, v in clients.items() if isinstance(v, dict) and "converged" in v}):
        best, last = found.get(client, (None, None))
        stated = (clients.get(client) or {}).get("converged", metrics.get("converged"))
        flagged = (not bool(stated)) if stated is not None else (None if best is None else best == last)
        rows.append({"experiment": experiment, "client": client, "best_round": best, "last_round": last,
                     "best_is_last": flagged})
    return pd.DataFrame(rows, columns=COLUMNS)


def convergence_table(planned: Iterable[Any], labels: dict[str, str], train_dir: Path) -> pd.DataFrame:
    """Every planned experiment's client-runs (objects with name, study, seed), with study and label."""
    frames = []
    for p in planned:
        f = run_convergence(train_dir, p.name)
        if not f.empty:
            frames.append(f.assign(study=p.study, label=labels[p.name], seed=int(p.seed)))
    if not frames:
        return pd.DataFrame(columns=[*COLUMNS, "study", "label", "seed"])
    return pd.concat(frames, ignore_index=True)


def run_converged(train_dir: Path, experiment: str) -> bool | None:
    """The run's MLflow tag ``converged``: no client's best round is its last (None: no train record)."""
    f = run_convergence(train_dir, experiment)
    flags = f["best_is_last"].dropna()
    return None if flags.empty else not bool(flags.any())


def row_mark(table: pd.DataFrame | None, study: str, label: str, client: str | None) -> str:
    """'↗ 2/3': how many client-runs of (study, label), or of one ``client``, had their best round last ('' if none)."""
    if table is None or table.empty:
        return ""
    sub = table[(table["study"] == study) & (table["label"] == label)]
    sub = sub[sub["client"] == client] if client is not None else sub
    flagged = int(sub["best_is_last"].fillna(False).astype(bool).sum())
    return f"{MARK} {flagged}/{len(sub)}" if flagged else ""


def note(table: pd.DataFrame | None, studies: Iterable[str], labels: Iterable[str] | None = None) -> str:
    """The tables' note: how many client-runs had their best validation round in their last round ('' if none)."""
    if table is None or table.empty:
        return ""
    sub = table[table["study"].isin(list(studies))]
    if labels is not None:
        sub = sub[sub["label"].isin(list(labels))]
    known = sub.dropna(subset=["best_is_last"])
    flagged = known[known["best_is_last"].astype(bool)]
    if flagged.empty:
        return ""
    lasts = sorted({int(r) for r in flagged["last_round"].dropna()})
    at = f" ({', '.join(map(str, lasts))})" if lasts else ""
    return (f"{MARK} {len(flagged)} of {len(known)} client-runs had their best validation round in their last "
            f"round{at}: they were still improving when training stopped, so these numbers hold for this round "
            "budget only.")
