"""Generated summaries side by side: the evaluate stage's predictions per method, the case study and the
human-evaluation kit (METHOD.md section 7.12): blind pairwise sheets (which side is the target method is only in
``key.json``), as the paper compares SelectKD with every other method, and their win/tie/loss counts."""

from __future__ import annotations

import hashlib
import html
import itertools
import json
import random
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from pipeline.common import atomic
from pipeline.common.config import ConfigError, config, from_dict
from pipeline.common.schema import DataError
from pipeline.experiments.entries import Experiment
from pipeline.results import published
from pipeline.results.plotting import plt, save
from pipeline.results.readers import read_json, read_predictions
from pipeline.results.scoring import TABLE_ROUGE_L, Scorer
from pipeline.results.tables import ReportConfig

SHEET_COLUMNS = ("item_id", "domain", "query", "reference", "summary_A", "summary_B", "judgement", "comment", "kit")
OUTCOMES = ("win", "tie", "loss")
JUDGEMENTS = {"a": "A", "b": "B", "tie": "tie", "t": "tie", "=": "tie", "same": "tie"}


@dataclass(frozen=True)
class Prediction:  # one generated summary of one test example (a line of reports/eval/<exp>/predictions.jsonl)
    experiment: str
    example_id: str
    domain: str
    prediction: str
    reference: str


Predictions = dict[str, dict[str, Prediction]]  # method -> example id -> its summary


@config(frozen=True)
class KeyEntry:  # an item of key.json; every field text (pandas' crosstab would drop a judgement of a null domain)
    example_id: str
    domain: str
    target: str  # the method being evaluated (SelectKD)
    opponent: str
    target_side: Literal["A", "B"]
    target_experiment: str
    opponent_experiment: str


def predictions_by_method(
    planned: list[Experiment], eval_dir: Path, target: str, other: str | None = None
) -> tuple[Predictions, int | None]:
    """method -> example_id -> Prediction for the main study's lowest seed at which ``target`` and another method (the
    method ``other`` if given) have predictions (without one, the lowest seed with any), and that seed."""
    avail = [p for p in planned if p.study == "main" and (eval_dir / p.name / "predictions.jsonl").is_file()]
    if not avail:
        return {}, None
    others = {p.seed for p in avail if p.method != target and other in (None, p.method)}
    shared = {p.seed for p in avail if p.method == target} & others
    chosen_seed = min(shared or {p.seed for p in avail})
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


def case_study(preds: Predictions, queries: dict[str, str], seed: int) -> str | None:
    """One test example per domain: FedAvg's and SelectKD's summary and the gold one (seeded choice)."""
    methods = ("fedavg", "fedselectkd")
    if not all(m in preds for m in methods):
        return None
    scorer = Scorer()
    common = sorted(set(preds[methods[0]]) & set(preds[methods[1]]))
    by_domain: dict[str, list[str]] = defaultdict(list)
    for ex in common:
        by_domain[preds[methods[0]][ex].domain].append(ex)
    rng = random.Random(f"case_study:{seed}")
    lines = [
        "# Case study",
        "",
        "One test example per domain, chosen at random (seeded, `report.case_study_seed`), summarised by each "
        "client's own model; ROUGE F1 x 100 of each summary against the gold one.",
        "",
    ]
    for domain in sorted(by_domain):
        ex = rng.choice(by_domain[domain])
        gold = preds[methods[0]][ex].reference
        lines += [f"## {domain}", "", f"Example `{ex}`", ""]
        if queries.get(ex):
            lines += [f"**Query:** {queries[ex]}", ""]
        for m in methods:
            p = preds[m][ex]
            s = scorer.score(p.prediction, gold)
            lines += [
                f"**{published.PAPER_METHOD_NAMES.get(m, m)}** (R-1 {s['rouge1']:.1f}, R-2 {s['rouge2']:.1f}, "
                f"R-L {s[TABLE_ROUGE_L]:.1f}; `{p.experiment}`): {p.prediction}",
                "",
            ]
        lines += [f"**Gold:** {gold}", ""]
    return "\n".join(lines)


