"""What each role of a real federation holds (pipeline.federation.cli.write_kit, `python -m pipeline.federation
kit`): the server the plan and the backbone only; a site its own partition slice and examples, with which its ClientApp
identifies itself and reports its split sizes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from tests.test_federated import workspace, write_plan, ws  # noqa: F401  (fixtures)


def test_the_servers_kit_is_the_plan_the_backbone_and_its_run_config_from_the_params_file(ws, tmp_path):
    """`kit` without --client: the plan, the backbone and run_config.toml, whose timeouts and decoding are the
    params file's (with the experiment's own overrides); the ServerApp reads them from its run config."""
    import tomllib

    import yaml

    from pipeline.common.cli import run as run_cli
    from pipeline.common.config import from_dict
    from pipeline.federation.cli import main
    from pipeline.federation.deployment import ServerRunConfig

    plan = write_plan("kit-server", "fedavg", rounds=1)
    Path("kit-params.yaml").write_text(
        yaml.safe_dump(
            {
                "train": {"round_timeout_s": 120, "admission_timeout_s": 45},
                "experiments": {"kit-server": {"round_timeout_s": 77}},
                "evaluate": {"num_beams": 3, "adapter": "final"},
            }
        )
    )
    assert run_cli(main, ["kit", "--plan", plan, "--out", str(tmp_path / "server"), "--params", "kit-params.yaml"]) == 0
    assert sorted(p.name for p in (tmp_path / "server").iterdir()) == ["models", "run_config.toml"]
    assert sorted(p.name for p in (tmp_path / "server/models").iterdir()) == ["backbone", "plans"]
    assert (tmp_path / "server" / plan).read_text() == Path(plan).read_text()
    run_config = tomllib.loads((tmp_path / "server" / "run_config.toml").read_text())
    server = from_dict(ServerRunConfig, run_config)
    assert run_config["plan"] == plan and server.timeouts() == (77.0, 45.0)
    cfg = server.evaluate_config()
    assert (cfg.num_beams, cfg.adapter, cfg.max_target_length) == (3, "final", 96)  # 96: the group's default
    assert ServerRunConfig().timeouts() == (1800.0, 600.0) and ServerRunConfig().evaluate_config().num_beams == 1


def test_a_kit_for_a_client_of_the_plan_its_partition_lacks_is_one_line_naming_it(ws, tmp_path):
    """The plan names Product but the partition file (hand-edited, or re-partitioned) has no Product: before, a
    KeyError traceback in write_kit; now read_partition's DataError naming the file and the client, and no partial kit
    (the plan and a copy of the backbone were written before the partition was read)."""
    from pipeline.common.schema import DataError
    from pipeline.federation.cli import write_kit
    from pipeline.paths import PATHS

    plan = write_plan("kit-no-client", "fedavg", rounds=1)
    path = PATHS.partition("domain/seed0")
    original = path.read_text()  # the workspace is shared by this module's tests: restored after
    partition = json.loads(original)
    del partition["clients"]["Product"]
    path.write_text(json.dumps(partition))
    try:
        with pytest.raises(DataError, match="'Product'"):
            write_kit(plan, tmp_path / "x", "Product")
        assert not (tmp_path / "x").exists()
    finally:
        path.write_text(original)


def test_a_kit_whose_pos_tag_file_is_damaged_is_one_line_naming_it_and_no_partial_kit(ws, tmp_path):
    """Hard KD's site kit carries the client's rows of the POS tags: a file cut short was pyarrow's traceback."""
    from pipeline.common.schema import DataError
    from pipeline.federation.cli import write_kit
    from pipeline.paths import PATHS

    plan = write_plan("kit-postags", "hardkd", rounds=1)
    original = PATHS.postags.read_bytes()  # the workspace is shared by this module's tests: restored after
    PATHS.postags.write_bytes(original[:100])
    try:
        with pytest.raises(DataError, match=rf"^{re.escape(str(PATHS.postags))}: not a readable POS-tag file"):
            write_kit(plan, tmp_path / "x", "Product")
        assert not (tmp_path / "x").exists()
    finally:
        PATHS.postags.write_bytes(original)
    write_kit(plan, tmp_path / "y", "Product")  # the intact file: the client's rows
    own = set(pd.read_parquet(tmp_path / "y" / PATHS.examples)["example_id"])
    assert set(pd.read_parquet(tmp_path / "y" / PATHS.postags)["example_id"]) == own


def test_a_sites_kit_holds_only_its_own_ids_and_examples_and_its_client_identifies_from_it(ws, tmp_path, monkeypatch):
    from pipeline.federation.admission import identify_clients
    from pipeline.federation.cli import write_kit
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import InProcessGrid, _set_server_identity
    from pipeline.paths import PATHS

    plan = write_plan("kit-site", "fedavg", rounds=1)
    full = json.loads(PATHS.partition("domain/seed0").read_text())
    write_kit(plan, tmp_path / "product", "Product")
    site = tmp_path / "product"
    part = json.loads((site / PATHS.partition("domain/seed0")).read_text())
    assert list(part["clients"]) == ["Product"] and part["clients"]["Product"] == full["clients"]["Product"]
    own = {i for split in full["clients"]["Product"].values() for i in split}
    assert set(pd.read_parquet(site / PATHS.examples)["example_id"]) == own

    monkeypatch.chdir(site)
    grid = InProcessGrid(client_app, [{"client-name": "Product", "plan": plan}])
    _set_server_identity(grid.run.run_id)
    sizes = {}
    assert list(identify_clients(grid, plan, ["Product"], 5, sizes).values()) == ["Product"]
    assert sizes == {
        "Product": {
            "num-train": len(full["clients"]["Product"]["train"]),
            "num-valid": len(full["clients"]["Product"]["valid"]),
        }
    }


