"""The asyncio client: the same verbs as :class:`tenure_client.Client`, awaited."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncGenerator, AsyncIterator, Dict, Iterable, List, Mapping, Optional, Union

import httpx

from . import _core
from ._routes import build
from ._types import Killed, LogChunk, Notice, OutputEvent, Page, Sent, Submitted, Task, Waited, WhoAmI


class AsyncOutputStream:
    """A task's output, followed live: iterate with ``async for`` for :class:`OutputEvent` s.

    Iteration ends when the task ended and every byte was delivered; then
    :attr:`end` holds the task as it ended. A dropped connection is resumed
    by itself from :attr:`offset` (sent as ``Last-Event-ID``), up to a few
    times in a row; to resume later, call :meth:`AsyncClient.follow` with
    ``offset=stream.offset``.
    """

    def __init__(self, client: "AsyncClient", task: str, offset: int, reconnects: int) -> None:
        self.task = task
        #: The byte offset after the last delivered output.
        self.offset = offset
        #: The task once the stream saw it end, else ``None``.
        self.end: Optional[Task] = None
        self._client = client
        self._reconnects = reconnects
        self._resumed = False

    async def __aiter__(self) -> AsyncIterator[OutputEvent]:
        failures = 0
        while self.end is None:
            headers = {"Last-Event-ID": str(self.offset)} if self._resumed else {}
            req = build("follow", self.task, query={"offset": self.offset}, headers=headers)
            try:
                async with self._client._http.stream(
                    req.method, req.path, params=req.params, headers=req.headers, timeout=self._client._stream_timeout
                ) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise _core.error_of(resp)
                    async for name, _id, data in _aevents(resp.aiter_lines()):
                        failures = 0
                        value = _core.decode(data)
                        if name == "output":
                            event = _core.output_event(value)
                            self.offset = event.next_offset
                            self._resumed = True
                            yield event
                        elif name == "end":
                            self.end = Task.from_json(value)
                            return
                        elif name == "error":
                            raise _core.stream_error(value)
            except httpx.TransportError as e:
                failures += 1
                if failures > self._reconnects:
                    raise _core.unreachable(e) from e
                await asyncio.sleep(_core.backoff(failures))
            self._resumed = True

    async def text(self) -> str:
        """All the output until the task ends, as one string."""
        return "".join([e.text async for e in self])


class AsyncClient:
    """tenure over its HTTP gateway, for asyncio.

    ``url`` and ``token`` default to ``TENURE_URL`` and ``TENURE_TOKEN``.
    Every refusal raises :class:`TenureError` with the gateway's stable
    ``code``; not reaching the gateway raises it with code ``unreachable``.
    Use it as an async context manager, or await :meth:`close`.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        *,
        timeout: float = 30.0,
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> None:
        self.url, token = _core.settings(url, token)
        self._timeout = timeout
        self._stream_timeout = httpx.Timeout(timeout, read=_core.STREAM_READ_TIMEOUT)
        self._http = httpx.AsyncClient(base_url=self.url, headers=_core.headers(token), timeout=timeout, transport=transport)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(
        self,
        verb: str,
        task: Optional[str] = None,
        *,
        query: Optional[Mapping[str, Any]] = None,
        body: Optional[Mapping[str, Any]] = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        req = build(verb, task, query=query, body=body, headers=headers)
        try:
            resp = await self._http.request(
                req.method,
                req.path,
                params=req.params,
                json=req.json,
                headers=req.headers,
                timeout=timeout if timeout is not None else self._timeout,
            )
        except httpx.TransportError as e:
            raise _core.unreachable(e) from e
        return _core.json_of(resp)

    # ------------------------------------------------------------- verbs

    async def submit(
        self,
        command: str = "",
        *,
        kind: Optional[str] = None,
        label: Optional[str] = None,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        idempotent: Optional[bool] = None,
        pattern: Optional[str] = None,
        steps: Optional[Iterable[str]] = None,
        final_output: Optional[bool] = None,
        timeout_ms: Optional[int] = None,
        idle_timeout_ms: Optional[int] = None,
        priority: Optional[int] = None,
        on: Optional[Iterable[str]] = None,
        concurrency_key: Optional[str] = None,
        concurrency_limit: Optional[int] = None,
        hold: Optional[bool] = None,
        resume_command: Optional[str] = None,
        captures: Optional[Iterable[str]] = None,
        resume_anywhere: Optional[bool] = None,
        idempotency_key: Optional[str] = None,
    ) -> Submitted:
        """Start a task: ``command`` runs as ``sh -c COMMAND`` (``kind`` defaults to
        ``shell``; ``steps`` instead of a command makes a workflow).

        Retrying with the same ``idempotency_key`` never makes a second task;
        without one a new key is generated and returned in the answer.
        ``on`` places it on workers whose labels satisfy each constraint,
        ``concurrency_key``/``concurrency_limit`` cap how many of the key run at
        once, and ``hold`` keeps it ``blocked`` until :meth:`approve`. An
        ``agent`` task with ``resume_command`` (``{name}`` placeholders filled
        from ``captures``, regular expressions over its output lines) is
        resumed instead of left ``unknown`` once its machine proves its
        process gone (anywhere with ``resume_anywhere``).
        """
        body, key = _core.submit_body(
            command,
            dict(
                kind=kind,
                label=label,
                cwd=cwd,
                env=dict(env) if env is not None else None,
                idempotent=idempotent,
                pattern=pattern,
                steps=list(steps) if steps is not None else None,
                final_output=final_output,
                timeout_ms=timeout_ms,
                idle_timeout_ms=idle_timeout_ms,
                priority=priority,
                on=list(on) if on is not None else None,
                concurrency_key=concurrency_key,
                concurrency_limit=concurrency_limit,
                hold=hold,
                resume_command=resume_command,
                captures=list(captures) if captures is not None else None,
                resume_anywhere=resume_anywhere,
                idempotency_key=idempotency_key,
            ),
        )
        return _core.submitted(await self._call("submit", body=body), key)

    async def submit_batch(self, tasks: Iterable[Mapping[str, Any]]) -> List[Submitted]:
        """Start many tasks in one request (1 to 1000), each a mapping of
        :meth:`submit`'s arguments (``command`` and its keywords). All are
        checked before any is created: one refusal creates none, and its
        message names the task's place (counting from 1). The answers come in
        the order given, each with its idempotency key; send the same batch
        again after an error and its keys return the tasks already made.
        """
        bodies, keys = _core.batch_bodies(tasks)
        return _core.submitted_batch(await self._call("submit_batch", body={"tasks": bodies}), keys)

    async def get(self, task: str) -> Task:
        """One task (``not-found`` when it does not exist or is not yours)."""
        return Task.from_json(await self._call("get", task))

    async def list_page(self, *, all: bool = False, after: Optional[int] = None) -> Page:
        """One page of your tasks; pass ``page.next`` as ``after`` for the next."""
        return Page.from_json(await self._call("list", query={"all": all, "after": after}))

    async def iter_tasks(self, status: Union[str, Iterable[str], None] = None, *, all: bool = False) -> AsyncIterator[Task]:
        """Your tasks, page after page, only those in ``status`` when given.

        Without ``all`` only active, unreported tasks are listed: pass
        ``all=True`` to find finished tasks that were already reported.
        """
        wanted = _core.statuses(status)
        after: Optional[int] = None
        while True:
            page = await self.list_page(all=all, after=after)
            for t in page.tasks:
                if wanted is None or t.status in wanted:
                    yield t
            if page.next is None:
                return
            after = page.next

    async def list(self, status: Union[str, Iterable[str], None] = None, *, all: bool = False) -> List[Task]:
        """Every page of :meth:`iter_tasks`, as a list."""
        return [t async for t in self.iter_tasks(status, all=all)]

    async def logs(self, task: str, offset: int = 0, max: Optional[int] = None) -> LogChunk:
        """Output from byte ``offset`` (at most ``max`` bytes, capped by the gateway).

        A read that reaches the end of a finished task's output marks it reported.
        """
        data = await self._call("logs", task, query={"offset": offset, "max": max})
        return _core.log_chunk(data)

    def follow(
        self, task: str, offset: int = 0, *, reconnects: int = _core.STREAM_RECONNECTS
    ) -> AsyncOutputStream:
        """Follow output live from byte ``offset`` (SSE); see :class:`AsyncOutputStream`."""
        return AsyncOutputStream(self, task, offset, reconnects)

    async def send(self, task: str, text: str, *, raw: bool = False) -> Sent:
        """Send one message to a running ``agent`` task's stdin (a newline is
        added unless ``raw`` or it ends with one). Code ``input-in-doubt``
        means the message may or may not have arrived: it is never resent."""
        return _core.sent(await self._call("send", task, body={"text": text, "raw": raw}))

    async def kill(self, task: str, reason: Optional[str] = None) -> Killed:
        """Ask a task to stop (SIGTERM to its group, SIGKILL after a grace);
        ``reason`` is kept on the task."""
        return _core.killed(await self._call("kill", task, query={"reason": reason}))

    async def wait(self, task: str, timeout: float = 60.0, started: bool = False) -> Waited:
        """Wait at most ``timeout`` seconds for a task to end (any length:
        longer waits are several requests). ``finished`` is false if it still runs.
        With ``started``, only until it left the queue for good (running,
        paused, stopping, unknown, or ended): its ``started_at`` says whether it ran."""
        deadline = time.monotonic() + timeout
        until = "started" if started else "ended"
        while True:
            ms = _core.wait_ms(deadline - time.monotonic())
            query = {"timeout_ms": ms, "until": until}
            waited = Waited.from_json(await self._call("wait", task, query=query, timeout=ms / 1000 + 30))
            if waited.finished or (started and _core.left_the_queue(waited.task.status)):
                return waited
            if time.monotonic() >= deadline:
                return waited

    async def archive(self, task: str) -> Task:
        """Hide a finished task from the default list (``invalid-request`` while it runs)."""
        return Task.from_json(await self._call("archive", task))

    async def unarchive(self, task: str) -> Task:
        return Task.from_json(await self._call("unarchive", task))

    async def approve(self, task: str) -> Task:
        """Let a task held for approval start (refused when the policy does not allow you)."""
        return Task.from_json(await self._call("approve", task))

    async def pause(self, task: str) -> Task:
        """Hold a running task's process group stopped."""
        return Task.from_json(await self._call("pause", task))

    async def resume(self, task: str) -> Task:
        """Let a paused task go on."""
        return Task.from_json(await self._call("resume", task))

    async def delete(self, task: str) -> Task:
        """Delete a finished task for good (its record is kept for audit)."""
        return Task.from_json(await self._call("delete", task))

    async def status(self) -> Dict[str, Any]:
        """The cluster: leader, epoch, workers, tasks by status (as tenure reports it)."""
        data = await self._call("status")
        return dict(data) if isinstance(data, dict) else {}

    async def whoami(self) -> WhoAmI:
        return _core.whoami(await self._call("whoami"))

    async def notices(self, *, reconnects: int = _core.STREAM_RECONNECTS) -> AsyncGenerator[Notice, None]:
        """Your notices, live and without end: each task that ended unreported
        once (``ended``), and monitor matches (``matched``). The gateway
        remembers what was delivered: a new stream continues after it.
        Close the generator (``await .aclose()``) to leave early."""
        failures = 0
        req = build("notices")
        while True:
            try:
                async with self._http.stream(req.method, req.path, timeout=self._stream_timeout) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise _core.error_of(resp)
                    async for name, _id, data in _aevents(resp.aiter_lines()):
                        failures = 0
                        value = _core.decode(data)
                        if name == "error":
                            raise _core.stream_error(value)
                        notice = _core.notice_of(name, value)
                        if notice is not None:
                            yield notice
            except httpx.TransportError as e:
                failures += 1
                if failures > reconnects:
                    raise _core.unreachable(e) from e
                await asyncio.sleep(_core.backoff(failures))


async def _aevents(lines: AsyncIterator[str]) -> AsyncIterator[Any]:
    parser = _core.SseParser()
    async for line in lines:
        event = parser.feed(line)
        if event is not None:
            yield event


__all__ = ["AsyncClient", "AsyncOutputStream"]
