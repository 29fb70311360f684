"""The Check decision as plain Python: who is calling, may they, can we take it now."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sitsmesh.authz import extract
from sitsmesh.authz import methods as route_methods
from sitsmesh.authz.admission import Admission
from sitsmesh.authz.gie import GieHeaders, GieSettings
from sitsmesh.authz.model import ApiKey, Tenant, key_id_of, matches
from sitsmesh.pressure.entryqueue import Waiter

HEADER_PREFIX = "x-sits-"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
MAX_HEADER_VALUE = 8192


@dataclass(frozen=True, slots=True)
class AuthzSnapshot:
    tenants: Mapping[str, Tenant] = field(default_factory=dict)
    keys: Mapping[str, ApiKey] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AuthzSettings:
    api_key_headers: tuple[str, ...] = ("x-api-key", "authorization")
    peer_tenants: Mapping[str, str] = field(default_factory=dict)
    jwt_header: str = ""
    jwt_tenant_claim: str = "tenant"
    priority_header: str = "x-priority"
    pipeline_header: str = "x-sits-pipeline-hint"
    # The JWT-payload header is a claim any workload can send: read it only from
    # these mesh peers (the ingress gateway that ran RequestAuthentication).
    jwt_trusted_principals: frozenset[str] = frozenset()
    # A client-sent hint could name a pipeline that is not shedding; off, the
    # pipeline comes from the model alone.
    trust_pipeline_hint: bool = False
    # Normalized paths of non-model entry points (a preprocess service) that any
    # identified tenant may call; every other unknown path is refused.
    open_paths: frozenset[str] = frozenset()
    # The `payload_in_metadata` name of Envoy's jwt_authn provider: the payload it
    # verified reaches Check as metadata, which no client can write ("" = unused).
    jwt_metadata_key: str = ""
    # Gateway API Inference Extension headers for an endpoint picker upstream (gie.py).
    gie: GieSettings = field(default_factory=GieSettings)
    # HTTP methods each route family accepts (authz/methods.py); others get a 405.
    methods: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: dict(route_methods.DEFAULTS))
    # gRPC methods whose messages the grpc_stream_check filter checks one by one
    # (stream_check_methods): only these may start without the body's model.
    per_message_paths: frozenset[str] = frozenset((MODEL_STREAM_INFER,))


@dataclass(frozen=True, slots=True)
class CheckInput:
    headers: Mapping[str, str]
    path: str = ""
    body: bytes = b""
    principal: str = ""
    request_id: str = ""
    http: bool = True
    jwt_tenant: str = ""  # the tenant claim of a JWT Envoy's jwt_authn verified
    # The HTTP method; "" when the caller gave none, which Envoy never does for HTTP (a
    # direct caller able to omit it could as well send any method it likes).
    method: str = ""
    # The route checks each message of this gRPC stream (its ext_authz context extension
    # sitsmesh_stream_check: per_message, authz/streamcheck.py): the body is not buffered
    # for Check, which decides on identity and admission alone.
    per_message: bool = False


@dataclass(frozen=True, slots=True)
class Allowed:
    tenant: str
    priority: int
    model: str
    request_class: str
    set_headers: tuple[tuple[str, str], ...]
    remove_headers: tuple[str, ...]
    # The API key's id when a key identified the caller (its token budget may count per
    # key). Not part of the answer, so not of equality: replies stay cached per answer.
    key_id: str = field(default="", compare=False)
    # The tokens its tenant's token budget reserved for it (for the decision log).
    reserved_tokens: int = field(default=0, compare=False)
    # Held at the pipeline's entry for room: the answer waits for it (pressure.entryqueue).
    waiting: Waiter | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Denied:
    status: int  # HTTP status: 400, 401, 403, 405, 429 or 503
    code: str
    message: str
    retry_after_s: float = 0.0
    grpc: bool = False  # the caller speaks gRPC: the answer carries a gRPC status too
    # Who was refused, when known, for metrics and the decision log. Not part of the
    # answer, so not of equality either: replies stay cached per answer.
    tenant: str = field(default="", compare=False)
    allow: str = ""  # a 405's `allow` header: the methods the route accepts
    # More headers of the answer (a token budget's x-ratelimit-*-tokens), and the budget
    # a 429 names in its JSON body.
    headers: tuple[tuple[str, str], ...] = ()
    budget: str = ""


_REFUSED = {
    extract.INVALID_PATH: Denied(400, "path_invalid", "the request path cannot be read: a "
                                 "bad percent-escape, a control, space, backslash or "
                                 "non-ASCII character"),
    extract.CONTROL_API: Denied(403, "control_api_not_allowed", "Triton repository and "
                                "control APIs (load, unload, index, config, statistics, "
                                "shared memory, trace, logging) are not open to tenants"),
    extract.UNKNOWN_ROUTE: Denied(403, "route_not_allowed", "this path is not an inference, "
                                  "health or metadata route"),
    extract.DUPLICATE_KEY: Denied(400, "json_duplicate_key", "the JSON body gives a key more "
                                  "than once; send each key once"),
    extract.MIXED_MODELS: Denied(403, "model_mixed", "the messages of this gRPC stream name "
                                 "different models"),
}
_PARTIAL = Denied(403, "body_too_large", "request body is larger than the authorization "
                  "buffer; the model cannot be verified")
_NO_MODEL = Denied(403, "model_unknown", "cannot determine the model of this request from "
                   "its body")
_AS_GRPC = {d: dataclasses.replace(d, grpc=True) for d in (*_REFUSED.values(), _PARTIAL,
                                                           _NO_MODEL)}


def _method_policy(family: str, allowed: tuple[str, ...]) -> tuple[frozenset[str], Denied,
                                                                   Denied]:
    allow = route_methods.allow_header(allowed)
    refused = Denied(405, "method_not_allowed", f"{family} routes accept {allow} only",
                     allow=allow)
    return frozenset(allowed), refused, dataclasses.replace(refused, grpc=True)


def _deny_401(message: str) -> Denied:
    return Denied(401, "unauthenticated", message)


class Authorizer:
    """Reads `snapshot` (swapped whole on every state change); no I/O on the request path."""

    __slots__ = ("_clock", "_gie", "_methods", "_settings", "admission", "snapshot")

    def __init__(self, snapshot: AuthzSnapshot, settings: AuthzSettings, admission: Admission,
                 clock: Callable[[], float] = time.time) -> None:
        self.snapshot = snapshot
        self._settings = settings
        self.admission = admission
        self._clock = clock
        self._gie = GieHeaders(settings.gie) if settings.gie.enabled else None
        # Built once: a refused method allocates nothing on the request path.
        self._methods = {family: _method_policy(family, allowed)
                         for family, allowed in {**route_methods.DEFAULTS,
                                                 **settings.methods}.items()}

    @property
    def settings(self) -> AuthzSettings:
        return self._settings

    def check(self, request: CheckInput) -> Allowed | Denied:
        snapshot = self.snapshot
        tenant_or_denial, key_id = self._identify(request, snapshot)
        if isinstance(tenant_or_denial, Denied):
            return tenant_or_denial
        tenant = tenant_or_denial
        decision = self._authorize(request, tenant)
        if type(decision) is Denied and not decision.tenant:
            return dataclasses.replace(decision, tenant=tenant.name)
        if key_id and type(decision) is Allowed:
            return dataclasses.replace(decision, key_id=key_id)
        return decision

    def _authorize(self, request: CheckInput, tenant: Tenant) -> Allowed | Denied:
        """What an identified tenant may do with this request."""
        if not request.http:
            # A TCP ext_authz check: identity is all there is to decide on.
            return Allowed(tenant.name, tenant.priority, "", "tcp", (), ())
        model, request_class, from_body = extract.classify(request.path, request.body)
        grpc = request_class == "grpc" or request.headers.get(
            "content-type", "").startswith("application/grpc")
        if request_class[0] == "!":
            open_paths = self._settings.open_paths
            if request_class == extract.UNKNOWN_ROUTE and open_paths and \
                    extract.normalize(request.path) in open_paths:
                request_class = "other"
            else:
                refused = _REFUSED[request_class]
                return _AS_GRPC[refused] if grpc else refused
        if request.method:
            allowed, refused, refused_grpc = self._methods[route_methods.family(
                request_class,
                extract.normalize(request.path) if request_class == "metadata" else "")]
            if request.method not in allowed:
                return refused_grpc if grpc else refused
        # A stream checked message by message has its models checked as they come.
        if from_body and not (request.per_message and not request.body and grpc
                              and request.path in self._settings.per_message_paths):
            # The model is in the body: a body cut short by Envoy's buffer limit, or
            # one we cannot read, could hide the real model. Fail safe.
            if request.headers.get("x-envoy-auth-partial-body") == "true":
                return _AS_GRPC[_PARTIAL] if grpc else _PARTIAL
            if not model:
                return _AS_GRPC[_NO_MODEL] if grpc else _NO_MODEL
        if model and not tenant.allows(model):
            return Denied(403, "model_not_allowed",
                          f"tenant {tenant.name} may not call model {model}", grpc=grpc,
                          tenant=tenant.name)
        priority = self._priority(request.headers, tenant)
        if request_class == "metadata":
            # Health and metadata calls are counted against the tenant's cap, but they
            # are no arrivals at the model: they never enter a pipeline's pressure.
            verdict = self.admission.admit(tenant.name, "", priority, "", request.request_id)
        else:
            hint = request.headers.get(self._settings.pipeline_header, "")[:128] \
                if self._settings.trust_pipeline_hint else ""
            verdict = self.admission.admit(tenant.name, model, priority, hint,
                                           request.request_id)
        if not verdict.admit:
            return Denied(429, verdict.code, verdict.reason, verdict.retry_after_s,
                          grpc=grpc, tenant=tenant.name)
        set_headers: tuple[tuple[str, str], ...] = (
            ("x-sits-tenant", tenant.name), ("x-sits-priority", str(priority)),
            ("x-sits-model", model), ("x-sits-request-class", request_class))
        ours = {name for name, _ in set_headers}
        remove = tuple(name for name in request.headers
                       if name.startswith(HEADER_PREFIX) and name not in ours)
        if self._gie is not None:
            gie_set, gie_remove = self._gie.decide(tenant, priority, request.headers)
            set_headers += gie_set
            remove += gie_remove
        if verdict.waiting is not None:
            verdict.waiting.grpc = grpc
            return Allowed(tenant.name, priority, model, request_class, set_headers, remove,
                           waiting=verdict.waiting)
        return Allowed(tenant.name, priority, model, request_class, set_headers, remove)

    def identify(self, request: CheckInput) -> Tenant | Denied:
        """Who the caller is on the directory as it is now (a stream's later messages)."""
        return self._identify(request, self.snapshot)[0]

    def _identify(self, request: CheckInput, snapshot: AuthzSnapshot
                  ) -> tuple[Tenant | Denied, str]:
        """The caller, and the id of the API key that named it ("" for other ways)."""
        headers = request.headers
        for name in self._settings.api_key_headers:
            value = headers.get(name)
            if not value:
                continue
            presented = value.strip()
            if name == "authorization":
                scheme, _, credential = presented.partition(" ")
                if scheme.lower() != "bearer":
                    continue
                presented = credential.strip()
            key_id = key_id_of(presented)
            if key_id is None and name == "authorization":
                continue  # some other bearer token (a user's JWT): not ours to judge
            return self._by_key(presented, key_id, snapshot), key_id or ""
        return self._identify_peer(request, snapshot), ""

    def _identify_peer(self, request: CheckInput, snapshot: AuthzSnapshot) -> Tenant | Denied:
        headers = request.headers
        if request.principal:
            mapped = self._settings.peer_tenants.get(request.principal)
            if mapped is not None:
                tenant = snapshot.tenants.get(mapped)
                if tenant is None:
                    return Denied(403, "unknown_tenant",
                                  f"peer maps to tenant {mapped}, which does not exist")
                return tenant
            if self._settings.jwt_header and \
                    request.principal in self._settings.jwt_trusted_principals:
                payload = headers.get(self._settings.jwt_header)
                if payload:
                    return self._by_jwt(payload, snapshot)
        if request.jwt_tenant:
            tenant = snapshot.tenants.get(request.jwt_tenant)
            return tenant if tenant is not None else _deny_401("JWT names no known tenant")
        return _deny_401("no credentials: send an API key in x-api-key or "
                         "'authorization: Bearer <key>'")

    def _by_key(self, presented: str, key_id: str | None, snapshot: AuthzSnapshot
                ) -> Tenant | Denied:
        key = snapshot.keys.get(key_id) if key_id else None
        if key is None or not matches(key, presented):
            return _deny_401("invalid API key")
        if key.revoked:
            return _deny_401("API key revoked")
        if key.expires_at is not None and key.expires_at <= self._clock():
            return _deny_401("API key expired")
        tenant = snapshot.tenants.get(key.tenant)
        if tenant is None or tenant.uid != key.tenant_uid:
            # Gone, or deleted and created again: a new tenant of the same name is not
            # the one this key was made for.
            return _deny_401("API key's tenant no longer exists")
        return tenant

    def _by_jwt(self, payload: str, snapshot: AuthzSnapshot) -> Tenant | Denied:
        """Istio verified the JWT; it forwards the payload as base64url JSON."""
        if len(payload) > MAX_HEADER_VALUE:
            return _deny_401("JWT payload header too large")
        try:
            raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
            claims: Any = json.loads(raw)
        except (binascii.Error, ValueError, RecursionError):
            return _deny_401("JWT payload header is not base64url JSON")
        name = claims.get(self._settings.jwt_tenant_claim) if isinstance(claims, dict) else None
        tenant = snapshot.tenants.get(name) if isinstance(name, str) else None
        if tenant is None:
            return _deny_401("JWT names no known tenant")
        return tenant

    def _priority(self, headers: Mapping[str, str], tenant: Tenant) -> int:
        asked = headers.get(self._settings.priority_header, "")
        if asked.isdigit() and len(asked) < 3:
            return min(int(asked), tenant.max_priority)  # a caller cannot exceed its ceiling
        return tenant.priority
