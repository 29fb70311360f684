"""`sitsmesh completion bash|zsh`: the scripts load in the real shells and complete."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sitsmesh.cli import main

BASH = shutil.which("bash")


def _script(shell: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["completion", shell]) == 0
    return capsys.readouterr().out


def _complete(script: Path, *words: str) -> list[str]:
    """What bash offers for the last of `words`, through the function `complete` names."""
    line = " ".join(words)
    probe = (f'source {script}\n'
             'spec=$(complete -p sitsmesh) || exit 3\n'
             'fn=$(sed -E "s/.* -F ([^ ]+) .*/\\1/" <<<"$spec")\n'
             f'COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}\n'
             f'COMP_LINE="{line}"; COMP_POINT=${{#COMP_LINE}}\n'
             '"$fn" sitsmesh "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"\n'
             'printf "%s\\n" "${COMPREPLY[@]}"\n')
    done = subprocess.run([BASH or "bash", "--norc", "-c", probe], capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_bash_loads_the_script_and_completes_commands_and_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "sitsmesh.bash"
    script.write_text(_script("bash", capsys))
    shown = subprocess.run([BASH or "bash", "--norc", "-c", f"source {script} && "
                            "complete -p sitsmesh"], capture_output=True, text=True,
                           timeout=30, check=False)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("complete ") and shown.stdout.rstrip().endswith(" sitsmesh")
    assert _complete(script, "sitsmesh", "ten") == ["tenants"]
    assert _complete(script, "sitsmesh", "tenants", "l") == ["list"]
    assert "--tenant" in _complete(script, "sitsmesh", "apikeys", "list", "--te")
    assert _complete(script, "sitsmesh", "status", "-o", "y") == ["yaml"]
    assert _complete(script, "sitsmesh", "completion", "") == ["bash", "zsh"]


def test_zsh_script_defines_the_completion_function(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    script = _script("zsh", capsys)
    assert script.startswith("#compdef sitsmesh")
    assert "tenants" in script and "apikeys" in script
    zsh = shutil.which("zsh")
    assert zsh is not None, "zsh is missing: `make test` installs it (Debian package zsh)"
    path = tmp_path / "_sitsmesh"
    path.write_text(script)
    done = subprocess.run([zsh, "-n", str(path)], capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 0, done.stderr


def test_an_unknown_shell_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["completion", "fish"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fish'" in capsys.readouterr().err


def test_the_cli_does_not_import_shtab_until_asked() -> None:
    probe = "import sys, sitsmesh.cli; sitsmesh.cli.build_parser(); print('shtab' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.stdout.strip() == "False", done.stderr
