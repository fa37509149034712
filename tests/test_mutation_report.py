"""pipeline.mutation_report: verdict counts and scores from mutmut's meta files (a synthetic mutants/ dir), and the
verdicts kept in git across machines."""
from __future__ import annotations

import json

import pytest

from pipeline import mutation_report as mr


def _meta(tmp_path, module: str, codes: dict[int, int | None]) -> None:
    meta = tmp_path / "mutants" / "pipeline" / f"{module.replace('.', '/')}.py.meta"
    meta.parent.mkdir(parents=True, exist_ok=True)
    keys = {f"pipeline.{module}.x_f__mutmut_{i}": c for i, c in codes.items()}
    meta.write_text(json.dumps({"exit_code_by_key": keys}))


def _codes(tmp_path) -> dict[str, dict[str, int | None]]:
    return {m: e["exit_code_by_key"] for m, e in mr.read_meta(tmp_path / "mutants").items()}


def test_counts_and_score_leave_out_equivalent_and_unrun_mutants(tmp_path):
    # 1, 3: killed; 36: mutmut's timeout; 0: survived; 33: no test reaches it; 35: suspicious; None: not run yet
    _meta(tmp_path, "modeling.losses", {1: 1, 2: 3, 3: 36, 4: 0, 5: 0, 6: 33, 7: 35, 8: None, 9: 1, 10: 1})
    equivalent = {"pipeline.modeling.losses.x_f__mutmut_5": "same values"}
    r = mr.collect(_codes(tmp_path), equivalent)["modeling.losses"]
    assert (r.made, r.killed, r.timeout, r.survived, r.no_tests, r.other, r.not_run) == (10, 4, 1, 2, 1, 1, 1)
    assert r.equivalent == 1 and r.detected == 5
    assert r.undetected == [f"pipeline.modeling.losses.x_f__mutmut_{i}" for i in (4, 5, 6, 7)]
    assert r.score == pytest.approx(5 / (10 - 1 - 1))  # 5 detected of 8 run, non-equivalent mutants
    assert "federation.strategies" not in mr.collect(_codes(tmp_path), equivalent)  # never generated: absent


def test_baseline_keeps_each_modules_first_run_and_scores_it_over_todays_mutants(tmp_path):
    _meta(tmp_path, "modeling.losses", {1: 1, 2: 0, 3: 0, 4: 0})
    first = mr.baseline_record(mr.collect(_codes(tmp_path)), {"commit": "a"})
    _meta(tmp_path, "modeling.losses", {1: 1, 2: 1, 3: 1, 4: 0})  # new tests kill two survivors
    _meta(tmp_path, "results.scoring", {1: 1, 2: 0})
    now = mr.collect(_codes(tmp_path), {"pipeline.modeling.losses.x_f__mutmut_4": "same values"})
    second = mr.baseline_record(now, {"commit": "b"}, first)
    assert second["modules"]["modeling.losses"]["killed"] == 1 and second["modules"]["results.scoring"]["killed"] == 1
    assert mr.before_score(second["modules"]["modeling.losses"], now["modeling.losses"]) == pytest.approx(1 / 3)
    assert now["modeling.losses"].score == 1.0


def test_equivalent_list_needs_a_reason(tmp_path):
    path = tmp_path / "eq.yaml"
    path.write_text("pipeline.modeling.losses.x_f__mutmut_1: ''\n")
    with pytest.raises(ValueError, match="mutant name -> non-empty reason"):
        mr.load_equivalent(path)
    assert mr.load_equivalent(tmp_path / "none.yaml") == {}


