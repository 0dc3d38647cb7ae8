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
# # 04 · Many hidden states at once
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/scan-course/scans-the-hard-way/blob/main/notebooks/04_multistate.ipynb)
#
# Chapters 02 and 03 scanned one state per position. A state space model such as Mamba keeps
# **N states per position** (N = 16 in Mamba), each with its own decay, and reads its output out of
# all of them. The arithmetic hardly changes; what changes is the memory the states would occupy if
# we wrote them out. This chapter is about not writing them out: kernels that keep the states on chip
# (3, 4), a backward that *recomputes* them (5), and the exported `scan_lib.multistate_scan` with, on a
# GPU, its speed (6, 7).

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
#| default_exp multistate

# %%
import math

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

from scan_lib.ema import first_order_op
from scan_lib.multistate import default_block_l, num_warps_for  # launch configuration: see "Going deeper"
from scan_lib.runtime import save_figure

# %% [markdown]
# ## 1 · The recurrence
#
# At every position $t$ there are $N$ states $h_t[0], \dots, h_t[N-1]$. Each is chapter 02's first-order
# recurrence with its own gate $a_t[n]$ and its own input coefficient $B_t[n]$, all fed by the same scalar
# input $x_t$; the output mixes them with the output coefficients $C_t[n]$:
#
# $$h_t[n] = a_t[n]\, h_{t-1}[n] + b_t[n], \quad b_t[n] = B_t[n]\, x_t, \qquad
# y_t = \sum_{n=0}^{N-1} C_t[n]\, h_t[n], \qquad h_{-1}[n] = \text{the initial state (zero by default)}.$$
#
# This is Mamba's scan for one channel before discretisation. In code `a, b, c` are `(batch, N, L)`,
# Mamba's layout, and `x` is `(batch, L)`: **`b` holds $B$ and `c` holds $C$**. A batch row is one
# independent sequence (in Mamba, one (sample, channel) pair). The reference is the loop itself, in
# float64 ("Going deeper: four states, four decay rates" plots it for a pulse).

# %%
#| export
"""The multi-state scan h_t[n] = a_t[n] h_{t-1}[n] + B_t[n] x_t, y_t = sum_n C_t[n] h_t[n] (the arguments
b and c hold B and C): a float64 reference, a fused Triton forward and backward that keep the N states
on chip and write only the states at chunk boundaries, torch custom ops around them, and the public API."""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from scan_lib.ema import accumulator_dtype, first_order_op
from scan_lib.runtime import apply, check_float_tensor, check_same_device, custom_op, next_power_of_2, plus, zero_in_graph


def multistate_scan_ref(a, b, c, x, initial_state=None):
    """The recurrence as a loop over time, differentiable by autograd (run it in float64 for checks).

    a, b (= B), c (= C): (batch, N, L); x: (batch, L); initial_state: (batch, N) or None (zeros).
    Returns y (batch, L) and the last state h_{L-1} (batch, N)."""
    batch, n_states, length = a.shape
    h = a.new_zeros(batch, n_states) if initial_state is None else initial_state  # batch x N
    ys = []
    for t in range(length):
        h = a[:, :, t] * h + b[:, :, t] * x[:, None, t]  # batch x N
        ys.append((c[:, :, t] * h).sum(dim=1))            # batch
    return torch.stack(ys, dim=1), h


# %% [markdown]
# Nothing couples $n$ and $n'$, so the reference must equal $N$ runs of chapter 03's `scan_lib.linear_scan`
# over the rows $(a[n], B[n] x)$ (`reference_states`, all the states), weighted by $C$ and added up.
# Inputs throughout (`random_inputs`): gates in $(0.9, 1)$, like Mamba's $e^{\Delta A}$; $B$, $C$, $x$
# standard normal.

# %%
def random_inputs(batch, n_states, length, dtype=torch.float32, seed=0):
    """a in (0.9, 1); b (= B), c (= C), x standard normal. Shapes (batch, N, L) x 3 and (batch, L)."""
    g = torch.Generator().manual_seed(seed)
    a = 0.9 + 0.1 * torch.rand(batch, n_states, length, generator=g, dtype=torch.float64)
    b, c = (torch.randn(batch, n_states, length, generator=g, dtype=torch.float64) for _ in range(2))
    x = torch.randn(batch, length, generator=g, dtype=torch.float64)
    return [t.to(device=DEVICE, dtype=dtype) for t in (a, b, c, x)]


def rel_err(got, want):
    """Largest error relative to the largest |want|."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def reference_states(a, b, x, initial_state=None):
    """All states h, batch x N x L: N first-order scans, chapter 03's linear_scan over the rows (a[n], B[n] x),
    run on DEVICE (the kernels need CUDA tensors on a GPU) and returned on a's device."""
    on_device = [None if t is None else t.to(DEVICE) for t in (a, b * x[:, None, :], initial_state)]
    return scan_lib.linear_scan(*on_device).to(a.device)


for length in (1, 7, 129, 1000):
    a, b, c, x = random_inputs(3, 5, length, dtype=torch.float64, seed=length)
    err = rel_err(multistate_scan_ref(a, b, c, x)[0], (c * reference_states(a, b, x)).sum(dim=1))
    print(f"L = {length:4d}: reference vs N linear_scans, max rel err {err:.1e}")
    assert err < 1e-12

# %% [markdown]
# ## 2 · The states are the expensive part
#
# Writing the states out (a scan kernel writes $h$, a second kernel reads it back with $C$) moves two
# more $(\text{batch}, N, L)$ tensors through the GPU's main memory (HBM), and autograd keeps them for
# the backward. The fused design (Mamba's CUDA kernel) never writes them: a chunk of
# $L_{\text{block}} \times N$ states lives on chip, is reduced to $y$ there, and only its last $N$ states
# are carried to the next chunk; for the backward it saves the state entering each chunk. It moves
#
# $$\underbrace{3\,\text{batch}\,N L + \text{batch}\,L}_{a,\ B,\ C,\ x\ \text{read}} +
# \underbrace{\text{batch}\,L + \text{batch}\,N}_{y,\ \text{last state written}}
# \ \big(+\ \text{batch}\,\lceil L/L_{\text{block}}\rceil N\ \text{boundary states, for training}\big)$$
#
# numbers, here at batch = 4096 sequences of $L = 1024$, $N = 16$, in float32. ("Going deeper: counting
# the bytes" checks the formula and draws both designs.)

# %%
def fused_bytes(batch, length, n_states, itemsize=4, block_l=None, acc_itemsize=4):
    """The formula above: the fused forward's traffic; with block_l, plus the saved boundary states."""
    numbers = 3 * batch * n_states * length + 2 * batch * length + batch * n_states
    boundary = 0 if block_l is None else batch * math.ceil(length / block_l) * n_states * acc_itemsize
    return numbers * itemsize + boundary


batch_big, length_big, n_states_big = 4096, 1024, 16
block_big = default_block_l(length_big, n_states_big)            # the chunk length multistate_scan picks
states_big = batch_big * n_states_big * length_big * 4            # all states, float32, bytes
fused_big = fused_bytes(batch_big, length_big, n_states_big)
for design, nbytes in {"fused (states on chip)": fused_big, "two passes (states via HBM)": fused_big + 2 * states_big,
                       "all states (batch, N, L)": states_big, f"boundary states, block_l={block_big}":
                       fused_bytes(batch_big, length_big, n_states_big, block_l=block_big) - fused_big}.items():
    print(f"{design:32s} {nbytes / 2**20:8.0f} MiB")

# %% [markdown]
# ## 3 · The simplest kernel: one block holds the whole sequence
#
# One program per sequence loads $L_{\text{block}} \times N$ tiles of $a$, $B$, $C$ (time along axis 0,
# state along axis 1) and $L_{\text{block}}$ inputs $x$. Every column $n$ is an independent scan of the
# pairs $(a_t[n],\, B_t[n] x_t)$, so one `tl.associative_scan(..., axis=0)` with chapter 02's
# `first_order_op` (it composes *earlier then later*: $(a_1, b_1) \circ (a_2, b_2) = (a_1 a_2,\, a_2 b_1 + b_2)$)
# does all $N$ at once. Its second output is $h_t[n]$ (from $h_{-1} = 0$); `tl.sum(c * h, axis=1)` gives
# $y$. Tiles are powers of two; padding loads $a = 1$, $B = 0$, the identity step. The states exist only
# in registers.

