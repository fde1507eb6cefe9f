"""What this machine can do: the capability probe behind every member record.

A shepherd plans a round from these figures (which artifact targets to build,
how many inner steps a worker can do in the time budget), so they are measured
rather than declared: the throughput figure comes from a short matrix-multiply
benchmark run at start-up (measured so that a busy machine reads like an idle
one, and stamped with when it was taken), and the IREE drivers listed are those
the runtime can actually create a device for.

The probe imports neither JAX nor the IREE compiler: a worker needs neither.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pcp_p2p import __version__
from pcp_p2p.core.errors import ConfigError
from pcp_p2p.wire import Message, wire_struct

# CPU flags that decide which compiled CPU variant a machine can run; the full
# /proc/cpuinfo list is ~150 names and would bloat every member record.
RELEVANT_CPU_FLAGS = frozenset(
    """avx avx2 avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16 avx512_vnni
    avx512vnni amx_bf16 amx_tile bmi1 bmi2 f16c fma lzcnt abm movbe popcnt sse4_1
    sse4_2 ssse3 xsave asimd neon sve fphp asimdhp""".split()
)

# Backend names as users say them -> IREE runtime driver names.
BACKEND_DRIVERS = {
    "cpu": "local-task",
    "cuda": "cuda",
    "rocm": "hip",
    "vulkan": "vulkan",
    "metal": "metal",
}
BACKENDS = ("auto", *BACKEND_DRIVERS)


@wire_struct
class Device(Message):
    name: str
    driver: str
    memory_bytes: int | None = None


@wire_struct
class Capabilities(Message):
    backends: tuple[str, ...]  # IREE runtime drivers usable here, best first
    cpu_model: str
    cpu_arch: str
    cpu_flags: tuple[str, ...]
    cpu_count: int
    memory_bytes: int
    devices: tuple[Device, ...]
    throughput_gflops: float  # fp32 matmul rate of the CPU: one core's, measured in CPU time, times the cores
    versions: dict[str, str]
    can_compile: bool
    throughput_measured_at: float = 0.0  # unix time of that measurement; 0: not measured (a bootstrap server)
    # A worker group under MPI (pcp_p2p.cluster): its live ranks, their summed matmul rate and
    # "host/target" of each rank. 0 ranks: a node on its own.
    group_ranks: int = 0
    group_gflops: float = 0.0
    group_devices: tuple[str, ...] = ()
    # Memory this node can still take for training, measured at start-up (free_memory_bytes):
    # what the shepherd sizes the run's micro-batch from (pcp_p2p.compile.memory). 0: not measured.
    memory_free_bytes: int = 0


def cpu_info() -> tuple[str, tuple[str, ...]]:
    """(model name, relevant flags) from /proc/cpuinfo, or platform data elsewhere."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return model, ()
    for line in text.splitlines():
        k, _, v = line.partition(":")
        k = k.strip().lower()
        if k in ("model name", "hardware", "cpu model") and v.strip():
            model = v.strip()
        elif k in ("flags", "features"):
            flags.update(v.split())
    return model, tuple(sorted(flags & RELEVANT_CPU_FLAGS))


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _meminfo_available() -> int | None:
    """``MemAvailable`` of /proc/meminfo: what the kernel can give without swapping (Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _cgroup_headroom(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Limit minus usage of this process's memory cgroup (v2, else v1), or None if unlimited."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # v2: the unified hierarchy
            limit, usage = _read_int(root / rel / "memory.max"), _read_int(root / rel / "memory.current")
        elif "memory" in controllers.split(","):  # v1; a container usually sees its own group at the root
            base = root / "memory"
            limit, usage = _read_int(base / "memory.limit_in_bytes"), _read_int(base / "memory.usage_in_bytes")
        else:
            continue
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 "no limit" is ~2^63
            found.append(max(0, limit - usage))
    return min(found) if found else None


def _rlimit_cap() -> int | None:
    """The lower of this process's data and address-space soft limits (``ulimit -d``/``-v``),
    which the executor child inherits: a training process can never map more than that."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    caps = [soft for soft in (resource.getrlimit(r)[0] for r in (resource.RLIMIT_DATA, resource.RLIMIT_AS))
            if soft != resource.RLIM_INFINITY]
    return min(caps) if caps else None


def free_memory_bytes() -> int:
    """Memory this node can take for training now: the least of what the kernel has available,
    what this process's memory cgroup still allows, and its data/address-space rlimits.

    A container's cgroup limit or a ``ulimit`` binds long before the host's free RAM does,
    and a training step that crosses it dies (OOM kill, failed allocation), so the shepherd
    sizes batches from the tightest of them (docs/compile.md, "Memory-aware sizing").
    0 when none can be read.
    """
    known = [x for x in (_meminfo_available(), _cgroup_headroom(), _rlimit_cap()) if x is not None]
    return max(0, min(known)) if known else 0


