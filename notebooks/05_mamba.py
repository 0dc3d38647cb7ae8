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
# # 05 · Mamba's selective scan (S6)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/scan-course/scans-the-hard-way/blob/main/notebooks/05_mamba.ipynb)
#
# Mamba's S6 layer is chapter 04's multi-state scan with two twists: the gates are *computed* from a
# step size $\Delta$ (the discretisation), and they differ for every channel, state and position (the
# *selection*). You will learn:
#
# 1. the discretisation $a_t = e^{\Delta_t A}$, $b_t = \Delta_t B_t u_t$ and its derivatives;
# 2. a float64 reference with `mamba_ssm`'s semantics, and the backward pass by hand;
# 3. a Triton kernel for one sequence, then a batched, chunked one that keeps the states in registers;
# 4. `selective_scan`, a drop-in for `mamba_ssm`'s `selective_scan_fn`, checked gradient by gradient
#    and against the official CUDA kernel.
#
# The package's `scan_lib.selective_scan` has the same interface over chapter 07's kernels (faster in
# training); this chapter checks and times its own.

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
#| default_exp selective_scan

# %%
import math

import matplotlib
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from scan_lib.ema import first_order_op
from scan_lib.runtime import save_figure

matplotlib.use("Agg")


def max_err(x, ref):
    """Largest absolute difference, in float64."""
    return (x.double() - ref.double()).abs().max().item()


def rel_err(x, ref):
    """Largest absolute difference relative to the largest magnitude of the reference.
    A reference that is exactly zero must be matched exactly: 0 if it is, inf otherwise."""
    scale, err = ref.double().abs().max().item(), max_err(x, ref)
    if scale == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / scale

# %% [markdown]
# ## 1. The model: one scan per channel and state
#
# For every batch element, channel $d$ (of `dim`) and state $n$ (of $N$), S6 runs chapter 02's
# first-order recurrence over the positions $t = 0 \dots L-1$ and reads the states out as in chapter 04:
#
# $$h_{t} = a_{t}\, h_{t-1} + b_{t}, \qquad y_{t} = \sum_n C_{t,n}\, h_{t,n}, \qquad
#   \bar y_t = y_t + D\, u_t, \qquad \text{out}_t = \bar y_t \cdot \operatorname{silu}(z_t)$$
#
# with $h_{-1} = 0$ (or a given initial state); $\bar y$ is the output before the gate $z$. The inputs,
# as `mamba_ssm` lays them out:
#
# | tensor | shape | meaning |
# | --- | --- | --- |
# | `u` | (batch, dim, L) | the input (chapter 04's $x$) |
# | `delta` | (batch, dim, L) | the step $\Delta$ (optionally `softplus(delta + delta_bias)`) |
# | `A` | (dim, N) | continuous-time decay rates, real and negative |
# | `B`, `C` | (batch, N, L), (batch, groups, N, L), or (dim, N) | input and output coefficients: per position (one per group of `dim // groups` channels), or time-invariant per channel |
# | `D`, `delta_bias` | (dim,) | skip weight, bias of $\Delta$ |
# | `z` | (batch, dim, L) | gate |
#
# The *selection*: $\Delta$, $B$ and $C$ depend on the input (a Mamba block computes them as
# projections of it), so the recurrence decides, position by position, how much to remember.
#
# ## 2. Discretisation
#
# Mamba samples the continuous-time system $h'(s) = A\,h(s) + B\,u(s)$ with step $\Delta$: over one
# step the state decays exactly by $e^{\Delta A}$, and the input enters by the Euler term $\Delta B u$
# (the exact zero-order hold differs by $O(\Delta^2)$: "Going deeper: the discretisation"):
#
# $$a_t = e^{\Delta_t A}, \qquad b_t = \Delta_t\, B_t\, u_t, \qquad h_t = a_t h_{t-1} + b_t .$$
#
# With $A < 0$ and $\Delta > 0$, $0 < a_t < 1$. The derivatives
#
# $$\frac{\partial a}{\partial \Delta} = A\,a, \quad \frac{\partial a}{\partial A} = \Delta\,a, \quad
#   \frac{\partial b}{\partial \Delta} = B u, \quad \frac{\partial b}{\partial B} = \Delta u, \quad
#   \frac{\partial b}{\partial u} = \Delta B$$
#
# give $\Delta$ gradient from **both** $a$ and $b$. A large step forgets quickly, a small one keeps the
# state ("Going deeper: the discretisation" plots $a$ against the step and checks the derivatives
# against autograd).
#
# ## 3. The reference
#
# The oracle for everything below: a PyTorch loop over positions in float64 with the semantics of
# `mamba_ssm`'s `selective_scan_ref` (every option above, `delta_softplus`, `return_last_state`), plus
# an `initial_state`. It returns float64,
# so that comparisons measure the kernel's error, not the reference's.

# %%
#| export
"""Mamba's selective scan (S6): float64 reference and the fused Triton kernels behind `selective_scan`."""
import torch
import torch.nn.functional as F


