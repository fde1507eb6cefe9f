"""A worker group without the network: the MPI tests and ``bench/cluster.py`` drive a GroupEngine directly.

The parent (pytest, the benchmark) compiles the train artifact once
(:func:`prepare`) and starts ``mpiexec -n K python -m pcp_p2p.testing.mpi_group
CONFIG.json``. Rank 0 opens the :class:`~pcp_p2p.cluster.group.WorkerGroup`,
starts its own executor, hands it to the group exactly as the node's runtime
does (:meth:`~pcp_p2p.cluster.group.WorkerGroup.engine_for`) and plays a
scenario, writing one JSON result:

- ``equal``: one round of the group; then the same process trains every rank's
  sub-shard itself from the same θ (fresh moments, like the ranks) and combines
  them with :func:`~pcp_p2p.diloco.protocol.group_split.combine`: the largest difference
  between the two θ_local, and the steps and tokens of each rank.
- ``kill``: one round, then a round during which rank 1 is SIGKILLed (by pid,
  from its hello) half a second in, then one more round: how long each took and
  who contributed. ``"signal": "SIGSTOP"`` hangs the rank instead.
- ``bench``: ``rounds`` group rounds against the same total work done by one
  process, round time and tokens/s.

The other ranks run :func:`~pcp_p2p.cluster.group.serve_follower`, exactly what
``pcp node join`` runs on them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # imported where used: the parent process needs none of these to write a config
    from pcp_p2p.cluster.group import GroupEngine, WorkerGroup
    from pcp_p2p.compile.pipeline import Artifact
    from pcp_p2p.diloco.protocol.effects import RunInner
    from pcp_p2p.diloco.protocol.messages import DataAssignment
    from pcp_p2p.diloco.protocol.worker import InnerResult
    from pcp_p2p.diloco.run.engine import InnerEngine

SPEC = """
name = "group"
[model]
preset = "tiny"
[inner]
batch_size = 4
seq_len = 32
[round]
time_budget_s = 60.0
max_inner_steps = {steps}
"""


def corpus(n: int = 60_000) -> str:
    """A deterministic character corpus (no download): enough for many sub-shards."""
    rng = np.random.default_rng(7)
    words = ["the", "group", "trains", "one", "delta", "rank", "over", "mpi", "and", "a", "swarm", "of", "nodes"]
    return " ".join(words[i] for i in rng.integers(0, len(words), size=n // 4))[:n]


def prepare(out: Path, *, steps: int = 20, mode: str = "equal", artifact: Artifact | None = None,
            **extra: Any) -> Path:
    """Write the scenario's config (and the artifact's files); its path.

    ``artifact``: a compiled train :class:`~pcp_p2p.compile.pipeline.Artifact` for
    :data:`SPEC`'s program options and the tiny preset (the tests pass the session's
    shared one); None compiles it here.
    """
    from pcp_p2p.compile.model import PRESETS
    from pcp_p2p.compile.pipeline import Lowered, compile_lowered, lower_program, write_artifact
    from pcp_p2p.compile.targets import get_target
    from pcp_p2p.core.identity import Identity
    from pcp_p2p.diloco.protocol.spec import parse_spec
    from pcp_p2p.diloco.run.engine import program_options
    from pcp_p2p.executor.cpu import best_cpu_target

    out.mkdir(parents=True, exist_ok=True)
    spec_text = SPEC.format(steps=steps)
    spec = parse_spec(spec_text)
    if artifact is None:
        lowered: Lowered = lower_program("train", PRESETS["tiny"], program_options(spec))
        artifact = compile_lowered(lowered, get_target(best_cpu_target().name), Identity.generate(), "tiny", None)
    vmfb, manifest = write_artifact(out / "art", artifact)
    cfg = {"mode": mode, "spec": spec_text, "vmfb": str(vmfb), "manifest": str(manifest),
           "shepherd": artifact.manifest.signer, "vocab_size": PRESETS["tiny"].vocab_size, "steps": steps,
           "result": str(out / f"{mode}.json"), **extra}
    path = out / f"{mode}.config.json"
    path.write_text(json.dumps(cfg))
    return path


def main(config_path: str) -> int:
    from pcp_p2p.cluster.group import WorkerGroup, serve_follower
    from pcp_p2p.cluster.rankproc import is_rank_child, rank_argv, supervise
    from pcp_p2p.core import logs
    from pcp_p2p.core.launch import detect_launch

    logs.configure("INFO")
    cfg = json.loads(Path(config_path).read_text())
    launch = detect_launch(os.environ)
    if launch is None:
        raise SystemExit("run me under mpiexec -n K (K >= 2)")
    if not is_rank_child():
        return supervise(rank_argv(), lead=launch.is_lead)
    if not launch.is_lead:
        return serve_follower(launch, silence_s=float(cfg.get("silence_s", 30.0)))
    group = WorkerGroup.open(launch, timeout_s=float(cfg.get("timeout_s", 10.0)), heartbeat_s=1.0)
    try:
        result = SCENARIOS[cfg["mode"]](group, cfg)
    finally:
        group.close("the scenario ended")
    Path(cfg["result"]).write_text(json.dumps(result))
    return 0


def _setup(group: WorkerGroup, cfg: dict[str, Any]) -> tuple[GroupEngine, InnerEngine, dict[str, np.ndarray]]:
    from pcp_p2p.compile.manifest import read_manifest
    from pcp_p2p.core.identity import Identity
    from pcp_p2p.diloco.algorithm.data import CharDataset
    from pcp_p2p.diloco.protocol.spec import parse_spec, sign_spec
    from pcp_p2p.diloco.run.engine import InnerEngine, initial_theta, start_executor
    from pcp_p2p.wire import encode

    spec = parse_spec(cfg["spec"])
    ds = CharDataset.from_text(corpus())
    manifest = read_manifest(Path(cfg["manifest"]))
    local = InnerEngine(start_executor(Path(cfg["vmfb"]), manifest, cfg["shepherd"]), spec, ds)
    engine = group.engine_for(local, sign_spec(spec, Identity.generate()), encode(manifest), Path(cfg["vmfb"]),
                              cfg["shepherd"])
    return engine, local, initial_theta(spec, int(cfg["vocab_size"]))


def _round(theta: dict[str, np.ndarray], r: int, steps: int, state: str | None = None,
           budget_s: float = 60.0) -> RunInner:
    from pcp_p2p.diloco.protocol.effects import RunInner
    from pcp_p2p.diloco.protocol.messages import DataAssignment

    a = DataAssignment(worker="group", shard=0, num_shards=1, seed=1000 + r, max_steps=steps)
    return RunInner(round=r, attempt=0, theta=theta, theta_cid="", artifact_cid=None, assignment=a,
                    time_budget_s=budget_s, inner_state=state)


def _split(engine: GroupEngine, eff: RunInner) -> list[DataAssignment]:
    """The sub-assignments the group used (same function, same weights)."""
    from pcp_p2p.diloco.protocol.audit import CHUNK_STEPS
    from pcp_p2p.diloco.protocol.group_split import rank_steps, sub_assignments

    g = engine.group
    members = list(g.last_round["ranks"])
    steps = rank_steps(eff.assignment.max_steps, [g.ranks[r].gflops for r in members], CHUNK_STEPS)
    return sub_assignments(eff.assignment, steps)


def _equal(group: WorkerGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    from pcp_p2p.diloco.protocol.group_split import combine

    engine, local, theta = _setup(group, cfg)
    eff = _round(theta, 0, cfg["steps"])
    t0 = time.monotonic()
    res = engine.run(eff, threading.Event())
    group_s = time.monotonic() - t0
    parts, per_rank = [], []
    t0 = time.monotonic()
    for sub in _split(engine, eff):
        one = local.run(replace(eff, assignment=sub, inner_state=None), threading.Event())
        tokens = one.steps * local.spec.tokens_per_step
        parts.append((one.theta, tokens))
        per_rank.append({"steps": one.steps, "tokens": tokens})
    single_s = time.monotonic() - t0
    ref = combine(theta, parts)
    diff = max(float(np.max(np.abs(res.theta[k] - ref[k]))) for k in ref)
    scale = max(float(np.max(np.abs(theta[k] - ref[k]))) for k in ref)
    # a second round from the group's kept state, audited as the swarm would audit it
    res2 = engine.run(_round(theta, 1, cfg["steps"], res.inner_state), threading.Event())
    return {"max_abs_diff": diff, "delta_max_abs": scale, "steps": res.steps,
            "tokens": res.steps * local.spec.tokens_per_step, "reference": per_rank,
            "group": group.status(), "group_s": group_s, "single_s": single_s,
            "state_in": res.state_in, "state_out": res.state_out,
            "audit": _audit_round(engine, local, theta, _round(theta, 1, cfg["steps"]), res2)}


def _audit_round(engine: GroupEngine, auditor: InnerEngine, theta: dict[str, np.ndarray], eff: RunInner,
                 res: InnerResult) -> dict[str, Any]:
    """Sign the group's round as its worker would, serve its state bundle over MPI, replay it as an auditor."""
    from pcp_p2p.core.cid import cid_of
    from pcp_p2p.core.identity import Identity
    from pcp_p2p.diloco.algorithm.params import codec_of, pack_tensors, params_cid
    from pcp_p2p.diloco.protocol import audit
    from pcp_p2p.diloco.protocol.audit import CHUNK_STEPS
    from pcp_p2p.diloco.protocol.group_replay import check_split, decode_group_state, stateful_ranks
    from pcp_p2p.diloco.protocol.messages import Submission, sign
    from pcp_p2p.diloco.protocol.worker import pseudo_gradient
    from pcp_p2p.wire import encode

    worker, auditor_id, shepherd = Identity.generate(), Identity.generate(), Identity.generate()
    spec = auditor.spec
    a = replace(eff.assignment, worker=worker.peer_id)
    codec = spec.round.delta_codec
    sub = sign(Submission(
        run_id="group-run", term=0, round=1, attempt=0, worker=worker.peer_id, base_theta_cid=params_cid(theta),
        codec=codec, delta_cid=None, delta_inline=codec_of(codec).encode(pseudo_gradient(theta, res.theta)),
        steps=res.steps, tokens=res.steps * spec.tokens_per_step, losses=res.losses, state_in=res.state_in,
        state_out=res.state_out, group=res.group), worker)
    check_split(sub, a, CHUNK_STEPS)  # what the shepherd checks before it accepts the group's Δ
    sub_bytes = encode(sub)
    req = sign(audit.AuditRequest(
        run_id="group-run", term=0, round=1, attempt=0, worker=worker.peer_id, submission_cid=cid_of(sub_bytes),
        beacon="b", assignment=a, target="t", artifact_cid="a", dataset_cid="d", auditor=auditor_id.peer_id,
        shepherd=shepherd.peer_id, shepherd_term=0), shepherd)
    job = audit.AuditJob(req, auditor_id, chunk_steps=CHUNK_STEPS)
    job.on_blob(req.submission_cid, sub_bytes)
    job.on_blob(params_cid(theta), pack_tensors(theta, "fp32"))
    bundle = engine.export_state(res.state_in)  # every rank's start state, gathered over MPI
    job.on_offer(audit.make_offer(req, res.state_in, bundle, worker))
    job.on_blob(cid_of(bundle), bundle)
    report = job.finish_replays([auditor.replay(*i) for i in job.replay_inputs()])
    return {"verdict": report.verdict, "differs": list(report.differs), "max_abs_diff": report.max_abs_diff,
            "parts": [[p.rank, p.max_steps, p.steps] for p in res.group],
            "served_ranks": list(decode_group_state(bundle, stateful_ranks(sub)))}


