// @tenure/client: tenure's tasks over its HTTP gateway, from JavaScript and
// TypeScript (types in index.d.ts). ESM, no dependency beyond the platform's
// fetch; Node >= 18, Deno, Bun and browsers.

import { ROUTES, build } from "./routes.js";

export { ROUTES, build };

/** Statuses after which a task never changes again. */
export const TERMINAL = Object.freeze(["completed", "killed", "failed", "unknown"]);

/** Longest wait one request asks the gateway for (it caps waits at 60 s). */
const MAX_WAIT_MS = 60_000;
/** Reconnects a stream tries in a row, with growing pauses, before it gives up. */
const STREAM_RECONNECTS = 5;
/** A stream with no byte for this long is dead (the gateway sends keep-alives every 15 s). */
const STREAM_IDLE_MS = 60_000;

/**
 * A refusal of the gateway, or a failure to reach it: `code` is stable
 * (`not-found`, `unauthorized`, `invalid-spec`, … or `unreachable`),
 * `message` for people, `status` the HTTP status or `null` when there was
 * none (no answer, or an `error` event inside a stream).
 */
export class TenureError extends Error {
  constructor(code, message, status = null, options = undefined) {
    super(message, options);
    this.name = "TenureError";
    this.code = code;
    this.status = status;
  }
}

const env = (name) => globalThis.process?.env?.[name];
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const backoff = (failures) => Math.min(200 * 2 ** (failures - 1), 5000);

function unreachable(e) {
  return new TenureError("unreachable", `${e?.name ?? "Error"}: ${e?.cause?.message ?? e?.message ?? e}`, null, { cause: e });
}

async function errorOf(response) {
  const text = await response.text().catch(() => "");
  try {
    const body = JSON.parse(text);
    if (typeof body?.code === "string") return new TenureError(body.code, String(body.message ?? ""), response.status);
  } catch {
    // not JSON: reported below
  }
  return new TenureError("http", text.slice(0, 500) || response.statusText, response.status);
}

function streamError(data) {
  if (data && typeof data.code === "string") return new TenureError(data.code, String(data.message ?? ""), null);
  return new TenureError("stream", JSON.stringify(data), null);
}

function decode(data) {
  try {
    return JSON.parse(data);
  } catch (e) {
    throw new TenureError("bad-response", `event data is not JSON: ${e.message}`, null);
  }
}

/** Server-Sent Events of a response body, as `{event, id, data}`; comments skipped. */
async function* sseEvents(body, idleMs, abort) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let name = "";
  let id = "";
  let data = [];
  let idle;
  const arm = () => {
    clearTimeout(idle);
    idle = setTimeout(() => abort(new TenureError("unreachable", `no byte for ${idleMs} ms`, null)), idleMs);
  };
  try {
    arm();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      arm();
      buffer += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffer.search(/\r\n|\r|\n/)) >= 0) {
        const line = buffer.slice(0, nl);
        buffer = buffer.slice(nl + (buffer.startsWith("\r\n", nl) ? 2 : 1));
        if (line === "") {
          if (data.length) yield { event: name || "message", id, data: data.join("\n") };
          name = "";
          data = [];
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const key = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (key === "event") name = val;
        else if (key === "data") data.push(val);
        else if (key === "id") id = val;
      }
    }
  } finally {
    clearTimeout(idle);
    reader.cancel().catch(() => {});
  }
}

/**
 * A task's output followed live: `for await (const out of stream)` yields
 * `{offset, next_offset, text}` and ends when the task ended and every byte
 * was delivered (then `stream.end` is the task). A dropped connection is
 * resumed by itself from `stream.offset` (sent as `Last-Event-ID`); to resume
 * later, `client.follow(task, { offset: stream.offset })`.
 */
export class OutputStream {
  constructor(client, task, offset, { reconnects = STREAM_RECONNECTS, signal } = {}) {
    this.task = task;
    /** The byte offset after the last delivered output. */
    this.offset = offset;
    /** The task once the stream saw it end, else `null`. */
    this.end = null;
    this._client = client;
    this._reconnects = reconnects;
    this._signal = signal;
    this._resumed = false;
  }

  async *[Symbol.asyncIterator]() {
    let failures = 0;
    while (this.end === null) {
      const headers = this._resumed ? { "Last-Event-ID": String(this.offset) } : {};
      const req = build("follow", { task: this.task, query: { offset: this.offset }, headers });
      try {
        for await (const { event, data } of this._client._stream(req, this._signal)) {
          failures = 0;
          const value = decode(data);
          if (event === "output") {
            this.offset = value.next_offset;
            this._resumed = true;
            yield { offset: value.offset, next_offset: value.next_offset, text: value.text };
          } else if (event === "end") {
            this.end = value;
            return;
          } else if (event === "error") {
            throw streamError(value);
          }
        }
      } catch (e) {
        if (!(e instanceof TenureError && e.code === "unreachable") || this._signal?.aborted) throw e;
        failures += 1;
        if (failures > this._reconnects) throw e;
        await sleep(backoff(failures));
      }
      this._resumed = true;
    }
  }

