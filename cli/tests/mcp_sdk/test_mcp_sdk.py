"""The task contract's MCP tools as the official MCP Python SDK sees them, over
stdio (`tenure mcp`) and over streamable HTTP (the gateway's `/mcp`), against
a real cluster: the tool list and its schemas, every tool, refusals as tool
errors, and each ending or matched line told once — as a log message where
the client asked for them, in the results otherwise — across a worker
restart."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, Optional

import anyio
import jsonschema
import pytest
from mcp import Client

from conftest import TOOLS, connect, env, http_transport, restart_worker, stdio_params

# One tool call may wait for at most 30 s (`wait_task` here); a generous bound on each.
CALL_BOUND = 90


class Session:
    """One connected client: calls tools, checks each result against the
    tool's declared output schema, and records every task and matched line
    it was told of, by results and by log messages."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.schemas: dict[str, dict] = {}
        self.told: list[str] = []  # task ids, from `unreported` and from `ended` messages
        self.matched: list[tuple[str, int]] = []  # (task, offset), from `matched` and messages
        self.messages: list[dict] = []

    async def load_schemas(self) -> list[Any]:
        tools = (await self.client.list_tools()).tools
        self.schemas = {t.name: t.output_schema for t in tools}
        return tools

    async def call(self, tool: str, **args: Any) -> tuple[bool, Any]:
        """(is_error, structured result or error text); never a protocol error."""
        with anyio.fail_after(CALL_BOUND):
            result = await self.client.call_tool(tool, args)
        if result.is_error:
            text = "".join(getattr(c, "text", "") for c in result.content)
            return True, text
        data = result.structured_content
        assert isinstance(data, dict), f"{tool}: no structured content: {result}"
        schema = self.schemas.get(tool)
        assert schema is not None, f"{tool}: no output schema listed"
        jsonschema.validate(data, schema)
        for t in data["unreported"]:
            assert t["reported"] is True, t
            self.told.append(t["id"])
        self.matched.extend((m["task"], m["offset"]) for m in data["matched"])
        return False, data

    async def ok(self, tool: str, **args: Any) -> dict:
        is_error, data = await self.call(tool, **args)
        assert not is_error, f"{tool} {args}: {data}"
        return data

    async def refused(self, tool: str, **args: Any) -> str:
        is_error, data = await self.call(tool, **args)
        assert is_error, f"{tool} {args} was not refused: {data}"
        assert isinstance(data, str) and data, "a refusal says why"
        return data

    async def on_log(self, params: Any) -> None:
        data = params.data
        assert params.logger == "tenure", params
        self.messages.append(data)
        if data.get("event") == "ended":
            self.told.append(data["task"]["id"])
        elif data.get("event") == "matched":
            self.matched.append((data["match"]["task"], data["match"]["offset"]))

    async def until(self, bound: float, check: Any) -> Any:
        """Polls ``check()`` (an async callable) until it returns non-None."""
        deadline = time.monotonic() + bound
        while True:
            value = await check()
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise AssertionError(f"no result within {bound} s")
            await anyio.sleep(0.1)


def run(main: Any) -> None:
    anyio.run(main)


# ---------------------------------------------------------------- the tool list


async def check_tool_list(s: Session) -> None:
    tools = await s.load_schemas()
    assert sorted(t.name for t in tools) == TOOLS
    for t in tools:
        assert t.description and len(t.description) > 40, t
        assert t.input_schema.get("type") == "object", t
        out = t.output_schema
        assert out is not None and out.get("type") == "object", f"{t.name}: no output schema"
        props = out.get("properties", {})
        for field in ("unreported", "matched"):
            assert field in props, f"{t.name}: output schema lacks {field}: {out}"
        jsonschema.Draft202012Validator.check_schema(out)
    start = next(t for t in tools if t.name == "start_task")
    for field in ("command", "kind", "label", "idempotency_key"):
        assert start.input_schema["properties"][field].get("description"), field
    read = next(t for t in tools if t.name == "read_output")
    for field in ("text", "next_offset", "more", "finished"):
        assert field in read.output_schema["properties"], field


