"""Tenants and keys in a real SQLite store: deleting a tenant takes its keys with it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sitsmesh.authz.admission import Admission, AdmissionPolicy
from sitsmesh.authz.check import Allowed, Authorizer, AuthzSettings, CheckInput, Denied
from sitsmesh.authz.directory import TenantDirectory
from sitsmesh.errors import NotFoundError
from sitsmesh.state import SqliteStore

BODY = {"models": ["bert"], "priority": 1}


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    opened = SqliteStore(tmp_path / "state.db")
    yield opened
    await opened.close()


@pytest.fixture
async def directory(store: SqliteStore) -> TenantDirectory:
    found = TenantDirectory(store)
    await found.refresh()
    return found


def _check(directory: TenantDirectory, key: str) -> Allowed | Denied:
    authorizer = Authorizer(directory.snapshot, AuthzSettings(),
                            Admission(AdmissionPolicy()))
    return authorizer.check(CheckInput({"x-api-key": key}, "/v2/models/bert/infer"))


async def test_deleting_a_tenant_revokes_its_keys_and_a_new_one_of_that_name_gets_none(
        directory: TenantDirectory) -> None:
    first = await directory.create_tenant("acme", {**BODY, "uid": "chosen-by-caller"})
    assert first.uid and first.uid != "chosen-by-caller"  # the caller cannot pick it
    key, secret = await directory.create_key("acme")
    _, other_secret = await directory.create_key("acme")
    await directory.create_tenant("beta", BODY)
    _, beta_secret = await directory.create_key("beta")
    assert isinstance(_check(directory, secret), Allowed)

    assert await directory.delete_tenant("acme") == 2
    assert all(k.revoked for k in await directory.list_keys("acme"))
    assert not any(k.revoked for k in await directory.list_keys("beta"))

    second = await directory.create_tenant("acme", BODY)
    assert second.uid != first.uid
    for old in (secret, other_secret):
        denied = _check(directory, old)
        assert isinstance(denied, Denied) and denied.status == 401
    assert isinstance(_check(directory, beta_secret), Allowed)
    with pytest.raises(NotFoundError):
        await directory.delete_tenant("acme-nope")
    assert key.tenant_uid == first.uid


async def test_a_key_of_a_tenant_re_created_outside_the_api_is_refused(
        directory: TenantDirectory, store: SqliteStore) -> None:
    """Even without the revocation (a store restored from an old backup, a write that
    raced the delete), a key only works for the tenant it was made for."""
    await directory.create_tenant("acme", BODY)
    _, secret = await directory.create_key("acme")
    record = await store.get("tenant", "acme")
    assert record is not None
    await store.put("tenant", "acme", {**record.body, "uid": "another"})
    await directory.refresh()
    denied = _check(directory, secret)
    assert isinstance(denied, Denied) and "no longer exists" in denied.message


async def test_updating_a_tenant_keeps_its_uid(directory: TenantDirectory) -> None:
    created = await directory.create_tenant("acme", BODY)
    updated = await directory.update_tenant("acme", {**BODY, "priority": 3, "uid": "x"})
    assert updated.uid == created.uid and updated.priority == 3
    _, secret = await directory.create_key("acme")
    assert isinstance(_check(directory, secret), Allowed)