def test_runs_are_read_from_the_make_log_and_shown_with_the_functions_they_ran(tmp_path):
    runs = tmp_path / "runs.tsv"
    runs.write_text("datasets.readers\tpipeline.datasets.readers.x__parse_span__mutmut_* "
                    "pipeline.datasets.readers.x_read_qmsum__mutmut_*\t1795459012\t3725\tnice -n 10 mutmut run"
                    "\tabc1234\nmodeling.losses\tsurvivors\t1795459012\t59\tcmd\tdef5678+changes\nbroken line\n")
    read = mr.read_runs(runs)
    assert read == [
        {"module": "datasets.readers", "mutants": "pipeline.datasets.readers.x__parse_span__mutmut_* "
         "pipeline.datasets.readers.x_read_qmsum__mutmut_*", "started": "2026-11-23 18:36",
         "wall": "62 min 05 s", "command": "nice -n 10 mutmut run", "commit": "abc1234"},
        {"module": "modeling.losses", "mutants": "survivors", "started": "2026-11-23 18:36", "wall": "0 min 59 s",
         "command": "cmd", "commit": "def5678+changes"}]
    assert mr._which("datasets.readers", read[0]["mutants"]) == "functions `_parse_span`, `read_qmsum`"
    assert mr._which("modeling.losses", "survivors") == "survivors"
    text = mr.render({}, {}, None, {}, {"written": "now", "commit": "c", "mutmut": "3.8.1", "runs": read})
    assert "| pipeline/datasets/readers.py | functions `_parse_span`, `read_qmsum` | 2026-11-23 18:36 | 62 min 05 s |" in text
    assert mr.read_runs(tmp_path / "none.tsv") == []


def test_unfinished_mutants_are_the_undetected_and_unrun_non_equivalent_ones(tmp_path):
    _meta(tmp_path, "modeling.losses", {1: 1, 2: 0, 3: None, 4: 33, 5: 36, 6: 0, 7: None, 10: None})
    equivalent = {"pipeline.modeling.losses.x_f__mutmut_6": "same values", "pipeline.modeling.losses.x_f__mutmut_7": "x"}
    names = mr.unfinished(_codes(tmp_path)["modeling.losses"], equivalent)
    # 6: equivalent and already seen to survive; 7: equivalent but not run since its function changed - run it
    assert names == [f"pipeline.modeling.losses.x_f__mutmut_{i}" for i in (2, 3, 4, 7, 10)]
    assert mr._which("modeling.losses", "unfinished pipeline.modeling.losses.x_f__mutmut_*") == (
        "unfinished mutants of functions `f`")


def test_a_module_run_in_part_names_the_functions_run_and_not_run(tmp_path):
    meta = tmp_path / "mutants" / "pipeline" / "training" / "recorder.py.meta"
    meta.parent.mkdir(parents=True)
    keys = {"pipeline.training.recorder.x_keep_best__mutmut_1": 1, "pipeline.training.recorder.x_keep_best__mutmut_2": 0,
            "pipeline.training.recorder.xǁRecorderǁstarted__mutmut_1": None,
            "pipeline.training.recorder.x_write__mutmut_1": 1, "pipeline.training.recorder.x_write__mutmut_2": None}
    meta.write_text(json.dumps({"exit_code_by_key": keys}))
    r = mr.collect(_codes(tmp_path))["training.recorder"]
    assert r.functions == {"keep_best": [2, 0], "Recorder.started": [0, 1], "write": [1, 1]}
    text = mr.render({"training.recorder": r}, {}, None, {}, {"written": "now", "commit": "c", "mutmut": "3", "runs": []})
    assert ("- `pipeline/training/recorder.py`: 3 of 5 mutants run; every mutant of `keep_best` (2); part of `write` "
            "(1 of 2); not run: `Recorder.started` (1).") in text


def _entry(hashes: dict[str, str], codes: dict[str, int | None]) -> dict:
    return {"hash_by_function_name": hashes, "exit_code_by_key": {f"pipeline.training.recorder.{k}": c for k, c in codes.items()}}