# %%
@triton.jit
def multistate_single_block_kernel(
    A, B, C, X, Y,          # A, B, C: batch x N x L;  X, Y: batch x L
    length, n_states,
    BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)                        # int64: seq * N * L may pass 2^31
    t = tl.arange(0, BLOCK_L)                                  # BLOCK_L: time
    n = tl.arange(0, BLOCK_N)                                  # BLOCK_N: state
    mask = (t < length)[:, None] & (n < n_states)[None, :]     # BLOCK_L x BLOCK_N
    tile = seq * n_states * length + n[None, :] * length + t[:, None]   # BLOCK_L x BLOCK_N offsets
    a = tl.load(A + tile, mask=mask, other=1.0).to(tl.float32)
    b = tl.load(B + tile, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(C + tile, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + seq * length + t, mask=t < length, other=0.0).to(tl.float32)   # BLOCK_L
    ### BEGIN SOLUTION
    ### HINT: h = the N scans at once: tl.associative_scan of the pairs (a, B x) along the time axis with first_order_op; y = sum over the states of C * h
    _, h = tl.associative_scan((a, b * x[:, None]), axis=0, combine_fn=first_order_op)  # BLOCK_L x BLOCK_N
    y = tl.sum(c * h, axis=1)                                  # BLOCK_L
    ### END SOLUTION
    tl.store(Y + seq * length + t, y.to(Y.dtype.element_ty), mask=t < length)


def multistate_single_block(a, b, c, x):
    batch, n_states, length = a.shape
    y = torch.empty_like(x)
    multistate_single_block_kernel[(batch,)](
        a, b, c, x, y, length, n_states,
        BLOCK_L=triton.next_power_of_2(length), BLOCK_N=triton.next_power_of_2(n_states),
    )
    return y


# %% [markdown]
# How close must it be? Relative to the largest $|y|$, `tolerance` allows one rounding of the output to
# its dtype, plus $32\sqrt{L}$ units of the accumulator ($2^{-24}$ in float32, $2^{-53}$ in float64)
# for the roundings the recurrence carries along the sequence ("Going deeper: the tolerance, and the
# bugs the checks catch" says where it comes from). It has the shape of chapter 01's, with $\sqrt{L}$
# where a tree had $\log_2 L$; chapter 05 checks the selective scan with this same function.

# %%
#| export
import math

from scan_lib.runtime import INTERPRET

# Largest relative error of one rounding to each dtype: round to nearest, except the interpreter's
# float32 -> bfloat16, which truncates (chapter 00).
UNIT_ROUNDOFF = {torch.float64: 2**-53, torch.float32: 2**-24, torch.float16: 2**-11,
                 torch.bfloat16: 2**-7 if INTERPRET else 2**-8}


def tolerance(dtype, length):
    """Largest error relative to max |reference| of a recurrence carried over `length` steps: one rounding
    of the output to dtype, plus 32 sqrt(L) roundings of the accumulator (float32; float64 for float64),
    with L at least 16."""
    accumulator = torch.float64 if dtype == torch.float64 else torch.float32
    return UNIT_ROUNDOFF[dtype] + 32 * math.sqrt(max(length, 16)) * UNIT_ROUNDOFF[accumulator]


# %%
print(f"{'L':>5} {'N':>3} {'max rel err':>12} {'tolerance':>10}  ok")
for length in (1, 7, 129):
    for n_states in (4, 5):
        a, b, c, x = random_inputs(3, n_states, length)
        y_ref, _ = multistate_scan_ref(*(t.double() for t in (a, b, c, x)))
        err, tol = rel_err(multistate_single_block(a, b, c, x), y_ref), tolerance(torch.float32, length)
        print(f"{length:5d} {n_states:3d} {err:12.2e} {tol:10.1e}  {err < tol}")
        assert err < tol

# %% [markdown]
# ## 4 · The blocked kernel: a carry of N states in registers
#
# The single tile grows with $L$ until it no longer fits in registers ("Going deeper: the largest tile").
# The fix is chapters 01 and 02's: one program still owns one sequence, but walks it in chunks of
# $L_{\text{block}}$ positions, holding $h_{\text{in}}[n]$, the $N$ states after the previous chunk. The
# chunk's scan gives, per position, $(P_t[n], \tilde h_t[n])$: the product of the gates since the chunk
# start and the state reached from zero, so $h_t[n] = P_t[n]\, h_{\text{in}}[n] + \tilde h_t[n]$
# (`scan_tile`). The next carry is the tile's last row, taken by `row_of` as a masked sum: registers
# cannot be indexed by a variable. When gradients will be needed the program writes $h_{\text{in}}$ of
# every chunk (`SAVE_CHUNKS`), the only states that reach memory. It accumulates in `ACC` (float32;
# float64 for float64).

# %%
#| export
@triton.jit
def scan_tile(a, bx, h_in):
    """States of one chunk: a, bx are BLOCK_L x BLOCK_N (time on axis 0), h_in the BLOCK_N states before it."""
    a_prod, h_from_zero = tl.associative_scan((a, bx), axis=0, combine_fn=first_order_op)
    return a_prod * h_in[None, :] + h_from_zero


@triton.jit
def row_of(tile, rows, i):
    """Row i of a BLOCK_L x BLOCK_N tile as a BLOCK_N vector (registers are not indexable: a masked sum)."""
    return tl.sum(tl.where(rows[:, None] == i, tile, 0.0), axis=0)


@triton.jit
def multistate_fwd_kernel(
    A, B, C, X, H0, Y, H_LAST, H_CHUNKS,  # A, B, C: batch x N x L; X, Y: batch x L; H0, H_LAST: batch x N;
    length, n_states, n_chunks,           # H_CHUNKS: batch x n_chunks x N (state entering each chunk)
    HAS_H0: tl.constexpr, SAVE_CHUNKS: tl.constexpr, ACC: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    A, B, C = A + seq * n_states * length, B + seq * n_states * length, C + seq * n_states * length
    X, Y = X + seq * length, Y + seq * length
    rows = tl.arange(0, BLOCK_L)                                  # BLOCK_L: time within a chunk
    n = tl.arange(0, BLOCK_N)                                     # BLOCK_N: state index
    h = tl.zeros([BLOCK_N], dtype=ACC)                            # the carry, in registers
    if HAS_H0:
        h = tl.load(H0 + seq * n_states + n, mask=n < n_states, other=0.0).to(ACC)
    chunk = 0
    while chunk < n_chunks:   # a while loop: Triton 3.6's interpreter under NumPy >= 2.4 cannot `range` over a runtime int
        t = chunk * BLOCK_L + rows                                # BLOCK_L
        mask = (t < length)[:, None] & (n < n_states)[None, :]    # BLOCK_L x BLOCK_N
        tile = n[None, :] * length + t[:, None]                   # BLOCK_L x BLOCK_N offsets
        if SAVE_CHUNKS:
            tl.store(H_CHUNKS + (seq * n_chunks + chunk) * n_states + n, h, mask=n < n_states)
        a = tl.load(A + tile, mask=mask, other=1.0).to(ACC)
        b = tl.load(B + tile, mask=mask, other=0.0).to(ACC)
        c = tl.load(C + tile, mask=mask, other=0.0).to(ACC)
        x = tl.load(X + t, mask=t < length, other=0.0).to(ACC)   # BLOCK_L
        ### BEGIN SOLUTION
        ### HINT: states = scan_tile of the pairs (a, B x) from the carry h; store y_t = sum_n C * states; the new carry h = the tile's last row (row_of)
        states = scan_tile(a, b * x[:, None], h)                  # BLOCK_L x BLOCK_N, never stored
        tl.store(Y + t, tl.sum(c * states, axis=1).to(Y.dtype.element_ty), mask=t < length)
        h = row_of(states, rows, BLOCK_L - 1)
        ### END SOLUTION
        chunk += 1
    tl.store(H_LAST + seq * n_states + n, h.to(H_LAST.dtype.element_ty), mask=n < n_states)


def multistate_forward(a, b, c, x, initial_state, block_l, save_chunks):
    """Launch the fused forward on checked, contiguous inputs. Returns y (batch, L), the last state
    (batch, N) and the state entering each chunk (batch, n_chunks, N) in the accumulator dtype, or an
    empty (batch, 0, N) unless save_chunks."""
    batch, n_states, length = a.shape
    n_chunks = triton.cdiv(length, block_l)
    acc = torch.promote_types(a.dtype, torch.float32)   # float64 stays, half precision computes in float32
    y = torch.empty_like(x)
    h_last = torch.empty(batch, n_states, device=a.device, dtype=a.dtype)
    h_chunks = torch.empty(batch, n_chunks if save_chunks else 0, n_states, device=a.device, dtype=acc)
    with torch.cuda.device_of(a):
        multistate_fwd_kernel[(batch,)](  # unused pointer arguments get a real tensor: h_last
            a, b, c, x, initial_state if initial_state is not None else h_last, y, h_last,
            h_chunks if save_chunks else h_last,
            length, n_states, n_chunks,
            HAS_H0=initial_state is not None, SAVE_CHUNKS=save_chunks,
            ACC=accumulator_dtype(acc),
            BLOCK_L=block_l, BLOCK_N=triton.next_power_of_2(n_states), num_warps=num_warps_for(block_l, n_states),
        )
    return y, h_last, h_chunks


# %% [markdown]
# Checks in float64, with and without an initial state; the state saved entering chunk $k$ must be
# $h_{k L_{\text{block}} - 1}$ (`reference_states`).

# %%
print(f"{'L':>5} {'block':>5} {'h0':>5} {'err y':>9} {'err last':>9} {'err chunks':>10}  ok")
for length in (1, 7, 129, 1000):
    for block_l in (16, 64):
        for with_h0 in (False, True):
            a, b, c, x = random_inputs(2, 5, length, dtype=torch.float64, seed=length)
            h0 = torch.randn(2, 5, dtype=torch.float64, device=DEVICE) if with_h0 else None
            y, h_last, h_chunks = multistate_forward(a, b, c, x, h0, block_l, save_chunks=True)
            y_ref, last_ref = multistate_scan_ref(a, b, c, x, h0)
            states = reference_states(a, b, x, h0)                           # batch x N x L
            entering = torch.cat([torch.zeros_like(states[..., :1]) if h0 is None else h0[..., None],
                                  states[..., block_l - 1:-1:block_l]], dim=-1).transpose(1, 2)  # batch x n_chunks x N
            errs = rel_err(y, y_ref), rel_err(h_last, last_ref), rel_err(h_chunks, entering)
            ok = max(errs) < 1e-12
            print(f"{length:5d} {block_l:5d} {str(with_h0):>5} {errs[0]:9.1e} {errs[1]:9.1e} {errs[2]:10.1e}  {ok}")
            assert ok

# %% [markdown]
# ## 5 · The backward pass
#
# Given $\partial\mathcal L/\partial y_t$ and $g[n]$, the gradient that arrives at the returned last
# state (`dh_last`), the adjoint $\delta_t[n] = \partial\mathcal L / \partial h_t[n]$ collects what flows
# into $h_t[n]$: through $y_t$ (weight $C_t[n]$) and through $h_{t+1}[n] = a_{t+1}[n] h_t[n] + \dots$
# (weight $a_{t+1}[n]$):
#
# $$\delta_t[n] = a_{t+1}[n]\, \delta_{t+1}[n] + C_t[n]\, \frac{\partial\mathcal L}{\partial y_t},
# \qquad \delta_{L}[n] := g[n],\ a_{L}[n] := 1 ,$$
#
# so the last position needs no special case (why, and a check against autograd: "Going deeper: the
# backward formulas as a loop"). As in chapter 03, this is the same first-order recurrence **run from
# right to left**, per state, with the gate **shifted by one**. Every gradient is then a local product:
#
# $$\frac{\partial\mathcal L}{\partial a_t[n]} = \delta_t[n]\, h_{t-1}[n], \quad
# \frac{\partial\mathcal L}{\partial B_t[n]} = \delta_t[n]\, x_t, \quad
# \frac{\partial\mathcal L}{\partial C_t[n]} = \frac{\partial\mathcal L}{\partial y_t}\, h_t[n], \quad
# \frac{\partial\mathcal L}{\partial x_t} = \sum_n \delta_t[n]\, B_t[n], \quad
# \frac{\partial\mathcal L}{\partial h_{-1}[n]} = a_0[n]\, \delta_0[n].$$
#
# The gradients of $a$ and $C$ need the forward states; storing them would bring back the
# $(\text{batch}, N, L)$ tensor, so the kernel **recomputes** each chunk's states from the saved state
# entering it (as Mamba does). One program per sequence walks the chunks **from last to first**,
# carrying $\delta$ for the $N$ states in registers. For the chunk starting at $s$:
# 1. scan the pairs shifted right by one, $(a_{t-1}, B_{t-1} x_{t-1})$ (loaded from one position earlier,
#    `A + tile - 1`; the identity at the first row), from the saved $h_{s-1}$: that gives $h_{t-1}$ on every
#    row, and $h_t = a_t h_{t-1} + B_t x_t$;
# 2. scan $(a_{t+1}[n], C_t[n]\, \partial\mathcal L/\partial y_t)$ (gates loaded from one position later,
#    `A + tile + 1`) with `reverse=True`, which composes *later then earlier*, and apply the carry:
#    $\delta_t = Q_t \delta_{\text{carry}} + \tilde\delta_t$, $Q_t$ the product of the shifted gates from $t$
#    to the chunk's end;
# 3. write the four gradients; the new carry is the first row, $\delta_s$.
#
# In the code `adj` holds the adjoint $\delta$ (chapter 05 keeps `delta` for Mamba's step $\Delta$).

# %%
#| export
@triton.jit
def multistate_bwd_kernel(
    A, B, C, X, H_CHUNKS, DY, DH_LAST,    # A, B, C: batch x N x L; X, DY: batch x L; H_CHUNKS: batch x n_chunks x N
    DA, DB, DC, DX, DH0,                  # DA, DB, DC: batch x N x L; DX: batch x L; DH0, DH_LAST: batch x N
    length, n_states, n_chunks,
    ACC: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    A, B, C = A + seq * n_states * length, B + seq * n_states * length, C + seq * n_states * length
    DA, DB, DC = DA + seq * n_states * length, DB + seq * n_states * length, DC + seq * n_states * length
    X, DY, DX = X + seq * length, DY + seq * length, DX + seq * length
    rows = tl.arange(0, BLOCK_L)                                  # BLOCK_L: time within a chunk
    n = tl.arange(0, BLOCK_N)                                     # BLOCK_N: state index
    adj = tl.load(DH_LAST + seq * n_states + n, mask=n < n_states, other=0.0).to(ACC)  # adjoint carry
    chunk = n_chunks - 1
    while chunk >= 0:                                             # right to left
        t = chunk * BLOCK_L + rows                                # BLOCK_L
        t_ok = t < length
        mask = t_ok[:, None] & (n < n_states)[None, :]            # BLOCK_L x BLOCK_N
        tile = n[None, :] * length + t[:, None]                   # BLOCK_L x BLOCK_N offsets
        # 1. recompute h_{t-1} and h_t from the state that entered the chunk
        h_in = tl.load(H_CHUNKS + (seq * n_chunks + chunk) * n_states + n, mask=n < n_states, other=0.0)
        prev = mask & (rows > 0)[:, None]
        a_prev = tl.load(A + tile - 1, mask=prev, other=1.0).to(ACC)
        b_prev = tl.load(B + tile - 1, mask=prev, other=0.0).to(ACC)
        x_prev = tl.load(X + t - 1, mask=t_ok & (rows > 0), other=0.0).to(ACC)
        h_prev = scan_tile(a_prev, b_prev * x_prev[:, None], h_in)       # BLOCK_L x BLOCK_N: h_{t-1}
        a = tl.load(A + tile, mask=mask, other=1.0).to(ACC)
        b = tl.load(B + tile, mask=mask, other=0.0).to(ACC)
        c = tl.load(C + tile, mask=mask, other=0.0).to(ACC)
        x = tl.load(X + t, mask=t_ok, other=0.0).to(ACC)
        dy = tl.load(DY + t, mask=t_ok, other=0.0).to(ACC)
        h = a * h_prev + b * x[:, None]                                  # h_t
        # 2. the adjoint: reversed scan of (a_{t+1}, C_t dy_t), then the carry from the right
        ### BEGIN SOLUTION
        ### HINT: adj_tile = the adjoint delta_t (a tile of time x states): load the shifted gates a_{t+1} (1 past the end), scan (a_{t+1}, C dy) right to left with first_order_op, apply the carry adj from the right
        a_next = tl.load(A + tile + 1, mask=(t + 1 < length)[:, None] & (n < n_states)[None, :], other=1.0).to(ACC)
        a_suffix, adj_from_zero = tl.associative_scan((a_next, c * dy[:, None]), axis=0,
                                                        combine_fn=first_order_op, reverse=True)
        adj_tile = a_suffix * adj[None, :] + adj_from_zero         # adj_t
        ### END SOLUTION
        # 3. the gradients
        tl.store(DA + tile, (adj_tile * h_prev).to(DA.dtype.element_ty), mask=mask)
        tl.store(DB + tile, (adj_tile * x[:, None]).to(DB.dtype.element_ty), mask=mask)
        tl.store(DC + tile, (h * dy[:, None]).to(DC.dtype.element_ty), mask=mask)
        tl.store(DX + t, tl.sum(adj_tile * b, axis=1).to(DX.dtype.element_ty), mask=t_ok)
        adj = row_of(adj_tile, rows, 0)
        chunk -= 1
    a_first = tl.load(A + n * length, mask=n < n_states, other=0.0).to(ACC)
    tl.store(DH0 + seq * n_states + n, (a_first * adj).to(DH0.dtype.element_ty), mask=n < n_states)


def multistate_backward(a, b, c, x, h_chunks, dy, dh_last, block_l):
    """Launch the fused backward. dy: (batch, L); dh_last: (batch, N). Returns the gradients of a, b, c
    (batch, N, L), x (batch, L) and the initial state (batch, N), in the inputs' dtype."""
    batch, n_states, length = a.shape
    da, db, dc = torch.empty_like(a), torch.empty_like(b), torch.empty_like(c)
    dx, dh0 = torch.empty_like(x), torch.empty(batch, n_states, device=a.device, dtype=a.dtype)
    with torch.cuda.device_of(a):
        multistate_bwd_kernel[(batch,)](
            a, b, c, x, h_chunks, dy.contiguous(), dh_last.contiguous(), da, db, dc, dx, dh0,
            length, n_states, h_chunks.shape[1],
            ACC=accumulator_dtype(h_chunks.dtype),
            BLOCK_L=block_l, BLOCK_N=triton.next_power_of_2(n_states), num_warps=num_warps_for(block_l, n_states),
        )
    return da, db, dc, dx, dh0


# %% [markdown]
# Every gradient against autograd through the float64 loop, at the same lengths and chunk lengths, with
# an initial state and a gradient into the last state.

# %%
print(f"{'L':>5} {'block':>5} " + " ".join(f"{'d' + k:>8}" for k in ("a", "B", "C", "x", "h0")) + "  ok")
for length in (1, 7, 129, 1000):
    for block_l in (16, 64):
        a, b, c, x = (t.requires_grad_() for t in random_inputs(2, 5, length, dtype=torch.float64, seed=length))
        h0 = torch.randn(2, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
        dy = torch.randn(2, length, dtype=torch.float64, device=DEVICE)
        dh_last = torch.randn(2, 5, dtype=torch.float64, device=DEVICE)
        want = torch.autograd.grad(multistate_scan_ref(a, b, c, x, h0), (a, b, c, x, h0), (dy, dh_last))
        with torch.no_grad():
            _, _, h_chunks = multistate_forward(a, b, c, x, h0, block_l, save_chunks=True)
            got = multistate_backward(a, b, c, x, h_chunks, dy, dh_last, block_l)
        errs = [rel_err(g, w) for g, w in zip(got, want)]
        ok = max(errs) < 1e-12
        print(f"{length:5d} {block_l:5d} " + " ".join(f"{e:8.1e}" for e in errs) + f"  {ok}")
        assert ok

# %% [markdown]
# ## 6 · The exported API
#
# The docstring is the contract. The function checks its arguments and runs the forward as a torch
# custom op, through an autograd Function when a gradient may be needed; its helpers are defined in
# "Going deeper: a torch op, autograd, and transforms", and the dtype check after it imports the
# exported module, which has them all.

# %%
#| export
def multistate_scan(a, b, c, x, initial_state=None, return_last_state=False, block_l=None):
    """N hidden states per position: h_t[n] = a_t[n] h_{t-1}[n] + B_t[n] x_t, y_t = sum_n C_t[n] h_t[n].

    a, b (= B, the input coefficients), c (= C, the output coefficients): (batch, N, L); x: (batch, L);
    initial_state: (batch, N) or None (zeros). Returns y (batch, L), or (y, last_state) with
    last_state = h_{L-1} (batch, N) if return_last_state. fp16/bf16/fp32 accumulate in fp32, fp64 in
    fp64; outputs have the inputs' dtype. Differentiable once (second derivatives raise). The
    (batch, N, L) states are never written to memory; block_l is the chunk length (a power of two)."""
    block_l = check_multistate_inputs(a, b, c, x, initial_state, block_l)
    if a.numel() == 0:
        y, h_last = empty_multistate_scan(a, b, c, x, initial_state)
        return (y, h_last) if return_last_state else y
    tensors = (a, b, c, x) if initial_state is None else (a, b, c, x, initial_state)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        y, h_last, _ = apply(MultistateScan, a, b, c, x, initial_state, block_l)
    else:
        y, h_last, _ = multistate_fwd(a, b, c, x, initial_state, block_l, False)
    return (y, h_last) if return_last_state else y


# %% [markdown]
# Every dtype against the float64 reference of the same (rounded) inputs, with section 3's `tolerance`:

# %%
from scan_lib.multistate import multistate_scan  # the exported copy, wiring included, as a user imports it

print(f"{'dtype':>15} {'L':>5} {'err y':>9} {'err last':>9} {'tolerance':>9}  ok")
for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
    for length in (7, 1000):
        a, b, c, x = random_inputs(3, 16, length, dtype=dtype, seed=2)
        y, h_last = multistate_scan(a, b, c, x, return_last_state=True)
        y_ref, last_ref = multistate_scan_ref(*(t.double() for t in (a, b, c, x)))
        errs = rel_err(y, y_ref), rel_err(h_last, last_ref)
        ok = y.dtype == dtype and max(errs) < tolerance(dtype, length)
        print(f"{str(dtype):>15} {length:5d} {errs[0]:9.1e} {errs[1]:9.1e} {tolerance(dtype, length):9.1e}  {ok}")
        assert ok

# %% [markdown]
# ## 7 · Speed on a GPU
#
# At section 2's size, in float32 and bfloat16, forward and forward + backward: the fused scan against a
# PyTorch scan that materialises every state, a real parallel scan (Hillis-Steele doubling: $\lceil \log_2 L
# \rceil$ steps, each composing every position with the one `shift` places before it), checked first. The
# memory floor is the fused design's bytes (section 2; for the backward, `training_bytes`) over the
# measured copy bandwidth.

# %%
def multistate_scan_materialised(a, b, c, x):
    """All (batch, N, L) states in memory: a log-depth doubling scan in PyTorch, then the sum over N."""
    a_acc, h = a, b * x[:, None, :]                                   # batch x N x L each
    shift = 1
    while shift < a.shape[-1]:
        # position t composes (a_acc, h) at t - shift (earlier) with its own (later): first_order_op
        h = torch.cat([h[..., :shift], a_acc[..., shift:] * h[..., :-shift] + h[..., shift:]], dim=-1)
        a_acc = torch.cat([a_acc[..., :shift], a_acc[..., :-shift] * a_acc[..., shift:]], dim=-1)
        shift *= 2
    return (c * h).sum(dim=1)


for length in (1, 7, 129, 1000):
    a, b, c, x = random_inputs(2, 5, length, dtype=torch.float64, seed=4)
    assert rel_err(multistate_scan_materialised(a, b, c, x), multistate_scan_ref(a, b, c, x)[0]) < 1e-12
print("the materialising PyTorch scan matches the reference")

# %%
def training_bytes(batch, length, n_states, itemsize=4):
    """Forward + backward of the fused design: the forward, then the backward reads a, B, C, x, dL/dy and
    writes the gradients of a, B, C, x (the boundary states are block_l times smaller and left out)."""
    return fused_bytes(batch, length, n_states, itemsize) + (6 * batch * n_states * length + 3 * batch * length) * itemsize


if not ON_GPU:
    bandwidth = None
    print("skipped: no GPU (the benchmark needs do_bench on CUDA)")
else:
    from scan_lib.runtime import copy_bandwidth, median_us
    bandwidth = copy_bandwidth()   # bytes / s, read + write, of a 1 GiB device-to-device copy

    def device_inputs(dtype):
        """Benchmark inputs made on the GPU directly: a in (0.9, 1), b, c, x normal."""
        shape = (batch_big, n_states_big, length_big)
        a = 0.9 + 0.1 * torch.rand(shape, device=DEVICE)
        b, c = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)
        x = torch.randn(batch_big, length_big, device=DEVICE)
        return [t.to(dtype) for t in (a, b, c, x)]

    print(f"{torch.cuda.get_device_name(DEVICE)}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"a, b, c ({batch_big}, {n_states_big}, {length_big}), x ({batch_big}, {length_big}), default block_l {block_big}")
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(5)
        a, b, c, x = device_inputs(dtype)
        short = str(dtype).split(".")[1]
        itemsize = a.element_size()
        y_fused = multistate_scan(a, b, c, x)
        y_check = multistate_scan_materialised(*(t.float() for t in (a, b, c, x)))
        assert rel_err(y_fused, y_check) < (1e-4 if dtype == torch.float32 else 1e-2)
        results[f"{short} fwd"] = {
            "memory floor": fused_bytes(batch_big, length_big, n_states_big, itemsize) / bandwidth * 1e6,
            "fused Triton": median_us(lambda: multistate_scan(a, b, c, x)),
            "materialised PyTorch": median_us(lambda: multistate_scan_materialised(a, b, c, x)),
        }
        for t in (a, b, c, x):
            t.requires_grad_()
        dy = torch.randn_like(x)
        results[f"{short} fwd+bwd"] = {
            "memory floor": training_bytes(batch_big, length_big, n_states_big, itemsize) / bandwidth * 1e6,
            "fused Triton": median_us(lambda: torch.autograd.grad(multistate_scan(a, b, c, x), (a, b, c, x), dy)),
            "materialised PyTorch": median_us(lambda: torch.autograd.grad(multistate_scan_materialised(a, b, c, x), (a, b, c, x), dy)),
        }
        del a, b, c, x, dy

    print(f"{'':17s} {'memory floor':>12} {'fused Triton':>12} {'materialised':>12}   fused / floor   materialised / fused")
    for key, r in results.items():
        print(f"{key:17s} {r['memory floor']:9.0f} us {r['fused Triton']:9.0f} us {r['materialised PyTorch']:9.0f} us"
              f"   {r['fused Triton'] / r['memory floor']:13.2f}   {r['materialised PyTorch'] / r['fused Triton']:20.1f}")
    for key, r in results.items():
        assert r["fused Triton"] < r["materialised PyTorch"], key

# %% [markdown]
# "fused / floor" near 1 means memory-bound: in this run the float32 rows come near it (1.08 forward,
# 1.12 forward + backward), the bfloat16 rows do not (1.63, 1.86). "materialised / fused" is the price
# of writing the states. "Going deeper" draws the table and looks at bfloat16 and chunk lengths.
#
# ## Summary
#
# - $N$ states per position are $N$ independent scans, one `tl.associative_scan` over a 2-D tile. The
#   fused kernel keeps the $(\text{batch}, N, L)$ states in registers and writes only $y$, the last state
#   and, for training, the states at chunk boundaries, from which the backward recomputes them.
# - Next, chapter 05 adds Mamba's discretisation, $a_t = e^{\Delta_t A}$, $b_t = \Delta_t B_t x_t$, and shares
#   $B$, $C$ across channels.

# %% [markdown]
# ## Going deeper: four states, four decay rates
#
# Section 1's recurrence as a picture: four exponential moving averages of a pulse, with constant
# gates $a[n] = 1 - 2^{-(n+1)}$ (memories of about 1, 3, 7 and 15 steps), $B[n] = 1 - a[n]$ and
# $C[n] = 1/N$, so that $y$ is their average.

# %%
length, n_states = 128, 4
x_demo = torch.zeros(1, length, dtype=torch.float64)
x_demo[0, 16:64] = 1.0                                                     # 1 x L: a pulse
gates = 1 - 0.5 ** (torch.arange(n_states, dtype=torch.float64) + 1)      # N
a_demo = gates[None, :, None].expand(1, n_states, length)                 # 1 x N x L
y_demo, _ = multistate_scan_ref(a_demo, 1 - a_demo, torch.full_like(a_demo, 1 / n_states), x_demo)
h_demo = reference_states(a_demo, 1 - a_demo, x_demo)[0]                  # N x L

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(x_demo[0], "k--", lw=1, label="$x_t$")
for n in range(n_states):
    ax.plot(h_demo[n], label=f"$h_t[{n}]$, $a={gates[n]:.4f}$")
ax.plot(y_demo[0], "k", lw=2, label=r"$y_t=\frac{1}{4}\sum_n h_t[n]$")
ax.set_xlabel("t"); ax.legend(fontsize=7, loc="upper right"); ax.set_title("four states, four decay rates, one output")
save_figure(fig, "multistate_emas.png")

# %% [markdown]
# ## Going deeper: the speed table drawn, and bfloat16
#
# On a GPU, section 7's table as a chart, and bfloat16 against float32. If bfloat16's forward is much
# further from its memory floor than float32's, the kernel is not memory-bound in bfloat16: the work on
# chip (everything converted to float32, a $\log_2 L_{\text{block}}$-level scan per chunk, chunks walked one
# after another by one program) does not shrink with the dtype.

# %%
if not ON_GPU:
    print("skipped: no GPU (section 7's benchmark did not run)")
else:
    time_ratio = results["bfloat16 fwd"]["fused Triton"] / results["float32 fwd"]["fused Triton"]
    print(f"bfloat16 halves the bytes; its fused forward takes {time_ratio:.2f}x the float32 time, at "
          f"{results['bfloat16 fwd']['fused Triton'] / results['bfloat16 fwd']['memory floor']:.1f}x its memory floor "
          f"(float32: {results['float32 fwd']['fused Triton'] / results['float32 fwd']['memory floor']:.1f}x)")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(next(iter(results.values())))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([j + i * width for j in range(len(results))], [r[name] for r in results.values()], width, label=name)
    ax.set_xticks([j + width for j in range(len(results))], list(results))
    ax.set_yscale("log"); ax.set_ylabel("time (us, median)")
    ax.set_title(f"multi-state scan, batch={batch_big}, L={length_big}, N={n_states_big}, {torch.cuda.get_device_name(DEVICE)}",
                 fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, "multistate_benchmark.png")


# %% [markdown]
# ## Going deeper: launch configuration
#
# One program per sequence suits many sequences (in Mamba, every (sample, channel) pair is one). With
# only a few long sequences most of the GPU would sit idle; then the chunks of one sequence would run in
# parallel in three phases, as in chapters 01 and 02, and again only chunk-boundary states would cross
# HBM. That variant is not built yet.
#
# `default_block_l` picks about 1024 tile elements ($L_{\text{block}} \times N$), at least 16 rows and
# no more rows than $L$ needs. `num_warps_for` gives about 8 tile elements per thread, 1 to 8 warps of
# 32 threads, so that the forward's tiles, and the backward's (about twice as many), stay in registers.
# The tile sizes are capped (`MAX_STATES`, `MAX_TILE`) for the same reason.

# %%
#| export
MAX_STATES = 256        # BLOCK_L x BLOCK_N tiles must fit in registers
MAX_TILE = 2**14


def default_block_l(length, n_states):
    """About 1024 tile elements, at least 16 rows, no more rows than L needs."""
    return max(16, min(next_power_of_2(length), 1024 // next_power_of_2(max(n_states, 1))))


def num_warps_for(block_l, n_states):
    """About 8 tile elements per thread (1 to 8 warps of 32), so that the forward's tiles and the
    backward's (about twice as many) stay in registers."""
    return max(1, min(8, block_l * triton.next_power_of_2(n_states) // 256))


# %% [markdown]
# Whether the default chunk length is the fastest is a measurement, not a prediction: on a GPU the cell
# times the forward of section 7's problem at five chunk lengths, in both dtypes, and says.

# %%
if not ON_GPU:
    print("skipped: no GPU (the sweep needs do_bench on CUDA)")
else:
    print(f"forward time (us) by block_l, batch={batch_big}, L={length_big}, N={n_states_big}, default block_l {block_big}")
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(5)
        a, b, c, x = device_inputs(dtype)
        sweep = {bl: median_us(lambda: multistate_scan(a, b, c, x, block_l=bl)) for bl in (16, 32, 64, 128, 256)}
        best = min(sweep, key=sweep.get)
        verdict = ("the default is the fastest" if best == block_big
                   else f"the fastest is {best}; the default is {sweep[block_big] / sweep[best]:.2f}x slower")
        print(f"  {str(dtype):15s} " + ", ".join(f"{bl}: {t:.0f}" for bl, t in sweep.items()) + f"; {verdict}")
        del a, b, c, x


# %% [markdown]
# (On a GPU.) In this run the time is not monotone in $L_{\text{block}}$. In float32 it falls from 456 us
# at 16 to 300 us at 64, the default, rises to 412 us at 128 and falls again to 297 us at 256, so the
# fastest there is 256 and the default is 1.01x slower. In bfloat16 it falls from 252 us at 16 to 229 us
# at 64, the fastest, and is 367 and 364 us at 128 and 256. Both dtypes slow down sharply from 64 to 128,
# where `num_warps_for` first gives 8 warps (16, 32, 64 get 1, 2, 4; 256 gets 8 too, with twice the tile
# elements per thread). A hypothesis, which nothing in this chapter measures: from 16 to 128 the warps
# grow with the tile, so every thread holds the same number of tile elements (at $N = 16$), and the
# tile's demand on each thread's registers alone would not explain a jump at 128; what does change is how
# Triton spreads the tile over threads and warps, and with it how much of each chunk's scan and of the
# sum over $N$ combines values held by other warps, which go through shared memory with a
# synchronisation. Testing that would take the compiled code's layouts and a profile (registers, spills,
# occupancy, stalls); the bfloat16 row at 256, which does not recover as float32's does, is not explained
# by it either. The default is the rule above, not a tuned value; in this run it is the fastest in
# bfloat16 only (in float32, 1.01x slower than 256).
#
# ## Going deeper: the backward formulas as a loop
#
# Why section 5 sets $\delta_L[n] := g[n]$ (`dh_last`; zero if the last state was not used) and
# $a_L[n] := 1$: $h_{L-1}$ has no successor (there is no $h_L$), but it reaches the loss twice, through
# $y_{L-1}$ and directly as the last state, so the chain rule gives
# $\delta_{L-1}[n] = g[n] + C_{L-1}[n]\,\partial\mathcal L/\partial y_{L-1}$. That is the recurrence's
# step at $t = L - 1$ with a gate of 1 and a "next" adjoint $g[n]$, so the last position needs no
# special case: the kernel starts its adjoint carry at `dh_last` and loads the gate past the end as 1
# (`other=1`), and the loop below starts with `carry = dh_last` and a gate of ones.
#
# Section 5's formulas, written as a PyTorch loop in float64 (the adjoint run right to left, then the
# local products), against autograd through the reference:

# %%
def multistate_backward_ref(a, b, c, x, initial_state, dy, dh_last):
    """The formulas above as loops (float64). Returns the gradients of a, B, C, x and the initial state."""
    states = reference_states(a, b, x, initial_state)                          # batch x N x L
    h_prev = torch.cat([initial_state[..., None], states[..., :-1]], dim=-1)    # h_{t-1}
    adj = torch.empty_like(a)                                                 # batch x N x L
    carry, gate = dh_last, torch.ones_like(dh_last)                             # adj_L, a_L
    for t in reversed(range(a.shape[-1])):
        carry = gate * carry + c[:, :, t] * dy[:, None, t]
        adj[:, :, t], gate = carry, a[:, :, t]
    return adj * h_prev, adj * x[:, None, :], dy[:, None, :] * states, (adj * b).sum(1), a[:, :, 0] * adj[:, :, 0]


a, b, c, x = (t.requires_grad_() for t in random_inputs(2, 3, 50, dtype=torch.float64, seed=1))
h0 = torch.randn(2, 3, dtype=torch.float64, device=DEVICE, requires_grad=True)
dy, dh_last = torch.randn(2, 50, dtype=torch.float64, device=DEVICE), torch.randn(2, 3, dtype=torch.float64, device=DEVICE)
autograd_grads = torch.autograd.grad(multistate_scan_ref(a, b, c, x, h0), (a, b, c, x, h0), (dy, dh_last))
with torch.no_grad():
    formula_grads = multistate_backward_ref(a, b, c, x, h0, dy, dh_last)
for name, got, want in zip(("a", "B", "C", "x", "h0"), formula_grads, autograd_grads):
    print(f"d{name:3s} max rel err {rel_err(got, want):.1e}")
    assert rel_err(got, want) < 1e-12

# %% [markdown]
# ## Going deeper: partial chunks, and the backward kernel's shifted loads
#
# Section 4's new carry, the tile's last row, is right in a partial chunk too: padded rows are identity
# steps.
#
# Section 5's backward recomputes the states with one more scan of data already on chip. Its steps 1
# and 2 need the tile shifted by one row. The shift is a load, not a move: registers cannot be indexed,
# and moving a tile down by one row would move values between threads, so the kernel loads $a$, $B$, $x$
# a second time from one position earlier (`A + tile - 1`), with the first row masked to the identity
# $(1, 0)$. The shifted gates of step 2 are loaded the same way, one position later
# (`A + tile + 1`), so the last row reads the next chunk's first gate from memory; $t = L - 1$ reads
# $a_L = 1$ (`other=1`).
#
# ## Going deeper: the tolerance, and the bugs the checks catch
#
# Section 3's `tolerance` is, relative to the largest $|y|$, the sum of two parts.
#
# **The output's rounding to its dtype**, $u_{\text{out}}$: $2^{-24}$ (float32), $2^{-11}$ (float16),
# $2^{-8}$ (bfloat16; $2^{-7}$ under the CPU interpreter, which truncates to bfloat16 instead of
# rounding, chapter 00).
#
# **The accumulation**, $32\sqrt{L}\,u$ with $u$ the accumulator's unit roundoff ($2^{-24}$, or
# $2^{-53}$ for float64 inputs). Each step of $h_t = a_t h_{t-1} + b_t x_t$ rounds a few times, each
# a relative error of at most $u$, so step $t$ adds an error $\varepsilon_t$ with
# $|\varepsilon_t| \le c\,u\,\max|h|$ for a small $c$. The recurrence is linear, so each error is then
# carried like a state: after step $s$ it has been multiplied by $a_{t+1}\cdots a_s$, at most 1 in
# size for gates in $(0, 1)$, as here. The error at step $L$ is therefore a sum of at most $L$ terms of size
# $c\,u\,\max|h|$. In the worst case they share a sign and add to $c\,L\,u$; rounding errors are
# as often up as down, though, and behave like a random walk, whose typical size is $\sqrt{L}$ times
# one step's error (chapter 01 met the same question for a tree, where each value passes $\log_2 L$
# additions). The factor 32 covers $c$, the sum over the $N$ states into $y$, and a random walk's
# excursions several times its typical size; $L$ is taken as at least 16, so that short sequences
# keep room for their few roundings. This is an allowance argued from the typical case, not a
# proven bound: the worst case grows like $L$. Chapter 05 checks the selective scan, the same
# recurrence, with this function.
#
# It is loose on purpose: the float32 errors this chapter records are about 2 units or less (the
# largest in section 3's table, 1.24e-07 at $L = 129$, $N = 5$, against a tolerance of 2.2e-05). What
# it must do is separate a correct kernel from a broken one. In section 4's check, dropping the carry
# between chunks fails every row past the first chunk, by orders of magnitude; a float16 accumulator
# fails it for float32 inputs. For float16 inputs the output's own rounding, $2^{-11}$, is most of the
# tolerance, and a float16 accumulator lands only a little above it. The tests inject these bugs.

# %% [markdown]
# ## Going deeper: a torch op, autograd, and transforms
#
# The launchers become torch custom ops (`scan_lib.runtime.custom_op`, a thin wrapper of
# `torch.library.custom_op`), `multistate_fwd` and `multistate_bwd`, opaque to torch except for
# - a **fake** implementation (`register_fake`): output shapes and dtypes without running the kernel, so
#   `torch.compile` can trace through them on fake tensors without a graph break;
# - a **vmap** rule (`register_vmap`): the rule moves `torch.func.vmap`'s batch dimension to the front and
#   folds it into the kernel's batch of sequences, which are independent anyway.
#
# Autograd is a `torch.autograd.Function` with the forward / `setup_context` / backward split that
# `torch.func.grad` requires, and `generate_vmap_rule = True`. The forward returns the boundary states
# as a third, non-differentiable output so that `setup_context` can save them.
#
# **Second derivatives are not supported.** The backward kernel's outputs carry no graph, so a second
# derivative would silently miss this scan's contribution (a wrong or zero Hessian). So the backward
# runs the kernel inside a second autograd Function, `MultistateScanBackward`, whose own backward raises
# a `RuntimeError` naming `multistate_scan`: a first derivative works (also under `torch.func.grad`,
# which runs the backward with gradients enabled); differentiating it again fails loudly.
#
# Section 6's `multistate_scan` calls names defined only in the next cell (`check_multistate_inputs`,
# `empty_multistate_scan`, `multistate_fwd`, `MultistateScan`): Python looks a name up when the
# function runs, not when it is defined.

# %%
#| export
def empty_multistate_scan(a, b, c, x, initial_state):
    """(y, last state) for an empty a (batch, N or L zero), as torch's ops give them: y zeros of x's
    shape (a sum over no states, or no positions), the last state the initial state or zeros; both in
    the graph of every input that needs a gradient (zero gradients, the initial state's through the
    last state)."""
    zero = zero_in_graph(a, b, c, x, initial_state)       # None when nothing is differentiated
    h_last = a.new_zeros(a.shape[:2]) if initial_state is None else initial_state.clone()
    return plus(torch.zeros_like(x), zero), plus(h_last, zero)


def check_multistate_inputs(a, b, c, x, initial_state, block_l):
    """Validate the public API's arguments; return the block length to use."""
    named = {"a": a, "b": b, "c": c, "x": x}
    if initial_state is not None:
        named["initial_state"] = initial_state
    for name, value in named.items():
        check_float_tensor(name, value)
    for name, value in named.items():
        if value.dtype != a.dtype:
            raise TypeError(f"{name} must have the same dtype as a ({a.dtype}), got {value.dtype}")
    if a.dim() != 3:
        raise ValueError(f"a must have shape (batch, N, L), got {tuple(a.shape)}")
    batch, n_states, length = a.shape
    expected = {"a": (batch, n_states, length), "b": (batch, n_states, length), "c": (batch, n_states, length),
                "x": (batch, length), "initial_state": (batch, n_states)}
    for name, value in named.items():
        if tuple(value.shape) != expected[name]:
            raise ValueError(f"{name} must have shape {expected[name]} to match a (batch, N, L), got {tuple(value.shape)}")
        if not value.is_contiguous():
            raise ValueError(f"{name} must be contiguous; call .contiguous() on it first")
    if n_states > MAX_STATES:
        raise ValueError(f"a has N = {n_states} states; at most {MAX_STATES} are supported")
    check_same_device(**named)
    if block_l is None:
        return default_block_l(length, n_states)
    if isinstance(block_l, bool) or not isinstance(block_l, int):
        raise TypeError(f"block_l must be an int, got {type(block_l).__name__}")
    if block_l < 2 or block_l > 4096 or block_l & (block_l - 1):
        raise ValueError(f"block_l must be a power of two from 2 to 4096, got {block_l}")
    if block_l * triton.next_power_of_2(n_states) > MAX_TILE:
        raise ValueError(f"block_l * N (rounded up to a power of two) must be at most {MAX_TILE}, got block_l={block_l}, N={n_states}")
    return block_l


@custom_op("multistate_fwd", __name__)
def multistate_fwd(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, x: torch.Tensor,
                   initial_state: Optional[torch.Tensor], block_l: int, save_chunks: bool
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y, last state, boundary states ((batch, 0, N) unless save_chunks) of checked inputs."""
    return multistate_forward(a, b, c, x, initial_state, block_l, save_chunks)


@multistate_fwd.register_fake
def _(a, b, c, x, initial_state, block_l, save_chunks):
    batch, n_states, length = a.shape
    n_chunks = triton.cdiv(length, block_l) if save_chunks else 0
    acc = torch.promote_types(a.dtype, torch.float32)
    return torch.empty_like(x), a.new_empty(batch, n_states), a.new_empty(batch, n_chunks, n_states, dtype=acc)


@custom_op("multistate_bwd", __name__)
def multistate_bwd(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, x: torch.Tensor, h_chunks: torch.Tensor,
                   dy: torch.Tensor, dh_last: torch.Tensor, block_l: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of a, b, c, x and the initial state."""
    return multistate_backward(a, b, c, x, h_chunks, dy, dh_last, block_l)


@multistate_bwd.register_fake
def _(a, b, c, x, h_chunks, dy, dh_last, block_l):
    return (torch.empty_like(a), torch.empty_like(b), torch.empty_like(c), torch.empty_like(x),
            a.new_empty(a.shape[0], a.shape[1]))


def _fold_vmap(info, in_dims, tensors):
    """Move each tensor's vmapped dim to the front (expanding unbatched ones) and fold it into the
    kernel's batch of sequences: (vmap, batch, ...) -> (vmap * batch, ...). None stays None."""
    out = []
    for t, dim in zip(tensors, in_dims):
        if t is not None:
            t = t.movedim(dim, 0) if dim is not None else t.expand(info.batch_size, *t.shape)
            t = t.reshape(-1, *t.shape[2:]).contiguous()
        out.append(t)
    return out


def _unfold_vmap(info, outputs):
    """The inverse of _fold_vmap for the outputs: (vmap * batch, ...) -> (vmap, batch, ...), out_dims 0."""
    size = info.batch_size
    return tuple(t.reshape(size, t.shape[0] // size, *t.shape[1:]) for t in outputs), (0,) * len(outputs)


@multistate_fwd.register_vmap
def _(info, in_dims, a, b, c, x, initial_state, block_l, save_chunks):
    folded = _fold_vmap(info, in_dims[:5], (a, b, c, x, initial_state))
    return _unfold_vmap(info, multistate_fwd(*folded, block_l, save_chunks))


@multistate_bwd.register_vmap
def _(info, in_dims, a, b, c, x, h_chunks, dy, dh_last, block_l):
    folded = _fold_vmap(info, in_dims[:7], (a, b, c, x, h_chunks, dy, dh_last))
    return _unfold_vmap(info, multistate_bwd(*folded, block_l))


class MultistateScan(torch.autograd.Function):
    """y, last_state, boundary states = scan(a, b, c, x, initial_state); the backward recomputes states per chunk."""
    generate_vmap_rule = True

    @staticmethod
    def forward(a, b, c, x, initial_state, block_l):
        return multistate_fwd(a, b, c, x, initial_state, block_l, True)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, c, x, initial_state, block_l = inputs
        ctx.save_for_backward(a, b, c, x, output[2])
        ctx.mark_non_differentiable(output[2])
        ctx.block_l, ctx.has_initial_state = block_l, initial_state is not None

    @staticmethod
    def backward(ctx, dy, dh_last, _):
        a, b, c, x, h_chunks = ctx.saved_tensors
        args = (a, b, c, x, h_chunks, dy, dh_last, ctx.block_l)
        # Grad mode is on in a backward under create_graph=True and under torch.func.grad: the kernel then
        # runs inside MultistateScanBackward, whose backward refuses to differentiate it a second time.
        da, db, dc, dx, dh0 = apply(MultistateScanBackward, *args) if torch.is_grad_enabled() else multistate_bwd(*args)
        return da, db, dc, dx, dh0 if ctx.has_initial_state else None, None


class MultistateScanBackward(torch.autograd.Function):
    """The backward kernel as a function that can be called but not differentiated."""
    generate_vmap_rule = True

    @staticmethod
    def forward(a, b, c, x, h_chunks, dy, dh_last, block_l):
        return multistate_bwd(a, b, c, x, h_chunks, dy, dh_last, block_l)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("multistate_scan supports first derivatives only: its backward cannot be "
                           "differentiated (second derivatives, e.g. hessian or create_graph=True, are not supported)")


# %% [markdown]
# First `torch.autograd.gradcheck` through this wiring (finite differences in float64, `fast_mode=False`)
# on $L = 5$ with `block_l=2`, so that three chunks (the last one partial) are crossed, through both
# outputs. Then the op under each transform, against the plain call: `torch.func.grad`, `torch.func.vmap` (over an
# extra leading dimension), `torch.compile(fullgraph=True)` (a graph break would be an error; the
# `aot_eager` backend traces forward and backward through the fake implementations without needing
# a C compiler), and a Hessian, which must raise. The transform checks compare the op with itself:
# under `torch.func.grad` and plain autograd the same backward kernel runs, so their agreement checks
# the wiring (that each transform reaches the kernels through the Function and the custom ops), not
# the gradients' values, which gradcheck here and section 5 check.

# %%
a, b, c, x = (t.requires_grad_() for t in random_inputs(1, 2, 5, dtype=torch.float64, seed=3))
h0 = torch.randn(1, 2, dtype=torch.float64, device=DEVICE, requires_grad=True)
assert torch.autograd.gradcheck(
    lambda *args: multistate_scan(*args, return_last_state=True, block_l=2), (a, b, c, x, h0), fast_mode=False
)
print("gradcheck (fast_mode=False) passed")

a, b, c, x = random_inputs(2, 3, 20, dtype=torch.float64, seed=6)
loss = lambda a, b, c, x: (multistate_scan(a, b, c, x, block_l=8) ** 2).sum()
grads = torch.func.grad(loss, argnums=(0, 1, 2, 3))(a, b, c, x)
inputs = [t.clone().requires_grad_() for t in (a, b, c, x)]
want = torch.autograd.grad(loss(*inputs), inputs)
print("func.grad == autograd:", all(torch.allclose(g, w, rtol=1e-12, atol=0) for g, w in zip(grads, want)))
assert all(torch.allclose(g, w, rtol=1e-12, atol=0) for g, w in zip(grads, want))

stacked = [torch.stack([t, 2 * t]) for t in (a, b, c, x)]                 # 2 x (batch, ...) each
y_vmap = torch.func.vmap(lambda *t: multistate_scan(*t, block_l=8))(*stacked)
y_loop = torch.stack([multistate_scan(*(s[i] for s in stacked), block_l=8) for i in range(2)])
print("vmap == loop:", torch.equal(y_vmap, y_loop))
assert torch.equal(y_vmap, y_loop)

compiled = torch.compile(lambda *t: multistate_scan(*t, block_l=8) * 2, fullgraph=True, backend="aot_eager")
y_compiled = compiled(*inputs)
d_compiled = torch.autograd.grad(y_compiled.sum(), inputs)
d_plain = torch.autograd.grad((multistate_scan(*inputs, block_l=8) * 2).sum(), inputs)
print("compile(fullgraph) == eager:", torch.equal(y_compiled, 2 * multistate_scan(a, b, c, x, block_l=8))
      and all(torch.equal(g, w) for g, w in zip(d_compiled, d_plain)))
assert torch.equal(y_compiled, 2 * multistate_scan(a, b, c, x, block_l=8))
assert all(torch.equal(g, w) for g, w in zip(d_compiled, d_plain))

try:
    torch.autograd.functional.hessian(lambda x: loss(a, b, c, x), x)
except RuntimeError as e:
    assert "multistate_scan" in str(e)
    print(f"hessian -> RuntimeError: {e}")
else:
    raise AssertionError("hessian through multistate_scan did not raise")

# %% [markdown]
# ## Going deeper: bad input
#
# Bad input raises `TypeError` (not a tensor, wrong dtype, mixed dtypes, `block_l` not an int) or
# `ValueError` (shapes, non-contiguous, devices, `block_l` value), naming the argument. Empty inputs
# are not bad input: as torch's ops do, they give an empty (or all-zero) result, checked after the list.

# %%
a, b, c, x = random_inputs(2, 4, 9)
bad_calls = {
    "x with the wrong length": (lambda: multistate_scan(a, b, c, x[:, :5].contiguous()), ValueError, "x"),
    "c in float64": (lambda: multistate_scan(a, b, c.double(), x), TypeError, "c"),
    "b as a list": (lambda: multistate_scan(a, b.tolist(), c, x), TypeError, "b"),
    "a 2-D": (lambda: multistate_scan(a[0], b, c, x), ValueError, "a"),
    "a non-contiguous view": (lambda: multistate_scan(a.transpose(1, 2).contiguous().transpose(1, 2), b, c, x), ValueError, "a"),
    "initial_state (batch, N+1)": (lambda: multistate_scan(a, b, c, x, torch.zeros(2, 5, device=DEVICE)), ValueError, "initial_state"),
    "block_l = 24": (lambda: multistate_scan(a, b, c, x, block_l=24), ValueError, "block_l"),
}
for what, (call, error, name) in bad_calls.items():
    try:
        call()
    except error as e:
        assert str(e).startswith(name + " "), e
        print(f"{what:28s} -> {error.__name__}: {e}")
    else:
        raise AssertionError(f"{what}: no {error.__name__}")

y_empty, h_empty = multistate_scan(a[..., :0], b[..., :0], c[..., :0], x[:, :0], return_last_state=True)
print(f"{'all empty (L = 0)':28s} -> y of shape {tuple(y_empty.shape)}, last state zeros {tuple(h_empty.shape)}")
assert y_empty.shape == (2, 0) and h_empty.shape == (2, 4) and not h_empty.any()


# %% [markdown]
# ## Going deeper: counting the bytes
#
# Section 2's formula, checked against the bytes of the op's inputs and outputs: `bytes_moved` runs a
# function under a `TorchDispatchMode`, which sees every operator call the function makes, and adds up
# the bytes of each call's tensor inputs and outputs (views are free). `multistate_scan` is one operator
# call, a custom op, so the count is the bytes of its inputs and outputs and must equal the formula,
# with and without the boundary states. That is all the count can see. The mode does not see the
# calls made inside the op (the count equals the formula although the op allocates its outputs inside,
# with `torch.empty`), so memory that an op allocates and writes internally (a scratch buffer of every
# state, say) would never appear in it. And the formula is the kernel's traffic to memory only because
# section 4's kernel loads each input element once and stores each output once, which one reads off
# its code; measuring the traffic takes a profiler (Nsight Compute's DRAM byte counters, on a GPU),
# which this chapter does not run. The PyTorch doubling scan of section 7 is counted too, at the
# realistic size, on `meta` tensors (shapes without data: nothing is computed or allocated); for it the
# count is a lower bound on the traffic.

# %%
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class BytesMoved(TorchDispatchMode):
    """Adds up the bytes of the tensor inputs and outputs of every operator call (views excepted)."""
    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.total += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                              if isinstance(t, torch.Tensor))
        return out


def bytes_moved(fn, *args):
    with BytesMoved() as counter:
        fn(*args)
    return counter.total


# measured on small inputs: inference (no grad) and training (boundary states saved)
batch, length, n_states = 3, 100, 5
a, b, c, x = random_inputs(batch, n_states, length)
inference = bytes_moved(lambda: multistate_scan(a, b, c, x))
training = bytes_moved(lambda: multistate_scan(a.requires_grad_(), b, c, x, block_l=16))
print(f"batch={batch}, L={length}, N={n_states}: fused forward moves {inference} B (formula {fused_bytes(batch, length, n_states)}), "
      f"{training} B when it saves boundary states (formula {fused_bytes(batch, length, n_states, block_l=16)})")
assert inference == fused_bytes(batch, length, n_states)
assert training == fused_bytes(batch, length, n_states, block_l=16)

meta = [torch.empty(batch_big, n_states_big, length_big, device="meta") for _ in "abc"] + [torch.empty(batch_big, length_big, device="meta")]
doubling_big = bytes_moved(multistate_scan_materialised, *meta)
print(f"batch={batch_big}, L={length_big}, N={n_states_big}: the doubling scan moves at least "
      f"{doubling_big / 2**20:.0f} MiB, {doubling_big / fused_big:.1f} times the fused forward's {fused_big / 2**20:.0f} MiB")
assert doubling_big > 10 * fused_big


# %% [markdown]
# What autograd keeps for the backward pass, measured the same way: `torch.autograd.graph.saved_tensors_hooks`
# sees every tensor saved for the backward; the cell adds up the bytes of those that are not inputs.
# The fused scan must keep exactly the boundary states, $\text{batch}\lceil L/L_{\text{block}}\rceil N$
# float32 numbers; the PyTorch doubling scan keeps at least every state.

# %%
def saved_bytes(fn, *inputs):
    """Bytes of memory that the tensors autograd saves while fn(*inputs) runs keep alive, inputs excluded."""
    inputs_at = {t.untyped_storage().data_ptr() for t in inputs}
    saved = {}                                                   # storage address -> bytes

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs_at:
            saved[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(saved.values())


batch, length, n_states, block_l = 3, 100, 5, 16
inputs = [t.requires_grad_() for t in random_inputs(batch, n_states, length)]
fused_saved = saved_bytes(lambda *t: multistate_scan(*t, block_l=block_l), *inputs)
doubling_saved = saved_bytes(multistate_scan_materialised, *inputs)
all_states = batch * n_states * length * 4
print(f"batch={batch}, L={length}, N={n_states}, block_l={block_l}: fused keeps {fused_saved} B, "
      f"the doubling scan {doubling_saved} B; all states are {all_states} B")
assert fused_saved == batch * math.ceil(length / block_l) * n_states * 4
assert doubling_saved >= all_states
print(f"at batch={batch_big}, L={length_big}, N={n_states_big}, block_l={block_big}: the fused scan keeps "
      f"{batch_big * math.ceil(length_big / block_big) * n_states_big * 4 / 2**20:.0f} MiB, all states are {states_big / 2**20:.0f} MiB")


# %% [markdown]
# The picture: which tensors cross between HBM and the chip in each design, at section 2's size. (On a GPU
# its label carries the copy bandwidth measured in section 7.)

# %%
import matplotlib


def draw_memory_figure(batch, length, n_states, block_l, bandwidth, itemsize=4):
    """Two panels: the tensors each design reads from (blue) or writes to (red) HBM, and what stays on chip."""
    bnl, bl = batch * n_states * length, batch * length
    designs = {"two passes: states written to HBM": (
                   [("a", bnl, "r"), ("B", bnl, "r"), ("x", bl, "r"), ("h", bnl, "rw"), ("C", bnl, "r"), ("y", bl, "w")],
                   "scan kernel: h = a h + B x\nreduce kernel: y = sum_n C h"),
               "fused: states stay on chip": (
                   [("a", bnl, "r"), ("B", bnl, "r"), ("C", bnl, "r"), ("x", bl, "r"), ("y", bl, "w"),
                    ("h at\nchunk\nstarts", bnl // block_l, "w")],
                   f"tiles of {block_l} x N: scan, y = sum over N of C h;\ncarry: N states in registers")}
    hbm = "HBM (off chip" + (f", {bandwidth / 1e12:.2f} TB/s copy)" if bandwidth else ")")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, (title, (tensors, on_chip)) in zip(axes, designs.items()):
        ax.set_xlim(0, 12); ax.set_ylim(0, 8); ax.axis("off"); ax.set_title(title, fontsize=10)
        ax.add_patch(matplotlib.patches.Rectangle((0.2, 4.6), 11.6, 3.1, fc="#eeeeee", ec="k"))
        ax.add_patch(matplotlib.patches.Rectangle((0.2, 0.3), 11.6, 2.6, fc="#fff7e0", ec="k"))
        ax.text(0.4, 7.3, hbm, fontsize=8, weight="bold")
        ax.text(0.4, 0.5, "on chip: registers of one program", fontsize=8, weight="bold")
        ax.text(6, 1.7, on_chip, ha="center", va="center", fontsize=8)
        for i, (name, numel, mode) in enumerate(tensors):
            x0 = 0.4 + i * 1.9
            ax.add_patch(matplotlib.patches.Rectangle((x0, 5.0), 1.7, 1.9, fc="white", ec="k"))
            ax.text(x0 + 0.85, 6.3, name, ha="center", va="center", fontsize=8 if len(name) < 3 else 6.5)
            ax.text(x0 + 0.85, 5.3, f"{numel * itemsize / 2**20:.0f} MiB", ha="center", fontsize=7)
            for kind, dx, ends in (("r", 0.6, (2.95, 4.95)), ("w", 1.1, (4.95, 2.95))):
                if kind in mode:
                    ax.annotate("", (x0 + dx, ends[0]), (x0 + dx, ends[1]),
                                arrowprops=dict(arrowstyle="->", color="#4c72b0" if kind == "r" else "#c44e52"))
        moved = sum(numel * len(mode) for _, numel, mode in tensors)
        ax.text(6, 3.75, f"moved through HBM: {moved * itemsize / 2**20:.0f} MiB", ha="center", fontsize=9,
                weight="bold", bbox=dict(fc="white", ec="none"), zorder=3)
    fig.suptitle(f"batch={batch}, L={length}, N={n_states}, float32; blue: read, red: written "
                 "(chunk-start states: for the backward)", fontsize=9)
    return fig


save_figure(draw_memory_figure(batch_big, length_big, n_states_big, block_big, bandwidth), "multistate_memory.png")

# %% [markdown]
# ## Going deeper: the largest tile
#
# Triton refuses any block of more than $2^{20}$ elements (`tl.TRITON_MAX_TENSOR_NUMEL`), so section 3's
# single-block kernel has a hard limit besides registers. The cell asks it for a $2^{20} \times 2$ tile
# ($L = 2^{19} + 1$, $N = 2$) and shows the refusal.

# %%
def error_text(error):
    """The messages of an exception and its causes (the GPU compiler wraps the one from tl)."""
    texts = []
    while error is not None:
        texts.append(str(error))
        error = error.__cause__ or error.__context__
    return " | ".join(texts)


a, b, c, x = random_inputs(1, 2, 2**19 + 1)
try:
    multistate_single_block(a, b, c, x)
except Exception as e:  # a ValueError from tl, or on the GPU a CompilationError wrapping it
    assert "exceeds triton maximum tensor numel" in error_text(e), error_text(e)
    print(f"L = {2**19 + 1}, N = 2: refused: {error_text(e).splitlines()[-1][:100]}")
else:
    raise AssertionError("a tile of 2^21 elements was accepted")

# %% [markdown]
# ## References
#
# - Gu, Goel and Ré, "Efficiently modeling long sequences with structured state spaces", ICLR 2022.
# - Smith, Warrington and Linderman, "Simplified state space layers for sequence modeling", ICLR 2023 (parallel scans for diagonal state spaces).
# - Gu and Dao, "Mamba: linear-time sequence modeling with selective state spaces", arXiv:2312.00752, 2023. (section 3.3: states kept on chip, only boundaries in memory).
# - Sasha Rush, "Mamba: The Hard Way" (a Triton notebook from cumulative sums to the selective scan; part 4): https://srush.github.io/annotated-mamba/hard.html
