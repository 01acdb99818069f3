"""fd_server against a scripted fake engine client: every error path and field mapping, fast.

The fake has the interface of ``fd_core.engine.client.AsyncEngineClient``: a byte-level
tokenizer (id = byte + 3), and a generator that writes ``"abcdefghij..."`` one character per
token (choice ``i`` starts ``i`` letters later), honours max_tokens, stop strings, EOS-free
generation, logprobs and prompt logprobs (each prompt token at -1.5, rank 7, its top k
``"B", "C", ...`` at -0.5 each rank), and records aborts, so what the server does with each
field can be checked exactly. A toy prefix cache (whole blocks of ``BLOCK`` tokens, keyed by the cache salt
and the tokens before them, the prompt's last token never matched) reports
``num_cached_tokens`` as the real engine does.
"""

from __future__ import annotations

import asyncio
import json
import socket
import string
import threading
import time
from collections.abc import AsyncIterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from fd_server.app import build_app
from fd_server.errors import EngineDeadError
from fd_server.limits import ServerLimits

from fd_core.engine import core
from fd_core.engine.config import EngineConfig
from fd_core.engine.detokenizer import stop_holdback
from fd_core.engine.outputs import CompletionOutput, Logprob, RequestOutput
from fd_core.engine.sampling_params import SamplingParams
from fd_core.errors import InvalidRequestError

MODEL = "fake-model"
BLOCK = 16  # the fake's prefix-cache block size
LETTERS = string.ascii_lowercase


class FakeTokenizer:
    bos_token_id = 1
    eos_token_ids = frozenset({2})
    vocab_size = 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - 3 for i in ids if i >= 3)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw: object) -> str:
        if kw.get("explode"):
            raise RuntimeError("template blew up")
        out = ""
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise InvalidRequestError(f"unknown role {m['role']!r}")
            out += f"<{m['role']}>{m.get('content', '')}\n"
        return out + ("<assistant>" if add_generation_prompt else "")


class FakeEngineClient:
    """Same interface as AsyncEngineClient; outputs are scripted (see the module docstring)."""

    def __init__(self, max_model_len: int = 64, delay: float = 0.0) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.vocab_size = 259
        self.unavailable: dict[str, str] = {}  # as the core's Ready says: fields its backend cannot honour
        self.eos_token_ids = frozenset({2})
        self.config = EngineConfig(model="/models/fake")
        self.delay = delay
        self.healthy = True
        self.fail_with: BaseException | None = None
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.salts: dict[str, str | None] = {}  # the cache_salt each request id came with
        self.cached_prefixes: set[tuple] = set()  # (salt, tokens of whole blocks)
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.active: set[str] = set()
        self.aborted: set[str] = set()  # the server may abort explicitly and by closing the iterator
        self.generation_tokens = 0
        self._dead: asyncio.Event | None = None

    @classmethod
    async def start(cls, config: EngineConfig, start_timeout: float = 900.0) -> "FakeEngineClient":
        return cls()

    def is_healthy(self) -> bool:
        return self.healthy

    def check_prompt(self, token_ids: list[int]) -> None:
        core.check_prompt(token_ids, self.vocab_size, self.max_model_len, 1 << 30, True)

    def check_params(self, params: SamplingParams) -> None:
        core.check_params(params, self.vocab_size, unavailable=self.unavailable)

    def die(self) -> None:
        self.healthy = False
        if self._dead is not None:
            self._dead.set()

    def _lookup(self, ids: list[int], salt: str | None) -> int:
        """Prompt tokens the toy prefix cache holds; then it holds the whole prompt's blocks."""
        cached = 0
        while cached + BLOCK <= len(ids) - 1 and (salt, tuple(ids[:cached + BLOCK])) in self.cached_prefixes:
            cached += BLOCK
        self.cached_prefixes.update((salt, tuple(ids[:end])) for end in range(BLOCK, len(ids) + 1, BLOCK))
        self.queried_tokens += len(ids)
        self.hit_tokens += cached
        return cached

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt_text: str | None = None, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        if self._dead is None:
            self._dead = asyncio.Event()
        if not self.healthy:
            raise EngineDeadError("engine-core process exited")
        self.check_prompt(prompt_token_ids)
        self.requests.append((request_id, list(prompt_token_ids), params))
        self.salts[request_id] = cache_salt
        num_cached = self._lookup(list(prompt_token_ids), cache_salt)
        self.active.add(request_id)
        finished = False
        try:
            if self.fail_with is not None:
                raise self.fail_with
            limit = min(params.max_tokens or 10**9, self.max_model_len - len(prompt_token_ids))
            outs = [_Seq(i) for i in range(params.n)]
            scores = None
            if params.prompt_logprobs is not None:
                scores = [None] + [self._prompt_entry(t, params.prompt_logprobs) for t in prompt_token_ids[1:]]
            while not all(o.finish for o in outs):
                if self.delay:
                    try:
                        await asyncio.wait_for(self._dead.wait(), self.delay)
                    except asyncio.TimeoutError:
                        pass
                else:
                    await asyncio.sleep(0)
                if self._dead.is_set():
                    raise EngineDeadError("engine-core process exited")
                for o in outs:
                    if o.finish:
                        continue
                    ch = LETTERS[(o.index + len(o.ids)) % 26]
                    o.ids.append(ord(ch) + 3)
                    o.text += ch
                    self.generation_tokens += 1
                    if params.logprobs is not None:
                        step = {o.ids[-1]: Logprob(-0.25, 1, ch)}
                        for r in range(2, params.logprobs + 1):
                            step[ord("A") + r + 3] = Logprob(-float(r), r, chr(ord("A") + r))
                        o.logprobs.append(step)
                    for stop in params.stop_strings:
                        at = o.text.find(stop)
                        if at != -1:
                            o.text = o.text[:at]
                            o.finish = "stop"
                            break
                    if not o.finish and len(o.ids) >= limit:
                        o.finish = "length"
                done = all(o.finish for o in outs)
                yield RequestOutput(
                    request_id, prompt_text, list(prompt_token_ids),
                    [CompletionOutput(o.index, o.text, list(o.ids), -0.25 * len(o.ids),
                                      list(o.logprobs) if params.logprobs is not None else None, o.finish)
                     for o in outs],
                    finished=done, num_cached_tokens=num_cached, prompt_logprobs=scores)
            finished = True
        finally:
            self.active.discard(request_id)
            if not finished:
                self.aborted.add(request_id)

    def _prompt_entry(self, token: int, k: int) -> dict[int, Logprob]:
        entry = {token: Logprob(-1.5, 7, self.tokenizer.decode([token]))}
        for r in range(1, k + 1):
            entry[ord("A") + r + 3] = Logprob(-0.5 * r, r, chr(ord("A") + r))
        return entry

    async def abort(self, request_id: str) -> None:
        if request_id in self.active:
            self.aborted.add(request_id)

    def metrics(self) -> dict:
        return {"num_running": len(self.active), "num_waiting": 0, "kv_cache_usage": 0.0,
                "num_free_blocks": 100, "num_blocks": 100, "prompt_tokens_total": 0,
                "generation_tokens_total": self.generation_tokens, "preemptions_total": 0,
                "prompt_tokens_computed_total": self.queried_tokens - self.hit_tokens,
                "prefix_cache_queried_tokens_total": self.queried_tokens,
                "prefix_cache_hit_tokens_total": self.hit_tokens,
                "prefix_cache_hit_rate": self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
                "prefix_cache_blocks": len(self.cached_prefixes), "prefix_cache_evictions_total": 0,
                "swapped_out_total": 0, "recomputed_total": 0, "num_swapped": 0}

    async def shutdown(self) -> None:
        pass


