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
# A Triton kernel is opaque to autograd: to train through the scan of chapter 02 we must write its
# backward pass ourselves. In this chapter you will
#
# - derive $\partial\mathcal L/\partial x$, $\partial a$, $\partial b$, $\partial c$ and
#   $\partial h^{\text{init}}$ for $h_t = a_t h_{t-1} + b_t x_t$, $y_t = c_t h_t$, and see that the
#   adjoint is **the same linear scan, run right to left, with the gates shifted by one**;
# - check the derivation in plain PyTorch against `torch.autograd`, then in a single-block kernel that
#   does forward and backward in one program;
# - write the blocked backward kernel (the forward state comes in from the left, the adjoint from the
#   right), decide what to store and what to recompute, and wrap both directions as the
#   differentiable `scan_lib.linear_scan`;
# - check **every** gradient against autograd in float64, at lengths 1, 7, 129, 1000, 4097 and several
#   chunk sizes, then benchmark against the best Triton scan we know of, and the memory floor.

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
import sys

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

from scan_lib.ema import FWD_CONFIG, linear_scan_rows, scan_chunk
from scan_lib.runtime import save_figure

# %% [markdown]
# ## 1. A reference with autograd
#
# The model of chapter 02, with every coefficient free to change along the sequence, and an initial
# state. All tensors are (R, L): R independent rows, scanned along L. The loop is slow and obviously
# right, and `torch.autograd` differentiates it for us: that is what every gradient below is checked
# against, in float64. For the reverse direction the loop runs on flipped inputs (flips are
# differentiable too).

# %%
def ssm_loop(x, a, b, c, h0=None, reverse=False):
    """y_t = c_t * h_t with h_t = a_t * h_{t-1} + b_t * x_t (reverse: h_{t+1}); all (R, L), h0 (R,)."""
    if reverse:
        return ssm_loop(x.flip(-1), a.flip(-1), b.flip(-1), c.flip(-1), h0).flip(-1)
    h = torch.zeros_like(x[:, 0]) if h0 is None else h0
    ys = []
    for t in range(x.shape[-1]):
        h = a[:, t] * h + b[:, t] * x[:, t]  # R
        ys.append(c[:, t] * h)
    return torch.stack(ys, -1)  # R x L


def reference_grads(x, a, b, c, h0, dy, reverse=False):
    """(y, dx, da, db, dc, dh0) in float64 from autograd through ssm_loop, for the loss sum(y * dy)."""
    inputs = [t.detach().double().requires_grad_() for t in (x, a, b, c, h0)]
    y = ssm_loop(*inputs, reverse=reverse)
    grads = torch.autograd.grad(y, inputs, dy.double())
    return (y.detach(), *grads)

# %% [markdown]
# ## 2. The derivation
#
# Let $\mathcal L$ be any loss of the outputs and write $g_t = \partial\mathcal L/\partial y_t$ (in the code:
# `dy`, the gradient that arrives from the layers above). The state $h_t$ influences the loss in two
# ways: through its own output $y_t = c_t h_t$, and through the next state
# $h_{t+1} = a_{t+1} h_t + b_{t+1} x_{t+1}$, which carries everything later. Call the total derivative
# $\delta_t = d\mathcal L/d h_t$ (`dh` in the code). The chain rule gives
#
# $$\delta_t \;=\; \frac{\partial \mathcal L}{\partial y_t}\frac{\partial y_t}{\partial h_t}
#   + \frac{d\mathcal L}{d h_{t+1}}\frac{\partial h_{t+1}}{\partial h_t}
#   \;=\; c_t\, g_t \;+\; a_{t+1}\, \delta_{t+1}, \qquad \delta_{L-1} = c_{L-1}\, g_{L-1}.$$
#
# This is the recurrence we already know how to scan, $h_t = a_t h_{t-1} + u_t$, with three changes:
# it runs **right to left**, its tokens are $c_t g_t$, and its gate at position $t$ is
# $a_{t+1}$: the **gates shifted by one** (and $0$ past the end, where nothing follows). Unrolled,
# $\delta_t = \sum_{s \ge t} \big(\prod_{t < k \le s} a_k\big)\, c_s g_s$: the mirror image of the forward
# sum. Every parameter touches the loss only through one $h_t$ or one $y_t$, so the rest is one line each:
#
# $$\frac{\partial\mathcal L}{\partial x_t} = b_t\,\delta_t,\qquad
#   \frac{\partial\mathcal L}{\partial b_t} = x_t\,\delta_t,\qquad
#   \frac{\partial\mathcal L}{\partial c_t} = h_t\, g_t,\qquad
#   \frac{\partial\mathcal L}{\partial a_t} = h_{t-1}\,\delta_t,\qquad
#   \frac{\partial\mathcal L}{\partial h^{\text{init}}} = a_0\,\delta_0 ,$$
#
# with $h_{-1} = h^{\text{init}}$. The gradient of the gates needs the forward state *one step
# earlier*: the backward pass needs values from both directions, $\delta$ from the right and $h$ from
# the left. For the reverse scan ($h_t = a_t h_{t+1} + u_t$) everything mirrors: the adjoint runs left to
# right with gates $a_{t-1}$, $\partial a_t = h_{t+1}\delta_t$ and $\partial h^{\text{init}} = a_{L-1}\delta_{L-1}$.
#
# For the bare linear scan $h_t = a_t h_{t-1} + u_t$ (what `scan_lib.linear_scan` computes, with
# $b = c = 1$): $\partial u_t = \delta_t$ and $\partial a_t = h_{t-1}\delta_t$, where $\delta$ is the reverse scan
# of the incoming gradient $g$ with the shifted gates.
#
# First check, in plain PyTorch: the formulas, with $\delta$ computed by chapter 02's *forward* kernel
# run in reverse on shifted gates, against autograd.

