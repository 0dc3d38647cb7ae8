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
# Chapters 05 and 07 run Mamba's selective scan on the GPU's scalar units; the tensor cores, most of an
# H100's or H200's arithmetic, sit idle. Mamba-2 (Dao and Gu, "Transformers are SSMs", 2024) changes
# one thing: the decay $A$ becomes **one number per head**. Then a chunk of the recurrence is a masked
# matrix product, and the scan is left only *between* chunks: state space duality (SSD), built here in
# PyTorch, then in Triton. The backward, the differentiable op, its speed and the Mamba2 block are
# summed up at the end and built in "Going deeper".

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
import torch

# %% [markdown]
# ## 1. The recurrence
#
# A Mamba-2 layer splits its channels into $H$ **heads** of $P$ channels. Head $h$ keeps a state
# $\mathbf{H}_t \in \mathbb{R}^{P \times N}$. At position $t$ it reads its input $x_t \in \mathbb{R}^P$,
# a step $\Delta_t > 0$, and $B_t, C_t \in \mathbb{R}^N$ (shared by a **group** of heads):
#
# $$\mathbf{H}_t = e^{\Delta_t A}\, \mathbf{H}_{t-1} + \Delta_t\, x_t B_t^{\top}, \qquad
# y_t = \mathbf{H}_t\, C_t + D\, x_t .$$
#
# $A < 0$ is **one number per head**: every entry of $\mathbf{H}_t$ decays by the same factor, where in
# chapter 05 each state decays at its own rate. The shapes are `mamba_ssm`'s: $x$ `(batch, L, heads,
# P)`, $\Delta$ `(batch, L, heads)`, $A$ and $D$ `(heads,)`, $B$ and $C$ `(batch, L, groups, N)`, the
# states `(batch, heads, P, N)`. The reference is the loop, in float64:

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
    Shapes as above (D, initial_state may be None: zeros). Returns y and the final state."""
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
# ## 2. The same computation as one matrix
#
# Unrolled from $\mathbf{H}_{-1} = 0$, the input at $s$ reaches $t \ge s$ decayed by every step in
# between:
#
# $$y_t = \sum_{s \le t} L_{ts}\, \big(C_t^{\top} B_s\big)\, \Delta_s\, x_s, \qquad
# L_{ts} = \exp\Big(\sum_{r=s+1}^{t} a_r\Big) = e^{\,\mathrm{segsum}(a)_{ts}},\quad a_r = \Delta_r A .$$
#
# Because $A$ is a scalar, $L_{ts}$ is one number per pair of positions. So $y = M (\Delta \circ x)$
# with $M = L \circ (C B^{\top})$, lower triangular ($L_{ts} = 0$ for $s > t$): attention with a
# decaying causal mask in place of the softmax, the link to chapter 08. With chapter 05's vector $A$, no
# single matrix would do.
#
# As a difference of cumulative sums, the segment sum would cancel two large numbers on a long
# sequence, losing digits near the diagonal, where $L_{ts}$ matters. `segsum` adds only the terms it
# needs, a cumulative sum down each column ("Going deeper: more checks of the reference forms" shows the
# difference).

# %%
#| export
def segsum(a):
    """(..., T) -> (..., T, T): a[s+1] + ... + a[t] for s <= t, -inf above, summing only those terms."""
    length = a.shape[-1]
    terms = a[..., :, None].expand(*a.shape, length)                      # [..., r, s] = a[r]
    ones = torch.ones(length, length, dtype=torch.bool, device=a.device)
    sums = terms.masked_fill(~ones.tril(-1), 0).cumsum(dim=-2)             # [..., t, s] = sum_{s<r<=t} a[r]
    return sums.masked_fill(~ones.tril(), float("-inf"))


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
# ## 3. In chunks: state space duality
#
# The matrix form does $L^2$ work, the loop one position at a time. Cut the sequence into chunks of
# $Q$ positions: $M$ splits into $Q \times Q$ blocks, and every block below the diagonal factors
# through the state at a chunk boundary, since any path into chunk $c$ from an earlier one crosses
# its start:
#
# 1. **Diagonal blocks**: section 2's matrix form inside each chunk.
# 2. **Chunk states**, what each chunk leaves from zero:
#    $\mathbf{S}_c = \sum_{s \in c} L_{\text{end}_c, s}\, \Delta_s x_s B_s^{\top}$.
# 3. **The scan over chunks**: $\mathbf{H}^{\text{in}}_{c+1} = g_c \mathbf{H}^{\text{in}}_c + \mathbf{S}_c$,
#    $g_c = e^{\sum_{r \in c} a_r}$, from the initial state: chapter 02's carried state, one gate per
#    chunk. Its last value is the final state.
# 4. **The past's contribution**:
#    $y^{\text{off}}_t = e^{\sum_{r \in c,\, r \le t} a_r}\, \mathbf{H}^{\text{in}}_c C_t$.
#
# Then $y = y^{\text{diag}} + y^{\text{off}} + D x$: batched matrix products, and a scan over only
# $L / Q$ chunks. A last partial chunk is padded with $\Delta = 0$, which neither decays nor adds.

# %%
#| export
def _in_chunks(t, chunk_size):
    """(batch, L, ...) -> (batch, chunks, Q, ...), padded with zeros (where dt is 0: no decay, no input)."""
    batch, length = t.shape[:2]
    n_chunks = -(-length // chunk_size)
    t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, n_chunks * chunk_size - length))
    return t.reshape(batch, n_chunks, chunk_size, *t.shape[2:])


def _chunk_steps(x, dt, A, B, C, initial_state):
    """Steps 1 to 3 on inputs in chunks (batch x chunks x Q x heads x ..., B and C per head): a_cum, the diagonal
    blocks' decays and scores, the decays to the chunk's end, the chunk states, the entering and final states."""
    batch, n_chunks, _, heads, head_dim = x.shape
    a = (dt * A).permute(0, 3, 1, 2)                                       # batch x heads x chunks x Q
    a_cum = a.cumsum(-1)                                                   # decay from the chunk's start
    # 1. diagonal blocks: their decays and C_t . B_s
    decay = torch.exp(segsum(a))                                           # batch x heads x chunks x Q x Q
    scores = torch.einsum("bcthn,bcshn->bhcts", C, B)
    # 2. chunk states: each position's input decayed to the chunk's end
    to_end = torch.exp(a_cum[..., -1:] - a_cum)                            # batch x heads x chunks x Q
    chunk_states = torch.einsum("bhcs,bcsh,bcshp,bcshn->bchpn", to_end, dt, x, B)
    # 3. the scan over chunk boundaries (chapter 02's carried state, sequential over chunks)
    state = (x.new_zeros(batch, heads, head_dim, B.shape[-1]) if initial_state is None
             else initial_state.to(x.dtype))
    entering = []
    for c in range(n_chunks):
        ### BEGIN SOLUTION
        ### HINT: keep the state entering chunk c (append it to entering), then carry it across the chunk: decay it by the chunk's total decay exp(a_cum[:, :, c, -1]) and add the chunk's own state chunk_states[:, c]
        entering.append(state)
        state = torch.exp(a_cum[:, :, c, -1])[..., None, None] * state + chunk_states[:, c]
        ### END SOLUTION
    # batch x chunks x heads x P x N; for L = 0 there are no chunks, and chunk_states is that empty tensor
    entering = torch.stack(entering, dim=1) if entering else chunk_states
    return a_cum, decay, scores, to_end, chunk_states, entering, state


def ssd_chunked(x, dt, A, B, C, chunk_size, D=None, initial_state=None):
    """Section 3's four steps in PyTorch. Shapes and results as ssd_loop; any L (the last chunk padded with
    dt = 0; L = 0 gives an empty y and the initial state)."""
    batch, length, heads, head_dim = x.shape
    xc, dtc, Bc, Cc = (_in_chunks(t, chunk_size) for t in (x, dt, _per_head(B, heads), _per_head(C, heads)))
    a_cum, decay, scores, _, _, entering, state = _chunk_steps(xc, dtc, A, Bc, Cc, initial_state)
    # 1. diagonal blocks
    y_diag = torch.einsum("bhcts,bcsh,bcshp->bcthp", decay * scores, dtc, xc)
    # 4. the past's contribution, decayed from the chunk's start to each position
    y_off = torch.einsum("bcthn,bchpn,bhct->bcthp", Cc, entering, torch.exp(a_cum))
    y = (y_diag + y_off).flatten(1, 2)[:, :length]                        # batch x L x heads x P
    if D is not None:
        y = y + D[:, None] * x
    return y, state

# %% [markdown]
# **Checks** of $y$ and the final state against the float64 loop, at awkward lengths, with groups of
# heads and initial states:

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
# ## 4. What the chunked form costs
#
# Per head and chunk, a multiply-add counted as 2 flops:
#
# | step | work | flops |
# | --- | --- | --- |
# | 1. $C B^{\top}$, then $(L \circ C B^{\top})(\Delta x)$ | two $Q \times Q$ products | $2Q^2N + 2Q^2P$ |
# | 2. chunk state | $P \times Q$ by $Q \times N$ | $2QPN$ |
# | 3. scan over chunks | a scale and an add of $P \times N$ | $2PN$ |
# | 4. $\mathbf{H}^{\text{in}} C_t$ | $Q \times N$ by $N \times P$ | $2QPN$ |
#
# Per position that is about $2Q(N+P) + 4PN$ flops where the loop does $4PN$: **more** work, 1.75 times
# the loop's with $Q = P = 64$ and $N = 128$, 4.0 times with `mamba_ssm`'s chunks of 256. It can still
# win: almost all of it is products of tiles of 64 or more, and an H200's bfloat16
# tensor-core rate is many times the scalar float32 rate of chapter 07's kernels (datasheet peaks:
# "Going deeper: the cost for other chunks"). So the chunk should be as small as
# still fills the tensor cores.

# %% [markdown]
# ## 5. A first Triton forward
#
# Four kernels, one program per (batch, head, chunk) unless said. `ssd_chunk_steps_kernel` writes the
# steps $\Delta$ and, per chunk, the cumulative sums $a_{\text{cum}}$ of $\Delta A$ (`tl.cumsum`) once
# for the others: `ssd_chunk_state_kernel`, step 2 as one `tl.dot`; `ssd_state_passing_kernel`, step 3,
# chapter 02's carried state; `ssd_chunk_output_kernel`, steps 1 and 4 as three `tl.dot`s.
#
# Decays are differences of $a_{\text{cum}}$, small over $Q$ positions: section 2's cancellation costs
# little. Section 8's options (the step's softplus, the gate) are off in `ssd_forward`. A program holds
# a chunk in registers, so kernels run chunks of at most `KERNEL_CHUNK` = 64: by section 3, the same
# computation. Details: "Going deeper: the forward kernels' fine print".

# %%
#| export
import triton
import triton.language as tl

from scan_lib.flash_attention import matmul   # chapter 08: tl.dot, float32 sums, bfloat16 safe under the interpreter
from scan_lib.runtime import cdiv, check_float_tensor, check_same_device, next_power_of_2
from scan_lib.selective_scan import _load_delta   # chapter 05: steps after their bias and softplus, 0 where masked


@triton.jit
def ssd_chunk_steps_kernel(DT, DT_BIAS, A, STEPS, A_CUM, SLOPE, length, heads, n_chunks, HAS_DT_BIAS: tl.constexpr,
                           DT_SOFTPLUS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (batch, chunk, BLOCK_H heads): dt (+ dt_bias, softplus if asked; 0 past L), a_cum = cumsum(dt A) in the
    chunk, SLOPE (if given) = sigmoid(dt + dt_bias). DT: b x L x h; STEPS, A_CUM, SLOPE: b x h x chunks x CHUNK fp32."""
    b, c, h = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    t, h_ok = c * CHUNK + tl.arange(0, CHUNK), h < heads
    dt, raw = _load_delta(DT, DT_BIAS, (b * length + t[None, :]) * heads + h[:, None], h_ok[:, None] & (t < length),
                          h, h_ok, HAS_DT_BIAS, DT_SOFTPLUS, tl.float32)   # BLOCK_H x CHUNK, a row of heads per t
    rows = ((b * heads + h[:, None]) * n_chunks + c) * CHUNK + tl.arange(0, CHUNK)[None, :]
    tl.store(STEPS + rows, dt, h_ok[:, None])
    tl.store(A_CUM + rows, tl.cumsum(dt * tl.load(A + h, h_ok, other=0.0)[:, None], axis=1), h_ok[:, None])
    if SLOPE is not None:
        tl.store(SLOPE + rows, tl.sigmoid(raw), h_ok[:, None])


@triton.jit
def _chunk_program(STEPS, A_CUM, length, heads, groups, n_chunks, CHUNK: tl.constexpr):
    """b, h, c, the group, positions t (t_ok: before L), dt and a_cum (the chunk's rows of STEPS, A_CUM), a_cum[-1]."""
    b, h, c = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    t, row = c * CHUNK + tl.arange(0, CHUNK), ((b * heads + h) * n_chunks + c) * CHUNK
    dt, a_cum = tl.load(STEPS + row + tl.arange(0, CHUNK)), tl.load(A_CUM + row + tl.arange(0, CHUNK))
    return b, h, c, h // (heads // groups), t, t < length, dt, a_cum, tl.load(A_CUM + row + CHUNK - 1)


@triton.jit
def _rows(M, b, t, t_ok, length, count, index, width, BLOCK: tl.constexpr):
    """M[b, t, index, :width] of a contiguous b x L x count x width tensor: a CHUNK x BLOCK float32 tile, 0 outside."""
    j = tl.arange(0, BLOCK)
    return tl.load(M + ((b * length + t[:, None]) * count + index) * width + j[None, :],
                   t_ok[:, None] & (j[None, :] < width), other=0.0).to(tl.float32)


@triton.jit
def _mm(a, b, X, DOT: tl.constexpr):
    """a @ b on the tensor cores at X's precision, float32 sums; float32 as DOT, "tf32x3" or "tf32" (_tiles)."""
    if X.dtype.element_ty == tl.float32:
        return tl.dot(a, b, input_precision=DOT)
    return matmul(a.to(X.dtype.element_ty), b.to(X.dtype.element_ty))


