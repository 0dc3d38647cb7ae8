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
# # 08 · FlashAttention: attention as a scan
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/scan-course/scans-the-hard-way/blob/main/notebooks/08_flash_attention.ipynb)
#
# Softmax attention looks nothing like a recurrence: every query looks at every key at once. Yet
# FlashAttention computes it with the pattern of chapters 02 and 03: walk along the keys block by
# block, carry a small state, and merge states with an associative operator. You will define the
# **online-softmax state** $(m, \ell, o)$ and its merge, write the **tiled forward** kernel and a
# **backward** that recomputes the tiles, export the differentiable
# `flash_attention(q, k, v, causal=False, sm_scale=None)`, and on a GPU compare it with PyTorch's
# `scaled_dot_product_attention`.

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
#| default_exp flash_attention

# %%
import random

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from scan_lib.runtime import save_figure

# %% [markdown]
# ## 1. Softmax attention, and the $L \times L$ problem
#
# One attention head takes queries $q_i$, keys $k_j$ and values $v_j$, vectors of size $d$ (the head
# dim), for positions $0 \le i, j < L$. Each query scores every key, a softmax over the keys turns the
# scores into weights, and the output is the weighted mean of the values:
#
# $$s_{ij} = \tau\, q_i \cdot k_j, \qquad P_{ij} = \frac{e^{s_{ij}}}{\sum_{j'} e^{s_{ij'}}}, \qquad
# O_i = \sum_j P_{ij}\, v_j ,$$
#
# with the scale $\tau = 1/\sqrt{d}$ by default. **Causal** attention lets query $i$ see only the keys
# $j \le i$ ($s_{ij} = -\infty$ for $j > i$). The **log-sum-exp** $\mathrm{lse}_i = \log \sum_j e^{s_{ij}}$
# gives $P_{ij} = e^{s_{ij} - \mathrm{lse}_i}$; we will store it for the backward pass. The reference
# below is the definition in float64, on tensors (batch, heads, L, head_dim) as in
# `F.scaled_dot_product_attention`, through the full matrix of scores (other cases: "Going deeper:
# attention as people call it").

# %%
#| export
"""FlashAttention in Triton: the tiled forward (online softmax) and backward kernels, and the differentiable op `flash_attention`."""
import torch
import triton
import triton.language as tl

from scan_lib.ema import accumulator_dtype
from scan_lib.runtime import (INTERPRET, ON_GPU, apply, cdiv, check_float_tensor, check_same_device, custom_op,
                              next_power_of_2)

LOG2E = 1.4426950408889634  # log2(e): the kernels use exp2, e^x = 2^(x log2 e)


def attention_reference(q, k, v, causal=False, sm_scale=None):
    """(softmax(q k^T * sm_scale, causal mask) v, log-sum-exp of the scores), float64 and differentiable.

    q: (..., heads, Lq, head_dim); k, v: (..., kv_heads, Lk, head_dim), query head h reading kv head h // (heads //
    kv_heads). causal: query i sees the keys j <= i + Lk - Lq (bottom-right; the usual mask if Lq == Lk); a query
    that sees no key gets the output 0 and the lse -inf. sm_scale None: 1 / sqrt(head_dim)."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if k.shape[-3:-2] != q.shape[-3:-2]:  # fewer kv heads: each serves a group of consecutive query heads
        k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], -3) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * scale  # ... x Lq x Lk
    if causal:
        queries, keys = scores.shape[-2:]
        later = torch.ones(queries, keys, dtype=torch.bool, device=q.device).triu(keys - queries + 1)  # j > i + Lk - Lq
        scores = scores.masked_fill(later, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # ... x Lq; -inf where a query sees no key
    p = torch.exp(scores - lse.clamp(min=torch.finfo(lse.dtype).min)[..., None])  # such a row: e^-inf = 0, not NaN
    return p @ v, lse

# %%
torch.manual_seed(0)
q_small, k_small, v_small = torch.randn(3, 2, 3, 5, 32, dtype=torch.float64)
out_small, lse_small = attention_reference(q_small, k_small, v_small, causal=True)
torch.testing.assert_close(out_small, F.scaled_dot_product_attention(q_small, k_small, v_small, is_causal=True))
torch.testing.assert_close(out_small[..., 0, :], v_small[..., 0, :])  # causal: query 0 sees key 0 only
print("attention_reference == F.scaled_dot_product_attention in float64 (causal); query 0 returns v_0: ok")

# %% [markdown]
# The reference materialises the scores $s$ and the probabilities $P$: $L^2$ numbers per head, against
# $4 L d$ for the inputs and the output, $L / (4 d)$ times more: 64 times at $L = 16384$, $d = 64$
# ("Going deeper: the memory, measured"). Autograd keeps $P$ for the backward pass, so training pays it
# on every layer.
#
# FlashAttention never stores the matrix. It walks along the keys in blocks, keeps for each query a
# state of size $d + 2$, and recomputes the scores in the backward pass.
#
# ## 2. The online-softmax state and its merge
#
# Take one query and any set $J$ of keys. Its **state** summarises what the softmax needs from $J$:
#
# $$m_J = \max_{j \in J} s_j, \qquad \ell_J = \sum_{j\in J} e^{s_j - m_J}, \qquad
# o_J = \sum_{j\in J} e^{s_j - m_J}\, v_j .$$
#
# The output over $J$ is $o_J / \ell_J$ and its log-sum-exp is $m_J + \log \ell_J$. Subtracting the
# maximum keeps every exponent $\le 0$, so nothing overflows (a float16 $e^{12}$ already does). For two
# disjoint sets $A$ and $B$, the state of $A \cup B$ follows from the two states alone, by rescaling
# both to the common maximum $m = \max(m_A, m_B)$:
#
# $$(m_A, \ell_A, o_A) \oplus (m_B, \ell_B, o_B) = \big(m,\ \ e^{m_A - m}\ell_A + e^{m_B - m}\ell_B,\ \
# e^{m_A - m} o_A + e^{m_B - m} o_B\big).$$
#
# The state of the empty set, $(-\infty, 0, 0)$, is the identity (with the convention
# $e^{-\infty - (-\infty)} \cdot 0 = 0$, which the code writes as a select).
#
# **The merge is associative and commutative**: multiplying $\ell$ and $o$ by $e^{m}$ turns the state
# of $J$ into $(\max_J s_j,\ \sum_J e^{s_j},\ \sum_J e^{s_j} v_j)$ and the merge into (max, +, +)
# componentwise ("Going deeper: why the merge is associative" proves it and checks `merge_states`). So
# the keys can be cut into blocks anywhere and merged in any grouping and, unlike chapter 02's steps, in
# any order.
#
# In PyTorch, for the states of many queries at once:

# %%
def softmax_state(scores, values):
    """The state (m, l, o) of the keys in `scores` (..., n) with `values` (..., n, head_dim)."""
    m = scores.max(-1).values  # ...
    weights = torch.exp(scores - m[..., None])  # ... x n
    return m, weights.sum(-1), (weights[..., None] * values).sum(-2)


def merge_states(x, y):
    """(m, l, o) of keys X, (m, l, o) of disjoint keys Y -> (m, l, o) of X and Y together."""
    (m_x, l_x, o_x), (m_y, l_y, o_y) = x, y
    ### BEGIN SOLUTION
    ### HINT: m = the larger maximum; rescale each state's l and o by e^(its m - m) (the select of the text where that is e^(-inf - (-inf))); return (m, l, o) of X and Y
    m = torch.maximum(m_x, m_y)
    scale_x = torch.where(m_x == m, 1.0, torch.exp(m_x - m))  # the select: e^(-inf - (-inf)) counts as 1
    scale_y = torch.where(m_y == m, 1.0, torch.exp(m_y - m))
    return m, scale_x * l_x + scale_y * l_y, scale_x[..., None] * o_x + scale_y[..., None] * o_y
    ### END SOLUTION

# %% [markdown]
# A query needs only the state of all its keys, so the kernels fold the key blocks into one state, left
# to right like chapter 02's chunk loop, and parallelise over queries. (`tl.associative_scan` can scan
# the states too, for attention over every prefix: "Going deeper: the merge in `tl.associative_scan`".)
#
# ## 3. One block: attention in a single program
#
# When $L$ is small, one program can hold a head's queries, keys and values and compute the scores
# with one `tl.dot`. Keys past $L$ get the score $-\infty$, so their weight is $e^{-\infty} = 0$.

# %%
@triton.jit
def attention_one_block_kernel(Q, K, V, O, length, sm_scale, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    # Q, K, V, O: heads x length x HEAD_DIM contiguous, float32. One program per head; BLOCK >= length.
    head = tl.program_id(0)
    positions = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    offsets = head * length * HEAD_DIM + positions[:, None] * HEAD_DIM + dims[None, :]  # BLOCK x HEAD_DIM
    inside = positions[:, None] < length
    q = tl.load(Q + offsets, mask=inside, other=0.0)
    k = tl.load(K + offsets, mask=inside, other=0.0)
    v = tl.load(V + offsets, mask=inside, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale  # BLOCK x BLOCK scores
    s = tl.where(positions[None, :] < length, s, float("-inf"))  # keys past the end weigh nothing
    p = tl.exp(s - tl.max(s, 1)[:, None])
    o = tl.dot(p, v, input_precision="ieee") / tl.sum(p, 1)[:, None]
    tl.store(O + offsets, o, mask=inside)


def attention_one_block(q, k, v):
    """Attention of contiguous float32 (heads, L, head_dim) tensors, each head in one program (L <= a few hundred)."""
    heads, length, head_dim = q.shape
    out = torch.empty_like(q)
    attention_one_block_kernel[(heads,)](q, k, v, out, length, head_dim**-0.5, HEAD_DIM=head_dim,
                                         BLOCK=max(16, triton.next_power_of_2(length)), num_warps=8)
    return out


torch.manual_seed(3)
print(f"{'L':>4} {'max abs err':>12}")
for length in (1, 7, 33, 100):
    q_1b, k_1b, v_1b = torch.randn(3, 2, length, 64, device=DEVICE)
    err = (attention_one_block(q_1b, k_1b, v_1b).double() - attention_reference(q_1b, k_1b, v_1b)[0]).abs().max().item()
    print(f"{length:4} {err:12.2e}")
    assert err < 1e-5

# %% [markdown]
# `tl.dot` needs blocks of at least 16 rows, hence the `max(16, ...)`. The block of scores lives in
# registers, which a `BLOCK` of 256 would overflow ("Going deeper: the forward kernel's details"):
# longer sequences need the keys in blocks, with the state carried between them.
#
# ## 4. The tiled forward kernel
#
# Each program takes `BLOCK_M` queries of one head and loops over the keys in blocks of `BLOCK_N`,
# keeping its queries' state $(m, \ell, o)$ in registers. Per key block it computes the scores with
# `tl.dot` and merges in the block's state: section 2's merge, for a running state and one new block, is
# the **online softmax**:
#
# $$m' = \max\big(m, \max_j s_{ij}\big),\quad \alpha = e^{m - m'},\quad p_{ij} = e^{s_{ij} - m'},\quad
# \ell' = \alpha\,\ell + \sum_j p_{ij},\quad o' = \alpha\, o + p\, V_{\text{block}} .$$
#
# After the last block, $O_i = o_i / \ell_i$ and $\mathrm{lse}_i = m_i + \log \ell_i$ are written.
# In the code:
#
# - **exp2**: the scores are multiplied by $\tau \log_2 e$ and exponentiated with `tl.exp2`, one
#   multiply fewer per score; $m$ is kept in these base-2 units.
# - **masks only where needed**: `attend_key_blocks` runs twice: unmasked over the key blocks wholly
#   inside $0..L-1$ (and, when causal, left of the program's first query), then masked over the rest. A
#   causal program stops at its last query, skipping the blocks above the diagonal.
# - **precision**: scores and the state are float32 (float64 for float64 inputs); $p$ is rounded to the
#   input's dtype for the second product, so that float16 / bfloat16 run on the tensor cores.
# - **as people call it**: the kernel reads any strides, lets query heads share a head of keys and values
#   (`group`), takes $L_q$ queries and $L_k$ keys (`diagonal` $= L_k - L_q$) and pads head dims such as 80
#   to a power of two (`HEAD_DIM_PADDED`). On a first reading take `group` 1, `diagonal` 0 and a head dim
#   of 64 ("Going deeper: attention as people call it" explains the rest).
#
# "Going deeper: the forward kernel's details" explains the grid's order (the last query blocks first),
# the `tl.float64` scale and the interpreter bug that `matmul` works around.

# %%
#| export
UPCAST_BFLOAT16_DOTS: tl.constexpr = tl.constexpr(INTERPRET)  # Triton 3.6's interpreter botches bfloat16 tl.dot
LOG2E_CONST: tl.constexpr = tl.constexpr(LOG2E)  # LOG2E inside kernels


@triton.jit
def matmul(a, b):
    """tl.dot(a, b) with float32 accumulation and full float32 precision ("ieee", not TF32)."""
    if UPCAST_BFLOAT16_DOTS:
        if a.dtype == tl.bfloat16:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def tile_pointers(T, positions, dims, stride_l, stride_d):
    """Pointers to the tile `positions` x `dims` of one head T (positions down, head dims across), at its strides."""
    return T + positions[:, None] * stride_l + dims[None, :] * stride_d


@triton.jit
def load_tile(PTRS, positions, length, dims, HEAD_DIM: tl.constexpr, MASK_POSITIONS: tl.constexpr):
    """The tile at PTRS, zeros at positions >= `length` (if MASK_POSITIONS) and dims >= HEAD_DIM (padding)."""
    if dims.shape[0] != HEAD_DIM:
        inside = dims[None, :] < HEAD_DIM
        if MASK_POSITIONS:
            inside = inside & (positions[:, None] < length)
        tile = tl.load(PTRS, mask=inside, other=0.0)
    elif MASK_POSITIONS:
        tile = tl.load(PTRS, mask=positions[:, None] < length, other=0.0)
    else:
        tile = tl.load(PTRS)
    return tile


@triton.jit
def store_tile(PTRS, tile, positions, length, dims, HEAD_DIM: tl.constexpr):
    """Store `tile` at PTRS, except at the positions from `length` on and the dims from HEAD_DIM on."""
    inside = positions[:, None] < length
    if dims.shape[0] != HEAD_DIM:
        inside = inside & (dims[None, :] < HEAD_DIM)
    tl.store(PTRS, tile.to(PTRS.dtype.element_ty), mask=inside)


@triton.jit
def attend_key_blocks(o, l, m, q, K, V, stride_kl, stride_kd, stride_vl, stride_vd, rows, start, stop, k_length,
                      diagonal, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                      CAUSAL: tl.constexpr):
    """Merge the key blocks [start, stop) into the state (m, l, o) of the queries `rows` (m in base-2 units)."""
    dims = tl.arange(0, q.shape[1])  # the head dim, padded to a power of two
    for block_start in tl.range(start, stop, BLOCK_N):
        keys = block_start + tl.arange(0, BLOCK_N)
        k = load_tile(tile_pointers(K, keys, dims, stride_kl, stride_kd), keys, k_length, dims, HEAD_DIM, MASKED)
        v = load_tile(tile_pointers(V, keys, dims, stride_vl, stride_vd), keys, k_length, dims, HEAD_DIM, MASKED)
        s = matmul(q, tl.trans(k)).to(o.dtype) * qk_scale  # BLOCK_M x BLOCK_N
        if MASKED:
            visible = keys[None, :] < k_length
            if CAUSAL:
                visible = visible & (keys[None, :] <= rows[:, None] + diagonal)
            s = tl.where(visible, s, float("-inf"))
        ### BEGIN SOLUTION
        ### HINT: fold the block's scores s (base 2) into (m, l, o): m_new = the larger maximum, alpha = 2^(m - m_new) rescales the old l and o, p = 2^(s - m_new) adds the block's terms; then m = m_new
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)  # rescales the old state to the new maximum
        p = tl.exp2(s - m_new[:, None])  # BLOCK_M x BLOCK_N
        l = l * alpha + tl.sum(p, 1)
        o = o * alpha[:, None] + matmul(p.to(v.dtype), v).to(o.dtype)
        m = m_new
        ### END SOLUTION
    return o, l, m


@triton.jit
def flash_fwd_kernel(Q, K, V, O, LSE, q_length, k_length, q_bucket, k_bucket, group,  # buckets: the autotune key
                     qk_scale: tl.float64,
                     stride_qb, stride_qh, stride_ql, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
                     stride_vb, stride_vh, stride_vl, stride_vd, stride_ob, stride_oh, stride_ol, stride_od,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Q, O: batch x heads x q_length x HEAD_DIM; K, V: batch x (heads / group) x k_length x HEAD_DIM; LSE in ACC.
    qk_scale = tl.full([], qk_scale, ACC)  # why float64, why tl.full: "Going deeper: the forward kernel's details"
    block_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the last queries first: causal, they have the most keys
    head, batch = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    Q += batch * stride_qb + head * stride_qh
    K += batch * stride_kb + head // group * stride_kh
    V += batch * stride_vb + head // group * stride_vh
    O += batch * stride_ob + head * stride_oh
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    q = load_tile(tile_pointers(Q, rows, dims, stride_ql, stride_qd), rows, q_length, dims, HEAD_DIM, True)
    m = tl.full([BLOCK_M], float("-inf"), ACC)
    l = tl.zeros([BLOCK_M], ACC)
    o = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], ACC)
    diagonal = k_length - q_length  # causal: query i sees the keys j <= i + diagonal (aligned bottom-right)
    if CAUSAL:  # keys left of the first query's diagonal need no mask; stop after the last query's
        unmasked_stop = tl.maximum(block_m * BLOCK_M + diagonal, 0) // BLOCK_N * BLOCK_N
        stop = tl.minimum(k_length, (block_m + 1) * BLOCK_M + diagonal)
        m = tl.where(rows + diagonal < 0, 0.0, m)  # a query that sees no key: 2^(-inf - 0), never -inf - (-inf)
    else:  # whole key blocks need no mask
        unmasked_stop = k_length // BLOCK_N * BLOCK_N
        stop = k_length
    o, l, m = attend_key_blocks(o, l, m, q, K, V, stride_kl, stride_kd, stride_vl, stride_vd, rows, 0, unmasked_stop,
                                k_length, diagonal, qk_scale, HEAD_DIM, BLOCK_N, False, CAUSAL)
    o, l, m = attend_key_blocks(o, l, m, q, K, V, stride_kl, stride_kd, stride_vl, stride_vd, rows, unmasked_stop, stop,
                                k_length, diagonal, qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL)
    seen = l > 0  # l >= 1 for a query that sees a key: only one that sees none has l = 0 (and o = 0)
    l = tl.where(seen, l, 1.0)
    store_tile(tile_pointers(O, rows, dims, stride_ol, stride_od), o / l[:, None], rows, q_length, dims, HEAD_DIM)
    lse = tl.where(seen, m / LOG2E_CONST + tl.log(l), float("-inf"))  # natural log; log(no terms) = -inf
    tl.store(LSE + (batch * tl.num_programs(1) + head) * q_length + rows, lse, mask=rows < q_length)

# %% [markdown]
# The launcher's grid depends on the block size, which `triton.autotune` picks on a GPU ("Going deeper:
# tile sizes and autotuning"); the interpreter runs one small tile.

# %%
#| export
# (BLOCK_M, BLOCK_N, num_warps, num_stages) for autotune on a GPU, by element size, at head dims <= 128.
GPU_TILES = {
    "fwd": {2: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)],
            4: [(64, 32, 4, 2), (32, 32, 4, 2)], 8: [(32, 32, 4, 1)]},
    "dkdv": {2: [(64, 128, 8, 3), (32, 128, 4, 3)],
             4: [(32, 64, 4, 2), (32, 32, 4, 2)], 8: [(32, 32, 4, 1)]},
    "dq": {2: [(128, 64, 8, 3), (64, 64, 4, 3)],
           4: [(64, 32, 4, 2), (32, 32, 4, 2)], 8: [(32, 32, 4, 1)]},
}
INTERPRETER_TILES = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}  # (BLOCK_M, BLOCK_N) on the CPU
MAX_HEAD_DIM = 256  # head dims: the multiples of 16 up to this (tl.dot needs 16 at least)


def gpu_tiles(kernel_name: str, element_size: int, head_dim_padded: int) -> list:
    """GPU_TILES[kernel_name][element_size], shrunk past head dim 128 ("Going deeper: attention as people call it")."""
    shrink = max(1, head_dim_padded // 128)
    return list(dict.fromkeys(
        (max(16, block_m // shrink), max(16, block_n // shrink), warps, stages if shrink == 1 else min(stages, 2))
        for block_m, block_n, warps, stages in GPU_TILES[kernel_name][element_size]))


def tuned(kernel_name: str):
    """triton.autotune over the gpu_tiles of the inputs' element size and head dim; on the CPU, INTERPRETER_TILES."""
    key = ["q_bucket", "k_bucket", "HEAD_DIM", "CAUSAL"]
    if not ON_GPU:
        block_m, block_n = INTERPRETER_TILES[kernel_name]
        return triton.autotune([triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n})], key=key)
    padded_dims = [16 << i for i in range(MAX_HEAD_DIM.bit_length() - 4)]  # 16, 32, ..., MAX_HEAD_DIM
    by_size_and_dim = {(size, dim): [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                                     for m, n, w, s in gpu_tiles(kernel_name, size, dim)]
                       for size in GPU_TILES[kernel_name] for dim in padded_dims}

    def for_element_size_and_head_dim(configs, named_args, **kwargs):
        return by_size_and_dim[named_args["Q"].element_size(), kwargs["HEAD_DIM_PADDED"]]

    def quick_bench(kernel_call, quantiles):  # each new key costs a search: short warm-up and repeats
        return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)
    return triton.autotune([c for configs in by_size_and_dim.values() for c in configs], key=key, do_bench=quick_bench,
                           prune_configs_by={"early_config_prune": for_element_size_and_head_dim})


