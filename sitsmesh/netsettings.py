"""Values of the network-facing settings: listen addresses (TCP or a Unix socket) and
the client identities that allowlists name. Pure parsing; sitsmesh.config uses these."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from sitsmesh.keyvalues import split_pairs

# The data-plane services an allowlist can name, as `data_callers` keys.
DATA_SERVICES = ("authz", "ratelimit", "accesslog", "metrics", "quota", "tokens")
_LOOPBACK_NAMES = ("localhost", "ip6-localhost")


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        if self.is_unix:
            return self.host
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def is_unix(self) -> bool:
        """A Unix socket, written unix:/PATH: `host` holds it whole and `port` is 0."""
        return self.host.startswith("unix:")

    @property
    def is_loopback(self) -> bool:
        """Reachable only from this host (or pod): loopback, or a Unix socket."""
        if self.is_unix or self.host in _LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_address(text: str) -> Address:
    """Parse HOST:PORT or [V6]:PORT. Raises ValueError with a readable reason."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"expected [IPV6]:PORT, got {text!r}")
        port_text = rest[1:]
        ipaddress.IPv6Address(host)
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        if ":" in host:
            raise ValueError(f"IPv6 hosts need brackets, as in [::1]:PORT; got {text!r}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"port must be a number from 0 to 65535, got {port_text!r}")
    return Address(host, int(port_text))


def data_address(raw: Any) -> Address:
    """HOST:PORT, or unix:/ABSOLUTE/PATH for an Envoy on the same host or in the same pod."""
    if not isinstance(raw, str):
        raise ValueError(f"expected HOST:PORT or unix:/PATH as a string, got {raw!r}")
    text = raw.strip()
    if text.startswith("unix:"):
        path = text.removeprefix("unix:")
        if not path.startswith("/") or path.startswith("//"):
            raise ValueError(f"expected unix:/ABSOLUTE/PATH, got {raw!r}")
        return Address(text, 0)
    return parse_address(text)


def optional_address(raw: Any) -> Address | None:
    """HOST:PORT or unix:/PATH; empty for none. Port 0 is refused: Envoy's cluster for
    it must name the port, and the process serving it is not the one that logs it."""
    if isinstance(raw, str) and not raw.strip():
        return None
    addr = data_address(raw)
    if addr.port == 0 and not addr.is_unix:
        raise ValueError(f"expected a fixed port, got {raw!r} (Envoy's cluster names it)")
    return addr


def identities(raw: Any) -> tuple[str, ...]:
    """Client identities (URI SANs such as SPIFFE ids, or DNS SANs): a list, or
    comma-separated."""
    items = raw if isinstance(raw, list) else str(raw).split(",")
    if not all(isinstance(i, str) for i in items):
        raise ValueError(f"expected identities as strings, got {raw!r}")
    names = tuple(i.strip() for i in items if i.strip())
    if not names:
        raise ValueError("expected at least one client identity")
    return names


def callers(raw: Any) -> dict[str, tuple[str, ...]]:
    """{service: [identity, ...]} (YAML), or 'authz=ID|ID,accesslog=ID' (env, flag)."""
    items: list[tuple[Any, Any]]
    if isinstance(raw, dict):
        items = list(raw.items())
    elif isinstance(raw, str):
        items = [(key, value.split("|")) for key, value in split_pairs(raw, "SERVICE=ID|ID")]
    else:
        raise ValueError(f"expected a mapping of service to identities, got {raw!r}")
    found: dict[str, tuple[str, ...]] = {}
    for key, value in items:
        if key not in DATA_SERVICES:
            raise ValueError(f"unknown service {key!r} (allowed: {', '.join(DATA_SERVICES)})")
        try:
            found[key] = identities(value)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
    return found
