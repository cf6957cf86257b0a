"""The gateway routes this client calls, as data.

Every request the clients make is built from one entry of :data:`ROUTES`, and
the builder refuses a query parameter or body field the entry does not list.
The test suite checks each entry against the gateway's ``/openapi.json``, so
a route or field the gateway does not document cannot be sent unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple
from urllib.parse import quote


@dataclass(frozen=True)
class Route:
    """One operation of the gateway's API."""

    method: str
    #: The path template, with ``{id}`` for a task id.
    path: str
    query: Tuple[str, ...] = ()
    body: Tuple[str, ...] = ()
    headers: Tuple[str, ...] = ()


#: Every operation the clients call, by verb.
ROUTES: Dict[str, Route] = {
    "submit_batch": Route("POST", "/v1/tasks/batch", body=("tasks",)),
    "submit": Route(
        "POST",
        "/v1/tasks",
        body=(
            "kind",
            "command",
            "label",
            "cwd",
            "env",
            "idempotent",
            "pattern",
            "steps",
            "final_output",
            "timeout_ms",
            "idle_timeout_ms",
            "retries",
            "backoff_ms",
            "backoff_max_ms",
            "retry_on",
            "not_before",
            "not_before_in_ms",
            "priority",
            "on",
            "concurrency_key",
            "concurrency_limit",
            "hold",
            "memory_bytes",
            "cpu_millis",
            "pids",
            "resume_command",
            "captures",
            "resume_anywhere",
            "idempotency_key",
        ),
        headers=("Idempotency-Key",),
    ),
    "list": Route("GET", "/v1/tasks", query=("all", "after", "order", "before")),
    "get": Route("GET", "/v1/tasks/{id}"),
    "delete": Route("DELETE", "/v1/tasks/{id}"),
    "logs": Route("GET", "/v1/tasks/{id}/logs", query=("offset", "max")),
    "follow": Route("GET", "/v1/tasks/{id}/logs/stream", query=("offset",), headers=("Last-Event-ID",)),
    "kill": Route("POST", "/v1/tasks/{id}/kill", query=("reason",)),
    "send": Route("POST", "/v1/tasks/{id}/input", body=("text", "raw")),
    "wait": Route("GET", "/v1/tasks/{id}/wait", query=("timeout_ms", "until")),
    "archive": Route("POST", "/v1/tasks/{id}/archive"),
    "unarchive": Route("POST", "/v1/tasks/{id}/unarchive"),
    "approve": Route("POST", "/v1/tasks/{id}/approve"),
    "pause": Route("POST", "/v1/tasks/{id}/pause"),
    "resume": Route("POST", "/v1/tasks/{id}/resume"),
    "status": Route("GET", "/v1/status"),
    "whoami": Route("GET", "/v1/whoami"),
    "notices": Route("GET", "/v1/notices/stream"),
}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    params: Dict[str, str]
    json: Optional[Dict[str, Any]]
    headers: Dict[str, str]


def build(
    verb: str,
    task: Optional[str] = None,
    query: Optional[Mapping[str, Any]] = None,
    body: Optional[Mapping[str, Any]] = None,
    headers: Optional[Mapping[str, str]] = None,
) -> Request:
    """The request for ``verb``; ``None`` values are left out.

    Raises ``ValueError`` for a parameter the route does not list: that is a
    bug of this client, never of its caller.
    """
    route = ROUTES[verb]
    path = route.path
    if "{id}" in path:
        if not task:
            raise ValueError(f"{verb}: a task id is required")
        path = path.replace("{id}", quote(str(task), safe=""))
    params: Dict[str, str] = {}
    for k, v in (query or {}).items():
        if k not in route.query:
            raise ValueError(f"{verb}: query parameter {k!r} is not part of the route")
        if v is None:
            continue
        params[k] = ("true" if v else "false") if isinstance(v, bool) else str(v)
    json: Optional[Dict[str, Any]] = None
    if body is not None:
        json = {}
        for k, v in body.items():
            if k not in route.body:
                raise ValueError(f"{verb}: body field {k!r} is not part of the route")
            if v is not None:
                json[k] = v
    sent_headers: Dict[str, str] = {}
    for k, v in (headers or {}).items():
        if k not in route.headers:
            raise ValueError(f"{verb}: header {k!r} is not part of the route")
        sent_headers[k] = v
    return Request(route.method, path, params, json, sent_headers)
