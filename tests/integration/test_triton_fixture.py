"""The Triton fixture: a real tritonserver from the nvidia-pytriton wheel, the lazy demo model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import InferInput

from sitsmesh.dev import demo_model
from sitsmesh.dev.triton import TritonServer

pytestmark = pytest.mark.integration

MODEL = "lazy"
CONTEXT_MS = 400.0
DATA = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)


@pytest.fixture
def triton(tmp_path: Path) -> Iterator[TritonServer]:
    repo = tmp_path / "models"
    demo_model.write_lazy_model(repo, MODEL, [1, 2], context_ms=CONTEXT_MS)
    server = TritonServer(tmp_path / "triton", repo)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
async def client(triton: TritonServer) -> AsyncIterator[triton_aio.InferenceServerClient]:
    client = triton_aio.InferenceServerClient(triton.grpc_url)
    try:
        yield client
    finally:
        await client.close()


async def infer(client: triton_aio.InferenceServerClient,
                version: str = "") -> tuple[str, npt.NDArray[np.float32], float]:
    """(answering version, OUTPUT0, seconds) for one request."""
    tensor = InferInput(demo_model.INPUT, [demo_model.WIDTH], "FP32")
    tensor.set_data_from_numpy(DATA)
    start = time.perf_counter()
    result = await client.infer(MODEL, [tensor], model_version=version, client_timeout=10)
    elapsed = time.perf_counter() - start
    answered = str(result.get_response().model_version)
    output = result.as_numpy(demo_model.OUTPUT)
    assert output is not None
    return answered, output, elapsed


async def test_lazy_model_loads_serves_and_moves_to_a_new_version(
        triton: TritonServer, client: triton_aio.InferenceServerClient) -> None:
    assert await client.is_server_live()
    assert not await client.is_model_ready(MODEL)

    await client.load_model(MODEL, config=demo_model.config_json(MODEL, [1]))
    assert await client.is_model_ready(MODEL, "1")
    assert not await client.is_model_ready(MODEL, "2")

    version, output, first = await infer(client)
    assert version == "1"
    np.testing.assert_array_equal(output, DATA * 1)
    assert first >= CONTEXT_MS / 1000 * 0.8, "the first request builds the lazy context"
    _, _, second = await infer(client)
    assert second < 0.05

    # Adding a version leaves the loaded one alone: v1 answers, still warm, during the load.
    load = asyncio.create_task(
        client.load_model(MODEL, config=demo_model.config_json(MODEL, [1, 2])))
    await asyncio.sleep(0.2)  # a python-backend load takes over a second: still loading
    version, output, during = await infer(client, "1")
    assert not load.done()
    await load
    assert version == "1"
    assert during < 0.05
    assert await client.is_model_ready(MODEL, "1")
    assert await client.is_model_ready(MODEL, "2")
    version, output, after = await infer(client, "1")
    assert version == "1"
    assert after < 0.05, "v1 was not reloaded"
    np.testing.assert_array_equal(output, DATA * 1)
    version, output, _ = await infer(client)
    assert version == "2", "unversioned requests go to the highest ready version"
    np.testing.assert_array_equal(output, DATA * 2)

    assert triton.stop() == 0
    assert "successfully unloaded 'lazy' version 2" in triton.output()
