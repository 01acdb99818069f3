"""The `fd` command line: engine flags, start-up refusals, generate and chat (local)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fd_core.entrypoints.cli import build_parser, engine_config


def fd(*args: str, stdin: str | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def test_flags_accept_fastdeploy_and_vllm_spellings():
    dashed = build_parser().parse_args(["serve", "--max-num-seqs", "4", "--max-model-len=256", "--port", "9"])
    under = build_parser().parse_args(["serve", "--max_num_seqs", "4", "--max_model_len=256", "--port", "9"])
    assert vars(dashed) == vars(under)
    cfg = engine_config(under)
    assert (cfg.max_num_seqs, cfg.max_model_len) == (4, 256)
    assert build_parser().parse_args(["serve"]).port == 8180
    assert engine_config(build_parser().parse_args(["serve", "--no-enable-chunked-prefill"])).enable_chunked_prefill is False
    cfg = engine_config(build_parser().parse_args(["serve", "--no-enable-prefix-caching", "--swap-space", "4"]))
    assert cfg.enable_prefix_caching is False and cfg.swap_space == 4.0
    left = engine_config(build_parser().parse_args(["serve"]))  # the backend decides
    assert left.enable_prefix_caching is None and left.enable_chunked_prefill is None
    assert left.max_num_batched_tokens is None and left.long_prefill_token_threshold is None
    for args, value in [(["--long-prefill-token-threshold", "32"], 32), (["--long_prefill_token_threshold=0"], 0)]:
        assert engine_config(build_parser().parse_args(["serve", *args])).long_prefill_token_threshold == value


@pytest.mark.parametrize("flag, message", [
    (["--quantization", "wint8"],
     "--quantization wint8: the cpu backend declares no quantization method (with --runtime torch it serves wint8)"),
    (["--quantization", "fp8", "--runtime", "torch"],
     "--quantization block_wise_fp8: the cpu backend declares wint4, wint8"),
    (["--quantization", "wint3"], "--quantization wint3: fd quantizes weights with wint8, wint4, block_wise_fp8, "
                                  "fp8 (= block_wise_fp8)"),
    (["--quantization", "wint4", "--quantization-group-size", "0"], "--quantization-group-size 0: give the input"),
    (["--quantization-group-size", "64"], "--quantization-group-size sets the groups of --quantization"),
    (["--kv-cache-dtype", "int3"], "--kv-cache-dtype int3: accepted values are auto, float32, float16, bfloat16, "
                                   "int8, fp8_e4m3, fp8 (= fp8_e4m3)"),
    (["--kv-cache-dtype", "bfloat16"], "--kv-cache-dtype bfloat16: a float KV cache is kept in the model's dtype"),
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization: the cpu backend"),
    (["--tensor-parallel-size", "100000"], "--tensor-parallel-size 100000: the cpu backend"),
    (["--tensor-parallel-size", "2", "--enable-expert-parallel"],
     "--enable-expert-parallel: LlamaForCausalLM has no mixture-of-experts layers"),
    (["--dtype", "bfloat16"], "--dtype bfloat16: the cpu backend"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
     "--speculative-config: num_speculative_tokens must be an integer from 1 to 16, got 0"),
    (["--speculative-config", "{ngram"], "--speculative-config is not valid JSON"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--async-scheduling"],
     "--async-scheduling: speculative decoding (--speculative-config) needs each step's accepted tokens"),
    (["--num-scheduler-steps", "0"], "num_scheduler_steps must be a positive integer, got 0"),
    (["--num-scheduler-steps", "4"], "--num-scheduler-steps 4: a round's steps take their input tokens from the "
                                     "step before on the device, and the cpu backend has no sample_async op"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
     "--speculative-config: method 'mtp' needs the MTP layer's weights (model.mtp_*)"),
])
def test_flags_the_backend_cannot_honour_fail_at_start_up(flag, message):
    out = fd("generate", "hi", "--device", "cpu", *flag, timeout=60)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.oracle
def test_generate_and_local_chat(tmp_path):
    pytest.importorskip("transformers")
    from tests import checkpoints

    model = str(checkpoints.make_llama(tmp_path))
    out = fd("generate", "hello there", "--model", model, "--max-tokens", "5", "--num-kv-blocks", "32")
    assert out.returncode == 0, out.stderr
    chat = fd("chat", "--model", model, "--max-tokens", "5", "--num-kv-blocks", "32",
              stdin="hi\n/reset\nagain\n/exit\n")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.count("assistant> ") == 2


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_remote_chat_to_no_server_says_so_in_one_line():
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    out = fd("chat", "--base-url", url, stdin="hello\n", timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fd chat: cannot reach a server at {url} (ConnectError")
    assert lines[0].endswith("is `fd serve` running there?")


def test_remote_chat_to_something_else_names_its_answer():
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b"no such page")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = fd("chat", "--base-url", url, stdin="hello\n", timeout=60)
    finally:
        server.shutdown()
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == f"fd chat: {url}/v1/models answered 404: no such page"


def test_every_option_says_what_it_does():
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = {name: [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
            for name, parser in sub.choices.items()}
    assert not any(bare.values()), bare


def test_serve_takes_the_model_as_vllm_does():
    from fd_core.errors import ConfigError
    from fd_core.loader import DEFAULT_MODEL

    def model(*args):
        return engine_config(build_parser().parse_args(["serve", *args])).model

    assert model("Qwen/Qwen3-0.6B", "--max-model-len", "2048") == "Qwen/Qwen3-0.6B"
    assert model("--model", "m.gguf") == "m.gguf" == model("m.gguf", "--model", "m.gguf")
    assert model() == DEFAULT_MODEL
    with pytest.raises(ConfigError, match="the model is given twice: a and --model b; give it once"):
        model("a", "--model", "b")


def test_output_into_a_closed_pipe_is_no_error():
    # as `fd backends | head -1` once head has its line: here the reader is gone before fd writes
    pipe = subprocess.run(f"{sys.executable} -m fd_core.entrypoints.cli backends -v | true",
                          shell=True, capture_output=True, text=True, timeout=60)
    assert pipe.stderr == "", pipe.stderr
