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
# # 10 · Mamba-2: when the scan becomes a matrix multiply
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/scan-course/scans-the-hard-way/blob/main/notebooks/10_mamba2.ipynb)
#
# Chapters 05 and 07 run Mamba's selective scan on the GPU's scalar units: every position and every
# state is a multiply and an add, one after another along the sequence, and the tensor cores, which
# do most of an H200's arithmetic, sit idle. Mamba-2 (Dao and Gu, "Transformers are SSMs", 2024)
# changes one thing: the decay $A$ becomes **one number per head** instead of one per state. Then a
# chunk of the recurrence is a masked matrix product, and the scan is left only *between* chunks.
# You will
#
# - write the Mamba-2 recurrence and its plain loop (the float64 reference);
# - see the same computation as **one lower-triangular matrix** applied to the inputs, its mask built
#   from a segment sum (chapter 01's cumulative sum), and check the two agree;
# - derive the **chunked algorithm** (state space duality, SSD): masked matrix products inside each
#   chunk, a chunk state, chapter 02's carried state between chunks (now a matrix per head), and the
#   contribution of the past to each chunk; each step checked against the loop;
# - count what the chunked form costs, and why its products are the kind tensor cores run.
#
# This first part is PyTorch and a first Triton forward in float32; the tensor-core kernels and the
# backward come next.

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
#| default_exp ssd

# %%
import math

import matplotlib.pyplot as plt
import torch

from scan_lib.runtime import save_figure

# %% [markdown]
# ## 1. The recurrence
#
# A Mamba-2 layer splits its channels into $H$ **heads** of $P$ channels each (the head dimension).
# Head $h$ keeps a state $\mathbf{H}_t \in \mathbb{R}^{P \times N}$: for each of its $P$ channels, $N$
# numbers, as chapter 05's state has $N$ numbers per channel. At position $t$ the head reads its
# input $x_t \in \mathbb{R}^P$, a step $\Delta_t > 0$ (one per head and position), and the vectors
# $B_t, C_t \in \mathbb{R}^N$ (shared by a **group** of heads, as multi-query attention shares keys):
#
# $$\mathbf{H}_t = e^{\Delta_t A}\, \mathbf{H}_{t-1} + \Delta_t\, x_t B_t^{\top}, \qquad
# y_t = \mathbf{H}_t\, C_t + D\, x_t .$$
#
# $A < 0$ is **one number per head**. That is the whole difference from chapter 05, where $A$ is an
# $N$-vector per channel and each of the $N$ states decays at its own rate: here every entry of
# $\mathbf{H}_t$ decays by the same factor $e^{\Delta_t A}$. The shapes follow `mamba_ssm`'s
# `mamba_chunk_scan_combined`: $x$ is `(batch, L, heads, P)`, $\Delta$ `(batch, L, heads)`, $A$
# `(heads,)`, $B$ and $C$ `(batch, L, groups, N)` with head $h$ in group $h \,/\!/\, (H / G)$, $D$
# `(heads,)`, the initial and final states `(batch, heads, P, N)`.
#
# The reference is the loop, in float64:

# %%
#| export
"""Mamba-2's state space duality (chapter 10): the recurrence as a loop, as one masked matrix, and in
chunks, in PyTorch (float64 references for the kernels)."""
import torch


def _per_head(M, heads):
    """B or C (batch, L, groups, N) repeated for each head of its group: (batch, L, heads, N)."""
    return M.repeat_interleave(heads // M.shape[2], dim=2)


def ssd_loop(x, dt, A, B, C, D=None, initial_state=None):
    """H_t = exp(dt_t A) H_{t-1} + dt_t x_t B_t^T, y_t = H_t C_t + D x_t, one position at a time, in float64.

    x: (batch, L, heads, P); dt: (batch, L, heads), the steps (positive); A: (heads,); B, C:
    (batch, L, groups, N), groups dividing heads; D: (heads,) or None; initial_state: (batch, heads,
    P, N) or None (zeros). Returns y (batch, L, heads, P) and the final state (batch, heads, P, N)."""
    x, dt, A = x.double(), dt.double(), A.double()
    batch, length, heads, head_dim = x.shape
    B, C = _per_head(B.double(), heads), _per_head(C.double(), heads)       # batch x L x heads x N
    state = (x.new_zeros(batch, heads, head_dim, B.shape[-1]) if initial_state is None
             else initial_state.double())
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]                        # batch x heads x 1 x 1
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(x.shape)
    if D is not None:
        y = y + D.double()[:, None] * x
    return y, state

# %%
torch.manual_seed(0)


