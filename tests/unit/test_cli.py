"""The `sitsmesh` command line in-process: parsing, helpers, and errors caught before any RPC."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sitsmesh import __version__
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli import (
    batching,
    build_parser,
    completion,
    credentials,
    declarative,
    dev,
    main,
    models,
    pipelines,
    pressure,
    ratelimit,
    serve,
    status,
    swapview,
    tenants,
)
from sitsmesh.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    RpcFailed,
    UsageError,
    message_dict,
    print_json,
    read_text,
    table,
)

GROUPS = ["serve", "status", "health", "ratelimit", "tenants", "apikeys", "pipelines", "chain",
          "dev", "models", "swaps", "thresholds", "pressure", "simulate", "apply", "diff", "get",
          "schemas", "admin-credentials", "completion"]

# Every leaf command with the fewest arguments it parses with, and the function it runs.
COMMANDS: list[tuple[list[str], Callable[[argparse.Namespace], int]]] = [
    (["serve"], serve.cmd_serve),
    (["status"], status.cmd_status),
    (["health"], status.cmd_health),
    (["ratelimit", "check", "r.yaml"], ratelimit.cmd_ratelimit_check),
    (["ratelimit", "apply", "r.yaml"], ratelimit.cmd_ratelimit_apply),
    (["ratelimit", "get"], ratelimit.cmd_ratelimit_get),
    (["ratelimit", "delete", "d"], ratelimit.cmd_ratelimit_delete),
    (["tenants", "create", "t", "--models", "m*"], tenants.cmd_tenants),
    (["tenants", "update", "t"], tenants.cmd_tenants),
    (["tenants", "get", "t"], tenants.cmd_tenants),
    (["tenants", "delete", "t"], tenants.cmd_tenants),
    (["tenants", "list"], tenants.cmd_tenants),
    (["tenants", "usage", "t"], tenants.cmd_tenants),
    (["apikeys", "create", "--tenant", "t"], tenants.cmd_apikeys),
    (["apikeys", "list"], tenants.cmd_apikeys),
    (["apikeys", "revoke", "k1"], tenants.cmd_apikeys),
    (["pipelines", "apply", "p.yaml"], pipelines.cmd_pipelines),
    (["pipelines", "get", "p"], pipelines.cmd_pipelines),
    (["pipelines", "delete", "p"], pipelines.cmd_pipelines),
    (["pipelines", "list"], pipelines.cmd_pipelines),
    (["chain", "show", "p"], pipelines.cmd_chain_show),
    (["dev"], dev.cmd_dev),
    (["models", "list"], models.cmd_models_list),
    (["models", "swap", "m", "--to", "2"], models.cmd_models_swap),
    (["models", "profile", "m"], batching.cmd_profile),
    (["models", "curve", "m"], batching.cmd_curve),
    (["models", "tune", "m", "--dry-run"], batching.cmd_tune),
    (["models", "autotune", "p", "on"], batching.cmd_autotune),
    (["models", "batching-history"], batching.cmd_history),
    (["swaps", "list"], models.cmd_swaps_list),
    (["swaps", "get", "s1"], models.cmd_swaps_get),
    (["thresholds", "get", "p"], pressure.cmd_thresholds_get),
    (["thresholds", "set", "p", "t.yaml"], pressure.cmd_thresholds_set),
    (["thresholds", "history"], pressure.cmd_thresholds_history),
    (["pressure", "watch"], pressure.cmd_pressure_watch),
    (["simulate", "--pipeline", "p.yaml", "--load", "l.yaml"], pressure.cmd_simulate),
    (["apply", "-f", "c.yaml"], declarative.cmd_apply),
    (["diff", "-f", "c.yaml"], declarative.cmd_diff),
    (["get", "tenants"], declarative.cmd_get),
    (["schemas", "write"], declarative.cmd_schemas),
    (["admin-credentials", "generate"], credentials.cmd_generate),
    (["admin-credentials", "hash"], credentials.cmd_hash),
    (["admin-credentials", "check", "c.yaml"], credentials.cmd_check),
    (["completion", "bash"], completion.cmd_completion),
]

PIPELINE = """name: demo
models: ["lazy"]
stages:
  - name: model
    match: {upstream_cluster: triton}
    sla_p99_ms: 250
    triton_model: lazy
