"""A torch-runtime backend whose reductions keep their running sums in the operand dtype: in
bfloat16, every addition rounds the sum to 8 significant bits, as in a kernel whose accumulator
is declared bfloat16 (a Triton ``acc`` of ``tl.bfloat16``, or a scalar loop ``acc += x[k] * w[k]``
over bfloat16 values) instead of float32. In float32 the same code is right.

PyTorch's own CPU kernels accumulate bfloat16 in float32 (``torch.sum``, ``matmul``), so the
ops below keep the running sum explicitly: products and exponentials are formed in float32,
and the sum is rounded after each ``BLOCK`` terms (1: after every term;
``FD_TEST_ACCUMULATE_BLOCK`` sets it, 16 models a GPU kernel that rounds after each 16-deep
tensor-core step). Only ``linear`` (dense weights), ``rms_norm`` and ``attention`` are its own;
the torch reference serves the rest.
"""

BF16_ACCUMULATOR = '''
    import os

    import torch

    from fd_core.interfaces import Capabilities
    from fd_core.interfaces.ops import QuantizedWeight
    from fd_core.plugins import hookimpl

    FD_API_VERSION = "1.2"
    BLOCK = int(os.environ.get("FD_TEST_ACCUMULATE_BLOCK", "1"))


    class Bf16Chip:
        name = "bf16chip"
        device_type = "bf16chip"
        runtime = "torch"

        def is_available(self):
            return True, ""

        def device_count(self):
            return 1

        def capabilities(self):
            dtypes = {"float32", "bfloat16"}
            return Capabilities(dtypes=dtypes, kv_cache_dtypes=dtypes)

        def memory(self, device_index=0):
            from fd_core.runtimes.torch import TorchMemory
            return TorchMemory("cpu")

        def communicator(self, rank=0, world_size=1, rendezvous=None):
            from fd_core.runtimes.torch import TorchCommunicator
            return TorchCommunicator(rank, world_size)

        def runner_hooks(self):
            return None


    def running_sum(terms, dtype):
        """The sum of float32 ``terms`` over the last axis, kept in ``dtype`` as it grows."""
        acc = torch.zeros(terms.shape[:-1], dtype=dtype)
        for start in range(0, terms.shape[-1], BLOCK):
            acc = acc + terms[..., start:start + BLOCK].sum(-1).to(dtype)
        return acc.float()


    def linear(x, weight, bias=None):
        from fd_core.runtimes.torch import REFERENCE_OPS
        if isinstance(weight, QuantizedWeight):
            return REFERENCE_OPS["linear"](x, weight, bias)
        y = running_sum(x.float()[:, None, :] * weight.float()[None, :, :], x.dtype)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


    def rms_norm(x, weight, eps, residual=None):
        h = x.float() if residual is None else x.float() + residual.float()
        mean_square = running_sum(h * h, x.dtype) / h.shape[-1]
        y = (h * torch.rsqrt(mean_square[..., None] + eps) * weight.float()).to(x.dtype)
        return y if residual is None else (y, h.to(x.dtype))


    def attention(q, k, v, kv_cache, meta, scale):
        from fd_core.runtimes.torch import REFERENCE_OPS
        REFERENCE_OPS["attention"](q, k, v, kv_cache, meta, scale)  # for its cache write alone
        key_cache, value_cache = kv_cache
        group = q.shape[1] // key_cache.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float32)
        for i in range(meta.num_seqs):
            start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
            context, total = int(meta.context_lens[i]), int(meta.seq_lens[i])
            pos = torch.arange(total)
            slots = torch.from_numpy(meta.block_tables[i])[pos // meta.block_size] * meta.block_size \\
                + pos % meta.block_size
            keys = key_cache[slots].float().repeat_interleave(group, dim=1)  # [T, Hq, D]
            values = value_cache[slots].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("lhd,thd->hlt", q[start:end].float(), keys) * scale
            visible = pos[None, :] <= (context + torch.arange(end - start))[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            p = torch.exp(scores - scores.amax(-1, keepdim=True))  # [Hq, L, T]
            weighted = p[:, :, None, :] * values.permute(1, 2, 0)[:, None, :, :]  # [Hq, L, D, T]
            acc, total_p = running_sum(weighted, q.dtype), running_sum(p, q.dtype)
            out[start:end] = (acc / total_p[..., None]).permute(1, 0, 2)
        return out.to(q.dtype)


    @hookimpl
    def fd_platforms():
        return [Bf16Chip()]


    @hookimpl
    def fd_register_ops(registry):
        for op, fn in (("linear", linear), ("rms_norm", rms_norm), ("attention", attention)):
            registry.register(op, "bf16chip", fn, name=f"{op}-bf16-sum", priority=10, runtime="torch")
        registry.use_reference("bf16chip", "torch")
'''
