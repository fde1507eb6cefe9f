"""What a node advertises, and what it keeps or passes on of others' addresses (issue #14).

The rules are pure functions (:mod:`pcp_p2p.net.advertise`, :mod:`pcp_p2p.core.addrs`),
tested here without a network; one in-process node on 127.0.0.1 checks that identify,
the DHT's own peer info and the member record carry the same set. The netlab test
(a cone home seen from the internet) is in ``tests/test_netlab_addrs.py``.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import multiaddr
import pytest
from conftest import TEST_CAPS
from libp2p import new_host
from libp2p.identity.identify.identify import _mk_identify_protobuf
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID
from libp2p.peer.peerstore import create_signed_peer_record

from pcp_p2p.core.addrs import dialable_by, dialable_here
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.rpc import _closer
from pcp_p2p.net.advertise import Advertiser, ListenView, advertised, expand_listen
from pcp_p2p.net.reachability import HOLE_PUNCHABLE, PUBLIC, RELAY_ONLY, UNKNOWN
from pcp_p2p.node.node import NodeConfig, open_node

ME = "12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"
RELAY = "12D3KooWQs9uTrZ5cz1oTRdV8dhU1Q7sT3nDywb2xdtq5UuqHz7F"
RELAYED = f"/ip4/198.18.0.10/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{ME}"
HOME_IPS = ["127.0.0.1", "10.1.0.2"]
WILD = ["/ip4/0.0.0.0/tcp/4001"]
LAB = [ipaddress.ip_network("198.18.0.0/24")]  # the networks of a node on the lab's internet
HOME = [ipaddress.ip_network("10.1.0.0/24")]  # ... and of one in a home


# --- what a node advertises -------------------------------------------------------------------


def test_the_wildcard_is_expanded_and_never_advertised() -> None:
    assert expand_listen(["/ip4/0.0.0.0/tcp/7", "/ip6/::/tcp/7", "/ip4/10.1.1.1/tcp/8"], ["127.0.0.1", "10.1.1.1"]) \
        == ["/ip4/127.0.0.1/tcp/7", "/ip4/10.1.1.1/tcp/7", "/ip4/10.1.1.1/tcp/8"]
    for verdict in (PUBLIC, HOLE_PUNCHABLE, RELAY_ONLY, UNKNOWN):
        assert not any("0.0.0.0" in a or "/ip6/::/" in a
                       for a in advertised(verdict, [*WILD, "/ip6/::/tcp/1"], HOME_IPS))


def test_loopback_is_advertised_only_by_a_node_that_listens_on_nothing_else() -> None:
    assert advertised(UNKNOWN, ["/ip4/127.0.0.1/tcp/5"], ["127.0.0.1"]) == ["/ip4/127.0.0.1/tcp/5"]
    assert advertised(UNKNOWN, WILD, HOME_IPS) == ["/ip4/10.1.0.2/tcp/4001"]  # a LAN swarm: its LAN address


def test_a_public_node_advertises_its_public_addresses_only() -> None:
    ips = ["127.0.0.1", "172.17.0.1", "198.18.0.11"]  # a docker bridge beside the public interface
    assert advertised(PUBLIC, WILD, ips) == ["/ip4/198.18.0.11/tcp/4001"]
    assert advertised(PUBLIC, ["/ip4/198.18.0.11/tcp/9"], ips) == ["/ip4/198.18.0.11/tcp/9"]


def test_behind_a_nat_only_relayed_addresses_are_advertised() -> None:
    for verdict in (HOLE_PUNCHABLE, RELAY_ONLY):
        got = advertised(verdict, WILD, HOME_IPS, relayed=[RELAYED])
        assert got == [RELAYED]


def test_behind_a_nat_without_a_relay_the_listen_addresses_stand_in() -> None:
    """No reservation yet, or the relay died: never nothing (py-libp2p's identify would then send the
    raw listen addresses, 0.0.0.0 included), and not our public IP with the listen port (a NAT that
    drops silently made every dial to it hang); receivers elsewhere drop the private ones."""
    for verdict in (HOLE_PUNCHABLE, RELAY_ONLY):
        assert advertised(verdict, WILD, HOME_IPS) == ["/ip4/10.1.0.2/tcp/4001"]
        assert dialable_here(advertised(verdict, WILD, HOME_IPS), LAB) == []  # a public node keeps none


def test_the_host_advertises_circuit_addresses_whole_and_others_with_our_id() -> None:
    adv = Advertiser(ME, HOME_IPS)
    assert adv.addrs(WILD) == [f"/ip4/10.1.0.2/tcp/4001/p2p/{ME}"]
    adv.verdict, adv.relayed = RELAY_ONLY, (RELAYED,)
    assert adv.addrs(WILD) == [RELAYED]  # py-libp2p's get_addrs would cut it to the relay's address


# --- what a node keeps, and passes on, of others' addresses ------------------------------------

def test_a_stranger_s_private_address_is_kept_only_inside_our_own_network() -> None:
    given = ["/ip4/0.0.0.0/tcp/1", "/ip4/10.1.0.2/tcp/1", "/ip4/198.18.0.7/tcp/1", "/ip4/127.0.0.1/tcp/1", RELAYED]
    assert dialable_here(given, LAB) == ["/ip4/198.18.0.7/tcp/1", "/ip4/127.0.0.1/tcp/1", RELAYED]
    assert dialable_here(given, HOME) == ["/ip4/10.1.0.2/tcp/1", "/ip4/198.18.0.7/tcp/1", "/ip4/127.0.0.1/tcp/1",
                                          RELAYED]


def test_private_addresses_are_passed_on_only_to_a_neighbour_in_that_network() -> None:
    given = ["/ip4/0.0.0.0/tcp/1", "/ip4/10.1.0.2/tcp/1", "/ip4/198.18.0.7/tcp/1", "/ip4/127.0.0.1/tcp/1", RELAYED]
    public = ["/ip4/198.18.0.7/tcp/1", RELAYED]
    assert dialable_by(given, "198.18.0.20", LAB + HOME) == public  # a stranger on the internet
    assert dialable_by(given, None, LAB + HOME) == public  # unknown (a relayed asker)
    assert dialable_by(given, "10.1.0.3", LAB + HOME) == ["/ip4/10.1.0.2/tcp/1", *public]
    assert dialable_by(given, "127.0.0.1", LAB) == ["/ip4/198.18.0.7/tcp/1", "/ip4/127.0.0.1/tcp/1", RELAYED]
    # an asker on this machine (loopback) can dial whatever we can: our LAN neighbours too
    assert dialable_by(given, "127.0.0.1", HOME) == dialable_here(given, HOME)
    assert "/ip4/127.0.0.1/tcp/1" not in dialable_by(given, "10.1.0.3", HOME)  # loopback is for this machine only


# --- one rule at every exit: identify, the DHT, the member record, status ----------------------


def bare(addr: str) -> str:
    return addr.rsplit("/p2p/", 1)[0]


@pytest.mark.timeout(60)
async def test_identify_the_dht_and_the_member_record_advertise_the_same_set(tmp_path: Path) -> None:
    cfg = NodeConfig(tmp_path / "a", listen=("/ip4/127.0.0.1/tcp/0",), capabilities=TEST_CAPS)
    async with open_node(cfg) as node:
        want = node.advertised_addrs()
        assert want == node.addrs() and want[0].startswith("/ip4/127.0.0.1/tcp/")
        identify = _mk_identify_protobuf(node.host, None)  # listenAddrs go without the trailing /p2p/<me>
        assert [str(multiaddr.Multiaddr(b)) for b in identify.listen_addrs] == [bare(a) for a in want]
        assert [str(a) for a in node.dht.peer_routing.host.get_addrs()] == want  # FIND_NODE about itself
        assert list(node.member_record().addrs) == want and list(node.status().addrs) == want
        # Behind a NAT with a reservation: every exit says the relayed address, whole.
        node.connectivity.advertiser.verdict = RELAY_ONLY
        node.connectivity.advertiser.relayed = (f"/ip4/198.18.0.10/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/"
                                                f"{node.peer_id}",)
        relayed = list(node.connectivity.advertiser.relayed)
        identify = _mk_identify_protobuf(node.host, None)
        assert [str(multiaddr.Multiaddr(b)) for b in identify.listen_addrs] == [bare(a) for a in relayed]
        assert bare(relayed[0]).endswith(f"/p2p/{RELAY}/p2p-circuit")  # the relay's id kept
        assert list(node.member_record().addrs) == relayed and node.advertised_addrs() == relayed
        # ... while DCUtR still sees the address it listens on (to bind its hole-punch dials).
        view = node.connectivity.dcutr.host
        assert isinstance(view, ListenView)
        assert [str(a) for a in view.get_addrs()] == [a.split("/p2p/")[0] for a in want]
        assert node.status().network["listen_addrs"] == want


def test_a_dht_answer_s_undialable_addresses_never_reach_the_peerstore() -> None:
    """``rpc._closer``: what a stranger's answer says of another peer is stored only where we could dial it."""
    me = new_host(key_pair=Identity.generate().key_pair)
    answer = Message()
    answer.type = Message.MessageType.GET_VALUE
    named = {}
    for name, addrs in (("home", ["/ip4/10.1.0.2/tcp/1", "/ip4/198.18.0.7/tcp/1"]),
                        ("public", ["/ip4/198.18.0.8/tcp/1"])):
        ident = Identity.generate()
        peer = ID.from_base58(ident.peer_id)
        entry = answer.closerPeers.add()
        entry.id = peer.to_bytes()
        entry.addrs.extend(multiaddr.Multiaddr(a).to_bytes() for a in addrs)
        envelope = create_signed_peer_record(peer, [multiaddr.Multiaddr(a) for a in addrs], ident.key_pair.private_key)
        entry.signedRecord = envelope.marshal_envelope()
        named[name] = peer
    assert set(_closer(me, answer, LAB)) == set(named.values())
    store = me.get_peerstore()
    assert [str(a) for a in store.addrs(named["home"])] == ["/ip4/198.18.0.7/tcp/1"]
    assert store.get_peer_record(named["home"]) is None  # its record names 10.1.0.2: not kept
    assert store.get_peer_record(named["public"]) is not None
    assert [str(a) for a in store.addrs(named["public"])] == ["/ip4/198.18.0.8/tcp/1"]


