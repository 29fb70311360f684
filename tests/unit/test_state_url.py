from __future__ import annotations

import pytest

from sitsmesh.config import describe, load_settings
from sitsmesh.errors import ConfigError


def test_state_url_defaults_to_sqlite_in_the_state_dir() -> None:
    assert load_settings({}, env={}).state_url == ""


@pytest.mark.parametrize("url", ["sqlite:///var/lib/sitsmesh/state.db",
                                 "postgresql://sitsmesh@db:5432/sitsmesh",
                                 "postgres://db/sitsmesh?sslmode=require"])
def test_state_url_accepts_sqlite_and_postgresql(url: str) -> None:
    assert load_settings({"state_url": url}, env={}).state_url == url
    assert load_settings({}, env={"SITSMESH_STATE_URL": url}).state_url == url


@pytest.mark.parametrize(("url", "message"), [
    ("sqlite://relative.db", "expected sqlite:///ABSOLUTE/PATH"),
    ("sqlite:///", "expected sqlite:///ABSOLUTE/PATH"),
    ("mysql://u:pw@db/x", "expected a sqlite:/// or postgresql:// URL, got 'mysql://u:***@db/x'"),
])
def test_a_bad_state_url_names_the_flag_and_hides_the_password(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match="--state-url: ") as err:
        load_settings({"state_url": url}, env={})
    assert message in err.value.message and "pw@" not in err.value.message


def test_describe_hides_the_state_url_password() -> None:
    s = load_settings({"state_url": "postgresql://app:hunter2@db/x?password=also"}, env={})
    shown = describe(s)["state_url"]
    assert shown == "postgresql://app:***@db/x?password=***"
    assert "hunter2" not in str(describe(s)) and "also" not in str(describe(s))
