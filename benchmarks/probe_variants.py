"""Launch parameters of chapter 07's selective-scan kernels timed side by side on one GPU, before any
of them goes into the notebook's GPU_CONFIG (the notebooks are the source of scan_lib; this script
only measures).

    python benchmarks/probe_variants.py [--quick]    # VARIANTS against the GPU_CONFIG in force
    python benchmarks/probe_variants.py --peer       # mamba_ssm's selective_scan_fn on the same inputs
    python benchmarks/probe_variants.py --forward    # the forward's chunk x states per step, per dtype
    ncu ... --profile-from-start off python benchmarks/probe_variants.py --ncu   # one backward per shape

A variant changes scan_lib.fast_selective_scan.GPU_CONFIG for as long as it runs (plans follow the
config: plan_context). For every shape (bench.py's selective-scan inputs: the block's layout, every
option, softplus) it checks the variant's gradients against GPU_CONFIG's on the same inputs, then
prints the forward's and the backward's GPU time (CUDA-graph replay of the ops, no host work) and the
training step's time through the public call (do_bench, host included).
"""
import argparse
import contextlib
import sys
from pathlib import Path

import torch

import scan_lib.fast_selective_scan as fast
from scan_lib.runtime import graph_us, median_us

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import mamba_ssm_scan, rel_err, selective_inputs  # noqa: E402

# The next session's candidates (name, forward config changes, backward config changes): the forward's
# states per step forced against states_per_step's table, and the backward with two warps per program
# (64 runs per chunk: the runs' scan crosses the warps through shared memory) where the programs are few.
VARIANTS = [
    ("GPU_CONFIG", {}, {}),
    ("fwd 2 states", dict(unroll=2), {}),
    ("fwd 1 state", dict(unroll=1), {}),
    ("bwd 2 warps, chunk 256", {}, dict(chunk=256, num_warps=2)),
    ("bwd 2 warps, chunk 256, 1 channel", {}, dict(block_d=1, chunk=256, num_warps=2)),
    ("bwd chunk 256", {}, dict(chunk=256)),
    ("bwd 1 channel (fp32 at batch 1)", {}, dict(block_d=1)),
]


@contextlib.contextmanager
def configured(fwd, bwd):
    """GPU_CONFIG with the forward's and the backward's entries updated, restored afterwards."""
    saved = {kind: dict(config) for kind, config in fast.GPU_CONFIG.items()}
    fast.GPU_CONFIG["fwd"] = {**saved["fwd"], **fwd}
    fast.GPU_CONFIG["bwd"] = {**saved["bwd"], **bwd}
    try:
        yield
    finally:
        fast.GPU_CONFIG.update(saved)


def ops(inputs):
    """(forward, backward): the two ops as training calls them, on inputs run once (compiled, warm)."""
    u, delta, A, B, C, D, z, delta_bias = inputs
    B4, C4 = fast.positions_adjacent(B.unsqueeze(1)), fast.positions_adjacent(C.unsqueeze(1))
    chunk = fast.backward_chunk(u, B4, C4)
    args = (u, delta, A, B4, C4, D, z, delta_bias)
    states = fast.strided_fwd(*args, None, True, chunk, 1)[2]
    dout = torch.randn_like(u)
    fast.strided_bwd(*args, states, dout, None, True, chunk, 1)
    torch.cuda.synchronize()
    return (lambda: fast.strided_fwd(*args, None, True, chunk, 1),
            lambda: fast.strided_bwd(*args, states, dout, None, True, chunk, 1))


def op_times(inputs):
    """(forward us, backward us): the ops alone, replayed from a CUDA graph, as training runs them."""
    forward, backward = ops(inputs)
    return graph_us(forward), graph_us(backward)


def step(leaves, grad):
    diff = [t for t in leaves if t is not None]
    return lambda: torch.autograd.grad(fast.selective_scan(*leaves, delta_softplus=True), diff, grad)


def time_peer(shapes):
    peer, reason = mamba_ssm_scan()
    if peer is None:
        print(f"skipped mamba_ssm: {reason}")
        return
    for shape, dtype in shapes:
        inputs = selective_inputs(*shape, dtype, True)
        leaves = [t.detach().requires_grad_() if t is not None else None for t in inputs]
        grad = torch.randn_like(inputs[0])
        diff = [t for t in leaves if t is not None]
        with torch.no_grad():
            fwd_us = graph_us(lambda: peer(*inputs, delta_softplus=True))
        step_us = median_us(lambda: torch.autograd.grad(peer(*leaves, delta_softplus=True), diff, grad))
        print(f"{str(shape):22s} {str(dtype)[6:]:8s} {'mamba_ssm':26s} fwd {fwd_us:8.1f} bwd {'':8s} "
              f"step {step_us:8.1f}", flush=True)