class _Seq:
    def __init__(self, index: int) -> None:
        self.index = index
        self.ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] = []
        self.finish: str | None = None


# -- helpers ---------------------------------------------------------------------------------


@contextmanager
def serve(fake: FakeEngineClient | None = None, **kw: Any):
    fake = fake or FakeEngineClient()
    app = build_app(fake, MODEL, **kw)
    with TestClient(app, raise_server_exceptions=False) as http:
        http.fake = fake  # type: ignore[attr-defined]
        yield http


@pytest.fixture
def http():
    with serve() as client:
        yield client


def chat(http: TestClient, **body: Any) -> httpx.Response:
    body.setdefault("model", MODEL)
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return http.post("/v1/chat/completions", json=body)


def complete(http: TestClient, **body: Any) -> httpx.Response:
    body.setdefault("model", MODEL)
    body.setdefault("prompt", "hello")
    return http.post("/v1/completions", json=body)


def events(response: httpx.Response) -> list[Any]:
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


# -- chat ------------------------------------------------------------------------------------


def test_chat_basic_fields(http):
    r = chat(http, max_tokens=5)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "abcde"}, "logprobs": None,
                      "finish_reason": "length"}
    prompt = len("<user>hi\n<assistant>")
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # the chat template's text is encoded without special tokens: the template places BOS itself
    _, ids, params = http.fake.requests[-1]
    assert ids[0] != 1 and params.max_tokens == 5


def test_chat_sampling_fields_reach_the_engine(http):
    r = chat(http, n=2, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, max_completion_tokens=4, max_tokens=9,
             stop=["zz"], seed=11, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
             ignore_eos=True, min_tokens=2, stop_token_ids=[5], user="u1", unknown_field={"x": 1})
    assert r.status_code == 200, r.text
    _, _, p = http.fake.requests[-1]
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (2, 0.5, 0.9, 7, 0.1)
    assert p.max_tokens == 4  # max_completion_tokens wins over the deprecated max_tokens
    assert (p.stop_strings, p.seed, p.presence_penalty, p.frequency_penalty) == (("zz",), 11, 0.5, -0.5)
    assert (p.repetition_penalty, p.ignore_eos, p.min_tokens, p.stop_token_ids) == (1.1, True, 2, [5])
    assert [c["message"]["content"] for c in r.json()["choices"]] == ["abcd", "bcde"]
    assert r.json()["usage"]["completion_tokens"] == 8


def test_chat_default_max_tokens_fills_the_context(http):
    r = chat(http)
    prompt = r.json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["completion_tokens"] == 64 - prompt
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_chat_stop_string(http):
    r = chat(http, stop="de", max_tokens=10)
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "abc" and choice["finish_reason"] == "stop"


def test_neutral_values_of_unhonoured_fields_pass(http):
    r = chat(http, use_beam_search=False, length_penalty=1.0, priority=0, modalities=["text"],
             spaces_between_special_tokens=True, logits_processors=[], max_tokens=2)
    assert r.status_code == 200, r.text
    assert complete(http, prompt_embeds=None, use_beam_search=False, max_tokens=2).status_code == 200


def test_continue_final_message_reaches_the_template(http, monkeypatch):
    seen: dict = {}
    render = http.fake.tokenizer.apply_chat_template

    def capture(messages, add_generation_prompt=True, **kw):
        seen.update(kw, add_generation_prompt=add_generation_prompt)
        return render(messages, add_generation_prompt, **kw)

    monkeypatch.setattr(http.fake.tokenizer, "apply_chat_template", capture)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    r = chat(http, messages=messages, continue_final_message=True, add_generation_prompt=False, max_tokens=2)
    assert r.status_code == 200, r.text
    assert seen["continue_final_message"] is True and seen["add_generation_prompt"] is False
    assert chat(http, continue_final_message=False, max_tokens=2).status_code == 200


