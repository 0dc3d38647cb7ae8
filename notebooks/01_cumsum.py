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
# # 01 · Cumulative sums, one block then any length
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/scan-course/scans-the-hard-way/blob/main/notebooks/01_cumsum.ipynb)
#
# A cumulative sum (a *scan* with `+`) is the simplest recurrence there is, and every later chapter
# (moving averages, their gradients, Mamba's selective scan) is the same algorithm with a richer
# combine operator. In this chapter you will:
#
# 1. write the sequential definition and a float64 reference every kernel is checked against;
# 2. scan one block in a single Triton program with `tl.associative_scan`;
# 3. see the tree that makes a scan parallel (Blelloch's up-sweep and down-sweep) and why it only
#    works for an *associative* operator;
# 4. scan any length by splitting it into blocks: the three-phase blocked scan, and why it needs
#    three separate kernel launches;
# 5. cut the memory traffic from $4N$ words to $3N$ (reduce, then scan), then to the minimum $2N$
#    in a single launch (decoupled look-back), and learn why that needs atomics, a ticket counter
#    and care about memory ordering;
# 6. turn that into the exported `scan_lib.cumsum(x, dim=-1)` (any shape, any dim, four dtypes) and
#    benchmark it against `torch.cumsum` on a GPU, separating the GPU's time from the host's.

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
#| default_exp cumsum

# %%
import math

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

from scan_lib.runtime import INTERPRET, save_figure

# %% [markdown]
# ## The scan, sequentially
#
# Given $x_0, \dots, x_{N-1}$, the inclusive cumulative sum is
#
# $$y_i = \sum_{j=0}^{i} x_j, \qquad\text{or as a recurrence}\qquad h_{-1} = 0,\quad h_i = h_{i-1} + x_i,\quad y_i = h_i .$$
#
# The recurrence reads like a chain: $h_i$ needs $h_{i-1}$, which needs $h_{i-2}$, and so on, $N$
# dependent steps. The plain Python loop below is that chain, word for word. It is the definition
# we trust; the float64 `torch.cumsum` is the fast stand-in for it that all later checks use.

# %%
def cumsum_sequential(xs: list[float]) -> list[float]:
    """The definition: carry a running total h from left to right."""
    h, ys = 0.0, []
    for x in xs:
        h = h + x
        ys.append(h)
    return ys


def cumsum_reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """What every kernel is checked against: torch.cumsum in float64."""
    return torch.cumsum(x.double(), dim=dim)


torch.manual_seed(0)
x_seq = torch.randn(1000, dtype=torch.float64)
assert torch.allclose(torch.tensor(cumsum_sequential(x_seq.tolist()), dtype=torch.float64), cumsum_reference(x_seq), rtol=0, atol=1e-12)
print("sequential loop == float64 torch.cumsum (to 1e-12) on 1000 random values: ok")

# %% [markdown]
# How close must a float32 kernel come to the float64 reference? A sum of $i+1$ numbers computed in
# a precision with unit roundoff $u$ is off by at most about $c\,u\sum_{j\le i}|x_j|$, where $c$
# depends on the order of the additions (about $i$ for a left-to-right loop, about $\log_2 i$ for a
# tree). So we compare each output with a tolerance proportional to $\sum_{j\le i}|x_j|$: scaled by
# the size of what was summed, not by $y_i$ itself, which can be near zero by cancellation. For
# float16 and bfloat16 outputs the final rounding to the output dtype dominates.

# %%
SCAN_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def scan_error(y: torch.Tensor, x: torch.Tensor, dim: int = -1) -> float:
    """max_i |y_i - reference_i| / sum_{j<=i} |x_j|: the error relative to the size of what was summed."""
    scale = torch.cumsum(x.double().abs(), dim=dim).clamp_min(1e-30)
    return ((y.double() - cumsum_reference(x, dim)).abs() / scale).max().item() if x.numel() else 0.0


def assert_cumsum(y: torch.Tensor, x: torch.Tensor, dim: int = -1) -> float:
    assert y.shape == x.shape and y.dtype == x.dtype, (y.shape, y.dtype, x.shape, x.dtype)
    err = scan_error(y, x, dim)
    assert err <= SCAN_TOLERANCE[x.dtype], f"scaled error {err:.2e} above {SCAN_TOLERANCE[x.dtype]:.0e} for {x.dtype}"
    return err

# %% [markdown]
# ## One block: `tl.associative_scan`
#
# A Triton program loads a block of values into registers, and `tl.associative_scan(values, axis,
# combine_fn)` scans them in parallel. The combine function must itself be a `@triton.jit`
# function of two arguments. For a cumulative sum it is addition; it goes into `scan_lib` because
# the exported kernels use it too.

# %%
#| export
"""Cumulative sums along any dimension of a tensor, computed with Triton kernels (decoupled look-back or reduce-then-scan)."""
import torch
import triton
import triton.language as tl

from scan_lib.runtime import ON_GPU, check_float_tensor, check_same_device


@triton.jit
def add_combine(a, b):
    """The combine operator of a cumulative sum. It is associative, so a scan may group it in any tree."""
    return a + b

# %% [markdown]
# The simplest kernel: one program, one block of `BLOCK` lanes (a power of two, as every `tl.arange`
# must be), covering a sequence of any length `N <= BLOCK`. The mask switches off the lanes past the
# end: they read the neutral element `0.0` (which leaves every prefix unchanged) and are not stored.

# %%
@triton.jit
def cumsum_one_block_kernel(X, Y, N, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)                          # BLOCK
    mask = offsets < N                                     # BLOCK
    x = tl.load(X + offsets, mask=mask, other=0.0)         # BLOCK, lanes >= N hold 0
    y = tl.associative_scan(x.to(tl.float32), 0, add_combine)
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)


def cumsum_one_block(x: torch.Tensor) -> torch.Tensor:
    """Cumulative sum of a 1-D tensor short enough for one program."""
    y = torch.empty_like(x)
    cumsum_one_block_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return y


torch.manual_seed(1)
print(f"{'N':>5} {'BLOCK':>5} {'scaled err':>10}")
for n in (1, 7, 16, 129, 1000):
    x_one = torch.randn(n, device=DEVICE)
    print(f"{n:>5} {triton.next_power_of_2(n):>5} {assert_cumsum(cumsum_one_block(x_one), x_one):>10.1e}")