flash_fwd = tuned("fwd")(flash_fwd_kernel)


def length_bucket(length: int) -> int:
    """The autotuning key of a length: the power of two at or above it."""
    return 1 << (length - 1).bit_length()


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the saved log-sum-exp, the kernels' accumulator: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def head_dim_options(head_dim: int) -> dict:
    """The kernels' constexprs for a head dim: itself, and padded to a power of two (tl.arange's sizes)."""
    return dict(HEAD_DIM=head_dim, HEAD_DIM_PADDED=next_power_of_2(head_dim))


def flash_attention_forward(q, k, v, causal: bool, sm_scale: float):
    """(output, lse) for q (batch, heads, Lq, head_dim), k, v (batch, kv_heads, Lk, head_dim): one dtype, any strides,
    Lq, Lk >= 1, kv_heads dividing heads. output: empty_like(q); lse: (batch, heads, Lq), lse_dtype, -inf: no key."""
    batch, heads, q_length, head_dim = q.shape
    kv_heads, k_length = k.shape[1:3]
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, q_length, dtype=lse_dtype(q.dtype), device=q.device)
    grid = lambda meta: (cdiv(q_length, meta["BLOCK_M"]), heads, batch)  # noqa: E731
    flash_fwd[grid](q, k, v, out, lse, q_length, k_length, length_bucket(q_length), length_bucket(k_length),
                    heads // kv_heads, sm_scale * LOG2E, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                    CAUSAL=causal, ACC=accumulator_dtype(q.dtype), **head_dim_options(head_dim))
    return out, lse

# %% [markdown]
# The checks: random inputs at awkward lengths, causal and not, head dims 32, 64 and 128 (the others:
# "Going deeper: attention as people call it") and every input dtype, against the float64 reference. The
# output is rounded once to the input dtype, so the tolerance is a few units of its rounding. (On a CPU,
# bfloat16 errors are larger than the GPU's printed here: "Going deeper: the forward kernel's details".)

# %%
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # max abs error allowed, inputs ~ N(0, 1)


def forward_cases():
    """(L, head_dim, dtype, causal): every L and flag in float32 at d 64; the rest at two L (the CPU is slow)."""
    lengths = (1, 7, 33, 129, 1000, 4097) if ON_GPU else (1, 7, 33, 129)
    cases = [(length, 64, torch.float32, causal) for length in lengths for causal in (False, True)]
    for head_dim in (32, 64, 128):
        for dtype in TOLERANCE:
            cases += [(length, head_dim, dtype, True) for length in (7, 129) if (head_dim, dtype) != (64, torch.float32)]
    return cases


torch.manual_seed(4)
print(f"{'L':>5} {'d':>4} {'dtype':>9} {'causal':>6} {'out err':>9} {'lse err':>9}")
for length, head_dim, dtype, causal in forward_cases():
    q_f, k_f, v_f = torch.randn(3, 1, 2, length, head_dim, device=DEVICE).to(dtype)  # batch 1, 2 heads
    out_f, lse_f = flash_attention_forward(q_f, k_f, v_f, causal, head_dim**-0.5)
    want_out, want_lse = attention_reference(q_f, k_f, v_f, causal)
    out_err = (out_f.double() - want_out).abs().max().item()
    lse_err = (lse_f.double() - want_lse).abs().max().item()
    print(f"{length:5} {head_dim:4} {str(dtype)[6:]:>9} {str(causal):>6} {out_err:9.1e} {lse_err:9.1e}")
    assert out_f.dtype == dtype and lse_f.dtype == torch.float32
    assert out_err < TOLERANCE[dtype] and lse_err < 1e-4

# %% [markdown]
# ## 5. The backward pass, derived
#
# For one head and a loss $\mathcal{L}$, write $dX$ for $\partial\mathcal{L}/\partial X$ ($dO$ is the
# incoming gradient). From $O_i = \sum_j P_{ij} v_j$:
#
# $$dV_j = \sum_i P_{ij}\, dO_i, \qquad dP_{ij} = dO_i \cdot v_j .$$
#
# The softmax of row $i$ has the Jacobian $\partial P_{ik} / \partial s_{ij} = P_{ik}(\delta_{jk} - P_{ij})$, so
#
# $$dS_{ij} = \sum_k dP_{ik}\, P_{ik}(\delta_{jk} - P_{ij}) = P_{ij}\Big(dP_{ij} - \sum_k P_{ik}\, dP_{ik}\Big)
# = P_{ij}\,\big(dP_{ij} - D_i\big),$$
#
# and the row sum is a dot product of two vectors of size $d$, because $\sum_k P_{ik} v_k = O_i$:
#
# $$D_i = \sum_k P_{ik}\, dO_i \cdot v_k = dO_i \cdot O_i .$$
#
# Finally $s_{ij} = \tau\, q_i \cdot k_j$ gives
#
# $$dQ_i = \tau \sum_j dS_{ij}\, k_j, \qquad dK_j = \tau \sum_i dS_{ij}\, q_i .$$
#
# With causal masking, $P_{ij} = 0$ for $j > i$, hence $dS_{ij} = 0$ there: the same formulas, the same mask.
#
# **What to store, what to recompute.** $P$ is the $L \times L$ matrix we refused to store, but
# $P_{ij} = e^{\tau q_i\cdot k_j - \mathrm{lse}_i}$ is one score and one exponential away from the saved
# log-sum-exp, in any tile, in any order. So the backward recomputes the tiles of $S$ and $P$, in three
# kernels:
#
# 1. **preprocess**: $D_i = dO_i \cdot O_i$, one number per query;
# 2. **dK, dV**: one program per block of keys, looping over the blocks of queries, accumulating
#    $dV_j$ and $dK_j$ in registers;
# 3. **dQ**: one program per block of queries, looping over the blocks of keys, accumulating $dQ_i$.
#
# Each program owns the rows it writes: no atomics, and a result that does not depend on the programs'
# order. The price is computing $S$ and $dP$ twice, once per kernel. "Going deeper: the backward kernels"
# has their code, with the forward's loops and masks, and checks these formulas and every gradient
# against autograd of the float64 reference.

# %% [markdown]
# ## 6. `scan_lib.flash_attention`: a differentiable torch op
#
# As in chapter 03, the kernels become two torch custom ops, forward and backward, with fake
# implementations (for `torch.compile`) and vmap rules, joined by an `autograd.Function` into the
# exported `flash_attention`, which checks its arguments. Its code and checks follow the backward
# kernels', in "Going deeper: the torch op". It takes head dims that are multiples of 16 up to 256,
# grouped-query attention, $L_q \ne L_k$ and the (batch, L, heads, head_dim) layout in place ("Going
# deeper: attention as people call it").

# %% [markdown]
# ## 7. On a GPU: against PyTorch's FlashAttention and cuDNN
#
# "Going deeper: the benchmark" times ours in bfloat16 against `F.scaled_dot_product_attention` run by
# PyTorch's FlashAttention-2 kernels and by NVIDIA's cuDNN. In the recorded run (NVIDIA H100 80GB HBM3)
# ours beats the former at $L$ 4096 and 16384, trails it in five rows of eight at 1024 (the fine
# print measures why in one), and trails cuDNN everywhere (0.35-0.97x).

# %% [markdown]
# ## Summary
#
# - Softmax attention over the keys is a **scan with the state $(m, \ell, o)$**, whose merge is
#   associative and commutative: the keys can be cut into blocks anywhere, and the $L \times L$ matrix
#   never needs to exist.
# - The tiled forward keeps the state of `BLOCK_M` queries in registers and saves the log-sum-exp; the
#   backward recomputes $P = e^{S - \mathrm{lse}}$ tile by tile, in three kernels with no atomics.
# - `scan_lib.flash_attention` is a differentiable torch op for `torch.compile` and `torch.func`, with
#   head dims up to 256, grouped-query attention, $L_q \ne L_k$ (causal aligned bottom-right) and the
#   (batch, L, heads, head_dim) layout in place.
# - The naive CUDA kernel ("Going deeper: the CUDA kernel of the source, line by line") shows what a
#   tiled kernel must avoid: a serial softmax, scalar products, bank conflicts, too few blocks.

# %% [markdown]
# ## Going deeper: the backward kernels
#
# The code of section 5's three kernels, what shaped it, and its checks: every gradient against
# autograd of the float64 reference, and the derivation's formulas in float64.
#
# **Recomputing $P$.** The saved log-sum-exp gives each $P_{ij}$ in any tile, in
# any order: no running maximum is needed the second time.
#
# **The price of no atomics.** Computing $S$ and $dP$ once per kernel makes seven matrix products per
# tile pair ($S$, $dP$, $dV$, $dK$ in the first, $S$, $dP$, $dQ$ in the second), against two in the
# forward and five in a backward that computes each once.
#
# **Which way round.** On the tensor cores, a matrix product takes its left operand from registers and
# its right one from shared memory, where a transposed view costs nothing. $dV = P^\top dO$ and
# $dK = dS^\top Q$ need $P$ and $dS$ *transposed* on the left, and they were computed in registers: the
# transpose would shuffle them through shared memory, twice per tile. So the dK/dV kernel computes the
# transposed tile from the start, $S^\top = K Q^\top$ (keys down, queries across), and every product then
# has the operand it needs where it needs it: $P^\top$ and $dS^\top$ on the left, $Q^\top$, $dO^\top$
# (loaded tiles) on the right.
#
# **Masks only where they change something.** As in the forward, each kernel runs two or three loops
# of one body with a constexpr `MASKED`: masked on the causal diagonal and on the last, partial block,
# unmasked everywhere else. The dK/dV kernel needs no mask for its own keys past $L$: their rows of
# $dK$, $dV$ are never stored, and a row of a product depends only on the same row of its
# left operand. Queries past $L$ load as zeros ($dO = 0$ makes their terms vanish) but are masked anyway,
# because their recomputed $P$ is not a probability. The dQ kernel must mask keys past $L$: there
# $P = e^{-\mathrm{lse}}$ can overflow, and $\infty \cdot 0$ in $dS\,K$ is NaN in a row that *is* stored.
# The causal dQ program for the last queries has the most keys to visit, so the grid runs the query
# blocks from last to first: the long programs start first and the short ones fill the end.
#
# The kernels, the autotuned launches and the launcher:

# %%
#| export
@triton.jit
def flash_bwd_preprocess_kernel(O, DO, DELTA, q_length, stride_ob, stride_oh, stride_ol, stride_od,
                                stride_dob, stride_doh, stride_dol, stride_dod, HEAD_DIM: tl.constexpr,
                                HEAD_DIM_PADDED: tl.constexpr, ACC: tl.constexpr, BLOCK_M: tl.constexpr):
    # O, DO: batch x heads x q_length x HEAD_DIM at their strides; DELTA: batch x heads x q_length contiguous, in
    # ACC. DELTA = rowsum(DO * O): D_i = dO_i . O_i. The grid: (query blocks, heads, batch).
    head, batch = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    o = load_tile(tile_pointers(O + batch * stride_ob + head * stride_oh, rows, dims, stride_ol, stride_od),
                  rows, q_length, dims, HEAD_DIM, True).to(ACC)
    do = load_tile(tile_pointers(DO + batch * stride_dob + head * stride_doh, rows, dims, stride_dol, stride_dod),
                   rows, q_length, dims, HEAD_DIM, True).to(ACC)
    tl.store(DELTA + (batch * tl.num_programs(1) + head) * q_length + rows, tl.sum(o * do, 1), mask=rows < q_length)


@triton.jit
def dkdv_query_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, stride_ql, stride_qd, stride_dol, stride_dod, keys, start, stop,
                      q_length, diagonal, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """Add the query blocks [start, stop) of one query head to the keys' dK / sm_scale and dV, transposed: keys
    down the tiles.

    dk, dv: BLOCK_N x HEAD_DIM (padded) accumulators; k, v: BLOCK_N x HEAD_DIM; keys: BLOCK_N positions; Q, DO: the
    query head's rows (q_length x HEAD_DIM, at their strides), LSE, DELTA: its q_length statistics. MASKED: mask
    queries past `q_length` and, if CAUSAL, the queries before a key's diagonal (query i < key j - diagonal)."""
    dims = tl.arange(0, k.shape[1])  # the head dim, padded to a power of two
    for block_start in tl.range(start, stop, BLOCK_M):
        rows = block_start + tl.arange(0, BLOCK_M)
        q = load_tile(tile_pointers(Q, rows, dims, stride_ql, stride_qd), rows, q_length, dims, HEAD_DIM, MASKED)
        do = load_tile(tile_pointers(DO, rows, dims, stride_dol, stride_dod), rows, q_length, dims, HEAD_DIM, MASKED)
        if MASKED:
            lse2 = tl.load(LSE + rows, mask=rows < q_length, other=0.0) * LOG2E_CONST  # base 2
            delta = tl.load(DELTA + rows, mask=rows < q_length, other=0.0)
        else:
            lse2 = tl.load(LSE + rows) * LOG2E_CONST
            delta = tl.load(DELTA + rows)
        p_t = tl.exp2(matmul(k, tl.trans(q)).to(dk.dtype) * qk_scale - lse2[None, :])  # P^T: BLOCK_N x BLOCK_M
        if MASKED:
            visible = rows[None, :] < q_length
            if CAUSAL:
                visible = visible & (keys[:, None] <= rows[None, :] + diagonal)
            p_t = tl.where(visible, p_t, 0.0)
        ### BEGIN SOLUTION
        ### HINT: accumulate dV += P^T dO, then dP^T = V dO^T, dS^T = P^T * (dP^T - delta) (delta: one number per query, and queries run across the tile), dK += dS^T Q (sm_scale is applied at the store); use matmul
        dv += matmul(p_t.to(do.dtype), do).to(dk.dtype)  # dV += P^T dO
        dp_t = matmul(v, tl.trans(do)).to(dk.dtype)  # dP^T = V dO^T: BLOCK_N x BLOCK_M
        ds_t = p_t * (dp_t - delta[None, :])
        dk += matmul(ds_t.to(q.dtype), q).to(dk.dtype)  # dK += dS^T Q (times sm_scale at the end)
        ### END SOLUTION
    return dk, dv


@triton.jit
def flash_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, q_length, k_length, q_bucket, k_bucket, group,
                          qk_scale: tl.float64,
                          sm_scale: tl.float64, stride_qb, stride_qh, stride_ql, stride_qd,
                          stride_kb, stride_kh, stride_kl, stride_kd, stride_vb, stride_vh, stride_vl, stride_vd,
                          stride_dob, stride_doh, stride_dol, stride_dod,
                          stride_dkb, stride_dkh, stride_dkl, stride_dkd,
                          stride_dvb, stride_dvh, stride_dvl, stride_dvd, HEAD_DIM: tl.constexpr,
                          HEAD_DIM_PADDED: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Q, DO: batch x heads x q_length x HEAD_DIM; K, V, DK, DV: batch x (heads / group) x k_length x HEAD_DIM; each
    # at its strides. LSE, DELTA: batch x heads x q_length contiguous. One program per BLOCK_N keys of one kv head,
    # the grid (key blocks, kv heads, batch): it loops over the group of query heads that read the kv head, and
    # over each one's blocks of queries that can see the keys, summing their terms of dK and dV.
    qk_scale, sm_scale = tl.full([], qk_scale, ACC), tl.full([], sm_scale, ACC)  # see flash_fwd_kernel
    kv_head, batch = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    K += batch * stride_kb + kv_head * stride_kh
    V += batch * stride_vb + kv_head * stride_vh
    keys = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    k = load_tile(tile_pointers(K, keys, dims, stride_kl, stride_kd), keys, k_length, dims, HEAD_DIM, True)
    v = load_tile(tile_pointers(V, keys, dims, stride_vl, stride_vd), keys, k_length, dims, HEAD_DIM, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PADDED], ACC)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PADDED], ACC)
    whole_stop = q_length // BLOCK_M * BLOCK_M  # the query blocks before it are whole
    diagonal = k_length - q_length  # causal: query i sees the keys j <= i + diagonal
    if CAUSAL:  # queries before the keys' first diagonal cannot see them; the blocks across the diagonals see some
        first = tl.maximum(tl.program_id(0) * BLOCK_N - diagonal, 0) // BLOCK_M * BLOCK_M
        diagonal_stop = tl.cdiv(tl.maximum((tl.program_id(0) + 1) * BLOCK_N - diagonal, 0), BLOCK_M) * BLOCK_M
    else:
        first = 0
        diagonal_stop = 0
    for member in range(group):  # the query heads that read this kv head (a loop of one, compiled away, when
        head = kv_head * group + member  # group is 1: Triton specializes an int argument equal to 1)
        Q_head = Q + batch * stride_qb + head * stride_qh
        DO_head = DO + batch * stride_dob + head * stride_doh
        stats = (batch * tl.num_programs(1) * group + head) * q_length  # the head's offset in LSE and DELTA
        dk, dv = dkdv_query_blocks(dk, dv, k, v, Q_head, DO_head, LSE + stats, DELTA + stats, stride_ql, stride_qd,
                                   stride_dol, stride_dod, keys, first, tl.minimum(diagonal_stop, q_length), q_length,
                                   diagonal, qk_scale, HEAD_DIM, BLOCK_M, True, CAUSAL)
        dk, dv = dkdv_query_blocks(dk, dv, k, v, Q_head, DO_head, LSE + stats, DELTA + stats, stride_ql, stride_qd,
                                   stride_dol, stride_dod, keys, diagonal_stop, whole_stop, q_length,
                                   diagonal, qk_scale, HEAD_DIM, BLOCK_M, False, CAUSAL)
        dk, dv = dkdv_query_blocks(dk, dv, k, v, Q_head, DO_head, LSE + stats, DELTA + stats, stride_ql, stride_qd,
                                   stride_dol, stride_dod, keys, tl.maximum(diagonal_stop, whole_stop), q_length,
                                   q_length, diagonal, qk_scale, HEAD_DIM, BLOCK_M, True, CAUSAL)
    DK += batch * stride_dkb + kv_head * stride_dkh
    DV += batch * stride_dvb + kv_head * stride_dvh
    store_tile(tile_pointers(DK, keys, dims, stride_dkl, stride_dkd), dk * sm_scale, keys, k_length, dims, HEAD_DIM)
    store_tile(tile_pointers(DV, keys, dims, stride_dvl, stride_dvd), dv, keys, k_length, dims, HEAD_DIM)


