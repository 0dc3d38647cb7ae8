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
# # 02 · Exponential moving averages and the first-order scan
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/scan-course/scans-the-hard-way/blob/main/notebooks/02_ema.ipynb)
#
# Chapter 01 scanned with `+`. This chapter scans a recurrence whose next value *multiplies* the
# previous one, $h_t = a_t h_{t-1} + b_t$, of which the exponential moving average (EMA) is the
# simplest case. The trick is to scan *steps* instead of values: a step is a pair $(a_t, b_t)$, and
# pairs compose associatively. We prove that, test it in plain PyTorch, scan pairs in one Triton
# block, then over any length with a state carried from chunk to chunk, in both directions. The
# blocked kernel is exported to `scan_lib.ema`; chapter 03 adds its backward pass.

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
#| default_exp ema

# %%
import math

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

from scan_lib.runtime import save_figure

# %% [markdown]
# ## 1. The EMA is a recurrence
#
# An exponential moving average keeps one number $h$ and, for every new sample $x_t$, moves it a
# fraction $1-\alpha$ of the way towards the sample:
#
# $$h_t = \alpha\, h_{t-1} + (1-\alpha)\, x_t, \qquad h_{-1} = 0 .$$
#
# Unrolled, $h_t = (1-\alpha)\sum_{s \le t} \alpha^{t-s} x_s$: old samples fade geometrically.
# The loop below is the definition.

# %%
def ema_loop(x: list[float], alpha: float) -> list[float]:
    """The EMA of a list of numbers, one step at a time (the definition)."""
    h, out = 0.0, []
    for sample in x:
        h = alpha * h + (1 - alpha) * sample
        out.append(h)
    return out


steps = [1.0] * 50  # a unit step: the EMA climbs as 1 - alpha^(t+1)
climb = ema_loop(steps, alpha=0.9)
assert all(abs(h - (1 - 0.9 ** (t + 1))) < 1e-12 for t, h in enumerate(climb))
print(f"EMA of a unit step after 1, 10, 50 samples: {climb[0]:.3f}, {climb[9]:.3f}, {climb[49]:.3f}")

# %% [markdown]
# Let the coefficients change with the position and we get the **first-order linear recurrence**
#
# $$h_t = a_t\, h_{t-1} + b_t, \qquad h_{-1} = h^{\text{init}},$$
#
# with a *gate* $a_t$ that scales the previous state and a term $b_t$ added at step $t$. The EMA is
# $a_t = \alpha$, $b_t = (1-\alpha)\,x_t$; in Mamba (chapter 05) both are computed from the input.
# The float64 loop below, the reference for every check, takes `gates` ($a_t$) and `tokens` ($b_t$)
# of shape (..., L), an optional initial state, and an optional **reverse** direction,
# $h_t = a_t h_{t+1} + b_t$, running from the end. ("Going deeper" checks it against the unrolled
# EMA.)

# %%
#| export
"""The first-order (linear) scan h_t = a_t * h_{t-1} + b_t: its combine operator, forward kernels and checks."""
import math

import torch
import triton
import triton.language as tl

from scan_lib.runtime import INTERPRET


def linear_scan_loop(gates, tokens, initial_state=None, reverse=False):
    """h_t = gates_t * h_{t-1} + tokens_t along the last dim (reverse: h_{t+1}), in float64: the reference."""
    if reverse:
        return linear_scan_loop(gates.flip(-1), tokens.flip(-1), initial_state).flip(-1)
    gates, tokens = torch.broadcast_tensors(gates.double(), tokens.double())
    h = torch.zeros_like(tokens[..., 0]) if initial_state is None else initial_state.double()
    states = []
    for t in range(tokens.shape[-1]):
        h = gates[..., t] * h + tokens[..., t]  # (...)
        states.append(h)
    return torch.stack(states, dim=-1)  # (..., L)

# %% [markdown]
# ## 2. One step is a pair, and pairs compose
#
# A cumulative sum can be split anywhere because $+$ is associative. The recurrence looks
# sequential: $h_t$ needs $h_{t-1}$. The way out is to stop thinking about the *value* $h$ and think
# about the *step*: step $t$ is the affine map $h \mapsto a_t h + b_t$, which we store as the pair
# $(a_t, b_t)$. Doing a step $p = (a_p, b_p)$ and then a later step $q = (a_q, b_q)$ is again an affine map,
#
# $$a_q (a_p h + b_p) + b_q = (a_p a_q)\,h + (a_q b_p + b_q),$$
#
# so we define the **combine operator** on pairs, earlier operand on the left:
#
# $$(a_p, b_p) \bullet (a_q, b_q) = (a_p a_q,\; a_q b_p + b_q).$$
#
# The state $h_t$ is the second component of $(a_0, a_0 h^{\text{init}} + b_0) \bullet (a_1, b_1)
# \bullet \dots \bullet (a_t, b_t)$: an inclusive scan with $\bullet$, whose identity is $(1, 0)$.
#
# **Associativity.** For three steps $p, q, r$:
#
# $$\begin{aligned}
# (p \bullet q) \bullet r &= (a_p a_q,\ a_q b_p + b_q) \bullet (a_r, b_r)
#   = \big(a_p a_q a_r,\ a_r a_q b_p + a_r b_q + b_r\big),\\
# p \bullet (q \bullet r) &= (a_p, b_p) \bullet (a_q a_r,\ a_r b_q + b_r)
#   = \big(a_p a_q a_r,\ a_q a_r b_p + a_r b_q + b_r\big),
# \end{aligned}$$
#
# equal because real multiplication commutes. Equivalently, the step is the matrix
# $M(a, b) = \begin{pmatrix} a & b \\ 0 & 1 \end{pmatrix}$ acting on $(h, 1)^\top$,
# $M(a_q, b_q)\,M(a_p, b_p) = M\big((a_p,b_p)\bullet(a_q,b_q)\big)$, and matrix products are
# associative. They are *not* commutative: $p \bullet q \ne q \bullet p$, so operand order matters.

# %%
#| export
@triton.jit
def first_order_op(a_left, b_left, a_right, b_right):
    ### BEGIN SOLUTION
    ### HINT: return the pair (gate, token) of the left step followed by the right one, as derived above
    """Compose two steps of h -> a*h + b: first the left (earlier) one, then the right (later) one.

    a_right * (a_left * h + b_left) + b_right = (a_left * a_right) * h + (a_right * b_left + b_right)

    With finite gates and tokens a scan with this operator gives the recurrence up to rounding, in any
    grouping. With infinite gates it need not: a zero gate followed later by an infinite one gives the
    composed gate 0 * inf = NaN, so a tree scan (a GPU's) returns NaN where the recurrence, applied
    step by step, gives +-inf (finite only where a product or sum of finite values overflowed first); a
    left-to-right fold (Triton's CPU interpreter) gives the recurrence's values. See "Zero and infinite gates" in notebooks/02_ema.
    """
    return a_left * a_right, a_right * b_left + b_right
    ### END SOLUTION

# %% [markdown]
# A `@triton.jit` function keeps the plain Python function it was made from as `.fn`. Its body is
# arithmetic that PyTorch tensors understand too, so the checks below run the very operator the
# kernels use, not a copy:

# %%
compose = first_order_op.fn  # (a_left, b_left, a_right, b_right) -> the composed pair, on tensors

# %%
def step_matrix(a, b):
    """The 2x2 matrix [[a, b], [0, 1]] of the step h -> a*h + b, for tensors a, b of shape (n,)."""
    return torch.stack([torch.stack([a, b], -1), torch.stack([torch.zeros_like(a), torch.ones_like(a)], -1)], -2)


torch.manual_seed(0)
a_p, b_p, a_q, b_q = torch.randn(4, 1000, dtype=torch.float64)
pair_pq = compose(a_p, b_p, a_q, b_q)
assert torch.allclose(step_matrix(a_q, b_q) @ step_matrix(a_p, b_p), step_matrix(*pair_pq))
assert not torch.allclose(torch.stack(pair_pq), torch.stack(compose(a_q, b_q, a_p, b_p)))
print("M(q) @ M(p) == M(p . q) on 1000 random pairs: ok;  p . q != q . p: ok (order matters)")

# %% [markdown]
# ### A property test for associativity
#
# `is_associative` compares both groupings on random float64 triples. This test matters: a kernel
# using a tempting wrong operator, `broken`, which keeps only the later gate, passes every check on
# Triton's CPU interpreter and fails only on a GPU. "Going deeper" runs the test on the operator, on
# `broken` and on one more wrong operator, and shows why the interpreter lets `broken` through.

