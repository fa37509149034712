"""The results in words (docs/statistics.md): the sentences of reports/tables/results.md and of the README's
Results block, rendered from the comparisons table (pipeline.results.comparisons), so no number in them is typed by
hand."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import SimpleNamespace

import pandas as pd

from pipeline.common.schema import DataError
from pipeline.results import published
from pipeline.results.comparisons import ABOVE, AVERAGE, BACKBONES, BELOW, CONTAINS, format_p, with_published
from pipeline.results.readers import convergence_note

PAPER_BACKBONE_NAMES = {"bart-large": "BART-large", "bart-base": "BART-base", "led-large": "LED-large"}
# How each place of the paper's difference reads in a sentence, in the order the sentence lists them.
PLACED = {
    ABOVE: "excluded: above our upper limit",
    CONTAINS: "inside our interval",
    BELOW: "excluded: below our lower limit",
}
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
SHORT = {
    "single": "AdaSingle",
    "centralized": "AdaCentralized",
    "fedavg": "FedAvg",
    "fedkd": "FedKD",
    "fedselectkd": "SelectKD",
}
FEDERATED = ("fedavg", "fedkd", "fedselectkd")
# What AdaCentralized's lead can mean under each `train.centralized_steps` rule (pipeline.training.serverless).
STEP_RULE = {
    "largest_client": "AdaCentralized trained with the largest client's optimizer steps a round "
    "(`train.centralized_steps: largest_client`), so its lead is not one of more steps.",
    "epoch": "AdaCentralized made one pass over the pooled data a round (`train.centralized_steps: epoch`), several "
    "times the optimizer steps of any client: its lead cannot be told apart from more steps.",
}


@dataclass(frozen=True)
class ClaimScale:
    """`report.smoke`, `report.claim_min_seeds`, `report.claim_min_examples` and `train.centralized_steps`."""

    smoke: bool = False
    min_seeds: int = 2
    min_examples: int = 100
    centralized_steps: str = "largest_client"


def _num(x: float) -> str:
    return f"{x:+.2f}".replace("-", "−")


def effect(r) -> str:
    """'+0.02 [−0.56, +0.62]'."""
    return f"{_num(r.mean_diff)} [{_num(r.ci_low)}, {_num(r.ci_high)}]"


def _p(r) -> str:
    shown = format_p(r.p_value)
    return f"p {shown}" if shown.startswith("<") else f"p = {shown}"


def _range(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return _num(lo) if f"{lo:.2f}" == f"{hi:.2f}" else f"{_num(lo)} to {_num(hi)}"


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def _all(r, where: str) -> bool:
    return all(getattr(r, f"vs_published_{b}", "") == where for b in BACKBONES)


def _papers(rows: list) -> str:
    return _range([getattr(r, f"published_{b}") for r in rows for b in BACKBONES])


def _name(r, side: str) -> str:
    method, label, study = (r.method_a, r.config_a, r.study) if side == "a" else (r.method_b, r.config_b, r.study_b)
    base = SHORT.get(method, label)
    return base if study == "main" else f"{base} ({label})"


def _pair(r) -> str:
    """'A − B effect', with where the paper's difference for this pair sits against our interval, per backbone."""
    groups: dict[str, list[str]] = {}
    for b in BACKBONES:
        where = getattr(r, f"vs_published_{b}", "")
        if isinstance(where, str) and where:
            groups.setdefault(where, []).append(b)
    parts = []
    for where in (w for w in PLACED if w in groups):
        bbs = groups[where]
        who = (
            "all three backbones"
            if len(bbs) == len(BACKBONES) == 3
            else ", ".join(PAPER_BACKBONE_NAMES.get(b, b) for b in bbs)
        )
        parts.append(f"{_range([getattr(r, f'published_{b}') for b in bbs])} on {who}, {PLACED[where]}")
    text = f"{_name(r, 'a')} − {_name(r, 'b')} {effect(r)}"
    return f"{text} (paper {'; '.join(parts)})" if parts else text


def _records(frame: pd.DataFrame) -> list[SimpleNamespace]:
    """Rows as objects whose attributes are the column names as they are (``published_bart-large``)."""
    return [SimpleNamespace(**rec) for rec in frame.to_dict("records")]


def _rows(avg: pd.DataFrame, a: tuple[str, ...], b: tuple[str, ...]) -> list:
    sub = avg[(avg["study"] == "main") & (avg["study_b"] == "main") & avg["method_a"].isin(a) & avg["method_b"].isin(b)]
    order = {m: i for i, m in enumerate(published.METHOD_ORDER)}
    return sorted(_records(sub), key=lambda r: (order.get(r.method_a, 99), order.get(r.method_b, 99)))


def verdict(rows: list, subject: str, gain: str = "helps") -> str:
    """'<subject> helps' or 'hurts' by the sign of a difference excluding 0, else 'does not measurably help'."""
    if any(r.significant and r.mean_diff > 0 for r in rows):
        return f"{subject} {gain}"
    if any(r.significant and r.mean_diff < 0 for r in rows):
        return f"{subject} hurts"
    return f"{subject} does not measurably help"