@triton.jit
def dq_key_blocks(dq, q, do, lse2, delta, K, V, stride_kl, stride_kd, stride_vl, stride_vd, rows, start, stop,
                  k_length, diagonal, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """Add the key blocks [start, stop) to the queries' dQ / sm_scale.

    dq, q, do: BLOCK_M x HEAD_DIM (padded); lse2 (base 2), delta: BLOCK_M; K, V: the head's keys and values, at
    their strides. MASKED: mask keys past `k_length` and, if CAUSAL, the keys after a query's diagonal."""
    dims = tl.arange(0, q.shape[1])  # the head dim, padded to a power of two
    for block_start in tl.range(start, stop, BLOCK_N):
        keys = block_start + tl.arange(0, BLOCK_N)
        k = load_tile(tile_pointers(K, keys, dims, stride_kl, stride_kd), keys, k_length, dims, HEAD_DIM, MASKED)
        v = load_tile(tile_pointers(V, keys, dims, stride_vl, stride_vd), keys, k_length, dims, HEAD_DIM, MASKED)
        p = tl.exp2(matmul(q, tl.trans(k)).to(dq.dtype) * qk_scale - lse2[:, None])  # BLOCK_M x BLOCK_N
        if MASKED:
            visible = keys[None, :] < k_length
            if CAUSAL:
                visible = visible & (keys[None, :] <= rows[:, None] + diagonal)
            p = tl.where(visible, p, 0.0)
        dp = matmul(do, tl.trans(v)).to(dq.dtype)  # dP = dO V^T
        ds = p * (dp - delta[:, None])
        dq += matmul(ds.to(k.dtype), k).to(dq.dtype)  # dQ += dS K (times sm_scale at the end)
    return dq


@triton.jit
def flash_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, q_length, k_length, q_bucket, k_bucket, group,
                        qk_scale: tl.float64,
                        sm_scale: tl.float64, stride_qb, stride_qh, stride_ql, stride_qd,
                        stride_kb, stride_kh, stride_kl, stride_kd, stride_vb, stride_vh, stride_vl, stride_vd,
                        stride_dob, stride_doh, stride_dol, stride_dod, stride_dqb, stride_dqh, stride_dql, stride_dqd,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, CAUSAL: tl.constexpr,
                        ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Q, DO, DQ: batch x heads x q_length x HEAD_DIM; K, V: batch x (heads / group) x k_length x HEAD_DIM; each at
    # its strides. LSE, DELTA: batch x heads x q_length contiguous. One program per BLOCK_M queries of one head,
    # the grid (query blocks, heads, batch), looping over the blocks of keys they can see (of kv head h // group).
    qk_scale, sm_scale = tl.full([], qk_scale, ACC), tl.full([], sm_scale, ACC)  # see flash_fwd_kernel
    block_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the last queries first: they have the most keys
    head, batch = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    Q += batch * stride_qb + head * stride_qh
    DO += batch * stride_dob + head * stride_doh
    DQ += batch * stride_dqb + head * stride_dqh
    K += batch * stride_kb + head // group * stride_kh
    V += batch * stride_vb + head // group * stride_vh
    stats = (batch * tl.num_programs(1) + head) * q_length  # the head's offset in LSE and DELTA
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    q = load_tile(tile_pointers(Q, rows, dims, stride_ql, stride_qd), rows, q_length, dims, HEAD_DIM, True)
    do = load_tile(tile_pointers(DO, rows, dims, stride_dol, stride_dod), rows, q_length, dims, HEAD_DIM, True)
    lse2 = tl.load(LSE + stats + rows, mask=rows < q_length, other=0.0) * LOG2E_CONST
    delta = tl.load(DELTA + stats + rows, mask=rows < q_length, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], ACC)
    diagonal = k_length - q_length  # causal: query i sees the keys j <= i + diagonal
    if CAUSAL:  # keys left of the first query's diagonal need no mask; stop after the last query's
        unmasked_stop = tl.maximum(block_m * BLOCK_M + diagonal, 0) // BLOCK_N * BLOCK_N
        stop = tl.minimum(k_length, (block_m + 1) * BLOCK_M + diagonal)
    else:  # whole key blocks need no mask
        unmasked_stop = k_length // BLOCK_N * BLOCK_N
        stop = k_length
    dq = dq_key_blocks(dq, q, do, lse2, delta, K, V, stride_kl, stride_kd, stride_vl, stride_vd, rows, 0,
                       unmasked_stop, k_length, diagonal, qk_scale, HEAD_DIM, BLOCK_N, False, CAUSAL)
    dq = dq_key_blocks(dq, q, do, lse2, delta, K, V, stride_kl, stride_kd, stride_vl, stride_vd, rows, unmasked_stop,
                       stop, k_length, diagonal, qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL)
    store_tile(tile_pointers(DQ, rows, dims, stride_dql, stride_dqd), dq * sm_scale, rows, q_length, dims, HEAD_DIM)


flash_bwd_dkdv = tuned("dkdv")(flash_bwd_dkdv_kernel)
flash_bwd_dq = tuned("dq")(flash_bwd_dq_kernel)
PREPROCESS_BLOCK = 128 if ON_GPU else 32  # queries per program of the preprocessing kernel


def flash_attention_backward(q, k, v, out, lse, grad_out, causal: bool, sm_scale: float):
    """(dq, dk, dv) for q, out, grad_out (batch, heads, Lq, head_dim) and k, v (batch, kv_heads, Lk, head_dim) of one
    dtype, at any strides (read in place), and the forward's lse (batch, heads, Lq); Lq, Lk >= 1. The gradients
    in the input dtype, each with its input's strides where that input is dense (torch.empty_like)."""
    batch, heads, q_length, head_dim = q.shape
    kv_heads, k_length = k.shape[1:3]
    acc, dim_options = accumulator_dtype(q.dtype), head_dim_options(head_dim)
    delta = torch.empty_like(lse)  # rowsum(dO * O), (batch, heads, Lq)
    flash_bwd_preprocess_kernel[(cdiv(q_length, PREPROCESS_BLOCK), heads, batch)](
        out, grad_out, delta, q_length, *out.stride(), *grad_out.stride(), ACC=acc, BLOCK_M=PREPROCESS_BLOCK,
        **dim_options)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = (q, k, v, grad_out, lse, delta)
    sizes = (q_length, k_length, length_bucket(q_length), length_bucket(k_length), heads // kv_heads, sm_scale * LOG2E,
             sm_scale)
    strides = (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride())
    flash_bwd_dkdv[lambda meta: (cdiv(k_length, meta["BLOCK_N"]), kv_heads, batch)](
        *args, dk, dv, *sizes, *strides, *dk.stride(), *dv.stride(), CAUSAL=causal, ACC=acc, **dim_options)
    flash_bwd_dq[lambda meta: (cdiv(q_length, meta["BLOCK_M"]), heads, batch)](
        *args, dq, *sizes, *strides, *dq.stride(), CAUSAL=causal, ACC=acc, **dim_options)
    return dq, dk, dv

