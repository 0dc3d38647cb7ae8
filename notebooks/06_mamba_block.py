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
# Chapter 05 built the selective scan. Here it goes to work inside the layer Mamba stacks into a
# language model:
#
# 1. the causal depthwise convolution before the scan, as a Triton kernel;
# 2. the block around the two kernels, with `mamba_ssm`'s parameter names (a `state_dict` loads either
#    way) and the initialisation that keeps it stable;
# 3. inference three ways that agree: the whole sequence, a long prompt in chunks, and one token at a
#    time in constant memory;
# 4. a tiny model that learns the selective-copying task, beside a baseline that cannot.
#
# "Going deeper" at the end holds the engineering.

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
from scan_lib.selective_scan import selective_scan_ref

matplotlib.use("Agg")


def max_err(x, ref):
    """Largest absolute difference, in float64."""
    return (x.double() - ref.double()).abs().max().item()


def rel_err(x, ref):
    """Largest absolute difference relative to the reference's largest magnitude (absolute if that is 0)."""
    scale = ref.double().abs().max().item()
    return max_err(x, ref) / scale if scale else max_err(x, ref)

# %% [markdown]
# ## 1. The block at a glance
#
# A Mamba language model is a stack of residual blocks `h + Mamba(RMSNorm(h))`. One block maps
# `hidden_states` (batch, L, d_model) to the same shape in six steps, with
# $d_{inner} = \text{expand} \cdot d_{model}$ channels inside (`mamba_ssm`'s parameter names in brackets):
#
# 1. **Project up** [`in_proj`]: each position's vector becomes two of $d_{inner}$ channels,
#    $x$ (the signal) and $z$ (the gate).
# 2. **Mix neighbours** [`conv1d`]: a causal depthwise convolution of width `d_conv`, then SiLU.
# 3. **Compute the selection** [`x_proj`, `dt_proj`]: from $x_t$, a step size
#    $\Delta_t = \mathrm{softplus}(W_\Delta\, W_r x_t + b_\Delta)$ per channel and $B_t$, $C_t$ of $N$
#    values each, shared by all channels. $W_r$ is `x_proj`'s first $R$ = `dt_rank`
#    $= \lceil d_{model}/16 \rceil$ rows, its next $2N$ give $B_t$ and $C_t$; `dt_proj` is
#    $W_\Delta$ ($d_{inner} \times R$) with bias $b_\Delta$. This makes the scan *selective*: what to
#    keep, write and read depends on the token.
# 4. **Scan** [`A_log`, `D`]: chapter 05's $h_t = e^{\Delta_t A} h_{t-1} + \Delta_t B_t x_t$,
#    $\bar y_t = C_t \cdot h_t + D x_t$, with $A = -e^{A_{log}}$.
# 5. **Gate**: $y_t = \bar y_t \cdot \mathrm{SiLU}(z_t)$ (fused into the scan).
# 6. **Project down** [`out_proj`]: back to d_model.
#
# Only steps 2 and 4 look across positions: they are the two kernels, the convolution (section 2) and
# chapter 05's scan. The rest are matrix products.

# %% [markdown]
# ## 2. The causal convolution
#
# Before the scan, Mamba mixes each channel with its few predecessors: a **depthwise** convolution
# (a filter per channel) that is **causal** (position $t$ sees $t-K+1, \dots, t$ only). With width $K$
# (2 to 4; Mamba uses 4), weights $w_{d,k}$ and bias $\beta_d$ for channel $d$, it gives chapter 05's
# scan input $u$:
#
# $$u_{t,d} = \mathrm{silu}\Big(\beta_d + \sum_{k=0}^{K-1} w_{d,k}\, x_{t-K+1+k,\,d}\Big),
# \qquad \mathrm{silu}(p) = p\,\sigma(p) = \frac{p}{1 + e^{-p}},$$
#
# where $x_s$ for $s < 0$ is zero, or the `initial_states` (the last $K-1$ inputs of a previous
# piece of the sequence). `mamba_ssm` gets this from the `causal-conv1d` CUDA package; ours, in
# Triton, has the signature of its `causal_conv1d_fn`. The reference is the package's own, on
# `F.conv1d` (`groups=dim`: depthwise; padding $K-1$ on both sides, then keeping the first $L$
# outputs: causal); it heads the library's module, in "Going deeper: the convolution kernels".

# %% [markdown]
# **Why causal.** A language model predicts token $t+1$ from tokens $\le t$; if any layer lets
# position $t$ read $t+1$, training shows the model the answer. A "same" convolution pads
# symmetrically, so its output at $t$ reads $t+1$. The cell changes the input at position 5 and asks
# which outputs moved, with the library's `scan_lib.causal_conv1d` (the next cells write a simpler
# forward kernel):

# %%
from scan_lib.causal_conv1d import causal_conv1d, causal_conv1d_ref, causal_conv1d_update

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
# **A kernel.** One program per (batch element, block of `BLOCK_D` channels, block of `BLOCK_L`
# positions) computes a `BLOCK_D x BLOCK_L` tile of outputs. Tap $k$ reads $x$ shifted by
# $k - K + 1$ positions, so the program loads the tile $K$ times, each load shifted and masked:
# positions before 0 and from $L$ on read zero (this kernel has no `initial_states`).

# %%
@triton.jit
def conv_shifted_kernel(X, WEIGHT, BIAS, OUT, dim, length,   # b x d x L, d x W, d, b x d x L, contiguous
                        WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """out[t] = silu(bias + sum_k w[k] x[t - (WIDTH - 1) + k]) on a BLOCK_D x BLOCK_L tile."""
    b = tl.program_id(0).to(tl.int64)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[:, None]       # BLOCK_D x 1
    ts = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)[None, :]       # 1 x BLOCK_L
    d_ok = ds < dim
    rows = (b * dim + ds) * length                                         # where each channel starts
    acc = tl.zeros((BLOCK_D, BLOCK_L), X.dtype.element_ty) + tl.load(BIAS + ds, d_ok, other=0.0)
    for k in tl.static_range(WIDTH):
        ### BEGIN SOLUTION
        ### HINT: tap k: load w[k] (BLOCK_D x 1, at WEIGHT + ds * WIDTH + k) and x at positions s = ts - (WIDTH - 1) + k (at X + rows + s, masked: zero where s < 0 or s >= length), and add their product to acc
        s = ts - (WIDTH - 1) + k                                           # tap k reads position s
        w_k = tl.load(WEIGHT + ds * WIDTH + k, d_ok, other=0.0)            # BLOCK_D x 1
        acc += w_k * tl.load(X + rows + s, d_ok & (s >= 0) & (s < length), other=0.0)
        ### END SOLUTION
    out = acc / (1.0 + tl.exp(-acc))                                       # silu(p) = p sigma(p)
    tl.store(OUT + rows + ts, out, d_ok & (ts < length))


def conv_shifted(x, weight, bias, block_d=16, block_l=64):
    """silu(causal_conv1d(x, weight, bias)) with the kernel above, for x of shape (batch, dim, L)."""
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    batch, dim, length = x.shape
    out = torch.empty_like(x)
    grid = (batch, triton.cdiv(dim, block_d), triton.cdiv(length, block_l))
    conv_shifted_kernel[grid](x, weight, bias, out, dim, length, WIDTH=weight.shape[1], BLOCK_D=block_d,
                              BLOCK_L=block_l)
    return out

# %% [markdown]
# **The library's kernels.** `scan_lib.causal_conv1d`, used from here on, computes the same function
# with aligned loads, takes `initial_states`, returns the final states and has a backward. "Going
# deeper" checks section 2's kernel against the reference, derives the backward and shows the
# library's kernels with their checks.

# %% [markdown]
# ## 3. The block, piece by piece
#
# Triton's interpreter can check a kernel on the CPU but not train. So the block has two backends
# that compute the same function: `"triton"` (section 2's `scan_lib.causal_conv1d` and chapter 05's
# scan) and `"torch"` (the convolution's reference and the scan as a loop over positions, below).

# %%
#| export
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from scan_lib.causal_conv1d import causal_conv1d, causal_conv1d_ref, causal_conv1d_update
from scan_lib.ema import accumulator_dtype
from scan_lib.runtime import ON_GPU, check_float_tensor, check_same_device
from scan_lib.fast_selective_scan import cdiv, next_power_of_2, selective_scan   # chapter 07's: the package's public op
from scan_lib.selective_scan import _load_delta, discretize


def selective_scan_loop(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                        return_last_state=False, initial_state=None):
    """selective_scan's semantics in plain PyTorch, one position at a time, for B and C of shape
    (batch, N, L). Computes in float32 (float64 for float64 u) and differentiates through autograd."""
    acc = torch.float64 if u.dtype == torch.float64 else torch.float32
    u_acc, delta = u.to(acc), delta.to(acc)
    if delta_bias is not None:
        delta = delta + delta_bias.to(acc)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    a = torch.exp(delta[..., None] * A.to(acc)[:, None, :])                 # batch x dim x L x N
    b = (delta * u_acc)[..., None] * B.to(acc).transpose(1, 2)[:, None]     # batch x dim x L x N
    h = a.new_zeros(a.shape[0], a.shape[1], a.shape[3]) if initial_state is None else initial_state.to(acc)
    states = []
    for a_t, b_t in zip(a.unbind(2), b.unbind(2)):                          # batch x dim x N each
        h = a_t * h + b_t
        states.append(h)
    y = torch.einsum("bdln,bnl->bdl", torch.stack(states, 2), C.to(acc))    # batch x dim x L
    if D is not None:
        y = y + D.to(acc)[:, None] * u_acc
    if z is not None:
        y = y * F.silu(z.to(acc))
    y = y.to(u.dtype)
    return (y, h) if return_last_state else y

# %% [markdown]
# Generation reads one token at a time, so the scan's single step gets a kernel of its own
# (`mamba_ssm`'s `selective_state_update`, without heads). A program takes `BLOCK_D` channels of one
# sequence's state $h$, applies $h \leftarrow e^{\Delta A} h + \Delta B x$ with chapter 05's
# `discretize`, stores it back in place, and reads out $y = C \cdot h + D x$, gated. Chapter 05's
# `_load_delta` adds `dt_bias` and applies softplus (its second result is not needed: `delta, _ =`);
# chapter 02's `accumulator_dtype` gives the kernel's `ACC`, the Triton type it computes in.

# %%
#| export
@triton.jit
def selective_state_update_kernel(
    STATE, X, DT, A, B, C, D, Z, DT_BIAS, OUT,   # STATE: batch x dim x N (updated in place); A: dim x N
    dim, n_states, stride_x, stride_z,                         # row strides of X and Z (stride 1 along dim)
    stride_dt, stride_dt_d, stride_b, stride_b_n, stride_c, stride_c_n,   # DT, B, C: row and element strides
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)                                     # the batch element
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)    # its channels: BLOCK_D
    ns = tl.arange(0, BLOCK_N)
    d_ok, n_ok = ds < dim, ns < n_states
    tile = ds[:, None] * n_states + ns[None, :]                # BLOCK_D x BLOCK_N
    tile_ok = d_ok[:, None] & n_ok[None, :]
    STATE_ROW = STATE + row * dim * n_states
    h = tl.load(STATE_ROW + tile, tile_ok, other=0.0).to(ACC)
    delta, _ = _load_delta(DT + row * stride_dt, DT_BIAS, ds[:, None] * stride_dt_d, d_ok[:, None], ds, d_ok,
                           HAS_BIAS, SOFTPLUS, ACC)            # BLOCK_D x 1
    u = tl.load(X + row * stride_x + ds, d_ok, other=0.0).to(ACC)                       # BLOCK_D
    b_coef = tl.load(B + row * stride_b + ns * stride_b_n, n_ok, other=0.0).to(ACC)     # BLOCK_N
    c_coef = tl.load(C + row * stride_c + ns * stride_c_n, n_ok, other=0.0).to(ACC)     # BLOCK_N
    ### BEGIN SOLUTION
    ### HINT: discretize with A's tile, update h (BLOCK_D x BLOCK_N), store it back in place, and read out y = C . h per channel (BLOCK_D)
    a, b = discretize(delta, tl.load(A + tile, tile_ok, other=0.0).to(ACC), b_coef[None, :], u[:, None])
    h = a * h + b
    tl.store(STATE_ROW + tile, h.to(STATE.dtype.element_ty), tile_ok)
    y = tl.sum(h * c_coef[None, :], axis=1)                    # BLOCK_D
    ### END SOLUTION
    if HAS_D:
        y += tl.load(D + ds, d_ok, other=0.0).to(ACC) * u
    if HAS_Z:
        zv = tl.load(Z + row * stride_z + ds, d_ok, other=0.0).to(ACC)
        y = y * zv * tl.sigmoid(zv)
    tl.store(OUT + row * dim + ds, y.to(OUT.dtype.element_ty), d_ok)


