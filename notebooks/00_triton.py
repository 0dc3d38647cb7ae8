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
# # 00 · Triton in one sitting
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/scan-course/scans-the-hard-way/blob/main/notebooks/00_triton.ipynb)

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

# %% [markdown]
# ## What this chapter teaches
#
# Triton is a small language, embedded in Python, for writing GPU kernels. A kernel *loads* blocks
# of numbers from GPU memory into registers, computes on whole blocks at once, and *stores* results
# back. There is no indexing of single elements and no Python inside: only block operations
# (`tl.load`, `tl.store`, arithmetic, `tl.sum`, `tl.associative_scan`, ...). Without a GPU, Triton's
# CPU interpreter runs every kernel of this course; the chapter ends with what it hides from you.
#
# ## The setup cell, opened up
#
# `import scan_lib` ran `scan_lib/runtime.py`, written from this chapter's cells marked `#| export`:
# without a CUDA GPU it sets `TRITON_INTERPRET=1` ("Going deeper: why the setup cell comes first"),
# and `describe()` prints where kernels will run. The chapter imports its helpers from that module, as
# later chapters do; their bodies are in the Going deeper sections named where each is used.

# %%
import re
import time

import numpy as np
import torch
import triton
import triton.language as tl

from scan_lib.runtime import INTERPRET, copy_bandwidth, gpu_assembly, median_us, save_figure

# %% [markdown]
# ## How a GPU runs a kernel
#
# Launching `kernel[grid](...)` runs `grid` copies of the kernel, called **programs** (CUDA: *thread
# blocks*, or CTAs), on the same arguments. Each program works on a **block**: a tile of values whose
# shape is fixed when the kernel is compiled.
#
# * An **SM** (streaming multiprocessor) is one of the GPU's many cores (the next cell prints how
#   many). Each program runs on one SM, several at once when its registers and shared memory allow.
#   Programs exchange values only through global memory (the GPU's main memory), and nothing orders
#   them unless the kernel itself does.
# * A **warp** is 32 **threads** (each with its own registers) that execute the same instruction
#   at the same time. A program has `num_warps` warps (a launch option, 4 by default); each thread
#   holds a few values of the block: 1024 float32 over 4 warps is 8 per thread, in two runs of 4
#   consecutive values, since 4 warps of 32 threads with 4 values each cover 512 values and then
#   repeat (the figure's thread 0 holds values 0-3 and 512-515).
# * Between threads, as in a sum or a scan, values move by **shuffles** (a thread reads a register of
#   another thread of its warp) and through **shared memory** (a small, fast memory of the SM).
#   `tl.sum` and `tl.associative_scan` do this for you.
#
# The figure draws both.

# %%
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

if ON_GPU:
    print(f"{torch.cuda.get_device_name(DEVICE)}: {torch.cuda.get_device_properties(DEVICE).multi_processor_count} SMs")
warp_colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
fig, (ax_grid, ax_block) = plt.subplots(1, 2, figsize=(7.5, 3.5), gridspec_kw={"width_ratios": [1, 1.4]})
for sm in range(4):                                        # left: grid = 8 programs, 4 SMs
    ax_grid.add_patch(Rectangle((sm * 1.1, 0), 1, 2.6, facecolor="0.92", edgecolor="0.3"))
    ax_grid.text(sm * 1.1 + 0.5, 2.35, f"SM {sm}", ha="center", fontsize=8)
    for slot, program in enumerate((sm, sm + 4)):
        ax_grid.add_patch(Rectangle((sm * 1.1 + 0.1, 0.2 + slot * 1.05), 0.8, 0.85, facecolor="white", edgecolor="0.3"))
        ax_grid.text(sm * 1.1 + 0.5, 0.62 + slot * 1.05, f"program\n{program}", ha="center", va="center", fontsize=6)
ax_grid.set_xlim(-0.1, 4.4); ax_grid.set_ylim(-0.1, 2.8); ax_grid.axis("off")
ax_grid.set_title("kernel[(8,)]: 8 programs on 4 SMs", fontsize=9)
for row in range(8):                                       # right: one block of 1024 float32
    warp = row % 4                                         # a row: 32 threads x 4 values; rows r and r + 4: 8 per thread
    for thread in range(32):
        ax_block.add_patch(Rectangle((thread * 4, 7 - row), 4, 0.8, facecolor=warp_colors[warp],
                                     edgecolor="white", linewidth=0.3, alpha=1.0 if thread else 0.55))
    ax_block.text(-3, 7.4 - row, f"{128 * row}-{128 * row + 127}", ha="right", va="center", fontsize=7)
    ax_block.text(131, 7.4 - row, f"warp {warp}", ha="left", va="center", fontsize=7, color=warp_colors[warp])
ax_block.annotate("thread 0 of warp 0:\nvalues 0-3 and 512-515", xy=(2, 7.4), xytext=(20, 8.6), fontsize=7,
                  arrowprops={"arrowstyle": "->", "linewidth": 0.6})
ax_block.annotate("", xy=(2, 3.4), xytext=(20, 8.5), arrowprops={"arrowstyle": "->", "linewidth": 0.6})
ax_block.text(64, -0.35, "one cell: the 4 consecutive values of one thread", ha="center", va="top", fontsize=7)
ax_block.set_xlim(-28, 156); ax_block.set_ylim(-1.2, 9.6); ax_block.axis("off")
ax_block.set_title("one program: BLOCK = 1024 float32, num_warps = 4\n(4 warps x 32 threads, 8 values each)", fontsize=9)
save_figure(fig, "00_programs_warps_threads.png")

# %% [markdown]
# ## Programs and program ids
#
# Each program asks `tl.program_id(0)` which one it is and picks its share of the work from that.
# A tensor argument arrives as a pointer to its first element, and `X + offsets` is a block of
# pointers (offsets count elements, not bytes).

# %%
@triton.jit
def which_program_kernel(OUT, BLOCK: tl.constexpr):
    pid = tl.program_id(0)                                # scalar: 0, 1, ..., grid - 1
    offsets = pid * BLOCK + tl.arange(0, BLOCK)           # BLOCK: this program's slots
    tl.store(OUT + offsets, tl.full((BLOCK,), pid, tl.int32))


programs, block = 4, 8
owner = torch.empty(programs * block, dtype=torch.int32, device=DEVICE)
which_program_kernel[(programs,)](owner, BLOCK=block)
assert torch.equal(owner.cpu(), torch.arange(programs, dtype=torch.int32).repeat_interleave(block))
print(owner.view(programs, block))

# %% [markdown]
# `tl.full(shape, value, dtype)` makes a block of one value. `BLOCK` is a `tl.constexpr`, known when
# the kernel is compiled, so it can set shapes, which must be compile-time constants; `tl.arange`
# lengths must be powers of two ("Going deeper: a block of 6" shows the refusal).
#
# ## `tl.arange`, shapes and broadcasting
#
# `tl.arange(0, K)` has shape `(K,)`; `[:, None]` or `[None, :]` adds an axis of length 1, and
# operations broadcast as in PyTorch. A **row-major** `ROWS x COLS` matrix stores its rows one after
# another, so a 2-D block of pointers into it is `Y + rows[:, None] * COLS + cols[None, :]`.