# %% [markdown]
# Every gradient against the float64 reference's autograd, at the lengths and dtypes of section 4 and
# a scale other than the default.

# %%
GRAD_TOLERANCE = {torch.float32: 5e-5, torch.float16: 2e-2, torch.bfloat16: 1.5e-1}  # max abs error, inputs ~ N(0, 1)

torch.manual_seed(6)
print(f"{'L':>5} {'d':>4} {'dtype':>9} {'causal':>6} {'dq err':>9} {'dk err':>9} {'dv err':>9}")
for length, head_dim, dtype, causal in forward_cases():
    q_g, k_g, v_g, grad_g = torch.randn(4, 1, 2, length, head_dim, device=DEVICE).to(dtype)
    leaves = [t.double().requires_grad_() for t in (q_g, k_g, v_g)]
    want_out, _ = attention_reference(*leaves, causal, 0.1)
    want = torch.autograd.grad(want_out, leaves, grad_g.double())
    out_g, lse_g = flash_attention_forward(q_g, k_g, v_g, causal, 0.1)
    got = flash_attention_backward(q_g, k_g, v_g, out_g, lse_g, grad_g, causal, 0.1)
    errors = [(g.double() - w).abs().max().item() for g, w in zip(got, want)]
    print(f"{length:5} {head_dim:4} {str(dtype)[6:]:>9} {str(causal):>6} " + " ".join(f"{e:9.1e}" for e in errors))
    assert all(g.dtype == dtype for g in got) and max(errors) < GRAD_TOLERANCE[dtype]

# %% [markdown]
# **The formulas, checked.** Section 5's $dS$, $dQ$, $dK$ and $dV$, in float64 against autograd of the
# reference:

# %%
def attention_backward_formulas(q, k, v, grad_out, causal, sm_scale):
    """(dq, dk, dv) from the formulas above, in float64, for (..., L, head_dim) tensors."""
    out, lse = attention_reference(q, k, v, causal, sm_scale)
    scores = q.double() @ k.double().transpose(-1, -2) * sm_scale  # ... x L x L
    p = torch.exp(scores - lse[..., None])
    if causal:
        p = p.tril()  # e^(s - lse) of a masked score is 0
    d_p = grad_out.double() @ v.double().transpose(-1, -2)
    d_rows = (grad_out.double() * out).sum(-1)  # D_i = dO_i . O_i
    d_s = p * (d_p - d_rows[..., None])
    return sm_scale * d_s @ k.double(), sm_scale * d_s.transpose(-1, -2) @ q.double(), p.transpose(-1, -2) @ grad_out.double()


torch.manual_seed(5)
for causal in (False, True):
    q_b, k_b, v_b, grad_b = torch.randn(4, 2, 3, 37, 32, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q_b, k_b, v_b)]
    want = torch.autograd.grad(attention_reference(*leaves, causal, 0.3)[0], leaves, grad_b)
    got = attention_backward_formulas(q_b, k_b, v_b, grad_b, causal, 0.3)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
print("dS = P * (dP - rowsum(dO * O)), dQ, dK, dV == autograd of the reference, causal and not: ok")

# %% [markdown]
# ## Going deeper: the torch op
#
# The code of section 6's export and its checks. Each custom op's fake implementation gives shapes
# only, for `torch.compile`; its vmap rule folds the vmapped dim into the batch. The
# `autograd.Function`'s forward saves $q, k, v$, the output and the log-sum-exp; its backward calls the
# backward op, wrapped in a Function of its own so that a second differentiation raises.

# %%
#| export
@custom_op("flash_attention_fwd", __name__)
def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, lse) for q (batch, heads, Lq, head_dim) and k, v (batch, kv_heads, Lk, head_dim) of one dtype."""
    if q.numel() == 0 or k.numel() == 0:  # no query, or no key: every output 0 and every lse -inf, as in SDPA
        return torch.zeros_like(q), q.new_full(q.shape[:-1], float("-inf"), dtype=lse_dtype(q.dtype))
    return flash_attention_forward(q, k, v, causal, sm_scale)


@flash_attention_fwd.register_fake
def _(q, k, v, causal, sm_scale):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


@custom_op("flash_attention_bwd", __name__)
def flash_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        grad_out: torch.Tensor, causal: bool,
                        sm_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for q, out, grad_out (batch, heads, Lq, head_dim), k, v (batch, kv_heads, Lk, head_dim),
    lse (batch, heads, Lq)."""
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return flash_attention_backward(q, k, v, out, lse, grad_out, causal, sm_scale)


@flash_attention_bwd.register_fake
def _(q, k, v, out, lse, grad_out, causal, sm_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fold_into_batch(info, in_dims, *tensors):
    """vmap: move each tensor's vmapped dim to the front (expanding an unbatched tensor), then fold it
    into the batch: (n, batch, ...) -> (n * batch, ...), a view where the strides allow (the kernels read any)."""
    folded = []
    for tensor, dim in zip(tensors, in_dims):
        tensor = tensor.movedim(dim, 0) if dim is not None else tensor.expand(info.batch_size, *tensor.shape)
        folded.append(tensor.reshape(tensor.shape[0] * tensor.shape[1], *tensor.shape[2:]))
    return folded


def _unfold(info, tensor):
    """(n * batch, ...) -> (n, batch, ...)."""
    return tensor.unflatten(0, (info.batch_size, tensor.shape[0] // info.batch_size))


def _flash_attention_fwd_vmap(info, in_dims, q, k, v, causal, sm_scale):
    out, lse = flash_attention_fwd(*_fold_into_batch(info, in_dims[:3], q, k, v), causal, sm_scale)
    return (_unfold(info, out), _unfold(info, lse)), (0, 0)


def _flash_attention_bwd_vmap(info, in_dims, q, k, v, out, lse, grad_out, causal, sm_scale):
    grads = flash_attention_bwd(*_fold_into_batch(info, in_dims[:6], q, k, v, out, lse, grad_out), causal, sm_scale)
    return tuple(_unfold(info, g) for g in grads), (0, 0, 0)


flash_attention_fwd.register_vmap(_flash_attention_fwd_vmap)
flash_attention_bwd.register_vmap(_flash_attention_bwd_vmap)



class FlashAttentionFunction(torch.autograd.Function):
    """Autograd for flash_attention on q (batch, heads, Lq, head_dim), k, v (batch, kv_heads, Lk, head_dim) of one
    dtype: returns (output, lse); lse is not differentiable."""
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, causal, sm_scale):
        return flash_attention_fwd(q, k, v, causal, sm_scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, causal, sm_scale = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out if offsets_fit_in_32_bits(grad_out) else grad_out.contiguous()
        dq, dk, dv = apply(FlashAttentionBackward, q, k, v, out, lse, grad_out, ctx.causal, ctx.sm_scale)
        return dq, dk, dv, None, None


class FlashAttentionBackward(torch.autograd.Function):
    """The backward op as a Function whose own backward refuses: flash_attention is differentiable once.
    (torch.func.grad runs every backward with create_graph=True, so the op needs a Function around it.)"""
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, out, lse, grad_out, causal, sm_scale):
        return flash_attention_bwd(q, k, v, out, lse, grad_out, causal, sm_scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad_dq, grad_dk, grad_dv):
        raise RuntimeError("flash_attention is differentiable once: its backward has no backward (no double "
                           "backward, no Hessian)")


OFFSET_LIMIT = 2**31  # the kernels widen batch and head offsets to 64 bits; the offsets inside a head stay 32-bit


def offsets_fit_in_32_bits(tensor) -> bool:
    """Whether every element of every (batch, head) of `tensor` (batch, heads, L, head_dim) lies less than
    OFFSET_LIMIT elements from the head's first: the kernels compute position * stride + dim * stride in int32."""
    length, head_dim = tensor.shape[2:]
    return (length - 1) * abs(tensor.stride(2)) + (head_dim - 1) * abs(tensor.stride(3)) < OFFSET_LIMIT


def _check_attention_inputs(q, k, v, causal, sm_scale):
    """Raise TypeError / ValueError naming the argument at fault."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, tensor)
        if tensor.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, heads, L, head_dim), got shape {tuple(tensor.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)} (batch, kv_heads, Lk, head_dim): one number "
                         f"of heads and one length Lk, got {tuple(v.shape)}")
    (batch, heads, _, head_dim), kv_heads = q.shape, k.shape[1]
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k and v must have q's batch ({batch}, dim 0) and head_dim ({head_dim}, dim 3), got "
                         f"shape {tuple(k.shape)}")
    if heads % kv_heads if kv_heads else heads:
        raise ValueError(f"k's and v's heads (dim 1) must divide q's heads {heads} (grouped-query attention: "
                         f"heads / kv_heads query heads share a kv head), got {kv_heads}")
    if head_dim % 16 or not 16 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim (the last dim of q, k, v) must be a multiple of 16 from 16 to {MAX_HEAD_DIM}, "
                         f"got {head_dim}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float))):
        raise TypeError(f"sm_scale must be None or a real number, got {type(sm_scale).__name__}")
    check_same_device(q=q, k=k, v=v)
    for name, tensor in (("q", q), ("k", k)):
        if tensor.shape[2] * tensor.shape[3] >= OFFSET_LIMIT:
            raise ValueError(f"{name}'s L x head_dim must be below 2^31 (the kernels' offsets inside a head are "
                             f"32-bit), got {tensor.shape[2]} x {tensor.shape[3]}")


def flash_attention(q, k, v, causal=False, sm_scale=None):
    """softmax(q k^T * sm_scale, causal mask) v, the Lq x Lk matrix never stored; differentiable in q, k, v.

    q: (batch, heads, Lq, head_dim); k, v: (batch, kv_heads, Lk, head_dim), of one float dtype, at any strides:
    the kernels read them in place, so the (batch, heads, L, head_dim) view of a (batch, L, heads, head_dim)
    tensor (x.transpose(1, 2)) is not copied. head_dim: a multiple of 16 from 16 to 256. kv_heads must divide
    heads: query head h reads kv head h // (heads // kv_heads) (grouped-query attention; kv_heads 1 is multi-query
    attention), as F.scaled_dot_product_attention(..., enable_gqa=True). causal: query i sees the keys
    j <= i + Lk - Lq, the diagonal aligned bottom-right as in flash-attn and
    torch.nn.attention.bias.causal_lower_right (not SDPA's is_causal=True, which is aligned top-left; the two
    agree when Lq == Lk); a query that sees no key (i < Lq - Lk) gets the output 0 and zero gradients.
    sm_scale: the scale of the scores, None for 1 / sqrt(head_dim).

    Returns the output (batch, heads, Lq, head_dim) in the input dtype, with q's strides where q is dense
    (torch.empty_like: a (batch, L, heads, head_dim) layout stays one), computed in float32 (float64 for
    float64). Differentiable once (no double backward); works under torch.func (grad, vmap), and torch.compile
    sees the kernels as the custom ops scan_lib::flash_attention_fwd / flash_attention_bwd.
    """
    _check_attention_inputs(q, k, v, causal, sm_scale)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    # A view whose heads span 2^31 elements or more (the (batch, L, heads, head_dim) layout at L x heads x head_dim
    # >= 2^31) would overflow the kernels' 32-bit offsets inside a head: it is copied, contiguous, instead.
    q, k, v = (t if offsets_fit_in_32_bits(t) else t.contiguous() for t in (q, k, v))
    out, _ = apply(FlashAttentionFunction, q, k, v, causal, scale)
    return out

# %% [markdown]
# The public function end to end: output and every gradient against the reference, on non-contiguous
# inputs (the (batch, heads, L, head_dim) views of (batch, L, heads, head_dim) tensors that a model's
# projections give, which the kernels read in place: no copy); on a GPU also against
# `F.scaled_dot_product_attention` in bfloat16, with the bfloat16 tolerance because both round to
# bfloat16. (One exception to reading in place: the offsets inside a head are 32-bit, so a view whose heads
# span $2^{31}$ elements or more, L $\times$ heads $\times$ head_dim $\ge 2^{31}$ in the (batch, L, heads,
# head_dim) layout, is copied to a contiguous tensor first.)

# %%
def attention_inputs(batch, heads, length, head_dim, dtype, seed):
    """q, k, v as (batch, heads, L, head_dim) views of (batch, L, heads, head_dim) tensors (not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, length, heads, head_dim, generator=gen).to(DEVICE, dtype).transpose(1, 2)
            for _ in range(3)]


print(f"{'L':>5} {'causal':>6} {'out err':>9} {'dq err':>9} {'dk err':>9} {'dv err':>9}")
for length in (1, 33, 129):
    for causal in (False, True):
        q_p, k_p, v_p = [t.requires_grad_() for t in attention_inputs(2, 2, length, 32, torch.float32, seed=length)]
        grad_p = torch.randn(2, 2, length, 32, device=DEVICE)
        out_p = flash_attention(q_p, k_p, v_p, causal=causal)
        got = [out_p, *torch.autograd.grad(out_p, (q_p, k_p, v_p), grad_p)]
        leaves = [t.detach().double().requires_grad_() for t in (q_p, k_p, v_p)]
        want_out = attention_reference(*leaves, causal)[0]
        want = [want_out, *torch.autograd.grad(want_out, leaves, grad_p.double())]
        errors = [(g.double() - w).abs().max().item() for g, w in zip(got, want)]
        print(f"{length:5} {str(causal):>6} " + " ".join(f"{e:9.1e}" for e in errors))
        assert (length == 1 or not q_p.is_contiguous()) and max(errors) < GRAD_TOLERANCE[torch.float32]

if ON_GPU:
    for length, causal in ((1000, False), (4097, True)):
        q_s, k_s, v_s = [t.requires_grad_() for t in attention_inputs(2, 8, length, 128, torch.bfloat16, seed=7)]
        grad_s = torch.randn(2, 8, length, 128, device=DEVICE, dtype=torch.bfloat16)
        ours = flash_attention(q_s, k_s, v_s, causal=causal)
        theirs = F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=causal)
        pairs = zip([ours, *torch.autograd.grad(ours, (q_s, k_s, v_s), grad_s)],
                    [theirs, *torch.autograd.grad(theirs, (q_s, k_s, v_s), grad_s)])
        errors = [(a.double() - b.double()).abs().max().item() for a, b in pairs]
        print(f"vs F.scaled_dot_product_attention, bfloat16, L {length}, causal {causal}: max abs diff "
              f"out, dq, dk, dv = " + ", ".join(f"{e:.1e}" for e in errors))
        assert max(errors) < GRAD_TOLERANCE[torch.bfloat16]

# %% [markdown]
# Bad arguments raise an error that names the argument:

