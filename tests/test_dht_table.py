"""Routing tables hold DHT servers with dialable addresses: short-lived clients and
wildcard-only peers stay out (pcp_p2p/dht/table.py), over real py-libp2p on 127.0.0.1."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import multiaddr
import pytest
import trio
from conftest import TEST_CAPS
from libp2p import new_host
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.table import ServersOnlyRoutingTable, dialable, is_unspecified
from pcp_p2p.node.node import NodeConfig, open_node

pytestmark = pytest.mark.timeout(120)


def ma(s: str) -> multiaddr.Multiaddr:
    return multiaddr.Multiaddr(s)


def test_unspecified_addresses_are_not_dialable() -> None:
    assert is_unspecified(ma("/ip4/0.0.0.0/tcp/4001")) and is_unspecified(ma("/ip6/::/tcp/4001"))
    assert not is_unspecified(ma("/ip4/127.0.0.1/tcp/4001")) and not is_unspecified(ma("/ip6/::1/tcp/1"))
    home = [ipaddress.ip_network("10.0.0.0/24")]
    assert dialable([ma("/ip4/0.0.0.0/tcp/1"), ma("/ip4/10.0.0.2/tcp/1")], home) == [ma("/ip4/10.0.0.2/tcp/1")]
    # another home's private address names nobody we could reach
    assert dialable([ma("/ip4/10.0.0.2/tcp/1"), ma("/ip4/198.18.0.5/tcp/1")]) == [ma("/ip4/198.18.0.5/tcp/1")]


async def test_a_private_address_from_outside_our_networks_does_not_enter_the_table() -> None:
    host = new_host(key_pair=Identity.generate().key_pair)
    table = ServersOnlyRoutingTable(host.get_id(), host, networks=[ipaddress.ip_network("198.18.0.0/24")])
    home = ID.from_base58(Identity.generate().peer_id)
    assert not await table.add_peer(PeerInfo(home, [ma("/ip4/10.1.0.2/tcp/4001")]))
    assert table.refused["no dialable address"] == 1



async def test_a_home_reachable_only_through_a_relay_stays_out_and_a_direct_address_is_kept() -> None:
    """Relays carry control traffic for their homes, not every lookup that would walk through
    them: a node whose only dialable address is a circuit asks the DHT and is never asked."""
    host = new_host(key_pair=Identity.generate().key_pair)
    table = ServersOnlyRoutingTable(host.get_id(), host, networks=[ipaddress.ip_network("198.18.0.0/24")])
    home = ID.from_base58(Identity.generate().peer_id)
    relayed = ma(f"/ip4/198.18.0.10/tcp/4001/p2p/{Identity.generate().peer_id}/p2p-circuit")
    assert not await table.add_peer(PeerInfo(home, [ma("/ip4/10.1.0.2/tcp/4001"), relayed]))
    assert table.refused["reachable only through a relay"] == 1 and not table.peer_in_table(home)
    public = ID.from_base58(Identity.generate().peer_id)
    assert await table.add_peer(PeerInfo(public, [relayed, ma("/ip4/198.18.0.7/tcp/4001")]))
    (info,) = [i for i in table.get_peer_infos() if i.peer_id == public]
    assert [str(a) for a in info.addrs] == ["/ip4/198.18.0.7/tcp/4001"]  # the direct one only


async def test_a_peer_advertising_only_the_wildcard_is_refused() -> None:
    host = new_host(key_pair=Identity.generate().key_pair)
    table = ServersOnlyRoutingTable(host.get_id(), host)
    wild = ID.from_base58(Identity.generate().peer_id)
    assert not await table.add_peer(PeerInfo(wild, [ma("/ip4/0.0.0.0/tcp/4001")]))
    assert not table.peer_in_table(wild) and table.refused["no dialable address"] == 1
    ok = ID.from_base58(Identity.generate().peer_id)
    assert await table.add_peer(PeerInfo(ok, [ma("/ip4/0.0.0.0/tcp/1"), ma("/ip4/127.0.0.1/tcp/1")]))
    (info,) = [i for i in table.get_peer_infos() if i.peer_id == ok]
    assert [str(a) for a in info.addrs] == ["/ip4/127.0.0.1/tcp/1"]  # the wildcard is not kept either


async def _until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    """Routing tables change without an event to wait on: look again every 0.1 s, bounded."""
    with trio.fail_after(timeout):
        while not predicate():  # noqa: ASYNC110  (py-libp2p's routing table has no change event)
            await trio.sleep(0.1)


async def test_a_client_that_comes_and_goes_never_enters_the_servers_routing_tables(tmp_path: Path) -> None:
    def cfg(name: str, **kw: object) -> NodeConfig:
        return NodeConfig(tmp_path / name, capabilities=TEST_CAPS, op_timeout=3.0, **kw)  # type: ignore[arg-type]

    async with open_node(cfg("boot", role="bootstrap", listen=("/ip4/127.0.0.1/tcp/0",))) as boot:
        # Workers listen on the wildcard, as `pcp node join` does by default: they must still get in.
        workers = ("/ip4/0.0.0.0/tcp/0",)
        async with open_node(cfg("a", listen=workers, bootstrap=(boot.addrs()[0],))) as a, \
                open_node(cfg("b", listen=workers, bootstrap=(boot.addrs()[0],))) as b:
            servers = (boot, a, b)
            ids = {n.peer_id for n in servers}

            def table(n):  # type: ignore[no-untyped-def]
                return {p.to_base58() for p in n.dht.routing_table.get_peer_ids()}

            await _until(lambda: all(ids - {n.peer_id} <= table(n) for n in servers), 60, "servers know each other")
            await a.put_record(a._signed_member_record())
            async with open_node(cfg("client", role="client", listen=("/ip4/0.0.0.0/tcp/0",),
                                     bootstrap=(boot.addrs()[0],))) as client:
                assert client.dht.mode.name == "CLIENT"
                with trio.fail_after(30):
                    await client.bootstrapped.wait()
                # The client's lookups open KAD streams to the servers ...
                assert (await client.get_record("member", a.peer_id)).peer_id == a.peer_id
                cid = ID.from_base58(client.peer_id)
                await _until(lambda: all(cid not in getattr(n.dht.routing_table, "_pending", ()) for n in servers), 20,
                             "deferred checks done")
                # ... and yet no server keeps it, while it is there ...
                assert not any(client.peer_id in table(n) for n in servers)
                assert sum(n.dht.routing_table.refused["not a DHT server"] for n in servers) >= 1
            # ... nor after it has gone and the servers have refreshed their tables.
            for n in servers:
                await n._refresh()
                assert client.peer_id not in table(n)
                assert ids - {n.peer_id} <= table(n)
