#!/usr/bin/env python3
"""An agent harness that delegates background work to a tenure cluster
through MCP, with the official MCP Python SDK (`pip install mcp`).

It stands where a coding assistant's harness stands: it registers
`tenure mcp` as an MCP server over stdio, starts an `agent` task (a small
line-reading program standing in for a coding agent), sends it work, follows
its output by byte offset, asks it to finish, and is told of its end once —
as a log message, since it asks for them with `logging/setLevel`.

    python3 harness.py                      # starts `tenure dev` in a temporary folder, stops it at the end
    python3 harness.py --cluster .tenure-dev   # uses a running `tenure dev` (its dev.env)

Exit status 0 when the end was told exactly once; the last line says how.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import anyio
from mcp import Client
from mcp.client.stdio import StdioServerParameters

# The stand-in coding agent: reads one instruction per line, "works" on it,
# and leaves on `quit`. Any CLI agent reading its stdin fits here.
AGENT = (
    'echo "agent ready"; '
    "while read -r line; do "
    'case "$line" in '
    'quit) echo "agent: bye"; exit 0;; '
    '*) echo "agent: working on $line"; sleep 0.2; echo "agent: done with $line";; '
    "esac; done"
)
WORK = ["fix the flaky test", "write the changelog"]
# Every wait of the harness is bounded: a cluster that does not answer fails it.
BOUND = 90.0


def say(text: str) -> None:
    print(f"[harness] {text}", flush=True)


def read_env(path: Path) -> dict[str, str]:
    """KEY=VALUE lines, as `tenure dev` writes `dev.env`."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values


class DevCluster:
    """`tenure dev` in a temporary folder, stopped (by its pid) at the end."""

    def __init__(self, tenure: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tenure-harness-"))
        self.log = open(self.dir / "dev.log", "wb")
        self.proc = subprocess.Popen(
            [tenure, "dev", "--data-dir", str(self.dir / "data")],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        env_file = self.dir / "data" / "dev.env"
        deadline = time.monotonic() + BOUND
        while not env_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"tenure dev did not come up; its log:\n{(self.dir / 'dev.log').read_text()}")
            time.sleep(0.2)
        self.env = read_env(env_file)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # `tenure dev` stops its components in order
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Harness:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.told: list[str] = []  # task ids whose end reached us, by message or in a result
        self.how: dict[str, str] = {}

    async def on_log(self, params: Any) -> None:
        data = params.data if isinstance(params.data, dict) else {}
        if data.get("event") == "ended":
            task = data["task"]["id"]
            self.told.append(task)
            self.how.setdefault(task, "log message")
            say(f"notice: {data['message']}")
        elif data.get("event") == "matched":
            say(f"notice: {data['message']}")

    async def call(self, tool: str, **args: Any) -> tuple[bool, Any]:
        with anyio.fail_after(BOUND):
            result = await self.client.call_tool(tool, args)
        if result.is_error:
            return True, "".join(getattr(c, "text", "") for c in result.content)
        data = result.structured_content
        for t in data.get("unreported", []):
            self.told.append(t["id"])
            self.how.setdefault(t["id"], f"the `unreported` list of {tool}")
            say(f"told in a result: {t['id']} {t['status']}")
        return False, data

    async def ok(self, tool: str, **args: Any) -> dict:
        is_error, data = await self.call(tool, **args)
        if is_error:
            raise SystemExit(f"{tool} refused: {data}")
        return data

    async def until(self, what: str, check: Any) -> Any:
        deadline = time.monotonic() + BOUND
        while True:
            value = await check()
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise SystemExit(f"gave up waiting for {what}")
            await anyio.sleep(0.2)

    async def run(self) -> int:
        # Log messages are deprecated from MCP 2026-07-28 on (SEP-2577); on a
        # handshake-era session they are how a server pushes news.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            await self.client.set_logging_level("notice")
        task = (await self.ok("start_task", kind="agent", command=AGENT, label="stand-in coding agent"))["task"]
        say(f"started {task}")

        for line in WORK:
            # Refused (a tool error) until the agent's process runs: try again.
            async def sent(line: str = line) -> Optional[dict]:
                is_error, data = await self.call("send_input", task=task, text=line)
                return None if is_error else data

            await self.until(f"{task} to take input", sent)
            say(f"sent: {line}")

        offset, seen = 0, ""

        async def follow() -> Optional[bool]:
            nonlocal offset, seen
            out = await self.ok("read_output", task=task, offset=offset)
            if out["text"]:
                for line in out["text"].splitlines():
                    say(f"{task} | {line}")
                seen += out["text"]
            offset = out["next_offset"]
            return True if f"done with {WORK[-1]}" in seen else None

        await self.until(f"{task} to finish its work", follow)
        await self.ok("send_input", task=task, text="quit")
        say("sent: quit; waiting for the end notice")

        # No wait_task, no read to the end, no other call here: a wait or a
        # read would report the task itself, and any result could carry its
        # end in `unreported` first. The harness would go on with other work;
        # the end comes to it as a log message.
        async def told() -> Optional[bool]:
            return True if task in self.told else None

        try:
            await self.until(f"the end of {task}", told)
        except SystemExit:
            await self.ok("list_tasks")  # no message: results carry it instead
            if task not in self.told:
                raise
        # Later results never repeat it.
        await self.ok("list_tasks")
        await self.ok("get_task", task=task)
        count = self.told.count(task)
        status = (await self.ok("get_task", task=task))["task"]["status"]
        say(f"{task} ended {status}; told {count} time(s), by {self.how.get(task)}")
        return 0 if count == 1 and status == "completed" else 1


async def main(args: argparse.Namespace) -> int:
    dev: Optional[DevCluster] = None
    if args.cluster:
        env = read_env(Path(args.cluster) / "dev.env")
    else:
        say("starting tenure dev")
        dev = DevCluster(args.tenure)
        env = dev.env
    try:
        server = StdioServerParameters(
            command=args.tenure,
            args=["mcp"],
            env={**env, "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RUST_LOG": "warn"},
        )
        harness: dict[str, Harness] = {}

        async def on_log(params: Any) -> None:
            await harness["h"].on_log(params)

        # mode="legacy": the handshake-era session, in which a client asks for
        # log messages with logging/setLevel.
        async with Client(server, mode="legacy", logging_callback=on_log) as client:
            h = harness["h"] = Harness(client)
            tools = [t.name for t in (await client.list_tools()).tools]
            say(f"tenure mcp offers: {', '.join(tools)}")
            return await h.run()
    finally:
        if dev is not None:
            dev.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", help="the data folder of a running `tenure dev` (its dev.env is read)")
    parser.add_argument("--tenure", default=shutil.which("tenure") or "tenure", help="the tenure binary")
    sys.exit(anyio.run(main, parser.parse_args()))