# %%
@triton.jit
def broadcast_add_kernel(X, Y, Z, ROWS: tl.constexpr, COLS: tl.constexpr):
    cols = tl.arange(0, COLS)                             # COLS
    rows = tl.arange(0, ROWS)[:, None]                    # ROWS x 1
    x = tl.load(X + cols)                                 # COLS
    y = tl.load(Y + rows * COLS + cols)                   # ROWS x COLS  (ROWS x 1 broadcast with COLS)
    tl.store(Z + rows * COLS + cols, x + y)               # ROWS x COLS  (COLS broadcast over the rows)


torch.manual_seed(0)
x_row, y_mat = torch.randn(4, device=DEVICE), torch.randn(8, 4, device=DEVICE)
z_mat = torch.empty(8, 4, device=DEVICE)
broadcast_add_kernel[(1,)](x_row, y_mat, z_mat, ROWS=8, COLS=4)
assert torch.equal(z_mat, x_row + y_mat)
print("Z = X[None, :] + Y, exactly as torch broadcasts: ok")

# %% [markdown]
# ## Loads and stores with masks
#
# A block has a power-of-two length, data rarely do. `tl.load(ptrs, mask=m, other=v)` reads only
# where `m` is true and puts `v` elsewhere; `tl.store(ptrs, values, mask=m)` writes only where `m`
# is true. From here on every load and store over data has a mask.
#
# ## A blocked kernel: vector addition of any length
#
# One program per block of `BLOCK` elements, `cdiv(n, BLOCK)` programs in all; the tail of the last
# block is masked off.

# %%
@triton.jit
def vector_add_kernel(X, Y, Z, n, BLOCK: tl.constexpr):
    ### BEGIN SOLUTION
    ### HINT: this program's BLOCK offsets (from its program id), a mask of those below n, masked loads of X and Y, a masked store of x + y to Z
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)    # BLOCK
    mask = offsets < n                                          # BLOCK
    x = tl.load(X + offsets, mask=mask)
    y = tl.load(Y + offsets, mask=mask)
    tl.store(Z + offsets, x + y, mask=mask)
    ### END SOLUTION


def vector_add(x: torch.Tensor, y: torch.Tensor, block: int = 256) -> torch.Tensor:
    z = torch.empty_like(x)
    vector_add_kernel[(triton.cdiv(x.numel(), block),)](x, y, z, x.numel(), BLOCK=block)
    return z


torch.manual_seed(1)
for n in (1, 7, 129, 1000, 4097):
    x_vec, y_vec = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    assert torch.equal(vector_add(x_vec, y_vec), x_vec + y_vec)
print("vector_add == x + y for n = 1, 7, 129, 1000, 4097 (BLOCK = 256)")

# %% [markdown]
# ## What `num_warps` changes
#
# `num_warps` (`kernel[grid](..., num_warps=8)`) changes how blocks are spread over threads, not
# what a kernel computes. The compiler states that spread as the block's **layout**. `gpu_assembly`
# compiles a kernel for an H100 or H200 on any machine, without running it, and returns the
# compiler's output by stage, down to the GPU's assembly (PTX); the stage `ttgir` holds the layout.
# The cell prints it for `vector_add_kernel` (BLOCK 1024) with 1, 4 and 8 warps.

# %%
vector_add_types = {"X": "*fp32", "Y": "*fp32", "Z": "*fp32", "n": "i32"}
layouts = {}
for num_warps in (1, 4, 8):
    ttgir = gpu_assembly(vector_add_kernel, vector_add_types, num_warps=num_warps, BLOCK=1024)["ttgir"]
    layouts[num_warps] = re.search(r"#ttg\.blocked<\{(.*?)\}>", ttgir).group(1)
    print(f"num_warps {num_warps}: {layouts[num_warps]}")

# %% [markdown]
# Each thread holds `sizePerThread` consecutive float32, each warp `threadsPerWarp` threads, each
# program `warpsPerCTA` warps; a layout smaller than the block repeats until it covers it. With 4
# warps that is 8 values per thread, as in the figure; with 8 warps, 4. "Going deeper: reading a
# layout, choosing `num_warps`" defines `gpu_assembly`, reads the rest of the layout and shows how
# `tl.sum` crosses warps.

# %% [markdown]
# ## Strides and contiguity
#
# A tensor is a flat piece of memory plus a shape and **strides**: `x.stride(d)` is how many
# elements to step in memory to move by one along dimension `d`, so element `[i, j]` sits at offset
# `i * x.stride(0) + j * x.stride(1)`. A row-major `3 x 4` matrix has strides `(4, 1)`; its
# transpose `m.t()` is a *view* of the same memory with strides `(1, 4)`, not **contiguous** (not
# laid out row after row). `.contiguous()` returns a contiguous tensor itself, otherwise a row-major
# copy.

# %%
m = torch.arange(12.0, device=DEVICE).view(3, 4)
m_t = m.t()
m_t_copy = m_t.contiguous()
for name, tensor in (("m", m), ("m.t()", m_t), ("m.t().contiguous()", m_t_copy)):
    print(f"{name:>18}: shape {tuple(tensor.shape)}, stride {tensor.stride()}, "
          f"contiguous {tensor.is_contiguous()}, shares m's memory {tensor.data_ptr() == m.data_ptr()}")
assert m.stride() == (4, 1) and m_t.stride() == (1, 4) and m_t_copy.stride() == (3, 1)
assert not m_t.is_contiguous() and m_t.data_ptr() == m.data_ptr() and m_t_copy.data_ptr() != m.data_ptr()
assert m.contiguous().data_ptr() == m.data_ptr()                      # already contiguous: no copy
flat = m.view(-1)                                                     # the memory, in order
assert all(m_t[i, j] == flat[i * m_t.stride(0) + j * m_t.stride(1)] for i in range(4) for j in range(3))
print("m.t()[i, j] is memory[i * 1 + j * 4]: ok")

# %% [markdown]
# A kernel sees only the pointer to the first element, so it must be given the strides and compute
# `row * stride_row + col * stride_col` itself. A kernel that assumes row-major reads a transposed
# view wrongly (the last lines below show it); one that takes strides reads any view in place,
# without a copy, as `copy_2d` does.

# %%
@triton.jit
def copy_2d_kernel(X, Y, n_rows, n_cols, stride_row, stride_col, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]                                # ROWS x 1
    cols = tl.arange(0, COLS)[None, :]                                # 1 x COLS
    ### BEGIN SOLUTION
    ### HINT: mask the ROWS x COLS block to the n_rows x n_cols matrix and load x through X's strides
    mask = (rows < n_rows) & (cols < n_cols)                          # ROWS x COLS
    x = tl.load(X + rows * stride_row + cols * stride_col, mask=mask)  # any strides
    ### END SOLUTION
    tl.store(Y + rows * n_cols + cols, x, mask=mask)                  # Y is contiguous: strides (n_cols, 1)


