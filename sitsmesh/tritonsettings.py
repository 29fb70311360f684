"""The `triton` setting: the production Triton servers, each with its metrics and the
sandbox that vets candidates for it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sitsmesh import settingvalues as values


@dataclass(frozen=True, slots=True)
class TritonEndpoint:
    """One production Triton server, and the sandbox that vets candidates for it."""

    name: str
    url: str                  # gRPC HOST:PORT
    metrics_url: str = ""     # http://HOST:PORT/metrics; pressure and drain read it
    preflight_url: str = ""   # gRPC HOST:PORT of a sandbox serving the same repository



_ENDPOINT_KEYS = {"name": values.string, "url": values.grpc_target, "metrics_url": values.http_url,
                  "preflight_url": values.grpc_target}


def endpoints(raw: Any) -> tuple[TritonEndpoint, ...]:
    """A YAML list of endpoints, or the same list as JSON (environment, flag)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError("expected a list of endpoints (JSON from a flag or the "
                             "environment)") from None
    if not isinstance(raw, list):
        raise ValueError(f"expected a list of endpoints, got {type(raw).__name__}")
    endpoints: list[TritonEndpoint] = []
    for i, item in enumerate(raw):
        where = f"endpoint {i + 1}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a mapping, got {type(item).__name__}")
        for key in item:
            if key not in _ENDPOINT_KEYS:
                raise ValueError(f"{where}: unknown key '{key}' (allowed: "
                                 f"{', '.join(_ENDPOINT_KEYS)})")
        for key in ("name", "url"):
            if key not in item:
                raise ValueError(f"{where}: '{key}' is required")
        values: dict[str, str] = {}
        for key, parse in _ENDPOINT_KEYS.items():
            if key in item:
                try:
                    values[key] = parse(item[key])
                except ValueError as exc:
                    raise ValueError(f"{where}: '{key}': {exc}") from None
        if any(e.name == values["name"] for e in endpoints):
            raise ValueError(f"{where}: name '{values['name']}' is used twice")
        endpoints.append(TritonEndpoint(**values))
    return tuple(endpoints)
