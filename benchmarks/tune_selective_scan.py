"""Sweep selective_scan's GPU launch parameters at the course's benchmark shape; one line per measurement.

    python benchmarks/tune_selective_scan.py            (GPU only; about 150 s on an H200)

Shape: batch 8, dim 1024, L 2048, N 16, fp32 inputs, D, z, delta_bias and softplus on (as in a Mamba block).
Times are do_bench medians in microseconds. Steps:
  0. a correctness smoke test on this GPU: dA exactly zero at L=1 without an initial state;
  1. forward (no grad: no boundary states written): block_d x chunk x num_warps;
  2. forward+backward (the forward then runs with the backward's chunk): the backward's
     block_d x chunk x num_warps;
  3. bf16 inputs with the best configs.
The final BEST line holds the winning configs of this sweep; the defaults in notebooks/05_mamba.py are
chosen from it.

Recorded run: benchmarks/results/tune_selective_scan_h200.txt (NVIDIA H200).
Reference points on the same H200, 2026-11-29 (notebook 05, the benchmark of section 9): mamba_ssm fp32 593 us fwd,
1968 us fwd+bwd; bf16 304 / 1490 us; memory floor 64 us fwd, 175 us fwd+bwd (fp32).
"""
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repo root, for scan_lib

import torch  # noqa: E402

import scan_lib  # noqa: E402
from scan_lib.runtime import median_us  # noqa: E402

ss = sys.modules["scan_lib.selective_scan"]  # the module: scan_lib.selective_scan is the function
START = time.time()
BUDGET_S = 120  # stop sweeping (keep the best so far) once this much wall time has passed


def inputs(batch=8, dim=1024, L=2048, N=16, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, dt=dtype: torch.randn(*s, device="cuda", generator=g).to(dt)  # noqa: E731
    u, delta, z = r(batch, dim, L), 0.5 * r(batch, dim, L), r(batch, dim, L)
    A = -torch.rand(dim, N, device="cuda", generator=g) - 0.5
    B, C = r(batch, N, L), r(batch, N, L)
    D, bias = r(dim, dt=torch.float32), r(dim, dt=torch.float32)
    return u, delta, A, B, C, D, z, bias


def time_fwd(args):
    with torch.no_grad():
        return median_us(lambda: ss.selective_scan(*args[:7], delta_bias=args[7], delta_softplus=True),
                         warmup=5, rep=40)


def time_fwd_bwd(args):
    leaves = [a.detach().clone().requires_grad_(True) for a in args]
    grad = torch.randn_like(args[0])

    def step():
        o = ss.selective_scan(*leaves[:7], delta_bias=leaves[7], delta_softplus=True)
        torch.autograd.grad(o, leaves, grad)
    return median_us(step, warmup=5, rep=40)


def smoke_test():
    """dA at L=1 with no initial state is exactly zero (round 1 gave ~1e-9 from cancellation)."""
    u, delta, A, B, C, D, z, bias = inputs(batch=2, dim=64, L=1, N=16)
    A.requires_grad_(True)
    out = ss.selective_scan(u, delta, A, B, C, D, z, delta_bias=bias, delta_softplus=True)
    (dA,) = torch.autograd.grad(out.sum(), [A])
    print(f"smoke: L=1 dA max |dA| = {dA.abs().max().item():.1e} (must be 0)", flush=True)
    assert torch.equal(dA, torch.zeros_like(dA))


def sweep(name, table, timer, args, candidates):
    """Time each candidate (a dict of config changes) applied to `table`; keep the best in `table`."""
    base, results = dict(table), []
    for change in candidates:
        if time.time() - START > BUDGET_S:
            print(f"{name}: time budget reached, {len(results)} configs measured", flush=True)
            break
        table.clear()
        table.update({**base, **change})
        try:
            t = timer(args)
        except Exception as e:  # e.g. out of shared memory / registers for large tiles
            print(f"{name} {change}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            continue
        results.append((t, change))
        print(f"{name} {table}: {t:8.1f} us", flush=True)
    table.clear()
    table.update(base)
    if results:
        t, change = min(results, key=lambda r: r[0])
        table.update(change)
        print(f"best {name}: {t:.1f} us with {table}", flush=True)
        return t
    return float("nan")


FWD_CANDIDATES = ([dict(block_d=1, chunk=c, num_warps=w) for c in (256, 512, 1024, 2048) for w in (2, 4, 8)]
                  + [dict(block_d=2, chunk=c, num_warps=w) for c in (256, 512) for w in (2, 4)])
BWD_CANDIDATES = ([dict(block_d=1, chunk=c, num_warps=w) for c in (256, 512, 1024) for w in (2, 4, 8)]
                  + [dict(block_d=2, chunk=256, num_warps=4)])

if __name__ == "__main__":
    assert scan_lib.runtime.ON_GPU, "needs a GPU"
    print(scan_lib.runtime.describe(), torch.cuda.get_device_name(), flush=True)
    smoke_test()
    args = inputs()
    fwd, bwd = ss.GPU_FWD_CONFIG, ss.GPU_BWD_CONFIG
    t_fwd = sweep("fwd", fwd, time_fwd, args, FWD_CANDIDATES)
    t_both = sweep("fwd+bwd", bwd, time_fwd_bwd, args, BWD_CANDIDATES)
    bf16 = inputs(dtype=torch.bfloat16)
    t_fwd16, t_both16 = time_fwd(bf16), time_fwd_bwd(bf16)
    print(f"bf16 inputs with the best configs: fwd {t_fwd16:.1f} us, fwd+bwd {t_both16:.1f} us", flush=True)
    print(f"BEST fp32 fwd {t_fwd:.1f} us, fwd+bwd {t_both:.1f} us; bf16 fwd {t_fwd16:.1f} us, "
          f"fwd+bwd {t_both16:.1f} us; GPU_FWD_CONFIG = {fwd}; GPU_BWD_CONFIG = {bwd}; "
          f"total {time.time() - START:.0f} s")
