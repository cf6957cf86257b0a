// Types of @tenure/client. The data types mirror the gateway's OpenAPI
// schemas (snake_case, as on the wire); the test suite checks them against
// /openapi.json.

export type Status =
  | "queued" | "blocked" | "leased" | "running" | "waiting" | "paused" | "stopping" | "completed" | "killed" | "failed" | "unknown";

/** Statuses after which a task never changes again. */
export declare const TERMINAL: readonly Status[];

/** Why an outcome could not be proved (`maybe-ran`, `worker-lost`, …) and what to do. */
export interface Hint {
  tag: string;
  message: string;
}

/** A task as the gateway shows it (schema `TaskView`). */
export interface Task {
  /** `<kind>-<n>`. */
  id: string;
  kind: string;
  label: string;
  owner: string;
  status: Status;
  detail: string | null;
  exit_code: number | null;
  output_dropped: number;
  attempt: number;
  epoch: number;
  worker: string | null;
  idempotent: boolean;
  kill_requested: boolean;
  kill_reason: string | null;
  hint: Hint | null;
  /** RFC 3339, UTC. */
  created_at: string;
  created_at_ms: number;
  started_at: string | null;
  started_at_ms: number | null;
  finished_at: string | null;
  finished_at_ms: number | null;
  reported: boolean;
  /** `active`, `archived` or `deleted`. */
  board: string;
  cleaned: boolean;
  parent: string | null;
  steps: unknown[];
  matches: number;
  final_output: boolean;
  /** Each ended attempt of a task with a retry policy, oldest first. */
  attempts: unknown[];
  /** A queued task that may not start before this time (RFC 3339, UTC). */
  not_before: string | null;
  not_before_ms: number | null;
  /** Its retry policy (`retries`, `backoff_ms`, `backoff_max_ms`, `on`). */
  retry: Record<string, unknown> | null;
  priority: number;
  /** Its placement constraints on worker labels, as written. */
  on: string[];
  /** Its concurrency key, and the limit it was submitted with. */
  concurrency_key: string | null;
  concurrency_limit: number | null;
  /** For an ended, `unknown` or paused task: can it go on as it is, and how to go on. */
  resumable: boolean | null;
  resume_how: string | null;
  /** Its resource limits (`memory_bytes`, `cpu_millis`, `pids`), when it has some. */
  resources: Record<string, unknown> | null;
  /**
   * An `agent` task with a resume command: the declaration (`spec`), the
   * values captured from its output (`captured`), `resumes`, the input kept
   * for its next attempt (`pending_input`) and the machine it resumes on.
   */
  agent_resume: Record<string, unknown> | null;
  /**
   * Its status history, derived from what its record keeps: entries of `at`,
   * `at_ms`, `what` (`submitted`, `attempt-started`, `attempt-ended`, `ended`,
   * …), `attempt`, `worker`, `detail`.
   */
  timeline: Record<string, unknown>[];
}

/** What `submit` sends besides the command (schema `SubmitBody`). */
export interface SubmitOptions {
  /** `shell` (default), `agent`, `monitor`, `workflow` (with `steps`), … */
  kind?: string;
  label?: string;
  cwd?: string;
  env?: Record<string, string>;
  /** May tenure run it again if its worker is lost? Default false. */
  idempotent?: boolean;
  /** For `monitor`: the regular expression a line must match. */
  pattern?: string;
  /** Workflow steps (shell commands, in order); give `""` as the command. */
  steps?: string[];
  final_output?: boolean;
  /** End the task past this much run time (it fails as `timed-out`). */
  timeout_ms?: number;
  /** End the task past this long without output (it fails as `idle-timeout`). */
  idle_timeout_ms?: number;
  /** Run an idempotent task again up to this many times after a failed attempt. */
  retries?: number;
  /** The first retry's delay (default 1000); later ones double, with jitter. */
  backoff_ms?: number;
  backoff_max_ms?: number;
  /** Which failures are retried: `exit`, `lost`, `timeout` (default: all). */
  retry_on?: string[];
  /** Do not start before this time (RFC 3339). */
  not_before?: string;
  /** Do not start before this many milliseconds after the submit. */
  not_before_in_ms?: number;
  /** Dispatch priority, -100 to 100 (higher first; default 0). */
  priority?: number;
  /** Run only on workers whose labels satisfy each: `gpu=a100`, `repo in (web,api)`, `!spot`. */
  on?: string[];
  /** Count against this key: at most its limit of its tasks run at once. */
  concurrency_key?: string;
  concurrency_limit?: number;
  /** Hold it `blocked` until someone allowed approves it. */
  hold?: boolean;
  /** Memory limit of all its processes (bytes); past it the task fails as `out-of-memory`. */
  memory_bytes?: number;
  /** CPU limit in thousandths of a CPU (`500`: half a CPU). */
  cpu_millis?: number;
  /** Most processes and threads alive at once. */
  pids?: number;
  /**
   * For an `agent` task: run this instead of leaving it `unknown` once its
   * machine proves its process gone; `{name}` takes a value `captures` found.
   */
  resume_command?: string;
  /** Regular expressions over its output lines: `session: (\S+)` captures `session`. */
  captures?: string[];
  /** Resume on any machine (its session is on shared storage). */
  resume_anywhere?: boolean;
  /** The same key never makes a second task; generated when absent. */
  idempotency_key?: string;
}

