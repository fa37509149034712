"""KD usage ratio and the analyze stage on hand-made gate logs, POS tags and metrics."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import yaml

from pipeline import analyze
from pipeline.common.schema import DataError
from pipeline.results.claims import backbone_note
from pipeline.results.kd_analysis import SELECTKD, kd_usage, word_updates

NA = None
# Paper's worked example "project manager decides to use lcd" as BPE pieces; label positions 0..9.
# (position, token_id, word_index, word, pos)
PRODUCT_TOKENS = [
    (0, 0, NA, NA, NA),  # <s>
    (1, 101, 0, "project", "NOUN"),
    (2, 102, 1, "manager", "NOUN"),  # Ġman
    (3, 103, 1, "manager", "NOUN"),  # ager
    (4, 104, 2, "decides", "VERB"),
    (5, 105, 3, "to", "PART"),
    (6, 106, 4, "use", "VERB"),
    (7, 107, 5, "lcd", "NOUN"),  # Ġl
    (8, 108, 5, "lcd", "NOUN"),  # cd
    (9, 2, NA, NA, NA),  # </s>
]
# KD applied per round (token positions); with rule "first" the KD word updates are: round 1 project and lcd,
# round 2 manager -> 3 of 6 words x 2 rounds = 25 %. Round 3 is after the best round (2) and must not count.
PRODUCT_KD = {1: {0, 1, 3, 7, 8}, 2: {2, 9}, 3: set(range(10))}
ACADEMIC_TOKENS = [
    (0, 0, NA, NA, NA),
    (1, 201, 0, "the", "DET"),
    (2, 202, 1, "professor", "NOUN"),
    (3, 203, 2, "presented", "VERB"),  # Ġpresent
    (4, 204, 2, "presented", "VERB"),  # ed
    (5, 205, 3, "results", "NOUN"),
    (6, 2, NA, NA, NA),
]
# best round 1: professor, presented, results with KD, "the" without -> 3 / 4
ACADEMIC_KD = {1: {2, 3, 5}, 2: {1, 2}}
NOUN_VERB = {"NOUN", "PROPN", "VERB"}


def postags_table() -> pd.DataFrame:
    rows = []
    for eid, toks in (("p1", PRODUCT_TOKENS), ("a1", ACADEMIC_TOKENS)):
        for pos_i, tid, w, word, pos in toks:
            rows.append(
                {
                    "example_id": eid,
                    "position": pos_i,
                    "token_id": tid,
                    "word_index": w,
                    "word": word,
                    "pos": pos,
                    "is_noun_or_verb": pos in NOUN_VERB,
                }
            )
    t = pd.DataFrame(rows)
    t["word_index"] = t["word_index"].astype("Int32")
    return t


def gate_log(epochs: int = 1) -> pd.DataFrame:
    rows = []
    for client, eid, toks, kd in (
        ("Product", "p1", PRODUCT_TOKENS, PRODUCT_KD),
        ("Academic", "a1", ACADEMIC_TOKENS, ACADEMIC_KD),
    ):
        for rnd, kd_positions in kd.items():
            for _ in range(epochs):
                for pos_i, tid, *_ in toks:
                    on = pos_i in kd_positions
                    rows.append(
                        {
                            "client": client,
                            "round": rnd,
                            "example_id": eid,
                            "position": pos_i,
                            "token_id": tid,
                            "entropy": 1.0 if on else 7.0,
                            "kd_applied": on,
                        }
                    )
    return pd.DataFrame(rows)


def product_updates(rule: str, epochs: int = 1) -> pd.DataFrame:
    wu = word_updates(gate_log(epochs), postags_table(), rule)
    return wu[wu["client"] == "Product"]


def test_paper_worked_example_25_percent():
    usage = kd_usage(product_updates("first"), best_round=2)
    assert (usage["kd_word_updates"], usage["word_updates"]) == (3, 12)
    assert usage["kd_usage_ratio"] == pytest.approx(0.25)


@pytest.mark.parametrize("rule,kd", [("first", 3), ("any", 4), ("all", 2), ("majority", 2)])
def test_word_rules(rule, kd):
    # any: manager also KD in round 1 (its "ager" piece); all/majority: manager needs both pieces.
    usage = kd_usage(product_updates(rule), best_round=2)
    assert (usage["kd_word_updates"], usage["word_updates"]) == (kd, 12)


def test_local_epochs_count_once():
    wu = word_updates(gate_log(epochs=3), postags_table(), "first")
    usage = kd_usage(wu[wu["client"] == "Product"], 2)
    assert (usage["kd_word_updates"], usage["word_updates"]) == (3, 12)
    # tokens: Product 10 positions x 3 rounds + Academic 7 x 2; no-word tokens (2 per example per round) are no word
    # update: 34 word tokens, one row per word and round, its tokens counted once however many epochs logged them
    assert wu["n_tokens"].sum() == 44 - 10 and wu.equals(word_updates(gate_log(epochs=1), postags_table(), "first"))


def test_token_mismatch_is_an_error():
    gate = gate_log()
    gate.loc[gate["position"] == 4, "token_id"] = 999
    with pytest.raises(DataError, match="differ from"):
        word_updates(gate, postags_table(), "first", "models/x/gate_log.parquet")
    with pytest.raises(DataError, match="no POS tag"):
        word_updates(gate_log(), postags_table()[lambda t: t["example_id"] != "a1"], "first")


def test_a_clients_pos_pattern_pools_its_seeds_word_updates_where_its_kd_usage_is_their_mean():
    """One client over two seeds (best round 1 in both), by hand. Seed 0, 4 word updates: NOUN and VERB with KD, DET
    and NOUN without; seed 1, 8: VERB twice with KD, NOUN five times and PRON without. The KD usage ratio is the
    mean of the seeds' (2/4, 2/8); the POS numbers are ratios of the seeds' pooled counts, where the mean of the
    seeds' ratios differs: DET/PRON are 2 of 8 non-KD updates (not (1/2 + 1/6) / 2 = 1/3), nouns and verbs 4 of 10
    with KD (not (2/3 + 2/7) / 2 = 0.48)."""
    from pipeline.results.kd_analysis import client_summary

    seeds = {
        "s0": [("NOUN", True), ("VERB", True), ("DET", False), ("NOUN", False)],
        "s1": [("VERB", True)] * 2 + [("NOUN", False)] * 5 + [("PRON", False)],
    }
    row = {"client": "Product", "round": 1, "example_id": "p1"}
    words = pd.DataFrame(
        row | {"experiment": e, "word_index": i, "kd": kd, "pos": pos, "is_noun_or_verb": pos in NOUN_VERB}
        for e, updates in seeds.items()
        for i, (pos, kd) in enumerate(updates)
    )
    gate = pd.DataFrame(row | {"experiment": e, "position": 1, "kd_applied": True, "entropy": 1.0} for e in seeds)
    per_seed = {"s0": {"best_round": 1, "kd_usage_ratio": 2 / 4}, "s1": {"best_round": 1, "kd_usage_ratio": 2 / 8}}
    record, _ = client_summary("Product", words, gate, per_seed, None)
    assert record["kd_usage_ratio"] == pytest.approx(3 / 8)  # the seeds' mean; pooled it would be 4 / 12
    assert record["det_pron_share_of_no_kd"] == pytest.approx(2 / 8)
    assert record["noun_verb_kd_rate"] == pytest.approx(4 / 10)
    # NOUN: 1 of the 4 KD updates, 6 of the 8 non-KD ones (the seeds' shares of non-KD: 1/2 and 5/6)
    assert record["pos"]["NOUN"] == pytest.approx(
        {"kd": 1, "no_kd": 6, "kd_rate": 1 / 7, "share_of_kd": 1 / 4, "share_of_no_kd": 6 / 8}
    )


def write_experiment(root, name, clients_best, scores, gate=True):
    if gate:
        (root / "models" / name).mkdir(parents=True)
        gate_log().to_parquet(root / "models" / name / "gate_log.parquet")
    if clients_best is not None:
        (root / "reports/train" / name).mkdir(parents=True)
        (root / "reports/train" / name / "metrics.json").write_text(
            json.dumps({"clients": {c: {"best_round": b} for c, b in clients_best.items()}})
        )
    (root / "reports/eval" / name).mkdir(parents=True)
    (root / "reports/eval" / name / "metrics.json").write_text(
        json.dumps(
            {
                "clients": {
                    c: {
                        "rouge1": r1,
                        "rouge2": r2,
                        "rougeL": rl,
                        "rougeLsum": rl,
                        "avg_rouge": (r1 + r2 + rl) / 3,
                        "n": 5,
                    }
                    for c, (r1, r2, rl) in scores.items()
                }
            }
        )
    )


def test_stage_on_synthetic_mini_experiment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    best = {"Product": 2, "Academic": 1}
    write_experiment(tmp_path, "sel_s0", best, {"Product": (30, 10, 20), "Academic": (24, 6, 18)})
    write_experiment(tmp_path, "hard_s0", None, {"Product": (27, 9, 18), "Academic": (24, 3, 15)}, gate=False)
    write_experiment(tmp_path, "tau3_s0", best, {"Product": (21, 6, 15), "Academic": (21, 3, 12)})
    (tmp_path / "data/processed").mkdir(parents=True)
    postags_table().to_parquet(tmp_path / "data/processed/postags.parquet")
    params = {
        "tau": 5.0,
        "analyze": {"word_rule": "first"},
        "experiments": {
            "sel_s0": {"method": "fedselectkd", "partition": "domain/seed0", "seed": 0, "study": "main"},
            "sel_s1": {"method": "fedselectkd", "partition": "domain/seed1", "seed": 1, "study": "main"},
            "hard_s0": {"method": "hardkd", "partition": "domain/seed0", "seed": 0, "study": "main"},
            "tau3_s0": {
                "method": "fedselectkd",
                "partition": "domain/seed0",
                "seed": 0,
                "study": "tau_sweep",
                "tau": 3.0,
            },
            "avg_s0": {"method": "fedavg", "partition": "domain/seed0", "seed": 0, "study": "main"},
        },
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    analyze.main([])

    out = tmp_path / "reports/analysis"
    for fig in (
        "pos_Product",
        "pos_Academic",
        "entropy_Product",
        "entropy_Academic",
        "hardkd_vs_selectkd",
        "tau_sweep",
    ):
        assert (out / "figures" / f"{fig}.png").stat().st_size > 1000
    res = json.loads((out / "kd_analysis.json").read_text())
    prod, acad = res["clients"]["Product"], res["clients"]["Academic"]
    assert prod["kd_usage_ratio"] == pytest.approx(0.25) and prod["paper_kd_usage_ratio"] == 0.89
    assert acad["kd_usage_ratio"] == pytest.approx(0.75)
    # Product, rounds 1-2: nouns/verbs 10 word updates, 3 with KD; no DET/PRON among the 9 non-KD updates.
    assert prod["noun_verb_kd_rate"] == pytest.approx(0.3) and prod["det_pron_share_of_no_kd"] == 0
    assert prod["pos"]["NOUN"] == {
        "kd": 3,
        "no_kd": 3,
        "kd_rate": 0.5,
        "share_of_kd": 1.0,
        "share_of_no_kd": pytest.approx(3 / 9),
    }
    # Academic, round 1 only: "the" is the one non-KD word.
    assert acad["det_pron_share_of_no_kd"] == 1.0 and acad["noun_verb_kd_rate"] == 1.0
    # gate: fraction of tokens with KD per round (all logged rounds), consistent with tau = 5
    assert prod["gate_pass_fraction_per_round"] == {"1": 0.5, "2": 0.2, "3": 1.0}
    assert prod["gate_inconsistent_tokens"] == 0
    hard = res["hardkd_vs_selectkd"]
    assert hard["hardkd_minus_selectkd_avg_rouge"]["Product"] == pytest.approx(18 - 20)
    points = {(p["client"], p["tau"]): p for p in res["tau_sweep"]["points"]}
    assert set(points) == {("Academic", 3.0), ("Academic", 5.0), ("Product", 3.0), ("Product", 5.0)}
    assert points[("Product", 3.0)]["avg_rouge"] == pytest.approx(14) and points[("Product", 5.0)]["avg_rouge"] == 20
    assert points[("Product", 3.0)]["kd_usage_ratio"] == pytest.approx(0.25)
    csv = pd.read_csv(out / "tau_sweep.csv")
    assert (
        list(csv.columns)
        == ["client", "tau", "avg_rouge", "kd_usage_ratio", "noun_verb_kd_rate", "det_pron_share_of_no_kd", "n_seeds"]
        and len(csv) == 4
    )
    assert res["tau_sweep"]["portable_gates"] == []  # every gate here is in nats
    # sel_s1 has no files at all: reported, not invented; fedavg is not an input of the analysis
    missing = {(m["experiment"], m["file"]) for m in res["missing"]}
    assert missing == {
        ("sel_s1", "models/sel_s1/gate_log.parquet"),
        ("sel_s1", "reports/train/sel_s1/metrics.json"),
        ("sel_s1", "reports/eval/sel_s1/metrics.json"),
    }
    assert prod["experiments"] == ["sel_s0"]


def test_portable_gates_are_read_from_the_entry_or_the_train_group():
    from pipeline.planning import declared

    params = {
        "tau": 5.0,
        "train": {"tau_scale": "absolute"},
        "experiments": {
            "a": {"method": "fedselectkd", "partition": "domain/seed0"},
            "b": {"method": "fedselectkd", "partition": "domain/seed0", "tau": 0.87, "tau_scale": "batch_quantile"},
            "c": {"method": "fedavg", "partition": "domain/seed0"},
        },
    }
    got = {e.name: (e.tau, e.tau_scale) for e in declared(params)}
    assert got == {"a": (5.0, "absolute"), "b": (0.87, "batch_quantile"), "c": (None, "absolute")}


def test_read_json_reports_a_missing_or_bad_file_in_one_line(tmp_path):
    from pipeline.results.readers import read_json

    with pytest.raises(DataError, match=r"x\.json: train metrics not found$"):
        read_json(tmp_path / "x.json", "train metrics")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(DataError, match=r"bad\.json: not valid JSON \("):
        read_json(tmp_path / "bad.json", "train metrics")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe{}")  # not UTF-8: was a UnicodeDecodeError traceback
    with pytest.raises(DataError, match=r"binary\.json: not valid JSON \(.*can't decode byte 0xff"):
        read_json(tmp_path / "binary.json", "train metrics")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(DataError, match=r"list\.json: expected a JSON object \(train metrics\)$"):
        read_json(tmp_path / "list.json", "train metrics")
    (tmp_path / "ok.json").write_text('{"clients": {}}')
    assert read_json(tmp_path / "ok.json") == {"clients": {}}


def _analyze_one_selectkd_run(root, best_rounds, entry=None, **params):
    """The analyze stage (in ``root``, the working directory) over one main-study SelectKD run whose clients' best
    rounds are ``best_rounds`` (``entry``: its own keys); ``params`` at the top of params.yaml. Its kd_analysis.json."""
    write_experiment(root, "sel_s0", best_rounds, {"Product": (30, 10, 20), "Academic": (24, 6, 18)})
    (root / "data/processed").mkdir(parents=True)
    postags_table().to_parquet(root / "data/processed/postags.parquet")
    run = {"method": "fedselectkd", "partition": "domain/seed0", "seed": 0, "study": "main"} | (entry or {})
    (root / "params.yaml").write_text(yaml.safe_dump(params | {"experiments": {"sel_s0": run}}))
    analyze.main([])
    return json.loads((root / "reports/analysis/kd_analysis.json").read_text())


def test_a_portable_main_gate_is_not_checked_as_an_entropy(tmp_path, monkeypatch):
    # The main study reads tau 0.46 as a share of ln|V| (train.tau_scale max_entropy): on BART's 50,265 tokens its
    # threshold is 0.46 x 10.83 = 4.98 nats, so the log (KD at H = 1, none at H = 7) is consistent; H < 0.46 would call
    # every KD token inconsistent, and the entropy figure would draw "tau = 0.46" on a nats axis.
    monkeypatch.chdir(tmp_path)
    res = _analyze_one_selectkd_run(
        tmp_path, {"Product": 2, "Academic": 1}, tau=0.46, train={"tau_scale": "max_entropy"}
    )
    assert 0.46 * math.log(50265) == pytest.approx(4.98, abs=0.01)
    for client in ("Product", "Academic"):
        assert res["clients"][client]["gate_inconsistent_tokens"] is None  # not checkable here; never a false count
    # nor does the results text quote its KD usage "at tau = 0.46", an entropy it is not
    assert res["tau"] is None and "of target words, the paper's" in backbone_note({"name": "b"}, res)


def test_the_kd_record_and_the_results_text_give_the_main_runs_tau(tmp_path, monkeypatch):
    # The KD usage kd_analysis.json holds and the results text quotes is the main study's SelectKD runs', at their
    # tau: here the entry's own 3.0 nats, not the top-level 5.0 (which no main run reads).
    monkeypatch.chdir(tmp_path)
    res = _analyze_one_selectkd_run(tmp_path, {"Product": 2, "Academic": 1}, {"tau": 3.0}, tau=5.0)
    assert res["tau"] == 3.0 and "of target words at tau = 3.0 nats, the paper's" in backbone_note({"name": "b"}, res)


def test_the_kd_record_and_the_results_text_give_the_main_runs_tau_in_its_unit(tmp_path, monkeypatch):
    # An absolute threshold is in the unit of H(q_g), train.entropy_log_base's: e (nats, the default) or 2 (bits);
    # tau = 5 bits is the gate H_nats < 5 ln 2 = 3.47, so "at tau = 5.0" alone names no gate.
    monkeypatch.chdir(tmp_path)
    res = _analyze_one_selectkd_run(tmp_path, {"Product": 2, "Academic": 1}, {"entropy_log_base": 2}, tau=5.0)
    assert (res["tau"], res["tau_unit"]) == (5.0, "bits")
    assert "of target words at tau = 5.0 bits, the paper's" in backbone_note({"name": "b"}, res)


@pytest.mark.parametrize(
    "train, tau, unit, legend",
    [
        ({}, 5.0, "nats", "tau = 5 nats"),  # log base e: nats (the default)
        ({"entropy_log_base": 2}, 5.0, "bits", "tau = 5 bits"),  # log base 2: bits
        ({"tau_scale": "max_entropy"}, 0.46, "nats", None),  # a share of ln|V|: no tau line; H(q_g) still in nats
    ],
)
def test_the_entropy_figure_gives_the_unit_of_h_and_tau(tmp_path, monkeypatch, train, tau, unit, legend):
    # H(q_g) is logged in train.entropy_log_base's unit, and an absolute tau is in it: 5 bits is 3.47 nats, so an
    # axis "H(q_g)" and a line "tau = 5" name no gate. The figure's axis and legend say the unit.
    from pipeline.results import kd_analysis

    drawn, save = {}, kd_analysis.save

    def keep(fig, path):
        ax = fig.axes[0]
        drawn[path.stem] = (ax.get_ylabel(), [t.get_text() for t in ax.get_legend().texts] if ax.get_legend() else [])
        return save(fig, path)

    monkeypatch.setattr(kd_analysis, "save", keep)
    monkeypatch.chdir(tmp_path)
    _analyze_one_selectkd_run(tmp_path, {"Product": 2, "Academic": 1}, tau=tau, train=train)
    for client in ("Product", "Academic"):
        assert drawn[f"entropy_{client}"] == (f"H(q_g) ({unit})", [legend] if legend else [])


def test_a_threshold_in_bits_is_placed_in_nats_on_the_sweep_axis():
    # 5 nats (main, ROUGE 20) and 5 bits (ROUGE 14) are different gates: H_bits < 5 is H_nats < 5 ln 2 = 3.466. They
    # must be two points, not one averaged point at tau 5 (17, "1 seed").
    from pipeline.planning import declared
    from pipeline.results.kd_analysis import SWEEP_COLUMNS, tau_sweep_rows, tau_sweep_summary

    params = {
        "tau": 5.0,
        "experiments": {
            "main": {"method": "fedselectkd", "partition": "domain/seed0", "seed": 0},
            "bits": {"method": "fedselectkd", "partition": "domain/seed0", "seed": 0, "study": "tau_sweep"}
            | {"entropy_log_base": 2},
        },
    }
    runs = {e.name: e for e in declared(params)}
    words = pd.DataFrame(
        {"client": "A", "round": 1, "kd": [True, False], "is_noun_or_verb": [True, False], "pos": ["NOUN", "DET"]}
    )
    usage = {"words": words, "clients": {"A": {"best_round": 1, "kd_usage_ratio": 0.5}}}
    rows = [
        r
        for n, rouge in (("main", 20.0), ("bits", 14.0))
        for r in tau_sweep_rows(runs[n], usage, {"A": {"avg_rouge": rouge}})
    ]
    table, _ = tau_sweep_summary(pd.DataFrame(rows, columns=SWEEP_COLUMNS))
    assert table["tau"].tolist() == pytest.approx([5 * math.log(2), 5.0]) and table["avg_rouge"].tolist() == [14, 20]


def test_a_client_without_a_best_round_is_reported_not_a_crash(tmp_path, monkeypatch, capsys):
    # Product never had a validation loss (every round NaN or failed): record_run leaves best_round 0, so its window
    # 1..0 holds no word update and its KD usage ratio is undefined (null in kd_analysis.json). The stage still
    # prints every client's line and ends normally; Academic's 3 of 4 word updates are 75 %.
    monkeypatch.chdir(tmp_path)
    res = _analyze_one_selectkd_run(tmp_path, {"Product": 0, "Academic": 1}, tau=5.0)
    assert res["clients"]["Product"]["kd_usage_ratio"] is None
    out = capsys.readouterr().out
    assert "analyze: Academic: KD usage 75.0 % (paper 86 %)" in out
    assert "analyze: Product: KD usage undefined (no word update in 1..best) (paper 89 %)" in out


def test_an_evaluation_without_any_client_scores_is_an_error_naming_its_file(tmp_path, monkeypatch):
    # An evaluation record with no client's ROUGE (an interrupted or hand-edited metrics.json) cannot feed hard KD vs
    # SelectKD or the tau sweep: the stage stops on one DataError naming that file, never a KeyError or empty figure.
    from pipeline.common.schema import DataError

    monkeypatch.chdir(tmp_path)
    original = write_experiment

    def without_scores(root, name, *args, **kw):
        original(root, name, *args, **kw)
        (root / "reports/eval" / name / "metrics.json").write_text(json.dumps({"clients": {}}))

    monkeypatch.setitem(globals(), "write_experiment", without_scores)
    with pytest.raises(DataError, match=r"reports/eval/sel_s0/metrics\.json: no client has ROUGE scores$"):
        _analyze_one_selectkd_run(tmp_path, {"Product": 1, "Academic": 1}, tau=5.0)


def test_a_damaged_pos_tag_table_is_one_error_naming_it(tmp_path, monkeypatch):
    # The postag stage's table cut short on disk: one DataError naming it, not pyarrow's traceback.
    from pipeline.common.schema import DataError

    monkeypatch.chdir(tmp_path)
    write_experiment(
        tmp_path, "sel_s0", {"Product": 1, "Academic": 1}, {"Product": (30, 10, 20), "Academic": (24, 6, 18)}
    )
    (tmp_path / "data/processed").mkdir(parents=True)
    postags_table().to_parquet(path := tmp_path / "data/processed/postags.parquet")
    path.write_bytes(path.read_bytes()[:100])
    run = {"method": "fedselectkd", "partition": "domain/seed0", "seed": 0, "study": "main"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"tau": 5.0, "experiments": {"sel_s0": run}}))
    with pytest.raises(DataError, match=r"^data/processed/postags\.parquet: not a readable POS-tag table \("):
        analyze.main([])


def test_the_analysis_reads_average_rouge_as_the_tables_do(tmp_path):
    # A record written when R-L was rougeLsum (before b73f235) stores avg_rouge = (R-1 + R-2 + rougeLsum) / 3 =
    # (30 + 10 + 29) / 3 = 23. The tables recompute it from plain rougeL (readers.METRICS): (30 + 10 + 20) / 3 = 20;
    # hard KD vs SelectKD and the tau sweep must read the same 20.
    from pipeline.results.readers import read_eval_metrics

    path = tmp_path / "metrics.json"
    scores = {"rouge1": 30.0, "rouge2": 10.0, "rougeL": 20.0, "rougeLsum": 29.0, "avg_rouge": 23.0, "n": 5}
    path.write_text(json.dumps({"clients": {"Product": scores}}))
    assert read_eval_metrics(path)[1]["Product"] == {"rouge1": 30.0, "rouge2": 10.0, "rougeL": 20.0, "avg_rouge": 20.0}


def test_a_margin_gate_of_the_sweep_is_not_a_point_on_the_entropy_axis():
    # kd_gate margin reads tau as a probability margin (top-1 minus top-2 >= tau; tau_scale does not apply), not an
    # entropy: margin 1.0 (ROUGE 16) and entropy tau 1 nat (ROUGE 10) must not be one averaged point at tau 1 (13, 2
    # seeds), nor a margin in a bits run be moved to 0.69 "nats"; the nats axis keeps the entropy gates (1, 5) only.
    from pipeline.planning import declared
    from pipeline.results.kd_analysis import SWEEP_COLUMNS, tau_sweep_rows, tau_sweep_summary

    sweep = {"method": "fedselectkd", "partition": "domain/seed0", "study": "tau_sweep"}
    params = {
        "tau": 5.0,
        "experiments": {
            "main": {"method": "fedselectkd", "partition": "domain/seed0", "seed": 0},
            "tau-1": sweep | {"tau": 1.0, "seed": 0},
            "margin-1": sweep | {"tau": 1.0, "seed": 1, "kd_gate": "margin"},
            "margin-bits": sweep | {"tau": 0.5, "seed": 0, "kd_gate": "margin", "entropy_log_base": 2},
        },
    }
    runs = {e.name: e for e in declared(params)}
    words = pd.DataFrame({"client": "A", "round": 1, "kd": [True], "is_noun_or_verb": [True], "pos": ["NOUN"]})
    usage = {"words": words, "clients": {"A": {"best_round": 1, "kd_usage_ratio": 1.0}}}
    rouge = {"main": 20.0, "tau-1": 10.0, "margin-1": 16.0, "margin-bits": 15.0}
    rows = [r for n, x in rouge.items() for r in tau_sweep_rows(runs[n], usage, {"A": {"avg_rouge": x}})]
    table, beside = tau_sweep_summary(pd.DataFrame(rows, columns=SWEEP_COLUMNS))
    assert table["tau"].tolist() == [1.0, 5.0] and table["avg_rouge"].tolist() == [10.0, 20.0]
    assert table["n_seeds"].tolist() == [1, 1]
    assert sorted(zip(beside["tau"], beside["avg_rouge"])) == [(0.5, 15.0), (1.0, 16.0)]


def test_a_margin_main_gate_is_not_checked_as_an_entropy(tmp_path, monkeypatch):
    # kd_gate margin: KD where the teacher's top-1 minus top-2 probability >= 0.3; H(q_g) < 0.3 says nothing of it.
    monkeypatch.chdir(tmp_path)
    res = _analyze_one_selectkd_run(tmp_path, {"Product": 2, "Academic": 1}, tau=0.3, train={"kd_gate": "margin"})
    for client in ("Product", "Academic"):
        assert res["clients"][client]["gate_inconsistent_tokens"] is None  # not checkable here; never a false count


@pytest.mark.parametrize(
    "extra, says",
    [
        # FedAvg as the sweep's no-KD point: it reads no tau
        (
            {"fedavg-sweep": {"method": "fedavg", "partition": "domain/seed0", "study": "tau_sweep"}},
            "needs a method that reads tau; 'fedavg' reads none",
        ),
        # a second main-study SelectKD at another tau
        ({"sel-tau4": {"method": "fedselectkd", "partition": "domain/seed0", "seed": 1, "tau": 4.0}}, "different tau"),
        # a second one at the same tau 5.0 in bits: another gate (H_nats < 3.47), not the same tau
        (
            {"sel-bits": {"method": "fedselectkd", "partition": "domain/seed0", "seed": 1, "entropy_log_base": 2}},
            "different tau",
        ),
    ],
)
@pytest.mark.parametrize("file", ["params.yaml", "study/params.yaml"])  # the latter: the stage's --params
def test_a_params_file_the_analysis_refuses_is_one_error_line_not_a_traceback(
    tmp_path, monkeypatch, capsys, extra, says, file
):
    from pipeline.common.cli import run

    monkeypatch.chdir(tmp_path)
    for name in ("sel_s0", *extra):
        write_experiment(tmp_path, name, {"Product": 2, "Academic": 1}, {"Product": (30, 10, 20)})
    (tmp_path / "data/processed").mkdir(parents=True)
    postags_table().to_parquet(tmp_path / "data/processed/postags.parquet")
    run0 = {"method": "fedselectkd", "partition": "domain/seed0", "seed": 0, "study": "main"}
    (tmp_path / file).parent.mkdir(exist_ok=True)
    (tmp_path / file).write_text(yaml.safe_dump({"tau": 5.0, "experiments": {"sel_s0": run0} | extra}))
    assert run(analyze.main, ["--params", file]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {file}") and says in err[0]


def test_main_runs_whose_entropies_are_in_different_units_are_refused_not_pooled(tmp_path, monkeypatch, capsys):
    # A client's gate statistics (entropy_median_per_round, the entropy figure's boxes) pool its main runs' H(q_g);
    # a log in bits and one in nats (train.entropy_log_base 2 and e) hold the same H as 1/ln 2 = 1.44 to 1: pooled,
    # the median mixes units. With a portable gate (0.46 of ln|V|, the same gate in either base) there is no tau to
    # differ, so the analysis used to pool them; it must refuse them as it does an absolute tau in two units.
    from pipeline.common.cli import run

    monkeypatch.chdir(tmp_path)
    portable = {"method": "fedselectkd", "partition": "domain/seed0", "tau": 0.46, "tau_scale": "max_entropy"}
    runs = {"sel_s0": portable | {"seed": 0}, "sel_s1": portable | {"seed": 1, "entropy_log_base": 2}}
    for name in runs:
        write_experiment(tmp_path, name, {"Product": 2, "Academic": 1}, {"Product": (30, 10, 20)})
    (tmp_path / "data/processed").mkdir(parents=True)
    postags_table().to_parquet(tmp_path / "data/processed/postags.parquet")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"tau": 5.0, "experiments": runs}))
    assert run(analyze.main, []) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("error: params.yaml")
        and "(0.46, 'max_entropy', 'bits'), (0.46, 'max_entropy', 'nats')" in err[0]
    )


@pytest.mark.parametrize(
    "gates, refused",
    [
        # 0.5 nats (H(q_g) < 0.5) and 0.5 of ln|V| (H(q_g) < 5.4 nats on BART's 50,265 tokens): two gates at one tau
        (
            ({"tau_scale": "absolute"}, {"tau_scale": "max_entropy"}),
            [(0.5, "absolute", "nats"), (0.5, "max_entropy", "nats")],
        ),
        # H(q_g) < 0.5 nats and a top-1 minus top-2 probability >= 0.5
        (({}, {"kd_gate": "margin"}), [(0.5, "absolute", "nats"), (0.5, "margin", "nats")]),
        # the batch's 0.5-quantile of H(q_g) and a probability margin
        (
            ({"tau_scale": "batch_quantile"}, {"kd_gate": "margin"}),
            [(0.5, "batch_quantile", "nats"), (0.5, "margin", "nats")],
        ),
        # one gate: a margin reads no tau_scale (gates/margin.py), so its runs are seeds of one gate
        (({"kd_gate": "margin"}, {"kd_gate": "margin", "tau_scale": "max_entropy"}), None),
    ],
)
@pytest.mark.parametrize("without_log", [False, True], ids=["logs", "second-without-gate-log"])
def test_main_runs_with_different_gates_at_one_tau_are_refused_not_pooled(
    tmp_path, monkeypatch, capsys, gates, refused, without_log
):
    # A client's KD usage ratio is a mean over its main runs as seeds of one gate, its POS pattern and gate pass
    # fraction per round pool their decisions; main runs at different taus are refused, and so must be runs at one
    # tau whose gates differ (the gates above decide on different quantities or thresholds), not pooled as one gate;
    # also when a run has no gate log (hard KD's comparison still averages its scores with the others' as seeds).
    from pipeline.common.cli import run

    monkeypatch.chdir(tmp_path)
    main = {"method": "fedselectkd", "partition": "domain/seed0", "tau": 0.5}
    runs = {f"sel_s{seed}": main | {"seed": seed} | gate for seed, gate in enumerate(gates)}
    for name in runs:
        write_experiment(tmp_path, name, {"Product": 2, "Academic": 1}, {"Product": (30, 10, 20)})
    (tmp_path / "data/processed").mkdir(parents=True)
    postags_table().to_parquet(tmp_path / "data/processed/postags.parquet")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"experiments": runs}))
    if without_log:
        (tmp_path / "models/sel_s1/gate_log.parquet").unlink()
    assert run(analyze.main, []) == (2 if refused else 0)
    err = capsys.readouterr().err.strip().splitlines()
    if refused:
        assert len(err) == 1 and err[0].startswith("error: params.yaml") and str(refused) in err[0]


def test_hard_kd_minus_selectkd_is_taken_over_the_seeds_both_trained(tmp_path):
    """Noun-verb hard KD against SelectKD on equal footing: hard KD trained seed 0 only, SelectKD seeds 0 and 1, so
    the difference is hard KD's seed 0 minus SelectKD's seed 0 (18 - 20), not minus SelectKD's two-seed mean
    (18 - 22): the second seed's luck is no property of hard KD."""
    from types import SimpleNamespace

    from pipeline.experiments.entries import Experiment
    from pipeline.results.analysis import Analysis

    runs = [
        Experiment(name=n, method=m, partition=f"domain/seed{s}", seed=s, tau=5.0 if m == "fedselectkd" else None)
        for n, m, s in (("sel_s0", "fedselectkd", 0), ("sel_s1", "fedselectkd", 1), ("hard_s0", "hardkd", 0))
    ]
    rouge = {"sel_s0": 20.0, "sel_s1": 24.0, "hard_s0": 18.0}
    metrics = ("rouge1", "rouge2", "rougeL", "avg_rouge")
    analysis = SimpleNamespace(
        experiments=runs,
        main=runs[:2],
        figures=tmp_path,
        scores=lambda e, needed_for: {"Product": dict.fromkeys(metrics, rouge[e.name])},
    )
    out = Analysis.hardkd(analysis)
    assert out["hardkd_minus_selectkd_avg_rouge"] == {"Product": pytest.approx(18.0 - 20.0)}
    assert out["methods"][SELECTKD]["Product"]["mean"]["avg_rouge"] == 22.0  # the table keeps every seed