@triton.jit
def ssd_chunk_state_kernel(X, STEPS, A_CUM, B, STATES, DECAY, length, heads, groups, head_dim, n_states, n_chunks,
                           CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """Step 2: the chunk's state from zero, sum_s exp(a_end - a_cum_s) dt_s x_s B_s^T, and its decay. X: b x L x h x P,
    B: b x L x g x N, STEPS, A_CUM: b x h x chunks x CHUNK; STATES: b x h x chunks x P x N, DECAY: b x h x chunks."""
    b, h, c, g, t, t_ok, dt, a_cum, a_end = _chunk_program(STEPS, A_CUM, length, heads, groups, n_chunks, CHUNK)
    p, n = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    weight = dt * tl.exp(a_end - a_cum)                                     # CHUNK
    x = _rows(X, b, t, t_ok, length, heads, h, head_dim, BLOCK_P)          # CHUNK x P
    Bv = _rows(B, b, t, t_ok, length, groups, g, n_states, BLOCK_N)        # CHUNK x N
    state = _mm(tl.trans(x * weight[:, None]), Bv, X, DOT)                  # P x N
    base = (b * heads + h) * n_chunks + c
    tl.store(STATES + base * head_dim * n_states + p[:, None] * n_states + n[None, :], state,
             (p[:, None] < head_dim) & (n[None, :] < n_states))
    tl.store(DECAY + base, tl.exp(a_end))


@triton.jit
def _decays(a_cum, CHUNK: tl.constexpr):
    """The diagonal block's L_ts = exp(a_cum_t - a_cum_s) for s <= t, else 0: short differences."""
    causal = tl.arange(0, CHUNK)[:, None] >= tl.arange(0, CHUNK)[None, :]
    return tl.where(causal, tl.exp(a_cum[:, None] - a_cum[None, :]), 0.0)


@triton.jit
def _scan_outputs(X, B, C, D, ENTERING, b, h, c, g, t, t_ok, dt, a_cum, length, heads, groups, head_dim, n_states,
                  n_chunks, HAS_D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT: tl.constexpr):
    """Steps 1 and 4 before any gate: y = (L o C B^T)(dt x) + exp(a_cum) C H_in^T (+ D x), CHUNK x P; C's rows."""
    p, n = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    x = _rows(X, b, t, t_ok, length, heads, h, head_dim, BLOCK_P)
    Bv = _rows(B, b, t, t_ok, length, groups, g, n_states, BLOCK_N)
    Cv = _rows(C, b, t, t_ok, length, groups, g, n_states, BLOCK_N)
    base = (b * heads + h) * n_chunks + c
    H = tl.load(ENTERING + base * head_dim * n_states + p[:, None] * n_states + n[None, :],
                (p[:, None] < head_dim) & (n[None, :] < n_states), other=0.0)   # P x N
    y = _mm(_mm(Cv, tl.trans(Bv), X, DOT) * _decays(a_cum, CHUNK) * dt[None, :], x, X, DOT)   # step 1
    y += tl.exp(a_cum)[:, None] * _mm(Cv, tl.trans(H), X, DOT)                                  # step 4
    if HAS_D:
        y += tl.load(D + h).to(tl.float32) * x
    return y, Cv


@triton.jit
def ssd_chunk_output_kernel(X, STEPS, A_CUM, B, C, D, Z, ENTERING, Y, length, heads, groups, head_dim, n_states,
                            n_chunks, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """Steps 1 and 4, times silu(z) if z is given. X, Z, Y: b x L x h x P, B, C: b x L x g x N, STEPS, A_CUM:
    b x h x chunks x CHUNK; ENTERING: b x h x chunks x P x N."""
    b, h, c, g, t, t_ok, dt, a_cum, _ = _chunk_program(STEPS, A_CUM, length, heads, groups, n_chunks, CHUNK)
    y, _ = _scan_outputs(X, B, C, D, ENTERING, b, h, c, g, t, t_ok, dt, a_cum, length, heads, groups, head_dim,
                         n_states, n_chunks, HAS_D, CHUNK, BLOCK_P, BLOCK_N, DOT)
    if HAS_Z:   # the gate in registers: y is stored once, gated
        z = _rows(Z, b, t, t_ok, length, heads, h, head_dim, BLOCK_P)
        y *= z * tl.sigmoid(z)
    p = tl.arange(0, BLOCK_P)
    tl.store(Y + ((b * length + t[:, None]) * heads + h) * head_dim + p[None, :], y.to(Y.dtype.element_ty),
             t_ok[:, None] & (p[None, :] < head_dim))



def _check_given(name, value, dims, shape):
    """Raise naming the argument unless value is None or a float tensor of this shape (dims: its names)."""
    if value is None:
        return
    check_float_tensor(name, value)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {dims} = {tuple(shape)}, got {tuple(value.shape)}")


def _check_forward_inputs(x, dt, A, B, C, chunk_size, D, initial_state, float64_dt=False):
    """Raise a TypeError or ValueError naming the argument unless the kernels can index the inputs as given.
    float64_dt: accept a float64 dt (section 8's op, whose step with a bias or softplus is computed in float32)."""
    named = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, initial_state=initial_state)
    for name, value in named.items():
        if value is not None or name not in ("D", "initial_state"):
            check_float_tensor(name, value)
            # the kernels sum in float32: float64 would lose digits silently
            if value.dtype == torch.float64 and not (name == "dt" and float64_dt):
                raise TypeError(f"{name}: ssd_forward computes in float32; for float64 use ssd_chunked")
    if x.dim() != 4:
        raise ValueError(f"x must have shape (batch, L, heads, P), got {tuple(x.shape)}")
    batch, length, heads, head_dim = x.shape
    if B.dim() != 4 or tuple(B.shape[:2]) != (batch, length) or B.shape[3] == 0:
        raise ValueError(f"B must have shape (batch={batch}, L={length}, groups, N) with N >= 1, got {tuple(B.shape)}")
    groups, n_states = B.shape[2], B.shape[3]
    if groups == 0 or heads % groups != 0:
        raise ValueError(f"B and C: the number of groups ({groups}) must divide heads ({heads}, x's third dim)")
    expected = {"dt": ("(batch, L, heads)", (batch, length, heads)), "A": ("(heads,)", (heads,)),
                "C": ("(batch, L, groups, N)", (batch, length, groups, n_states)), "D": ("(heads,)", (heads,)),
                "initial_state": ("(batch, heads, P, N)", (batch, heads, head_dim, n_states))}
    for name, (dims, shape) in expected.items():
        _check_given(name, named[name], dims, shape)
    check_same_device(**named)
    is_int = isinstance(chunk_size, int) and not isinstance(chunk_size, bool)
    if not is_int or chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16 (tl.arange and tl.dot's tiles), got {chunk_size!r}")


def _output_dtype(x, z):
    """y's dtype: x's, or with the gate z what y * silu(z) gives in PyTorch (x's and z's, promoted)."""
    return x.dtype if z is None else torch.promote_types(x.dtype, z.dtype)


KERNEL_CHUNK = 64   # the longest chunk a program holds: its Q x Q, Q x P and Q x N tiles fit in registers


def _tiles(chunk_size, head_dim, n_states):
    """CHUNK (at most KERNEL_CHUNK), P, N padded to powers of two >= 16 (tl.dot's), float32 products (fine print)."""
    return dict(CHUNK=min(chunk_size, KERNEL_CHUNK), BLOCK_P=max(16, next_power_of_2(head_dim)),
                BLOCK_N=max(16, next_power_of_2(n_states)),
                DOT="tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32")


@triton.jit
def ssd_state_passing_kernel(LOCAL, DECAY, START, PASSED, END, n_chunks, size,
                             HAS_START: tl.constexpr, REVERSE: tl.constexpr, BLOCK: tl.constexpr):
    """Step 3 on BLOCK state entries (REVERSE: last chunk first): PASSED[c], the carry before chunk c; END, after."""
    bh, block = tl.program_id(0), tl.program_id(1)
    entries = block * BLOCK + tl.arange(0, BLOCK)
    ok = entries < size
    head_base = bh.to(tl.int64) * n_chunks * size
    carry = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_START:
        carry = tl.load(START + bh.to(tl.int64) * size + entries, ok, 0.0)
    for step in range(n_chunks):
        c = n_chunks - 1 - step if REVERSE else step
        ### BEGIN SOLUTION
        ### HINT: store the carry as chunk c's entry of PASSED (before the chunk), then carry = the chunk's gate DECAY[bh, c] times carry plus the chunk's entries of LOCAL
        tl.store(PASSED + head_base + c * size + entries, carry, ok)
        carry = tl.load(DECAY + bh * n_chunks + c) * carry + tl.load(LOCAL + head_base + c * size + entries, ok, 0.0)
        ### END SOLUTION
    tl.store(END + bh.to(tl.int64) * size + entries, carry, ok)


def pass_states(local, decay, start, reverse=False, block=1024):
    """Step 3 on float32 chunk states (batch, heads, chunks, P, N) with gates (batch, heads, chunks), from start
    or zeros: the carry entering each chunk (in the order walked) and the carry at the end."""
    batch, heads, n_chunks, head_dim, n_states = local.shape
    size = head_dim * n_states
    passed = torch.empty_like(local)
    end = local.new_empty(batch, heads, head_dim, n_states)
    block = min(block, next_power_of_2(size))
    ssd_state_passing_kernel[(batch * heads, cdiv(size, block))](
        local, decay, start, passed, end, n_chunks, size, HAS_START=start is not None, REVERSE=reverse, BLOCK=block)
    return passed, end


def _launch_steps(dt, dt_bias, dt_softplus, A, tiles, slope=None):
    """(dt, a_cum) from the steps kernel, (batch, heads, chunks, CHUNK) float32; slope gets sigmoid(dt + dt_bias)."""
    (batch, length, heads), chunk, n_chunks = dt.shape, tiles["CHUNK"], cdiv(dt.shape[1], tiles["CHUNK"])
    steps, a_cum = (torch.empty(batch, heads, n_chunks, chunk, device=dt.device, dtype=torch.float32) for _ in range(2))
    ssd_chunk_steps_kernel[(batch, n_chunks, cdiv(heads, 32))](   # 32 heads: 128 bytes of float32 steps
        dt, dt_bias, A, steps, a_cum, slope, length, heads, n_chunks, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus, CHUNK=chunk, BLOCK_H=32)
    return steps, a_cum


def _scan_chunks(x, dt, dt_bias, dt_softplus, A, B, tiles, initial_state, slope=None):
    """_launch_steps, then steps 2 and 3 on contiguous inputs (A, dt_bias float32): its (dt, a_cum), the state
    entering each chunk (batch, heads, chunks, P, N), the decays (batch, heads, chunks), the final state; float32."""
    (batch, length, heads, head_dim), (groups, n_states) = x.shape, B.shape[2:]
    steps, a_cum = _launch_steps(dt, dt_bias, dt_softplus, A, tiles, slope)
    n_chunks, f32 = steps.shape[2], dict(device=x.device, dtype=torch.float32)
    states, decay = torch.empty(batch, heads, n_chunks, head_dim, n_states, **f32), torch.empty(steps.shape[:3], **f32)
    ssd_chunk_state_kernel[(batch, heads, n_chunks)](x, steps, a_cum, B, states, decay, length, heads, groups,
                                                     head_dim, n_states, n_chunks, **tiles)
    entering, final = pass_states(states, decay, None if initial_state is None else initial_state.float().contiguous())
    return (steps, a_cum), entering, decay, final


def ssd_forward(x, dt, A, B, C, chunk_size, D=None, initial_state=None):
    """ssd_chunked in four kernels (inputs checked): y in x's dtype, the final state in float32. Not differentiable."""
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (x, dt, A, B, C, D, initial_state)):
        raise RuntimeError("ssd_forward is not differentiable: call mamba_chunk_scan_combined (section 8), or no_grad")
    _check_forward_inputs(x, dt, A, B, C, chunk_size, D, initial_state)
    return _forward_kernels(x, dt, A, B, C, chunk_size, D, initial_state)


def _forward_kernels(x, dt, A, B, C, chunk_size, D, initial_state, z=None, dt_bias=None, dt_softplus=False):
    """The forward on checked inputs; z, dt_bias and dt_softplus are section 8's options (its op checks them)."""
    if x.numel() == 0:
        return _empty_forward(x, B.shape[3], initial_state, z)   # "Going deeper: the forward kernels' fine print"
    (batch, length, heads, head_dim), (groups, n_states) = x.shape, B.shape[2:]
    x, dt, B, C, z = (None if t is None else t.contiguous() for t in (x, dt, B, C, z))
    A, D, dt_bias = (None if t is None else t.float().contiguous() for t in (A, D, dt_bias))   # indexed by head
    tiles = _tiles(chunk_size, head_dim, n_states)
    steps, entering, _, final = _scan_chunks(x, dt, dt_bias, dt_softplus, A, B, tiles, initial_state)
    y = torch.empty(x.shape, dtype=_output_dtype(x, z), device=x.device)
    ssd_chunk_output_kernel[(batch, heads, entering.shape[2])](
        x, *steps, B, C, D, z, entering, y, length, heads, groups, head_dim, n_states, entering.shape[2],
        HAS_D=D is not None, HAS_Z=z is not None, **tiles)
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
# The errors are float32 rounding, also for sizes that are not powers of two (padded, masked tiles).

# %% [markdown]
# ## What we built
#
# `ssd_loop` (the float64 reference), `segsum` and `ssd_quadratic` (one masked matrix) and
# `ssd_chunked`, each checked against the loop; and `ssd_forward`, four Triton kernels, checked in
# float32.
#
# **Going deeper, in brief.** The backward follows chapter 03, the steps in reverse, each term a
# product of one chunk's tiles (sections 6-7). With the forward it makes one differentiable op with
# `mamba_ssm`'s interface, `scan_lib.mamba_chunk_scan_combined` (section 8), which section 9 times
# against `mamba_ssm`'s kernels; section 10 wraps it in `scan_lib.Mamba2`.

# %% [markdown]
# ## Going deeper: more checks of the reference forms
#
# Three checks the main line leaves out: the loop against chapter 02's scan, the stable segment sum
# against the difference of cumulative sums, and step 1 of the chunked form alone.
#
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
# **Why the stable segment sum.** The next cell makes section 2's cancellation visible: a long sequence
# of steps whose cumulative sum drifts far from zero, in float32. The difference of cumulative sums
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
# **Step 1 alone.** The final state is step 3's last value, so section 3's table checks steps 2 and 3;
# step 1 alone is the answer when every chunk starts from zero states. Cut the problem into chunks and
# run each piece alone, the loop and the chunked function: for a single chunk from zero, steps 2-4 add
# nothing, and what is compared is the diagonal block.

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
# ## Going deeper: the cost for other chunks
#
# Section 4's factor, $(2Q(N+P) + 4PN) / 4PN$, for a few chunk sizes and head shapes, beside NVIDIA's
# datasheet rates for the H200 (the H100 SXM's datasheet gives the same two). It grows with $Q$;
# `mamba_ssm` buys its factor of 4.0 back with fewer, larger products and a shorter scan over chunks.

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
# ## Going deeper: the forward kernels' fine print
#
# What section 5 says in a sentence each: why the steps and the scan over chunks have kernels of their
# own, how `_mm` rounds, why a chunk of 64, and what `ssd_forward` checks, with a cell that tries its
# refusals.
#
# **The steps, once.** Every chunk kernel needs its chunk's steps $\Delta$ (after section 8's bias and
# softplus) and $a_{\text{cum}}$, and a training step runs six of them: the state and output kernels
# forward, then the state kernel again, the adjoint and the two grad kernels backward. Computed in each, as
# this chapter first did, the steps cost far more than the $Q$ exponentials and logarithms of a
# chunk. A program's `(CHUNK,)` vector lives in the layout of the 2-D tile it scales (the rows of the
# decays, their columns, a product's rows), spread so that each thread holds many of its positions,
# and Triton recomputed the load, the softplus and the cumulative sum in each layout it was used in
# (two `math.log` in the output kernel's TTGIR, three in the grad kernel's). Compiled for sm_90 by
# `benchmarks/sass_lines.py` (bfloat16, $P = N = 64$, chunk 64, with $D$, $z$, the bias and the
# softplus; static counts, not time), those lines were 1109 of the output kernel's 2592 instructions
# per thread, 1103 of the adjoint kernel's 4128 and 648 of the grad kernel's 3880.
#
# So `ssd_chunk_steps_kernel` computes them once per forward and once per backward, as `mamba_ssm`'s
# `_chunk_cumsum_fwd` does, into two (batch, heads, chunks, `CHUNK`) float32 arrays (the kernels' chunks, of
# at most `KERNEL_CHUNK`), 0 past $L$, in which a chunk kernel's program finds each of its two rows
# contiguous. It reads $\Delta$ through chapter 05's `_load_delta` (the bias, the overflow-safe softplus, the
# mask), one program per batch element, chunk and 32 heads: $(B, L, H)$ keeps the heads last, so one
# position's 32 heads are 128 contiguous bytes of float32, a whole cache line per load, where a program per
# (batch, head, chunk) reads 4 bytes of every line it touches. The same counts after the change: the output
# kernel 1584 instructions, the adjoint 3176, the grad 3480 (one kernel then; its spills 488 bytes a thread,
# from 548), the state kernel 528 (from 632); the steps kernel has 1040 (1352 in the backward, where it also
# writes the softplus's slope for the grad kernel, section 8), in 256 programs at (8, 2048, 32 heads) where
# each chunk kernel runs 8192. The price is memory traffic: two float32 arrays of $B \cdot H \cdot L$ written,
# and read back by every chunk kernel in place of the raw steps, each about 3 % of a bfloat16 $x$ at $P = 64$.
# Whether the trade wins on the GPU is for section 9's table to say (`benchmarks/NOTES_ssd.md` has the static
# profiles).
#
# **The scan over chunks.** Chapter 03's `linear_scan` computes the same recurrence as
# `ssd_state_passing_kernel` with the state entries as rows, but it wants a gate per row and the
# chunks along each row: the chunk's gate would be copied to all $P N$ rows, and the states
# transposed in and out. A kernel that reads the states in their own layout needs neither copy;
# `tests/test_ssd.py` checks the two agree.
#
# **On the tensor cores.** Every product goes through `_mm`, which puts it on the tensor cores at the
# precision of the inputs, with float32 sums:
#
# - bfloat16 and float16 inputs: both operands are rounded to the input's dtype first, as chapter 08's
#   attention rounds its probabilities, so the weighted inputs, the decayed scores and the states are
#   rounded once more each (chapter 08's `matmul` makes this work under the CPU interpreter too).
# - float32 inputs: the tensor cores take TF32, a float32 with a 10-bit mantissa, which alone would
#   round each operand by up to $2^{-11}$. Triton's `tf32x3` splits each operand into a TF32 part and
#   a TF32 remainder and adds three products, which gives about float32's accuracy for three times
#   the work; a float32 call stays checked to float32 rounding. That is the default. A program that
#   allows PyTorch's own float32 matrix products to run in TF32, with
#   `torch.set_float32_matmul_precision("high")` (or `"medium"`), gets one TF32 product here too, as
#   `mamba_ssm`'s kernels always do: about a third of the work, each operand rounded to TF32. `_tiles`
#   reads the setting at each call and hands it to every chunk kernel as the constexpr `DOT`, which
#   `_mm` passes to `tl.dot` as its `input_precision` (the interpreter computes in float32 either way).
#   Compiled for sm_90, one TF32 product per `tl.dot` needs more shared memory than three, not less:
#   at $N = 128$ the grad kernel of before section 7's split would need 288 KB, more than the 227 KB a
#   program may have; the two grad kernels need 192 and 160 KB
#   (`benchmarks/sass_lines.py --matmul-precision high`; `benchmarks/NOTES_ssd.md`).
#
# **Why chunks of 64.** A program holds a whole chunk: $Q \times Q$ scores and decays, $Q \times P$ and
# $Q \times N$ tiles, and a $P \times N$ state, all in registers. Compiled for sm_90, the H100's and
# H200's architecture (`ptxas -v` reports what each thread spills to memory; `benchmarks/NOTES_ssd.md`
# has the counts), at $Q = 64$ the forward's kernels spill at most about a hundred bytes per thread
# and the backward's `ssd_chunk_grad_kernel` the most, even after section 7's split; at 256 every kernel
# spills kilobytes, and at 128, timed on an H200, the forward is a little faster but a training step
# slower (`benchmarks/results/ssd_tensor_cores_h200_2026-12-03.log`). So the kernels run
# chunks of 64, and a call with `mamba_ssm`'s 256 gets the same result up to rounding.
#
# **What `ssd_forward` checks.** The kernels trust their arguments: they index $A$ and $D$ by head at
# stride 1, B and C by group $h \,/\!/\, (H / G)$, and tile the chunk with `tl.arange` (a power of two)
# into `tl.dot` (16 or more). So `ssd_forward` first checks them (`_check_forward_inputs`: the shapes of
# section 1, float dtypes, one device, groups dividing heads, the chunk a power of two $\ge 16$),
# raising an error that names the argument instead of reading past a tensor (and refusing what it
# cannot do: float64 inputs, whose digits its float32 sums would drop, and inputs that require a
# gradient, since the kernels keep no graph; `ssd_chunked` does both, section 7 adds the backward's
# kernels and section 8 the differentiable op); copies $A$ and $D$ to contiguous float32; and for an
# empty sequence launches nothing, returning an empty $y$ and the initial state, as the loop does
# (`_empty_forward`, the next cell).

# %%
#| export
def _empty_forward(x, n_states, initial_state, z):
    """ssd_forward's result for an empty x (L = 0, or no batch, heads or channels), launching nothing."""
    batch, _, heads, head_dim = x.shape
    final = (torch.zeros(batch, heads, head_dim, n_states, device=x.device) if initial_state is None
             else initial_state.to(torch.float32, copy=True))               # no position moved the state
    return torch.empty(x.shape, dtype=_output_dtype(x, z), device=x.device), final

# %% [markdown]
# The cell tries the arguments the kernels cannot take as they come: $A$ and $D$ read every other
# element of a longer tensor give the same answer, an empty sequence gives the initial state, and
# groups that do not divide the heads or a chunk of 24 are refused.

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
# ## Going deeper: 6. The backward, chunk by chunk
#
# The main line's backward in brief, worked out: each step's adjoint, then `ssd_chunked_backward`,
# every gradient in PyTorch, checked against autograd through the loop.
#
# Training needs the gradients of $y$ and of the final state with respect to every input. Autograd
# through `ssd_chunked` gives them, but it keeps every intermediate of every step, and the kernels
# to come need the backward spelled out as the forward is: per chunk, in matrix products, with one
# short scan over the chunks. The recipe is chapter 03's: run the forward's steps in reverse, and
# for each step turn "the gradient of what it produced" into "the gradient of what it read". Per
# head, within a chunk, write $u_s = \Delta_s x_s$, $a_s = \Delta_s A$, $\gamma_t = \sum_{r \le t} a_r$
# (the decay from the chunk's start), $\gamma_{\text{end}} = \sum_{r \in c} a_r$ (its value at the
# chunk's last slot, padded slots included), $L_{ts} = e^{\gamma_t - \gamma_s}$ for $s \le t$ and
# $G_{ts} = C_t^{\top} B_s$; $\bar y_t$ is the gradient arriving at $y_t$ (a vector of $P$) and
# $\bar\gamma_t$ collects what reaches $\gamma_t$.
#
# **Step 4, the past's contribution** $y^{\text{off}}_t = e^{\gamma_t} \mathbf{H}^{\text{in}}_c C_t$, is a
# product of three factors, so each gets the other two: $\bar C_t \mathrel{+}= e^{\gamma_t}
# \mathbf{H}^{\text{in}\top}_c \bar y_t$, the entering state gets the local gradient
# $\bar{\mathbf{H}}^{\text{loc}}_c = \sum_t e^{\gamma_t} \bar y_t C_t^{\top}$, and
# $\bar\gamma_t \mathrel{+}= \bar y_t \cdot y^{\text{off}}_t$.
#
# **Step 3, the scan over chunks**, runs backward, as chapter 03's adjoint does: with
# $\mathbf{H}^{\text{in}}_{c+1} = g_c \mathbf{H}^{\text{in}}_c + \mathbf{S}_c$ and $g_c = e^{\gamma_{\text{end}}}$,
# the total gradient of the state entering chunk $c$ is
# $\Lambda_c = \bar{\mathbf{H}}^{\text{loc}}_c + g_c \Lambda_{c+1}$, started from the final state's
# gradient ($\Lambda$ after the last chunk; zero if there is none). Then
# $\bar{\mathbf{S}}_c = \Lambda_{c+1}$, $\bar g_c = \langle \Lambda_{c+1}, \mathbf{H}^{\text{in}}_c \rangle$
# (the sum of the entries' products), so $\bar\gamma_{\text{end}} \mathrel{+}= g_c \bar g_c$, and the
# initial state's gradient is $\Lambda_0$.
#
# **Step 2, the chunk states** $\mathbf{S}_c = \sum_s w_s u_s B_s^{\top}$, $w_s = e^{\gamma_{\text{end}} - \gamma_s}$:
# $\bar u_s \mathrel{+}= w_s \bar{\mathbf{S}}_c B_s$, $\bar B_s \mathrel{+}= w_s \bar{\mathbf{S}}_c^{\top} u_s$, and
# $w_s$'s gradient $u_s^{\top} \bar{\mathbf{S}}_c B_s$, times $w_s$, goes to $\gamma_{\text{end}}$ with a plus
# sign and to $\gamma_s$ with a minus.
#
# **Step 1, the diagonal blocks** $y^{\text{diag}}_t = \sum_{s \le t} L_{ts} G_{ts} u_s$: with
# $\pi_{ts} = \bar y_t \cdot u_s$, $\bar u_s \mathrel{+}= \sum_{t \ge s} L_{ts} G_{ts} \bar y_t$,
# $\bar G_{ts} = L_{ts} \pi_{ts}$ (so $\bar C_t \mathrel{+}= \sum_s \bar G_{ts} B_s$ and
# $\bar B_s \mathrel{+}= \sum_t \bar G_{ts} C_t$), and $L_{ts} G_{ts} \pi_{ts}$ goes to $\gamma_t$ with a
# plus sign and to $\gamma_s$ with a minus: four products of $Q \times Q$ tiles ($\pi$, $(L \circ G)^{\top}
# \bar y$, $\bar G B$, $\bar G^{\top} C$) besides recomputing $C B^{\top}$, of the shapes the forward's are.
#
# Last, the chain through the definitions: $\bar x_s = \Delta_s \bar u_s + D \bar y_s$,
# $\bar a_r = \sum_{t \ge r} \bar\gamma_t$ (a reverse cumulative sum within the chunk: $\gamma$ is a
# cumulative sum, chapter 01), $\bar\Delta_s = x_s \cdot \bar u_s + A \bar a_s$,
# $\bar A = \sum_s \Delta_s \bar a_s$, $\bar D = \sum_t \bar y_t \cdot x_t$, and $\bar B$, $\bar C$ summed
# over the heads of each group (`_per_group`, `_per_head`'s adjoint). Padded positions have
# $\Delta = 0$ and their gradients are dropped, but not $\bar\gamma$ at the last slot of the last
# chunk, which may be a padded one: it holds the end terms of steps 2 and 3, and the reverse
# cumulative sum carries them to every real position.
# Every term is a product of tiles of one chunk, or the short reverse scan: the same structure as
# the forward, which is what lets a kernel compute it chunk by chunk.

# %%
#| export
def _per_group(M, groups):
    """_per_head's adjoint: a (batch, L, heads, N) gradient summed over each group's heads, (batch, L, groups, N)."""
    batch, length, heads, n_states = M.shape
    return M.reshape(batch, length, groups, heads // groups, n_states).sum(3)


def _empty_gradients(x, dt, A, B, C, dfinal, D, initial_state):
    """The gradients for a sequence of no position: the final state is the initial one, so its gradient
    (a copy) is the initial state's, and nothing else has one (zeros; None for absent D, initial_state)."""
    d_start = None
    if initial_state is not None:
        d_start = torch.zeros_like(initial_state) if dfinal is None else dfinal.to(initial_state.dtype, copy=True)
    return (torch.zeros_like(x), torch.zeros_like(dt), torch.zeros_like(A), torch.zeros_like(B),
            torch.zeros_like(C), None if D is None else torch.zeros_like(D), d_start)


def ssd_chunked_backward(x, dt, A, B, C, chunk_size, dy, dfinal=None, D=None, initial_state=None):
    """The gradients of ssd_chunked's (y, final state) with respect to x, dt, A, B, C, D and the initial
    state, given dy (batch, L, heads, P) and dfinal (batch, heads, P, N) or None: the forward's four
    steps recomputed, then each step's adjoint, in reverse order. Returns (dx, ddt, dA, dB, dC, dD, dh0)
    (dD, dh0 None where D, initial_state are)."""
    batch, length, heads, head_dim = x.shape
    groups, n_states = B.shape[2], B.shape[3]
    if length == 0:
        return _empty_gradients(x, dt, A, B, C, dfinal, D, initial_state)
    xc, dtc, Bc, Cc, dyc = (_in_chunks(t, chunk_size) for t in (x, dt, _per_head(B, heads), _per_head(C, heads), dy))
    n_chunks = xc.shape[1]
    # the forward's intermediates (steps 1 to 3)
    a_cum, decay, scores, to_end, _, entering, _ = _chunk_steps(xc, dtc, A, Bc, Cc, initial_state)
    u = dtc[..., None] * xc                                                # dt x: batch x chunks x Q x heads x P
    gate = torch.exp(a_cum[..., -1])                                       # batch x heads x chunks
    from_start = torch.exp(a_cum)                                          # batch x heads x chunks x Q
    # 4. y_off_t = e^{cum_t} H_c C_t
    d_cum = torch.einsum("bcthp,bchpn,bcthn,bhct->bhct", dyc, entering, Cc, from_start)
    dC = torch.einsum("bcthp,bchpn,bhct->bcthn", dyc, entering, from_start)
    d_entering_local = torch.einsum("bcthp,bcthn,bhct->bchpn", dyc, Cc, from_start)
    # 3. the scan over chunks, in reverse: Lambda_c = local_c + gate_c Lambda_{c+1}, from dfinal
    later = x.new_zeros(batch, heads, head_dim, n_states) if dfinal is None else dfinal.to(x.dtype)
    d_chunk_states, d_gate = [None] * n_chunks, [None] * n_chunks
    for c in reversed(range(n_chunks)):
        d_chunk_states[c] = later                                          # dL/dS_c = Lambda_{c+1}
        d_gate[c] = (later * entering[:, c]).sum((-2, -1))                 # batch x heads
        later = d_entering_local[:, c] + gate[:, :, c, None, None] * later
    dh0 = later
    d_chunk_states = torch.stack(d_chunk_states, dim=1)                    # batch x chunks x heads x P x N
    d_cum[..., -1] += torch.stack(d_gate, dim=-1) * gate                   # gate = e^{cum_end}
    # 2. chunk states S_c = sum_s e^{cum_end - cum_s} u_s B_s^T
    uSB = torch.einsum("bcshp,bchpn,bcshn->bhcs", u, d_chunk_states, Bc) * to_end
    d_cum[..., -1] += uSB.sum(-1)
    d_cum -= uSB
    du = torch.einsum("bhcs,bchpn,bcshn->bcshp", to_end, d_chunk_states, Bc)
    dB = torch.einsum("bhcs,bchpn,bcshp->bcshn", to_end, d_chunk_states, u)
    # 1. diagonal blocks y_diag_t = sum_{s <= t} L_ts (C_t . B_s) u_s
    dyu = torch.einsum("bcthp,bcshp->bhcts", dyc, u)                       # dy_t . u_s
    du += torch.einsum("bhcts,bcthp->bcshp", decay * scores, dyc)
    d_scores = decay * dyu
    dC += torch.einsum("bhcts,bcshn->bcthn", d_scores, Bc)
    dB += torch.einsum("bhcts,bcthn->bcshn", d_scores, Cc)
    d_segsum = decay * scores * dyu                                        # d/d(cum_t - cum_s), 0 above the diagonal
    d_cum += d_segsum.sum(-1) - d_segsum.sum(-2)
    # u = dt x, a = dt A, cum = cumsum(a)
    da = d_cum.flip(-1).cumsum(-1).flip(-1)                                # sum over t >= r
    da = da.permute(0, 2, 3, 1)                                            # batch x chunks x Q x heads
    dxc = dtc[..., None] * du
    ddtc = (xc * du).sum(-1) + A * da
    dA = (dtc * da).sum((0, 1, 2))
    unchunk = lambda t: t.reshape(batch, n_chunks * chunk_size, *t.shape[3:])[:, :length]   # noqa: E731
    dx, ddt, dBh, dCh = unchunk(dxc), unchunk(ddtc), unchunk(dB), unchunk(dC)
    dD = None
    if D is not None:
        dx = dx + D[:, None] * dy
        dD = (dy * x).sum((0, 1, 3))
    return dx, ddt, dA, _per_group(dBh, groups), _per_group(dCh, groups), dD, (dh0 if initial_state is not None else None)

# %% [markdown]
# **Checks**, in float64: every gradient against autograd through the sequential loop `ssd_loop`
# (not through `ssd_chunked`, whose derivation this is), with a gradient arriving at the final state
# too, at lengths that are and are not multiples of the chunk, one position, a chunk as long as the
# sequence, groups of heads, with and without $D$ and the initial state.

# %%
print(f"{'L':>4s} {'chunk':>5s} {'heads/groups':>12s} {'D, h0':>6s}  largest relative error per gradient")
for length, chunk, heads, groups, with_options in [(37, 8, 4, 2, True), (32, 8, 4, 4, False), (5, 16, 2, 1, True),
                                                   (1, 4, 2, 2, True), (64, 64, 6, 3, True), (40, 8, 4, 1, False)]:
    x, dt, A, B, C, D, h0 = ssd_problem(length=length, heads=heads, groups=groups, seed=length)
    D, h0 = (D, h0) if with_options else (None, None)
    inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, h0=h0)
    leaves = {name: t.clone().requires_grad_() for name, t in inputs.items() if t is not None}
    y, final = ssd_loop(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], leaves.get("D"), leaves.get("h0"))
    g = torch.Generator().manual_seed(length)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(DEVICE)
    dfinal = torch.randn(final.shape, generator=g, dtype=torch.float64).to(DEVICE)
    want = dict(zip(leaves, torch.autograd.grad((y * dy).sum() + (final * dfinal).sum(), list(leaves.values()))))
    got = dict(zip(inputs, ssd_chunked_backward(x, dt, A, B, C, chunk, dy, dfinal, D, h0)))
    errors = {name: ((got[name] - want[name]).abs().max() / want[name].abs().max()).item() for name in want}
    print(f"{length:4d} {chunk:5d} {f'{heads}/{groups}':>12s} {str(with_options):>6s}  "
          + " ".join(f"{name} {error:.1e}" for name, error in errors.items()))
    assert max(errors.values()) < 1e-12, errors
    assert all(got[name] is None for name in inputs if name not in want)

