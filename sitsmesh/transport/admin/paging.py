"""Paging and read masks of the admin API's list and get RPCs.

A page token names the last item of the page before it and the request it continues
(method and filter), under an HMAC whose key lives in the state store, so every replica
of one deployment honours the others' tokens and a token edited or made up by the caller
is refused (INVALID_ARGUMENT) instead of steering the listing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from google.protobuf.field_mask_pb2 import FieldMask
from google.protobuf.message import Message

from sitsmesh.errors import ConflictError, InvalidArgumentError
from sitsmesh.state import StateStore

DEFAULT_PAGE_SIZE = 100
# The admin port faces callers it does not trust: no request makes a reply bigger than this.
MAX_PAGE_SIZE = 1000
MAX_TOKEN = 512
KEY_KIND, KEY_NAME = "admin-paging", "key"

T = TypeVar("T")
M = TypeVar("M", bound=Message)


def page_size(requested: int) -> int:
    """0 is the default; above the maximum is the maximum; negative is refused."""
    if requested < 0:
        raise InvalidArgumentError(f"page_size must not be negative, got {requested}")
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class PageTokens:
    """Signs and checks page tokens; the key is read (or made) once, on first use."""

    def __init__(self, store: StateStore | None = None, *, key: bytes | None = None) -> None:
        self._store = store
        self._key = key

    async def _secret(self) -> bytes:
        if self._key is None:
            assert self._store is not None
            record = await self._store.get(KEY_KIND, KEY_NAME)
            if record is None:
                try:
                    record = await self._store.create(
                        KEY_KIND, KEY_NAME, {"key": secrets.token_hex(32)})
                except ConflictError:  # another replica made it first: use theirs
                    record = await self._store.get(KEY_KIND, KEY_NAME)
                    assert record is not None
            self._key = bytes.fromhex(str(record.body["key"]))
        return self._key

    async def issue(self, scope: str, after: str) -> str:
        payload = json.dumps({"s": scope, "a": after}, separators=(",", ":")).encode()
        mac = hmac.new(await self._secret(), payload, hashlib.sha256).digest()[:16]
        return f"{_b64(payload)}.{_b64(mac)}"

    async def after(self, scope: str, token: str) -> str:
        """The key the page `token` continues after; "" for the first page."""
        if not token:
            return ""
        bad = InvalidArgumentError("page_token is not one this API issued for this request")
        if len(token) > MAX_TOKEN or token.count(".") != 1:
            raise bad
        body, _, sig = token.partition(".")
        try:
            payload, mac = _unb64(body), _unb64(sig)
        except (binascii.Error, ValueError):
            raise bad from None
        want = hmac.new(await self._secret(), payload, hashlib.sha256).digest()[:16]
        if not hmac.compare_digest(mac, want):
            raise bad
        doc = json.loads(payload)
        # Signed by us, so well formed; only a token of another request is refused here.
        if doc.get("s") != scope:
            raise bad
        return str(doc["a"])


def scope_of(method: str, *filters: str) -> str:
    """What a token is good for: the method and the filters of the request it continues."""
    return hashlib.sha256(json.dumps([method, *filters]).encode()).hexdigest()[:16]


async def page(tokens: PageTokens, scope: str, items: Sequence[T], key: Callable[[T], str], *,
               size: int, token: str) -> tuple[list[T], str]:
    """One page of `items` (any order: they are sorted by `key` here) after the token's key,
    and the token of the next page ("" on the last)."""
    after = await tokens.after(scope, token)
    rest = sorted((i for i in items if key(i) > after), key=key)
    chunk = rest[:size]
    more = len(rest) > size
    return chunk, (await tokens.issue(scope, key(chunk[-1])) if more else "")


# Newest first as an ascending key: seconds before a time far in the future, fixed width.
FAR_FUTURE_S = 1e13


def newest_first(at: float, tie: str) -> str:
    """A `page` key that sorts later times first; `tie` orders items of the same time."""
    return f"{FAR_FUTURE_S - at:021.6f}|{tie}"


def check_mask(mask: FieldMask, message_type: type[Message]) -> FieldMask | None:
    """The read mask, validated against the message it trims; None when it is empty."""
    if not mask.paths:
        return None
    descriptor = message_type.DESCRIPTOR
    unknown = [p for p in mask.paths if not _has_path(descriptor, p)]
    if unknown:
        raise InvalidArgumentError(
            f"read_mask: {', '.join(sorted(unknown))} not a field of {descriptor.name} "
            f"(fields: {', '.join(f.name for f in descriptor.fields)})")
    return mask


def _has_path(descriptor: Any, path: str) -> bool:
    for part in path.split("."):
        field = descriptor.fields_by_name.get(part) if descriptor is not None else None
        if field is None:
            return False
        descriptor = field.message_type
    return True


def trimmed(message: M, mask: FieldMask | None) -> M:
    """`message` with only the fields `mask` names (all of them without a mask)."""
    if mask is None:
        return message
    out = type(message)()
    mask.MergeMessage(message, out)
    return out
