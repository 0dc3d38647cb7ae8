"""Sweep linear_scan's GPU launch parameters at (8, 1024, 4096) float32; one line per measurement.

    python benchmarks/bench_linear_scan.py            (GPU only; about 90 s on an H200)

Times are do_bench medians in microseconds. Floors = tensors that must move / measured copy bandwidth:
forward 3 tensors (read gates, tokens; write h), backward 5 (read gates, h, grad; write 2 grads),
forward + backward 8. The knobs are the module dicts scan_lib.ema.FWD_CONFIG and
scan_lib.linear_scan.BWD_CONFIG (max_chunk, elements_per_thread -> num_warps, stages = num_stages of
the chunk loop, reversed_loads = descending loads + forward scan instead of tl.associative_scan
reverse=True); the BEST lines give the dicts to put into notebooks/02_ema.py and 03_backward.py.
Every configuration is checked against the first one before it is timed.
"""
import itertools
import sys
import time

import torch

import scan_lib  # first: without a GPU it would switch Triton to its interpreter (this script needs a GPU)

from scan_lib.runtime import copy_bandwidth, median_us

ema = sys.modules["scan_lib.ema"]
ls = sys.modules["scan_lib.linear_scan"]  # the module: scan_lib.linear_scan is the function
SHAPE = (8, 1024, 4096)
BUDGET_S = 70  # stop sweeping (and say so) past this many seconds, to stay within the lead's time slot
START = time.perf_counter()


def time_us(fn):
    return median_us(fn, warmup=5, rep=40)


