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
# # 03 · The backward pass is a scan too
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/scan-course/scans-the-hard-way/blob/main/notebooks/03_backward.ipynb)
#
# A Triton kernel is opaque to autograd: to train through chapter 02's scan we write its backward
# pass ourselves. You will
#
# - derive the gradients of $h_t = a_t h_{t-1} + b_t$ and see that the adjoint is **the same linear
#   scan, run right to left, with the gates shifted by one**;
# - check the formulas against `torch.autograd`, then in a one-block kernel, then in a blocked kernel
#   for any length;
# - hand both kernels to autograd with a `torch.autograd.Function`, check **every** gradient, and time
#   the library's `scan_lib.linear_scan` (differentiable twice, too) on a GPU against the memory floor.

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
#| default_exp linear_scan

# %%
import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

from scan_lib.ema import FWD_CONFIG, error_bound, linear_scan_rows, scan_chunk
from scan_lib.runtime import INTERPRET, save_figure

# %% [markdown]
# ## 1. The adjoint
#
# Chapter 02 scans the pairs $(a_t, b_t)$: $h_t = a_t h_{t-1} + b_t$ for $t = 0, \dots, L-1$, from an
# initial state $h_{-1}$, and the output is the state, $y_t = h_t$. For any loss $\mathcal L$, the layers
# above hand us $\partial\mathcal L/\partial y_t$ (`dy` in the code). The state $h_t$ reaches the loss
# through its own output $y_t$ and through the next state $h_{t+1} = a_{t+1} h_t + b_{t+1}$. Call the
# total derivative the **adjoint**, $\delta_t = \partial\mathcal L/\partial h_t$ (`delta`). The chain
# rule gives
#
# $$\delta_t \;=\; \frac{\partial\mathcal L}{\partial y_t} \;+\; a_{t+1}\,\delta_{t+1},
#   \qquad \delta_{L-1} = \frac{\partial\mathcal L}{\partial y_{L-1}} .$$
#
# This is the recurrence we can already scan, with three changes: it runs **right to left**, its tokens
# are the incoming gradients $\partial\mathcal L/\partial y_t$, and its gate at position $t$ is $a_{t+1}$:
# the **gates shifted by one**, with $0$ past the end, where nothing follows. Each input touches the loss
# through one state only:
#
# $$\frac{\partial\mathcal L}{\partial b_t} = \delta_t, \qquad
#   \frac{\partial\mathcal L}{\partial a_t} = h_{t-1}\,\delta_t, \qquad
#   \frac{\partial\mathcal L}{\partial h_{-1}} = a_0\,\delta_0 .$$
#
# The gate's gradient needs the state *one step earlier*: the backward pass uses values from both
# directions, $h$ from the left and $\delta$ from the right. For the reverse scan
# ($h_t = a_t h_{t+1} + b_t$, initial state $h_L$) everything mirrors: the adjoint runs left to right with
# gates $a_{t-1}$, $\partial\mathcal L/\partial a_t = h_{t+1}\delta_t$ and
# $\partial\mathcal L/\partial h_L = a_{L-1}\delta_{L-1}$.

# %%
fig, ax = plt.subplots(figsize=(7, 2.6))
steps = 6
for t in range(steps):
    ax.text(t, 1, f"$h_{t}$", ha="center", va="center", bbox=dict(boxstyle="circle", fc="C0", alpha=0.25))
    ax.text(t, 0, rf"$\delta_{t}$", ha="center", va="center", bbox=dict(boxstyle="circle", fc="C1", alpha=0.25))
    ax.annotate(f"$b_{t}$", (t, 1.18), (t, 1.55), ha="center", arrowprops=dict(arrowstyle="->"))
    ax.annotate(rf"$\partial\mathcal{{L}}/\partial y_{t}$", (t, -0.18), (t, -0.6), ha="center",
                arrowprops=dict(arrowstyle="->"))
for t in range(steps - 1):
    ax.annotate("", (t + 0.8, 1), (t + 0.2, 1), arrowprops=dict(arrowstyle="->", color="C0"))
    ax.text(t + 0.5, 1.08, f"$a_{t + 1}$", ha="center", color="C0", fontsize=9)
    ax.annotate("", (t + 0.2, 0), (t + 0.8, 0), arrowprops=dict(arrowstyle="->", color="C1"))
    ax.text(t + 0.5, 0.08, f"$a_{t + 1}$", ha="center", color="C1", fontsize=9)
    ax.plot([t + 0.1, t + 0.9], [0.85, 0.15], ":", color="gray")  # h_{t-1} meets delta_t in d a_t
ax.text(steps - 0.4, 0.5, r"$\partial\mathcal{L}/\partial a_t = h_{t-1}\,\delta_t$ (dotted)", fontsize=9, va="center")
ax.set_xlim(-0.5, steps + 2.2)
ax.set_ylim(-0.8, 1.8)
ax.axis("off")
ax.set_title(r"$h$ flows from the left, the adjoint $\delta$ from the right, through the same gates", fontsize=10)
save_figure(fig, "adjoint_flow.png")

# %% [markdown]
# ## 2. A reference, and the formulas checked against it
#
# The loop is slow and obviously right, and `torch.autograd` differentiates it: every gradient in this
# chapter is checked against it, in float64. All tensors are (rows, L): independent rows, scanned along
# L; the reverse direction runs the loop on flipped inputs.

# %%
def scan_loop(a, b, h0=None, reverse=False):
    """h_t = a_t * h_{t-1} + b_t along the last dim (reverse: h_{t+1}); a, b (rows, L), h0 (rows,) or None."""
    if reverse:
        return scan_loop(a.flip(-1), b.flip(-1), h0).flip(-1)
    h = torch.zeros_like(b[:, 0]) if h0 is None else h0
    states = []
    for t in range(b.shape[-1]):
        h = a[:, t] * h + b[:, t]  # rows
        states.append(h)
    return torch.stack(states, -1)  # rows x L


def reference_grads(a, b, h0, dy, reverse=False):
    """(h, da, db, dh0) in float64 by autograd through scan_loop, for the loss sum(h * dy)."""
    inputs = [t.detach().double().requires_grad_() for t in (a, b, h0)]
    h = scan_loop(*inputs, reverse=reverse)
    return (h.detach(), *torch.autograd.grad(h, inputs, dy.double()))

# %% [markdown]
# The formulas in PyTorch, with both scans done by chapter 02's forward kernel: the adjoint is its
# reverse scan of the incoming gradient with the shifted gates ("Going deeper: what the adjoint looks
# like" plots it for constant gates).

# %%
def shift_gates(a, reverse=False):
    """a_{t+1} at position t, 0 at the end (reverse: a_{t-1}, 0 at the start). (rows, L) -> (rows, L)."""
    zero = torch.zeros_like(a[:, :1])
    return torch.cat([zero, a[:, :-1]], -1) if reverse else torch.cat([a[:, 1:], zero], -1)


def grads_by_formula(a, b, h0, dy, reverse=False):
    """(h, da, db, dh0) from the formulas of section 1; both scans are chapter 02's kernel."""
    h = linear_scan_rows(a, b, h0, reverse=reverse)
    ### BEGIN SOLUTION
    ### HINT: delta = the adjoint: chapter 02's linear_scan_rows of dy with the shifted gates, against the direction of the forward scan
    delta = linear_scan_rows(shift_gates(a, reverse), dy, reverse=not reverse)  # the adjoint
    ### END SOLUTION
    if reverse:
        h_prev, first = torch.cat([h[:, 1:], h0[:, None]], -1), -1  # h_{t+1}; the scan starts at L - 1
    else:
        h_prev, first = torch.cat([h0[:, None], h[:, :-1]], -1), 0  # h_{t-1}
    return h, h_prev * delta, delta, a[:, first] * delta[:, first]


names = ["h", "da", "db", "dh0"]
torch.manual_seed(0)
print(f"{'L':>5} {'reverse':>8} " + " ".join(f"{n:>9}" for n in names))
for length in [1, 7, 129]:
    a = torch.rand(3, length, dtype=torch.float64, device=DEVICE)
    b, dy = torch.randn(2, 3, length, dtype=torch.float64, device=DEVICE)
    h0 = torch.randn(3, dtype=torch.float64, device=DEVICE)
    for reverse in [False, True]:
        expected = reference_grads(a, b, h0, dy, reverse)
        got = grads_by_formula(a, b, h0, dy, reverse)
        errors = [(g.cpu() - e.cpu()).abs().max().item() for g, e in zip(got, expected)]
        print(f"{length:5} {str(reverse):>8} " + " ".join(f"{err:9.1e}" for err in errors))
        assert max(errors) < 1e-12

# %% [markdown]
# ## 3. One block: forward and backward in one program
#
# With the whole row in one block, one program can do everything: the forward scan, the adjoint scan
# and the gradients. Both need the neighbour of each position, and a block of registers has no cheap
# "shift by one", so we shift **on the way in**: loading `A + t + 1` gives the gates $a_{t+1}$ for the
# adjoint, and loading the pairs at `t - 1` and scanning them gives $h_{t-1}$ directly (position 0
# gets the identity pair $(1, 0)$ with the initial state folded in, so it scans to $h_{-1}$). That costs
# a third scan, to avoid moving data between threads. `scan_chunk` (chapter 02) folds a starting state
# into the first pair of its scan order and returns the state that leaves the block.

