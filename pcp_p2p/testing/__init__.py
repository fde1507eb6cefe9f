"""Tools that attack, load or drive real parts, shared by tests and benchmarks.

Nothing here runs inside a node: these are the outside views (an attacker's
flood, a process's memory) that tests assert on and benchmarks report, and the
in-process drivers (:mod:`~pcp_p2p.testing.inprocess`: the round machines pumped
in one process; :mod:`~pcp_p2p.testing.run_harness`: N production run machines
on trio's ``MockClock`` over :mod:`~pcp_p2p.testing.memnet`'s network, DHT,
blob stores and seeded fault plan; :mod:`~pcp_p2p.testing.byzantine`: workers
that lie) that let
``bench/*.py`` and ``tests/`` run the same code the same way.
"""

from pcp_p2p.testing.flood import FloodResult, flood, flood_node, flood_streams, rss_mib

__all__ = ["FloodResult", "flood", "flood_node", "flood_streams", "rss_mib"]
