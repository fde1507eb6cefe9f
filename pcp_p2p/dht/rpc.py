"""One KAD request/response in one round trip: multistream-select pipelined with the request.

``host.new_stream`` in py-libp2p 0.8.1 negotiates a protocol in two round
trips (the multistream header, then the protocol, each written and echoed in
turn) and the KAD code then writes the length prefix and the message as two
more frames: three round trips and half a dozen socket writes per RPC, each
write a wake-up of another process. On a loaded 2-core machine that, not the
DHT logic, was most of a 120 ms get.

:func:`kad_request` sends the multistream header, the protocol and the
length-prefixed request in ONE write on a fresh yamux stream, then reads the
two echoes and the answer (multistream-select allows this: a listener reads
the proposals in order; Go's "lazy" client does the same). Only to a peer whose
identify listed the KAD protocol, though: py-libp2p 0.8.1's listener, after
answering ``na``, reads the request bytes as the next proposal, fails to
decode them as text, and the UnicodeDecodeError takes its whole host down (a
bench's status client died so). Any other peer gets py-libp2p's own
negotiation first (``host.new_stream``). The same KAD wire messages as
py-libp2p's own, so either side may be either code.

The request builders and answer readers below mirror what py-libp2p's
``_get_from_peer``/``_store_at_peer`` send and check (the sender's signed
peer record, closer peers with their signed records into the peerstore),
without their extra round trips. There is no FIND_NODE here: py-libp2p's
server resets a FIND_NODE whose key is longer than 50 bytes and not a peer
id, and every ``/pcp/<kind>/<name>`` key is longer; a GET_VALUE answer names
the closer peers just the same (keys up to 128 bytes).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import varint
from libp2p.abc import IHost
from libp2p.kad_dht.common import PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message, Record
from libp2p.kad_dht.utils import maybe_consume_signed_record
from libp2p.peer.envelope import unmarshal_envelope
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import env_to_send_in_RPC
from libp2p.utils.varint import encode_delim, read_delim, read_varint_prefixed_bytes_limited
from multiaddr import Multiaddr

from pcp_p2p.core import addrs as addr_rules
from pcp_p2p.core.errors import MalformedMessage, PeerGone, RemoteError
from pcp_p2p.core.faults import Boundary
from pcp_p2p.core.logs import LogOnce

log = logging.getLogger("pcp.dht")

MULTISTREAM = b"/multistream/1.0.0"
MAX_ANSWER = 4 * 1024 * 1024  # py-libp2p's MAX_DHT_MESSAGE_SIZE: a closer-peers list with records
CLOSER_ADDR_TTL_S = 600  # how long addresses learned from an answer stay in the peerstore


def _preamble(protocol: str) -> bytes:
    return encode_delim(MULTISTREAM) + encode_delim(protocol.encode())


_KAD_PREAMBLE = _preamble(str(PROTOCOL_ID))
_OWN = Boundary(LogOnce(log))  # for requests made without a node's boundary (tools, tests)


async def kad_request(host: IHost, peer: ID, request: Message, *, boundary: Boundary | None = None) -> Message:
    """Send ``request`` to ``peer`` on a new KAD stream and return its answer (one round trip).

    Raises :class:`PeerGone` when the stream cannot be opened, the peer refuses
    the protocol or closes early, :class:`MalformedMessage` (or another
    ``RemoteError``) for an answer that does not parse or is too large, and
    :class:`~pcp_p2p.core.faults.InternalFault` for a bug of ours on the way, recorded
    at ``boundary`` (the DHT's: the node's). The stream is closed on every path.
    """
    boundary = boundary if boundary is not None else _OWN
    body = request.SerializeToString()
    pipelined = speaks_kad(host, peer)
    try:
        if pipelined:
            stream = await host.get_network().new_stream(peer)
            stream.set_protocol(PROTOCOL_ID)  # (proposed in the preamble; status counts its bytes under it)
        else:
            stream = await host.new_stream(peer, [PROTOCOL_ID])
    except Exception as exc:
        raise boundary.failure(exc, "dht", f"a KAD stream to {peer}") from exc
    try:
        framed = varint.encode(len(body)) + body
        await stream.write(_KAD_PREAMBLE + framed if pipelined else framed)
        if pipelined:
            if await read_delim(stream) != MULTISTREAM:
                raise PeerGone(f"{peer} does not speak multistream-select")
            if (await read_delim(stream)).decode(errors="replace") != str(PROTOCOL_ID):
                raise PeerGone(f"{peer} refused {PROTOCOL_ID}")
        answer_bytes = await read_varint_prefixed_bytes_limited(stream, MAX_ANSWER)
    except (PeerGone, RemoteError):
        raise  # (a peer's bad answer stays its fault)
    except Exception as exc:
        raise boundary.failure(exc, "dht", f"the KAD request to {peer}") from exc
    finally:
        try:
            await stream.close()
        except Exception:
            pass
    answer = Message()
    try:
        answer.ParseFromString(answer_bytes)
    except Exception as exc:
        raise MalformedMessage(f"unparsable KAD answer from {peer}: {exc}") from exc
    if answer.type != request.type:
        raise MalformedMessage(f"KAD answer of type {answer.type} to a request of type {request.type}")
    if not maybe_consume_signed_record(answer, host, peer):
        raise MalformedMessage(f"{peer} sent an invalid signed peer record")
    return answer


def speaks_kad(host: IHost, peer: ID) -> bool:
    """Whether identify told us ``peer`` serves the KAD protocol (then a request may be pipelined)."""
    try:
        return str(PROTOCOL_ID) in [str(p) for p in host.get_peerstore().get_protocols(peer) or ()]
    except Exception:
        return False


def _request(host: IHost, kind: Message.MessageType, key: bytes) -> Message:
    msg = Message()
    msg.type = kind
    msg.key = key
    msg.senderRecord = env_to_send_in_RPC(host)[0]
    return msg


def _dialable_record(signed: bytes, networks: Sequence[addr_rules.IPNetwork]) -> bool:
    """Whether a peer's signed peer record names only addresses this node could dial (parsed, not
    yet verified: :func:`maybe_consume_signed_record` verifies what is kept)."""
    try:
        addrs = unmarshal_envelope(signed).record().addrs
    except Exception:
        return True  # unreadable: maybe_consume_signed_record refuses it, and the entry with it
    return len(addr_rules.dialable_here(addrs, networks)) == len(addrs)


def _closer(host: IHost, answer: Message, networks: Sequence[addr_rules.IPNetwork] = ()) -> list[ID]:
    """The peers an answer names (their addresses and signed records go to the peerstore).

    Only addresses this node could dial are stored (:func:`pcp_p2p.core.addrs.dialable_here`:
    never an unspecified one, nor a private one outside our ``networks``), and a signed peer
    record naming any other is not stored at all (it replaces the peer's addresses when it is).
    """
    out: list[ID] = []
    local = host.get_id()
    for entry in answer.closerPeers:
        if entry.signedRecord and not _dialable_record(entry.signedRecord, networks):
            entry.ClearField("signedRecord")
        if not entry.id or not maybe_consume_signed_record(entry, host):
            continue
        try:
            peer = ID(entry.id)
        except Exception:
            continue
        if peer == local or peer in out:
            continue
        addrs = []
        for raw in entry.addrs:
            try:
                addrs.append(Multiaddr(raw))
            except Exception:
                pass
        addrs = [Multiaddr(a) for a in addr_rules.dialable_here(addrs, networks)]
        if addrs:
            host.get_peerstore().add_addrs(peer, addrs, CLOSER_ADDR_TTL_S)
        out.append(peer)
    return out


async def get_value(
    host: IHost, peer: ID, key: bytes, *, closer_if_found: bool = True,
    networks: Sequence[addr_rules.IPNetwork] = (), boundary: Boundary | None = None,
) -> tuple[Record | None, list[ID]]:
    """GET_VALUE: the peer's record for ``key`` (unvalidated: the caller validates) and closer peers.

    ``closer_if_found=False`` skips the closer peers when a record came back (a
    lookup that stops at the first record needs none): each carries a signed
    peer record, and checking eight signatures costs more than the rest of the answer.
    ``networks``: this node's, whose private addresses it keeps (:func:`_closer`).
    """
    answer = await kad_request(host, peer, _request(host, Message.MessageType.GET_VALUE, key), boundary=boundary)
    record = answer.record if answer.HasField("record") and answer.record.value else None
    if record is not None and not closer_if_found:
        return record, []
    return record, _closer(host, answer, networks)


async def get_providers(
    host: IHost, peer: ID, key: bytes, *, networks: Sequence[addr_rules.IPNetwork] = (),
    boundary: Boundary | None = None,
) -> tuple[list[PeerInfo], list[ID]]:
    """GET_PROVIDERS: the providers ``peer`` knows for ``key`` and the closer peers it names.

    A provider entry is read as a closer-peer entry is (:func:`_closer`: its signed peer
    record checked, only addresses this node could dial kept); one without a dialable
    address is still returned, with none (the host may already know how to reach it)."""
    answer = await kad_request(host, peer, _request(host, Message.MessageType.GET_PROVIDERS, key), boundary=boundary)
    as_closer = Message()
    as_closer.closerPeers.extend(answer.providerPeers)
    providers = [PeerInfo(p, _known_addrs(host, p)) for p in _closer(host, as_closer, networks)]
    return providers, _closer(host, answer, networks)


def _known_addrs(host: IHost, peer: ID) -> list[Multiaddr]:
    try:
        return list(host.get_peerstore().addrs(peer))
    except Exception:  # (PeerStoreError: none known, or expired)
        return []


async def add_provider(host: IHost, peer: ID, key: bytes, *, boundary: Boundary | None = None) -> bool:
    """ADD_PROVIDER: this node provides ``key``, at the addresses its signed peer record names;
    True once the peer echoed the key (py-libp2p's server does; its own sender does not wait
    for the echo, but one round trip per announcement is what tells a store from a reset)."""
    msg = _request(host, Message.MessageType.ADD_PROVIDER, key)
    provider = msg.providerPeers.add()
    provider.id = host.get_id().to_bytes()
    provider.addrs.extend(a.to_bytes() for a in host.get_addrs())
    provider.signedRecord = msg.senderRecord
    answer = await kad_request(host, peer, msg, boundary=boundary)
    return answer.key == key


async def put_value(host: IHost, peer: ID, key: bytes, value: bytes, *, boundary: Boundary | None = None) -> bool:
    """PUT_VALUE: store ``value`` at ``peer``; True once it acknowledged the key."""
    msg = _request(host, Message.MessageType.PUT_VALUE, key)
    msg.record.key = key
    msg.record.value = value
    answer = await kad_request(host, peer, msg, boundary=boundary)
    return answer.key == key
