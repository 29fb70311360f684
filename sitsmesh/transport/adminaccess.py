"""Who is calling the admin API, and may they make this call: each Admin RPC's behaviour
is wrapped so the check sees the request (an aio interceptor cannot), decides through
sitsmesh.access, and leaves the caller's name for the audit (`caller()`).

`RULES` is the one table: RPC -> (verb, resource kind, where the resource's name is in
the request: a dotted field path, optionally resolved through a lookup). An RPC missing
from it is an admin-only write (deny by default); a unit test keeps it complete.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from grpc import aio

from sitsmesh import logs
from sitsmesh.access import GLOBAL, MODEL, PIPELINE, READ, SCOPE_OF, TENANT, WRITE, denial
from sitsmesh.access.credentials import Credential, CredentialSet
from sitsmesh.admin.v1 import admin_pb2_grpc
from sitsmesh.errors import SitsmeshError, UnauthenticatedError
from sitsmesh.transport.admin.common import read_yaml
from sitsmesh.transport.admin.service import METHODS
from sitsmesh.transport.auth import PermissionDeniedError, peer_identities
from sitsmesh.transport.errors import abort

_log = logs.get("sitsmesh.admin.access")
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("admin_caller", default="")
_CREDENTIAL: contextvars.ContextVar[Credential | None] = contextvars.ContextVar(
    "admin_credential", default=None)
# (the YAML text, its document) when the check parsed it: the call reuses it.
_PARSED: contextvars.ContextVar[tuple[str, Any] | None] = contextvars.ContextVar(
    "admin_parsed", default=None)
NOT_PARSED = object()
_UNAUTHENTICATED = UnauthenticatedError(
    "admin API needs 'authorization: Bearer <token>' with a valid token, or a client "
    "certificate mapped to a credential")


@dataclass(frozen=True, slots=True)
class Rule:
    verb: str
    kind: str = GLOBAL
    field: str = ""      # dotted path to the resource name in the request
    via: str = ""        # a lookup from that value to the resource name (see AdminAccess)


async def _pipeline_in_yaml(text: str) -> str:
    """ApplyPipeline names its pipeline inside the YAML; unreadable YAML names none. Only
    an operator's call gets here (the credential alone decides the others), bounded by
    size before parsing and parsed off the event loop."""
    doc = await read_yaml(text, "pipeline")
    _PARSED.set((text, doc))
    name = doc.get("name") if isinstance(doc, dict) else None
    return name if isinstance(name, str) else ""


VIA_KEY_TENANT = "key_tenant"  # RevokeApiKey names a key id; the key's tenant is checked
VIA_YAML = "yaml"

RULES: Mapping[str, Rule] = {
    "GetStatus": Rule(READ),
    "ApplyRateLimitConfig": Rule(WRITE),
    "GetRateLimitConfig": Rule(READ),
    "DeleteRateLimitConfig": Rule(WRITE),
    "CreateTenant": Rule(WRITE, TENANT, "tenant.name"),
    "UpdateTenant": Rule(WRITE, TENANT, "tenant.name"),
    "GetTenant": Rule(READ, TENANT, "name"),
    "ListTenants": Rule(READ, TENANT),
    "DeleteTenant": Rule(WRITE, TENANT, "name"),
    "CreateApiKey": Rule(WRITE, TENANT, "tenant"),
    "ListApiKeys": Rule(READ, TENANT, "tenant"),
    "RevokeApiKey": Rule(WRITE, TENANT, "id", via=VIA_KEY_TENANT),
    "GetTokenUsage": Rule(READ, TENANT, "tenant"),
    "ApplyPipeline": Rule(WRITE, PIPELINE, "yaml", via=VIA_YAML),
    "GetPipeline": Rule(READ, PIPELINE, "name"),
    "ListPipelines": Rule(READ, PIPELINE),
    "DeletePipeline": Rule(WRITE, PIPELINE, "name"),
    "GetLatencyChain": Rule(READ, PIPELINE, "pipeline"),
    # Request-streamed, pipelines mixed in one stream: kept global (admin only).
    "ReportStageLatency": Rule(WRITE),
    "ListModels": Rule(READ, MODEL),
    "SwapModel": Rule(WRITE, MODEL, "model"),
    "GetSwap": Rule(READ, MODEL),
    "ListSwaps": Rule(READ, MODEL, "model"),
    "GetThresholds": Rule(READ, PIPELINE, "pipeline"),
    "SetThresholds": Rule(WRITE, PIPELINE, "pipeline"),
    "ListThresholdChanges": Rule(READ, PIPELINE, "pipeline"),
    "WatchPressure": Rule(READ, PIPELINE, "pipeline"),
    "ProfileModel": Rule(WRITE, MODEL, "model"),
    "GetModelProfile": Rule(READ, MODEL, "model"),
    # A dry run too: it reads the model's live config and the stage's live rate.
    "TuneModel": Rule(WRITE, MODEL, "model"),
    "SetAutoTuning": Rule(WRITE, PIPELINE, "auto_tuning.pipeline"),
    "GetAutoTuning": Rule(READ, PIPELINE, "pipeline"),
    "ListBatchingChanges": Rule(READ, MODEL, "model"),
}
_ADMIN_ONLY = Rule(WRITE)


def rule(method: str) -> Rule:
    return RULES.get(method, _ADMIN_ONLY)


def caller() -> str:
    """Who the current admin call authenticated as ("" outside one), for audit records."""
    return _CALLER.get()


def parsed(text: str) -> Any:
    """The document the access check parsed of this very `text` in the current call, or
    NOT_PARSED: ApplyPipeline's YAML is read once, not once per step."""
    found = _PARSED.get()
    # Equal, not identical: protobuf hands out a new str on every read of a field.
    return found[1] if found is not None and found[0] == text else NOT_PARSED