  /** All the output until the task ends, as one string. */
  async text() {
    let all = "";
    for await (const out of this) all += out.text;
    return all;
  }
}

/**
 * tenure over its HTTP gateway. `url` and `token` default to the
 * environment's TENURE_URL and TENURE_TOKEN. Every refusal rejects with a
 * TenureError carrying the gateway's stable `code`.
 */
export class Client {
  constructor({ url = env("TENURE_URL"), token = env("TENURE_TOKEN"), timeoutMs = 30_000, fetch: f } = {}) {
    if (!url) throw new Error("no gateway URL: pass { url } or set TENURE_URL (e.g. http://127.0.0.1:8080)");
    if (!token) throw new Error("no token: pass { token } or set TENURE_TOKEN (tenure gateway token create ...)");
    this.url = String(url).replace(/\/+$/, "");
    this._token = token;
    this._timeoutMs = timeoutMs;
    this._fetch = f ?? globalThis.fetch.bind(globalThis);
  }

  _headers(extra, json) {
    return {
      Authorization: `Bearer ${this._token}`,
      Accept: json ? "application/json" : "text/event-stream",
      ...(json ? { "Content-Type": "application/json" } : {}),
      ...extra,
    };
  }

  async _call(verb, { timeoutMs, ...parts } = {}) {
    const req = build(verb, parts);
    let response;
    try {
      response = await this._fetch(this.url + req.path, {
        method: req.method,
        headers: this._headers(req.headers, true),
        body: req.body === undefined ? undefined : JSON.stringify(req.body),
        signal: AbortSignal.timeout(timeoutMs ?? this._timeoutMs),
      });
    } catch (e) {
      throw unreachable(e);
    }
    if (!response.ok) throw await errorOf(response);
    try {
      return await response.json();
    } catch (e) {
      throw new TenureError("bad-response", `not JSON: ${e.message}`, response.status);
    }
  }

  /** The events of one SSE request; network failures become `unreachable`. */
  async *_stream(req, signal) {
    const controller = new AbortController();
    let reason = null;
    const abort = (why) => {
      reason = why;
      controller.abort(why);
    };
    const onAbort = () => abort(signal.reason);
    signal?.addEventListener("abort", onAbort, { once: true });
    try {
      let response;
      try {
        response = await this._fetch(this.url + req.path, {
          method: req.method,
          headers: this._headers(req.headers, false),
          signal: controller.signal,
        });
      } catch (e) {
        throw signal?.aborted ? e : unreachable(e);
      }
      if (!response.ok) throw await errorOf(response);
      try {
        yield* sseEvents(response.body, STREAM_IDLE_MS, abort);
      } catch (e) {
        if (e instanceof TenureError) throw e;
        if (signal?.aborted) throw e;
        throw reason instanceof TenureError ? reason : unreachable(e);
      }
    } finally {
      signal?.removeEventListener("abort", onAbort);
      controller.abort();
    }
  }

  /**
   * Start a task: `command` runs as `sh -c COMMAND` (kind `shell` unless
   * given; `steps` instead of a command makes a workflow). The same
   * `idempotency_key` never makes a second task; without one a key is
   * generated and returned.
   */
  async submit(command, options = {}) {
    const idempotency_key = options.idempotency_key ?? globalThis.crypto.randomUUID();
    const body = { ...options, command: command ?? "", idempotency_key };
    const data = await this._call("submit", { body });
    return { task: data.task, existing: Boolean(data.existing), idempotency_key };
  }

  /**
   * Start many tasks in one request (1 to 1000), each `{ command, ...options }`
   * as `submit` takes them. All are checked before any is created: one
   * refusal creates none, and its message names the task's place (counting
   * from 1). The answers come in the order given, each with its key; send
   * the same batch again after an error and its keys return the tasks made.
   */
  async submitBatch(tasks) {
    const bodies = tasks.map(({ command, ...options }) => ({
      ...options,
      command: command ?? "",
      idempotency_key: options.idempotency_key ?? globalThis.crypto.randomUUID(),
    }));
    const data = await this._call("submit_batch", { body: { tasks: bodies } });
    if (!Array.isArray(data.tasks) || data.tasks.length !== bodies.length) {
      throw new TenureError("bad-response", `${data.tasks?.length} answers to a batch of ${bodies.length}`, 200);
    }
    return data.tasks.map((d, i) => ({
      task: d.task,
      existing: Boolean(d.existing),
      idempotency_key: bodies[i].idempotency_key,
    }));
  }

