"""pipeline.experiments (the one reader of `experiments:` and of plans) and the package's import structure."""

from __future__ import annotations

import ast
import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from pipeline.common.config import ConfigError, load_params

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipeline"
DVC_YAML = yaml.safe_load((ROOT / "dvc.yaml").read_text())


# ------------------------------------------------------------------------------------------- import structure
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """pipeline modules ``path`` imports anywhere in its source (function-level imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PIPELINE.rglob("*.py")}
    return {m: {n for n in _imports(p) if n in modules and n != m} for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_cycle_finder_finds_a_planted_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_in_pipeline():
    # function-level imports count: a local import that works around a cycle is still a cycle in the design
    assert find_cycle(import_graph()) is None


def test_package_init_files_hold_no_code():
    # dvc.yaml lists the modules a stage imports; the packages' __init__ files are not listed, so they must not
    # hold anything a result could depend on
    for init in PIPELINE.rglob("__init__.py"):
        body = ast.parse(init.read_text()).body
        assert all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body), init


# ------------------------------------------------------------------------------------------- experiments
def _params(**changes) -> dict:
    params = copy.deepcopy(load_params(ROOT / "params.yaml"))
    for dotted, value in changes.items():
        node = params
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return params


def _plans(params: dict, out: Path) -> dict[str, str]:
    from pipeline.planning import check_params, write_plans

    return {p.name: p.read_text() for p in write_plans(check_params(params), out)}


@pytest.mark.parametrize(
    "key, value",
    [
        ("model.cache_max_gb", 0.5),
        ("model.cache_dir", "/elsewhere/prefix"),
        ("train.admission_timeout_s", 30),
        ("train.round_timeout_s", 60),
    ],
)
def test_settings_that_cannot_change_a_result_leave_every_plan_unchanged(tmp_path, key, value):
    before = _plans(_params(), tmp_path / "a")
    after = _plans(_params(**{key: value}), tmp_path / "b")
    assert after == before
    # ...and the train stages depend on their plan, never on params: so the change reruns no train stage
    train = DVC_YAML["stages"]["train"]["do"]
    assert "params" not in train and "models/plans/${key}.json" in train["deps"]


def test_settings_that_change_results_change_the_plans_they_affect(tmp_path):
    before = _plans(_params(), tmp_path / "a")
    # a float16 prefix cache changes the logits: every plan with the cache on changes
    half = _plans(_params(**{"model.cache_dtype": "float16"}), tmp_path / "b")
    assert all(json.loads(half[n]).get("cache_dtype") == "float16" for n in half)
    assert all("cache_dtype" not in json.loads(before[n]) for n in before)
    # tau: the selective-KD experiments without their own tau, nothing else
    tau4 = _plans(_params(tau=4.0), tmp_path / "c")
    changed = {n for n in before if before[n] != tau4[n]}
    assert changed == {
        "fedselectkd-domain.json",
        "fedselectkd-iid.json",
        "fedselectkd-noniid.json",
        "fedselectkd-extreme.json",
        "fedselectkd-sampling.json",
        "post_addition.json",
    }


def test_declared_resolves_tau_and_seed_as_the_plan_does():
    from pipeline.planning import declared

    params = _params(tau=4.5)
    params["experiments"] = {
        "a": {"method": "post_addition", "partition": "extreme/seed0"},  # selective: the top-level tau
        "b": {"method": "fedavg", "partition": "domain/seed2", "fraction_train": 0.67},
        "c": {"method": "fedselectkd", "partition": "domain/seed0", "tau": 2, "seed": 3, "study": "tau_sweep"},
    }
    a, b, c = declared(params)
    assert (a.tau, a.seed, a.study, a.scheme) == (4.5, 0, "main", "extreme")
    # the seed is the entry's (0 when absent), never read from the partition's name
    assert (b.tau, b.seed, b.variant, b.scheme) == (None, 0, "fraction_train=0.67", "domain")
    assert (c.tau, c.seed, c.study) == (2.0, 3, "tau_sweep")


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"method": "fedavg", "partition": "domain/seed0", "tau": 3}, "does not use it"),
        ({"method": "fedavg", "partition": "domain"}, "'<scheme>/seed<k>'"),
        ({"method": "nope", "partition": "domain/seed0"}, "experiments.x.method"),
        ({"partition": "domain/seed0"}, r"missing required key\(s\) \['method'\]"),
        ({"method": "fedavg", "partition": "domain/seed0", "lr_typo": 1}, "unknown key"),
        ({"method": "fedavg", "partition": "domain/seed0", "privacy": {"mode": "example"}}, "exactly one of"),
        ({"method": "fedavg", "partition": "domain/seed0", "privacy": {"epsilon": 3}}, "unknown key"),
        ({"method": "fedavg", "partition": "domain/seed0", "privacy": 3}, "expected a mapping"),
        (
            {"method": "single", "partition": "domain/seed0", "privacy": {"mode": "example", "target_epsilon": 3}},
            "sends nothing",
        ),
    ],
)
def test_a_bad_entry_is_one_line_naming_it(entry, message):
    from pipeline.planning import declared

    params = _params()
    params["experiments"] = {"x": entry}
    with pytest.raises((ConfigError, ValueError), match=message) as err:
        declared(params)
    assert "experiments.x" in str(err.value) and "\n" not in str(err.value)


def test_an_entrys_unknown_key_says_what_its_privacy_key_holds_naming_the_file_read():
    """Its allowed keys said 'privacy (a mapping of params.yaml privacy keys)': a set of keys, of ./params.yaml
    whatever file was read."""
    from pipeline.planning import declared

    params = _params()
    params["experiments"] = {"x": {"method": "fedavg", "partition": "domain/seed0", "lr_typo": 1}}
    with pytest.raises(ConfigError) as err:
        declared(params, "study/params.yaml")
    assert "'study', 'tau'], privacy (a mapping from study/params.yaml's privacy keys to the entry's values) and " in (
        str(err.value)
    )


def test_resolve_plan_names_the_params_file_of_a_train_group_not_a_mapping():
    """resolve_plan, called alone (benchmarks/engine.py, scale.py), reads params' train group: a non-mapping is
    named in the file it was given, not in ./params.yaml."""
    from pipeline.planning import declared, resolve_plan

    exp = declared(_params())[0]
    with pytest.raises(ConfigError, match=r"^study/params\.yaml train: expected a mapping of keys, got list \[5\]$"):
        resolve_plan(exp, _params(train=[5]), "study/params.yaml")


@pytest.mark.parametrize(
    "key",
    [
        "train.lr",
        "train.weight_decay",
        "train.kd_temperature",
        "train.proximal_mu",
        "train.fedopt.server_lr",
        "train.fedopt.eps",
        "model.adapter_init_std",
        "model.cache_max_gb",  # int(inf * 2**30) fails in the train stage
    ],
)
def test_an_infinite_number_is_refused_at_planning_in_one_line(key):
    """YAML's .inf passes a float's lower bound; AdamW at lr or weight_decay inf, a KL at temperature inf (x T^2),
    a proximal term inf x 0, a server step inf x delta, a normal_ of std inf all give NaN weights."""
    from pipeline.planning import check_params

    with pytest.raises(ConfigError, match=rf"{key.split('.')[-1]}=inf is out of range; allowed: a finite number") as e:
        check_params(_params(**{key: float("inf")}))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "privacy, line",
    [
        (
            {"mode": "example", "noise_multiplier": float("nan")},
            "noise_multiplier=nan is out of range; allowed: a finite number",
        ),
        ({"mode": "example", "noise_multiplier": -1.0}, "noise_multiplier=-1.0 is out of range; allowed: >= 0"),
        (
            {"mode": "example", "target_epsilon": float("inf")},
            "target_epsilon=inf is out of range; allowed: a finite number",
        ),
        ({"mode": "example", "target_epsilon": 0.0}, "target_epsilon=0.0 is out of range; allowed: > 0"),
        (
            {"mode": "example", "noise_multiplier": 1.0, "delta": float("nan")},
            "delta=nan is out of range; allowed: a finite number",
        ),
        ({"mode": "example", "noise_multiplier": 1.0, "delta": 1.0}, "delta=1.0 is out of range; allowed: > 0 and < 1"),
        (
            {"mode": "example", "noise_multiplier": 1.0, "max_grad_norm": float("nan")},
            "max_grad_norm=nan is out of range; allowed: > 0",
        ),
        (
            {"mode": "client", "noise_multiplier": 1.0, "clipping_norm": -float("inf")},
            "clipping_norm=-inf is out of range; allowed: > 0",
        ),
        (
            {"mode": "client", "noise_multiplier": 1.0, "clipping": "adaptive", "clipped_count_stddev": float("inf")},
            "clipped_count_stddev=inf is out of range; allowed: a finite number",
        ),
        (
            {"mode": "client", "noise_multiplier": 1.0, "clipping": "adaptive", "clip_norm_lr": -0.2},
            "clip_norm_lr=-0.2 is out of range; allowed: > 0",
        ),
        (
            {
                "mode": "client",
                "noise_multiplier": 1.0,
                "clipping_norm": 1.0,
                "secagg": {"clipping_range": float("inf")},
            },
            "secagg.clipping_range=inf is out of range; allowed: a finite number",
        ),
    ],
)
def test_a_dp_number_out_of_range_is_refused_at_planning_in_one_line_naming_the_file_and_key(privacy, line):
    """The DP settings' numbers (noise multiplier, target epsilon, delta, the clipping bounds, adaptive clipping's
    rate and count noise, SecAgg+'s range) are refused by the plan stage, NaN, inf (but a clipping bound's .inf, no
    clipping) and out-of-range values alike, in one line naming the params file and the key: not by opacus, Flower
    or torch in the train stage. In the params file's group and in an entry's overrides of it."""
    from pipeline.planning import check_params

    params = _params(privacy={**load_params(ROOT / "params.yaml")["privacy"], **privacy})
    with pytest.raises(ConfigError) as e:
        check_params(params, "site/params.yaml")
    assert str(e.value) == f"site/params.yaml privacy.{line}"
    entry = next(name for name, raw in params["experiments"].items() if raw["method"] == "fedavg")
    params = _params()
    params["experiments"][entry]["privacy"] = privacy
    with pytest.raises(ConfigError) as e:
        check_params(params, "site/params.yaml")
    assert str(e.value) == f"site/params.yaml experiments.{entry} privacy.{line}"


def test_an_infinite_clipping_bound_and_tau_still_plan():
    """.inf is meaningful where the docs give it a meaning: no clipping (privacy.md, with noise 0) and a tau every
    entropy is below (H(q_g) < inf: KD on every token)."""
    from pipeline.planning import check_params

    inf = float("inf")
    assert check_params(_params(**{"privacy.max_grad_norm": inf}))
    plans = check_params(_params(tau=inf))
    assert plans["fedselectkd-domain"]["tau"] == inf


def test_an_entrys_train_mapping_overrides_merge_key_by_key_into_params_train():
    """An entry overriding one key of a `train` mapping keeps the params file's other keys of it (as the entry's
    privacy.secagg and a preset's mappings do), not the code's defaults: here gpu-study's stop rule with a lower
    ceiling stays enabled with its own min_rel_improvement, and fedopt's other settings stay the params file's."""
    from pipeline.planning import declared, resolve_plan

    stop = {"enabled": True, "min_rel_improvement": 0.001, "patience": 3, "max_rounds": 60}
    params = _params(**{"train.stop": stop, "train.fedopt.server_optimizer": "adam", "train.fedopt.server_lr": 0.1})
    params["experiments"] = {
        "a": {"method": "fedavg", "partition": "domain/seed0", "stop": {"max_rounds": 30}},
        "b": {"method": "fedopt", "partition": "domain/seed0", "fedopt": {"beta_2": 0.9}},
    }
    plans = {e.name: resolve_plan(e, params) for e in declared(params)}
    assert plans["a"]["train"]["stop"] == {**stop, "max_rounds": 30} and plans["a"]["train"]["rounds"] == 30
    fedopt = plans["b"]["train"]["fedopt"]
    assert (fedopt["server_optimizer"], fedopt["server_lr"], fedopt["beta_2"]) == ("adam", 0.1, 0.9)


def test_an_experiment_name_yaml_reads_as_a_number_is_one_line():
    # `7:` or `2024:` in params.yaml experiments is an int key: it was a TypeError traceback ("/" in 7)
    from pipeline.planning import declared

    params = _params()
    params["experiments"] = {7: {"method": "fedavg", "partition": "domain/seed0"}}
    with pytest.raises(ConfigError, match=r"^params.yaml experiments: invalid experiment name 7 \(a string"):
        declared(params)


def test_a_misspelt_params_group_is_refused_at_planning_not_skipped():
    # `trian:` beside `train:` (or a group a stage never reads) planned every experiment from the defaults, exit 0
    from pipeline.planning import check_params

    params = _params()
    params["trian"] = {"rounds": 40}
    with pytest.raises(
        ConfigError, match=r"^site/params.yaml: unknown top-level key\(s\) \['trian'\]; the groups are tau"
    ):
        check_params(params, "site/params.yaml")


@pytest.mark.parametrize("folder", ["", "  "])
def test_a_prefix_cache_folder_that_names_no_folder_is_refused_not_the_project_root(tmp_path, folder):
    # model.cache_dir "" was the project root itself: the cache wrote its entries there and pruned among them
    from pipeline.experiments.settings import load_run_settings
    from pipeline.planning import check_params

    message = "model.cache_dir: is empty or blank: no folder (a relative one is under the project root)"
    with pytest.raises(ConfigError, match=rf"^site/params.yaml {re.escape(message)}$"):
        check_params(_params(**{"model.cache_dir": folder}), "site/params.yaml")
    (path := tmp_path / "params.yaml").write_text(yaml.safe_dump(_params(**{"model.cache_dir": folder})))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))} {re.escape(message)}$"):
        load_run_settings(path)
    assert load_run_settings(ROOT / "params.yaml").cache.cache_dir == "data/cache/prefix"


def test_an_experiment_name_the_train_stage_cannot_carry_is_refused_at_planning():
    """dvc.yaml runs `python -m pipeline.train --experiment ${key}` through a shell and writes models/${key}. A name
    with a space passed planning and reached the train stage as two arguments (argparse: unrecognized arguments);
    '..' made models/.. (the project root) the run's output directory; '-x' reads as an option. Each is refused when
    the plans are made, and a name that passes is one argument of that command and a folder inside models/."""
    import shlex

    from pipeline.planning import declared

    command = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]["do"]["cmd"]
    entry = {"method": "fedavg", "partition": "domain/seed0"}
    for name in ["fedavg domain", "..", ".", "-x", "a;b", "a\nb", "$HOME", "x'y"]:
        with pytest.raises(ConfigError, match=r"^params.yaml experiments: invalid experiment name "):
            declared(_params(experiments={name: entry}))
    for name in ["fedavg-domain", "sel_s0", "tau-1.5", "seed7"]:
        assert [e.name for e in declared(_params(experiments={name: entry}))] == [name]
        argv = shlex.split(command.replace("${key}", name))
        assert argv[argv.index("--experiment") + 1 :] == [name]
        assert (ROOT / "models" / name).resolve().parent == ROOT / "models"


def test_an_entrys_train_override_either_changes_its_plan_or_is_refused():
    """`kd_lambda: 0.5` on a fedavg entry (which distils nothing) planned exactly as without it, and the tables
    labelled the entry `fedavg kd_lambda=0.5` as if it were a variant (with_labels); so did every override of a key
    its method never reads (hardkd's kd_gate, fedkd's tau_scale, single's fraction_train, fedavg's proximal_mu ...),
    where `tau` on such a method is refused. Each such override is now refused at planning, naming it; one the method
    reads still reaches its plan."""
    from pipeline.experiments.methods import METHODS
    from pipeline.planning import declared, resolve_plan

    overrides = {  # each differs from params.yaml's value and is valid on its own
        "kd_lambda": 0.5,
        "kd_temperature": 2.0,
        "kd_direction": "student_to_teacher",
        "entropy_log_base": "2",
        "tau_scale": "max_entropy",
        "kd_gate": "margin",
        "new_client": "Product",
        "join": {"max_round": 2},
        "local_adapter": "reset",
        "fraction_train": 0.5,
        "transfer_dtype": "int8",
        "centralized_steps": "epoch",
        "proximal_mu": 0.5,
        "fedopt": {"server_lr": 0.5},
        "fedtrimmedavg": {"beta": 0.2},
    }
    refused = set()
    for method, spec in METHODS.items():
        entry = {"method": method, "partition": "extreme/seed0"} | ({"tau": 0.5} if spec.uses_tau else {})
        params = _params(experiments={"x": entry})
        base = resolve_plan(declared(params)[0], params)
        for key, value in overrides.items():
            params = _params(experiments={"x": entry | {key: value}})
            try:
                plan = resolve_plan(declared(params)[0], params)
            except ConfigError as exc:
                assert str(exc).startswith("params.yaml experiments.x: ") and repr(key) in str(exc), str(exc)
                refused.add((method, key))
                continue
            assert plan != base, f"{method}: {key}: {value!r} planned as without it"
    assert {("fedavg", "kd_lambda"), ("hardkd", "kd_gate"), ("single", "fraction_train")} <= refused
    assert not {("fedkd", "kd_lambda"), ("fedprox", "proximal_mu"), ("centralized", "centralized_steps")} & refused


def test_an_entrys_privacy_overrides_reach_its_plan_alone():
    """A privacy-utility study in one DVC experiment: each entry's `privacy` mapping is merged over params.yaml
    privacy for that entry; entries without one keep the plan (and hash) they had."""
    from pipeline.experiments.entries import with_labels
    from pipeline.planning import declared, resolve_plan

    params = _params()
    before = {e.name: resolve_plan(e, params) for e in declared(params)}
    params["experiments"] = {
        "plain": {"method": "fedavg", "partition": "domain/seed0", "study": "privacy"},
        "eps3": {
            "method": "fedavg",
            "partition": "domain/seed0",
            "study": "privacy",
            "privacy": {"mode": "example", "target_epsilon": 3, "max_grad_norm": 0.5},
        },
        "sigma": {
            "method": "fedavg",
            "partition": "domain/seed0",
            "study": "privacy",
            "privacy": {"mode": "example", "noise_multiplier": 1.1},
        },
    }
    plain, eps3, sigma = declared(params)
    assert resolve_plan(plain, params) == before["fedavg-domain"] | {"experiment": "plain", "study": "privacy"}
    plan = resolve_plan(eps3, params)
    assert plan["privacy"] == {
        "mode": "example",
        "noise_multiplier": None,
        "target_epsilon": 3,
        "max_grad_norm": 0.5,
        "delta": None,
        "accountant": "rdp",
    }
    assert (plain.dp, eps3.dp, sigma.dp) == ("", "DP-SGD ε≤3 δ≤1e-5", "DP-SGD σ=1.1")
    assert with_labels([plain, eps3, sigma]) == {
        "plain": "fedavg",
        "eps3": "fedavg DP-SGD ε≤3 δ≤1e-5",
        "sigma": "fedavg DP-SGD σ=1.1",
    }


def test_an_entrys_privacy_override_reaches_secure_aggregation_and_merges_its_secagg_keys():
    """An entry may turn SecAgg+ on for itself; its `secagg` mapping is merged key by key over params.yaml's (a
    key it does not name keeps params.yaml's value, not the default)."""
    from pipeline.experiments.entries import with_labels
    from pipeline.planning import declared, resolve_plan

    params = _params(**{"privacy.secagg.clipping_range": 2.0})
    fedavg = {"method": "fedavg", "partition": "domain/seed0", "study": "secure"}
    params["experiments"] = {
        "plain": fedavg,
        "secure": {
            **fedavg,
            "privacy": {"secure_aggregation": True, "secagg": {"num_shares": 3, "reconstruction_threshold": 2}},
        },
        "both": {**fedavg, "privacy": {"mode": "example", "target_epsilon": 3, "secure_aggregation": True}},
    }
    plain, secure, both = declared(params)
    assert "privacy" not in resolve_plan(plain, params)
    assert resolve_plan(secure, params)["privacy"] == {
        "mode": "none",
        "secure_aggregation": True,
        "secagg": {"num_shares": 3, "reconstruction_threshold": 2, "clipping_range": 2.0, "quantization_range": 2**22},
    }
    assert resolve_plan(both, params)["privacy"]["secagg"]["num_shares"] == 1.0  # params.yaml's
    assert (plain.dp, secure.dp, both.dp) == ("", "SecAgg+", "DP-SGD ε≤3 δ≤1e-5 + SecAgg+")
    assert with_labels([plain, secure, both])["secure"] == "fedavg SecAgg+"
    params["experiments"] = {
        "x": {"method": "single", "partition": "domain/seed0", "privacy": {"secure_aggregation": True}}
    }
    with pytest.raises(ConfigError, match=r"^params.yaml experiments.x.privacy: method 'single' sends nothing"):
        declared(params)


