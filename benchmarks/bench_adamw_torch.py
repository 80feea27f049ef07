#!/usr/bin/env python3
"""benchmarks/bench_adamw_torch.py - libfsdp's CPU AdamW step beside
torch.optim.AdamW(fused=True): same sizes, threads and hyperparameters, in one
run, alternating step by step so that both see the same machine (a shared
machine's load drifts over seconds). libfsdp's step runs in a bench_optimizer
--serve process that waits on its stdin while torch runs, so the two never
overlap; a pause before each step lets the other side's threads go idle. The
memory-bandwidth roof (bench_optimizer's loop with the same 28 bytes/element)
is timed after each pair. Prints one JSON object per round and a summary per
(numel, threads) with libfsdp/torch elements/s ratios.

    bench_adamw_torch.py [--bench build/default/benchmarks/bench_optimizer]
                         [--log2-sizes 24,26] [--threads 1,2] [--rounds 5] [--reps 5]

Exits 0 with a message when torch is not importable.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01  # as bench_optimizer.cpp
BYTES_PER_ELEMENT = 28  # read p, g, m, v; write p, m, v
PAUSE_S = 0.05  # longer than an OpenMP worker spins after torch's parallel region


class Libfsdp:
    """A bench_optimizer --serve process holding the arrays of one (numel, threads)."""

    def __init__(self, bench, n, threads):
        self.proc = subprocess.Popen(
            [bench, "--serve", str(n), str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("bench_optimizer --serve did not start")

    def run(self, cmd):
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait()


def torch_step(opt):
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def summary(times):
    return min(times), statistics.median(times)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default=os.path.join(here, "..", "build", "default", "benchmarks", "bench_optimizer"))
    ap.add_argument("--log2-sizes", default="24,26")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="step pairs per round")
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"bench_adamw_torch: skipped, torch is not importable ({e})")
        return 0
    if not os.access(args.bench, os.X_OK):
        print(f"bench_adamw_torch: {args.bench} is not built; build the bench_optimizer target", file=sys.stderr)
        return 1

    for log2n in (int(s) for s in args.log2_sizes.split(",")):
        n = 1 << log2n
        for threads in (int(s) for s in args.threads.split(",")):
            torch.set_num_threads(threads)
            # The same initial values as bench_optimizer (they do not change the traffic).
            ramp = 1e-7 * (torch.arange(n, dtype=torch.float32) % 1000)
            param = torch.nn.Parameter(0.5 + ramp)
            param.grad = 0.01 + ramp
            del ramp
            opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
            ours = Libfsdp(args.bench, n, threads)
            ours.run("adam")  # warm-up: page faults, thread start
            ours.run("roof")
            torch_step(opt)
            all_ours, all_torch, all_roof, pair_ratios = [], [], [], []
            for r in range(args.rounds):
                t_ours, t_torch = [], []
                for k in range(args.reps):
                    # Alternate which side goes first, so neither always follows the other.
                    for side in ("ours", "torch") if (r * args.reps + k) % 2 == 0 else ("torch", "ours"):
                        time.sleep(PAUSE_S)
                        if side == "ours":
                            t_ours.append(ours.run("adam"))
                        else:
                            t_torch.append(torch_step(opt))
                    pair_ratios.append(t_torch[-1] / t_ours[-1])
                    time.sleep(PAUSE_S)
                    all_roof.append(ours.run("roof"))
                ob, om = summary(t_ours)
                tb, tm = summary(t_torch)
                print(
                    json.dumps(
                        {
                            "benchmark": "adamw_vs_torch_round",
                            "round": r,
                            "numel": n,
                            "threads": threads,
                            "libfsdp_elements_per_s": n / ob,
                            "torch_elements_per_s": n / tb,
                            "ratio": tb / ob,
                            "median_ratio": tm / om,
                            "roof_gb_per_s": BYTES_PER_ELEMENT * n / min(all_roof[-args.reps :]) / 1e9,
                        }
                    ),
                    flush=True,
                )
                all_ours += t_ours
                all_torch += t_torch
            ours.close()
            del opt, param

            ob, om = summary(all_ours)
            tb, tm = summary(all_torch)
            roof_gbs = BYTES_PER_ELEMENT * n / min(all_roof) / 1e9
            print(
                json.dumps(
                    {
                        "benchmark": "adamw_vs_torch",
                        "numel": n,
                        "threads": threads,
                        "pairs": len(pair_ratios),
                        "torch_version": torch.__version__,
                        "libfsdp_elements_per_s": n / ob,
                        "torch_elements_per_s": n / tb,
                        "ratio_best": tb / ob,
                        "ratio_median": tm / om,
                        "pair_ratio_median": statistics.median(pair_ratios),
                        "pairs_won": sum(x >= 1.0 for x in pair_ratios),
                        "roof_gb_per_s": roof_gbs,
                        "libfsdp_fraction_of_roof": BYTES_PER_ELEMENT * n / ob / 1e9 / roof_gbs,
                        "torch_fraction_of_roof": BYTES_PER_ELEMENT * n / tb / 1e9 / roof_gbs,
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
