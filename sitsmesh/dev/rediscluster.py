"""A real Redis Cluster for tests and benchmarks: N masters, each with one replica, on
loopback ports, made with `redis-cli --cluster create` as an operator would.

The node timeout is 1 s (Redis's default is 15 s), so a killed master's replica
takes over within a few seconds and a failover test stays short.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import redis

from sitsmesh.dev import harness
from sitsmesh.dev.redis import ping, redis_server_binary

NODE_TIMEOUT_MS = 1000
BUS_OFFSET = 10000  # Redis's cluster bus listens here, above the node's port


def _free_node_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too: a node whose bus
    port is taken exits at start."""
    for _ in range(100):
        port = harness.free_port()
        if port + BUS_OFFSET >= 65536:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port + BUS_OFFSET))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a redis cluster node")


class RedisClusterNodes:
    """`masters` masters and as many replicas; `ports` in creation order (masters first,
    as `redis-cli --cluster create` assigns them)."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.workdir = workdir
        self.masters = masters
        self.ports = [_free_node_port() for _ in range(2 * masters)]
        self.procs: dict[int, harness.Proc] = {}

    @property
    def url(self) -> str:
        """sitsmesh's redis_url for the cluster, every node a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout: float = 30) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli not found on PATH; install it "
                               "(Debian/Ubuntu: apt-get install -y redis-tools)")
        for port in self.ports:
            self._spawn(port)
        subprocess.run([cli, "--cluster", "create",
                        *(f"127.0.0.1:{p}" for p in self.ports),
                        "--cluster-replicas", "1", "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout)
        harness.wait_until(self.healthy, timeout, "redis cluster ok on every node")

    def _spawn(self, port: int) -> None:
        workdir = self.workdir / str(port)
        workdir.mkdir(parents=True, exist_ok=True)
        argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(workdir),
                "--daemonize", "no", "--logfile", "", "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                # As README "Redis Cluster" advises: a dead master stops only its own
                # slots, not every master's, while its replica takes over.
                "--cluster-require-full-coverage", "no"]
        proc = harness.spawn(argv, workdir / "redis.log")
        self.procs[port] = proc

        def up() -> bool:
            if proc.proc.poll() is not None:
                raise RuntimeError(f"redis cluster node {port} exited "
                                   f"{proc.proc.returncode}:\n{proc.output()}")
            return ping(port)

        harness.wait_until(up, 10, f"redis cluster node {port}")

    def info(self, port: int, section: str) -> dict[str, str]:
        with redis.Redis(host="127.0.0.1", port=port, decode_responses=True,
                         socket_timeout=1) as client:
            if section == "cluster":
                text = str(client.execute_command("CLUSTER", "INFO"))
                return dict(line.split(":", 1) for line in text.split() if ":" in line)
            return {k: str(v) for k, v in client.info(section).items()}

    def live_ports(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.proc.poll() is None]

    def healthy(self) -> bool:
        """Every live node says the cluster is ok, and every live replica is in sync."""
        try:
            for port in self.live_ports():
                if self.info(port, "cluster").get("cluster_state") != "ok":
                    return False
                role = self.info(port, "replication")
                if role.get("role") == "slave" and role.get("master_link_status") != "up":
                    return False
        except (redis.RedisError, OSError):
            return False
        return True

    def master_of(self, key: str) -> int:
        """The port of the master that serves `key`'s slot now."""
        port = self.live_ports()[0]
        with redis.Redis(host="127.0.0.1", port=port, decode_responses=True) as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        raise RuntimeError(f"no master serves slot {slot}")

    def flush(self) -> None:
        """Empty every master (a test's fresh start on the shared cluster)."""
        for port in self.live_ports():
            with redis.Redis(host="127.0.0.1", port=port) as client:
                if client.info("replication").get("role") == "master":
                    client.flushall()

    def kill(self, port: int) -> None:
        """A crash: SIGKILL, no goodbye to the other nodes."""
        self.procs[port].kill()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()


@contextlib.contextmanager
def redis_cluster(workdir: Path, masters: int = 3) -> Iterator[RedisClusterNodes]:
    nodes = RedisClusterNodes(workdir, masters)
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()
