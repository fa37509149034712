"""The results in words (docs/statistics.md): the sentences of reports/tables/results.md and of the README's
Results block, rendered from the comparisons table (pipeline.results.comparisons), so no number in them is typed by
hand."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pandas as pd

from pipeline.common.schema import DataError
from pipeline.results import comparisons, published
from pipeline.results.readers import convergence_note, run_verdicts
from pipeline.results.tables import ReportConfig

PAPER_BACKBONE_NAMES = {"bart-large": "BART-large", "bart-base": "BART-base", "led-large": "LED-large"}
# How each place of the paper's difference reads in a sentence, in the order the sentence lists them.
PLACED = {
    comparisons.ABOVE: "excluded: above our upper limit",
    comparisons.CONTAINS: "inside our interval",
    comparisons.BELOW: "excluded: below our lower limit",
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
ONE_MEETING = "a client's test set is one meeting or one example: its spread is unknown"
LARGEST_CLIENT_STEPS = (
    "AdaCentralized trained with the largest client's optimizer steps a round (`train.centralized_steps: "
    "largest_client`), so its lead is not one of more steps."
)


def _num(x: float) -> str:
    return f"{x:+.2f}".replace("-", "−")


def effect(r) -> str:
    """'+0.02 [−0.56, +0.62]'; '+0.02' without an interval (NaN: a client of one meeting or example)."""
    return _num(r.mean_diff) + ("" if math.isnan(r.ci_low) else f" [{_num(r.ci_low)}, {_num(r.ci_high)}]")


def _p(p: float, relation: str = "=") -> str:
    """'Holm p = 0.012': the family-adjusted p the claims test ('Holm p ≤ 0.012', rounded up: a bound)."""
    shown = comparisons.format_p(p, up=relation != "=")
    return f"Holm p {shown}" if shown.startswith("<") else f"Holm p {relation} {shown}"


def _range(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return _num(lo) if f"{lo:.2f}" == f"{hi:.2f}" else f"{_num(lo)} to {_num(hi)}"


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def _seeds(n) -> str:  # "1 seed", "2 seeds", "1-2 seeds"
    return f"{n} seed{'' if str(n) == '1' else 's'}"


def _all(r, where: str) -> bool:
    return all(getattr(r, f"vs_published_{b}", "") == where for b in comparisons.BACKBONES)


def _papers(rows: list) -> str:
    return _range([getattr(r, f"published_{b}") for r in rows for b in comparisons.BACKBONES])


def _difference(r) -> str:
    """'FedKD − AdaSingle +0.02 [−0.56, +0.62]': a configuration of another study than main by method and label."""
    a, b = (
        SHORT.get(method, label) + ("" if study == "main" else f" ({label})")
        for method, label, study in ((r.method_a, r.config_a, r.study), (r.method_b, r.config_b, r.study_b))
    )
    return f"{a} − {b} {effect(r)}"


def _pair(r) -> str:
    """'A − B effect', with where the paper's difference for this pair sits against our interval, per backbone."""
    parts = []
    for where, placed in PLACED.items():
        if bbs := [b for b in comparisons.BACKBONES if getattr(r, f"vs_published_{b}", "") == where]:
            # bbs are of the paper's three backbones (comparisons.BACKBONES): three are all of them
            who = "all three backbones" if len(bbs) == 3 else ", ".join(PAPER_BACKBONE_NAMES[b] for b in bbs)
            parts.append(f"{_range([getattr(r, f'published_{b}') for b in bbs])} on {who}, {placed}")
    text = _difference(r) + (f", {_seeds(r.n_seeds)}: numbers only" if r.few_seeds else "")
    return f"{text} (paper {'; '.join(parts)})" if parts else text


def _records(frame: pd.DataFrame) -> list[SimpleNamespace]:
    """Rows as objects whose attributes are the column names as they are (``published_bart-large``)."""
    return [SimpleNamespace(**rec) for rec in frame.to_dict("records")]