def make_sheets(
    predictions: Predictions, out: Path, cfg: ReportConfig, queries: dict, meetings: dict, run_seed: int = 0
) -> dict[str, Any]:
    """Blind pairwise sheets (into ``out``, created) of `report.human_eval_target` against every other method on the
    examples all predicted (up to `report.human_eval_per_domain` a domain, drawn with `report.human_eval_seed`;
    ``queries``, ``meetings``: by example id, :func:`example_info`; ``run_seed``: the runs' seed, for the summary);
    their summary. The report calls it only when the target and another method have predictions."""
    target, per_domain, seed = cfg.human_eval_target, cfg.human_eval_per_domain, cfg.human_eval_seed
    opponents = sorted(m for m in predictions if m != target)
    common = set(predictions[target]).intersection(*(predictions[m] for m in opponents))
    if not common:
        raise DataError(
            f"human evaluation: {target!r} and {opponents} share no test example "
            "(were they evaluated on the same partition?)"
        )
    rng = random.Random(f"human_eval:{seed}")
    domain_of = {ex: predictions[target][ex].domain for ex in common}
    # up to per_domain examples a domain, round-robin over its shuffled meetings: as many meetings as there are
    by_domain: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for ex in sorted(common):
        by_domain[domain_of[ex]][meetings.get(ex, ex)].append(ex)
    chosen: list[str] = []
    for domain in sorted(by_domain):
        order = sorted(by_domain[domain])
        rng.shuffle(order)
        queues = [rng.sample(by_domain[domain][m], len(by_domain[domain][m]))[::-1] for m in order]
        # one example of each meeting in turn (its queue's next), until per_domain or every queue is empty
        chosen += [ex for turn in itertools.zip_longest(*queues) for ex in turn if ex is not None][:per_domain]

    # as many sheets as opponents, each showing every chosen example once, its opponent rotating: in one sheet of all
    # pairs, the summary repeated in every item of an example was the target's and gave its side away
    sheets = [[(ex, opponents[(i + j) % len(opponents)]) for i, ex in enumerate(chosen)] for j in range(len(opponents))]
    for pairs in sheets:
        rng.shuffle(pairs)  # annotators must not see one method's items in a block
    sheet_rows: list[list[dict[str, str]]] = []  # per sheet, its rows (every column but the kit)
    items: dict[str, dict[str, str]] = {}  # key.json's: item id -> its KeyEntry
    for pairs in sheets:
        sheet_rows.append([])
        for ex, opp in pairs:
            t, o = predictions[target][ex], predictions[opp][ex]
            target_side = rng.choice(("A", "B"))
            a, b = (t, o) if target_side == "A" else (o, t)
            item_id = f"item{len(items) + 1:04d}"
            sheet_row = (item_id, t.domain, queries.get(ex, ""), t.reference, a.prediction, b.prediction, "", "")
            sheet_rows[-1].append(dict(zip(SHEET_COLUMNS[:-1], sheet_row, strict=True)))
            items[item_id] = asdict(KeyEntry(ex, t.domain, target, opp, target_side, t.experiment, o.experiment))
    # the kit's id (a hash of what it shows and of its answers) in every row and key.json: score_sheets refuses a
    # sheet of another kit (another build's summaries, seed or runs), whose items have the same ids; 12 hex of the
    # sha256 holding a-d or f: a spreadsheet reads 000123456789 or 1234567890e1 as a number and saves it changed
    digest = hashlib.sha256(json.dumps([list(itertools.chain(*sheet_rows)), items]).encode()).hexdigest()
    kit = next(k for k in (digest[i : i + 12] for i in range(53)) if set(k) & set("abcdf"))

    for old in [*out.glob("sheet*.csv"), *out.glob("sheet*.html")]:  # another kit's sheets, never to hand out
        old.unlink()
    for j, rows in enumerate(sheet_rows, 1):
        part = [r | {"kit": kit} for r in rows]
        table = pd.DataFrame(part, columns=SHEET_COLUMNS)
        atomic.to_csv(table, out / f"sheet{j}.csv", index=False, lineterminator="\r\n")
        atomic.write_text(out / f"sheet{j}.html", _html_page(part, kit, f"sheet{j}"))
    atomic.write_json(out / "key.json", {"target": target, "seed": seed, "kit": kit, "items": items})
    summary = {
        "target": target,
        "opponents": opponents,
        "items": len(items),
        "sheets": len(sheets),
        "examples": len(chosen),
        "examples_per_domain": dict(sorted(Counter(domain_of[ex] for ex in chosen).items())),
        "requested_per_domain": per_domain,
        "seed": seed,
        "run_seed": run_seed,  # predictions_by_method's choice
    }
    atomic.write_json(out / "summary.json", summary)
    return summary