# %% [markdown]
# ## The tree behind it
#
# How can $N$ dependent additions run in parallel? Because $+$ is associative,
# $(a + b) + c = a + (b + c)$, the partial sums can be grouped in any tree we like. Blelloch's
# work-efficient scan uses a balanced binary tree over $N = 2^k$ elements, in two sweeps:
#
# * **up-sweep** (a reduction): at level $d = 1, 2, 4, \dots$ every element at index
#   $i \equiv 2d - 1 \pmod{2d}$ adds in the element $d$ to its left. After $\log_2 N$ levels the last
#   element holds the total, and the others hold the sums of their subtrees.
# * **down-sweep**: set the last element to $0$ (the neutral element), then at level
#   $d = N/2, \dots, 2, 1$ each such $i$ passes its value to its left child $i - d$ and takes
#   (its value + the left child's old value). At the end element $i$ holds
#   $\sum_{j<i} x_j$: the *exclusive* scan; adding $x_i$ gives the inclusive one.
#
# Each sweep does $N - 1$ additions, so the whole scan does $2(N-1)$: the same order of work as the
# sequential loop, but only $2\log_2 N$ dependent steps instead of $N$. Below, the sweeps in plain
# PyTorch, recording every step for the figure.

# %%
def blelloch_scan(x: torch.Tensor) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor, torch.Tensor]], int]:
    """Inclusive scan of a 1-D tensor of length 2^k by up-sweep and down-sweep.

    Returns the scan, the steps (kind, updated indices, array after the step) and the number of additions."""
    n = x.numel()
    assert n & (n - 1) == 0, "a power of two"
    a, steps, additions = x.clone(), [("input", torch.arange(0), x.clone())], 0
    d = 1
    while d < n:                                        # up-sweep
        i = torch.arange(2 * d - 1, n, 2 * d)
        a[i] = a[i - d] + a[i]
        additions += i.numel()
        steps.append((f"up d={d}", i, a.clone()))
        d *= 2
    a[n - 1] = 0
    steps.append(("clear last", torch.tensor([n - 1]), a.clone()))
    d = n // 2
    while d >= 1:                                       # down-sweep
        i = torch.arange(2 * d - 1, n, 2 * d)
        left = a[i - d].clone()
        a[i - d] = a[i]
        a[i] = a[i] + left
        additions += i.numel()
        steps.append((f"down d={d}", i, a.clone()))
        d //= 2
    return a + x, steps, additions


torch.manual_seed(2)
x_tree = torch.randint(0, 10, (8,)).double()
y_tree, tree_steps, tree_additions = blelloch_scan(x_tree)
assert torch.equal(y_tree, cumsum_reference(x_tree))
assert tree_additions == 2 * (8 - 1) and len(tree_steps) == 2 + 2 * int(math.log2(8))
for n in (2, 16, 1024):
    x_check = torch.randn(n, dtype=torch.float64)
    y_check, _, adds = blelloch_scan(x_check)
    assert torch.allclose(y_check, cumsum_reference(x_check), atol=1e-12) and adds == 2 * (n - 1)
print("Blelloch scan == reference for N = 2, 8, 16, 1024, with 2(N-1) additions each")

# %%
def draw_blelloch(steps, inclusive: torch.Tensor) -> plt.Figure:
    """One row per step; arrows run from the cells a step read (row above) to the cells it wrote."""
    n = inclusive.numel()
    rows = steps + [("+ input", torch.arange(n), inclusive)]
    fig, ax = plt.subplots(figsize=(0.9 * n + 2, 0.8 * len(rows)))
    arrow = dict(arrowstyle="->", lw=0.8, shrinkA=0, shrinkB=0)
    for row, (label, updated, values) in enumerate(rows):
        y = -row
        ax.text(-0.9, y, label, ha="right", va="center", fontsize=9)
        d = int(label.split("=")[1]) if "=" in label else 0
        moved = [col - d for col in updated.tolist()] if label.startswith("down") else []
        for col in range(n):
            color = "#f4c542" if col in updated.tolist() else "#f2a7a0" if col in moved else "#dde6f0"
            ax.add_patch(plt.Rectangle((col - 0.4, y - 0.3), 0.8, 0.6, facecolor=color, edgecolor="black", lw=0.5))
            ax.text(col, y, f"{values[col]:.0f}", ha="center", va="center", fontsize=9)
        for col in updated.tolist() if d else []:
            for src in (col - d, col):                                    # sum of the two cells above
                ax.annotate("", xy=(col, y + 0.3), xytext=(src, y + 0.7), arrowprops=dict(arrow, color="#333333"))
            if label.startswith("down"):                                  # right cell's old value moves left
                ax.annotate("", xy=(col - d, y + 0.3), xytext=(col, y + 0.7),
                            arrowprops=dict(arrow, color="#c0392b", linestyle="--"))
    ax.set_xlim(-3.2, n - 0.4)
    ax.set_ylim(-len(rows) + 0.5, 0.6)
    ax.axis("off")
    ax.set_title(f"Blelloch scan of {n} values: the up-sweep builds subtree sums, the down-sweep hands prefixes down\n"
                 "yellow: sum of the two cells above; red: copy of the right cell above (dashed)", fontsize=9)
    return fig


fig = draw_blelloch(tree_steps, y_tree)
save_figure(fig, "blelloch_tree.png")
plt.close(fig)
print("input:", x_tree.tolist(), " inclusive scan:", y_tree.tolist())

# %% [markdown]
# ![Blelloch up-sweep and down-sweep on 8 values](../figures/blelloch_tree.png)
#
# The row before last is the exclusive scan; adding the input gives the inclusive one.
# `tl.associative_scan` does not promise this particular tree: on a GPU each thread first scans the
# few elements it holds, then warps combine partial results with shuffles, then warps combine
# through shared memory. Any grouping gives the same answer *only because the operator is
# associative*, so that is the one property every combine function in this course must have.
#
# Floating-point addition is associative only up to rounding, which is why the checks above use a
# tolerance rather than `torch.equal`:

# %%
a32, b32, c32 = torch.tensor(1e8, dtype=torch.float32), torch.tensor(-1e8, dtype=torch.float32), torch.tensor(1.0, dtype=torch.float32)
assert (a32 + b32) + c32 == 1.0 and a32 + (b32 + c32) == 0.0
print("float32: (1e8 + -1e8) + 1 =", ((a32 + b32) + c32).item(), " but 1e8 + (-1e8 + 1) =", (a32 + (b32 + c32)).item())

# %% [markdown]
# Under Triton's CPU interpreter there is a trap (chapter 00 shows it): `tl.associative_scan` simply
# folds left to right, so a non-associative combine function gives the "right" sequential answer on
# the CPU and a different one on the GPU. Associativity has to be tested on its own, in plain
# PyTorch; `tests/test_cumsum.py` does that for `add_combine`'s operator.
#
# ## Longer than one block: the three-phase scan
#
# One program holds at most a few thousand values in registers, and one program runs on one
# streaming multiprocessor, so a long sequence is split into blocks of `BLOCK` values, one program
# each. Write $b$ for a block and $T_b$ for its total. The output at position $i$ of block $b$ is
#
# $$y_i = \underbrace{\sum_{b' < b} T_{b'}}_{\text{carry } C_b} + \underbrace{\sum_{j \in b,\ j \le i} x_j}_{\text{scan inside block } b},$$
#
# and the carries $C_b$ are themselves an (exclusive) cumulative sum, of the block totals. Hence
# three phases:
#
# 1. every program scans its block, writes it to $y$, and writes its total $T_b$;
# 2. scan the totals: $S_b = \sum_{b' \le b} T_{b'}$ (a shorter sequence, so we can reuse the same
#    function recursively, until it fits in one block); then $C_b = S_{b-1}$ and $C_0 = 0$;
# 3. every program adds its carry $C_b$ to its block of $y$.

