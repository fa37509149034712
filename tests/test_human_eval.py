"""Human-evaluation kit: blind sheets -> programmatic judgements -> win/tie/loss counts and the bar chart."""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import pytest
import yaml

from pipeline.common.schema import DataError
from pipeline.report import main as report_main
from pipeline.results.human_eval import Prediction, make_sheets, score_sheets
from pipeline.results.tables import ReportConfig

DOMAINS = ("Academic", "Committee", "Product")
METHODS = ("fedselectkd", "fedavg", "fedkd")


def predictions() -> dict[str, dict[str, Prediction]]:
    out: dict[str, dict[str, Prediction]] = {}
    for m in METHODS:
        out[m] = {}
        for d in DOMAINS:
            for meeting in range(3):
                for q in range(2):
                    ex = f"qmsum/{d}/test/M{meeting}/q{q}"
                    out[m][ex] = Prediction(f"{m}-s0", ex, d, f"summary by {m} of {ex}", f"gold of {ex}")
    return out


def read_sheet(path):
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def read_sheets(folder):
    """The rows of every sheet make_sheets wrote, sheet1.csv first."""
    return [r for f in sorted(folder.glob("sheet[0-9]*.csv")) for r in read_sheet(f)]


def write_sheet(path, rows, fields=("item_id", "judgement")):
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(fields), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def test_sheets_are_blind_and_balanced(tmp_path):
    meetings = {ex: ex.split("/")[3] for ex in predictions()["fedavg"]}
    summary = make_sheets(
        predictions(), tmp_path, ReportConfig(human_eval_per_domain=3, human_eval_seed=1), {}, meetings
    )
    assert summary["examples_per_domain"] == {d: 3 for d in DOMAINS}
    assert summary["items"] == 3 * 3 * 2 and summary["opponents"] == ["fedavg", "fedkd"]
    rows = read_sheets(tmp_path)
    text = "".join(f.read_text() for f in sorted(tmp_path.glob("sheet*.*")))
    for m in METHODS:
        assert "-s0" not in text and f"by {m} of" in text  # summaries shown, experiment names never
    assert "fedselectkd" not in "".join(r["item_id"] + r["domain"] for r in rows)
    key = json.loads((tmp_path / "key.json").read_text())["items"]
    sides = [key[r["item_id"]]["target_side"] for r in rows]
    assert set(sides) == {"A", "B"}
    # One query per meeting first: 3 picks per domain cover the 3 meetings.
    for d in DOMAINS:
        picked = {key[r["item_id"]]["example_id"].split("/")[3] for r in rows if r["domain"] == d}
        assert picked == {"M0", "M1", "M2"}
    # The shown summary on the target side is the target's.
    for r in rows:
        k = key[r["item_id"]]
        assert r[f"summary_{k['target_side']}"] == f"summary by fedselectkd of {k['example_id']}"
    # Same seed -> same sheets.
    again = tmp_path / "again"
    make_sheets(predictions(), again, ReportConfig(human_eval_per_domain=3, human_eval_seed=1), {}, meetings)
    assert [(again / f.name).read_text() for f in sorted(tmp_path.glob("sheet*.*"))] == [
        f.read_text() for f in sorted(tmp_path.glob("sheet*.*"))
    ]