def _check_step_inputs(state, x, dt, A, B, C, D, z, dt_bias):
    named = dict(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    for name, value in named.items():
        if value is not None or name in ("state", "x", "dt", "A", "B", "C"):
            check_float_tensor(name, value)
    if state.dim() != 3:
        raise ValueError(f"state must have shape (batch, dim, N), got {tuple(state.shape)}")
    batch, dim, n_states = state.shape
    shapes = dict(x=(batch, dim), dt=(batch, dim), z=(batch, dim), A=(dim, n_states), B=(batch, n_states),
                  C=(batch, n_states), D=(dim,), dt_bias=(dim,))
    for name, shape in shapes.items():
        if named[name] is not None and tuple(named[name].shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (state is {tuple(state.shape)}), "
                             f"got {tuple(named[name].shape)}")
    if not state.is_contiguous():
        raise ValueError("state must be contiguous: it is updated in place")
    for name in ("x", "z", "A", "D", "dt_bias"):   # dt, B and C may have any strides (the block's are views)
        if named[name] is not None and named[name].stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 along its last dimension, got strides {named[name].stride()}")
    if torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in named.values()):
        raise RuntimeError("selective_state_update is for inference and has no autograd: call it under "
                           "torch.no_grad(), or train through selective_scan")
    check_same_device(**named)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One position of the selective scan, updating `state` in place; mamba_ssm's selective_state_update
    for states without heads. state: (batch, dim, N), contiguous; x, dt, z: (batch, dim); A: (dim, N);
    B, C: (batch, N); D, dt_bias: (dim,); x, z, A, D, dt_bias with stride 1 along their last dimension,
    dt, B, C any strides. Returns y (batch, dim) in x's dtype. Inference only."""
    _check_step_inputs(state, x, dt, A, B, C, D, z, dt_bias)
    batch, dim, n_states = state.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.numel() == 0:   # no batch element or no channel: nothing to launch (Triton's launch alone costs more)
        return out
    block_n = next_power_of_2(n_states)
    block_d = max(1, min(next_power_of_2(dim), 4096 // block_n))
    acc = torch.float64 if state.dtype == torch.float64 or x.dtype == torch.float64 else torch.float32
    selective_state_update_kernel[(batch, cdiv(dim, block_d))](
        state, x, dt, A.contiguous(), B, C, D, z, dt_bias, out, dim, n_states,   # the kernel reads A as dim x N rows
        x.stride(0), 0 if z is None else z.stride(0), *dt.stride(), *B.stride(), *C.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
        ACC=accumulator_dtype(acc), BLOCK_D=block_d, BLOCK_N=block_n)
    return out

# %% [markdown]
# The module. Its constructor takes `mamba_ssm`'s arguments and creates the same parameters, shapes
# and order, so a `state_dict` moves between the two. `ssm_parameters`, the selection (step 3 of
# section 1), is a method of its own so that section 5's baseline can replace it.

# %%
#| export
@dataclass
class InferenceParams:
    """Generation state in the layout mamba_ssm's modules read (mamba_ssm.utils.generation.InferenceParams):
    block `layer_idx` keeps (conv_state, ssm_state) in key_value_memory_dict[layer_idx]; the caller
    advances seqlen_offset by the number of positions fed so far."""
    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Optional[torch.Tensor] = None

    def reset(self, max_seqlen, max_batch_size):
        """Ready for a new prompt, as mamba_ssm's reset: the offset back to 0 (the next call starts
        from zero states; the cached tensors are kept and overwritten)."""
        self.max_seqlen, self.max_batch_size, self.seqlen_offset = max_seqlen, max_batch_size, 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


def features_first(x):
    """(batch, C, L) -> the (C, batch L) matrix a projection multiplies: a view when x is in that layout
    (positions_last's), a copy otherwise."""
    batch, channels, length = x.shape
    return x.transpose(0, 1).reshape(channels, batch * length)


def positions_last(flat, batch, length):
    """features_first's inverse, a view: a projection's output (C, batch L) as (batch, C, L), with
    stride 1 along L, L along the batch and batch L along C."""
    return flat.view(flat.shape[0], batch, length).transpose(0, 1)


class Mamba(nn.Module):
    """The Mamba (S6) block of mamba_ssm.modules.mamba_simple.Mamba: the same constructor arguments,
    parameter names and shapes, forward, step and allocate_inference_cache, on scan_lib's kernels.

    backend: "triton" (scan_lib.causal_conv1d, selective_scan, selective_state_update) or "torch"
    (plain PyTorch, for training on a CPU); None picks "triton" on a GPU and "torch" otherwise.
    use_fast_path is accepted for compatibility and has no effect.
    forward(hidden_states, inference_params): with inference_params, a call at seqlen_offset 0 starts a
    new prompt from zero states, as mamba_ssm's does, whatever the cache holds; a later call continues
    from the states cached under layer_idx, so a prompt can be fed in chunks; either leaves its final
    states there. A single position after the first (seqlen_offset > 0) runs `step`, as in mamba_ssm.
    """

    def __init__(self, d_model, d_state=16, d_conv=4, expand=2, dt_rank="auto", dt_min=0.001, dt_max=0.1,
                 dt_init="random", dt_scale=1.0, dt_init_floor=1e-4, conv_bias=True, bias=False,
                 use_fast_path=True, layer_idx=None, device=None, dtype=None, backend=None):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if backend not in (None, "triton", "torch"):
            raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
        if not 2 <= d_conv <= 4:
            raise ValueError(f"d_conv must be 2, 3 or 4 (the convolution kernel's widths), got {d_conv}")
        self.backend = backend or ("triton" if ON_GPU else "torch")
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank
        self.use_fast_path, self.layer_idx = use_fast_path, layer_idx
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=bias, **factory)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, padding=d_conv - 1,
                                bias=conv_bias, **factory)
        self.activation = "silu"
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False, **factory)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **factory)
        init_dt_proj(self.dt_proj, self.dt_rank, dt_min, dt_max, dt_init, dt_scale, dt_init_floor)
        self.A_log = nn.Parameter(torch.log(s4d_real_A(self.d_inner, d_state, device)))   # float32 always
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))                   # float32 always
        self.D._no_weight_decay = True
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory)

    def ssm_parameters(self, x):
        """x: batch x d_inner x L (the convolution's output) -> delta before dt_proj.bias and softplus
        (batch x d_inner x L), B and C (batch x N x L), in positions_last's layout."""
        batch, _, length = x.shape
        ### BEGIN SOLUTION
        ### HINT: x_proj at every position gives R + 2N values: the low-rank dt (R), B (N) and C (N); delta = dt_proj.weight @ dt (its bias comes later, in the scan). Multiply features_first(x) and view the results with positions_last
        x_dbl = self.x_proj.weight @ features_first(x)                          # (R + 2N) x (batch L)
        dt, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=0)
        delta = self.dt_proj.weight @ dt                                        # d_inner x (batch L)
        return tuple(positions_last(m, batch, length) for m in (delta, B, C))
        ### END SOLUTION

    def forward(self, hidden_states, inference_params=None):
        """hidden_states: batch x L x d_model -> batch x L x d_model."""
        self._check_hidden(hidden_states)
        if inference_params is None:
            return self._sequence(hidden_states)[0]
        conv_state, ssm_state = self._get_states_from_cache(inference_params, hidden_states.shape[0])
        if inference_params.seqlen_offset > 0 and hidden_states.shape[1] == 1:
            return self.step(hidden_states, conv_state, ssm_state)[0]
        if inference_params.seqlen_offset == 0:   # a new prompt: from zeros, not from an old prompt's states
            conv_state.zero_()
            ssm_state.zero_()
        out, new_conv_state, new_ssm_state = self._sequence(hidden_states, conv_state, ssm_state)
        conv_state.copy_(new_conv_state)
        ssm_state.copy_(new_ssm_state)
        return out

    def _sequence(self, hidden_states, conv_state=None, ssm_state=None):
        """The whole sequence, or one chunk continuing from conv_state and ssm_state (then also returns
        the states after it)."""
        batch, length, _ = hidden_states.shape
        xz = self.in_proj.weight @ hidden_states.reshape(batch * length, self.d_model).t()   # 2 d_inner x (batch L)
        if self.in_proj.bias is not None:
            xz = xz + self.in_proj.bias.to(xz.dtype)[:, None]
        x, z = (positions_last(half, batch, length) for half in xz.chunk(2, dim=0))  # batch x d_inner x L
        keep = conv_state is not None
        x_conv = self._conv(x, conv_state[..., 1:].to(x.dtype) if keep else None)
        delta, B, C = self.ssm_parameters(x_conv)
        A = -torch.exp(self.A_log.float())                                      # d_inner x N, negative
        scan = selective_scan if self.backend == "triton" else selective_scan_loop
        y = scan(x_conv, delta, A, B, C, self.D.float(), z=z, delta_bias=self.dt_proj.bias.float(),
                 delta_softplus=True, return_last_state=keep, initial_state=ssm_state)
        y, last_state = y if keep else (y, None)
        out = self.out_proj(features_first(y).t()).view(batch, length, self.d_model)   # batch x L x d_model
        if not keep:
            return out, None, None
        new_conv_state = torch.cat([conv_state, x.to(conv_state.dtype)], dim=-1)[..., -self.d_conv:]
        return out, new_conv_state, last_state

    def _conv(self, x, initial_states=None):
        conv = causal_conv1d if self.backend == "triton" else causal_conv1d_ref
        return conv(x, self.conv1d.weight[:, 0], self.conv1d.bias, initial_states=initial_states,
                    activation=self.activation)

    def step(self, hidden_states, conv_state, ssm_state):
        """One position: hidden_states batch x 1 x d_model; conv_state (batch, d_inner, d_conv) and
        ssm_state (batch, d_inner, N) are updated in place. Returns (out, conv_state, ssm_state)."""
        self._check_hidden(hidden_states)
        if hidden_states.shape[1] != 1:
            raise ValueError(f"step takes one position: hidden_states of shape (batch, 1, {self.d_model}), "
                             f"got {tuple(hidden_states.shape)}")
        self._check_states(hidden_states.shape[0], conv_state, ssm_state)
        x, z = self.in_proj(hidden_states[:, 0]).chunk(2, dim=-1)               # batch x d_inner each
        weight = self.conv1d.weight[:, 0]                                       # d_inner x d_conv
        if self.backend == "triton":   # the cache may have another dtype (allocate_inference_cache(dtype=...))
            x = causal_conv1d_update(x.to(conv_state.dtype), conv_state, weight, self.conv1d.bias,
                                     self.activation).to(x.dtype)
        else:   # shift the window left by one position, append x, and apply the filter
            conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
            conv_state[:, :, -1] = x
            x = (conv_state * weight).sum(-1)                                   # batch x d_inner
            if self.conv1d.bias is not None:
                x = x + self.conv1d.bias
            x = F.silu(x).to(hidden_states.dtype)
        delta, B, C = (p[..., 0] for p in self.ssm_parameters(x[:, :, None]))  # b x d_inner; b x N; b x N
        A = -torch.exp(self.A_log.float())
        if self.backend == "triton":
            y = selective_state_update(ssm_state, x, delta, A, B, C, self.D.float(), z=z,
                                       dt_bias=self.dt_proj.bias.float(), dt_softplus=True)
        else:   # one position of the loop: L = 1
            y, last_state = selective_scan_loop(x[..., None], delta[..., None], A, B[..., None], C[..., None],
                                                self.D.float(), z[..., None], self.dt_proj.bias.float(),
                                                delta_softplus=True, return_last_state=True,
                                                initial_state=ssm_state)
            ssm_state.copy_(last_state)
            y = y[..., 0]
        return self.out_proj(y)[:, None], conv_state, ssm_state

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        """Zero states for generation: conv_state (batch, d_inner, d_conv), ssm_state (batch, d_inner, N),
        in the dtype of conv1d.weight and dt_proj.weight unless dtype is given. Their size does not
        depend on max_seqlen: that is the point."""
        device = self.out_proj.weight.device
        conv_state = torch.zeros(batch_size, self.d_inner, self.d_conv, device=device,
                                 dtype=dtype or self.conv1d.weight.dtype)
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device,
                                dtype=dtype or self.dt_proj.weight.dtype)
        return conv_state, ssm_state

    def _get_states_from_cache(self, inference_params, batch_size):
        if self.layer_idx is None:
            raise ValueError("inference_params needs the block's layer_idx (Mamba(..., layer_idx=i)): the "
                             "states are cached under it")
        cache = inference_params.key_value_memory_dict
        if self.layer_idx not in cache:
            cache[self.layer_idx] = self.allocate_inference_cache(batch_size, inference_params.max_seqlen)
        conv_state, ssm_state = cache[self.layer_idx]
        self._check_states(batch_size, conv_state, ssm_state)
        return conv_state, ssm_state

    def _check_hidden(self, hidden_states):
        check_float_tensor("hidden_states", hidden_states)
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.d_model:
            raise ValueError(f"hidden_states must have shape (batch, L, d_model={self.d_model}), "
                             f"got {tuple(hidden_states.shape)}")
        weight = self.in_proj.weight
        if hidden_states.dtype != weight.dtype and not torch.is_autocast_enabled(hidden_states.device.type):
            raise TypeError(f"hidden_states must have the block's dtype {weight.dtype} (or run under "
                            f"torch.autocast), got {hidden_states.dtype}")
        if hidden_states.shape[1] == 0:   # a batch of 0 gives an empty result; no positions is refused,
            # as F.conv1d (the torch backend's convolution) refuses them
            raise ValueError(f"hidden_states must hold at least one position, got shape {tuple(hidden_states.shape)}")

    def _check_states(self, batch_size, conv_state, ssm_state):
        for name, state, shape in (("conv_state", conv_state, (batch_size, self.d_inner, self.d_conv)),
                                   ("ssm_state", ssm_state, (batch_size, self.d_inner, self.d_state))):
            check_float_tensor(name, state)
            if tuple(state.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(state.shape)}")
            if not state.is_contiguous():
                raise ValueError(f"{name} must be contiguous: it is updated in place")

# %% [markdown]
# The constructor's helpers `s4d_real_A` and `init_dt_proj` start $A$ negative and $\Delta$ in
# $[\Delta_{min}, \Delta_{max}]$, which keeps the scan stable: "Going deeper: the initialisation".
# "Going deeper: the block on both backends" checks that the two backends compute the same function.

# %% [markdown]
# ## 4. Inference three ways
#
# A Transformer generating text keeps every past key and value: its cache grows with the sequence.
# The block continues from two small states: the last `d_conv` inputs of the convolution and the
# scan's $h$ (d_inner x N). So three ways to run it must agree: **the whole sequence** at once
# (training, or a short prompt); **chunks**, a long prompt fed in pieces, each starting from the states
# the previous piece left; and **one token at a time**, `step`, which updates both states in place (on
# a GPU with `selective_state_update`). "Going deeper: inference three ways" checks that they agree to
# rounding; "Going deeper: generation's cost" times a step against an attention layer's.

# %% [markdown]
# ## 5. A model that learns: selective copying
#
# The Mamba paper motivates selection with a synthetic task, *selective copying* (Gu & Dao 2023,
# section 4.1.1). A sequence of `L` positions holds `n_data` data tokens at random positions among
# blank tokens; then come `n_data` markers, and at the $k$-th marker the model must output the $k$-th
# data token. Only the markers are scored. The data tokens' positions change from one sequence to the
# next, so the gaps between them have no fixed length.

# %% [markdown]
# **Why this needs selection.** Fix $\Delta$, $B$ and $C$ (the same at every position, whatever the
# input) and each channel's scan becomes *time-invariant* (LTI): unrolling
# $h_t = a h_{t-1} + \Delta B u_t$, with $a = e^{\Delta A}$, gives a fixed convolution over positions,
#
# $$\bar y_t = \sum_{s \le t} k_{t-s}\, u_s + D u_t, \qquad k_j = \sum_n C_n\, e^{j \Delta A_n}\, \Delta B_n .$$
#
# The weight $k_{t-s}$ of token $s$ at position $t$ depends only on the distance $t - s$, never on the
# tokens between. Small blank values $u_s$ do not help: a decaying kernel weighs the $k$-th data token
# by the random number of positions after it, and one that does not decay ($a \approx 1$) sums the
# data tokens in no order. A selective scan computes $\Delta_t$, $B_t$ and $C_t$ from the token, so it
# can, for instance, take $\Delta_t$ near 0 on a blank ($a_t \approx 1$, $b_t \approx 0$: the state
# passes untouched) and a large $\Delta_t$ on a data token, which is written in: the state evolves only
# on the data tokens, however long the gaps. Training finds its own mix of $\Delta$, $B$ and $C$.
#
# The model: an embedding, `n_layers` residual blocks
# $x \leftarrow x + \mathrm{Mamba}(\mathrm{RMSNorm}(x))$ (here one; "Going deeper: selective copying"
# says why), a final RMSNorm and a linear head. The baseline's block is LTI: a subclass of
# `scan_lib.Mamba` whose `ssm_parameters` returns learned constants. All else is shared, so the two
# differ only in the selection.

# %% [markdown]
# **The result.** Both models train alike (AdamW with warm-up and cosine decay, cross-entropy on the
# scored positions, the same batches, the same starting weights where they share a parameter) and are
# scored on a held-out batch. In the recorded run the selective model copies every slot; the baseline
# gets 0.472 of the tokens (chance is 0.125), from 0.32 at the first marker to 0.65 at the last, where
# the answer is the most recent data token, the one a decaying kernel weighs most. "Going deeper:
# selective copying" has the code (it asserts at least 90% for the selective model, at most 70% for
# the baseline), the training curves, and the trained model generating token by token through `step`.

# %% [markdown]
# ## 6. On the GPU: one block against `mamba_ssm`'s
#
# With the same weights, `scan_lib.Mamba` and `mamba_ssm`'s `Mamba` agree in outputs and every
# gradient at the size of a small language model's layer (batch 8, L 2048, d_model 1024), in float32
# and bfloat16. In the recorded run ours is the faster in every row, forward and forward+backward,
# against both of `mamba_ssm`'s paths; the widest gap is bfloat16's training step, where `mamba_ssm`
# takes 1.14 to 1.22 times as long. "Going deeper: one block against `mamba_ssm`'s" has the code, every
# ratio and the fine print.

# %% [markdown]
# ## Going deeper

# %% [markdown]
# ### Section 2's kernel against the reference
#
# `conv_shifted` matches the reference in float64 at every width and at shapes that leave blocks
# partly empty (one position; odd channel counts; a length that ends inside a block), to rounding:
# both sides sum the same few terms.

# %%
for width in (2, 3, 4):
    errors = []
    for batch, dim, length in ((1, 1, 1), (2, 5, 7), (3, 19, 129)):
        g = torch.Generator().manual_seed(width * length)
        x, weight, bias = (torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE)
                           for shape in ((batch, dim, length), (dim, width), (dim,)))
        errors.append(rel_err(conv_shifted(x, weight, bias), causal_conv1d_ref(x, weight, bias, activation="silu")))
    print(f"width {width}: relative errors " + "  ".join(f"{e:.1e}" for e in errors))
    assert max(errors) < 1e-12, (width, errors)

