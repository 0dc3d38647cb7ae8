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
# A cumulative sum (a *scan* with `+`) is the simplest recurrence there is; every later chapter is
# the same algorithm with a richer combine operator. You will scan one block with
# `tl.associative_scan`, see the tree that makes it parallel, scan any length in blocks (three
# phases, then a single pass), and export `scan_lib.cumsum`, which behaves like `torch.cumsum`.

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
# Given $x_0, \dots, x_{L-1}$, the inclusive cumulative sum is
#
# $$y_t = \sum_{j=0}^{t} x_j, \qquad\text{or as a recurrence}\qquad h_{-1} = 0,\quad h_t = h_{t-1} + x_t,\quad y_t = h_t .$$
#
# $h_t$ needs $h_{t-1}$, which needs $h_{t-2}$: $L$ dependent steps. The Python loop below is that
# chain, word for word; the float64 `torch.cumsum` is the fast stand-in that every check uses.

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
# How close must a kernel come? Rounding the output costs up to the unit roundoff $u_\text{out}$
# ($2^{-24}$ for float32, $2^{-11}$ for float16) times $|y_t|$, and each addition in the accumulation
# dtype up to $u_\text{acc}$ times a partial sum; both are at most $\sum_{j \le t} |x_j|$. So we divide
# the error by that (not by $y_t$, which can cancel to zero) and allow
# $u_\text{out} + 32\,u_\text{acc}\log_2 L$ ("Going deeper" derives the factor 32, measures the worst
# order of additions against it, and gives the margins of float16 and bfloat16).

# %%
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def scan_tolerance(dtype: torch.dtype, length: int) -> float:
    """Largest scaled error allowed for a cumsum returned in `dtype` (accumulated in float32, float64 for float64)."""
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    truncating = INTERPRET and dtype == torch.bfloat16      # the interpreter casts float32 to bfloat16 by truncation
    return (2 if truncating else 1) * UNIT_ROUNDOFF[dtype] + 32 * UNIT_ROUNDOFF[accumulate] * math.log2(max(length, 2))


def scan_error(y: torch.Tensor, x: torch.Tensor, dim: int = -1) -> float:
    """max_t |y_t - reference_t| / sum_{j<=t} |x_j|: the error relative to the size of what was summed."""
    scale = torch.cumsum(x.double().abs(), dim=dim).clamp_min(1e-30)
    return ((y.double() - cumsum_reference(x, dim)).abs() / scale).max().item() if x.numel() else 0.0


def assert_cumsum(y: torch.Tensor, x: torch.Tensor, dim: int = -1) -> float:
    assert y.shape == x.shape and y.dtype == x.dtype, (y.shape, y.dtype, x.shape, x.dtype)
    err, tolerance = scan_error(y, x, dim), scan_tolerance(x.dtype, x.shape[dim] if x.dim() else 1)
    assert err <= tolerance, f"scaled error {err:.2e} above {tolerance:.1e} for {x.dtype}"
    return err

# %% [markdown]
# ## One block: `tl.associative_scan`
#
# A Triton program loads a block of values and `tl.associative_scan(values, axis, combine_fn)` scans
# them in parallel. The combine function is a `@triton.jit` function of two arguments; for a
# cumulative sum it is addition. It goes into `scan_lib`, since the exported kernels use it too.

# %%
#| export
"""Cumulative sums along any dimension of a tensor, like torch.cumsum, computed with Triton kernels
(a single-pass decoupled look-back scan, or reduce-then-scan, on rows; along a dimension but the last,
a column scan that reads the tensor in place at its strides)."""
import torch
import triton
import triton.language as tl

from scan_lib.runtime import ON_GPU, apply, cdiv, check_same_device, custom_op, next_power_of_2


@triton.jit
def add_combine(a, b):
    """The combine operator of a cumulative sum. It is associative, so a scan may group it in any tree."""
    return a + b

# %% [markdown]
# The simplest kernel: one program, one block of `BLOCK` lanes (a power of two, as every `tl.arange`
# must be), covering a sequence of any length `length <= BLOCK`. The mask switches off the lanes past
# the end: they read the neutral element 0 (which leaves every prefix unchanged) and are not stored.

# %%
@triton.jit
def cumsum_one_block_kernel(X, Y, length, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)                          # BLOCK
    ### BEGIN SOLUTION
    ### HINT: mask the lanes past `length`, load x with 0 there, and scan it in float32 with tl.associative_scan and add_combine
    mask = offsets < length                                # BLOCK
    x = tl.load(X + offsets, mask=mask, other=0.0)         # BLOCK, lanes >= length hold 0
    y = tl.associative_scan(x.to(tl.float32), 0, add_combine)
    ### END SOLUTION
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)


def cumsum_one_block(x: torch.Tensor) -> torch.Tensor:
    """Cumulative sum of a 1-D tensor short enough for one program."""
    y = torch.empty_like(x)
    cumsum_one_block_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return y


torch.manual_seed(1)
print(f"{'L':>5} {'BLOCK':>5} {'scaled err':>10}")
for length in (1, 7, 16, 129, 1000):
    x_one = torch.randn(length, device=DEVICE)
    print(f"{length:>5} {triton.next_power_of_2(length):>5} {assert_cumsum(cumsum_one_block(x_one), x_one):>10.1e}")

# %% [markdown]
# ## The tree behind it
#
# How can $L$ dependent additions run in parallel? Because $+$ is associative,
# $(a + b) + c = a + (b + c)$, the partial sums can be grouped in any tree. Blelloch's scan uses a
# balanced binary tree over $L = 2^m$ values, in two sweeps:
#
# * **up-sweep**: at level $d = 1, 2, 4, \dots$ every index $t \equiv 2d - 1 \pmod{2d}$ adds in the
#   value $d$ to its left; the last value ends up holding the total.
# * **down-sweep**: set the last value to 0, then at level $d = L/2, \dots, 1$ each such $t$ hands its
#   value to its left child $t - d$ and takes (its value + the child's old value). Value $t$ now holds
#   $\sum_{j<t} x_j$, the *exclusive* scan; adding $x_t$ gives the inclusive one.
#
# That is $3L - 2$ additions against the loop's $L$, but only $2\log_2 L + 1$ dependent steps instead of $L$
# ("Going deeper" counts both in what torch actually runs).

# %%
def blelloch_scan(x: torch.Tensor) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor, torch.Tensor]], int]:
    """Inclusive scan of a 1-D tensor of length 2^m by up-sweep and down-sweep. Returns the scan,
    the steps (label, indices written, values after the step) and the number of additions."""
    length = x.numel()
    assert length & (length - 1) == 0, "a power of two"
    a, steps, additions, d = x.clone(), [("input", torch.arange(0), x.clone())], 0, 1
    while d < length:                                   # up-sweep, d = 1, 2, ..., L/2
        t = torch.arange(2 * d - 1, length, 2 * d)
        a[t] = a[t - d] + a[t]
        additions += t.numel()
        steps.append((f"up d={d}", t, a.clone()))
        d *= 2
    a[length - 1] = 0
    steps.append(("clear last", torch.tensor([length - 1]), a.clone()))
    while d > 1:                                        # down-sweep, d = L/2, ..., 1
        ### BEGIN SOLUTION
        ### HINT: halve d, take the indices t = 2d-1, 4d-1, ..., and let each hand its value to t - d and add that child's old value
        d //= 2
        t = torch.arange(2 * d - 1, length, 2 * d)
        a[t - d], a[t] = a[t].clone(), a[t] + a[t - d]  # hand the value left, add the left child's old value
        ### END SOLUTION
        additions += t.numel()
        steps.append((f"down d={d}", t, a.clone()))
    inclusive = a + x                                   # exclusive scan + input
    steps.append(("+ input", torch.arange(length), inclusive.clone()))
    return inclusive, steps, additions + length

# %%
def draw_cell(ax, x: float, y: float, text: str, color: str, width: float = 0.8, fontsize: float = 8) -> None:
    """A box with a number in it, the unit of this chapter's pictures."""
    ax.add_patch(plt.Rectangle((x - width / 2, y - 0.3), width, 0.6, facecolor=color, edgecolor="black", lw=0.5))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize)


def draw_blelloch(steps) -> plt.Figure:
    """One row per step; arrows run from the cells a step read (row above) to the cells it wrote."""
    from matplotlib.patches import Patch
    colors = {"sum": "#f4c542", "copy": "#f2a7a0", "clear": "#ffffff", "result": "#9fd89f", "read": "#dde6f0"}
    legend = {"sum": "sum of the two cells above", "copy": "copy of the right cell above (dashed)",
              "clear": "set to 0", "result": "cell above + input", "read": "unchanged"}
    length = steps[0][2].numel()
    fig, ax = plt.subplots(figsize=(7, 0.55 * len(steps) + 0.6))
    arrow = dict(arrowstyle="->", lw=0.7, shrinkA=0, shrinkB=0)
    for row, (label, updated, values) in enumerate(steps):
        y, written = -row, updated.tolist()
        d = int(label.split("=")[1]) if "=" in label else 0
        moved = [col - d for col in written] if label.startswith("down") else []
        kind = "clear" if label == "clear last" else "result" if label == "+ input" else "sum"
        ax.text(-0.7, y, label, ha="right", va="center", fontsize=8)
        for col in range(length):
            color = colors[kind] if col in written else colors["copy"] if col in moved else colors["read"]
            draw_cell(ax, col, y, f"{values[col]:.0f}", color)
        for col in written if kind != "clear" else []:
            for src in (col,) if kind == "result" else (col - d, col):        # "+ input": the cell above plus x
                ax.annotate("", xy=(col, y + 0.3), xytext=(src, y + 0.7), arrowprops=dict(arrow, color="#333333"))
            if label.startswith("down"):                                      # right cell's old value moves left
                ax.annotate("", xy=(col - d, y + 0.3), xytext=(col, y + 0.7),
                            arrowprops=dict(arrow, color="#c0392b", linestyle="--"))
    ax.legend(handles=[Patch(facecolor=colors[k], edgecolor="black", label=legend[k]) for k in legend],
              loc="upper center", bbox_to_anchor=(0.45, 0.0), ncol=3, fontsize=7, frameon=False)
    ax.set(xlim=(-2.6, length - 0.5), ylim=(-len(steps) + 0.5, 0.6))
    ax.axis("off")
    ax.set_title(f"Blelloch scan of {length} values: up-sweep, then down-sweep", fontsize=9)
    return fig


torch.manual_seed(2)
x_tree = torch.randint(0, 10, (8,)).double()
y_tree, tree_steps, _ = blelloch_scan(x_tree)
assert torch.equal(y_tree, cumsum_reference(x_tree))
print("input:", x_tree.tolist(), " inclusive scan:", y_tree.tolist())
save_figure(draw_blelloch(tree_steps), "blelloch_tree.png")