def copy_2d(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    copy_2d_kernel[(1,)](x, y, x.shape[0], x.shape[1], x.stride(0), x.stride(1),
                         ROWS=triton.next_power_of_2(x.shape[0]), COLS=triton.next_power_of_2(x.shape[1]))
    return y


assert torch.equal(copy_2d(m_t), m_t) and torch.equal(copy_2d(m), m)
assert torch.equal(copy_2d(m[:, ::2]), m[:, ::2])                    # every other column: strides (4, 2)
wrong = torch.empty(4, 3, device=DEVICE)                              # pretend m.t() were row-major
copy_2d_kernel[(1,)](m_t, wrong, 4, 3, 3, 1, ROWS=4, COLS=4)
assert not torch.equal(wrong, m_t)
print("copy_2d reads m.t() and m[:, ::2] through their strides: ok; assuming row-major reads m in order:")
print(wrong)

# %% [markdown]
# ## A blocked kernel with a loop: row sums over any length
#
# Each program owns one row, reached through its strides, and walks along it `BLOCK` columns at a
# time, carrying `BLOCK` partial sums in float32 registers; `tl.sum` adds them up at the end. The
# loop is a `while` (a `for` works too: "Going deeper: the interpreter and NumPy").

# %%
@triton.jit
def row_sums_kernel(X, OUT, n_cols, stride_row, stride_col, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)                 # BLOCK partial sums
    start = 0
    while start < n_cols:
        ### BEGIN SOLUTION
        ### HINT: the columns start .. start + BLOCK - 1 of this row, loaded through the strides (0 past n_cols), added into acc in float32
        cols = start + tl.arange(0, BLOCK)                     # BLOCK
        x = tl.load(X + row * stride_row + cols * stride_col, mask=cols < n_cols, other=0.0)
        acc += x.to(tl.float32)
        ### END SOLUTION
        start += BLOCK
    tl.store(OUT + row, tl.sum(acc, axis=0))


def row_sums(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    n_rows, n_cols = x.shape
    out = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    row_sums_kernel[(n_rows,)](x, out, n_cols, x.stride(0), x.stride(1), BLOCK=block)
    return out


torch.manual_seed(2)
print(f"{'shape':>10} {'layout':>10} {'max abs err':>11} {'bound':>8}")
for shape in ((3, 1), (5, 7), (2, 1000), (4, 4097)):
    for layout in ("row-major", "transposed"):
        x_mat = torch.randn(shape, device=DEVICE) if layout == "row-major" else torch.randn(shape[::-1], device=DEVICE).t()
        exact = x_mat.double().sum(1)
        err = (row_sums(x_mat).double() - exact).abs().max().item()
        bound = shape[1] ** 0.5 * 2**-24 * x_mat.double().abs().sum(1).max().item()   # see below
        assert err <= bound, (shape, layout, err, bound)
        print(f"{str(shape):>10} {layout:>10} {err:>11.1e} {bound:>8.1e}")

# %% [markdown]
# The bound is the usual size of the error of `n` float32 additions, $\sqrt{n}\,2^{-24}\sum|x|$
# (the roundings, each at most $2^{-24}$ relative, mostly cancel like a random walk); the transposed
# rows pass it too.
#
# ## Timing a kernel on a GPU
#
# A launch only *queues* the kernel, so `time.perf_counter()` around a launch measures the host, not
# the GPU. The GPU's time is measured with **CUDA events**, markers that the GPU stamps with its own
# clock. `median_us` calls `triton.testing.do_bench`: warm-up runs (the first launch compiles the
# kernel), the **L2 cache** flushed before each run, the median in microseconds. A kernel that moves
# `bytes` through memory needs about `bytes` over the memory bandwidth, which `copy_bandwidth`
# measures by copying 1 GiB: every benchmark of the course compares with this **memory floor**. Both
# are defined in "Going deeper: timing fine print", with two more timers that split host and GPU time.
#
# On a GPU, the cell times `vector_add`'s kernel and `torch.add` at a small and a large size against
# the memory floor (3 float32 of 4 bytes per element), and checks after each that the output holds
# `x + y`. Without a GPU there is nothing to time: the
# interpreter's speed says nothing about a GPU's ("Going deeper: timing fine print" shows it).

# %%
def additions(n):
    """Fresh float32 x, y, z of n values and the two additions to time, by name; each writes x + y into z."""
    x, y, z = (torch.randn(n, device=DEVICE) for _ in range(3))
    ops = {"triton": lambda: vector_add_kernel[(triton.cdiv(n, 1024),)](x, y, z, n, BLOCK=1024),
           "torch": lambda: torch.add(x, y, out=z)}
    return ops, (x, y, z)


def addition_floor_us(n, bandwidth):
    """The memory floor of an addition of n float32: 3 tensors of 4 bytes per element at `bandwidth`."""
    return 3 * 4 * n / bandwidth * 1e6


torch.manual_seed(4)
if ON_GPU:
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(DEVICE)}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; float32, BLOCK 1024")
    print(f"{'n':>5} {'op':>7} {'median_us':>9} {'floor_us':>8}")
    for log_n in (14, 26):
        ops, (x_speed, y_speed, z_speed) = additions(2**log_n)
        floor_us = addition_floor_us(2**log_n, bandwidth)
        for name, op in ops.items():
            z_speed.zero_()
            gpu = median_us(op)
            assert torch.equal(z_speed, x_speed + y_speed), f"{name} wrote a wrong sum"
            assert gpu >= 0.8 * floor_us, f"{name} beats the memory floor at 2^{log_n}: the timing is wrong"
            print(f"{'2^' + str(log_n):>5} {name:>7} {gpu:>9.1f} {floor_us:>8.1f}")
else:
    print("no GPU: nothing to time")

# %% [markdown]
# ## The CPU interpreter and what it hides
#
# Without a GPU, `TRITON_INTERPRET=1` makes `@triton.jit` return an *interpreted* function: each
# program runs in Python, on NumPy arrays. The same kernel source runs on a GPU unchanged, but
# besides its speed, four differences matter.
#
# ### 1. Programs run one after another, so races pass
#
# Each program below reads a counter, adds one, writes it back. On a GPU, programs run at the same
# time: two of them read the same old value and one increment is lost. `tl.atomic_add` makes the
# read-modify-write indivisible.

# %%
@triton.jit
def racy_count_kernel(COUNT):
    tl.store(COUNT, tl.load(COUNT) + 1.0)                 # read, add, write: not atomic


@triton.jit
def atomic_count_kernel(COUNT):
    tl.atomic_add(COUNT, 1.0)


n_programs = 10_000 if ON_GPU else 200
racy, atomic = torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE)
racy_count_kernel[(n_programs,)](racy)
atomic_count_kernel[(n_programs,)](atomic)
print(f"{n_programs} programs: racy count {racy.item():.0f}, atomic count {atomic.item():.0f}")
assert atomic.item() == n_programs
if INTERPRET:
    assert racy.item() == n_programs, "one program at a time: the race never happens"
else:
    assert racy.item() < n_programs, "programs run at the same time: increments are lost"