# %%
def shift_gates(a, reverse=False):
    """a_{t+1} at position t, 0 at the end (reverse: a_{t-1}, 0 at the start). (R, L) -> (R, L)."""
    zero = torch.zeros_like(a[:, :1])
    return torch.cat([zero, a[:, :-1]], -1) if reverse else torch.cat([a[:, 1:], zero], -1)


def grads_by_formula(x, a, b, c, h0, dy, reverse=False):
    """(dx, da, db, dc, dh0) from the formulas above; both scans are chapter 02's kernel."""
    h = linear_scan_rows(a, b * x, h0, reverse=reverse)
    delta = linear_scan_rows(shift_gates(a, reverse), c * dy, reverse=not reverse)  # the adjoint
    h_prev = torch.cat([h0[:, None], h[:, :-1]], -1) if not reverse else torch.cat([h[:, 1:], h0[:, None]], -1)
    a_first = a[:, -1] if reverse else a[:, 0]
    delta_first = delta[:, -1] if reverse else delta[:, 0]
    return b * delta, h_prev * delta, x * delta, h * dy, a_first * delta_first


torch.manual_seed(0)
print(f"{'L':>5} {'reverse':>8} " + " ".join(f"{n:>9}" for n in ["dx", "da", "db", "dc", "dh0"]))
for length in [1, 7, 129]:
    x, a, b, c, dy = (torch.randn(3, length, dtype=torch.float64, device=DEVICE) for _ in range(5))
    a = torch.rand(3, length, dtype=torch.float64, device=DEVICE)
    h0 = torch.randn(3, dtype=torch.float64, device=DEVICE)
    for reverse in [False, True]:
        expected = reference_grads(x, a, b, c, h0, dy, reverse)[1:]
        got = grads_by_formula(x, a, b, c, h0, dy, reverse)
        errors = [(g.cpu() - e.cpu()).abs().max().item() for g, e in zip(got, expected)]
        print(f"{length:5} {str(reverse):>8} " + " ".join(f"{err:9.1e}" for err in errors))
        assert max(errors) < 1e-10

# %% [markdown]
# What the adjoint looks like: for the loss $\mathcal L = \sum_t y_t$ with constant $a_t = 0.95$,
# $\partial\mathcal L/\partial x_t$ counts how many later outputs $x_t$ still reaches, discounted by
# $0.95$ per step: flat far from the end, falling to $b\,c$ at the last position. The gate gradient
# $h_{t-1}\delta_t$ is that curve times the state the gate multiplied.

