"""The array module (NumPy or CuPy), GPU binding, and host<->device staging.

Everything that differs between CPU and GPU lives here; model, optimizer and loops only see
`backend.xp`. Messages always travel from host buffers: on the GPU those are pinned and the
copies run on a dedicated non-blocking stream, ordered against compute with events.
"""

from __future__ import annotations

import numpy as np

from mpitrain.core.codec import decode, encode
from mpitrain.core.config import UsageError


class Backend:
    """NumPy: device arrays ARE the host message buffers, so staging costs nothing."""

    xp = np
    is_gpu = False
    cuda_aware = False
    description = "CPU (NumPy)"

    def host_alloc(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def mirror(self, host: np.ndarray):
        """A float32 device array that shadows `host`: the very same memory when that is
        possible (NumPy, float32), so computing into it needs no staging copy at all."""
        return host if host.dtype == np.float32 else np.zeros(host.shape, np.float32)

    def upload(self, dev, host: np.ndarray) -> None:
        if dev is not host:
            decode(np, host, dev)  # float16 / bfloat16 wire data to float32

    def download(self, dev, host: np.ndarray) -> None:
        if dev is not host:
            encode(np, dev, host)

    def asarray(self, a: np.ndarray):
        return a

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)


class CupyBackend(Backend):
    is_gpu = True

    def __init__(self, cupy, device_id: int, cuda_aware: bool = False):
        self.cp = cupy
        self.xp = cupy
        self.device_id = device_id
        self.cuda_aware = cuda_aware
        cupy.cuda.Device(device_id).use()
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.description = f"GPU {device_id} ({name})" + (", CUDA-aware MPI" if cuda_aware else "")
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)

    def host_alloc(self, nbytes: int) -> np.ndarray:
        """Message memory. CUDA-aware: device memory, handed to MPI as it is (no staging)."""
        if self.cuda_aware:
            return self.cp.empty((nbytes,), self.cp.uint8)
        import cupyx

        return cupyx.empty_pinned((nbytes,), np.uint8)  # pinned: DMA straight from/to it

    def mirror(self, host: np.ndarray):
        if self.cuda_aware and host.dtype == np.float32:
            return host  # already a float32 device array: compute in place, like NumPy
        return self.cp.asarray(host, dtype=np.float32)

    def upload(self, dev, host: np.ndarray) -> None:
        cp = self.cp
        if self.cuda_aware:
            if dev is not host:
                decode(cp, host, dev)  # device to device
            return
        landing = dev if dev.dtype == host.dtype else cp.empty(host.shape, host.dtype)
        # The copy overwrites `dev` (or a pooled block a decode queued before may still read): after
        # the compute already queued. Without this wait a follower of --quorum that applies two
        # updates in a row overwrote the first while its optimizer step was still reading it, and
        # the replicas drifted apart (seen on an H200; bf16 went through a fresh block and a decode).
        self._copy_after_compute()
        landing.set(host, stream=self.copy_stream)
        done = cp.cuda.Event()
        done.record(self.copy_stream)
        cp.cuda.get_current_stream().wait_event(done)  # compute waits for the copy, not the host
        if landing is not dev:
            decode(cp, landing, dev)  # float16 / bfloat16 -> float32 on the device

    def download(self, dev, host: np.ndarray) -> None:
        cp = self.cp
        if self.cuda_aware:
            if dev is not host:
                encode(cp, dev, host)
            cp.cuda.get_current_stream().synchronize()  # MPI reads this device memory next
            return
        if dev.dtype != host.dtype:  # narrowed on the device: half the bytes to copy
            narrow = cp.empty(host.shape, host.dtype)
            encode(cp, dev, narrow)
            dev = narrow
        self._copy_after_compute()  # the copy reads what the compute queued before writes into `dev`
        dev.get(stream=self.copy_stream, out=host)
        self.copy_stream.synchronize()  # MPI reads `host` next

    def _copy_after_compute(self) -> None:
        """The copy stream's next copy starts after every kernel queued so far on this thread's stream."""
        ready = self.cp.cuda.Event()
        ready.record(self.cp.cuda.get_current_stream())
        self.copy_stream.wait_event(ready)

    def asarray(self, a: np.ndarray):
        return self.cp.asarray(a)

    def to_host(self, a) -> np.ndarray:
        return self.cp.asnumpy(a)


def _import_cupy():
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # ImportError, or a CUDA runtime/driver error: no usable GPU either way
        return None, 0
    return cupy, n


def make_backend(device: str, node_local_rank: int, cuda_aware: bool = False, flag: str = "--device",
                 mpi_reads_gpu: bool | None = None) -> Backend:
    """The backend of --device (or --ps-device, `flag`) on this node-local rank. `mpi_reads_gpu`:
    what the MPI library says of GPU memory (launch.mpiimpl.mpi_cuda_support(); None: it cannot say)."""
    if device == "cpu":
        return Backend()
    if cuda_aware and mpi_reads_gpu is False:
        # Handing device pointers to an MPI that treats them as host memory crashes or corrupts.
        raise UsageError("--cuda-aware but this MPI library says it cannot read GPU memory "
                         "(MPIX_Query_cuda_support() = 0; the PyPI mpich wheel is built without CUDA): "
                         "drop --cuda-aware to stage through pinned host memory, or use a CUDA-aware MPI")
    cupy, n = _import_cupy()
    if n == 0:
        if device == "gpu":
            raise UsageError(f"{flag} gpu but no GPU is usable here (CuPy missing or no CUDA device); "
                             f"install mpitrain[cuda13] or [cuda12] on a GPU node, or use {flag} cpu")
        return Backend()
    return CupyBackend(cupy, node_local_rank % n, cuda_aware)