# %%
@triton.jit
def scan_one_block_kernel(A, B, H0, DY, H, DA, DB, DH0, length, BLOCK: tl.constexpr):
    # A, B, DY, H, DA, DB: rows x length contiguous; H0, DH0: rows. One row per program, BLOCK >= length.
    row = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    mask = t < length
    offs = row * length + t
    a = tl.load(A + offs, mask=mask, other=1.0)
    b = tl.load(B + offs, mask=mask, other=0.0)
    dy = tl.load(DY + offs, mask=mask, other=0.0)
    h_init = tl.load(H0 + row)
    h, _ = scan_chunk(a, b, h_init, False)  # forward, left to right: h_t
    ### BEGIN SOLUTION
    ### HINT: h_prev = h_{t-1}: load the pairs at t - 1 (the identity pair (1, 0) at t = 0) and scan them forward from h_init
    before = mask & (t >= 1)
    a_prev = tl.load(A + offs - 1, mask=before, other=1.0)
    b_prev = tl.load(B + offs - 1, mask=before, other=0.0)
    h_prev, _ = scan_chunk(a_prev, b_prev, h_init, False)  # the pairs shifted right by one: h_{t-1}
    ### END SOLUTION
    a_next = tl.load(A + offs + 1, mask=t + 1 < length, other=0.0)
    delta, delta_0 = scan_chunk(a_next, dy, 0.0, True)  # right to left: delta_t = dy_t + a_{t+1} delta_{t+1}
    tl.store(H + offs, h, mask=mask)
    tl.store(DA + offs, h_prev * delta, mask=mask)
    tl.store(DB + offs, delta, mask=mask)
    tl.store(DH0 + row, tl.load(A + row * length) * delta_0)


def scan_one_block(a, b, h0, dy):
    """(h, da, db, dh0) for contiguous (rows, L) float32/float64 inputs and h0 (rows,)."""
    rows, length = b.shape
    h, da, db = (torch.empty_like(b) for _ in range(3))
    dh0 = torch.empty_like(h0)
    scan_one_block_kernel[(rows,)](a, b, h0, dy, h, da, db, dh0, length, BLOCK=triton.next_power_of_2(length))
    return h, da, db, dh0

# %% [markdown]
# In the adjoint, past the end the shifted gate is $0$, not the identity's $1$: harmless, because the
# adjoint *starts* there (it runs right to left) with a zero state and zero tokens. Every output and
# gradient, against autograd in float64:

# %%
torch.manual_seed(2)
rows_1b = 4 if ON_GPU else 2
print(f"{'L':>5} " + " ".join(f"{n:>9}" for n in names))
for length in [1, 7, 129, 1000, 4097]:
    a = torch.rand(rows_1b, length, dtype=torch.float64, device=DEVICE)
    b, dy = torch.randn(2, rows_1b, length, dtype=torch.float64, device=DEVICE)
    h0 = torch.randn(rows_1b, dtype=torch.float64, device=DEVICE)
    expected = reference_grads(a, b, h0, dy)
    got = scan_one_block(a, b, h0, dy)
    errors = [(g.cpu() - e.cpu()).abs().max().item() for g, e in zip(got, expected)]
    print(f"{length:5} " + " ".join(f"{err:9.1e}" for err in errors))
    assert max(errors) < 1e-9, dict(zip(names, errors))

# %% [markdown]
# ## 4. Any length: the blocked backward, and a `torch.autograd.Function`
#
# Chapter 02's forward kernel walks a row's chunks left to right with the state in a register. The
# backward kernel walks them **right to left** with the adjoint $\delta$ in a register, folded into each
# chunk by the same `scan_chunk` run the other way: $\delta$ flows from the right through the loop, $h$
# from the left through memory, read back from the forward's output by a load offset by one position
# ($h_{t-1}$), as the gates are by the opposite offset ($a_{t+1}$). In the padding it puts the identity
# pair $(1, 0)$, not section 3's zero gate ("Going deeper: padding in the adjoint" says why), so the
# carried adjoint passes through unchanged; what is left after the last chunk, times the first gate of
# the forward scan ($a_0$; $a_{L-1}$ in reverse), is the initial state's gradient. One kernel serves
# both directions of the forward scan.

# %%
#| export
"""The differentiable linear scan h_t = a_t * h_{t-1} + b_t: backward kernel, custom ops, autograd, public API."""
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from scan_lib.ema import accumulator_dtype, chunk_positions, launch_options, linear_scan_rows, scan_chunk
from scan_lib.runtime import FLOAT_DTYPES, apply, check_same_device, custom_op, plus, zero_in_graph

# Launch parameters of the backward kernel (benchmarks/bench_linear_scan.py sweeps them on a GPU).
BWD_CONFIG = {"max_chunk": 2048, "elements_per_thread": 16, "stages": 1, "reversed_loads": False}


@triton.jit
def linear_scan_bwd_kernel(A, H, H0, DY, DA, DB, DH0, length, REVERSE: tl.constexpr, HAS_H0: tl.constexpr,
                           CHUNK: tl.constexpr, REVERSED_LOADS: tl.constexpr, STAGES: tl.constexpr,
                           ACC: tl.constexpr):
    # A (gates), H (the forward's output), DY (dL/dy), DA, DB: rows x length contiguous; H0, DH0: rows.
    # One program per row, walking its chunks in the adjoint's order: against the forward scan.
    row = tl.program_id(0)
    base = row.to(tl.int64) * length
    if HAS_H0:
        h_init = tl.load(H0 + row).to(ACC)
    else:
        h_init = tl.zeros((), ACC)
    delta_carry = tl.zeros((), ACC)
    ADJOINT_REVERSE: tl.constexpr = not REVERSE
    SCAN_REVERSE: tl.constexpr = ADJOINT_REVERSE and not REVERSED_LOADS  # does the block scan run right to left?
    STEP: tl.constexpr = -1 if REVERSE else 1  # t + STEP: the step after t in the forward scan
    for k in tl.range(0, tl.cdiv(length, CHUNK), num_stages=STAGES):
        t, mask = chunk_positions(k, length, CHUNK, ADJOINT_REVERSE, REVERSED_LOADS)
        later, earlier = t + STEP, t - STEP
        has_later = mask & (later >= 0) & (later < length)
        has_earlier = mask & (earlier >= 0) & (earlier < length)
        a_later = tl.load(A + base + later, mask=has_later, other=0.0).to(ACC)
        dy = tl.load(DY + base + t, mask=mask, other=0.0).to(ACC)
        h_earlier = tl.load(H + base + earlier, mask=has_earlier, other=0.0).to(ACC)
        ### BEGIN SOLUTION
        ### HINT: identity pairs (1, 0) in the padding, then delta and the new delta_carry: scan_chunk of (a_later, dy) from delta_carry, in the adjoint's direction
        a_later = tl.where(mask, a_later, 1.0)  # identity pairs in the padding, 0 past the last step
        delta, delta_carry = scan_chunk(a_later, dy, delta_carry, SCAN_REVERSE)
        ### END SOLUTION
        h_earlier = tl.where(has_earlier, h_earlier, h_init)
        tl.store(DB + base + t, delta.to(DB.dtype.element_ty), mask=mask)
        tl.store(DA + base + t, (h_earlier * delta).to(DA.dtype.element_ty), mask=mask)
    if HAS_H0:
        first = length - 1 if REVERSE else 0  # the first step of the forward scan
        a_first = tl.load(A + base + first).to(ACC)
        tl.store(DH0 + row, (a_first * delta_carry).to(DH0.dtype.element_ty))


def linear_scan_rows_backward(gates, h, grad_h, initial_state=None, reverse=False, chunk=None, config=None):
    """(d_gates, d_tokens, d_initial_state or None) for contiguous (rows, L) tensors, L >= 1.

    grad_h: dL/dy for the output y = h; config: launch parameters, BWD_CONFIG if None."""
    rows, length = h.shape
    d_gates, d_tokens = torch.empty_like(gates), torch.empty_like(h)
    d_init = None if initial_state is None else torch.empty_like(initial_state)
    linear_scan_bwd_kernel[(rows,)](
        gates, h, h if initial_state is None else initial_state, grad_h, d_gates, d_tokens,
        h if d_init is None else d_init, length, REVERSE=reverse, HAS_H0=initial_state is not None,
        ACC=accumulator_dtype(h.dtype), **launch_options(length, config or BWD_CONFIG, chunk),
    )
    return d_gates, d_tokens, d_init

# %% [markdown]
# Autograd cannot look inside a Triton kernel, so we tell it what the two launchers compute with a
# `torch.autograd.Function`. Its `forward` runs chapter 02's forward launcher and saves what the
# backward needs: the gates, the initial state and the output $h$ (not the tokens). Its `backward`
# receives $\partial\mathcal L/\partial h$ and returns one gradient for each input of `forward`: `None`
# for the two that are not tensors, and for an initial state that is `None`. Like both launchers, it
# takes contiguous (rows, L) tensors.