# %% [markdown]
# Every gradient agrees with autograd through the loop to float64 rounding. This function is the
# specification of the Triton backward to come, as `ssd_chunked` was of the forward's kernels.

# %% [markdown]
# ## Going deeper: 7. A Triton backward
#
# Section 6's gradients as Triton kernels on the tensor cores, `ssd_backward`, checked in float32.
#
# Section 6's steps map onto kernels the way the forward's do, with the scan over chunks once more
# section 5's `pass_states`, now walking the chunks backward (`reverse=True`):
#
# - The forward's steps kernel and its steps 2 and 3 again (`_scan_chunks`, section 5's code): the
#   backward gets only the inputs, so it computes the steps and $a_{\text{cum}}$ once more (and, where
#   the softplus is on, its slope, section 8), and it needs the state entering each chunk:
#   recomputing that costs one kernel and one scan, where keeping it would cost $P \times N$ floats per
#   chunk and head for the whole sequence. The kernels below read their chunk's rows of the steps
#   and $a_{\text{cum}}$, as the forward's do.
# - `ssd_chunk_adjoint_kernel`, one program per (batch, head, chunk): the local gradient of the
#   entering state, $\sum_t e^{\gamma_t} \bar y_t C_t^{\top}$, one `tl.dot` ($P \times Q$ by $Q \times N$).
# - The backward scan over chunks, $\Lambda_c = (\text{local})_c + g_c \Lambda_{c+1}$ from the final
#   state's gradient: `pass_states(locals, decays, dfinal, reverse=True)`, which walks from the last
#   chunk to the first and writes, for chunk $c$, the carry before it folds chunk $c$ in: $\Lambda_{c+1}$,
#   the gradient of the state leaving the chunk, which is what chunk $c$ reads. Its carry at the end is
#   $\Lambda_0$, the initial state's gradient.
# - Two grad kernels, one program per (batch, head, chunk) each, for steps 4, 2 and 1 of section 6 at
#   the chunk's positions: `ssd_chunk_grad_kernel` computes $\bar x$, $\bar\Delta$ and the chunk's
#   shares of $\bar A$ and $\bar D$ (five `tl.dot`s on tiles of $Q$, $P$ and $N$, the reverse cumulative
#   sum within the chunk, `tl.cumsum(..., reverse=True)`, and the chain), `ssd_chunk_grad_bc_kernel`
#   $\bar B$ and $\bar C$ (five more). Both start from the same loads (`_grad_program`), so two
#   products, $\bar y_t H$ and the $\bar y_t \cdot u_s$, are computed twice. That is the price of the
#   split: one kernel with all eight products held so many tiles at once that it spilled registers to
#   memory. Compiled for sm_90 by `benchmarks/sass_lines.py` (bfloat16, $P = N = 64$, with section 8's
#   options; static counts, not time), the one kernel had 3480 instructions a thread and spilled 488
#   bytes; the two have 2776 and 1496 instructions and spill 96 bytes and none. In float32 (tf32x3
#   products) the one kernel had 9312 instructions and spilled 4588 bytes; the two have 6336 and 4104
#   and spill 2180 and 604. Timed on an H100 (`benchmarks/results/probe_ssd_h100_2026-12-07.log`), the
#   split made the backward faster in each row timed: by 30 % in float32 at $N = 64$, 12 % in bfloat16
#   at $N = 128$, under 1 % in bfloat16 at $N = 64$. Summed as section 6 writes it,
#   $\bar a_r = \sum_{t \ge r} \bar\gamma_t$ adds step 1's $E_{ts} = L_{ts} G_{ts} \pi_{ts}$ once with a
#   plus sign (at $t$) and once with a minus
#   (at $s$), and the two cancel for every $r \le s$: exact in float64, lost digits in float32.
#   `ssd_chunk_grad_kernel` adds only what survives,
#   $\sum_{t \ge r > s} E_{ts}$, the pairs that straddle $r$ (a cumulative sum along $s$, then a masked
#   column sum), and step 2's terms the same way, $\sum_{s < r} v_s$ with $v_s = w_s\, u_s^{\top}
#   \bar{\mathbf{S}}_c B_s$. A
#   head writes its own $\bar B$ and $\bar C$ and its chunk's shares of $\bar A$ and $\bar D$; the
#   launcher sums them over the heads of a group and over the chunks, so nothing depends on the
#   order the programs run in (no atomics).
#
# As in the forward, every product goes through `_mm`, on the tensor cores at the inputs' precision.
# Section 8's options reach these kernels too: the adjoint kernel writes $\bar z$ and turns the
# gradient of the gated output into that of the scan's, $\bar y_t \odot \operatorname{silu}(z_t)$,
# which the grad kernels read; the first chains $\bar\Delta$ through the softplus with the slope the
# steps kernel wrote. Section 8 says how.

# %%
#| export
from scan_lib.selective_scan import _gate_dybar, _gate_dz   # chapter 05's gate y = ybar silu(z), differentiated


@triton.jit
def _head_rows(b, t, t_ok, length, heads, h, head_dim, p):
    """Offsets and mask of the chunk's rows of head h in a contiguous b x L x h x P tensor (x, z, their
    gradients): CHUNK x P, p = arange(BLOCK_P)."""
    return ((b * length + t[:, None]) * heads + h) * head_dim + p[None, :], t_ok[:, None] & (p[None, :] < head_dim)


