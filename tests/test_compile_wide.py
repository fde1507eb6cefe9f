"""Data tiling for wide models on x86-64-v4: flag choice, fallback, verification, numerics.

A target may carry ``wide_flags`` that are tried first for models at least
``wide_min_embd`` wide (x86-64-v4: ``--iree-opt-data-tiling`` from d 384),
falling back to its plain flags when IREE rejects them for a shape. The
model here is one d-384 block: wide enough for the data-tiled path, small
enough to compile in seconds. At B*T = 512 rows data tiling compiles; at
B*T = 128 IREE 3.13 rejects it ("operations with large vector sizes"), which
exercises the fallback.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("iree.compiler")

from conftest_compile import CACHE, shepherd

from pcp_p2p.compile.cache import ArtifactCache, cache_key
from pcp_p2p.compile.iree_compile import compiler_version, run_compiler
from pcp_p2p.compile.manifest import check_fields, sign_manifest, verify_manifest
from pcp_p2p.compile.model import GPTConfig, init_params, param_names
from pcp_p2p.compile.pipeline import Artifact, compile_lowered, lower_program
from pcp_p2p.compile.programs import ProgramOptions
from pcp_p2p.compile.targets import (
    WIDE_FLAGS_V4,
    allowed_flag_lists,
    compile_flag_choices,
    compile_flags,
    get_target,
)
from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import CompilerRejected, MalformedMessage
from pcp_p2p.executor.cpu import cpu_can_run, local_cpu

V4 = get_target("cpu-x86_64-v4")
V3 = get_target("cpu-x86_64-v3")
WIDE = GPTConfig(vocab_size=65, block_size=64, n_layer=1, n_head=6, n_embd=384)
TILED_OPTS = ProgramOptions(inner_steps=3, batch=8, seq=64)  # 512 rows: data tiling compiles
FALLBACK_OPTS = ProgramOptions(inner_steps=3, batch=4, seq=32)  # 128 rows: IREE rejects it
LR = 1e-3


@cache
def _lowered(opts: ProgramOptions):
    return lower_program("train", WIDE, opts)


@cache
def _artifact(opts: ProgramOptions) -> Artifact:
    return compile_lowered(_lowered(opts), V4, shepherd(), "wide", CACHE)


def test_flag_choices_depend_on_target_and_width():
    plain = compile_flags(V4)
    assert compile_flag_choices(V4, 384) == ((*plain, *WIDE_FLAGS_V4), plain)
    assert compile_flag_choices(V4, 1024) == ((*plain, *WIDE_FLAGS_V4), plain)
    assert compile_flag_choices(V4, 64) == (plain,)  # tiny: data tiling fails or is slower
    assert compile_flag_choices(V4, None) == (plain,)
    assert compile_flag_choices(V3, 384) == (compile_flags(V3),)  # fails to compile on v3
    assert allowed_flag_lists(V4) == ((*plain, *WIDE_FLAGS_V4), plain)
    assert allowed_flag_lists(V3) == (compile_flags(V3),)


def test_wide_model_compiles_with_data_tiling_deterministically():
    art = _artifact(TILED_OPTS)
    m = art.manifest
    assert m.flags == (*compile_flags(V4), "--iree-opt-data-tiling")
    verify_manifest(m, art.vmfb, expected_signer=shepherd().peer_id)
    # the same text and flags through a fresh compiler process: the same bytes
    assert cid_of(run_compiler(_lowered(TILED_OPTS).stablehlo, m.flags)) == m.artifact_cid


def _key(opts: ProgramOptions, flags: tuple[str, ...]) -> str:
    return cache_key(_lowered(opts).stablehlo_hash, V4.name, compiler_version(), flags)


def test_shape_that_data_tiling_rejects_falls_back_to_plain_flags():
    art = _artifact(FALLBACK_OPTS)
    assert art.manifest.flags == compile_flags(V4)
    verify_manifest(art.manifest, art.vmfb, expected_signer=shepherd().peer_id)
    # the cache remembers that data tiling fails here, so the next build does not retry it
    assert CACHE.failed(_key(FALLBACK_OPTS, (*compile_flags(V4), *WIDE_FLAGS_V4)))
    again = compile_lowered(_lowered(FALLBACK_OPTS), V4, shepherd(), "wide", CACHE)
    assert again.cached and again.compile_s == 0.0 and again.vmfb == art.vmfb


def test_cached_plain_build_does_not_shadow_the_data_tiled_one(tmp_path):
    """A cache filled before v4 gained data tiling holds a plain build: it is not served."""
    cache = ArtifactCache(tmp_path / "cache")
    cache.put(_key(TILED_OPTS, compile_flags(V4)), b"an older plain build")
    art = compile_lowered(_lowered(TILED_OPTS), V4, shepherd(), "wide", cache)
    assert not art.cached and "--iree-opt-data-tiling" in art.manifest.flags
    assert art.vmfb == _artifact(TILED_OPTS).vmfb


def test_compiler_rejection_is_a_typed_error():
    with pytest.raises(CompilerRejected):
        run_compiler("this is not MLIR", compile_flags(V4))


def test_manifest_with_flags_outside_the_targets_lists_is_refused():
    m = _artifact(TILED_OPTS).manifest
    check_fields(m)
    bad = [
        # a v3 manifest cannot claim the v4-only data-tiled list
        dataclasses.replace(m, target="cpu-x86_64-v3",
                            flags=(*compile_flags(V3), *WIDE_FLAGS_V4)),
        # nor can a v4 one carry a flag this node never uses for v4
        dataclasses.replace(m, flags=(*m.flags, "--iree-llvmcpu-enable-ukernels=all")),
        # wide flags in the wrong place are a different list
        dataclasses.replace(m, flags=(*WIDE_FLAGS_V4, *compile_flags(V4))),
    ]
    for manifest in bad:
        signed = sign_manifest(manifest, shepherd())
        with pytest.raises(MalformedMessage, match="flags"):
            verify_manifest(signed)


@pytest.mark.skipif(cpu_can_run(V4, local_cpu()) is not None, reason="needs an AVX-512 (v4) CPU")
def test_data_tiled_numerics_match_jax(tmp_path):
    """3 AdamW steps of the data-tiled artifact match jax.jit (same tolerances as tiny's test)."""
    import jax

    from pcp_p2p.compile.pipeline import write_artifact
    from pcp_p2p.executor.executor import Executor

    art = _artifact(TILED_OPTS)
    assert "--iree-opt-data-tiling" in art.manifest.flags
    opts = TILED_OPTS
    rng = np.random.default_rng(3)
    seqs = rng.integers(0, WIDE.vocab_size, size=(opts.inner_steps, opts.batch, opts.seq + 1),
                        dtype=np.int32)
    xs, ys = seqs[..., :-1].copy(), seqs[..., 1:].copy()
    params = init_params(WIDE, seed=0)
    names = param_names(WIDE)
    zeros = [np.zeros_like(params[n]) for n in names]
    out = jax.jit(_lowered(opts).program.fn)(
        *[params[n] for n in names], *zeros, *zeros, np.int32(0), np.float32(LR), xs, ys)
    out = [np.asarray(o) for o in out]
    ref_params = dict(zip(names, out[: len(names)]))

    vmfb, _ = write_artifact(tmp_path, art)
    with Executor.start(vmfb, art.manifest, expected_signer=shepherd().peer_id) as ex:
        ex.load_state(params)
        losses = ex.train(LR, xs, ys)
        state = ex.read_state()
    np.testing.assert_allclose(losses, out[-1], atol=1e-4, rtol=0)
    assert state.step == 3
    moved = max(np.abs(ref_params[n] - params[n]).max() for n in names)
    assert moved > 2e-3  # 3 steps of lr 1e-3: the check below could not pass by standing still
    for n in names:
        np.testing.assert_allclose(state.params[n], ref_params[n], atol=2.5e-4, rtol=0, err_msg=n)
