"""`make bench` (GPU only): scan_lib against every peer that is importable, correctness first.

    python benchmarks/bench.py [--quick] [--only cumsum,linear_scan,selective_scan,block,mamba2,ssd,conv,host]

For every workload it first checks scan_lib (and each peer) against a reference on the same inputs:
a float64 computation, or the peer itself where a float64 reference would not fit. A check that
fails is reported and that row is not timed. Then it times each implementation twice:

- call_us: `triton.testing.do_bench` median of the public call, host work included (what a training
  step pays when the GPU waits for the host);
- host_us: the host's time to issue one call, calls queued back to back without synchronising
  (`scan_lib.runtime.host_us`): where it exceeds the GPU's time, the GPU waits for Python;
- gpu_us (forward rows): the median of the same call replayed from a CUDA graph (`do_bench_cudagraph`):
  the GPU's time alone. Host work (Python, dispatch, autograd) varies with the machine's load, so
  call_us of a short call varies from run to run; gpu_us does not, and forward ratios use it.
  Forward+backward rows are not replayed (capturing autograd's backward failed on the H200 and left
  the CUDA RNG unusable), so their ratios use call_us.

The floor of a row is the bytes that must move (each input read once, each output written once;
for forward+backward the forward's reads and writes plus the backward's: the forward's inputs and
the output gradient read again, one gradient per input written) over the copy bandwidth measured in
the same run. Peers that are not importable are reported missing, never guessed: torch.cumsum and
torch.compile of associative_scan (always there), accelerated-scan (pip install accelerated-scan),
mamba_ssm (its CUDA extension built for this GPU), mamba_ssm's Mamba and Mamba2 modules, mamba_ssm's Triton
`mamba_chunk_scan_combined` (Mamba-2's chunked scan, beside chapter 10's) and causal-conv1d's
`causal_conv1d_fn` (its CUDA extension built for this GPU). The `host` workload times each public op's
Python path on empty inputs (benchmarks/host_time.py's calls, beside torch's op where there is one).

Writes benchmarks/results/bench_<gpu>_<date>.csv (GPU, driver, versions, shapes, dtypes, times,
ratios, percent of floor) and figures/bench_selective_scan_*.png, and prints the table.
"""
import argparse
import csv
import datetime
import importlib
import importlib.util
import math
import re
import statistics
import subprocess
import sys
import traceback
from pathlib import Path

import torch

import scan_lib  # first: it sets up Triton (this script needs a GPU)
from scan_lib.mamba import positions_last
from scan_lib.runtime import copy_bandwidth, graph_us, host_us, median_us
from scan_lib.causal_conv1d import causal_conv1d_ref
from scan_lib.selective_scan import selective_scan_ref
from scan_lib.ssd import ssd_chunked

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda"
ROWS = []          # one dict per (workload, implementation)

# The shapes (the performance issue's): tests/test_bench.py swaps in tiny ones to run this file on a CPU.
SIZES = dict(
    cumsum=[25], cumsum_more=[20, 27],                               # log2 of the number of values
    linear_scan=(8, 1024, 4096),                                     # (batch, dim, L)
    selective=(8, 1024, 2048, 16),                                   # (batch, dim, L, N)
    selective_lengths=[512, 8192, 32768], selective_states=[4, 64],
    selective_batch=((1, 2, 4), 1536, 8192), selective_long=(1, 1536, 65536, 16),
    selective_groups=2,                                              # B and C of shape (batch, groups, N, L)
    block=(8, 2048, 1024), block_check_length=256,                  # (batch, L, d_model)
    mamba2=(8, 2048, 1024, 64, 128),                                # (batch, L, d_model, head_dim, N)
    ssd=[(8, 2048, 32, 64, 64), (8, 2048, 32, 64, 128)],            # (batch, L, heads, head_dim, N)
    ssd_more=[(8, 8192, 32, 64, 128), (1, 65536, 24, 64, 128)], ssd_chunk=256, ssd_check_heads=2,
    conv=[((8, 2048, 2048), torch.float32), ((8, 2048, 2048), torch.bfloat16)],   # (batch, dim, L), width 4
    conv_more=[((1, 4096, 32768), torch.bfloat16), ((2, 1536, 4097), torch.bfloat16)], conv_check_channels=16,
    host_calls=200,
)


# ---------------------------------------------------------------- measuring

