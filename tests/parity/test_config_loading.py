"""Config loading as envoyproxy/ratelimit does it (spec §3): every bad-config kind is
refused with the reference's message after the file name, by `sitsmesh ratelimit check`
and by `serve --ratelimit-require-config true`; several files of one domain merge only
when asked; every good fixture loads."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from sitsmesh.dev import harness
from tests.parity.rls import BAD, GOOD, MERGE, OK, Fleet, ask, desc, limit_of

pytestmark = pytest.mark.integration

# file -> the reference's message, as it follows "<name>: ". For the two kinds whose
# detail comes from a library (Go's YAML parser, Go's structpb) only the reference's own
# words are required.
BAD_KINDS = {
    "01_unparsable.yaml": "error loading config file: ",
    "01_rpu_text.yaml": "error loading config file: ",
    "02_numeric_key.yaml": "config error, key is not of type string: 7",
    "03_unknown_key.yaml": "config error, unknown key 'rate-limit'",
    "03_unknown_nested_key.yaml": "config error, unknown key 'request_per_unit'",
    "04_scalar_in_list.yaml": "config error, yaml file contains list of type other than map: tier",
    "05_float_leaf.yaml": "error checking config",
    "06_no_domain.yaml": "config file cannot have empty domain",
    "08_keyless.yaml": "descriptor has empty key",
    "09_twin_siblings.yaml": "duplicate descriptor composite key 'broken.region_eu.zone_a'",
    "10_unlimited_with_unit.yaml": "should not specify rate limit unit when unlimited",
    "11_bad_unit.yaml": "invalid rate limit unit 'fortnight'",
    "12_replaces_blank.yaml": "should not have an empty replaces entry",
    "13_replaces_itself.yaml": "replaces should not contain name of same descriptor",
    "14_share_without_wildcard.yaml": "share_threshold can only be used with wildcard values "
                                      "(containing '*'), but found key 'path_/static'",
    "15_binary_metadata.yaml": "error parsing metadata: ",
}
DUP_DOMAIN = "duplicate domain 'shop' in config file"
DUP_KEY = "duplicate descriptor composite key 'shop.sku_basic'"


def test_every_bad_kind_has_a_fixture() -> None:
    assert sorted(p.name for p in BAD.glob("*.yaml")) == sorted(BAD_KINDS)


@dataclass
class Outcome:
    returncode: int | None  # None: it started serving
    output: str


def _check(*args: str) -> Outcome:
    result = harness.run_cli("ratelimit", "check", *args)
    return Outcome(result.returncode, result.stdout + result.stderr)


def _serve(tmp: Path, name: str, *args: str) -> Outcome:
    """`serve --ratelimit-require-config true` on a config: its exit, or None once it
    serves (then it is killed)."""
    data = f"127.0.0.1:{harness.free_port()}"
    log = tmp / f"{name}.log"
    proc = harness.spawn(
        [harness.SITSMESH, "serve", "--data-addr", data,
         "--admin-addr", f"127.0.0.1:{harness.free_port()}",
         "--metrics-addr", f"127.0.0.1:{harness.free_port()}",
         "--state-dir", str(tmp / f"{name}-state"), "--drain-seconds", "0",
         "--ratelimit-require-config", "true", *args], log)
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            code = proc.proc.poll()
            if code is not None:
                return Outcome(code, proc.output())
            if harness.health_status(data, timeout=0.2) == health_pb2.HealthCheckResponse.SERVING:
                return Outcome(None, proc.output())
            time.sleep(0.1)
        return Outcome(None, proc.output())
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def checked() -> dict[str, Outcome]:
    """`sitsmesh ratelimit check` on each bad file alone, run side by side."""
    with ThreadPoolExecutor(4) as pool:
        return dict(zip(BAD_KINDS, pool.map(lambda n: _check(str(BAD / n)), BAD_KINDS),
                        strict=True))


SERVE_CASES = {
    **{name: ("--ratelimit-config", str(BAD / name)) for name in BAD_KINDS},
    "dup-domain": ("--ratelimit-config", str(MERGE / "part_one.yaml"),
                   "--ratelimit-config", str(MERGE / "part_two.yaml")),
    "dup-key-merged": ("--ratelimit-config", str(MERGE / "part_one.yaml"),
                       "--ratelimit-config", str(MERGE / "part_clash.yaml"),
                       "--ratelimit-merge-domain-config", "true"),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """`serve --ratelimit-require-config true` on each bad config, side by side."""
    tmp = tmp_path_factory.mktemp("refused")
    with ThreadPoolExecutor(6) as pool:
        outcomes = pool.map(lambda item: _serve(tmp, f"s{item[0]}", *item[1]),
                            enumerate(SERVE_CASES.values()))
        return dict(zip(SERVE_CASES, outcomes, strict=True))


@pytest.mark.parametrize("name", BAD_KINDS)
def test_check_refuses_a_bad_file_with_the_reference_message(
        checked: dict[str, Outcome], name: str) -> None:
    outcome = checked[name]
    assert outcome.returncode == 1, outcome.output
    assert f"{BAD / name}: {BAD_KINDS[name]}" in outcome.output


@pytest.mark.parametrize("name", BAD_KINDS)
def test_serve_requiring_config_refuses_to_start_on_a_bad_file(
        served: dict[str, Outcome], name: str) -> None:
    outcome = served[name]
    assert outcome.returncode not in (None, 0), f"serve started:\n{outcome.output}"
    assert f"{BAD / name}: {BAD_KINDS[name]}" in outcome.output


def test_two_files_of_one_domain_are_refused_without_merge(
        served: dict[str, Outcome]) -> None:
    checked = _check(str(MERGE / "part_one.yaml"), str(MERGE / "part_two.yaml"))
    assert checked.returncode == 1
    assert f"{MERGE / 'part_two.yaml'}: {DUP_DOMAIN}" in checked.output
    outcome = served["dup-domain"]
    assert outcome.returncode not in (None, 0), f"serve started:\n{outcome.output}"
    assert f"{MERGE / 'part_two.yaml'}: {DUP_DOMAIN}" in outcome.output


def test_two_files_of_one_domain_load_with_merge() -> None:
    checked = _check("--merge-domain-config", str(MERGE / "part_one.yaml"),
                     str(MERGE / "part_two.yaml"))
    assert checked.returncode == 0, checked.output


def test_a_descriptor_both_merged_files_define_is_refused(
        served: dict[str, Outcome]) -> None:
    checked = _check("--merge-domain-config", str(MERGE / "part_one.yaml"),
                     str(MERGE / "part_clash.yaml"))
    assert checked.returncode == 1
    assert f"{MERGE / 'part_clash.yaml'}: {DUP_KEY}" in checked.output
    outcome = served["dup-key-merged"]
    assert outcome.returncode not in (None, 0), f"serve started:\n{outcome.output}"
    assert f"{MERGE / 'part_clash.yaml'}: {DUP_KEY}" in outcome.output


@pytest.mark.parametrize("name", sorted(p.name for p in GOOD.glob("*.yaml")))
def test_each_good_fixture_loads_alone(name: str) -> None:
    checked = _check(str(GOOD / name))
    assert checked.returncode == 0, checked.output


@pytest.fixture(scope="module")
def merged(fleet: Fleet) -> harness.Sitsmesh:
    return fleet.get("memory", "--ratelimit-config", str(MERGE / "part_two.yaml"),
                     "--ratelimit-merge-domain-config", "true",
                     config=MERGE / "part_one.yaml")


def test_merged_files_each_contribute_their_rules(merged: harness.Sitsmesh) -> None:
    reply = ask(merged, "shop", desc(("sku", "basic")), desc(("cart", "c1")))
    assert reply.overall_code == OK
    assert [limit_of(reply, 0), limit_of(reply, 1)] == [2, 4]


def test_an_earlier_files_wildcard_wins_over_a_later_files(merged: harness.Sitsmesh) -> None:
    # Both bulk* (part_one) and bul* (part_two) match; the one loaded first decides.
    assert limit_of(ask(merged, "shop", desc(("sku", "bulk-pack")))) == 3
    assert limit_of(ask(merged, "shop", desc(("sku", "bully")))) == 5
