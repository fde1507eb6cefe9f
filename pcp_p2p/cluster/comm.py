"""MPI with deadlines: every call is a non-blocking request polled until it completes or time runs out.

A blocking ``MPI_Recv`` from a rank that died waits forever (MPI without ULFM
has no notion of a dead peer), and so does a collective one rank never joins.
Here nothing blocks: sends and receives are ``Isend``/``Improbe``+``Imrecv``,
the reduction is ``Iallreduce``, and each is polled against a deadline from an
injected clock. A missed deadline is a :class:`~pcp_p2p.core.errors.PeerTimeout`
naming the rank(s); the request is abandoned (kept referenced with its buffer
so MPI never writes into freed memory) and the caller stops counting on that
rank. A communicator an abandoned collective ran on is never used again:
survivors build a fresh one with ``Create_group``, which only the members of
the new group take part in, so a dead rank cannot block it.

This needs the launcher not to kill the whole job when one rank dies
(``mpiexec -disable-auto-cleanup`` with MPICH's Hydra, ``srun --no-kill``
under Slurm; docs/clusters.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from pcp_p2p.core.errors import PeerTimeout

if TYPE_CHECKING:  # importing mpi4py.MPI initialises MPI: only where a communicator exists
    from mpi4py import MPI

POLL_MIN_S = 0.0005
POLL_MAX_S = 0.01
PROGRESS_S = 0.02
TAG_NEVER = 32000  # the progress thread probes a tag nobody sends on


class Cancelled(Exception):
    """The caller's cancel event was set while a request was pending (not an error of any rank)."""


