"""Fixtures: a client of the gateway named by ``TENURE_URL`` and ``TENURE_TOKEN``
(and ``TENURE_TOKEN_OTHER``, a second identity). The suite runs against a
real cluster; without these variables it fails rather than skip."""

from __future__ import annotations

import os
import time
from typing import Callable, Iterator, Optional, TypeVar

import pytest

from tenure_client import Client

T = TypeVar("T")


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: run this suite through `cargo nextest run -p tenure-cli --test clients`")
    return value


@pytest.fixture(scope="session")
def url() -> str:
    return _env("TENURE_URL")


@pytest.fixture(scope="session")
def token() -> str:
    return _env("TENURE_TOKEN")


@pytest.fixture(scope="session")
def other_token() -> str:
    return _env("TENURE_TOKEN_OTHER")


@pytest.fixture
def client(url: str, token: str) -> Iterator[Client]:
    with Client(url, token) as c:
        yield c


def eventually(bound: float, check: Callable[[], Optional[T]]) -> T:
    """``check()``'s first non-None value, polled until ``bound`` seconds pass."""
    deadline = time.monotonic() + bound
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"no result within {bound} s")
        time.sleep(0.05)
