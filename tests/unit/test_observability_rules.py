"""deploy/observability: the alert rules and the Grafana dashboard, checked by promtool.

The PrometheusRule is the one copy of the rules; the plain rules file promtool reads is
its `spec`, written here. `promtool test rules` runs tests/unit/observability/
alerts_test.yaml, where each alert fires on some series and stays quiet on healthy ones.
Every dashboard query goes through promtool's parser as a recording rule, and every
metric name the dashboard and the rules use must be defined in the sitsmesh package, so
renaming a metric breaks this test, not a dashboard in production.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "deploy" / "observability"
RULE_CR = OBS / "prometheusrule.yaml"
DASHBOARD = OBS / "dashboard.json"
ALERT_TESTS = Path(__file__).parent / "observability" / "alerts_test.yaml"
RULES_NAME = "sitsmesh-rules.yml"  # what alerts_test.yaml's rule_files names
PROMTOOL = shutil.which("promtool")
MIN_SCHEMA_VERSION = 36
BUILTIN_METRICS = {"up"}  # set by Prometheus itself for every target
SEVERITIES = {"critical", "warning"}
REQUIRED_ANNOTATIONS = {"summary", "description", "runbook"}
# Grafana's variables, as the live test substitutes them too.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h",
                "$pipeline": ".*", "$tenant": ".*", "${datasource}": "prometheus"}

Doc = dict[str, Any]

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package "
                                    "prometheus) is not installed; make test installs it")


# --- the rules -----------------------------------------------------------------------

def rules_spec() -> Doc:
    """The PrometheusRule's spec: a rules file as Prometheus and promtool read it."""
    doc = yaml.safe_load(RULE_CR.read_text())
    assert doc["kind"] == "PrometheusRule"
    spec: Doc = doc["spec"]
    return spec


def write_rules(directory: Path) -> Path:
    path = directory / RULES_NAME
    path.write_text(yaml.safe_dump(rules_spec(), sort_keys=False))
    return path


def alerts() -> dict[str, Doc]:
    return {r["alert"]: r for g in rules_spec()["groups"] for r in g["rules"] if "alert" in r}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False)


_LABEL_TEMPLATE = re.compile(r"\{\{\s*\$labels\.(\w+)\s*\}\}")


def render(template: str, labels: dict[str, str]) -> str:
    """Prometheus' rendering of an annotation that only uses `{{ $labels.NAME }}`."""
    return _LABEL_TEMPLATE.sub(lambda m: labels.get(m.group(1), ""), template)


def alert_tests(rules_dir: Path) -> Doc:
    """alerts_test.yaml with rule_files at `rules_dir` and each expected alert's
    annotations rendered from its rule (promtool compares them whole)."""
    tests: Doc = yaml.safe_load(ALERT_TESTS.read_text())
    assert tests["rule_files"] == [RULES_NAME]
    tests["rule_files"] = [str(rules_dir / RULES_NAME)]
    by_name = alerts()
    for group in tests["tests"]:
        for case in group["alert_rule_test"]:
            annotations = by_name[case["alertname"]]["annotations"]
            for expected in case["exp_alerts"]:
                expected["exp_annotations"] = {
                    key: render(text, expected["exp_labels"])
                    for key, text in annotations.items()}
    return tests


@needs_promtool
def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    write_rules(tmp_path)
    result = promtool("check", "rules", RULES_NAME, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


@needs_promtool
def test_promtool_unit_tests_fire_each_alert_and_not_on_healthy_series(
        tmp_path: Path) -> None:
    write_rules(tmp_path)
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(alert_tests(tmp_path)))
    result = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    tests: Doc = yaml.safe_load(ALERT_TESTS.read_text())
    fires: set[str] = set()
    quiet: set[str] = set()
    for group in tests["tests"]:
        for case in group["alert_rule_test"]:
            (fires if case["exp_alerts"] else quiet).add(case["alertname"])
    assert fires == set(alerts()), "alerts without a case where they fire"
    assert quiet == set(alerts()), "alerts without a case where they stay quiet"


@needs_promtool
@pytest.mark.parametrize(("alert", "expr"), [
    ("SitsmeshDown", 'up{job=~".*sitsmesh.*"} == 2'),
    ("SitsmeshShedsHighPriority",
     'sum by (pipeline, stage, priority) (increase(sitsmesh_shed_total[5m])) > 10'),
    ("SitsmeshStageOverSLA", 'histogram_quantile(0.99, sum by (pipeline, stage, le) '
                             '(rate(sitsmesh_stage_latency_seconds_bucket[5m]))) > 1'),
    ("SitsmeshTritonMetricsStale", 'sitsmesh_stage_signal_age_seconds > 30'),
    ("SitsmeshSwapFailed", 'sum by (outcome) (increase(sitsmesh_swaps_total[30m])) > 0'),
])
def test_the_unit_tests_catch_a_wrong_expression(tmp_path: Path, alert: str,
                                                 expr: str) -> None:
    """A rule that misses its alert, or pages on healthy series, fails alerts_test.yaml."""
    spec = rules_spec()
    [rule] = [r for g in spec["groups"] for r in g["rules"] if r.get("alert") == alert]
    rule["expr"] = expr
    (tmp_path / RULES_NAME).write_text(yaml.safe_dump(spec))
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(alert_tests(tmp_path)))
    result = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert result.returncode != 0, result.stdout
    assert f"alertname: {alert}" in result.stdout + result.stderr


@needs_promtool
@pytest.mark.parametrize("alert", sorted(alerts()))
@pytest.mark.parametrize("expr", ["vector(1) < 0", "vector(1)"], ids=["never", "always"])
def test_each_alert_has_a_case_that_fails_when_it_never_or_always_fires(
        tmp_path: Path, alert: str, expr: str) -> None:
    test_the_unit_tests_catch_a_wrong_expression(tmp_path, alert, expr)


