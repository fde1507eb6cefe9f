"""Training over a WAN: home links, NATs and an ocean, against the same run on loopback.

Run: ``.venv/bin/python bench/wan.py`` as root with ``ip``, ``tc`` and
``iptables`` (the network lab, :mod:`pcp_p2p.testing.netlab`); a few minutes on
2 cores. Ends with one JSON line.

Setup (issue #14): a bootstrap server (which is also the relay) on the lab's
internet and 4 worker processes, each on an access link shaped to
``UP_MBIT`` up / ``DOWN_MBIT`` down with ``DELAY_MS`` one-way delay (so 2x that
between two homes' ends and the bootstrap... one link each: a round trip to the
bootstrap crosses it twice): two with public addresses, one behind a cone NAT,
one behind a symmetric NAT. They train the ``tiny`` GPT for ``ROUNDS`` rounds
with a ``BUDGET_S``-second inner budget. The baseline is the same run (same
spec, same number of processes) on 127.0.0.1, measured in the same invocation.

Figures:

- ``headline``: compute utilisation on the WAN, the mean over workers of the
  time inside inner steps over the wall time from the first inner run to the
  last commit (what ``pcp status`` reports as ``run.utilisation``); goal ≥ 0.9.
- ``loopback_utilisation``: the same on loopback.
- ``round_s_wan`` / ``round_s_loopback``: median wall time between two
  consecutive commits, seen by polling a public worker's status every 0.25 s;
  ``round_overhead_s`` is their difference (what the WAN costs per round).
- ``relay_byte_share``: the bytes the relay spliced between the two ends of its
  circuits over all bytes the WAN processes sent (each node's libp2p and
  side-channel bytes out); goal < 0.01. Relays carry control traffic only: the
  blob service refuses relayed streams both ways. ``relayed_from``: those
  bytes by the node that sent them into the relay (which links are relayed).

Knobs: ``PCP_BENCH_WAN_ROUNDS`` (5), ``PCP_BENCH_WAN_BUDGET`` (8 s),
``PCP_BENCH_WAN_MODEL`` (tiny), ``PCP_BENCH_WAN_OVERLAP`` (1: ``round.overlap``
on, with ``audit_rate`` 0 as overlap needs; 0: the synchronous rounds with the
default audits), ``PCP_BENCH_WAN_ARMS`` (``wan,loopback``: which
arms run; the figures of a skipped arm are null), ``PCP_BENCH_WAN_KEEP`` (a
directory: the nodes' data directories and logs are kept there, to trace a round
afterwards; by default they go with a temporary directory).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio

from pcp_p2p.core.errors import PcpError
from pcp_p2p.node.local_swarm import local_swarm, pcp_command
from pcp_p2p.node.status import to_json
from pcp_p2p.testing.netlab import LinkSpec, Nat, netlab, unavailable

ROUNDS = int(os.environ.get("PCP_BENCH_WAN_ROUNDS", "5"))
BUDGET_S = float(os.environ.get("PCP_BENCH_WAN_BUDGET", "8"))
MODEL = os.environ.get("PCP_BENCH_WAN_MODEL", "tiny")
OVERLAP = os.environ.get("PCP_BENCH_WAN_OVERLAP", "1") == "1"
UP_MBIT, DOWN_MBIT, DELAY_MS = 20.0, 100.0, 40.0
WORKERS = 4
SPEC = f"""
name = "wan"
[model]
preset = "{MODEL}"
[inner]
lr = 3e-3
[round]
time_budget_s = {BUDGET_S}
max_inner_steps = 100000
deadline_s = {BUDGET_S * 3 + 20}
rounds = {ROUNDS}
min_quorum = {WORKERS - 1}
overlap = {"true" if OVERLAP else "false"}
[election]
rotate_every = 0
""" + ("[aggregation]\naudit_rate = 0.0\n" if OVERLAP else "")
RUN_DEADLINE_S = 240 + ROUNDS * (BUDGET_S * 3 + 20)


def round_times(commit_seen_at: dict[int, float]) -> list[float]:
    """Seconds between consecutive commits (from the first commit on: the set-up is not a round)."""
    rounds = sorted(commit_seen_at)
    return [commit_seen_at[b] - commit_seen_at[a] for a, b in itertools.pairwise(rounds)]


class Phases:
    """Seconds each worker spent in each run phase (fetching, training, submitted, ...), from its
    status polled every ``POLL_S``: where a round's wall time goes, beside the utilisation."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[str, float]] = {}
        self.total: dict[str, float] = {}

    def see(self, who: str, phase: str | None, now: float) -> None:
        prev = self.last.get(who)
        if prev is not None:
            self.total[prev[0]] = self.total.get(prev[0], 0.0) + (now - prev[1])
        if phase is not None:
            self.last[who] = (phase, now)

    def per_round(self, workers: int, rounds: int) -> dict[str, float]:
        return {k: round(v / max(1, workers * rounds), 2) for k, v in sorted(self.total.items())}


