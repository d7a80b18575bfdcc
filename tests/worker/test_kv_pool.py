"""Shared KV pools: a second, spawned process maps a worker's pool through its handle, and
blocks move between pools exactly. On CPU through /dev/shm; on CUDA (when a GPU and CuPy are
there) through CUDA IPC handles, the same test. Also: the shm file is reserved in full (a small
/dev/shm is a clear error at start-up), and pools of peers that are gone are unmapped."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import pathlib
import shutil
import signal

import pytest
import torch

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.worker import kv_pool
from sluiceway.worker.kv_pool import (
    SHM_PREFIX,
    ShmReservationError,
    allocate_shared_kv_pool,
    copy_blocks,
    open_kv_pool,
    release_stale_kv_pools,
    remove_stale_pools,
)

SHAPE = (2, 2, 6, 3, 16 * 4)  # layers, K/V, blocks, KV heads, block_size * head_dim


def _cuda_ipc_available() -> bool:
    """A GPU, and CuPy (the `cuda` extra), which CUDA pools are made and opened with."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not _cuda_ipc_available(), reason="needs CUDA and CuPy"),
    ),
]


def _peer(
    device: str,
    handle_bytes: bytes,
    src: list[int],
    dst: list[int],
    to_parent: mp.Queue,  # type: ignore[type-arg]
    from_parent: mp.Queue,  # type: ignore[type-arg]
) -> None:
    """In a spawned process: map the parent's pool, copy blocks `src` of it into blocks `dst`
    of a pool of our own, write one value into the parent's pool, and hand our pool's handle
    back."""
    handle = scheduler_pb2.KvPoolHandle.FromString(handle_bytes)
    parent = open_kv_pool(handle, device)
    own = allocate_shared_kv_pool(tuple(parent.shape), parent.dtype, device)
    own.tensor.zero_()
    copy_blocks(parent, own.tensor, src, dst)
    parent[0, 0, 0, 0, 0] = -7.0  # the parent sees writes: the memory is shared, not copied
    if device == "cuda":
        torch.cuda.synchronize()  # the write and the copy are done before the parent looks
    to_parent.put(own.handle.SerializeToString())
    from_parent.get()  # wait until the parent has read our pool, then remove it
    own.close()


@pytest.mark.parametrize("device", DEVICES)
def test_pool_opened_by_a_spawned_process_and_blocks_copied_between_pools(device: str) -> None:
    # The parent never opens its own handle: cudaIpcOpenMemHandle fails in the process that
    # made it. It opens the child's pool only.
    pool = allocate_shared_kv_pool(SHAPE, torch.float32, device)
    try:
        assert pool.tensor.device.type == device
        assert pool.handle.WhichOneof("location") == (
            "cuda_ipc_handle" if device == "cuda" else "shm_path"
        )
        pool.tensor.copy_(torch.randn(SHAPE))
        expected = pool.tensor.clone()
        if device == "cuda":
            torch.cuda.synchronize()
        ctx = mp.get_context("spawn")
        to_child, from_child = ctx.Queue(), ctx.Queue()
        src, dst = [4, 1, 5], [0, 3, 2]
        child = ctx.Process(
            target=_peer,
            args=(device, pool.handle.SerializeToString(), src, dst, from_child, to_child),
        )
        child.start()
        child_handle = scheduler_pb2.KvPoolHandle.FromString(from_child.get(timeout=120))
        peer_pool = open_kv_pool(child_handle, device)
        assert peer_pool.device.type == device
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(peer_pool[:, :, d], expected[:, :, s])
        untouched = [b for b in range(SHAPE[2]) if b not in dst]
        assert torch.count_nonzero(peer_pool[:, :, untouched]) == 0
        assert pool.tensor[0, 0, 0, 0, 0].item() == -7.0  # zero-copy: the child's write
        assert torch.equal(pool.tensor.view(-1)[1:], expected.view(-1)[1:])
        to_child.put(None)
        child.join(timeout=60)
        assert child.exitcode == 0
        if device == "cpu":
            assert not os.path.exists(child_handle.shm_path)  # the owner removed its file
    finally:
        pool.close()
    if device == "cpu":
        assert not os.path.exists(pool.handle.shm_path)


def test_handle_is_small_and_names_shape_and_dtype() -> None:
    pool = allocate_shared_kv_pool(SHAPE, torch.bfloat16, "cpu")
    try:
        h = pool.handle
        assert list(h.shape) == list(SHAPE)
        assert h.dtype == "bfloat16"
        assert h.WhichOneof("location") == "shm_path"
        assert len(h.SerializeToString()) < 200
        assert open_kv_pool(h, "cpu").dtype == torch.bfloat16
    finally:
        pool.close()


