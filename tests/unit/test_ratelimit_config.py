"""Every config error has its own fixture and exact message, starting with the file name."""

from __future__ import annotations

from pathlib import Path

import pytest

from sitsmesh.errors import ConfigError
from sitsmesh.ratelimit import config as rlconfig
from sitsmesh.ratelimit.config import Algorithm, Unit

ERRORS = [
    ("malformed yaml", "domain: [x\n", "f.yaml: error loading config file: "),
    ("unknown key typo", """
domain: d
descriptors:
  - key: k
    rate_limit: {unlimied: true}
""", "f.yaml: config error, unknown key 'unlimied' (at descriptors[0].rate_limit)"),
    ("unknown top key", "domain: d\ndescriptor: []\n",
     "f.yaml: config error, unknown key 'descriptor' (at top level)"),
    ("empty domain", "domain: ''\ndescriptors: []\n",
     "f.yaml: config file cannot have empty domain"),
    ("missing domain", "descriptors: []\n", "f.yaml: config file cannot have empty domain"),
    ("empty key", "domain: d\ndescriptors:\n  - value: v\n",
     "f.yaml: descriptor has empty key (at descriptors[0])"),
    ("duplicate key/value", """
domain: d
descriptors:
  - {key: k, value: v}
  - {key: k, value: v}
""", "f.yaml: duplicate descriptor composite key 'd.k_v'"),
    ("duplicate nested", """
domain: d
descriptors:
  - key: a
    descriptors:
      - {key: k}
      - {key: k}
""", "f.yaml: duplicate descriptor composite key 'd.a.k'"),
    ("invalid unit", """
domain: d
descriptors:
  - key: k
    rate_limit: {unit: fortnight, requests_per_unit: 1}
""", "f.yaml: invalid rate limit unit 'fortnight' (at descriptors[0].rate_limit)"),
    ("unlimited with unit", """
domain: d
descriptors:
  - key: k
    rate_limit: {unlimited: true, unit: second}
""", "f.yaml: should not specify rate limit unit when unlimited (at descriptors[0].rate_limit)"),
    ("empty replaces", """
domain: d
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: ''}]}
""", "f.yaml: should not have an empty replaces entry (at descriptors[0].rate_limit)"),
    ("replaces itself", """
domain: d
descriptors:
  - key: k
    rate_limit: {name: a, unit: second, requests_per_unit: 1, replaces: [{name: a}]}
""", "f.yaml: replaces should not contain name of same descriptor (at descriptors[0].rate_limit)"),
    ("share_threshold without wildcard", """
domain: d
descriptors:
  - key: k
    value: v
    share_threshold: true
    rate_limit: {unit: second, requests_per_unit: 1}
""", "f.yaml: share_threshold can only be used with wildcard values (containing '*'), "
     "but found key 'k_v' (at descriptors[0])"),
    ("missing requests_per_unit", """
domain: d
descriptors:
  - key: k
    rate_limit: {unit: second}
""", "f.yaml: rate limit has no requests_per_unit (at descriptors[0].rate_limit)"),
    ("replaces names no rule", """
domain: d
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: ghost}]}
""", "f.yaml: replaces names no rule: 'ghost' (in d.k)"),
    ("negative requests", """
domain: d
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: -1}
""", "f.yaml: error loading config file: requests_per_unit must be an integer from 0 to "
     "4294967295, got -1 (at descriptors[0].rate_limit)"),
    ("bad algorithm", """
domain: d
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky}
""", "f.yaml: invalid algorithm 'leaky'; use fixed_window, sliding_window or gcra "
     "(at descriptors[0].rate_limit)"),
    ("list of scalars", "domain: d\ndescriptors: [1]\n",
     "f.yaml: config error, yaml file contains list of type other than map: 1 (at descriptors[0])"),
]


@pytest.mark.parametrize(("text", "message"), [(t, m) for _, t, m in ERRORS],
                         ids=[name for name, _, _ in ERRORS])
