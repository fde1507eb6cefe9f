"""Named hardware targets: the exact ``iree-compile`` flags and the runtime driver.

A target name is part of an artifact's identity (it goes into the manifest and
the cache key), so the flags for a name must never change silently: change
them and you must rename the target. Every flag list is complete: nothing is
left to compiler defaults that could depend on the compiling machine, and no
CPU target uses ``target-cpu=host``.

CPU targets also record the architecture and the CPU flags (as
``/proc/cpuinfo`` names them) a machine must have to run the artifact; code
built for a CPU level the machine lacks dies with SIGILL at run time, with no
check at load. See :mod:`pcp_p2p.executor.cpu` for the matching side.

This module imports nothing heavy: workers use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pcp_p2p.core.errors import ConfigError

_LOCAL = ("--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu")
_X86 = (*_LOCAL, "--iree-llvmcpu-target-triple=x86_64-unknown-linux-gnu")

# x86-64 micro-architecture levels (psABI), as /proc/cpuinfo spells the flags.
# ``abm`` is how Linux reports LZCNT on AMD and Intel alike. (v2's cx16 and
# lahf_lm are left out: every CPU with AVX2 has them, and member records
# carry only the flags that tell the levels apart, see net/capabilities.py.)
X86_64_V2_FLAGS = ("popcnt", "sse4_1", "sse4_2", "ssse3")
X86_64_V3_FLAGS = (*X86_64_V2_FLAGS, "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm",
                   "movbe", "xsave")
X86_64_V4_FLAGS = (*X86_64_V3_FLAGS, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclass(frozen=True)
class Target:
    """One compile target: name, flags, runtime driver and what a machine needs to run it."""

    name: str
    flags: tuple[str, ...]
    driver: str  # IREE runtime driver: local-task, cuda, hip, vulkan, metal
    arch: str | None = None  # CPU architecture for CPU targets: x86_64, aarch64, arm64-apple
    cpu_flags: tuple[str, ...] = ()  # /proc/cpuinfo flags required (x86 only)
    preference: int = 0  # among runnable CPU variants, the highest wins
    # Flags tried first (appended to ``flags``) for models at least ``wide_min_embd`` wide;
    # if the compiler rejects them, ``flags`` alone is the fallback. See WIDE_FLAGS_V4.
    wide_flags: tuple[str, ...] = ()
    wide_min_embd: int = 0

    @property
    def is_cpu(self) -> bool:
        return self.driver == "local-task"


# IREE's data tiling (matmul operands packed into tiles the AVX-512 kernels
# stream through) cuts the CPU time of a 10.7M-parameter (d 384) train step by
# ~15% on x86-64-v4, which brings it from ~0.85-0.95x to ~0.70-0.78x of
# jax.jit (bench/step.py). It is fragile in IREE 3.13: it fails to compile
# ("operations with large vector sizes", "exceeded stack allocation limit")
# for narrower models (d 64-256) and for d 384 with few rows per step (B*T =
# 128), and on x86-64-v3 it fails even for d 384. So it is tried only for
# models at least WIDE_MIN_EMBD wide on v4, and a compile that fails falls back
# to the plain flag list; both lists are this target's, and a manifest may
# carry either (see compile_flag_choices and allowed_flag_lists below).
WIDE_FLAGS_V4 = ("--iree-opt-data-tiling",)
WIDE_MIN_EMBD = 384


def _cpu(name: str, cpu: str, flags: tuple[str, ...], pref: int,
         wide_flags: tuple[str, ...] = ()) -> Target:
    return Target(name, (*_X86, f"--iree-llvmcpu-target-cpu={cpu}"), "local-task", "x86_64",
                  flags, pref, wide_flags, WIDE_MIN_EMBD if wide_flags else 0)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        _cpu("cpu-x86_64-v4", "x86-64-v4", X86_64_V4_FLAGS, 40, WIDE_FLAGS_V4),
        _cpu("cpu-x86_64-v3", "x86-64-v3", X86_64_V3_FLAGS, 30),
        _cpu("cpu-x86_64-generic", "generic", (), 10),
        Target(
            "cpu-aarch64",
            (*_LOCAL, "--iree-llvmcpu-target-triple=aarch64-unknown-linux-gnu",
             "--iree-llvmcpu-target-cpu=generic", "--iree-llvmcpu-target-cpu-features=+neon"),
            "local-task", "aarch64", (), 10,
        ),
        Target(
            "cpu-apple-m1",
            (*_LOCAL, "--iree-llvmcpu-target-triple=arm64-apple-darwin",
             "--iree-llvmcpu-target-cpu=apple-m1"),
            "local-task", "arm64-apple", (), 20,
        ),
        *(Target(f"cuda-sm{sm}", ("--iree-hal-target-device=cuda", f"--iree-cuda-target=sm_{sm}"),
                 "cuda") for sm in (75, 80, 86, 89)),
        *(Target(f"rocm-{gfx}", ("--iree-hal-target-device=hip", f"--iree-rocm-target={gfx}"),
                 "hip") for gfx in ("gfx90a", "gfx942", "gfx1100")),
        Target("vulkan", ("--iree-hal-target-device=vulkan",), "vulkan"),
        Target("metal", ("--iree-hal-target-device=metal", "--iree-metal-target-platform=macos"),
               "metal"),
    )
}

# Flags common to every compile: the input dialect is StableHLO text.
COMMON_FLAGS = ("--iree-input-type=stablehlo",)


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ConfigError(f"unknown target {name!r}; known: {', '.join(TARGETS)}") from None


def parse_targets(spec: str) -> list[Target]:
    """``"cpu-x86_64-v3,cuda-sm80"`` → targets (``all`` for every one, ``cpu`` for CPU ones)."""
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if part == "all":
            names += list(TARGETS)
        elif part == "cpu":
            names += [n for n, t in TARGETS.items() if t.is_cpu]
        elif part:
            names.append(part)
    if not names:
        raise ConfigError("no targets given")
    return [get_target(n) for n in dict.fromkeys(names)]


def compile_flags(target: Target) -> tuple[str, ...]:
    """The plain flag list for ``target``: what every model compiles with as a last resort."""
    return (*COMMON_FLAGS, *target.flags)


def compile_flag_choices(target: Target, n_embd: int | None = None) -> tuple[tuple[str, ...], ...]:
    """The flag lists to try for a model ``n_embd`` wide, best first; the last always applies.

    A target's ``wide_flags`` (data tiling on x86-64-v4) are faster for wide
    models but do not compile for every shape, so they come first and the
    plain list is the fallback. Whichever compiled is recorded in the manifest.
    """
    plain = compile_flags(target)
    if target.wide_flags and n_embd is not None and n_embd >= target.wide_min_embd:
        return ((*plain, *target.wide_flags), plain)
    return (plain,)


def allowed_flag_lists(target: Target) -> tuple[tuple[str, ...], ...]:
    """Every flag list a manifest for ``target`` may carry (both are this node's own)."""
    plain = compile_flags(target)
    return ((*plain, *target.wide_flags), plain) if target.wide_flags else (plain,)
