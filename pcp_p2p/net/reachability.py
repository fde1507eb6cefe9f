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