@triton.jit
def ssd_chunk_adjoint_kernel(DY, Z, X, STEPS, A_CUM, B, C, D, ENTERING, LOCAL, DYBAR, DZ, length, heads, groups,
                             head_dim, n_states, n_chunks, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                             CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """Program (batch, head, chunk): what the chunk's outputs send back to the state entering it,
    sum_t exp(a_cum_t) dybar_t C_t^T (P x N), dybar the gradient of the scan's output. Where z is given the
    gate's gradients come first: dz = dy ybar silu'(z) (ybar recomputed as the output kernel computes it, and
    rounded to DYBAR's dtype) and dybar = dy silu(z), both written for the grad kernel. X, DY, Z, DYBAR, DZ:
    b x L x h x P, B, C: b x L x g x N, STEPS, A_CUM: b x h x chunks x CHUNK; ENTERING, LOCAL: b x h x chunks
    x P x N."""
    b, h, c, g, t, t_ok, dt, a_cum, _ = _chunk_program(STEPS, A_CUM, length, heads, groups, n_chunks, CHUNK)
    p, n = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    dy = _rows(DY, b, t, t_ok, length, heads, h, head_dim, BLOCK_P)        # CHUNK x P
    if HAS_Z:   # section 8's gate, undone once here rather than in each layout the grad kernel's products want
        ybar, Cv = _scan_outputs(X, B, C, D, ENTERING, b, h, c, g, t, t_ok, dt, a_cum, length, heads, groups,
                                 head_dim, n_states, n_chunks, HAS_D, CHUNK, BLOCK_P, BLOCK_N, DOT)
        z = _rows(Z, b, t, t_ok, length, heads, h, head_dim, BLOCK_P)
        qp, qp_ok = _head_rows(b, t, t_ok, length, heads, h, head_dim, p)
        # Staged through DYBAR (section 8) so that ybar, dy and z meet in the loads' layout and the gate
        # is computed once: ybar goes out and comes back, then dy silu(z) goes out and comes back.
        tl.store(DYBAR + qp, ybar.to(DYBAR.dtype.element_ty), qp_ok)
        tl.debug_barrier()   # every thread's stores done and visible to the program's threads
        ybar = _rows(DYBAR, b, t, t_ok, length, heads, h, head_dim, BLOCK_P)   # what this program stored
        tl.store(DZ + qp, _gate_dz(dy, ybar, z).to(DZ.dtype.element_ty), qp_ok)
        tl.debug_barrier()   # every thread's loads of ybar done before DYBAR is overwritten
        tl.store(DYBAR + qp, _gate_dybar(dy, z, HAS_Z).to(DYBAR.dtype.element_ty), qp_ok)
        tl.debug_barrier()
        dy = _rows(DYBAR, b, t, t_ok, length, heads, h, head_dim, BLOCK_P)
    else:
        Cv = _rows(C, b, t, t_ok, length, groups, g, n_states, BLOCK_N)    # CHUNK x N
    local = _mm(tl.trans(dy * tl.exp(a_cum)[:, None]), Cv, DY, DOT)         # P x N
    base = (b * heads + h) * n_chunks + c
    tl.store(LOCAL + base * head_dim * n_states + p[:, None] * n_states + n[None, :], local,
             (p[:, None] < head_dim) & (n[None, :] < n_states))


@triton.jit
def _grad_program(X, STEPS, A_CUM, B, C, DY, ENTERING, DSTATE, length, heads, groups, head_dim, n_states, n_chunks,
                  CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """What both grad kernels' programs (batch, head, chunk) start from: b, h, positions t (t_ok: before L),
    dt, a_cum (gamma) and a_end, the chunk's index in b x h x chunks, the rows of x, u = x dt and dy (CHUNK x
    P), of B and C (CHUNK x N), the state entering the chunk H and the gradient of the one leaving it dS (P x N)."""
    b, h, c, g, t, t_ok, dt, a_cum, a_end = _chunk_program(STEPS, A_CUM, length, heads, groups, n_chunks, CHUNK)
    p, n = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    x = _rows(X, b, t, t_ok, length, heads, h, head_dim, BLOCK_P)          # CHUNK x P
    dy = _rows(DY, b, t, t_ok, length, heads, h, head_dim, BLOCK_P)        # CHUNK x P
    Bv = _rows(B, b, t, t_ok, length, groups, g, n_states, BLOCK_N)        # CHUNK x N
    Cv = _rows(C, b, t, t_ok, length, groups, g, n_states, BLOCK_N)
    part = (b * heads + h) * n_chunks + c                                  # the chunk's index in b x h x chunks
    pn = part * head_dim * n_states + p[:, None] * n_states + n[None, :]
    pn_ok = (p[:, None] < head_dim) & (n[None, :] < n_states)
    H = tl.load(ENTERING + pn, pn_ok, other=0.0)                            # P x N
    dS = tl.load(DSTATE + pn, pn_ok, other=0.0)
    return b, h, t, t_ok, dt, a_cum, a_end, part, x, x * dt[:, None], dy, Bv, Cv, H, dS


@triton.jit
def ssd_chunk_grad_kernel(X, STEPS, A_CUM, SLOPE, A, B, C, D, DY, ENTERING, DSTATE, DX, DDT, DA_PART, DD_PART,
                          DBIAS_PART, length, heads, groups, head_dim, n_states, n_chunks, HAS_D: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """Program (batch, head, chunk): section 6's steps 4, 2 and 1 in reverse for the chunk's positions, from
    the state entering it (ENTERING) and the gradient of the state leaving it (DSTATE, both P x N): dx, d dt
    (of the raw dt: times the softplus's slope SLOPE where given), and the chunk's shares of dA, dD and, where
    DBIAS_PART is given, d dt_bias (b x h x chunks). dB and dC: the next kernel. STEPS, A_CUM, SLOPE: the steps
    kernel's, b x h x chunks x CHUNK. DY: the gradient of the scan's output (the adjoint kernel's DYBAR where z
    is given)."""
    b, h, t, t_ok, dt, a_cum, a_end, part, x, u, dy, Bv, Cv, H, dS = _grad_program(
        X, STEPS, A_CUM, B, C, DY, ENTERING, DSTATE, length, heads, groups, head_dim, n_states, n_chunks, CHUNK,
        BLOCK_P, BLOCK_N)
    to_end, rate = tl.exp(a_end - a_cum), tl.load(A + h).to(tl.float32)   # w_s; a_cum: gamma
    # 4. the past's contribution e^{gamma_t} H C_t
    d_gamma = tl.exp(a_cum) * tl.sum(_mm(dy, H, X, DOT) * Cv, axis=1)       # dy_t . y_off_t
    end_term = tl.exp(a_end) * tl.sum(tl.sum(dS * H, axis=1), axis=0)       # the chunk's gate
    # 2. the chunk state sum_s w_s u_s B_s^T
    dSB = _mm(Bv, tl.trans(dS), X, DOT)                                     # CHUNK x P: dS B_s
    du = to_end[:, None] * dSB
    v = to_end * tl.sum(u * dSB, axis=1)
    # 1. the diagonal block sum_{s <= t} L_ts (C_t . B_s) u_s
    rows, cols = tl.arange(0, CHUNK)[:, None], tl.arange(0, CHUNK)[None, :]
    M = _mm(Cv, tl.trans(Bv), X, DOT) * _decays(a_cum, CHUNK)              # CHUNK x CHUNK
    du += _mm(tl.trans(M), dy, X, DOT)
    E = M * _mm(dy, tl.trans(u), X, DOT)                                    # L_ts (C_t . B_s) (dy_t . u_s)
    # the chain: a = dt A, gamma = cumsum(a) within the chunk, so a_r gets the gamma_t of t >= r. The
    # terms entering with opposite signs at two positions are summed in the form that cancels nothing
    # (section 7's prose): step 1's as the pairs t >= r > s, step 2's as the positions before r
    F = tl.cumsum(E, axis=1) - E                                            # F_tr = sum over s < r of E_ts
    da = (tl.cumsum(d_gamma, axis=0, reverse=True) + end_term + tl.cumsum(v, axis=0) - v
          + tl.sum(tl.where(rows >= cols, F, 0.0), axis=0))
    dx = dt[:, None] * du
    dd_part = tl.sum(tl.sum(dy * x, axis=1), axis=0)
    if HAS_D:
        dx += tl.load(D + h).to(tl.float32) * dy
    qp, qp_ok = _head_rows(b, t, t_ok, length, heads, h, head_dim, tl.arange(0, BLOCK_P))   # x's rows, CHUNK x P
    tl.store(DX + qp, dx.to(DX.dtype.element_ty), qp_ok)
    ddt = tl.sum(x * du, axis=1) + rate * da                                # d step
    if SLOPE is not None:   # the step is softplus(dt + dt_bias), whose slope the steps kernel wrote
        ddt *= tl.load(SLOPE + part * CHUNK + tl.arange(0, CHUNK))
    tl.store(DDT + (b * length + t) * heads + h, ddt.to(DDT.dtype.element_ty), t_ok)
    tl.store(DA_PART + part, tl.sum(dt * da, axis=0))
    tl.store(DD_PART + part, dd_part)
    if DBIAS_PART is not None:
        tl.store(DBIAS_PART + part, tl.sum(tl.where(t_ok, ddt, 0.0), axis=0))   # d dt_bias: d dt summed, to L


@triton.jit
def ssd_chunk_grad_bc_kernel(X, STEPS, A_CUM, B, C, DY, ENTERING, DSTATE, DB, DC, length, heads, groups, head_dim,
                             n_states, n_chunks, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                             DOT: tl.constexpr):
    """Program (batch, head, chunk): the same steps' dB and dC, this head's share (fp32, b x L x h x N, summed over
    a group's heads afterwards). Arguments as the kernel above's."""
    b, h, t, t_ok, dt, a_cum, a_end, part, x, u, dy, Bv, Cv, H, dS = _grad_program(
        X, STEPS, A_CUM, B, C, DY, ENTERING, DSTATE, length, heads, groups, head_dim, n_states, n_chunks, CHUNK,
        BLOCK_P, BLOCK_N)
    dC = tl.exp(a_cum)[:, None] * _mm(dy, H, X, DOT)                        # 4.: CHUNK x N
    dB = tl.exp(a_end - a_cum)[:, None] * _mm(u, dS, X, DOT)                # 2.
    dG = _decays(a_cum, CHUNK) * _mm(dy, tl.trans(u), X, DOT)               # 1.: L_ts (dy_t . u_s)
    dC += _mm(dG, Bv, X, DOT)
    dB += _mm(tl.trans(dG), Cv, X, DOT)
    n = tl.arange(0, BLOCK_N)
    qn_head = ((b * length + t[:, None]) * heads + h) * n_states + n[None, :]   # this head's dB, dC rows
    qn_ok = t_ok[:, None] & (n[None, :] < n_states)
    tl.store(DB + qn_head, dB, qn_ok)
    tl.store(DC + qn_head, dC, qn_ok)


def ssd_backward(x, dt, A, B, C, chunk_size, dy, dfinal=None, D=None, initial_state=None):
    """The gradients of ssd_forward's (y, final state) given dy (batch, L, heads, P) and dfinal (batch,
    heads, P, N) or None: (dx, d dt, dA, dB, dC, dD, d initial_state), each in its input's dtype (dD and
    d initial_state None where D and initial_state are). Seven kernel launches, the forward's steps and scan
    recomputed (section 7)."""
    _check_forward_inputs(x, dt, A, B, C, chunk_size, D, initial_state)
    check_float_tensor("dy", dy)
    _check_given("dy", dy, "x's (batch, L, heads, P)", x.shape)
    _check_given("dfinal", dfinal, "(batch, heads, P, N)", (*x.shape[::2], x.shape[3], B.shape[3]))
    check_same_device(x=x, dy=dy, dfinal=dfinal)
    return _backward_kernels(x, dt, A, B, C, chunk_size, dy, dfinal, D, initial_state)[:7]


def _backward_kernels(x, dt, A, B, C, chunk_size, dy, dfinal, D, initial_state, z=None, dt_bias=None,
                      dt_softplus=False):
    """ssd_backward's work on checked inputs, with section 8's options (z, dt_bias, dt_softplus, as in
    _forward_kernels): its seven gradients, then dz and d dt_bias (None where z, dt_bias are)."""
    batch, length, heads, head_dim = x.shape
    groups, n_states = B.shape[2], B.shape[3]
    if x.numel() == 0:
        return (*_empty_gradients(x, dt, A, B, C, dfinal, D, initial_state),
                *(None if t is None else torch.zeros_like(t) for t in (z, dt_bias)))
    x, dt, B, C, dy = (t.contiguous() for t in (x, dt, B, C, dy))
    z = None if z is None else z.contiguous()
    A32, D32, bias32 = (None if t is None else t.float().contiguous() for t in (A, D, dt_bias))
    tiles = _tiles(chunk_size, head_dim, n_states)
    n_chunks = cdiv(length, tiles["CHUNK"])
    grid = (batch, heads, n_chunks)
    f32 = dict(device=x.device, dtype=torch.float32)
    slope = torch.empty(batch, heads, n_chunks, tiles["CHUNK"], **f32) if dt_softplus else None
    steps, entering, decay, _ = _scan_chunks(x, dt, bias32, dt_softplus, A32, B, tiles, initial_state, slope)
    local = torch.empty(batch, heads, n_chunks, head_dim, n_states, **f32)
    dz = None if z is None else torch.empty_like(z)
    # the scan's output gradient dy silu(z) where z is given (and ybar staged before it): dy's dtype, float32
    # where that is float16, whose range (65504) ybar may leave while y = ybar silu(z) stays in it
    dybar = dy if z is None else torch.empty_like(dy, dtype=torch.float32 if dy.dtype == torch.float16 else None)
    ssd_chunk_adjoint_kernel[grid](dy, z, x, *steps, B, C, D32, entering, local, dybar, dz, length, heads, groups,
                                   head_dim, n_states, n_chunks, HAS_D=D is not None, HAS_Z=z is not None, **tiles)
    d_end = None if dfinal is None else dfinal.float().contiguous()
    d_leaving, d_start = pass_states(local, decay, d_end, reverse=True)   # Lambda_{c+1} per chunk, Lambda_0
    dx, ddt = torch.empty_like(x), torch.empty_like(dt)
    dB_heads, dC_heads = (torch.empty(batch, length, heads, n_states, **f32) for _ in range(2))
    dA_part, dD_part = (torch.empty(batch, heads, n_chunks, **f32) for _ in range(2))
    dbias_part = None if dt_bias is None else torch.empty(batch, heads, n_chunks, **f32)
    sizes = (length, heads, groups, head_dim, n_states, n_chunks)
    ssd_chunk_grad_kernel[grid](x, *steps, slope, A32, B, C, D32, dybar, entering, d_leaving, dx, ddt, dA_part,
                                dD_part, dbias_part, *sizes, HAS_D=D is not None, **tiles)
    ssd_chunk_grad_bc_kernel[grid](x, *steps, B, C, dybar, entering, d_leaving, dB_heads, dC_heads, *sizes, **tiles)
    dh0 = None if initial_state is None else d_start.to(initial_state.dtype)
    return (dx, ddt, dA_part.sum((0, 2)).to(A.dtype), _per_group(dB_heads, groups).to(B.dtype),
            _per_group(dC_heads, groups).to(B.dtype),
            None if D is None else dD_part.sum((0, 2)).to(D.dtype), dh0, dz,
            None if dt_bias is None else dbias_part.sum((0, 2)).to(dt_bias.dtype))

# %% [markdown]
# **Checks**: float32 inputs, every gradient against section 6's `ssd_chunked_backward` on the same
# values in float64 (itself checked against autograd through the loop), at lengths that are not
# multiples of the chunk, one position, head and state sizes that are not powers of two, groups of
# heads, with and without $D$, the initial state and a final-state gradient; and an empty sequence.
# Every gradient but $\bar A$ is held to $10^{-5}$. $\bar A = \sum_s \Delta_s \bar a_s$ adds the $\bar a_s$
# of every position of the batch, each a sum over the rest of its chunk, and its total is often far
# smaller than its terms, so float32 rounding weighs more in it: it is held to $5 \cdot 10^{-5}$, and
# the table shows how close it comes.

# %%
print(f"{'L':>4s} {'chunk':>5s} {'heads/groups':>12s} {'P':>3s} {'N':>3s} {'options':>7s}  largest relative error per gradient")
for length, chunk, heads, groups, head_dim, n_states, with_options in [
        (37, 16, 4, 2, 3, 5, True), (32, 16, 2, 2, 16, 16, True), (70, 32, 2, 1, 8, 4, False),
        (1, 16, 2, 2, 4, 4, True), (48, 16, 4, 4, 5, 3, False)]:
    x, dt, A, B, C, D, h0 = ssd_problem(length=length, heads=heads, head_dim=head_dim, groups=groups,
                                        n_states=n_states, seed=length)       # float64
    g = torch.Generator().manual_seed(length)
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64).to(DEVICE)
    dfinal = torch.randn(h0.shape, generator=g, dtype=torch.float64).to(DEVICE)
    if not with_options:
        D = h0 = dfinal = None
    want = ssd_chunked_backward(x, dt, A, B, C, chunk, dy, dfinal, D, h0)
    as32 = [None if t is None else t.float() for t in (x, dt, A, B, C, dy, dfinal, D, h0)]
    got = ssd_backward(*as32[:5], chunk, *as32[5:])
    errors = {name: ((g.double() - w).abs().max() / w.abs().max()).item()
              for name, g, w in zip(["x", "dt", "A", "B", "C", "D", "h0"], got, want) if w is not None}
    print(f"{length:4d} {chunk:5d} {f'{heads}/{groups}':>12s} {head_dim:3d} {n_states:3d} {str(with_options):>7s}  "
          + " ".join(f"{name} {error:.1e}" for name, error in errors.items()))
    assert max(error for name, error in errors.items() if name != "A") < 1e-5, errors
    assert errors["A"] < 5e-5, errors   # a sum over every position (see above)
    assert all((g is None) == (w is None) for g, w in zip(got, want))
x, dt, A, B, C, D, h0 = (t.float() for t in ssd_problem(length=5, seed=1))
dfinal = torch.randn_like(h0)
empty = ssd_backward(x[:, :0], dt[:, :0], A, B[:, :0], C[:, :0], 16, x[:, :0], dfinal, D, h0)
print(f"L = 0: d initial_state equals dfinal: {torch.equal(empty[-1], dfinal)}; dA, dD zero: "
      f"{bool((empty[2] == 0).all() and (empty[5] == 0).all())}")
assert torch.equal(empty[-1], dfinal) and (empty[2] == 0).all() and (empty[5] == 0).all()

# %% [markdown]
# ## Going deeper: the host's share, and launches remembered
#
# A call `kernel[grid](...)` is Python before it is a launch. Triton binds every argument to its
# parameter, works out the specialisation of each (a tensor's dtype and whether its address is a
# multiple of 16 bytes, whether an integer is 1 or a multiple of 16), looks the result up among its
# compiled kernels, calls the grid function, gathers the launch's metadata, and only then calls the
# compiled kernel's launcher, a C function; `triton.autotune` adds its own pass over the arguments to
# build its key. This chapter's kernels take a pointer per tensor and the sizes, 7 to 22 runtime
# arguments, and a training step launches nine to eleven of them: all that work is done at every
# launch, though for a given shape, layout and dtype every answer is the one of the launch before.
#
# `RememberedLaunches` wraps a kernel so that the answers are worked out once. Its key is what Triton's
# answers depend on: the current device, each tensor's dtype and 16-byte alignment, and every other
# argument and constexpr as it is. The first call with a key goes through Triton (and through
# `triton.autotune`, which searches if its own key is new); the compiled kernel is remembered with the
# configuration the autotuner picked, in chapter 07's bounded cache (`remember`). Later calls with the
# key evaluate the grid and call the compiled kernel's launcher directly. Chapter 07's `Launcher` does the
# same for its selective scan with a plan per signature; this wrapper keeps the launch as it reads,
# `kernel[grid](...)`, for any `@triton.jit` kernel or `triton.autotune` over one, and evaluates a grid
# function at each call from the remembered configuration. Under the interpreter every call goes through
# Triton, as does every call with `through_triton` set (section 9 times both ways).
#
# What the key leaves out, and so what it costs: lengths are in it as they are, so a new length is a new
# key and pays Triton's path once (a key of Triton's own classes, "is 1, is a multiple of 16", would cost
# a Python test per argument on every call). Triton's debug and instrumentation settings are not in it:
# changed after a first call, they reach only new keys. And it serves `@triton.jit` kernels and
# `triton.autotune` over one, not `triton.heuristics`.

# %%
#| export
from scan_lib.fast_selective_scan import remember  # chapter 07's bounded cache
from scan_lib.runtime import INTERPRET


class RememberedLaunches:
    """A @triton.jit kernel, or triton.autotune over one, whose launches after the first for a key skip Triton's
    Python path.

    `kernel[grid](*args, **constexprs)` as for the wrapped kernel, every non-constexpr parameter passed
    positionally. On a GPU the first call for a key (the current device; each tensor argument's dtype and
    16-byte alignment; every other argument and every constexpr) goes through Triton, which autotunes and
    compiles where it must; the compiled kernel is kept with the configuration triton.autotune picked, and
    later calls with the key go straight to its launcher. A grid function sees the constexprs and that
    configuration; a grid of fewer than three dims is padded with 1s, as Triton does. Under the interpreter,
    or with `through_triton` set, every call goes through Triton. Anything else (`.cache`, `.fn`, ...) is the
    wrapped kernel's."""
    through_triton = False

    def __init__(self, kernel):
        self.kernel = kernel.kernel if isinstance(kernel, RememberedLaunches) else kernel  # a cell run twice
        self.compiled = {}  # key -> (compiled kernel, constexprs and configuration, the parameters after args)

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.launch(grid, args, constexprs)

    def launch(self, grid, args: tuple, constexprs: dict) -> None:
        if INTERPRET or self.through_triton:
            self.kernel[grid](*args, **constexprs)
            return
        key = (torch.cuda.current_device(), *constexprs.items(),
               *[(arg.dtype, arg.data_ptr() % 16 == 0) if isinstance(arg, torch.Tensor) else arg for arg in args])
        remembered = self.compiled.get(key)
        if remembered is None:
            compiled = self.kernel[grid](*args, **constexprs)
            config = getattr(self.kernel, "best_config", None)  # triton.autotune's pick for this call
            meta = {**constexprs, **(config.all_kwargs() if config is not None else {})}
            tail = [meta[name] for name in self.kernel.arg_names[len(args):]]  # the compiled kernel takes them all
            remember(self.compiled, key, (compiled, meta, tail))
            return
        compiled, meta, tail = remembered
        grid = grid(meta) if callable(grid) else grid
        compiled[(*grid, 1, 1)[:3]](*args, *tail)  # the compiled kernel's launcher reads three dims

    def __getattr__(self, name):
        if name.startswith("__") or name in ("kernel", "compiled"):  # not yet set (copy, pickle)
            raise AttributeError(name)
        return getattr(self.kernel, name)


# %% [markdown]
# ## Going deeper: the forward in one walk over the chunks
#
# Section 5's forward runs the chunked algorithm step by step, a kernel per step, and between the steps
# the chunk states go through memory: float32, (batch, heads, chunks, $P$, $N$), written by the state
# kernel, read and written again by the scan over chunks, read by the output kernel. Four passes over
# an array that, at the shapes `mamba_ssm`'s Mamba-2 blocks train at, is larger than $x$. The cell
# counts them beside what a forward must move anyway: $x$, $z$ and $y$ in bfloat16 (the steps, $B$ and
# $C$ are far smaller).

# %%
def forward_state_bytes(batch, length, heads, head_dim, n_states, chunk=KERNEL_CHUNK, passes=4):
    """Bytes of float32 chunk states section 5's forward moves: passes over (batch, heads, chunks, P, N)."""
    return passes * batch * heads * cdiv(length, chunk) * head_dim * n_states * 4


for n_states in (64, 128):
    xzy = 3 * 8 * 2048 * 32 * 64 * 2                                        # x, z and y in bfloat16
    states = forward_state_bytes(8, 2048, 32, 64, n_states)
    print(f"(8, 2048, 32 heads, P 64, N {n_states:3d}): chunk states {states / 2**20:5.0f} MiB over four passes, "
          f"x, z and y {xzy / 2**20:4.0f} MiB: {states / xzy:.1f}x")

# %% [markdown]
# So the states, not the inputs, set the forward's memory traffic: 2.7 times what $x$, $z$ and $y$
# move at $N = 64$, 5.3 times at $N = 128$. They need not leave the chip. One program per (batch,
# head) can walk its chunks in order, as chapter 02's kernel walks a row chunk by chunk with its
# state carried in a register (section 4 there), here the state $H$ in registers: for each chunk it
# computes the outputs from $H$ (steps 1 and 4 of section 3), then folds the chunk into it
# (steps 2 and 3), $H \leftarrow e^{a_{\text{end}}} H + \sum_s w_s\, u_s B_s^{\top}$, and the final state is
# $H$ after the last chunk. No state is written but the last. The loop's loads do not depend on $H$,
# so Triton's compiler can issue the next chunk's loads while this one computes (software pipelining,
# the loop's `num_stages`).
#
# The price is parallelism. Section 5's kernels run a program per (batch, head, chunk); the walk runs
# one per (batch, head), each a chain of $L/Q$ chunks, so with fewer programs than the GPU has
# multiprocessors most of them idle for the whole walk. Programs take $P$ in blocks of at most 64
# (channel $p$ of $y$, a column of the chunk's $Q \times P$ tile, needs only row $p$ of $H$), which also
# keeps $H$, a $P \times N$ float32 tile, within the registers. `_walks` decides where the walk runs:
# 16-bit inputs (bfloat16 or float16) and at least as many programs as multiprocessors, the regime of
# the one measurement (bfloat16, section 9's shapes: $8 \times 32$ programs, $N$ = 64 and 128; float16
# and larger $N$ were not timed). On an H100 it made that forward faster on the GPU at both sizes of
# state, 318.2 to 159.3 us at $N = 64$ and 538.5 to 330.4 at $N = 128$
# (`benchmarks/results/probe_ssd_fused_h100_2026-12-07.log`). Section 9's table, recorded with the walk,
# has the op's bfloat16 forward at 159 and 326 us on the GPU, below `mamba_ssm`'s forward kernels there
# (268 and 349 us). In float32, whose tf32x3 products hold
# three times the tiles, the walk was slower (the same log), and its compile spills registers (`python
# benchmarks/sass_lines.py ssd-walk --dtype fp32`), so float32 keeps section 5's kernels. Under the
# interpreter (no multiprocessors) it runs wherever the inputs are 16-bit, so that the CPU checks it.
# The loop's pipelined loads take shared memory, and the tiles of $B$ and $C$ grow
# with $N$: where a GPU refuses the walk for it (Triton's `OutOfResources` at the launch; `python
# benchmarks/sass_lines.py ssd-walk --n-states 512` prints what sm_90 would need), `_walk_forward`
# returns section 5's kernels' results instead, and does not try that walk again.

# %%
#| export
from triton.runtime.errors import OutOfResources

from scan_lib.fast_selective_scan import multiprocessor_count   # chapter 07's


@triton.jit
def ssd_chunk_walk_kernel(X, STEPS, A_CUM, B, C, D, Z, START, Y, FINAL, length, heads, groups, head_dim, n_states,
                          n_chunks, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """Program (batch, head, block of P): the chunks in order, the state H (BLOCK_P x N) in registers: each chunk's
    y = (L o C B^T)(dt x) + exp(a_cum) C H^T (+ D x), times silu(z) if given, stored; then H = exp(a_end) H +
    sum_s exp(a_end - a_cum_s) dt_s x_s B_s^T. H starts at START (if given) and ends in FINAL, b x h x P x N
    float32. Other arguments as ssd_chunk_output_kernel's."""
    b, h, block = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    g = h // (heads // groups)
    p, n = block * BLOCK_P + tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    pn_ok = (p[:, None] < head_dim) & (n[None, :] < n_states)
    state_at = (b * heads + h) * head_dim * n_states + p[:, None] * n_states + n[None, :]
    H = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    if START is not None:
        H = tl.load(START + state_at, pn_ok, other=0.0)
    for c in range(n_chunks):
        t = c * CHUNK + tl.arange(0, CHUNK)
        t_ok = t < length
        row = ((b * heads + h) * n_chunks + c) * CHUNK
        dt, a_cum = tl.load(STEPS + row + tl.arange(0, CHUNK)), tl.load(A_CUM + row + tl.arange(0, CHUNK))
        a_end = tl.load(A_CUM + row + CHUNK - 1)
        qp, qp_ok = _head_rows(b, t, t_ok, length, heads, h, head_dim, p)         # this block's rows of x, z, y
        x = tl.load(X + qp, qp_ok, other=0.0).to(tl.float32)                    # CHUNK x BLOCK_P
        Bv = _rows(B, b, t, t_ok, length, groups, g, n_states, BLOCK_N)        # CHUNK x N
        Cv = _rows(C, b, t, t_ok, length, groups, g, n_states, BLOCK_N)
        y = _mm(_mm(Cv, tl.trans(Bv), X, DOT) * _decays(a_cum, CHUNK) * dt[None, :], x, X, DOT)   # step 1
        y += tl.exp(a_cum)[:, None] * _mm(Cv, tl.trans(H), X, DOT)                                  # step 4
        if HAS_D:
            y += tl.load(D + h).to(tl.float32) * x
        if HAS_Z:
            z = tl.load(Z + qp, qp_ok, other=0.0).to(tl.float32)
            y *= z * tl.sigmoid(z)
        tl.store(Y + qp, y.to(Y.dtype.element_ty), qp_ok)
        weight = dt * tl.exp(a_end - a_cum)                                                         # steps 2, 3
        H = tl.exp(a_end) * H + _mm(tl.trans(x * weight[:, None]), Bv, X, DOT)
    tl.store(FINAL + state_at, H, pn_ok)


WALK_BLOCK_P = 64   # the rows of P (and of the state) a walking program holds
_WALK_REFUSED = set()   # (device, dtypes, tiles) of walks a GPU refused: more shared memory than it has


def _walks(x):
    """Whether the op's forward walks the chunks (ssd_chunk_walk_kernel): 16-bit x, and on a GPU at least as many
    programs (batch x heads x blocks of P) as multiprocessors."""
    if x.element_size() != 2:
        return False
    multiprocessors = multiprocessor_count(x.device)
    programs = x.shape[0] * x.shape[2] * cdiv(x.shape[3], WALK_BLOCK_P)
    return multiprocessors is None or programs >= multiprocessors


def _walk_forward(x, dt, A, B, C, chunk_size, D, initial_state, z=None, dt_bias=None, dt_softplus=False):
    """_forward_kernels' results from the steps kernel and one walk over the chunks (checked inputs); from
    _forward_kernels itself where the GPU refuses the walk for its shared memory (the loop's pipelined tiles of B
    and C grow with N: N 128 in bfloat16 is more than an sm_89 GPU, an L4's, gives a program; N 512 more than an
    H100's; section 5's kernels need far less)."""
    if x.numel() == 0:
        return _empty_forward(x, B.shape[3], initial_state, z)
    (batch, length, heads, head_dim), (groups, n_states) = x.shape, B.shape[2:]
    tiles = _tiles(chunk_size, head_dim, n_states)
    block_p = min(WALK_BLOCK_P, tiles["BLOCK_P"])
    refused = (x.device, x.dtype, B.dtype, C.dtype, None if z is None else z.dtype, D is None, block_p,
               tiles["CHUNK"], tiles["BLOCK_N"])
    if refused in _WALK_REFUSED:
        return _forward_kernels(x, dt, A, B, C, chunk_size, D, initial_state, z, dt_bias, dt_softplus)
    x, dt, B, C, z = (None if t is None else t.contiguous() for t in (x, dt, B, C, z))
    A, D, dt_bias = (None if t is None else t.float().contiguous() for t in (A, D, dt_bias))   # indexed by head
    steps = _launch_steps(dt, dt_bias, dt_softplus, A, tiles)   # dt, a_cum
    n_chunks, f32 = steps[0].shape[2], dict(device=x.device, dtype=torch.float32)
    y = torch.empty(x.shape, dtype=_output_dtype(x, z), device=x.device)
    final = torch.empty(batch, heads, head_dim, n_states, **f32)
    start = None if initial_state is None else initial_state.float().contiguous()
    try:   # Triton raises at the launch, before the kernel runs
        ssd_chunk_walk_kernel[(batch, heads, cdiv(head_dim, block_p))](
            x, *steps, B, C, D, z, start, y, final, length, heads, groups, head_dim, n_states, n_chunks,
            HAS_D=D is not None, HAS_Z=z is not None, CHUNK=tiles["CHUNK"], BLOCK_P=block_p,
            BLOCK_N=tiles["BLOCK_N"], DOT=tiles["DOT"])
    except OutOfResources:
        _WALK_REFUSED.add(refused)   # not tried again for this key
        return _forward_kernels(x, dt, A, B, C, chunk_size, D, initial_state, z, dt_bias, dt_softplus)
    return y, final

# %% [markdown]
# The walk against the float64 loop, at awkward sizes: a length that is not a multiple of the chunk,
# $P = 80$ (two blocks of $P$), groups, the initial state, $D$ and the gate, and beside it section 5's
# kernels on the same inputs. The loop runs on the inputs as rounded to the dtype, so what remains is the
# kernels' own rounding: float32's, and in bfloat16 a few roundings of $2^{-8}$ (the products' operands
# and $y$), the bound the tests use.

# %%
for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
    for length, chunk, heads, groups, head_dim, n_states in [(37, 16, 4, 2, 3, 5), (70, 32, 2, 1, 80, 16)]:
        x, dt, A, B, C, D, h0 = ssd_problem(length=length, heads=heads, head_dim=head_dim, groups=groups,
                                            n_states=n_states, seed=length, dtype=torch.float32)
        x, B, C, z = (t.to(dtype) for t in (x, B, C, torch.randn_like(x)))
        y_want, final_want = ssd_loop(*(t.double() for t in (x, dt, A, B, C, D, h0)))
        want = (y_want * torch.nn.functional.silu(z.double()), final_want)
        for name, forward in (("walk", _walk_forward), ("section 5", _forward_kernels)):
            errors = [((g.double() - w).abs().max() / w.abs().max()).item()
                      for g, w in zip(forward(x, dt, A, B, C, chunk, D, h0, z), want)]
            print(f"{str(dtype)[6:]:>8s} L {length:3d} chunk {chunk:2d} P {head_dim:2d} {name:>9s}: y {errors[0]:.1e}, "
                  f"final state {errors[1]:.1e}")
            assert max(errors) < bound, (name, errors)

# %% [markdown]
# ## Going deeper: 8. One differentiable op: `mamba_chunk_scan_combined`
#
# The forward and backward launchers joined into the op that training calls: its plumbing, its
# checks, and what it refuses.
#
# Sections 5 and 7 give two launchers, a forward and its backward. An engineer wants what
# `mamba_ssm` offers, `mamba_chunk_scan_combined`, with its shapes and argument order, so that a
# Mamba-2 layer can call ours in its place, and a function that autograd, `torch.compile` and
# `torch.func` treat as one operation (`tests/test_ssd.py` checks `vmap`, `torch.func.grad` and
# `torch.compile(fullgraph=True)`). The pieces, the same as for the other public ops of the course:
#
# - `ssd_fwd` and `ssd_bwd`: the two launchers as `torch.library` custom ops, each with a *fake*
#   implementation (the shapes and dtypes of its results without running a kernel, which is what
#   `torch.compile` traces with) and a vmap rule (one call per element of the mapped dimension).
#   They run the launchers' kernels without their checks (`_forward_kernels`, `_backward_kernels`):
#   the public function checks its arguments once per call, as the course's other ops do.
# - `SSDFn`: an autograd Function whose forward is `ssd_fwd` and whose backward is `ssd_bwd`, keeping
#   only the inputs (the backward recomputes the steps and the chunk states, section 7). Its kernels'
#   gradients carry no graph, so the backward ties them to the inputs through chapter 05's
#   `_NoSecondDerivative`: a second derivative raises instead of treating the gradients as constants,
#   silently.
# - `mamba_chunk_scan_combined`: the checks, then `SSDFn` with the options as they come: the step's
#   bias and softplus, $\Delta_t = \operatorname{softplus}(\Delta^{\text{raw}}_t + b)$ in float32, and
#   the gate, $y_t \odot \operatorname{silu}(z_t)$, are computed inside the kernels.
# - The forward: the walk over the chunks where `_walks` says so (16-bit inputs, enough programs; the
#   section before), else section 5's kernels. The backward: section 7's.
# - The kernels, launched through `RememberedLaunches` ("Going deeper: the host's share, and launches
#   remembered"). A training step launches nine to eleven of them, most with many
#   arguments, and Triton's Python launch path works on every argument at every launch; remembered,
#   each launch after the first with the same key goes straight to the compiled kernel. Section 9's
#   table is recorded with them. Measured both ways on an H100 before the walk
#   (`benchmarks/results/host_ssd_h100_2026-12-07.log`, the same bits both ways), the host's time per
#   bfloat16 forward+backward went from 1630 to 1504 us at $N = 64$ and from 1829 to 1480 at $N = 128$;
#   at (2, 512, 32, 64, 64) the forward's host time rose instead, 222 to 312 us, one sample, not yet
#   explained.
#
# **Why the options are in the kernels.** In PyTorch each option is a pass of its own over memory:
# the bias and the softplus read and write the $(B, L, H)$ steps (two passes, and a float32 copy), the
# gate reads $y$ and $z$ and writes $(B, L, H, P)$ once more, and autograd adds their backward
# passes (softplus' and silu's gradients, the bias's sum). The kernels read $\Delta^{\text{raw}}$ and
# $z$ anyway, or can, so each option is a few operations on values already in registers, and each
# pass over memory is saved. (The profile in `benchmarks/NOTES_ssd.md` put the PyTorch work around
# the kernels, these passes and the sums of the gradients over heads and chunks, at about 270 of a
# 1415 us training step on an H200. The choices below were then timed one at a time on an H100,
# `benchmarks/results/probe_ssd_h100_2026-12-07.log`: each made the backward faster on the GPU, moving
# the gate most; section 9 says more.) The choices:
#
# - **The step, computed once.** `ssd_chunk_steps_kernel` loads $\Delta^{\text{raw}}$ and computes
#   $\operatorname{softplus}(\Delta^{\text{raw}} + b)$ (chapter 05's `_load_delta`, its overflow-safe
#   softplus), 0 past $L$, and the cumulative sums $a_{\text{cum}}$, once per forward and once per backward,
#   as `mamba_ssm` does with its steps and their cumulative sums; every chunk kernel (state, output, adjoint,
#   the two grad kernels) reads its chunk's rows of the two. Computed in each of them instead, as this chapter
#   first did, the steps cost far more than their exponentials and logarithms, up to 43 % of a kernel's
#   instructions: "Going deeper: the forward kernels' fine print" has the static counts.
#   `ssd_chunk_grad_kernel` multiplies $\bar\Delta$ by the softplus's slope,
#   $\sigma(\Delta^{\text{raw}} + b)$, which the backward's steps kernel writes as a third array from the
#   same $\Delta^{\text{raw}} + b$ (cheaper, compiled for sm_90, than reading the raw steps again in the
#   grad kernel: before section 7's split, 3480 instructions a thread there against 3528, and 488 bytes
#   of spills against 512), and writes each chunk's sum of the product, which the launcher adds up into
#   $\bar b$ (as $\bar A$'s shares, no atomics).
# - **The gate.** The output kernel multiplies by $\operatorname{silu}(z)$ before its one store. The
#   backward needs the output before the gate, $\hat y$, for $\bar z = \bar y \odot \hat y \odot
#   \operatorname{silu}'(z)$, and the scan's gradient is $\bar y \odot \operatorname{silu}(z)$. `mamba_ssm`
#   saves $\hat y$ in its forward (a second output of $x$'s size) and reads it back in a kernel of its
#   own. Here nothing is saved: the adjoint kernel recomputes $\hat y$ as the output kernel computes it
#   (`_scan_outputs`, one definition for both: three more `tl.dot`s on $x$, $B$, $C$, the steps and the
#   entering state), writes $\bar z$, and writes $\bar y \odot \operatorname{silu}(z)$, which the grad
#   kernels read in place of $\bar y$ and $z$. The first version undid the gate in the grad kernel,
#   where it cost most: compiled for sm_90 (`benchmarks/sass_lines.py`, bfloat16, $P = N = 64$, chunk
#   64, static counts, not time), Triton computed $\operatorname{silu}(z)$ once for each layout the grad
#   kernel's products read $\bar y \odot \operatorname{silu}(z)$ in, and the gate's lines were 44 % of
#   its 6440 instructions a thread, with 1644 bytes of spills; with the gate moved out (and the steps
#   of the bullet above) it had 3480 and 488 bytes, before section 7 split it in two. The price is one
#   more write and read of an $x$-sized tensor; saving $\hat y$ in the forward instead would add
#   another. On the GPU the move paid: the backward took about two thirds of the time it took with the
#   gate undone in the grad kernel, in bfloat16 at both sizes of state (the log above).
# - **The gate's layouts, and a barrier.** A 2-D value in a Triton program has a *layout*: which of
#   the program's threads holds which element. $\bar y$ and $z$ come in the layout of their loads,
#   $\hat y$ in that of the `tl.dot` that made it, and $\bar y \odot \operatorname{silu}(z)$ goes into
#   another `tl.dot`, which wants its own. Moving values between layouts goes through shared memory,
#   so where an elementwise chain is used in several layouts Triton's compiler recomputes it in each,
#   from the loads, instead: the adjoint kernel computed the gate in several (3176 instructions a
#   thread, static count as above). So it stages through memory: it stores $\hat y$ into the rows of
#   its output `DYBAR` that it fills anyway, loads them back in the layout $\bar y$ and $z$ were loaded
#   in, computes $\bar z$ and $\bar y \odot \operatorname{silu}(z)$ once there, stores the latter over
#   the same rows and loads it back for its product (2296 instructions, 195 registers against 254).
#   Each program reads back exactly the rows it wrote, with the same mask; no other program touches
#   them. Within the program the values cross between threads, which `tl.debug_barrier()` makes safe:
#   a barrier of the program's threads (`bar.sync` on an NVIDIA GPU) that none passes until all have
#   reached it, after which the memory writes each made before it are visible to all. One barrier
#   stands between each store and the load that reads it, and one between the load of $\hat y$ and the
#   store that overwrites it (else a fast thread could overwrite a row a slow one has not read yet).
#   The interpreter runs a program as one thread; there the barrier does nothing. The staged $\hat y$
#   is rounded to $\bar y$'s dtype (`mamba_ssm` keeps its saved $\hat y$ in $x$'s), but `DYBAR` is
#   float32 where $\bar y$ is float16: float16 ends at 65504, which $\hat y$ can pass where
#   $y = \hat y \odot \operatorname{silu}(z)$ does not. Two more passes over `DYBAR`'s rows, which
#   the program has just written (likely in the GPU's caches): timed, staging made the backward
#   faster, not slower, by 0.6 to 7 % in the rows of the log above.
#
# `y` keeps the dtype PyTorch's `y * silu(z)` gave (x's and z's promoted), and the step's float32.
#
# The arguments after `initial_states` are keyword-only: `mamba_ssm`'s function has `seq_idx` and
# `cu_seqlens` (several sequences packed in one row) in between, which this one does not take, and a
# keyword call reads the same in both. It does not take `dt_limit` either (a clamp of $\Delta$ that
# `mamba_ssm` leaves off by default), nor a $D$ per channel of shape (heads, $P$): $D$ is one number per
# head here, and anything else is refused by name.

# %%
#| export
from typing import Optional

from scan_lib.runtime import apply, custom_op
from scan_lib.selective_scan import _NoSecondDerivative as _SelectiveScanNoSecondDerivative
from scan_lib.selective_scan import _vmap_by_loop   # a vmap rule: one call per vmapped element, stacked

# The kernels of sections 5 and 7 and the walk, remembered (the launchers look them up by name at each call)
(ssd_chunk_steps_kernel, ssd_chunk_state_kernel, ssd_state_passing_kernel, ssd_chunk_output_kernel,
 ssd_chunk_adjoint_kernel, ssd_chunk_grad_kernel, ssd_chunk_grad_bc_kernel, ssd_chunk_walk_kernel) = map(
    RememberedLaunches, (ssd_chunk_steps_kernel, ssd_chunk_state_kernel, ssd_state_passing_kernel,
                         ssd_chunk_output_kernel, ssd_chunk_adjoint_kernel, ssd_chunk_grad_kernel,
                         ssd_chunk_grad_bc_kernel, ssd_chunk_walk_kernel))

_NO_SECOND_DERIVATIVE = ("mamba_chunk_scan_combined has no second derivative: its backward kernels' gradients "
                         "cannot be differentiated again (create_graph=True gives first derivatives only)")


def _dense(t):
    """An uninitialised tensor of t's shape, dtype and device, contiguous: what the launchers return."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


@custom_op("ssd_fwd", __name__)
def ssd_fwd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: int,
            D: Optional[torch.Tensor], z: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
            initial_state: Optional[torch.Tensor], dt_softplus: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward launcher as a custom op, the step's bias and softplus and the gate z included: y (x's
    shape; x's dtype, promoted with z's where z is given) and the final state (float32), both contiguous
    (the final state is a view of the last chunk's column of the scan: contiguous() copies it)."""
    forward = _walk_forward if _walks(x) else _forward_kernels   # "Going deeper: the forward in one walk"
    y, final = forward(x, dt, A, B, C, chunk_size, D, initial_state, z, dt_bias, dt_softplus)
    return y.contiguous(), final.contiguous()


@ssd_fwd.register_fake
def _(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_state, dt_softplus):
    batch, _, heads, head_dim = x.shape
    return (x.new_empty(x.shape, dtype=_output_dtype(x, z)),
            x.new_empty(batch, heads, head_dim, B.shape[3], dtype=torch.float32))


@custom_op("ssd_bwd", __name__)
def ssd_bwd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: int,
            dy: torch.Tensor, dfinal: Optional[torch.Tensor], D: Optional[torch.Tensor], z: Optional[torch.Tensor],
            dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
            dt_softplus: bool) -> list[torch.Tensor]:
    """The backward launcher as a custom op: the nine gradients of _backward_kernels (x, dt, A, B, C, D, the
    initial state, z, dt_bias), each contiguous in its input's dtype, an empty tensor where D, the initial
    state, z or dt_bias is None (a custom op returns tensors only)."""
    grads = _backward_kernels(x, dt, A, B, C, chunk_size, dy, dfinal, D, initial_state, z, dt_bias, dt_softplus)
    return [x.new_empty(0) if g is None else g.contiguous() for g in grads]


@ssd_bwd.register_fake
def _(x, dt, A, B, C, chunk_size, dy, dfinal, D, z, dt_bias, initial_state, dt_softplus):
    return [_dense(t) if t is not None else x.new_empty(0) for t in (x, dt, A, B, C, D, initial_state, z, dt_bias)]


ssd_fwd.register_vmap(_vmap_by_loop(ssd_fwd))
ssd_bwd.register_vmap(_vmap_by_loop(ssd_bwd))


class _NoSecondDerivative(_SelectiveScanNoSecondDerivative):
    """Chapter 05's identity on the gradients, attached to the tensors they depend on, with this op's message."""

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_NO_SECOND_DERIVATIVE)


class SSDFn(torch.autograd.Function):
    """(y, final state) = the chunked scan of (x, dt, A, B, C, D, z, dt_bias, initial_state, dt_softplus),
    differentiable once."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_state, dt_softplus):
        return ssd_fwd(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_state, dt_softplus)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_state, dt_softplus = inputs
        ctx.save_for_backward(x, dt, A, B, C, D, initial_state, z, dt_bias)   # the inputs only: no ybar (section 8)
        ctx.chunk_size, ctx.dt_softplus = chunk_size, dt_softplus
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, D, initial_state, z, dt_bias = ctx.saved_tensors
        dy = torch.zeros_like(x) if dy is None else dy
        with torch.no_grad():   # the op's own outputs carry no graph
            grads = ssd_bwd(x, dt, A, B, C, ctx.chunk_size, dy, dfinal, D, z, dt_bias, initial_state,
                            ctx.dt_softplus)
        inputs = (x, dt, A, B, C, D, initial_state, z, dt_bias)
        grads = [None if t is None else g for g, t in zip(grads, inputs)]
        if torch.is_grad_enabled():   # create_graph=True (or torch.func.grad): make a second derivative raise
            anchors = [t for t in (*inputs, dy, dfinal) if t is not None]
            given = [g for g in grads if g is not None]
            poisoned = iter(_NoSecondDerivative.apply(len(anchors), *anchors, *given))
            grads = [None if g is None else next(poisoned) for g in grads]
        dx, ddt, dA, dB, dC, dD, dh0, dz, ddt_bias = grads
        return dx, ddt, dA, dB, dC, None, dD, dz, ddt_bias, dh0, None


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, *,
                              dt_softplus=False, return_final_states=False):
    """Mamba-2's chunked scan with mamba_ssm's shapes and semantics: x (batch, L, heads, P), dt (batch, L,
    heads), A (heads,), B and C (batch, L, groups, N), D (heads,), z like x, dt_bias (heads,),
    initial_states (batch, heads, P, N). Returns y (x's dtype) or (y, final states (float32)). chunk_size
    is a power of two >= 16; the kernels run chunks of min(chunk_size, KERNEL_CHUNK), the same computation."""
    check_float_tensor("x", x)
    check_float_tensor("dt", dt)
    _check_given("z", z, "x's (batch, L, heads, P)", x.shape)
    _check_given("dt_bias", dt_bias, "(heads,)", dt.shape[-1:])
    check_same_device(x=x, z=z, dt_bias=dt_bias)
    _check_forward_inputs(x, dt, A, B, C, chunk_size, D, initial_states,
                          float64_dt=dt_bias is not None or bool(dt_softplus))
    y, final = apply(SSDFn, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, bool(dt_softplus))
    return (y, final) if return_final_states else y

# %% [markdown]
# **Checks**: the op's every gradient, $z$ and the step's bias included, against autograd through
# section 3's `ssd_chunked` in float64 on the same values, with the options composed the same way in
# PyTorch: float32 inputs, held as section 7's backward is ($10^{-5}$, and $5 \cdot 10^{-5}$ for $\bar A$
# and $\bar b$, the two sums over every position); and bf16 $x$, $z$, $B$, $C$, where the output's
# own rounding ($2^{-8}$ relative) sets the scale, held to $2 \cdot 10^{-2}$ on the GPU. On the CPU, to
# $5 \cdot 10^{-2}$: Triton's interpreter truncates float32 to bfloat16 where the GPU rounds to nearest
# (chapter 00), and since the gate moved into the kernels the gated gradient $\bar y \odot
# \operatorname{silu}(z)$ reaches the products in float32 and is converted there (PyTorch rounded it
# before), so the interpreter's errors are about twice the GPU's. Then what the op refuses.

# %%
import torch.nn.functional as F


def chunk_scan_reference(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states):
    """mamba_chunk_scan_combined's (y, final) composed from ssd_chunked (section 3), softplus on."""
    y, final = ssd_chunked(x, F.softplus(dt + dt_bias), A, B, C, chunk_size, D, initial_states)
    return y * F.silu(z), final


def op_gradient_errors(length, chunk, heads, groups, head_dim, n_states, low_precision):
    """{name: relative error} of y, the final state and every gradient, the op against the reference."""
    x, dt, A, B, C, D, h0 = ssd_problem(length=length, heads=heads, head_dim=head_dim, groups=groups,
                                        n_states=n_states, seed=length)
    g = torch.Generator().manual_seed(length)
    z, dt_raw = (torch.randn(t.shape, generator=g, dtype=torch.float64).to(DEVICE) for t in (x, dt))
    dt_bias = torch.randn(heads, generator=g, dtype=torch.float64).to(DEVICE) * 0.5
    inputs = dict(x=x, dt=dt_raw, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=h0)
    weights = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(DEVICE) for t in (x, h0)]
    lowered = {"x", "B", "C", "z"} if low_precision else set()
    results = {}
    for name, dtypes in (("want", {}), ("got", {k: torch.bfloat16 if k in lowered else torch.float32 for k in inputs})):
        leaves = {k: v.to(dtypes.get(k, v.dtype)).requires_grad_() for k, v in inputs.items()}
        if name == "want":
            y, final = chunk_scan_reference(*[leaves[k] for k in ("x", "dt", "A", "B", "C")], chunk,
                                            leaves["D"], leaves["z"], leaves["dt_bias"], leaves["initial_states"])
        else:
            y, final = mamba_chunk_scan_combined(*[leaves[k] for k in ("x", "dt", "A", "B", "C")], chunk,
                                                          leaves["D"], leaves["z"], leaves["dt_bias"],
                                                          leaves["initial_states"], dt_softplus=True,
                                                          return_final_states=True)
        loss = (y.double() * weights[0]).sum() + (final.double() * weights[1]).sum()
        results[name] = {"y": y, "final": final, **dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))}
    return {k: ((results["got"][k].double() - w).abs().max() / w.abs().max()).item() for k, w in results["want"].items()}


