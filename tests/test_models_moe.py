"""Mixture-of-experts models (Qwen3-MoE, ERNIE 4.5 MoE) against transformers on the same
random weights, on both CPU runtimes: logits over a prefill and 16 decode steps (float32,
max |fd - hf| / max |hf| <= 1e-4), 64 greedy tokens on 8 prompts, two tensor-parallel ranks
equal to one, and the checkpoints fd refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.oracle

from fd_core import LLM, SamplingParams
from fd_core.errors import CheckpointError
from tests import checkpoints
from tests.oracle import fd_greedy_logits, hf_logits, relative_error

BUILDERS = [checkpoints.make_qwen3_moe, checkpoints.make_ernie45_moe]
IDS = ["qwen3-moe", "ernie45-moe"]
RUNTIMES = ["torch", "paddle"]


@pytest.fixture(scope="module", params=BUILDERS, ids=IDS)
def model_dir(request, tmp_path_factory):
    return request.param(tmp_path_factory.mktemp(request.param.__name__))


def prompts(n: int = 8) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, 500, size=int(rng.integers(4, 30))).tolist() for _ in range(n)]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_logits_match_transformers(model_dir, runtime):
    llm = LLM(model=str(model_dir), device="cpu", runtime=runtime, block_size=4, num_kv_blocks=64, max_model_len=128)
    prompt = np.random.default_rng(0).integers(0, 500, size=11).tolist()
    tokens, ours = fd_greedy_logits(llm, prompt, 17)
    theirs = hf_logits(model_dir, prompt + tokens[:-1])[len(prompt) - 1 :]
    errors = [relative_error(ours[i], theirs[i]) for i in range(17)]
    assert max(errors) <= 1e-4, errors


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_64_greedy_tokens_equal_transformers(model_dir, runtime):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model=str(model_dir), device="cpu", runtime=runtime, block_size=4, num_kv_blocks=512, max_model_len=128)
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts(), outs, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64, min_new_tokens=64,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert list(out.outputs[0].token_ids) == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-sliced", "expert-parallel"])
def test_two_ranks_equal_one(model_dir, expert_parallel):
    """Two ranks over gloo: each expert sliced by width, or (--enable-expert-parallel) 4 of the
    8 experts whole on each rank; the tokens equal one process's."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(**engine_args):
        llm = LLM(model=str(model_dir), device="cpu", max_model_len=128, block_size=4, num_kv_blocks=512,
                  **engine_args)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
        finally:
            llm.engine.core.shutdown()

    assert run(tensor_parallel_size=2, enable_expert_parallel=expert_parallel) == run()


def test_expert_parallel_is_refused_on_a_dense_model_and_on_indivisible_experts(tmp_path):
    from fd_core.errors import ConfigError

    dense = checkpoints.make_qwen3(tmp_path / "dense")
    with pytest.raises(ConfigError, match="--enable-expert-parallel: Qwen3ForCausalLM has no mixture-of-experts"):
        LLM(model=str(dense), device="cpu", tensor_parallel_size=2, enable_expert_parallel=True)
    three = checkpoints.make_qwen3_moe(tmp_path / "moe", num_experts=3)
    with pytest.raises(ConfigError, match="the model's 3 experts per layer do not divide over "
                                          "--tensor-parallel-size 2"):
        LLM(model=str(three), device="cpu", tensor_parallel_size=2, enable_expert_parallel=True)


def _drop_tensor(folder, name: str) -> None:
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_missing_expert_is_refused_naming_layer_and_expert(tmp_path):
    folder = checkpoints.make_ernie45_moe(tmp_path)
    _drop_tensor(folder, "model.layers.2.mlp.experts.5.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        LLM(model=str(folder), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=128)


def test_a_router_choosing_more_experts_than_exist_is_refused(tmp_path):
    folder = checkpoints.make_qwen3_moe(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="routes each token to 9 of 8 experts"):
        LLM(model=str(folder), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=128)


def test_sparse_layers_follow_the_config():
    from fd_core.models.config import ModelConfig
    from fd_core.models.moe import moe_spec

    def config(**raw):
        return ModelConfig("x", 10, 8, 16, 6, 2, 2, 4, 1e-5, 1e4, 64, raw=raw)

    qwen = moe_spec("qwen3", config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                     decoder_sparse_step=2, mlp_only_layers=[3]))
    assert qwen.sparse_layers == {1, 5} and not qwen.renormalize and not qwen.shared_intermediate_size
    ernie = moe_spec("ernie", config(moe_num_experts=4, moe_k=2, moe_intermediate_size=8, moe_num_shared_experts=2,
                                     moe_layer_start_index=1, moe_layer_end_index=4, moe_layer_interval=2))
    assert ernie.sparse_layers == {1, 3} and ernie.renormalize and ernie.correction_bias
    assert ernie.shared_intermediate_size == 16
    with pytest.raises(CheckpointError, match="lacks moe_intermediate_size"):
        moe_spec("qwen3", config(num_experts=4, num_experts_per_tok=2))


