"""What changed, pushed by PostgreSQL: an API process answers polls of unchanged plans, and knows the
tokens it has seen, from memory.

Agents poll their plan (`GET /v1/plans/{id}` with If-None-Match) many times a second across a cluster, and
almost every answer is "not modified". Asking the database each time costs a pooled connection, a thread
hop and a query per poll. Instead each API process LISTENs on `memplan_plan_changed`; triggers (migration
0003) NOTIFY a plan's id from inside every transaction that changes its entity tag's inputs, so the
notification arrives after the change commits, and never for a rolled-back one. The process keeps the last
tag it read for recently polled plans and forgets a plan's tag when its notification arrives.

When the cache may answer:
- only while the listener is connected: a lost connection may have lost notifications, so the caches are
  emptied and unused until LISTEN is re-established;
- only for a tag (or token) read by a query that started after the listener was (re)connected and before any
  notification arrived since (the `generation`): a read that raced a change is used once, not kept.
A change made through another API process reaches this one a few milliseconds after its commit; the
process that makes a change forgets the plan's tag itself, and the SDK drops its own copy of a plan it
changed, so a client reads its own writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict

import psycopg

log = logging.getLogger("memplan.service.change_feed")

# migrations/versions/2026_11_21_0003_change_notifications.py
PLAN_CHANNEL = "memplan_plan_changed"  # payload: the plan's id
TOKEN_CHANNEL = "memplan_token_changed"  # payload: the token's id
APPLICATION_NAME = "memplan-change-feed"  # how the listener's connection shows in pg_stat_activity
TokenOwner = tuple[str, str]  # (project id, token id): plain values, so the feed needs nothing from `auth`


class ChangeFeed:
    """Recently read plan entity tags and resolved tokens, kept current by PostgreSQL notifications (one
    per API process; used from the event loop's thread, except `forget`)."""

    def __init__(
        self, conninfo: str, *, capacity: int = 100_000, ping_s: float = 10.0, reconnect_s: float = 1.0
    ) -> None:
        self.conninfo = conninfo
        self.capacity = capacity
        self.ping_s = ping_s
        self.reconnect_s = reconnect_s
        self._tags: OrderedDict[str, tuple[str, str]] = OrderedDict()  # plan id -> (project id, etag)
        self._owners: OrderedDict[str, TokenOwner] = OrderedDict()  # token digest -> (project id, token id)
        self._generation = 0  # bumped by every notification and every listener (re)connection or loss
        self._listening = False
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._task: asyncio.Task[None] | None = None
        self.notifications = 0

    # -------------------------------------------------------------------------------------------- cache
    @property
    def listening(self) -> bool:
        return self._listening

    @property
    def generation(self) -> int:
        """Take this before reading a plan's tag from the database; pass it to `remember`."""
        return self._generation

    def tag(self, plan_id: str, project_id: str) -> str | None:
        """The plan's current entity tag if it is known here (None: ask the database)."""
        if not self._listening:
            return None
        found = self._tags.get(plan_id)
        if found is None or found[0] != project_id:  # another project's plan: the database answers (404)
            return None
        return found[1]

    def remember(self, plan_id: str, project_id: str, etag: str, generation: int) -> None:
        """Keep a tag read from the database by a query that started at `generation`."""
        if not self._listening or generation != self._generation:
            return  # a notification (or a reconnection) came in while it was read: it may be stale
        self._tags[plan_id] = (project_id, etag)
        if len(self._tags) > self.capacity:
            self._tags.popitem(last=False)

    def token_owner(self, token_digest: str) -> TokenOwner | None:
        """(project id, token id) of a token (by digest), if resolved here since the last token change (None:
        ask the database)."""
        return self._owners.get(token_digest) if self._listening else None

    def keep_token_owner(self, token_digest: str, project_id: str, token_id: str, generation: int) -> None:
        """Keep a token resolved by a query that started at `generation`."""
        if not self._listening or generation != self._generation:
            return
        self._owners[token_digest] = (project_id, token_id)
        if len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def forget(self, plan_id: str) -> None:
        """This process is changing the plan: drop its tag now rather than when the notification comes.
        May be called from a handler's thread: a `remember` racing it on the loop's thread can keep the old
        tag, but only until the change's notification arrives (ms), as for a change made anywhere else."""
        self._tags.pop(plan_id, None)
        self._generation += 1

    async def changed(self, plan_id: str, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a notification about the plan (or the listener's loss: then the
        caller must ask the database). True if one came."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._waiters.setdefault(plan_id, [])
        waiting.append(future)
        try:
            await asyncio.wait_for(future, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with contextlib.suppress(ValueError):
                waiting.remove(future)
            if not waiting and self._waiters.get(plan_id) is waiting:
                del self._waiters[plan_id]

    def _tokens_changed(self) -> None:
        self.notifications += 1
        self._generation += 1
        self._owners.clear()  # revocations are rare: forget every token rather than track which

    def _changed(self, plan_id: str) -> None:
        self.notifications += 1
        self._generation += 1
        self._tags.pop(plan_id, None)
        for future in self._waiters.pop(plan_id, ()):
            if not future.done():
                future.set_result(None)

    def _lost(self) -> None:
        self._listening = False
        self._generation += 1
        self._tags.clear()
        self._owners.clear()
        waiters, self._waiters = self._waiters, {}
        for futures in waiters.values():
            for future in futures:
                if not future.done():
                    future.set_result(None)

    # ------------------------------------------------------------------------------------------ listener
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="memplan-change-feed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._lost()

    async def _run(self) -> None:
        """Listen forever: reconnect after a loss (the database restarted), the cache unused meanwhile."""
        warned = False
        while True:
            try:
                await self._listen()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: the cache is off until we listen again
                if self._listening or not warned:
                    log.warning(
                        "change feed lost (%s): requests ask the database until it is back",
                        type(exc).__name__,
                    )
                    warned = True
            self._lost()
            await asyncio.sleep(self.reconnect_s)

    async def _listen(self) -> None:
        async with await psycopg.AsyncConnection.connect(
            self.conninfo, autocommit=True, connect_timeout=5, application_name=APPLICATION_NAME
        ) as conn:
            await conn.execute(f"LISTEN {PLAN_CHANNEL}")
            await conn.execute(f"LISTEN {TOKEN_CHANNEL}")
            self._generation += 1
            self._listening = True
            log.info("listening for plan and token changes")
            while True:
                async for note in conn.notifies(timeout=self.ping_s):
                    if note.channel == TOKEN_CHANNEL:
                        self._tokens_changed()
                    else:
                        self._changed(note.payload)
                # Quiet for ping_s: make sure the connection is alive (a dead one would lose notifications).
                await asyncio.wait_for(conn.execute("SELECT 1"), timeout=5)
