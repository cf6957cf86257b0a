// The client against the gateway's own OpenAPI document: every route it calls
// exists with its method, every query parameter, header and body field it can
// send is documented, and the declared types match the schemas.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { ROUTES, build } from "../src/index.js";
import { url } from "./helpers.js";

const doc = async () => {
  const response = await fetch(`${url()}/openapi.json`);
  assert.equal(response.status, 200);
  return response.json();
};

const resolve = (doc, schema) => {
  if (!schema.$ref) return schema;
  assert.ok(schema.$ref.startsWith("#/components/schemas/"), schema.$ref);
  return doc.components.schemas[schema.$ref.split("/").pop()];
};

/** The field names of `interface NAME { … }` in index.d.ts. */
function declared(name) {
  const text = readFileSync(new URL("../src/index.d.ts", import.meta.url), "utf8");
  const start = text.indexOf(`export interface ${name} {`);
  assert.ok(start >= 0, `interface ${name} in index.d.ts`);
  const body = text.slice(start, text.indexOf("\n}", start));
  return new Set([...body.matchAll(/^  (\w+)\??:/gm)].map((m) => m[1]));
}

test("every route is documented with what the client sends", async () => {
  const d = await doc();
  for (const [verb, route] of Object.entries(ROUTES)) {
    const op = d.paths[route.path]?.[route.method.toLowerCase()];
    assert.ok(op, `${verb}: ${route.method} ${route.path} is not in /openapi.json`);
    const params = op.parameters ?? [];
    const query = new Set(params.filter((p) => p.in === "query").map((p) => p.name));
    const headers = new Set(params.filter((p) => p.in === "header").map((p) => p.name.toLowerCase()));
    for (const q of route.query ?? []) assert.ok(query.has(q), `${verb}: query ${q} undocumented`);
    for (const h of route.headers ?? []) assert.ok(headers.has(h.toLowerCase()), `${verb}: header ${h} undocumented`);
    if (route.path.includes("{id}")) assert.ok(params.some((p) => p.in === "path" && p.name === "id"), `${verb}: id`);
    if (route.body) {
      const schema = resolve(d, op.requestBody.content["application/json"].schema);
      const props = new Set(Object.keys(schema.properties));
      for (const f of route.body) assert.ok(props.has(f), `${verb}: body field ${f} undocumented`);
      for (const r of schema.required ?? []) assert.ok(route.body.includes(r), `${verb}: cannot send required ${r}`);
    }
  }
});

test("the declared types are the schemas", async () => {
  const d = await doc();
  const s = d.components.schemas;
  const same = (iface, schema) =>
    assert.deepEqual([...declared(iface)].sort(), Object.keys(s[schema].properties).sort(), `${iface} vs ${schema}`);
  same("Task", "TaskView");
  same("Page", "Page");
  same("LogChunk", "LogChunk");
  same("OutputEvent", "OutputEvent");
  same("Killed", "Killed");
  same("Sent", "Sent");
  same("Waited", "Waited");
  same("WhoAmI", "WhoAmI");
  same("Hint", "HintView");
  const options = [...declared("SubmitOptions")];
  const body = new Set(Object.keys(s.SubmitBody.properties));
  for (const f of options) assert.ok(body.has(f), `SubmitOptions.${f} is not in SubmitBody`);
  assert.deepEqual([...body].filter((f) => !options.includes(f)), ["command"], "every spec field can be given");
});

test("the builder refuses what a route does not list", () => {
  assert.throws(() => build("kill", { task: "shell-1", query: { because: "x" } }));
  assert.throws(() => build("submit", { body: { comand: "true" } }));
  assert.throws(() => build("get", {}));
  assert.equal(build("kill", { task: "shell-1", query: { reason: "a b" } }).path, "/v1/tasks/shell-1/kill?reason=a+b");
});
