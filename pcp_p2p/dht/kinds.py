"""Every record kind of the protocol, registered in one place.

A node's DHT validator refuses records of kinds it does not know, so every node
— a bootstrap server that never trains included — must know all of them, or
it would refuse to store (and serve) a run spec or a commit record. Each kind
is declared next to its payload type; importing those modules registers them.
"""

from __future__ import annotations

import importlib

KIND_MODULES = (
    "pcp_p2p.node.membership",  # member
    "pcp_p2p.diloco.runs",  # run
    "pcp_p2p.diloco.commits",  # commit
    "pcp_p2p.diloco.election",  # lease
    "pcp_p2p.diloco.admission",  # allowlist
    "pcp_p2p.diloco.owner_runs",  # owner-runs
    "pcp_p2p.diloco.lifecycle",  # stop
)


def register_all() -> None:
    for name in KIND_MODULES:
        importlib.import_module(name)