# %%
class LinearScanRows(torch.autograd.Function):
    """h for contiguous (rows, L) gates and tokens and initial_state (rows,) or None; differentiable once."""

    @staticmethod
    def forward(ctx, gates, tokens, initial_state, reverse, chunk):
        h = linear_scan_rows(gates, tokens, initial_state, reverse, chunk)  # chapter 02's forward launcher
        ctx.save_for_backward(gates, h, initial_state)
        ctx.reverse, ctx.chunk = reverse, chunk
        return h

    @staticmethod
    def backward(ctx, grad_h):
        gates, h, initial_state = ctx.saved_tensors
        d_gates, d_tokens, d_init = linear_scan_rows_backward(gates, h, grad_h.contiguous(), initial_state,
                                                              ctx.reverse, ctx.chunk)
        return d_gates, d_tokens, d_init, None, None  # one per input of forward

# %% [markdown]
# ## 5. Every gradient, every length, several chunk sizes
#
# This check runs `LinearScanRows` between elementwise products, as chapters 04 and 05 will run their
# scans: $y = C \odot \mathrm{scan}(a,\ B \odot x,\ h_{-1})$ in plain PyTorch, so autograd chains our
# gradients with the elementwise ones. **In this check only**, $y$ is that model's output, not the state,
# and `dy` is $\partial\mathcal L/\partial y$ for it; from the `gradcheck` cell on, $y_t = h_t$ again. We
# check $y$ and all five gradients against the float64 loop, at lengths 1, 7, 129, 1000 and 4097 (1100
# under the interpreter), with chunks of 16 (a carry every 16 steps), 128 and 1024, in both directions,
# with and without an initial state. The table shows the runs with an initial state and chunks of 16.

# %%
def model_grads(x, a, B, C, h0, dy, reverse, scan):
    """(y, dx, da, dB, dC[, dh0]) for y = C * scan(a, B * x, h0, reverse), by autograd; h0 may be None."""
    leaves = [t.detach().requires_grad_() for t in (x, a, B, C) + (() if h0 is None else (h0,))]
    x_, a_, B_, C_ = leaves[:4]
    y = C_ * scan(a_, B_ * x_, leaves[4] if h0 is not None else None, reverse)
    return (y.detach(), *torch.autograd.grad(y, leaves, dy))


model_names = ["y", "dx", "da", "dB", "dC", "dh0"]
torch.manual_seed(3)
rows_full = 16 if ON_GPU else 2
print(f"{'L':>5} {'reverse':>8} {'init':>5} {'chunk':>6} " + " ".join(f"{n:>9}" for n in model_names))
for length in [1, 7, 129, 1000, 4097 if ON_GPU else 1100]:
    x, B, C, dy = torch.randn(4, rows_full, length, dtype=torch.float64, device=DEVICE)
    a = torch.rand(rows_full, length, dtype=torch.float64, device=DEVICE)
    h0 = torch.randn(rows_full, dtype=torch.float64, device=DEVICE)
    for reverse in [False, True]:
        for init in [h0, None]:
            expected = model_grads(x, a, B, C, init, dy, reverse, scan_loop)
            for chunk in [16, 128, 1024]:
                got = model_grads(x, a, B, C, init, dy, reverse,
                                  lambda *args: LinearScanRows.apply(*args, chunk))
                errors = [(g.cpu() - e.cpu()).abs().max().item() for g, e in zip(got, expected)]
                assert max(errors) < 1e-9, (length, reverse, init is None, chunk, dict(zip(model_names, errors)))
                if init is not None and chunk == 16:
                    print(f"{length:5} {str(reverse):>8} {'yes':>5} {chunk:6} " + " ".join(f"{err:9.1e}" for err in errors))
print("the other runs (chunks of 128 and 1024, no initial state) match too, at every length and direction")

# %% [markdown]
# The rest of the chapter uses the library's op, `scan_lib.linear_scan`: it wraps the same two launchers
# and adds what `LinearScanRows` lacks, among it any leading dims, non-contiguous inputs and a backward
# that autograd can differentiate again ("Going deeper: autograd plumbing" shows how it is wired).
# `torch.autograd.gradcheck` compares its backward with finite differences of our own forward over the
# full Jacobian (`fast_mode=False`), in float64, on small shapes with extra leading dims, a
# non-contiguous input and chunks of 16, so that carries are crossed. `gradgradcheck` does the same for
# the second derivatives ($L = 17$); "Going deeper: why the Hessian tests the differentiated backward"
# also compares a Hessian with the loop's.

# %%
from scan_lib import linear_scan  # the library's op

torch.manual_seed(4)
gates_gc = torch.rand(1, 2, 20, dtype=torch.float64, device=DEVICE).requires_grad_()
tokens_gc = torch.randn(1, 20, 2, dtype=torch.float64, device=DEVICE).transpose(1, 2).requires_grad_()  # non-contiguous
init_gc = torch.randn(1, 2, dtype=torch.float64, device=DEVICE).requires_grad_()
assert not tokens_gc.is_contiguous()
for reverse in [False, True]:
    assert torch.autograd.gradcheck(lambda g, u, h: linear_scan(g, u, h, reverse, chunk=16),
                                    (gates_gc, tokens_gc, init_gc), fast_mode=False)
    small = [t.detach().requires_grad_() for t in (gates_gc[0, :1, :17], tokens_gc[0, :1, :17], init_gc[0, :1])]
    assert torch.autograd.gradgradcheck(lambda g, u, h: linear_scan(g, u, h, reverse, chunk=16), small)
print("gradcheck (float64, shape (1, 2, 20), full Jacobian) and gradgradcheck (1, 17), chunk 16, both directions: ok")

# %% [markdown]
# In float32, float16 and bfloat16, "Going deeper: low precision, and the gradients' error bound"
# checks every gradient, element by element, against a bound built from chapter 02's `error_bound`,
# and shows the check catching a wrong adjoint.
#
# ## 6. On a GPU: how fast, and how far from the floor
#
# Gates and tokens of shape (batch 8, channels 1024, L 4096) in float32. Both passes do a few flops per
# element, so memory traffic sets their least time: the **memory floor** is the bytes that must move
# over the copy bandwidth (`copy_bandwidth`, chapter 00, measured in the same cell). The forward moves
# **3 tensors** (reads gates and tokens, writes $h$); forward + backward **8** (the backward also reads
# gates, $h$ and the incoming gradient, and writes two gradients). Ours runs with its default
# `BWD_CONFIG` and with the backward's loads descending ("Going deeper: launch parameters, and two
# ways to scan against the memory order"); a peer, accelerated-scan's Triton scan, runs when it is
# installed (`pip install accelerated-scan`): where it is not, the cell says so and times ours alone.
# Times are `do_bench` medians.

# %%
if not ON_GPU:
    print("skipped: needs a GPU")