def ssd_problem(batch=2, length=37, heads=4, head_dim=3, groups=2, n_states=5, seed=0, dtype=torch.float64):
    """A random problem in mamba_ssm's layout: x, dt, A, B, C, D, initial_state."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)   # noqa: E731
    x = rand(batch, length, heads, head_dim)
    dt = torch.nn.functional.softplus(rand(batch, length, heads) - 1.0)           # positive steps
    A = -torch.exp(rand(heads) * 0.5)                                             # negative decays
    B, C = rand(batch, length, groups, n_states), rand(batch, length, groups, n_states)
    D, h0 = rand(heads), rand(batch, heads, head_dim, n_states)
    return [t.to(dtype).to(DEVICE) for t in (x, dt, A, B, C, D, h0)]


problem = ssd_problem()
y_loop, final_loop = ssd_loop(*problem)
print("y", tuple(y_loop.shape), " final state", tuple(final_loop.shape))

# %% [markdown]
# One check that the loop is the recurrence and not something near it: with one head, one channel and
# $N = 1$, $\mathbf{H}_t$ is a number, and the recurrence is chapter 02's linear scan with gates
# $e^{\Delta_t A}$ and tokens $\Delta_t x_t B_t$; `scan_lib.linear_scan` must give $\mathbf{H}_t$, and
# $y_t = \mathbf{H}_t C_t$.

# %%
x1, dt1, A1, B1, C1 = ssd_problem(batch=1, heads=1, head_dim=1, groups=1, n_states=1)[:5]
gates = torch.exp(dt1[0, :, 0] * A1[0])                                     # L
tokens = dt1[0, :, 0] * x1[0, :, 0, 0] * B1[0, :, 0, 0]                     # L
states = scan_lib.linear_scan(gates, tokens)                                # H_t, a number per position
y1, _ = ssd_loop(x1, dt1, A1, B1, C1)
error = (y1[0, :, 0, 0] - states * C1[0, :, 0, 0]).abs().max().item()
print(f"one head, one channel, N = 1: loop against linear_scan, max |difference| {error:.1e}")
assert error < 1e-12

# %% [markdown]
# ## 2. The same computation as one matrix
#
# Unroll the recurrence from $\mathbf{H}_{-1} = 0$: the input at position $s$ reaches position
# $t \ge s$ multiplied by the decays of the positions after it,
#
# $$\mathbf{H}_t = \sum_{s \le t} \exp\Big(\sum_{r=s+1}^{t} \Delta_r A\Big)\, \Delta_s\, x_s B_s^{\top},
# \qquad
# y_t = \sum_{s \le t} \underbrace{\exp\Big(\sum_{r=s+1}^{t} \Delta_r A\Big)}_{L_{ts}}\,
# \big(C_t^{\top} B_s\big)\, \Delta_s\, x_s .$$
#
# Because $A$ is a scalar, the decay $L_{ts}$ is a number for each pair of positions, the same for
# every channel and state of the head. So the whole sequence is one matrix product:
#
# $$y = M\, (\Delta \circ x), \qquad M = L \circ (C B^{\top}), \qquad
# L_{ts} = \begin{cases} e^{\,\mathrm{segsum}(a)_{ts}} & s \le t \\ 0 & s > t \end{cases},
# \quad a_r = \Delta_r A ,$$
#
# with $\circ$ the elementwise product and $\mathrm{segsum}(a)_{ts} = \sum_{r=s+1}^{t} a_r$, the
# **segment sum**. $M$ is lower triangular ($y_t$ reads only $s \le t$: causal) and $L \times L$; this
# is attention with a decaying causal mask in place of the softmax, the link to chapter 08
# ("Transformers are SSMs"). In chapter 05's model $A$ is a vector, $L_{ts}$ would differ per state,
# and no single matrix would do.
#
# The segment sum is a difference of cumulative sums, $\mathrm{segsum}(a)_{ts} = \mathrm{cs}_t -
# \mathrm{cs}_s$ with $\mathrm{cs} = \mathrm{cumsum}(a)$, but that difference cancels two large numbers
# when the sequence is long (both grow like $t$), and loses digits exactly where $L_{ts}$ matters,
# near the diagonal. The stable way sums only the terms it needs: put $a_r$ in row $t$, column $s$
# for $s < r \le t$, and take a cumulative sum down each column.

# %%
#| export
def segsum(a):
    """segsum(a)[..., t, s] = a[s+1] + ... + a[t] for s <= t (0 on the diagonal), -inf above it, summing
    only those terms (no difference of two long cumulative sums). a: (..., T) -> (..., T, T)."""
    length = a.shape[-1]
    terms = a[..., :, None].expand(*a.shape, length)                      # [..., r, s] = a[r]
    below = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)   # r > s
    sums = terms.masked_fill(~below, 0).cumsum(dim=-2)                     # [..., t, s] = sum_{s<r<=t} a[r]
    on_or_below = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~on_or_below, float("-inf"))


def ssd_quadratic(x, dt, A, B, C, D=None):
    """y = (L o C B^T)(dt o x) per head, the L x L matrix built whole (no initial state). Shapes as ssd_loop."""
    heads = x.shape[2]
    B, C = _per_head(B, heads), _per_head(C, heads)                       # batch x L x heads x N
    decay = torch.exp(segsum((dt * A).transpose(1, 2)))                   # batch x heads x L x L
    scores = torch.einsum("bthn,bshn->bhts", C, B)                         # batch x heads x L x L
    y = torch.einsum("bhts,bsh,bshp->bthp", decay * scores, dt, x)
    return y if D is None else y + D[:, None] * x

# %%
a_small = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
print(segsum(a_small))
cs = torch.cumsum(a_small, 0)
assert torch.allclose(segsum(a_small).tril(), (cs[:, None] - cs[None, :]).tril())

y_quadratic = ssd_quadratic(*problem[:6])
y_loop_zero, _ = ssd_loop(*problem[:6])                                     # the same, from zero states
error = ((y_quadratic - y_loop_zero).abs().max() / y_loop_zero.abs().max()).item()
print(f"the matrix form against the loop (float64): relative error {error:.1e}")
assert error < 1e-12

# %% [markdown]
# **Why the stable segment sum.** The next cell makes the cancellation visible: a long sequence of
# steps whose cumulative sum drifts far from zero, in float32. The difference of cumulative sums
# gets the decay between neighbours wrong by what is lost in rounding $\mathrm{cs}_t$, which grows
# with $t$; the column sums do not.

# %%
a_long = -torch.rand(4096, dtype=torch.float64) * 0.1 - 1.0                 # decays summing to about -4300
exact = segsum(a_long)                                                       # float64
stable = segsum(a_long.float()).double()
cs32 = torch.cumsum(a_long.float(), 0)
by_difference = (cs32[:, None] - cs32[None, :]).double()
near_diagonal = torch.ones(4096, 4096, dtype=torch.bool).tril() & ~torch.ones(4096, 4096, dtype=torch.bool).tril(-8)
worst = {name: (torch.exp(v) - torch.exp(exact))[near_diagonal].abs().max().item()
         for name, v in (("column sums", stable), ("difference of cumsums", by_difference))}
print("float32, L = 4096, decays within 8 positions of the diagonal, max |error|: "
      + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
assert worst["column sums"] < worst["difference of cumsums"]

# %% [markdown]
# ## 3. In chunks: state space duality
#
# The matrix form does $L^2$ work per head and stores an $L \times L$ matrix: fine for a check, hopeless
# for $L = 64\text{k}$. The loop does $O(L)$ work but one position at a time. The **chunked** form
# takes the best of both. Cut the sequence into chunks of $Q$ positions. $M$ splits into $Q \times Q$
# blocks: the blocks on the diagonal are small matrix products (the "attention" part), and every block
# below the diagonal factors through the state at the chunk boundary, because any path from position
# $s$ in an earlier chunk to position $t$ in chunk $c$ crosses the start of chunk $c$:
#
# 1. **Diagonal blocks**: $y^{\text{diag}}_t = \sum_{s \in c,\, s \le t} L_{ts} (C_t^{\top}B_s) \Delta_s x_s$,
#    the matrix form of section 2 inside each chunk.
# 2. **Chunk states**: the state each chunk would leave behind starting from zero,
#    $\mathbf{S}_c = \sum_{s \in c} e^{\,\mathrm{segsum}(a)_{\text{end}_c, s}}\, \Delta_s x_s B_s^{\top}$.
# 3. **The scan over chunks**: $\mathbf{H}^{\text{in}}_{c+1} = e^{\sum_{r \in c} a_r}\, \mathbf{H}^{\text{in}}_c +
#    \mathbf{S}_c$, from $\mathbf{H}^{\text{in}}_0$ = the initial state: chapter 02's carried state,
#    with a $P \times N$ matrix for the state and a scalar gate per chunk. Its last value is the final state.
# 4. **The past's contribution**: $y^{\text{off}}_t = e^{\sum_{r \in c,\, r \le t} a_r}\, \mathbf{H}^{\text{in}}_c C_t$.
#
# and $y = y^{\text{diag}} + y^{\text{off}} + D x$. Steps 1, 2 and 4 are independent across chunks
# (and batched matrix products); only step 3 is sequential, over $L / Q$ chunks instead of $L$
# positions. A length that is not a multiple of $Q$ gets its last chunk padded with $\Delta = 0$:
# a zero step neither decays the state ($e^{0} = 1$) nor adds to it, so padding changes nothing.

# %%
#| export
def ssd_chunked(x, dt, A, B, C, chunk_size, D=None, initial_state=None):
    """The chunked algorithm (SSD) in PyTorch: intra-chunk matrix products, chunk states, the scan over
    chunk boundaries, the past's contribution. Shapes as ssd_loop; any L (the last chunk is padded
    with dt = 0; L = 0 gives an empty y and the initial state). Returns y (batch, L, heads, P) and the
    final state (batch, heads, P, N)."""
    batch, length, heads, head_dim = x.shape
    n_chunks = -(-length // chunk_size)
    pad = n_chunks * chunk_size - length
    B, C = _per_head(B, heads), _per_head(C, heads)                        # batch x L x heads x N
    x, dt, B, C = (torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    chunks = lambda t: t.reshape(batch, n_chunks, chunk_size, *t.shape[2:])   # noqa: E731
    x, dt, B, C = chunks(x), chunks(dt), chunks(B), chunks(C)              # batch x chunks x Q x ...
    a = (dt * A).permute(0, 3, 1, 2)                                       # batch x heads x chunks x Q
    a_cum = a.cumsum(-1)                                                   # decay from the chunk's start
    # 1. diagonal blocks
    decay = torch.exp(segsum(a))                                           # batch x heads x chunks x Q x Q
    scores = torch.einsum("bcthn,bcshn->bhcts", C, B)
    y_diag = torch.einsum("bhcts,bcsh,bcshp->bcthp", decay * scores, dt, x)
    # 2. chunk states: each position's input decayed to the chunk's end
    to_end = torch.exp(a_cum[..., -1:] - a_cum)                            # batch x heads x chunks x Q
    chunk_states = torch.einsum("bhcs,bcsh,bcshp,bcshn->bchpn", to_end, dt, x, B)
    # 3. the scan over chunk boundaries (chapter 02's carried state, sequential over chunks)
    state = (x.new_zeros(batch, heads, head_dim, B.shape[-1]) if initial_state is None
             else initial_state.to(x.dtype))
    entering = []
    for c in range(n_chunks):
        entering.append(state)
        state = torch.exp(a_cum[:, :, c, -1])[..., None, None] * state + chunk_states[:, c]
    # batch x chunks x heads x P x N; for L = 0 there are no chunks, and chunk_states is that empty tensor
    entering = torch.stack(entering, dim=1) if entering else chunk_states
    # 4. the past's contribution, decayed from the chunk's start to each position
    y_off = torch.einsum("bcthn,bchpn,bhct->bcthp", C, entering, torch.exp(a_cum))
    y = (y_diag + y_off).reshape(batch, n_chunks * chunk_size, heads, head_dim)[:, :length]
    if D is not None:
        y = y + D[:, None] * x.reshape(batch, -1, heads, head_dim)[:, :length]
    return y, state

# %% [markdown]
# **Checks**, in float64 against the loop: lengths that are and are not multiples of the chunk, a
# chunk longer than the sequence, one position, heads sharing groups, with and without the initial
# state; the final state too.

# %%
print(f"{'L':>4s} {'chunk':>5s} {'heads/groups':>12s} {'initial state':>13s} {'y rel err':>10s} {'final rel err':>13s}")
for length, chunk, heads, groups, with_h0 in [(37, 8, 4, 2, True), (32, 8, 4, 4, False), (5, 16, 2, 1, True),
                                              (1, 4, 2, 2, True), (64, 64, 6, 3, True)]:
    x, dt, A, B, C, D, h0 = ssd_problem(length=length, heads=heads, groups=groups, seed=length)
    h0 = h0 if with_h0 else None
    y_want, final_want = ssd_loop(x, dt, A, B, C, D, h0)
    y_got, final_got = ssd_chunked(x, dt, A, B, C, chunk, D, h0)
    errors = [((g - w).abs().max() / w.abs().max()).item() for g, w in ((y_got, y_want), (final_got, final_want))]
    print(f"{length:4d} {chunk:5d} {f'{heads}/{groups}':>12s} {str(with_h0):>13s} {errors[0]:10.1e} {errors[1]:13.1e}")
    assert max(errors) < 1e-12, errors

# %% [markdown]
# The final state is step 3's last value, so the table checks steps 2 and 3; step 1 alone is the answer
# when every chunk starts from zero states. Cut the problem into chunks and run each piece alone, the
# loop and the chunked function: for a single chunk from zero, steps 2-4 add nothing, and what is
# compared is the diagonal block.

# %%
x, dt, A, B, C, D, h0 = ssd_problem(length=24, seed=3)
chunk = 8
y_cut = torch.cat([ssd_loop(x[:, i:i + chunk], dt[:, i:i + chunk], A, B[:, i:i + chunk], C[:, i:i + chunk])[0]
                   for i in range(0, 24, chunk)], dim=1)                 # every chunk from zero states
y_diag_only = torch.cat([ssd_chunked(x[:, i:i + chunk], dt[:, i:i + chunk], A, B[:, i:i + chunk], C[:, i:i + chunk], chunk)[0]
                         for i in range(0, 24, chunk)], dim=1)
error = ((y_diag_only - y_cut).abs().max() / y_cut.abs().max()).item()
print(f"step 1 (diagonal blocks, each chunk from zero) against the loop cut into chunks: {error:.1e}")
assert error < 1e-12

# %% [markdown]
# ## 4. What the chunked form costs
#
# Per head and chunk of $Q$ positions, with head dimension $P$ and $N$ states, counting a multiply-add
# as 2 flops:
#
# | step | work | flops |
# | --- | --- | --- |
# | 1. $C B^{\top}$, then $(L \circ C B^{\top})(\Delta x)$ | two $Q \times Q$ products | $2Q^2N + 2Q^2P$ |
# | 2. chunk state $\sum_s (\ldots) x_s B_s^{\top}$ | a $P \times Q$ by $Q \times N$ product | $2QPN$ |
# | 3. scan over chunks | a scale and an add of $P \times N$ | $2PN$ |
# | 4. $\mathbf{H}^{\text{in}} C_t$ for the chunk | a $Q \times N$ by $N \times P$ product | $2QPN$ |
#
# Per position that is $2Q(N+P) + 4PN$ flops, against $4PN$ for the loop (a multiply-add into each of
# the $PN$ state entries, and one for the output). The chunked form does **more** arithmetic, by a
# factor $1 + Q(N+P)/(2PN)$: with $Q = P = 64$ and $N = 128$, 1.75 times the loop's. It can
# still win, because almost all of it is matrix products of tiles of 64 or more, which tensor cores
# run, and on
# an H200 the dense bfloat16 tensor-core rate is many times the scalar float32 rate (the cell prints
# NVIDIA's datasheet figures and their ratio), far more than the chunks cost. The loop, and chapter
# 07's kernels, can use only the scalar rate. This is an argument from datasheet peaks, not a
# measurement: this part times nothing, and its Triton forward (section 5) keeps its products in
# float32, off the tensor cores. The cell prints the factor for a few chunk sizes.

# %%
def extra_work(chunk, head_dim, n_states):
    """Chunked flops over the loop's, per position: (2Q(N + P) + 4PN) / 4PN."""
    return (2 * chunk * (n_states + head_dim) + 4 * head_dim * n_states) / (4 * head_dim * n_states)


