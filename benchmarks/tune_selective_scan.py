"""Sweep selective_scan's GPU launch parameters at the course's benchmark shape; print a table.

    python benchmarks/tune_selective_scan.py            (GPU only)

Shape: batch 8, dim 1024, L 2048, N 16, fp32 inputs, D, z, delta_bias and softplus on (as in a Mamba block).
Times are do_bench medians in microseconds; the winning configs belong in notebooks/05_mamba.py.
"""
import itertools
import sys

import torch
import triton
from triton.testing import do_bench

import scan_lib

ss = sys.modules["scan_lib.selective_scan"]  # the module: scan_lib.selective_scan is the function


def inputs(batch=8, dim=1024, L=2048, N=16, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, dt=dtype: torch.randn(*s, device="cuda", generator=g).to(dt)  # noqa: E731
    u, delta, z = r(batch, dim, L), 0.5 * r(batch, dim, L), r(batch, dim, L)
    A = -torch.rand(dim, N, device="cuda", generator=g) - 0.5
    B, C = r(batch, N, L), r(batch, N, L)
    D, bias = r(dim, dt=torch.float32), r(dim, dt=torch.float32)
    return u, delta, A, B, C, D, z, bias


def time_fwd(args):
    return 1e3 * do_bench(lambda: ss.selective_scan(*args[:7], delta_bias=args[7], delta_softplus=True),
                          return_mode="median", warmup=5, rep=40)


def time_fwd_bwd(args):
    leaves = [a.detach().clone().requires_grad_(True) for a in args]
    out = ss.selective_scan(*leaves[:7], delta_bias=leaves[7], delta_softplus=True)
    grad = torch.randn_like(out)

    def step():
        o = ss.selective_scan(*leaves[:7], delta_bias=leaves[7], delta_softplus=True)
        torch.autograd.grad(o, leaves, grad)
    return 1e3 * do_bench(step, return_mode="median", warmup=5, rep=40)


def sweep(name, table, timer, args):
    results = []
    for block_d, chunk, warps in itertools.product((2, 4, 8, 16), (16, 32, 64), (4, 8)):
        table.update(block_d=block_d, chunk=chunk, num_warps=warps)
        try:
            t = timer(args)
        except Exception as e:  # e.g. out of shared memory / registers for large tiles
            print(f"{name} block_d={block_d:2d} chunk={chunk:3d} warps={warps}: failed ({type(e).__name__})")
            continue
        results.append((t, block_d, chunk, warps))
        print(f"{name} block_d={block_d:2d} chunk={chunk:3d} warps={warps}: {t:8.1f} us", flush=True)
    best = min(results)
    table.update(block_d=best[1], chunk=best[2], num_warps=best[3])
    print(f"BEST {name}: {best[0]:.1f} us with block_d={best[1]} chunk={best[2]} num_warps={best[3]}")
    return best


if __name__ == "__main__":
    assert scan_lib.runtime.ON_GPU, "needs a GPU"
    print(scan_lib.runtime.describe())
    args = inputs()
    sweep("fwd", ss.GPU_FWD_CONFIG, time_fwd, args)
    sweep("fwd+bwd", ss.GPU_BWD_CONFIG, time_fwd_bwd, args)
    bf16 = inputs(dtype=torch.bfloat16)
    print(f"bf16 inputs with the best configs: fwd {time_fwd(bf16):.1f} us, fwd+bwd {time_fwd_bwd(bf16):.1f} us")
