"""The blocking client against a real cluster: every verb, its errors, and
output followed live and resumed."""

from __future__ import annotations

import concurrent.futures
import uuid
from typing import Callable, Generator, List, Optional

import pytest

from conftest import eventually
from tenure_client import Client, Notice, Task, TenureError


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_submit_is_idempotent_by_key_and_wait_and_logs_read_by_offset(client: Client) -> None:
    key = unique("build")
    first = client.submit("printf 'hello\\nworld\\n'", idempotency_key=key, label="greeting", env={"A": "1"})
    assert first.task.startswith("shell-") and not first.existing and first.idempotency_key == key
    again = client.submit("printf 'hello\\nworld\\n'", idempotency_key=key, label="greeting", env={"A": "1"})
    assert (again.task, again.existing) == (first.task, True)
    generated = client.submit("true")
    assert generated.idempotency_key and generated.task != first.task

    waited = client.wait(first.task, timeout=60)
    assert waited.finished and waited.task.status == "completed" and waited.task.terminal
    assert waited.task.exit_code == 0 and waited.task.label == "greeting" and waited.task.reported

    chunk = client.logs(first.task)
    assert (chunk.text, chunk.offset, chunk.next_offset) == ("hello\nworld\n", 0, 12)
    tail = client.logs(first.task, offset=chunk.next_offset - 6, max=3)
    assert (tail.text, tail.next_offset) == ("wor", 9)
    end = client.logs(first.task, offset=12)
    assert (end.text, end.finished) == ("", True)

    task = client.get(first.task)
    assert isinstance(task, Task) and task.id == first.task and task.kind == "shell"
    assert task.created_at.endswith("Z") and task.finished_at_ms is not None


def test_a_batch_submits_in_order_all_or_nothing_and_again_by_key(client: Client) -> None:
    key = unique("batch")
    tasks = [
        {"command": "echo one", "idempotency_key": key},
        {"command": "echo two", "label": "second"},
        {"kind": "noop", "command": "-"},
    ]
    done = client.submit_batch(tasks)
    assert [d.existing for d in done] == [False, False, False]
    assert done[0].idempotency_key == key and all(d.idempotency_key for d in done)
    numbers = [int(d.task.rsplit("-", 1)[1]) for d in done]
    assert numbers == sorted(numbers) and done[2].task.startswith("noop-")
    assert client.wait(done[1].task, timeout=60).task.label == "second"
    # Sent again with the keys it returned: the same tasks.
    again = client.submit_batch([{**t, "idempotency_key": d.idempotency_key} for t, d in zip(tasks, done)])
    assert [(a.task, a.existing) for a in again] == [(d.task, True) for d in done]

    before = len(client.list(all=True))
    with pytest.raises(TenureError) as refused:
        client.submit_batch([{"command": "true"}, {"command": "true", "retries": 3}])
    assert refused.value.status == 400 and "task 2 of the batch" in refused.value.message
    with pytest.raises(TenureError) as empty:
        client.submit_batch([])
    assert empty.value.code == "invalid-batch"
    assert len(client.list(all=True)) == before, "nothing of a refused batch was stored"


def test_a_bounded_wait_returns_unfinished_while_the_task_runs(client: Client) -> None:
    task = client.submit("sleep 30").task
    waited = client.wait(task, timeout=0.3)
    assert not waited.finished and not waited.task.terminal
    client.kill(task, reason="test over")


def test_a_started_wait_returns_once_the_task_runs_not_at_its_end(client: Client) -> None:
    task = client.submit("sleep 30").task
    waited = client.wait(task, timeout=30, started=True)
    assert not waited.finished and waited.task.status == "running" and waited.task.started_at
    client.kill(task, reason="test over")


def test_kill_keeps_the_reason_and_the_task_ends_killed(client: Client) -> None:
    task = client.submit("sleep 60").task
    eventually(30, lambda: client.get(task).status == "running" or None)
    killed = client.kill(task, reason="not needed any more")
    assert (killed.task, killed.result) == (task, "requested")
    waited = client.wait(task, timeout=60)
    assert waited.finished and waited.task.status == "killed"
    assert waited.task.kill_reason == "not needed any more" and waited.task.kill_requested
    assert client.kill(task).result == "already-finished"


