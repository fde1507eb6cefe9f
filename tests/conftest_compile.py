"""Compiled artifacts shared by the compile and executor tests (not a pytest conftest).

Compiling takes 2–10 s per (program, target), so each artifact is built at
most once per test session: the functions here are memoised in-process and
back onto one session-wide :class:`ArtifactCache` in a temporary directory.
Test modules import them directly (``from conftest_compile import ...``).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

import numpy as np

from pcp_p2p.compile.cache import ArtifactCache
from pcp_p2p.compile.model import PRESETS, GPTConfig
from pcp_p2p.compile.pipeline import Artifact, Lowered, compile_lowered, lower_program, write_artifact
from pcp_p2p.compile.programs import ProgramOptions
from pcp_p2p.compile.targets import get_target
from pcp_p2p.core.identity import Identity

TINY: GPTConfig = PRESETS["tiny"]
# Small shapes keep the tests fast; H=10 is the round chunk the numerics test checks.
TINY_OPTS = ProgramOptions(inner_steps=10, batch=4, seq=32, sample_batch=2)

_ROOT = Path(tempfile.mkdtemp(prefix="pcp-test-compile-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)
CACHE = ArtifactCache(_ROOT / "cache")


@cache
def shepherd() -> Identity:
    """The identity that signs every test artifact."""
    return Identity.generate()


@cache
def lowered(program: str, opts: ProgramOptions = TINY_OPTS) -> Lowered:
    return lower_program(program, TINY, opts)


@cache
def artifact(program: str, target: str, opts: ProgramOptions = TINY_OPTS) -> Artifact:
    """The tiny model's ``program`` compiled for ``target`` and signed by :func:`shepherd`."""
    return compile_lowered(lowered(program, opts), get_target(target), shepherd(), "tiny", CACHE)


@cache
def artifact_file(program: str, target: str, opts: ProgramOptions = TINY_OPTS) -> Path:
    """:func:`artifact` written to disk; the path of its ``.vmfb``."""
    art = artifact(program, target, opts)
    out = _ROOT / "out" / f"H{opts.inner_steps}-B{opts.batch}-T{opts.seq}"
    vmfb_path, _ = write_artifact(out, art)
    return vmfb_path


def batches(opts: ProgramOptions = TINY_OPTS, seed: int = 0, vocab: int | None = None,
            steps: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Random next-token batches ``xs, ys`` (int32, (H, B, T)), ys = xs shifted by one."""
    rng = np.random.default_rng(seed)
    vocab = vocab or TINY.vocab_size
    H = steps or opts.inner_steps
    seqs = rng.integers(0, vocab, size=(H, opts.batch, opts.seq + 1), dtype=np.int32)
    return seqs[..., :-1].copy(), seqs[..., 1:].copy()
