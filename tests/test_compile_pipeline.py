"""Compiling with iree-compile: determinism, GPU targets, the cache and ``pcp compile``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("iree.compiler")

from conftest_compile import CACHE, TINY_OPTS, artifact, lowered, shepherd

from pcp_p2p.compile.iree_compile import compiler_version, run_compiler
from pcp_p2p.compile.manifest import read_manifest, verify_manifest
from pcp_p2p.compile.pipeline import compile_lowered
from pcp_p2p.compile.targets import TARGETS, get_target
from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import CompileError

REPO = Path(__file__).resolve().parents[1]


def test_compile_is_deterministic_across_processes(tmp_path):
    """`pcp compile` in a fresh process (new trace, new lowering, no cache) gives the same CID."""
    art = artifact("train", "cpu-x86_64-v3")
    cmd = [
        sys.executable, "-m", "pcp_p2p.cli", "compile", "--model", "tiny",
        "--targets", "cpu-x86_64-v3", "--programs", "train", "--out", str(tmp_path / "out"),
        "--inner-steps", str(TINY_OPTS.inner_steps), "--batch", str(TINY_OPTS.batch),
        "--seq", str(TINY_OPTS.seq), "--data-dir", str(tmp_path / "data"), "--no-cache", "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["program"], r["target"]) for r in rows] == [("train", "cpu-x86_64-v3")]
    assert rows[0]["cid"] == art.cid
    assert rows[0]["size"] == len(art.vmfb) and rows[0]["compile_s"] > 0
    assert "train  cpu-x86_64-v3" in proc.stderr  # progress line per artifact

    # the CLI's artifact and manifest on disk verify, signed by the CLI's own new key
    vmfb = Path(rows[0]["artifact"]).read_bytes()
    manifest = read_manifest(Path(rows[0]["manifest"]))
    verify_manifest(manifest, vmfb)
    assert manifest.signer != shepherd().peer_id
    assert manifest.stablehlo_hash == art.manifest.stablehlo_hash
    assert manifest.options["inner_steps"] == TINY_OPTS.inner_steps


def test_manifest_binds_everything(tmp_path):
    art = artifact("train", "cpu-x86_64-v3")
    m = art.manifest
    verify_manifest(m, art.vmfb, expected_signer=shepherd().peer_id)
    assert m.artifact_cid == cid_of(art.vmfb) and m.artifact_size == len(art.vmfb)
    assert m.compiler_version == compiler_version() and m.compiler_version.startswith("3.13")
    assert m.flags[-1] == "--iree-llvmcpu-target-cpu=x86-64-v3"
    assert m.driver == "local-task" and m.model == "tiny" and m.model_config["n_layer"] == 4
    names = [s.name for s in m.inputs]
    assert names[0] == "param/wte" and names[-4:] == ["step", "lr", "xs", "ys"]
    assert [s.name for s in m.outputs][-1] == "losses"
    assert m.stablehlo_hash == lowered("train").stablehlo_hash


def test_gpu_target_compiles():
    """cuda-sm80 needs the reduce(add, negate) rewrite to compile at all."""
    art = artifact("train", "cuda-sm80")
    assert art.manifest.driver == "cuda" and b"sm_80" in art.vmfb
    assert art.cid != artifact("train", "cpu-x86_64-v3").cid


def test_cache_skips_recompile():
    first = artifact("train", "cpu-x86_64-v3")  # built (or found) via the session cache
    again = compile_lowered(lowered("train"), get_target("cpu-x86_64-v3"), shepherd(), "tiny", CACHE)
    assert again.cached and again.compile_s == 0.0
    assert again.vmfb == first.vmfb and again.manifest == first.manifest  # Ed25519 is deterministic


def test_compiler_error_is_typed():
    with pytest.raises(CompileError):
        run_compiler("this is not mlir", ("--iree-hal-target-device=local",))


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_target_compiles(target):
    art = artifact("train", target)
    verify_manifest(art.manifest, art.vmfb)
    assert art.manifest.target == target
