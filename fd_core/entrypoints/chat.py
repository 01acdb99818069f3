"""``fd chat``: a terminal conversation, with a local model or with a running server."""

from __future__ import annotations

import json
import sys
from typing import Callable, Iterator

from fd_core.engine.config import EngineConfig

_HELP = "Type a message and press Enter. /reset starts over, /exit (or Ctrl-D) quits."


def _loop(reply: Callable[[list[dict[str, str]]], Iterator[str]]) -> int:
    print(_HELP)
    messages: list[dict[str, str]] = []
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = []
            continue
        messages.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        text = ""
        try:
            for piece in reply(messages):
                text += piece
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            pass  # stop this answer, keep the conversation
        print()
        messages.append({"role": "assistant", "content": text})


def chat_local(config: EngineConfig, max_tokens: int, temperature: float) -> int:
    from fd_core.engine.engine import LLMEngine
    from fd_core.engine.sampling_params import SamplingParams

    engine = LLMEngine(config)
    counter = iter(range(sys.maxsize))

    def reply(messages: list[dict[str, str]]) -> Iterator[str]:
        tok = engine.tokenizer
        prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
        rid = f"chat-{next(counter)}"
        engine.add_request(rid, prompt, SamplingParams(temperature=temperature, max_tokens=max_tokens))
        shown = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    text = out.outputs[0].text
                    yield text[shown:]
                    shown = len(text)
        finally:
            engine.abort_request(rid)

    return _loop(reply)


def chat_remote(base_url: str, api_key: str | None, model: str | None, max_tokens: int,
                temperature: float) -> int:
    import httpx

    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # connecting may fail fast; a reply may take as long as the model needs
    client = httpx.Client(base_url=base_url, headers=headers, timeout=httpx.Timeout(None, connect=10.0))

    def unreachable(exc: Exception) -> SystemExit:
        return SystemExit(f"fd chat: cannot reach a server at {base_url} ({type(exc).__name__}: "
                          f"{str(exc) or 'no answer'}); is `fd serve` running there?")

    if model is None:
        try:
            response = client.get("/v1/models")
        except httpx.TransportError as exc:
            raise unreachable(exc) from None
        if response.status_code != 200:
            raise SystemExit(f"fd chat: {base_url}/v1/models answered {response.status_code}: {response.text[:300]}")
        try:
            model = response.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise SystemExit(f"fd chat: {base_url}/v1/models did not list a model: {response.text[:300]}") from None

    def reply(messages: list[dict[str, str]]) -> Iterator[str]:
        body = {"model": model, "messages": messages, "stream": True, "max_tokens": max_tokens,
                "temperature": temperature}
        try:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise SystemExit(f"fd chat: the server answered {response.status_code}: {response.text}")
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    for choice in chunk.get("choices", []):
                        yield choice.get("delta", {}).get("content") or ""
        except httpx.TransportError as exc:  # the server went away mid-conversation
            raise unreachable(exc) from None

    return _loop(reply)
