# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · Performance: finding the floor, profiling, and making the selective scan faster
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/scan-course/scans-the-hard-way/blob/main/notebooks/07_performance.ipynb)
#
# Chapter 05 ended with a kernel that is correct but slower than `mamba_ssm`'s in training on a
# block's bf16 views, and a list of guesses about where the time goes. This chapter replaces guesses
# with measurements. You will learn:
#
# 1. how to find a kernel's **floors**: its bytes and `exp`s over rates measured on this GPU;
# 2. how to **profile** a training step with `torch.profiler`;
# 3. the optimisations **one at a time**, each with its idea, its change and its measured effect:
#    reading strided views in place, a leaner backward, and segments and several states per step for
#    long sequences at small batch;
# 4. where the result stands against `mamba_ssm`.
#
# The kernels become `scan_lib.selective_scan`; "Going deeper" holds the rest of their code, the
# checks and the details. Without a GPU the kernels run on Triton's interpreter and the timing cells
# are skipped.

# %%
# Setup, the same in every chapter. On Colab, install scan_lib (Colab already has torch and triton).
# Importing scan_lib comes first: without a GPU it switches Triton to its CPU interpreter,
# which must happen before any @triton.jit function is defined.
import subprocess, sys
if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "git+https://github.com/scan-course/scans-the-hard-way"], check=True)
import scan_lib
from scan_lib.runtime import DEVICE, ON_GPU
print(scan_lib.runtime.describe())

# %%
#| default_exp fast_selective_scan

# %%
import functools
import math
import sys

import matplotlib
import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

from scan_lib.ema import first_order_op
from scan_lib.mamba import positions_last   # chapter 06: a projection's (C, batch L) output as (batch, C, L)
from scan_lib.runtime import save_figure
from scan_lib.selective_scan import discretize, selective_scan_ref

matplotlib.use("Agg")
chapter05 = sys.modules["scan_lib.selective_scan"]   # the module (scan_lib.selective_scan is a function)
selective_scan_05 = chapter05.selective_scan

# %% [markdown]
# ## 1. The floors
#
# A kernel cannot be faster than its slowest resource. For the selective scan at Mamba's usual layer
# size (batch 8, dim 1024, $L$ 2048, $N$ 16) two matter:
#
# * **Memory.** The forward reads $u$, $\Delta$, $z$, $B$ and $C$ and writes the output; those bytes
#   over the copy bandwidth (measured by copying 1 GiB) are the **memory floor**.
# * **Special functions.** Every (batch, channel, position, state) element needs $a = e^{\Delta A}$:
#   268 million `exp`s in the forward, on a special-function unit with a fraction of the arithmetic
#   units' throughput. The count over the `exp` rate measured below is the second floor.
#
# The arithmetic units (about 67 TFLOP/s in fp32 on an H100, NVIDIA's figure) do about 18 operations
# for each `exp` at that rate, so an efficient kernel sits near the larger floor.

# %%
@triton.jit
def exp_rate_kernel(X, Y, REPEATS: tl.constexpr, BLOCK: tl.constexpr):
    """Y = sum of four chains x <- exp(-x), REPEATS steps each, per element: nothing but exps to do."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x0 = tl.load(X + offs)
    x1, x2, x3 = x0 + 1.0, x0 + 2.0, x0 + 3.0
    for _ in range(REPEATS):
        x0, x1, x2, x3 = tl.exp(-x0), tl.exp(-x1), tl.exp(-x2), tl.exp(-x3)
    tl.store(Y + offs, x0 + x1 + x2 + x3)


def exp_rate(programs=4096, block=256, repeats=256):
    """exps per second on this GPU, from the kernel above."""
    from scan_lib.runtime import median_us
    x = torch.rand(programs * block, device=DEVICE)
    y = torch.empty_like(x)
    us = median_us(lambda: exp_rate_kernel[(programs,)](x, y, REPEATS=repeats, BLOCK=block))
    return programs * block * repeats * 4 / (us * 1e-6)


def selective_floors(batch, dim, length, n_states, size, bandwidth, exps_per_s, backward=False):
    """(memory floor, exp floor) in microseconds. Forward: read u, delta, z, B, C, write out; exps: one per
    (batch, channel, position, state). The backward reads those and dout again, writes du, d delta, dz,
    dB, dC, and evaluates one exp per element (a_t; a_{t+1} is the next position's a: section 4): with
    backward, the floors of a training step, both passes' bytes and two exps per element."""
    ### BEGIN SOLUTION
    ### HINT: count the bytes (batch x dim x L tensors, batch x N x L tensors, `size` bytes a value) and the exps; with backward, the bytes of both passes and the backward's exps; divide by bandwidth and exps_per_s, in microseconds
    big, small = batch * dim * length * size, batch * n_states * length * size
    fwd_bytes, fwd_exps = 4 * big + 2 * small, batch * dim * length * n_states
    if backward:
        return ((fwd_bytes + 7 * big + 4 * small) / bandwidth * 1e6, 2 * fwd_exps / exps_per_s * 1e6)
    return fwd_bytes / bandwidth * 1e6, fwd_exps / exps_per_s * 1e6
    ### END SOLUTION


if not ON_GPU:
    print("skipped: needs a GPU")
else:
    from scan_lib.runtime import copy_bandwidth
    bandwidth, exps_per_s = copy_bandwidth(), exp_rate()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"exp rate {exps_per_s / 1e12:.2f} T exp/s")
    for size, name in ((4, "float32"), (2, "bfloat16")):
        for backward in (False, True):
            memory, exps = selective_floors(8, 1024, 2048, 16, size, bandwidth, exps_per_s, backward)
            print(f"(8, 1024, 2048, N=16) {name:8s} {'fwd+bwd' if backward else 'fwd':7s}: "
                  f"memory floor {memory:6.0f} us, exp floor {exps:6.0f} us")

# %% [markdown]
# (On a GPU.) At $N = 16$ the memory floor is the larger in fp32 and the `exp` floor in bf16: bf16's
# halved bytes lower the binding floor only to the `exp`s' (90 to 74 µs forward on this run's H100).
# Chapter 05's kernel takes almost the same time forward in fp32 and bf16 (section 6's table: 690
# against 612 µs on the views), while `mamba_ssm`'s roughly halves (chapter 05's benchmark): ours is
# limited by the instructions it issues, far above both floors.
#
# ## 2. Where the time goes: the profiler
#
# `torch.profiler` records every kernel the GPU runs and its duration ("Going deeper: profiling tools
# on this GPU" lists others). We profile one training step of
# chapter 05's scan as chapter 06's Mamba block calls it: $u$, $\Delta$, $z$, $B$ and $C$ are
# (batch, channels, $L$) views of (features, batch $\cdot$ L) matrices (`positions_last`), stride 1
# along $L$ but not contiguous.

# %%
def block_layout_inputs(batch, dim, length, n_states, dtype, seed=0):
    """u, delta, A, B, C, D, z, delta_bias as chapter 06's Mamba block passes them: u, delta and z
    (batch, dim, L) views of (dim, batch L) matrices, B and C rows of one (R + 2N, batch L) matrix,
    x_proj's output (R = dim / 32, the block's dt rank); A, D, delta_bias fp32."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, device=DEVICE, generator=g)  # noqa: E731
    as_block = lambda flat: positions_last(flat, batch, length)  # noqa: E731  (C, batch L) -> (batch, C, L)
    u, delta, z = (as_block(rand(dim, batch * length).to(dtype)) for _ in range(3))
    rank = max(1, dim // 32)
    x_dbl = rand(rank + 2 * n_states, batch * length).to(dtype)
    B, C = as_block(x_dbl[rank:rank + n_states]), as_block(x_dbl[rank + n_states:])
    A = -(0.5 + torch.rand(dim, n_states, device=DEVICE, generator=g))
    return u, delta, A, B, C, rand(dim), z, rand(dim) * 0.1 - 1.0


def training_step(scan, inputs):
    """One forward+backward of `scan` on leaves made from inputs; returns the gradients."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = scan(*leaves, delta_softplus=True)
    return torch.autograd.grad(out, leaves, torch.ones_like(out))


def kernel_times(fn, calls=5):
    """GPU time per kernel name per call of fn, from torch.profiler's CUDA timeline, largest first."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {e.key: e.self_device_time_total / calls for e in events}


def profile_table(fn, rows=8):
    """Print and return the GPU time per kernel name of one call of fn (kernel_times)."""
    times = kernel_times(fn)
    total = sum(times.values())
    print(f"{'kernel':60s} {'share':>6s} {'us per step':>12s}")
    for name, us in list(times.items())[:rows]:
        print(f"{name[:60]:60s} {us / total:6.1%} {us:12.0f}")
    print(f"{'all kernels':60s} {1:6.0%} {total:12.0f}")
    return times


if not ON_GPU:
    print("skipped: needs a GPU")
else:
    strided = block_layout_inputs(8, 1024, 2048, 16, torch.bfloat16)
    print("chapter 05's selective_scan, one training step, (8, 1024, 2048, N=16) bf16, block layout")
    profile_05 = profile_table(lambda: training_step(selective_scan_05, strided))

# %% [markdown]
# (On a GPU.) Three kinds of work show up: the backward, the forward, and copies
# (`elementwise`, `copy_` or `contiguous` kernels) of each strided view, made by chapter 05's launcher
# before each pass: pure overhead. The backward dominates.
#
# ## 3. First optimisation: read the views in place
#
# **Prediction.** A copy of a (batch, dim, $L$) bf16 tensor moves $2 \times 2 \cdot 8 \cdot 1024 \cdot 2048$
# bytes (read and written), about 22 µs at the measured bandwidth; removing the copies should save that
# per copy and nothing more.
#
# **The change.** Each pointer gets its strides (batch, channel, position) instead of assuming
# `(dim * L, L, 1)` (the loads of `u` and `delta` below; "Going deeper: why strides and not
# `.contiguous()`"), and $B$ and $C$ get four (batch, group, state, position). Offsets are 64-bit, so
# inputs past $2^{31}$ elements work.
#
# The kernel below, otherwise chapter 05's forward, is the final one, with section 4's instruction cuts
# (`discretize_exp2`, `step_u`, the carries in `LAST`), section 5's segments (`H0`, `SUMMARY`) and
# states per step (`UNROLL`), and the states it keeps for the backward (`SAVE`, `SAVE_EVERY`).

# %%
#| export
"""The selective scan (S6) tuned in chapter 07: strided inputs read in place, a leaner backward.
scan_lib.selective_scan is this module's selective_scan."""
import torch
import triton
import triton.language as tl

from scan_lib.ema import accumulator_dtype, first_order_op
from scan_lib.runtime import INTERPRET
from scan_lib.selective_scan import _column, _gate_dybar, _gate_dz, _load_delta


@triton.jit
def _program_indices(BLOCK_D: tl.constexpr):
    """The program's batch element (64-bit, so that every offset computed from it is: tensors past 2^31
    elements work), its first channel and its channels (BLOCK_D)."""
    first_d = tl.program_id(1) * BLOCK_D
    return tl.program_id(0).to(tl.int64), first_d, first_d + tl.arange(0, BLOCK_D)


@triton.jit
def _segment_chunks(seg_chunks, n_chunks):
    """The chunks [first, end) of this program's segment (program axis 2), and the number of segments."""
    pid_s = tl.program_id(2)
    return pid_s, tl.num_programs(2), pid_s * seg_chunks, tl.minimum(pid_s * seg_chunks + seg_chunks, n_chunks)


@triton.jit
def _coef_row(M, base, n, ds, d_ok, t, t_ok, stride_g, stride_n, stride_l, PER_STEP: tl.constexpr,
              ACC: tl.constexpr):
    """State n's coefficient B or C: the group's row at positions t (1 x CHUNK; base: the group's start),
    or the time-invariant M[d, n] (BLOCK_D x 1; channel d at d * stride_g). The row is loaded as a
    1 x CHUNK tile, in the layout of the tiles it meets (a 1-D load would need a layout conversion)."""
    if PER_STEP:
        coef = tl.load(M + base + n * stride_n + t[None, :] * stride_l, t_ok[None, :], other=0.0).to(ACC)
    else:
        coef = tl.load(M + ds * stride_g + n * stride_n, d_ok, other=0.0).to(ACC)[:, None]
    return coef


LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)   # exp(x) = 2^(x log2 e)


@triton.jit
def discretize_exp2(delta, rate2, B, step_u):
    """Chapter 05's discretize with A pre-scaled by log2(e) (rate2 = A log2 e) and delta*u given:
    a = 2^(delta*rate2) = exp(delta*A), one MUFU.EX2 instruction on the GPU; b = (delta*u)*B."""
    return tl.exp2(delta * rate2), step_u * B


@triton.jit
def _carry_in(CARRY, n, n_segments, d_ok):
    """State n's carry for the block's channels (BLOCK_D), where the last chunk stored it."""
    return tl.load(CARRY + n * n_segments, d_ok, other=0.0)


