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
# ## The setup cell, opened up
#
# What `import scan_lib` did above lives in `scan_lib/runtime.py`, which is written from the cells
# below marked `#| export`. Triton decides *when a kernel is defined* whether it will compile it for
# the GPU or run it in its CPU interpreter, by reading the environment variable `TRITON_INTERPRET`.
# So the variable must be set before the first `@triton.jit`: that is why every chapter imports
# `scan_lib` in its first cell (the last section of this chapter shows what goes wrong otherwise).
# The lines before the import run only on Colab (detected by `google.colab` being imported): they
# `pip install` this repository, which declares torch and triton with lower bounds only, so Colab's
# own torch and triton are kept. `describe()` prints one line saying where the kernels will run.

# %%
#| default_exp runtime

# %%
#| export
"""Where kernels run: the GPU when there is one, else Triton's CPU interpreter; shared input checks."""
import os
import warnings
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch


def use_interpreter_without_gpu() -> bool:
    """Set TRITON_INTERPRET=1 when no CUDA GPU is visible. Call before any @triton.jit is defined.

    Warns when NumPy is 2.4 or newer and Triton older than 3.9: Triton 3.6's interpreter cannot run a
    `for` loop over a runtime bound with that NumPy (section "A blocked kernel with a loop" shows the
    failure); 3.9's can; 3.7 and 3.8 were not tried."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if interpret and _major_minor(np.__version__) >= (2, 4) and _major_minor(version("triton")) < (3, 9):
        warnings.warn(f"Triton {version('triton')}'s CPU interpreter may fail with NumPy {np.__version__}: "
                      "use numpy<2.4 (requirements.txt pins 2.3.5) or Triton 3.9", stacklevel=2)
    return interpret


def _major_minor(version_string: str) -> tuple:
    return tuple(int(part) for part in version_string.split(".")[:2])


INTERPRET: bool = use_interpreter_without_gpu()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU: bool = DEVICE.type == "cuda" and not INTERPRET


def describe() -> str:
    """One line saying where kernels will run, for the top of every notebook and benchmark."""
    if ON_GPU:
        return f"GPU: {torch.cuda.get_device_name(DEVICE)} (torch {torch.__version__})"
    return f"no GPU: Triton's CPU interpreter, small problem sizes (torch {torch.__version__})"


def figure_path(name: str) -> Path:
    """Where a notebook saves a figure: the repository's figures/ folder, or ./figures elsewhere (Colab)."""
    here = Path.cwd()
    folder = (here.parent if here.name == "notebooks" else here) / "figures"
    folder.mkdir(exist_ok=True)
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


_LOCAL_OPS = iter(range(1, 1 << 62))


