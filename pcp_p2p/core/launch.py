"""Which launcher started this process, read from the environment alone.

``pcp node join`` must decide before it opens a node whether it is rank 0 of a
worker group (then it is the libp2p peer), another rank (then it never opens a
node), or a plain node. MPI itself is imported only once a launcher is seen,
so a plain node never loads libmpi.

Each launcher names rank and size in its own variables; the first complete
pair wins, in the order below. A process started by ``srun`` under an
``mpiexec`` (or the reverse) sees both; the MPI launcher's variables are the
ones mpi4py's communicator agrees with, so they come first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pcp_p2p.core.errors import ConfigError

LAUNCHERS: tuple[tuple[str, str, str], ...] = (
    ("mpich", "PMI_RANK", "PMI_SIZE"),  # MPICH's Hydra (the mpich wheel's mpiexec), Intel MPI
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("pmix", "PMIX_RANK", "PMIX_SIZE"),  # PMIx launchers (prterun); PMIX_SIZE is not always set
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS"),  # srun, with or without --mpi=pmi2/pmix
)


@dataclass(frozen=True)
class Launch:
    """Where this process sits in its group."""

    launcher: str
    rank: int
    size: int

    @property
    def is_lead(self) -> bool:
        """Rank 0 is the group's libp2p peer."""
        return self.rank == 0


def detect_launch(env: Mapping[str, str]) -> Launch | None:
    """The launch this environment describes, or None when no launcher started a group of more than one.

    A group of one (``mpiexec -n 1``, a single-task ``srun``) is a plain node: there is nobody to
    synchronise with, so MPI is not initialised at all. Malformed values are a
    :class:`~pcp_p2p.core.errors.ConfigError`, not a silent plain node: an operator who asked for a group
    must not get K independent nodes fighting over one data dir.
    """
    for name, rank_var, size_var in LAUNCHERS:
        if rank_var in env and size_var in env:
            try:
                rank, size = int(env[rank_var]), int(env[size_var])
            except ValueError:
                raise ConfigError(f"{rank_var}={env[rank_var]!r}, {size_var}={env[size_var]!r}: not integers") from None
            if size < 1 or not 0 <= rank < size:
                raise ConfigError(f"{name} launch with rank {rank} of {size}")
            return Launch(name, rank, size) if size > 1 else None
    return None


LAUNCH_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_")


def without_launch(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the MPI launcher's variables: for child processes that are not ranks.

    The IREE runtime sees ``PMI_RANK``/``OMPI_COMM_WORLD_SIZE`` and tries to open an MPI
    channel for its device (failing without libmpi on the library path: "no local-task
    device"). An executor child is one device of one rank, never a rank itself.
    """
    return {k: v for k, v in env.items() if not k.startswith(LAUNCH_PREFIXES)}
