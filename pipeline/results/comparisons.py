"""Which differences between methods are real (docs/statistics.md): paired comparisons of every configuration
with its baselines on the same partition and test examples, and of every private configuration with the same method
without privacy, from each experiment's ``reports/eval/<exp>/per_example.parquet`` and ``predictions.jsonl``, with
Holm-adjusted p-values over each study's family; then our effects against the paper's. The sentences that state
them: pipeline.results.claims."""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.common.schema import DataError, read_parquet
from pipeline.results import published
from pipeline.results.readers import read_predictions
from pipeline.results.scoring import SCORE_KEYS, TABLE_METRICS
from pipeline.results.stats import BootstrapConfig, holm, meetings, nested_interval

AVERAGE = "client average"
# The paper's methods (Table III) as comparison baselines, in the order that orients each pair (A − B, B earlier):
# federation against local training, selectivity against plain KD, and AdaCentralized against every other method.
MAIN_ORDER: tuple[str, ...] = ("single", "fedavg", "fedkd", "fedselectkd", "centralized")
COLUMNS = (
    "study client method_a method_b config_a config_b study_b metric mean_diff ci_low ci_high p_value p_holm "
    "n_examples n_seeds identical_fraction significant mostly_identical experiments_a experiments_b"
).split()


@dataclass(frozen=True)
class Config:
    """One configuration (a study's row: method and its settings), run once per seed."""

    study: str
    label: str
    method: str
    scheme: str
    runs: tuple[tuple[int, str], ...]  # (seed, experiment name)
    dp: str = ""  # its privacy in words ("" = none: pipeline.experiments.entries.privacy_label)


def configurations(planned: Iterable[Any], labels: dict[str, str]) -> list[Config]:
    """Group planned experiments (name, study, method, scheme, seed, optionally dp) into configurations."""
    groups: dict[tuple[str, str, str, str, str], list[tuple[int, str]]] = defaultdict(list)
    for p in planned:
        groups[(p.study, labels[p.name], p.method, p.scheme, getattr(p, "dp", ""))].append((int(p.seed), p.name))
    return [
        Config(study, label, method, scheme, tuple(sorted(runs)), dp)
        for (study, label, method, scheme, dp), runs in groups.items()
    ]


def _plain(config: Config, configs: list[Config], study: str) -> Config | None:
    """``config``'s method on its partition scheme in ``study`` without privacy (the lowest label; None if none)."""
    same = (c for c in configs if not c.dp and (c.study, c.method, c.scheme) == (study, config.method, config.scheme))
    return min(same, key=lambda c: c.label, default=None)


def baseline_for(config: Config, method: str, configs: list[Config]) -> Config | None:
    """The ``method`` configuration ``config`` is compared with: same partition scheme, preferably the same study,
    else the main study's (a study such as the tau sweep has no baselines of its own)."""
    same = (c for c in configs if c.method == method and c.scheme == config.scheme)
    return min(same, key=lambda c: (bool(c.dp), c.study != config.study, c.study != "main", c.label), default=None)


def per_example(eval_dir: Path, name: str) -> pd.DataFrame | None:
    path = eval_dir / name / "per_example.parquet"
    if not path.is_file():
        return None
    frame = read_parquet(path, "per-example score table")
    if missing := [c for c in ("client", "example_id", *SCORE_KEYS) if c not in frame.columns]:
        raise DataError(f"{path}: missing column(s) {missing}")
    return frame.assign(avg_rouge=frame[list(TABLE_METRICS)].mean(axis=1))


def shared_ids(frame: pd.DataFrame) -> dict[str, list[str]]:
    """Per client, the test examples of ``frame`` (one seed's per-example scores; compare's: those A and B share)."""
    return {c: sorted(set(frame.loc[frame["client"] == c, "example_id"])) for c in sorted(set(frame["client"]))}


def client_rows(frame: pd.DataFrame, client: str, ids: list[str]) -> pd.DataFrame:
    """One client's examples ``ids`` of one seed's ``frame``, in that order."""
    return frame[frame["client"] == client].set_index("example_id").loc[ids]


def _predictions(eval_dir: Path, name: str) -> dict[tuple[str, str], str]:
    """(client, example id) -> the summary generated, from an evaluation's predictions.jsonl ({} without one)."""
    path = eval_dir / name / "predictions.jsonl"
    rows = read_predictions(path, ("client", "example_id", "prediction")) if path.is_file() else []
    return {(str(c), str(e)): str(p) for c, e, p in rows}