print(f"{'L':>4s} {'chunk':>5s} {'heads/groups':>12s} {'P':>3s} {'N':>3s} {'inputs':>8s}  largest relative error")
for length, chunk, heads, groups, head_dim, n_states, low_precision in [
        (37, 16, 4, 2, 3, 5, False), (70, 32, 2, 1, 8, 4, False), (1, 16, 2, 2, 4, 4, False), (37, 16, 4, 2, 3, 5, True)]:
    errors = op_gradient_errors(length, chunk, heads, groups, head_dim, n_states, low_precision)
    print(f"{length:4d} {chunk:5d} {f'{heads}/{groups}':>12s} {head_dim:3d} {n_states:3d} "
          f"{'bf16' if low_precision else 'float32':>8s}  " + " ".join(f"{k} {e:.1e}" for k, e in errors.items()))
    if low_precision:   # the interpreter truncates to bfloat16, the GPU rounds (above)
        assert max(errors.values()) < (2e-2 if ON_GPU else 5e-2), errors
    else:
        assert max(e for k, e in errors.items() if k not in ("A", "dt_bias")) < 1e-5, errors
        assert max(errors["A"], errors["dt_bias"]) < 5e-5, errors

# %%
x, dt, A, B, C, D, h0 = (t.float() for t in ssd_problem(length=20, seed=3))
for what, call, error in [
        ("z of the wrong shape", lambda: mamba_chunk_scan_combined(x, dt, A, B, C, 16, z=x[:, :5]), ValueError),
        ("D of shape (heads, P)", lambda: mamba_chunk_scan_combined(x, dt, A, B, C, 16, D=x[0, 0]), ValueError),
        ("a second derivative", lambda: torch.autograd.grad(
            torch.autograd.grad(mamba_chunk_scan_combined(x.requires_grad_(), dt, A, B, C, 16).sum(), x,
                                create_graph=True)[0].sum(), x), RuntimeError)]:
    try:
        call()
    except error as refusal:
        print(f"{what}: {error.__name__}: {str(refusal).splitlines()[0]}")
    else:
        raise AssertionError(f"{what} was accepted")