else:
    from scan_lib.runtime import copy_bandwidth, median_us

    from scan_lib.linear_scan import BWD_CONFIG as backward_config  # the dict scan_lib's linear_scan reads
    torch.manual_seed(6)
    shape_bench = (8, 1024, 4096)
    gates_b = (0.5 + 0.5 * torch.rand(shape_bench, device=DEVICE)).requires_grad_()
    tokens_b = torch.randn(shape_bench, device=DEVICE).requires_grad_()
    grad_b = torch.randn(shape_bench, device=DEVICE)
    tensor_bytes = gates_b.numel() * gates_b.element_size()

    bandwidth = copy_bandwidth()  # bytes/s, read + write, from a 1 GiB copy (far larger than the L2 cache)
    floors_us = {"fwd": 3 * tensor_bytes / bandwidth * 1e6, "fwd+bwd": 8 * tensor_bytes / bandwidth * 1e6}

    # name -> (scan function, backward launch parameters or None for a third-party scan)
    scans = {"ours (default)": (linear_scan, dict(backward_config)),
             f"ours, backward with {'reverse=True' if backward_config['reversed_loads'] else 'descending loads'}":
                 (linear_scan, {**backward_config, "reversed_loads": not backward_config["reversed_loads"]})}
    try:
        from accelerated_scan.scalar import scan as accelerated_scan_triton
    except ImportError:
        try:
            from accelerated_scan.triton import scan as accelerated_scan_triton
        except ImportError:
            accelerated_scan_triton = None
            print("skipped accelerated-scan: accelerated_scan is not importable (pip install accelerated-scan)")
    if accelerated_scan_triton is not None:
        scans["accelerated-scan (Triton)"] = (accelerated_scan_triton, None)

    def grads_of(scan):
        return torch.autograd.grad(scan(gates_b, tokens_b), (gates_b, tokens_b), grad_b)

    # correctness at full size first: every variant against our float64 scan of the same inputs
    leaves64 = [gates_b.detach().double().requires_grad_(), tokens_b.detach().double().requires_grad_()]
    h64 = linear_scan(*leaves64)
    expected_b = [h64.detach(), *torch.autograd.grad(h64, leaves64, grad_b.double())]
    del h64, leaves64
    default_config = dict(backward_config)
    times_us = {}
    for name, (scan, config) in scans.items():
        backward_config.update(config or default_config)
        got = [scan(gates_b, tokens_b).detach(), *grads_of(scan)]
        errors = [((g.double() - e).abs().max() / e.abs().max()).item() for g, e in zip(got, expected_b)]
        assert max(errors) < 1e-4, (name, errors)
        forward_us = median_us(lambda: scan(gates_b, tokens_b))
        both_us = median_us(lambda: grads_of(scan))
        times_us[name] = (forward_us, both_us)
    backward_config.update(default_config)
    del expected_b, got

    print(f"shapes: gates, tokens, grad {shape_bench} float32; one tensor = {tensor_bytes / 2**20:.0f} MiB")
    print(f"copy bandwidth (1 GiB copy_): {bandwidth / 1e12:.2f} TB/s")
    print(f"FWD_CONFIG = {FWD_CONFIG}\nBWD_CONFIG = {backward_config}")
    print(f"floors: fwd 3 tensors = {floors_us['fwd']:.0f} us, fwd+bwd 8 tensors = {floors_us['fwd+bwd']:.0f} us")
    print(f"{'':40} {'fwd us':>8} {'x floor':>8} {'fwd+bwd us':>11} {'x floor':>8}")
    for name, (forward_us, both_us) in times_us.items():
        print(f"{name:40} {forward_us:8.1f} {forward_us / floors_us['fwd']:8.2f} "
              f"{both_us:11.1f} {both_us / floors_us['fwd+bwd']:8.2f}")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(times_us)
    for i, (name, pair) in enumerate(times_us.items()):
        ax.bar([j + i * width for j in range(2)], pair, width, label=name)
    for j, key in enumerate(["fwd", "fwd+bwd"]):
        ax.hlines(floors_us[key], j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="--",
                  label="memory floor" if j == 0 else None)
    ax.set_xticks([0.4 - width / 2, 1.4 - width / 2], ["forward", "forward + backward"])
    ax.set_ylabel("median time (us)")
    ax.set_title(f"linear scan {shape_bench} float32 on {torch.cuda.get_device_name(DEVICE)}")
    ax.legend(fontsize=8)
    ours_fwd, ours_both = times_us["ours (default)"]
    print(f"ours: forward {ours_fwd / floors_us['fwd']:.2f}x the floor, forward + backward "
          f"{ours_both / floors_us['fwd+bwd']:.2f}x the floor")
    if "accelerated-scan (Triton)" in times_us:
        peer_fwd, peer_both = times_us["accelerated-scan (Triton)"]
        print(f"accelerated-scan / ours: forward {peer_fwd / ours_fwd:.2f}, forward + backward {peer_both / ours_both:.2f} "
              "(above 1: ours is faster in this run)")
    save_figure(fig, "linear_scan_benchmark.png")


# %% [markdown]
# The cell times the public `linear_scan`, call included: the forward takes 1.04x the floor in the
# first row and 1.05x in the second, forward + backward 1.03x with the default backward and 1.08x with
# descending loads. Both rows run the same forward; of the two backwards, the default was the faster in
# this run (more in "Going deeper: reading the timing"). This run has no peer row: accelerated-scan was
# not installed.
#
# ## Summary
#
# - The adjoint of $h_t = a_t h_{t-1} + b_t$ is $\delta_t = \partial\mathcal L/\partial y_t + a_{t+1}\delta_{t+1}$:
#   the same scan run the other way on the shifted gates; $\partial\mathcal L/\partial b_t = \delta_t$,
#   $\partial\mathcal L/\partial a_t = h_{t-1}\delta_t$, $\partial\mathcal L/\partial h_{-1} = a_0\delta_0$.
# - The backward kernel walks each row's chunks right to left, carrying $\delta$ in a register and reading
#   the stored forward output one step back. A `torch.autograd.Function` hands both kernels to autograd;
#   every gradient matches the float64 loop.
# - `scan_lib.linear_scan(gates, tokens, initial_state=None, reverse=False)` wraps the same kernels,
#   differentiable (twice too) in all three tensors, checked by `gradcheck`, `gradgradcheck` and a Hessian,
#   and in low precision against a bound that the adjoint with unshifted gates fails.
# - Next, chapter 04: N states per position, where storing $h$ is no longer an option.

# %% [markdown]
# ## Going deeper: what the adjoint looks like
#
# For $\mathcal L = \sum_t y_t$ (every $\partial\mathcal L/\partial y_t = 1$) and
# constant gates $a_t = 0.95$, $\partial\mathcal L/\partial b_t = \delta_t$ counts the later outputs $b_t$
# still reaches, discounted by $0.95$ per step: flat at $1/(1 - 0.95) = 20$ far from the end, falling to
# $1$ at the last position. The gate's gradient $h_{t-1}\delta_t$ is that curve times the state the gate
# multiplied.

# %%
torch.manual_seed(1)
length_plot = 200
b_plot = torch.randn(1, length_plot, dtype=torch.float64, device=DEVICE)
a_plot = torch.full_like(b_plot, 0.95)
zero_plot = torch.zeros(1, dtype=torch.float64, device=DEVICE)
_, da_plot, db_plot, _ = grads_by_formula(a_plot, b_plot, zero_plot, torch.ones_like(b_plot))
assert abs(db_plot[0, 0].item() - (1 - 0.95 ** length_plot) / 0.05) < 1e-9 and abs(db_plot[0, -1].item() - 1) < 1e-12

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3))
ax1.plot(db_plot[0].cpu())
ax1.set_ylabel(r"$\partial\mathcal{L}/\partial b_t = \delta_t$")
ax1.set_title("the adjoint: a reverse scan")
ax2.plot(da_plot[0].cpu(), color="C1")
ax2.set_ylabel(r"$\partial\mathcal{L}/\partial a_t = h_{t-1}\,\delta_t$")
ax2.set_title("the gate's gradient")
for ax in (ax1, ax2):
    ax.set_xlabel("t")
fig.tight_layout()
save_figure(fig, "adjoint_gradients.png")

# %% [markdown]
# ## Going deeper: what the backward stores, and what it recomputes
#
# $\partial a_t = h_{t-1}\delta_t$ needs the forward states. Storing the output $h$ (it exists anyway) and
# reading $h_{t-1}$ back, or storing the inputs plus the state at each chunk boundary and recomputing
# $h_{t-1}$ in each chunk (as the single-block kernel does), both cost 3 reads and 2 writes per element.
# `linear_scan` stores $h$: one scan per chunk instead of two, and the tokens need not be kept alive
# (they are often a temporary like $B_t x_t$). Chapter 04 must recompute: with N states per position,
# storing them all would cost N times the memory. Each tensor is read once; only the element of an offset
# load that falls in the next chunk is read twice (most likely from the cache; nothing here measures it).
# The three loads are issued before the scan, so that their latencies can overlap.
#
# ## Going deeper: padding in the adjoint, and placeholders
#
# Past the end, the one-block kernel of section 3 gives the adjoint the shifted gate $0$, not the
# identity's $1$, which is harmless there because the padding is where the adjoint enters. The blocked
# kernel of section 4 meets padding on the adjoint's way out: when the adjoint runs left to right (the
# adjoint of a reverse scan), or with descending loads (below), the padding ends the last chunk the
# adjoint visits, so the adjoint leaves through it on its way to the initial state's gradient, and a
# zero gate there would zero that gradient. So the blocked kernel puts the identity pair $(1, 0)$ in
# the padding. As in chapter 02, `HAS_H0` is a compile-time constant: without an initial state the
# kernel neither reads `H0` nor writes `DH0`, and the launcher passes `h` in their places as
# placeholders that are never touched.

# %% [markdown]
# ## Going deeper: autograd plumbing: torch ops, `setup_context`, double backward
#
# Section 4's `LinearScanRows` hands autograd the two launchers for contiguous rows and one derivative.
# The library's `linear_scan`, exported by the three cells below, wraps the same launchers for more. The
# public function broadcasts gates against tokens and passes them, as contiguous rows, to an
# `autograd.Function`, `LinearScanFunction`, which calls the launchers as custom ops, `linear_scan_fwd`
# and `linear_scan_bwd`. A second derivative needs no second kernel: the backward is a linear scan plus
# elementwise products, so when autograd records the backward (`create_graph=True`), `_backward_by_scan`
# computes it with `LinearScanFunction` and torch ops.
#
# - **Custom ops.** The second cell registers the two launchers as PyTorch custom ops with
#   `scan_lib.runtime.custom_op`, chapter 00's wrapper of `torch.library.custom_op`, which in a plain
#   eager call runs the op's Python function directly. `torch.compile` does not trace into a Triton
#   launcher: it calls the custom ops `linear_scan_fwd` / `linear_scan_bwd` and builds its graph from
#   their *fake* implementations (shapes and dtypes only); `torch.func.vmap` uses their *vmap rules*,
#   which fold the batch dim into the rows. The third cell registers the fake implementations and the
#   vmap rules.
# - **Arguments.** The first cell defines `_check_linear_scan_inputs`, which `linear_scan` calls first:
#   it raises a `TypeError` or `ValueError` naming a wrong argument, and promotes dtypes as
#   `gates * tokens` would (the last section tries it).
# - **The autograd.Function** has `forward` without `ctx` plus `setup_context` (what `torch.func` needs) and
#   `generate_vmap_rule = True`. Its backward is the fused kernel unless autograd records the backward
#   (`create_graph=True`: `gradgradcheck`, `hessian`, `torch.func.grad`); then `_backward_by_scan` computes
#   it from `LinearScanFunction` and torch ops, which autograd differentiates again. A backward that
#   autograd cannot differentiate, such as `LinearScanRows`'s, does not always say so:
#   `torch.autograd.functional.hessian` returns zeros through it, and where the first gradient also flows
#   through other ops, the second derivative silently lacks the scan's part. So such a backward should
#   raise when differentiated, as `causal_conv1d`'s and `selective_scan`'s do.
# - **Host cost.** That style's `Function.apply` binds its arguments with `inspect.signature` on every call,
#   host work that this course does not time (for a scale, chapter 00's table times a whole launch of a
#   Triton kernel on the host, its `host_us` column). So the library calls `scan_lib.runtime.apply`:
#   outside `torch.compile` and `torch.func` it runs the same forward, `setup_context` and backward as an
#   old-style Function, whose `apply` goes straight to C++.
# - **Saved tensors.** The Function saves the gates, the initial state and its output $h$, which share the
#   caller's version counters: editing one in place before backward raises autograd's usual error instead
#   of giving a wrong gradient. Broadcasting and casting happen outside the Function, so autograd sums the
#   gradient of a broadcast gate back to its shape and casts it to its dtype.

