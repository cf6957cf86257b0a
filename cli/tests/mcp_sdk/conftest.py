"""Fixtures of the MCP suite: `tenure mcp` over stdio and the gateway's `/mcp`
over streamable HTTP, spoken to by the official MCP Python SDK (`mcp`).

The suite runs against a real cluster started by
`cargo nextest run -p tenure-cli --test clients` (cli/tests/clients.rs), which
sets:

- ``TENURE_BIN``: the `tenure` binary; ``TENURE_NATS``: the cluster's NATS URL;
  ``TENURE_SESSION``: the session `tenure mcp` acts as over stdio;
- ``TENURE_URL``, ``TENURE_TOKEN``, ``TENURE_TOKEN_OTHER``: the gateway and the
  bearer tokens of two identities;
- ``TENURE_CONTROL``: a folder through which a test asks the harness to
  restart the worker (see :func:`restart_worker`);
- ``TENURE_CLUSTER_DIR``: a folder holding a ``dev.env`` for the cluster, as
  `tenure dev` writes one (the example harness reads it).

Without them the suite fails rather than skip.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

T = TypeVar("T")

TOOLS = sorted(
    ["archive_task", "get_task", "list_tasks", "read_output", "send_input", "start_task", "stop_task", "wait_task"]
)


def env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: run this suite through `cargo nextest run -p tenure-cli --test clients`")
    return value


def stdio_params(session: Optional[str] = None) -> StdioServerParameters:
    """`tenure mcp` as a client launches it: a subprocess acting as ``session``."""
    return StdioServerParameters(
        command=env("TENURE_BIN"),
        args=["--nats", env("TENURE_NATS"), "--session", session or env("TENURE_SESSION"), "mcp"],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RUST_LOG": "warn"},
    )


def http_transport(token: str) -> Any:
    """The gateway's `/mcp`, authenticated by ``token``."""
    import httpx2

    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(90.0))
    return streamable_http_client(env("TENURE_URL") + "/mcp", http_client=http)


@asynccontextmanager
async def connect(server: Any, **kwargs: Any) -> AsyncIterator[Client]:
    async with Client(server, **kwargs) as client:
        yield client


def eventually(bound: float, check: Callable[[], Optional[T]]) -> T:
    """``check()``'s first non-None value, polled until ``bound`` seconds pass."""
    deadline = time.monotonic() + bound
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"no result within {bound} s")
        time.sleep(0.05)


def restart_worker() -> dict:
    """Asks the harness to SIGKILL the worker process (by its pid) and start
    it again; returns ``{"old_pid": …, "new_pid": …}`` once it did."""
    control = Path(env("TENURE_CONTROL"))
    done = control / "restart-worker.done"
    done.unlink(missing_ok=True)
    (control / "restart-worker.request").write_text("restart")

    def answered() -> Optional[dict]:
        try:
            return json.loads(done.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    answer = eventually(60, answered)
    done.unlink(missing_ok=True)
    return answer
