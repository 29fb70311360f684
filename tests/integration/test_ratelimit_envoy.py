"""Real Envoy with envoy.filters.http.ratelimit in front, sitsmesh answering ShouldRateLimit."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from sitsmesh.dev import harness

CONFIG = harness.REPO / "filters" / "local" / "ratelimit"


def _get(envoy: harness.Envoy, user: str) -> tuple[int, dict[str, str]]:
    req = urllib.request.Request(envoy.url("/v2/models/demo/infer"), headers={"x-user": user})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}


def test_request_over_the_limit_gets_429_with_headers_and_envoy_fails_open(
    tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh], upstream: int
) -> None:
    node = start_sitsmesh("--ratelimit-config", str(CONFIG))
    envoy = harness.start_envoy(tmp_path, node.data_addr, upstream, fragments=["ratelimit"])
    try:
        # The limit is per minute window: start well inside one, so the six requests
        # share it and the reset header is predictable.
        if time.time() % 60 > 55:
            time.sleep(61 - time.time() % 60)
        results = [_get(envoy, "alice") for _ in range(6)]
        until_reset = 60 - time.time() % 60
        codes = [code for code, _ in results]
        assert codes == [200, 200, 200, 200, 200, 429], codes
        _, headers = results[-1]
        assert headers["x-ratelimit-limit"].startswith("5, 5;w=60")
        assert headers["x-ratelimit-remaining"] == "0"
        # Envoy rounds duration_until_reset down to whole seconds.
        assert abs(int(headers["x-ratelimit-reset"]) - until_reset) <= 1.5
        first_headers = results[0][1]
        assert first_headers["x-ratelimit-remaining"] == "4"
        # Another user has a budget of its own.
        assert _get(envoy, "bob")[0] == 200

        # sitsmesh down: the filter is configured to fail open.
        assert node.stop(signal.SIGKILL) != 0
        assert [_get(envoy, "alice")[0] for _ in range(3)] == [200, 200, 200]
        stats = envoy.admin_get("/stats?filter=ratelimit")
        assert "ratelimit.error: " in stats or "ratelimit.failure_mode_allowed" in stats
    finally:
        envoy.kill()
        node.kill()


def test_no_config_yet_fails_open_through_envoy_then_limits_once_it_loads(
    tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh], upstream: int
) -> None:
    """As envoyproxy/ratelimit: sitsmesh serves without a loadable config and answers
    each call with an error, which the fragment's filter turns into a pass (fail open)."""
    config = tmp_path / "rl"
    config.mkdir()
    (config / "broken.yaml").write_text("domain: sitsmesh\ndescriptors: [{key: user, "
                                        "rate_limit: {unit: hour}}]\n")
    node = start_sitsmesh("--ratelimit-config", str(config), "--reload-interval-seconds", "0.2")
    envoy = harness.start_envoy(tmp_path, node.data_addr, upstream, fragments=["ratelimit"])
    try:
        assert [_get(envoy, "carol")[0] for _ in range(7)] == [200] * 7
        assert "ratelimit.error: 7" in envoy.admin_get("/stats?filter=ratelimit.error")
        (config / "broken.yaml").unlink()
        for source in CONFIG.glob("*.yaml"):
            (config / source.name).write_text(source.read_text())
        harness.wait_until(lambda: _get(envoy, "dave")[1].get("x-ratelimit-limit"), 10,
                           "the config loads")
        if time.time() % 60 > 55:  # six requests in one minute window
            time.sleep(61 - time.time() % 60)
        codes = [_get(envoy, "erin")[0] for _ in range(6)]
        assert codes.count(429) >= 1 and codes[0] == 200, codes
    finally:
        envoy.kill()
        node.kill()
