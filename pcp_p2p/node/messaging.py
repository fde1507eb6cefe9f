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
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from pcp_p2p.errors import PcpError, PeerGone, PeerTimeout, ProtocolError
from pcp_p2p.wire import Message, decode, encode
from pcp_p2p.wire.framing import read_exact, read_frame, reset_quietly, write_frame

if TYPE_CHECKING:
    from pcp_p2p.node.node import Node

MSG_PROTOCOL = TProtocol("/pcp/msg/1.0.0")
_ACK = b"\x06"
log = logging.getLogger("pcp.msg")

Handler = Callable[[str, Message], Awaitable[None]]


class Messenger:
    """Send typed messages to a peer; dispatch received ones to their handler."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._handlers: dict[type[Message], Handler] = {}

    def register(self, types: tuple[type[Message], ...], handler: Handler) -> None:
        """Deliver messages of ``types`` to ``handler(sender_peer_id, message)``.

        The handler runs before the acknowledgement is sent, so it should only
        queue work (a memory channel) and return.
        """
        for t in types:
            self._handlers[t] = handler

    def unregister(self, types: tuple[type[Message], ...]) -> None:
        for t in types:
            self._handlers.pop(t, None)

    async def send(self, peer_id: str, msg: Message, *, timeout: float | None = None) -> None:
        """Deliver ``msg`` to ``peer_id``; raises PeerGone/PeerTimeout/ProtocolError."""
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
            except Exception as exc:
                raise PeerGone(f"cannot open a stream to {peer_id}: {exc or type(exc).__name__}") from exc
            try:
                await write_frame(stream, data, timeout=timeout)
                ack = await read_exact(stream, 1)
                if ack != _ACK:
                    raise ProtocolError(f"{peer_id} refused {msg.TAG}")
                log.debug("sent %s to %s", msg.TAG, peer_id)
            finally:
                with trio.move_on_after(1):
                    try:
                        await stream.close()
                    except Exception:
                        pass
            return
        assert scope.cancelled_caught
        raise PeerTimeout(f"sending {msg.TAG} to {peer_id} took longer than {timeout:.0f} s")

    async def _ensure_route(self, peer_id: str, pid: ID) -> None:
        """Dial ``peer_id`` with the addresses its member record gives, if not connected."""
        if pid in self.node.host.get_network().connections:
            return
        from pcp_p2p.node.node import transport_addrs

        member = self.node.membership.get(peer_id)
        addrs = transport_addrs(member.record.addrs) if member else []
        if not addrs:
            addrs = list(self.node.host.get_peerstore().addrs(pid))
        if not addrs:
            raise PeerGone(f"no known address for {peer_id}")
        try:
            await self.node.host.connect(PeerInfo(pid, addrs))
        except trio.Cancelled:
            raise
        except Exception as exc:
            raise PeerGone(f"cannot reach {peer_id}: {exc or type(exc).__name__}") from exc

    async def handle(self, stream: INetStream) -> None:
        try:
            sender = stream.muxed_conn.peer_id.to_base58()
        except Exception:
            sender = "?"
        types = tuple(self._handlers)
        try:
            if not types:
                raise ProtocolError("this node takes no direct messages now")
            limit = max(t.MAX_SIZE for t in types)
            msg = decode(await read_frame(stream, max_size=limit, timeout=self.node.config.op_timeout), *types)
            log.debug("received %s from %s", msg.TAG, sender)
            await self._handlers[type(msg)](sender, msg)
            await stream.write(_ACK)
            await stream.close()
        except PcpError as exc:
            self.node._reject(sender, exc, "message")
            await reset_quietly(stream)
        except trio.Cancelled:
            raise
        except Exception as exc:  # a libp2p stream error: the peer's problem, not ours
            self.node._reject(sender, exc, "message")
            await reset_quietly(stream)