# %% [markdown]
# ## Going deeper: 9. The speed on a GPU
#
# The timing behind the main line's summary: the op against `mamba_ssm`'s Triton kernels and the
# memory floor, and how to read the table.
#
# The kernels of sections 5 and 7 run their products on the tensor cores (`_mm`), and each program
# holds one chunk of at most 64 positions. How fast is the op where Mamba-2 trains? The cell times one
# forward and one forward+backward of `mamba_chunk_scan_combined` with $D$, the gate $z$, `dt_bias` and
# the softplus on, one group of $B$ and $C$, every input requiring a gradient in the forward+backward, at
# the shapes of `mamba_ssm`'s Mamba-2 blocks (heads of $P = 64$, $N$ = 64 or 128, length 2048; `make
# bench` times longer sequences too): the median of `triton.testing.do_bench`, beside `mamba_ssm`'s own Triton
# `mamba_chunk_scan_combined` at its chunk of 256 where `mamba_ssm` is installed, and beside the memory
# floor, the inputs and outputs moved once at the copy bandwidth (chapter 07's floor). In float32 the
# two do different work by default: tf32x3 here, one TF32 product there (Triton's default for float32).
# So float32 has a second row, "float32 tf32", with ours under `torch.set_float32_matmul_precision("high")`,
# one TF32 product as theirs ("Going deeper: the forward kernels' fine print"). With
# `mamba_ssm` installed, expect the cell to take minutes on a fresh machine: its SSD kernels are
# autotuned, and each kernel's candidate configs (about 200 `triton.Config`s across its `ssd_*.py`
# files) are compiled and timed on the first call of every new shape and dtype.
#
# A call's time is the larger of two things: the GPU running the kernels, and the host (Python, the
# dispatch, autograd, an autotuner's lookup) issuing them. The table shows both: the forward as a
# call and as the GPU's time alone (the same forward replayed from a CUDA graph, which leaves the
# host's work out), and beside the forward+backward the host's time to issue one (calls queued back to
# back, no synchronisation inside). Where the host's time is near the call's, the GPU waits for Python,
# and the ratio compares host paths, not kernels.

# %%
def chunk_scan_inputs(batch, length, heads, head_dim, n_states, dtype, seed=0):
    """A timed call's inputs: x, z, B and C (one group) in dtype; raw steps dt, A, D and dt_bias float32."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    rand = lambda *shape, dtype=dtype: torch.randn(*shape, device=DEVICE, generator=g).to(dtype)  # noqa: E731
    x, z = rand(batch, length, heads, head_dim), rand(batch, length, heads, head_dim)
    B, C = rand(batch, length, 1, n_states), rand(batch, length, 1, n_states)
    dt = rand(batch, length, heads, dtype=torch.float32)
    D, dt_bias = rand(heads, dtype=torch.float32), rand(heads, dtype=torch.float32)
    A = -torch.rand(heads, device=DEVICE, generator=g) - 0.5
    return dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)


def chunk_scan_floor_us(inputs, backward, bandwidth):
    """The memory floor of a forward (read x, z, dt, B, C; write y) or of a training step (also read them
    and dy, write dx, dz, d dt, dB, dC), in microseconds."""
    x, dt, B = inputs["x"], inputs["dt"], inputs["B"]
    xs, dts, bs = (t.numel() * t.element_size() for t in (x, dt, B))
    moved = 3 * xs + dts + 2 * bs + (5 * xs + 2 * dts + 4 * bs if backward else 0)
    return moved / bandwidth * 1e6


def time_chunk_scan(op, inputs, chunk):
    """Medians in microseconds of op (mamba_chunk_scan_combined's signature): a forward call, the same
    forward replayed from a CUDA graph (the GPU's time, the host's work left out), a forward+backward
    call, and the host's time to queue one forward+backward (calls back to back, no synchronisation)."""
    call = lambda: op(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], chunk, D=inputs["D"],  # noqa: E731
                      z=inputs["z"], dt_bias=inputs["dt_bias"], dt_softplus=True)
    times = dict(forward=scan_lib.runtime.median_us(call), forward_gpu=scan_lib.runtime.graph_us(call))
    leaves = [t.requires_grad_() for t in inputs.values()]   # every input, as in training
    dy = torch.randn_like(inputs["x"])
    step = lambda: call().backward(dy)  # noqa: E731
    times.update(step=scan_lib.runtime.median_us(step, grad_to_none=leaves),
                 step_host=scan_lib.runtime.host_us(step, calls=5))   # few calls: the launch queue never fills
    for leaf in leaves:
        leaf.requires_grad_(False)
    return times


def speed_row(shape, label, ours, theirs, floors):
    """One line of the table: each column ours / mamba_ssm's where it was timed, then the ratio."""
    cells = []
    for key, floor in (("forward", floors[0]), ("forward_gpu", floors[0]), ("step", floors[1]), ("step_host", None)):
        mine = f"{ours[key]:6.0f}"
        other = "     -" if theirs is None else f"{theirs[key]:6.0f}"
        ratio = "    -" if theirs is None or key == "step_host" else f"{theirs[key] / ours[key]:5.2f}"
        cells.append(f"{mine} {other} {ratio}" + ("" if floor is None else f" {floor:5.0f}"))
    return f"{str(shape):>24s} {label:>12s} | " + " | ".join(cells)


SPEED_SHAPES = [(8, 2048, 32, 64, 64), (8, 2048, 32, 64, 128)]   # make bench times more (benchmarks/bench.py)
SPEED_COLUMNS = [("forward call", True), ("forward on the GPU", True), ("forward+backward", True),
                 ("host per fwd+bwd", False)]
if not ON_GPU:
    print("Timing needs a GPU: this machine runs the kernels under Triton's interpreter.")
else:
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as mamba_ssm_op
    except ImportError as missing:
        mamba_ssm_op = None
        print(f"mamba_ssm's Triton kernels are not importable ({missing}): scan_lib alone")
    bandwidth = scan_lib.runtime.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; times in us, each column "
          "ours, mamba_ssm's, ratio = mamba_ssm / ours (above 1: ours faster), floor")
    print(f"{'(batch, L, heads, P, N)':>24s} {'dtype':>12s} | " + " | ".join(f"{name:^{24 if floor else 18}s}" for name, floor in SPEED_COLUMNS))
    for shape in SPEED_SHAPES:   # float32 twice: tf32x3 (torch's default "highest") and one TF32 product ("high")
        for dtype, label, matmuls in ((torch.bfloat16, "bfloat16", "highest"), (torch.float32, "float32", "highest"),
                                      (torch.float32, "float32 tf32", "high")):
            inputs = chunk_scan_inputs(*shape, dtype)
            torch.set_float32_matmul_precision(matmuls)
            ours = time_chunk_scan(mamba_chunk_scan_combined, inputs, 256)
            theirs = None if mamba_ssm_op is None else time_chunk_scan(mamba_ssm_op, inputs, 256)
            torch.set_float32_matmul_precision("highest")
            floors = [chunk_scan_floor_us(inputs, backward, bandwidth) for backward in (False, True)]
            print(speed_row(shape, label, ours, theirs, floors))

# %% [markdown]
# What the recorded table shows (one run on an NVIDIA H100 80GB HBM3; on a machine without a GPU the
# cell prints nothing to compare). Its bfloat16 rows run the forward as the walk over the chunks (the
# section before section 8); the float32 rows, and every backward, run the kernels of sections 5 and 7:
#
# * In bfloat16, the dtype Mamba-2 trains in, our op is ahead of `mamba_ssm`'s in every column at both
#   sizes of state. On the GPU alone our forward takes 159 us against 268 at $N = 64$ (1.68x) and 326
#   against 349 at $N = 128$ (1.07x); a forward+backward call takes 1418 us against 3171 (2.24x) and
#   2607 against 3987 (1.53x). Both sides run their products on the tensor cores with bfloat16 operands
#   and float32 sums, so the precision is like for like; the chunks are not: ours runs chunks of 64
#   where `mamba_ssm`'s runs the 256 asked for, 1.75 against 4.0 times the loop's flops at $N = 128$
#   (section 4).
# * The calls' ratios say less about the kernels than the GPU's. `mamba_ssm`'s host takes about as long
#   to issue a forward+backward as the call lasts (3263 against 3171 us at $N = 64$, 4089 against 3987
#   at $N = 128$), and its forward call took 432 us at $N = 64$ for 268 on the GPU: its host path sets
#   its pace. Ours takes 950 us to issue a 1418 us forward+backward at $N = 64$ (1046 to issue 2607 at
#   $N = 128$): nine launches of Triton kernels (two in the forward, the steps kernel and the walk; seven
#   in the backward), and the autograd, allocations and sums around them, take two thirds of the
#   kernels' time, so our GPU sets the pace, and a faster backward at $N = 64$ would show in the call
#   down to about the host's time.
#   (The cell below measures what remembering the launches saves.)
# * In float32 the two do different work by default, and the ratios say so. At torch's default
#   precision ("highest") each of our products is tf32x3, three tensor-core products that keep float32's
#   accuracy, and we are behind: at $N = 64$ 0.80x on the GPU's forward and 0.70x in forward+backward;
#   at $N = 128$ 0.53x and 0.26x. `mamba_ssm`'s
#   product is one TF32 product, whose operands keep 10 bits of mantissa (`make bench` on an H200 finds
#   its float32 results 1.3e-03 to 4.7e-03 off, relative, against our 8.3e-07 to 3.9e-06:
#   `benchmarks/results/bench_ssd_h200_2026-12-03.log`). Asked for the same precision ("float32 tf32":
#   `torch.set_float32_matmul_precision("high")`, one TF32 product), ours is ahead at $N = 64$ (1.08x
#   on the GPU's forward, 1.21x in forward+backward) and behind at $N = 128$ (0.81x on the GPU, 0.72x in
#   forward+backward). One TF32 product in place of three took our float32 forward+backward from 4482
#   to 2487 us at $N = 64$ and from 12642 to 4778 at $N = 128$, where the tf32x3 grad kernels hold the
#   most tiles.
# * Neither op is near the floor, and the backward is now where ours is far from it: our bfloat16
#   forward at $N = 64$ takes 159 us on the GPU against a floor of 69, about 2.3 times, the
#   forward+backward 1418 against 185, about 7.7 times; `mamba_ssm`'s forward, 268 us, about 3.9 times.
#   The changes of sections 7 and 8 (the steps computed once, the gate moved to the adjoint kernel and
#   staged there, the grad kernel split) were timed one at a time, each version's GPU time beside the
#   one before, on an H100: `benchmarks/results/probe_ssd_h100_2026-12-07.log`
#   (`benchmarks/probe_ssd_variants.py`). Each made the backward faster in every row it timed; the
#   gate's move did most in bfloat16, the split most in float32 at $N = 64$. A backward that walks the
#   chunks as the forward does (two walks, one forward to write each chunk's entering state once, one
#   in reverse carrying the state's gradient) was slower in every row than section 7's kernels
#   (`benchmarks/results/probe_ssd_sweeps_h100_2026-12-07.log`: bfloat16 at $N = 64$, 1760 against
#   1204 us on the GPU at best): each walk is a chain of chunks in one program, and the walks hold
#   more tiles than the registers keep (their compiles spill 128 to 2192 bytes a thread to the stack,
#   `benchmarks/NOTES_ssd.md`).
# * Read `mamba_ssm`'s column with care. Its Triton kernels pick their tile sizes by timing candidates
#   on the first call of each shape (autotuning), and the choice, so its time, changes from run to run:
#   `make bench` timed the same shapes on an H200 with other results
#   (`benchmarks/results/bench_ssd_h200_2026-12-03.log`). At longer sequences its bfloat16
#   forward+backward grows far less than the work does and ends faster than ours: `make bench` on an
#   H100 with this chapter's kernels (`benchmarks/results/bench_h100_2026-12-07_mamba2_ssd.log`, a later
#   run than this recording) has ours at 0.68x its speed at (8, 8192, 32, 64, 128) and 0.83x at
#   (1, 65536, 24, 64, 128), though ours is ahead on the forward at $L = 8192$. At $L = 2048$ its step
#   is set by the host, as the host column shows here, not by its kernels. Beating its kernels, at every
#   length, is still open.

# %% [markdown]
# The host's share, both ways: the table's first bfloat16 row timed again with every launch through
# Triton's path (`RememberedLaunches.through_triton`) and with the launches remembered ("Going deeper: the
# host's share, and launches remembered"), after a check that a training step gives the same output and
# gradients, bit for bit, both ways.

# %%
def chunk_scan_results(inputs, chunk):
    """The output of mamba_chunk_scan_combined on inputs (section 9's options) and the gradients of every input."""
    leaves = {name: t.detach().requires_grad_() for name, t in inputs.items()}
    y = mamba_chunk_scan_combined(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk,
                                  D=leaves["D"], z=leaves["z"], dt_bias=leaves["dt_bias"], dt_softplus=True)
    return (y.detach(), *torch.autograd.grad(y, list(leaves.values()), torch.ones_like(y)))


if not ON_GPU:
    print("skipped: needs a GPU (under the interpreter every launch goes through Triton)")
else:
    inputs = chunk_scan_inputs(*SPEED_SHAPES[0], torch.bfloat16)
    results = {}
    print(f"{torch.cuda.get_device_name()}, bfloat16, (batch, L, heads, P, N) = {SPEED_SHAPES[0]}, us")
    try:
        for through_triton in (True, False):
            RememberedLaunches.through_triton = through_triton
            results[through_triton] = chunk_scan_results(inputs, 256)
            times = time_chunk_scan(mamba_chunk_scan_combined, inputs, 256)
            print(f"{'through Triton' if through_triton else 'remembered':>14}: forward call {times['forward']:5.0f}, "
                  f"on the GPU {times['forward_gpu']:5.0f}; forward+backward call {times['step']:5.0f}, "
                  f"the host's time to issue one {times['step_host']:5.0f}")
    finally:
        RememberedLaunches.through_triton = False
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
    print("the same output and gradients, bit for bit, both ways: ok")
    del inputs, results

# %% [markdown]
# In the recorded run the remembered launches cut the host's time to issue a bfloat16 forward+backward
# from 1158 to 1003 us, about 13 %, with the same bits; the GPU's time (160 and 159 us for the forward)
# and the calls' (1409 and 1408 us per forward+backward) did not move, because at this shape the GPU
# sets the pace. The saving shows in a call only where the host's time is above the GPU's. The host's
# times are few-call samples and vary from one to the next: the table above, remembered too, measured
# 950 us for the same step.

# %% [markdown]
# ## Going deeper: 10. The Mamba2 block
#
# Chapter 06 wrapped Mamba-1's scan in a block; Mamba-2's block (Dao and Gu, section 7;
# `mamba_ssm.modules.mamba2.Mamba2`) wraps `mamba_chunk_scan_combined` the same way, with three changes:
#
# - **One projection makes every input of the scan.** Mamba-1 computed $B$, $C$ and $\Delta$ from the
#   convolved $x$ (`x_proj`, `dt_proj`); Mamba-2 computes $z$, $x$, $B$, $C$ and the raw step $\Delta$
#   from the block's input $u$ in one matrix product, `in_proj`, whose output splits as
#   $[z \mid x \mid B \mid C \mid \Delta]$ of widths $d_{\text{ssm}}$, $d_{\text{ssm}}$, $gN$, $gN$ and $H$
#   ($g$ groups of $B$ and $C$, $H$ heads of $P$ channels, $d_{\text{ssm}} = HP$). One product replaces
#   three in sequence, and (the paper's reason) a block split over GPUs by heads needs no communication
#   before the scan.
# - **The convolution runs over $x$, $B$ and $C$ together** (`xBC`, $d_{\text{ssm}} + 2gN$ channels),
#   chapter 06's causal depthwise convolution and SiLU, so that $B$ and $C$ see a few past positions as
#   $x$ does.
# - **The output is normalised.** Where Mamba-1 multiplied $y$ by $\operatorname{silu}(z)$, Mamba-2
#   normalises the gated output per group of $d_{\text{ssm}}/g$ channels (`RMSNormGated`):
#   $\hat y = y \odot \operatorname{silu}(z)$, then $\hat y / \sqrt{\operatorname{mean}(\hat y^2) + \epsilon}$
#   times a learned weight. The paper added it for stability in larger models.
#
# $A$ is one number per head, $-\exp(A_{\log})$; $D$ one per head (or per channel, `D_has_hdim`); the
# step is $\operatorname{softplus}(\Delta + b)$, optionally clamped to `dt_limit`. With `d_ssm` below
# $d_{\text{inner}}$ the remaining channels skip the scan, a gated MLP, $\operatorname{silu}(z_0) \odot x_0$,
# concatenated before `out_proj`. For generation the block keeps, per layer, the last `d_conv` inputs of
# the convolution and the $(H, P, N)$ state: a step costs the same at every position, as chapter 06's.
#
# `Mamba2` below takes `mamba_ssm`'s constructor arguments, parameter names and shapes (so its
# `state_dict` loads either way), `forward`, `step` and `allocate_inference_cache`; the scan is
# `mamba_chunk_scan_combined` on the `"triton"` backend and section 3's `ssd_chunked` in float32 on the
# `"torch"` one (the default on a CPU, where the interpreter is slow); a float64 block runs `ssd_chunked`
# on either, since the kernels sum in float32. Where the op lacks an option (`dt_limit`, $D$ per channel)
# the block applies it around the op in PyTorch. Not supported, with an error that says so: tensor
# parallelism (`process_group`), packed sequences (`seq_idx`, `cu_seqlens`). In a generation step the
# convolution is chapter 06's `causal_conv1d_update` kernel and the state's update runs in PyTorch (one
# position is a few small products; `mamba_ssm` launches a Triton kernel there).

# %%
#| export
import math

import torch.nn as nn
import torch.nn.functional as F

from scan_lib.causal_conv1d import causal_conv1d, causal_conv1d_ref, causal_conv1d_update   # chapter 06
from scan_lib.mamba import Mamba, inverse_softplus   # chapter 06
from scan_lib.runtime import ON_GPU
from scan_lib.selective_scan import _acc_dtype   # chapter 05: float64 where a tensor is float64, else float32


def _rms_norm_gated_torch(x, z, weight, eps, group_size, norm_before_gate):
    """RMSNormGated's computation in PyTorch: float32 (float64 for float64 x), returned in x's dtype;
    differentiable to any order."""
    f = _acc_dtype(x)
    v = x.to(f)                                                            # ... x hidden
    gate = None if z is None else F.silu(z.to(f))
    if gate is not None and not norm_before_gate:
        v = v * gate
    groups = v.unflatten(-1, (-1, group_size))                             # ... x groups x group_size
    v = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight.to(f)
    return (v if gate is None or not norm_before_gate else v * gate).to(x.dtype)