def test_chat_echo_begins_the_reply_with_the_assistants_last_message(http):
    def content(r):
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    def streamed(r):
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events(r)[:-1] if e["choices"])

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once "}]
    body = dict(messages=messages, continue_final_message=True, add_generation_prompt=False, max_tokens=3)
    plain = content(chat(http, **body))
    assert plain and content(chat(http, echo=True, **body)) == "Once " + plain
    assert streamed(chat(http, echo=True, stream=True, **body)) == "Once " + plain
    parts = [messages[0], {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]
    assert content(chat(http, echo=True, messages=parts, max_tokens=3)).startswith("A\nB")
    # the last message is the user's: nothing to echo
    assert content(chat(http, echo=True, max_tokens=3)) == content(chat(http, max_tokens=3))


def test_token_rules_and_template_fields_reach_the_engine(http, monkeypatch):
    seen: dict = {}
    render = http.fake.tokenizer.apply_chat_template

    def capture(messages, add_generation_prompt=True, **kw):
        seen.update(kw)
        return render(messages, add_generation_prompt, **kw)

    monkeypatch.setattr(http.fake.tokenizer, "apply_chat_template", capture)
    docs = [{"title": "t", "text": "d"}]
    r = chat(http, allowed_token_ids=[5, 6], bad_words=["x y"], documents=docs, reasoning_effort="low", max_tokens=2)
    assert r.status_code == 200, r.text
    _, ids, params = http.fake.requests[-1]
    assert params.allowed_token_ids == [5, 6] and params.bad_words == ["x y"]
    assert seen == {"documents": docs, "reasoning_effort": "low", "continue_final_message": False}
    assert ids[0] != 1  # the template placed the special tokens; with add_special_tokens the tokenizer adds BOS too
    assert chat(http, add_special_tokens=True, max_tokens=2).status_code == 200 and http.fake.requests[-1][1][0] == 1
    assert complete(http, add_special_tokens=False, max_tokens=2).status_code == 200
    assert http.fake.requests[-1][1][0] != 1


@pytest.mark.parametrize("extra, starts_after, reasoning", [
    ({"response_format": {"type": "json_object"}}, "</think>", True),
    ({"response_format": {"type": "json_object"}, "chat_template_kwargs": {"enable_thinking": False}}, None, False),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "</think>", True),
    ({"structured_outputs": {"regex": "a+"}}, None, True),  # the whole output, thought included
])
def test_the_answer_is_constrained_after_the_thought(extra, starts_after, reasoning):
    from fd_server.tools import ChatParsing

    with serve(parsing=ChatParsing(reasoning_parser="qwen3")) as http:
        r = chat(http, max_tokens=4, **extra)
        assert r.status_code == 200, r.text
        assert http.fake.requests[-1][2].structured_outputs.starts_after == starts_after
        # the fake writes no </think>: with a parser at work, all of it is thought
        assert ("reasoning_content" in r.json()["choices"][0]["message"]) == reasoning


def test_chat_content_parts_and_extra_message_keys(http):
    r = chat(http, messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                              "reasoning_content": "x"}], max_tokens=1)
    assert r.status_code == 200
    assert http.fake.tokenizer.decode(http.fake.requests[-1][1]) == "<user>a\nb\n<assistant>"
    r = chat(http, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert_error(r, 400, param="messages.0.content")


def test_chat_logprobs(http):
    r = chat(http, max_tokens=2, logprobs=True, top_logprobs=3)
    lp = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in lp] == ["a", "b"]
    assert lp[0]["logprob"] == -0.25 and lp[0]["bytes"] == [97]
    assert [t["token"] for t in lp[0]["top_logprobs"]] == ["a", "C", "D"]
    assert [t["logprob"] for t in lp[0]["top_logprobs"]] == [-0.25, -2.0, -3.0]
    r = chat(http, max_tokens=2, logprobs=True)
    assert r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    assert http.fake.requests[-1][2].logprobs == 0


def test_chat_stream(http):
    r = chat(http, stream=True, max_tokens=3, n=2)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r)
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    texts = {0: "", 1: ""}
    roles = set()
    finish = {}
    for c in chunks:
        (choice,) = c["choices"]
        delta = choice["delta"]
        if "role" in delta:
            roles.add(choice["index"])
        texts[choice["index"]] += delta.get("content", "")
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "abc", 1: "bcd"} and roles == {0, 1} and finish == {0: "length", 1: "length"}


def test_chat_stream_usage_and_logprobs(http):
    r = chat(http, stream=True, max_tokens=3, stream_options={"include_usage": True}, logprobs=True, top_logprobs=1)
    chunks = events(r)[:-1]
    assert all("usage" in c for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    tokens = [e["token"] for c in chunks[:-1] for ch in c["choices"] if ch["logprobs"]
              for e in ch["logprobs"]["content"]]
    assert tokens == ["a", "b", "c"]


def test_stream_never_sends_part_of_a_stop_string(http):
    r = chat(http, stream=True, stop=["cdX", "zz"], max_tokens=5)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in events(r)[:-1] if c["choices"])
    assert text == "abcde"
    with serve(FakeEngineClient(delay=0.001)) as slow:
        r = chat(slow, stream=True, stop="cd", max_tokens=10)
        deltas = [c["choices"][0]["delta"].get("content", "") for c in events(r)[:-1]]
        assert "".join(deltas) == "ab" and all("c" not in d for d in deltas)


def test_stop_holdback():
    assert stop_holdback("abc", ("cd",)) == 1
    assert stop_holdback("abc", ("xyz",)) == 0
    assert stop_holdback("abcab", ("abcd", "b")) == 2
    assert stop_holdback("xabc", ("abcd", "bc!")) == 3


# -- completions -----------------------------------------------------------------------------


def test_completion_basic(http):
    r = complete(http)
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == "abcdefghijklmnop" and choice["finish_reason"] == "length"  # OpenAI's default 16
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 16, "total_tokens": 22,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert http.fake.requests[-1][1][0] == 1  # plain prompts get the model's BOS


def test_completion_default_max_tokens_is_cut_to_fit(http):
    r = complete(http, prompt="x" * 55)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64 - 56


def test_completion_prompt_forms(http):
    r = complete(http, prompt=[5, 6, 7], max_tokens=1)
    assert r.status_code == 200 and http.fake.requests[-1][1] == [5, 6, 7]
    r = complete(http, prompt=["a", "b"], n=2, max_tokens=2)
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == ["ab", "bc", "ab", "bc"]
    assert r.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    r = complete(http, prompt=[[5, 6], [7]], max_tokens=1)
    assert len(r.json()["choices"]) == 2
    assert [req[1] for req in http.fake.requests[-2:]] == [[5, 6], [7]]


def test_completion_echo_and_logprobs(http):
    r = complete(http, prompt="hey", echo=True, max_tokens=2)
    assert r.json()["choices"][0]["text"] == "heyab"
    r = complete(http, prompt=[3 + ord("h"), 3 + ord("i")], echo=True, max_tokens=1)
    assert r.json()["choices"][0]["text"] == "hia"
    r = complete(http, prompt="hey", logprobs=2, max_tokens=3)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"]
    assert lp["token_logprobs"] == [-0.25] * 3
    assert lp["top_logprobs"][0] == {"a": -0.25, "C": -2.0}
    assert lp["text_offset"] == [0, 1, 2]