@pytest.mark.parametrize(("tau_main", "clients"), [(3.0, ["A", "B"]), (None, ["A", "B"]), (3.0, [])])
def test_the_tau_sweep_figure_says_dotted_only_where_a_dotted_line_is_drawn(monkeypatch, tmp_path, tau_main, clients):
    """The title said "(dotted: main study)" when no main SelectKD run has an absolute tau (a portable gate's main
    study: no line is drawn) and when no client has sweep results (no panel)."""
    import matplotlib.pyplot as plt

    from pipeline.results import kd_analysis

    drawn = {}

    def keep(fig, path):
        dotted = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_linestyle() == ":"]
        drawn.update(title=fig._suptitle.get_text(), dotted=len(dotted))
        plt.close(fig)

    monkeypatch.setattr(kd_analysis, "save", keep)
    rows = [(c, tau, 20.0 + tau, 0.1 * tau) for c in clients for tau in (1.0, 3.0)]
    sweep = pd.DataFrame(rows, columns=["client", "tau", "avg_rouge", "kd_usage_ratio"])
    kd_analysis.plot_tau_sweep(sweep, tau_main, tmp_path / "tau_sweep.png")
    assert drawn["dotted"] == (len(clients) if tau_main is not None else 0)
    assert ("dotted" in drawn["title"]) == (drawn["dotted"] > 0), drawn


