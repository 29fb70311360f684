"""sitsmesh beside a scenario's stages, and one variant's run through a fresh Envoy.

| variant | entry listener's filters | sitsmesh thresholds policy |
|---|---|---|
| no control | ext_authz, access_log, router | off (never sheds) |
| adaptive_concurrency | ext_authz, adaptive_concurrency, access_log, router | off |
| seed | ext_authz, access_log, router | seed (priority-blind queue-depth cap) |
| sitsmesh | ext_authz, access_log, router | sitsmesh |

Every variant authenticates through sitsmesh, logs every hop to it and pushes
Envoy's stats to it; only the admission decision differs. One sitsmesh serves all
variants of a scenario (as one would in production, it keeps what it learned).

With `replicas` N >= 2 that sitsmesh is N `sitsmesh serve` processes sharing one
SQLite state dir and, through one redis-server, the controller (a lease: the leader
decides, the others apply its published decision), admission holds and latency-chain
hops (--shared-runtime redis). Admin calls and WatchPressure go to the first replica;
every Envoy lists all replicas as endpoints of its sitsmesh cluster. A variant run on
N replicas is keyed `<key>-xN` and labelled `<label> xN`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import load
import topology
from prometheus_client.parser import text_string_to_metric_families
from scenarios import Backend

from sitsmesh.admin.enums import word
from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness
from sitsmesh.dev.redis import redis_server

NONE, ADAPTIVE, SEED, SITSMESH = "none", "adaptive", "seed", "sitsmesh"


class BenchError(Exception):
    """Something could not be started, or a variant could not be run."""


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    policy: str      # sitsmesh thresholds policy
    adaptive: bool   # Envoy with the adaptive_concurrency filter
    replicas: int = 1  # sitsmesh serve processes behind every Envoy


VARIANTS = {v.key: v for v in (
    Variant(NONE, "no control", "off", False),
    Variant(ADAPTIVE, "adaptive_concurrency", "off", True),
    Variant(SEED, "seed", "seed", False),
    Variant(SITSMESH, "sitsmesh", "sitsmesh", False),
)}


MAX_REPLICAS = 4


def replicated(variant: Variant, replicas: int) -> Variant:
    """The variant run on `replicas` sitsmesh processes (itself for one)."""
    if replicas == 1:
        return variant
    return Variant(f"{variant.key}-x{replicas}", f"{variant.label} x{replicas}",
                   variant.policy, variant.adaptive, replicas)


def base_key(key: str) -> str:
    """The variant a (possibly replicated) key names: "sitsmesh-x2" -> "sitsmesh"."""
    return key.split("-x", 1)[0]


@dataclass
class Stack:
    tmp: Path
    backend: Backend
    node: harness.Sitsmesh   # admin calls and WatchPressure go here
    key: str
    nodes: list[harness.Sitsmesh] = field(default_factory=list)  # every replica

    @property
    def replicas(self) -> int:
        return len(self.nodes)


def _start_nodes(tmp: Path, backend: Backend, exits: contextlib.ExitStack,
                 replicas: int, tag: str) -> list[harness.Sitsmesh]:
    if replicas == 1:
        node = harness.start_sitsmesh(tmp, *backend.sitsmesh_args, name=f"sitsmesh{tag}")
        exits.callback(node.kill)
        return [node]
    prefix = f"sitsmesh-x{replicas}{tag}"
    redis = exits.enter_context(redis_server(tmp / f"redis-x{replicas}{tag}"))
    shared = ("--shared-runtime", "redis", "--redis-url", redis.url)
    nodes = []
    # One after the other: the first creates the admin token the others read.
    for name in "abcd"[:replicas]:
        node = harness.start_sitsmesh(tmp, *backend.sitsmesh_args, *shared,
                                      name=f"{prefix}-{name}", state_dir=tmp / f"{prefix}-state")
        exits.callback(node.kill)
        nodes.append(node)
    return nodes


def start_sitsmesh(tmp: Path, backend: Backend, exits: contextlib.ExitStack,
                   replicas: int = 1, tag: str = "") -> Stack:
    """`tag` sets a sitsmesh apart from the scenario's others (its logs, its state)."""
    if not 1 <= replicas <= MAX_REPLICAS:
        raise BenchError(f"replicas must be within 1..{MAX_REPLICAS}, not {replicas}")
    nodes = _start_nodes(tmp, backend, exits, replicas, tag)
    node = nodes[0]
    (tmp / "pipeline.yaml").write_text(backend.pipeline_yaml())
    steps = (("pipelines", "apply", str(tmp / "pipeline.yaml")),
             ("tenants", "create", "acme", "--models", "*", "--priority", "0",
              "--max-priority", "9"))
    for args in steps:
        done = node.cli(*args)
        if done.returncode != 0:
            raise BenchError(f"sitsmesh {' '.join(args[:2])} failed: {done.stderr}")
    made = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
    if made.returncode != 0:
        raise BenchError(f"sitsmesh apikeys create failed: {made.stderr}")
    stack = Stack(tmp, backend, node, str(json.loads(made.stdout)["key"]), nodes)
    set_policy(stack, "off")
    return stack