def test_truncate_prompt_tokens_keeps_the_prompts_end(http):
    """vLLM's truncate_prompt_tokens: the last k tokens of the prompt reach the engine (after
    the chat template), the echo and usage are theirs; -1 keeps the last max_model_len, so a
    text far past the context is taken instead of refused."""
    r = complete(http, prompt="hello world", truncate_prompt_tokens=5, echo=True, max_tokens=1)
    assert r.status_code == 200, r.text
    assert http.fake.requests[-1][1] == [3 + ord(c) for c in "world"]
    assert r.json()["choices"][0]["text"] == "worlda" and r.json()["usage"]["prompt_tokens"] == 5
    r = complete(http, prompt=[3 + ord(c) for c in "abc"], truncate_prompt_tokens=10, max_tokens=1)
    assert http.fake.requests[-1][1] == [3 + ord(c) for c in "abc"]  # shorter than k: as it is
    assert complete(http, prompt="x" * 500, max_tokens=1).status_code == 400  # too long without it
    r = complete(http, prompt="x" * 500, truncate_prompt_tokens=60, max_tokens=2)
    assert r.status_code == 200, r.text
    assert len(http.fake.requests[-1][1]) == 60
    # -1 keeps the whole context, which leaves no room to generate: the usual 400
    assert_error(complete(http, prompt="x" * 500, truncate_prompt_tokens=-1, max_tokens=2), 400,
                 code="context_length_exceeded", param="prompt")
    r = chat(http, messages=[{"role": "user", "content": "a long question"}], truncate_prompt_tokens=4, max_tokens=1)
    assert r.status_code == 200, r.text
    assert http.fake.requests[-1][1] == [3 + ord(c) for c in "ant>"]  # the end of "<assistant>"


def test_completion_echo_with_logprobs_starts_with_the_prompt(http):
    """As OpenAI's legacy completions: the prompt's tokens first, the first without a logprob,
    text offsets running on through the completion's."""
    r = complete(http, prompt="hey", echo=True, logprobs=1, max_tokens=2)
    (choice,) = r.json()["choices"]
    assert choice["text"] == "heyab" and "prompt_logprobs" not in choice
    lp = choice["logprobs"]
    assert lp["tokens"] == ["", "h", "e", "y", "a", "b"]  # the BOS decodes to nothing here
    assert lp["token_logprobs"] == [None, -1.5, -1.5, -1.5, -0.25, -0.25]
    assert lp["top_logprobs"] == [None, {"B": -0.5, "h": -1.5}, {"B": -0.5, "e": -1.5}, {"B": -0.5, "y": -1.5},
                                  {"a": -0.25}, {"b": -0.25}]
    assert lp["text_offset"] == [0, 0, 1, 2, 3, 4]
    assert http.fake.requests[-1][2].prompt_logprobs == 1  # the engine was asked for them
    # a token-id prompt, and prompt_logprobs beside: the engine computes the more of the two
    r = complete(http, prompt=[3 + ord("h"), 3 + ord("i")], echo=True, logprobs=0, prompt_logprobs=2, max_tokens=1)
    (choice,) = r.json()["choices"]
    assert choice["text"] == "hia" and choice["logprobs"]["tokens"] == ["h", "i", "a"]
    assert choice["logprobs"]["top_logprobs"] == [None, {"i": -1.5}, {"a": -0.25}]
    assert http.fake.requests[-1][2].prompt_logprobs == 2
    assert len(choice["prompt_logprobs"][1]) == 3


def test_completion_prompt_logprobs(http):
    r = complete(http, prompt="hi", prompt_logprobs=2, max_tokens=1, n=2)
    h, i = 3 + ord("h"), 3 + ord("i")
    want = [None,
            {str(h): {"logprob": -1.5, "rank": 7, "decoded_token": "h"},
             str(3 + ord("B")): {"logprob": -0.5, "rank": 1, "decoded_token": "B"},
             str(3 + ord("C")): {"logprob": -1.0, "rank": 2, "decoded_token": "C"}},
            {str(i): {"logprob": -1.5, "rank": 7, "decoded_token": "i"},
             str(3 + ord("B")): {"logprob": -0.5, "rank": 1, "decoded_token": "B"},
             str(3 + ord("C")): {"logprob": -1.0, "rank": 2, "decoded_token": "C"}}]
    assert [c["prompt_logprobs"] for c in r.json()["choices"]] == [want, want]  # each choice, as vLLM
    assert [c["logprobs"] for c in r.json()["choices"]] == [None, None]
    r = complete(http, prompt="hi", max_tokens=1)
    assert "prompt_logprobs" not in r.json()["choices"][0]  # not asked, not there


def test_completion_stream_sends_the_prompt_part_first(http):
    # "é" is two bytes, two tokens that each decode to U+FFFD: the offsets count the tokens'
    # texts (as vLLM's), not the prompt's characters
    r = complete(http, prompt=["hey", "yé"], stream=True, max_tokens=2, echo=True, logprobs=0, prompt_logprobs=1)
    chunks = events(r)[:-1]
    by_choice: dict[int, list[dict]] = {}
    for c in chunks:
        (choice,) = c["choices"]
        by_choice.setdefault(choice["index"], []).append(choice)
    for index, prompt, texts in ((0, "hey", ["", "h", "e", "y"]), (1, "yé", ["", "y", "\ufffd", "\ufffd"])):
        first, *rest = by_choice[index]
        assert first["text"] == prompt and len(first["prompt_logprobs"]) == len(texts)
        assert first["logprobs"]["tokens"] == texts
        assert first["logprobs"]["token_logprobs"] == [None] + [-1.5] * (len(texts) - 1)
        assert all("prompt_logprobs" not in c for c in rest)
        assert "".join(c["text"] for c in rest) == "ab"
        offsets = [o for c in by_choice[index] for o in c["logprobs"]["text_offset"]]
        assert offsets == [0, 0, 1, 2, 3, 4]  # "yé" is 2 characters, its tokens' texts 3
    # prompt_logprobs alone: an empty first chunk carries them, then the text as usual
    chunks = events(complete(http, prompt="hey", stream=True, max_tokens=2, prompt_logprobs=0))[:-1]
    assert chunks[0]["choices"][0]["text"] == "" and len(chunks[0]["choices"][0]["prompt_logprobs"]) == 4
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ab"


