"""Dynamic batching on a real Triton: untuned vs the design's hand-picked [8, 16] / 10 ms vs
sitsmesh-tuned, at three arrival rates, in one run.

Everything is started (and stopped) here on free 127.0.0.1 ports in a temporary
directory: one `tritonserver` from the nvidia-pytriton wheel with the batching demo
model (sitsmesh.dev.batch_model: 20 ms per execute plus 0.5 ms per item up to 16 items,
time growing with the items past them; one instance, CPU, the time slept so the curve
holds on a busy 2-core machine).

1. The curve is measured once, as `sitsmesh models profile` measures it
   (sitsmesh.batching.profile over the ModelServer adapter), without dynamic batching.
2. For each rate, sitsmesh's recommendation for that rate and the SLA is computed from
   the curve (sitsmesh.batching.recommend, the same call `models tune` makes).
3. For each round, rate and config (in an order that rotates per round): the model is
   reloaded with the config (warm: the override carries model_warmup, as a sitsmesh swap
   does), five unmeasured requests, then an open-loop Poisson stream of single-item
   requests at the rate for `--seconds` (sitsmesh.dev.tritonload.OpenLoop). After a cell
   whose queue collapsed, Triton is restarted, so the next cell starts empty.

Per cell: offered and completed requests, failures (errors and client timeouts), p50,
p99, and the goodput: requests/s answered within the SLA, and its share of the offered.
Medians over rounds when --rounds > 1.

    .venv/bin/python bench/batching_triton.py [--rates 30,150,300] [--sla-ms 100]
        [--seconds 5] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tritonclient.grpc as triton_grpc

from sitsmesh.batching.curve import Curve, knee
from sitsmesh.batching.profile import ProfilePlan, measure
from sitsmesh.batching.recommend import Batching, batching_of, recommend
from sitsmesh.dev.batch_model import batch_config, write_batch_model
from sitsmesh.dev.triton import TritonServer
from sitsmesh.dev.tritonload import OpenLoop
from sitsmesh.swap.override import SwapOptions, probe_inputs, swap_override, with_versions
from sitsmesh.triton.client import TritonServer as TritonAdapter

MODEL = "bm"
HAND = Batching((8, 16), 10_000)


@dataclass(frozen=True)
class Cell:
    rate: float
    config: str
    batching: str
    offered: int
    completed: int
    failed: int
    p50_ms: float
    p99_ms: float
    goodput: float       # requests/s answered within the SLA
    share: float         # goodput / offered rate


def profile(triton: TritonServer) -> Curve:
    async def run() -> Curve:
        server = TritonAdapter("bench", triton.grpc_url)
        try:
            config = await server.model_config(MODEL)
            return await measure(server, MODEL, probe_inputs(config, SwapOptions()),
                                 ProfilePlan((1, 2, 4, 8, 16, 32), requests=20),
                                 instances=1, max_batch_size=32, endpoint="bench",
                                 source="preflight")
        finally:
            await server.close()

    return asyncio.run(run())


def load(triton: TritonServer, batching: Batching) -> None:
    config = batch_config(MODEL, [1])
    if batching.enabled:
        config["dynamic_batching"] = batching.block()
    client = triton_grpc.InferenceServerClient(triton.grpc_url)
    try:
        client.load_model(MODEL, config=json.dumps(
            with_versions(swap_override(config, SwapOptions()), [1])))
        # Wait for the batcher to be the one asked for (Triton spells int64 as strings).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            served = client.get_model_config(MODEL, as_json=True)["config"]
            if batching_of(served) == batching:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"Triton does not serve {batching.label()}")
    finally:
        client.close()
    with OpenLoop(triton.grpc_url, MODEL, 5.0, 1.0, seed=99):
        pass  # five unmeasured requests or so


def drive(triton: TritonServer, rate: float, seconds: float, sla_s: float, seed: int,
          name: str, batching: Batching) -> Cell:
    with OpenLoop(triton.grpc_url, MODEL, rate, seconds, seed=seed) as stream:
        pass
    done = sorted(stream.latencies)
    within = sum(1 for d in done if d <= sla_s)
    p50 = done[len(done) // 2] * 1000 if done else float("inf")
    return Cell(rate, name, batching.label(), stream.sent, len(done), len(stream.errors), p50,
                stream.p99_ms(), within / seconds, within / max(1, stream.sent))


def run(args: argparse.Namespace) -> list[Cell]:
    rates = [float(r) for r in args.rates.split(",")]
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="sitsmesh-batching-") as tmp:
        repo = Path(tmp) / "models"
        write_batch_model(repo, MODEL)
        triton = TritonServer(Path(tmp) / "triton", repo)
        triton.start()
        try:
            load(triton, Batching())
            curve = profile(triton)
            print(f"curve (knee B* = {knee(curve.points)}):", file=sys.stderr)
            for p in curve.points:
                print(f"  batch {p.batch_size:>3}: {p.throughput:7.1f} items/s, p50 "
                      f"{p.p50_ms:.1f} ms", file=sys.stderr)
            tuned: dict[float, Batching] = {}
            for rate in rates:
                found = recommend(curve, Batching(), rate=rate, sla_ms=args.sla_ms,
                                  rate_source="given")
                tuned[rate] = found.proposed.batching
                print(f"tuned at {rate:g}/s: {found.reason}", file=sys.stderr)
            configs: list[tuple[str, dict[float, Batching]]] = [
                ("untuned", dict.fromkeys(rates, Batching())),
                ("hand [8,16]/10ms", dict.fromkeys(rates, HAND)),
                ("sitsmesh-tuned", tuned)]
            for rnd in range(args.rounds):
                order = configs[rnd % 3:] + configs[:rnd % 3]
                for rate in rates:
                    for name, chosen in order:
                        batching = chosen[rate]
                        load(triton, batching)
                        cell = drive(triton, rate, args.seconds, args.sla_ms / 1000,
                                     seed=1000 * rnd + int(rate), name=name,
                                     batching=batching)
                        cells.append(cell)
                        print(f"round {rnd + 1} {rate:g}/s {name}: p99 {cell.p99_ms:.0f} ms, "
                              f"goodput {cell.share:.0%}", file=sys.stderr)
                        if cell.completed < cell.offered or cell.p99_ms > 10 * args.sla_ms:
                            triton.restart()  # a standing queue: start the next cell empty
        finally:
            triton.kill()
    return cells


def table(cells: Sequence[Cell], sla_ms: float) -> str:
    keys = sorted({(c.rate, c.config) for c in cells},
                  key=lambda k: (k[0], ["untuned", "hand [8,16]/10ms",
                                        "sitsmesh-tuned"].index(k[1])))
    lines = [f"| rate/s | config | batching | offered | failed | p50 ms | p99 ms | "
             f"goodput/s (p99 ≤ {sla_ms:g} ms) | goodput share |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for rate, name in keys:
        mine = [c for c in cells if (c.rate, c.config) == (rate, name)]

        def med(field: str, mine: list[Cell] = mine) -> Any:
            return statistics.median(getattr(c, field) for c in mine)

        lines.append(f"| {rate:g} | {name} | {mine[0].batching} | {med('offered'):.0f} | "
                     f"{med('failed'):.0f} | {med('p50_ms'):.0f} | {med('p99_ms'):.0f} | "
                     f"{med('goodput'):.1f} | {med('share'):.0%} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="30,150,300", help="arrival rates, requests/s")
    p.add_argument("--sla-ms", type=float, default=100.0, help="p99 SLA")
    p.add_argument("--seconds", type=float, default=5.0, help="per cell")
    p.add_argument("--rounds", type=int, default=1)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cells = run(args)
    print(table(cells, args.sla_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
