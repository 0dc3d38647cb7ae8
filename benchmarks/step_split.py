"""Where one training step of the selective scan (or of chapter 10's SSD) spends its time: the host or the GPU.

    python benchmarks/step_split.py [--dtype bf16] [--shapes 8,1024,512,16 8,1024,2048,4 ...] [--rows 12]
    python benchmarks/step_split.py --workload ssd [--shapes 8,2048,32,64,64 ...]
    ncu --clock-control none --profile-from-start off ... python benchmarks/step_split.py --ncu ...

For each (batch, dim, L, N), on the inputs `make bench` times (bench.py's selective_inputs: the
block's layout, with D, z, delta_bias and softplus), one forward+backward (`training_step`) of
scan_lib's selective_scan, and of mamba_ssm's selective_scan_fn where it is importable, is timed
four ways:

- step: `triton.testing.do_bench` median of the whole step, what a training loop pays;
- host: the wall time the host takes to queue one step (as `runtime.host_us` times it: steps back
  to back, no synchronisation inside; the queue never fills at these counts), whatever the GPU is doing;
- cpu: the process's CPU time per step over the same steps (all its threads: autograd runs the
  backward on a thread of its own), which the host's scheduling moves less than the wall time;
- kernels: the sum of the step's kernel durations from `torch.profiler`'s CUDA timeline.

The host samples of the implementations are interleaved (one sample of each in turn, `--samples`
rounds), so that a drift in the host's speed, which on the H200 machine has moved one step's host
time by 2x between calls, reaches all of them alike; compare the rows of one shape with each other.
The step is about the larger of host and kernels; where host is the larger, the GPU waits and the
kernels are not what to cut. Then, for scan_lib, the host's own time per step by operation
(`torch.profiler`'s CPU activity, self time, the `--rows` largest), which names what the host
spends it on. `--workload ssd` does the same for `mamba_chunk_scan_combined` (bench.py's ssd_inputs:
D, z, dt_bias, softplus, chunk 256; shapes batch,L,heads,P,N) beside mamba_ssm's Triton op where it is
importable. With `--ncu`, nothing is timed: one step of each implementation per shape runs between
cudaProfilerStart and Stop (after a warm-up step outside, which compiles and autotunes), for Nsight
Compute's `--profile-from-start off`. GPU only, as bench.py is (tests/test_bench.py runs it on the CPU interpreter at a tiny
shape, with bench.py's device switched to the CPU: there it times the interpreter).
"""
import argparse
import statistics
import time

import torch

import scan_lib  # first: without a GPU it switches Triton to its interpreter
from bench import mamba_ssm_chunk_scan, mamba_ssm_scan, selective_inputs, ssd_inputs   # benchmarks/bench.py's
from scan_lib.runtime import ON_GPU, host_us, median_us

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPES = {"selective_scan": ["8,1024,512,16", "8,1024,2048,4", "8,1024,2048,16", "1,1536,8192,16"],
          "ssd": ["8,2048,32,64,64", "8,2048,32,64,128", "8,8192,32,64,128"]}
SSD_CHUNK = 256   # mamba_ssm's default chunk_size


def training_step(inputs, scan=scan_lib.selective_scan):
    """One forward+backward of `scan` (selective_scan_fn's signature) on leaves made from inputs."""
    leaves = [t.detach().requires_grad_() for t in inputs]   # every input given: full=True
    out = scan(*leaves, delta_softplus=True)
    return torch.autograd.grad(out, leaves, torch.ones_like(out))


