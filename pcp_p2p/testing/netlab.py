"""A planet on one machine: network namespaces with NAT, shaped links, latency and loss.

Tests and benchmarks build the network volunteers sit in (home NATs, asymmetric
links, an ocean between them) out of Linux network namespaces, and run real
``pcp`` processes inside it. Topology (addresses are fixed per lab; labs do not
see each other, so parallel labs may reuse them)::

    public host "boot" 198.18.0.10 --+
    public host ...    198.18.0.11 --+-- bridge br0 in the "inet" namespace
    router r1 wan      198.18.0.101 -+        (198.18.0.0/24: the benchmarking range)
      NAT (cone | symmetric) + stateful firewall
    router r1 lan      10.1.0.1
       |  (optional "wire": a user-space forwarder adding delay and loss)
    home "alice" eth0  10.1.0.2, default route via 10.1.0.1

- **NAT.** ``Nat.CONE`` is Linux ``MASQUERADE``: endpoint-independent mapping (a
  home socket keeps one public port whatever it talks to; the kernel keeps the
  source port when free) with address-and-port-dependent filtering (a
  "port-restricted cone", what most home routers do, and hole-punchable).
  ``Nat.SYMMETRIC`` is ``MASQUERADE --random-fully``: a fresh random public port
  for every new connection, so each destination sees a different one. Every
  router drops, silently, each packet from the wan side that does not belong
  to a connection its homes opened, even one routed straight at a home's
  address, and never answers one itself (RFC 5382 REQ-4: a RST for an early
  SYN would break TCP hole punching). Several homes may share one router
  (:meth:`Lab.add_router`); they reach each other on its LAN.
- **Partitions.** :meth:`Lab.cut` drops traffic between two sets of hosts,
  :meth:`Lab.heal` lets it through again.
- **Rate limits** are ``tc tbf`` on each end of a link: the home end's egress is
  the uplink, the other end's egress the downlink, so a link can be asymmetric.
- **Latency and loss** come from user space, since this kernel has no ``netem``:
  a link with delay or loss gets a third namespace in the middle (the *wire*)
  whose two interfaces carry no address; :class:`WireForwarder` reads every
  Ethernet frame from one with an ``AF_PACKET`` socket and writes it to the
  other after the delay, dropping a seeded-random share. Being a wire, not a
  proxy, it is transparent to TCP, UDP, NAT and hole punching. It runs in two
  **threads** per link (one per direction) rather than trio tasks, because it
  serves synchronous tests and trio tests alike and must keep forwarding while
  a trio test blocks in a subprocess call; a thread enters a namespace with
  ``setns(2)``, which is per thread (:func:`inside`). Frames must be plain
  Ethernet frames with valid checksums, so the interfaces that send into a wire
  have checksum offload, TSO, GSO and GRO switched off (``SIOCETHTOOL``; no
  ``ethtool`` binary needed).
- **Processes.** :meth:`Lab.popen` runs any command in a namespace with
  ``ip netns exec``, in a session of its own; :meth:`Lab.start_bootstrap` and
  :meth:`Lab.start_node` run ``pcp bootstrap`` / ``pcp node join`` and wait for
  the multiaddr each prints when it listens.
- **Teardown.** :func:`netlab` is a context manager; on every exit path it
  stops the processes (SIGTERM, then SIGKILL), the forwarders and deletes
  every namespace (which removes their interfaces, qdiscs and iptables rules).
  Namespace names start with ``pcplab-<pid>-<tag>-``; a lab that was killed
  before its ``finally`` ran leaves namespaces whose pid is gone, and
  :func:`cleanup_leftovers` (called whenever a lab opens) kills what runs in
  them and deletes them. Labs of other live processes are left alone.

Everything here needs root, ``ip`` and ``iptables``; :func:`unavailable` says
in one line why a lab cannot be built, for tests to skip with.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import json
import os
import random
import re
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from pcp_p2p.core.errors import LocalError, PcpError, PeerTimeout
from pcp_p2p.node.local_swarm import pcp_command

T = TypeVar("T")

PREFIX = "pcplab-"
PUBLIC_NET = "198.18.0"  # RFC 2544 benchmarking range: never a real host
NETNS_DIR = Path("/run/netns")
START_TIMEOUT_S = 60.0


class NetlabError(LocalError):
    """A lab could not be built or driven (a command failed, a process did not start)."""


class Nat(Enum):
    """How a router maps its homes' connections to its public address."""

    CONE = "cone"  # endpoint-independent mapping, port-restricted filtering
    SYMMETRIC = "symmetric"  # a random public port per connection