# %% [markdown]
# ### The initialisation: the code, a check, and the sketch's two bugs
#
# Two parameters start at special values, to keep $h_t = e^{\Delta_t A} h_{t-1} + \Delta_t B_t x_t$
# stable and useful from the first step.
#
# **$A$ negative.** $A = -e^{A_{log}}$ is negative whatever $A_{log}$ learns, so $e^{\Delta A}$ lies in
# $(0, 1)$: every state decays. At the start $A_{:,n} = -(n+1)$ for $n = 0 \dots N-1$ (S4D-real): some
# states hold long context and some short.
#
# **$\Delta$ in $[\Delta_{min}, \Delta_{max}]$.** `dt_proj.weight` starts small, so $\Delta$ starts near
# $\mathrm{softplus}(b_\Delta)$. Drawing $\Delta_0$ log-uniformly in $[\Delta_{min}, \Delta_{max}]$
# (default $[10^{-3}, 10^{-1}]$) and setting $b_\Delta = \Delta_0 + \log(1 - e^{-\Delta_0})$,
# softplus's inverse, gives channels that remember for about $1/\Delta$ steps, ten to a thousand
# positions. The constructor calls the two helpers below; the cells after them check both and show
# what goes wrong without them.

# %%
#| export
def s4d_real_A(d_inner, d_state, device=None):
    """The S4D-real initial -A: (1, 2, ..., N) for every channel (A = -exp(A_log) = -(1..N))."""
    return torch.arange(1, d_state + 1, dtype=torch.float32, device=device).repeat(d_inner, 1)


def inverse_softplus(y):
    """x with softplus(x) = y, for y > 0: y + log(1 - exp(-y)), written with expm1 for small y."""
    return y + torch.log(-torch.expm1(-y))


def init_dt_proj(dt_proj, dt_rank, dt_min=0.001, dt_max=0.1, dt_init="random", dt_scale=1.0, dt_init_floor=1e-4):
    """mamba_ssm's initialisation of dt_proj: small weights, and a bias that puts softplus(bias)
    log-uniformly in [dt_min, dt_max] (never below dt_init_floor)."""
    std = dt_rank ** -0.5 * dt_scale
    if dt_init == "constant":
        nn.init.constant_(dt_proj.weight, std)
    elif dt_init == "random":
        nn.init.uniform_(dt_proj.weight, -std, std)
    else:
        raise ValueError(f"dt_init must be 'random' or 'constant', got {dt_init!r}")
    log_dt = torch.rand(dt_proj.out_features, device=dt_proj.bias.device, dtype=dt_proj.bias.dtype)
    dt = torch.exp(log_dt * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_init_floor)
    with torch.no_grad():
        dt_proj.bias.copy_(inverse_softplus(dt))
    dt_proj.bias._no_reinit = True

# %% [markdown]
# **A check.** The initialisation on a fresh block: $\mathrm{softplus}(b_\Delta)$ lies in
# $[\Delta_{min}, \Delta_{max}]$, `inverse_softplus` inverts softplus, and $A_{:,n} = -(n+1)$, all
# negative. The histogram shows the initial step sizes, log-uniform.

# %%
torch.manual_seed(0)
block = Mamba(d_model=64, d_state=16, backend="torch")
dt0 = F.softplus(block.dt_proj.bias.detach())
assert 0.001 * (1 - 1e-5) <= dt0.min() and dt0.max() <= 0.1 * (1 + 1e-5), "softplus(bias) outside [dt_min, dt_max]"
assert torch.allclose(inverse_softplus(F.softplus(torch.linspace(-5, 5, 11))), torch.linspace(-5, 5, 11), atol=1e-5)
A = -torch.exp(block.A_log.detach())
assert torch.allclose(A[0], -torch.arange(1.0, 17.0), rtol=1e-6) and (A < 0).all()
print(f"softplus(dt bias) in [{dt0.min():.4f}, {dt0.max():.4f}]; A[0] = {A[0, :4].tolist()} ... {A[0, -1].item()}")
fig, ax = plt.subplots(figsize=(7, 3))
ax.hist(dt0.log10().numpy(), bins=20, color="tab:blue")
ax.set(xlabel=r"$\log_{10} \Delta_0$ per channel", ylabel="channels",
       title=r"initial step sizes: log-uniform in $[\Delta_{min}, \Delta_{max}]$")
save_figure(fig, "06_dt_init.png")

# %% [markdown]
# **What goes wrong without them.** The source sketch this chapter started from uses
# $A$ = `torch.rand(d_model, d_state) * 0.1`: positive. Then $e^{\Delta A} > 1$ and every state *grows*
# at every position, whatever the input. The cell runs the scan 4096 positions with $A = -(1..N)$ and
# with the sketch's $A$, all else the same.

