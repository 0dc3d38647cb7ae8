"""Prototype for issue 20, not part of scan_lib: chapter 07's backward rebuilt so that no scan runs
with Triton's reverse=True over the whole chunk.

The chunk is viewed as (BLOCK_D, SEGS, ITEMS): each thread holds ITEMS consecutive positions of a
segment (16 bytes of the input dtype: 8 for bf16, 4 for fp32), and `unpack` splits such a tile into
ITEMS tiles of (BLOCK_D, SEGS) with tl.split, which costs nothing when the items sit in one thread.
Per state: the states are computed segment by segment in registers (left to right), only the
segments' summaries go through a scan across threads; the adjoint the same way right to left, its
gate a_{t+1} taken from the next item's a_t (one exp per element and state instead of three); the
states before each position (h_{t-1}) come out of the same pass, so the second forward scan and the
second load of B disappear.

Static SASS for sm_90 at the base shape (benchmarks/NOTES_selective_scan.md): 37.6 instructions per
(position, state) per thread in bf16 (chapter 07's backward: 63.1), 49.0 in fp32 at chunk 128 (69.2),
216 and 128 registers, no stack. Not timed on a GPU yet.

Scope of the prototype: per-step B and C (batch, groups, N, L); no D, z, delta_bias or softplus;
one segment; no gradient of the last state. two_level_bwd returns du, d delta, dA, dB, dC as
chapter 07's strided_bwd does, and takes the states its forward saved (save_chunk = chunk)."""
import torch
import triton
import triton.language as tl

