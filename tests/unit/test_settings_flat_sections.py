"""What `hvd-resilient run`'s launcher sections and the Horovod driver's switches ask of the
settings machinery: sections whose settings keep their own names, a variable named apart from
its setting, a field's docs inherited from a base dataclass, and two settings of one name
refused."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from hvd_resilient.settings import Schema, setting


@dataclass(kw_only=True)
class Base:
    level: int = 1
    """How high."""


@dataclass(kw_only=True)
class Mine(Base):
    colour: str = setting("red", env="OLD_COLOUR")
    """Which colour."""


@dataclass(kw_only=True)
class Top:
    name: str = "x"
    """Its name."""
    mine: Mine = field(default_factory=Mine)


def test_flat_sections_keep_their_flags_file_keys_and_inherited_docs():
    schema = Schema("t", Top, {"mine": Mine}, prefix_sections=False)
    assert [(st.name, st.section) for st in schema.settings] == [
        ("name", ""), ("level", "mine"), ("colour", "mine")]
    assert {st.name: st.doc for st in schema.settings}["level"] == "How high."
    p = argparse.ArgumentParser()
    schema.add_arguments(p)
    values = schema.read(args=p.parse_args(["--colour", "blue"]),
                         file_values={"mine": {"level": 3}})
    assert schema.build(values) == Top(mine=Mine(level=3, colour="blue"))


def test_a_variable_named_apart_from_its_setting():
    schema = Schema("t", Mine, env_prefix="P_")
    assert [st.env for st in schema.settings] == ["P_LEVEL", "OLD_COLOUR"]
    assert schema.read(env={"OLD_COLOUR": "green", "P_COLOUR": "no"}) == {"colour": "green"}
    assert Schema("t", Mine).settings[1].env is None  # a schema that reads no environment


@dataclass(kw_only=True)
class Twice:
    level: int = 2


@dataclass(kw_only=True)
class Both:
    a: Base = field(default_factory=Base)
    b: Twice = field(default_factory=Twice)


def test_two_settings_of_one_name_are_refused():
    with pytest.raises(TypeError, match="settings named twice: level"):
        _ = Schema("t", Both, {"a": Base, "b": Twice}, prefix_sections=False).settings
