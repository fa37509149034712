"""The registry of the study figures the report draws: one :class:`StudyFigure` entry per study (its title, the
rows its bars show, its panels, the paper's values beside ours, rows another study's runs stand in for). Every study
gets its table without an entry here; adding a study's figure is one entry in :data:`STUDY_FIGURES`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from pipeline.results import published
from pipeline.results.figures import bar_figure

# (client, configuration label) -> the paper's average ROUGE
PaperValues = dict[tuple[str, str], float]


def main_rows_of(agg: pd.DataFrame, methods: set[str]) -> pd.DataFrame:
    """The main study's (3-client, every round) rows of ``methods``."""
    return agg[(agg["study"] == "main") & agg["method"].isin(methods)].copy()


def with_main_baselines(*methods: str) -> Callable[[pd.DataFrame, pd.DataFrame], pd.DataFrame]:
    """Bars: the study's rows plus the main study's runs of ``methods`` the study itself did not run."""
    def bars(rows: pd.DataFrame, agg: pd.DataFrame) -> pd.DataFrame:
        base = main_rows_of(agg, {m for m in methods if m not in set(rows["method"])})
        return pd.concat([rows, base], ignore_index=True)

    return bars


def extreme_bars(rows: pd.DataFrame, agg: pd.DataFrame) -> pd.DataFrame:
    """Panels with and without SAMSum as a 4th client."""
    has_samsum = {lab for lab in rows["label"] if "SAMSum" in set(rows[rows["label"] == lab]["client"])}
    rows["setting"] = ["with SAMSum" if lab in has_samsum else "without SAMSum" for lab in rows["label"]]
    if (rows["setting"] == "without SAMSum").sum() == 0:
        # The 3-client runs of the same methods in the main study are the "without" setting.
        base = main_rows_of(agg, set(rows["method"])).assign(setting="without SAMSum (main study)")
        rows = pd.concat([rows, base], ignore_index=True)
    return rows


def sampling_bars(rows: pd.DataFrame, agg: pd.DataFrame) -> pd.DataFrame:
    """Panels: the main study's runs of the same methods (every client every round) beside the sampled ones."""
    base = main_rows_of(agg, set(rows["method"])).assign(setting="all clients every round (main study)")
    return pd.concat([base, rows.assign(setting="2 of 3 clients per round")], ignore_index=True)


def server_paper(bars: pd.DataFrame) -> PaperValues:
    paper = {(c, m): v for m, by_c in published.SERVER_AVG_ROUGE.items() for c, v in by_c.items()}
    return {(c, lab): paper[(c, m)] for lab, m in zip(bars["label"], bars["method"])
            for c in published.QMSUM_CLIENTS if (c, m) in paper}


def new_client_paper(bars: pd.DataFrame) -> PaperValues:
    key_of = {"post_addition": "post_addition", "pre_addition": "pre_addition", "fedselectkd": "three_clients"}
    return {(c, lab): published.NEW_CLIENT_AVG_ROUGE[key_of[m]][c] for lab, m in zip(bars["label"], bars["method"])
            if m in key_of for c in published.NEW_CLIENT_AVG_ROUGE[key_of[m]]}


def pre_addition_stand_in(agg: pd.DataFrame) -> pd.DataFrame:
    """Pre-addition (SAMSum a client from round 1) is the same computation as the extreme study's SelectKD run,
    so a profile may run it once, there: when study `new_client` has no pre_addition rows, the extreme study's
    fedselectkd rows stand in, labelled as such."""
    new_client = agg[agg["study"] == "new_client"]
    if new_client.empty or "pre_addition" in set(new_client["method"]):
        return agg
    pre = agg[(agg["study"] == "extreme") & (agg["method"] == "fedselectkd")]
    pre = pre.assign(study="new_client", method="pre_addition",
                     label="pre_addition (= " + pre["label"].astype(str) + " of study extreme)")
    return pd.concat([agg, pre], ignore_index=True)


@dataclass(frozen=True)
class StudyFigure:
    """One study's bar chart: ``reports/figures/<study>.png``, its data in ``reports/plots/<study>.csv``."""

    study: str  # its METHOD.md section and description: pipeline.results.studies
    title: str
    # (study rows, all rows) -> the bars drawn (None: the study's own rows)
    bars: Callable[[pd.DataFrame, pd.DataFrame], pd.DataFrame] | None = None
    facet_col: str | None = None  # one panel per value of this column of the bars
    paper: Callable[[pd.DataFrame], PaperValues] | None = None  # the bars -> the paper's values beside them
    stand_in: Callable[[pd.DataFrame], pd.DataFrame] | None = None  # all rows -> with rows other runs stand in for


# In the order the figures are listed in reports/README.md. The tau sweep's figure (ROUGE and KD usage against
# tau, with the main study's tau) is the analyze stage's reports/analysis/figures/tau_sweep.png; its table is
# tables/study_tau_sweep.md.
STUDY_FIGURES: tuple[StudyFigure, ...] = (
    StudyFigure("iid", "IID and balanced (each client a third of every domain)"),
    StudyFigure("noniid", "Non-IID and balanced (200/40/40 per domain)"),
    StudyFigure("extreme", "Extreme non-IID and unbalanced (SAMSum as a 4th client)", extreme_bars,
                facet_col="setting"),
    StudyFigure("sampling", "Client sampling (2 of 3 clients per round)", sampling_bars, facet_col="setting"),
    StudyFigure("server", "Server algorithms (paper: BART-large)", with_main_baselines("fedavg", "fedselectkd"),
                paper=server_paper),
    StudyFigure("new_client", "New client (SAMSum joins) (paper: BART-large)", with_main_baselines("fedselectkd"),
                paper=new_client_paper, stand_in=pre_addition_stand_in),
)


def with_stand_ins(agg: pd.DataFrame) -> pd.DataFrame:
    """The aggregated rows with every registered study's stand-in rows added."""
    for entry in STUDY_FIGURES:
        if entry.stand_in is not None:
            agg = entry.stand_in(agg)
    return agg


def study_figures(agg: pd.DataFrame, figures: Path, plots: Path) -> tuple[list[str], dict[str, str]]:
    """Draw every registered study's figure; returns the figures made and, per study without rows, why not."""
    made: list[str] = []
    not_made: dict[str, str] = {}
    for entry in STUDY_FIGURES:
        rows = agg[agg["study"] == entry.study].copy()
        if rows.empty:
            not_made[f"figure {entry.study}"] = f"no evaluated experiment of study `{entry.study}`"
            continue
        bars = entry.bars(rows, agg) if entry.bars is not None else rows
        made.append(bar_figure(bars, entry.title, figures / f"{entry.study}.png", plots / f"{entry.study}.csv",
                               facet_col=entry.facet_col,
                               paper=entry.paper(bars) if entry.paper is not None else None)["figure"])
    return made, not_made
