"""A real, throwaway PostgreSQL cluster for tests and benchmarks: loopback only,
restartable on its port.

PostgreSQL refuses to run as root, so as root initdb and the server run as the
`postgres` user (runuser), in a temp dir it owns: pytest's own temp dirs are
private to root. The server runs in its own session (harness.spawn), so teardown
kills it and its backends even when a test failed half-way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg

from sitsmesh.dev import harness

USER = "postgres"


def bin_dir() -> Path:
    """Debian keeps the server tools in /usr/lib/postgresql/N/bin, off PATH."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit()
                   else 0)
    if found:
        return found[-1].parent
    on_path = shutil.which("pg_ctl")
    if on_path is None:
        # Fail loudly: a silent skip would hide that CI stopped testing PostgreSQL.
        raise RuntimeError("PostgreSQL server not found; install it "
                           "(Debian/Ubuntu: apt-get install -y postgresql)")
    return Path(on_path).resolve().parent


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            # Field 4 is the parent pid; the command (field 2) may hold spaces, so split
            # after its closing parenthesis.
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _as_postgres(argv: list[str]) -> list[str]:
    return ["runuser", "-u", USER, "--", *argv] if os.geteuid() == 0 else argv


class PostgresServer:
    """One cluster; `port` and the data stay the same across restarts."""

    def __init__(self, port: int | None = None, *, fsync: bool = True) -> None:
        self.bin = bin_dir()
        self.port = port or harness.free_port()
        self.fsync = fsync
        self.root = Path(tempfile.mkdtemp(prefix="sitsmesh-pg-"))
        self.data = self.root / "data"
        self.proc: harness.Proc | None = None
        self._starts = 0
        if os.geteuid() == 0:
            shutil.chown(self.root, USER, USER)
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", USER, "-A", "trust",
                   "-E", "UTF8", "--locale=C", "--no-sync"])

    def _run(self, argv: list[str]) -> None:
        done = subprocess.run(_as_postgres(argv), capture_output=True, text=True, check=False,
                              cwd=self.root, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} exited {done.returncode}:\n{done.stdout}"
                               f"{done.stderr}")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{dbname}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None

    def ready(self) -> bool:
        try:
            with psycopg.connect(self.url(), connect_timeout=1):
                return True
        except psycopg.Error:
            return False

    def start(self, timeout: float = 30) -> None:
        if self.running:
            raise RuntimeError(f"postgres already running on port {self.port}")
        argv = [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
                "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.root}",
                "-c", f"fsync={'on' if self.fsync else 'off'}", "-c", "max_connections=200"]
        self._starts += 1
        log = self.root / f"postgres-{self._starts}.log"
        with log.open("wb") as out:
            # The server is our own child (no runuser in between), so kill() reaps the
            # postmaster itself and a restart never finds its pid still taken.
            proc = harness.Proc(subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                cwd=self.root, user=USER if os.geteuid() == 0 else None), log)
        self.proc = proc

        def up() -> bool:
            if proc.proc.poll() is not None:
                raise RuntimeError(f"postgres exited {proc.proc.returncode}:\n{proc.output()}")
            return self.ready()

        try:
            harness.wait_until(up, timeout, f"postgres on port {self.port}")
        except BaseException:
            proc.kill()
            raise

    def stop(self, timeout: float = 30) -> None:
        """Fast shutdown (SIGINT to the postmaster): sessions end, commits are on disk."""
        if self.running:
            self._run([str(self.bin / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast",
                       "-w", "-t", str(int(timeout))])
        if self.proc is not None:
            self.proc.stop(signal.SIGINT, timeout)

    def _signal_all(self, sig: int) -> None:
        """`sig` to the postmaster and its children: backends call setsid(), so a signal
        to the postmaster's process group reaches the postmaster only."""
        if not self.running or self.proc is None:
            return
        pids = [self.proc.proc.pid, *_children(self.proc.proc.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill(self) -> None:
        """Abrupt, like a crash: SIGKILL to the server and every backend."""
        self._signal_all(signal.SIGKILL)
        if self.proc is not None:
            self.proc.kill()

    def pause(self) -> None:
        """Freeze the server and its backends (SIGSTOP): sockets stay open, nothing answers."""
        self._signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_all(signal.SIGCONT)

    def restart(self, timeout: float = 30) -> None:
        self.stop(timeout)
        self.start(timeout)

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def remove(self) -> None:
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def postgres_server(*, fsync: bool = True) -> Iterator[PostgresServer]:
    server = PostgresServer(fsync=fsync)
    try:
        server.start()
        yield server
    finally:
        server.remove()