# %%
torch.manual_seed(1)
length_plot = 200
x_plot = torch.randn(1, length_plot, dtype=torch.float64, device=DEVICE)
a_plot = torch.full_like(x_plot, 0.95)
ones_plot = torch.ones_like(x_plot)
dx_plot, da_plot, *_ = grads_by_formula(x_plot, a_plot, ones_plot, ones_plot, torch.zeros(1, dtype=torch.float64, device=DEVICE), ones_plot)
assert abs(dx_plot[0, 0].item() - (1 - 0.95 ** length_plot) / 0.05) < 1e-9 and abs(dx_plot[0, -1].item() - 1) < 1e-12

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
ax1.plot(dx_plot[0].cpu())
ax1.set_title(r"$\partial\mathcal{L}/\partial x_t$ = reverse scan of the shifted gates")
ax2.plot(da_plot[0].cpu(), color="C1")
ax2.set_title(r"$\partial\mathcal{L}/\partial a_t = h_{t-1}\,\delta_t$")
for ax in (ax1, ax2):
    ax.set_xlabel("t")
save_figure(fig, "adjoint_gradients.png")
plt.close(fig)

# %% [markdown]
# ![gradients of the sum of outputs](../figures/adjoint_gradients.png)
#
# ## 3. One block: forward and backward in one program
#
# With the whole row in one block, one program can do everything: the forward scan (for $y$ and $h$),
# the adjoint scan, and all five gradients. Two scans need the neighbour of each position, and a block
# of registers has no cheap "shift by one", so we shift **on the way in**: loading `A + t + 1` gives
# the gates $a_{t+1}$ for the adjoint, and loading the pairs at `t - 1` and scanning them gives
# $h_{t-1}$ directly (position 0 gets the identity pair, and the initial state folded in, so it
# scans to $h^{\text{init}}$). That is a recomputation: the program does three scans instead of two, to
# avoid moving data between threads. `scan_chunk` from chapter 02 folds the starting state in.

# %%
@triton.jit
def ssm_one_block_kernel(X, A, B, C, H0, DY, Y, DX, DA, DB, DC, DH0, L, BLOCK: tl.constexpr):
    # X, A, B, C, DY, Y, DX, DA, DB, DC: R x L contiguous; H0, DH0: R. One row per program, BLOCK >= L.
    row = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    mask = t < L
    offs = row * L + t
    x = tl.load(X + offs, mask=mask, other=0.0)
    a = tl.load(A + offs, mask=mask, other=1.0)
    b = tl.load(B + offs, mask=mask, other=0.0)
    c = tl.load(C + offs, mask=mask, other=0.0)
    dy = tl.load(DY + offs, mask=mask, other=0.0)
    h0 = tl.load(H0 + row)
    # forward, left to right: h_t
    h, _ = scan_chunk(a, b * x, h0, False)
    # the same scan on pairs shifted right by one: h_{t-1} (h0 at t = 0)
    before = mask & (t >= 1)
    a_prev = tl.load(A + offs - 1, mask=before, other=1.0)
    u_prev = tl.load(B + offs - 1, mask=before, other=0.0) * tl.load(X + offs - 1, mask=before, other=0.0)
    h_prev, _ = scan_chunk(a_prev, u_prev, h0, False)
    # adjoint, right to left, gates shifted left by one: delta_t = c_t dy_t + a_{t+1} delta_{t+1}
    a_next = tl.load(A + offs + 1, mask=t + 1 < L, other=0.0)
    delta, delta_0 = scan_chunk(a_next, c * dy, 0.0, True)
    tl.store(Y + offs, c * h, mask=mask)
    tl.store(DX + offs, b * delta, mask=mask)
    tl.store(DA + offs, h_prev * delta, mask=mask)
    tl.store(DB + offs, x * delta, mask=mask)
    tl.store(DC + offs, h * dy, mask=mask)
    tl.store(DH0 + row, tl.load(A + row * L) * delta_0)


def ssm_one_block(x, a, b, c, h0, dy):
    """(y, dx, da, db, dc, dh0) for contiguous (R, L) float32/float64 inputs and h0 (R,)."""
    rows, length = x.shape
    y, dx, da, db, dc = (torch.empty_like(x) for _ in range(5))
    dh0 = torch.empty_like(h0)
    ssm_one_block_kernel[(rows,)](x, a, b, c, h0, dy, y, dx, da, db, dc, dh0, length,
                                  BLOCK=triton.next_power_of_2(length))
    return y, dx, da, db, dc, dh0