def test_each_config_error_has_an_exact_message(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        rlconfig.build([("f.yaml", text)])
    if message.endswith(": "):
        assert err.value.message.startswith(message)
    else:
        assert err.value.message == message


def test_duplicate_domain_across_files() -> None:
    with pytest.raises(ConfigError) as err:
        rlconfig.build([("a.yaml", "domain: d\n"), ("b.yaml", "domain: d\n")])
    assert err.value.message == "b.yaml: duplicate domain 'd' in config file (also in a.yaml)"


def test_reference_format_loads_with_every_feature() -> None:
    cfg = rlconfig.build([("f.yaml", """
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: Second, requests_per_unit: 10}
  - key: path
    value: /api/*
    share_threshold: true
    shadow_mode: true
    detailed_metric: true
    quota_mode: true
    metadata: {team: a}
    rate_limit: {unit: MINUTE, requests_per_unit: 20, name: api}
  - key: tenant
    rate_limits:
      - {unit: second, requests_per_unit: 5, algorithm: gcra}
      - {unit: second, unit_multiplier: 30, requests_per_unit: 100, algorithm: sliding_window}
  - key: ldap
    rate_limit: {unlimited: true}
""")])
    root = cfg.domains["edge"]
    api = root.children["path_/api/*"]
    assert api.share_threshold and api.metadata == {"team": "a"}
    rule = api.rules[0]
    assert (rule.unit, rule.window_s, rule.shadow_mode, rule.quota_mode, rule.name) == (
        Unit.MINUTE, 60, True, True, "api")
    assert root.wildcards[0][0].parts == ("path_/api/", "")
    burst, sustained = root.children["tenant"].rules
    assert burst.algorithm is Algorithm.GCRA and burst.window_s == 1
    assert sustained.window_s == 30 and sustained.index == 1
    assert root.children["ldap"].rules[0].unlimited
    assert {u.name for u in Unit} == {"SECOND", "MINUTE", "HOUR", "DAY", "WEEK", "MONTH", "YEAR"}


def test_directory_loading_reads_yaml_files_only(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("domain: a\n")
    (tmp_path / "b.yml").write_text("domain: b\n")
    (tmp_path / "notes.txt").write_text("not config")
    (tmp_path / ".hidden.yaml").write_text("domain: [")
    cfg = rlconfig.load([tmp_path])
    assert sorted(cfg.domains) == ["a", "b"]


def test_merge_domain_config_adds_top_level_descriptors_like_the_reference() -> None:
    first = "domain: d\ndescriptors:\n  - {key: a, rate_limit: {unit: second, " \
            "requests_per_unit: 1}}\n  - {key: w, value: 'x*', rate_limit: {unit: second, " \
            "requests_per_unit: 1}}\n"
    second = "domain: d\ndescriptors:\n  - {key: b, rate_limit: {unit: second, " \
             "requests_per_unit: 2}}\n  - {key: w, value: '*', rate_limit: {unit: second, " \
             "requests_per_unit: 2}}\n"
    with pytest.raises(ConfigError, match=r"two\.yaml: duplicate domain 'd' in config file"):
        rlconfig.build([("one.yaml", first), ("two.yaml", second)])
    merged = rlconfig.build([("one.yaml", first), ("two.yaml", second)], merge=True)
    root = merged.domains["d"]
    assert set(root.children) >= {"a", "b", "w_x*", "w_*"}
    # The earlier file's wildcards come first.
    assert [node.pattern for _, node in root.wildcards] == ["w_x*", "w_*"]
    assert merged.sources["d"] == "one.yaml + two.yaml"
    clash = "domain: d\ndescriptors:\n  - {key: a, rate_limit: {unit: second, " \
            "requests_per_unit: 1}}\n"
    with pytest.raises(ConfigError,
                       match=r"three\.yaml: duplicate descriptor composite key 'd\.a'$"):
        rlconfig.build([("one.yaml", first), ("three.yaml", clash)], merge=True)
