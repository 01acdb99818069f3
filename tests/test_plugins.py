"""Discovery, the allowlist, the API-version check, op selection and `fd backends`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fd_core.errors import BackendError, ConfigError
from fd_core.interfaces import Capabilities, is_compatible
from fd_core.plugins import BackendRegistry, OpRegistry
from fd_core.testing.models import write_checkpoint
from tests.plugins import fake_dists

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def site(tmp_path, monkeypatch):
    """A site folder with a broken backend, an old-API backend and a working toy backend."""
    site = tmp_path / "site"
    fake_dists.install(site, "fd-backend-broken", "fd_backend_broken", fake_dists.BROKEN, "broken")
    fake_dists.install(site, "fd-backend-oldapi", "fd_backend_oldapi", fake_dists.OLD_API, "oldapi", "0.3.0")
    fake_dists.install(site, "fd-backend-toy", "fd_backend_toy", fake_dists.EXTRA_OP, "toy")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("FD_BACKENDS", raising=False)
    # a test that rediscovers (get_registry(refresh=True)) while these packages are on the path
    # would leave the process-wide registry holding them; the one from before comes back
    monkeypatch.setattr("fd_core.plugins.registry._registry", None)
    yield site
    for mod in ("fd_backend_broken", "fd_backend_oldapi", "fd_backend_toy"):
        sys.modules.pop(mod, None)


def test_version_rule():
    assert is_compatible("1.0")[0]
    assert is_compatible("1.0.7", "1.2.0")[0]
    ok, why = is_compatible("1.3", "1.2.0")
    assert not ok and "upgrade fd-core" in why
    ok, why = is_compatible("2.0", "1.2.0")
    assert not ok and "major" in why
    assert not is_compatible("banana")[0]


def test_capabilities_are_immutable_and_checked():
    caps = Capabilities(dtypes={"float32", "bfloat16"}, device_count=2)
    assert isinstance(caps.dtypes, frozenset)
    with pytest.raises(Exception):
        caps.dtypes = frozenset()  # type: ignore[misc]
    assert caps.unsupported(dtypes="bfloat16", device_count=2) == []
    assert caps.unsupported(dtypes="float16", graph_capture=True, device_count=4) == [
        "dtypes=float16", "graph_capture=True", "device_count=4"]


def test_failures_are_reported_and_cpu_keeps_working(site):
    reg = BackendRegistry()
    by_name = {r.name: r for r in reg.records}
    assert by_name["cpu"].loaded
    assert "import failed" in by_name["broken"].error and "libvendor_runtime.so" in by_name["broken"].error
    assert by_name["broken"].package == "fd-backend-broken"
    assert "incompatible" in by_name["oldapi"].error and "0.3" in by_name["oldapi"].error
    assert reg.platform("cpu").name == "cpu"
    with pytest.raises(BackendError, match="failed to load.*libvendor"):
        reg.platform("broken")
    with pytest.raises(BackendError, match="no such backend; a backend is a package of its own.*installed "
                                           "backends: cpu, .*toy"):
        reg.platform("nonexistent")
    with pytest.raises(BackendError, match=r"--device xpu: no such backend; install it with pip install "
                                           r"fd-backend-xpu; installed backends: none"):
        BackendRegistry(entry_points=[]).platform("xpu")


def test_a_registration_that_fails_part_way_leaves_nothing_behind(site):
    fake_dists.install(site, "fd-backend-half", "fd_backend_half", fake_dists.HALF_REGISTERED, "half")
    try:
        reg = BackendRegistry()
        half = {r.name: r for r in reg.records}["half"]
        assert half.error == ("hook failed: RuntimeError: the vendor kernel library is missing "
                              f"(at {site}/fd_backend_half/__init__.py:14)")
        assert [i.name for i in reg.ops.implementations("silu_and_mul", "cpu")] == []
        assert ("halfchip", "paddle") not in reg.ops._adopted
        rows = {op: impl for op, impl, _, _ in reg.op_table(reg.platform("cpu"), {"dtype": "float32"}).describe()}
        assert rows["silu_and_mul"] != "half-silu"
    finally:
        sys.modules.pop("fd_backend_half", None)


@pytest.mark.oracle
def test_cpu_generates_while_broken_backends_are_installed(site, tmp_path):
    pytest.importorskip("transformers")
    from fd_core import LLM, SamplingParams
    from fd_core.plugins import get_registry
    from tests import checkpoints

    registry = get_registry(refresh=True)  # discovery sees the broken packages (`site` restores the old one)
    assert {r.name for r in registry.failures()} >= {"broken", "oldapi"}
    llm = LLM(model=str(checkpoints.make_llama(tmp_path)), device="cpu", num_kv_blocks=16, max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_allowlist(site, monkeypatch):
    monkeypatch.setenv("FD_BACKENDS", "cpu")
    reg = BackendRegistry()
    assert [p.name for p in reg.platforms()] == ["cpu"]
    assert "not in FD_BACKENDS" in {r.name: r for r in reg.records}["toy"].error


def test_out_of_tree_op_wins_others_fall_back(site, caplog):
    reg = BackendRegistry()
    toy = reg.platform("toy")
    with caplog.at_level("WARNING", logger="fd.ops"):
        table = reg.op_table(toy, {"dtype": "float32"})
    rows = {op: (impl, why) for op, impl, _, why in table.describe()}
    assert rows["silu_and_mul"][0] == "toy-silu"
    # rms_norm's registered impl declines float32, so the reference is used and a warning logged
    assert rows["rms_norm"][0] == "reference" and "declined" in rows["rms_norm"][1]
    assert rows["attention"][0] == "reference" and "fallback" in rows["attention"][1]
    assert any("attention" in r.getMessage() for r in caplog.records)
    pinned = reg.op_table(toy, {"dtype": "float32"}, {"silu_and_mul": "reference"})
    assert {op: impl for op, impl, _, _ in pinned.describe()}["silu_and_mul"] == "reference"
    with pytest.raises(ConfigError, match="no implementation named 'fast'"):
        reg.op_table(toy, {}, {"attention": "fast"})
    with pytest.raises(ConfigError, match="unknown ops"):
        reg.op_table(toy, {}, {"flash": "x"})


def test_a_wrong_signature_is_refused_at_load_naming_plugin_op_and_contract(site):
    fake_dists.install(site, "fd-backend-wrong", "fd_backend_wrong", fake_dists.WRONG_SIGNATURE, "wrong")
    try:
        reg = BackendRegistry()
        wrong = {r.name: r for r in reg.records}["wrong"]
        assert wrong.error == (
            "hook failed: TypeError: fd-backend-wrong registers 'wrong-rms-norm' for rms_norm on cpu, but it takes "
            "no parameter 4 (residual); the contract is rms_norm(x: T[..., H], weight: T[H], eps: float, "
            f"residual: T[..., H] | None = None) -> T | tuple[T, T] (at {site}/fd_backend_wrong/__init__.py:15)")
        assert [i.name for i in reg.ops.implementations("rms_norm", "cpu")] == []
    finally:
        sys.modules.pop("fd_backend_wrong", None)


@pytest.mark.parametrize("fn, why", [
    (lambda x, weight, eps, residual=None: x, ""),
    (lambda h, w, e, r=None: h, "does not take residual= by name"),  # a renamed default
    (lambda *args, **kwargs: None, ""),
    (lambda x, weight, eps, residual, scale: x, "requires scale, which the engine never passes"),
    (lambda x, weight, eps, residual, *, out: x, "requires out, which the engine never passes"),
])
def test_signature_rules(fn, why):
    from fd_core.plugins.signatures import mismatch

    assert mismatch("rms_norm", fn) == why


def test_every_shipped_op_table_has_the_contract_signatures():
    from fd_core.plugins.signatures import mismatch
    from fd_core.runtimes.paddle import REFERENCE_OPS as paddle_ops
    from fd_core.runtimes.paddle.fused import ADAPTERS

    tables = [paddle_ops, ADAPTERS]
    if __import__("importlib").util.find_spec("torch"):
        from fd_core.runtimes.torch import REFERENCE_OPS as torch_ops

        tables.append(torch_ops)
    assert {op: mismatch(op, fn) for table in tables for op, fn in table.items() if mismatch(op, fn)} == {}


def test_registering_an_unknown_op_is_refused():
    with pytest.raises(ValueError, match="unknown op"):
        OpRegistry().register("conv2d", "cpu", lambda x: x, name="x")


def test_a_declining_predicate_may_say_why():
    def float32_only(dtype=None, **_):
        return dtype == "float32"

    def broken_why(**_):
        raise RuntimeError("no reason today")

    float32_only.why = lambda dtype=None, **_: f"the kernel has no {dtype} variant"
    reg = OpRegistry()
    reg.register("rms_norm", "chip", lambda *a, **k: None, name="told", priority=2, supports=float32_only)
    silent = lambda dtype=None, **_: dtype == "float32"  # noqa: E731
    silent.why = broken_why
    reg.register("rms_norm", "chip", lambda *a, **k: None, name="silent", priority=1, supports=silent)
    reg.register_reference("paddle", {"rms_norm": lambda *a, **k: None})
    reason = reg.select("chip", "paddle", {"dtype": "bfloat16"}).choices["rms_norm"].reason
    assert ("declined (told: supports() declined this configuration: the kernel has no bfloat16 variant; "
            "silent: supports() declined this configuration)") in reason  # a failing why() adds nothing
    assert reg.select("chip", "paddle", {"dtype": "float32"}).choices["rms_norm"].impl.name == "told"


def test_pack_experts_goes_with_the_moe_of_its_name():
    """The chosen moe gets what the pack_experts registered under its name makes; a moe of
    another name (a pin to the reference, a declining kernel) gets the lists."""
    reg = OpRegistry()
    reference_moe = lambda *a, **k: "reference"  # noqa: E731
    reg.register_reference("torch", {"moe": reference_moe})
    bf16_only = lambda dtype=None, **_: dtype == "bfloat16"  # noqa: E731
    reg.register("moe", "chip", lambda *a, **k: "fused", name="fused-moe", priority=5, supports=bf16_only)
    reg.register("pack_experts", "chip", lambda g, d: ("stacked", len(g) + len(d)), name="fused-moe",
                 priority=5, supports=bf16_only)
    reg.register("pack_experts", "chip", lambda g, d: ("wrong", 0), name="another", priority=9)
    lists = ([1, 2], [3, 4])

    table = reg.select("chip", "torch", {"dtype": "bfloat16"})
    assert table.choices["moe"].impl.name == "fused-moe"
    assert table.pack_experts(*lists) == ("stacked", 4)
    assert "paired with moe (fused-moe)" in table.choices["pack_experts"].reason
    for declined in (reg.select("chip", "torch", {"dtype": "float32"}),
                     reg.select("chip", "torch", {"dtype": "bfloat16"}, pins={"moe": "reference"})):
        assert declined.moe is reference_moe
        assert declined.pack_experts(*lists) == lists  # nothing paired: the lists as they are


def test_a_fused_op_stands_in_only_where_its_package_serves_its_parts():
    """rotary_attention is chosen beside the rotary and attention of its own package; a pin
    (or a fallback) that takes either part elsewhere leaves it out, so the parts run, unless
    it is pinned itself."""
    reg = OpRegistry()
    reg.register_reference("torch", {"rotary": lambda *a: "ref", "attention": lambda *a: "ref"})
    with reg.registering("fd-backend-chip"):
        for op in ("rotary", "attention", "rotary_attention"):
            reg.register(op, "chip", lambda *a: "chip", name=f"chip-{op}", priority=5)
    assert reg.select("chip", "torch", {"dtype": "bfloat16"}).has("rotary_attention")
    for part in ("rotary", "attention"):
        table = reg.select("chip", "torch", {"dtype": "bfloat16"}, pins={part: "reference"})
        assert not table.has("rotary_attention") and table.choices[part].impl.name == "reference"
    pinned = reg.select("chip", "torch", {"dtype": "bfloat16"},
                        pins={"attention": "reference", "rotary_attention": "chip-rotary_attention"})
    assert pinned.has("rotary_attention")
    with reg.registering("fd-backend-other"):  # a faster attention from another package
        reg.register("attention", "chip", lambda *a: "other", name="other-attention", priority=9)
    table = reg.select("chip", "torch", {"dtype": "bfloat16"})
    assert table.choices["attention"].impl.name == "other-attention" and not table.has("rotary_attention")


def test_fd_backends_cli_reports_everything(site):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    env.pop("FD_BACKENDS", None)
    out = subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", "backends", "--json"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    report = {b["name"]: b for b in json.loads(out.stdout)["backends"]}
    cpu = report["cpu"]["platforms"]["cpu"]
    assert report["cpu"]["status"] == "loaded" and cpu["available"] and cpu["devices"] == (os.cpu_count() or 1)
    assert "float32" in cpu["capabilities"]["dtypes"]
    assert report["broken"]["status"] == "failed" and "libvendor_runtime.so" in report["broken"]["reason"]
    assert report["oldapi"]["status"] == "failed" and "incompatible" in report["oldapi"]["reason"]
    text = subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", "backends"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert text.returncode == 0
    assert "device cpu: type cpu, runtime paddle, 1 device\n" in text.stdout  # one CPU, whatever its cores
    assert "reason: import failed" in text.stdout
    # the plugin's own file and line, and with --verbose the traceback
    broken = str(site / "fd_backend_broken" / "__init__.py")
    assert f"libvendor_runtime.so: cannot open shared object file (at {broken}:2)" in report["broken"]["reason"]
    verbose = subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", "backends", "--verbose"],
                             capture_output=True, text=True, env=env, timeout=120)
    assert verbose.returncode == 0 and "  Traceback (most recent call last):" in verbose.stdout
    assert f'  File "{broken}", line 2, in <module>' in verbose.stdout


def test_fd_doctor_prints_the_chosen_table(site, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    out = subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", "doctor", "--device", "toy",
                          "--op", "attention=reference"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert "toy-silu" in lines["silu_and_mul"] and "pinned by the user" in lines["attention"]
    assert out.stdout.splitlines()[1] == "  for float32, any head size (--model applies one)"
    assert "declined" in lines["rotary"] and "toy-rope-16" not in lines["rotary"].split()[1]
    # with a model, the choice is the engine's: its head size (16) is what the kernel takes
    model = tmp_path / "tiny"
    write_checkpoint(model)
    out = subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", "doctor", "--device", "toy",
                          "--model", str(model)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert out.stdout.splitlines()[1] == f"  for float32, head size 16 ({model})"
    assert lines["rotary"].split()[1] == "toy-rope-16"
    missing = subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", "doctor", "--device", "toy",
                              "--model", str(tmp_path / "nowhere")], capture_output=True, text=True, env=env,
                             timeout=120)
    assert missing.returncode == 2 and "nowhere" in missing.stderr and "Traceback" not in missing.stderr
    bad = subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", "doctor", "--device", "broken"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "libvendor_runtime.so" in bad.stderr and "Traceback" not in bad.stderr
