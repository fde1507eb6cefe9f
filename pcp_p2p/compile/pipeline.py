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
one program share its StableHLO hash.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pcp_p2p.cid import cid_of
from pcp_p2p.compile.cache import ArtifactCache, atomic_write, cache_key
from pcp_p2p.compile.iree_compile import compile_flag_choices, compiler_version, run_compiler
from pcp_p2p.compile.manifest import Manifest, sign_manifest, write_manifest
from pcp_p2p.compile.model import GPTConfig
from pcp_p2p.compile.programs import Program, ProgramOptions, build_program
from pcp_p2p.compile.targets import Target
from pcp_p2p.errors import CompileCancelled, CompilerRejected
from pcp_p2p.node.identity import Identity


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


def lower_program(name: str, cfg: GPTConfig, opts: ProgramOptions) -> Lowered:
    from pcp_p2p.compile.lowering import lower  # imports JAX

    program = build_program(name, cfg, opts)
    text = lower(program)
    return Lowered(program, text, cid_of(text.encode()))


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

    ``cancel`` set: stops between steps and kills a compiler that is running
    (:class:`CompileCancelled`); lowering itself (JAX, in this thread) runs to its end."""
    out: list[Artifact] = []

    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise CompileCancelled("the build is not needed any more")

    for name in programs:
        check()
        lowered = lower_program(name, cfg, opts)
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
