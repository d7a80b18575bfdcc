"""KV pools another process can map without a copy: POSIX shared memory on CPU, CUDA IPC on GPU.

A worker that shares its pool allocates it with :func:`allocate_shared_kv_pool` and announces
its :class:`~sluiceway.internal.v1.scheduler_pb2.KvPoolHandle` (a few dozen bytes) when it
registers. A peer opens the handle once with :func:`open_kv_pool` (cached per pool) and reads
blocks straight out of the owner's memory. The peer drops a cached pool once it is gone (its
file removed, its owner process ended) when it opens another one, e.g. the pool of the owner's
restarted worker (:func:`release_stale_kv_pools`):

- **CPU**: the pool is a file in ``/dev/shm`` mapped ``MAP_SHARED``
  (``torch.from_file(shared=True)``); the handle is its path. The file's whole size is reserved
  when it is made, so a ``/dev/shm`` too small for the pool is an error at start-up
  (:class:`ShmReservationError`), not a SIGBUS when the pool fills up. The owner unlinks the
  file when it closes the pool; a pool whose owner died without closing is removed by the next
  :func:`allocate_shared_kv_pool` on the machine (its file name carries the owner's pid).
- **CUDA**: the pool is one ``cudaMalloc`` of its own, made through CuPy, so that
  ``cudaIpcGetMemHandle`` names exactly the pool (a pointer inside torch's caching allocator
  would name a larger segment); a peer maps it with ``cudaIpcOpenMemHandle`` and wraps it as a
  torch tensor through DLPack. CuPy (``pip install sluiceway[cuda]``) is imported only here and
  only for CUDA pools.

The pool is allocated as bytes and viewed as its dtype (CuPy has no bfloat16).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.pids import dead_owner_paths, pid_alive

__all__ = [
    "SharedKvPool",
    "ShmReservationError",
    "allocate_shared_kv_pool",
    "copy_blocks",
    "open_kv_pool",
    "release_stale_kv_pools",
]

SHM_PREFIX = "sluiceway-kv-"
# int8: a --kv-cache-dtype int8 pool, scales inside its rows (kernels/kv_quant.py)
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_MIB = 1024 * 1024


class ShmReservationError(OSError, ValueError):
    """The shared-memory file of a CPU pool cannot be given its full size (``/dev/shm`` too
    small, typically): a configuration error. An OSError (what creating the file raises) and a
    ValueError, which the worker's start-up reports in one line before exiting with status 2;
    the OS error is its ``__cause__``."""


@dataclass(slots=True)
class _OpenedPool:
    """A peer's pool mapped into this process: ``identity`` tells a new pool of the same owner
    from this one; ``close`` unmaps a CUDA pool (a CPU mapping goes with its last tensor)."""

    tensor: torch.Tensor
    identity: tuple[str, str | bytes, int]
    handle: scheduler_pb2.KvPoolHandle
    close: Callable[[], None] | None = None


_opened: dict[str, _OpenedPool] = {}  # handle.owner -> the peer's pool, mapped once


def _shm_dir() -> pathlib.Path:
    shm = pathlib.Path("/dev/shm")
    return shm if shm.is_dir() else pathlib.Path(tempfile.gettempdir())


def _dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"a shared KV pool cannot hold {dtype}")


@dataclass(slots=True)
class SharedKvPool:
    """A KV pool allocated to be shared: ``tensor`` (the pool, ``shape``/``dtype`` as asked) and
    ``handle`` (what a peer needs to open it). Call :meth:`close` when the worker stops."""

    tensor: torch.Tensor
    handle: scheduler_pb2.KvPoolHandle
    _keepalive: Any = None  # the CuPy allocation behind a CUDA pool

    def close(self) -> None:
        """Removes the shared-memory file of a CPU pool (peers that mapped it keep their
        mapping). Idempotent."""
        if self.handle.HasField("shm_path"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.handle.shm_path)


def remove_stale_pools(directory: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Deletes the pool files of workers that are no longer running (killed before they could
    close their pool); returns the paths removed."""
    removed = []
    for path in dead_owner_paths(directory or _shm_dir(), SHM_PREFIX):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def allocate_shared_kv_pool(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> SharedKvPool:
    """Allocates an (uninitialized) pool of `shape` and `dtype` on `device` that peers can open.

    On CPU the pool is a file in ``/dev/shm`` (the temporary directory where there is none)
    whose ``prod(shape) * dtype.itemsize`` bytes are reserved up front: that much shared memory
    is in use from here on, not as the pool fills.

    Raises:
        ValueError: a dtype other than float32/bfloat16/float16/int8/float8_e4m3fn.
        ImportError: CUDA device without CuPy (``pip install sluiceway[cuda]``).
        ShmReservationError: (an OSError and a ValueError) ``/dev/shm`` has no room for the
            pool; the message names the bytes needed, the bytes free and the remedy. No file
            is left behind.
        OSError: the shared-memory file cannot be created.
    """
    device = torch.device(device)
    numel = 1
    for n in shape:
        numel *= n
    handle = scheduler_pb2.KvPoolHandle(
        shape=list(shape),
        dtype=_dtype_name(dtype),
        owner=f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex}",
    )
    if device.type == "cuda":
        return _allocate_cuda(shape, dtype, device, numel, handle)
    directory = _shm_dir()
    remove_stale_pools(directory)
    path = directory / f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    _reserve_file(path, numel * dtype.itemsize)
    try:
        flat = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    handle.shm_path = str(path)
    return SharedKvPool(flat.view(shape), handle)