def test_stdio_lists_every_tool_with_input_and_output_schemas() -> None:
    async def main() -> None:
        async with connect(stdio_params()) as client:
            await check_tool_list(Session(client))

    run(main)


def test_http_lists_every_tool_with_input_and_output_schemas() -> None:
    async def main() -> None:
        async with connect(http_transport(env("TENURE_TOKEN"))) as client:
            await check_tool_list(Session(client))

    run(main)


# ---------------------------------------------------------------- every tool


async def drive_every_tool(s: Session) -> None:
    await s.load_schemas()
    key = f"letters-{uuid.uuid4()}"
    started = await s.ok("start_task", command="printf 'ab\\ncd\\n'", label="letters", idempotency_key=key)
    task = started["task"]
    assert task.startswith("shell-") and started["existing"] is False, started
    waited = await s.ok("wait_task", task=task, timeout_ms=30000)
    assert waited["finished"] is True and waited["task"]["status"] == "completed", waited
    again = await s.ok("start_task", command="printf 'ab\\ncd\\n'", label="letters", idempotency_key=key)
    assert again["task"] == task and again["existing"] is True, "the idempotency key starts nothing twice"
    first = await s.ok("read_output", task=task, max_bytes=3)
    assert (first["text"], first["next_offset"], first["more"]) == ("ab\n", 3, True), first
    rest = await s.ok("read_output", task=task, offset=first["next_offset"])
    assert (rest["text"], rest["next_offset"]) == ("cd\n", 6), rest
    end = await s.ok("read_output", task=task, offset=6)
    assert end["text"] == "" and end["finished"] is True, end

    got = await s.ok("get_task", task=task)
    assert got["task"]["id"] == task and got["task"]["exit_code"] == 0 and got["task"]["reported"] is True
    listed = await s.ok("list_tasks", status="completed", all=True)
    assert task in [t["id"] for t in listed["tasks"]] and listed["omitted"] >= 0, listed
    assert (await s.ok("archive_task", task=task))["task"]["board"] == "archived"

    agent = (await s.ok("start_task", command='while read -r l; do echo "got: $l"; done', kind="agent"))["task"]

    async def sent() -> Optional[dict]:
        is_error, data = await s.call("send_input", task=agent, text="hello")
        return None if is_error else data

    assert (await s.until(30, sent))["bytes"] == 6

    async def echoed() -> Optional[dict]:
        out = await s.ok("read_output", task=agent)
        return out if out["text"] == "got: hello\n" else None

    await s.until(30, echoed)
    stopped = await s.ok("stop_task", task=agent, reason="done with it")
    assert stopped["result"] == "requested", stopped
    waited = await s.ok("wait_task", task=agent, timeout_ms=30000)
    assert waited["task"]["status"] == "killed" and waited["task"]["kill_reason"] == "done with it", waited
    # The letters may have ended before the wait (then start_task's own result
    # told it, once). So may the agent: its end races the wait after the stop
    # (a wait registered first reports it, and then it is never pushed; an end
    # that comes first is pushed, once). Either way each is told at most once.
    assert s.told.count(task) <= 1 and s.told.count(agent) <= 1, f"told again: {s.told}"


async def refusals(s: Session, foreign: str) -> None:
    """Each refusal is a tool error with a message, never a protocol error."""
    await s.load_schemas()
    assert "shell-999999" in await s.refused("get_task", task="shell-999999")
    assert "not a task id" in await s.refused("get_task", task="not an id")
    assert "command" in await s.refused("start_task", label="nothing to run")
    # Arguments of a wrong name or type are tool errors too, naming what is wrong.
    assert "taks" in await s.refused("get_task", taks="shell-1")
    assert "bad arguments" in await s.refused("read_output", task="shell-1", offset="ten")
    assert "bad arguments" in await s.refused("start_task", command="true", retries="many")
    # Another identity's task is refused as if it did not exist.
    for tool, args in [
        ("get_task", {}),
        ("read_output", {}),
        ("wait_task", {"timeout_ms": 100}),
        ("stop_task", {}),
        ("send_input", {"text": "hi"}),
        ("archive_task", {}),
    ]:
        message = await s.refused(tool, task=foreign, **args)
        assert foreign in message or "not found" in message.lower(), f"{tool}: {message}"
    sleeper = (await s.ok("start_task", command="sleep 30"))["task"]
    await s.refused("archive_task", task=sleeper)
    await s.refused("send_input", task=sleeper, text="input to a shell task")
    await s.ok("stop_task", task=sleeper)


