"""The admin API's contract checks with the real buf CLI (pinned in tools/buf, installed by
`make test`/`make lint` with npm ci): the tree passes `buf lint` (STANDARD) and
`buf breaking` against the last release's image, and both catch what they are there for."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUF = REPO / "tools" / "buf" / "node_modules" / ".bin" / "buf"
ADMIN = Path("sitsmesh") / "admin" / "v1" / "admin.proto"


@pytest.fixture(autouse=True)
def _buf_installed() -> None:
    assert BUF.exists(), "buf is missing: `make test` runs npm ci --prefix tools/buf"


def _lint(protos: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BUF), "lint", str(protos)], capture_output=True, text=True,
                          timeout=60, check=False, cwd=REPO)


def _breaking(protos: Path) -> subprocess.CompletedProcess[str]:
    # Through the script `make lint` runs, so what is tested is what is wired.
    return subprocess.run([str(REPO / "scripts" / "check_breaking.sh")], capture_output=True,
                          text=True, timeout=60, check=False, cwd=REPO,
                          env={**os.environ, "PROTOS": str(protos)})


def _copy(tmp_path: Path, old: str, new: str) -> Path:
    """protos/ (with its buf.yaml) copied, one edit made to admin.proto."""
    copy = tmp_path / "protos"
    shutil.copytree(REPO / "protos", copy, ignore=shutil.ignore_patterns("releases"))
    proto = copy / ADMIN
    text = proto.read_text()
    assert text.count(old) == 1, old
    proto.write_text(text.replace(old, new))
    return copy


def test_the_tree_passes_lint_and_the_breaking_check() -> None:
    lint = _lint(REPO / "protos")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    breaking = _breaking(REPO / "protos")
    assert breaking.returncode == 0, breaking.stdout + breaking.stderr


def test_lint_reports_an_unprefixed_enum_value(tmp_path: Path) -> None:
    copy = _copy(tmp_path, "  SWAP_STATE_INTERRUPTED = 5;", "  INTERRUPTED = 5;")
    lint = _lint(copy)
    assert lint.returncode != 0
    assert 'Enum value name "INTERRUPTED" should be prefixed with "SWAP_STATE_"' in lint.stdout


def test_breaking_reports_a_removed_field(tmp_path: Path) -> None:
    copy = _copy(tmp_path, "  // Requests in flight at once; 0 means no cap.\n"
                 "  uint32 max_concurrency = 5;\n", "")
    breaking = _breaking(copy)
    assert breaking.returncode != 0
    assert 'Previously present field "5" with name "max_concurrency" on message "Tenant" ' \
           "was deleted" in breaking.stdout, breaking.stdout + breaking.stderr


def test_breaking_reports_a_renumbered_field(tmp_path: Path) -> None:
    copy = _copy(tmp_path, "  uint32 max_priority = 4;", "  uint32 max_priority = 14;")
    breaking = _breaking(copy)
    assert breaking.returncode != 0
    assert 'Previously present field "4" with name "max_priority" on message "Tenant"' \
        in breaking.stdout, breaking.stdout + breaking.stderr
