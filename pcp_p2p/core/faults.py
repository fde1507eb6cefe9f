"""The error boundary: whose fault an exception caught at a peer's input is, decided once.

Every place where a stranger's bytes meet this node's code (a direct
message's handler, a SWIM packet, a status request, a blob request, a DHT
record to validate, a run's pump) ends in a catch-all. What that catch does
used to differ from place to place: some counted *any* exception as the
peer's rejection (so a bug of ours blamed, and logged a one-line "rejected"
about, an honest peer), others caught only :class:`~pcp_p2p.core.errors.PcpError`
and let a bug take the node's task group, and the node, down — which a
stranger who found the bug could then do to every node at will.

The rule, in :func:`blame_of`, sorts by the tree in :mod:`pcp_p2p.core.errors`:

========================  =========  ==================================================
caught                    blame      what the boundary does
========================  =========  ==================================================
:class:`RemoteError`      ``remote`` the peer's fault: refused with its reason code,
                                     counted in ``rejected`` by kind, logged once per
                                     (peer, kind)
:class:`PeerError`, a     ``peer``   the world broke: logged at info once per
transport error                      (peer, kind), counted in ``dropped``, nothing
(py-libp2p's, trio's                 against anyone; the caller drops the exchange
broken stream, a reset,              (or retries elsewhere)
a passed deadline)
anything else: a bug,     ``local``  this node's fault: logged ONCE with its traceback
:class:`LocalError`                  at error level (:class:`LocalFaults`), counted in
included                             ``local_faults``; the peer gets the neutral
                                     ``internal_error`` code, its rejected counts and
                                     reputation are not touched; the node goes on
========================  =========  ==================================================

``trio.Cancelled``, ``KeyboardInterrupt`` and ``SystemExit`` are
``BaseException`` and never reach a boundary: every boundary catches
``Exception`` only (a group holding any of them is a ``BaseExceptionGroup``
and passes through too).

:class:`InternalFault` is what a boundary that must still raise (a DHT
validator, whose caller is py-libp2p) raises after it has recorded a bug: a
:class:`LocalError`, so an outer boundary that sees it refuses neutrally and
does not count it a second time.
"""

from __future__ import annotations

import logging
import traceback
from collections import Counter, OrderedDict
from typing import Literal

import trio
from libp2p.exceptions import BaseLibp2pError

from pcp_p2p.core.errors import LocalError, PcpError, PeerError, PeerGone, RemoteError
from pcp_p2p.core.logs import LogOnce

log = logging.getLogger("pcp.faults")

Blame = Literal["remote", "peer", "local"]
REMOTE: Blame = "remote"
PEER: Blame = "peer"
LOCAL: Blame = "local"

INTERNAL_ERROR = "internal_error"
"""The refusal code a peer gets when handling its input hit a bug of ours: it says nothing about the peer."""

TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    BaseLibp2pError,  # py-libp2p's stream/connection errors: a reset, an EOF, a closed muxer
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    ConnectionError,  # a reset or broken pipe on a raw socket (the blob side channel)
    trio.TooSlowError,  # a deadline (trio.fail_after) passed: the other end was slow
)
"""Exceptions the transport raises when a connection or stream breaks: the world broke, like :class:`PeerError`."""

WORLD_BROKE: tuple[type[BaseException], ...] = (PeerError, *TRANSPORT_ERRORS)
"""Everything :func:`blame_of` calls ``peer``: for a handler that drops these quietly (SWIM's silence)."""


class InternalFault(LocalError):
    """A bug of this node's, caught at a boundary that must still raise; already logged and counted.

    Its message is neutral on purpose: it may travel to the peer whose input
    was being handled, and the traceback (paths, values) stays in our log.
    """

    refusal_reason = INTERNAL_ERROR


def blame_of(exc: BaseException) -> Blame:
    """Whose fault ``exc`` is (see the module's table); a group is as bad as its worst member."""
    if isinstance(exc, BaseExceptionGroup):
        blames = {blame_of(e) for e in exc.exceptions}
        return LOCAL if LOCAL in blames or not blames else REMOTE if REMOTE in blames else PEER
    if isinstance(exc, RemoteError):
        return REMOTE
    if isinstance(exc, WORLD_BROKE):
        return PEER
    return LOCAL