# %%
q_ok = torch.randn(1, 2, 5, 32, device=DEVICE)
bad_calls = [
    ("v of another length than k", ValueError, lambda: flash_attention(q_ok, q_ok, q_ok[:, :, :4])),
    ("k with 3 heads, q 2", ValueError, lambda: flash_attention(q_ok, *[torch.randn(1, 3, 5, 32, device=DEVICE)] * 2)),
    ("head_dim 40", ValueError, lambda: flash_attention(*[torch.randn(1, 2, 5, 40, device=DEVICE)] * 3)),
    ("3-dim q", ValueError, lambda: flash_attention(q_ok[0], q_ok[0], q_ok[0])),
    ("integer v", TypeError, lambda: flash_attention(q_ok, q_ok, q_ok.long())),
    ("float16 k, float32 q", TypeError, lambda: flash_attention(q_ok, q_ok.half(), q_ok)),
    ("causal=1", TypeError, lambda: flash_attention(q_ok, q_ok, q_ok, causal=1)),
]
for what, error, call in bad_calls:
    try:
        call()
    except error as exc:
        print(f"{what:26} -> {error.__name__}: {exc}")
    else:
        raise AssertionError(f"{what}: no {error.__name__}")

# %% [markdown]
# `torch.compile` sees the two ops and their fake implementations, so a model that calls
# `flash_attention` compiles in one graph, backward included:

# %%
q_c, k_c, v_c = [t.requires_grad_() for t in attention_inputs(1, 2, 40, 64, torch.float32, seed=8)]
compiled = torch.compile(lambda q, k, v: flash_attention(2 * q, k, v, causal=True).sum(-1),
                         fullgraph=True, backend="aot_eager")
grads_compiled = torch.autograd.grad(compiled(q_c, k_c, v_c).sum(), (q_c, k_c, v_c))
grads_eager = torch.autograd.grad(flash_attention(2 * q_c, k_c, v_c, causal=True).sum(-1).sum(), (q_c, k_c, v_c))
for got, want in zip(grads_compiled, grads_eager):
    torch.testing.assert_close(got, want)
print("torch.compile(fullgraph=True): the same gradients as eager: ok")

# %% [markdown]
# ## Going deeper: why the merge is associative
#
# Map a state to $\varphi(m, \ell, o) = (m,\ e^{m}\ell,\ e^{m} o)$; for a set of keys this is
# $(\max_J s_j,\ \sum_J e^{s_j},\ \sum_J e^{s_j} v_j)$. $\varphi$ is one-to-one on states with a finite
# $m$ (divide by $e^m$ to go back), and it turns the merge into three familiar operations:
#
# $$\varphi(x \oplus y) = \big(\max(m_x, m_y),\ e^{m}(e^{m_x - m}\ell_x + e^{m_y - m}\ell_y),\ \dots\big)
# = \big(\max(m_x, m_y),\ e^{m_x}\ell_x + e^{m_y}\ell_y,\ e^{m_x}o_x + e^{m_y}o_y\big)
# = \varphi(x) \boxplus \varphi(y),$$
#
# where $\boxplus$ is (max, +, +) componentwise. Max and + are associative and commutative, so
# $\varphi\big((x \oplus y) \oplus z\big) = (\varphi(x) \boxplus \varphi(y)) \boxplus \varphi(z) =
# \varphi(x) \boxplus (\varphi(y) \boxplus \varphi(z)) = \varphi\big(x \oplus (y \oplus z)\big)$, and
# since $\varphi$ is one-to-one, $(x \oplus y) \oplus z = x \oplus (y \oplus z)$; likewise
# $x \oplus y = y \oplus x$. (With the identity involved the equalities hold by its definition.) The
# rescaling by $e^{-m}$ changes how the numbers are stored, not what they mean: it is there only so
# that they fit in floating point.

# %% [markdown]
# **The check.** Cut the keys of random scores (spread wide, so that the maxima differ) into random
# pieces, merge their states in four orders and groupings with section 2's `merge_states`, and compare
# each with the state of all keys and with the reference's output and log-sum-exp.

# %%
def identity_state(queries, head_dim):
    """The state of no keys: (-inf, 0, 0) for `queries` queries, float64."""
    m = torch.full((queries,), float("-inf"), dtype=torch.float64)
    return m, torch.zeros(queries, dtype=torch.float64), torch.zeros(queries, head_dim, dtype=torch.float64)


def random_cuts(length, pieces, rng):
    """`pieces` - 1 distinct cut points in (0, length): contiguous pieces [0, c1), [c1, c2), ..."""
    return [0, *sorted(rng.sample(range(1, length), pieces - 1)), length]


def merge_in_random_tree(states, rng):
    """Merge a list of states by repeatedly merging a random adjacent pair."""
    states = list(states)
    while len(states) > 1:
        i = rng.randrange(len(states) - 1)
        states[i:i + 2] = [merge_states(states[i], states[i + 1])]
    return states[0]


torch.manual_seed(1)
rng = random.Random(1)
queries, keys, head_dim = 6, 97, 32
scores = 20 * torch.randn(queries, keys, dtype=torch.float64)
values = torch.randn(keys, head_dim, dtype=torch.float64)
whole = softmax_state(scores, values)
cuts = random_cuts(keys, 9, rng)
pieces = [softmax_state(scores[:, a:b], values[a:b]) for a, b in zip(cuts, cuts[1:])]
empty = identity_state(queries, head_dim)
shuffled = rng.sample(pieces, len(pieces))
left = pieces[0]
for piece in pieces[1:]:
    left = merge_states(left, piece)
right = pieces[-1]
for piece in reversed(pieces[:-1]):
    right = merge_states(piece, right)
shuffled_left = empty
for piece in shuffled:
    shuffled_left = merge_states(shuffled_left, piece)
results = {"left to right": left, "right to left": right, "random tree": merge_in_random_tree(pieces, rng),
           "shuffled, from the identity": shuffled_left}
attention_out, attention_lse = attention_reference(scores[None], torch.eye(keys, dtype=torch.float64)[None],
                                                   values[None], sm_scale=1.0)
print(f"pieces: {[b - a for a, b in zip(cuts, cuts[1:])]}")
print(f"{'grouping':28} {'state err':>10} {'output err':>11} {'lse err':>9}")
for name, (m, l, o) in results.items():
    state_err = max((x - w).abs().max().item() for x, w in zip((m, l, o), whole))
    out_err = (o / l[:, None] - attention_out[0]).abs().max().item()
    lse_err = (m + l.log() - attention_lse[0]).abs().max().item()
    print(f"{name:28} {state_err:10.1e} {out_err:11.1e} {lse_err:9.1e}")
    assert state_err < 1e-12 and out_err < 1e-12 and lse_err < 1e-12

empty_merged = merge_states(empty, left)
assert all(torch.equal(x, y) for x, y in zip(empty_merged, left))
print("the identity (-inf, 0, 0) merged with a state leaves it unchanged: ok")

# %% [markdown]
# ## Going deeper: the merge in `tl.associative_scan`
#
# Because the merge is associative, Triton's `tl.associative_scan` can scan states, as chapter 02
# scanned pairs. The kernel below takes one query per program and all keys in one block. Key $j$
# alone has the state $(s_j, 1, v_j)$, the padding past $L$ the identity; the scan's element $j$ is the
# state of keys $0..j$, so $o/\ell$ there is the attention over the first $j+1$ keys. ($m$ and $\ell$
# are repeated along the head dim: a scanned tuple's members must have one shape.)

# %%
@triton.jit
def softmax_merge(m_x, l_x, o_x, m_y, l_y, o_y):
    """The merge of two states (m, l, o) of disjoint sets of keys, on blocks of one shape; identity (-inf, 0, 0)."""
    m = tl.maximum(m_x, m_y)
    scale_x = tl.where(m_x == m, 1.0, tl.exp(m_x - m))  # e^(-inf - (-inf)) would be NaN: the identity gets 1
    scale_y = tl.where(m_y == m, 1.0, tl.exp(m_y - m))
    return m, scale_x * l_x + scale_y * l_y, scale_x * o_x + scale_y * o_y