def test_chat_prompt_logprobs(http):
    """vLLM puts the chat endpoint's beside the choices; a stream, in its first chunk."""
    r = chat(http, max_tokens=2, prompt_logprobs=0)
    body = r.json()
    _, ids, params = http.fake.requests[-1]
    assert params.prompt_logprobs == 0
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(ids)
    assert body["prompt_logprobs"][1] == {str(ids[1]): {"logprob": -1.5, "rank": 7, "decoded_token": "u"}}  # "<user>..."
    assert "prompt_logprobs" not in chat(http, max_tokens=1).json()
    chunks = events(chat(http, max_tokens=3, n=2, prompt_logprobs=1, stream=True))[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["prompt_logprobs"] == body["prompt_logprobs"][:1] + [
        {**entry, str(3 + ord("B")): {"logprob": -0.5, "rank": 1, "decoded_token": "B"}}
        for entry in body["prompt_logprobs"][1:]]
    assert all("prompt_logprobs" not in c for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == 0) \
        == "abc"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("body, param, message", [
    ({"prompt_logprobs": 21}, "prompt_logprobs", "at most 20"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "every token of the vocabulary"),
    ({"prompt_logprobs": -2}, "prompt_logprobs", None),
    ({"prompt_logprobs": "3"}, "prompt_logprobs", None),
    ({"prompt_logprobs": 2.5}, "prompt_logprobs", None),
])
def test_bad_prompt_logprobs_are_400(http, endpoint, body, param, message):
    r = (chat if endpoint == "chat" else complete)(http, **body)
    error = assert_error(r, 400, param=param)
    if message is not None:
        assert message in error["message"]
    assert not http.fake.requests


def test_echo_logprobs_over_the_cap_name_logprobs(http):
    assert_error(complete(http, echo=True, logprobs=21), 400, param="logprobs")
    assert not http.fake.requests


def test_completion_stream(http):
    r = complete(http, prompt=["a", "b"], stream=True, max_tokens=2, echo=True,
                 stream_options={"include_usage": True})
    chunks = events(r)
    assert chunks[-1] == "[DONE]"
    texts: dict[int, str] = {}
    for c in chunks[:-2]:
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "aab", 1: "bab"}
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == 4
    r = complete(http, stream=True, max_tokens=3, logprobs=0, n=2)
    offsets: dict[int, list[int]] = {}
    tokens: dict[int, list[str]] = {}
    for c in events(r)[:-1]:
        (choice,) = c["choices"]
        if choice["logprobs"]:
            offsets.setdefault(choice["index"], []).extend(choice["logprobs"]["text_offset"])
            tokens.setdefault(choice["index"], []).extend(choice["logprobs"]["tokens"])
    assert offsets == {0: [0, 1, 2], 1: [0, 1, 2]}
    assert tokens == {0: ["a", "b", "c"], 1: ["b", "c", "d"]}


# -- prefix cache: cache_salt in, usage.prompt_tokens_details.cached_tokens out -------------


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_completion_cached_tokens(http):
    prompt = "x" * 40  # 41 tokens with BOS: two whole blocks can come from the cache
    assert cached(complete(http, prompt=prompt, max_tokens=2)) == 0
    assert cached(complete(http, prompt=prompt, max_tokens=2)) == 2 * BLOCK
    # once per prompt, not once per choice
    r = complete(http, prompt=prompt, max_tokens=2, n=3)
    assert cached(r) == 2 * BLOCK and r.json()["usage"]["prompt_tokens"] == 41
    # several prompts: each one's own, summed like prompt_tokens
    r = complete(http, prompt=[prompt, "y" * 40, prompt], max_tokens=1)
    assert cached(r) == 2 * 2 * BLOCK and r.json()["usage"]["prompt_tokens"] == 3 * 41
    chunks = events(complete(http, prompt=prompt, max_tokens=2, n=2, stream=True,
                             stream_options={"include_usage": True}))
    assert chunks[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2 * BLOCK}
    assert all(c["usage"] is None for c in chunks[:-2])


def test_chat_cached_tokens_and_cache_salt(http):
    messages = [{"role": "user", "content": "y" * 40}]  # 58 prompt tokens: three whole blocks
    assert cached(chat(http, messages=messages, max_tokens=2)) == 0
    assert cached(chat(http, messages=messages, max_tokens=2, n=2)) == 3 * BLOCK
    chunks = events(chat(http, messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}))
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3 * BLOCK}
    # a salt keeps a request's cached prefixes apart from those of other salts (and of none)
    assert cached(chat(http, messages=messages, max_tokens=2, cache_salt="tenant-a")) == 0
    assert cached(chat(http, messages=messages, max_tokens=2, cache_salt="tenant-a")) == 3 * BLOCK
    assert cached(chat(http, messages=messages, max_tokens=2, cache_salt="tenant-b")) == 0
    assert cached(complete(http, prompt="z" * 40, max_tokens=1, cache_salt="tenant-b")) == 0
    assert cached(complete(http, prompt="z" * 40, max_tokens=1, cache_salt="tenant-b")) == 2 * BLOCK
    salts = [http.fake.salts[request_id] for request_id, _, _ in http.fake.requests]
    assert salts == [None] * 3 + ["tenant-a", "tenant-a", "tenant-b", "tenant-b", "tenant-b"]


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_bad_cache_salt_is_400(http, salt):
    assert_error(chat(http, cache_salt=salt), 400, param="cache_salt")
    assert_error(complete(http, cache_salt=salt), 400, param="cache_salt")
    assert not http.fake.requests


def test_cache_salt_must_be_unicode(http):
    body = b'{"model": "fake-model", "prompt": "hi", "cache_salt": "a\\ud800"}'  # a lone surrogate
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, param="cache_salt")
    assert not http.fake.requests