def _expand_coefficients(M, batch, dim, length):
    """B or C as (batch, dim, N, L): from (batch, N, L) or (batch, groups, N, L) (channel d uses group
    d // (dim // groups)), or from the time-invariant (dim, N)."""
    if M.dim() == 2:
        return M[None, :, :, None].expand(batch, dim, M.shape[1], length)
    if M.dim() == 3:
        M = M.unsqueeze(1)
    return M.repeat_interleave(dim // M.shape[1], dim=1)


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False, initial_state=None):
    """The float64 oracle: mamba_ssm's selective_scan_ref semantics, one position at a time.

    u, delta, z: (batch, dim, L); A: (dim, N); B, C: (batch, N, L), (batch, groups, N, L) or (dim, N);
    D, delta_bias: (dim,); initial_state: (batch, dim, N). Returns out (batch, dim, L) in float64,
    and with return_last_state also the state after the last position (batch, dim, N), float64.
    """
    u, delta, A = u.double(), delta.double(), A.double()
    batch, dim, length = u.shape
    if delta_bias is not None:
        delta = delta + delta_bias.double()[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    B = _expand_coefficients(B.double(), batch, dim, length)                 # batch x dim x N x L
    C = _expand_coefficients(C.double(), batch, dim, length)
    a = torch.exp(delta[:, :, :, None] * A[None, :, None, :])               # batch x dim x L x N
    b = (delta * u)[:, :, :, None] * B.transpose(2, 3)                      # batch x dim x L x N
    h = u.new_zeros(batch, dim, A.shape[1]) if initial_state is None else initial_state.double()
    ys = []
    for t in range(length):
        h = a[:, :, t] * h + b[:, :, t]
        ys.append((h * C[:, :, :, t]).sum(-1))                              # batch x dim
    out = torch.stack(ys, dim=2)
    if D is not None:
        out = out + D.double()[:, None] * u
    if z is not None:
        out = out * F.silu(z.double())
    return (out, h) if return_last_state else out

# %% [markdown]
# ## 4. The backward pass, by hand
#
# Write $dX$ for $\partial\mathcal L/\partial X$; the incoming gradients are $d\,\text{out}$ and, with
# `return_last_state`, $dh_{L-1}$ (`dlast`, arriving at the returned last state itself).
# Through the gate ($\sigma$ the sigmoid, $\operatorname{silu}(z) = z\sigma(z)$):
#
# $$d\bar y_t = d\text{out}_t\; z_t\sigma(z_t), \qquad
#   dz_t = d\text{out}_t\; \bar y_t\; \sigma(z_t)\,\big(1 + z_t(1 - \sigma(z_t))\big),$$
#
# and $dy_t = d\bar y_t$ since $\bar y = y + D u$. For one batch element, channel and state, $h_t$
# receives $C_t\, d\bar y_t$ directly plus what flows back from later states: chapter 03's adjoint
# $\delta$ (lower case: not the step $\Delta$),
#
# $$\delta_t = C_t\, d\bar y_t + a_{t+1}\, \delta_{t+1}, \qquad \delta_{L-1} = C_{L-1}\, d\bar y_{L-1} + dh_{L-1},$$
#
# a first-order scan right to left, gates shifted by one. Every gradient is then local,
# $da_t = \delta_t h_{t-1}$, $db_t = \delta_t$, $dh_{-1} = a_0 \delta_0$, chained through section 2's
# derivatives and summed over what a parameter is shared by (the batch and positions for $A$ and $D$,
# the channels of a group for $B$ and $C$; "Going deeper: the gradients, index by index" writes every
# index):
#
# $$d\Delta_t = \sum_n \delta_t\, (a_t h_{t-1} A + B_t u_t), \quad du_t = D\, d\bar y_t + \Delta_t \sum_n \delta_t B_t, \quad
#   dA = \sum_{\text{batch},\,t} \Delta_t\, \delta_t\, a_t h_{t-1},$$
# $$dD = \sum_{\text{batch},\,t} d\bar y_t\, u_t, \quad dB_t = \sum_{d \in g} \delta_t\, \Delta_t u_t, \quad dC_t = \sum_{d \in g} d\bar y_t\, h_t .$$
#
# The step is $\Delta = \operatorname{softplus}(\Delta_{\text{raw}} + \text{bias})$, and
# $\operatorname{softplus}(x) = \log(1 + e^x)$ has derivative $\sigma(x)$: so
# $d\Delta_{\text{raw}} = d\Delta\; \sigma(\Delta_{\text{raw}} + \text{bias})$ and
# $d\,\text{bias} = \sum_{\text{batch},\,t} d\Delta_{\text{raw}}$. The code takes $a_t h_{t-1}$ from the
# previous state, not as $h_t - b_t$ ("Going deeper: the previous state"). In PyTorch (B, C of shape
# (batch, N, L), softplus on), checked against autograd of the reference:

# %%
def selective_scan_backward_by_hand(u, delta, A, B, C, D, z, delta_bias, h0, dout, dlast):
    """The derived backward for B, C of shape (batch, N, L), softplus on, in float64: delta is the raw
    step, before bias and softplus."""
    pre = delta + delta_bias[:, None]
    delta = F.softplus(pre)                                            # batch x dim x L
    a = torch.exp(delta[..., None] * A[:, None, :])                    # batch x dim x L x N
    b = (delta * u)[..., None] * B.transpose(1, 2)[:, None]            # batch x dim x L x N
    hs, h = [], h0
    for t in range(u.shape[2]):
        h = a[:, :, t] * h + b[:, :, t]
        hs.append(h)
    hs = torch.stack(hs, dim=2)                                        # batch x dim x L x N
    ybar = (hs * C.transpose(1, 2)[:, None]).sum(-1) + D[:, None] * u  # batch x dim x L
    sig = torch.sigmoid(z)
    dybar = dout * z * sig
    dz = dout * ybar * sig * (1 + z * (1 - sig))
    c = C.transpose(1, 2)[:, None] * dybar[..., None]                  # batch x dim x L x N
    adj, flow = torch.zeros_like(hs), dlast
    for t in reversed(range(u.shape[2])):
        flow = c[:, :, t] + flow                                       # adj_t = C_t dybar_t + a_{t+1} adj_{t+1}
        adj[:, :, t] = flow
        flow = a[:, :, t] * flow                                       # what flows into h_{t-1}
    ### BEGIN SOLUTION
    ### HINT: with h_{t-1} (h0, then hs shifted by one), the adjoint adj and dybar, return a dict of the gradients by input name (u, delta: the raw step's, A, B, C, D, z, delta_bias, initial_state), each of its input's shape
    h_prev = torch.cat([h0[:, :, None], hs[:, :, :-1]], dim=2)        # h_{t-1}: shifted by one
    ah = a * h_prev                                                    # a_t h_{t-1}
    ddelta = (adj * ah * A[:, None, :]).sum(-1) + u * (adj * B.transpose(1, 2)[:, None]).sum(-1)
    ddelta_raw = ddelta * torch.sigmoid(pre)
    return dict(
        u=D[:, None] * dybar + delta * (adj * B.transpose(1, 2)[:, None]).sum(-1),
        delta=ddelta_raw,
        A=(adj * ah * delta[..., None]).sum((0, 2)),
        B=(adj * (delta * u)[..., None]).sum(1).transpose(1, 2),
        C=(hs * dybar[..., None]).sum(1).transpose(1, 2),
        D=(dybar * u).sum((0, 2)),
        z=dz,
        delta_bias=ddelta_raw.sum((0, 2)),
        initial_state=flow,
    )
    ### END SOLUTION


torch.manual_seed(1)
f64 = dict(dtype=torch.float64)
bw_batch, bw_dim, bw_N, bw_L = 2, 3, 4, 9
inputs = dict(u=torch.randn(bw_batch, bw_dim, bw_L, **f64), delta=torch.randn(bw_batch, bw_dim, bw_L, **f64),
              A=-torch.rand(bw_dim, bw_N, **f64) - 0.5, B=torch.randn(bw_batch, bw_N, bw_L, **f64),
              C=torch.randn(bw_batch, bw_N, bw_L, **f64), D=torch.randn(bw_dim, **f64),
              z=torch.randn(bw_batch, bw_dim, bw_L, **f64), delta_bias=torch.randn(bw_dim, **f64),
              initial_state=torch.randn(bw_batch, bw_dim, bw_N, **f64))
for value in inputs.values():
    value.requires_grad_(True)
out_ref, last_ref = selective_scan_ref(**inputs, delta_softplus=True, return_last_state=True)
dout, dlast = torch.randn_like(out_ref), torch.randn_like(last_ref)
auto = dict(zip(inputs, torch.autograd.grad((out_ref * dout).sum() + (last_ref * dlast).sum(), list(inputs.values()))))
with torch.no_grad():
    by_hand = selective_scan_backward_by_hand(**{k: v for k, v in inputs.items() if k != "initial_state"},
                                              h0=inputs["initial_state"], dout=dout, dlast=dlast)
for name in inputs:
    print(f"d{name:14s} max abs err vs autograd {max_err(by_hand[name], auto[name]):.1e}")
    assert torch.allclose(by_hand[name], auto[name], rtol=1e-10, atol=1e-12), name

# %% [markdown]
# ## 5. One sequence in one Triton program
#
# Chapter 04's kernels load their pairs $(a, b)$; here `discretize`, a `@triton.jit` helper every
# later kernel reuses, computes them on chip from $\Delta$, $A$, $B$ and $u$. The simplest kernel that
# is right: one program holds a sequence as an $N \times L$ tile (padded to powers of two, time along
# axis 1) and runs `tl.associative_scan` along $L$ with chapter 02's `first_order_op`, one scan per
# state. Padding loads $\Delta = 0$: $a = 1$, $b = 0$, the identity step.
#
# The backward gets its two shifted quantities by *loading* one position off, not by moving tiles
# between threads:
#
# * $h_{t-1}$: the same scan over the steps loaded at $t - 1$; position 0 loads nothing, so
#   $h_{-1} = 0$ exactly.
# * the adjoint: a right-to-left scan (`reverse=True`) of the pairs $(a_{t+1}, C_t\,d\bar y_t)$, with
#   $\Delta$ loaded at $t+1$ (0 past the end: $a = 1$).
#
# In the code `delta` is the step $\Delta$ and `adj` the adjoint $\delta$.

# %%
#| export
import triton
import triton.language as tl

from scan_lib.ema import accumulator_dtype, first_order_op


@triton.jit
def discretize(delta, A, B, u):
    ### BEGIN SOLUTION
    ### HINT: return the pair (a, b) of one step, the discretisation of section 2 (tl.exp; the arguments broadcast)
    """One S6 step from its continuous-time parameters: a = exp(delta*A), b = (delta*u)*B (broadcasting;
    delta*u first, as in the reference, so that a loop over the states computes it once)."""
    return tl.exp(delta * A), delta * u * B
    ### END SOLUTION

# %%
@triton.jit
def single_sequence_kernel(U, DELTA, A, B, C, DOUT,          # L, L, N, N x L, N x L, L
                           Y, DU, DDELTA, DA, DB, DC,        # L, L, L, N, N x L, N x L
                           length, n_states, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr):
    ts = tl.arange(0, BLOCK_L)                               # positions
    ns = tl.arange(0, BLOCK_N)                               # states
    t_ok, n_ok = ts < length, ns < n_states
    prev_ok, next_ok = t_ok & (ts > 0), ts + 1 < length
    tile = ns[:, None] * length + ts[None, :]                # N x L offsets into B, C, DB, DC
    tile_ok = n_ok[:, None] & t_ok[None, :]
    rate = tl.load(A + ns, n_ok, other=0.0)[:, None]         # N x 1
    u = tl.load(U + ts, t_ok, other=0.0)                     # L
    delta = tl.load(DELTA + ts, t_ok, other=0.0)             # L (0 on padding: the identity step)
    b_coef = tl.load(B + tile, tile_ok, other=0.0)           # N x L
    c_coef = tl.load(C + tile, tile_ok, other=0.0)
    # Forward: h_t = a_t h_{t-1} + b_t for every state at once, then y_t = sum_n C_t h_t.
    a, b = discretize(delta[None, :], rate, b_coef, u[None, :])              # N x L
    _, h = tl.associative_scan((a, b), axis=1, combine_fn=first_order_op)    # N x L
    tl.store(Y + ts, tl.sum(c_coef * h, axis=0), t_ok)
    dout = tl.load(DOUT + ts, t_ok, other=0.0)[None, :]      # 1 x L (no gate here: dybar = dout)
    tl.store(DC + tile, h * dout, tile_ok)                   # dC_t = dybar_t h_t
    # h_{t-1}: the scan of the steps loaded one position earlier (position -1 is the identity step).
    u_prev = tl.load(U + ts - 1, prev_ok, other=0.0)[None, :]
    delta_prev = tl.load(DELTA + ts - 1, prev_ok, other=0.0)[None, :]
    b_coef_prev = tl.load(B + tile - 1, n_ok[:, None] & prev_ok[None, :], other=0.0)
    a_prev, b_prev = discretize(delta_prev, rate, b_coef_prev, u_prev)
    _, h_prev = tl.associative_scan((a_prev, b_prev), axis=1, combine_fn=first_order_op)
    # The adjoint, right to left: adj_t = C_t dybar_t + a_{t+1} adj_{t+1}.
    delta_next = tl.load(DELTA + ts + 1, next_ok, other=0.0)[None, :]
    _, adj = tl.associative_scan((tl.exp(delta_next * rate), c_coef * dout), axis=1,
                                 combine_fn=first_order_op, reverse=True)
    adj_ah = adj * a * h_prev                                # adj_t a_t h_{t-1}
    adj_b = tl.sum(adj * b_coef, axis=0)                     # L: sum_n adj_t B_t
    tl.store(DDELTA + ts, tl.sum(adj_ah * rate, axis=0) + u * adj_b, t_ok)
    tl.store(DU + ts, delta * adj_b, t_ok)
    tl.store(DA + ns, tl.sum(adj_ah * delta[None, :], axis=1), n_ok)
    tl.store(DB + tile, adj * (delta * u)[None, :], tile_ok)


def single_sequence(u, delta, A, B, C, dout):
    """Run the one-program kernel: returns y, du, ddelta, dA, dB, dC for one channel of one sequence."""
    (length,), n_states = u.shape, A.shape[0]
    y, du, ddelta = (torch.empty_like(u) for _ in range(3))
    dA, dB, dC = torch.empty_like(A), torch.empty_like(B), torch.empty_like(C)
    single_sequence_kernel[(1,)](u, delta, A, B, C, dout, y, du, ddelta, dA, dB, dC, length, n_states,
                                 BLOCK_L=triton.next_power_of_2(length), BLOCK_N=triton.next_power_of_2(n_states))
    return y, du, ddelta, dA, dB, dC

# %% [markdown]
# Checked against autograd of the reference (batch 1, one channel) at awkward lengths, with $N = 3$
# padding the state axis too. Errors are relative to each reference's largest magnitude; at $L = 1$
# the reference $dA$ is exactly zero ($h_{-1} = 0$), and `rel_err` then demands an exact zero.
# The tolerance is chapter 04's `tolerance`: the output's rounding plus float32 rounding compounded
# over the length, $32\sqrt{L}$ units ("Going deeper: the tolerances").

# %%
from scan_lib.multistate import tolerance   # chapter 04's error model


print(f"{'L':>5s} {'y':>9s} {'du':>9s} {'ddelta':>9s} {'dA':>9s} {'dB':>9s} {'dC':>9s} {'tol':>9s}")
for L in [1, 7, 129, 1000]:
    torch.manual_seed(L)
    N = 3
    u = torch.randn(L, device=DEVICE)
    delta = torch.rand(L, device=DEVICE) * 0.5 + 0.05
    A = -torch.rand(N, device=DEVICE) * 2 - 0.1
    B, C = torch.randn(N, L, device=DEVICE), torch.randn(N, L, device=DEVICE)
    dout = torch.randn(L, device=DEVICE)
    ours = single_sequence(u, delta, A, B, C, dout)
    leaves = [x.double().requires_grad_(True) for x in (u, delta, A, B, C)]
    y_ref = selective_scan_ref(leaves[0][None, None], leaves[1][None, None], leaves[2][None],
                               leaves[3][None], leaves[4][None])[0, 0]
    refs = [y_ref, *torch.autograd.grad((y_ref * dout.double()).sum(), leaves)]
    errs = [rel_err(x, r) for x, r in zip(ours, refs)]
    print(f"{L:5d} " + " ".join(f"{e:9.1e}" for e in errs) + f" {tolerance(torch.float32, L):9.1e}")
    assert max(errs) < tolerance(torch.float32, L), errs
    if L == 1:
        assert torch.equal(ours[3], torch.zeros_like(ours[3])), ours[3]

# %% [markdown]
# ## 6. The batched, chunked kernel
#
# A real layer has (batch 8, dim 1024, L 2048, N 16): 1024 MiB of states in float32 ("Going deeper:
# memory in training" prints it), which must never be written to memory; and one program cannot hold
# a sequence of any length. The batched kernel follows `mamba_ssm`'s CUDA kernel:
#
# * **One program per (batch element, block of `BLOCK_D` channels)**, walking the sequence in chunks
#   of `CHUNK` positions; `u` and $\Delta$ (bias and softplus applied on the fly) load as
#   `BLOCK_D x CHUNK` tiles.
# * **Time across the threads, the $N$ states a loop**: per state, load row $n$ of `B` and `C`,
#   discretise, scan along time, add $C_n h$ into $y$. A position's terms stay in its thread, so
#   $y = \sum_n C_n h_n$ needs no sum across threads ("Going deeper: launch parameters and the layout",
#   which also explains the kernel's helpers).
# * **The carry**: the state entering the chunk, a `BLOCK_D x N` tile in registers, folded into the
#   chunk's first step.
# * **What training keeps**: when an input needs a gradient, the forward writes the carry at the start
#   of every chunk (the *boundary states*, $1/\texttt{CHUNK}$ of all the states) and, with `z`,
#   $\bar y$; the backward recomputes the states chunk by chunk. Inference writes neither.
#
# **The chunking identity.** Unrolled from the state $h_{s-1}$ entering a chunk that starts at $s$:
#
# $$h_t = \Big(\prod_{r=s}^{t} a_r\Big)\, h_{s-1} + \sum_{q=s}^{t} \Big(\prod_{r=q+1}^{t} a_r\Big) b_q, \qquad s \le t < s + \texttt{CHUNK}.$$
#
# The second term is the chunk scanned from zero; the first needs the product of the gates, which the
# scan computes too. Equivalently (chapter 02's `scan_chunk`), replace the chunk's first pair
# $(a_s, b_s)$ by $(a_s,\ a_s h_{s-1} + b_s)$: the scan then yields the exact states ("Going deeper:
# the chunks in one picture" checks both forms).

# %%
#| export
from scan_lib.runtime import INTERPRET

# Launch parameters: BLOCK_D channels per program, CHUNK positions per loop step, num_warps.
# GPU defaults: the fastest of a sweep on an H200 (2026-11-29; benchmarks/tune_selective_scan.py).
# Under the CPU interpreter: small blocks, so that small tests still cross several chunks and blocks,
# and a backward chunk smaller than the forward's (training runs the forward with the backward's chunk).
GPU_FWD_CONFIG = dict(block_d=1, chunk=512, num_warps=2)
GPU_BWD_CONFIG = dict(block_d=1, chunk=512, num_warps=4)
CPU_FWD_CONFIG = dict(block_d=2, chunk=16, num_warps=1)
CPU_BWD_CONFIG = dict(block_d=2, chunk=8, num_warps=1)


@triton.jit
def _load_delta(DELTA, BIAS, offs, mask, ds, d_ok, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                ACC: tl.constexpr):
    """Delta tile (BLOCK_D x CHUNK) after bias and softplus, 0 where masked (the identity step).
    Also returns the raw pre-activation, whose sigmoid the backward needs."""
    pre = tl.load(DELTA + offs, mask, other=0.0).to(ACC)
    if HAS_BIAS:
        pre = pre + tl.load(BIAS + ds, d_ok, other=0.0).to(ACC)[:, None]
    delta = pre
    if SOFTPLUS:
        # softplus(x) = max(x, 0) + log1p(e^-|x|); log1p(e) = log(w) * e / (w - 1) with w = 1 + e.
        e = tl.exp(-tl.abs(pre))
        w = 1.0 + e
        delta = tl.maximum(pre, 0.0) + tl.where(w == 1.0, e, tl.log(w) * e / (w - 1.0))
    return tl.where(mask, delta, 0.0), pre


@triton.jit
def _column(tile, n, cols):
    """tile[:, n] of a BLOCK_D x BLOCK_N tile (cols = its column indices): a masked sum."""
    return tl.sum(tl.where(cols[None, :] == n, tile, 0.0), axis=1)


@triton.jit
def _load_coef(ROW, M, n, t, t_ok, ds, d_ok, n_states, length, PER_STEP: tl.constexpr, ACC: tl.constexpr):
    """State n's coefficient: ROW[n, t] of the channel's group (1 x CHUNK), or M[d, n] (BLOCK_D x 1)."""
    if PER_STEP:
        coef = tl.load(ROW + n * length + t, t_ok, other=0.0).to(ACC)[None, :]
    else:
        coef = tl.load(M + ds * n_states + n, d_ok, other=0.0).to(ACC)[:, None]
    return coef


@triton.jit
def selective_scan_fwd_kernel(
    U, DELTA, A, B, C, D, Z, BIAS, H0,       # b x d x L, b x d x L, d x N, b x gB x N x L or d x N (C alike), d, b x d x L, d, b x d x N
    OUT, YBAR, STATES, LAST,                  # b x d x L, b x d x L (before the gate), b x d x N x n_chunks, b x d x N
    dim, length, n_states, n_chunks, groups_b, groups_c,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr,
    B_PER_STEP: tl.constexpr, C_PER_STEP: tl.constexpr,
    SOFTPLUS: tl.constexpr, ACC: tl.constexpr, SAVE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    pid_b, pid_d = tl.program_id(0), tl.program_id(1)
    ds = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)                     # BLOCK_D
    ns = tl.arange(0, BLOCK_N)
    ts = tl.arange(0, CHUNK)
    d_ok, n_ok = ds < dim, ns < n_states
    dn_ok = d_ok[:, None] & n_ok[None, :]
    # All channels of the block share one group (the launcher makes sure), so one B and C row each.
    B_ROW = B + (pid_b * groups_b + pid_d * BLOCK_D // (dim // groups_b)) * n_states * length
    C_ROW = C + (pid_b * groups_c + pid_d * BLOCK_D // (dim // groups_c)) * n_states * length
    dl_row = (pid_b * dim + ds) * length                             # BLOCK_D
    state_offs = (pid_b * dim + ds[:, None]) * n_states + ns[None, :]  # BLOCK_D x N
    if HAS_H0:
        carry = tl.load(H0 + state_offs, dn_ok, other=0.0).to(ACC)  # BLOCK_D x N
    else:
        carry = tl.zeros((BLOCK_D, BLOCK_N), dtype=ACC)
    if HAS_D:
        skip = tl.load(D + ds, d_ok, other=0.0).to(ACC)[:, None]
    first, last = ts[None, :] == 0, ts[None, :] == CHUNK - 1
    for k in range(0, n_chunks):
        if SAVE:  # the state entering chunk k, for the backward
            tl.store(STATES + state_offs * n_chunks + k, carry, dn_ok)
        t = k * CHUNK + ts
        t_ok = t < length
        offs = dl_row[:, None] + t[None, :]                          # BLOCK_D x CHUNK
        mask = d_ok[:, None] & t_ok[None, :]
        u = tl.load(U + offs, mask, other=0.0).to(ACC)
        delta, _ = _load_delta(DELTA, BIAS, offs, mask, ds, d_ok, HAS_BIAS, SOFTPLUS, ACC)
        ybar = tl.zeros((BLOCK_D, CHUNK), dtype=ACC)
        for n in range(0, n_states):
            rate = tl.load(A + ds * n_states + n, d_ok, other=0.0).to(ACC)[:, None]   # BLOCK_D x 1
            b_coef = _load_coef(B_ROW, B, n, t, t_ok, ds, d_ok, n_states, length, B_PER_STEP, ACC)
            c_coef = _load_coef(C_ROW, C, n, t, t_ok, ds, d_ok, n_states, length, C_PER_STEP, ACC)
            a, b = discretize(delta, rate, b_coef, u)                                 # BLOCK_D x CHUNK
            ### BEGIN SOLUTION
            ### HINT: fold column n of `carry` into the chunk's first step, scan along axis 1 with first_order_op, add C_n h to ybar, store the state at the chunk's last position in column n of `carry`
            b += tl.where(first, a * _column(carry, n, ns)[:, None], 0.0)            # start from the carry
            _, h = tl.associative_scan((a, b), axis=1, combine_fn=first_order_op)
            ybar += c_coef * h
            carry = tl.where(ns[None, :] == n, tl.sum(tl.where(last, h, 0.0), axis=1)[:, None], carry)
            ### END SOLUTION
        if HAS_D:
            ybar += skip * u
        out = ybar
        if HAS_Z:
            if SAVE:
                tl.store(YBAR + offs, ybar, mask)
            zv = tl.load(Z + offs, mask, other=0.0).to(ACC)
            out = ybar * zv * tl.sigmoid(zv)
        tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask)
    tl.store(LAST + state_offs, carry, dn_ok)

# %% [markdown]
# The backward walks the chunks right to left with the adjoint carry, a `BLOCK_D x N` tile
# ($dh_{L-1}$ at the start). Per chunk it loads the inputs once ($u$ and $\Delta$ also one position
# earlier, $\Delta$ one later), writes $dz$, forms $d\bar y$, then, state by state:
#
# 1. $h_{t-1}$ by section 5's scan, the chunk's first pair being $(0, h_{s-1})$, the stored boundary
#    state; then $h_t = a_t h_{t-1} + b_t$;
# 2. the adjoint by the reverse scan, the adjoint carry added at the chunk's last position;
# 3. section 4's gradients, and the next adjoint carry $a_s \delta_s$.
#
# Its code: "Going deeper: the chunked backward kernel". This chapter's `selective_scan` (exported to
# the module `scan_lib/selective_scan.py`, `chapter_scan` in "Going deeper") wraps both kernels ("Going
# deeper: the launchers and autograd").
#
# ## 7. Checks
#
# `chapter_scan` is checked against autograd through the float64 reference (output, last state, all
# nine gradients) at lengths 1 to 1000, in every option and half precision ("Going deeper: checking
# `selective_scan`"), and against `mamba_ssm`'s kernel where installed ("Going deeper: against the
# official kernel").
#
# ## 8. Speed (GPU only)
#
# "Going deeper: the benchmark" times `chapter_scan` against `mamba_ssm` at Mamba's usual layer size,
# next to the memory floor. In the recorded run (an NVIDIA H100 80GB HBM3) ours is 1.16x faster than
# `mamba_ssm` in the float32 forward only, and slower in the other three rows: 1.34x in the float32
# forward+backward, 1.50x and 1.60x in the bfloat16 forward and forward+backward. Ours runs at 5.7x to
# 20.1x the memory floor. Closing the gaps is chapter 07's work.

# %% [markdown]
# ## What we built
#
# A drop-in `selective_scan` with every gradient checked; its backward recomputes the states from one
# boundary state per chunk instead of storing all `(batch, dim, L, N)` of them.

# %% [markdown]
# ## Going deeper: the chunked backward kernel
#
# The code of section 6's backward; the comments `(1)`, `(2)`, `(3)` mark its three steps, and
# `_gate_dybar`, `_gate_dz` are section 4's gradients through the gate. `prev_ok` and `next_ok` mark
# the positions whose neighbour at $t-1$ or $t+1$ lies in the same chunk (and in the sequence): only
# those are loaded, and at the chunk's edges the carries come in instead ("Going deeper: the chunks in
# one picture").
#
# Sums over the sequence (`dA`, `dD`, `d delta_bias`, and time-invariant $dB$, $dC$) accumulate in
# registers. Per-position `dB`, `dC` are sums over the channels of a group, which live in different
# programs: they are added with `tl.atomic_add` into float32 buffers, as `mamba_ssm` does. Padding
# positions add nothing, but their adjoint is the carry, not 0: the kernel zeroes $d\Delta$ there.

# %%
#| export
@triton.jit
def _gate_dybar(dout, zv, HAS_Z: tl.constexpr):
    """Gradient reaching ybar through out = ybar * silu(z)."""
    dybar = dout
    if HAS_Z:
        dybar = dout * zv * tl.sigmoid(zv)
    return dybar


@triton.jit
def _gate_dz(dout, ybar, zv):
    """Gradient of z in out = ybar * silu(z): dout * ybar * sigmoid(z) * (1 + z * (1 - sigmoid(z)))."""
    sig = tl.sigmoid(zv)
    return dout * ybar * sig * (1.0 + zv * (1.0 - sig))


@triton.jit
def selective_scan_bwd_kernel(
    U, DELTA, A, B, C, D, Z, BIAS, STATES, YBAR, DOUT, DLAST,  # as in the forward; DOUT b x d x L, DLAST b x d x N
    DU, DDELTA, DZ, DB, DC,          # b x d x L (x3); dB, dC: b x gB x N x L fp32 (atomics), or b x d x N if time-invariant
    DA_PART, DD_PART, DBIAS_PART, DH0,                         # b x d x N, b x d, b x d, b x d x N
    dim, length, n_states, n_chunks, groups_b, groups_c,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DLAST: tl.constexpr,
    B_PER_STEP: tl.constexpr, C_PER_STEP: tl.constexpr, SOFTPLUS: tl.constexpr, ACC: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    pid_b, pid_d = tl.program_id(0), tl.program_id(1)
    ds = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    ns = tl.arange(0, BLOCK_N)
    ts = tl.arange(0, CHUNK)
    d_ok, n_ok = ds < dim, ns < n_states
    dn_ok = d_ok[:, None] & n_ok[None, :]
    b_off = (pid_b * groups_b + pid_d * BLOCK_D // (dim // groups_b)) * n_states * length
    c_off = (pid_b * groups_c + pid_d * BLOCK_D // (dim // groups_c)) * n_states * length
    dl_row = (pid_b * dim + ds) * length
    state_offs = (pid_b * dim + ds[:, None]) * n_states + ns[None, :]
    if HAS_DLAST:
        adj_carry = tl.load(DLAST + state_offs, dn_ok, other=0.0).to(ACC)   # dL/dh at the end of the chunk
    else:
        adj_carry = tl.zeros((BLOCK_D, BLOCK_N), dtype=ACC)
    skip = tl.zeros((BLOCK_D,), dtype=ACC)
    if HAS_D:
        skip = tl.load(D + ds, d_ok, other=0.0).to(ACC)
    dA_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=ACC)
    dB_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=ACC)                 # time-invariant B only
    dC_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=ACC)                 # time-invariant C only
    dD_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    first, last = ts[None, :] == 0, ts[None, :] == CHUNK - 1
    for i in range(0, n_chunks):
        k = n_chunks - 1 - i                                         # chunks from right to left
        t = k * CHUNK + ts
        t_ok = t < length
        prev_ok = (ts > 0) & t_ok                                    # t-1 is in this chunk (and t < L)
        next_ok = (ts < CHUNK - 1) & (t + 1 < length)                # position t+1 is in this chunk
        offs = dl_row[:, None] + t[None, :]                          # BLOCK_D x CHUNK
        mask = d_ok[:, None] & t_ok[None, :]
        prev_mask, next_mask = d_ok[:, None] & prev_ok[None, :], d_ok[:, None] & next_ok[None, :]
        u = tl.load(U + offs, mask, other=0.0).to(ACC)
        delta, pre = _load_delta(DELTA, BIAS, offs, mask, ds, d_ok, HAS_BIAS, SOFTPLUS, ACC)
        u_prev = tl.load(U + offs - 1, prev_mask, other=0.0).to(ACC)
        delta_prev, _ = _load_delta(DELTA, BIAS, offs - 1, prev_mask, ds, d_ok, HAS_BIAS, SOFTPLUS, ACC)
        delta_next, _ = _load_delta(DELTA, BIAS, offs + 1, next_mask, ds, d_ok, HAS_BIAS, SOFTPLUS, ACC)
        dout = tl.load(DOUT + offs, mask, other=0.0).to(ACC)
        zv = u
        if HAS_Z:
            zv = tl.load(Z + offs, mask, other=0.0).to(ACC)
            tl.store(DZ + offs, _gate_dz(dout, tl.load(YBAR + offs, mask, other=0.0), zv).to(DZ.dtype.element_ty), mask)
        dybar = _gate_dybar(dout, zv, HAS_Z)
        dD_acc += tl.sum(dybar * u, axis=1)
        adj_b_sum = tl.zeros((BLOCK_D, CHUNK), dtype=ACC)           # sum_n adj_t B_t
        adj_ah_rate_sum = tl.zeros((BLOCK_D, CHUNK), dtype=ACC)     # sum_n adj_t a_t h_{t-1} A
        for n in range(0, n_states):
            rate = tl.load(A + ds * n_states + n, d_ok, other=0.0).to(ACC)[:, None]
            b_coef = _load_coef(B + b_off, B, n, t, t_ok, ds, d_ok, n_states, length, B_PER_STEP, ACC)
            b_coef_prev = _load_coef(B + b_off, B, n, t - 1, prev_ok, ds, d_ok, n_states, length, B_PER_STEP, ACC)
            c_coef = _load_coef(C + c_off, C, n, t, t_ok, ds, d_ok, n_states, length, C_PER_STEP, ACC)
            h_in = tl.load(STATES + ((pid_b * dim + ds) * n_states + n) * n_chunks + k, d_ok, other=0.0)
            # (1) h_{t-1}: the steps of positions t-1, the first one setting the boundary state.
            a, b = discretize(delta, rate, b_coef, u)
            a_prev, b_prev = discretize(delta_prev, rate, b_coef_prev, u_prev)
            _, h_prev = tl.associative_scan((tl.where(first, 0.0, a_prev), tl.where(first, h_in[:, None], b_prev)),
                                            axis=1, combine_fn=first_order_op)
            h = a * h_prev + b
            # (2) the adjoint, right to left; the adjoint carry enters at the chunk's last position.
            c = c_coef * dybar + tl.where(last, _column(adj_carry, n, ns)[:, None], 0.0)
            _, adj = tl.associative_scan((tl.exp(delta_next * rate), c), axis=1, combine_fn=first_order_op,
                                         reverse=True)
            # (3) the gradients.
            adj_b_sum += adj * b_coef
            adj_ah = adj * a * h_prev
            adj_ah_rate_sum += adj_ah * rate
            at_n = ns[None, :] == n
            dA_acc += tl.where(at_n, tl.sum(adj_ah * delta, axis=1)[:, None], 0.0)
            if B_PER_STEP:
                tl.atomic_add(DB + b_off + n * length + t, tl.sum(adj * delta * u, axis=0), t_ok, sem="relaxed")
            else:
                dB_acc += tl.where(at_n, tl.sum(adj * delta * u, axis=1)[:, None], 0.0)
            if C_PER_STEP:
                tl.atomic_add(DC + c_off + n * length + t, tl.sum(h * dybar, axis=0), t_ok, sem="relaxed")
            else:
                dC_acc += tl.where(at_n, tl.sum(tl.where(mask, h * dybar, 0.0), axis=1)[:, None], 0.0)
            adj_carry = tl.where(at_n, tl.sum(tl.where(first, a * adj, 0.0), axis=1)[:, None], adj_carry)
        ddelta = adj_ah_rate_sum + u * adj_b_sum
        if SOFTPLUS:
            ddelta = ddelta * tl.sigmoid(pre)
        ddelta = tl.where(mask, ddelta, 0.0)                         # padding: the adjoint is the carry there, not 0
        tl.store(DDELTA + offs, ddelta.to(DDELTA.dtype.element_ty), mask)
        tl.store(DU + offs, (skip[:, None] * dybar + delta * adj_b_sum).to(DU.dtype.element_ty), mask)
        dbias_acc += tl.sum(ddelta, axis=1)
    tl.store(DA_PART + state_offs, dA_acc, dn_ok)
    if not B_PER_STEP:
        tl.store(DB + state_offs, dB_acc, dn_ok)
    if not C_PER_STEP:
        tl.store(DC + state_offs, dC_acc, dn_ok)
    tl.store(DH0 + state_offs, adj_carry, dn_ok)
    tl.store(DD_PART + pid_b * dim + ds, dD_acc, d_ok)
    tl.store(DBIAS_PART + pid_b * dim + ds, dbias_acc, d_ok)

# %% [markdown]
# ## Going deeper: checking `selective_scan`
#
# The code behind section 7: `chapter_scan` against the float64 reference in every option; the later
# sections' cells use its helpers too. `make_inputs` draws one problem; `check_selective_scan` runs
# `chapter_scan` and the reference on the same (rounded) inputs and compares the output, the last
# state, all nine gradients and the inference path (no gradient: nothing kept), within chapter 04's
# `tolerance` for the input's dtype and length: for half-precision inputs its first part is the final
# rounding to the input's dtype ("Going deeper: the tolerances"). The cases cover lengths from 1 to 1000, groups, time-invariant `B`
# and `C`, each optional input left out in turn, and `delta_softplus=False` twice.

# %%
def make_inputs(batch, dim, N, L, groups=None, D=True, z=True, bias=True, h0=True, dtype=torch.float32,
                seed=0, time_invariant=""):
    """Random S6 inputs: None for the options left out; B, C 4-D when groups is given, (dim, N) for the
    letters in time_invariant."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale + shift).to(device=DEVICE, dtype=dt)

    wide = torch.float64 if dtype == torch.float64 else torch.float32
    bc_shape = (batch, N, L) if groups is None else (batch, groups, N, L)
    inputs = dict(u=rand(batch, dim, L), delta=rand(batch, dim, L, scale=0.5, shift=-1.0),
                  A=-torch.rand(dim, N, generator=g).add(0.2).to(DEVICE, wide), B=rand(*bc_shape), C=rand(*bc_shape),
                  D=rand(dim, dt=wide) if D else None, z=rand(batch, dim, L) if z else None,
                  delta_bias=rand(dim, scale=0.3, dt=wide) if bias else None,
                  initial_state=rand(batch, dim, N, dt=wide) if h0 else None)
    for name in time_invariant:
        inputs[name] = rand(dim, N)
    return inputs


def run_with_grads(fn, inputs, dout, dlast, softplus, cast=None):
    """out, last and the gradient of <out, dout> + <last, dlast> for every given input."""
    leaves = {k: (v if cast is None else v.to(cast)).detach().requires_grad_(True)
              for k, v in inputs.items() if v is not None}
    full = {k: leaves.get(k) for k in inputs}
    out, last = fn(**full, delta_softplus=softplus, return_last_state=True)
    loss = (out.double() * dout).sum() + (last.double() * dlast).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return out, last, dict(zip(leaves, grads))


chapter_scan = sys.modules["scan_lib.selective_scan"].selective_scan   # this chapter's selective_scan, exported


def check_selective_scan(inputs, softplus=True, verbose=True):
    """Compare selective_scan with the float64 reference: output, last state and every gradient (printed),
    and, asserted silently, the inference path (no gradient: the forward's own chunk, nothing kept)."""
    torch.manual_seed(1)
    u = inputs["u"]
    tol = tolerance(u.dtype, u.shape[2])
    dout = torch.randn(u.shape, dtype=torch.float64, device=DEVICE).to(u.dtype).double()
    dlast = torch.randn(u.shape[0], u.shape[1], inputs["A"].shape[1], dtype=torch.float64, device=DEVICE)
    out, last, grads = run_with_grads(chapter_scan, inputs, dout, dlast, softplus)
    out_r, last_r, grads_r = run_with_grads(selective_scan_ref, inputs, dout, dlast, softplus, cast=torch.float64)
    assert out.dtype == u.dtype and last.dtype == (torch.float64 if u.dtype == torch.float64 else torch.float32)
    errors = {"out": rel_err(out, out_r), "last": rel_err(last, last_r)}
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype and grad.shape == inputs[name].shape, name
        errors["d" + name] = rel_err(grad, grads_r[name])
    if verbose:
        print(f"L={u.shape[2]:5d} tol {tol:.2e}: " + "  ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    assert all(e < tol for e in errors.values()), errors
    with torch.no_grad():
        out_ng, last_ng = chapter_scan(**inputs, delta_softplus=softplus, return_last_state=True)
    assert rel_err(out_ng, out_r) < tol and rel_err(last_ng, last_r) < tol, "inference path"
    return errors


cases = [  # (batch, dim, N, L, options)
    (2, 4, 3, 1, dict(groups=None)),
    (2, 4, 3, 1, dict(groups=None, h0=False)),  # dA is exactly 0 here: rel_err demands an exact 0
    (2, 6, 4, 7, dict(groups=2, bias=False)),
    (1, 4, 5, 129, dict(groups=None, z=False, h0=False)),
    (1, 8, 3, 100, dict(groups=4, D=False)),
    (2, 4, 3, 30, dict(time_invariant="BC")),   # B and C of shape (dim, N), as mamba_ssm allows
    (1, 4, 3, 20, dict(groups=2, time_invariant="C")),
    (1, 2, 2, 1000, dict(groups=None)),
]
for batch, dim, N, L, options in cases:
    check_selective_scan(make_inputs(batch, dim, N, L, **options, seed=L))
check_selective_scan(make_inputs(1, 4, 3, 33, z=False, D=False, bias=False, h0=False), softplus=False)
# softplus off with delta_bias: delta + delta_bias is the step itself, drawn positive as a caller passes it
no_softplus = make_inputs(2, 4, 3, 21, groups=2, seed=21)
no_softplus.update(delta=no_softplus["delta"].abs(), delta_bias=no_softplus["delta_bias"].abs())
check_selective_scan(no_softplus, softplus=False)
print("selective_scan matches the float64 reference: outputs and all gradients")

# %% [markdown]
# Half precision (`u`, `delta`, `B`, `C`, `z` in bfloat16 or float16; state and sums in float32): the
# reference runs on the same rounded inputs, so what is left is the final rounding of the output and
# each gradient to its input's dtype, within the tolerance printed on each line.

# %%
for dtype in (torch.bfloat16, torch.float16):
    print(dtype, end=" ")
    check_selective_scan(make_inputs(2, 4, 4, 61, groups=2, dtype=dtype, seed=5))

# %% [markdown]
# ## Going deeper: the discretisation
#
# Section 2's derivatives checked against autograd in float64, a plot of how much of the state
# survives one step, and the order of the Euler term. First the derivatives and the plot:

# %%
def discretize_torch(delta, A, B, u):
    """a = exp(delta*A), b = (delta*u)*B (elementwise, broadcasting)."""
    return torch.exp(delta * A), delta * u * B


torch.manual_seed(0)
delta_s, A_s, B_s, u_s = (torch.randn(5, dtype=torch.float64, requires_grad=True) for _ in range(4))
a_s, b_s = discretize_torch(delta_s, A_s, B_s, u_s)
ga, gb = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
auto = torch.autograd.grad((a_s * ga + b_s * gb).sum(), (delta_s, A_s, B_s, u_s))
by_hand = (ga * A_s * a_s + gb * B_s * u_s,  # d delta: through a and through b
           ga * delta_s * a_s,               # dA
           gb * delta_s * u_s,               # dB
           gb * delta_s * B_s)               # du
for name, x, ref in zip(["d delta", "dA", "dB", "du"], by_hand, auto):
    print(f"{name:8s} max abs err {max_err(x, ref):.1e}")
    assert torch.allclose(x, ref, rtol=1e-12, atol=1e-14)

fig, ax = plt.subplots(figsize=(7, 3.5))
deltas = torch.linspace(0, 3, 200)
for rate in [-0.25, -1.0, -4.0, -16.0]:
    ax.plot(deltas, torch.exp(deltas * rate), label=f"A = {rate:g}")
ax.set_xlabel(r"step $\Delta$")
ax.set_ylabel(r"$a = e^{\Delta A}$")
ax.set_title("How much of the state survives one step")
ax.legend()
save_figure(fig, "05_discretisation.png")

# %% [markdown]
# A large step forgets quickly, a small step keeps the state: the same $A$ gives anything from "keep
# everything" to "forget at once", depending on the step the model selects.
#
# If $u$ and $B$ are held constant over the step (the zero-order hold), the input adds exactly
# $(\Delta A)^{-1}(e^{\Delta A} - 1)\,\Delta B\, u$. `mamba_ssm` keeps the exact decay but uses the
# first-order (Euler) input term $\Delta B u$, which agrees with the zero-order hold up to $O(\Delta^2)$,
# since $(\Delta A)^{-1}(e^{\Delta A} - 1) = 1 + \Delta A/2 + O(\Delta^2)$.
#
# An EMA is the case $\Delta = 1$, $A = \ln\alpha$, $B = 1 - \alpha$.
#
# The cell checks the order of the Euler term: halving $\Delta$ divides its difference to the
# zero-order hold by about 4 (by 2 if it were only $O(\Delta)$).

# %%
A_rate = -1.5
for step in (0.1, 0.05, 0.025):
    zoh = (math.exp(step * A_rate) - 1) / (step * A_rate) * step   # zero-order hold, times B u
    euler = step                                                  # Euler, times B u
    gap = abs(zoh - euler)
    if step < 0.1:
        print(f"step {step:5.3f}: |zero-order hold - Euler| = {gap:.2e}, {previous / gap:.2f}x smaller than at twice the step")
        assert 3.8 < previous / gap < 4.2
    previous = gap

# %% [markdown]
# ## Going deeper: the gradients, index by index
#
# Section 4's gradients with every index written out: batch element $i$, channel $d$, state $n$,
# position $t$, with $g(d)$ the group of channel $d$ and $a_{i,d,t,n} = e^{\Delta_{i,d,t} A_{d,n}}$.
# They are what `selective_scan_backward_by_hand` computes.
#
# $$d\Delta_{i,d,t} = \sum_n \delta_{i,d,t,n}\, \big(a_{i,d,t,n}\, h_{i,d,t-1,n}\, A_{d,n} + B_{i,g(d),n,t}\, u_{i,d,t}\big), \qquad
#   du_{i,d,t} = D_d\,d\bar y_{i,d,t} + \Delta_{i,d,t} \sum_n \delta_{i,d,t,n}\, B_{i,g(d),n,t},$$
# $$dA_{d,n} = \sum_{i,\,t} \Delta_{i,d,t}\, \delta_{i,d,t,n}\, a_{i,d,t,n}\, h_{i,d,t-1,n}, \qquad
#   dD_d = \sum_{i,\,t} d\bar y_{i,d,t}\, u_{i,d,t},$$
# $$dB_{i,g,n,t} = \sum_{d:\,g(d) = g} \delta_{i,d,t,n}\, \Delta_{i,d,t}\, u_{i,d,t}, \qquad
#   dC_{i,g,n,t} = \sum_{d:\,g(d) = g} d\bar y_{i,d,t}\, h_{i,d,t,n} .$$

# %% [markdown]
# ## Going deeper: the previous state
#
# Section 4's backward computes $a_t h_{t-1}$ from the previous state $h_{t-1}$, not as $h_t - b_t$.
# Why not $h_t - b_t$: it cancels catastrophically whenever $|b_t| \gg |a_t h_{t-1}|$. In float32,
# with a small decayed state next to a large input, the subtraction keeps only the bits of
# $a_t h_{t-1}$ that survived the rounding of $h_t$ to the scale of $b_t$; the product from $h_{t-1}$
# is correct to float32 precision.

# %%
a_c, h_prev_c, b_c = (torch.tensor(v, dtype=torch.float32) for v in (0.5, 1e-3, 1000.0))
h_c = a_c * h_prev_c + b_c
exact = 0.5 * 1e-3
err_subtract = abs((h_c - b_c).item() - exact) / exact
err_shifted = abs((a_c * h_prev_c).item() - exact) / exact
print(f"a*h_prev = {exact}: h - b gives {(h_c - b_c).item():.6g} (rel err {err_subtract:.1e}), "
      f"a * h_prev gives {(a_c * h_prev_c).item():.6g} (rel err {err_shifted:.1e})")
assert err_subtract > 1e-2 and err_shifted < 1e-7

# %% [markdown]
# ## Going deeper: the tolerances
#
# Every check of this chapter uses chapter 04's `tolerance(dtype, length)`, argued in its "Going
# deeper: the tolerance": one rounding of the output to its dtype, plus $32\sqrt{L}$ float32 roundings
# ($2^{-53}$ units for float64 inputs). It is an allowance for the typical case, not a proven bound.
# The course uses three error models, each fitted to its computation: chapter 01's sums pass a tree,
# so its tolerance grows like $\log_2 L$; chapters 02 and 03 scan one state, whose rounding
# `error_bound` bounds element by element from the gates and tokens themselves; chapters 04 and 05
# carry $N$ states per channel and sum them into $y$, where the $\sqrt{L}$ allowance is what is argued.
#
# **Float32 over the length.** The selective scan is chapter 04's recurrence. With positive steps
# $\Delta$ (softplus makes them so) its gates $e^{\Delta A}$ lie in $(0, 1)$, so chapter 04's argument
# holds as it stands: rounding errors of either sign are carried and damped by the gates, and add up
# like a random walk, $\sqrt{L}$ times the float32 unit roundoff $2^{-24}$, times 32 for the few
# roundings per step and the sums over states (and at least $\sqrt{16}$). One check with
# `delta_softplus=False` passes steps near $-1$, gates above 1 (a state that grows along the
# sequence), and stays within it as well; the bound then rests on no argument. The float16
# rounding that a state kept in half precision would add, $2^{-11}$ per step, is far above the
# float32 part. The gradients run the same recurrence backwards (the adjoint), so the
# same bound serves them.
#
# **Half-precision inputs** add the final rounding of each output and gradient
# to the input's dtype: $2^{-11}$ for float16 (11 significant bits) and $2^{-8}$ for bfloat16 (8 bits)
# when rounding to nearest, as a GPU does (under Triton's CPU interpreter, $2^{-7}$ for bfloat16:
# "Going deeper: the fine print" says why). For it to hold, the incoming gradient `dout` is drawn
# representable in the input dtype (autograd hands our backward `dout` in the output's dtype; a
# float64 `dout` would be rounded on our side only).
#
# **The checks catch the bugs they guard against.** `tests/test_selective_scan.py` breaks the kernels
# on purpose (the carry between chunks dropped, the input term discretised without $u$, the state kept
# in float16) and asserts that the comparison fails.

# %% [markdown]
# ## Going deeper: the chunks in one picture
#
# Section 6's scheme for one state of one channel and a chunk $k$ of 4 positions $s \dots s+3$ (slot
# $j$ of the tile holds position $s + j$; the kernels use the same slots). The forward folds the carry
# into slot 0. The backward's two scans, explained in section 6, *load* their inputs
# one position off, so that every slot sees the step it needs without moving data between threads; at
# the chunk's edges, where that load would leave the chunk, the carries come in instead:
#
# ```text
# position                   s-1 |  s         s+1       s+2       s+3    | s+4
#                      chunk k-1 |  slot 0    slot 1    slot 2    slot 3 | chunk k+1
# forward: loads at t            |  s         s+1       s+2       s+3    |
#   carry h[s-1] ----------------+> slot 0's pair: (a[s], b[s] + a[s] h[s-1])
#   scan, left to right          |  h[s]      h[s+1]    h[s+2]    h[s+3] +-> carry into chunk k+1
# backward (1): loads at t-1     |  --        s         s+1       s+2    |
#   boundary state h[s-1] -------+> slot 0's pair: (0, h[s-1])
#   scan, left to right          |  h[s-1]    h[s]      h[s+1]    h[s+2] |   then h[t] = a[t] h[t-1] + b[t]
# backward (2): Δ loads at t+1   |  s+1       s+2       s+3       --     |   (--: no load, the gate is 1)
#   reverse scan, right to left  |  δ[s]      δ[s+1]    δ[s+2]    δ[s+3] <-- carry a[s+4] δ[s+4], added in slot 3
#   carry into chunk k-1 <-------+- a[s] δ[s]                            |
# ```
#
# The pairs each scan sees, as a table, with $c_t = C_t\, d\bar y_t$:
#
# | row | 0 | 1 | 2 | 3 |
# | --- | --- | --- | --- | --- |
# | forward: pairs, the carry folded into row 0 | $(a_s,\ b_s + a_s h_{s-1})$ | $(a_{s+1}, b_{s+1})$ | $(a_{s+2}, b_{s+2})$ | $(a_{s+3}, b_{s+3})$ |
# | forward scan gives | $h_s$ | $h_{s+1}$ | $h_{s+2}$ | $h_{s+3}$, the next carry |
# | backward (1): pairs loaded at $t-1$, row 0 set | $(0,\ h_{s-1})$ | $(a_s, b_s)$ | $(a_{s+1}, b_{s+1})$ | $(a_{s+2}, b_{s+2})$ |
# | backward (1) scan gives | $h_{s-1}$ | $h_s$ | $h_{s+1}$ | $h_{s+2}$ |
# | backward (2): pairs, $\Delta$ loaded at $t+1$ | $(a_{s+1},\ c_s)$ | $(a_{s+2},\ c_{s+1})$ | $(a_{s+3},\ c_{s+2})$ | $(1,\ c_{s+3} + a_{s+4}\delta_{s+4})$ |
# | backward (2) reverse scan gives | $\delta_s$; next carry $a_s \delta_s$ | $\delta_{s+1}$ | $\delta_{s+2}$ | $\delta_{s+3}$ |
#
# Row 3 of (2) loads no gate from the next chunk (unlike chapter 04's backward): the adjoint carry
# arrives already multiplied by it. In the last chunk the carry is $dh_{L-1}$, which gives section 4's
# $\delta_{L-1}$.
#
# **Section 6's identity, checked.** The cell checks both forms in plain PyTorch against the sequential
# recurrence, with chunks that do not divide the length: the folded form, the same float64 operations
# as the loop, agrees to the last bit; the carry-added form may differ by rounding.

# %%
def chunked_states(a, b, h_init, chunk, fold=False):
    """States of h_t = a_t h_{t-1} + b_t (a, b: N x L) chunk by chunk: a scan from zero plus the carry
    (fold=False), or a scan whose first step starts from the carry (fold=True)."""
    states, h = [], h_init                                             # h: N
    for s in range(0, a.shape[1], chunk):
        a_c, b_c = a[:, s:s + chunk], b[:, s:s + chunk].clone()
        if fold:
            b_c[:, 0] += a_c[:, 0] * h                                 # the first step, from the carry
        b_hat, acc = [], torch.zeros_like(h)
        for t in range(a_c.shape[1]):                                  # the chunk from a zero state
            acc = a_c[:, t] * acc + b_c[:, t]
            b_hat.append(acc)
        b_hat = torch.stack(b_hat, dim=1)                              # N x chunk
        chunk_h = b_hat if fold else torch.cumprod(a_c, dim=1) * h[:, None] + b_hat
        states.append(chunk_h)
        h = chunk_h[:, -1]
    return torch.cat(states, dim=1)


torch.manual_seed(2)
a_chk, b_chk = torch.rand(3, 37, dtype=torch.float64), torch.randn(3, 37, dtype=torch.float64)
h_chk, h_seq = torch.randn(3, dtype=torch.float64), []
h = h_chk
for t in range(37):
    h = a_chk[:, t] * h + b_chk[:, t]
    h_seq.append(h)
for chunk in (1, 4, 8, 37, 64):
    errs = [max_err(chunked_states(a_chk, b_chk, h_chk, chunk, fold), torch.stack(h_seq, dim=1)) for fold in (False, True)]
    print(f"chunk {chunk:2d}: max abs err vs the sequential recurrence {errs[0]:.1e} (carry added), {errs[1]:.1e} (folded)")
    assert max(errs) < 1e-13

# %% [markdown]
# **What the check of the identity can catch.** The folded form's zero error is a statement of
# the construction, not a measurement of accuracy: position by position it does the same float64
# operations as the sequential loop ($a_s h_{s-1} + b_s$, then the same steps), so it could differ only
# if the bookkeeping were wrong (the carry taken from the wrong position, or folded into the wrong
# step). The carry-added form may differ by rounding once a chunk holds more than one position; the
# cell's assertion bounds both. Neither form runs a kernel: the cell checks the identity in PyTorch. The kernels'
# own carries are checked against the float64 reference in
# "Going deeper: checking `selective_scan`" and, with chunks of 4 to 64
# positions, in "Going deeper: launch parameters and the layout".

# %% [markdown]
# ## Going deeper: launch parameters and the layout
#
# **Why time across threads and states as a loop.** A first version of this chapter gave each
# program a `BLOCK_D x N x CHUNK` tile (chapter 04's all-states tile) and scanned along its last axis:
# states *and* time spread over the threads. Every chunk then paid for a sum across threads that the
# loop does not need: the output $y_t = \sum_n C_{t,n} h_{t,n}$ is a sum over the state axis, which
# lived on other threads.
# With time across the threads and the states as a loop, the 512 positions of a chunk are shared by
# the 64 threads of 2 warps, 8 each, in short runs of consecutive positions (how long the runs are is
# Triton's choice); Triton's scan runs along a thread's own runs one position after another in
# registers, then over the per-thread totals (a tree of shuffles within each warp and one level
# between warps through shared memory), and finally each thread applies its prefix: close to the
# scheme `mamba_ssm` writes by hand. This chapter does not time the first version; chapter 07 does
# (section 9, "All states at once") and finds it slower than the loop.
#
# **The loops are `for` loops.** Chapter 00 wrote its loops over runtime bounds as `while`; these
# kernels use `for ... in range(n)`, which older Triton interpreters cannot run under NumPy 2.4.
# `scan_lib.runtime` mends those interpreters (chapter 00, "Going deeper: the interpreter and NumPy"),
# so the loops run under every Triton and NumPy the package admits.
#
# **The forward kernel's helpers.** `_load_delta` applies `delta_bias` and the softplus, computed
# stably ("Going deeper: the fine print" shows how). `_column` reads column $n$ of the carry tile.
# Registers cannot be indexed by a loop variable, so it is a masked sum (`tl.where`, then `tl.sum`);
# writing column $n$ back is a `tl.where` too. `_load_coef` loads state $n$'s `B` or `C` in either
# layout: per position (`PER_STEP`, a `1 x CHUNK` row, read from the channel's group) or
# time-invariant (a `BLOCK_D x 1` column, `B[d, n]`); `discretize` broadcasts either.
#
# **What still crosses threads**: per state and chunk, the carry. Reading it (`_column`) and taking
# the scan's last column as the next carry (a masked sum over the whole chunk) are two reductions per
# state and chunk; long chunks spread that cost thin.
#
# **Block size and groups.** The channels of one program must share a group, so that the program
# loads one `B` row: the launcher shrinks `BLOCK_D` to the largest power of two dividing
# `dim // groups` (`tests/test_selective_scan.py` runs a block of 4 on 2 groups of 4 channels; the
# cell below asserts that the launcher chooses it).
#
# **The defaults** (`GPU_FWD_CONFIG`, `GPU_BWD_CONFIG`) are the fastest of the sweep in
# `benchmarks/tune_selective_scan.py` on an H200 (raw output in
# `benchmarks/results/tune_selective_scan_h200.txt`); this recording, on an H100, runs them unchanged
# (they were not swept there). Under the interpreter the blocks are small so that small tests cross
# several chunks and blocks.

# %% [markdown]
# The launch parameters must not change the result: one channel per program or four (with 2 groups of
# 4 channels, so that a block of 4 fits in a group: the cell asserts the block size this chapter's
# launcher chooses), and other chunk sizes for either pass (in training the forward runs with the
# backward's chunk, so the forward's own chunk only matters in inference, which the check also runs).
# `check_selective_scan` runs this chapter's kernels, whose launchers read these parameters, so each
# of the lines below is a run with one variant (`tests/test_selective_scan.py` runs the same variants,
# `test_launch_configs_agree`, and chapter 07's, `test_fast_launch_configs_agree`).

# %%
ss_module = sys.modules["scan_lib.selective_scan"]  # the module (scan_lib.selective_scan is the function)
fwd_config = ss_module.GPU_FWD_CONFIG if ON_GPU else ss_module.CPU_FWD_CONFIG  # the dicts in use
bwd_config = ss_module.GPU_BWD_CONFIG if ON_GPU else ss_module.CPU_BWD_CONFIG
defaults = dict(fwd=dict(fwd_config), bwd=dict(bwd_config))
variants = [dict(block_d=1), dict(block_d=4), dict(fwd=dict(chunk=64), bwd=dict(chunk=32)),
            dict(fwd=dict(chunk=4), bwd=dict(chunk=64))]
cfg_dim, cfg_groups, cfg_L = 8, 2, 300 if ON_GPU else 37
for variant in variants:
    fwd_config.update(variant.get("fwd", {k: v for k, v in variant.items() if k == "block_d"}))
    bwd_config.update(variant.get("bwd", {k: v for k, v in variant.items() if k == "block_d"}))
    for kind in ("fwd", "bwd"):
        chosen = ss_module._launch_config(kind, cfg_dim, cfg_groups, cfg_groups, cfg_L)
        assert chosen["block_d"] == (fwd_config if kind == "fwd" else bwd_config)["block_d"], chosen
    print(f"fwd {fwd_config} bwd {bwd_config}", end=" ")
    check_selective_scan(make_inputs(1, cfg_dim, 3, cfg_L, groups=cfg_groups, h0=False, seed=2))
    fwd_config.update(defaults["fwd"])
    bwd_config.update(defaults["bwd"])

# %% [markdown]
# ## Going deeper: the launchers and autograd
#
# The launchers. Each is a PyTorch custom operator (`torch.library`), so that `torch.compile`,
# `torch.func` and fake tensors know the kernels' output shapes without running them (explained after
# the code). Inputs are made contiguous, the state and every sum are float32 (float64
# when an input is float64), outputs and gradients come back in their input's dtype.
#
# The package's public function `scan_lib.selective_scan` is not this one: it has the same arguments,
# semantics and input checks over chapter 07's kernels (`scan_lib/__init__.py` imports it from
# `scan_lib.fast_selective_scan`).

# %%
#| export
from typing import Optional

from scan_lib.runtime import custom_op


def _launch_config(kind, dim, groups_b, groups_c, length):
    """The config dict for 'fwd' or 'bwd', with block_d (a power of two whose blocks never straddle a
    group) and chunk (at most the padded length) adapted to this problem."""
    if INTERPRET:
        config = dict(CPU_FWD_CONFIG if kind == "fwd" else CPU_BWD_CONFIG)
    else:
        config = dict(GPU_FWD_CONFIG if kind == "fwd" else GPU_BWD_CONFIG)
    block_d = min(config["block_d"], triton.next_power_of_2(dim))
    for groups in (groups_b, groups_c):
        if groups > 1:
            per_group = dim // groups
            block_d = min(block_d, per_group & -per_group)   # largest power of two dividing per_group
    config.update(block_d=block_d, chunk=min(config["chunk"], max(triton.next_power_of_2(length), 2)))
    return config


def _acc_dtype(*tensors):
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _groups(M):
    """Groups of a per-position B or C (batch, groups, N, L); 1 for the time-invariant (dim, N)."""
    return M.shape[1] if M.dim() == 4 else 1


def _contiguous(*tensors):
    return [None if t is None else t.contiguous() for t in tensors]


@custom_op("selective_scan_fwd", __name__)
def selective_scan_fwd(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: Optional[torch.Tensor], z: Optional[torch.Tensor], delta_bias: Optional[torch.Tensor],
                       initial_state: Optional[torch.Tensor], delta_softplus: bool, save_chunk: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel. B, C: (batch, groups, N, L) or (dim, N). Returns out, the last state, and,
    when save_chunk > 0 (training), the state entering every chunk of save_chunk positions
    (batch, dim, N, n_chunks) and ybar (out before the gate; only with z). Tensors not kept are empty."""
    u, delta, A, B, C, D, z, delta_bias, initial_state = _contiguous(u, delta, A, B, C, D, z, delta_bias, initial_state)
    batch, dim, length = u.shape
    n_states = A.shape[1]
    acc = _acc_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    config = _launch_config("fwd", dim, _groups(B), _groups(C), length)
    save = save_chunk > 0
    chunk = save_chunk if save else config["chunk"]
    n_chunks = triton.cdiv(length, chunk)
    out = torch.empty_like(u)
    last = u.new_empty(batch, dim, n_states, dtype=acc)
    states = u.new_empty(batch, dim, n_states, n_chunks if save else 0, dtype=acc)
    ybar = u.new_empty(u.shape if save and z is not None else (0,), dtype=acc)
    selective_scan_fwd_kernel[(batch, triton.cdiv(dim, config["block_d"]))](
        u, delta, A, B, C, D, z, delta_bias, initial_state, out, ybar, states, last,
        dim, length, n_states, n_chunks, _groups(B), _groups(C),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        HAS_H0=initial_state is not None, B_PER_STEP=B.dim() == 4, C_PER_STEP=C.dim() == 4,
        SOFTPLUS=delta_softplus, ACC=accumulator_dtype(acc), SAVE=save,
        BLOCK_D=config["block_d"], BLOCK_N=triton.next_power_of_2(n_states), CHUNK=chunk,
        num_warps=config["num_warps"])
    return out, last, states, ybar


@selective_scan_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, save_chunk):
    batch, dim, length = u.shape
    acc = _acc_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    n_chunks = (length + save_chunk - 1) // save_chunk if save_chunk > 0 else 0
    return (u.new_empty(u.shape), u.new_empty(batch, dim, A.shape[1], dtype=acc),
            u.new_empty(batch, dim, A.shape[1], n_chunks, dtype=acc),
            u.new_empty(u.shape if save_chunk > 0 and z is not None else (0,), dtype=acc))


@custom_op("selective_scan_bwd", __name__)
def selective_scan_bwd(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: Optional[torch.Tensor], z: Optional[torch.Tensor], delta_bias: Optional[torch.Tensor],
                       states: torch.Tensor, ybar: torch.Tensor, dout: torch.Tensor, dlast: Optional[torch.Tensor],
                       delta_softplus: bool, chunk: int) -> list[torch.Tensor]:
    """The backward kernel: du, d delta, dA, dB, dC, dD, dz, d delta_bias, d initial_state; dA, dB, dC,
    dD, d delta_bias and d initial_state in the accumulation dtype (float32 or float64), the others in
    their input's; dD, dz, d delta_bias are empty when D, z, delta_bias are None."""
    u, delta, A, B, C, D, z, delta_bias, states, ybar, dout, dlast = _contiguous(
        u, delta, A, B, C, D, z, delta_bias, states, ybar, dout, dlast)
    batch, dim, length = u.shape
    n_states, n_chunks, acc = A.shape[1], states.shape[-1], states.dtype
    config = _launch_config("bwd", dim, _groups(B), _groups(C), length)
    du, ddelta = torch.empty_like(u), torch.empty_like(delta)
    dz = torch.empty_like(z) if z is not None else u.new_empty(0)
    dB = torch.zeros(B.shape if B.dim() == 4 else (batch, dim, n_states), device=u.device, dtype=acc)
    dC = torch.zeros(C.shape if C.dim() == 4 else (batch, dim, n_states), device=u.device, dtype=acc)
    dA_part, dh0 = (u.new_empty(batch, dim, n_states, dtype=acc) for _ in range(2))
    dD_part, dbias_part = (u.new_empty(batch, dim, dtype=acc) for _ in range(2))
    selective_scan_bwd_kernel[(batch, triton.cdiv(dim, config["block_d"]))](
        u, delta, A, B, C, D, z, delta_bias, states, ybar, dout, dlast,
        du, ddelta, dz, dB, dC, dA_part, dD_part, dbias_part, dh0,
        dim, length, n_states, n_chunks, _groups(B), _groups(C),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        HAS_DLAST=dlast is not None, B_PER_STEP=B.dim() == 4, C_PER_STEP=C.dim() == 4,
        SOFTPLUS=delta_softplus, ACC=accumulator_dtype(acc),
        BLOCK_D=config["block_d"], BLOCK_N=triton.next_power_of_2(n_states), CHUNK=chunk,
        num_warps=config["num_warps"])
    if B.dim() == 2:
        dB = dB.sum(0)
    if C.dim() == 2:
        dC = dC.sum(0)
    return [du, ddelta, dA_part.sum(0), dB, dC, dD_part.sum(0) if D is not None else u.new_empty(0, dtype=acc),
            dz, dbias_part.sum(0) if delta_bias is not None else u.new_empty(0, dtype=acc), dh0]


@selective_scan_bwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, states, ybar, dout, dlast, delta_softplus, chunk):
    acc, dim = states.dtype, u.shape[1]
    return [u.new_empty(u.shape), delta.new_empty(delta.shape), A.new_empty(A.shape, dtype=acc),
            B.new_empty(B.shape, dtype=acc), C.new_empty(C.shape, dtype=acc),
            u.new_empty((dim,) if D is not None else (0,), dtype=acc),
            (z if z is not None else u).new_empty(z.shape if z is not None else (0,)),
            u.new_empty((dim,) if delta_bias is not None else (0,), dtype=acc),
            u.new_empty(u.shape[0], dim, A.shape[1], dtype=acc)]


def _vmap_by_loop(op):
    """A vmap rule for op: call it once per element of the vmapped dimension and stack the results."""
    def rule(info, in_dims, *args):
        results = [op(*[a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)])
                   for i in range(info.batch_size)]
        kind = type(results[0])                                   # a tuple or a list of tensors
        return kind(torch.stack(parts) for parts in zip(*results)), kind([0] * len(results[0]))
    return rule


selective_scan_fwd.register_vmap(_vmap_by_loop(selective_scan_fwd))
selective_scan_bwd.register_vmap(_vmap_by_loop(selective_scan_bwd))

# %% [markdown]
# Autograd: a `torch.autograd.Function` whose forward calls the forward op and keeps what the
# backward needs, and whose backward calls the backward op. The backward kernel's gradients are not
# themselves differentiable: a second derivative through the scan raises a `RuntimeError` instead of
# silently leaving the scan's part out (explained after the code).

# %%
#| export
_NO_SECOND_DERIVATIVE = ("selective_scan has no second derivative: its backward kernel's gradients cannot "
                         "be differentiated again (create_graph=True gives first derivatives only; "
                         "hessians, double backward and gradgradcheck through selective_scan are not supported)")


class _NoSecondDerivative(torch.autograd.Function):
    """The identity on selective_scan's gradients, attached to the tensors they depend on; differentiating
    through it (a second derivative of selective_scan) raises instead of returning a silent zero."""
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


class SelectiveScanFn(torch.autograd.Function):
    """(out, last_state, states, ybar) = S6(u, delta, A, B, C, D, z, delta_bias, initial_state);
    B, C are 4-D or (dim, N) here; save_chunk > 0 keeps boundary states for the backward."""
    generate_vmap_rule = True

    @staticmethod
    def forward(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, save_chunk):
        return selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, save_chunk)

    @staticmethod
    def setup_context(ctx, inputs, output):
        u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, save_chunk = inputs
        _, _, states, ybar = output
        ctx.mark_non_differentiable(states, ybar)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, states, ybar)
        ctx.delta_softplus, ctx.chunk = delta_softplus, save_chunk
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout, dlast, _dstates, _dybar):
        u, delta, A, B, C, D, z, delta_bias, initial_state, states, ybar = ctx.saved_tensors
        if ctx.chunk == 0:
            raise RuntimeError("selective_scan: the forward kept no boundary states (no input required a "
                               "gradient when it ran), so there is nothing to differentiate")
        if dout is None:
            dout = torch.zeros_like(u)
        with torch.no_grad():  # the op's own outputs carry no graph (see _NoSecondDerivative below)
            grads = selective_scan_bwd(u, delta, A, B, C, D, z, delta_bias, states, ybar, dout.to(u.dtype),
                                       dlast, ctx.delta_softplus, ctx.chunk)
        inputs = (u, delta, A, B, C, D, z, delta_bias, initial_state)
        grads = [None if x is None else g.to(x.dtype) for g, x in zip(grads, inputs)]
        if torch.is_grad_enabled():  # create_graph=True (or torch.func.grad): make a second derivative raise
            anchors = [x for x in (*inputs, dout, dlast) if x is not None]
            given = [g for g in grads if g is not None]
            poisoned = iter(_NoSecondDerivative.apply(len(anchors), *anchors, *given))
            grads = [None if g is None else next(poisoned) for g in grads]
        return (*grads, None, None)