H200_DATASHEET_TFLOPS = {"bf16 tensor cores, dense": 989.5, "fp32 scalar cores": 67.0}   # NVIDIA's H200 datasheet
print(", ".join(f"{k}: {v} TFLOP/s" for k, v in H200_DATASHEET_TFLOPS.items())
      + f"; ratio {H200_DATASHEET_TFLOPS['bf16 tensor cores, dense'] / H200_DATASHEET_TFLOPS['fp32 scalar cores']:.1f}")
print("chunked flops over the loop's, per position:")
print(f"{'chunk Q':>8s} " + " ".join(f"{f'P={p}, N={n}':>14s}" for p, n in ((64, 64), (64, 128), (128, 128))))
for chunk in (16, 32, 64, 128, 256):
    print(f"{chunk:8d} " + " ".join(f"{extra_work(chunk, p, n):14.2f}" for p, n in ((64, 64), (64, 128), (128, 128))))
assert abs(extra_work(64, 64, 128) - 1.75) < 1e-12

# %% [markdown]
# The factor grows with $Q$, so the chunk should be as small as the tensor cores allow while still
# filling them. `mamba_ssm`'s Mamba-2 block uses chunks of 256 with $P = 64$ and $N = 128$, a factor
# of 4.0 in the table, bought back by fewer, larger products and a shorter scan over chunks; which
# chunk wins is a measurement, for the kernels of this chapter's next part.

