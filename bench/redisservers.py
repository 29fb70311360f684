"""The Redis servers a rate-limit benchmark counts on, as the benchmark's own Procs (so
their CPU is the target's and their stop is checked): one redis-server, or a Redis Cluster
of CLUSTER_MASTERS masters with one replica each; and their script-call counters."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import subprocess
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import benchlib as bl

CLUSTER_MASTERS = 3


def redis_argv(args: argparse.Namespace, port: int, workdir: Path, *extra: str) -> list[str]:
    workdir.mkdir(parents=True, exist_ok=True)
    return [args.redis_server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no", "--logfile", "",
            *extra]


class SingleRedis:
    """One redis-server."""

    def __init__(self, workdir: Path, args: argparse.Namespace) -> None:
        port = bl.free_port()
        self.procs = [bl.Proc("redis-server", redis_argv(args, port, workdir),
                              workdir / "redis.log")]
        self.url = f"redis://127.0.0.1:{port}/0"
        self.masters = [port]

    def setup(self, args: argparse.Namespace) -> None:
        del args

    def expected(self, requests: int) -> dict[str, float]:
        del requests
        return {}


class RedisCluster:
    """CLUSTER_MASTERS masters with one replica each, made with `redis-cli --cluster create`
    as sitsmesh.dev.rediscluster does, but as bench Procs (CPU split, clean stop).
    Redis's default node timeout (15 s): a loaded 2-core machine must not see a failover."""

    def __init__(self, workdir: Path, args: argparse.Namespace, tags: list[str]) -> None:
        self.ports = [_cluster_port() for _ in range(2 * CLUSTER_MASTERS)]
        self.procs = [bl.Proc(f"redis-cluster-{n}", redis_argv(
            args, port, workdir / f"cluster-{port}", "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf"), workdir / f"cluster-{port}.log")
            for n, port in enumerate(self.ports)]
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self.tags = tags  # the hash tag of each load's counter
        self.masters: list[int] = []
        self.tag_master: list[int] = []  # the master of each tag's slot, as tags

    def setup(self, args: argparse.Namespace) -> None:
        import redis as redis_py

        cli = shutil.which("redis-cli")
        if cli is None:
            raise bl.BenchError("redis-cli not found (apt-get install -y redis-tools)")
        for port, proc in zip(self.ports, self.procs, strict=True):
            bl.wait_until(partial(_pings, proc, port), args.ready_timeout,
                          f"redis cluster node {port}")
        created = subprocess.run([cli, "--cluster", "create",
                                  *(f"127.0.0.1:{p}" for p in self.ports),
                                  "--cluster-replicas", "1", "--cluster-yes"],
                                 capture_output=True, text=True, timeout=args.ready_timeout,
                                 check=False)
        if created.returncode:
            raise bl.BenchError(f"redis-cli --cluster create failed:\n{created.stdout}"
                                f"{created.stderr}")
        bl.wait_until(self.healthy, args.ready_timeout, "redis cluster ok on every node")
        with redis_py.Redis(host="127.0.0.1", port=self.ports[0], socket_timeout=5) as client:
            ranges = [(int(lo), int(hi), int(master[1]))
                      for lo, hi, master, *_ in client.execute_command("CLUSTER", "SLOTS")]
            slots = [int(client.execute_command("CLUSTER", "KEYSLOT", tag))
                     for tag in self.tags]
        self.masters = sorted({port for _, _, port in ranges})
        self.tag_master = [next(port for lo, hi, port in ranges if lo <= slot <= hi)
                            for slot in slots]
        if len(self.masters) != CLUSTER_MASTERS:
            raise bl.BenchError(f"expected {CLUSTER_MASTERS} masters, got {ranges}")

    def healthy(self) -> bool:
        """Every node says the cluster is ok, and every replica is in sync."""
        import redis as redis_py

        try:
            for port in self.ports:
                with redis_py.Redis(host="127.0.0.1", port=port, decode_responses=True,
                                    socket_timeout=1) as client:
                    if "cluster_state:ok" not in str(client.execute_command("CLUSTER", "INFO")):
                        return False
                    role = client.info("replication")
                    if role["role"] == "slave" and role.get("master_link_status") != "up":
                        return False
        except (redis_py.RedisError, OSError):
            return False
        return True

    def expected(self, requests: int) -> dict[str, float]:
        """Each master's EVALSHA growth: the requests of the loads whose counter it holds
        (one load per tag, a round split among them as run_h2load does)."""
        want = {f"redis evalsha calls on :{port}": 0.0 for port in self.masters}
        for port, count in zip(self.tag_master,
                               bl.split_requests(requests, len(self.tags)), strict=True):
            want[f"redis evalsha calls on :{port}"] += count
        return want


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too, so at most 55535."""
    for _ in range(1000):
        port = bl.free_port()
        if port <= 55535:
            with contextlib.suppress(OSError), socket.socket() as bus:
                bus.bind(("127.0.0.1", port + 10000))
                return port
    raise bl.BenchError("no free port pair for a redis cluster node")


def _pings(proc: bl.Proc, port: int) -> bool:
    import redis as redis_py

    proc.check_alive()
    try:
        with redis_py.Redis(host="127.0.0.1", port=port, socket_timeout=1) as client:
            return bool(client.ping())
    except (redis_py.RedisError, OSError):
        return False


def redis_calls(ports: Sequence[int]) -> dict[str, float]:
    """Script calls the redis-servers on `ports` have executed (INFO commandstats), each and
    summed; their open connections and socket reads, summed."""
    import redis as redis_py

    out = {"redis evalsha calls": 0.0, "redis eval calls": 0.0, "redis connected clients": 0.0,
           "redis reads": 0.0}
    for port in ports:
        client = redis_py.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        try:
            info: dict[str, Any] = client.info("commandstats")
            clients: dict[str, Any] = client.info("clients")
            stats: dict[str, Any] = client.info("stats")
        except redis_py.RedisError as exc:
            raise bl.BenchError(f"cannot read redis-server INFO on {port}: {exc}") from exc
        finally:
            client.close()
        for cmd in ("evalsha", "eval"):
            calls = float(info.get(f"cmdstat_{cmd}", {}).get("calls", 0))
            out[f"redis {cmd} calls"] += calls
            out[f"redis {cmd} calls on :{port}"] = calls
        out["redis connected clients"] += float(clients["connected_clients"]) - 1  # minus us
        # Socket reads the server made: a batch sent in one write arrives in about one.
        out["redis reads"] += float(stats["total_reads_processed"])
    return out
