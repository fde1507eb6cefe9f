"""The ~100M-parameter preset (``large``) compiles for every target the pipeline knows.

Slow (about a minute or two per target on two busy cores; docs/compile.md lists the
times and sizes): the figures in the docs come from ``pcp compile --model large
--targets all --programs train --inner-steps 5 --batch 16 --seq 64``, the shapes
compiled here.
"""

from __future__ import annotations

from functools import cache

import pytest
from conftest_compile import CACHE, shepherd

from pcp_p2p.compile.manifest import verify_manifest
from pcp_p2p.compile.model import PRESETS, num_params
from pcp_p2p.compile.pipeline import Lowered, compile_lowered, lower_program
from pcp_p2p.compile.programs import ProgramOptions
from pcp_p2p.compile.targets import TARGETS, get_target


@cache
def _large_train() -> Lowered:
    return lower_program("train", PRESETS["large"], ProgramOptions(inner_steps=5, batch=16, seq=64))


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_large_preset_compiles_for_every_target(target: str) -> None:
    assert 95e6 <= num_params(PRESETS["large"]) <= 105e6
    art = compile_lowered(_large_train(), get_target(target), shepherd(), "large", CACHE)
    verify_manifest(art.manifest, art.vmfb)
    assert (art.manifest.target, art.manifest.model) == (target, "large")
    assert art.manifest.model_config["n_embd"] == 768 and art.manifest.model_config["n_layer"] == 14
    # weights are inputs, not constants: a 400 MB model's artifact stays small
    assert len(art.vmfb) < 16 << 20
