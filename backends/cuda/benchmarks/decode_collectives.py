"""The collectives of one decode step of a tensor-parallel ERNIE 4.5 MoE, alone, as fd's CUDA
graphs run them: one process per GPU over NCCL (NVLink multicast off), fd's
``TorchCommunicator``, and per step the sums the shared decoder makes (the embedding's, then
two a layer: after attention's ``o`` and after the MLP or the experts, sliced or dealt out
alike) and the gather of the LM head's vocabulary slices, captured in one graph and replayed.

    python backends/cuda/benchmarks/decode_collectives.py [--shape 21b|300b] [--world 2 4] [--batches 1 64 128]

Divided by a measured decode step (TPOT p50 of ``moe_serve.py`` at the same batch) this is the
collectives' share of the step: fd runs them in line, nothing overlaps them. With
``--enable-expert-parallel`` every rank still computes attention for every token, so the
experts' partial sums are added as a row-parallel matmul's are (``fd_core/models/parallel.py``):
the collectives, and these figures, are the same with EP on and off.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_serve import MULTICAST_OFF, SHAPES  # noqa: E402

REPLAYS = 50


def _rank(rank: int, world: int, rendezvous: str, shape: str, batches: list[int], results) -> None:
    import torch.distributed as dist
    from fd_core.runtimes.torch.communicator import TorchCommunicator, init_process_group

    init_process_group(rank, world, rendezvous, backend="nccl")
    comm = TorchCommunicator(rank, world)
    config = SHAPES[shape][0]
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    sums = 1 + 2 * layers
    for batch in batches:
        x = torch.zeros(batch, hidden, dtype=torch.bfloat16, device="cuda")
        logits = torch.zeros(batch, -(-vocab // world), dtype=torch.bfloat16, device="cuda")

        def step():
            for _ in range(sums):
                comm.all_reduce(x)
            return comm.all_gather(logits)

        step()  # NCCL's communicator and buffers
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        if rank == 0:
            results.put((world, batch, sums, start.elapsed_time(end) / REPLAYS))
        del graph
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="21b")
    parser.add_argument("--world", type=int, nargs="+", default=[2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    args = parser.parse_args()
    os.environ.update(MULTICAST_OFF)
    from fd_core.engine.executor import rendezvous_address

    ctx = mp.get_context("spawn")
    print(f"| GPUs | batch | collectives a step | ms a step ({args.shape} shape) |")
    print("|---|---|---|---|")
    for world in args.world:
        if world > torch.cuda.device_count():
            print(f"| {world} | - | - | only {torch.cuda.device_count()} GPUs |")
            continue
        results = ctx.Queue()
        mp.start_processes(_rank, args=(world, rendezvous_address(world), args.shape, args.batches, results),
                           nprocs=world, start_method="spawn")
        for _ in args.batches:
            world_, batch, sums, ms = results.get(timeout=60)
            print(f"| {world_} | {batch} | {sums} all-reduces + 1 all-gather | {ms:.3f} |", flush=True)


if __name__ == "__main__":
    main()