def test_prefix_cache_and_preemption_metrics(http):
    for _ in range(2):
        complete(http, prompt="x" * 40, max_tokens=1)
    text = http.get("/metrics").text
    fake = http.fake
    assert (fake.queried_tokens, fake.hit_tokens) == (82, 32)
    expected = {
        "fd:prefix_cache_queries_total": 82.0, "fd:prefix_cache_hits_total": 32.0,
        "fd:prefix_cache_blocks": 2.0, "fd:prefix_cache_evictions_total": 0.0,
        "fd:num_preemptions_swap_total": 0.0, "fd:num_preemptions_recompute_total": 0.0,
        "fd:num_requests_swapped": 0.0, "fd:prompt_tokens_computed_total": 50.0,
    }
    labels = '{engine="0",model_name="fake-model"}'
    for name, value in expected.items():
        (line,) = [ln for ln in text.splitlines() if ln.startswith(name + labels + " ")]
        assert float(line.split()[1]) == pytest.approx(value), line
        kind = "counter" if name.endswith("_total") else "gauge"
        assert f"# TYPE {name} {kind}" in text
        assert f"# HELP {name} " in text


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ({"stop": 3}, None),
    ({"seed": -1}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias.abc"),
    ({"logit_bias": {"-5": 1.0}}, "logit_bias.-5"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias.5"),
    ({"logit_bias": {"5": -101}}, "logit_bias.5"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
    ({"logit_bias": [[5, 1.0]]}, "logit_bias"),
])
def test_chat_validation_errors_are_400(http, body, param):
    error = assert_error(chat(http, **body), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stop": ""}, None),
    ({"min_tokens": 5, "max_tokens": 2}, None),
    ({"logit_bias": {"259": 1.0}}, "logit_bias"),  # past the vocabulary
    ({"logit_bias": {"3000000000": 1.0}}, "logit_bias"),  # past any token id
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto needs the flags
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "a(", "structured_outputs": {"regex": "b"}}, "guided_regex"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"chat_template_kwargs": {"explode": True}}, "messages"),
    ({"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}, "chat_template_kwargs"),
    ({"stop_token_ids": [9999]}, "stop_token_ids"),
    ({"allowed_token_ids": [3, 9999]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": ["fine", "   "]}, "bad_words"),
    # fields of OpenAI and vLLM that fd does not honour (fd_server.refused)
    ({"use_beam_search": True}, "use_beam_search"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"priority": 1}, "priority"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),  # past max_model_len (64)
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"logits_processors": ["pkg.Proc"]}, "logits_processors"),
])
def test_chat_semantic_errors_are_400(http, body, param):
    assert_error(chat(http, **body), 400, param=param)
    assert not http.fake.requests


@pytest.mark.parametrize("body, param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": [1.5]}, None),
    ({"logprobs": 21}, "logprobs"),  # over the default --max-logprobs (20)
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"prompt": ["ok", [1] * 70]}, "prompt.1"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's whole vocabulary
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"media_io_kwargs": {"video": {"num_frames": 8}}}, "media_io_kwargs"),
    ({"allowed_token_ids": [99999]}, "allowed_token_ids"),
    ({"logit_bias": {"x1": 1.0}}, "logit_bias.x1"),
    ({"logit_bias": {"9999": -1.0}}, "logit_bias"),
])
def test_completion_errors_are_400(http, body, param):
    assert_error(complete(http, **body), 400, param=param)
    assert not http.fake.requests  # a bad prompt anywhere rejects the whole request


def test_every_refused_field_is_declared_where_it_is_checked():
    """``refused.check`` sees only declared fields (the schema drops unknown ones), so a rule
    whose field a request model does not declare would let that field through silently."""
    from fd_server import refused
    from fd_server.protocol import ChatCompletionRequest, CompletionRequest

    for model, own in ((ChatCompletionRequest, refused.CHAT), (CompletionRequest, refused.COMPLETIONS)):
        missing = [name for name in (*refused.SHARED, *own) if name not in model.model_fields]
        assert not missing, f"{model.__name__} does not declare {missing}"


def test_logit_bias_reaches_the_engine_with_token_ids_as_keys(http):
    assert chat(http, logit_bias={"5": 1, "258": -100.0, "007": 2.5}).status_code == 200
    assert complete(http, logit_bias={"0": 100}).status_code == 200
    assert complete(http, logit_bias={}).status_code == 200
    assert [p.logit_bias for _, _, p in http.fake.requests] == [{5: 1.0, 258: -100.0, 7: 2.5}, {0: 100.0}, None]


def test_logit_bias_on_a_backend_whose_sampler_predates_it_is_400(http):
    """The core says why its sample ops cannot take the bias (a plugin written before API 1.11):
    a biased request is refused naming the field, on both endpoints; others run."""
    http.fake.unavailable = {"logit_bias": "on the cpu backend, its sample op (old-sample, from fd-backend-old) was "
                                           "written for plugin API 1.10, before 1.11"}
    for response in (chat(http, logit_bias={"5": 1.0}), complete(http, logit_bias={"5": 1.0})):
        error = assert_error(response, 400, param="logit_bias")
        assert "logit_bias is unavailable" in error["message"] and "fd-backend-old" in error["message"]
    assert not http.fake.requests
    assert chat(http).status_code == 200 and complete(http, logit_bias={}).status_code == 200


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
])
def test_structured_output_where_it_cannot_run_is_400_naming_its_source(http, extra, param):
    """The backend cannot constrain: the 400 names the field the constraint came from (a
    required or named tool choice is enforced with structured output; that was a 500)."""
    http.fake.unavailable = {"structured_outputs": "on the cpu backend, its sample op predates 1.10"}
    error = assert_error(chat(http, **extra), 400, param=param)
    assert "structured_outputs is unavailable" in error["message"]
    assert not http.fake.requests


def test_malformed_bodies_are_400(http):
    for content in (b"{not json", b"[1, 2]", b"", b'"text"'):
        r = http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        assert_error(r, 400)
    # without a JSON content type the body is not parsed (a browser could send it cross-site)
    r = http.post("/v1/completions", content=json.dumps({"model": MODEL, "prompt": "x"}),
                  headers={"content-type": "text/plain"})
    assert "Content-Type: application/json" in assert_error(r, 400)["message"]
    r = http.post("/v1/completions", content=b'{"model": "fake-model", "prompt": "x", "temperature": NaN}',
                  headers={"content-type": "application/json"})
    assert_error(r, 400, param="temperature")