def inputs(dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(0)
    gates = (0.5 + 0.5 * torch.rand(SHAPE, device="cuda", generator=g)).to(dtype)
    tokens = torch.randn(SHAPE, device="cuda", generator=g).to(dtype)
    grad = torch.randn(SHAPE, device="cuda", generator=g).to(dtype)
    return gates, tokens, grad


def fwd_bwd(scan, gates, tokens, grad):
    leaves = [gates.detach().requires_grad_(), tokens.detach().requires_grad_()]
    return lambda: torch.autograd.grad(scan(*leaves), leaves, grad)


def close(got, want):
    return all(((g.float() - w.float()).abs().max() / w.float().abs().max()).item() < 1e-4 for g, w in zip(got, want))


def over_budget(what):
    if time.perf_counter() - START > BUDGET_S:
        print(f"{what}: skipped (time budget of {BUDGET_S} s spent)", flush=True)
        return True
    return False


def name_of(config):
    return (f"chunk={config['max_chunk']:4d} ept={config['elements_per_thread']:2d} stages={config['stages']} "
            f"{'desc-loads' if config['reversed_loads'] else 'rev-scan  '}")


def sweep_forward(gates, tokens, floor_us, configs, reverse=False):
    rows = (gates.view(-1, SHAPE[-1]), tokens.view(-1, SHAPE[-1]))
    results, reference = [], None
    for config in configs:
        tag = f"fwd{' reverse' if reverse else ''} {name_of(config)}"
        if over_budget(tag):
            break
        run = lambda: ema.linear_scan_rows(*rows, reverse=reverse, config=config)  # noqa: E731
        h = run()
        reference = h if reference is None else reference
        assert close([h], [reference]), tag
        t = time_us(run)
        results.append((t, config))
        print(f"{tag}: {t:7.1f} us  x{t / floor_us:.2f} floor", flush=True)
    return min(results, key=lambda r: r[0])


def sweep_backward(gates, tokens, grad, floor_bwd_us, floor_both_us):
    h = ema.linear_scan_rows(gates.view(-1, SHAPE[-1]), tokens.view(-1, SHAPE[-1]))
    rows = (gates.view(-1, SHAPE[-1]), h, grad.view(-1, SHAPE[-1]))
    results, reference = [], None
    for chunk, ept, stages, rl in itertools.product((2048, 4096, 1024), (16, 8), (1, 2), (False, True)):
        config = {"max_chunk": chunk, "elements_per_thread": ept, "stages": stages, "reversed_loads": rl}
        tag = f"bwd {name_of(config)}"
        if over_budget(tag):
            break
        run = lambda: ls.linear_scan_rows_backward(*rows, config=config)  # noqa: E731
        grads = run()[:2]
        reference = grads if reference is None else reference
        assert close(grads, reference), tag
        bwd_us = time_us(run)
        ls.BWD_CONFIG.update(config)
        both_us = time_us(fwd_bwd(scan_lib.linear_scan, gates, tokens, grad))
        results.append((both_us, bwd_us, config))
        print(f"{tag}: bwd {bwd_us:7.1f} us x{bwd_us / floor_bwd_us:.2f}  fwd+bwd {both_us:7.1f} us "
              f"x{both_us / floor_both_us:.2f}", flush=True)
    return min(results, key=lambda r: r[0])


def accelerated_scan(gates, tokens, grad, floors):
    try:
        from accelerated_scan.scalar import scan
    except ImportError:
        try:
            from accelerated_scan.triton import scan
        except ImportError:
            print("accelerated-scan: skipped: accelerated_scan is not importable (pip install accelerated-scan)")
            return None
    fwd_us = time_us(lambda: scan(gates, tokens))
    both_us = time_us(fwd_bwd(scan, gates, tokens, grad))
    print(f"accelerated-scan: fwd {fwd_us:7.1f} us x{fwd_us / floors['fwd']:.2f}  fwd+bwd {both_us:7.1f} us "
          f"x{both_us / floors['fwd+bwd']:.2f}", flush=True)
    return fwd_us, both_us


if __name__ == "__main__":
    assert scan_lib.runtime.ON_GPU, "needs a GPU"
    print(scan_lib.runtime.describe())
    bandwidth = copy_bandwidth()
    gates, tokens, grad = inputs()
    tensor_bytes = gates.numel() * gates.element_size()
    floors = {k: n * tensor_bytes / bandwidth * 1e6 for k, n in (("fwd", 3), ("bwd", 5), ("fwd+bwd", 8))}
    print(f"shape {SHAPE} float32, copy bandwidth {bandwidth / 1e12:.2f} TB/s, floors: "
          + ", ".join(f"{k} {v:.0f} us" for k, v in floors.items()), flush=True)
    reference_times = accelerated_scan(gates, tokens, grad, floors)

    best_fwd = sweep_forward(gates, tokens, floors["fwd"], [
        {"max_chunk": chunk, "elements_per_thread": ept, "stages": stages, "reversed_loads": False}
        for chunk, ept, stages in itertools.product((2048, 4096), (16, 8), (1, 2))])
    ema.FWD_CONFIG.update(best_fwd[1])
    best_both = sweep_backward(gates, tokens, grad, floors["bwd"], floors["fwd+bwd"])
    ls.BWD_CONFIG.update(best_both[2])
    # reverse=True forward: the two ways of scanning a chunk from its end, at the best forward config
    best_reverse = sweep_forward(gates, tokens, floors["fwd"], [
        {**best_fwd[1], "reversed_loads": rl} for rl in (False, True)], reverse=True)
    ema.FWD_CONFIG.update(best_reverse[1])

    if not over_budget("reverse=True fwd+bwd and bf16 with the best configs"):
        both_rev = time_us(fwd_bwd(lambda g, u: scan_lib.linear_scan(g, u, reverse=True), gates, tokens, grad))
        print(f"reverse=True, best configs: fwd+bwd {both_rev:7.1f} us x{both_rev / floors['fwd+bwd']:.2f}")
        bf16 = inputs(torch.bfloat16)
        print(f"bfloat16 inputs, best configs: fwd {time_us(lambda: scan_lib.linear_scan(*bf16[:2])):7.1f} us, "
              f"fwd+bwd {time_us(fwd_bwd(scan_lib.linear_scan, *bf16)):7.1f} us (floors are half the float32 ones)")

    print(f"BEST fwd: {best_fwd[0]:.1f} us (x{best_fwd[0] / floors['fwd']:.2f}), reverse=True {best_reverse[0]:.1f} us; "
          f"FWD_CONFIG = {ema.FWD_CONFIG}")
    print(f"BEST fwd+bwd: {best_both[0]:.1f} us (x{best_both[0] / floors['fwd+bwd']:.2f}), bwd alone "
          f"{best_both[1]:.1f} us (x{best_both[1] / floors['bwd']:.2f}) BWD_CONFIG = {best_both[2]}"
          + ("" if reference_times is None else f"; accelerated-scan fwd+bwd {reference_times[1]:.1f} us"))
    print(f"total {time.perf_counter() - START:.0f} s")