@pytest.mark.parametrize("name", sorted(alerts()))
def test_alert_says_how_bad_what_and_what_to_do(name: str) -> None:
    rule = alerts()[name]
    assert rule["labels"]["severity"] in SEVERITIES
    assert set(rule["annotations"]) >= REQUIRED_ANNOTATIONS
    for key, text in rule["annotations"].items():
        # Only $labels templates: render() above must be Prometheus' rendering.
        assert "{{" not in _LABEL_TEMPLATE.sub("", text), f"{name}.{key}: other template"
        assert len(text) >= 20, f"{name}.{key} says too little"


# --- the dashboard -------------------------------------------------------------------

def dashboard() -> Doc:
    doc: Doc = json.loads(DASHBOARD.read_text())
    return doc


def panels(doc: Doc) -> Iterator[Doc]:
    for panel in doc["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def queries(doc: Doc) -> Iterator[tuple[str, str]]:
    """(panel title, expr) of every query panel's targets."""
    for panel in panels(doc):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def substitute(expr: str, values: dict[str, str] = GRAFANA_VARS) -> str:
    for name, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a variable left in {expr}"
    return expr


def test_dashboard_is_a_grafana_dashboard_on_a_prometheus_variable() -> None:
    doc = dashboard()
    assert doc["schemaVersion"] >= MIN_SCHEMA_VERSION
    assert doc["uid"] and doc["title"]
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("pipeline", "tenant"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in panels(doc)]
    assert len(ids) == len(set(ids)), "panel ids repeat"


def test_every_panel_queries_the_datasource_variable() -> None:
    for panel in panels(dashboard()):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, \
            panel["title"]
        assert panel["targets"], f"{panel['title']}: no target"
        for target in panel["targets"]:
            assert target["expr"].strip(), f"{panel['title']}: empty expr"
            assert target["refId"], panel["title"]


@needs_promtool
def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    exprs = list(queries(dashboard()))
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": substitute(expr)}
        for i, (_, expr) in enumerate(exprs)]}]}
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", "dashboard.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


@needs_promtool
def test_a_broken_dashboard_query_fails_the_parse_check(tmp_path: Path) -> None:
    broken = {"groups": [{"name": "dashboard", "rules": [
        {"record": "dashboard:query0", "expr": substitute("sum by (stage (rate(x[$__range]))")}
    ]}]}
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(broken))
    assert promtool("check", "rules", "dashboard.yml", cwd=tmp_path).returncode != 0


# --- metric names --------------------------------------------------------------------

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPINGS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_SELECTORS = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
_IDENT = re.compile(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
             "unless", "bool", "offset", "inf", "nan"}
_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions,
    keywords, label names (in groupings and matchers) or strings."""
    bare = _SELECTORS.sub(" ", _GROUPINGS.sub(" ", _STRINGS.sub('""', expr)))
    names = set()
    for ident, call in _IDENT.findall(bare):
        if not call and ident.lower() not in _KEYWORDS:
            names.add(ident)
    return names


def test_metric_names_finds_metrics_and_skips_the_rest() -> None:
    expr = ('sum by (pipeline, le) (rate(a_bucket{x="y", le!="b_total"}[5m])) '
            '/ on (pipeline) group_left max(b_total offset 5m) or absent(up) > bool 1')
    assert metric_names(expr) == {"a_bucket", "b_total", "up"}


def _package_strings() -> set[str]:
    strings = set()
    for path in (ROOT / "sitsmesh").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    return strings


def defined(name: str, strings: set[str]) -> bool:
    """Whether sitsmesh defines `name`: as written, or as the family a prometheus-client
    sample belongs to (`x_total`/`x_bucket`... of `x`), or as a prefix constant plus a
    suffix constant (ratelimit_service_rate_limit_ + over_limit)."""
    candidates = {name} | {name.removesuffix(s) for s in _SUFFIXES if name.endswith(s)}
    if candidates & strings:
        return True
    return any(c.startswith(p) and c[len(p):] in strings
               for c in candidates for p in strings if p.endswith("_") and len(p) > 3)


def used_names() -> dict[str, set[str]]:
    """Metric name -> where it is used (alert or panel)."""
    used: dict[str, set[str]] = {}
    for name, rule in alerts().items():
        for metric in metric_names(rule["expr"]):
            used.setdefault(metric, set()).add(f"alert {name}")
    doc = dashboard()
    for title, expr in queries(doc):
        for metric in metric_names(substitute(expr)):
            used.setdefault(metric, set()).add(f"panel {title!r}")
    for variable in doc["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable["definition"])
            assert match, variable["definition"]
            used.setdefault(match.group(1), set()).add(f"variable {variable['name']}")
    return used


def test_every_metric_used_is_defined_in_sitsmesh() -> None:
    strings = _package_strings()
    missing = {name: sorted(where) for name, where in used_names().items()
               if name not in BUILTIN_METRICS and not defined(name, strings)}
    assert not missing, f"metrics that sitsmesh does not define: {missing}"


def test_a_renamed_metric_is_caught() -> None:
    strings = _package_strings()
    assert defined("sitsmesh_swaps_total", strings)
    assert defined("sitsmesh_stage_latency_seconds_bucket", strings)
    assert defined("ratelimit_service_rate_limit_over_limit", strings)
    assert not defined("sitsmesh_swap_total", strings)
    assert not defined("ratelimit_service_rate_limit_over_limits", strings)


def test_rules_and_dashboard_use_the_same_job_selector() -> None:
    job = 'job=~".*sitsmesh.*"'
    assert job in alerts()["SitsmeshDown"]["expr"]
    assert any(job in expr for _, expr in queries(dashboard()))