# %% [markdown]
# In the adjoint the padding needs a moment's thought: past the end the shifted gate is $0$, not the
# identity's $1$. That is harmless here because the adjoint *starts* in the padding (it runs right to
# left) with a zero state and zero tokens, so the padding scans to zeros whatever the gate.
#
# Every output and gradient, against autograd in float64:

# %%
torch.manual_seed(2)
rows_1b = 4 if ON_GPU else 2
names = ["y", "dx", "da", "db", "dc", "dh0"]
print(f"{'L':>5} " + " ".join(f"{n:>9}" for n in names))
for length in [1, 7, 129, 1000, 4097]:
    x, b, c, dy = (torch.randn(rows_1b, length, dtype=torch.float64, device=DEVICE) for _ in range(4))
    a = torch.rand(rows_1b, length, dtype=torch.float64, device=DEVICE)
    h0 = torch.randn(rows_1b, dtype=torch.float64, device=DEVICE)
    expected = reference_grads(x, a, b, c, h0, dy)
    got = ssm_one_block(x, a, b, c, h0, dy)
    errors = [(g.cpu() - e.cpu()).abs().max().item() for g, e in zip(got, expected)]
    print(f"{length:5} " + " ".join(f"{err:9.1e}" for err in errors))
    assert max(errors) < 1e-9, dict(zip(names, errors))

# %% [markdown]
# ## 4. Any length: the blocked backward
#
# The forward kernel of chapter 02 walks a row's chunks left to right with the state in a register.
# The backward kernel walks them **right to left** with the adjoint state $\delta$ in a register,
# folded into the first pair of each chunk *in the adjoint's scan order* (its last in memory) exactly
# as the forward folds $h$ into the first: it is the same `scan_chunk`, run in the other direction. States flow both ways: $\delta$ from the right through
# the loop, $h$ from the left through memory.
#
# **What is stored, what is recomputed.** $\partial a_t = h_{t-1}\delta_t$ needs the forward states. Two
# options move the same bytes from memory in the backward pass:
#
# - *store the output* $h$ (it exists anyway) with the gates, and read $h_{t-1}$ back, shifted by one:
#   reads gates, $h$ and $g$, writes $\partial a$ and $\partial u$;
# - *store the inputs* (gates and tokens) plus the state at every chunk boundary, and recompute $h_{t-1}$
#   inside each chunk as in the single-block kernel: reads gates, tokens and $g$, writes the same two.
#
# Both are 3 reads and 2 writes per element. We store the output: the kernel is simpler (one scan per
# chunk instead of two) and the tokens need not be kept alive, which matters when they are a
# temporary like $b_t x_t$. The recomputing variant becomes necessary in chapter 04, where there are
# N states per position and storing them all would cost N times the memory. Nothing is
# recomputed: $\delta$ is new, and the two neighbours' values, $a_{t+1}$ and $h_{t-1}$, come from loads
# offset by one position. The loop never needs the unshifted gates, so each tensor is still read
# once; only the one element of an offset load that falls in the next chunk is read twice, and that
# one comes from the cache.
#
# One launch does the whole backward pass for both directions of the forward scan: for `reverse=True`
# the roles of left and right swap (the adjoint runs left to right with gates $a_{t-1}$, and
# $\partial a_t = h_{t+1}\delta_t$). The initial state's gradient $a_0\delta_0$ (reverse: $a_{L-1}\delta_{L-1}$) is
# the adjoint state left over after the last chunk, times one gate. In the padding we load the
# identity pair $(1, 0)$ so that the adjoint state passes through it unchanged whichever end the
# padding sits at.
#
# The kernel reuses chapter 02's machinery: `chunk_positions` walks the chunks in the adjoint's order
# (for the usual forward scan, from the right: either with descending loads, the block then in scan
# order, or with ascending loads and `reverse=True`), and `scan_chunk` scans them. All three loads are
# issued at the top of the loop body, before the scan, so that their memory latencies overlap. Its
# launch parameters are a dict of their own, `BWD_CONFIG`: the backward moves 5 tensors where the
# forward moves 3, so its best chunk, warps and loads need not be the forward's.