# %%
#| export
def is_associative(op, n: int = 10_000, seed: int = 0) -> bool:
    """Property test: (p.q).r == p.(q.r) on n random float64 triples of pairs; op works on tensors
    (for a @triton.jit combine, pass its .fn)."""
    gen = torch.Generator().manual_seed(seed)
    p, q, r = (torch.randn(2, n, dtype=torch.float64, generator=gen) for _ in range(3))
    left = op(*op(*p, *q), *r)
    right = op(*p, *op(*q, *r))
    return all(torch.allclose(u, v, rtol=1e-12, atol=1e-12) for u, v in zip(left, right))

# %% [markdown]
# ## 3. One block: `tl.associative_scan` over pairs
#
# `tl.associative_scan(values, axis, combine_fn)` scans a block along `axis`. Given a *tuple* of
# tensors it scans them together, calling `combine_fn` with the earlier element's values, then the
# later one's, and returns the scanned tuple. One program scans one row held in one block; the
# padding up to the power of two holds the **identity pair** $(1, 0)$ (`other=1.0` for gates,
# `other=0.0` for tokens), so it changes nothing, and the store is masked.

# %%
@triton.jit
def scan_one_block_kernel(GATES, TOKENS, H, length, BLOCK: tl.constexpr):
    # GATES, TOKENS, H: rows x length contiguous, one program per row, BLOCK >= length
    row = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    mask = t < length
    a = tl.load(GATES + row * length + t, mask=mask, other=1.0)  # BLOCK gates, identity past the end
    b = tl.load(TOKENS + row * length + t, mask=mask, other=0.0)  # BLOCK tokens
    _, h = tl.associative_scan((a, b), 0, first_order_op)
    tl.store(H + row * length + t, h, mask=mask)


def scan_one_block(gates, tokens):
    """h for contiguous (rows, L) float32/float64 tensors, each row in a single block."""
    rows, length = tokens.shape
    h = torch.empty_like(tokens)
    scan_one_block_kernel[(rows,)](gates, tokens, h, length, BLOCK=triton.next_power_of_2(length))
    return h


torch.manual_seed(3)
print(f"{'L':>5} {'max abs err':>12}")
for length in [1, 7, 129, 1000]:
    gates_1b = torch.rand(3, length, device=DEVICE)
    tokens_1b = torch.randn(3, length, device=DEVICE)
    err = (scan_one_block(gates_1b, tokens_1b).double() - linear_scan_loop(gates_1b, tokens_1b)).abs().max().item()
    print(f"{length:5} {err:12.2e}")
    assert err < 1e-5  # section 5 replaces this fixed tolerance by one derived from dtype and length

# %% [markdown]
# ## 4. Any length: chunks and a carried state
#
# One block cannot hold a long row. A block lives in the registers of one program's threads, a fixed
# budget (chapter 01 counts it), and a scan of pairs keeps several values per element live (the gate,
# the token, the scanned pair). What does not fit is spilled by the compiler to local memory, which
# lives in the GPU's main memory and is slow, and Triton refuses a block of more than $2^{20}$ elements outright. Where between those limits
# a single block stops being fast, "Going deeper: one chunk per row, measured" times on a GPU: on the
# H100 of this run, one block per row keeps pace with the default chunk (at most 2048) up to rows of
# $2^{14}$ (ratios 0.99 to 1.04), then takes 1.61 times as long at $2^{15}$ and 5.82 times at
# $2^{16}$. Chapter 03 runs rows of 4097 float64 values in one block of 8192, three scans in one
# program: that it runs says nothing of its speed.
# So one program walks its row **chunk by chunk, in order**, and carries the state in a register: the
# $h$ at the end of one chunk is the $h^{\text{init}}$ of the next. Inside a chunk `tl.associative_scan`
# still works in parallel, and every element is read once and written once. The parallelism along
# the sequence is given up, but the rows are many (batch $\times$ dim in a Mamba layer).
#
# The state enters a chunk **folded into its first pair**, $(a_0, b_0) \to (a_0,\ a_0 h^{\text{in}} + b_0)$,
# which is $(1, h^{\text{in}}) \bullet (a_0, b_0)$; it leaves as the scanned value at the chunk's last
# position (padding, the identity, carries it through unchanged). The **reverse** direction is the
# same picture read from the right: chunks from the last one, each scanned right to left by
# `tl.associative_scan(..., reverse=True)`, with the same operator (Triton's left operand is the one
# earlier *in scan order*, so later in memory). The reverse chunks stay aligned to multiples of the
# chunk, like the forward ones, so when the chunk does not divide $L$ the padding sits at the right
# end of the first chunk visited, where the reverse scan starts: the state enters folded into a
# padding pair, $(1, 0) \to (1, h^{\text{init}})$, and the identity steps carry it unchanged to the
# row's last element. The figure's row has $L = 10$ in chunks of 4: its last chunk holds positions 8
# and 9 and two padding pairs (hatched), where the reverse scan starts.

