// The client against a real cluster: every verb, its errors, output followed
// live and resumed, and notices.
import { test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { Client, TenureError } from "../src/index.js";
import { client, eventually, other, url, within } from "./helpers.js";

const tenure = client();

async function refusal(promise) {
  try {
    await promise;
  } catch (e) {
    assert.ok(e instanceof TenureError, `not a TenureError: ${e}`);
    return e;
  }
  assert.fail("expected a refusal");
}

const running = (task) => async () => ((await tenure.get(task)).status === "running" ? true : null);

test("submit is idempotent by key; wait and logs read by offset", async () => {
  const key = `build-${randomUUID()}`;
  const first = await tenure.submit("printf 'hello\\nworld\\n'", { idempotency_key: key, label: "greeting", env: { A: "1" } });
  assert.match(first.task, /^shell-\d+$/);
  assert.equal(first.existing, false);
  const again = await tenure.submit("printf 'hello\\nworld\\n'", { idempotency_key: key, label: "greeting", env: { A: "1" } });
  assert.deepEqual([again.task, again.existing], [first.task, true]);
  const generated = await tenure.submit("true");
  assert.ok(generated.idempotency_key && generated.task !== first.task);

  const waited = await tenure.wait(first.task, { timeoutMs: 60_000 });
  assert.equal(waited.finished, true);
  assert.equal(waited.task.status, "completed");
  assert.equal(waited.task.label, "greeting");
  assert.equal(waited.task.reported, true);

  const chunk = await tenure.logs(first.task);
  assert.deepEqual([chunk.text, chunk.offset, chunk.next_offset], ["hello\nworld\n", 0, 12]);
  const part = await tenure.logs(first.task, { offset: 6, max: 3 });
  assert.deepEqual([part.text, part.next_offset], ["wor", 9]);
  const end = await tenure.logs(first.task, { offset: 12 });
  assert.deepEqual([end.text, end.finished], ["", true]);
  const task = await tenure.get(first.task);
  assert.equal(task.id, first.task);
  assert.ok(task.created_at.endsWith("Z"));
});

test("a batch submits in order, all or nothing, and again by key", async () => {
  const key = `batch-${randomUUID()}`;
  const tasks = [
    { command: "echo one", idempotency_key: key },
    { command: "echo two", label: "second" },
    { kind: "noop", command: "-" },
  ];
  const done = await tenure.submitBatch(tasks);
  assert.deepEqual(done.map((d) => d.existing), [false, false, false]);
  assert.equal(done[0].idempotency_key, key);
  const numbers = done.map((d) => Number(d.task.split("-").pop()));
  assert.deepEqual(numbers, [...numbers].sort((a, b) => a - b));
  assert.match(done[2].task, /^noop-\d+$/);
  assert.equal((await tenure.wait(done[1].task, { timeoutMs: 60_000 })).task.label, "second");
  const again = await tenure.submitBatch(tasks.map((t, i) => ({ ...t, idempotency_key: done[i].idempotency_key })));
  assert.deepEqual(again.map((a) => [a.task, a.existing]), done.map((d) => [d.task, true]));

  const before = (await tenure.list({ all: true })).length;
  const e = await refusal(tenure.submitBatch([{ command: "true" }, { command: "true", retries: 3 }]));
  assert.equal(e.status, 400);
  assert.match(e.message, /task 2 of the batch/);
  assert.equal((await tenure.list({ all: true })).length, before, "nothing of a refused batch was stored");
});

test("a bounded wait returns unfinished while the task runs", async () => {
  const { task } = await tenure.submit("sleep 30");
  const waited = await tenure.wait(task, { timeoutMs: 300 });
  assert.equal(waited.finished, false);
  await tenure.kill(task);
});

test("a started wait returns once the task runs, not at its end", async () => {
  const { task } = await tenure.submit("sleep 30");
  const waited = await tenure.wait(task, { timeoutMs: 30_000, started: true });
  assert.deepEqual([waited.finished, waited.task.status], [false, "running"]);
  assert.ok(waited.task.started_at);
  await tenure.kill(task);
});

test("kill keeps the reason and the task ends killed", async () => {
  const { task } = await tenure.submit("sleep 60");
  await eventually(30_000, running(task));
  assert.deepEqual(await tenure.kill(task, { reason: "not needed any more" }), { task, result: "requested" });
  const waited = await tenure.wait(task, { timeoutMs: 60_000 });
  assert.equal(waited.task.status, "killed");
  assert.equal(waited.task.kill_reason, "not needed any more");
  assert.equal((await tenure.kill(task)).result, "already-finished");
});

test("send reaches an agent task's stdin; follow resumes from an offset", async () => {
  const { task } = await tenure.submit('while read -r l; do echo "got: $l"; [ "$l" = bye ] && exit 0; done', { kind: "agent" });
  const bytes = await eventually(30_000, async () => {
    try {
      return (await tenure.send(task, "hello")).bytes;
    } catch (e) {
      if (e instanceof TenureError && e.code === "not-running") return null;
      throw e;
    }
  });
  assert.equal(bytes, 6);
  const stream = tenure.follow(task);
  for await (const out of stream) {
    assert.deepEqual(out, { offset: 0, next_offset: 11, text: "got: hello\n" });
    break;
  }
  assert.equal(stream.offset, 11);
  assert.equal((await tenure.send(task, "bye\n")).bytes, 4);
  const rest = tenure.follow(task, { offset: stream.offset });
  assert.equal(await rest.text(), "got: bye\n");
  assert.equal(rest.end?.status, "completed");
  assert.equal(rest.offset, 20);
});

test("follow delivers everything in order and from the middle", async () => {
  const { task } = await tenure.submit("for i in 1 2 3 4; do echo line-$i; sleep 0.2; done");
  const events = [];
  const stream = tenure.follow(task);
  for await (const out of stream) events.push(out);
  assert.equal(events.map((e) => e.text).join(""), "line-1\nline-2\nline-3\nline-4\n");
  for (let i = 1; i < events.length; i++) assert.equal(events[i].offset, events[i - 1].next_offset);
  assert.equal(stream.end?.status, "completed");
  assert.equal(await tenure.follow(task, { offset: 7 }).text(), "line-2\nline-3\nline-4\n");
});

test("errors carry code, message and status", async () => {
  let e = await refusal(tenure.get("shell-999999999"));
  assert.deepEqual([e.code, e.status], ["not-found", 404]);
  assert.ok(e.message);
  e = await refusal(tenure.submit(""));
  assert.deepEqual([e.code, e.status], ["invalid-spec", 400]);
  e = await refusal(tenure.get("not an id"));
  assert.deepEqual([e.code, e.status], ["bad-task-id", 400]);

  const { task } = await tenure.submit("sleep 30");
  e = await refusal(tenure.send(task, "hi"));
  assert.deepEqual([e.code, e.status], ["no-input", 409]);
  e = await refusal(tenure.archive(task));
  assert.equal(e.status, 409);

  const bob = other();
  e = await refusal(bob.get(task));
  assert.equal(e.code, "not-found");
  e = await refusal(bob.kill(task));
  assert.equal(e.code, "not-found");
  assert.ok((await bob.list({ all: true })).every((t) => t.id !== task));
  e = await refusal(new Client({ url: url(), token: "tnr_nope_nope" }).whoami());
  assert.deepEqual([e.code, e.status], ["unauthorized", 401]);
  e = await refusal(new Client({ url: "http://127.0.0.1:9", token: "tnr_x" }).whoami());
  assert.deepEqual([e.code, e.status], ["unreachable", null]);
  await tenure.kill(task);
});

test("list pages and filters by status", async () => {
  const done = (await tenure.submit("true")).task;
  await tenure.wait(done, { timeoutMs: 60_000 });
  const { task } = await tenure.submit("sleep 30");
  await eventually(30_000, running(task));
  const ids = (tasks) => new Set(tasks.map((t) => t.id));
  assert.ok(ids(await tenure.list({ status: "running" })).has(task));
  assert.ok(!ids(await tenure.list({ status: "running", all: true })).has(done));
  assert.ok(ids(await tenure.list({ status: ["completed", "failed"], all: true })).has(done));
  assert.ok(!ids(await tenure.list()).has(done), "a reported task is not listed without `all`");
  const number = Number(done.split("-").pop());
  const after = await tenure.listPage({ all: true, after: number });
  assert.ok(after.tasks.every((t) => Number(t.id.split("-").pop()) > number));
  assert.ok(ids(after.tasks).has(task));
  await tenure.kill(task);
});

test("archive, unarchive, delete; whoami and status", async () => {
  const { task } = await tenure.submit("true");
  await tenure.wait(task, { timeoutMs: 60_000 });
  assert.equal((await tenure.archive(task)).board, "archived");
  assert.equal((await tenure.unarchive(task)).board, "active");
  assert.equal((await tenure.delete(task)).board, "deleted");
  assert.equal((await tenure.whoami()).identity, "alice");
  assert.equal(typeof (await tenure.status()), "object");
});

test("notices tell an unreported end once, and monitor matches", async () => {
  const reported = (await tenure.submit("echo read")).task;
  assert.equal((await tenure.wait(reported, { timeoutMs: 60_000 })).task.reported, true);
  const monitor = (await tenure.submit("echo start; echo ERROR disk full; echo done", { kind: "monitor", pattern: "ERROR" })).task;
  const unread = (await tenure.submit("echo nobody reads me")).task;
  const controller = new AbortController();
  const seen = [];
  const endedIds = () => seen.filter((n) => n.kind === "ended").map((n) => n.task.id);
  const stream = tenure.notices({ signal: controller.signal });
  const until = (done) =>
    within(120_000, async () => {
      for (;;) {
        const { value, done: over } = await stream.next();
        assert.ok(!over, "the notice stream ended");
        seen.push(value);
        if (done()) return;
      }
    });
  try {
    const matches = () =>
      seen.filter((n) => n.kind === "matched" && n.match.task === monitor).map((n) => [n.match.text.trim(), n.match.offset]);
    // The leader publishes notices side by side: a match may come after its task's end.
    await until(() => endedIds().includes(unread) && endedIds().includes(monitor) && matches().length > 0);
    assert.ok(!endedIds().includes(reported), "a reported task was noticed");
    const later = (await tenure.submit("echo later")).task;
    await until(() => endedIds().includes(later));
    assert.equal(endedIds().filter((id) => id === unread).length, 1, "an end was noticed twice");
    assert.deepEqual(matches(), [["ERROR disk full", 6]]);
  } finally {
    controller.abort();
    await stream.return();
  }
});
