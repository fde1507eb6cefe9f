"""The shepherd's bytes per round, measured with N worker processes, over the model's size.

Run: ``.venv/bin/python bench/shepherd_bytes.py`` (several minutes on 2 CPU cores:
it starts 16 + 4 ``pcp`` node processes).

Issue #15 item 3 (and #14's WAN rounds): the star through the shepherd's
uplink is the wall, so its traffic must not grow with the swarm. Goal: at
most 3 models' worth of bytes in + out per round with 16 worker processes,
and flat in N.

What runs: a bootstrap server and ``N`` ``pcp node join`` processes on
127.0.0.1 (:mod:`pcp_p2p.node.local_swarm`) train the ``tiny`` GPT with the
sparse codec (``topk2``: what the bandwidth bench's headline arm uses; a Δ is
~1.5% of θ) for ``ROUNDS`` rounds, the real round flow end to end (signed
messages, the election, heartbeats, the DHT, checkpoint replication, θ by
swarming: :mod:`pcp_p2p.blob.swarm`). A non-shepherd worker's status is
polled to see each commit; the shepherd's own counters (``pcp status``'s
``network``: every byte on its libp2p connections, Noise and yamux included,
plus its blob side channels, both directions) are read at the first commit
after ``WARM`` and at the last, so the set-up (compiling, the artifact and
dataset fetched once per run) is not counted. The bench's own status polls of
the shepherd fall inside the window (a few KiB each: one per round, and one
more for the relay-tree counters at the window's start); their payload (status
``network.protocol_bytes`` of ``/pcp/status``) is taken out of the figures and
reported as ``bench_status_polls_per_round``, since nobody polls a real
shepherd once a round (their framing, a few hundred bytes, stays in). The workers' relay-tree counters
(``network.swarm_*``, summed) say how many fetches a round went past their
ancestors to the origin (``swarm_fetches_from_origin_per_round``): each is a
copy beyond one on the shepherd's uplink. The control bytes are split by
libp2p protocol (status ``network.protocol_bytes``: each protocol's stream
payload, in + out); the rest of them is Noise and yamux framing
(``control_framing_per_round``).

``shepherd_bytes_per_model`` = (bytes in + out) per round / the size of θ as
it travels (the fp32 bundle, the unit of ``bench/bandwidth.py``). Measured at
N = 16 (the headline) and at a smaller N (``PCP_BENCH_SHEPHERD_NS``, default
"4,16"); ``shepherd_bytes_flat_in_n`` is true when the largest N's figure is
at most 1.25x the smallest's (null when one N was measured).

Aggregators (issue #15 item 3): with ``PCP_BENCH_SHEPHERD_AGGREGATORS=K`` every N is
measured twice in the same run, without aggregators (the baseline) and with
``aggregation.aggregators = K`` (``aggregate_above = 4``, ``partial_audit_rate = 0.25``);
the headline is then the aggregated figure at the largest N, and
``shepherd_bytes_without_aggregators_by_n`` holds the baseline's. Aggregators pay where
a worker's Δ is large next to a group's update (a dense codec: ``PCP_BENCH_SHEPHERD_CODEC=int8``);
with ``topk2`` a Δ is ~1.5% of θ, smaller than the int8 update a group sends.

Knobs: ``PCP_BENCH_SHEPHERD_NS`` ("4,16"), ``PCP_BENCH_SHEPHERD_ROUNDS`` (5),
``PCP_BENCH_SHEPHERD_BUDGET`` (2 s of inner steps per round), ``PCP_BENCH_SHEPHERD_CODEC``
("topk2"), ``PCP_BENCH_SHEPHERD_AGGREGATORS`` (0: none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio

from pcp_p2p.blob.server import SwarmCounts
from pcp_p2p.core.errors import PcpError
from pcp_p2p.diloco.protocol.spec import FEEDBACK_CODECS
from pcp_p2p.node.local_swarm import LocalSwarm, NodeProcess, local_swarm, pcp_command
from pcp_p2p.node.status import STATUS_PROTOCOL, to_json

NS = [int(n) for n in os.environ.get("PCP_BENCH_SHEPHERD_NS", "4,16").split(",")]
ROUNDS = int(os.environ.get("PCP_BENCH_SHEPHERD_ROUNDS", "5"))
BUDGET_S = float(os.environ.get("PCP_BENCH_SHEPHERD_BUDGET", "2"))
CODEC = os.environ.get("PCP_BENCH_SHEPHERD_CODEC", "topk2")
AGGREGATORS = int(os.environ.get("PCP_BENCH_SHEPHERD_AGGREGATORS", "0"))
WARM = 2  # rounds before the window opens (the first rounds also fetch the artifact, θ_0, ...)
TARGET = 3.0
FLAT = 1.25
POLL_S = 0.5


def spec(n: int, aggregators: int = 0) -> str:
    # SparseLoCo's outer step for an error-feedback codec (bench/bandwidth.py); the spec's default
    # otherwise: at lr 4 without momentum int8 rounds jumped in val loss, and the guard dropped
    # the suspects (one worker, or a whole group with aggregators)
    outer = "[outer]\nlr = 4.0\nmomentum = 0.0" if CODEC in FEEDBACK_CODECS else ""
    return f"""