from scan_lib.ema import accumulator_dtype, first_order_op

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def unpack(x, ITEMS: tl.constexpr):
    """(..., ITEMS) -> the ITEMS tiles (...) of items 0, 1, ...: free register renames when each thread
    holds the whole last axis."""
    if ITEMS == 1:
        return (tl.reshape(x, x.shape[:-1]),)
    else:
        even, odd = tl.split(tl.reshape(x, x.shape[:-1] + [ITEMS // 2, 2]))
        e = unpack(even, ITEMS // 2)
        o = unpack(odd, ITEMS // 2)
        out = ()
        for i in tl.static_range(ITEMS // 2):
            out = out + (e[i], o[i])
        return out


@triton.jit
def pack(items, ITEMS: tl.constexpr):
    """unpack's inverse."""
    if ITEMS == 1:
        return tl.reshape(items[0], items[0].shape + [1])
    else:
        e = ()
        o = ()
        for i in tl.static_range(ITEMS // 2):
            e = e + (items[2 * i],)
            o = o + (items[2 * i + 1],)
        joined = tl.join(pack(e, ITEMS // 2), pack(o, ITEMS // 2))
        return tl.reshape(joined, joined.shape[:-2] + [ITEMS])


@triton.jit
def items_of(x, SEGS: tl.constexpr, ITEMS: tl.constexpr):
    """rows x (SEGS * ITEMS) -> ITEMS tiles rows x SEGS: item r of every segment."""
    return unpack(tl.reshape(x, (x.shape[0], SEGS, ITEMS)), ITEMS)


@triton.jit
def positions_of(items, SEGS: tl.constexpr, ITEMS: tl.constexpr):
    """items_of's inverse."""
    x = pack(items, ITEMS)
    return tl.reshape(x, (x.shape[0], SEGS * ITEMS))


@triton.jit
def two_level_bwd_kernel(
    U, DELTA, A, B, C, STATES, DOUT,
    DU, DDELTA, DB, DC, DA_PART, ADJ_CARRY,
    dim, length, n_chunks, per_group_b, per_group_c,
    su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sa_d, sa_n,
    sb_b, sb_g, sb_n, sb_l, sc_b, sc_g, sc_n, sc_l, so_b, so_d, so_l,
    N_STATES: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr, SEGS: tl.constexpr,
    ITEMS: tl.constexpr,
):
    CHUNK: tl.constexpr = SEGS * ITEMS
    pid_b = tl.program_id(0).to(tl.int64)
    first_d = tl.program_id(1) * BLOCK_D
    ds = first_d + tl.arange(0, BLOCK_D)
    d_ok = ds < dim
    d2 = ds[:, None]
    cols = tl.arange(0, CHUNK)[None, :]                                  # 1 x CHUNK: positions in the chunk
    segs = tl.arange(0, SEGS)[None, :]                                                       # 1 x SEGS
    rows = 0 * ds[:, None]                                                                   # BLOCK_D x 1
    group_b, group_c = first_d // per_group_b, first_d // per_group_c
    b_base, c_base = pid_b * sb_b + group_b * sb_g, pid_b * sc_b + group_c * sc_g
    db_base = (pid_b * (dim // per_group_b) + group_b) * N_STATES * length
    dc_base = (pid_b * (dim // per_group_c) + group_c) * N_STATES * length
    CARRY = ADJ_CARRY + (pid_b * dim + ds) * N_STATES          # BLOCK_D: state n at + n
    DA = DA_PART + ((pid_b * dim + d2) * N_STATES) * SEGS + segs   # BLOCK_D x SEGS: state n at + n * SEGS
    seg_ok = d_ok[:, None] & (segs < SEGS)
    first_seg = d_ok[:, None] & (segs == 0)
    zero = tl.zeros((BLOCK_D,), dtype=ACC)
    for n in range(0, N_STATES):
        tl.store(CARRY + n, zero, d_ok)
        tl.store(DA + n * SEGS, tl.zeros((BLOCK_D, SEGS), dtype=ACC), seg_ok)
    for i in range(0, n_chunks):
        tl.debug_barrier()
        k = n_chunks - 1 - i
        t2 = k * CHUNK + cols
        t_ok2 = t2 < length
        mask2 = d_ok[:, None] & t_ok2
        u3 = items_of(tl.load(U + pid_b * su_b + d2 * su_d + t2 * su_l, mask2, other=0.0).to(ACC), SEGS, ITEMS)
        delta3 = items_of(tl.load(DELTA + pid_b * sdt_b + d2 * sdt_d + t2 * sdt_l, mask2, other=0.0).to(ACC), SEGS, ITEMS)
        dy3 = items_of(tl.load(DOUT + pid_b * so_b + d2 * so_d + t2 * so_l, mask2, other=0.0).to(ACC), SEGS, ITEMS)
        t_after = k * CHUNK + (segs + 1) * ITEMS                     # the position after each segment
        delta_after = tl.load(DELTA + pid_b * sdt_b + ds[:, None] * sdt_d + t_after * sdt_l,
                              d_ok[:, None] & (t_after < length), other=0.0).to(ACC)   # BLOCK_D x SEGS
        us, dts, dys = u3, delta3, dy3
        steps = ()
        for r in tl.static_range(ITEMS):
            steps = steps + (dts[r] * us[r],)
        adj_b_sum = ()
        adj_ah_rate_sum = ()
        for r in tl.static_range(ITEMS):
            adj_b_sum = adj_b_sum + (tl.zeros((BLOCK_D, SEGS), dtype=ACC),)
            adj_ah_rate_sum = adj_ah_rate_sum + (tl.zeros((BLOCK_D, SEGS), dtype=ACC),)
        for n in range(0, N_STATES):
            rate = tl.load(A + ds * sa_d + n * sa_n, d_ok, other=0.0).to(ACC)[:, None]   # BLOCK_D x 1
            rate2 = rate * LOG2E
            Bn = items_of(tl.load(B + b_base + n * sb_n + t2 * sb_l, t_ok2, other=0.0).to(ACC), SEGS, ITEMS)  # 1 x SEGS each
            Cn = items_of(tl.load(C + c_base + n * sc_n + t2 * sc_l, t_ok2, other=0.0).to(ACC), SEGS, ITEMS)
            h_in = tl.load(STATES + ((pid_b * dim + ds) * N_STATES + n) * n_chunks + k, d_ok, other=0.0)
            adj_in = tl.load(CARRY + n, d_ok, other=0.0)
            a = ()
            b = ()
            for r in tl.static_range(ITEMS):
                a = a + (tl.exp2(dts[r] * rate2),)
                b = b + (steps[r] * Bn[r],)
            # states: each segment from 0, its summary, the state entering each segment, then the states
            seg_a = a[0]
            seg_h = b[0]
            for r in tl.static_range(1, ITEMS):
                seg_a = seg_a * a[r]
                seg_h = a[r] * seg_h + b[r]
            seg_h = tl.where(segs == 0, seg_h + seg_a * h_in[:, None], seg_h)
            _, seg_end = tl.associative_scan((seg_a, seg_h), axis=1, combine_fn=first_order_op)
            before = tl.gather(seg_end, tl.maximum(segs - 1, 0) + rows, axis=1)
            h = tl.where(segs == 0, h_in[:, None], before)               # BLOCK_D x SEGS: entering each segment
            ah = ()                                                    # a_t h_{t-1}
            dC = ()
            for r in tl.static_range(ITEMS):
                x = a[r] * h
                h = x + b[r]
                ah = ah + (x,)
                dC = dC + (tl.sum(h * dys[r], axis=0)[None, :],)
            tl.atomic_add(DC + dc_base + n * length + t2, positions_of(dC, SEGS, ITEMS), t_ok2, sem="relaxed")
            # the adjoint: each segment from 0 at its right end, its summary, the adjoint after it, then all
            c = ()
            gate = ()                                                  # a_{t+1}
            for r in tl.static_range(ITEMS):
                c = c + (Cn[r] * dys[r],)
            for r in tl.static_range(ITEMS - 1):
                gate = gate + (a[r + 1],)
            gate = gate + (tl.exp2(delta_after * rate2),)
            last_c = c[ITEMS - 1] + tl.where(segs == SEGS - 1, adj_in[:, None], 0.0)
            seg_g = gate[ITEMS - 1]
            seg_adj = last_c
            for r in tl.static_range(ITEMS - 2, -1, -1):
                seg_adj = c[r] + gate[r] * seg_adj
                seg_g = seg_g * gate[r]
            _, seg_start = tl.associative_scan((seg_g, seg_adj), axis=1, combine_fn=first_order_op, reverse=True)
            after = tl.gather(seg_start, tl.minimum(segs + 1, SEGS - 1) + rows, axis=1)
            adj_next = tl.where(segs == SEGS - 1, 0.0, after)        # the adjoint entering each segment from the right
            dB = ()
            dA_elem = tl.zeros((BLOCK_D, SEGS), dtype=ACC)
            adj = ()
            adj_next = last_c + gate[ITEMS - 1] * adj_next
            adj = (adj_next,)
            for r in tl.static_range(ITEMS - 2, -1, -1):
                adj_next = c[r] + gate[r] * adj_next
                adj = (adj_next,) + adj
            new_b_sum = ()
            new_rate_sum = ()
            for r in tl.static_range(ITEMS):
                y = adj[r] * ah[r]
                new_b_sum = new_b_sum + (adj_b_sum[r] + adj[r] * Bn[r],)
                new_rate_sum = new_rate_sum + (adj_ah_rate_sum[r] + y * rate,)
                dA_elem += y * dts[r]
                dB = dB + (tl.sum(adj[r] * steps[r], axis=0)[None, :],)
            adj_b_sum = new_b_sum
            adj_ah_rate_sum = new_rate_sum
            tl.atomic_add(DB + db_base + n * length + t2, positions_of(dB, SEGS, ITEMS), t_ok2, sem="relaxed")
            tl.store(CARRY[:, None] + n + 0 * segs, a[0] * adj[0], first_seg)     # segment 0's thread writes it
            tl.store(DA + n * SEGS, tl.load(DA + n * SEGS, seg_ok, other=0.0) + dA_elem, seg_ok)
        ddelta = ()
        du = ()
        for r in tl.static_range(ITEMS):
            ddelta = ddelta + (adj_ah_rate_sum[r] + us[r] * adj_b_sum[r],)
            du = du + (dts[r] * adj_b_sum[r],)
        out_offs = (pid_b * dim + d2) * length + t2
        tl.store(DDELTA + out_offs, positions_of(ddelta, SEGS, ITEMS).to(DDELTA.dtype.element_ty), mask2)
        tl.store(DU + out_offs, positions_of(du, SEGS, ITEMS).to(DU.dtype.element_ty), mask2)


def two_level_bwd(u, delta, A, B, C, states, dout, chunk, block_d=2, items=None):
    """du, ddelta, dA, dB, dC for B, C (batch, groups, N, L); states: the forward's, one per chunk."""
    batch, dim, length = u.shape
    n_states, n_chunks, acc = A.shape[1], states.shape[-1], states.dtype
    items = items or max(1, min(8, 16 // u.element_size()))
    du, ddelta = torch.empty_like(u), torch.empty_like(delta)
    dB = torch.zeros(B.shape, device=u.device, dtype=acc)
    dC = torch.zeros(C.shape, device=u.device, dtype=acc)
    dA_part = u.new_empty(batch, dim, n_states, chunk // items, dtype=acc)
    carry = u.new_empty(batch, dim, n_states, dtype=acc)
    two_level_bwd_kernel[(batch, triton.cdiv(dim, block_d))](
        u, delta, A, B, C, states, dout, du, ddelta, dB, dC, dA_part, carry,
        dim, length, n_chunks, dim // B.shape[1], dim // C.shape[1],
        *u.stride(), *delta.stride(), *A.stride(), *B.stride(), *C.stride(), *dout.stride(),
        N_STATES=n_states, ACC=accumulator_dtype(acc), BLOCK_D=block_d, SEGS=chunk // items, ITEMS=items,
        num_warps=1)
    return du, ddelta, dA_part.sum((0, 3)), dB, dC