# %%
def state_norms(A, length=4096, d_inner=32, d_state=16, seed=0):
    """max |h_t| over channels and states, at every position, for the block's initial dt and A."""
    torch.manual_seed(seed)
    init = Mamba(d_model=d_inner // 2, d_state=d_state, backend="torch")
    u = torch.randn(1, d_inner, length)
    delta = F.softplus(init.dt_proj.bias.detach())[None, :, None].expand(1, d_inner, length)
    B = torch.randn(1, d_state, length)
    a = torch.exp(delta[..., None] * A[:, None, :])[0]                       # d_inner x L x N
    b = (delta * u)[0, :, :, None] * B[0].T[None]
    h, norms = torch.zeros(d_inner, d_state), []
    for t in range(length):
        h = a[:, t] * h + b[:, t]
        norms.append(h.abs().max().item())
    return norms


torch.manual_seed(1)
stable = state_norms(-s4d_real_A(32, 16))
sketch = state_norms(torch.rand(32, 16) * 0.1)
print(f"max |h| at the last position: A = -(1..N): {stable[-1]:.3g};  the sketch's positive A: {sketch[-1]:.3g}")
assert max(stable) < 10 and sketch[-1] > 1e6 * stable[-1]
fig, ax = plt.subplots(figsize=(7, 3))
ax.semilogy(stable, label=r"$A = -(1..N)$: $e^{\Delta A} < 1$")
ax.semilogy(sketch, label=r"positive $A$: $e^{\Delta A} > 1$")
ax.set(xlabel="position t", ylabel=r"max $|h_t|$", title="a positive A makes every state grow")
ax.legend()
save_figure(fig, "06_positive_A.png")

# %% [markdown]
# The sketch's second bug: it takes $C$ as `x_proj(x)[..., d_state:]`, the same slice as $B$, so the
# block can only read a state in the direction it writes it. The block's $B$ and $C$ come from disjoint
# rows of `x_proj`.

# %%
torch.manual_seed(0)
d_model, d_state = 16, 4
sketch_x_proj = nn.Linear(d_model, 2 * d_state)
x = torch.randn(3, 10, d_model)
delta_in, B_sketch = sketch_x_proj(x).split(d_state, dim=-1)
C_sketch = sketch_x_proj(x)[..., d_state:]
assert torch.equal(C_sketch, B_sketch)
block = Mamba(d_model=d_model, d_state=d_state, backend="torch")
_, B_ours, C_ours = block.ssm_parameters(torch.randn(3, block.d_inner, 10))
assert not torch.allclose(B_ours, C_ours)
print("the sketch's C is its B: True;  the block's B and C differ: True")

# %% [markdown]
# With $C_t = B_t$, at the current position the output gets $\Delta_t x_t \lVert B_t\rVert^2 \geq 0$, a
# term whose sign the block cannot choose. The block's `x_proj` has $R + 2N$ outputs, so its $B$ and $C$
# are independent.

# %% [markdown]
# ### The block on both backends: the check
#
# With the same weights, the float32 `"triton"` block must match the float64 `"torch"` block, output
# and every parameter's gradient, at awkward lengths, to $10^{-4}$ relative to the largest value.
# ("The block: layouts, caches and what `mamba_ssm` does differently" below checks the `state_dict`'s
# names and shapes against `mamba_ssm`'s.)

# %%
def compare_backends(length, d_model, d_state, batch=2, seed=0):
    """Max relative error of the float32 triton block against the float64 torch block: output and grads."""
    torch.manual_seed(seed)
    reference = Mamba(d_model, d_state=d_state, bias=True, backend="torch", device=DEVICE, dtype=torch.float64)
    with torch.no_grad():   # an A that is not the initial one, to catch a wrong index into A
        reference.A_log.add_(0.3 * torch.randn_like(reference.A_log))
    block = Mamba(d_model, d_state=d_state, bias=True, backend="triton", device=DEVICE)
    block.load_state_dict(reference.state_dict())
    hidden = torch.randn(batch, length, d_model, device=DEVICE, dtype=torch.float64)
    errors = {}
    outputs = [m(hidden.to(dtype)) for m, dtype in ((reference, torch.float64), (block, torch.float32))]
    errors["out"] = rel_err(outputs[1], outputs[0])
    weight = torch.randn_like(outputs[0])
    for m, out in zip((reference, block), outputs):
        (out * weight.to(out.dtype)).sum().backward()
    for (name, p), q in zip(reference.named_parameters(), block.parameters()):
        errors[name] = rel_err(q.grad, p.grad)
    return errors


sizes = dict(d_model=64, d_state=16, batch=2) if ON_GPU else dict(d_model=4, d_state=4, batch=1)
for length in (1, 7, 129, 1000) if ON_GPU else (1, 7, 40):
    errors = compare_backends(length, **sizes)
    worst = max(errors, key=errors.get)
    print(f"L={length:5d}: out {errors['out']:.1e}, worst of output and gradients: {worst} {errors[worst]:.1e}")
    assert max(errors.values()) < 1e-4, errors

# %% [markdown]
# ### The convolution's backward, derived
#
# Section 2's kernel computes the forward only; training also needs the gradients, which the library's
# backward kernel (next subsection) computes. Their formulas:
#
# **The backward.** Write $p_{t,d}$ for the pre-activation, the argument of silu
# ($u = \mathrm{silu}(p)$). The incoming gradient through the activation is
#
# $$g_t = \frac{\partial\mathcal{L}}{\partial p_t} = \frac{\partial\mathcal{L}}{\partial u_t}\,
# \mathrm{silu}'(p_t), \qquad \mathrm{silu}'(p) = \sigma(p)\big(1 + p\,(1 - \sigma(p))\big).$$
#
# Input $x_s$ appears in the outputs $t = s, \dots, s+K-1$, as the term $k = s - t + K - 1$, so
#
# $$\frac{\partial\mathcal{L}}{\partial x_s} = \sum_{j=0}^{K-1} w_{K-1-j}\, g_{s+j}
# \qquad (g_t = 0 \text{ for } t \ge L):$$
#
# the same convolution with the **flipped** filter, run **forward** in time. The initial states are
# the inputs at $s = -K+1, \dots, -1$, so the same formula gives their gradients, with only the terms
# $s + j \ge 0$. Numbering them $h^0_i = x_{i-K+1}$, $i = 0, \dots, K-2$, and substituting
# $k = K-1-j$:
#
# $$\frac{\partial\mathcal{L}}{\partial h^0_{i}} = \sum_{k=0}^{i} w_{k}\, g_{i-k}.$$
#
# The weight and bias gradients sum over every batch element and position:
#
# $$\frac{\partial\mathcal{L}}{\partial w_{d,k}} = \sum_{b,\,t} g_{b,t,d}\; x_{b,\,t-K+1+k,\,d},
# \qquad \frac{\partial\mathcal{L}}{\partial \beta_d} = \sum_{b,\,t} g_{b,t,d}.$$
#
# A gradient arriving through the final states (the last $K-1$ columns of `cat(initial_states, x)`)
# flows straight into the inputs they copied: the last $K-1$ columns of $x$, or initial states when
# $L < K-1$.

# %% [markdown]
# ### The convolution kernels
#
# This is the code of `scan_lib.causal_conv1d`: the module's first cell (section 2's reference and the
# imports), the forward and backward kernels (their window sum, `_window_sum`, is section 2's loop
# over taps), their checks against the reference, the launchers, the one-token update, half precision
# and the `causal-conv1d` package.
#
# **Aligned runs.** Section 2's kernel loads the tile $K$ times, shifted, and a shifted load is not
# aligned to 16 bytes. These kernels use aligned loads only. They cut a tile's positions into
# **runs** of `ITEMS` consecutive positions, 16 bytes' worth (8 in bfloat16, 4 in float32), each
# thread holding whole runs. Output item $i$ of a run needs inputs at items $i-K+1, \dots, i$ of the
# same run and, for $i < K-1$, the last items of the run before. So the forward kernel loads the tile
# twice, where it is and one run earlier, and picks every term from one of the two with no data
# movement: `items_of` (from chapter 07) turns a `BLOCK_D x BLOCK_L` tile into `ITEMS` tiles of
# `BLOCK_D x RUNS`, the $i$-th holding item $i$ of every run, and `positions_of` turns them back.
# `_around` picks the item $m$ positions from a run's start, from the run before it ($m < 0$) or after
# it ($m \ge$ `ITEMS`). `_x_at` handles the padding, reading `initial_states` before position 0. The
# first block of positions also writes the final states, the last $K-1$ columns of
# `cat(initial_states, x)`: the next piece's `initial_states`.
#
# **The imports.** Besides the reference, the module's first cell (the next one) imports what the
# launchers need: `accumulator_dtype` (chapter 02's map from a torch dtype to the Triton dtype a kernel
# sums in), `custom_op` and `apply` (the runtime's custom-operator and autograd plumbing, taught in
# chapter 03's "Going deeper"), `_vmap_by_loop` (chapter 05's vmap rule; below), and from chapter 07's
# module the helpers its fast kernels share with these (`items_of`, `positions_of`, introduced above;
# `LOG2E`; `cdiv` and `next_power_of_2` in plain Python, which cost less per call than Triton's).

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
from scan_lib.runtime import INTERPRET, apply, check_float_tensor, check_same_device, custom_op, plus, zero_in_graph
from scan_lib.selective_scan import _vmap_by_loop   # a vmap rule: one call per vmapped element, stacked
from scan_lib.selective_scan import _NoSecondDerivative as _SelectiveScanNoSecondDerivative   # chapter 05's
from scan_lib.fast_selective_scan import LOG2E, cdiv, items_of, next_power_of_2, positions_of   # chapter 07's


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
def _x_items(X_ROW, H0_ROW, s, d_ok, length, stride_xl, stride_hl, WIDTH: tl.constexpr, HAS_H0: tl.constexpr,
             ACC: tl.constexpr, RUNS: tl.constexpr, ITEMS: tl.constexpr):
    """_x_at at positions s (1 x BLOCK_L, RUNS runs of ITEMS) as ITEMS tiles BLOCK_D x RUNS: item i of every run."""
    return items_of(_x_at(X_ROW, H0_ROW, s, d_ok, length, stride_xl, stride_hl, WIDTH, HAS_H0, ACC), RUNS, ITEMS)


@triton.jit
def _seq_items(SEQ_ROW, s, length, stride_sl, RUNS: tl.constexpr, ITEMS: tl.constexpr):
    """seq_idx at positions s (1 x BLOCK_L) as ITEMS tiles 1 x RUNS; -1 (no sequence) outside 0 <= s < L."""
    return items_of(tl.load(SEQ_ROW + s * stride_sl, (s >= 0) & (s < length), other=-1), RUNS, ITEMS)


@triton.jit
def _around(before, run, after, m: tl.constexpr, ITEMS: tl.constexpr):
    """Item m of every run, counted from the run's first position (each argument: ITEMS tiles, item by
    item): from the run before it for m < 0, from the run after it for m >= ITEMS."""
    if m < 0:
        return before[ITEMS + m]
    elif m < ITEMS:
        return run[m]
    else:
        return after[m - ITEMS]


@triton.jit
def _weights(W_ROW, d_ok, stride_wk, WIDTH: tl.constexpr, ACC: tl.constexpr):
    """The channels' filter w[0], ..., w[WIDTH - 1], each BLOCK_D x 1."""
    w = ()
    for k in tl.static_range(WIDTH):
        w = w + (tl.load(W_ROW + k * stride_wk, d_ok, other=0.0).to(ACC),)
    return w


@triton.jit
def _program_tile(X, WEIGHT, BIAS, H0, dim, stride_xb, stride_xd, stride_wd, stride_wk, stride_bias, stride_hb,
                  stride_hd, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """What the forward and the backward program (batch element, block of channels, block of positions)
    both start from: b, the block of positions pid_l, the channels ds (BLOCK_D x 1) and which exist,
    the positions ts (1 x BLOCK_L), the rows of x and of the initial states, the bias and the weights."""
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
    return b, pid_l, ds, d_ok, ts, X_ROW, H0_ROW, bias, _weights(WEIGHT + ds * stride_wd, d_ok, stride_wk, WIDTH, ACC)


@triton.jit
def _same_seq(seqs, m: tl.constexpr, i: tl.constexpr, ITEMS: tl.constexpr):
    """Whether items m and i of every run are in one sequence (seqs: seq_idx's ITEMS tiles before, at
    and after the run): 1 x RUNS."""
    return _around(seqs[0], seqs[1], seqs[2], m, ITEMS) == _around(seqs[0], seqs[1], seqs[2], i, ITEMS)


@triton.jit
def _window_sum(w, bias, before, run, after, i: tl.constexpr, WIDTH: tl.constexpr, ITEMS: tl.constexpr,
                seqs, HAS_SEQ_IDX: tl.constexpr):
    """The pre-activation bias + sum_k w[k] x[t - (WIDTH - 1) + k] at item i of every run: BLOCK_D x RUNS.
    With seq_idx, only the taps in item i's sequence, and 0 (no bias) where seq_idx < 0 (padding)."""
    acc = bias + tl.zeros_like(run[0])
    for k in tl.static_range(WIDTH):
        x_k = _around(before, run, after, i - (WIDTH - 1) + k, ITEMS)
        if HAS_SEQ_IDX:  # a tap in another sequence reads 0: masking the input, not the product, keeps the FMA
            x_k = tl.where(_same_seq(seqs, i - (WIDTH - 1) + k, i, ITEMS), x_k, 0.0)
        acc += w[k] * x_k
    if HAS_SEQ_IDX:
        acc = tl.where(_around(seqs[0], seqs[1], seqs[2], i, ITEMS) >= 0, acc, 0.0)
    return acc


@triton.jit
def _sigmoid(p, ACC: tl.constexpr):
    """1 / (1 + e^-p): in float32 one exp2 and one fast reciprocal (fdiv); float64 divides exactly."""
    if ACC == tl.float64:
        return 1.0 / (1.0 + tl.exp(-p))
    else:
        return tl.math.fdiv(tl.full(p.shape, 1.0, ACC), 1.0 + tl.exp2(p * -LOG2E))


@triton.jit
def causal_conv1d_fwd_kernel(
    X, WEIGHT, BIAS, H0, OUT, FINAL, SEQ,     # b x d x L, d x W, d, b x d x (W-1), b x d x L, b x d x (W-1), b x L
    dim, length,
    stride_xb, stride_xd, stride_xl, stride_wd, stride_wk, stride_bias,
    stride_hb, stride_hd, stride_hl, stride_ob, stride_od, stride_ol, stride_fb, stride_fd, stride_fl,
    stride_sb, stride_sl,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, SILU: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
    ITEMS: tl.constexpr,
):
    """One program per (batch element, block of channels, block of positions); runs of ITEMS positions."""
    RUNS: tl.constexpr = BLOCK_L // ITEMS
    b, pid_l, ds, d_ok, ts, X_ROW, H0_ROW, bias, w = _program_tile(
        X, WEIGHT, BIAS, H0, dim, stride_xb, stride_xd, stride_wd, stride_wk, stride_bias, stride_hb, stride_hd,
        WIDTH, HAS_BIAS, HAS_H0, ACC, BLOCK_D, BLOCK_L)
    x_run = _x_items(X_ROW, H0_ROW, ts, d_ok, length, stride_xl, stride_hl, WIDTH, HAS_H0, ACC, RUNS, ITEMS)
    x_before = _x_items(X_ROW, H0_ROW, ts - ITEMS, d_ok, length, stride_xl, stride_hl, WIDTH, HAS_H0, ACC, RUNS,
                        ITEMS)                                             # the same tile, one run earlier
    seqs = ()
    if HAS_SEQ_IDX:  # seq_idx where x is loaded: one run earlier and at the run (the forward reads no later)
        SEQ_ROW = SEQ + b * stride_sb
        seq_run = _seq_items(SEQ_ROW, ts, length, stride_sl, RUNS, ITEMS)
        seqs = (_seq_items(SEQ_ROW, ts - ITEMS, length, stride_sl, RUNS, ITEMS), seq_run, seq_run)
    outs = ()
    for i in tl.static_range(ITEMS):
        pre = _window_sum(w, bias, x_before, x_run, x_run, i, WIDTH, ITEMS, seqs, HAS_SEQ_IDX)   # BLOCK_D x RUNS
        if SILU:
            pre = pre * _sigmoid(pre, ACC)
        outs = outs + (pre,)
    out = positions_of(outs, RUNS, ITEMS)                                  # BLOCK_D x BLOCK_L
    tl.store(OUT + b * stride_ob + ds * stride_od + ts * stride_ol, out.to(OUT.dtype.element_ty), d_ok & (ts < length))
    if pid_l == 0:  # the final states: the last WIDTH - 1 columns of cat(initial_states, x)
        j = tl.arange(0, 4)[None, :]                                       # 1 x 4, WIDTH - 1 <= 3 used
        final = _x_at(X_ROW, H0_ROW, length - (WIDTH - 1) + j, d_ok, length, stride_xl, stride_hl, WIDTH, HAS_H0, ACC)
        tl.store(FINAL + b * stride_fb + ds * stride_fd + j * stride_fl, final.to(FINAL.dtype.element_ty),
                 d_ok & (j < WIDTH - 1))

# %% [markdown]
# **The backward in runs.** The kernel computes the formulas of "The convolution's backward, derived"
# above. For $\partial\mathcal{L}/\partial x$, item $i$ of a run needs $g$ at items $i, \dots, i+K-1$,
# the last ones in the run after it; so the kernel loads $x$ and $\partial\mathcal{L}/\partial u$ where they are
# and one run later, and computes $g$ at the run's `ITEMS` items and at the next run's first $K-1$. The
# same formula, with $x$ padded on the left by the initial states, gives their gradients (the `dh0`
# loop). For the weight and bias gradients each program writes its block's partial sums, and PyTorch
# adds them up.

# %%
#| export causal_conv1d
@triton.jit
def _silu_grad(pre, dout, ACC: tl.constexpr):
    """g = dout * silu'(pre), silu'(p) = sigma(p) (1 + p (1 - sigma(p)))."""
    sig = _sigmoid(pre, ACC)
    return dout * sig * (1.0 + pre * (1.0 - sig))


@triton.jit
def causal_conv1d_bwd_kernel(
    X, WEIGHT, BIAS, H0, DOUT, DFINAL, SEQ,   # as the forward; b x d x L, b x d x (W-1), b x L
    DX, DW_PART, DBIAS_PART, DH0,             # b x d x L, (b * n_blocks_l) x d x W, (b * n_blocks_l) x d, b x d x (W-1)
    dim, length, n_blocks_l,
    stride_xb, stride_xd, stride_xl, stride_wd, stride_wk, stride_bias, stride_hb, stride_hd, stride_hl,
    stride_gb, stride_gd, stride_gl, stride_fb, stride_fd, stride_fl, stride_sb, stride_sl,
    stride_dxb, stride_dxd, stride_dxl,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, HAS_DFINAL: tl.constexpr,
    SILU: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr, ITEMS: tl.constexpr,
):
    RUNS: tl.constexpr = BLOCK_L // ITEMS
    b, pid_l, ds, d_ok, ts, X_ROW, H0_ROW, bias, w = _program_tile(
        X, WEIGHT, BIAS, H0, dim, stride_xb, stride_xd, stride_wd, stride_wk, stride_bias, stride_hb, stride_hd,
        WIDTH, HAS_BIAS, HAS_H0, ACC, BLOCK_D, BLOCK_L)
    DOUT_ROW = DOUT + b * stride_gb + ds * stride_gd
    x_run = _x_items(X_ROW, H0_ROW, ts, d_ok, length, stride_xl, stride_hl, WIDTH, HAS_H0, ACC, RUNS, ITEMS)
    x_before = _x_items(X_ROW, H0_ROW, ts - ITEMS, d_ok, length, stride_xl, stride_hl, WIDTH, HAS_H0, ACC, RUNS, ITEMS)
    du_run = _x_items(DOUT_ROW, DOUT_ROW, ts, d_ok, length, stride_gl, 0, WIDTH, False, ACC, RUNS, ITEMS)
    du_after = _x_items(DOUT_ROW, DOUT_ROW, ts + ITEMS, d_ok, length, stride_gl, 0, WIDTH, False, ACC, RUNS, ITEMS)
    if SILU:
        x_after = _x_items(X_ROW, H0_ROW, ts + ITEMS, d_ok, length, stride_xl, stride_hl, WIDTH, HAS_H0, ACC, RUNS,
                           ITEMS)
    seqs = ()
    if HAS_SEQ_IDX:  # seq_idx one run earlier, at the run and one run later
        SEQ_ROW = SEQ + b * stride_sb
        seqs = (_seq_items(SEQ_ROW, ts - ITEMS, length, stride_sl, RUNS, ITEMS),
                _seq_items(SEQ_ROW, ts, length, stride_sl, RUNS, ITEMS),
                _seq_items(SEQ_ROW, ts + ITEMS, length, stride_sl, RUNS, ITEMS))
    g = ()  # g at the run's items and the next run's first WIDTH - 1 (zero past L, where dout is)
    for i in tl.static_range(ITEMS + WIDTH - 1):
        g_i = _around(du_run, du_run, du_after, i, ITEMS)                  # BLOCK_D x RUNS
        if SILU:
            g_i = _silu_grad(_window_sum(w, bias, x_before, x_run, x_after, i, WIDTH, ITEMS, seqs, HAS_SEQ_IDX),
                             g_i, ACC)
        if HAS_SEQ_IDX:  # padding's outputs are constant zeros
            g_i = tl.where(_around(seqs[0], seqs[1], seqs[2], i, ITEMS) >= 0, g_i, 0.0)
        g = g + (g_i,)
    dxs = ()  # dx[s] = sum_j w[WIDTH - 1 - j] g[s + j]: the flipped filter, reading forward in time
    for i in tl.static_range(ITEMS):
        dx_i = tl.zeros_like(g[0])
        for j in tl.static_range(WIDTH):
            g_j = g[i + j]
            if HAS_SEQ_IDX:  # only outputs of x[s]'s own sequence read it
                g_j = tl.where(_same_seq(seqs, i + j, i, ITEMS), g_j, 0.0)
            dx_i += w[WIDTH - 1 - j] * g_j
        dxs = dxs + (dx_i,)
    dx = positions_of(dxs, RUNS, ITEMS)                                    # BLOCK_D x BLOCK_L
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
        share = tl.zeros_like(g[0])
        for i in tl.static_range(ITEMS):
            x_k = _around(x_before, x_run, x_run, i - (WIDTH - 1) + k, ITEMS)
            if HAS_SEQ_IDX:
                x_k = tl.where(_same_seq(seqs, i - (WIDTH - 1) + k, i, ITEMS), x_k, 0.0)
            share += g[i] * x_k
        tl.store(DW_PART + (part + ds) * WIDTH + k, tl.sum(share, axis=1)[:, None], d_ok)
    if HAS_BIAS:
        share = tl.zeros_like(g[0])
        for i in tl.static_range(ITEMS):
            share += g[i]
        tl.store(DBIAS_PART + part + ds, tl.sum(share, axis=1)[:, None], d_ok)
    if HAS_H0:
        if pid_l == 0:  # dh0[i] = sum_{k <= i} w[k] g[i - k] (items of the first run), plus dfinal[i - L] when L < WIDTH - 1
            first_run = tl.arange(0, RUNS)[None, :] == 0                     # 1 x RUNS
            for i in tl.static_range(WIDTH - 1):
                dh = tl.zeros_like(g[0])
                for k in tl.static_range(i + 1):
                    dh += w[k] * g[i - k]
                dh = tl.sum(tl.where(first_run, dh, 0.0), axis=1)[:, None]  # BLOCK_D x 1
                if HAS_DFINAL:
                    past_x = tl.zeros_like(ds) + i >= length                 # BLOCK_D x 1: a tile, not a
                    # scalar, in the mask (Triton 3.9's interpreter rejects a mask that broadcasts a scalar)
                    dh += tl.load(F_ROW + (i - length) * stride_fl, d_ok & past_x, other=0.0).to(ACC)
                tl.store(DH0 + (b * dim + ds) * (WIDTH - 1) + i, dh.to(DH0.dtype.element_ty), d_ok)

# %% [markdown]
# **Checks.** `causal_conv1d` against the reference in float64, at lengths that are not multiples of
# anything (1 is shorter than the filter), for every width, with bias, SiLU, initial and final states,
# and every gradient. Both sides sum the same few terms, so they agree to rounding ($10^{-12}$ relative
# is far above it). The launchers, half precision and the `causal-conv1d` package follow.

# %%
def conv_grads(fn, x, weight, bias, h0, dout, dfinal, dtype=None):
    """out, final states and the four gradients of sum(out * dout) + sum(final * dfinal)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in (x, weight, bias, h0)]
    out, final = fn(leaves[0], leaves[1], leaves[2], initial_states=leaves[3], return_final_states=True,
                    activation="silu")
    loss = (out.double() * dout).sum() + (final.double() * dfinal).sum()
    return [out, final, *torch.autograd.grad(loss, leaves)]


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
# **Launch configuration.** A program computes a `BLOCK_D x BLOCK_L` tile; the grid is
# `(batch, cdiv(dim, BLOCK_D), cdiv(L, BLOCK_L))`, thousands of programs at Mamba's size, so the GPU
# is full without a loop inside the program. The blocks (8 channels x 256 positions and 2 warps for
# the forward; for the backward 8 x 256 and 4 warps on 2-byte inputs, 16 x 128 and 4 warps on 4-byte
# ones) come from a sweep of the kernels alone, replayed from CUDA graphs, on an H200 (2026-12-04) at
# four of the benchmark's problems: at each, the fastest block or close to it
# (`benchmarks/NOTES_causal_conv1d.md` has the sweep, the earlier kernels' times and the package's at
# the same problems). Under the interpreter the blocks are
# larger, because the interpreter runs each program as NumPy array operations.
#
# **Why runs.** The kernels before these loaded $x$ at $K$ shifted positions (the forward: section 2's
# kernel) or shifted tiles between threads with `tl.gather` (the backward). On an H200 (2026-12-04)
# that forward was well behind `causal-conv1d`
# (`benchmarks/NOTES_causal_conv1d.md` has the times): a load that starts $k - K + 1$ positions off is
# not aligned to 16 bytes, so each thread issues a load per value, four times over. Compiled for the
# H200's sm_90 (with Triton's own `ptxas`), the run kernels issue far fewer instructions per output, a
# fraction of the global loads and, in the backward, of the warp shuffles;
# `benchmarks/NOTES_causal_conv1d.md` has the counts beside the sweep's GPU times, which fell with
# them. The backward still recomputes $g$ at $K-1$ positions of the next run (11 sigmoids per 8
# positions in bfloat16, 7 per 4 in float32) and adds up its partial weight gradients once per program;
# a loop over several blocks of positions per program, summing them once per loop, was faster at three
# of the four problems and, at the shortest, only with two blocks per program (slower with four or
# eight: the notes give the times), and is not in this kernel.
#
# **The forward kernel in detail.** In the run kernels the second load (one run earlier) is aligned
# too, and its values come from cache. `items_of` and `positions_of` only rename registers when each
# thread holds its runs whole; chapter 07's "Going deeper: the backward kernel" counts the instructions
# they compile to. The sum
# over $k$ is unrolled at compile time (`tl.static_range`), so every choice `_around` makes is made by
# the compiler. `_x_at` is the one place that knows the padding: positions $< 0$ come from
# `initial_states` (or are zero), positions $\ge L$ are masked. SiLU needs
# $\sigma(p) = 1/(1+e^{-p})$: in float32, `_sigmoid` computes $e^{-p}$ as `exp2` of $-p\log_2 e$ and
# the reciprocal with `tl.math.fdiv`, each one hardware instruction (relative error about $10^{-7}$);
# float64 keeps the exact division. Strides are arguments, so a transposed (channel-last) or sliced
# `x` is read in place, never copied (only 16-byte vectors need positions adjacent and rows aligned;
# other layouts load value by value).
#
# **The backward kernel in detail.** It recomputes $p_t$ from $x$ because that is cheaper than storing
# it: the loads of $x$ against a write and a read of a `(batch, dim, L)` tensor. The flipped
# convolution for $\partial\mathcal{L}/\partial x_s$ reads positions $s, \dots, s+K-1$, zero past $L$;
# the kernel loads $x$ one run earlier too, for $p$ at the first items. It recomputes $g$ at the next
# run's first $K-1$ positions rather than moving it between threads: a sigmoid costs less than a trip
# through shared memory. The initial states' gradients are the sum derived above for
# $\partial\mathcal{L}/\partial h^0_i$ over the first run's items, plus, when $L < K-1$, the gradient of
# the final state that copied $h^0_i$ (the kernel's `dh0` loop).
# PyTorch adds the programs' partial sums of the weight and bias gradients in a fixed order: no
# atomics, so the gradients are the same bits on every run. A gradient arriving through the final
# states flows into the last $K-1$ columns of $x$, or into initial states when $L < K-1$.
#
# **Packed sequences.** With `seq_idx` (an int32 id per position, as the package takes it) several
# sequences share a row: a tap counts only where its position's id equals its output's, so each sequence
# starts from zeros, and a negative id (padding) gives a zero output and passes no gradient; as in the
# package, `initial_states` and the final states are refused with it. The kernels load the ids beside
# $x$ and mask each term with `tl.where` under the constexpr `HAS_SEQ_IDX`, so without `seq_idx` they
# compile to the code above.
#
# **Tests.** `tests/test_causal_conv1d.py` adds to the checks above `gradcheck` (our backward against
# finite differences of our own forward) for every input, and checks `seq_idx` against a reference that
# cuts each row into its sequences.
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
# The backward's blocks, by the bytes per element of x, were picked by a sweep of the backward kernel on
# the H200 at four of the benchmark's shapes (benchmarks/NOTES_causal_conv1d.md).
GPU_CONFIG = {"block_d": 8, "block_l": 256, "num_warps": 2}
GPU_BWD_CONFIG = {2: {"block_d": 8, "block_l": 256, "num_warps": 4}, 4: {"block_d": 16, "block_l": 128, "num_warps": 4}}
CPU_CONFIG = {"block_d": 32, "block_l": 512, "num_warps": 4}


def _items(x):
    """Positions per run: 16 bytes of x's dtype (8 in bfloat16, 4 in float32), at least 4, so that a run
    holds the WIDTH - 1 <= 3 positions the kernels read beyond an item."""
    return max(16 // x.element_size(), 4)


def _launch_config(dim, length, backward_element_size=None):
    """Blocks and warps for a launch: the forward's, or the backward's for x of that element size."""
    if INTERPRET:
        config = dict(CPU_CONFIG)
    elif backward_element_size is not None:
        config = dict(GPU_BWD_CONFIG[min(backward_element_size, 4)])
    else:
        config = dict(GPU_CONFIG)
    config.update(block_d=min(config["block_d"], max(next_power_of_2(dim), 2)),
                  block_l=min(config["block_l"], max(next_power_of_2(length), 16)))
    return config


def _acc_dtype(x, weight):
    return torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32


def _strides(t, n=3):
    """A tensor's strides, or zeros for None (the kernel never reads it)."""
    return tuple(t.stride()) if t is not None else (0,) * n


@custom_op("causal_conv1d_fwd", __name__)
def causal_conv1d_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      initial_states: Optional[torch.Tensor], silu: bool,
                      seq_idx: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel, on x of any strides: out (x's layout and dtype) and the final states
    (batch, dim, width - 1), the last width - 1 columns of cat(initial_states or zeros, x). With
    seq_idx (batch, L) int32, a tap counts only within its output's sequence (see causal_conv1d)."""
    batch, dim, length = x.shape
    width = weight.shape[1]
    out = torch.empty_like(x)
    final = x.new_empty(batch, dim, width - 1)
    config = _launch_config(dim, length)
    grid = (batch, cdiv(dim, config["block_d"]), cdiv(length, config["block_l"]))
    causal_conv1d_fwd_kernel[grid](
        x, weight, bias, initial_states, out, final, seq_idx, dim, length,
        *x.stride(), *weight.stride(), *_strides(bias, 1), *_strides(initial_states), *out.stride(), *final.stride(),
        *_strides(seq_idx, 2),
        WIDTH=width, HAS_BIAS=bias is not None, HAS_H0=initial_states is not None, SILU=silu,
        HAS_SEQ_IDX=seq_idx is not None, ACC=accumulator_dtype(_acc_dtype(x, weight)), BLOCK_D=config["block_d"],
        BLOCK_L=config["block_l"], ITEMS=_items(x), num_warps=config["num_warps"])
    return out, final


@causal_conv1d_fwd.register_fake
def _(x, weight, bias, initial_states, silu, seq_idx=None):
    return torch.empty_like(x), x.new_empty(x.shape[0], x.shape[1], weight.shape[1] - 1)


@custom_op("causal_conv1d_bwd", __name__)
def causal_conv1d_bwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      initial_states: Optional[torch.Tensor], dout: torch.Tensor, dfinal: Optional[torch.Tensor],
                      silu: bool, seq_idx: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """The backward kernel: dx (x's layout and dtype), dweight and dbias (float32, float64 for float64
    inputs; dbias empty without bias), dinitial_states (its dtype; empty without). dweight and dbias are
    sums of per-program partials, so the result does not depend on the order programs run in."""
    batch, dim, length = x.shape
    width = weight.shape[1]
    acc = _acc_dtype(x, weight)
    config = _launch_config(dim, length, backward_element_size=x.element_size())
    n_blocks_l = cdiv(length, config["block_l"])
    dx = torch.empty_like(x)
    dw_part = x.new_empty(batch * n_blocks_l, dim, width, dtype=acc)
    dbias_part = x.new_empty(batch * n_blocks_l, dim if bias is not None else 0, dtype=acc)
    dh0 = x.new_empty(batch, dim, width - 1) if initial_states is not None else x.new_empty(0)
    grid = (batch, cdiv(dim, config["block_d"]), n_blocks_l)
    causal_conv1d_bwd_kernel[grid](
        x, weight, bias, initial_states, dout, dfinal, seq_idx, dx, dw_part, dbias_part, dh0, dim, length, n_blocks_l,
        *x.stride(), *weight.stride(), *_strides(bias, 1), *_strides(initial_states), *dout.stride(),
        *_strides(dfinal), *_strides(seq_idx, 2), *dx.stride(),
        WIDTH=width, HAS_BIAS=bias is not None, HAS_H0=initial_states is not None, HAS_DFINAL=dfinal is not None,
        SILU=silu, HAS_SEQ_IDX=seq_idx is not None, ACC=accumulator_dtype(acc), BLOCK_D=config["block_d"],
        BLOCK_L=config["block_l"], ITEMS=_items(x), num_warps=config["num_warps"])
    return [dx, dw_part.sum(0), dbias_part.sum(0), dh0]


@causal_conv1d_bwd.register_fake
def _(x, weight, bias, initial_states, dout, dfinal, silu, seq_idx=None):
    acc = _acc_dtype(x, weight)
    return [torch.empty_like(x), weight.new_empty(weight.shape, dtype=acc),
            weight.new_empty(weight.shape[0] if bias is not None else 0, dtype=acc),
            x.new_empty(initial_states.shape if initial_states is not None else (0,))]


causal_conv1d_fwd.register_vmap(_vmap_by_loop(causal_conv1d_fwd))
causal_conv1d_bwd.register_vmap(_vmap_by_loop(causal_conv1d_bwd))

# %%
#| export causal_conv1d
_NO_SECOND_DERIVATIVE = ("causal_conv1d has no second derivative: its backward kernel's gradients cannot be "
                         "differentiated again (create_graph=True gives first derivatives only; hessians, "
                         "double backward and gradgradcheck through causal_conv1d are not supported)")


class _NoSecondDerivative(_SelectiveScanNoSecondDerivative):
    """Chapter 05's identity on the gradients, attached to the tensors they depend on (differentiating
    through it raises instead of returning a silent zero), with this op's message."""

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_NO_SECOND_DERIVATIVE)


class CausalConv1dFn(torch.autograd.Function):
    """(out, final_states) = causal_conv1d(x, weight, bias, initial_states, silu, seq_idx); seq_idx
    (integers) gets no gradient."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, initial_states, silu, seq_idx):
        return causal_conv1d_fwd(x, weight, bias, initial_states, silu, seq_idx)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, initial_states, silu, seq_idx = inputs
        ctx.save_for_backward(x, weight, bias, initial_states, seq_idx)
        ctx.silu = silu
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout, dfinal):
        x, weight, bias, initial_states, seq_idx = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(x)
        with torch.no_grad():  # the op's own outputs carry no graph (see _NoSecondDerivative)
            grads = causal_conv1d_bwd(x, weight, bias, initial_states, dout, dfinal, ctx.silu, seq_idx)
        inputs = (x, weight, bias, initial_states)
        grads = [None if t is None else g.to(t.dtype) for g, t in zip(grads, inputs)]
        if torch.is_grad_enabled():  # create_graph=True (or torch.func.grad): make a second derivative raise
            anchors = [t for t in (*inputs, dout, dfinal) if t is not None]
            given = [g for g in grads if g is not None]
            poisoned = iter(_NoSecondDerivative.apply(len(anchors), *anchors, *given))
            grads = [None if g is None else next(poisoned) for g in grads]
        return (*grads, None, None)


def _check_inputs(x, weight, bias, initial_states, final_states_out, seq_idx=None):
    named = dict(x=x, weight=weight, bias=bias, initial_states=initial_states, final_states_out=final_states_out)
    for name, value in named.items():
        if value is not None or name in ("x", "weight"):
            check_float_tensor(name, value)
    if x.dim() != 3:
        raise ValueError(f"x must have shape (batch, dim, L), got {tuple(x.shape)}")
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
    if seq_idx is not None:
        if not isinstance(seq_idx, torch.Tensor) or seq_idx.dtype != torch.int32:
            got = seq_idx.dtype if isinstance(seq_idx, torch.Tensor) else type(seq_idx).__name__
            raise TypeError(f"seq_idx must be a torch.int32 tensor, got {got}")
        if tuple(seq_idx.shape) != (batch, length):
            raise ValueError(f"seq_idx must have shape (batch, L) = {(batch, length)}, got {tuple(seq_idx.shape)}")
    check_same_device(**named, seq_idx=seq_idx)


def _empty_conv(x, weight, bias, initial_states, return_final_states):
    """out and the final states for an empty x, as torch's ops give them: out empty, in the graph of
    every input that needs a gradient (zero gradients); the final states, made only when asked for,
    the last width - 1 columns of cat(initial_states or zeros, x)."""
    out = plus(torch.empty_like(x), zero_in_graph(x, weight, bias, initial_states))   # None: no gradients
    if not return_final_states:
        return out, None
    start = x.new_zeros(*x.shape[:2], weight.shape[1] - 1) if initial_states is None else initial_states
    return out, torch.cat([start, x], dim=-1)[..., x.shape[-1]:]


def causal_conv1d(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                  final_states_out=None, activation=None):
    """Causal depthwise conv1d, a drop-in for the causal-conv1d package's causal_conv1d_fn.

    x: (batch, dim, L), any strides; weight: (dim, width), width 2, 3 or 4; bias: (dim,);
    initial_states: (batch, dim, width - 1), the inputs before position 0 (default zeros);
    activation: None, "silu" or "swish" (the same).

        out[b, d, t] = act(bias[d] + sum_k weight[d, k] * x[b, d, t - (width - 1) + k])

    seq_idx: (batch, L) int32, any strides, for several sequences packed in one row, as the package
    takes it: position s feeds out[b, :, t] only where seq_idx[b, s] == seq_idx[b, t], so each
    sequence (a run of equal ids) starts from zeros; out is 0 where seq_idx < 0 (padding). It excludes
    initial_states and return_final_states (ValueError), and gets no gradient.

    Returns out (x's dtype and layout), and with return_final_states also final_states
    (batch, dim, width - 1): the last width - 1 columns of cat(initial_states or zeros, x), the
    initial_states of the next piece of the sequence; written into final_states_out when given (in
    place, then returned). Sums in float32 (float64 for float64 inputs); weight may have another float
    dtype than x (bias has weight's, initial_states and final_states_out x's). Gradients flow to x,
    weight, bias, initial_states, also through final_states. First derivatives only: differentiating
    the gradients again raises RuntimeError. Works under torch.compile, torch.func.grad and vmap.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if final_states_out is not None and not return_final_states:
        raise ValueError("final_states_out is only written with return_final_states=True")
    if seq_idx is not None and initial_states is not None:
        raise ValueError("initial_states must be None when seq_idx is given (each packed sequence starts from zeros)")
    if seq_idx is not None and return_final_states:
        raise ValueError("return_final_states must be False when seq_idx is given (no final states for packed sequences)")
    _check_inputs(x, weight, bias, initial_states, final_states_out, seq_idx)
    if x.numel() == 0:
        out, final_states = _empty_conv(x, weight, bias, initial_states, return_final_states)
    else:
        out, final_states = apply(CausalConv1dFn, x, weight, bias, initial_states, activation is not None, seq_idx)
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
    block_d = min(64, max(next_power_of_2(x.shape[1]), 2))
    causal_conv1d_update_kernel[(x.shape[0], cdiv(x.shape[1], block_d))](
        x, conv_state, new_state, weight, bias, out, x.shape[1], state_len, *x.stride(), *conv_state.stride(),
        *new_state.stride(), *weight.stride(), *_strides(bias, 1), *out.stride(), WIDTH=weight.shape[1],
        HAS_BIAS=bias is not None, SILU=silu, ACC=accumulator_dtype(_acc_dtype(x, weight)), BLOCK_D=block_d,
        BLOCK_S=max(next_power_of_2(state_len), 2))
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


def _check_update_inputs(x, conv_state, weight, bias):
    """causal_conv1d_update's checks, for x of one position (batch, dim)."""
    named = dict(x=x, conv_state=conv_state, weight=weight, bias=bias)
    for name, value in named.items():
        if value is not None or name != "bias":
            check_float_tensor(name, value)
    if x.dim() != 2:
        raise ValueError(f"x must have shape (batch, dim) or (batch, dim, L), got {tuple(x.shape)}")
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


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """One step of the causal conv for token-by-token generation, like the causal-conv1d package's
    causal_conv1d_update (forward only). x: (batch, dim), the new input, or (batch, dim, L), L new
    inputs in order (one step each, as the package accepts); conv_state: (batch, dim, state_len) with
    state_len >= width - 1, the last inputs, updated in place (shifted left by one per input, the input
    appended); weight: (dim, width); bias: (dim,); activation None, "silu" or "swish".
    Returns out of x's shape and dtype: the causal_conv1d output at the new positions. No gradients;
    works under torch.compile (as a functional op and a copy into conv_state)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if isinstance(x, torch.Tensor) and x.dim() == 3:   # L steps, each checked; L = 0 checked as one step
        if x.shape[-1] == 0:
            _check_update_inputs(x.new_empty(x.shape[:2]), conv_state, weight, bias)
        steps = [causal_conv1d_update(x[..., t], conv_state, weight, bias, activation) for t in range(x.shape[-1])]
        return torch.stack(steps, dim=-1) if steps else x.clone()
    _check_update_inputs(x, conv_state, weight, bias)
    if x.numel() == 0:   # no batch element or no channel: no output to compute, no state to shift
        return torch.empty_like(x)
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

# %% [markdown]
# **Half precision.** The inputs are rounded to the dtype for both sides, the kernel sums in float32,
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
# bandwidth measured in the same cell. The first two columns time the public calls as a user makes
# them (`do_bench`: the host's Python, the custom operator and autograd included); the last two
# replay the kernels alone from a CUDA graph (`graph_us`: no host work at all), ours through their
# launchers and the package's through its own `cpp_functions`, so that a gap between the two kinds
# of column is the host's time, not the kernels'.

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


def conv_launchers_of_scan_lib(x, weight, bias, dout):
    """Our forward and backward launchers alone (no autograd, no custom-op dispatch), to time the kernels."""
    conv = sys.modules["scan_lib.causal_conv1d"]   # the module (scan_lib.causal_conv1d is also a function)
    x, weight, bias = x.detach(), weight.detach(), bias.detach()
    return (lambda: conv.causal_conv1d_fwd(x, weight, bias, None, True),
            lambda: conv.causal_conv1d_bwd(x, weight, bias, None, dout, None, True))


def conv_launchers_of_package(x, weight, bias, dout):
    """The package's own forward and backward functions (causal-conv1d 1.7.0's cpp_functions)."""
    from causal_conv1d.cpp_functions import causal_conv1d_bwd_function, causal_conv1d_fwd_function
    x, weight, bias = x.detach(), weight.detach(), bias.detach()
    return (lambda: causal_conv1d_fwd_function(x, weight, bias, None, None, None, True),
            lambda: causal_conv1d_bwd_function(x, weight, bias, dout, None, None, None, None, False, True))


try:
    from causal_conv1d import causal_conv1d_fn
except ImportError as error:
    causal_conv1d_fn = None
    conv_package_error = error
if not ON_GPU:
    print("skipped: needs a GPU")
else:
    from scan_lib.runtime import copy_bandwidth, graph_us, median_us
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
    conv_launchers = {"scan_lib": conv_launchers_of_scan_lib(bench_x, bench_w, bench_b, bench_dout)}
    if causal_conv1d_fn is not None:
        conv_launchers["causal-conv1d"] = conv_launchers_of_package(bench_x, bench_w, bench_b, bench_dout)
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, (batch, dim, L) = {(bench_batch, bench_dim, bench_length)}, bf16, "
          f"width 4, bias, silu; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'':>16} {'fwd (us)':>10} {'fwd+bwd (us)':>13} {'fwd kernel':>11} {'bwd kernels':>12}")
    floors = [conv_io_bytes(bench_batch, bench_dim, bench_length, 2, bwd) / bandwidth * 1e6 for bwd in (False, True)]
    bwd_floor = 3 * bench_batch * bench_dim * bench_length * 2 / bandwidth * 1e6   # read x and dout, write dx
    print(f"{'memory floor':>16} {floors[0]:10.0f} {floors[1]:13.0f} {floors[0]:11.0f} {bwd_floor:12.0f}")
    bench_leaves = [bench_x, bench_w, bench_b]
    for name, fn in conv_impls.items():
        with torch.no_grad():
            forward = median_us(lambda fn=fn: fn(bench_x, bench_w, bench_b))
        both = median_us(lambda fn=fn: fn(bench_x, bench_w, bench_b).backward(bench_dout), grad_to_none=bench_leaves)
        kernels = [f"{graph_us(launch):11.0f} " for launch in conv_launchers[name]] if name in conv_launchers else []
        print(f"{name:>16} {forward:10.0f} {both:13.0f} " + "".join(kernels))

# %% [markdown]
# The table says where each implementation stands against the floor and against the others in this
# run (the GPU is named above it; where the package was not importable, its row is missing). The
# kernels first (the last two columns): our forward kernel takes 50 us against the package's 49 (the
# floor is 45), our backward 100 us against its 81 (floor 67). So the forward kernel is within a few
# percent of the package's and about 1.1x the memory floor; the backward is about 1.2x behind the
# package, and **Why runs** above says what it still does twice (the sigmoids at the next run's
# first positions, a partial sum per program). The calls (the first two columns) tell another story.
# Without autograd, our forward call (55 us) is a few us above its kernel and a little behind the
# package's (53). But our forward+backward takes 438 us against the package's 279, when the kernels
# add up to 50 + 100 us and 49 + 81. About two thirds of our training step's call is the host's work (the
# custom operators, autograd, the launches), which the GPU waits for; the package pays it too (it is also a
# custom operator with an autograd Function: about half of its call), ours is longer. `make bench BENCH_ARGS="--only conv"`
# prints this split for four problems (`host_us`: the host's time per call); cutting the host path
# is the next work for this op, as for the selective scan (chapter 07's "Going deeper: the host's
# share"). `F.conv1d` and SiLU are the slowest in both.

# %% [markdown]
# ### One block against `mamba_ssm`'s: the check, the times and the fine print
#
# The measurement behind section 6's summary: the same weights in `scan_lib.Mamba` and in
# `mamba_ssm`'s `Mamba` (skipped where it is not installed), at the size of a small language model's
# layer: first the outputs and gradients must agree, then the times, forward and forward+backward, in float32 and bfloat16.
# `mamba_ssm` runs its unfused path (convolution and scan as separate calls, like ours) and, where the
# `causal-conv1d` package is installed, its fused path (one autograd function for the whole block).
#
# The two blocks run at batch 8, L 2048, d_model 1024 (d_inner 2048, N 16), with `mamba_ssm` built
# for this GPU. The forward is timed for inference, without autograd. `mamba_ssm`'s unfused path is
# `use_fast_path=False`; its fused path is `mamba_inner_fn`. In the printed ratio lines a ratio below 1
# means `mamba_ssm`'s block is the faster in that row, above 1 ours. These are one run's medians;
# differences of a few percent are within what a second run can change.

# %%
#| export
def _mamba_ssm_block():
    """mamba_ssm's Mamba module class, or None and the reason it is missing. mamba_ssm's package
    __init__ also imports Mamba2, Mamba3 and transformers; only mamba_simple is needed here."""
    import importlib
    import importlib.util
    import sys
    import types
    try:
        if "mamba_ssm" not in sys.modules:   # the package without its __init__ (a second call finds it)
            spec = importlib.util.find_spec("mamba_ssm")
            if spec is None:
                return None, "mamba_ssm is not installed"
            package = types.ModuleType("mamba_ssm")
            package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
            sys.modules["mamba_ssm"] = package
        return importlib.import_module("mamba_ssm.modules.mamba_simple").Mamba, None
    except Exception as error:   # noqa: BLE001 (a missing CUDA extension shows up as any of several errors)
        return None, f"mamba_ssm not importable: {type(error).__name__}: {error}"

# %%
def block_pair(MambaSSM, d_model, dtype, fast_path, seed=0):
    """scan_lib's block and mamba_ssm's (the class MambaSSM) with the same weights."""
    torch.manual_seed(seed)
    ours = Mamba(d_model, device=DEVICE, dtype=dtype)
    theirs = MambaSSM(d_model, use_fast_path=fast_path, device=DEVICE, dtype=dtype)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def agreement(ours, theirs, hidden):
    """Relative differences of output and of every parameter's gradient (ours against theirs)."""
    outs = []
    for m in (ours, theirs):
        m.zero_grad(set_to_none=True)
        out = m(hidden)
        out.float().square().mean().backward()
        outs.append(out)
    diffs = {"out": rel_err(outs[0], outs[1])}
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        diffs[name] = rel_err(p.grad, q.grad)
    return diffs


def block_times(m, hidden):
    with torch.no_grad():
        forward = scan_lib.runtime.median_us(lambda: m(hidden), rep=200)
    grad = torch.randn_like(hidden)
    training = scan_lib.runtime.median_us(lambda: m(hidden).backward(grad), rep=400)
    return forward, training


MambaSSM, missing = _mamba_ssm_block()
if not ON_GPU or MambaSSM is None:
    print(f"skipped: {'needs a GPU' if not ON_GPU else missing}")
else:
    import importlib.util
    if importlib.util.find_spec("causal_conv1d") is not None:   # the package (its name is our function's)
        paths = {"mamba_ssm (unfused)": False, "mamba_ssm (fused)": True}
    else:
        paths = {"mamba_ssm (unfused)": False}
        print("causal-conv1d is not installed: mamba_ssm's fused path and its conv kernel are not measured")
    batch, length, d_model = 8, 2048, 1024
    print(f"{scan_lib.runtime.describe()}; batch {batch}, L {length}, d_model {d_model} (d_inner 2048, N 16)")
    results = []
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 5e-2)):
        hidden = torch.randn(batch, length, d_model, device=DEVICE, dtype=dtype)
        for label, fast_path in paths.items():
            ours, theirs = block_pair(MambaSSM, d_model, dtype, fast_path)
            diffs = agreement(ours, theirs, hidden)
            worst = max(diffs, key=diffs.get)
            print(f"{str(dtype):15s} vs {label}: out {diffs['out']:.1e}, worst of output and gradients: "
                  f"{worst} {diffs[worst]:.1e}")
            assert max(diffs.values()) < tol, diffs
            if fast_path is False:
                results.append((dtype, "scan_lib", *block_times(ours, hidden)))
            results.append((dtype, label, *block_times(theirs, hidden)))
    print(f"\n{'dtype':15s} {'block':22s} {'forward us':>11s} {'fwd+bwd us':>11s}")
    for dtype, label, fwd, train in results:
        print(f"{str(dtype):15s} {label:22s} {fwd:11.0f} {train:11.0f}")
    for dtype in (torch.float32, torch.bfloat16):
        rows = {label: (fwd, train) for d, label, fwd, train in results if d == dtype}
        for label in paths:
            print(f"{str(dtype)}: {label} / scan_lib = {rows[label][0] / rows['scan_lib'][0]:.2f} forward, "
                  f"{rows[label][1] / rows['scan_lib'][1]:.2f} forward+backward (above 1: scan_lib faster)")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    labels = ["scan_lib"] + list(paths)
    for ax, dtype in zip(axes, (torch.float32, torch.bfloat16)):
        rows = {label: (fwd, train) for d, label, fwd, train in results if d == dtype}
        xs = torch.arange(len(labels)).float()
        ax.bar(xs - 0.2, [rows[l][0] for l in labels], 0.4, label="forward")
        ax.bar(xs + 0.2, [rows[l][1] for l in labels], 0.4, label="forward+backward")
        ax.set_xticks(xs.tolist(), [l.replace("mamba_ssm ", "mamba_ssm\n") for l in labels], fontsize=8)
        ax.set(ylabel="us", title=f"one block, {str(dtype)[6:]}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, "06_block_benchmark.png")

# %% [markdown]
# The two blocks compute the same function: the cell asserts that outputs and every gradient agree.
# In the recorded run ours is the faster in every row. In a training step (forward+backward)
# `mamba_ssm`'s time over ours is 1.03 (fused) to 1.05 (unfused) in float32 and 1.14 (fused) to 1.22
# (unfused) in bfloat16; in the forward alone it is 1.04 in float32, for both of `mamba_ssm`'s paths,
# and 1.10 (unfused) to 1.11 (fused) in bfloat16. Gaps of a few percent, as in float32, are within what a second run can change.

# %% [markdown]
# ### Where the time goes in scan_lib's block
#
# In scan_lib's block, bfloat16, forward+backward: the ten kernels that take the most GPU time, from
# `torch.profiler`, with their share of the total. The list says which kernels the time goes to (the
# selective scan's Triton kernels, cuBLAS's matrix products, the convolution, and PyTorch's elementwise
# kernels) and in what proportion in this run. It does not say which PyTorch operation launched each
# elementwise kernel: the names are generic and cut at 90 characters. Copies of strided inputs to
# contiguous tensors, dtype casts and transposes around the projections are candidates, and finding out
# which would need the profiler's stacks (`with_stack=True`), which this cell does not record.
#
# In this run the selective scan's two kernels take over two thirds of the step
# (`strided_bwd_kernel` 1919 us, 52.3%; `strided_fwd_kernel` 573 us, 15.6%); three of cuBLAS's matrix
# products (the `nvjet` kernels) follow at about 190 us each, then the convolution's backward (93 us),
# one of PyTorch's own kernels, a concatenation (`CatArrayBatchedCopy`, 91 us), a fourth matrix product
# (87 us) and a second PyTorch kernel, an addition (82 us); the convolution's forward (50 us) closes
# the list. The names of PyTorch's two do not say which operation launched them; the backward has one
# of each that fits, the split of `xz` into `x` and `z` (its backward concatenates their gradients)
# and the sum of the convolution output's two gradients (from the scan and from `x_proj`), and
# `with_stack=True` would confirm it.
# `benchmarks/NOTES_selective_scan.md` ("Fifth look") records the profile of the block before its
# projections were applied in that layout, when $B$, $C$ and the scan's output gradient reached the
# kernels with positions far apart and the forward kernel alone took longer than this whole list's
# first line.

# %%
if not ON_GPU:
    print("skipped: needs a GPU")
else:
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    block = Mamba(1024, device=DEVICE, dtype=torch.bfloat16)
    hidden = torch.randn(8, 2048, 1024, device=DEVICE, dtype=torch.bfloat16)
    grad = torch.randn_like(hidden)
    for _ in range(3):
        block(hidden).backward(grad)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            block(hidden).backward(grad)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events)
    print(f"GPU time per forward+backward: {total / 5:.0f} us")
    for e in events[:10]:
        print(f"{e.self_device_time_total / 5:8.0f} us {100 * e.self_device_time_total / total:5.1f}%  {e.key[:90]}")

