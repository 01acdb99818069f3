"""Structured output in the engine: the request's checks, the grammar holding on a model whose
random weights would otherwise write anything, asynchronous scheduling giving the synchronous
outputs, and what happens on backends that cannot or do not apply the bitmask."""

from __future__ import annotations

import json
import re
import time

import pytest

pytest.importorskip("transformers")  # the checkpoint is built with transformers
pytest.importorskip("llguidance")

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.engine.wire import params_from_wire, params_to_wire  # noqa: E402
from fd_core.engine.structured import StructuredOutputsParams as S  # noqa: E402
from fd_core.engine.structured.params import ascii_classes  # noqa: E402
from fd_core.errors import InvalidRequestError  # noqa: E402
from fd_core.plugins import registry as registry_module  # noqa: E402
from fd_core.plugins.registry import BackendRegistry  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.test_async_scheduling import HostFed, HostGate, async_cpu, deferred_cpu  # noqa: E402, F401 - fixtures

REGEX = r"[ab]{2,5}c\d"
CHOICES = ["alpha", "beta gamma", "δ"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["x", "yy"]}},
          "required": ["n", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("structured"))


def run(model_dir, params, n_prompts=6, **engine_args):
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512, **engine_args)
    prompts = [f"prompt number {i} says" for i in range(n_prompts)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.pool.num_free == llm.engine.pool.capacity
    return llm, [c for o in outs for c in o.outputs]


# -- the request ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, param", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
    ({"json": "{nope"}, "structured_outputs.json"),
    ({"json": ["not", "a", "schema"]}, "structured_outputs.json"),
    ({"json": {"type": "wat"}}, "structured_outputs.json"),
    ({"json": {"type": "integer", "minimum": "x"}}, "structured_outputs.json"),
    ({"json": {"": None, " ": [-18446744073709551616]}}, "structured_outputs.json"),  # past 64 bits (a fuzz's)
    ({"regex": "a(b"}, "structured_outputs.regex"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"grammar": "root ::= (("}, "structured_outputs.grammar"),
    ({"grammar": "start: missing_rule"}, "structured_outputs.grammar"),
    ({"json_object": False}, "structured_outputs"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace"),
])
def test_bad_constraints_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        S(**kwargs)
    assert info.value.param == param, str(info.value)


def test_unknown_fields_on_the_wire_are_refused():
    with pytest.raises(InvalidRequestError, match="structural_tag"):
        SamplingParams(structured_outputs={"regex": "a", "structural_tag": {}})


def test_the_wire_form_round_trips():
    for so in (S(json=SCHEMA, disable_any_whitespace=True), S(regex=REGEX), S(choice=CHOICES),
               S(grammar='start: "a"+'), S(json_object=True), S(json=json.dumps(SCHEMA),
                                                                 disable_additional_properties=True)):
        params = SamplingParams(max_tokens=5, structured_outputs=so)
        back = params_from_wire(params_to_wire(params))
        assert back.structured_outputs == so and back.structured_outputs.spec == so.spec


def test_digits_and_word_characters_are_ascii():
    assert ascii_classes(r"\d+\.\w[\d_]\\d[^\d]") == r"[0-9]+\.[0-9A-Za-z_][0-9_]\\d[^0-9]"