# %%
@triton.jit
def scan_blocks_kernel(X, Y, T, N, BLOCK: tl.constexpr):
    """Phase 1: scan block b of X into Y, write its total to T[b].  X, Y: N; T: cdiv(N, BLOCK)."""
    b = tl.program_id(0)
    offsets = b * BLOCK + tl.arange(0, BLOCK)             # BLOCK
    mask = offsets < N
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offsets, tl.associative_scan(x, 0, add_combine), mask=mask)
    tl.store(T + b, tl.sum(x, axis=0))


@triton.jit
def add_carry_kernel(Y, S, N, BLOCK: tl.constexpr):
    """Phase 3: add C_b = S[b-1] (0 for the first block) to block b of Y.  Y: N; S: cdiv(N, BLOCK)."""
    b = tl.program_id(0)
    offsets = b * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    carry = tl.load(S + b - 1, mask=b > 0, other=0.0)       # scalar
    tl.store(Y + offsets, tl.load(Y + offsets, mask=mask) + carry, mask=mask)


def cumsum_three_phase(x: torch.Tensor, block: int) -> torch.Tensor:
    """Cumulative sum of a 1-D float32 tensor of any length, in blocks of `block` (a power of two)."""
    n = x.numel()
    num_blocks = triton.cdiv(n, block)
    y = torch.empty_like(x)
    totals = torch.empty(num_blocks, dtype=torch.float32, device=x.device)
    scan_blocks_kernel[(num_blocks,)](x, y, totals, n, BLOCK=block)                 # launch 1
    if num_blocks > 1:
        inclusive_totals = cumsum_three_phase(totals, block)                        # launch(es) 2
        add_carry_kernel[(num_blocks,)](y, inclusive_totals, n, BLOCK=block)        # launch 3
    return y

# %% [markdown]
# Now the checks the source notebook could not make (it required the length to be a multiple of the
# block): awkward lengths, and blocks small enough that the totals need a second and third level of
# recursion (with `BLOCK = 16`, 4097 values give 257 totals, then 17, then 2).

# %%
torch.manual_seed(3)
blocks = (16, 64, 1024) if not ON_GPU else (64, 1024, 4096)
print(f"{'N':>5} " + " ".join(f"{'BLOCK=' + str(b):>11}" for b in blocks))
for n in (1, 7, 129, 1000, 4097):
    x_blocked = torch.randn(n, device=DEVICE)
    errors = [assert_cumsum(cumsum_three_phase(x_blocked, b), x_blocked) for b in blocks]
    print(f"{n:>5} " + " ".join(f"{e:>11.1e}" for e in errors))

# %% [markdown]
# ### Why three launches?
#
# Program $b$ can only finish once programs $0, \dots, b-1$ have written their totals. Inside one
# launch there is no barrier across programs: a GPU runs as many programs as fit on its
# multiprocessors, in an order it chooses, and starts the rest only when earlier ones *finish*. A
# program that spins waiting for a total that a not-yet-started program will write can wait forever.
# The end of a launch *is* a grid-wide barrier, so the simple safe design puts each dependency
# across a launch boundary. (A single launch can be made safe, with an atomic ticket counter and a
# careful publishing protocol: that is the decoupled look-back scan at the end of this chapter.)
#
# Here is the tempting wrong version: one launch, where program $b$ reads the running total that
# program $b-1$ wrote, without waiting. The running totals start as NaN, so a read that comes too
# early shows up.

# %%
@triton.jit
def one_launch_chained_kernel(X, Y, RUNNING, N, BLOCK: tl.constexpr):
    """WRONG on a GPU: reads RUNNING[b-1] whether or not program b-1 has written it yet."""
    b = tl.program_id(0)
    offsets = b * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    carry = tl.load(RUNNING + b - 1, mask=b > 0, other=0.0)
    tl.store(Y + offsets, tl.associative_scan(x, 0, add_combine) + carry, mask=mask)
    tl.store(RUNNING + b, carry + tl.sum(x, axis=0))


torch.manual_seed(4)
n_chain, block_chain = (2**24, 1024) if ON_GPU else (4096, 64)
x_chain = torch.randn(n_chain, device=DEVICE)
y_chain = torch.empty_like(x_chain)
running = torch.full((triton.cdiv(n_chain, block_chain),), float("nan"), device=DEVICE)
one_launch_chained_kernel[(running.numel(),)](x_chain, y_chain, running, n_chain, BLOCK=block_chain)
y_blocks = y_chain.view(-1, block_chain).double()                        # blocks x BLOCK
reference_blocks = cumsum_reference(x_chain).view(-1, block_chain)
wrong_blocks = (~torch.isclose(y_blocks, reference_blocks, rtol=1e-4, atol=1e-2)).any(dim=1).sum().item()
print(f"{'interpreter' if INTERPRET else 'GPU'}: {wrong_blocks} of {running.numel()} blocks wrong")
if INTERPRET:
    assert wrong_blocks == 0, "the interpreter runs programs 0, 1, 2, ... one after another, so this passes"

# %% [markdown]
# Under the interpreter it passes, because the interpreter runs program 0 to completion, then
# program 1, and so on. On a GPU many programs run at once and most read a NaN or a stale total.
# Such a bug is invisible to CPU tests; only a run on a real GPU exposes it.
#
# ## Reduce, then scan: $3N$ words instead of $4N$
#
# A cumulative sum does one addition per element and moves at least two words per element (read $x$,
# write $y$): it is bound by memory bandwidth, so the number of words that cross the memory bus is
# the cost. The three-phase scan above moves $4N$: phase 1 reads $x$ and writes $y$, phase 3 reads
# $y$ again and writes it again. (The source notebook's version, which scanned every block twice,
# moved $5N$.) Reordering the same work removes one pass over $y$:
#
# | pass | reduce-then-scan | words |
# | --- | --- | --- |
# | 1 | read block $b$ of $x$, write only its total $T_b$ | $N$ + $N/\text{BLOCK}$ |
# | 2 | scan the totals in place, $S_b = \sum_{b' \le b} T_{b'}$ | $2N/\text{BLOCK}$ |
# | 3 | read block $b$ of $x$ again, scan it, add the carry $S_{b-1}$, write $y$ | $2N$ |
#
# So $3N$ words, 1.5 times the floor of a copy, in three launches whatever the length. Pass 2 is
# tiny: one program per row walks that row's totals in chunks, carrying the running sum from one
# chunk to the next, so the totals are never scanned recursively. (The first GPU run of this
# chapter used the recursion of `cumsum_three_phase` here: up to five launches for $2^{25}$ values.
# Each launch of a Triton kernel from Python costs the host tens of microseconds: in the H200 run of
# 2026-11-29, one launch of `scan_blocks_kernel` on 1024 values took 23.8 us, against 7.0 us for
# `torch.cumsum`; the benchmark below shows that this overhead, not the GPU, is what a user waits
# for at small and medium sizes.)
#
# The exported kernels also handle batches: the input is viewed as $R$ rows of length $N$ (the
# scanned dimension moved last and made contiguous), the program id numbers (row, block) pairs, and
# offsets into the rows are 64-bit so that $R \cdot N$ may exceed $2^{31}$. Pass 3 can walk the
# blocks from the *end* of the tensor (`REVERSE`): pass 1 finished there, so part of the tail of
# $x$ may still be in the GPU's L2 cache (50 MB on an H200) when pass 3 starts. Any order is
# correct, since pass 3's programs are independent; `benchmarks/bench_cumsum.py` measures both. On
# the H200 (2026-11-29, $2^{25}$ values) the two orders took 108.0 and 110.3 us: a difference within
# the noise, so the cache effect is too small to see; `REVERSE` stays on because it costs nothing.
#
# Rows short enough for one block need only pass 3 (no carries), in one launch; then each program
# takes a tile of several short rows, so that a batch of many short rows does not become millions
# of tiny programs.