# %% [markdown]
# ### The block: layouts, caches and what `mamba_ssm` does differently
#
# - **Layouts.** Every projection is one matrix product on the (features, batch L) matrix of its input
#   (`features_first`), as `mamba_ssm` applies `in_proj` and `dt_proj`: `in_proj.weight @ hidden.t()`
#   reads `hidden_states` (batch L, d_model) as it lies and gives `xz` as (2 d_inner, batch L); `x` and
#   `z` are its two halves, and `positions_last` views each as (batch, d_inner, L) with stride 1 along
#   L. The convolution reads `x` in place (it takes strides) and writes its output in the same layout;
#   `x_proj` and `dt_proj` multiply that output's (d_inner, batch L) matrix without a copy, so `delta`,
#   `B` and `C` are views with stride 1 along L too. The scan (the package's public `selective_scan`,
#   chapter 07's kernels) reads all of them in place and writes `y` in `u`'s layout, which `out_proj`
#   reads as a transposed matrix, again without a copy; in the backward each gradient comes back in its
#   tensor's layout. Applying `in_proj` as `weight @ hidden_states.transpose(1, 2)` on the
#   (batch, d_model, L) view instead makes PyTorch compute the product in the other layout and copy its
#   transpose (`xz` itself, 128 MiB in bf16 at section 6's size), and `out_proj(y.transpose(1, 2))` on a
#   contiguous `y` copies `y` and hands the scan's backward a gradient with positions `d_inner`
#   elements apart: one memory transaction per position. (A census of every aten operation of one
#   training step, on fake tensors, found both: `benchmarks/NOTES_selective_scan.md`, fourth look.)
# - **The conv cache.** `mamba_ssm` keeps `conv_state` as the last `d_conv` inputs of the convolution,
#   of which the next step uses the last `d_conv - 1` (it rolls the window left and appends the new
#   input). A chunk therefore starts from `initial_states = conv_state[..., 1:]`, and the state after
#   it is the last `d_conv` columns of `cat(conv_state, x)`: for a chunk shorter than the window, some
#   of them are the old state's.
# - **Chunked prefill is an extension.** `mamba_ssm`'s `Mamba.forward` with `inference_params` at
#   `seqlen_offset == 0` overwrites both states from the sequence (it starts from zeros), and at any
#   later offset calls `step`, which takes one position only. This block does the same at offset 0
#   (it zeroes the cached states first, so a reused `InferenceParams`, after `reset`, starts the new
#   prompt afresh), continues from the cached states at any later offset, and runs `step` only for a
#   single position there, so a prompt can be fed in chunks of any length. Each chunk starts from the
#   states the previous piece left (the convolution's `initial_states` and the scan's
#   `initial_state`), as chapter 02 carried a state from block to block.
# - **The step kernel's launch.** One program per (batch element, block of channels), with the block
#   sized so a program holds about 4096 state values ($\text{BLOCK\_D} \times N$). A step reads and
#   writes the whole state once, 2 x batch x d_inner x N values, so at batch 1 it is well under a
#   microsecond of memory traffic; the rest of the step (the small matrix products around it, and their
#   launches unless they are replayed from a CUDA graph) is the rest of its cost: the table in
#   "Generation's cost" below measures the whole step, replayed from a CUDA graph.
# - **Precision.** `A_log` and `D` stay float32 in a bfloat16 block (as in `mamba_ssm`), and both kernels
#   accumulate in float32; the states in the cache take the weights' dtype unless
#   `allocate_inference_cache(..., dtype=...)` says otherwise.
# - **The backends' tolerance.** "The block on both backends" above holds the float32 `"triton"`
#   block to the float64 `"torch"` block relative to the largest value: float32 carries 24 bits (about
#   $6 \cdot 10^{-8}$), and each output sums a few hundred products through the projections and the
#   scan, so errors of a few $10^{-6}$ are expected; $10^{-4}$ would still catch any wrong term. That a
#   `state_dict` moves between our block and `mamba_ssm`'s is checked only where `mamba_ssm` runs: "One
#   block against `mamba_ssm`'s" above loads ours into theirs and compares outputs and gradients.

