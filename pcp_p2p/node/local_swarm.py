"""A swarm of real node processes on loopback: for ``pcp swarm``, tests and benchmarks.

Each node is a separate ``pcp`` process in a process group of its own, so a
kill reaches everything it started and nothing is left behind: :class:`LocalSwarm`
kills every group it started when its ``async with`` block ends, however it
ends (error, Ctrl+C, cancellation).

A child prints its full multiaddr as the first line of stdout once it listens;
the parent waits for that line (an event), not for a fixed time.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from pcp_p2p.core.errors import PcpError, PeerTimeout
from pcp_p2p.core.shutdown import PARENT_ENV
from pcp_p2p.node.status import StatusReply, fetch_status

log = logging.getLogger("pcp.swarm")

START_TIMEOUT_S = 60.0


@dataclass
class NodeProcess:
    name: str
    data_dir: Path
    args: list[str]
    process: trio.Process | None = None
    addr: str = ""
    peer_id: str = ""
    log_path: Path | None = None
    _stdout_rest: bytes = field(default=b"", repr=False)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.returncode is None:
            try:
                os.killpg(self.process.pid, signum)
            except ProcessLookupError:
                pass


def pcp_command() -> list[str]:
    """How to start ``pcp`` with this interpreter (works without the venv on PATH)."""
    return [sys.executable, "-m", "pcp_p2p.cli"]


class LocalSwarm:
    """A bootstrap server and worker nodes as separate processes on 127.0.0.1."""

    def __init__(self, root: Path, nursery: trio.Nursery, extra_args: Sequence[str] = ()) -> None:
        self.root = root
        self.nursery = nursery
        self.extra_args = list(extra_args)
        self.bootstrap: NodeProcess | None = None
        self.workers: list[NodeProcess] = []
        self._next_index = 0

    async def start_bootstrap(self) -> NodeProcess:
        proc = NodeProcess("bootstrap", self.root / "bootstrap", [
            *pcp_command(), "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0",
            "--data-dir", str(self.root / "bootstrap"),
        ])
        await self._start(proc)
        self.bootstrap = proc
        return proc

    async def add_worker(self, extra: Sequence[str] = (), prefix: Sequence[str] = ()) -> NodeProcess:
        """A ``pcp node join`` process; ``prefix`` starts it under a launcher (``mpiexec -n 2``: a worker group)."""
        # Without a bootstrap server the worker starts a swarm of its own (a lone target).
        boot = ["--bootstrap", self.bootstrap.addr] if self.bootstrap is not None else []
        i = self._next_index  # reserved before any await: add_worker may run concurrently
        self._next_index += 1
        data_dir = self.root / f"node{i}"
        proc = NodeProcess(f"node{i}", data_dir, [
            *prefix, *pcp_command(), "node", "join", *boot,
            "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(data_dir),
            *self.extra_args, *extra,
        ])
        await self._start(proc)
        self.workers.append(proc)
        return proc

    async def add_workers(self, n: int, *, deadline_s: float) -> list[NodeProcess]:
        """Start ``n`` workers at once; return them when every worker sees all the others."""
        started: list[NodeProcess] = []

        async def one() -> None:
            started.append(await self.add_worker())

        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)
        await self.wait_views({w.peer_id for w in self.workers}, deadline_s=deadline_s)
        return started

    async def restart(self, proc: NodeProcess) -> None:
        """Start a stopped node again with the same data dir (and so the same identity)."""
        if proc.running:
            raise RuntimeError(f"{proc.name} is still running")
        await self._start(proc)

    async def kill(self, proc: NodeProcess, signum: int = signal.SIGKILL) -> None:
        proc.signal(signum)
        if proc.process is not None:
            await proc.process.wait()

    async def _start(self, proc: NodeProcess) -> None:
        proc.data_dir.mkdir(parents=True, exist_ok=True)
        proc.log_path = self.root / f"{proc.name}.log"
        logf = open(proc.log_path, "ab")  # noqa: ASYNC230 (a local append-only log: one quick syscall)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}  # no orphans on SIGKILL
        proc.process = await trio.lowlevel.open_process(
            proc.args, stdout=subprocess.PIPE, stderr=logf, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env,
        )
        logf.close()
        line = await self._first_line(proc)
        proc.addr = line
        proc.peer_id = line.rsplit("/p2p/", 1)[-1]
        # Keep draining stdout so the child never blocks on a full pipe.
        self.nursery.start_soon(self._drain, proc.process)

    async def _first_line(self, proc: NodeProcess) -> str:
        assert proc.process is not None and proc.process.stdout is not None
        buf = b""
        with trio.move_on_after(START_TIMEOUT_S):
            while b"\n" not in buf:
                chunk = await proc.process.stdout.receive_some(4096)
                if not chunk:
                    break
                buf += chunk
            if b"\n" in buf:
                return buf.split(b"\n", 1)[0].decode().strip()
        tail = proc.log_path.read_text(errors="replace")[-2000:] if proc.log_path else ""
        proc.signal(signal.SIGKILL)
        raise PeerTimeout(f"{proc.name} did not start within {START_TIMEOUT_S:.0f} s; its log ends:\n{tail}")

    @staticmethod
    async def _drain(process: trio.Process) -> None:
        assert process.stdout is not None
        try:
            while await process.stdout.receive_some(65536):
                pass
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def all_processes(self) -> list[NodeProcess]:
        return [p for p in [self.bootstrap, *self.workers] if p is not None]

    def stop_all(self, signum: int = signal.SIGKILL) -> None:
        for p in self.all_processes():
            p.signal(signum)

    async def status(self, proc: NodeProcess, timeout: float = 5.0) -> StatusReply:
        return await fetch_status(proc.addr, timeout=timeout)

    async def views(
        self, procs: Sequence[NodeProcess] | None = None, timeout: float = 5.0
    ) -> dict[str, set[str] | None]:
        """Member peer ids each running node sees (None where the status call failed)."""
        procs = [p for p in (procs if procs is not None else self.workers) if p.running]
        out: dict[str, set[str] | None] = {}

        async def one(p: NodeProcess) -> None:
            try:
                reply = await self.status(p, timeout)
                out[p.peer_id] = {m.peer_id for m in reply.members}
            except PcpError:
                out[p.peer_id] = None

        async with trio.open_nursery() as n:
            for p in procs:
                n.start_soon(one, p)
        return out

    async def wait_views(self, expected: set[str], *, deadline_s: float, poll_s: float = 0.5) -> float:
        """Wait until every running worker's view equals ``expected``; return the seconds taken.

        There is no cross-process event for "everyone sees everyone", so this
        polls the nodes' status, bounded by ``deadline_s``.
        """
        t0 = trio.current_time()
        last: dict[str, Any] = {}
        with trio.move_on_after(deadline_s) as scope:
            while True:
                last = await self.views()
                if last and all(v == expected for v in last.values()):
                    break
                await trio.sleep(poll_s)
        if not scope.cancelled_caught:
            return trio.current_time() - t0
        summary = {k[-8:]: (sorted(x[-8:] for x in v) if v is not None else None) for k, v in last.items()}
        raise PeerTimeout(f"views did not converge within {deadline_s:.0f} s: {summary}")


@asynccontextmanager
async def local_swarm(root: Path | None = None, extra_args: Sequence[str] = ()) -> AsyncIterator[LocalSwarm]:
    """A :class:`LocalSwarm` whose processes are all killed when the block ends."""
    with tempfile.TemporaryDirectory(prefix="pcp-swarm-") as tmp:
        base = Path(root) if root is not None else Path(tmp)
        async with trio.open_nursery() as nursery:
            swarm = LocalSwarm(base, nursery, extra_args)
            try:
                yield swarm
            finally:
                swarm.stop_all(signal.SIGTERM)
                with trio.move_on_after(5) as scope:
                    scope.shield = True
                    for p in swarm.all_processes():
                        if p.process is not None:
                            await p.process.wait()
                swarm.stop_all(signal.SIGKILL)
                nursery.cancel_scope.cancel()