def _rows(avg: pd.DataFrame, a: tuple[str, ...], b: tuple[str, ...]) -> list:
    sub = avg[(avg["study"] == "main") & (avg["study_b"] == "main") & avg["method_a"].isin(a) & avg["method_b"].isin(b)]
    order = {m: i for i, m in enumerate(published.METHOD_ORDER)}
    return sorted(_records(sub), key=lambda r: (order.get(r.method_a, 99), order.get(r.method_b, 99)))


def verdict(rows: list, subject: str, gain: str = "helps") -> str:
    """'<subject> helps', 'hurts' or 'helps and hurts' by the signs of the differences that hold (Holm); else the
    same words 'before Holm's adjustment only' by the signs of the tested ones whose unadjusted interval excludes 0
    (the intervals printed beside it), else 'does not measurably help'; 'not tested' when every one has fewer seeds
    than a claim needs (numbers only)."""
    tested = [r for r in rows if not r.few_seeds]
    holm = [any(r.significant and sign * r.mean_diff > 0 for r in rows) for sign in (1, -1)]
    unadjusted = [any(r.ci_low > 0 for r in tested), any(r.ci_high < 0 for r in tested)]
    for (up, down), after in ((holm, ""), (unadjusted, " before Holm's adjustment only")):
        if up or down:
            return f"{subject} {' and '.join([gain] * up + ['hurts'] * down)}{after}"
    return f"{subject} {'does not measurably help' if tested else 'not tested'}"


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
    clients = ((kd or {}).get("clients") or {}).values()
    if usage := [v["kd_usage_ratio"] for v in clients if v.get("kd_usage_ratio") is not None]:
        ours, paper = [round(100 * u) for u in usage], [round(100 * u) for u in published.KD_USAGE_RATIO.values()]
        unit = f" {kd['tau_unit']}" if kd.get("tau_unit") else ""  # none in a record older than the unit
        at = f" at tau = {kd['tau']}{unit}" if kd.get("tau") is not None else ""  # none: a portable gate, a margin
        text += (
            f" Its selective KD distils on {min(ours)}-{max(ours)} % of target words{at}, "
            f"the paper's on {min(paper)}-{max(paper)} %."
        )
    return text


