"""The pipelines under overload, each with its bottleneck at a different place:

- `triton`: one Envoy hop to a real Triton model (the demo model, fixed service time,
  ONE CPU instance): sitsmesh scrapes Triton's /metrics and reads the instance count;
- `twohop`: entry hop -> `pre` (a fast plain HTTP stage) -> second Envoy hop -> `svc`, a
  plain HTTP stage with `--parallelism` workers and `--service-ms` (1 and 20 ms: 50 rps),
  no Triton metrics: Envoy's own per-cluster gauges and the access logs are all there is;
- `fanout`: entry -> `pre` -> `feat`, which calls `model` `--fanout` N times in parallel
  (the bottleneck: N workers, `--service-ms`, so N / 20 ms / N calls = 50 pipeline
  requests/s whatever N) and then `post`.

The plain stages are sitsmesh.dev.stagesvc services in this process; each hop is a
listener of the variant's Envoy (topology.py) whose cluster is named after its stage.
The thresholds an SRE would set are the only ones set: the policy and, for plain
stages, `parallelism` (and `fanout` on the fanned-out stage) — what Triton cannot tell.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import tritonclient.grpc as triton_grpc
import yaml
from load import RequestSpec, hinted_spec, kserve_spec
from topology import Hop

from sitsmesh.dev import demo_model, harness
from sitsmesh.dev import stagesvc as stages
from sitsmesh.dev.triton import TritonServer

MODEL = "lazy"
# The hinted scenarios enter through POST /pipeline, a non-model path, and name their
# pipeline in x-sits-pipeline-hint: both are refused or ignored unless allowed.
HINTED_ARGS = ("--authz-open-paths", "/pipeline", "--authz-trust-pipeline-hint", "true")
FAST_MS, FAST_WORKERS = 1.0, 8  # pre, feat and post: capacity far above the bottleneck


@dataclass(frozen=True)
class Options:
    service_ms: float
    distribution: str   # of the plain bottleneck stages' service times: stagesvc.DISTRIBUTIONS
    sla_ms: float
    seed: int
    fanout: int = 2     # calls from feat to model per request (the fanout scenario)


@dataclass
class Backend:
    """A scenario's stages, started; what the rest of the bench needs to know of them."""

    pipeline: str
    hops: list[Hop]
    spec: RequestSpec
    bottleneck: str
    nominal_rps: float                     # parallelism / service time of the bottleneck
    stages: list[dict[str, object]]        # the pipeline document's stages
    thresholds: dict[str, dict[str, int]]  # per-stage thresholds an SRE sets
    queued: Callable[[], float]            # requests still inside the stages
    describe: str
    models: list[str] = field(default_factory=list)
    sitsmesh_args: tuple[str, ...] = ()
    # Pipeline-wide thresholds the sitsmesh policy gets besides the stages' (--entry-wait-ms).
    top: dict[str, object] = field(default_factory=dict)

    def pipeline_yaml(self) -> str:
        doc: dict[str, object] = {"name": self.pipeline, "stages": self.stages}
        if self.models:
            doc["models"] = self.models
        return yaml.safe_dump(doc, sort_keys=False)

    def thresholds_yaml(self, policy: str) -> str:
        return yaml.safe_dump(self._thresholds(policy), sort_keys=False)

    def thresholds_flow(self, policy: str) -> str:
        """The same document on one line, for the report."""
        return yaml.safe_dump(self._thresholds(policy), sort_keys=False,
                              default_flow_style=True, width=1000).strip()

    def _thresholds(self, policy: str) -> dict[str, object]:
        doc: dict[str, object] = {"policy": policy}
        if policy == "sitsmesh":
            doc.update(self.top)
        if self.thresholds:
            # Copies: stages sharing one dict would be dumped as YAML aliases, which
            # sitsmesh's config loader refuses.
            doc["stages"] = {name: dict(t) for name, t in self.thresholds.items()}
        return doc


def _stage(name: str, opts: Options, **extra: str) -> dict[str, object]:
    return {"name": name, "match": {"upstream_cluster": name}, "sla_p99_ms": opts.sla_ms,
            **extra}


def _ports(*listeners: str) -> dict[str, int]:
    return {name: harness.free_port() for name in listeners}


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def _in_flight(*svcs: stages.StageService) -> Callable[[], float]:
    return lambda: float(sum(s.stats().in_flight for s in svcs))