# Run in a child process whose BLAS has one thread: see measure_gflops.
_MEASURE = """
import sys, time
import numpy as np
seconds, n = float(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
a = rng.standard_normal((n, n), dtype=np.float32)
b = rng.standard_normal((n, n), dtype=np.float32)
a @ b
best, start, reps = float("inf"), time.perf_counter(), 0
while reps < 3 or time.perf_counter() - start < seconds:
    t = time.thread_time()
    a @ b
    best = min(best, time.thread_time() - t)
    reps += 1
print(2 * n ** 3 / max(best, 1e-9) / 1e9)
"""
SINGLE_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                     "VECLIB_MAXIMUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1"}


def usable_cores() -> int:
    """The cores this process may run on (a container's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def measure_gflops(seconds: float = 0.25, n: int = 256) -> float:
    """fp32 matmul throughput of this machine: one core's rate in CPU time, times the cores.

    Measured the way it reads the same on a busy machine as on an idle one.
    numpy's BLAS splits a matmul over all cores and its threads wait on each
    other: with every core busy elsewhere (a local swarm's nodes starting
    together, a neighbour compiling) the wall-clock rate fell from 170 to
    0.5 GFLOP/s on the same CPU. One BLAS thread, timed by the CPU time it
    was given (``time.thread_time``), does not see the neighbours: the best of
    at least three repetitions is what one core does when it has the CPU,
    which, times the cores, is what the machine does when idle. The child
    process is how BLAS gets one thread (its thread count is fixed when numpy
    loads); should the child fail, this process measures by wall clock.
    """
    try:
        out = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(seconds), str(n)], env={**os.environ, **SINGLE_THREAD_ENV},
            capture_output=True, text=True, timeout=60 + 4 * seconds, stdin=subprocess.DEVNULL,
        )
        per_core = float(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return _measure_wall_clock(seconds, n)
    return round(per_core * usable_cores(), 2)


def _measure_wall_clock(seconds: float, n: int) -> float:
    """The fallback: the best wall-clock repetition in this process (all BLAS threads)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm-up
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return round(2 * n**3 / best / 1e9, 2)


def usable_drivers() -> list[tuple[str, list[Device]]]:
    """IREE drivers for which the runtime can enumerate at least one device."""
    try:
        import iree.runtime as ireert
    except ImportError:
        return []
    found: list[tuple[str, list[Device]]] = []
    for driver_name in ("cuda", "hip", "vulkan", "metal", "local-task"):
        try:
            driver = ireert.get_driver(driver_name)
            infos = driver.query_available_devices()
        except Exception:  # the runtime raises plain RuntimeError/ValueError per driver
            continue
        if driver_name == "local-task":
            found.append((driver_name, [Device(name="cpu", driver=driver_name, memory_bytes=memory_bytes())]))
        elif infos:
            devices = [Device(name=str(d.get("name", d.get("path", "?"))), driver=driver_name) for d in infos]
            found.append((driver_name, devices))
    return found


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe(backend: str = "auto", *, benchmark_s: float = 0.25) -> Capabilities:
    """Measure this machine; ``backend`` restricts the drivers advertised."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    drivers = usable_drivers()
    if backend != "auto":
        wanted = BACKEND_DRIVERS[backend]
        drivers = [(d, devs) for d, devs in drivers if d == wanted]
        if not drivers:
            raise ConfigError(f"--backend {backend}: the IREE runtime finds no {wanted} device here")
    model, flags = cpu_info()
    versions = {
        k: v
        for k, v in {
            "pcp": __version__,
            "python": platform.python_version(),
            "libp2p": _version("libp2p"),
            "iree-runtime": _version("iree-base-runtime"),
            "iree-compiler": _version("iree-base-compiler"),
            "jax": _version("jax"),
        }.items()
        if v is not None
    }
    can_compile = all(importlib.util.find_spec(m) is not None for m in ("jax", "iree.compiler"))
    return Capabilities(
        backends=tuple(d for d, _ in drivers),
        cpu_model=model[:120],
        cpu_arch=platform.machine(),
        cpu_flags=flags,
        cpu_count=os.cpu_count() or 1,
        memory_bytes=memory_bytes(),
        devices=tuple(dev for _, devs in drivers for dev in devs),
        throughput_gflops=measure_gflops(benchmark_s) if benchmark_s > 0 else 0.0,
        versions=versions,
        can_compile=can_compile,
        throughput_measured_at=round(time.time(), 1) if benchmark_s > 0 else 0.0,
        memory_free_bytes=free_memory_bytes(),
    )
