"""An asyncio reader-writer lock (SGLang's aio_rwlock.RWLock): the TokenizerManager's
model_update_lock.

Where it sits: the HTTP process. Every generate / encode request holds the reader side from
before it is sent to the scheduler until its last output; a weight update holds the writer
side while the scheduler loads. So an update waits for the requests in flight to finish, and
requests that come meanwhile wait for the update: none runs over two sets of weights.

Writers go first: once a writer waits, new readers wait behind it (a steady stream of requests
never starves an update).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator


class RWLock:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0  # readers holding the lock
        self._writer_active = False
        self._waiting_writers = 0

    @contextlib.asynccontextmanager
    async def reader_lock(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer_active and self._waiting_writers == 0)
            self._readers += 1
        try:
            yield
        finally:
            # (shielded: a cancelled reader, a client that left, must still give its place back)
            await asyncio.shield(self._release_reader())

    async def _release_reader(self) -> None:
        async with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer_lock(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self._writer_active and self._readers == 0)
            finally:
                self._waiting_writers -= 1
                self._cond.notify_all()  # (a writer that gave up waiting lets the readers behind it in)
            self._writer_active = True
        try:
            yield
        finally:
            await asyncio.shield(self._release_writer())

    async def _release_writer(self) -> None:
        async with self._cond:
            self._writer_active = False
            self._cond.notify_all()
