"""A real redis-server for tests and benchmarks: loopback only, no persistence, restartable
on its port.

The server runs in its own session (see harness.spawn), so teardown kills it
even when a test failed half-way.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

from sitsmesh.dev import harness


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        # Fail loudly: a silent skip would hide that CI stopped testing the Redis store.
        raise RuntimeError("redis-server not found on PATH; install it "
                           "(Debian/Ubuntu: apt-get install -y redis-server)")
    return path


def ping(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server; `port` stays the same across restarts."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.binary = redis_server_binary()
        self.workdir = workdir
        self.port = port or harness.free_port()
        self.proc: harness.Proc | None = None
        self._starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None

    def start(self, timeout: float = 10) -> None:
        if self.running:
            raise RuntimeError(f"redis-server already running on port {self.port}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--daemonize", "no", "--logfile", ""]
        self._starts += 1
        proc = harness.spawn(argv, self.workdir / f"redis-{self._starts}.log")
        self.proc = proc

        def up() -> bool:
            if proc.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited {proc.proc.returncode}:\n"
                                   f"{proc.output()}")
            return ping(self.port)

        try:
            harness.wait_until(up, timeout, f"redis-server on port {self.port}")
        except BaseException:
            proc.kill()
            raise

    def stop(self, timeout: float = 10) -> None:
        """Graceful: SIGTERM, then the process group is killed whatever happened."""
        if self.proc is not None:
            self.proc.stop(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """Abrupt, like a crash: SIGKILL to the process group."""
        if self.proc is not None:
            self.proc.kill()

    def restart(self, timeout: float = 10) -> None:
        self.kill()
        self.start(timeout)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open and nothing answers."""
        if self.proc is not None:
            self.proc.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.proc.send_signal(signal.SIGCONT)


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        # A paused server ignores SIGTERM until continued; SIGKILL does not care.
        server.kill()