def time_both(fn, graph=True):
    """(call_us, gpu_us, host_us) of fn(); gpu_us is nan when fn is not replayed from a CUDA graph
    (graph=False: autograd's backward, whose capture fails and leaves the CUDA RNG unusable), or cannot
    be captured."""
    fn()
    torch.cuda.synchronize()
    call = median_us(fn, warmup=25, rep=200)
    host = statistics.median(host_us(fn, calls=5) for _ in range(5))   # few calls: CUDA's launch queue stays short of full
    if not graph:
        return call, math.nan, host
    try:
        gpu = graph_us(fn)
    except Exception as error:  # noqa: BLE001 (capture fails in many ways: report, do not guess)
        print(f"    (no CUDA graph: {type(error).__name__}: {str(error)[:80]})")
        torch.cuda.synchronize()
        gpu = math.nan
    return call, gpu, host


def rel_err(got, want):
    got, want = [g.double() for g in got], [w.double() for w in want]
    return max(((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for g, w in zip(got, want))


def record(workload, shape, dtype, mode, impl, fn, check, tol, floor_us):
    """Check (check() -> relative error) then time fn; append a row. A peer that raises (an unsupported
    mode) gets a row saying so; scan_lib raising is an error."""
    row = dict(workload=workload, shape=tuple(shape), dtype=str(dtype).replace("torch.", ""), mode=mode, impl=impl,
               floor_us=round(floor_us, 1), call_us=math.nan, gpu_us=math.nan, host_us=math.nan)
    try:
        err = check()
        row.update(rel_err=f"{err:.1e}", correct=err <= tol)
        if err <= tol:
            row["call_us"], row["gpu_us"], row["host_us"] = (round(t, 1) for t in time_both(fn, graph=mode == "fwd"))
        else:
            print(f"    FAILED check: {impl} {workload} {shape} {dtype} {mode}: relative error {err:.1e} > {tol:.0e}")
    except Exception as error:  # noqa: BLE001
        ours = impl.startswith("scan_lib")
        row.update(rel_err="", correct=False if ours else "", note=f"{'error' if ours else 'not supported'}: "
                   f"{type(error).__name__}: {str(error)[:100]}")
        print(f"    {row['note']}")
        torch.cuda.synchronize()
    ROWS.append(row)
    print(f"  {workload:15s} {str(shape):24s} {row['dtype']:8s} {mode:8s} {impl:28s} err {row['rel_err']:>7s} "
          f"call {row['call_us']:9.1f} us  gpu {row['gpu_us']:9.1f} us  host {row['host_us']:8.1f} us  "
          f"floor {floor_us:8.1f} us", flush=True)


def missing(workload, impl, reason):
    print(f"  {workload:15s} {impl}: missing ({reason})")
    ROWS.append(dict(workload=workload, impl=impl, shape="", dtype="", mode="", rel_err="", correct="",
                     floor_us="", call_us="", gpu_us="", host_us="", note=f"missing: {reason}"))


def grads_of(f, leaves, grad):
    """A callable running f's forward and backward: autograd.grad of f(*leaves) against grad."""
    return lambda: torch.autograd.grad(f(*leaves), [x for x in leaves if x.requires_grad], grad)


# ---------------------------------------------------------------- peers

def accelerated_scan():
    try:
        from accelerated_scan.scalar import scan
        return scan, None
    except ImportError as error:
        return None, f"accelerated_scan not importable ({error})"


def mamba_ssm_scan():
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
        return selective_scan_fn, None
    except Exception as error:  # noqa: BLE001 (a missing CUDA extension surfaces as several error types)
        return None, f"mamba_ssm not importable ({type(error).__name__}: {str(error)[:60]})"


def mamba_ssm_chunk_scan():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined, None
    except Exception as error:  # noqa: BLE001 (the package's import needs its CUDA extension)
        return None, f"mamba_ssm's Triton SSD not importable ({type(error).__name__}: {str(error)[:60]})"


def causal_conv1d_peer():
    try:
        from causal_conv1d import causal_conv1d_fn
        return causal_conv1d_fn, None
    except Exception as error:  # noqa: BLE001 (a missing CUDA extension surfaces as several error types)
        return None, f"causal_conv1d not importable ({type(error).__name__}: {str(error)[:60]})"


def compiled_linear_scan():
    from torch._higher_order_ops.associative_scan import associative_scan
    combine_pairs = scan_lib.ema.first_order_op.fn   # chapter 02's operator, as a Python function

    def combine(left, right):
        return combine_pairs(*left, *right)
    return torch.compile(lambda gates, tokens: associative_scan(combine, (gates, tokens), dim=-1)[1], fullgraph=True)


# ---------------------------------------------------------------- workloads

def bench_cumsum(bandwidth, quick):
    for exponent in SIZES["cumsum"] + ([] if quick else SIZES["cumsum_more"]):
        x = torch.randn(2**exponent, device=DEVICE)
        floor = 2 * x.nbytes / bandwidth * 1e6
        want = torch.cumsum(x.double(), 0)
        for impl, fn in (("scan_lib.cumsum", lambda: scan_lib.cumsum(x)), ("torch.cumsum", lambda: torch.cumsum(x, 0))):
            record("cumsum", (2**exponent,), x.dtype, "fwd", impl, fn, lambda fn=fn: rel_err([fn()], [want]),
                   1e-3, floor)   # a wrong result, not float32 rounding (chapter 01 bounds that)


def bench_linear_scan(bandwidth, quick):
    shape = SIZES["linear_scan"]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    gates = (0.5 + 0.5 * torch.rand(shape, device=DEVICE, generator=g)).requires_grad_()
    tokens = torch.randn(shape, device=DEVICE, generator=g).requires_grad_()
    grad = torch.randn(shape, device=DEVICE, generator=g)
    nbytes = gates.nbytes
    want = scan_lib.ema.linear_scan_loop(gates.double(), tokens.double()) if not quick else None
    impls = {"scan_lib.linear_scan": scan_lib.linear_scan, "associative_scan, compiled": compiled_linear_scan()}
    accel, reason = accelerated_scan()
    if accel is None:
        missing("linear_scan", "accelerated-scan", reason)
    else:
        impls["accelerated-scan"] = accel
    reference = scan_lib.linear_scan(gates, tokens).detach() if want is None else want
    ref_grads = torch.autograd.grad(scan_lib.linear_scan(gates, tokens), [gates, tokens], grad)
    for impl, f in impls.items():
        with torch.no_grad():
            record("linear_scan", shape, gates.dtype, "fwd", impl, lambda f=f: f(gates.detach(), tokens.detach()),
                   lambda f=f: rel_err([f(gates.detach(), tokens.detach())], [reference]), 1e-4, 3 * nbytes / bandwidth * 1e6)
        record("linear_scan", shape, gates.dtype, "fwd+bwd", impl, grads_of(f, [gates, tokens], grad),
               lambda f=f: rel_err(grads_of(f, [gates, tokens], grad)(), ref_grads), 1e-4, 8 * nbytes / bandwidth * 1e6)


def selective_inputs(batch, dim, length, n_states, dtype, full, seed=0, groups=1):
    """u, delta, A, B, C, D, z, delta_bias as chapter 06's Mamba block passes them (delta before softplus
    when full): every (batch, ., L) tensor a view of a (features, batch L) matrix, a projection's output
    (scan_lib.mamba.positions_last: stride 1 along L, not contiguous), B and C rows of one matrix. With
    groups > 1, B and C of shape (batch, groups, N, L), channel d reading group d // (dim / groups), as
    mamba_ssm's selective_scan_fn takes them (the same matrix's rows, split in groups)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    rand = lambda *s: torch.randn(*s, device=DEVICE, generator=g)  # noqa: E731
    as_block = lambda flat: positions_last(flat.to(dtype), batch, length)  # noqa: E731
    u = as_block(rand(dim, batch * length))
    delta = as_block(rand(dim, batch * length) * 0.5 - (1.0 if full else 0.0))
    if not full:
        delta = as_block(0.02 + 0.1 * torch.rand(dim, batch * length, device=DEVICE, generator=g))
    A = -(0.5 + torch.rand(dim, n_states, device=DEVICE, generator=g))
    B, C = as_block(rand(2 * groups * n_states, batch * length)).split(groups * n_states, dim=1)
    if groups > 1:
        B, C = B.unflatten(1, (groups, n_states)), C.unflatten(1, (groups, n_states))
    D, z, delta_bias = (rand(dim), as_block(rand(dim, batch * length)), rand(dim) * 0.1 - 2.0) if full else (None, None, None)
    return u, delta, A, B, C, D, z, delta_bias


def selective_bytes(u, B, full, backward):
    """Bytes that must move: read u, delta, B, C (+ z), write out; the backward reads them again and
    the output gradient, and writes one gradient each."""
    big = u.nbytes * (3 if full else 2) + 2 * B.nbytes          # u, delta (, z), B, C
    fwd = big + u.nbytes                                        # + out
    return fwd + (big + u.nbytes + big) if backward else fwd    # + read again, dout, write the gradients


def bench_selective_scan(bandwidth, quick):
    peer, reason = mamba_ssm_scan()
    if peer is None:
        missing("selective_scan", "mamba_ssm selective_scan_fn", reason)
    base = batch, dim, length, n_states = SIZES["selective"]
    both_dtypes = (torch.float32, torch.bfloat16)
    cases = [(base, dtype, full, 1) for dtype in both_dtypes for full in (False, True)]
    cases += [(base, dtype, True, SIZES["selective_groups"]) for dtype in both_dtypes]
    if not quick:
        cases += [((batch, dim, other, n_states), torch.bfloat16, True, 1) for other in SIZES["selective_lengths"]]
        cases += [((batch, dim, length, n), dtype, True, 1) for n in SIZES["selective_states"] for dtype in both_dtypes]
        batches, wide, long = SIZES["selective_batch"]
        cases += [((b, wide, long, n_states), torch.bfloat16, True, 1) for b in batches]
        cases += [(SIZES["selective_long"], dtype, True, 1) for dtype in both_dtypes]
    for shape, dtype, full, groups in cases:
        inputs = selective_inputs(*shape, dtype, full, groups=groups)
        leaves = [t.detach().requires_grad_() if t is not None else None for t in inputs]
        grad = torch.randn_like(inputs[0])
        options = dict(delta_softplus=full)
        fn = {"scan_lib.selective_scan": scan_lib.selective_scan}
        if peer is not None:
            fn["mamba_ssm selective_scan_fn"] = peer
        sliced = slice_inputs(inputs)                   # float64 reference on batch 0, 16 channels
        want = [selective_scan_ref(*sliced, **options)]
        sliced_leaves = [t.detach().requires_grad_() if t is not None else None for t in sliced]
        sliced_grad = grad[:1, :16]
        want_grads = torch.autograd.grad(selective_scan_ref(*sliced_leaves, **options),
                                         [t for t in sliced_leaves if t is not None], sliced_grad.double())
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        workload = "selective_scan" + (" full" if full else "") + (f", {groups} groups" if groups > 1 else "")
        for impl, f in fn.items():
            call = lambda f=f: f(*inputs, **options)  # noqa: E731
            with torch.no_grad():
                record(workload, shape, dtype, "fwd", impl, call, lambda call=call: rel_err([call()[:1, :16]], want),
                       tol, selective_bytes(inputs[0], inputs[3], full, False) / bandwidth * 1e6)
            diff = [t for t in leaves if t is not None]
            both = lambda f=f: torch.autograd.grad(f(*leaves, **options), diff, grad)  # noqa: E731

            def check(f=f):   # the gradients on the slice, inputs in their original dtypes, against float64
                small = [None if t is None else t.detach().to(orig.dtype).requires_grad_()
                         for t, orig in zip(sliced, inputs)]
                got = torch.autograd.grad(f(*small, **options), [t for t in small if t is not None], sliced_grad)
                return rel_err(got, want_grads)
            record(workload, shape, dtype, "fwd+bwd", impl, both, check, tol if dtype == torch.float32 else 5e-2,
                   selective_bytes(inputs[0], inputs[3], full, True) / bandwidth * 1e6)


def slice_inputs(inputs, channels=16):
    """The selective scan's inputs for batch element 0 and the first channels, in float64; B and C of
    shape (batch, groups, N, L) cut to the groups those channels read (channel d reads group
    d // (dim / groups))."""
    u, delta, A, B, C, D, z, delta_bias = inputs
    cut = lambda t, rows: None if t is None else t[rows].double()  # noqa: E731
    per_group = u.shape[1] // B.shape[1] if B.dim() == 4 else None           # channels reading one group
    read = slice(0, -(-min(channels, u.shape[1]) // per_group) if per_group else None)   # the groups they read
    return (cut(u, (slice(0, 1), slice(0, channels))), cut(delta, (slice(0, 1), slice(0, channels))),
            cut(A, slice(0, channels)), cut(B, (slice(0, 1), read)), cut(C, (slice(0, 1), read)),
            cut(D, slice(0, channels)),
            cut(z, (slice(0, 1), slice(0, channels))), cut(delta_bias, slice(0, channels)))


class WithScan(torch.nn.Module):
    """mamba_ssm's Mamba module (its unfused path) calling another selective scan: its module's
    selective_scan_fn is swapped for the duration of each forward (the backward needs no lookup)."""

    def __init__(self, block, scan):
        super().__init__()
        self.block, self.scan = block, scan

    def forward(self, hidden):
        module = sys.modules[type(self.block).__module__]
        saved, module.selective_scan_fn = module.selective_scan_fn, self.scan
        try:
            return self.block(hidden)
        finally:
            module.selective_scan_fn = saved


def bench_block(bandwidth, quick):
    MambaSSM, reason = scan_lib.mamba._mamba_ssm_block()
    if MambaSSM is None:
        missing("block", "mamba_ssm Mamba", reason)
    fused = importlib.util.find_spec("causal_conv1d") is not None
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        batch, length, d_model = shape = SIZES["block"]
        ours = scan_lib.Mamba(d_model, device=DEVICE, dtype=dtype)
        blocks = {"scan_lib.Mamba": ours}
        if MambaSSM is not None:
            for name, fast in (("mamba_ssm Mamba (unfused)", False), ("mamba_ssm Mamba (fused)", True))[: 2 if fused else 1]:
                blocks[name] = MambaSSM(d_model, use_fast_path=fast, device=DEVICE, dtype=dtype)
                blocks[name].load_state_dict(ours.state_dict())
            blocks["mamba_ssm Mamba (unfused) on scan_lib.selective_scan"] = WithScan(
                blocks["mamba_ssm Mamba (unfused)"], scan_lib.selective_scan)
        hidden = torch.randn(shape, device=DEVICE, dtype=dtype)
        reference = scan_lib.Mamba(d_model, backend="torch", device=DEVICE, dtype=torch.float32)   # plain PyTorch
        reference.load_state_dict(ours.state_dict())
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        record_blocks("block", hidden, blocks, reference, tol, tol)


def record_blocks(workload, hidden, blocks, reference, tol, peer_tol):
    """Each block's forward (no autograd) and forward+backward (the gradients of its parameters against a random
    output gradient) on hidden (batch, L, d_model), checked first on the first block_check_length positions
    against reference's output and parameter gradients (reference: a block of the same parameters in PyTorch,
    in its own dtype), within tol for scan_lib's block and peer_tol for the others."""
    shape, dtype, grad = tuple(hidden.shape), hidden.dtype, torch.randn_like(hidden)
    short, short_grad = hidden[:, :SIZES["block_check_length"]], grad[:, :SIZES["block_check_length"]]
    exact = next(reference.parameters()).dtype
    with torch.no_grad():
        want = reference(short.to(exact))
    want_grads = torch.autograd.grad(reference(short.to(exact)), list(reference.parameters()), short_grad.to(exact))
    for name, block in blocks.items():
        params = list(block.parameters())   # in the reference's order: the blocks register the same parameters
        tol_here = tol if name.startswith("scan_lib") else peer_tol
        with torch.no_grad():
            record(workload, shape, dtype, "fwd", name, lambda b=block: b(hidden),
                   lambda b=block: rel_err([b(short)], [want]), tol_here, math.nan)
        record(workload, shape, dtype, "fwd+bwd", name,
               lambda b=block, p=params: torch.autograd.grad(b(hidden), p, grad),
               lambda b=block, p=params: rel_err(torch.autograd.grad(b(short), p, short_grad), want_grads),
               tol_here, math.nan)


def bench_mamba2(bandwidth, quick):
    """scan_lib.Mamba2 against mamba_ssm's Mamba2, unfused and (where causal-conv1d is built) fused, checked against
    the block in float64 (PyTorch's ssd_chunked). main turns TF32 off, but mamba_ssm's SSD kernels multiply in TF32
    whatever torch is told (chapter 10 measured 1.2e-03 against float64): in float32 they are held to 5e-3, ours to
    1e-4."""
    Theirs, reason = scan_lib.ssd._mamba_ssm_mamba2()
    if Theirs is None:
        missing("mamba2", "mamba_ssm Mamba2", reason)
        fused = False
    else:   # the fused path calls causal-conv1d's extension, which may be missing where its package is not
        fused = getattr(importlib.import_module("mamba_ssm.ops.triton.ssd_combined"), "causal_conv1d_fwd_function",
                        None) is not None
    batch, length, d_model, head_dim, n_states = SIZES["mamba2"]
    sizes = dict(d_model=d_model, headdim=head_dim, d_state=n_states, device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        ours = scan_lib.Mamba2(**sizes, dtype=dtype)
        blocks = {"scan_lib.Mamba2": ours}
        if Theirs is not None:
            for name, fast in (("mamba_ssm Mamba2 (unfused)", False), ("mamba_ssm Mamba2 (fused)", True))[: 2 if fused else 1]:
                blocks[name] = Theirs(**sizes, use_mem_eff_path=fast, dtype=dtype)
                blocks[name].load_state_dict(ours.state_dict())
        hidden = torch.randn(batch, length, d_model, device=DEVICE, dtype=dtype)
        reference = scan_lib.Mamba2(**sizes, backend="torch", dtype=torch.float64)
        reference.load_state_dict(ours.state_dict())
        float32 = dtype == torch.float32
        record_blocks("mamba2", hidden, blocks, reference, 1e-4 if float32 else 5e-2, 5e-3 if float32 else 5e-2)


def ssd_inputs(batch, length, heads, head_dim, n_states, dtype, seed=0):
    """x, dt, A, B, C, D, z, dt_bias as a Mamba-2 layer passes them: one group, dt before its bias and
    softplus, A, D and dt_bias in float32, the rest in dtype."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    rand = lambda *shape, dt=dtype: torch.randn(*shape, device=DEVICE, generator=g).to(dt)  # noqa: E731
    x, z = rand(batch, length, heads, head_dim), rand(batch, length, heads, head_dim)
    dt = rand(batch, length, heads) - 2.0                           # softplus(dt + bias) about 0.1
    B, C = rand(batch, length, 1, n_states), rand(batch, length, 1, n_states)
    A = -torch.rand(heads, device=DEVICE, generator=g) * 4 - 1      # decays of -1 to -5 per unit step
    D, dt_bias = rand(heads, dt=torch.float32), rand(heads, dt=torch.float32) * 0.1
    return x, dt, A, B, C, D, z, dt_bias


def ssd_head_slice(inputs, heads):
    """The inputs of batch element 0 and the first heads, in float64 (one group: B and C are shared)."""
    x, dt, A, B, C, D, z, dt_bias = inputs
    return (x[:1, :, :heads].double(), dt[:1, :, :heads].double(), A[:heads].double(), B[:1].double(),
            C[:1].double(), D[:heads].double(), z[:1, :, :heads].double(), dt_bias[:heads].double())


def ssd_reference(x, dt, A, B, C, D, z, dt_bias, chunk_size):
    """Chapter 10's float64 chunked form with the options composed as the op documents them."""
    y, _ = ssd_chunked(x, torch.nn.functional.softplus(dt + dt_bias), A, B, C, chunk_size, D)
    return y * torch.nn.functional.silu(z)


def ssd_bytes(x, dt, B, backward):
    """Bytes that must move: read x, z, dt, B, C, write y; the backward reads them again and dy and
    writes dx, dz, d dt, dB, dC."""
    reads = 2 * x.nbytes + dt.nbytes + 2 * B.nbytes
    fwd = reads + x.nbytes
    return fwd + (reads + x.nbytes + reads) if backward else fwd


def bench_ssd(bandwidth, quick):
    peer, reason = mamba_ssm_chunk_scan()
    if peer is None:
        missing("ssd", "mamba_ssm mamba_chunk_scan_combined", reason)
    chunk, heads_checked = SIZES["ssd_chunk"], SIZES["ssd_check_heads"]
    shapes = SIZES["ssd"] + ([] if quick else SIZES["ssd_more"])
    fn = {"scan_lib.mamba_chunk_scan_combined": scan_lib.mamba_chunk_scan_combined}
    if peer is not None:
        fn["mamba_ssm mamba_chunk_scan_combined"] = peer
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            inputs = ssd_inputs(*shape, dtype)
            x, dt, A, B, C, D, z, dt_bias = inputs
            grad = torch.randn_like(x)
            sliced = ssd_head_slice(inputs, heads_checked)
            want = ssd_reference(*sliced, chunk)
            sliced_leaves = [t.detach().requires_grad_() for t in sliced]
            sliced_grad = grad[:1, :, :heads_checked]
            want_grads = torch.autograd.grad(ssd_reference(*sliced_leaves, chunk), sliced_leaves, sliced_grad.double())
            for impl, f in fn.items():
                # float32: ours multiplies at float32's precision (tf32x3), mamba_ssm in TF32 (section 9 of chapter
                # 10): its rows are timed within TF32's error, as record_blocks does for the blocks
                tol = (1e-4 if impl.startswith("scan_lib") else 5e-3) if dtype == torch.float32 else 2e-2

                def call(f=f, args=inputs):
                    x, dt, A, B, C, D, z, dt_bias = args
                    return f(x, dt, A, B, C, chunk, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
                with torch.no_grad():
                    record("ssd", shape, dtype, "fwd", impl, call,
                           lambda call=call: rel_err([call()[:1, :, :heads_checked]], [want]), tol,
                           ssd_bytes(x, dt, B, False) / bandwidth * 1e6)
                leaves = [t.detach().requires_grad_() for t in inputs]
                both = lambda call=call, leaves=leaves: torch.autograd.grad(call(args=leaves), leaves, grad)  # noqa: E731

                def check(call=call):   # the gradients on the slice, inputs in their original dtypes
                    small = [t.detach().to(orig.dtype).requires_grad_() for t, orig in zip(sliced, inputs)]
                    return rel_err(torch.autograd.grad(call(args=small), small, sliced_grad), want_grads)
                record("ssd", shape, dtype, "fwd+bwd", impl, both, check, tol if dtype == torch.float32 else 5e-2,
                       ssd_bytes(x, dt, B, True) / bandwidth * 1e6)


def bench_conv(bandwidth, quick):
    """causal_conv1d, width 4, bias, SiLU, as the Mamba block calls it. The check is float64 F.conv1d on
    the first channels of batch element 0 (depthwise: a channel's output needs only its own input), not
    the peer: causal-conv1d's gradients were seen about 1e-2 off at lengths such as 4097."""
    peer, reason = causal_conv1d_peer()
    if peer is None:
        missing("causal_conv1d", "causal-conv1d causal_conv1d_fn", reason)
    fn = {"scan_lib.causal_conv1d": scan_lib.causal_conv1d}
    if peer is not None:
        fn["causal-conv1d causal_conv1d_fn"] = peer
    channels = SIZES["conv_check_channels"]
    for shape, dtype in SIZES["conv"] + ([] if quick else SIZES["conv_more"]):
        g = torch.Generator(device=DEVICE).manual_seed(0)
        x = torch.randn(shape, device=DEVICE, generator=g).to(dtype)
        weight, bias = (torch.randn(*s, device=DEVICE, generator=g).to(dtype) for s in ((shape[1], 4), (shape[1],)))
        grad = torch.randn_like(x)
        sliced = [x[:1, :channels].double(), weight[:channels].double(), bias[:channels].double()]
        want = [causal_conv1d_ref(*sliced, activation="silu")]
        sliced_leaves = [t.detach().requires_grad_() for t in sliced]
        want_grads = torch.autograd.grad(causal_conv1d_ref(*sliced_leaves, activation="silu"), sliced_leaves,
                                         grad[:1, :channels].double())
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for impl, f in fn.items():
            call = lambda f=f, args=(x, weight, bias): f(*args, activation="silu")  # noqa: E731
            with torch.no_grad():
                record("causal_conv1d", shape, dtype, "fwd", impl, call,
                       lambda call=call: rel_err([call()[:1, :channels]], want), tol, 2 * x.nbytes / bandwidth * 1e6)
            leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
            both = lambda call=call, leaves=leaves: torch.autograd.grad(call(args=leaves), leaves, grad)  # noqa: E731

            def check(call=call):   # the gradients on the slice, inputs in their original dtypes
                small = [t.detach().to(orig.dtype).requires_grad_() for t, orig in zip(sliced, (x, weight, bias))]
                return rel_err(torch.autograd.grad(call(args=small), small, grad[:1, :channels]), want_grads)
            record("causal_conv1d", shape, dtype, "fwd+bwd", impl, both, check,
                   tol if dtype == torch.float32 else 5e-2, 5 * x.nbytes / bandwidth * 1e6)   # + x, dout read, dx written


def bench_host(bandwidth, quick):
    """Each public op's host path on empty inputs (nothing reaches a kernel), beside torch's op for the
    same input: benchmarks/host_time.py's calls, issue 21's target of at most 30 us per call."""
    spec = importlib.util.spec_from_file_location("host_time", Path(__file__).resolve().parent / "host_time.py")
    host_time = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_time)
    for mode, calls in (("empty", host_time.empty_calls(False)), ("empty, grad", host_time.empty_calls(True))):
        for name, (ours, theirs) in calls.items():
            for impl, fn in (("scan_lib", ours), ("torch", theirs)):
                if fn is None:
                    continue
                us = host_time.median_host_us(fn, SIZES["host_calls"])
                ROWS.append(dict(workload=f"host {name}", shape="", dtype="float32", mode=mode, impl=impl,
                                 rel_err="", correct="", floor_us=math.nan, call_us=round(us, 1), gpu_us=math.nan,
                                 host_us=round(us, 1)))
                print(f"  host {name:18s} {mode:12s} {impl:9s} {us:8.1f} us per call", flush=True)


# ---------------------------------------------------------------- report

def environment():
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    import triton
    return dict(gpu=torch.cuda.get_device_name(), driver=driver, torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat())


def add_ratios():
    """ratio = peer gpu_us / scan_lib gpu_us for the same workload, shape, dtype and mode (above 1: scan_lib faster)."""
    ours = {(r["workload"], r["shape"], r["dtype"], r["mode"]): r for r in ROWS if r["impl"].startswith("scan_lib")}
    for row in ROWS:
        mine = ours.get((row["workload"], row["shape"], row["dtype"], row["mode"]))
        basis = "gpu_us" if row.get("mode") == "fwd" else "call_us"   # fwd+bwd is not graph-replayed
        row["ratio_basis"] = basis
        row["ratio_vs_scan_lib"] = ("" if mine is None or row is mine or not isinstance(row.get(basis), float) else
                                    round(row[basis] / mine[basis], 2))
        floor, time = row.get("floor_us"), row.get(basis)
        row["pct_of_floor"] = (round(100 * floor / time, 1) if isinstance(floor, float) and math.isfinite(floor)
                               and isinstance(time, float) and math.isfinite(time) else "")


def write_csv(env):
    model = re.search(r"[A-Z]+\d{2,}", env["gpu"])   # "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H200" -> h200
    name = model.group(0) if model else env["gpu"].split()[-1]
    out = ROOT / "benchmarks" / "results" / f"bench_{name.lower()}_{env['date']}.csv"
    fields = list(env) + ["workload", "shape", "dtype", "mode", "impl", "correct", "rel_err", "call_us", "gpu_us",
                          "host_us", "floor_us", "pct_of_floor", "ratio_vs_scan_lib", "ratio_basis", "note"]
    with out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fields)
        writer.writeheader()
        for row in ROWS:
            writer.writerow({**env, **row})
    return out


def plot(env):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scan_lib.runtime import save_figure
    rows = [r for r in ROWS if r["workload"] == "selective_scan full" and r["dtype"] == "bfloat16"
            and r["mode"] == "fwd+bwd" and math.isfinite(r.get("call_us", math.nan))]   # not graph-replayed
    base, wide, long = SIZES["selective"], SIZES["selective_batch"][1], SIZES["selective_batch"][2]
    for axis, index, name, fixed in (("L", 2, "length", lambda s: s[:2] == base[:2] and s[3] == base[3]),
                                     ("N", 3, "states", lambda s: s[:3] == base[:3]),
                                     ("batch", 0, "batch", lambda s: s[1:3] == (wide, long))):
        series = {impl: sorted((r["shape"][index], r["call_us"]) for r in rows if r["impl"] == impl and fixed(r["shape"]))
                  for impl in sorted({r["impl"] for r in rows})}
        series = {impl: points for impl, points in series.items() if len(points) > 1}
        if not series:   # --quick: one point per line, nothing to plot against
            continue
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for impl, points in series.items():
            ax.loglog(*zip(*points), "o-", label=impl)
        ax.set(xlabel=axis, ylabel="time per call (us)", title=f"selective scan fwd+bwd, bf16, {env['gpu']}")
        ax.legend(fontsize=8)
        save_figure(fig, f"bench_selective_scan_{name}.png")


def print_table():
    print(f"\n{'workload':20s} {'shape':22s} {'dtype':9s} {'mode':8s} {'impl':28s} {'gpu_us':>9s} {'call_us':>9s} "
          f"{'host_us':>8s} {'floor':>7s} {'%floor':>7s} {'peer/ours':>9s}")
    for r in ROWS:
        if r.get("note"):
            print(f"{r['workload']:20s} {str(r['shape']):22s} {r['dtype']:9s} {r['mode']:8s} {r['impl']:28s} {r['note']}")
            continue
        print(f"{r['workload']:20s} {str(r['shape']):22s} {r['dtype']:9s} {r['mode']:8s} {r['impl']:28s} {r['gpu_us']:9.1f} "
              f"{r['call_us']:9.1f} {r['host_us']:8.1f} {r['floor_us']:7.1f} {str(r['pct_of_floor']):>7s} "
              f"{str(r['ratio_vs_scan_lib']):>9s}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the base shapes only")
    parser.add_argument("--only", default="cumsum,linear_scan,selective_scan,block,mamba2,ssd,conv,host")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("make bench needs a CUDA GPU (the interpreter's timings mean nothing)")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False   # full float32 in cuBLAS and cuDNN (F.conv1d)
    env = environment()
    bandwidth = copy_bandwidth()
    print(f"{env}; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    benches = dict(cumsum=bench_cumsum, linear_scan=bench_linear_scan, selective_scan=bench_selective_scan,
                   block=bench_block, mamba2=bench_mamba2, ssd=bench_ssd, conv=bench_conv, host=bench_host)
    failed = []
    for name in args.only.split(","):
        print(f"== {name}")
        try:
            benches[name](bandwidth, args.quick)
        except Exception:  # noqa: BLE001 (report it, finish the other workloads, exit non-zero)
            traceback.print_exc()
            failed.append(name)
    add_ratios()
    print_table()
    print(f"\nwrote {write_csv(env)}")
    plot(env)
    checked = [r for r in ROWS if r["impl"].startswith("scan_lib") and not r["workload"].startswith("host")]
    if failed or not all(r["correct"] is True for r in checked):   # host rows time empty calls: nothing to check
        sys.exit(f"make bench: errors in {failed or 'a correctness check'} (see above)")


if __name__ == "__main__":
    main()