def test_hard_kd_minus_selectkd_is_taken_over_the_seeds_both_evaluated(tmp_path):
    """Both methods planned seeds 0 and 1, but hard KD's seed 1 has no evaluation yet (reported missing): the
    difference is over seed 0, the one both have scores for (18 - 20), not hard KD's seed 0 minus SelectKD's two-seed
    mean (18 - 22)."""
    from types import SimpleNamespace

    from pipeline.experiments.entries import Experiment
    from pipeline.results.analysis import Analysis

    plan = (
        ("sel_s0", "fedselectkd", 0),
        ("sel_s1", "fedselectkd", 1),
        ("hard_s0", "hardkd", 0),
        ("hard_s1", "hardkd", 1),
    )
    runs = [
        Experiment(name=n, method=m, partition=f"domain/seed{s}", seed=s, tau=5.0 if m == "fedselectkd" else None)
        for n, m, s in plan
    ]
    rouge = {"sel_s0": 20.0, "sel_s1": 24.0, "hard_s0": 18.0}  # hard_s1: not evaluated
    metrics = ("rouge1", "rouge2", "rougeL", "avg_rouge")
    analysis = SimpleNamespace(
        experiments=runs,
        main=runs[:2],
        figures=tmp_path,
        scores=lambda e, needed_for: {"Product": dict.fromkeys(metrics, rouge[e.name])} if e.name in rouge else None,
    )
    out = Analysis.hardkd(analysis)
    assert out["hardkd_minus_selectkd_avg_rouge"] == {"Product": pytest.approx(18.0 - 20.0)}


