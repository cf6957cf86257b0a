// The gateway routes this client calls, as data. Every request is built from
// one entry, and the builder refuses a query parameter, header or body field
// the entry does not list; the test suite checks each entry against the
// gateway's /openapi.json.

/** @type {Record<string, {method: string, path: string, query?: string[], body?: string[], headers?: string[]}>} */
export const ROUTES = Object.freeze({
  submit_batch: { method: "POST", path: "/v1/tasks/batch", body: ["tasks"] },
  submit: {
    method: "POST",
    path: "/v1/tasks",
    body: [
      "kind", "command", "label", "cwd", "env", "idempotent", "pattern", "steps",
      "final_output", "timeout_ms", "idle_timeout_ms", "retries", "backoff_ms", "backoff_max_ms",
      "retry_on", "not_before", "not_before_in_ms", "priority", "on", "concurrency_key", "concurrency_limit",
      "hold", "memory_bytes", "cpu_millis", "pids", "resume_command", "captures", "resume_anywhere",
      "idempotency_key",
    ],
    headers: ["Idempotency-Key"],
  },
  list: { method: "GET", path: "/v1/tasks", query: ["all", "after", "order", "before"] },
  get: { method: "GET", path: "/v1/tasks/{id}" },
  delete: { method: "DELETE", path: "/v1/tasks/{id}" },
  logs: { method: "GET", path: "/v1/tasks/{id}/logs", query: ["offset", "max"] },
  follow: { method: "GET", path: "/v1/tasks/{id}/logs/stream", query: ["offset"], headers: ["Last-Event-ID"] },
  kill: { method: "POST", path: "/v1/tasks/{id}/kill", query: ["reason"] },
  send: { method: "POST", path: "/v1/tasks/{id}/input", body: ["text", "raw"] },
  wait: { method: "GET", path: "/v1/tasks/{id}/wait", query: ["timeout_ms", "until"] },
  archive: { method: "POST", path: "/v1/tasks/{id}/archive" },
  unarchive: { method: "POST", path: "/v1/tasks/{id}/unarchive" },
  approve: { method: "POST", path: "/v1/tasks/{id}/approve" },
  pause: { method: "POST", path: "/v1/tasks/{id}/pause" },
  resume: { method: "POST", path: "/v1/tasks/{id}/resume" },
  status: { method: "GET", path: "/v1/status" },
  whoami: { method: "GET", path: "/v1/whoami" },
  notices: { method: "GET", path: "/v1/notices/stream" },
});

/**
 * The request for `verb`: its method, path with query string, headers and
 * JSON body. `undefined` and `null` values are left out. Throws for a
 * parameter the route does not list (a bug of this client, not its caller).
 */
export function build(verb, { task, query, body, headers } = {}) {
  const route = ROUTES[verb];
  if (!route) throw new Error(`unknown verb ${verb}`);
  let path = route.path;
  if (path.includes("{id}")) {
    if (!task) throw new Error(`${verb}: a task id is required`);
    path = path.replace("{id}", encodeURIComponent(String(task)));
  }
  const params = new URLSearchParams();
  for (const [k, v] of Object.entries(query ?? {})) {
    if (!(route.query ?? []).includes(k)) throw new Error(`${verb}: query parameter ${k} is not part of the route`);
    if (v !== undefined && v !== null) params.set(k, String(v));
  }
  let json;
  if (body !== undefined) {
    json = {};
    for (const [k, v] of Object.entries(body)) {
      if (!(route.body ?? []).includes(k)) throw new Error(`${verb}: body field ${k} is not part of the route`);
      if (v !== undefined && v !== null) json[k] = v;
    }
  }
  const sent = {};
  for (const [k, v] of Object.entries(headers ?? {})) {
    if (!(route.headers ?? []).includes(k)) throw new Error(`${verb}: header ${k} is not part of the route`);
    sent[k] = v;
  }
  const qs = params.toString();
  return { method: route.method, path: qs ? `${path}?${qs}` : path, headers: sent, body: json };
}
