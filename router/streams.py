"""Several async streams read as one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import TypeVar

__all__ = ["merge_streams"]

T = TypeVar("T")


async def merge_streams(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[T, None]:
    """The items of every stream in `streams` as they come, one task reading each.

    The first exception a stream raises is raised here, after the other streams are
    cancelled; closing this generator early (a client gone) cancels them all, so each
    stream's own cleanup (a scheduler call cancelled) runs before this returns.
    """
    queue: asyncio.Queue[tuple[T] | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(stream) as items:
                async for item in items:
                    queue.put_nowait((item,))
            queue.put_nowait(None)
        except Exception as e:  # handed to the reader, which raises it
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            got = await queue.get()
            if got is None:
                left -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got[0]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