def results_text(
    table: pd.DataFrame,
    convergence: pd.DataFrame | None = None,
    cfg: ReportConfig | None = None,
    level: float = 0.95,
    centralized_steps: str = "largest_client",
    step_ratios: tuple[tuple[str, float], ...] = (),
    source: str = "comparisons.csv",
    backbone: str = "",
) -> str:
    """The results bullets (markdown) for the main study's client average of avg_rouge, from the comparisons
    table with the published columns, and the convergence records of the studies the table covers. A smoke run
    (``cfg.smoke``; without ``cfg``: none, the default minimums), or one smaller than ``cfg``'s claim minimums,
    states numbers, no claim; so does each comparison with fewer seeds. ``level``: `bootstrap.level`, the
    intervals', and the test's 1 - level (comparisons.with_holm); ``centralized_steps``: `train.centralized_steps`,
    and under `epoch` ``step_ratios``, AdaCentralized's optimizer steps a round over each client's (client, ratio),
    from the run records; ``backbone``: :func:`backbone_note`."""
    cfg = cfg or ReportConfig(smoke=False)
    if "vs_published_" + comparisons.BACKBONES[0] not in table.columns:
        table = comparisons.with_published(table)
    table = table[table["metric"] == "avg_rouge"]
    # a comparison with fewer seeds than `report.claim_min_seeds` states its numbers; no claim is drawn from it
    few = table["n_seeds"].astype(int) < cfg.claim_min_seeds
    table = table.assign(few_seeds=few, significant=table["significant"].astype(bool) & ~few)
    main = table[(table["study"] == "main") & (table["study_b"] == "main")]
    avg, per_client = table[table["client"] == comparisons.AVERAGE], main[main["client"] != comparisons.AVERAGE]
    main_avg = main[main["client"] == comparisons.AVERAGE]
    seeds, examples = sorted(set(main_avg["n_seeds"].astype(int))), sorted(set(main_avg["n_examples"].astype(int)))
    size = f"; {_seeds(_span(seeds))} and {_span(examples)} test examples a comparison" if seeds else ""
    lines = [
        f"Generated by `python -m pipeline.report claims` from `{source}` (paired difference of the client "
        f"average of `avg_rouge`, A − B with its {level * 100:g} % interval over seeds and test examples, QMSum's queries on one "
        "meeting one cluster, pipeline/results/stats.py; R-L is plain `rougeL`, as the paper's; the paper's "
        f"differences are its Table III's, BART-large, BART-base and LED-large){size}. A claim needs Holm-adjusted "
        f"p < {1 - level:.2g} over the study's {avg.loc[avg['study'] == 'main', 'p_value'].notna().sum()} client-average comparisons (per client: over that client's), "
        f"and at least {cfg.claim_min_seeds} seeds (`report.claim_min_seeds`); the intervals are unadjusted:"
    ] + ([backbone] if backbone else [])
    # why no comparative claim is drawn: a smoke run, or fewer seeds or test examples than the profile asks for
    why = "a smoke run (`report.smoke: true`)" if cfg.smoke else ""
    if not why and seeds and (seeds[-1] < cfg.claim_min_seeds or examples[0] < cfg.claim_min_examples):
        short = [("seeds", seeds[-1], cfg.claim_min_seeds), ("test examples", examples[0], cfg.claim_min_examples)]
        why = f"{_seeds(seeds[-1])} and {examples[0]} test examples: " + "; ".join(  # only the minimum it is below
            f"fewer {what} than the {need} this profile needs for a claim (`report.claim_min_{what.split()[-1]}`)"
            for what, have, need in short
            if have < need
        )
    if not why and seeds and main_avg["p_value"].isna().all():  # stats.mean_interval: NaN, no test
        why = f"no client-average comparison has an interval ({ONE_MEETING})"
    if why:
        rows = _rows(avg, published.METHOD_ORDER, published.METHOD_ORDER)
        lines.append(
            f"- **No comparative claim**: {why}. The differences, as numbers only (nor set against the "
            "paper's): " + "; ".join(_difference(r) for r in rows) + "."
        )
        return _with_budget(lines, table, convergence)
    lines += _pooling(avg, per_client, centralized_steps, step_ratios) + _federation(avg)
    if select := _rows(avg, ("fedselectkd",), ("fedkd",)):
        lines.append(f"- **{verdict(select, 'Selectivity')}**: {_pair(select[0])}.")
    if distil := _rows(avg, ("fedkd", "fedselectkd"), ("fedavg",)):
        lines.append(
            "- **Distillation against averaging** (FedAvg has no teacher, so these compare KD with plain "
            "averaging, not selectivity): " + "; ".join(_pair(r) for r in distil) + "."
        )
    return _with_budget(lines + _per_client(per_client) + _variants(avg), table, convergence)