# %%
#| export
@triton.jit
def to_accumulator(x, FP64: tl.constexpr):
    """Widen a loaded block to the accumulation dtype: float64 for float64 inputs, float32 otherwise."""
    return x.to(tl.float64 if FP64 else tl.float32)


@triton.jit
def block_totals_kernel(X, T, N, NUM_BLOCKS, BLOCK: tl.constexpr, FP64: tl.constexpr):
    """Pass 1 (reduce): T[r, b] = sum of block b of row r.  X: R x N; T: R x NUM_BLOCKS, program r * NUM_BLOCKS + b."""
    pid = tl.program_id(0)
    row = pid // NUM_BLOCKS
    cols = (pid % NUM_BLOCKS) * BLOCK + tl.arange(0, BLOCK)                      # BLOCK
    x = tl.load(X + row.to(tl.int64) * N + cols, mask=cols < N, other=0.0)      # BLOCK
    tl.store(T + pid, tl.sum(to_accumulator(x, FP64), axis=0))


@triton.jit
def scan_totals_kernel(T, NUM_BLOCKS, CHUNK: tl.constexpr):
    """Pass 2: replace row r of T (R x NUM_BLOCKS) by its inclusive scan, CHUNK totals at a time.
    One program per row; `carry` is the sum of the chunks already done."""
    ROW = T + tl.program_id(0).to(tl.int64) * NUM_BLOCKS
    carry = tl.zeros((), T.dtype.element_ty)
    for start in range(0, NUM_BLOCKS, CHUNK):
        cols = start + tl.arange(0, CHUNK)                                      # CHUNK
        totals = tl.load(ROW + cols, mask=cols < NUM_BLOCKS, other=0.0)
        tl.store(ROW + cols, carry + tl.associative_scan(totals, 0, add_combine), mask=cols < NUM_BLOCKS)
        carry += tl.sum(totals, axis=0)


