"""The reachability verdicts, as words every part of PCP shares (no I/O, no libp2p import).

A node judges itself (:func:`pcp_p2p.net.connectivity.verdict`), puts the
verdict in its member record, and the election (:mod:`pcp_p2p.diloco.protocol.election`)
and the dashboards read it from there; this module is the vocabulary they share,
kept apart so the sans-IO election need not import the networking code.
"""

from __future__ import annotations

PUBLIC, HOLE_PUNCHABLE, RELAY_ONLY, UNKNOWN = "public", "hole-punchable", "relay-only", "unknown"
VERDICTS = (PUBLIC, HOLE_PUNCHABLE, RELAY_ONLY, UNKNOWN)


def known(word: str) -> str:
    """``word`` if it is a verdict, else ``unknown``: a stranger's record may say anything."""
    return word if word in VERDICTS else UNKNOWN


def takes_dials(them: str) -> bool:
    """Whether anyone can dial a node judged ``them`` at any port it opens: a public one, or one
    whose verdict is not known (given the benefit of the doubt). Behind a NAT only the ports its
    own connections mapped are open, so a blob side port there is out of anyone's reach."""
    return known(them) in (PUBLIC, UNKNOWN)


def dialable(me: str, them: str) -> bool:
    """Whether a node judged ``me`` can open a direct connection to one judged ``them``.

    A public node takes anyone's dial; a node behind a cone NAT takes a hole punch from a
    public or cone one; a relay-only node (symmetric NAT) takes none, and cannot punch
    through to a cone one either: between those two there is only the relay, which never
    carries blobs. An unknown verdict (either side's) is given the benefit of the doubt.
    """
    if takes_dials(them) or known(me) == UNKNOWN:
        return True
    return known(them) == HOLE_PUNCHABLE and known(me) != RELAY_ONLY