def compare(a: Config, b: Config, read: Callable, cfg: BootstrapConfig, notes: list[str]) -> list[tuple]:
    """Rows (:data:`COLUMNS`) for A - B, its runs' files ``read(file, run)``: per client and on the client average, per
    metric; [] and a note when they share no seed or example. Seeds with the same test examples (a fixed test split) are
    crossed, seeds with their own (a partition re-divided per seed) nested, each seed's full test sets
    (:func:`nested_interval`), a client some seeds lack noted, the client average then left out."""
    seeds_a, seeds_b = dict(a.runs), dict(b.runs)
    ids, rows, same = {}, {}, defaultdict(list)  # seed: client: examples; (seed, client): rows; client: same-text flags
    for s in sorted(set(seeds_a) & set(seeds_b)):
        fa, fb = read(per_example, seeds_a[s]), read(per_example, seeds_b[s])
        if fa is None or fb is None:
            continue
        both = fa.merge(fb, on=["client", "example_id"], suffixes=("_a", "_b"))
        frame = both.assign(**{k: both[f"{k}_a"] - both[f"{k}_b"] for k in SCORE_KEYS})  # A - B
        ids[s] = shared_ids(frame)
        pa, pb = read(_predictions, seeds_a[s]), read(_predictions, seeds_b[s])
        for c, cids in ids[s].items():
            rows[s, c] = client_rows(frame, c, cids)  # selected once
            same[c] += [pa[(c, i)] == pb[(c, i)] for i in cids if (c, i) in pa and (c, i) in pb]
    seeds = sorted(ids)
    if not any(ids.values()):
        notes.append(f"{a.study}: {a.label} vs {b.label}: no evaluated seed and test example in common")
        return []
    nested = any(ids[s] != ids[seeds[0]] for s in seeds)
    clients = sorted(set().union(*ids.values()))
    lacking = {c: [s for s in seeds if c not in ids[s]] for c in clients}
    for c in (c for c in clients if lacking[c]):
        notes.append(
            f"{a.study}: {a.label} vs {b.label}: client {c} has no paired test example in seed(s) "
            f"{', '.join(map(str, lacking[c]))}; its rows use the other seeds, and no client average is given"
        )

    out = []
    runs_a, runs_b = (",".join(runs[s] for s in seeds) for runs in (seeds_a, seeds_b))
    for scope, scope_clients in [(c, [c]) for c in clients] + [(AVERAGE, clients)] * (not any(lacking.values())):
        flags = [x for c in scope_clients for x in same[c]]
        identical = float(np.mean(flags)) if flags else math.nan
        mostly_identical = identical > cfg.identical_warning  # NaN (no pair of summaries) is not above it
        had = [s for s in seeds if all(c in ids[s] for c in scope_clients)]
        clusters = [meetings(ids[s][c] for c in scope_clients) for s in had]  # QMSum: a meeting's queries one cluster
        n_examples = len({i for s in had for c in scope_clients for i in ids[s][c]})  # distinct: a redrawn one once
        for metric in SCORE_KEYS:
            d = [[rows[s, c][metric].to_numpy(float) for c in scope_clients] for s in had]
            r = nested_interval(d, cfg, clusters, crossed=not nested)
            # a row in COLUMNS order; p_holm and significant are with_holm's, over the study's family
            pair = (a.study, scope, a.method, b.method, a.label, b.label, b.study, metric)
            interval = (r.estimate, r.low, r.high, r.p_value, math.nan, n_examples, r.n_seeds)
            out.append((*pair, *interval, identical, None, mostly_identical, runs_a, runs_b))
    return out


def comparisons_table(
    configs: list[Config], baselines: list[str], eval_dir: Path, cfg: BootstrapConfig
) -> tuple[pd.DataFrame, list[str]]:
    """Every configuration against each baseline it has (``baselines`` then :data:`MAIN_ORDER`, as
    docs/statistics.md lists them), and a note per comparison that could not be made."""
    rows: list[tuple] = []
    notes: list[str] = []
    read = functools.cache(lambda file, run: file(eval_dir, run))  # each run's files read once per table, not per pair

    baselines = list(dict.fromkeys([*baselines, *MAIN_ORDER]))
    done: set[tuple[Config, Config]] = set()
    for config in configs:
        # A non-private configuration outside the main study varies that study's configuration of its method on its
        # partition (a gate or tau of the tau sweep varies the main SelectKD).
        ranked = config.method in baselines
        varied = _plain(config, configs, "main") if ranked and not config.dp and config.study != "main" else None
        # A baseline is compared only with the baselines listed before it (fedavg vs single, not also the reverse).
        against = baselines[: baselines.index(config.method)] if ranked and not varied else baselines
        for method in against:
            base = varied if method == config.method else baseline_for(config, method, configs)
            if base is None:
                notes.append(
                    f"{config.study}: {config.label} has no {method} run on partition scheme "
                    f"{config.scheme!r} to compare with"
                )
            elif (config, base) not in done and (base, config) not in done:
                done.add((config, base))
                rows.extend(compare(config, base, read, cfg, notes))
        plain = _plain(config, configs, config.study) if config.dp else None  # the same without privacy
        if config.dp and plain is None:
            notes.append(
                f"{config.study}: {config.label} has no run of {config.method} without privacy on "
                f"partition scheme {config.scheme!r} in its study to compare with"
            )
        elif plain is not None:
            rows.extend(compare(config, plain, read, cfg, notes))
    return with_holm(pd.DataFrame(rows, columns=COLUMNS), cfg), notes