class RMSNormGated(nn.Module):
    """mamba_ssm's gated RMSNorm (mamba_ssm.ops.triton.layernorm_gated.RMSNorm): forward(x, z) is
    norm(x * silu(z)) (norm_before_gate False) or norm(x) * silu(z) (True), norm(v) = v / sqrt(mean(v^2)
    + eps) * weight over each group of group_size features (all of them if None), computed in float32 (float64
    for float64 x) and returned in x's dtype: on a GPU by the fused kernels below, else in PyTorch."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        if group_size is not None and (group_size <= 0 or hidden_size % group_size):
            raise ValueError(f"group_size must divide hidden_size ({hidden_size}), got {group_size}")
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        check_float_tensor("x", x)
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"x must have {self.weight.shape[0]} features in its last dim, got shape {tuple(x.shape)}")
        if z is not None and (not isinstance(z, torch.Tensor) or z.shape != x.shape):
            raise ValueError(f"z must be a tensor of x's shape {tuple(x.shape)}, got "
                             f"{tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__}")
        options = (self.eps, self.group_size or self.weight.shape[0], self.norm_before_gate)
        if ON_GPU and x.is_cuda:
            return apply(RMSNormGatedFn, x, z, self.weight, *options)[0]
        return _rms_norm_gated_torch(x, z, self.weight, *options)


class Mamba2(nn.Module):
    """The Mamba-2 block of mamba_ssm.modules.mamba2.Mamba2: the same constructor arguments, parameter names
    and shapes, forward, step and allocate_inference_cache, on scan_lib's kernels.

    backend: "triton" (scan_lib.mamba_chunk_scan_combined, causal_conv1d, causal_conv1d_update) or "torch"
    (ssd_chunked in float32 and F.conv1d, for a CPU); None picks "triton" on a GPU and "torch" otherwise. A
    float64 block scans with ssd_chunked on both. use_mem_eff_path, sequence_parallel and layer_idx are
    accepted as mamba_ssm's; process_group (tensor parallelism), seq_idx and cu_seqlens are not supported.
    forward(u, inference_params): as scan_lib.Mamba's, a call at seqlen_offset 0 starts a new prompt from zero
    states; a later call of one position runs `step`, of several continues from the cached states (a prompt
    fed in chunks); every call leaves its final states in the cache (a scan_lib.InferenceParams). dt_limit
    clamps the step in `step` too, so that generation gives forward's outputs (mamba_ssm's step does not)."""

    def __init__(self, d_model, d_state=128, d_conv=4, conv_init=None, expand=2, headdim=64, d_ssm=None,
                 ngroups=1, A_init_range=(1, 16), D_has_hdim=False, rmsnorm=True, norm_before_gate=False,
                 dt_min=0.001, dt_max=0.1, dt_init_floor=1e-4, dt_limit=(0.0, float("inf")), bias=False,
                 conv_bias=True, chunk_size=256, use_mem_eff_path=True, layer_idx=None, process_group=None,
                 sequence_parallel=True, device=None, dtype=None, backend=None):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if process_group is not None:
            raise NotImplementedError("process_group: scan_lib.Mamba2 has no tensor parallelism")
        if backend not in (None, "triton", "torch"):
            raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
        if not 2 <= d_conv <= 4:
            raise ValueError(f"d_conv must be 2, 3 or 4 (the convolution kernel's widths), got {d_conv}")
        self.backend = backend or ("triton" if ON_GPU else "torch")
        self.d_model, self.d_state, self.d_conv, self.conv_init, self.expand = d_model, d_state, d_conv, conv_init, expand
        self.d_inner = expand * d_model
        self.headdim, self.ngroups = headdim, ngroups
        self.d_ssm = self.d_inner if d_ssm is None else d_ssm
        if self.d_ssm % headdim or not 0 < self.d_ssm <= self.d_inner:
            raise ValueError(f"d_ssm ({self.d_ssm}) must be a multiple of headdim ({headdim}) and at most "
                             f"expand * d_model ({self.d_inner})")
        self.nheads = self.d_ssm // headdim
        if ngroups <= 0 or self.nheads % ngroups:
            raise ValueError(f"ngroups ({ngroups}) must divide the number of heads ({self.nheads})")
        if not 0 < A_init_range[0] <= A_init_range[1]:
            raise ValueError(f"A_init_range must be (low, high) with 0 < low <= high, got {A_init_range}")
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.dt_limit, self.activation, self.chunk_size = tuple(dt_limit), "silu", chunk_size
        self.use_mem_eff_path, self.layer_idx, self.sequence_parallel = use_mem_eff_path, layer_idx, sequence_parallel
        self.d_mlp = self.d_inner - self.d_ssm                                 # channels that skip the scan
        self.conv_dim = self.d_ssm + 2 * ngroups * d_state                     # x, B and C
        # in_proj's output: [z0, x0 (d_mlp each), z (d_ssm), xBC (conv_dim), dt (nheads)]
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner + 2 * ngroups * d_state + self.nheads, bias=bias, **factory)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, padding=d_conv - 1,
                                bias=conv_bias, **factory)
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        self.act = nn.SiLU()   # mamba_ssm's attribute, kept for code that reads it; the kernels apply SiLU themselves
        step = torch.exp(torch.rand(self.nheads, **factory) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.dt_bias = nn.Parameter(inverse_softplus(step.clamp(min=dt_init_floor)))   # softplus(dt_bias) = step
        self.dt_bias._no_weight_decay = True
        A = torch.empty(self.nheads, dtype=torch.float32, device=device).uniform_(*A_init_range)
        self.A_log = nn.Parameter(torch.log(A).to(dtype))                      # A = -exp(A_log), one per head
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_ssm if D_has_hdim else self.nheads, device=device))  # float32 always
        self.D._no_weight_decay = True
        if rmsnorm:
            self.norm = RMSNormGated(self.d_ssm, eps=1e-5, group_size=self.d_ssm // ngroups,
                                     norm_before_gate=norm_before_gate, **factory)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory)

    def forward(self, u, seqlen=None, seq_idx=None, cu_seqlens=None, inference_params=None):
        """u: (batch, L, d_model), or (batch * L, d_model) with seqlen = L. Returns u's shape."""
        if seq_idx is not None or cu_seqlens is not None:
            raise NotImplementedError("seq_idx and cu_seqlens (packed sequences) are not supported by scan_lib.Mamba2")
        if seqlen is not None:
            if u.dim() != 2 or seqlen <= 0 or u.shape[0] % seqlen:
                raise ValueError(f"u must have shape (batch * seqlen, d_model) with seqlen={seqlen}, got {tuple(u.shape)}")
            return self.forward(u.view(-1, seqlen, u.shape[-1]), inference_params=inference_params).flatten(0, 1)
        # chapter 06's flow, on this block's _check_hidden, _sequence, step and cache: the whole sequence, or
        # with inference_params a new prompt from zero states, a step, or a prompt continued
        return Mamba.forward(self, u, inference_params)

    def _split(self, zxbcdt):
        """in_proj's output (..., d_in_proj) -> z0, x0, z, xBC, dt (views)."""
        return torch.split(zxbcdt, [self.d_mlp, self.d_mlp, self.d_ssm, self.conv_dim, self.nheads], dim=-1)

    def _split_xBC(self, xBC):
        """The convolution's output (..., conv_dim) -> x (..., d_ssm), B and C (..., groups N)."""
        return torch.split(xBC, [self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)

    def _finish(self, y, z, z0, x0):
        """The scan's output y (..., d_ssm) -> the block's output: the norm (or no gate left), the MLP's
        channels, out_proj."""
        if self.rmsnorm:
            y = self.norm(y, z)
        if self.d_mlp > 0:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return self.out_proj(y)

    def _sequence(self, u, conv_state=None, ssm_state=None):
        """The whole sequence, or one chunk continuing from conv_state and ssm_state (then also returns
        the states after it)."""
        z0, x0, z, xBC, dt = self._split(self.in_proj(u))                     # batch x L x ... each
        keep = conv_state is not None
        xBC_t = xBC.transpose(1, 2)                                            # batch x conv_dim x L, a view
        conv = causal_conv1d if self.backend == "triton" else causal_conv1d_ref
        xBC = conv(xBC_t, self.conv1d.weight[:, 0], self.conv1d.bias, activation=self.activation,
                   initial_states=conv_state[..., 1:].to(xBC_t.dtype) if keep else None).transpose(1, 2)
        x, B, C = self._split_xBC(xBC)
        y, last_state = self._scan(x, dt, B, C, z, ssm_state)                 # batch x L x d_ssm
        out = self._finish(y, z, z0, x0)
        if not keep:
            return out, None, None
        new_conv_state = torch.cat([conv_state, xBC_t.to(conv_state.dtype)], dim=-1)[..., -self.d_conv:]
        return out, new_conv_state, last_state

    def _scan(self, x, dt, B, C, z, initial_state):
        """x (batch, L, d_ssm), dt (batch, L, heads), B and C (batch, L, groups N), z (batch, L, d_ssm) ->
        y (batch, L, d_ssm), gated here unless rmsnorm, and the final state (batch, heads, P, N)."""
        heads = lambda t: t.unflatten(-1, (self.nheads, self.headdim))         # noqa: E731  (..., d_ssm) -> (..., H, P)
        groups = lambda t: t.unflatten(-1, (self.ngroups, self.d_state))       # noqa: E731  (..., g N) -> (..., g, N)
        f = _acc_dtype(x)
        A = -torch.exp(self.A_log.to(f))
        gate_in_op = not self.rmsnorm and not self.D_has_hdim                  # the op gates after adding D x
        D = None if self.D_has_hdim else self.D
        dt_bias = self.dt_bias
        if self.dt_limit != (0.0, float("inf")):                               # the op has no clamp: the step here
            dt, dt_bias = F.softplus(dt.to(f) + dt_bias.to(f)).clamp(*self.dt_limit), None
        scan = self._chunk_scan_torch if self.backend == "torch" or x.dtype == torch.float64 else mamba_chunk_scan_combined
        initial_state = None if initial_state is None else initial_state.to(f)   # a cache of any dtype
        y, final = scan(heads(x), dt, A, groups(B), groups(C), self.chunk_size, D, heads(z) if gate_in_op else None,
                        dt_bias, initial_state, dt_softplus=dt_bias is not None, return_final_states=True)
        if self.D_has_hdim:   # D is float32: the sum in float32, y back in x's dtype
            y = (y.to(f) + heads(x).to(f) * heads(self.D).to(f)).to(y.dtype)
        y = y.flatten(-2)
        if not self.rmsnorm and not gate_in_op:
            y = y * F.silu(z)
        return y, final

    @staticmethod
    def _chunk_scan_torch(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, *,
                          dt_softplus=False, return_final_states=False):
        """mamba_chunk_scan_combined's computation with section 3's ssd_chunked, in float32 (float64 for
        float64 x), differentiable by autograd; y in x's dtype, the final state float32 (or float64)."""
        f = _acc_dtype(x)
        step = dt.to(f) if dt_bias is None else dt.to(f) + dt_bias.to(f)
        step = F.softplus(step) if dt_softplus else step
        y, final = ssd_chunked(x.to(f), step, A.to(f), B.to(f), C.to(f), min(chunk_size, KERNEL_CHUNK),
                               None if D is None else D.to(f), None if initial_states is None else initial_states.to(f))
        y = (y if z is None else y * F.silu(z.to(f))).to(x.dtype)
        return (y, final) if return_final_states else y

    def step(self, hidden_states, conv_state, ssm_state):
        """One position: hidden_states (batch, 1, d_model); conv_state (batch, conv_dim, d_conv) and ssm_state
        (batch, heads, P, N) are updated in place. Returns (out, conv_state, ssm_state)."""
        self._check_hidden(hidden_states, "hidden_states")
        if hidden_states.shape[1] != 1:
            raise ValueError(f"step takes one position: hidden_states of shape (batch, 1, {self.d_model}), "
                             f"got {tuple(hidden_states.shape)}")
        self._check_states(hidden_states.shape[0], conv_state, ssm_state)
        z0, x0, z, xBC, dt = self._split(self.in_proj(hidden_states[:, 0]))  # batch x ... each
        weight = self.conv1d.weight[:, 0]                                      # conv_dim x d_conv
        if self.backend == "triton":
            xBC = causal_conv1d_update(xBC.to(conv_state.dtype), conv_state, weight, self.conv1d.bias,
                                       self.activation).to(xBC.dtype)
        else:   # shift the window left by one position, append the input, and apply the filter
            conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
            conv_state[:, :, -1] = xBC
            xBC = (conv_state * weight).sum(-1)
            xBC = F.silu(xBC if self.conv1d.bias is None else xBC + self.conv1d.bias).to(hidden_states.dtype)
        x, B, C = self._split_xBC(xBC)
        y = self._ssm_step(x, dt, B, C, z, ssm_state)                          # batch x d_ssm
        return self._finish(y, z, z0, x0)[:, None], conv_state, ssm_state

    def _ssm_step(self, x, dt, B, C, z, ssm_state):
        """H <- exp(dt A) H + dt x B^T, y = H C + D x (gated here unless rmsnorm), per head, in float32
        (float64 for a float64 state); ssm_state updated in place."""
        f = _acc_dtype(ssm_state)
        step = F.softplus(dt.to(f) + self.dt_bias.to(f)).clamp(*self.dt_limit)   # batch x H
        per_head = self.nheads // self.ngroups
        B, C = (t.to(f).unflatten(-1, (self.ngroups, self.d_state)).repeat_interleave(per_head, dim=1) for t in (B, C))
        x_h = x.to(f).unflatten(-1, (self.nheads, self.headdim))              # batch x H x P
        decay = torch.exp(step * -torch.exp(self.A_log.to(f)))                 # batch x H
        state = decay[..., None, None] * ssm_state.to(f) + (step[..., None] * x_h)[..., None] * B[:, :, None, :]
        ssm_state.copy_(state)
        D = self.D.to(f).view(self.nheads, self.headdim) if self.D_has_hdim else self.D.to(f)[:, None]
        y = (torch.einsum("bhpn,bhn->bhp", state, C) + D * x_h).flatten(1)
        if not self.rmsnorm:
            y = y * F.silu(z.to(f))
        return y.to(x.dtype)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        """Zero states for generation: conv_state (batch, conv_dim, d_conv) in conv1d.weight's dtype, ssm_state
        (batch, heads, P, N) in in_proj.weight's, unless dtype is given. Their size does not depend on max_seqlen."""
        device = self.out_proj.weight.device
        conv_state = torch.zeros(batch_size, self.conv_dim, self.d_conv, device=device,
                                 dtype=dtype or self.conv1d.weight.dtype)
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device,
                                dtype=dtype or self.in_proj.weight.dtype)
        return conv_state, ssm_state

    def _get_states_from_cache(self, inference_params, batch_size):
        if self.layer_idx is None:
            raise ValueError("inference_params needs the block's layer_idx (Mamba2(..., layer_idx=i)): the "
                             "states are cached under it")
        return Mamba._get_states_from_cache(self, inference_params, batch_size)   # chapter 06's, on this block's cache

    def _check_hidden(self, u, name="u"):
        check_float_tensor(name, u)
        if u.dim() != 3 or u.shape[-1] != self.d_model:
            raise ValueError(f"{name} must have shape (batch, L, d_model={self.d_model}), got {tuple(u.shape)}")
        weight = self.in_proj.weight
        if u.dtype != weight.dtype and not torch.is_autocast_enabled(u.device.type):
            raise TypeError(f"{name} must have the block's dtype {weight.dtype} (or run under torch.autocast), "
                            f"got {u.dtype}")
        if u.shape[1] == 0:
            raise ValueError(f"{name} must hold at least one position, got shape {tuple(u.shape)}")

    def _check_states(self, batch_size, conv_state, ssm_state):
        for name, state, shape in (("conv_state", conv_state, (batch_size, self.conv_dim, self.d_conv)),
                                   ("ssm_state", ssm_state, (batch_size, self.nheads, self.headdim, self.d_state))):
            check_float_tensor(name, state)
            if tuple(state.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(state.shape)}")

# %% [markdown]
# **The norm, fused.** Written in PyTorch, `RMSNormGated` is about ten passes over $(B, L, d_{\text{ssm}})$
# (the casts to float32, the gate, the squares, the scaling, the weight, the cast back), each reading and
# writing the whole tensor, and autograd's backward as many again: at the block's training sizes more
# memory traffic than the scan's. One Triton program per block of rows and group does the forward in one
# read of $y$ and $z$ and one write, keeping each row's $1/\mathrm{rms}$ (`rstd`) for the backward. With
# $v$ the normalised input ($y \odot \operatorname{silu}(z)$, or $y$ when the gate comes after the norm),
# $n = v \cdot \mathrm{rstd}$, output $n \odot w$ (times $\operatorname{silu}(z)$ after the norm), the
# backward of a row of $G$ entries is
#
# $$\bar n = \bar o \odot w\ [\odot \operatorname{silu}(z)], \qquad
# \bar v = \mathrm{rstd}\,\Big(\bar n - n \cdot \tfrac{1}{G}\textstyle\sum_j \bar n_j n_j\Big), \qquad
# \bar w = \textstyle\sum_{\text{rows}} \bar o \odot n\ [\odot \operatorname{silu}(z)],$$
#
# and $\bar y$, $\bar z$ from $\bar v$ through the gate (or, after the norm, $\bar z = \bar o \odot n \odot w
# \odot \operatorname{silu}'(z)$). The backward's programs each walk many rows, summing $\bar w$ in registers,
# and write one partial sum per program, which PyTorch adds up. A backward asked for a graph
# (`create_graph=True`) differentiates the PyTorch form instead, so that second derivatives stay exact.
# The norm's $\epsilon$ is a constexpr, not a runtime argument: Triton passes a Python float as float32, and
# the rounded $10^{-5}$ moved a float64 block's output by about $10^{-11}$ (relative) on an H100, against
# $4 \cdot 10^{-16}$ in PyTorch (a recording's failed check, `benchmarks/NOTES_ssd.md`); as a constexpr it is
# compiled in at the kernel's precision (one compile per $\epsilon$). Chapter 08 met the same trap with its
# scale and annotated the parameter `tl.float64` instead, which passes the float whole without a compile per
# value; both work.

# %%
#| export
from scan_lib.ema import accumulator_dtype   # chapter 02: float64 sums for float64 inputs, else float32


