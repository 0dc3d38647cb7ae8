"""Check and time scan_lib.cumsum's two long-row algorithms on a GPU; print one line per measurement.

    python benchmarks/bench_cumsum.py            (GPU only, about a minute on an H200)

1. correctness: each algorithm against torch.cumsum in float64, many times on fresh random data at
   several sizes (the look-back scan's races, if any, would show up as sporadic wrong tiles or hangs;
   a watchdog ends the script if a look-back launch never finishes);
2. sweeps of block size, warps, window (look-back) and pass-3 order (reduce-then-scan) at 2^25 and
   2^27 float32 values, picking the best configuration of each algorithm;
3. sizes 2^10 .. 2^27 with the best configurations: torch.cumsum, reduce-then-scan, look-back, each as
   do_bench median (host + GPU, what a user waits for), CUDA-graph median (GPU only) and host time per
   call (launches queued back to back, timed on the CPU), next to the memory floor (2N words at the
   measured copy bandwidth).
Times are in microseconds. The last lines, BEST ..., give the values for CONFIG in notebooks/01_cumsum.py.
"""
import faulthandler
import math
import sys
import time

import torch

import scan_lib  # noqa: I001  (before triton, as everywhere)
import triton

from scan_lib.runtime import copy_bandwidth, graph_us, host_us, median_us

cs = sys.modules["scan_lib.cumsum"]  # the module: scan_lib.cumsum is the function
WATCHDOG_S = 150


def scaled_error(y: torch.Tensor, x: torch.Tensor, dim: int = -1) -> float:
    """max |y - reference| / cumsum(|x|) along dim, the notebook's error measure (elementwise, float64)."""
    reference = torch.cumsum(x.double(), dim=dim)
    scale = torch.cumsum(x.double().abs(), dim=dim).clamp_min(1e-30)
    return ((y.double() - reference).abs() / scale).max().item()


def check(algorithm: str, shape: tuple, repeats: int, dtype=torch.float32, **config) -> float:
    """Worst scaled error over `repeats` fresh random inputs; raises on any error above the tolerance."""
    # The notebook's scan_tolerance on a GPU: rounding to the output dtype plus 32 log2(L) float32 roundings.
    tolerance = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}[dtype] + 32 * 2.0**-24 * math.log2(shape[-1])
    worst = 0.0
    for seed in range(repeats):
        x = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).to(dtype)
        error = scaled_error(cs.scan_rows(x, algorithm=algorithm, **config), x)
        assert error <= tolerance, f"{algorithm} {shape} {config} seed {seed}: scaled error {error:.2e}"
        worst = max(worst, error)
    return worst


def check_all(algorithm: str, **config) -> None:
    cases = [((1, 1000), 20), ((1, 4097), 50), ((1, 2**16 + 3), 50), ((1, 2**20 + 1), 50),
             ((16, 2**20 + 5), 10), ((1, 2**22), 20), ((1, 2**25 + 7), 5), ((1, 2**27), 2)]
    for shape, repeats in cases:
        start = time.perf_counter()
        worst = check(algorithm, shape, repeats, **config)
        print(f"check {algorithm:16s} {str(shape):16s} x{repeats:<3d} worst scaled error {worst:.1e}  "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    worst = check(algorithm, (4, 2**21 + 1), 3, dtype=torch.bfloat16, **config)
    print(f"check {algorithm:16s} bf16 (4, 2**21+1) worst scaled error {worst:.1e}", flush=True)


def quick_us(fn) -> float:
    return median_us(fn, warmup=5, rep=40)


def sweep(algorithm: str, grid: list[dict], inputs: dict) -> dict:
    """Check each config of `grid` twice at 2^25, time it on each input; return the config with the
    smallest total time."""
    results = []
    for config in grid:
        try:
            check(algorithm, (1, 2**25), 2, **config)
            times = {name: quick_us(lambda: cs.scan_rows(x, algorithm=algorithm, **config))
                     for name, x in inputs.items()}
        except Exception as e:  # e.g. out of registers / shared memory for a large tile
            print(f"sweep {algorithm:16s} {config}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            continue
        results.append((sum(times.values()), config))
        print(f"sweep {algorithm:16s} {config}: " + "  ".join(f"{n} {t:7.1f}" for n, t in times.items()), flush=True)
    return min(results, key=lambda r: r[0])[1]


def main() -> None:
    assert scan_lib.runtime.ON_GPU, "needs a GPU"
    print(scan_lib.runtime.describe(), f"triton {triton.__version__}; CONFIG {cs.CONFIG}", flush=True)
    copy_gbs = copy_bandwidth() / 1e9
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)

    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)   # a look-back that never finishes ends the run
    for algorithm in ("reduce_then_scan", "lookback"):
        check_all(algorithm)
    faulthandler.cancel_dump_traceback_later()

    inputs = {"2^25": torch.randn(1, 2**25, device="cuda"), "2^27": torch.randn(1, 2**27, device="cuda")}
    print("floors: " + "  ".join(f"{n} {2 * x.numel() * 4 / copy_gbs / 1e3:.1f}" for n, x in inputs.items()))
    block_warps = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 8), (16384, 16)]
    best = {}
    rts = sweep("reduce_then_scan", [dict(block=b, num_warps=w, reverse=True) for b, w in block_warps], inputs)
    best["reduce_then_scan"] = sweep("reduce_then_scan", [rts, {**rts, "reverse": False}], inputs)
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    lookback = sweep("lookback", [dict(block=b, num_warps=w, window=32) for b, w in block_warps], inputs)
    best["lookback"] = sweep("lookback", [{**lookback, "window": w} for w in (8, 16, 32, 64)], inputs)
    faulthandler.cancel_dump_traceback_later()

    print(f"{'N':>10} {'floor':>7} {'torch':>7} {'torch-graph':>11} " + " ".join(
        f"{a + ' ' + m:>24}" for a in best for m in ("median", "graph", "host")))
    totals = {a: {} for a in best}
    for k in range(10, 28):
        x = torch.randn(1, 2**k, device="cuda")
        row = [2 * x.numel() * 4 / copy_gbs / 1e3, quick_us(lambda: torch.cumsum(x, 1)),
               graph_us(lambda: torch.cumsum(x, 1))]
        for algorithm, config in best.items():
            fn = lambda: cs.scan_rows(x, algorithm=algorithm, **config)  # noqa: E731
            totals[algorithm][k] = quick_us(fn)
            row += [totals[algorithm][k], graph_us(fn), host_us(fn)]
        print(f"{2**k:>10} {row[0]:>7.1f} {row[1]:>7.1f} {row[2]:>11.1f} " + " ".join(f"{t:>24.1f}" for t in row[3:]),
              flush=True)
    batched = torch.randn(64, 2**19, device="cuda")
    print("batched 64 x 2^19: torch %.1f, " % quick_us(lambda: torch.cumsum(batched, 1)) + ", ".join(
        f"{a} {quick_us(lambda: cs.scan_rows(batched, algorithm=a, **c)):.1f}" for a, c in best.items()))
    for algorithm, config in best.items():
        print(f"BEST {algorithm}: {config}; 2^25 {totals[algorithm][25]:.1f} us, 2^27 {totals[algorithm][27]:.1f} us")
    winner = min(best, key=lambda a: totals[a][25] + totals[a][27])
    print("BEST CONFIG", {"algorithm": winner, **best[winner]})


if __name__ == "__main__":
    main()