FORWARD_GRID = [dict(block_d=1, chunk=chunk, num_warps=1, unroll=unroll)
                for chunk in (256, 512, 1024) for unroll in (1, 2, 4, 16)]


def forward_grid(shapes):
    """The forward alone (CUDA-graph replay) over FORWARD_GRID: without gradients (save_chunk 0) and as
    training runs it (saving the backward's chunks), each next to what the config in force picks; and
    chapter 07 section 9's sweep case (fp32, no D, z or delta_bias, no softplus)."""
    print(f"{torch.cuda.get_device_name()}: forward op us, CUDA-graph replay; columns chunk/states per step")
    print(f"{'(batch, dim, L, N)':22s} {'dtype':8s} {'mode':9s} {'in force':>9s} "
          + " ".join(f"{c['chunk']:>4d}/{c['unroll']:<3d}" for c in FORWARD_GRID))
    cases = [(shape, dtype, True) for shape, dtype in shapes] + [((8, 1024, 2048, 16), torch.float32, False)]
    for shape, dtype, full in cases:
        u, delta, A, B, C, D, z, delta_bias = selective_inputs(*shape, dtype, full)
        if not full:
            delta = torch.nn.functional.softplus(delta)
        B4, C4 = fast.positions_adjacent(B.unsqueeze(1)), fast.positions_adjacent(C.unsqueeze(1))
        args = (u, delta, A, B4, C4, D, z, delta_bias, None, full)
        for mode, save in (("no grad", 0), ("training", fast.backward_chunk(u, B4, C4))):
            row = [graph_us(lambda: fast.strided_fwd(*args, save, 1))]
            for config in FORWARD_GRID:
                with configured(config, {}):
                    row.append(graph_us(lambda: fast.strided_fwd(*args, save, 1)))
            print(f"{str(shape):22s} {str(dtype)[6:]:8s} {mode + ('' if full else '*'):9s} "
                  + " ".join(f"{us:8.1f}" for us in row), flush=True)
            torch.cuda.empty_cache()
    print("* chapter 07 section 9's case: no D, z or delta_bias, steps already positive")


def profile_once(shapes):
    """One backward per shape between cudaProfilerStart and Stop, after a warm-up outside."""
    for shape, dtype in shapes:
        _, backward = ops(selective_inputs(*shape, dtype, True))
        torch.cuda.profiler.start()
        backward()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"profiled the backward at {shape} {dtype}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two shapes only")
    parser.add_argument("--peer", action="store_true", help="time mamba_ssm's selective_scan_fn instead (step, and its "
                        "forward replayed from a CUDA graph)")
    parser.add_argument("--ncu", action="store_true", help="run the backward op once "
                        "inside cudaProfilerStart/Stop, for ncu --profile-from-start off")
    parser.add_argument("--forward", action="store_true", help="time the forward over FORWARD_GRID instead")
    options = parser.parse_args()
    shapes = [((1, 1536, 65536, 16), torch.bfloat16), ((8, 1024, 2048, 16), torch.bfloat16)]
    if not options.quick:
        shapes += [((2, 1536, 8192, 16), torch.bfloat16), ((1, 1536, 8192, 16), torch.bfloat16),
                   ((4, 1536, 8192, 16), torch.bfloat16), ((1, 1536, 65536, 16), torch.float32),
                   ((8, 1024, 2048, 16), torch.float32), ((8, 1024, 512, 16), torch.bfloat16),
                   ((8, 1024, 2048, 4), torch.bfloat16), ((8, 1024, 2048, 64), torch.bfloat16)]
    if options.peer:
        time_peer(shapes)
        return
    if options.forward:
        forward_grid(shapes[:-2])
        return
    if options.ncu:
        profile_once(shapes[:2])
        return
    print(f"{torch.cuda.get_device_name()}, every option, softplus; us (fwd, bwd: CUDA-graph replay of the ops; "
          f"step: do_bench of forward+backward through selective_scan)")
    for shape, dtype in shapes:
        inputs = selective_inputs(*shape, dtype, True)
        leaves = [t.detach().requires_grad_() if t is not None else None for t in inputs]
        grad = torch.randn_like(inputs[0])
        want = step(leaves, grad)()
        for name, fwd, bwd in VARIANTS:
            with configured(fwd, bwd):
                err = rel_err(step(leaves, grad)(), want)
                fwd_us, bwd_us = op_times(inputs)
                step_us = median_us(step(leaves, grad))
            print(f"{str(shape):22s} {str(dtype)[6:]:8s} {name:34s} fwd {fwd_us:8.1f} bwd {bwd_us:8.1f} "
                  f"step {step_us:8.1f}  grads vs GPU_CONFIG {err:.1e}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
