"""Every command group's --help ends with examples, and every example parses."""

from __future__ import annotations

import argparse
import os
import re
import shlex
from collections.abc import Iterator

import pytest

from sitsmesh.cli import build_parser

SHELL = {"|", ">", "<", ">>", "&&", ";"}


@pytest.fixture(autouse=True)
def _no_sitsmesh_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SITSMESH_"):
            monkeypatch.delenv(name)


def _groups() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    yield from sub.choices.items()


def _examples(parser: argparse.ArgumentParser) -> list[str]:
    epilog = parser.epilog or ""
    head, _, body = epilog.partition("examples:\n")
    assert not head, "examples come last"
    return [line.strip() for line in body.splitlines() if line.strip()]


def _argv(example: str) -> list[str]:
    """The sitsmesh arguments of one shell line: no VAR=value before, no pipe, redirect,
    comment or `source <(...)` around."""
    words = shlex.split(re.sub(r"^source <\((.*?)\)", r"\1", example), comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words.pop(0)
    cut = next((i for i, w in enumerate(words) if w in SHELL), len(words))
    assert words[0] == "sitsmesh", example
    return words[1:cut]


def test_every_group_has_two_or_three_examples() -> None:
    counts = {name: len(_examples(parser)) for name, parser in _groups()}
    assert all(2 <= n <= 3 for n in counts.values()), counts
    assert len(counts) == 20


@pytest.mark.parametrize("example", [e for _, p in _groups() for e in _examples(p)])
def test_every_example_parses(example: str) -> None:
    argv = _argv(example)
    args = build_parser().parse_args(argv)
    assert callable(args.func)
    if argv[0] == "dev" and "--" in argv:  # what follows -- goes to `sitsmesh serve`
        build_parser().parse_args(["serve", *argv[argv.index("--") + 1:]])


def test_examples_show_under_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tenants", "--help"])
    out = capsys.readouterr().out
    # RawDescription keeps one example a line, as written.
    assert "\nexamples:\n  sitsmesh tenants create acme --models 'llama-*,bert'" in out
