"""vLLM's and FastDeploy's command lines on fd: --dtype auto, --tokenizer, --chat-template,
--max-logprobs, several --served-model-name, --metrics-port, FastDeploy's flags, and model
names found in the local Hugging Face cache."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fd_core.engine.config import EngineConfig, auto_dtype
from fd_core.errors import ConfigError, ModelNotFoundError
from fd_core.loader import DEFAULT_MODEL, resolve_model
from fd_core.runtimes import reference_capabilities
from tests.checkpoints import byte_level_tokenizer_json
from tests.servers import Server


def _caps(dtypes, kv=None):
    caps = reference_capabilities(frozenset(dtypes), collective_library="none")
    return dataclasses.replace(caps, kv_cache_dtypes=frozenset(kv or dtypes))


def test_dtype_auto_is_the_platforms_choice_else_the_narrowest_declared():
    assert auto_dtype(_caps({"float32", "float16", "bfloat16"})) == "bfloat16"
    assert auto_dtype(_caps({"float32", "float16"})) == "float16"
    assert auto_dtype(_caps({"float32"})) == "float32"
    # a dtype the KV cache cannot be kept in is no choice
    assert auto_dtype(_caps({"float32", "bfloat16"}, kv={"float32"})) == "float32"
    assert auto_dtype(_caps({"float32", "bfloat16"}), default_dtype="float32") == "float32"
    assert auto_dtype(_caps({"float32"}), default_dtype="bfloat16") == "float32"  # not declared: ignored

    config = EngineConfig(model="m")
    assert config.dtype == "auto"
    config.check_against("gpu", _caps({"float32", "bfloat16"}))
    assert config.dtype == "bfloat16"


def test_the_cpu_backend_keeps_float32_under_auto():
    from fd_core.engine.core import select_platform

    for runtime in ("paddle", "torch"):
        config = EngineConfig(model=DEFAULT_MODEL, device="cpu", runtime=runtime)
        select_platform(config)
        assert config.dtype == "float32"


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert EngineConfig(model="m", chat_template=inline).validate() is None
    file = tmp_path / "t.jinja"
    file.write_text(inline)
    config = EngineConfig(model="m", chat_template=str(file))
    config.validate()
    assert config.chat_template == inline
    with pytest.raises(ConfigError, match="--chat-template: no file missing.jinja"):
        EngineConfig(model="m", chat_template="missing.jinja").validate()
    with pytest.raises(ConfigError, match="--chat-template: not a valid Jinja template"):
        EngineConfig(model="m", chat_template="{% for %}").validate()


def _tokenizer_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(byte_level_tokenizer_json())
    (folder / "tokenizer_config.json").write_text('{"eos_token": "</s>", "bos_token": "<s>"}')
    return folder


def test_tokenizer_comes_from_another_folder(tmp_path):
    from fd_core.engine.loading import open_checkpoint

    own = open_checkpoint(EngineConfig(model=DEFAULT_MODEL)).tokenizer
    other = open_checkpoint(EngineConfig(model=DEFAULT_MODEL, tokenizer=str(_tokenizer_folder(tmp_path)))).tokenizer
    text = "The capital of France is Paris."
    assert own.encode(text) != other.encode(text)
    assert other.decode(other.encode(text, add_special_tokens=False)) == text
    with pytest.raises(ModelNotFoundError, match="No local model at"):
        open_checkpoint(EngineConfig(model=DEFAULT_MODEL, tokenizer=str(tmp_path / "nothing")))


def test_a_repo_id_in_the_hugging_face_cache_is_found_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("acme/tiny") == snapshot
    with pytest.raises(ModelNotFoundError, match=rf"already in the cache \({cache}\); fd does not download"):
        resolve_model("acme/absent")
    # the packaged default model stays what its name means, whatever the cache holds
    assert resolve_model(DEFAULT_MODEL).suffix == ".gguf"


def fd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", *args], capture_output=True, check=False,
                          text=True, timeout=180)


def test_fastdeploy_flags_start_and_say_they_change_nothing():
    out = fd("generate", "Hi", "--max-tokens", "2", "--load-choices", "default_v1", "--use-cudagraph",
             "--engine-worker-queue-port", "8182", "--num-gpu-blocks-override", "64", "--max-model-len", "256")
    assert out.returncode == 0, out.stderr
    for flag in ("--load-choices", "--use-cudagraph", "--engine-worker-queue-port"):
        assert f"{flag}: accepted for FastDeploy's scripts; it changes nothing" in out.stderr
    assert "64 blocks" in out.stderr  # --num-gpu-blocks-override sized the KV cache
    refused = fd("generate", "Hi", "--use-cudagraph", "--enforce-eager")
    assert refused.returncode == 2 and "give one" in refused.stderr and "Traceback" not in refused.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_vllm_launch_line_starts_and_is_honoured(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{{ 'Answer briefly. ' }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    metrics_port = _free_port()
    command = [sys.executable, "-m", "fd_core.entrypoints.cli", "serve", DEFAULT_MODEL]
    with Server(DEFAULT_MODEL, tmp_path / "serve.log", "--dtype", "auto", "--max-model-len", "2048",
                "--served-model-name", "a", "b", "--chat-template", str(template), "--disable-log-requests",
                "--max-logprobs", "3", "--metrics-port", str(metrics_port), command=command) as server:
        models = httpx.get(server.url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["a", "b"]
        body = {"model": "b", "messages": [{"role": "user", "content": "Paris?"}], "max_tokens": 2,
                "temperature": 0}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "a"  # responses carry the first name, as vLLM's
        from fd_core.engine.loading import open_checkpoint

        tokenizer = open_checkpoint(EngineConfig(model=DEFAULT_MODEL)).tokenizer
        assert reply.json()["usage"]["prompt_tokens"] == len(tokenizer.encode("Answer briefly. Paris?"))
        unknown = httpx.post(server.url + "/v1/chat/completions", json={**body, "model": "c"}, timeout=60)
        assert unknown.status_code == 404 and "'a' or 'b'" in unknown.json()["error"]["message"]
        many = {**body, "logprobs": True, "top_logprobs": 4}
        refused = httpx.post(server.url + "/v1/chat/completions", json=many, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
        assert "at most 3 (--max-logprobs)" in refused.json()["error"]["message"]
        allowed = httpx.post(server.url + "/v1/chat/completions", json={**many, "top_logprobs": 3}, timeout=60)
        assert allowed.status_code == 200, allowed.text
        assert len(allowed.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
        scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
        assert scraped.status_code == 200 and 'fd:num_requests_running{' in scraped.text
        assert 'model_name="a"' in scraped.text
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/v1/models", timeout=10).status_code == 404
    log = server.log_path.read_text()
    assert "received request" not in log  # --disable-log-requests


@pytest.mark.oracle
def test_skip_tokenizer_init_runs_on_token_ids_alone(tmp_path):
    from fd_core import LLM, SamplingParams
    from fd_core.errors import CheckpointError, InvalidRequestError
    from tests.checkpoints import make_llama

    folder = make_llama(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    want = LLM(str(folder), max_model_len=128).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(CheckpointError, match="no tokenizer"):
        LLM(str(folder), max_model_len=128)
    llm = LLM(str(folder), skip_tokenizer_init=True, max_model_len=128)
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == ""
    assert [sorted(step) for step in got.logprobs] == [sorted(step) for step in want.logprobs]
    with pytest.raises(InvalidRequestError, match="a text prompt needs a tokenizer"):
        llm.generate("hi", params, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
    with pytest.raises(ConfigError, match="--chat-template has no tokenizer"):
        LLM(str(folder), skip_tokenizer_init=True, chat_template="{{ 1 }}")
