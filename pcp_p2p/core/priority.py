"""Process priorities: the work a node donates yields to the node itself.

A node's control plane (its trio loop: lease renewals, heartbeats, membership
probes, stream negotiation) needs little CPU but needs it *now*; its compute
(``iree-compile`` children, the executor child's training steps) needs a lot
and can wait. At equal priority the compute won: a shepherd's own compile
starved it until its lease lapsed, and sixteen workers' executors on two cores
starved every node's heartbeats, so followers deposed live shepherds in turn
(docs/diloco.md, the 16-worker stall). So compute children run at a
positive niceness: with nothing else to run they get the whole machine, and
the loops that keep the swarm together are scheduled first whenever they wake.
It is also what a volunteer expects of donated compute (BOINC runs its tasks at
the lowest priority). Niceness changes no result: not the compiler's output,
not a training step's bits.
"""

from __future__ import annotations

import shutil

COMPILE_NICENESS = 10  # iree-compile and the JAX lowering (pcp_p2p.compile.child)
EXECUTOR_NICENESS = 10  # the executor child's training steps (pcp_p2p.executor.executor)


def low_priority(niceness: int) -> list[str]:
    """The ``nice -n NICENESS`` prefix for a child's command line, where ``nice`` exists
    (without it the child runs at the node's own priority: slower to yield, same result)."""
    tool = shutil.which("nice")
    return [tool, "-n", str(niceness)] if tool else []