def _reserve_file(path: pathlib.Path, nbytes: int) -> None:
    """Creates `path` (mode 0600) with `nbytes` bytes reserved (``posix_fallocate``), not a
    sparse file: a tmpfs too small for it fails here rather than with SIGBUS when a page beyond
    its room is first written. Raises ShmReservationError (the file removed) when the space
    cannot be reserved, OSError when the file cannot be created."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if nbytes > 0 and hasattr(os, "posix_fallocate"):  # not on macOS: stays sparse there
            os.posix_fallocate(fd, 0, nbytes)
    except BaseException as e:
        path.unlink(missing_ok=True)
        if not isinstance(e, OSError):
            raise
        free = shutil.disk_usage(path.parent).free
        raise ShmReservationError(
            f"cannot reserve the shared KV pool: {nbytes} bytes ({nbytes / _MIB:.1f} MiB) "
            f"needed in {path.parent}, {free} bytes ({free / _MIB:.1f} MiB) free there "
            f"({e.strerror or e}). Give the container a larger {path.parent} (docker run "
            f"--shm-size, shm_size in compose, a memory-backed emptyDir on Kubernetes; every "
            f"worker of the machine puts its pool there) or lower --kv-cache-memory."
        ) from e
    finally:
        os.close(fd)


def _allocate_cuda(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    numel: int,
    handle: scheduler_pb2.KvPoolHandle,
) -> SharedKvPool:
    import cupy  # optional: the `cuda` extra

    index = device.index if device.index is not None else torch.cuda.current_device()
    nbytes = numel * dtype.itemsize
    with cupy.cuda.Device(index):
        memory = cupy.cuda.Memory(nbytes)  # a cudaMalloc of its own
        array = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))
        handle.cuda_ipc_handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(memory.ptr))
    handle.device_index = index
    tensor = torch.from_dlpack(array).view(dtype).view(shape)
    return SharedKvPool(tensor, handle, _keepalive=(memory, array))


def open_kv_pool(handle: scheduler_pb2.KvPoolHandle, device: torch.device | str) -> torch.Tensor:
    """The peer pool that `handle` names, mapped into this process (once; later calls return
    the same tensor). A CUDA pool is opened on `device` (peer access between GPUs is enabled
    lazily by the driver).

    Before mapping a pool it has not mapped yet, drops the cached pools that are gone
    (:func:`release_stale_kv_pools`) and an earlier pool of the same ``owner`` with another
    location, so that the pools of peers that restarted do not stay mapped. A tensor this
    returned must not be kept beyond the copy it was opened for: on CUDA it is unmapped then.

    Raises:
        ValueError: a handle without a location, or an unknown dtype.
        FileNotFoundError: the CPU pool's file is gone (its owner stopped).
        ImportError: a CUDA handle without CuPy.
    """
    identity = _identity(handle)
    cached = _opened.get(handle.owner)
    if cached is not None:
        if cached.identity == identity:
            return cached.tensor
        _release(handle.owner)  # the same owner with a new pool: the old one is gone
    release_stale_kv_pools()
    if handle.dtype not in _DTYPES:
        raise ValueError(f"KV pool handle has unknown dtype {handle.dtype!r}")
    dtype = _DTYPES[handle.dtype]
    shape = tuple(handle.shape)
    numel = 1
    for n in shape:
        numel *= n
    close = None
    location = handle.WhichOneof("location")
    if location == "shm_path":
        if not os.path.exists(handle.shm_path):
            raise FileNotFoundError(f"KV pool {handle.shm_path} does not exist (owner stopped?)")
        tensor = torch.from_file(handle.shm_path, shared=True, size=numel, dtype=dtype).view(shape)
    elif location == "cuda_ipc_handle":
        tensor, close = _open_cuda(handle, torch.device(device), numel * dtype.itemsize)
        tensor = tensor.view(dtype).view(shape)
    else:
        raise ValueError("KV pool handle names no pool (neither shm_path nor cuda_ipc_handle)")
    _opened[handle.owner] = _OpenedPool(tensor, identity, handle, close)
    return tensor


def release_stale_kv_pools() -> list[str]:
    """Unmaps the peer pools opened by :func:`open_kv_pool` that are gone: a CPU pool whose
    file no longer exists (its owner closed it, or it died and the file was removed as stale),
    a CUDA pool whose owner process is no longer running (as this process's PID namespace sees
    it; CUDA IPC needs a shared one anyway). Returns their owners. Cheap (a ``stat`` or a
    signal 0 per pool); never raises."""
    stale = [owner for owner, pool in _opened.items() if not _alive(pool.handle)]
    for owner in stale:
        _release(owner)
    return stale


def _identity(handle: scheduler_pb2.KvPoolHandle) -> tuple[str, str | bytes, int]:
    if handle.HasField("shm_path"):
        return ("shm_path", handle.shm_path, 0)
    return ("cuda_ipc_handle", handle.cuda_ipc_handle, handle.device_index)


def _alive(handle: scheduler_pb2.KvPoolHandle) -> bool:
    if handle.HasField("shm_path"):
        return os.path.exists(handle.shm_path)
    try:  # owner = host:pid:uuid
        pid = int(handle.owner.split(":")[1])
    except (IndexError, ValueError):
        return True  # not one of ours: cannot tell
    return pid_alive(pid)


def _release(owner: str) -> None:
    pool = _opened.pop(owner, None)
    if pool is not None and pool.close is not None:
        del pool.tensor  # the last reference, unless a caller kept one (see open_kv_pool)
        pool.close()


def _open_cuda(
    handle: scheduler_pb2.KvPoolHandle, device: torch.device, nbytes: int
) -> tuple[torch.Tensor, Callable[[], None]]:
    """The peer's CUDA pool as a uint8 tensor on `device`, and the function that unmaps it."""
    import cupy  # optional: the `cuda` extra

    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index):
        ptr = cupy.cuda.runtime.ipcOpenMemHandle(
            handle.cuda_ipc_handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess
        )
        memory = cupy.cuda.UnownedMemory(ptr, nbytes, None, index)
        array = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))

    def close() -> None:
        with cupy.cuda.Device(index), contextlib.suppress(cupy.cuda.runtime.CUDARuntimeError):
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)

    return torch.from_dlpack(array), close