# The comparisons one claim is drawn from together: a study's, on one scope (the client average, or one client) and
# metric. Holm's adjustment over each keeps the chance of any false claim in it at most 1 - level.
FAMILY = ["study", "client", "metric"]


def with_holm(table: pd.DataFrame, cfg: BootstrapConfig) -> pd.DataFrame:
    """``table`` with ``p_holm`` (Holm-adjusted ``p_value`` within each :data:`FAMILY`) and ``significant`` =
    ``p_holm`` < 1 - level: the claims' test (the intervals stay the unadjusted ones)."""
    out = table.copy()
    out["p_holm"] = out.groupby(FAMILY, sort=False)["p_value"].transform(lambda p: holm(p.to_numpy(dtype=float)))
    out["significant"] = out["p_holm"].lt(1.0 - cfg.level)
    return out


def format_p(p: float, up: bool = False) -> str:
    """A p-value for tables and text: "< 0.001", else three decimals rounded *down*, so a p just below 0.05 (its
    interval excludes 0) never prints as 0.050; with ``up`` rounded up (a bound the p of each comparison meets)."""
    if p is None or math.isnan(p):
        return "–"
    rounded = math.ceil(p * 1000 - 1e-9) if up else math.floor(p * 1000 + 1e-9)
    return "< 0.001" if p < 0.001 else f"{rounded / 1000:.3f}"


def markdown_section(table: pd.DataFrame, study: str, cfg: BootstrapConfig) -> str:
    """The study's paired comparisons on the client average of avg_rouge, as markdown (empty when it has none)."""
    sub = table[(table["study"] == study) & (table["client"] == AVERAGE) & (table["metric"] == "avg_rouge")]
    if sub.empty:
        return ""
    level = f"{cfg.level:.0%}"
    # The paper's difference for the same pair per backbone (with_published), when present.
    backbones = [c.removeprefix("vs_published_") for c in sub.columns if c.startswith("vs_published_")]
    backbones = [b for b in backbones if (sub[f"vs_published_{b}"].fillna("") != "").any()]
    paper_head = f" paper's Δ ({' / '.join(backbones)}): where it sits against our interval |" if backbones else ""
    lines = [
        "",
        "## Paired comparisons (client average of `avg_rouge`, A − B)",
        "",
        "Seeds and test examples paired (pipeline/results/stats.py): with one seed a bootstrap over test examples "
        f"({cfg.n_resamples} replicates, seed {cfg.seed}), a QMSum meeting's queries resampled together, once for "
        "every client holding them; with several a t-interval over seeds that adds the test examples' spread, or "
        "where each seed redraws the test sets, is floored at it (docs/statistics.md). Holm p = p "
        f"adjusted over the {sub['p_value'].notna().sum()} comparisons below (Holm's step-down). **Bold** = Holm p < "
        f"{1 - cfg.level:.2g} (the {level} interval, unadjusted, may exclude 0 without it). ⚠ = more than "
        f"{cfg.identical_warning:.0%} of the paired summaries are the same text: the runs did not separate, so "
        "neither a difference nor its absence says much about the methods.",
        "",
        f"| A | B | Δ | {level} interval | p | Holm p | seeds | examples | identical summaries |{paper_head}",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * bool(paper_head),
    ]
    for rec, r in zip(sub.to_dict("records"), sub.itertuples()):
        b = r.config_b + ("" if r.study_b == study else f" ({r.study_b})")
        delta = f"{r.mean_diff:+.2f}"
        interval = "–" if math.isnan(r.ci_low) else f"[{r.ci_low:+.2f}, {r.ci_high:+.2f}]"  # a client of one meeting
        if r.significant:
            delta, interval = f"**{delta}**", f"**{interval}**"
        identical = "–" if math.isnan(r.identical_fraction) else f"{r.identical_fraction:.0%}"
        if r.mostly_identical:  # above the threshold also as shown: 0.504 is '⚠ 50.4%', not '⚠ 50%'
            up = f"{math.ceil(r.identical_fraction * 1000 - 1e-9) / 10:.1f}%"
            identical = f"⚠ {up if identical == f'{cfg.identical_warning:.0%}' else identical}"
        paper = [
            f"{rec[f'published_{bb}']:+.2f} {rec[f'vs_published_{bb}']}"
            for bb in backbones
            if isinstance(rec[f"vs_published_{bb}"], str) and rec[f"vs_published_{bb}"]
        ]
        lines.append(
            f"| {r.config_a} | {b} | {delta} | {interval} | {format_p(r.p_value)} | {format_p(r.p_holm)} | {r.n_seeds} | "
            f"{r.n_examples} | {identical} |" + (f" {' / '.join(paper) or '–'} |" if backbones else "")
        )
    if n_identical := int(sub["mostly_identical"].sum()):
        lines += ["", f"⚠ {n_identical} of {len(sub)} comparisons above are between mostly identical summaries."]
    return "\n".join(lines) + "\n"