def _pooling(avg: pd.DataFrame, per_client: pd.DataFrame, steps: str, ratios: tuple) -> list[str]:
    """AdaCentralized against every other method: the lead, its step budget, per client, against the paper."""
    central = _rows(avg, ("centralized",), ("single", *FEDERATED))
    if not central:
        return []
    ahead = all(r.significant and r.mean_diff > 0 for r in central)
    head = "Pooling the data helps" if ahead else verdict(central, "Pooling the data", "helps against some methods")
    # one p for the whole line only when it supports the line (every lead holds); else each comparison speaks
    p_text = f" ({_p(max(r.p_holm for r in central), '≤')} each)" if ahead else ""
    held = [f"{SHORT[r.method_b]} ({_p(r.p_holm)})" for r in central if r.significant and r.mean_diff > 0]
    lines = [f"- **{head}**{p_text}: " + "; ".join(_pair(r) for r in central) + "."]
    if held and not ahead:
        lines.append(f"  The lead holds against {', '.join(held)} only.")
    # what AdaCentralized's lead can mean under its `train.centralized_steps` rule (pipeline.training.serverless)
    times = ", ".join(f"{r:.1f}x {c}'s" for c, r in ratios) or "more than"
    lines.append(
        "  " + LARGEST_CLIENT_STEPS
        if steps == "largest_client"
        else "  AdaCentralized made one pass over the pooled data a round (`train.centralized_steps: epoch`): "
        f"{times} optimizer steps a round: its lead cannot be told apart from more steps."
    )
    by_b = []
    for r in central:
        if r.few_seeds:
            by_b.append(f"vs {SHORT[r.method_b]} not tested ({_seeds(r.n_seeds)})")
            continue
        sig = per_client[(per_client["method_a"] == "centralized") & (per_client["method_b"] == r.method_b)]
        yes, loss = (list(sig.loc[sig["significant"] & (sign * sig["mean_diff"] > 0), "client"]) for sign in (1, -1))
        no = [c for c in sig["client"] if c not in yes]  # a significant loss is no lead: it is named one
        by_b.append(
            f"vs {SHORT[r.method_b]} on {', '.join(yes) or 'no client'}"
            + (f" (not {', '.join(no)})" if no and yes else "")
            + (f", a loss on {', '.join(loss)}" if loss else "")
        )
    lines.append("  Per client its lead holds " + "; ".join(by_b) + ".")
    gaps = [r for r in central if r.method_b in FEDERATED]
    if gaps and all(_all(r, comparisons.BELOW) and not r.few_seeds for r in gaps):
        lo, hi = min(r.mean_diff for r in gaps), max(r.mean_diff for r in gaps)
        lines.append(
            f"  The federated methods stay {lo:.2f} to {hi:.2f} below AdaCentralized; "
            f"the paper's gaps ({_papers(gaps)} across its backbones) are below every one of our unadjusted "
            f"lower limits ({', '.join(_num(r.ci_low) for r in gaps)})."
        )
    return lines


def _federation(avg: pd.DataFrame) -> list[str]:
    """Each federated method against AdaSingle, the paper's gains it excludes, the summaries that did not separate."""
    fed = _rows(avg, FEDERATED, ("single",))
    if not fed:
        return []
    lines = [f"- **{verdict(fed, 'Federation, as run here,')}**: " + "; ".join(_pair(r) for r in fed) + "."]
    if excluded := [r for r in fed if _all(r, comparisons.ABOVE) and not r.few_seeds]:
        lines.append(
            f"  The paper's gains of {' and '.join(SHORT[r.method_a] for r in excluded)} over AdaSingle "
            f"({_papers(excluded)} across its backbones) are excluded here: our unadjusted upper "
            f"{'limits are' if len(excluded) > 1 else 'limit is'} {' and '.join(_num(r.ci_high) for r in excluded)}."
        )
    kd = [r for r in fed if r.method_a in ("fedkd", "fedselectkd") and not math.isnan(r.identical_fraction)]
    if same := [round(r.identical_fraction * 100) for r in kd]:
        # runs that did not separate: where the tables flag it (more than `bootstrap.identical_warning` the same text)
        split = ": many runs did not separate from local training" if any(r.mostly_identical for r in kd) else ""
        lines.append(
            f"  {_span(sorted({min(same), max(same)}))} % of the FedKD and SelectKD summaries are the "
            f"same text as AdaSingle's (`identical_fraction`){split}."
        )
    return lines