def test_merge_keeps_a_verdict_only_while_its_function_is_unchanged_and_fresh_verdicts_win():
    kept = {"training.recorder": _entry({"x_f": "h1", "x_g": "h2"},
                                      {"x_f__mutmut_1": 1, "x_f__mutmut_2": 0, "x_g__mutmut_1": 1, "x_gone__mutmut_1": 1}),
            "modeling.losses": {"hash_by_function_name": {}, "exit_code_by_key": {"pipeline.modeling.losses.x_l__mutmut_1": 3}}}
    # this machine ran x_f__mutmut_2 again (now killed); x_g's source changed (new hash), x_gone no longer exists
    fresh = {"training.recorder": _entry({"x_f": "h1", "x_g": "h3"},
                                       {"x_f__mutmut_1": None, "x_f__mutmut_2": 1, "x_g__mutmut_1": None})}
    merged = mr.merge(kept, fresh)
    assert merged["training.recorder"]["exit_code_by_key"] == {
        "pipeline.training.recorder.x_f__mutmut_1": 1,  # not run here, function unchanged: the kept verdict
        "pipeline.training.recorder.x_f__mutmut_2": 1,  # run here: the fresh verdict
        "pipeline.training.recorder.x_g__mutmut_1": None}  # function changed: not run
    assert merged["training.recorder"]["hash_by_function_name"] == {"x_f": "h1", "x_g": "h3"}
    assert merged["modeling.losses"] == kept["modeling.losses"]  # a module this machine did not run is kept whole


def test_kept_verdicts_round_trip_through_git_and_restore_into_mutants(tmp_path):
    kept = {"training.recorder": _entry({"x_f": "h1"}, {"x_f__mutmut_1": 1, "x_f__mutmut_2": 0, "x_f__mutmut_3": None})}
    mr.save_kept(kept, tmp_path / "verdicts.json")
    assert mr.load_kept(tmp_path / "verdicts.json") == kept
    assert mr.load_kept(tmp_path / "none.json") == {}
    mutants = tmp_path / "mutants"
    assert mr.restore(kept, mutants) == 2  # two decided verdicts written for mutmut to resume from
    meta = json.loads((mutants / "pipeline" / "training" / "recorder.py.meta").read_text())
    assert {"durations_by_key", "estimated_durations_by_key", "type_check_error_by_key"} <= set(meta)  # mutmut pops them
    assert mr.read_meta(mutants)["training.recorder"] == kept["training.recorder"]
    # a meta this machine already has keeps what it ran and takes the kept verdicts of the rest
    meta["exit_code_by_key"] = {"pipeline.training.recorder.x_f__mutmut_1": None, "pipeline.training.recorder.x_f__mutmut_2": 1,
                                "pipeline.training.recorder.x_f__mutmut_3": 0}
    (mutants / "pipeline" / "training" / "recorder.py.meta").write_text(json.dumps(meta))
    assert mr.restore(kept, mutants) == 3
    assert mr.read_meta(mutants)["training.recorder"]["exit_code_by_key"] == {
        "pipeline.training.recorder.x_f__mutmut_1": 1, "pipeline.training.recorder.x_f__mutmut_2": 1,
        "pipeline.training.recorder.x_f__mutmut_3": 0}


def test_verdicts_in_force_are_todays_mutants_with_the_kept_verdicts_of_unchanged_functions():
    kept = {"training.recorder": _entry({"x_f": "h1", "x_g": "h2"}, {"x_f__mutmut_1": 1, "x_g__mutmut_1": 0, "x_g__mutmut_2": 1})}
    today = {"training.recorder": mr.Mutated(
        ["pipeline.training.recorder.x_f__mutmut_1", "pipeline.training.recorder.x_f__mutmut_2",
         "pipeline.training.recorder.x_g__mutmut_1"], {"x_f": "h1", "x_g": "h9"}, ""),
        "modeling.losses": mr.Mutated(["pipeline.modeling.losses.x_l__mutmut_1"], {"x_l": "h"}, "")}
    codes, dropped = mr.in_force(kept, today)
    assert codes == {"training.recorder": {"pipeline.training.recorder.x_f__mutmut_1": 1,
                                         "pipeline.training.recorder.x_f__mutmut_2": None,  # new mutant: not run
                                         "pipeline.training.recorder.x_g__mutmut_1": None}}  # x_g changed since
    assert dropped == {"training.recorder": 2}  # x_g's two verdicts no longer count; losses has none kept: absent
