"""Worker groups under MPI (pcp_p2p.cluster): the arithmetic, and real ``mpiexec -n 2`` groups.

The MPI tests run the mpich wheel's ``mpiexec`` from this interpreter's environment
(no system MPI) on :mod:`pcp_p2p.testing.mpi_group`, which drives the same
GroupEngine and follower loop ``pcp node join`` runs, on the real IREE executor.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pcp_p2p.cluster.rank_messages import Done, Train, frame, unframe
from pcp_p2p.core.errors import ConfigError, ProtocolError
from pcp_p2p.core.launch import detect_launch, without_launch
from pcp_p2p.diloco.algorithm.data import batches_for_assignment
from pcp_p2p.diloco.protocol.group_split import combine, group_state, mean_losses, rank_steps, sub_assignments
from pcp_p2p.diloco.protocol.messages import FRESH_STATE, DataAssignment

MPIEXEC = Path(sys.executable).parent / "mpiexec"


# -- launcher detection ------------------------------------------------------------------------


def test_detects_each_launcher() -> None:
    assert detect_launch({}) is None
    assert detect_launch({"PMI_RANK": "1", "PMI_SIZE": "4"}) == detect_launch({"PMI_RANK": "1", "PMI_SIZE": "4"})
    mpich = detect_launch({"PMI_RANK": "1", "PMI_SIZE": "4"})
    assert mpich is not None and (mpich.launcher, mpich.rank, mpich.size, mpich.is_lead) == ("mpich", 1, 4, False)
    ompi = detect_launch({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    assert ompi is not None and (ompi.launcher, ompi.is_lead) == ("openmpi", True)
    slurm = detect_launch({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"})
    assert slurm is not None and (slurm.launcher, slurm.rank) == ("slurm", 3)
    # mpiexec inside an allocation: the MPI launcher's numbering wins over Slurm's
    both = detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "PMI_RANK": "1", "PMI_SIZE": "2"})
    assert both is not None and (both.launcher, both.rank) == ("mpich", 1)
    # a group of one is a plain node: MPI is never initialised
    assert detect_launch({"PMI_RANK": "0", "PMI_SIZE": "1"}) is None


@pytest.mark.parametrize("env", [{"PMI_RANK": "x", "PMI_SIZE": "2"}, {"PMI_RANK": "2", "PMI_SIZE": "2"},
                                 {"SLURM_PROCID": "-1", "SLURM_NTASKS": "2"}])
def test_malformed_launch_is_a_config_error(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        detect_launch(env)


def test_executor_children_do_not_inherit_the_launch() -> None:
    env = {"PMI_RANK": "0", "PMI_FD": "9", "OMPI_COMM_WORLD_SIZE": "2", "PATH": "/bin", "HOME": "/root"}
    assert without_launch(env) == {"PATH": "/bin", "HOME": "/root"}


# -- the split and the average -------------------------------------------------------------------


def test_rank_steps_are_whole_chunks_by_throughput() -> None:
    assert rank_steps(100, [1.0, 1.0], 5) == [50, 50]
    assert rank_steps(100, [3.0, 1.0], 5) == [75, 25]
    assert rank_steps(23, [1.0, 1.0], 5) == [10, 10]  # whole chunks only, never above the cap
    assert rank_steps(5, [1.0, 1.0, 1.0], 5) == [5, 0, 0]  # fewer chunks than ranks: some sit out
    assert rank_steps(30, [0.0, 0.0], 5) == [15, 15]  # no measurement: equal shares
    for w in ([1.0, 2.5, 0.3], [7.0], [1.0] * 9):
        assert sum(rank_steps(200, w, 5)) == 200


def test_sub_shards_partition_the_group_shard() -> None:
    tokens = np.arange(10_000, dtype=np.int32)
    group = DataAssignment(worker="g", shard=1, num_shards=3, seed=42, max_steps=20)
    subs = sub_assignments(group, [10, 10])
    assert [(s.shard, s.num_shards) for s in subs] == [(2, 6), (3, 6)]
    assert len({s.seed for s in subs}) == 2 and all(s.max_steps == 10 for s in subs)
    lo, hi = 10_000 // 3, 2 * 10_000 // 3
    windows = [batches_for_assignment(tokens, s, batch_size=2, seq_len=8)[0] for s in subs]
    for w in windows:  # every window inside the group's own shard
        assert w.min() >= lo - 1 and w.max() < hi + 1
    assert windows[0].max() < windows[1].min() + 8  # the two pieces are the shard's two halves


def test_combine_is_the_token_weighted_average_of_deltas() -> None:
    theta = {"a": np.ones(3, np.float32), "b": np.zeros((2, 2), np.float32)}
    l1 = {"a": np.full(3, 0.5, np.float32), "b": np.full((2, 2), 1.0, np.float32)}
    l2 = {"a": np.full(3, 0.8, np.float32), "b": np.full((2, 2), -1.0, np.float32)}
    out = combine(theta, [(l1, 300), (l2, 100)])
    np.testing.assert_allclose(out["a"], 1 - (0.75 * 0.5 + 0.25 * 0.2), rtol=1e-6)
    np.testing.assert_allclose(out["b"], 0.75 * 1.0 + 0.25 * -1.0, rtol=1e-6)
    assert combine(theta, [(l1, 50)])["a"][0] == pytest.approx(0.5)


def test_group_state_names_and_losses() -> None:
    assert group_state({0: FRESH_STATE, 1: FRESH_STATE}) == FRESH_STATE
    a = group_state({0: "x", 1: FRESH_STATE})
    assert a.startswith("grp-") and a != group_state({0: "x", 1: "y"}) and a == group_state({1: FRESH_STATE, 0: "x"})
    assert mean_losses([(1.0, 2.0, 3.0), (3.0, 4.0)]) == (2.0, 3.0, 3.0)


def test_group_frames_are_checked() -> None:
    msg = Train(1, "run", 0, 0, DataAssignment("g", 0, 1, 1, 10), 2.0, "")
    got, parts = unframe(frame(msg, b"theta", b""), Train)
    assert got == msg and [bytes(p) for p in parts] == [b"theta", b""]
    data = frame(Done(1, 1, 10, (1.0,), "fresh", "d"), b"xyz")
    for bad in (data[:-1], data + b"!", data[:3], b"\x00\x00\x00\x01\x09" + data[5:]):
        with pytest.raises(ProtocolError):
            unframe(bad, Done)
    with pytest.raises(ProtocolError):
        unframe(frame(msg), Done)  # a Train where a Done was expected


# -- real groups under mpiexec -----------------------------------------------------------------------


def _mpiexec(config: Path, n: int, timeout_s: float) -> subprocess.CompletedProcess[str]:
    import os

    env = {**without_launch(os.environ), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(
        [str(MPIEXEC), "-disable-auto-cleanup", "-n", str(n), sys.executable, "-m", "pcp_p2p.testing.mpi_group",
         str(config)], capture_output=True, text=True, timeout=timeout_s, env=env)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny train artifact for the default spec's shapes: the session's, shared with test_audit_replay."""
    from conftest_compile import artifact

    from pcp_p2p.diloco.protocol.spec import parse_spec
    from pcp_p2p.diloco.run.engine import program_options
    from pcp_p2p.executor.cpu import best_cpu_target
    from pcp_p2p.testing.mpi_group import SPEC, prepare

    opts = program_options(parse_spec(SPEC.format(steps=20)))
    return prepare(tmp_path_factory.mktemp("group"), steps=20, mode="equal",
                   artifact=artifact("train", best_cpu_target().name, opts))


