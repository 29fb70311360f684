"""envoy.service.auth.v3.Authorization/Check: protobuf in, Authorizer decision out."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any
from urllib.parse import quote

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf.struct_pb2 import Struct
from google.rpc import code_pb2, status_pb2
from grpc import aio

from sitsmesh.authz.check import Allowed, Authorizer, CheckInput, Denied
from sitsmesh.budgets.gate import BudgetGate
from sitsmesh.budgets.model import TokenBudget
from sitsmesh.pressure.gate import Shed
from sitsmesh.telemetry.decisions import Telemetry
from sitsmesh.transport.checklimits import CheckLimits

SERVICE_NAME = external_auth_pb2.DESCRIPTOR.services_by_name["Authorization"].full_name
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_RPC_CODE = {400: code_pb2.INVALID_ARGUMENT, 401: code_pb2.UNAUTHENTICATED,
             403: code_pb2.PERMISSION_DENIED, 405: code_pb2.PERMISSION_DENIED,
             429: code_pb2.RESOURCE_EXHAUSTED, 503: code_pb2.UNAVAILABLE}
_OK_STATUS = status_pb2.Status(code=code_pb2.OK)
JWT_AUTHN = "envoy.filters.http.jwt_authn"
# The route's ext_authz context extension for streams checked message by message (set
# by Envoy's route config, which no client writes).
STREAM_CHECK, PER_MESSAGE = "sitsmesh_stream_check", "per_message"


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, value=value),
                                      append_action=_OVERWRITE)


def grpc_message(text: str) -> str:
    """gRPC's percent-encoding: printable ASCII stays, everything else (and %) is escaped."""
    return "".join(c if " " <= c <= "~" and c != "%" else quote(c) for c in text)


def _denied(decision: Denied) -> Any:
    body: dict[str, Any] = {"code": decision.code, "message": decision.message}
    if decision.budget:
        body["budget"] = decision.budget
    headers = [_header("content-type", "application/json"),
               *(_header(k, v) for k, v in decision.headers)]
    if decision.status == 401:
        headers.append(_header("www-authenticate", 'Bearer realm="sitsmesh"'))
    if decision.allow:
        headers.append(_header("allow", decision.allow))
    if decision.status in (429, 503):
        retry = max(1, round(decision.retry_after_s))
        body["retry_after_s"] = retry
        headers.append(_header("retry-after", str(retry)))
    if decision.grpc:
        # Envoy turns a bare 429 into UNAVAILABLE for gRPC callers, which clients retry
        # at once; a shed call must say RESOURCE_EXHAUSTED.
        headers.append(_header("grpc-status", str(_RPC_CODE[decision.status])))
        headers.append(_header("grpc-message", grpc_message(decision.message)))
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=_RPC_CODE[decision.status], message=decision.message),
        denied_response=external_auth_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=decision.status), headers=headers,
            body=json.dumps(body)))


def verified_claim(context: Any, key: str, claim: str) -> str:
    """A claim of the payload Envoy's jwt_authn verified and put in dynamic metadata
    under `key` (its payload_in_metadata); "" when there is none."""
    filters = context.filter_metadata
    if JWT_AUTHN not in filters:
        return ""
    payload = filters[JWT_AUTHN].fields.get(key)
    if payload is None:
        return ""
    value = payload.struct_value.fields.get(claim)
    return value.string_value if value is not None else ""


def _allowed(decision: Allowed, more: tuple[tuple[str, str], ...] = ()) -> Any:
    metadata = Struct()
    metadata.update({"tenant": decision.tenant, "priority": decision.priority,
                     "model": decision.model, "request_class": decision.request_class})
    return external_auth_pb2.CheckResponse(
        status=_OK_STATUS,
        ok_response=external_auth_pb2.OkHttpResponse(
            headers=[_header(k, v) for k, v in (*decision.set_headers, *more)],
            headers_to_remove=list(decision.remove_headers)),
        dynamic_metadata=metadata)


MAX_CACHED_REPLIES = 10_000


