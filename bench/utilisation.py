"""Compute utilisation on loopback, overlapped rounds against synchronous ones (issue #15, item 2).

Run: ``.venv/bin/python bench/utilisation.py`` (about 5 minutes on 2 cores). Ends with one JSON line.

A bootstrap server and ``WORKERS`` worker processes (real libp2p, the blob exchange,
the IREE executor) train the ``tiny`` GPT for ``ROUNDS`` rounds with a
``BUDGET_S``-second inner budget, twice in this run: with ``round.overlap`` (each
worker trains round r+1 while its Δ of round r travels and the shepherd combines;
docs/diloco.md, "Overlap") and, the baseline, with synchronous rounds. Both arms
have ``audit_rate`` 0, which overlap needs, so overlap is the only difference.

Utilisation is what ``pcp status`` reports as ``run.utilisation``: per worker, the
time inside inner steps over the wall time from its first inner run to the last
commit; the headline is the mean over workers with overlap (goal ≥ 0.97).

Knobs: ``PCP_BENCH_UTIL_WORKERS`` (2), ``PCP_BENCH_UTIL_ROUNDS`` (4),
``PCP_BENCH_UTIL_BUDGET`` (20 s), ``PCP_BENCH_UTIL_ARMS`` (``overlap,sync``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio

from pcp_p2p.node.local_swarm import local_swarm, pcp_command
from pcp_p2p.node.status import to_json

WORKERS = int(os.environ.get("PCP_BENCH_UTIL_WORKERS", "2"))
ROUNDS = int(os.environ.get("PCP_BENCH_UTIL_ROUNDS", "4"))
BUDGET_S = float(os.environ.get("PCP_BENCH_UTIL_BUDGET", "20"))


def spec(overlap: bool, audit_rate: float | None = 0.0) -> str:
    """The run both arms train (``audit_rate`` None: the spec's default)."""
    audits = "" if audit_rate is None else f"[aggregation]\naudit_rate = {audit_rate}\n"
    return f"""
name = "bench-utilisation"
[model]
preset = "tiny"
[round]
time_budget_s = {BUDGET_S}
deadline_s = {BUDGET_S * 2 + 10}
max_inner_steps = 100000
rounds = {ROUNDS}
min_quorum = {WORKERS}
overlap = {"true" if overlap else "false"}
{audits}"""


def loopback_run(spec_text: str) -> list[dict[str, Any]]:
    """Train ``spec_text`` with ``WORKERS`` worker processes on 127.0.0.1: each worker's final run status."""

    async def run() -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory(prefix="pcp-bench-util-") as tmp:
            async with local_swarm(Path(tmp), extra_args=["--trust-any"]) as swarm:
                boot = await swarm.start_bootstrap()
                for _ in range(WORKERS):
                    await swarm.add_worker()
                await swarm.wait_views({w.peer_id for w in swarm.workers}, deadline_s=60)
                (Path(tmp) / "run.toml").write_text(spec_text)
                await trio.to_thread.run_sync(lambda: subprocess.run(
                    [*pcp_command(), "run", "create", str(Path(tmp) / "run.toml"), "--bootstrap", boot.addr,
                     "--data-dir", str(Path(tmp) / "owner")], check=True, capture_output=True, timeout=120))
                with trio.fail_after(120 + ROUNDS * (BUDGET_S * 2 + 15)):
                    while True:
                        await trio.sleep(1.0)
                        runs = [to_json(await swarm.status(w)).get("run") or {} for w in swarm.workers]
                        if all(r.get("phase") == "finished" for r in runs):
                            return runs

    return trio.run(run)


def mean_utilisation(runs: list[dict[str, Any]]) -> float | None:
    values = [r["utilisation"] for r in runs if r.get("utilisation") is not None]
    return round(sum(values) / len(values), 4) if values else None


def main() -> None:
    arms = os.environ.get("PCP_BENCH_UTIL_ARMS", "overlap,sync").split(",")
    out: dict[str, Any] = {}
    for arm in arms:
        runs = loopback_run(spec(overlap=arm == "overlap"))
        out[arm] = {
            "utilisation": mean_utilisation(runs),
            "per_worker": [r.get("utilisation") for r in runs],
            "overlapped_rounds": [r.get("overlapped_rounds") for r in runs],
            "overlap_tau": [r.get("overlap_tau") for r in runs],
            "contributed_rounds": [len(r.get("contributed_rounds") or []) for r in runs],
            "val_loss": [h.get("val_loss") for h in (runs[0].get("history") or [])],
        }
        print(f"{arm}: {out[arm]}", file=sys.stderr)
    print(json.dumps({
        "headline": out.get("overlap", {}).get("utilisation"),
        "target": 0.97,
        "better": "higher",
        "unit": "fraction of wall time inside inner steps, mean over workers, overlapped rounds on loopback",
        "sync_utilisation": out.get("sync", {}).get("utilisation"),
        "setup": f"{WORKERS} worker processes + bootstrap on 127.0.0.1, tiny GPT through the IREE executor, "
                 f"{ROUNDS} rounds, {BUDGET_S:.0f} s inner budget, audit_rate 0 in both arms",
        **{f"{arm}_detail": v for arm, v in out.items()},
    }))


if __name__ == "__main__":
    main()