def _per_client(per_client: pd.DataFrame) -> list[str]:
    """Per-client comparisons among AdaSingle and the federated methods that hold, or the closest one."""
    mains = ("single", *FEDERATED)
    fed_clients = per_client[per_client["method_a"].isin(mains) & per_client["method_b"].isin(mains)]
    if fed_clients.empty:
        return []
    sig, tested = fed_clients[fed_clients["significant"]], fed_clients[~fed_clients["few_seeds"]]
    if tested.empty:  # every one below `report.claim_min_seeds`: no claim, of an ordering or of none
        seeds = _seeds(_span(sorted(set(fed_clients["n_seeds"].astype(int)))))
        return [f"- Per-client comparisons among AdaSingle, FedAvg, FedKD and SelectKD, {seeds}: numbers only."]
    if sig.empty and tested["p_value"].isna().all():  # stats.mean_interval: a client of one meeting (or example)
        return [
            "- No per-client comparison among AdaSingle, FedAvg, FedKD and SelectKD has a p-value (each client's test "
            "set is one meeting or one example: its spread is unknown); no ordering among them is supported."
        ]
    if sig.empty:
        c = _records(tested.loc[[tested["p_value"].idxmin()]])[0]
        return [
            f"- No per-client comparison among AdaSingle, FedAvg, FedKD and SelectKD holds (closest: "
            f"{SHORT[c.method_a]} − {SHORT[c.method_b]} on {c.client} {effect(c)}, "
            f"p = {comparisons.format_p(c.p_value)} unadjusted, {_p(c.p_holm)}); no ordering among them is supported."
        ]
    return [
        "- Per-client federated comparisons that hold: "
        + "; ".join(f"{SHORT[c.method_a]} − {SHORT[c.method_b]} on {c.client} {effect(c)}" for c in _records(sig))
        + "."
    ]


def _variants(avg: pd.DataFrame) -> list[str]:
    """Each SelectKD variant of another study (a KD gate, a study's settings) against the main SelectKD."""
    selectkd = avg[(avg["method_a"] == "fedselectkd") & (avg["method_b"] == "fedselectkd")]
    lines = []
    for r in _records(selectkd[(selectkd["study"] != "main") & (selectkd["study_b"] == "main")]):
        gate, base = (re.sub(r"^fedselectkd\s*", "", c) or c for c in (r.config_a, r.config_b))
        # the same gate in another study (e.g. client sampling) differs in that study's settings, not in its gate
        if r.config_a != r.config_b:
            what, changed = f"**A different KD gate** ({gate})", "the gate changes"
        else:
            what, changed = f"**SelectKD in study {r.study}** ({gate})", f"study {r.study}'s settings change"
        finding = (
            f"{_seeds(r.n_seeds)}: numbers only"
            if r.few_seeds
            else f"no interval ({ONE_MEETING}): numbers only"
            if math.isnan(r.p_value)
            else f"{changed} ROUGE ({_p(r.p_holm)})"
            if r.significant
            else f"no difference detected ({_p(r.p_holm)}), though the unadjusted interval excludes 0"
            if r.ci_low > 0 or r.ci_high < 0
            else f"no difference detected; this unadjusted interval excludes a gain above {_num(r.ci_high)} or a "
            f"loss beyond {_num(r.ci_low)}, not a smaller difference either way"
        )
        lines.append(f"- {what} − SelectKD ({base}): {effect(r)}: {finding}.")
    return lines


def _with_budget(lines: list[str], table: pd.DataFrame, convergence: pd.DataFrame | None) -> str:
    """``lines`` and the round-budget note of the table's studies (``convergence``: their evaluated runs), markdown."""
    studies = sorted(set(table["study"]) | set(table["study_b"]))
    if text := convergence_note(convergence, studies):
        runs = run_verdicts(convergence[convergence["study"].isin(studies)])
        lines.append(
            f"- **Round budget** (the evaluated runs, which the comparisons are over): {text.removeprefix('↗ ')} "
            f"{int((~runs).sum())} of {len(runs)} runs are not converged (with the stop rule of `train.stop`: "
            "it never held before the round ceiling; with a fixed round budget: a client's best validation round "
            "was its last). The whole comparison is conditional on it."
        )
    return "\n".join(lines) + "\n"


def replace_block(text: str, block: str, where: str = "markdown file") -> str:
    """``text`` with the part between the results markers replaced by ``block``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise DataError(f"{where}: no {BEGIN} ... {END} block")
    return text[: start + len(BEGIN)] + "\n" + block + text[end:]