def _html_page(rows: list[dict[str, str]], kit: str, sheet: str) -> str:
    """A static page: every item with radio buttons; a button downloads item_id,judgement,kit as <sheet>_<name>.csv."""
    esc = html.escape
    items = []
    for r in rows:
        iid = esc(r["item_id"])
        radios = " ".join(
            f'<label><input type="radio" name="{iid}" value="{v}"> {label}</label>'
            for v, label in (("A", "A is better"), ("tie", "tie"), ("B", "B is better"))
        )
        items.append(
            f'<section class="item" id="{iid}"><h2>{iid} <small>({esc(r["domain"])})</small></h2>'
            f"<p><b>Query:</b> {esc(r['query']) or '<i>(whole meeting)</i>'}</p>"
            f"<p><b>Gold summary:</b> {esc(r['reference'])}</p>"
            f'<div class="pair"><div><h3>Summary A</h3><p>{esc(r["summary_A"])}</p></div>'
            f"<div><h3>Summary B</h3><p>{esc(r['summary_B'])}</p></div></div>"
            f"<p>{radios}</p></section>"
        )
    script = """
function download() {
  const name = (document.getElementById('annotator').value || 'anonymous').replace(/[^A-Za-z0-9_-]/g, '_');
  let csv = 'item_id,judgement,kit\\n';
  document.querySelectorAll('section.item').forEach(s => {
    const c = s.querySelector('input:checked');
    csv += s.id + ',' + (c ? c.value : '') + ',' + document.body.dataset.kit + '\\n';
  });
  const a = document.createElement('a');
  a.href = URL.createObjectURL(new Blob([csv], {type: 'text/csv'}));
  a.download = document.body.dataset.sheet + '_' + name + '.csv';
  a.click();
}"""
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>fedmeet human evaluation</title>"
        "<style>body{font-family:sans-serif;max-width:70em;margin:auto}"
        ".pair{display:flex;gap:2em}.pair>div{flex:1;background:#f4f4f4;padding:0 1em}"
        "section{border-bottom:1px solid #ccc;padding-bottom:1em}</style></head>"
        f"<body data-kit='{esc(kit)}' data-sheet='{esc(sheet)}'>"
        "<h1>Which summary is better?</h1><p>For each item, read the query and the gold summary, then judge "
        "which of the two system summaries answers the query better (informativeness, faithfulness, fluency). "
        "The order of the systems is random. Use <i>tie</i> when neither is better.</p>"
        "<p>Annotator: <input id='annotator'> <button onclick='download()'>Download my judgements</button> "
        f"(or fill the <code>judgement</code> column of {esc(sheet)}.csv with A, B or tie)</p>"
        + "".join(items)
        + f"<script>{script}</script></body></html>"
    )


