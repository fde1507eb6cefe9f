"""Worker groups: a whole cluster (a rack, a Slurm allocation) joins a run as ONE DiLoCo worker.

``mpiexec -n K pcp node join ...`` (or ``srun``) starts K ranks. Rank 0 is the
libp2p peer: it runs the ordinary node, joins the run, fetches θ and the
artifact. The other ranks never touch the network beyond MPI. Each round rank 0
splits the group's data assignment into per-rank sub-shards sized by each
rank's measured throughput; every rank trains its sub-shard on its own IREE
executor; the ranks then sum their token-weighted pseudo-gradients with an MPI
allreduce, and rank 0 submits one signed Δ with the group's total steps (so its
tokens add up). Inside the group synchronisation runs over the fast local
network once per round; between the group and the swarm it is DiLoCo as usual.

Modules:

- :mod:`~pcp_p2p.core.launch`: which launcher started us (MPICH/Hydra, Open
  MPI, Slurm), from the environment alone.
- :mod:`~pcp_p2p.diloco.protocol.group_split`: the arithmetic (sub-shards, token-weighted
  average, the group's inner-state names), pure functions.
- :mod:`~pcp_p2p.cluster.rank_messages`: what ranks say to each other (wire messages).
- :mod:`~pcp_p2p.cluster.comm`: MPI with deadlines: every call is a non-blocking
  request polled against a deadline, so a dead or hung rank costs a timeout,
  never a hang.
- :mod:`~pcp_p2p.cluster.group`: rank 0's :class:`~pcp_p2p.cluster.group.WorkerGroup`
  and :class:`~pcp_p2p.cluster.group.GroupEngine` (the node's inner engine for
  the whole group), and :func:`~pcp_p2p.cluster.group.serve_follower`, the other
  ranks' loop.

See ``docs/clusters.md``.
"""
