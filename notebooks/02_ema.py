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
# Chapter 01 scanned with `+`. This chapter scans with something that does not look like it can be
# scanned at all: a recurrence whose next value *multiplies* the previous one. By the end you will
#
# - write the exponential moving average (EMA) and its generalisation
#   $h_t = a_t h_{t-1} + b_t x_t$ as a plain loop, the reference for everything after;
# - turn one step of it into a **pair** $(a, b)$, compose pairs, and prove the composition is
#   associative (twice: by algebra and by $2\times2$ matrices), then *test* it in plain PyTorch;
# - see why a test on Triton's CPU interpreter alone would not catch a wrong combine operator;
# - scan pairs with `tl.associative_scan` in one block, then over any length with a carried state,
#   an initial state, and in reverse. The blocked kernel is exported to `scan_lib.ema`; chapter 03
#   adds its backward pass and wraps both as `scan_lib.linear_scan`.

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
# The loop below is the definition; it runs in float64 and is the reference we test against.

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
# ### The general first-order recurrence
#
# Let every coefficient change with the position, and read the state out through one more
# coefficient:
#
# $$h_t = a_t\, h_{t-1} + b_t\, x_t, \qquad y_t = c_t\, h_t, \qquad h_{-1} = h_0^{\text{init}} .$$
#
# The EMA is $a_t = \alpha$, $b_t = 1-\alpha$, $c_t = 1$. Mamba's selective scan (chapter 05) is this
# recurrence with $a_t, b_t, c_t$ computed from the input. Only the line for $h$ is sequential:
# $u_t = b_t x_t$ and $y_t = c_t h_t$ are elementwise. So the kernel problem is the **linear scan**
#
# $$h_t = a_t\, h_{t-1} + u_t ,$$
#
# with *gates* $a_t$ and *tokens* $u_t$. Here is its reference for tensors of shape (..., L), scanning
# the last dimension, with an optional initial state and an optional reverse direction
# ($h_t = a_t h_{t+1} + u_t$, running from the end).

# %%
def linear_scan_loop(gates, tokens, initial_state=None, reverse=False):
    """h_t = gates_t * h_{t-1} + tokens_t along the last dim (reverse: h_{t+1}), in float64."""
    if reverse:
        return linear_scan_loop(gates.flip(-1), tokens.flip(-1), initial_state).flip(-1)
    gates, tokens = gates.double(), tokens.double()
    h = torch.zeros_like(tokens[..., 0]) if initial_state is None else initial_state.double()
    states = []
    for t in range(tokens.shape[-1]):
        h = gates[..., t] * h + tokens[..., t]  # (...)
        states.append(h)
    return torch.stack(states, dim=-1)  # (..., L)


samples = torch.tensor(steps, dtype=torch.float64)
ema_as_scan = linear_scan_loop(torch.full_like(samples, 0.9), 0.1 * samples)
assert torch.allclose(ema_as_scan, torch.tensor(climb, dtype=torch.float64))
print("the EMA is the linear scan with gates = alpha and tokens = (1 - alpha) * x: ok")