# ---------------------------------------------------------------------------
# Preconditions and leftovers


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why no lab can be built here (one line), or None when one can.

    Beyond root and the tools on PATH, it builds a namespace and lists its NAT
    table once (cached), so a kernel without netns or nf_tables says so here
    rather than failing half-way through a test.
    """
    if os.geteuid() != 0:
        return "netlab needs root (network namespaces, iptables)"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"netlab needs `{tool}` on PATH (Debian: apt-get install -y iproute2 iptables)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
        if made.returncode != 0:
            return f"netlab: cannot create a network namespace: {made.stderr.strip()}"
        nat = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L", "-n"],
                             capture_output=True, text=True, check=False)
        if nat.returncode != 0:
            return f"netlab: iptables NAT does not work here: {nat.stderr.strip().splitlines()[-1:]}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _pid_of_lab(ns: str) -> int | None:
    m = re.match(rf"{re.escape(PREFIX)}(\d+)-", ns)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    """Every network namespace name on the machine (``ip netns list``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_and_delete(names: Sequence[str]) -> None:
    """Kill every process inside the namespaces ``names``, then delete them."""
    for ns in names:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
        for pid in pids.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def cleanup_leftovers() -> list[str]:
    """Remove the namespaces of labs whose process is gone; return their names.

    A lab's process is recorded in its namespaces' names, so a lab still running
    in another process (another test session) is never touched.
    """
    stale = [ns for ns in list_namespaces()
             if ns.startswith(PREFIX) and (pid := _pid_of_lab(ns)) is not None and not _alive(pid)]
    _kill_and_delete(stale)
    return stale


# ---------------------------------------------------------------------------
# Entering a namespace from a thread

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetlabError(f"setns failed: {os.strerror(err)}")


@contextmanager
def inside(ns: str) -> Iterator[None]:
    """Run the block with the *calling thread* in namespace ``ns``.

    ``setns(2)`` with ``CLONE_NEWNET`` moves one thread only, and a socket stays
    in the namespace it was created in, so tests create sockets here and use
    them anywhere. The block must not yield to other code on the same thread
    (no ``await`` inside): it would run in the wrong namespace.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(NETNS_DIR / ns, os.O_RDONLY)
    except FileNotFoundError:
        os.close(own)
        raise NetlabError(f"no network namespace {ns!r}") from None
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


def run_in(ns: str, fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn(*args)`` on a fresh thread that lives in namespace ``ns``; return its result.

    For code that opens sockets as it goes (a whole ``trio.run`` of a libp2p
    client), where :func:`inside` around one call is not enough.
    """
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            with inside(ns):
                box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=body, name=f"in-{ns}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def socket_in(ns: str, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A socket that lives in namespace ``ns`` (usable from any thread)."""
    with inside(ns):
        return socket.socket(family, kind)


# ---------------------------------------------------------------------------
# Offloads: frames through a user-space wire must be whole and checksummed

_SIOCETHTOOL = 0x8946
_ETHTOOL_SET = {"tx-checksum": 0x17, "scatter-gather": 0x19, "tso": 0x1F, "gso": 0x24, "gro": 0x2C}


def _set_offloads_off(ifname: str) -> None:
    """Switch checksum offload, TSO, GSO and GRO off on ``ifname`` (calling thread's namespace).

    With them on, a veth hands a raw socket 64 KB super-frames whose TCP
    checksum is not filled in; forwarded as they are, the other side drops them.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name, cmd in _ETHTOOL_SET.items():
            value = ctypes.create_string_buffer(struct.pack("II", cmd, 0))
            ifreq = struct.pack("16sP", ifname.encode(), ctypes.addressof(value)).ljust(40, b"\0")
            try:
                fcntl.ioctl(s.fileno(), _SIOCETHTOOL, ifreq)
            except OSError as e:
                if name in ("tx-checksum", "tso", "gso"):
                    raise NetlabError(f"cannot switch {name} off on {ifname}: {e}") from None


# ---------------------------------------------------------------------------
# The wire: delay and loss in user space


class DelayLine:
    """One direction of a wire: frames leave ``delay_s`` after they came, some never.

    Sans-IO (time is passed in), so the queueing rule is tested without sockets.
    A constant delay keeps frames in order, as a cable does. The queue is
    bounded like a router's buffer: beyond ``max_frames`` new frames are dropped.
    """

    def __init__(self, delay_s: float, loss: float = 0.0, *, seed: int = 0, max_frames: int = 20_000) -> None:
        if delay_s < 0 or not 0.0 <= loss < 1.0:
            raise ValueError(f"delay_s >= 0 and 0 <= loss < 1 required, got {delay_s}, {loss}")
        self.delay_s = delay_s
        self.loss = loss
        self.max_frames = max_frames
        self._rng = random.Random(seed)
        self._queue: deque[tuple[float, bytes]] = deque()
        self.passed = 0
        self.lost = 0
        self.overflowed = 0

    def push(self, frame: bytes, now: float) -> bool:
        """Take a frame that arrived at ``now``; False when it is lost or the queue is full."""
        if self.loss and self._rng.random() < self.loss:
            self.lost += 1
            return False
        if len(self._queue) >= self.max_frames:
            self.overflowed += 1
            return False
        self._queue.append((now + self.delay_s, frame))
        return True

    def due(self, now: float) -> list[bytes]:
        """The frames whose time has come, oldest first (removed from the line)."""
        out: list[bytes] = []
        while self._queue and self._queue[0][0] <= now:
            out.append(self._queue.popleft()[1])
        self.passed += len(out)
        return out

    def next_due(self) -> float | None:
        """When the oldest frame is due, or None when the line is empty."""
        return self._queue[0][0] if self._queue else None


_ETH_P_ALL = 0x0003
_SOL_PACKET = 263
_PACKET_IGNORE_OUTGOING = 23
_PACKET_OUTGOING = 4
_MAX_FRAME = 65536


def _packet_socket(ifname: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
    s.bind((ifname, _ETH_P_ALL))
    try:
        s.setsockopt(_SOL_PACKET, _PACKET_IGNORE_OUTGOING, 1)
    except OSError:
        pass  # older kernels: outgoing frames are filtered by pkttype below
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.setblocking(False)
    return s


class WireForwarder:
    """Two interfaces of a wire namespace joined in user space, one thread per direction."""

    def __init__(self, ns: str, if_a: str, if_b: str, a_to_b: DelayLine, b_to_a: DelayLine) -> None:
        self.ns = ns
        with inside(ns):
            self._a = _packet_socket(if_a)
            self._b = _packet_socket(if_b)
        self.lines = {"a_to_b": a_to_b, "b_to_a": b_to_a}
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._pump, args=(self._a, self._b, a_to_b), name=f"wire-{ns}-ab", daemon=True),
            threading.Thread(target=self._pump, args=(self._b, self._a, b_to_a), name=f"wire-{ns}-ba", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, line: DelayLine) -> None:
        poller = select.poll()
        poller.register(src.fileno(), select.POLLIN)
        while not self._stop.is_set():
            nxt = line.next_due()
            wait_s = 0.05 if nxt is None else max(0.0, min(0.05, nxt - time.monotonic()))
            if poller.poll(wait_s * 1000):
                now = time.monotonic()
                while True:
                    try:
                        frame, addr = src.recvfrom(_MAX_FRAME)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        return  # socket closed by stop()
                    if addr[2] != _PACKET_OUTGOING:
                        line.push(frame, now)
            for frame in line.due(time.monotonic()):
                try:
                    dst.send(frame)
                except (BlockingIOError, InterruptedError):
                    line.overflowed += 1  # the next hop's queue is full: a drop, as on a real link
                except OSError:
                    return

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        self._a.close()
        self._b.close()


# ---------------------------------------------------------------------------
# The lab


@dataclass(frozen=True)
class LinkSpec:
    """What a link between a host and the network does, per direction.

    ``up`` is from the host (home or public host) towards the internet, ``down``
    the other way. Rates in Mbit/s (None: unlimited); delay in ms and loss as a
    fraction, per direction (each applied once, on the wire).
    """

    up_mbit: float | None = None
    down_mbit: float | None = None
    delay_ms: float = 0.0
    loss: float = 0.0

    @property
    def needs_wire(self) -> bool:
        return self.delay_ms > 0 or self.loss > 0


@dataclass
class Host:
    """A namespace with one address where processes run: a public host or a home."""

    name: str
    ns: str
    ip: str
    nat: Nat | None = None  # None: a public host
    router: Router | None = None
    public_ip: str = ""  # the router's wan address for a home, else ``ip``


@dataclass
class Router:
    """A NAT router: ``wan_ip`` on the internet, LAN ``<lan_prefix>.0.0/24`` (gateway ``.1``)."""

    name: str
    ns: str
    wan_ip: str
    lan_prefix: str
    nat: Nat
    homes: int = 0


@dataclass
class Cut:
    """The rules of one partition, as ``(namespace, iptables rule)``; see :meth:`Lab.cut`."""

    rules: list[tuple[str, tuple[str, ...]]]


@dataclass
class LabProcess:
    """A process the lab started in a namespace."""

    name: str
    host: Host
    popen: subprocess.Popen[bytes]
    log_path: Path
    addr: str = ""
    peer_id: str = ""
    data_dir: Path | None = None
    pending: bytes = field(default=b"", repr=False)  # stdout read past the last line taken

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signum)
            except ProcessLookupError:
                pass

    def stop(self, signum: int | None = None, timeout_s: float = 20.0) -> int:
        """Signal the process's group (default SIGTERM) and wait for it (SIGKILL after ``timeout_s``); its exit code."""
        self.signal(signal.SIGTERM if signum is None else signum)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.popen.wait(timeout=10)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""


def _rate(mbit: float) -> str:
    return f"{int(mbit * 1_000_000)}bit"


def _burst_bytes(mbit: float) -> int:
    # 5 ms of traffic, at least a few full frames: a smaller bucket cannot reach the rate.
    return max(16 * 1024, int(mbit * 1_000_000 / 8 * 0.005))


class Lab:
    """A topology of namespaces; use :func:`netlab` so it is always torn down."""

    def __init__(self, root: Path, tag: str | None = None) -> None:
        why = unavailable()
        if why is not None:
            raise NetlabError(why)
        cleanup_leftovers()
        self.root = root
        self.prefix = f"{PREFIX}{os.getpid()}-{tag or secrets.token_hex(3)}-"
        self.namespaces: list[str] = []
        self.hosts: dict[str, Host] = {}
        self.routers: dict[str, Router] = {}
        self.names: set[str] = set()  # hosts' and routers' (each is a namespace)
        self.cuts: list[Cut] = []
        self.processes: list[LabProcess] = []
        self.forwarders: list[WireForwarder] = []
        self._next_public = 10
        self._next_router = 1
        self._next_port = 0
        try:
            self.inet = self._netns("inet")
            self._ip(self.inet, "link", "add", "br0", "type", "bridge")
            self._ip(self.inet, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    # -- commands -----------------------------------------------------------

    @staticmethod
    def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command on the machine; a failure is a :class:`NetlabError` with its stderr."""
        res = subprocess.run(list(argv), capture_output=True, text=True, check=False)
        if check and res.returncode != 0:
            raise NetlabError(f"`{' '.join(argv)}` failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def _ip(self, ns: str, *args: str) -> None:
        self.run("ip", "-n", ns, *args)

    def exec(self, host: Host | str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command inside a host's namespace (or a namespace by name) and wait for it."""
        ns = host.ns if isinstance(host, Host) else host
        return self.run("ip", "netns", "exec", ns, *argv, check=check)

    def _netns(self, role: str) -> str:
        name = f"{self.prefix}{role}"
        self.run("ip", "netns", "add", name)
        self.namespaces.append(name)
        self._ip(name, "link", "set", "lo", "up")
        with inside(name):  # /proc/sys/net answers for the opening thread's namespace
            for knob in ("all", "default"):
                Path(f"/proc/sys/net/ipv6/conf/{knob}/disable_ipv6").write_text("1\n")
        return name

    def _veth(self, ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
        self._ip(ns_a, "link", "add", if_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
        self._ip(ns_a, "link", "set", if_a, "up")
        self._ip(ns_b, "link", "set", if_b, "up")

    def _shape(self, ns: str, ifname: str, mbit: float | None) -> None:
        if mbit is None:
            return
        self._ip_tc(ns, "qdisc", "replace", "dev", ifname, "root", "tbf", "rate", _rate(mbit),
                    "burst", str(_burst_bytes(mbit)), "latency", "100ms")

    def _ip_tc(self, ns: str, *args: str) -> None:
        self.run("ip", "netns", "exec", ns, "tc", *args)

    def _link(self, host_ns: str, host_if: str, net_ns: str, net_if: str, spec: LinkSpec, wire_role: str) -> None:
        """Join a host to the network side, through a wire namespace when the link delays or loses."""
        if not spec.needs_wire:
            self._veth(host_ns, host_if, net_ns, net_if)
        else:
            wire = self._netns(wire_role)
            self._veth(host_ns, host_if, wire, "wa")
            self._veth(net_ns, net_if, wire, "wb")
            for ns, ifname in ((host_ns, host_if), (net_ns, net_if), (wire, "wa"), (wire, "wb")):
                with inside(ns):
                    _set_offloads_off(ifname)
            seed = len(self.forwarders)
            delay = spec.delay_ms / 1000
            self.forwarders.append(WireForwarder(
                wire, "wa", "wb",
                DelayLine(delay, spec.loss, seed=2 * seed), DelayLine(delay, spec.loss, seed=2 * seed + 1)))
        self._shape(host_ns, host_if, spec.up_mbit)
        self._shape(net_ns, net_if, spec.down_mbit)

    # -- topology -----------------------------------------------------------

    def add_public(self, name: str, link: LinkSpec = LinkSpec()) -> Host:
        """A host with a public address on the internet bridge (a bootstrap server, a public node)."""
        self._check_name(name)
        ip = f"{PUBLIC_NET}.{self._next_public}"
        self._next_public += 1
        ns = self._netns(name)
        port = f"p{self._next_port}"
        self._next_port += 1
        self._link(ns, "eth0", self.inet, port, link, f"{name}-wire")
        self._ip(self.inet, "link", "set", port, "master", "br0")
        self._ip(ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        host = Host(name, ns, ip, public_ip=ip)
        self.hosts[name] = host
        self.names.add(name)
        return host

    def add_router(self, name: str, nat: Nat = Nat.CONE) -> Router:
        """A NAT router on the internet with an empty LAN (a bridge) that homes join.

        Its uplink is unshaped: a home's bottleneck is its own access link.
        """
        self._check_name(name)
        return self._router(name, nat)

    def _router(self, name: str, nat: Nat) -> Router:
        i = self._next_router
        if i > 89:
            raise NetlabError("at most 89 routers per lab")
        self._next_router += 1
        ns = self._netns(name)
        wan_ip = f"{PUBLIC_NET}.{100 + i}"
        port = f"p{self._next_port}"
        self._next_port += 1
        self._veth(ns, "wan", self.inet, port)
        self._ip(self.inet, "link", "set", port, "master", "br0")
        self._ip(ns, "addr", "add", f"{wan_ip}/24", "dev", "wan")
        self._ip(ns, "link", "add", "lan", "type", "bridge")
        self._ip(ns, "link", "set", "lan", "up")
        self._ip(ns, "addr", "add", f"10.{i}.0.1/24", "dev", "lan")
        with inside(ns):
            Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        masq = ["-j", "MASQUERADE"] + (["--random-fully"] if nat is Nat.SYMMETRIC else [])
        ipt = ("ip", "netns", "exec", ns, "iptables")
        self.run(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", *masq)
        # MASQUERADE only rewrites: without the FORWARD rules, a stranger routing 10.i.0.0/24 at wan
        # walks in. The INPUT rules make the router silent to unsolicited packets, as RFC 5382 REQ-4
        # asks ("MUST NOT respond to an unsolicited inbound SYN" for 6 s): a RST from the router for a
        # peer's early SYN would kill a TCP hole punch (simultaneous open), measured here.
        for chain in ("FORWARD", "INPUT"):
            self.run(*ipt, "-A", chain, "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                     "-j", "ACCEPT")
            self.run(*ipt, "-A", chain, "-i", "wan", "-j", "DROP")
        router = Router(name, ns, wan_ip, f"10.{i}", nat)
        self.routers[name] = router
        self.names.add(name)
        return router

    def add_home(self, name: str, nat: Nat | None = None, link: LinkSpec = LinkSpec(), *,
                 router: Router | None = None) -> Host:
        """A home behind a NAT router: a router of its own (kind ``nat``), or ``router``'s LAN.

        ``link`` is the home's access link (home <-> router), where a volunteer's
        bottleneck and distance are. Homes behind one router reach each other
        on its LAN directly, as in a house or a campus.
        """
        self._check_name(name)
        if router is None:
            router = self._router(f"{name}-nat", nat or Nat.CONE)  # '-': never a user's name
        elif nat is not None and nat is not router.nat:
            raise NetlabError(f"{name}: router {router.name} is {router.nat.value}, not {nat.value}")
        router.homes += 1
        if router.homes > 250:
            raise NetlabError(f"router {router.name} has no address left")
        home_ip = f"{router.lan_prefix}.0.{1 + router.homes}"
        ns = self._netns(name)
        port = f"h{router.homes}"
        self._link(ns, "eth0", router.ns, port, link, f"{name}-wire")
        self._ip(router.ns, "link", "set", port, "master", "lan")
        self._ip(ns, "addr", "add", f"{home_ip}/24", "dev", "eth0")
        self._ip(ns, "route", "add", "default", "via", f"{router.lan_prefix}.0.1")
        host = Host(name, ns, home_ip, nat=router.nat, router=router, public_ip=router.wan_ip)
        self.hosts[name] = host
        self.names.add(name)
        return host

    def cut(self, side_a: Sequence[Host], side_b: Sequence[Host]) -> Cut:
        """Drop every packet between the hosts of ``side_a`` and those of ``side_b`` (a partition).

        The rules sit in each side-A host's own namespace and match both the
        private and the public address of each side-B host, so the cut holds
        through NAT and between homes on one LAN; seen from outside, homes behind
        one router share its address and are cut together. Open connections stall
        rather than close, as in a real partition. :meth:`heal` undoes it.
        """
        if {h.name for h in side_a} & {h.name for h in side_b}:
            raise NetlabError("a host cannot be on both sides of a cut")
        rules: list[tuple[str, tuple[str, ...]]] = []
        for a in side_a:
            for addr in sorted({x for b in side_b for x in (b.ip, b.public_ip)}):
                rules.append((a.ns, ("INPUT", "-s", addr, "-j", "DROP")))
                rules.append((a.ns, ("OUTPUT", "-d", addr, "-j", "DROP")))
        done = Cut([])
        self.cuts.append(done)
        for ns, (chain, *spec) in rules:
            self.run("ip", "netns", "exec", ns, "iptables", "-I", chain, *spec)
            done.rules.append((ns, (chain, *spec)))
        return done

    def heal(self, cut: Cut) -> None:
        """Remove a cut's rules: packets flow again (connections that timed out meanwhile stay closed)."""
        for ns, (chain, *spec) in cut.rules:
            self.run("ip", "netns", "exec", ns, "iptables", "-D", chain, *spec)
        cut.rules.clear()
        if cut in self.cuts:
            self.cuts.remove(cut)

    def _check_name(self, name: str) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", name) or name in self.names or name == "inet":
            raise NetlabError(f"name {name!r}: lowercase letters and digits, unique in the lab, at most 16")

    # -- processes ----------------------------------------------------------

    def popen(self, host: Host, argv: Sequence[str], *, name: str, env: dict[str, str] | None = None,
              stdout: int = subprocess.PIPE) -> LabProcess:
        """Start ``argv`` inside ``host``'s namespace, in a session of its own; stderr to a log file."""
        log_path = self.root / f"{name}.log"
        with open(log_path, "ab") as logf:
            popen = subprocess.Popen(
                ["ip", "netns", "exec", host.ns, *argv], stdout=stdout, stderr=logf, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        proc = LabProcess(name, host, popen, log_path)
        self.processes.append(proc)
        return proc

    def _pcp(self, host: Host, name: str, args: Sequence[str]) -> LabProcess:
        data_dir = self.root / name
        data_dir.mkdir(parents=True, exist_ok=True)
        proc = self.popen(host, [*pcp_command(), *args, "--data-dir", str(data_dir)], name=name)
        proc.data_dir = data_dir
        proc.addr = read_line(proc)
        proc.peer_id = proc.addr.rsplit("/p2p/", 1)[-1]
        threading.Thread(target=_drain, args=(proc.popen,), daemon=True).start()
        return proc

    def start_bootstrap(self, host: Host, *, port: int = 4001, extra: Sequence[str] = ()) -> LabProcess:
        """``pcp bootstrap`` listening on the host's address; returns once it prints its multiaddr."""
        return self._pcp(host, f"{host.name}-bootstrap",
                         ["bootstrap", "--listen", f"/ip4/{host.ip}/tcp/{port}", *extra])

    def start_node(self, host: Host, bootstrap: Sequence[str], *, extra: Sequence[str] = ()) -> LabProcess:
        """``pcp node join`` on ``host`` (its own address, a free port) through ``bootstrap`` addresses."""
        boots = [a for b in bootstrap for a in ("--bootstrap", b)]
        n = sum(1 for p in self.processes if p.host is host)
        return self._pcp(host, f"{host.name}-node{n}",
                         ["node", "join", *boots, "--listen", f"/ip4/{host.ip}/tcp/0", *extra])

    def pcp_status(self, host: Host, addr: str, *, timeout: float = 10.0) -> dict[str, Any]:
        """``pcp status --json`` run inside ``host``, asking the node at ``addr``."""
        res = self.exec(host, *pcp_command(), "status", "--json", "--connect", addr,
                        "--timeout", str(timeout), check=False)
        if res.returncode != 0:
            raise PeerTimeout(f"pcp status of {addr} from {host.name} failed: {res.stderr.strip()}")
        status: dict[str, Any] = json.loads(res.stdout)  # `pcp status --json` prints one object
        return status

    def status(self, host: Host, addr: str, *, timeout: float = 10.0) -> dict[str, Any]:
        """The status of the node at ``addr`` asked from inside ``host`` over ``/pcp/status``, as
        ``pcp status --json`` prints it, without starting a process (a CLI start costs ~2 s here)."""
        import trio

        from pcp_p2p.node.status import fetch_status, to_json

        reply = run_in(host.ns, trio.run, functools.partial(fetch_status, addr, timeout=timeout))
        return to_json(reply)

    def wait_member(self, host: Host, proc: LabProcess, peer_id: str, *, deadline_s: float,
                    poll_s: float = 0.5) -> dict[str, Any]:
        """Poll the status of ``proc`` (from ``host``) until ``peer_id`` is among its members.

        There is no cross-process event for "the node has joined", so this polls,
        bounded by ``deadline_s``; returns the status that listed the member.
        """
        deadline = time.monotonic() + deadline_s
        last: dict[str, Any] | str | None = None
        while time.monotonic() < deadline:
            try:
                status = self.status(host, proc.addr, timeout=min(10.0, max(1.0, deadline - time.monotonic())))
                if any(m.get("peer_id") == peer_id for m in status.get("members", [])):
                    return status
                last = status
            except PcpError as e:  # not up yet, or refused: ask again until the deadline
                last = str(e)
            time.sleep(poll_s)
        raise PeerTimeout(f"{peer_id} not among {proc.name}'s members within {deadline_s:.0f} s; last: "
                          f"{str(last)[:500]}; its log ends:\n{proc.log_tail(1000)}")

    def wait_statuses(self, procs: dict[str, LabProcess], ok: Callable[[dict[str, dict[str, Any]]], bool], *,
                      deadline_s: float, what: str,
                      brief: Callable[[dict[str, dict[str, Any]]], Any] = lambda st: st) -> dict[str, dict[str, Any]]:
        """Every node's status (each asked from its own namespace) until ``ok(statuses)``.

        No cross-process event exists for "round committed", so this polls, bounded by
        ``deadline_s``; on timeout the error holds ``brief(statuses)`` and each log's tail.
        """
        deadline = time.monotonic() + deadline_s
        statuses: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            for name, p in procs.items():
                try:
                    statuses[name] = self.status(p.host, p.addr, timeout=5.0)
                except PcpError:
                    statuses.pop(name, None)
            if len(statuses) == len(procs) and ok(statuses):
                return statuses
            time.sleep(1.0)
        tails = "\n".join(f"--- {p.name}\n{p.log_tail(1500)}" for p in procs.values())
        raise PeerTimeout(f"{what}: not within {deadline_s:.0f} s; last: "
                          f"{json.dumps(brief(statuses), default=str)[:4000]}\n{tails}")

    # -- teardown -----------------------------------------------------------

    def close(self) -> None:
        """Stop processes and forwarders, delete every namespace; safe to call twice."""
        for p in self.processes:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.processes:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.processes:
            p.signal(signal.SIGKILL)
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for f in self.forwarders:
            f.stop()
        self.forwarders.clear()
        _kill_and_delete(self.namespaces)  # also what a process left in them
        self.namespaces.clear()


def read_line(proc: LabProcess, timeout_s: float = START_TIMEOUT_S) -> str:
    """The next line a process prints on stdout (a ``pcp`` process's first: its multiaddr), bounded.

    Reads the pipe's descriptor with a deadline (a blocking ``readline`` could
    hang a test forever); what came after the line waits in ``proc.pending``.
    """
    assert proc.popen.stdout is not None
    fd = proc.popen.stdout.fileno()
    buf = proc.pending
    deadline = time.monotonic() + timeout_s
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    if b"\n" in buf:
        line, proc.pending = buf.split(b"\n", 1)
        return line.decode(errors="replace").strip()
    proc.pending = buf
    state = "exited" if proc.popen.poll() is not None else "running"
    raise PeerTimeout(f"{proc.name} ({state}) printed no line within {timeout_s:.0f} s; its log ends:\n"
                      f"{proc.log_tail()}")


def _drain(popen: subprocess.Popen[bytes]) -> None:
    """Keep reading a child's stdout so it never blocks on a full pipe."""
    assert popen.stdout is not None
    try:
        while popen.stdout.read(65536):
            pass
    except (OSError, ValueError):
        pass


@contextmanager
def netlab(root: Path | None = None, tag: str | None = None) -> Iterator[Lab]:
    """A :class:`Lab` torn down when the block ends, however it ends."""
    with tempfile.TemporaryDirectory(prefix="pcp-netlab-") as tmp:
        lab = Lab(Path(root) if root is not None else Path(tmp), tag)  # cleans up after itself if it fails
        try:
            yield lab
        finally:
            lab.close()


# ---------------------------------------------------------------------------
# Measuring a path (for tests and benchmarks)


def _serve_in_thread(target: Callable[..., object], *args: object) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def tcp_goodput_mbit(client: Host, server: Host, nbytes: int, *, upload: bool = True, port: int = 9100,
                     timeout_s: float = 30.0) -> float:
    """Mbit/s of one TCP connection that ``client`` opens to ``server`` (a public host).

    ``upload``: the client sends ``nbytes``; else the server sends them down the
    connection the client opened (the only way data reaches a home). Measured by
    the receiver from its first byte to its last, so the handshake is not counted.
    """
    if server.nat is not None:
        raise NetlabError(f"{server.name} is behind NAT: a client cannot open a connection to it")
    listener = socket_in(server.ns)
    conn: socket.socket | None = None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((server.ip, port))
        listener.listen(1)
        listener.settimeout(timeout_s)
        conn = socket_in(client.ns)
        conn.settimeout(timeout_s)
        conn.connect((server.ip, port))
        accepted, _ = listener.accept()
        accepted.settimeout(timeout_s)
        sender, receiver = (conn, accepted) if upload else (accepted, conn)
        result: dict[str, float] = {}

        def receive() -> None:
            got, first = 0, 0.0
            while got < nbytes:
                data = receiver.recv(1 << 16)
                if not data:
                    break
                if got == 0:
                    first = time.monotonic()
                got += len(data)
            result["bytes"], result["s"] = got, time.monotonic() - first

        rx = _serve_in_thread(receive)
        chunk = b"\0" * (1 << 16)
        left = nbytes
        while left > 0:
            left -= sender.send(chunk[: min(left, len(chunk))])
        rx.join(timeout_s)
        accepted.close()
        if result.get("bytes") != nbytes:
            raise PeerTimeout(f"only {result.get('bytes', 0)} of {nbytes} bytes arrived within {timeout_s} s")
        return nbytes * 8 / max(result["s"], 1e-9) / 1e6
    finally:
        listener.close()
        if conn is not None:
            conn.close()


def udp_round_trips(client: Host, server: Host, count: int, *, port: int = 9200, wait_s: float = 1.0,
                    size: int = 64) -> list[float | None]:
    """Round-trip times (s) of ``count`` UDP probes, one at a time, echoed by ``server``; None: lost.

    A probe waits at most ``wait_s`` for its echo; a late echo is recognised by
    its sequence number and not taken for the next probe's.
    """
    echo = socket_in(server.ns, kind=socket.SOCK_DGRAM)
    probe = socket_in(client.ns, kind=socket.SOCK_DGRAM)
    stop = threading.Event()
    try:
        echo.bind((server.ip, port))
        echo.settimeout(0.05)

        def serve() -> None:
            while not stop.is_set():
                try:
                    data, peer = echo.recvfrom(65536)
                except (TimeoutError, OSError):
                    continue
                echo.sendto(data, peer)

        server_thread = _serve_in_thread(serve)
        out: list[float | None] = []
        for seq in range(count):
            sent = time.monotonic()
            probe.sendto(struct.pack("!I", seq).ljust(size, b"\0"), (server.ip, port))
            rtt: float | None = None
            while (left := sent + wait_s - time.monotonic()) > 0:
                probe.settimeout(left)
                try:
                    data = probe.recv(65536)
                except TimeoutError:
                    break
                if struct.unpack("!I", data[:4])[0] == seq:
                    rtt = time.monotonic() - sent
                    break
            out.append(rtt)
        stop.set()
        server_thread.join(2)
        return out
    finally:
        stop.set()
        echo.close()
        probe.close()
