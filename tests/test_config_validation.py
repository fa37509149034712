"""pipeline.common.config.from_dict: pydantic validation of any config class, one line naming the key."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Annotated, Literal

import pytest
from pydantic import Field, model_validator

from pipeline.common.config import ConfigError, config, from_dict, load_params


@config
class Inner:
    rate: Annotated[float, Field(gt=0, le=1)] = 0.5
    names: list[str] = field(default_factory=lambda: ["a"])
    kind: Literal["x", "y"] = "x"
    limit: float = 2.0

    @model_validator(mode="after")
    def _rate_below_limit(self) -> Inner:
        if self.rate > self.limit:
            raise ValueError(f"rate={self.rate} must be <= limit={self.limit}")
        return self


@config(frozen=True)
class Outer:  # a config class of its own: validated with no code beyond its fields
    steps: Annotated[int, Field(ge=1)] = 3
    cap: int | None = None
    share: int | float = 1.0
    on: bool = False
    sizes: dict[str, int] = field(default_factory=dict)
    inner: Inner = field(default_factory=Inner)


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        from_dict(Outer, data, "params.yaml grp")
    assert "\n" not in str(err.value)
    return str(err.value)


def test_values_are_built_with_defaults_for_missing_keys():
    built = from_dict(Outer, {"steps": 5, "share": 3, "inner": {"rate": 1}, "sizes": {"train": 2}}, "grp")
    assert built == Outer(steps=5, share=3, sizes={"train": 2}, inner=Inner(rate=1.0))
    assert isinstance(built.inner.rate, float) and isinstance(built.share, int)  # int|float keeps an int
    assert from_dict(Outer, None) == Outer()
    assert from_dict(Outer, {"inner": Inner(rate=0.25)}).inner.rate == 0.25  # an instance passes for its mapping


@pytest.mark.parametrize(
    "data, key",
    [
        ({"steps": "96"}, "params.yaml grp.steps"),  # no string-to-number coercion
        ({"steps": 8.0}, "params.yaml grp.steps"),
        ({"steps": True}, "params.yaml grp.steps"),
        ({"on": "yes"}, "params.yaml grp.on"),
        ({"cap": "x"}, "params.yaml grp.cap"),
        ({"share": True}, "params.yaml grp.share"),
        ({"sizes": {"train": "2"}}, "params.yaml grp.sizes.train"),
        ({"inner": {"names": ["a", 3]}}, "params.yaml grp.inner.names[1]"),
        ({"inner": 3}, "params.yaml grp.inner"),
    ],
)
def test_a_wrong_type_names_the_key_path_and_the_value(data, key):
    message = _error(data)
    assert message.startswith(key + ": expected ")
    assert message.count(": expected ") == 1


def test_unknown_keys_are_refused_at_every_level_with_the_allowed_ones():
    assert _error({"stpes": 1, "zz": 2}) == (
        "params.yaml grp: unknown key(s) ['stpes', 'zz']; allowed: ['cap', 'inner', 'on', 'share', 'sizes', 'steps']"
    )
    assert _error({"inner": {"rat": 1}}) == (
        "params.yaml grp.inner: unknown key(s) ['rat']; allowed: ['kind', 'limit', 'names', 'rate']"
    )


def test_a_range_or_choice_check_names_the_key_and_what_is_allowed():
    assert _error({"inner": {"rate": 2}}) == "params.yaml grp.inner.rate=2 is out of range; allowed: > 0 and <= 1"
    assert _error({"inner": {"rate": 0}}) == "params.yaml grp.inner.rate=0 is out of range; allowed: > 0 and <= 1"
    assert _error({"inner": {"kind": "z"}}) == (
        "params.yaml grp.inner.kind='z' is out of range; allowed: one of 'x' or 'y'"
    )
    assert _error({"sizes": {"train": 2}, "steps": 0}) == ("params.yaml grp.steps=0 is out of range; allowed: >= 1")
    with pytest.raises(ConfigError, match="expected a mapping"):
        from_dict(Outer, [1], "grp")  # type: ignore[arg-type]


def test_a_check_across_keys_names_its_key():
    assert _error({"inner": {"rate": 0.9, "limit": 0.5}}) == "params.yaml grp.inner.rate=0.9 must be <= limit=0.5"


def test_built_in_code_a_bad_value_is_one_line_naming_the_class_and_key():
    with pytest.raises(ConfigError, match=r"^Inner.kind='q' is out of range; allowed: one of 'x' or 'y'$"):
        Inner(kind="q")
    with pytest.raises(ConfigError, match=r"^Inner.rate=3.0 is out of range; allowed: > 0 and <= 1$"):
        dataclasses.replace(Inner(), rate=3.0)


def test_a_params_path_that_is_a_folder_is_one_line_naming_it(tmp_path):
    """``--params`` given a folder (a study folder instead of its params.yaml): it exists, so reading it was an
    IsADirectoryError traceback; an absent file keeps its own line."""
    (tmp_path / "study").mkdir()
    with pytest.raises(ConfigError) as err:
        load_params(tmp_path / "study")
    assert str(err.value) == f"{tmp_path / 'study'}: not a readable parameter file (Is a directory)"
    with pytest.raises(ConfigError, match=r"absent.yaml: parameter file not found \(run from the project root\)$"):
        load_params(tmp_path / "absent.yaml")
