"""The capability probe's throughput figure: the same on a busy machine as on an idle one,
and stamped with when it was measured."""

from __future__ import annotations

import subprocess
import sys
import time

from pcp_p2p.net.capabilities import measure_gflops, probe, usable_cores

# Keeps every core busy with numpy's multi-threaded BLAS, as a neighbour training would.
BUSY = ("import numpy as np, time\na = np.ones((600, 600), np.float32)\nend = time.time() + 20\n"
        "while time.time() < end: a @ a\n")


def test_throughput_read_under_load_matches_the_idle_figure() -> None:
    idle = measure_gflops(0.2)
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.DEVNULL) for _ in range(2 * usable_cores())]
    try:
        time.sleep(0.5)  # let them load numpy and start multiplying; there is no event to wait on
        loaded = measure_gflops(0.2)
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait(timeout=10)
    assert idle > 0 and loaded > 0
    # The wall-clock figure fell 300-fold under such load (170 -> 0.5 GFLOP/s); CPU time on one
    # BLAS thread moves by cache and frequency effects only.
    assert loaded > idle / 4, (idle, loaded)


def test_the_probe_says_when_it_measured_and_a_server_that_did_not_says_so() -> None:
    before = time.time()
    caps = probe(benchmark_s=0.05)
    assert caps.throughput_gflops > 0 and before - 1 <= caps.throughput_measured_at <= time.time() + 1
    bare = probe(benchmark_s=0.0)
    assert bare.throughput_gflops == 0.0 and bare.throughput_measured_at == 0.0
