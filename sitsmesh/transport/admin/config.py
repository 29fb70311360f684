"""sitsmesh.admin.v1.ConfigService: declarative documents applied in one transaction.

Apply validates every document with the models (the domain validators' messages),
plans the writes against the stored records, and commits them with one
StateStore.apply; every existing record carries its revision, so a concurrent change
fails the whole apply with ABORTED. Then the views the imperative RPCs refresh are
refreshed here too, and other processes follow the store's revision as usual.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any, cast

import grpc
from google.protobuf.json_format import MessageToDict
from grpc import aio

from sitsmesh import logs, workerguard
from sitsmesh.access import GLOBAL, PIPELINE, TENANT, WRITE, Credential, content, denial
from sitsmesh.admin.v1 import config_pb2, config_pb2_grpc
from sitsmesh.authz.directory import TenantDirectory
from sitsmesh.authz.model import APIKEY_KIND, new_uid, tenant_from
from sitsmesh.budgets.model import budget_from
from sitsmesh.chains.catalog import PipelineCatalog
from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.declarative import documents
from sitsmesh.declarative.models import KINDS, Document, PipelineDocument
from sitsmesh.declarative.plan import (
    CONFIGURED,
    CREATED,
    LABELS_KIND,
    PRUNED,
    STORE_KIND,
    UNCHANGED,
    Plan,
    Stored,
    document,
    plan,
    selector,
)
from sitsmesh.errors import ConfigError, ConflictError, InvalidArgumentError, NotFoundError
from sitsmesh.pressure.ledger import ThresholdLedger
from sitsmesh.pressure.thresholds import AUDIT_KIND
from sitsmesh.ratelimit.reload import ConfigManager
from sitsmesh.state import Put, StateStore
from sitsmesh.transport.admin.pressure import ACTOR_METADATA, MAX_ACTOR
from sitsmesh.transport.admin.service import guarded
from sitsmesh.transport.adminaccess import AdminAccess
from sitsmesh.transport.auth import PermissionDeniedError
from sitsmesh.transport.errors import abort, refuse

SERVICE_NAME = config_pb2.DESCRIPTOR.services_by_name["ConfigService"].full_name
ACTIONS = {CREATED: config_pb2.APPLY_ACTION_CREATED,
           CONFIGURED: config_pb2.APPLY_ACTION_CONFIGURED,
           UNCHANGED: config_pb2.APPLY_ACTION_UNCHANGED, PRUNED: config_pb2.APPLY_ACTION_PRUNED}
# Each kind's resource for the access policy, as the Admin RPCs writing it are judged:
# (resource kind, whether the object's name is the resource's name).
ACCESS_KIND = {"Tenant": (TENANT, True), "ApiKeyPolicy": (TENANT, True),
               "TokenBudget": (TENANT, True),
               "Pipeline": (PIPELINE, True), "Thresholds": (PIPELINE, True),
               "RateLimitConfig": (GLOBAL, False)}
_log = logs.get("sitsmesh.admin")


class ConfigServicer:
    def __init__(self, state: StateStore, directory: TenantDirectory,
                 pipelines: PipelineCatalog, thresholds: ThresholdLedger,
                 ratelimit: ConfigManager, *, access: AdminAccess, workers: int = 1,
                 budget_workers: int = 1,
                 clock: Callable[[], float] = time.time) -> None:
        self._state = state
        self._access = access
        self._directory = directory
        self._pipelines = pipelines
        self._thresholds = thresholds
        self._ratelimit = ratelimit
        self._workers = workers
        # Workers that would each spend their own token budgets (the memory store).
        self._budget_workers = budget_workers
        self._clock = clock
        self._sequence = 0
        self.Apply = guarded(self._apply)
        self.Get = guarded(self._get)

    def add_to_server(self, server: aio.Server) -> None:
        config_pb2_grpc.add_ConfigServiceServicer_to_server(
            cast(config_pb2_grpc.ConfigServiceServicer, self), server)

    async def _stored(self, kinds: set[str]) -> Stored:
        records = {(r.kind, r.name): r for kind in sorted(kinds)
                   for r in await self._state.list(STORE_KIND[kind])}
        labels = {}
        for r in await self._state.list(LABELS_KIND):
            kind, _, name = r.name.partition("/")
            labels[(kind, name)] = r
        keys = await self._state.list(APIKEY_KIND) if "Tenant" in kinds else []
        return Stored(records, labels, keys)

    async def _authorize(self, credential: Credential, docs: list[Document], result: Plan,
                         stored: Stored, context: aio.ServicerContext[Any, Any]) -> None:
        """Write access to every object the apply names or prunes (a dry run too: it
        shows what the caller could not otherwise change), judged as the Admin RPCs that
        write them are, by name and by content (models, governed tenants, reserved
        labels); every refusal listed (up to a bound), nothing applied."""
        # Up to 500 documents of globs to judge: off the event loop, as the parse is.
        refusals = await asyncio.to_thread(_refusals, credential, docs, result, stored)
        if refusals:
            await abort(context, PermissionDeniedError(
                f"Apply: {len(refusals)} refused: {content.bounded(refusals)}"))

    @staticmethod
    def _govern(credential: Credential, docs: list[Document]) -> None:
        """A pipeline an operator applies without `tenants` governs its tenants scope."""
        default = content.governed_default(credential)
        for doc in docs:
            if isinstance(doc, PipelineDocument) and doc.spec.tenants is None:
                doc.spec.tenants = default

    def _guard(self, docs: list[Document]) -> None:
        """What --workers N refuses through the imperative RPCs, refused here alike."""
        if self._budget_workers > 1:
            for doc in docs:
                if doc.KIND == "TokenBudget":
                    raise workerguard.refuse_budget(doc.metadata.name)
        if self._workers <= 1:
            return
        for doc in docs:
            if doc.KIND == "Pipeline":
                raise workerguard.refuse_pipeline(doc.metadata.name)
            if doc.KIND == "Tenant" and doc.body()["max_concurrency"] > 0:
                raise workerguard.refuse_cap(doc.metadata.name)

    async def _check_ratelimit(self, docs: list[Document], result: Plan) -> None:
        """Rate-limit configs validate together with the live ones (replaces, file
        domains), as ApplyRateLimitConfig does."""
        changed = {o.name for o in result.touched("RateLimitConfig") if o.action != PRUNED}
        dropped = [o.name for o in result.touched("RateLimitConfig") if o.action == PRUNED]
        if not changed and not dropped:
            return
        files = [(d.metadata.name, d.body()["yaml"]) for d in docs
                 if d.KIND == "RateLimitConfig" and d.metadata.name in changed]
        try:
            await self._ratelimit.check(files, dropped)
        except ConfigError as exc:
            raise InvalidArgumentError(f"RateLimitConfig: {exc.message}") from None

    def _audit(self, result: Plan, stored: Stored, actor: str, peer: str) -> list[Put]:
        """Threshold changes are audited as SetThresholds audits them, in the same
        transaction as the change."""
        entries = []
        now = self._clock()
        for write in result.writes:
            if not isinstance(write, Put) or write.kind != STORE_KIND["Thresholds"]:
                continue
            before = stored.records.get((write.kind, write.name))
            self._sequence += 1
            entries.append(Put(AUDIT_KIND, f"{now:017.6f}-{self._sequence:04d}-{write.name}", {
                "pipeline": write.name, "actor": actor, "peer": peer, "at": now,
                "before": before.body if before is not None else None, "after": write.body}))
        return entries

    async def _refresh(self, result: Plan) -> None:
        kinds = {o.kind for o in result.outcomes if o.action != UNCHANGED}
        if kinds & {"Tenant", "TokenBudget"}:
            await self._directory.refresh()
        if "Pipeline" in kinds:
            await self._pipelines.refresh()
        if "Thresholds" in kinds:
            await self._thresholds.refresh()
        if "RateLimitConfig" in kinds:
            await self._ratelimit.reload("declarative apply")

    async def _apply(self, request: config_pb2.ApplyRequest,
                     context: aio.ServicerContext[Any, Any]) -> config_pb2.ApplyResponse:
        credential, actor = await self._access.authenticate("ConfigService/Apply", context)
        if credential.role == "viewer":
            # Decided by the credential alone: refused before a byte of YAML is parsed.
            await abort(context, PermissionDeniedError(
                f"Apply: credential '{credential.name}' (viewer) may not write: viewers "
                "only read"))
        # Up to 1 MiB of YAML is tens of milliseconds of CPU: off the event loop, which
        # also serves Check and ShouldRateLimit in a single process.
        docs = await asyncio.to_thread(_read, request)
        if request.prune_selector and not request.prune:
            raise InvalidArgumentError("prune_selector is only used with prune")
        prune = selector(request.prune_selector) if request.prune else None
        self._guard(docs)
        self._govern(credential, docs)
        kinds = {d.KIND for d in docs}
        stored = await self._stored(kinds)
        result = await asyncio.to_thread(plan, docs, stored, prune=prune, new_uid=new_uid)
        await self._authorize(credential, docs, result, stored, context)
        await self._check_ratelimit(docs, result)
        applied = not request.dry_run and bool(result.writes)
        if applied:
            # As SetThresholds audits: the authenticated credential; the header is a note.
            claimed = str(dict(context.invocation_metadata() or ()).get(ACTOR_METADATA, "")
                          or "")[:MAX_ACTOR]
            actor += f" (on behalf of {claimed})" if claimed else ""
            writes = [*result.writes, *self._audit(result, stored, actor, context.peer())]
            try:
                revision = await self._state.apply(writes)
            except (ConflictError, NotFoundError) as exc:
                refuse(context, grpc.StatusCode.ABORTED,
                       f"changed while applying ({exc.message}); nothing was applied: "
                       "apply again")
            await self._refresh(result)
            _log.info("declarative config applied", actor=actor, revision=revision,
                      changed=[f"{o.kind}/{o.name}:{o.action}" for o in result.outcomes
                               if o.action != UNCHANGED])
        else:
            revision = await self._state.revision()
        return config_pb2.ApplyResponse(
            results=[config_pb2.DocumentResult(kind=o.kind, name=o.name,
                                               action=ACTIONS[o.action], diff=o.diff)
                     for o in result.outcomes],
            applied=applied, revision=revision)

    async def _get(self, request: config_pb2.GetRequest,
                   context: aio.ServicerContext[Any, Any]) -> config_pb2.GetResponse:
        await self._access.authenticate("ConfigService/Get", context)  # every role reads
        if request.kind and request.kind not in KINDS:
            raise InvalidArgumentError(f"kind must be one of {', '.join(KINDS)}, got "
                                       f"{request.kind!r}")
        if request.name and not request.kind:
            raise InvalidArgumentError("a name needs its kind")
        kinds = [request.kind] if request.kind else list(KINDS)
        stored = await self._stored(set(kinds))
        found = []
        for kind in kinds:
            for (store_kind, name), record in sorted(stored.records.items()):
                if store_kind != STORE_KIND[kind] or (request.name and name != request.name):
                    continue
                labels = stored.labels.get((kind, name))
                doc = document(kind, name, record.body,
                               labels.body.get("labels", {}) if labels is not None else {})
                found.append(config_pb2.ConfigDocument(kind=kind, name=name,
                                                       json=json.dumps(doc)))
        if request.name and not found:
            raise NotFoundError(f"{request.kind} {request.name} does not exist")
        return config_pb2.GetResponse(documents=found)


def _refusals(credential: Credential, docs: list[Document], result: Plan,
              stored: Stored) -> list[str]:
    refusals = []
    for doc in docs:
        kind, name = doc.KIND, doc.metadata.name
        resource, scoped = ACCESS_KIND[kind]
        reason = denial(credential, WRITE, resource, name if scoped else "")
        if reason is None:
            reason = content.refusal(credential, f"{kind} '{name}'",
                                     _problems(credential, doc, stored))
        if reason is not None:
            refusals.append(f"{kind}/{name}: {reason}")
    for outcome in result.outcomes:
        if outcome.action != PRUNED:
            continue
        resource, scoped = ACCESS_KIND[outcome.kind]
        reason = denial(credential, WRITE, resource, outcome.name if scoped else "")
        if reason is not None:
            refusals.append(f"{outcome.kind}/{outcome.name}: {reason}")
    return refusals


def _problems(credential: Credential, doc: Document, stored: Stored) -> list[str]:
    """What of `doc`'s content lies outside the credential's scopes, against the stored
    object (what it already holds may stay)."""
    kind, name = doc.KIND, doc.metadata.name
    record = stored.records.get((STORE_KIND[kind], name))
    labels = stored.labels.get((kind, name))
    problems = content.labels(credential, doc.metadata.labels,
                              labels.body.get("labels", {}) if labels is not None else {},
                              "metadata.labels")
    if kind == "Tenant":
        body = doc.body()
        before = tenant_from(name, record.body) if record is not None else None
        problems += content.tenant_problems(
            credential, body["models"], body["labels"],
            before_models=before.models if before is not None else (),
            before_labels=before.labels if before is not None else None)
    elif kind == "TokenBudget":
        problems += content.budget_problems(
            credential, budget_from(name, doc.body()),
            budget_from(name, record.body) if record is not None else None)
    elif kind == "Pipeline":
        problems += content.pipeline_problems(
            credential, pipeline_from(name, doc.body()),
            pipeline_from(name, record.body) if record is not None else None)
    return problems


def _read(request: config_pb2.ApplyRequest) -> list[Document]:
    raws, where = documents.load_files(
        [(f.name or f"files[{i}]", f.documents) for i, f in enumerate(request.files)],
        [MessageToDict(o) for o in request.objects])
    if not raws:
        raise InvalidArgumentError("no documents to apply")
    return documents.validate(raws, where)