def test_a_kit_for_a_client_outside_the_plan_is_refused(ws, tmp_path):
    from pipeline.common.schema import DataError
    from pipeline.federation.cli import write_kit

    with pytest.raises(DataError, match="'Prodcut'"):
        write_kit(write_plan("kit-typo", "fedavg", rounds=1), tmp_path / "x", "Prodcut")


def test_a_client_named_outside_its_partition_still_says_its_name_so_the_server_can_refuse_it(ws):
    from pipeline.federation.admission import name_nodes
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import InProcessGrid, _set_server_identity

    plan = write_plan("kit-typo-node", "fedavg", rounds=1)
    grid = InProcessGrid(client_app, [{"client-name": "Prodcut", "plan": plan}])
    _set_server_identity(grid.run.run_id)
    sizes, names = {}, {}
    assert name_nodes(grid, plan, names, [1000], ["Product"], 5, sizes, admission=True) == {1000: "Prodcut"}
    assert sizes == {"Prodcut": {}} and names == {}


def test_the_servers_mlflow_store_is_the_project_root_of_the_directory_it_runs_in(tmp_path, monkeypatch):
    """docs/federation.md: the deployed ServerApp logs to the store of the SuperLink's working directory: the git
    checkout that holds it (a kit inside the project checkout: the project's mlflow.db), else that directory (a
    server machine whose kit is no checkout); MLFLOW_TRACKING_URI overrides both."""
    import subprocess

    from pipeline.results.tracking import tracking_uri

    for var in ("MLFLOW_TRACKING_URI", "FEDMEET_ROOT", "DVC_ROOT"):
        monkeypatch.delenv(var, raising=False)
    checkout, alone = tmp_path / "checkout", tmp_path / "alone" / "server"
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    for kit in (checkout / ".flwr-local/sites/server", alone):
        kit.mkdir(parents=True)
    monkeypatch.chdir(checkout / ".flwr-local/sites/server")
    assert tracking_uri() == f"sqlite:///{checkout.resolve() / 'mlflow.db'}"
    monkeypatch.chdir(alone)
    assert tracking_uri() == f"sqlite:///{alone.resolve() / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////elsewhere/mlflow.db")
    assert tracking_uri() == "sqlite:////elsewhere/mlflow.db"


def test_a_kit_of_a_plan_named_by_its_absolute_path_is_refused_in_one_line(ws, tmp_path, capsys):
    """The kit lays the plan out at its own path under --out (the roles' configs name it so): an absolute --plan,
    which the docs' recipe never gives but a user may, ended in shutil.SameFileError (the plan copied onto itself);
    one through '..' laid its copies outside --out."""
    from pipeline.common.cli import run as run_cli
    from pipeline.federation.cli import main

    plan = write_plan("kit-absolute", "fedavg", rounds=1)
    before = Path(plan).read_bytes()
    for given, client in [(str(Path(plan).resolve()), ["--client", "Product"]), (f"../{Path.cwd().name}/{plan}", [])]:
        assert run_cli(main, ["kit", "--plan", given, *client, "--out", str(tmp_path / "kit")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and given in err[0] and "relative" in err[0]
    assert Path(plan).read_bytes() == before and not list(tmp_path.iterdir())


def test_a_kit_out_that_is_a_file_or_the_project_root_is_refused_in_one_line(ws, tmp_path, capsys):
    """--out is the folder the role's copies go to: an existing file there ended in NotADirectoryError, and the
    project root itself ('--out .') in shutil.SameFileError (the plan copied onto itself), each a traceback."""
    from pipeline.common.cli import run as run_cli
    from pipeline.federation.cli import main

    plan = write_plan("kit-out", "fedavg", rounds=1)
    (a_file := tmp_path / "kit.txt").write_text("x")
    for out, client in [(str(a_file), []), (".", []), (str(Path.cwd()), ["--client", "Product"])]:
        assert run_cli(main, ["kit", "--plan", plan, *client, "--out", out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--out {out}" in err[0]
    assert a_file.read_text() == "x"


def test_the_servers_run_config_reads_back_in_flower_with_a_plan_path_outside_the_bmp(ws, tmp_path):
    """run_config.toml was written with JSON's ASCII escapes: a character outside the BMP (an emoji in the plan's
    file name) became a surrogate pair escape, which TOML refuses, so `flwr run --run-config run_config.toml` failed."""
    import shutil

    from flwr.common.config import parse_config_args

    from pipeline.federation.cli import write_kit

    plan = write_plan("kit-emoji", "fedavg", rounds=1)
    shutil.copyfile(plan, emoji := str(Path(plan).with_name("kit-\U0001f600.json")))
    write_kit(emoji, tmp_path / "server")
    assert parse_config_args([str(tmp_path / "server" / "run_config.toml")])["plan"] == emoji
