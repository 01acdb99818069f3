"""Triton kernels, one module per concept:

* ``rms_norm``   -- RMSNorm, optionally fused with the residual add
* ``rotary``     -- rotary position embedding, neox and interleaved styles
* ``activation`` -- silu_and_mul
* ``attention``  -- KV-cache write + paged attention over a mixed prefill/decode batch
* ``sampling``   -- the ``sample`` op: greedy, temperature / top-k / top-p / min-p, without a sort

All of them take torch tensors and run on whatever device Triton drives; with
``TRITON_INTERPRET=1`` set before ``triton`` is first imported they run on CPU tensors through
Triton's interpreter (slow, for testing). The modules are not imported here, so that
``fd_backend_cuda.kernels.rotary`` is the module, not the function of the same name.
"""
