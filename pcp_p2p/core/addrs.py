"""Which addresses can be dialled, and by whom: pure rules on multiaddrs shared by every layer.

A node hears addresses from strangers (identify, DHT answers, member records)
and hands its own and others' on. An address is only worth storing or passing
on if the one who gets it could dial it:

- an unspecified address (``0.0.0.0``, ``::``) is a listen address, never dialable;
- a public address (and a relayed ``…/p2p-circuit`` one through a relay at a
  public address) is dialable from anywhere;
- a private, link-local or loopback address is dialable only from inside the
  network it belongs to: a ``10.1.0.2`` heard from a peer in another home
  names some machine in *our* network, or none.

The node's view of "its networks" (:func:`local_networks`) is read once from
the interfaces; everything else here is a pure function of its arguments
(sans-IO: no sockets, no clock).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

import multiaddr

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

CIRCUIT = "/p2p-circuit"

# RFC 2544's benchmarking range: Python calls it private, but it is the lab's
# "internet" (pcp_p2p/testing/netlab.py) and py-libp2p's relay code treats it as public.
BENCHMARK_NET = ipaddress.ip_network("198.18.0.0/15")
LOOPBACK_NETS: tuple[IPNetwork, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


def is_public_ip(ip: str) -> bool:
    """Routable between homes: not private (RFC 1918 and co.), loopback, link-local or unspecified."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return _is_public(addr)


def _is_public(addr: IPAddress) -> bool:
    if isinstance(addr, ipaddress.IPv4Address) and addr in BENCHMARK_NET:
        return True
    return not (addr.is_private or addr.is_loopback or addr.is_link_local or addr.is_unspecified)


def ip_of(addr: str | multiaddr.Multiaddr) -> IPAddress | None:
    """The IP an address dials first (a circuit address: the relay's), or None (DNS, malformed)."""
    try:
        ma = addr if isinstance(addr, multiaddr.Multiaddr) else multiaddr.Multiaddr(addr)
    except Exception:
        return None
    for proto in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(ma.value_for_protocol(proto))
        except Exception:
            continue
    return None


def is_unspecified(addr: str | multiaddr.Multiaddr) -> bool:
    """``/ip4/0.0.0.0/...`` or ``/ip6/::/...``: a listen address, not one anyone can dial."""
    ip = ip_of(addr)
    return ip is not None and ip.is_unspecified


def is_loopback(addr: str | multiaddr.Multiaddr) -> bool:
    ip = ip_of(addr)
    return ip is not None and ip.is_loopback


def is_public(addr: str | multiaddr.Multiaddr) -> bool:
    """Its IP (a relay's, for a circuit) is public; DNS names count as public (resolved where dialled)."""
    ip = ip_of(addr)
    return ip is None or _is_public(ip)


def _network_of(ip: IPAddress, networks: Iterable[IPNetwork]) -> IPNetwork | None:
    for net in networks:
        if ip.version == net.version and ip in net:
            return net
    return None


def dialable_here(addrs: Iterable[str | multiaddr.Multiaddr], networks: Sequence[IPNetwork]) -> list[str]:
    """The addresses a stranger gave us that we could dial (the receiving side's rule).

    Unspecified ones are dropped; public ones (circuits through a public relay
    included) and loopback ones are kept (an honest node advertises loopback
    only when it listens on nothing else: a test swarm on this machine); a
    private or link-local one is kept only when it lies in one of our own
    ``networks``: otherwise it names a machine in someone else's home.
    """
    out = []
    for a in addrs:
        ip = ip_of(a)
        if ip is None:
            out.append(str(a))
        elif ip.is_unspecified:
            continue
        elif _is_public(ip) or ip.is_loopback or _network_of(ip, networks) is not None:
            out.append(str(a))
    return list(dict.fromkeys(out))


def dialable_by(addrs: Iterable[str | multiaddr.Multiaddr], asker: str | None,
                networks: Sequence[IPNetwork]) -> list[str]:
    """The addresses worth passing on to a peer at IP ``asker`` (None: not known, e.g. relayed).

    Public ones always; a private, link-local or loopback one only when the
    asker reached us from inside the same one of our ``networks`` (a neighbour
    on our LAN), or from loopback (a node on this machine: it can dial what we
    can, :func:`dialable_here`); unspecified ones never.
    """
    try:
        asker_ip = ipaddress.ip_address(asker) if asker is not None else None
    except ValueError:
        asker_ip = None
    if asker_ip is not None and asker_ip.is_loopback:
        return dialable_here(addrs, networks)
    out = []
    for a in addrs:
        ip = ip_of(a)
        if ip is None:
            out.append(str(a))
        elif ip.is_unspecified:
            continue
        elif _is_public(ip):
            out.append(str(a))
        elif asker_ip is not None:
            shared = [*networks, *LOOPBACK_NETS]
            net = _network_of(ip, shared)
            if net is not None and asker_ip.version == net.version and asker_ip in net:
                out.append(str(a))
    return list(dict.fromkeys(out))


def local_networks() -> list[IPNetwork]:
    """The networks of this machine's interfaces (loopback included): what "our network" means.

    The only function here that does I/O (it lists the interfaces); called once at node start.
    """
    import ifaddr

    nets: list[IPNetwork] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            address = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            try:
                nets.append(ipaddress.ip_network(f"{address.split('%')[0]}/{ip.network_prefix}", strict=False))
            except ValueError:
                continue
    return list(dict.fromkeys([*nets, *LOOPBACK_NETS]))