# %% [markdown]
# ## 2. One step is a pair, and pairs compose
#
# A cumulative sum can be split anywhere because $+$ is associative. The recurrence looks
# sequential: $h_t$ needs $h_{t-1}$. The way out is to stop thinking about the *value* $h$ and think
# about the *step*: step $t$ is the affine map
#
# $$f_t(h) = a_t h + u_t ,$$
#
# which we store as the pair $(a_t, u_t)$. Doing one step $p = (a_p, b_p)$ and then a later step
# $q = (a_q, b_q)$ is again an affine map:
#
# $$q(p(h)) = a_q (a_p h + b_p) + b_q = (a_p a_q)\,h + (a_q b_p + b_q),$$
#
# so we define the **combine operator** on pairs, earlier operand on the left:
#
# $$(a_p, b_p) \bullet (a_q, b_q) = (a_p a_q,\; a_q b_p + b_q).$$
#
# The state after step $t$ is the second component of $(a_0, u_0 + a_0 h^{\text{init}}) \bullet
# (a_1, u_1) \bullet \dots \bullet (a_t, u_t)$: an inclusive scan with $\bullet$. The pair $(1, 0)$
# (the map $h \mapsto h$) is its identity, which is what we pad blocks with.
#
# **Associativity, by algebra.** For three steps $p, q, r$:
#
# $$\begin{aligned}
# (p \bullet q) \bullet r &= (a_p a_q,\ a_q b_p + b_q) \bullet (a_r, b_r)
#   = \big(a_p a_q a_r,\ a_r a_q b_p + a_r b_q + b_r\big),\\
# p \bullet (q \bullet r) &= (a_p, b_p) \bullet (a_q a_r,\ a_r b_q + b_r)
#   = \big(a_p a_q a_r,\ a_q a_r b_p + a_r b_q + b_r\big).
# \end{aligned}$$
#
# Both are equal (real multiplication commutes). **Associativity, by matrices.** Write the step as
# a $2\times2$ matrix acting on the column $(h, 1)^\top$:
#
# $$M(a, b) = \begin{pmatrix} a & b \\ 0 & 1 \end{pmatrix}, \qquad
# M(a,b)\begin{pmatrix} h \\ 1\end{pmatrix} = \begin{pmatrix} a h + b \\ 1 \end{pmatrix},\qquad
# M(a_q, b_q)\,M(a_p, b_p) = M\big((a_p,b_p)\bullet(a_q,b_q)\big).$$
#
# Composing steps is multiplying matrices (later on the left), and matrix multiplication is
# associative. The pair is the compressed form of that matrix: its bottom row never changes.
# (It is *not* commutative: $p \bullet q \ne q \bullet p$ in general, so the order of operands
# matters everywhere below.)
#
# The operator Triton will use is exported now; the Mamba chapter imports it from here.

# %%
#| export
"""Forward kernels of the first-order (linear) scan h_t = a_t * h_{t-1} + u_t, built on one combine operator."""
import torch
import triton
import triton.language as tl


@triton.jit
def first_order_op(a_left, b_left, a_right, b_right):
    """Compose two steps of h -> a*h + b: first the left (earlier) one, then the right (later) one.

    a_right * (a_left * h + b_left) + b_right = (a_left * a_right) * h + (a_right * b_left + b_right)
    """
    return a_left * a_right, a_right * b_left + b_right

# %% [markdown]
# A `@triton.jit` function is launched only from inside a kernel, but it keeps the plain Python
# function it was made from as `.fn`. Its body is arithmetic that PyTorch tensors understand too, so
# the plain-PyTorch experiments below run the very operator the kernels use, not a copy of it:

# %%
compose = first_order_op.fn  # (a_left, b_left, a_right, b_right) -> the composed pair, on tensors

# %% [markdown]
# First the matrix view, numerically:

# %%
def step_matrix(a, b):
    """The 2x2 matrix [[a, b], [0, 1]] of the step h -> a*h + b, for tensors a, b of shape (N,)."""
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
# A proof on paper is good; a test that would fail if the *code* had a typo is better. The test
# draws many random triples and compares both groupings in float64. We run it on the right operator
# and on a tempting wrong one, `broken`, which forgets to multiply the gates and keeps only the later
# one.

# %%
def broken(a_left, b_left, a_right, b_right):
    """A wrong combine: keeps only the later gate instead of the product of both."""
    return a_right, a_right * b_left + b_right


def is_associative(op, n: int = 10_000, seed: int = 0) -> bool:
    """Compare (p.q).r with p.(q.r) on n random triples of pairs, in float64."""
    gen = torch.Generator().manual_seed(seed)
    p, q, r = (torch.randn(2, n, dtype=torch.float64, generator=gen) for _ in range(3))
    left = op(*op(*p, *q), *r)
    right = op(*p, *op(*q, *r))
    return all(torch.allclose(u, v, rtol=1e-12, atol=1e-12) for u, v in zip(left, right))


