from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.parity.rls import Fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    serves = Fleet(tmp_path_factory.mktemp("parity"))
    yield serves
    serves.close()


@pytest.fixture(scope="module", params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> str:
    """Each module's counting and service facts hold on both stores."""
    param: str = request.param
    return param