# %% [markdown]
# The public function checks its inputs first, with errors that name the argument.

# %%
#| export
from scan_lib.runtime import apply, check_float_tensor, check_same_device, plus, zero_in_graph


def _check_shape(name, tensor, shape):
    if tensor is not None and tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")


def _check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state):
    if isinstance(A, torch.Tensor) and A.is_complex():
        raise TypeError(f"A must be real: complex A ({A.dtype}, mamba_ssm's complex variant) is not supported")
    named = dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias, initial_state=initial_state)
    for name, value in named.items():
        if value is not None or name in ("u", "delta", "A", "B", "C"):
            check_float_tensor(name, value)
    if u.dim() != 3:
        raise ValueError(f"u must have shape (batch, dim, L), got {tuple(u.shape)}")
    batch, dim, length = u.shape
    if A.dim() != 2 or A.shape[0] != dim or A.shape[1] == 0:
        raise ValueError(f"A must have shape (dim={dim}, N) with N >= 1, got {tuple(A.shape)}")
    n_states = A.shape[1]
    for name, M in (("B", B), ("C", C)):
        if M.dim() == 2:
            if tuple(M.shape) != (dim, n_states):
                raise ValueError(f"{name} of 2 dimensions (time-invariant) must have shape (dim={dim}, "
                                 f"N={n_states}), got {tuple(M.shape)}")
            continue
        if M.dim() not in (3, 4) or M.shape[0] != batch or tuple(M.shape[-2:]) != (n_states, length):
            raise ValueError(f"{name} must have shape (batch={batch}, N={n_states}, L={length}), "
                             f"(batch={batch}, groups, N={n_states}, L={length}) or (dim={dim}, N={n_states}), "
                             f"got {tuple(M.shape)}")
        if M.dim() == 4 and (M.shape[1] == 0 or dim % M.shape[1] != 0):
            raise ValueError(f"{name}: the number of groups ({M.shape[1]}) must divide dim ({dim})")
    for name, value, shape in (("delta", delta, u.shape), ("z", z, u.shape), ("D", D, (dim,)),
                               ("delta_bias", delta_bias, (dim,)),
                               ("initial_state", initial_state, (batch, dim, n_states))):
        _check_shape(name, value, shape)
    check_same_device(**named)


