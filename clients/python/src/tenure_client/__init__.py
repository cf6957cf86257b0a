"""tenure-client: tenure's tasks over its HTTP gateway, from Python.

>>> from tenure_client import Client
>>> with Client("http://127.0.0.1:8080", token) as tenure:
...     task = tenure.submit("make test", idempotency_key="test-42").task
...     for out in tenure.follow(task):
...         print(out.text, end="")

:class:`Client` blocks, :class:`AsyncClient` awaits; both raise
:class:`TenureError` for every refusal.
"""

from ._async import AsyncClient, AsyncOutputStream
from ._routes import ROUTES, Route
from ._sync import Client, OutputStream
from ._types import (
    TERMINAL,
    Hint,
    Killed,
    LogChunk,
    Match,
    Notice,
    OutputEvent,
    Page,
    Sent,
    Status,
    Submitted,
    Task,
    TenureError,
    Waited,
    WhoAmI,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncOutputStream",
    "Client",
    "Hint",
    "Killed",
    "LogChunk",
    "Match",
    "Notice",
    "OutputEvent",
    "OutputStream",
    "Page",
    "ROUTES",
    "Route",
    "Sent",
    "Status",
    "Submitted",
    "Task",
    "TenureError",
    "TERMINAL",
    "Waited",
    "WhoAmI",
]