POLL_S = 0.5


def summary(runs: list[dict[str, Any]], commits: dict[int, float]) -> dict[str, Any]:
    utils = [r.get("utilisation") for r in runs if r.get("utilisation") is not None]
    times = round_times(commits)
    return {
        "utilisation": round(statistics.mean(utils), 4) if utils else None,
        "utilisation_per_worker": utils,
        "round_s": round(statistics.median(times), 2) if times else None,
        "participants": [h.get("participants") for h in (runs[0].get("history") or [])] if runs else [],
        "contributed_rounds": [len(r.get("contributed_rounds") or []) for r in runs],
        "overlapped_rounds": [r.get("overlapped_rounds") for r in runs],
        "overlap_tau": [r.get("overlap_tau") for r in runs],
        # per worker: commits' checkpoints built from the update, and fetched whole
        "checkpoints": [[(r.get("checkpoints") or {}).get(k) for k in ("rebuilt", "fetched")] for r in runs],
    }


# --- the WAN arm: the network lab -------------------------------------------------------------


def wan_arm(root: Path) -> dict[str, Any]:
    with netlab(root / "lab") as lab:
        boot_host = lab.add_public("boot")
        link = LinkSpec(up_mbit=UP_MBIT, down_mbit=DOWN_MBIT, delay_ms=DELAY_MS)
        hosts = [lab.add_public("pub1", link), lab.add_public("pub2", link),
                 lab.add_home("cone", Nat.CONE, link), lab.add_home("sym", Nat.SYMMETRIC, link)]
        boot = lab.start_bootstrap(boot_host)
        nodes = [lab.start_node(h, [boot.addr], extra=["--trust-any"]) for h in hosts]
        for viewer in [boot, *nodes]:
            for n in nodes:
                lab.wait_member(viewer.host, viewer, n.peer_id, deadline_s=90)
        (root / "run.toml").write_text(SPEC)
        lab.exec(boot_host, *pcp_command(), "run", "create", str(root / "run.toml"), "--bootstrap", boot.addr,
                 "--data-dir", str(root / "owner"), "--json")
        commits: dict[int, float] = {}
        phases = Phases()
        deadline = time.monotonic() + RUN_DEADLINE_S
        runs: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            for n in nodes:
                try:
                    run_ = lab.status(n.host, n.addr, timeout=5.0).get("run") or {}
                except PcpError:
                    continue
                if commits:  # from the first commit on: the set-up (compiling) is not a round
                    phases.see(n.name, run_.get("phase"), time.monotonic())
                if n is nodes[0]:
                    for h in run_.get("history", []):
                        commits.setdefault(h["round"], time.monotonic())
            if len(commits) >= ROUNDS:
                break
            time.sleep(POLL_S)
        statuses = []
        for n in nodes:
            try:
                statuses.append(lab.status(n.host, n.addr, timeout=10.0))
            except PcpError:
                statuses.append({})
        relay = lab.status(boot_host, boot.addr, timeout=10.0)["network"]
        sent = relay.get("bytes_out", 0) + sum((s.get("network") or {}).get("bytes_out", 0) for s in statuses)
        runs = [s.get("run") or {} for s in statuses]
        out = summary(runs, commits)
        out["relayed_bytes"] = relay.get("relayed_bytes", 0)
        names = {n.peer_id: n.name for n in nodes}  # whose bytes the relay carried, by sender
        out["relayed_from"] = {names.get(p, p[-8:]): b for p, b in sorted((relay.get("relayed_from") or {}).items())}
        out["bytes_sent"] = sent
        out["relay_byte_share"] = round(out["relayed_bytes"] / sent, 5) if sent else None
        out["phase_s_per_round"] = phases.per_round(WORKERS, ROUNDS - 1)
        out["reachability"] = [(s.get("network") or {}).get("reachability") for s in statuses]
        return out


# --- the baseline: the same run on 127.0.0.1 --------------------------------------------------


