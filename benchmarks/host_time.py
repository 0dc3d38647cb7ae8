"""Host time per call of each public op, on empty inputs, beside torch's own op for the same empty
input: nothing reaches a kernel, so what is timed is the Python path an empty call takes (the input
checks, then the custom operator and autograd's wrapping where the op keeps them for empties, or the
op's own empty result). Runs on any machine (without a GPU too: empty inputs never reach Triton's
interpreter). Issue 21's target: at most 30 us per call. A non-empty call's host time, the one that
decides small batches on a GPU, is the GPU benchmarks' (bench.py's call_us against its kernels).

    python benchmarks/host_time.py            # prints the table; --calls N for more calls per sample
    python benchmarks/host_time.py --save after.json --before before.json   # keep a run, compare with one

On a shared machine the wall time per call swings with the load of other jobs (2x between runs was
seen on 2 CPU cores). So --clock cpu (the default without a GPU) times this thread's CPU time, which
another job's load changes far less, and every run also times `torch.empty(0)`, the yardstick: the
cost of one tensor op in the same run. The comparison with --before prints both runs' numbers and
their ratio; where the yardsticks differ much the machine differed, and the ratio to the yardstick
is the fairer comparison.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import scan_lib  # first: without a GPU it switches Triton to its interpreter
from scan_lib.runtime import DEVICE, host_us


def empty_calls(requires_grad: bool):
    """name -> (scan_lib's call, torch's call for the same empty input, or None)."""
    def t(*shape):
        return torch.empty(shape, device=DEVICE, requires_grad=requires_grad)
    x2, g2 = t(4, 0), t(4, 0)
    u, A, B = t(2, 4, 0), torch.randn(4, 3, device=DEVICE, requires_grad=requires_grad), t(2, 3, 0)
    weight = torch.randn(4, 4, device=DEVICE, requires_grad=requires_grad)
    no_batch, q = t(0, 4, 5), t(1, 2, 0, 32)
    ms_a, ms_x = t(2, 3, 0), t(2, 0)
    block = scan_lib.Mamba(16, device=DEVICE, backend="triton")   # on a CPU too: an empty batch never reaches a kernel
    hidden = t(0, 5, 16)
    ssd_x, ssd_dt, ssd_B = t(2, 0, 3, 4), t(2, 0, 3), t(2, 0, 1, 5)
    ssd_A = torch.randn(3, device=DEVICE, requires_grad=requires_grad)
    conv_state, step_x = t(0, 4, 3), t(0, 4)
    ssm_state, ssm_A, ssm_B = t(0, 4, 5), torch.randn(4, 5, device=DEVICE, requires_grad=requires_grad), t(0, 5)
    return {
        "cumsum": (lambda: scan_lib.cumsum(x2), lambda: torch.cumsum(x2, -1)),
        "linear_scan": (lambda: scan_lib.linear_scan(g2, x2), None),
        "multistate_scan": (lambda: scan_lib.multistate_scan(ms_a, ms_a, ms_a, ms_x), None),
        "selective_scan": (lambda: scan_lib.selective_scan(u, u, A, B, B), None),
        "causal_conv1d": (lambda: scan_lib.causal_conv1d(no_batch, weight, activation="silu"),   # F.conv1d refuses L = 0
                          lambda: F.silu(F.conv1d(no_batch, weight.unsqueeze(1), padding=3, groups=4)[..., :5])),
        "flash_attention": (lambda: scan_lib.flash_attention(q, q, q, causal=True),
                            lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)),
        "mamba_chunk_scan_combined": (lambda: scan_lib.mamba_chunk_scan_combined(ssd_x, ssd_dt, ssd_A, ssd_B, ssd_B, 16),
                                      None),
        "causal_conv1d_update": (lambda: scan_lib.causal_conv1d_update(step_x, conv_state, weight), None),
        "selective_state_update": (lambda: _no_grad(scan_lib.selective_state_update, ssm_state, step_x, step_x, ssm_A,
                                                    ssm_B, ssm_B), None),
        "Mamba (batch 0)": (lambda: block(hidden), None),
    }


def _no_grad(op, *args):
    """op(*args) under torch.no_grad(): generation's step ops have no autograd, and refuse inputs that need grad
    outside it."""
    with torch.no_grad():
        return op(*args)


def median_host_us(fn, calls: int, samples: int = 7, clock: str = "wall") -> float:
    """Median over samples of the mean host time of `calls` calls, after a warm-up: wall time
    (scan_lib.runtime.host_us) or, with clock="cpu", this thread's CPU time (see the module's docstring)."""
    for _ in range(10):
        fn()
    timer = host_us if clock == "wall" else cpu_us
    return statistics.median(timer(fn, calls) for _ in range(samples))


def cpu_us(fn, calls: int) -> float:
    """This thread's CPU time per call of fn(), in microseconds (no GPU synchronisation: for CPU runs)."""
    start = time.thread_time_ns()
    for _ in range(calls):
        fn()
    return (time.thread_time_ns() - start) / calls / 1e3


def table(calls: int, clock: str) -> dict:
    """{row name: [scan_lib us, torch us or None, scan_lib us with inputs needing grad]} (None where
    the op raises), plus the yardstick row "torch.empty(0)"."""
    rows = {"torch.empty(0)": [median_host_us(lambda: torch.empty(0, device=DEVICE), calls, clock=clock), None, None]}
    plain, grad = empty_calls(False), empty_calls(True)
    for name, (ours, theirs) in plain.items():
        torch_us = median_host_us(theirs, calls, clock=clock) if theirs else None
        try:
            rows[name] = [median_host_us(ours, calls, clock=clock), torch_us, median_host_us(grad[name][0], calls, clock=clock)]
        except (ValueError, RuntimeError) as error:   # an op that refuses empty inputs: say so, time the rest
            rows[name] = [None, torch_us, None]
            print(f"{name}: raises {type(error).__name__}: {error}")
    return rows


def _cell(value, width: int) -> str:
    return f"{value:{width}.1f}" if value is not None else f"{'-':>{width}s}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--save", help="write this run's table as JSON")
    parser.add_argument("--before", help="a table written by --save: print it beside this run, with the ratios before / now")
    args = parser.parse_args()
    print(f"{scan_lib.runtime.describe()}; host us per call on empty inputs, {args.clock} time "
          f"(median of 7 samples of {args.calls}); issue 21's target: 30 us")
    rows = table(args.calls, args.clock)
    before = json.loads(open(args.before).read())["rows"] if args.before else {}
    print(f"{'op':26s} {'scan_lib':>9s} {'torch':>7s} {'scan_lib, inputs need grad':>27s}"
          + (f" {'before':>9s} {'ratio':>6s} {'before, grad':>13s} {'ratio':>6s}" if before else ""))
    for name, (ours, theirs, ours_grad) in rows.items():
        line = f"{name:26s} {_cell(ours, 9)} {_cell(theirs, 7)} {_cell(ours_grad, 27)}"
        if name in before:
            old, _, old_grad = before[name]
            ratio = lambda new, was: f"{was / new:6.1f}" if new and was else f"{'-':>6s}"   # noqa: E731
            line += f" {_cell(old, 9)} {ratio(ours, old)} {_cell(old_grad, 13)} {ratio(ours_grad, old_grad)}"
        print(line)
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"describe": scan_lib.runtime.describe(), "clock": args.clock, "calls": args.calls, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