def empty_selective_scan(u, delta, A, B, C, D, z, delta_bias, return_last_state, initial_state):
    """The result for an empty u (batch, dim or L zero), as torch's ops give one: out, empty, in u's
    dtype; the last state, the initial state (no position moved it) or zeros. Differentiable: the
    gradient reaches initial_state through the last state, and every other input's is zero."""
    inputs = [t for t in (u, delta, A, B, C, D, z, delta_bias, initial_state) if t is not None]
    zero = zero_in_graph(*inputs)                 # in every input's graph; None when nothing is differentiated
    out = plus(torch.empty_like(u, memory_format=torch.contiguous_format), zero)
    if not return_last_state:
        return out
    acc = _acc_dtype(*inputs)
    last = (u.new_zeros(u.shape[0], u.shape[1], A.shape[1], dtype=acc) if initial_state is None
            else initial_state.to(acc, copy=True))
    return out, plus(last, zero)


def _check_index_range(u_shape, n_states, groups_b, groups_c):
    """The kernels index with 32-bit offsets: refuse inputs whose largest buffer they would overrun.

    The largest are the (batch, dim, L) tensors, the fp32 dB and dC buffers (batch, groups, N, L), and
    the boundary states (batch, dim, N, ceil(L / CHUNK_bwd))."""
    batch, dim, length = u_shape
    bwd = _launch_config("bwd", dim, groups_b, groups_c, length)
    largest = max(batch * dim * length, batch * max(groups_b, groups_c) * n_states * length,
                  batch * dim * n_states * triton.cdiv(length, bwd["chunk"]))
    if largest >= 2**31:
        raise ValueError(f"u of shape {tuple(u_shape)} with N={n_states}: a buffer of {largest} elements needs "
                         "64-bit offsets, which these kernels do not use yet; split the batch or the sequence "
                         "(initial_state and last_state make the pieces exact)")


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, initial_state=None):
    """Mamba's selective scan (S6), a drop-in for mamba_ssm's selective_scan_fn (real A), plus initial_state.

    u, delta: (batch, dim, L); A: (dim, N), real (complex A raises TypeError); B, C: (batch, N, L),
    (batch, groups, N, L) with channel d using group d // (dim // groups), or (dim, N), the same for
    every batch element and position; D, delta_bias: (dim,); z: (batch, dim, L);
    initial_state: (batch, dim, N), the state before position 0 (default zeros).

        delta <- softplus(delta + delta_bias) if delta_softplus else delta + delta_bias
        h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t,   ybar_t = sum_n C_t h_t + D * u_t
        out = ybar * silu(z) if z is given else ybar

    Returns out (dtype of u), and with return_last_state also h after the last position (batch, dim, N)
    in float32 (float64 for float64 inputs). Gradients flow to every tensor argument, including
    initial_state and through last_state: scanning a sequence in pieces, each piece starting from the
    previous piece's last_state, gives the same outputs and gradients as one scan. First derivatives
    only: differentiating the gradients again raises RuntimeError. Works under torch.compile,
    torch.func.grad and torch.func.vmap.
    """
    _check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    if u.numel() == 0:
        return empty_selective_scan(u, delta, A, B, C, D, z, delta_bias, return_last_state, initial_state)
    B4 = B.unsqueeze(1) if B.dim() == 3 else B
    C4 = C.unsqueeze(1) if C.dim() == 3 else C
    _check_index_range(u.shape, A.shape[1], _groups(B4), _groups(C4))
    tensors = (u, delta, A, B4, C4, D, z, delta_bias, initial_state)
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    save_chunk = _launch_config("bwd", u.shape[1], _groups(B4), _groups(C4), u.shape[2])["chunk"] if training else 0
    out, last, _, _ = apply(SelectiveScanFn, *tensors, bool(delta_softplus), save_chunk)
    return (out, last) if return_last_state else out

