"""The decision log: an optional, sampled structured record of ext_authz and rate-limit
decisions, with every secret masked before it is kept.

What may carry a secret, and what is done with it:
- headers: only the ones named in `decision_log_headers` are logged at all; a masked
  name (API-key and JWT headers, authorization, cookies, `decision_log_mask`) or a
  value shaped like a credential (an sitsmesh API key, `Bearer`/`Basic`, a JWT) is
  replaced by MASK;
- the path: logged without its query string, where tokens are often passed;
- rate-limit descriptor values: a value whose key names a credential (token, secret,
  password, auth, api key, cookie, session, or a `decision_log_mask` name) or that is
  shaped like one is replaced by MASK;
- an API key's id (not its secret) is logged, so a denial can be traced to its key.

Volume is bounded twice: a sample ratio, then at most `max_per_s` records a second (a
flood of bad requests must not flood the log); what the bound drops is counted and
reported once per flush.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sitsmesh import logs
from sitsmesh.authz.check import Allowed, CheckInput, Denied
from sitsmesh.authz.model import key_id_of
from sitsmesh.ratelimit.limiter import Decision, Descriptor

MODES = ("off", "denials", "all")
MASK = "[masked]"
ALWAYS_MASKED = frozenset(("authorization", "proxy-authorization", "cookie", "set-cookie",
                           "x-api-key"))
_SECRET_KEY = re.compile(r"token|secret|passw|auth|api[-_]?key|cookie|session", re.I)
# An sitsmesh key anywhere in a value, a Bearer/Basic credential, or a JWT (three
# base64url parts, the first a JSON object).
_SECRET_VALUE = re.compile(r"smk_|^\s*(bearer|basic)\s|eyJ[\w-]*\.[\w-]+\.", re.I)
MAX_VALUE_CHARS = 256
_log = logs.get("sitsmesh.decisions")


def masked(name: str, value: str, mask: frozenset[str]) -> str:
    """`value` as the log may show it: MASK when its name or its shape says credential."""
    if name.lower() in mask or _SECRET_KEY.search(name) or _SECRET_VALUE.search(value):
        return MASK
    return value[:MAX_VALUE_CHARS]


class DecisionLog:
    __slots__ = ("_buffer", "_clock", "_dropped", "_headers", "_mask", "_max_per_s",
                 "_mode", "_pipeline_of", "_rand", "_sample", "_tokens", "_when")

    def __init__(self, mode: str, *, sample: float = 1.0, max_per_s: int = 100,
                 headers: Iterable[str] = (), mask: Iterable[str] = (),
                 pipeline_of: Callable[[str, str], str] = lambda model, tenant: "",
                 rand: Callable[[], float] = random.random,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if mode not in MODES:
            raise ValueError(f"decision_log must be one of {', '.join(MODES)}, got {mode!r}")
        self._mode = mode
        self._sample = sample
        self._max_per_s = max_per_s
        self._headers = tuple(h.lower() for h in headers)
        self._mask = ALWAYS_MASKED | {m.lower() for m in mask}
        self._pipeline_of = pipeline_of
        self._rand = rand
        self._clock = clock
        self._tokens = float(max_per_s)
        self._when = clock()
        self._dropped = 0
        self._buffer: list[dict[str, Any]] = []

    def wants(self, denied: bool) -> bool:
        """Whether this decision is logged: by mode, by sample, then by the rate bound."""
        mode = self._mode
        if mode == "off" or (mode == "denials" and not denied):
            return False
        if self._sample < 1.0 and self._rand() >= self._sample:
            return False
        now = self._clock()
        self._tokens = min(float(self._max_per_s),
                           self._tokens + (now - self._when) * self._max_per_s)
        self._when = now
        if self._tokens < 1.0:
            self._dropped += 1
            return False
        self._tokens -= 1.0
        return True

    def authz(self, request: CheckInput, decision: Allowed | Denied, seconds: float) -> None:
        record: dict[str, Any] = {
            "kind": "authz", "request_id": request.request_id[:MAX_VALUE_CHARS],
            "tenant": decision.tenant, "latency_ms": round(seconds * 1000, 3),
            "path": request.path.partition("?")[0][:MAX_VALUE_CHARS]}
        if isinstance(decision, Denied):
            record.update(decision="deny", reason=decision.code, status=decision.status)
            if decision.budget:
                record["budget"] = decision.budget
        else:
            record.update(decision="allow", reason="ok", status=200, model=decision.model,
                          pipeline=self._pipeline_of(decision.model, decision.tenant),
                          priority=decision.priority)
            if decision.reserved_tokens:
                record["reserved_tokens"] = decision.reserved_tokens
        if request.principal:
            record["principal"] = request.principal[:MAX_VALUE_CHARS]
        key_id = self._key_id(request)
        if key_id:
            record["api_key_id"] = key_id
        if self._headers:
            record["headers"] = {name: masked(name, request.headers[name], self._mask)
                                 for name in self._headers if name in request.headers}
        self._buffer.append(record)

    def settlement(self, request_id: str, tenant: str, model: str, reserved: int,
                   charged: int) -> None:
        """A token-budget reservation settled when its stream ended: what Check reserved
        for the request (its record has the same request id) and what it was charged."""
        self._buffer.append({"kind": "token_budget", "request_id": request_id[:MAX_VALUE_CHARS],
                             "tenant": tenant, "model": model[:MAX_VALUE_CHARS],
                             "reserved_tokens": reserved, "charged_tokens": charged})

    def ratelimit(self, domain: str, descriptors: Sequence[Descriptor],
                  decision: Decision | None, seconds: float, error: str) -> None:
        record: dict[str, Any] = {"kind": "ratelimit", "domain": domain[:MAX_VALUE_CHARS],
                                  "latency_ms": round(seconds * 1000, 3)}
        shown = []
        for descriptor in descriptors[:16]:
            entries = []
            for key, value in descriptor.entries[:16]:
                entries.append(f"{key[:64]}={masked(key, value, self._mask)}")
                # The request's own labels, when its route sends them as descriptors.
                for field in ("tenant", "model", "pipeline"):
                    if key in (field, f"x-sits-{field}") and field not in record:
                        record[field] = value[:MAX_VALUE_CHARS]
            shown.append(",".join(entries))
        record["descriptors"] = shown
        if decision is None:
            record.update(decision="error", reason=error[:MAX_VALUE_CHARS])
        else:
            record.update(decision="over_limit" if decision.over else "ok",
                          reason=",".join(s.rule.name or s.rule.stats_key for s in
                                          decision.statuses if s.over and s.rule) or "ok")
        self._buffer.append(record)

    def _key_id(self, request: CheckInput) -> str:
        for name in ("x-api-key", "authorization"):
            value = request.headers.get(name, "")
            if value:
                found = key_id_of(value.removeprefix("Bearer ").strip())
                if found:
                    return found
        return ""

    def flush(self) -> None:
        """Write what was kept since the last flush (off the request path)."""
        buffer, self._buffer = self._buffer, []
        for record in buffer:
            _log.info("decision", **record)
        if self._dropped:
            _log.warning("decision log records over decision_log_max_per_s were dropped",
                         dropped=self._dropped, max_per_s=self._max_per_s)
            self._dropped = 0