async def foreign_task(server: Any) -> str:
    """A task of another owner."""
    async with connect(server) as client:
        other = Session(client)
        await other.load_schemas()
        return (await other.ok("start_task", command="true", label="not yours"))["task"]


def test_stdio_every_tool_and_every_refusal() -> None:
    async def main() -> None:
        foreign = await foreign_task(stdio_params(session=f"other-{uuid.uuid4().hex[:8]}"))
        async with connect(stdio_params()) as client:
            s = Session(client)
            await drive_every_tool(s)
            await refusals(s, foreign)

    run(main)


def test_http_every_tool_and_every_refusal() -> None:
    async def main() -> None:
        foreign = await foreign_task(http_transport(env("TENURE_TOKEN_OTHER")))
        async with connect(http_transport(env("TENURE_TOKEN"))) as client:
            s = Session(client)
            await drive_every_tool(s)
            await refusals(s, foreign)

    run(main)


def test_http_refuses_a_client_without_a_valid_token() -> None:
    import httpx2

    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    }
    headers = {"Accept": "application/json, text/event-stream"}
    for auth in [{}, {"Authorization": "Bearer tnr_not_a_token"}]:
        r = httpx2.post(env("TENURE_URL") + "/mcp", json=body, headers={**headers, **auth}, timeout=30)
        assert r.status_code == 401, (auth, r.status_code, r.text)
        assert r.json()["code"] == "unauthorized", r.text


# ---------------------------------------------------------------- told once


async def told_once_in_results(s: Session) -> None:
    """An ended task nobody read is listed in `unreported` of a later result,
    once; a monitor's matched line is in `matched`, once."""
    await s.load_schemas()
    quiet = (await s.ok("start_task", command="echo nobody reads me"))["task"]
    monitor = (
        await s.ok(
            "start_task",
            kind="monitor",
            pattern="ALERT",
            command="echo fine; echo 'ALERT disk full'; echo fine; sleep 600",
        )
    )["task"]

    async def heard() -> Optional[bool]:
        await s.ok("get_task", task=monitor)
        return True if quiet in s.told and (monitor, 5) in s.matched else None

    await s.until(60, heard)
    await s.ok("list_tasks")
    await s.ok("list_tasks", all=True)
    assert s.told.count(quiet) == 1, s.told
    assert s.matched.count((monitor, 5)) == 1, s.matched
    assert (await s.ok("get_task", task=quiet))["task"]["reported"] is True
    await s.ok("stop_task", task=monitor)


def test_http_tells_each_ending_and_match_once_in_results() -> None:
    async def main() -> None:
        async with connect(http_transport(env("TENURE_TOKEN"))) as client:
            await told_once_in_results(Session(client))

    run(main)


def test_stdio_without_log_level_tells_each_ending_once_in_results() -> None:
    async def main() -> None:
        session = f"results-{uuid.uuid4().hex[:8]}"
        async with connect(stdio_params(session=session), mode="legacy") as client:
            s = Session(client)
            await told_once_in_results(s)
            assert s.messages == [], "no log message without logging/setLevel"

    run(main)


