"""Rate-limit config YAML is bounded before it is built (issue 26): a 5 KB file of aliases
expanded to 531 441 descriptors (7-18 s, +270-390 MB); deep nesting overflowed the
composer's recursion; an alias inside its own anchor made a cycle. Ordinary anchors, a
limit block shared by several descriptors, still load as the reference loads them."""

from __future__ import annotations

import time

import pytest

from sitsmesh.errors import ConfigError
from sitsmesh.ratelimit import config, yamlread


def alias_bomb(levels: int = 6, width: int = 9) -> str:
    """`width` descriptors per level, each holding the whole level below through an alias:
    width ** levels descriptors from a few KB."""
    lines = ["domain: bomb", "descriptors:"]
    for level in range(levels):
        lines += [f"  - key: level{level}", f"    descriptors: &l{level}"]
        for v in range(width):
            below = f", descriptors: *l{level - 1}" if level else ""
            lines.append(f"      - {{key: k{level}, value: v{v}, rate_limit: "
                         f"{{unit: second, requests_per_unit: 1}}{below}}}")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_expands() -> None:
    text = alias_bomb()
    assert len(text) < 6000
    started = time.perf_counter()
    with pytest.raises(ConfigError) as refused:
        config.parse_domain("bomb.yaml", text)
    assert time.perf_counter() - started < 1.0  # it took 7.4 s here, 18 s in the issue
    assert refused.value.message == (
        "bomb.yaml: error loading config file: yaml: document contains excessive aliasing: "
        f"aliases expand to more than {yamlread.MAX_ALIAS_NODES} nodes (line 38)")


def test_shared_limit_blocks_still_load_as_if_written_out() -> None:
    shared = ("domain: d\ndescriptors:\n"
              "  - {key: k0, rate_limit: &std {unit: minute, requests_per_unit: 5}}\n"
              + "".join(f"  - {{key: k{i}, rate_limit: *std}}\n" for i in range(1, 500))
              + "  - {key: m, descriptors: &kids [{key: a}, {key: b}]}\n"
              + "  - {key: n, descriptors: *kids}\n"
              + "  - {key: o, rate_limit: {<<: *std, requests_per_unit: 9}}\n")
    written = shared.replace("&std ", "").replace("*std", "{unit: minute, requests_per_unit: 5}")
    written = written.replace("&kids ", "").replace("*kids", "[{key: a}, {key: b}]")
    written = written.replace("{<<: {unit: minute, requests_per_unit: 5}, ", "{unit: minute, ")
    _, root = config.parse_domain("shared.yaml", shared)
    _, expected = config.parse_domain("written.yaml", written)
    assert root == expected
    assert root.children["k499"].rules[0].requests_per_unit == 5
    assert root.children["o"].rules[0].requests_per_unit == 9
    assert set(root.children["n"].children) == {"a", "b"}


def test_an_alias_inside_its_own_anchor_is_refused() -> None:
    text = "domain: d\ndescriptors: &loop\n  - key: k\n    descriptors: *loop\n"
    with pytest.raises(ConfigError) as refused:
        config.parse_domain("loop.yaml", text)
    assert refused.value.message == ("loop.yaml: error loading config file: yaml: alias "
                                     "'*loop' inside its own anchor (line 4)")


@pytest.mark.parametrize("text", [
    "domain: d\ndescriptors: " + "[" * 100_000 + "]" * 100_000 + "\n",
    "domain: d\ndescriptors:\n" + "".join(
        f"{'  ' * (2 * i)}- key: k{i}\n{'  ' * (2 * i + 1)}descriptors:\n" for i in range(40)),
])
def test_nesting_past_the_bound_is_refused_not_a_recursion_error(text: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config.parse_domain("deep.yaml", text)
    # libyaml refuses deep flow collections itself, while it scans (past 1 000 levels).
    assert refused.value.message.startswith((
        f"deep.yaml: error loading config file: yaml: nested deeper than "
        f"{yamlread.MAX_DEPTH} levels (line ",
        "deep.yaml: error loading config file: while increasing flow level exceeded maximum "
        "nesting depth"))


def test_descriptors_nested_as_deep_as_configs_do_load() -> None:
    text = "domain: d\ndescriptors:\n" + "".join(
        f"{'  ' * (2 * i)}- key: k{i}\n{'  ' * (2 * i + 1)}descriptors:\n" for i in range(30))
    _, root = config.parse_domain("ok.yaml", text)
    assert "k0" in root.children


def test_descriptors_past_the_bound_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "MAX_DESCRIPTORS", 100)
    text = "domain: d\ndescriptors:\n" + "".join(
        f"  - {{key: k, value: v{i}, descriptors: [{{key: x}}]}}\n" for i in range(50))
    config.parse_domain("ok.yaml", text)
    with pytest.raises(ConfigError) as refused:
        config.parse_domain("many.yaml", text + "  - {key: one-more}\n")
    assert refused.value.message == ("many.yaml: config error, more than 100 descriptors in "
                                     "one config file (at descriptors[50])")


def test_broken_yaml_is_still_reported_in_the_usual_words() -> None:
    with pytest.raises(ConfigError) as refused:
        config.parse_domain("f.yaml", "domain: [x\n")
    assert refused.value.message.startswith("f.yaml: error loading config file: while ")
    with pytest.raises(ConfigError, match="found undefined alias"):
        config.parse_domain("f.yaml", "domain: d\ndescriptors: *nowhere\n")
