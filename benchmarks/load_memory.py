#!/usr/bin/env python3
"""Peak host memory of loading a model plain and with ``--quantization`` (CPU, torch runtime).

    python benchmarks/load_memory.py [--layers 8] [--methods none wint8 wint4] [--model DIR]

Without ``--model`` it writes a random-weight Llama of TinyLlama-1.1B's width (hidden 2048, MLP
5632, 32 heads, 4 key-value heads, vocabulary 32000) at ``--layers`` depth as a float32 HF
checkpoint in a temporary folder. Each load runs in a fresh process and reports: peak RSS
(``VmHWM``, which counts the checkpoint's memory-mapped pages), peak anonymous memory
(``RssAnon`` sampled every 5 ms: what the process itself allocated), RSS before the load (Python, torch and fd imported), the bytes of the weights
the engine holds, and the load's seconds. ``--quantization`` quantizes each linear as the
checkpoint streams in, so its peak stays near the quantized size plus one float matrix.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def status_bytes(field: str) -> int:
    """A /proc/self/status figure. VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and
    exec, so a child would start at its parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(model: str, method: str) -> None:
    from fd_core import LLM

    before = status_bytes("VmRSS")
    peak_anon, done = [0], threading.Event()

    def poll() -> None:  # anonymous memory only: the checkpoint's mapped pages are page cache
        while not done.wait(0.005):
            peak_anon[0] = max(peak_anon[0], status_bytes("RssAnon"))

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    start = time.perf_counter()
    llm = LLM(model=model, device="cpu", runtime="torch", max_model_len=256, num_kv_blocks=32,
              quantization=None if method == "none" else method)
    seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    print(json.dumps({"method": method, "peak_rss": status_bytes("VmHWM"), "peak_anon": peak_anon[0],
                      "rss_before": before, "seconds": seconds, "weights": llm.engine.runner.model.weight_bytes()}))


def make_model(folder: Path, layers: int) -> str:
    sys.path.insert(0, str(ROOT))
    from tests import checkpoints

    return str(checkpoints.make_llama(folder, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                                      num_attention_heads=32, num_key_value_heads=4, vocab_size=32000))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--methods", nargs="+", default=["none", "wint8", "wint4"])
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model(Path(tmp), args.layers)
        disk = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
        print(f"model {model}: {disk / 2**30:.2f} GiB of safetensors")
        print(f"{'method':<8} {'peak RSS GiB':>12} {'peak anon GiB':>13} {'RSS before':>10} {'weights GiB':>11} "
              f"{'load s':>7}")
        for method in args.methods:
            out = subprocess.run([sys.executable, __file__, "--child", model, method], capture_output=True,
                                 text=True, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
            if out.returncode:
                print(f"{method:<8} failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{method:<8} {r['peak_rss'] / 2**30:>12.2f} {r['peak_anon'] / 2**30:>13.2f} "
                  f"{r['rss_before'] / 2**30:>10.2f} "
                  f"{r['weights'] / 2**30:>11.2f} {r['seconds']:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
