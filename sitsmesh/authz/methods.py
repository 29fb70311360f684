"""HTTP methods each route family accepts (README "Request-path policy").

A route's family follows from what extract.classify made of its path: inference
routes (KServe infer/generate, OpenAI completions, chat, embeddings, responses) take
POST; metadata (`/v2`, `/v2/models/{m}`, `/v1/models/{m}`) and health
(`/v2/health/*`, `/v2/models/{m}/ready`) take GET and HEAD, so OpenAI's delete-model
call (`DELETE /v1/models/{m}`) is not read as metadata; operator open paths take GET,
HEAD and POST. gRPC calls are POST by protocol and cannot be configured otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sitsmesh.keyvalues import split_pairs

INFERENCE, METADATA, HEALTH, OPEN, GRPC = "inference", "metadata", "health", "open", "grpc"
# RFC 9110's methods and PATCH (RFC 5789): a misspelt method in a setting would
# otherwise admit nothing, silently.
KNOWN = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT")
# Tuples in KNOWN's order, not sets: settings print (and hash into config_version) the
# same in every process.
DEFAULTS: Mapping[str, tuple[str, ...]] = {
    INFERENCE: ("POST",),
    METADATA: ("GET", "HEAD"),
    HEALTH: ("GET", "HEAD"),
    OPEN: ("GET", "HEAD", "POST"),
    GRPC: ("POST",),
}
CONFIGURABLE = (INFERENCE, METADATA, HEALTH, OPEN)

# Request classes that name their family outright; "metadata" needs the path.
_BY_CLASS = {"infer": INFERENCE, "generate": INFERENCE, "stream": INFERENCE,
             "openai": INFERENCE, "grpc": GRPC, "other": OPEN}
_HEALTH = re.compile(r"^/v2/(?:health/(?:live|ready)|models/[^/]+(?:/versions/[^/]+)?/ready)$",
                     re.IGNORECASE)


def family(request_class: str, normalized_path: str) -> str:
    """The family of an admitted route: its request class, and for class "metadata" the
    normalized path (a gRPC method, a health route, or metadata)."""
    found = _BY_CLASS.get(request_class)
    if found is not None:
        return found
    if normalized_path[:11].lower() == "/inference.":
        return GRPC
    return HEALTH if _HEALTH.match(normalized_path) else METADATA


def allow_header(methods: tuple[str, ...]) -> str:
    """The methods as an `allow` header lists them."""
    return ", ".join(methods)


def parse(raw: Any) -> dict[str, tuple[str, ...]]:
    """The `authz_methods` setting: YAML `{family: [METHOD, ...]}` (or "GET|HEAD"), or
    `family=METHOD|METHOD,family=METHOD` (environment, flag). Families not named keep
    their defaults; the result holds every family."""
    items: list[tuple[Any, Any]]
    if isinstance(raw, dict):
        items = list(raw.items())
    elif isinstance(raw, str):
        items = [(k, v) for k, v in split_pairs(raw, "FAMILY=METHOD|METHOD")]
    else:
        raise ValueError(f"expected a mapping of route family to methods, got {raw!r}")
    found = dict(DEFAULTS)
    for key, value in items:
        if key == GRPC:
            raise ValueError("grpc: gRPC calls are POST by protocol; the family cannot be "
                             "configured")
        if key not in CONFIGURABLE:
            raise ValueError(f"unknown route family {key!r} (allowed: "
                             f"{', '.join(CONFIGURABLE)})")
        names = value.split("|") if isinstance(value, str) else value
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{key}: expected a list of HTTP methods, got {value!r}")
        methods = {n.strip().upper() for n in names if n.strip()}
        if not methods:
            raise ValueError(f"{key}: expected at least one HTTP method")
        unknown = sorted(methods.difference(KNOWN))
        if unknown:
            raise ValueError(f"{key}: unknown HTTP method {unknown[0]!r} (allowed: "
                             f"{', '.join(KNOWN)})")
        found[key] = tuple(m for m in KNOWN if m in methods)
    return found
