"""Stage `ingest`: upstream formats -> canonical records, bad input, and where the files come from."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import http.server
import json
import shutil
import threading
import zipfile
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.common.schema import DataError
from pipeline.datasets import sources
from pipeline.datasets.readers.catalog import dataset_spec
from pipeline.datasets.readers.hmnet import HMNET_CHUNKS
from pipeline.datasets.readers.qmsum import qmsum_meeting_id
from pipeline.datasets.readers.samsum import SAMSUM_FILES
from pipeline.datasets.readers.upstream import absent_allowed
from pipeline.datasets.sources import IngestConfig, resolve_source
from pipeline.ingest import ingest_dataset, write_outputs
from tests.errors import names

FIXTURES = Path(__file__).parent / "fixtures" / "mirror"
AMI_DIR = "hmnet/ExampleRawData/meeting_summarization/AMI_proprec"


@pytest.fixture
def mirror(tmp_path, monkeypatch) -> Path:
    """The hand-written fixtures as a data root: HMNet chunks gzip-compressed like upstream, one chunk per split."""
    root = tmp_path / "mirror"
    shutil.copytree(FIXTURES, root)
    for plain in root.glob("ami/**/*.jsonl"):
        with gzip.open(plain.with_suffix(".jsonl.gz"), "wt", encoding="utf-8") as fh:
            fh.write(plain.read_text())
        plain.unlink()
    monkeypatch.setitem(HMNET_CHUNKS, "ami", {"train": 1, "dev": 1, "test": 1})
    monkeypatch.delenv(sources.ENV_DATA_ROOT, raising=False)
    return root


def rows(frame: pd.DataFrame, **where) -> list[dict]:
    out = frame
    for k, v in where.items():
        out = out[out[k] == v]
    return out.to_dict("records")


# ---------------------------------------------------------------------------------------------- QMSum
def test_qmsum_fixture_counts_and_splits(mirror):
    frame, report = ingest_dataset("qmsum", mirror / "qmsum")
    # 9 files, one meeting each: 9 general queries, 10 specific ones (2 in Academic/train).
    assert report.query_types == {"general": 9, "specific": 10}
    assert report.counts["Academic"] == {"train": 3, "valid": 2, "test": 2}
    assert set(frame.split) == {"train", "valid", "test"}  # upstream `val` normalised


def test_qmsum_spans_are_end_exclusive_slices_in_order(mirror):
    frame, report = ingest_dataset("qmsum", mirror / "qmsum")
    acad = rows(frame, domain="Academic", split="train", query_type="specific")
    first, second = sorted(acad, key=lambda r: r["query_index"])
    # spans [1,3) + [4,5) -> turns 1, 2, 4
    assert [t["speaker"] for t in first["turns"]] == ["PhD C", "Professor B", "PhD C"]
    assert first["turns"][0]["content"] == "we need the {vocalsound} data ."
    assert [list(s) for s in first["spans"]] == [[1, 3], [4, 5]]
    assert first["summary"] == "The data  is ready."
    # [2,2) is empty, then [0,1): only turn 0; the empty span is kept and counted
    assert [t["content"] for t in second["turns"]] == ["OK ."]
    assert report.notes["specific spans with start == end (empty slice, kept)"] == 1
    general = rows(frame, domain="Academic", split="train", query_type="general")[0]
    assert len(general["turns"]) == 5 and len(general["spans"]) == 0 and general["query_index"] == 0
    assert first["source_file"] == "qmsum/data/Academic/jsonl/train.jsonl" and first["source_line"] == 1


def test_qmsum_meeting_id_is_a_stable_content_hash(mirror):
    frame, _ = ingest_dataset("qmsum", mirror / "qmsum")
    line = json.loads((mirror / "qmsum/data/Academic/jsonl/train.jsonl").read_text())
    expected = qmsum_meeting_id(line["meeting_transcripts"])
    assert set(rows(frame, domain="Academic", split="train")[i]["meeting_id"] for i in range(3)) == {expected}
    assert expected.startswith("m") and len(expected) == 11
    assert frame.meeting_id.nunique() == 9


# ---------------------------------------------------------------------------------------------- SAMSum
def test_samsum_turns_and_empty_dialogue(mirror):
    frame, report = ingest_dataset("samsum", mirror / "samsum")
    assert report.counts == {"SAMSum": {"train": 2, "valid": 1, "test": 1}}
    [skipped] = report.skipped
    assert (skipped.record, skipped.source_line, skipped.reason) == ("13828807", 2, "empty dialogue")
    assert report.to_dict()["skipped_by_reason"] == {"empty dialogue": 1}
    amanda = rows(frame, meeting_id="13818513")[0]
    # \r\n separates turns; only the first ": " separates speaker and content
    assert [(t["speaker"], t["content"]) for t in amanda["turns"]] == [
        ("Amanda", "I baked  cookies. Do you want some?"),
        ("Jerry", "Sure: thanks!"),
    ]
    tom = rows(frame, meeting_id="13612302")[0]
    # "\n" separator, "Ann:<file_photo>" without space, a line without speaker continues the previous turn
    assert [(t["speaker"], t["content"]) for t in tom["turns"]] == [
        ("Tom", "hi"),
        ("Ann", "<file_photo> see you there"),
    ]
    assert report.notes == {
        "turns split at ':' without a following space": 1,
        "lines without a speaker appended to the previous turn": 1,
    }
    assert rows(frame, meeting_id="13820882")[0]["split"] == "valid"


# ---------------------------------------------------------------------------------------------- AMI (HMNet)
def test_hmnet_speaker_content_summary(mirror):
    frame, report = ingest_dataset("ami", mirror / "ami")
    assert report.counts == {"AMI": {"train": 1, "valid": 1, "test": 1}}
    es = rows(frame, meeting_id="ES2002a")[0]
    assert [(t["speaker"], t["content"]) for t in es["turns"]] == [
        ("PM B", "Hello everyone ."),
        ("ME A", "Hi ."),
        ("PM B", "Let us start"),
    ]
    assert es["summary"] == "The team met .\nThey said hello ."
    assert (es["query_index"], es["query_type"], es["domain"]) == (-1, "none", "AMI")
    test = rows(frame, meeting_id="ES2004a")[0]
    assert [t["speaker"] for t in test["turns"]] == ["ID D", "A"]  # no role: the letter alone, counted
    assert report.notes == {"turns without a role (speaker letter only)": 1}
    assert rows(frame, meeting_id="IS1005c")[0]["split"] == "valid"  # HMNet `dev`


def test_outputs_round_trip(mirror, tmp_path):
    frame, report = ingest_dataset("ami", mirror / "ami")
    write_outputs(frame, report, tmp_path / "interim", tmp_path / "reports")
    back = pd.read_parquet(tmp_path / "interim" / "ami.parquet")
    assert back.turns.iloc[0][0] == {"speaker": "PM B", "content": "Hello everyone ."}
    assert list(back.spans.iloc[0]) == []
    rep = json.loads((tmp_path / "reports" / "ingest_ami.json").read_text())
    assert rep["n_records"] == 3 and rep["n_skipped"] == 0


# ---------------------------------------------------------------------------------------------- bad input
def _edit_qmsum(mirror: Path, edit) -> None:
    path = mirror / "qmsum/data/Committee/jsonl/val.jsonl"
    meeting = json.loads(path.read_text())
    edit(meeting)
    path.write_text(json.dumps(meeting) + "\n")


def test_malformed_json_names_file_and_line(mirror):
    path = mirror / "samsum/validation.json"
    path.write_text(path.read_text() + '{"id": "x", "dialogue": \n')
    with pytest.raises(DataError, match=r"samsum/validation\.json:2:"):
        ingest_dataset("samsum", mirror / "samsum")


def test_malformed_gzip_json_names_chunk(mirror):
    chunk = mirror / "ami" / AMI_DIR / "dev/split_0.jsonl.gz"
    with gzip.open(chunk, "wt") as fh:
        fh.write("{not json}\n")
    with pytest.raises(DataError, match=r"AMI_proprec/dev/split_0\.jsonl\.gz:1:"):
        ingest_dataset("ami", mirror / "ami")


def test_missing_field_names_field_and_record(mirror):
    _edit_qmsum(mirror, lambda m: m["specific_query_list"][0].pop("answer"))
    with pytest.raises(
        DataError, match=r"Committee/jsonl/val\.jsonl:1: specific_query_list\[0\]\.answer: Field required$"
    ):
        ingest_dataset("qmsum", mirror / "qmsum")


def test_missing_summary_in_hmnet(mirror):
    chunk = mirror / "ami" / AMI_DIR / "test/split_0.jsonl.gz"
    with gzip.open(chunk, "wt") as fh:
        fh.write(json.dumps({"id": "ES2004a", "meeting": []}) + "\n")
    with pytest.raises(DataError, match=r"test/split_0\.jsonl\.gz:1: summary: Field required$"):
        ingest_dataset("ami", mirror / "ami")


@pytest.mark.parametrize(
    "span, problem", [(["1", "3"], r"\[1, 3\].*2 turns"), (["2", "1"], r"\[2, 1\]"), (["a", "1"], r"\['a', '1'\]")]
)
def test_bad_span_names_meeting_and_query(mirror, span, problem):
    def edit(m):
        m["specific_query_list"][0]["relevant_text_span"] = [["0", "1"], span]

    _edit_qmsum(mirror, edit)
    with pytest.raises(DataError, match=r"val\.jsonl:1: .*m\w+.*specific_query_list\[0\].*" + problem):
        ingest_dataset("qmsum", mirror / "qmsum")


def test_missing_turn_field(mirror):
    _edit_qmsum(mirror, lambda m: m["meeting_transcripts"][1].pop("speaker"))
    with pytest.raises(DataError, match=r"val\.jsonl:1: meeting_transcripts\[1\]\.speaker: Field required$"):
        ingest_dataset("qmsum", mirror / "qmsum")


# ---------------------------------------------------------------------------------------------- sources
def test_env_var_overrides_data_root(mirror, tmp_path, monkeypatch):
    cfg = IngestConfig(data_root=str(tmp_path / "nowhere"), raw_dir=str(tmp_path / "raw"), urls={})
    monkeypatch.setenv(sources.ENV_DATA_ROOT, str(mirror))
    assert resolve_source("qmsum", cfg) == mirror / "qmsum"


def test_incomplete_mirror_is_an_error(mirror, tmp_path):
    (mirror / "qmsum/data/Product/jsonl/test.jsonl").unlink()
    cfg = IngestConfig(data_root=str(mirror), raw_dir=str(tmp_path / "raw"), urls={})
    with pytest.raises(DataError, match=r"data/Product/jsonl/test\.jsonl"):
        resolve_source("qmsum", cfg)


def _upstream_layout(mirror: Path, tmp_path: Path) -> Path:
    """The fixtures as the upstream servers lay them out: QMSum repo, HMNet repo (no `hmnet/`), samsum.zip."""
    site = tmp_path / "site"
    shutil.copytree(mirror / "qmsum", site / "qmsum")
    shutil.copytree(mirror / "ami" / "hmnet", site / "hmnet")
    with zipfile.ZipFile(site / "samsum.zip", "w") as zf:
        for name in ("train.json", "validation.json", "test.json"):
            zf.write(mirror / "samsum" / name, f"samsum/{name}")
    return site


@pytest.fixture
def http_site(mirror, tmp_path):
    site = _upstream_layout(mirror, tmp_path)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_download_over_http_keeps_upstream_layout(http_site, tmp_path):
    cfg = IngestConfig(
        data_root=str(tmp_path / "no-mirror"),
        raw_dir=str(tmp_path / "raw"),
        urls={"qmsum": f"{http_site}/qmsum", "ami": f"{http_site}/hmnet", "samsum": f"{http_site}/samsum.zip"},
    )
    for dataset, n in (("qmsum", 19), ("ami", 3), ("samsum", 4)):
        where = resolve_source(dataset, cfg)
        assert where == tmp_path / "raw" / dataset
        frame, _ = ingest_dataset(dataset, where)
        assert len(frame) == n
    assert (tmp_path / "raw/ami" / AMI_DIR / "train/split_0.jsonl.gz").is_file()
    assert (tmp_path / "raw/samsum/validation.json").is_file()


def test_download_from_file_url_then_reuse(mirror, tmp_path):
    site = _upstream_layout(mirror, tmp_path)
    cfg = IngestConfig(
        data_root=str(tmp_path / "no-mirror"), raw_dir=str(tmp_path / "raw"), urls={"qmsum": (site / "qmsum").as_uri()}
    )
    assert resolve_source("qmsum", cfg) == tmp_path / "raw/qmsum"
    shutil.rmtree(site)  # second time: the finished download is reused, nothing fetched
    assert resolve_source("qmsum", cfg) == tmp_path / "raw/qmsum"


def test_a_split_allowed_absent_is_not_downloaded_nor_fetched_again(mirror, tmp_path):
    site = _upstream_layout(mirror, tmp_path)
    (site / "qmsum/data/Product/jsonl/test.jsonl").unlink()  # absent upstream
    cfg = IngestConfig(
        data_root=str(tmp_path / "no-mirror"), raw_dir=str(tmp_path / "raw"), urls={"qmsum": (site / "qmsum").as_uri()}
    )
    with pytest.raises(DataError, match="download from .* failed"):  # not allowed: the download fails
        resolve_source("qmsum", cfg)
    cfg = dataclasses.replace(cfg, allow_absent_splits=["qmsum/Product/test"])
    assert resolve_source("qmsum", cfg) == tmp_path / "raw/qmsum"
    assert not (tmp_path / "raw/qmsum/data/Product/jsonl/test.jsonl").exists()
    shutil.rmtree(site)  # second time: complete but for the allowed split, nothing fetched
    assert resolve_source("qmsum", cfg) == tmp_path / "raw/qmsum"
    frame, _ = ingest_dataset("qmsum", tmp_path / "raw/qmsum", cfg.allow_absent_splits)
    assert set(frame.split[frame.domain == "Product"]) == {"train", "valid"}


def test_a_failed_write_is_not_taken_for_a_split_allowed_absent(mirror, tmp_path, monkeypatch):
    """Only a failed fetch may mean "absent upstream"; a full disk while writing a fetched split is an error."""
    site = _upstream_layout(mirror, tmp_path)
    cfg = IngestConfig(
        data_root=str(tmp_path / "no-mirror"),
        raw_dir=str(tmp_path / "raw"),
        urls={"qmsum": (site / "qmsum").as_uri()},
        allow_absent_splits=["qmsum/*"],
    )

    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sources.atomic, "write_bytes", disk_full)
    with pytest.raises(DataError, match="No space left on device"):
        resolve_source("qmsum", cfg)


def test_a_download_url_may_end_in_a_slash_whatever_its_last_letter(mirror, tmp_path):
    site = _upstream_layout(mirror, tmp_path)
    shutil.move(site / "qmsum", site / "qmsumX")  # a copy whose directory name ends in "X"
    cfg = IngestConfig(
        data_root=str(tmp_path / "no-mirror"),
        raw_dir=str(tmp_path / "raw"),
        urls={"qmsum": (site / "qmsumX").as_uri() + "/"},
    )
    assert resolve_source("qmsum", cfg) == tmp_path / "raw/qmsum"


def test_no_mirror_and_failed_download_says_what_to_set(tmp_path, monkeypatch):
    monkeypatch.delenv(sources.ENV_DATA_ROOT, raising=False)
    cfg = IngestConfig(
        data_root=str(tmp_path / "no-mirror"),
        raw_dir=str(tmp_path / "raw"),
        urls={"qmsum": (tmp_path / "nothing-here").as_uri()},
    )
    with pytest.raises(DataError, match="FEDMEET_DATA_ROOT.*ingest.data_root.*ingest.urls.qmsum"):
        resolve_source("qmsum", cfg)


# ---------------------------------------------------------------------------------------------- real data
@pytest.mark.slow
@pytest.mark.shared_data
def test_real_qmsum_counts(shared_data):
    frame, report = ingest_dataset("qmsum", shared_data / "qmsum")
    specific = frame[frame.query_type == "specific"]
    counts = specific.groupby(["domain", "split"]).size().to_dict()
    assert counts == {
        ("Academic", "train"): 218,
        ("Academic", "valid"): 45,
        ("Academic", "test"): 49,
        ("Committee", "train"): 284,
        ("Committee", "valid"): 67,
        ("Committee", "test"): 66,
        ("Product", "train"): 593,
        ("Product", "valid"): 125,
        ("Product", "test"): 129,
    }
    # SOURCE.md: 232 meetings, 234 general queries
    assert frame.meeting_id.nunique() == 232
    assert report.query_types == {"general": 234, "specific": 1576}


# ---------------------------------------------------------------------------------------------- sources (units)
def test_the_expected_files_are_the_upstream_layout():
    assert list(dataset_spec("qmsum").files()) == [
        f"data/{d}/jsonl/{s}.jsonl" for d in ("Academic", "Committee", "Product") for s in ("train", "val", "test")
    ]
    assert list(dataset_spec("samsum").files()) == ["train.json", "validation.json", "test.json"]
    for dataset, corpus, chunks in (
        ("ami", "AMI", {"train": 32, "dev": 20, "test": 20}),
        ("icsi", "ICSI", {"train": 32, "dev": 10, "test": 6}),
    ):
        files = list(dataset_spec(dataset).files())
        assert len(files) == sum(chunks.values())
        assert files[0] == f"hmnet/ExampleRawData/meeting_summarization/{corpus}_proprec/train/split_0.jsonl.gz"
        assert files[-1] == (
            f"hmnet/ExampleRawData/meeting_summarization/{corpus}_proprec/test/split_{chunks['test'] - 1}.jsonl.gz"
        )
    with pytest.raises(DataError) as err:
        dataset_spec("cnn")
    names(err.value, "'cnn'", "qmsum", "samsum", "ami", "icsi")


def test_ingest_config_names_an_unknown_dataset():
    IngestConfig(datasets=["qmsum", "samsum", "ami", "icsi"])
    with pytest.raises(ValueError) as err:
        IngestConfig(datasets=["qmsum", "xsum", "cnn"])
    names(err.value, "IngestConfig.datasets", "'cnn'", "'xsum'")


@pytest.mark.parametrize(
    "dataset, rel, key",
    [
        ("qmsum", "data/Academic/jsonl/val.jsonl", "qmsum/Academic/valid"),
        ("qmsum", "data/Product/jsonl/test.jsonl", "qmsum/Product/test"),
        ("samsum", "validation.json", "samsum/SAMSum/valid"),
        ("ami", "hmnet/ExampleRawData/meeting_summarization/AMI_proprec/dev/split_3.jsonl.gz", "ami/AMI/valid"),
        ("icsi", "hmnet/ExampleRawData/meeting_summarization/ICSI_proprec/train/split_0.jsonl.gz", "icsi/ICSI/train"),
    ],
)
def test_a_missing_file_may_be_absent_exactly_when_its_split_key_is_allowed(dataset, rel, key):
    def allowed(*patterns):
        return absent_allowed(dataset_spec(dataset).files()[rel], list(patterns))

    assert allowed(key) and allowed(f"{dataset}/*/*") and allowed("*")
    assert not allowed() and not allowed(key + "x") and not allowed(key.upper()) and not allowed("other/*/*")


def test_the_data_root_is_the_environment_variable_else_the_parameter(mirror, tmp_path, monkeypatch):
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy/qmsum").symlink_to(mirror / "qmsum")
    cfg = IngestConfig(data_root=str(mirror), raw_dir=str(tmp_path / "raw"), urls={})
    monkeypatch.delenv(sources.ENV_DATA_ROOT, raising=False)
    assert resolve_source("qmsum", cfg) == mirror / "qmsum"
    monkeypatch.setenv(sources.ENV_DATA_ROOT, "")
    assert resolve_source("qmsum", cfg) == mirror / "qmsum"
    monkeypatch.setenv(sources.ENV_DATA_ROOT, str(tmp_path / "copy"))
    assert resolve_source("qmsum", cfg) == tmp_path / "copy/qmsum"


def test_an_incomplete_mirror_lists_five_missing_files_and_counts_them(mirror, tmp_path):
    for split in ("train", "val", "test"):
        for domain in ("Academic", "Committee"):
            (mirror / f"qmsum/data/{domain}/jsonl/{split}.jsonl").unlink()
    cfg = IngestConfig(data_root=str(mirror), raw_dir=str(tmp_path / "raw"), urls={})
    with pytest.raises(DataError) as err:
        resolve_source("qmsum", cfg)
    missing = [f"data/{d}/jsonl/{s}.jsonl" for d in ("Academic", "Committee") for s in ("train", "val", "test")]
    names(err.value, str(mirror / "qmsum"), str(missing[:5]), "6")
    assert missing[5] not in str(err.value)  # five named, the rest counted
    # the same files allowed absent: the mirror is used as it is
    cfg = IngestConfig(
        data_root=str(mirror),
        raw_dir=str(tmp_path / "raw"),
        urls={},
        allow_absent_splits=["qmsum/Academic/*", "qmsum/Committee/*"],
    )
    assert resolve_source("qmsum", cfg) == mirror / "qmsum"


def test_five_missing_files_are_all_listed_without_an_ellipsis(mirror, tmp_path):
    gone = [
        ("Academic", "train"),
        ("Academic", "val"),
        ("Academic", "test"),
        ("Committee", "train"),
        ("Committee", "val"),
    ]
    for domain, split in gone:
        (mirror / f"qmsum/data/{domain}/jsonl/{split}.jsonl").unlink()
    cfg = IngestConfig(data_root=str(mirror), raw_dir=str(tmp_path / "raw"), urls={})
    with pytest.raises(DataError) as err:
        resolve_source("qmsum", cfg)
    missing = [f"data/{d}/jsonl/{s}.jsonl" for d, s in gone]
    names(err.value, str(mirror / "qmsum"), str(missing))
    assert "..." not in str(err.value)


def test_without_a_mirror_or_a_download_the_error_says_what_to_set(tmp_path, monkeypatch):
    monkeypatch.delenv(sources.ENV_DATA_ROOT, raising=False)
    cfg = IngestConfig(data_root=str(tmp_path / "none"), raw_dir=str(tmp_path / "raw"), urls={})
    with pytest.raises(DataError) as err:
        resolve_source("samsum", cfg)
    # the way out: the DVC import to update, the environment variable and the params keys to set
    names(err.value, "dvc update data/raw/samsum.dvc", "FEDMEET_DATA_ROOT", "ingest.data_root", "ingest.urls.samsum")
    assert str(err.value).startswith(
        "cannot read dataset 'samsum': no local mirror and no `ingest.urls.samsum`. "
        "Run `dvc update data/raw/samsum.dvc`"
    )


def test_a_partial_download_is_resumed_not_refetched(mirror, tmp_path, monkeypatch):
    site = _upstream_layout(mirror, tmp_path)
    fetched = []
    real = sources._fetch
    monkeypatch.setattr(sources, "_fetch", lambda url: fetched.append(url) or real(url))
    raw = tmp_path / "raw" / "qmsum"
    (raw / "data/Academic/jsonl").mkdir(parents=True)
    (raw / "data/Academic/jsonl/train.jsonl").write_text((site / "qmsum/data/Academic/jsonl/train.jsonl").read_text())
    cfg = IngestConfig(
        data_root=str(tmp_path / "none"), raw_dir=str(tmp_path / "raw"), urls={"qmsum": (site / "qmsum").as_uri() + "/"}
    )  # a trailing slash is not doubled
    assert resolve_source("qmsum", cfg) == raw
    assert len(fetched) == 8 and not any("Academic/jsonl/train" in u for u in fetched)
    assert all("//data" not in u for u in fetched)


def test_hmnet_files_are_fetched_from_the_repository_root(mirror, tmp_path, monkeypatch):
    fetched = []
    monkeypatch.setattr(sources, "_fetch", lambda url: fetched.append(url) or b"")
    sources.download("ami", IngestConfig(urls={"ami": "https://example.org/hmnet"}), tmp_path / "ami")
    assert (
        fetched[0]
        == "https://example.org/hmnet/ExampleRawData/meeting_summarization/AMI_proprec/train/split_0.jsonl.gz"
    )
    assert (tmp_path / "ami/hmnet/ExampleRawData/meeting_summarization/AMI_proprec/train/split_0.jsonl.gz").is_file()


def test_a_samsum_zip_without_a_split_is_named(tmp_path, monkeypatch):
    import io

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("samsum/train.json", "{}")
        zf.writestr("samsum/validation.json", "{}")
    monkeypatch.setattr(sources, "_fetch", lambda url: buffer.getvalue())
    with pytest.raises(DataError) as err:
        sources.download("samsum", IngestConfig(urls={"samsum": "https://x/samsum.zip"}), tmp_path / "samsum")
    names(err.value, "https://x/samsum.zip", "samsum/test.json")
    allowed = IngestConfig(urls={"samsum": "https://x/samsum.zip"}, allow_absent_splits=["samsum/SAMSum/test"])
    sources.download("samsum", allowed, tmp_path / "samsum")  # the split allowed absent may be missing upstream too
    assert sorted(p.name for p in (tmp_path / "samsum").iterdir()) == ["train.json", "validation.json"]
    monkeypatch.setattr(sources, "_fetch", lambda url: b"not a zip")
    with pytest.raises(DataError, match=r"https://x/samsum\.zip.*File is not a zip file"):
        sources.download("samsum", IngestConfig(urls={"samsum": "https://x/samsum.zip"}), tmp_path / "samsum")


def test_a_download_address_without_its_scheme_is_named(tmp_path, monkeypatch):
    """ingest.urls.<dataset> without http(s):// or file:// (urlopen's ValueError "unknown url type") is the one-line
    download error naming the address and the key, not a traceback."""
    monkeypatch.delenv(sources.ENV_DATA_ROOT, raising=False)
    cfg = IngestConfig(
        data_root=str(tmp_path / "none"), raw_dir=str(tmp_path / "raw"), urls={"qmsum": "example.org/qmsum"}
    )
    with pytest.raises(DataError) as err:
        resolve_source("qmsum", cfg)
    names(err.value, "example.org/qmsum", "unknown url type", "ingest.urls.qmsum")


def test_a_download_that_hangs_is_given_up_after_the_timeout(monkeypatch):
    seen = {}

    class Response:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return b"data"

    def urlopen(url, timeout):
        seen.update(url=url, timeout=timeout)
        return Response()

    monkeypatch.setattr(sources.urllib.request, "urlopen", urlopen)
    assert sources._fetch("https://x/a") == b"data"
    assert seen == {"url": "https://x/a", "timeout": sources.DOWNLOAD_TIMEOUT_S} and sources.DOWNLOAD_TIMEOUT_S == 120


# ---------------------------------------------------------------------------------------------- spans (properties)
def _one_meeting(tmp_path: Path, spans: list, n_turns: int = 6, domain: str = "Committee") -> Path:
    """A QMSum copy holding one meeting in <domain>/train (every other split allowed absent)."""
    meeting = {
        "topic_list": [],
        "meeting_transcripts": [{"speaker": f"S{i}", "content": f"turn {i}"} for i in range(n_turns)],
        "general_query_list": [{"query": "Summarize.", "answer": "All."}],
        "specific_query_list": [{"query": "What?", "answer": "That.", "relevant_text_span": spans}],
    }
    path = tmp_path / "qmsum" / "data" / domain / "jsonl" / "train.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meeting) + "\n")
    return tmp_path / "qmsum"


def _read(directory: Path):
    from pipeline.common.schema import IngestReport
    from pipeline.datasets.readers.qmsum import read_qmsum

    report = IngestReport("qmsum", str(directory))
    return list(read_qmsum(directory, report, allow_absent=["qmsum/*/*"])), report


span_bounds = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)).map(sorted), min_size=0, max_size=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spans=span_bounds, as_text=st.booleans())
def test_a_specific_query_gets_the_end_exclusive_slices_of_its_spans_in_order(tmp_path_factory, spans, as_text):
    directory = _one_meeting(tmp_path_factory.mktemp("q"), [[str(a), str(b)] if as_text else [a, b] for a, b in spans])
    records, report = _read(directory)
    general, specific = records
    assert general.query_type == "general" and [t.content for t in general.turns] == [f"turn {i}" for i in range(6)]
    assert general.spans == [] and specific.query_type == "specific"
    assert [t.content for t in specific.turns] == [f"turn {i}" for a, b in spans for i in range(a, b)]
    assert [tuple(s) for s in specific.spans] == [tuple(s) for s in spans]
    assert all(type(x) is int for s in specific.spans for x in s)
    empty = sum(a == b for a, b in spans)
    assert report.notes.get("specific spans with start == end (empty slice, kept)", 0) == empty
    assert report.notes.get("specific queries whose spans select no turn (kept, query only)", 0) == (
        1 if all(a == b for a, b in spans) else 0
    )
    assert (specific.domain, specific.split, specific.query_index) == ("Committee", "train", 0)
    assert specific.source_file == "qmsum/data/Committee/jsonl/train.jsonl" and specific.source_line == 1


@settings(max_examples=60, deadline=None)
@given(start=st.integers(-3, 9), end=st.integers(-3, 9), n=st.integers(0, 6), as_text=st.booleans())
def test_a_span_is_accepted_exactly_when_it_lies_within_the_meeting(start, end, n, as_text):
    from pipeline.datasets.readers.qmsum import _parse_span

    raw = [str(start), str(end)] if as_text else (start, end)
    if 0 <= start <= end <= n:
        assert _parse_span(raw, n, "w") == (start, end)
        return
    with pytest.raises(DataError) as err:
        _parse_span(raw, n, "w")
    if start > end:
        names(err.value, "w:", f"[{start}, {end}]", "reversed")
    else:
        names(err.value, "w:", f"[{start}, {end}]", f"{n} turns")


@pytest.mark.parametrize(
    "raw, problem",
    [
        (["1"], "is not a [start, end] pair"),
        (["1", "2", "3"], "is not a [start, end] pair"),
        ("12", "is not a [start, end] pair"),
        ({"a": 1, "b": 2}, "is not a [start, end] pair"),
        ([1.0, 2], "has a non-integer index"),
        ([True, 2], "has a non-integer index"),
        ([1, False], "has a non-integer index"),
        (["1.5", "2"], "has a non-integer index"),
        ([None, 2], "has a non-integer index"),
        ([1, "x"], "has a non-integer index"),
    ],
)
def test_a_malformed_span_is_named_not_read(raw, problem):
    from pipeline.datasets.readers.qmsum import _parse_span

    with pytest.raises(DataError) as err:
        _parse_span(raw, 5, "file:3")
    names(err.value, "file:3:", repr(raw))


def test_a_bad_span_is_reported_with_its_meeting_and_query(tmp_path):
    from pipeline.datasets.readers.qmsum import qmsum_meeting_id

    directory = _one_meeting(tmp_path, [[0, 2], [3, 9]])
    transcript = json.loads((directory / "data/Committee/jsonl/train.jsonl").read_text())["meeting_transcripts"]
    with pytest.raises(DataError) as err:
        _read(directory)
    names(
        err.value,
        "qmsum/data/Committee/jsonl/train.jsonl:1:",
        qmsum_meeting_id(transcript),
        "specific_query_list[0]",
        "[3, 9]",
        "6 turns",
    )


def test_the_meeting_id_hashes_speakers_and_contents_in_order():
    import hashlib

    from pipeline.datasets.readers.qmsum import qmsum_meeting_id

    # the formula is the contract: meeting ids are part of the example ids stored in partitions and reports
    a = [{"speaker": "A", "content": "hello"}, {"speaker": "B", "content": "yes"}]

    text = json.dumps([["A", "hello"], ["B", "yes"]], ensure_ascii=True)
    assert qmsum_meeting_id(a) == "m" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:10]
    assert qmsum_meeting_id(a[::-1]) != qmsum_meeting_id(a)
    assert qmsum_meeting_id([{"speaker": "A", "content": "hello", "extra": 1}, a[1]]) == qmsum_meeting_id(a)
    assert (
        qmsum_meeting_id([{"speaker": "é", "content": "x"}])
        == "m" + hashlib.sha1(json.dumps([["é", "x"]], ensure_ascii=True).encode()).hexdigest()[:10]
    )


# ---------------------------------------------------------------------------------------------- reader units
@pytest.mark.parametrize(
    "value, got", [(True, "true"), (1.5, "1.5"), (2, "2"), (None, "null"), ([1], "[1]"), ({"a": 1}, '{"a": 1}')]
)
def test_a_field_of_the_wrong_json_type_names_the_value_as_json(value, got):
    """A value of the wrong JSON type is shown as the JSON it was (null, not Python's None; true is not text)."""
    from pipeline.datasets.readers.samsum import SamsumDialogue
    from pipeline.datasets.readers.upstream import parse_record

    record = {"id": "d1", "dialogue": "A: hi", "summary": value}
    with pytest.raises(DataError) as err:
        parse_record(SamsumDialogue, record, "x.json:3")
    assert str(err.value) == f"x.json:3: summary: Input should be a valid string, got {got}"


def test_an_unknown_key_with_a_line_break_is_named_on_the_one_line_as_json():
    """An upstream key may hold anything: one that is not a plain name is quoted as JSON, so the message stays one
    line (found by the mutation property test: a key "\\r" broke the line)."""
    from pipeline.datasets.readers.samsum import SamsumDialogue
    from pipeline.datasets.readers.upstream import parse_record

    record = {"id": "d1", "dialogue": "A: hi", "summary": "s", "\r": 1}
    with pytest.raises(DataError) as err:
        parse_record(SamsumDialogue, record, "x.json:3")
    assert str(err.value) == 'x.json:3: ["\\r"]: Extra inputs are not permitted'
    assert len(str(err.value).splitlines()) == 1


def _samsum_dir(tmp_path, **files: list[dict] | str) -> Path:
    directory = tmp_path / "samsum"
    directory.mkdir(parents=True)
    for name in SAMSUM_FILES:
        content = files.get(name.removesuffix(".json"), [{"id": f"{name}-1", "dialogue": "A: hi", "summary": "s"}])
        text = content if isinstance(content, str) else "".join(json.dumps(r) + "\n" for r in content)
        (directory / name).write_text(text)
    return directory


def test_an_empty_split_file_is_read_as_absent_exactly_when_a_pattern_allows_its_split(tmp_path):
    from pipeline.common.schema import IngestReport
    from pipeline.datasets.readers.samsum import read_samsum

    directory = _samsum_dir(tmp_path, test="\n")
    records = list(read_samsum(directory, IngestReport("samsum", "test"), allow_absent=["qmsum/*", "samsum/*/test"]))
    assert sorted(r.split for r in records) == ["train", "valid"]
    with pytest.raises(DataError, match=r"samsum/test\.json: .*samsum/SAMSum/test.*ingest\.allow_absent_splits"):
        list(read_samsum(directory, IngestReport("samsum", "test"), allow_absent=["qmsum/*", "samsum/*/valid"]))


def test_an_empty_dialogue_or_summary_is_skipped_and_the_rest_of_the_file_still_read(tmp_path):
    """No source, or no target to train toward or score against: left out, named in the report (file, line,
    dialogue, reason)."""
    from pipeline.common.schema import IngestReport, Skipped
    from pipeline.datasets.readers.samsum import read_samsum

    train = [
        {"id": "1", "dialogue": "A: hi", "summary": "s1"},
        {"id": "2", "dialogue": " ", "summary": "s2"},
        {"id": "3", "dialogue": "B: yes", "summary": " \r\n"},
        {"id": "4", "dialogue": "C: bye", "summary": ""},
        {"id": "5", "dialogue": "D: ok", "summary": "s5"},
    ]
    report = IngestReport("samsum", "test")
    records = list(read_samsum(_samsum_dir(tmp_path, train=train), report))
    assert [r.meeting_id for r in records if r.split == "train"] == ["1", "5"]
    assert report.skipped == [
        Skipped("samsum/train.json", 2, "2", "empty dialogue"),
        Skipped("samsum/train.json", 3, "3", "empty summary"),
        Skipped("samsum/train.json", 4, "4", "empty summary"),
    ]


def test_a_duplicate_dialogue_id_names_both_places(tmp_path):
    from pipeline.common.schema import IngestReport
    from pipeline.datasets.readers.samsum import read_samsum

    directory = _samsum_dir(tmp_path, validation=[{"id": "train.json-1", "dialogue": "A: x", "summary": "s"}])
    with pytest.raises(DataError) as err:
        list(read_samsum(directory, IngestReport("samsum", "test")))
    names(err.value, "samsum/validation.json:1:", "'train.json-1'", "samsum/train.json:1")


def test_dialogue_lines_become_turns_with_every_repair_counted():
    """Blank lines are dropped and counted; a line without ': ' splits at its first ':' (the rest, colons and all,
    is the content); a line without a colon continues the latest turn; parsing goes on after each repair."""
    from pipeline.common.schema import IngestReport, Turn
    from pipeline.datasets.readers.samsum import split_dialogue

    report = IngestReport("samsum", "test")
    dialogue = "\r\n".join(
        ["A: one", "", "B: two", "C:three 3:00", "and more", "   ", "D: four", "E: five", "still five"]
    )
    assert split_dialogue(dialogue, "w", report) == [
        Turn("A", "one"),
        Turn("B", "two"),
        Turn("C", "three 3:00 and more"),
        Turn("D", "four"),
        Turn("E", "five still five"),
    ]
    assert report.notes == {
        "blank dialogue lines (dropped)": 2,
        "turns split at ':' without a following space": 1,
        "lines without a speaker appended to the previous turn": 2,
    }


def test_a_dialogue_that_does_not_start_with_a_speaker_is_named_with_its_first_60_characters():
    from pipeline.common.schema import IngestReport
    from pipeline.datasets.readers.samsum import split_dialogue

    line = "no speaker here " * 5
    with pytest.raises(DataError) as err:
        split_dialogue(line + "\nA: hi", "samsum/train.json:4: dialogue 7", IngestReport("samsum", "test"))
    names(err.value, "samsum/train.json:4: dialogue 7", repr(line[:60]))


def test_a_samsum_record_is_the_whole_dialogue_with_no_query_and_its_file_and_line(tmp_path):
    from pipeline.common.schema import CanonicalRecord, IngestReport, Turn
    from pipeline.datasets.readers.samsum import read_samsum

    train = [{"id": "7", "dialogue": "A: hi\nB: yes", "summary": "They greet."}]
    records = [
        r for r in read_samsum(_samsum_dir(tmp_path, train=train), IngestReport("samsum", "test")) if r.split == "train"
    ]
    assert records == [
        CanonicalRecord(
            dataset="samsum",
            domain="SAMSum",
            split="train",
            meeting_id="7",
            query_index=-1,
            query="",
            query_type="none",
            turns=[Turn("A", "hi"), Turn("B", "yes")],
            spans=[],
            summary="They greet.",
            source_file="samsum/train.json",
            source_line=1,
        )
    ]


def test_samsum_errors_and_skips_name_the_file_line_and_dialogue(tmp_path):
    from pipeline.common.schema import IngestReport, Skipped
    from pipeline.datasets.readers.samsum import read_samsum

    report = IngestReport("samsum", "test")
    list(read_samsum(_samsum_dir(tmp_path, test=[{"id": "9", "dialogue": "", "summary": "s"}]), report))
    assert report.skipped == [Skipped("samsum/test.json", 1, "9", "empty dialogue")]
    bad = _samsum_dir(tmp_path / "bad", train=[{"id": "4", "dialogue": "no speaker", "summary": "s"}])
    with pytest.raises(DataError) as err:
        list(read_samsum(bad, IngestReport("samsum", "test")))
    names(err.value, "samsum/train.json:1:", "dialogue 4", "'no speaker'")


def test_an_emoji_cut_after_its_first_surrogate_escape_is_named_not_a_traceback_at_the_write(tmp_path):
    """SAMSum's files escape an emoji as a UTF-16 pair ("\\ud83d\\udc83"); JSON accepts half a pair, UTF-8 (the parquet)
    cannot hold it: the record is one line naming file and line, not a UnicodeEncodeError once everything is read."""
    whole = {"id": "1", "dialogue": "A: salsa \ud83d\udc83", "summary": "s"}
    frame, report = ingest_dataset("samsum", _samsum_dir(tmp_path / "ok", train=[whole]))
    write_outputs(frame, report, tmp_path / "out", tmp_path / "out")
    assert rows(pd.read_parquet(tmp_path / "out" / "samsum.parquet"), meeting_id="1")[0]["turns"][0]["content"] == (
        "salsa \N{DANCER}"
    )
    cut = _samsum_dir(tmp_path / "cut", train=[whole, {"id": "2", "dialogue": "B: salsa \ud83d", "summary": "s"}])
    with pytest.raises(DataError) as err:
        write_outputs(*ingest_dataset("samsum", cut), tmp_path / "out", tmp_path / "out")
    names(err.value, "samsum/train.json:2:", "surrogate")


def _qmsum_meeting(*turns: tuple[str, str]) -> dict:
    return {
        "topic_list": [],
        "general_query_list": [{"query": "Summarize", "answer": "A."}],
        "specific_query_list": [],
        "meeting_transcripts": [{"speaker": s, "content": c} for s, c in turns],
    }


def test_two_meetings_of_one_split_are_both_read_and_an_identical_transcript_is_named(mirror):
    from pipeline.common.schema import IngestReport
    from pipeline.datasets.readers.qmsum import read_qmsum

    path = mirror / "qmsum" / "data" / "Committee" / "jsonl" / "val.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in (_qmsum_meeting(("A", "x")), _qmsum_meeting(("B", "y")))))
    records = [
        r
        for r in read_qmsum(mirror / "qmsum", IngestReport("qmsum", "test"))
        if r.domain == "Committee" and r.split == "valid"
    ]
    assert [(r.source_line, [t.speaker for t in r.turns]) for r in records] == [(1, ["A"]), (2, ["B"])]
    path.write_text("".join(json.dumps(m) + "\n" for m in (_qmsum_meeting(("A", "x")), _qmsum_meeting(("A", "x")))))
    with pytest.raises(DataError) as err:
        list(read_qmsum(mirror / "qmsum", IngestReport("qmsum", "test")))
    first = "qmsum/data/Committee/jsonl/val.jsonl"
    names(err.value, f"{first}:2:", records[0].meeting_id, f"{first}:1")


def test_an_allowed_absent_qmsum_split_leaves_the_domains_other_splits_read(mirror):
    from pipeline.common.schema import IngestReport
    from pipeline.datasets.readers.qmsum import read_qmsum

    (mirror / "qmsum" / "data" / "Academic" / "jsonl" / "train.jsonl").unlink()
    report = IngestReport("qmsum", "test")
    records = list(read_qmsum(mirror / "qmsum", report, allow_absent=["qmsum/Academic/train"]))
    assert {r.split for r in records if r.domain == "Academic"} == {"valid", "test"}
    assert report.notes["absent split files allowed by ingest.allow_absent_splits (qmsum/Academic/train)"] == 1


@pytest.mark.parametrize(
    "meeting, problem",
    [
        ({"meeting_transcripts": {"speaker": "A"}}, ["meeting_transcripts: Input should be a valid list"]),
        (
            {"meeting_transcripts": [{"speaker": 3, "content": "x"}]},
            ["meeting_transcripts[0].speaker: Input should be a valid string, got 3"],
        ),
    ],
)
def test_a_malformed_qmsum_transcript_is_named_with_its_file_and_line(mirror, meeting, problem):
    from pipeline.common.schema import IngestReport
    from pipeline.datasets.readers.qmsum import read_qmsum

    path = mirror / "qmsum" / "data" / "Academic" / "jsonl" / "train.jsonl"
    path.write_text(json.dumps(_qmsum_meeting(("A", "x")) | meeting) + "\n")
    with pytest.raises(DataError) as err:
        list(read_qmsum(mirror / "qmsum", IngestReport("qmsum", "test")))
    names(err.value, "qmsum/data/Academic/jsonl/train.jsonl:1:", *problem)


def _hmnet_chunk(mirror, split: str, meetings: list[dict], k: int = 0) -> None:
    with gzip.open(mirror / "ami" / AMI_DIR / split / f"split_{k}.jsonl.gz", "wt") as fh:
        fh.write("".join(json.dumps(m) + "\n" for m in meetings))


def _hmnet_meeting(mid: str = "ES9", **edit) -> dict:
    meeting = {
        "id": mid,
        "meeting": [{"speaker": "A", "role": "PM", "utt": {"word": ["Hi", "."]}}],
        "summary": ["They met ."],
    }
    return meeting | edit


@pytest.mark.parametrize(
    "meeting, problem",
    [
        (
            _hmnet_meeting(meeting=[{"speaker": "A", "role": 3, "utt": {"word": ["x"]}}]),
            ["meeting[0].role: Input should be a valid string"],
        ),
        (
            _hmnet_meeting(meeting=[{"speaker": "A", "utt": {"word": ["x"]}, "start": 0}]),
            ["meeting[0].start: Extra inputs"],
        ),
        (_hmnet_meeting(meeting=[{"speaker": "A", "utt": ["x"]}]), ["meeting[0].utt: expected a JSON object"]),
        (
            _hmnet_meeting(meeting=[{"speaker": "A", "utt": {"word": {"0": "x"}}}]),
            ["meeting[0].utt.word: Input should be a valid list"],
        ),
        (
            _hmnet_meeting(meeting=[{"speaker": "A", "utt": {"word": ["x", 7, "y"]}}]),
            ["meeting[0].utt.word[1]: Input should be a valid string"],
        ),
        (_hmnet_meeting(meeting=[]), ["ES9", "transcript"]),
        (_hmnet_meeting(summary=[]), ["ES9", "summary"]),
        (_hmnet_meeting(summary=["", " \n"]), ["ES9", "summary"]),  # blank sentences only: no summary either
    ],
)
def test_a_malformed_hmnet_meeting_is_named_down_to_the_turn_and_word(mirror, meeting, problem):
    _hmnet_chunk(mirror, "test", [meeting])
    with pytest.raises(DataError) as err:
        ingest_dataset("ami", mirror / "ami")
    names(err.value, f"ami/{AMI_DIR}/test/split_0.jsonl.gz:1:", *problem)


def test_a_meeting_id_in_two_hmnet_splits_names_both_places(mirror):
    _hmnet_chunk(mirror, "test", [_hmnet_meeting("IS1005c")])  # the dev chunk's meeting
    with pytest.raises(DataError) as err:
        ingest_dataset("ami", mirror / "ami")
    names(err.value, f"ami/{AMI_DIR}/test/split_0.jsonl.gz:1:", "'IS1005c'", f"ami/{AMI_DIR}/dev/split_0.jsonl.gz:1")


def test_an_allowed_absent_hmnet_chunk_leaves_the_splits_other_chunks_read(mirror, monkeypatch):
    monkeypatch.setitem(HMNET_CHUNKS, "ami", {"train": 2, "dev": 1, "test": 1})
    (mirror / "ami" / AMI_DIR / "train" / "split_0.jsonl.gz").rename(
        mirror / "ami" / AMI_DIR / "train" / "split_1.jsonl.gz"
    )
    frame, report = ingest_dataset("ami", mirror / "ami", allow_absent=["ami/AMI/train"])
    assert report.counts == {"AMI": {"train": 1, "valid": 1, "test": 1}}
    assert rows(frame, meeting_id="ES2002a")[0]["source_file"] == f"ami/{AMI_DIR}/train/split_1.jsonl.gz"


def _lines(path: Path) -> list:
    from pipeline.datasets.readers.upstream import _json_lines

    return list(_json_lines(path, path.name))


def test_json_lines_are_numbered_as_in_the_file_past_blank_lines(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n\n   \n{"b": 2}\n')
    assert _lines(path) == [(1, {"a": 1}), (4, {"b": 2})]


@pytest.mark.parametrize(
    "content, problem",
    [
        (b'{"a": 1}\n{"b": "\xff"}\n', ["x.jsonl:2:", "UTF-8", "column 8"]),
        (b'{"a": 1}\n' + b"[" * 100000 + b"\n", ["x.jsonl:2:"]),
        (b'{"a": 1}\n{"b": }\n', ["x.jsonl:2:", "column 7"]),
    ],
)
def test_an_unreadable_json_line_is_named_with_its_line_and_column(tmp_path, content, problem):
    path = tmp_path / "x.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as err:
        _lines(path)
    names(err.value, *problem)


def test_a_missing_or_damaged_gzip_chunk_names_the_line_it_stopped_at(tmp_path):
    missing = tmp_path / "missing.jsonl.gz"
    with pytest.raises(DataError) as err:
        _lines(missing)
    names(err.value, "missing.jsonl.gz")
    plain = tmp_path / "plain.jsonl.gz"  # not gzip at all: fails before its first line
    plain.write_bytes(b'{"a": 1}\n')
    with pytest.raises(OSError):
        gzip.open(plain).read()
    with pytest.raises(DataError) as err:
        _lines(plain)
    names(err.value, "plain.jsonl.gz:1")
    cut = tmp_path / "cut.jsonl.gz"  # cut short: the lines before the cut are read, the error names the next
    cut.write_bytes(gzip.compress(b"".join(b'{"n": %d, "pad": "%s"}\n' % (i, b"x" * 50) for i in range(20000)))[:-40])
    from pipeline.datasets.readers.upstream import _json_lines

    read = []
    with pytest.raises(DataError) as err:
        for line_no, _ in _json_lines(cut, "cut.jsonl.gz"):
            read.append(line_no)
    assert read and str(err.value).startswith(f"cut.jsonl.gz:{read[-1] + 1}: truncated or damaged file (")


def test_an_hmnet_record_is_the_whole_meeting_with_no_query_and_its_chunk_and_line(mirror):
    from pipeline.common.schema import CanonicalRecord, IngestReport, Turn
    from pipeline.datasets.readers.hmnet import read_hmnet

    _hmnet_chunk(mirror, "test", [_hmnet_meeting("ES1"), _hmnet_meeting("ES2", summary=[" A. ", "B."])])
    records = [r for r in read_hmnet(mirror / "ami", IngestReport("ami", "test"), [], "ami") if r.split == "test"]
    chunk = f"ami/{AMI_DIR}/test/split_0.jsonl.gz"
    assert records == [
        CanonicalRecord(
            dataset="ami",
            domain="AMI",
            split="test",
            meeting_id=mid,
            query_index=-1,
            query="",
            query_type="none",
            turns=[Turn("PM A", "Hi .")],
            spans=[],
            summary=summary,
            source_file=chunk,
            source_line=line,
        )
        for mid, summary, line in (("ES1", "They met .", 1), ("ES2", "A.\nB.", 2))
    ]


def test_an_empty_hmnet_chunk_is_an_allowed_absence_only_when_it_is_its_splits_one_chunk(mirror, monkeypatch):
    """A split kept in one chunk may be allowed empty; one empty chunk among several is a damaged copy."""
    from pipeline.common.schema import IngestReport
    from pipeline.datasets.readers.hmnet import read_hmnet

    _hmnet_chunk(mirror, "test", [])
    records = list(read_hmnet(mirror / "ami", IngestReport("ami", "test"), ["ami/AMI/test"], "ami"))
    assert {r.split for r in records} == {"train", "valid"}
    monkeypatch.setitem(HMNET_CHUNKS, "ami", {"train": 1, "dev": 1, "test": 2})
    _hmnet_chunk(mirror, "test", [_hmnet_meeting("ES7")], k=1)
    with pytest.raises(DataError, match=r"test/split_0\.jsonl\.gz: .*ami/AMI/test"):
        list(read_hmnet(mirror / "ami", IngestReport("ami", "test"), ["ami/AMI/test"], "ami"))


def test_a_missing_samsum_split_allowed_by_a_pattern_leaves_the_others_read(tmp_path):
    from pipeline.common.schema import IngestReport
    from pipeline.datasets.readers.samsum import read_samsum

    directory = _samsum_dir(tmp_path)
    (directory / "train.json").unlink()
    records = list(read_samsum(directory, IngestReport("samsum", "test"), allow_absent=["samsum/SAMSum/train"]))
    assert sorted(r.split for r in records) == ["test", "valid"]


def test_a_qmsum_query_record_is_its_query_answer_and_selected_turns_and_its_errors_name_the_query(mirror):
    from pipeline.common.schema import CanonicalRecord, IngestReport, Turn
    from pipeline.datasets.readers.qmsum import qmsum_meeting_id, read_qmsum

    path = mirror / "qmsum" / "data" / "Committee" / "jsonl" / "test.jsonl"
    meeting = _qmsum_meeting(("A", "x"), ("B", "y")) | {
        "specific_query_list": [{"query": "Q?", "answer": "Ans.", "relevant_text_span": [["1", "2"]]}]
    }
    path.write_text(json.dumps(meeting) + "\n")
    mid = qmsum_meeting_id(meeting["meeting_transcripts"])
    where = "qmsum/data/Committee/jsonl/test.jsonl"
    records = [
        r
        for r in read_qmsum(mirror / "qmsum", IngestReport("qmsum", "test"))
        if r.domain == "Committee" and r.split == "test"
    ]
    assert records == [
        CanonicalRecord(
            dataset="qmsum",
            domain="Committee",
            split="test",
            meeting_id=mid,
            query_index=0,
            query="Summarize",
            query_type="general",
            turns=[Turn("A", "x"), Turn("B", "y")],
            spans=[],
            summary="A.",
            source_file=where,
            source_line=1,
        ),
        CanonicalRecord(
            dataset="qmsum",
            domain="Committee",
            split="test",
            meeting_id=mid,
            query_index=0,
            query="Q?",
            query_type="specific",
            turns=[Turn("B", "y")],
            spans=[(1, 2)],
            summary="Ans.",
            source_file=where,
            source_line=1,
        ),
    ]
    for edit, problem in (
        ({"query": 1}, "query: Input should be a valid string, got 1"),
        ({"answer": None}, "answer: Input should be a valid string, got null"),
        ({"relevant_text_span": "1-2"}, 'relevant_text_span: Input should be a valid list, got "1-2"'),
    ):
        bad = dict(meeting, specific_query_list=[meeting["specific_query_list"][0] | edit])
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(DataError) as err:
            list(read_qmsum(mirror / "qmsum", IngestReport("qmsum", "test")))
        names(err.value, f"{where}:1: specific_query_list[0].{problem}")


def test_a_qmsum_meeting_with_an_empty_transcript_is_named_not_read(mirror):
    """Like an HMNet meeting without turns: one line naming the file, the line and the problem, not a general query
    read with no transcript (nor a span error that hides why)."""
    from pipeline.common.schema import IngestReport
    from pipeline.datasets.readers.qmsum import read_qmsum

    path = mirror / "qmsum" / "data" / "Academic" / "jsonl" / "train.jsonl"
    for specific in ([], [{"query": "Q?", "answer": "A.", "relevant_text_span": [["0", "2"]]}]):
        path.write_text(json.dumps(_qmsum_meeting() | {"specific_query_list": specific}) + "\n")
        with pytest.raises(DataError) as err:
            list(read_qmsum(mirror / "qmsum", IngestReport("qmsum", "test")))
        names(err.value, "qmsum/data/Academic/jsonl/train.jsonl:1:", "empty transcript")


def test_a_qmsum_meeting_in_two_split_files_is_named_not_read_twice(mirror):
    """Like a meeting id in two HMNet splits or a dialogue id in two SAMSum files: the same meeting (identical
    transcript) in a domain's train and test files is one line naming both places, not two copies of its queries."""
    from pipeline.common.schema import IngestReport
    from pipeline.datasets.readers.qmsum import read_qmsum

    jsonl = mirror / "qmsum" / "data" / "Committee" / "jsonl"
    meeting = json.dumps(_qmsum_meeting(("A", "x"), ("B", "y"))) + "\n"
    (jsonl / "train.jsonl").write_text(meeting)
    (jsonl / "test.jsonl").write_text(meeting)
    with pytest.raises(DataError) as err:
        list(read_qmsum(mirror / "qmsum", IngestReport("qmsum", "test")))
    names(err.value, "qmsum/data/Committee/jsonl/test.jsonl:1:", "qmsum/data/Committee/jsonl/train.jsonl:1")


def test_a_qmsum_query_with_an_empty_answer_is_named_not_read_as_an_empty_target(mirror):
    """Like a meeting without a transcript: one line naming the file, line, meeting and query, not a record whose
    reference summary is empty (trained toward nothing, scored 0)."""
    from pipeline.common.schema import IngestReport
    from pipeline.datasets.readers.qmsum import qmsum_meeting_id, read_qmsum

    path = mirror / "qmsum" / "data" / "Committee" / "jsonl" / "val.jsonl"
    meeting = _qmsum_meeting(("A", "x"), ("B", "y"))
    mid = qmsum_meeting_id(meeting["meeting_transcripts"])
    q0 = {"query": "Q0?", "answer": "Ans.", "relevant_text_span": [["0", "1"]]}
    for edit, key in (
        ({"specific_query_list": [q0, q0 | {"answer": " \n"}]}, "specific_query_list[1]"),
        ({"general_query_list": [{"query": "Summarize", "answer": ""}]}, "general_query_list[0]"),
    ):
        path.write_text(json.dumps(meeting | {"specific_query_list": [q0]} | edit) + "\n")
        with pytest.raises(DataError) as err:
            list(read_qmsum(mirror / "qmsum", IngestReport("qmsum", "test")))
        names(err.value, "qmsum/data/Committee/jsonl/val.jsonl:1:", mid, key, "empty answer")