class AuthorizationServicer(external_auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    def __init__(self, authorizer: Authorizer, limits: CheckLimits | None = None,
                 telemetry: Telemetry | None = None, budgets: BudgetGate | None = None
                 ) -> None:
        """`budgets`: token budgets, reserved for each LLM request of a tenant that has
        one (sitsmesh/budgets/gate.py); the only Check that waits on I/O."""
        self._authorizer = authorizer
        self._telemetry = telemetry
        self._budgets = budgets
        self._jwt_key = authorizer.settings.jwt_metadata_key
        self._jwt_claim = authorizer.settings.jwt_tenant_claim
        self.limits = limits or CheckLimits()
        # An answer depends only on its decision, and few distinct decisions exist
        # (tenant x priority x model x class): build each reply once, not per Check.
        self._replies: dict[Allowed | Denied, Any] = {}

    def _reply(self, decision: Allowed | Denied) -> Any:
        reply = self._replies.get(decision)
        if reply is None:
            reply = _denied(decision) if isinstance(decision, Denied) else _allowed(decision)
            if len(self._replies) >= MAX_CACHED_REPLIES:
                self._replies.clear()
            self._replies[decision] = reply
        return reply

    async def Check(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        started = time.perf_counter()
        refused = self.limits.screen(request)
        if refused is not None:
            if self._telemetry is not None:
                self._telemetry.refused(self.limits.refusal(request), started)
            return refused
        attributes = request.attributes
        is_http = attributes.request.HasField("http")
        http = attributes.request.http
        headers: dict[str, str] = dict(http.headers)
        if not headers and http.HasField("header_map"):
            headers = {h.key: h.value or h.raw_value.decode(errors="replace")
                       for h in http.header_map.headers}
        body = http.raw_body or http.body.encode()
        jwt_tenant = verified_claim(attributes.metadata_context, self._jwt_key,
                                     self._jwt_claim) if self._jwt_key else ""
        checked = CheckInput(headers, http.path, body, attributes.source.principal,
                             headers.get("x-request-id") or http.id, is_http, jwt_tenant,
                             http.method or headers.get(":method", ""),
                             attributes.context_extensions.get(STREAM_CHECK) == PER_MESSAGE)
        decision = self._authorizer.check(checked)
        if type(decision) is Allowed and decision.waiting is not None:
            decision = await _wait_for_room(decision)
        if self._budgets is not None and type(decision) is Allowed:
            budget = self._budgets.governs(decision)
            if isinstance(budget, Denied):
                decision = budget
            elif budget is not None:
                return await self._reserve(budget, decision, checked, started, context)
        if self._telemetry is not None:
            self._telemetry.check(checked, decision, started, context)
        return self._reply(decision)

    async def _reserve(self, budget: TokenBudget, decision: Allowed, checked: CheckInput,
                       started: float, context: aio.ServicerContext[Any, Any]) -> Any:
        """A request its tenant's token budget governs: its answer carries its own
        figures, so it is built for it, not cached."""
        assert self._budgets is not None
        spent = await self._budgets.reserve(budget, decision, checked)
        final: Allowed | Denied = spent if isinstance(spent, Denied) else decision
        if spent is not None and not isinstance(spent, Denied):
            final = dataclasses.replace(decision, reserved_tokens=spent.estimate.cost)
        if self._telemetry is not None:
            self._telemetry.check(checked, final, started, context)
        if isinstance(spent, Denied):
            return _denied(spent)
        return _allowed(decision, spent.headers if spent is not None else ())


async def _wait_for_room(decision: Allowed) -> Allowed | Denied:
    """A request held at its pipeline's entry: admitted once there is room, or refused
    when it waited its time (pressure.entryqueue)."""
    waiter = decision.waiting
    assert waiter is not None
    try:
        let_in = await waiter.future
    except BaseException:
        waiter.abandon()  # Envoy gave up on the Check: the request never goes on
        raise
    if let_in:
        return dataclasses.replace(decision, waiting=None)
    refusal = waiter.refusal
    assert isinstance(refusal, Shed)
    return Denied(429, refusal.reason, refusal.message, float(refusal.retry_after_s),
                  grpc=waiter.grpc, tenant=decision.tenant)


def add_to_server(servicer: AuthorizationServicer, server: aio.Server) -> None:
    handlers = {"Check": grpc.unary_unary_rpc_method_handler(
        servicer.Check, request_deserializer=servicer.limits.deserializer(),
        response_serializer=external_auth_pb2.CheckResponse.SerializeToString)}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    # Registered methods are looked up in C core, skipping the per-call Python lookup.
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