def ssd_step(inputs, op=scan_lib.mamba_chunk_scan_combined):
    """One forward+backward of `op` (mamba_chunk_scan_combined's signature) on leaves made from inputs."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    x, dt, A, B, C, D, z, dt_bias = leaves
    out = op(x, dt, A, B, C, SSD_CHUNK, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    return torch.autograd.grad(out, leaves, torch.ones_like(out))


# workload -> (inputs of a shape and dtype, step(inputs, implementation), mamba_ssm's implementation, ours)
WORKLOADS = {
    "selective_scan": (lambda shape, dtype: selective_inputs(*shape, dtype, full=True), training_step,
                       mamba_ssm_scan, scan_lib.selective_scan),
    "ssd": (lambda shape, dtype: ssd_inputs(*shape, dtype), ssd_step, mamba_ssm_chunk_scan,
            scan_lib.mamba_chunk_scan_combined),
}


def implementations(peer, workload="selective_scan"):
    """name -> implementation to time: scan_lib's, and with peer mamba_ssm's where it is importable."""
    _, _, find_peer, ours = WORKLOADS[workload]
    found = {}
    if peer:
        fn, reason = find_peer()
        if fn is None:
            print(f"{reason}: its rows are left out")
        else:
            found["mamba_ssm"] = fn
    found["scan_lib"] = ours   # last: its host operations follow its row
    return found


def host_sample(fn, calls):
    """(wall us, process CPU us) per call of fn: runtime.host_us, with the CPU time of the calls
    themselves added up beside it (not of host_us's synchronisations, whose wait for the GPU would
    count as CPU time: CUDA spins while it waits)."""
    cpu = [0.0]

    def counted():
        start = time.process_time()
        fn()
        cpu[0] += time.process_time() - start
    return host_us(counted, calls), cpu[0] / calls * 1e6


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


def split(shape, dtype, scans, rows, calls, samples, workload="selective_scan"):
    make_inputs, step_of, _, _ = WORKLOADS[workload]
    inputs = make_inputs(shape, dtype)
    steps = {name: (lambda scan=scan: step_of(inputs, scan)) for name, scan in scans.items()}
    hosts = {name: [] for name in steps}
    for _ in range(samples):   # interleaved: a drift in the host's speed reaches every implementation
        for name, fn in steps.items():
            hosts[name].append(host_sample(fn, calls))
    for name, fn in steps.items():
        step = median_us(fn) if ON_GPU else float("nan")
        wall, cpu = (statistics.median(sample[i] for sample in hosts[name]) for i in (0, 1))
        kernels, by_op = profile_step(fn, calls)
        print(f"{str(shape):22s} {name:10s} step {step:8.0f} us   host {wall:8.0f} us   cpu {cpu:8.0f} us   "
              f"kernels {kernels:8.0f} us")
    for op, us in by_op[:rows]:   # the last implementation's: scan_lib
        print(f"    {us:8.1f} us  {op[:90]}")


def profiled_steps(shape, dtype, scans, workload="selective_scan"):
    """One step of each implementation inside cudaProfilerStart/Stop, after one outside (compiles, autotunes)."""
    make_inputs, step_of, _, _ = WORKLOADS[workload]
    inputs = make_inputs(shape, dtype)
    for name, scan in scans.items():
        step_of(inputs, scan)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        step_of(inputs, scan)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"{str(shape):22s} {name:10s} one step profiled", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="selective_scan")
    parser.add_argument("--shapes", nargs="+", help="batch,dim,L,N each (ssd: batch,L,heads,P,N)")
    parser.add_argument("--rows", type=int, default=12, help="host operations listed per shape")
    parser.add_argument("--calls", type=int, default=20, help="steps per host sample and profiled")
    parser.add_argument("--samples", type=int, default=9, help="host samples (their median is printed)")
    parser.add_argument("--no-peer", action="store_true", help="scan_lib alone, without mamba_ssm's rows")
    parser.add_argument("--ncu", action="store_true", help="one step per implementation and shape inside "
                        "cudaProfilerStart/Stop, for ncu --profile-from-start off; nothing timed")
    args = parser.parse_args(argv)
    scans = implementations(peer=not args.no_peer, workload=args.workload)
    options = ("block layout, D, z, delta_bias, softplus" if args.workload == "selective_scan"
               else f"D, z, dt_bias, softplus, chunk {SSD_CHUNK}")
    print(f"{scan_lib.runtime.describe()}; {args.workload} forward+backward, {args.dtype}, {options}; us per step")
    for text in args.shapes or SHAPES[args.workload]:
        shape = tuple(int(v) for v in text.split(","))
        if args.ncu:
            profiled_steps(shape, DTYPES[args.dtype], scans, args.workload)
            continue
        split(shape, DTYPES[args.dtype], scans, args.rows, args.calls, args.samples, args.workload)


if __name__ == "__main__":
    main()