"""


@pytest.fixture(autouse=True)
def _no_sitsmesh_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # A SITSMESH_* variable of the shell running the tests must not change what is parsed.
    for name in list(os.environ):
        if name.startswith("SITSMESH_"):
            monkeypatch.delenv(name)


def _leaf_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
                ) -> Iterator[tuple[str, ...]]:
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield path
        return
    for name, child in subparsers[0].choices.items():
        yield from _leaf_paths(child, (*path, name))


def _no_rpc(*_: Any, **__: Any) -> Any:
    raise AssertionError("this command must fail before calling the admin API")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("argv", "func"), COMMANDS, ids=[" ".join(a[:2]) for a, _ in COMMANDS])
def test_every_command_parses_to_its_function(
        argv: list[str], func: Callable[[argparse.Namespace], int]) -> None:
    args = build_parser().parse_args(argv)
    assert args.func is func
    assert callable(args.func)


def test_the_list_above_has_every_command() -> None:
    leaves = set(_leaf_paths(build_parser()))
    listed = {next(tuple(argv[:n]) for n in range(len(argv), 0, -1) if tuple(argv[:n]) in leaves)
              for argv, _ in COMMANDS}
    assert listed == leaves
    assert len(leaves) == len(COMMANDS) == 44


def test_help_lists_every_group_in_order(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal's width
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: sitsmesh [-h] [--version]")
    assert ("The `sitsmesh` command: `serve` runs the control plane; the rest speak to a "
            "running one.") in " ".join(out.split())
    match = re.search(r"\{([a-z,-]+)\}", out)
    assert match is not None, out
    assert match.group(1).split(",") == GROUPS
    for group in GROUPS:
        assert re.search(rf"^    {group}\s+\S", out, re.M), f"{group} has no help line"


def test_defaults_of_the_admin_commands() -> None:
    parse = build_parser().parse_args
    args = parse(["status"])
    assert (args.timeout, args.output, args.admin_addr, args.token) == (5.0, "table", None, None)
    assert parse(["models", "swap", "m", "--to", "2"]).timeout == swapview.SWAP_TIMEOUT_S == 1800
    assert parse(["pressure", "watch"]).timeout == pressure.WATCH_TIMEOUT_S == 24 * 3600
    # A timeout given on the command line still wins over the command's own default.
    assert parse(["models", "swap", "m", "--to", "2", "--timeout", "9"]).timeout == 9.0
    health = parse(["health"])
    assert (health.addr, health.service, health.timeout) == ("127.0.0.1:50051", "", 3.0)
    assert parse(["chain", "show", "p"]).window == "1m"
    assert parse(["tenants", "update", "t"]).models is None


def test_serve_has_a_flag_for_every_setting_and_repeats_ratelimit_config() -> None:
    from sitsmesh.config import PARSERS

    args = build_parser().parse_args(
        ["serve", "--ratelimit-config", "a.yaml", "--ratelimit-config", "b", "--workers", "3"])
    assert args.ratelimit_config == ["a.yaml", "b"]
    assert args.workers == "3", "values stay strings: load_settings parses and checks them"
    assert set(PARSERS) <= set(vars(args))


def test_usage_errors_of_argparse_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["tenants"], ["models", "swap", "m"],
                 ["chain", "show", "p", "--window", "9m"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == EXIT_USAGE
    assert "the following arguments are required: --to" in capsys.readouterr().err


def test_table_aligns_columns_two_spaces_apart_without_trailing_blanks() -> None:
    assert table([("NAME", "STATE", "NOTE"), ("a-long-name", "ok", ""), ("b", "failed", "x")]
                 ) == ("NAME         STATE   NOTE\n"
                       "a-long-name  ok\n"
                       "b            failed  x")
    assert table([("ONLY",)]) == "ONLY"


def test_labels_parse_and_reject_pairs_without_a_key_or_equals() -> None:
    assert tenants.parse_labels(None) == {}
    assert tenants.parse_labels(["team=ml", "empty=", "eq=a=b"]) == {
        "team": "ml", "empty": "", "eq": "a=b"}
    with pytest.raises(UsageError, match=r"^--label wants KEY=VALUE, got 'bad'$"):
        tenants.parse_labels(["ok=1", "bad"])
    with pytest.raises(UsageError, match=r"^--label wants KEY=VALUE, got '=v'$"):
        tenants.parse_labels(["=v"])


def test_expiry_takes_durations_and_iso_times(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: 1_000.0)
    assert tenants.parse_expiry("30d") == 1_000.0 + 30 * 86400
    assert tenants.parse_expiry("12h") == 1_000.0 + 12 * 3600
    assert tenants.parse_expiry("90m") == 1_000.0 + 90 * 60
    assert tenants.parse_expiry("5s") == 1_005.0
    assert tenants.parse_expiry("2030-01-01T00:00:00") == 1_893_456_000.0, "naive is UTC"
    assert tenants.parse_expiry("2030-01-01T02:00:00+02:00") == 1_893_456_000.0
    for text in ("soon", "12x", "d"):
        with pytest.raises(UsageError) as info:
            tenants.parse_expiry(text)
        assert str(info.value) == (
            f"--expires wants 30d, 12h, 90m or an ISO 8601 time, got {text!r}")


def test_read_text_names_the_file_it_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("x: 1\n", encoding="utf-8")
    assert read_text(tmp_path / "a.yaml") == "x: 1\n"
    missing = tmp_path / "nope.yaml"
    with pytest.raises(UsageError) as info:
        read_text(missing, "the pipeline")
    assert str(info.value) == f"{missing}: cannot read the pipeline: No such file or directory"
    with pytest.raises(UsageError) as info:
        read_text(missing)
    assert str(info.value) == f"{missing}: cannot read: No such file or directory"


def test_json_output_keeps_proto_field_names(capsys: pytest.CaptureFixture[str]) -> None:
    tenant = admin_pb2.Tenant(name="t", models=["m*"], max_priority=3)
    assert message_dict(tenant) == {"name": "t", "models": ["m*"], "max_priority": 3}
    everything = message_dict(tenant, all_fields=True)
    assert everything["priority"] == 0 and everything["labels"] == {}
    print_json(tenant)
    assert json.loads(capsys.readouterr().out) == {"name": "t", "models": ["m*"],
                                                   "max_priority": 3}


def test_bad_label_exits_2_before_any_rpc(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tenants, "call_admin", _no_rpc)
    code, out, err = _run(capsys, "tenants", "create", "x", "--models", "a", "--label", "bad")
    assert (code, out) == (EXIT_USAGE, "")
    assert err == "sitsmesh: error: --label wants KEY=VALUE, got 'bad'\n"


def test_bad_expiry_exits_2_before_any_rpc(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tenants, "call_admin", _no_rpc)
    code, _, err = _run(capsys, "apikeys", "create", "--tenant", "t", "--expires", "soon")
    assert code == EXIT_USAGE
    assert err == ("sitsmesh: error: --expires wants 30d, 12h, 90m or an ISO 8601 time, "
                   "got 'soon'\n")


def test_tenant_create_sends_what_the_flags_say(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    sent: list[tuple[str, Any]] = []

    def echo(args: argparse.Namespace, method: str, request: Any) -> Any:
        sent.append((method, request.tenant))
        return admin_pb2.CreateTenantResponse(tenant=request.tenant)

    monkeypatch.setattr(tenants, "call_admin", echo)
    code, out, _ = _run(capsys, "tenants", "create", "x", "--models", "a,b*,", "--priority", "2",
                        "--label", "team=ml", "--label", "env=dev")
    assert code == 0
    [(method, tenant)] = sent
    assert method == "CreateTenant"
    assert (list(tenant.models), tenant.priority, dict(tenant.labels)) == (
        ["a", "b*"], 2, {"team": "ml", "env": "dev"})
    assert out == ("NAME  MODELS  PRIORITY  MAX_PRIORITY  MAX_CONCURRENCY  LABELS\n"
                   "x     a,b*    2         0             0                env=dev,team=ml\n")


def test_tenant_usage_prints_each_counter(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    reply = admin_pb2.GetTokenUsageResponse(tenant="acme", truncated=True, usage=[
        admin_pb2.TokenUsage(limit_index=0, per="minute", each="tenant", tokens=1000,
                             models=["*"], subject="acme", used=0, remaining=1000,
                             reset_s=30),
        admin_pb2.TokenUsage(limit_index=1, per="day", each="model", tokens=9000,
                             models=["llama-*"], subject="llama-8b", used=300,
                             remaining=8700, reset_s=57570.5)])
    sent: list[Any] = []

    def answer(args: argparse.Namespace, method: str, request: Any) -> Any:
        sent.append((method, request.tenant))
        return reply

    monkeypatch.setattr(tenants, "call_admin", answer)
    code, out, _ = _run(capsys, "tenants", "usage", "acme")
    assert code == 0 and sent == [("GetTokenUsage", "acme")]
    assert out == (
        "LIMIT  PER     EACH    SUBJECT   TOKENS  USED  REMAINING  RESET_S  MODELS\n"
        "0      minute  tenant  acme      1000    0     1000       30.0     *\n"
        "1      day     model   llama-8b  9000    300   8700       57570.5  llama-*\n"
        "(the first 2 counters; the tenant has more)\n")
    code, out, _ = _run(capsys, "tenants", "usage", "acme", "-o", "json")
    doc = json.loads(out)
    assert (doc["tenant"], doc["truncated"]) == ("acme", True)
    # Numbers as numbers, and zero counts kept.
    assert doc["usage"][0] == {"limit_index": 0, "per": "minute", "each": "tenant",
                               "tokens": 1000, "models": ["*"], "subject": "acme",
                               "used": 0, "remaining": 1000, "reset_s": 30.0}


def test_main_maps_failures_to_exit_codes(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    def refused(*_: Any, **__: Any) -> Any:
        raise RpcFailed("GetPipeline on 127.0.0.1:1: NOT_FOUND: no pipeline 'p'")

    monkeypatch.setattr(pipelines, "call_admin", refused)
    code, out, err = _run(capsys, "pipelines", "get", "p")
    assert (code, out) == (EXIT_FAILED, "")
    assert err == "sitsmesh: error: GetPipeline on 127.0.0.1:1: NOT_FOUND: no pipeline 'p'\n"

    def interrupted(*_: Any, **__: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(pipelines, "call_admin", interrupted)
    assert _run(capsys, "pipelines", "list") == (130, "", "")


def test_missing_token_file_is_a_usage_error(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # A SitsmeshError (here from reading the token) exits 2, before any channel is opened.
    code, out, err = _run(capsys, "status", "--state-dir", str(tmp_path / "none"))
    assert (code, out) == (EXIT_USAGE, "")
    assert err == (f"sitsmesh: error: {tmp_path / 'none' / 'admin-token'}: admin token file "
                   "does not exist\n")


def test_unreachable_admin_api_is_one_line_and_exit_1(
        capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{sock.getsockname()[1]}"
    code, out, err = _run(capsys, "status", "--admin", addr, "--token", "t", "--timeout", "3")
    assert (code, out) == (EXIT_FAILED, "")
    assert err.startswith(f"sitsmesh: error: GetStatus on {addr}: UNAVAILABLE: ")
    assert err.count("\n") == 1


@pytest.mark.parametrize("command", [["ratelimit", "apply"], ["pipelines", "apply"]])
def test_apply_of_an_unreadable_file_exits_1(command: list[str], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(ratelimit, "call_admin", _no_rpc)
    monkeypatch.setattr(pipelines, "call_admin", _no_rpc)
    missing = tmp_path / "nope.yaml"
    code, _, err = _run(capsys, *command, str(missing))
    assert code == EXIT_FAILED
    assert err == f"sitsmesh: error: {missing}: cannot read: No such file or directory\n"


def test_thresholds_set_of_an_unreadable_file_exits_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(pressure, "call_admin", _no_rpc)
    missing = tmp_path / "nope.yaml"
    code, _, err = _run(capsys, "thresholds", "set", "demo", str(missing))
    assert code == EXIT_USAGE
    assert err == f"sitsmesh: error: {missing}: No such file or directory\n"


def test_swap_sample_must_be_numbers_by_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(models, "admin_call", _no_rpc)
    sample = tmp_path / "sample.json"
    sample.write_text('{"INPUT0": [1, "x"]}')
    code, _, err = _run(capsys, "models", "swap", "m", "--to", "2", "--sample", str(sample))
    assert code == EXIT_USAGE
    assert err == f"sitsmesh: error: {sample}: expected {{input name: [numbers]}}\n"


def test_dev_takes_rlqs_addr_only_with_rlqs_admission(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    code, _, err = _run(capsys, "dev", "--rlqs-addr", "127.0.0.1:50053")
    assert code == EXIT_USAGE
    assert err == "sitsmesh: error: --rlqs-addr: RLQS is used with --admission rlqs only\n"


def test_dev_rejects_bad_triton_ports(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "dev", "--triton-ports", "1,2")
    assert code == EXIT_USAGE
    assert err == ("sitsmesh: error: --triton-ports: expected HTTP,GRPC,METRICS port numbers, "
                   "got '1,2'\n")


def test_simulate_input_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "load.yaml").write_text("duration_s: 5\nsteps: []\n")
    (tmp_path / "broken.yaml").write_text("policy: [\n")
    (tmp_path / "nameless.yaml").write_text("stages: []\n")
    missing = tmp_path / "nope.yaml"
    cases = [
        ([str(missing), "load.yaml"],
         f"{missing}: cannot read the pipeline: No such file or directory"),
        (["p.yaml", str(missing)],
         f"{missing}: cannot read the load profile: No such file or directory"),
        (["broken.yaml", "load.yaml"], "broken.yaml: invalid YAML: "),
        (["nameless.yaml", "load.yaml"], "nameless.yaml: a pipeline needs a name and stages"),
        (["p.yaml", "load.yaml"], "load.yaml: steps must be a list of {at_s, rps}"),
    ]
    for (pipeline, load), message in cases:
        code, out, err = _run(capsys, "simulate", "--pipeline", str(tmp_path / pipeline),
                              "--load", str(tmp_path / load))
        assert (code, out) == (EXIT_USAGE, ""), err
        assert err.startswith("sitsmesh: error: ") and message in err, err


def test_simulate_prints_the_per_second_table_and_a_summary(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "load.yaml").write_text(
        "duration_s: 3\npriorities: {0: 1.0}\nservice_ms: {model: 20}\n"
        "steps:\n  - {at_s: 0, rps: 10}\n")
    code, out, err = _run(capsys, "simulate", "--pipeline", str(tmp_path / "p.yaml"),
                          "--load", str(tmp_path / "load.yaml"), "--compare")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "policy sitsmesh, per second:"
    assert lines[1].split() == ["T", "OFFERED", "ADMITTED", "SHED", "%", "GOODPUT", "P99", "MS",
                                "ADMIT"]
    summary = lines[lines.index("summary:") + 1:]
    assert summary[0].split()[:2] == ["POLICY", "GOODPUT/S"]
    assert [row.split()[0] for row in summary[1:]] == ["sitsmesh", "seed", "off"]


def test_simulate_says_how_much_high_priority_each_policy_made_late(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A step to twice capacity over exponential service times: without control the
    protected priority waits behind everything admitted; sitsmesh keeps most of it in
    time. Both are judged on the same requests and the same service times."""
    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "load.yaml").write_text(
        "duration_s: 12\npriorities: {0: 0.7, 9: 0.3}\nservice_ms: {model: 20}\n"
        "service: exp\nlog_flush_s: 0.02\nsteps:\n  - {at_s: 0, rps: 25}\n"
        "  - {at_s: 3.9, rps: 25}\n  - {at_s: 4, rps: 100}\n")
    code, out, err = _run(capsys, "simulate", "--pipeline", str(tmp_path / "p.yaml"),
                          "--load", str(tmp_path / "load.yaml"), "--compare",
                          "--output", "json")
    assert (code, err) == (0, "")
    runs = json.loads(out)
    assert runs["off"]["protected_late_by_others"] > 0.3
    assert runs["sitsmesh"]["protected_late_by_others"] < 0.08
    code, out, err = _run(capsys, "simulate", "--pipeline", str(tmp_path / "p.yaml"),
                          "--load", str(tmp_path / "load.yaml"))
    assert "LATE BY OTHERS" in out