@triton.jit
def rms_norm_gated_fwd_kernel(X, Z, W, OUT, RSTD, rows, group_size, n_groups, stride_x, stride_z, stride_out,
                              EPS: tl.constexpr, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, ACC: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (block of BLOCK_M rows, group g): OUT = norm(X [* silu(Z)]) * W [* silu(Z)] over the group's
    columns; RSTD[row, g] = 1 / rms. X, Z, OUT: rows x (n_groups * group_size), unit column stride."""
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tl.program_id(1) * group_size + tl.arange(0, BLOCK_N)
    row_ok, col_ok = row < rows, tl.arange(0, BLOCK_N) < group_size
    mask, row64 = row_ok[:, None] & col_ok[None, :], row.to(tl.int64)[:, None]
    v = tl.load(X + row64 * stride_x + col[None, :], mask=mask, other=0.0).to(ACC)      # BLOCK_M x BLOCK_N
    if HAS_Z:
        z = tl.load(Z + row64 * stride_z + col[None, :], mask=mask, other=0.0).to(ACC)
        gate = z * tl.sigmoid(z)
        if not NORM_BEFORE_GATE:
            v = v * gate
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / group_size + EPS)                       # BLOCK_M
    out = v * rstd[:, None] * tl.load(W + col, mask=col_ok, other=0.0).to(ACC)[None, :]
    if HAS_Z and NORM_BEFORE_GATE:
        out = out * gate
    tl.store(OUT + row64 * stride_out + col[None, :], out.to(OUT.dtype.element_ty), mask=mask)
    tl.store(RSTD + row * n_groups + tl.program_id(1), rstd, mask=row_ok)


@triton.jit
def rms_norm_gated_bwd_kernel(X, Z, W, RSTD, DOUT, DX, DZ, DW_PARTS, rows, group_size, n_groups, rows_per_program,
                              stride_x, stride_z, stride_dout, stride_dx, stride_dz, HAS_Z: tl.constexpr,
                              NORM_BEFORE_GATE: tl.constexpr, ACC: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr):
    """Program (p, group g) walks rows [p * rows_per_program, ...) BLOCK_M at a time: DX, DZ, and its share of
    dW summed over its rows into DW_PARTS[p, the group's columns] (ACC)."""
    col = tl.program_id(1) * group_size + tl.arange(0, BLOCK_N)
    col_ok = tl.arange(0, BLOCK_N) < group_size
    w = tl.load(W + col, mask=col_ok, other=0.0).to(ACC)
    dw = tl.zeros([BLOCK_N], dtype=ACC)
    first = tl.program_id(0) * rows_per_program
    for start in range(first, tl.minimum(first + rows_per_program, rows), BLOCK_M):
        row = start + tl.arange(0, BLOCK_M)
        row_ok = (row < rows) & (row < first + rows_per_program)
        mask, row64 = row_ok[:, None] & col_ok[None, :], row.to(tl.int64)[:, None]
        x = tl.load(X + row64 * stride_x + col[None, :], mask=mask, other=0.0).to(ACC)
        dout = tl.load(DOUT + row64 * stride_dout + col[None, :], mask=mask, other=0.0).to(ACC)
        rstd = tl.load(RSTD + row * n_groups + tl.program_id(1), mask=row_ok, other=0.0).to(ACC)[:, None]
        v = x
        if HAS_Z:
            z = tl.load(Z + row64 * stride_z + col[None, :], mask=mask, other=0.0).to(ACC)
            sig = tl.sigmoid(z)
            gate, gate_slope = z * sig, sig * (1.0 + z * (1.0 - sig))      # silu(z) and its derivative
            if not NORM_BEFORE_GATE:
                v = x * gate
        n = v * rstd                                                      # the normalised row
        dn = dout * w[None, :]
        if HAS_Z and NORM_BEFORE_GATE:
            tl.store(DZ + row64 * stride_dz + col[None, :], (dn * n * gate_slope).to(DZ.dtype.element_ty), mask=mask)
            dw += tl.sum(dout * n * gate, axis=0)
            dn = dn * gate
        else:
            dw += tl.sum(dout * n, axis=0)
        dv = rstd * (dn - n * (tl.sum(dn * n, axis=1) / group_size)[:, None])
        if HAS_Z and not NORM_BEFORE_GATE:
            tl.store(DZ + row64 * stride_dz + col[None, :], (dv * x * gate_slope).to(DZ.dtype.element_ty), mask=mask)
            dv = dv * gate
        tl.store(DX + row64 * stride_dx + col[None, :], dv.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTS + tl.program_id(0).to(tl.int64) * n_groups * group_size + col, dw, mask=col_ok)


# remembered, as section 8's kernels: a training step launches both
rms_norm_gated_fwd_kernel, rms_norm_gated_bwd_kernel = map(RememberedLaunches, (rms_norm_gated_fwd_kernel,
                                                                               rms_norm_gated_bwd_kernel))


def _norm_tiles(group_size):
    """(BLOCK_M, BLOCK_N): the group's columns in one block, rows up to 4096 entries a program."""
    block_n = next_power_of_2(group_size)
    return max(1, min(16, 4096 // block_n)), block_n


@custom_op("rms_norm_gated_fwd", __name__)
def rms_norm_gated_fwd(x: torch.Tensor, z: Optional[torch.Tensor], weight: torch.Tensor, eps: float, group_size: int,
                       norm_before_gate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x, z: rows x hidden, unit column stride; weight (hidden,). Returns out (rows x hidden, x's dtype) and
    rstd (rows x groups, the accumulator's dtype)."""
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, hidden // group_size, dtype=_acc_dtype(x), device=x.device)
    if rows == 0:   # nothing to launch
        return out, rstd
    block_m, block_n = _norm_tiles(group_size)
    rms_norm_gated_fwd_kernel[(cdiv(rows, block_m), hidden // group_size)](
        x, x if z is None else z, weight, out, rstd, rows, group_size, hidden // group_size, x.stride(0),
        0 if z is None else z.stride(0), out.stride(0), EPS=eps, HAS_Z=z is not None, NORM_BEFORE_GATE=norm_before_gate,
        ACC=accumulator_dtype(x.dtype), BLOCK_M=block_m, BLOCK_N=block_n)
    return out, rstd


@rms_norm_gated_fwd.register_fake
def _(x, z, weight, eps, group_size, norm_before_gate):
    return x.new_empty(x.shape), x.new_empty(x.shape[0], x.shape[1] // group_size, dtype=_acc_dtype(x))


@custom_op("rms_norm_gated_bwd", __name__)
def rms_norm_gated_bwd(dout: torch.Tensor, x: torch.Tensor, z: Optional[torch.Tensor], weight: torch.Tensor,
                       rstd: torch.Tensor, group_size: int, norm_before_gate: bool) -> list[torch.Tensor]:
    """Gradients of rms_norm_gated_fwd's out: dx, dz (empty without z), dweight, each in its input's dtype."""
    rows, hidden = x.shape
    dx = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    dz = torch.empty(0, dtype=x.dtype, device=x.device) if z is None else torch.empty(rows, hidden, dtype=z.dtype,
                                                                                        device=x.device)
    if rows == 0:   # no rows: nothing to launch, and no program to sum dW
        return [dx, dz, torch.zeros_like(weight)]
    block_m, block_n = _norm_tiles(group_size)
    programs = max(1, min(cdiv(rows, block_m), 4 * (multiprocessor_count(x.device) or 16)))
    rows_per_program = cdiv(cdiv(rows, programs), block_m) * block_m
    programs = max(1, cdiv(rows, rows_per_program))
    dw_parts = torch.empty(programs, hidden, dtype=rstd.dtype, device=x.device)
    rms_norm_gated_bwd_kernel[(programs, hidden // group_size)](
        x, x if z is None else z, weight, rstd, dout, dx, x if z is None else dz, dw_parts, rows, group_size,
        hidden // group_size, rows_per_program, x.stride(0), 0 if z is None else z.stride(0), dout.stride(0),
        dx.stride(0), 0 if z is None else dz.stride(0), HAS_Z=z is not None, NORM_BEFORE_GATE=norm_before_gate,
        ACC=accumulator_dtype(x.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=8)   # sm_90, bf16, 4096-entry tiles: 255 registers a thread at 4 warps (spills), 165 at 8
    return [dx, dz, dw_parts.sum(0).to(weight.dtype)]


@rms_norm_gated_bwd.register_fake
def _(dout, x, z, weight, rstd, group_size, norm_before_gate):
    return [x.new_empty(x.shape), x.new_empty(0) if z is None else z.new_empty(z.shape), weight.new_empty(weight.shape)]


rms_norm_gated_fwd.register_vmap(_vmap_by_loop(rms_norm_gated_fwd))
rms_norm_gated_bwd.register_vmap(_vmap_by_loop(rms_norm_gated_bwd))


def _as_rows(t):
    """(..., hidden) -> rows x hidden with unit column stride: a view where the strides allow, else a copy."""
    if t is None:
        return None
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


class RMSNormGatedFn(torch.autograd.Function):
    """rms_norm_gated_fwd over x, z as rows (views of the last dim), differentiable; with create_graph the
    backward differentiates _rms_norm_gated_torch instead (second derivatives)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, z, weight, eps, group_size, norm_before_gate):
        out, rstd = rms_norm_gated_fwd(_as_rows(x), _as_rows(z), weight, eps, group_size, norm_before_gate)
        return out.view(x.shape), rstd

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, z, weight, eps, group_size, norm_before_gate = inputs
        ctx.save_for_backward(x, z, weight, output[1])
        ctx.eps, ctx.group_size, ctx.norm_before_gate = eps, group_size, norm_before_gate
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, dout, _):
        x, z, weight, rstd = ctx.saved_tensors
        inputs = (x, z, weight)
        if torch.is_grad_enabled():   # create_graph: the PyTorch form recomputed and differentiated, a graph kept
            wanted = [t for t in inputs if t is not None and t.requires_grad]
            with torch.enable_grad():
                out = _rms_norm_gated_torch(x, z, weight, ctx.eps, ctx.group_size, ctx.norm_before_gate)
            found = iter(torch.autograd.grad(out, wanted, dout, create_graph=True))
            dx, dz, dweight = (next(found) if t is not None and t.requires_grad else None for t in inputs)
        else:
            dx, dz, dweight = rms_norm_gated_bwd(_as_rows(dout), _as_rows(x), _as_rows(z), weight, rstd,
                                                 ctx.group_size, ctx.norm_before_gate)
            dx, dz = dx.view(x.shape), None if z is None else dz.view(z.shape)
        return dx, dz, dweight, None, None, None

# %% [markdown]
# The check: a block with every parameter moved off its initial value, against the computation written
# out one position at a time in float64 (chapter 06's convolution as a sum over the window, section 1's
# `ssd_loop`, the norm's formula), on both backends, with groups, the MLP channels and the options that
# change the path (no norm, $D$ per channel, a clamped step).

# %%
def mamba2_reference(block, u):
    """The block's forward in float64 from its parameters, the convolution and the scan position by position."""
    params = {name: p.detach().double() for name, p in block.named_parameters()}
    u = u.detach().double()
    zxbcdt = u @ params["in_proj.weight"].T + params.get("in_proj.bias", 0)
    widths = [block.d_mlp, block.d_mlp, block.d_ssm, block.conv_dim, block.nheads]   # [z0, x0, z, xBC, dt]
    z0, x0, z, xBC, dt = torch.split(zxbcdt, widths, dim=-1)
    window = F.pad(xBC, (0, 0, block.d_conv - 1, 0)).unfold(1, block.d_conv, 1)   # batch x L x conv_dim x d_conv
    xBC = F.silu((window * params["conv1d.weight"][:, 0]).sum(-1) + params.get("conv1d.bias", 0))
    x, B, C = torch.split(xBC, [block.d_ssm, block.ngroups * block.d_state, block.ngroups * block.d_state], dim=-1)
    step = F.softplus(dt + params["dt_bias"]).clamp(*block.dt_limit)
    x_h = x.unflatten(-1, (block.nheads, block.headdim))
    y, _ = ssd_loop(x_h, step, -torch.exp(params["A_log"]), B.unflatten(-1, (block.ngroups, block.d_state)),
                    C.unflatten(-1, (block.ngroups, block.d_state)))
    D = params["D"].view(block.nheads, block.headdim) if block.D_has_hdim else params["D"][:, None]
    y = (y + D * x_h).flatten(-2)
    if block.rmsnorm:
        gated = y * F.silu(z) if not block.norm_before_gate else y
        groups = gated.unflatten(-1, (block.ngroups, -1))
        y = (groups / torch.sqrt(groups.square().mean(-1, keepdim=True) + 1e-5)).flatten(-2) * params["norm.weight"]
        y = y * F.silu(z) if block.norm_before_gate else y
    else:
        y = y * F.silu(z)
    if block.d_mlp:
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    return y @ params["out_proj.weight"].T + params.get("out_proj.bias", 0)


def small_mamba2(backend, dtype, seed=0, **options):
    """A small block (d_model 16, heads of 8, N 8, chunks of 16) with every parameter perturbed."""
    torch.manual_seed(seed)
    block = Mamba2(16, d_state=8, headdim=8, chunk_size=16, backend=backend, device=DEVICE, dtype=dtype, **options)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return block


print(f"{'backend':>7} {'dtype':>8}  {'options':52s} relative error")
for backend, dtype in (("torch", torch.float64), ("triton", torch.float32)):
    for options in ({}, {"ngroups": 2, "d_ssm": 16, "bias": True}, {"rmsnorm": False, "conv_bias": False},
                    {"D_has_hdim": True, "norm_before_gate": True}, {"dt_limit": (0.02, 0.3), "rmsnorm": False, "D_has_hdim": True}):
        block = small_mamba2(backend, dtype, **options)
        u = torch.randn(2, 37, 16, device=DEVICE, dtype=dtype)
        want, got = mamba2_reference(block, u), block(u).double()
        error = ((got - want).abs().max() / want.abs().max()).item()
        named = ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"
        print(f"{backend:>7} {str(dtype)[6:]:>8}  {named:52s} {error:.1e}")
        assert error < (1e-12 if dtype == torch.float64 else 1e-5), error

# %% [markdown]
# Generation: the same prompt fed whole, in two chunks (a prefill continued from the cached states) and one
# position at a time (`step`) gives the same outputs and leaves the same states; a second prompt on the
# same cache, from offset 0, starts from zero states.

# %%
from scan_lib import InferenceParams


def run_prompt(block, u, pieces):
    """The block over u fed in pieces of the given lengths, with one InferenceParams; outputs and states."""
    params, outs, start = InferenceParams(max_seqlen=u.shape[1], max_batch_size=u.shape[0]), [], 0
    for length in pieces:
        outs.append(block(u[:, start:start + length], inference_params=params))
        params.seqlen_offset, start = start + length, start + length
    return torch.cat(outs, dim=1), params


for backend, dtype in (("torch", torch.float64), ("triton", torch.float32)):
    block = small_mamba2(backend, dtype, layer_idx=0, ngroups=2)
    u = torch.randn(2, 21, 16, device=DEVICE, dtype=dtype)
    whole, whole_params = run_prompt(block, u, [21])
    errors = []
    for pieces in ([13, 8], [5] + [1] * 16):
        out, params = run_prompt(block, u, pieces)
        errors += [(out - whole).abs().max() / whole.abs().max()] + [
            (a - b).abs().max() / b.abs().max() for a, b in zip(params.key_value_memory_dict[0], whole_params.key_value_memory_dict[0])]
    whole_params.seqlen_offset = 0   # a new prompt on the old cache
    again = block(u, inference_params=whole_params)
    errors.append((again - whole).abs().max() / whole.abs().max())
    print(f"{backend:>7}: whole / in two chunks / token by token / a second prompt, largest relative error "
          f"{max(errors).item():.1e}")
    assert max(errors) < (1e-12 if dtype == torch.float64 else 1e-5)

# %% [markdown]
# On a GPU with `mamba_ssm` installed, the same weights in `mamba_ssm`'s own `Mamba2` (its unfused path,
# `use_mem_eff_path=False`, which needs no causal-conv1d package), in float32 and bfloat16, both against the
# block in float64: the output and every gradient of ours within twice `mamba_ssm`'s error, or within the
# float32 bound of the checks above (eight roundings in bfloat16): two implementations that sum in different
# orders are not bit-equal.

# %%
#| export
from scan_lib.mamba import _mamba_ssm_block   # chapter 06's: mamba_ssm's package entered without its __init__


def _mamba_ssm_mamba2():
    """mamba_ssm's Mamba2 class, or None and the reason. mamba_ssm's package is entered as chapter 06's
    `_mamba_ssm_block` enters it (without its __init__, which imports far more); huggingface_hub, whose only
    use in the module is a mixin for saving to the Hub, is replaced by an empty mixin where it is missing."""
    import importlib
    import importlib.util
    import sys
    import types
    _, why_not = _mamba_ssm_block()
    if "mamba_ssm" not in sys.modules:
        return None, why_not
    stand_in = "huggingface_hub" not in sys.modules and importlib.util.find_spec("huggingface_hub") is None
    if stand_in:
        hub = sys.modules["huggingface_hub"] = types.ModuleType("huggingface_hub")
        hub.PyTorchModelHubMixin = type("PyTorchModelHubMixin", (), {})
    try:
        return importlib.import_module("mamba_ssm.modules.mamba2").Mamba2, None
    except Exception as error:   # noqa: BLE001 (a missing extension or package shows up as any of several errors)
        return None, f"mamba_ssm's Mamba2 not importable: {type(error).__name__}: {error}"
    finally:
        if stand_in:   # mamba2 keeps its mixin; nothing else should find the stand-in
            sys.modules.pop("huggingface_hub")


# %%
def block_results(block, u, grad):
    """The block's output and the gradients of u and of every parameter (by name), in float64."""
    u = u.to(block.in_proj.weight.dtype).requires_grad_()
    out = block(u)
    names, params = zip(*block.named_parameters())
    grads = torch.autograd.grad(out, [u, *params], grad.to(out.dtype))
    return {"out": out.double(), "u": grads[0].double(), **{n: g.double() for n, g in zip(names, grads[1:])}}


Theirs, why_not = _mamba_ssm_mamba2() if ON_GPU else (None, "needs a GPU")
if Theirs is None:
    print(f"skipped the comparison with mamba_ssm's Mamba2 ({why_not})")
else:
    import copy

    torch.manual_seed(0)
    config = dict(d_model=256, d_state=64, headdim=64, ngroups=2, device=DEVICE)
    u, grad = torch.randn(2, 300, 256, device=DEVICE, dtype=torch.float64), torch.randn(2, 300, 256, device=DEVICE, dtype=torch.float64)
    exact = Mamba2(**config, dtype=torch.float64, backend="torch")
    want = block_results(exact, u, grad)
    for dtype in (torch.float32, torch.bfloat16):
        ours = copy.deepcopy(exact).to(dtype)
        ours.backend, ours.D.data = "triton", ours.D.data.float()               # D is float32 in both blocks
        theirs = Theirs(**config, use_mem_eff_path=False, dtype=dtype)
        theirs.load_state_dict(ours.state_dict())
        errors = {name: [((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want]
                  for name, got in (("ours", block_results(ours, u, grad)), ("theirs", block_results(theirs, u, grad)))}
        worst = max(range(len(want)), key=lambda i: errors["ours"][i] / max(errors["theirs"][i], 1e-30))
        floor = 1e-5 if dtype == torch.float32 else 8 * torch.finfo(dtype).eps   # the float32 bound of the checks above
        print(f"{str(dtype)[6:]:>8}: relative error against float64, largest of output and gradients: ours "
              f"{max(errors['ours']):.1e}, mamba_ssm's {max(errors['theirs']):.1e}; the largest ratio at "
              f"{list(want)[worst]} ({errors['ours'][worst]:.1e} against {errors['theirs'][worst]:.1e})")
        assert all(o <= max(2 * t, floor) for o, t in zip(errors["ours"], errors["theirs"])), errors

# %% [markdown]
# In the recorded run, in float32 ours is at worst 1.1e-06 off the float64 block and `mamba_ssm`'s 1.2e-03:
# its SSD kernels multiply in TF32 (Triton's default for float32, section 9), ours in full float32 precision.
# In bfloat16 the two are alike, 1.1e-02 at worst each, the largest ratio at the convolution's weight
# (7.0e-03 against 6.6e-03).

# %% [markdown]
# How fast is the block? On a GPU the cell times a forward and a training step (the forward, then the
# gradients of the input and of every parameter) of both blocks in bfloat16, at section 9's second shape
# (`d_model` 1024: 32 heads of 64, $N = 128$, batch 8, $L = 2048$): `mamba_ssm`'s on its fused path
# (`use_mem_eff_path=True`: `mamba_split_conv1d_scan_combined`, with the convolution, the norm and
# `out_proj` inside its autograd function) where causal-conv1d's extension is installed, which that path
# needs, else on the unfused one; the forward without autograd, as in inference. Beside them, section 9's
# memory floor of the scan inside. Printed, not asserted.

# %%
def block_times_us(block, u, grad):
    """Medians of a forward without autograd (inference) and of a training step (forward, then backward into
    u and every parameter)."""
    def forward():
        with torch.no_grad():
            block(u)
    step = lambda: block(u).backward(grad)   # noqa: E731
    return (scan_lib.runtime.median_us(forward),
            scan_lib.runtime.median_us(step, grad_to_none=[u, *block.parameters()]))


if Theirs is None:
    print(f"skipped the block's timing against mamba_ssm's ({why_not})")
else:
    import importlib

    fused = getattr(importlib.import_module("mamba_ssm.ops.triton.ssd_combined"), "causal_conv1d_fwd_function",
                    None) is not None   # causal-conv1d's extension, which the fused path calls
    config = dict(d_model=1024, d_state=128, headdim=64, device=DEVICE, dtype=torch.bfloat16)
    ours = Mamba2(**config)
    theirs = Theirs(**config, use_mem_eff_path=fused)
    theirs.load_state_dict(ours.state_dict())
    u = torch.randn(8, 2048, 1024, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(u)
    times = {"ours": block_times_us(ours, u, grad), "mamba_ssm": block_times_us(theirs, u, grad)}
    print(f"{torch.cuda.get_device_name()}, bfloat16, batch 8, L 2048, d_model 1024 (32 heads of 64, N 128); "
          f"mamba_ssm's {'fused' if fused else 'unfused'} path; us")
    print(f"{'':>10} {'forward':>8} {'training step':>14}")
    for name, (forward, step) in times.items():
        print(f"{name:>10} {forward:8.0f} {step:14.0f}")
    print(f"{'ratio':>10} {times['mamba_ssm'][0] / times['ours'][0]:8.2f} {times['mamba_ssm'][1] / times['ours'][1]:14.2f}"
          "   (mamba_ssm / ours: above 1, ours faster)")
    scan_inputs = chunk_scan_inputs(8, 2048, 32, 64, 128, torch.bfloat16)   # section 9's: the scan inside alone
    print(f"{'floor':>10} " + " ".join(f"{chunk_scan_floor_us(scan_inputs, backward, bandwidth):{w}.0f}"
                                      for backward, w in ((False, 8), (True, 14)))
          + "   (the scan's inputs and outputs moved once, section 9; the block moves more)")
    del ours, theirs, u, grad, scan_inputs

# %% [markdown]
# In the recorded run our block is ahead of `mamba_ssm`'s on its fused path in both columns: the forward
# takes 910 us against 1050 (1.15x), the training step 4307 against 6044 (1.40x). These are calls, host
# included. `make bench` on an H100 (`benchmarks/results/bench_h100_2026-12-07_mamba2_ssd.log`) also times the
# forward on the GPU alone, replayed from a CUDA graph: there `mamba_ssm`'s fused forward is faster, 747 us
# against our 881 (0.85x), and its calls are slower because its host is. In float32 ours is behind (the same
# log: forward on the GPU 5806 us against 5046, training step 21036 against 13186), where our op's tf32x3
# backward at $N = 128$ takes most of the step (section 9's float32 rows) and `mamba_ssm`'s multiplies in
# TF32. Both blocks are far above the scan's floor (71 and 189 us), and the scan is only part of the
# block: the two projections, the convolution and the norm move more. The cell does not split the time among them; a profile of both
# blocks, kernel by kernel, is still to be done.

# %% [markdown]
# ## References
#
# - Dao and Gu, "Transformers are SSMs: generalized models and efficient algorithms through structured
#   state space duality", ICML 2024, arXiv:2405.21060 (Mamba-2, SSD, the chunked algorithm).
# - Gu and Dao, "Mamba: linear-time sequence modeling with selective state spaces", 2023, arXiv:2312.00752.
# - Blelloch, "Prefix sums and their applications", CMU-CS-90-190, 1990 (the scan over chunks).
# - Dao and Gu, `mamba_ssm` 2.3.2 (github.com/state-spaces/mamba): `mamba_chunk_scan_combined`'s interface,
#   and the Mamba2 block and its gated RMSNorm (`modules/mamba2.py`, `ops/triton/layernorm_gated.py`), whose
#   arguments, parameters and generation cache section 10 follows.
# - Zhang and Sennrich, "Root mean square layer normalization", NeurIPS 2019, arXiv:1910.07467 (RMSNorm).
# - NVIDIA H200 Tensor Core GPU datasheet (the tensor-core and scalar rates; the H100 SXM's has the
#   same two).
