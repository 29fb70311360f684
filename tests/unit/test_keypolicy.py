"""ApiKeyPolicy: validated like the other kinds, enforced where keys are made (a real
SQLite store), and its declarative document gives the domain's messages."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sitsmesh.authz.directory import TenantDirectory
from sitsmesh.authz.keypolicy import KEYPOLICY_KIND, key_policy_from
from sitsmesh.authz.model import InvalidObject
from sitsmesh.declarative import documents
from sitsmesh.errors import FailedPreconditionError, InvalidArgumentError
from sitsmesh.state import SqliteStore

NOW = 1_000_000.0


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    opened = SqliteStore(tmp_path / "state.db")
    yield opened
    await opened.close()


@pytest.fixture
async def directory(store: SqliteStore) -> TenantDirectory:
    found = TenantDirectory(store, clock=lambda: NOW)
    await found.create_tenant("acme", {"models": ["bert"]})
    return found


async def test_without_a_policy_keys_are_made_as_before(directory: TenantDirectory) -> None:
    key, _ = await directory.create_key("acme")
    assert key.expires_at is None


async def test_ttl_and_active_key_cap_are_enforced(store: SqliteStore,
                                                    directory: TenantDirectory) -> None:
    # As apply stores it.
    await store.put(KEYPOLICY_KIND, "acme", {"max_ttl_s": 3600, "max_active_keys": 2})
    with pytest.raises(InvalidObject, match="lets keys live at most 3600 s"):
        await directory.create_key("acme")
    with pytest.raises(InvalidObject, match="lets keys live at most 3600 s"):
        await directory.create_key("acme", expires_at=NOW + 3601)
    first, _ = await directory.create_key("acme", expires_at=NOW + 3600)
    await directory.create_key("acme", expires_at=NOW + 60)
    with pytest.raises(FailedPreconditionError, match="2 active keys, its ApiKeyPolicy "
                       "allows 2; revoke one first"):
        await directory.create_key("acme", expires_at=NOW + 60)
    await directory.revoke_key(first.id)
    await directory.create_key("acme", expires_at=NOW + 60)


@pytest.mark.parametrize(("body", "message"), [
    ({"max_ttl_s": -1}, "max_ttl_s must be an integer from 0 to 315360000"),
    ({"max_active_keys": True}, "max_active_keys must be an integer from 0 to 100000"),
    ({"max_keys": 1}, "unknown key 'max_keys'"),
])
def test_document_messages_are_the_domain_s(body: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidObject) as domain:
        key_policy_from("acme", body)
    assert message in domain.value.message
    with pytest.raises(InvalidArgumentError) as declared:
        documents.validate([{"apiVersion": "sitsmesh.io/v1alpha1", "kind": "ApiKeyPolicy",
                             "metadata": {"name": "acme"}, "spec": body}])
    assert declared.value.message == f"document 0 (ApiKeyPolicy/acme): {domain.value.message}"