def test_oversized_body_is_413(http):
    r = http.post("/v1/completions", content=b"x" * (33 << 20), headers={"content-type": "application/json"})
    assert_error(r, 413, code="request_too_large")


def test_context_length_exceeded(http):
    error = assert_error(complete(http, prompt="x" * 80), 400, code="context_length_exceeded", param="prompt")
    assert "max_model_len" in error["message"]
    assert_error(chat(http, messages=[{"role": "user", "content": "x" * 80}]), 400,
                 code="context_length_exceeded", param="messages")
    assert_error(complete(http, prompt="x", max_tokens=63), 400, code="context_length_exceeded", param="max_tokens")
    assert complete(http, prompt="x", max_tokens=62).status_code == 200


def test_unknown_model_is_404(http):
    error = assert_error(chat(http, model="gpt-4"), 404, code="model_not_found", param="model")
    assert MODEL in error["message"]
    assert_error(complete(http, model="other"), 404)


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)


def test_api_key():
    with serve(api_key="sekret") as http:
        assert_error(chat(http), 401, code="invalid_api_key")
        assert_error(http.post("/v1/chat/completions", content=b"{bad json"), 401)
        assert_error(http.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert http.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                       headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        for path in ("/health", "/metrics", "/version"):  # probes and scrapers need no secret
            assert http.get(path).status_code == 200


def test_engine_errors_map_to_status(http):
    http.fake.fail_with = InvalidRequestError("bad thing")
    assert_error(chat(http), 400)
    http.fake.fail_with = RuntimeError("kaboom")
    error = assert_error(chat(http), 500, code="internal_error")
    assert "kaboom" not in error["message"]  # internals stay in the log
    r = chat(http, stream=True)
    assert r.status_code == 200
    evs = events(r)
    assert evs[-1] != "[DONE]" and evs[-1]["error"]["code"] == "internal_error"
    http.fake.fail_with = None
    assert chat(http, max_tokens=1).status_code == 200


def test_models_version_health_metrics(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == MODEL and models["data"][0]["object"] == "model"
    assert models["data"][0]["max_model_len"] == 64 and models["data"][0]["root"] == "/models/fake"
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(http.get("/v1/models/other"), 404, code="model_not_found")
    assert "version" in http.get("/version").json()
    assert http.get("/health").status_code == 200
    chat(http, max_tokens=3)
    text = http.get("/metrics").text
    labels = '{engine="0",model_name="fake-model"}'
    for name in ("fd:num_requests_running", "fd:num_requests_waiting", "fd:kv_cache_usage_perc",
                 "fd:kv_cache_free_blocks" + labels + " 100.0", "fd:kv_cache_total_blocks" + labels + " 100.0",
                 "fd:prompt_tokens_total", "fd:generation_tokens_total" + labels + " 3.0",
                 "fd:time_to_first_token_seconds_bucket", "fd:inter_token_latency_seconds_bucket",
                 "fd:request_time_per_output_token_seconds_bucket", "fd:e2e_request_latency_seconds_count",
                 'fd:request_success_total{engine="0",finished_reason="length",model_name="fake-model"} 1.0',
                 'fd:request_success_total{engine="0",finished_reason="stop",model_name="fake-model"} 0.0'):
        assert name in text, name


def test_two_apps_have_separate_metrics():
    with serve() as a, serve() as b:
        chat(a, max_tokens=1)
        count = 'fd:e2e_request_latency_seconds_count{engine="0",model_name="fake-model"}'
        assert count + " 1.0" in a.get("/metrics").text
        assert count + " 0.0" in b.get("/metrics").text


def test_openapi_documents_both_endpoints(http):
    spec = http.get("/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "429", "503"} <= set(responses)
        assert "422" not in responses
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        bias = spec["components"]["schemas"][request]["properties"]["logit_bias"]["anyOf"][0]
        assert bias["maxProperties"] == 1024
        assert bias["patternProperties"] == {"^[0-9]{1,10}$": {"type": "number", "minimum": -100, "maximum": 100}}


# -- concurrency, disconnects, a dead engine (real sockets) ----------------------------------


@contextmanager
def live_server(fake: FakeEngineClient, **kw: Any):
    """The app under uvicorn in a thread, on a free loopback port."""
    import uvicorn

    app = build_app(fake, MODEL, **kw)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(10)


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_disconnect_aborts_streaming_and_plain_requests():
    fake = FakeEngineClient(max_model_len=10_000, delay=0.01)
    with live_server(fake) as (url, app), httpx.Client(base_url=url, timeout=10) as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if '"content":"a' in line.replace(" ", ""):
                    break
        wait_for(lambda: len(fake.aborted) == 1 and not fake.active)
        # a non-streamed request whose client gives up
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5000}, timeout=0.3)
        wait_for(lambda: len(fake.aborted) == 2 and not fake.active)
        assert app.state.monitor.in_flight == 0 and not app.state.monitor.streams


def test_max_concurrency_429():
    fake = FakeEngineClient(max_model_len=10_000, delay=0.01)
    with live_server(fake, limits=ServerLimits(max_concurrency=2)) as (url, app), httpx.Client(base_url=url, timeout=10) as http:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 5000, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as a, \
                http.stream("POST", "/v1/completions", json=body) as b:
            lines = a.iter_lines(), b.iter_lines()  # kept: a dropped iterator closes its response
            next(lines[0]), next(lines[1])
            r = http.post("/v1/completions", json={**body, "stream": False})
            assert_error(r, 429, code="rate_limit_exceeded")
            assert r.headers["retry-after"] == "1"
        wait_for(lambda: app.state.monitor.in_flight == 0)
        assert http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2}).status_code == 200


