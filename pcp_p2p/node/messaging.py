"""Direct messages between peers: ``/pcp/msg/1.0.0``, one frame per stream.

Gossipsub is right for what everyone needs (heartbeats, round announcements)
but wrong for what one peer needs: it caps messages at 1 MiB, drops silently
when a peer's 32-entry queue is full, and makes every node carry every
submission. A submission or a join goes to one peer, so it travels on a
stream of its own: the sender opens a stream, writes one length-prefixed
frame, and reads a one-byte acknowledgement, so "sent" means "decoded by the
receiver's codec" rather than "handed to a queue".

Handlers register the message types they take; a frame of any other type, or
malformed, or above the largest registered type's limit, is refused (the
stream is reset, the rejection counted and logged once) and the node goes on.
A message that decoded but that its handler declined is answered instead of
reset: a NAK byte and one small :class:`Refusal` frame (a reason code and a
bounded line), which the sender raises as :class:`~pcp_p2p.core.errors.Refused` —
so ``pcp run create`` can say "not trusted" rather than "stream closed".
Whose fault a handler's exception is decides what is counted and said
(:mod:`pcp_p2p.core.faults`): a :class:`~pcp_p2p.core.errors.RemoteError` is the
sender's (its own reason code, counted as rejected); a
:class:`~pcp_p2p.core.errors.PeerError` nobody's (``unavailable``); anything else
is a bug of ours, logged with its traceback, counted in ``local_faults`` and
answered ``internal_error`` — never the sender's rejection.

Every inbound stream spends from a :class:`~pcp_p2p.net.budget.Budget`: a
stream slot on arrival, and the frame's declared length (read first) before
any of its body, both per peer and in total; a stream beyond either is reset
with :class:`~pcp_p2p.core.errors.OverBudget`. The whole frame must then arrive by
``op_timeout + size / msg_min_rate`` after the stream opened (an overall
deadline with a minimum rate, not a per-read timeout), so a peer that declares
a large frame and trickles it holds its reservation for a bounded time.

**Lines** (``/pcp/line/1.0.0``, :meth:`Messenger.post`) are for the small,
frequent and loss-tolerant: a shepherd's heartbeats and lease renewals, to every
member. A stream of their own each, with its ack, cost 630 bytes on the wire
for a 253-byte beat (stream open, protocol negotiation, the ack, the close:
docs/diloco.md), and the shepherd sends them to every member. A line is one
stream per peer, kept open, that carries frames one after another with no ack:
"posted" means handed to the connection. Only types registered for lines
travel on them (``register(..., line=True)``), through the same handlers. What
a stranger can make a node spend on lines is bounded: one line per peer (a
newer one replaces it: the sender reopens when its old one broke),
``lines_total`` in all, frames of at most the largest line type's size, paced
by a token bucket per peer and in total, and a line idle for ``line_idle_s``
is closed. A frame that is malformed, oversized or over its sender's pace ends
its line (counted as the sender's rejection); one that decoded but its handler
declined is counted and the line goes on, and so does one dropped because all
lines together are over the total pace (not its sender's fault).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from pcp_p2p.core.errors import (
    MalformedMessage,
    OverBudget,
    PcpError,
    PeerGone,
    PeerTimeout,
    ProtocolError,
    Refused,
)
from pcp_p2p.core.faults import INTERNAL_ERROR, LOCAL, PEER, refusal_reason
from pcp_p2p.net.budget import RATE_TOTAL, Budget, Limits, Pace, Rate, Reservation
from pcp_p2p.wire import Message, decode, encode, wire_message
from pcp_p2p.wire.framing import read_body, read_exact, read_frame, read_length, reset_quietly, write_frame

if TYPE_CHECKING:
    from pcp_p2p.node.node import Node

MSG_PROTOCOL = TProtocol("/pcp/msg/1.0.0")
LINE_PROTOCOL = TProtocol("/pcp/line/1.0.0")
_ACK = b"\x06"
_NAK = b"\x15"  # followed by one Refusal frame
MAX_REFUSAL_DETAIL = 240
_REASON = re.compile(r"[a-z][a-z0-9_]{0,31}")
log = logging.getLogger("pcp.msg")

Handler = Callable[[str, Message], Awaitable[None]]


@wire_message("msg.refusal", max_size=1024)
class Refusal(Message):
    """Why a decoded message was declined: a code (``[a-z][a-z0-9_]{0,31}``) and one printable line.

    Both are bounded and checked on arrival, and the line is stripped of
    control characters on both sides: a sender prints it on an owner's
    terminal, and the peer that wrote it is a stranger.
    """

    reason: str
    detail: str

    def __post_init__(self) -> None:
        if not _REASON.fullmatch(self.reason):
            raise ValueError("a refusal reason is a short lower-case code")
        if len(self.detail) > MAX_REFUSAL_DETAIL or not self.detail.isprintable():
            raise ValueError("a refusal's detail is one printable line")


def printable(text: str, limit: int = MAX_REFUSAL_DETAIL) -> str:
    """``text`` as one printable line of at most ``limit`` characters (control characters dropped)."""
    line = "".join(c if c.isprintable() else " " for c in text)
    return line if len(line) <= limit else line[: limit - 1] + "…"


def refusal_of(exc: BaseException) -> Refusal:
    """The answer for a handler's error: its ``refusal_reason`` (if well-formed) and its text;
    for a bug of ours (:mod:`pcp_p2p.core.faults`), ``internal_error`` and no detail of it (the traceback is ours)."""
    reason = refusal_reason(exc)
    if reason == INTERNAL_ERROR:
        detail = "internal error on the receiving node"
    else:
        reason = reason if _REASON.fullmatch(reason) else "refused"
        detail = printable(str(exc) or type(exc).__name__)
    return Refusal(reason=reason, detail=detail)


class Messenger:
    """Send typed messages to a peer; dispatch received ones to their handler."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._handlers: dict[type[Message], Handler] = {}
        c = node.config
        self.budget = Budget(
            Limits(c.msg_streams_per_peer, c.msg_streams_total, c.msg_bytes_per_peer, c.msg_bytes_total,
                   small_reserve=c.msg_small_reserve),
            name="msg",
        )
        self.pace = Pace(grace_s=c.op_timeout, min_rate=c.msg_min_rate)
        c.extra_status["msg_budget"] = self.budget.snapshot
        self._line_types: set[type[Message]] = set()
        self._lines_out: dict[str, _Line] = {}  # peer -> the line this node posts to it on
        self._lines_in: dict[str, trio.CancelScope] = {}  # peer -> the scope of the line it posts to us on
        self.line_rate = Rate(c.line_rate, name="line")
        c.extra_status["line_rate"] = self.line_rate.snapshot  # (its refusals by reason)

    def register(self, types: tuple[type[Message], ...], handler: Handler, *, line: bool = False) -> None:
        """Deliver messages of ``types`` to ``handler(sender_peer_id, message)``; with ``line``,
        also when they arrive on a line (:meth:`post`).

        The handler runs before the acknowledgement is sent, so it should only
        queue work (a memory channel) and return.
        """
        for t in types:
            self._handlers[t] = handler
            if line:
                self._line_types.add(t)

    def unregister(self, types: tuple[type[Message], ...]) -> None:
        for t in types:
            self._handlers.pop(t, None)
            self._line_types.discard(t)

    async def post(self, peer_id: str, msg: Message, *, timeout: float | None = None) -> None:
        """Write ``msg`` on this node's line to ``peer_id`` (opened on first use, then kept).

        No acknowledgement: the peer may not act on it, and a message posted on a
        connection that just died is lost. One post at a time per peer: while one
        is in flight another is dropped (PeerTimeout), since what lines carry is
        superseded by the next one anyway. Raises PeerGone or PeerTimeout; a line
        whose post failed is dropped (reset), and the next post opens a new one.
        """
        timeout = timeout or self.node.config.op_timeout
        data = encode(msg)
        line = self._lines_out.pop(peer_id, None) or _Line()
        self._lines_out[peer_id] = line  # (most recently posted to last)
        if line.busy:
            raise PeerTimeout(f"a post to {peer_id} is still in flight; {msg.TAG} dropped")
        line.busy = True
        while len(self._lines_out) > self.node.config.lines_total:  # peers long gone: their lines go
            stale_peer, stale = next(iter(self._lines_out.items()))
            if stale.busy:
                break
            await self._drop_line(stale_peer, stale)
        ok = False
        try:
            with trio.fail_after(timeout):
                if line.stream is None:
                    pid = ID.from_base58(peer_id)
                    await self._ensure_route(peer_id, pid)
                    try:
                        line.stream = await self.node.host.new_stream(pid, [LINE_PROTOCOL])
                    except trio.Cancelled:
                        raise
                    except Exception as exc:
                        raise self.node.boundary.failure(exc, "line", f"opening a line to {peer_id}") from exc
                await write_frame(line.stream, data, timeout=timeout)
            ok = True
        except trio.TooSlowError:
            raise PeerTimeout(f"posting {msg.TAG} to {peer_id} took longer than {timeout:.0f} s") from None
        finally:
            line.busy = False
            if not ok:  # (a frame may be half written: the line cannot carry another)
                await self._drop_line(peer_id, line)

    async def _drop_line(self, peer_id: str, line: _Line) -> None:
        if self._lines_out.get(peer_id) is line:
            del self._lines_out[peer_id]
        stream, line.stream = line.stream, None
        if stream is not None:
            with trio.CancelScope(shield=True):
                await reset_quietly(stream)

    async def handle_line(self, stream: INetStream) -> None:
        """A peer's line: frames read one after another until it closes, idles or misbehaves."""
        try:
            sender = stream.muxed_conn.peer_id.to_base58()
        except Exception:
            sender = "?"
        c = self.node.config
        scope = trio.CancelScope()
        try:
            if not self._line_types:
                raise ProtocolError("this node takes no lines now")
            if sender not in self._lines_in and len(self._lines_in) >= c.lines_total:
                raise OverBudget(f"line: more than {c.lines_total} lines open (line total budget)")
            old = self._lines_in.get(sender)
            if old is not None:
                old.cancel()  # its newer line replaces it: the sender reopens when its old one broke
            self._lines_in[sender] = scope
            with scope:
                while True:
                    types = tuple(self._line_types)
                    if not types:
                        raise ProtocolError("this node takes no lines now")
                    with trio.move_on_after(c.line_idle_s) as idle:
                        try:
                            n = await read_length(stream, max_size=max(t.MAX_SIZE for t in types))
                        except PeerGone:
                            break  # the sender closed its line between frames: an orderly end
                    if idle.cancelled_caught:
                        break
                    with trio.move_on_after(c.op_timeout) as slow:
                        data = await read_body(stream, n)
                    if slow.cancelled_caught:
                        raise PeerTimeout(f"a line frame of {n} bytes did not arrive within {c.op_timeout:.0f} s")
                    try:
                        self.line_rate.take(sender, trio.current_time())
                    except OverBudget as exc:
                        if exc.reason != RATE_TOTAL:
                            raise  # this sender's own pace: the line ends, its rejection
                        # All lines together are over the pace: this frame is dropped (counted in
                        # the budget's refusals), but the line stays and is not its sender's
                        # fault: strangers' floods must not cut the holder's heartbeats off.
                        self.node._notify()
                        continue
                    msg = decode(data, *types)
                    try:
                        await self._handlers[type(msg)](sender, msg)
                    except PcpError as exc:  # this message declined; the line goes on
                        self.node._reject(sender, exc, "line")
        except Exception as exc:  # the boundary (pcp_p2p.core.faults): whose fault decides what is counted
            self.node._reject(sender, exc, "line")
        finally:
            if self._lines_in.get(sender) is scope:
                del self._lines_in[sender]
            await reset_quietly(stream)

    async def send(self, peer_id: str, msg: Message, *, timeout: float | None = None) -> None:
        """Deliver ``msg`` to ``peer_id``; raises PeerGone/PeerTimeout/ProtocolError (InternalFault: a bug of ours)."""
        timeout = timeout or self.node.config.op_timeout
        data = encode(msg)
        log.debug("send %s (%d bytes) to %s", msg.TAG, len(data), peer_id)
        pid = ID.from_base58(peer_id)
        with trio.move_on_after(timeout) as scope:
            await self._ensure_route(peer_id, pid)
            try:
                stream = await self.node.host.new_stream(pid, [MSG_PROTOCOL])
            except trio.Cancelled:
                raise
            except Exception as exc:  # the transport's failure is PeerGone; a bug of ours a local fault
                raise self.node.boundary.failure(exc, "message", f"opening a stream to {peer_id}") from exc
            try:
                await write_frame(stream, data, timeout=timeout)
                ack = await read_exact(stream, 1)
                if ack == _NAK:
                    raise await self._read_refusal(stream, peer_id, msg, timeout)
                if ack != _ACK:
                    raise ProtocolError(f"{peer_id} refused {msg.TAG}")
                log.debug("sent %s to %s", msg.TAG, peer_id)
            finally:
                with trio.move_on_after(1):
                    try:
                        await stream.close()
                    except Exception:
                        pass
        if scope.cancelled_caught:
            raise PeerTimeout(f"sending {msg.TAG} to {peer_id} took longer than {timeout:.0f} s")

    @staticmethod
    async def _read_refusal(stream: INetStream, peer_id: str, msg: Message, timeout: float) -> Refused:
        """The :class:`Refused` a NAK announces (a ProtocolError if its frame is bad)."""
        try:
            refusal = decode(await read_frame(stream, max_size=Refusal.MAX_SIZE, timeout=timeout), Refusal)
        except ProtocolError as exc:
            raise MalformedMessage(f"{peer_id} refused {msg.TAG} with a bad refusal: {exc}") from exc
        detail = printable(refusal.detail)
        return Refused(f"{peer_id} refused {msg.TAG}: {detail}", reason=refusal.reason, detail=detail)

    async def _ensure_route(self, peer_id: str, pid: ID) -> None:
        """Dial ``peer_id`` with the addresses its member record gives, if not connected."""
        if pid in self.node.host.get_network().connections:
            return
        member = self.node.membership.get(peer_id)
        addrs = [str(a) for a in member.record.addrs] if member else []
        if not addrs:
            addrs = [str(a) for a in self.node.host.get_peerstore().addrs(pid)]
        if not addrs:
            raise PeerGone(f"no known address for {peer_id}")
        try:
            await self.node.connect(pid, addrs)  # direct addresses first, then through its relays
        except PeerGone:
            raise
        except trio.Cancelled:
            raise
        except Exception as exc:  # (the same rule as a stream's: pcp_p2p.core.faults.Boundary.failure)
            raise self.node.boundary.failure(exc, "message", f"reaching {peer_id}") from exc

    async def handle(self, stream: INetStream) -> None:
        try:
            sender = stream.muxed_conn.peer_id.to_base58()
        except Exception:
            sender = "?"
        handled = False  # the message decoded and its handler ran (so it gets an answer, not a reset)
        try:
            with self.budget.open(sender) as reservation:
                msg = await self._read(stream, reservation)
                log.debug("received %s from %s", msg.TAG, sender)
                handled = True
                await self._handlers[type(msg)](sender, msg)
                handled = False  # from here on only the ack is written: a failure is the stream's
                await stream.write(_ACK)
                await stream.close()
        except Exception as exc:  # the boundary (pcp_p2p.core.faults): whose fault decides what is counted and said
            blame = self.node._reject(sender, exc, "message")
            if blame == LOCAL or (handled and (blame != PEER or isinstance(exc, PcpError))):
                await self._refuse(stream, exc)
            else:
                await reset_quietly(stream)

    async def _refuse(self, stream: INetStream, exc: BaseException) -> None:
        """Answer a declined message with NAK and its :class:`Refusal`; reset if even that fails."""
        try:
            with trio.fail_after(self.node.config.op_timeout):
                await stream.write(_NAK)
                await write_frame(stream, encode(refusal_of(exc)), timeout=self.node.config.op_timeout)
                await stream.close()
        except trio.Cancelled:
            raise
        except Exception:  # the sender left, or stalls: nothing more to tell it
            await reset_quietly(stream)

    async def _read(self, stream: INetStream, reservation: Reservation) -> Message:
        """One frame, its declared length reserved before its body is read, under the pace's deadline."""
        types = tuple(self._handlers)
        if not types:
            raise ProtocolError("this node takes no direct messages now")
        limit = max(t.MAX_SIZE for t in types)
        arrived = trio.current_time()
        data: bytearray | None = None
        with trio.CancelScope(deadline=self.pace.deadline(arrived, 0)) as scope:
            n = await read_length(stream, max_size=limit)
            reservation.reserve(n)  # OverBudget: refused before a byte of the body is read
            scope.deadline = self.pace.deadline(arrived, n)
            data = await read_body(stream, n)
        if data is None:
            raise PeerTimeout(f"no complete frame within {trio.current_time() - arrived:.1f} s "
                              f"(at least {self.pace.min_rate / 1024:.0f} KiB/s after {self.pace.grace_s:.0f} s)")
        # The reservation stays until the handler returns: the decoded message
        # holds about as much as the frame did until the handler has queued it.
        return decode(data, *types)


class _Line:
    """The stream this node posts to one peer on, and whether a post is writing on it."""

    def __init__(self) -> None:
        self.stream: INetStream | None = None
        self.busy = False
