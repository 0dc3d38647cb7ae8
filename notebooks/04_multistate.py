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
# Chapters 02 and 03 scanned one scalar state per position. A state space model such as Mamba keeps
# **N states per position** (N = 16 in Mamba), each with its own decay, and reads the output out of
# all of them. The arithmetic hardly changes; what changes is the amount of memory the states would
# occupy if we wrote them out. This chapter is about not writing them out.
#
# You will learn:
# 1. the multi-state recurrence and a plain float64 PyTorch reference;
# 2. why the $(L, N)$ states, not the arithmetic, are the expensive part, counted in bytes;
# 3. the simplest kernel: one $L_{\text{block}} \times N$ tile, `tl.associative_scan` along time, a sum over $N$;
# 4. the blocked kernel: one program per sequence walks over chunks, the $N$ states stay in registers,
#    and only the state at each chunk boundary is written to memory;
# 5. the backward pass, derived, written as a kernel that *recomputes* the states from those
#    chunk-boundary states, and checked against autograd in float64;
# 6. the exported `scan_lib.multistate_scan` and, on a GPU, a benchmark against a PyTorch version
#    that materialises every state.

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
import matplotlib
import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

from scan_lib.ema import first_order_op
from scan_lib.runtime import save_figure

# %% [markdown]
# ## 1 · The recurrence
#
# At every position $t$ there are $N$ hidden states $h_t[0], \dots, h_t[N-1]$. Each one is the
# first-order recurrence of chapter 02 with its own gate $a_t[n]$ and its own input weight $b_t[n]$,
# all fed by the same scalar input $x_t$; the output mixes them with weights $c_t[n]$:
#
# $$h_t[n] = a_t[n]\, h_{t-1}[n] + b_t[n]\, x_t, \qquad y_t = \sum_{n=0}^{N-1} c_t[n]\, h_t[n],
# \qquad h_{-1}[n] = h_{\text{init}}[n] \ (\text{zero by default}).$$
#
# This is exactly the shape of Mamba's scan for one channel, before discretisation (chapter 05 will
# set $a = e^{\Delta A}$ and $b = \Delta B$). Mamba stores $B$ and $C$ as `(batch, N, L)`, so we do too:
# `a`, `b`, `c` are `(batch, N, L)`, `x` and `y` are `(batch, L)`. A "batch" row here is one independent
# sequence; in Mamba it would be one (sample, channel) pair.
#
# The reference is the loop itself, in float64. It is exported: the tests use it.

# %%
#| export
"""The multi-state scan h_t[n] = a_t[n] h_{t-1}[n] + b_t[n] x_t, y_t = sum_n c_t[n] h_t[n]: a float64
reference, a fused Triton forward and backward that keep the N states on chip, and the public API."""
import torch
import triton
import triton.language as tl

from scan_lib.ema import accumulator_dtype, first_order_op
from scan_lib.runtime import check_float_tensor, check_same_device


def multistate_scan_ref(a, b, c, x, initial_state=None):
    """The recurrence as a loop over time, differentiable by autograd (run it in float64 for checks).

    a, b, c: (batch, N, L); x: (batch, L); initial_state: (batch, N) or None (zeros).
    Returns y (batch, L) and the last state h_{L-1} (batch, N)."""
    batch, n_states, length = a.shape
    h = a.new_zeros(batch, n_states) if initial_state is None else initial_state  # batch x N
    ys = []
    for t in range(length):
        h = a[:, :, t] * h + b[:, :, t] * x[:, None, t]  # batch x N
        ys.append((c[:, :, t] * h).sum(dim=1))            # batch
    return torch.stack(ys, dim=1), h


# %% [markdown]
# A first look: four exponential moving averages of a pulse, with constant gates
# $a[n] = 1 - 2^{-(n+1)}$ (memories of about 1, 3, 7 and 15 steps), input weights $b[n] = 1 - a[n]$,
# and $c[n] = 1/N$, so that $y$ is their average. The states never talk to each other (nothing couples $n$
# and $n'$), so the $N$-state scan must equal $N$ separate one-state scans added together: the cell
# asserts it.

# %%
length, n_states = 128, 4
x_demo = torch.zeros(1, length, dtype=torch.float64)
x_demo[0, 16:64] = 1.0                                      # 1 x L: a pulse
alpha = (1 - 0.5 ** (torch.arange(n_states, dtype=torch.float64) + 1))[None, :, None].expand(1, n_states, length)
a_demo, b_demo = alpha, 1 - alpha                                       # 1 x N x L
c_demo = torch.full((1, n_states, length), 1 / n_states, dtype=torch.float64)

y_demo, _ = multistate_scan_ref(a_demo, b_demo, c_demo, x_demo)
states_demo = torch.stack(
    [multistate_scan_ref(a_demo[:, n:n + 1], b_demo[:, n:n + 1], c_demo[:, n:n + 1], x_demo)[0][0] for n in range(n_states)]
)                                                            # N x L: c[n] h_t[n], one single-state scan per n
assert torch.allclose(y_demo[0], states_demo.sum(0), rtol=1e-12, atol=1e-12)
print("N-state scan == sum of N one-state scans:", True)

fig, ax = plt.subplots(figsize=(8, 3))
ax.plot(x_demo[0], "k--", lw=1, label="$x_t$")
for n in range(n_states):
    ax.plot(states_demo[n] * n_states, label=f"$h_t[{n}]$, $a={alpha[0, n, 0]:.4f}$")
ax.plot(y_demo[0], "k", lw=2, label=r"$y_t=\frac{1}{4}\sum_n h_t[n]$")
ax.set_xlabel("t"); ax.legend(fontsize=8, loc="upper right"); ax.set_title("four states, four decay rates, one output")
save_figure(fig, "multistate_emas.png"); plt.close(fig)

# %% [markdown]
# ![four EMAs and their sum](../figures/multistate_emas.png)

