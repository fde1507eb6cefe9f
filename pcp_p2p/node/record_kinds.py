"""Every record kind of the protocol, in one static table.

A node's DHT validator refuses records of kinds it does not know, so every node
— a bootstrap server that never trains included — must know all of them, or
it would refuse to store (and serve) a run spec or a commit record. Each kind's
rule (:class:`~pcp_p2p.dht.records.KindRule`: payload type, who may sign which
key, which record wins) is declared next to its payload type; this table names
them all, so what a node accepts is read here rather than depending on which
modules happened to be imported first.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pcp_p2p.dht.records import KindRule
from pcp_p2p.diloco.protocol.admission import ALLOWLIST_KIND, ALLOWLIST_RULE
from pcp_p2p.diloco.protocol.commits import COMMIT_KIND, COMMIT_RULE
from pcp_p2p.diloco.protocol.election import LEASE_KIND, LEASE_RULE
from pcp_p2p.diloco.protocol.lifecycle import STOP_KIND, STOP_RULE
from pcp_p2p.diloco.protocol.owner_runs import OWNER_RUNS_KIND, OWNER_RUNS_RULE
from pcp_p2p.diloco.protocol.runs import RUN_KIND, RUN_RULE
from pcp_p2p.net.membership import MEMBER_KIND, MEMBER_RULE

RECORD_KINDS: Mapping[str, KindRule] = MappingProxyType({
    MEMBER_KIND: MEMBER_RULE,  # a node's signed member record (SWIM gossips it too)
    RUN_KIND: RUN_RULE,  # a run's signed spec, under its run id
    COMMIT_KIND: COMMIT_RULE,  # a run's latest commit, by term then round
    LEASE_KIND: LEASE_RULE,  # the elected shepherd's lease, by term
    ALLOWLIST_KIND: ALLOWLIST_RULE,  # an allowlist run's admission list, by the owner's seq
    OWNER_RUNS_KIND: OWNER_RUNS_RULE,  # the runs an owner has published
    STOP_KIND: STOP_RULE,  # an owner's order to stop a run
})
