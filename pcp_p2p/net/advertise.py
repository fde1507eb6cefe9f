"""What a node tells others to dial, decided once from its reachability verdict.

A node's addresses leave it by four roads: identify's ``listenAddrs`` (and the
signed peer record beside it), the DHT (its own peer info in FIND_NODE
answers, the ``senderRecord`` of every KAD message, provider records), its
member record (SWIM, ``/pcp/msg``), and its status. py-libp2p 0.8.1 builds the
first three from ``host.get_addrs()``, the node the last two: all four use
:func:`advertised`, through :func:`install` (the host) and ``Node.advertised_addrs``.

=================  ==========================================================
verdict            advertised
=================  ==========================================================
``public``         listen addresses at public IPs (the address peers observe
                   is one of ours, with the port we listen on)
``hole-punchable`` ``<relay>/p2p-circuit/p2p/<me>`` for each live reservation;
``relay-only``     without one (the first second, or after the relay died): the
                   listen addresses, as at start-up (see :func:`advertised`)
``unknown``        listen addresses (a swarm on 127.0.0.1 or a LAN, where no
                   public observer ever judges us; or the first second of start-up)
=================  ==========================================================

Never an unspecified address (``0.0.0.0`` is expanded to the interfaces' IPs),
and loopback only when the node has nothing else (a test swarm on 127.0.0.1):
a peer elsewhere that dials ``127.0.0.1`` reaches itself.

DCUtR (hole punching) needs none of this advertised: it sends the predicted
address (observed IP + listen port) in its own CONNECT message, and reads our
*local* listen address from ``host.get_addrs()`` to bind its dials; it gets a
:class:`ListenView` of the host for that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import multiaddr
from libp2p.abc import IHost

from pcp_p2p.core.addrs import CIRCUIT, is_loopback, is_public, is_unspecified
from pcp_p2p.net.reachability import HOLE_PUNCHABLE, PUBLIC, RELAY_ONLY


def expand_listen(listen: Iterable[str], local_ips: Sequence[str]) -> list[str]:
    """Listen addresses as others could dial them: ``/ip4/0.0.0.0/...`` once per local IPv4
    address, other unspecified ones (``::``) dropped, duplicates removed, order kept."""
    out: list[str] = []
    for a in listen:
        if a.startswith("/ip4/0.0.0.0/"):
            out.extend(a.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/", 1) for ip in local_ips)
        elif not is_unspecified(a):
            out.append(a)
    return list(dict.fromkeys(a for a in out if not is_unspecified(a)))


def advertised(
    verdict: str,
    listen: Iterable[str],
    local_ips: Sequence[str],
    *,
    relayed: Sequence[str] = (),
) -> list[str]:
    """The addresses this node advertises (pure: the table in the module docstring).

    ``listen``: the transport's listen addresses (no ``/p2p/``), ``0.0.0.0`` allowed;
    ``local_ips``: this machine's IPv4 addresses; ``relayed``: full circuit addresses of
    live reservations.
    Empty only when the node listens nowhere.
    """
    own = expand_listen(listen, local_ips)
    own = [a for a in own if not is_loopback(a)] or own  # loopback only when it is all we have
    if verdict == PUBLIC:
        return [a for a in own if is_public(a)] or own
    if verdict in (HOLE_PUNCHABLE, RELAY_ONLY) and relayed:
        return list(dict.fromkeys(relayed))
    # Behind a NAT with no relay (yet, or any more) nothing of ours is dialable from outside. The
    # listen addresses, not nothing: told nothing, py-libp2p's identify sends the raw ones
    # (0.0.0.0 included). Not our public IP with the listen port either: receivers take it for a
    # public address and keep it in their routing tables, and a dial to it waits on a NAT that
    # drops silently (5 s to a timeout in the lab, where the private address fails at once); a
    # private address from outside their networks is dropped by receivers
    # (pcp_p2p.core.addrs.dialable_here), so it enters no routing table.
    return own


class Advertiser:
    """The node's advertised set, kept by :class:`~pcp_p2p.net.connectivity.Connectivity`
    (verdict, reservations, observed public IPs) and read by the host (:func:`install`)."""

    def __init__(self, me: str, local_ips: Sequence[str]) -> None:
        self.me = me
        self.local_ips = tuple(local_ips)
        self.verdict = "unknown"
        self.relayed: tuple[str, ...] = ()

    def addrs(self, listen: Iterable[str]) -> list[str]:
        """Full multiaddrs (``/p2p/<me>`` included) to advertise, given the listen addresses."""
        out = []
        for a in advertised(self.verdict, listen, self.local_ips, relayed=self.relayed):
            out.append(a if CIRCUIT in a or "/p2p/" in a else f"{a}/p2p/{self.me}")
        return out


def _listen_strs(host: IHost) -> list[str]:
    return [str(a).split("/p2p/")[0] for a in host.get_transport_addrs()]


def install(host: IHost, advertiser: Advertiser) -> None:
    """Make ``host.get_addrs()`` (identify, signed peer records, the DHT) return the advertised set.

    py-libp2p 0.8.1 has an ``addrs_factory`` for this, but ``BasicHost.get_addrs`` then strips
    "any existing /p2p/ component" of each address by decapsulating its *first* ``/p2p/`` value:
    ``<relay>/p2p/<relay id>/p2p-circuit`` comes out as the relay's own transport address under
    our peer id, a lie. So the method itself is replaced, on this host instance only: the one
    place PCP overrides py-libp2p's address plumbing (re-check when the pin moves).
    """

    def get_addrs() -> list[multiaddr.Multiaddr]:
        return [multiaddr.Multiaddr(a) for a in advertiser.addrs(_listen_strs(host))]

    setattr(host, "get_addrs", get_addrs)  # noqa: B010 (an instance override, see the docstring)


class ListenView:
    """The host as py-libp2p 0.8.1's DCUtR must see it: ``get_addrs()`` gives our *local* listen
    addresses, everything else is the host's.

    DCUtR reads ``host.get_addrs()`` for two things, both local: the port we listen on (to
    predict our NAT mapping, observed IP + that port) and the IP and port to bind its
    hole-punch dials to (the SYN must leave from the listen port). The advertised set (relayed
    or public addresses) holds neither. Non-loopback addresses come first: a dial bound to
    127.0.0.1 cannot leave the machine.
    """

    def __init__(self, host: IHost, local_ips: Sequence[str]) -> None:
        self._host = host
        self._local_ips = tuple(local_ips)

    def get_addrs(self) -> list[multiaddr.Multiaddr]:
        own = expand_listen(_listen_strs(self._host), self._local_ips)
        return [multiaddr.Multiaddr(a) for a in sorted(own, key=is_loopback)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)
