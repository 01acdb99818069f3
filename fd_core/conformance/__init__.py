"""The conformance kit: what a backend must do to be an fd backend, as pytest tests.

    pytest --pyargs fd_core.conformance --fd-device NAME [--fd-runtime R] [--fd-emulate]

- ``test_contract``: discovery, the API version, the platform's answers, and every capability
  in its manifest either honoured or, when not declared, refused at start-up with one sentence
  naming the flag and the backend;
- ``test_memory``: transfers, the KV cache and its block copies, swap, memory queries;
- ``test_ops``: every implementation the backend registers (and each op the engine would select,
  the runtime's reference included) against the NumPy specification over shapes and every
  declared dtype, at ``fd_core.testing.spec.tolerance``;
- ``test_generation``: greedy generation end to end on a small random-weight Llama, held to the
  specification's own greedy continuation.

Options and fixtures come from ``fd_core.testing.plugin`` (fd-core's ``pytest11`` entry point).
"""