def significance_marks(table: pd.DataFrame, study: str, label: str, client: str) -> str:
    """'> single, < fedavg': the baselines this configuration is significantly above or below for one client."""
    held = table[(table["metric"] == "avg_rouge") & table["significant"]]
    sub = held[(held["study"] == study) & (held["config_a"] == label) & (held["client"] == client)]
    return ", ".join(f"{'>' if r.mean_diff > 0 else '<'} {r.method_b}" for r in sub.itertuples()) or "–"


def read_table(path: Path, checked: tuple[str, ...] = tuple(COLUMNS[8:18])) -> pd.DataFrame:
    """A comparisons.csv the report wrote; an unreadable file, a column of :data:`COLUMNS` missing, or a value of
    ``checked`` that is not a number (True or False for the flags: pandas reads a blank one as True) is one line."""
    try:
        table = pd.read_csv(path)
    except ValueError as err:  # empty, a stray quote, not UTF-8: pandas' errors name no file
        raise DataError(f"{path}: not a readable comparisons table: {' '.join(str(err).split())}") from err
    if missing := [c for c in COLUMNS if c not in table.columns]:
        raise DataError(f"{path}: missing column(s) {missing} (not a comparisons table of the report stage)")
    for c in checked:
        flag = c in ("significant", "mostly_identical")
        values = table[c]
        wrong = ~values.isin([True, False]) if flag else pd.to_numeric(values, errors="coerce").isna() & values.notna()
        if wrong.any():  # its line: the header is line 1
            i = int(wrong.to_numpy().argmax())
            raise DataError(f"{path}:{i + 2}: {c} = {values.iloc[i]!r}, not {'True or False' if flag else 'a number'}")
    return table


def carry_identical(table: pd.DataFrame, previous: pd.DataFrame, cfg: BootstrapConfig) -> pd.DataFrame:
    """``table`` with the identical-summary fractions it could not compute (a study folder keeps no
    predictions.jsonl) taken from ``previous`` for the same experiments, client and metric; others keep NaN."""
    key = ["experiments_a", "experiments_b", "client", "metric"]
    known = previous.dropna(subset=["identical_fraction"]).drop_duplicates(key).set_index(key)["identical_fraction"]
    out = table.copy()
    missing = out["identical_fraction"].isna()
    out.loc[missing, "identical_fraction"] = known.reindex(pd.MultiIndex.from_frame(out.loc[missing, key])).to_numpy()
    out["mostly_identical"] = out["identical_fraction"].gt(cfg.identical_warning)
    return out


BACKBONES: tuple[str, ...] = tuple(published.MAIN_TABLE)
CONTAINS, ABOVE, BELOW = "contains", "excludes above", "excludes below"


def classify(low: float, high: float, value: float | None) -> str:
    """Where a published difference sits against our interval [low, high] ('' when there is none)."""
    if value is None or any(math.isnan(x) for x in (value, low, high)):  # no paper's value, or no interval
        return ""
    return ABOVE if value > high else BELOW if value < low else CONTAINS


def published_difference(backbone: str, method_a: str, method_b: str, client: str, metric: str) -> float | None:
    """The paper's A - B for one client (or the client average) and metric; None where it reports none."""
    table = published.MAIN_TABLE[backbone]
    clients = list(table) if client == AVERAGE else [client]
    cells = [table[c] for c in clients if {method_a, method_b} <= table.get(c, {}).keys()]  # {method: Rouge3}
    if metric not in (*TABLE_METRICS, "avg_rouge") or len(cells) < len(clients):
        return None
    return sum(getattr(r[method_a], metric) - getattr(r[method_b], metric) for r in cells) / len(cells)


def with_published(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with ``published_<backbone>`` and ``vs_published_<backbone>`` per backbone of Table III; only rows
    between two of the paper's methods as run in the main study get them (a gate variant is ours, not the paper's)."""
    out = table.copy()
    for b in BACKBONES:
        paper = [
            published_difference(b, r.method_a, r.method_b, r.client, r.metric)
            if r.study == "main" and r.study_b == "main"
            else None
            for r in out.itertuples()
        ]
        out[f"published_{b}"] = [math.nan if p is None else p for p in paper]
        out[f"vs_published_{b}"] = [classify(lo, hi, p) for lo, hi, p in zip(out["ci_low"], out["ci_high"], paper)]
    return out