def loopback_arm(root: Path) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        async with local_swarm(root / "loop", extra_args=["--trust-any"]) as swarm:
            boot = await swarm.start_bootstrap()
            await swarm.add_workers(WORKERS, deadline_s=90)
            (root / "loop.toml").write_text(SPEC)
            await trio.to_thread.run_sync(lambda: __import__("subprocess").run(
                [*pcp_command(), "run", "create", str(root / "loop.toml"), "--bootstrap", boot.addr,
                 "--data-dir", str(root / "loop-owner"), "--json"], capture_output=True, check=True, timeout=180))
            commits: dict[int, float] = {}
            phases = Phases()
            with trio.move_on_after(RUN_DEADLINE_S):
                while len(commits) < ROUNDS:
                    for w in swarm.workers:
                        try:
                            run_ = to_json(await swarm.status(w, timeout=5.0)).get("run") or {}
                        except PcpError:
                            continue
                        if commits:
                            phases.see(w.name, run_.get("phase"), time.monotonic())
                        if w is swarm.workers[0]:
                            for h in run_.get("history", []):
                                commits.setdefault(h["round"], time.monotonic())
                    await trio.sleep(POLL_S)
            runs = []
            for w in swarm.workers:
                try:
                    runs.append(to_json(await swarm.status(w, timeout=10.0)).get("run") or {})
                except PcpError:
                    runs.append({})
            return {**summary(runs, commits), "phase_s_per_round": phases.per_round(WORKERS, ROUNDS - 1)}

    return trio.run(run)


def main() -> None:
    why = unavailable()
    if why is not None:
        print(json.dumps({"headline": None, "target": 0.9, "better": "higher", "unit": "fraction",
                          "skipped": why}))
        return
    keep = os.environ.get("PCP_BENCH_WAN_KEEP")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        print(f"keeping the nodes' directories and logs under {keep}", file=sys.stderr)
    where = (contextlib.nullcontext(tempfile.mkdtemp(prefix="pcp-bench-wan-", dir=keep)) if keep
             else tempfile.TemporaryDirectory(prefix="pcp-bench-wan-"))
    with where as tmp:
        root = Path(tmp)
        arms = os.environ.get("PCP_BENCH_WAN_ARMS", "wan,loopback").split(",")
        empty = {"utilisation": None, "utilisation_per_worker": [], "round_s": None, "participants": [],
                 "contributed_rounds": [], "overlapped_rounds": [], "overlap_tau": [], "checkpoints": [],
                 "phase_s_per_round": {},
                 "relayed_bytes": None, "relayed_from": {}, "bytes_sent": None,
                 "relay_byte_share": None, "reachability": []}
        wan = wan_arm(root) if "wan" in arms else empty
        loop = loopback_arm(root) if "loopback" in arms else empty
    overhead = (wan["round_s"] - loop["round_s"]) if wan["round_s"] and loop["round_s"] else None
    print(json.dumps({
        "headline": wan["utilisation"],
        "target": 0.9,
        "better": "higher",
        "unit": "fraction of wall time inside inner steps (mean over workers)",
        "setup": f"bootstrap/relay + {WORKERS} workers (2 public, 1 cone NAT, 1 symmetric NAT), each link "
                 f"{UP_MBIT:.0f} Mbit/s up / {DOWN_MBIT:.0f} down, {DELAY_MS:.0f} ms one way; {MODEL} GPT, "
                 f"{ROUNDS} rounds, {BUDGET_S:.0f} s inner budget, overlap {'on' if OVERLAP else 'off'}; "
                 "baseline: the same run on 127.0.0.1",
        "overlap": OVERLAP,
        "loopback_utilisation": loop["utilisation"],
        "round_s_wan": wan["round_s"],
        "round_s_loopback": loop["round_s"],
        "round_overhead_s": round(overhead, 2) if overhead is not None else None,
        "relay_byte_share": wan["relay_byte_share"],
        "relay_byte_share_target": 0.01,
        "relayed_bytes": wan["relayed_bytes"],
        "relayed_from": wan["relayed_from"],
        "bytes_sent_wan": wan["bytes_sent"],
        "utilisation_per_worker_wan": wan["utilisation_per_worker"],
        "utilisation_per_worker_loopback": loop["utilisation_per_worker"],
        "participants_wan": wan["participants"],
        "contributed_rounds_wan": wan["contributed_rounds"],
        "overlapped_rounds_wan": wan["overlapped_rounds"],
        "overlapped_rounds_loopback": loop["overlapped_rounds"],
        "overlap_tau_wan": wan["overlap_tau"],
        "overlap_tau_loopback": loop["overlap_tau"],
        "checkpoints_rebuilt_fetched_wan": wan["checkpoints"],
        "reachability_wan": wan["reachability"],
        "phase_s_per_round_wan": wan["phase_s_per_round"],
        "phase_s_per_round_loopback": loop["phase_s_per_round"],
    }))


if __name__ == "__main__":
    main()