# %% [markdown]
# ## 5. A first Triton forward
#
# The four steps map onto two kernels and one call to chapter 03's `linear_scan`:
#
# - `ssd_chunk_state_kernel`, one program per (batch, head, chunk): step 2, the chunk's state from zero
#   as one `tl.dot` of the weighted inputs ($P \times Q$) by $B$ ($Q \times N$), and the chunk's total
#   decay $e^{\sum_c a_r}$.
# - Step 3, the scan over chunks: $\mathbf{H}^{\text{in}}_{c+1} = e^{\sum_c a}\,\mathbf{H}^{\text{in}}_c +
#   \mathbf{S}_c$ is a first-order linear recurrence with one gate per chunk for all $P N$ entries of a
#   head's state: `scan_lib.linear_scan` with the entries as rows and the chunks along the sequence,
#   the state entering chunk $c$ being the scan's value after chunk $c-1$.
# - `ssd_chunk_output_kernel`, one program per (batch, head, chunk): steps 1 and 4, $C B^{\top}$ and
#   $(L \circ C B^{\top})(\Delta x)$ as two `tl.dot`s, and $e^{a_{\text{cum}}} C\,(\mathbf{H}^{\text{in}})^{\top}$
#   as a third.
#
# Inside a chunk the decays come from a difference of cumulative sums, $e^{\mathrm{cs}_t - \mathrm{cs}_s}$:
# within $Q$ positions the sums stay small, so the cancellation of section 2 costs little, and a
# $Q \times Q$ tile of them is what the products need. Positions past $L$ load $\Delta = 0$ (no decay,
# no input) and are not stored. This first version computes its products in float32
# (`input_precision="ieee"`) so that it can be checked to float32 rounding; on a GPU that keeps them
# off the tensor cores, whose inputs are bfloat16 or TF32, and feeding them is the next part's work.
#
# The kernels trust their arguments: they index $A$ and $D$ by head at stride 1, B and C by group
# $h \,/\!/\, (H / G)$, and tile the chunk with `tl.arange` (a power of two) into `tl.dot` (16 or
# more). So `ssd_forward` first checks them (`_check_forward_inputs`: the shapes of section 1, float
# dtypes, one device, groups dividing heads, the chunk a power of two $\ge 16$), raising an error that
# names the argument instead of reading past a tensor (and refusing what it cannot do yet: float64
# inputs, whose digits its float32 sums would drop, and inputs that require a gradient, since it has
# no backward: `ssd_chunked` does both); copies $A$ and $D$ to contiguous float32; and
# for an empty sequence launches nothing, returning an empty $y$ and the initial state, as the loop does.