def score_sheets(sheet_dir: Path) -> dict[str, Any]:
    """Win/tie/loss of the key's target against each opponent over every filled ``sheet*.csv`` (blank: not judged)."""
    # key.json and its entries by item id; a key lacking them, or a malformed entry, is a one-line DataError
    path = sheet_dir / "key.json"
    data = read_json(path, "answer key (the report stage writes it next to the blank sheets)")
    for name, kind in (("target", str), ("kit", str), ("items", dict)):
        if not isinstance(data.get(name), kind):
            raise DataError(f"{path}: {name!r} missing or not a {kind.__name__} (not a report stage's answer key)")
    try:  # a hand edit: an entry not an object, a field missing, added or null, a target_side not A or B
        key = {item: from_dict(KeyEntry, entry, f"{path}: items[{item!r}]") for item, entry in data["items"].items()}
    except ConfigError as exc:
        raise DataError(str(exc)) from None
    files = sorted(sheet_dir.glob("sheet*.csv"))
    if not files:
        raise DataError(f"{sheet_dir}: no sheet*.csv files to score")
    judged = []  # (opponent, domain, outcome)
    unjudged, per_file = 0, {}
    for f in files:
        try:  # a stray comma, an empty file, a spreadsheet's Latin-1: pandas' errors (ValueErrors) name no file
            sheet = pd.read_csv(f, dtype=str, keep_default_na=False)
        except ValueError as exc:
            raise DataError(f"{f}: not a readable CSV sheet: {' '.join(str(exc).split())}") from exc
        if missing := sorted({"item_id", "judgement", "kit"} - set(sheet.columns)):
            raise DataError(f"{f}: missing column(s) {missing} (columns: {list(sheet.columns)})")
        per_file[f.name], seen = 0, {}  # seen: item -> its line in this sheet (one annotator judges it once)
        cells = zip(sheet["item_id"].str.strip(), sheet["judgement"].str.strip(), sheet["kit"].str.strip())
        for line_no, (item, raw, kit) in enumerate(cells, 2):
            if kit != data["kit"]:
                raise DataError(f"{f}:{line_no}: kit {kit!r}, not key.json's {data['kit']!r} (another build's sheet)")
            if item not in key:
                raise DataError(f"{f}:{line_no}: item_id {item!r} is not in the answer key")
            if item in seen:
                raise DataError(f"{f}:{line_no}: {item} is judged again (first on line {seen[item]})")
            seen[item] = line_no
            if not raw:
                unjudged += 1
                continue
            if raw.lower() not in JUDGEMENTS:
                raise DataError(f"{f}:{line_no}: judgement {raw!r} for {item}; expected A, B or tie")
            choice, entry = JUDGEMENTS[raw.lower()], key[item]
            outcome = "tie" if choice == "tie" else ("win" if choice == entry.target_side else "loss")
            judged.append((entry.opponent, entry.domain, outcome))
            per_file[f.name] += 1
    frame = pd.DataFrame(judged, columns=["opponent", "domain", "outcome"])
    # win / tie / loss counts per (opponent, domain), sorted: per opponent, and per opponent and domain
    tally = pd.crosstab([frame["opponent"], frame["domain"]], frame["outcome"])
    tally = tally.reindex(columns=list(OUTCOMES), fill_value=0)
    return {
        "target": data["target"],
        "opponents": tally.groupby(level=0).sum().assign(n=lambda t: t.sum(axis=1)).to_dict("index"),
        "by_domain": {o: t.droplevel(0).to_dict("index") for o, t in tally.groupby(level=0)},
        "unjudged": unjudged,
        "judged_per_file": per_file,
    }


def plot_results(results: dict[str, Any], path: str | Path) -> Path:
    """Stacked win/tie/loss bars (share of judged items) per opponent, ours beside the paper's
    (``results["published"]``, as the human command writes them)."""
    counts = {}  # bar label -> its win / tie / loss counts
    for opp, c in results["opponents"].items():
        counts[f"vs {opp} (ours, n={c['n']})"] = c
        if p := results["published"].get(opp):
            counts[f"vs {opp} (paper, n={sum(p.values())})"] = p
    labels, rows = list(counts), [tuple(c[o] for o in OUTCOMES) for c in counts.values()]
    fig, ax = plt.subplots(figsize=(8, 0.6 * max(len(rows), 2) + 1.2))
    left = [0.0] * len(rows)
    for j, (name, colour) in enumerate((("win", "#2a9d8f"), ("tie", "#e9c46a"), ("loss", "#e76f51"))):
        widths = [100.0 * r[j] / max(sum(r), 1) for r in rows]
        bars = ax.barh(labels, widths, left=left, color=colour, label=name)  # a count on each bar wider than 4 %
        ax.bar_label(bars, [str(r[j]) if w > 4 else "" for w, r in zip(widths, rows)], label_type="center", fontsize=8)
        left = [lft + w for lft, w in zip(left, widths)]
    ax.set(xlim=(0, 100), xlabel=f"% of judged comparisons ({results['target']} wins / ties / losses)")
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=8)
    return save(fig, Path(path))
