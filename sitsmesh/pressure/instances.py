"""Each staged Triton model's instance count: its stage's parallelism, as Triton says."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from sitsmesh.config import TritonEndpoint
from sitsmesh.pressure.runtime import PressureRuntime
from sitsmesh.swap.contract import ServerError

INSTANCES_EVERY_S = 30.0  # how often Triton's model configs are re-read


async def learn_instances(runtime: PressureRuntime,
                          endpoints: Sequence[TritonEndpoint]) -> None:
    """Each staged Triton model's instance count (times the batch it executes, with
    dynamic batching), summed over the endpoints serving it, becomes its stage's
    parallelism (unless the thresholds set one); re-read now and
    then, since a swap or an operator may change it."""
    # Imported here: tritonclient loads only where Triton is configured.
    from sitsmesh.triton.client import TritonServer, execute_slots

    servers = [TritonServer(e.name, e.url) for e in endpoints]
    try:
        while True:
            for model in runtime.triton_models():
                total = 0
                for server in servers:
                    try:
                        total += execute_slots(await server.model_config(model))
                    except ServerError:
                        continue  # not served there, or down: the scrape says so
                if total:
                    runtime.set_instances(model, total)
            await asyncio.sleep(INSTANCES_EVERY_S)
    finally:
        for server in servers:
            await server.close()