# %% [markdown]
# **How the pieces fit.** `selective_scan_fwd` and `selective_scan_bwd` are custom operators (`torch.library.custom_op`): to
# PyTorch they are opaque functions of tensors, with a *fake* implementation that only computes the
# shapes and dtypes of the outputs. That is what `torch.compile` traces with (no kernel runs while it
# builds the graph), and it never has to look inside Triton. The autograd rule lives in
# `SelectiveScanFn`, a `torch.autograd.Function` written in the form `torch.func` needs (a `forward`
# without `ctx`, a `setup_context`, `generate_vmap_rule = True`). Under `torch.func.vmap` each op runs
# once per element of the mapped dimension (`_vmap_by_loop`): correct for any input mapped, not fast.
#
# **Second derivatives.** The backward kernel's gradients are computed without a graph. Under
# `create_graph=True` (which `torch.func.grad` always uses), a plain `Function` would return gradients
# that look constant to autograd, so a Hessian would silently miss the scan's part. `SelectiveScanFn`
# therefore passes its gradients through `_NoSecondDerivative`, an identity attached to the inputs the
# gradients depend on, whose backward raises. First derivatives work everywhere; a second raises.
# The cell runs this chapter's op (`chapter_scan`). Its first number, `torch.func.grad` against plain
# autograd, checks the wiring only: both run the same backward kernel, so they agree whether or not
# its gradients are right ("Going deeper: checking `selective_scan`"
# checks those against the float64 reference). The same holds for
# the other two, `torch.compile` and `vmap` against the plain call, which run the same kernels:

