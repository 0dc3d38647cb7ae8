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
# # 06 · The Mamba block: the scan doing its job
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/scan-course/scans-the-hard-way/blob/main/notebooks/06_mamba_block.ipynb)
#
# Chapter 05 built the selective scan. Here it goes to work inside the layer Mamba stacks to make a
# language model. You will learn:
#
# 1. the causal depthwise convolution that comes before the scan, as a Triton kernel (forward and
#    backward), a drop-in for the `causal-conv1d` package's `causal_conv1d_fn`;
# 2. the block around the two kernels, piece by piece, with `mamba_ssm`'s parameter names so a
#    `state_dict` loads either way, and the initialisation that keeps it stable (and what goes wrong
#    without it);
# 3. inference three ways that agree: the whole sequence at once, a long prompt in chunks, and one
#    token at a time in constant memory;
# 4. the scan three ways: a loop, PyTorch's `associative_scan`, and `scan_lib`;
# 5. a tiny model that learns the selective-copying task, beside a baseline that cannot.

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
#| default_exp mamba

# %%
import math

import matplotlib
import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from scan_lib.runtime import save_figure

matplotlib.use("Agg")


def max_err(x, ref):
    """Largest absolute difference, in float64."""
    return (x.double() - ref.double()).abs().max().item()

# %% [markdown]
# ## 1. The block at a glance
#
# (lead: the data flow of one block)

# %% [markdown]
# ## 2. The causal convolution
#
# Before the scan, Mamba mixes each channel with its few predecessors: a **depthwise** convolution
# (each of the `dim` channels has its own filter; channels never mix) that is **causal** (position $t$
# sees positions $t-K+1, \dots, t$ only). With filter width $K$ (2 to 4; Mamba uses 4), weights
# $w_{d,k}$ and bias $\beta_d$ for channel $d$, the output is the scan's input $u$ of chapter 05:
#
# $$u_{t,d} = \mathrm{silu}\Big(\beta_d + \sum_{k=0}^{K-1} w_{d,k}\, x_{t-K+1+k,\,d}\Big),
# \qquad \mathrm{silu}(p) = p\,\sigma(p) = \frac{p}{1 + e^{-p}},$$
#
# where $x_s$ for $s < 0$ is zero, or the `initial_states` (the last $K-1$ inputs of a previous
# piece of the sequence). The weight $w_{d,K-1}$ multiplies the current input; $w_{d,0}$ the oldest.
# `mamba_ssm` gets this from the `causal-conv1d` CUDA package; we write it in Triton with the same
# function signature as that package's `causal_conv1d_fn`, so either can be imported. The
# reference is the package's own, on `F.conv1d` (`groups=dim` makes it depthwise; padding $K-1$ on
# both sides, then keeping the first $L$ outputs, makes it causal):

# %%
#| export causal_conv1d
"""Causal depthwise conv1d (Mamba's short convolution): float64 reference and the Triton kernels behind
`causal_conv1d` (a drop-in for the causal-conv1d package's causal_conv1d_fn) and `causal_conv1d_update`."""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from scan_lib.ema import accumulator_dtype
from scan_lib.runtime import INTERPRET, apply, check_float_tensor, check_same_device, custom_op


def causal_conv1d_ref(x, weight, bias=None, initial_states=None, return_final_states=False, activation=None):
    """The package's reference (causal_conv1d_ref), with F.conv1d: x (batch, dim, L), weight (dim, width)."""
    dtype_in, length, (dim, width) = x.dtype, x.shape[-1], weight.shape
    x = x.to(weight.dtype)
    if initial_states is None:
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=dim)
    else:
        x = torch.cat([initial_states.to(weight.dtype), x], dim=-1)
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=0, groups=dim)
    out = out[..., :length]
    out = (out if activation is None else F.silu(out)).to(dtype_in)
    if not return_final_states:
        return out
    return out, F.pad(x, (width - 1 - x.shape[-1], 0)).to(dtype_in)

# %% [markdown]
# **Why causal.** A language model predicts token $t+1$ from tokens $\le t$; if any layer lets
# position $t$ read $t+1$, training shows the model the answer and generation (where $t+1$ does not
# exist yet) breaks. The usual "same" convolution pads symmetrically, so its output at $t$ reads
# $t+1$. The cell changes one input, at position 5, and asks which outputs moved:

# %%
from scan_lib.causal_conv1d import causal_conv1d, causal_conv1d_ref

torch.manual_seed(0)
conv_x = torch.randn(1, 1, 10, dtype=torch.float64, device=DEVICE)
conv_w = torch.randn(1, 3, dtype=torch.float64, device=DEVICE)
conv_x_changed = conv_x.clone()
conv_x_changed[..., 5] += 1.0                                          # a different token at t = 5
same = lambda v: F.conv1d(v, conv_w.unsqueeze(1), padding=1)           # symmetric padding, width 3
moved_same = (same(conv_x_changed) != same(conv_x)).flatten().nonzero().flatten().tolist()
moved_causal = (causal_conv1d(conv_x_changed, conv_w) != causal_conv1d(conv_x, conv_w)).flatten().nonzero().flatten().tolist()
print(f"outputs that moved, symmetric padding: {moved_same};  causal: {moved_causal}")
assert min(moved_same) == 4            # position 4 saw the future
assert moved_causal == [5, 6, 7]       # the change reaches t = 5 .. 5 + K - 1, never before

# %% [markdown]
# **The kernel.** One program per (batch element, block of `BLOCK_D` channels, block of `BLOCK_L`
# positions) computes a `BLOCK_D x BLOCK_L` tile of outputs. The sum over $k$ is unrolled
# (`tl.static_range(WIDTH)`): $K$ loads of the same tile shifted by $k - K + 1$ positions, each
# times the channels' weight $w_{\cdot,k}$. The shifted loads overlap, so after the first they come
# from cache: the kernel reads $x$ about once. `_x_at` is the one place that knows the padding:
# positions $< 0$ come from `initial_states` (or are zero), positions $\ge L$ are masked. Bias and
# SiLU are applied in registers before the single store. The program of the first block of
# positions also writes the final states, the last $K-1$ columns of `cat(initial_states, x)`, which
# are the next piece's `initial_states`. Strides are arguments, so a transposed (channel-last) or sliced `x`
# is read in place, never copied.

