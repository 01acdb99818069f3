"""vLLM's request fields ``continue_final_message``, chat ``echo`` and ``return_token_ids``
through a real ``fd serve`` and the official ``openai`` client (SmolLM2 on the cpu backend and
on an emulated vendor backend): a prefilled assistant reply is continued exactly as the
completions endpoint continues the same text, ``echo`` puts the prefix back in front, and the
token ids returned are the prompt's and the output's, whole and streamed."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from fd_core.loader import resolve_model
from fd_core.loader.formats import load_tokenizer
from tests.test_structured_server import MODEL, door_only, oai, server  # noqa: F401 - the fixtures

PREFILL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]
OPEN = {"continue_final_message": True, "add_generation_prompt": False}


def test_a_prefilled_reply_is_continued_as_its_text_would_be(oai):  # noqa: F811
    tokenizer = load_tokenizer(resolve_model(MODEL))
    text = tokenizer.apply_chat_template(PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")
    chat = oai.chat.completions.create(model=MODEL, messages=PREFILL, max_tokens=6, temperature=0, extra_body=OPEN)
    plain = oai.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))

    echoed = oai.chat.completions.create(model=MODEL, messages=PREFILL, max_tokens=6, temperature=0,
                                         extra_body={**OPEN, "echo": True})
    assert echoed.choices[0].message.content == "The capital of France is" + plain.choices[0].text
    chunks = oai.chat.completions.create(model=MODEL, messages=PREFILL, max_tokens=6, temperature=0, stream=True,
                                         extra_body={**OPEN, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed.choices[0].message.content


@pytest.mark.parametrize("extra, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt left true
    ({**OPEN, "messages": [PREFILL[0], {"role": "assistant", "content": " "}]}, "messages"),
])
def test_a_reply_that_cannot_be_continued_is_a_400(oai, extra, param):  # noqa: F811
    body = {"model": MODEL, "messages": PREFILL, "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**{k: body[k] for k in ("model", "messages", "max_tokens")},
                                    extra_body={k: v for k, v in body.items() if k not in ("model", "messages", "max_tokens")})
    assert e.value.body["param"] == param, e.value.body


def test_return_token_ids_are_the_prompts_and_the_outputs(oai):  # noqa: F811
    tokenizer = load_tokenizer(resolve_model(MODEL))
    ask = [{"role": "user", "content": "Name a colour."}]
    text = tokenizer.apply_chat_template(ask, add_generation_prompt=True)
    extra = {"return_token_ids": True}
    chat = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=5, temperature=0, extra_body=extra)
    body = chat.model_dump()
    assert body["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)
    ids = body["choices"][0]["token_ids"]
    assert len(ids) == chat.usage.completion_tokens and tokenizer.decode(ids) == chat.choices[0].message.content
    chunks = [c.model_dump() for c in oai.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=5, temperature=0, stream=True, extra_body=extra)]
    assert chunks[0]["prompt_token_ids"] == body["prompt_token_ids"]
    assert all(c.get("prompt_token_ids") is None for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == ids

    plain = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                   n=2, extra_body=extra).model_dump()
    prompt = tokenizer.encode("The capital of France is")
    for choice in plain["choices"]:
        assert choice["prompt_token_ids"] == prompt and tokenizer.decode(choice["token_ids"]) == choice["text"]
    streamed = [c.model_dump() for c in oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, n=2, stream=True,
        extra_body=extra)]
    for index in (0, 1):
        mine = [ch for c in streamed for ch in c["choices"] if ch["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompt and all(ch.get("prompt_token_ids") is None for ch in mine[1:])
        assert [t for ch in mine for t in ch.get("token_ids") or []] == plain["choices"][index]["token_ids"]
    # not asked: not there
    assert "prompt_token_ids" not in oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=2).model_dump()
