"""What the sync and async clients share: configuration, request bodies,
answers to values, errors, and the Server-Sent Events parser.

Nothing here does IO; the two clients differ only in how they wait.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Dict, FrozenSet, Iterable, Iterator, List, Mapping, Optional, Tuple

import httpx

from ._types import Killed, LogChunk, Match, Notice, OutputEvent, Sent, Submitted, Task, TenureError, WhoAmI

#: Longest wait one request asks the gateway for (it caps waits at 60 s).
MAX_WAIT_MS = 60_000
#: Reconnects a stream tries in a row, with growing pauses, before it gives up.
STREAM_RECONNECTS = 5
#: A stream with no byte (the gateway sends keep-alives every 15 s) for this long is dead.
STREAM_READ_TIMEOUT = 60.0


def settings(url: Optional[str], token: Optional[str]) -> Tuple[str, str]:
    """The gateway URL and token, from the arguments or ``TENURE_URL`` / ``TENURE_TOKEN``."""
    url = url or os.environ.get("TENURE_URL")
    token = token or os.environ.get("TENURE_TOKEN")
    if not url:
        raise ValueError("no gateway URL: pass url= or set TENURE_URL (e.g. http://127.0.0.1:8080)")
    if not token:
        raise ValueError("no token: pass token= or set TENURE_TOKEN (tenure gateway token create ...)")
    return url.rstrip("/"), token


def headers(token: str) -> Dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Accept": "application/json", "User-Agent": "tenure-client-python/0.1"}


def submit_body(command: str, options: Mapping[str, Any]) -> Tuple[Dict[str, Any], str]:
    """The submit body and its idempotency key (a new UUID when none was given:
    a submit retried with the key it returned never makes a second task)."""
    body = {"command": command, **options}
    key = body.get("idempotency_key") or str(uuid.uuid4())
    body["idempotency_key"] = key
    if body.get("env") is not None:
        body["env"] = {str(k): str(v) for k, v in body["env"].items()}
    if body.get("steps") is not None:
        body["steps"] = [str(s) for s in body["steps"]]
    return body, key


def error_of(response: httpx.Response) -> TenureError:
    """The gateway's ``{code, message}`` as a :class:`TenureError`."""
    try:
        data = response.json()
        return TenureError(str(data["code"]), str(data["message"]), response.status_code)
    except (ValueError, KeyError, TypeError):
        text = response.text[:500] if response.text else response.reason_phrase
        return TenureError("http", text, response.status_code)


def json_of(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        raise error_of(response)
    try:
        return response.json()
    except ValueError as e:
        raise TenureError("bad-response", f"not JSON: {e}", response.status_code) from e


def unreachable(e: Exception) -> TenureError:
    err = TenureError("unreachable", f"{type(e).__name__}: {e}")
    err.__cause__ = e
    return err


def left_the_queue(status: str) -> bool:
    """Whether a task in ``status`` has left the queue for good (what a wait
    with ``started`` waits for)."""
    return status not in ("queued", "leased", "blocked")


def wait_ms(left_s: float) -> int:
    return max(0, min(int(left_s * 1000), MAX_WAIT_MS))


def statuses(status: Optional[Any]) -> Optional[FrozenSet[str]]:
    if status is None:
        return None
    if isinstance(status, str):
        return frozenset({status})
    return frozenset(status)


class SseParser:
    """Server-Sent Events from lines (without their line ends), as
    ``(event, id, data)``; comments and keep-alives are skipped."""

    def __init__(self) -> None:
        self._name = ""
        self._id = ""
        self._data: List[str] = []

    def feed(self, line: str) -> Optional[Tuple[str, str, str]]:
        if line == "":
            if not self._data:
                self._name = ""
                return None
            event = (self._name or "message", self._id, "\n".join(self._data))
            self._name, self._data = "", []
            return event
        if line.startswith(":"):
            return None
        key, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if key == "event":
            self._name = value
        elif key == "data":
            self._data.append(value)
        elif key == "id":
            self._id = value
        return None


def events(lines: Iterable[str]) -> Iterator[Tuple[str, str, str]]:
    parser = SseParser()
    for line in lines:
        event = parser.feed(line)
        if event is not None:
            yield event


def decode(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as e:
        raise TenureError("bad-response", f"event data is not JSON: {e}") from e


def output_event(data: Any) -> OutputEvent:
    try:
        return OutputEvent(int(data["offset"]), int(data["next_offset"]), str(data["text"]))
    except (KeyError, TypeError, ValueError) as e:
        raise TenureError("bad-response", f"output event: {e}") from e


def stream_error(data: Any) -> TenureError:
    if isinstance(data, Mapping) and "code" in data:
        return TenureError(str(data["code"]), str(data.get("message", "")))
    return TenureError("stream", str(data))


def notice_of(name: str, data: Any) -> Optional[Notice]:
    if name == "ended":
        return Notice("ended", task=Task.from_json(data))
    if name == "matched":
        try:
            return Notice("matched", match=Match(str(data["task"]), int(data["offset"]), str(data["text"])))
        except (KeyError, TypeError, ValueError) as e:
            raise TenureError("bad-response", f"matched event: {e}") from e
    return None


def backoff(failures: int) -> float:
    """Pause before reconnect number ``failures`` (1-based): 0.2 s doubling, at most 5 s."""
    return min(0.2 * 2.0 ** (failures - 1), 5.0)


def log_chunk(data: Any) -> "LogChunk":
    try:
        return LogChunk(int(data["offset"]), int(data["next_offset"]), str(data["text"]), bool(data["finished"]))
    except (KeyError, TypeError, ValueError) as e:
        raise TenureError("bad-response", f"log chunk: {e}") from e


def submitted(data: Any, key: str) -> "Submitted":
    try:
        return Submitted(str(data["task"]), bool(data["existing"]), key)
    except (KeyError, TypeError) as e:
        raise TenureError("bad-response", f"submit answer: {e}") from e


def batch_bodies(tasks: Iterable[Mapping[str, Any]]) -> Tuple[List[Dict[str, Any]], List[str]]:
    """The bodies of a batch and their keys: each task as :meth:`submit`
    takes it (``command`` and its keyword arguments), a new key for each
    that has none."""
    bodies, keys = [], []
    for task in tasks:
        options = dict(task)
        body, key = submit_body(str(options.pop("command", "")), options)
        bodies.append(body)
        keys.append(key)
    return bodies, keys


def submitted_batch(data: Any, keys: List[str]) -> List["Submitted"]:
    try:
        done = data["tasks"]
        if len(done) != len(keys):
            raise TenureError("bad-response", f"{len(done)} answers to a batch of {len(keys)}")
        return [submitted(d, k) for d, k in zip(done, keys)]
    except (KeyError, TypeError) as e:
        raise TenureError("bad-response", f"batch answer: {e}") from e


def sent(data: Any) -> "Sent":
    try:
        return Sent(str(data["task"]), int(data["bytes"]), bool(data.get("kept", False)))
    except (KeyError, TypeError, ValueError) as e:
        raise TenureError("bad-response", f"send answer: {e}") from e


def killed(data: Any) -> "Killed":
    try:
        return Killed(str(data["task"]), str(data["result"]))
    except (KeyError, TypeError) as e:
        raise TenureError("bad-response", f"kill answer: {e}") from e


def whoami(data: Any) -> "WhoAmI":
    try:
        return WhoAmI(str(data["identity"]), str(data["session"]), int(data["now_ms"]))
    except (KeyError, TypeError, ValueError) as e:
        raise TenureError("bad-response", f"whoami answer: {e}") from e