# %% [markdown]
# Under the interpreter both counts are right; on a GPU the racy one is lower. A test suite that
# only runs on the CPU cannot catch a race.
#
# ### 2. `tl.associative_scan` folds left to right, so a non-associative combine passes
#
# `tl.associative_scan(x, 0, f)` computes $x_0,\ f(x_0, x_1),\ f(f(x_0, x_1), x_2), \dots$
# (with `f = +`, a cumulative sum), grouping the combines in any tree, since it assumes `f` is
# associative. The interpreter evaluates a plain left fold, so with subtraction it returns what a
# sequential loop would; a GPU evaluates a tree and returns something else.

# %%
@triton.jit
def subtract(a, b):
    return a - b


@triton.jit
def scan_kernel(X, Y, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(Y + offsets, tl.associative_scan(tl.load(X + offsets), 0, subtract))


def left_fold(xs: list[float], f) -> list[float]:
    out = [xs[0]]
    for x in xs[1:]:
        out.append(f(out[-1], x))
    return out


x_fold = torch.arange(1.0, 17.0, device=DEVICE)
y_fold = torch.empty_like(x_fold)
scan_kernel[(1,)](x_fold, y_fold, BLOCK=16)
sequential = torch.tensor(left_fold(x_fold.tolist(), lambda a, b: a - b), device=DEVICE)
print("kernel:   ", y_fold.tolist())
print("left fold:", sequential.tolist())
if INTERPRET:
    assert torch.equal(y_fold, sequential), "the interpreter folds left to right"
else:
    assert not torch.equal(y_fold, sequential), "a GPU combines in a tree"

# %% [markdown]
# So the associativity of every combine operator must be checked separately, in plain PyTorch:
# $f(f(a, b), c) = f(a, f(b, c))$ on random inputs. The check catches subtraction at once
# (integer-valued floats keep the comparison exact):

# %%
def is_associative(f, samples: int = 1000) -> bool:
    a, b, c = torch.randint(-100, 100, (3, samples), generator=torch.Generator().manual_seed(0)).double()
    return torch.equal(f(f(a, b), c), f(a, f(b, c)))


assert is_associative(lambda a, b: a + b) and not is_associative(lambda a, b: a - b)
print("a + b is associative; a - b is not")

# %% [markdown]
# ### 3. Out-of-bounds reads are silent, so masks matter
#
# A kernel only receives a pointer: it does not know where the tensor ends. An unmasked block that
# runs past the end reads its neighbours, on CPU and GPU alike, with no error ("Going deeper:
# out-of-bounds reads" shows one). The mask makes it right.
#
# ### 4. Rounding differs from the GPU's
#
# The interpreter computes with NumPy; a GPU uses its own instructions, some of them fast
# approximations, and sums in another order. Results agree within rounding errors, not bit for bit,
# so the course checks a computed result against a float64 reference within a tolerance; `torch.equal`
# only checks what involves no rounding (copies, indices, a single addition, as in this chapter's
# first kernels). The cell checks `tl.exp`, which a GPU computes with a fast approximate instruction,
# against float64 within a tolerance ("Going deeper: the error bound of `tl.exp`" derives the bound
# under it).

# %%
@triton.jit
def exp_kernel(X, Y, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(Y + offsets, tl.exp(tl.load(X + offsets, mask=mask)), mask=mask)


x_exp = torch.linspace(-10, 10, 4097, device=DEVICE)
y_exp = torch.empty_like(x_exp)
exp_kernel[(triton.cdiv(x_exp.numel(), 1024),)](x_exp, y_exp, x_exp.numel(), BLOCK=1024)
exact = torch.exp(x_exp.double())
relative = (y_exp.double() - exact).abs() / exact
print(f"tl.exp on [-10, 10]: max relative error {relative.max().item():.1e} against float64")
assert relative.max() <= 2e-6, "more than a few float32 roundings"

# %% [markdown]
# Conversions can differ too: Triton 3.6's interpreter truncates float32 to bfloat16, where PyTorch
# and a GPU round to nearest ("Going deeper: catching a truncating conversion").
#
# ## Summary
#
# Kernels find their block from `tl.program_id` and `tl.arange`, read tensors through strides and
# mask every load and store; `median_us` times them against the memory floor. The interpreter hides
# races, non-associative combines and the GPU's rounding: run everything on a real GPU before
# trusting it.
#
# Next: chapter 01 scans with `+`, first in one block, then at any length.

# %% [markdown]
# ## Going deeper: why the setup cell comes first
#
# `scan_lib/runtime.py` starts with the cell below. `use_interpreter_without_gpu` sets
# `TRITON_INTERPRET=1` when no CUDA GPU is visible, and mends older interpreters for NumPy 2.4
# ("Going deeper: the interpreter and NumPy"). `save_figure` writes a figure with
# no timestamp in it, so that re-running a notebook leaves git clean, into `$SCAN_COURSE_FIGURES`
# where a test run sets it.

# %%
#| default_exp runtime

# %%
#| export
"""Where kernels run (the GPU, else Triton's CPU interpreter), figures, compiled code, timers, input checks."""
import functools
import os
import warnings
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch


def use_interpreter_without_gpu() -> bool:
    """Set TRITON_INTERPRET=1 when no CUDA GPU is visible. Call before any @triton.jit is defined.

    Under the interpreter of a Triton older than 3.9, also gives it 3.9's conversion of a scalar to a
    Python int, without which a `for` loop over a runtime bound fails under NumPy 2.4 or newer
    ("Going deeper: the interpreter and NumPy")."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if interpret and _major_minor(version("triton")) < (3, 9):
        _index_scalars_as_triton_3_9_does()
    return interpret


def _major_minor(version_string: str) -> tuple:
    return tuple(int(part) for part in version_string.split(".")[:2])


def _index_scalars_as_triton_3_9_does():
    """The interpreter holds a scalar as a one-element array and turns it into a Python int (a `range`
    bound) with int(array), which NumPy 2.4 refuses for arrays of one dimension; Triton 3.9 squeezes
    the array first. Wrap the interpreter's patching of tl.tensor so that older versions do the same
    (3.5 sets the attribute itself, 3.6 through a scope that restores it); warn if this Triton's
    interpreter has no such function."""
    from triton.runtime import interpreter
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_scalars", False):
        if patch is None and _major_minor(np.__version__) >= (2, 4):
            warnings.warn(f"Triton {version('triton')}'s CPU interpreter may fail with NumPy {np.__version__}: "
                          "use numpy<2.4 (requirements.txt pins 2.3.5) or Triton 3.9", stacklevel=3)
        return

    def patch_lang_tensor(tensor, *scope):
        patch(tensor, *scope)
        index = lambda self: int(self.handle.data.squeeze())  # noqa: E731
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index
    patch_lang_tensor.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_lang_tensor


INTERPRET: bool = use_interpreter_without_gpu()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU: bool = DEVICE.type == "cuda" and not INTERPRET


def describe() -> str:
    """One line saying where kernels will run, for the top of every notebook and benchmark."""
    if ON_GPU:
        return f"GPU: {torch.cuda.get_device_name(DEVICE)} (torch {torch.__version__})"
    return f"no GPU: Triton's CPU interpreter, small problem sizes (torch {torch.__version__})"


def figure_path(name: str) -> Path:
    """Where a notebook saves a figure: $SCAN_COURSE_FIGURES if set (`make test` and `make course` set it,
    so that a CPU run leaves the committed GPU figures alone), else the repository's figures/ folder,
    or ./figures elsewhere (Colab)."""
    here = Path.cwd()
    folder = Path(os.environ.get("SCAN_COURSE_FIGURES") or (here.parent if here.name == "notebooks" else here) / "figures")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def save_figure(fig, name: str, dpi: int = 100) -> None:
    """Save a matplotlib figure to figures/<name> and show it as the cell's output.

    The file has no timestamp or version in it, so re-running a notebook rewrites the same bytes and
    leaves git clean. The figure is shown as an image output (not a link to ../figures/, which Colab
    and the HTML pages cannot follow), then closed so that it is not drawn a second time."""
    import matplotlib.pyplot as plt
    path = figure_path(name)
    fig.savefig(path, dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    try:
        from IPython import get_ipython
        from IPython.display import Image, display
    except ImportError:
        return
    if get_ipython() is not None:
        display(Image(filename=str(path)))

# %% [markdown]
# `@triton.jit` looks at `TRITON_INTERPRET` when it *defines* a kernel, and returns either a
# compiled GPU function or an interpreted one; setting the variable later changes no kernel already
# defined. A kernel defined while it was unset is compiled for a GPU, and without one its first
# launch fails. So `import scan_lib`, which sets the variable when no GPU is visible, comes first in
# every chapter. (On Colab, the setup cell's first lines also `pip install` this repository.)

# %%
import os

from triton.runtime.interpreter import InterpretedFunction

assert isinstance(vector_add_kernel, InterpretedFunction) == INTERPRET
print(f"vector_add_kernel is a {type(vector_add_kernel).__name__}")
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        @triton.jit
        def defined_too_late_kernel(X):
            tl.store(X, 1.0)
    finally:
        os.environ["TRITON_INTERPRET"] = "1"
    assert not isinstance(defined_too_late_kernel, InterpretedFunction)
    try:
        defined_too_late_kernel[(1,)](torch.zeros(1))
        raise AssertionError("a GPU kernel should not launch without a GPU")
    except RuntimeError as error:
        print(f"defined with TRITON_INTERPRET=0, launched without a GPU: RuntimeError: {error}")

# %% [markdown]
# ## Going deeper: names in kernels
#
# Names in the kernels of this course follow one rule:
#
# * **Pointers** are capitalised words: `X`, `Y`, `GATES`, `DA`.
# * **Compile-time constants** (`tl.constexpr` parameters) are upper case too: `BLOCK`, `CHUNK`,
#   `REVERSE`. The annotation tells them from pointers.
# * **Runtime values**, sizes and strides included, are lower case: `length`, `n_rows`, `stride_t`,
#   `num_blocks`.
#
# So an upper-case name in a kernel is a pointer or a constant, and never changes while the kernel
# runs. A `tl.constexpr` gets one compiled version of the kernel per value.

# %% [markdown]
# ## Going deeper: a block of 6
#
# `tl.arange` lengths must be powers of two, so `which_program_kernel` launched with `BLOCK=6` is
# refused when it is compiled:

# %%
try:                                                      # a block of 6 is refused when compiled
    which_program_kernel[(1,)](torch.empty(6, dtype=torch.int32, device=DEVICE), BLOCK=6)
    refusal = "none"
except Exception as error:
    refusal = f"{type(error).__name__}: {error}"
assert "power of 2" in refusal, refusal
print("BLOCK=6 is refused: arange's range must be a power of 2")

# %% [markdown]
# ## Going deeper: reading a layout, choosing `num_warps`
#
# `gpu_assembly` is below. It compiles in a fresh Python process, with the interpreter off, because
# the interpreter changes `triton.language` while it runs kernels; its docstring gives the arguments.

# %%
#| export
_COMPILE_FOR_GPU = """
import json, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from kernel_source import kernel
types, constexprs, num_warps, capability = json.loads(sys.argv[2])
aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(types.values()) if kind.startswith("*")}
source = triton.compiler.ASTSource(fn=kernel, signature=types, constexprs=constexprs, attrs=aligned)
compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps})
print(json.dumps({stage: code for stage, code in compiled.asm.items() if isinstance(code, str)}))
"""


def gpu_assembly(kernel, signature: dict, num_warps: int = 4, capability: int = 90, **constexprs) -> dict:
    """Compile `kernel` for an NVIDIA GPU without running it, on any machine, and return its code by
    stage: "ttir" (Triton's IR), "ttgir" (the same with the layout of the block over threads), "llir",
    "ptx" (the GPU's assembly). `capability` 90 is the H100 and H200.

    `signature` gives the type of each runtime argument ("*fp32" a float32 pointer, "i32" an int);
    `constexprs` the values of the tl.constexpr ones. Pointers are taken as 16-byte aligned, as
    PyTorch's allocations are. The kernel is compiled in a fresh Python with the interpreter off (the
    interpreter changes triton.language while it runs kernels), so it may use triton.language only,
    not other @triton.jit functions or globals of its notebook."""
    import inspect
    import json
    import re
    import subprocess
    import sys
    import tempfile
    import textwrap
    source = textwrap.dedent(inspect.getsource(kernel.fn))
    source = source[re.search(r"^def ", source, re.MULTILINE).start():]            # drop the decorator
    names = list(inspect.signature(kernel.fn).parameters)
    types = {name: signature.get(name, "constexpr") for name in names}
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "kernel_source.py").write_text(
            f"import triton\nimport triton.language as tl\n\n\n@triton.jit\n{source}\n\nkernel = {kernel.fn.__name__}\n")
        result = subprocess.run(
            [sys.executable, "-c", _COMPILE_FOR_GPU, folder, json.dumps([types, constexprs, num_warps, capability])],
            capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"})
    if result.returncode != 0:
        raise RuntimeError(f"compiling {kernel.fn.__name__} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])

# %% [markdown]
# The cell reads the layouts of "What `num_warps` changes" (`warpsPerCTA` is warps per program) as
# threads per program and values per thread.

# %%
print(f"{'num_warps':>9} {'threads':>7} {'values per thread':>17}   (BLOCK = 1024 float32)")
for num_warps, layout in layouts.items():
    size, lanes, warps = (int(re.search(rf"{key} = \[(\d+)\]", layout).group(1))
                          for key in ("sizePerThread", "threadsPerWarp", "warpsPerCTA"))
    assert lanes == 32 and warps == num_warps and size == 4, layout
    print(f"{num_warps:>9} {lanes * warps:>7} {1024 // (lanes * warps):>17}")

# %% [markdown]
# Each thread's 4 neighbouring float32 are 16 bytes. `order` lists the block's dimensions from
# the one whose consecutive values sit in one thread (and then in neighbouring threads) first: a
# one-dimensional block has only `[0]`.
#
# The next cell shows how `tl.sum` combines values of other threads in `row_sums_kernel`: with one
# warp, only shuffles (`shfl.sync`); with four, also shared memory (`st.shared`, `ld.shared`).

# %%
row_sums_types = {"X": "*fp32", "OUT": "*fp32", "n_cols": "i32", "stride_row": "i32", "stride_col": "i32"}
print(f"{'num_warps':>9} {'shfl.sync':>9} {'st.shared':>9} {'ld.shared':>9}   (instructions in row_sums_kernel's PTX)")
for num_warps in (1, 4):
    ptx = gpu_assembly(row_sums_kernel, row_sums_types, num_warps=num_warps, BLOCK=1024)["ptx"]
    counts = [ptx.count(instruction) for instruction in ("shfl.sync", "st.shared", "ld.shared")]
    assert counts[0] > 0 and (min(counts[1:]) > 0) == (num_warps > 1), counts
    print(f"{num_warps:>9} {counts[0]:>9} {counts[1]:>9} {counts[2]:>9}")

# %% [markdown]
# More warps mean fewer values per thread and more threads to hide memory latency, but also more
# work to combine values across warps in a sum or a scan; later chapters choose `num_warps` per
# kernel.

# %% [markdown]
# ## Going deeper: timing fine print
#
# The timers of `scan_lib.runtime` are below. `do_bench` flushes the L2 cache (the GPU's last cache
# before its memory) by writing a 256 MiB buffer before each run, so that every run reads its inputs
# from memory as a real workload would.

# %%
#| export
def median_us(fn, **do_bench_options) -> float:
    """Median GPU time of fn() in microseconds (triton.testing.do_bench; needs a GPU). Sweeps that
    must be quick pass shorter warm-up and repeat times, e.g. warmup=5, rep=40 (milliseconds)."""
    from triton.testing import do_bench
    return do_bench(fn, return_mode="median", **do_bench_options) * 1e3


def graph_us(fn) -> float:
    """Median time of fn() replayed from a CUDA graph, in microseconds: the GPU's time without launch overhead."""
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, return_mode="median") * 1e3