def pressure_once(stack: Stack, node: harness.Sitsmesh | None = None
                  ) -> admin_pb2.PipelinePressure:
    return (node or stack.node).pressure(stack.backend.pipeline)


def _pressure_is(stack: Stack, test: Callable[[admin_pb2.PipelinePressure], bool],
                 node: harness.Sitsmesh | None = None) -> bool:
    """A poll for wait_until: a WatchPressure that fails or is slow counts as "not yet"
    (as does a replica that does not know the pipeline yet)."""
    try:
        return test(pressure_once(stack, node))
    except grpc.RpcError:
        return False


def set_policy(stack: Stack, policy: str) -> None:
    path = stack.tmp / f"thresholds-{policy}.yaml"
    path.write_text(stack.backend.thresholds_yaml(policy))
    done = stack.node.cli("thresholds", "set", stack.backend.pipeline, str(path))
    if done.returncode != 0:
        raise BenchError(f"sitsmesh thresholds set ({policy}) failed: {done.stderr}")
    # Every replica: the others read the thresholds from the shared state store.
    try:
        def applied(p: admin_pb2.PipelinePressure) -> bool:
            return word(admin_pb2.PressurePolicy, p.policy) == policy

        harness.wait_until(lambda: all(_pressure_is(stack, applied, n) for n in stack.nodes), 20,
                           f"sitsmesh to apply policy {policy}", interval=0.1)
    except TimeoutError as exc:
        raise BenchError(str(exc)) from exc


def wait_drained(stack: Stack, timeout: float = 180.0) -> float:
    """Seconds until nothing is queued in the stages (and stays so for 0.5 s): the
    backlog a variant left behind drains before the next one starts."""
    began = time.monotonic()
    try:
        for _ in range(2):
            harness.wait_until(lambda: stack.backend.queued() == 0, timeout,
                               "the stages' queues to drain", interval=0.2)
            time.sleep(0.5)
    except TimeoutError as exc:
        raise BenchError(str(exc)) from exc
    return time.monotonic() - began


