"""KV pools another process can map without a copy: POSIX shared memory on CPU, CUDA IPC on GPU.

A worker that shares its pool allocates it with :func:`allocate_shared_kv_pool` and announces
its :class:`~sluiceway.internal.v1.scheduler_pb2.KvPoolHandle` (a few dozen bytes) when it
registers. A peer opens the handle once with :func:`open_kv_pool` (cached per pool) and reads
blocks straight out of the owner's memory:

- **CPU**: the pool is a file in ``/dev/shm`` mapped ``MAP_SHARED``
  (``torch.from_file(shared=True)``); the handle is its path. The owner unlinks the file when it
  closes the pool; a pool whose owner died without closing is removed by the next
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
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from sluiceway.internal.v1 import scheduler_pb2

__all__ = [
    "SharedKvPool",
    "allocate_shared_kv_pool",
    "copy_blocks",
    "open_kv_pool",
]

SHM_PREFIX = "sluiceway-kv-"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_opened: dict[str, torch.Tensor] = {}  # handle.owner -> the peer's pool, mapped once


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
    for path in (directory or _shm_dir()).glob(f"{SHM_PREFIX}*"):
        try:
            pid = int(path.name[len(SHM_PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        except PermissionError:
            pass  # alive, someone else's
    return removed


def allocate_shared_kv_pool(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> SharedKvPool:
    """Allocates an (uninitialized) pool of `shape` and `dtype` on `device` that peers can open.

    Raises:
        ValueError: a dtype other than float32/bfloat16/float16.
        ImportError: CUDA device without CuPy (``pip install sluiceway[cuda]``).
        OSError: the shared-memory file cannot be created (e.g. ``/dev/shm`` too small).
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
    flat = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
    handle.shm_path = str(path)
    return SharedKvPool(flat.view(shape), handle)


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

    Raises:
        ValueError: a handle without a location, or an unknown dtype.
        FileNotFoundError: the CPU pool's file is gone (its owner stopped).
        ImportError: a CUDA handle without CuPy.
    """
    cached = _opened.get(handle.owner)
    if cached is not None:
        return cached
    if handle.dtype not in _DTYPES:
        raise ValueError(f"KV pool handle has unknown dtype {handle.dtype!r}")
    dtype = _DTYPES[handle.dtype]
    shape = tuple(handle.shape)
    numel = 1
    for n in shape:
        numel *= n
    location = handle.WhichOneof("location")
    if location == "shm_path":
        if not os.path.exists(handle.shm_path):
            raise FileNotFoundError(f"KV pool {handle.shm_path} does not exist (owner stopped?)")
        tensor = torch.from_file(handle.shm_path, shared=True, size=numel, dtype=dtype).view(shape)
    elif location == "cuda_ipc_handle":
        tensor = _open_cuda(handle, torch.device(device), numel * dtype.itemsize)
        tensor = tensor.view(dtype).view(shape)
    else:
        raise ValueError("KV pool handle names no pool (neither shm_path nor cuda_ipc_handle)")
    _opened[handle.owner] = tensor
    return tensor


def _open_cuda(
    handle: scheduler_pb2.KvPoolHandle, device: torch.device, nbytes: int
) -> torch.Tensor:
    import cupy  # optional: the `cuda` extra

    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index):
        ptr = cupy.cuda.runtime.ipcOpenMemHandle(
            handle.cuda_ipc_handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess
        )
        memory = cupy.cuda.UnownedMemory(ptr, nbytes, None, index)
        array = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))
    return torch.from_dlpack(array)


def copy_blocks(
    source: torch.Tensor,
    destination: torch.Tensor,
    src_block_ids: list[int],
    dst_block_ids: list[int],
) -> int:
    """Copies blocks ``src_block_ids`` of `source` into blocks ``dst_block_ids`` of
    `destination`, every layer, K and V; both pools ``[L, 2, num_blocks, Hkv, block_size * D]``
    of one dtype. Device to device on CUDA (one gather and one scatter kernel); waits for the
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
    src = torch.tensor(src_block_ids, dtype=torch.int64).to(source.device)
    dst = torch.tensor(dst_block_ids, dtype=torch.int64).to(destination.device)
    blocks = source.index_select(2, src)
    if blocks.device != destination.device:
        blocks = blocks.to(destination.device)
    destination.index_copy_(2, dst, blocks)
    if destination.is_cuda:
        torch.cuda.current_stream(destination.device).synchronize()
    return blocks.numel() * blocks.element_size()