# %% [markdown]
# ## 2 · The states are the expensive part
#
# Per position the inputs are $3N + 1$ numbers ($a, b, c$ and $x$) and the output is one. The states
# are $N$ numbers per position too, so an implementation that *writes the states out* (scan kernel
# writes $h$, a second kernel reads $h$ and $c$ and reduces over $N$) moves two extra $(B, N, L)$
# tensors through HBM: $5BNL + 2BL$ numbers instead of $3BNL + 2BL$. Training makes it worse: autograd
# keeps the states for the backward pass, $BNL$ numbers of activation memory per layer. And a
# PyTorch parallel scan (log-depth doubling, below) writes and reads whole $(B, N, L)$ tensors at
# every one of its $\lceil\log_2 L\rceil$ steps.
#
# The hardware-aware design (the one Mamba's CUDA kernel uses) never writes the states: a chunk of
# $L_{\text{block}} \times N$ states lives in registers, is reduced to $y$ on chip, and only the $N$
# states at the end of the chunk are carried to the next chunk, in registers too. For the backward
# pass it saves the carried state at each chunk boundary, $B \cdot \lceil L / L_{\text{block}} \rceil
# \cdot N$ numbers, and recomputes the states inside a chunk from them.
#
# Here is the count at a realistic size: $B = 4096$ sequences (say 4 samples x 1024 channels of a
# small Mamba layer) of length $L = 1024$ with $N = 16$ states, in float32.

# %%
def traffic_bytes(batch, length, n_states, itemsize=4):
    """Bytes that must cross HBM for the forward pass of each design (lower bounds: every tensor
    read or written once per pass that touches it)."""
    states, seq = batch * n_states * length, batch * length
    steps = (length - 1).bit_length()                            # ceil(log2 L) doubling steps
    return {
        "fused (states on chip)": (3 * states + 2 * seq) * itemsize,              # read a,b,c,x; write y
        "two passes (states via HBM)": (5 * states + 2 * seq) * itemsize,         # + write h, read h
        "PyTorch doubling scan": ((2 + 6 * steps + 4) * states + 2 * seq) * itemsize,
        # b*x: read b, write bx; each step: read a and h twice, write both; then c*h: read c, h,
        # write c*h, read it back for the sum over N
    }


def training_traffic_bytes(batch, length, n_states, itemsize=4):
    """Forward + backward of the fused design: forward as above; the backward reads a, b, c, x, dy and
    writes da, db, dc, dx (the chunk-boundary states are L_block times smaller and left out)."""
    states, seq = batch * n_states * length, batch * length
    return traffic_bytes(batch, length, n_states, itemsize)["fused (states on chip)"] + (6 * states + 3 * seq) * itemsize


batch_big, length_big, n_states_big = 4096, 1024, 16
traffic = traffic_bytes(batch_big, length_big, n_states_big)
for design, nbytes in traffic.items():
    print(f"{design:30s} {nbytes / 2**20:9.0f} MiB")
states_bytes = batch_big * n_states_big * length_big * 4
print(f"{'all states (B, N, L)':30s} {states_bytes / 2**20:9.0f} MiB   <- kept for backward if materialised")
block_big = 64                                               # the default chunk length for N = 16
print(f"{f'chunk-boundary states, L_block={block_big}':30s} {states_bytes / block_big / 2**20:9.0f} MiB   <- kept by the fused design")
assert traffic["fused (states on chip)"] < traffic["two passes (states via HBM)"] < traffic["PyTorch doubling scan"]
assert traffic["two passes (states via HBM)"] / traffic["fused (states on chip)"] > 1.6

# %% [markdown]
# The picture below (drawn by the next cell) shows the tensors, their shapes, and which of them
# cross the boundary between HBM and the chip in each design, with the sizes above.

