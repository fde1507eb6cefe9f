"""A node behind a cone NAT, seen from the internet: no private address of its home anywhere (#14).

The home node (a real ``pcp node join`` process behind the lab's cone NAT)
connects to a public node before it knows it sits behind a NAT, so identify
first tells that node its private ``10.x`` address. Once the verdict and a relay
reservation are in, the home's identify push must replace it: the public node's
peerstore (what identify gave it) and the home's signed peer record hold the
relayed address and no private one; no routing table holds the home (reachable
only through its relay, it asks the DHT and is never asked), and the DHT's
FIND_NODE answers about it (asked by a third host, of the public node and of the
bootstrap server, which know it as a connected peer) name its relayed address
and no private one.

The public node runs in this process, inside its namespace (``run_in``), so its
peerstore can be read directly.
"""

from __future__ import annotations

import functools
import ipaddress
import time
from pathlib import Path
from typing import Any

import multiaddr
import pytest
import trio
from conftest import TEST_CAPS
from libp2p import new_host
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.envelope import consume_envelope
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from pcp_p2p.core.errors import PcpError
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.rpc import kad_request
from pcp_p2p.net.reachability import HOLE_PUNCHABLE
from pcp_p2p.node.node import NodeConfig, open_node
from pcp_p2p.testing.netlab import Host, Lab, LabProcess, Nat, netlab, run_in, unavailable

needs_lab = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")


def private(addrs: list[str]) -> list[str]:
    """The addresses that name a machine inside some home (not public, not a relay's circuit)."""
    out = []
    for a in addrs:
        try:
            ip = ipaddress.ip_address(multiaddr.Multiaddr(a).value_for_protocol("ip4"))
        except Exception:
            continue
        if (ip.is_private and ip not in ipaddress.ip_network("198.18.0.0/15")) or ip.is_unspecified:
            out.append(a)
    return out


def wait_relayed(lab: Lab, home: Host, proc: LabProcess, deadline_s: float) -> dict[str, Any]:
    """The home node's status once its verdict is hole-punchable and a relay granted a slot (polled:
    another process, no event to wait on; bounded)."""
    deadline = time.monotonic() + deadline_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = lab.status(home, proc.addr, timeout=5.0)
            if last["network"]["reachability"] == HOLE_PUNCHABLE and last["network"]["relayed_addrs"]:
                return dict(last)
        except PcpError as exc:
            last = str(exc)
        time.sleep(0.5)
    raise AssertionError(f"no verdict and reservation within {deadline_s:.0f} s: {str(last)[:800]}\n"
                         f"{proc.log_tail(1500)}")


async def find_node(asker_ip: str, answerer: str, target: ID) -> list[str]:
    """FIND_NODE ``target`` asked of the node at ``answerer`` by a fresh host: the addresses (and those
    of the signed peer record) its answer gives for ``target``."""
    host = new_host(key_pair=Identity.generate().key_pair)
    info = info_from_p2p_addr(multiaddr.Multiaddr(answerer))
    async with host.run(listen_addrs=[multiaddr.Multiaddr(f"/ip4/{asker_ip}/tcp/0")]):
        with trio.fail_after(20):
            await host.connect(info)
            request = Message()
            request.type = Message.MessageType.FIND_NODE
            request.key = target.to_bytes()
            answer = await kad_request(host, info.peer_id, request)
    out: list[str] = []
    for entry in answer.closerPeers:
        if entry.id != target.to_bytes():
            continue
        out.extend(str(multiaddr.Multiaddr(b)) for b in entry.addrs)
        if entry.signedRecord:
            _env, record = consume_envelope(entry.signedRecord, "libp2p-peer-record")
            out.extend(str(a) for a in record.addrs)
    return out


@needs_lab
@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_internet_never_sees_a_private_address_of_a_cone_home(tmp_path: Path) -> None:
    with netlab(tmp_path) as lab:
        boot_host, pub_host = lab.add_public("boot"), lab.add_public("pub")
        home = lab.add_home("cone", Nat.CONE)
        boot = lab.start_bootstrap(boot_host)
        found: dict[str, Any] = {}

        async def public_node() -> None:
            cfg = NodeConfig(tmp_path / "pub", listen=(f"/ip4/{pub_host.ip}/tcp/0",), bootstrap=(boot.addr,),
                             capabilities=TEST_CAPS, op_timeout=5.0)
            async with open_node(cfg) as pub:
                with trio.fail_after(30):
                    await pub.bootstrapped.wait()
                # The home bootstraps through both: it meets this node before it has a verdict.
                cone = await trio.to_thread.run_sync(
                    functools.partial(lab.start_node, home, [boot.addr, pub.addrs()[0]]))
                cone_id = ID.from_base58(cone.peer_id)
                status = await trio.to_thread.run_sync(wait_relayed, lab, home, cone, 60.0)
                relayed = status["network"]["relayed_addrs"][0]
                found["own"] = status["addrs"]
                found["private_ip"] = home.ip

                def known() -> list[str]:
                    return [str(a) for a in pub.host.get_peerstore().addrs(cone_id)]

                # What identify (then identify push) told this node; no event for it: polled, bounded.
                with trio.fail_after(60):
                    while relayed.rsplit("/p2p/", 1)[0] not in [a.rsplit("/p2p/", 1)[0] for a in known()]:  # noqa: ASYNC110
                        await trio.sleep(0.2)
                found["peerstore"] = known()
                envelope = pub.host.get_peerstore().get_peer_record(cone_id)
                found["peer_record"] = [str(a) for a in envelope.record().addrs] if envelope is not None else []
                found["table"] = [str(a) for i in pub.dht.routing_table.get_peer_infos()
                                  if i.peer_id == cone_id for a in i.addrs]
                # A third host on the internet asks the public node and the bootstrap server about it.
                found["find_node_pub"] = await find_node(pub_host.ip, pub.addrs()[0], cone_id)
                found["find_node_boot"] = await find_node(pub_host.ip, boot.addr, cone_id)

        run_in(pub_host.ns, trio.run, public_node)

    assert found["own"] and not private(found["own"]), found["own"]  # the home's own status: relayed only
    assert found["peerstore"] and not private(found["peerstore"]), found
    assert not private(found["peer_record"]), found
    # A home reachable only through its relay asks the DHT and is never asked: it is in no routing
    # table (pcp_p2p/dht/table.py). A node it is connected to still names it when asked for it
    # (py-libp2p's FIND_NODE answers with the target it knows): by its relayed address alone
    assert found["table"] == [], found
    for answer in ("find_node_pub", "find_node_boot"):
        assert found[answer], f"{answer}: the home is not named at all: {found}"
        assert not private(found[answer]), found
        assert any("/p2p-circuit" in a for a in found[answer]), found
    assert not any(found["private_ip"] in a for key in found if isinstance(found[key], list) for a in found[key])