def test_copy_blocks_counts_bytes_and_rejects_bad_input() -> None:
    a = torch.randn(SHAPE)
    b = torch.zeros(2, 2, 9, 3, 16 * 4)  # more blocks: fine
    assert copy_blocks(a, b, [0, 5], [8, 1]) == 2 * 2 * 2 * 3 * 64 * 4
    assert torch.equal(b[:, :, 8], a[:, :, 0]) and torch.equal(b[:, :, 1], a[:, :, 5])
    with pytest.raises(ValueError, match="does not match"):
        copy_blocks(a, torch.zeros(2, 2, 6, 2, 64), [0], [0])
    with pytest.raises(ValueError, match="does not match"):
        copy_blocks(a, b.to(torch.bfloat16), [0], [0])
    with pytest.raises(ValueError, match="src_block_ids: block 6 outside"):
        copy_blocks(a, b, [6], [0])
    with pytest.raises(ValueError, match="2 source blocks but 1"):
        copy_blocks(a, b, [0, 1], [0])


def test_pool_of_a_dead_owner_is_removed_and_a_missing_pool_is_a_clear_error(
    tmp_path: pathlib.Path,
) -> None:
    ctx = mp.get_context("spawn")
    gone = ctx.Process(target=int)
    gone.start()
    gone.join()
    stale = tmp_path / f"{SHM_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{SHM_PREFIX}{os.getpid()}-abc"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    assert remove_stale_pools(tmp_path) == [stale]
    assert live.exists()
    handle = scheduler_pb2.KvPoolHandle(
        shm_path=str(stale), shape=[1], dtype="float32", owner="nobody"
    )
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_kv_pool(handle, "cpu")
    with pytest.raises(ValueError, match="names no pool"):
        open_kv_pool(scheduler_pb2.KvPoolHandle(dtype="float32", owner="x"), "cpu")


def test_cpu_pools_never_touch_cupy_even_when_it_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys
    import types

    class Untouchable(types.ModuleType):
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"cupy.{name} used for a CPU pool")

    monkeypatch.setitem(sys.modules, "cupy", Untouchable("cupy"))
    pool = allocate_shared_kv_pool(SHAPE, torch.float32, "cpu")
    try:
        pool.tensor.fill_(1.5)
        handle = scheduler_pb2.KvPoolHandle.FromString(pool.handle.SerializeToString())
        handle.owner += "-reopened"  # not the cached mapping: open the file again
        assert float(open_kv_pool(handle, "cpu").sum()) == 1.5 * pool.tensor.numel()
    finally:
        pool.close()


def test_cpu_pool_file_is_reserved_in_full_not_sparse() -> None:
    pool = allocate_shared_kv_pool(SHAPE, torch.float32, "cpu")
    try:
        nbytes = pool.tensor.numel() * 4
        st = os.stat(pool.handle.shm_path)
        assert st.st_size == nbytes
        assert st.st_blocks * 512 >= nbytes  # every page allocated: no SIGBUS later
        assert st.st_mode & 0o777 == 0o600
        pool.tensor.fill_(2.0)  # the mapping is the file's
        assert float(open_kv_pool(pool.handle, "cpu").sum()) == 2.0 * pool.tensor.numel()
    finally:
        pool.close()


def _no_room(fd: int, offset: int, length: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_shm_too_small_for_the_pool_is_a_clear_error_and_leaves_no_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_pool, "_shm_dir", lambda: tmp_path)
    monkeypatch.setattr(os, "posix_fallocate", _no_room)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=48 * 1024 * 1024))
    shape = (2, 2, 2048, 4, 16 * 64)  # 128 MiB of float32
    with pytest.raises(ShmReservationError) as err:
        allocate_shared_kv_pool(shape, torch.float32, "cpu")
    assert str(err.value) == (
        f"cannot reserve the shared KV pool: 134217728 bytes (128.0 MiB) needed in {tmp_path}, "
        "50331648 bytes (48.0 MiB) free there (No space left on device). Give the container a "
        f"larger {tmp_path} (docker run --shm-size, shm_size in compose, a memory-backed "
        "emptyDir on Kubernetes; every worker of the machine puts its pool there) or lower "
        "--kv-cache-memory."
    )
    # the worker's start-up (sluiceway/cli.py) reports a ValueError in one line, exit status 2
    assert isinstance(err.value, ValueError) and isinstance(err.value, OSError)
    assert isinstance(err.value.__cause__, OSError)
    assert err.value.__cause__.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # the partial file is gone