# %%
#| export causal_conv1d
@triton.jit
def _x_at(X_ROW, H0_ROW, s, d_ok, length, stride_xl, stride_hl,
          WIDTH: tl.constexpr, HAS_H0: tl.constexpr, ACC: tl.constexpr):
    """x at positions s (1 x BLOCK_L, may be negative) of a block of channels (X_ROW: BLOCK_D x 1):
    x[s] for 0 <= s < L, initial_states[WIDTH - 1 + s] for -(WIDTH - 1) <= s < 0 (zero without), 0 past L."""
    val = tl.load(X_ROW + s * stride_xl, d_ok & (s >= 0) & (s < length), other=0.0).to(ACC)
    if HAS_H0:
        val += tl.load(H0_ROW + (s + WIDTH - 1) * stride_hl, d_ok & (s < 0) & (s >= 1 - WIDTH), other=0.0).to(ACC)
    return val


@triton.jit
def _pre_activation(X_ROW, H0_ROW, W_ROW, bias, t, d_ok, length, stride_xl, stride_hl, stride_wk,
                    WIDTH: tl.constexpr, HAS_H0: tl.constexpr, ACC: tl.constexpr):
    """bias + sum_k w[k] x[t - (WIDTH - 1) + k] at positions t (1 x BLOCK_L): BLOCK_D x BLOCK_L."""
    acc = bias + tl.zeros(t.shape, ACC)                                    # BLOCK_D x BLOCK_L
    for k in tl.static_range(WIDTH):
        w = tl.load(W_ROW + k * stride_wk, d_ok, other=0.0).to(ACC)        # BLOCK_D x 1
        acc += w * _x_at(X_ROW, H0_ROW, t - (WIDTH - 1) + k, d_ok, length, stride_xl, stride_hl, WIDTH, HAS_H0, ACC)
    return acc


@triton.jit
def causal_conv1d_fwd_kernel(
    X, WEIGHT, BIAS, H0, OUT, FINAL,          # b x d x L, d x W, d, b x d x (W-1), b x d x L, b x d x (W-1)
    dim, length,
    stride_xb, stride_xd, stride_xl, stride_wd, stride_wk, stride_bias,
    stride_hb, stride_hd, stride_hl, stride_ob, stride_od, stride_ol, stride_fb, stride_fd, stride_fl,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, SILU: tl.constexpr,
    ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """One program per (batch element, block of channels, block of positions)."""
    b = tl.program_id(0).to(tl.int64)
    pid_l = tl.program_id(2)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[:, None]       # BLOCK_D x 1
    d_ok = ds < dim
    ts = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)[None, :]                  # 1 x BLOCK_L
    X_ROW = X + b * stride_xb + ds * stride_xd
    H0_ROW = X_ROW
    if HAS_H0:
        H0_ROW = H0 + b * stride_hb + ds * stride_hd
    bias = tl.zeros((BLOCK_D, 1), ACC)
    if HAS_BIAS:
        bias = tl.load(BIAS + ds * stride_bias, d_ok, other=0.0).to(ACC)
    pre = _pre_activation(X_ROW, H0_ROW, WEIGHT + ds * stride_wd, bias, ts, d_ok, length, stride_xl, stride_hl,
                          stride_wk, WIDTH, HAS_H0, ACC)
    out = pre
    if SILU:
        out = pre / (1.0 + tl.exp(-pre))
    tl.store(OUT + b * stride_ob + ds * stride_od + ts * stride_ol, out.to(OUT.dtype.element_ty), d_ok & (ts < length))
    if pid_l == 0:  # the final states: the last WIDTH - 1 columns of cat(initial_states, x)
        j = tl.arange(0, 4)[None, :]                                       # 1 x 4, WIDTH - 1 <= 3 used
        final = _x_at(X_ROW, H0_ROW, length - (WIDTH - 1) + j, d_ok, length, stride_xl, stride_hl, WIDTH, HAS_H0, ACC)
        tl.store(FINAL + b * stride_fb + ds * stride_fd + j * stride_fl, final.to(FINAL.dtype.element_ty),
                 d_ok & (j < WIDTH - 1))

# %% [markdown]
# **The backward.** Write $p_{t,d}$ for the pre-activation (the argument of silu) and pad $x$ on the
# left with the $K-1$ initial states. The incoming gradient through the activation is
#
# $$g_t = \frac{\partial\mathcal{L}}{\partial p_t} = \frac{\partial\mathcal{L}}{\partial u_t}\,
# \mathrm{silu}'(p_t), \qquad \mathrm{silu}'(p) = \sigma(p)\big(1 + p\,(1 - \sigma(p))\big),$$
#
# with $p_t$ recomputed from $x$ (cheaper than storing it: $K$ loads of $x$ against a write and a
# read of a `(batch, dim, L)` tensor). Input $x_s$ appears in the outputs $t = s, \dots, s+K-1$, as the
# term $k = s - t + K - 1$, so
#
# $$\frac{\partial\mathcal{L}}{\partial x_s} = \sum_{j=0}^{K-1} w_{K-1-j}\, g_{s+j}:$$
#
# the same convolution with the **flipped** filter, run **forward** in time (reading positions
# $s, \dots, s+K-1$, zero past $L$): the kernel computes $g$ at $K$ shifted positions as the
# forward loads $x$ at $K$ shifted positions. The initial states are the inputs at $s = -K+1, \dots, -1$, the same formula. The weight
# and bias gradients sum over every batch element and position:
#
# $$\frac{\partial\mathcal{L}}{\partial w_{d,k}} = \sum_{b,\,t} g_{b,t,d}\; x_{b,\,t-K+1+k,\,d},
# \qquad \frac{\partial\mathcal{L}}{\partial \beta_d} = \sum_{b,\,t} g_{b,t,d}.$$
#
# Each program writes its block's partial sums, and PyTorch adds them up afterwards in a fixed order:
# no atomics, so the gradients are the same bits on every run. A gradient arriving through the final
# states flows straight into the inputs they copied (the last $K-1$ columns of $x$, or initial states
# when $L < K-1$).

