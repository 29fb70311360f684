from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sitsmesh.dev import harness


@pytest.fixture
def start_sitsmesh(tmp_path: Path) -> Iterator[Callable[..., harness.Sitsmesh]]:
    """Factory: start `sitsmesh serve` on free ports; every one is killed at teardown."""
    started: list[harness.Sitsmesh] = []

    def start(*extra: str, **kwargs: Any) -> harness.Sitsmesh:
        kwargs.setdefault("name", f"sitsmesh{len(started)}")
        node = harness.start_sitsmesh(tmp_path, *extra, **kwargs)
        started.append(node)
        return node

    yield start
    for node in started:
        node.kill()


@pytest.fixture
def sitsmesh(start_sitsmesh: Callable[..., harness.Sitsmesh]) -> harness.Sitsmesh:
    return start_sitsmesh()


@pytest.fixture
def upstream() -> Iterator[int]:
    with harness.echo_upstream() as port:
        yield port


@pytest.fixture
def kill_envoys() -> Iterator[list[harness.Envoy]]:
    """Envoys a test appends here are killed at its teardown."""
    envoys: list[harness.Envoy] = []
    yield envoys
    for envoy in envoys:
        envoy.kill()


@pytest.fixture
def envoy(tmp_path: Path, sitsmesh: harness.Sitsmesh, upstream: int) -> Iterator[harness.Envoy]:
    node = harness.start_envoy(tmp_path, sitsmesh.data_addr, upstream)
    yield node
    node.kill()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.integration)