def test_a_shm_too_small_makes_the_worker_exit_with_status_2(
    tiny_models: dict[str, pathlib.Path],
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sluiceway import cli

    def serve(coro) -> int:  # type: ignore[no-untyped-def]
        coro.close()
        pytest.fail("the worker went on to serve")

    monkeypatch.setattr(kv_pool, "_shm_dir", lambda: tmp_path)
    monkeypatch.setattr(os, "posix_fallocate", _no_room)
    monkeypatch.setattr(cli, "_run_async", serve)
    args = cli.build_parser().parse_args(
        ["worker", "--model", str(tiny_models["llama-tied"]), "--device", "cpu",
         "--dtype", "float32", "--share-kv-pool", "--kv-cache-memory", "1MiB",
         "--num-threads", str(torch.get_num_threads()), "--metrics-port", "-1",
         "--scheduler", "127.0.0.1:1"]
    )  # fmt: skip
    assert cli._run_worker(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("sluiceway worker: cannot reserve the shared KV pool: ")
    assert "--shm-size" in err and "--kv-cache-memory" in err
    assert list(tmp_path.iterdir()) == []


def _mapped(path: str) -> bool:
    """Whether `path` (or what was unlinked from there) is mapped into this process."""
    maps = pathlib.Path("/proc/self/maps").read_text()
    return any(line.split(maxsplit=5)[-1].startswith(path) for line in maps.splitlines())


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_a_pool_of_the_same_owner_at_a_new_location_replaces_the_old_mapping() -> None:
    first = allocate_shared_kv_pool(SHAPE, torch.float32, "cpu")
    second = allocate_shared_kv_pool(SHAPE, torch.float32, "cpu")
    try:
        first.tensor.fill_(1.0)
        second.tensor.fill_(2.0)
        handle = scheduler_pb2.KvPoolHandle()
        handle.CopyFrom(first.handle)
        handle.owner = "prefill-restarting"
        assert float(open_kv_pool(handle, "cpu")[0, 0, 0, 0, 0]) == 1.0
        del first.tensor  # only the peer's mapping is left
        assert _mapped(first.handle.shm_path)
        handle.shm_path = second.handle.shm_path  # same owner, another pool
        assert float(open_kv_pool(handle, "cpu")[0, 0, 0, 0, 0]) == 2.0
        assert not _mapped(first.handle.shm_path)  # the old pool is unmapped
        assert _mapped(second.handle.shm_path)
    finally:
        first.close()
        second.close()
        release_stale_kv_pools()


def _own_pool(to_parent: mp.Queue) -> None:  # type: ignore[type-arg]
    """In a spawned process: a prefill worker's pool, announced, then held until killed."""
    pool = allocate_shared_kv_pool(SHAPE, torch.float32, "cpu")
    pool.tensor.fill_(3.0)
    to_parent.put(pool.handle.SerializeToString())
    signal.pause()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_the_pool_of_a_peer_that_died_is_unmapped_when_its_successor_is_opened() -> None:
    # A prefill worker dies without closing its pool (SIGKILL) and starts again: the new
    # process removes the dead pool's file and announces a new pool (another owner). The
    # decode worker unmaps the dead pool when it opens the new one.
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    dead = ctx.Process(target=_own_pool, args=(queue,))
    dead.start()
    try:
        old = scheduler_pb2.KvPoolHandle.FromString(queue.get(timeout=120))
        assert float(open_kv_pool(old, "cpu")[1, 1, 5, 2, 63]) == 3.0
    finally:
        dead.kill()
        dead.join(timeout=60)
    assert _mapped(old.shm_path) and os.path.exists(old.shm_path)
    assert release_stale_kv_pools() == []  # dead but its file is still there: kept for now
    restarted = allocate_shared_kv_pool(SHAPE, torch.float32, "cpu")  # removes the dead file
    try:
        assert not os.path.exists(old.shm_path)
        assert _mapped(old.shm_path)  # still mapped here: the leak to plug
        restarted.tensor.fill_(4.0)
        assert float(open_kv_pool(restarted.handle, "cpu")[0, 0, 0, 0, 0]) == 4.0
        assert not _mapped(old.shm_path)
        assert old.owner not in kv_pool._opened
        restarted.close()  # the peer stops: its file goes, and our own mapping of it
        del restarted.tensor
        assert release_stale_kv_pools() == [restarted.handle.owner]  # the explicit sweep
        assert not _mapped(restarted.handle.shm_path)
    finally:
        restarted.close()
