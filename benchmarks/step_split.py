"""Where one training step of the selective scan spends its time: the host or the GPU.

    python benchmarks/step_split.py [--dtype bf16] [--shapes 8,1024,512,16 8,1024,2048,4 ...] [--rows 12]

For each (batch, dim, L, N), on the inputs `make bench` times (bench.py's selective_inputs: the
block's layout, with D, z, delta_bias and softplus), one forward+backward (`training_step`) is timed
three ways:

- step: `triton.testing.do_bench` median of the whole step, what a training loop pays;
- host: the time the host takes to queue one step (`runtime.host_us`: steps back to back, no
  synchronisation inside; the queue never fills at these counts), whatever the GPU is doing;
- kernels: the sum of the step's kernel durations from `torch.profiler`'s CUDA timeline.

The step is about the larger of host and kernels; where host is the larger, the GPU waits and the
kernels are not what to cut. Then the host's own time per step by operation (`torch.profiler`'s CPU
activity, self time, the `--rows` largest), which names what the host spends it on. GPU only, as
bench.py is (tests/test_bench.py runs it on the CPU interpreter at a tiny shape, with bench.py's
device switched to the CPU: there it times the interpreter).
"""
import argparse
import statistics

import torch

import scan_lib  # first: without a GPU it switches Triton to its interpreter
from bench import selective_inputs   # benchmarks/bench.py: the block's layout, every option
from scan_lib.runtime import ON_GPU, host_us, median_us

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPES = ["8,1024,512,16", "8,1024,2048,4", "8,1024,2048,16", "1,1536,8192,16"]


def training_step(inputs):
    """One forward+backward of scan_lib.selective_scan on leaves made from inputs (chapter 07's)."""
    leaves = [t.detach().requires_grad_() for t in inputs]   # every input given: full=True
    out = scan_lib.selective_scan(*leaves, delta_softplus=True)
    return torch.autograd.grad(out, leaves, torch.ones_like(out))


def profile_step(fn, steps):
    """(kernel us per step, [(operation, host self us per step)]) from torch.profiler over `steps` calls."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ON_GPU else [])
    fn()
    if ON_GPU:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if ON_GPU:
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    host = [(e.key, e.self_cpu_time_total / steps) for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    return kernels / steps, sorted(host, key=lambda item: -item[1])


def split(shape, dtype, rows, calls, samples):
    inputs = selective_inputs(*shape, dtype, full=True)
    fn = lambda: training_step(inputs)  # noqa: E731
    step = median_us(fn) if ON_GPU else float("nan")
    host = statistics.median(host_us(fn, calls) for _ in range(samples))
    kernels, by_op = profile_step(fn, calls)
    print(f"{str(shape):22s} step {step:8.0f} us   host {host:8.0f} us   kernels {kernels:8.0f} us")
    for name, us in by_op[:rows]:
        print(f"    {us:8.1f} us  {name[:90]}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="batch,dim,L,N each")
    parser.add_argument("--rows", type=int, default=12, help="host operations listed per shape")
    parser.add_argument("--calls", type=int, default=20, help="steps per host sample and profiled")
    parser.add_argument("--samples", type=int, default=5, help="host samples (their median is printed)")
    args = parser.parse_args(argv)
    print(f"{scan_lib.runtime.describe()}; selective_scan forward+backward, {args.dtype}, block layout, "
          "D, z, delta_bias, softplus; us per step")
    for text in args.shapes:
        split(tuple(int(v) for v in text.split(",")), DTYPES[args.dtype], args.rows, args.calls, args.samples)


if __name__ == "__main__":
    main()
