"""Versions of chapter 10's SSD kernels timed side by side on one GPU, before one of them goes into the
notebook (the notebook is the source of scan_lib; this script only measures).

    python benchmarks/probe_ssd_variants.py NAME=PATH [NAME=PATH ...] [--quick]

Each PATH is a copy of scan_lib/ssd.py as some branch generates it (`git show BRANCH:scan_lib/ssd.py >
PATH`); the first is the baseline. Every version runs its own launchers on checked inputs,
`_forward_kernels` and `_backward_kernels`, with every option of a Mamba-2 layer (D, z, dt_bias, softplus;
bench.py's `ssd_inputs`, chunk_size 256). Per shape and dtype it prints, per version: the largest difference
of y and of each gradient from the baseline's, relative to the baseline's largest value (bench.py's rel_err),
the forward's and the backward's GPU time (CUDA-graph replay: no host work) and the forward+backward call
(do_bench, host included).
"""
import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from scan_lib.runtime import graph_us

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import SIZES, rel_err, ssd_inputs  # noqa: E402

GRADIENTS = ("dx", "ddt", "dA", "dB", "dC", "dD", "dh0", "dz", "ddt_bias")


def load_version(name, path):
    """The module at path, imported under a name of its own (its custom ops get a namespace of their own)."""
    spec = importlib.util.spec_from_file_location(f"ssd_version_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def calls(module, inputs, dy, chunk):
    """(forward, backward): the version's two launchers on these inputs, every option on."""
    x, dt, A, B, C, D, z, dt_bias = inputs
    forward = lambda: module._forward_kernels(x, dt, A, B, C, chunk, D, None, z, dt_bias, True)  # noqa: E731
    backward = lambda: module._backward_kernels(x, dt, A, B, C, chunk, dy, None, D, None, z, dt_bias, True)  # noqa: E731
    return forward, backward


def results(forward, backward):
    """y and the named gradients of one version, as float tensors (None where absent)."""
    y = forward()[0]
    return {"y": y, **dict(zip(GRADIENTS, backward()))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="+", help="NAME=PATH, the baseline first")
    parser.add_argument("--quick", action="store_true", help="the two short shapes only")
    parser.add_argument("--matmul-precision", default="highest", choices=["highest", "high"],
                        help="torch.set_float32_matmul_precision for the run: versions that follow it take one TF32 "
                        "product per float32 tl.dot under high (their differences from the first then include TF32's)")
    options = parser.parse_args()
    torch.set_float32_matmul_precision(options.matmul_precision)
    versions = [(name, load_version(name, path)) for name, path in (v.split("=", 1) for v in options.versions)]
    chunk = SIZES["ssd_chunk"]
    shapes = SIZES["ssd"] + ([] if options.quick else SIZES["ssd_more"])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; chunk_size {chunk}; D, z, dt_bias, softplus; "
          f"float32 matmul precision {options.matmul_precision}")
    for shape in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            inputs = ssd_inputs(*shape, dtype)
            dy = torch.randn_like(inputs[0])
            print(f"\n(batch, L, heads, P, N) = {shape}, {dtype}")
            print(f"  {'version':12s} {'fwd GPU us':>10s} {'bwd GPU us':>10s} {'fwd+bwd call us':>15s}  largest diff from the first")
            baseline = None
            for name, module in versions:
                forward, backward = calls(module, inputs, dy, chunk)
                got = results(forward, backward)
                baseline = baseline or got
                worst = max((rel_err([got[k]], [baseline[k]]), k) for k in got if got[k] is not None)
                fwd_us, bwd_us = graph_us(forward), graph_us(backward)
                both_us = do_bench(lambda: (forward(), backward()), return_mode="median") * 1e3
                print(f"  {name:12s} {fwd_us:10.1f} {bwd_us:10.1f} {both_us:15.1f}  {worst[0]:.1e} ({worst[1]})",
                      flush=True)
                del got
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