def host_us(fn, calls: int = 50) -> float:
    """Host time per call: launches queued back to back, timed on the CPU, no synchronisation inside
    (the GPU, where there is one, is synchronised before and after)."""
    import time
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / calls * 1e6


def copy_bandwidth() -> float:
    """Device memory bandwidth in bytes per second, read plus write, measured by copying 1 GiB of
    float32 (far larger than the L2 cache): the rate every memory floor in the course divides by."""
    source = torch.empty(2**28, device=DEVICE)
    target = torch.empty_like(source)
    return 2 * source.numel() * source.element_size() / (median_us(lambda: target.copy_(source)) * 1e-6)

# %% [markdown]
# Each launch also costs the host time (Python, argument checks and the driver), which for a small
# kernel can exceed the GPU's. `host_us` measures it per call; `graph_us` replays the calls from a
# **CUDA graph** (recorded launches, replayed by one call), leaving only the GPU's time. On a GPU the
# cell times the additions of "Timing a kernel on a GPU" with all three timers and says which of
# host and GPU sets the pace.

# %%
from scan_lib.runtime import graph_us, host_us

if ON_GPU:
    print(f"{'n':>5} {'op':>7} {'median_us':>9} {'graph_us':>9} {'host_us':>8} {'floor_us':>8}  paced by")
    for log_n in (14, 26):
        ops, _ = additions(2**log_n)
        floor_us = addition_floor_us(2**log_n, bandwidth)
        for name, op in ops.items():
            gpu, graph, host = median_us(op), graph_us(op), host_us(op)
            print(f"{'2^' + str(log_n):>5} {name:>7} {gpu:>9.1f} {graph:>9.1f} {host:>8.1f} {floor_us:>8.1f}  "
                  f"{'the host' if host > graph else 'the GPU'}")