def test_quantized_experts_stay_quantized_and_close(model_dir):
    """--quantization wint8 on the torch runtime: the routed experts reach the moe op as int8
    weights in the canonical form (the op reads them, not the backend's packed linear), and the
    logits stay within 5% of transformers' float ones (measured: 1.3% Qwen3-MoE, 0.5% ERNIE)."""
    from fd_core.interfaces import QuantizedWeight

    llm = LLM(model=str(model_dir), device="cpu", runtime="torch", quantization="wint8", block_size=4,
              num_kv_blocks=64, max_model_len=128)
    experts = next(layer.experts for layer in llm.engine.runner.model.layers if layer.experts is not None)
    assert all(isinstance(w, QuantizedWeight) and w.method == "wint8" and not w.layout
               for w in experts.gate_up + experts.down)
    prompt = np.random.default_rng(0).integers(0, 500, size=11).tolist()
    tokens, ours = fd_greedy_logits(llm, prompt, 5)
    theirs = hf_logits(model_dir, prompt + tokens[:-1])[len(prompt) - 1 :]
    assert max(relative_error(ours[i], theirs[i]) for i in range(5)) <= 0.05


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_weight_bytes_are_the_checkpoints_and_quantized_experts_are_smaller(model_dir, runtime):
    """What the load's log line reports: in float32 every tensor of the checkpoint once (fused
    q/k/v and gate/up, stacked experts and a tied LM head change no count), with wint8 every
    linear, the routed experts' too, at a byte a value plus its scales."""
    from safetensors.numpy import load_file

    stored = load_file(str(model_dir / "model.safetensors"))
    want = sum(a.size for a in stored.values()) * 4
    plain = LLM(model=str(model_dir), device="cpu", runtime=runtime, dtype="float32", block_size=4,
                num_kv_blocks=64, max_model_len=128)
    assert plain.engine.runner.model.weight_bytes() == want
    if runtime == "torch":  # wint8 on the torch runtime, as test_quantized_experts_stay_quantized_and_close
        quantized = LLM(model=str(model_dir), device="cpu", runtime="torch", quantization="wint8", block_size=4,
                        num_kv_blocks=64, max_model_len=128)
        # each linear ([out, in]) as int8 levels and a scale per output row (float32 at most; a
        # packed layout may keep it narrower)
        levels = sum(a.size for n, a in stored.items() if n.endswith("_proj.weight"))
        rows = sum(a.shape[0] for n, a in stored.items() if n.endswith("_proj.weight"))
        rest = sum(4 * a.size for n, a in stored.items() if not n.endswith("_proj.weight"))
        assert levels + rest < quantized.engine.runner.model.weight_bytes() <= levels + 4 * rows + rest