def is_identity(op, n: int = 1000) -> bool:
    """(1, 0) . p == p . (1, 0) == p on random pairs."""
    a, b = torch.randn(2, n, dtype=torch.float64)
    one, zero = torch.ones_like(a), torch.zeros_like(b)
    return all(torch.equal(torch.stack(op(*x)), torch.stack((a, b))) for x in [(one, zero, a, b), (a, b, one, zero)])


assert is_associative(compose) and is_identity(compose)
assert not is_associative(broken)
print(f"{'operator':10} {'associative':>12} {'(1,0) identity':>15}")
for name, op in [("compose", compose), ("broken", broken)]:
    print(f"{name:10} {str(is_associative(op)):>12} {str(is_identity(op)):>15}")

# %% [markdown]
# ### Why the interpreter would not have caught `broken`
#
# Folding left to right, one new step at a time, only ever combines an accumulated pair with a
# *single* step, and for that `broken` gives the right state: the state part $a_q b_p + b_q$ is
# correct, only the gate part is wrong, and a single step's gate is its own. A parallel scan also
# combines two *accumulated* pairs, and then the wrong gate part poisons the result. Triton's CPU
# interpreter folds `tl.associative_scan` left to right; the GPU combines in a tree. So a kernel using
# `broken` passes every test on the CPU and fails on the GPU.
#
# We can show this without a GPU. `scan_by_doubling` is the Hillis-Steele scan in plain PyTorch: in
# round $k$ every position combines with the position $2^k$ to its left, so after $\lceil\log_2 L\rceil$
# rounds each holds the composition of all steps up to it, grouped as a tree.

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
# The same property test, run on the operator Triton actually uses: a tiny kernel evaluates both
# groupings of `first_order_op` on random triples. (On the interpreter this checks the formula; on a
# GPU it also checks the compiled code.)

# %%
@triton.jit
def associativity_kernel(P, Q, R, OUT, N, BLOCK: tl.constexpr):
    # P, Q, R: 2 x N pairs (gates in row 0, states in row 1); OUT: 4 x N = both groupings
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    a_p, b_p = tl.load(P + i, mask=mask), tl.load(P + N + i, mask=mask)
    a_q, b_q = tl.load(Q + i, mask=mask), tl.load(Q + N + i, mask=mask)
    a_r, b_r = tl.load(R + i, mask=mask), tl.load(R + N + i, mask=mask)
    a_pq, b_pq = first_order_op(a_p, b_p, a_q, b_q)
    a_left, b_left = first_order_op(a_pq, b_pq, a_r, b_r)
    a_qr, b_qr = first_order_op(a_q, b_q, a_r, b_r)
    a_right, b_right = first_order_op(a_p, b_p, a_qr, b_qr)
    tl.store(OUT + i, a_left, mask=mask)
    tl.store(OUT + N + i, b_left, mask=mask)
    tl.store(OUT + 2 * N + i, a_right, mask=mask)
    tl.store(OUT + 3 * N + i, b_right, mask=mask)


torch.manual_seed(2)
n_triples = 5000
p_pairs, q_pairs, r_pairs = (torch.randn(2, n_triples, dtype=torch.float64, device=DEVICE) for _ in range(3))
groupings = torch.empty(4, n_triples, dtype=torch.float64, device=DEVICE)
associativity_kernel[(triton.cdiv(n_triples, 1024),)](p_pairs, q_pairs, r_pairs, groupings, n_triples, BLOCK=1024)
assert torch.allclose(groupings[:2], groupings[2:], rtol=1e-12, atol=1e-12)
print(f"first_order_op: (p.q).r == p.(q.r) on {n_triples} random float64 triples: ok")

# %% [markdown]
# ## 3. One block: `tl.associative_scan` over pairs
#
# `tl.associative_scan` takes a *tuple* of tensors and a combine function with twice as many
# arguments, here `first_order_op(a_left, b_left, a_right, b_right)`, and returns the scanned tuple.
# One program scans one row held entirely in one block. The block is a power of two, so rows whose
# length is not get padded, and the padding must not change the result: we load the **identity pair**
# $(1, 0)$ there (`other=1.0` for gates, `other=0.0` for tokens) and mask the store.

