"""The example agent harness (examples/agent-harness) end to end, against the
suite's cluster: it must be told of its agent's end exactly once, within a
bound."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import env

ROOT = Path(__file__).resolve().parents[3]
HARNESS = ROOT / "examples" / "agent-harness" / "harness.py"


def test_the_example_harness_runs_to_its_single_end_notice() -> None:
    run = subprocess.run(
        [sys.executable, str(HARNESS), "--cluster", env("TENURE_CLUSTER_DIR"), "--tenure", env("TENURE_BIN")],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ},
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    lines = run.stdout.strip().splitlines()
    assert "agent: done with write the changelog" in run.stdout, output
    assert "told 1 time(s), by log message" in lines[-1], output
    assert lines[-1].endswith("by log message") and "ended completed" in lines[-1], output