def test_strict_closes_objects():
    from fd_core.engine.structured.params import _closed

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "object", "additionalProperties": True,
                                                     "properties": {}}}}
    closed = _closed(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True  # said: kept


# -- the engine -----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_weights_still_obey_the_grammar(model_dir, temperature):
    """A random model would write anything; every finished output must match."""
    kinds = [S(regex=REGEX), S(choice=CHOICES), S(json=SCHEMA, disable_any_whitespace=True)]
    for so in kinds:
        params = SamplingParams(temperature=temperature, seed=4, max_tokens=60, n=2, structured_outputs=so)
        _, outs = run(model_dir, params)
        for o in outs:
            assert o.finish_reason in ("stop", "length"), o
            if so.kind == "regex":
                assert o.finish_reason == "stop" and re.fullmatch(r"[ab]{2,5}c[0-9]", o.text), o.text
            elif so.kind == "choice":
                assert o.finish_reason == "stop" and o.text in CHOICES, o.text
            elif o.finish_reason == "stop":
                value = json.loads(o.text)
                assert set(value) == {"n", "tag"} and 0 <= value["n"] <= 99 and value["tag"] in ("x", "yy")


def test_constrained_and_free_rows_share_a_batch(model_dir):
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512)
    alone = llm.generate(["free text here"], free, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(["free text here", "constrained"],
                        [free, SamplingParams(temperature=0, max_tokens=20, structured_outputs=S(choice=CHOICES))],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone  # the mask of one row leaves the others alone
    assert outs[1].outputs[0].text in CHOICES


@pytest.mark.parametrize("backend", ["async_cpu", "deferred_cpu"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, structured_outputs=S(json=SCHEMA)),
    SamplingParams(temperature=0.9, seed=7, max_tokens=40, n=2, structured_outputs=S(regex=REGEX)),
    [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
     SamplingParams(temperature=0.9, seed=3, max_tokens=20, structured_outputs=S(choice=CHOICES)),
     SamplingParams(temperature=0.9, seed=5, max_tokens=30, allowed_token_ids=list(range(3, 300)),
                    structured_outputs=S(regex=REGEX))] * 2,
], ids=["greedy-json", "seeded-regex-forks", "mixed"])
def test_async_scheduling_gives_the_synchronous_outputs(request, model_dir, params, backend):
    """The mask of step t+1 needs step t's token: the engine reads that step while the next
    forward runs (async_cpu), or its grammar thread fills the mask while the device holds the
    sample (deferred_cpu); constrained rows come out as the synchronous engine's."""
    request.getfixturevalue(backend)
    _, sync = run(model_dir, params, async_scheduling=False)
    before, made = HostFed.fed, HostGate.made
    llm, overlapped = run(model_dir, params)
    core = llm.engine.core
    assert core.async_scheduling
    if backend == "async_cpu":
        assert HostFed.fed > before and core._masks is None
    else:
        assert HostGate.made > made and core._masks is not None
    assert [(o.token_ids, o.finish_reason) for o in overlapped] == [(o.token_ids, o.finish_reason) for o in sync]


def test_steps_defer_their_masks_by_their_constrained_rows(deferred_cpu, model_dir, monkeypatch):  # noqa: F811
    """From ``DEFER_ROWS`` constrained rows a step's masks go to the grammar thread, below it
    they are filled on the engine's thread; as requests end the engine goes from one to the
    other and back (new requests), and the outputs stay the synchronous engine's."""
    from fd_core.engine import core as core_module
    from fd_core.engine.structured.matchers import GrammarMatchers

    monkeypatch.setattr(core_module, "DEFER_ROWS", 3)
    inline = []
    real = GrammarMatchers.fill
    monkeypatch.setattr(GrammarMatchers, "fill", lambda self, seqs, batch: (
        inline.append(len(self.constrained(seqs))), real(self, seqs, batch))[1])  # the engine's thread's fills
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=[6, 12, 30, 18][i % 4],
                             structured_outputs=S(regex=REGEX) if i % 2 else S(json=SCHEMA)) for i in range(8)]
    prompts = [f"prompt number {i} says" for i in range(8)]
    sync = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512, max_num_seqs=4,
               async_scheduling=False).generate(prompts, params, use_tqdm=False)
    inline.clear()
    made = HostGate.made
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512, max_num_seqs=4)
    overlapped = llm.generate(prompts, params, use_tqdm=False)
    assert HostGate.made > made and any(0 < rows < 3 for rows in inline)
    assert ([[(c.token_ids, c.finish_reason) for c in o.outputs] for o in overlapped]
            == [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in sync])


def test_a_failing_grammar_thread_fails_the_step_without_a_hang(deferred_cpu, model_dir, monkeypatch):  # noqa: F811
    """The device waits for the mask: a fill that raises still releases it, and the engine's
    thread raises what went wrong instead of waiting for ever."""
    from fd_core.engine.structured.matchers import GrammarMatchers

    def broken(self, rows, mask, base):
        raise ValueError("no mask today")

    monkeypatch.setattr(GrammarMatchers, "fill_rows", broken)
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512)
    with pytest.raises(RuntimeError, match="grammar thread failed: ValueError"):
        llm.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=S(regex=REGEX)), use_tqdm=False)
    worker = llm.engine.core._masks
    llm.engine.core.shutdown()
    assert not worker._thread.is_alive()


def _registry_with_sample(source: str, api: str, sample):
    registry = BackendRegistry()
    with registry.ops.registering(source, api):
        registry.ops.register("sample", "cpu", sample, name="plugin-sample", priority=5, runtime="paddle")
    return registry