# %%
@triton.jit
def scan_one_block_kernel(A, U, H, L, BLOCK: tl.constexpr):
    # A, U, H: R x L contiguous, one program per row, BLOCK >= L
    row = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    mask = t < L
    a = tl.load(A + row * L + t, mask=mask, other=1.0)  # BLOCK gates, identity past the end
    u = tl.load(U + row * L + t, mask=mask, other=0.0)  # BLOCK tokens
    _, h = tl.associative_scan((a, u), 0, first_order_op)
    tl.store(H + row * L + t, h, mask=mask)


def scan_one_block(gates, tokens):
    """h for contiguous (R, L) float32/float64 tensors, each row in a single block."""
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
    assert err < 1e-5

# %% [markdown]
# ## 4. Any length: chunks and a carried state
#
# One block cannot hold a long row (registers run out past a few thousand elements), so we cut the
# row into chunks and pass a **state** from chunk to chunk: the $h$ at the end of one chunk is the
# $h^{\text{init}}$ of the next. Two organisations suggest themselves:
#
# - **three phases**, as chapter 01 did for cumsum (scan every chunk in parallel, scan the chunk
#   totals, fix up): each chunk's total is now a *pair* $(\prod a, h)$, and every element is read
#   twice and written twice;
# - **one program per row, looping over its chunks in order**, keeping the carried state in a
#   register: every element is read once and written once, in one launch.
#
# We take the loop. Our rows are many: a Mamba layer scans batch $\times$ channels rows (8 x 1024 =
# 8192 in the benchmark of chapter 03), enough programs to fill every SM of a GPU several times, so
# the parallelism along the sequence is not needed and the loop costs nothing but the memory traffic
# that any scan must pay. Inside a chunk, `tl.associative_scan` still does the work in parallel across
# the block's threads; consecutive elements of a row are consecutive in memory, so the loads are
# coalesced. (With few rows and very long sequences, say 16 rows of a million, the loop would leave
# most SMs idle and the three-phase form would win.)
#
# How the carried state enters a chunk: rather than scanning the chunk and fixing every element up
# afterwards, we **fold the state into the first pair** of the chunk,
# $(a_0, u_0) \to (a_0,\ a_0 h^{\text{in}} + u_0)$, which is $(1, h^{\text{in}}) \bullet (a_0, u_0)$, and scan.
# The state that leaves the chunk is then the scanned value at its last position. Padding with the
# identity $(1, 0)$ carries a state through unchanged, so this "last position" may even be padding.
#
# The **reverse** direction, $h_t = a_t h_{t+1} + u_t$, is the same story read from the right: the
# loop visits chunks from the last one, and each chunk is scanned from its end. There are two ways to
# scan a chunk from its end, and the kernel offers both (`REVERSED_LOADS`):
#
# - load the chunk with ascending addresses, as usual, and call
#   `tl.associative_scan(..., reverse=True)`: the state enters at the chunk's last position and leaves
#   at its first. The combine operator does not change: in a reverse scan, Triton's "left" operand is
#   the one that comes earlier *in scan order*, that is, later in memory. The loads stay aligned and
#   vectorised, but to run the scan right to left the compiled code reverses the order of the values
#   across the threads of each warp before the scan and again after it: extra data movement between
#   threads (warp shuffles) on every chunk;
# - load the chunk with **descending** addresses, so that position $j$ of the block holds element
#   $e - j$ of the row ($e$ the chunk's last element), and run the ordinary forward scan. The block is
#   then in scan order: nothing is reversed between threads. The price is on the memory side: each
#   warp still reads 32 neighbouring elements (coalesced), but the compiler cannot merge a thread's
#   neighbours into one wide (vectorised) load, since they run backwards.
#
# Which costs less is a measurement, not an argument: `benchmarks/bench_linear_scan.py` times both on
# a GPU. On the H200 (2026-11-29; 8192 rows of 4096 float32 values, chunks of 2048) `reverse=True`
# won: a reverse scan took 109.7 us with it and 141.6 us with descending loads, and chapter 03's
# backward kernel 169 against 219 us, so both default configurations use it. Scanning right to left
# still costs about 10% over the plain forward scan (109.7 against 100.4 us).
#
# The helper `chunk_positions` gives the memory positions of the block for each case, and
# `scan_chunk` scans in either direction.
#
# Three details for GPUs. The chunk loop is a `for` over a runtime number of chunks, so one compiled
# kernel serves every $L$, and `tl.range(..., num_stages=STAGES)` lets the compiler *software-pipeline*
# it (issue the loads of the next chunk while the current one is scanned) when `STAGES` > 1. Loads are
# converted to an accumulator type, float32 for float16/bfloat16/float32 inputs and float64 for float64,
# with the output stored back in the input's dtype. And each row starts at `row * L`, computed in 64-bit
# integers: in 32 bits it would overflow past $2^{31}$ elements.

