"""Stage `examples`: model inputs, word counters, QMSum<->AMI/ICSI meeting names, Table II."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pandas as pd
import pytest

from pipeline.common.schema import DataError, Turn, spoken_word_count, summary_word_count
from pipeline.datasets.examples import (
    PAPER_TABLE_II,
    ExamplesConfig,
    build_examples,
    link_meetings,
    stats_markdown,
    table_ii,
)
from pipeline.datasets.readers.hmnet import HMNET_CHUNKS
from pipeline.ingest import ingest_dataset
from tests.errors import names

FIXTURES = Path(__file__).parent / "fixtures" / "mirror"


@pytest.fixture
def interim(tmp_path, monkeypatch) -> dict[str, pd.DataFrame]:
    root = tmp_path / "mirror"
    shutil.copytree(FIXTURES, root)
    for plain in root.glob("ami/**/*.jsonl"):
        with gzip.open(plain.with_suffix(".jsonl.gz"), "wt", encoding="utf-8") as fh:
            fh.write(plain.read_text())
    monkeypatch.setitem(HMNET_CHUNKS, "ami", {"train": 1, "dev": 1, "test": 1})
    return {ds: ingest_dataset(ds, root / ds)[0] for ds in ("qmsum", "samsum", "ami")}


def test_word_counters_by_hand():
    # the paper's summary counter splits on single spaces: a double space adds an empty word
    assert summary_word_count("The data  is ready.") == 5
    assert summary_word_count("One two .\nThree") == 4  # AMI/ICSI: counted per sentence line
    # spoken words: speaker + content, {...} tags removed, whitespace split
    assert spoken_word_count(Turn("PhD C", "we need the {vocalsound} data .")) == 7
    assert spoken_word_count(Turn("Marketing", "{disfmarker}")) == 1


def test_qmsum_input_is_query_sep_rendered_turns(interim):
    examples, _ = build_examples(interim, ExamplesConfig())
    acad = examples[(examples.domain == "Academic") & (examples.split == "train")].sort_values("example_id")
    assert len(acad) == 2 and set(acad.query_type) == {"specific"}  # general queries left out by default
    q0 = acad.iloc[0]
    assert q0.example_id.startswith("qmsum/Academic/train/m") and q0.example_id.endswith("/q0")
    assert q0.source == (
        "What did they say about the data? #SEP# PhD C: we need the {vocalsound} data .\n"
        "Professor B: the data is ready .\nPhD C: next topic ."
    )
    assert q0.target == "The data  is ready."
    assert (q0.n_turns, q0.n_speakers, q0.n_words, q0.n_summary_words) == (3, 2, 7 + 7 + 5, 5)


def test_other_datasets_and_options(interim):
    cfg = ExamplesConfig(
        qmsum_query_types=["general", "specific"], samsum_query="Summarize the dialogue", sep_token="<sep>"
    )
    examples, _ = build_examples(interim, cfg)
    qm = examples[examples.dataset == "qmsum"]
    assert len(qm) == 19 and qm.example_id.str.contains("/g0$").sum() == 9
    sam = examples.set_index("example_id").loc["samsum/train/13818513"]
    assert (
        sam.source == "Summarize the dialogue <sep> Amanda: I baked  cookies. Do you want some?\nJerry: Sure: thanks!"
    )
    assert "samsum/train/13828807" not in set(examples.example_id)  # the empty dialogue was skipped at ingest
    ami = examples.set_index("example_id").loc["ami/train/ES2002a"]
    assert ami.source == "PM B: Hello everyone .\nME A: Hi .\nPM B: Let us start"  # no query for whole meetings
    assert ami.target == "The team met .\nThey said hello ." and ami.n_summary_words == 4 + 4


def test_qmsum_product_meeting_takes_its_ami_name(interim):
    qm, ami = interim["qmsum"], interim["ami"].copy()
    product_train = qm[(qm.domain == "Product") & (qm.split == "train") & (qm.query_type == "general")].iloc[0]
    ami.at[ami.index[ami.meeting_id == "ES2004a"][0], "turns"] = product_train.turns  # same meeting, as in reality
    examples, links = build_examples({"qmsum": qm, "ami": ami}, ExamplesConfig())
    product = examples[(examples.domain == "Product") & (examples.split == "train")]
    assert list(product.meeting_id) == ["ES2004a"]
    assert list(product.example_id) == ["qmsum/Product/train/ES2004a/q0"]
    assert links["Product"]["linked"] == 1 and links["Product"]["same_split"] == 0  # AMI has it in test
    assert links["Academic"]["status"].startswith("icsi not ingested")


def test_a_product_meeting_without_a_general_query_is_named_unmatched_not_left_out(interim):
    """The link reads a meeting's whole transcript from its general query. A Product meeting without one (its jsonl
    line's general_query_list empty) was in neither 'linked' nor 'unmatched': its examples kept their hash name, so the
    leakage guard could not see it is an AMI meeting (here AMI's test meeting ES2004a), with no word of it anywhere."""
    qm, ami = interim["qmsum"], interim["ami"].copy()
    general = (qm.domain == "Product") & (qm.split == "train") & (qm.query_type == "general")
    meeting = qm[general].iloc[0]
    ami.at[ami.index[ami.meeting_id == "ES2004a"][0], "turns"] = meeting.turns
    _, links = build_examples({"qmsum": qm[~general], "ami": ami}, ExamplesConfig())
    assert meeting.meeting_id in links["Product"]["unmatched"]
    assert links["Product"]["meetings"] == 3 and links["Product"]["linked"] == 0  # train, valid and test: one each


def test_link_meetings_matches_by_shared_word_ngrams():
    corpus = {
        "ES2002a": ["hello everyone , let us start the meeting about the remote control design today"],
        "ES2002b": ["we discussed the battery and the case material of the new remote in detail"],
    }
    queries = {
        "m1": ["We discussed the battery , and the case", "material of the new remote in detail ."],
        "m2": ["something else entirely that nobody said in any of those meetings at all"],
    }
    links, record = link_meetings(queries, corpus, min_jaccard=0.05)
    assert links == {"m1": "ES2002b"} and record["unmatched"] == ["m2"] and record["min_score"] == 1.0
    with pytest.raises(DataError, match="both match ES2002b"):
        link_meetings({"m1": queries["m1"], "m3": list(queries["m1"])}, corpus, min_jaccard=0.05)


def test_stats_markdown_shows_paper_values_and_skips():
    stats = {
        "qmsum": {
            "Academic": {
                "train": {
                    "n": 218,
                    "avg_turns": 54.64,
                    "avg_speakers": 4.35,
                    "avg_words": 1041.26,
                    "avg_summary_words": 46.22,
                }
            }
        }
    }
    md = stats_markdown(stats, {"samsum": {"empty dialogue": 1}}, {})
    assert "| Academic | train | 218 / 218 | 54.64 / 54.64 | 4.35 / 4.35 | 1041.26 / 1049.80 | 46.22 / 46.22 |" in md
    assert "- samsum: 1 x empty dialogue" in md


@pytest.mark.slow
@pytest.mark.shared_data
def test_table_ii_from_the_real_qmsum(shared_data):
    frame, _ = ingest_dataset("qmsum", shared_data / "qmsum")
    examples, _ = build_examples({"qmsum": frame}, ExamplesConfig())
    ours = table_ii(examples)["qmsum"]
    for domain, by_split in PAPER_TABLE_II.items():
        for split, paper in by_split.items():
            got = ours[domain][split]
            assert got["n"] == paper["n"], (domain, split)
            assert abs(got["avg_turns"] - paper["avg_turns"]) <= 0.01, (domain, split)
            assert abs(got["avg_speakers"] - paper["avg_speakers"]) <= 0.01, (domain, split)
            assert abs(got["avg_summary_words"] - paper["avg_summary_words"]) <= 0.1, (domain, split)
            # the paper's spoken-word counter is unknown; ours stays within 2.5 % (METHOD.md section 2)
            assert abs(got["avg_words"] / paper["avg_words"] - 1) <= 0.025, (domain, split)
    assert examples.example_id.is_unique


@pytest.mark.parametrize("types", [["specifc"], ["Specific"], []])
def test_a_qmsum_query_type_that_selects_nothing_is_named_not_an_empty_qmsum(types):
    """QMSum records are of query type "general" or "specific" (the ingest stage's); a misspelt type or none at
    all would leave the examples stage without a single QMSum example, silently."""
    from pipeline.common.config import ConfigError, from_dict

    with pytest.raises(ConfigError) as err:
        from_dict(ExamplesConfig, {"qmsum_query_types": types}, "params.yaml examples")
    names(err.value, "examples.qmsum_query_types")
    assert from_dict(ExamplesConfig, {"qmsum_query_types": ["general", "specific"]}).qmsum_query_types == [
        "general",
        "specific",
    ]


@pytest.mark.parametrize("threshold", [5, 1.5, -0.1])
def test_a_link_threshold_outside_the_jaccard_range_is_named(threshold):
    """A Jaccard similarity lies in [0, 1]: above 1 no QMSum meeting is ever linked to its AMI/ICSI name, so the
    leakage guard cannot see that a Product/Academic meeting is an AMI/ICSI test meeting (METHOD.md section 2)."""
    from pipeline.common.config import ConfigError, from_dict

    with pytest.raises(ConfigError) as err:
        from_dict(ExamplesConfig, {"link_min_jaccard": threshold}, "params.yaml examples")
    names(err.value, "examples.link_min_jaccard", str(threshold))
    assert from_dict(ExamplesConfig, {"link_min_jaccard": 1.0}).link_min_jaccard == 1.0


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_or_missing_ingest_report_is_one_error_line_naming_it(interim, tmp_path, damage):
    """The stage reads each dataset's ingest report (its records skipped by design): a report cut short by a killed
    writer was a JSONDecodeError traceback naming no file."""
    from pipeline import examples as stage
    from pipeline.common.cli import EXIT_USAGE
    from tests.reliability import run_inprocess

    (tmp_path / "interim").mkdir()
    interim["samsum"].to_parquet(tmp_path / "interim" / "samsum.parquet")
    (tmp_path / "p.yaml").write_text("ingest:\n  datasets: [samsum]\n")
    report = tmp_path / "reports" / "ingest_samsum.json"
    report.parent.mkdir()
    if damage == "truncated":
        report.write_text('{"skipped_by_reason": {"empty dia')
    args = ["--params", str(tmp_path / "p.yaml"), "--interim-dir", str(tmp_path / "interim")]
    args += ["--report-dir", str(report.parent), "--out", str(tmp_path / "examples.parquet")]
    outcome = run_inprocess(stage.main, args)
    assert outcome.status == EXIT_USAGE and "Traceback" not in outcome.stderr, outcome.stderr
    assert outcome.lines[-1].startswith(f"error: {report}: "), outcome.stderr
    assert not (tmp_path / "examples.parquet").exists()  # nothing written from a stage that stopped


def run_examples_stage(tmp_path, monkeypatch):
    """The stage on the inputs of :func:`write_samsum_stage_inputs`, run in ``tmp_path`` (its timing record too)."""
    from pipeline import examples as stage
    from tests.reliability import run_inprocess

    monkeypatch.chdir(tmp_path)
    return run_inprocess(
        stage.main,
        ["--params", str(tmp_path / "p.yaml"), "--interim-dir", str(tmp_path / "interim")]
        + ["--report-dir", str(tmp_path / "reports"), "--out", str(tmp_path / "examples.parquet")],
    )


def write_samsum_stage_inputs(interim, tmp_path, edit=None) -> tuple[Path, Path]:
    import pyarrow as pa

    from pipeline.common.schema import canonical_arrow_schema

    (tmp_path / "interim").mkdir()
    (tmp_path / "reports").mkdir()
    table, report = tmp_path / "interim" / "samsum.parquet", tmp_path / "reports" / "ingest_samsum.json"
    frame = (edit or (lambda frame: frame))(interim["samsum"])
    schema = canonical_arrow_schema()  # as ingest writes it, less a column the edit dropped
    frame.to_parquet(table, schema=pa.schema([c for c in schema if c.name in frame.columns]), index=False)
    report.write_text('{"skipped_by_reason": {"empty dialogue": 1}}')
    (tmp_path / "p.yaml").write_text("ingest:\n  datasets: [samsum]\n")
    return table, report


INTERIM_DAMAGES = {  # an ingest table cut short, from another version, or written by hand -> what the line names
    "truncated": (None, "not a readable ingest table"),
    "empty file": (None, "not a readable ingest table"),
    "no summary column": (lambda f: f.drop(columns=["summary"]), "column summary is missing"),
    "no turns column": (lambda f: f.drop(columns=["turns"]), "column turns is missing"),
    "null summary": (lambda f: f.assign(summary=[None, *f.summary[1:]]), "column summary is null in row 0"),
    "null turns": (lambda f: f.assign(turns=[None, *f.turns[1:]]), "column turns is null in row 0"),
}


@pytest.mark.parametrize("damage", INTERIM_DAMAGES)
def test_a_damaged_ingest_table_is_one_error_line_naming_it_and_the_column(interim, tmp_path, monkeypatch, damage):
    """The stage reads each dataset's ingest table (data/interim/<dataset>.parquet): one cut short was pyarrow's
    ArrowInvalid traceback, one without a column an AttributeError from inside build_examples ('Pandas' object has
    no attribute 'summary'), a null value an AttributeError or TypeError from a word counter."""
    from pipeline.common.cli import EXIT_USAGE

    edit, problem = INTERIM_DAMAGES[damage]
    if edit is None:  # the columns of the schema ingest writes, then the file damaged
        table, _ = write_samsum_stage_inputs(interim, tmp_path)
        table.write_bytes(table.read_bytes()[: len(table.read_bytes()) // 2] if damage == "truncated" else b"")
    else:
        table, _ = write_samsum_stage_inputs(interim, tmp_path, edit)
    outcome = run_examples_stage(tmp_path, monkeypatch)
    assert outcome.status == EXIT_USAGE and "Traceback" not in outcome.stderr, outcome.stderr
    names(outcome.lines[-1], f"error: {table}: ", problem)
    assert not (tmp_path / "examples.parquet").exists()


@pytest.mark.parametrize("content", ['{"n_records": 3}', '{"skipped_by_reason": ["empty dialogue"]}'])
def test_an_ingest_report_without_its_skipped_counts_is_one_line_and_writes_nothing(
    interim, tmp_path, monkeypatch, content
):
    """An ingest report without the object of skipped counts by reason (another version's, or edited) was a KeyError
    traceback; a list there crashed the markdown after examples.parquet and stats.json had been written."""
    from pipeline.common.cli import EXIT_USAGE

    _, report = write_samsum_stage_inputs(interim, tmp_path)
    report.write_text(content)
    outcome = run_examples_stage(tmp_path, monkeypatch)
    assert outcome.status == EXIT_USAGE and "Traceback" not in outcome.stderr, outcome.stderr
    names(outcome.lines[-1], f"error: {report}: ", "skipped_by_reason")
    assert not (tmp_path / "examples.parquet").exists() and not (tmp_path / "reports" / "stats.json").exists()


def test_the_stage_on_an_intact_ingest_table_writes_its_examples(interim, tmp_path, monkeypatch):
    write_samsum_stage_inputs(interim, tmp_path)
    assert run_examples_stage(tmp_path, monkeypatch).status == 0
    written = pd.read_parquet(tmp_path / "examples.parquet")
    assert written.equals(build_examples({"samsum": interim["samsum"]}, ExamplesConfig())[0])


def test_stats_md_names_the_query_types_its_qmsum_table_counts(interim, tmp_path, monkeypatch):
    """stats.md headed its QMSum table 'specific queries (the paper's Table II)' whatever examples.qmsum_query_types
    chose: with general queries too its n and averages count both kinds, beside the paper's specific-only numbers."""
    from pipeline.common.schema import canonical_arrow_schema

    write_samsum_stage_inputs(interim, tmp_path)
    interim["qmsum"].to_parquet(tmp_path / "interim" / "qmsum.parquet", schema=canonical_arrow_schema(), index=False)
    (tmp_path / "reports" / "ingest_qmsum.json").write_text('{"skipped_by_reason": {}}')
    params = "ingest:\n  datasets: [qmsum]\nexamples:\n  qmsum_query_types: [%s]\n"
    for types, heading in (
        ("specific", "QMSum, specific queries (the paper's Table II)."),
        ("general, specific", None),
    ):
        (tmp_path / "p.yaml").write_text(params % types)
        assert run_examples_stage(tmp_path, monkeypatch).status == 0
        md = (tmp_path / "reports" / "stats.md").read_text()
        qmsum = pd.read_parquet(tmp_path / "examples.parquet")
        assert set(qmsum.query_type) == set(types.split(", "))
        if heading:  # the committed wording when the table is the paper's kind of example
            assert heading in md
        else:
            assert "QMSum, general and specific queries" in md and "specific queries only" in md, md


def test_an_empty_ingest_datasets_list_is_one_error_line_not_an_empty_examples_table(interim, tmp_path, monkeypatch):
    """With `ingest.datasets: []` the stage wrote an examples table of no row and a Table II of none, exit 0; the
    partition stage then stopped on 'no QMSum examples', one stage late."""
    from pipeline.common.cli import EXIT_USAGE

    write_samsum_stage_inputs(interim, tmp_path)
    (tmp_path / "p.yaml").write_text("ingest:\n  datasets: []\n")
    outcome = run_examples_stage(tmp_path, monkeypatch)
    assert outcome.status == EXIT_USAGE and "Traceback" not in outcome.stderr, outcome.stderr
    names(outcome.lines[-1], f"error: {tmp_path / 'p.yaml'} ingest.datasets: ", "got []")
    assert not (tmp_path / "examples.parquet").exists() and not (tmp_path / "reports" / "stats.json").exists()