class Recorder:
    """sitsmesh's decisions (WatchPressure, every tick) and, for adaptive_concurrency,
    Envoy's gradient-controller gauges, with monotonic receive times."""

    def __init__(self, stack: Stack, envoy: harness.Envoy | None) -> None:
        self.stack, self.envoy = stack, envoy
        self.pressure: list[tuple[float, dict[str, Any]]] = []
        self.envoy_stats: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._channel = grpc.insecure_channel(stack.node.admin_addr)
        self._call: Any = None
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Recorder:
        stub = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._call = stub.WatchPressure(
            admin_pb2.WatchPressureRequest(pipeline=self.stack.backend.pipeline),
            metadata=self.stack.node.admin_metadata(), timeout=600)
        self._threads = [threading.Thread(target=self._watch, daemon=True)]
        if self.envoy is not None:
            self._threads.append(threading.Thread(target=self._poll_envoy, daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        for thread in self._threads:
            thread.join(5)
        self._channel.close()

    def _watch(self) -> None:
        name, bottleneck = self.stack.backend.pipeline, self.stack.backend.bottleneck
        with contextlib.suppress(grpc.RpcError):
            for snapshot in self._call:
                now = time.monotonic()
                for p in snapshot.pipelines:
                    if p.pipeline != name:
                        continue
                    stage = next((s for s in p.stages if s.name == bottleneck), None)
                    self.pressure.append((now, {
                        "policy": word(admin_pb2.PressurePolicy, p.policy),
                        "fraction": p.fraction, "cutoff": p.cutoff,
                        "concurrency": p.concurrency,
                        "level": word(admin_pb2.PressureLevel, p.level),
                        "bottleneck": p.bottleneck, "lam": p.arrival_rate,
                        "in_flight": p.in_flight, "shed_total": p.shed_total,
                        "wait_ms": p.entry_wait_ms, "waiting": p.entry_waiting,
                        "mu": stage.capacity if stage else 0.0,
                        "queue": stage.queue if stage else 0.0,
                        "rt99_ms": stage.rt99_ms if stage else 0.0,
                        "stage_level": (word(admin_pb2.PressureLevel, stage.level)
                                        if stage else "")}))

    def _poll_envoy(self) -> None:
        assert self.envoy is not None
        while not self._stop.wait(0.2):
            try:
                text = self.envoy.admin_get("/stats?filter=gradient_controller")
            except OSError:
                continue
            values: dict[str, float] = {}
            for line in text.splitlines():
                stat, _, value = line.partition(": ")
                with contextlib.suppress(ValueError):
                    values[stat.rsplit(".", 1)[-1]] = float(value)
            self.envoy_stats.append((time.monotonic(), values))


@dataclass
class ReplicaShare:
    """What one replica got of a run: Envoy's calls to it (every Check, plus one per
    access-log or stats stream), the streams still open on it at the end (Envoy's
    access-log and stats streams), the sheds its gate answered, and whether it ever
    took the controller's lease."""

    name: str
    calls: int
    streams: int
    sheds: int
    leading: bool


@dataclass
class VariantRun:
    variant: Variant
    flush: str
    results: list[load.Result]
    t0: float
    drained_s: float          # after the load, until the stages' queues were empty
    settled_s: float | None   # before it, until sitsmesh admitted everything
    pressure: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    envoy_stats: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    replicas: list[ReplicaShare] = field(default_factory=list)  # with 2 or more


def _sheds(node: harness.Sitsmesh) -> float:
    return sum(sample.value for family in text_string_to_metric_families(node.metrics())
               for sample in family.samples if sample.name == "sitsmesh_shed_total")


def _shares(stack: Stack, envoy: harness.Envoy, before: list[float]) -> list[ReplicaShare]:
    hosts: dict[str, dict[str, int]] = {}
    prefix = f"{topology.SITSMESH_CLUSTER}::"
    for line in envoy.admin_get("/clusters").splitlines():
        parts = line.split("::")  # cluster::host:port::stat::value, or a cluster-wide line
        if line.startswith(prefix) and len(parts) == 4 and parts[2] in ("rq_total", "rq_active"):
            hosts.setdefault(parts[1], {})[parts[2]] = int(parts[3])
    out = []
    for node, sheds in zip(stack.nodes, before, strict=True):
        host = hosts.get(node.data_addr, {})
        out.append(ReplicaShare(node.log_path.stem, host.get("rq_total", 0),
                                host.get("rq_active", 0), round(_sheds(node) - sheds),
                                '"leading"' in node.output()))
    return out


def _envoy(stack: Stack, name: str, flush: str, adaptive: bool) -> harness.Envoy:
    try:
        return topology.start_envoy(stack.tmp, name, [n.data_addr for n in stack.nodes],
                                    stack.backend.hops, access_log_flush=flush,
                                    adaptive=adaptive)
    except RuntimeError as exc:  # Envoy exited: a setup failure of this variant
        raise BenchError(f"envoy ({name}): {str(exc)[-2000:]}") from None


def _sanity(stack: Stack, envoy: harness.Envoy, timeout: float) -> None:
    # High priority: never shed, so a 429 here is a broken path, not the controller.
    port = envoy.listen_port
    status, code, _ = asyncio.run(load.call(
        port, stack.backend.spec.payload(port, stack.key, load.HIGH), timeout))
    if status != 200:
        raise BenchError(f"sanity request through Envoy got {status} {code!r}")


def wait_admitting(stack: Stack, timeout: float = 30.0) -> float | None:
    """Seconds until sitsmesh admits every priority again (None if it did not within
    `timeout`): each variant starts from a calm controller, not the last one's overload."""
    began = time.monotonic()
    try:
        harness.wait_until(lambda: _pressure_is(stack, lambda p: p.fraction >= 1.0), timeout,
                           "sitsmesh to admit everything", interval=0.1)
    except TimeoutError:
        return None
    return time.monotonic() - began


def flush_seconds(flush: str) -> float:
    """Envoy's duration text ("0.02s", "1s") in seconds."""
    if not flush.endswith("s"):
        raise ValueError(f"flush interval {flush!r}: write seconds, like 0.02s or 1s")
    return float(flush[:-1])


def measure_capacity(stack: Stack, workers: int, seconds: float,
                     timeout: float) -> tuple[float, float]:
    """Closed loop through a no-control Envoy: (completions/s, median latency ms)."""
    set_policy(stack, "off")
    wait_drained(stack)
    name = "capacity" if stack.replicas == 1 else f"capacity-x{stack.replicas}"
    envoy = _envoy(stack, name, "0.02s", adaptive=False)
    try:
        _sanity(stack, envoy, timeout)
        n, latencies, failed = asyncio.run(load.closed_loop(
            envoy.listen_port, stack.key, stack.backend.spec, workers, 1.0, seconds, timeout))
        _settle(stack, "0.02s")
    finally:
        envoy.kill()
    if failed or not n:
        raise BenchError(f"capacity run: {failed} requests failed, {n} completed")
    return n / seconds, sorted(latencies)[len(latencies) // 2] * 1000


def _settle(stack: Stack, flush: str) -> float:
    """Drain with Envoy still up, then wait out a flush: Envoy must live until it has sent
    every access-log entry, or sitsmesh would hold the lost ones as in flight."""
    drained = wait_drained(stack)
    time.sleep(flush_seconds(flush) + 0.5)
    return drained


def run_variant(stack: Stack, variant: Variant, flush: str,
                plan: Sequence[tuple[float, int]], timeout: float) -> VariantRun:
    set_policy(stack, variant.policy)
    wait_drained(stack)
    name = f"{stack.backend.pipeline}-{variant.key}-{flush}"
    envoy = _envoy(stack, name, flush, variant.adaptive)
    try:
        _sanity(stack, envoy, timeout)
        settled = wait_admitting(stack)
        time.sleep(0.5)
        before = [_sheds(n) for n in stack.nodes] if stack.replicas > 1 else []
        t0_box: list[float] = []
        with Recorder(stack, envoy if variant.adaptive else None) as recorder:
            results = asyncio.run(load.open_loop(envoy.listen_port, stack.key,
                                                 stack.backend.spec, plan, timeout, t0_box))
        drained = _settle(stack, flush)
        if envoy.proc.poll() is not None:
            raise BenchError(f"envoy ({name}) died during the run")
        shares = _shares(stack, envoy, before) if before else []
    finally:
        envoy.kill()
    return VariantRun(variant, flush, results, t0_box[0], drained, settled,
                      recorder.pressure, recorder.envoy_stats, shares)
