"""``pcp swarm``: a whole training swarm on one machine with one command (``make demo``).

Starts a bootstrap server and N worker nodes as separate processes on
127.0.0.1, creates a run (``pcp run create``, as an owner would), and follows
it: one progress line per committed round, optional churn (workers killed with
SIGKILL mid-run and restarted with their data dir), and a summary at the end —
rounds committed, loss and validation loss per round, time to first
contribution of rejoining workers, whether every live node holds the same
committed θ, the model's parameters, the median round time and the tokens
committed per second, and a sample of text from the final θ.

Every node runs in a process group of its own and all of them are killed when
the swarm ends, also on Ctrl+C or on failure: nothing is left running.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from pcp_p2p.core.errors import ConfigError, PcpError
from pcp_p2p.core.shutdown import run_until_signal
from pcp_p2p.diloco.protocol.spec import MODEL_PRESETS

if TYPE_CHECKING:
    from pcp_p2p.node.local_swarm import LocalSwarm, NodeProcess


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "swarm",
        help="run a local training swarm: a bootstrap server and N nodes as processes on 127.0.0.1",
        description="Start a bootstrap server and N nodes as separate processes on 127.0.0.1, create a "
        "DiLoCo run on Shakespeare and train it, printing a line per committed round and a summary. "
        "Nothing is left running afterwards, also on Ctrl+C.",
    )
    p.add_argument("--workers", type=int, default=4, help="number of worker nodes (default 4)")
    p.add_argument("--rounds", type=int, default=10, help="outer rounds to train (default 10)")
    p.add_argument("--model", default="tiny", choices=MODEL_PRESETS,
                   help="model preset: tiny 0.2M, small 1M, medium 10.8M or large 99.7M parameters (default tiny; "
                   "batches are split to fit the nodes' free memory)")
    p.add_argument("--time-budget", type=float, default=5.0, help="seconds of inner training per round (default 5)")
    p.add_argument("--churn", type=float, default=0.0,
                   help="per committed round, the chance that a random worker is SIGKILLed (it is restarted "
                   "with its data dir a round later); default 0")
    p.add_argument("--kill-shepherd-every", type=int, default=0, metavar="N",
                   help="SIGKILL the shepherd every N committed rounds (it is restarted a round later); "
                   "forces failovers to a new term")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for the churn schedule, the run and the sample (default: random, "
                        "printed in the summary so a run can be repeated)")
    p.add_argument("--dir", type=Path, default=None, help="keep data dirs and logs here (default: a temporary dir)")
    p.add_argument("--json", action="store_true", help="end with one JSON line summarising the run")
    p.set_defaults(func=_cmd_swarm)


def _say(msg: str) -> None:
    print(msg, flush=True)


def _cmd_swarm(args: argparse.Namespace) -> int:
    if not 1 <= args.workers <= 32:
        raise ConfigError("--workers must be between 1 and 32")
    if not 1 <= args.rounds <= 10_000:
        raise ConfigError("--rounds must be between 1 and 10000")
    if not 0.0 <= args.churn <= 1.0:
        raise ConfigError("--churn is a probability between 0 and 1")
    if args.kill_shepherd_every < 0:
        raise ConfigError("--kill-shepherd-every must be >= 0")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1_000_000)
    # Ctrl+C or SIGTERM: the swarm's processes are stopped (local_swarm), then exit 130/143.
    summary = run_until_signal(_run, args, stopping="stopping the swarm's processes")
    if args.json:
        print(json.dumps(summary))
    if summary["rounds_committed"] < args.rounds:
        raise PcpError(f"only {summary['rounds_committed']}/{args.rounds} rounds were committed before the deadline")
    if not summary["final_theta_hash_agreement"]:
        raise PcpError("the live nodes do not all hold the final committed θ")
    return 0


def _spec_toml(args: argparse.Namespace) -> str:
    quorum = max(1, (args.workers + 1) // 2) if args.churn else max(1, args.workers - 1)
    return f"""name = "local-swarm"