@triton.jit
def scan_tiles_kernel(X, S, Y, R, N, NUM_BLOCKS,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr, FP64: tl.constexpr, REVERSE: tl.constexpr):
    """Pass 3 (scan): scan a ROWS x BLOCK tile of X along its rows, add each row's carry S[r, b-1]
    (S: R x NUM_BLOCKS, the inclusive scan of the block totals; not read when NUM_BLOCKS == 1),
    and write the tile to Y in Y's dtype.  X, Y: R x N.  REVERSE: last tile first."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0) if REVERSE else tl.program_id(0)
    b = pid % NUM_BLOCKS
    rows = (pid // NUM_BLOCKS) * ROWS + tl.arange(0, ROWS)[:, None]             # ROWS x 1
    cols = b * BLOCK + tl.arange(0, BLOCK)[None, :]                             # 1 x BLOCK
    mask = (rows < R) & (cols < N)                                              # ROWS x BLOCK
    offsets = rows.to(tl.int64) * N + cols                                      # ROWS x BLOCK
    x = tl.load(X + offsets, mask=mask, other=0.0)
    # b > 0 is spelled out as a ROWS x 1 tile: Triton 3.9's interpreter rejects a mask that broadcasts a scalar.
    has_carry = tl.zeros_like(rows) + b > 0                                     # ROWS x 1
    carry = tl.load(S + rows * NUM_BLOCKS + b - 1, mask=(rows < R) & has_carry, other=0.0)   # ROWS x 1
    y = tl.associative_scan(to_accumulator(x, FP64), 1, add_combine) + carry
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)

# %% [markdown]
# ## One pass: decoupled look-back, $2N$ words
#
# Reduce-then-scan still reads $x$ twice. To read it once, the program that holds block $b$ in
# registers must learn its carry $C_b = \sum_{b'<b} T_{b'}$ *during the same launch*, from the
# programs that hold the earlier blocks. The chained kernel above showed the two dangers: waiting
# for a program that has not started can deadlock, and reading a value that has not been written
# yet gives garbage. Merrill and Garland's *decoupled look-back* (2016, the algorithm behind CUB's
# and `torch.cumsum`'s device scans) removes both.
#
# **A ticket instead of the program id.** The first thing every program does is
# `tile = atomic_add(counter, 1)`: tiles are numbered in the order in which programs *start*, not
# in the order of their ids (which CUDA does not promise to follow). So when tile $t$ waits for
# tile $t-1$, that tile belongs to a program that is already running on some multiprocessor, and,
# as we will see, it publishes its first result without waiting for anyone. A wait can be long, but
# never forever: no deadlock, whatever order the hardware picks.
#
# **Publish early, in a state word per tile.** Each tile $t$ owns a state word that moves only
# forward: EMPTY $\to$ (AGGREGATE, $T_t$) $\to$ (PREFIX, $S_t$), where $T_t$ is the total of its own
# block and $S_t = \sum_{t' \le t} T_{t'}$ its inclusive prefix. A tile publishes its aggregate as
# soon as it has loaded its block, before it looks at anyone else (tile 0, which has no
# predecessors, publishes its prefix straight away).
#
# **Look back.** Tile $t$ then walks backwards, $t-1, t-2, \dots$, adding up aggregates until it
# meets a prefix $S_j$:
#
# $$C_t = S_j + \sum_{j < k < t} T_k,$$
#
# spinning on a predecessor whose word is still EMPTY. It publishes (PREFIX, $C_t + T_t$), adds
# $C_t$ to its scanned block and writes $y$: $x$ is read once and $y$ written once, $2N$ words plus
# two 64-bit words per tile. *Decoupled* means a tile need not wait for its predecessor's prefix
# (which would chain all tiles into one serial line); aggregates appear as soon as blocks are
# loaded, and prefixes of older tiles are usually found a few steps back. Our look-back inspects
# `WINDOW` predecessors at once, with one vector load: it finds the newest PREFIX in the window, and
# uses the window only if every word newer than that is already non-empty (otherwise it loads the
# same window again). Tiles past the start of the tile's row read as (PREFIX, 0), so a look-back
# stops at its row's start by itself.
#
# **Memory ordering: why this is correct on a GPU.** A GPU's memory model is weak: two stores by one
# program may become visible to another multiprocessor in the opposite order, and an ordinary load
# in a loop may be served from the multiprocessor's own (non-coherent) L1 cache, or hoisted out of
# the loop by the compiler, and never see the new value. Had we kept the flag and the value in two
# separate words, a reader could see the flag AGGREGATE together with the *old* value 0 of the other
# word. The textbook fix is a *release* store of the flag after the value and an *acquire* load of
# the flag before the value. We sidestep it: the flag (high 32 bits) and the float32 bits of the
# value (low 32 bits) share **one int64 word**, written by one 64-bit atomic exchange and read by
# 64-bit loads. A naturally aligned 64-bit access is indivisible, so a reader sees the old word or
# the new one, never half of each; and every value a word ever holds is final for its flag. Since
# the programs share nothing else (each writes only its own part of $y$), no ordering between
# *different* addresses is needed, and the atomics can be `sem="relaxed"`. The look-back reads with
# `tl.load(..., volatile=True)`, which becomes PTX `ld.volatile` (a relaxed load in PTX's memory
# model): it is issued again on every trip round the loop and reads the coherent copy in L2, where
# the atomics are performed. The counter and the state words are zeroed by one `torch.zeros` before
# the launch, and the launch boundary orders that memset before every program.
#
# Two consequences. Float64 sums do not fit next to a flag in 64 bits, so float64 inputs take the
# reduce-then-scan path. And the CPU interpreter cannot test any of this: it runs the programs one
# after another in ticket order, so every look-back finds a PREFIX at $t-1$ on the first try, and
# the ordering never matters. The CPU tests check the arithmetic, the indexing and (below) the
# look-back on hand-made snapshots of the state words; only many GPU runs with fresh data can catch
# a race (`benchmarks/bench_cumsum.py` does that).

# %%
#| export
AGGREGATE = tl.constexpr(1)      # state word flags (high 32 bits); 0 means EMPTY
PREFIX = tl.constexpr(2)


@triton.jit
def pack_state(flag, value):
    """One int64 state word: the flag in the high 32 bits, the float32 bits of value in the low 32."""
    return (flag.to(tl.int64) << 32) | value.to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def state_value(word):
    """The float32 value stored in the low 32 bits of a state word."""
    return (word & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def look_back(STATE, tile, first, WINDOW: tl.constexpr):
    """The exclusive prefix of `tile`: the sum of the blocks of tiles first .. tile-1 (its row's
    earlier tiles), read from their state words WINDOW at a time, newest first.  STATE: one int64 word
    per tile; words of tiles before `first` are treated as (PREFIX, 0)."""
    lanes = tl.arange(0, WINDOW)                                                # WINDOW
    newest = tile - 1                                                           # newest tile not yet added
    exclusive = tl.zeros((), tl.float32)
    while newest >= first:
        tiles = newest - lanes                                                  # WINDOW, newest first
        word = tl.load(STATE + tiles, mask=tiles >= first, other=PREFIX << 32, volatile=True)
        flag = word >> 32
        stop = tl.min(tl.where(flag == PREFIX, lanes, WINDOW))                 # newest PREFIX, WINDOW if none
        ready = tl.sum(((lanes < stop) & (flag == 0)).to(tl.int32)) == 0        # none newer than it EMPTY
        window_sum = tl.sum(tl.where(lanes <= stop, state_value(word), 0.0))
        exclusive = tl.where(ready, exclusive + window_sum, exclusive)
        newest = tl.where(ready, tl.where(stop < WINDOW, first - 1, newest - WINDOW), newest)
    return exclusive


@triton.jit
def lookback_scan_kernel(X, Y, STATE, N, NUM_BLOCKS, BLOCK: tl.constexpr, WINDOW: tl.constexpr):
    """Single-pass scan of the rows of X into Y.  X, Y: R x N, blocks of BLOCK values, NUM_BLOCKS per row;
    STATE: 1 + R * NUM_BLOCKS zeros (int64): STATE[0] hands out tickets, STATE[1 + t] is tile t's word."""
    tile = tl.atomic_add(STATE, 1, sem="relaxed")                               # tickets in start order
    b = tile % NUM_BLOCKS
    cols = b * BLOCK + tl.arange(0, BLOCK)                                      # BLOCK
    offsets = (tile // NUM_BLOCKS) * N + cols                                   # BLOCK, int64
    x = tl.load(X + offsets, mask=cols < N, other=0.0).to(tl.float32)
    aggregate = tl.sum(x, axis=0)
    tl.atomic_xchg(STATE + 1 + tile, pack_state(tl.where(b == 0, PREFIX, AGGREGATE), aggregate), sem="relaxed")
    y = tl.associative_scan(x, 0, add_combine)                                  # BLOCK, while others publish
    exclusive = look_back(STATE + 1, tile, tile - b, WINDOW)
    tl.atomic_xchg(STATE + 1 + tile, pack_state(tl.full((), PREFIX, tl.int32), exclusive + aggregate),
                   mask=b > 0, sem="relaxed")
    tl.store(Y + offsets, (y + exclusive).to(Y.dtype.element_ty), mask=cols < N)

# %% [markdown]
# The interpreter cannot show a look-back that has to walk, but we can hand `look_back` a snapshot
# of state words as a GPU might leave them mid-flight: tile 37 of a row whose only PREFIX so far is
# tile 5, with aggregates in between (so a window of 4 must walk eight windows back), and a second
# row that starts at tile 20 and has no PREFIX yet at all (so the row start must stop the walk).
# The words are built in PyTorch with the same bit layout as `pack_state`.

# %%
def pack_words(flags: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """State words as pack_state writes them: flag << 32 | float32 bits of value."""
    bits = values.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return flags.to(torch.int64) << 32 | bits


@triton.jit
def look_back_probe_kernel(STATE, OUT, TILE, FIRST, WINDOW: tl.constexpr):
    tl.store(OUT, look_back(STATE, TILE, FIRST, WINDOW))


def probe_look_back(words: torch.Tensor, tile: int, first: int, window: int) -> float:
    out = torch.empty(1, device=DEVICE)
    look_back_probe_kernel[(1,)](words.to(DEVICE), out, tile, first, WINDOW=window)
    return out.item()


torch.manual_seed(8)
block_totals = torch.randint(-9, 10, (40,)).float()                     # exact in float32
flags = torch.full((40,), 1)                                             # AGGREGATE everywhere ...
flags[5] = 2                                                             # ... but tile 5 is a PREFIX
values = block_totals.clone()
values[5] = block_totals[:6].sum()                                       # S_5
words = pack_words(flags, values)
for window in (1, 4, 32):
    assert probe_look_back(words, 37, 0, window) == block_totals[:37].sum().item()
    assert probe_look_back(words, 37, 20, window) == block_totals[20:37].sum().item()
    assert probe_look_back(words, 20, 20, window) == 0.0                # first tile of its row
assert torch.equal(pack_words(torch.tensor([2]), torch.tensor([-1.5])), torch.tensor([(2 << 32) | 0xBFC00000]))
print("look_back on snapshots: the walk over aggregates, the stop at a PREFIX and at the row start: ok")

# %% [markdown]
# ## The launcher
#
# `scan_rows` picks the path: rows of at most `block` values take one launch of `scan_tiles_kernel`;
# longer rows take the look-back (one launch, after a memset) or reduce-then-scan (three launches).
# The choices live in the module-level dict `CONFIG`, read on every call, so a benchmark can switch
# algorithm, block size, warps and window without touching the code; keyword arguments override it
# for one call (tests use tiny blocks to send short inputs through many blocks). Block sizes and
# windows become `tl.arange` lengths, so they must be powers of two.

# %%
#| export
ALGORITHMS = ("lookback", "reduce_then_scan")
# GPU defaults: the fastest correct configuration of benchmarks/bench_cumsum.py on an H200 (2026-11-29).
CONFIG = {
    "algorithm": "lookback",                # rows longer than one block; float64 always reduce_then_scan
    "block": 4096 if ON_GPU else 1024,      # values per program on those rows (the interpreter prefers few programs)
    "num_warps": 4,                         # warps per program on those rows
    "window": 16,                           # predecessors one look-back step inspects
    "reverse": True,                        # reduce_then_scan: pass 3 starts with the last block
}


def is_power_of_two(value) -> bool:
    return isinstance(value, int) and value > 0 and value & (value - 1) == 0


def resolve_config(overrides: dict) -> dict:
    """CONFIG with `overrides` applied, checked; raise TypeError/ValueError naming the bad key."""
    unknown = set(overrides) - set(CONFIG)
    if unknown:
        raise TypeError(f"unknown scan option(s) {sorted(unknown)}; options are {sorted(CONFIG)}")
    config = {**CONFIG, **overrides}
    if config["algorithm"] not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {config['algorithm']!r}")
    if not is_power_of_two(config["block"]) or config["block"] < 16:
        raise ValueError(f"block must be a power of two >= 16, got {config['block']}")
    if not is_power_of_two(config["window"]):
        raise ValueError(f"window must be a power of two, got {config['window']}")
    return config


def warps_for(elements: int) -> int:
    """Warps for a program handling `elements` values: about 16 per thread, between 1 and 8 warps."""
    return max(1, min(8, elements // 512))


def scan_short_rows(x: torch.Tensor, y: torch.Tensor, max_block: int) -> torch.Tensor:
    """One launch for R x N with N <= max_block: each program scans ROWS whole rows."""
    num_rows, n = x.shape
    block = max(16, triton.next_power_of_2(n))
    rows = min(max_block // block, triton.next_power_of_2(num_rows))
    scan_tiles_kernel[(triton.cdiv(num_rows, rows),)](
        x, y, y, num_rows, n, 1, ROWS=rows, BLOCK=block, FP64=x.dtype == torch.float64, REVERSE=False,
        num_warps=warps_for(rows * block))
    return y


def scan_reduce_then_scan(x: torch.Tensor, y: torch.Tensor, config: dict) -> torch.Tensor:
    """Three launches: block totals, their scan (one program per row), the scan of x plus carries."""
    num_rows, n = x.shape
    fp64, block, warps = x.dtype == torch.float64, config["block"], config["num_warps"]
    num_blocks = triton.cdiv(n, block)
    totals = torch.empty(num_rows, num_blocks, dtype=torch.float64 if fp64 else torch.float32, device=x.device)
    grid = (num_rows * num_blocks,)
    block_totals_kernel[grid](x, totals, n, num_blocks, BLOCK=block, FP64=fp64, num_warps=warps)
    chunk = min(block, triton.next_power_of_2(num_blocks))
    scan_totals_kernel[(num_rows,)](totals, num_blocks, CHUNK=chunk, num_warps=warps_for(chunk))
    scan_tiles_kernel[grid](x, totals, y, num_rows, n, num_blocks,
                            ROWS=1, BLOCK=block, FP64=fp64, REVERSE=config["reverse"], num_warps=warps)
    return y


def scan_lookback(x: torch.Tensor, y: torch.Tensor, config: dict) -> torch.Tensor:
    """One launch (after a memset): the decoupled look-back scan, float32 accumulation."""
    num_rows, n = x.shape
    num_blocks = triton.cdiv(n, config["block"])
    state = torch.zeros(1 + num_rows * num_blocks, dtype=torch.int64, device=x.device)   # ticket, words
    lookback_scan_kernel[(num_rows * num_blocks,)](x, y, state, n, num_blocks, BLOCK=config["block"],
                                                   WINDOW=config["window"], num_warps=config["num_warps"])
    return y


def scan_rows(x: torch.Tensor, **overrides) -> torch.Tensor:
    """Inclusive cumulative sum of each row of a contiguous R x N tensor, returned in x's dtype.

    Accumulates in float32 (float64 for float64 input). The path and its parameters come from CONFIG,
    with `overrides` (algorithm, block, num_warps, window, reverse) applied for this call."""
    config = resolve_config(overrides)
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    if x.shape[1] <= config["block"]:
        return scan_short_rows(x, y, config["block"])
    if config["algorithm"] == "lookback" and x.dtype != torch.float64:
        return scan_lookback(x, y, config)
    return scan_reduce_then_scan(x, y, config)

# %% [markdown]
# The public function: validate, move `dim` last, view as rows, scan, move it back (for a
# contiguous tensor scanned along its last dimension all of this is a free view). The gradient of
# a cumulative sum is the *reverse* cumulative sum of the incoming gradient,
# $\partial L/\partial x_j = \sum_{i \ge j} \partial L / \partial y_i$, so autograd support is a flip, the
# same scan, and a flip back. Written with the public `cumsum`, that backward is itself differentiable,
# so second derivatives (a gradient penalty, a Hessian-vector product) come out right too.

# %%
#| export
def check_dim(dim, ndim: int) -> int:
    """Return dim as a non-negative index, or raise TypeError/ValueError naming `dim`."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim must be in [{-ndim}, {ndim - 1}] for a {ndim}-dim x, got {dim}")
    return dim % ndim


class CumsumFunction(torch.autograd.Function):
    """Autograd for scan_rows on a contiguous R x N tensor. The Function's input and output are whole
    tensors, not views, so that users may modify the output in place; its backward calls the public
    cumsum, so that it is differentiable again (the gradient of a scan is a scan)."""

    @staticmethod
    def forward(ctx, rows):
        return scan_rows(rows)                                            # R x N

    @staticmethod
    def backward(ctx, grad_y):
        return cumsum(grad_y.flip(-1)).flip(-1)                           # R x N


def cumsum_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The scan without checks: dim moved last, rows made contiguous, scanned (through CumsumFunction
    when autograd records), moved back."""
    moved = x.movedim(dim, -1).contiguous()                               # ... x N
    rows = moved.view(-1, moved.shape[-1])                                # R x N
    y = CumsumFunction.apply(rows) if torch.is_grad_enabled() and x.requires_grad else scan_rows(rows)
    return y.view(moved.shape).movedim(-1, dim)


def cumsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inclusive cumulative sum of `x` along `dim`, like torch.cumsum, computed by Triton kernels.

    x: a float16, bfloat16, float32 or float64 tensor with at least one dimension, on the GPU
    (or on the CPU under Triton's interpreter). Sums are accumulated in float32 (float64 for
    float64 input) and returned in x's dtype and shape (as a view when dim is not the last
    dimension). Differentiable, twice or more. Empty tensors give an empty result. The algorithm
    for long rows is chosen by the module-level CONFIG (see scan_rows)."""
    check_float_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension to scan along, got a 0-dim tensor")
    dim = check_dim(dim, x.dim())
    check_same_device(x=x)
    if x.numel() == 0:
        return x.clone()
    return cumsum_along(x, dim)

# %% [markdown]
# ## Checking the exported `cumsum`
#
# Both algorithms, at the awkward lengths and with blocks small enough that 4097 values make up to
# 257 blocks (so pass 2 walks its totals in many chunks, and the look-back runs through 257 tiles),
# then batches of rows (the look-back's tiles of one row must not look into the previous row), then
# every dtype through the public function.

# %%
torch.manual_seed(5)
block_sizes = (16, 128, 1024) if not ON_GPU else (256, 1024, 4096)
print(f"{'algorithm':>16} {'N':>5} " + " ".join(f"{'block=' + str(b):>10}" for b in block_sizes))
for algorithm in ALGORITHMS:
    for n in (1, 7, 129, 1000, 4097):
        x_rows = torch.randn(1, n, device=DEVICE)
        errors = [assert_cumsum(scan_rows(x_rows, algorithm=algorithm, block=b), x_rows) for b in block_sizes]
        print(f"{algorithm:>16} {n:>5} " + " ".join(f"{e:>10.1e}" for e in errors))
    x_batch = torch.randn(3, 1000, device=DEVICE) + torch.arange(3, device=DEVICE)[:, None] * 100
    for window in (1, 4, 32):
        assert_cumsum(scan_rows(x_batch, algorithm=algorithm, block=16, window=window), x_batch)
print("3 rows x 1000 values in blocks of 16, windows 1, 4, 32: ok")

# %%
torch.manual_seed(6)
print(f"{'dtype':>15} {'shape':>16} {'dim':>3} {'scaled err':>10}")
for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
    for shape, dim in (((3, 1000), -1), ((5, 37, 2), 1), ((129, 3), 0), ((2, 3, 4097), 2)):
        x_any = torch.randn(shape, device=DEVICE, dtype=dtype)
        err = assert_cumsum(scan_lib.cumsum(x_any, dim=dim), x_any, dim)
        print(f"{str(dtype):>15} {str(shape):>16} {dim:>3} {err:>10.1e}")

# %% [markdown]
# Edge cases: non-contiguous views, empty tensors and length-1 dimensions behave like
# `torch.cumsum`; the gradient matches `torch.cumsum`'s; bad input raises an exception naming
# the argument.

# %%
torch.manual_seed(7)
x_t = torch.randn(40, 30, device=DEVICE).t()                    # 30 x 40, not contiguous
assert not x_t.is_contiguous()
assert_cumsum(scan_lib.cumsum(x_t, dim=1), x_t, 1)
assert scan_lib.cumsum(torch.empty(3, 0, device=DEVICE)).shape == (3, 0)
x_single = torch.randn(4, 1, 5, device=DEVICE)
assert torch.equal(scan_lib.cumsum(x_single, dim=1), x_single)

x_grad = torch.randn(3, 50, device=DEVICE, requires_grad=True)
weights = torch.randn(3, 50, device=DEVICE)
(grad_ours,) = torch.autograd.grad((scan_lib.cumsum(x_grad) * weights).sum(), x_grad)
(grad_torch,) = torch.autograd.grad((torch.cumsum(x_grad, -1) * weights).sum(), x_grad)
assert torch.allclose(grad_ours, grad_torch, atol=1e-4), (grad_ours - grad_torch).abs().max()

bad_inputs = [
    (lambda: scan_lib.cumsum([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
    (lambda: scan_lib.cumsum(torch.arange(5, device=DEVICE)), TypeError, "x must be float16"),
    (lambda: scan_lib.cumsum(torch.tensor(1.0, device=DEVICE)), ValueError, "at least one dimension"),
    (lambda: scan_lib.cumsum(torch.ones(2, 3, device=DEVICE), dim=2), ValueError, "dim must be in"),
    (lambda: scan_lib.cumsum(torch.ones(2, 3, device=DEVICE), dim=1.0), TypeError, "dim must be an int"),
    (lambda: scan_rows(torch.ones(2, 3, device=DEVICE), block=24), ValueError, "block must be a power of two"),
    (lambda: scan_rows(torch.ones(2, 3, device=DEVICE), algorithm="chained"), ValueError, "algorithm must be"),
]
for call, error, words in bad_inputs:
    try:
        call()
    except error as e:
        assert words in str(e), str(e)
        print(f"{error.__name__}: {e}")
    else:
        raise AssertionError(f"expected {error.__name__} ({words})")

# %% [markdown]
# ## Benchmark (GPU only)
#
# `torch.cumsum` against the look-back scan, reduce-then-scan and the $4N$ three-phase scan above, on
# 1-D float32 inputs from $2^{10}$ to $2^{27}$ elements. Each time is the median of
# `triton.testing.do_bench`, which flushes the L2 cache before every call and times the call with
# CUDA events: that is what a user waits for, *including* the host's time to launch the kernels
# whenever the GPU runs out of queued work. To see which of the two dominates, the table adds, for
# `scan_lib.cumsum`, the GPU time alone (`do_bench_cudagraph`: a CUDA graph replays the launches
# with no Python in between) and the host time per call (a loop of calls without synchronising,
# timed on the CPU). The memory floor is the $2N$ words a cumulative sum must move, divided by the
# copy bandwidth measured in the same cell (a 1 GiB `copy_`).
#
# What to expect: below about $2^{20}$ values the GPU needs only a few microseconds, and every
# variant's time is host time, a few microseconds for `torch.cumsum`'s C++ launch and several times
# that for each launch of a Triton kernel from Python; fewer launches (one for a single block, two
# for the look-back counting its memset, three for reduce-then-scan) is the only cure there. The
# host and the GPU overlap only partly (the L2 flush gives the host a head start on each call), so
# host-bound medians jitter from run to run. Only from about $2^{25}$ values (128 MiB) on does the
# median match the GPU-only time, and then bandwidth dominates: $2N$ words for the look-back against
# $3N$ for reduce-then-scan and $4N$ for the three-phase scan.
# `benchmarks/bench_cumsum.py` checks both algorithms many times on fresh data, sweeps their block
# size, warps and window, and prints the same split; `CONFIG` holds its defaults.

# %%
from scan_lib.runtime import copy_bandwidth, graph_us, host_us, median_us  # the timers of chapter 00


def benchmark_cumsum() -> None:
    gpu = torch.cuda.get_device_name(DEVICE)
    copy_gbs = copy_bandwidth() / 1e9
    print(f"{gpu}: copy bandwidth {copy_gbs:.0f} GB/s (1 GiB float32 copy_); CONFIG {CONFIG}")
    sizes = [2**k for k in range(10, 28)]
    methods = {"torch.cumsum": lambda x: torch.cumsum(x, 0),
               "look-back": lambda x: scan_rows(x[None], algorithm="lookback")[0],
               "reduce-then-scan": lambda x: scan_rows(x[None], algorithm="reduce_then_scan")[0],
               "three-phase (4N)": lambda x: cumsum_three_phase(x, 1024)}
    times = {name: [] for name in methods}
    floors = []
    print(f"{'N':>10} {'floor':>7} " + " ".join(f"{name:>16}" for name in methods)
          + f" {'ours GPU-only':>13} {'ours host':>9}   (median us, float32)")
    for n in sizes:
        x = torch.randn(n, device=DEVICE)
        floors.append(2 * n * 4 / copy_gbs / 1e3)
        for name, fn in methods.items():
            assert_cumsum(fn(x), x)
            times[name].append(median_us(lambda: fn(x)))
        gpu_only, host = graph_us(lambda: scan_lib.cumsum(x)), host_us(lambda: scan_lib.cumsum(x))
        print(f"{n:>10} {floors[-1]:>7.1f} " + " ".join(f"{times[name][-1]:>16.1f}" for name in methods)
              + f" {gpu_only:>13.1f} {host:>9.1f}")
    fig, (ax_time, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, ts in times.items():
        ax_time.loglog(sizes, ts, "o-", ms=3, label=name)
        ax_bw.semilogx(sizes, [2 * n * 4 / t / 1e3 for n, t in zip(sizes, ts)], "o-", ms=3, label=name)
    ax_time.loglog(sizes, floors, "k--", label="memory floor (2N words at copy bandwidth)")
    ax_bw.axhline(copy_gbs, color="k", ls="--", label="copy bandwidth")
    ax_time.set(xlabel="N (float32 elements)", ylabel="median time (us)", title=f"cumsum on {gpu}")
    ax_bw.set(xlabel="N (float32 elements)", ylabel="GB/s (2N words / time)", title="effective bandwidth")
    for ax in (ax_time, ax_bw):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, "cumsum_benchmark.png")
    plt.close(fig)


if ON_GPU:
    benchmark_cumsum()
else:
    print("skipped: no GPU (do_bench needs one)")

# %% [markdown]
# ![cumsum benchmark](../figures/cumsum_benchmark.png)
#
# (The figure is written when this notebook runs on a GPU.)
#
# **What the H200 measured (2026-11-29, the table above; copy bandwidth 4.25 TB/s).**
#
# * *Small and medium sizes: we are slower, and the host is why.* Up to $2^{24}$ values the look-back
#   path takes 46 to 63 us whatever the size (one outlier: 16.2 us at $2^{13}$), while the GPU needs
#   only 1.3 us ($2^{10}$) to 44.5 us ($2^{24}$) of it (the "GPU-only" column), and one call of
#   `scan_lib.cumsum` costs the host 69 to 124 us (checks, views, our launcher and Triton's Python
#   launch path). `torch.cumsum` launches from C++ and wins by a wide margin there: 7.0 against 51.5 us at $2^{10}$, 11.9 against 59.1 us at
#   $2^{20}$, still 58.6 against 63.4 us at $2^{24}$. These medians are noisy: for $N \le 4096$ the
#   look-back and reduce-then-scan columns run the very same single launch, yet at $2^{11}$ they read
#   47.1 and 22.5 us. Only fewer launches, CUDA graphs or a C++ launcher would close this gap.
# * *Large sizes: the single pass wins.* From $2^{25}$ values the look-back beats `torch.cumsum`:
#   84.6 against 110.8 us at $2^{25}$, 158.8 against 213.6 at $2^{26}$, 305.1 against 417.3 at $2^{27}$,
#   that is 1.34, 1.26 and 1.21 times the memory floor (63.2, 126.4, 252.7 us), where `torch.cumsum`
#   sits at 1.65 to 1.75 times. The GPU-only time at $2^{25}$, 81.2 us, is still 1.28 times the floor:
#   the look-back does not reach copy speed, and we have not profiled where the last 20 to 30% go.
# * *Words moved, as predicted, roughly.* At $2^{27}$ reduce-then-scan ($3N$) takes 398.8 us, 1.31
#   times the look-back ($2N$), and the three-phase scan ($4N$) 520.6 us, 1.71 times: less than the
#   word counts' 1.5 and 2 because the multi-pass scans come closer to *their* floors (1.05 and 1.03
#   times $3N$ and $4N$ words at copy bandwidth) than the look-back does to its own (1.21). `CONFIG`
#   is the fastest look-back of `benchmarks/bench_cumsum.py`'s sweep (block 4096, 4 warps, window 16: 85.2 us
#   at $2^{25}$); the best reduce-then-scan there (block 16384, 8 warps) took 108 us, still slower.
#   Every look-back correctness check of that script, repeated many times on fresh data up to
#   $2^{27}$ values, passed on the GPU.
#
# ## Summary
#
# * A scan parallelises because its operator is associative: the partial results can be combined
#   in a tree of depth $O(\log N)$ with $O(N)$ work. Non-associative operators silently break this,
#   and the CPU interpreter does not notice.
# * A long scan is blocks plus carries: per-block totals, a scan of the totals, and a carry added to
#   each block. Launch boundaries are the safe grid-wide barriers; reduce-then-scan uses three and
#   moves $3N$ words instead of $4N$.
# * The decoupled look-back scan needs no barrier: tickets in start order rule out deadlock, a
#   flag and a value packed into one atomically written word rule out torn reads, and the data
#   crosses the memory bus once in each direction, $2N$ words.
# * At small sizes the host's launch overhead, not the GPU, sets the time: count launches. On the
#   H200 our Python-launched kernels lose to `torch.cumsum` below about $2^{25}$ values and beat it
#   above, at 1.2 to 1.3 times the memory floor.
#
# The next chapter keeps this structure and swaps `+` for the operator of a first-order linear
# recurrence, $h_t = a_t h_{t-1} + b_t$.
