"""The compile pipeline: model → programs → StableHLO → vmfb per target → signed manifests.

::

    GPTConfig + ProgramOptions ─► build_program ─► lower (+ GPU rewrite) ─► StableHLO text
                                                                             │ cid_of(text)
            ┌────────────────────────────────────────────────────────────────┘
            ▼ per target
    cache hit? ─no─► iree-compile (stdin) ─► vmfb ─► cache
            │                                 │
            └──────────────yes────────────────┤ cid_of(vmfb)
                                              ▼
                               Manifest(...) signed by this node's Identity

Each program is lowered once and compiled once per target; the artifacts of
one program share its StableHLO hash. A cancellable build (a node's) runs both
steps as child processes (:mod:`pcp_p2p.compile.child`) and caches the lowered
text too.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import msgpack

from pcp_p2p.compile.cache import ArtifactCache, atomic_write, cache_key
from pcp_p2p.compile.child import run_child
from pcp_p2p.compile.iree_compile import compiler_version, run_compiler
from pcp_p2p.compile.manifest import Manifest, sign_manifest, write_manifest
from pcp_p2p.compile.model import GPTConfig
from pcp_p2p.compile.programs import Program, ProgramOptions, build_program
from pcp_p2p.compile.targets import Target, compile_flag_choices
from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import CompileCancelled, CompileError, CompilerRejected
from pcp_p2p.core.identity import Identity


@dataclass(frozen=True)
class Lowered:
    """A program and its StableHLO text."""

    program: Program
    stablehlo: str
    stablehlo_hash: str


@dataclass(frozen=True)
class Artifact:
    """One compiled, signed artifact."""

    vmfb: bytes
    manifest: Manifest
    compile_s: float  # wall time of iree-compile (0 on a cache hit)
    cached: bool

    @property
    def cid(self) -> str:
        return self.manifest.artifact_cid

    def file_stem(self) -> str:
        return f"{self.manifest.program}.{self.manifest.target}"


LOWER_TIMEOUT_S = 600.0


def lower_program(
    name: str, cfg: GPTConfig, opts: ProgramOptions, *,
    cache: ArtifactCache | None = None, cancel: threading.Event | None = None,
) -> Lowered:
    """The named program and its StableHLO text.

    With ``cancel`` the lowering runs in a child process (:mod:`pcp_p2p.compile.child`:
    stopped at once when ``cancel`` is set, and off this process's GIL); without it,
    here (``pcp compile``, tests). With ``cache``, the text is kept by
    :func:`lowering_key`, so a hot standby's take-over skips JAX altogether.
    """
    program = build_program(name, cfg, opts)
    key = lowering_key(name, cfg, opts)
    text = None
    if cache is not None:
        hit = cache.get(key)
        text = hit.decode() if hit is not None else None
    if text is None:
        if cancel is None:
            from pcp_p2p.compile.lowering import lower  # imports JAX

            text = lower(program)
        else:
            text = _lower_in_child(name, cfg, opts, cancel)
        if cache is not None:
            cache.put(key, text.encode())
    return Lowered(program, text, cid_of(text.encode()))


def lower_command() -> list[str]:
    """The lowering child's command line (a function so tests can swap the child)."""
    return [sys.executable, "-m", "pcp_p2p.compile.lower_child"]


def _lower_in_child(name: str, cfg: GPTConfig, opts: ProgramOptions, cancel: threading.Event) -> str:
    job = json.dumps({"program": name, "config": cfg.to_dict(), "options": opts.to_dict()}).encode()
    code, out, err = run_child(lower_command(), job, what="lowering", timeout=LOWER_TIMEOUT_S, cancel=cancel)
    if code != 0 or not out:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise CompileError(f"lowering {name} failed (exit {code}): {tail[0]}")
    return out.decode()


@lru_cache(maxsize=1)
def _lowering_sources_digest() -> str:
    """What, besides the config, decides the lowered text: this package's model,
    programs and lowering code, and the JAX that traces them."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for mod in ("model.py", "programs.py", "lowering.py"):
        h.update((here / mod).read_bytes())
    for dist in ("jax", "jaxlib"):
        try:
            h.update(importlib.metadata.version(dist).encode())
        except importlib.metadata.PackageNotFoundError:
            pass
    return h.hexdigest()


def lowering_key(name: str, cfg: GPTConfig, opts: ProgramOptions) -> str:
    """Cache key of a program's StableHLO text (hex sha256)."""
    blob = msgpack.packb(["pcp-lowering-v1", name, cfg.to_dict(), opts.to_dict(), _lowering_sources_digest()],
                         use_bin_type=True)
    return hashlib.sha256(blob).hexdigest()


def compile_lowered(
    lowered: Lowered,
    target: Target,
    identity: Identity,
    model_name: str,
    cache: ArtifactCache | None = None,
    cancel: threading.Event | None = None,
) -> Artifact:
    """Compile (or fetch from ``cache``) one lowered program for one target, and sign it.

    ``cancel`` set: the compiler is killed and :class:`CompileCancelled` raised (see ``run_compiler``)."""
    p = lowered.program
    choices = compile_flag_choices(target, p.config.n_embd)
    version = compiler_version()
    keys = [cache_key(lowered.stablehlo_hash, target.name, version, f) for f in choices]
    vmfb, flags, cached = None, choices[-1], False
    t0 = time.perf_counter()
    # Best choice first. A cached fallback is used only once the better choice
    # is known to fail, so a cache filled before a target gained faster flags
    # does not keep serving the slower build.
    for i, (f, key) in enumerate(zip(choices, keys)):
        last = i == len(choices) - 1
        if cache is not None:
            vmfb = cache.get(key)
            if vmfb is not None:
                flags, cached = f, True
                break
            if not last and cache.failed(key):
                continue
        try:
            vmfb = run_compiler(lowered.stablehlo, f, cancel=cancel)
        except CompilerRejected as exc:  # a timeout or a missing tool is not a verdict: raise it
            if last:
                raise
            if cache is not None:
                cache.put_failure(key, str(exc))
            continue
        flags = f
        if cache is not None:
            cache.put(key, vmfb)
        break
    assert vmfb is not None  # the last choice either compiled or raised
    elapsed = 0.0 if cached else time.perf_counter() - t0
    manifest = Manifest(
        program=p.name,
        model=model_name,
        model_config=p.config.to_dict(),
        options=p.options.to_dict(),
        stablehlo_hash=lowered.stablehlo_hash,
        target=target.name,
        driver=target.driver,
        compiler_version=version,
        flags=flags,
        artifact_cid=cid_of(vmfb),
        artifact_size=len(vmfb),
        inputs=p.inputs,
        outputs=p.outputs,
        signer="",
    )
    return Artifact(vmfb, sign_manifest(manifest, identity), elapsed, cached)


def build_artifacts(
    model_name: str,
    cfg: GPTConfig,
    opts: ProgramOptions,
    programs: Sequence[str],
    targets: Sequence[Target],
    identity: Identity,
    cache: ArtifactCache | None = None,
    on_artifact: Callable[[Artifact], None] | None = None,
    cancel: threading.Event | None = None,
) -> list[Artifact]:
    """Every (program, target) artifact; ``on_artifact`` is called as each one finishes.

    ``cancel`` set: stops between steps and kills the lowering or compiler child
    that is running (:class:`CompileCancelled`)."""
    out: list[Artifact] = []

    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise CompileCancelled("the build is not needed any more")

    for name in programs:
        check()
        lowered = lower_program(name, cfg, opts, cache=cache, cancel=cancel)
        for target in targets:
            check()
            art = compile_lowered(lowered, target, identity, model_name, cache, cancel=cancel)
            if on_artifact is not None:
                on_artifact(art)
            out.append(art)
    return out


def write_artifact(out_dir: Path, art: Artifact) -> tuple[Path, Path]:
    """``<program>.<target>.vmfb`` and ``.manifest`` (+ ``.json``) in ``out_dir``."""
    out_dir = Path(out_dir)
    vmfb_path = out_dir / f"{art.file_stem()}.vmfb"
    manifest_path = out_dir / f"{art.file_stem()}.manifest"
    atomic_write(vmfb_path, art.vmfb)
    write_manifest(manifest_path, art.manifest)
    return vmfb_path, manifest_path