# %%
#| export
"""The differentiable linear scan h_t = a_t * h_{t-1} + b_t: backward kernel, custom ops, autograd, public API."""
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from scan_lib.ema import accumulator_dtype, chunk_positions, launch_options, linear_scan_rows, scan_chunk
from scan_lib.runtime import FLOAT_DTYPES, check_same_device, custom_op

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
        a_later = tl.where(mask, a_later, 1.0)  # identity pairs in the padding, 0 past the last step
        delta, delta_carry = scan_chunk(a_later, dy, delta_carry, SCAN_REVERSE)
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


# The two kernels as torch ops: opaque to torch.compile (which sees only their fake implementations)
# and batched by torch.func.vmap through their vmap rules. Inputs: contiguous rows of one dtype.
@custom_op("linear_scan_fwd", __name__)
def linear_scan_fwd(gates: torch.Tensor, tokens: torch.Tensor, initial_state: Optional[torch.Tensor],
                    reverse: bool, chunk: Optional[int]) -> torch.Tensor:
    """h for gates, tokens (rows, L) and initial_state (rows,) or None."""
    if tokens.numel() == 0:
        return torch.empty_like(tokens)
    return linear_scan_rows(gates, tokens, initial_state, reverse, chunk)


@linear_scan_fwd.register_fake
def _(gates, tokens, initial_state, reverse, chunk):
    return torch.empty_like(tokens)