# %% [markdown]
# `tl.associative_scan` does not promise this particular tree (on a GPU, threads and warps combine
# partial results in their own order), so every combine function in this course must be associative.
# Floating-point addition is associative only up to rounding, hence the tolerance rather than
# `torch.equal`:

# %%
a32, b32, c32 = torch.tensor(1e8, dtype=torch.float32), torch.tensor(-1e8, dtype=torch.float32), torch.tensor(1.0, dtype=torch.float32)
assert (a32 + b32) + c32 == 1.0 and a32 + (b32 + c32) == 0.0
print("float32: (1e8 + -1e8) + 1 =", ((a32 + b32) + c32).item(), " but 1e8 + (-1e8 + 1) =", (a32 + (b32 + c32)).item())

# %% [markdown]
# Triton's CPU interpreter folds `tl.associative_scan` left to right, so a non-associative combine
# passes on the CPU and fails on the GPU (chapter 00).
#
# ## Longer than one block: the three-phase scan
#
# A program's block lives in its threads' registers (chapter 00), a fixed budget that a block of tens
# of thousands of values exceeds ("Going deeper" counts them). So a long sequence is cut into blocks
# of `BLOCK` values, one program each. Number the blocks $k = 0, 1, \dots$, write $T_k$ for the total
# of block $k$ and $S_k = T_0 + \dots + T_k$. For $t$ in block $k$,
#
# $$y_t = \underbrace{S_{k-1}}_{\text{carry into block } k} + \underbrace{\sum_{j \in \text{block } k,\ j \le t} x_j}_{\text{scan inside block } k}, \qquad S_{-1} = 0,$$
#
# and the carries are themselves a cumulative sum, of the block totals. Hence three phases:
# (1) every program scans its block into $y$ and writes its total $T_k$; (2) scan the totals
# (the same function, recursively, until they fit in one block); (3) every program adds its carry
# $S_{k-1}$ to its block of $y$. ("Going deeper" draws the three phases on a short input.)
#
# The two kernels and the recursive launcher, in separate launches: block $k$ needs the totals of all
# earlier blocks, and the end of a launch is the only grid-wide barrier ("Going deeper" shows what goes
# wrong in one launch).

# %%
@triton.jit
def scan_blocks_kernel(X, Y, T, length, BLOCK: tl.constexpr):
    """Phase 1: scan block k of X into Y, write its total to T[k].  X, Y: length; T: cdiv(length, BLOCK)."""
    k = tl.program_id(0)
    offsets = k * BLOCK + tl.arange(0, BLOCK)             # BLOCK
    mask = offsets < length
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offsets, tl.associative_scan(x, 0, add_combine), mask=mask)
    ### BEGIN SOLUTION
    ### HINT: store the total of block k (the sum of its x) in T[k]
    tl.store(T + k, tl.sum(x, axis=0))
    ### END SOLUTION


@triton.jit
def add_carry_kernel(Y, S, length, BLOCK: tl.constexpr):
    """Phase 3: add the carry S[k-1] (0 for the first block) to block k of Y.  Y: length; S: cdiv(length, BLOCK)."""
    k = tl.program_id(0)
    offsets = k * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < length
    ### BEGIN SOLUTION
    ### HINT: load the carry S[k-1] (0 for block 0, without reading S[-1]) and add it to block k of Y
    carry = tl.load(S + k - 1, mask=k > 0, other=0.0)       # scalar
    tl.store(Y + offsets, tl.load(Y + offsets, mask=mask) + carry, mask=mask)
    ### END SOLUTION


def cumsum_three_phase(x: torch.Tensor, block: int) -> torch.Tensor:
    """Cumulative sum of a 1-D float32 tensor of any length, in blocks of `block` (a power of two)."""
    length = x.numel()
    num_blocks = triton.cdiv(length, block)
    y = torch.empty_like(x)
    totals = torch.empty(num_blocks, dtype=torch.float32, device=x.device)
    scan_blocks_kernel[(num_blocks,)](x, y, totals, length, BLOCK=block)          # launch 1
    if num_blocks > 1:
        prefix = cumsum_three_phase(totals, block)                                # launch(es) 2: S
        add_carry_kernel[(num_blocks,)](y, prefix, length, BLOCK=block)           # launch 3
    return y

# %% [markdown]
# Checked at awkward lengths, with blocks small enough that the totals recurse: on a GPU the
# smallest block is 64, and 4097 values give 65 totals, then 2 (two levels):

# %%
torch.manual_seed(4)
blocks = (16, 64, 1024) if not ON_GPU else (64, 1024, 4096)
print(f"{'L':>5} " + " ".join(f"{'BLOCK=' + str(b):>11}" for b in blocks))
for length in (1, 7, 129, 1000, 4097):
    x_blocked = torch.randn(length, device=DEVICE)
    errors = [assert_cumsum(cumsum_three_phase(x_blocked, b), x_blocked) for b in blocks]
    print(f"{length:>5} " + " ".join(f"{e:>11.1e}" for e in errors))

# %% [markdown]
# ## Fewer words: reduce-then-scan ($3L$) and the single-pass look-back ($2L$)
#
# A cumulative sum does one addition per value but must read $x$ and write $y$, two words per value:
# it is bound by memory bandwidth. The three-phase scan moves $4L$ words: phase 1 reads $x$ and writes
# $y$, phase 3 reads and writes $y$ again.
#
# **Reduce, then scan** ($3L$ words, three launches): pass 1 reads $x$ and writes only the totals
# $T_k$; pass 2 scans the totals; pass 3 reads $x$ again, scans each block, adds its carry and writes $y$.
#
# **Decoupled look-back** (Merrill and Garland, 2016) reads $x$ once: the program holding block $k$
# learns its carry *during the same launch*.
#
# * Every program first takes a ticket, `tile = atomic_add(counter, 1)`: tiles are numbered in the
#   order programs *start*, so a tile only waits for tiles already running, and no wait lasts forever.
# * Each tile owns a state word that only moves forward: EMPTY, then (AGGREGATE, $T_k$) once it has
#   loaded its block, then (PREFIX, $S_k$) once it knows its carry.
# * Tile $k$ looks back over $k-1, k-2, \dots$, adding aggregates until it meets a PREFIX $S_j$: its
#   carry is $S_{k-1} = S_j + T_{j+1} + \dots + T_{k-1}$. It publishes (PREFIX, $S_{k-1} + T_k$) and writes $y$.
#
# New primitives: `tl.atomic_add(pointer, value)` adds to a word in global memory and returns the old
# value, as one indivisible step, and `tl.atomic_xchg` writes a word the same way; `tl.where(c, a, b)`
# picks elementwise, like `torch.where`; `.to(tl.uint32, bitcast=True)` reinterprets a float32's bits,
# so that a flag and a float32 share one int64 state word. "Going deeper" draws the state words during
# a look-back and says why this is correct under the GPU's weak memory ordering.
#
# The exported kernels below scan the rows of a contiguous `n_rows x length` tensor, the scanned
# dimension last; the program id numbers (row, block) pairs ("Going deeper" gives that layout's cost,
# why the offsets are 64-bit, and the further kernel that scans along any other dimension in place).
# They accumulate in `ACC`: float64 for float64, int64 for integers (as `torch.cumsum` does), float32
# otherwise.