@triton.jit
def prefix_attention_kernel(Q, K, V, O, length, sm_scale, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    # Q: queries x HEAD_DIM; K, V: length x HEAD_DIM; O: queries x length x HEAD_DIM, all float32.
    # One program per query; BLOCK >= length. O[i, j] = attention of query i over keys 0..j.
    query = tl.program_id(0)
    keys = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    inside = keys[:, None] < length  # BLOCK x 1
    q = tl.load(Q + query * HEAD_DIM + dims)  # HEAD_DIM
    k = tl.load(K + keys[:, None] * HEAD_DIM + dims[None, :], mask=inside, other=0.0)  # BLOCK x HEAD_DIM
    v = tl.load(V + keys[:, None] * HEAD_DIM + dims[None, :], mask=inside, other=0.0)  # BLOCK x HEAD_DIM
    s = tl.sum(k * q[None, :], 1) * sm_scale  # BLOCK scores
    m = tl.where(inside, s[:, None], float("-inf")) + tl.zeros_like(v)  # key j's state (s_j, 1, v_j),
    l = tl.where(inside, 1.0, 0.0) + tl.zeros_like(v)  # the identity (-inf, 0, 0) in the padding
    m, l, o = tl.associative_scan((m, l, v), 0, softmax_merge)
    l = tl.where(inside, l, 1.0)  # the padding's l is 0: divide by 1 there (the store skips it)
    tl.store(O + (query * length + keys[:, None]) * HEAD_DIM + dims[None, :], o / l, mask=inside)


def prefix_attention(q, k, v, sm_scale):
    """(queries, L, head_dim): attention of each query (queries, head_dim) over each prefix of k, v (L, head_dim)."""
    length, head_dim = k.shape
    out = torch.empty(q.shape[0], length, head_dim, device=q.device)
    prefix_attention_kernel[(q.shape[0],)](q, k, v, out, length, sm_scale, HEAD_DIM=head_dim,
                                           BLOCK=triton.next_power_of_2(length))
    return out


torch.manual_seed(2)
print(f"{'L':>4} {'max abs err':>12}")
for length in (1, 7, 33, 129):
    q_scan, k_scan, v_scan = torch.randn(3, length, 32, device=DEVICE)
    got = prefix_attention(q_scan[:3], k_scan, v_scan, 32**-0.5)  # 3 queries (or fewer)
    # the reference: query i repeated at every position, causal, is attention over each prefix
    want = torch.stack([attention_reference(q_i.expand(length, 32), k_scan, v_scan, causal=True)[0] for q_i in q_scan[:3]])
    err = (got.double() - want).abs().max().item()
    print(f"{length:4} {err:12.2e}")
    assert err < 1e-5

# %% [markdown]
# ## Going deeper: the forward kernel's details
#
# **Registers in the one-block kernel.** In `attention_one_block_kernel` the $L \times L$ block
# of scores lives in registers: at $L = 128$ that is 16384 floats, 64 per thread of the 8 warps
# launched, beside $q$, $k$ and $v$. At `BLOCK` 256 it would be 256 per thread, more than a thread's 255
# registers, and the compiler would spill them to memory.
#
# **exp2.** $e^x = 2^{x \log_2 e}$, and the GPU's exponential unit computes powers of 2, which is why
# `tl.exp2` saves a multiply per score. The stored log-sum-exp is converted back to natural units.
#
# **The masked pass** covers the last, partial key block and, when causal, the blocks on the diagonal.
# Skipping the blocks above the diagonal saves half the work of a causal call.
#
# **The longest programs first.** A causal program's work grows with the position of its queries, so
# the grid hands out the query blocks from last to first; the long programs start first and the short
# ones fill the end of the run instead of leaving a tail of long ones.
#
# **Precision.** Rounding $p$ to the input's dtype before its product is what every FlashAttention
# does. With float32 products at `input_precision="ieee"`, not TF32, a float32 call is as accurate as a
# float32 matrix product. The scale `qk_scale` is annotated `tl.float64`: Triton passes a Python float as
# float32 unless told otherwise, and float64 keeps every digit of the scale for float64 inputs. The kernel
# converts it to the accumulator's dtype `ACC` with `tl.full`, not `.to`, because under the interpreter it
# arrives as a Python float.
#
# **The interpreter and bfloat16.** Triton 3.6's CPU interpreter multiplies bfloat16 blocks in `tl.dot`
# as their raw 16-bit integers, a bug; under the interpreter `matmul` converts bfloat16 to float32
# first, which is exact and gives the same sums as the tensor cores (which multiply bfloat16 exactly
# and add in float32). The interpreter also converts float32 to bfloat16 (`.to`, for $p$ and the stored
# output, and in the backward for $dS$ and the gradients) by truncating, an error of up to a whole unit
# in the last place ($2^{-7}$ relative), where a GPU rounds to nearest (half a unit, $2^{-8}$): on a
# CPU the bfloat16 errors of the checks are larger than the GPU's printed in this chapter.

# %% [markdown]
# ## Going deeper: the memory, measured
#
# The arithmetic first. The table computes, for heads $\times$ head_dim $= 2048$, batch 4, in bfloat16,
# the bytes of the inputs and the output, $4 L d$ per head, and of one matrix of scores, $L^2$ per head:
# the matrix outgrows all the rest together by the factor $L / (4 d)$.

# %%
def attention_bytes(batch, heads, length, head_dim, element_size=2):
    """(bytes of q, k, v and the output; bytes of one batch x heads x L x L matrix), in one dtype."""
    return 4 * batch * heads * length * head_dim * element_size, batch * heads * length**2 * element_size


print(f"{'head_dim':>8} {'L':>6} {'q,k,v,out GiB':>14} {'one L x L GiB':>14} {'ratio':>6}")
for head_dim in (64, 128):
    for length in (1024, 4096, 16384):
        io_bytes, matrix_bytes = attention_bytes(4, 2048 // head_dim, length, head_dim)
        print(f"{head_dim:8} {length:6} {io_bytes / 2**30:14.3f} {matrix_bytes / 2**30:14.2f} "
              f"{matrix_bytes / io_bytes:6.0f}")
        assert matrix_bytes / io_bytes == length / (4 * head_dim)

# %% [markdown]
# (On a GPU.) The next cell measures the peak memory, above the inputs, of the plain computation in
# bfloat16 and of our forward kernel, at batch 4, 16 heads of dim 128. The plain one needs at least one
# $L \times L$ matrix (the printed peak shows how many it holds at once), the kernel only its output and
# the log-sum-exp.

# %%
if not ON_GPU:
    print("skipped: needs a GPU")
else:
    def peak_extra_bytes(fn):
        """Peak memory allocated while fn() runs, above what was allocated before, in bytes."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()  # the peak is recorded while fn runs; its result can go at once
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    def plain_attention(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v

    print(f"{torch.cuda.get_device_name()}: batch 4, 16 heads, head_dim 128, bfloat16, forward only")
    print(f"{'L':>6} {'one L x L GiB':>14} {'plain GiB':>10} {'flash GiB':>10} {'out + lse GiB':>14}")
    for length in (1024, 2048, 4096, 8192):
        q_mem, k_mem, v_mem = torch.randn(3, 4, 16, length, 128, device=DEVICE, dtype=torch.bfloat16)
        flash_attention_forward(q_mem, k_mem, v_mem, False, 128**-0.5)  # autotune first: its timing buffers are not the kernel's
        plain = peak_extra_bytes(lambda: plain_attention(q_mem, k_mem, v_mem))
        flash = peak_extra_bytes(lambda: flash_attention_forward(q_mem, k_mem, v_mem, False, 128**-0.5))
        matrix = 4 * 16 * length**2 * 2
        needed = q_mem.numel() * 2 + 4 * 16 * length * 4  # output (bfloat16) + lse (float32)
        print(f"{length:6} {matrix / 2**30:14.2f} {plain / 2**30:10.2f} {flash / 2**30:10.3f} {needed / 2**30:14.3f}")
        assert plain >= matrix and flash <= 1.05 * needed
        del q_mem, k_mem, v_mem

# %% [markdown]
# ## Going deeper: the CUDA kernel of the source, line by line
#
# The kernel that popularised FlashAttention's forward pass as a teaching example is a short CUDA
# kernel: one CUDA block per (batch, head), one thread per score of a $B_r \times B_c$ tile. Below is
# our own version of it, with the usual listing's gaps corrected ("Going deeper: the CUDA kernel's fine
# print"). Its **outer** loop runs over key tiles and the **inner** one over query tiles, so the running
# state $(m, \ell, O)$ of every query lives in global memory, read and written once per key tile.
#
# **The header.** A template fixes the tile sizes and the head dim; `PAD` adds floats at the end of
# each tile row in shared memory (see the scores, below). $O$ is kept normalised (divided by $\ell$).

# %%
CUDA_HEADER = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cmath>

// One CUDA block per (batch, head) with BR * BC threads; thread (row, col) computes one score of a
// BR x BC tile. Rows of the tiles in shared memory are HEAD_DIM + PAD floats apart.
// Q, K, V, O: batch x heads x length x HEAD_DIM contiguous float32; ROW_MAX, ROW_SUM: batch x heads x length,
// the running m and l, initialised by the caller to -inf and 0 (and O to 0).
template <int BR, int BC, int HEAD_DIM, int PAD>
__global__ void __launch_bounds__(BR * BC) naive_flash_kernel(const float* __restrict__ Q, const float* __restrict__ K,
                                   const float* __restrict__ V, float* __restrict__ O,
                                   float* __restrict__ ROW_MAX, float* __restrict__ ROW_SUM,
                                   int length, float scale) {
    constexpr int ROW = HEAD_DIM + PAD;
    __shared__ float q_tile[BR * ROW], o_tile[BR * ROW], k_tile[BC * ROW], v_tile[BC * ROW];
    __shared__ float s_tile[BR * BC];
    __shared__ float max_old[BR], sum_old[BR], max_new[BR], sum_new[BR], max_tile[BR];

    const int tx = threadIdx.x;
    const int row = tx / BC, col = tx % BC;  // this thread's score in the tile
    const long head = (long)blockIdx.x * gridDim.y + blockIdx.y;
    const float* q = Q + head * length * HEAD_DIM;
    const float* k = K + head * length * HEAD_DIM;
    const float* v = V + head * length * HEAD_DIM;
    float* o = O + head * length * HEAD_DIM;
    float* row_max = ROW_MAX + head * length;
    float* row_sum = ROW_SUM + head * length;
"""

# %% [markdown]
# **Loading the key and value tiles.** The threads copy them cooperatively, consecutive threads taking
# consecutive elements (coalesced reads), with zeros past $L$. In Triton: one masked `tl.load`, and no
# shared memory to declare.

# %%
CUDA_LOAD_KEYS = r"""
    for (int key_start = 0; key_start < length; key_start += BC) {
        for (int e = tx; e < BC * HEAD_DIM; e += BR * BC) {  // K and V tiles, zeros past the end
            const int r = e / HEAD_DIM, c = e % HEAD_DIM, key = key_start + r;
            k_tile[r * ROW + c] = key < length ? k[(long)key * HEAD_DIM + c] : 0.f;
            v_tile[r * ROW + c] = key < length ? v[(long)key * HEAD_DIM + c] : 0.f;
        }
        __syncthreads();
"""

# %% [markdown]
# **The inner loop over query tiles.** Every query tile is reloaded for every key tile, with the rows'
# running max and sum, and so is the partial output $O$ (first weakness: $O$ makes a round trip through
# global memory per key tile).

# %%
CUDA_LOAD_QUERIES = r"""
        for (int query_start = 0; query_start < length; query_start += BR) {
            for (int e = tx; e < BR * HEAD_DIM; e += BR * BC) {  // Q and the partial O, zeros past the end
                const int r = e / HEAD_DIM, c = e % HEAD_DIM, query = query_start + r;
                q_tile[r * ROW + c] = query < length ? q[(long)query * HEAD_DIM + c] : 0.f;
                o_tile[r * ROW + c] = query < length ? o[(long)query * HEAD_DIM + c] : 0.f;
            }
            const int query = query_start + row;
            if (col == 0) {
                max_old[row] = query < length ? row_max[query] : -INFINITY;
                sum_old[row] = query < length ? row_sum[query] : 0.f;
            }
            __syncthreads();
"""

# %% [markdown]
# **The scores.** Each thread computes one dot product of length $d$ with scalar fused multiply-adds
# (second weakness: no tensor cores, where Triton's `tl.dot` uses them). The read
# `k_tile[col * ROW + c]` is the third weakness: shared memory has 32 banks, and a warp's reads of
# different addresses in one bank are served one after another (a **bank conflict**). The threads of a
# warp read it for different `col`, floats `ROW` floats apart; with `ROW` $= d$, a multiple of 32, these
# all fall in one bank. `PAD` $= 1$ puts each `col`'s float in a different bank.

# %%
CUDA_SCORES = r"""
            float score = 0.f;
            for (int c = 0; c < HEAD_DIM; ++c)
                score += q_tile[row * ROW + c] * k_tile[col * ROW + c];  // a warp reads one k_tile column
            s_tile[row * BC + col] = key_start + col < length ? score * scale : -INFINITY;
            __syncthreads();
"""

# %% [markdown]
# **The softmax, one thread per row.** The thread with `col == 0` walks its row of $B_c$ scores
# serially (max, then exponentials and sum) and merges the tile's state into the running one, while
# the other $B_c - 1$ threads of its row wait (fourth weakness). In Triton, `tl.max(s, 1)` and
# `tl.sum(p, 1)` spread these reductions over the threads.

# %%
CUDA_SOFTMAX = r"""
            if (col == 0) {  // one thread per query row, serially over the tile
                float m = -INFINITY;
                for (int j = 0; j < BC; ++j) m = fmaxf(m, s_tile[row * BC + j]);
                float sum = 0.f;
                for (int j = 0; j < BC; ++j) {
                    const float p = expf(s_tile[row * BC + j] - m);
                    s_tile[row * BC + j] = p;
                    sum += p;
                }
                max_tile[row] = m;
                max_new[row] = fmaxf(max_old[row], m);
                sum_new[row] = expf(max_old[row] - max_new[row]) * sum_old[row] + expf(m - max_new[row]) * sum;
            }
            __syncthreads();
"""

# %% [markdown]
# **The output.** Each thread computes $d / B_c$ elements of $P V$ (scalar again), rescales the old
# $O$ and the new part to the new maximum, divides by the new sum, and writes the result back to global
# memory, with $m$ and $\ell$.

# %%
CUDA_OUTPUT = r"""
            for (int c = col; c < HEAD_DIM; c += BC) {
                float pv = 0.f;
                for (int j = 0; j < BC; ++j) pv += s_tile[row * BC + j] * v_tile[j * ROW + c];
                const float updated = (sum_old[row] * expf(max_old[row] - max_new[row]) * o_tile[row * ROW + c]
                                       + expf(max_tile[row] - max_new[row]) * pv) / sum_new[row];
                if (query < length) o[(long)query * HEAD_DIM + c] = updated;  // to global memory, every key tile
            }
            if (col == 0 && query < length) {
                row_max[query] = max_new[row];
                row_sum[query] = sum_new[row];
            }
            __syncthreads();  // the next query tile overwrites the tiles
        }
    }
}
"""

# %% [markdown]
# **The launcher** allocates $O$, $m$ and $\ell$ with their initial values and launches one block per
# (batch, head). Static shared memory is limited to 48 KB per block: the cell below computes what the
# tiles take and asserts the limit.

# %%
CUDA_LAUNCHER = r"""
template <int BR, int BC, int HEAD_DIM, int PAD>
void launch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& o,
            torch::Tensor& row_max, torch::Tensor& row_sum) {
    const dim3 grid(q.size(0), q.size(1));
    naive_flash_kernel<BR, BC, HEAD_DIM, PAD><<<grid, BR * BC, 0, at::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), o.data_ptr<float>(),
        row_max.data_ptr<float>(), row_sum.data_ptr<float>(), (int)q.size(2), 1.0f / sqrtf((float)q.size(3)));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

torch::Tensor naive_flash_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool pad) {
    TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "q, k, v must be CUDA tensors");
    TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                v.scalar_type() == torch::kFloat32, "q, k, v must be float32");
    TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
                "q, k, v must have one shape (batch, heads, L, head_dim)");
    q = q.contiguous();
    k = k.contiguous();
    v = v.contiguous();
    auto o = torch::zeros_like(q);
    auto row_max = torch::full({q.size(0), q.size(1), q.size(2)}, -INFINITY, q.options());
    auto row_sum = torch::zeros({q.size(0), q.size(1), q.size(2)}, q.options());
    if (q.size(3) == 64 && !pad) launch<32, 32, 64, 0>(q, k, v, o, row_max, row_sum);
    else if (q.size(3) == 64) launch<32, 32, 64, 1>(q, k, v, o, row_max, row_sum);
    else if (q.size(3) == 128 && !pad) launch<16, 16, 128, 0>(q, k, v, o, row_max, row_sum);
    else if (q.size(3) == 128) launch<16, 16, 128, 1>(q, k, v, o, row_max, row_sum);
    else TORCH_CHECK(false, "head_dim must be 64 or 128, got ", q.size(3));
    return o;
}
"""
CUDA_SOURCE = CUDA_HEADER + CUDA_LOAD_KEYS + CUDA_LOAD_QUERIES + CUDA_SCORES + CUDA_SOFTMAX + CUDA_OUTPUT + CUDA_LAUNCHER


def naive_shared_bytes(block_rows, block_cols, head_dim, pad):
    """Static shared memory of naive_flash_kernel: four tiles of rows (HEAD_DIM + PAD), the scores, five row arrays."""
    return 4 * (2 * block_rows * (head_dim + pad) + 2 * block_cols * (head_dim + pad) + block_rows * block_cols
                + 5 * block_rows)


for tiles in ((32, 32, 64), (16, 16, 128)):
    for pad in (0, 1):
        used = naive_shared_bytes(*tiles, pad)
        print(f"BR, BC, head_dim = {tiles}, PAD {pad}: {used} bytes of static shared memory, {tiles[0] * tiles[1]} threads")
        assert used <= 48 * 1024 and tiles[0] * tiles[1] <= 1024

# %% [markdown]
# **Predictions**, each measured by the next cell on a GPU, at batch 4, heads $\times$ head_dim $= 2048$,
# $L = 2048$, float32 (the kernel reads float32 only):
#
# 1. *The serial softmax, the round trips of $O$ and a small grid*: the naive kernel is more than 10
#    times slower than our Triton forward on the same float32 inputs (which, with
#    `input_precision="ieee"`, does not use the tensor cores either).
# 2. *No tensor cores*: our Triton forward in bfloat16 is more than twice as fast as in float32.
# 3. *$O$ through global memory*: the cell prints the time that reading and writing $O$ once per key
#    tile takes at the copy bandwidth, as a share of the kernel's time.
# 4. *Bank conflicts*: `PAD = 1` makes the kernel faster.
# 5. *Parallelism* (a count, not a timing): batch $\times$ heads blocks are fewer than twice the GPU's
#    multiprocessors.

# %%
if not ON_GPU:
    print("skipped: needs a GPU (CUDA's compiler nvcc and a device to run the compiled kernel)")
else:
    from torch.utils.cpp_extension import load_inline

    from scan_lib.runtime import copy_bandwidth, median_us

    naive = load_inline("naive_flash_attention", cpp_sources="torch::Tensor naive_flash_forward(torch::Tensor q, "
                        "torch::Tensor k, torch::Tensor v, bool pad);", cuda_sources=CUDA_SOURCE,
                        functions=["naive_flash_forward"], extra_cuda_cflags=["-O3"])
    torch.manual_seed(9)
    for length in (1, 7, 33, 129, 1000):  # correctness first, at awkward lengths
        for head_dim in (64, 128):
            q_n, k_n, v_n = torch.randn(3, 2, 3, length, head_dim, device=DEVICE)
            want_n = attention_reference(q_n, k_n, v_n)[0]
            for pad in (False, True):
                err = (naive.naive_flash_forward(q_n, k_n, v_n, pad).double() - want_n).abs().max().item()
                assert err < 1e-5, (length, head_dim, pad, err)
    print("naive CUDA kernel == reference at L 1, 7, 33, 129, 1000, head_dim 64 and 128, PAD 0 and 1: ok")

    bandwidth = copy_bandwidth()
    processors = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: {processors} multiprocessors, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'head_dim':>8} {'naive us':>10} {'naive PAD 1 us':>15} {'Triton fp32 us':>15} {'Triton bf16 us':>15} "
          f"{'naive/Triton':>13} {'O traffic share':>16} {'blocks':>7}")
    for head_dim, block_cols in ((64, 32), (128, 16)):
        heads, length = 2048 // head_dim, 2048
        q_n, k_n, v_n = torch.randn(3, 4, heads, length, head_dim, device=DEVICE)
        q_h, k_h, v_h = (t.to(torch.bfloat16) for t in (q_n, k_n, v_n))
        naive_us = median_us(lambda: naive.naive_flash_forward(q_n, k_n, v_n, False))
        padded_us = median_us(lambda: naive.naive_flash_forward(q_n, k_n, v_n, True))
        triton_us = median_us(lambda: flash_attention_forward(q_n, k_n, v_n, False, head_dim**-0.5))
        triton_bf16_us = median_us(lambda: flash_attention_forward(q_h, k_h, v_h, False, head_dim**-0.5))
        o_bytes = 2 * q_n.numel() * 4 * (length // block_cols)  # O read and written once per key tile
        o_share = o_bytes / bandwidth * 1e6 / naive_us
        print(f"{head_dim:8} {naive_us:10.0f} {padded_us:15.0f} {triton_us:15.0f} {triton_bf16_us:15.0f} "
              f"{naive_us / triton_us:13.1f} {o_share:16.2f} {4 * heads:7}")
        print(f"  prediction 1 (naive > 10x Triton fp32): {naive_us > 10 * triton_us}; "
              f"2 (Triton bf16 > 2x Triton fp32): {triton_us > 2 * triton_bf16_us}; "
              f"3: O traffic {o_share:.0%} of the naive time; "
              f"4 (PAD 1 faster): {padded_us < naive_us} ({naive_us / padded_us:.2f}x); "
              f"5 (blocks {4 * heads} < 2 x {processors} multiprocessors): {4 * heads < 2 * processors}")

# %% [markdown]
# The cell prints each prediction's outcome; those lines, not this text, judge them. In the run
# recorded here, on an NVIDIA H100 80GB HBM3, prediction 1 failed (5.2 and 8.9 times slower, not more
# than 10), and prediction 3 shows that the round trips of $O$ are not the naive kernel's problem: their
# bytes would take 5% (head dim 64) and 4% (head dim 128) of its time. The other three held. What remains to
# explain its time is the serial softmax, the scalar products, the bank conflicts and the small grid;
# the cell does not split the time between them.

# %% [markdown]
# ## Going deeper: the CUDA kernel's fine print
#
# **The loop order**, key tiles outside and query tiles inside, is the first FlashAttention's. Our
# kernel keeps $O$ normalised at every step, as the listing does.
#
# **Where our version corrects the usual listing.**
#
# - `__launch_bounds__(BR * BC)` is not in the listing and is needed: it tells the compiler how many
#   threads a block will have. A multiprocessor has 65536 registers, so a block of $32 \times 32 = 1024$
#   threads may use at most 64 per thread. Left alone, the compiler may use more for this kernel, and
#   then every launch fails with "too many resources requested for launch".
# - The listing's loop count for loading the key and value tiles, $\lceil d / B_r \rceil$ steps of
#   $B_r B_c$ elements, covers a $B_c \times d$ tile only because it has $B_r B_c$ threads; our loop
#   says what it covers. The listing also leaves stale data in the rows past $L$; here they are zeros
#   (a NaN left in shared memory would survive a multiplication by a zero weight).
# - The listing reads the running max and sum past the end of the arrays for rows beyond $L$; here
#   those rows get the identity $(-\infty, 0)$.
# - The listing forgets to give keys past $L$ the score $-\infty$.
# - The last barrier keeps the next query tile from overwriting the tiles while slower threads still
#   read them (the listing has none there).
# - The listing leaves the allocation of $O$, $m$ and $\ell$ with their initial values to the reader.
#
# **In Triton** all of the header is `tl.program_id`, `tl.arange` and pointer arithmetic on blocks;
# shared memory is not declared at all: the compiler decides what is staged where.
#
# **The bank conflicts, counted.** Shared memory has 32 banks of 4 bytes, and the float at index $x$
# sits in bank $x \bmod 32$; threads reading the same address share one read. Thread `tx` has
# `col = tx % BC`, so with $B_c = 32$ (the launch for $d = 64$) the 32 threads of a warp have `col` 0 to
# 31 and read 32 floats `ROW` floats apart; with `ROW` $= d$ all 32 fall in one bank: a 32-way conflict.
# With $B_c = 16$ (the launch for $d = 128$) a
# warp spans two rows of the tile, `col` runs 0 to 15 twice, and the two rows read the same 16 floats:
# 16 addresses in one bank, a 16-way conflict. (`q_tile[row * ROW + c]` is one address for the whole
# warp when $B_c = 32$, a broadcast, which costs nothing; with $B_c = 16$ it is two addresses `ROW`
# floats apart, in one bank without the padding: a 2-way conflict.) With `PAD` $= 1$, `ROW` $= d + 1$
# puts `col`'s float in bank $(\text{col} + c) \bmod 32$, a different bank for each `col`.
#
# **Shared memory.** With $B_r = B_c = 32$ and $d = 64$ the five tiles take
# $4 \cdot 32 \cdot 65 + 32 \cdot 32$ floats plus five rows of 32, 38016 bytes with `PAD` $= 1$ (37504
# without); $d = 128$ needs $B_r = B_c = 16$ (34368 and 34112 bytes), as the launcher's cell prints.
#
# **The predictions in full.** Prediction 3 counts that the kernel reads and writes $O$ once per key
# tile, $L / B_c$ times. Prediction 5 compares the number of blocks with the number of multiprocessors:
# batch $\times$ heads blocks fewer than twice the GPU's multiprocessors means the GPU runs at most two
# partly filled waves (our Triton grid has $L / $ `BLOCK_M` times more programs).
#
# **The measurements in detail.** In the recorded run, bfloat16 took our forward from 11683 to 334 us
# at head dim 64 and from 14623 to 314 us at 128, far more than twice as fast; `PAD = 1` made the naive
# kernel 1.83 and 1.72 times faster. Its 128 and 64 blocks are fewer than twice the 132 multiprocessors
# (prediction 5), fewer even than once, so at least 132 - 128 = 4 and 132 - 64 = 68 multiprocessors get
# no block at all.

# %% [markdown]
# ## Going deeper: the benchmark
#
# Section 7's measurements in full: the cell, the recorded run's numbers, the host's share at
# $L = 1024$, and what may lie behind the gap to cuDNN. The benchmark: bfloat16, batch 4, heads
# $\times$ head_dim $= 2048$, $L$ from 1024 to 16384, causal and not, forward and forward + backward,
# in TFLOP/s. The peers are
# `F.scaled_dot_product_attention` pinned with `torch.nn.attention.sdpa_kernel` to `FLASH_ATTENTION`
# (PyTorch's FlashAttention-2 kernels, written for the A100's generation: the lower bar on this run's
# H100) and to `CUDNN_ATTENTION` (NVIDIA's cuDNN: the bar for a Hopper kernel). Every provider's output
# is first compared with ours.

# %%
if not ON_GPU:
    print("skipped: needs a GPU")
else:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from scan_lib.runtime import graph_us, host_us, median_us

    def sdpa_with(backend):
        def attention(q, k, v, causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return attention

    providers = {"ours (Triton)": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal),
                 "SDPA flash": sdpa_with(SDPBackend.FLASH_ATTENTION),
                 "SDPA cuDNN": sdpa_with(SDPBackend.CUDNN_ATTENTION)}
    bench_lengths = (1024, 4096, 16384)
    tflops = {}  # (head_dim, causal, "fwd" or "fwd+bwd", provider) -> {L: TFLOP/s}
    for head_dim in (64, 128):
        heads = 2048 // head_dim
        for causal in (False, True):
            for length in bench_lengths:
                torch.manual_seed(10)
                q_t, k_t, v_t = [torch.randn(4, heads, length, head_dim, device=DEVICE, dtype=torch.bfloat16,
                                             requires_grad=True) for _ in range(3)]
                grad_t = torch.randn_like(q_t)
                forward_flops = 4 * 4 * heads * length**2 * head_dim / (2 if causal else 1)
                ours_out = flash_attention(q_t, k_t, v_t, causal=causal).detach()
                for name, attention in providers.items():
                    try:
                        out_t = attention(q_t, k_t, v_t, causal).detach()
                    except RuntimeError as exc:
                        print(f"skipped {name}, head_dim {head_dim}, causal {causal}, L {length}: "
                              f"{str(exc).splitlines()[0]}")
                        continue
                    assert (out_t.float() - ours_out.float()).abs().max().item() < GRAD_TOLERANCE[torch.bfloat16]
                    forward_us = median_us(lambda: attention(q_t, k_t, v_t, causal))
                    both_us = median_us(lambda: torch.autograd.grad(attention(q_t, k_t, v_t, causal), (q_t, k_t, v_t), grad_t))
                    tflops.setdefault((head_dim, causal, "fwd", name), {})[length] = forward_flops / forward_us / 1e6
                    tflops.setdefault((head_dim, causal, "fwd+bwd", name), {})[length] = 3.5 * forward_flops / both_us / 1e6
                del q_t, k_t, v_t, grad_t, ours_out

    print(f"{torch.cuda.get_device_name()}, bfloat16, batch 4, heads x head_dim = 2048: TFLOP/s")
    print(f"{'d':>4} {'causal':>6} {'pass':>8} {'provider':>14} " + " ".join(f"{length:>7}" for length in bench_lengths))
    for (head_dim, causal, mode, name), row in tflops.items():
        print(f"{head_dim:4} {str(causal):>6} {mode:>8} {name:>14} "
              + " ".join(f"{row[length]:7.0f}" if length in row else f"{'-':>7}" for length in bench_lengths))
    rows_compared = [(key, row) for key, row in tflops.items() if key[3] == "SDPA flash"]
    behind = [(key[:3], length) for key, row in rows_compared for length, value in row.items()
              if tflops[(*key[:3], "ours (Triton)")][length] < value]
    print(f"ours >= SDPA flash in every row and length: {not behind}" + (f"; behind at {behind}" if behind else ""))
    for key in sorted({key[:3] for key in tflops}):
        if (*key, "SDPA cuDNN") in tflops:
            ours_row, cudnn_row = tflops[(*key, "ours (Triton)")], tflops[(*key, "SDPA cuDNN")]
            ratios = [ours_row[length] / cudnn_row[length] for length in bench_lengths if length in cudnn_row]
            print(f"head_dim {key[0]}, causal {key[1]}, {key[2]}: ours / cuDNN from {min(ratios):.2f} to {max(ratios):.2f}")

    # L = 1024, head_dim 64, not causal: the host's time per call (launches queued back to back) and the
    # GPU's (the same work replayed from a CUDA graph, no host in between), for ours and the flash backend
    torch.manual_seed(10)
    q_t, k_t, v_t = [torch.randn(4, 32, 1024, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
                     for _ in range(3)]
    grad_t = torch.randn_like(q_t)
    print("L 1024, head_dim 64, not causal, us per call: host / GPU (CUDA graph)")
    for name in ("ours (Triton)", "SDPA flash"):
        attention = providers[name]
        forward = lambda: attention(q_t, k_t, v_t, False)
        both = lambda: torch.autograd.grad(attention(q_t, k_t, v_t, False), (q_t, k_t, v_t), grad_t)
        print(f"{name:>14}: forward {host_us(forward):7.1f} / {graph_us(forward):7.1f}, "
              f"forward+backward {host_us(both):7.1f} / {graph_us(both):7.1f}")
    del q_t, k_t, v_t, grad_t

    # NVIDIA's datasheets: dense bfloat16 tensor-core peak of the SXM parts, TFLOP/s (no sparsity)
    DENSE_BF16_PEAK = {"H100 80GB HBM3": 989, "H200": 989}
    peak = next((value for part, value in DENSE_BF16_PEAK.items() if part in torch.cuda.get_device_name()), None)
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharex=True, sharey=True)
    for r, head_dim in enumerate((64, 128)):
        for c, (mode, causal) in enumerate([("fwd", False), ("fwd", True), ("fwd+bwd", False), ("fwd+bwd", True)]):
            ax = axes[r, c]
            for name in providers:
                row = tflops.get((head_dim, causal, mode, name), {})
                ax.plot(list(row), list(row.values()), marker="o", linestyle="none", label=name)  # measured points only
            if peak is not None:
                ax.axhline(peak, color="gray", linestyle=":", linewidth=1, label=f"dense bf16 peak ({peak})")
            ax.set_xscale("log", base=2)
            ax.set_title(f"d {head_dim}, {'causal' if causal else 'not causal'}, {mode}", fontsize=9)
            ax.set_ylim(bottom=0)
            if c == 0:
                ax.set_ylabel("TFLOP/s")
            if r == 1:
                ax.set_xlabel("L")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"attention, bfloat16, batch 4, heads x head_dim = 2048, on {torch.cuda.get_device_name()}")
    save_figure(fig, "flash_attention_benchmark.png")

