"""One engine-core process serving several clients (the HTTP processes of a server with more
than one): each request's outputs reach the client that sent it, stats reach all, one client's
abort or shutdown leaves the others running, and the core's owner stops it for all."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from fd_core.engine.client import AsyncEngineClient
from fd_core.engine.config import EngineConfig
from fd_core.engine.core_handle import CoreHandle, CoreWatch, client_addresses
from fd_core.engine.sampling_params import SamplingParams
from fd_core.errors import EngineDeadError
from tests import checkpoints

ENGINE_ARGS = dict(max_model_len=128, num_kv_blocks=64, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("shared"))


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(3, 400, size=int(rng.integers(3, 30))).tolist() for _ in range(n)]


async def tokens(client: AsyncEngineClient, request_id: str, prompt: list[int],
                 params: SamplingParams = GREEDY) -> list[int]:
    last = None
    async for out in client.generate(request_id, prompt, params):
        last = out
    assert last is not None and last.finished
    return list(last.outputs[0].token_ids)


def test_two_clients_share_one_core(model_dir, tmp_path):
    config = EngineConfig(model=str(model_dir), **ENGINE_ARGS)
    batch = prompts(6)

    async def main() -> None:
        alone = await AsyncEngineClient.start(config)
        try:
            want = await asyncio.gather(*(tokens(alone, f"r{i}", p) for i, p in enumerate(batch)))
        finally:
            await alone.shutdown()

        pairs = [client_addresses(str(tmp_path), k) for k in range(2)]
        core = CoreHandle.spawn(config, pairs)
        try:
            a, b = await asyncio.gather(*(AsyncEngineClient.attach(config, pairs[k], core.pid, k, 2)
                                          for k in range(2)))
            # the same request ids on both clients, interleaved in the core's batches
            got = await asyncio.gather(*(tokens(c, f"r{i}", p) for i, p in enumerate(batch) for c in (a, b)))
            assert got[0::2] == want and got[1::2] == want
            assert a.metrics()["num_blocks"] == b.metrics()["num_blocks"] > 0  # the stats reach both

            # a request one client abandons is aborted in the core; the other's goes on
            stream = a.generate("long", batch[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
            await anext(stream)
            await stream.aclose()
            assert await tokens(b, "other", batch[1]) == want[1]

            # a client's shutdown leaves the core to its owner, serving the others
            await a.shutdown()
            assert core.is_alive() and b.is_healthy()
            assert await tokens(b, "after", batch[2]) == want[2]

            await core.stop()  # the owner's stop ends it for every client
            deadline = time.monotonic() + 5
            while b.is_healthy() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not b.is_healthy()
            with pytest.raises(EngineDeadError):
                await tokens(b, "late", batch[3])
            await b.shutdown()
        finally:
            await core.stop()

    asyncio.run(asyncio.wait_for(main(), 120))  # a lost output would leave a request waiting


def test_a_watched_core_that_died_is_not_alive():
    """A client that did not spawn the core cannot reap it: a zombie counts as dead."""
    import multiprocessing

    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    process.start()
    watch = CoreWatch(process.pid)
    deadline = time.monotonic() + 10
    while watch.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not watch.is_alive()  # exited, not reaped yet
    process.join()
    assert not CoreWatch(process.pid).is_alive()