@pytest.mark.mpi
@pytest.mark.timeout(120, func_only=True)  # the module's shared compile is not this test's time
def test_two_ranks_equal_one_process_training_both_sub_shards(compiled: Path) -> None:
    proc = _mpiexec(compiled, 2, 90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(Path(json.loads(compiled.read_text())["result"]).read_text())
    # The same artifact on the same target is bit-for-bit deterministic across processes
    # (docs/diloco.md, "Audits"); the allreduce sums in float64, one process sums the same
    # float64 terms: the tolerance allows float32 rounding of θ − Δ (|θ| ≲ 1) and no more.
    assert res["max_abs_diff"] <= 1e-6, res
    assert res["delta_max_abs"] > 1e-4  # and the round did move θ
    assert [r["steps"] for r in res["reference"]] == [10, 10]
    assert res["steps"] == 20 and res["tokens"] == sum(r["tokens"] for r in res["reference"])  # tokens add up
    g = res["group"]
    assert g["size"] == 2 and g["live"] == 2 and g["last_round"]["ranks"] == [0, 1]
    assert res["state_in"] == FRESH_STATE and res["state_out"].startswith("grp-")
    # the group's next round (from its kept state) audited as the swarm audits it: the signed split, each rank's
    # start state served over MPI, every part replayed and recombined: bit for bit what the allreduce made
    au = res["audit"]
    assert au["verdict"] == "match" and au["max_abs_diff"] == 0.0, au
    assert au["parts"] == [[0, 10, 10], [1, 10, 10]] and au["served_ranks"] == [0, 1]


@pytest.mark.mpi
@pytest.mark.timeout(120, func_only=True)  # the module's shared compile is not this test's time
def test_killing_a_rank_mid_round_does_not_hang_the_group(compiled: Path) -> None:
    cfg = json.loads(compiled.read_text())
    kill_cfg = compiled.with_name("kill.config.json")
    result = compiled.with_name("kill.json")
    kill_cfg.write_text(json.dumps({**cfg, "mode": "kill", "steps": 400, "budget_s": 2.0, "timeout_s": 5.0,
                                    "kill_after_s": 0.5, "result": str(result)}))
    t0 = time.monotonic()
    proc = _mpiexec(kill_cfg, 2, 90)
    took = time.monotonic() - t0
    assert result.exists(), proc.stderr[-3000:]
    res = json.loads(result.read_text())
    before, during, after = res["rounds"]
    assert before["ranks"] == [0, 1] and before["live"] == [0, 1]
    # Rank 1 died half a second into the round: the round still ends, with rank 0's part,
    # well inside budget + timeout (the launcher's word and a heartbeat census find the dead rank).
    assert during["ranks"] == [0] and during["live"] == [0] and during["steps"] > 0
    assert during["seconds"] < 2.0 + 5.0 + 1.0
    assert after["ranks"] == [0] and after["seconds"] < 2.0 + 1.0  # no more waiting for the dead rank
    dead = res["group"]["ranks"][1]
    assert not dead["alive"] and dead["why"]
    # The job ended on its own: rank 0 finished, the dead rank's exit code is mpiexec's.
    assert proc.returncode == 128 + 9, proc.stderr[-2000:]
    assert took < 60


@pytest.mark.mpi
@pytest.mark.slow  # ~15 s more of mpiexec; the default run has the kill test
@pytest.mark.timeout(120, func_only=True)  # the module's shared compile is not this test's time
def test_a_hung_rank_costs_one_timeout(compiled: Path) -> None:
    cfg = json.loads(compiled.read_text())
    hang_cfg = compiled.with_name("hang.config.json")
    result = compiled.with_name("hang.json")
    hang_cfg.write_text(json.dumps({**cfg, "mode": "kill", "signal": "SIGSTOP", "steps": 400, "budget_s": 1.0,
                                    "timeout_s": 2.0, "kill_after_s": 0.3, "result": str(result)}))
    proc = _mpiexec(hang_cfg, 2, 90)
    assert result.exists(), proc.stderr[-3000:]
    before, during, after = json.loads(result.read_text())["rounds"]
    assert before["ranks"] == [0, 1]
    # A stopped rank is alive to MPI and the launcher: only the deadline (budget + timeout) finds it.
    assert during["ranks"] == [0] and during["live"] == [0]
    assert 1.0 + 2.0 <= during["seconds"] < 1.0 + 2.0 + 1.5
    assert after["ranks"] == [0] and after["seconds"] < 1.0 + 1.0


def test_status_and_metrics_show_the_group() -> None:
    import copy

    from pcp_p2p.commands.node_commands import render_text
    from pcp_p2p.node.metrics import families

    fixture = Path(__file__).parent / "fixtures" / "status_worker_idle.json"
    obj = copy.deepcopy(json.loads(fixture.read_text()))
    obj["group"] = {"launcher": "mpich", "size": 2, "live": 1, "gflops": 207.0, "rounds": 3, "last_round": {},
                    "ranks": [{"rank": 0, "host": "a", "target": "cpu-x86_64-v4", "gflops": 207.0, "alive": True,
                               "why": "", "steps": 100, "tokens_per_s": 9000.0},
                              {"rank": 1, "host": "b", "target": "cpu-x86_64-v3", "gflops": 150.0, "alive": False,
                               "why": "round 2: rank 1 died", "steps": 0, "tokens_per_s": 0.0}]}
    text = render_text(obj)
    assert "group    1/2 ranks via mpich, 207 GFLOP/s" in text and "dropped: round 2: rank 1 died" in text
    got = {f.name: f.samples[0].value for f in families(obj) if f.name.startswith("pcp_group")}
    assert got == {"pcp_group_ranks": 1.0, "pcp_group_gflops": 207.0}
