"""``pcp node join`` under ``mpiexec``/``srun``: which process does what.

Every process the launcher starts is a thin supervisor (:mod:`~pcp_p2p.cluster.rankproc`)
around the real rank. Rank 0 opens the :class:`~pcp_p2p.cluster.group.WorkerGroup`
and then runs the ordinary node, with the group in its config (the runtime
hands it each run's executor) and in its capabilities and status; every other
rank runs :func:`~pcp_p2p.cluster.group.serve_follower` and never opens a node.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pcp_p2p.core.launch import Launch

if TYPE_CHECKING:
    from pcp_p2p.cluster.group import WorkerGroup
    from pcp_p2p.node.node import NodeConfig

log = logging.getLogger("pcp.cluster")


def join_as_group(launch: Launch, config: NodeConfig, args: argparse.Namespace,
                  serve: Callable[[NodeConfig], int]) -> int:
    """Run this rank of ``pcp node join``; ``serve(config)`` runs the node (rank 0 only)."""
    from pcp_p2p.cluster.group import WorkerGroup, serve_follower
    from pcp_p2p.cluster.rankproc import is_rank_child, rank_argv, supervise
    from pcp_p2p.core import logs

    if not is_rank_child():
        return supervise(rank_argv(), lead=launch.is_lead)
    timeout_s = float(getattr(args, "group_timeout", 30.0))
    if not launch.is_lead:
        logs.configure(args.log_level.upper(), json_lines=args.log_json)
        return serve_follower(launch, silence_s=max(60.0, 4 * timeout_s))
    group = WorkerGroup.open(launch, timeout_s=timeout_s)
    try:
        return serve(group_config(config, group, getattr(args, "backend", "auto")))
    finally:
        group.close()


def group_config(config: NodeConfig, group: WorkerGroup, backend: str) -> NodeConfig:
    """The node's config as rank 0 of ``group``: the group in its status, capabilities and runtime."""
    from pcp_p2p.net.capabilities import probe

    caps = config.capabilities or probe(backend, benchmark_s=config.benchmark_s)
    live = [group.ranks[r] for r in group.live]
    caps = dataclasses.replace(caps, group_ranks=len(live), group_gflops=round(sum(i.gflops for i in live), 1),
                               group_devices=tuple(f"{i.host}/{i.target}" for i in live))
    return dataclasses.replace(config, capabilities=caps, worker_group=group,
                               extra_status={**config.extra_status, "group": group.status})
