"""Tools that attack or load a real node, shared by tests and benchmarks.

Nothing here runs inside a node: these are the outside views (an attacker's
flood, a process's memory) that tests assert on and benchmarks report.
"""

from pcp_p2p.testing.flood import FloodResult, flood, flood_node, flood_streams, rss_mib

__all__ = ["FloodResult", "flood", "flood_node", "flood_streams", "rss_mib"]