# %%
def draw_carried_state(length=10, chunk=4):
    """The state carried between the chunks of one row, forward (top) and reverse (bottom); the chunks are
    aligned to multiples of `chunk`, the last one padded with identity pairs (hatched)."""
    padded = -(-length // chunk) * chunk          # the row rounded up to whole chunks
    fig, ax = plt.subplots(figsize=(7, 2.8))
    for y, reverse in [(1.6, False), (0.0, True)]:
        for t in range(padded):
            pad = t >= length
            ax.add_patch(plt.Rectangle((t, y), 0.9, 0.7, facecolor=f"C{t // chunk}", alpha=0.12 if pad else 0.3,
                                       hatch="//" if pad else None, edgecolor="0.3"))
            ax.text(t + 0.45, y + 0.35, "pad" if pad else f"{t}", ha="center", va="center", fontsize=7 if pad else 8)
        arrow = dict(arrowstyle="->", color="C3", lw=1.5, connectionstyle=f"arc3,rad={0.6 if reverse else -0.6}")
        for k in range(1, padded // chunk):  # the state leaves one chunk and enters the next in scan order
            leave, enter = (k * chunk, k * chunk - 1) if reverse else (k * chunk - 1, k * chunk)
            ax.annotate("", xy=(enter + 0.45, y + 0.72), xytext=(leave + 0.45, y + 0.72), arrowprops=arrow)
            ax.text(k * chunk - 0.05, y + 1.05, "h", color="C3", ha="center", fontsize=9)
        first, side = (padded - 1, 1) if reverse else (0, -1)
        ax.annotate(r"$h^{init}$", xy=(first + 0.45, y + 0.72), xytext=(first + 0.45 + 1.3 * side, y + 1.2), color="C0",
                    ha="center", fontsize=9, arrowprops=dict(arrowstyle="->", color="C0", lw=1.5))
        how = "reverse: chunks from the right,\neach scanned right to left" if reverse else "forward: chunks from the left,\neach scanned left to right"
        ax.text(padded + 0.4, y + 0.35, how, va="center", fontsize=8)
    ax.set(xlim=(-1.8, padded + 4.6), ylim=(-0.2, 3.0))
    ax.axis("off")
    ax.set_title(f"One program per row: L = {length} in {padded // chunk} chunks of {chunk} (the last padded), "
                 "the state h carried in a register", fontsize=9)
    return fig


save_figure(draw_carried_state(), "ema_carried_state.png")

# %% [markdown]
# `scan_chunk` scans one chunk from a carried state. Two `tl.where` tricks act on a single position:
# `tl.where(idx == entry, a * carry + b, b)` rewrites only the entry element (the fold), and
# `tl.sum(tl.where(idx == leave, h, 0.0))` picks the leaving element out as a scalar (all others add
# zero). `chunk_positions` gives the memory positions of the $k$-th chunk in either direction; the
# kernel loops over chunks with `tl.range` (a loop over a runtime count: one compiled kernel serves
# every length). It computes in an accumulator type `ACC` (float32, or float64 for float64 inputs) and
# rounds once, on the store, to the input's dtype. `REVERSED_LOADS` and `STAGES` are performance
# options ("Going deeper"); with their defaults the kernel is exactly the picture above (plus the
# padding of a partial chunk at the row's end, as just described).

# %%
#| export
@triton.jit
def scan_chunk(a, b, carry, REVERSE: tl.constexpr):
    """Scan one chunk of pairs (a, b) starting from the state `carry`; return (h, state leaving the chunk).

    a, b: CHUNK values (identity pairs (1, 0) in the padding); carry: a scalar.
    Forward, the state enters at position 0 and leaves at CHUNK - 1; in reverse, the other way round.
    """
    CHUNK: tl.constexpr = a.shape[0]
    idx = tl.arange(0, CHUNK)
    entry: tl.constexpr = CHUNK - 1 if REVERSE else 0
    leave: tl.constexpr = 0 if REVERSE else CHUNK - 1
    ### BEGIN SOLUTION
    ### HINT: fold `carry` into the entry pair, scan with first_order_op (reverse=REVERSE), return h and the state at `leave`
    b = tl.where(idx == entry, a * carry + b, b)  # fold the carried state into the entry pair
    _, h = tl.associative_scan((a, b), 0, first_order_op, reverse=REVERSE)
    return h, tl.sum(tl.where(idx == leave, h, 0.0), axis=0)
    ### END SOLUTION


@triton.jit
def chunk_positions(k, length, CHUNK: tl.constexpr, REVERSE: tl.constexpr, REVERSED_LOADS: tl.constexpr):
    """Memory positions (CHUNK, within the row) of the k-th chunk that a scan visits, and their mask.

    Forward: chunks from the left, ascending. Reverse: chunks from the right; ascending within the
    chunk (aligned to multiples of CHUNK), or with REVERSED_LOADS descending, so that the block is in
    scan order (its chunks end at length - 1, length - 1 - CHUNK, ...).
    """
    idx = tl.arange(0, CHUNK)
    if not REVERSE:
        t = k * CHUNK + idx
    elif REVERSED_LOADS:
        t = length - 1 - k * CHUNK - idx
    else:
        ### BEGIN SOLUTION
        ### HINT: t = the positions of the k-th chunk from the right, ascending, chunks aligned to multiples of CHUNK
        t = ((length - 1) // CHUNK - k) * CHUNK + idx
        ### END SOLUTION
    return t, (t >= 0) & (t < length)


@triton.jit
def linear_scan_fwd_kernel(GATES, TOKENS, H0, H, length, REVERSE: tl.constexpr, HAS_H0: tl.constexpr,
                           CHUNK: tl.constexpr, REVERSED_LOADS: tl.constexpr, STAGES: tl.constexpr, ACC: tl.constexpr):
    # GATES, TOKENS, H: rows x length contiguous; H0: rows (read only if HAS_H0). One program per row,
    # its chunks in scan order.
    row = tl.program_id(0)
    base = row.to(tl.int64) * length
    if HAS_H0:
        carry = tl.load(H0 + row).to(ACC)
    else:
        carry = tl.zeros((), ACC)
    SCAN_REVERSE: tl.constexpr = REVERSE and not REVERSED_LOADS  # does the block scan run right to left?
    for k in tl.range(0, tl.cdiv(length, CHUNK), num_stages=STAGES):
        t, mask = chunk_positions(k, length, CHUNK, REVERSE, REVERSED_LOADS)
        a = tl.load(GATES + base + t, mask=mask, other=1.0).to(ACC)
        b = tl.load(TOKENS + base + t, mask=mask, other=0.0).to(ACC)
        h, carry = scan_chunk(a, b, carry, SCAN_REVERSE)
        tl.store(H + base + t, h.to(H.dtype.element_ty), mask=mask)

# %% [markdown]
# The launcher scans contiguous (rows, L) tensors; chapter 03 builds the public, differentiable
# `scan_lib.linear_scan` on top of it. Its launch parameters (chunk size, warps) live in the dict
# `FWD_CONFIG`, explained in "Going deeper" with the tensor it passes for a missing initial state.

# %%
#| export
# Launch parameters of the forward kernel (benchmarks/bench_linear_scan.py sweeps them on a GPU).
FWD_CONFIG = {"max_chunk": 2048, "elements_per_thread": 16, "stages": 1, "reversed_loads": False}


def accumulator_dtype(dtype: torch.dtype):
    """The type kernels compute in: float64 for float64 inputs, float32 for everything else."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def default_chunk(length: int, max_chunk: int = 2048) -> int:
    """Elements per step of the chunk loop: a power of two in [16, max_chunk] covering the row if it can."""
    return max(16, min(triton.next_power_of_2(max(length, 1)), max_chunk))


def launch_options(length: int, config: dict, chunk=None) -> dict:
    """Constexprs and launch options for a scan kernel over rows of `length` (chunk: None for the default)."""
    chunk = chunk or default_chunk(length, config["max_chunk"])
    num_warps = min(16, max(1, chunk // (32 * config["elements_per_thread"])))
    return {"CHUNK": chunk, "STAGES": config["stages"], "REVERSED_LOADS": config["reversed_loads"],
            "num_warps": num_warps}


def linear_scan_rows(gates, tokens, initial_state=None, reverse=False, chunk=None, config=None):
    """h_t = gates_t * h_{t-1} + tokens_t (reverse: h_{t+1}) for contiguous (rows, L) tensors, L >= 1.

    initial_state: (rows,) or None for zeros; config: launch parameters, FWD_CONFIG if None.
    No autograd here: see scan_lib.linear_scan."""
    rows, length = tokens.shape
    h = torch.empty_like(tokens)
    linear_scan_fwd_kernel[(rows,)](
        gates, tokens, tokens if initial_state is None else initial_state, h, length,
        REVERSE=reverse, HAS_H0=initial_state is not None, ACC=accumulator_dtype(tokens.dtype),
        **launch_options(length, config or FWD_CONFIG, chunk),
    )
    return h

# %% [markdown]
# ## 5. Checks, with tolerances derived from the dtype and the length
#
# We compare the kernel with the float64 loop on the *same* (already rounded) inputs, so what is
# left is the kernel's own rounding, which `error_bound` bounds element by element. It has two sources:
# the output's rounding to its dtype, at most $u_{\text{out}}|h_t|$ ($u_{\text{out}}$ is the unit
# roundoff: $2^{-11}$ for float16, $2^{-8}$ for bfloat16, 0 when the output keeps the accumulator type;
# Triton 3.6's CPU interpreter truncates to bfloat16 instead of rounding, so there the bound allows
# $2^{-7}$); and the roundings in the accumulator type, at most $u_{\text{acc}}$ each ($2^{-24}$ in
# float32, $2^{-53}$ in float64), which add up along the way of each term $b_s$ to $h_t$: about one
# multiply and one add per step from $s$ to $t$, plus a few more in a tree. "Going deeper" counts
# them and writes the bound as two scans of absolute values, which is how `error_bound` computes it.
# The bound holds element by element, so a small $|h_t|$ gets a small tolerance too; "Going deeper"
# shows that a kernel accumulating in float16, or one that forgets the carry, fails it.

# %%
#| export
def error_bound(gates, tokens, initial_state=None, reverse=False, dtype=None):
    """Elementwise bound on |kernel - linear_scan_loop| for a scan whose output has `dtype` (tokens'
    dtype if None), computed in float32 (float64 for float64 output), rounded once to the output dtype
    (to nearest; truncated for bfloat16 by Triton's CPU interpreter).

    u_out |h_t| + 2 u_acc sum_s (t - s + 1 + d) prod_{r=s+1..t} |a_r| |b_s|, d = ceil(log2 L) + 2 tree
    levels, first order in u_acc (with a margin for the second-order terms)."""
    dtype = dtype or tokens.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    u_acc = torch.finfo(acc).eps / 2
    u_out = 0.0 if dtype == acc else torch.finfo(dtype).eps / 2
    if dtype == torch.bfloat16 and INTERPRET:
        u_out *= 2  # Triton 3.6's interpreter truncates float32 to bfloat16; a GPU rounds to nearest
    length = tokens.shape[-1]
    depth = math.ceil(math.log2(max(length, 2))) + 2
    h = linear_scan_loop(gates, tokens, initial_state, reverse)
    magnitude = linear_scan_loop(gates.abs(), tokens.abs(),
                                 None if initial_state is None else initial_state.abs(), reverse)
    steps = linear_scan_loop(gates.abs(), magnitude, None, reverse)  # each term weighted by t - s + 1
    second_order = 1 + 4 * (length + depth) * u_acc
    return (u_out * h.abs() + u_out * torch.finfo(dtype).tiny
            + 2 * u_acc * (1 + u_out) * second_order * (steps + depth * magnitude))


def error_ratio(h, gates, tokens, initial_state=None, reverse=False) -> float:
    """max |h - linear_scan_loop| / error_bound: at most 1 for a correct kernel."""
    expected = linear_scan_loop(gates, tokens, initial_state, reverse)
    bound = error_bound(gates, tokens, initial_state, reverse, dtype=h.dtype)
    return ((h.double() - expected).abs() / bound).max().item()

# %% [markdown]
# Every length, several chunk sizes, both directions (the reverse one both ways of "Going deeper"),
# with and without an initial state. Small chunks make the loop run many times and exercise the
# carry; a chunk larger than the row exercises the padding; length 4097 leaves a last chunk of one
# element. The table prints the worst ratio of error to bound per length and direction.

# %%
torch.manual_seed(4)
rows_check = 64 if ON_GPU else 2
print(f"{'L':>5} {'reverse':>16} {'max err / bound':>16}")
for length in [1, 7, 129, 1000, 4097]:
    gates_ck = torch.rand(rows_check, length, device=DEVICE)  # in [0, 1): a decaying state
    tokens_ck = torch.randn(rows_check, length, device=DEVICE)
    init_ck = torch.randn(rows_check, device=DEVICE)
    worst = {}
    for reverse in [False, True]:
        for init in [None, init_ck]:
            expected_ck = linear_scan_loop(gates_ck, tokens_ck, init, reverse)
            bound_ck = error_bound(gates_ck, tokens_ck, init, reverse)
            for reversed_loads in ([False, True] if reverse else [False]):
                how = ("descending loads" if reversed_loads else "reverse=True") if reverse else "no"
                config_ck = {**FWD_CONFIG, "reversed_loads": reversed_loads}
                for chunk in [16, 128, 1024] if length <= 1000 or ON_GPU else [1024]:
                    h_ck = linear_scan_rows(gates_ck, tokens_ck, init, reverse=reverse, chunk=chunk, config=config_ck)
                    ratio = ((h_ck.double() - expected_ck).abs() / bound_ck).max().item()
                    assert ratio <= 1, (length, chunk, how, init is not None, ratio)
                    worst[how] = max(worst.get(how, 0.0), ratio)
    for how, ratio in worst.items():
        print(f"{length:5} {how:>16} {ratio:16.3f}")
print("every length, chunk, direction and initial state: error within the bound")

# %% [markdown]
# Every dtype, with gates drawn in $[0.5, 1)$ (a long memory, the hard case for rounding): float16 and
# bfloat16 are scanned in float32, so one output rounding dominates their bound. (With tokens of mean 0
# and variance 1 the terms partly cancel: for a constant gate $a$, $|h|$ is typically about
# $1/\sqrt{1-a^2}$, not the $1/(1-a)$ that tokens all equal to 1 reach.)

# %%
torch.manual_seed(5)
gates_lp = torch.rand(4, 3000, device=DEVICE) * 0.5 + 0.5  # long memory: gates near 1
tokens_lp = torch.randn(4, 3000, device=DEVICE)
print(f"{'dtype':>15} {'max err / bound':>16}")
for dtype in [torch.float64, torch.float32, torch.float16, torch.bfloat16]:
    gates_d, tokens_d = gates_lp.to(dtype), tokens_lp.to(dtype)
    h_lp = linear_scan_rows(gates_d, tokens_d, chunk=256)
    assert h_lp.dtype == dtype
    ratio = error_ratio(h_lp, gates_d, tokens_d)
    print(f"{str(dtype):>15} {ratio:16.3f}")
    assert ratio <= 1, (dtype, ratio)

# %% [markdown]
# ## 6. Speed
#
# A scan reads the gates and tokens and writes the states: its floor is moving those three arrays at
# chapter 00's copy bandwidth. On a GPU the cell times the forward scan and the two ways of scanning
# in reverse ("Going deeper"), against that floor. Chapter 03 benchmarks the differentiable version.

# %%
if not ON_GPU:
    print("skipped: needs a GPU")
else:
    from scan_lib.runtime import copy_bandwidth, median_us
    rows_sp, length_sp = 8192, 4096
    gates_sp = torch.rand(rows_sp, length_sp, device=DEVICE)
    tokens_sp = torch.randn(rows_sp, length_sp, device=DEVICE)
    floor_us = 3 * gates_sp.numel() * gates_sp.element_size() / copy_bandwidth() * 1e6  # read a, b; write h
    print(f"{torch.cuda.get_device_name(DEVICE)}: {rows_sp} rows x {length_sp} float32, "
          f"chunks of {default_chunk(length_sp, FWD_CONFIG['max_chunk'])}; memory floor {floor_us:.1f} us")
    times_sp = {}
    for name, reverse, reversed_loads in [("forward", False, False), ("reverse, reverse=True", True, False),
                                          ("reverse, descending loads", True, True)]:
        config_sp = {**FWD_CONFIG, "reversed_loads": reversed_loads}
        times_sp[name] = median_us(lambda: linear_scan_rows(gates_sp, tokens_sp, reverse=reverse, config=config_sp))
        print(f"{name:26} {times_sp[name]:8.1f} us   floor / time = {floor_us / times_sp[name]:.2f}")
    faster = min(["reverse, reverse=True", "reverse, descending loads"], key=times_sp.get)
    print(f"fastest reverse scan here: {faster}; FWD_CONFIG['reversed_loads'] = {FWD_CONFIG['reversed_loads']}")

# %% [markdown]
# ## What we have, and what comes next
#
# - The recurrence $h_t = a_t h_{t-1} + b_t$ is a scan with the pair operator
#   $(a_p, b_p) \bullet (a_q, b_q) = (a_p a_q,\ a_q b_p + b_q)$, associative because it is a product of
#   $2\times2$ matrices; a property test in plain PyTorch ("Going deeper") confirms it and rejects a
#   plausible wrong one that the interpreter's left-to-right fold would have accepted. Associativity
#   is not correctness: the operator with its operands swapped is associative too, and only the
#   comparison with the steps applied one after another rejects it.
# - `scan_lib.ema` exports `first_order_op`, `scan_chunk`, `chunk_positions`, `linear_scan_fwd_kernel`
#   and the launcher `linear_scan_rows` with its launch parameters `FWD_CONFIG` (one program per row,
#   the state carried from chunk to chunk, an initial state, both directions); and the checks
#   `linear_scan_loop`, `error_bound` (with `error_ratio`) and `is_associative`.
# - "Going deeper" puts the kernel to work on a noisy signal: the EMA lags behind it, the reverse EMA
#   leads, and forward then reverse cancels the lag.
# - Chapter 03 derives the gradients, finds that the backward pass is the same scan run the other way,
#   and wraps both into the differentiable `scan_lib.linear_scan`.

# %% [markdown]
# ## Going deeper
#
# The main line is complete; what follows is the EMA computed as a scan, by the reference and then by
# the kernel on a noisy signal, and detail for readers who tune or debug these kernels.

# %% [markdown]
# ### The reference against the unrolled EMA
#
# The check compares the scan with something computed another way: the unrolled sum of section 1,
# $h_t = (1-\alpha)\sum_{s \le t} \alpha^{t-s} x_s$, as a matrix of weights times the samples (no loop,
# no recurrence), on a random signal.

# %%
torch.manual_seed(0)
alpha = 0.9
samples = torch.randn(50, dtype=torch.float64)
ema_as_scan = linear_scan_loop(torch.full_like(samples, alpha), (1 - alpha) * samples)
t_out, s_in = torch.arange(50)[:, None], torch.arange(50)[None, :]  # output position t, sample position s
weights = torch.where(s_in <= t_out, (1 - alpha) * alpha ** (t_out - s_in).clamp(min=0).double(), 0.0)  # 50 x 50
unrolled = weights @ samples  # h_t = (1 - alpha) * sum_{s <= t} alpha^(t - s) x_s
assert torch.allclose(ema_as_scan, unrolled, rtol=1e-12, atol=1e-12)
print("the linear scan with gates a_t = alpha and tokens b_t = (1 - alpha) * x_t equals the unrolled EMA: ok")

# %% [markdown]
# ### The EMA of a noisy signal
#
# Back to where section 1 started, now with the kernel: gates $a_t = \alpha$ and tokens $b_t = (1-\alpha)x_t$.
# A causal EMA lags behind the signal. Feed it a complex sine $x_t = e^{i\omega t}$ (angular frequency
# $\omega$ radians per sample): once the start-up transient (which decays like $\alpha^t$) has died
# out, the output is the same sine times a constant, $h_t = H e^{i\omega t}$,
# and putting that into $h_t = \alpha h_{t-1} + (1-\alpha)x_t$ gives $H(1 - \alpha e^{-i\omega}) = 1-\alpha$.
# Since $1 - \alpha e^{-i\omega} = (1 - \alpha\cos\omega) + i\,\alpha\sin\omega$, the angle of $H$ is
# $-\varphi$ with $\varphi = \arctan\!\big(\alpha \sin\omega / (1 - \alpha\cos\omega)\big)$. Why an angle is a
# delay: writing $H = |H|\,e^{-i\varphi}$ gives
# $h_t = |H|\,e^{i(\omega t - \varphi)} = |H|\,e^{i\omega(t - \varphi/\omega)}$, the input scaled by $|H|$
# and shifted $\varphi/\omega$ samples later. So the output is the input delayed by
# $\varphi/\omega$ samples (and a real sine, the sum of two complex ones, by the same). The reverse EMA
# (`reverse=True`) leads by as much: the same substitution in $h_t = \alpha h_{t+1} + (1-\alpha)x_t$
# gives the complex conjugate of $H$, the angle $+\varphi$. The reverse scan of the forward one multiplies
# the sine by both factors, $H\bar H = |H|^2$, a real number with no angle, so it cancels the lag
# (what signal processing calls a zero-phase filter). The cell measures
# the lags by cross-correlation and prints them next to the theory (the noise is drawn on the CPU,
# so every device smooths the same signal).

# %%
gen = torch.Generator().manual_seed(6)
alpha, n_samples = 0.9, 400
time_axis = torch.arange(n_samples, dtype=torch.float32)
clean = torch.sin(2 * math.pi * time_axis / 200)
noisy = clean + 0.4 * torch.randn(n_samples, generator=gen)
ema_gates = torch.full((1, n_samples), alpha, device=DEVICE)
ema_tokens = (1 - alpha) * noisy[None].to(DEVICE)
causal = linear_scan_rows(ema_gates, ema_tokens)[0]
anticausal = linear_scan_rows(ema_gates, ema_tokens, reverse=True)[0]
two_pass = linear_scan_rows(ema_gates, (1 - alpha) * causal[None], reverse=True)[0]
causal, anticausal, two_pass = causal.cpu(), anticausal.cpu(), two_pass.cpu()

assert error_ratio(causal[None], ema_gates.cpu(), ema_tokens.cpu()) <= 1
assert torch.allclose(causal.double(), torch.tensor(ema_loop(noisy.tolist(), alpha), dtype=torch.float64), atol=1e-5)


def lag(series) -> int:
    """The shift s in [-30, 30] for which series[t + s] best matches the clean sine (s > 0: it lags)."""
    window = slice(100, 300)  # away from the start-up transient and the ends
    scores = [(series[100 + s:300 + s] * clean[window]).sum().item() for s in range(-30, 31)]
    return max(range(-30, 31), key=lambda s: scores[s + 30])


expected_lag = math.atan(alpha * math.sin(2 * math.pi / 200) / (1 - alpha * math.cos(2 * math.pi / 200))) / (2 * math.pi / 200)
print(f"lag behind the clean sine (samples): causal {lag(causal)}, reverse {lag(anticausal)}, two-pass {lag(two_pass)}"
      f"  (theory for the causal EMA at this frequency: {expected_lag:.1f})")
assert abs(lag(causal) - expected_lag) <= 2 and abs(lag(anticausal) + expected_lag) <= 2 and abs(lag(two_pass)) <= 1

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(noisy, color="0.75", lw=0.8, label="noisy signal")
ax.plot(clean, "k--", lw=1, label="clean")
ax.plot(causal, lw=1.6, label=f"EMA, alpha = {alpha} (lags)")
ax.plot(anticausal, lw=1.6, label="reverse EMA (leads)")
ax.plot(two_pass, lw=1.6, label="forward then reverse (no lag)")
ax.set_xlabel("t")
ax.legend(loc="lower left", fontsize=7, ncol=2)
ax.set_title("Exponential moving averages computed by linear_scan_fwd_kernel", fontsize=10)
save_figure(fig, "ema_noisy_signal.png")

# %% [markdown]
# ### Launch parameters
#
# `launch_options` picks the chunk as the largest power of two up to `max_chunk` that the row needs
# (at least 16), and the number of warps so that each thread holds about `elements_per_thread`
# elements of the chunk (within 1 to 16 warps). `STAGES` > 1 lets the compiler *software-pipeline*
# the chunk loop (`tl.range(..., num_stages=STAGES)`: issue the loads of the next chunk while the
# current one is scanned). Each row starts at `row * length`, computed in 64-bit integers
# (`row.to(tl.int64)`): in 32 bits it would overflow past $2^{31}$ elements. The parameters live in
# one module-level dict so that `benchmarks/bench_linear_scan.py` can sweep others without touching
# the code. On the CPU interpreter only the chunk matters.
#
# Without an initial state the kernel never reads `H0`: `HAS_H0` is a compile-time constant, so the
# load is compiled out, and whatever is passed in that argument's place is never read. The launcher
# passes `tokens`, a tensor already at hand, as that placeholder.
#
# ### One chunk per row, measured
#
# Section 4 gave up a single block per row for chunks. Where does one block stop being fast? On a
# GPU, the cell times the forward on $2^{24}$ float32 values laid out as rows of $L$, once with the
# whole row as one chunk (a block of $L$ elements, with `launch_options`' warps: up to 16) and once with
# the default chunk, for $L$ from $2^{10}$ to $2^{16}$, and prints their ratio. Above 1, the single
# block is the slower. Up to $L = 2^{11}$ the default chunk is the whole row, so both columns time the
# same kernel, and their ratios (1.01, 1.00) show the noise.

# %%
from scan_lib.runtime import median_us   # chapter 00's timer

if not ON_GPU:
    print("skipped: needs a GPU")
else:
    print(f"{'L':>6} {'one chunk us':>13} {'default chunk us':>17} {'ratio':>6}"
          f"   ({torch.cuda.get_device_name()}, 2^24 float32 values)")
    for log_length in range(10, 17):
        length = 2**log_length
        gates_1c = torch.rand(2**24 // length, length, device=DEVICE)
        tokens_1c = torch.randn_like(gates_1c)
        whole_row = median_us(lambda: linear_scan_rows(gates_1c, tokens_1c, chunk=length))
        chunked = median_us(lambda: linear_scan_rows(gates_1c, tokens_1c))
        print(f"{length:6d} {whole_row:13.1f} {chunked:17.1f} {whole_row / chunked:6.2f}")

# %% [markdown]
# ### One loop per row, or three phases
#
# Chapter 01's cumsum scanned long rows in three phases: scan every chunk in parallel, scan the
# chunk totals, fix up. That works here too, with a *pair* $(\prod a, h)$ as each chunk's total, but
# reads and writes every element twice. The loop reads and writes once, and gives up only the
# parallelism along the sequence, which the many rows of a Mamba layer (batch $\times$ dim) make up
# for. With few rows and very long sequences we expect the balance to turn, an argument that this
# course does not measure: 16 rows are 16 programs, which keep at most 16 of the H100's 132
# multiprocessors busy (chapter 00 prints the count), while the three phases spread every row over many
# programs. Whether, and from which length on, the three-phase form is the faster one, no cell here times.
#
# ### Scanning a chunk from its end: `REVERSED_LOADS`
#
# There are two ways to scan a chunk right to left, and the kernel offers both:
#
# - load the chunk with ascending addresses and call `tl.associative_scan(..., reverse=True)` (the
#   default, `reversed_loads = False`). The loads stay aligned, but to run the scan right to left
#   Triton 3.6 reverses the order of the values across the threads of each warp before a forward
#   scan and again after it: extra data movement between threads (warp shuffles) on every chunk
#   (`benchmarks/NOTES_selective_scan.md` counts these shuffles in the compiled code of chapter 05's
#   kernels; this chapter does not inspect its own);
# - load the chunk with **descending** addresses (`REVERSED_LOADS=True`), so that position $j$ of
#   the block holds element $e - j$ of the row ($e$ the chunk's last element), and run the ordinary
#   forward scan. The block is then in scan order and nothing is reversed between threads. The price
#   is expected on the memory side: each warp still reads 32 neighbouring elements (coalesced), but
#   a thread's neighbours run backwards in memory, which can keep the compiler from merging them into
#   one wide (vectorised) load (not inspected here either). The chunks then end at
#   $L-1, L-1-\text{CHUNK}, \dots$ instead of being aligned.
#
# Which costs less is a measurement, not an argument: the speed table of section 6 times both on a
# GPU and names the faster (in this run `reverse=True`, 141.4 us; descending loads were slower,
# 157.6 us), and `benchmarks/bench_linear_scan.py` sweeps them with the other launch parameters.
# Section 5 checks both against the loop.
#
# ### The error bound of section 5, derived
#
# The model (Higham, chapter 2): a multiply or add in the accumulator type returns the exact result
# times $1+\epsilon$ with $|\epsilon| \le u_{\text{acc}}$ (underflow and overflow in the accumulator
# left aside; a fused multiply-add, which a GPU may use for $a_q b_p + b_q$, rounds once and only
# lowers the counts below). The exact state is a sum of terms, $h_t = \sum_{s \le t} \big(\prod_{r=s+1}^{t} a_r\big) b_s$,
# plus $\big(\prod_{r=0}^{t} a_r\big) h^{\text{init}}$. A rounded add, $(x + y)(1+\epsilon) = x(1+\epsilon) + y(1+\epsilon)$,
# and a rounded multiply, $xy(1+\epsilon)$, put their factor $1+\epsilon$ on every term that flows
# through them, so in any grouping the computed state is
#
# $$\hat h_t = \sum_{s \le t} \Big(\prod_{r=s+1}^{t} a_r\Big)\, b_s \prod_{i=1}^{n_s} (1 + \epsilon_i)$$
#
# (and likewise for the initial state), with $n_s$ the number of roundings on the way of $b_s$ to
# $h_t$. A product of $n$ such factors lies within $\gamma_n = n u/(1 - nu)$ of 1, with $u = u_{\text{acc}}$
# (Higham, lemma 3.1), so $|\hat h_t - h_t| \le \sum_s \gamma_{n_s} P_{s,t} |b_s|$ with
# $P_{s,t} = \prod_{r=s+1}^{t} |a_r|$: the roundings on a
# term's way add up, and the terms add in absolute value, which is why the bound scans $|a|$ and $|b|$.
# To first order, $\gamma_n \approx nu$; it remains to count $n_s$.
#
# - *Multiplies:* $t - s$, in any grouping. The factor $\prod_{r=s+1}^{t} a_r$ is built from
#   the gate products of $k$ disjoint ranges that cover positions $s+1, \dots, t$; a range of $m$ gates
#   costs $m - 1$ multiplies and multiplies the term once, $\sum_{i=1}^{k} (m_i - 1) + k = t - s$. The
#   initial state also passes through the first gate (in the fold $a_0 h^{\text{init}} + b_0$): $t + 1$.
# - *Adds:* one per combine on the term's way ($a_q b_p + b_q$ has one add; the fold into a chunk's
#   entry pair is one more combine). A left-to-right fold puts at most $t - s + 1$ combines on that
#   way. A tree puts fewer on a distant term's way and can put more on a near one's; the bound allows
#   $d = \lceil\log_2 \max(L, 2)\rceil + 2$ more than the fold, one per level of a binary tree over
#   the row, plus two. That allowance is not derived: the excess depends on how Triton compiles
#   `tl.associative_scan` and how the chunks cut the row, so it is measured. On the H100 of this run
#   the largest excess was 5 or 6 adds at every size measured ($L$ from 256 to 5000, chunks of 256 to
#   2048, both directions), against $d$ of 10 to 15: $d$ is an allowance well above what was measured,
#   and at other sizes, or with another Triton, an assumption until the cell runs there.
#
# The cell below counts them. `count_adds_kernel` is `linear_scan_fwd_kernel` (the same launch
# options, chunk loop, masked loads, fold, pick of the leaving state and `tl.associative_scan` call:
# axis 0, the same `reverse`, a tuple of two 32-bit tensors like the float32 kernel's) in which
# program $s$ follows one term, $b_s$, and one more program the initial state, which enters as the
# carry (counted as present in every row: without one the first fold adds zero, exactly). Its pairs
# are $(\text{kind}, \text{count})$: kind 2 where the pair's $b$ holds the term, 0 where $b$ is exactly
# zero (the padding's identity pairs), 1 otherwise; count, the adds the term has passed. `count_op`
# mirrors `first_order_op`: the add $a_q b_p + b_q$ lies on the term's way if either operand holds it
# (at most one does: their ranges are disjoint) and rounds unless the other operand's $b$ is zero, so
# there the count goes up by one; the result's kind is the larger one. (The `tl.sum` that picks the
# leaving state adds only zeros to it: exact.) The cell subtracts the loop's $t - s + 1$ (the initial
# state counts as $b_0$, or $b_{L-1}$ in reverse) and checks that the largest excess, over every term
# and every output it reaches, is at most $d$. It counts whichever lowering of `tl.associative_scan`
# runs it: on a GPU the compiled one (a sequential scan of each thread's elements, shuffles between
# the threads of a warp, a step across warps); on Triton's CPU interpreter a left-to-right fold, whose
# excess must be exactly 0, which checks the counting itself.

# %%
@triton.jit
def count_op(kind_left, count_left, kind_right, count_right):
    """first_order_op's adds on the way of one term: kind 2 = this b holds the term, 1 = b may be nonzero,
    0 = b is exactly 0; count = adds the term has passed. a_right * b_left + b_right rounds unless a summand is 0."""
    passes_left = (kind_left == 2) & (kind_right > 0)  # the term is in b_left, and b_right may be nonzero
    passes_right = (kind_right == 2) & (kind_left > 0)
    count = tl.where(kind_left == 2, count_left, tl.where(kind_right == 2, count_right, 0))
    return tl.maximum(kind_left, kind_right), count + (passes_left | passes_right).to(tl.int32)


@triton.jit
def count_chunk(kind, count, carry_kind, carry_count, REVERSE: tl.constexpr):
    """scan_chunk on (kind, count) pairs: fold the carry into the entry pair, scan, pick the leaving pair."""
    CHUNK: tl.constexpr = kind.shape[0]
    idx = tl.arange(0, CHUNK)
    entry: tl.constexpr = CHUNK - 1 if REVERSE else 0
    leave: tl.constexpr = 0 if REVERSE else CHUNK - 1
    fold_kind, fold_count = count_op(carry_kind, carry_count, kind, count)  # the fold a * carry + b
    kind = tl.where(idx == entry, fold_kind, kind)
    count = tl.where(idx == entry, fold_count, count)
    kind, count = tl.associative_scan((kind, count), 0, count_op, reverse=REVERSE)
    return count, tl.sum(tl.where(idx == leave, kind, 0), axis=0), tl.sum(tl.where(idx == leave, count, 0), axis=0)


@triton.jit
def count_adds_kernel(KIND, CARRY_KIND, COUNT, length, REVERSE: tl.constexpr, CHUNK: tl.constexpr,
                      REVERSED_LOADS: tl.constexpr, STAGES: tl.constexpr):
    # KIND, COUNT: rows x length int32 (program r follows one term: row r of KIND is its pairs' kinds);
    # CARRY_KIND: rows, the kind of the state entering the row. Loops like linear_scan_fwd_kernel.
    row = tl.program_id(0)
    base = row.to(tl.int64) * length
    carry_kind = tl.load(CARRY_KIND + row)
    carry_count = tl.zeros((), tl.int32)
    SCAN_REVERSE: tl.constexpr = REVERSE and not REVERSED_LOADS
    for k in tl.range(0, tl.cdiv(length, CHUNK), num_stages=STAGES):
        t, mask = chunk_positions(k, length, CHUNK, REVERSE, REVERSED_LOADS)
        kind = tl.load(KIND + base + t, mask=mask, other=0)  # CHUNK kinds, padding 0: the identity's b = 0
        count = tl.zeros_like(kind)
        count, carry_kind, carry_count = count_chunk(kind, count, carry_kind, carry_count, SCAN_REVERSE)
        tl.store(COUNT + base + t, count, mask=mask)


def count_adds(length: int, reverse: bool, chunk=None):
    """Adds on the way of each term to each output of linear_scan_fwd_kernel, (length + 1, length) int32:
    row s < length for b_s, row `length` for the initial state (zero where the term does not reach)."""
    kind = torch.ones(length + 1, length, dtype=torch.int32, device=DEVICE)
    kind[torch.arange(length), torch.arange(length)] = 2  # program s follows b_s
    carry_kind = torch.ones(length + 1, dtype=torch.int32, device=DEVICE)
    carry_kind[length] = 2  # the last program follows the initial state, the carry entering the row
    count = torch.zeros_like(kind)
    count_adds_kernel[(length + 1,)](kind, carry_kind, count, length, REVERSE=reverse,
                                     **launch_options(length, FWD_CONFIG, chunk))
    return count


def excess_over_fold(count, reverse: bool) -> int:
    """max over terms s and outputs t of count - (t - s + 1), the adds of the loop; the initial state as b_0."""
    length = count.shape[1]
    t = torch.arange(length, device=count.device)
    s = torch.cat([t, t[-1:] if reverse else t[:1]])[:, None]  # (length + 1, 1): each program's term
    steps = (s - t if reverse else t - s) + 1  # (length + 1, length): the loop's adds; < 1 where unreached
    return (count - steps)[steps >= 1].max().item()


sizes_adds = [(256, None), (1000, None), (2048, None), (4096, None), (5000, None), (5000, 256)] if ON_GPU \
    else [(7, None), (40, 16)]  # (L, chunk): the interpreter runs one program per term
print(f"{'L':>5} {'chunk':>6} {'direction':>9} {'excess':>7} {'d':>3}")
for length, chunk in sizes_adds:
    depth = math.ceil(math.log2(max(length, 2))) + 2
    for reverse in [False, True]:
        excess = excess_over_fold(count_adds(length, reverse, chunk), reverse)
        print(f"{length:5} {launch_options(length, FWD_CONFIG, chunk)['CHUNK']:6} "
              f"{'reverse' if reverse else 'forward':>9} {excess:7} {depth:3}")
        assert excess <= depth, (length, chunk, reverse, excess)
        assert ON_GPU or excess == 0  # the interpreter folds left to right: the loop's count exactly

# %% [markdown]
# So $n_s \le (t - s) + (t - s + 1 + d) \le 2(t - s + 1 + d)$: that is where $2u_{\text{acc}}$ and the
# weight $t - s + 1 + d$ come from. The initial state shares the combines of $b_0$ and has one more
# multiply, $n \le (t + 1) + (t + 1 + d) \le 2(t + 1 + d)$: weight $t + 1 + d$, as `error_bound` gives it.
#
# Adding the output's rounding, the bound to first order in $u_{\text{acc}}$ is
#
# $$|\hat h_t - h_t| \;\le\; u_{\text{out}}\,|h_t| \;+\; 2u_{\text{acc}} \sum_{s \le t} (t-s+1+d)\, P_{s,t}\, |b_s|,
# \qquad d = \lceil\log_2 \max(L, 2)\rceil + 2,$$
#
# with the initial state as one more term, $(t+1+d)\,P_{-1,t}\,|h^{\text{init}}|$. The sum is two
# scans of absolute values: $S = \mathrm{scan}(|a|, |b|)$ from $|h^{\text{init}}|$ is
# $\sum_s P_{s,t}|b_s| + P_{-1,t}|h^{\text{init}}|$, and $\mathrm{scan}(|a|, S)$ from zero weights each
# term by the number of positions from its entry to $t$: $t-s+1$ for $b_s$, $t+1$ for the initial state.
#
# `error_bound` adds three small terms to this formula:
#
# - the second-order factor $1 + 4(L + d)u_{\text{acc}}$: $\gamma_n \le nu(1 + 2nu)$ when $nu \le 1/2$
#   (because $1/(1-x) \le 1 + 2x$ for $0 \le x \le 1/2$), and $n \le 2(L + d)$;
# - the factor $1 + u_{\text{out}}$ and the term $u_{\text{out}}\,\text{tiny}$, from the output rounding.
#   Rounding $\hat h_t$ to the output dtype errs by at most $u_{\text{out}}|\hat h_t| + u_{\text{out}}\,\text{tiny}$,
#   where tiny is the dtype's smallest normal number (`torch.finfo(dtype).tiny`): below it the numbers
#   are subnormal, evenly spaced $2u_{\text{out}}\,\text{tiny}$ apart, and the error is absolute, at
#   most half that spacing. With $|\hat h_t| \le |h_t| + E$, $E$ the accumulator's bound above, the
#   total is $u_{\text{out}}|h_t| + u_{\text{out}}\,\text{tiny} + (1 + u_{\text{out}})E$. Truncation (bfloat16 on
#   the interpreter) errs by less than a whole spacing, which doubling $u_{\text{out}}$ covers.
#
# The ratios printed in section 5 (at most 0.164 in float32 and float64; 0.970 and 0.969 in float16
# and bfloat16, where the output rounding dominates) say the bound held on those inputs; they cannot
# confirm the count $d$, which random inputs rarely come near. The counting cell above measures the
# excess that $d$ allows for instead: at most 6 adds on the GPU, below $d$ at every size it tried.

# %% [markdown]
# ### The checks can fail
#
# Two plausible bugs, run through the check of section 5's dtype table, on its inputs: the kernel
# with its accumulator forced to float16 (`ACC=tl.float16`, a rounding per step), and a scan that
# forgets the carry, that is, scans every chunk of 256 on its own from a zero state.

# %%
gates_16, tokens_16 = gates_lp.to(torch.float16), tokens_lp.to(torch.float16)
h_acc16 = torch.empty_like(tokens_16)
linear_scan_fwd_kernel[(4,)](gates_16, tokens_16, tokens_16, h_acc16, 3000, REVERSE=False, HAS_H0=False,
                             ACC=tl.float16, **launch_options(3000, FWD_CONFIG, 256))
no_carry = linear_scan_rows(gates_lp[:, :2816].reshape(-1, 256), tokens_lp[:, :2816].reshape(-1, 256)).reshape(4, 2816)
ratio_acc16 = error_ratio(h_acc16, gates_16, tokens_16)
ratio_no_carry = error_ratio(no_carry, gates_lp[:, :2816], tokens_lp[:, :2816])
print(f"float16 accumulation: max err / bound = {ratio_acc16:.1f};  carry skipped: {ratio_no_carry:.3g}")
assert ratio_acc16 > 1 and ratio_no_carry > 1

# %% [markdown]
# ### Operators that pass some tests
#
# Section 2's `is_associative` accepts the operator and rejects a tempting wrong one, `broken`, which
# keeps only the later gate.
#
# What `is_associative` cannot see is *which* composition the operator computes: it compares the
# operator with itself, grouped two ways. The operator with its operands swapped, `swapped` below,
# which does the later step first, is associative too (it is the product of the same matrices in the
# other order) and has the same identity, so it passes both tests. What catches it is a comparison of
# the composed value with the definition: the step matrices of section 2 do that, and so does
# `follows_the_recurrence`, which applies the composed pair to a random state and compares the result
# with step $p$ applied first and step $q$ applied to that, $a_q(a_p h + b_p) + b_q$.

# %%
def broken(a_left, b_left, a_right, b_right):
    """A wrong combine: keeps only the later gate instead of the product of both."""
    return a_right, a_right * b_left + b_right


def swapped(a_left, b_left, a_right, b_right):
    """A wrong combine: the right (later) step first, then the left one."""
    return compose(a_right, b_right, a_left, b_left)


def is_identity(op, n: int = 1000) -> bool:
    """(1, 0) . p == p . (1, 0) == p on random pairs."""
    a, b = torch.randn(2, n, dtype=torch.float64)
    one, zero = torch.ones_like(a), torch.zeros_like(b)
    return all(torch.equal(torch.stack(op(*x)), torch.stack((a, b))) for x in [(one, zero, a, b), (a, b, one, zero)])


def follows_the_recurrence(op, n: int = 1000) -> bool:
    """op(p, q) applied to a state h equals step p, then step q, applied to h, on random pairs and states."""
    a_p, b_p, a_q, b_q, h = torch.randn(5, n, dtype=torch.float64)
    a_pq, b_pq = op(a_p, b_p, a_q, b_q)
    return torch.allclose(a_pq * h + b_pq, a_q * (a_p * h + b_p) + b_q, rtol=1e-12, atol=1e-12)


assert is_associative(compose) and is_identity(compose) and follows_the_recurrence(compose)
assert not is_associative(broken)
assert is_associative(swapped) and is_identity(swapped) and not follows_the_recurrence(swapped)
print(f"{'operator':10} {'associative':>12} {'(1,0) identity':>15} {'follows the recurrence':>23}")
for name, op in [("compose", compose), ("broken", broken), ("swapped", swapped)]:
    print(f"{name:10} {str(is_associative(op)):>12} {str(is_identity(op)):>15} {str(follows_the_recurrence(op)):>23}")

# %% [markdown]
# ### Why a kernel test on the CPU would not catch `broken`
#
# Folding left to right only ever combines the accumulated pair with a *single* step, and for that
# `broken` gives the right state: its state part $a_q b_p + b_q$ is correct, only the gate part is
# wrong, and a single step's gate is its own. A parallel scan also combines two *accumulated* pairs,
# and then the wrong gate poisons the result. Triton's CPU interpreter folds `tl.associative_scan`
# left to right; a GPU combines in a tree. So a kernel using `broken` would pass every test on the
# CPU and fail on the GPU: the property test of section 2 is the check that catches it everywhere.
#
# `scan_by_doubling` shows it without a GPU: the Hillis-Steele scan in plain PyTorch, where in round
# $k$ every position combines with the position $2^k$ to its left, a tree of combines.

# %%
def scan_left_fold(op, gates, tokens):
    """Inclusive scan along the last dim, one step at a time (how the interpreter folds)."""
    acc = (gates[..., 0], tokens[..., 0])
    states = [acc[1]]
    for t in range(1, tokens.shape[-1]):
        acc = op(*acc, gates[..., t], tokens[..., t])
        states.append(acc[1])
    return torch.stack(states, -1)


def scan_by_doubling(op, gates, tokens):
    """Inclusive scan along the last dim in ceil(log2 L) rounds (Hillis-Steele), padding with (1, 0)."""
    a, b = gates, tokens
    shift = 1
    while shift < tokens.shape[-1]:
        a_earlier = torch.cat([torch.ones_like(a[..., :shift]), a[..., :-shift]], -1)
        b_earlier = torch.cat([torch.zeros_like(b[..., :shift]), b[..., :-shift]], -1)
        a, b = op(a_earlier, b_earlier, a, b)
        shift *= 2
    return b


torch.manual_seed(1)
gates_demo = torch.rand(4, 100, dtype=torch.float64)
tokens_demo = torch.randn(4, 100, dtype=torch.float64)
expected_demo = linear_scan_loop(gates_demo, tokens_demo)
print(f"{'operator':10} {'left fold err':>14} {'tree err':>10}")
for name, op in [("compose", compose), ("broken", broken)]:
    fold_err = (scan_left_fold(op, gates_demo, tokens_demo) - expected_demo).abs().max().item()
    tree_err = (scan_by_doubling(op, gates_demo, tokens_demo) - expected_demo).abs().max().item()
    print(f"{name:10} {fold_err:14.1e} {tree_err:10.1e}")
assert torch.allclose(scan_left_fold(broken, gates_demo, tokens_demo), expected_demo)
assert not torch.allclose(scan_by_doubling(broken, gates_demo, tokens_demo), expected_demo)
assert torch.allclose(scan_by_doubling(compose, gates_demo, tokens_demo), expected_demo)

# %% [markdown]
# ### The combine as compiled
#
# The property tests above ran `first_order_op.fn` in PyTorch. The same tests on the operator
# as Triton compiles it: a tiny kernel evaluates both groupings on random triples. On the interpreter
# this checks the formula again; on a GPU it also checks the compiled code. Equal groupings alone would
# let an operator with its operands swapped through (the table of "Operators that pass some tests"),
# so the cell also checks the composed value: the pair $(p \bullet q) \bullet r$ applied to a random
# state must equal the three steps applied one after another, $a_r(a_q(a_p h + b_p) + b_q) + b_r$,
# computed on the host without `first_order_op`.

# %%
@triton.jit
def associativity_kernel(P, Q, R, OUT, n, BLOCK: tl.constexpr):
    # P, Q, R: 2 x n pairs (gates in row 0, tokens in row 1); OUT: 4 x n = both groupings
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    a_p, b_p = tl.load(P + i, mask=mask), tl.load(P + n + i, mask=mask)
    a_q, b_q = tl.load(Q + i, mask=mask), tl.load(Q + n + i, mask=mask)
    a_r, b_r = tl.load(R + i, mask=mask), tl.load(R + n + i, mask=mask)
    a_pq, b_pq = first_order_op(a_p, b_p, a_q, b_q)
    a_left, b_left = first_order_op(a_pq, b_pq, a_r, b_r)
    a_qr, b_qr = first_order_op(a_q, b_q, a_r, b_r)
    a_right, b_right = first_order_op(a_p, b_p, a_qr, b_qr)
    tl.store(OUT + i, a_left, mask=mask)
    tl.store(OUT + n + i, b_left, mask=mask)
    tl.store(OUT + 2 * n + i, a_right, mask=mask)
    tl.store(OUT + 3 * n + i, b_right, mask=mask)


torch.manual_seed(2)
n_triples = 5000
p_pairs, q_pairs, r_pairs = (torch.randn(2, n_triples, dtype=torch.float64, device=DEVICE) for _ in range(3))
groupings = torch.empty(4, n_triples, dtype=torch.float64, device=DEVICE)
associativity_kernel[(triton.cdiv(n_triples, 1024),)](p_pairs, q_pairs, r_pairs, groupings, n_triples, BLOCK=1024)
assert torch.allclose(groupings[:2], groupings[2:], rtol=1e-12, atol=1e-12)
state_pqr = torch.randn(n_triples, dtype=torch.float64, device=DEVICE)
step_by_step = r_pairs[0] * (q_pairs[0] * (p_pairs[0] * state_pqr + p_pairs[1]) + q_pairs[1]) + r_pairs[1]
assert torch.allclose(groupings[0] * state_pqr + groupings[1], step_by_step, rtol=1e-12, atol=1e-12)
print(f"first_order_op as compiled, on {n_triples} random float64 triples: (p.q).r == p.(q.r), "
      "and (p.q).r applied to h == step p, then q, then r: ok")

# %% [markdown]
# ### Zero and infinite gates
#
# Associativity holds for real numbers, not for IEEE's infinities. The recurrence applied step by
# step to the gates $0, \infty$ computes $\infty\cdot(0 \cdot h + b_1) + b_2$, which is $\pm\infty$ for
# a finite state $h$ and $b_1 \ne 0$. A tree may first compose the two steps, and their gate is
# $0 \cdot \infty =$ NaN, which then turns the state into NaN. In general, where a tree gives NaN and
# the recurrence does not, the recurrence gives $\pm\infty$, never a finite value: before the first
# infinite gate every gate is finite, so (as long as no product of gates overflows) the tree computes
# what the recurrence does, up to rounding; from the first infinite gate on, the recurrence's state
# is $\pm\infty$ or NaN, because an infinite gate times a finite state is $\pm\infty$ (NaN if the
# state is 0), and neither becomes finite again ($0 \cdot \infty$ and $\infty - \infty$ are NaN, and
# NaN stays NaN). A select, `tl.where(a_left == 0, 0, a_left * a_right)`, would mend this one case
# but not infinities in general (after two infinite gates with $b_1 > 0$, a negative state gives
# $-\infty$ step by step, and $-\infty + \infty =$ NaN in a tree), and it would stop
# `first_order_op.fn` from running on PyTorch tensors (`tl.where` exists only inside a kernel). So
# `first_order_op` keeps the plain formula. What it gives: with finite gates and tokens (and no
# overflow) the recurrence up to rounding, in any grouping; with infinite gates, possibly NaN on a GPU
# where the recurrence gives $\pm\infty$ (or, as its docstring says, a finite value where some product
# or sum overflowed first). The interpreter folds left to right, which is the recurrence step by
# step, so on the CPU the kernel gives the loop's values. The cell runs the loop, the left fold, the
# tree (`scan_by_doubling`) and the kernel on a row whose gate 0 is followed by an infinite one. On a
# GPU the kernel's tree need not group like `scan_by_doubling`, so its NaNs need not fall on the same
# positions; the asserts require only that wherever the kernel differs from the loop, the kernel
# gives NaN and the loop $\pm\infty$.

# %%
gates_inf = torch.tensor([[0.5, 0.0, math.inf, 0.5, 0.5]], dtype=torch.float64)
tokens_inf = torch.ones_like(gates_inf)
loop_inf = linear_scan_loop(gates_inf, tokens_inf)
fold_inf = scan_left_fold(compose, gates_inf, tokens_inf)
tree_inf = scan_by_doubling(compose, gates_inf, tokens_inf)
kernel_inf = linear_scan_rows(gates_inf.to(DEVICE), tokens_inf.to(DEVICE)).cpu()
for name, row in [("loop", loop_inf), ("left fold", fold_inf), ("tree", tree_inf), (f"kernel ({DEVICE.type})", kernel_inf)]:
    print(f"{name:14}", " ".join(f"{v:6}" for v in row[0].tolist()))
assert torch.equal(fold_inf, loop_inf) and tree_inf.isnan().any() and not loop_inf.isnan().any()
# the kernel gives the loop's value, or NaN where the loop gives +-inf (a tree on a GPU)
differs = ~torch.eq(kernel_inf, loop_inf)
assert (kernel_inf[differs].isnan() & loop_inf[differs].isinf()).all()
assert ON_GPU or torch.equal(kernel_inf, loop_inf)

# %% [markdown]
# ## References
#
# - Blelloch, "Prefix sums and their applications", CMU-CS-90-190, 1990 (scans, the up-sweep/down-sweep tree, and first-order recurrences as scans of pairs).
# - Martin and Cundy, "Parallelizing linear recurrent neural nets over sequence length", ICLR 2018.
# - Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., SIAM 2002 (rounding-error bounds for sums and products).
# - Sasha Rush, "Mamba: The Hard Way" (a Triton notebook from cumulative sums to the selective scan; part 2): https://srush.github.io/annotated-mamba/hard.html