# %%
#| export
@triton.jit
def scan_chunk(a, u, carry, REVERSE: tl.constexpr):
    """Scan one chunk of pairs (a, u) starting from the state `carry`; return (h, state leaving the chunk).

    a, u: CHUNK values (identity pairs (1, 0) in the padding); carry: a scalar.
    Forward, the state enters at position 0 and leaves at CHUNK - 1; in reverse, the other way round.
    """
    CHUNK: tl.constexpr = a.shape[0]
    idx = tl.arange(0, CHUNK)
    entry: tl.constexpr = CHUNK - 1 if REVERSE else 0
    leave: tl.constexpr = 0 if REVERSE else CHUNK - 1
    u = tl.where(idx == entry, a * carry + u, u)  # fold the carried state into the entry pair
    _, h = tl.associative_scan((a, u), 0, first_order_op, reverse=REVERSE)
    return h, tl.sum(tl.where(idx == leave, h, 0.0), axis=0)


@triton.jit
def chunk_positions(k, L, CHUNK: tl.constexpr, REVERSE: tl.constexpr, REVERSED_LOADS: tl.constexpr):
    """Memory positions (CHUNK, within the row) of the k-th chunk that a scan visits, and their mask.

    Forward: chunks from the left, ascending. Reverse: chunks from the right; ascending within the
    chunk (aligned to multiples of CHUNK), or with REVERSED_LOADS descending, so that the block is in
    scan order (its chunks end at L - 1, L - 1 - CHUNK, ...).
    """
    idx = tl.arange(0, CHUNK)
    if not REVERSE:
        t = k * CHUNK + idx
    elif REVERSED_LOADS:
        t = L - 1 - k * CHUNK - idx
    else:
        t = ((L - 1) // CHUNK - k) * CHUNK + idx
    return t, (t >= 0) & (t < L)


@triton.jit
def linear_scan_fwd_kernel(A, U, H0, H, L, REVERSE: tl.constexpr, HAS_H0: tl.constexpr, CHUNK: tl.constexpr,
                           REVERSED_LOADS: tl.constexpr, STAGES: tl.constexpr, ACC: tl.constexpr):
    # A, U, H: R x L contiguous; H0: R (read only if HAS_H0). One program per row, its chunks in scan order.
    row = tl.program_id(0)
    base = row.to(tl.int64) * L
    if HAS_H0:
        carry = tl.load(H0 + row).to(ACC)
    else:
        carry = tl.zeros((), ACC)
    SCAN_REVERSE: tl.constexpr = REVERSE and not REVERSED_LOADS  # does the block scan run right to left?
    for k in tl.range(0, tl.cdiv(L, CHUNK), num_stages=STAGES):
        t, mask = chunk_positions(k, L, CHUNK, REVERSE, REVERSED_LOADS)
        a = tl.load(A + base + t, mask=mask, other=1.0).to(ACC)
        u = tl.load(U + base + t, mask=mask, other=0.0).to(ACC)
        h, carry = scan_chunk(a, u, carry, SCAN_REVERSE)
        tl.store(H + base + t, h.to(H.dtype.element_ty), mask=mask)

# %% [markdown]
# The launcher works on contiguous (R, L) rows; chapter 03 builds the public, differentiable
# `scan_lib.linear_scan` (any leading dims, input checks) on top of it. Its launch parameters live in
# one module-level dict, `FWD_CONFIG`, so that a benchmark script can try others without touching the
# code: the chunk is the largest power of two up to `max_chunk` that the row needs (at least 16), and
# the number of warps gives each thread about `elements_per_thread` elements of it (within 1 to 16
# warps). On the CPU interpreter only the chunk matters.

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
    """h_t = gates_t * h_{t-1} + tokens_t (reverse: h_{t+1}) for contiguous (R, L) tensors, L >= 1.

    initial_state: (R,) or None for zeros; config: launch parameters, FWD_CONFIG if None.
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
# ### Checks: every length, several chunk sizes, both directions, with and without an initial state
#
# Small chunks (16) make the loop run hundreds of times and exercise the carry; a chunk larger than
# the row exercises the padding. Length 4097 is one past a power of two, so one chunk holds a single
# element. The reverse direction is checked both ways: descending loads and `reverse=True`.

# %%
torch.manual_seed(4)
rows_check = 64 if ON_GPU else 3
print(f"{'L':>5} {'chunk':>6} {'reverse':>16} {'init':>5} {'max abs err':>12}")
for length in [1, 7, 129, 1000, 4097]:
    gates_ck = torch.rand(rows_check, length, device=DEVICE)  # in [0, 1): a decaying state
    tokens_ck = torch.randn(rows_check, length, device=DEVICE)
    init_ck = torch.randn(rows_check, device=DEVICE)
    for reverse, reversed_loads in [(False, False), (True, True), (True, False)]:
        config_ck = {**FWD_CONFIG, "reversed_loads": reversed_loads}
        how = ("descending loads" if reversed_loads else "reverse=True") if reverse else "no"
        for init in [None, init_ck]:
            expected_ck = linear_scan_loop(gates_ck, tokens_ck, init, reverse)
            for chunk in [16, 128, 1024]:
                h_ck = linear_scan_rows(gates_ck, tokens_ck, init, reverse=reverse, chunk=chunk, config=config_ck)
                err = (h_ck.double() - expected_ck).abs().max().item()
                assert err < 1e-4, (length, chunk, reverse, reversed_loads, init is not None, err)
                if chunk == 16 and init is not None:
                    print(f"{length:5} {chunk:6} {how:>16} {'yes' if init is not None else 'no':>5} {err:12.2e}")
print("every length, chunk, direction and initial state: max abs err < 1e-4")

# %% [markdown]
# Low precision: float16 and bfloat16 inputs are scanned in float32 and rounded once on the way out,
# so the error is about one rounding of the output (relative $2^{-11}$ and $2^{-8}$), not a rounding per
# step; float64 inputs are scanned in float64.

# %%
torch.manual_seed(5)
gates_lp = torch.rand(4, 3000, device=DEVICE) * 0.5 + 0.5  # long memory: h grows to about 1/(1-a)
tokens_lp = torch.randn(4, 3000, device=DEVICE)
expected_lp = linear_scan_loop(gates_lp, tokens_lp)
scale_lp = expected_lp.abs().max().item()
print(f"{'dtype':>15} {'max abs err / max |h|':>22}")
for dtype, tolerance in [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)]:
    h_lp = linear_scan_rows(gates_lp.to(dtype), tokens_lp.to(dtype), chunk=256)
    assert h_lp.dtype == dtype
    # compare with the float64 scan of the *rounded* inputs: what is left is the kernel's own error
    err = (h_lp.double() - linear_scan_loop(gates_lp.to(dtype), tokens_lp.to(dtype))).abs().max().item() / scale_lp
    print(f"{str(dtype):>15} {err:22.2e}")
    assert err < tolerance

# %% [markdown]
# ## 5. The EMA of a noisy signal
#
# Back to where we started, now with the kernel. A causal EMA lags behind the signal: for a sine of
# angular frequency $\omega$ the lag is $\arctan\!\big(\alpha \sin\omega / (1 - \alpha\cos\omega)\big)/\omega$
# samples (the phase of $(1-\alpha)/(1-\alpha e^{-i\omega})$), about $\alpha/(1-\alpha)$ for slow signals.
# The reverse EMA (same gates, `reverse=True`) leads by the same amount, and running the reverse scan
# on the output of the forward one cancels the lag, like a zero-phase filter. We measure each lag by
# cross-correlating with the clean sine.

# %%
torch.manual_seed(6)
alpha, n_samples = 0.9, 400
time_axis = torch.arange(n_samples, device=DEVICE, dtype=torch.float32)
clean = torch.sin(2 * math.pi * time_axis / 200)
noisy = clean + 0.4 * torch.randn(n_samples, device=DEVICE)
ema_gates = torch.full((1, n_samples), alpha, device=DEVICE)
causal = linear_scan_rows(ema_gates, (1 - alpha) * noisy[None])[0]
anticausal = linear_scan_rows(ema_gates, (1 - alpha) * noisy[None], reverse=True)[0]
two_pass = linear_scan_rows(ema_gates, (1 - alpha) * causal[None], reverse=True)[0]

assert torch.allclose(causal.double().cpu(), torch.tensor(ema_loop(noisy.tolist(), alpha), dtype=torch.float64), atol=1e-5)


def lag(series) -> int:
    """The shift s in [-30, 30] for which series[t + s] best matches the clean sine (s > 0: it lags)."""
    window = slice(100, 300)  # away from the start-up transient and the ends
    scores = [(series[100 + s:300 + s] * clean[window]).sum().item() for s in range(-30, 31)]
    return max(range(-30, 31), key=lambda s: scores[s + 30])


expected_lag = math.atan(alpha * math.sin(2 * math.pi / 200) / (1 - alpha * math.cos(2 * math.pi / 200))) / (2 * math.pi / 200)
print(f"lag behind the clean sine (samples): causal {lag(causal)}, reverse {lag(anticausal)}, two-pass {lag(two_pass)}"
      f"  (theory for the causal EMA at this frequency: {expected_lag:.1f})")
assert abs(lag(causal) - expected_lag) <= 2 and abs(lag(anticausal) + expected_lag) <= 2 and abs(lag(two_pass)) <= 1

fig, ax = plt.subplots(figsize=(9, 3.5))
ax.plot(noisy.cpu(), color="0.75", lw=0.8, label="noisy signal")
ax.plot(clean.cpu(), "k--", lw=1, label="clean")
ax.plot(causal.cpu(), lw=1.6, label=f"EMA, alpha = {alpha} (lags)")
ax.plot(anticausal.cpu(), lw=1.6, label="reverse EMA (leads)")
ax.plot(two_pass.cpu(), lw=1.6, label="forward then reverse (no lag)")
ax.set_xlabel("t")
ax.legend(loc="lower left", fontsize=8, ncol=2)
ax.set_title("Exponential moving averages computed by linear_scan_fwd_kernel")
save_figure(fig, "ema_noisy_signal.png")
plt.close(fig)

# %% [markdown]
# ![EMA of a noisy signal](../figures/ema_noisy_signal.png)
#
# ## What we have, and what comes next
#
# - The recurrence $h_t = a_t h_{t-1} + u_t$ is a scan with the pair operator
#   $(a_p, b_p) \bullet (a_q, b_q) = (a_p a_q,\ a_q b_p + b_q)$, associative because it is a product of
#   $2\times2$ matrices; a property test in plain PyTorch confirms it and rejects a plausible wrong one
#   that the interpreter's left-to-right fold would have accepted.
# - `scan_lib.ema` exports `first_order_op`, `scan_chunk`, `chunk_positions`, `linear_scan_fwd_kernel`
#   and the launcher `linear_scan_rows` with its launch parameters `FWD_CONFIG`: one program per row,
#   chunks in order, the state carried in a register and folded into each chunk's first pair in scan
#   order; initial state and reverse direction (by descending loads or by `reverse=True`) included.
# - Chapter 03 derives the gradients, finds that the backward pass is the same scan run the other way,
#   and wraps both into the differentiable `scan_lib.linear_scan`, with a GPU benchmark.