seed = {args.seed}
[model]
preset = "{args.model}"
[inner]
lr = 3e-3
batch_size = 16
seq_len = 64
[round]
time_budget_s = {args.time_budget}
max_inner_steps = 500
deadline_s = {args.time_budget * 3 + 10}
rounds = {args.rounds}
min_quorum = {quorum}
"""


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from pcp_p2p.node.local_swarm import local_swarm, pcp_command
    from pcp_p2p.node.status import to_json

    rng = random.Random(args.seed)
    t0 = time.monotonic()
    async with local_swarm(args.dir, extra_args=["--trust-any"]) as swarm:
        boot = await swarm.start_bootstrap()
        _say(f"bootstrap server  {boot.addr}")
        ids = {w.peer_id for w in await swarm.add_workers(args.workers, deadline_s=120)}
        _say(f"{len(ids)} nodes up and in each other's view after {time.monotonic() - t0:.1f} s")

        spec_path = swarm.root / "run.toml"
        spec_path.write_text(_spec_toml(args))
        created = await trio.to_thread.run_sync(lambda: subprocess.run(
            [*pcp_command(), "run", "create", str(spec_path), "--bootstrap", boot.addr,
             "--data-dir", str(swarm.root / "owner"), "--json"],
            capture_output=True, text=True, timeout=120,
        ))
        if created.returncode != 0:
            raise ConfigError(f"pcp run create failed: {created.stderr.strip()[-500:]}")
        run_id = json.loads(created.stdout.strip().splitlines()[-1])["run_id"]
        _say(f"run {run_id} created: {args.rounds} rounds of {args.time_budget:.0f} s, model {args.model}")

        history: dict[int, dict[str, Any]] = {}
        seen_at: dict[int, float] = {}  # when this command first saw each round committed (its clock)
        failovers = 0
        killed: dict[str, tuple[NodeProcess, int]] = {}  # peer id -> (process, round killed at)
        rejoined: list[str] = []
        first_contribution: dict[str, float] = {}
        deadline = time.monotonic() + 120 + args.rounds * (args.time_budget * 3 + 15) * (2 if args.churn else 1)
        statuses: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            await trio.sleep(1.0)
            statuses = {}
            for w in swarm.workers:
                if not w.running:
                    continue
                try:
                    statuses[w.peer_id] = to_json(await swarm.status(w, timeout=5)).get("run") or {}
                except PcpError:
                    continue
            for st in statuses.values():
                for h in st.get("history", []):
                    if h["round"] not in history:
                        history[h["round"]] = h
                        seen_at[h["round"]] = time.monotonic() - t0
                        val = f"{h['val_loss']:.4f}" if h.get("val_loss") is not None else "-"
                        _say(f"round {h['round']:>3}/{args.rounds}  loss {h['loss']:.4f}  val {val}  "
                             f"workers {h['participants']}  ({time.monotonic() - t0:.0f} s)")
                        await _churn(args, rng, swarm, statuses, killed, rejoined, h["round"])
                        if (args.kill_shepherd_every and h["round"] % args.kill_shepherd_every == 0
                                and h["round"] < args.rounds - 1):
                            victim = next((w for w in swarm.workers
                                           if w.running and w.peer_id == h.get("shepherd")), None)
                            if victim is not None and victim.peer_id not in killed:
                                await swarm.kill(victim, signal.SIGKILL)
                                killed[victim.peer_id] = (victim, h["round"])
                                failovers += 1
                                _say(f"  SIGKILLed the shepherd {victim.peer_id[-12:]} (term {h.get('term')})")
            for pid in rejoined:
                fc = statuses.get(pid, {}).get("first_contribution_s")
                if fc is not None:
                    first_contribution[pid] = fc
            live = [st for st in statuses.values() if st]
            if len(history) >= args.rounds and live and all(st.get("phase") == "finished" for st in live):
                break
        final = history.get(args.rounds)  # status counts rounds from 1
        thetas = {st.get("theta") for st in statuses.values() if st}
        agreement = final is not None and thetas == {final["theta"]}
        sample = _sample(swarm, final, args) if final is not None else ""
        # Next to the run's data; without --dir that is deleted at exit, so the plot
        # goes to the system temp dir instead.
        plot_dir = args.dir if args.dir is not None else Path(tempfile.gettempdir())
        plot = write_loss_plot(plot_dir / f"pcp-swarm-{run_id[-12:]}-loss.png",
                               [history[r] for r in sorted(history)], run_id)
        _say("")
        theta = final["theta"] if final else "-"
        _say(f"rounds committed: {len(history)}/{args.rounds}; every live node holds θ {theta}: {agreement}")
        if plot is not None:
            _say(f"loss per round plotted in {plot}")
        if sample:
            _say("sample from the final θ:")
            _say(sample)
    rounds = [history[r] for r in sorted(history)]
    pace = round_pace(args.model, rounds, seen_at)
    _say(f"{pace['params']:,} parameters ({args.model}); median round {pace['round_s']} s; "
         f"{pace['tokens_per_s']} tokens/s committed")
    return {
        **pace,
        "run_id": run_id,
        "seed": args.seed,
        "workers": args.workers,
        "rounds_committed": len(rounds),
        "loss_history": [round(h["loss"], 4) for h in rounds],
        "val_loss_history": [round(h["val_loss"], 4) if h.get("val_loss") is not None else None for h in rounds],
        "participants": [h["participants"] for h in rounds],
        "failovers": failovers,
        "terms": sorted({h.get("term") for h in rounds if h.get("term") is not None}),
        "churn_kills": len(killed) + len(rejoined) - failovers,
        "time_to_first_contribution_s": first_contribution,
        "final_theta_hash_agreement": agreement,
        "sample": sample,
        "plot": str(plot) if plot is not None else None,
        "wall_s": round(time.monotonic() - t0, 1),
    }


async def _churn(
    args: argparse.Namespace,
    rng: random.Random,
    swarm: LocalSwarm,
    statuses: dict[str, dict[str, Any]],
    killed: dict[str, tuple[NodeProcess, int]],
    rejoined: list[str],
    committed_round: int,
) -> None:
    """Restart workers killed a round ago; maybe kill another (never the shepherd)."""
    for pid, (proc, at) in list(killed.items()):
        if committed_round > at:
            await swarm.restart(proc)
            del killed[pid]
            rejoined.append(pid)
            _say(f"  churn: restarted {pid[-12:]} with its data dir")
    if args.churn and committed_round < args.rounds - 1 and rng.random() < args.churn:
        shepherds = {st.get("shepherd") for st in statuses.values()}
        victims = [w for w in swarm.workers if w.running and w.peer_id not in shepherds and w.peer_id not in killed]
        if victims:
            proc = rng.choice(victims)
            await swarm.kill(proc, signal.SIGKILL)
            killed[proc.peer_id] = (proc, committed_round)
            _say(f"  churn: SIGKILLed {proc.peer_id[-12:]} mid-run")


def round_pace(model: str, rounds: list[dict[str, Any]], seen_at: dict[int, float]) -> dict[str, Any]:
    """The model's size and the swarm's pace: the median time between consecutive commits and the
    tokens committed per second after the first commit (which waits for the compile), both as this
    command saw them (it polls each second, so a round time is ±1 s)."""
    from itertools import pairwise

    from pcp_p2p.compile.model import num_params, preset
    from pcp_p2p.diloco.algorithm.data import CharDataset

    nums = sorted(seen_at)
    gaps = sorted(seen_at[b] - seen_at[a] for a, b in pairwise(nums) if b == a + 1)
    span = seen_at[nums[-1]] - seen_at[nums[0]] if len(nums) > 1 else 0.0
    tokens = sum(int(h.get("tokens") or 0) for h in rounds if h["round"] != nums[0]) if nums else 0
    return {"params": num_params(preset(model, CharDataset.load("shakespeare").vocab_size)),
            "round_s": round(gaps[len(gaps) // 2], 1) if gaps else None,
            "tokens_per_s": round(tokens / span) if span > 0 else None}


def write_loss_plot(path: Path, rounds: list[dict[str, Any]], run_id: str) -> Path | None:
    """Training and validation loss per committed round, as a PNG next to the run's data."""
    if not rounds:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    xs = [h["round"] for h in rounds]  # 1-based already
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(xs, [h["loss"] for h in rounds], marker="o", label="training loss (mean over workers)")
    val = [(x, h["val_loss"]) for x, h in zip(xs, rounds) if h.get("val_loss") is not None]
    if val:
        ax.plot([x for x, _ in val], [v for _, v in val], marker="s", label="validation loss")
    for x, h, prev in zip(xs[1:], rounds[1:], rounds):
        if h.get("term") != prev.get("term"):
            ax.axvline(x - 0.5, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("outer round (dotted: a new shepherd term)")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title(f"PCP run {run_id[:20]}…", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _sample(swarm: LocalSwarm, final: dict[str, Any], args: argparse.Namespace) -> str:
    """Text from the final θ, read from a worker's blob store (hash-checked)."""
    from pcp_p2p.blob.store import BlobStore
    from pcp_p2p.core.cid import check_cid
    from pcp_p2p.diloco.algorithm.data import CharDataset
    from pcp_p2p.diloco.algorithm.params import unpack_tensors
    from pcp_p2p.export.generate import sample_text

    for w in swarm.workers:
        store = BlobStore(w.data_dir / "blobs", 1 << 40)
        if store.has(final["theta"]):
            data = store.read(final["theta"])
            check_cid(final["theta"], data)
            tokenizer = CharDataset.load("shakespeare").tokenizer
            return sample_text(args.model, unpack_tensors(data), tokenizer, "ROMEO:", 200, seed=args.seed)
    print("no node holds the final θ on disk; no sample", file=sys.stderr)
    return ""
