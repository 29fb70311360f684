"""Test servers' ports: each pytest-xdist worker draws from its own slice of the range, so
two workers never hand out the same port (a parallel `make test` once did, and a server
failed to bind)."""

from __future__ import annotations

import pytest

from sitsmesh.dev import harness


def test_workers_draw_from_disjoint_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(harness.port_range())
        low, high = slices[-1]
        assert all(low <= harness.free_port() < high for _ in range(20))
    (low0, high0), (low1, high1) = slices
    assert high0 <= low1 and high1 - low1 == high0 - low0 > 1000


def test_alone_the_whole_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert harness.port_range() == (20000, 32000)
