"""Every CLI flag that names a SITSMESH_* variable in --help takes its default from it."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

from sitsmesh.cli import build_parser, main
from sitsmesh.cli.common import EXIT_USAGE
from sitsmesh.config import PARSERS, env_name

DOCUMENTED = re.compile(r"\(or (SITSMESH_[A-Z0-9_]+)\)")
# How the CLI finds and talks to a sitsmesh: wherever one of these appears, it must have a
# variable (an operator sets them once per shell, or per CI job).
CONNECTION = {"--config", "--admin", "--token", "--token-file", "--state-dir", "--ca", "--cert",
              "--key", "--server-name", "--timeout", "--output", "--addr", "--data-addr"}


@pytest.fixture(autouse=True)
def _no_sitsmesh_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SITSMESH_"):
            monkeypatch.delenv(name)


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
            ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, child in subs[0].choices.items():
        yield from _leaves(child, (*path, name))


def _leaf(path: tuple[str, ...]) -> argparse.ArgumentParser:
    return dict(_leaves(build_parser()))[path]


def _required_argv(leaf: argparse.ArgumentParser) -> list[str]:
    """The least a command line needs to parse: '1' for each required value."""
    argv: list[str] = []
    for action in leaf._actions:
        if action.option_strings:
            if action.required:
                argv += [action.option_strings[0], "1"]
        elif action.nargs in (None, "+"):
            argv.append(str(next(iter(action.choices))) if action.choices else "1")
    return argv


def _sample(action: argparse.Action) -> tuple[str, Any, str]:
    """For the variable: a value unlike the flag's own default, and what it parses to; and
    another one for the command line."""
    if action.choices:
        others = [str(c) for c in action.choices if c != action.default]
        given = others[0] if len(others) > 1 else str(action.default)
        return others[-1], others[-1], given
    if action.type is float:
        return "7.25", 7.25, "2"
    return "/from/the/environment", "/from/the/environment", "/from/argv"


def _documented() -> dict[str, list[tuple[tuple[str, ...], argparse.Action]]]:
    """Each variable --help names, with the (command, flag) pairs that name it."""
    by_env: dict[str, list[tuple[tuple[str, ...], argparse.Action]]] = {}
    for path, leaf in _leaves(build_parser()):
        for action in leaf._actions:
            documented = DOCUMENTED.search(action.help or "")
            if documented is not None:
                by_env.setdefault(documented.group(1), []).append((path, action))
    return by_env


def test_every_documented_variable_is_the_flags_default(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    checked: set[str] = set()
    for env, named in _documented().items():
        # serve's settings reach load_settings, which layers the variables itself.
        settings = [a for path, a in named if path == ("serve",) and a.dest in PARSERS]
        assert all(env == env_name(action.dest) for action in settings)
        flags = [(path, a) for path, a in named if a not in settings]
        if not flags:
            continue
        text, expected, given = _sample(flags[0][1])
        with monkeypatch.context() as env_only:
            env_only.setenv(env, text)
            leaves = dict(_leaves(build_parser()))
            for path, action in flags:
                leaf = leaves[path]
                parsed = leaf.parse_args(_required_argv(leaf))
                assert getattr(parsed, action.dest) == expected, (path, action.dest, env)
                # The command line still wins over the variable.
                again = leaf.parse_args([*_required_argv(leaf), action.option_strings[0],
                                         given])
                assert str(getattr(again, action.dest)) == str(
                    float(given) if action.type is float else given)
            # An empty variable is unset, as in config.load_settings.
            env_only.setenv(env, "")
            leaves = dict(_leaves(build_parser()))
            for path, action in flags:
                leaf = leaves[path]
                assert getattr(leaf.parse_args(_required_argv(leaf)), action.dest
                               ) == action.default
        checked.add(env)
    assert checked == {"SITSMESH_CONFIG", "SITSMESH_ADMIN_ADDR", "SITSMESH_ADMIN_TOKEN",
                       "SITSMESH_ADMIN_TOKEN_FILE", "SITSMESH_STATE_DIR", "SITSMESH_ADMIN_CA",
                       "SITSMESH_ADMIN_CERT", "SITSMESH_ADMIN_KEY",
                       "SITSMESH_ADMIN_SERVER_NAME", "SITSMESH_TIMEOUT", "SITSMESH_OUTPUT",
                       "SITSMESH_DATA_ADDR", "SITSMESH_TLS_MIN_VERSION"}


def test_every_connection_flag_has_a_variable() -> None:
    missing = []
    for path, leaf in _leaves(build_parser()):
        for action in leaf._actions:
            if not CONNECTION & set(action.option_strings):
                continue
            help_text = action.help or ""
            # A swap or a watch lasts: its timeout is its own, and says so.
            if not (DOCUMENTED.search(help_text) or "SITSMESH_TIMEOUT does not apply"
                    in help_text):
                missing.append(f"{' '.join(path)} {action.option_strings[0]}")
    assert missing == []


def test_health_reads_sitsmesh_data_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SITSMESH_DATA_ADDR", "10.0.0.7:6001")
    assert build_parser().parse_args(["health"]).addr == "10.0.0.7:6001"


@pytest.mark.parametrize(("env", "value", "message"), [
    ("SITSMESH_OUTPUT", "xml", "argument --output/-o: invalid choice 'xml' (on the command "
     "line or in SITSMESH_OUTPUT; choose from table, json, yaml)"),
    ("SITSMESH_TIMEOUT", "soon", "argument --timeout: invalid value 'soon' (on the command "
     "line or in SITSMESH_TIMEOUT)"),
])
def test_a_bad_variable_is_a_usage_error_naming_it(
        env: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as exit_info:
        main(["status"])
    assert exit_info.value.code == EXIT_USAGE
    assert message in capsys.readouterr().err