def test_round_trip_counts(tmp_path):
    make_sheets(predictions(), tmp_path, ReportConfig(human_eval_per_domain=3), {}, {})
    rows = read_sheets(tmp_path)
    for f in tmp_path.glob("sheet*.csv"):  # one annotator's judgements of every item, in one file
        f.unlink()
    key = json.loads((tmp_path / "key.json").read_text())["items"]
    other = {"A": "B", "B": "A"}
    fedavg_items = sorted(r["item_id"] for r in rows if key[r["item_id"]]["opponent"] == "fedavg")
    fedkd_items = sorted(r["item_id"] for r in rows if key[r["item_id"]]["opponent"] == "fedkd")
    judgement = {}
    # vs fedavg (9 items): 1 tie, 1 loss, 7 wins.  vs fedkd: 8 ties, 1 left blank.
    judgement[fedavg_items[0]] = "tie"
    judgement[fedavg_items[1]] = other[key[fedavg_items[1]]["target_side"]].lower()
    for item in fedavg_items[2:]:
        judgement[item] = key[item]["target_side"]
    for item in fedkd_items[:-1]:
        judgement[item] = "TIE"
    for r in rows:
        r["judgement"] = judgement.get(r["item_id"], "")
    write_sheet(tmp_path / "sheet.csv", rows, fields=list(rows[0]))
    # A second annotator, in the HTML page's download format (item_id, judgement, kit): SelectKD always wins.
    kit = rows[0]["kit"]
    bob = [{"item_id": i, "judgement": key[i]["target_side"], "kit": kit} for i in fedavg_items]
    write_sheet(tmp_path / "sheet_bob.csv", bob, fields=("item_id", "judgement", "kit"))

    results = score_sheets(tmp_path)
    assert results["target"] == "fedselectkd"
    assert results["opponents"]["fedavg"] == {"win": 7 + 9, "tie": 1, "loss": 1, "n": 18}
    assert results["opponents"]["fedkd"] == {"win": 0, "tie": 8, "loss": 0, "n": 8}
    assert results["unjudged"] == 1
    assert results["judged_per_file"] == {"sheet.csv": 17, "sheet_bob.csv": 9}
    assert sum(v["win"] for v in results["by_domain"]["fedavg"].values()) == 16

    # The CLI writes results.json and the chart (with the paper's 52/4/4 beside ours).
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"report": {}}))
    out = tmp_path / "out"
    assert report_main(["--params", str(params), "human", "--sheets", str(tmp_path), "--out", str(out)]) == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["opponents"]["fedavg"]["win"] == 16
    assert saved["published"]["fedavg"] == {"win": 52, "tie": 4, "loss": 4}
    assert (out / "human_eval.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_judgement_names_file_and_line(tmp_path):
    make_sheets(predictions(), tmp_path, ReportConfig(human_eval_per_domain=1), {}, {})
    rows = read_sheet(tmp_path / "sheet1.csv")
    rows[1]["judgement"] = "maybe"
    write_sheet(tmp_path / "sheet1.csv", rows, fields=list(rows[0]))
    with pytest.raises(DataError, match=r"sheet1\.csv:3: judgement 'maybe'"):
        score_sheets(tmp_path)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (b"item_id,judgement\r\nitem0001,A\r\nitem0002,B,extra\r\n", r"line 3"),  # a stray comma: 3 fields, not 2
        (b"", r"[Nn]o columns"),  # saved empty
        (b"item_id,judgement\nitem0001,\xe9gal\n", r"utf-8"),  # saved as Latin-1 by a spreadsheet
    ],
)
def test_malformed_sheet_is_one_line_naming_the_file(tmp_path, text, problem):
    make_sheets(predictions(), tmp_path, ReportConfig(human_eval_per_domain=1), {}, {})
    (tmp_path / "sheet_ann.csv").write_bytes(text)
    with pytest.raises(DataError, match=rf"sheet_ann\.csv: .*{problem}"):
        score_sheets(tmp_path)


def test_an_item_twice_in_one_sheet_is_an_error(tmp_path):
    # One annotator's sheet judging an item twice (rows pasted twice) must not count it twice: 1 judged item, not 2.
    make_sheets(predictions(), tmp_path, ReportConfig(human_eval_per_domain=1), {}, {})
    first = read_sheet(tmp_path / "sheet1.csv")[0]
    write_sheet(tmp_path / "sheet_ann.csv", [first | {"judgement": "A"}, first | {"judgement": "B"}], list(first))
    first = first["item_id"]
    with pytest.raises(DataError, match=rf"sheet_ann\.csv:3: {first} is judged again \(first on line 2\)"):
        score_sheets(tmp_path)


def test_the_runs_are_the_lowest_seed_at_which_the_target_and_an_opponent_have_predictions(tmp_path):
    # SelectKD evaluated at seed 1 only, FedAvg at seeds 0 and 1: the sheets compare the seed-1 runs (seed 0 has no
    # SelectKD, so taking it made no sheets at all although seed 1 has both)
    from pipeline.experiments.entries import Experiment
    from pipeline.results.human_eval import predictions_by_method

    planned = [
        Experiment(name=f"{m}-s{s}", method=m, partition="domain/seed0", seed=s, **({"tau": 5.0} if kd else {}))
        for m, kd, seeds in (("fedavg", False, (0, 1)), ("fedselectkd", True, (1,)))
        for s in seeds
    ]
    for p in planned:
        (tmp_path / p.name).mkdir()
        record = {"experiment": p.name, "example_id": "e1", "domain": "Academic", "prediction": "x", "reference": "y"}
        (tmp_path / p.name / "predictions.jsonl").write_text(json.dumps(record) + "\n")
    preds, seed = predictions_by_method(planned, tmp_path, ReportConfig().human_eval_target)
    assert seed == 1 and {m: p["e1"].experiment for m, p in preds.items()} == {
        "fedavg": "fedavg-s1",
        "fedselectkd": "fedselectkd-s1",
    }
    assert make_sheets(preds, tmp_path / "kit", ReportConfig(), {}, {}, seed)["run_seed"] == 1  # the kit says which