def backbone_note(backbone: dict | None, kd: dict | None) -> str:
    """The backbone caveat, from the backbone record (reports/backbone.json) and the KD analysis: what the runs
    used instead of the paper's backbones, and its KD usage against the paper's ('' without a record)."""
    if not backbone:
        return ""
    ev = backbone.get("evaluation") or {}
    warm = (
        f", ROUGE-1 {ev['rouge1']:.2f} on {ev['examples']} {ev.get('dataset', '')} validation examples after its "
        "warm-up"
        if "rouge1" in ev
        else ""
    )
    text = (
        f"- **Backbone**: `{backbone.get('name')}` ({backbone.get('parameters', 0) / 1e6:.1f}M parameters{warm}), "
        "not the paper's BART-large, BART-base or LED-large: every comparison with the paper's differences is "
        "across backbones."
    )
    usage = [
        v["kd_usage_ratio"] for v in ((kd or {}).get("clients") or {}).values() if v.get("kd_usage_ratio") is not None
    ]
    if usage:
        ours, paper = [round(100 * u) for u in usage], [round(100 * u) for u in published.KD_USAGE_RATIO.values()]
        text += (
            f" Its selective KD distils on {min(ours)}-{max(ours)} % of target tokens at tau = {kd.get('tau')}, "
            f"the paper's on {min(paper)}-{max(paper)} %."
        )
    return text


