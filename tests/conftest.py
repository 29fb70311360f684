"""Suite-wide: which tests must run alone.

`make test` runs the suite in two passes: everything else spread over two pytest-xdist
workers (most integration tests wait on subprocesses and sockets, so two at once halve
the wall time on two cores), then these files one test at a time. They judge timing or
resources under load they create themselves (overload and shedding, swap latency checks,
rate accuracy, drain and kill timings), and a neighbour's load on the
same two cores would make them judge the neighbour.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SERIAL = frozenset({
    "integration/test_pressure_plain.py", "integration/test_pressure_e2e.py",
    "integration/test_shared_overload.py", "integration/test_shared_pressure.py",
    "integration/test_rlqs_envoy.py", "integration/test_replicas_envoy.py",
    "integration/test_swap_triton.py", "integration/test_batching_triton.py",
    "integration/test_tracing_swap_triton.py",
    "integration/test_chains_envoy.py", "integration/test_prometheus_live.py",
    "integration/test_dev.py", "integration/test_shutdown.py",
    "security/test_soak_hostile.py",
})
HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(HERE).as_posix() in SERIAL:
            item.add_marker(pytest.mark.serial)
