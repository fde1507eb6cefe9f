"""A probe of py-libp2p 0.8.1's circuit relay v2 and DCUtR hole punching, run inside the lab.

Not PCP code: the smallest working recipe for issue #14's second item, and the
check that the lab's NATs behave like the ones hole punching was built for. Each
role is one process in a lab namespace (``python -m pcp_p2p.testing.netlab_punch``):

- ``relay IP``: a public host offering reservations (hop), with limits; prints its multiaddr.
- ``listen IP RELAY``: reserves a slot on the relay; prints ``RESERVED <peer id>``.
- ``dial IP RELAY TARGET [WAIT_S]``: reserves too, dials TARGET through the relay
  (``RELAY/p2p-circuit/p2p/TARGET``), and lets DCUtR upgrade; prints one JSON
  line: ``relayed_s``, ``direct`` (a connection without ``/p2p-circuit``),
  ``direct_s`` and the connections' addresses.

Both peers listen on a fixed port: DCUtR binds its punching dials to the listen
port (SO_REUSEPORT) and advertises relay-observed WAN IP + listen port, which an
endpoint-independent ("cone") NAT preserves and a symmetric one does not.
"""

from __future__ import annotations

import json
import logging
import sys

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID, CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.tools.anyio_service.context import background_trio_service

RELAY_PORT = 4001
PEER_PORT = 4002
# A relay carries control traffic only: small per-circuit byte and time budgets.
LIMITS = RelayLimits(duration=600, data=4 << 20, max_circuit_conns=16, max_reservations=16)


def connection_addrs(host: IHost, peer: ID) -> list[list[str]]:
    """The transport addresses of every connection to ``peer`` (``/p2p-circuit`` ones are relayed)."""
    conns = host.get_network().connections.get(peer, [])
    out = []
    for conn in conns if isinstance(conns, list) else [conns]:
        try:
            out.append([str(a) for a in conn.get_transport_addresses()])
        except Exception:  # a connection closing under us: skip it
            continue
    return out


def is_direct(addrs: list[list[str]]) -> bool:
    return any(a and not any("/p2p-circuit" in x for x in a) for a in addrs)


class ConnectionWatch(INotifee):
    """Wakes a waiter each time the swarm opens a connection (DCUtR's direct one among them)."""

    def __init__(self) -> None:
        self.opened = trio.Event()

    def arm(self) -> trio.Event:
        """A fresh event for the next connection; take it *before* looking, so none is missed."""
        self.opened = trio.Event()
        return self.opened

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self.opened.set()  # the swarm lists the connection before it notifies

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        pass

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, addr: multiaddr.Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, addr: multiaddr.Multiaddr) -> None:
        pass


async def run(role: str, ip: str, relay_addr: str = "", target: str = "", wait_s: str = "40") -> None:
    from libp2p.relay.circuit_v2.transport import CircuitV2Transport

    host = new_host(key_pair=create_new_key_pair())
    proto = CircuitV2Protocol(host, limits=LIMITS, allow_hop=role == "relay")
    port = RELAY_PORT if role == "relay" else PEER_PORT
    async with host.run([multiaddr.Multiaddr(f"/ip4/{ip}/tcp/{port}")]), background_trio_service(proto):
        if role == "relay":
            print(f"/ip4/{ip}/tcp/{port}/p2p/{host.get_id()}", flush=True)
            await trio.sleep_forever()
        transport = CircuitV2Transport(host, proto, RelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT, limits=LIMITS))
        async with background_trio_service(DCUtRProtocol(host)), trio.open_nursery() as nursery:
            relay = info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
            await host.connect(relay)
            stream = await host.new_stream(relay.peer_id, [PROTOCOL_ID])
            if not await transport.reserve(stream, relay.peer_id, nursery):
                raise SystemExit("reservation refused")
            print(f"RESERVED {host.get_id()}", flush=True)
            if role == "listen":
                await trio.sleep_forever()
            peer = ID.from_string(target)
            watch = ConnectionWatch()
            host.get_network().register_notifee(watch)
            t0 = trio.current_time()
            await transport.dial(multiaddr.Multiaddr(f"{relay_addr}/p2p-circuit/p2p/{target}"))
            relayed_s = trio.current_time() - t0
            direct_s = None
            with trio.move_on_after(float(wait_s)):
                while True:
                    opened = watch.arm()
                    if is_direct(connection_addrs(host, peer)):
                        break
                    await opened.wait()
                direct_s = trio.current_time() - t0
            print(json.dumps({"relayed_s": round(relayed_s, 2), "direct": direct_s is not None,
                              "direct_s": None if direct_s is None else round(direct_s, 2),
                              "connections": connection_addrs(host, peer)}), flush=True)
            nursery.cancel_scope.cancel()


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    trio.run(run, *argv)


if __name__ == "__main__":
    main(sys.argv[1:])