# Log messages are what handshake-era clients have; the SDK warns that
# 2026-07-28 deprecates them (SEP-2577).
@pytest.mark.filterwarnings("ignore:The logging capability is deprecated")
def test_stdio_notice_arrives_once_as_a_log_message_across_a_worker_restart(tmp_path: Path) -> None:
    """A task runs while its worker is SIGKILLed and started again; it ends
    afterwards, and its end reaches the client once, as a log message; a
    later result does not list it again. Notices arrive in order, so a second
    task's notice after it proves no repeat was on its way."""
    gate = tmp_path / "go"

    async def main() -> None:
        session = f"notify-{uuid.uuid4().hex[:8]}"
        holder: dict[str, Session] = {}

        async def on_log(params: Any) -> None:
            await holder["s"].on_log(params)

        async with connect(stdio_params(session=session), mode="legacy", logging_callback=on_log) as client:
            s = holder["s"] = Session(client)
            await s.load_schemas()
            await client.set_logging_level("notice")
            command = f"while [ ! -e {gate} ]; do sleep 0.1; done; echo survived"
            task = (await s.ok("start_task", command=command, label="outlives its worker"))["task"]

            async def running() -> Optional[bool]:
                return True if (await s.ok("get_task", task=task))["task"]["status"] == "running" else None

            await s.until(60, running)
            pids = await anyio.to_thread.run_sync(restart_worker)
            assert pids["old_pid"] != pids["new_pid"], pids
            gate.write_text("go")

            async def noticed() -> Optional[bool]:
                return True if task in s.told else None

            await s.until(90, noticed)
            ended = [m for m in s.messages if m.get("event") == "ended" and m["task"]["id"] == task]
            assert len(ended) == 1, f"the end came as a log message once: {s.messages}"
            assert ended[0]["task"]["status"] == "completed" and task in ended[0]["message"]

            marker = (await s.ok("start_task", command="true", label="marker"))["task"]

            async def marker_noticed() -> Optional[bool]:
                return True if marker in s.told else None

            await s.until(60, marker_noticed)
            await s.ok("list_tasks", all=True)
            assert s.told.count(task) == 1 and s.told.count(marker) == 1, s.told
            got = await s.ok("get_task", task=task)
            assert got["task"]["reported"] is True and got["task"]["status"] == "completed", got
            out = await s.ok("read_output", task=task)
            assert out["text"] == "survived\n", out

    run(main)


@pytest.mark.filterwarnings("ignore:The logging capability is deprecated")
def test_a_2026_client_that_opts_in_per_request_gets_each_ending_once_as_a_log_message() -> None:
    """On MCP 2026-07-28 (no sessions), a request whose `_meta` opts in to
    log messages gets the news as messages before its result, over HTTP and
    over stdio, and the result's lists stay empty: still once."""

    async def main() -> None:
        servers = [
            ("http", http_transport(env("TENURE_TOKEN"))),
            ("stdio", stdio_params(session=f"modern-{uuid.uuid4().hex[:8]}")),
        ]
        for name, server in servers:
            holder: dict[str, Session] = {}

            async def on_log(params: Any) -> None:
                await holder["s"].on_log(params)

            async with connect(server, log_level="notice", logging_callback=on_log) as client:
                assert client.protocol_version == "2026-07-28", (name, client.protocol_version)
                s = holder["s"] = Session(client)
                await s.load_schemas()
                quiet = (await s.ok("start_task", command="echo quietly", label=name))["task"]

                async def heard() -> Optional[bool]:
                    await s.ok("get_task", task=quiet)
                    return True if quiet in s.told else None

                await s.until(60, heard)
                await s.ok("list_tasks", all=True)
                assert s.told.count(quiet) == 1, (name, s.told)
                ended = [m for m in s.messages if m.get("event") == "ended" and m["task"]["id"] == quiet]
                assert len(ended) == 1, f"{name}: told in a result instead of a log message: {s.messages}"

    run(main)