# %%
torch.manual_seed(4)
small = make_inputs(1, 2, 3, 5, dtype=torch.float64, seed=4)
u_leaf = small.pop("u").requires_grad_(True)


def scan_of_u(u):
    return chapter_scan(u, **small, delta_softplus=True)


grad_u = torch.func.grad(lambda u: scan_of_u(u).square().sum())(u_leaf.detach())
(grad_u_ref,) = torch.autograd.grad(scan_of_u(u_leaf).square().sum(), u_leaf)
compiled = torch.compile(scan_of_u, fullgraph=True, backend="aot_eager")
batched = torch.func.vmap(scan_of_u)(torch.stack([u_leaf.detach(), 2 * u_leaf.detach()]))
print(f"torch.func.grad vs autograd: {max_err(grad_u, grad_u_ref):.1e}; "
      f"torch.compile(fullgraph=True): {max_err(compiled(u_leaf), scan_of_u(u_leaf)):.1e}; "
      f"vmap: {max_err(batched[1], scan_of_u(2 * u_leaf)):.1e}")
assert max_err(grad_u, grad_u_ref) < 1e-12 and max_err(compiled(u_leaf), scan_of_u(u_leaf)) == 0
assert max_err(batched[1], scan_of_u(2 * u_leaf)) < 1e-12
try:
    torch.autograd.functional.hessian(lambda u: scan_of_u(u).square().sum(), u_leaf.detach())
