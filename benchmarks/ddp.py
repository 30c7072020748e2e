"""Data-parallel scaling: training steps of Seq2SeqTransformer on 1 and 2 MPI ranks, one thread each.

    python benchmarks/ddp.py [--config base] [--steps 8] [--ranks 1 2]

Each rank runs the config's batch (weak scaling: N ranks train on N times the tokens per step)
through forward, cross-entropy, backward with DistributedDataParallel (bucketed, non-blocking
all-reduce overlapping backward) and Adam, float32, dropout 0.1, as benchmarks/train_step.py.
Prints per run: the median ms/step, tokens/s over all ranks, the time the all-reduce adds
to a step (starting buckets during backward, and waiting for them at its end), and the
scaling efficiency (tokens/s of N ranks) / (N x tokens/s of one process without DDP). Also
the time of one blocking all-reduce of the whole gradient on 2 ranks, alone.
Every run is a fresh `mpiexec -n N` job (through npformer.distributed.launch) with OMP/OpenBLAS threads
and npformer.set_num_threads at 1.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from train_step import CONFIGS, make_batch  # noqa: E402


def worker(args):
    """One rank: time `steps` training steps after one warm-up step; rank 0 prints JSON."""
    import numpy as np

    import npformer
    import npformer.distributed as dist
    import npformer.functional as F
    from npformer import models, optim

    npformer.set_num_threads(1)
    group = dist.init()
    cfg = CONFIGS[args.config]
    npformer.manual_seed(0)
    model = models.Seq2SeqTransformer(cfg["vocab"], cfg["vocab"], d_model=cfg["d_model"], nhead=cfg["nhead"],
                                      num_encoder_layers=cfg["layers"], num_decoder_layers=cfg["layers"],
                                      dim_feedforward=cfg["d_ff"], dropout=0.1, max_len=max(cfg["seq"], 16))
    trained = model if args.no_ddp else dist.DistributedDataParallel(model)
    optimizer = optim.Adam(model.parameters(), lr=1e-4)
    src, tgt_in, tgt_out = make_batch(cfg, seed=group.rank)  # each rank its own data
    times, comm = [], []
    for step in range(args.steps + 1):
        group.barrier()
        before = dict(trained.timings) if not args.no_ddp else {"start": 0.0, "wait": 0.0}
        start = time.perf_counter()
        logits = trained(src, tgt_in)
        loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), tgt_out.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()
        if step:  # the first step warms up
            times.append(time.perf_counter() - start)
            after = trained.timings if not args.no_ddp else before
            comm.append(after["start"] - before["start"] + after["wait"] - before["wait"])
    allreduce = None
    if group.size > 1:  # one blocking all-reduce of the whole gradient, alone
        flat = np.ones(sum(p.size for p in model.parameters()), dtype=np.float32)
        samples = []
        for _ in range(5):
            group.barrier()
            start = time.perf_counter()
            group.sum_(flat)
            samples.append(time.perf_counter() - start)
        allreduce = statistics.median(samples)
    slowest = group.comm.allreduce(max(times), op=group.MPI.MAX) if group.size > 1 else max(times)
    if group.rank == 0:
        step = statistics.median(times)
        print(json.dumps({
            "ranks": group.size, "ddp": not args.no_ddp, "ms_per_step": 1e3 * step, "slowest_step_ms": 1e3 * slowest,
            "tokens_per_s": group.size * 2 * cfg["batch"] * cfg["seq"] / step,
            "comm_ms_per_step": 1e3 * statistics.median(comm), "buckets": 0 if args.no_ddp else len(trained.buckets),
            "parameters": int(sum(p.size for p in model.parameters())),
            "allreduce_alone_ms": None if allreduce is None else 1e3 * allreduce}))


def run(args, ranks, no_ddp=False):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "npformer.distributed.launch", "-n", str(ranks), __file__, "--worker",
           "--config", args.config, "--steps", str(args.steps)] + (["--no-ddp"] if no_ddp else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=CONFIGS, default="base")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-ddp", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print(f"config {args.config} {CONFIGS[args.config]}, {args.steps} timed steps, 1 thread per rank, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    baseline = run(args, 1, no_ddp=True)
    print(f"1 process, no DDP: {baseline['ms_per_step']:8.1f} ms/step  {baseline['tokens_per_s']:8.0f} tokens/s  "
          f"({baseline['parameters']:,} parameters)")
    for ranks in args.ranks:
        r = run(args, ranks)
        efficiency = r["tokens_per_s"] / (ranks * baseline["tokens_per_s"])
        alone = f", one all-reduce of the whole gradient alone {r['allreduce_alone_ms']:.1f} ms" \
            if r["allreduce_alone_ms"] is not None else ""
        print(f"{ranks} rank{'s' if ranks > 1 else ' '} with DDP: {r['ms_per_step']:8.1f} ms/step  "
              f"{r['tokens_per_s']:8.0f} tokens/s  all-reduce {r['comm_ms_per_step']:6.1f} ms/step "
              f"({r['buckets']} buckets){alone}; scaling efficiency {efficiency:.1%}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