# %%
def draw_memory_figure(batch, length, n_states, block_l, itemsize=4):
    """Two panels: what each design reads from / writes to HBM and what stays on chip."""
    mib = lambda numel: f"{numel * itemsize / 2**20:.0f} MiB"
    bnl, bl = batch * n_states * length, batch * length
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    designs = {
        "two passes: states written to HBM": (
            [("a  (B,N,L)", bnl, "r"), ("b  (B,N,L)", bnl, "r"), ("x  (B,L)", bl, "r"),
             ("h  (B,N,L)", bnl, "rw"), ("c  (B,N,L)", bnl, "r"), ("y  (B,L)", bl, "w")],
            ["scan kernel: h = a*h + b*x", "reduce kernel: y = sum_n c*h"]),
        "fused: states stay on chip": (
            [("a  (B,N,L)", bnl, "r"), ("b  (B,N,L)", bnl, "r"), ("c  (B,N,L)", bnl, "r"), ("x  (B,L)", bl, "r"),
             ("y  (B,L)", bl, "w"), (f"h at chunk\nstarts  (B,L/{block_l},N)", bnl // block_l, "w*")],
            [f"tile {block_l} x N: scan,\nthen y = sum over N of c*h", "carry: N states\nin registers"]),
    }
    colours = {"r": "#4c72b0", "w": "#c44e52", "rw": "#8172b2", "w*": "#dd8452"}
    for ax, (title, (tensors, chip_boxes)) in zip(axes, designs.items()):
        ax.set_xlim(0, 12); ax.set_ylim(0, 8); ax.axis("off"); ax.set_title(title)
        ax.add_patch(matplotlib.patches.Rectangle((0.2, 4.6), 11.6, 3.1, fc="#eeeeee", ec="k"))
        ax.text(0.4, 7.35, "HBM (off chip, ~4.8 TB/s)", fontsize=9, weight="bold")
        ax.add_patch(matplotlib.patches.Rectangle((0.2, 0.3), 11.6, 2.6, fc="#fff7e0", ec="k"))
        ax.text(0.4, 0.5, "on chip: registers / SRAM of one program", fontsize=9, weight="bold")
        for i, (name, numel, mode) in enumerate(tensors):
            x0 = 0.4 + i * 1.9
            ax.add_patch(matplotlib.patches.Rectangle((x0, 5.0), 1.7, 1.9, fc="white", ec=colours[mode], lw=2))
            ax.text(x0 + 0.85, 6.2, name.replace("  ", "\n"), ha="center", va="center", fontsize=7)
            ax.text(x0 + 0.85, 5.3, mib(numel), ha="center", fontsize=7.5)
            up, down = "w" in mode, "r" in mode
            if down:
                ax.annotate("", (x0 + 0.6, 2.95), (x0 + 0.6, 4.95), arrowprops=dict(arrowstyle="->", color=colours["r"]))
            if up:
                ax.annotate("", (x0 + 1.1, 4.95), (x0 + 1.1, 2.95), arrowprops=dict(arrowstyle="->", color=colours["w"]))
        for j, label in enumerate(chip_boxes):
            ax.add_patch(matplotlib.patches.FancyBboxPatch((0.6 + j * 5.6, 1.2), 5.0, 1.2, boxstyle="round", fc="white"))
            ax.text(3.1 + j * 5.6, 1.8, label, ha="center", va="center", fontsize=8.5)
        moved = sum(numel * (mode.count("r") + mode.count("w")) for _, numel, mode in tensors)
        ax.text(6, 3.75, f"moved through HBM: {moved * itemsize / 2**20:.0f} MiB", ha="center", fontsize=10,
                weight="bold", bbox=dict(fc="white", ec="none"), zorder=3)
    fig.suptitle(f"multi-state scan, B={batch}, L={length}, N={n_states}, float32   (blue: read, red: written, orange: saved for the backward)")
    return fig, moved


fig, fused_moved = draw_memory_figure(batch_big, length_big, n_states_big, block_big)
save_figure(fig, "multistate_memory.png"); plt.close(fig)
# the figure's fused total = the count above plus the chunk-boundary states saved for backward
assert fused_moved * 4 == traffic["fused (states on chip)"] + states_bytes // block_big

# %% [markdown]
# ![HBM traffic of the two designs](../figures/multistate_memory.png)

# %% [markdown]
# ## 3 · The simplest kernel: one block holds the whole sequence
#
# One program per sequence loads a 2-D tile of shape $L_{\text{block}} \times N$ (time along axis 0,
# state along axis 1) for each of $a$, $b$, $c$, and a vector of $L_{\text{block}}$ inputs $x$. The
# pairs $(a_t[n],\, b_t[n] x_t)$ are scanned along axis 0 with the combine operator of chapter 02,
# `first_order_op`, imported from `scan_lib.ema` (it composes *earlier then later*:
# $(a_1, b_1) \circ (a_2, b_2) = (a_1 a_2,\, a_2 b_1 + b_2)$). Every column $n$ is an independent
# scan, so a single `tl.associative_scan(..., axis=0)` does all $N$ at once. The second output of
# the scan is the state $h_t[n]$ (from $h_{-1} = 0$); multiplying by $c$ and summing over axis 1
# gives $y$. The $L \times N$ states exist only in registers.
#
# Positions past $L$ and states past $N$ (tiles are powers of two) are masked: the padding loads
# $a = 1$, $b = 0$, the identity step, so it cannot disturb anything.

# %%
@triton.jit
def multistate_single_block_kernel(
    A, B, C, X, Y,          # A, B, C: batch x N x L;  X, Y: batch x L
    L, N,
    BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_L)                                  # BLOCK_L: time
    n = tl.arange(0, BLOCK_N)                                  # BLOCK_N: state
    mask = (t < L)[:, None] & (n < N)[None, :]                 # BLOCK_L x BLOCK_N
    tile = seq * N * L + n[None, :] * L + t[:, None]           # BLOCK_L x BLOCK_N offsets
    a = tl.load(A + tile, mask=mask, other=1.0).to(tl.float32)
    b = tl.load(B + tile, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(C + tile, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + seq * L + t, mask=t < L, other=0.0).to(tl.float32)   # BLOCK_L
    _, h = tl.associative_scan((a, b * x[:, None]), axis=0, combine_fn=first_order_op)  # BLOCK_L x BLOCK_N
    y = tl.sum(c * h, axis=1)                                  # BLOCK_L
    tl.store(Y + seq * L + t, y.to(Y.dtype.element_ty), mask=t < L)


def multistate_single_block(a, b, c, x):
    batch, n_states, length = a.shape
    y = torch.empty_like(x)
    grid = (batch,)
    multistate_single_block_kernel[grid](
        a, b, c, x, y, length, n_states,
        BLOCK_L=triton.next_power_of_2(length), BLOCK_N=triton.next_power_of_2(n_states),
    )
    return y


def random_inputs(batch, n_states, length, dtype=torch.float32, seed=0):
    """Gates in (0.5, 1) like exp(delta*A) in Mamba; b, c, x standard normal. Shapes (B,N,L) x3, (B,L)."""
    g = torch.Generator().manual_seed(seed)
    a = 0.5 + 0.5 * torch.rand(batch, n_states, length, generator=g, dtype=torch.float64)
    b, c = (torch.randn(batch, n_states, length, generator=g, dtype=torch.float64) for _ in range(2))
    x = torch.randn(batch, length, generator=g, dtype=torch.float64)
    return [t.to(device=DEVICE, dtype=dtype) for t in (a, b, c, x)]


def rel_err(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


print(f"{'L':>5} {'N':>3} {'max rel err':>12}  ok")
for length in (1, 7, 129):
    for n_states in (4, 5):
        a, b, c, x = random_inputs(3, n_states, length)
        y_ref, _ = multistate_scan_ref(*(t.double() for t in (a, b, c, x)))
        err = rel_err(multistate_single_block(a, b, c, x), y_ref)
        print(f"{length:5d} {n_states:3d} {err:12.2e}  {err < 1e-5}")
        assert err < 1e-5

# %% [markdown]
# This kernel is right but cannot scale: the tile grows with $L$, and at some point it no longer fits
# in registers (and Triton caps a tile at $2^{20}$ elements anyway: the cell below asserts it). The fix
# is the one from chapters 01 and 02: cut the sequence into chunks and carry a state from chunk to chunk.

# %%
assert tl.TRITON_MAX_TENSOR_NUMEL == 2**20
print(f"largest tile: {tl.TRITON_MAX_TENSOR_NUMEL} elements, e.g. L = {2**20 // 16} at N = 16 (one chunk)")

# %% [markdown]
# ## 4 · The blocked kernel: a carry of N states in registers
#
# One program still owns one sequence, but now it walks through it in chunks of $L_{\text{block}}$
# positions. Before chunk $k$ it holds $h_{\text{in}}[n]$, the $N$ states after the previous chunk.
# The scan of the chunk's pairs from the identity gives, for every position, a pair
# $(P_t[n], \tilde h_t[n])$: the product of the gates since the chunk start and the state the chunk
# would reach from zero. The true state is then one multiply-add,
#
# $$h_t[n] = P_t[n]\, h_{\text{in}}[n] + \tilde h_t[n],$$
#
# and the carry for the next chunk is the last row of the tile. (The last row is right even in a
# partial last chunk: padded rows are identity steps.) Registers cannot be indexed by a variable, so
# "row $i$ of a tile" is a masked sum over axis 0 (`row_of`).
#
# This is also where the chunk-boundary states go to memory: when the caller will need gradients, the
# program writes $h_{\text{in}}$ for every chunk, $\lceil L / L_{\text{block}} \rceil \times N$ numbers per
# sequence, for the backward pass. Accumulation is in float32 (float64 for float64 inputs); $y$ and
# the last state are written in the input dtype. This kernel is exported and used by the public API.

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
    L, N, n_chunks,                       # H_CHUNKS: batch x n_chunks x N (state entering each chunk)
    HAS_H0: tl.constexpr, SAVE_CHUNKS: tl.constexpr, ACC: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    A, B, C = A + seq * N * L, B + seq * N * L, C + seq * N * L
    X, Y = X + seq * L, Y + seq * L
    rows = tl.arange(0, BLOCK_L)                                  # BLOCK_L: time within a chunk
    n = tl.arange(0, BLOCK_N)                                     # BLOCK_N: state index
    h = tl.zeros([BLOCK_N], dtype=ACC)                            # the carry, in registers
    if HAS_H0:
        h = tl.load(H0 + seq * N + n, mask=n < N, other=0.0).to(ACC)
    chunk = 0
    while chunk < n_chunks:   # a while loop: Triton 3.6's interpreter under NumPy >= 2.4 cannot `range` over a runtime int
        t = chunk * BLOCK_L + rows                                # BLOCK_L
        mask = (t < L)[:, None] & (n < N)[None, :]                # BLOCK_L x BLOCK_N
        tile = n[None, :] * L + t[:, None]                        # BLOCK_L x BLOCK_N offsets
        if SAVE_CHUNKS:
            tl.store(H_CHUNKS + (seq * n_chunks + chunk) * N + n, h, mask=n < N)
        a = tl.load(A + tile, mask=mask, other=1.0).to(ACC)
        b = tl.load(B + tile, mask=mask, other=0.0).to(ACC)
        c = tl.load(C + tile, mask=mask, other=0.0).to(ACC)
        x = tl.load(X + t, mask=t < L, other=0.0).to(ACC)        # BLOCK_L
        states = scan_tile(a, b * x[:, None], h)                  # BLOCK_L x BLOCK_N, never stored
        tl.store(Y + t, tl.sum(c * states, axis=1).to(Y.dtype.element_ty), mask=t < L)
        h = row_of(states, rows, BLOCK_L - 1)
        chunk += 1
    tl.store(H_LAST + seq * N + n, h.to(H_LAST.dtype.element_ty), mask=n < N)


# %%
#| export
MAX_STATES = 256        # BLOCK_L x BLOCK_N tiles must fit in registers
MAX_TILE = 2**14


def default_block_l(length, n_states):
    """About 1024 tile elements, at least 16 rows, no more rows than L needs."""
    return max(16, min(triton.next_power_of_2(length), 1024 // triton.next_power_of_2(n_states)))


def num_warps_for(block_l, n_states):
    """About 8 tile elements per thread (1 to 8 warps of 32): ptxas for sm_90 then fits the forward in
    ~70 registers and the backward, which holds about twice as many tiles, in ~145, without spilling."""
    return max(1, min(8, block_l * triton.next_power_of_2(n_states) // 256))


def multistate_forward(a, b, c, x, initial_state, block_l, save_chunks):
    """Launch the fused forward. Returns y (batch, L), the last state (batch, N) and, when
    save_chunks, the state entering each chunk (batch, n_chunks, N) in the accumulator dtype, else None."""
    batch, n_states, length = a.shape
    n_chunks = triton.cdiv(length, block_l)
    acc = torch.promote_types(a.dtype, torch.float32)   # float64 stays, half precision computes in float32
    y = torch.empty_like(x)
    h_last = torch.empty(batch, n_states, device=a.device, dtype=a.dtype)
    h_chunks = torch.empty(batch, n_chunks, n_states, device=a.device, dtype=acc) if save_chunks else None
    with torch.cuda.device_of(a):
        multistate_fwd_kernel[(batch,)](  # unused pointer arguments get a real tensor: y or h_last
            a, b, c, x, initial_state if initial_state is not None else h_last, y, h_last,
            h_chunks if save_chunks else y,
            length, n_states, n_chunks,
            HAS_H0=initial_state is not None, SAVE_CHUNKS=save_chunks,
            ACC=accumulator_dtype(acc),
            BLOCK_L=block_l, BLOCK_N=triton.next_power_of_2(n_states), num_warps=num_warps_for(block_l, n_states),
        )
    return y, h_last, h_chunks


# %% [markdown]
# Checks at awkward lengths and two block sizes (so that 1000 is 63 chunks of 16, or 16 chunks of
# 64 with a partial last one), with and without an initial state, in float64 against the reference.
# We also check the claim that the chunk-boundary states are the true states: the saved state
# entering chunk $k$ must equal the reference $h$ at position $k L_{\text{block}} - 1$.

# %%
def reference_states(a, b, x, initial_state=None):
    """All states, batch x N x L, by the loop (float64): only for checking the saved chunk states."""
    h = torch.zeros_like(a[:, :, 0]) if initial_state is None else initial_state
    out = []
    for t in range(a.shape[-1]):
        h = a[:, :, t] * h + b[:, :, t] * x[:, None, t]
        out.append(h)
    return torch.stack(out, dim=-1)


print(f"{'L':>5} {'block':>5} {'h0':>5} {'err y':>9} {'err last':>9} {'err chunks':>10}  ok")
for length in (1, 7, 129, 1000):
    for block_l in (16, 64):
        for with_h0 in (False, True):
            a, b, c, x = random_inputs(2, 5, length, dtype=torch.float64, seed=length)
            h0 = torch.randn(2, 5, dtype=torch.float64, device=DEVICE) if with_h0 else None
            y, h_last, h_chunks = multistate_forward(a, b, c, x, h0, block_l, save_chunks=True)
            y_ref, last_ref = multistate_scan_ref(a, b, c, x, h0)
            states = reference_states(a, b, x, h0)                           # B x N x L
            entering = torch.cat([torch.zeros_like(states[..., :1]) if h0 is None else h0[..., None],
                                  states[..., block_l - 1:-1:block_l]], dim=-1).transpose(1, 2)  # B x n_chunks x N
            errs = rel_err(y, y_ref), rel_err(h_last, last_ref), rel_err(h_chunks, entering)
            ok = max(errs) < 1e-12
            print(f"{length:5d} {block_l:5d} {str(with_h0):>5} {errs[0]:9.1e} {errs[1]:9.1e} {errs[2]:10.1e}  {ok}")
            assert ok

# %% [markdown]
# One program per sequence is the right shape when there are many sequences (in Mamba, every
# (sample, channel) pair is one, thousands of them). With only a few long sequences most of the GPU
# would sit idle; then the chunks of one sequence are processed in parallel in three phases, as in
# chapters 01 and 02: each chunk writes its $N$ composed pairs, a small scan over those gives every
# chunk its entering state, and a second pass over the chunks uses them. The states that cross HBM
# are again only the chunk-boundary ones. We leave that variant to the performance chapter.

# %% [markdown]
# ## 5 · The backward pass
#
# Let $\bar y_t = \partial \mathcal L / \partial y_t$ be given, and $\bar h_{\text{last}}[n]$ too when the
# caller used the last state. Write $\bar h_t[n]$ for the *total* derivative of the loss with respect
# to $h_t[n]$. The state $h_t[n]$ reaches the loss in two ways: directly through $y_t$ (weight
# $c_t[n]$) and through the next state $h_{t+1}[n] = a_{t+1}[n] h_t[n] + \dots$ (weight $a_{t+1}[n]$).
# So
#
# $$\bar h_t[n] = a_{t+1}[n]\, \bar h_{t+1}[n] + c_t[n]\, \bar y_t, \qquad
# \bar h_{L}[n] := \bar h_{\text{last}}[n],\ a_{L}[n] := 1 .$$
#
# This is the same first-order recurrence, **run from right to left**, per state $n$, with the gate
# **shifted by one** ($a_{t+1}$ at position $t$) and the token $c_t[n] \bar y_t$. Once $\bar h$ is
# known, every gradient is a local product (from $h_t = a_t h_{t-1} + b_t x_t$ and $y_t = \sum_n c_t h_t$):
#
# $$\bar a_t[n] = \bar h_t[n]\, h_{t-1}[n], \quad \bar b_t[n] = \bar h_t[n]\, x_t, \quad
# \bar c_t[n] = \bar y_t\, h_t[n], \quad \bar x_t = \sum_n \bar h_t[n]\, b_t[n], \quad
# \bar h_{\text{init}}[n] = a_0[n]\, \bar h_0[n].$$
#
# Note $\bar a$ needs the state *before* position $t$ and $\bar c$ the state *at* $t$: the backward
# needs the forward states. Before writing a kernel, the formulas themselves, as a PyTorch loop, are
# checked against autograd.

# %%
def multistate_backward_ref(a, b, c, x, initial_state, dy, dh_last):
    """The formulas above as loops (float64). Returns da, db, dc, dx, dh_init."""
    states = reference_states(a, b, x, initial_state)                          # B x N x L
    h_prev = torch.cat([initial_state[..., None], states[..., :-1]], dim=-1)    # h_{t-1}
    g = torch.empty_like(a)                                                     # \bar h, B x N x L
    carry, gate = dh_last, torch.ones_like(dh_last)                             # \bar h_L, a_L
    for t in reversed(range(a.shape[-1])):
        carry = gate * carry + c[:, :, t] * dy[:, None, t]
        g[:, :, t], gate = carry, a[:, :, t]
    return g * h_prev, g * x[:, None, :], dy[:, None, :] * states, (g * b).sum(1), a[:, :, 0] * g[:, :, 0]


torch.manual_seed(1)
a, b, c, x = (t.requires_grad_() for t in random_inputs(2, 3, 50, dtype=torch.float64, seed=1))
h0 = torch.randn(2, 3, dtype=torch.float64, device=DEVICE, requires_grad=True)
dy, dh_last = torch.randn(2, 50, dtype=torch.float64, device=DEVICE), torch.randn(2, 3, dtype=torch.float64, device=DEVICE)
y_ref, last_ref = multistate_scan_ref(a, b, c, x, h0)
autograd_grads = torch.autograd.grad((y_ref, last_ref), (a, b, c, x, h0), (dy, dh_last))
with torch.no_grad():
    formula_grads = multistate_backward_ref(a, b, c, x, h0, dy, dh_last)
for name, got, want in zip(("a", "b", "c", "x", "h0"), formula_grads, autograd_grads):
    print(f"d{name:3s} max abs diff {(got - want).abs().max().item():.1e}")
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)

# %% [markdown]
# ### The backward kernel: states recomputed from the chunk boundaries
#
# Storing all $h_t[n]$ for the backward would bring back exactly the $(B, N, L)$ tensor we avoided.
# Instead the forward saved only the state entering each chunk, and the backward **recomputes** the
# states inside a chunk (as Mamba does): that costs one more scan over data already on chip, cheap
# next to an extra $(B, N, L)$ round trip through HBM.
#
# One program per sequence walks the chunks **from last to first**, carrying $\bar h$ for the $N$
# states in registers (the adjoint flows right to left). For chunk $k$ starting at $s$:
# 1. load the saved $h_{s-1}$ and scan the pairs shifted right by one position,
#    $(a_{t-1}, b_{t-1} x_{t-1})$ with the identity at the first row: that gives $h_{t-1}$ for every row
#    directly, and then $h_t = a_t h_{t-1} + b_t x_t$ is elementwise;
# 2. scan the pairs $(a_{t+1}[n], c_t[n] \bar y_t)$ with `reverse=True` (Triton's reverse scan
#    composes from the end of the axis, so the same `first_order_op` applies, *later then earlier*),
#    and apply the carry: $\bar h_t = Q_t \bar h_{\text{carry}} + \tilde g_t$, where $Q_t$ is the product of
#    the shifted gates from $t$ to the chunk's end and $\tilde g_t$ the adjoint the chunk gives from zero;
#    $a_{t+1}$ is loaded one position to the right, so the last row of a chunk already reads the next
#    chunk's first gate, and the position $t = L - 1$ reads the virtual $a_L = 1$ (masked load, `other=1`);
# 3. write the four gradients; the new carry is the first row, $\bar h_s$.
#
# After the last (leftmost) chunk, $\bar h_{\text{init}} = a_0 \bar h_0$.

# %%
#| export
@triton.jit
def multistate_bwd_kernel(
    A, B, C, X, H_CHUNKS, DY, DH_LAST,    # A, B, C: batch x N x L; X, DY: batch x L; H_CHUNKS: batch x n_chunks x N
    DA, DB, DC, DX, DH0,                  # DA, DB, DC: batch x N x L; DX: batch x L; DH0, DH_LAST: batch x N
    L, N, n_chunks,
    HAS_DH_LAST: tl.constexpr, ACC: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    A, B, C = A + seq * N * L, B + seq * N * L, C + seq * N * L
    DA, DB, DC = DA + seq * N * L, DB + seq * N * L, DC + seq * N * L
    X, DY, DX = X + seq * L, DY + seq * L, DX + seq * L
    rows = tl.arange(0, BLOCK_L)                                  # BLOCK_L: time within a chunk
    n = tl.arange(0, BLOCK_N)                                     # BLOCK_N: state index
    g = tl.zeros([BLOCK_N], dtype=ACC)                            # adjoint carry \bar h, in registers
    if HAS_DH_LAST:
        g = tl.load(DH_LAST + seq * N + n, mask=n < N, other=0.0).to(ACC)
    chunk = n_chunks - 1
    while chunk >= 0:                                             # right to left
        t = chunk * BLOCK_L + rows                                # BLOCK_L
        t_ok = t < L
        mask = t_ok[:, None] & (n < N)[None, :]                   # BLOCK_L x BLOCK_N
        tile = n[None, :] * L + t[:, None]                        # BLOCK_L x BLOCK_N offsets
        # 1. recompute h_{t-1} and h_t from the state that entered the chunk
        h_in = tl.load(H_CHUNKS + (seq * n_chunks + chunk) * N + n, mask=n < N, other=0.0)
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
        # 2. the adjoint: reversed scan of (a_{t+1}, c_t dy_t), then the carry from the right
        a_next = tl.load(A + tile + 1, mask=(t + 1 < L)[:, None] & (n < N)[None, :], other=1.0).to(ACC)
        a_suffix, g_from_zero = tl.associative_scan((a_next, c * dy[:, None]), axis=0,
                                                    combine_fn=first_order_op, reverse=True)
        g_tile = a_suffix * g[None, :] + g_from_zero                     # \bar h_t
        # 3. the gradients
        tl.store(DA + tile, (g_tile * h_prev).to(DA.dtype.element_ty), mask=mask)
        tl.store(DB + tile, (g_tile * x[:, None]).to(DB.dtype.element_ty), mask=mask)
        tl.store(DC + tile, (h * dy[:, None]).to(DC.dtype.element_ty), mask=mask)
        tl.store(DX + t, tl.sum(g_tile * b, axis=1).to(DX.dtype.element_ty), mask=t_ok)
        g = row_of(g_tile, rows, 0)
        chunk -= 1
    a_first = tl.load(A + n * L, mask=n < N, other=0.0).to(ACC)
    tl.store(DH0 + seq * N + n, (a_first * g).to(DH0.dtype.element_ty), mask=n < N)


def multistate_backward(a, b, c, x, h_chunks, dy, dh_last, block_l):
    """Launch the fused backward. dy: (batch, L) or None; dh_last: (batch, N) or None.
    Returns da, db, dc (batch, N, L), dx (batch, L), dh_init (batch, N), in the inputs' dtype."""
    batch, n_states, length = a.shape
    dy = torch.zeros_like(x) if dy is None else dy.contiguous()
    da, db, dc = torch.empty_like(a), torch.empty_like(b), torch.empty_like(c)
    dx, dh0 = torch.empty_like(x), torch.empty(batch, n_states, device=a.device, dtype=a.dtype)
    with torch.cuda.device_of(a):
        multistate_bwd_kernel[(batch,)](
            a, b, c, x, h_chunks, dy, dh_last.contiguous() if dh_last is not None else dh0,
            da, db, dc, dx, dh0,
            length, n_states, h_chunks.shape[1],
            HAS_DH_LAST=dh_last is not None,
            ACC=accumulator_dtype(h_chunks.dtype),
            BLOCK_L=block_l, BLOCK_N=triton.next_power_of_2(n_states), num_warps=num_warps_for(block_l, n_states),
        )
    return da, db, dc, dx, dh0


# %% [markdown]
# Every gradient against torch autograd through the float64 loop, at lengths 1, 7, 129, 1000, with
# block sizes 16 and 64, with an initial state and a gradient flowing into the last state, and with
# $N = 5$ (not a power of two, so the state axis is masked too).

# %%
print(f"{'L':>5} {'block':>5} " + " ".join(f"{'d' + k:>8}" for k in ("a", "b", "c", "x", "h0")) + "  ok")
for length in (1, 7, 129, 1000):
    for block_l in (16, 64):
        a, b, c, x = (t.requires_grad_() for t in random_inputs(2, 5, length, dtype=torch.float64, seed=length))
        h0 = torch.randn(2, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
        dy = torch.randn(2, length, dtype=torch.float64, device=DEVICE)
        dh_last = torch.randn(2, 5, dtype=torch.float64, device=DEVICE)
        y_ref, last_ref = multistate_scan_ref(a, b, c, x, h0)
        want = torch.autograd.grad((y_ref, last_ref), (a, b, c, x, h0), (dy, dh_last))
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
# `multistate_scan(a, b, c, x, initial_state=None, return_last_state=False, block_l=None)`:
#
# - `a`, `b`, `c`: `(batch, N, L)` (Mamba's layout for $B$ and $C$), `x`: `(batch, L)`, `initial_state`:
#   `(batch, N)` or `None` (zeros); all one floating dtype, contiguous, on one device, none empty,
#   $N \le 256$. Any $L \ge 1$.
# - returns `y` `(batch, L)`, or `(y, last_state)` with `last_state` `(batch, N)`, in the input dtype;
#   float16 / bfloat16 / float32 inputs accumulate in float32, float64 in float64.
# - differentiable in all inputs (a `torch.autograd.Function`); the forward keeps only the
#   chunk-boundary states for the backward.
# - `block_l` (a power of two, 2 to 4096, with `block_l` x N at most $2^{14}$) is the chunk length;
#   by default about 1024 / N.
#
# Bad input raises `TypeError` (not a tensor, wrong dtype, mixed dtypes, `block_l` not an int) or
# `ValueError` (shapes, empty, non-contiguous, devices, `block_l` value), naming the argument.

# %%
#| export
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
        if value.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(value.shape)})")
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


class MultistateScan(torch.autograd.Function):
    """y, last_state = scan(a, b, c, x, initial_state); the backward recomputes states per chunk."""

    @staticmethod
    def forward(ctx, a, b, c, x, initial_state, block_l):
        y, h_last, h_chunks = multistate_forward(a, b, c, x, initial_state, block_l, save_chunks=True)
        ctx.save_for_backward(a, b, c, x, h_chunks)
        ctx.block_l, ctx.has_initial_state = block_l, initial_state is not None
        ctx.set_materialize_grads(False)
        return y, h_last

    @staticmethod
    def backward(ctx, dy, dh_last):  # either may be None: set_materialize_grads(False)
        # Grad mode is on in a backward only under create_graph=True. The kernel's gradients carry no
        # graph, so second derivatives would silently miss this scan (once_differentiable's lazy error
        # is pruned by autograd.grad(..., inputs)): refuse loudly instead.
        if torch.is_grad_enabled():
            raise RuntimeError("multistate_scan has no double backward: do not use create_graph=True through it")
        a, b, c, x, h_chunks = ctx.saved_tensors
        da, db, dc, dx, dh0 = multistate_backward(a, b, c, x, h_chunks, dy, dh_last, ctx.block_l)
        return da, db, dc, dx, dh0 if ctx.has_initial_state else None, None


def multistate_scan(a, b, c, x, initial_state=None, return_last_state=False, block_l=None):
    """N hidden states per position: h_t[n] = a_t[n] h_{t-1}[n] + b_t[n] x_t, y_t = sum_n c_t[n] h_t[n].

    a, b, c: (batch, N, L); x: (batch, L); initial_state: (batch, N) or None (zeros).
    Returns y (batch, L), or (y, last_state) with last_state = h_{L-1} (batch, N) if return_last_state.
    fp16/bf16/fp32 accumulate in fp32, fp64 in fp64; outputs have the inputs' dtype. Differentiable.
    The (batch, N, L) states are never written to memory; block_l is the chunk length (power of two)."""
    block_l = check_multistate_inputs(a, b, c, x, initial_state, block_l)
    tensors = (a, b, c, x) if initial_state is None else (a, b, c, x, initial_state)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        y, h_last = MultistateScan.apply(a, b, c, x, initial_state, block_l)
    else:
        y, h_last, _ = multistate_forward(a, b, c, x, initial_state, block_l, save_chunks=False)
    return (y, h_last) if return_last_state else y


# %% [markdown]
# The public function, in every dtype, against the float64 reference computed from the same
# (rounded) inputs. The tolerance is relative to the largest $|y|$. Since the accumulation is in
# float32, for half precision it is set by the one rounding of the output to 8 (bfloat16) or 11
# (float16) significant bits: at most $2^{-8}$ or $2^{-11}$ relative, and $2^{-7}$ for bfloat16 under
# the CPU interpreter, which truncates float32 to bfloat16 instead of rounding to nearest (chapter 00).

# %%
from scan_lib.multistate import multistate_scan  # the exported copy, as a user would import it

tolerances = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
print(f"{'dtype':>15} {'L':>5} {'err y':>9} {'err last':>9}  ok")
for dtype, tol in tolerances.items():
    for length in (7, 1000):
        a, b, c, x = random_inputs(3, 16, length, dtype=dtype, seed=2)
        y, h_last = multistate_scan(a, b, c, x, return_last_state=True)
        y_ref, last_ref = multistate_scan_ref(*(t.double() for t in (a, b, c, x)))
        errs = rel_err(y, y_ref), rel_err(h_last, last_ref)
        ok = y.dtype == dtype and max(errs) < tol
        print(f"{str(dtype):>15} {length:5d} {errs[0]:9.1e} {errs[1]:9.1e}  {ok}")
        assert ok

# %% [markdown]
# `torch.autograd.gradcheck` (finite differences, float64) on a tiny problem, $L = 5$ with
# `block_l=2`, so that three chunks (the last one partial) are crossed, through both outputs.

# %%
a, b, c, x = (t.requires_grad_() for t in random_inputs(1, 2, 5, dtype=torch.float64, seed=3))
h0 = torch.randn(1, 2, dtype=torch.float64, device=DEVICE, requires_grad=True)
assert torch.autograd.gradcheck(
    lambda *args: multistate_scan(*args, return_last_state=True, block_l=2), (a, b, c, x, h0)
)
print("gradcheck passed")

# %% [markdown]
# Bad input gets an exception that names the argument:

# %%
a, b, c, x = random_inputs(2, 4, 9)
bad_calls = {
    "x with the wrong length": (lambda: multistate_scan(a, b, c, x[:, :5].contiguous()), ValueError, "x"),
    "c in float64": (lambda: multistate_scan(a, b, c.double(), x), TypeError, "c"),
    "b as a list": (lambda: multistate_scan(a, b.tolist(), c, x), TypeError, "b"),
    "a 2-D": (lambda: multistate_scan(a[0], b, c, x), ValueError, "a"),
    "a non-contiguous view": (lambda: multistate_scan(a.transpose(1, 2).contiguous().transpose(1, 2), b, c, x), ValueError, "a"),
    "all empty (L = 0)": (lambda: multistate_scan(a[..., :0], b[..., :0], c[..., :0], x[:, :0]), ValueError, "a"),
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

# %% [markdown]
# ## 7 · Memory kept for the backward pass
#
# What `MultistateScan` saves besides its inputs is the chunk-boundary states, $L_{\text{block}}$
# times fewer numbers than all the states autograd keeps for the loop (or for any PyTorch version
# that materialises the states). The cell counts the saved tensor at the realistic size without
# allocating anything.

# %%
assert block_big == default_block_l(length_big, n_states_big)
n_chunks_big = triton.cdiv(length_big, block_big)
saved_chunk_states = batch_big * n_chunks_big * n_states_big * 4
print(f"B={batch_big}, L={length_big}, N={n_states_big}, block_l={block_big}: chunk states "
      f"{saved_chunk_states / 2**20:.1f} MiB vs all states {states_bytes / 2**20:.0f} MiB")
assert states_bytes == saved_chunk_states * block_big

# %% [markdown]
# ## 8 · GPU benchmark
#
# At $B = 4096$, $L = 1024$, $N = 16$ (float32 and bfloat16): the fused kernel against a PyTorch
# version that materialises every state. That version is a real parallel scan, not a Python loop:
# Hillis-Steele doubling, $\lceil \log_2 L \rceil$ steps, each composing every position with the one
# `shift` places before it, all $(B, N, L)$ at once; then $y = \sum_n c \odot h$. It is checked
# against the reference first (on the CPU too, at a small size). The memory floor is the fused design's
# bytes divided by the copy bandwidth measured in the same cell (`copy_bandwidth`, chapter 00).

# %%
def multistate_scan_materialised(a, b, c, x):
    """All (batch, N, L) states in memory: a log-depth doubling scan in PyTorch, then sum over N."""
    a_acc, h = a, b * x[:, None, :]                                   # B x N x L each
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
if not ON_GPU:
    print("skipped: no GPU (the benchmark needs do_bench on CUDA)")
else:
    from scan_lib.runtime import copy_bandwidth, median_us

    def device_inputs(dtype):
        """Benchmark inputs made on the GPU directly: a in (0.5, 1), b, c, x normal."""
        shape = (batch_big, n_states_big, length_big)
        a = 0.5 + 0.5 * torch.rand(shape, device=DEVICE)
        b, c = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)
        x = torch.randn(batch_big, length_big, device=DEVICE)
        return [t.to(dtype) for t in (a, b, c, x)]

    print(torch.cuda.get_device_name(DEVICE))
    bandwidth = copy_bandwidth()   # bytes / s, read + write
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (1 GiB device-to-device copy)")

    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(5)
        a, b, c, x = device_inputs(dtype)
        short = str(dtype).split(".")[1]
        itemsize = a.element_size()
        y_fused = multistate_scan(a, b, c, x)
        y_check = multistate_scan_materialised(*(t.float() for t in (a, b, c, x)))
        assert rel_err(y_fused, y_check) < (1e-4 if dtype == torch.float32 else 1e-2)
        fwd_floor = traffic_bytes(batch_big, length_big, n_states_big, itemsize)["fused (states on chip)"]
        results[f"{short} fwd"] = {
            "memory floor": fwd_floor / bandwidth * 1e6,
            "fused Triton": median_us(lambda: multistate_scan(a, b, c, x)),
            "materialised PyTorch": median_us(lambda: multistate_scan_materialised(a, b, c, x)),
        }
        sweep = {bl: median_us(lambda: multistate_scan(a, b, c, x, block_l=bl)) for bl in (16, 32, 64, 128, 256)}
        for t in (a, b, c, x):
            t.requires_grad_()
        dy = torch.randn_like(x)
        results[f"{short} fwd+bwd"] = {
            "memory floor": training_traffic_bytes(batch_big, length_big, n_states_big, itemsize) / bandwidth * 1e6,
            "fused Triton": median_us(lambda: torch.autograd.grad(multistate_scan(a, b, c, x), (a, b, c, x), dy)),
            "materialised PyTorch": median_us(lambda: torch.autograd.grad(multistate_scan_materialised(a, b, c, x), (a, b, c, x), dy)),
        }
        print(f"a, b, c {tuple(a.shape)}, x {tuple(x.shape)}, {dtype}, default block_l "
              f"{default_block_l(length_big, n_states_big)}")
        for key in (f"{short} fwd", f"{short} fwd+bwd"):
            print(f"   {key:16s} " + ", ".join(f"{k} {v:.0f} us" for k, v in results[key].items()))
        print("   block_l sweep, fused fwd (us): " + ", ".join(f"{bl}: {t:.0f}" for bl, t in sweep.items()))
        for key in (f"{short} fwd", f"{short} fwd+bwd"):
            assert results[key]["fused Triton"] < results[key]["materialised PyTorch"], key
        del a, b, c, x, dy

    fig, ax = plt.subplots(figsize=(8, 3.8))
    names = list(next(iter(results.values())))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([j + i * width for j in range(len(results))], [r[name] for r in results.values()], width, label=name)
    ax.set_xticks([j + width for j in range(len(results))], list(results))
    ax.set_yscale("log"); ax.set_ylabel("time (us, median)")
    ax.set_title(f"multi-state scan, B={batch_big}, L={length_big}, N={n_states_big}, {torch.cuda.get_device_name(DEVICE)}",
                 fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, "multistate_benchmark.png"); plt.close(fig)

# %% [markdown]
# ![benchmark](../figures/multistate_benchmark.png)
#
# (The plot is written when the notebook runs on a GPU.) On an H200, one run, in microseconds:
#
# | | memory floor | fused Triton | materialised PyTorch |
# | --- | --- | --- | --- |
# | float32 fwd | 197 | 215 | 12533 |
# | float32 fwd+bwd | 588 | 783 | 43099 |
# | bfloat16 fwd | 99 | 227 | not recorded |
# | bfloat16 fwd+bwd | 294 | 768 | not recorded |
#
# and the `block_l` sweep of the float32 forward: 16: 377, 32: 257, 64: 214, 128: 405, 256: 240.
# What that says:
#
# - In float32 the fused forward is within 10% of the memory floor, and about 58 times faster than
#   the materialising scan, whose $\lceil \log_2 L \rceil$ passes over $(B, N, L)$ tensors move at
#   least 21 times the fused design's bytes (section 2). The backward (per chunk, one scan to
#   recompute the states and one reverse scan for the adjoint) brings fwd+bwd to 1.3 times its floor.
# - The default `block_l` (64 here) was the fastest; the sweep is not monotonic (128 is slower than
#   256), so chunk length is a tuning knob to measure, not to predict.
# - bfloat16 halves the bytes but not the time: the fused kernel is no faster than in float32, at
#   more than twice its floor, so in bfloat16 this kernel is **not** memory-bound. Our reading: the
#   work on chip does not shrink with the dtype (everything is converted to float32, each chunk costs
#   a $\log_2 L_{\text{block}}$-level scan with exchanges between threads, and one program walks its
#   chunks one after another); it takes about as long as the float32 traffic (about 220 us either
#   way), so in float32 it was hidden behind the traffic and in bfloat16 it is what we wait for. The
#   performance chapter is where the on-chip work gets cut.
#
# ## Summary
#
# - N states per position are N independent first-order scans that share the input and are mixed
#   into one output; a 2-D tile scanned along time handles all of them with one `tl.associative_scan`.
# - The arithmetic is cheap; the $(B, N, L)$ states are not. The fused kernel keeps them in
#   registers, carries only $N$ numbers from chunk to chunk, and writes only $y$, plus, for training,
#   the state at each chunk boundary.
# - The backward is the same scan run right to left with the gate shifted by one, per state; it
#   recomputes the states of each chunk from the saved boundary state instead of storing them.
# - Next, chapter 05 adds Mamba's discretisation, $a = e^{\Delta A}$, $b = \Delta B$, and shares $B$, $C$
#   across channels.
