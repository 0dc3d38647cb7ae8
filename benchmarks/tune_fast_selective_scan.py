"""Sweep chapter 07's launch parameters (scan_lib.fast_selective_scan.GPU_CONFIG) and its segments at
the rows `make bench` has short with few programs per GPU (batch 1-2 at dim 1536, L 8192 and 65536).

    python benchmarks/tune_fast_selective_scan.py [--shapes 1,1536,8192,16 2,1536,8192,16] [--dtype bf16]
                                                  [--budget 240] [--states table 1 2 4]

For each (batch, dim, L, N), on the inputs `make bench` times (bench.py's selective_inputs: the
block's layout, D, z, delta_bias and softplus), the forward without gradients and one
forward+backward (bench.py's timing: do_bench medians, us) under each candidate: the forward's
(block_d, chunk, num_warps), then the backward's (the forward in training runs with its chunk),
then the number of segments (section 5's split along L) with the best configs. One line per
measurement, the best per shape and pass at the end, beside GPU_CONFIG's own time: a candidate
counts as better only when it is at least 5% faster, so that run-to-run noise does not pick one.
The sweep stops at --budget seconds of wall time, keeping what it measured. With --states, each
forward candidate is tried at each number of states per step of the forward's loop over states (the
config's "unroll"; `table` for FORWARD_STATES_PER_STEP's choice, what runs without one): the per-dtype
forward table of issue 20 (07's sweep found fp32 faster at chunk 1024 with 2 states per step, bf16 not).

Why these rows: at batch 1 of dim 1536 the forward launches batch x dim / block_d = 768 programs of
one warp on the H200's 132 multiprocessors, about six warps each, which may be too few to hide the
scan's latencies (not yet profiled); mamba_ssm's kernel runs 1536 blocks of 128 threads there.
Fewer channels per program, more warps per program, or segments (more programs along L) each add
parallelism at some cost; this sweep measures which, if any, pays.

GPU only for the numbers; --smoke runs the same code on tiny shapes (the CPU interpreter in the
tests), where only its plumbing is checked.
"""
import argparse
import itertools
import time

import torch

import scan_lib  # first: without a GPU it switches Triton to its interpreter
import bench     # benchmarks/bench.py: selective_inputs, the block's layout with every option
from scan_lib import fast_selective_scan as fast
from scan_lib.runtime import DEVICE, ON_GPU, describe, median_us

bench.DEVICE = str(DEVICE)   # bench.py assumes a GPU; --smoke runs on the CPU interpreter too

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPES = ["1,1536,8192,16", "2,1536,8192,16", "1,1536,65536,16"]
FWD_CANDIDATES = [dict(block_d=b, chunk=c, num_warps=w) for b, c, w in itertools.product((1, 2), (256, 512, 1024), (1, 2, 4))]
BWD_CANDIDATES = [dict(block_d=b, chunk=c, num_warps=w) for b, c, w in itertools.product((1, 2), (64, 128, 256), (1, 2, 4))]
SEGMENTS = (1, 2, 4, 8)


def forward(inputs, segments=1):
    """A forward without gradients, as inference runs it."""
    with torch.no_grad():
        return fast.scan_in_segments(*inputs, delta_softplus=True, segments=segments)