def _kill(group: WorkerGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    engine, _local, theta = _setup(group, cfg)
    out: dict[str, Any] = {"rounds": []}
    victim = group.ranks[1].pid
    how = signal.Signals[cfg.get("signal", "SIGKILL")]  # SIGSTOP: a hung rank
    state = None
    for r in range(3):
        eff = _round(theta, r, cfg["steps"], state, budget_s=float(cfg.get("budget_s", 2.0)))
        if r == 1:
            threading.Timer(float(cfg.get("kill_after_s", 0.5)), os.kill, (victim, how)).start()
        t0 = time.monotonic()
        res = engine.run(eff, threading.Event())
        state = res.inner_state
        out["rounds"].append({"round": r, "seconds": time.monotonic() - t0, "steps": res.steps,
                              "ranks": list(group.last_round["ranks"]), "live": list(group.live)})
    out["group"] = group.status()
    if how is not signal.SIGKILL:
        os.kill(victim, signal.SIGKILL)  # a hung rank never ends by itself: the job's end is ours
    return out


def _bench(group: WorkerGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    engine, local, theta = _setup(group, cfg)
    rounds = int(cfg.get("rounds", 3))
    bt = local.spec.tokens_per_step
    g_times, g_tokens, allreduce = [], [], []
    for r in range(rounds):
        eff = _round(theta, r, cfg["steps"])
        t0 = time.monotonic()
        res = engine.run(eff, threading.Event())
        g_times.append(time.monotonic() - t0)
        g_tokens.append(res.steps * bt)
        allreduce.append(group.last_round["allreduce_s"])
    s_times, s_tokens = [], []
    for r in range(rounds):
        eff = _round(theta, r, cfg["steps"])
        t0 = time.monotonic()
        tokens = 0
        for sub in _split(engine, eff):  # the same total work, one process
            tokens += local.run(replace(eff, assignment=sub, inner_state=None), threading.Event()).steps * bt
        s_times.append(time.monotonic() - t0)
        s_tokens.append(tokens)
    return {"group_round_s": g_times, "group_tokens": g_tokens, "allreduce_s": allreduce,
            "single_round_s": s_times, "single_tokens": s_tokens, "group": group.status()}


SCENARIOS = {"equal": _equal, "kill": _kill, "bench": _bench}

if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