# %% [markdown]
# The claim about `LinearScanRows` above, checked: the Hessian of $\sum_t h_t^2$ in the gates and tokens
# comes back all zeros through it, with no error, while through the loop it does not (largest entry
# 0.0 against 20.59).

# %%
def largest_entry(hessian):
    return max(block.abs().max().item() for row in hessian for block in row)


gates_9 = 0.5 + 0.5 * torch.rand(9, dtype=torch.float64, device=DEVICE)
tokens_9 = torch.randn(9, dtype=torch.float64, device=DEVICE)
through_rows = torch.autograd.functional.hessian(
    lambda g, u: (LinearScanRows.apply(g[None], u[None], None, False, 16) ** 2).sum(), (gates_9, tokens_9))
through_loop = torch.autograd.functional.hessian(lambda g, u: (scan_loop(g[None], u[None]) ** 2).sum(),
                                                 (gates_9, tokens_9))
print(f"largest Hessian entry through LinearScanRows: {largest_entry(through_rows)}, "
      f"through the loop: {largest_entry(through_loop):.2f}")
assert largest_entry(through_rows) == 0.0 and largest_entry(through_loop) > 0.1

# %%
#| export
def _promoted_dtype(gates, tokens):
    """torch.result_type(gates, tokens) for floating tensors (or a Python number for gates), written with
    torch.promote_types so that torch.compile can trace it: a tensor with dimensions outranks a 0-dim
    one, which outranks a Python number; tensors of the same rank promote as torch.promote_types says."""
    if not isinstance(gates, torch.Tensor) or (gates.dim() == 0 and tokens.dim() > 0):
        return tokens.dtype
    if tokens.dim() == 0 and gates.dim() > 0:
        return gates.dtype
    return torch.promote_types(gates.dtype, tokens.dtype)


def _check_linear_scan_inputs(gates, tokens, initial_state, reverse, chunk):
    """Validate the arguments; return (shape of h, dtype of h)."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
    if not isinstance(gates, torch.Tensor) and (isinstance(gates, bool) or not isinstance(gates, (int, float))):
        raise TypeError(f"gates must be a torch.Tensor or a real number, got {type(gates).__name__}")
    named = {"gates": gates, "tokens": tokens, "initial_state": initial_state}
    for name, value in named.items():
        if isinstance(value, torch.Tensor) and value.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {value.dtype}")
    if initial_state is not None and not isinstance(initial_state, torch.Tensor):
        raise TypeError(f"initial_state must be None or a torch.Tensor, got {type(initial_state).__name__}")
    gate_shape = gates.shape if isinstance(gates, torch.Tensor) else ()
    try:
        shape = tokens.shape if gate_shape == tokens.shape else torch.broadcast_shapes(gate_shape, tokens.shape)
    except RuntimeError:
        raise ValueError(f"gates and tokens must have broadcastable shapes, got {tuple(gate_shape)} and "
                         f"{tuple(tokens.shape)}") from None
    if len(shape) == 0:
        raise ValueError("gates and tokens must have at least one dimension (..., L) between them, got 0-dim tensors")
    dtype = _promoted_dtype(gates, tokens)  # the dtype of gates * tokens
    if initial_state is not None:
        dtype = torch.promote_types(dtype, initial_state.dtype)
        try:
            ok = initial_state.shape == shape[:-1] or torch.broadcast_shapes(initial_state.shape, shape[:-1]) == shape[:-1]
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"initial_state must broadcast to {tuple(shape[:-1])} (the leading dims of h), "
                             f"got {tuple(initial_state.shape)}")
    if not isinstance(reverse, bool):
        raise TypeError(f"reverse must be a bool, got {type(reverse).__name__}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 16 or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be None or a power of two >= 16, got {chunk!r}")
    check_same_device(**{name: value for name, value in named.items() if isinstance(value, torch.Tensor)})
    return shape, dtype

# %% [markdown]
# The ops, the Function, the backward that autograd can differentiate, and the public function, which
# broadcasts and casts outside the Function:

# %%
#| export
# The two kernels as torch ops: opaque to torch.compile (which sees only their fake implementations)
# and batched by torch.func.vmap through their vmap rules. Inputs: contiguous rows of one dtype.
@custom_op("linear_scan_fwd", __name__)
def linear_scan_fwd(gates: torch.Tensor, tokens: torch.Tensor, initial_state: Optional[torch.Tensor],
                    reverse: bool, chunk: Optional[int]) -> torch.Tensor:
    """h for gates, tokens (rows, L) and initial_state (rows,) or None."""
    if tokens.numel() == 0:
        return torch.empty_like(tokens)
    return linear_scan_rows(gates, tokens, initial_state, reverse, chunk)


@custom_op("linear_scan_bwd", __name__)
def linear_scan_bwd(gates: torch.Tensor, h: torch.Tensor, grad_h: torch.Tensor, initial_state: Optional[torch.Tensor],
                    reverse: bool, chunk: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_gates, d_tokens, d_initial_state), the last of shape (0,) when initial_state is None."""
    d_init = gates.new_empty(0) if initial_state is None else torch.zeros_like(initial_state)
    if h.numel() == 0:
        return torch.zeros_like(gates), torch.zeros_like(h), d_init
    d_gates, d_tokens, d_init_rows = linear_scan_rows_backward(gates, h, grad_h, initial_state, reverse, chunk)
    return d_gates, d_tokens, d_init if d_init_rows is None else d_init_rows


def _shift(x, reverse, fill):
    """x_{t+1} at position t with `fill` at the end (reverse: x_{t-1}, `fill` at the start). (rows, L)."""
    pad = fill.expand_as(x[:, :1]) if isinstance(fill, torch.Tensor) else torch.full_like(x[:, :1], fill)
    return torch.cat([pad, x[:, :-1]], -1) if reverse else torch.cat([x[:, 1:], pad], -1)


class LinearScanFunction(torch.autograd.Function):
    """Autograd for linear_scan on contiguous rows of one dtype: gates, tokens (rows, L), initial_state (rows,) or None."""
    generate_vmap_rule = True

    @staticmethod
    def forward(gates, tokens, initial_state, reverse, chunk):
        return linear_scan_fwd(gates, tokens, initial_state, reverse, chunk)

    @staticmethod
    def setup_context(ctx, inputs, output):
        gates, _, initial_state, reverse, chunk = inputs
        ctx.save_for_backward(gates, output, initial_state)
        ctx.reverse, ctx.chunk = reverse, chunk

    @staticmethod
    def backward(ctx, grad_h):
        gates, h, initial_state = ctx.saved_tensors
        if torch.is_grad_enabled() and h.shape[-1] > 0:  # create_graph=True: a backward autograd can differentiate
            d_gates, d_tokens, d_init = _backward_by_scan(gates, h, grad_h, initial_state, ctx.reverse, ctx.chunk)
        else:  # the usual case: one fused kernel
            d_gates, d_tokens, d_init = linear_scan_bwd(gates, h, grad_h.contiguous(), initial_state,
                                                        ctx.reverse, ctx.chunk)
        return d_gates, d_tokens, None if initial_state is None else d_init, None, None


def _backward_by_scan(gates, h, grad_h, initial_state, reverse, chunk):
    """The backward pass written with differentiable pieces: the adjoint is a linear scan the other way
    on the shifted gates, so autograd can differentiate it again (Hessians, double backward)."""
    delta = apply(LinearScanFunction, _shift(gates, reverse, 0.0), grad_h.contiguous(), None, not reverse, chunk)
    ### BEGIN SOLUTION
    ### HINT: return (d_gates, d_tokens, d_initial_state) from delta, h (shifted with _shift, the initial state or 0 at the first step) and the gates
    h_init = torch.zeros_like(h[:, :1]) if initial_state is None else initial_state[:, None]
    h_prev = _shift(h, not reverse, h_init)  # h_{t-1} (reverse: h_{t+1}), the initial state at the first step
    first = -1 if reverse else 0
    return h_prev * delta, delta, gates[:, first] * delta[:, first]
    ### END SOLUTION