# %%
#| export
import triton
import triton.language as tl

import scan_lib
from scan_lib.runtime import check_float_tensor, check_same_device


@triton.jit
def ssd_chunk_state_kernel(X, DT, A, B, STATES, DECAY, length, heads, groups, head_dim, n_states, n_chunks,
                           CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (batch, head, chunk): the state the chunk leaves from zero, sum_s exp(a_end - a_cum_s) dt_s x_s B_s^T
    (P x N), and the chunk's decay exp(sum of a). X: b x L x h x P, DT: b x L x h, B: b x L x g x N (contiguous);
    STATES: b x h x chunks x P x N, DECAY: b x h x chunks."""
    b, h, c = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    g = h // (heads // groups)
    t = c * CHUNK + tl.arange(0, CHUNK)                                     # CHUNK positions
    t_ok = t < length
    p, n = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    dt = tl.load(DT + (b * length + t) * heads + h, t_ok, other=0.0).to(tl.float32)   # 0 past L: no decay, no input
    a_cum = tl.cumsum(dt * tl.load(A + h).to(tl.float32), axis=0)          # CHUNK
    a_end = tl.sum(dt * tl.load(A + h).to(tl.float32), axis=0)
    weight = dt * tl.exp(a_end - a_cum)                                     # CHUNK
    x = tl.load(X + ((b * length + t[:, None]) * heads + h) * head_dim + p[None, :],
                t_ok[:, None] & (p[None, :] < head_dim), other=0.0).to(tl.float32)   # CHUNK x P
    Bv = tl.load(B + ((b * length + t[:, None]) * groups + g) * n_states + n[None, :],
                 t_ok[:, None] & (n[None, :] < n_states), other=0.0).to(tl.float32)  # CHUNK x N
    state = tl.dot(tl.trans(x * weight[:, None]), Bv, input_precision="ieee")                       # P x N
    base = (b * heads + h) * n_chunks + c
    tl.store(STATES + base * head_dim * n_states + p[:, None] * n_states + n[None, :], state,
             (p[:, None] < head_dim) & (n[None, :] < n_states))
    tl.store(DECAY + base, tl.exp(a_end))


@triton.jit
def ssd_chunk_output_kernel(X, DT, A, B, C, D, ENTERING, Y, length, heads, groups, head_dim, n_states, n_chunks,
                            HAS_D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (batch, head, chunk): y = (L o C B^T)(dt x) + exp(a_cum) C H_in^T (+ D x) for the chunk's positions."""
    b, h, c = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    g = h // (heads // groups)
    t = c * CHUNK + tl.arange(0, CHUNK)
    t_ok = t < length
    p, n = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    dt = tl.load(DT + (b * length + t) * heads + h, t_ok, other=0.0).to(tl.float32)
    a_cum = tl.cumsum(dt * tl.load(A + h).to(tl.float32), axis=0)
    x = tl.load(X + ((b * length + t[:, None]) * heads + h) * head_dim + p[None, :],
                t_ok[:, None] & (p[None, :] < head_dim), other=0.0).to(tl.float32)
    row = ((b * length + t[:, None]) * groups + g) * n_states + n[None, :]
    mask_n = t_ok[:, None] & (n[None, :] < n_states)
    Bv = tl.load(B + row, mask_n, other=0.0).to(tl.float32)
    Cv = tl.load(C + row, mask_n, other=0.0).to(tl.float32)
    scores = tl.dot(Cv, tl.trans(Bv), input_precision="ieee")                                       # CHUNK x CHUNK
    causal = tl.arange(0, CHUNK)[:, None] >= tl.arange(0, CHUNK)[None, :]
    decay = tl.where(causal, tl.exp(a_cum[:, None] - a_cum[None, :]), 0.0)  # within a chunk: short differences
    y = tl.dot(scores * decay * dt[None, :], x, input_precision="ieee")                            # CHUNK x P
    base = (b * heads + h) * n_chunks + c
    H = tl.load(ENTERING + base * head_dim * n_states + p[:, None] * n_states + n[None, :],
                (p[:, None] < head_dim) & (n[None, :] < n_states), other=0.0)   # P x N
    y += tl.exp(a_cum)[:, None] * tl.dot(Cv, tl.trans(H), input_precision="ieee")                   # CHUNK x P
    if HAS_D:
        y += tl.load(D + h).to(tl.float32) * x
    tl.store(Y + ((b * length + t[:, None]) * heads + h) * head_dim + p[None, :], y.to(Y.dtype.element_ty),
             t_ok[:, None] & (p[None, :] < head_dim))


def _check_forward_inputs(x, dt, A, B, C, chunk_size, D, initial_state):
    """Raise a TypeError or ValueError naming the argument unless the kernels can index the inputs as given."""
    named = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, initial_state=initial_state)
    for name, value in named.items():
        if value is not None or name not in ("D", "initial_state"):
            check_float_tensor(name, value)
            if value.dtype == torch.float64:   # the kernels sum in float32: float64 would lose digits silently
                raise TypeError(f"{name}: ssd_forward computes in float32; for float64 use ssd_chunked")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in named.values()):
        raise RuntimeError("ssd_forward has no backward yet: call it under torch.no_grad(), or differentiate ssd_chunked")
    if x.dim() != 4:
        raise ValueError(f"x must have shape (batch, L, heads, P), got {tuple(x.shape)}")
    batch, length, heads, head_dim = x.shape
    if B.dim() != 4 or tuple(B.shape[:2]) != (batch, length) or B.shape[3] == 0:
        raise ValueError(f"B must have shape (batch={batch}, L={length}, groups, N) with N >= 1, "
                         f"got {tuple(B.shape)}")
    groups, n_states = B.shape[2], B.shape[3]
    if groups == 0 or heads % groups != 0:
        raise ValueError(f"B and C: the number of groups ({groups}) must divide heads ({heads}, x's third dim)")
    expected = {"dt": ("(batch, L, heads)", (batch, length, heads)), "A": ("(heads,)", (heads,)),
                "C": ("(batch, L, groups, N)", (batch, length, groups, n_states)), "D": ("(heads,)", (heads,)),
                "initial_state": ("(batch, heads, P, N)", (batch, heads, head_dim, n_states))}
    for name, (dims, shape) in expected.items():
        if named[name] is not None and tuple(named[name].shape) != shape:
            raise ValueError(f"{name} must have shape {dims} = {shape}, got {tuple(named[name].shape)}")
    check_same_device(**named)
    is_int = isinstance(chunk_size, int) and not isinstance(chunk_size, bool)
    if not is_int or chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16 (tl.arange and tl.dot's tiles), got {chunk_size!r}")


def _empty_forward(x, n_states, initial_state):
    """ssd_forward's result for an empty x (L = 0, or no batch, heads or channels), launching nothing."""
    batch, _, heads, head_dim = x.shape
    final = (torch.zeros(batch, heads, head_dim, n_states, device=x.device) if initial_state is None
             else initial_state.to(torch.float32, copy=True))               # no position moved the state
    return torch.empty_like(x), final


def ssd_forward(x, dt, A, B, C, chunk_size, D=None, initial_state=None):
    """The chunked forward on the GPU (or Triton's interpreter): two kernels and chapter 03's linear_scan
    between them. Shapes as ssd_loop (checked); chunk_size a power of two >= 16; float32 sums. Returns y
    (x's dtype) and the final state (float32). Forward only: the backward is the next part's."""
    _check_forward_inputs(x, dt, A, B, C, chunk_size, D, initial_state)
    if x.numel() == 0:
        return _empty_forward(x, B.shape[3], initial_state)
    batch, length, heads, head_dim = x.shape
    groups, n_states = B.shape[2], B.shape[3]
    n_chunks = triton.cdiv(length, chunk_size)
    bp, bn = max(16, triton.next_power_of_2(head_dim)), max(16, triton.next_power_of_2(n_states))
    x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
    A, D = (None if t is None else t.float().contiguous() for t in (A, D))  # the kernels read A + h, D + h
    states = torch.empty(batch, heads, n_chunks, head_dim, n_states, device=x.device, dtype=torch.float32)
    decay = torch.empty(batch, heads, n_chunks, device=x.device, dtype=torch.float32)
    grid = (batch, heads, n_chunks)
    ssd_chunk_state_kernel[grid](x, dt, A, B, states, decay, length, heads, groups, head_dim, n_states, n_chunks,
                                 CHUNK=chunk_size, BLOCK_P=bp, BLOCK_N=bn)
    # the scan over chunks: chapter 03's linear_scan, the P x N entries of each head as rows
    h0 = None if initial_state is None else initial_state.float().reshape(batch, heads, -1)
    after = scan_lib.linear_scan(decay[:, :, None, :], states.permute(0, 1, 3, 4, 2).reshape(batch, heads, -1, n_chunks), h0)
    start = torch.zeros(batch, heads, head_dim * n_states, 1, device=x.device) if h0 is None else h0[..., None]
    entering = torch.cat([start, after[..., :-1]], dim=-1)                  # b x h x PN x chunks
    entering = entering.reshape(batch, heads, head_dim, n_states, n_chunks).permute(0, 1, 4, 2, 3).contiguous()
    y = torch.empty_like(x)
    ssd_chunk_output_kernel[grid](x, dt, A, B, C, D, entering, y, length, heads, groups, head_dim, n_states, n_chunks,
                                  HAS_D=D is not None, CHUNK=chunk_size, BLOCK_P=bp, BLOCK_N=bn)
    final = after[..., -1].reshape(batch, heads, head_dim, n_states)
    return y, final

# %%
print(f"{'L':>4s} {'chunk':>5s} {'heads/groups':>12s} {'P':>3s} {'N':>3s} {'y rel err':>10s} {'final rel err':>13s}")
for length, chunk, heads, groups, head_dim, n_states in [(37, 16, 4, 2, 3, 5), (32, 16, 2, 2, 16, 16),
                                                         (70, 32, 2, 1, 8, 4), (1, 16, 2, 2, 4, 4)]:
    x, dt, A, B, C, D, h0 = ssd_problem(length=length, heads=heads, head_dim=head_dim, groups=groups,
                                        n_states=n_states, seed=length, dtype=torch.float32)
    y_want, final_want = ssd_loop(x, dt, A, B, C, D, h0)
    y_got, final_got = ssd_forward(x, dt, A, B, C, chunk, D, h0)
    errors = [((g.double() - w).abs().max() / w.abs().max()).item() for g, w in ((y_got, y_want), (final_got, final_want))]
    print(f"{length:4d} {chunk:5d} {f'{heads}/{groups}':>12s} {head_dim:3d} {n_states:3d} {errors[0]:10.1e} {errors[1]:13.1e}")
    assert max(errors) < 1e-5, errors

# %% [markdown]
# Float32 inputs against the float64 loop: the errors are float32 rounding, over lengths that are not
# multiples of the chunk, a single position, head and state sizes that are not powers of two (the
# tiles are padded and masked), and groups of heads.
#
# And the arguments the kernels cannot take as they come: $A$ and $D$ read every other element of a
# longer tensor give the same answer, an empty sequence gives the initial state, and groups that do
# not divide the heads or a chunk of 24 are refused.

# %%
x, dt, A, B, C, D, h0 = ssd_problem(length=20, seed=7, dtype=torch.float32)
y_want, final_want = ssd_loop(x, dt, A, B, C, D, h0)
A_strided, D_strided = A.repeat_interleave(2)[::2], D.repeat_interleave(2)[::2]   # the same values, stride 2
y_got, final_got = ssd_forward(x, dt, A_strided, B, C, 16, D_strided, h0)
error = max(((g.double() - w).abs().max() / w.abs().max()).item() for g, w in ((y_got, y_want), (final_got, final_want)))
print(f"A and D of stride {A_strided.stride(0)}: relative error {error:.1e}")
assert error < 1e-5
y_empty, final_empty = ssd_forward(x[:, :0], dt[:, :0], A, B[:, :0], C[:, :0], 16, D, h0)
print(f"L = 0: y {tuple(y_empty.shape)}, final state equal to the initial state: {torch.equal(final_empty, h0)}")
assert y_empty.shape == x[:, :0].shape and torch.equal(final_empty, h0)
for what, call in [("3 groups for 4 heads", lambda: ssd_forward(x, dt, A, B[:, :, [0, 1, 0]], C[:, :, [0, 1, 0]], 16)),
                   ("chunk_size 24", lambda: ssd_forward(x, dt, A, B, C, 24))]:
    try:
        call()
    except ValueError as refusal:
        print(f"{what}: ValueError: {refusal}")
    else:
        raise AssertionError(f"{what} was accepted")

# %% [markdown]
# ## What we built
#
# * `ssd_loop`: the recurrence one position at a time, the float64 reference.
# * `segsum` and `ssd_quadratic`: the same computation as one masked $L \times L$ matrix, $M = L \circ
#   CB^{\top}$, with a segment sum that adds only the terms it needs.
# * `ssd_chunked`: the state space duality algorithm, each of its four steps checked against the loop,
#   any length, groups of heads, initial and final states.
# * `ssd_forward`: the same in two Triton kernels around chapter 03's `linear_scan`, checked in float32.
#
# ## References
#
# - Dao and Gu, "Transformers are SSMs: generalized models and efficient algorithms through structured
#   state space duality", ICML 2024, arXiv:2405.21060 (Mamba-2, SSD, the chunked algorithm).
# - Gu and Dao, "Mamba: linear-time sequence modeling with selective state spaces", 2023, arXiv:2312.00752.
# - Blelloch, "Prefix sums and their applications", CMU-CS-90-190, 1990 (the scan over chunks).
# - NVIDIA H200 Tensor Core GPU datasheet (the tensor-core and scalar rates).