def results_text(
    table: pd.DataFrame,
    convergence: pd.DataFrame | None = None,
    scale: ClaimScale = ClaimScale(),
    metric: str = "avg_rouge",
    source: str = "comparisons.csv",
    backbone: str = "",
) -> str:
    """The results bullets (markdown) for the main study's client average of ``metric``, from the comparisons
    table with the published columns, and the convergence records of the studies the table covers. A smoke run,
    or one smaller than ``scale`` asks for, states numbers, no claim; ``backbone``: :func:`backbone_note`."""
    if "vs_published_" + BACKBONES[0] not in table.columns:
        table = with_published(table)
    avg = table[(table["client"] == AVERAGE) & (table["metric"] == metric)]
    per_client = table[
        (table["client"] != AVERAGE)
        & (table["metric"] == metric)
        & (table["study"] == "main")
        & (table["study_b"] == "main")
    ]
    main = table[(table["study"] == "main") & (table["study_b"] == "main") & (table["client"] == AVERAGE)]
    found = (
        None
        if main.empty or not {"n_seeds", "n_examples"} <= set(main.columns)
        else (sorted(set(main["n_seeds"].astype(int))), sorted(set(main["n_examples"].astype(int))))
    )
    size = f"; {_span(found[0])} seed(s) and {_span(found[1])} test examples a comparison" if found else ""
    lines = [
        f"Generated by `python -m pipeline.report claims` from `{source}` (paired difference of the client "
        f"average of `{metric}`, A − B with its 95 % interval over seeds and test examples, "
        "pipeline/results/stats.py; R-L is plain `rougeL`, as the paper's; the paper's differences are its "
        f"Table III's, BART-large, BART-base and LED-large){size}:"
    ] + ([backbone] if backbone else [])
    # why no comparative claim is drawn: a smoke run, or fewer seeds or test examples than the profile asks for
    why = "a smoke run (`report.smoke: true`)" if scale.smoke else ""
    if not why and found is not None and (found[0][0] < scale.min_seeds or found[1][0] < scale.min_examples):
        why = (
            f"{found[0][0]} seed(s) and {found[1][0]} test examples, below the {scale.min_seeds} seeds and "
            f"{scale.min_examples} examples this profile needs for a claim (`report.claim_min_seeds`, "
            "`report.claim_min_examples`)"
        )
    if why:
        rows = _rows(avg, published.METHOD_ORDER, published.METHOD_ORDER)
        lines.append(
            f"- **No comparative claim**: {why}. The differences, as numbers only (nor set against the "
            "paper's): " + "; ".join(f"{_name(r, 'a')} − {_name(r, 'b')} {effect(r)}" for r in rows) + "."
        )
        return _with_budget(lines, table, convergence)

    central = _rows(avg, ("centralized",), ("single", *FEDERATED))
    if central:
        ahead = all(r.significant and r.mean_diff > 0 for r in central)
        head = "Pooling the data helps" if ahead else verdict(central, "Pooling the data", "helps against some methods")
        worst_p = max(r.p_value for r in central)
        # one p for the whole line only when it supports the line (every lead excludes 0); else each interval speaks
        p_text = (" (p < 0.001 each)" if worst_p < 0.001 else f" (p ≤ {worst_p:.3f} each)") if ahead else ""
        lines.append(f"- **{head}**{p_text}: " + "; ".join(_pair(r) for r in central) + ".")
        lines.append("  " + STEP_RULE[scale.centralized_steps])
        by_b = []
        for r in central:
            sig = per_client[(per_client["method_a"] == "centralized") & (per_client["method_b"] == r.method_b)]
            yes = [c for c, s in zip(sig["client"], sig["significant"]) if s]
            no = [c for c, s in zip(sig["client"], sig["significant"]) if not s]
            by_b.append(
                f"vs {SHORT[r.method_b]} on {', '.join(yes) or 'no client'}"
                + (f" (not {', '.join(no)})" if no and yes else "")
            )
        lines.append("  Per client its lead excludes 0 " + "; ".join(by_b) + ".")
        gaps = [r for r in central if r.method_b in FEDERATED]
        if gaps and all(_all(r, BELOW) for r in gaps):
            lo, hi = min(r.mean_diff for r in gaps), max(r.mean_diff for r in gaps)
            lines.append(
                f"  The federated methods stay {lo:.2f} to {hi:.2f} below AdaCentralized; "
                f"the paper's gaps ({_papers(gaps)} across its backbones) are below every one of our "
                f"lower limits ({', '.join(_num(r.ci_low) for r in gaps)})."
            )

    fed = _rows(avg, FEDERATED, ("single",))
    if fed:
        lines.append(f"- **{verdict(fed, 'Federation, as run here,')}**: " + "; ".join(_pair(r) for r in fed) + ".")
        excluded = [r for r in fed if _all(r, ABOVE)]
        if excluded:
            lines.append(
                f"  The paper's gains of {' and '.join(SHORT[r.method_a] for r in excluded)} over AdaSingle "
                f"({_papers(excluded)} across its backbones) are excluded here: our upper limits are "
                f"{' and '.join(_num(r.ci_high) for r in excluded)}."
            )
        same = [
            round(r.identical_fraction * 100)
            for r in fed
            if r.method_a in ("fedkd", "fedselectkd") and not math.isnan(r.identical_fraction)
        ]
        if same:
            lines.append(
                f"  {_span(sorted({min(same), max(same)}))} % of the FedKD and SelectKD summaries are the "
                "same text as AdaSingle's (`identical_fraction`): many runs did not separate from local "
                "training."
            )

    select = _rows(avg, ("fedselectkd",), ("fedkd",))
    if select:
        lines.append(f"- **{verdict(select, 'Selectivity')}**: {_pair(select[0])}.")

    distil = _rows(avg, ("fedkd", "fedselectkd"), ("fedavg",))
    if distil:
        lines.append(
            "- **Distillation against averaging** (FedAvg has no teacher, so these compare KD with plain "
            "averaging, not selectivity): " + "; ".join(_pair(r) for r in distil) + "."
        )

    mains = ("single", *FEDERATED)
    fed_clients = per_client[per_client["method_a"].isin(mains) & per_client["method_b"].isin(mains)]
    if not fed_clients.empty:
        sig = fed_clients[fed_clients["significant"]]
        if sig.empty:
            c = _records(fed_clients.loc[[fed_clients["p_value"].idxmin()]])[0]
            lines.append(
                f"- No per-client comparison among AdaSingle, FedAvg, FedKD and SelectKD excludes 0 "
                f"(closest: {SHORT[c.method_a]} − {SHORT[c.method_b]} on {c.client} {effect(c)}, "
                f"{_p(c)}); no ordering among them is supported."
            )
        else:
            lines.append(
                "- Per-client federated comparisons that exclude 0: "
                + "; ".join(
                    f"{SHORT[c.method_a]} − {SHORT[c.method_b]} on {c.client} {effect(c)}" for c in _records(sig)
                )
                + "."
            )

    variants = avg[
        (avg["study"] != "main")
        & (avg["method_a"] == "fedselectkd")
        & (avg["method_b"] == "fedselectkd")
        & (avg["study_b"] == "main")
    ]
    for r in _records(variants):
        gate = re.sub(r"^fedselectkd\s*", "", r.config_a) or r.config_a
        base = re.sub(r"^fedselectkd\s*", "", r.config_b) or r.config_b
        # the same gate in another study (e.g. client sampling) differs in that study's settings, not in its gate
        if r.config_a != r.config_b:
            what, changed = f"**A different KD gate** ({gate})", "the gate changes"
        else:
            what, changed = f"**SelectKD in study {r.study}** ({gate})", f"study {r.study}'s settings change"
        finding = (
            f"{changed} ROUGE ({_p(r)})"
            if r.significant
            else f"no difference detected; this excludes a gain above {_num(r.ci_high)} or a loss beyond "
            f"{_num(r.ci_low)}, not a smaller difference either way"
        )
        lines.append(f"- {what} − SelectKD ({base}): {effect(r)}: {finding}.")

    return _with_budget(lines, table, convergence)


def _with_budget(lines: list[str], table: pd.DataFrame, convergence: pd.DataFrame | None) -> str:
    """``lines`` and the round-budget note of the studies the table covers, as markdown."""
    if convergence is not None and not convergence.empty:
        text = convergence_note(convergence, sorted(set(table["study"]) | set(table["study_b"])))
        if text:
            lines.append(f"- **Round budget**: {text.removeprefix('↗ ')} The whole comparison is conditional on it.")
    return "\n".join(lines) + "\n"


def replace_block(text: str, block: str, where: str = "markdown file") -> str:
    """``text`` with the part between the results markers replaced by ``block``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise DataError(f"{where}: no {BEGIN} ... {END} block")
    return text[: start + len(BEGIN)] + "\n" + block + text[end:]