else:
    print("no GPU: nothing to time")

# %% [markdown]
# The memory floor is itself a measurement, of a copy, so a kernel that streams as well as a copy
# lands on it give or take the run-to-run variation, and may come in slightly under it (in the
# table above, the large additions replayed from a CUDA graph, the `graph_us` column, do); the
# cell of "Timing a kernel on a GPU" treats only a time under 0.8 of the floor as a timing error.
#
# Without a GPU the next cell times the interpreter: every operation of every program runs in
# Python, so many small blocks cost far more than a few large ones, and both are much slower than
# PyTorch. That is why every chapter has two size profiles (`if ON_GPU:` realistic sizes, else small
# ones) and reports no CPU timings.

# %%
if not ON_GPU:
    torch.manual_seed(4)
    x_speed, y_speed = torch.randn(2**14, device=DEVICE), torch.randn(2**14, device=DEVICE)
    seconds = {}
    for block in (64, 1024):
        start = time.perf_counter()
        vector_add(x_speed, y_speed, block)
        seconds[block] = time.perf_counter() - start
    start = time.perf_counter()
    x_speed + y_speed
    seconds["torch"] = time.perf_counter() - start
    print(f"2^14 additions: interpreter {seconds[64] * 1e3:.0f} ms (BLOCK 64, 256 programs), "
          f"{seconds[1024] * 1e3:.0f} ms (BLOCK 1024, 16 programs); torch {seconds['torch'] * 1e3:.2f} ms")
    assert seconds[64] > seconds[1024] > seconds["torch"]
else:
    print("on a GPU: the interpreter is not timed")

# %% [markdown]
# ## Going deeper: the error bound of `tl.exp`
#
# On a GPU `tl.exp(x)` computes $2^t$, $t = x \log_2 e$, with the fast instruction `ex2.approx.f32`,
# whose error is at most 2 units in the last place (ulp), a relative $2^{-22}$; the rounding of $t$
# (up to $2^{-23}|t|$) adds a relative $|x|\,2^{-23}$. The cell checks that `exp_kernel` compiles to
# that instruction, and asserts, on the GPU and under the interpreter (NumPy's float32 `exp`), that
# the error of "4. Rounding differs from the GPU's" against float64 stays within
# $2^{-22} + |x|\,2^{-23} + 2^{-24}$ (the last term for the final rounding), which on $[-10, 10]$
# stays under that cell's tolerance. It also prints the largest errors in ulp, with `torch.exp`'s.

# %%
ptx = gpu_assembly(exp_kernel, {"X": "*fp32", "Y": "*fp32", "n": "i32"}, BLOCK=1024)["ptx"]
assert "ex2.approx.f32" in ptx
print("PTX of exp_kernel:", next(line.strip() for line in ptx.splitlines() if "ex2.approx" in line))
bound = 2**-22 + x_exp.double().abs() * 2**-23 + 2**-24


def max_ulps(y: torch.Tensor) -> float:
    """Largest error of float32 values y, in units of the last place of the exact result."""
    return ((y.double() - exact).abs() / (2**-23 * 2.0 ** torch.floor(torch.log2(exact)))).max().item()


print(f"tl.exp on [-10, 10]: max relative error {relative.max().item():.1e} ({max_ulps(y_exp):.2f} ulp; "
      f"torch.exp {max_ulps(torch.exp(x_exp)):.2f} ulp), within the bound everywhere: {bool((relative <= bound).all())}")
assert (relative <= bound).all() and bound.max() <= 2e-6

# %% [markdown]
# ## Going deeper: out-of-bounds reads
#
# Below, `x` is the first five elements of an eight-element buffer whose tail holds 100. An unmasked
# block of 8 reads the neighbours, on CPU and GPU alike, with no error; the mask makes it right.

