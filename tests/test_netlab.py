"""The network lab (issue #14): namespaces, NAT, shaped links, the delaying wire, real ``pcp`` in it.

Everything but the :class:`DelayLine` tests needs root, ``ip`` and ``iptables``
(``make test`` installs iptables when it can) and skips with one line otherwise.
Every lab here is torn down by :func:`netlab` however the test ends.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pcp_p2p.testing.netlab import (
    PREFIX,
    DelayLine,
    Host,
    Lab,
    LinkSpec,
    Nat,
    NetlabError,
    cleanup_leftovers,
    list_namespaces,
    netlab,
    read_line,
    socket_in,
    tcp_goodput_mbit,
    udp_round_trips,
    unavailable,
)

pytestmark = pytest.mark.netlab
needs_lab = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")


def mine() -> list[str]:
    return [ns for ns in list_namespaces() if ns.startswith(f"{PREFIX}{os.getpid()}-")]


# --- the wire's queueing rule, no namespaces needed ------------------------------------------


def test_delay_line_holds_each_frame_for_its_delay_in_order() -> None:
    line = DelayLine(0.040)
    line.push(b"a", now=1.000)
    line.push(b"b", now=1.010)
    assert line.due(1.039) == []
    assert line.next_due() == pytest.approx(1.040)
    assert line.due(1.045) == [b"a"]
    assert line.due(2.0) == [b"b"] and line.next_due() is None and line.passed == 2


def test_delay_line_loses_its_share_and_bounds_its_queue() -> None:
    lossy = DelayLine(0.0, loss=0.25, seed=7)
    kept = sum(lossy.push(b"x", now=0.0) for _ in range(4000))
    assert 0.22 < lossy.lost / 4000 < 0.28 and kept + lossy.lost == 4000
    full = DelayLine(1.0, max_frames=3)
    assert [full.push(b"x", now=0.0) for _ in range(5)] == [True, True, True, False, False]
    assert full.overflowed == 2
    with pytest.raises(ValueError):
        DelayLine(0.0, loss=1.0)


# --- the lab ---------------------------------------------------------------------------------


@needs_lab
def test_cone_home_dials_out_and_nothing_unsolicited_reaches_it() -> None:
    with netlab() as lab:
        boot, mallory = lab.add_public("boot"), lab.add_public("mallory")
        home = lab.add_home("alice", Nat.CONE)

        # A service in the home that nobody outside may reach.
        server = socket_in(home.ns)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((home.ip, 7000))
        server.listen(8)
        server.setblocking(False)
        udp = socket_in(home.ns, kind=socket.SOCK_DGRAM)
        udp.bind((home.ip, 5555))
        udp.settimeout(0.5)
        try:
            # Out: a TCP connection to the bootstrap arrives from the router's public address.
            listener = socket_in(boot.ns)
            listener.bind((boot.ip, 4001))
            listener.listen(1)
            listener.settimeout(5)
            out = socket_in(home.ns)
            out.settimeout(5)
            out.connect((boot.ip, 4001))
            accepted, peer = listener.accept()
            assert peer[0] == home.public_ip != home.ip
            for s in (accepted, out, listener):
                s.close()

            # Even a stranger with a route straight at the home's private address gets nothing in.
            lab.exec(mallory, "ip", "route", "add", "10.1.0.0/24", "via", home.public_ip)
            for target in ((home.ip, 7000), (home.public_ip, 7000)):
                probe = socket_in(mallory.ns)
                probe.settimeout(1.0)
                with pytest.raises(OSError):  # dropped (timeout) or refused by the router itself
                    probe.connect(target)
                probe.close()
            with pytest.raises(BlockingIOError):
                server.accept()

            # UDP: the bootstrap's answer to the home's packet comes back; the same packet from
            # anyone else to the same public port does not (port-restricted filtering).
            echo = socket_in(boot.ns, kind=socket.SOCK_DGRAM)
            echo.bind((boot.ip, 9000))
            echo.settimeout(5)
            udp.sendto(b"hello", (boot.ip, 9000))
            _, mapped = echo.recvfrom(100)
            assert mapped == (home.public_ip, 5555)  # Linux keeps the source port when it is free
            spoof = socket_in(mallory.ns, kind=socket.SOCK_DGRAM)
            spoof.sendto(b"unsolicited", mapped)
            echo.sendto(b"reply", mapped)
            assert udp.recvfrom(100) == (b"reply", (boot.ip, 9000))
            with pytest.raises(TimeoutError):
                udp.recvfrom(100)
            echo.close()
            spoof.close()
        finally:
            server.close()
            udp.close()


def public_ports_seen(lab: Lab, nat: Nat) -> tuple[set[str], list[int]]:
    """One home UDP socket sends to three public endpoints; the (address, port) each saw."""
    a, b = lab.add_public(f"a{nat.value[:3]}"), lab.add_public(f"b{nat.value[:3]}")
    home = lab.add_home(f"h{nat.value[:3]}", nat)
    sinks = []
    for host, port in ((a, 9000), (a, 9001), (b, 9000)):
        s = socket_in(host.ns, kind=socket.SOCK_DGRAM)
        s.bind((host.ip, port))
        s.settimeout(5)
        sinks.append((s, (host.ip, port)))
    sender = socket_in(home.ns, kind=socket.SOCK_DGRAM)
    sender.bind((home.ip, 5555))
    try:
        seen = []
        for s, dest in sinks:
            sender.sendto(b"x", dest)
            seen.append(s.recvfrom(10)[1])
        return {ip for ip, _ in seen}, [port for _, port in seen]
    finally:
        sender.close()
        for s, _ in sinks:
            s.close()


@needs_lab
def test_cone_nat_maps_one_port_for_every_destination_and_symmetric_a_new_one_each() -> None:
    with netlab() as lab:
        ips, ports = public_ports_seen(lab, Nat.CONE)
        assert len(ips) == 1 and len(set(ports)) == 1
        ips, ports = public_ports_seen(lab, Nat.SYMMETRIC)
        # A random port per connection: three equal ones would happen once in 4e9 runs.
        assert len(ips) == 1 and len(set(ports)) > 1, ports


def can_connect(src: Host, dst: Host, port: int, timeout: float = 0.5) -> bool:
    s = socket_in(src.ns)
    s.settimeout(timeout)
    try:
        s.connect((dst.ip, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


@needs_lab
def test_homes_behind_one_router_share_its_address_and_reach_each_other() -> None:
    with netlab() as lab:
        boot = lab.add_public("boot")
        router = lab.add_router("campus", Nat.SYMMETRIC)
        a, b = lab.add_home("a", router=router), lab.add_home("b", router=router)
        assert a.public_ip == b.public_ip == router.wan_ip and a.nat is b.nat is Nat.SYMMETRIC
        with pytest.raises(NetlabError):
            lab.add_home("c", Nat.CONE, router=router)
        listener = socket_in(b.ns)
        listener.bind((b.ip, 7000))
        listener.listen(1)
        try:
            assert can_connect(a, b, 7000)  # on the LAN: no NAT between them
            assert not can_connect(boot, b, 7000)
        finally:
            listener.close()


@needs_lab
def test_a_cut_partitions_the_network_and_heal_restores_it() -> None:
    with netlab() as lab:
        boot, other = lab.add_public("boot"), lab.add_public("other")
        home = lab.add_home("alice", Nat.CONE)
        listeners = []
        for host in (boot, other):
            s = socket_in(host.ns)
            s.bind((host.ip, 4001))
            s.listen(8)
            listeners.append(s)
        try:
            cut = lab.cut([home], [boot])
            assert not can_connect(home, boot, 4001)
            assert can_connect(home, other, 4001)  # only what the cut names is cut
            lab.heal(cut)
            assert can_connect(home, boot, 4001)
            assert lab.cuts == []
        finally:
            for s in listeners:
                s.close()


@needs_lab
def test_shaped_link_measures_near_its_rate_in_each_direction() -> None:
    with netlab() as lab:
        boot = lab.add_public("boot")
        home = lab.add_home("alice", link=LinkSpec(up_mbit=8, down_mbit=32))
        up = tcp_goodput_mbit(home, boot, 1_000_000, upload=True)  # ~1 s at 8 Mbit/s
        down = tcp_goodput_mbit(home, boot, 4_000_000, upload=False)  # ~1 s at 32 Mbit/s
        print(f"shaped 8/32 Mbit/s measured up {up:.1f}, down {down:.1f}")
        # tbf's bucket lets a little more than the rate through at the start; TCP gets ~95% after.
        assert 0.6 * 8 < up < 1.15 * 8
        assert 0.6 * 32 < down < 1.15 * 32


@needs_lab
def test_the_wire_adds_its_latency_and_loses_its_share() -> None:
    with netlab() as lab:
        boot = lab.add_public("boot")
        far = lab.add_home("far", link=LinkSpec(delay_ms=40))
        lossy = lab.add_home("lossy", link=LinkSpec(loss=0.2))
        rtts = udp_round_trips(far, boot, 6)
        assert None not in rtts
        print(f"40 ms each way: round trips {[round(r * 1000) for r in rtts if r is not None]} ms")
        assert min(r for r in rtts if r is not None) >= 0.080  # the first one also waits for ARP
        assert sorted(r for r in rtts if r is not None)[len(rtts) // 2] < 0.080 + 0.25  # loose: a loaded machine
        near = lab.add_home("near")  # no wire: no delay
        assert all(r is not None and r < 0.080 for r in udp_round_trips(near, boot, 3))

        probes = udp_round_trips(lossy, boot, 100, wait_s=0.03)  # no delay: an echo takes < 1 ms
        lost = sum(r is None for r in probes) / len(probes)
        # A probe is lost when either its packet or its echo is: 1 - 0.8**2 = 0.36.
        assert 0.2 < lost < 0.52, lost
        wire = lab.forwarders[-1]
        assert sum(line.lost for line in wire.lines.values()) > 0


@needs_lab
def test_lab_is_torn_down_on_error_and_dead_labs_are_found() -> None:
    with pytest.raises(RuntimeError):
        with netlab() as lab:
            lab.add_home("alice", link=LinkSpec(delay_ms=5))
            lab.popen(lab.hosts["alice"], ["sleep", "60"], name="sleeper")
            assert len(mine()) == 4  # inet, router, wire, home
            raise RuntimeError("a test failed half-way")
    assert mine() == []

    # A lab whose process died (SIGKILL: no finally ran) leaves a namespace and a process in it.
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True).stdout.strip()
    ns = f"{PREFIX}{dead}-dead-inet"
    Lab.run("ip", "netns", "add", ns)
    orphan = subprocess.Popen(["ip", "netns", "exec", ns, "sh", "-c", "echo in; exec sleep 60"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert orphan.stdout is not None and orphan.stdout.readline() == "in\n"  # it runs in there now
        with netlab() as live:  # opening a lab sweeps; its own namespaces survive the sweep
            assert ns not in list_namespaces()
            assert cleanup_leftovers() == [] and live.inet in list_namespaces()
        assert orphan.wait(timeout=5) != 0  # killed by the sweep
    finally:
        if orphan.poll() is None:
            orphan.kill()
        Lab.run("ip", "netns", "del", ns, check=False)


@needs_lab
def test_bad_host_names_are_refused() -> None:
    with netlab() as lab:
        lab.add_public("boot")
        lab.add_home("alice")
        for bad in ("boot", "Boot", "a-b", "alice-nat", "inet", "x" * 17):
            with pytest.raises(NetlabError):
                lab.add_public(bad)


# --- real pcp processes in the lab -----------------------------------------------------------


@needs_lab
@pytest.mark.timeout(120)
def test_node_behind_cone_nat_joins_a_public_bootstrap(tmp_path: Path) -> None:
    """A real ``pcp bootstrap`` on the internet and a real ``pcp node join`` in a NATed home."""
    with netlab(tmp_path) as lab:  # the processes' logs stay in tmp_path for a failed run
        boot_host = lab.add_public("boot")
        home = lab.add_home("alice", Nat.CONE, LinkSpec(up_mbit=20, down_mbit=100))
        boot = lab.start_bootstrap(boot_host)
        assert boot.addr.startswith(f"/ip4/{boot_host.ip}/tcp/4001/p2p/")
        node = lab.start_node(home, [boot.addr])

        lab.wait_member(boot_host, boot, node.peer_id, deadline_s=30)
        # Behind the NAT it reserves a slot on the bootstrap relay and advertises the relayed
        # address instead of its private one (tests/test_connectivity.py has the rest).
        relayed = f"{boot.addr}/p2p-circuit/p2p/{node.peer_id}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # no cross-process event for "record updated": poll, bounded
            status = lab.status(boot_host, boot.addr)
            member = next(m for m in status["members"] if m["peer_id"] == node.peer_id)
            if member["addrs"] == [relayed]:
                break
            time.sleep(0.5)
        assert member["addrs"] == [relayed]
        # The bootstrap's end of the connection is the router's public address, never the home's.
        conns = lab.exec(boot_host, "ss", "-Htn", "state", "established", "sport", "= :4001").stdout
        assert home.public_ip in conns and home.ip not in conns
        # The node answers `pcp status` inside its home.
        assert lab.pcp_status(home, node.addr)["peer_id"] == node.peer_id
        assert node.running and boot.running
        assert node.stop() == 0  # SIGTERM inside the namespace: a clean exit
    assert not boot.running


@needs_lab
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_public_cone_and_symmetric_nodes_on_long_lossy_links_all_see_each_other(tmp_path: Path) -> None:
    """Membership today, before any NAT traversal: every node behind either NAT kind, on a
    40 ms link that loses 1%, is a member in every view (through the connections it opened)."""
    with netlab(tmp_path) as lab:
        boot_host = lab.add_public("boot")
        far = LinkSpec(up_mbit=20, down_mbit=100, delay_ms=40)
        hosts = [lab.add_public("pub"), lab.add_home("cone", Nat.CONE, far),
                 lab.add_home("sym", Nat.SYMMETRIC, LinkSpec(20, 100, 40, loss=0.01))]
        boot = lab.start_bootstrap(boot_host)
        nodes = [lab.start_node(h, [boot.addr]) for h in hosts]
        for viewer in [boot, *nodes]:
            for member in nodes:
                lab.wait_member(viewer.host, viewer, member.peer_id, deadline_s=60)
        assert all(n.running for n in nodes)


@needs_lab
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_py_libp2p_hole_punches_through_cone_nats_and_not_a_symmetric_one(tmp_path: Path) -> None:
    """The lab's NATs against the real thing: py-libp2p 0.8.1's relay v2 + DCUtR turn a relayed
    connection between two cone homes into a direct one; towards a symmetric home they cannot."""
    probe = [sys.executable, "-m", "pcp_p2p.testing.netlab_punch"]
    with netlab(tmp_path) as lab:
        relay_host = lab.add_public("relay")
        far = LinkSpec(delay_ms=20)
        alice, bob, sym = (lab.add_home("alice", Nat.CONE, far), lab.add_home("bob", Nat.CONE, far),
                           lab.add_home("sym", Nat.SYMMETRIC, far))
        relay_addr = read_line(lab.popen(relay_host, [*probe, "relay", relay_host.ip], name="relay"))
        targets = {}
        for host in (bob, sym):
            line = read_line(lab.popen(host, [*probe, "listen", host.ip, relay_addr], name=host.name))
            targets[host.name] = line.split()[-1]
        results = {}
        for name, target in targets.items():
            # DCUtR: 3 rounds of 5 s + 2 s
            dialer = lab.popen(alice, [*probe, "dial", alice.ip, relay_addr, target, "30"], name=f"to-{name}")
            assert read_line(dialer).startswith("RESERVED")
            results[name] = json.loads(read_line(dialer, 90))
            dialer.stop()
        print(results)
        assert results["bob"]["direct"], results["bob"]
        assert any(f"/ip4/{bob.public_ip}/tcp/" in a for c in results["bob"]["connections"] for a in c)
        assert not results["sym"]["direct"], results["sym"]