# %% [markdown]
# **The same parameters as `mamba_ssm`.** The cell checks that the `state_dict` has exactly
# `mamba_ssm`'s parameter names and shapes (listed by hand, so the check runs without it), and that it
# loads strictly into a second block of ours.

# %%
def mamba_ssm_layout(d_model, d_state=16, d_conv=4, expand=2, conv_bias=True, bias=False):
    """The parameter names and shapes of mamba_ssm.modules.mamba_simple.Mamba(d_model, ...)."""
    d_inner, rank = expand * d_model, math.ceil(d_model / 16)
    layout = {"A_log": (d_inner, d_state), "D": (d_inner,), "in_proj.weight": (2 * d_inner, d_model),
              "conv1d.weight": (d_inner, 1, d_conv), "x_proj.weight": (rank + 2 * d_state, d_inner),
              "dt_proj.weight": (d_inner, rank), "dt_proj.bias": (d_inner,), "out_proj.weight": (d_model, d_inner)}
    if conv_bias:
        layout["conv1d.bias"] = (d_inner,)
    if bias:
        layout.update({"in_proj.bias": (2 * d_inner,), "out_proj.bias": (d_model,)})
    return layout


for options in ({}, dict(d_state=8, d_conv=3, expand=3, conv_bias=False, bias=True)):
    block = Mamba(40, **options)
    shapes = {name: tuple(p.shape) for name, p in block.state_dict().items()}
    assert shapes == mamba_ssm_layout(40, **options), shapes
    twin = Mamba(40, **options)                         # other random draws: differs before the load
    assert not torch.equal(twin.in_proj.weight, block.in_proj.weight)
    twin.load_state_dict(block.state_dict())            # strict: every name present, no extra
    assert all(torch.equal(p, q) for p, q in zip(block.parameters(), twin.parameters()))