def test_the_case_study_uses_the_lowest_seed_at_which_fedavg_and_selectkd_both_have_predictions(tmp_path):
    # SelectKD at seeds 0 and 1, FedKD at 0, FedAvg at 1 only (METHOD.md 7.11: FedAvg, SelectKD and the gold summary
    # per domain): the sheets take seed 0 (SelectKD against FedKD), the case study seed 1, the one seed with both
    from pipeline.paths import ProjectPaths
    from pipeline.report import report_inputs
    from pipeline.results.outputs import build_report

    experiments = {}
    for m, s in (("fedselectkd", 0), ("fedselectkd", 1), ("fedkd", 0), ("fedavg", 1)):
        experiments[name := f"{m}-s{s}"] = {"method": m, "partition": "domain/seed0", "seed": s, "study": "main"}
        (d := tmp_path / "reports/eval" / name).mkdir(parents=True)
        rows = [
            {"experiment": name, "example_id": f"{x}/e1", "domain": x, "prediction": name, "reference": "g"}
            for x in DOMAINS
        ]
        (d / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    index = build_report(report_inputs({"tau": 5.0, "experiments": experiments}), ProjectPaths(tmp_path))
    assert "case study" not in index["not_made"]
    case = (tmp_path / "reports/tables/case_study.md").read_text()
    assert case.count("`fedavg-s1`") == case.count("`fedselectkd-s1`") == 3 and "fedselectkd-s0" not in case
    assert json.loads((tmp_path / "reports/human_eval/sheets/summary.json").read_text())["run_seed"] == 0


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda k: k.pop("target"), r"key\.json: 'target' missing or not a str"),
        (lambda k: k.pop("kit"), r"key\.json: 'kit' missing or not a str"),  # a key written before kits had ids
        (lambda k: k.pop("items"), r"key\.json: 'items' missing or not a dict"),
        (lambda k: k.update(items=[]), r"key\.json: 'items' missing or not a dict"),
        (lambda k: k["items"].update(item0001="A"), r"key\.json: items\['item0001'\]: expected a mapping of keys"),
        (  # KeyEntry's seven fields less target_side
            lambda k: k["items"]["item0001"].pop("target_side"),
            r"key\.json: items\['item0001'\]: missing required key\(s\) \['target_side'\]",
        ),
        (
            lambda k: k["items"]["item0001"].update(target_side="C"),
            r"key\.json: items\['item0001'\]\.target_side='C' is out of range; allowed: one of 'A' or 'B'",
        ),
        # a judgement of a null domain (or opponent) was dropped from the counts (pandas' crosstab leaves NaN out)
        (
            lambda k: k["items"]["item0001"].update(domain=None),
            r"key\.json: items\['item0001'\]\.domain: expected a string, got NoneType None",
        ),
        (
            lambda k: k["items"]["item0001"].update(extra=1),
            r"key\.json: items\['item0001'\]: unknown key\(s\) \['extra'\]; allowed: \['domain', 'example_id'",
        ),
    ],
)
def test_a_malformed_key_is_one_line_naming_the_file_and_item(tmp_path, edit, problem):
    make_sheets(predictions(), tmp_path, ReportConfig(human_eval_per_domain=1), {}, {})
    key = json.loads((tmp_path / "key.json").read_text())
    edit(key)
    (tmp_path / "key.json").write_text(json.dumps(key))
    with pytest.raises(DataError, match=problem):
        score_sheets(tmp_path)


def test_a_sheet_of_another_kit_is_refused_in_one_line_naming_it(tmp_path):
    # Kits of another human_eval_seed (another key) and of another build (one summary changed, same key) share the
    # item ids item0001..: their filled sheets were scored against this key's sides, silently. Each sheet row and the
    # HTML page's download carry the kit's id (key.json's), and a sheet of another kit is refused.
    make_sheets(predictions(), tmp_path, ReportConfig(human_eval_per_domain=1), {}, {})
    other_seed, other_build = tmp_path / "seed1", tmp_path / "build2"
    make_sheets(predictions(), other_seed, ReportConfig(human_eval_per_domain=1, human_eval_seed=1), {}, {})
    rebuilt = predictions()
    rebuilt["fedavg"] = {ex: replace(p, prediction=f"retrained {p.prediction}") for ex, p in rebuilt["fedavg"].items()}
    make_sheets(rebuilt, other_build, ReportConfig(human_eval_per_domain=1), {}, {})
    kit = json.loads((tmp_path / "key.json").read_text())["kit"]
    assert {r["kit"] for r in read_sheets(tmp_path)} == {kit}
    assert f"data-kit='{kit}'" in (page := (tmp_path / "sheet2.html").read_text()) and "item_id,judgement,kit" in page
    for other in (other_seed, other_build):
        other_kit = json.loads((other / "key.json").read_text())["kit"]
        assert other_kit != kit
        rows = [r | {"judgement": "A"} for r in read_sheets(other)]
        write_sheet(tmp_path / "sheet_other.csv", rows, fields=list(rows[0]))
        with pytest.raises(DataError, match=rf"sheet_other\.csv:2: kit '{other_kit}', not key\.json's '{kit}'"):
            score_sheets(tmp_path)
    # The HTML page's download (item_id, judgement, kit) of this kit is scored
    write_sheet(
        tmp_path / "sheet_other.csv",
        [{"item_id": "item0001", "judgement": "tie", "kit": kit}],
        ("item_id", "judgement", "kit"),
    )
    assert score_sheets(tmp_path)["judged_per_file"]["sheet_other.csv"] == 1


