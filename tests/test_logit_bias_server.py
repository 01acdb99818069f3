"""``logit_bias`` through a real ``fd serve`` and the official ``openai`` client: SmolLM2 on the
cpu backend and on an emulated vendor backend (xpu, the structured-output tests' servers), a
bias forcing and banning tokens on both endpoints, the 400s; and a server whose ``sample`` op
comes from a plugin written for API 1.10 refusing biased requests by name."""

from __future__ import annotations

import os

import httpx
import pytest

openai = pytest.importorskip("openai")

from fd_core.loader import resolve_model
from fd_core.loader.formats import load_tokenizer
from tests.servers import Server
from tests.test_structured_server import MODEL, door_only, oai, server  # noqa: F401 - the fixtures

BANANA = 21285  # " banana" in SmolLM2's vocabulary
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(MODEL))


def complete(oai, **kw):  # noqa: F811
    return oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, **kw)


def test_a_bias_forces_and_bans_tokens(oai, tokenizer):  # noqa: F811
    assert tokenizer.decode([BANANA]) == " banana"
    plain = complete(oai).choices[0].text
    forced = complete(oai, logit_bias={str(BANANA): 100})
    assert forced.choices[0].text == " banana" * 6 and forced.usage.completion_tokens == 6
    # the greedy continuation's own tokens banned: it must say something else
    banned = {str(t): -100 for t in tokenizer.encode(plain)}
    other = complete(oai, logit_bias=banned).choices[0].text
    assert other != plain, plain
    assert complete(oai).choices[0].text == plain  # the same request without the bias


def test_chat_streamed_and_seeded_rows_take_the_bias(oai):  # noqa: F811
    ask = [{"role": "user", "content": "Name a fruit."}]
    r = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=0,
                                    logit_bias={str(BANANA): 100})
    assert r.choices[0].message.content == " banana" * 4
    chunks = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=1.0, seed=3, n=2,
                                         stream=True, logit_bias={str(BANANA): 100})
    texts = ["", ""]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [" banana" * 4] * 2


@pytest.mark.parametrize("path, bias, param", [
    ("/v1/completions", {"abc": 1.0}, "logit_bias.abc"),
    ("/v1/chat/completions", {"5": 150}, "logit_bias.5"),
    ("/v1/chat/completions", {"5": -100.5}, "logit_bias.5"),
    ("/v1/completions", {"49152": 1.0}, "logit_bias"),  # SmolLM2's vocabulary is 49152
    ("/v1/chat/completions", {"4000000000": 1.0}, "logit_bias"),
    ("/v1/completions", {str(i): 1.0 for i in range(1025)}, "logit_bias"),
])
def test_bad_biases_are_400_naming_the_field(server, path, bias, param):  # noqa: F811
    door_only(server)
    body = {"model": MODEL, "max_tokens": 2, "logit_bias": bias,
            **({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})}
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# -- a sampler written before API 1.11 --------------------------------------------------------

OLD_SAMPLER = """
    from fd_core.plugins import hookimpl

    FD_API_VERSION = "1.10"  # its sample knows the grammar's bitmask, not logit_bias


    def sample(logits, batch):
        from fd_core.runtimes.paddle.ops import sample as reference

        return reference(logits, batch)


    @hookimpl
    def fd_register_ops(registry):
        registry.register("sample", "cpu", sample, name="old-sample", priority=5, runtime="paddle")
"""


@pytest.fixture(scope="module")
def old_sampler_server(tmp_path_factory):
    from tests import checkpoints
    from tests.plugins import fake_dists

    pytest.importorskip("transformers")  # the checkpoint is built with transformers
    site = tmp_path_factory.mktemp("site")
    fake_dists.install(site, "fd-backend-oldsampler", "fd_backend_oldsampler", OLD_SAMPLER, "oldsampler")
    model = checkpoints.make_llama(tmp_path_factory.mktemp("model"))
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    srv = Server(str(model), tmp_path_factory.mktemp("log") / "server.log", "--device", "cpu", "--num-kv-blocks", "64",
                 "--served-model-name", "tiny", env={"PYTHONPATH": path})
    with srv:
        yield srv


def test_a_sampler_older_than_1_11_refuses_biased_requests(old_sampler_server):
    url = old_sampler_server.url
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        body = {"model": "tiny", "max_tokens": 3, **body}
        r = httpx.post(url + path, json={**body, "logit_bias": {"5": 2.0}}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "logit_bias", error
        assert ("its sample op (old-sample, from fd-backend-oldsampler) was written for plugin API 1.10, "
                "before 1.11") in error["message"], error
        assert httpx.post(url + path, json=body, timeout=60).status_code == 200  # without a bias: served
        assert httpx.post(url + path, json={**body, "logit_bias": {}}, timeout=60).status_code == 200
