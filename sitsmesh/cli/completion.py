"""`sitsmesh completion bash|zsh`: a shell completion script generated from the parser."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from sitsmesh.cli.common import Subcommands

# What a value names on disk, by dest or metavar: completed as files or directories.
_DIRECTORIES = {"state_dir", "run_dir", "filters_dir"}
_FILES = {"config", "admin_token_file", "ca", "cert", "key", "file", "files", "paths",
          "out", "sample", "pipeline_file", "thresholds", "load"}


def add_commands(sub: Subcommands, root: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "completion", help="print a shell completion script",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  source <(sitsmesh completion bash)           # this shell only\n"
               "  sitsmesh completion bash > ~/.local/share/bash-completion/completions/"
               "sitsmesh\n"
               "  sitsmesh completion zsh > \"${fpath[1]}/_sitsmesh\"")
    p.add_argument("shell", choices=("bash", "zsh"))
    # The root parser, to walk: this module cannot import build_parser (an import cycle).
    p.set_defaults(func=cmd_completion, root_parser=root)


def _actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _actions(child)
        else:
            yield action


def cmd_completion(args: argparse.Namespace) -> int:
    # shtab writes the script from the argparse tree, so it never drifts from the commands.
    import shtab

    for action in _actions(args.root_parser):
        metavar = str(action.metavar or "")
        if action.dest in _DIRECTORIES:
            action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
        elif (action.dest in _FILES or metavar.endswith((".yaml", ".json"))
              or metavar in ("PEM", "FILE", "PATH")):
            action.complete = shtab.FILE  # type: ignore[attr-defined]
    print(shtab.complete(args.root_parser, shell=args.shell), end="")
    return 0
