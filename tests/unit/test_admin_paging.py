"""Page sizes, page tokens and read masks of the admin list/get RPCs (pure logic; the
real server's paging is in tests/integration/test_admin_paging.py)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from google.protobuf.field_mask_pb2 import FieldMask

from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli.common import RpcFailed, all_pages
from sitsmesh.errors import InvalidArgumentError
from sitsmesh.state.sqlite import SqliteStore
from sitsmesh.transport.admin.paging import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    PageTokens,
    check_mask,
    newest_first,
    page,
    page_size,
    scope_of,
    trimmed,
)

KEY = bytes(range(32))
NAMES = [f"t{i:03d}" for i in range(25)]


def test_page_size_defaults_and_is_bounded() -> None:
    assert page_size(0) == DEFAULT_PAGE_SIZE == 100
    assert page_size(7) == 7
    assert page_size(10**9) == MAX_PAGE_SIZE == 1000
    with pytest.raises(InvalidArgumentError, match="page_size must not be negative, got -1"):
        page_size(-1)


async def test_pages_cover_everything_once_in_order_whatever_the_input_order() -> None:
    tokens, scope = PageTokens(key=KEY), scope_of("ListTenants")
    seen, token, pages = [], "", 0
    while True:
        chunk, token = await page(tokens, scope, list(reversed(NAMES)), str, size=10,
                                  token=token)
        seen += chunk
        pages += 1
        if not token:
            break
    assert (seen, pages) == (NAMES, 3)
    # Exactly one page: no token to a page that would be empty.
    assert (await page(tokens, scope, NAMES, str, size=25, token=""))[1] == ""


async def _second_page_token(tokens: PageTokens, scope: str) -> str:
    _, token = await page(tokens, scope, NAMES, str, size=10, token="")
    return token


@pytest.mark.parametrize("forge", [
    lambda t: t + "x",                                              # bad signature
    lambda t: t.split(".")[0],                                      # no signature
    lambda t: "!!!." + t.split(".")[1],                             # not base64
    lambda t: "a" * 600,                                            # oversized
    lambda t: (base64.urlsafe_b64encode(json.dumps({"s": json.loads(base64.urlsafe_b64decode(
        t.split(".")[0] + "==").decode())["s"], "a": "t000"}).encode()).rstrip(b"=").decode()
               + "." + t.split(".")[1]),                             # payload edited
])
async def test_a_malformed_or_forged_token_is_invalid_argument(forge: object) -> None:
    tokens, scope = PageTokens(key=KEY), scope_of("ListTenants")
    token = await _second_page_token(tokens, scope)
    with pytest.raises(InvalidArgumentError, match="page_token is not one this API issued"):
        await page(tokens, scope, NAMES, str, size=10, token=forge(token))  # type: ignore[operator]


async def test_a_token_is_good_only_for_the_request_and_the_key_it_came_from() -> None:
    tokens = PageTokens(key=KEY)
    token = await _second_page_token(tokens, scope_of("ListApiKeys", "team-a"))
    with pytest.raises(InvalidArgumentError):
        await page(tokens, scope_of("ListApiKeys", "team-b"), NAMES, str, size=10, token=token)
    with pytest.raises(InvalidArgumentError):
        await page(PageTokens(key=bytes(32)), scope_of("ListApiKeys", "team-a"), NAMES, str,
                   size=10, token=token)


async def test_replicas_on_one_store_honour_each_others_tokens(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    try:
        scope = scope_of("ListTenants")
        token = await _second_page_token(PageTokens(store), scope)
        chunk, _ = await page(PageTokens(store), scope, NAMES, str, size=10, token=token)
        assert chunk == NAMES[10:20]
    finally:
        await store.close()


def test_a_read_mask_trims_to_the_named_fields_and_refuses_unknown_ones() -> None:
    tenant = admin_pb2.Tenant(name="a", models=["m*"], priority=3, labels={"team": "ml"})
    assert check_mask(FieldMask(), admin_pb2.Tenant) is None
    assert trimmed(tenant, None) == tenant
    mask = check_mask(FieldMask(paths=["name", "labels"]), admin_pb2.Tenant)
    assert trimmed(tenant, mask) == admin_pb2.Tenant(name="a", labels={"team": "ml"})
    key = admin_pb2.ApiKey(id="k", tenant="a")
    key.created_at.FromSeconds(5)
    assert trimmed(key, check_mask(FieldMask(paths=["created_at.seconds"]), admin_pb2.ApiKey)
                   ).created_at.seconds == 5
    with pytest.raises(InvalidArgumentError, match=r"read_mask: nmae, secret not a field of "
                       r"Tenant \(fields: name, models, priority"):
        check_mask(FieldMask(paths=["name", "nmae", "secret"]), admin_pb2.Tenant)
    with pytest.raises(InvalidArgumentError, match=r"read_mask: name\.first not a field"):
        check_mask(FieldMask(paths=["name.first"]), admin_pb2.Tenant)


def test_newest_first_keys_sort_later_times_first_and_ties_by_the_tie() -> None:
    times = [1.5, 1_700_000_000.25, 1_700_000_000.5, 0.0]
    keys = sorted([newest_first(t, "b") for t in times] + [newest_first(1.5, "a")])
    assert keys == [newest_first(1_700_000_000.5, "b"), newest_first(1_700_000_000.25, "b"),
                    newest_first(1.5, "a"), newest_first(1.5, "b"), newest_first(0.0, "b")]


def test_the_cli_joins_pages_and_stops_at_its_limit() -> None:
    """What `tenants list` / `swaps list --limit N` do with a server of small pages."""
    names = [f"t{i}" for i in range(7)]
    sent: list[admin_pb2.ListTenantsRequest] = []

    def call(request: admin_pb2.ListTenantsRequest) -> admin_pb2.ListTenantsResponse:
        sent.append(admin_pb2.ListTenantsRequest(page_size=request.page_size,
                                                 page_token=request.page_token))
        start = int(request.page_token or 0)
        end = min(start + 3, len(names))
        return admin_pb2.ListTenantsResponse(
            tenants=[admin_pb2.Tenant(name=n) for n in names[start:end]],
            next_page_token=str(end) if end < len(names) else "")

    whole = all_pages(call, admin_pb2.ListTenantsRequest(), "tenants")
    assert ([t.name for t in whole.tenants], whole.next_page_token) == (names, "")
    assert [r.page_token for r in sent] == ["", "3", "6"]
    sent.clear()
    first = all_pages(call, admin_pb2.ListTenantsRequest(), "tenants", limit=4)
    assert [t.name for t in first.tenants] == names[:4]
    assert [(r.page_size, r.page_token) for r in sent] == [(4, ""), (4, "3")]

    def stuck(request: admin_pb2.ListTenantsRequest) -> admin_pb2.ListTenantsResponse:
        return admin_pb2.ListTenantsResponse(next_page_token="same")

    with pytest.raises(RpcFailed, match="the server repeated page token 'same'"):
        all_pages(stuck, admin_pb2.ListTenantsRequest(), "tenants")
