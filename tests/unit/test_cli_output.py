"""The CLI's one renderer: tables sized by their content, json and yaml of one document."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli import build_parser, main, pressure, tenants
from sitsmesh.cli.common import dump, render, table

LONG = "k" * 60


@pytest.fixture(autouse=True)
def _no_sitsmesh_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SITSMESH_"):
            monkeypatch.delenv(name)


def _keys() -> admin_pb2.ListApiKeysResponse:
    reply = admin_pb2.ListApiKeysResponse()
    reply.keys.add(id="k1", tenant="acme", name=LONG)
    reply.keys.add(id="a-much-longer-key-id", tenant="t" * 30, name="short", revoked=True)
    return reply


def test_columns_are_as_wide_as_their_widest_cell() -> None:
    lines = tenants.apikey_table(_keys().keys).splitlines()
    assert lines[0].split() == ["ID", "TENANT", "STATE", "EXPIRES", "NAME"]
    # Every row's cells start where the header's do, however long the id or tenant.
    starts = [lines[0].index(h) for h in ("TENANT", "STATE", "EXPIRES", "NAME")]
    for line in lines[1:]:
        for start in starts:
            assert line[start - 2:start] == "  " and line[start] != " ", line
    assert lines[1].endswith(LONG) and lines[2].endswith("short")
    assert lines[2].startswith("a-much-longer-key-id  " + "t" * 30 + "  revoked  never")


def test_a_table_of_one_row_is_its_header_and_cells_never_pad_the_end() -> None:
    assert table([("A", "B")]) == "A  B"
    assert table([("A", "B"), ("xyz", "")]) == "A    B\nxyz"


@pytest.mark.parametrize("doc", [
    {"name": "t", "models": ["m*"], "max_priority": 3},
    [{"pipeline": "p", "before": None, "after": {"policy": "seed", "cut": 0.5}}],
    {"seed": {"success_by_priority": {0: 0.5, 9: 1.0}}},  # int keys: json makes them strings
    {"text": "ünïcode: and 'quotes'\nnewline", "empty": [], "nested": {"a": {}}},
])
def test_yaml_and_json_print_the_same_document(doc: Any) -> None:
    assert yaml.safe_load(dump(doc, "yaml")) == json.loads(dump(doc, "json"))


def test_render_prints_the_table_only_for_table_output(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    def never() -> str:
        raise AssertionError("json and yaml must not build the table")

    for output in ("json", "yaml"):
        render(argparse.Namespace(output=output), {"a": 1}, never)
    assert capsys.readouterr().out == '{\n  "a": 1\n}\na: 1\n'
    render(argparse.Namespace(output="table"), {"a": 1}, lambda: "A\n1")
    render(argparse.Namespace(output="table"), {"a": 1}, None)
    assert capsys.readouterr().out == "A\n1\n"


def test_every_command_that_prints_takes_yaml() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for child in sub.choices.values():
        leaves = [child]
        inner = [a for a in child._actions if isinstance(a, argparse._SubParsersAction)]
        if inner:
            leaves = list(inner[0].choices.values())
        for leaf in leaves:
            outputs = [a for a in leaf._actions if a.dest == "output"]
            if not outputs or "yaml" not in (outputs[0].choices or ()):
                missing.append(leaf.prog)
    # serve and dev run servers; `ratelimit check` prints one verdict line per file;
    # completion prints a shell script.
    assert sorted(missing) == ["sitsmesh completion", "sitsmesh dev",
                               "sitsmesh ratelimit check", "sitsmesh serve"]


@pytest.mark.parametrize("output", ["json", "yaml"])
def test_apikeys_list_and_thresholds_set_honour_output(
        output: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tenants, "call_admin", lambda *_, **__: _keys())
    assert main(["apikeys", "list", "-o", output]) == 0
    load = json.loads if output == "json" else yaml.safe_load
    doc = load(capsys.readouterr().out)
    assert [k["name"] for k in doc["keys"]] == [LONG, "short"]

    body = tmp_path / "t.yaml"
    body.write_text("policy: seed\n")
    monkeypatch.setattr(pressure, "call_admin", lambda *_, **__: admin_pb2.SetThresholdsResponse(
        thresholds=admin_pb2.PipelineThresholds(pipeline="demo", yaml="policy: seed\n")))
    assert main(["thresholds", "set", "demo", str(body), "-o", output]) == 0
    assert load(capsys.readouterr().out) == {"pipeline": "demo", "dry_run": False,
                                             "thresholds": {"policy": "seed"}}


@pytest.mark.parametrize("output", ["json", "yaml"])
def test_pressure_watch_streams_one_document_per_snapshot(
        output: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    snapshots = [admin_pb2.WatchPressureResponse(pipelines=[admin_pb2.PipelinePressure(
        pipeline=f"p{i}", level=admin_pb2.PRESSURE_LEVEL_OK)]) for i in range(2)]

    @contextlib.contextmanager
    def stream(*_: Any, **__: Any) -> Iterator[Any]:
        yield lambda request: iter(snapshots)

    monkeypatch.setattr(pressure, "admin_call", stream)
    assert main(["pressure", "watch", "-o", output]) == 0
    out = capsys.readouterr().out
    docs = ([json.loads(line) for line in out.splitlines()] if output == "json"
            else list(yaml.safe_load_all(out)))
    assert [d["pipelines"][0]["pipeline"] for d in docs] == ["p0", "p1"]
    # The level is an enum on the wire and the word it always was in the output.
    assert [d["pipelines"][0]["level"] for d in docs] == ["ok", "ok"]