def test_an_ernie_45_21b_a3b_shaped_checkpoint_loads_and_generates(tmp_path):
    """ERNIE-4.5-21B-A3B's shape (hidden 2560, 64 experts of width 1536, top-6, two shared
    experts, a 103,424-token vocabulary) at two layers, one dense and one sparse, random bfloat16
    weights: it loads on the torch runtime in bfloat16 and generates."""
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    shape = dict(checkpoints.ERNIE_45_21B_A3B, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    folder = checkpoints.make_large_random(tmp_path, Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, "ernie45_21b", **shape)
    llm = LLM(model=str(folder), device="cpu", runtime="torch", dtype="bfloat16", block_size=16, num_kv_blocks=8,
              max_model_len=64)
    model = llm.engine.runner.model
    assert model.moe.sparse_layers == {1} and model.moe.top_k == 6 and model.moe.shared_intermediate_size == 3072
    experts = model.layers[1].experts
    assert len(experts.gate_up) == 64 and tuple(experts.gate_up[0].shape) == (3072, 2560)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_an_ernie_45_300b_a47b_shaped_config_gives_its_moe_layers(tmp_path):
    """ERNIE-4.5-300B-A47B's config at four layers (three dense, one sparse): the sparse layer,
    top-8 of 64 experts of width 3584, no shared expert, and the expert shapes the loader expects.
    (Loading it takes ~9 GB even at four layers: ``backends/cuda/tests/test_moe_gpu.py`` loads it
    on a GPU with ``--load-format dummy --quantization wint4``.)"""
    from transformers import Ernie4_5_MoeConfig

    from fd_core.loader.dummy import load_dummy
    from fd_core.models import moe_spec, weight_shapes

    shape = dict(checkpoints.ERNIE_45_300B_A47B, num_hidden_layers=4, moe_layer_end_index=3, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0)
    folder = checkpoints.make_config_only(tmp_path, Ernie4_5_MoeConfig, "ernie45_300b", **shape)
    config = load_dummy(folder).config
    spec = moe_spec(config)
    assert spec.sparse_layers == {3} and spec.top_k == 8 and spec.num_experts == 64
    assert spec.shared_intermediate_size == 0
    shapes = weight_shapes(config)
    assert shapes["model.layers.3.mlp.experts.63.gate_proj.weight"] == (3584, 8192)
    assert shapes["model.layers.3.mlp.experts.0.down_proj.weight"] == (8192, 3584)
    assert "model.layers.2.mlp.gate_proj.weight" in shapes and "model.layers.3.mlp.gate.weight" in shapes
    assert not any("shared_experts" in name for name in shapes)


def test_a_rank_reads_only_its_own_experts(tmp_path, monkeypatch):
    """With experts dealt out, a rank does not read the other ranks' experts from the checkpoint
    (on four GPUs each rank would otherwise read every expert of the 300B-A47B); without, it
    reads every tensor once."""
    from fd_core.engine.config import EngineConfig
    from fd_core.engine.loading import load_runner, open_checkpoint
    from fd_core.plugins import get_registry

    model_dir = checkpoints.make_ernie45_moe(tmp_path)
    registry = get_registry()
    platform = registry.platform("cpu", "torch")
    for expert_parallel in (False, True):
        config = EngineConfig(model=str(model_dir), device="cpu", runtime="torch", dtype="float32", max_model_len=128,
                              block_size=4,
                              num_kv_blocks=64, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
        config.validate()
        checkpoint = open_checkpoint(config)
        read = []
        for name, reader in list(checkpoint._readers.items()):
            checkpoint._readers[name] = lambda name=name, reader=reader: (read.append(name), reader())[1]
        runner = load_runner(config, platform, registry, rank=1, world_size=2, checkpoint=checkpoint)
        experts = [n for n in read if ".experts." in n]
        if expert_parallel:  # rank 1 of 2 holds experts 4-7 of 8, in each of the two sparse layers
            assert sorted({int(n.split(".experts.")[1].split(".")[0]) for n in experts}) == [4, 5, 6, 7]
            assert len(experts) == 2 * 4 * 3
            assert runner.model.layers[1].experts.first == 4
        else:
            assert len(experts) == 2 * 8 * 3
        assert sorted(read) == sorted(set(read)) and len(read) == checkpoint.num_tensors - (24 if expert_parallel else 0)


def test_a_layer_goes_to_the_device_as_soon_as_its_last_tensor_is_read(tmp_path, monkeypatch):
    """The host holds about one layer while loading, not the model: each decoder layer is
    uploaded right after the last of its tensors is read (a rank of the 300B-A47B with experts
    sliced was killed for memory when the whole checkpoint was collected first)."""
    from fd_core.engine.config import EngineConfig
    from fd_core.engine.loading import load_runner, open_checkpoint
    from fd_core.models.decoder import DecoderForCausalLM
    from fd_core.plugins import get_registry

    model_dir = checkpoints.make_ernie45_moe(tmp_path)
    config = EngineConfig(model=str(model_dir), device="cpu", runtime="torch", dtype="float32", max_model_len=128,
                          block_size=4, num_kv_blocks=64, tensor_parallel_size=2)
    config.validate()
    checkpoint = open_checkpoint(config)
    events: list[tuple[str, str]] = []
    for name, reader in list(checkpoint._readers.items()):
        checkpoint._readers[name] = lambda name=name, reader=reader: (events.append(("read", name)), reader())[1]
    upload_layer = DecoderForCausalLM.upload_layer

    def logged(self, prefix, host, sparse=False):
        events.append(("upload", prefix))
        return upload_layer(self, prefix, host, sparse)

    monkeypatch.setattr(DecoderForCausalLM, "upload_layer", logged)
    registry = get_registry()
    runner = load_runner(config, registry.platform("cpu", "torch"), registry, rank=1, world_size=2,
                         checkpoint=checkpoint)
    layers = runner.model.config.num_hidden_layers
    uploads = [name for kind, name in events if kind == "upload"]
    assert sorted(uploads) == sorted(f"model.layers.{i}." for i in range(layers))  # each once
    for i in range(layers):
        prefix = f"model.layers.{i}."
        last_read = max(k for k, (kind, name) in enumerate(events) if kind == "read" and name.startswith(prefix))
        assert events[last_read + 1] == ("upload", prefix), events[last_read - 2:last_read + 3]