def triton(tmp: Path, exits: contextlib.ExitStack, opts: Options) -> Backend:
    repo = tmp / "models"
    demo_model.write_lazy_model(repo, MODEL, [1], context_ms=opts.service_ms,
                                service_ms=opts.service_ms)
    server = TritonServer(tmp / "triton", repo)
    exits.callback(server.kill)
    server.start(timeout=60)
    client = triton_grpc.InferenceServerClient(server.grpc_url)
    try:
        client.load_model(MODEL)
        version = str(client.get_server_metadata().version)
    finally:
        client.close()

    def pending() -> float:
        return harness.metric_value(server.metrics(), "nv_inference_pending_request_count",
                                    model=MODEL)

    listen = _ports("L1")
    return Backend(
        pipeline="triton", hops=[Hop("L1", "model", listen["L1"], server.http_port)],
        spec=kserve_spec(MODEL), bottleneck="model", nominal_rps=1000 / opts.service_ms,
        stages=[_stage("model", opts, triton_model=MODEL)], thresholds={},
        queued=pending, models=[MODEL],
        sitsmesh_args=("--triton-url", server.grpc_url,
                       "--triton-metrics-url", server.metrics_url),
        describe=(f"tritonserver {version}, demo model {opts.service_ms:g} ms fixed, "
                  "1 instance, one Envoy hop"))


def twohop(tmp: Path, exits: contextlib.ExitStack, opts: Options) -> Backend:
    del tmp
    listen = _ports("L1", "L2")
    svc = exits.enter_context(stages.stage_service(
        name="svc", parallelism=1, service_ms=opts.service_ms,
        distribution=opts.distribution, seed=opts.seed))
    pre = exits.enter_context(stages.stage_service(
        name="pre", parallelism=FAST_WORKERS, service_ms=FAST_MS,
        forward_to=[_url(listen["L2"])]))
    return Backend(
        pipeline="twohop",
        hops=[Hop("L1", "pre", listen["L1"], pre.port),
              Hop("L2", "svc", listen["L2"], svc.port)],
        spec=hinted_spec("twohop"), sitsmesh_args=HINTED_ARGS,
        bottleneck="svc", nominal_rps=svc.capacity_rps,
        stages=[_stage("pre", opts), _stage("svc", opts)],
        thresholds={"pre": {"parallelism": FAST_WORKERS}, "svc": {"parallelism": 1}},
        queued=_in_flight(pre, svc),
        describe=(f"entry -> pre ({FAST_WORKERS} workers, {FAST_MS:g} ms) -> second hop -> "
                  f"svc (1 worker, {opts.service_ms:g} ms {opts.distribution})"))


def fanout(tmp: Path, exits: contextlib.ExitStack, opts: Options) -> Backend:
    del tmp
    listen = _ports("L1", "L2", "L3", "L4")
    n = opts.fanout
    model = exits.enter_context(stages.stage_service(
        name="model", parallelism=n, service_ms=opts.service_ms,
        distribution=opts.distribution, seed=opts.seed))
    post = exits.enter_context(stages.stage_service(
        name="post", parallelism=FAST_WORKERS, service_ms=FAST_MS))
    feat = exits.enter_context(stages.stage_service(
        name="feat", parallelism=FAST_WORKERS, service_ms=FAST_MS,
        forward_to=[stages.Hop(_url(listen["L3"]), fanout=n), _url(listen["L4"])]))
    pre = exits.enter_context(stages.stage_service(
        name="pre", parallelism=FAST_WORKERS, service_ms=FAST_MS,
        forward_to=[_url(listen["L2"])]))
    fast = {"parallelism": FAST_WORKERS}
    return Backend(
        pipeline="fanout",
        hops=[Hop("L1", "pre", listen["L1"], pre.port),
              Hop("L2", "feat", listen["L2"], feat.port),
              Hop("L3", "model", listen["L3"], model.port),
              Hop("L4", "post", listen["L4"], post.port)],
        spec=hinted_spec("fanout"), sitsmesh_args=HINTED_ARGS,
        bottleneck="model", nominal_rps=model.capacity_rps / n,
        stages=[_stage(name, opts) for name in ("pre", "feat", "model", "post")],
        thresholds={"pre": fast, "feat": fast, "model": {"parallelism": n, "fanout": n},
                    "post": fast},
        queued=_in_flight(pre, feat, model, post),
        describe=(f"entry -> pre -> feat -> {n} x model ({n} workers, {opts.service_ms:g} ms "
                  f"{opts.distribution}, the bottleneck) then post; fast stages "
                  f"{FAST_WORKERS} workers, {FAST_MS:g} ms"))


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    start: Callable[[Path, contextlib.ExitStack, Options], Backend]
    fans_out: bool = False  # --fanout shapes it

    def heading(self, opts: Options) -> str:
        """The title with what the options change in this scenario."""
        shape = f"fan-out {opts.fanout}, " if self.fans_out else ""
        return (self.title if self.key == "triton"
                else f"{self.title} ({shape}{opts.distribution} service times)")

    def tag(self, opts: Options) -> str:
        """The key, with the fan-out where --fanout shapes it: for sub-headings."""
        return f"{self.key} x{opts.fanout}" if self.fans_out else self.key


SCENARIOS = {s.key: s for s in (
    Scenario("triton", "(a) Triton model bottleneck", triton),
    Scenario("twohop", "(b) plain HTTP bottleneck two Envoy hops down", twohop),
    Scenario("fanout", "(c) pipeline with a fan-out stage as the bottleneck", fanout, True),
)}
