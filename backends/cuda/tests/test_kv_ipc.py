"""The ``cuda_ipc`` KV-cache connector: tensors from a sender process reach a receiver process's
GPU bit for bit, without host memory; with two GPUs, from GPU 0 to GPU 1 (a peer copy); a
receiver that cannot see the sender's GPU fails the send, saying so. And a prefill and a decode
engine handing requests over through it decode as one engine does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fd_core.plugins import get_registry  # noqa: E402
from tests.test_kv_transfer import wait_for  # noqa: E402

RECEIVER = textwrap.dedent("""
    import sys, time, torch
    from fd_core.plugins import get_registry
    t = get_registry().kv_transfer("cuda_ipc", 20.0)
    print(t.listen("127.0.0.1"), flush=True)
    deadline, left = time.monotonic() + 60, int(sys.argv[1])
    while left and time.monotonic() < deadline:
        for got in t.received():
            left -= 1
            where = sorted({str(a.device) for a in got.arrays})
            sums = [float(a.view(torch.uint8).double().sum()) if a.dtype.itemsize == 1 else float(a.double().sum())
                    for a in got.arrays]
            print("GOT", got.request_id, got.header.decode(), got.nbytes, ",".join(where), *sums, flush=True)
        time.sleep(0.005)
    time.sleep(0.5)  # the acknowledgements leave
    t.close()
""")


def tensors(seed: int) -> list:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn((64, 2, 128), generator=g, device="cuda").to(torch.bfloat16),
            torch.randint(-128, 127, (48, 2, 130), generator=g, device="cuda", dtype=torch.int8),
            torch.randn((33, 1, 7), generator=g, device="cuda")]


def checksum(t) -> float:
    return float(t.view(torch.uint8).double().sum()) if t.dtype.itemsize == 1 else float(t.double().sum())


def receiver(count: int, visible: str | None):
    env = dict(os.environ)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    child = subprocess.Popen([sys.executable, "-c", RECEIVER, str(count)], stdout=subprocess.PIPE, text=True, env=env)
    lines = (line.strip() for line in child.stdout)
    return child, lines, next(line for line in lines if line.startswith("tcp://"))


def _visible_pair() -> str | None:
    """CUDA_VISIBLE_DEVICES for a receiver on another GPU that still sees this process's (its own first)."""
    if torch.cuda.device_count() < 2:
        return None
    ids = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(torch.cuda.device_count()))).split(",")
    return f"{ids[1]},{ids[0]}"


def test_tensors_reach_another_process_whole_and_buffers_are_reused():
    child, lines, endpoint = receiver(3, _visible_pair())
    sender = get_registry().kv_transfer("cuda_ipc", 20.0)
    try:
        assert sender.device == "cuda"
        for i in range(3):
            sent = tensors(i)
            sender.send(endpoint, f"r{i}", b"h", sent)
            (done,) = wait_for(sender.completed)
            assert done.ok, done.error
            assert done.nbytes == sum(t.numel() * t.element_size() for t in sent)
            request_id, header, nbytes, where, *sums = next(line for line in lines if line.startswith("GOT")).split()[1:]
            assert (request_id, header, int(nbytes)) == (f"r{i}", "h", done.nbytes)
            assert where == "cuda:0"  # the receiver's own GPU
            assert [float(s) for s in sums] == pytest.approx([checksum(t) for t in sent], rel=1e-12)
        assert len(sender._free) == 1  # one shared buffer took the three requests in turn
    finally:
        sender.close()
        child.wait(30)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_receiver_that_cannot_see_the_senders_gpu_fails_the_send_saying_so():
    child, lines, endpoint = receiver(0, os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")[-1])
    sender = get_registry().kv_transfer("cuda_ipc", 20.0)
    try:
        sender.send(endpoint, "hidden", b"h", tensors(0))
        (done,) = wait_for(sender.completed)
        assert not done.ok and "is not visible to this process: list it in CUDA_VISIBLE_DEVICES" in done.error
    finally:
        sender.close()
        child.kill()
        child.wait(30)


def test_host_arrays_are_refused():
    import numpy as np

    from fd_core.interfaces.kv_transfer import KVTransferError

    sender = get_registry().kv_transfer("cuda_ipc", 1.0)
    try:
        with pytest.raises(KVTransferError, match="moves tensors on cuda:0"):
            sender.send("tcp://127.0.0.1:1", "r", b"h", [np.zeros(4, np.float32)])
    finally:
        sender.close()


def test_a_prefill_and_a_decode_engine_through_the_connector(llama):
    """The engine's device path end to end in two processes: the decode engine's tokens are
    one engine's, and it computes no prompt token."""
    script = textwrap.dedent(f"""
        import json, sys, time
        from fd_core import LLM, SamplingParams
        from fd_core.engine.core import Prefilled
        from fd_core.plugins import get_registry
        core = LLM(model={str(llama)!r}, device="cuda", max_model_len=128, block_size=16, num_kv_blocks=64).engine.core
        t = get_registry().kv_transfer("cuda_ipc", 20.0)
        print(t.listen("127.0.0.1"), flush=True)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        tokens, left, deadline = {{}}, 4, time.monotonic() + 60
        while left and time.monotonic() < deadline:
            for got in t.received():
                left -= 1
                rid, first, prompt = got.header.decode().split(":")
                assert all(a.device.type == "cuda" for a in got.arrays)
                core.add_request(rid, [int(x) for x in prompt.split(",")], params,
                                 prefilled=Prefilled(int(first), 0, [got.arrays], 0))
            time.sleep(0.005)
        while core.has_unfinished_requests():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
        print("TOKENS", core.stats["prompt_tokens_computed"], json.dumps(tokens), flush=True)
        t.close()
    """)
    from fd_core import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5 + i, 17, 33, 9 + i] * (3 + 2 * i) for i in range(4)]
    alone = LLM(model=str(llama), device="cuda", max_model_len=128, block_size=16, num_kv_blocks=64,
                async_scheduling=False)
    reference = {f"r{i}": list(o.outputs[0].token_ids) for i, o in enumerate(alone.generate(
        [{"prompt_token_ids": p} for p in prompts], params))}
    prefill = alone.engine.core
    env = dict(os.environ)
    if _visible_pair():
        env["CUDA_VISIBLE_DEVICES"] = _visible_pair()
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    lines = (line.strip() for line in child.stdout)
    endpoint = next(line for line in lines if line.startswith("tcp://"))
    sender = get_registry().kv_transfer("cuda_ipc", 20.0)
    try:
        firsts = {}
        for i, prompt in enumerate(prompts):
            prefill.add_request(f"r{i}", prompt, params, hand_over=True)
        while prefill.has_unfinished_requests():
            prefill.step()
            for seq in prefill.prefilled():
                (kv,) = prefill.export_kv(seq, on_device=True)
                firsts[seq.request_id] = first = seq.output_token_ids[0]
                header = f"{seq.request_id}:{first}:{','.join(map(str, seq.prompt_token_ids))}"
                prefill.release(seq)  # the export is a copy: the blocks may go before the send ends
                sender.send(endpoint, seq.request_id, header.encode(), kv)
        done = []
        wait_for(lambda: done.extend(sender.completed()) or len(done) == len(prompts))
        assert all(d.ok for d in done), [d.error for d in done]
        line = next(line for line in lines if line.startswith("TOKENS"))
        computed, tokens = line.removeprefix("TOKENS ").split(" ", 1)
        assert firsts == {r: t[0] for r, t in reference.items()}
        assert json.loads(tokens) == {r: t[1:] for r, t in reference.items()}
        assert int(computed) == 0
    finally:
        sender.close()
        child.wait(60)