def test_ratelimit_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    code, out, err = _run(capsys, "ratelimit", "check", str(tmp_path / "empty"))
    assert (code, out, err) == (EXIT_FAILED, "", "sitsmesh: error: no config files found\n")

    good = tmp_path / "good.yaml"
    good.write_text("domain: files\ndescriptors:\n  - key: user\n"
                    "    rate_limit: {unit: hour, requests_per_unit: 2}\n")
    assert _run(capsys, "ratelimit", "check", str(good)) == (
        0, f"{good}: ok (domain 'files')\n", "")

    (tmp_path / "bad.yaml").write_text("domain: ''\n")
    code, out, _ = _run(capsys, "ratelimit", "check", str(tmp_path))
    assert code == EXIT_FAILED
    assert f"{tmp_path / 'bad.yaml'}: config file cannot have empty domain" in out
    assert f"{good}: ok (domain 'files')" in out


def test_importing_the_cli_loads_neither_prometheus_nor_the_server() -> None:
    # `serve` must set PROMETHEUS_MULTIPROC_DIR before prometheus_client is first imported,
    # so neither the package nor building the parser may import it (a fresh interpreter:
    # other tests of this session may have imported it already).
    heavy = ("prometheus_client", "sitsmesh.app.server", "sitsmesh.dev.devstack")
    probe = ("import sys, sitsmesh.cli; sitsmesh.cli.build_parser(); "
             f"print([m for m in {heavy!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.strip() == "[]"


def test_python_dash_m_sitsmesh_runs_the_cli() -> None:
    done = subprocess.run([sys.executable, "-m", "sitsmesh", "--version"], capture_output=True,
                          text=True, check=False, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"sitsmesh {__version__}\n")