# %% [markdown]
# In the run recorded here, on an NVIDIA H100 80GB HBM3, ours is at least as fast as the flash backend
# in every row at $L$ = 4096 and 16384, and behind it at $L = 1024$ in five rows of eight (the cell
# lists them): forward + backward at both head dims, causal or not, and the causal forward at head
# dim 64. The cell's $L = 1024$ lines (head dim 64, not causal) show our host time per call above our
# GPU time in both passes: 104.2 against 94.0 us in the forward, 739.1 against 376.6 us in forward +
# backward. Our GPU time is shorter than the flash backend's (123.3 and 548.0 us), whose host time
# (45.5 and 226.5 us) stays below its GPU time. Ours is behind cuDNN in every row (ours / cuDNN from
# 0.35 to 0.97). The fine print below discusses the host's share and the gap to cuDNN.
#
# **The shapes.** heads $\times$ head_dim $= 2048$ is 32 heads of 64 or 16 of 128. A backend that
# refuses a shape is reported and skipped.
#
# **The flop count.** The flop counts are the matrix products' ($2 \cdot 2 \cdot$ batch $\cdot$ heads
# $\cdot L^2 d$ for $QK^\top$ and $PV$ in the forward, half of it when causal), with the backward
# counted as 2.5 forwards, as FlashAttention's papers count (its five products against the forward's
# two); so forward + backward is 3.5 forwards. Times are `median_us` (do_bench medians); forward +
# backward times `torch.autograd.grad`.
#
# **The two peers.** FlashAttention-2 on Hopper uses neither the warpgroup matrix instructions
# (`wgmma`) nor the tensor memory accelerator (TMA), while cuDNN's Hopper kernels, like
# FlashAttention-3, are built on both.
#
# **The host at $L = 1024$.** There the GPU has little work per call. Our op is
# Python (an autograd Function around two torch custom ops, four Triton launches for forward +
# backward) where SDPA's is C++ from end to end. The benchmark cell's last lines separate the two at
# $L = 1024$: `host_us` times the host's work per call (launches queued back to back) and `graph_us`
# the GPU's (the call replayed from a CUDA graph). For ours the host is the slower of the two in both
# passes (104.2 against 94.0 us in the forward, 739.1 against 376.6 us in forward + backward): calls
# queued back to back leave the GPU waiting for the host. For the flash backend the GPU is the slower
# in both passes (45.5 against 123.3 us, 226.5 against 548.0 us). Our GPU time is shorter than the
# flash backend's in both passes, so at this shape the kernels are not what puts us behind: our
# host's time per call sets the pace, and cutting it is open work. The cell does
# not split the other rows at $L = 1024$ this way.
# The figure's dotted line is the GPU's dense bfloat16 peak from NVIDIA's datasheet.
#
# **Behind cuDNN.** The likely reason lies in what the kernel does not use: FlashAttention-3, and by
# NVIDIA's accounts cuDNN's Hopper kernels, split each block's warps into producers, which move tiles
# with the tensor memory accelerator (TMA), and consumers, which run the asynchronous `wgmma` matrix
# products, and they overlap the softmax of one tile with the products of the next (ping-pong
# scheduling). Our kernel relies on what Triton 3.6 does by itself: `tl.dot` compiles to `wgmma` on
# Hopper and `num_stages` pipelines the loads, but the softmax and the products of one loop iteration
# still take turns. This explanation is not measured here (the cell times whole calls, not their
# parts); "Going deeper: what Hopper offers beyond this kernel" lists the features that would narrow
# the gap.

# %% [markdown]
# ## Going deeper: tile sizes and autotuning
#
# On a GPU each kernel is wrapped in `triton.autotune`, keyed on $L_q$ and $L_k$ rounded up to powers of
# two (`length_bucket`), the head dim, the causal flag and (automatically) the dtypes, and tries the tiles of `GPU_TILES` for the inputs' element size
# (shrunk by `gpu_tiles` past head dim 128: "Going deeper: attention as people call it"):
# `BLOCK_M` 128 queries per forward program (a multiple of the 64 rows a Hopper warpgroup's `wgmma`
# handles), `BLOCK_N` 64 or 128 keys, 4 or 8 warps, 1 to 3 pipeline stages. float32 and float64 inputs
# run with `input_precision="ieee"`, not on the tensor cores, and get small tiles (their blocks of
# scores would not fit in registers at 128 $\times$ 128). The first call for each key pays for the
# search, a few hundred milliseconds: keyed on the exact lengths, a decoding loop whose $L_k$ grows by one
# per step would search at every step; keyed on buckets it searches once per doubling of $L_k$. The
# kernels take the two buckets as arguments they never read, because `triton.autotune` keys on arguments
# by name. The chosen configuration is printed below on a GPU. Under the interpreter a single small
# tile runs, with `BLOCK_M` $\ne$ `BLOCK_N` so that the block arithmetic of the masks is exercised.

# %%
if not ON_GPU:
    print("skipped: needs a GPU (the interpreter runs one fixed tile:", INTERPRETER_TILES, ")")
else:
    for name, kernel in (("forward", flash_fwd), ("dK, dV", flash_bwd_dkdv), ("dQ", flash_bwd_dq)):
        for key, config in kernel.cache.items():
            print(f"{name:8} key (Lq bucket, Lk bucket, head_dim, causal, dtypes...) {key}: {config}")