export interface Submitted {
  task: string;
  /** The key had made this task before. */
  existing: boolean;
  /** The key the submit was sent with: reuse it to retry. */
  idempotency_key: string;
}

export interface Page {
  tasks: Task[];
  /** Pass as `after` for the next page; null on the last. */
  next: number | null;
}

export interface LogChunk {
  offset: number;
  /** Pass as the next read's `offset`. */
  next_offset: number;
  text: string;
  /** The task ended and every byte is out. */
  finished: boolean;
}

/** Output a follow stream delivered: `text` spans `[offset, next_offset)`. */
export interface OutputEvent {
  offset: number;
  next_offset: number;
  text: string;
}

export interface Killed {
  task: string;
  /** `requested` or `already-finished`. */
  result: string;
}

export interface Sent {
  task: string;
  bytes: number;
  /** Kept for the task's resumed attempt (its machine lost its process). */
  kept: boolean;
}

export interface Waited {
  /** False when the time ran out first. */
  finished: boolean;
  task: Task;
}

export interface WhoAmI {
  identity: string;
  session: string;
  now_ms: number;
}

export interface Match {
  task: string;
  offset: number;
  text: string;
}

export type Notice = { kind: "ended"; task: Task } | { kind: "matched"; match: Match };

/** A refusal of the gateway, or a failure to reach it (`code` `unreachable`). */
export declare class TenureError extends Error {
  constructor(code: string, message: string, status?: number | null, options?: ErrorOptions);
  /** Stable and machine-readable: `not-found`, `unauthorized`, `invalid-spec`, … */
  readonly code: string;
  /** The HTTP status; null when there was none. */
  readonly status: number | null;
}

export interface Route {
  method: string;
  path: string;
  query?: string[];
  body?: string[];
  headers?: string[];
}

/** Every operation the client calls, by verb. */
export declare const ROUTES: Readonly<Record<string, Route>>;

export declare function build(
  verb: string,
  parts?: { task?: string; query?: Record<string, unknown>; body?: Record<string, unknown>; headers?: Record<string, string> },
): { method: string; path: string; headers: Record<string, string>; body: Record<string, unknown> | undefined };

export declare class OutputStream implements AsyncIterable<OutputEvent> {
  readonly task: string;
  /** The byte offset after the last delivered output. */
  readonly offset: number;
  /** The task once the stream saw it end. */
  readonly end: Task | null;
  [Symbol.asyncIterator](): AsyncIterator<OutputEvent>;
  /** All the output until the task ends. */
  text(): Promise<string>;
}

export interface ClientOptions {
  /** Defaults to TENURE_URL. */
  url?: string;
  /** Defaults to TENURE_TOKEN. */
  token?: string;
  /** Per request (waits add their own length). Default 30000. */
  timeoutMs?: number;
  fetch?: typeof globalThis.fetch;
}

export declare class Client {
  constructor(options?: ClientOptions);
  readonly url: string;
  submit(command: string, options?: SubmitOptions): Promise<Submitted>;
  /** 1 to 1000 tasks in one request: all created, or none (the error names the task). */
  submitBatch(tasks: Array<SubmitOptions & { command?: string }>): Promise<Submitted[]>;
  get(task: string): Promise<Task>;
  listPage(options?: { all?: boolean; after?: number }): Promise<Page>;
  iterTasks(options?: { status?: Status | Status[]; all?: boolean }): AsyncGenerator<Task, void>;
  list(options?: { status?: Status | Status[]; all?: boolean }): Promise<Task[]>;
  logs(task: string, options?: { offset?: number; max?: number }): Promise<LogChunk>;
  follow(task: string, options?: { offset?: number; reconnects?: number; signal?: AbortSignal }): OutputStream;
  send(task: string, text: string, options?: { raw?: boolean }): Promise<Sent>;
  kill(task: string, options?: { reason?: string }): Promise<Killed>;
  wait(task: string, options?: { timeoutMs?: number; started?: boolean }): Promise<Waited>;
  archive(task: string): Promise<Task>;
  unarchive(task: string): Promise<Task>;
  approve(task: string): Promise<Task>;
  pause(task: string): Promise<Task>;
  resume(task: string): Promise<Task>;
  delete(task: string): Promise<Task>;
  status(): Promise<Record<string, unknown>>;
  whoami(): Promise<WhoAmI>;
  notices(options?: { reconnects?: number; signal?: AbortSignal }): AsyncGenerator<Notice, void>;
}
