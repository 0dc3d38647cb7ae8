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
# Everything so far comes together here. Mamba's S6 layer is the multi-state scan of chapter 04 with
# three twists: the gates are not given but *computed* from a time step $\Delta$ (the
# discretisation), they differ for every channel, state and position (the *selection*), and there are
# thousands of channels in a batch. You will learn:
#
# 1. the discretisation $\bar A = e^{\Delta A}$, $\bar B = \Delta B$ and its derivatives, including the
#    gradient with respect to $\Delta$, which flows through both;
# 2. a float64 PyTorch reference with exactly the semantics of `mamba_ssm`'s `selective_scan_ref`;
# 3. the backward pass derived by hand, checked against autograd;
# 4. a single-sequence Triton kernel that does forward and backward;
# 5. the batched, chunked kernel, laid out as `mamba_ssm`'s CUDA kernel is (time across the threads,
#    the $N$ states as a loop): states stay in registers, only chunk-boundary states are written, and
#    the backward recomputes the rest;
# 6. `scan_lib.selective_scan`, a drop-in for `mamba_ssm`'s `selective_scan_fn` that also takes an
#    `initial_state` (so a long sequence can be processed in pieces), checked gradient by gradient;
# 7. on a GPU: the memory the backward uses, and a benchmark against the official CUDA kernel;
# 8. where this kernel stands against `mamba_ssm` (faster in the fp32 forward, slower in the rest), and why.
#
# The source notebook this course follows stopped at a kernel that only handled lengths that are a
# multiple of its block, one `A` per batch element, compared outputs only (never $d\Delta$), and was
# slower than the official kernel. We fix the first three, and the fourth in part: our forward beats
# `mamba_ssm`'s with fp32 inputs, but with bf16 inputs, and forward plus backward, ours is still slower
# (section 12 gives the measured numbers and the likely reasons); closing that gap is chapter 07's job.

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
# For every batch element, channel $d$ (of `dim`) and state $n$ (of $N$), S6 runs the first-order
# recurrence of chapter 02 over the positions $t = 0 \dots L-1$:
#
# $$h_{t} = \bar A_{t}\, h_{t-1} + \bar B_{t}\, u_{t}, \qquad
#   y_{t} = \sum_n C_{t,n}\, h_{t,n} + D\, u_t, \qquad \text{out}_t = y_t \cdot \operatorname{silu}(z_t)$$
#
# with $h_{-1} = 0$ (or a given initial state). The inputs and their shapes, as `mamba_ssm` lays them out:
#
# | tensor | shape | meaning |
# | --- | --- | --- |
# | `u` | (batch, dim, L) | the input sequence, one per channel |
# | `delta` | (batch, dim, L) | the time step $\Delta$, per channel and position (optionally `softplus(delta + delta_bias)`) |
# | `A` | (dim, N) | continuous-time decay rates, real and negative, shared over batch and time |
# | `B`, `C` | (batch, N, L) or (batch, groups, N, L) | input and output projections, shared by the `dim // groups` channels of a group |
# | `D`, `delta_bias` | (dim,) | skip connection, bias of $\Delta$ |
# | `z` | (batch, dim, L) | gate |
#
# The *selection* is that $\Delta$, $B$ and $C$ depend on the input (they are projections of it, see
# chapter 06): the recurrence can decide, position by position, how much to remember.
#
# ## 2. Discretisation
#
# Mamba thinks of $h$ as a continuous-time system $h'(s) = A\,h(s) + B\,u(s)$ sampled with step $\Delta$.
# Over one step the state decays exactly by $\bar A = e^{\Delta A}$, whatever the input does. If $u$ (and
# $B$) are held constant over the step (the zero-order hold), the input adds exactly
# $\bar B u = (\Delta A)^{-1}(e^{\Delta A} - 1)\,\Delta B\, u$. `mamba_ssm` (and the paper's code) keeps the
# exact $\bar A$ but uses the first-order (Euler) form $\bar B = \Delta B$, which agrees with the zero-order
# hold up to $O(\Delta^2)$: $(\Delta A)^{-1}(e^{\Delta A} - 1) = 1 + \Delta A/2 + O(\Delta^2)$. So one step is
#
# $$a_t = e^{\Delta_t A}, \qquad b_t = \Delta_t\, B_t\, u_t, \qquad h_t = a_t h_{t-1} + b_t .$$
#
# With $A < 0$ and $\Delta > 0$, $0 < a_t < 1$: a large step forgets quickly, a small step keeps the state.
# Its derivatives, which the backward pass needs, are
#
# $$\frac{\partial a}{\partial \Delta} = A\,a, \quad \frac{\partial a}{\partial A} = \Delta\,a, \quad
#   \frac{\partial b}{\partial \Delta} = B u, \quad \frac{\partial b}{\partial B} = \Delta u, \quad
#   \frac{\partial b}{\partial u} = \Delta B .$$
#
# $\Delta$ gets gradient from **both** $a$ and $b$: the source notebook's final test never checked
# it. First, these formulas against autograd, in float64:

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

# %% [markdown]
# A one-line sanity check links this to chapter 02: the exponential moving average
# $h_t = \alpha h_{t-1} + (1-\alpha) x_t$ is the special case $\Delta = 1$, $A = \ln \alpha$, $B = 1-\alpha$.
# The figure shows how $\bar A$ depends on $\Delta$ for a few decay rates: the same $A$ gives
# anything from "keep everything" to "forget at once", depending on the step the model selects.

# %%
alpha = 0.9
x_ema = torch.randn(50, dtype=torch.float64)
a_ema, b_ema = discretize_torch(torch.ones(50, dtype=torch.float64), math.log(alpha), 1 - alpha, x_ema)
h, ema_by_discretisation, ema_direct = 0.0, [], []
h_direct = 0.0
for t in range(50):
    h = a_ema[t] * h + b_ema[t]
    h_direct = alpha * h_direct + (1 - alpha) * x_ema[t]
    ema_by_discretisation.append(h)
    ema_direct.append(h_direct)
assert torch.allclose(torch.stack(ema_by_discretisation), torch.stack(ema_direct), rtol=1e-12)
print("EMA = discretised SSM with delta=1, A=ln(alpha), B=1-alpha: ok")

fig, ax = plt.subplots(figsize=(6, 3.2))
deltas = torch.linspace(0, 3, 200)
for rate in [-0.25, -1.0, -4.0, -16.0]:
    ax.plot(deltas, torch.exp(deltas * rate), label=f"A = {rate:g}")
ax.set_xlabel(r"step $\Delta$")
ax.set_ylabel(r"$\bar A = e^{\Delta A}$")
ax.set_title("How much of the state survives one step")
ax.legend()
save_figure(fig, "05_discretisation.png")
plt.close(fig)

# %% [markdown]
# ![A_bar against delta](../figures/05_discretisation.png)
#
# ## 3. The reference
#
# The oracle for everything below: a plain PyTorch loop over positions in float64, with the semantics
# of `mamba_ssm.ops.selective_scan_interface.selective_scan_ref` (groups, `D`, `z`, `delta_bias`,
# `delta_softplus`, `return_last_state`) plus an `initial_state`. It returns float64 (no cast back
# to `u`'s dtype) so that comparisons measure the kernel's error, not the reference's. It is
# exported, because the tests use it too.

# %%
#| export
"""Mamba's selective scan (S6): float64 reference and the fused Triton kernels behind `selective_scan`."""
import torch
import torch.nn.functional as F


