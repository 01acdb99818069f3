"""KV-cache transfer between two processes on this machine, per connector (``tcp``, ``nixl``):
the time from ``send`` to the receiver's acknowledgement, for a request's KV cache of a given
number of tokens in a given model's layout. Prints a table; nothing is asserted.

    python benchmarks/kv_transfer.py                      # SmolLM2-135M's layout, float32
    python benchmarks/kv_transfer.py --layers 32 --kv-heads 8 --head-dim 128 --dtype bfloat16

The arrays are what the engine sends: a key and a value array per layer, ``[tokens rounded up to
whole blocks, kv heads, head dim]`` in the cache's dtype; bfloat16 travels as its 16-bit
patterns (uint16), as ``ModelRunner.export_kv`` sends it since API 1.15.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np

from fd_core.errors import ConfigError
from fd_core.plugins import get_registry

RECEIVER = textwrap.dedent("""
    import sys, time
    from fd_core.plugins import get_registry
    t = get_registry().kv_transfer(sys.argv[1], 60.0)
    print("ENDPOINT", t.listen("127.0.0.1"), flush=True)
    expected = int(sys.argv[2])
    got = 0
    while got < expected:
        got += len(t.received())
        time.sleep(0.0005)
    time.sleep(0.5)
    t.close()
""")


def run(protocol: str, arrays: list[np.ndarray], repeats: int) -> list[float]:
    child = subprocess.Popen([sys.executable, "-c", RECEIVER, protocol, str(repeats + 1)], stdout=subprocess.PIPE,
                             text=True)
    sender = get_registry().kv_transfer(protocol, 60.0)
    try:
        endpoint = next(line.split()[1] for line in child.stdout if line.startswith("ENDPOINT"))
        seconds = []
        for i in range(repeats + 1):  # the first one also connects: not counted
            sender.send(endpoint, f"r{i}", b"", arrays)
            done = []
            while not done:
                done = sender.completed()
                time.sleep(0.0002)
            if done[0].error:
                raise RuntimeError(done[0].error)
            if i:
                seconds.append(done[0].seconds)
        return seconds
    finally:
        sender.close()
        child.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", help="the cache dtype (bfloat16 travels as its uint16 bits)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 256, 2048])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--protocols", nargs="+", default=["tcp", "nixl"])
    args = ap.parse_args()
    dtype = np.uint16 if args.dtype == "bfloat16" else np.dtype(args.dtype)
    print(f"{args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}, {args.dtype}, blocks of "
          f"{args.block_size}; median of {args.repeats} sends, each until acknowledged")
    print(f"{'connector':>9} {'tokens':>7} {'MiB':>8} {'ms':>8} {'MiB/s':>8}")
    for protocol in args.protocols:
        for tokens in args.tokens:
            rows = -(-tokens // args.block_size) * args.block_size
            arrays = [np.random.default_rng(i).standard_normal((rows, args.kv_heads, args.head_dim)).astype(dtype)
                      for i in range(2 * args.layers)]
            mib = sum(a.nbytes for a in arrays) / 2**20
            try:
                median = statistics.median(run(protocol, arrays, args.repeats))
            except ConfigError as exc:
                print(f"{protocol:>9}: skipped: {exc}")
                break
            print(f"{protocol:>9} {tokens:>7} {mib:>8.2f} {median * 1000:>8.2f} {mib / median:>8.0f}")


if __name__ == "__main__":
    main()