def linear_scan(gates, tokens, initial_state=None, reverse=False, *, chunk=None):
    """The first-order linear scan along the last dim, differentiable (twice and more) in all three tensors.

    h_t = gates_t * h_{t-1} + tokens_t, with h_{-1} = initial_state (zeros if None);
    reverse=True: h_t = gates_t * h_{t+1} + tokens_t, with h_L = initial_state.
    gates: a tensor broadcastable against tokens (a scalar () or a per-channel (..., 1) gate, for an EMA)
    or a Python number; tokens: (..., L); initial_state: None or broadcastable to the leading dims (...).
    h has the broadcast shape of gates and tokens and the dtype torch's promotion gives gates * tokens
    (and initial_state); it is computed in float32 (float64 for float64). The gradient of a broadcast
    argument is summed back to its shape, in its dtype. Works under torch.func (grad, vmap), and
    torch.compile sees the kernels as the custom ops scan_lib::linear_scan_fwd / linear_scan_bwd.
    """
    shape, dtype = _check_linear_scan_inputs(gates, tokens, initial_state, reverse, chunk)
    rows, length = math.prod(shape[:-1]), shape[-1]
    if rows * length == 0:   # an empty h, as torch's ops give: no kernel, none of the copies below
        return plus(tokens.new_empty(shape, dtype=dtype), zero_in_graph(gates, tokens, initial_state))
    if not isinstance(gates, torch.Tensor):
        gates = torch.tensor(gates, dtype=dtype, device=tokens.device)
    rows_gates = gates.to(dtype).expand(shape).reshape(rows, length).contiguous()  # rows x L
    rows_tokens = tokens.to(dtype).expand(shape).reshape(rows, length).contiguous()  # rows x L
    rows_init = None if initial_state is None else initial_state.to(dtype).expand(shape[:-1]).reshape(rows).contiguous()
    return apply(LinearScanFunction, rows_gates, rows_tokens, rows_init, reverse, chunk).view(shape)

# %% [markdown]
# The ops' fake implementations and vmap rules:

# %%
#| export
@linear_scan_fwd.register_fake
def _(gates, tokens, initial_state, reverse, chunk):
    return torch.empty_like(tokens)


@linear_scan_bwd.register_fake
def _(gates, h, grad_h, initial_state, reverse, chunk):
    d_init = gates.new_empty(0) if initial_state is None else torch.empty_like(initial_state)
    return torch.empty_like(gates), torch.empty_like(h), d_init


def _rows_of_batch(info, in_dims, *tensors):
    """vmap: move each batch dim to the front (expanding unbatched tensors), then fold it into the rows:
    (batch, rows, L) -> (batch * rows, L), (batch, rows) -> (batch * rows,)."""
    out = []
    for tensor, dim in zip(tensors, in_dims):
        if tensor is not None:
            tensor = tensor.movedim(dim, 0) if dim is not None else tensor.expand(info.batch_size, *tensor.shape)
            tensor = tensor.reshape(tensor.shape[0] * tensor.shape[1], *tensor.shape[2:]).contiguous()
        out.append(tensor)
    return out


def _linear_scan_fwd_vmap(info, in_dims, gates, tokens, initial_state, reverse, chunk):
    rows = tokens.shape[0] if in_dims[1] is None else tokens.movedim(in_dims[1], 0).shape[1]
    h = linear_scan_fwd(*_rows_of_batch(info, in_dims[:3], gates, tokens, initial_state), reverse, chunk)
    return h.view(info.batch_size, rows, h.shape[-1]), 0


def _linear_scan_bwd_vmap(info, in_dims, gates, h, grad_h, initial_state, reverse, chunk):
    rows = h.shape[0] if in_dims[1] is None else h.movedim(in_dims[1], 0).shape[1]
    d_gates, d_tokens, d_init = linear_scan_bwd(*_rows_of_batch(info, in_dims[:4], gates, h, grad_h, initial_state),
                                                reverse, chunk)
    batch, length = info.batch_size, h.shape[-1]
    d_init = d_init.view(batch, rows) if initial_state is not None else d_init.new_empty(batch, 0)
    return (d_gates.view(batch, rows, length), d_tokens.view(batch, rows, length), d_init), (0, 0, 0)


linear_scan_fwd.register_vmap(_linear_scan_fwd_vmap)
linear_scan_bwd.register_vmap(_linear_scan_bwd_vmap)

# %% [markdown]
# The transforms, against the plain call. What the comparison shows is the wiring: that each transform
# reaches the kernels through the Function and the custom ops. It is not a check of the gradients'
# values, because both sides run our own backward; section 5 checked the kernels' values
# against the float64 loop, and `gradcheck` the library's copy of this code against finite differences. (The two sides do not even take the same path:
# `torch.func.grad` differentiates with `create_graph=True`, so grad mode is on inside the backward and
# it runs `_backward_by_scan`, while the plain call runs the fused kernel. Both compute the same
# formulas with the same chunks, and the recording shows them equal, a difference of 0.0e+00.)

# %%
torch.manual_seed(7)
gates_fn = torch.rand(4, 3, 20, dtype=torch.float64, device=DEVICE)
tokens_fn = torch.randn(4, 3, 20, dtype=torch.float64, device=DEVICE)
loss_fn = lambda g, u: (linear_scan(g, u) ** 2).sum()  # noqa: E731
leaves_fn = [t.clone().requires_grad_() for t in (gates_fn, tokens_fn)]
plain_grads = torch.autograd.grad(loss_fn(*leaves_fn), leaves_fn)
checks = {
    "torch.func.grad": torch.func.grad(loss_fn, argnums=(0, 1))(gates_fn, tokens_fn),
    "torch.func.vmap(grad) over dim 0": torch.func.vmap(torch.func.grad(loss_fn, argnums=(0, 1)))(gates_fn, tokens_fn),
}
compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
checks["torch.compile(fullgraph=True)"] = torch.autograd.grad(compiled(*leaves_fn), leaves_fn)
for what, grads in checks.items():
    error = max((g - p).abs().max().item() for g, p in zip(grads, plain_grads))
    print(f"{what:34} gradients, max abs difference from autograd: {error:.1e}")
    assert error < 1e-12
batched = torch.func.vmap(linear_scan, in_dims=(1, 1))(gates_fn, tokens_fn)
assert torch.equal(batched, linear_scan(gates_fn.transpose(0, 1), tokens_fn.transpose(0, 1)))
print("torch.func.vmap over dim 1: equal to the plain call")

# %% [markdown]
# ## Going deeper: low precision, and the gradients' error bound
#
# The check: the gradients of float32, float16 and bfloat16 inputs against the float64 gradients of
# the same (rounded) inputs, element by element, with a bound built from chapter 02's `error_bound`. The
# backward is two scans, $h$ and the adjoint $\delta$ (the same scan by the same `scan_chunk`, on the
# shifted gates and `dy`), which `error_bound` bounds, and two products, $h_{t-1}\delta_t$ and
# $a_0\delta_0$, which `product` bounds (both derived below). The table prints the worst ratio of
# error to bound: at most 1 for a correct backward, as the cell asserts. Random roundings
# partly cancel where a worst-case bound adds them all, so the ratio can lie far below 1 where many add
# up (float32, a long memory) and come close to 1 where one output rounding dominates (float16,
# bfloat16).

# %%
def output_roundoff(dtype):
    """u_out of chapter 02's error_bound: the relative error of one rounding from float32 to `dtype`
    (0 for float32 itself; a whole epsilon for bfloat16 on the interpreter, which truncates)."""
    if dtype == torch.float32:
        return 0.0
    return torch.finfo(dtype).eps / (1 if dtype == torch.bfloat16 and INTERPRET else 2)


def gradient_bounds(gates, tokens, initial_state, dy):
    """Elementwise bounds on |linear_scan - float64| of (h, d_gates, d_tokens, d_init) for a forward scan of
    (rows, L) inputs of one dtype (float32, float16 or bfloat16), the loss sum(h * dy)."""
    dtype = tokens.dtype
    u32, u_out, tiny = 2.0 ** -24, output_roundoff(dtype), torch.finfo(dtype).tiny
    a, b, h_init, dy = (t.detach().double() for t in (gates, tokens, initial_state, dy))
    shifted = shift_gates(a)
    h, delta = scan_loop(a, b, h_init), scan_loop(shifted, dy, reverse=True)
    bound_h = error_bound(a, b, h_init, dtype=dtype)  # h as stored, which the backward reads back
    bound_delta = error_bound(shifted, dy, None, True, dtype=torch.float32)  # the adjoint before its store
    bound_d_tokens = error_bound(shifted, dy, None, True, dtype=dtype)  # ... and stored: d_tokens
    h_prev = torch.cat([h_init[:, None], h[:, :-1]], -1)  # h_{t-1}
    bound_h_prev = torch.cat([torch.zeros_like(h_init[:, None]), bound_h[:, :-1]], -1)  # h_{-1}: the input, exact

    def product(x, bound_x, y, bound_y):  # bound on |round_dtype(float32(x_hat * y_hat)) - x * y|
        first_order = x.abs() * bound_y + y.abs() * bound_x + bound_x * bound_y
        return (1 + u32) * (1 + u_out) * first_order + (u32 + u_out + u32 * u_out) * (x * y).abs() + u_out * tiny

    return (bound_h, product(h_prev, bound_h_prev, delta, bound_delta), bound_d_tokens,
            product(a[:, 0], 0.0, delta[:, 0], bound_delta[:, 0]))


