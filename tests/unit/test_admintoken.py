from __future__ import annotations

import stat
from pathlib import Path

import pytest

from sitsmesh.app.admintoken import load_or_create, read_token
from sitsmesh.errors import ConfigError, StartupError


def test_first_start_creates_a_0600_token_and_later_starts_reuse_it(tmp_path: Path) -> None:
    path = tmp_path / "admin-token"
    token, created = load_or_create(path, {})
    assert created and len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again, created_again = load_or_create(path, {})
    assert (again, created_again) == (token, False)
    assert read_token(path) == token
    assert list(tmp_path.iterdir()) == [path], "no temp file left behind"


def test_environment_token_wins_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "admin-token"
    assert load_or_create(path, {"SITSMESH_ADMIN_TOKEN": " abc "}) == ("abc", False)
    assert not path.exists()


def test_empty_token_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "admin-token"
    path.write_text("\n")
    with pytest.raises(ConfigError, match="admin token file is empty"):
        load_or_create(path, {})


def test_missing_token_file_for_the_cli(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="admin token file does not exist"):
        read_token(tmp_path / "nope")


def test_unwritable_location(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StartupError, match="cannot write admin token"):
        load_or_create(blocker / "admin-token", {})