def copy_blocks(
    source: torch.Tensor,
    destination: torch.Tensor,
    src_block_ids: list[int],
    dst_block_ids: list[int],
) -> int:
    """Copies blocks ``src_block_ids`` of `source` into blocks ``dst_block_ids`` of
    `destination`, every layer, K and V; both pools ``[L, 2, num_blocks, Hkv, width]`` of one
    dtype (an int8 pool's rows carry their scales: :mod:`kernels.kv_quant`). Device to device on CUDA (one gather and one scatter kernel); waits for the
    copy to finish, so the source blocks may be reused once this returns. Returns the bytes
    copied.

    Raises:
        ValueError: different layouts or dtypes, lists of different lengths, or an id outside
            its pool.
    """
    if source.dtype != destination.dtype or (
        source.shape[:2] + source.shape[3:] != destination.shape[:2] + destination.shape[3:]
    ):
        raise ValueError(
            f"peer pool {tuple(source.shape)} {source.dtype} does not match this worker's "
            f"{tuple(destination.shape)} {destination.dtype} (model, block size or dtype differ)"
        )
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(
            f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks"
        )
    for name, ids, pool in (
        ("src_block_ids", src_block_ids, source),
        ("dst_block_ids", dst_block_ids, destination),
    ):
        bad = [b for b in ids if not 0 <= b < pool.shape[2]]
        if bad:
            raise ValueError(f"{name}: block {bad[0]} outside a pool of {pool.shape[2]} blocks")
    if not src_block_ids:
        return 0
    if source.dtype == torch.float8_e4m3fn:  # index_copy_ has no float8 kernel: copy bytes
        source, destination = source.view(torch.uint8), destination.view(torch.uint8)
    src = torch.tensor(src_block_ids, dtype=torch.int64).to(source.device)
    dst = torch.tensor(dst_block_ids, dtype=torch.int64).to(destination.device)
    blocks = source.index_select(2, src)
    if blocks.device != destination.device:
        blocks = blocks.to(destination.device)
    destination.index_copy_(2, dst, blocks)
    if destination.is_cuda:
        torch.cuda.current_stream(destination.device).synchronize()
    return blocks.numel() * blocks.element_size()
