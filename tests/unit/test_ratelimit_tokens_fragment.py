"""filters/fragments/ratelimit_tokens.yaml: envoyconf.charge_tokens_on gives its filter
the fragment's rate_limits on the named routes, and Envoy (`--mode validate`) accepts the
result next to the other fragments it is meant to run with, and refuses misspelt fields
(so the validation reads them)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from sitsmesh.dev import envoyconf, harness
from sitsmesh.errors import ConfigError

BOOTSTRAP = harness.REPO / "filters" / "local" / "bootstrap.yaml"
FRAGMENTS = ["ext_authz", "token_timing", "access_log", "ratelimit", "ratelimit_tokens"]


def _rendered() -> dict[str, Any]:
    values = harness.envoy_values("127.0.0.1:5001", 5002, 5003, 5004)
    return envoyconf.render(BOOTSTRAP, values, FRAGMENTS)


def _route(config: dict[str, Any], name: str) -> dict[str, Any]:
    routes = envoyconf.http_connection_manager(config)["route_config"]["virtual_hosts"][0][
        "routes"]
    found: dict[str, Any] = next(r for r in routes if r["name"] == name)
    return found


def _validate(config: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    out = envoyconf.write(config, tmp_path / "envoy.yaml")
    return subprocess.run([harness.ENVOY, "--mode", "validate", "-c", str(out),
                           "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60, check=False)


def test_charge_tokens_on_adds_a_check_and_a_stream_done_charge(tmp_path: Path) -> None:
    config = _rendered()
    before = _route(config, "upstream")["route"]["rate_limits"]
    envoyconf.charge_tokens_on(config, ["upstream"])
    route = _route(config, "upstream")
    assert route["route"]["rate_limits"] == before  # ratelimit.yaml's, read at stage 0
    per_route = route["typed_per_filter_config"][envoyconf.RATELIMIT_TOKENS]
    assert per_route["@type"].endswith("ratelimit.v3.RateLimitPerRoute")
    check, charge = per_route["rate_limits"]
    tenant = [{"request_headers": {"header_name": "x-sits-tenant", "descriptor_key": "tenant"}}]
    assert check == {"actions": tenant, "hits_addend": {"number": 0}}
    assert charge == {"apply_on_stream_done": True, "actions": tenant,
                      "hits_addend": {"format": "%DYNAMIC_METADATA(sitsmesh.tokens:n)%"}}
    filters = envoyconf.http_connection_manager(config)["http_filters"]
    names = [f["name"] for f in filters]
    assert names.index(envoyconf.RATELIMIT_TOKENS) > names.index(
        "envoy.filters.http.ext_authz")  # the tenant header is Check's
    stages = {f["name"]: f["typed_config"].get("stage") for f in filters
              if f["typed_config"].get("@type", "").endswith("ratelimit.v3.RateLimit")}
    assert stages == {"envoy.filters.http.ratelimit": 0, envoyconf.RATELIMIT_TOKENS: 1}
    done = _validate(config, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_envoy_validates_the_fields_against_its_own_protos(tmp_path: Path) -> None:
    """`--mode validate` checks field names and proto constraints (not the format's
    substitutions: those are parsed when the route is built): a misspelt option and a
    format that is not one are refused, so the passing validation above means something."""
    for change, error in (
            ({"apply_on_stream_end": True}, "apply_on_stream_end"),
            ({"hits_addend": {"format": "sitsmesh.tokens:n"}},
             'HitsAddendValidationError.Format: value does not have prefix "%"')):
        config = _rendered()
        envoyconf.charge_tokens_on(config, ["upstream"])
        per_route = _route(config, "upstream")["typed_per_filter_config"]
        per_route[envoyconf.RATELIMIT_TOKENS]["rate_limits"][-1].update(change)
        done = _validate(config, tmp_path)
        assert done.returncode != 0 and error in done.stdout + done.stderr, change


def test_charge_tokens_on_names_a_missing_route_and_a_fragment_without_entries(
        tmp_path: Path) -> None:
    config = _rendered()
    with pytest.raises(ConfigError, match="no forwarding route named 'chat' to charge on"):
        envoyconf.charge_tokens_on(config, ["upstream", "chat"])
    empty = tmp_path / "empty.yaml"
    empty.write_text("http_filter: {name: x}\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml: no route_rate_limits"):
        envoyconf.charge_tokens_on(config, ["upstream"], empty)
