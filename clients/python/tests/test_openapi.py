"""The client against the gateway's own OpenAPI document: every route the
client calls exists with its method, every query parameter, header and body
field it can send is documented, and every field of ``Task`` is one of the
``TaskView`` schema's."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

import httpx
import pytest

from tenure_client import ROUTES, Task
from tenure_client._routes import build


@pytest.fixture(scope="module")
def doc(url: str) -> Dict[str, Any]:
    resp = httpx.get(f"{url}/openapi.json", timeout=30)
    assert resp.status_code == 200
    return resp.json()


def resolve(doc: Dict[str, Any], schema: Dict[str, Any]) -> Dict[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    assert ref.startswith("#/components/schemas/"), ref
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]]


@pytest.mark.parametrize("verb", sorted(ROUTES))
def test_each_route_is_documented_with_what_the_client_sends(doc: Dict[str, Any], verb: str) -> None:
    route = ROUTES[verb]
    assert route.path in doc["paths"], f"{verb}: {route.path} is not in /openapi.json"
    op = doc["paths"][route.path].get(route.method.lower())
    assert op is not None, f"{verb}: {route.method} {route.path} is not in /openapi.json"
    params = op.get("parameters", [])
    documented_query = {p["name"] for p in params if p["in"] == "query"}
    documented_headers = {p["name"].lower() for p in params if p["in"] == "header"}
    assert set(route.query) <= documented_query, f"{verb}: undocumented query {set(route.query) - documented_query}"
    assert {h.lower() for h in route.headers} <= documented_headers, f"{verb}: undocumented headers"
    if "{id}" in route.path:
        assert any(p["in"] == "path" and p["name"] == "id" for p in params), f"{verb}: no `id` path parameter"
    if route.body:
        schema = resolve(doc, op["requestBody"]["content"]["application/json"]["schema"])
        props = set(schema["properties"])
        assert set(route.body) <= props, f"{verb}: undocumented body fields {set(route.body) - props}"
        required = set(schema.get("required", []))
        assert required <= set(route.body), f"{verb}: the client cannot send required {required - set(route.body)}"
    else:
        assert route.method == "GET" or "requestBody" not in op or not op["requestBody"].get("required")


def test_the_builder_refuses_what_a_route_does_not_list() -> None:
    with pytest.raises(ValueError):
        build("kill", "shell-1", query={"because": "x"})
    with pytest.raises(ValueError):
        build("submit", body={"comand": "true"})
    with pytest.raises(ValueError):
        build("get")


def test_task_fields_are_the_task_view_schema(doc: Dict[str, Any]) -> None:
    view = doc["components"]["schemas"]["TaskView"]
    fields = {f.name for f in dataclasses.fields(Task)}
    assert fields == set(view["properties"]), fields ^ set(view["properties"])