@custom_op("linear_scan_bwd", __name__)
def linear_scan_bwd(gates: torch.Tensor, h: torch.Tensor, grad_h: torch.Tensor, initial_state: Optional[torch.Tensor],
                    reverse: bool, chunk: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_gates, d_tokens, d_initial_state), the last of shape (0,) when initial_state is None."""
    d_init = gates.new_empty(0) if initial_state is None else torch.zeros_like(initial_state)
    if h.numel() == 0:
        return torch.zeros_like(gates), torch.zeros_like(h), d_init
    d_gates, d_tokens, d_init_rows = linear_scan_rows_backward(gates, h, grad_h, initial_state, reverse, chunk)
    return d_gates, d_tokens, d_init if d_init_rows is None else d_init_rows


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
    delta = LinearScanFunction.apply(_shift(gates, reverse, 0.0), grad_h.contiguous(), None, not reverse, chunk)
    h_init = torch.zeros_like(h[:, :1]) if initial_state is None else initial_state[:, None]
    h_prev = _shift(h, not reverse, h_init)  # h_{t-1} (reverse: h_{t+1}), the initial state at the first step
    first = -1 if reverse else 0
    return h_prev * delta, delta, gates[:, first] * delta[:, first]


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
        shape = torch.broadcast_shapes(gate_shape, tokens.shape)
    except RuntimeError:
        raise ValueError(f"gates and tokens must have broadcastable shapes, got {tuple(gate_shape)} and "
                         f"{tuple(tokens.shape)}") from None
    if len(shape) == 0:
        raise ValueError("gates and tokens must have at least one dimension (..., L) between them, got 0-dim tensors")
    dtype = _promoted_dtype(gates, tokens)  # the dtype of gates * tokens
    if initial_state is not None:
        dtype = torch.promote_types(dtype, initial_state.dtype)
        try:
            ok = torch.broadcast_shapes(initial_state.shape, shape[:-1]) == shape[:-1]
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
    if not isinstance(gates, torch.Tensor):
        gates = torch.tensor(gates, dtype=dtype, device=tokens.device)
    rows_gates = gates.to(dtype).expand(shape).reshape(rows, length).contiguous()  # rows x L
    rows_tokens = tokens.to(dtype).expand(shape).reshape(rows, length).contiguous()  # rows x L
    rows_init = None if initial_state is None else initial_state.to(dtype).expand(shape[:-1]).reshape(rows).contiguous()
    return LinearScanFunction.apply(rows_gates, rows_tokens, rows_init, reverse, chunk).view(shape)

# %% [markdown]
# ## 5. Every gradient, every length, several chunk sizes
#
# The full model $y = c \odot \text{linear\_scan}(a,\ b \odot x,\ h^{\text{init}})$ is now ordinary
# PyTorch around our function, so autograd combines our gradients with the elementwise ones. We check
# $y$ and all five gradients against the float64 loop, at lengths 1, 7, 129, 1000, 4097, with chunks
# of 16 (hundreds of carries), 128 and 1024, in both directions, with and without an initial state.

# %%
def ssm_with_linear_scan(x, a, b, c, h0, dy, reverse, chunk):
    """(y, dx, da, db, dc, dh0) with the scan done by linear_scan; h0 may be None."""
    inputs = [t.detach().requires_grad_() for t in (x, a, b, c)]
    h0_leaf = None if h0 is None else h0.detach().requires_grad_()
    x_, a_, b_, c_ = inputs
    y = c_ * linear_scan(a_, b_ * x_, h0_leaf, reverse, chunk=chunk)
    leaves = inputs + ([] if h0_leaf is None else [h0_leaf])
    grads = torch.autograd.grad(y, leaves, dy)
    return (y.detach(), *grads)


torch.manual_seed(3)
rows_full = 16 if ON_GPU else 2
print(f"{'L':>5} {'reverse':>8} {'init':>5} {'chunk':>6} " + " ".join(f"{n:>9}" for n in names))
for length in [1, 7, 129, 1000, 4097]:
    x, b, c, dy = (torch.randn(rows_full, length, dtype=torch.float64, device=DEVICE) for _ in range(4))
    a = torch.rand(rows_full, length, dtype=torch.float64, device=DEVICE)
    h0 = torch.randn(rows_full, dtype=torch.float64, device=DEVICE)
    for reverse in [False, True]:
        for with_init in [True, False]:
            init = h0 if with_init else torch.zeros_like(h0)
            expected = reference_grads(x, a, b, c, init, dy, reverse)
            for chunk in [16, 128, 1024]:
                got = ssm_with_linear_scan(x, a, b, c, h0 if with_init else None, dy, reverse, chunk)
                errors = [(g.cpu() - e.cpu()).abs().max().item() for g, e in zip(got, expected)]
                assert max(errors) < 1e-9, (length, reverse, with_init, chunk, dict(zip(names, errors)))
                if with_init:
                    print(f"{length:5} {str(reverse):>8} {'yes':>5} {chunk:6} " + " ".join(f"{err:9.1e}" for err in errors))
print("without an initial state: y, dx, da, db, dc also match at every length, direction and chunk")

# %% [markdown]
# The loop above ran the backward kernel with its default launch parameters `BWD_CONFIG`. The other
# way of running the adjoint against the memory order (descending loads instead of `reverse=True`,
# or the reverse) must give the same gradients:

# %%
bwd_config = sys.modules["scan_lib.linear_scan"].BWD_CONFIG  # the module's dict (scan_lib.linear_scan is the function)
default_bwd_config = dict(bwd_config)
bwd_config["reversed_loads"] = not default_bwd_config["reversed_loads"]
try:
    for length in [129, 4097]:
        x, b, c, dy = (torch.randn(rows_full, length, dtype=torch.float64, device=DEVICE) for _ in range(4))
        a = torch.rand(rows_full, length, dtype=torch.float64, device=DEVICE)
        h0 = torch.randn(rows_full, dtype=torch.float64, device=DEVICE)
        for reverse in [False, True]:
            expected = reference_grads(x, a, b, c, h0, dy, reverse)
            got = ssm_with_linear_scan(x, a, b, c, h0, dy, reverse, 128)
            errors = [(g.cpu() - e.cpu()).abs().max().item() for g, e in zip(got, expected)]
            assert max(errors) < 1e-9, (length, reverse, dict(zip(names, errors)))
finally:
    bwd_config.update(default_bwd_config)
print(f"backward with reversed_loads={not default_bwd_config['reversed_loads']}: all gradients match at L = 129 and 4097")

# %% [markdown]
# `torch.autograd.gradcheck` compares our backward with finite differences of our own forward, in
# float64, on small shapes with extra leading dims and a non-contiguous input. On the CPU we use its
# `fast_mode` (it checks the Jacobian along random directions instead of column by column: hundreds
# of interpreted launches fewer); on a GPU, the full Jacobian.

# %%
torch.manual_seed(4)
gates_gc = torch.rand(2, 3, 37, dtype=torch.float64, device=DEVICE).requires_grad_()
tokens_gc = torch.randn(2, 37, 3, dtype=torch.float64, device=DEVICE).transpose(1, 2).requires_grad_()  # non-contiguous
init_gc = torch.randn(2, 3, dtype=torch.float64, device=DEVICE).requires_grad_()
assert not tokens_gc.is_contiguous()
for reverse in [False, True]:
    assert torch.autograd.gradcheck(lambda g, u, h: linear_scan(g, u, h, reverse, chunk=16),
                                    (gates_gc, tokens_gc, init_gc), fast_mode=not ON_GPU)
print(f"gradcheck (float64, shape (2, 3, 37), chunk 16, both directions, fast_mode={not ON_GPU}): ok")

# %% [markdown]
# Low precision: the gradients of float16/bfloat16/float32 inputs, relative to the largest float64
# gradient. The scans accumulate in float32, so the error is a few roundings of the stored values.

# %%
torch.manual_seed(5)
gates_lp = torch.rand(4, 2000, device=DEVICE) * 0.5 + 0.5
tokens_lp, grad_lp = torch.randn(2, 4, 2000, device=DEVICE)
init_lp = torch.randn(4, device=DEVICE)
leaves64 = [t.double().requires_grad_() for t in (gates_lp, tokens_lp, init_lp)]
h64 = linear_scan(*leaves64)
ref_lp = [h64.detach(), *torch.autograd.grad(h64, leaves64, grad_lp.double())]
print(f"{'dtype':>15} " + " ".join(f"{n:>9}" for n in ["h", "d_gates", "d_tokens", "d_init"]))
for dtype, tolerance in [(torch.float32, 1e-5), (torch.float16, 5e-3), (torch.bfloat16, 3e-2)]:
    leaves = [t.to(dtype).requires_grad_() for t in (gates_lp, tokens_lp, init_lp)]
    h_lp = linear_scan(*leaves)
    got = [h_lp.detach(), *torch.autograd.grad(h_lp, leaves, grad_lp.to(dtype))]
    assert all(t.dtype == dtype for t in got)
    errors = [((g.double() - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref_lp)]
    print(f"{str(dtype):>15} " + " ".join(f"{err:9.1e}" for err in errors))
    assert max(errors) < tolerance

# %% [markdown]
# Bad input gets an exception that names the argument; empty sequences are allowed.

# %%
ok_gates = torch.rand(2, 5, device=DEVICE)
ok_tokens = torch.randn(2, 5, device=DEVICE)
bad_calls = {
    "shape mismatch": (ValueError, lambda: linear_scan(ok_gates, ok_tokens[:, :4])),
    "dtype mismatch": (TypeError, lambda: linear_scan(ok_gates.double(), ok_tokens)),
    "integer tokens": (TypeError, lambda: linear_scan(ok_gates, torch.ones(2, 5, dtype=torch.int64, device=DEVICE))),
    "not a tensor": (TypeError, lambda: linear_scan([0.5] * 5, ok_tokens)),
    "0-dim tensors": (ValueError, lambda: linear_scan(ok_gates[0, 0], ok_tokens[0, 0])),
    "initial_state shape": (ValueError, lambda: linear_scan(ok_gates, ok_tokens, torch.zeros(5, device=DEVICE))),
    "initial_state dtype": (TypeError, lambda: linear_scan(ok_gates, ok_tokens, torch.zeros(2, device=DEVICE, dtype=torch.float64))),
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
# ## 6. On a GPU: how fast, and how far from the floor
#
# The workload of the design table: gates and tokens of shape (batch 8, channels 1024, L 4096) in
# float32, 8192 rows of 4096. Every scan must read its inputs and write its outputs at least once, so
# the **memory floor** is the bytes that must move divided by the copy bandwidth, which we measure in
# the same cell with `copy_bandwidth` (chapter 00: a 1 GiB `copy_`, timed by `median_us`). One tensor
# is $8 \cdot 1024 \cdot 4096 \cdot 4$ bytes = 128 MiB. We count:
#
# - forward: read gates and tokens, write $h$: **3 tensors** (384 MiB);
# - forward + backward: the forward's 3, plus the backward reads gates, $h$ (or, recomputing, tokens)
#   and the incoming gradient and writes $\partial$gates and $\partial$tokens: **8 tensors** (1 GiB).
#   The backward reads the gates and $h$ at positions offset by one, but still each element once.
#
# We compare with accelerated-scan's Triton kernel (`from accelerated_scan.scalar import scan`, or
# `accelerated_scan.triton` in other versions: `scan(gates, tokens)`, same recurrence, contiguous
# (B, C, T) tensors) when it is installed. Its structure is close to ours: one
# program per row, chunks of 2048, the adjoint scanned with `reverse=True` over ascending loads, the
# shifted gates and states read by a second, offset load. Ours is timed with the default launch
# parameters (`FWD_CONFIG`, `BWD_CONFIG`) and with the other way of running the adjoint backwards
# (descending loads); `benchmarks/bench_linear_scan.py` sweeps all the parameters. Times are medians
# of `triton.testing.do_bench` (`median_us`, chapter 00); fwd+bwd uses `torch.autograd.grad` so no
# `.grad` accumulation is timed.

# %%
if not ON_GPU:
    print("skipped: needs a GPU")
else:
    from scan_lib.runtime import copy_bandwidth, median_us

    backward_config = sys.modules["scan_lib.linear_scan"].BWD_CONFIG  # the module's dict (scan_lib.linear_scan is the function)
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
    save_figure(fig, "linear_scan_benchmark.png")
    plt.close(fig)

# %% [markdown]
# ![benchmark](../figures/linear_scan_benchmark.png)
#
# (The figure is written by the cell above on a GPU.) Both passes are memory-bound, so the time should
# sit a little above the dashed floor. The forward moves each element once each way. The backward adds
# 5 tensors, and a scan that runs against the memory order: with `reverse=True` the compiled code
# reverses the values across each warp's threads before and after the scan; with descending loads it
# does not, but gives up wide loads and needs more registers per thread.
#
# **What the H200 measured (2026-11-29, the table above; copy bandwidth 4.25 TB/s).**
#
# - *Forward: at the floor.* 101.3 us, 1.07 times the 95 us floor; accelerated-scan took 103.6 us.
#   Both kernels are within 10% of what memory allows; there is little left to win.
# - *Forward + backward: 350.0 us, 1.39 times the 253 us floor*, against 385.9 us for accelerated-scan
#   in the same run. The gap to the floor is not in the kernels: timed alone by
#   `benchmarks/bench_linear_scan.py`, the backward kernel takes 169 us against its 159 us floor
#   (5 tensors), so the two kernels add up to about 270 us. The remaining 80 us lie outside them
#   (presumably autograd, allocations and the gaps between launches), and that part varies a lot
#   from run to run: an earlier run measured accelerated-scan at 281.6 us and ours between 277 and
#   660 us depending on launch parameters, in an order unrelated to the kernels' own times (the
#   configuration with the fastest backward kernel, 169 us, measured 660 us forward + backward). We
#   have not found the source of this variance, so read the fwd+bwd column as a rough figure: it
#   does not show that we beat accelerated-scan, only that our two kernels run close to their floors.
# - *Descending loads lose.* In the backward they took 219 us against 169 us for `reverse=True`
#   (571.4 us fwd+bwd in the table above), so `BWD_CONFIG` keeps ascending loads.
# - *Direction and dtype.* The forward pass of `linear_scan(..., reverse=True)` costs about 10% more
#   than a left-to-right one (109.7 against 100.4 us): the price of reversing values across each warp. bfloat16 inputs halve
#   the bytes: the forward took 54.3 us (floor about 48 us).
#
# ## Summary
#
# - The adjoint of $h_t = a_t h_{t-1} + u_t$ is $\delta_t = g_t + a_{t+1}\delta_{t+1}$: the same scan run the
#   other way on the shifted gates; $\partial u = \delta$, $\partial a_t = h_{t-1}\delta_t$,
#   $\partial h^{\text{init}} = a_0\delta_0$; with $b$ and $c$ around it, $\partial x = b\delta$, $\partial b = x\delta$,
#   $\partial c = h\,g$.
# - The backward kernel walks each row's chunks right to left, carrying $\delta$ in a register and
#   reading the stored forward output one step back; one kernel serves both scan directions. It runs
#   the adjoint against the memory order either with `reverse=True` or with descending loads; its
#   launch parameters are `BWD_CONFIG` (the forward's, `FWD_CONFIG`), swept by
#   `benchmarks/bench_linear_scan.py`.
# - `scan_lib.linear_scan(gates, tokens, initial_state=None, reverse=False)` is differentiable in all
#   three tensors; every gradient was checked against autograd in float64, at lengths 1 to 4097,
#   chunk sizes 16 to 1024, both directions, with and without an initial state, and by `gradcheck`.
# - Next, chapter 04: N states per position, where storing $h$ is no longer an option.
