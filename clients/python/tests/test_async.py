"""The asyncio client against a real cluster: the same verbs, awaited, run
with ``asyncio.run`` so that the suite needs no plugin."""

from __future__ import annotations

import asyncio
import uuid
from typing import Awaitable, Callable, List, Optional, TypeVar

import pytest

from tenure_client import AsyncClient, Notice, TenureError

T = TypeVar("T")


async def eventually(bound: float, check: Callable[[], Awaitable[Optional[T]]]) -> T:
    async def poll() -> T:
        while True:
            value = await check()
            if value is not None:
                return value
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(poll(), bound)


def test_async_verbs_end_to_end(url: str, token: str) -> None:
    async def main() -> None:
        async with AsyncClient(url, token) as client:
            key = f"async-{uuid.uuid4().hex[:8]}"
            first = await client.submit("printf 'a\\nb\\n'", idempotency_key=key)
            assert (await client.submit("printf 'a\\nb\\n'", idempotency_key=key)).existing
            waited = await client.wait(first.task, timeout=60)
            assert waited.finished and waited.task.status == "completed"
            assert (await client.logs(first.task, offset=2)).text == "b\n"
            assert (await client.get(first.task)).id == first.task
            assert first.task in {t.id for t in await client.list("completed", all=True)}
            assert (await client.archive(first.task)).board == "archived"
            assert (await client.unarchive(first.task)).board == "active"
            assert (await client.delete(first.task)).board == "deleted"
            assert (await client.whoami()).identity == "alice"

            agent = (await client.submit('while read -r l; do echo "got: $l"; [ "$l" = bye ] && exit 0; done', kind="agent")).task

            async def sent() -> Optional[int]:
                try:
                    return (await client.send(agent, "hi")).bytes
                except TenureError as e:
                    if e.code == "not-running":
                        return None
                    raise

            assert await eventually(30, sent) == 3
            stream = client.follow(agent)
            async for event in stream:
                assert event.text == "got: hi\n"
                break
            await client.send(agent, "bye")
            rest = client.follow(agent, offset=stream.offset)
            assert await rest.text() == "got: bye\n"
            assert rest.end is not None and rest.end.status == "completed"

            sleeper = (await client.submit("sleep 60")).task
            await eventually(30, lambda: _running(client, sleeper))
            assert (await client.kill(sleeper, reason="async stop")).result == "requested"
            ended = await client.wait(sleeper, timeout=60)
            assert (ended.task.status, ended.task.kill_reason) == ("killed", "async stop")

            with pytest.raises(TenureError) as e:
                await client.get("shell-999999999")
            assert (e.value.code, e.value.status) == ("not-found", 404)

    asyncio.run(main())


async def _running(client: AsyncClient, task: str) -> Optional[bool]:
    return (await client.get(task)).status == "running" or None


def test_async_notices_tell_an_unreported_end(url: str, token: str) -> None:
    async def main() -> None:
        async with AsyncClient(url, token) as client:
            task = (await client.submit("echo async notice")).task
            seen: List[Notice] = []

            stream = client.notices()

            async def read() -> Notice:
                async for notice in stream:
                    seen.append(notice)
                    if notice.kind == "ended" and notice.task is not None and notice.task.id == task:
                        return notice
                raise AssertionError("the notice stream ended")

            try:
                notice = await asyncio.wait_for(read(), 90)
            finally:
                await stream.aclose()
            assert notice.task is not None and notice.task.status == "completed"

    asyncio.run(main())