# %%
@triton.jit
def sum_of_block_kernel(X, OUT, n, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    if MASKED:
        x = tl.load(X + offsets, mask=offsets < n, other=0.0)
    else:
        x = tl.load(X + offsets)                          # reads BLOCK values whatever n is
    tl.store(OUT, tl.sum(x, axis=0))


buffer = torch.full((8,), 100.0, device=DEVICE)
x_short = buffer[:5]
x_short.fill_(1.0)                                        # x = [1, 1, 1, 1, 1], then 100, 100, 100
total = torch.zeros(1, device=DEVICE)
sum_of_block_kernel[(1,)](x_short, total, x_short.numel(), BLOCK=8, MASKED=False)
unmasked = total.item()
sum_of_block_kernel[(1,)](x_short, total, x_short.numel(), BLOCK=8, MASKED=True)
print(f"sum of five ones: unmasked {unmasked:.0f}, masked {total.item():.0f}")
assert unmasked == 5 + 3 * 100 and total.item() == 5

# %% [markdown]
# The cell reads past the end of a tensor but inside its buffer. Past the end of an allocation the
# result is garbage or a crash, depending on luck.

# %% [markdown]
# ## Going deeper: catching a truncating conversion
#
# Conversions can differ too: PyTorch and a GPU round float32 to the nearest bfloat16 or float16,
# while Triton 3.6's interpreter truncates float32 to bfloat16. `rounds_to_nearest` tells the two
# apart with $\pm(1 + \tfrac34\varepsilon)$, $\varepsilon$ the gap between 1 and the next value of
# the type: nearest gives $\pm(1 + \varepsilon)$, truncation $\pm 1$. In `convert_kernel`,
# `Y.dtype.element_ty` is the type that `Y` points to, so one kernel serves every output dtype. The
# second cell prints what `convert_kernel` does on your device.

# %%
#| export
def rounds_to_nearest(convert, dtype: torch.dtype) -> bool:
    """Whether `convert(x, dtype)`, a float32 -> dtype conversion, rounds to nearest (not towards zero).

    Tries ±(1 + 3/4 eps) (eps: the gap between 1 and the next dtype value): exact in float32, not in
    dtype, and nearer its upper neighbour ±(1 + eps) than its lower one ±1, where truncation goes."""
    eps = torch.finfo(dtype).eps
    x = torch.tensor([1 + 0.75 * eps, -(1 + 0.75 * eps)], dtype=torch.float32, device=DEVICE)
    nearest = torch.tensor([1 + eps, -(1 + eps)], dtype=torch.float64).to(dtype)
    return torch.equal(convert(x, dtype).cpu(), nearest)

# %%
@triton.jit
def convert_kernel(X, Y, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(Y + offsets, tl.load(X + offsets, mask=mask).to(Y.dtype.element_ty), mask=mask)


def convert(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    convert_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return y


for dtype in (torch.bfloat16, torch.float16):
    assert rounds_to_nearest(lambda x, dtype: x.to(dtype), dtype)    # torch's conversion: the reference
    nearest = rounds_to_nearest(convert, dtype)
    print(f"{str(dtype):>15}: convert_kernel {'rounds to nearest' if nearest else 'truncates'}")
    if INTERPRET and dtype == torch.bfloat16:
        assert not nearest, "Triton 3.6's interpreter truncates float32 to bfloat16"
    else:
        assert nearest

# %% [markdown]
# Triton 3.6's interpreter converts float32 to bfloat16 by dropping the low 16 bits, that is
# truncation, towards zero. A test value must tell that from rounding to nearest: not representable
# in the target type, and closer to its upper neighbour. $\pm(1 + \tfrac34\varepsilon)$ is both,
# with $\varepsilon = 2^{-7}$ for bfloat16 and $2^{-10}$ for float16. A value exact in the type,
# such as $1 + 2^{-8} + 2^{-10}$ in float16, cannot catch truncation: `tests/test_runtime.py` shows
# a truncating conversion passing with it and failing with this one.

# %% [markdown]
# ## Going deeper: torch ops in `scan_lib.runtime`
#
# Nothing in this chapter uses the cell below; later chapters' exported modules do. `custom_op`
# registers a launcher as a PyTorch custom op (`torch.library.custom_op`) and wraps it in
# `EagerFastOp`; `apply` runs a `torch.autograd.Function`: the wrapping that makes the library's
# kernels PyTorch ops with gradients. Chapter 03 ("Going deeper: autograd plumbing: torch ops,
# `setup_context`, double backward") explains custom ops and `apply`; `EagerFastOp`'s docstring says
# why a plain eager call skips the dispatcher.

# %%
#| export
_LOCAL_OPS = iter(range(1, 1 << 62))


def custom_op(name: str, module: str, **options):
    """torch.library.custom_op for a scan_lib public op: `@custom_op("cumsum", __name__)`.

    In a scan_lib module the op is `scan_lib::name`. Defined anywhere else (a notebook cell, whose
    module is `__main__`), it gets a namespace of its own each time the cell runs, because scan_lib,
    imported by the setup cell, has already registered `scan_lib::name`, and torch refuses a second
    registration of one name."""
    namespace = "scan_lib" if module.startswith("scan_lib.") else f"scan_lib_local{next(_LOCAL_OPS)}"

    def register(implementation):
        return EagerFastOp(torch.library.custom_op(f"{namespace}::{name}", mutates_args=(), **options)(implementation),
                           implementation)
    return register


class EagerFastOp:
    """A registered custom op that, in a plain eager call, runs its Python implementation directly.

    Through the dispatcher, a Python custom op costs tens of microseconds per call before its code
    runs (the autograd key, a redispatch, a wrapper that keeps torch.compile out of the
    implementation). None of that does anything for plain tensors outside torch.compile, torch.func
    transforms, dispatch or torch-function modes (fake tensors, the profiler's op names), and
    tensors that need no gradient through the op; such calls go straight to the implementation,
    every other call through the op. Everything else (register_fake, register_vmap, ...) is the op's."""

    def __init__(self, op, implementation):
        self._op, self._implementation = op, implementation
        functools.update_wrapper(self, implementation)     # name, docstring and signature for help()

    def __call__(self, *args, **kwargs):
        if not _dispatcher_needed() and _plain_tensors(args) and (not kwargs or _plain_tensors(kwargs.values())):
            return self._implementation(*args, **kwargs)
        return self._op(*args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_op", "_implementation"):   # not yet set (copy, pickle)
            raise AttributeError(name)
        return getattr(self._op, name)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)   # a Parameter's __torch_function__ is the Tensor's


def _dispatcher_needed() -> bool:
    """Whether the current context needs every op call to go through the dispatcher: torch.compile, a
    torch.func transform, a dispatch or torch-function mode (fake tensors, ...), the profiler (its op
    names) or the jit tracer. One C call each (is_compiling first: Dynamo answers it while tracing and
    then reads no further)."""
    return (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled()
            or torch.autograd._profiler_enabled() or torch._C._get_tracing_state() is not None)


def _plain_tensors(args) -> bool:
    """Whether every tensor among args (lists and tuples looked into) is a plain tensor or parameter
    needing no gradient through the op: a subclass or a gradient is the dispatcher's business."""
    grad = torch.is_grad_enabled()
    for arg in args:
        if isinstance(arg, (list, tuple)) and not _plain_tensors(arg):
            return False
        if isinstance(arg, torch.Tensor) and (type(arg) not in _PLAIN_TENSORS or (grad and arg.requires_grad)):
            return False
    return True


def needs_grad(*tensors) -> bool:
    """Whether autograd must record an op on these tensors (None and numbers skipped): grad mode is on
    and one of them requires a gradient."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def apply(function, *args):
    """`function.apply(*args)` for a torch.autograd.Function in the style torch.func needs (a forward
    without ctx, and setup_context), without that style's cost in plain eager calls.

    For that style, Function.apply binds the arguments with inspect.signature on every call: tens of
    microseconds of host time, as much as a kernel launch. Outside torch.compile and torch.func
    transforms, the same forward, setup_context and backward run as an old-style Function, whose
    apply goes straight to C++; and when no argument needs a gradient (nor a forward-mode tangent,
    which the Function would refuse), the forward alone runs: the Function would record nothing.
    Pass every argument positionally."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    if not needs_grad(*args) and torch.autograd.forward_ad._current_level < 0:   # no dual_level open
        return function.forward(*args)
    return _eager_twin(function).apply(*args)


_EAGER_TWINS: dict = {}


def _eager_twin(function):
    """An old-style autograd.Function, named like `function`, that runs its forward, setup_context and backward."""
    if function not in _EAGER_TWINS:
        def forward(ctx, *args):
            output = function.forward(*args)
            function.setup_context(ctx, args, output)
            return output

        def backward(ctx, *grads):
            return function.backward(ctx, *grads)
        _EAGER_TWINS[function] = type(function.__name__, (torch.autograd.Function,),
                                      {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    return _EAGER_TWINS[function]

# %% [markdown]
# ## Going deeper: the rest of `scan_lib.runtime`
#
# The public functions of later chapters check their inputs with the two helpers below, so that a
# wrong argument raises a `TypeError` or `ValueError` naming it, before any kernel runs.

# %%
#| export
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float_tensor(name: str, value) -> None:
    """Raise a TypeError naming `name` unless `value` is a tensor of a floating dtype we support."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {value.dtype}")


def check_same_device(**tensors) -> torch.device:
    """Raise a ValueError naming the arguments unless all given tensors (None skipped) share one device
    on which the kernels can run, and return that device.

    On a GPU machine kernels need CUDA tensors; under the interpreter, CPU tensors (the interpreter
    also copies CUDA tensors through the host, so those are accepted too). Meta tensors never are.
    Every call of every op runs this check, so the passing path is a plain loop; the messages are
    built only when one is raised."""
    device = None
    for t in tensors.values():
        if t is None:
            continue
        if device is None:
            device = t.device
        elif t.device != device:
            _raise_device_error(tensors)
    if device is None or device.type not in KERNEL_DEVICE_TYPES:
        _raise_device_error(tensors)
    return device


KERNEL_DEVICE_TYPES = ("cpu", "cuda") if INTERPRET else ("cuda",)


def _raise_device_error(tensors: dict):
    """The ValueError of check_same_device for these arguments, naming them."""
    named = {name: t for name, t in tensors.items() if t is not None}
    if not named:
        raise ValueError(f"{', '.join(tensors) or 'tensors'}: no tensor given, only None")
    devices = {t.device for t in named.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in named.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    device = devices.pop()
    if INTERPRET:
        raise ValueError(f"{', '.join(named)} must be CPU tensors for Triton's interpreter (got {device})")
    raise ValueError(
        f"{', '.join(named)} must be CUDA tensors (got {device}); to run Triton kernels on the CPU "
        "set TRITON_INTERPRET=1 before importing scan_lib"
    )


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive integers (triton.cdiv, without its per-call cost on the host)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1, 0 for 0: triton.next_power_of_2 in plain Python.
    Triton's is wrapped so that kernels can call it too, and under the interpreter that wrapper costs
    about as much per host call as a tensor allocation. A size that is a symbol while torch.compile
    traces (a SymInt, not an int) goes to Triton's, which is written with operators a SymInt has."""
    if type(n) is not int:
        import triton
        return triton.next_power_of_2(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


def zero_in_graph(*tensors):
    """A 0-dim zero in the autograd graph of each given tensor that needs a gradient (None and numbers
    skipped), or None when none does. An op's result for an empty input, plus this zero, gives every input a
    gradient of its own shape (zeros), as torch's ops do, while a call without gradients pays nothing.
    The zero is the sum of no elements (each tensor's first zero elements), so it is exactly 0 even
    for inputs holding inf or nan."""
    if not needs_grad(*tensors):
        return None
    return torch.cat([t.flatten()[:0] for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]).sum()


def plus(tensor, zero):
    """tensor + zero in tensor's dtype, or tensor itself when zero is None (see zero_in_graph)."""
    return tensor if zero is None else tensor + zero.to(tensor.dtype)

# %% [markdown]
# ## Going deeper: the interpreter and NumPy
#
# Left alone, Triton 3.6's interpreter under NumPy 2.4 or newer cannot run a `for` loop whose bound
# is a kernel argument: it fails with "only 0-dimensional arrays can be converted to Python scalars".
# The interpreter holds every scalar as a one-element NumPy array, and Python's `range` turns the
# bound into an int with `int(array)`, which NumPy 2.4 refuses for an array of one dimension. Triton
# 3.9 squeezes the array to zero dimensions first; `use_interpreter_without_gpu` gives older
# interpreters that one line (`_index_scalars_as_triton_3_9_does`), so the course's `for` loops run
# under any NumPy. (`requirements.txt` still pins NumPy 2.3, the version CI tests with.)
# The cell runs a `for` loop over a runtime bound with whatever NumPy you have (the recorded GPU run
# had NumPy 2.5.2). On a GPU the kernel is compiled, not interpreted, and NumPy plays no part.

# %%
@triton.jit
def row_sums_for_kernel(X, OUT, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(X + row * n_cols + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(OUT + row, tl.sum(acc, axis=0))


torch.manual_seed(3)
x_for = torch.randn(2, 100, device=DEVICE)
out_for = torch.empty(2, device=DEVICE)
row_sums_for_kernel[(2,)](x_for, out_for, 100, BLOCK=64)
assert torch.allclose(out_for, x_for.sum(1), atol=1e-4)
print(f"triton {triton.__version__}, numpy {np.__version__}: the for loop over a runtime bound ran and is correct")

# %% [markdown]
# ## References
#
# - Tillet, Kung and Cox, "Triton: an intermediate language and compiler for tiled neural network computations", MAPL 2019.
# - The Triton tutorials (vector addition, fused softmax, matrix multiplication, fused attention): https://triton-lang.org/main/getting-started/tutorials/
# - NVIDIA, CUDA C++ Programming Guide, chapters on the programming model (grids, blocks, warps) and the memory hierarchy.
# - Sasha Rush, "Mamba: The Hard Way" (a Triton notebook from cumulative sums to the selective scan; part 0): https://srush.github.io/annotated-mamba/hard.html