def test_dead_engine_ends_everything_with_503():
    fake = FakeEngineClient(max_model_len=10_000, delay=0.02)
    with live_server(fake) as (url, app), httpx.Client(base_url=url, timeout=10) as http:
        results: dict[str, Any] = {}

        def plain() -> None:
            results["plain"] = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5000})

        worker = threading.Thread(target=plain)
        worker.start()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            wait_for(lambda: len(fake.active) == 2)
            t0 = time.monotonic()
            fake.die()
            rest = [line for line in lines if line.startswith("data: ")]
        worker.join(5)
        assert time.monotonic() - t0 < 2
        last = json.loads(rest[-1][len("data: "):])
        assert last["error"]["code"] == "engine_unavailable"
        assert_error(results["plain"], 503, code="engine_unavailable")
        assert_error(http.get("/health"), 503)
        assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 503)
        assert app.state.monitor.dead.is_set()


def test_unhealthy_engine_is_noticed_without_traffic():
    fake = FakeEngineClient()
    with live_server(fake) as (url, app):
        fake.healthy = False  # a dead process, nothing in flight
        wait_for(app.state.monitor.dead.is_set, timeout=2)
        assert httpx.get(url + "/health").status_code == 503


# -- limits, timeouts, health (issue 14) -------------------------------------------------------


def test_request_timeout_aborts_and_answers_504():

    fake = FakeEngineClient(max_model_len=10_000, delay=0.01)
    with live_server(fake, limits=ServerLimits(request_timeout=0.5)) as (url, app), \
            httpx.Client(base_url=url, timeout=10) as http:
        started = time.monotonic()
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5000})
        assert 0.5 <= time.monotonic() - started < 5
        error = assert_error(r, 504, code="request_timeout")
        assert "0.5 s" in error["message"] and "--request-timeout" in error["message"]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as s:
            data = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert json.loads(data[-1][len("data: "):])["error"]["code"] == "request_timeout"
        wait_for(lambda: len(fake.aborted) == 2 and not fake.active)
        assert app.state.monitor.in_flight == 0
        # a request that finishes in time is untouched
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}).status_code == 200
        assert http.get("/health").status_code == 200


def test_a_silent_engine_is_stalled_not_dead():

    fake = FakeEngineClient()
    age = [0.0]
    fake.report_age = lambda: age[0]  # type: ignore[attr-defined]
    with serve(fake, limits=ServerLimits(heartbeat_timeout=2.0)) as http:
        assert http.get("/health").status_code == 200
        age[0] = 3.5
        error = assert_error(http.get("/health"), 503, code="engine_unavailable")
        assert "not reported for 4 s" in error["message"] or "not reported for 3 s" in error["message"]
        assert_error(complete(http), 503, code="engine_unavailable")
        assert "fd:engine_report_age_seconds" not in http.get("/metrics").text  # the fake does not report it
        assert not http.app.state.monitor.dead.is_set()  # a stall is not a death: the server stays up
        age[0] = 0.1
        assert http.get("/health").status_code == 200 and complete(http).status_code == 200
    with serve(fake, limits=ServerLimits(heartbeat_timeout=None)) as http:
        age[0] = 1e6
        assert http.get("/health").status_code == 200  # liveness only


def test_chunked_body_over_the_limit_is_413_before_it_is_read():

    fake = FakeEngineClient()
    with live_server(fake, limits=ServerLimits(max_body_bytes=4096)) as (url, app):
        sent = []

        def body():
            for _ in range(10_000):  # 10 MB if it were all read
                sent.append(1)
                yield b"x" * 1024

        try:
            r = httpx.post(url + "/v1/completions", content=body(), headers={"content-type": "application/json"},
                           timeout=10)
            assert_error(r, 413, code="request_too_large")
        except httpx.TransportError:
            pass  # the server answered and closed while the client still wrote; it read no more either
        assert len(sent) < 10_000
        small = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        r = httpx.post(url + "/v1/completions", content=iter([small[:10], small[10:]]),
                       headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 200, r.text  # a chunked body within the limit is read whole


def test_prompts_times_n_over_the_limit_is_400(http):

    with serve(limits=ServerLimits(max_sequences_per_request=8)) as http:
        error = assert_error(complete(http, prompt=["a", "b", "c"], n=3), 400, param="prompt")
        assert "9 sequences" in error["message"] and "--max-sequences-per-request" in error["message"]
        assert_error(chat(http, n=9), 400, param="n")
        assert not http.fake.requests
        assert complete(http, prompt=["a", "b"], n=4, max_tokens=1).status_code == 200
    with serve(limits=ServerLimits(max_sequences_per_request=None)) as http:
        assert complete(http, prompt=["a"] * 20, n=3, max_tokens=1).status_code == 200


@pytest.mark.parametrize("field, value", [("top_k", 2**31), ("seed", 2**63), ("n", 129), ("min_tokens", 2**31),
                                          ("max_tokens", 2**31), ("stop_token_ids", [2**31]),
                                          ("stop", ["x"] * 65), ("stop", "x" * 1025), ("prompt", [2**31])])
def test_bounds_are_400_naming_the_field(http, field, value):
    assert assert_error(complete(http, **{field: value}), 400)["param"].split(".")[0] == field
    assert not http.fake.requests


def test_content_none_is_only_for_assistant_messages(http):
    assert_error(chat(http, messages=[{"role": "user"}]), 400, param="messages.0.content")
    ok = chat(http, messages=[{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                              {"role": "user", "content": "and?"}])
    assert ok.status_code == 200, ok.text


def test_tokenization_runs_off_the_event_loop():
    """While a prompt is being tokenized, /health and other requests are answered."""
    fake = FakeEngineClient()
    started, release = threading.Event(), threading.Event()
    encode = fake.tokenizer.encode

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if text == "slow":
            started.set()
            assert release.wait(10)
        return encode(text, add_special_tokens)

    fake.tokenizer.encode = slow_encode  # type: ignore[method-assign]
    with live_server(fake) as (url, app), httpx.Client(base_url=url, timeout=10) as http:
        result: dict[str, httpx.Response] = {}
        worker = threading.Thread(target=lambda: result.update(
            slow=http.post("/v1/completions", json={"model": MODEL, "prompt": "slow", "max_tokens": 2})))
        worker.start()
        assert started.wait(10)
        try:
            assert http.get("/health").status_code == 200  # the event loop is free meanwhile
            assert http.post("/v1/completions", json={"model": MODEL, "prompt": "fast", "max_tokens": 2}).status_code == 200
            assert "slow" not in result
        finally:
            release.set()
        worker.join(10)
        assert result["slow"].status_code == 200