class DeadlineComm:
    """Point-to-point bytes and a sum-allreduce over mpi4py communicators, each bounded by a deadline."""

    def __init__(self, comm: MPI.Intracomm, clock: Callable[[], float] = time.monotonic) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.clock = clock
        self._abandoned: list[tuple[MPI.Request, object]] = []  # with the buffer it must keep alive
        self._lock = threading.Lock()  # the abandoned list is touched from the heartbeat thread too
        self._groups: dict[tuple[int, ...], MPI.Intracomm] = {}
        self._group_tag = 1000
        self._stopped = threading.Event()
        self._progress = threading.Thread(target=self._keep_progressing, name="pcp-mpi-progress", daemon=True)
        self._progress.start()

    def stop(self) -> None:
        """Stop the progress thread (before MPI is finalised: no MPI call may follow)."""
        self._stopped.set()
        self._progress.join(timeout=1.0)

    def _keep_progressing(self) -> None:
        """Enter MPI's progress engine every few milliseconds, whatever the rank is doing.

        Measured with the mpich wheel (ch4:ucx, Hydra with -disable-auto-cleanup): when a rank
        dies, a rank that is not inside an MPI call at that moment (training, or asleep) is
        killed with it, while one that polls MPI every 50 ms or less lives on. The ranks spend
        most of a round in the executor, so this thread polls for them.
        """
        while not self._stopped.wait(PROGRESS_S):
            self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=TAG_NEVER)

    # -- waiting --------------------------------------------------------------------------------

    def _wait(self, done: Callable[[], bool], deadline: float, what: str, cancel: threading.Event | None) -> None:
        pause = POLL_MIN_S
        while not done():
            if cancel is not None and cancel.is_set():
                raise Cancelled(what)
            if self.clock() >= deadline:
                raise PeerTimeout(f"{what}: no answer before its deadline")
            time.sleep(pause)
            pause = min(POLL_MAX_S, pause * 2)

    def _abandon(self, req: MPI.Request, buf: object) -> None:
        with self._lock:
            self._abandoned.append((req, buf))
            self._abandoned = [(r, b) for r, b in self._abandoned if not r.Test()]

    # -- point to point -------------------------------------------------------------------------

    def send(self, dest: int, tag: int, data: bytes, deadline: float, cancel: threading.Event | None = None) -> None:
        """Send ``data`` to ``dest``; :class:`PeerTimeout` if it is not taken before ``deadline``.

        Small messages complete at once (eager); a large one completes only once the
        receiver posts its receive, so a hung rank is noticed here too.
        """
        req = self.comm.Isend([data, self.MPI.BYTE], dest=dest, tag=tag)
        try:
            self._wait(req.Test, deadline, f"sending {len(data)} bytes to rank {dest}", cancel)
        except (PeerTimeout, Cancelled):
            self._abandon(req, data)
            raise

    def drain(self, tag: int) -> list[tuple[int, bytes]]:
        """Every message with ``tag`` already here, without waiting (heartbeats: a few bytes each)."""
        out: list[tuple[int, bytes]] = []
        while True:
            status = self.MPI.Status()
            m = self.comm.Improbe(source=self.MPI.ANY_SOURCE, tag=tag, status=status)
            if m is None:
                return out
            buf = bytearray(status.Get_count(self.MPI.BYTE))
            m.Recv([buf, self.MPI.BYTE])  # matched and small: already here
            out.append((status.Get_source(), bytes(buf)))

    def post(self, dest: int, tag: int, data: bytes) -> None:
        """Send without waiting (a heartbeat): the request is kept until it completes."""
        self._abandon(self.comm.Isend([data, self.MPI.BYTE], dest=dest, tag=tag), data)

    def recv(self, source: int, tag: int, deadline: float, cancel: threading.Event | None = None,
             max_bytes: int = 1 << 34) -> tuple[int, int, bytearray]:
        """The next message from ``source`` (or ``MPI.ANY_SOURCE``) with ``tag`` (or ``MPI.ANY_TAG``).

        Returns (source, tag, bytes). The message is matched (``Improbe``) and then
        received with ``Imrecv``, both polled, so a sender that dies mid-transfer
        costs the deadline, not the process.
        """
        status = self.MPI.Status()
        matched: list[MPI.Message] = []

        def probe() -> bool:
            m = self.comm.Improbe(source=source, tag=tag, status=status)
            if m is not None:
                matched.append(m)
            return bool(matched)

        self._wait(probe, deadline, f"waiting for rank {source if source >= 0 else 'any'}", cancel)
        n = status.Get_count(self.MPI.BYTE)
        src, got_tag = status.Get_source(), status.Get_tag()
        if n > max_bytes:
            raise PeerTimeout(f"rank {src} sent {n} bytes, above the bound {max_bytes}")
        buf = bytearray(n)
        req = matched[0].Irecv([buf, self.MPI.BYTE])
        try:
            self._wait(req.Test, deadline, f"receiving {n} bytes from rank {src}", None)
        except PeerTimeout:
            self._abandon(req, buf)
            raise
        return src, got_tag, buf

    # -- the reduction --------------------------------------------------------------------------

    def group_comm(self, members: tuple[int, ...]) -> MPI.Intracomm:
        """A communicator of exactly ``members`` (ranks of this one), cached; collective over them only."""
        if members not in self._groups:
            group = self.comm.Get_group().Incl(list(members))
            self._groups[members] = self.comm.Create_group(group, tag=self._group_tag)
            group.Free()
        return self._groups[members]

    def forget(self, members: tuple[int, ...]) -> None:
        """Never use this communicator again (a collective on it was abandoned)."""
        self._groups.pop(members, None)  # not freed: a pending request may still refer to it

    def allreduce_sum(self, members: tuple[int, ...], buf: np.ndarray, deadline: float) -> np.ndarray:
        """Σ over ``members`` of ``buf`` (float64), or :class:`PeerTimeout` (the communicator is then forgotten)."""
        comm = self.group_comm(members)
        out = np.empty_like(buf)
        req = comm.Iallreduce(buf, out, op=self.MPI.SUM)
        try:
            self._wait(req.Test, deadline, f"the allreduce among ranks {list(members)}", None)
        except PeerTimeout:
            self._abandon(req, (buf, out))
            self.forget(members)
            raise
        return out