torch.manual_seed(5)
length_lp = 2000
gates_lp = 0.98 + 0.02 * torch.rand(4, length_lp, device=DEVICE)
tokens_lp, grad_lp = torch.randn(2, 4, length_lp, device=DEVICE)
init_lp = torch.randn(4, device=DEVICE)
print(f"max err / bound, L = {length_lp}")
print(f"{'dtype':>15} " + " ".join(f"{n:>9}" for n in ["h", "d_gates", "d_tokens", "d_init"]))
for dtype in [torch.float32, torch.float16, torch.bfloat16]:
    leaves = [t.to(dtype).requires_grad_() for t in (gates_lp, tokens_lp, init_lp)]
    h_lp = linear_scan(*leaves)
    got = [h_lp.detach(), *torch.autograd.grad(h_lp, leaves, grad_lp.to(dtype))]
    assert all(t.dtype == dtype for t in got)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]  # the same rounded inputs, in float64
    h64 = scan_loop(*leaves64)
    ref_lp = [h64.detach(), *torch.autograd.grad(h64, leaves64, grad_lp.to(dtype).double())]
    bounds_lp = gradient_bounds(*leaves, grad_lp.to(dtype))
    ratios = [((g.double() - r).abs() / bound).max().item() for g, r, bound in zip(got, ref_lp, bounds_lp)]
    print(f"{str(dtype):>15} " + " ".join(f"{ratio:9.3f}" for ratio in ratios))
    assert max(ratios) <= 1, (dtype, ratios)

# %% [markdown]
# The check bounds each gradient with chapter 02's `error_bound` and one rule for a product. $h$ is
# stored in the input dtype and read back by the backward: `error_bound(a, b, h_init, dtype=dtype)`
# bounds it as stored. The adjoint $\delta$ is bounded by `error_bound` of the shifted gates and `dy`,
# right to left (why that applies: below), in float32 before its store and in the input dtype after it
# ($\partial\mathcal L/\partial b_t$). The products $\partial\mathcal L/\partial a_t = h_{t-1}\delta_t$ and
# $\partial\mathcal L/\partial h_{-1} = a_0\delta_0$ multiply two values within their bounds $E_x$, $E_y$
# once in float32 ($u_{32} = 2^{-24}$) and round the product to the dtype ($u_{\text{out}}$, chapter
# 02's). The rule for such a product: write the two factors as computed, $\hat x = x + e_x$ and
# $\hat y = y + e_y$, with $|e_x| \le E_x$ and $|e_y| \le E_y$. Then $\hat x\hat y - xy = x e_y + y e_x + e_x e_y$, at most
# $e = |x|E_y + |y|E_x + E_xE_y$ in size. The float32 multiply returns $\hat x\hat y\,(1+\epsilon_1)$ with
# $|\epsilon_1| \le u_{32}$, and the store rounds that to the dtype, a factor $1+\epsilon_2$ with
# $|\epsilon_2| \le u_{\text{out}}$, plus at most $u_{\text{out}}\,\text{tiny}$ below the dtype's normal range
# (chapter 02's "Going deeper"). With $|\hat x\hat y| \le |xy| + e$ and
# $|(1+\epsilon_1)(1+\epsilon_2) - 1| \le u_{32} + u_{\text{out}} + u_{32}u_{\text{out}}$, the stored product errs by at most
#
# $$e + (|xy| + e)(u_{32} + u_{\text{out}} + u_{32}u_{\text{out}}) + u_{\text{out}}\,\text{tiny}
#   = (1+u_{32})(1+u_{\text{out}})\,e + (u_{32} + u_{\text{out}} + u_{32}u_{\text{out}})\,|xy| + u_{\text{out}}\,\text{tiny}.$$
#
# What goes in, read off the backward kernel: for $\partial\mathcal L/\partial a_t$, $\hat x$ is $h_{t-1}$ as the
# forward stored it ($E_x$ is `error_bound` in the dtype; 0 at the first step, where the kernel reads the
# initial state itself) and $\hat y$ is $\delta_t$ as the float32 scan computed it, before any store
# ($E_y$ is `error_bound` with output type float32: no output rounding). For
# $\partial\mathcal L/\partial h_{-1}$, $x = a_0$ is an input, exact, and $\hat y$ is the carry that leaves the
# adjoint's last chunk, $\delta_0$. `error_bound` applies to the adjoint because the backward kernel
# computes it with the forward's operations (the same `scan_chunk`, identity pairs in the padding, the
# carry folded into each chunk's entry pair), so chapter 02's count of roundings holds as it stands, with
# its one assumption, the tree depth $d$. As there, the float64 reference is taken as exact.
#
# Gates near 1 give a long memory, so a scan that rounded its state to float16 or bfloat16 at every
# step would fail this check (`tests/test_linear_scan.py` injects that bug).

# %% [markdown]
# **The check can fail.** Section 1's easy slip, the adjoint scanned with unshifted gates ($a_t$ where
# $\delta_t$ needs $a_{t+1}$), goes through the same float32 bound next to the right adjoint; the cell
# asserts that the wrong one's error exceeds its bound more than a hundredfold.

# %%
exact_delta = scan_loop(shift_gates(gates_lp.double()), grad_lp.double(), reverse=True)
bound_d_tokens = gradient_bounds(gates_lp, tokens_lp, init_lp, grad_lp)[2]  # float32, as in the table
right_delta = linear_scan_rows(shift_gates(gates_lp), grad_lp, reverse=True)  # gates a_{t+1}
unshifted_delta = linear_scan_rows(gates_lp, grad_lp, reverse=True)  # the slip: gates a_t
ratio_right, ratio_unshifted = (((d.double() - exact_delta).abs() / bound_d_tokens).max().item()
                                for d in (right_delta, unshifted_delta))
print(f"adjoint in float32, max err / bound: shifted gates {ratio_right:.3f}, unshifted gates {ratio_unshifted:.0f}")
assert ratio_right <= 1 and ratio_unshifted > 100

# %% [markdown]
# ## Going deeper: why the Hessian tests the differentiated backward
#
# The Hessian of a loss through `linear_scan` ($L = 20$) must equal the loop's, which needs the
# backward to be differentiated correctly:
# $h_t = \sum_{s \le t} \big(\prod_{r=s+1}^{t} a_r\big) b_s$ (plus the initial state's term) is linear in
# the tokens and the initial state and multilinear in the gates, a polynomial of degree up to $L$ in
# them, so its second derivatives are not zero, and the Hessian of $\sum_t h_t^2$,
# $2\sum_t \big(\nabla h_t \nabla h_t^\top + h_t \nabla^2 h_t\big)$, contains them. With chunks of 16, at
# $L = 17$ and $L = 20$ the state and the adjoint pass from one chunk to the next.
#
# The cell also asserts nonzero Hessian entries coupling a gate of the first chunk with one of the
# second (the largest is 1.67, against 16.01 over the whole Hessian): only a correct carry, in the
# forward and the differentiated backward, gets them right. Ours differs from the loop's by at most
# 1.1e-14.

# %%
def squared_loss(scan):
    return lambda g, u, h: (scan(g[None], u[None], h[None]) ** 2).sum()


hessian_args = (gates_gc[0, 0].detach(), tokens_gc[0, 0].detach(), init_gc[0, 0].detach())  # L = 20
ours = torch.autograd.functional.hessian(squared_loss(lambda g, u, h: linear_scan(g, u, h, chunk=16)), hessian_args)
theirs = torch.autograd.functional.hessian(squared_loss(scan_loop), hessian_args)
hessian_error = max((o - t).abs().max().item() for row_o, row_t in zip(ours, theirs) for o, t in zip(row_o, row_t))
across_chunks = theirs[0][0][:16, 16:].abs().max().item()  # d2/(d gate_s d gate_t), s in chunk 0, t in chunk 1
print(f"Hessian of sum(h^2) in (gates, tokens, initial state), L = 20, chunks of 16: largest entry "
      f"{max(t.abs().max().item() for row in theirs for t in row):.2f}, largest across the carry "
      f"{across_chunks:.2f}, max abs error {hessian_error:.1e}")
assert across_chunks > 0.1 and hessian_error < 1e-10

