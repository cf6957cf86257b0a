"""The values the gateway answers with, as typed dataclasses, and the one
exception every refusal becomes.

Parsing is lenient about *new* fields (a newer gateway may add some) and
strict about missing ones: a field the client relies on that is absent is a
:class:`TenureError` with code ``bad-response``, never a ``KeyError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Literal, Mapping, Optional, Type, TypeVar, Union

#: Statuses a task can show; terminal ones never change again.
Status = Literal["queued", "leased", "running", "stopping", "completed", "killed", "failed", "unknown"]
TERMINAL = frozenset({"completed", "killed", "failed", "unknown"})


class TenureError(Exception):
    """A refusal of the gateway, or a failure to reach it.

    ``code`` is stable and machine-readable (``not-found``, ``unauthorized``,
    ``invalid-spec``, ``not-running``, ``no-input``, ``input-in-doubt``, …, or
    ``unreachable`` when no answer came); ``message`` is for people;
    ``status`` is the HTTP status, or ``None`` when there was none (no
    answer, or an ``error`` event inside a stream).
    """

    def __init__(self, code: str, message: str, status: Optional[int] = None) -> None:
        super().__init__(f"{code}: {message}" + (f" (HTTP {status})" if status is not None else ""))
        self.code = code
        self.message = message
        self.status = status


T = TypeVar("T")


def _from(cls: Type[T], data: Any) -> T:
    if not isinstance(data, Mapping):
        raise TenureError("bad-response", f"expected an object for {cls.__name__}, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    try:
        return cls(**{k: v for k, v in data.items() if k in known})
    except TypeError as e:
        raise TenureError("bad-response", f"{cls.__name__}: {e}") from e


@dataclass(frozen=True)
class Hint:
    """Why an outcome could not be proved (``maybe-ran``, ``worker-lost``, …) and what to do."""

    tag: str
    message: str


@dataclass(frozen=True)
class Task:
    """A task as the gateway shows it (the schema ``TaskView``)."""

    id: str
    kind: str
    label: str
    owner: str
    status: str
    detail: Optional[str]
    exit_code: Optional[int]
    output_dropped: int
    attempt: int
    epoch: int
    worker: Optional[str]
    idempotent: bool
    kill_requested: bool
    kill_reason: Optional[str]
    hint: Optional[Hint]
    created_at: str
    created_at_ms: int
    started_at: Optional[str]
    started_at_ms: Optional[int]
    finished_at: Optional[str]
    finished_at_ms: Optional[int]
    reported: bool
    board: str
    cleaned: bool
    parent: Optional[str]
    steps: List[Any]
    matches: int
    final_output: bool
    #: Each ended attempt of a task with a retry policy, oldest first.
    attempts: List[Any]
    #: A queued task that may not start before this time (RFC 3339, UTC).
    not_before: Optional[str]
    not_before_ms: Optional[int]
    #: Its retry policy (``retries``, ``backoff_ms``, ``backoff_max_ms``, ``on``).
    retry: Optional[Any]
    priority: int
    #: Its placement constraints on worker labels, as written (``gpu=a100``).
    on: List[str]
    #: Its concurrency key, and the limit it was submitted with.
    concurrency_key: Optional[str]
    concurrency_limit: Optional[int]
    #: For an ended, ``unknown`` or paused task: can it go on as it is, and how to go on.
    resumable: Optional[bool]
    resume_how: Optional[str]
    #: Its resource limits (``memory_bytes``, ``cpu_millis``, ``pids``), when it has some.
    resources: Optional[Any] = None
    #: An ``agent`` task with a resume command: the declaration (``spec``),
    #: the values captured from its output (``captured``), ``resumes``, the
    #: input kept for its next attempt (``pending_input``) and the machine it
    #: resumes on (``machine``).
    agent_resume: Optional[Any] = None
    #: Its status history, derived from what its record keeps: entries of
    #: ``at``, ``at_ms``, ``what`` (``submitted``, ``attempt-started``,
    #: ``attempt-ended``, ``ended``, …), ``attempt``, ``worker``, ``detail``.
    timeline: List[Any] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        """Ended for good: ``completed``, ``killed``, ``failed`` or ``unknown``."""
        return self.status in TERMINAL

    @staticmethod
    def from_json(data: Any) -> "Task":
        task = _from(Task, data)
        if isinstance(task.hint, Mapping):
            object.__setattr__(task, "hint", _from(Hint, task.hint))
        return task


@dataclass(frozen=True)
class Submitted:
    """What a submit made: the task id, and whether the idempotency key had made it before."""

    task: str
    existing: bool
    #: The idempotency key the submit was sent with (generated when none was given).
    idempotency_key: str = ""


@dataclass(frozen=True)
class Page:
    """One page of the caller's tasks; ``next`` continues it (``None`` on the last)."""

    tasks: List[Task]
    next: Optional[int]

    @staticmethod
    def from_json(data: Any) -> "Page":
        page = _from(Page, data)
        return Page([Task.from_json(t) for t in page.tasks or []], page.next)


@dataclass(frozen=True)
class LogChunk:
    """A piece of a task's output; pass ``next_offset`` as the next read's offset.

    ``finished`` is true once the attempt ended and every byte is out.
    """

    offset: int
    next_offset: int
    text: str
    finished: bool


@dataclass(frozen=True)
class OutputEvent:
    """Output that a follow stream delivered: ``text`` spans ``[offset, next_offset)``."""

    offset: int
    next_offset: int
    text: str


@dataclass(frozen=True)
class Killed:
    """A kill's answer: ``result`` is ``requested`` or ``already-finished``."""

    task: str
    result: str


@dataclass(frozen=True)
class Sent:
    """Input delivered to an agent task's stdin (or, ``kept``, kept for its
    resumed attempt: its machine lost its process)."""

    task: str
    bytes: int
    kept: bool = False


@dataclass(frozen=True)
class Waited:
    """A bounded wait's answer: ``finished`` is false when the time ran out first."""

    finished: bool
    task: Task

    @staticmethod
    def from_json(data: Any) -> "Waited":
        w = _from(Waited, data)
        return Waited(bool(w.finished), Task.from_json(w.task))


@dataclass(frozen=True)
class WhoAmI:
    identity: str
    session: str
    now_ms: int


@dataclass(frozen=True)
class Match:
    """A monitor's output line that matched its pattern."""

    task: str
    offset: int
    text: str


@dataclass(frozen=True)
class Notice:
    """One notice: ``kind`` is ``ended`` (``task`` is set; given once, only if
    nothing else reported the task) or ``matched`` (``match`` is set)."""

    kind: Literal["ended", "matched"]
    task: Optional[Task] = None
    match: Optional[Match] = None


Json = Union[Dict[str, Any], List[Any], str, int, float, bool, None]

__all__ = [
    "Hint",
    "Killed",
    "LogChunk",
    "Match",
    "Notice",
    "OutputEvent",
    "Page",
    "Sent",
    "Status",
    "Submitted",
    "Task",
    "TenureError",
    "TERMINAL",
    "Waited",
    "WhoAmI",
]
