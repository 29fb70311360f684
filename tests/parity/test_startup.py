"""Serving without a loadable config, as envoyproxy/ratelimit does (spec §3, §4): by
default serve starts and every call fails with "no rate limit configuration loaded"
until a reload succeeds; a failed reload keeps the last good config; an empty config
directory is a good config with no domains; health may wait for a domain."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from sitsmesh.dev import harness
from sitsmesh.transport.ratelimit import SERVICE_NAME
from tests.parity.rls import BAD, GOOD, OK, ask, desc, fresh, limit_of

pytestmark = pytest.mark.integration

Launch = Callable[..., harness.Sitsmesh]
NO_CONFIG = "no rate limit configuration loaded"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    """Start serve on a config and wait until ShouldRateLimit answers, whatever it
    answers (health is not waited for: it is under test here)."""
    tmp = tmp_path_factory.mktemp("startup")
    started: list[harness.Sitsmesh] = []

    def start(config: Path, *flags: str) -> harness.Sitsmesh:
        node = harness.start_sitsmesh(tmp, "--ratelimit-config", str(config),
                                      "--reload-interval-seconds", "0.2", *flags,
                                      wait=False, name=f"start{len(started)}")
        started.append(node)

        def answers() -> bool:
            if node.proc.poll() is not None:
                raise RuntimeError(f"serve exited {node.proc.returncode}:\n{node.output()}")
            try:
                ask(node, "probe", desc(("k", "v")))
            except grpc.RpcError as exc:
                return bool(exc.code() != grpc.StatusCode.UNAVAILABLE)
            return True

        harness.wait_until(answers, 30, "ShouldRateLimit to answer")
        return node

    yield start
    for node in started:
        node.kill()


def _config_dir(tmp: Path, *files: tuple[str, str]) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    for name, text in files:
        (tmp / name).write_text(text)
    return tmp


@pytest.fixture(scope="module")
def unloaded(launch: Launch, tmp_path_factory: pytest.TempPathFactory) -> harness.Sitsmesh:
    bad = (BAD / "11_bad_unit.yaml").read_text()
    return launch(_config_dir(tmp_path_factory.mktemp("unloaded"), ("limits.yaml", bad)))


def test_without_a_loaded_config_every_call_is_an_error(unloaded: harness.Sitsmesh) -> None:
    for domain in ("broken", "catalog", "anything"):
        with pytest.raises(grpc.RpcError) as err:
            ask(unloaded, domain, desc(("tier", "x")))
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNKNOWN, NO_CONFIG)


def test_without_a_loaded_config_request_errors_come_first(unloaded: harness.Sitsmesh) -> None:
    with pytest.raises(grpc.RpcError) as err:
        ask(unloaded, "", desc(("tier", "x")))
    assert err.value.details() == "rate limit domain must not be empty"


def test_without_a_loaded_config_health_is_serving(unloaded: harness.Sitsmesh) -> None:
    assert harness.health_status(unloaded.data_addr) == SERVING
    assert harness.health_status(unloaded.data_addr, SERVICE_NAME) == SERVING


def test_fixing_the_file_serves_at_the_next_reload(
        launch: Launch, tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = _config_dir(tmp_path_factory.mktemp("fixed"),
                         ("limits.yaml", (BAD / "11_bad_unit.yaml").read_text()))
    node = launch(folder)
    with pytest.raises(grpc.RpcError):
        ask(node, "meter", desc(("basic", "x")))
    (folder / "limits.yaml").write_text((GOOD / "meter.yaml").read_text())

    def serving() -> bool:
        try:
            return limit_of(ask(node, "meter", desc(("basic", fresh())))) == 5
        except grpc.RpcError:
            return False

    harness.wait_until(serving, 10, "the fixed config to load")


def test_a_failed_reload_keeps_the_last_good_config(
        launch: Launch, tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = _config_dir(tmp_path_factory.mktemp("kept"),
                         ("limits.yaml", (GOOD / "meter.yaml").read_text()))
    node = launch(folder)
    assert limit_of(ask(node, "meter", desc(("basic", fresh())))) == 5
    metric = "sitsmesh_ratelimit_config_load_errors_total"
    before = harness.metric_value(node.metrics(), metric)
    (folder / "limits.yaml").write_text((BAD / "11_bad_unit.yaml").read_text())
    harness.wait_until(lambda: harness.metric_value(node.metrics(), metric) > before, 10,
                       "the bad reload to be rejected")
    reply = ask(node, "meter", desc(("basic", fresh())))
    assert (reply.overall_code, limit_of(reply)) == (OK, 5)


def test_an_empty_config_directory_loads_with_every_domain_unknown(
        launch: Launch, tmp_path_factory: pytest.TempPathFactory) -> None:
    node = launch(_config_dir(tmp_path_factory.mktemp("empty")),
                  "--ratelimit-require-config", "true")
    reply = ask(node, "catalog", desc(("region", "us")))
    assert (reply.overall_code, limit_of(reply)) == (OK, None)


def test_health_can_wait_for_a_config_with_a_domain(
        launch: Launch, tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = _config_dir(tmp_path_factory.mktemp("health"))
    node = launch(folder, "--ratelimit-healthy-requires-config", "true")
    # The reference marks its one health service; sitsmesh may mark the whole server or
    # the RateLimitService: either tells Envoy's health check.
    statuses = {harness.health_status(node.data_addr),
                harness.health_status(node.data_addr, SERVICE_NAME)}
    assert NOT_SERVING in statuses
    (folder / "limits.yaml").write_text((GOOD / "meter.yaml").read_text())
    harness.wait_until(lambda: {harness.health_status(node.data_addr),
                                harness.health_status(node.data_addr, SERVICE_NAME)}
                       == {SERVING}, 10, "health SERVING once a domain is loaded")
