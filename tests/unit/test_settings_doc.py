"""docs/settings.md is the settings table of the code, rendered (``elasticd.settings_doc``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.settings import AGENT_SETTINGS, WORKER_VARIABLES
from elasticd.settings_doc import (
    ESSENTIAL,
    REGENERATE,
    REGENERATE_TOML,
    TESTING_ONLY,
    default_text,
    render,
    render_toml,
)

pytestmark = pytest.mark.timeout(30)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_the_page_is_the_rendered_table() -> None:
    assert PAGE.read_text() == render(), f"docs/settings.md is stale: regenerate it with `{REGENERATE}`"


def test_every_setting_and_variable_is_on_the_page() -> None:
    page = PAGE.read_text()
    for s in AGENT_SETTINGS.values():
        assert f"| `{s.name}` |" in page, s.name
    for s in WORKER_VARIABLES.values():
        assert f"| `{s.variable}` |" in page, s.variable


def test_the_groups_name_only_settings_that_exist() -> None:
    assert set(ESSENTIAL) <= set(AGENT_SETTINGS)
    assert set(TESTING_ONLY) <= set(WORKER_VARIABLES)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("lease_ttl_s", "3.0"),
        ("node_id", "the host name"),
        ("checkpoint_dir", "unset"),
        ("relay", "true"),
        ("etcd_endpoints", "127.0.0.1:2379"),
    ],
)
def test_defaults_are_shown_as_the_code_has_them(name: str, expected: str) -> None:
    assert default_text(AGENT_SETTINGS[name]) == expected


TOML_EXAMPLE = Path(__file__).resolve().parents[2] / "systemd" / "elasticd.toml.example"


def test_the_toml_example_is_the_rendered_table() -> None:
    assert TOML_EXAMPLE.read_text() == render_toml(), (
        f"the TOML example is stale: regenerate it with `{REGENERATE_TOML}`"
    )


def test_the_toml_example_holds_every_agent_setting_once() -> None:
    text = render_toml()
    for s in AGENT_SETTINGS.values():
        lines = [line for line in text.splitlines() if line.lstrip("#").startswith(f"{s.name} = ")]
        assert len(lines) == 1, (s.name, lines)


def test_computed_defaults_stay_commented_out_in_the_toml_example() -> None:
    lines = render_toml().splitlines()
    assert "#nproc_per_node = 1" in lines  # one per visible GPU when unset: a 1 here would override it
    assert not any(line.startswith("node_id = ") for line in lines)