except RuntimeError as error:
    assert "selective_scan has no second derivative" in str(error)
    print(f"hessian: RuntimeError: {str(error)[:60]}...")
else:
    raise AssertionError("hessian through selective_scan must raise")

# %% [markdown]
# ## Going deeper: scanning in pieces
#
# `initial_state` and the differentiable `last_state` make the scan composable: process a long
# sequence in pieces, each starting from the previous piece's last state, and you get the same outputs
# *and gradients* as in one go (chunked inference, truncated training). Checked in float64, with
# uneven pieces:

# %%
def scan_in_pieces(pieces, inputs, softplus=True):
    """Run selective_scan piece by piece along L, carrying last_state into the next initial_state."""
    outs, state, start = [], inputs["initial_state"], 0
    for length in pieces:
        sl = slice(start, start + length)
        part = {k: (v[..., sl] if k in ("u", "delta", "z", "B", "C") and v is not None else v) for k, v in inputs.items()}
        part["initial_state"] = state
        out, state = chapter_scan(**part, delta_softplus=softplus, return_last_state=True)
        outs.append(out)
        start += length
    return torch.cat(outs, dim=-1), state


base = make_inputs(1, 4, 3, 41, groups=2, dtype=torch.float64, seed=7)
base = {k: (None if v is None else v.requires_grad_(True)) for k, v in base.items()}
torch.manual_seed(3)
dout = torch.randn(1, 4, 41, dtype=torch.float64, device=DEVICE)
dlast = torch.randn(1, 4, 3, dtype=torch.float64, device=DEVICE)
results = []
for pieces in ([41], [13, 1, 27], [17, 17, 7]):
    out, last = scan_in_pieces(pieces, base)
    grads = torch.autograd.grad((out * dout).sum() + (last * dlast).sum(), list(base.values()))
    results.append((pieces, out, last, grads))
whole = results[0]
for pieces, out, last, grads in results[1:]:
    errs = [max_err(out, whole[1]), max_err(last, whole[2])] + [max_err(g, w) for g, w in zip(grads, whole[3])]
    print(f"pieces {pieces}: max abs diff vs one piece, out/last/grads: {max(errs):.1e}")
    assert max(errs) < 1e-12

# %% [markdown]
# ## Going deeper: memory in training
#
# Autograd through the reference would keep every state: `batch x dim x L x N` values. Our forward keeps
# only the boundary states, `batch x dim x N x ceil(L / CHUNK_bwd)` float32 values, and, when `z` is
# given, $\bar y$, one `batch x dim x L` float32 tensor (`mamba_ssm` keeps its `out` too, in the input
# dtype); the backward recomputes the states chunk by chunk. What the backward allocates on top, at
# its peak (the end, when the gradients are cast to their inputs' dtypes), with $s$ the input element
# size and $g$ the number of groups:
#
# * $3\,b\,d\,L\,s$ bytes for $du$, $d\Delta$, $dz$ (two tensors without `z`);
# * $2\,b\,g\,N\,L \cdot 4$ bytes for $dB$, $dC$, accumulated in float32;
# * for half-precision inputs only, another $2\,b\,g\,N\,L\,s$ bytes for their casts to the input dtype
#   (float32 inputs need no cast);
# * $(2bdN + 2bd) \cdot 4$ bytes of partial sums for $dA$, $dh_{-1}$, $dD$ and $d\,\text{bias}$.
#
# The cell computes these for (8, 1024, 2048, N=16) in float32 and prints them; on a GPU the next code
# cell compares the formula with the measured peak. The cell's assert is only arithmetic: 2048 is a
# multiple of `CHUNK_bwd`, so the boundary states must be exactly $1/\texttt{CHUNK\_bwd}$ of all the
# states. That catches a slip in `boundary_state_bytes`'s product, but not a wrong count of chunks
# (here rounding $L / \texttt{CHUNK\_bwd}$ up or down gives the same number), and it runs no kernel,
# so it says nothing about what the forward keeps. Both are checked after the measurement, at a
# length that is not a multiple of the chunk, against the states the forward keeps.

# %%
from scan_lib.selective_scan import GPU_BWD_CONFIG  # noqa: E402


def boundary_state_bytes(batch, dim, L, N, chunk):
    return batch * dim * N * triton.cdiv(L, chunk) * 4


def backward_extra_bytes(batch, dim, L, N, groups=1, in_size=4, has_z=True):
    """Peak bytes the backward allocates: input gradients, fp32 dB and dC, their casts, partial sums."""
    grads = (3 if has_z else 2) * batch * dim * L * in_size
    bc = 2 * batch * groups * N * L * 4
    casts = 0 if in_size == 4 else 2 * batch * groups * N * L * in_size
    partial = (2 * batch * dim * N + 2 * batch * dim) * 4
    return grads + bc + casts + partial


mem_shape = dict(batch=8, dim=1024, L=2048, N=16)
chunk_bwd = GPU_BWD_CONFIG["chunk"]
all_states = math.prod(mem_shape.values()) * 4
ybar_bytes = math.prod(mem_shape[k] for k in ("batch", "dim", "L")) * 4
print(f"all states: {all_states / 2**20:.0f} MiB; kept by our forward: boundary states (CHUNK_bwd={chunk_bwd}) "
      f"{boundary_state_bytes(**mem_shape, chunk=chunk_bwd) / 2**20:.0f} MiB + ybar {ybar_bytes / 2**20:.0f} MiB; "
      f"backward allocations: {backward_extra_bytes(**mem_shape) / 2**20:.0f} MiB, of which "
      f"{3 * ybar_bytes / 2**20:.0f} MiB are du, d delta, dz")
assert all_states == chunk_bwd * boundary_state_bytes(**mem_shape, chunk=chunk_bwd)

fig, ax = plt.subplots(figsize=(7, 3.5))
lengths = [2**k for k in range(8, 18)]
ax.loglog(lengths, [8 * 1024 * L * 16 * 4 / 2**30 for L in lengths], "o-", label="every state (autograd of the loop)")
ax.loglog(lengths, [boundary_state_bytes(8, 1024, L, 16, chunk_bwd) / 2**30 for L in lengths], "s-",
          label=f"boundary states, CHUNK_bwd={chunk_bwd}")
ax.loglog(lengths, [8 * 1024 * L * 4 / 2**30 for L in lengths], "--", color="gray",
          label="one (batch, dim, L) fp32 tensor (ybar, kept with z)")
ax.set_xlabel("sequence length L")
ax.set_ylabel("GiB kept for the backward")
ax.set_title("batch 8, dim 1024, N 16")
ax.legend(fontsize=8)
save_figure(fig, "05_memory.png")

# %% [markdown]
# On a GPU, the measured peak of the backward against that formula, for fp32 and bf16 inputs (the
# cell asserts that they agree within 10%), this chapter's backward (`chapter_scan`).

# %%
if not ON_GPU:
    print("skipped: needs a GPU (torch.cuda.max_memory_allocated)")
else:
    for in_dtype in (torch.float32, torch.bfloat16):
        inputs = make_inputs(**{k: mem_shape[k] for k in ("batch", "dim", "N", "L")}, dtype=in_dtype, h0=False)
        leaves = {k: v.requires_grad_(True) for k, v in inputs.items() if v is not None}
        out = chapter_scan(**leaves, delta_softplus=True)
        dout = torch.randn_like(out)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out.backward(dout)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - before
        predicted = backward_extra_bytes(**mem_shape, in_size=inputs["u"].element_size())
        print(f"{in_dtype}: backward peak {measured / 2**20:.1f} MiB, formula {predicted / 2**20:.1f} MiB, "
              f"all states would be {all_states / 2**20:.0f} MiB")
        assert 0.9 * predicted <= measured <= 1.1 * predicted + 2**20, (measured, predicted)
        del out, dout, leaves, inputs

# %% [markdown]
# The boundary-state formula at a length that is not a multiple of the chunk: at $L = 21$ with chunks
# of 8 positions the last chunk holds 5 positions and still gets a boundary state, so the forward keeps
# 3 per channel and state, not $21/8$. The cell runs this chapter's forward op with that chunk (on any
# device) and checks what it keeps: the size against `boundary_state_bytes`, and the values against
# the reference's state entering each chunk $k$ (the initial state for $k = 0$, otherwise the state
# after position $8k - 1$). The last state, which comes out of the partial chunk, is checked too.

# %%
ss_fwd = sys.modules["scan_lib.selective_scan"].selective_scan_fwd   # this chapter's forward op
odd_L, odd_chunk = 21, 8                                             # two chunks of 8 and one of 5
odd = make_inputs(1, 2, 3, odd_L, groups=1, D=False, z=False, bias=False, seed=21)
_, odd_last, kept, _ = ss_fwd(odd["u"], odd["delta"], odd["A"], odd["B"], odd["C"], None, None, None,
                              odd["initial_state"], True, odd_chunk)  # save_chunk = 8: keep the boundary states
print(f"L = {odd_L}, chunk {odd_chunk}: kept {tuple(kept.shape)} (batch, dim, N, chunks), "
      f"{kept.numel() * kept.element_size()} bytes; formula {boundary_state_bytes(1, 2, odd_L, 3, odd_chunk)} bytes")
assert kept.shape == (1, 2, 3, 3)
assert kept.numel() * kept.element_size() == boundary_state_bytes(1, 2, odd_L, 3, odd_chunk)
odd_tol = tolerance(torch.float32, odd_L)
for k in range(kept.shape[-1]):
    if k == 0:
        entering = odd["initial_state"]
    else:
        prefix = {name: (v[..., :k * odd_chunk] if name in ("u", "delta", "B", "C") else v) for name, v in odd.items()}
        _, entering = selective_scan_ref(**prefix, delta_softplus=True, return_last_state=True)
    print(f"  state entering chunk {k} (position {k * odd_chunk}): rel err vs the reference "
          f"{rel_err(kept[..., k], entering):.1e}")
    assert rel_err(kept[..., k], entering) < odd_tol
_, last_ref_odd = selective_scan_ref(**odd, delta_softplus=True, return_last_state=True)
print(f"  last state (after the partial chunk): rel err {rel_err(odd_last, last_ref_odd):.1e}, tolerance {odd_tol:.1e}")
assert rel_err(odd_last, last_ref_odd) < odd_tol

# %% [markdown]
# ## Going deeper: against the official kernel
#
# Section 7's comparison: where `mamba_ssm` is installed (it needs a CUDA GPU), its `selective_scan_fn`
# and `chapter_scan` should agree on outputs, the last state and every gradient, for fp32 inputs with
# groups, `D`, `z`, `delta_bias` and softplus, and with time-invariant `B` and `C` (for a
# time-invariant `B` the cell rescales the official last state: "Going deeper: the fine print").

# %%
def compare_with_mamba_ssm(batch=2, dim=64, N=16, L=1000, groups=2, time_invariant="", tol=1e-4):
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except ImportError as error:
        print(f"skipped: mamba_ssm not importable ({error})")
        return None
    if not ON_GPU:
        print("skipped: mamba_ssm's kernel needs a GPU")
        return None
    inputs = make_inputs(batch, dim, N, L, groups=groups, h0=False, seed=11, time_invariant=time_invariant)
    inputs.pop("initial_state")
    dout = torch.randn(batch, dim, L, dtype=torch.float64, device=DEVICE)
    dlast = torch.zeros(batch, dim, N, dtype=torch.float64, device=DEVICE)  # mamba_ssm ignores d last_state
    ours = run_with_grads(chapter_scan, inputs, dout, dlast, True)
    theirs = run_with_grads(selective_scan_fn, inputs, dout, dlast, True)
    # For a time-invariant B, mamba_ssm's CUDA kernel scans delta * u without B and folds B into C for
    # the output, so the last state it returns is h / B (its own selective_scan_ref returns h, as we do).
    their_last = theirs[1] * inputs["B"] if "B" in time_invariant else theirs[1]
    errors = {"out": rel_err(ours[0], theirs[0]), "last": rel_err(ours[1], their_last)}
    errors.update({"d" + k: rel_err(ours[2][k], theirs[2][k]) for k in ours[2]})
    print(f"ours vs mamba_ssm (B, C {'(dim, N)' if time_invariant else 'per position'}): "
          + "  ".join(f"{k} {v:.0e}" for k, v in errors.items()))
    assert all(e < tol for e in errors.values()), errors
    return errors


