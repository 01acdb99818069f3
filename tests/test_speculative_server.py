"""Speculative decoding behind a real ``fd serve`` (a tiny random Llama on the CPU, n-gram
proposals): 200 mixed requests — streamed, whole, ``n = 2``, stop strings, clients that leave
early — on a KV cache small enough to preempt, give the same greedy text as a server without
speculation, and leave every block free, as ``/metrics`` shows with the spec_decode counters."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests import checkpoints  # noqa: E402
from tests.servers import API_KEY, Server, leave_after  # noqa: E402

NAME = "tiny"
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
WORDS = "alpha beta gamma delta river stone cloud seven orange music".split()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(checkpoints.make_llama(tmp_path_factory.mktemp("spec-e2e")))


def serve(model: str, log, *extra: str) -> Server:
    # 40 blocks of 16 tokens: a dozen running sequences fill it, so some are preempted
    return Server(model, log, "--served-model-name", NAME, "--api-key", API_KEY, "--num-kv-blocks", "40",
                  "--max-num-seqs", "24", "--max-model-len", "256", *extra)


def prompt(i: int) -> str:
    rng = random.Random(i)
    phrase = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
    return f"{i}: " + ", ".join([phrase] * rng.randint(2, 4))


async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, list[str]] | None:
    """Request ``i`` of the mix; what it returned, or None for a client that left early."""
    kind = i % 5
    args = dict(model=NAME, prompt=prompt(i), temperature=0, max_tokens=12 + i % 20, extra_body={"ignore_eos": True})
    if kind == 0:  # streamed, the client leaves after three chunks
        await leave_after(await client.completions.create(stream=True, **{**args, "max_tokens": 120}))
        return None
    if kind == 1:
        stream = await client.completions.create(stream=True, **args)
        return "stream", ["".join([c.choices[0].text async for c in stream])]
    if kind == 2:
        out = await client.completions.create(n=2, **args)
        return "n2", [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    if kind == 3:
        out = await client.completions.create(stop=[WORDS[i % len(WORDS)]], **args)
        return "stop", [out.choices[0].text + "|" + out.choices[0].finish_reason]
    out = await client.completions.create(**args)
    return "whole", [out.choices[0].text]


def run_mix(server: Server) -> list:
    async def everyone() -> list:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(200)))
        finally:
            await client.close()

    return asyncio.run(everyone())


def settled(server: Server) -> str:
    """/metrics once every block is free again (waiting for the aborts to land)."""
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        m = server.metrics()
        if m["fd:kv_cache_free_blocks"] == m["fd:kv_cache_total_blocks"] and m["fd:num_requests_running"] == 0:
            return text
        assert time.monotonic() < deadline, f"KV cache not freed: {m}"
        time.sleep(0.1)


def spec_samples(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("fd:spec_decode") or sample.name == "fd:num_preemptions_total":
                out[(sample.name, sample.labels.get("position"))] = sample.value
    return out


def test_mixed_load_with_speculation(tiny_model, tmp_path, capsys):
    from tests.test_bench_serve import bench

    with serve(tiny_model, tmp_path / "spec.log", "--speculative-config", SPEC) as server:
        got = run_mix(server)
        metrics = spec_samples(settled(server))
        # fd bench serve reports what its own requests' drafts did, from /metrics before and after
        rc, report = bench(["--base-url", server.url, "--api-key", API_KEY, "--model", NAME, "--tokenizer",
                            tiny_model, "--num-prompts", "8", "--random-input-len", "32", "--random-output-len",
                            "24", "--save-result", str(tmp_path / "bench.json")])
        after = spec_samples(settled(server))
    with serve(tiny_model, tmp_path / "plain.log") as server:
        want = run_mix(server)
        assert ("fd:spec_decode_num_drafts_total", None) not in spec_samples(settled(server))
    assert got == want
    assert metrics[("fd:num_preemptions_total", None)] > 0
    drafts = metrics[("fd:spec_decode_num_draft_tokens_total", None)]
    accepted = metrics[("fd:spec_decode_num_accepted_tokens_total", None)]
    assert metrics[("fd:spec_decode_num_drafts_total", None)] > 0 and 0 < accepted < drafts
    per_pos = [metrics[("fd:spec_decode_num_accepted_tokens_per_pos_total", str(p))] for p in range(4)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)

    assert rc == 0 and report["completed"] == 8
    spec, key = report["spec_decode"], ("fd:spec_decode_num_draft_tokens_total", None)
    # the timed requests' drafts: the server's count less the warm-up request's
    assert 0 < spec["draft_tokens"] < after[key] - metrics[key]
    assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["draft_tokens"]
    assert report["spec_decode_acceptance_rate"] == spec["acceptance_rate"]  # vLLM's result field
    assert len(spec["per_position_acceptance_rate"]) == 4
    assert "acceptance rate" in capsys.readouterr().out


def test_spec_decode_figures_from_metrics_text():
    from fd_core.bench import spec_decode

    def text(drafts, tokens, accepted, per_pos, prefix="vllm:"):
        lines = [f'{prefix}spec_decode_num_drafts_total{{engine="0"}} {drafts}',
                 f'{prefix}spec_decode_num_draft_tokens_total{{engine="0"}} {tokens}',
                 f'{prefix}spec_decode_num_accepted_tokens_total{{engine="0"}} {accepted}']
        lines += [f'{prefix}spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{p}"}} {v}'
                  for p, v in enumerate(per_pos)]
        return "\n".join(f"# TYPE {line.split('{')[0]} counter\n{line}" for line in lines) + "\n"

    before = spec_decode.parse(text(10, 30, 12, [8, 3, 1]))
    after = spec_decode.parse(text(30, 90, 42, [26, 12, 4]))
    d = spec_decode.difference(before, after)
    assert (d["num_drafts"], d["draft_tokens"], d["accepted_tokens"]) == (20, 60, 30)
    assert d["acceptance_rate"] == 0.5 and d["acceptance_length"] == 2.5
    assert d["per_position_acceptance_rate"] == [0.9, 0.45, 0.15]
    assert spec_decode.parse("# TYPE fd:num_requests_running gauge\nfd:num_requests_running 0\n") is None
    assert spec_decode.difference(None, None) is None
