"""``examples/run.toml``: parsed by the real spec loader, and naming every key a spec has."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

from pcp_p2p.diloco.protocol.spec import _SECTIONS, RunSpec, load_spec

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "run.toml"

# RunSpec's fields that TOML spells as a table of their own rather than a key of the same name.
SPELLED = {"model": ("model", "preset"), "dataset": ("data", "dataset"), "targets": ("targets", "allowed")}


def spec_keys() -> set[tuple[str, str]]:
    """Every (table, key) a run spec has, from the spec dataclasses themselves ("" = top level)."""
    keys: set[tuple[str, str]] = set()
    for f in dataclasses.fields(RunSpec):
        if f.name in _SECTIONS:
            keys |= {(f.name, g.name) for g in dataclasses.fields(_SECTIONS[f.name])}  # type: ignore[arg-type]
        else:
            keys.add(SPELLED.get(f.name, ("", f.name)))
    return keys


def test_the_example_spec_parses_and_names_every_key_with_a_comment() -> None:
    load_spec(EXAMPLE)  # the real loader: a wrong key or value fails here
    doc = tomllib.loads(EXAMPLE.read_text())
    written = {("", k) for k, v in doc.items() if not isinstance(v, dict)}
    written |= {(t, k) for t, table in doc.items() if isinstance(table, dict) for k in table}
    assert written == spec_keys()
    for line in EXAMPLE.read_text().splitlines():  # every key line says what the key is
        if re.match(r"^[a-z_0-9]+ *=", line):
            assert "#" in line.split("=", 1)[1], f"key without a comment: {line}"


def test_the_example_shows_the_defaults_but_for_the_name() -> None:
    spec = load_spec(EXAMPLE)
    assert dataclasses.replace(spec, name=RunSpec().name) == RunSpec()


def test_the_readme_links_the_example() -> None:
    assert "examples/run.toml" in (EXAMPLE.parent.parent / "README.md").read_text()