def test_a_sample_op_older_than_the_bitmask_is_refused_at_the_door(monkeypatch, model_dir):
    from fd_core.runtimes.paddle.ops import REFERENCE_OPS

    monkeypatch.setattr(registry_module, "_registry", _registry_with_sample("fd-backend-old", "1.9",
                                                                           REFERENCE_OPS["sample"]))
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512)
    with pytest.raises(InvalidRequestError, match=r"plugin-sample, from fd-backend-old\) was written for plugin API "
                                                  r"1\.9, before 1\.10") as info:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=S(regex="a+")), use_tqdm=False)
    assert info.value.param == "structured_outputs"
    assert llm.generate(["x"], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids  # unconstrained: fine


def test_a_backend_that_ignores_the_bitmask_ends_the_sequence(monkeypatch, model_dir, caplog):
    """Declared 1.10 but drops the mask: the first token the grammar refuses ends the sequence
    with ``abort`` and an error in the log; the engine goes on."""
    from fd_core.runtimes.paddle.ops import REFERENCE_OPS

    def careless(logits, batch):
        batch.allowed_token_bitmask = None
        return REFERENCE_OPS["sample"](logits, batch)

    monkeypatch.setattr(registry_module, "_registry", _registry_with_sample("fd-backend-careless", "1.10", careless))
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512)
    outs = llm.generate(["x", "y"], [SamplingParams(temperature=0, max_tokens=6, structured_outputs=S(regex="q{6}")),
                                     SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "abort"
    assert len(outs[1].outputs[0].token_ids) == 6
    assert "did not apply the allowed-token bitmask" in caplog.text


def test_templates_are_cached(model_dir):
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=10, structured_outputs=S(choice=CHOICES))
    llm.generate(["a"], params, use_tqdm=False)
    grammars = llm.engine.core.grammars
    first = dict(grammars._templates)
    llm.generate(["b", "c"], SamplingParams(temperature=0, max_tokens=10, structured_outputs=S(choice=CHOICES)),
                 use_tqdm=False)
    assert dict(grammars._templates) == first and len(first) == 1
    # with a pool of three threads, a grammar's first three requests compile a template each
    # (copies of one template share state the pool serialises on), the others copy them in turn
    grammars.pool = 3
    so = S(regex=REGEX)
    before = grammars.compile_seconds
    made = [grammars.grammar(so) for _ in range(7)]
    templates, count = grammars._templates[so.spec]
    assert len(templates) == 3 and count == [7] and grammars.compile_seconds > before
    assert all(g.matcher.is_error() is False for g in made)


def test_masks_cover_the_padded_vocabulary(model_dir):
    """The model's vocabulary (512) is wider than its tokenizer's: the padding ids are never
    allowed under a grammar."""
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512)
    core = llm.engine.core
    assert core.model_config.vocab_size > core.tokenizer.vocab_size
    llm.generate(["a"], SamplingParams(max_tokens=2, structured_outputs=S(json_object=True)), use_tqdm=False)
    from fd_core.interfaces.ops import unpack_token_bitmask

    class Row:
        grammar = core.grammars.grammar(S(json_object=True))

    class Batch:
        allowed_token_bitmask = None

    batch = Batch()
    core.grammars.fill([Row()], batch)
    allowed = unpack_token_bitmask(batch.allowed_token_bitmask, core.model_config.vocab_size)[0]
    assert allowed.any() and not allowed[core.tokenizer.vocab_size:].any()


def _single_token_text(llm, tokens, start):
    """Text of one output token at or after ``start`` that tokenizes back to that token alone."""
    tokenizer = llm.engine.core.tokenizer
    for i in range(start, len(tokens)):
        text = tokenizer.decode([tokens[i]])
        if text.strip() and tokenizer.encode(text, add_special_tokens=False) == [tokens[i]]:
            return i, text
    pytest.skip("no token that tokenizes back to itself")


@pytest.mark.parametrize("scheduling", ["sync", "async", "deferred"])
def test_a_grammar_can_wait_for_its_start(request, model_dir, scheduling, monkeypatch):
    """``starts_after`` (a reasoning model's end of thought): the output is free, and the same
    as without a grammar, up to and including the waking tokens; the grammar holds after. A
    constrained request beside it keeps its steps' masks deferred (deferred_cpu) while it
    wakes: the grammar thread must see it wake before it fills that step's masks."""
    request.getfixturevalue("deferred_cpu" if scheduling == "deferred" else "async_cpu")
    if scheduling == "deferred":  # the grammar thread lags: the engine queues the next step first
        from fd_core.engine.structured.worker import Advance

        run = Advance.run
        monkeypatch.setattr(Advance, "run", lambda self: (time.sleep(0.02), run(self))[1])
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512,
              async_scheduling=scheduling != "sync")
    beside = SamplingParams(temperature=0, max_tokens=60, structured_outputs=S(json=SCHEMA))

    def first(params):
        outs = llm.generate(["prompt number 0 says", "beside it"], [params, beside], use_tqdm=False)
        return outs[0].outputs[0], outs[1].outputs[0]

    free, companion = first(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    free = free.token_ids
    at, trigger = _single_token_text(llm, free, 2)
    assert len(companion.token_ids) > at + 2  # constrained while the other wakes
    out, _ = first(SamplingParams(temperature=0, max_tokens=30, structured_outputs=S(regex=REGEX, starts_after=trigger)))
    assert out.token_ids[:at + 1] == free[:at + 1]
    answer = llm.engine.core.tokenizer.decode(out.token_ids[at + 1:])
    assert re.fullmatch(REGEX, answer) and out.finish_reason == "stop"
    # a start that never comes: no constraint at all
    never = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                           structured_outputs=S(regex=REGEX, starts_after="\u2603\u2603\u2603"))
    assert first(never)[0].token_ids == free