def _expand_groups(M, dim):
    """(batch, N, L) or (batch, groups, N, L) -> (batch, dim, N, L): channel d uses group d // (dim // groups)."""
    if M.dim() == 3:
        M = M.unsqueeze(1)
    return M.repeat_interleave(dim // M.shape[1], dim=1)


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False, initial_state=None):
    """The float64 oracle: mamba_ssm's selective_scan_ref semantics, one position at a time.

    u, delta, z: (batch, dim, L); A: (dim, N); B, C: (batch, N, L) or (batch, groups, N, L);
    D, delta_bias: (dim,); initial_state: (batch, dim, N). Returns out (batch, dim, L) in float64,
    and with return_last_state also the state after the last position (batch, dim, N), float64.
    """
    u, delta, A = u.double(), delta.double(), A.double()
    dim = u.shape[1]
    if delta_bias is not None:
        delta = delta + delta_bias.double()[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    B, C = _expand_groups(B.double(), dim), _expand_groups(C.double(), dim)  # batch x dim x N x L
    a = torch.exp(delta[:, :, :, None] * A[None, :, None, :])               # batch x dim x L x N
    b = (delta * u)[:, :, :, None] * B.transpose(2, 3)                      # batch x dim x L x N
    h = u.new_zeros(u.shape[0], dim, A.shape[1]) if initial_state is None else initial_state.double()
    ys = []
    for t in range(u.shape[2]):
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
# Write $c_t = C_t\, \bar y_t$ for the gradient reaching $h_t$ directly through the output
# ($\bar y = \partial\mathcal L/\partial y$, after the gate), and $G_t = \partial\mathcal L / \partial h_t$
# for the total gradient of the state, which also flows through all later states:
#
# $$G_t = c_t + a_{t+1}\, G_{t+1}, \qquad G_{L-1} = c_{L-1} + \frac{\partial \mathcal L}{\partial h_{L-1}}\Big|_{\text{last\_state}} .$$
#
# This is chapter 03's adjoint: the same first-order scan, run right to left, with the gates
# shifted by one. From $G$, every gradient is local:
#
# $$\frac{\partial\mathcal L}{\partial a_t} = G_t h_{t-1}, \qquad \frac{\partial\mathcal L}{\partial b_t} = G_t,
#   \qquad \frac{\partial \mathcal L}{\partial h_{-1}} = a_0 G_0 \;(\text{the initial state}).$$
#
# Chained through the discretisation ($\partial a/\partial\Delta = A a$, $\partial b/\partial\Delta = B u$, ...),
# summing over whatever the parameter is shared by: the states $n$ for the per-channel $\Delta_t$ and $u_t$,
# the batch and the positions for $A$ and $D$, the channels $d$ of a group for $B_t$ and $C_t$:
#
# $$d\Delta_t = \sum_n \big(G_t\, a_t h_{t-1} A + G_t B_t u_t\big), \quad
#   dA = \sum_{\text{batch},\,t} \Delta_t\, G_t\, a_t h_{t-1}, \quad
#   du_t = D\,\bar y_t + \Delta_t \sum_n G_t B_t, $$
# $$dB_t = \sum_d G_t\, \Delta_t u_t, \quad dC_t = \sum_d \bar y_t\, h_t, \quad dD = \sum_{\text{batch},\,t} \bar y_t u_t .$$
#
# The product $a_t h_{t-1}$ needs the *previous* state. It is tempting to write it as $h_t - b_t$ (true
# in exact arithmetic, and it avoids a shifted copy of $h$), but in floating point that subtraction
# cancels catastrophically whenever $|b_t| \gg |a_t h_{t-1}|$: at $t = 0$ with a zero initial state the
# true value is exactly $0$ while $h_0 - b_0$ is whatever rounding (or an FMA contraction on the GPU)
# left behind. So the kernels below compute $h_{t-1}$ itself, by shifting the recomputed states one
# position along time (the cell after the derivation shows the cancellation).
#
# The two elementwise functions around the scan. The gate $\text{out} = y\,\operatorname{silu}(z) = y\,z\,\sigma(z)$,
# with $\sigma$ the sigmoid and $\sigma' = \sigma(1-\sigma)$, gives
# $\bar y = \overline{\text{out}}\; z\sigma(z)$ and
# $dz = \overline{\text{out}}\; y\,\big(\sigma(z) + z\,\sigma(z)(1-\sigma(z))\big) = \overline{\text{out}}\; y\; \sigma(z)\,\big(1 + z(1 - \sigma(z))\big)$.
# The step is $\Delta = \operatorname{softplus}(\Delta_{\text{raw}} + \text{bias})$ with
# $\operatorname{softplus}(x) = \log(1 + e^x)$, whose derivative is $e^x/(1+e^x) = \sigma(x)$; so
# $d\Delta_{\text{raw}} = d\Delta\; \sigma(\Delta_{\text{raw}} + \text{bias})$ and
# $d\,\text{bias} = \sum_{\text{batch},\,t} d\Delta_{\text{raw}}$ (without the softplus, $d\Delta_{\text{raw}} = d\Delta$).
#
# Here are those formulas as plain PyTorch (one sequence-batch, no groups, for readability),
# checked against autograd of the reference. If this passes, the derivation is right, and the kernels
# only have to implement it.

# %%
def selective_scan_backward_by_hand(u, delta_raw, A, B, C, D, z, delta_bias, h0, dout, dlast):
    """The derived backward for B, C of shape (batch, N, L), softplus on, in float64."""
    pre = delta_raw + delta_bias[:, None]
    delta = F.softplus(pre)                                            # batch x dim x L
    a = torch.exp(delta[..., None] * A[:, None, :])                    # batch x dim x L x N
    b = (delta * u)[..., None] * B.transpose(1, 2)[:, None]            # batch x dim x L x N
    hs, h = [], h0
    for t in range(u.shape[2]):
        h = a[:, :, t] * h + b[:, :, t]
        hs.append(h)
    hs = torch.stack(hs, dim=2)                                        # batch x dim x L x N
    y = (hs * C.transpose(1, 2)[:, None]).sum(-1) + D[:, None] * u    # batch x dim x L
    sig = torch.sigmoid(z)
    dy = dout * z * sig
    dz = dout * y * sig * (1 + z * (1 - sig))
    c = C.transpose(1, 2)[:, None] * dy[..., None]                     # batch x dim x L x N
    G, g = torch.zeros_like(hs), dlast
    for t in reversed(range(u.shape[2])):
        g = c[:, :, t] + g                                             # G_t = c_t + a_{t+1} G_{t+1}
        G[:, :, t] = g
        g = a[:, :, t] * g                                             # what flows into h_{t-1}
    h_prev = torch.cat([h0[:, :, None], hs[:, :, :-1]], dim=2)        # h_{t-1}: shifted by one
    ah = a * h_prev                                                    # a_t h_{t-1}
    ddelta = (G * ah * A[:, None, :]).sum(-1) + u * (G * B.transpose(1, 2)[:, None]).sum(-1)
    ddelta_raw = ddelta * torch.sigmoid(pre)
    return dict(
        u=D[:, None] * dy + delta * (G * B.transpose(1, 2)[:, None]).sum(-1),
        delta=ddelta_raw,
        A=(G * ah * delta[..., None]).sum((0, 2)),
        B=(G * (delta * u)[..., None]).sum(1).transpose(1, 2),
        C=(hs * dy[..., None]).sum(1).transpose(1, 2),
        D=(dy * u).sum((0, 2)),
        z=dz,
        delta_bias=ddelta_raw.sum((0, 2)),
        initial_state=g,
    )


torch.manual_seed(1)
batch, dim, N, L = 2, 3, 4, 9
f64 = dict(dtype=torch.float64)
inputs = dict(u=torch.randn(batch, dim, L, **f64), delta=torch.randn(batch, dim, L, **f64),
              A=-torch.rand(dim, N, **f64) - 0.5, B=torch.randn(batch, N, L, **f64),
              C=torch.randn(batch, N, L, **f64), D=torch.randn(dim, **f64), z=torch.randn(batch, dim, L, **f64),
              delta_bias=torch.randn(dim, **f64), initial_state=torch.randn(batch, dim, N, **f64))
for value in inputs.values():
    value.requires_grad_(True)
out_ref, last_ref = selective_scan_ref(**inputs, delta_softplus=True, return_last_state=True)
dout, dlast = torch.randn_like(out_ref), torch.randn_like(last_ref)
auto = dict(zip(inputs, torch.autograd.grad((out_ref * dout).sum() + (last_ref * dlast).sum(), list(inputs.values()))))
with torch.no_grad():
    by_hand = selective_scan_backward_by_hand(
        inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"], inputs["D"], inputs["z"],
        inputs["delta_bias"], inputs["initial_state"], dout, dlast)
for name in inputs:
    print(f"d{name:14s} max abs err vs autograd {max_err(by_hand[name], auto[name]):.1e}")
    assert torch.allclose(by_hand[name], auto[name], rtol=1e-10, atol=1e-12), name

# %% [markdown]
# Why not $h_t - b_t$: in float32, a small decayed state next to a large input. The subtraction keeps
# only the bits of $a_t h_{t-1}$ that survived the rounding of $h_t$ to the scale of $b_t$; the shifted
# state gives the product to full precision.

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
# ## 5. One sequence in one Triton program
#
# The simplest kernel that is right: one program holds a whole sequence as an $(N \times L)$ tile
# (padded to powers of two), discretises it, and runs `tl.associative_scan` along $L$ with chapter
# 02's `first_order_op`, one independent scan per state. The discretisation is a `@triton.jit`
# helper of its own, exported once and reused by every kernel below.
#
# The backward needs the adjoint, a scan from right to left. Chapter 02 showed two ways to scan right
# to left: `tl.associative_scan(..., reverse=True)` on ordinary loads, or loads in descending order and
# an ordinary scan. This first kernel takes the second, which needs nothing but the forward scan and
# makes the reversal visible in the code: we **load the inputs of the backward in reversed order**, so
# that an ordinary left-to-right scan runs backwards in time. (The batched kernel of section 6 takes the
# first, which was the faster on the H200 in chapter 02.)
# The two shifts of the derivation are handled at load time and with `tl.gather`: the gate $a_{t+1}$
# comes from loading $\Delta$ one position further, and the previous state $h_{t-1}$ is the state tile
# gathered at index $t-1$ (with $h_{-1} = 0$ put in at $t = 0$, exactly, so that $d\bar A_0 = 0$ exactly).
# Only the tile $a_t h_{t-1}$, computed in forward order, is flipped with `tl.flip` to meet the
# reversed adjoint. Padding positions get $\Delta = 0$, i.e. $a = 1$, $b = 0$: the identity
# step, which the scan passes through untouched.

# %%
#| export
import triton
import triton.language as tl

from scan_lib.ema import accumulator_dtype, first_order_op


@triton.jit
def discretize(delta, A, B, u):
    """One S6 step from its continuous-time parameters: a = exp(delta*A), b = (delta*u)*B (broadcasting;
    delta*u first, as in the reference, so that a loop over the states computes it once)."""
    return tl.exp(delta * A), delta * u * B

# %%
@triton.jit
def single_sequence_kernel(U, DELTA, A, B, C, DOUT,          # L, L, N, N x L, N x L, L
                           Y, DU, DDELTA, DA, DB, DC,        # L, L, L, N, N x L, N x L
                           L, N, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr):
    ls = tl.arange(0, BLOCK_L)                               # positions, forward order
    rs = BLOCK_L - 1 - ls                                    # positions, reversed order
    ns = tl.arange(0, BLOCK_N)
    n_ok = ns < N
    A_n = tl.load(A + ns, n_ok, other=0.0)[:, None]          # N x 1
    # Forward: h_t = a_t h_{t-1} + b_t for every state at once, then y_t = sum_n C h.
    u = tl.load(U + ls, ls < L, other=0.0)[None, :]          # 1 x L
    delta = tl.load(DELTA + ls, ls < L, other=0.0)[None, :]  # 1 x L (0 on padding: identity step)
    nl = ns[:, None] * L + ls[None, :]
    nl_ok = n_ok[:, None] & (ls < L)[None, :]
    a, b = discretize(delta, A_n, tl.load(B + nl, nl_ok, other=0.0), u)      # N x L
    _, h = tl.associative_scan((a, b), axis=1, combine_fn=first_order_op)    # N x L
    C_f = tl.load(C + nl, nl_ok, other=0.0)
    tl.store(Y + ls, tl.sum(C_f * h, axis=0), ls < L)
    dout = tl.load(DOUT + ls, ls < L, other=0.0)
    tl.store(DC + nl, h * dout[None, :], nl_ok)               # dC_t = dy_t h_t
    prev = tl.broadcast_to(tl.maximum(ls - 1, 0)[None, :], (BLOCK_N, BLOCK_L))
    h_prev = tl.where(ls[None, :] == 0, 0.0, tl.gather(h, prev, 1))          # h_{t-1}, h_{-1} = 0
    ah = tl.flip(a * h_prev, 1)                              # a_t h_{t-1}, now in reversed order
    # Backward, in reversed order: G_t = c_t + a_{t+1} G_{t+1} is a left-to-right scan here.
    nr = ns[:, None] * L + rs[None, :]
    nr_ok = n_ok[:, None] & (rs < L)[None, :]
    u_r = tl.load(U + rs, rs < L, other=0.0)[None, :]
    delta_r = tl.load(DELTA + rs, rs < L, other=0.0)[None, :]
    delta_next = tl.load(DELTA + rs + 1, rs + 1 < L, other=0.0)[None, :]  # 0 past the end: a = 1
    B_r = tl.load(B + nr, nr_ok, other=0.0)
    c = tl.load(C + nr, nr_ok, other=0.0) * tl.load(DOUT + rs, rs < L, other=0.0)[None, :]
    _, G = tl.associative_scan((tl.exp(delta_next * A_n), c), axis=1, combine_fn=first_order_op)
    GB = tl.sum(G * B_r, axis=0)                                              # L
    tl.store(DDELTA + rs, tl.sum(G * ah * A_n, axis=0) + u_r.reshape(BLOCK_L) * GB, rs < L)
    tl.store(DU + rs, delta_r.reshape(BLOCK_L) * GB, rs < L)
    tl.store(DA + ns, tl.sum(G * ah * delta_r, axis=1), n_ok)
    tl.store(DB + nr, G * delta_r * u_r, nr_ok)


def single_sequence(u, delta, A, B, C, dout):
    """Run the one-program kernel: returns y, du, ddelta, dA, dB, dC for one channel of one sequence."""
    (L,), N = u.shape, A.shape[0]
    y, du, ddelta = (torch.empty_like(u) for _ in range(3))
    dA, dB, dC = torch.empty_like(A), torch.empty_like(B), torch.empty_like(C)
    single_sequence_kernel[(1,)](u, delta, A, B, C, dout, y, du, ddelta, dA, dB, dC, L, N,
                                 BLOCK_L=triton.next_power_of_2(L), BLOCK_N=triton.next_power_of_2(N))
    return y, du, ddelta, dA, dB, dC

# %% [markdown]
# Checked against autograd of the reference (batch 1, one channel), every gradient including
# $d\Delta$, at awkward lengths, with $N = 3$ so the state axis is padded too. Errors are relative to
# the largest magnitude of each reference gradient; at $L = 1$ the reference $dA$ is exactly zero
# ($h_{-1} = 0$), and `rel_err` then demands an exact zero (it returns `inf` otherwise):

# %%
print(f"{'L':>5s} {'y':>9s} {'du':>9s} {'ddelta':>9s} {'dA':>9s} {'dB':>9s} {'dC':>9s}")
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
    print(f"{L:5d} " + " ".join(f"{e:9.1e}" for e in errs))
    assert max(errs) < 1e-5, errs
    if L == 1:
        assert torch.equal(ours[3], torch.zeros_like(ours[3])), ours[3]

# %% [markdown]
# ## 6. The batched, chunked kernel
#
# A real layer has (batch 8, dim 1024, L 2048, N 16): 268 million state values, a gigabyte in
# float32. They must never be written to memory. The work is $\text{batch} \times \text{dim} \times N$ =
# 131 072 independent scans of length $L$; the question is how to spread them over programs, threads
# and loops.
#
# **A first design, and why it was slow.** The first version of this chapter gave each program a
# `BLOCK_D x N x CHUNK` tile (4 channels, all 16 states, 32 positions) and ran `tl.associative_scan`
# along its last axis: states *and* time spread over the threads. It was correct, and 2x slower than
# `mamba_ssm`'s forward on an H200 (about 1190 against 590 us at the size above). Every chunk paid for two
# things that move data between threads: the output $y_t = \sum_n C_{t,n} h_{t,n}$ is a sum over the
# state axis, which lived on other threads (and other warps), and the tree scan ran its
# $\log_2 32 = 5$ levels of warp shuffles for *every* element.
#
# **The design below follows `mamba_ssm`'s CUDA kernel instead, and is 2.5x faster** (section 12):
#
# * **One program per (batch element, channel)** (`BLOCK_D` channels; 1 on a GPU): 8192 programs, about
#   62 for each of the 132 SMs of an H200.
# * **Time is spread over the threads; the $N$ states are a loop.** Each chunk of `CHUNK` positions (512
#   on a GPU) loads `u`, `delta` (bias and softplus fused) as `BLOCK_D x CHUNK` tiles, once. Then, for
#   one state $n$ after another: load row $n$ of `B` and `C`, discretise ($a$ and $b$ of this state
#   only: a `BLOCK_D x CHUNK` tile), scan along time, and add $C_n h$ into $y$. Every thread adds the
#   terms of its own positions, state after state, so $y$ needs no sum across threads at all.
# * **A scan in levels.** Each thread holds several positions (512 positions over the 64 threads of
#   2 warps: 8 each), in runs of consecutive ones (Triton lays contiguous loads out that way, to
#   vectorise them), and Triton's scan first runs over each run of a thread's positions one after
#   another in registers, then over the per-thread totals:
#   a log-depth tree of shuffles within each warp, and one more level between warps through shared
#   memory; finally each thread applies its prefix to its positions. That is the scheme `mamba_ssm`
#   writes by hand; the cost of the upper levels is shared by all the positions of a thread.
# * **What still crosses threads**: per state and chunk, the carry. Reading it (`_column`, a sum over the
#   $N$ columns of the carry tile) and taking the scan's last column as the next carry (a sum over the
#   whole chunk, across warps) are two reductions per state and chunk. Long chunks (512 positions, where
#   the first design used 32) spread that cost thin.
# * **The carry of each state** across chunks is the chunking identity below: folded into the chunk's
#   first step, it makes the scan produce the exact states, and the scan's last column is the carry
#   of state $n$ for the next chunk. The carries of all states form a `BLOCK_D x N` tile in registers.
# * **What training keeps.** When an input needs a gradient, the forward runs with the backward's chunk
#   and writes the carry tile at the start of every chunk: the *boundary states*,
#   `(batch, dim, N, ceil(L / CHUNK))`, $1/\texttt{CHUNK}$ of all the states. When `z` is given it also
#   keeps $y$ before the gate, which $dz$ needs (as `mamba_ssm` does). Inference writes neither.
# * Channels of one block must share a group (so the block loads one `B` row): the launcher shrinks
#   `BLOCK_D` to a power of two dividing `dim // groups` when needed.
# * Lengths need not be multiples of anything: positions past `L` load $\Delta = 0$, the identity step
#   ($a = 1$, $b = 0$).
#
# **The chunking identity.** Unrolling $h_t = a_t h_{t-1} + b_t$ from the state $h_{s-1}$ entering a chunk
# that starts at position $s$:
#
# $$h_t = \underbrace{\Big(\prod_{r=s}^{t} a_r\Big)}_{\hat a_t}\, h_{s-1}
#       + \underbrace{\sum_{q=s}^{t} \Big(\prod_{r=q+1}^{t} a_r\Big) b_q}_{\hat b_t}, \qquad s \le t < s + \texttt{CHUNK}.$$
#
# $(\hat a_t, \hat b_t)$ is exactly the inclusive scan of the pairs $(a_r, b_r)$ under chapter 02's
# `first_order_op`, $(a, b) \circ (a', b') = (a a', a' b + b')$, and $\hat b_t$ alone is the chunk's
# states computed from a zero state. So a scan that knows nothing of the past, plus one multiply-add
# with the carry, give the exact states. The kernel uses the identity in the equivalent form of chapter
# 02's `scan_chunk` (which does it for one row): replace the chunk's first pair $(a_s, b_s)$ by
# $(a_s,\ a_s h_{s-1} + b_s)$, which is the step from the carried state itself; then the scan's $\hat b_t$ *is* $h_t$, and $\hat a_t$ is never used afterwards. (Which
# form is faster we have not measured: the folded one costs a multiply, a select and an add on every
# element of the tile, since the test for the first position is per element; the other one, one
# multiply-add with $\hat a_t$, which the scan computes anyway.) The backward uses
# the same identity on the adjoint, right to left: the gradient $K$ reaching the chunk's last state
# from the chunks to its right is folded into the last position. Padding positions ($a = 1$, $b = 0$,
# $c = 0$) change neither product nor sum.
#
# In plain PyTorch, both forms against the sequential recurrence, with chunks that do not divide the length:

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
# The forward kernel. `_column` reads column $n$ of the carry tile (a masked sum over its $N$ columns;
# registers cannot be indexed by a runtime value), and `tl.where` writes it back.

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
        # log(1 + e^x) = max(x, 0) + log1p(e^-|x|); log1p(e) = log(w) * e / (w - 1) with w = 1 + e
        # keeps full relative precision when e^-|x| is tiny (Goldberg's trick; no log1p in tl).
        e = tl.exp(-tl.abs(pre))
        w = 1.0 + e
        delta = tl.maximum(pre, 0.0) + tl.where(w == 1.0, e, tl.log(w) * e / (w - 1.0))
    return tl.where(mask, delta, 0.0), pre


@triton.jit
def _column(tile, n, cols):
    """tile[:, n] of a BLOCK_D x BLOCK_N tile (cols = its column indices)."""
    return tl.sum(tl.where(cols[None, :] == n, tile, 0.0), axis=1)


@triton.jit
def selective_scan_fwd_kernel(
    U, DELTA, A, B, C, D, Z, BIAS, H0,       # b x d x L, b x d x L, d x N, b x gB x N x L, b x gC x N x L, d, b x d x L, d, b x d x N
    OUT, Y, STATES, LAST,                     # b x d x L, b x d x L (y before the gate), b x d x N x n_chunks, b x d x N
    dim, L, N, n_chunks, groups_b, groups_c,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr,
    SOFTPLUS: tl.constexpr, ACC: tl.constexpr, SAVE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    pid_b, pid_d = tl.program_id(0), tl.program_id(1)
    ds = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)                     # BLOCK_D
    ns = tl.arange(0, BLOCK_N)
    ts = tl.arange(0, CHUNK)
    d_ok, n_ok = ds < dim, ns < N
    dn_ok = d_ok[:, None] & n_ok[None, :]
    # All channels of the block share one group (the launcher makes sure), so one B and C row each.
    B_row = B + (pid_b * groups_b + pid_d * BLOCK_D // (dim // groups_b)) * N * L
    C_row = C + (pid_b * groups_c + pid_d * BLOCK_D // (dim // groups_c)) * N * L
    dl_row = (pid_b * dim + ds) * L                                  # BLOCK_D
    state_offs = (pid_b * dim + ds[:, None]) * N + ns[None, :]       # BLOCK_D x N
    if HAS_H0:
        carry = tl.load(H0 + state_offs, dn_ok, other=0.0).to(ACC)  # BLOCK_D x N
    else:
        carry = tl.zeros((BLOCK_D, BLOCK_N), dtype=ACC)
    if HAS_D:
        D_d = tl.load(D + ds, d_ok, other=0.0).to(ACC)[:, None]
    first, last = ts[None, :] == 0, ts[None, :] == CHUNK - 1
    for k in range(0, n_chunks):
        if SAVE:  # the state entering chunk k, for the backward
            tl.store(STATES + state_offs * n_chunks + k, carry, dn_ok)
        t = k * CHUNK + ts
        t_ok = t < L
        offs = dl_row[:, None] + t[None, :]                          # BLOCK_D x CHUNK
        mask = d_ok[:, None] & t_ok[None, :]
        u = tl.load(U + offs, mask, other=0.0).to(ACC)
        delta, _ = _load_delta(DELTA, BIAS, offs, mask, ds, d_ok, HAS_BIAS, SOFTPLUS, ACC)
        y = tl.zeros((BLOCK_D, CHUNK), dtype=ACC)
        for n in range(0, N):
            A_n = tl.load(A + ds * N + n, d_ok, other=0.0).to(ACC)[:, None]          # BLOCK_D x 1
            B_n = tl.load(B_row + n * L + t, t_ok, other=0.0).to(ACC)[None, :]       # 1 x CHUNK
            C_n = tl.load(C_row + n * L + t, t_ok, other=0.0).to(ACC)[None, :]
            a, b = discretize(delta, A_n, B_n, u)                                     # BLOCK_D x CHUNK
            b += tl.where(first, a * _column(carry, n, ns)[:, None], 0.0)             # start from the carry
            _, h = tl.associative_scan((a, b), axis=1, combine_fn=first_order_op)
            y += C_n * h
            carry = tl.where(ns[None, :] == n, tl.sum(tl.where(last, h, 0.0), axis=1)[:, None], carry)
        if HAS_D:
            y += D_d * u
        if HAS_Z:
            if SAVE:
                tl.store(Y + offs, y, mask)
            zv = tl.load(Z + offs, mask, other=0.0).to(ACC)
            y = y * zv * tl.sigmoid(zv)
        tl.store(OUT + offs, y.to(OUT.dtype.element_ty), mask)
    tl.store(LAST + state_offs, carry, dn_ok)

# %% [markdown]
# The backward kernel walks the chunks right to left with the adjoint carry
# $K = \partial\mathcal L/\partial h$ at the chunk's end, a `BLOCK_D x N` tile (the gradient of
# `last_state` at the start). Per chunk it loads the 2-D inputs once ($u$ and $\Delta$, also one position
# earlier; $\Delta$ also one position later; `dout`, `z` and the kept $y$), writes $dz$, forms
# $dy = \text{dout} \cdot \text{silu}(z)$, and then, state by state:
#
# 1. **The previous states $h_{t-1}$**, as a scan of the steps of the *previous* positions,
#    $(a_{t-1}, b_{t-1})$, whose first pair is $(0, h_{s-1})$, the stored boundary state. The shift by
#    one is done by the loads, not by moving a tile between threads. Then $h_t = a_t h_{t-1} + b_t$,
#    exactly: never $a_t h_{t-1} = h_t - b_t$, whose cancellation gave a wrong $dA$ on the GPU in a
#    first version of this chapter.
# 2. **The adjoint** $G_t = C_t\,dy_t + a_{t+1} G_{t+1}$, by `tl.associative_scan(..., reverse=True)` on
#    the pairs $(a_{t+1}, c_t)$, with $K$ added to $c$ at the chunk's last position. This is chapter 02's
#    reverse recurrence $h_t = a_t h_{t+1} + u_t$ with other names: there the accumulated right part is
#    the *earlier* operand of `first_order_op`, and chapter 02 checks the reverse scan against the loop.
# 3. **The gradients** (section 4): $dC_t \mathrel{+}= h_t\,dy_t$ and $dB_t \mathrel{+}= G_t \Delta_t u_t$;
#    per position, $\sum_n G B$ and $\sum_n G\, a\, h_{t-1} A$, from which $du$ and $d\Delta$ follow after
#    the loop; $dA_n \mathrel{+}= \sum_t G\, a\, h_{t-1} \Delta$; and the new carry
#    $K_n = a_s G_s$ at the chunk's first position $s$.
#
# `dA`, `dD`, `d delta_bias` are accumulated in registers over the whole sequence and written once per
# program (then summed over the batch). `dB`, `dC` are sums over the channels of a group, which live in
# different programs: those are added with `tl.atomic_add` into float32 buffers, as `mamba_ssm` does.
# The order of those additions changes from run to run, so `dB` and `dC` are not bitwise reproducible
# (they agree to float32 rounding), as with `mamba_ssm`. Padding positions past `L` see $\Delta = 0$,
# $B = C = 0$, so they add nothing, but their adjoint is $G = K$, not 0: the kernel zeroes $d\Delta$
# there explicitly before summing it into `d delta_bias`.
# The price of the shifted loads is two more `exp` per element ($a_{t-1}$ and $a_{t+1}$, three in all);
# the alternative, `tl.gather` along time (the first version's choice), moves the tile through shared
# memory. We did not measure the two in isolation.

# %%
#| export
@triton.jit
def _gate_dy(dout, zv, HAS_Z: tl.constexpr):
    """Gradient reaching y through out = y * silu(z)."""
    dy = dout
    if HAS_Z:
        dy = dout * zv * tl.sigmoid(zv)
    return dy


@triton.jit
def _gate_dz(dout, y, zv):
    """Gradient of z in out = y * silu(z): dout * y * sigmoid(z) * (1 + z * (1 - sigmoid(z)))."""
    sig = tl.sigmoid(zv)
    return dout * y * sig * (1.0 + zv * (1.0 - sig))


@triton.jit
def selective_scan_bwd_kernel(
    U, DELTA, A, B, C, D, Z, BIAS, STATES, Y, DOUT, DLAST,  # as in the forward; DOUT b x d x L, DLAST b x d x N
    DU, DDELTA, DZ, DB, DC,                                 # b x d x L (x3), b x gB x N x L, b x gC x N x L (fp32 atomics)
    DA_PART, DD_PART, DBIAS_PART, DH0,                      # b x d x N, b x d, b x d, b x d x N
    dim, L, N, n_chunks, groups_b, groups_c,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DLAST: tl.constexpr,
    SOFTPLUS: tl.constexpr, ACC: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    pid_b, pid_d = tl.program_id(0), tl.program_id(1)
    ds = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    ns = tl.arange(0, BLOCK_N)
    ts = tl.arange(0, CHUNK)
    d_ok, n_ok = ds < dim, ns < N
    dn_ok = d_ok[:, None] & n_ok[None, :]
    B_off = (pid_b * groups_b + pid_d * BLOCK_D // (dim // groups_b)) * N * L
    C_off = (pid_b * groups_c + pid_d * BLOCK_D // (dim // groups_c)) * N * L
    dl_row = (pid_b * dim + ds) * L
    state_offs = (pid_b * dim + ds[:, None]) * N + ns[None, :]
    if HAS_DLAST:
        K = tl.load(DLAST + state_offs, dn_ok, other=0.0).to(ACC)   # dL/dh at the end of the chunk
    else:
        K = tl.zeros((BLOCK_D, BLOCK_N), dtype=ACC)
    D_d = tl.zeros((BLOCK_D,), dtype=ACC)
    if HAS_D:
        D_d = tl.load(D + ds, d_ok, other=0.0).to(ACC)
    dA_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=ACC)
    dD_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    first, last = ts[None, :] == 0, ts[None, :] == CHUNK - 1
    for i in range(0, n_chunks):
        k = n_chunks - 1 - i                                         # chunks from right to left
        t = k * CHUNK + ts
        t_ok = t < L
        prev_ok = (ts > 0) & t_ok                                    # t-1 is in this chunk (and t < L)
        next_ok = (ts < CHUNK - 1) & (t + 1 < L)                     # position t+1 is in this chunk
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
            tl.store(DZ + offs, _gate_dz(dout, tl.load(Y + offs, mask, other=0.0), zv).to(DZ.dtype.element_ty), mask)
        dy = _gate_dy(dout, zv, HAS_Z)
        dD_acc += tl.sum(dy * u, axis=1)
        GB_sum = tl.zeros((BLOCK_D, CHUNK), dtype=ACC)              # sum_n G_t B_t
        GahA_sum = tl.zeros((BLOCK_D, CHUNK), dtype=ACC)            # sum_n G_t a_t h_{t-1} A
        for n in range(0, N):
            A_n = tl.load(A + ds * N + n, d_ok, other=0.0).to(ACC)[:, None]
            B_n = tl.load(B + B_off + n * L + t, t_ok, other=0.0).to(ACC)[None, :]
            B_prev = tl.load(B + B_off + n * L + t - 1, prev_ok, other=0.0).to(ACC)[None, :]
            C_n = tl.load(C + C_off + n * L + t, t_ok, other=0.0).to(ACC)[None, :]
            h_in = tl.load(STATES + ((pid_b * dim + ds) * N + n) * n_chunks + k, d_ok, other=0.0)
            # (1) h_{t-1}: the steps of positions t-1, the first one setting the boundary state.
            a, b = discretize(delta, A_n, B_n, u)
            a_prev, b_prev = discretize(delta_prev, A_n, B_prev, u_prev)
            _, h_prev = tl.associative_scan((tl.where(first, 0.0, a_prev), tl.where(first, h_in[:, None], b_prev)),
                                            axis=1, combine_fn=first_order_op)
            h = a * h_prev + b
            tl.atomic_add(DC + C_off + n * L + t, tl.sum(h * dy, axis=0), t_ok, sem="relaxed")
            # (2) the adjoint, right to left; the carry K enters at the chunk's last position.
            c = C_n * dy + tl.where(last, _column(K, n, ns)[:, None], 0.0)
            _, G = tl.associative_scan((tl.exp(delta_next * A_n), c), axis=1, combine_fn=first_order_op,
                                       reverse=True)
            # (3) the gradients.
            GB_sum += G * B_n
            Gah = G * a * h_prev
            GahA_sum += Gah * A_n
            dA_acc += tl.where(ns[None, :] == n, tl.sum(Gah * delta, axis=1)[:, None], 0.0)
            tl.atomic_add(DB + B_off + n * L + t, tl.sum(G * delta * u, axis=0), t_ok, sem="relaxed")
            K = tl.where(ns[None, :] == n, tl.sum(tl.where(first, a * G, 0.0), axis=1)[:, None], K)
        ddelta = GahA_sum + u * GB_sum
        if SOFTPLUS:
            ddelta = ddelta * tl.sigmoid(pre)
        ddelta = tl.where(mask, ddelta, 0.0)                         # padding: G = K there, not 0
        tl.store(DDELTA + offs, ddelta.to(DDELTA.dtype.element_ty), mask)
        tl.store(DU + offs, (D_d[:, None] * dy + delta * GB_sum).to(DU.dtype.element_ty), mask)
        dbias_acc += tl.sum(ddelta, axis=1)
    tl.store(DA_PART + state_offs, dA_acc, dn_ok)
    tl.store(DH0 + state_offs, K, dn_ok)
    tl.store(DD_PART + pid_b * dim + ds, dD_acc, d_ok)
    tl.store(DBIAS_PART + pid_b * dim + ds, dbias_acc, d_ok)

# %% [markdown]
# The launcher and autograd wrapper. Inputs are made contiguous (a no-op when they already are; a
# differentiable copy otherwise, so non-contiguous views work), the state and every accumulation
# are float32 (float64 when an input is float64), outputs and gradients come back in their input's dtype.
# Whenever an input needs a gradient the forward runs with the backward's chunk and keeps the boundary
# states (and $y$ when there is a `z`); in inference it keeps nothing.

# %%
#| export
def _launch_config(kind, dim, groups_b, groups_c, L):
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
    config.update(block_d=block_d, chunk=min(config["chunk"], max(triton.next_power_of_2(L), 2)))
    return config


def _acc_dtype(*tensors):
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _forward(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, save_chunk):
    """Launch the forward kernel: out, the last state, and, unless save_chunk is None (inference), the
    state entering every chunk of save_chunk positions (batch, dim, N, n_chunks) and y before the gate
    (None without z)."""
    batch, dim, L = u.shape
    N = A.shape[1]
    acc = _acc_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    config = _launch_config("fwd", dim, B.shape[1], C.shape[1], L)
    save = save_chunk is not None
    chunk = save_chunk if save else config["chunk"]
    n_chunks = triton.cdiv(L, chunk)
    out = torch.empty_like(u)
    y = torch.empty(u.shape, device=u.device, dtype=acc) if save and z is not None else None
    states = torch.empty(batch, dim, N, n_chunks, device=u.device, dtype=acc) if save else None
    last = torch.empty(batch, dim, N, device=u.device, dtype=acc)
    selective_scan_fwd_kernel[(batch, triton.cdiv(dim, config["block_d"]))](
        u, delta, A, B, C, D, z, delta_bias, initial_state, out, y, states, last,
        dim, L, N, n_chunks, B.shape[1], C.shape[1],
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        HAS_H0=initial_state is not None, SOFTPLUS=delta_softplus, ACC=accumulator_dtype(acc), SAVE=save,
        BLOCK_D=config["block_d"], BLOCK_N=triton.next_power_of_2(N), CHUNK=chunk,
        num_warps=config["num_warps"])
    return out, last, states, y


class SelectiveScanFn(torch.autograd.Function):
    """out, last_state = S6(u, delta, A, B, C, D, z, delta_bias, initial_state); B, C are 4-D here.
    keep_states: whether the forward keeps boundary states for the backward (False in inference)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, keep_states):
        dim, L = u.shape[1:]
        bwd_chunk = _launch_config("bwd", dim, B.shape[1], C.shape[1], L)["chunk"]
        out, last, states, y = _forward(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus,
                                        bwd_chunk if keep_states else None)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, states, y)
        ctx.delta_softplus, ctx.chunk = delta_softplus, bwd_chunk
        ctx.set_materialize_grads(False)
        return out, last

    @staticmethod
    def backward(ctx, dout, dlast):
        # Grad mode is on in a backward only under create_graph=True; the kernel's gradients carry no
        # graph, so second derivatives would silently miss this scan: refuse loudly instead.
        if torch.is_grad_enabled():
            raise RuntimeError("selective_scan has no double backward: do not use create_graph=True through it")
        u, delta, A, B, C, D, z, delta_bias, initial_state, states, y = ctx.saved_tensors
        batch, dim, L = u.shape
        N, n_chunks = A.shape[1], states.shape[-1]
        config = _launch_config("bwd", dim, B.shape[1], C.shape[1], L)
        acc = states.dtype
        if dout is None:
            dout = torch.zeros_like(u)
        dout = dout.contiguous()
        dlast = None if dlast is None else dlast.contiguous()
        du, ddelta = torch.empty_like(u), torch.empty_like(delta)
        dz = torch.empty_like(z) if z is not None else None
        dB = torch.zeros(B.shape, device=u.device, dtype=acc)
        dC = torch.zeros(C.shape, device=u.device, dtype=acc)
        dA_part = torch.empty(batch, dim, N, device=u.device, dtype=acc)
        dD_part, dbias_part = (torch.empty(batch, dim, device=u.device, dtype=acc) for _ in range(2))
        dh0 = torch.empty(batch, dim, N, device=u.device, dtype=acc)
        selective_scan_bwd_kernel[(batch, triton.cdiv(dim, config["block_d"]))](
            u, delta, A, B, C, D, z, delta_bias, states, y, dout, dlast,
            du, ddelta, dz, dB, dC, dA_part, dD_part, dbias_part, dh0,
            dim, L, N, n_chunks, B.shape[1], C.shape[1],
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
            HAS_DLAST=dlast is not None, SOFTPLUS=ctx.delta_softplus, ACC=accumulator_dtype(acc),
            BLOCK_D=config["block_d"], BLOCK_N=triton.next_power_of_2(N), CHUNK=ctx.chunk,
            num_warps=config["num_warps"])

        def cast(grad, like):
            return None if like is None else grad.to(like.dtype)

        return (du, ddelta, cast(dA_part.sum(0), A), cast(dB, B), cast(dC, C),
                cast(dD_part.sum(0), D), dz, cast(dbias_part.sum(0), delta_bias), cast(dh0, initial_state), None, None)


# %% [markdown]
# The public function validates everything first, with errors that name the argument.

# %%
#| export
from scan_lib.runtime import check_float_tensor, check_same_device


def _check_shape(name, tensor, shape):
    if tensor is not None and tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")


def _check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state):
    if isinstance(A, torch.Tensor) and A.is_complex():
        raise TypeError("complex A is not supported (A must be real, of shape (dim, N))")
    named = dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias, initial_state=initial_state)
    for name, value in named.items():
        if value is not None or name in ("u", "delta", "A", "B", "C"):
            check_float_tensor(name, value)
    if u.dim() != 3:
        raise ValueError(f"u must have shape (batch, dim, L), got {tuple(u.shape)}")
    if u.numel() == 0:
        raise ValueError(f"u must not be empty, got shape {tuple(u.shape)}")
    batch, dim, L = u.shape
    if A.dim() != 2 or A.shape[0] != dim or A.shape[1] == 0:
        raise ValueError(f"A must have shape (dim={dim}, N) with N >= 1, got {tuple(A.shape)}")
    N = A.shape[1]
    for name, M in (("B", B), ("C", C)):
        if M.dim() not in (3, 4) or M.shape[0] != batch or M.shape[-2:] != (N, L):
            raise ValueError(f"{name} must have shape (batch={batch}, N={N}, L={L}) or "
                             f"(batch={batch}, groups, N={N}, L={L}), got {tuple(M.shape)}")
        if M.dim() == 4 and (M.shape[1] == 0 or dim % M.shape[1] != 0):
            raise ValueError(f"{name}: the number of groups ({M.shape[1]}) must divide dim ({dim})")
    for name, value, shape in (("delta", delta, u.shape), ("z", z, u.shape), ("D", D, (dim,)),
                               ("delta_bias", delta_bias, (dim,)), ("initial_state", initial_state, (batch, dim, N))):
        _check_shape(name, value, shape)
    check_same_device(**named)


def _check_index_range(u_shape, N, groups_b, groups_c):
    """The kernels index with 32-bit offsets: refuse inputs whose largest buffer they would overrun.

    The largest are the (batch, dim, L) tensors, the fp32 dB and dC buffers (batch, groups, N, L), and
    the boundary states (batch, dim, N, ceil(L / CHUNK_bwd))."""
    batch, dim, L = u_shape
    bwd = _launch_config("bwd", dim, groups_b, groups_c, L)
    largest = max(batch * dim * L, batch * max(groups_b, groups_c) * N * L,
                  batch * dim * N * triton.cdiv(L, bwd["chunk"]))
    if largest >= 2**31:
        raise ValueError(f"u of shape {tuple(u_shape)} with N={N}: a buffer of {largest} elements needs 64-bit "
                         "offsets, which these kernels do not use yet; split the batch or the sequence "
                         "(initial_state and last_state make the pieces exact)")


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, initial_state=None):
    """Mamba's selective scan (S6), a drop-in for mamba_ssm's selective_scan_fn, plus initial_state.

    u, delta: (batch, dim, L); A: (dim, N) real; B, C: (batch, N, L) or (batch, groups, N, L), channel d
    using group d // (dim // groups); D, delta_bias: (dim,); z: (batch, dim, L);
    initial_state: (batch, dim, N), the state before position 0 (default zeros).

        delta <- softplus(delta + delta_bias) if delta_softplus else delta + delta_bias
        h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t,   y_t = sum_n C_t h_t + D * u_t
        out = y * silu(z) if z is given else y

    Returns out (dtype of u), and with return_last_state also h after the last position (batch, dim, N)
    in float32 (float64 for float64 inputs). Gradients flow to every tensor argument, including
    initial_state and through last_state: scanning a sequence in pieces, each piece starting from the
    previous piece's last_state, gives the same outputs and gradients as one scan.
    """
    _check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    B4 = B.unsqueeze(1) if B.dim() == 3 else B
    C4 = C.unsqueeze(1) if C.dim() == 3 else C
    _check_index_range(u.shape, A.shape[1], B4.shape[1], C4.shape[1])
    contiguous = [None if t is None else t.contiguous()
                  for t in (u, delta, A, B4, C4, D, z, delta_bias, initial_state)]
    keep_states = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in contiguous)
    out, last = SelectiveScanFn.apply(*contiguous, bool(delta_softplus), keep_states)
    return (out, last) if return_last_state else out

# %% [markdown]
# ## 7. Checks: every gradient, every option, awkward lengths
#
# `make_inputs` draws one problem; `check_selective_scan` runs our function and the float64 reference on
# the same (rounded) inputs and compares the output, the last state and all nine gradients, with a
# tolerance relative to each reference's magnitude. The configurations cover groups, `z`, `D`,
# `delta_bias`, softplus and `initial_state`, at lengths 1, 7, 129 and 1000 (never a multiple of the chunk).

# %%
def make_inputs(batch, dim, N, L, groups=None, D=True, z=True, bias=True, h0=True, dtype=torch.float32, seed=0):
    """Random S6 inputs: None for the options left out; B, C 4-D when groups is given."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale + shift).to(device=DEVICE, dtype=dt)

    bc_shape = (batch, N, L) if groups is None else (batch, groups, N, L)
    return dict(u=rand(batch, dim, L), delta=rand(batch, dim, L, scale=0.5, shift=-1.0),
                A=-torch.rand(dim, N, generator=g).add(0.2).to(DEVICE), B=rand(*bc_shape), C=rand(*bc_shape),
                D=rand(dim, dt=torch.float32) if D else None, z=rand(batch, dim, L) if z else None,
                delta_bias=rand(dim, scale=0.3, dt=torch.float32) if bias else None,
                initial_state=rand(batch, dim, N, dt=torch.float32) if h0 else None)


def run_with_grads(fn, inputs, dout, dlast, softplus, cast=None):
    """out, last and the gradient of <out, dout> + <last, dlast> for every given input."""
    leaves = {k: (v if cast is None else v.to(cast)).detach().requires_grad_(True)
              for k, v in inputs.items() if v is not None}
    full = {k: leaves.get(k) for k in inputs}
    out, last = fn(**full, delta_softplus=softplus, return_last_state=True)
    loss = (out.double() * dout).sum() + (last.double() * dlast).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return out, last, dict(zip(leaves, grads))


def check_selective_scan(inputs, softplus=True, tol=2e-5, verbose=True):
    """Compare selective_scan with the float64 reference: output, last state and every gradient (printed),
    and, asserted silently, the inference path (no gradient: the forward's own chunk, nothing kept)."""
    torch.manual_seed(1)
    u = inputs["u"]
    dout = torch.randn(u.shape, dtype=torch.float64, device=DEVICE)
    dlast = torch.randn(u.shape[0], u.shape[1], inputs["A"].shape[1], dtype=torch.float64, device=DEVICE)
    out, last, grads = run_with_grads(scan_lib.selective_scan, inputs, dout, dlast, softplus)
    out_r, last_r, grads_r = run_with_grads(selective_scan_ref, inputs, dout, dlast, softplus, cast=torch.float64)
    assert out.dtype == u.dtype and last.dtype == torch.float32
    errors = {"out": rel_err(out, out_r), "last": rel_err(last, last_r)}
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype and grad.shape == inputs[name].shape, name
        errors["d" + name] = rel_err(grad, grads_r[name])
    if verbose:
        print(f"L={u.shape[2]:5d}: " + "  ".join(f"{k} {v:.0e}" for k, v in errors.items()))
    assert all(e < tol for e in errors.values()), errors
    with torch.no_grad():
        out_ng, last_ng = scan_lib.selective_scan(**inputs, delta_softplus=softplus, return_last_state=True)
    assert rel_err(out_ng, out_r) < tol and rel_err(last_ng, last_r) < tol, "inference path"
    return errors


cases = [  # (batch, dim, N, L, options)
    (2, 4, 3, 1, dict(groups=None)),
    (2, 4, 3, 1, dict(groups=None, h0=False)),  # dA is exactly 0 here: rel_err demands an exact 0
    (2, 6, 4, 7, dict(groups=2, bias=False)),
    (2, 4, 5, 129, dict(groups=None, z=False, h0=False)),
    (1, 8, 3, 129, dict(groups=4, D=False)),
    (1, 2, 2, 1000, dict(groups=None)),
]
for batch, dim, N, L, options in cases:
    check_selective_scan(make_inputs(batch, dim, N, L, **options, seed=L))
check_selective_scan(make_inputs(1, 4, 3, 33, z=False, D=False, bias=False, h0=False), softplus=False)
print("selective_scan matches the float64 reference: outputs and all gradients")

# %% [markdown]
# The launch parameters must not change the result: one channel per program or several, and other chunk
# sizes for either pass (in training the forward runs with the backward's chunk, so the forward's own
# chunk only matters in inference, which `check_selective_scan` also checks).

# %%
ss_module = sys.modules["scan_lib.selective_scan"]  # the module (scan_lib.selective_scan is the function)
fwd_config = ss_module.GPU_FWD_CONFIG if ON_GPU else ss_module.CPU_FWD_CONFIG  # the dicts in use
bwd_config = ss_module.GPU_BWD_CONFIG if ON_GPU else ss_module.CPU_BWD_CONFIG
defaults = dict(fwd=dict(fwd_config), bwd=dict(bwd_config))
variants = [dict(fwd=dict(block_d=1), bwd=dict(block_d=1)), dict(fwd=dict(block_d=4), bwd=dict(block_d=4)),
            dict(fwd=dict(chunk=64), bwd=dict(chunk=32)), dict(fwd=dict(chunk=4), bwd=dict(chunk=64))]
for variant in variants:
    fwd_config.update(variant.get("fwd", {}))
    bwd_config.update(variant.get("bwd", {}))
    print(variant, end=" ")
    check_selective_scan(make_inputs(2, 4, 3, 300 if ON_GPU else 45, groups=2, h0=False, seed=2))
    fwd_config.update(defaults["fwd"])
    bwd_config.update(defaults["bwd"])

# %% [markdown]
# Half precision: `u`, `delta`, `B`, `C`, `z` in bfloat16 or float16, state and sums in float32, the
# output and each gradient in its input's dtype. The reference runs on the same rounded inputs, so the
# error left is the final rounding to 8 (bf16) or 11 (fp16) bits of mantissa.

# %%
for dtype, tol in [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)]:
    inputs = make_inputs(2, 4, 4, 77, groups=2, dtype=dtype, seed=5)
    print(dtype, end=" ")
    check_selective_scan(inputs, tol=tol)

# %% [markdown]
# ## 8. Beyond `mamba_ssm`: scanning in pieces
#
# `initial_state` and the differentiable `last_state` make the scan composable: process a long
# sequence in pieces, each starting from the previous piece's last state, and you get the same outputs
# *and gradients* as in one go (chapter 06 uses this for chunked inference and truncated training).
# Checked in float64, with uneven pieces:

# %%
def scan_in_pieces(pieces, inputs, softplus=True):
    """Run selective_scan piece by piece along L, carrying last_state into the next initial_state."""
    outs, state, start = [], inputs["initial_state"], 0
    for length in pieces:
        sl = slice(start, start + length)
        part = {k: (v[..., sl] if k in ("u", "delta", "z", "B", "C") and v is not None else v) for k, v in inputs.items()}
        part["initial_state"] = state
        out, state = scan_lib.selective_scan(**part, delta_softplus=softplus, return_last_state=True)
        outs.append(out)
        start += length
    return torch.cat(outs, dim=-1), state


torch.manual_seed(3)
base = make_inputs(2, 4, 3, 61, groups=2, dtype=torch.float64, seed=7)
base = {k: (None if v is None else v.double().requires_grad_(True)) for k, v in base.items()}
dout = torch.randn(2, 4, 61, dtype=torch.float64, device=DEVICE)
dlast = torch.randn(2, 4, 3, dtype=torch.float64, device=DEVICE)
results = []
for pieces in ([61], [20, 1, 40], [17, 17, 27]):
    out, last = scan_in_pieces(pieces, base)
    grads = torch.autograd.grad((out * dout).sum() + (last * dlast).sum(), list(base.values()))
    results.append((pieces, out, last, grads))
whole = results[0]
for pieces, out, last, grads in results[1:]:
    errs = [max_err(out, whole[1]), max_err(last, whole[2])] + [max_err(g, w) for g, w in zip(grads, whole[3])]
    print(f"pieces {pieces}: max abs diff vs one piece, out/last/grads: {max(errs):.1e}")
    assert max(errs) < 1e-12

# %% [markdown]
# Bad input gets an exception naming the argument:

# %%
good = make_inputs(2, 4, 3, 9, groups=2)
bad_cases = {
    "u must have shape": dict(u=good["u"][0]),
    "delta must have shape": dict(delta=good["delta"][..., :5]),
    "complex A is not supported": dict(A=good["A"].to(torch.complex64)),
    "B: the number of groups": dict(B=torch.randn(2, 3, 3, 9, device=DEVICE)),
    "C must have shape": dict(C=torch.randn(2, 3, 8, device=DEVICE)),
    "D must have shape": dict(D=torch.randn(5, device=DEVICE)),
    "initial_state must have shape": dict(initial_state=torch.randn(2, 4, 2, device=DEVICE)),
    "u must be float16": dict(u=good["u"].to(torch.int32)),
    "delta must be a torch.Tensor": dict(delta=1.0),
    "all tensors must be on one device": dict(D=torch.randn(4, device="meta")),
}
for message, change in bad_cases.items():
    try:
        scan_lib.selective_scan(**{**good, **change})
    except (TypeError, ValueError) as error:
        assert message in str(error), (message, str(error))
        print(f"{type(error).__name__:10s} {error}")
    else:
        raise AssertionError(f"no error for {message}")

# %% [markdown]
# ## 9. Memory in training
#
# Autograd through the reference would keep every state: `batch x dim x L x N` values. Our forward keeps
# only the boundary states, `batch x dim x N x ceil(L / CHUNK_bwd)` float32 values, and, when `z` is
# given, $y$ before the gate, one `batch x dim x L` float32 tensor (`mamba_ssm` keeps its `out` too, in the
# input dtype: half as many bytes for bf16 inputs); the
# backward recomputes the states chunk by chunk. What the backward allocates on top, at its peak (the
# end, when the gradients are cast to their inputs' dtypes):
#
# $$\underbrace{3\,bdL\,s}_{du,\ d\Delta,\ dz} + \underbrace{2\,bgNL \cdot 4}_{dB,\ dC \text{ in fp32}}
#   + \underbrace{2\,bgNL\,s\,[s \ne 4]}_{\text{their casts}}
#   + \underbrace{(2 bdN + 2bd)\cdot 4}_{\text{partial } dA,\ dh_0,\ dD,\ d\text{bias}}$$
#
# bytes, with $s$ the input element size and $g$ the number of groups (two gradient tensors instead of
# three when there is no `z`; no casts for float32 inputs). For (8, 1024, 2048, N=16) in float32 that
# is about 195 MiB, 192 MiB of it the three gradients that any backward must produce; the forward keeps
# 2 MiB of boundary states (CHUNK_bwd = 512) and 64 MiB of $y$, instead of 1 GiB of states. The cell
# below prints and asserts these numbers.

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


shape = dict(batch=8, dim=1024, L=2048, N=16)
chunk_bwd = GPU_BWD_CONFIG["chunk"]
all_states = shape["batch"] * shape["dim"] * shape["L"] * shape["N"] * 4
y_bytes = math.prod(shape[k] for k in ("batch", "dim", "L")) * 4
print(f"all states: {all_states / 2**20:.0f} MiB; kept by our forward: boundary states (CHUNK_bwd={chunk_bwd}) "
      f"{boundary_state_bytes(**shape, chunk=chunk_bwd) / 2**20:.0f} MiB + y {y_bytes / 2**20:.0f} MiB; "
      f"backward allocations: {backward_extra_bytes(**shape) / 2**20:.0f} MiB")
assert all_states == chunk_bwd * boundary_state_bytes(**shape, chunk=chunk_bwd)
assert chunk_bwd == 512  # the default the text above is about
assert round(boundary_state_bytes(**shape, chunk=chunk_bwd) / 2**20) == 2 and y_bytes == 64 * 2**20
assert round(backward_extra_bytes(**shape) / 2**20) == 195
assert 3 * y_bytes == 192 * 2**20  # du, d delta, dz

fig, ax = plt.subplots(figsize=(6, 3.2))
lengths = [2**k for k in range(8, 18)]
ax.loglog(lengths, [8 * 1024 * L * 16 * 4 / 2**30 for L in lengths], "o-", label="every state (autograd of the loop)")
ax.loglog(lengths, [boundary_state_bytes(8, 1024, L, 16, chunk_bwd) / 2**30 for L in lengths], "s-",
          label=f"boundary states, CHUNK_bwd={chunk_bwd}")
ax.loglog(lengths, [8 * 1024 * L * 4 / 2**30 for L in lengths], "--", color="gray",
          label="one (batch, dim, L) fp32 tensor (y, kept with z)")
ax.set_xlabel("sequence length L")
ax.set_ylabel("GiB kept for the backward")
ax.set_title("batch 8, dim 1024, N 16")
ax.legend(fontsize=8)
save_figure(fig, "05_memory.png")
plt.close(fig)

# %% [markdown]
# ![memory kept for the backward](../figures/05_memory.png)
#
# On a GPU, the measured peak of the backward against that formula, for fp32 and bf16 inputs (the
# cell asserts that they agree within 10%; the committed output is from an H200).

# %%
if not ON_GPU:
    print("skipped: needs a GPU (torch.cuda.max_memory_allocated)")
else:
    for in_dtype in (torch.float32, torch.bfloat16):
        inputs = make_inputs(**{k: shape[k] for k in ("batch", "dim", "N", "L")}, dtype=in_dtype, h0=False)
        leaves = {k: v.requires_grad_(True) for k, v in inputs.items() if v is not None}
        out = scan_lib.selective_scan(**leaves, delta_softplus=True)
        dout = torch.randn_like(out)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out.backward(dout)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - before
        predicted = backward_extra_bytes(**shape, in_size=inputs["u"].element_size())
        print(f"{in_dtype}: backward peak {measured / 2**20:.1f} MiB, formula {predicted / 2**20:.1f} MiB, "
              f"all states would be {all_states / 2**20:.0f} MiB")
        assert 0.9 * predicted <= measured <= 1.1 * predicted + 2**20, (measured, predicted)
        del out, dout, leaves, inputs

# %% [markdown]
# ## 10. Against the official kernel
#
# Where `mamba_ssm` is installed (it needs a CUDA GPU), `selective_scan_fn` and ours should agree on
# outputs, the last state and every gradient, for fp32 inputs with groups, `D`, `z`, `delta_bias`
# and softplus (`initial_state` is ours only).

# %%
def compare_with_mamba_ssm(batch=2, dim=64, N=16, L=1000, groups=2, tol=1e-4):
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except ImportError as error:
        print(f"skipped: mamba_ssm not importable ({error})")
        return None
    if not ON_GPU:
        print("skipped: mamba_ssm's kernel needs a GPU")
        return None
    inputs = make_inputs(batch, dim, N, L, groups=groups, h0=False, seed=11)
    inputs.pop("initial_state")
    dout = torch.randn(batch, dim, L, dtype=torch.float64, device=DEVICE)
    dlast = torch.zeros(batch, dim, N, dtype=torch.float64, device=DEVICE)  # mamba_ssm ignores d last_state
    ours = run_with_grads(scan_lib.selective_scan, inputs, dout, dlast, True)
    theirs = run_with_grads(selective_scan_fn, inputs, dout, dlast, True)
    errors = {"out": rel_err(ours[0], theirs[0]), "last": rel_err(ours[1], theirs[1])}
    errors.update({"d" + k: rel_err(ours[2][k], theirs[2][k]) for k in ours[2]})
    print("ours vs mamba_ssm: " + "  ".join(f"{k} {v:.0e}" for k, v in errors.items()))
    assert all(e < tol for e in errors.values()), errors
    return errors


compare_with_mamba_ssm();

# %% [markdown]
# ## 11. Benchmark (GPU only)
#
# At Mamba's usual layer size (batch 8, dim 1024, L 2048, N 16), softplus, `D`, `z` and `delta_bias`
# on, `A`, `D`, `delta_bias` in fp32; `u`, `delta`, `B`, `C`, `z` in fp32 and then bf16. The memory floor
# is the bytes that must move (inputs read once, outputs written once) over the copy bandwidth measured
# in the same cell. The forward is also bounded by `exp`: one per (batch, dim, L, N) element is 268 million
# of them, about 65 us on an H200's special-function units; our backward computes three per element
# (section 6). The forward is timed without gradients (so
# it writes no boundary states), the forward+backward with all inputs requiring gradients. The launch
# parameters are the defaults of `GPU_FWD_CONFIG` / `GPU_BWD_CONFIG`; `benchmarks/tune_selective_scan.py`
# sweeps them. Whatever the cell prints is the measurement; the committed output and the plot below
# come from an H200.

# %%
def io_bytes(batch, dim, L, N, size, backward):
    """Bytes read and written: u, delta, z, out (+ dout, du, d delta, dz) and B, C (+ dB, dC)."""
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
    print(torch.cuda.get_device_name(), f"(batch, dim, L, N) = {tuple(shape.values())}")
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for in_dtype in (torch.float32, torch.bfloat16):
        inputs = make_inputs(**{k: shape[k] for k in ("batch", "dim", "N", "L")}, dtype=in_dtype, h0=False)
        inputs.pop("initial_state")
        leaves = {k: v.requires_grad_(True) for k, v in inputs.items()}
        dout = torch.randn_like(inputs["u"])
        impls = {"scan_lib": scan_lib.selective_scan}
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
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['dtype']}\n{r['pass']}" for r in rows]
    series = [k for k in ("floor", "scan_lib", "mamba_ssm") if k in rows[0]]
    for i, key in enumerate(series):
        ax.bar([j + 0.27 * (i - 1) for j in range(len(rows))], [r[key] for r in rows], width=0.27, label=key)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("median time (us)")
    ax.set_title(f"selective scan, (8, 1024, 2048, N=16), {torch.cuda.get_device_name()}")
    ax.legend()
    save_figure(fig, "05_benchmark.png")
    plt.close(fig)

# %% [markdown]
# ![selective scan benchmark](../figures/05_benchmark.png)
#
# ## 12. Where we stand
#
# The committed output of section 11's cell, run on an NVIDIA H200 (torch 2.11, Triton 3.6) on
# 2026-11-29 with the default launch parameters, in one table (`do_bench` medians; the floor is the
# cell's, from the copy bandwidth it measured), next to the first design of section 6 (states and time
# both across threads), measured by the same cell earlier the same day:
#
# | inputs, pass | ours | first design | `mamba_ssm` (CUDA) | ours / `mamba_ssm` | memory floor |
# | --- | --- | --- | --- | --- | --- |
# | fp32, forward (no grad) | 476 us | 1188 us | 593 us | 0.80 | 64 us (`exp`-bound: ~65 us) |
# | fp32, forward + backward | 2740 us | 4829 us | 1968 us | 1.39 | 175 us |
# | bf16, forward (no grad) | 458 us | 1187 us | 304 us | 1.51 | 32 us |
# | bf16, forward + backward | 2582 us | 5716 us | 1490 us | 1.73 | 88 us |
#
# Laying the work out as `mamba_ssm` does made the forward 2.5x faster and forward+backward 1.8x
# faster (fp32): our forward now beats the official kernel with fp32 inputs. The launch parameters are
# the best of the sweep in `benchmarks/tune_selective_scan.py` (raw output in
# `benchmarks/results/tune_selective_scan_h200.txt`): one channel per program, chunks of 512, 2 warps
# forward and 4 backward; 8 warps, chunks of 256, 1024 or (forward only) 2048, or two channels per
# program were all slower. Everything else is still slower than `mamba_ssm`, and the table says where
# to look:
#
# * **Our forward does not get faster with fewer bytes; `mamba_ssm`'s does.** bf16 inputs halve the
#   bytes: `mamba_ssm` gets 2x faster (its time scales with what it loads, though at about 9x the memory
#   floor, so it is not bandwidth-bound either), ours 4% faster. So at about 460 us our forward is
#   limited by the instructions it issues (or their latency), not by memory. At about 1.98 GHz, 132 SMs with 128 fp32 lanes issue about
#   $3.3 \cdot 10^{13}$ lane-instructions per second: 460 us is room for about 57 per (batch, dim,
#   position, state) element, where the arithmetic needs about ten (an `exp`, the discretisation, a
#   multiply-add for the recurrence and one for $C h$, the scan's combine). Likely costs, from the
#   design (not yet confirmed by a profiler): per state and chunk, the carry goes in and out through
#   reductions across the whole program (`_column`, and the last column of the scan by a masked sum),
#   and the scan's cross-thread levels; `mamba_ssm` passes the carry as the block scan's running prefix
#   instead.
# * **The backward takes almost five times the forward's time.** It recomputes the states (one `exp`), and
#   computes $a_{t-1}$ and $a_{t+1}$ with two more, runs two scans (states and adjoint) where the
#   forward runs one, and adds $dB$, $dC$ with two `tl.atomic_add` per element (as `mamba_ssm` does;
#   536 million atomic adds at this size). A one-off diagnostic on the same H200 (variants of the
#   backward kept out of the repository because they compute wrong gradients: plain stores instead of the
#   atomic adds, and $\Delta$ itself instead of the two extra `exp`) timed the backward alone at 2248 us,
#   2001 us without the atomics, 2090 us without the extra `exp`, 1872 us without either. So neither is
#   the main cost; by elimination (not measured), probably the two scans per state and the reductions
#   around them are.
#
# What chapter 07 should try, one change at a time and with the tests of this chapter as the guard:
# profile first (Nsight Compute: issued instructions per element, stall reasons, the layout Triton gives
# the tiles); then a cheaper carry (a running prefix instead of two reductions per state and chunk; the
# unfolded form of the chunking identity);
# $a_{t\pm1}$ from $a_t$ by a shift within each thread's positions instead of two more `exp`; the
# `dB`, `dC` sums over channels done in registers for several channels per program before one atomic
# add; and more than one state per loop step, so that independent scans overlap.
#
# ## What we fixed, and what is next
#
# * Any length: positions past `L` are identity steps, so nothing needs to be a multiple of a block.
# * `A` is `(dim, N)`, as in Mamba, not one per batch element; `B`, `C` may be grouped.
# * Every gradient is checked, $d\Delta$ included, against a float64 reference, and (on the H200, by
#   `tests/test_selective_scan.py`) every output and gradient against `mamba_ssm`'s CUDA
#   `selective_scan_fn`; so are the options and half-precision inputs.
# * The backward never stores the `(batch, dim, L, N)` states: it recomputes them per chunk from
#   `1/CHUNK_bwd` as many boundary states (none are written when no gradient is needed), and it computes
#   the previous state $h_{t-1}$ by a scan of its own, never as $h_t - b_t$, whose cancellation gave a
#   wrong $dA$ on the GPU in a first version of this chapter.
# * `initial_state` and a differentiable `last_state` make the scan composable.
#
# * Speed, in part: with fp32 inputs our forward is faster than `mamba_ssm`'s.
#
# Not fixed: the rest of the speed. Forward+backward is about 1.4x slower than `mamba_ssm` with fp32
# inputs, and with bf16 inputs the forward is 1.5x and forward+backward 1.7x slower (section 12).
# Chapter 07 profiles these kernels on the GPU and tunes them, one change at a time.
