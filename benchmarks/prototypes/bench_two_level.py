"""On a GPU: chapter 07's backward kernel against the two-level prototype, same inputs, same saved
states' chunk where they agree. Prints the GPU, shapes, dtypes, each kernel launcher's do_bench
median and the largest relative difference of the gradients (per-step B and C, no options).

    python benchmarks/prototypes/bench_two_level.py
"""
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from two_level_bwd import two_level_bwd  # noqa: E402

import scan_lib.fast_selective_scan as fast  # noqa: E402

SHAPES = [(8, 1024, 2048, 16), (8, 1024, 512, 16), (1, 1536, 8192, 16), (8, 1024, 2048, 4), (8, 1024, 2048, 64)]


def inputs(batch, dim, length, n_states, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    u = torch.randn(batch, dim, length, device="cuda", generator=g).to(dtype)
    delta = (0.05 + 0.5 * torch.rand(batch, dim, length, device="cuda", generator=g)).to(dtype)
    A = -(0.5 + torch.rand(dim, n_states, device="cuda", generator=g))
    B = torch.randn(batch, 1, n_states, length, device="cuda", generator=g).to(dtype)
    C = torch.randn(batch, 1, n_states, length, device="cuda", generator=g).to(dtype)
    dout = torch.randn(batch, dim, length, device="cuda", generator=g).to(dtype)
    return u, delta, A, B, C, dout


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"chapter 07's GPU_CONFIG['bwd'] = {fast.GPU_CONFIG['bwd']}")
    print(f"{'(batch, dim, L, N)':>22} {'dtype':>9} {'ch07 us':>9} {'two-level (chunk, items, block_d)':>36} {'us':>8} "
          f"{'ch07/two':>8} {'max rel diff':>12}")
    for shape in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            u, delta, A, B, C, dout = inputs(*shape, dtype)
            args = (u, delta, A, B, C, None, None, None)
            chunk07 = fast.GPU_CONFIG["bwd"]["chunk"]
            states07 = fast.strided_fwd(*args, None, False, chunk07, 1)[2]
            want = fast.strided_bwd(*args, states07, dout, None, False, chunk07, 1)[:5]
            t07 = triton.testing.do_bench(lambda: fast.strided_bwd(*args, states07, dout, None, False, chunk07, 1))
            items = 16 // u.element_size()
            for chunk, block_d in ((32 * items, 2), (32 * items, 1), (64 * items, 2)):
                states = fast.strided_fwd(*args, None, False, chunk, 1)[2]
                got = two_level_bwd(u, delta, A, B, C, states, dout, chunk, block_d=block_d, items=items)
                diff = max(((x.double() - y.double()).abs().max() / y.double().abs().max()).item()
                           for x, y in zip(got, want))
                t = triton.testing.do_bench(lambda: two_level_bwd(u, delta, A, B, C, states, dout, chunk,
                                                                  block_d=block_d, items=items))
                print(f"{str(shape):>22} {str(dtype)[6:]:>9} {t07 * 1e3:9.0f} {str((chunk, items, block_d)):>36} "
                      f"{t * 1e3:8.0f} {t07 / t:8.2f} {diff:12.1e}", flush=True)


if __name__ == "__main__":
    main()
