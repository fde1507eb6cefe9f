"""Which CPU artifacts this machine can run, and which of them is fastest.

An llvm-cpu artifact built for a CPU level the machine lacks is not refused
when loaded: it dies with SIGILL on the first instruction it cannot execute.
So a worker decides from its own CPU flags, before loading anything:

- x86-64-v4 needs AVX-512 F/BW/CD/DQ/VL (1.2–1.5x faster than v3 where present);
- x86-64-v3 needs AVX2, BMI1/2, FMA, F16C, MOVBE, LZCNT (``abm``), XSAVE;
- generic x86-64 runs anywhere;
- aarch64 Linux runs ``cpu-aarch64`` (NEON is mandatory there); an Apple
  silicon Mac runs ``cpu-apple-m1`` and ``cpu-aarch64``.

Flags come from ``/proc/cpuinfo`` (Linux); elsewhere only the generic variant
of the machine's architecture is assumed.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pcp_p2p.compile.targets import TARGETS, Target
from pcp_p2p.core.errors import ConfigError


@dataclass(frozen=True)
class CpuInfo:
    """The architecture (``x86_64``, ``aarch64``, ``arm64-apple``) and CPU flags."""

    arch: str
    flags: frozenset[str]


def parse_cpuinfo(text: str) -> frozenset[str]:
    """The CPU flags of the first processor in ``/proc/cpuinfo`` text (x86 ``flags``, arm ``Features``)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def normalize_arch(machine: str) -> str:
    """``platform.machine()`` (here or in a peer's member record) → a target ``arch``.

    Linux on 64-bit ARM says ``aarch64``; macOS on Apple silicon says ``arm64``.
    """
    machine = machine.lower()
    if machine in ("x86_64", "amd64"):
        return "x86_64"
    if machine == "arm64":
        return "arm64-apple"
    return machine


def cpu_of(machine: str, flags: Iterable[str]) -> CpuInfo:
    """A :class:`CpuInfo` from a machine name and flags, e.g. a peer's capabilities record."""
    return CpuInfo(normalize_arch(machine), frozenset(flags))


@lru_cache(maxsize=1)
def local_cpu() -> CpuInfo:
    """This machine's CPU (read once)."""
    try:
        flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        flags = frozenset()
    return cpu_of(platform.machine(), flags)


def cpu_can_run(target: Target, cpu: CpuInfo) -> str | None:
    """None if ``cpu`` can run ``target``'s code, else the reason it cannot."""
    if not target.is_cpu:
        return f"{target.name} is not a CPU target"
    runnable_archs = {target.arch}
    if target.arch == "aarch64":
        runnable_archs.add("arm64-apple")  # a Mac runs generic aarch64 code too
    if cpu.arch not in runnable_archs:
        return f"{target.name} is built for {target.arch}, this machine is {cpu.arch}"
    missing = [f for f in target.cpu_flags if f not in cpu.flags]
    if missing:
        return f"{target.name} needs CPU flags this machine lacks: {' '.join(missing)}"
    return None


def runnable_cpu_targets(cpu: CpuInfo | None = None) -> list[Target]:
    """CPU targets this machine can run, fastest first."""
    cpu = cpu or local_cpu()
    ok = [t for t in TARGETS.values() if t.is_cpu and cpu_can_run(t, cpu) is None]
    return sorted(ok, key=lambda t: -t.preference)


def best_cpu_target(cpu: CpuInfo | None = None) -> Target:
    """The fastest CPU variant this machine can run."""
    ok = runnable_cpu_targets(cpu)
    if not ok:
        cpu = cpu or local_cpu()
        raise ConfigError(f"no CPU target for architecture {cpu.arch}")
    return ok[0]