def credential() -> Credential | None:
    """The credential of the current admin call (None outside one): the servicers judge
    by it what a request writes, beyond the name `RULES` checks."""
    return _CREDENTIAL.get()


def field_value(request: Any, path: str) -> str:
    value = request
    for part in path.split("."):
        value = getattr(value, part)
    return str(value)


Lookup = Callable[[str], Awaitable[str]]


class AdminAccess:
    """Authenticates and authorizes every Admin RPC against the current credential set.

    `lookups` resolve a `via` (VIA_KEY_TENANT: key id -> its tenant, "" if none).
    `reload(new)` swaps the snapshot; calls in flight finish under the one they started
    with. `on_reject` counts unauthenticated calls.
    """

    def __init__(self, credentials: CredentialSet, lookups: Mapping[str, Lookup],
                 on_reject: Callable[[], None] = lambda: None) -> None:
        self.credentials = credentials
        self._lookups = {VIA_YAML: _pipeline_in_yaml, **lookups}
        self._on_reject = on_reject

    def reload(self, credentials: CredentialSet) -> None:
        self.credentials = credentials

    def add_to_server(self, servicer: Any, server: Any) -> None:
        """Register `servicer`'s Admin RPCs on `server`, each behind the check."""
        guarded = _Guarded()
        for method in METHODS:
            setattr(guarded, method, self.guard(method, getattr(servicer, method)))
        admin_pb2_grpc.add_AdminServiceServicer_to_server(
            cast(admin_pb2_grpc.AdminServiceServicer, guarded), server)

    def guard(self, method: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        wanted = rule(method)
        if inspect.isasyncgenfunction(inner):
            async def stream(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
                # Not reset after: a generator may be closed from another context (which
                # reset() refuses), and each RPC runs in a task, and a context, of its own.
                who, actor = await self._check(method, wanted, request, context)
                _CALLER.set(actor)
                _CREDENTIAL.set(who)
                async for item in inner(request, context):
                    yield item

            return stream

        async def unary(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            who, actor = await self._check(method, wanted, request, context)
            token, held = _CALLER.set(actor), _CREDENTIAL.set(who)
            try:
                return await inner(request, context)
            finally:
                _CREDENTIAL.reset(held)
                _CALLER.reset(token)

        return unary

    async def authenticate(self, method: str, context: aio.ServicerContext[Any, Any]
                           ) -> tuple[Credential, str]:
        """(the caller's credential, its audit name); aborts UNAUTHENTICATED otherwise.
        Services beside Admin whose requests name many resources (ConfigService) call
        this, then `denial` for each resource."""
        identities = peer_identities(context)
        credential, by_token = self._authenticate(context, identities)
        if credential is None:
            self._on_reject()
            why = ("wrong bearer token" if by_token else
                   "no credential for the client certificate" if identities else
                   "missing bearer token")
            _log.warning("admin call rejected", method=method, peer=context.peer(),
                         identities=list(identities), reason=why)
            await abort(context, _UNAUTHENTICATED)
        actor = credential.name
        if by_token and identities:
            actor += f" via {identities[0]}"
        return credential, actor

    async def _check(self, method: str, wanted: Rule, request: Any,
                     context: aio.ServicerContext[Any, Any]) -> tuple[Credential, str]:
        """The caller's credential and audit name if it may make this call; aborts the
        call otherwise."""
        credential, actor = await self.authenticate(method, context)
        if wanted.verb == READ:
            return credential, actor
        # What the credential alone decides is decided before the request's content is
        # read: a viewer's (or an unscoped operator's) 4 MB ApplyPipeline is refused
        # without parsing it, and an admin's YAML is not parsed for the audit line.
        scoped = bool(credential.scopes.get(SCOPE_OF.get(wanted.kind, ""), ()))
        reads_name = bool(wanted.field) and (
            scoped if credential.role == "operator" else
            credential.role == "admin" and wanted.via != VIA_YAML)
        name = ""
        if reads_name:
            # Streamed requests are not here to read; the table keeps those RPCs global.
            name = field_value(request, wanted.field)
            if wanted.via:
                try:
                    name = await self._lookups[wanted.via](name)
                except SitsmeshError as exc:
                    await abort(context, exc)
        reason = denial(credential, wanted.verb, wanted.kind, name)
        if reason is not None:
            _log.warning("admin call denied", actor=actor, method=method, kind=wanted.kind,
                         resource=name, peer=context.peer())
            await abort(context, PermissionDeniedError(f"{method}: {reason}"))
        _log.info("admin write", actor=actor, method=method, kind=wanted.kind,
                  resource=name or None, peer=context.peer())
        return credential, actor

    def _authenticate(self, context: aio.ServicerContext[Any, Any],
                      identities: tuple[str, ...]) -> tuple[Credential | None, bool]:
        """(credential, whether a token proved it). A token, when sent, decides alone:
        a wrong one is refused even from a mapped certificate."""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                raw = value.encode() if isinstance(value, str) else value
                scheme, _, presented = raw.partition(b" ")
                if scheme.lower() != b"bearer" or not presented.strip():
                    return None, True
                return self.credentials.by_token(presented.strip()), True
        return self.credentials.by_identity(identities), False


class _Guarded:
    """Stands in for the servicer in the generated registrar, which looks RPCs up by name."""

