"""A ``sample_async`` for the CPU, where no op is asynchronous: a runtime's reference sample,
handed back as a PendingSample whose ``feed`` scatters on the host. It counts its feeds
(``HostFed.fed``), and with ``FD_TEST_FEEDS`` set appends its process id to that file for each
feed, so a test can tell which processes (tensor-parallel ranks) fed steps."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from fd_core.engine.model_runner import PLACEHOLDER


class HostFed:
    fed = 0

    def __init__(self, output: Any) -> None:
        self.output = output

    def feed(self, ids: Any, dest: Any, src: Any) -> Any:
        HostFed.fed += 1
        log = os.environ.get("FD_TEST_FEEDS")
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\n")
        out, where = ids.numpy().copy(), dest.numpy()  # CPU tensors of either runtime
        assert (out[where] == PLACEHOLDER).all()  # only placeholders are written over
        out[where] = self.output.token_ids[src.numpy()]
        if hasattr(ids, "place"):  # a Paddle tensor
            import paddle

            return paddle.to_tensor(out, place=ids.place)
        import torch

        return torch.from_numpy(out)

    def result(self) -> Any:
        return self.output


def sampler(runtime: str) -> Callable[[Any, Any], HostFed]:
    """``sample_async`` over ``runtime``'s reference sample."""
    if runtime == "paddle":
        from fd_core.runtimes.paddle.ops import REFERENCE_OPS
    else:
        from fd_core.runtimes.torch.ops import REFERENCE_OPS
    sample = REFERENCE_OPS["sample"]
    return lambda logits, batch: HostFed(sample(logits, batch))


def async_cpu_registry(monkeypatch: Any, runtime: str = "paddle") -> Any:
    """Install, for one test, a process registry whose cpu device has this ``sample_async``
    (``runtime``'s reference sample); returns it."""
    from fd_core.plugins import registry as registry_module
    from fd_core.plugins.registry import BackendRegistry

    registry = BackendRegistry()
    registry.ops.register("sample_async", "cpu", sampler(runtime), name="host-fed", runtime=runtime)
    monkeypatch.setattr(registry_module, "_registry", registry)
    HostFed.fed = 0
    return registry