# %%
#| export
@triton.jit
def block_totals_kernel(X, T, length, num_blocks, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """Pass 1 (reduce): T[r, k] = sum of block k of row r.  X: n_rows x length; T: n_rows x num_blocks."""
    pid = tl.program_id(0)                                                      # r * num_blocks + k
    row = pid // num_blocks
    cols = (pid % num_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)        # BLOCK, 64-bit: rows past 2^31
    x = tl.load(X + row.to(tl.int64) * length + cols, mask=cols < length, other=0)   # BLOCK
    tl.store(T + pid, tl.sum(x.to(ACC), axis=0))


@triton.jit
def scan_totals_kernel(T, num_blocks, CHUNK: tl.constexpr):
    """Pass 2: replace row r of T (n_rows x num_blocks) by its inclusive scan S, CHUNK totals at a time.
    One program per row; `carry` is the sum of the chunks already done."""
    ROW = T + tl.program_id(0).to(tl.int64) * num_blocks
    carry = tl.zeros((), T.dtype.element_ty)
    for start in range(0, num_blocks, CHUNK):
        cols = start + tl.arange(0, CHUNK)                                      # CHUNK
        totals = tl.load(ROW + cols, mask=cols < num_blocks, other=0)
        tl.store(ROW + cols, carry + tl.associative_scan(totals, 0, add_combine), mask=cols < num_blocks)
        carry += tl.sum(totals, axis=0)


@triton.jit
def scan_tiles_kernel(X, S, Y, n_rows, length, num_blocks,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr, REVERSE: tl.constexpr):
    """Pass 3 (scan): scan a ROWS x BLOCK tile of X along its rows, add each row's carry S[r, k-1]
    (S: n_rows x num_blocks, the inclusive scan of the block totals; not read when num_blocks == 1),
    and write the tile to Y in Y's dtype.  X, Y: n_rows x length.  REVERSE: last tile first."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0) if REVERSE else tl.program_id(0)   # num_programs: grid size
    k = pid % num_blocks
    rows = (pid // num_blocks) * ROWS + tl.arange(0, ROWS)[:, None]            # ROWS x 1
    cols = k.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[None, :]                # 1 x BLOCK, 64-bit
    mask = (rows < n_rows) & (cols < length)                                    # ROWS x BLOCK
    offsets = rows.to(tl.int64) * length + cols                                 # ROWS x BLOCK
    x = tl.load(X + offsets, mask=mask, other=0)
    # k > 0 is spelled out as a ROWS x 1 tile: Triton 3.9's interpreter rejects a mask that broadcasts a scalar.
    has_carry = tl.zeros_like(rows) + k > 0                                     # ROWS x 1
    carry = tl.load(S + rows.to(tl.int64) * num_blocks + k - 1, mask=(rows < n_rows) & has_carry, other=0)   # ROWS x 1
    y = tl.associative_scan(x.to(ACC), 1, add_combine) + carry
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)

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
    """The carry of `tile`: the sum of the blocks of tiles first .. tile-1 (its row's earlier tiles),
    read from their state words WINDOW at a time, newest first.  STATE: one int64 word per tile;
    words of tiles before `first` are treated as (PREFIX, 0)."""
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
def lookback_scan_kernel(X, Y, STATE, length, num_blocks, BLOCK: tl.constexpr, WINDOW: tl.constexpr):
    """Single-pass scan of the rows of X into Y.  X, Y: n_rows x length, blocks of BLOCK values, num_blocks
    per row; STATE: 1 + n_rows * num_blocks zeros (int64): STATE[0] hands out tickets, STATE[1 + t] is tile t's word."""
    tile = tl.atomic_add(STATE, 1, sem="relaxed")                               # tickets in start order
    k = tile % num_blocks
    cols = k * BLOCK + tl.arange(0, BLOCK)                                      # BLOCK
    offsets = (tile // num_blocks) * length + cols                              # BLOCK, int64
    x = tl.load(X + offsets, mask=cols < length, other=0.0).to(tl.float32)
    aggregate = tl.sum(x, axis=0)
    tl.atomic_xchg(STATE + 1 + tile, pack_state(tl.where(k == 0, PREFIX, AGGREGATE), aggregate), sem="relaxed")
    y = tl.associative_scan(x, 0, add_combine)                                  # BLOCK, while others publish
    exclusive = look_back(STATE + 1, tile, tile - k, WINDOW)
    tl.atomic_xchg(STATE + 1 + tile, pack_state(tl.full((), PREFIX, tl.int32), exclusive + aggregate),
                   mask=k > 0, sem="relaxed")
    tl.store(Y + offsets, (y + exclusive).to(Y.dtype.element_ty), mask=cols < length)

# %% [markdown]
# ## The exported `cumsum`
#
# A launcher, `scan_rows`, picks the path: rows of at most one block take one launch of
# `scan_tiles_kernel`; longer ones the look-back (float32 sums, which fit in a state word) or
# reduce-then-scan (float64 and integers). Around it, `scan_lib.cumsum` follows `torch.cumsum` (any
# dim, integers summed in int64, `dtype=`, 0-dim tensors, a contiguous result, `IndexError` for a bad
# dim). Its gradient is the *reverse* cumulative sum,
# $\partial\mathcal{L}/\partial x_j = \sum_{t \ge j} \partial\mathcal{L}/\partial y_t$: a flip, the
# same scan, a flip back. That code is engineering, not a new idea: it is exported from "Going deeper:
# the launcher and the exported `cumsum`", and checked against the float64 reference there.
#
# ## Speed (GPU only)
#
# "Going deeper: the benchmark" times `cumsum` (the look-back) against `torch.cumsum`,
# reduce-then-scan and the three-phase scan on float32 inputs of $2^{10}$ to $2^{27}$ values. From
# $L = 2^{22}$ up to $2^{27}$, the largest size measured, the look-back is the fastest of the four and
# beats `torch.cumsum`; there the words moved set the order of our three scans ($2L$, then $3L$, then
# $4L$), and at $2^{27}$ the look-back takes 1.07 times the memory floor (the time to move $2L$ words
# at the measured copy bandwidth). At every size up to $2^{22}$ that it splits into host and GPU time,
# a `cumsum` call is host-bound: its host time per call exceeds its GPU time. So below $2^{22}$ its
# medians in this run include host time, which varies from call to call, and say little about the
# kernels ("Going deeper: the benchmark" sets them beside the GPU time alone).
#
# ## Summary
#
# * A scan parallelises because its operator is associative: a tree of depth $O(\log L)$ with $O(L)$
#   work. A non-associative operator breaks this silently, and the CPU interpreter does not notice.
# * A long scan is blocks plus carries. Launch boundaries are the safe grid-wide barriers;
#   reduce-then-scan moves $3L$ words, the decoupled look-back $2L$ in one launch.
# * `scan_lib.cumsum` behaves like `torch.cumsum`, checked against a float64 reference with tolerances
#   a wrong kernel fails.
#
# The next chapter swaps `+` for the operator of a first-order linear recurrence, $h_t = a_t h_{t-1} + b_t$.

# %% [markdown]
# ## Going deeper: where the tolerance's factor 32 comes from
#
# A sum grouped as any tree has an error of at most $d\,u_\text{acc}\sum|x_j|$ (to first order), where
# $d$ is the largest number of additions one value passes through on its way to $y_t$; the roundings
# have random signs and mostly cancel, so the typical error is nearer
# $\sqrt{d}\,u_\text{acc}\sum|x_j|$ (chapter 00's row sums use the same model). A balanced tree has
# $d \approx \log_2 L$, but no kernel here is one: a GPU thread first adds the values it holds one
# after another, the carries pass from block to block one addition per block, and the interpreter
# folds a whole block left to right, so $d$ can reach the block's length. The worst case of such a sum
# grows like $L$, and no tolerance tight enough to catch a bug covers it; the factor 32 covers the
# typical error of the worst order there is, a fully sequential float32 sum ($d = L - 1$):
# $\sqrt{L} \le 32\log_2 L$ for every $L$ up to $2^{18}$, beyond the lengths the CPU run checks; the
# measurement below asserts that inequality. On a GPU the longest path is much shorter than $L$: the
# carry chain, about one addition per block of 4096, plus a thread's few values and a tree; at the
# benchmark's largest size, $2^{27}$, the chain is $2^{27}/4096 = 2^{15}$ additions, and the square
# root of the whole path, about 181, is far below $32\log_2 L = 32 \cdot 27 = 864$.
#
# The cell below measures the worst order of additions, a fully sequential float32 sum (NumPy's
# `cumsum`, on positive values, which do not cancel): its error is within the tolerance, and above
# $u_\text{acc}\log_2 L$, so a factor of 1 would fail it.

# %%
import numpy as np

assert all(math.sqrt(n) <= 32 * math.log2(n) for n in range(2, 2**18 + 1))   # sqrt(L) <= 32 log2 L up to 2^18
print(f"{'L':>7} {'sequential float32':>18} {'u log2 L':>9} {'tolerance':>9}   (scaled errors)")
for log_length in (10, 14, 18):
    n = 2**log_length
    x_pos = torch.rand(n, generator=torch.Generator().manual_seed(log_length), dtype=torch.float64).float()
    y_sequential = torch.from_numpy(np.cumsum(x_pos.numpy(), dtype=np.float32))   # one addition after another
    err = scan_error(y_sequential, x_pos)
    assert UNIT_ROUNDOFF[torch.float32] * log_length < err <= scan_tolerance(torch.float32, n), (n, err)
    print(f"{'2^' + str(log_length):>7} {err:>18.1e} {UNIT_ROUNDOFF[torch.float32] * log_length:>9.1e} "
          f"{scan_tolerance(torch.float32, n):>9.1e}")

# %% [markdown]
# In float16 and bfloat16 the output rounding dominates: rounding to nearest costs at most
# $u_\text{out}|y_t| \le u_\text{out}\sum_{j\le t}|x_j|$, the tolerance's first term, so the margin of
# a correctly rounding kernel is the accumulation term alone, a few percent of the tolerance in
# float16 and under one percent in bfloat16 (the table of the exported `cumsum`'s checks prints error
# and tolerance side by side). That margin is thin but not luck: the float32 accumulation's own error
# is about $u_\text{acc}$, thousands of times smaller than $u_\text{out}$, and the rounding of the
# output cannot exceed its bound. A kernel that accumulated float16 in float16 fails the tolerance
# (`tests/test_cumsum.py` shows it). Under the interpreter, whose float32-to-bfloat16 cast truncates,
# bfloat16 gets $2u_\text{out}$.

# %% [markdown]
# ## Going deeper: counting the tree's additions
#
# `blelloch_scan` tallies its additions from the index sets it writes, which would agree with the
# formula even if an addition were missing or doubled. So the check below does not take the function's
# word for it: it counts, with a `TorchDispatchMode` (a hook that sees every operation torch runs
# while it is active), the floating-point additions torch actually performs and the calls that
# perform them: each call adds one whole index set at once, so the calls are the dependent steps.

# %%
from torch.utils._python_dispatch import TorchDispatchMode


class CountAdditions(TorchDispatchMode):
    """Counts what torch itself adds while active: each floating-point aten.add call (one parallel step)
    and the elements it adds (one addition each), whatever the code under it believes it does."""
    def __init__(self):
        super().__init__()
        self.calls = self.additions = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.add.Tensor and out.is_floating_point():
            self.calls, self.additions = self.calls + 1, self.additions + out.numel()
        return out


for length in (1, 2, 8, 16, 1024):
    x_check = torch.randn(length, dtype=torch.float64)
    with CountAdditions() as counted:
        y_check, steps, additions = blelloch_scan(x_check)
    assert torch.allclose(y_check, cumsum_reference(x_check), rtol=0, atol=1e-12)
    assert counted.additions == additions == 3 * length - 2, (length, counted.additions, additions)
    assert counted.calls == 2 * int(math.log2(length)) + 1, (length, counted.calls)   # dependent steps
print("Blelloch scan == reference for L = 1, 2, 8, 16, 1024, with 3L - 2 additions in 2 log2(L) + 1 dependent steps")

# %% [markdown]
# ## Going deeper: why one program cannot scan a long sequence
#
# A program's block lives in its threads' registers (chapter 00: a block of values is spread over the
# program's threads), and registers are a fixed budget: 65,536 32-bit registers per multiprocessor on
# an H100 or H200, at most 255 per thread, shared by every program resident there. With the default
# 4 warps a program's 128 threads have at most 128 x 255 = 32,640 registers, so a block of tens of
# thousands of values no longer fits; more warps raise that only towards the multiprocessor's
# 65,536, and well before that one program fills a multiprocessor alone.

# %% [markdown]
# ## Going deeper: one launch, no barrier
#
# Why not carry the totals within one launch? A GPU runs as many programs as fit, in an order it
# chooses, and starts the rest only when earlier ones *finish*; inside a launch there is no barrier
# across programs. Here is the tempting wrong version: program $k$ reads the running total that
# program $k-1$ wrote, without waiting. The running totals start as NaN, so an early read shows up,
# and since each program passes on what it read, one early read spoils every block after it. The
# interpreter runs program 0 to completion, then program 1, and so on, so there the wrong kernel
# passes; on a GPU most blocks come out wrong (the cell asserts more than half). Only a GPU run
# exposes such a bug.

# %%
@triton.jit
def one_launch_chained_kernel(X, Y, RUNNING, length, BLOCK: tl.constexpr):
    """WRONG on a GPU: reads RUNNING[k-1] whether or not program k-1 has written it yet."""
    k = tl.program_id(0)
    offsets = k * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < length
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    carry = tl.load(RUNNING + k - 1, mask=k > 0, other=0.0)
    tl.store(Y + offsets, tl.associative_scan(x, 0, add_combine) + carry, mask=mask)
    tl.store(RUNNING + k, carry + tl.sum(x, axis=0))


torch.manual_seed(5)
length_chain, block_chain = (2**24, 1024) if ON_GPU else (4096, 64)
x_chain = torch.randn(length_chain, device=DEVICE)
y_chain = torch.empty_like(x_chain)
running = torch.full((triton.cdiv(length_chain, block_chain),), float("nan"), device=DEVICE)
one_launch_chained_kernel[(running.numel(),)](x_chain, y_chain, running, length_chain, BLOCK=block_chain)
block_errors = ((y_chain.double() - cumsum_reference(x_chain)).abs()
                / torch.cumsum(x_chain.double().abs(), 0)).view(-1, block_chain).amax(dim=1)
wrong_blocks = (~(block_errors <= scan_tolerance(torch.float32, length_chain))).sum().item()   # NaN counts as wrong
print(f"{'interpreter' if INTERPRET else 'GPU'}: {wrong_blocks} of {running.numel()} blocks wrong")
if INTERPRET:
    assert wrong_blocks == 0, "the interpreter runs programs 0, 1, 2, ... one after another"
else:
    assert wrong_blocks > running.numel() // 2, "on a GPU most programs read their carry too early"

# %% [markdown]
# ## Going deeper: the three-phase scan and the look-back, drawn
#
# The three phases on a short integer input, blocks side by side; the dashed arrows carry each
# running total $S_k$ into the next block:

# %%
def draw_three_phase(x: torch.Tensor, block: int) -> plt.Figure:
    """The three phases on a short integer input, one row each, blocks side by side."""
    length, num_blocks = x.numel(), x.numel() // block
    totals = x.view(num_blocks, block).sum(1)                              # T_k
    prefix = torch.cumsum(totals, 0)                                       # S_k
    shades = ["#dde6f0", "#f4e3b5", "#e3d4ef", "#d4efe0"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    position = lambda t: t + 0.6 * (t // block)                           # noqa: E731 (gaps between blocks)
    rows = [("x", x, None), ("1: scan each block", torch.cumsum(x.view(num_blocks, block), 1).flatten(), None),
            ("2: S = scan of totals", None, None), ("3: add carry S(k-1)", torch.cumsum(x, 0), "#9fd89f")]
    for row, (label, values, color) in enumerate(rows):
        ax.text(-0.8, -row, label, ha="right", va="center", fontsize=8)
        for t in range(length) if values is not None else []:
            draw_cell(ax, position(t), -row, f"{values[t]:.0f}", color or shades[(t // block) % len(shades)])
    for k in range(num_blocks):
        last, centre = position((k + 1) * block - 1), (position(k * block) + position((k + 1) * block - 1)) / 2
        draw_cell(ax, centre, -2, f"T={totals[k]:.0f}, S={prefix[k]:.0f}", shades[k % len(shades)], width=1.8, fontsize=7)
        ax.annotate("", xy=(centre, -1.7), xytext=(last, -1.3), arrowprops=dict(arrowstyle="->", lw=0.7))
        if k + 1 < num_blocks:                                             # S_k is the carry into block k+1
            target = (position((k + 1) * block) + position((k + 2) * block - 1)) / 2
            ax.annotate("", xy=(target, -2.7), xytext=(centre + 0.9, -2.1),
                        arrowprops=dict(arrowstyle="->", lw=0.8, color="#c0392b", linestyle="--"))
    ax.set(xlim=(-4.2, position(length - 1) + 0.6), ylim=(-3.5, 0.6))
    ax.axis("off")
    ax.set_title(f"Three-phase scan of {length} values in blocks of {block} (dashed: carry into the next block)", fontsize=9)
    return fig


torch.manual_seed(3)
save_figure(draw_three_phase(torch.randint(0, 10, (12,)).double(), 4), "three_phase_scan.png")

# %% [markdown]
# The look-back at one moment: the tiles' state words in ticket order, and one tile walking back over
# aggregates until it meets a PREFIX:

# %%
def draw_look_back() -> plt.Figure:
    """Eight tiles' state words at one moment, and tile 6 looking back until it meets a PREFIX."""
    states, totals = "PPPPAAAE", [3, 5, 2, 4, 6, 1, 7, 2]            # tile 6 has published its aggregate
    prefix = torch.cumsum(torch.tensor(totals), 0).tolist()
    fig, ax = plt.subplots(figsize=(7, 2.4))
    for tile, state in enumerate(states):
        text = {"P": f"PREFIX\nS={prefix[tile]}", "A": f"AGGREGATE\nT={totals[tile]}", "E": "EMPTY"}[state]
        ax.add_patch(plt.Rectangle((tile - 0.45, -0.4), 0.9, 0.8, facecolor={"P": "#9fd89f", "A": "#f4c542", "E": "#ffffff"}[state],
                                   edgecolor="black", lw=0.6))
        ax.text(tile, 0, text, ha="center", va="center", fontsize=5.5)
        ax.text(tile, 0.55, f"tile {tile}", ha="center", fontsize=7)
    for source in (5, 4, 3):                                            # tile 6 reads back to the first PREFIX
        ax.annotate("", xy=(source, -0.45), xytext=(6, -0.45),
                    arrowprops=dict(arrowstyle="->", color="#c0392b", lw=0.8, connectionstyle=f"arc3,rad={-0.12 * (7 - source)}"))
    ax.text(3.5, -1.45, f"tile 6: carry = S(3) + T(4) + T(5) = {prefix[3]} + {totals[4]} + {totals[5]} = {prefix[5]}; "
            f"then it publishes PREFIX S(6) = {prefix[6]}", ha="center", fontsize=7.5)
    ax.set(xlim=(-0.6, 7.6), ylim=(-1.65, 0.8))
    ax.axis("off")
    ax.set_title("Decoupled look-back: tiles in ticket order, their state words, tile 6 looking back", fontsize=9)
    return fig


save_figure(draw_look_back(), "look_back_scan.png")

# %% [markdown]
# ## Going deeper: the look-back and the GPU's memory model
#
# The decoupled look-back is the algorithm behind the device scans of CUB, NVIDIA's C++ library of GPU
# primitives such as scans, sorts and reductions, and of `torch.cumsum`.
#
# A GPU's memory model is weak: two stores by one program may become visible to another
# multiprocessor in the opposite order, and an ordinary load in a loop may be served from the
# multiprocessor's own L1 cache (a small cache private to each multiprocessor, which other
# multiprocessors' writes do not update), or hoisted out of the loop by the compiler, and never see
# the new value. With the flag and the value in two separate words, a reader could see the flag
# AGGREGATE together with the *old* value of the other word. The textbook fix is a *release* store of
# the flag after the value (a store that becomes visible only after every earlier write of its
# program) and an *acquire* load of the flag before the value (a load after which the reader sees every
# write that preceded the release it read). We sidestep it: the
# flag (high 32 bits) and the float32 bits of the value (low 32 bits) share **one int64 word**,
# written by one 64-bit atomic exchange and read by 64-bit loads. An aligned 64-bit access is
# indivisible, so a reader sees the old word or the new one, never half of each, and every value a
# word ever holds is final for its flag. The programs share nothing else (each writes only its own
# part of $y$), so no ordering between *different* addresses is needed, and the atomics can be
# `sem="relaxed"`. The look-back reads with `tl.load(..., volatile=True)`, which becomes PTX
# `ld.volatile`: issued again on every trip round the loop, it reads the coherent copy in the L2 cache
# (the one cache that all multiprocessors share, in front of the GPU's memory), where the atomics are
# performed. The counter and the state words are zeroed by one `torch.zeros` before the launch, and
# the launch boundary orders that memset before every program.
#
# The interpreter cannot show which instructions these become, but the compiler can, without a GPU.
# `gpu_assembly` (chapter 00) compiles a kernel's source alone, and `lookback_scan_kernel` calls other
# `@triton.jit` functions of `scan_lib.cumsum`; so the cell below hands the same compile script a
# module that imports the kernel from `scan_lib.cumsum`, and reads its PTX for sm_90 (H100, H200). It
# asserts the instructions the claims above name: the ticket is one `atom.global.gpu.relaxed.add.u64`;
# both publications are `atom.global.gpu.relaxed.exch.b64`, relaxed, 64 bits at once, at the scope of
# the whole GPU (`.gpu`: every multiprocessor); the look-back's read is `ld.volatile.global.b64`, a
# 64-bit load; and there is no acquire load, release store or fence (`.acquire`, `.release`, `fence`,
# `membar`) anywhere: nothing in the kernel orders accesses to different addresses. The cell shows
# which instructions the kernel compiles to, not what they do: that an aligned 64-bit access is
# indivisible, and that `ld.volatile` is issued on every trip round the loop and served from L2, not
# L1, is what the PTX documentation says of these instructions; nothing in this chapter inspects it.

# %%
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import scan_lib.runtime


def lookback_ptx(block: int = 4096, window: int = 16, num_warps: int = 4) -> str:
    """PTX of scan_lib.cumsum.lookback_scan_kernel for sm_90, compiled without a GPU by gpu_assembly's script."""
    types = {"X": "*fp32", "Y": "*fp32", "STATE": "*i64", "length": "i32", "num_blocks": "i32"}
    package_root = str(Path(scan_lib.__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "kernel_source.py").write_text("from scan_lib.cumsum import lookback_scan_kernel as kernel\n")
        result = subprocess.run(
            [sys.executable, "-c", scan_lib.runtime._COMPILE_FOR_GPU, folder,
             json.dumps([types, {"BLOCK": block, "WINDOW": window}, num_warps, 90])],
            capture_output=True, text=True,
            env={**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["ptx"]


ptx_lookback = lookback_ptx()
memory_lines = [line.strip() for line in ptx_lookback.splitlines()
                if re.search(r"\batom\.|\.volatile|\.acquire|\.release|\bfence\b|\bmembar\b", line)]
print("\n".join(memory_lines))
opcodes = [re.search(r"(atom|ld|st|fence|membar)\S*", line).group(0) for line in memory_lines]
assert opcodes.count("atom.global.gpu.relaxed.add.u64") == 1, opcodes             # the ticket
assert opcodes.count("atom.global.gpu.relaxed.exch.b64") == 2, opcodes            # AGGREGATE, then PREFIX
assert opcodes.count("ld.volatile.global.b64") >= 1, opcodes                      # the look-back's window
assert not any(re.search(r"acquire|release|fence|membar", op) for op in opcodes), opcodes
assert len(opcodes) == 3 + opcodes.count("ld.volatile.global.b64"), opcodes       # nothing else orders memory
print("PTX of lookback_scan_kernel: relaxed 64-bit atomics at GPU scope, volatile 64-bit loads, no acquire, release or fence")

# %% [markdown]
# `look_back` inspects `WINDOW` predecessors with one vector load: it finds the newest PREFIX in the
# window, and uses the window only if every word newer than that is already non-empty (otherwise it
# loads the same window again). Tiles before the start of the tile's row read as (PREFIX, 0), so a
# look-back stops at its row's start by itself. Float64 and int64 sums do not fit next to a flag in
# 64 bits, so those inputs take reduce-then-scan.
#
# The interpreter cannot test any of this: it runs the programs one after another in ticket order,
# so every look-back finds a PREFIX at $k-1$ on the first try. The walk is checked instead on
# snapshots of state words as a GPU might leave them mid-flight: tile 37 of a row whose only PREFIX
# so far is tile 5 (so a window of 4 must walk eight windows back), and a second row that starts at
# tile 20 and has no PREFIX yet (so the row start must stop the walk). Races can only show on a GPU:
# `benchmarks/bench_cumsum.py` repeats the checks many times on fresh data there.

# %%
def pack_words(flags: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """State words as pack_state writes them: flag << 32 | float32 bits of value."""
    bits = values.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return flags.to(torch.int64) << 32 | bits


@triton.jit
def look_back_probe_kernel(STATE, OUT, tile, first, WINDOW: tl.constexpr):
    tl.store(OUT, look_back(STATE, tile, first, WINDOW))


def probe_look_back(words: torch.Tensor, tile: int, first: int, window: int) -> float:
    out = torch.empty(1, device=DEVICE)
    look_back_probe_kernel[(1,)](words.to(DEVICE), out, tile, first, WINDOW=window)
    return out.item()


torch.manual_seed(9)
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
# ## Going deeper: the launcher and the exported `cumsum`
#
# The code that turns the main line's kernels into `scan_lib.cumsum`: first the launcher. `scan_rows`
# picks the path: rows of at most `block` values take one launch of `scan_tiles_kernel` (pass 3 alone,
# with no carry), in which a program takes several rows at once; longer ones the look-back (float32
# sums, which fit in a state word) or reduce-then-scan (float64 and integers). `CONFIG` holds the
# defaults; keyword arguments override them for one call ("launch configuration and tuning" below).

# %%
#| export
ALGORITHMS = ("lookback", "reduce_then_scan")
# GPU defaults: the fastest correct configuration of benchmarks/bench_cumsum.py on an H200 (2026-11-29).
CONFIG = {
    "algorithm": "lookback",                # rows longer than one block; float64 and int64 always reduce_then_scan
    "block": 4096 if ON_GPU else 1024,      # values per program on those rows (the interpreter prefers few programs)
    "num_warps": 4,                         # warps per program on those rows
    "window": 16,                           # predecessors one look-back step inspects
    "reverse": True,                        # reduce_then_scan: pass 3 starts with the last block
}
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64)


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels add in: float64 and int64 as themselves, float32 for the rest."""
    return dtype if dtype in (torch.float64, torch.int64) else torch.float32


def tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.float64: tl.float64, torch.int64: tl.int64}[dtype]


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
    """One launch for n_rows x length with length <= max_block: each program scans ROWS whole rows."""
    n_rows, length = x.shape
    block = max(16, next_power_of_2(length))
    rows = min(max_block // block, next_power_of_2(n_rows))
    scan_tiles_kernel[(cdiv(n_rows, rows),)](
        x, y, y, n_rows, length, 1, ROWS=rows, BLOCK=block, ACC=tl_dtype(accumulator(x.dtype)), REVERSE=False,
        num_warps=warps_for(rows * block))
    return y


def scan_reduce_then_scan(x: torch.Tensor, y: torch.Tensor, config: dict) -> torch.Tensor:
    """Three launches: block totals, their scan (one program per row), the scan of x plus carries."""
    n_rows, length = x.shape
    block, warps, acc = config["block"], config["num_warps"], accumulator(x.dtype)
    num_blocks = cdiv(length, block)
    totals = torch.empty(n_rows, num_blocks, dtype=acc, device=x.device)
    grid = (n_rows * num_blocks,)
    block_totals_kernel[grid](x, totals, length, num_blocks, BLOCK=block, ACC=tl_dtype(acc), num_warps=warps)
    chunk = min(block, next_power_of_2(num_blocks))
    scan_totals_kernel[(n_rows,)](totals, num_blocks, CHUNK=chunk, num_warps=warps_for(chunk))
    scan_tiles_kernel[grid](x, totals, y, n_rows, length, num_blocks, ROWS=1, BLOCK=block, ACC=tl_dtype(acc),
                            REVERSE=config["reverse"], num_warps=warps)
    return y


def scan_lookback(x: torch.Tensor, y: torch.Tensor, config: dict) -> torch.Tensor:
    """One launch (after a memset): the decoupled look-back scan, float32 accumulation."""
    n_rows, length = x.shape
    num_blocks = cdiv(length, config["block"])
    state = torch.zeros(1 + n_rows * num_blocks, dtype=torch.int64, device=x.device)   # ticket, words
    lookback_scan_kernel[(n_rows * num_blocks,)](x, y, state, length, num_blocks, BLOCK=config["block"],
                                                 WINDOW=config["window"], num_warps=config["num_warps"])
    return y


def scan_rows(x: torch.Tensor, out: torch.Tensor | None = None, **overrides) -> torch.Tensor:
    """Inclusive cumulative sum of each row of a contiguous n_rows x length tensor, returned in x's dtype
    (one of KERNEL_DTYPES), in `out` if given (contiguous, like x). The path and its parameters come from
    CONFIG, with `overrides` (algorithm, block, num_warps, window, reverse) applied for this call."""
    config = resolve_config(overrides)
    y = torch.empty_like(x) if out is None else out
    if x.numel() == 0:
        return y
    if x.shape[1] <= config["block"]:
        return scan_short_rows(x, y, config["block"])
    if config["algorithm"] == "lookback" and accumulator(x.dtype) == torch.float32:
        return scan_lookback(x, y, config)
    return scan_reduce_then_scan(x, y, config)

# %% [markdown]
# ## Going deeper: the exported kernels' layout and 64-bit offsets
#
# The row kernels above scan rows of a contiguous `n_rows x length` tensor, the scanned dimension
# last. Given anything else, `cumsum` could copy its input into that layout and, along any dimension
# but the last, copy its result back: each copy reads and writes every value once more, which a
# kernel taking strides (chapter 00) avoids. So along a dimension but the last, a second exported
# kernel, the column scan of the next section, reads the tensor in place at its strides and writes
# the contiguous result directly; the copy path remains where the column scan would be slow or cannot
# read the view (that section says when: few columns and a long scan, the last dimension of a
# non-contiguous tensor, dimensions that do not share one stride). "Going deeper: what the copies
# along a dimension but the last cost" times both paths on a GPU.
#
# The row kernels' column indices and offsets are 64-bit because a program id is a 32-bit integer, and block k's
# first column, k times the block, passes 2^31 in a row of that many values: the kernels widen k
# before multiplying.
#
# Pass 2 of reduce-then-scan needs no recursion: one program per row walks the totals in chunks.

# %% [markdown]
# ## Going deeper: scanning along a dimension but the last, in place
#
# Along a dimension that is not the last, the values of one scan are not neighbours in memory, but
# the scans themselves are: view `x` as `outer x length x inner`, `length` the scanned dimension,
# `outer` the product of the dimensions before it and `inner` of those after it. For a given outer
# index and position $t$, the `inner` values of the `inner` different scans lie side by side. So the
# *column scan* puts the lanes across them:
#
# * a program takes `BLOCK_INNER` consecutive columns of one outer index and walks down `length`,
#   `BLOCK_L` rows at a time: it loads the `BLOCK_L x BLOCK_INNER` tile through x's strides, scans it
#   along axis 0 (`tl.cumsum`: on a GPU the same tree as `tl.associative_scan` with `add_combine`,
#   but the CPU interpreter runs it as one NumPy call instead of a combine per value), adds the
#   *carry* (one running total per column, `BLOCK_INNER` values in registers), stores the tile into
#   the contiguous result and adds the tile's column sums to the carry. That is chapter 02's state
#   carried from chunk to chunk, here down `BLOCK_INNER` columns at once;
# * neighbouring lanes read neighbouring columns, which for a tensor whose last dimensions are dense
#   are neighbouring addresses: the loads are coalesced (chapter 00), whole 32-byte sectors.
#   `BLOCK_INNER` is at most 16, so that a tile row fills at least one sector in every dtype (16 x 2
#   bytes) while a wide `inner` still gives many programs; the rows of the tile make it `COLUMN_TILE`
#   values in all, like the row kernels' block;
# * the sums are accumulated in `ACC`, as in the row kernels, and cast to the result's dtype on store;
#   the offsets are 64-bit, since `outer x length x inner` and positions times strides can pass $2^{31}$.
#
# It reads every value once and writes it once, as the row kernels do on rows: no copy in, no copy
# back. Its parallelism is the number of programs, `outer x ceil(inner / BLOCK_INNER)`, each of which
# walks all of `length` in order. `cumsum` (`cumsum_op`, next section) therefore takes it only where
# that suffices, and otherwise the copy path of the previous section, whose row kernels split a long
# row across many programs (the look-back):
#
# * `inner > 1`. With `inner == 1` the scanned dimension is the last one that matters: for a
#   contiguous `x` these are rows already, which the row kernels scan with no copy at all (the `.contiguous()`
#   of the copy path returns `x` itself, and the result, in `x`'s shape, is rows too: `scan_copied`
#   copies back only where it is not). Along the last dimension of a non-contiguous `x` (a
#   transposed matrix, say) the values of one row are strided and the columns' lanes would have no
#   neighbours to read: each load would fetch a sector for one value. The copy path's transposing
#   copy reads such a view once, efficiently, and its result is already the answer's layout: one copy,
#   not two.
# * At least `MIN_COLUMNS` (4096) columns, `outer x inner`: at least 256 programs of 16 columns, about
#   two per SM of a 132-SM H100, so that every SM has loads in flight while each program walks its
#   columns. With few columns and a long `length` (a `(2**22, 4)` tensor along dim 0: one program
#   walking 4 million rows), the lanes would be full, but one SM would do all the work. The count is a
#   threshold on columns, not on `inner` alone: a `(65536, 64, 4)` tensor along dim 1 has only four
#   columns per outer index but 65536 programs.
# * Or a `length` of one tile (`BLOCK_L` rows or fewer): then no program walks, and one launch beats
#   three (copy, scan, copy back), however few the columns.
# * x views as `outer x length x inner` with one stride for each (`as_columns`): true of every
#   contiguous tensor and of many views (a slice or a step along the scanned dimension, a slice of the
#   first; a step or an `expand` along the first when the scan is along the second, a step along the
#   last when it is along the one before it); false where a slice, a step or a transpose leaves the
#   dimensions on one side of `dim` with strides that do not chain, as `x[:, ::2]` along dim 0 of a 3-D
#   `x`. The kernel would then need a stride per dimension; the copy path is taken instead.
#   `as_columns` checks the strides before it views: a `view` that fails raises an exception, which
#   costs more host time than a launch.
# * Fewer than $2^{31}$ programs, the most a grid holds: only a huge `outer` of very short scans
#   (`(2**31, 1, 2)` along dim 1) has more, and the row kernels take many of those in one program.
#
# The GPU timing of "what the copies along a dimension but the last cost" below compares the two
# paths on the same tensors.

# %%
#| export
COLUMN_WIDTH = 16     # BLOCK_INNER at most: a tile row fills a 32-byte sector even in 16-bit dtypes
COLUMN_TILE = 4096    # values per tile of the column scan, BLOCK_L x BLOCK_INNER
MIN_COLUMNS = 4096    # outer x inner below which long scans take the copy path (256 programs of 16 columns)


@triton.jit
def scan_columns_kernel(X, Y, length, inner, column_blocks, stride_outer, stride_length, stride_inner,
                        BLOCK_L: tl.constexpr, BLOCK_INNER: tl.constexpr, ACC: tl.constexpr):
    """Scan X (outer x length x inner, at its strides) along its middle dimension into Y (the same shape,
    contiguous). A program takes BLOCK_INNER consecutive columns of one outer index and walks down length
    BLOCK_L rows at a time, carrying each column's running total."""
    pid = tl.program_id(0)                                                      # o * column_blocks + j
    o = (pid // column_blocks).to(tl.int64)
    cols = (pid % column_blocks).to(tl.int64) * BLOCK_INNER + tl.arange(0, BLOCK_INNER)[None, :]   # 1 x BLOCK_INNER
    rows = tl.arange(0, BLOCK_L)[:, None]                                       # BLOCK_L x 1
    X_COLS = X + o * stride_outer + cols * stride_inner                         # 1 x BLOCK_INNER pointers
    Y_COLS = Y + o * length * inner + cols
    carry = tl.zeros((1, BLOCK_INNER), ACC)                                     # sums of the rows done
    for start in range(0, length, BLOCK_L):
        t = (start + rows).to(tl.int64)                                         # BLOCK_L x 1 positions
        mask = (t < length) & (cols < inner)                                    # BLOCK_L x BLOCK_INNER
        x = tl.load(X_COLS + t * stride_length, mask=mask, other=0).to(ACC)
        tl.store(Y_COLS + t * inner, (tl.cumsum(x, 0) + carry).to(Y.dtype.element_ty), mask=mask)
        carry += tl.sum(x, 0, keep_dims=True)


def column_tile(length: int, inner: int, tile: int = COLUMN_TILE) -> tuple[int, int]:
    """(BLOCK_L, BLOCK_INNER) of the column scan: up to COLUMN_WIDTH columns, `tile` values, rows no more
    than length needs."""
    width = min(COLUMN_WIDTH, next_power_of_2(inner))
    return min(tile // width, next_power_of_2(length)), width


def scan_columns(x: torch.Tensor, out: torch.Tensor | None = None, tile: int = COLUMN_TILE) -> torch.Tensor:
    """Inclusive cumulative sum of x (outer x length x inner, any strides, one of KERNEL_DTYPES) along its
    middle dimension, read in place, into a contiguous tensor of x's shape and dtype (`out` if given), in
    tiles of `tile` values (a power of two, at least COLUMN_WIDTH)."""
    if not is_power_of_two(tile) or tile < COLUMN_WIDTH:
        raise ValueError(f"tile must be a power of two >= {COLUMN_WIDTH}, got {tile}")
    outer, length, inner = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if x.numel() == 0:
        return y
    block_l, block_inner = column_tile(length, inner, tile)
    column_blocks = cdiv(inner, block_inner)
    scan_columns_kernel[(outer * column_blocks,)](
        x, y, length, inner, column_blocks, *x.stride(), BLOCK_L=block_l, BLOCK_INNER=block_inner,
        ACC=tl_dtype(accumulator(x.dtype)), num_warps=warps_for(block_l * block_inner))
    return y


def column_shape(shape: torch.Size, dim: int) -> tuple[int, int, int]:
    """(outer, length, inner) of a tensor of `shape` scanned along dim: the dims before it, dim, those after."""
    d = dim % len(shape)
    return shape[:d].numel(), shape[d], shape[d + 1:].numel()


def chain(sizes: torch.Size, strides: tuple[int, ...]) -> bool:
    """Whether dims (sizes, strides) merge into one with a single stride: each one's stride is the next
    one's times the next one's size, dims of size 1 aside (their stride is never used)."""
    dims = [(size, stride) for size, stride in zip(sizes, strides) if size != 1]
    return all(stride == size * next_stride for (_, stride), (size, next_stride) in zip(dims, dims[1:]))


def as_columns(x: torch.Tensor, dim: int) -> torch.Tensor | None:
    """x viewed as outer x length x inner (length: dim, outer: the dims before it, inner: those after), or
    None where the dims before dim, or those after it, cannot share one stride (the view would need a copy).
    Checked before viewing: a failing x.view raises, which costs more host time than the whole launch."""
    d = dim % x.dim()
    shape, strides = x.shape, x.stride()
    if not (chain(shape[:d], strides[:d]) and chain(shape[d + 1:], strides[d + 1:])):
        return None
    return x.view(*column_shape(shape, d))


def takes_columns(outer: int, length: int, inner: int) -> bool:
    """Whether cumsum scans columns in place rather than copying into rows: more than one column per
    outer index, and enough columns to give every SM programs, or a length of one tile; and fewer
    programs than a grid holds (2^31 - 1), which a huge outer of very short scans could pass."""
    if inner == 1:
        return False
    block_l, block_inner = column_tile(length, inner)
    return (outer * inner >= MIN_COLUMNS or length <= block_l) and outer * cdiv(inner, block_inner) < 2**31

# %% [markdown]
# Checked on the CPU against `torch.cumsum`, through `scan_columns` itself (the shapes here are too
# small for `cumsum` to choose it), along each dimension of a dense `(3, 37, 5)` tensor, of a view with
# steps and of an `expand` (a stride of 0): integers exactly, floats within the chapter's tolerance.
# Tiles of 256 values (16 rows of 16 columns at most) make the 37 rows take three tiles, so that the
# carry is used. Where a view's outer or inner dimensions do not share one stride, `as_columns` says so
# (None) and `cumsum` would take the copy path.

# %%
def awkward_views(dtype: torch.dtype) -> dict:
    """A dense (3, 37, 5) tensor, a view with steps of a (6, 37, 40) one, an expand: values of about 1000."""
    make = lambda *shape: (torch.randn(shape, device=DEVICE) * 1000).to(dtype)   # noqa: E731
    return {"(3, 37, 5)": make(3, 37, 5),
            "(6, 37, 40)[::2, :, 3::7]": make(6, 37, 40)[::2, :, 3::7],         # strides (2960, 40, 7)
            "(1, 37, 5).expand(3, 37, 5)": make(1, 37, 5).expand(3, 37, 5)}     # strides (0, 5, 1)


torch.manual_seed(9)
x_floats, x_longs = awkward_views(torch.float32), awkward_views(torch.int64)
for name in x_floats:
    for dim in range(3):
        x_view, x_long = x_floats[name], x_longs[name]
        columns = as_columns(x_view, dim)
        if columns is None:
            print(f"{name:>28} dim {dim}: no single-stride outer x length x inner view: the copy path")
            continue
        err = assert_cumsum(scan_columns(columns, tile=256).view(x_view.shape), x_view, dim)
        y_long = scan_columns(as_columns(x_long, dim), tile=256).view(x_long.shape)
        assert torch.equal(y_long, torch.cumsum(x_long, dim))
        print(f"{name:>28} dim {dim}: {tuple(columns.shape)} at strides {columns.stride()}, "
              f"float32 scaled err {err:.1e}, int64 exact")

# %% [markdown]
# ## Going deeper: `cumsum` as a PyTorch op
#
# The public function around `scan_rows` (and `scan_columns`), as the main line describes it: it follows `torch.cumsum`, and
# its gradient, the reverse cumulative sum, is a flip, the same scan, a flip back. How it is wrapped
# follows the code.

# %%
#| export
INTEGER_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
RESULT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64) + INTEGER_DTYPES[1:]


@custom_op("cumsum", __name__)
def cumsum_op(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The kernels on a tensor of KERNEL_DTYPES along dim (negative): a fresh contiguous tensor of x's shape.
    Along a dim but the last, the column scan reads x in place where takes_columns says it pays; else
    scan_copied. (dim == -1 is tested first: it never takes the column scan, and it is the common call.)"""
    if x.dim() == 0 or x.numel() == 0:
        return x.clone(memory_format=torch.contiguous_format)
    columns = None
    if dim != -1 and takes_columns(*column_shape(x.shape, dim)):
        columns = as_columns(x, dim)                                      # outer x length x inner, or None
    if columns is None:
        return scan_copied(x, dim)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    scan_columns(columns, out=y.view(*columns.shape))
    return y


def scan_copied(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The row kernels on x copied into rows (... x length; no copy if x is already so), the result
    copied back into x's shape unless that shape is already rows: dim is the last, or those after it
    have size 1."""
    moved = x.movedim(dim, -1).contiguous()                               # ... x length
    length = moved.shape[-1]
    rows_only = dim == -1 or x.shape[dim + 1:].numel() == 1               # x's shape, contiguous, is rows
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if rows_only else torch.empty_like(moved)
    scan_rows(moved.view(-1, length), out=y.view(-1, length))             # n_rows x length
    if rows_only:
        return y
    return y.movedim(-1, dim).clone(memory_format=torch.contiguous_format)   # the copy back


@cumsum_op.register_fake
def _(x, dim):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _cumsum_vmap(info, in_dims, x, dim):
    """dim is negative, so it still names the same dimension after the batch dimension moves to the front."""
    if in_dims[0] is None:
        return cumsum_op(x, dim), None
    return cumsum_op(x.movedim(in_dims[0], 0), dim), 0


cumsum_op.register_vmap(_cumsum_vmap)


class CumsumFunction(torch.autograd.Function):
    """Autograd for cumsum_op: the gradient of a scan is the reverse scan, computed by this Function
    again, so that it is differentiable in turn (twice, or more)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, dim):
        return cumsum_op(x, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.dim = inputs[1]

    @staticmethod
    def backward(ctx, grad_y):
        return apply(CumsumFunction, grad_y.flip(ctx.dim), ctx.dim).flip(ctx.dim), None


def cumsum(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inclusive cumulative sum of `x` along `dim`, like torch.cumsum, computed by Triton kernels.

    x: a floating, integer or bool tensor (any shape, 0-dim included) on the GPU, or on the CPU under
    Triton's interpreter. The result has x's shape, is contiguous and has dtype `dtype` if given
    (x is cast to it first, as torch.cumsum does), else x's dtype, or int64 for integer and bool x.
    Floating sums are accumulated in float32 (float64 for float64), integer sums in int64 (wrapping on
    overflow, then cast to the result dtype). Differentiable, twice or more, and usable under
    torch.func.grad, torch.func.vmap and torch.compile. The algorithm for long rows is chosen by the
    module-level CONFIG (see scan_rows); along a dim but the last, x is read in place where it has
    enough columns (see cumsum_op)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in RESULT_DTYPES + (torch.bool,):
        raise TypeError(f"x must be a floating, integer or bool tensor, got {x.dtype}")
    if dtype is not None and dtype not in RESULT_DTYPES:
        raise TypeError(f"dtype must be None or one of {', '.join(str(d) for d in RESULT_DTYPES)}, got {dtype}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    ndim = max(x.dim(), 1)                                                # a 0-dim tensor has dims -1 and 0
    if not -ndim <= dim < ndim:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    check_same_device(x=x)
    result = dtype or (torch.int64 if x.dtype in INTEGER_DTYPES else x.dtype)
    x = x.to(result)                                                      # torch.cumsum casts first, too
    dim = dim % ndim - ndim                                               # negative: survives a vmap batch dim
    if x.dim() == 0:
        return x.clone()
    if not x.is_floating_point():
        return cumsum_op(x.to(torch.int64), dim).to(result)          # integers are summed in int64
    return apply(CumsumFunction, x, dim)

# %% [markdown]
# * `cumsum_op` is a custom op (`torch.library.custom_op`, through `scan_lib.runtime.custom_op`):
#   `torch.compile` treats it as one opaque node instead of tracing into Triton's launcher, its *fake*
#   version gives the result's shape and dtype without running a kernel (what the compiler traces
#   with), and its *vmap* rule moves the batch dimension to the front, where the op treats it as one
#   more row. `dim` is kept negative, so it names the same dimension once a batch dimension is added.
# * `CumsumFunction` gives the op its gradient. It uses the `forward` + `setup_context` form, which
#   `torch.func.grad` and `vmap` require, and `generate_vmap_rule = True`. Its backward calls
#   `CumsumFunction` again (on the flipped gradient), so the backward is itself differentiable:
#   `gradgradcheck` and Hessians come out right, as the checks below and `tests/test_cumsum.py` show.
# * The op returns a fresh tensor, never a view of its input or of a temporary, so that users may
#   modify the result in place under autograd.

# %% [markdown]
# ## Going deeper: checking the exported `cumsum`
#
# The main line checked the three-phase scan; here the exported code is checked. First `scan_rows`,
# both algorithms at awkward lengths, with blocks small enough that 4097 values span many of them,
# then a batch of rows (a look-back must not run into the previous row):

# %%
torch.manual_seed(6)
block_sizes = (16, 128, 1024) if not ON_GPU else (256, 1024, 4096)
print(f"{'algorithm':>16} {'L':>5} " + " ".join(f"{'block=' + str(b):>10}" for b in block_sizes))
for algorithm in ALGORITHMS:
    for length in (1, 7, 129, 1000, 4097):
        x_rows = torch.randn(1, length, device=DEVICE)
        errors = [assert_cumsum(scan_rows(x_rows, algorithm=algorithm, block=b), x_rows) for b in block_sizes]
        print(f"{algorithm:>16} {length:>5} " + " ".join(f"{e:>10.1e}" for e in errors))
    x_batch = torch.randn(3, 1000, device=DEVICE) + torch.arange(3, device=DEVICE)[:, None] * 100
    for window in (1, 4, 32):
        assert_cumsum(scan_rows(x_batch, algorithm=algorithm, block=16, window=window), x_batch)
print("3 rows x 1000 values in blocks of 16, windows 1, 4, 32: ok")

# %% [markdown]
# Then the public function in every floating dtype along every kind of dim, and its gradient:

# %%
torch.manual_seed(7)
print(f"{'dtype':>15} {'shape':>16} {'dim':>3} {'scaled err':>10} {'tolerance':>9}")
for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
    for shape, dim in (((3, 1000), -1), ((5, 37, 2), 1), ((129, 3), 0), ((2, 3, 4097), 2)):
        x_any = torch.randn(shape, device=DEVICE, dtype=dtype)
        y_any = cumsum(x_any, dim=dim)
        assert y_any.is_contiguous()
        err = assert_cumsum(y_any, x_any, dim)
        print(f"{str(dtype):>15} {str(shape):>16} {dim:>3} {err:>10.1e} {scan_tolerance(dtype, shape[dim]):>9.1e}")
x_grad = torch.randn(3, 7, device=DEVICE, dtype=torch.float64, requires_grad=True)
assert torch.autograd.gradcheck(lambda t: cumsum(t, dim=0), (x_grad,), fast_mode=False)
assert torch.autograd.gradgradcheck(lambda t: cumsum(t, dim=1), (x_grad,))
print("gradcheck, gradgradcheck: ok")

# %% [markdown]
# Then the rest of what makes `cumsum` behave like `torch.cumsum`: integer and bool inputs (exact, so
# compared with `torch.equal`), `dtype=`, 0-dim and empty tensors, non-contiguous inputs, a contiguous
# result when `dim` is not the last, and bad input raising the exception `torch.cumsum` raises.

# %%
torch.manual_seed(8)
x_int = torch.randint(-2**40, 2**40, (3, 2000), device=DEVICE)
for x_like, dim in ((x_int, 1), (x_int.int(), 0), (torch.rand(4, 100, device=DEVICE) < 0.5, 1)):
    y_like = cumsum(x_like, dim=dim)
    assert y_like.dtype == torch.int64 and torch.equal(y_like, torch.cumsum(x_like, dim))
x_half = torch.randn(3, 500, device=DEVICE, dtype=torch.float16)
assert torch.equal(cumsum(x_half, dtype=torch.float64), torch.cumsum(x_half, -1, dtype=torch.float64))
assert torch.equal(cumsum(x_int, dim=1, dtype=torch.int8), torch.cumsum(x_int, 1, dtype=torch.int8))   # wraps like torch
x_scalar = torch.tensor(2.5, device=DEVICE)
assert torch.equal(cumsum(x_scalar, dim=0), torch.cumsum(x_scalar, 0))
assert cumsum(torch.empty(3, 0, device=DEVICE)).shape == (3, 0)
x_t = torch.randn(40, 30, device=DEVICE).t()                             # 30 x 40, not contiguous
assert_cumsum(cumsum(x_t, dim=1), x_t, 1)
y_dim0 = cumsum(torch.randn(6, 7, device=DEVICE), dim=0)
assert y_dim0.is_contiguous() and y_dim0.view(-1).shape == (42,)
print("integers, bool, dtype=, 0-dim, empty, non-contiguous, contiguous result: ok")

bad_inputs = [
    (lambda: cumsum([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
    (lambda: cumsum(torch.ones(3, dtype=torch.complex64, device=DEVICE)), TypeError, "x must be a floating, integer or bool"),
    (lambda: cumsum(torch.ones(2, 3, device=DEVICE), dim=2), IndexError, "Dimension out of range"),
    (lambda: cumsum(torch.tensor(1.0, device=DEVICE), dim=1), IndexError, "Dimension out of range"),
    (lambda: cumsum(torch.ones(2, 3, device=DEVICE), dim=1.0), TypeError, "dim must be an int"),
    (lambda: cumsum(torch.ones(3, device=DEVICE), dtype=torch.bool), TypeError, "dtype must be None or one of"),
    (lambda: scan_rows(torch.ones(2, 3, device=DEVICE), block=24), ValueError, "block must be a power of two"),
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
# ## Going deeper: what the copies along a dimension but the last cost
#
# ("The exported kernels' layout" says why they are made.) On a GPU, the cell times `cumsum` of one
# (4096, 4096) float32 tensor along its last dimension, then along its first two ways: the copy path
# (`scan_copied`, called directly) and, alone, its two copies, into rows and back; and the column scan
# that `cumsum` now takes there, which reads the tensor in place. Reading in place can save at most the
# copies' time.
#
# On the copy path, which `cumsum` took along every dimension but the last before the column scan,
# the copies are most of the cost: it takes 326.9 us against 81.3 along the last dimension, and its
# two copies alone 142.4 and 141.8 us of it. Each copy, which reads and writes every value once, as
# the scan does, takes longer than the whole scan along the last dimension: there `cumsum` pays mostly
# for its layout, not for scanning. The column scan wins all of that back: `cumsum` along the first
# dimension takes 72.1 us, and the column scan called alone, without `cumsum`'s checks and choice of
# path, 72.6. In this run that is even a little shorter than the 81.3 along the last dimension; the
# output does not say why, and the two differ in parallelism, which it does not isolate: along the
# first dimension 256 programs of 16 columns each walk all 4096 rows in order, where along the last
# each of the 4096 rows is one program.
#
# Its last two rows test the threshold of "scanning along a dimension but the last, in place": a
# (2^22, 4) tensor along its first dimension has 4 columns, fewer than `MIN_COLUMNS`, so `cumsum` takes
# the copy path there (234.7 us); the column scan called directly, one program walking 2^22 rows,
# takes 9352.1 us.

# %%
from scan_lib.runtime import median_us   # chapter 00's timer

if not ON_GPU:
    print("skipped: needs a GPU")
else:
    square = torch.randn(4096, 4096, device=DEVICE)
    skinny = torch.randn(2**22, 4, device=DEVICE)
    calls = {"cumsum along the last dim": lambda: cumsum(square, dim=-1),
             "cumsum along the first dim": lambda: cumsum(square, dim=0),
             "  the column scan alone": lambda: scan_columns(as_columns(square, -2)),
             "  the copy path instead": lambda: scan_copied(square, -2),
             "    its copy into rows": lambda: square.movedim(0, -1).contiguous(),
             "    its copy back": lambda: square.movedim(-1, 0).clone(memory_format=torch.contiguous_format),
             "(2^22, 4), cumsum along dim 0": lambda: cumsum(skinny, dim=0),
             "  the column scan instead": lambda: scan_columns(as_columns(skinny, -2))}
    print(f"(4096, 4096) float32 unless said, on {torch.cuda.get_device_name()}, median us (do_bench):")
    print(f"  (along the first dim, cumsum takes the column scan: {takes_columns(*as_columns(square, -2).shape)}; "
          f"on (2^22, 4): {takes_columns(*as_columns(skinny, -2).shape)})")
    for name, call in calls.items():
        print(f"  {name:32s} {median_us(call):8.1f}")

# %% [markdown]
# ## Going deeper: what the checks guard against
#
# * Since the CPU interpreter folds `tl.associative_scan` left to right, associativity is tested on
#   its own, in plain PyTorch, in `tests/test_cumsum.py`.
# * Without a GPU the three-phase check's blocks start at 16, and 4097 values give 257 totals, then
#   17, then 2 (three levels).
# * The check of both algorithms uses blocks small enough that 4097 values give a chain of tiles to
#   look back over, and totals that pass 2 walks in chunks.
#
# `tests/test_cumsum.py` runs the checks of this chapter and more (random shapes, `torch.func.grad`,
# `vmap`, `torch.compile(fullgraph=True)`, Hessians), and injects the bugs they guard against (a skipped
# carry, a look-back past its row, float16 accumulation, non-associative combines) to show each fails.

# %% [markdown]
# ## Going deeper: launch configuration and tuning
#
# * `block`: values per program on long rows. Larger blocks mean fewer carries and fewer tiles to
#   look back over, but more registers per program. Under the interpreter few large programs run
#   fastest, hence the separate CPU default.
# * `num_warps`: how many warps (groups of 32 threads) run one program; `warps_for` picks it for
#   short rows (about 16 values per thread).
# * `window`: how many predecessors one look-back step reads; a wider window finds a PREFIX in fewer
#   trips but loads more words per trip.
# * `reverse`: when True, pass 3 of reduce-then-scan runs its programs from the last block to the
#   first. Pass 1 finished at the end of the tensor, so part of its tail may still sit in the L2
#   cache when pass 3 starts. Any order is correct, since pass 3's programs are independent.
# * Rows no longer than one block take `scan_short_rows`: one launch in which each program scans a
#   tile of `ROWS` whole rows, so that a batch of many short rows does not become millions of tiny
#   programs.
#
# `CONFIG` holds the fastest correct configuration of `benchmarks/bench_cumsum.py`'s sweep on an
# H200; its output is kept in `benchmarks/results/bench_cumsum_h200.txt` (the sweep lines show every
# configuration it tried, both pass-3 orders included). Run the script on another GPU to retune.

# %% [markdown]
# ## Going deeper: the benchmark, in a picture, and where the time goes at small sizes
#
# The measurement behind the main line's speed section, and what its table does not say at small
# sizes. `cumsum` (the look-back) against `torch.cumsum`, reduce-then-scan and the three-phase scan, on
# 1-D float32 inputs of $2^{10}$ to $2^{27}$ values: the median of `triton.testing.do_bench`, what a
# user waits for once the GPU sets the pace (while the host does, a lower bound: the end of this
# section measures it). The memory floor is the $2L$ words a cumulative sum must move, at the copy
# bandwidth measured in the same cell. Up to $L = 2^{12}$ two of the columns time the same kernel
# (said below the table).

# %%
from scan_lib.runtime import copy_bandwidth, graph_us, host_us, median_us  # the timers of chapter 00

BENCH_SIZES = [2**k for k in range(10, 28)]


def benchmark_cumsum() -> dict:
    gpu = torch.cuda.get_device_name(DEVICE)
    copy_gbs = copy_bandwidth() / 1e9
    print(f"{gpu}: copy bandwidth {copy_gbs:.0f} GB/s (1 GiB float32 copy_); CONFIG {CONFIG}")
    methods = {"torch.cumsum": lambda x: torch.cumsum(x, 0),
               "cumsum (look-back)": lambda x: cumsum(x),
               "reduce-then-scan": lambda x: scan_rows(x[None], algorithm="reduce_then_scan")[0],
               "three-phase (4L)": lambda x: cumsum_three_phase(x, 1024)}
    times = {name: [] for name in methods}
    floors = []
    print(f"{'L':>10} {'floor':>7} " + " ".join(f"{name:>18}" for name in methods) + "   (median us, float32)")
    for length in BENCH_SIZES:
        x = torch.randn(length, device=DEVICE)
        floors.append(2 * length * 4 / copy_gbs / 1e3)
        for name, fn in methods.items():
            assert_cumsum(fn(x), x)
            times[name].append(median_us(lambda: fn(x)))
        print(f"{length:>10} {floors[-1]:>7.1f} " + " ".join(f"{times[name][-1]:>18.1f}" for name in methods))
    ours, theirs = times["cumsum (look-back)"], times["torch.cumsum"]
    ahead = [i for i in range(len(BENCH_SIZES)) if all(ours[j] < theirs[j] for j in range(i, len(BENCH_SIZES)))]
    if ahead:
        print(f"cumsum is faster than torch.cumsum from L = 2^{int(math.log2(BENCH_SIZES[ahead[0]]))} up")
    else:
        print("cumsum is slower than torch.cumsum at the largest size measured")
    for i in (BENCH_SIZES.index(2**25), len(BENCH_SIZES) - 1):
        print(f"L = 2^{int(math.log2(BENCH_SIZES[i]))}: torch.cumsum / cumsum = {theirs[i] / ours[i]:.2f}; "
              + ", ".join(f"{name} {times[name][i] / floors[i]:.2f}x" for name in methods) + " the memory floor")
    return {"gpu": gpu, "times": times, "floors": floors}


if ON_GPU:
    bench = benchmark_cumsum()
else:
    print("skipped: no GPU (do_bench needs one)")

# %% [markdown]
# Two column labels of the table hold only for rows longer than one block (`CONFIG["block"]`,
# 4096 on a GPU): up to $L = 2^{12}$ `scan_rows` sends both `cumsum` and the reduce-then-scan call to
# `scan_short_rows`, one launch of `scan_tiles_kernel`, so those two columns time the same kernel
# behind different Python. The three-phase column, in blocks of 1024, is one launch at $2^{10}$ and
# three or more from $2^{11}$.
#
# The speed cell prints its conclusions from its measurements; its line "faster than torch.cumsum
# from L = 2^22 up" means at every size from there to the largest measured, $2^{27}$: the table says
# nothing about longer inputs. Below $2^{22}$ `torch.cumsum` is faster or level at every size but
# $2^{16}$ (8.9 us against 9.1), by far at some: at $2^{10}$ `cumsum` takes 69.3 us against 7.8, at
# $2^{21}$ 42.8 against 30.7. Those medians do not measure the look-back kernel: the table at the end
# of this section times `cumsum`'s GPU work alone at 1.4 us at $2^{10}$ and 5.9 at $2^{19}$, and the
# same calls' medians there at 4.5 and 11.5. The gap is not the kernel's work; those calls are
# host-bound (end of this section), so it is most likely host time that `do_bench`'s L2 flush did not
# hide. The other columns show the same: they step down here and there between neighbouring sizes,
# where the kernels' work only grows with $L$ (reduce-then-scan takes 69.9 us at $2^{13}$ and 11.0 at
# $2^{14}$, 98.0 at $2^{17}$ and 13.2 at $2^{18}$; the three-phase scan 64.0 at $2^{17}$ and 10.3 at
# $2^{18}$). How much host time reaches a median varies from call to call, for reasons one run cannot
# pin down.
#
# The table, plotted: times, and the fraction of the memory floor each method reaches.

# %%
def plot_benchmark(gpu: str, times: dict, floors: list) -> None:
    fig, (ax_time, ax_floor) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, ts in times.items():
        ax_time.loglog(BENCH_SIZES, ts, "o-", ms=3, label=name)
        ax_floor.semilogx(BENCH_SIZES, [f / t for f, t in zip(floors, ts)], "o-", ms=3, label=name)
    measured = [t for ts in times.values() for t in ts]
    ax_time.loglog(BENCH_SIZES, floors, "k--", label="memory floor")
    ax_time.set_ylim(min(measured) / 1.5, max(measured) * 1.5)          # the floor runs off the bottom at small L
    ax_floor.axhline(1.0, color="k", ls="--")
    ax_time.set(xlabel="L (float32 values)", ylabel="median time (us)", title=f"cumsum on {gpu}")
    ax_floor.set(xlabel="L (float32 values)", ylabel="floor / time", ylim=(0, 1.05),
                 title="fraction of the memory floor reached")
    for ax in (ax_time, ax_floor):
        ax.grid(True, which="both", alpha=0.3)
    ax_time.legend(fontsize=7)
    save_figure(fig, "cumsum_benchmark.png")


if ON_GPU:
    plot_benchmark(**bench)
else:
    print("skipped: no GPU")

# %% [markdown]
# `do_bench`'s median includes the host's time per call (Python and the launches) whenever the GPU
# runs out of queued work. Two more timers from chapter 00 split it: the GPU time alone (`graph_us`: a
# CUDA graph replays the launches with no Python in between) and the host time per call (`host_us`:
# calls queued back to back, timed on the CPU). When the host time exceeds the GPU time, the call is
# host-bound: in the table below, every size up to $2^{22}$ (all but the two largest), and at
# $2^{10}$ the host time alone, 50.8 us, is many times `torch.cumsum`'s whole median, 8.2. A call
# makes one Triton launch (rows of at most 4096 values) or a `torch.zeros` and one launch (the
# look-back), yet at those sizes its host time is 50.8 to 82.6 us in this run, several times the
# host time of one bare launch of `vector_add_kernel` (chapter 00's table, its `host_us` column at
# $2^{14}$). So most of the host time per call is not the launch itself; it goes to what `cumsum`
# runs around its launch: the input checks, `apply` (which, when nothing needs a gradient, runs the autograd
# Function's forward alone), the reshaping in `cumsum_op`, the configuration in `scan_rows`, and a
# launch that binds more arguments than `vector_add_kernel`'s (the custom op's dispatcher is not
# among them: for tensors that need no gradient, `EagerFastOp` calls the implementation directly).
# These outputs do not split the host time among those layers, and the speed table cannot rank them:
# at $L = 2^{10}$, where each of its columns is a single launch, its medians (`cumsum` 69.3 us,
# reduce-then-scan 21.0, the three-phase scan 6.9, `torch.cumsum` 7.8) spread far wider than one
# launch's GPU time (1.4 us for `cumsum` in the table below): how much of the host time reaches a
# median varies from call to call (next paragraph). Fewer Python layers per
# call, CUDA graphs (they replay the launches with no Python in between) or a C++ launcher make such
# calls faster; cutting the library's host path further is open work.
#
# One more thing the table below shows: at every size up to $2^{22}$ (all but the two largest), the
# `median` column is below the `host` column, although a host-bound call cannot finish before the host
# has queued it. `do_bench` queues its L2 flush before each call's start event, so the GPU stamps that
# event only when the flush is done, and the host's work for the call runs meanwhile: part of the host
# time hides under the flush. How much is not fixed: at $2^{13}$ the median is 31.5 us against 3.8
# of GPU time alone, where the speed table measured the same call at 63.0, and at $2^{10}$ the speed
# table measured 69.3 where the median below is 4.5. `host_us` is therefore the measure of host
# time, and `do_bench`'s median a lower bound of what a host-bound call costs when called back to
# back, one that varies from call to call.

# %%
def time_split() -> None:
    print(f"{'L':>10} {'median':>8} {'GPU only':>8} {'host':>8} {'torch':>8}   (us; cumsum unless 'torch')")
    for length in BENCH_SIZES[::3] + [BENCH_SIZES[-1]]:
        x = torch.randn(length, device=DEVICE)
        median, gpu_only, host = median_us(lambda: cumsum(x)), graph_us(lambda: cumsum(x)), host_us(lambda: cumsum(x))
        print(f"{length:>10} {median:>8.1f} {gpu_only:>8.1f} {host:>8.1f} {median_us(lambda: torch.cumsum(x, 0)):>8.1f}"
              + ("   host-bound" if host > gpu_only else ""))


if ON_GPU:
    time_split()
else:
    print("skipped: no GPU (CUDA graphs and do_bench need one)")

# %% [markdown]
# ## References
#
# - Blelloch, "Prefix sums and their applications", CMU-CS-90-190, 1990 (scans, the up-sweep/down-sweep tree, and first-order recurrences as scans of pairs).
# - Hillis and Steele, "Data parallel algorithms", Communications of the ACM 29(12), 1986.
# - Harris, Sengupta and Owens, "Parallel prefix sum (scan) with CUDA", GPU Gems 3, chapter 39, 2007.
# - Merrill and Garland, "Single-pass parallel prefix scan with decoupled look-back", NVIDIA technical report NVR-2016-002, 2016.
# - NVIDIA CUB, the device-wide scan built on that look-back: https://nvidia.github.io/cccl/cub/
# - Sasha Rush, "Mamba: The Hard Way" (a Triton notebook from cumulative sums to the selective scan; part 1): https://srush.github.io/annotated-mamba/hard.html