# %%
#| export causal_conv1d
@triton.jit
def _grad_pre(X_ROW, H0_ROW, W_ROW, bias, DOUT_ROW, t, d_ok, length, stride_xl, stride_hl, stride_wk, stride_gl,
              WIDTH: tl.constexpr, HAS_H0: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr):
    """g = dL/d(pre-activation) at positions t (1 x BLOCK_L): dout * silu'(pre), recomputing pre; 0 past L."""
    g = tl.load(DOUT_ROW + t * stride_gl, d_ok & (t < length), other=0.0).to(ACC)
    if SILU:
        pre = _pre_activation(X_ROW, H0_ROW, W_ROW, bias, t, d_ok, length, stride_xl, stride_hl, stride_wk,
                              WIDTH, HAS_H0, ACC)
        sig = 1.0 / (1.0 + tl.exp(-pre))
        g = g * sig * (1.0 + pre * (1.0 - sig))
    return g


@triton.jit
def causal_conv1d_bwd_kernel(
    X, WEIGHT, BIAS, H0, DOUT, DFINAL,        # as the forward; b x d x L, b x d x (W-1)
    DX, DW_PART, DBIAS_PART, DH0,             # b x d x L, (b * n_blocks_l) x d x W, (b * n_blocks_l) x d, b x d x (W-1)
    dim, length, n_blocks_l,
    stride_xb, stride_xd, stride_xl, stride_wd, stride_wk, stride_bias, stride_hb, stride_hd, stride_hl,
    stride_gb, stride_gd, stride_gl, stride_fb, stride_fd, stride_fl, stride_dxb, stride_dxd, stride_dxl,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, HAS_DFINAL: tl.constexpr,
    SILU: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pid_l = tl.program_id(2)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[:, None]       # BLOCK_D x 1
    d_ok = ds < dim
    ts = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)[None, :]                  # 1 x BLOCK_L
    X_ROW = X + b * stride_xb + ds * stride_xd
    W_ROW = WEIGHT + ds * stride_wd
    DOUT_ROW = DOUT + b * stride_gb + ds * stride_gd
    H0_ROW = X_ROW
    if HAS_H0:
        H0_ROW = H0 + b * stride_hb + ds * stride_hd
    bias = tl.zeros((BLOCK_D, 1), ACC)
    if HAS_BIAS:
        bias = tl.load(BIAS + ds * stride_bias, d_ok, other=0.0).to(ACC)
    # dx[s] = sum_j w[WIDTH - 1 - j] g[s + j]: the flipped filter, reading forward in time
    dx = tl.zeros((BLOCK_D, BLOCK_L), ACC)
    g0 = dx
    for j in tl.static_range(WIDTH):
        g = _grad_pre(X_ROW, H0_ROW, W_ROW, bias, DOUT_ROW, ts + j, d_ok, length, stride_xl, stride_hl, stride_wk,
                      stride_gl, WIDTH, HAS_H0, SILU, ACC)
        if j == 0:
            g0 = g
        dx += tl.load(W_ROW + (WIDTH - 1 - j) * stride_wk, d_ok, other=0.0).to(ACC) * g
    F_ROW = X_ROW
    if HAS_DFINAL:
        F_ROW = DFINAL + b * stride_fb + ds * stride_fd
    if HAS_DFINAL:  # x's last WIDTH - 1 columns are the final states
        jf = ts - (length - (WIDTH - 1))
        dx += tl.load(F_ROW + jf * stride_fl, d_ok & (jf >= 0) & (ts < length), other=0.0).to(ACC)
    tl.store(DX + b * stride_dxb + ds * stride_dxd + ts * stride_dxl, dx.to(DX.dtype.element_ty),
             d_ok & (ts < length))
    # this block's share of dweight[k] = sum_t g[t] x[t - (WIDTH - 1) + k] and of dbias = sum_t g[t]
    part = (b * n_blocks_l + pid_l) * dim
    for k in tl.static_range(WIDTH):
        xk = _x_at(X_ROW, H0_ROW, ts - (WIDTH - 1) + k, d_ok, length, stride_xl, stride_hl, WIDTH, HAS_H0, ACC)
        tl.store(DW_PART + (part + ds) * WIDTH + k, tl.sum(g0 * xk, axis=1)[:, None], d_ok)
    if HAS_BIAS:
        tl.store(DBIAS_PART + part + ds, tl.sum(g0, axis=1)[:, None], d_ok)
    if HAS_H0:
        if pid_l == 0:  # dh0[i] = sum_{k <= i} w[k] g[i - k], plus dfinal[i - L] when L < WIDTH - 1
            q = tl.arange(0, 4)[None, :]                                   # positions 0..3
            gq = _grad_pre(X_ROW, H0_ROW, W_ROW, bias, DOUT_ROW, q, d_ok, length, stride_xl, stride_hl, stride_wk,
                           stride_gl, WIDTH, HAS_H0, SILU, ACC)
            for i in tl.static_range(WIDTH - 1):
                dh = tl.zeros((BLOCK_D, 1), ACC)
                for k in tl.static_range(i + 1):
                    w = tl.load(W_ROW + k * stride_wk, d_ok, other=0.0).to(ACC)
                    dh += tl.sum(tl.where(q == i - k, w * gq, 0.0), axis=1)[:, None]
                if HAS_DFINAL:
                    dh += tl.load(F_ROW + (i - length) * stride_fl, d_ok & (i >= length), other=0.0).to(ACC)
                tl.store(DH0 + (b * dim + ds) * (WIDTH - 1) + i, dh.to(DH0.dtype.element_ty), d_ok)

