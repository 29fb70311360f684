"""What a tenant's API keys may be: how long they live and how many are active at once.

Checked where keys are issued (CreateApiKey), never on the request path. A tenant
without a policy issues keys as before: any lifetime, any number.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sitsmesh.authz.model import ApiKey, InvalidObject
from sitsmesh.errors import FailedPreconditionError

KEYPOLICY_KIND = "apikey-policy"
MAX_TTL_S = 10 * 365 * 86400
MAX_KEYS = 100_000
# The tenant's name rule: a policy is stored under the name of the tenant it governs.
_TENANT_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
_KEYS = {"max_ttl_s": MAX_TTL_S, "max_active_keys": MAX_KEYS}


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    tenant: str
    max_ttl_s: int = 0        # 0: keys may live for ever; else each must expire within it
    max_active_keys: int = 0  # 0: no cap; else unrevoked, unexpired keys at once

    def to_body(self) -> dict[str, Any]:
        return {"max_ttl_s": self.max_ttl_s, "max_active_keys": self.max_active_keys}

    def check_issue(self, expires_at: float | None, now: float, keys: Iterable[ApiKey]) -> None:
        """Refuse a new key this policy does not allow; names the rule and the way out."""
        if self.max_ttl_s and (expires_at is None or expires_at - now > self.max_ttl_s):
            raise InvalidObject(f"tenant {self.tenant}: its ApiKeyPolicy lets keys live at "
                                f"most {self.max_ttl_s} s; give an expiry within that")
        if self.max_active_keys:
            active = sum(1 for k in keys if k.tenant == self.tenant and not k.revoked
                         and (k.expires_at is None or k.expires_at > now))
            if active >= self.max_active_keys:
                raise FailedPreconditionError(
                    f"tenant {self.tenant}: {active} active keys, its ApiKeyPolicy allows "
                    f"{self.max_active_keys}; revoke one first")


def key_policy_from(tenant: str, body: Mapping[str, Any]) -> KeyPolicy:
    """Build and validate a key policy; raises InvalidObject naming the field."""
    if not isinstance(tenant, str) or not _TENANT_NAME.match(tenant):
        raise InvalidObject(f"api key policy {tenant!r}: name it after its tenant (1-63 "
                            "lowercase letters, digits, '.', '_' or '-')")
    unknown = set(body) - set(_KEYS)
    if unknown:
        raise InvalidObject(f"api key policy {tenant}: unknown key '{sorted(unknown)[0]}'")
    values = {}
    for key, high in _KEYS.items():
        value = body.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise InvalidObject(f"api key policy {tenant}: {key} must be an integer from 0 "
                                f"to {high}")
        values[key] = value
    return KeyPolicy(tenant, **values)