def forward_backward(inputs, segments=1):
    """One training step: leaves, the forward, the backward of every input."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fast.scan_in_segments(*leaves, delta_softplus=True, segments=segments)
    return torch.autograd.grad(out, leaves, torch.ones_like(out))


def time_us(fn):
    """do_bench's median in us on a GPU; under the interpreter (--smoke) one call's wall time."""
    if ON_GPU:
        return median_us(fn, warmup=5, rep=40)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def active_config() -> dict:
    """The launch configs the kernels read now: GPU_CONFIG on a GPU, CPU_CONFIG under the interpreter."""
    return fast.GPU_CONFIG if ON_GPU else fast.CPU_CONFIG


class Sweep:
    """Times candidates, printing each, until the wall-time budget is spent."""

    def __init__(self, budget_s):
        self.deadline = time.time() + budget_s

    def measure(self, label, fn):
        """fn's time in us, or None past the budget or when the compiler refuses the config."""
        if time.time() > self.deadline:
            return None
        try:
            us = time_us(fn)
        except Exception as error:   # a config the compiler refuses (registers, shared memory)
            print(f"{label}: failed ({type(error).__name__}: {str(error)[:80]})", flush=True)
            return None
        print(f"{label}: {us:9.1f} us", flush=True)
        return us

    @staticmethod
    def apply(table, change):
        """table updated by change, a key whose value is None removed (unroll None: the table's choice)."""
        table.update(change)
        for key in [key for key, value in table.items() if value is None]:
            del table[key]

    def configs(self, kind, candidates, fn, shape_label):
        """(the default's time, the best config, its time) over candidates for the active config[kind];
        the best is left in place, so that the backward's sweep runs with the forward's best."""
        table = active_config()[kind]
        default = dict(table)
        default_us = self.measure(f"{shape_label} {kind} default {default}", fn)
        best, best_us = default, default_us
        for change in candidates:
            self.apply(table, change)
            us = self.measure(f"{shape_label} {kind} {change}", fn)
            if us is not None and (best_us is None or us < best_us / 1.05):
                best, best_us = dict(table), us
        table.clear()
        table.update(best)
        return default_us, best, best_us


def tune_shape(sweep, shape, dtype, fwd_candidates=FWD_CANDIDATES, bwd_candidates=BWD_CANDIDATES,
               segments=SEGMENTS):
    """Forward configs, backward configs, then segments with the best configs, at one shape; the
    launch configs are restored at the end, whatever happened."""
    saved = {kind: dict(config) for kind, config in active_config().items()}
    inputs = bench.selective_inputs(*shape, dtype, True)
    label = f"{shape} {str(dtype).split('.')[-1]}"
    try:
        report = {"fwd": sweep.configs("fwd", fwd_candidates, lambda: forward(inputs), label),
                  "bwd": sweep.configs("bwd", bwd_candidates, lambda: forward_backward(inputs), label)}
        for count in segments[1:]:
            sweep.measure(f"{label} fwd segments={count}", lambda: forward(inputs, count))
            sweep.measure(f"{label} fwd+bwd segments={count}", lambda: forward_backward(inputs, count))
    finally:
        for kind, config in saved.items():
            active_config()[kind].clear()
            active_config()[kind].update(config)
    return report


def with_states(candidates, states):
    """Each candidate at each of `states` ("table" -> unroll None, the table's choice), or candidates as
    they are when states is None."""
    if not states:
        return candidates
    unrolls = [None if value == "table" else int(value) for value in states]
    return [dict(candidate, unroll=unroll) for candidate in candidates for unroll in unrolls]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="batch,dim,L,N")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--budget", type=float, default=240, help="seconds of sweeping, then stop")
    parser.add_argument("--states", nargs="+", help="states per step of the forward's loop to try with each forward "
                        "candidate: numbers, or `table` for FORWARD_STATES_PER_STEP's choice")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, the plumbing only (any machine)")
    args = parser.parse_args(argv)
    if not ON_GPU and not args.smoke:
        raise SystemExit("needs a GPU (or --smoke)")
    print(describe(), flush=True)
    sweep = Sweep(args.budget)
    fwd_candidates = with_states(FWD_CANDIDATES, args.states)
    if args.smoke:   # two candidates of each kind, two segment counts
        reports = {(1, 4, 24, 2): tune_shape(sweep, (1, 4, 24, 2), DTYPES[args.dtype], fwd_candidates[:2],
                                             BWD_CANDIDATES[:2], SEGMENTS[:2])}
    else:
        reports = {shape: tune_shape(sweep, shape, DTYPES[args.dtype], fwd_candidates)
                   for shape in (tuple(int(x) for x in s.split(",")) for s in args.shapes)}
    print("\nbest per shape and pass (a change counts when at least 5% faster than the best before it):")
    for shape, report in reports.items():
        for kind, (default_us, best, best_us) in report.items():
            if default_us is not None and best_us is not None:
                print(f"{str(shape):22s} {kind}: default {default_us:8.1f} us, best {best_us:8.1f} us "
                      f"({default_us / best_us:.2f}x) with {best}")
    return reports


if __name__ == "__main__":
    main()