def test_send_reaches_an_agent_task_stdin(client: Client) -> None:
    task = client.submit(
        'while read -r l; do echo "got: $l"; [ "$l" = bye ] && exit 0; done', kind="agent"
    ).task

    def sent() -> Optional[int]:
        try:
            return client.send(task, "hello").bytes
        except TenureError as e:
            if e.code == "not-running":
                return None
            raise

    assert eventually(30, sent) == 6
    assert client.send(task, "bye\n").bytes == 4
    stream = client.follow(task)
    assert stream.text() == "got: hello\ngot: bye\n"
    assert stream.end is not None and stream.end.status == "completed"


def test_follow_delivers_everything_and_resumes_from_an_offset(client: Client) -> None:
    task = client.submit("for i in 1 2 3 4; do echo line-$i; sleep 0.2; done").task
    # Followed at once: while the task is only queued or leased the stream waits.
    stream = client.follow(task)
    first = next(iter(stream))
    assert first.offset == 0 and first.text.startswith("line-1\n")
    assert stream.offset == first.next_offset
    # A new stream from where the first one stopped: nothing lost, nothing twice.
    rest = client.follow(task, offset=stream.offset)
    events = list(rest)
    assert first.text + "".join(e.text for e in events) == "line-1\nline-2\nline-3\nline-4\n"
    assert rest.end is not None and rest.end.status == "completed" and rest.offset == 28
    for before, after in zip(events, events[1:]):
        assert before.next_offset == after.offset
    # Followed from the middle of a finished task.
    assert client.follow(task, offset=7).text() == "line-2\nline-3\nline-4\n"


def test_errors_carry_code_message_and_status(client: Client, url: str, other_token: str) -> None:
    with pytest.raises(TenureError) as e:
        client.get("shell-999999999")
    assert (e.value.code, e.value.status) == ("not-found", 404) and e.value.message
    with pytest.raises(TenureError) as e:
        client.submit("")
    assert (e.value.code, e.value.status) == ("invalid-spec", 400)
    with pytest.raises(TenureError) as e:
        client.get("not an id")
    assert (e.value.code, e.value.status) == ("bad-task-id", 400)

    running = client.submit("sleep 30").task
    with pytest.raises(TenureError) as e:
        client.send(running, "hi")
    assert (e.value.code, e.value.status) == ("no-input", 409)
    with pytest.raises(TenureError) as e:
        client.archive(running)
    assert e.value.status == 409

    # Another identity's task does not exist for it.
    with Client(url, other_token) as bob:
        with pytest.raises(TenureError) as e:
            bob.get(running)
        assert e.value.code == "not-found"
        with pytest.raises(TenureError) as e:
            bob.kill(running)
        assert e.value.code == "not-found"
        assert all(t.id != running for t in bob.list(all=True))
    with Client(url, "tnr_nope_nope") as stranger:
        with pytest.raises(TenureError) as e:
            stranger.whoami()
        assert (e.value.code, e.value.status) == ("unauthorized", 401)
    client.kill(running)

    with Client("http://127.0.0.1:9", "tnr_x") as nowhere:
        with pytest.raises(TenureError) as e:
            nowhere.whoami()
        assert e.value.code == "unreachable" and e.value.status is None


def test_list_pages_and_filters_by_status(client: Client) -> None:
    done = client.submit("true").task
    client.wait(done, timeout=60)
    running = client.submit("sleep 30").task
    eventually(30, lambda: client.get(running).status == "running" or None)

    assert running in {t.id for t in client.list("running")}
    assert done not in {t.id for t in client.list("running", all=True)}
    assert done in {t.id for t in client.list(["completed", "failed"], all=True)}
    # Without `all`, a reported task is not listed.
    assert done not in {t.id for t in client.list()}

    page = client.list_page(all=True)
    assert page.tasks and all(isinstance(t, Task) for t in page.tasks)
    number = int(done.rsplit("-", 1)[1])
    after = client.list_page(all=True, after=number)
    assert all(int(t.id.rsplit("-", 1)[1]) > number for t in after.tasks)
    assert running in {t.id for t in after.tasks}
    client.kill(running)


