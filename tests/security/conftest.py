"""Fixtures the security tests share: one test CA per module, and a server certificate
for 127.0.0.1/localhost. A module that needs another CA defines its own `ca`."""

from __future__ import annotations

import pytest

from tests.security.pki import Ca, Pair, make_ca


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Ca:
    return make_ca(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def server_pair(ca: Ca) -> Pair:
    return ca.issue("server", "DNS:localhost", "IP:127.0.0.1")
