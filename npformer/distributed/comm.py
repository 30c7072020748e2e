"""The process group: which rank this process is, and collectives on arrays of any device.

MPI, through mpi4py, carries every message; mpi4py is imported by `init()` only. Arrays reach
MPI by the transport of their device:
- "cpu": numpy memory goes to MPI as it is;
- "test" and "cuda": staged through a host buffer (device -> host copy, MPI, host -> device
  copy); on "cuda" with `cuda_aware=True` (a CUDA-aware MPI) the device memory goes to MPI
  directly, and with NCCL (`cupy.cuda.nccl`, used when the node has several GPUs) the
  all-reduce and all-gather run on the GPUs, MPI only handing out NCCL's id.
A single process without `init()` is rank 0 of 1 (`LOCAL`): every collective is then the
identity, so code written for several ranks runs unchanged in one.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

from autograd import backend
from autograd.backend import Array
from autograd.checks import check_bool

from . import reports
from .departures import Departures, install_excepthooks


class _Done:
    """A finished request (what a collective of one process returns)."""

    def wait(self):
        pass

    def test(self):
        return True


class _MpiRequest:
    """An MPI request; `after` runs once it completed (copying a staged result back)."""

    def __init__(self, request, after=None):
        self.request, self.after = request, after

    def test(self):
        return self.request.Test()  # also drives MPI's progress on the other pending requests

    def wait(self):
        self.request.Wait()
        if self.after is not None:
            self.after()
            self.after = None


class HostTransport:
    """Host (numpy) arrays straight to MPI. departures: the group's `Departures` (every
    collective is counted there)."""

    staged = False  # whether arrays go through a host buffer (`staging` arguments)

    def __init__(self, comm, mpi, departures):
        self.comm, self.MPI, self.departures = comm, mpi, departures

    def start_sum(self, flat, staging=None):
        """Begin the in-place sum over ranks of a flat array; returns a request to wait on.
        staging: a host buffer like `flat` to reuse (transports with `staged` only)."""
        self.departures.collective()
        return _MpiRequest(self.comm.Iallreduce(self.MPI.IN_PLACE, flat, op=self.MPI.SUM))

    def allgatherv(self, flat, counts, staging=None):
        """In place: rank r's entries sit at [sum(counts[:r]), sum(counts[:r+1])) of `flat`
        (its own already filled); afterwards every rank has every segment."""
        from mpi4py.util import dtlib

        displacements = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        self.departures.collective()
        self.comm.Allgatherv(self.MPI.IN_PLACE, [flat, list(counts), displacements, dtlib.from_numpy_dtype(flat.dtype)])


class StagedTransport(HostTransport):
    """Device arrays through a host buffer (device -> host, MPI, host -> device). Callers that
    repeat a collective on the same array keep a buffer from `staging_buffer` and pass it in.
    The "test" device runs this path on any machine."""

    staged = True

    @staticmethod
    def staging_buffer(flat):
        """A host array shaped like `flat`; page-locked for a CuPy array (faster copies)."""
        if backend.device_of(flat) == "cuda":
            memory = backend.module_for("cuda").cuda.alloc_pinned_memory(flat.nbytes)
            return np.frombuffer(memory, flat.dtype, flat.size).reshape(flat.shape)
        return np.empty(flat.shape, flat.dtype)

    def start_sum(self, flat, staging=None):
        host = self.staging_buffer(flat) if staging is None else staging
        _copy_to_host(flat, host)
        self.departures.collective()
        request = self.comm.Iallreduce(self.MPI.IN_PLACE, host, op=self.MPI.SUM)
        return _MpiRequest(request, after=lambda: _copy_from_host(host, flat))

    def allgatherv(self, flat, counts, staging=None):
        host = self.staging_buffer(flat) if staging is None else staging
        _copy_to_host(flat, host)
        super().allgatherv(host, counts)
        _copy_from_host(host, flat)


class CudaAwareTransport(HostTransport):
    """CuPy arrays handed to a CUDA-aware MPI as they are (mpi4py reads __cuda_array_interface__);
    the current stream is synchronised first so that MPI reads finished values."""

    def start_sum(self, flat, staging=None):
        backend.module_for("cuda").cuda.get_current_stream().synchronize()
        return super().start_sum(flat)

    def allgatherv(self, flat, counts, staging=None):
        backend.module_for("cuda").cuda.get_current_stream().synchronize()
        super().allgatherv(flat, counts)


class NcclTransport:
    """All-reduce and all-gather on the GPUs with NCCL (cupy.cuda.nccl) on a stream of its own,
    ordered after the work queued so far on the current stream; waiting makes the current
    stream wait for NCCL's (no host synchronisation)."""

    def __init__(self, comm, mpi, departures):
        cupy = backend.module_for("cuda")
        from cupy.cuda import nccl

        self.cupy, self.nccl, self.departures = cupy, nccl, departures
        departures.collective()
        uid = comm.bcast(nccl.get_unique_id() if comm.rank == 0 else None, root=0)
        self.comm = nccl.NcclCommunicator(comm.size, uid, comm.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def _dtype(self, dtype):
        return {"float16": self.nccl.NCCL_FLOAT16, "float32": self.nccl.NCCL_FLOAT32,
                "float64": self.nccl.NCCL_FLOAT64}[str(dtype)]

    def _after_current_stream(self):
        self.stream.wait_event(self.cupy.cuda.get_current_stream().record())

    staged = False

    def start_sum(self, flat, staging=None):
        self._after_current_stream()
        self.departures.collective()
        self.comm.allReduce(flat.data.ptr, flat.data.ptr, flat.size, self._dtype(flat.dtype),
                            self.nccl.NCCL_SUM, self.stream.ptr)
        return _NcclRequest(self)

    def allgatherv(self, flat, counts, staging=None):
        """One broadcast per rank (NCCL's all-gather wants equal counts), grouped into one launch."""
        self._after_current_stream()
        offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
        self.departures.collective()
        self.nccl.groupStart()
        for root, count in enumerate(counts):
            segment = flat[offsets[root]:offsets[root] + count]
            self.comm.broadcast(segment.data.ptr, segment.data.ptr, count, self._dtype(flat.dtype), root,
                                self.stream.ptr)
        self.nccl.groupEnd()
        _NcclRequest(self).wait()


class _NcclRequest:
    def __init__(self, transport):
        self.transport, self.event = transport, transport.stream.record()

    def test(self):
        return self.event.done

    def wait(self):
        self.transport.cupy.cuda.get_current_stream().wait_event(self.event)


def _copy_to_host(flat, host):
    if backend.device_of(flat) == "cuda":
        flat.get(out=host)  # waits for the stream: the values are final when MPI reads them
    else:
        np.copyto(host, backend.as_numpy(flat))


def _copy_from_host(host, flat):
    if backend.device_of(flat) == "cuda":
        flat.set(host)
    else:
        flat[...] = backend.to_device(host, backend.device_of(flat))


class ProcessGroup:
    """The ranks of an MPI communicator (COMM_WORLD after `init()`).

    rank / size: this process's rank and the number of ranks; local_rank: its rank among the
    processes of this machine (which GPU it takes). Collectives must be called by every rank in
    the same order; each is counted by `departures`, which ends the job when a rank that left
    the program will never join one (npformer.distributed.departures). Made by `init()` (comm:
    an mpi4py communicator, mpi: mpi4py's MPI module). Without `init()`, `group()` is a
    one-process stand-in with the same methods."""

    def __init__(self, comm: Any, mpi: Any, cuda_aware: bool = False):
        self.comm, self.MPI = comm, mpi
        self.rank, self.size = comm.rank, comm.size
        self.local_rank = comm.Split_type(mpi.COMM_TYPE_SHARED).rank  # rank among this machine's
        self.cuda_aware = cuda_aware
        self.departures = Departures(self)
        self._transports = {}

    def transport(self, device: str) -> Any:
        """How arrays of `device` reach the other ranks (see the module docstring)."""
        if device not in self._transports:
            if device == "cpu":
                made = HostTransport(self.comm, self.MPI, self.departures)
            elif device == "cuda" and _nccl_available() and _gpus_on_this_machine() > 1:
                made = NcclTransport(self.comm, self.MPI, self.departures)
            elif device == "cuda" and self.cuda_aware:
                made = CudaAwareTransport(self.comm, self.MPI, self.departures)
            else:
                made = StagedTransport(self.comm, self.MPI, self.departures)
            self._transports[device] = made
        return self._transports[device]

    def sum(self, values: list[float]) -> list[float]:
        """[sum over ranks of values[i]] for a list of numbers (float64, one message)."""
        buffer = np.array(values, dtype=np.float64)
        self.departures.collective()
        self.comm.Allreduce(self.MPI.IN_PLACE, buffer, op=self.MPI.SUM)
        return buffer.tolist()

    def sum_(self, array: Array) -> Array:
        """Sum an array (any device, any layout) over ranks, in place; returns it."""
        contiguous = array if array.flags.c_contiguous else backend.get_array_module(array).ascontiguousarray(array)
        self.transport(backend.device_of(array)).start_sum(contiguous).wait()
        if contiguous is not array:  # MPI and NCCL take contiguous memory only
            array[...] = contiguous
        return array

    def broadcast_(self, array: Array, root: int = 0) -> Array:
        """Overwrite `array` (any device) with root's values, in place; returns it."""
        device = backend.device_of(array)
        host = backend.as_numpy(array) if device != "cpu" else array
        host = np.ascontiguousarray(host)
        self.departures.collective()
        self.comm.Bcast(host, root=root)
        if device != "cpu":
            array[...] = backend.to_device(host, device)
        elif host is not array:
            array[...] = host
        return array

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """[obj of rank 0, obj of rank 1, ...] on root (pickled), None elsewhere."""
        self.departures.collective()
        return self.comm.gather(obj, root=root)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """[obj of rank 0, obj of rank 1, ...] (pickled) on every rank."""
        self.departures.collective()
        return self.comm.allgather(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """root's `obj` (pickled) on every rank; the others' `obj` is ignored."""
        self.departures.collective()
        return self.comm.bcast(obj, root=root)

    def barrier(self) -> None:
        """Wait until every rank has reached its barrier."""
        self.departures.collective()
        self.comm.Barrier()

    def abort(self, code: int = 1) -> None:
        """End every rank of the job at once with exit status `code` (MPI_Abort), a moment after
        flushing this rank's output (mpiexec drops output it has not forwarded yet when it
        tears the job down, the message saying why included). Under npformer's launcher this
        rank first tells it that it ends the job on purpose (npformer.distributed.reports)."""
        reports.abort()
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(_OUTPUT_FORWARDING_SECONDS)
        self.comm.Abort(code)


class _LocalGroup:
    """One process, no MPI: rank 0 of 1; collectives return their input."""

    rank, size, local_rank = 0, 1, 0

    def transport(self, device):
        return _LocalTransport()

    def sum(self, values):
        return [float(v) for v in values]

    def sum_(self, array):
        return array

    def broadcast_(self, array, root=0):
        return array

    def gather_object(self, obj, root=0):
        return [obj]

    def all_gather_object(self, obj):
        return [obj]

    def broadcast_object(self, obj, root=0):
        return obj

    def barrier(self):
        pass

    def abort(self, code=1):
        raise SystemExit(code)


class _LocalTransport:
    staged = False

    def start_sum(self, flat, staging=None):
        return _Done()

    def allgatherv(self, flat, counts, staging=None):
        pass


LOCAL = _LocalGroup()
_world = None
_OUTPUT_FORWARDING_SECONDS = 0.5  # before MPI_Abort: time for mpiexec to forward the last messages


def _gpus_on_this_machine():
    return backend.module_for("cuda").cuda.runtime.getDeviceCount()


def _nccl_available():
    try:
        from cupy.cuda import nccl  # noqa: F401
        return True
    except Exception:
        return False


def init(cuda_aware: bool = False) -> ProcessGroup:
    """Join the MPI job this process was started in (`mpiexec -n N python script.py`; a script
    started alone is rank 0 of 1, with MPI or, when mpi4py is not installed, without) and return
    the world group; later calls return the same group.

    Also: a rank that leaves before the others (an exception reaching the top of any thread,
    its script ending or sys.exit while others still run collectives) ends the whole job with a
    message naming it (npformer.distributed.departures), so that no rank waits forever in a
    collective; with CuPy and GPUs present, each
    rank takes the GPU `local_rank % number of GPUs` (one rank per GPU); cuda_aware=True hands
    CuPy arrays to MPI directly (only with an MPI built CUDA-aware; TypeError unless a bool)."""
    global _world
    cuda_aware = check_bool(cuda_aware, "cuda_aware", "init")
    if _world is not None:
        return _world
    try:
        from mpi4py import MPI
    except ImportError as e:
        if launched_by_mpi():
            raise ImportError("npformer.distributed needs mpi4py and an MPI library: pip install -e '.[mpi]' "
                              "(mpi4py and mpich)") from e
        _world = LOCAL  # started alone, without mpi4py: rank 0 of 1
        return _world
    _world = ProcessGroup(MPI.COMM_WORLD, MPI, cuda_aware=cuda_aware)
    if _world.size > 1:
        install_excepthooks(_world)
    reports.start(_world.rank)  # under npformer.distributed.launch: it watches this rank from now on
    if backend.cuda_available():
        backend.module_for("cuda").cuda.Device(_world.local_rank % _gpus_on_this_machine()).use()
    return _world


def launched_by_mpi() -> bool:
    """Whether the environment says this process is one of several ranks (MPICH, Intel MPI,
    MVAPICH, Open MPI, Slurm)."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(name, "1").strip() not in ("", "1"):
            return True
    return False


def is_initialized() -> bool:
    """Whether `init()` has been called in this process."""
    return _world is not None


def group() -> ProcessGroup:
    """The world group after `init()`, else the one-process group (rank 0 of 1, the same methods)."""
    return _world if _world is not None else LOCAL


def rank() -> int:
    """This process's rank (0 without `init()`)."""
    return group().rank


def world_size() -> int:
    """The number of ranks (1 without `init()`)."""
    return group().size


def barrier() -> None:
    """Wait until every rank has reached this call."""
    group().barrier()


def abort(message: str = "", code: int = 1) -> None:
    """End every rank of the job now (MPI_Abort), after printing `message` on this one's stderr.
    For errors seen on one rank only (e.g. a bad file): `sys.exit` there would end the job only
    when another rank starts a collective that this one never joins, and without the message."""
    if message:
        print(f"rank {rank()}: {message}", file=sys.stderr, flush=True)
    group().abort(code)
