"""Run profiles (configs/*.yaml): validation against params.yaml and application through DVC's --set-param."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dvc.utils.hydra import apply_overrides

from pipeline import presets as pr
from pipeline.common.cli import run as run_cli
from pipeline.common.config import flatten, load_params

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))
PARAMS = load_params(ROOT / "params.yaml")


def test_privacy_study_pairs_every_budget_with_the_plain_run_seed_by_seed():
    from pipeline.experiments.entries import with_labels
    from pipeline.planning import declared

    merged = pr.apply_preset(PARAMS, pr.load_preset(ROOT / "configs" / "privacy-study.yaml"))
    planned = declared(merged)
    labels = with_labels(planned)
    by_config: dict[tuple[str, str], set[int]] = {}
    for e in planned:
        assert e.study == "privacy" and e.partition == "domain/seed0"
        by_config.setdefault((e.method, e.dp), set()).add(e.seed)
    assert set(by_config) == {
        (m, dp)
        for m in ("fedavg", "fedselectkd")
        for dp in ("", "DP-SGD ε≤8 δ≤1e-5", "DP-SGD ε≤3 δ≤1e-5", "DP-SGD ε≤1 δ≤1e-5")
    }
    assert all(seeds == {0, 1, 2} for seeds in by_config.values())
    assert len(set(labels.values())) == 8


def test_the_four_profiles_exist():
    assert {p.name for p in PRESETS} >= {
        "paper-bart-large.yaml",
        "paper-bart-base.yaml",
        "paper-led-large.yaml",
        "cpu-study.yaml",
    }


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_profile_names_only_params_yaml_keys(path):
    preset = pr.load_preset(path)
    assert pr.problems(preset, PARAMS) == []
    for key in flatten(
        preset, whole=pr.REPLACED_WHOLE
    ):  # each leaf is a params.yaml key (experiments replaced as a whole)
        node = PARAMS
        for part in key.split("."):
            assert part in node, f"{path.name}: {key}"
            node = node[part]


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_profile_uses_the_study_names_the_default_profile_uses(path):
    # The report and analyze stages find a study by name (tau_sweep, new_client, ...): a renamed study would
    # silently lose its figure and its analysis.
    from pipeline.results.evaluation import STUDIES

    known = {e.get("study", "main") for e in PARAMS["experiments"].values()} | set(STUDIES)
    used = {e.get("study", "main") for e in (pr.load_preset(path).get("experiments") or {}).values()}
    assert used <= known, f"{path.name}: unknown studies {sorted(used - known)}"


# METHOD.md section 3 / 4: (k, m) per backbone and the paper's optimiser settings
PAPER = {
    "paper-bart-large.yaml": ("facebook/bart-large", 6, 2048),
    "paper-bart-base.yaml": ("facebook/bart-base", 3, 1536),
    "paper-led-large.yaml": ("allenai/led-large-16384", 6, 2048),
}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_profiles_carry_the_papers_settings(name):
    merged = pr.apply_preset(PARAMS, pr.load_preset(ROOT / "configs" / name))
    backbone, k, m = PAPER[name]
    assert merged["backbone"]["name"] == backbone
    assert (merged["model"]["top_k"], merged["model"]["bottleneck"]) == (k, m)
    t = merged["train"]
    assert (t["lr"], t["batch_size"] * t["grad_accum_steps"], t["weight_decay"], t["kd_lambda"]) == (
        2e-4,
        16,
        0.01,
        0.2,
    )
    assert t["fraction_train"] == 1.0 and t["max_train_examples_per_client"] is None
    assert merged["tau"] == 5.0 and merged["evaluate"]["num_beams"] > 1
    assert merged["evaluate"]["test_examples_per_client"] is None
    # every configuration is run with the 3 seeds the paper averages over
    configs: dict[tuple, set[int]] = {}
    for entry in merged["experiments"].values():
        key = (entry["method"], entry["partition"].split("/seed")[0], entry["study"], entry.get("tau"))
        configs.setdefault(key, set()).add(entry["seed"])
        assert entry["partition"].endswith(f"/seed{entry['seed']}")
    assert configs and all(seeds == {0, 1, 2} for seeds in configs.values())
    methods = {m for (m, *_rest) in configs}
    assert {"single", "centralized", "fedavg", "fedkd", "fedselectkd"} <= methods


def test_cpu_study_uses_the_offline_backbone_and_full_qmsum():
    merged = pr.apply_preset(PARAMS, pr.load_preset(ROOT / "configs" / "cpu-study.yaml"))
    assert merged["backbone"]["name"] == "minilm-bert2bert"
    assert merged["train"]["max_train_examples_per_client"] is None
    assert merged["train"]["rounds"] > PARAMS["train"]["rounds"]
    assert {e["method"] for e in merged["experiments"].values()} == {
        "single",
        "centralized",
        "fedavg",
        "fedkd",
        "fedselectkd",
    }


# ---------------------------------------------------------------------------------------------- validation
def write(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_unknown_keys_are_errors_naming_each_key(tmp_path):
    path = write(tmp_path, "train:\n  rounds: 4\n  roundz: 5\nmodle: {top_k: 1}\n")
    pr.load_preset(path)  # read alone: not checked
    with pytest.raises(pr.PresetError) as err:
        pr.load_preset(path, ROOT / "params.yaml")
    msg = str(err.value)
    assert "p.yaml: 2 problem(s)" in msg and "train.roundz: unknown key" in msg and "modle.top_k: unknown key" in msg
    assert "train.rounds" not in msg


def test_shape_mismatches_and_duplicates_are_errors(tmp_path):
    assert pr.problems({"train": 3}, PARAMS) == ["params.yaml train: expected a mapping of keys, got int 3"]
    assert pr.problems({"tau": {"a": 1}}, PARAMS) == ["tau.a: unknown key (params.yaml has no tau.a)"]
    with pytest.raises(pr.PresetError, match="duplicate key 'tau'"):
        pr.load_preset(write(tmp_path, "tau: 1.0\ntau: 2.0\n"))
    with pytest.raises(pr.PresetError, match="expected a mapping at the top level"):
        pr.load_preset(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(pr.PresetError, match="non-empty mapping"):
        pr.load_preset(write(tmp_path, "# every key commented out\n"))
    with pytest.raises(pr.PresetError, match="absent.yaml: preset file not found"):
        pr.load_preset(tmp_path / "absent.yaml")
    with pytest.raises(pr.PresetError, match="preset file not found"):
        pr.load_preset(tmp_path)  # a folder
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("study: 'Académie'\n".encode("latin-1"))  # not UTF-8: one line, no UnicodeDecodeError
    with pytest.raises(pr.PresetError, match="latin1.yaml: not valid YAML"):
        pr.load_preset(latin1)


@pytest.mark.parametrize("group", ["train", "privacy", "evaluate", "experiments"])
def test_a_group_left_with_every_key_commented_out_is_a_problem_not_a_silent_reset(tmp_path, group):
    """'train:' with its keys commented out is YAML null: DVC's --set-param train=null replaced params.yaml's whole
    group (the plan stage reads a null group as every default), while the preset names none of its keys."""
    preset = pr.load_preset(write(tmp_path, f"tau: 4.0\n{group}:\n  # rounds: 5\n"))
    assert preset == {"tau": 4.0, group: None}
    bad = pr.problems(preset, PARAMS)
    assert len(bad) == 1 and bad[0].startswith(f"{group}: null where params.yaml has a mapping") and "\n" not in bad[0]


def test_experiment_entries_are_checked_by_the_plan_rules():
    ok = {"method": "fedavg", "partition": "domain/seed0", "seed": 0, "study": "main"}
    assert pr.problems({"experiments": {"x": ok}}, PARAMS) == []
    assert pr.problems({"experiments": {"x": {**ok, "rounds": 9}}}, PARAMS) == []  # a train override
    bad = pr.problems(
        {
            "experiments": {
                "typo": {**ok, "lamda": 0.1},
                "nomethod": {**ok, "method": "fedmagic"},
                "seed7": {**ok, "partition": "domain/seed7", "seed": 7},
            }
        },
        PARAMS,
    )
    assert len(bad) == 3
    assert "experiments.typo" in bad[0] and "lamda" in bad[0]
    assert "experiments.nomethod" in bad[1] and "fedmagic" in bad[1]
    assert "experiments.seed7" in bad[2] and "partition.seeds" in bad[2]
    # ...unless the same preset also produces that partition
    assert (
        pr.problems(
            {"partition": {"seeds": [0, 7]}, "experiments": {"seed7": {**ok, "partition": "domain/seed7", "seed": 7}}},
            PARAMS,
        )
        == []
    )


def test_a_preset_that_drops_a_partition_the_params_experiments_train_on_is_refused():
    """A preset without experiments keeps params.yaml's: a partition they train on that the preset's partition.schemes
    or seeds no longer produce is named (dvc exp run would stop at that training, after the partitions and backbone)."""
    iid = [name for name, e in PARAMS["experiments"].items() if e["partition"] == "iid/seed0"]
    assert iid  # params.yaml trains on the iid partition (METHOD.md 7.2)
    bad = pr.problems({"partition": {"schemes": ["domain", "noniid_balanced", "extreme"]}}, PARAMS)
    assert [b.split(":")[0] for b in bad] == [f"params.yaml experiments.{name}.partition" for name in iid]
    assert all("'iid/seed0' is not produced" in b for b in bad)


def test_a_client_level_dp_entry_the_plan_stage_refuses_is_a_problem():
    """privacy.mode client with delta 0.5 on the domain partition's 3 clients: delta >= 1/3 promises nothing
    (accounting.federation_privacy), which the plan stage refuses before writing a plan; check must say so too."""
    dp = {"mode": "client", "noise_multiplier": 1.0, "clipping_norm": 1.0, "delta": 0.5}
    entry = {"method": "fedavg", "partition": "domain/seed0", "privacy": dp}
    bad = pr.problems({"experiments": {"x": entry}}, PARAMS)
    assert len(bad) == 1 and "experiments.x: privacy.delta 0.5 >= 1/3 " in bad[0]


@pytest.mark.parametrize(
    "text, named",
    [  # a scalar where the partition stage reads a list; a list of entries where params.yaml has a mapping
        ("partition:\n  seeds: 1\n", "partition.seeds: expected a list, got int 1"),
        ("experiments:\n  - fedavg\n", "experiments: expected a mapping of keys, got list ['fedavg']"),
    ],
)
def test_a_group_of_the_wrong_shape_is_one_line_naming_it_not_a_traceback(tmp_path, capsys, text, named):
    """`presets check` read partition.seeds and experiments itself (a TypeError, an AttributeError traceback);
    the plan stage's own check names them."""
    path = write(tmp_path, text)
    assert run_cli(pr.main, ["--params", str(ROOT / "params.yaml"), "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: 1 problem(s): {ROOT / 'params.yaml'} {named}\n"  # the --params file


@pytest.mark.parametrize(
    "text, problem",
    [  # a key the params file lacks, a group nulled, an entry the plan stage refuses
        ("tau:\n  a: 1\n", "tau.a: unknown key ({params} has no tau.a)"),
        ("tau: 4.0\ntrain:\n  # rounds: 5\n", "train: null where {params} has a mapping (every key commented out?)"),
        ("experiments:\n  x: {method: fedavg, partition: domain/seed9}\n", "{params} experiments.x.partition: "),
    ],
)
def test_a_problem_names_the_params_file_checked_against(tmp_path, capsys, text, problem):
    """`presets check --params other.yaml` said 'params.yaml has no tau.a' of the file it had read, other.yaml."""
    (params := tmp_path / "study" / "other.yaml").parent.mkdir()
    shutil.copy(ROOT / "params.yaml", params)
    path = write(tmp_path, text)
    assert run_cli(pr.main, ["--params", str(params), "check", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {path}: 1 problem(s): {problem.format(params=params)}")


# ---------------------------------------------------------------------------------------------- applying
def overlay(params: dict, preset: dict, top: bool = True) -> dict:
    """The rules of pipeline.presets' docstring written out: leaves replace, mappings merge key by key,
    experiments are replaced whole."""
    merged = copy.deepcopy(params)
    for key, value in preset.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and not (top and key == "experiments"):
            merged[key] = overlay(merged[key], value, False)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_dvc_set_param_overrides_reproduce_the_overlay(tmp_path, path):
    """What DVC's own --set-param machinery writes equals params.yaml with the preset overlaid."""
    preset = pr.load_preset(path)
    target = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", target)
    apply_overrides(str(target), pr.overrides(preset))
    written = load_params(target)
    assert written == overlay(PARAMS, preset) == pr.apply_preset(PARAMS, preset)
    # experiments replaced (not merged), other groups merged key by key
    assert written["experiments"] == preset["experiments"]
    assert written["ingest"] == PARAMS["ingest"]
    assert written["train"]["proximal_mu"] == PARAMS["train"]["proximal_mu"]


def test_strings_survive_the_override_grammar(tmp_path):
    params = {"backbone": {"name": "x", "revision": "main"}, "ids": [1], "z": None}
    target = write(tmp_path, yaml.safe_dump(params), "params.yaml")
    tricky = {
        "backbone": {"name": "/models/it's a \\dir\\", "revision": "a=b: c, [d] {e} 'f' # g"},
        "ids": ["1", 2.5, True, None],
        "z": "null",
    }
    apply_overrides(str(target), pr.overrides(tricky))
    assert load_params(target) == tricky


def test_show_and_dry_run_print_the_overrides(tmp_path, capsys):
    preset = write(tmp_path, "tau: 4.0\ntrain:\n  rounds: 2\n")
    assert pr.main(["--params", str(ROOT / "params.yaml"), "show", str(preset)]) == 0
    assert capsys.readouterr().out.splitlines() == ["tau=4.0", "train.rounds=2"]
    assert (
        pr.main(["--params", str(ROOT / "params.yaml"), "run", str(preset), "--name", "t4", "--queue", "--dry-run"])
        == 0
    )
    out = capsys.readouterr().out
    assert "dvc exp run --name t4 --queue --set-param tau=4.0 --set-param train.rounds=2" in out
    bad = write(tmp_path, "tua: 4.0\n", "bad.yaml")
    assert run_cli(pr.main, ["--params", str(ROOT / "params.yaml"), "run", str(bad), "--dry-run"]) == 2
    assert "tua: unknown key" in capsys.readouterr().err


@pytest.mark.slow
def test_run_makes_a_dvc_experiment(tmp_path, monkeypatch):
    """End to end in a scratch repo: the preset run is a DVC experiment with the overridden params."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    (repo / "params.yaml").write_text(
        "train:\n  rounds: 3\n  lr: 0.1\npartition: {schemes: [domain], seeds: [0]}\n"
        "experiments:\n  a: {method: fedavg, partition: domain/seed0}\n"
    )
    (repo / "dvc.yaml").write_text(
        "stages:\n  echo:\n    cmd: python -c \"import yaml; d=yaml.safe_load(open('params.yaml')); "
        "open('out.txt','w').write(str(d['train']['rounds']) + str(sorted(d['experiments'])))\"\n"
        "    params: [train, experiments]\n    outs: [out.txt]\n"
    )
    (repo / ".gitignore").write_text("/out.txt\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "init"], cwd=repo, check=True)
    preset = write(
        tmp_path, "train:\n  rounds: 7\nexperiments:\n  b: {method: fedkd, partition: domain/seed0}\n", "preset.yaml"
    )
    monkeypatch.chdir(repo)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    assert pr.main(["run", str(preset), "--name", "seven"]) == 0
    assert (repo / "out.txt").read_text() == "7['b']"  # experiments replaced, not merged
    shown = subprocess.run(
        [sys.executable, "-m", "dvc", "exp", "show", "--json"], cwd=repo, check=True, capture_output=True, text=True
    ).stdout
    assert '"seven"' in shown


def test_parts_split_a_preset_by_seed_then_run_the_whole(tmp_path):
    preset = write(
        tmp_path,
        "tau: 4.0\nexperiments:\n"
        "  a-s0: {method: fedavg, partition: domain/seed0, seed: 0}\n"
        "  b-s0: {method: fedkd, partition: domain/seed0, seed: 0}\n"
        "  a-s1: {method: fedavg, partition: domain/seed0, seed: 1}\n",
    )
    cmds = pr.run_commands(preset, ROOT / "params.yaml", "study", "seed", ("--queue",))
    names = [c[c.index("--name") + 1] for c in cmds]
    assert names == ["study-seed0", "study-seed1", "study"]  # the whole comes last
    assert all("--queue" in c and "--set-param" in c and "tau=4.0" in c for c in cmds)

    def experiments_of(cmd):
        target = write(tmp_path, yaml.safe_dump(PARAMS), "params.yaml")
        apply_overrides(str(target), [v for v in cmd if v.startswith(("~experiments", "+experiments"))])
        return load_params(target)["experiments"]

    assert experiments_of(cmds[0]) == {
        "a-s0": {"method": "fedavg", "partition": "domain/seed0", "seed": 0},
        "b-s0": {"method": "fedkd", "partition": "domain/seed0", "seed": 0},
    }
    assert list(experiments_of(cmds[1])) == ["a-s1"] and list(experiments_of(cmds[2])) == ["a-s0", "b-s0", "a-s1"]
    with pytest.raises(pr.PresetError, match="same 'method'"):
        pr.run_commands(
            write(tmp_path, "experiments:\n  a: {method: fedavg, partition: domain/seed0}\n"),
            ROOT / "params.yaml",
            "x",
            "method",
        )
    with pytest.raises(pr.PresetError, match="one of the experiments' keys"):
        pr.run_commands(preset, ROOT / "params.yaml", "x", "lr")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_whole_restores_the_parts_trainings_from_dvc_run_cache(tmp_path, monkeypatch):
    """The promise of --parts, against DVC itself: a scratch repo whose per-experiment stage declares the outputs
    and plots of our train stage (dvc.yaml, as they are) counts its real runs; after the parts, the whole runs
    none of them again, yet has every output, and its report stage sees all of them."""
    real = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]["do"]
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    (repo / "params.yaml").write_text(
        yaml.safe_dump(
            {
                "tau": 5.0,
                "partition": {"schemes": ["domain"], "seeds": [0]},
                "experiments": {"x": {"method": "fedavg", "partition": "domain/seed0"}},
            },
            sort_keys=False,
        )
    )
    outs = [next(iter(o)) if isinstance(o, dict) else o for o in real["outs"] + real["plots"]]
    train = (
        "import sys, os, pathlib, yaml; k = sys.argv[1]; "
        "open(os.environ['RUNS_LOG'], 'a').write(k + '\\n'); "
        "e = yaml.safe_load(open('params.yaml'))['experiments'][k]; "
        f"outs = [o.replace('${{key}}', k) for o in {outs!r}]; d = pathlib.Path(outs[0]); "
        "d.mkdir(parents=True, exist_ok=True); (d / 'adapter.txt').write_text(str(e)); "
        "[pathlib.Path(o).parent.mkdir(parents=True, exist_ok=True) for o in outs[1:]]; "
        '[pathlib.Path(o).write_text(\'[{"round": 1, "val_loss_mean": 2.0}]\') for o in outs[1:]]'
    )
    (repo / "train.py").write_text(train.replace("; ", "\n"))
    assert outs[0] == "models/${key}"
    (repo / "dvc.yaml").write_text(
        yaml.safe_dump(
            {
                "stages": {
                    "train": {
                        "foreach": "${experiments}",
                        "do": {
                            "cmd": "python train.py ${key}",
                            "deps": ["train.py"],
                            "params": ["experiments.${key}"],
                            "outs": real["outs"],
                            "plots": real["plots"],
                        },
                    },
                    "report": {
                        "cmd": "python -c \"import os; open('report.txt','w').write(' '.join(sorted(os.listdir('models'))))\"",
                        "deps": ["models"],
                        "params": ["experiments"],
                        "outs": ["report.txt"],
                    },
                }
            },
            sort_keys=False,
        )
    )
    (repo / ".gitignore").write_text("/models\n/report.txt\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "init"], cwd=repo, check=True)
    preset = write(
        tmp_path,
        "tau: 4.0\nexperiments:\n"
        "  a-s0: {method: fedavg, partition: domain/seed0, seed: 0}\n"
        "  b-s0: {method: fedkd, partition: domain/seed0, seed: 0}\n"
        "  a-s1: {method: fedavg, partition: domain/seed0, seed: 1}\n",
        "preset.yaml",
    )
    runs_log = tmp_path / "runs.log"
    monkeypatch.setenv("RUNS_LOG", str(runs_log))
    monkeypatch.chdir(repo)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    # --temp: each experiment in a fresh copy of the commit, as a queued one runs (no lock entries carried over)
    assert (
        pr.main(
            ["--params", str(repo / "params.yaml"), "run", str(preset), "--name", "st", "--temp", "--parts", "seed"]
        )
        == 0
    )
    # each experiment trained exactly once, in its part; the whole restored all three and reported over them
    assert sorted(runs_log.read_text().split()) == ["a-s0", "a-s1", "b-s0"]
    # export reads the experiment at its commit (the workspace never had these outputs: --temp), cached
    # outputs from DVC's cache, without changing the workspace
    dest = tmp_path / "exported"
    assert pr.main(["export", "st", str(dest), "models/*/adapter.txt", "report.txt=summary.txt"]) == 0
    assert (dest / "summary.txt").read_text() == "a-s0 a-s1 b-s0"
    assert "fedkd" in (dest / "models/b-s0/adapter.txt").read_text()
    assert yaml.safe_load((dest / "params.yaml").read_text())["tau"] == 4.0 and (dest / "dvc.lock").exists()
    record = yaml.safe_load((dest / "EXPERIMENT.yaml").read_text())
    assert record["experiment"] == "st" and len(record["files"]) == 6 and not (repo / "report.txt").exists()
    assert run_cli(pr.main, ["export", "st", str(dest), "nothing.txt"]) == 2  # a missing path is an error naming it
    assert run_cli(pr.main, ["export", "no-such-experiment", str(dest)]) == 2
    subprocess.run([sys.executable, "-m", "dvc", "exp", "apply", "st"], cwd=repo, check=True)
    assert (repo / "report.txt").read_text() == "a-s0 a-s1 b-s0"
    assert "fedkd" in (repo / "models/b-s0/adapter.txt").read_text()
    shown = subprocess.run(
        [sys.executable, "-m", "dvc", "exp", "show", "--json"], cwd=repo, check=True, capture_output=True, text=True
    ).stdout
    assert all(f'"{n}"' in shown for n in ("st-seed0", "st-seed1", "st"))


def test_a_profiles_experiments_without_a_seed_take_its_top_level_seed():
    """A profile sets the seed once for the experiments it does not seed themselves (the entry's own seed wins)."""
    from pipeline.planning import declared

    preset = {
        "seed": 3,
        "experiments": {
            "a": {"method": "fedavg", "partition": "domain/seed0"},
            "b": {"method": "fedkd", "partition": "domain/seed0", "seed": 1},
        },
    }
    assert pr.problems(preset, PARAMS) == []
    assert [e.seed for e in declared(pr.apply_preset(PARAMS, preset))] == [3, 1]
    assert pr.overrides(preset)[0] == "seed=3"
