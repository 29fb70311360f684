"""RateLimitService and the rate-limit admin API on a real `sitsmesh serve`."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from grpc_health.v1 import health_pb2

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness

Start = Callable[..., harness.Sitsmesh]
OK, OVER = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT

FILE_CONFIG = """
domain: files
descriptors:
  - key: user
    # Hour windows: a window rolling over mid-test (a minute boundary) would reset counts.
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: plan
    quota_mode: true
    metadata: {tier: gold}
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: route
    value: /api*v1
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 2}
"""
API_CONFIG = """
domain: api
descriptors:
  - key: team
    rate_limit: {unit: hour, requests_per_unit: 1, name: team}
"""


def _desc(key: str, value: str, addend: int | None = None) -> ratelimit_pb2.RateLimitDescriptor:
    d = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=key, value=value)])
    if addend is not None:
        d.hits_addend.value = addend
    return d


def _ask(node: harness.Sitsmesh, domain: str, *descs: ratelimit_pb2.RateLimitDescriptor,
         hits_addend: int = 0) -> rls_pb2.RateLimitResponse:
    with grpc.insecure_channel(node.data_addr) as channel:
        reply: rls_pb2.RateLimitResponse = rls_pb2_grpc.RateLimitServiceStub(
            channel).ShouldRateLimit(rls_pb2.RateLimitRequest(
                domain=domain, descriptors=list(descs), hits_addend=hits_addend), timeout=5)
        return reply


def _admin(node: harness.Sitsmesh) -> tuple[grpc.Channel, admin_pb2_grpc.AdminServiceStub]:
    channel = grpc.insecure_channel(node.admin_addr)
    return channel, admin_pb2_grpc.AdminServiceStub(channel)


@pytest.fixture
def node(start_sitsmesh: Start, tmp_path: Path) -> harness.Sitsmesh:
    config_dir = tmp_path / "rl"
    config_dir.mkdir()
    (config_dir / "files.yaml").write_text(FILE_CONFIG)
    return start_sitsmesh("--ratelimit-config", str(config_dir),
                          "--reload-interval-seconds", "0.2")


def test_response_fields_for_envoy_headers(node: harness.Sitsmesh) -> None:
    first = _ask(node, "files", _desc("user", "a"))
    assert first.overall_code == OK
    (status,) = first.statuses
    assert (status.code, status.limit_remaining) == (OK, 1)
    assert status.current_limit.requests_per_unit == 2
    assert status.current_limit.unit == rls_pb2.RateLimitResponse.RateLimit.HOUR
    until_reset = 3600 - time.time() % 3600
    reset = status.duration_until_reset.seconds + status.duration_until_reset.nanos / 1e9
    assert abs(reset - until_reset) < 2
    _ask(node, "files", _desc("user", "a"))
    third = _ask(node, "files", _desc("user", "a"), _desc("nomatch", "x"))
    assert third.overall_code == OVER
    assert [s.code for s in third.statuses] == [OVER, OK]
    assert not third.statuses[1].HasField("current_limit")


@pytest.mark.parametrize(("domain", "count", "message"), [
    ("", 1, "rate limit domain must not be empty"),
    ("files", 0, "rate limit descriptor list must not be empty"),
    ("files", 10_000, "too many descriptors: 10000 > 64"),
])
def test_bad_requests_get_invalid_argument(node: harness.Sitsmesh, domain: str, count: int,
                                           message: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _ask(node, domain, *[_desc("user", "z")] * count)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == message
    # Nothing was counted for "z" by the rejected calls.
    assert _ask(node, "files", _desc("user", "z")).statuses[0].limit_remaining == 1


def test_unknown_domain_is_ok_like_the_reference(node: harness.Sitsmesh) -> None:
    reply = _ask(node, "nobody", _desc("user", "a"))
    assert reply.overall_code == OK and reply.statuses[0].code == OK
    # A request-level limit override on a domain with no config limits nothing either.
    capped = _desc("user", "a")
    capped.limit.requests_per_unit = 1
    capped.limit.unit = rls_pb2.RateLimitResponse.RateLimit.SECOND
    for _ in range(3):
        reply = _ask(node, "nobody", capped)
        assert reply.overall_code == OK and not reply.statuses[0].HasField("current_limit")


def test_quota_mode_answers_like_the_reference(node: harness.Sitsmesh) -> None:
    """An over quota-mode descriptor says OVER_LIMIT in its status; the answer is
    OVER_LIMIT only when every quota-mode descriptor is over."""
    assert _ask(node, "files", _desc("plan", "a")).overall_code == OK
    mixed = _ask(node, "files", _desc("plan", "a"), _desc("plan", "b"))
    assert mixed.overall_code == OK
    assert [s.code for s in mixed.statuses] == [OVER, OK]
    both = _ask(node, "files", _desc("plan", "a"), _desc("plan", "b"))
    assert both.overall_code == OVER and [s.code for s in both.statuses] == [OVER, OVER]


def test_a_middle_wildcard_with_a_shared_threshold_like_the_reference(
        node: harness.Sitsmesh) -> None:
    codes = [_ask(node, "files", _desc("route", path)).overall_code
             for path in ("/api/users/v1", "/api/teams/v1", "/api/x/v1")]
    assert codes == [OK, OK, OVER]  # one counter for every path the pattern matches
    other = _ask(node, "files", _desc("route", "/api/x/v2"))
    assert other.overall_code == OK and not other.statuses[0].HasField("current_limit")


def test_two_files_of_one_domain_merge_when_asked_like_the_reference(
        start_sitsmesh: Start, tmp_path: Path) -> None:
    config_dir = tmp_path / "merged"
    config_dir.mkdir()
    (config_dir / "a.yaml").write_text(FILE_CONFIG)
    (config_dir / "b.yaml").write_text(
        "domain: files\ndescriptors:\n  - key: team\n"
        "    rate_limit: {unit: hour, requests_per_unit: 1}\n")
    node = start_sitsmesh("--ratelimit-config", str(config_dir),
                          "--ratelimit-merge-domain-config", "true")
    assert _ask(node, "files", _desc("user", "m")).statuses[0].current_limit.requests_per_unit == 2
    codes = [_ask(node, "files", _desc("team", "t")).overall_code for _ in range(2)]
    assert codes == [OK, OVER]  # the second file's rule is live beside the first's


def test_ratelimit_headers_when_enabled_like_the_reference(
        start_sitsmesh: Start, tmp_path: Path, node: harness.Sitsmesh) -> None:
    assert not _ask(node, "files", _desc("user", "quiet")).response_headers_to_add  # off
    config_dir = tmp_path / "headers"
    config_dir.mkdir()
    (config_dir / "files.yaml").write_text(FILE_CONFIG)
    loud = start_sitsmesh("--ratelimit-config", str(config_dir),
                          "--ratelimit-response-headers", "true", name="loud")

    def headers(reply: rls_pb2.RateLimitResponse) -> dict[str, str]:
        return {h.key: h.value for h in reply.response_headers_to_add}

    first = headers(_ask(loud, "files", _desc("user", "h"), _desc("team", "none")))
    assert first["RateLimit-Limit"] == "2" and first["RateLimit-Remaining"] == "1"
    assert 0 <= int(first["RateLimit-Reset"]) <= 3600
    _ask(loud, "files", _desc("user", "h"))
    over = _ask(loud, "files", _desc("user", "h"))
    assert over.overall_code == OVER and headers(over)["RateLimit-Remaining"] == "0"
    assert not _ask(loud, "files", _desc("team", "none")).response_headers_to_add  # no limit


def test_dynamic_metadata_only_when_enabled_like_the_reference(
        start_sitsmesh: Start, tmp_path: Path, node: harness.Sitsmesh) -> None:
    assert not _ask(node, "files", _desc("plan", "quiet")).HasField("dynamic_metadata")
    config_dir = tmp_path / "meta"
    config_dir.mkdir()
    (config_dir / "files.yaml").write_text(FILE_CONFIG)
    told = start_sitsmesh("--ratelimit-config", str(config_dir),
                          "--ratelimit-response-dynamic-metadata", "true", name="told")
    fields = _ask(told, "files", _desc("plan", "p")).dynamic_metadata.fields
    assert fields["domain"].string_value == "files"
    assert [v.string_value for v in
            fields["descriptors"].list_value.values[0].struct_value.fields["entries"]
            .list_value.values] == ["plan=p"]
    assert fields["metadata"].struct_value.fields["tier"].string_value == "gold"
    over = _ask(told, "files", _desc("plan", "p")).dynamic_metadata.fields
    assert "metadata" not in over  # an over quota descriptor did not pass


def test_a_descriptor_with_no_entries_is_ok_with_no_limit_like_the_reference(
        node: harness.Sitsmesh) -> None:
    reply = _ask(node, "files", ratelimit_pb2.RateLimitDescriptor(), _desc("user", "e"))
    assert reply.overall_code == OK and len(reply.statuses) == 2
    assert reply.statuses[0].code == OK and not reply.statuses[0].HasField("current_limit")
    assert reply.statuses[1].current_limit.requests_per_unit > 0


def test_a_huge_hits_addend_is_counted_like_the_reference(node: harness.Sitsmesh) -> None:
    assert _ask(node, "files", _desc("user", "h"), hits_addend=1_000_000).overall_code == OVER
    after = _ask(node, "files", _desc("user", "h")).statuses[0]
    assert (after.code, after.limit_remaining) == (OVER, 0)
    for request_addend, descriptor_addend in ((2**32 - 1, None), (0, 2**40)):
        with pytest.raises(grpc.RpcError) as err:
            _ask(node, "files", _desc("user", "h", addend=descriptor_addend),
                 hits_addend=request_addend)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_non_utf8_values_get_invalid_argument(node: harness.Sitsmesh) -> None:
    with grpc.insecure_channel(node.data_addr) as channel:
        raw: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
        # domain "files", one descriptor whose entry value is the single byte 0xff.
        body = b"\x0a\x05files" + b"\x12\x0b\x0a\x09\x0a\x04user\x12\x01\xff"
        with pytest.raises(grpc.RpcError) as err:
            raw(body, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in (err.value.details() or "")
    assert _ask(node, "files", _desc("user", "after")).overall_code == OK


def test_admin_apply_dry_run_get_delete(node: harness.Sitsmesh) -> None:
    channel, admin = _admin(node)
    meta = node.admin_metadata()
    with channel:
        dry = admin.ApplyRateLimitConfig(admin_pb2.ApplyRateLimitConfigRequest(
            files=[admin_pb2.RateLimitConfigFile(name="api.yaml", yaml=API_CONFIG)],
            dry_run=True), metadata=meta, timeout=5)
        assert (list(dry.domains), dry.applied) == (["api"], False)
        assert _ask(node, "api", _desc("team", "t")).statuses[0].HasField("current_limit") is False

        with pytest.raises(grpc.RpcError) as err:
            admin.ApplyRateLimitConfig(admin_pb2.ApplyRateLimitConfigRequest(
                files=[admin_pb2.RateLimitConfigFile(name="bad.yaml", yaml="domain: api\n"
                                                     "descriptors: [{key: k, rate_limit: "
                                                     "{unit: second}}]\n")]),
                metadata=meta, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("api:bad.yaml: rate limit has no")

        with pytest.raises(grpc.RpcError) as err:
            admin.ApplyRateLimitConfig(admin_pb2.ApplyRateLimitConfigRequest(
                files=[admin_pb2.RateLimitConfigFile(name="x.yaml", yaml=FILE_CONFIG)]),
                metadata=meta, timeout=5)
        assert "is defined in file" in (err.value.details() or "")

        applied = admin.ApplyRateLimitConfig(admin_pb2.ApplyRateLimitConfigRequest(
            files=[admin_pb2.RateLimitConfigFile(name="api.yaml", yaml=API_CONFIG)]),
            metadata=meta, timeout=5)
        assert applied.applied
        assert _ask(node, "api", _desc("team", "t")).overall_code == OK
        assert _ask(node, "api", _desc("team", "t")).overall_code == OVER

        live = admin.GetRateLimitConfig(admin_pb2.GetRateLimitConfigRequest(),
                                        metadata=meta, timeout=5)
        assert {(d.domain, d.source) for d in live.domains} == {
            ("api", "api:api.yaml"), ("files", str(node.state_dir.parent / "rl" / "files.yaml"))}
        assert live.config_version == applied.config_version

        admin.DeleteRateLimitConfig(admin_pb2.DeleteRateLimitConfigRequest(domain="api"),
                                    metadata=meta, timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            admin.DeleteRateLimitConfig(admin_pb2.DeleteRateLimitConfigRequest(domain="api"),
                                        metadata=meta, timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert _ask(node, "api", _desc("team", "t")).overall_code == OK


def test_applied_config_survives_restart(start_sitsmesh: Start, tmp_path: Path) -> None:
    node = start_sitsmesh(name="persist")
    channel, admin = _admin(node)
    with channel:
        admin.ApplyRateLimitConfig(admin_pb2.ApplyRateLimitConfigRequest(
            files=[admin_pb2.RateLimitConfigFile(name="api.yaml", yaml=API_CONFIG)]),
            metadata=node.admin_metadata(), timeout=5)
    assert node.stop() == 0
    again = start_sitsmesh(name="persist")
    assert again.state_dir == node.state_dir
    _ask(again, "api", _desc("team", "t"))
    assert _ask(again, "api", _desc("team", "t")).overall_code == OVER


def test_file_change_reloads_and_a_bad_file_keeps_the_old_config(
    node: harness.Sitsmesh, tmp_path: Path
) -> None:
    config = tmp_path / "rl" / "files.yaml"
    config.write_text(FILE_CONFIG.replace("requests_per_unit: 2", "requests_per_unit: 1"))
    harness.wait_until(lambda: _ask(node, "files", _desc("user", "r"), hits_addend=0)
                       .statuses[0].current_limit.requests_per_unit == 1, 10, "reload")
    config.write_text(FILE_CONFIG.replace("rate_limit:", "rate_limitt:"))
    harness.wait_until(lambda: harness.metric_value(
        node.metrics(), "sitsmesh_ratelimit_config_load_errors_total") >= 1, 10, "rejection")
    assert _ask(node, "files", _desc("user", "r2")).statuses[0].current_limit.requests_per_unit == 1
    assert "rate-limit config rejected" in node.output()
    assert "unknown key 'rate_limitt'" in node.output()

    # SIGHUP reloads too (the file is valid again, with a new limit).
    config.write_text(FILE_CONFIG.replace("requests_per_unit: 2", "requests_per_unit: 7"))
    node.proc.send_signal(signal.SIGHUP)
    harness.wait_until(lambda: _ask(node, "files", _desc("user", "r3"))
                       .statuses[0].current_limit.requests_per_unit == 7, 10, "SIGHUP reload")
    time.sleep(0.1)
    assert node.proc.poll() is None


def test_rejected_hits_not_counted_when_asked(start_sitsmesh: Start, tmp_path: Path) -> None:
    config = tmp_path / "files.yaml"
    config.write_text(FILE_CONFIG)
    node = start_sitsmesh("--ratelimit-config", str(config),
                          "--ratelimit-count-rejected-hits", "false")
    assert _ask(node, "files", _desc("user", "h"), hits_addend=1_000_000).overall_code == OVER
    assert _ask(node, "files", _desc("user", "h"), hits_addend=2).overall_code == OK
    assert _ask(node, "files", _desc("user", "h")).overall_code == OVER


BAD_FILE = "domain: d\ndescriptors: [{key: k, rate_limit: {unlimied: true}}]\n"


def test_no_loadable_config_serves_an_error_until_one_loads_like_the_reference(
    start_sitsmesh: Start, tmp_path: Path
) -> None:
    config = tmp_path / "rl" / "files.yaml"
    config.parent.mkdir()
    config.write_text(BAD_FILE)
    node = start_sitsmesh("--ratelimit-config", str(config.parent),
                          "--reload-interval-seconds", "0.2",
                          "--ratelimit-healthy-requires-config", "true", wait=False)
    harness.wait_until(lambda: harness.health_status(node.admin_addr)
                       == health_pb2.HealthCheckResponse.SERVING, 30, "sitsmesh serving")
    with pytest.raises(grpc.RpcError) as err:
        _ask(node, "files", _desc("user", "n"))
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert err.value.details() == "no rate limit configuration loaded"
    harness.wait_until(lambda: harness.health_status(node.data_addr)
                       == health_pb2.HealthCheckResponse.NOT_SERVING, 5, "health waits")
    assert "unknown key 'unlimied'" in node.output()
    config.write_text(FILE_CONFIG)
    harness.wait_until(lambda: harness.health_status(node.data_addr)
                       == health_pb2.HealthCheckResponse.SERVING, 10, "config health")
    assert _ask(node, "files", _desc("user", "n")).statuses[0].limit_remaining == 1
    # No files at all is a load with no domains: every domain is unknown (OK), and
    # health asked for at least one domain.
    config.unlink()
    harness.wait_until(lambda: harness.health_status(node.data_addr)
                       == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "no domains")
    assert _ask(node, "files", _desc("user", "n")).overall_code == OK


def test_bad_file_at_start_exits_2_when_a_config_is_required(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_FILE)
    result = harness.run_cli("serve", "--state-dir", str(tmp_path / "s"),
                             "--data-addr", f"127.0.0.1:{harness.free_port()}",
                             "--admin-addr", f"127.0.0.1:{harness.free_port()}",
                             "--metrics-addr", f"127.0.0.1:{harness.free_port()}",
                             "--ratelimit-config", str(bad), "--ratelimit-require-config", "true")
    assert result.returncode == 2
    assert result.stderr.strip() == (f"sitsmesh: error: {bad}: config error, unknown key "
                                     "'unlimied' (at descriptors[0].rate_limit)")


def test_ratelimit_check_cli(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(FILE_CONFIG)
    bad.write_text("domain: ''\n")
    ok = harness.run_cli("ratelimit", "check", str(good))
    assert ok.returncode == 0 and "ok (domain 'files')" in ok.stdout
    failed = harness.run_cli("ratelimit", "check", str(tmp_path))
    assert failed.returncode == 1
    assert f"{bad}: config file cannot have empty domain" in failed.stdout