@pytest.mark.parametrize(
    ("value", "shown"), [(None, "None"), ("n/a", "'n/a'"), ([30.0], r"\[30\.0\]"), (True, "True"), (False, "False")]
)
def test_a_score_that_is_no_number_is_one_error_naming_the_file_client_and_metric(tmp_path, value, shown):
    # a hand-edited or imported metrics.json whose ROUGE is null: one DataError line for the report and analyze
    # stages (pipeline.common.cli), not float()'s TypeError naming no file
    from pipeline.common.schema import DataError
    from pipeline.results.readers import read_eval_metrics

    path = tmp_path / "metrics.json"
    scores = {"rouge1": 30.0, "rouge2": value, "rougeL": 20.0, "rougeLsum": 29.0, "avg_rouge": 23.0, "n": 5}
    path.write_text(json.dumps({"clients": {"Product": scores}}))
    with pytest.raises(DataError, match=rf"metrics\.json: client 'Product' has rouge2 = {shown}, not a number$"):
        read_eval_metrics(path)


@pytest.mark.parametrize("value", [None, True, 2.0, "3"])
def test_a_best_round_that_is_no_integer_is_one_error_naming_the_file_and_client(tmp_path, value):
    # int(True) is 1: a hand-edited train record's `true` read as round 1 would cut the KD usage ratio at round 1
    from pipeline.results.readers import best_rounds

    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({"clients": {"Product": {"best_round": 4}, "ES2002": {"best_round": value}}}))
    with pytest.raises(DataError, match=r"metrics\.json: client 'ES2002' has no integer 'best_round'$"):
        best_rounds(path)
    path.write_text(json.dumps({"clients": {"Product": {"best_round": 4}, "ES2002": {"best_round": 1}}}))
    assert best_rounds(path) == {"Product": 4, "ES2002": 1}


@pytest.mark.parametrize(("value", "shown"), [(None, "None"), ("5", "'5'"), (True, "True"), (4.5, "4.5")])
def test_a_client_count_that_is_no_count_is_one_error_naming_the_file_and_client(tmp_path, value, shown):
    # the scores table's n_examples is metrics.json's `n`: a null ended the report stage in int()'s TypeError naming
    # no file, a JSON true or 4.5 was silently read as 1 or 4 examples
    from pipeline.common.schema import DataError
    from pipeline.results.readers import read_eval_metrics

    path = tmp_path / "metrics.json"
    scores = {"rouge1": 30.0, "rouge2": 10.0, "rougeL": 20.0, "rougeLsum": 29.0, "avg_rouge": 20.0, "n": value}
    path.write_text(json.dumps({"clients": {"Product": scores}}))
    with pytest.raises(DataError, match=rf"metrics\.json: client 'Product' has n = {shown}, not a count$"):
        read_eval_metrics(path)
    path.write_text(json.dumps({"clients": {"Product": 23.0}}))  # a client's scores not an object: TypeError before
    with pytest.raises(DataError, match=r"metrics\.json: client 'Product' lacks \['rouge1', "):
        read_eval_metrics(path)
