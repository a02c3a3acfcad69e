"""A background round repeated every `interval_s` (the replica poller, the KV subscriber): one way to
start it, keep it alive through a failed round, and stop it."""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("consort.router")


class Periodic:
    """Subclasses set `interval_s` and `task_name` and implement `poll_all` (one round)."""

    interval_s: float
    task_name = "periodic"
    _task: asyncio.Task | None = None

    async def poll_all(self) -> None:
        raise NotImplementedError

    async def run(self) -> None:
        while True:
            try:
                await self.poll_all()
            except Exception:  # noqa: BLE001 - keep going whatever one round meets
                log.exception("%s round failed", self.task_name)
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=self.task_name)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
