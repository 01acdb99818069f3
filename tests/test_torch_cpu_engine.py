"""``--runtime torch`` on the CPU: the built-in cpu platform bound to PyTorch's CPU build.

Choosing the runtime (engine, ``LLM``, CLI, tensor-parallel ranks), runtime-aware op selection
(Paddle's ops never chosen under torch, torch's references native rather than a fallback), the
errors for a runtime the platform does not list or that is not installed, and end-to-end greedy
output equal to the Paddle runtime's and transformers'.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fd_core.backends.cpu import CpuPlatform  # noqa: E402
from fd_core.engine.config import EngineConfig  # noqa: E402
from fd_core.errors import BackendError, ConfigError  # noqa: E402
from fd_core.interfaces import OP_SPECS  # noqa: E402
from fd_core.plugins import OpRegistry, get_registry  # noqa: E402
from fd_core.plugins.registry import bind_runtime, platform_runtimes  # noqa: E402
from fd_core.runtimes.torch import REFERENCE_OPS as TORCH_OPS  # noqa: E402
from fd_core.runtimes.torch import TorchCommunicator, TorchMemory  # noqa: E402


def fd(*args: str, code: str | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    """The ``fd`` CLI in a fresh process; ``code`` runs first (e.g. to hide torch)."""
    pre = code or ""
    script = f"import sys\n{pre}\nfrom fd_core.entrypoints.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)


# -- op registration and selection ---------------------------------------------------------------


def test_cpu_op_table_on_torch_is_the_torch_references_and_few_rows_without_fallback_warnings(caplog):
    registry = get_registry()
    platform = registry.platform("cpu", "torch")
    with caplog.at_level("WARNING", logger="fd.ops"):
        table = registry.op_table(platform, {"dtype": "float32", "head_dim": 16, "quantization": None})
    assert not caplog.records  # the torch references are the cpu backend's own here
    assert table.runtime == "torch" and not table.missing()
    for op in TORCH_OPS:
        impl = table.choices[op].impl
        if op == "linear":  # plain weights: few_rows.py, which hands most products to the reference
            assert impl.name == "few-rows" and impl.runtime == "torch"
            continue
        assert impl.fn is TORCH_OPS[op] and impl.runtime == "torch", op
        assert impl.fn.__module__ == "fd_core.runtimes.torch.ops"
    rows = [row for row in table.describe() if row[3] != "optional, not provided"]
    assert {impl for _, impl, _, _ in rows} == {"reference", "few-rows"}
    assert all(source == "fd-core" and "fallback" not in why and "torch runtime" in why
               for _, _, source, why in rows)
    # the default runtime still gets Paddle's ops, and never torch's
    paddle = registry.op_table(registry.platform("cpu"), {"dtype": "float32"})
    assert paddle.runtime == "paddle"
    assert all(c.impl.fn.__module__.startswith("fd_core.runtimes.paddle") for op, c in paddle.choices.items()
               if op != "linear")
    assert paddle.choices["linear"].impl.name == "few-rows" and paddle.choices["linear"].impl.runtime == "paddle"
    pinned = registry.op_table(platform, {"dtype": "float32"}, {"attention": "reference"})
    assert pinned.choices["attention"].impl.fn is TORCH_OPS["attention"]


def test_registration_is_runtime_aware(caplog):
    reg = OpRegistry()

    def paddle_silu(x):
        return x

    def any_silu(x):
        return x

    def torch_ref(x):
        return x

    reg.register("silu_and_mul", "chip", paddle_silu, name="pd-silu", priority=5, runtime="paddle")
    reg.register_reference("torch", {"silu_and_mul": torch_ref})
    reg.register_reference("paddle", {"silu_and_mul": torch_ref})
    # under torch the Paddle-only implementation is no candidate: the reference, with a warning
    with caplog.at_level("WARNING", logger="fd.ops"):
        table = reg.select("chip", "torch")
    assert table.choices["silu_and_mul"].impl.name == "reference"
    assert any("silu_and_mul" in r.getMessage() for r in caplog.records)
    assert reg.select("chip", "paddle").choices["silu_and_mul"].impl.name == "pd-silu"
    with pytest.raises(ConfigError, match="no implementation named 'pd-silu' for device type 'chip' on the torch runtime"):
        reg.select("chip", "torch", pins={"silu_and_mul": "pd-silu"})
    # runtime=None (the default, as before API 1.2): a candidate on every runtime
    reg.register("silu_and_mul", "chip", any_silu, name="any-silu", priority=1)
    assert reg.select("chip", "torch").choices["silu_and_mul"].impl.name == "any-silu"
    assert reg.select("chip", "paddle").choices["silu_and_mul"].impl.name == "pd-silu"
    # an adopted reference is chosen like a registered op: no warning
    reg.use_reference("chip", "torch", priority=3)
    caplog.clear()
    with caplog.at_level("WARNING", logger="fd.ops"):
        choice = reg.select("chip", "torch").choices["silu_and_mul"]
    assert choice.impl.fn is torch_ref and choice.impl.runtime == "torch" and not caplog.records


# -- the platform bound to a runtime -------------------------------------------------------------


def test_the_cpu_platform_binds_to_torch():
    registry = get_registry()
    default = registry.platform("cpu")
    assert default.runtime == "paddle" and platform_runtimes(default) == ("paddle", "torch")
    bound = registry.platform("cpu", "torch")
    assert bound is not default and bound.runtime == "torch" and default.runtime == "paddle"
    assert registry.platform("cpu", "paddle") is default
    assert registry.platform("auto", "torch").runtime == "torch"
    assert isinstance(bound.memory(), TorchMemory)
    comm = bound.communicator(0, 1)
    assert isinstance(comm, TorchCommunicator) and comm.world_size == 1
    caps = bound.capabilities()
    assert caps.dtypes == frozenset({"float32", "bfloat16"})
    assert caps.kv_cache_dtypes == caps.dtypes | {"int8", "fp8_e4m3"}  # a quantized cache on the reference
    assert caps.collective_library == "gloo"
    assert default.capabilities().dtypes == frozenset({"float32"})


def test_a_runtime_the_platform_does_not_list_is_one_config_error(tmp_path):
    from fd_core import LLM

    with pytest.raises(ConfigError, match=r"^--runtime jax: the cpu backend runs on paddle, torch$"):
        get_registry().platform("cpu", "jax")

    class OneRuntime:  # an API 1.1 platform: no runtimes, no with_runtime
        name, device_type, runtime = "chip", "chip", "torch"

    assert platform_runtimes(OneRuntime()) == ("torch",)
    with pytest.raises(ConfigError, match=r"--runtime paddle: the chip backend runs on torch"):
        bind_runtime(OneRuntime(), "paddle")
    assert bind_runtime(OneRuntime(), None).runtime == "torch"
    # refused before the model is even looked for
    with pytest.raises(ConfigError, match="--runtime jax"):
        LLM(model=str(tmp_path / "no-such-model"), device="cpu", runtime="jax")
    with pytest.raises(ConfigError, match="runtime must be a runtime name"):
        EngineConfig(model="m", runtime="").validate()


def test_cli_errors_name_the_flag_the_backend_and_what_it_supports():
    out = fd("generate", "hi", "--device", "cpu", "--runtime", "jax", timeout=60)
    assert out.returncode == 2, out.stderr
    assert "fd: error: --runtime jax: the cpu backend runs on paddle, torch" in out.stderr
    assert "Traceback" not in out.stderr
    hidden = "sys.modules['torch'] = None  # as if torch were not installed"
    out = fd("generate", "hi", "--device", "cpu", "--runtime", "torch", code=hidden, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "fd: error: --runtime torch: the torch runtime cannot be imported" in out.stderr
    assert "fd-core[torch]" in out.stderr and "Traceback" not in out.stderr
    out = fd("generate", "hi", "--device", "cpu", "--runtime", "torch", "--dtype", "float16", timeout=60)
    assert out.returncode == 2 and "--dtype float16: the cpu backend supports ['bfloat16', 'float32']" in out.stderr
    out = fd("backends", code=hidden, timeout=60)
    assert out.returncode == 0 and "runtimes: paddle (default), torch (not installed)" in out.stdout


def test_fd_backends_and_doctor_show_the_runtimes():
    out = fd("backends", "--json", timeout=60)
    assert out.returncode == 0, out.stderr
    cpu = {b["name"]: b for b in json.loads(out.stdout)["backends"]}["cpu"]["platforms"]["cpu"]
    assert cpu["runtime"] == "paddle" and cpu["runtimes"] == {"paddle": True, "torch": True}
    assert cpu["runtime_capabilities"]["torch"]["dtypes"] == ["bfloat16", "float32"]
    out = fd("doctor", "--device", "cpu", "--runtime", "torch", timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "device cpu (type cpu, runtime torch; also runs on paddle (--runtime))"
    # optional ops the reference lacks (token_logprobs, optional for a backend, it has)
    optional = [name for name, s in OP_SPECS.items() if s.optional and name != "pack_linear" and name not in TORCH_OPS]
    assert lines[1] == "  for float32, any head size (--model applies one)"
    assert lines[2] == ("  KV cache in bfloat16, float32, fp8_e4m3, int8 (--kv-cache-dtype); weights quantized with "
                        "wint4, wint8 (--quantization)")
    # every op once, and linear / pack_linear again for each quantization method torch serves
    per_method = [f"{op}[{m}]" for m in ("wint4", "wint8") for op in ("linear", "pack_linear")]
    names = [line.split()[0] for line in lines[3:]]
    assert sorted(names) == sorted([op for op in OP_SPECS if op != "pack_linear"] + per_method)
    assert all("torch-packed" in line for line in lines[3:] if line.split()[0] in per_method)
    assert all("for the torch runtime" in line for line in lines[3:] if line.split()[0] not in optional)
    assert all("optional, not provided" in line for line in lines[3:] if line.split()[0] in optional)


def test_cli_flag_reaches_the_config():
    from fd_core.entrypoints.cli import build_parser, engine_config

    for command in ("serve", "generate", "chat"):
        argv = [command] + (["hi"] if command == "generate" else []) + ["--runtime", "torch"]
        assert engine_config(build_parser().parse_args(argv)).runtime == "torch"
    assert engine_config(build_parser().parse_args(["serve"])).runtime is None


# -- end to end -----------------------------------------------------------------------------------


def prompts(n: int = 8) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, 400, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]


def generate(model_dir, params, **engine_args):
    from fd_core import LLM

    engine_args = {"num_kv_blocks": 512, **engine_args}
    llm = LLM(model=str(model_dir), device="cpu", max_model_len=128, block_size=4, **engine_args)
    try:
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts(), params, use_tqdm=False)], llm
    finally:
        llm.engine.core.shutdown()


@pytest.fixture(scope="module")
def checkpoints():
    pytest.importorskip("transformers")  # the checkpoints are built with transformers
    from tests import checkpoints

    return checkpoints


@pytest.mark.oracle
@pytest.mark.parametrize("make", ["make_llama", "make_qwen3", "make_ernie45"])
def test_greedy_on_torch_equals_paddle_and_transformers(tmp_path, checkpoints, make):
    from fd_core import LLM, SamplingParams
    from tests.oracle import fd_greedy_logits, hf_logits, relative_error

    model_dir = getattr(checkpoints, make)(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    on_paddle, _ = generate(model_dir, params)
    on_torch, llm = generate(model_dir, params, runtime="torch")
    assert llm.engine.core.platform.runtime == "torch" and llm.engine.core.ops.runtime == "torch"
    assert isinstance(llm.engine.memory, TorchMemory)
    assert isinstance(llm.engine.runner.kv_caches[0][0], torch.Tensor)
    assert on_torch == on_paddle
    # and transformers' logits at every step (float32, as in test_models_oracle.py)
    llm = LLM(model=str(model_dir), device="cpu", runtime="torch", max_model_len=128, block_size=4, num_kv_blocks=64)
    prompt = prompts(1)[0]
    tokens, ours = fd_greedy_logits(llm, prompt, 8)
    theirs = hf_logits(model_dir, prompt + tokens[:-1])[len(prompt) - 1:]
    assert max(relative_error(ours[i], theirs[i]) for i in range(8)) <= 1e-4
    assert tokens == ours.argmax(axis=1).tolist()


def test_seeded_sampling_and_swap_on_torch_equal_paddle(tmp_path, checkpoints):
    from fd_core import SamplingParams

    model_dir = checkpoints.make_llama(tmp_path)
    params = SamplingParams(temperature=0.5, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True, n=2)
    on_paddle, _ = generate(model_dir, params)
    tight, llm = generate(model_dir, params, runtime="torch", num_kv_blocks=4 * 16 + 1, swap_space=0.01)
    assert llm.engine.scheduler.num_swapped_out > 0
    assert tight == on_paddle


def test_two_torch_ranks_over_gloo_equal_one_process(tmp_path, checkpoints, monkeypatch):
    from fd_core import SamplingParams
    from fd_core.engine import core

    sent = []
    original = core.Workers.__init__

    def recording(self, config, *args):
        sent.append(config)
        original(self, config, *args)

    monkeypatch.setattr(core.Workers, "__init__", recording)
    model_dir = checkpoints.make_qwen3(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one, _ = generate(model_dir, params, runtime="torch")
    two, llm = generate(model_dir, params, runtime="torch", tensor_parallel_size=2)
    assert llm.engine.core.executor.workers.world_size == 2 and llm.engine.runner is None
    # every rank rebuilds the platform from this config: cpu on torch (TorchMemory, gloo)
    assert [(c.device, c.runtime) for c in sent] == [("cpu", "torch")]
    assert two == one


def test_bfloat16_on_torch(tmp_path, checkpoints):
    from fd_core import LLM, SamplingParams
    from tests.oracle import fd_greedy_logits, relative_error

    model_dir = checkpoints.make_llama(tmp_path)
    with pytest.raises(ConfigError, match=r"--dtype bfloat16: the cpu backend supports \['float32'\]"):
        LLM(model=str(model_dir), device="cpu", dtype="bfloat16")
    args = dict(model=str(model_dir), device="cpu", runtime="torch", max_model_len=128, block_size=4, num_kv_blocks=64)
    half = LLM(dtype="bfloat16", **args)
    assert half.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    prompt = prompts(1)[0]
    _, theirs = fd_greedy_logits(LLM(**args), prompt, 1)
    _, ours = fd_greedy_logits(half, prompt, 1)
    assert relative_error(ours[0], theirs[0]) < 5e-2  # bfloat16 keeps ~3 significant digits
    out = half.generate(prompts(4), SamplingParams(temperature=0.7, seed=1, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


def test_fd_generate_with_runtime_torch(tmp_path, checkpoints):
    from fd_core import LLM, SamplingParams

    model = str(checkpoints.make_llama(tmp_path))
    out = fd("generate", "hello there", "--model", model, "--device", "cpu", "--runtime", "torch",
             "--max-tokens", "6", "--num-kv-blocks", "32")
    assert out.returncode == 0, out.stderr
    llm = LLM(model=model, device="cpu", num_kv_blocks=32)
    text = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0].text
    assert out.stdout == text + "\n"


def test_an_unimportable_runtime_is_a_backend_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "fd_core.runtimes.torch", None)  # import fails as without torch
    with pytest.raises(BackendError, match=r"^--runtime torch: the torch runtime cannot be imported .*fd-core\[torch\]"):
        bind_runtime(CpuPlatform(), "torch")


class _HeadHooks:
    """Runner hooks whose forward replacement runs the forward and the attached head together
    (API 1.18's ``attach_head`` / ``with_head``), counting the decode steps it took."""

    def __init__(self, take: bool = True) -> None:
        self.take, self.calls, self.replacement = take, [], None

    def wrap_forward(self, forward, limits):
        hooks = self

        class Replacement:
            head = None

            def __call__(self, *args):
                return forward(*args)

            def attach_head(self, head):
                self.head = head

            def with_head(self, ids, positions, kv_caches, meta):
                hooks.calls.append(int(ids.shape[0]))
                if not hooks.take:
                    return None
                hidden = forward(ids, positions, kv_caches, meta)
                return hidden, self.head(hidden, None)

        self.replacement = Replacement()
        return self.replacement


@pytest.mark.parametrize("take", [True, False])
def test_a_forward_replacement_may_run_the_head_of_decode_steps(tmp_path, checkpoints, monkeypatch, take):
    """The runner attaches the model's head to a replacement that can run it (API 1.18) and
    hands it every decode step (each row samples, in order); the tokens are those of the plain
    forward, whether it takes the steps or declines them (None)."""
    from fd_core import SamplingParams

    model_dir = checkpoints.make_llama(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want, _ = generate(model_dir, params, runtime="torch")
    hooks = _HeadHooks(take)
    monkeypatch.setattr(CpuPlatform, "runner_hooks", lambda self: hooks)
    got, llm = generate(model_dir, params, runtime="torch")
    assert got == want
    assert hooks.replacement.head is not None
    # decode steps only: one row per sequence (a prefill step's rows outnumber its samples)
    assert hooks.calls and max(hooks.calls) <= len(prompts())
    eager, _ = generate(model_dir, params, runtime="torch", enforce_eager=True)
    assert eager == want


class _SampleHooks(_HeadHooks):
    """``_HeadHooks`` whose replacement also draws a decode step's tokens with the sampler the
    runner attaches (API 1.20's ``attach_sampler`` / ``with_sample``): ``draw`` says whether it
    takes the sampler, ``every``: it draws every ``every``-th step and hands the others' logits
    back to be sampled by the runner."""

    def __init__(self, draw: bool = True, every: int = 1) -> None:
        super().__init__()
        self.draw, self.every, self.sampled, self.handed_back = draw, every, 0, 0

    def wrap_forward(self, forward, limits):
        replacement = super().wrap_forward(forward, limits)
        hooks = self

        def attach_sampler(sample):
            replacement.sample = sample
            return hooks.draw

        def with_sample(ids, positions, kv_caches, meta, batch):
            assert hooks.draw, "with_sample called on a replacement that declined the sampler"
            hidden, logits = replacement.with_head(ids, positions, kv_caches, meta)
            if (hooks.sampled + hooks.handed_back) % hooks.every:
                hooks.handed_back += 1
                return hidden, logits, None
            hooks.sampled += 1
            return hidden, logits, replacement.sample(logits, batch)

        replacement.attach_sampler, replacement.with_sample = attach_sampler, with_sample
        return replacement


def _with_hooks(tmp_path, checkpoints, monkeypatch, hooks, greedy_tokens: int, **engine_args):
    """Greedy and seeded requests through the torch runtime with ``hooks`` as the CPU's runner
    hooks and the tests' host-fed sample_async: (the tokens, those of the synchronous engine
    without the hooks, the LLM)."""
    from fd_core import SamplingParams
    from tests.plugins.host_fed import async_cpu_registry

    async_cpu_registry(monkeypatch, "torch")
    model_dir = checkpoints.make_llama(tmp_path)
    params = [SamplingParams(temperature=0, max_tokens=greedy_tokens, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=9, ignore_eos=True)] * 4
    want, _ = generate(model_dir, params, runtime="torch", async_scheduling=False)
    monkeypatch.setattr(CpuPlatform, "runner_hooks", lambda self: hooks)
    got, llm = generate(model_dir, params, runtime="torch", **engine_args)
    return got, want, llm


@pytest.mark.parametrize("draw, every", [(True, 1), (True, 2), (False, 1)], ids=["draws", "half", "declines"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_forward_replacement_may_draw_the_tokens_of_decode_steps(tmp_path, checkpoints, monkeypatch, draw, every,
                                                                  async_scheduling):
    """The runner attaches its sample_async to a replacement that can draw (API 1.20) and takes
    the draw of each decode step it hands over, greedy and seeded alike, or samples the logits
    itself where the replacement hands them back or declined the sampler."""
    hooks = _SampleHooks(draw, every)
    got, want, llm = _with_hooks(tmp_path, checkpoints, monkeypatch, hooks, 8, async_scheduling=async_scheduling)
    assert got == want
    assert llm.engine.runner._with_sample == draw
    assert (hooks.sampled > 0) == draw and (hooks.handed_back > 0) == (every > 1)


class _AdvanceHooks(_SampleHooks):
    """``_SampleHooks`` whose replacement also runs a round's later decode steps from the step
    it drew last (API 1.21's ``advance_sample``), building their inputs itself as a backend
    does on its device; it declines every ``decline``-th call (0: never)."""

    def __init__(self, every: int = 1, decline: int = 0) -> None:
        super().__init__(True, every)
        self.decline, self.advanced, self.declined = decline, 0, 0

    def wrap_forward(self, forward, limits):
        from fd_core.engine.model_runner import ragged_inputs

        replacement = super().wrap_forward(forward, limits)
        hooks, drew, last = self, replacement.with_sample, {}

        def with_sample(ids, positions, kv_caches, meta, batch):
            got = drew(ids, positions, kv_caches, meta, batch)
            last.clear()
            if got[2] is not None:
                last.update(kv_caches=kv_caches, meta=meta, drawn=got[2])
            return got

        def advance_sample(batch):
            assert last, "advance_sample after a step the replacement did not draw"
            if hooks.decline and (hooks.advanced + hooks.declined + 1) % hooks.decline == 0:
                hooks.declined += 1
                last.clear()
                return None
            meta, n = last["meta"], last["meta"].num_seqs
            step = ragged_inputs(np.zeros(n, dtype=np.int64), meta.block_tables, meta.context_lens + 1,
                                 np.ones(n, dtype=np.int64), meta.block_size)
            ids = torch.as_tensor(last["drawn"].result().token_ids, dtype=torch.int64)
            hidden, logits = replacement.with_head(ids, torch.as_tensor(step.positions), last["kv_caches"], step.meta)
            drawn = replacement.sample(logits, batch)
            last.update(meta=step.meta, drawn=drawn)
            hooks.advanced += 1
            return drawn

        replacement.with_sample, replacement.advance_sample = with_sample, advance_sample
        return replacement


@pytest.mark.parametrize("every, decline", [(1, 0), (1, 3), (2, 0)], ids=["advances", "declines", "after_draws"])
def test_a_forward_replacement_may_run_a_round_s_later_steps(tmp_path, checkpoints, monkeypatch, every, decline):
    """With --num-scheduler-steps the runner hands a round's later decode steps to a replacement
    that advances its last draw (API 1.21) and builds and launches a step itself where the
    replacement declines, or where the step before was not the replacement's draw (it handed
    the logits back): greedy and seeded tokens as without rounds."""
    hooks = _AdvanceHooks(every, decline)
    got, want, llm = _with_hooks(tmp_path, checkpoints, monkeypatch, hooks, 11, num_scheduler_steps=4)
    assert got == want
    assert llm.engine.core.stats["rounds"] > 0
    assert hooks.advanced > 0
    assert (hooks.declined > 0) == (decline > 0)
    assert (hooks.handed_back > 0) == (every > 1)