# %% [markdown]
# **Checks.** `causal_conv1d` (the launchers and the `autograd.Function` around these kernels are in
# "Going deeper: the convolution kernels") against the reference in float64, at lengths that are not
# multiples of anything (1 is shorter than the filter), for every width, with bias, SiLU, initial
# states and final states all on, and every gradient: $x$, $w$, $\beta$, the initial states, and a
# gradient arriving through the final states. In float64 both sides sum the same few terms, so they
# agree to rounding ($10^{-12}$ relative is far above it). `tests/test_causal_conv1d.py` adds
# `gradcheck` (our backward against finite differences of our own forward) for every input.

# %%
def conv_grads(fn, x, weight, bias, h0, dout, dfinal, dtype=None):
    """out, final states and the four gradients of sum(out * dout) + sum(final * dfinal)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in (x, weight, bias, h0)]
    out, final = fn(leaves[0], leaves[1], leaves[2], initial_states=leaves[3], return_final_states=True,
                    activation="silu")
    loss = (out.double() * dout).sum() + (final.double() * dfinal).sum()
    return [out, final, *torch.autograd.grad(loss, leaves)]


def rel_err(x, ref):
    """Largest absolute difference relative to the reference's largest magnitude."""
    return max_err(x, ref) / max(ref.double().abs().max().item(), 1e-300)


def conv_problem(batch, dim, length, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, dim, length), (dim, width), (dim,), (batch, dim, width - 1), (batch, dim, length),
              (batch, dim, width - 1)]
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(DEVICE) for s in shapes]


CONV_NAMES = ["out", "final", "dx", "dweight", "dbias", "dinitial"]
print(" width      L  " + "  ".join(f"{n:>8}" for n in CONV_NAMES))
for width in (2, 3, 4):
    for length in (1, 7, 129, 1000):
        problem = conv_problem(2, 3, length, width, seed=width * length)
        ours, ref = conv_grads(causal_conv1d, *problem), conv_grads(causal_conv1d_ref, *problem)
        errors = [rel_err(a, r) for a, r in zip(ours, ref)]
        print(f"{width:6d} {length:6d}  " + "  ".join(f"{e:8.1e}" for e in errors))
        assert max(errors) < 1e-12, (width, length, errors)

# %% [markdown]
# In half precision the inputs are rounded to the dtype for both sides, the kernel sums in float32,
# and only the final cast of each output and gradient to the dtype differs from the float64 reference:
# half a unit in the last place, $2^{-11}$ relative for float16 and $2^{-8}$ for bfloat16 (rounding to
# nearest; Triton's CPU interpreter truncates to bfloat16, a whole unit, $2^{-7}$), plus float32 sums of
# up to `batch x L` terms. The bound is relative to each tensor's largest magnitude.

# %%
from scan_lib.runtime import INTERPRET

conv_length = 1000 if ON_GPU else 129
print(f"{'dtype':>9}  " + "  ".join(f"{n:>8}" for n in CONV_NAMES) + "     bound")
for dtype in (torch.float16, torch.bfloat16):
    problem = conv_problem(2, 8, conv_length, 4, seed=1)
    problem = [t.to(dtype).double() for t in problem]                    # representable in dtype
    ours = conv_grads(causal_conv1d, *problem, dtype=dtype)
    ref = conv_grads(causal_conv1d_ref, *problem)
    unit = {torch.float16: 2**-11, torch.bfloat16: 2**-7 if INTERPRET else 2**-8}[dtype]
    bound = unit + 32 * (2 * conv_length) ** 0.5 * 2**-24
    errors = [rel_err(a, r) for a, r in zip(ours, ref)]
    print(f"{str(dtype)[6:]:>9}  " + "  ".join(f"{e:8.1e}" for e in errors) + f"  {bound:8.1e}")
    assert all(o.dtype == dtype for o in ours) and max(errors) <= bound, errors

# %% [markdown]
# **Against the `causal-conv1d` package** (GPU only, where it is installed). Its kernel wants
# channel-last `x` (`x.stride(1) == 1`) for `initial_states` and final states, so the second
# comparison hands both functions the same channel-last view (ours reads any strides). Then the speed
# at Mamba's size (batch 8, dim 2048, L 2048, bf16, width 4, bias, SiLU), beside `F.conv1d` + `F.silu`,
# and the memory floor: the bytes that must move (forward: read $x$, write $u$; backward: also read
# $x$ and $\partial\mathcal{L}/\partial u$, write $\partial\mathcal{L}/\partial x$) over the copy
# bandwidth measured in the same cell.

# %%
def package_errors(causal_conv1d_fn, dtype, channel_last):
    """Relative differences between ours and the package's outputs and gradients on one problem."""
    problem = conv_problem(4, 512, 1000, 4, seed=7)
    if channel_last:  # x and the states with stride 1 along dim; .to() below keeps the layout
        problem = [p.transpose(1, 2).contiguous().transpose(1, 2) if p.dim() == 3 else p for p in problem]
    x, weight, bias, h0, dout, dfinal = [t.to(dtype).double() for t in problem]
    h0 = h0 if channel_last else None
    names = ["out", "final", "dx", "dweight", "dbias", "dinitial"] if channel_last else ["out", "dx", "dweight", "dbias"]

    def run(fn):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, weight, bias, h0) if t is not None]
        result = fn(*leaves[:3], initial_states=leaves[3] if channel_last else None,
                    return_final_states=channel_last, activation="silu")
        outs = list(result) if channel_last else [result]
        loss = sum((o.double() * d).sum() for o, d in zip(outs, (dout, dfinal)))
        return outs + list(torch.autograd.grad(loss, leaves))

    return names, [rel_err(a, r) for a, r in zip(run(causal_conv1d), run(causal_conv1d_fn))]


