"""Tenants and API keys: validation, storage form, and key material."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sitsmesh import globs
from sitsmesh.errors import Code, SitsmeshError

TENANT_KIND = "tenant"
APIKEY_KIND = "apikey"
MAX_PRIORITY = 9
MAX_UID = 64
_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
KEY_PREFIX = "smk_"
_KEY = re.compile(r"^smk_([0-9a-f]{12})_([A-Za-z0-9_-]{20,100})$")


class InvalidObject(SitsmeshError):
    code = Code.INVALID_ARGUMENT


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    models: tuple[str, ...]
    priority: int = 0
    max_priority: int = 0
    max_concurrency: int = 0  # 0: no cap
    labels: Mapping[str, str] = field(default_factory=dict)
    # Given at creation and never changed: keys bind to it, so a tenant deleted and created
    # again under the same name does not revive the old one's keys. "" on tenants stored
    # before uids existed.
    uid: str = ""
    # `models` compiled once: Check asks on every request, at a cost that does not grow
    # with the number of globs.
    _globs: globs.Globs = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_globs", globs.Globs((self.models,)))

    def allows(self, model: str) -> bool:
        return self._globs.matches(model)

    def to_body(self) -> dict[str, Any]:
        body = {"models": list(self.models), "priority": self.priority,
                "max_priority": self.max_priority, "max_concurrency": self.max_concurrency,
                "labels": dict(self.labels)}
        if self.uid:
            body["uid"] = self.uid
        return body


def tenant_from(name: str, body: Mapping[str, Any]) -> Tenant:
    """Build and validate a tenant; raises InvalidObject naming the field."""
    if not _NAME.match(name):
        raise InvalidObject(f"tenant name {name!r}: use 1-63 lowercase letters, digits, "
                            "'.', '_' or '-', starting and ending with a letter or digit")
    models = body.get("models") or []
    if not isinstance(models, list | tuple) or not models or not all(
            isinstance(m, str) and m for m in models):
        raise InvalidObject(f"tenant {name}: models must be a non-empty list of globs")
    try:
        globs.check(models, f"tenant {name}")
    except globs.GlobError as exc:
        raise InvalidObject(str(exc)) from None
    numbers = {}
    for key, high in (("priority", MAX_PRIORITY), ("max_priority", MAX_PRIORITY),
                      ("max_concurrency", 1_000_000)):
        value = body.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise InvalidObject(f"tenant {name}: {key} must be an integer from 0 to {high}")
        numbers[key] = value
    numbers["max_priority"] = max(numbers["max_priority"], numbers["priority"])
    labels = body.get("labels") or {}
    if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise InvalidObject(f"tenant {name}: labels must map strings to strings")
    uid = body.get("uid", "")
    if not isinstance(uid, str) or len(uid) > MAX_UID:
        raise InvalidObject(f"tenant {name}: uid must be a string of at most {MAX_UID} chars")
    return Tenant(name, tuple(models), labels=dict(labels), uid=uid, **numbers)


def new_uid() -> str:
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class ApiKey:
    id: str
    tenant: str
    digest: str  # sha256 of the whole key, hex
    created_at: float
    expires_at: float | None = None
    revoked: bool = False
    name: str = ""
    tenant_uid: str = ""  # the uid of the tenant it was made for (see Tenant.uid)

    def to_body(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "digest": self.digest, "created_at": self.created_at,
                "expires_at": self.expires_at, "revoked": self.revoked, "name": self.name,
                "tenant_uid": self.tenant_uid}


def apikey_from(key_id: str, body: Mapping[str, Any]) -> ApiKey:
    return ApiKey(key_id, str(body["tenant"]), str(body["digest"]), float(body["created_at"]),
                  body.get("expires_at"), bool(body.get("revoked", False)),
                  str(body.get("name", "")), str(body.get("tenant_uid", "")))


def digest(key: str) -> str:
    # The secret part is 256 random bits, so a plain SHA-256 cannot be brute-forced;
    # a slow password hash would only add latency to every request.
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """(key id, whole key). The key is shown once; only its digest is stored."""
    key_id = secrets.token_hex(6)
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def key_id_of(presented: str) -> str | None:
    match = _KEY.match(presented)
    return match.group(1) if match else None


def matches(key: ApiKey, presented: str) -> bool:
    return hmac.compare_digest(digest(presented), key.digest)
