"""The one-row wint4 kernel (``kernels/int4_row.py``) compiled for sm90 and sm80 without a GPU:
its layout claims (a word unpacks into the mma's A registers, the scales sit in the rows'
threads) are ``assert_trivial`` conversions that fail at compile time, and the PTX shows the
tensor-core instructions, 16-byte weight loads read ``evict_first`` and no byte-wise loads.
Its values are checked on a GPU by ``test_quantized_linear.py``'s one-row cases.

The compiler runs in a child process: on a machine without a GPU the conftest turns on
Triton's interpreter, under which the ``jit`` functions a Gluon kernel calls cannot be compiled."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from fd_backend_cuda.kernels import int4_gemv, int4_row  # noqa: E402

SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "y_ptr": "*bf16",
             "ws_ptr": "*fp32", "cnt_ptr": "*i32", "N": "i32", "K": "i32", "K_SPLIT": "i32", "K_SPLIT_WORDS": "i32",
             "stride_wn": "i32", "stride_sn": "i32"}


def compile_ptx(half: int, dtype: torch.dtype, group: int, zeros: bool, split: bool, pdl: bool, arch: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    w_layout, x_layout = int4_row._layouts(half)
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    signature = {k: (f"*{name}" if k in ("x_ptr", "y_ptr") else v) for k, v in SIGNATURE.items()}
    constants = dict(H=half, GROUP=group, HAS_ZEROS=zeros, SPLIT=split,
                     UNPACK=int4_row._UNPACK[dtype],
                     DT=gl.bfloat16 if dtype == torch.bfloat16 else gl.float16, MAGIC=int4_gemv.MAGIC[dtype][1],
                     WL=w_layout, XV=x_layout, GP=triton.next_power_of_2(group), GC=min(32, triton.next_power_of_2(max(1, 4096 // group))),
                     PDL=pdl)
    signature.update({k: "constexpr" for k in constants})
    # as the launcher specializes them: pointers and strides divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(SIGNATURE))}
    source = GluonASTSource(int4_row._int4_row_kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": 4, "maxnreg": int4_row.MAX_REGISTERS}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]


@pytest.mark.parametrize("half, dtype, group, zeros, split, pdl, arch", [
    (128, torch.bfloat16, 128, True, True, True, 90),
    (128, torch.float16, 128, False, False, True, 90),
    (64, torch.bfloat16, 64, True, True, False, 90),
    (128, torch.bfloat16, 4096, True, False, False, 80),
    (64, torch.float16, 384, False, False, True, 90),  # groups not tiling a step: the scales' division
])
def test_int4_row_compiles_to_tensor_cores_and_wide_loads(half, dtype, group, zeros, split, pdl, arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = Path(__file__).resolve().parent
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), env.get("PYTHONPATH", "")])
    args = json.dumps([half, str(dtype).removeprefix("torch."), group, zeros, split, pdl, arch])
    code = ("import json, sys, torch; from test_int4_row import compile_ptx; a = json.loads(sys.argv[1]); "
            "a[1] = getattr(torch, a[1]); sys.stdout.write(compile_ptx(*a))")
    run = subprocess.run([sys.executable, "-c", code, args], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    ptx = run.stdout
    kind = "bf16" if dtype == torch.bfloat16 else "f16"
    assert re.search(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{kind}\.{kind}\.f32", ptx)
    assert re.search(r"ld\.global\.L1::evict_first[.\w:]*\.v4\.b32", ptx)  # the weight's 16-byte loads
    assert not re.search(r"ld\.global[.\w:]*\.(u8|b8|s8)\b", ptx)  # never byte by byte
    assert (".maxnreg 128" in ptx) and (("griddepcontrol.wait" in ptx) == pdl)


def test_int4_row_serves_one_row_of_16_bit_floats_with_narrow_groups():
    """What goes to int4_gemv or the tiled kernel instead: two rows, float32, half-chunks of 32
    columns or not dividing the group (a half's sum takes one scale); and CPU tensors (Triton's
    interpreter runs no Gluon). Groups wider than a step are served, 384 across 256-column steps too."""
    from fd_core.interfaces import QuantizedWeight

    def weight(group: int, in_features: int) -> QuantizedWeight:
        return QuantizedWeight("wint4", torch.zeros((64, in_features // 2), dtype=torch.uint8),
                               torch.ones((64, in_features // group)), group, (64, in_features), None, "cuda_w4")

    narrow = weight(128, 1024)
    assert int4_row.serves(1, torch.bfloat16, narrow, 128) and int4_row.serves(1, torch.float16, narrow, 128)
    assert int4_row.serves(1, torch.bfloat16, weight(64, 1024), 64)
    assert not int4_row.serves(2, torch.bfloat16, narrow, 128)
    assert not int4_row.serves(1, torch.float32, narrow, 128)
    assert not int4_row.serves(1, torch.bfloat16, weight(32, 1024), 32)
    assert int4_row.serves(1, torch.bfloat16, weight(512, 1024), 128)
    assert int4_row.serves(1, torch.bfloat16, weight(384, 3072), 128)
    assert not int4_row.serves(1, torch.bfloat16, weight(192, 3072), 128)
    assert int4_row.serves(1, torch.bfloat16, weight(1024, 1024), 128)  # one group a row (per channel)
    assert not int4_row.supports(torch.zeros((1, 1024), dtype=torch.bfloat16), narrow, 128)


def test_split_k_plans():
    """The split-K rule both int4 kernels share: two programs per SM where K allows, each
    keeping ``min_steps`` whole steps; the programs' columns tile K."""
    for n, k, step, min_steps in [(4096, 4096, 256, 2), (4096, 14336, 256, 1), (28672, 4096, 256, 2),
                                  (256, 4096, 128, 1), (1000, 1024, 128, 2)]:
        (tiles, splits), k_split = int4_gemv.split_k(n, k, step, 132, min_steps)
        assert tiles == -(-n // int4_gemv.BLOCK_N) and k_split % step == 0 and splits == -(-k // k_split)
        assert splits == 1 or k_split >= min_steps * step  # every program keeps its steps
        if splits > 1:
            assert tiles * splits // 2 < 2 * 132  # no split beyond two programs per SM
    assert int4_gemv.split_k(28672, 4096, 256, 132, 2) == ((448, 1), 4096)  # enough programs already
    assert int4_gemv.split_k(4096, 4096, 256, 132, 2) == ((64, 8), 512)  # two steps a program


def test_packed_scales_are_the_kept_ones():
    """``pack_linear``'s cuda_w4 scales and zeros are exactly ``kept``'s rounding, the form the MoE
    and model tests build their exact references from (no GPU: packing runs on any tensor)."""
    import dataclasses

    import numpy as np
    from fd_core.quantization.quantize import quantize

    from fd_backend_cuda.kernels.quantized_linear import W4_SCALES, kept, pack_linear

    w = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
    canonical = quantize(w, "wint4", 128, zeros=True)
    host = kept(canonical)  # NumPy fields, as the loaders hold them
    as_torch = dataclasses.replace(canonical, qweight=torch.from_numpy(canonical.qweight),
                                   scales=torch.from_numpy(canonical.scales), zeros=torch.from_numpy(canonical.zeros))
    packed = pack_linear(as_torch)
    assert packed.layout == "cuda_w4" and packed.scales.dtype == packed.zeros.dtype == W4_SCALES
    for got, want in ((packed.scales, host.scales), (packed.zeros, host.zeros)):
        np.testing.assert_array_equal(got.float().numpy(), want)
    np.testing.assert_array_equal(kept(as_torch).scales.numpy(), host.scales)  # torch fields the same
    assert not np.array_equal(host.scales, canonical.scales)  # the rounding happened