# %% [markdown]
# ## Going deeper: launch parameters, and two ways to scan against the memory order
#
# The backward has its own launch parameters, `BWD_CONFIG` (the forward's are chapter 02's `FWD_CONFIG`):
# it moves 5 tensors where the forward moves 3, so its best chunk and warps need not be the same;
# `benchmarks/bench_linear_scan.py` sweeps both on a GPU. The adjoint of a left-to-right scan runs right to
# left, and `chunk_positions` (chapter 02) offers two ways to do that: ascending loads scanned with
# `tl.associative_scan(..., reverse=True)`, or descending loads with the block in scan order.
# `reversed_loads` picks one; the other must give the same gradients (in section 5's check, where
# $y_t = C_t h_t$):

# %%
default_bwd_config = dict(BWD_CONFIG)  # BWD_CONFIG: this notebook's dict, the one its linear_scan reads
BWD_CONFIG["reversed_loads"] = not default_bwd_config["reversed_loads"]
torch.manual_seed(6)
try:
    for length in [129, 4097 if ON_GPU else 1100]:
        x, B, C, dy = torch.randn(4, rows_full, length, dtype=torch.float64, device=DEVICE)
        a = torch.rand(rows_full, length, dtype=torch.float64, device=DEVICE)
        h0 = torch.randn(rows_full, dtype=torch.float64, device=DEVICE)
        for reverse in [False, True]:
            expected = model_grads(x, a, B, C, h0, dy, reverse, scan_loop)
            got = model_grads(x, a, B, C, h0, dy, reverse, lambda *args: linear_scan(*args, chunk=128))
            errors = [(g.cpu() - e.cpu()).abs().max().item() for g, e in zip(got, expected)]
            assert max(errors) < 1e-9, (length, reverse, dict(zip(model_names, errors)))
finally:
    BWD_CONFIG.update(default_bwd_config)
print(f"backward with reversed_loads={not default_bwd_config['reversed_loads']}: all gradients match at L = 129 and {length}")

# %% [markdown]
# ## Going deeper: reading the timing
#
# The peer in section 6 is accelerated-scan's Triton kernel (`scan(gates, tokens)`, the same
# recurrence, built much like ours). The fwd+bwd column calls `torch.autograd.grad`, so no `.grad`
# accumulation is timed. The two rows of ours run the same forward, and their forward columns (140.0
# and 140.1 us) are two timings of the same code. Their forward + backward columns (368.2 and 387.6 us)
# differ only in the backward's load order: ascending loads scanned with `reverse=True` (the default)
# were the faster in this run. Each number is one median of one run, so the cell does not show how
# stable that gap is. Besides the kernels, the call includes the host's Python work (input checks,
# broadcasting, the torch-op and autograd dispatch) and allocations; when the host takes longer than the
# GPU, the GPU waits, and the timing includes the wait. At this size any such wait is small: every
# timing lies within 1.08x of the memory floor, below which the GPU's own work can hardly go. The cell
# does not time the host's work separately. The kernels alone are timed elsewhere: chapter 02's speed
# cell times the forward launcher `linear_scan_rows` at this size against the same floor, and
# `benchmarks/bench_linear_scan.py` times the backward kernel alone, with the peer beside ours (its
# H200 output, from an earlier commit, is in `benchmarks/results/bench_linear_scan_h200.txt`).

# %% [markdown]
# ## Going deeper: broadcast gates, dtypes and bad input
#
# `linear_scan` takes what `gates * tokens` would: here a float16 per-channel gate of shape (3, 1) with
# float32 tokens. $h$ equals the scan of the expanded gate, and `d_alpha` comes back in the gate's shape
# and dtype.

# %%
tokens_ema = torch.randn(2, 3, 50, device=DEVICE)
alpha = torch.tensor([[0.9], [0.5], [0.99]], dtype=torch.float16, device=DEVICE, requires_grad=True)  # 3 x 1: per channel
h_ema = linear_scan(alpha, (1 - alpha) * tokens_ema)
d_alpha, = torch.autograd.grad(h_ema.sum(), alpha)
h_expanded = linear_scan(alpha.detach().float().expand(2, 3, 50).contiguous(), (1 - alpha.detach().float()) * tokens_ema)
assert h_ema.dtype == torch.float32 and d_alpha.shape == alpha.shape and d_alpha.dtype == torch.float16
assert torch.equal(h_ema.detach(), h_expanded)
print(f"per-channel float16 gate {tuple(alpha.shape)} with float32 tokens {tuple(tokens_ema.shape)}: "
      f"h {h_ema.dtype} {tuple(h_ema.shape)}, d_alpha {d_alpha.dtype} {tuple(d_alpha.shape)}")

# %% [markdown]
# The values in float64, against the loop with the gate expanded by hand, for each kind of gate: a
# tensor that broadcasts, a 0-dim tensor, and a Python number (which has no gradient).

# %%
def loop_broadcast(gates, tokens):
    """scan_loop with gates (a tensor or a number) broadcast against tokens (..., L) by hand."""
    gates = torch.as_tensor(gates, dtype=tokens.dtype, device=tokens.device)
    shape = torch.broadcast_shapes(gates.shape, tokens.shape)
    rows_of = lambda t: t.expand(shape).reshape(-1, shape[-1])  # noqa: E731
    return scan_loop(rows_of(gates), rows_of(tokens)).view(shape)


def ema_grads(scan, gate, tokens, dy):
    """(h, d_tokens[, d_gate]) for h = scan(gate, (1 - gate) * tokens) and the loss sum(h * dy)."""
    leaves = [tokens.clone().requires_grad_()] + ([gate.clone().requires_grad_()] if isinstance(gate, torch.Tensor) else [])
    gate_ = leaves[1] if isinstance(gate, torch.Tensor) else gate
    h = scan(gate_, (1 - gate_) * leaves[0])
    return [h.detach(), *torch.autograd.grad(h, leaves, dy)]


torch.manual_seed(8)
tokens_g, dy_g = torch.randn(2, 2, 3, 50, dtype=torch.float64, device=DEVICE)
gate_kinds = {"tensor (3, 1)": torch.tensor([[0.9], [0.5], [0.99]], dtype=torch.float64, device=DEVICE),
              "0-dim tensor": torch.tensor(0.9, dtype=torch.float64, device=DEVICE),
              "Python float": 0.9}
print(f"{'gate':>14} {'h':>9} {'d_tokens':>9} {'d_gate':>9}")
for kind, gate in gate_kinds.items():
    ours = ema_grads(linear_scan, gate, tokens_g, dy_g)
    theirs = ema_grads(loop_broadcast, gate, tokens_g, dy_g)
    if isinstance(gate, torch.Tensor):
        assert ours[2].shape == gate.shape  # d_gate, summed back to the gate's shape
    errors = [(o - t).abs().max().item() for o, t in zip(ours, theirs)]
    print(f"{kind:>14} " + " ".join(f"{err:9.1e}" for err in errors) + ("" if len(errors) == 3 else f" {'(none)':>9}"))
    assert max(errors) < 1e-9, (kind, errors)

# %% [markdown]
# Bad input gets an exception that names the argument; empty sequences are allowed.

# %%
ok_gates = torch.rand(2, 5, device=DEVICE)
ok_tokens = torch.randn(2, 5, device=DEVICE)
bad_calls = {
    "shapes not broadcastable": (ValueError, lambda: linear_scan(ok_gates, ok_tokens[:, :4])),
    "integer tokens": (TypeError, lambda: linear_scan(ok_gates, torch.ones(2, 5, dtype=torch.int64, device=DEVICE))),
    "gates a list": (TypeError, lambda: linear_scan([0.5] * 5, ok_tokens)),
    "0-dim tensors": (ValueError, lambda: linear_scan(ok_gates[0, 0], ok_tokens[0, 0])),
    "initial_state shape": (ValueError, lambda: linear_scan(ok_gates, ok_tokens, torch.zeros(5, device=DEVICE))),
    "chunk not a power of two": (ValueError, lambda: linear_scan(ok_gates, ok_tokens, chunk=100)),
}
if ON_GPU:
    bad_calls["tokens on the CPU"] = (ValueError, lambda: linear_scan(ok_gates, ok_tokens.cpu()))
for what, (error, call) in bad_calls.items():
    try:
        call()
    except error as exc:
        print(f"{what:26} -> {error.__name__}: {exc}")
    else:
        raise AssertionError(f"{what}: no {error.__name__}")

empty_gates = torch.rand(3, 0, device=DEVICE, requires_grad=True)
empty_h = linear_scan(empty_gates, torch.randn(3, 0, device=DEVICE))
assert empty_h.shape == (3, 0)
empty_h.sum().backward()
assert empty_gates.grad.shape == (3, 0)
print("L = 0: empty result, empty gradients: ok")

# %% [markdown]
# ## References
#
# - Martin and Cundy, "Parallelizing linear recurrent neural nets over sequence length", ICLR 2018.
# - Griewank and Walther, Evaluating Derivatives, 2nd ed., SIAM 2008 (the adjoint, or reverse, mode).
# - PyTorch documentation: torch.autograd.Function and Python custom operators (torch.library): https://pytorch.org/docs/stable/notes/extending.html
# - Sasha Rush, "Mamba: The Hard Way" (a Triton notebook from cumulative sums to the selective scan; part 3): https://srush.github.io/annotated-mamba/hard.html
