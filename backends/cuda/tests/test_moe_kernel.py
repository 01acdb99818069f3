"""The fused MoE kernel (``kernels/moe.py``) against the torch reference ``moe`` on the same GPU:
plain experts in float32 (exact products: 1e-5), bfloat16 and float16, and wint8 / wint4 /
block_wise_fp8 experts; decode and prefill token counts; ERNIE-4.5-21B-A3B's expert shape;
expert parallelism (a rank's share of the experts); and the same results replayed from a CUDA
graph with other inputs and other routing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fd_core.interfaces import QuantizedWeight
from fd_core.quantization.host import upload_quantized
from fd_core.quantization.quantize import quantize
from fd_core.runtimes.torch import ops as reference
from fd_core.runtimes.torch.memory import TorchMemory

from fd_backend_cuda.kernels import moe as fused  # noqa: E402
from fd_backend_cuda.kernels.quantized_linear import kept  # noqa: E402

# (relative) error allowed against the reference run in float32 on the same weights
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
QUANTIZED_TOLERANCE = 2.5e-2  # 16-bit activations; float32 ones are exact


def _quantized(w: torch.Tensor, method: str, group: int) -> QuantizedWeight:
    return upload_quantized(quantize(w.float().cpu().numpy(), method, group), TorchMemory("cuda"))


def _experts(e: int, hidden: int, inter: int, dtype, method: str | None, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = [torch.randn(2 * inter, hidden, generator=g, device="cuda") * hidden**-0.5 for _ in range(e)]
    down = [torch.randn(hidden, inter, generator=g, device="cuda") * inter**-0.5 for _ in range(e)]
    if method is None:
        return [w.to(dtype) for w in gate_up], [w.to(dtype) for w in down]
    group = {"wint8": -1, "wint4": 128, "block_wise_fp8": 128}[method]
    return [_quantized(w, method, group) for w in gate_up], [_quantized(w, method, group) for w in down]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def _case(n, e, hidden, inter, top_k, dtype, method, scoring="softmax", bias=False, share=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(n, hidden, generator=g, device="cuda").to(dtype)
    router = torch.randn(e, hidden, generator=g, device="cuda") * hidden**-0.5
    correction = torch.rand(e, generator=g, device="cuda") * 0.1 if bias else None
    gate_up, down = _experts(e, hidden, inter, dtype, method, seed)
    first, count = share or (0, e)
    gate_up, down = gate_up[first:first + count], down[first:first + count]
    extra = {"expert_offset": first} if share else {}
    ref_up = [kept(w) if isinstance(w, QuantizedWeight) else w.float() for w in gate_up]
    ref_down = [kept(w) if isinstance(w, QuantizedWeight) else w.float() for w in down]
    want = reference.moe(x.float(), router, ref_up, ref_down, top_k, scoring, True, correction, **extra)
    packed = fused.pack_experts(gate_up, down)
    assert not isinstance(packed[0], list), "pack_experts kept the lists: the kernel would not run"
    got = fused.moe(x, router, *packed, top_k, scoring, True, correction, **extra)
    assert got.dtype == dtype and got.shape == (n, hidden)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 5, 64, 333, 2048])
def test_plain_experts(n, dtype):
    got, want = _case(n, 16, 256, 384, 4, dtype, None, scoring="sigmoid", bias=True)
    assert _relative(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("method", ["wint8", "wint4", "block_wise_fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 64, 700])
def test_quantized_experts(n, dtype, method):
    got, want = _case(n, 8, 512, 256, 2, dtype, method)
    limit = 1e-5 if dtype == torch.float32 else QUANTIZED_TOLERANCE
    assert _relative(got, want) < limit


@pytest.mark.parametrize("method", [None, "wint4"])
@pytest.mark.parametrize("n", [64, 1024])
def test_ernie_21b_expert_shape(n, method):
    """64 experts of hidden 2560 / width 1536, top-6, bfloat16."""
    got, want = _case(n, 64, 2560, 1536, 6, torch.bfloat16, method)
    assert _relative(got, want) < QUANTIZED_TOLERANCE


@pytest.mark.parametrize("share", [(0, 4), (4, 4), (6, 2)])
@pytest.mark.parametrize("n", [3, 200])
def test_expert_parallel_share(n, share):
    """A rank holding experts share[0] .. share[0] + share[1] - 1 of 8: pairs that chose another
    rank's expert add nothing; a token that chose none gets zeros."""
    got, want = _case(n, 8, 128, 128, 2, torch.float32, None, share=share)
    assert _relative(got, want) < TOLERANCE[torch.float32]