compare_with_mamba_ssm()
compare_with_mamba_ssm(groups=None, time_invariant="BC");

# %% [markdown]
# ## Going deeper: the benchmark
#
# Section 8's measurement, on a GPU. It times `chapter_scan` ("ours") against `mamba_ssm`'s at Mamba's
# usual layer size (batch 8, dim 1024, L 2048, N 16), `u`, `delta`, `B`, `C`, `z` in fp32 and then
# bf16: the forward without gradients, the forward+backward with all inputs requiring them. The memory
# floor is the bytes that must move (`io_bytes`: each pass reading its inputs once and writing its
# outputs once) over the copy bandwidth measured in the same cell. The cell prints every time and,
# last, per dtype and pass, how ours compares with `mamba_ssm`'s kernel and the memory floor. The next
# section lists the likely costs behind the gaps.

# %%
def io_bytes(batch, dim, L, N, size, backward):
    """Bytes read and written, each large tensor once: forward u, delta, z, out (4 of batch x dim x L) and B, C
    (2 of batch x N x L); the backward adds u, delta, z, dout, du, ddelta, dz (7) and B, C, dB, dC (4)."""
    big, small = batch * dim * L * size, batch * N * L * size
    return (4 * big + 2 * small) + (backward * (7 * big + 4 * small))


if not ON_GPU:
    print("skipped: needs a GPU")
else:
    from scan_lib.runtime import copy_bandwidth, median_us
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except ImportError as error:
        selective_scan_fn = None
        print(f"mamba_ssm not importable ({error}): timing ours only")
    shape = dict(batch=8, dim=1024, L=2048, N=16)
    print(torch.cuda.get_device_name(), f"(batch, dim, L, N) = {tuple(shape.values())}")
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for in_dtype in (torch.float32, torch.bfloat16):
        inputs = make_inputs(**{k: shape[k] for k in ("batch", "dim", "N", "L")}, dtype=in_dtype, h0=False)
        inputs.pop("initial_state")
        leaves = {k: v.requires_grad_(True) for k, v in inputs.items()}
        dout = torch.randn_like(inputs["u"])
        impls = {"ours": chapter_scan}
        if selective_scan_fn is not None:
            impls["mamba_ssm"] = selective_scan_fn
        for backward in (False, True):
            floor = io_bytes(**shape, size=inputs["u"].element_size(), backward=backward) / bandwidth * 1e6
            row = {"dtype": str(in_dtype).replace("torch.", ""), "pass": "fwd+bwd" if backward else "fwd", "floor": floor}
            for name, fn in impls.items():
                if backward:
                    def step(fn=fn):
                        fn(**leaves, delta_softplus=True).backward(dout)
                    row[name] = median_us(step, grad_to_none=list(leaves.values()))
                else:
                    with torch.no_grad():
                        row[name] = median_us(lambda fn=fn: fn(**inputs, delta_softplus=True))
            rows.append(row)
            print("  ".join(f"{k} {v:8.0f} us" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    for row in rows:
        if "mamba_ssm" in row:
            ratio = row["mamba_ssm"] / row["ours"]
            print(f"{row['dtype']} {row['pass']}: ours is {max(ratio, 1 / ratio):.2f}x "
                  f"{'faster' if ratio > 1 else 'slower'} than mamba_ssm, {row['ours'] / row['floor']:.1f}x the memory floor")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['dtype']}\n{r['pass']}" for r in rows]
    series = [k for k in ("floor", "ours", "mamba_ssm") if k in rows[0]]
    for i, key in enumerate(series):
        ax.bar([j + 0.27 * (i - 1) for j in range(len(rows))], [r[key] for r in rows], width=0.27, label=key)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("median time (us)")
    ax.set_title(f"selective scan, (8, 1024, 2048, N=16), {torch.cuda.get_device_name()}")
    ax.legend()
    save_figure(fig, "05_benchmark.png")

# %% [markdown]
# ## Going deeper: where the time goes
#
# **What the benchmark times.** This chapter's kernels, not the package's `scan_lib.selective_scan`, which
# runs chapter 07's kernels: the README's `selective_scan` rows (from `make bench`) and chapter 07's
# section 10 time that one, so their numbers are not these. Softplus, `D`, `z` and `delta_bias` are
# on, and `A`, `D`, `delta_bias` in fp32. The forward, timed without gradients, writes no boundary
# states. The memory floor counts the forward as reading $u$, $\Delta$, $z$, $B$, $C$ and writing
# `out`, and the backward as reading $u$, $\Delta$, $z$, $B$, $C$ again with $d\,\text{out}$ and
# writing $du$, $d\Delta$, $dz$, $dB$, $dC$. That is what `io_bytes` adds up: 4 `(batch, dim, L)` and
# 2 `(batch, N, L)` tensors for the forward, 7 and 4 more for the backward, as its docstring lists
# them; the small `A`, `D`, `delta_bias` and their gradients are left out.
#
# These are the likely costs of the design, not confirmed by a profiler here (chapter 07 profiles them):
#
# * **The forward.** Halving the bytes (bf16 inputs) cuts our forward's time by only about a tenth
#   while it roughly halves `mamba_ssm`'s (the benchmark's forward lines, in fp32 and bf16 for both): our
#   forward is limited by the instructions it issues, not by memory. The arithmetic needs about ten
#   operations per (batch, dim, position, state) element (an `exp`, the discretisation, a multiply-add
#   for the recurrence and one for $C h$, the scan's combine); the reductions that move the carry in
#   and out of the scan, per state and chunk, and the scan's cross-thread levels come on top.
#   `mamba_ssm` passes the carry as the block scan's running prefix instead.
# * **The backward** recomputes the states (one `exp`), computes $a_{t-1}$ and $a_{t+1}$ with two more,
#   runs two scans per state (states and adjoint) where the forward runs one, and adds per-position
#   $dB$, $dC$ with two `tl.atomic_add` per element, as `mamba_ssm` does (so they are not bitwise
#   reproducible from run to run).
#
# What to try, one change at a time, with this chapter's tests as the guard: profile first (issued
# instructions per element, stall reasons, the layout Triton gives the tiles); then a cheaper carry
# (a running prefix instead of two reductions per state and chunk); $a_{t\pm1}$ from $a_t$ by a shift
# within each thread's positions instead of two more `exp`; the `dB`, `dC` sums over channels done in
# registers for several channels per program before one atomic add; and more than one state per loop
# step, so that independent scans overlap.

# %% [markdown]
# ## Going deeper: the fine print
#
# Five details: how the kernels compute the softplus, the errors bad
# input gets, the interpreter's conversion to bfloat16, the gradients of a time-invariant `B` or `C`,
# and `mamba_ssm`'s last state when `B` is time-invariant.
#
# **The softplus without overflow.** `_load_delta` (section 6) computes the step
# $\Delta = \operatorname{softplus}(x)$ of $x = \Delta_{\text{raw}} + \text{bias}$. $\log(1 + e^x)$
# computed literally overflows for large $x$ and rounds to 0 for very negative $x$ (where softplus is
# a tiny positive step that still matters). The kernel uses
# $\operatorname{softplus}(x) = \max(x, 0) + \operatorname{log1p}(e^{-|x|})$, which cannot overflow,
# and, since `tl` has no `log1p`, computes $\operatorname{log1p}(e)$ as $\log(w)\,e/(w - 1)$ with
# $w = 1 + e$ (Goldberg's trick: $w - 1$ is exactly the $e$ that $w$ holds after rounding, so the
# rounding of $w$ cancels), falling back to $e$ when $w$ rounds to 1. Without the trick, $\log(w)$
# alone keeps only the bits of $e$ that survive the rounding of $1 + e$: the small steps are still
# lost. The cell evaluates the three forms in float32 (with PyTorch on the CPU, the kernel's formula
# written with torch functions) against float64, and asserts that only the kernel's form is accurate
# over the whole range.

# %%
x_sp = torch.tensor([-30.0, -20.0, -10.0, -3.0, -0.5, 0.0, 0.5, 3.0, 10.0, 20.0, 100.0])   # float32
exact_sp = torch.logaddexp(x_sp.double(), torch.zeros((), dtype=torch.float64))          # log(1 + e^x)
e_sp = torch.exp(-x_sp.abs())
w_sp = 1.0 + e_sp
forms = {
    "log(1 + e^x), literally": torch.log(1.0 + torch.exp(x_sp)),
    "max(x, 0) + log(1 + e^-|x|)": torch.clamp(x_sp, min=0.0) + torch.log(w_sp),
    "the kernel's: Goldberg's log1p": torch.clamp(x_sp, min=0.0)
                                      + torch.where(w_sp == 1.0, e_sp, torch.log(w_sp) * e_sp / (w_sp - 1.0)),
}
sp_errors = {}
for name, value in forms.items():
    sp_errors[name] = ((value.double() - exact_sp).abs() / exact_sp).max().item()
    print(f"{name:32s} largest relative error over x in [-30, 100]: {sp_errors[name]:.1e}")
literal_sp = forms["log(1 + e^x), literally"]
assert torch.isinf(literal_sp[x_sp == 100.0]).all() and (literal_sp[x_sp == -20.0] == 0).all()
assert sp_errors["max(x, 0) + log(1 + e^-|x|)"] > 0.5                # the steps at x = -20, -30 round to 0
assert sp_errors["the kernel's: Goldberg's log1p"] < 1e-6

# %% [markdown]
# **Bad input.** The public function checks its arguments before any kernel runs (`_check_inputs`),
# and the exception names the argument. Each entry below is one bad argument and the words the cell
# expects in the error; the cell prints the error it got.

# %%
good = make_inputs(2, 4, 3, 9, groups=2)
bad_cases = {
    "u must have shape": dict(u=good["u"][0]),
    "delta must have shape": dict(delta=good["delta"][..., :5]),
    "A must be real": dict(A=good["A"].to(torch.complex64)),
    "B: the number of groups": dict(B=torch.randn(2, 3, 3, 9, device=DEVICE)),
    "C must have shape": dict(C=torch.randn(2, 3, 8, device=DEVICE)),
    "B of 2 dimensions (time-invariant) must have shape": dict(B=torch.randn(4, 2, device=DEVICE)),
    "D must have shape": dict(D=torch.randn(5, device=DEVICE)),
    "initial_state must have shape": dict(initial_state=torch.randn(2, 4, 2, device=DEVICE)),
    "u must be float16": dict(u=good["u"].to(torch.int32)),
    "delta must be a torch.Tensor": dict(delta=1.0),
    "all tensors must be on one device": dict(D=torch.randn(4, device="meta")),
}
for message, change in bad_cases.items():
    try:
        chapter_scan(**{**good, **change})
    except (TypeError, ValueError) as error:
        assert message in str(error), (message, str(error))
        print(f"{type(error).__name__:10s} {error}")
    else:
        raise AssertionError(f"no error for {message}")

# %% [markdown]
# **The interpreter's bfloat16.** A GPU converts float32 to bfloat16 by rounding to nearest, an error
# of at most half a unit in the last place, $2^{-8}$ relative (8 significant bits). Triton's CPU
# interpreter truncates the low 16 bits instead, which can cost up to a whole unit, $2^{-7}$. That is
# why chapter 04's `tolerance` (its `UNIT_ROUNDOFF`) takes the bfloat16 bound from `INTERPRET`. The cell casts random
# float32 values with a one-line Triton kernel and asserts which of the two conversions ran: on the
# interpreter, exactly the truncation, with errors above the round-to-nearest bound; on a GPU, exactly
# PyTorch's round to nearest.

# %%
@triton.jit
def cast_to_bfloat16_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, offs < n).to(tl.bfloat16), offs < n)


torch.manual_seed(8)
x_bf = torch.randn(4096, device=DEVICE)
y_bf = torch.empty(4096, device=DEVICE, dtype=torch.bfloat16)
cast_to_bfloat16_kernel[(1,)](x_bf, y_bf, 4096, BLOCK=4096)
truncated = (x_bf.view(torch.int32) & ~0xFFFF).view(torch.float32)    # the low 16 bits dropped
bf_error = ((y_bf.double() - x_bf.double()).abs() / x_bf.double().abs()).max().item()
print(f"Triton's float32 -> bfloat16 {'(interpreter)' if INTERPRET else '(GPU)'}: largest relative error "
      f"{bf_error:.2e}; round to nearest allows {2**-8:.2e}, truncation {2**-7:.2e}")
if INTERPRET:
    assert torch.equal(y_bf.float(), truncated) and 2**-8 < bf_error < 2**-7
else:
    assert torch.equal(y_bf, x_bf.to(torch.bfloat16)) and bf_error <= 2**-8

# %% [markdown]
# **The gradients of a time-invariant `B` or `C`.** Section 4's formulas are for `B`, `C` per position.
# A time-invariant $B$ of shape (dim, N) also sums over the batch and the positions; so does $C$.
#
# **`mamba_ssm`'s last state for a time-invariant `B`.** With `B` of shape (dim, N), $B_n$ is the same at
# every position, so $h_{t,n} / B_n$ obeys the recurrence with input $\Delta_t u_t$ alone.
# `mamba_ssm`'s CUDA kernel scans that, without $B$, and multiplies $B$ into $C$ for the output, so the
# output is the same, but the last state it returns is $h_{L-1} / B$, where its own `selective_scan_ref`
# and ours return $h_{L-1}$. The cell of "Going deeper: against the official kernel" compares our last
# state with theirs times $B$.

# %% [markdown]
# ## References
#
# - Gu and Dao, "Mamba: linear-time sequence modeling with selective state spaces", arXiv:2312.00752, 2023.
# - The mamba_ssm package and its CUDA selective-scan kernel: https://github.com/state-spaces/mamba
# - Smith, Warrington and Linderman, "Simplified state space layers for sequence modeling", ICLR 2023.
# - Sasha Rush, "Mamba: The Hard Way" (a Triton notebook from cumulative sums to the selective scan; part 5): https://srush.github.io/annotated-mamba/hard.html