def test_archive_unarchive_delete(client: Client) -> None:
    task = client.submit("true").task
    client.wait(task, timeout=60)
    assert client.archive(task).board == "archived"
    assert client.unarchive(task).board == "active"
    assert client.delete(task).board == "deleted"


def test_whoami_and_status(client: Client) -> None:
    me = client.whoami()
    assert me.identity == "alice" and me.session and me.now_ms > 0
    status = client.status()
    assert status, "the cluster status is an object"


class NoticeReader:
    """One notice stream, read on a thread so that every read is bounded.

    One stream for the whole test: a notice that a closed stream had already
    taken from the gateway comes again only after the gateway's redelivery
    delay (about 30 s)."""

    def __init__(self, client: Client) -> None:
        self.seen: List[Notice] = []
        self._stream: Generator[Notice, None, None] = client.notices()
        self._pool = concurrent.futures.ThreadPoolExecutor(1)

    def until(self, done: Callable[[Notice], bool], bound: float) -> Notice:
        def read() -> Notice:
            for notice in self._stream:
                self.seen.append(notice)
                if done(notice):
                    return notice
            raise AssertionError("the notice stream ended")

        return self._pool.submit(read).result(timeout=bound)

    def close(self) -> None:
        """Closes the stream (on the reading thread, unless a read is stuck there)."""
        self._pool.submit(self._stream.close)
        self._pool.shutdown(wait=False)


def ended(task: str) -> Callable[[Notice], bool]:
    return lambda n: n.kind == "ended" and n.task is not None and n.task.id == task


def test_notices_tell_an_unreported_end_once_and_monitor_matches(client: Client) -> None:
    reader = NoticeReader(client)
    try:
        reported = client.submit("echo read").task
        assert client.wait(reported, timeout=60).task.reported
        monitor = client.submit("echo start; echo ERROR disk full; echo done", kind="monitor", pattern="ERROR").task
        unread = client.submit("echo nobody reads me").task

        notice = reader.until(ended(unread), 90)
        assert notice.task is not None and notice.task.status == "completed" and notice.task.reported
        if not any(ended(monitor)(n) for n in reader.seen):
            reader.until(ended(monitor), 90)

        def matched(n: Notice) -> bool:
            return n.match is not None and n.match.task == monitor

        # Order is not promised (a notice the leader had to send again may
        # land later): a match may come after its task's end.
        if not any(matched(n) for n in reader.seen):
            reader.until(matched, 90)
        assert not any(ended(reported)(n) for n in reader.seen), "a reported task was noticed"

        # Once: a task ending later is noticed, the earlier ones and the match not again.
        later = client.submit("echo later").task
        reader.until(ended(later), 90)
        ends = [n.task.id for n in reader.seen if n.kind == "ended" and n.task is not None]
        assert ends.count(unread) == 1 and ends.count(monitor) == 1, ends
        matches = [n.match for n in reader.seen if matched(n)]
        assert [(m.text.strip(), m.offset) for m in matches if m is not None] == [("ERROR disk full", 6)]
    finally:
        reader.close()


def test_a_closed_stream_loses_no_notice(client: Client) -> None:
    """A reader that leaves hands back what it had not shown: the next
    stream gets it (after the gateway's redelivery delay at worst)."""
    first = NoticeReader(client)
    before = client.submit("echo before").task
    first.until(ended(before), 90)
    first.close()
    after = client.submit("echo after").task
    second = NoticeReader(client)
    try:
        notice = second.until(ended(after), 120)
        assert notice.task is not None and notice.task.status == "completed"
    finally:
        second.close()