@pytest.mark.filterwarnings("ignore:The logging capability is deprecated")
def test_stdio_pushes_each_matched_line_once_as_a_log_message() -> None:
    """With `logging/setLevel`, a monitor's matched lines are pushed as they
    happen, between calls, each once, and never listed in a result too."""

    async def main() -> None:
        holder: dict[str, Session] = {}

        async def on_log(params: Any) -> None:
            await holder["s"].on_log(params)

        session = f"matches-{uuid.uuid4().hex[:8]}"
        async with connect(stdio_params(session=session), mode="legacy", logging_callback=on_log) as client:
            s = holder["s"] = Session(client)
            await s.load_schemas()
            await client.set_logging_level("notice")
            command = "echo fine; echo 'ALERT one'; echo fine; echo 'ALERT two'; sleep 600"
            monitor = (await s.ok("start_task", kind="monitor", pattern="ALERT", command=command))["task"]
            # ALERT one starts at byte 5, ALERT two at 5 + 10 + 5 = 20.
            want = [(monitor, 5), (monitor, 20)]

            async def pushed() -> Optional[bool]:
                return True if all(m in s.matched for m in want) else None

            await s.until(60, pushed)
            # A marker's end, told after these, gives a repeat time to show up.
            marker = (await s.ok("start_task", command="true", label="marker"))["task"]

            async def marker_told() -> Optional[bool]:
                return True if marker in s.told else None

            await s.until(60, marker_told)
            await s.ok("list_tasks", all=True)
            assert sorted(s.matched) == want, s.matched
            texts = [m["match"]["text"] for m in s.messages if m.get("event") == "matched"]
            # Order is not promised (a notice the leader had to send again may land later).
            assert sorted(texts) == ["ALERT one", "ALERT two"], s.messages
            await s.ok("stop_task", task=monitor)

    run(main)


def test_concurrent_calls_list_an_ending_once(tmp_path: Path) -> None:
    """Rounds of concurrent calls of one caller, while its task ends: the
    ending is listed by exactly one result of all of them."""
    gate = tmp_path / "end"

    async def main() -> None:
        async with connect(http_transport(env("TENURE_TOKEN"))) as client:
            s = Session(client)
            await s.load_schemas()
            task = (await s.ok("start_task", command=f"while [ ! -e {gate} ]; do sleep 0.05; done"))["task"]

            async def running() -> Optional[bool]:
                return True if (await s.ok("get_task", task=task))["task"]["status"] == "running" else None

            await s.until(60, running)
            gate.write_text("end")
            deadline = time.monotonic() + 60
            rounds_after = 0
            while rounds_after < 2:
                assert time.monotonic() < deadline, f"{task} was never told: {s.told}"
                async with anyio.create_task_group() as group:
                    for _ in range(8):
                        group.start_soon(s.ok, "list_tasks")
                if task in s.told:
                    rounds_after += 1
            assert s.told.count(task) == 1, s.told

    run(main)


@pytest.mark.filterwarnings("ignore:The logging capability is deprecated")
def test_http_notice_arrives_once_with_a_call_across_a_worker_restart(tmp_path: Path) -> None:
    """Over HTTP (stateless, MCP 2026-07-28, log messages asked for per
    request): a task outlives a SIGKILL and restart of its worker, ends, and
    its end comes once, as a log message with the next call."""
    gate = tmp_path / "go"

    async def main() -> None:
        holder: dict[str, Session] = {}

        async def on_log(params: Any) -> None:
            await holder["s"].on_log(params)

        async with connect(http_transport(env("TENURE_TOKEN")), log_level="notice", logging_callback=on_log) as client:
            s = holder["s"] = Session(client)
            await s.load_schemas()
            command = f"while [ ! -e {gate} ]; do sleep 0.1; done; echo survived"
            task = (await s.ok("start_task", command=command, label="outlives its worker"))["task"]

            async def running() -> Optional[bool]:
                return True if (await s.ok("get_task", task=task))["task"]["status"] == "running" else None

            await s.until(60, running)
            pids = await anyio.to_thread.run_sync(restart_worker)
            assert pids["old_pid"] != pids["new_pid"], pids
            gate.write_text("go")

            async def noticed() -> Optional[bool]:
                await s.ok("list_tasks")
                return True if task in s.told else None

            await s.until(90, noticed)
            await s.ok("list_tasks", all=True)
            assert s.told.count(task) == 1, s.told
            ended = [m for m in s.messages if m.get("event") == "ended" and m["task"]["id"] == task]
            assert len(ended) == 1 and ended[0]["task"]["status"] == "completed", s.messages

    run(main)