name = "shepherd-bytes"
[model]
preset = "tiny"
[inner]
lr = 3e-3
{outer}
[round]
time_budget_s = {BUDGET_S}
max_inner_steps = 100000
deadline_s = {BUDGET_S * 4 + 30 + n}
rounds = {ROUNDS + 2}
min_quorum = {max(2, n // 2)}
delta_codec = "{CODEC}"
[aggregation]
rule = "centered_clip"
audit_rate = 0.0
aggregators = {aggregators}
aggregate_above = 4
[election]
rotate_every = 0
"""


async def status_of(swarm: LocalSwarm, proc: NodeProcess) -> dict[str, Any]:
    try:
        return to_json(await swarm.status(proc, timeout=10.0))
    except PcpError:
        return {}


SWARM_KEYS = tuple(SwarmCounts().as_status())  # swarm_fetches, swarm_fetches_from_origin, swarm_waits_missed


async def swarm_totals(swarm: LocalSwarm) -> dict[str, int]:
    """The relay trees' counters summed over the workers (status ``network.swarm_*``): fetches
    that went past every ancestor to the origin are copies beyond one on its uplink."""
    totals = dict.fromkeys(SWARM_KEYS, 0)
    for w in swarm.workers:
        net = (await status_of(swarm, w)).get("network") or {}
        for k in SWARM_KEYS:
            totals[k] += int(net.get(k) or 0)
    return totals


async def arm(root: Path, n: int, aggregators: int = 0) -> dict[str, Any]:
    name = f"n{n}a{aggregators}"
    async with local_swarm(root / name, extra_args=["--trust-any"]) as swarm:
        boot = await swarm.start_bootstrap()
        await swarm.add_workers(n, deadline_s=120 + 10 * n)
        (root / f"{name}.toml").write_text(spec(n, aggregators))
        await trio.to_thread.run_sync(lambda: subprocess.run(
            [*pcp_command(), "run", "create", str(root / f"{name}.toml"), "--bootstrap", boot.addr,
             "--data-dir", str(root / f"owner{name}"), "--json"], capture_output=True, check=True, timeout=300))
        by_peer = {w.peer_id: w for w in swarm.workers}
        marks: dict[int, tuple[int, int, float]] = {}  # round -> (shepherd bytes in + out, of them blob, time seen)
        split: dict[int, dict[str, int]] = {}  # round -> the shepherd's stream bytes (in + out) by protocol
        shepherd: NodeProcess | None = None
        watcher: NodeProcess | None = None
        participants: list[int] = []
        theta_cid = None
        changes = 0
        swarm_first = dict.fromkeys(SWARM_KEYS, 0)
        with trio.move_on_after(600 + 60 * ROUNDS) as scope:
            while len(marks) <= ROUNDS - WARM:
                await trio.sleep(POLL_S)
                if watcher is None:  # a worker that is not the shepherd tells us the rounds
                    for w in swarm.workers:
                        run_ = (await status_of(swarm, w)).get("run") or {}
                        if run_.get("shepherd") in by_peer and run_["shepherd"] != w.peer_id:
                            watcher, shepherd = w, by_peer[run_["shepherd"]]
                            break
                    continue
                run_ = (await status_of(swarm, watcher)).get("run") or {}
                if run_.get("shepherd") in by_peer and shepherd is not None and run_["shepherd"] != shepherd.peer_id:
                    # a failover (the set-up's election can move on): measure the new one from scratch
                    shepherd = by_peer[run_["shepherd"]]
                    marks.clear()
                    split.clear()
                    participants.clear()
                    changes += 1
                rnd = run_.get("round") or 0
                if shepherd is not None and rnd >= WARM and rnd not in marks:
                    net = (await status_of(swarm, shepherd)).get("network") or {}
                    marks[rnd] = (net.get("bytes_in", 0) + net.get("bytes_out", 0),
                                  net.get("blob_bytes_in", 0) + net.get("blob_bytes_out", 0), time.monotonic())
                    split[rnd] = {p: c["bytes_in"] + c["bytes_out"]
                                  for p, c in (net.get("protocol_bytes") or {}).items()}
                    participants.append(run_.get("participants") or 0)
                    theta_cid = run_.get("theta")
                    if len(marks) == 1:
                        swarm_first = await swarm_totals(swarm)
                if rnd >= ROUNDS + 2 and len(marks) >= 2:  # the run ended (after a failover restarted the window)
                    break
        if scope.cancelled_caught or len(marks) < 2 or shepherd is None:
            raise RuntimeError(f"N={n}: only rounds {sorted(marks)} were seen")
        swarm_last = await swarm_totals(swarm)
        first, last = min(marks), max(marks)
        per_round = (marks[last][0] - marks[first][0]) / (last - first)
        blob_per_round = (marks[last][1] - marks[first][1]) / (last - first)
        by_protocol = {p: round((split[last].get(p, 0) - split[first].get(p, 0)) / (last - first))
                       for p in split[last]}
        by_protocol = {p: b for p, b in sorted(by_protocol.items(), key=lambda kv: -kv[1]) if b}
        # the bench's own status polls of the shepherd are the bench's traffic, not the run's
        polls = by_protocol.pop(STATUS_PROTOCOL, 0)
        per_round -= polls
        theta_bytes = (shepherd.data_dir / "blobs" / "data" / theta_cid).stat().st_size if theta_cid else None
        if not theta_bytes:
            raise RuntimeError("θ's size is unknown")
        return {
            "per_model": round(per_round / theta_bytes, 3),
            "bytes_per_round": int(per_round),
            "blob_bytes_per_round": int(blob_per_round),  # side-channel data (θ, checkpoints, Δs)
            "control_bytes_per_round": int(per_round - blob_per_round),  # messages, beats, DHT, membership
            # the control bytes by libp2p protocol (stream payload); what is left is Noise and yamux framing
            "control_by_protocol_per_round": by_protocol,
            "control_framing_per_round": int(per_round - blob_per_round - sum(by_protocol.values())),
            "bench_status_polls_per_round": polls,  # (taken out of the figures above)
            "theta_bytes": theta_bytes,
            "round_s": round((marks[last][2] - marks[first][2]) / (last - first), 2),
            "rounds": [first, last],
            "participants": participants,
            "shepherd_changes": changes,
            # summed over the workers, per round (the last poll comes a little after the last mark)
            **{f"{k}_per_round": round((swarm_last[k] - swarm_first[k]) / (last - first), 2) for k in SWARM_KEYS},
        }


def measure(ns: list[int] = NS, aggregators: int = AGGREGATORS) -> dict[str, Any]:
    """The figures (also merged into ``bench/bandwidth.py``'s line)."""
    results: dict[int, dict[str, Any]] = {}
    baseline: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pcp-bench-shepherd-") as tmp:
        for n in ns:
            if aggregators:
                baseline[n] = trio.run(arm, Path(tmp), n, 0)
                print(json.dumps({"workers": n, "aggregators": 0, **baseline[n]}), file=sys.stderr, flush=True)
            results[n] = trio.run(arm, Path(tmp), n, aggregators)
            print(json.dumps({"workers": n, "aggregators": aggregators, **results[n]}), file=sys.stderr, flush=True)
    big, small = max(ns), min(ns)
    # one N alone says nothing about flatness: null, not a ratio of 1
    ratio = results[big]["per_model"] / results[small]["per_model"] if big != small else None
    return {
        "shepherd_bytes_per_model": results[big]["per_model"],
        "shepherd_bytes_per_model_target": TARGET,
        "shepherd_bytes_workers": big,
        "shepherd_bytes_by_n": {str(n): r["per_model"] for n, r in sorted(results.items())},
        "shepherd_bytes_flat_in_n": ratio <= FLAT if ratio is not None else None,
        "shepherd_bytes_ratio_largest_to_smallest_n": round(ratio, 3) if ratio is not None else None,
        "shepherd_bytes_detail": {str(n): r for n, r in sorted(results.items())},
        "shepherd_bytes_aggregators": aggregators,
        **({"shepherd_bytes_without_aggregators_by_n": {str(n): r["per_model"] for n, r in sorted(baseline.items())},
            "shepherd_bytes_without_aggregators_detail": {str(n): r for n, r in sorted(baseline.items())}}
           if baseline else {}),
    }


def main() -> None:
    figures = measure()
    print(json.dumps({
        "headline": figures["shepherd_bytes_per_model"],
        "target": TARGET,
        "better": "lower",
        "unit": f"shepherd bytes in + out per round / fp32 θ bundle, {figures['shepherd_bytes_workers']} worker "
                "processes",
        **figures,
        "before_swarming_computed_n16": 16.28,
        "model": "tiny",
        "delta_codec": CODEC,
        "inner_budget_s": BUDGET_S,
    }))


if __name__ == "__main__":
    main()