@triton.jit
def strided_fwd_kernel(
    U, DELTA, A, B, C, D, Z, BIAS, H0,     # u, delta, z: any strides (b, d, L); A (d, N); B, C (b, g, N, L) or (d, N)
    OUT, STATES, LAST, DSUM,               # OUT: u's layout; contiguous b x d x N x n_saved, b x d x N x S, b x d x S
    dim, length, n_chunks, seg_chunks, per_group_b, per_group_c,
    su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l, sa_d, sa_n,
    sb_b, sb_g, sb_n, sb_l, sc_b, sc_g, sc_n, sc_l, so_b, so_d, so_l,
    N_STATES: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_H0: tl.constexpr, B_PER_STEP: tl.constexpr, C_PER_STEP: tl.constexpr, SOFTPLUS: tl.constexpr,
    ACC: tl.constexpr, SAVE: tl.constexpr, SAVE_EVERY: tl.constexpr, SUMMARY: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, UNROLL: tl.constexpr,
):
    # Program (batch element, block of channels, segment): the segment's chunks, from the state H0 holds
    # for it (S segments: section 5; S = 1 is the whole sequence). SUMMARY: write no output, only the
    # segment's last state and its sum of steps delta (section 5's phase 1).
    pid_b, first_d, ds = _program_indices(BLOCK_D)
    ts = tl.arange(0, CHUNK)
    pid_s, n_segments, k_first, k_end = _segment_chunks(seg_chunks, n_chunks)
    ns = tl.arange(0, BLOCK_N)
    d_ok, n_ok = ds < dim, ns < N_STATES
    dn_ok = d_ok[:, None] & n_ok[None, :]                                 # BLOCK_D x N
    # All channels of the block share one group (the launcher makes sure): one B and C row start each.
    b_base = pid_b * sb_b + (first_d // per_group_b) * sb_g
    c_base = pid_b * sc_b + (first_d // per_group_c) * sc_g
    state_offs = (pid_b * dim + ds[:, None]) * N_STATES + ns[None, :]    # BLOCK_D x N
    if HAS_H0:
        carry = tl.load(H0 + state_offs * n_segments + pid_s, dn_ok, other=0.0).to(ACC)
    else:
        carry = tl.zeros((BLOCK_D, BLOCK_N), dtype=ACC)
    # Between chunks each state's carry waits in LAST, this program's own entries (section 4's last part):
    # state n of the block's channels at CARRY + n * n_segments.
    CARRY = LAST + (pid_b * dim + ds) * N_STATES * n_segments + pid_s     # BLOCK_D
    tl.store(CARRY[:, None] + ns[None, :] * n_segments, carry, dn_ok)
    if HAS_D:
        skip = tl.load(D + ds, d_ok, other=0.0).to(ACC)[:, None]
    # SAVE: the state entering every piece of SAVE_EVERY positions (the backward's chunk), SAVES per chunk,
    # state n of the block's channels at SAVED + n * n_saved + piece.
    SAVES: tl.constexpr = CHUNK // SAVE_EVERY
    n_saved = tl.cdiv(length, SAVE_EVERY)
    SAVED = STATES + (pid_b * dim + ds) * N_STATES * n_saved                # BLOCK_D
    dsum = tl.zeros((BLOCK_D,), dtype=ACC)
    first, last = ts[None, :] == 0, ts[None, :] == CHUNK - 1
    for k in range(k_first, k_end):
        tl.debug_barrier()   # every thread sees the carries the last chunk stored before it reads them
        t = k * CHUNK + ts
        t_ok = t < length
        mask = d_ok[:, None] & t_ok[None, :]                              # BLOCK_D x CHUNK
        ### BEGIN SOLUTION
        ### HINT: load the u tile (BLOCK_D x CHUNK) of batch element pid_b, channels ds, positions t through the strides su_b, su_d, su_l, and delta's through sdt_b, sdt_d, sdt_l (with _load_delta)
        u = tl.load(U + pid_b * su_b + ds[:, None] * su_d + t[None, :] * su_l, mask, other=0.0).to(ACC)
        delta, _ = _load_delta(DELTA, BIAS, pid_b * sdt_b + ds[:, None] * sdt_d + t[None, :] * sdt_l, mask,
                               ds, d_ok, HAS_BIAS, SOFTPLUS, ACC)
        ### END SOLUTION
        dsum += tl.sum(delta, axis=1)                                     # 0 where masked
        step_u = delta * u                                                # shared by the states
        ybar = tl.zeros((BLOCK_D, CHUNK), dtype=ACC)
        for n_first in range(0, N_STATES, UNROLL):   # UNROLL states per step: their scans are independent
            for j in tl.static_range(UNROLL):
                n = n_first + j
                rate = tl.load(A + ds * sa_d + n * sa_n, d_ok, other=0.0).to(ACC)[:, None]      # BLOCK_D x 1
                h_in = _carry_in(CARRY, n, n_segments, d_ok)                                    # BLOCK_D
                if SAVE:  # the state entering chunk k (its first piece), for the backward
                    tl.store(SAVED + n * n_saved + k * SAVES, h_in, d_ok)
                b_coef = _coef_row(B, b_base, n, ds, d_ok, t, t_ok, sb_g, sb_n, sb_l, B_PER_STEP, ACC)
                if not SUMMARY:
                    c_coef = _coef_row(C, c_base, n, ds, d_ok, t, t_ok, sc_g, sc_n, sc_l, C_PER_STEP, ACC)
                a, b = discretize_exp2(delta, rate * LOG2E, b_coef, step_u)                  # BLOCK_D x CHUNK
                b += tl.where(first, a * h_in[:, None], 0.0)                                 # start from the carry
                _, h = tl.associative_scan((a, b), axis=1, combine_fn=first_order_op)
                if SAVE:  # the states entering the chunk's other pieces: the tile's last state before each
                    for r in tl.static_range(1, SAVES):
                        entering = tl.sum(tl.where(ts[None, :] == r * SAVE_EVERY - 1, h, 0.0), axis=1)
                        if k * SAVES + r < n_saved:   # the last chunk may hold fewer pieces
                            tl.store(SAVED + n * n_saved + k * SAVES + r, entering, d_ok)
                if not SUMMARY:
                    ybar += c_coef * h
                tl.store(CARRY + n * n_segments, tl.sum(tl.where(last, h, 0.0), axis=1), d_ok)
        if not SUMMARY:
            if HAS_D:
                ybar += skip * u
            out = ybar
            if HAS_Z:
                zv = tl.load(Z + pid_b * sz_b + ds[:, None] * sz_d + t[None, :] * sz_l, mask, other=0.0).to(ACC)
                out = ybar * zv * tl.sigmoid(zv)
            tl.store(OUT + pid_b * so_b + ds[:, None] * so_d + t[None, :] * so_l, out.to(OUT.dtype.element_ty),
                     mask)
    if SUMMARY:
        tl.store(DSUM + (pid_b * dim + ds) * n_segments + pid_s, dsum, d_ok)

# %%
# The rest of this chapter's module (the backward kernel, section 5's phases, the launchers and the
# public function) is in "Going deeper"; until there, the cells call it from scan_lib, where it is exported.
selective_scan = scan_lib.selective_scan

# %% [markdown]
# ## 4. Second optimisation: a leaner backward
#
# Two things in chapter 05's backward cost more than they need to.
#
# **$\bar y$ was saved.** The gate's gradient needs $\bar y$, which chapter 05's forward wrote to
# memory. But the backward recomputes every $h_t$ anyway, so $\bar y_t = \sum_n C_{t,n} h_{t,n} + D
# u_t$ costs one multiply-add per element. **Prediction:** about 44 µs saved at the measured bandwidth
# (64 MiB of fp32 written, then read), and 64 MiB less kept alive between the passes.
#
# **No reverse scan, one `exp` per element.** Chapter 05's backward scans twice per state, for
# $h_{t-1}$ and for the adjoint $\lambda_t = C_t \partial\mathcal L/\partial \bar y_t +
# a_{t+1}\lambda_{t+1}$ (`reverse=True`), with three `exp`s per element; and Triton 3.6 runs
# `reverse=True` by moving every register across the warp's lanes, many lane shuffles per element
# and state (`benchmarks/NOTES_selective_scan.md` counts them). This backward gives each thread a *run* of consecutive positions (16 bytes of the input)
# and walks it in registers both ways, taking $h_{t-1}$ and $a_{t+1}$ from the neighbouring item; only
# the runs' summaries, one register per thread, cross the lanes ("Going deeper: the backward kernel").
#
# ### Fewer instructions per position and state
#
# Instructions per (position, state), not bytes, limit these kernels (section 1). Both drop three
# kinds that do no arithmetic the recurrence needs (see the forward above):
#
# * **The carry in a tile.** Reading and writing state $n$'s carry in a (`BLOCK_D`, $N$) register tile
#   costs a masked sum and a select over the tile. The carries now wait in memory (`LAST`, `_carry_in`).
# * **`exp` as two instructions.** With $A$ multiplied by $\log_2 e$ once per state
#   (`discretize_exp2`), each gate is one multiply and one `MUFU.EX2`.
# * **$\Delta u$ once per position** (`step_u`), outside the loop over states.
#
# **Prediction.** Far fewer instructions per (position, state), counted in the machine code ("Going
# deeper: the backward kernel"), so, if instructions bind, as much faster. Section 6 measures it.

# %% [markdown]
# ## 5. Third optimisation: long sequences at small batch
#
# Each program owns one (batch element, block of channels) and walks the whole sequence. At batch 1
# and 1536 channels that is about 12 one-warp programs per multiprocessor of an H100, which could hold
# 32: the GPU is mostly idle and needs more programs, or more independent work in each.
#
# **Segments.** Like chapter 01's blocked scan, the recurrence splits in three phases. Started from
# any state $h$, a segment of positions $t_s \le t < t_{s+1}$ ends at $e^{A \Sigma_s} h + \hat h_s$,
# where $\Sigma_s$ is its sum of steps and $\hat h_s$ where it ends from 0: one step of the same kind.
# Phase 1 runs every segment from 0 at once and writes $\hat h_s$ and $\Sigma_s$ (the forward with
# `SUMMARY`); phase 2 scans the $S$ pairs with chapter 03's `linear_scan`; phase 3 runs every segment
# again from its entering state (`H0`). The backward splits the same way ("Going deeper: segments in
# the backward").
#
# **Prediction:** phase 1 adds about half the work, so where programs were short of the GPU by a factor
# of three, the time should still fall nearly twofold. **Measured** ("Going deeper: segments and states
# per step, measured"): it failed. Phase 1 costs almost as much as phase 3, so a split roughly doubles
# the work, and in the recorded run every split is slower than one segment, at batch 1 too, forward
# and training step alike. `selective_scan` keeps one segment; the split stays, checked,
# because chapter 09 spreads a sequence over GPUs with the same phases.
#
# **States per step.** A state's scan is a chain of dependent instructions, and with a dozen warps per
# multiprocessor there is rarely one ready while another waits. The states are independent, so the
# forward takes `UNROLL` of them per step (the `tl.static_range(UNROLL)` above: the compiler
# interleaves their instructions), and one channel per program. The price is registers, which limit
# how many warps fit, so `states_per_step` reads how many pay from a table measured on an H100.
#
# **Prediction:** at batch 1 perhaps twice faster, at batch 8 little change. **Measured** (the same
# Going deeper section, four sizes): far from twice; the forward at batch 1 takes 2240 µs with two
# states per step, 2380 with one, 2728 as it was before this section.
#
# "Going deeper: the checks" tests these kernels against chapter 05's float64 reference.

# %% [markdown]
# ## 6. Measured: each optimisation's effect
#
# (GPU only.) The profile's training step, and the forward alone, for chapter 05's scan and this
# chapter's, on strided views and contiguous tensors, in fp32 and bf16; then the new step's profile.

# %%
if not ON_GPU:
    print("skipped: needs a GPU")
else:
    from scan_lib.runtime import median_us

    def contiguous_copy(inputs):
        return [t.contiguous() for t in inputs]

    def inference(scan, inputs):
        with torch.no_grad():
            return scan(*inputs, delta_softplus=True)

    effects = []
    print(torch.cuda.get_device_name(), "(batch, dim, L, N) = (8, 1024, 2048, 16); median us (do_bench)")
    print(f"{'dtype':9s} {'layout':10s} {'pass':8s} {'chapter 05':>10s} {'chapter 07':>10s} {'saved':>7s}")
    for dtype in (torch.float32, torch.bfloat16):
        views = block_layout_inputs(8, 1024, 2048, 16, dtype)
        for layout, inputs in (("strided", views), ("contiguous", contiguous_copy(views))):
            for name, run in (("fwd", inference), ("fwd+bwd", training_step)):
                old = median_us(lambda: run(selective_scan_05, inputs))
                new = median_us(lambda: run(selective_scan, inputs))
                effects.append(dict(dtype=dtype, layout=layout, name=name, old=old, new=new))
                print(f"{str(dtype)[6:]:9s} {layout:10s} {name:8s} {old:10.0f} {new:10.0f} {1 - new / old:7.1%}")
    print()
    def effect(dtype, layout, name):
        return next(e for e in effects if e["dtype"] == dtype and e["layout"] == layout and e["name"] == name)
    # the one finding asserted: bf16 on the block's views, where both the copies and the instructions go
    assert effect(torch.bfloat16, "strided", "fwd")["new"] < effect(torch.bfloat16, "strided", "fwd")["old"] / 1.3
    print("chapter 07's selective_scan, one training step, bf16, block layout")
    strided = block_layout_inputs(8, 1024, 2048, 16, torch.bfloat16)
    profile_07 = profile_table(lambda: training_step(selective_scan, strided))

# %% [markdown]
# (On a GPU.) Chapter 07's column has all of this chapter's changes, so each row mixes their effects:
#
# * **Strided views, forward.** No copies, fewer instructions: in bf16 the cell asserts at least 1.3x
#   less time (284 against 612 µs in the recorded run).
# * **Contiguous inputs, forward.** No copies to save: the instruction cuts and launch parameters, net
#   of the strided indexing: fp32 2.3% slower, bf16 40.1% faster.
# * **Forward+backward.** Recomputing $\bar y$, measured alone before the instruction cuts, made the
#   backward *slower*: its loop is limited by instructions, not bytes. The `saved` column has both
#   changes; the new profile shows no copies and the backward taking most of the time.
#
# The backward's $dB$, $dC$ atomic additions, timed alone, take a large share of it ("Going deeper:
# the atomics"); "Going deeper: ideas that did not pay" lists what else was tried.
#
# ## 7. Against the peers
#
# (GPU only.) Chapter 07's `selective_scan` against chapter 05's and `mamba_ssm`'s `selective_scan_fn`,
# bf16, every option, the block's layout, forward+backward: against $L$ (batch 8, dim 1024, $N$ 16),
# $N$ ($L$ 2048) and batch (dim 1536, $L$ 8192).

# %%
def peers():
    """The implementations to time: name -> function with selective_scan_fn's signature."""
    found = {"chapter 07": selective_scan, "chapter 05": selective_scan_05}
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
        found["mamba_ssm"] = selective_scan_fn
    except ImportError as error:
        print(f"mamba_ssm not importable ({type(error).__name__}): not in the plot")
    return found


if not ON_GPU:
    print("skipped: needs a GPU")
else:
    series = {"L": [(8, 1024, L, 16) for L in (512, 2048, 8192)],
              "N": [(8, 1024, 2048, N) for N in (4, 16, 64)],
              "batch": [(b, 1536, 8192, 16) for b in (1, 2, 4)]}
    times = {}
    for axis, shapes in series.items():
        for shape in shapes:
            inputs = block_layout_inputs(*shape, torch.bfloat16)
            for name, fn in peers().items():
                times[axis, shape, name] = median_us(lambda: training_step(fn, inputs), warmup=5, rep=50)
            print(shape, "  ".join(f"{name} {times[axis, shape, name]:7.0f} us" for name in peers()))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, (axis, shapes) in zip(axes, series.items()):
        position = {"L": 2, "N": 3, "batch": 0}[axis]
        for name in peers():
            ax.plot([s[position] for s in shapes], [times[axis, s, name] / 1e3 for s in shapes], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(axis)
        ax.set_ylabel("fwd+bwd, ms")
    axes[0].legend()
    fig.suptitle(f"selective scan, bf16, block layout, {torch.cuda.get_device_name()}")
    fig.tight_layout()
    save_figure(fig, "07_against_peers.png")

# %% [markdown]
# (On a GPU.) The cell below prints `mamba_ssm`'s time over ours (above 1: ours is faster). In the
# recorded run chapter 07 beats chapter 05 in every row; against `mamba_ssm` ours is faster at the
# base shape (8, 1024, 2048, 16), at $L$ 8192, at $N$ 64 and at batch 4 of dim 1536 (1.21 to 1.27)
# and at batch 1 (1.10), even at batch 2 (1.00), and slower at $L$ 512 and at $N$ 4 (0.74 and 0.68).
# There, with a quarter of the work, our time falls only to a half and two thirds (650 and 834 µs
# against 1304 and 1297 at the base shape) while `mamba_ssm`'s falls to about a third (482 and 568 µs
# against 1584 and 1582): our time there is the host's Python ("Going deeper: the host's share"; `mamba_ssm`'s launchers are
# C++). Along the batch of dim 1536 the kernels set the pace, and our lead is small at batch 1 and gone
# at batch 2, where programs are few: section 5's problem, not solved yet.

# %%
if ON_GPU and any(name == "mamba_ssm" for _, _, name in times):
    for axis, shapes in series.items():
        for shape in shapes:
            ratio = times[axis, shape, "mamba_ssm"] / times[axis, shape, "chapter 07"]
            print(f"{str(shape):22s} forward+backward, mamba_ssm time / chapter 07 time: {ratio:.2f}")
else:
    print("skipped: needs a GPU and mamba_ssm")

# %% [markdown]
# ## What we built
#
# * Two floors, from bytes and `exp`s over measured rates: at $N = 16$ on the recording's H100 the
#   `exp`s set the higher one in bf16, the bytes in fp32.
# * A profile of chapter 05's training step: copies of strided views, and a backward taking most of
#   the time.
# * `scan_lib.selective_scan`: strided inputs read in place, a leaner backward (no saved $\bar y$, one
#   `exp` per element), fewer instructions per (position, state), several states per step in the
#   forward, and a split into segments, built and checked but not used.
#
# Not done yet: the forward with the same runs; the atomics; a sequence-parallel scan that pays at
# batch 1; the host's time per step, which decides the short rows.

# %% [markdown]
# ## Going deeper: profiling tools on this GPU
#
# * `torch.profiler` (used above) reads CUDA's activity timeline: durations per kernel, no hardware
#   counters, no special permissions. It is enough to find which kernel to work on.
# * Triton's own profiler, `proton`, adds per-kernel metadata (launch grid, bytes) and can instrument
#   regions inside a kernel; `python -m triton.profiler.proton script.py` writes a trace that
#   `proton-viewer` summarises.
# * Nsight Compute gives issued instructions, stall reasons, registers, occupancy and memory traffic
#   per kernel from the GPU's hardware counters: `ncu --clock-control none --profile-from-start off
#   -k regex:strided --section SpeedOfLight --section WarpStateStats --section Occupancy python
#   script.py`, with the script calling `torch.cuda.profiler.start()` and `stop()` around the calls to
#   measure; `--section SourceCounters` attributes instructions to source lines of a Triton kernel.
# * The machine code itself needs no GPU: `triton.compile` of a kernel with
#   `target=GPUTarget("cuda", 90, 32)` runs Triton's bundled `ptxas` on any machine, and the
#   `cuobjdump --dump-sass` beside it prints the SASS. Counting the instructions of the loop over
#   states, divided by the elements each thread holds, gives the instructions per (position, state)
#   that section 4 cuts (`benchmarks/sass_count.py` does this for both kernels; "Going deeper: the
#   backward kernel" runs it); Triton's reverse scan shows up there as lane shuffles (`SHFL.BFLY`).
#
# ## Going deeper: why strides and not `.contiguous()`
#
# A view such as `xz[:, :dim]` of a (batch, 2 dim, L) tensor is "contiguous along $L$" but not
# contiguous: its channel stride is $L$ and its batch stride is $2\,\text{dim}\cdot L$. `.contiguous()`
# makes a copy whenever the strides differ from the packed ones, and autograd keeps the copy alive
# for the backward. Passing strides costs nothing at run time: the kernels compute the same addresses
# with different multipliers, and Triton specialises a stride of 1 so that loads along $L$ stay
# vectorised. A layout with stride 1 along the *channels* (the `layout="channels_last"` case of the checks,
# `(batch, L, dim)` transposed) also works, but each load of a row of positions then touches one float
# per 32-byte sector: correct, and slow. Transpose such inputs once, outside the scan.
#
# Chapter 06's block passes views of (features, batch $\cdot$ L) matrices, and the kernels write `out`,
# `du`, `d delta` and `dz` in `u`'s layout (`like_u`), so the products that read those downstream take
# them without a copy too. $B$ and $C$ are the one input copied when needed: with positions not adjacent
# (a (batch, L, N) tensor's transpose), `positions_adjacent` makes them contiguous, N values per
# position, since the kernels load one state's coefficients along the positions. The time-invariant $B$
# of shape (dim, $N$) is the forward's code with the group stride set to the channel stride and the
# batch and position strides to 0, so one kernel serves both.
#
# ## Going deeper: the backward kernel
#
# Section 4's backward views a chunk as `SEGS` runs of `ITEMS` consecutive positions, one run per
# thread (`ITEMS` positions are 16 bytes of the input: 8 in bf16, 4 in fp32), and splits each
# (`BLOCK_D`, `CHUNK`) tile into `ITEMS` tiles of (`BLOCK_D`, `SEGS`) with `tl.split` (`items_of`),
# which moves no data when each thread already holds its run. Then, per state:
#
# 1. **States, left to right.** Each run from zero gives its summary (the product of its $a$, its
#    last state); a forward `tl.associative_scan` over the `SEGS` summaries, and one `tl.gather` to
#    shift it by a run, give the state entering each run; a second pass through the items gives
#    $a_t h_{t-1}$ and $h_t$ for every position, in registers.
# 2. **The adjoint, right to left.** The same, through the items in reverse order (a Python loop over
#    registers, not a scan): $a_{t+1}$ is the next item's $a_t$, and the next run's first for a run's
#    last item (one `exp` per run). Only the (`BLOCK_D`, `SEGS`) summaries are scanned across the
#    lanes, one register per thread instead of a whole chunk's, and not with `reverse=True`: two
#    `tl.gather`s reverse the runs around a forward scan (`run_adjoints`).
# 3. **The gradients** from the items' values; $dB$ and $dC$ per position are summed over the block's
#    channels and added across programs with atomic additions, as before. The sums over positions
#    ($dA$ per run, $dD$, $d\Delta_{\text{bias}}$) are kept per program through the chunks, then added
#    the same way into totals the launcher zeroes, all in one buffer with $dB$ and $dC$: one
#    zeroing launch before the kernel and no reduction after it.
#
# The instructions the loop over states issues need no GPU to count (the cell after the kernel; "Going
# deeper: profiling tools on this GPU" says how): far fewer per (position, state) than the version with
# two scans and three `exp`s (`benchmarks/NOTES_selective_scan.md` keeps both counts), and no spilled
# registers.

# %%
#| export
@triton.jit
def unpack(x, ITEMS: tl.constexpr):
    """(..., ITEMS) -> the ITEMS tiles (...) of items 0, 1, ...: register renames, no data movement,
    when each thread holds the whole last axis."""
    if ITEMS == 1:
        return (tl.reshape(x, x.shape[:-1]),)
    else:
        even, odd = tl.split(tl.reshape(x, x.shape[:-1] + [ITEMS // 2, 2]))
        evens, odds = unpack(even, ITEMS // 2), unpack(odd, ITEMS // 2)
        items = ()
        for i in tl.static_range(ITEMS // 2):
            items = items + (evens[i], odds[i])
        return items


@triton.jit
def pack(items, ITEMS: tl.constexpr):
    """unpack's inverse: ITEMS tiles (...) -> (..., ITEMS)."""
    if ITEMS == 1:
        return tl.reshape(items[0], items[0].shape + [1])
    else:
        evens = ()
        odds = ()
        for i in tl.static_range(ITEMS // 2):
            evens = evens + (items[2 * i],)
            odds = odds + (items[2 * i + 1],)
        joined = tl.join(pack(evens, ITEMS // 2), pack(odds, ITEMS // 2))
        return tl.reshape(joined, joined.shape[:-2] + [ITEMS])


@triton.jit
def items_of(x, SEGS: tl.constexpr, ITEMS: tl.constexpr):
    """A rows x (SEGS * ITEMS) tile as ITEMS tiles of rows x SEGS: item r of every segment."""
    return unpack(tl.reshape(x, (x.shape[0], SEGS, ITEMS)), ITEMS)


@triton.jit
def positions_of(items, SEGS: tl.constexpr, ITEMS: tl.constexpr):
    """items_of's inverse."""
    x = pack(items, ITEMS)
    return tl.reshape(x, (x.shape[0], SEGS * ITEMS))


@triton.jit
def _coef_items(M, base, n, ds, d_ok, t, t_ok, stride_g, stride_n, stride_l, PER_STEP: tl.constexpr,
                ACC: tl.constexpr, SEGS: tl.constexpr, ITEMS: tl.constexpr):
    """State n's B or C as ITEMS tiles: 1 x SEGS each (per step), or the BLOCK_D x 1 column ITEMS times."""
    coef = _coef_row(M, base, n, ds, d_ok, t, t_ok, stride_g, stride_n, stride_l, PER_STEP, ACC)
    if PER_STEP:
        return items_of(coef, SEGS, ITEMS)
    else:
        same = ()
        for r in tl.static_range(ITEMS):
            same = same + (coef,)
        return same


@triton.jit
def _add_partial(PART, value, mask):
    """PART += value where this program alone writes (its own entries of a per-program partial sum)."""
    tl.store(PART, tl.load(PART, mask, other=0.0) + value, mask)


@triton.jit
def run_states(a, b, h_in, runs, SEGS: tl.constexpr, ITEMS: tl.constexpr):
    """The states of a chunk from its steps (a, b: ITEMS tiles of BLOCK_D x SEGS, item r of every run)
    and the state h_in (BLOCK_D) entering it: (a_t h_{t-1}, h_t) as ITEMS tiles each. Each run from 0
    gives its summary (the product of its a, its last state), a scan over the SEGS summaries and a shift
    by one run the state entering each run, and a second pass through the items the states."""
    run_a, run_h = a[0], b[0]
    for r in tl.static_range(1, ITEMS):
        run_a, run_h = run_a * a[r], a[r] * run_h + b[r]
    run_h = tl.where(runs == 0, run_h + run_a * h_in[:, None], run_h)       # the chunk starts from h_in
    _, run_end = tl.associative_scan((run_a, run_h), axis=1, combine_fn=first_order_op)
    before = tl.gather(run_end, tl.maximum(runs - 1, 0) + tl.zeros(run_end.shape, tl.int32), axis=1)
    h = tl.where(runs == 0, h_in[:, None], before)                         # BLOCK_D x SEGS: entering each run
    ah = ()
    hs = ()
    for r in tl.static_range(ITEMS):
        ah_r = a[r] * h
        h = ah_r + b[r]
        ah, hs = ah + (ah_r,), hs + (h,)
    return ah, hs


@triton.jit
def run_adjoints(gate, c, adj_in, runs, SEGS: tl.constexpr, ITEMS: tl.constexpr):
    """The adjoint of a chunk, right to left: adj_t = c_t + gate_t adj_{t+1} (ITEMS tiles of BLOCK_D x SEGS
    each, gate_t = a_{t+1}), adj_in (BLOCK_D) entering at the chunk's last position; run_states' method
    mirrored (the scan over the runs' summaries runs right to left: reversed by a gather, scanned forward)."""
    c_last = c[ITEMS - 1] + tl.where(runs == SEGS - 1, adj_in[:, None], 0.0)
    run_gate, run_adj = gate[ITEMS - 1], c_last
    for r in tl.static_range(ITEMS - 2, -1, -1):
        run_gate, run_adj = run_gate * gate[r], c[r] + gate[r] * run_adj
    # The runs in reverse order (a gather), a forward scan over them, and the next run's result (a gather
    # that also undoes the reversal): Triton's reverse=True would move every register across the lanes
    # twice instead.
    zero = tl.zeros(run_adj.shape, tl.int32)
    reverse = SEGS - 1 - runs + zero
    _, start = tl.associative_scan((tl.gather(run_gate, reverse, axis=1), tl.gather(run_adj, reverse, axis=1)),
                                   axis=1, combine_fn=first_order_op)      # run SEGS - 1 - i's start at i
    after = tl.gather(start, tl.maximum(SEGS - 2 - runs, 0) + zero, axis=1)  # run j + 1's start
    adj_r = c_last + gate[ITEMS - 1] * tl.where(runs == SEGS - 1, 0.0, after)
    adj = (adj_r,)
    for r in tl.static_range(ITEMS - 2, -1, -1):
        adj_r = c[r] + gate[r] * adj_r
        adj = (adj_r,) + adj
    return adj


@triton.jit
def strided_bwd_kernel(
    U, DELTA, A, B, C, D, Z, BIAS, STATES, DOUT, DLAST,  # as in the forward; DOUT any strides; DLAST b x d x N x S
    DU, DDELTA, DZ, DB, DC,   # u's layout b x d x L (x3); DB, DC fp32 b x g x N x L (atomics) or b x d x N x S x SEGS
    DA_PART, DA, DD, DBIAS, DH0,   # b x d x N x S x SEGS; d x N, d, d (zeroed, atomics); b x d x N x S
    dim, length, n_chunks, seg_chunks, per_group_b, per_group_c,
    su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l, sa_d, sa_n,
    sb_b, sb_g, sb_n, sb_l, sc_b, sc_g, sc_n, sc_l, so_b, so_d, so_l, sg_b, sg_d, sg_l,
    N_STATES: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DLAST: tl.constexpr, B_PER_STEP: tl.constexpr, C_PER_STEP: tl.constexpr, SOFTPLUS: tl.constexpr,
    ACC: tl.constexpr, BLOCK_D: tl.constexpr, SEGS: tl.constexpr, ITEMS: tl.constexpr,
):
    # Program (batch element, block of channels, segment of chunks): the chunks from right to left, the
    # adjoint entering at the right end from DLAST. A chunk is SEGS runs of ITEMS consecutive positions,
    # each run held by one thread; per state, the states run left to right and the adjoint right to left
    # through each run's items in registers, and only the runs' summaries are scanned across threads.
    CHUNK: tl.constexpr = SEGS * ITEMS
    pid_b, first_d, ds = _program_indices(BLOCK_D)
    pid_s, n_segments, k_first, k_end = _segment_chunks(seg_chunks, n_chunks)
    d_ok = ds < dim
    rows = ds[:, None]
    runs = tl.arange(0, SEGS)[None, :]                                  # 1 x SEGS: the runs of a chunk
    run_ok, first_run = d_ok[:, None] & (runs < SEGS), d_ok[:, None] & (runs == 0)
    group_b, group_c = first_d // per_group_b, first_d // per_group_c
    b_base, c_base = pid_b * sb_b + group_b * sb_g, pid_b * sc_b + group_c * sc_g
    db_base = (pid_b * (dim // per_group_b) + group_b) * N_STATES * length     # DB, DC are contiguous
    dc_base = (pid_b * (dim // per_group_c) + group_c) * N_STATES * length
    state_0 = (pid_b * dim + ds) * N_STATES * n_segments + pid_s        # BLOCK_D: state n at + n * n_segments
    ADJ = DH0 + state_0                                                 # the adjoint's carries, as the forward's
    PART = state_0[:, None] * SEGS + runs                               # per-run partial sums: + n * n_segments * SEGS
    for n in range(0, N_STATES):
        adj_carry = tl.zeros((BLOCK_D,), dtype=ACC)
        if HAS_DLAST:
            adj_carry = tl.load(DLAST + state_0 + n * n_segments, d_ok, other=0.0).to(ACC)   # dL/dh at the end
        tl.store(ADJ + n * n_segments, adj_carry, d_ok)
        zero_runs = tl.zeros((BLOCK_D, SEGS), dtype=ACC)
        tl.store(DA_PART + PART + n * n_segments * SEGS, zero_runs, run_ok)
        if not B_PER_STEP:
            tl.store(DB + PART + n * n_segments * SEGS, zero_runs, run_ok)
        if not C_PER_STEP:
            tl.store(DC + PART + n * n_segments * SEGS, zero_runs, run_ok)
    skip = tl.zeros((BLOCK_D,), dtype=ACC)
    if HAS_D:
        skip = tl.load(D + ds, d_ok, other=0.0).to(ACC)
    dD_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    for i in range(0, k_end - k_first):
        tl.debug_barrier()   # the carries the last chunk stored, before they are read
        k = k_end - 1 - i                                               # chunks from right to left
        t = k * CHUNK + tl.arange(0, CHUNK)
        t_ok = t < length
        mask = d_ok[:, None] & t_ok[None, :]                            # BLOCK_D x CHUNK
        u_offs = pid_b * su_b + rows * su_d + t[None, :] * su_l
        delta_offs = pid_b * sdt_b + rows * sdt_d + t[None, :] * sdt_l
        ### BEGIN SOLUTION
        ### HINT: u (BLOCK_D x CHUNK, mask) at u_offs; delta (mask) at delta_offs with _load_delta; delta_after: the step of the position after each run (k * CHUNK + (runs + 1) * ITEMS, BLOCK_D x SEGS, masked past the end), also with _load_delta
        u = tl.load(U + u_offs, mask, other=0.0).to(ACC)
        delta, _ = _load_delta(DELTA, BIAS, delta_offs, mask, ds, d_ok, HAS_BIAS, SOFTPLUS, ACC)
        t_after = k * CHUNK + (runs + 1) * ITEMS
        delta_after, _ = _load_delta(DELTA, BIAS, pid_b * sdt_b + rows * sdt_d + t_after * sdt_l,
                                     d_ok[:, None] & (t_after < length), ds, d_ok, HAS_BIAS, SOFTPLUS, ACC)
        ### END SOLUTION
        dout = tl.load(DOUT + pid_b * so_b + rows * so_d + t[None, :] * so_l, mask, other=0.0).to(ACC)
        grad_offs = pid_b * sg_b + rows * sg_d + t[None, :] * sg_l                # du, d delta, dz: u's layout
        zv = u
        if HAS_Z:
            zv = tl.load(Z + pid_b * sz_b + rows * sz_d + t[None, :] * sz_l, mask, other=0.0).to(ACC)
        dybar = _gate_dybar(dout, zv, HAS_Z)                             # BLOCK_D x CHUNK
        dD_acc += tl.sum(dybar * u, axis=1)
        us, steps_of, dys = items_of(u, SEGS, ITEMS), items_of(delta, SEGS, ITEMS), items_of(dybar, SEGS, ITEMS)
        step_u = ()                                                     # delta * u, shared by the states
        ybar = ()                                                       # recomputed, not kept by the forward
        adj_b_sum = ()                                                  # sum_n adj B
        adj_ah_rate_sum = ()                                            # sum_n adj a h_{t-1} A
        for r in tl.static_range(ITEMS):
            step_u = step_u + (steps_of[r] * us[r],)
            ybar = ybar + (skip[:, None] * us[r],)
            adj_b_sum = adj_b_sum + (tl.zeros((BLOCK_D, SEGS), dtype=ACC),)
            adj_ah_rate_sum = adj_ah_rate_sum + (tl.zeros((BLOCK_D, SEGS), dtype=ACC),)
        for n in range(0, N_STATES):
            rate = tl.load(A + ds * sa_d + n * sa_n, d_ok, other=0.0).to(ACC)[:, None]   # BLOCK_D x 1
            rate2 = rate * LOG2E
            b_coef = _coef_items(B, b_base, n, ds, d_ok, t, t_ok, sb_g, sb_n, sb_l, B_PER_STEP, ACC, SEGS, ITEMS)
            c_coef = _coef_items(C, c_base, n, ds, d_ok, t, t_ok, sc_g, sc_n, sc_l, C_PER_STEP, ACC, SEGS, ITEMS)
            h_in = tl.load(STATES + ((pid_b * dim + ds) * N_STATES + n) * n_chunks + k, d_ok, other=0.0)
            adj_in = tl.load(ADJ + n * n_segments, d_ok, other=0.0)
            a = ()
            b = ()
            for r in tl.static_range(ITEMS):
                step_a, step_b = discretize_exp2(steps_of[r], rate2, b_coef[r], step_u[r])
                a, b = a + (step_a,), b + (step_b,)
            # (1) the states, left to right (run_states); dC and ybar from them.
            ah, hs = run_states(a, b, h_in, runs, SEGS, ITEMS)
            dC_runs = tl.zeros((BLOCK_D, SEGS), dtype=ACC)
            dC_rows = ()
            new_ybar = ()
            for r in tl.static_range(ITEMS):
                new_ybar = new_ybar + (ybar[r] + c_coef[r] * hs[r],)
                if C_PER_STEP:   # summed over the block's channels, then added to the group's row
                    dC_rows = dC_rows + (tl.sum(hs[r] * dys[r], axis=0)[None, :],)
                else:
                    dC_runs += hs[r] * dys[r]
            ybar = new_ybar
            if C_PER_STEP:
                tl.atomic_add(DC + dc_base + n * length + t[None, :], positions_of(dC_rows, SEGS, ITEMS),
                              t_ok[None, :], sem="relaxed")
            else:
                _add_partial(DC + PART + n * n_segments * SEGS, dC_runs, run_ok)
            # (2) the adjoint, right to left (run_adjoints): adj_t = C_t dybar_t + a_{t+1} adj_{t+1}, with
            # a_{t+1} the next item's a (the next run's first for a run's last item: one exp per run).
            c = ()
            gate = ()
            for r in tl.static_range(ITEMS):
                c = c + (c_coef[r] * dys[r],)
            for r in tl.static_range(ITEMS - 1):
                gate = gate + (a[r + 1],)
            gate = gate + (tl.exp2(delta_after * rate2),)
            adj = run_adjoints(gate, c, adj_in, runs, SEGS, ITEMS)
            # (3) the gradients.
            dA_runs = tl.zeros((BLOCK_D, SEGS), dtype=ACC)
            dB_runs = tl.zeros((BLOCK_D, SEGS), dtype=ACC)
            dB_rows = ()
            new_b_sum = ()
            new_rate_sum = ()
            for r in tl.static_range(ITEMS):
                adj_ah = adj[r] * ah[r]
                new_b_sum = new_b_sum + (adj_b_sum[r] + adj[r] * b_coef[r],)
                new_rate_sum = new_rate_sum + (adj_ah_rate_sum[r] + adj_ah * rate,)
                dA_runs += adj_ah * steps_of[r]
                if B_PER_STEP:
                    dB_rows = dB_rows + (tl.sum(adj[r] * step_u[r], axis=0)[None, :],)
                else:
                    dB_runs += adj[r] * step_u[r]
            adj_b_sum, adj_ah_rate_sum = new_b_sum, new_rate_sum
            if B_PER_STEP:
                tl.atomic_add(DB + db_base + n * length + t[None, :], positions_of(dB_rows, SEGS, ITEMS),
                              t_ok[None, :], sem="relaxed")
            else:
                _add_partial(DB + PART + n * n_segments * SEGS, dB_runs, run_ok)
            _add_partial(DA_PART + PART + n * n_segments * SEGS, dA_runs, run_ok)
            # what leaves the chunk's first position, a_t adj_t there: stored by the thread of run 0
            tl.store(ADJ[:, None] + n * n_segments + 0 * runs, a[0] * adj[0], first_run)
        if HAS_Z:
            tl.store(DZ + grad_offs, _gate_dz(dout, positions_of(ybar, SEGS, ITEMS), zv).to(DZ.dtype.element_ty),
                     mask)
        b_sum = positions_of(adj_b_sum, SEGS, ITEMS)
        ddelta = positions_of(adj_ah_rate_sum, SEGS, ITEMS) + u * b_sum
        if SOFTPLUS:   # the softplus input again (a load the cache serves), not kept through the loop
            _, pre = _load_delta(DELTA, BIAS, delta_offs, mask, ds, d_ok, HAS_BIAS, False, ACC)
            ddelta = ddelta * tl.sigmoid(pre)
        ddelta = tl.where(mask, ddelta, 0.0)                            # padding: the adjoint is the carry there
        tl.store(DDELTA + grad_offs, ddelta.to(DDELTA.dtype.element_ty), mask)
        tl.store(DU + grad_offs, (skip[:, None] * dybar + delta * b_sum).to(DU.dtype.element_ty), mask)
        dbias_acc += tl.sum(ddelta, axis=1)
    # dA, dD and d delta_bias: this program's sums added to the totals over batch and segments (no
    # reduction launched after the kernel)
    tl.debug_barrier()   # the per-run partials the last chunk stored, before they are read
    for n in range(0, N_STATES):
        dA_runs = tl.load(DA_PART + PART + n * n_segments * SEGS, run_ok, other=0.0)
        tl.atomic_add(DA + ds * N_STATES + n, tl.sum(dA_runs, axis=1), d_ok, sem="relaxed")
    if HAS_D:
        tl.atomic_add(DD + ds, dD_acc, d_ok, sem="relaxed")
    if HAS_BIAS:
        tl.atomic_add(DBIAS + ds, dbias_acc, d_ok, sem="relaxed")

# %%
# What the GPU executes, counted without one: benchmarks/sass_count.py compiles this chapter's exported
# kernels for sm_90 with the ptxas in Triton's wheel and counts the instructions of the loop over states
# per (position, state) each thread handles, at (8, 1024, 2048, N=16) with GPU_CONFIG's launches.
import os
from pathlib import Path

counter = Path("../benchmarks/sass_count.py")
if not counter.exists():
    print("skipped: needs the repository's benchmarks/ folder (a clone, not a pip install)")
else:
    for dtype in ("bf16", "fp32"):
        report = subprocess.run([sys.executable, str(counter), "--dtype", dtype], capture_output=True, text=True,
                                check=True, env={**os.environ, "PYTHONPATH": str(Path("..").resolve())})
        print(report.stdout.strip())

# %% [markdown]
# The launch parameters changed with the instruction cuts (a sweep like the one in "Going deeper: ideas
# that did not pay"): two channels and one warp per program, chunks of 512 positions in the forward
# (section 5 later gives the forward one channel per program); the backward's chunk is 32 runs, one
# per lane (128 positions in fp32, 256 in bf16).
#
# ## Going deeper: segments in the backward
#
# The backward splits like the forward, right to left: the adjoint leaving segment $s$ at its first
# position is $e^{A\Sigma_s}$ times the adjoint entering at its right end, plus what the segment adds
# started from 0 (the product of the same gates, in the other order). Phase 1 is a kernel that runs
# only the adjoint scan; phase 2 the reverse `linear_scan`; phase 3 the backward kernel, each segment
# from its entering adjoint, the states it needs read from those the forward kept per chunk. The
# kernels take the number of segments as an argument (1: no split) and `scan_in_segments` is
# `selective_scan` with it.

# %%
#| export
@triton.jit
def adjoint_summary_kernel(
    DELTA, A, C, Z, BIAS, DOUT, ADJ, DSUM,  # as in the backward; ADJ b x d x N x S, DSUM b x d x S
    dim, length, n_chunks, seg_chunks, per_group_c,
    sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l, sa_d, sa_n, sc_b, sc_g, sc_n, sc_l, so_b, so_d, so_l,
    N_STATES: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, C_PER_STEP: tl.constexpr,
    SOFTPLUS: tl.constexpr, ACC: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    """Phase 1 of the split backward: each segment's adjoint scan started from 0 at its right end; writes
    what leaves its first position (a_t times the adjoint there) and the segment's sum of steps."""
    pid_b, first_d, ds = _program_indices(BLOCK_D)
    ts = tl.arange(0, CHUNK)
    pid_s, n_segments, k_first, k_end = _segment_chunks(seg_chunks, n_chunks)
    ns = tl.arange(0, BLOCK_N)
    d_ok, n_ok = ds < dim, ns < N_STATES
    c_base = pid_b * sc_b + (first_d // per_group_c) * sc_g
    adj_carry = tl.zeros((BLOCK_D, BLOCK_N), dtype=ACC)
    dsum = tl.zeros((BLOCK_D,), dtype=ACC)
    first, last = ts[None, :] == 0, ts[None, :] == CHUNK - 1
    for i in range(0, k_end - k_first):
        k = k_end - 1 - i
        t = k * CHUNK + ts
        t_ok = t < length
        next_ok = (ts < CHUNK - 1) & (t + 1 < length)
        mask, next_mask = d_ok[:, None] & t_ok[None, :], d_ok[:, None] & next_ok[None, :]
        delta_offs = pid_b * sdt_b + ds[:, None] * sdt_d + t[None, :] * sdt_l
        delta, _ = _load_delta(DELTA, BIAS, delta_offs, mask, ds, d_ok, HAS_BIAS, SOFTPLUS, ACC)
        delta_next, _ = _load_delta(DELTA, BIAS, delta_offs + sdt_l, next_mask, ds, d_ok, HAS_BIAS, SOFTPLUS, ACC)
        delta_first = tl.sum(tl.where(first, delta, 0.0), axis=1)                        # BLOCK_D
        dsum += tl.sum(delta, axis=1)
        dout = tl.load(DOUT + pid_b * so_b + ds[:, None] * so_d + t[None, :] * so_l, mask, other=0.0).to(ACC)
        zv = dout
        if HAS_Z:
            zv = tl.load(Z + pid_b * sz_b + ds[:, None] * sz_d + t[None, :] * sz_l, mask, other=0.0).to(ACC)
        dybar = _gate_dybar(dout, zv, HAS_Z)
        for n in range(0, N_STATES):
            rate = tl.load(A + ds * sa_d + n * sa_n, d_ok, other=0.0).to(ACC)
            c_coef = _coef_row(C, c_base, n, ds, d_ok, t, t_ok, sc_g, sc_n, sc_l, C_PER_STEP, ACC)
            c = c_coef * dybar + tl.where(last, _column(adj_carry, n, ns)[:, None], 0.0)
            _, adj = tl.associative_scan((tl.exp(delta_next * rate[:, None]), c), axis=1,
                                         combine_fn=first_order_op, reverse=True)
            leaving = tl.exp(delta_first * rate) * tl.sum(tl.where(first, adj, 0.0), axis=1)
            adj_carry = tl.where(ns[None, :] == n, leaving[:, None], adj_carry)
    state_offs = (pid_b * dim + ds[:, None]) * N_STATES + ns[None, :]
    tl.store(ADJ + state_offs * n_segments + pid_s, adj_carry, d_ok[:, None] & n_ok[None, :])
    tl.store(DSUM + (pid_b * dim + ds) * n_segments + pid_s, dsum, d_ok)

# %% [markdown]
# Phase 2, written once for both directions: the segments' gates $e^{A\Sigma_s}$ and a `linear_scan`
# over them, forward for the states (from the initial state), reverse for the adjoints (from the
# gradient of the last state).

# %%
#| export
from scan_lib.linear_scan import linear_scan


def segment_carries(summary, dsum, A, boundary, reverse):
    """Phase 2: what enters each segment. summary: (batch, dim, N, S) each segment's result started from
    0 (its last state, or the adjoint leaving its first position); dsum: (batch, dim, S) its sum of steps;
    boundary: the initial state (forward) or the last state's gradient (reverse), (batch, dim, N) or None.
    Returns (entering, through): (batch, dim, N, S) the state (adjoint) entering each segment, and
    (batch, dim, N) the one leaving the sequence at the other end."""
    gates = torch.exp(A[None, :, :, None].to(dsum.dtype) * dsum[:, :, None, :])   # batch x dim x N x S
    leaving = linear_scan(gates, summary, boundary, reverse=reverse)             # after each segment
    start = torch.zeros_like(summary[..., 0]) if boundary is None else boundary.to(summary.dtype)
    if reverse:
        return torch.cat([leaving[..., 1:], start[..., None]], -1), leaving[..., 0]
    return torch.cat([start[..., None], leaving[..., :-1]], -1), leaving[..., -1]

# %% [markdown]
# ## Going deeper: the launchers and the public function
#
# The launchers are chapter 05's with two differences besides section 5's segments: they pass
# strides instead of copying, and the forward returns no $\bar y$. The launch parameters come from
# sweeps on an H200 and an H100 ("Going deeper: ideas that did not pay" prints one, "Going deeper:
# segments and states per step, measured" a long sequence): one warp per program; for the forward
# one channel per program, 512 positions per chunk and `states_per_step`'s states per step (section
# 5); for the backward two channels per program, one state per step and 32 runs of 16 bytes (128
# positions in fp32, 256 in bf16: `launch_config` scales the fp32 count); in training the forward
# keeps the state entering every chunk of the backward's. Under the interpreter the chunks are small,
# so that the tests' short sequences still cross several chunks and blocks. The autograd plumbing (a
# `torch.library` custom op with fake and vmap rules, an autograd Function, a second derivative that
# raises) is chapter 05's, imported. The backward's sums are atomic additions, so $dA$, $dD$ and
# $d\Delta_{\text{bias}}$, like $dB$ and $dC$, can differ in their last bits from run to run.
#
# One thing is new: how much the host does per call. In a training loop the same shapes, strides and
# dtypes come back at every step, and everything the launchers work out from them comes out the same
# each time: the accumulator dtype, the layout and strides of every input, the launch config, the
# grid, the dozens of integer arguments, the constexprs, the sizes of the outputs, chapter 05's input
# checks. Each is a few microseconds of Python, and together they are a good part
# of the host's time per step ("Going deeper: the host's share" measures that time). So the launchers
# work it out once per *signature*, each tensor's shape, strides, dtype and device (`signature`), with
# the call's flags, and keep the result, a *plan* (`planned`, with `fwd_plan` and `bwd_plan`).
# A plain eager call (no `torch.compile`, `torch.func` transform, dispatch or torch-function mode,
# profiler, jit tracer, tensor subclass, nor saved-tensor hooks such as activation checkpointing's)
# works out one signature in all, its arguments': `call_plan` runs chapter 05's checks the first
# time a signature comes with its flags (one that fails them is never kept, so it raises at every
# call) and holds the chunk of states to keep, the forward's plan and the backward's plans.
# The backward's plan is found by what can still differ from the forward's signature, the output
# gradient's strides and whether the last state has a gradient (`backward_plan`), and both passes
# run their launches directly (`run_forward`, `run_backward`). Every other call goes through the
# custom ops, which plan from their own arguments' signatures. The backward also returns $dB$ and
# $dC$, adjacent in its buffer of summed gradients, to their dtype in one cast where both are per
# position and of one half-precision dtype (bf16 training).
#
# A plan's launches are `Launcher`s. On a GPU, `kernel[grid](*args)` runs a fair amount of Python
# before launching. It looks up the current device and stream and matches the arguments to the
# kernel's parameters. It then classifies each argument, which Triton calls *specialisation*: for a
# pointer, its element type and whether it is 16-byte aligned; for an integer, its width, whether it
# is 1 and whether it divides by 16 (these let the compiler drop a multiply or vectorise a load).
# From that it builds a key and looks the compiled kernel up, on every call: 41 runtime arguments in
# the forward here, 52 in the backward. In a plan all of that is fixed except the current device and
# stream and where the tensors start (hence their alignment). A `Launcher` holds the grid, the
# integers and the constexprs; its first call for a (current device, alignments) goes through
# Triton, which compiles if needed, launches, and returns the compiled kernel; its later calls go
# straight to the compiled kernel's own launcher for the grid, which still reads the current stream.
# What it skips are Triton's per-call checks around the launch (its debug switches, pre-run hooks,
# and that the kernel's globals have not changed), which these kernels do not use.
#
# A plan's key also includes `plan_context()`: the kernel objects and launch configs in force when
# it was made. The sweeps change the configs, and re-running a cell that defines a kernel
# makes a new kernel object; either way the old plan stops matching and a new one is built. The
# caches have two limits. Each holds at most `KEPT` entries before it starts afresh (every new
# sequence length adds a plan). And where a size is a symbol rather than a number (a `SymInt`, as
# with `torch.compile`'s dynamic shapes or `make_fx(tracing_mode="symbolic")`), it cannot be a
# dictionary key, and `cached` computes the answer each time without keeping it; while
# `torch.compile` traces, it keeps nothing either (the compiled graph's calls, made with real
# tensors, use the caches as eager calls do). The test suite compiles with dynamic shapes to check
# it. Triton's own `cdiv` and `next_power_of_2` are wrapped so that they also work inside kernels,
# and the wrapper costs more per host call than the arithmetic; the plans use chapter 00's plain
# Python ones (`scan_lib.runtime`). From here on `selective_scan` is the notebook's own, the one these
# cells define.

# %%
#| export
from scan_lib.runtime import cdiv, next_power_of_2   # plain Python: Triton's cost a wrapper call each

KEPT = 4096   # entries a cache holds before it starts afresh (every new sequence length adds one)
CACHES: dict = {"plans": {}, "calls": {}, "summed": {}}   # name -> {key: value}
_MISSING = object()


def remember(cache: dict, key, value):
    """cache[key] = value, returned; the cache is emptied first when it holds KEPT entries, so that a
    run with many shapes (variable-length training) keeps a bounded number."""
    if len(cache) >= KEPT:
        cache.clear()
    cache[key] = value
    return value


def cached(name: str, key, build):
    """CACHES[name][key()], built by build() the first time. While torch.compile traces, build() runs
    and no cache is touched: Dynamo would read the cache's keys (and fail on a Triton kernel among
    them), guard on them, and cannot follow a global dict changing inside an autograd Function. For
    a key holding symbolic sizes (make_fx's symbolic tracing: a SymInt cannot be hashed), build()
    runs each time and nothing is kept."""
    if torch.compiler.is_compiling():
        return build()
    cache, key = CACHES[name], key()
    try:
        value = cache.get(key, _MISSING)
    except TypeError:          # unhashable type: SymInt
        return build()
    return remember(cache, key, build()) if value is _MISSING else value


def signature(*tensors) -> tuple:
    """What the host's work for a call depends on: each tensor's shape, strides, dtype and device
    (None for an absent one)."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors)


class Launcher:
    """One kernel launch with everything but its tensors fixed: `launcher(*tensors)` runs
    `kernel[grid](*tensors, *scalars, **constexprs)`.

    The first call for a (current device, each tensor's 16-byte alignment) goes through Triton, which
    compiles if needed and returns the compiled kernel; later calls go straight to that compiled
    kernel's launcher for the grid, which reads the current stream and launches. Tensors' dtypes and
    which are None, the integers and the constexprs are the plan's, fixed when the Launcher is made.
    Under the interpreter, or with `through_triton` set ("Going deeper: the host's share" compares), every call goes
    through Triton."""
    through_triton = False

    def __init__(self, kernel, grid: tuple, scalars: tuple, constexprs: dict):
        self.kernel, self.grid, self.scalars, self.constexprs = kernel, grid, scalars, constexprs
        self.runners, self.tail = {}, None       # tail: scalars, then constexpr values in parameter order

    def __call__(self, *tensors):
        if INTERPRET or self.through_triton:
            self.kernel[self.grid](*tensors, *self.scalars, **self.constexprs)
            return
        key = (torch.cuda.current_device(), *[t is None or t.data_ptr() % 16 == 0 for t in tensors])
        runner = self.runners.get(key)
        if runner is not None:
            runner(*tensors, *self.tail)
            return
        compiled = self.kernel[self.grid](*tensors, *self.scalars, **self.constexprs)
        names = self.kernel.arg_names[len(tensors) + len(self.scalars):]   # the compiled kernel takes every parameter
        self.tail = (*self.scalars, *[self.constexprs[name] for name in names])
        self.runners[key] = compiled[self.grid]


def planned(build, tensors: tuple, options: tuple):
    """build(*tensors, *options), worked out once per signature of the tensors, options and
    plan_context(): a plan reads only shapes, strides, dtypes and devices, never the tensors' values."""
    return cached("plans", lambda: (build, signature(*tensors), options, plan_context()),
                  lambda: build(*tensors, *options))

# %%
#| export
import functools
import math
from typing import Optional

from scan_lib.runtime import _PLAIN_TENSORS, _dispatcher_needed, _plain_tensors, apply, custom_op, needs_grad
from scan_lib.selective_scan import (_NoSecondDerivative, _acc_dtype, _check_inputs, _groups,
                                     _vmap_by_loop, empty_selective_scan)

# block_d channels per program, chunk positions per loop step, num_warps, and for the forward unroll
# states per step of the loop over states (where it has none, states_per_step's table decides): the
# fastest of sweeps on an H200 and an H100 ("Going deeper": segments and states per step, and the
# sweep). The backward's chunk is for 4-byte inputs and scales to the same bytes for others
# (launch_config): 32 runs of 16 bytes, one per lane of the warp.
# Under the interpreter, small chunks so that small tests cross several chunks, and two states per
# step so that they run the unrolled loop.
GPU_CONFIG = {"fwd": dict(block_d=1, chunk=512, num_warps=1), "bwd": dict(block_d=2, chunk=128, num_warps=1)}
CPU_CONFIG = {"fwd": dict(block_d=2, chunk=16, num_warps=1, unroll=2), "bwd": dict(block_d=2, chunk=8, num_warps=1)}
# The forward's states per step (section 5) where its config gives none, as "Going deeper: segments
# and states per step, measured" found: rows (largest chunk, most programs per multiprocessor, states
# per step), the first that fits wins; one state per step where none does.
FORWARD_STATES_PER_STEP = ((256, 16, 16), (256, math.inf, 2), (512, 24, 2))


def plan_context() -> tuple:
    """What a plan depends on besides its inputs: the kernels and the launch configs as they stand now
    (a notebook cell may define a kernel again, a grader swap in a student's, the sweep of "Going
    deeper: ideas that did not pay" change GPU_CONFIG; a plan made before must not be used after)."""
    configs = CPU_CONFIG if INTERPRET else GPU_CONFIG
    return (strided_fwd_kernel, adjoint_summary_kernel, strided_bwd_kernel, FORWARD_STATES_PER_STEP,
            *[tuple(config.items()) for config in configs.values()])


def launch_config(kind, dim, per_group_b, per_group_c, length, element_size=4):
    """The config for 'fwd' or 'bwd' (on inputs of element_size bytes), block_d a power of two that never
    straddles a group, chunk at most the padded length."""
    config = dict((CPU_CONFIG if INTERPRET else GPU_CONFIG)[kind])
    if kind == "bwd":
        config["chunk"] = max(1, config["chunk"] * 4 // element_size)
    block_d = min(config["block_d"], next_power_of_2(dim))
    for per_group in (per_group_b, per_group_c):
        block_d = min(block_d, per_group & -per_group)       # largest power of two dividing per_group
    config.update(block_d=block_d, chunk=min(config["chunk"], max(next_power_of_2(length), 2)))
    return config


def states_per_step(config, chunk, n_states, programs, multiprocessors):
    """UNROLL, the states one step of the loop over states takes: the config's "unroll" where it has
    one; else all of them with 4 states or fewer (few registers), else FORWARD_STATES_PER_STEP's row for
    the chunk and the programs per multiprocessor. Made a divisor of n_states."""
    if "unroll" in config:
        unroll = config["unroll"]
    elif n_states <= 4:
        unroll = n_states
    else:
        per_multiprocessor = programs / multiprocessors
        unroll = next((states for most_chunk, most_programs, states in FORWARD_STATES_PER_STEP
                       if chunk <= most_chunk and per_multiprocessor <= most_programs), 1)
    return math.gcd(unroll, n_states)


@functools.cache
def multiprocessor_count(device: torch.device):
    """The GPU's multiprocessors (None under the interpreter)."""
    return None if INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count


def run_items(u, chunk):
    """Positions per thread's run in the backward: 16 bytes of u's dtype (8 in bf16, 4 in fp32, one
    vector load), at most the chunk."""
    return min(chunk, max(1, 16 // u.element_size()))


def split(n_chunks, segments):
    """(S, chunks per segment) for about `segments` segments of whole chunks (at most one per chunk)."""
    seg_chunks = cdiv(n_chunks, max(1, min(segments, n_chunks)))
    return cdiv(n_chunks, seg_chunks), seg_chunks


def _coef_layout(M, dim):
    """The strides (batch, group, state, position) of B or C and its channels per group: (batch, groups, N, L),
    or the time-invariant (dim, N) as dim groups of one channel with batch and position strides 0."""
    if M.dim() == 2:
        return (0, M.stride(0), M.stride(1), 0), 1
    return M.stride(), dim // M.shape[1]


def _layout(u, delta, z, A, B, C):
    """Channels per group of B and C, and every input's strides by name."""
    dim = u.shape[1]
    (b_strides, per_group_b), (c_strides, per_group_c) = _coef_layout(B, dim), _coef_layout(C, dim)
    strides = dict(u=u.stride(), delta=delta.stride(), z=z.stride() if z is not None else (0, 0, 0),
                   A=A.stride(), B=b_strides, C=c_strides)
    return per_group_b, per_group_c, strides


def _small_contiguous(*tensors):
    """D, delta_bias, initial_state, the last state's gradient: small, indexed as contiguous."""
    return [None if t is None else t.contiguous() for t in tensors]


def like_u_strides(u):
    """The strides like_u(u) gives, worked out on the meta device (no memory allocated)."""
    return like_u(torch.empty_strided(u.shape, u.stride(), dtype=u.dtype, device="meta")).stride()


def like_u(u, dtype=None):
    """A new (batch, dim, L) tensor in u's layout (its strides, where u is dense; else contiguous): out, du,
    d delta and dz. The next op reads them the way it wrote u: in a Mamba block, out_proj reads out
    without a copy, and the gradient it returns arrives in the same layout, stride 1 along L."""
    return torch.empty_like(u, dtype=dtype)


def positions_adjacent(M):
    """B or C (batch, groups, N, L) with stride 1 along L, copied if needed (N values per position, small
    beside u): the kernels load a state's coefficients along the positions, one transaction per
    position otherwise. (A (batch, L, N) tensor's transpose has positions N or more elements apart.)"""
    if M.dim() == 4 and M.shape[-1] > 1 and M.stride(-1) != 1:
        return M.contiguous()
    return M


def run_partials_shape(u, A, chunk, segments):
    """The backward's partial sums per (batch, channel, state, segment, run of a chunk)."""
    n_segments, _ = split(cdiv(u.shape[2], chunk), segments)
    return (u.shape[0], u.shape[1], A.shape[1], n_segments, chunk // run_items(u, chunk))


def summed_gradient_shapes(u, A, B, C, chunk, segments):
    """What the backward sums over positions, in the order of its one zeroed buffer: dB and dC (batch,
    groups, N, L), or for a time-invariant (dim, N) their partial sums per run (run_partials_shape),
    then dA (dim, N), dD and d delta_bias (dim,). One buffer: one allocation, one zeroing launch."""
    per_run = run_partials_shape(u, A, chunk, segments)
    return [tuple(B.shape) if B.dim() == 4 else per_run, tuple(C.shape) if C.dim() == 4 else per_run,
            tuple(A.shape), (u.shape[1],), (u.shape[1],)]


def summed_layout(u, A, B, C, chunk, segments):
    """(shapes, sizes) of the summed buffer's pieces (summed_gradient_shapes), once per shapes."""
    def build():
        shapes = summed_gradient_shapes(u, A, B, C, chunk, segments)
        return shapes, [math.prod(shape) for shape in shapes]
    return cached("summed", lambda: (u.shape, u.dtype, A.shape, B.shape, C.shape, chunk, segments), build)


def gradients_from_summed(summed, shapes, sizes, B, C):
    """(dA, dB, dC, dD, d delta_bias) from the backward's flat buffer of pieces `sizes` (summed_layout):
    views (dD and d delta_bias are already 1-D pieces), the time-invariant B's and C's runs summed. dB
    and dC, adjacent in the buffer, come back in B's and C's dtype, cast in one op where both are per
    position and share a dtype other than the buffer's (in bf16 training: one launch instead of two)."""
    if B.dim() == 4 and C.dim() == 4 and B.dtype == C.dtype != summed.dtype:
        both = sizes[0] + sizes[1]
        dB, dC = summed[:both].to(B.dtype).split_with_sizes(sizes[:2])
        dA, dD, dbias = summed[both:].split_with_sizes(sizes[2:])
        return dA.view(shapes[2]), dB.view(shapes[0]), dC.view(shapes[1]), dD, dbias
    dB, dC, dA, dD, dbias = summed.split_with_sizes(sizes)
    over_batch_segments_runs = (0, -2, -1)
    dB, dC = dB.view(shapes[0]), dC.view(shapes[1])
    return (dA.view(shapes[2]), dB.sum(over_batch_segments_runs) if B.dim() == 2 else dB,
            dC.sum(over_batch_segments_runs) if C.dim() == 2 else dC, dD, dbias)


def fwd_plan(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, save_chunk, segments):
    """What strided_fwd works out from its inputs' shapes, strides and dtypes alone: the accumulator
    dtype, its outputs' shapes and its launches (phase 1's only with segments)."""
    batch, dim, length = u.shape
    n_states = A.shape[1]
    acc = _acc_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    per_group_b, per_group_c, strides = _layout(u, delta, z, A, B, C)
    config = launch_config("fwd", dim, per_group_b, per_group_c, length)
    chunk = max(config["chunk"], save_chunk)
    if save_chunk > 0 and chunk % save_chunk:
        raise ValueError(f"save_chunk must divide the forward's chunk {chunk} (a power of two), got {save_chunk}")
    unroll = states_per_step(config, chunk, n_states, batch * cdiv(dim, config["block_d"]),
                             multiprocessor_count(u.device))
    n_chunks = cdiv(length, chunk)
    n_segments, seg_chunks = split(n_chunks, segments)
    grid = (batch, cdiv(dim, config["block_d"]), n_segments)
    scalars = (dim, length, n_chunks, seg_chunks, per_group_b, per_group_c, *strides["u"], *strides["delta"],
               *strides["z"], *strides["A"], *strides["B"], *strides["C"], *like_u_strides(u))
    constexprs = dict(N_STATES=n_states, HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
                      B_PER_STEP=B.dim() == 4, C_PER_STEP=C.dim() == 4, SOFTPLUS=delta_softplus,
                      ACC=accumulator_dtype(acc), BLOCK_D=config["block_d"], BLOCK_N=next_power_of_2(n_states),
                      CHUNK=chunk, UNROLL=unroll, SAVE_EVERY=save_chunk if save_chunk > 0 else chunk,
                      num_warps=config["num_warps"])

    def scan_pass(summary, has_h0):   # summary: phase 1 (each segment's last state and sum of steps)
        return Launcher(strided_fwd_kernel, grid, scalars, dict(
            constexprs, HAS_H0=has_h0, SAVE=save_chunk > 0 and not summary, SUMMARY=summary))
    return dict(acc=acc, n_segments=n_segments,
                ends=(batch, dim, n_states, n_segments) if n_segments > 1 else (batch, dim, n_states),
                states=(batch, dim, n_states, cdiv(length, save_chunk) if save_chunk > 0 else 0),
                summary=scan_pass(True, False) if n_segments > 1 else None,
                outputs=scan_pass(False, n_segments > 1 or initial_state is not None))


@custom_op("strided_selective_scan_fwd", __name__)
def strided_fwd(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: Optional[torch.Tensor], z: Optional[torch.Tensor], delta_bias: Optional[torch.Tensor],
                initial_state: Optional[torch.Tensor], delta_softplus: bool, save_chunk: int, segments: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward on u, delta, z of any strides; B, C: (batch, groups, N, L) or (dim, N). Returns out
    (u's layout: like_u), the last state, and with save_chunk > 0 the state entering every chunk of save_chunk
    positions (batch, dim, N, n_chunks) for the backward (else an empty tensor). segments: how many
    segments to split the sequence into (section 5; 1: none)."""
    D, delta_bias, initial_state = _small_contiguous(D, delta_bias, initial_state)
    plan = planned(fwd_plan, (u, delta, A, B, C, D, z, delta_bias, initial_state),
                   (delta_softplus, save_chunk, segments))
    return run_forward(plan, u, delta, A, B, C, D, z, delta_bias, initial_state)


def run_forward(plan, u, delta, A, B, C, D, z, delta_bias, initial_state):
    """strided_fwd's work once its plan (fwd_plan) is made: D, delta_bias and initial_state contiguous."""
    out = like_u(u)
    ends = u.new_empty(plan["ends"], dtype=plan["acc"])   # the state at each segment's end (one segment: the last)
    states = u.new_empty(plan["states"], dtype=plan["acc"])
    entering = initial_state
    if plan["summary"] is not None:   # phases 1 and 2: the state entering each segment
        dsum = u.new_empty(u.shape[0], u.shape[1], plan["n_segments"], dtype=plan["acc"])
        plan["summary"](u, delta, A, B, C, D, z, delta_bias, None, out, states, ends, dsum)
        entering, _ = segment_carries(ends, dsum, A, initial_state, reverse=False)
    plan["outputs"](u, delta, A, B, C, D, z, delta_bias, entering, out, states, ends, None)
    return out, ends if plan["summary"] is None else ends[..., -1].contiguous(), states


@strided_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, save_chunk, segments):
    batch, dim, length = u.shape
    acc = _acc_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    n_chunks = (length + save_chunk - 1) // save_chunk if save_chunk > 0 else 0
    return (like_u(u), u.new_empty(batch, dim, A.shape[1], dtype=acc),
            u.new_empty(batch, dim, A.shape[1], n_chunks, dtype=acc))


def bwd_plan(u, delta, A, B, C, D, z, delta_bias, states, dout, dlast, delta_softplus, chunk, segments):
    """What strided_bwd works out from its inputs' shapes, strides and dtypes alone: the summed
    buffer's layout, d initial_state's shape and the launches (phase 1's only with segments)."""
    batch, dim, length = u.shape
    n_states, n_chunks, acc = A.shape[1], states.shape[-1], states.dtype
    per_group_b, per_group_c, strides = _layout(u, delta, z, A, B, C)
    config = launch_config("bwd", dim, per_group_b, per_group_c, length)
    n_segments, seg_chunks = split(n_chunks, segments)
    grid = (batch, cdiv(dim, config["block_d"]), n_segments)
    sizes = dict(N_STATES=n_states, ACC=accumulator_dtype(acc), BLOCK_D=config["block_d"],
                 num_warps=config["num_warps"])
    options = dict(HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, C_PER_STEP=C.dim() == 4,
                   SOFTPLUS=delta_softplus)
    summary = None
    if n_segments > 1:   # phase 1: each segment's adjoint from 0 at its right end
        summary = Launcher(adjoint_summary_kernel, grid, (
            dim, length, n_chunks, seg_chunks, per_group_c, *strides["delta"], *strides["z"], *strides["A"],
            *strides["C"], *dout.stride()), dict(sizes, **options, BLOCK_N=next_power_of_2(n_states), CHUNK=chunk))
    items = run_items(u, chunk)
    gradients = Launcher(strided_bwd_kernel, grid, (
        dim, length, n_chunks, seg_chunks, per_group_b, per_group_c, *strides["u"], *strides["delta"],
        *strides["z"], *strides["A"], *strides["B"], *strides["C"], *dout.stride(), *like_u_strides(u)),
        dict(sizes, **options, HAS_D=D is not None, HAS_DLAST=n_segments > 1 or dlast is not None,
             B_PER_STEP=B.dim() == 4, SEGS=chunk // items, ITEMS=items))
    per_run = run_partials_shape(u, A, chunk, segments)
    summed_shapes, summed_sizes = summed_layout(u, A, B, C, chunk, segments)
    return dict(acc=acc, n_segments=n_segments, per_run=per_run, summed_shapes=summed_shapes, summed_sizes=summed_sizes,
                dh0=per_run[:-1] if n_segments > 1 else per_run[:3], summary=summary, gradients=gradients)


@custom_op("strided_selective_scan_bwd", __name__)
def strided_bwd(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: Optional[torch.Tensor], z: Optional[torch.Tensor], delta_bias: Optional[torch.Tensor],
                states: torch.Tensor, dout: torch.Tensor, dlast: Optional[torch.Tensor],
                delta_softplus: bool, chunk: int, segments: int) -> list[torch.Tensor]:
    """The backward: du, d delta, dz (u's layout: like_u; dz empty without z), d initial_state, and one
    flat buffer of the gradients summed over positions (summed_gradient_shapes: dB, dC, dA, dD,
    d delta_bias; `gradients_from_summed` unpacks it). segments: as in strided_fwd."""
    D, delta_bias, dlast = _small_contiguous(D, delta_bias, dlast)
    plan = planned(bwd_plan, (u, delta, A, B, C, D, z, delta_bias, states, dout, dlast),
                   (delta_softplus, chunk, segments))
    return run_backward(plan, u, delta, A, B, C, D, z, delta_bias, states, dout, dlast)


def run_backward(plan, u, delta, A, B, C, D, z, delta_bias, states, dout, dlast):
    """strided_bwd's work once its plan (bwd_plan) is made: D, delta_bias and dlast contiguous."""
    acc, n_segments = plan["acc"], plan["n_segments"]
    entering = dlast
    if plan["summary"] is not None:   # phases 1 and 2: the adjoint entering each segment from the right
        adj = u.new_empty(plan["per_run"][:-1], dtype=acc)
        dsum = u.new_empty(u.shape[0], u.shape[1], n_segments, dtype=acc)
        plan["summary"](delta, A, C, z, delta_bias, dout, adj, dsum)
        entering, _ = segment_carries(adj, dsum, A, dlast, reverse=True)
    du, ddelta = like_u(u), like_u(u, delta.dtype)
    dz = like_u(u, z.dtype) if z is not None else u.new_empty(0)
    summed = torch.zeros(sum(plan["summed_sizes"]), device=u.device, dtype=acc)
    dB, dC, dA, dD, dbias = summed.split_with_sizes(plan["summed_sizes"])   # the kernel indexes each piece as contiguous
    dA_part, dh0 = u.new_empty(plan["per_run"], dtype=acc), u.new_empty(plan["dh0"], dtype=acc)
    plan["gradients"](u, delta, A, B, C, D, z, delta_bias, states, dout, entering,
                      du, ddelta, dz, dB, dC, dA_part, dA, dD if D is not None else None,
                      dbias if delta_bias is not None else None, dh0)
    return [du, ddelta, dz, dh0 if n_segments == 1 else dh0[..., 0].contiguous(), summed]


@strided_bwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, states, dout, dlast, delta_softplus, chunk, segments):
    acc, shapes = states.dtype, summed_gradient_shapes(u, A, B, C, chunk, segments)
    return [like_u(u), like_u(u, delta.dtype), like_u(u, z.dtype) if z is not None else u.new_empty(0),
            u.new_empty(u.shape[0], u.shape[1], A.shape[1], dtype=acc),
            u.new_empty(sum(math.prod(shape) for shape in shapes), dtype=acc)]


strided_fwd.register_vmap(_vmap_by_loop(strided_fwd))
strided_bwd.register_vmap(_vmap_by_loop(strided_bwd))


def cast(x, dtype):
    """x in dtype: x itself when it is already (Tensor.to's no-op still costs about a microsecond)."""
    return x if x.dtype == dtype else x.to(dtype)


class StridedSelectiveScanFn(torch.autograd.Function):
    """(out, last_state, states) = S6(u, delta, A, B, C, D, z, delta_bias, initial_state) on strided inputs;
    B, C 4-D or (dim, N); save_chunk > 0 keeps one state per chunk for the backward; segments: how many
    segments both passes split the sequence into (section 5; 1: none). plan: the call's plan (call_plan)
    in a plain eager call, whose forward and backward then run their launches without the custom ops
    (each of which would work out its plan again from its arguments' signature); None otherwise."""
    generate_vmap_rule = True

    @staticmethod
    def forward(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, save_chunk, segments, plan):
        if plan is None:
            return strided_fwd(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, save_chunk,
                               segments)
        D, delta_bias, initial_state = _small_contiguous(D, delta_bias, initial_state)
        if plan["fwd"] is None:
            plan["fwd"] = fwd_plan(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, save_chunk,
                                   segments)
        return run_forward(plan["fwd"], u, delta, A, B, C, D, z, delta_bias, initial_state)

    @staticmethod
    def setup_context(ctx, inputs, output):
        u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, save_chunk, segments, plan = inputs
        ctx.mark_non_differentiable(output[2])
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, output[2])
        ctx.delta_softplus, ctx.chunk, ctx.segments, ctx.plan = delta_softplus, save_chunk, segments, plan
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout, dlast, _dstates):
        u, delta, A, B, C, D, z, delta_bias, initial_state, states = ctx.saved_tensors
        if ctx.chunk == 0:
            raise RuntimeError("selective_scan: the forward kept no boundary states (no input required a "
                               "gradient when it ran), so there is nothing to differentiate")
        if dout is None:
            dout = torch.zeros_like(u)
        dout = cast(dout, u.dtype)
        with torch.no_grad():  # the op's own outputs carry no graph (chapter 05's _NoSecondDerivative)
            if ctx.plan is not None and not _dispatcher_needed() and _plain_tensors((dout, dlast)):
                D, delta_bias, dlast = _small_contiguous(D, delta_bias, dlast)
                plan = backward_plan(ctx.plan, u, delta, A, B, C, D, z, delta_bias, states, dout, dlast,
                                     ctx.delta_softplus, ctx.chunk, ctx.segments)
                du, ddelta, dz, dh0, summed = run_backward(plan, u, delta, A, B, C, D, z, delta_bias, states, dout, dlast)
                shapes, sizes = plan["summed_shapes"], plan["summed_sizes"]
            else:
                du, ddelta, dz, dh0, summed = strided_bwd(u, delta, A, B, C, D, z, delta_bias, states, dout, dlast,
                                                          ctx.delta_softplus, ctx.chunk, ctx.segments)
                shapes, sizes = summed_layout(u, A, B, C, ctx.chunk, ctx.segments)
            dA, dB, dC, dD, dbias = gradients_from_summed(summed, shapes, sizes, B, C)
        grads = (du, ddelta, dA, dB, dC, dD, dz, dbias, dh0)
        inputs = (u, delta, A, B, C, D, z, delta_bias, initial_state)
        grads = [None if x is None else cast(g, x.dtype) for g, x in zip(grads, inputs)]
        if torch.is_grad_enabled():  # create_graph=True (or torch.func.grad): make a second derivative raise
            anchors = [x for x in (*inputs, dout, dlast) if x is not None]
            given = [g for g in grads if g is not None]
            poisoned = iter(_NoSecondDerivative.apply(len(anchors), *anchors, *given))
            grads = [None if g is None else next(poisoned) for g in grads]
        return (*grads, None, None, None, None)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, initial_state=None):
    """Mamba's selective scan (S6), a drop-in for mamba_ssm's selective_scan_fn (real A), plus initial_state.

    Chapter 05's semantics, arguments and checks (see scan_lib.selective_scan.selective_scan), with
    faster kernels: u, delta, z, B and C are read where they are, with any strides (the views a Mamba
    block's projection produces cost no copy), and inputs past 2^31 elements are accepted.

        delta <- softplus(delta + delta_bias) if delta_softplus else delta + delta_bias
        h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t,   ybar_t = sum_n C_t h_t + D * u_t
        out = ybar * silu(z) if z is given else ybar

    Returns out (dtype of u, in u's layout: contiguous for contiguous u), and with return_last_state also the state after the last
    position (batch, dim, N) in float32 (float64 for float64 inputs). Gradients flow to every tensor
    argument, including initial_state and through last_state; first derivatives only. Works under
    torch.compile, torch.func.grad and torch.func.vmap.
    """
    return scan_in_segments(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, initial_state)


def scan_in_segments(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                     return_last_state=False, initial_state=None, segments=1):
    """selective_scan with both passes split into `segments` segments along L (section 5)."""
    tensors = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    if not all(t is None or isinstance(t, torch.Tensor) for t in tensors):
        _check_inputs(*tensors)             # raises the TypeError naming the argument
    delta_softplus, training = bool(delta_softplus), needs_grad(*tensors)
    plan = cached("calls", lambda: (signature(*tensors), delta_softplus, training, segments, plan_context()),
                  lambda: call_plan(*tensors, training))
    if plan is None:
        return empty_selective_scan(u, delta, A, B, C, D, z, delta_bias, return_last_state, initial_state)
    B4 = positions_adjacent(B.unsqueeze(1) if B.dim() == 3 else B)
    C4 = positions_adjacent(C.unsqueeze(1) if C.dim() == 3 else C)
    eager = (not _dispatcher_needed() and all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)
             and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)  # no save_on_cpu, checkpoint
    out, last, _ = apply(StridedSelectiveScanFn, u, delta, A, B4, C4, D, z, delta_bias, initial_state,
                         delta_softplus, plan["save_chunk"], segments, plan if eager else None)
    return (out, last) if return_last_state else out


def call_plan(u, delta, A, B, C, D, z, delta_bias, initial_state, training):
    """What scan_in_segments works out once per signature of its arguments, its flags and plan_context()
    (one lookup per call): chapter 05's checks (_check_inputs: a key whose arguments fail them is never
    kept, so it raises at every call); None for an empty input; else the chunk of states the forward keeps for the backward
    (0 without training), and room for the forward's plan and the backward's plans by the output
    gradient's strides, which plain eager calls fill and use (StridedSelectiveScanFn)."""
    _check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    if u.numel() == 0:
        return None
    B4, C4 = (M.unsqueeze(1) if M.dim() == 3 else M for M in (B, C))
    return dict(save_chunk=backward_chunk(u, B4, C4) if training else 0, fwd=None, bwd={})


def backward_plan(plan, u, delta, A, B, C, D, z, delta_bias, states, dout, dlast, delta_softplus, chunk, segments):
    """bwd_plan(...) (D, delta_bias, dlast contiguous) for the backward of a call planned by call_plan:
    the rest of its signature is the forward's (the saved tensors come back as they were saved: no
    saved-tensor hooks were active, scan_in_segments checks), so it is kept in the call's plan by what
    can still differ, dout's strides and whether dlast is given."""
    key = (dout.stride(), dlast is None)
    found = plan["bwd"].get(key)
    if found is None:
        found = remember(plan["bwd"], key, bwd_plan(u, delta, A, B, C, D, z, delta_bias, states, dout, dlast,
                                                    delta_softplus, chunk, segments))
    return found


def backward_chunk(u, B4, C4):
    """The chunk the backward runs with, for the forward to keep one state per chunk."""
    dim = u.shape[1]
    return launch_config("bwd", dim, dim // _groups(B4) if B4.dim() == 4 else 1,
                         dim // _groups(C4) if C4.dim() == 4 else 1, u.shape[2], u.element_size())["chunk"]

# %% [markdown]
# ## Going deeper: the checks
#
# The new kernels must compute exactly what chapter 05's do. Each case below runs the forward and the
# backward against the float64 reference of chapter 05 (`selective_scan_ref`, differentiated by
# autograd), at awkward lengths, with and without every option, with grouped and time-invariant $B$
# and $C$, in fp32 and bf16, and on strided views like the block's; then split into segments
# (section 5). The tolerance is the one chapter 05 derived: a float32 random walk over the length,
# plus the final rounding of a half-precision output. `tests/test_selective_scan.py` runs chapter 05's
# whole suite against this function too.

# %%
def random_inputs(batch, dim, n_states, length, groups=1, dtype=torch.float32, options="DzbH",
                  layout="contiguous", time_invariant="", seed=0):
    """Random inputs of chapter 05's shapes. options: D, z, delta_bias (b), initial_state (H). layout:
    "contiguous"; "channels_last": u, delta, z slices of one (batch, L, 3 dim) tensor (stride 1 along dim,
    not along L); "block": every (batch, ., L) tensor a view of a (features, batch L) matrix, as chapter
    06's block passes them (block_layout_inputs)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, dt=dtype: torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dt)  # noqa: E731
    as_block = lambda flat: positions_last(flat, batch, length)  # noqa: E731
    if layout == "channels_last":
        rows = rand(batch, length, 3 * dim).transpose(1, 2)                 # batch x 3 dim x L, stride 1 along dim
        u, delta, z = rows[:, :dim], rows[:, dim:2 * dim] * 0.5 - 1.0, rows[:, 2 * dim:]
    elif layout == "block":
        u, delta, z = as_block(rand(dim, batch * length)), as_block(rand(dim, batch * length) * 0.5 - 1.0), \
            as_block(rand(dim, batch * length))
    else:
        u, delta, z = rand(batch, dim, length), rand(batch, dim, length) * 0.5 - 1.0, rand(batch, dim, length)
    A = -(0.2 + torch.rand(dim, n_states, generator=g)).to(DEVICE)
    if layout == "block":   # one x_proj output holds both: (2 groups N, batch L)
        x_dbl = as_block(rand(2 * groups * n_states, batch * length))      # batch x 2 groups N x L
        coefficients = x_dbl.unflatten(1, (2, groups, n_states)).unbind(1)
    else:
        coefficients = [rand(batch, groups, n_states, length) for _ in range(2)]
    B, C = (rand(dim, n_states) if name in time_invariant else coef for name, coef in zip("BC", coefficients))
    return dict(u=u, delta=delta, A=A, B=B, C=C, D=rand(dim, dt=torch.float32) if "D" in options else None,
                z=z if "z" in options else None,
                delta_bias=rand(dim, dt=torch.float32) * 0.3 if "b" in options else None,
                initial_state=rand(batch, dim, n_states, dt=torch.float32) if "H" in options else None)


def worst_error(scan, inputs, softplus=True):
    """The largest error, relative to the reference's scale, over out, the last state and every gradient."""
    leaves = {k: v.detach().requires_grad_() for k, v in inputs.items() if v is not None}
    wide = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    results = []
    for fn, args in ((scan, leaves), (selective_scan_ref, wide)):
        out, last = fn(**args, delta_softplus=softplus, return_last_state=True)
        torch.manual_seed(1)
        dout = torch.randn(out.shape, dtype=torch.float64).to(inputs["u"].dtype).double().to(DEVICE)
        dlast = torch.randn(last.shape, dtype=torch.float64, device=DEVICE)
        loss = (out.double() * dout).sum() + (last.double() * dlast).sum()
        results.append([out, last, *torch.autograd.grad(loss, list(args.values()))])
    return max(((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
               for got, want in zip(*results))


def tolerance(dtype, length):
    final = {torch.bfloat16: 2**-7, torch.float16: 2**-11, torch.float32: 0.0}[dtype]
    return final + 32 * math.sqrt(max(length, 16)) * 2**-24


CASES = [  # (batch, dim, N, L, keyword arguments of random_inputs)
    (2, 4, 3, 1, dict()), (2, 4, 3, 1, dict(options="Dzb")), (1, 6, 4, 7, dict(groups=3, options="DzH")),
    (1, 4, 2, 129, dict(groups=2, options="Db")), (1, 3, 5, 50, dict(options="")),
    (2, 5, 3, 33, dict(time_invariant="BC")), (1, 6, 4, 40, dict(layout="channels_last")),
    (1, 4, 3, 77, dict(dtype=torch.bfloat16, layout="channels_last")), (2, 6, 4, 45, dict(layout="block")),
    (3, 4, 2, 70, dict(groups=2, dtype=torch.bfloat16, layout="block")),
    (2, 64, 16, 4097, dict()) if ON_GPU else (1, 3, 16, 300, dict()),
]
print(f"{'batch, dim, N, L':18s} {'options':42s} {'worst rel err':>13s} {'tolerance':>10s}")
for batch, dim, n_states, length, kwargs in CASES:
    inputs = random_inputs(batch, dim, n_states, length, seed=length, **kwargs)
    err, tol = worst_error(selective_scan, inputs), tolerance(inputs["u"].dtype, length)
    print(f"{str((batch, dim, n_states, length)):18s} {str(kwargs):42s} {err:13.2e} {tol:10.2e}")
    assert err < tol, (batch, dim, n_states, length, kwargs, err)
print("split into segments (section 5):")
split_cases = [(3, CASES[3]), (5, CASES[6])] + ([(2, CASES[2]), (4, CASES[-1])] if ON_GPU else [])
for segments, (batch, dim, n_states, length, kwargs) in split_cases:
    inputs = random_inputs(batch, dim, n_states, length, seed=length, **kwargs)
    split_scan = functools.partial(scan_in_segments, segments=segments)
    err, tol = worst_error(split_scan, inputs), tolerance(inputs["u"].dtype, length)
    print(f"{str((batch, dim, n_states, length)):18s} {segments} segments {str(kwargs):31s} {err:13.2e} {tol:10.2e}")
    assert err < tol, (segments, batch, dim, n_states, length, kwargs, err)
exact = random_inputs(2, 4, 3, 1, options="Dzb")      # L = 1, no initial state: section 4's first position
leaves = {k: v.requires_grad_() for k, v in exact.items() if v is not None}
assert torch.all(torch.autograd.grad(selective_scan(**leaves, delta_softplus=True).sum(), leaves["A"])[0] == 0)
print("dA is exactly 0 at L = 1 without an initial state")

# %% [markdown]
# ## Going deeper: segments and states per step, measured
#
# (GPU only.) Section 5's split at batch 1 with a long sequence, where the programs are few, and at
# the usual size, where they are many: forward and training step, bf16, the block's layout, the
# sequence in 1, 2, 4 and 8 segments. And, since long sequences behave differently, the forward's
# chunk (256, 512 or 1024 positions) at both sizes. The cells below use section 6's `inference`.

# %%
if not ON_GPU:
    print("skipped: needs a GPU")
else:
    multiprocessors = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    print(torch.cuda.get_device_name(), f"({multiprocessors} multiprocessors), bf16, block layout; median us (do_bench)")
    print(f"at batch 1, dim 1536: {1536 * GPU_CONFIG['fwd']['num_warps'] / multiprocessors:.0f} warps per multiprocessor")
    split_times, chunk_times = {}, {}
    for shape in ((1, 1536, 65536, 16), (8, 1024, 2048, 16)):
        inputs = block_layout_inputs(*shape, torch.bfloat16)
        for name, run in (("fwd", inference), ("fwd+bwd", training_step)):
            times = [median_us(lambda: run(functools.partial(scan_in_segments, segments=n), inputs), rep=50)
                     for n in (1, 2, 4, 8)]
            split_times[shape, name] = times
            print(f"(batch, dim, L, N) = {str(shape):20s} {name:8s} segments 1, 2, 4, 8: "
                  + " ".join(f"{us:7.0f}" for us in times))
        chosen_fwd = dict(GPU_CONFIG["fwd"])
        for chunk in (256, 512, 1024):
            GPU_CONFIG["fwd"] = dict(chosen_fwd, chunk=chunk)
            chunk_times[shape, chunk] = median_us(lambda: inference(selective_scan, inputs), rep=50)
        GPU_CONFIG["fwd"] = chosen_fwd
        print(f"{'':41s} forward chunk 256, 512, 1024: "
              + " ".join(f"{chunk_times[shape, chunk]:7.0f}" for chunk in (256, 512, 1024)) + " us")
    for (shape, name), times in split_times.items():
        best = min(range(4), key=times.__getitem__)
        print(f"{str(shape):20s} {name:8s}: fastest with {2**best} segment(s), "
              f"{times[0] / times[best]:.2f}x the time of one segment over the fastest")

# %% [markdown]
# (On a GPU.) The lines after the timings say, row by row, which number of segments was fastest and
# by how much one segment loses to it. Phase 1 costs almost as much as phase 3: both run every `exp`
# and every scan, and those, not the loads and stores phase 1 skips, are most of the forward's work;
# so a split roughly doubles the work, and it pays only where the programs it adds find a GPU that
# would otherwise be idle. That is the case only for few programs: the cell's second line gives the
# warps per multiprocessor at batch 1 with one channel per program (half that with two channels per
# program). Section 5's prediction failed: in the recorded run one segment is the fastest in every
# row. At batch 1 the best split, 8 segments, takes 1.44 times the forward's time of one (3193
# against 2215 µs) and 1.15 times the training step's (12398 against 10812); at the usual size two
# segments take 1.77 times the forward's time of one (513 against 290 µs), close to the doubled work.
# `selective_scan` keeps one segment (`segments` stays 1); where a row shows a split faster (none
# does on this run's H100), that is speed still left at small batch. A split would pay more with a
# phase 1 much cheaper than the forward: the segment's end state is a sum,
# $\hat h_s = \sum_t e^{A(\Sigma_{\le \text{end}} - \Sigma_{\le t})}\Delta_t B_t u_t$, a reduction
# instead of a scan, though with the same `exp`s.
#
# The forward's chunk is measured at both sizes too (the "forward chunk" lines): `GPU_CONFIG`'s 512
# positions, from earlier runs of the sweep in "Going deeper: ideas that did not pay", are the fastest
# of the three at both sizes here in bf16 (2221 and 290 µs).
#
# ### States per step
#
# How many states per step pay depends on the chunk (a thread holds `CHUNK` / 32 positions of every
# tile) and on the programs per multiprocessor: a multiprocessor has 65,536 registers of 32 bits, so at
# 200 per thread it holds 10 warps of 32 threads, and if the unrolled forward needs so many that a small
# batch's programs no longer all fit at once, the time nearly doubles. `FORWARD_STATES_PER_STEP`,
# measured on an H100 (`benchmarks/NOTES_selective_scan.md` has the sweep it came from), says: with
# chunks of 512 positions, the forward's own, two states per step up to 24 programs per multiprocessor
# and one beyond; with chunks of 256 or fewer (a sequence that short, or a config that asks for them),
# all 16 states up to 16 programs per multiprocessor and two beyond; with 4 states or fewer, all of
# them. The backward issues about twice the forward's instructions per (position, state) and in bf16
# sits at the register limit with one state (36.4 against 17.4 instructions, 254 registers: the
# counts in "Going deeper: the backward kernel"); two states per step measured no faster there
# (NOTES), so it keeps one.
#
# One more change keeps the forward at its own chunk in training. The backward needs the state
# entering each of *its* chunks (128 positions in fp32, 256 in bf16), and the forward used to run
# with that chunk for the sake of saving them. Now it runs its 512 positions and saves, besides the
# state entering its chunk, the states entering the pieces of the backward's chunk inside it: each
# the tile's state just before the piece, picked out with a masked sum over the chunk (one warp
# reduction per piece, state and chunk, like the carry's). In training the forward should then take
# about as long as without gradients, plus a few percent for the extra reductions.
#
# (GPU only.) The forward at the same two sizes and at batch 2 and 4 of the long shape's width, bf16,
# the block's layout, with the launch parameters it had before (two channels per program, one state
# per step), with one channel per program and 1, 2 or 16 states per step, and with `GPU_CONFIG` as it
# stands (`states_per_step`'s choice). Twice: as a forward without gradients runs it, and as training
# runs it, keeping the states the backward needs (before at the backward's chunk, now at its own with
# the extra saves).

# %%
if not ON_GPU:
    print("skipped: needs a GPU")
else:
    chosen_fwd = dict(GPU_CONFIG["fwd"])

    def variants(save_chunk):
        """The launch parameters compared; before this section, training ran the backward's chunk."""
        return {"2 channels, 1 state": dict(block_d=2, chunk=save_chunk or 512, num_warps=1, unroll=1),
                "1 channel, 1 state": dict(block_d=1, chunk=512, num_warps=1, unroll=1),
                "1 channel, 2 states": dict(block_d=1, chunk=512, num_warps=1, unroll=2),
                "1 channel, 16 states": dict(block_d=1, chunk=512, num_warps=1, unroll=16),
                "GPU_CONFIG": chosen_fwd}

    def forward_op(inputs, save_chunk):
        """The forward op alone, as a call without gradients (save_chunk 0) or training runs it."""
        u, delta, A, B, C, D, z, delta_bias = inputs
        return lambda: strided_fwd(u, delta, A, B[:, None], C[:, None], D, z, delta_bias, None, True, save_chunk, 1)

    print(torch.cuda.get_device_name(), "forward op, bf16, block layout, every option; median us (do_bench)")
    print(f"{'':9s}{'(batch, dim, L, N)':22s}" + "".join(f"{name:>21s}" for name in variants(0)))
    for mode in ("no grad", "training"):
        for shape in ((1, 1536, 65536, 16), (2, 1536, 8192, 16), (4, 1536, 8192, 16), (8, 1024, 2048, 16)):
            inputs = block_layout_inputs(*shape, torch.bfloat16)
            save_chunk = backward_chunk(inputs[0], inputs[3][:, None], inputs[4][:, None]) if mode == "training" else 0
            times = []
            for config in variants(save_chunk).values():
                GPU_CONFIG["fwd"] = config
                times.append(median_us(forward_op(inputs, save_chunk), rep=50))
            GPU_CONFIG["fwd"] = chosen_fwd
            print(f"{mode:9s}{str(shape):22s}" + "".join(f"{us:21.0f}" for us in times))

# %% [markdown]
# (On a GPU.) Read each row from the left: the first column is the forward as it was before section 5's
# states per step, the next three isolate one channel per program and then the states per step, and
# the last is what `selective_scan` now runs. Where `GPU_CONFIG`'s column is not the smallest of its
# row, the table of `states_per_step` is off for that shape on this GPU. In the recorded run, on an
# H100 like the one the table was measured on, it is the smallest of every row or within 1 µs of it
# (2338 against 2337 µs in training at batch 1); other GPUs hold other numbers of warps per
# multiprocessor. Between the two modes, the first column adds the old training chunk (at batch 1,
# 5144 against 2728 µs); the others differ only by the states saved for the backward, which is what
# those saves cost: in `GPU_CONFIG`'s column 4 and 3% at batch 1 and 2 (2338 against 2240 µs at batch
# 1), as predicted, but 8 and 9% at batch 4 and 8 (949 against 876, 311 against 285).
#
# ## Going deeper: the atomics
#
# $\partial\mathcal L/\partial B_{t,n}$ sums over every channel of the group: 1024 channels add into
# each (batch, state, position) entry. Each program sums its `block_d` channels' contributions and
# adds the sum with `tl.atomic_add`: batch $\cdot$ dim $\cdot N \cdot L$ / `block_d` atomic additions
# for $dB$ and as many for $dC$, 268 million each with one channel per program, half that with
# `GPU_CONFIG`'s two. To see what they cost, a kernel that does only atomic additions, with the
# backward's chunk and warps but one program per (batch, channel), so 268 million of them, is timed on
# its own.

# %%
@triton.jit
def atomics_only_kernel(DB, dim, length, n_chunks, N_STATES: tl.constexpr, CHUNK: tl.constexpr):
    """The backward's dB (or dC) additions alone: one program per (batch, channel), N rows per chunk."""
    pid_b = tl.program_id(0)
    ts = tl.arange(0, CHUNK)
    value = (tl.program_id(1) + ts).to(tl.float32)
    for k in range(0, n_chunks):
        t = k * CHUNK + ts
        for n in range(0, N_STATES):
            tl.atomic_add(DB + (pid_b * N_STATES + n) * length + t, value, t < length, sem="relaxed")


if not ON_GPU:
    print("skipped: needs a GPU")
else:
    batch, dim, length, n_states = 8, 1024, 2048, 16
    config = GPU_CONFIG["bwd"]
    dB = torch.zeros(batch, n_states, length, device=DEVICE)
    atomics_us = median_us(lambda: atomics_only_kernel[(batch, dim)](
        dB, dim, length, triton.cdiv(length, config["chunk"]), N_STATES=n_states, CHUNK=config["chunk"],
        num_warps=config["num_warps"]))
    u, delta, A, B, C, D, z, delta_bias = block_layout_inputs(batch, dim, length, n_states, torch.float32)
    bwd_inputs = (u, delta, A, B[:, None], C[:, None], D, z, delta_bias)      # B, C as (batch, groups=1, N, L)
    states = strided_fwd(*bwd_inputs, None, True, config["chunk"], 1)[2]
    dout = torch.randn_like(u)
    bwd_us = median_us(lambda: strided_bwd(*bwd_inputs, states, dout, None, True, config["chunk"], 1))
    print(f"{torch.cuda.get_device_name()}, (8, 1024, 2048, N=16) fp32: backward kernel {bwd_us:.0f} us; "
          f"dB additions alone {atomics_us:.0f} us, dB and dC {2 * atomics_us:.0f} us "
          f"({2 * atomics_us / bwd_us:.0%} of the backward if they do not overlap other work)")

# %% [markdown]
# (On a GPU.) The atomic additions alone take a large share of the backward's time (the line above:
# 849 of 1251 µs in the recorded run; it times one addition per channel, twice as many as the backward
# with two channels per program issues, so it overstates their share).
# `mamba_ssm` adds per channel too, but first rearranges each thread block's values so that every
# warp adds 32 consecutive floats. Triton gets there by another route: its layout gives each thread 4
# consecutive positions (16 bytes) and adds them with one 4-wide reduction instruction, so the memory
# system receives the same requests and sectors either way. (Rearranging the values to one position
# per lane, as `mamba_ssm` does, was tried on an H100: Nsight Compute counted the same L2 requests
# and sectors, four times the reduction instructions, and the backward got slower;
# `benchmarks/NOTES_selective_scan.md`, eleventh look.) Summing several channels
# in one program before adding (`block_d` > 1) divides the additions, but fewer programs then share
# the GPU; the sweep in the next section tries one and two channels per program (in the recorded run the
# backward's best had two, as `GPU_CONFIG` has, but chunks of 256 positions where `GPU_CONFIG` has
# 128, and `GPU_CONFIG`'s row came within 1.04x of it, 1140 against 1101 µs). Two ways around it that
# this chapter has not built: accumulate $dB$ per group of channels in a workspace and reduce it with one more kernel
# (the bytes: $\text{dim}/g \cdot N \cdot L$ floats per batch element), or reformulate the backward so
# that the sum over channels becomes a matrix product (Mamba-2's "state space duality" does exactly this
# for a scalar $A$ per head).
#
# ## Going deeper: ideas that did not pay
#
# ### One `exp` fewer: $a_t h_{t-1} = h_t - b_t$
#
# Chapter 05's backward evaluates three `exp`s per element: $a_t$ for the states, $a_{t-1}$ for the scan
# that gives $h_{t-1}$, and $a_{t+1}$ for the adjoint; section 4's runs take $h_{t-1}$ and $a_{t+1}$ from
# registers instead. A shorter route to the same saving is the identity $a_t h_{t-1} = h_t - b_t$,
# which is all the gradients need from $h_{t-1}$ (`mamba_ssm`'s backward uses it): one scan over the
# steps of position $t$, a subtraction, and no $a_{t-1}$. A version of the backward built that way (one `exp` and one load of
# $B$ fewer per element and state) passed most of the tests, then failed one: with large steps ($\Delta \approx 25$, so
# $a_t = e^{\Delta A}$ is tiny and the state forgets almost at once), $\partial\mathcal L/\partial A$
# was off by far more than the test's tolerance. The reason is cancellation: when $a_t h_{t-1} \ll b_t$, the
# float32 difference $h_t - b_t$ keeps only the rounding error of $h_t$, which is of the size of $b_t$,
# not of $a_t h_{t-1}$. The cell shows it in plain PyTorch, one step, against float64.

# %%
torch.manual_seed(0)
h_prev, b_step = torch.randn(10_000, dtype=torch.float64), torch.randn(10_000, dtype=torch.float64)
for step in (0.1, 5.0, 25.0):
    a_step = torch.exp(torch.tensor(-step, dtype=torch.float64))           # A = -1
    exact = a_step * h_prev                                                  # a_t h_{t-1}
    h32 = (a_step.float() * h_prev.float() + b_step.float())                 # the float32 state
    from_difference = (h32 - b_step.float()).double()
    relative = ((from_difference - exact).abs().max() / exact.abs().max()).item()
    print(f"step {step:5.1f}: a_t = {a_step.item():.1e}, max error of h_t - b_t relative to a_t h_(t-1): {relative:.1e}")
    if step == 25.0:
        assert relative > 1e-3, "the cancellation this section describes did not happen"

# %% [markdown]
# ### All states at once: a three-dimensional tile
#
# Chapter 05's guess was that the loop over the states, one scan of a (`BLOCK_D`, `CHUNK`) tile per
# state, issues too many small scans. The alternative: one tile of shape (`BLOCK_D`, $N$, `CHUNK`), all
# states discretised and scanned in one `tl.associative_scan` along the last axis, $\bar y$ a sum over
# the middle axis. Fewer, larger operations; no loop over the states. Prediction: faster, if the loop's
# overhead was the problem. The forward below is checked and then timed at its best launch parameters.

# %%
@triton.jit
def all_states_fwd_kernel(U, DELTA, A, B, C, OUT, dim, length, n_states, n_chunks,
                          BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """out = S6(u, delta, A, B, C) for contiguous u, delta (b, d, L), A (d, N), B, C (b, N, L): every
    state of BLOCK_D channels in one BLOCK_D x N x CHUNK tile, scanned along its last axis."""
    pid_b, pid_d = tl.program_id(0), tl.program_id(1)
    ds = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    ns = tl.arange(0, BLOCK_N)
    ts = tl.arange(0, CHUNK)
    d_ok, n_ok = ds < dim, ns < n_states
    rate = tl.load(A + ds[:, None] * n_states + ns[None, :], d_ok[:, None] & n_ok[None, :], other=0.0)
    carry = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    first, last = ts[None, None, :] == 0, ts[None, None, :] == CHUNK - 1
    for k in range(0, n_chunks):
        t = k * CHUNK + ts
        mask = d_ok[:, None] & (t < length)[None, :]                               # BLOCK_D x CHUNK
        offs = (pid_b * dim + ds[:, None]) * length + t[None, :]
        u = tl.load(U + offs, mask, other=0.0)
        delta = tl.load(DELTA + offs, mask, other=0.0)
        nt_offs, nt_ok = ns[:, None] * length + t[None, :], n_ok[:, None] & (t < length)[None, :]
        b_coef = tl.load(B + pid_b * n_states * length + nt_offs, nt_ok, other=0.0)[None, :, :]   # 1 x N x CHUNK
        c_coef = tl.load(C + pid_b * n_states * length + nt_offs, nt_ok, other=0.0)[None, :, :]
        a, b = discretize(delta[:, None, :], rate[:, :, None], b_coef, u[:, None, :])       # BLOCK_D x N x CHUNK
        b = tl.where(first, b + a * carry[:, :, None], b)
        _, h = tl.associative_scan((a, b), axis=2, combine_fn=first_order_op)
        tl.store(OUT + offs, tl.sum(c_coef * h, axis=1), mask)
        carry = tl.sum(tl.where(last, h, 0.0), axis=2)


def all_states_forward(u, delta, A, B, C, block_d, chunk, num_warps):
    batch, dim, length = u.shape
    out = torch.empty_like(u)
    all_states_fwd_kernel[(batch, triton.cdiv(dim, block_d))](
        u, delta, A, B, C, out, dim, length, A.shape[1], triton.cdiv(length, chunk),
        BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(A.shape[1]), CHUNK=chunk, num_warps=num_warps)
    return out


check = random_inputs(2, 5, 3, 45, options="")
step = torch.nn.functional.softplus(check["delta"])              # positive steps: decaying states
B_rows, C_rows = check["B"][:, 0].contiguous(), check["C"][:, 0].contiguous()
want = selective_scan_ref(check["u"], step, check["A"], B_rows, C_rows)
got = all_states_forward(check["u"], step, check["A"], B_rows, C_rows, block_d=2, chunk=16, num_warps=1)
err = ((got.double() - want).abs().max() / want.abs().max()).item()
print(f"all states in one tile: max error {err:.1e} relative to the float64 reference's scale")
assert err < tolerance(torch.float32, 45)

# %% [markdown]
# ### The sweep
#
# (GPU only.) Both forwards over their launch parameters (channels per program, chunk, warps; for the
# loop over states also two states per step, at one channel and one warp), and the backward over its
# own, at (8, 1024, 2048, $N$=16) in fp32, without $D$, $z$ or `delta_bias` (the three-dimensional
# kernel has none). `GPU_CONFIG` above holds the winners of earlier runs of this sweep, and the
# forward's states per step come from bf16 measurements like those of "Going deeper: segments and
# states per step, measured"; the cell prints how far the config in force is from this run's best,
# and fails only on a gross miss (1.5x): the best forward config depends on the dtype and the GPU,
# and one table serves them all.

# %%
if not ON_GPU:
    print("skipped: needs a GPU")
else:
    import itertools
    plain = [t.contiguous() for t in block_layout_inputs(8, 1024, 2048, 16, torch.float32)[:5]]
    u, delta, A, B, C = plain
    delta = torch.nn.functional.softplus(delta)                             # positive steps: decaying states
    sweep = []

    def forward_with(config):
        GPU_CONFIG["fwd"] = config
        return median_us(lambda: strided_fwd(u, delta, A, B[:, None], C[:, None], None, None, None, None,
                                             False, 0, 1), warmup=5, rep=40)

    def backward_with(config):
        GPU_CONFIG["bwd"] = config
        states = strided_fwd(u, delta, A, B[:, None], C[:, None], None, None, None, None, False, config["chunk"], 1)[2]
        dout = torch.randn_like(u)
        return median_us(lambda: strided_bwd(u, delta, A, B[:, None], C[:, None], None, None, None, states, dout,
                                             None, False, config["chunk"], 1), warmup=5, rep=40)

    chosen = {kind: dict(config) for kind, config in GPU_CONFIG.items()}
    fwd_configs = [dict(block_d=block_d, chunk=chunk, num_warps=num_warps, unroll=1)
                   for block_d, chunk, num_warps in itertools.product((1, 2), (256, 512, 1024), (1, 2))]
    fwd_configs += [dict(block_d=1, chunk=chunk, num_warps=1, unroll=2) for chunk in (256, 512, 1024)]
    for config in fwd_configs:
        sweep.append(("loop over states, fwd", config, forward_with(config)))
    for block_d, chunk, num_warps in itertools.product((1, 2), (128, 256, 512), (1, 2)):
        config = dict(block_d=block_d, chunk=chunk, num_warps=num_warps)
        sweep.append(("loop over states, bwd", config, backward_with(config)))
    for block_d, chunk, num_warps in itertools.product((1, 2, 4), (32, 64, 128), (2, 4)):
        config = dict(block_d=block_d, chunk=chunk, num_warps=num_warps)
        sweep.append(("all states in one tile, fwd", config, median_us(
            lambda: all_states_forward(u, delta, A, B, C, **config), warmup=5, rep=40)))
    GPU_CONFIG.update(chosen)
    print(torch.cuda.get_device_name(), "(8, 1024, 2048, N=16) fp32, median us; the best of each kind:")
    for kind in dict.fromkeys(k for k, _, _ in sweep):
        rows = sorted((us, config) for k, config, us in sweep if k == kind)
        print(f"  {kind:30s} best {rows[0][0]:7.0f} us at {rows[0][1]}; worst {rows[-1][0]:7.0f} us")
        if kind.startswith("loop"):
            default = next(us for k, config, us in sweep if k == kind and all(
                GPU_CONFIG[kind[-3:]].get(key, 1) == value for key, value in config.items()))
            print(f"  {'':30s} GPU_CONFIG['{kind[-3:]}'] {GPU_CONFIG[kind[-3:]]}: {default:7.0f} us, "
                  f"{default / rows[0][0]:.2f}x the best")
            # the table is tuned in bf16, and timings move by a few percent under load: only a gross miss fails
            assert default <= 1.5 * rows[0][0], f"GPU_CONFIG['{kind[-3:]}'] is more than 1.5x slower than the best"
    best = {kind: min(us for k, _, us in sweep if k == kind) for kind in ("loop over states, fwd", "all states in one tile, fwd")}
    tile_over_loop = best["all states in one tile, fwd"] / best["loop over states, fwd"]
    print(f"  best of all states in one tile / best of the loop over states: {tile_over_loop:.2f}")
    assert tile_over_loop > 1.3, "the three-dimensional tile was not clearly slower"

# %% [markdown]
# (On a GPU.) The three-dimensional tile is *slower* than the loop over states, by the factor on the
# last line (2.27 in the recorded run; the cell asserts at least 1.3): the prediction failed. A scan
# along the last axis of a three-dimensional tile spreads each row's positions over fewer threads per
# warp, and extracting the carry becomes a reduction over the chunk for every state: the loop had
# neither problem to begin with. Its cost was not the loop. The best rows say whether more than one
# channel per program (`block_d` 2, which shares each load of $B$ and $C$ between two channels) paid,
# and for the forward whether two states per step (section 5) did at this size: in the recorded run
# the backward's best has two channels, the forward's one channel and two states per step.
# `GPU_CONFIG` holds the values earlier runs of this sweep and of the states-per-step measurements
# chose (the cell prints how far it is from this run's best, and checks that it is within 1.5x). On
# this run's H100 the backward's is 1.04x its best (1140 against 1101 µs), the forward's 1.32x (437
# against 332 µs): in fp32 the forward prefers chunks of 1024 positions with two states per step,
# where the table, tuned in bf16 (where 512 positions win: "Going deeper: segments and states per
# step, measured"), gives 512 positions and, with this many programs, one state per step. A table
# per dtype is open work (issue 20).

# %% [markdown]
# ## Going deeper: the host's share
#
# The GPU runs only what the host has queued. A training step's Python (the checks, the allocations,
# autograd's bookkeeping, each launch) takes time on the CPU whatever the kernels do, and when it
# takes longer than the kernels the GPU waits. Three numbers per step say which side sets the pace:
# `do_bench`'s time of the whole step; the host's time to queue one step (`host_us`: steps back to
# back, no synchronisation inside, so the timer measures only the host's work); and the sum of the
# step's kernel durations (`kernel_times`, section 2's profiler). When the kernels are the larger,
# the step follows them; when the host is the larger, `do_bench`'s step time is only a rough guide
# (in the rows below it lands sometimes over the host's time, sometimes under it): compare the host
# and kernel columns to see which side sets the pace. The same step with the Launchers ("Going deeper:
# the launchers and the public function") going through Triton's `kernel[grid](...)`
# (`triton_launched`) shows what the Launchers save, and `mamba_ssm`, where it is importable, is
# measured the same way. The host's
# samples of the rows are taken in turn, five rounds of 20 steps (`host_split`), so that a slow
# spell of the host falls on every row alike.

# %%
import statistics

from scan_lib.runtime import host_us, median_us


def host_split(steps, rounds=5):
    """{row: (step, host per step, kernels per step)} in us for training steps {row: step()}. The host's
    samples are taken in turn, one per row per round, so that a slow spell of the host falls on every
    row alike; each row's median of its rounds."""
    hosts = {row: [] for row in steps}
    for _ in range(rounds):
        for row, step in steps.items():
            hosts[row].append(host_us(step, 20))
    return {row: (median_us(step, warmup=5, rep=50), statistics.median(hosts[row]),
                  sum(kernel_times(step).values())) for row, step in steps.items()}


def triton_launched(step):
    """step() with the Launchers ("Going deeper: the launchers and the public function") going through Triton's kernel[grid](...) at every launch."""
    def run():
        Launcher.through_triton = True
        try:
            step()
        finally:
            Launcher.through_triton = False
    return run


if not ON_GPU:
    print("skipped: needs a GPU")
else:
    print(f"training step, bf16, block layout, every option; us per step on {torch.cuda.get_device_name()}")
    print(f"{'(batch, dim, L, N)':22s} {'':28s} {'step':>7s} {'host':>7s} {'kernels':>8s}")
    rows = {name: fn for name, fn in peers().items() if name != "chapter 05"}
    for shape in [(8, 1024, 512, 16), (8, 1024, 2048, 4), (8, 1024, 2048, 16), (1, 2048, 2048, 16)]:
        inputs = block_layout_inputs(*shape, torch.bfloat16)
        steps = {name: functools.partial(training_step, fn, inputs) for name, fn in rows.items()}
        steps["chapter 07, Triton launches"] = triton_launched(steps["chapter 07"])
        for name, times in host_split(steps).items():
            print(f"{str(shape):22s} {name:28s} {'%7.0f %7.0f %8.0f' % times}")

# %% [markdown]
# (On a GPU.) Read each row as: which of host and kernels is the larger, and how the step compares
# with it. In the run recorded here chapter 07's kernels are faster than `mamba_ssm`'s at all four
# shapes (343 against 366 µs at $L$ 512, 495 against 557 at $N$ 4, 1286 against 1563 at the base
# shape, 393 against 470 at (1, 2048, 2048, 16)), but its host time per step is 1.4 to 1.5 times
# `mamba_ssm`'s at every shape (790 to 846 µs against 552 to 602): `mamba_ssm`'s launchers are
# C++, ours are Python. At the three smaller shapes our host time is larger than our kernels' (790
# against 343 µs at $L$ 512, 846 against 495 at $N$ 4, 820 against 393 at (1, 2048, 2048, 16)): the
# GPU waits for Python, and there `mamba_ssm`'s step is the faster (713 against 899 µs, 684 against
# 787, 630 against 780); its host is the larger of its two columns too, by less. At the base shape
# the kernels are the larger (1286 against 815 µs of host time); the step (1303 µs) follows them and
# is ahead of `mamba_ssm`'s (1583), which follows its kernels too (1563 µs, over its host's 587).
# Section 7's series timed the same steps at 1304 and 1584 µs, ours ahead.
#
# The rows with Triton's own launches show what the Launchers save: 152 to 196 µs of host time per
# step in this run (942 against 790 µs at $L$ 512, 1021 against 846 at $N$ 4, 1011 against 815 at the
# base shape, 991 against 820 at (1, 2048, 2048, 16)): Triton's per-call work, twice per step (one
# launch per pass). Every host time here depends on the machine's CPU and on what else it runs, so
# read the differences, not the absolute values. The step column moves with the host where the host
# is the larger (948 against 899 µs at $L$ 512, 1033 against 787 at $N$ 4, 1014 against 780 at
# (1, 2048, 2048, 16)), not at the base shape, where the kernels set the pace (1303 against 1303 µs),
# and it moves between sections too where the host is the larger (at $L$ 512: 899 µs here, 650 in
# section 7's series; at the base shape 1303 here, 1304 there): steps near or over the host's time
# measure noisily, and section 7's rows near 1 should be read with it.
# What is left on the host is spread over the path, not in one place (a count on a CPU with the
# launches stubbed, in `benchmarks/NOTES_selective_scan.md`): autograd's own work, which `mamba_ssm`
# pays too, then the ops' Python (allocations, the plan lookups, the split of the summed buffer) and
# Triton's launcher per launch. The short rows are won or lost there; `benchmarks/step_split.py`
# lists the host's largest operations per step.

# %% [markdown]
# ## References
#
# - Williams, Waterman and Patterson, "Roofline: an insightful visual performance model for multicore architectures", Communications of the ACM 52(4), 2009.
# - Volkov, "Better performance at lower occupancy", GPU Technology Conference, 2010.
# - NVIDIA, Nsight Compute documentation (sections, metrics, source counters) and the Hopper tuning guide.
# - Gu and Dao, "Mamba: linear-time sequence modeling with selective state spaces", arXiv:2312.00752, 2023. (the hardware-aware scan).
# - The mamba_ssm package's selective-scan CUDA kernels: https://github.com/state-spaces/mamba
