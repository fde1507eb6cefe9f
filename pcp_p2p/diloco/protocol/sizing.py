"""The shepherd's memory plan for a term: the micro-batch its artifacts are compiled for,
and which members that leaves out.

The owner fixes the batch (``inner.batch_size``); the shepherd fixes, at each
term's set-up, how many of its sequences a worker holds in memory at once: the
largest micro-batch (:mod:`pcp_p2p.compile.memory`) that fits the smallest free
memory the run's members advertise (``Capabilities.memory_free_bytes``, in their
signed member records) once the lowest quarter of them is left out, and leaving
out members that could not train even one sequence per pass. The quarter is
there because the figure is each member's own word: on an open run a fresh key
advertising just enough for one sequence would otherwise make every worker take
B passes per step; now it takes more than a quarter of the members to shrink
everyone's micro-batch, and those left out are refused for the term.

One micro-batch per term, not one per node, so every
artifact of the term runs the same sums in the same order and an audit replays
a round on any worker's artifact of the same target as it was trained.

A member that joins later with less free memory than the plan needs is refused
with a one-line reason (:meth:`MemoryPlan.why_not`, answered as a
``RejectedUpdate`` by the shepherd's ``admit``); the next term's set-up sizes
for the members present then. Pure: numbers in, a plan out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pcp_p2p.compile.memory import fit_micro_batch, fixed_bytes, per_sample_bytes, train_memory_bytes
from pcp_p2p.compile.model import GPTConfig
from pcp_p2p.diloco.protocol.spec import RunSpec

MIB = 1 << 20


@dataclass(frozen=True)
class MemoryPlan:
    """A term's micro-batch and the memory a worker needs for it (modelled)."""

    batch: int  # the spec's batch B
    micro_batch: int  # M, a divisor of B
    need_bytes: int  # modelled need at M
    least_bytes: int  # modelled need at M = 1: below it no node can train this run

    @property
    def sized(self) -> bool:
        """Whether the batch is split (M < B)."""
        return self.micro_batch < self.batch

    def why_not(self, free_bytes: int) -> str | None:
        """None if a member with ``free_bytes`` can train at this plan, else a one-line reason.

        0 (not measured: a node from before free memory was advertised) is let in as before.
        """
        if free_bytes <= 0 or free_bytes >= self.need_bytes:
            return None
        if free_bytes < self.least_bytes:
            return (f"out of memory: {free_bytes // MIB} MiB free, this model needs {self.least_bytes // MIB} MiB "
                    f"even at 1 sequence per pass")
        return (f"out of memory for this term: {free_bytes // MIB} MiB free, {self.need_bytes // MIB} MiB needed "
                f"at micro-batch {self.micro_batch} of {self.batch} (the next term sizes for the members then)")


def plan_memory(spec: RunSpec, cfg: GPTConfig, free: Iterable[int], kept_states: int) -> MemoryPlan:
    """The largest micro-batch that fits the smallest member able to train at all, once the
    lowest quarter of those is left out (see the module's docstring).

    ``free``: each member's advertised free bytes (0 = not measured, ignored). With no
    measured member the batch stays whole, as before sizing existed.
    """
    batch, seq = spec.inner.batch_size, spec.inner.seq_len
    least = fixed_bytes(cfg, kept_states) + per_sample_bytes(cfg, seq)
    able = sorted(f for f in free if f >= least)
    m = (fit_micro_batch(cfg, batch, seq, able[len(able) // 4], kept_states) or 1) if able else batch
    return MemoryPlan(batch, m, train_memory_bytes(cfg, seq, m, kept_states), least)