print("parameter names and shapes as mamba_ssm's (listed by hand); our state_dict loads into our block: ok")

# %% [markdown]
# **The same seed, the same weights.** The constructor also makes `mamba_ssm`'s random draws in
# `mamba_ssm`'s order, so the same seed should give the same weights; the comparisons in this chapter
# never rely on it: they copy the `state_dict`. Where `mamba_ssm`'s module imports (on a GPU with the
# package built; the same `_mamba_ssm_block` as "One block against `mamba_ssm`'s" above and
# `tests/test_mamba.py`), the cell builds both blocks from the same seed, for the default options and for a second set, and asserts every
# parameter bit-identical, without copying anything; elsewhere it says it skipped. (`_mamba_ssm_block`
# imports `mamba_ssm`'s module without the package's `__init__`, through a stand-in package it puts in
# `sys.modules` with the real package's import spec; an earlier run's stand-in had no spec, and this
# second call failed on it.)

# %%
SeedMambaSSM, seed_missing = _mamba_ssm_block() if ON_GPU else (None, "needs a GPU")
if SeedMambaSSM is None:
    print(f"skipped: {seed_missing}")
else:
    for options in ({}, dict(d_state=8, d_conv=3, expand=3, conv_bias=False, bias=True)):
        torch.manual_seed(0)
        ours = Mamba(64, device=DEVICE, **options)
        torch.manual_seed(0)
        theirs = SeedMambaSSM(64, device=DEVICE, **options)
        ours_params, theirs_params = dict(ours.named_parameters()), dict(theirs.named_parameters())
        assert ours_params.keys() == theirs_params.keys(), (ours_params.keys(), theirs_params.keys())
        different = [name for name in ours_params if not torch.equal(ours_params[name], theirs_params[name])]
        print(f"options {options or 'default'}: {len(ours_params)} parameters, bit-identical from the same seed: "
              f"{not different}")
        assert not different, different

# %% [markdown]
# ### Inference three ways: the check
#
# Section 4's three ways to run the block, checked against each other: the whole sequence, chunks
# through `forward` with `InferenceParams`, and `step` token by token, on the same weights and input,
# for several lengths and chunkings, in float64: any difference beyond rounding, in the outputs or in
# the final states, is a bug.

