"""scan_lib.cumsum along a dim other than the last: the column scan (x read in place) against the copy path
and torch.cumsum, with the column scan's tile swept, on a GPU. One line per (shape, dim, dtype): the worst
error against a float64 torch.cumsum, scaled by cumsum(|x|) (bench_cumsum.scaled_error), takes_columns'
choice, do_bench medians in us of cumsum (what a user calls), scan_copied (the copy path), torch.cumsum and
scan_columns at tiles of 1024 to 16384 values (where x views as columns), and the memory floor (read x,
write y) at the copy bandwidth runtime.copy_bandwidth measures; then one forward+backward. (The committed
run of 2026-12-06 printed its floors at a fixed 4 TB/s, an H200's rate, not its H100's, and scaled each
error by the largest cumsum(|x|) rather than its own: results/README.md says so.) Sets COLUMN_TILE and
MIN_COLUMNS in notebooks/01_cumsum.py.

    python benchmarks/bench_cumsum_columns.py         (GPU only, about 30 s)
"""
import sys

import torch

import scan_lib  # noqa: I001  (before triton, as everywhere)
from triton.testing import do_bench

from bench_cumsum import scaled_error   # benchmarks/bench_cumsum.py's
from scan_lib.runtime import copy_bandwidth

cs = sys.modules["scan_lib.cumsum"]  # the module: scan_lib.cumsum is the function
TILES = (1024, 2048, 4096, 8192, 16384)


def columns(x, dim, tile):
    """scan_columns on x viewed as (outer, length, inner), or None where it does not view so."""
    view = cs.as_columns(x, dim)
    return None if view is None else cs.scan_columns(view, tile=tile)


def print_line(name, x, dim, bandwidth):
    """One printed line for x along dim; an exception is printed, not raised, so that the rest still runs."""
    try:
        print(measure(name, x, dim, bandwidth), flush=True)
    except Exception as error:
        print(f"FAILED {name}: {type(error).__name__} {str(error)[:300]}", flush=True)


def measure(name, x, dim, bandwidth) -> str:
    """The line for x along dim; bandwidth: bytes per second, read plus write (copy_bandwidth)."""
    error = scaled_error(scan_lib.cumsum(x, dim), x, dim)
    outer, length, inner = cs.column_shape(x.shape, dim)
    ms = dict(cumsum=do_bench(lambda: scan_lib.cumsum(x, dim)), copied=do_bench(lambda: cs.scan_copied(x, dim)),
              torch=do_bench(lambda: torch.cumsum(x, dim)))
    if cs.as_columns(x, dim) is not None and inner > 1:
        for tile in TILES:
            ms[f"col{tile}"] = do_bench(lambda: columns(x, dim, tile))
    floor_us = 2 * x.numel() * x.element_size() / bandwidth * 1e6   # read x, write y
    return (f"{name:40s} {x.dtype} takes_columns={cs.takes_columns(outer, length, inner)} err {error:.1e}  "
            + "  ".join(f"{key} {value * 1e3:.1f}" for key, value in ms.items()) + f"  floor~{floor_us:.1f} us")


def main():
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    def line(name, x, dim):
        print_line(name, x, dim, bandwidth)
    square = randn(4096, 4096)
    line("(4096,4096) dim0", square, 0)
    line("(4096,4096).T dim0", square.t(), 0)
    line("(4096,4096) dim1", square, 1)
    for dtype in (torch.float16, torch.bfloat16):
        line("(4096,4096) dim0", randn(4096, 4096, dtype=dtype), 0)
    line("(64,256,256).permute(2,1,0) dim1", randn(64, 256, 256).permute(2, 1, 0), 1)
    for outer, inner in ((2**22, 1), (2**20, 4), (2**18, 16)):   # short columns: programs of few values
        line(f"({outer},16,{inner}) dim1", randn(outer, 16, inner), 1)
    line("(1,65536,4096) dim1", randn(1, 2**16, 4096), 1)
    line("(1,2^20,64) dim1", randn(1, 2**20, 64), 1)                # few columns, long: the copy path
    line("(2^22,4) dim0", randn(2**22, 4), 0)
    line("(4,2^22).T dim0", randn(4, 2**22).t(), 0)
    line("(2^12,4) dim0", randn(2**12, 4), 0)
    line("(2^16,64) dim0", randn(2**16, 64), 0)
    line("(64,4096,64) dim1", randn(64, 4096, 64), 1)
    x = randn(64, 4096, 64).requires_grad_()
    grad = torch.randn_like(x)
    ours = do_bench(lambda: torch.autograd.grad(scan_lib.cumsum(x, 1), x, grad))
    theirs = do_bench(lambda: torch.autograd.grad(torch.cumsum(x, 1), x, grad))
    print(f"backward (64,4096,64) dim1: fwd+bwd {ours * 1e3:.1f} us, torch {theirs * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