def sole(exc: BaseException) -> BaseException:
    """The one exception inside single-member groups (trio wraps a child task's error in one), else ``exc``."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _site(exc: BaseException) -> str:
    """Where ``exc`` was raised (file:line of its innermost frame): one log entry per bug, not per type."""
    tb = exc.__traceback__
    if tb is None:
        return "?"
    frame = traceback.extract_tb(tb)[-1]
    return f"{frame.filename}:{frame.lineno}"


class LocalFaults:
    """This node's own bugs caught at a boundary: counted by where and what, each logged once with its traceback.

    Once per (where, type, raising line): a peer that keeps sending the input
    that trips a bug cannot flood the log, and two different bugs are both
    seen. Repeats go to debug. ``counts`` keys are ``"<where>:<ExceptionType>"``,
    like ``Node.rejected``'s, for ``pcp status --json`` (``local_faults``)
    and the ``pcp_local_faults`` metric.
    """

    def __init__(self, logger: logging.Logger = log, capacity: int = 1024) -> None:
        self._logger = logger
        self._seen: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._capacity = capacity
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def record(self, exc: BaseException, where: str, peer: str = "?") -> None:
        """Count ``exc`` (a bug met while handling ``peer``'s input at ``where``) and log it once.

        An :class:`InternalFault` was recorded where it was raised, so it is not counted again.
        """
        exc = sole(exc)
        if isinstance(exc, InternalFault):
            return
        kind = type(exc).__name__
        self.counts[f"{where}:{kind}"] += 1
        key = (where, kind, _site(exc))
        if key in self._seen:
            self._seen.move_to_end(key)
            self._logger.debug("local fault in %s (input from %s): %s: %s", where, peer, kind, exc)
            return
        self._seen[key] = None
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        self._logger.error("local fault in %s while handling input from %s: %s: %s (a bug of this node's; "
                           "the peer is not blamed, the node goes on)", where, peer, kind, exc, exc_info=exc)


class Boundary:
    """The one rule applied: what to count and log for an exception caught at ``what`` from ``peer``.

    ``rejected`` counts the peers' faults by ``"<what>:<ExceptionType>"``;
    ``dropped`` the exchanges the world broke (a stalled or vanished peer:
    nobody's fault, but worth seeing); ``faults`` our own. The caller then
    answers the peer according to the returned blame (:func:`refusal_reason`)
    or just drops the exchange.

    One instance per node, shared by every boundary of it (messages, SWIM, status, the
    blob server, the DHT's background work, the doctor's speed server): each calls
    :meth:`judge` and answers by the blame it returns; none restates the rule.
    """

    def __init__(self, log_once: LogOnce, faults: LocalFaults | None = None) -> None:
        self.log_once = log_once
        self.faults = faults if faults is not None else LocalFaults()
        self.rejected: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()

    def judge(self, peer: str, exc: BaseException, what: str, *, level: int = logging.WARNING) -> Blame:
        """Count and log ``exc`` by its blame; the blame, for the caller's answer.

        ``level``: the first log of a peer's fault (repeats go to debug); the world's
        breakage is logged at most at info. A site whose failures say little about
        a peer (background work of ours) passes ``logging.DEBUG``; our own bugs are
        logged with their traceback whatever the level."""
        exc = sole(exc)  # a task's error arrives wrapped in a group: count and log what it is
        blame = blame_of(exc)
        if blame == REMOTE:
            self.rejected[f"{what}:{type(exc).__name__}"] += 1
            self.log_once(peer, exc, f"{what} rejected", level=level)
        elif blame == PEER:
            self.dropped[f"{what}:{type(exc).__name__}"] += 1
            self.log_once(peer, exc, f"{what} dropped", level=min(level, logging.INFO))
        else:
            self.faults.record(exc, what, peer)
        return blame


    def failure(self, exc: BaseException, where: str, what: str) -> PcpError:
        """What an operation of ours that failed (a dial, a stream, a DHT request) raises to its caller.

        Our own bug is recorded here (its traceback, ``local_faults`` under ``where``) and
        becomes an :class:`InternalFault`, never mistaken for a vanished peer; anything else
        (a broken transport, a peer that refused) means the operation could not be done
        there: :class:`PeerGone`. The caller raises the answer ``from exc``."""
        if blame_of(exc) == LOCAL:
            self.faults.record(exc, where)
            return InternalFault(f"{what} failed on this node")
        inner = sole(exc)
        return PeerGone(f"{what} failed: {str(inner) or type(inner).__name__}")


def refusal_reason(exc: BaseException) -> str:
    """The code a peer is told for ``exc``: the error's own for a remote or peer error, neutral for ours."""
    exc = sole(exc)
    if blame_of(exc) == LOCAL:
        return INTERNAL_ERROR
    return exc.refusal_reason if isinstance(exc, PcpError) else "refused"