@pytest.mark.parametrize("head", ["000123456789", "1234567890e1"])
def test_a_kit_a_spreadsheet_reads_as_a_number_is_not_the_kits_id(tmp_path, monkeypatch, head):
    """The kit's id is hex: one of digits only (000123456789) or digits around one e (1234567890e1, 1.2e10) is a
    number to a spreadsheet (here pandas' type inference), which saves the filled sheet with 123456789 or
    12345678900.0 in every kit cell: all refused as another build's sheet. The sha256 is made to start so."""
    import hashlib
    import types

    import pandas as pd

    from pipeline.results import human_eval

    def sha256(data: bytes):
        return types.SimpleNamespace(hexdigest=lambda: head + hashlib.sha256(data).hexdigest()[12:])

    monkeypatch.setattr(human_eval, "hashlib", types.SimpleNamespace(sha256=sha256))
    make_sheets(predictions(), tmp_path, ReportConfig(human_eval_per_domain=1), {}, {})
    for sheet in tmp_path.glob("sheet*.csv"):
        saved = pd.read_csv(sheet, keep_default_na=False)  # each column's type inferred
        saved["judgement"] = "A"
        saved.to_csv(sheet, index=False)
    assert score_sheets(tmp_path)["unjudged"] == 0


def test_the_reports_readme_says_a_filled_sheet_keeps_its_kit_column(tmp_path):
    # score_sheets refuses a sheet without the kit column (a missing column), so the index's instructions for filling
    # the sheets, what an annotator or the person collecting the sheets reads, must say that the column stays.
    from pipeline.results.outputs import readme

    index = {"made": {}, "not_made": {}, "missing_experiments": [], "ignored_evaluations": [], "incomplete_seeds": []}
    section = readme(index, 0, tmp_path).split("## Human evaluation", 1)[1]
    assert "keep the `kit` column" in section
    make_sheets(predictions(), tmp_path, ReportConfig(human_eval_per_domain=1), {}, {})
    rows = [{k: v for k, v in r.items() if k != "kit"} | {"judgement": "A"} for r in read_sheets(tmp_path)]
    write_sheet(tmp_path / "sheet_dropped.csv", rows, fields=list(rows[0]))
    with pytest.raises(DataError, match=r"sheet_dropped\.csv: missing column\(s\) \['kit'\]"):
        score_sheets(tmp_path)


def test_no_sheet_shows_an_example_twice(tmp_path):
    # One sheet held every (example, opponent) pair: the target's summary of an example was the text repeated in each
    # of its items, the opponents' differed, so an annotator saw which side was SelectKD (the committed kit: 64 of its
    # 96 items told, none wrong). Each sheet now shows an example once, every pair still in one of the sheets.
    make_sheets(predictions(), tmp_path, ReportConfig(human_eval_per_domain=3), {}, {})
    key = json.loads((tmp_path / "key.json").read_text())["items"]
    pairs = []
    for sheet in sorted(tmp_path.glob("sheet*.csv")):
        shown = [key[r["item_id"]]["example_id"] for r in read_sheet(sheet)]
        assert len(shown) == len(set(shown)) == 9, sheet.name
        pairs += [(key[r["item_id"]]["example_id"], key[r["item_id"]]["opponent"]) for r in read_sheet(sheet)]
    assert len(pairs) == len(set(pairs)) == 9 * 2 and {p[1] for p in pairs} == {"fedavg", "fedkd"}


def test_items_are_numbered_in_reading_order_across_the_sheets(tmp_path):
    # An annotator or coordinator finds "item 12" by counting: sheet1 holds item0001.., the next sheet goes on where
    # the last stopped, and each sheet's page shows the items of its csv.
    make_sheets(predictions(), tmp_path, ReportConfig(human_eval_per_domain=3, human_eval_seed=2), {}, {})
    ids = [r["item_id"] for r in read_sheets(tmp_path)]
    assert ids == [f"item{i:04d}" for i in range(1, 9 * 2 + 1)]
    for sheet in sorted(tmp_path.glob("sheet[0-9]*.csv")):
        page = sheet.with_suffix(".html").read_text()
        assert all(r["item_id"] in page for r in read_sheet(sheet)), sheet.name