# %%
def three_ways(length, chunks, d_model, d_state, batch, seed=0, dtype=torch.float64):
    """Max difference between whole-sequence, chunked and token-by-token outputs (and final states)."""
    torch.manual_seed(seed)
    block = Mamba(d_model, d_state=d_state, layer_idx=0, backend="triton", device=DEVICE, dtype=dtype)
    hidden = torch.randn(batch, length, d_model, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        whole = block(hidden)
        params = InferenceParams(max_seqlen=length, max_batch_size=batch)
        pieces, start = [], 0
        for size in chunks:
            pieces.append(block(hidden[:, start:start + size], params))
            params.seqlen_offset += size
            start += size
        chunked = torch.cat(pieces, dim=1)
        conv_state, ssm_state = block.allocate_inference_cache(batch, length)
        tokens = torch.cat([block.step(hidden[:, t:t + 1], conv_state, ssm_state)[0] for t in range(length)], 1)
    cached = params.key_value_memory_dict[0]
    return {"chunks": max_err(chunked, whole), "tokens": max_err(tokens, whole),
            "states": max(max_err(conv_state, cached[0]), max_err(ssm_state, cached[1]))}


if ON_GPU:
    sizes, cases = dict(d_model=64, d_state=16, batch=2), {1: [1], 7: [3, 4], 129: [64, 1, 64], 1000: [500, 300, 200]}
else:
    sizes, cases = dict(d_model=4, d_state=4, batch=1), {1: [1], 7: [3, 4], 40: [20, 1, 19]}
for length, chunks in cases.items():
    diffs = three_ways(length, chunks, **sizes)
    print(f"L={length:5d} in chunks {chunks}: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert max(diffs.values()) < 1e-10, diffs

# %% [markdown]
# ### Generation's cost: timed against attention
#
# What the states buy: the cost of the next token. An attention layer's decoding step reads every
# cached key and value, so its memory and time grow with the position; the block's step touches the
# same two states at every position. The cell times both per layer, at the same d_model, batch 1: the
# block's `step`, and an attention step (q, k, v projections, the cache, `F.scaled_dot_product_attention`,
# the output projection). On a GPU both steps are replayed from CUDA graphs, as generation loops run
# them, so the time is the GPU's and not the host's launches.

# %%
import time


def time_us(fn, repeats=20):
    """Median time of fn() in microseconds: on a GPU replayed from a CUDA graph (as generation loops do,
    so the launches' host time is not counted), on a CPU by the host clock (synchronous there)."""
    if ON_GPU:
        return scan_lib.runtime.graph_us(fn)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return sorted(samples)[len(samples) // 2]


class AttentionStep(nn.Module):
    """One attention layer's decoding step over a preallocated key/value cache (batch x heads x max_len x head_dim)."""

    def __init__(self, d_model, heads, max_len, device=None, dtype=None):
        super().__init__()
        self.heads, self.head_dim = heads, d_model // heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False, device=device, dtype=dtype)
        self.out = nn.Linear(d_model, d_model, bias=False, device=device, dtype=dtype)
        self.k_cache = torch.zeros(1, heads, max_len, self.head_dim, device=device, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)

    def forward(self, hidden, position):                                  # hidden: 1 x 1 x d_model
        q, k, v = self.qkv(hidden).view(1, 1, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        self.k_cache[:, :, position] = k[:, :, 0]
        self.v_cache[:, :, position] = v[:, :, 0]
        keys, values = self.k_cache[:, :, :position + 1], self.v_cache[:, :, :position + 1]
        return self.out(F.scaled_dot_product_attention(q, keys, values).transpose(1, 2).reshape(1, 1, -1))


d_model, dtype = (1024, torch.bfloat16) if ON_GPU else (64, torch.float32)
positions = [2**k for k in (range(8, 21, 2) if ON_GPU else range(6, 13, 2))]
torch.manual_seed(0)
block = Mamba(d_model, device=DEVICE, dtype=dtype)
attention = AttentionStep(d_model, heads=d_model // 64, max_len=max(positions) + 1, device=DEVICE, dtype=dtype)
token = torch.randn(1, 1, d_model, device=DEVICE, dtype=dtype)
conv_state, ssm_state = block.allocate_inference_cache(1, max(positions))
rows = []
with torch.no_grad():
    for position in positions:
        mamba_us = time_us(lambda: block.step(token, conv_state, ssm_state))
        attention_us = time_us(lambda: attention(token, position))
        kv_bytes = 2 * (position + 1) * d_model * dtype.itemsize   # the keys and values attended over
        rows.append((position, mamba_us, attention_us, conv_state.nbytes + ssm_state.nbytes, kv_bytes))
print(f"{scan_lib.runtime.describe()}; d_model {d_model}, {dtype}, batch 1, one layer")
print(f"{'position':>9} {'Mamba step us':>14} {'attention us':>13} {'Mamba state B':>14} {'KV cache B':>11}")
for row in rows:
    print(f"{row[0]:>9} {row[1]:>14.1f} {row[2]:>13.1f} {row[3]:>14} {row[4]:>11}")
fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(9, 3.2))
ax_time.loglog(positions, [r[1] for r in rows], "o-", label="Mamba step")
ax_time.loglog(positions, [r[2] for r in rows], "s-", label="attention step")
ax_time.set(xlabel="position", ylabel="time per token (us)", title="time per token, one layer")
ax_mem.loglog(positions, [r[3] for r in rows], "o-", label="Mamba: conv + SSM state")
ax_mem.loglog(positions, [r[4] for r in rows], "s-", label="Transformer: KV cache")
ax_mem.set(xlabel="position", ylabel="bytes", title="memory carried, one layer")
for ax in (ax_time, ax_mem):
    ax.legend(fontsize=8)
fig.tight_layout()
save_figure(fig, "06_generation_cost.png")

# %% [markdown]
# In this run the attention step is the cheaper up to position 4096 (23.1 us against 26.9) and the
# dearer from 16384 on (43.9 us against 27.0). For short contexts attention can still be the cheaper of
# the two (a few small matrix products), and where the lines cross, if they do within these positions,
# depends on the device. The two byte columns are not measurements: the fourth is the size of the two
# state tensors allocated once before the loop, the fifth the size of the keys and values an attention
# step reads at that position, $2 \cdot (\text{position} + 1) \cdot d_{model}$ elements. The next cell
# checks, on the path generation takes (`forward` with `InferenceParams`, which allocates its cache
# itself), that the same two state tensors are updated token after token and never grow.

# %%
torch.manual_seed(0)
gen_block = Mamba(d_model, layer_idx=0, device=DEVICE, dtype=dtype)
gen_params = InferenceParams(max_seqlen=4096, max_batch_size=1)


def cache_tensors(params):
    # (data pointer, bytes) of every tensor the InferenceParams cache holds
    return [(t.data_ptr(), t.nbytes) for pair in params.key_value_memory_dict.values() for t in pair]


with torch.no_grad():
    gen_block(torch.randn(1, 16, d_model, device=DEVICE, dtype=dtype), gen_params)   # a prompt of 16 positions
    gen_params.seqlen_offset = 16
    first = cache_tensors(gen_params)
    for _ in range(64 if ON_GPU else 32):                     # then one token at a time
        gen_block(torch.randn(1, 1, d_model, device=DEVICE, dtype=dtype), gen_params)
        gen_params.seqlen_offset += 1
        assert cache_tensors(gen_params) == first, "the cache was reallocated or grew"
print(f"after the prompt and {gen_params.seqlen_offset - 16} generated tokens: {len(first)} cached tensors, "
      f"{sum(n for _, n in first)} bytes, the same storage at every step")

# %% [markdown]
# ### Selective copying: the code and the run
#
# Section 5's experiment in code: the task's batches (the cell prints two examples), the two models, the
# training loop, and the held-out score that section 5 quotes.

# %%
BLANK, MARKER = 0, 1


def selective_copying_batch(batch, length, n_data, n_symbols, generator, device=DEVICE):
    """A batch of the selective-copying task: n_data tokens drawn from n_symbols data symbols
    (token ids 2 .. n_symbols+1) at random positions among length - n_data blanks, then n_data markers.
    Returns inputs (batch, length), targets (batch, length) and the mask of the scored positions
    (the markers), where the targets are the data tokens in order."""
    n_noise = length - n_data
    data = torch.randint(2, n_symbols + 2, (batch, n_data), generator=generator)
    positions = torch.rand(batch, n_noise, generator=generator).argsort(dim=-1)[:, :n_data].sort(dim=-1).values
    inputs = torch.full((batch, length), BLANK, dtype=torch.long)
    inputs.scatter_(1, positions, data)
    inputs[:, n_noise:] = MARKER
    targets = torch.full((batch, length), BLANK, dtype=torch.long)
    targets[:, n_noise:] = data
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[:, n_noise:] = True
    return inputs.to(device), targets.to(device), mask.to(device)


def show_tokens(tokens):
    """A token sequence as text: '.' blank, '>' marker, letters for the data symbols."""
    return "".join(".>"[t] if t < 2 else chr(ord("a") + t - 2) for t in tokens.tolist())


# The same task and model on both; the GPU trains on larger batches.
copy_cfg = dict(length=32, n_data=4, n_symbols=8, d_model=32, n_layers=1, batch=64 if ON_GPU else 16,
                steps=1600 if ON_GPU else 1200, lr=1e-2)
copy_data = {k: copy_cfg[k] for k in ("length", "n_data", "n_symbols")}

example_in, example_target, example_mask = selective_copying_batch(
    2, generator=torch.Generator().manual_seed(0), **copy_data)
for row in range(2):
    print("input :", show_tokens(example_in[row]))
    print("target:", " " * int((~example_mask[row]).sum()) + show_tokens(example_target[row][example_mask[row]]))

# %% [markdown]
# The model and the LTI baseline of section 5. The cell's last lines check that the baseline's
# $\Delta$, $B$ and $C$ are the same for two different inputs and the selective block's are not.

# %%
class CopyLM(nn.Module):
    """Embedding, n_layers residual blocks x + mixer(RMSNorm(x)), a final RMSNorm and a linear head."""

    def __init__(self, mixer, vocab, d_model, n_layers):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)
        self.norms = nn.ModuleList(nn.RMSNorm(d_model) for _ in range(n_layers))
        self.mixers = nn.ModuleList(mixer(d_model, layer_idx=i) for i in range(n_layers))
        self.norm_f = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens):                         # tokens (batch, L) -> logits (batch, L, vocab)
        x = self.embedding(tokens)
        for norm, mixer in zip(self.norms, self.mixers):
            x = x + mixer(norm(x))
        return self.head(self.norm_f(x))

    def step(self, tokens, caches):                    # tokens (batch,) -> logits (batch, vocab), one position
        x = self.embedding(tokens)[:, None]
        for i, (norm, mixer) in enumerate(zip(self.norms, self.mixers)):
            out, conv_state, ssm_state = mixer.step(norm(x), *caches[i])
            caches[i] = (conv_state, ssm_state)
            x = x + out
        return self.head(self.norm_f(x))[:, 0]


class LTIMamba(scan_lib.Mamba):
    """scan_lib.Mamba with Delta, B and C that do not depend on the input: learned constants broadcast
    over the batch and the positions, so its scan is a linear time-invariant SSM. (x_proj goes unused.)"""

    def __init__(self, d_model, **kwargs):
        super().__init__(d_model, **kwargs)
        like = dict(device=self.A_log.device, dtype=self.dt_proj.weight.dtype)
        self.delta_const = nn.Parameter(torch.zeros(self.d_inner, **like))  # dt_proj.bias still sets the step
        self.B_const = nn.Parameter(torch.randn(self.d_state, **like))
        self.C_const = nn.Parameter(torch.randn(self.d_state, **like))

    def ssm_parameters(self, x):                        # x (batch, d_inner, L): only its shape is used
        batch, _, length = x.shape
        return (self.delta_const[None, :, None].expand(batch, -1, length),
                self.B_const[None, :, None].expand(batch, -1, length),
                self.C_const[None, :, None].expand(batch, -1, length))


# The baseline's Delta, B and C are the same for two different inputs; the selective block's are not.
probe = LTIMamba(8).to(DEVICE), scan_lib.Mamba(8).to(DEVICE)
probe_x = torch.randn(2, 2, 16, 5, device=DEVICE)
for block in probe:
    same = all(torch.equal(p, q) for p, q in zip(block.ssm_parameters(probe_x[0]), block.ssm_parameters(probe_x[1])))
    print(f"{type(block).__name__:8s} Delta, B, C independent of the input: {same}")
    assert same == isinstance(block, LTIMamba)

# %% [markdown]
# Training: AdamW with a linear warm-up over the first tenth of the steps and a cosine decay,
# cross-entropy on the scored positions only, the same batches for both models. Both start from the
# same weights wherever they share a parameter: the cell loads the selective model's `state_dict` into
# the baseline (all but its three constants) and asserts that they are equal.

# %%
from tqdm import tqdm   # a text progress bar (tqdm.auto would want ipywidgets in Jupyter)


def train_copying(model, cfg, seed=0):
    """Train a CopyLM on fresh batches of the task (drawn from `seed`); returns the model and the loss
    and accuracy on the scored positions at every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    steps, warmup = cfg["steps"], cfg["steps"] // 10
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    generator = torch.Generator().manual_seed(seed)
    data = {k: cfg[k] for k in ("length", "n_data", "n_symbols")}
    losses, accuracies = [], []
    progress = tqdm(range(steps), desc=type(model.mixers[0]).__name__, mininterval=1.0)
    for step in progress:
        inputs, targets, mask = selective_copying_batch(cfg["batch"], generator=generator, **data)
        logits = model(inputs)[mask]                       # (scored positions, vocab)
        loss = F.cross_entropy(logits, targets[mask])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        accuracies.append((logits.argmax(-1) == targets[mask]).float().mean().item())
        if step % 10 == 0 or step == steps - 1:
            progress.set_postfix(loss=f"{losses[-1]:.3f}", accuracy=f"{accuracies[-1]:.2f}", refresh=False)
    return model, losses, accuracies


copy_models = {}
for name, mixer in [("Mamba (selective)", scan_lib.Mamba), ("LTI baseline", LTIMamba)]:
    torch.manual_seed(0)
    copy_models[name] = CopyLM(mixer, copy_cfg["n_symbols"] + 2, copy_cfg["d_model"], copy_cfg["n_layers"]).to(DEVICE)
selective_start = copy_models["Mamba (selective)"].state_dict()
not_loaded = copy_models["LTI baseline"].load_state_dict(selective_start, strict=False)
assert not not_loaded.unexpected_keys and {k.rsplit(".", 1)[1] for k in not_loaded.missing_keys} == {
    "delta_const", "B_const", "C_const"}, not_loaded
baseline_start = copy_models["LTI baseline"].state_dict()
assert all(torch.equal(value, baseline_start[key]) for key, value in selective_start.items())
print(f"shared parameters equal at the start: {len(selective_start)} tensors; "
      f"the baseline's own: {sorted(not_loaded.missing_keys)}")
copy_runs = {name: train_copying(model, copy_cfg) for name, model in copy_models.items()}

# %% [markdown]
# The cell asserts the outcome on a fresh held-out batch (the selective model copies at least 90% of
# the tokens, the baseline at most 70%) and prints the accuracy for each slot $k$ (the $k$-th marker).
# The training curves are drawn below.

# %%
with torch.no_grad():
    test_in, test_target, test_mask = selective_copying_batch(
        1000, generator=torch.Generator().manual_seed(1), **copy_data)
    copy_correct = {name: (model(test_in).argmax(-1) == test_target)[test_mask].view(len(test_in), -1).double()
                    for name, (model, _, _) in copy_runs.items()}            # (sequences, n_data) hits
copy_accuracy = {name: hits.mean().item() for name, hits in copy_correct.items()}
chance = 1 / copy_cfg["n_symbols"]
print(f"chance {chance:.3f}")
print(f"{'model':18s} {'held-out':>8s}   by slot k = 1 .. n_data = {copy_cfg['n_data']}")
for name, hits in copy_correct.items():
    print(f"{name:18s} {copy_accuracy[name]:8.3f}   " + " ".join(f"{a:.2f}" for a in hits.mean(0).tolist()))
baseline_slots = copy_correct["LTI baseline"].mean(0)
print(f"the baseline's best slot: k = {baseline_slots.argmax().item() + 1} of {copy_cfg['n_data']}; "
      f"its last slot beats its first: {bool(baseline_slots[-1] > baseline_slots[0])}")
assert copy_accuracy["Mamba (selective)"] >= 0.9
assert copy_accuracy["LTI baseline"] <= 0.7

# %% [markdown]
# ### Selective copying: the CPU path, the sizes and one run
#
# On a CPU, the training above runs through the block's `"torch"` backend: the reference causal
# convolution and `selective_scan_loop`, a Python loop over the `L` positions that autograd differentiates step
# by step. Its cost grows with `L` times the number of blocks, which is why the task keeps `L = 32`
# and one block on both (the CPU profile trains on smaller batches and fewer steps); on a GPU the same model runs `scan_lib.causal_conv1d` and
# `scan_lib.selective_scan`, and generation runs `selective_state_update`.
#
# **Notation.** The task's count is `n_data`, not $K$: $K$ is the convolution's width.
#
# **Why one block.** The sizes are chosen so that the comparison isolates the selection. With one
# block the argument of section 5 covers the whole baseline: besides its time-invariant scan, only the
# causal conv (a window of `d_conv` tokens) and the gate $z_t$ (the current token alone) see the input,
# and neither can skip a gap. Wider and deeper models make the baseline stronger: the nonlinear parts
# of one block can hand the next features such as the number of data tokens seen so far (a kernel that
# barely decays sums them), and the second block recovers part of the task; the gated LTI models in
# the paper's table also score well above chance. In the selective block's solution sketched in
# section 5, the $k$-th data token is always `n_data` $- k$ writes back, however long the gaps: one
# solution the selective block can represent and the LTI block cannot. The two models share everything
# but the selection: the projections, the causal conv, the SiLU gate, $A$, $D$, the initialisation.
#
# **The same starting weights.** A common seed alone would not give the two models the same shared
# weights, because `LTIMamba` draws its `B_const` and `C_const` after its block's weights, so every
# draw after them (the next block, the head) would differ. So the training cell builds the selective
# model, builds the baseline, and loads the selective model's `state_dict` into it.

# %% [markdown]
# **The training curves.** The cell draws both models' loss and accuracy on the scored positions, as
# running means, with chance and the end of the warm-up marked.

# %%
def running_mean(values, window=10):
    v = torch.tensor(values, dtype=torch.float64)
    return (v.cumsum(0) - F.pad(v.cumsum(0), (window, 0))[:-window]) / torch.arange(1, len(v) + 1).clamp(max=window)


fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(7, 3.5))
for name, (_, losses, accuracies) in copy_runs.items():
    ax_loss.plot(running_mean(losses), label=name)
    ax_acc.plot(running_mean(accuracies), label=name)
ax_loss.axhline(math.log(copy_cfg["n_symbols"]), color="gray", ls=":", label="chance")
ax_acc.axhline(chance, color="gray", ls=":", label="chance")
for ax in (ax_loss, ax_acc):   # the learning rate reaches its peak here (train_copying's warm-up)
    ax.axvline(copy_cfg["steps"] // 10, color="gray", ls="--", lw=0.8, label="end of warm-up")
ax_loss.set(xlabel="step", ylabel="cross-entropy (scored positions)", yscale="log", title="loss (mean of 10 steps)")
ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02), title="accuracy (mean of 10 steps)")
ax_acc.legend(fontsize=8)
fig.tight_layout()
save_figure(fig, "06_selective_copying.png")

# %% [markdown]
# **The plateaus.** Both curves start with a short plateau near chance, and in this run both leave it
# before the dashed line, the end of the warm-up (the first tenth of the 1600 steps, over which the
# learning rate climbs linearly to its peak). So that first plateau is most likely the warm-up's small
# early steps (not measured: no run without the warm-up), not a sign that the task is hard to start
# on. The baseline's second plateau is different: its accuracy levels off at about the end of the
# warm-up and then barely moves to the last step (the progress bar of the training cell above, which
# shows a recent batch's accuracy, reads 0.45 at 200 of 1600 steps and 0.49 at the end), while the
# learning rate is at its peak and then decays. That plateau is not the warm-up: it is what this
# baseline reaches at this learning rate.
#
# **By slot.** A fixed kernel that decays weighs recent tokens most, and the most recent data token is
# the right answer only at the last marker; so the baseline is expected to do best in the later slots:
# the later the marker, the fewer data tokens come after the one it must copy.
#
# **What this comparison is.** One training run of each model, one seed, and one learning rate, chosen
# for the selective model and not tuned for the baseline. It shows a gap in one run, not a
# distribution over seeds, and a better-tuned baseline could score higher (though, by the argument of
# section 5, not solve the task with one block). More seeds and a learning-rate sweep for the baseline
# would multiply the training time, which is already most of this chapter's CPU run.

# %% [markdown]
# **Generation with the recurrent path.** The trained model reads the held-out sequences above one
# token at a time through `step`, carrying only each block's two states (section 4). Its logits must
# match the whole-sequence forward's, and so must the greedy tokens.

# %%
copy_model = copy_runs["Mamba (selective)"][0]
gen_in, gen_target, gen_mask = test_in[:8], test_target[:8], test_mask[:8]
with torch.no_grad():
    full_logits = copy_model(gen_in)                                      # (batch, L, vocab)
    caches = [mixer.allocate_inference_cache(gen_in.shape[0], gen_in.shape[1]) for mixer in copy_model.mixers]
    step_logits = torch.stack([copy_model.step(gen_in[:, t], caches) for t in range(gen_in.shape[1])], dim=1)
step_tokens, full_tokens = step_logits.argmax(-1), full_logits.argmax(-1)
logit_err, logit_tol = max_err(step_logits, full_logits), 1e-4 * full_logits.abs().max().item()
for row in range(3):
    print("input:", show_tokens(gen_in[row]), " target:", show_tokens(gen_target[row][gen_mask[row]]),
          " step path:", show_tokens(step_tokens[row][gen_mask[row]]))
print(f"max |step logits - forward logits| = {logit_err:.2e} (tolerance {logit_tol:.1e}); "
      f"greedy tokens agree at the scored positions: {torch.equal(step_tokens[gen_mask], full_tokens[gen_mask])}")
assert logit_err <= logit_tol
assert torch.equal(step_tokens[gen_mask], full_tokens[gen_mask])

# %% [markdown]
# ### The scan three ways
#
# The block's scan can be written three ways, from the most obvious to the fastest:
#
# 1. **a loop over positions** in PyTorch (`selective_scan_loop`, the CPU backend): one small kernel
#    launch per position on a GPU, so time grows with $L$ however wide the GPU is;
# 2. **PyTorch's `associative_scan`** (`torch._higher_order_ops.associative_scan`, still private in
#    the versions this course runs on) with chapter 02's combine operator
#    $(a_1, b_1) \circ (a_2, b_2) = (a_1 a_2,\; a_2 b_1 + b_2)$ on the discretised pairs, under
#    `torch.compile`, which turns it into a generated Triton scan on a GPU. It materialises $a$ and $b$
#    for every (batch, channel, position, state): $N$ times the input's size, twice;
# 3. **`scan_lib.selective_scan`**, which computes $a$ and $b$ on chip and never writes the states.
#
# On a CPU `associative_scan` has no fused form (its `"pointwise"` mode needs CUDA), so the cell
# compiles the `"generic"` mode there, with the `aot_eager` backend to keep the compile short.

# %%
from torch._higher_order_ops.associative_scan import associative_scan
from scan_lib.ema import first_order_op

combine_pairs = first_order_op.fn   # chapter 02's operator as a Python function (the @triton.jit wraps it)


def combine(left, right):
    """(a1, b1) then (a2, b2) = (a1 a2, a2 b1 + b2), on pairs of tensors."""
    return combine_pairs(*left, *right)


def selective_scan_assoc(u, delta, A, B, C, D, z, delta_bias):
    """The block's scan (softplus on, B and C batch x N x L) by associative_scan along positions."""
    delta = F.softplus(delta + delta_bias[:, None])
    a = torch.exp(delta[..., None] * A[:, None, :])                          # batch x dim x L x N
    b = (delta * u)[..., None] * B.transpose(1, 2)[:, None]                  # batch x dim x L x N
    _, h = associative_scan(combine, (a, b), dim=2, combine_mode="pointwise" if ON_GPU else "generic")
    y = torch.einsum("bdln,bnl->bdl", h, C) + D[:, None] * u
    return y * F.silu(z)


compiled_assoc = torch.compile(selective_scan_assoc, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
batch, dim, length, n_states = (8, 1024, 2048, 16) if ON_GPU else (2, 8, 129, 4)
torch.manual_seed(0)
u, delta, z = (torch.randn(batch, dim, length, device=DEVICE) for _ in range(3))
A = -torch.rand(dim, n_states, device=DEVICE) - 0.5
B, C = (torch.randn(batch, n_states, length, device=DEVICE) for _ in range(2))
D, delta_bias = torch.randn(dim, device=DEVICE), torch.randn(dim, device=DEVICE) - 2
args = (u, delta, A, B, C, D, z, delta_bias)
ways = {
    "loop (PyTorch)": lambda: selective_scan_loop(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True),
    "associative_scan, compiled": lambda: compiled_assoc(*args),
    "scan_lib.selective_scan": lambda: scan_lib.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True),
}
reference = selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True)
for name, way in ways.items():
    err = rel_err(way(), reference)
    print(f"{name:28s} relative error against float64: {err:.1e}")
    assert err < 1e-4, name
if not ON_GPU:
    print("skipped: the speed comparison needs a GPU")
else:
    print(f"{scan_lib.runtime.describe()}; batch {batch}, dim {dim}, L {length}, N {n_states}, float32, forward")
    for name, way in ways.items():
        print(f"{name:28s} {scan_lib.runtime.median_us(way, warmup=5, rep=50):10.0f} us")

# %% [markdown]
# ## References
#
# - Gu and Dao, "Mamba: linear-time sequence modeling with selective state spaces", arXiv:2312.00752, 2023. (the block, its initialisation, and the selective-copying task).
# - The mamba_ssm package (the Mamba module, its state_dict and generation loop): https://github.com/state-spaces/mamba
# - The causal-conv1d package (the short convolution's CUDA kernels): https://github.com/Dao-AILab/causal-conv1d
