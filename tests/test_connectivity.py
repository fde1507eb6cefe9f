"""Reaching nodes behind NAT (issue #14 item 2): the verdict, relay reservations, relayed addresses, DCUtR.

The verdict is a pure function (tested here without a network); the rest runs
real ``pcp`` processes in the network lab (:mod:`pcp_p2p.testing.netlab`),
marked ``netlab``, skipped with one line where the lab cannot run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from pcp_p2p.core.errors import PcpError
from pcp_p2p.diloco.protocol.election import Candidate, ElectionConfig, eligible
from pcp_p2p.net.connectivity import (
    HOLE_PUNCHABLE,
    PUBLIC,
    RELAY_ONLY,
    UNKNOWN,
    Observation,
    PunchBackoff,
    RelayBudget,
    is_public_ip,
    split_addrs,
    verdict,
)
from pcp_p2p.net.reachability import known
from pcp_p2p.node.node import NodeConfig, transport_addrs
from pcp_p2p.testing.netlab import Host, Lab, LabProcess, LinkSpec, Nat, netlab, unavailable

needs_lab = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")
ME = "12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"
INET = "198.18.0.10"  # an observer on the lab's internet
RELAYED = f"/ip4/198.18.0.2/tcp/4001/p2p/{ME}/p2p-circuit/p2p/{ME}"


# --- the verdict, no network -----------------------------------------------------------------


def test_an_address_seen_as_our_own_is_public() -> None:
    assert verdict(["10.1.0.2"], [Observation("10.1.0.2", 5000, 5000, INET)]) == PUBLIC


def test_peers_in_the_same_home_say_nothing_about_the_internet() -> None:
    assert verdict(["10.1.0.2"], [Observation("10.1.0.2", 5000, 5000, "10.1.0.3")]) == UNKNOWN
    assert verdict(["10.1.0.2"], [Observation("10.1.0.2", 5000, 5000, "10.1.0.3"),
                                  Observation("198.18.1.1", 5000, 5000, INET)]) == HOLE_PUNCHABLE


def test_without_observations_only_a_public_ip_decides() -> None:
    assert verdict(["198.18.0.5"], []) == PUBLIC
    assert verdict(["127.0.0.1", "10.1.0.2"], []) == UNKNOWN


def test_behind_nat_a_kept_port_is_hole_punchable_and_changed_ports_relay_only() -> None:
    local = ["127.0.0.1", "10.1.0.2"]
    assert verdict(local, [Observation("198.18.1.1", 40000, 40000, INET)]) == HOLE_PUNCHABLE
    changed = [Observation("198.18.1.1", 61234, 40000, INET), Observation("198.18.1.1", 1030, 40002, INET)]
    assert verdict(local, changed) == RELAY_ONLY
    assert verdict(local, [Observation("198.18.1.1", 61234, None, INET)]) == UNKNOWN


def test_hole_punching_is_rearmed_after_a_doubling_back_off() -> None:
    backoff = PunchBackoff(first_s=30.0, max_s=100.0)
    assert not backoff.due("p", 0.0)  # first seen exhausted: wait first_s
    assert not backoff.due("p", 29.0)
    assert backoff.due("p", 30.0) and not backoff.due("p", 31.0)
    assert not backoff.due("p", 89.0) and backoff.due("p", 90.0)  # then 60 s
    assert backoff.due("p", 190.0)  # capped at max_s
    backoff.forget(set())  # direct now: a later relayed spell starts over
    assert not backoff.due("p", 1000.0)


def test_public_ips() -> None:
    assert is_public_ip("198.18.0.5") and is_public_ip("8.8.8.8")
    assert not any(is_public_ip(ip) for ip in ("10.0.0.1", "192.168.1.2", "127.0.0.1", "169.254.1.1", "x"))


def test_relayed_addresses_are_dialled_through_the_relay_never_as_the_relays_own() -> None:
    direct, circuit = split_addrs([f"/ip4/10.1.0.2/tcp/5000/p2p/{ME}", RELAYED, "garbage"])
    assert [str(a) for a in direct] == ["/ip4/10.1.0.2/tcp/5000"]
    assert [str(a) for a in circuit] == [RELAYED]
    # Stripping /p2p/ from a relayed address would leave the relay's: it is skipped instead.
    assert transport_addrs([RELAYED]) == []


def test_bootstrap_servers_relay_by_default_and_workers_do_not(tmp_path: Path) -> None:
    assert NodeConfig(tmp_path, role="bootstrap").relay is True
    assert NodeConfig(tmp_path).relay is False
    assert NodeConfig(tmp_path, relay=True).relay is True
    limits = RelayBudget().limits()
    assert limits.data <= 1 << 20 and limits.duration <= 300  # control traffic, not blobs


def test_a_stream_over_a_circuit_is_told_from_a_direct_one() -> None:
    """What the blob service refuses both ways: a stream whose connection runs through a relay."""
    from types import SimpleNamespace

    from pcp_p2p.net.connectivity import is_relayed, stream_is_relayed

    def conn(addr: str) -> SimpleNamespace:
        return SimpleNamespace(get_transport_addresses=lambda: [addr])

    relayed = conn("/ip4/198.18.0.10/tcp/4001/p2p/" + ME + "/p2p-circuit")
    direct = conn("/ip4/198.18.0.101/tcp/40000")
    assert is_relayed(relayed) and not is_relayed(direct)
    assert stream_is_relayed(SimpleNamespace(swarm_conn=relayed))
    assert not stream_is_relayed(SimpleNamespace(swarm_conn=direct))
    assert not stream_is_relayed(SimpleNamespace())  # no connection known: not refused for it


def test_a_relay_only_member_never_leads_and_public_ones_lead_when_there_are_any() -> None:
    cfg = ElectionConfig(min_uptime_s=0.0)
    view = [Candidate("pub", 10.0, reachability=PUBLIC), Candidate("cone", 10.0, reachability=HOLE_PUNCHABLE),
            Candidate("sym", 10.0, reachability=RELAY_ONLY)]
    assert eligible(view, cfg) == ["pub"]
    # No public candidate: cone homes lead, a relay-only node still never does.
    assert eligible(view[1:], cfg) == ["cone"]
    assert eligible(view[2:], cfg) == []
    # Nobody has judged (127.0.0.1 swarms: no public observer): everyone is eligible, as before.
    assert eligible([Candidate("a", 10.0), Candidate("b", 10.0)], cfg) == ["a", "b"]
    # The run machine hands members' verdicts to the election, a stranger's odd word as unknown.
    assert known("relay-only") == RELAY_ONLY and known("x" * 100) == UNKNOWN


# --- in the lab --------------------------------------------------------------------------------


def wait_status(lab: Lab, host: Host, proc: LabProcess, ok: Any, *, deadline_s: float) -> dict[str, Any]:
    """Poll ``proc``'s status (asked from ``host``) until ``ok(status)``; bounded, no cross-process event."""
    deadline = time.monotonic() + deadline_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = lab.status(host, proc.addr, timeout=5.0)
            if ok(last):
                return last
        except PcpError as exc:
            last = str(exc)
        time.sleep(0.5)
    raise AssertionError(f"{proc.name}: condition not met within {deadline_s:.0f} s; last status: "
                         f"{str(last)[:1500]}\nits log ends:\n{proc.log_tail(1500)}")