def custom_op(name: str, module: str, **options):
    """torch.library.custom_op for a scan_lib public op: `@custom_op("cumsum", __name__)`.

    In a scan_lib module the op is `scan_lib::name`. Defined anywhere else (a notebook cell, whose
    module is `__main__`), it gets a namespace of its own each time the cell runs, because scan_lib,
    imported by the setup cell, has already registered `scan_lib::name`, and torch refuses a second
    registration of one name."""
    namespace = "scan_lib" if module.startswith("scan_lib.") else f"scan_lib_local{next(_LOCAL_OPS)}"
    return torch.library.custom_op(f"{namespace}::{name}", mutates_args=(), **options)

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
    also copies CUDA tensors through the host, so those are accepted too). Meta tensors never are."""
    named = {name: t for name, t in tensors.items() if t is not None}
    if not named:
        raise ValueError(f"{', '.join(tensors) or 'tensors'}: no tensor given, only None")
    devices = {t.device for t in named.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in named.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    device = devices.pop()
    if INTERPRET and device.type not in ("cpu", "cuda"):
        raise ValueError(f"{', '.join(named)} must be CPU tensors for Triton's interpreter (got {device})")
    if not INTERPRET and device.type != "cuda":
        raise ValueError(
            f"{', '.join(named)} must be CUDA tensors (got {device}); to run Triton kernels on the CPU "
            "set TRITON_INTERPRET=1 before importing scan_lib"
        )
    return device

# %% [markdown]
# Last, the timers every benchmark cell uses (GPU only). `median_us` is what the tables report: the
# median of `triton.testing.do_bench`, which synchronises through CUDA events and flushes the L2 cache
# before each run. `graph_us` replays a captured CUDA graph, which removes the host's launch overhead
# and so shows the GPU's time alone; `host_us` shows the host's time per call alone. `copy_bandwidth`
# measures the rate that memory floors are computed with: bytes that must move over this rate.

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
    """Host time per call: launches queued back to back, timed on the CPU, no synchronisation inside."""
    import time
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def copy_bandwidth() -> float:
    """Device memory bandwidth in bytes per second, read plus write, measured by copying 1 GiB of
    float32 (far larger than the L2 cache): the rate every memory floor in the course divides by."""
    source = torch.empty(2**28, device=DEVICE)
    target = torch.empty_like(source)
    return 2 * source.numel() * source.element_size() / (median_us(lambda: target.copy_(source)) * 1e-6)

# %% [markdown]
# ## What this chapter teaches
#
# Triton is a small language, embedded in Python, for writing GPU kernels. A kernel *loads* blocks
# of numbers from GPU memory into registers, computes on whole blocks at once, and *stores* results
# back. There is no indexing of single elements and no Python inside: only block operations
# (`tl.load`, `tl.store`, arithmetic, `tl.sum`, `tl.associative_scan`, ...). In this chapter:
# programs and program ids; `tl.arange`, shapes and broadcasting; loads and stores with masks; two
# blocked kernels over inputs of any length; and what Triton's CPU interpreter (which runs every
# kernel of this course when there is no GPU) hides from you.

# %%
import time

import numpy as np
import torch
import triton
import triton.language as tl

from scan_lib.runtime import INTERPRET

# %% [markdown]
# ## Programs and program ids
#
# Launching `kernel[grid](...)` runs `grid` copies of the kernel, called *programs*, on the same
# arguments. Each program asks `tl.program_id(0)` which one it is and picks its share of the work
# from that. Capital letters are pointers: a tensor argument arrives as a pointer to its first
# element, and `X + offsets` is a block of pointers.

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

try:                                                      # a block of 6 is refused when compiled
    which_program_kernel[(1,)](torch.empty(6, dtype=torch.int32, device=DEVICE), BLOCK=6)
    refusal = "none"
except Exception as error:
    refusal = f"{type(error).__name__}: {error}"
assert "power of 2" in refusal, refusal
print("BLOCK=6 is refused: arange's range must be a power of 2")

# %% [markdown]
# `BLOCK` is a `tl.constexpr`: its value is known when the kernel is compiled (one compiled version
# per value), so it can set shapes. Shapes must be compile-time constants, and `tl.arange` lengths
# must be powers of two (the cell above checks that `BLOCK=6` is refused).
#
# ## `tl.arange`, shapes and broadcasting
#
# `tl.arange(0, K)` is a block of shape `(K,)`; indexing with `[:, None]` or `[None, :]` adds an axis
# of length 1, and operations broadcast exactly as in PyTorch. A 2-D block of pointers into a
# row-major `L x K` matrix is `Y + rows[:, None] * K + cols[None, :]`.

# %%
@triton.jit
def broadcast_add_kernel(X, Y, Z, K: tl.constexpr, L: tl.constexpr):
    cols = tl.arange(0, K)                                # K
    rows = tl.arange(0, L)[:, None]                       # L x 1
    x = tl.load(X + cols)                                 # K
    y = tl.load(Y + rows * K + cols)                      # L x K   (L x 1 broadcast with K)
    tl.store(Z + rows * K + cols, x + y)                  # L x K   (K broadcast over the rows)


torch.manual_seed(0)
x_row, y_mat = torch.randn(4, device=DEVICE), torch.randn(8, 4, device=DEVICE)
z_mat = torch.empty(8, 4, device=DEVICE)
broadcast_add_kernel[(1,)](x_row, y_mat, z_mat, K=4, L=8)
assert torch.equal(z_mat, x_row + y_mat)
print("Z = X[None, :] + Y, exactly as torch broadcasts: ok")

# %% [markdown]
# ## Loads and stores with masks
#
# A block has a power-of-two length, data rarely do. `tl.load(ptrs, mask=m, other=v)` reads only
# where `m` is true and puts `v` elsewhere; `tl.store(ptrs, values, mask=m)` writes only where `m`
# is true. The kernels above got away without masks because their sizes were exactly their
# power-of-two blocks; from here on, every load and store over data has a mask, for a reason shown below.
#
# ## A blocked kernel: vector addition of any length
#
# One program per block of `BLOCK` elements, `cdiv(n, BLOCK)` programs in all; the last block is
# ragged and its tail is masked off.

# %%
@triton.jit
def vector_add_kernel(X, Y, Z, N, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)    # BLOCK
    mask = offsets < N                                          # BLOCK
    x = tl.load(X + offsets, mask=mask)
    y = tl.load(Y + offsets, mask=mask)
    tl.store(Z + offsets, x + y, mask=mask)


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
# ## A blocked kernel with a loop: row sums over any length
#
# Here each program owns one row of an `R x N` matrix and walks along it `BLOCK` columns at a time,
# accumulating in float32. A row can be longer than any block: the loop carries the partial sums
# in registers. The loop is a `while` on purpose: Triton 3.6's interpreter under NumPy 2.4 or newer
# cannot run a `for` loop whose bound is a kernel argument (it fails with "only 0-dimensional arrays
# can be converted to Python scalars"; that is why `requirements.txt` pins NumPy 2.3, and the cell
# after this one tries it with whatever NumPy you have), and a `while` loop compiles to the same
# thing on a GPU.

# %%
@triton.jit
def row_sums_kernel(X, OUT, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)                 # BLOCK partial sums
    start = 0
    while start < N:
        cols = start + tl.arange(0, BLOCK)                     # BLOCK
        acc += tl.load(X + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        start += BLOCK
    tl.store(OUT + row, tl.sum(acc, axis=0))


def row_sums(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    row_sums_kernel[(rows,)](x.contiguous(), out, n, BLOCK=block)
    return out


torch.manual_seed(2)
print(f"{'shape':>10} {'max abs err':>11}")
for shape in ((3, 1), (5, 7), (2, 1000), (4, 4097)):
    x_mat = torch.randn(shape, device=DEVICE)
    err = (row_sums(x_mat).double() - x_mat.double().sum(1)).abs().max().item()
    assert err < 1e-4 * shape[1] ** 0.5, err
    print(f"{str(shape):>10} {err:>11.1e}")

# %%
@triton.jit
def row_sums_for_kernel(X, OUT, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(X + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(OUT + row, tl.sum(acc, axis=0))


numpy_version = tuple(int(part) for part in np.__version__.split(".")[:2])
known_to_fail = INTERPRET and triton.__version__.startswith("3.6.") and numpy_version >= (2, 4)
torch.manual_seed(3)
x_for = torch.randn(2, 100, device=DEVICE)
out_for = torch.empty(2, device=DEVICE)
try:
    row_sums_for_kernel[(2,)](x_for, out_for, 100, BLOCK=64)
except Exception as error:
    print(f"numpy {np.__version__}, interpreter: {type(error).__name__}: {error}")
    assert INTERPRET and numpy_version >= (2, 4), "only the interpreter under NumPy >= 2.4 is known to fail"
else:
    assert not known_to_fail, "Triton 3.6's interpreter under NumPy >= 2.4 was expected to fail"
    assert torch.allclose(out_for, x_for.sum(1), atol=1e-4)
    print(f"numpy {np.__version__}: the for loop over a runtime bound ran and is correct")

# %% [markdown]
# ## The CPU interpreter and what it hides
#
# Without a GPU, `TRITON_INTERPRET=1` makes `@triton.jit` return an *interpreted* function: each
# program runs in Python, on NumPy arrays, over CPU tensors. That lets anyone run this course, and
# the same kernel source runs on a GPU unchanged. But the interpreter is not a GPU, and five
# differences matter.
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
# Under the interpreter both counts are right. On a GPU the racy count comes out below the number
# of programs (the cell asserts it there). A test suite that only runs on the CPU cannot catch a race.
#
# ### 2. `tl.associative_scan` folds left to right, so a non-associative combine passes
#
# `tl.associative_scan(x, 0, f)` is allowed to group the combines in any tree, because it assumes
# `f` is associative. The interpreter evaluates it as a plain left fold $((x_0 f x_1) f x_2) \dots$,
# so with subtraction, which is not associative, it returns the left fold, as a sequential loop
# would. A GPU evaluates a tree and returns something else.

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
# A kernel only receives a pointer: it does not know where the tensor ends. Below, `x` is the first
# five elements of an eight-element buffer whose tail holds 100. Loading a block of 8 without a
# mask reads the neighbours, on the CPU and on a GPU alike, with no error. (Past the end of an
# allocation the result is garbage or a crash, depending on luck.) The mask makes it right.

# %%
@triton.jit
def sum_of_block_kernel(X, OUT, N, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    if MASKED:
        x = tl.load(X + offsets, mask=offsets < N, other=0.0)
    else:
        x = tl.load(X + offsets)                          # reads BLOCK values whatever N is
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
# ### 4. Rounding differs from the GPU's
#
# The interpreter computes with NumPy; a GPU uses its own instructions, some of them fast
# approximations (`tl.exp` becomes a hardware `ex2.approx` after a multiplication by
# $\log_2 e$), and sums in a different order. Results agree to a few units in the last place, not
# bit for bit, which is why every check in this course compares with a float64 reference within a
# tolerance instead of with `torch.equal`.

# %%
@triton.jit
def exp_kernel(X, Y, N, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    tl.store(Y + offsets, tl.exp(tl.load(X + offsets, mask=mask)), mask=mask)


x_exp = torch.linspace(-5, 5, 4097, device=DEVICE)
y_exp = torch.empty_like(x_exp)
exp_kernel[(triton.cdiv(x_exp.numel(), 1024),)](x_exp, y_exp, x_exp.numel(), BLOCK=1024)
exact = torch.exp(x_exp.double())
relative = ((y_exp.double() - exact).abs() / exact).max().item()
differ = (y_exp != torch.exp(x_exp)).sum().item()
print(f"tl.exp vs float64 exp: max relative error {relative:.1e}; differs bitwise from torch.exp (float32) at {differ} of {x_exp.numel()}")
assert relative < 2e-6 and differ > 0

# %% [markdown]
# Half precision works under the interpreter (bfloat16 and float16 tensors load, store and convert),
# but one conversion rounds differently: the interpreter turns float32 into bfloat16 by dropping the
# low 16 bits (truncation, towards zero), while PyTorch and a GPU round to nearest. Float32 to
# float16 is rounded to nearest in both. Take $1 + 2^{-8} + 2^{-10}$: bfloat16 keeps 8 significant
# bits, so the neighbours are $1$ and $1 + 2^{-7}$, and the nearest is $1 + 2^{-7}$.

# %%
@triton.jit
def convert_kernel(X, Y, N, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < N
    tl.store(Y + offsets, tl.load(X + offsets, mask=mask).to(Y.dtype.element_ty), mask=mask)


x_round = torch.tensor([1 + 2**-8 + 2**-10, -(1 + 2**-8 + 2**-10)], device=DEVICE)   # float32
for dtype in (torch.bfloat16, torch.float16):
    y_round = torch.empty(2, dtype=dtype, device=DEVICE)
    convert_kernel[(1,)](x_round, y_round, 2, BLOCK=2)
    nearest = x_round.to(dtype)
    print(f"{str(dtype):>15}: kernel {y_round.tolist()}, torch (nearest) {nearest.tolist()}")
    if INTERPRET and dtype == torch.bfloat16:
        assert torch.equal(y_round.float(), torch.tensor([1.0, -1.0], device=DEVICE)), "truncated"
        assert not torch.equal(y_round, nearest)
    else:
        assert torch.equal(y_round, nearest)

# %% [markdown]
# ### 5. Speed
#
# The interpreter pays Python overhead for every operation of every program: the same vector
# addition is orders of magnitude slower than PyTorch's, and many small blocks cost far more than a
# few large ones. Hence two size profiles in every chapter (`if ON_GPU:` realistic sizes, else
# small ones), and no timings on the CPU beyond this cell. On a GPU, timings come from `median_us`
# (defined above), that is `triton.testing.do_bench`, which synchronises and takes the median of
# many runs.

# %%
torch.manual_seed(4)
x_speed, y_speed = torch.randn(2**14, device=DEVICE), torch.randn(2**14, device=DEVICE)
if INTERPRET:
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
    kernel_us = median_us(lambda: vector_add(x_speed, y_speed, 1024))
    torch_us = median_us(lambda: x_speed + y_speed)
    print(f"{torch.cuda.get_device_name(DEVICE)}: 2^14 float32 additions, Triton {kernel_us:.1f} us, torch {torch_us:.1f} us")

# %% [markdown]
# ## Why the setup cell comes first
#
# `@triton.jit` looks at `TRITON_INTERPRET` at the moment it *defines* a kernel, and returns either
# a compiled GPU function or an interpreted one. Setting the variable later does not change
# kernels already defined, and a kernel defined while it was unset is compiled for a GPU: without
# one, its first launch fails. That is why `import scan_lib`, which sets the variable when no GPU is
# visible, is the first thing every chapter does.

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
# ## Summary
#
# * A launch runs `grid` programs; each finds its block from `tl.program_id` and `tl.arange`.
# * Shapes are compile-time constants (powers of two for `tl.arange`) and broadcast like PyTorch.
# * Mask every load and store: a kernel reads past the end of a tensor without complaint.
# * The interpreter runs the same kernels on a CPU but serialises programs, folds scans left to
#   right, rounds like NumPy (and truncates float32 to bfloat16) and is slow. Test combine operators for associativity in PyTorch, and
#   run everything on a real GPU before trusting it.
#
# Next: chapter 01 scans with `+`, first in one block, then at any length.