def test_a_get_providers_answer_passes_on_only_the_dialable_addresses_of_its_providers() -> None:
    """The provider entries py-libp2p builds inline from its provider store get the closer peers'
    rule (``PcpKadDHT._add_closer_peers_to_response``): a provider that announced before its
    verdict is not handed out at its private address."""
    from libp2p.kad_dht.kad_dht import DHTMode

    from pcp_p2p.dht.table import PcpKadDHT

    dht = PcpKadDHT(new_host(key_pair=Identity.generate().key_pair), DHTMode.SERVER, networks=LAB)
    ident = Identity.generate()
    peer = ID.from_base58(ident.peer_id)
    addrs = ["/ip4/10.1.0.2/tcp/1", "/ip4/0.0.0.0/tcp/1", "/ip4/198.18.0.7/tcp/1"]
    answer = Message()
    answer.type = Message.MessageType.GET_PROVIDERS
    entry = answer.providerPeers.add()
    entry.id = peer.to_bytes()
    entry.addrs.extend(multiaddr.Multiaddr(a).to_bytes() for a in addrs)
    entry.signedRecord = create_signed_peer_record(
        peer, [multiaddr.Multiaddr(a) for a in addrs], ident.key_pair.private_key).marshal_envelope()
    dht._add_closer_peers_to_response(answer, [], exclude_peer_id=None)  # an asker from nowhere we share
    (out,) = answer.providerPeers
    assert [str(multiaddr.Multiaddr(b)) for b in out.addrs] == ["/ip4/198.18.0.7/tcp/1"]
    assert not out.signedRecord  # it names the addresses held back: it cannot be trimmed
