"""Parsers of one setting's raw value (YAML, an environment variable or a flag): each
returns the typed value or raises ValueError saying what was expected. Shared by
sitsmesh.config and the modules that keep a group of settings apart from it."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sitsmesh import redisclients
from sitsmesh.keyvalues import split_pairs
from sitsmesh.netsettings import parse_address


def int_range(low: int, high: int) -> Callable[[Any], int]:
    def parse(raw: Any) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int | str):
            raise ValueError(f"expected an integer, got {raw!r}")
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}, got {value}")
        return value

    return parse


def _number(raw: Any, expected: str) -> float:
    """`raw` as a float (a bool is no number); ValueError naming what was `expected`."""
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise ValueError(f"expected {expected}, got {raw!r}")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"expected {expected}, got {raw!r}") from None


def seconds(raw: Any) -> float:
    value = _number(raw, "a number of seconds")
    if not 0 <= value <= 3600:
        raise ValueError(f"must be between 0 and 3600 seconds, got {value:g}")
    return value


def fraction(raw: Any) -> float:
    """A ratio in [0, 1]."""
    value = _number(raw, "a number between 0 and 1")
    if not 0 <= value <= 1:
        raise ValueError(f"must be between 0 and 1, got {value:g}")
    return value


def choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(raw: Any) -> str:
        value = str(raw).lower()
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}; got {raw!r}")
        return value

    return parse


def boolean(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


def paths(raw: Any) -> tuple[Path, ...]:
    """A list (YAML) or an os.pathsep-separated string (env, repeated flags)."""
    items = raw if isinstance(raw, list) else str(raw).split(os.pathsep)
    if not all(isinstance(i, str) for i in items):
        raise ValueError(f"expected paths, got {raw!r}")
    return tuple(Path(i).expanduser() for i in items if i)


def redis_url(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"expected a Redis URL, got {raw!r}")
    redisclients.parse(raw)
    return raw


def header_names(raw: Any) -> tuple[str, ...]:
    items = raw if isinstance(raw, list) else str(raw).split(",")
    names = tuple(str(i).strip().lower() for i in items if str(i).strip())
    if not names:
        raise ValueError("expected at least one header name")
    return names


def header_name(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"expected a header name, got {raw!r}")
    return raw.strip().lower()


def header_name_as_given(raw: Any) -> str:
    """A header name to send, in the caller's case (as envoyproxy/ratelimit sends it)."""
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"expected a header name, got {raw!r}")
    name = raw.strip()
    if not all(c.isascii() and (c.isalnum() or c in "!#$%&'*+-.^_`|~") for c in name):
        raise ValueError(f"not a valid header name: {raw!r}")
    return name


def string(raw: Any) -> str:
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"expected a non-empty string, got {raw!r}")
    return raw


def mapping(raw: Any) -> dict[str, str]:
    """A YAML mapping, or 'key=value,key=value' from the environment or a flag."""
    items = list(raw.items()) if isinstance(raw, dict) else split_pairs(str(raw), "key=value")
    if not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in items):
        raise ValueError("expected a mapping of non-empty strings")
    return dict(items)


def path(raw: Any) -> Path:
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"expected a path, got {raw!r}")
    return Path(raw).expanduser()


def grpc_target(raw: Any) -> str:
    """HOST:PORT, as tritonclient takes it; a grpc:// prefix is dropped."""
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"expected a gRPC HOST:PORT, got {raw!r}")
    text = raw.removeprefix("grpc://")
    parse_address(text)
    return text


def http_url(raw: Any) -> str:
    if not isinstance(raw, str) or not raw.startswith(("http://", "https://")):
        raise ValueError(f"expected an http:// URL, got {raw!r}")
    return raw


def strings(raw: Any) -> tuple[str, ...]:
    items = raw if isinstance(raw, list) else str(raw).split(",")
    return tuple(str(i).strip() for i in items if str(i).strip())


def state_url(raw: Any) -> str:
    """sqlite:///ABSOLUTE/PATH or postgresql://... (empty: SQLite in state_dir)."""
    if not isinstance(raw, str):
        raise ValueError(f"expected a sqlite:/// or postgresql:// URL, got {raw!r}")
    if raw == "":
        return raw
    if raw.startswith("sqlite://"):
        path = raw.removeprefix("sqlite://")
        if not path.startswith("/") or path == "/":
            raise ValueError("expected sqlite:///ABSOLUTE/PATH (three slashes, then the "
                             f"file), got {raw!r}")
        return raw
    if raw.startswith(("postgresql://", "postgres://")):
        return raw
    raise ValueError(f"expected a sqlite:/// or postgresql:// URL, got {redact_url(raw)!r}")


def redact_url(url: str) -> str:
    """The URL with any password replaced by ***, for logs and messages."""
    url = re.sub(r"(?i)([?&]password=)[^&]*", r"\1***", url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, tail = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}{slash}{tail}"


def otlp_endpoint(raw: Any) -> str:
    """Empty (tracing off), or http://HOST:PORT / https://HOST:PORT of an OTLP/gRPC receiver.
    The scheme is the only switch between plaintext and TLS, so it must be explicit, and
    a path would be silently dropped by the gRPC exporter, so none is taken."""
    if not isinstance(raw, str):
        raise ValueError(f"expected http://HOST:PORT or https://HOST:PORT, got {raw!r}")
    if raw == "":
        return raw
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError:
        port, parts = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname \
            or port is None:
        raise ValueError("expected http://HOST:PORT (plaintext) or https://HOST:PORT (TLS), "
                         f"got {raw!r}")
    if parts.username is not None or parts.path not in ("", "/") or parts.query \
            or parts.fragment:
        raise ValueError(f"expected only a scheme, host and port, got {raw!r}")
    return raw.rstrip("/")
