"""Run-time settings travel from the stage entry points (issue 30, item 1): the train stage and a deployed ServerApp
read them from a params file they name, a ClientApp from its node config, run config or the server's message;
nothing below the entry points reads a params file, and a client never falls back to defaults it was not given."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
import yaml
from flwr.app import ConfigRecord, Context, Message, RecordDict

from pipeline.common.config import ConfigError
from pipeline.experiments.settings import CacheConfig, RunSettings, load_run_settings
from pipeline.federation.protocol import CONFIG_KEY, client_cache_config, client_settings_config

ROOT = Path(__file__).resolve().parents[1]


def _context(node_config=None, run_config=None) -> Context:
    return Context(
        run_id=1, node_id=5, node_config=dict(node_config or {}), state=RecordDict(), run_config=dict(run_config or {})
    )


def _message(config: dict) -> Message:
    from pipeline.federation.engines import _set_server_identity

    _set_server_identity(1)
    return Message(RecordDict({CONFIG_KEY: ConfigRecord(config)}), dst_node_id=5, message_type="train")


def test_the_engines_settings_reach_a_client_through_the_message():
    sent = CacheConfig(cache_dir="/somewhere/prefix", cache_max_gb=0.25)
    config = {"plan": "models/plans/x.json", **client_settings_config(sent)}
    assert client_cache_config(_message(config), _context()) == sent


def test_a_node_config_wins_over_the_run_config_which_wins_over_the_message():
    message = _message({"cache-dir": "m", "cache-max-gb": 1.0})
    got = client_cache_config(message, _context(node_config={"cache-dir": "node"}, run_config={"cache-max-gb": 2.0}))
    assert (got.cache_dir, got.cache_max_gb) == ("node", 2.0)
    got = client_cache_config(message, _context(run_config={"cache-dir": "run"}))
    assert (got.cache_dir, got.cache_max_gb) == ("run", 1.0)


def test_a_client_without_its_settings_fails_naming_the_missing_key():
    with pytest.raises(ValueError, match="cache-max-gb") as err:
        client_cache_config(_message({"plan": "p"}), _context(node_config={"cache-dir": "d"}))
    assert "cache-dir" not in str(err.value).split("]")[0]  # only what is missing is named
    with pytest.raises(ValueError, match="cache-dir"):
        client_cache_config(None, _context())


def test_a_node_configs_settings_are_typed_an_integer_passing_for_a_number():
    # --node-config "cache-max-gb=2" reaches the client as the integer 2
    assert client_cache_config(None, _context(node_config={"cache-dir": "d", "cache-max-gb": 2})).cache_max_gb == 2.0
    with pytest.raises(ValueError, match=r"client settings\.cache_max_gb: expected a number, got str '2'"):
        client_cache_config(None, _context(node_config={"cache-dir": "d", "cache-max-gb": "2"}))


def test_the_deployed_clients_default_to_the_projects_cache_settings():
    app_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    model = yaml.safe_load((ROOT / "params.yaml").read_text())["model"]
    assert client_cache_config(None, _context(run_config=app_config)) == CacheConfig(
        cache_dir=model["cache_dir"], cache_max_gb=model["cache_max_gb"]
    )


def test_run_settings_come_from_the_named_file_and_a_missing_file_is_an_error(tmp_path):
    params = tmp_path / "site.yaml"
    params.write_text(
        yaml.safe_dump(
            {
                "train": {"round_timeout_s": 60},
                "model": {"cache_dir": "/c", "cache_max_gb": 0.5},
                "experiments": {"e": {"round_timeout_s": 90}},
            }
        )
    )
    got = load_run_settings(params)
    assert (got.round_timeout_s, got.cache.cache_dir, got.cache.cache_max_gb) == (60, "/c", 0.5)
    assert load_run_settings(params, "e").round_timeout_s == 90  # the experiment's own override
    with pytest.raises(ConfigError, match="absent.yaml: parameter file not found"):
        load_run_settings(tmp_path / "absent.yaml")
    assert RunSettings().cache == CacheConfig()


@pytest.mark.parametrize(
    "group, key, value, problem",
    [
        ("train", "round_timeout_s", -5, "train.round_timeout_s=-5 is out of range; allowed: > 0"),
        ("model", "cache_max_gb", -1, "model.cache_max_gb=-1 is out of range; allowed: >= 0"),
    ],
)
def test_a_bad_run_setting_is_named_in_the_file_it_came_from(tmp_path, group, key, value, problem):
    # the train stage's and the federation commands' --params (a site's file): the line named ./params.yaml
    (params := tmp_path / "study" / "site.yaml").parent.mkdir()
    params.write_text(yaml.safe_dump({group: {key: value}}))
    with pytest.raises(ConfigError) as err:
        load_run_settings(params)
    assert str(err.value) == f"{params} {problem}"


@pytest.mark.parametrize(
    "entry, problem",
    [  # the entry's own value: the line named the file's train group, which holds a good one
        ({"round_timeout_s": -5}, "experiments.x.round_timeout_s=-5 is out of range; allowed: > 0"),
        # the group's value the entry inherits: the group
        ({"admission_timeout_s": 5}, "train.round_timeout_s=0 is out of range; allowed: > 0"),
    ],
)
def test_a_bad_run_setting_names_the_entry_it_came_from(tmp_path, entry, problem):
    params = tmp_path / "site.yaml"
    group = {"round_timeout_s": 60 if "round_timeout_s" in entry else 0}  # good under a bad entry's, else bad
    params.write_text(yaml.safe_dump({"train": group, "experiments": {"x": entry}}))
    with pytest.raises(ConfigError) as err:
        load_run_settings(params, "x")
    assert str(err.value) == f"{params} {problem}"


def _calls(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name for n in ast.walk(tree)
    )


def test_only_entry_points_read_run_settings_from_a_file():
    readers = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "pipeline").rglob("*.py") if _calls(p, "load_run_settings")
    )
    # the train stage's CLI and the federation's (`local --params`, `kit --params`: localhost.server_run_config);
    # nothing in training/, modeling/, or the engines and apps: the deployed ServerApp takes them from its run config
    assert readers == ["pipeline/federation/localhost.py", "pipeline/train.py"]
    assert not any(
        _calls(p, n)
        for p in (ROOT / "pipeline" / "federation").rglob("*.py")
        if p.name != "localhost.py"
        for n in ("load_params", "load_run_settings")
    )
    assert not any(_calls(p, "load_params") for p in (ROOT / "pipeline" / "training").rglob("*.py"))
    assert not any(_calls(p, "load_params") for p in (ROOT / "pipeline" / "modeling").rglob("*.py"))


@pytest.mark.parametrize(
    "experiments, problem",
    [
        (["x"], "experiments: expected a mapping of keys, got list ['x']"),
        ({"x": 5}, "experiments x: expected a mapping of keys, got int 5"),
    ],
)
def test_an_experiments_group_or_entry_that_is_no_mapping_is_one_line_naming_the_file(tmp_path, experiments, problem):
    """The train stage's and the federation commands' --params (a site's file, which the planning stage never read):
    a list of experiments, or an entry that is a number, ended in an AttributeError traceback."""
    params = tmp_path / "site.yaml"
    params.write_text(yaml.safe_dump({"train": {"round_timeout_s": 60}, "experiments": experiments}))
    with pytest.raises(ConfigError) as err:
        load_run_settings(params, "x")
    assert str(err.value) == f"{params} {problem}"
