"""Checks that run before any port is opened, so bad input exits 2 having changed nothing."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

from sitsmesh.config import Address, Settings
from sitsmesh.errors import StartupError


def check_state_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        os.close(fd)
        Path(probe).unlink()
    except OSError as exc:
        raise StartupError(f"state dir {path}: not writable: {exc.strerror or exc}") from None


def check_bindable(name: str, addr: Address) -> None:
    """Bind and release the address. No SO_REUSEPORT: a live listener must make this fail."""
    try:
        infos = socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"{name} {addr}: cannot resolve host: {exc.strerror}") from None
    family, socktype, proto, _, sockaddr = infos[0]
    with socket.socket(family, socktype, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            raise StartupError(f"{name} {addr}: cannot bind: {exc.strerror or exc}") from None


def check_socket_dir(name: str, addr: Address) -> None:
    directory = Path(addr.host.removeprefix("unix:")).parent
    if not directory.is_dir():
        raise StartupError(f"{name} {addr}: directory {directory} does not exist")


def check_all(settings: Settings) -> None:
    check_state_dir(settings.state_dir)
    addrs = {"data_addr": settings.data_addr, "admin_addr": settings.admin_addr,
             "metrics_addr": settings.metrics_addr}
    seen: dict[tuple[str, int], str] = {}
    for name, addr in addrs.items():
        if addr.is_unix:
            check_socket_dir(name, addr)
            continue
        key = (addr.host, addr.port)
        if addr.port and key in seen:
            raise StartupError(f"{name} {addr}: same address as {seen[key]}")
        seen[key] = name
        check_bindable(name, addr)