def test_run_settings_come_from_params_with_the_experiments_own_override(tmp_path):
    from pipeline.experiments.settings import load_run_settings

    params = _params(**{"train.round_timeout_s": 30, "model.cache_max_gb": 1.5})
    params["experiments"]["fedavg-domain"]["round_timeout_s"] = 90
    (path := tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    assert load_run_settings(path, "fedavg-domain").round_timeout_s == 90
    assert load_run_settings(path, "fedkd-domain").round_timeout_s == 30
    s = load_run_settings(path)
    assert (s.round_timeout_s, s.cache.cache_max_gb) == (30, 1.5)
    path.write_text(yaml.safe_dump(_params(**{"train.round_timeout_s": 0})))
    with pytest.raises(ConfigError, match="round_timeout_s"):
        load_run_settings(path)


def test_plan_paths_come_from_the_path_table(tmp_path):
    from pipeline.experiments.plans import read_plan
    from pipeline.planning import check_params, declared, write_plans

    params = _params()
    out = tmp_path / "plans"
    write_plans(check_params(params), out)
    hard = read_plan(out / "hardkd-domain.json")
    assert hard.paths == {
        "examples": "data/processed/examples.parquet",
        "partition": "data/partitions/domain/seed0.json",
        "backbone": "models/backbone",
        "out_dir": f"data/cache/runs/hardkd-domain-{hard.hash[:16]}",
        "model_dir": "models/hardkd-domain",
        "reports_dir": "reports/train/hardkd-domain",
        "postags": "data/processed/postags.parquet",
    }
    assert "paths" not in json.loads((out / "hardkd-domain.json").read_text())  # not a result: not in the plan
    assert len(declared(params)) == len(list(out.glob("*.json")))


@pytest.mark.parametrize("privacy", [None, {}])
def test_a_plan_whose_privacy_is_null_or_empty_reads_as_one_without_privacy(tmp_path, privacy):
    """A hand-edited plan with ``"privacy": null`` (or ``{}``) is a plan without privacy, read as the same plan with
    the key left out, not 'not a plan file (... multiple values for keyword argument 'privacy')'."""
    from pipeline.experiments.plans import read_plan
    from pipeline.planning import check_params, write_plans

    write_plans(check_params(_params()), tmp_path / "plans")
    raw = json.loads((tmp_path / "plans" / "fedavg-domain.json").read_text())
    raw.pop("privacy", None)
    (without := tmp_path / "without.json").write_text(json.dumps(raw))
    (edited := tmp_path / "edited.json").write_text(json.dumps(raw | {"privacy": privacy}))
    assert read_plan(edited).privacy is None
    assert read_plan(edited).hash == read_plan(without).hash


@pytest.mark.parametrize(
    "changes, name",
    [  # the partition stage writes data/partitions/<scheme>/seed<k>.json for partition.schemes x partition.seeds only
        ({"experiments.x": {"method": "fedavg", "partition": "domain/seed1"}}, "x"),
        ({"partition.seeds": [1], "experiments": {"x": {"method": "fedavg", "partition": "domain/seed01"}}}, "x"),
        ({"partition.schemes": ["domain", "noniid_balanced", "extreme"]}, "fedavg-iid"),
    ],
)
def test_an_experiment_on_a_partition_no_stage_produces_is_refused_by_the_plan_stage(changes, name):
    """Its train stage's dep data/partitions/<partition>.json has no producer: dvc repro stops there (after the
    plan, partitions and backbone), or trains on a stale file a former params left in the workspace."""
    from pipeline.planning import check_params

    params = _params(**changes)
    partition = params["experiments"][name]["partition"]
    with pytest.raises(ConfigError, match=rf"experiments\.{name}\.partition: '{partition}' is not produced") as err:
        check_params(params)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "key, value, problem",
    [
        ("train.lr", "1e-5", "lr: expected a number, got str '1e-5'"),  # YAML 1.1 reads 1e-5 (no dot) as a string
        ("train.stop", {"enabld": True}, "stop: unknown key(s) ['enabld']"),
        ("train.fedopt", {"server_lr": 0}, "fedopt.server_lr=0 is out of range"),
        ("train.kd_gate", "entrpy", "kd_gate 'entrpy' is not a KD gate"),  # a registry name: checked by planning
    ],
)
def test_a_bad_value_of_params_train_is_named_where_it_is_not_in_an_experiment_that_does_not_set_it(
    key, value, problem
):
    """The value is params.yaml's train group's (no experiment entry sets lr, stop or fedopt): the line names that
    record, not the first experiment (single-domain), whose entry holds no such key."""
    from pipeline.planning import check_params

    assert not any(key.split(".")[1] in entry for entry in _params()["experiments"].values())
    with pytest.raises(ConfigError) as err:
        check_params(_params(**{key: value}))
    assert str(err.value).startswith(f"params.yaml train.{problem}") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "key, value, problem",
    [
        ("tau", "5", "tau: expected a number, got str '5'"),
        ("tau", -1.0, "tau=-1.0 is out of range; allowed: > 0"),
        ("seed", -1, "seed=-1 is out of range; allowed: >= 0"),
        ("seed", 0.5, "seed: expected an integer, got float 0.5"),
    ],
)
def test_a_bad_top_level_tau_or_seed_is_named_as_the_top_level_key_not_as_the_first_experiment(key, value, problem):
    """The entries inherit params.yaml's top-level tau and seed (no entry sets seed; tau: every selective-KD entry
    without its own): the line names that key, not the first experiment that inherits it (fedselectkd-domain,
    single-domain)."""
    from pipeline.planning import check_params

    assert all("seed" not in entry for entry in _params()["experiments"].values())
    with pytest.raises(ConfigError) as err:
        check_params(_params(**{key: value}))
    assert str(err.value) == f"params.yaml {problem}"
