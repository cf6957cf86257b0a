"""A client generated from the gateway's own ``/openapi.json`` by a stock
OpenAPI generator (``openapi-python-client``, from PyPI) works as is: it
submits a task, reads it, waits for its end and reads its output, and
another identity's task is a 404. The document is what any language's
generator would be given; a schema the generator cannot follow fails here."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import eventually


@pytest.fixture(scope="module")
def generated(url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("generated")
    doc = out / "openapi.json"
    resp = httpx.get(f"{url}/openapi.json", timeout=30)
    assert resp.status_code == 200
    doc.write_bytes(resp.content)
    # `--meta none`: the package alone, no project around it (and no formatter run).
    run = subprocess.run(
        [sys.executable, "-m", "openapi_python_client", "generate", "--path", str(doc),
         "--output-path", str(out / "tenure_gateway_client"), "--meta", "none"],
        capture_output=True, text=True, timeout=180,
    )
    assert run.returncode == 0, f"the generator failed:\n{run.stdout}\n{run.stderr}"
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module("tenure_gateway_client")
    finally:
        sys.path.remove(str(out))


def test_a_generated_client_submits_reads_and_waits(generated: Any, url: str, token: str, other_token: str) -> None:
    def route(name: str) -> Any:
        return importlib.import_module(f"tenure_gateway_client.api.default.{name}")

    models = importlib.import_module("tenure_gateway_client.models")
    submit, wait, get_task, logs = (route(n) for n in ("submit", "wait", "get_task", "logs"))
    client = generated.AuthenticatedClient(base_url=url, token=token)
    submitted = submit.sync(client=client, body=models.SubmitBody(command="echo generated"))
    assert isinstance(submitted, models.Submitted), submitted
    task = submitted.task
    assert task.startswith("shell-")

    def ended() -> Any:
        waited = wait.sync(task, client=client, timeout_ms=5000)
        assert isinstance(waited, models.Waited), waited
        return waited if waited.finished else None

    waited = eventually(60, ended)
    assert waited.task.status == "completed", waited
    view = get_task.sync(task, client=client)
    assert isinstance(view, models.TaskView) and view.id == task and view.exit_code == 0
    out = logs.sync(task, client=client)
    assert "generated" in str(out.to_dict()), out
    # Another identity's generated client gets a 404, typed as the error body.
    other = generated.AuthenticatedClient(base_url=url, token=other_token)
    resp = get_task.sync_detailed(task, client=other)
    assert resp.status_code == 404
    assert isinstance(resp.parsed, models.ErrorBody) and resp.parsed.code == "not-found", resp.parsed
