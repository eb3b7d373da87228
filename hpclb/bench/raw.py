"""Raw mpi4py schedules of one set of gradient buckets: the baselines GradientSync is timed
against (``make bench-allreduce``).

For the bucket sizes hpclb chose (``GradientSync.bucket_sizes_bytes``, fp32, in the order hpclb
reduces them) the same bytes travel three ways, with nothing of hpclb in between:

* ``flat_allreduce``: one blocking ``Allreduce`` of a flat buffer of all the bytes;
* ``bucket_allreduce``: one blocking ``Allreduce`` per bucket, back to back;
* ``bucket_iallreduce``: every bucket's ``Iallreduce`` started at once, then ``Waitall``
  (pipelined: the library progresses them together);
* ``bucket_allreduce_mean``: ``bucket_allreduce`` then each bucket divided by the world size:
  the mean, which is what GradientSync delivers (the sum-only schedules leave that pass out).

Open MPI runs one 100 MB ``Allreduce`` slower than the same bytes in 25 MiB pieces, so the
flat buffer alone flatters whatever is compared with it; the fastest of the three sum-only
schedules is the baseline, and ``bucket_allreduce_mean`` the like-for-like one.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["RAW_SCHEDULES", "SUM_ONLY", "RawSchedules"]

RAW_SCHEDULES = ("flat_allreduce", "bucket_allreduce", "bucket_iallreduce",
                 "bucket_allreduce_mean")
SUM_ONLY = RAW_SCHEDULES[:3]


class RawSchedules:
    """The raw schedules of ``bucket_bytes`` (bytes per bucket, each a multiple of 4: fp32) on
    ``mpi_comm`` (an mpi4py communicator; default a duplicate of ``COMM_WORLD``, so its
    collectives never match hpclb's). The buckets are views into one float32 buffer of
    ``sum(bucket_bytes)`` bytes, zero-filled (sums stay finite however often they run).

    Raises ValueError for an empty list or a size that is not a positive multiple of 4."""

    def __init__(self, bucket_bytes: list[int], mpi_comm=None):
        from mpi4py import MPI
        if not bucket_bytes or any(b <= 0 or b % 4 for b in bucket_bytes):
            raise ValueError(f"bucket_bytes={bucket_bytes!r}: need positive multiples of 4 "
                             f"(fp32 buckets)")
        self._MPI = MPI
        self._owned = mpi_comm is None
        self.comm = MPI.COMM_WORLD.Dup() if self._owned else mpi_comm
        self.bucket_bytes = list(bucket_bytes)
        self.flat = np.zeros(sum(bucket_bytes) // 4, dtype=np.float32)
        offsets = np.cumsum([0] + [b // 4 for b in bucket_bytes])
        self.buckets = [self.flat[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def flat_allreduce(self) -> None:
        self.comm.Allreduce(self._MPI.IN_PLACE, self.flat, op=self._MPI.SUM)

    def bucket_allreduce(self) -> None:
        for b in self.buckets:
            self.comm.Allreduce(self._MPI.IN_PLACE, b, op=self._MPI.SUM)

    def bucket_iallreduce(self) -> None:
        reqs = [self.comm.Iallreduce(self._MPI.IN_PLACE, b, op=self._MPI.SUM)
                for b in self.buckets]
        self._MPI.Request.Waitall(reqs)

    def bucket_allreduce_mean(self) -> None:
        size = self.comm.Get_size()
        for b in self.buckets:
            self.comm.Allreduce(self._MPI.IN_PLACE, b, op=self._MPI.SUM)
            np.divide(b, size, out=b)

    def close(self) -> None:
        """Free the duplicated communicator (collective; not one passed in)."""
        if self._owned:
            self.comm.Free()
            self._owned = False

    def variants(self, prefix: str = "raw_") -> dict[str, Callable[[], None]]:
        """Each schedule by name (``prefix`` + a name of :data:`RAW_SCHEDULES`), for
        :func:`hpclb.bench.measure.interleaved`."""
        return {prefix + name: getattr(self, name) for name in RAW_SCHEDULES}

    def describe(self) -> dict[str, dict]:
        """Per schedule: how many messages it sends and the bytes of each (for the JSON)."""
        total = sum(self.bucket_bytes)
        return {"flat_allreduce": {"messages": 1, "message_bytes": [total]},
                "bucket_allreduce": {"messages": len(self.bucket_bytes),
                                     "message_bytes": self.bucket_bytes},
                "bucket_iallreduce": {"messages": len(self.bucket_bytes),
                                      "message_bytes": self.bucket_bytes},
                "bucket_allreduce_mean": {"messages": len(self.bucket_bytes),
                                          "message_bytes": self.bucket_bytes}}