# %% [markdown]
# ## Going deeper: what Hopper offers beyond this kernel
#
# - **Tensor descriptors** (`tl.make_tensor_descriptor`, TMA): one instruction copies a whole tile from
#   global to shared memory, handles the edges in hardware, and frees the threads that compute addresses.
#   They need a 16-byte aligned base and strides, and a host-side allocator for the descriptors
#   (`triton.set_allocator`).
# - **Warp specialisation** (`tl.range(..., warp_specialize=True)` in recent Triton): some warps only
#   load, others only compute, so that memory and math overlap without the compiler's software pipeline.
# - **Persistent kernels**: a grid of exactly as many programs as multiprocessors, each looping over
#   (head, query block) tiles, which removes the tail of the last partial wave and lets a causal
#   kernel balance its uneven tiles.
# - **The backward**: our dK/dV and dQ kernels each recompute $P$ and $dP$; FlashAttention-2's single
#   backward kernel computes them once and adds $dQ$ with atomics, trading determinism for less work.

# %% [markdown]
# ## Going deeper: why every row has a key, and what if it did not
#
# The online softmax would produce NaN for a query whose every key is masked: $m = -\infty$,
# $e^{m - m'} = e^{-\infty + \infty}$. With one length $L$ and the causal mask that never happens (query $i$
# sees key $i$, and every program's first key block holds key 0, which every query that sees a key sees,
# so $m$ is finite after it), and padding rows past $L$ see real keys too. In the naive CUDA kernel every
# key tile holds at least one key below $L$, so the tile's max is finite and no $-\infty - (-\infty)$
# occurs. It does happen for causal attention with more queries than keys, $L_q > L_k$: the next section
# says which rows see no key, what they get (the output 0, as in flash-attn), and how the forward kernel
# avoids the NaN. A kernel with arbitrary masks (document boundaries, sliding windows) must guard the
# rescaling the same way, or as `softmax_merge` does with its select.

# %% [markdown]
# ## Going deeper: attention as people call it (head dims, grouped queries, $L_q \ne L_k$, the (B, L, H, D) layout)
#
# Models call attention in four ways that the main line set aside: head dims such as 80 or 96; keys and
# values with fewer heads than the queries; a different number of queries and keys (decoding with a cache of
# keys and values); and queries laid out (batch, L, heads, head_dim), as a projection of (batch, L, d_model)
# gives them. The kernels of section 4 and "Going deeper: the backward kernels" take all four. Here is why
# each change is what it is, with a check on the CPU against the float64 reference or PyTorch's SDPA. No
# timing of these cases is recorded: what they cost on a GPU is not measured in this chapter.
#
# **Head dims that are not powers of two.** `tl.arange` needs a power of two, so the kernels run on the head
# dim padded to the next one, `HEAD_DIM_PADDED` (80 and 96 become 128; 160 and 192 become 256), and mask the
# dims from `HEAD_DIM` on. `load_tile` loads zeros there, so no byte past a row is read (the start of the
# next row, or memory past the tensor); a zero column adds nothing to $q \cdot k$, and in $o = P\,V$ the zero
# columns of $V$ give zero columns, which `store_tile` does not write. The price is arithmetic: the products
# run at the padded size, 128/80 = 1.6 times the work of a head dim of 80. Where the head dim is already a
# power of two, `load_tile` and `store_tile` compile to the loads and stores of before (the test
# `dims.shape[0] != HEAD_DIM` is decided when the kernel is compiled). `flash_attention` accepts the
# multiples of 16 from 16 to 256: `tl.dot` needs 16 at least, and Triton marks an integer argument divisible
# by 16 as such, so that the strides of a tensor whose head dim is a multiple of 16 keep its rows aligned for
# vector loads.
#
# **Large head dims need smaller tiles.** A forward program keeps its $o$ accumulator, `BLOCK_M` $\times$
# head dim floats, in registers, and each pipeline stage holds a tile of keys and one of values,
# `BLOCK_N` $\times$ head dim, in shared memory; the dK/dV program keeps two accumulators of `BLOCK_N`
# $\times$ head dim. The tiles of `GPU_TILES` were chosen at head dim 128; at 256 the same blocks would
# need twice the registers (and spill them to memory) and twice the shared memory per stage. So
# `gpu_tiles` halves both blocks at a padded head dim of 256 and keeps at most 2 pipeline stages: every
# tile then holds as many numbers as at 128. Neither their speed nor their use of registers and shared
# memory is measured in this chapter.
#
# The check: every head dim that is not a power of two, and 16 and 256, forward and every gradient; the
# inputs are the first columns of wider rows whose other columns hold NaN, so a read of the padding's
# columns would bring NaN in.

# %%
def with_nan_beyond(tensor, width):
    """`tensor` (..., head_dim) as the first head_dim columns of rows of `width`, the other columns NaN."""
    wide = torch.full((*tensor.shape[:-1], width), float("nan"), dtype=tensor.dtype, device=tensor.device)
    wide[..., :tensor.shape[-1]] = tensor
    return wide[..., :tensor.shape[-1]]


def errors_against_reference(q, k, v, grad_out, causal):
    """Max abs errors of flash_attention's output, dq, dk, dv against the float64 reference's autograd."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=causal)
    got = [out, *torch.autograd.grad(out, leaves, grad_out)]
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out = attention_reference(*leaves64, causal)[0]
    want = [want_out, *torch.autograd.grad(want_out, leaves64, grad_out.double())]
    return [(g.double() - w).abs().max().item() for g, w in zip(got, want)]


torch.manual_seed(20)
print(f"{'d':>4} {'padded':>6} {'out err':>9} {'dq err':>9} {'dk err':>9} {'dv err':>9}")
for head_dim in (16, 48, 80, 96, 160, 192, 256):
    q_d, k_d, v_d, grad_d = [with_nan_beyond(t, 272) for t in torch.randn(4, 1, 2, 19, head_dim, device=DEVICE)]
    errors = errors_against_reference(q_d, k_d, v_d, grad_d, causal=True)
    print(f"{head_dim:4} {triton.next_power_of_2(head_dim):6} " + " ".join(f"{e:9.1e}" for e in errors))
    assert max(errors) < GRAD_TOLERANCE[torch.float32]

# %% [markdown]
# **Grouped-query and multi-query attention.** Keys and values may have $H_{kv}$ heads for $H_q = g\,H_{kv}$
# query heads (grouped-query attention; $H_{kv} = 1$ is multi-query attention): query head $h$ reads kv head
# $\lfloor h / g \rfloor$, so consecutive query heads share one, as in SDPA's `enable_gqa=True`. The reference
# repeats each kv head $g$ times (`repeat_interleave`), $g$ times the memory; the kernels only compute the kv
# head's address from the query head's, `K += ... + head // group * stride_kh`, in the forward and the dQ
# kernel.
#
# The backward is where the sharing shows. A kv head is used by $g$ query heads, so by the chain rule its
# $dK$ and $dV$ are the sums of the $g$ query heads' terms. Each dK/dV program owns a block of keys of one kv
# head and loops over the group's query heads, adding each one's query blocks into the same accumulators:
# no atomics, no buffer of per-query-head gradients to add up afterwards, and the same sums on every run.
# The price is parallelism: that kernel's grid has $g$ times fewer programs, each doing $g$ times the work,
# so with multi-query attention and few batch $\times$ kv heads a GPU may get too few programs to fill its
# multiprocessors (not measured here). When $g = 1$ the loop has one iteration, and Triton, which compiles
# an integer argument equal to 1 as the constant 1, removes it.
#
# The check, against SDPA with `enable_gqa=True` in float64 (in the form the reference runs):

# %%
torch.manual_seed(21)
print(f"{'Hq':>3} {'Hkv':>3} {'causal':>6} {'out err':>9} {'dq err':>9} {'dk err':>9} {'dv err':>9}")
for heads, kv_heads in ((6, 2), (4, 1)):
    for causal in (False, True):
        q_g, grad_g = torch.randn(2, 2, heads, 23, 32, device=DEVICE)
        k_g, v_g = torch.randn(2, 2, kv_heads, 23, 32, device=DEVICE)
        errors = errors_against_reference(q_g, k_g, v_g, grad_g, causal)
        print(f"{heads:3} {kv_heads:3} {str(causal):>6} " + " ".join(f"{e:9.1e}" for e in errors))
        assert max(errors) < GRAD_TOLERANCE[torch.float32]
        want_sdpa = F.scaled_dot_product_attention(q_g.double(), k_g.double(), v_g.double(), is_causal=causal,
                                                   enable_gqa=True)
        torch.testing.assert_close(attention_reference(q_g, k_g, v_g, causal)[0], want_sdpa)

# %% [markdown]
# **$L_q \ne L_k$, and which diagonal.** Without a mask nothing changes but the two lengths. With the causal
# mask one must say where the diagonal lies. When a model decodes with a cache, its $L_q$ new queries are the
# last $L_q$ positions of a sequence of $L_k$: query $i$ stands at position $i + L_k - L_q$ and sees the keys
# $j \le i + L_k - L_q$. That is the diagonal **aligned bottom-right**, the convention of flash-attn (since
# 2.1) and of `torch.nn.attention.bias.causal_lower_right`, and the one `flash_attention(causal=True)` uses.
# SDPA's own `is_causal=True` is aligned top-left (query $i$ sees $j \le i$), which for $L_q < L_k$ would
# hide most of the cache from the new queries; for $L_q = L_k$ the two agree. The kernels take
# `diagonal` $= L_k - L_q$ and compare a key with its query's `rows + diagonal`; the block bounds shift the
# same way (a forward program's unmasked blocks end at its first query's diagonal and its loop at its last
# query's; a dK/dV program's first query block holds the first query that sees its first key, key $-$
# `diagonal`).
#
# **Queries that see no key.** With $L_q > L_k$, queries $i < L_q - L_k$ see no key at all, and attention
# over no keys is $0/0$. We do what flash-attn and SDPA's math backend do: output 0 and zero gradients; the
# log-sum-exp is $-\infty$, the log of an empty sum (flash-attn stores $+\infty$ there, so that its backward
# gets $e^{s - \mathrm{lse}} = 0$ without a mask). In the online softmax such a row would compute
# $2^{m - m'} = 2^{-\infty - (-\infty)}$, NaN, in any key block it shares with rows that do see keys, so
# the forward starts these rows at $m = 0$ instead of $-\infty$: each update then gives $2^{-\infty - 0} = 0$,
# their $(\ell, o)$ stay $(0, 0)$, and at the end $\ell = 0$ (every row with a key has $\ell \ge 1$) selects
# the output 0 and the log-sum-exp $-\infty$. In the backward these rows meet keys only in masked tiles,
# where $P$, $e^{s + \infty} = \infty$ there, is replaced by 0 with a select before it is used (a product
# $\infty \cdot 0$ would be NaN).
#
# The check, against SDPA with the mask `causal_lower_right` would build (`tril` at diagonal $L_k - L_q$),
# in float64; at $L_q = 37$, $L_k = 20$ the first 17 queries see no key, and share the first block of
# queries with queries that do:

# %%
torch.manual_seed(22)
print(f"{'Lq':>3} {'Lk':>3} {'causal':>6} {'no key':>6} {'out err':>9} {'dq err':>9} {'dk err':>9} {'dv err':>9}")
for q_length, k_length in ((5, 37), (37, 5), (37, 20)):
    for causal in (False, True):
        q_l, grad_l = torch.randn(2, 1, 4, q_length, 32, device=DEVICE)
        k_l, v_l = torch.randn(2, 1, 2, k_length, 32, device=DEVICE)
        errors = errors_against_reference(q_l, k_l, v_l, grad_l, causal)
        mask = torch.ones(q_length, k_length, dtype=torch.bool, device=DEVICE).tril(k_length - q_length)
        want_sdpa = F.scaled_dot_product_attention(q_l.double(), k_l.double(), v_l.double(),
                                                   attn_mask=mask if causal else None, enable_gqa=True)
        torch.testing.assert_close(attention_reference(q_l, k_l, v_l, causal)[0], want_sdpa)
        out_l, lse_l = flash_attention_fwd(q_l, k_l, v_l, causal, 32**-0.5)
        no_key = (lse_l == float("-inf")).all(1).all(0).sum().item()  # queries that see no key, in every head
        assert no_key == (max(0, q_length - k_length) if causal else 0) and not out_l[..., :no_key, :].any()
        print(f"{q_length:3} {k_length:3} {str(causal):>6} {no_key:6} " + " ".join(f"{e:9.1e}" for e in errors))
        assert max(errors) < GRAD_TOLERANCE[torch.float32]

# %% [markdown]
# **The (B, L, H, D) layout, read in place.** A model projects $x$ of shape (batch, L, d_model) to queries
# of shape (batch, L, heads, head_dim) and calls attention on `q.transpose(1, 2)`, a (batch, heads, L,
# head_dim) view with strides (L·heads·head_dim, head_dim, heads·head_dim, 1). Every kernel takes the four
# strides of each tensor (batch, head, position, dim) and computes its addresses from them, so such a view
# is read where it lies, with no `.contiguous()` copy of q, k, v or, in the backward, of the incoming
# gradient (a copy is a read and a write of the whole tensor). The head dim's stride is 1 in either layout,
# and Triton compiles an integer argument equal to 1 as the constant 1, so the loads along the head dim stay
# vector loads. The output is allocated with `torch.empty_like(q)`, which keeps q's strides when q is dense:
# from (batch, L, heads, head_dim) memory the output is again such a view, which the model's output
# projection can reshape to (batch, L, heads·head_dim) without a copy; dq, dk and dv take the layouts of q,
# k and v the same way. A stride of 0 works too: k expanded over the heads is read, never materialised.
#
# The check: the launcher receives the views themselves (their data pointers and strides), and the results
# match the reference.

# %%
torch.manual_seed(23)
q_v, grad_v = torch.randn(2, 2, 21, 4, 48, device=DEVICE).transpose(2, 3)  # (batch, heads, L, head_dim) views
k_v, v_v = torch.randn(2, 2, 30, 2, 48, device=DEVICE).transpose(2, 3)  # of (batch, L, heads, head_dim) tensors
received = []
launch_forward = flash_attention_forward


def flash_attention_forward(q, k, v, causal, sm_scale):  # the launcher, recording what it receives
    received.append([(t.data_ptr(), t.stride()) for t in (q, k, v)])
    return launch_forward(q, k, v, causal, sm_scale)


try:
    out_v = flash_attention(q_v, k_v, v_v, causal=True)
finally:
    flash_attention_forward = launch_forward
assert received == [[(t.data_ptr(), t.stride()) for t in (q_v, k_v, v_v)]]
assert out_v.stride() == q_v.stride() and out_v.transpose(1, 2).is_contiguous()
errors = errors_against_reference(q_v, k_v, v_v, grad_v, causal=True)
print(f"q {tuple(q_v.shape)} strides {q_v.stride()}: the launcher got q, k, v in place; the output's strides "
      f"{out_v.stride()}; max abs errors out, dq, dk, dv: " + ", ".join(f"{e:.1e}" for e in errors))
assert max(errors) < GRAD_TOLERANCE[torch.float32]

# %% [markdown]
# ## References
#
# - Milakov and Gimelshein, "Online normalizer calculation for softmax", arXiv:1805.02867, 2018.
# - Rabe and Staats, "Self-attention does not need O(n^2) memory", arXiv:2112.05682, 2021.
# - Dao, Fu, Ermon, Rudra and Ré, "FlashAttention: fast and memory-efficient exact attention with IO-awareness", NeurIPS 2022.
# - Dao, "FlashAttention-2: faster attention with better parallelism and work partitioning", ICLR 2024.
# - Shah, Bikshandi, Zhang, Thakkar, Ramani and Dao, "FlashAttention-3: fast and accurate attention with asynchrony and low-precision", NeurIPS 2024.
# - The Triton tutorials (vector addition, fused softmax, matrix multiplication, fused attention): https://triton-lang.org/main/getting-started/tutorials/