def conv_io_bytes(batch, dim, length, size, backward):
    return (2 + 3 * backward) * batch * dim * length * size


try:
    from causal_conv1d import causal_conv1d_fn
except ImportError as error:
    causal_conv1d_fn = None
    conv_package_error = error
if not ON_GPU:
    print("skipped: needs a GPU")
else:
    from scan_lib.runtime import copy_bandwidth, median_us
    if causal_conv1d_fn is None:
        print(f"causal-conv1d not importable ({conv_package_error}): no comparison, timing ours and F.conv1d only")
    else:
        for dtype in (torch.float32, torch.bfloat16):
            for channel_last in (False, True):
                layout = "channel-last + states" if channel_last else "contiguous"
                try:
                    names, errors = package_errors(causal_conv1d_fn, dtype, channel_last)
                except (RuntimeError, AssertionError) as error:  # the package's own layout checks
                    if not channel_last:
                        raise
                    print(f"{str(dtype)[6:]:>9} {layout:>22}: the package refused ({error})")
                    continue
                print(f"{str(dtype)[6:]:>9} {layout:>22}  " + "  ".join(f"{n} {e:.1e}" for n, e in zip(names, errors)))
                assert max(errors) < (2**-6 if dtype == torch.bfloat16 else 1e-4), errors
    bench_batch, bench_dim, bench_length = 8, 2048, 2048
    bench_gen = torch.Generator(device=DEVICE).manual_seed(0)
    bench_x = torch.randn(bench_batch, bench_dim, bench_length, device=DEVICE, generator=bench_gen)
    bench_x = bench_x.to(torch.bfloat16).requires_grad_(True)
    bench_w = (0.5 * torch.randn(bench_dim, 4, device=DEVICE, generator=bench_gen)).to(torch.bfloat16).requires_grad_(True)
    bench_b = torch.randn(bench_dim, device=DEVICE, generator=bench_gen).to(torch.bfloat16).requires_grad_(True)
    bench_dout = torch.randn_like(bench_x)
    conv_impls = {
        "scan_lib": lambda x, w, b: causal_conv1d(x, w, b, activation="silu"),
        "F.conv1d+silu": lambda x, w, b: F.silu(F.conv1d(x, w.unsqueeze(1), b, padding=3, groups=bench_dim)[..., :bench_length]),
    }
    if causal_conv1d_fn is not None:
        conv_impls["causal-conv1d"] = lambda x, w, b: causal_conv1d_fn(x, w, b, activation="silu")
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, (batch, dim, L) = {(bench_batch, bench_dim, bench_length)}, bf16, "
          f"width 4, bias, silu; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'':>16} {'fwd (us)':>10} {'fwd+bwd (us)':>13}")
    floors = [conv_io_bytes(bench_batch, bench_dim, bench_length, 2, bwd) / bandwidth * 1e6 for bwd in (False, True)]
    print(f"{'memory floor':>16} {floors[0]:10.0f} {floors[1]:13.0f}")
    bench_leaves = [bench_x, bench_w, bench_b]
    for name, fn in conv_impls.items():
        with torch.no_grad():
            forward = median_us(lambda fn=fn: fn(bench_x, bench_w, bench_b))
        both = median_us(lambda fn=fn: fn(bench_x, bench_w, bench_b).backward(bench_dout), grad_to_none=bench_leaves)
        print(f"{name:>16} {forward:10.0f} {both:13.0f}")

# %% [markdown]
# ## 3. The block, piece by piece
#
# (lead)

# %% [markdown]
# ## 4. Inference three ways
#
# (lead)

# %% [markdown]
# ## 5. The scan three ways
#
# (lead)

# %% [markdown]
# ## 6. A model that learns: selective copying
#
# (model helper: this section)

# %% [markdown]
# ## 7. On the GPU: one block against mamba_ssm's
#
# (lead)

# %% [markdown]
# ## Going deeper

# %% [markdown]
# ### The convolution kernels
#
# **Launch configuration.** A program computes a `BLOCK_D x BLOCK_L` tile; the grid is
# `(batch, cdiv(dim, BLOCK_D), cdiv(L, BLOCK_L))`, thousands of programs at Mamba's size, so the GPU
# is full without a loop inside the program. The $K$ shifted loads of a tile overlap in all but
# $K-1$ columns and hit the L1 cache; the backward makes $K$ recomputations of $g$ at shifted
# positions, each $K$ loads of $x$ and one of $\partial\mathcal{L}/\partial u$, all from cache after
# the first. The defaults are a starting point, not tuned; under the interpreter the blocks are
# larger, because the interpreter runs each program as NumPy array operations.
#
# **Autograd plumbing.** As in chapter 05: the two launchers are custom operators with a fake
# (shape-only) implementation, so `torch.compile` traces them without running them, and a vmap rule
# that loops over the vmapped dimension; `CausalConv1dFn` is an `autograd.Function` in the style
# `torch.func` needs (`forward` without `ctx`, `setup_context`, `generate_vmap_rule`), called through
# `scan_lib.runtime.apply`. The backward runs its kernel under `no_grad`; when the caller asks for a
# graph of the gradients (`create_graph=True`, `torch.func.grad` of a gradient) the gradients pass
# through `_NoSecondDerivative`, an identity whose own backward raises, so a second derivative fails
# loudly instead of coming back as a silent zero. `final_states_out` is filled with `copy_` outside
# the operator (custom operators here do not mutate their inputs), which autograd and `torch.compile`
# both track.

# %%
#| export causal_conv1d
# Launch parameters: (block of channels, block of positions, warps). The interpreter runs a program as
# NumPy array operations, so larger blocks mean fewer programs and a faster CPU run.
GPU_CONFIG = {"block_d": 32, "block_l": 128, "num_warps": 4}
CPU_CONFIG = {"block_d": 32, "block_l": 512, "num_warps": 4}


