"""AsyncEngineClient + the engine-core process on a tiny random Llama: the process boundary
changes no output, frees KV blocks whenever a request ends early, and never leaves a caller
waiting on a dead core or an orphan process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the process checks read /proc", allow_module_level=True)

pytest.importorskip("transformers")  # the checkpoint is built with transformers

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.engine.client import AsyncEngineClient  # noqa: E402
from fd_core.engine.config import EngineConfig  # noqa: E402
from fd_core.errors import (BackendError, ConfigError, EngineDeadError,  # noqa: E402
                            InvalidRequestError, ModelNotFoundError, PromptTooLongError)
from tests import checkpoints  # noqa: E402

ENGINE_ARGS = dict(max_model_len=128, num_kv_blocks=64, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("client"))


@pytest.fixture(scope="module")
def loop():
    # one loop for the module, so the client started once serves every test
    loop = asyncio.new_event_loop()
    yield loop
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


@pytest.fixture(scope="module")
def client(loop, model_dir):
    config = EngineConfig(model=str(model_dir), **ENGINE_ARGS)
    c = loop.run_until_complete(AsyncEngineClient.start(config))
    yield c
    loop.run_until_complete(c.shutdown())


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), **ENGINE_ARGS)


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, 400, size=int(rng.integers(3, 30))).tolist() for _ in range(n)]


async def collect(client, request_id, prompt, params, **kw):
    """Every output of one request; checks they are cumulative and only the last is finished."""
    seen = []
    async for out in client.generate(request_id, prompt, params, **kw):
        if seen:
            for before, now in zip(seen[-1].outputs, out.outputs):
                assert now.token_ids[:len(before.token_ids)] == before.token_ids
        seen.append(out)
    assert seen and seen[-1].finished and not any(o.finished for o in seen[:-1])
    return seen[-1]


async def wait_for_free_blocks(client, timeout: float = 2.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = client.metrics()
        if m["num_free_blocks"] == m["num_blocks"] and m["num_running"] == m["num_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"KV blocks not freed: {m}"
        await asyncio.sleep(0.02)


def same(a, b) -> None:
    """Two RequestOutputs agree on everything the engine decides."""
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs):
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == \
               (y.token_ids, y.text, y.finish_reason, y.stop_reason)
        assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_concurrent_outputs_equal_offline_llm(loop, client, llm, params):
    ps = prompts(6)
    reference = llm.generate(ps, params, use_tqdm=False)

    async def main():
        return await asyncio.gather(*(collect(client, f"{params.temperature}-{i}", p, params)
                                      for i, p in enumerate(ps)))

    outs = loop.run_until_complete(main())
    for out, ref, p in zip(outs, reference, ps):
        same(out, ref)
        assert out.prompt_token_ids == p
    m = loop.run_until_complete(wait_for_free_blocks(client))
    assert m["generation_tokens_total"] >= 6 * 12


def test_n_and_stop_strings(loop, client, llm):
    prompt = prompts(1)[0]
    text = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip() and text.index(stop) > 0
    cases = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
        SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, stop=[stop, "e"]),
    ]
    reference = llm.generate([prompt] * len(cases), cases, use_tqdm=False)

    async def main():
        return await asyncio.gather(*(collect(client, f"n-{i}", prompt, p) for i, p in enumerate(cases)))

    outs = loop.run_until_complete(main())
    for out, ref in zip(outs, reference):
        same(out, ref)
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].stop_reason == stop
    assert outs[0].outputs[0].text == text[:text.index(stop)]
    assert len(outs[1].outputs) == 3
    # a stop string ends sequences here; the core was told, so their blocks come back
    loop.run_until_complete(wait_for_free_blocks(client))


def test_leaving_early_frees_the_kv_cache(loop, client):
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    prompt = prompts(1)[0]

    async def break_early():
        n = 0
        async for _ in client.generate("break", prompt, long):
            n += 1
            if n == 3:
                assert client.metrics()["num_running"] == 1
                break
        await asyncio.sleep(0)  # the generator's aclose runs as its own task
        await wait_for_free_blocks(client)

    async def cancel():
        started = asyncio.Event()

        async def consume():
            async for _ in client.generate("cancel", prompt, long):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()  # what an HTTP client's disconnect does to its handler
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for_free_blocks(client)

    async def abort():
        outs = []
        async for out in client.generate("abort", prompt, long):
            outs.append(out)
            if len(outs) == 2:
                await client.abort("abort")
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        await wait_for_free_blocks(client)

    for case in (break_early, cancel, abort):
        before = client.metrics()["generation_tokens_total"]
        loop.run_until_complete(case())
        # stopped by the abort, far short of its 100 tokens
        assert client.metrics()["generation_tokens_total"] - before < 50, case.__name__
    # the ids are free again, and the client still serves
    out = loop.run_until_complete(collect(client, "break", prompt, GREEDY))
    assert len(out.outputs[0].token_ids) == 12


def test_bad_request_fails_only_itself(loop, client):
    bad_params = SamplingParams(temperature=0)
    bad_params.temperature = -1.0  # only the core's rebuild of the params can catch this
    too_long = list(range(3, 3 + ENGINE_ARGS["max_model_len"]))
    with pytest.raises(PromptTooLongError) as local:
        client.check_prompt(too_long)

    async def expect(request_id, prompt, params, error):
        with pytest.raises(error) as caught:
            await collect(client, request_id, prompt, params)
        return str(caught.value)

    async def main():
        good = asyncio.create_task(collect(client, "good", prompts(1)[0], GREEDY))
        messages = await asyncio.gather(
            expect("long", too_long, GREEDY, PromptTooLongError),
            expect("vocab", [1, 2, 10**6], GREEDY, InvalidRequestError),
            expect("params", [1, 2, 3], bad_params, InvalidRequestError),
            expect("good", [1, 2, 3], GREEDY, InvalidRequestError),  # its id is in use
        )
        return messages, await good

    messages, good = loop.run_until_complete(main())
    assert messages[0] == str(local.value)
    assert "token ids must be in [0, 512)" in messages[1]
    assert "temperature" in messages[2]
    assert "already in use" in messages[3]
    assert len(good.outputs[0].token_ids) == 12
    assert client.is_healthy()
    loop.run_until_complete(wait_for_free_blocks(client))


def test_prefix_cache_across_the_process_boundary(loop, client):
    prompt = list(range(100, 140))  # 40 tokens: two whole blocks can come from the cache
    one = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    two = SamplingParams(n=2, temperature=0, max_tokens=2, ignore_eos=True)
    before = client.metrics()

    async def main():
        return [await collect(client, f"pc-{i}", prompt, params, **kw) for i, (params, kw) in enumerate([
            (one, {}), (two, {}), (one, {"cache_salt": "tenant"}), (one, {"cache_salt": "tenant"})])]

    outs = loop.run_until_complete(main())
    assert [o.num_cached_tokens for o in outs] == [0, 32, 0, 32]
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        loop.run_until_complete(collect(client, "pc-bad", prompt, one, cache_salt=""))
    m = loop.run_until_complete(wait_for_free_blocks(client))
    assert m["prefix_cache_hit_tokens_total"] - before["prefix_cache_hit_tokens_total"] == 64
    assert m["prefix_cache_queried_tokens_total"] - before["prefix_cache_queried_tokens_total"] >= 4 * 40
    # the forked second choice shares its sibling's prompt: nothing is computed twice
    assert m["prompt_tokens_computed_total"] - before["prompt_tokens_computed_total"] == 40 + 8 + 40 + 8
    assert 0 < m["prefix_cache_hit_rate"] <= 1 and m["prefix_cache_blocks"] >= 4
    assert m["swapped_out_total"] == m["num_swapped"] == 0


def test_wire_messages_carry_the_prefix_cache_fields():
    import msgspec

    from fd_core.engine.wire import AddRequest, ClientMessage, Stats, WireOutput

    decode = msgspec.msgpack.Decoder(ClientMessage).decode
    encode = msgspec.msgpack.encode
    assert decode(encode(AddRequest("r", [1, 2], {}, "salt"))).cache_salt == "salt"
    assert decode(encode(AddRequest("r", [1, 2], {}))).cache_salt is None
    out = WireOutput("r", 0, [5], -0.5, [], [], [], None, None, 48)
    assert msgspec.msgpack.decode(encode(out), type=WireOutput).num_cached_tokens == 48
    stats = Stats(prefix_cache_hit_tokens_total=7, prefix_cache_hit_rate=0.5, num_swapped=1)
    assert msgspec.msgpack.decode(encode(stats), type=Stats) == stats


def test_core_reports_its_numbers(client):
    assert client.max_model_len == ENGINE_ARGS["max_model_len"]
    assert client.vocab_size == checkpoints.VOCAB
    assert 2 in client.eos_token_ids
    assert client.metrics()["num_blocks"] == ENGINE_ARGS["num_kv_blocks"] - 1  # block 0 is reserved
    tok = client.tokenizer  # loaded on this side
    assert tok.decode(tok.encode("Hello world"), skip_special_tokens=True) == "Hello world"


@pytest.mark.parametrize("args, error, match", [
    ({"model": "/no/such/model"}, ModelNotFoundError, "No local model at '/no/such/model'"),
    ({"max_model_len": 4096}, ConfigError, "exceeds the model's context length 256"),
], ids=["missing-model", "bad-config"])
def test_start_up_error_is_reraised(model_dir, args, error, match):
    config = EngineConfig(**{"model": str(model_dir), **args})
    before = set(_core_children())
    with pytest.raises(error, match=match):
        asyncio.run(AsyncEngineClient.start(config, start_timeout=60))
    assert set(_core_children()) <= before


def test_start_up_timeout_is_a_backend_error(model_dir):
    before = set(_core_children())
    with pytest.raises(BackendError, match="not ready within 0.2 s"):
        asyncio.run(AsyncEngineClient.start(EngineConfig(model=str(model_dir)), start_timeout=0.2))
    assert set(_core_children()) <= before  # the slow core was stopped, not left behind


def test_killed_core_fails_every_request_at_once(model_dir):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        client = await AsyncEngineClient.start(EngineConfig(model=str(model_dir), num_kv_blocks=128))
        started = [asyncio.Event() for _ in range(4)]

        async def consume(i):
            async for _ in client.generate(f"r{i}", prompts(4)[i], long):
                started[i].set()

        tasks = [asyncio.create_task(consume(i)) for i in range(4)]
        for e in started:
            await e.wait()
        os.kill(client._core.pid, signal.SIGKILL)
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=5)
        elapsed = time.monotonic() - t0
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert elapsed < 2.0
        assert not client.is_healthy()
        with pytest.raises(EngineDeadError, match="exited"):
            async for _ in client.generate("late", [1, 2, 3], long):
                pass
        await asyncio.wait_for(client.shutdown(), timeout=5)

    asyncio.run(main())


def test_shutdown_leaves_no_process(model_dir):
    async def main():
        client = await AsyncEngineClient.start(EngineConfig(model=str(model_dir), **ENGINE_ARGS))
        pid = client._core.pid
        assert pid in _core_children()
        out = await collect(client, "x", [1, 2, 3], GREEDY)
        assert out.finished
        await client.shutdown()
        await client.shutdown()  # twice is fine
        return pid, client

    pid, client = asyncio.run(main())
    assert client._core.exitcode == 0  # it stopped when asked, not killed
    assert pid not in _core_children() and not _exists(pid)


def test_core_exits_when_its_parent_dies(model_dir):
    # A parent killed without shutdown(): its core must notice and exit, not linger as an orphan.
    script = textwrap.dedent(f"""
        import asyncio, os, signal, sys
        from fd_core.engine.client import AsyncEngineClient
        from fd_core.engine.config import EngineConfig

        async def main():
            c = await AsyncEngineClient.start(EngineConfig(model={str(model_dir)!r}, num_kv_blocks=64))
            print(c._core.pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        if __name__ == "__main__":
            asyncio.run(main())
    """)
    parent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    core_pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 3
    while _exists(core_pid):
        assert time.monotonic() < deadline, "the engine core outlived its parent"
        time.sleep(0.05)


def _stat(pid) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, ...]."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _exists(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie is reaped by init, which may take a moment)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _core_children() -> list[int]:
    """Live processes this one spawned (multiprocessing's resource tracker is not spawned so)."""
    found = []
    for entry in os.listdir("/proc"):
        stat = _stat(entry) if entry.isdigit() else None
        if stat is None or stat[0] == "Z" or int(stat[1]) != os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(int(entry))
        except FileNotFoundError:
            pass
    return found