def wait_log(proc: LabProcess, text: str, *, deadline_s: float) -> bool:
    """Whether ``text`` shows up in ``proc``'s log within ``deadline_s`` (polled: another process)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if text in proc.log_tail(1_000_000):
            return True
        time.sleep(0.2)
    return False


def member(status: dict[str, Any], peer_id: str) -> dict[str, Any] | None:
    return next((m for m in status.get("members", []) if m["peer_id"] == peer_id), None)


def relayed_only(status: dict[str, Any], peer_id: str) -> bool:
    m = member(status, peer_id)
    return m is not None and bool(m["addrs"]) and all("/p2p-circuit/p2p/" + peer_id in a for a in m["addrs"])


@needs_lab
@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cone_and_symmetric_homes_are_reached_through_the_bootstrap_relay(tmp_path: Path) -> None:
    """Nodes behind either NAT kind reserve a slot on the bootstrap relay, advertise the relayed
    address instead of their private one, and a fresh host on the internet reaches them through it."""
    with netlab(tmp_path) as lab:
        boot_host, pub_host = lab.add_public("boot"), lab.add_public("pub")
        cone_home, sym_home = lab.add_home("cone", Nat.CONE, LinkSpec(delay_ms=10)), \
            lab.add_home("sym", Nat.SYMMETRIC, LinkSpec(delay_ms=10))
        boot = lab.start_bootstrap(boot_host)
        pub = lab.start_node(pub_host, [boot.addr])
        cone = lab.start_node(cone_home, [boot.addr])
        sym = lab.start_node(sym_home, [boot.addr])

        expected = {"pub": (pub, PUBLIC), "cone": (cone, HOLE_PUNCHABLE), "sym": (sym, RELAY_ONLY)}
        own = {name: wait_status(lab, p.host, p, lambda s, v=v: s["network"]["reachability"] == v
                                 and (v == PUBLIC or bool(s["network"]["relayed_addrs"])), deadline_s=60)
               for name, (p, v) in expected.items()}
        assert own["pub"]["network"]["relayed_addrs"] == [] and own["pub"]["network"]["relay_hop"] is False
        # ... and each said so in its start-up log, in one line (written once the bandwidth to the
        # bootstrap server is measured, a second or two after the verdict).
        for name, (p, v) in expected.items():
            assert wait_log(p, f"reachability: {v} (", deadline_s=30), name
        for name in ("cone", "sym"):
            assert own[name]["network"]["relayed_addrs"][0].startswith(f"{boot.addr}/p2p-circuit/p2p/")

        # Every view shows them at their relayed address only: never the private 10.x one.
        for viewer in (boot, pub):
            view = wait_status(lab, viewer.host, viewer,
                               lambda s: relayed_only(s, cone.peer_id) and relayed_only(s, sym.peer_id),
                               deadline_s=60)
            assert member(view, pub.peer_id)["addrs"][0].startswith(f"/ip4/{pub_host.ip}/")

        # A host on the internet that never met them reaches them through the relay.
        for name, p in (("cone", cone), ("sym", sym)):
            relayed = own[name]["network"]["relayed_addrs"][0]
            reply = lab.status(pub_host, relayed, timeout=20.0)
            assert reply["peer_id"] == p.peer_id
        # ... and the bootstrap server (a relay) says so of itself.
        assert lab.status(boot_host, boot.addr)["network"]["relay_hop"] is True
        assert all(p.running for p in (boot, pub, cone, sym))


@needs_lab
@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_cone_homes_upgrade_their_relayed_connection_to_a_direct_one(tmp_path: Path) -> None:
    """SWIM probes between two cone homes go through the relay first; DCUtR then punches a direct
    connection (its addresses are the other router's public ones, no /p2p-circuit)."""
    with netlab(tmp_path) as lab:
        boot_host = lab.add_public("boot")
        far = LinkSpec(delay_ms=20)
        alice_home, bob_home = lab.add_home("alice", Nat.CONE, far), lab.add_home("bob", Nat.CONE, far)
        boot = lab.start_bootstrap(boot_host)
        alice = lab.start_node(alice_home, [boot.addr])
        bob = lab.start_node(bob_home, [boot.addr])
        status = wait_status(lab, alice_home, alice,
                             lambda s: s["network"]["connections"].get(bob.peer_id) == "direct",
                             deadline_s=120)
        assert relayed_only(status, bob.peer_id)  # it was never given bob's private address to dial
        relayed = f"{boot.addr}/p2p-circuit/p2p/{alice.peer_id}"
        assert status["network"]["relayed_addrs"] == [relayed]
        assert status["network"]["reachability"] == HOLE_PUNCHABLE
        conns = lab.exec(alice_home, "ss", "-Htn", "state", "established").stdout
        assert bob_home.public_ip in conns  # a TCP connection straight to bob's router

        # The relay dies: alice stops advertising a relayed address nobody can use, and the
        # hole-punched connection to bob outlives it.
        assert boot.stop() == 0
        after = wait_status(lab, alice_home, alice, lambda s: s["network"]["relayed_addrs"] == [], deadline_s=40)
        assert after["network"]["connections"].get(bob.peer_id) == "direct"
        assert after["network"]["reachability"] == HOLE_PUNCHABLE  # still behind the same NAT
        # It comes back (same identity and port): alice reserves again.
        boot = lab.start_bootstrap(boot_host)
        wait_status(lab, alice_home, alice, lambda s: s["network"]["relayed_addrs"] == [relayed], deadline_s=40)


# --- pcp doctor ------------------------------------------------------------------------------


def test_doctor_words_follow_the_nodes_verdict() -> None:
    from pcp_p2p.node.doctor import ADVICE, judge

    assert judge(["10.1.0.2"], [], reached=False) == ("unreachable", "unknown")
    assert judge(["10.1.0.2"], [Observation("198.18.1.1", 4000, 4000, INET)], reached=True)[0] == "hole-punched"
    assert judge(["10.1.0.2"], [Observation("198.18.1.1", 6000, 4000, INET)], reached=True)[0] == "relay-only"
    assert judge(["198.18.0.5"], [Observation("198.18.0.5", 4000, 4000, INET)], reached=True)[0] == "reachable"
    assert set(ADVICE) >= {"reachable", "hole-punched", "relay-only", "unreachable"}


def test_the_speed_test_server_spends_a_bounded_budget() -> None:
    from pcp_p2p.node.doctor import SPEED_TESTS_PER_MIN, SpeedServer

    server = SpeedServer()
    assert all(server.admit(0.0) for _ in range(SPEED_TESTS_PER_MIN))
    assert not server.admit(30.0)  # the minute's budget is spent
    assert server.admit(60.0)  # and comes back a minute later


@needs_lab
@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pcp_doctor_tells_public_cone_and_symmetric_homes_apart_and_measures_their_links(tmp_path: Path) -> None:
    """`pcp doctor --json` run in each kind of home: the verdict, the NAT kind and the bandwidth to the
    bootstrap server and a public member, shaped at 8 Mbit/s up and 32 down."""
    from pcp_p2p.node.local_swarm import pcp_command

    with netlab(tmp_path) as lab:
        boot_host, pub_host = lab.add_public("boot"), lab.add_public("pub")
        link = LinkSpec(up_mbit=8, down_mbit=32)
        homes = {"reachable": lab.add_public("me", link), "hole-punched": lab.add_home("cone", Nat.CONE, link),
                 "relay-only": lab.add_home("sym", Nat.SYMMETRIC, link)}
        boot = lab.start_bootstrap(boot_host)
        pub = lab.start_node(pub_host, [boot.addr])
        lab.wait_member(boot_host, boot, pub.peer_id, deadline_s=30)
        for expected, host in homes.items():
            res = lab.exec(host, *pcp_command(), "doctor", "--bootstrap", boot.addr, "--json", check=False)
            assert res.returncode == 0, res.stderr[-2000:]
            report = json.loads(res.stdout)
            print(expected, report["nat"], [(p["up_mbit"], p["down_mbit"], p["error"]) for p in report["peers"]])
            assert report["reachability"] == expected, report
            measured = [p for p in report["peers"] if p["error"] is None]
            assert {p["peer_id"] for p in measured} == {boot.peer_id, pub.peer_id}, report["peers"]
            for p in measured:  # tbf lets a burst through first: loose bounds
                assert 0.4 * 8 < p["up_mbit"] < 2.0 * 8 and 0.3 * 32 < p["down_mbit"] < 2.0 * 32, p
        # A bootstrap that is not there: unreachable, exit status 1, the advice says what to check.
        gone = boot.addr.replace("/tcp/4001/", "/tcp/4999/")
        res = lab.exec(homes["hole-punched"], *pcp_command(), "doctor", "--bootstrap", gone, "--json",
                       "--timeout", "5", check=False)
        assert res.returncode == 1 and json.loads(res.stdout)["reachability"] == "unreachable"