def _launch_config(dim, length):
    config = dict(CPU_CONFIG if INTERPRET else GPU_CONFIG)
    config.update(block_d=min(config["block_d"], max(triton.next_power_of_2(dim), 2)),
                  block_l=min(config["block_l"], max(triton.next_power_of_2(length), 16)))
    return config


def _acc_dtype(x, weight):
    return torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32


def _strides(t, n=3):
    """A tensor's strides, or zeros for None (the kernel never reads it)."""
    return tuple(t.stride()) if t is not None else (0,) * n


@custom_op("causal_conv1d_fwd", __name__)
def causal_conv1d_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      initial_states: Optional[torch.Tensor], silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel, on x of any strides: out (x's layout and dtype) and the final states
    (batch, dim, width - 1), the last width - 1 columns of cat(initial_states or zeros, x)."""
    batch, dim, length = x.shape
    width = weight.shape[1]
    out = torch.empty_like(x)
    final = x.new_empty(batch, dim, width - 1)
    config = _launch_config(dim, length)
    grid = (batch, triton.cdiv(dim, config["block_d"]), triton.cdiv(length, config["block_l"]))
    causal_conv1d_fwd_kernel[grid](
        x, weight, bias, initial_states, out, final, dim, length,
        *x.stride(), *weight.stride(), *_strides(bias, 1), *_strides(initial_states), *out.stride(), *final.stride(),
        WIDTH=width, HAS_BIAS=bias is not None, HAS_H0=initial_states is not None, SILU=silu,
        ACC=accumulator_dtype(_acc_dtype(x, weight)), BLOCK_D=config["block_d"], BLOCK_L=config["block_l"],
        num_warps=config["num_warps"])
    return out, final


@causal_conv1d_fwd.register_fake
def _(x, weight, bias, initial_states, silu):
    return torch.empty_like(x), x.new_empty(x.shape[0], x.shape[1], weight.shape[1] - 1)


@custom_op("causal_conv1d_bwd", __name__)
def causal_conv1d_bwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      initial_states: Optional[torch.Tensor], dout: torch.Tensor, dfinal: Optional[torch.Tensor],
                      silu: bool) -> list[torch.Tensor]:
    """The backward kernel: dx (x's layout and dtype), dweight and dbias (float32, float64 for float64
    inputs; dbias empty without bias), dinitial_states (its dtype; empty without). dweight and dbias are
    sums of per-program partials, so the result does not depend on the order programs run in."""
    batch, dim, length = x.shape
    width = weight.shape[1]
    acc = _acc_dtype(x, weight)
    config = _launch_config(dim, length)
    n_blocks_l = triton.cdiv(length, config["block_l"])
    dx = torch.empty_like(x)
    dw_part = x.new_empty(batch * n_blocks_l, dim, width, dtype=acc)
    dbias_part = x.new_empty(batch * n_blocks_l, dim if bias is not None else 0, dtype=acc)
    dh0 = x.new_empty(batch, dim, width - 1) if initial_states is not None else x.new_empty(0)
    grid = (batch, triton.cdiv(dim, config["block_d"]), n_blocks_l)
    causal_conv1d_bwd_kernel[grid](
        x, weight, bias, initial_states, dout, dfinal, dx, dw_part, dbias_part, dh0, dim, length, n_blocks_l,
        *x.stride(), *weight.stride(), *_strides(bias, 1), *_strides(initial_states), *dout.stride(),
        *_strides(dfinal), *dx.stride(),
        WIDTH=width, HAS_BIAS=bias is not None, HAS_H0=initial_states is not None, HAS_DFINAL=dfinal is not None,
        SILU=silu, ACC=accumulator_dtype(acc), BLOCK_D=config["block_d"], BLOCK_L=config["block_l"],
        num_warps=config["num_warps"])
    return [dx, dw_part.sum(0), dbias_part.sum(0), dh0]


@causal_conv1d_bwd.register_fake
def _(x, weight, bias, initial_states, dout, dfinal, silu):
    acc = _acc_dtype(x, weight)
    return [torch.empty_like(x), weight.new_empty(weight.shape, dtype=acc),
            weight.new_empty(weight.shape[0] if bias is not None else 0, dtype=acc),
            x.new_empty(initial_states.shape if initial_states is not None else (0,))]


def _vmap_by_loop(op):
    """A vmap rule for op: call it once per element of the vmapped dimension and stack the results."""
    def rule(info, in_dims, *args):
        results = [op(*[a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)])
                   for i in range(info.batch_size)]
        kind = type(results[0])                                   # a tuple or a list of tensors
        return kind(torch.stack(parts) for parts in zip(*results)), kind([0] * len(results[0]))
    return rule


causal_conv1d_fwd.register_vmap(_vmap_by_loop(causal_conv1d_fwd))
causal_conv1d_bwd.register_vmap(_vmap_by_loop(causal_conv1d_bwd))

# %%
#| export causal_conv1d
_NO_SECOND_DERIVATIVE = ("causal_conv1d has no second derivative: its backward kernel's gradients cannot be "
                         "differentiated again (create_graph=True gives first derivatives only; hessians, "
                         "double backward and gradgradcheck through causal_conv1d are not supported)")


class _NoSecondDerivative(torch.autograd.Function):
    """The identity on causal_conv1d's gradients, attached to the tensors they depend on; differentiating
    through it (a second derivative) raises instead of returning a silent zero."""
    generate_vmap_rule = True

    @staticmethod
    def forward(n_anchors, *tensors):
        return tuple(t.clone() for t in tensors[n_anchors:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_NO_SECOND_DERIVATIVE)


class CausalConv1dFn(torch.autograd.Function):
    """(out, final_states) = causal_conv1d(x, weight, bias, initial_states, silu)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, initial_states, silu):
        return causal_conv1d_fwd(x, weight, bias, initial_states, silu)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, initial_states, silu = inputs
        ctx.save_for_backward(x, weight, bias, initial_states)
        ctx.silu = silu
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout, dfinal):
        x, weight, bias, initial_states = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(x)
        with torch.no_grad():  # the op's own outputs carry no graph (see _NoSecondDerivative)
            grads = causal_conv1d_bwd(x, weight, bias, initial_states, dout, dfinal, ctx.silu)
        inputs = (x, weight, bias, initial_states)
        grads = [None if t is None else g.to(t.dtype) for g, t in zip(grads, inputs)]
        if torch.is_grad_enabled():  # create_graph=True (or torch.func.grad): make a second derivative raise
            anchors = [t for t in (*inputs, dout, dfinal) if t is not None]
            given = [g for g in grads if g is not None]
            poisoned = iter(_NoSecondDerivative.apply(len(anchors), *anchors, *given))
            grads = [None if g is None else next(poisoned) for g in grads]
        return (*grads, None)


