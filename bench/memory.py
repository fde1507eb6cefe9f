"""The memory model against the executor child's measured peak: is sizing ever short?

The shepherd sizes each term's micro-batch from :mod:`pcp_p2p.compile.memory`'s
model of a worker's need. Here, for each case (model, B, T, micro-batch M), the
train program is compiled for the CPU variant this machine runs, an executor
child loads θ and runs two train calls of H steps, and its peak ``VmData`` (the
private memory it mapped: what ``RLIMIT_DATA`` limits; glibc never trims its
heap in the child, so the figure at the end is the peak) and peak RSS
(``VmHWM``) are read from ``/proc``. The model's executor part
(:func:`~pcp_p2p.compile.memory.executor_bytes`: runtime, copies of θ in a call,
M sequences' activations) is what they are compared with.

The headline is the largest measured/modelled ratio over the cases: above 1.0
the model is short and a node sized by it could run out of memory (lower is
better; the target is <= 1.0). Every case's figures are printed beside it.
Linux only (``/proc``).

    .venv/bin/python bench/memory.py
    .venv/bin/python bench/memory.py --cases small:16:128:4,medium:16:64:0 --steps 5
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from pcp_p2p.compile.cache import ArtifactCache
from pcp_p2p.compile.memory import executor_bytes
from pcp_p2p.compile.model import init_params, num_params, preset
from pcp_p2p.compile.pipeline import build_artifacts, write_artifact
from pcp_p2p.compile.programs import ProgramOptions
from pcp_p2p.core.identity import Identity
from pcp_p2p.executor.cpu import best_cpu_target
from pcp_p2p.executor.executor import Executor

DEFAULT_CASES = ("small:16:128:0,small:16:128:4,small:16:128:1,medium:16:64:0,medium:16:64:4,"
                 "medium:16:256:2")


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


def measure(name: str, batch: int, seq: int, micro_batch: int, steps: int, identity: Identity,
            cache: ArtifactCache, out: Path) -> dict[str, object]:
    cfg = preset(name)
    opts = ProgramOptions(inner_steps=steps, batch=batch, seq=seq, micro_batch=micro_batch)
    t0 = time.perf_counter()
    [art] = build_artifacts(name, cfg, opts, ["train"], [best_cpu_target()], identity, cache)
    compile_s = time.perf_counter() - t0
    vmfb, _ = write_artifact(out / f"{name}-{batch}-{seq}-{micro_batch}", art)
    rng = np.random.default_rng(0)
    xs = rng.integers(0, cfg.vocab_size, (steps, batch, seq)).astype(np.int32)
    with Executor.start(vmfb, art.manifest, expected_signer=identity.peer_id) as ex:
        ex.load_state(init_params(cfg))
        t1 = time.perf_counter()
        for _ in range(2):
            ex.train(1e-3, xs, xs)
        call_s = (time.perf_counter() - t1) / 2
        vm_data, hwm = _status(ex.pid, "VmData"), _status(ex.pid, "VmHWM")
    modelled = executor_bytes(cfg, seq, micro_batch or batch)
    return {"case": f"{name}:{batch}:{seq}:{micro_batch}", "params": num_params(cfg),
            "vm_data_mib": vm_data >> 20, "rss_peak_mib": hwm >> 20, "modelled_mib": modelled >> 20,
            "ratio": round(vm_data / modelled, 3), "compile_s": round(compile_s, 1), "call_s": round(call_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="model:B:T:M,... (M 0 = the whole batch)")
    ap.add_argument("--steps", type=int, default=5, help="H, inner steps per train call")
    args = ap.parse_args()
    identity = Identity.generate()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pcp-bench-memory-") as tmp:
        cache = ArtifactCache(Path(tmp) / "cache")
        for case in args.cases.split(","):
            name, b, t, m = case.split(":")
            row = measure(name, int(b), int(t), int(m), args.steps, identity, cache, Path(tmp))
            print(json.dumps(row), flush=True)
            rows.append(row)
    ratio, case = max((float(str(r["ratio"])), str(r["case"])) for r in rows)
    print(json.dumps({"headline": ratio, "target": 1.0, "better": "lower", "unit": "measured/modelled",
                      "worst_case": case, "cases": rows}))


if __name__ == "__main__":
    main()