def test_cuda_graph_replay_follows_new_inputs():
    """Captured once, replayed with other tokens (so other routing and other per-expert counts),
    the graph gives what an eager call gives on those tokens."""
    e, hidden, inter, n = 16, 256, 256, 24
    gate_up, down = fused.pack_experts(*_experts(e, hidden, inter, torch.bfloat16, "wint4"))
    router = torch.randn(e, hidden, device="cuda") * hidden**-0.5
    static = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) off the capture
        fused.moe(static, router, gate_up, down, 6)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused.moe(static, router, gate_up, down, 6)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        static.copy_(torch.randn(n, hidden, generator=g, device="cuda").to(torch.bfloat16) * (1 + seed))
        graph.replay()
        torch.cuda.synchronize()
        eager = fused.moe(static, router, gate_up, down, 6)
        assert torch.equal(out, eager)


def test_layouts_it_cannot_read_go_to_the_reference():
    """wint4 with a group of 48 has no int4 chunk; pack_linear dequantizes such a weight, and
    the stacked copies still run in the kernel (bfloat16 weights read in x's dtype)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    gate_up = [_quantized(torch.randn(192, 96, generator=g, device="cuda") * 0.1, "wint4", 48) for _ in range(4)]
    down = [_quantized(torch.randn(96, 96, generator=g, device="cuda") * 0.1, "wint4", 48) for _ in range(4)]
    x = torch.randn(9, 96, device="cuda")
    router = torch.randn(4, 96, device="cuda")
    packed = fused.pack_experts(gate_up, down)
    want = reference.moe(x, router, gate_up, down, 2)
    assert _relative(fused.moe(x, router, *packed, 2), want) < QUANTIZED_TOLERANCE
    mixed = fused.pack_experts(gate_up[:3] + [torch.randn(192, 96, device="cuda")], down)
    assert isinstance(mixed[0], list)  # kept: the reference moe serves them


@pytest.mark.parametrize("n,experts,top_k,share,scoring,bias", [
    (1, 64, 6, None, "softmax", True), (64, 64, 6, None, "softmax", False), (170, 64, 6, (32, 32), "softmax", True),
    (33, 16, 4, (4, 8), "sigmoid", True), (128, 128, 8, None, "sigmoid", False)])
def test_fused_routing_and_alignment_equal_the_torch_forms(n, experts, top_k, share, scoring, bias):
    """``route_and_align`` (two Triton programs, decode sizes) gives ``route`` + ``align``'s
    choices, weights, sorted pairs and block experts exactly (weights to float32 rounding)."""
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, 256, generator=g, device="cuda")
    router = torch.randn(experts, 256, generator=g, device="cuda") * 0.1
    correction = torch.rand(experts, generator=g, device="cuda") * 0.05 if bias else None
    first, count = share or (0, experts)
    renormalize = scoring == "softmax"
    ids, weights = reference.route(x, router, top_k, scoring, renormalize, correction)
    local = ids - first
    local = torch.where((local >= 0) & (local < count), local, count)
    for block_m in (16, 32):
        want_pairs, want_blocks = fused.align(local, count, block_m)
        got_ids, got_weights, pairs, blocks = fused.route_and_align(x @ router.t(), top_k, scoring, renormalize,
                                                                    correction, first, count, block_m)
        assert torch.equal(got_ids.long(), local)
        torch.testing.assert_close(got_weights, weights, rtol=1e-5, atol=1e-6)
        assert torch.equal(pairs.long(), want_pairs.long())
        assert torch.equal(blocks.long(), want_blocks.long())