def _check_inputs(x, weight, bias, initial_states, final_states_out):
    named = dict(x=x, weight=weight, bias=bias, initial_states=initial_states, final_states_out=final_states_out)
    for name, value in named.items():
        if value is not None or name in ("x", "weight"):
            check_float_tensor(name, value)
    if x.dim() != 3:
        raise ValueError(f"x must have shape (batch, dim, L), got {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"x must not be empty, got shape {tuple(x.shape)}")
    batch, dim, length = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim or not 2 <= weight.shape[1] <= 4:
        raise ValueError(f"weight must have shape (dim={dim}, width) with width 2, 3 or 4, got {tuple(weight.shape)}")
    width = weight.shape[1]
    if (dim - 1) * abs(x.stride(1)) + (length - 1) * abs(x.stride(2)) >= 2**31:
        raise ValueError(f"x of shape {tuple(x.shape)}: one batch element spans 2^31 elements or more, past the "
                         "kernels' 32-bit offsets within a batch element; split the channels or the sequence")
    for name, value, shape in (("bias", bias, (dim,)), ("initial_states", initial_states, (batch, dim, width - 1)),
                               ("final_states_out", final_states_out, (batch, dim, width - 1))):
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
    for name, value, like in (("bias", bias, "weight"), ("initial_states", initial_states, "x"),
                              ("final_states_out", final_states_out, "x")):
        if value is not None and value.dtype != named[like].dtype:
            raise TypeError(f"{name} must have {like}'s dtype {named[like].dtype}, got {value.dtype}")
    check_same_device(**named)


def causal_conv1d(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                  final_states_out=None, activation=None):
    """Causal depthwise conv1d, a drop-in for the causal-conv1d package's causal_conv1d_fn.

    x: (batch, dim, L), any strides; weight: (dim, width), width 2, 3 or 4; bias: (dim,);
    initial_states: (batch, dim, width - 1), the inputs before position 0 (default zeros);
    activation: None, "silu" or "swish" (the same). seq_idx is not supported (NotImplementedError).

        out[b, d, t] = act(bias[d] + sum_k weight[d, k] * x[b, d, t - (width - 1) + k])

    Returns out (x's dtype and layout), and with return_final_states also final_states
    (batch, dim, width - 1): the last width - 1 columns of cat(initial_states or zeros, x), the
    initial_states of the next piece of the sequence; written into final_states_out when given (in
    place, then returned). Sums in float32 (float64 for float64 inputs); weight may have another float
    dtype than x (bias has weight's, initial_states and final_states_out x's). Gradients flow to x,
    weight, bias, initial_states, also through final_states. First derivatives only: differentiating
    the gradients again raises RuntimeError. Works under torch.compile, torch.func.grad and vmap.
    """
    if seq_idx is not None:
        raise NotImplementedError("causal_conv1d: seq_idx (several sequences packed in one row) is not supported")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if final_states_out is not None and not return_final_states:
        raise ValueError("final_states_out is only written with return_final_states=True")
    _check_inputs(x, weight, bias, initial_states, final_states_out)
    out, final_states = apply(CausalConv1dFn, x, weight, bias, initial_states, activation is not None)
    if not return_final_states:
        return out
    if final_states_out is not None:
        final_states = final_states_out.copy_(final_states)
    return out, final_states

# %% [markdown]
# **One token at a time.** Generation feeds one position per call: the last $K-1$ inputs (the
# `conv_state`, `(batch, dim, state_len)` with `state_len >= K-1`, as the package keeps it) are the
# initial states of a sequence of length 1. `causal_conv1d_update` does it in one small kernel, forward
# only: the output from the last $K-1$ columns of the state and the new input, then the state shifted
# left by one with the new input appended, in place (every program reads its rows of the old state,
# waits at a barrier, then writes them); under `torch.compile`, a functional custom op (new state
# out) and a `copy_` into the state. The check: $L$ steps give the outputs and the final state of
# one `causal_conv1d` call over the whole sequence.

# %%
#| export causal_conv1d
@triton.jit
def causal_conv1d_update_kernel(
    X, STATE, NEW_STATE, WEIGHT, BIAS, OUT,   # b x d, b x d x state_len (twice: NEW_STATE may be STATE), d x W, d, b x d
    dim, state_len,
    stride_xb, stride_xd, stride_sb, stride_sd, stride_sl, stride_nb, stride_nd, stride_nl,
    stride_wd, stride_wk, stride_bias, stride_ob, stride_od,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per (batch element, block of channels): out = act(bias + sum_k w[k] window[k]), where the
    window is the last WIDTH columns of cat(state, x); then the state shifted left by one, with x appended,
    goes to NEW_STATE (in place when NEW_STATE is STATE)."""
    b = tl.program_id(0).to(tl.int64)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)                # BLOCK_D
    d_ok = ds < dim
    S_ROW = STATE + b * stride_sb + ds * stride_sd
    x = tl.load(X + b * stride_xb + ds * stride_xd, d_ok, other=0.0)
    acc = tl.zeros((BLOCK_D,), ACC)
    if HAS_BIAS:
        acc += tl.load(BIAS + ds * stride_bias, d_ok, other=0.0).to(ACC)
    for k in tl.static_range(WIDTH - 1):   # columns state_len - (WIDTH - 1) + k of the old state
        col = tl.load(S_ROW + (state_len - (WIDTH - 1) + k) * stride_sl, d_ok, other=0.0).to(ACC)
        acc += tl.load(WEIGHT + ds * stride_wd + k * stride_wk, d_ok, other=0.0).to(ACC) * col
    acc += tl.load(WEIGHT + ds * stride_wd + (WIDTH - 1) * stride_wk, d_ok, other=0.0).to(ACC) * x.to(ACC)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(OUT + b * stride_ob + ds * stride_od, acc.to(OUT.dtype.element_ty), d_ok)
    c = tl.arange(0, BLOCK_S)[None, :]                                     # 1 x BLOCK_S
    shifted = tl.load(S_ROW[:, None] + (c + 1) * stride_sl, d_ok[:, None] & (c + 1 < state_len), other=0.0)
    shifted = tl.where(c == state_len - 1, x[:, None], shifted)             # BLOCK_D x BLOCK_S
    tl.debug_barrier()  # every read of the old state before any write
    tl.store(NEW_STATE + b * stride_nb + ds[:, None] * stride_nd + c * stride_nl, shifted,
             d_ok[:, None] & (c < state_len))


def _launch_update(x, conv_state, new_state, weight, bias, silu):
    out = torch.empty_like(x)
    state_len = conv_state.shape[2]
    block_d = min(64, max(triton.next_power_of_2(x.shape[1]), 2))
    causal_conv1d_update_kernel[(x.shape[0], triton.cdiv(x.shape[1], block_d))](
        x, conv_state, new_state, weight, bias, out, x.shape[1], state_len, *x.stride(), *conv_state.stride(),
        *new_state.stride(), *weight.stride(), *_strides(bias, 1), *out.stride(), WIDTH=weight.shape[1],
        HAS_BIAS=bias is not None, SILU=silu, ACC=accumulator_dtype(_acc_dtype(x, weight)), BLOCK_D=block_d,
        BLOCK_S=max(triton.next_power_of_2(state_len), 2))
    return out


@custom_op("causal_conv1d_update", __name__)
def causal_conv1d_update_op(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                            bias: Optional[torch.Tensor], silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The functional form, for torch.compile: out and the new state (a custom op mutates nothing)."""
    new_state = torch.empty_like(conv_state)
    return _launch_update(x, conv_state, new_state, weight, bias, silu), new_state


@causal_conv1d_update_op.register_fake
def _(x, conv_state, weight, bias, silu):
    return torch.empty_like(x), torch.empty_like(conv_state)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """One step of the causal conv for token-by-token generation, like the causal-conv1d package's
    causal_conv1d_update (forward only). x: (batch, dim), the new input; conv_state: (batch, dim,
    state_len) with state_len >= width - 1, the last inputs, updated in place (shifted left by one, x
    appended); weight: (dim, width); bias: (dim,); activation None, "silu" or "swish".
    Returns out (batch, dim) in x's dtype: the causal_conv1d output at the new position. No gradients;
    works under torch.compile (as a functional op and a copy into conv_state)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    named = dict(x=x, conv_state=conv_state, weight=weight, bias=bias)
    for name, value in named.items():
        if value is not None or name != "bias":
            check_float_tensor(name, value)
    if x.dim() != 2:
        raise ValueError(f"x must have shape (batch, dim), got {tuple(x.shape)}")
    batch, dim = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim or not 2 <= weight.shape[1] <= 4:
        raise ValueError(f"weight must have shape (dim={dim}, width) with width 2, 3 or 4, got {tuple(weight.shape)}")
    width = weight.shape[1]
    if conv_state.dim() != 3 or tuple(conv_state.shape[:2]) != (batch, dim) or conv_state.shape[2] < width - 1:
        raise ValueError(f"conv_state must have shape (batch={batch}, dim={dim}, state_len >= {width - 1}), "
                         f"got {tuple(conv_state.shape)}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"bias must have shape ({dim},), got {tuple(bias.shape)}")
    if conv_state.dtype != x.dtype:
        raise TypeError(f"conv_state must have x's dtype {x.dtype}, got {conv_state.dtype}")
    check_same_device(**named)
    silu = activation is not None
    if torch.compiler.is_compiling():  # traced: the functional op, then the in-place copy torch.compile tracks
        out, new_state = causal_conv1d_update_op(x, conv_state, weight, bias, silu)
        conv_state.copy_(new_state)
        return out
    return _launch_update(x, conv_state, conv_state, weight, bias, silu)   # eager: one launch, in place

# %%
from scan_lib.causal_conv1d import causal_conv1d_update

torch.manual_seed(0)
for width, state_len in ((4, 3), (3, 5)):
    step_x = torch.randn(2, 6, 7, dtype=torch.float64, device=DEVICE)
    step_w, step_b = torch.randn(6, width, dtype=torch.float64, device=DEVICE), torch.randn(6, dtype=torch.float64, device=DEVICE)
    step_h0 = torch.randn(2, 6, width - 1, dtype=torch.float64, device=DEVICE)
    whole, final = causal_conv1d_ref(step_x, step_w, step_b, step_h0, return_final_states=True, activation="silu")
    state = torch.cat([torch.zeros(2, 6, state_len - width + 1, dtype=torch.float64, device=DEVICE), step_h0], -1)
    steps = torch.stack([causal_conv1d_update(step_x[..., t], state, step_w, step_b, "silu")
                         for t in range(step_x.shape[-1])], -1)
    print(f"width {width}, state_len {state_len}: max err of {step_x.shape[-1]} steps {max_err(steps, whole):.1e}, "
          f"of the state {max_err(state[..., -(width - 1):], final):.1e}")
    assert max_err(steps, whole) < 1e-12 and max_err(state[..., -(width - 1):], final) < 1e-12
