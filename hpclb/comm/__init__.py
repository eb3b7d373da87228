"""Communicators: one facade over the MPI, torch.distributed, Horovod and one-process backends.

:mod:`.base` (the :class:`~.base.Communicator` facade), :mod:`.registry` (the backends by name),
:mod:`.world` (``get_communicator``: this process's one communicator), :mod:`.env` (the
launcher's environment), :mod:`.device` (one device per rank), the backends :mod:`.mpi`,
:mod:`.torch_dist`, :mod:`.horovod`, :mod:`.local`, :mod:`.watchdog` (stalled collectives), and
:mod:`.launcher` (starting ``mpirun`` from hpclb's own tools).
Import from the submodules: this package imports nothing, so ``hpclb.comm.registry`` and
``hpclb.comm.env`` load without torch.
"""

__all__: list[str] = []