  /** One task (`not-found` when it does not exist or is not yours). */
  get(task) {
    return this._call("get", { task });
  }

  /** One page of your tasks; pass `page.next` as `after` for the next. */
  listPage({ all = false, after } = {}) {
    return this._call("list", { query: { all, after } });
  }

  /**
   * Your tasks, page after page, only those with a status in `status` when
   * given (a string or an array). Without `all` only active, unreported
   * tasks are listed.
   */
  async *iterTasks({ status, all = false } = {}) {
    const wanted = status === undefined ? null : new Set([status].flat());
    let after;
    for (;;) {
      const page = await this.listPage({ all, after });
      for (const t of page.tasks) if (wanted === null || wanted.has(t.status)) yield t;
      if (page.next === null || page.next === undefined) return;
      after = page.next;
    }
  }

  /** Every page of `iterTasks`, as an array. */
  async list(options = {}) {
    const out = [];
    for await (const t of this.iterTasks(options)) out.push(t);
    return out;
  }

  /**
   * Output from byte `offset` (at most `max` bytes, capped by the gateway).
   * A read reaching the end of a finished task's output reports it.
   */
  logs(task, { offset = 0, max } = {}) {
    return this._call("logs", { task, query: { offset, max } });
  }

  /** Follow output live from byte `offset`; see OutputStream. */
  follow(task, { offset = 0, reconnects, signal } = {}) {
    return new OutputStream(this, task, offset, { reconnects, signal });
  }

  /**
   * One message to a running `agent` task's stdin (a newline is added unless
   * `raw` or it ends with one). `input-in-doubt`: it may or may not have
   * arrived, and is never resent.
   */
  send(task, text, { raw = false } = {}) {
    return this._call("send", { task, body: { text, raw } });
  }

  /** Ask a task to stop; `reason` is kept on the task. */
  kill(task, { reason } = {}) {
    return this._call("kill", { task, query: { reason } });
  }

  /**
   * Wait at most `timeoutMs` for a task to end (any length: longer waits are
   * several requests). `finished` is false if it still runs. With `started`,
   * only until it left the queue for good (running, paused, stopping,
   * unknown, or ended): its `started_at` says whether it ran.
   */
  async wait(task, { timeoutMs = 60_000, started = false } = {}) {
    const deadline = Date.now() + timeoutMs;
    const until = started ? "started" : "ended";
    for (;;) {
      const ms = Math.max(0, Math.min(deadline - Date.now(), MAX_WAIT_MS));
      const waited = await this._call("wait", { task, query: { timeout_ms: ms, until }, timeoutMs: ms + 30_000 });
      const left = !["queued", "leased", "blocked"].includes(waited.task.status);
      if (waited.finished || (started && left) || Date.now() >= deadline) return waited;
    }
  }

  /** Hide a finished task from the default list (409 while it runs). */
  archive(task) {
    return this._call("archive", { task });
  }

  unarchive(task) {
    return this._call("unarchive", { task });
  }

  /** Let a task held for approval start (403 when the policy does not allow you). */
  approve(task) {
    return this._call("approve", { task });
  }

  /** Hold a running task's process group stopped. */
  pause(task) {
    return this._call("pause", { task });
  }

  /** Let a paused task go on. */
  resume(task) {
    return this._call("resume", { task });
  }

  /** Delete a finished task for good (its record is kept for audit). */
  delete(task) {
    return this._call("delete", { task });
  }

  /** The cluster: leader, epoch, workers, tasks by status. */
  status() {
    return this._call("status");
  }

  whoami() {
    return this._call("whoami");
  }

  /**
   * Your notices, live and without end: `{kind: "ended", task}` once per task
   * that ended unreported, `{kind: "matched", match}` for a monitor's
   * matching lines. `break` (or abort `signal`) to leave.
   */
  async *notices({ reconnects = STREAM_RECONNECTS, signal } = {}) {
    let failures = 0;
    for (;;) {
      try {
        for await (const { event, data } of this._stream(build("notices"), signal)) {
          failures = 0;
          const value = decode(data);
          if (event === "error") throw streamError(value);
          if (event === "ended") yield { kind: "ended", task: value };
          else if (event === "matched") yield { kind: "matched", match: value };
        }
      } catch (e) {
        if (!(e instanceof TenureError && e.code === "unreachable") || signal?.aborted) throw e;
        failures += 1;
        if (failures > reconnects) throw e;
        await sleep(backoff(failures));
      }
    }
  }
}
