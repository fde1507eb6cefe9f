"""A node under a memory cap: it advertises the cap, the shepherd sizes the micro-batch for it,
and the sized artifact trains there while the whole batch at once cannot.

The cap is ``RLIMIT_DATA`` (``ulimit -d``), set in child processes: the node's
process measures its free memory under it, and the executor child it starts
inherits it, as a worker's would. RLIMIT_DATA limits the private writable memory
a process maps, which is where IREE's CPU driver puts every buffer of a call.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest_compile import CACHE, shepherd

from pcp_p2p.compile.memory import train_memory_bytes
from pcp_p2p.compile.model import PRESETS
from pcp_p2p.compile.pipeline import compile_lowered, lower_program, write_artifact
from pcp_p2p.diloco.protocol.sizing import plan_memory
from pcp_p2p.diloco.protocol.spec import InnerOptimizer, RunSpec
from pcp_p2p.diloco.run.engine import KEEP_STATES, program_options
from pcp_p2p.executor.cpu import best_cpu_target

CAP = 800 << 20
BATCH, SEQ = 128, 128  # small's activations at 128 sequences (~1.6 GB) are far over the cap

_MEASURE = "from pcp_p2p.net.capabilities import free_memory_bytes; print(free_memory_bytes())"

_TRAIN = """
import json, sys
import numpy as np
from pcp_p2p.compile.manifest import Manifest
from pcp_p2p.compile.model import PRESETS, init_params
from pcp_p2p.core.errors import ExecutorError
from pcp_p2p.executor.executor import Executor

signer, batch, seq, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
cfg = PRESETS["small"]
rng = np.random.default_rng(0)
seqs = rng.integers(0, cfg.vocab_size, size=(1, batch, seq + 1), dtype=np.int32)
out = {}
for label, (vmfb, manifest) in runs.items():
    try:
        with Executor.start(vmfb, Manifest.from_bytes(open(manifest, "rb").read()), expected_signer=signer) as ex:
            ex.load_state(init_params(cfg))
            losses = ex.train(1e-3, seqs[..., :-1].copy(), seqs[..., 1:].copy())
        out[label] = "trained" if np.all(np.isfinite(losses)) else "diverged"
    except ExecutorError as exc:
        out[label] = type(exc).__name__ + ": " + " ".join(str(exc).split())[:300]
print(json.dumps(out))
"""


def _capped(code: str, *args: str) -> str:
    """Run ``code`` in a Python child that caps itself first (no preexec_fn: this process runs JAX's threads)."""
    capped = f"import resource; resource.setrlimit(resource.RLIMIT_DATA, ({CAP}, {CAP}))\n{code}"
    done = subprocess.run([sys.executable, "-c", capped, *args], capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_sized_micro_batch_trains_under_a_cap_the_whole_batch_exceeds(tmp_path: Path) -> None:
    cfg = PRESETS["small"]
    spec = dataclasses.replace(RunSpec(model="small"),
                               inner=InnerOptimizer(batch_size=BATCH, seq_len=SEQ)).validate()
    free = int(_capped(_MEASURE))  # what this node's member record would advertise
    assert free == CAP
    plan = plan_memory(spec, cfg, [free], KEEP_STATES)
    assert 1 <= plan.micro_batch < BATCH and plan.need_bytes <= CAP  # sized below the batch
    assert train_memory_bytes(cfg, SEQ, BATCH, KEEP_STATES) > CAP  # the model says the whole batch cannot

    target = best_cpu_target()
    runs = {}
    for label, micro_batch in (("sized", plan.micro_batch), ("whole", BATCH)):
        opts = dataclasses.replace(program_options(spec, micro_batch), inner_steps=1)
        art = compile_lowered(lower_program("train", cfg, opts), target, shepherd(), "small", CACHE)
        assert art.manifest.options["micro_batch"] == (0 if micro_batch == BATCH else micro_batch)
        vmfb, manifest = write_artifact(tmp_path / label, art)
        runs[label] = (str(vmfb), str(manifest))

    out = json.loads(_capped(_TRAIN, shepherd().peer_id, str(BATCH), str(SEQ), json.dumps(runs)))
    assert out["sized"] == "trained", out
    assert out["whole"].startswith("Executor"), out  # the child ran out of memory: a typed executor error
