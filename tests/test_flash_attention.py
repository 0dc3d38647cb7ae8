"""scan_lib.flash_attention: softmax attention without the L x L matrix, against float64 SDPA and autograd."""
import sys

import pytest
import torch
import torch.nn.functional as F

import scan_lib
from scan_lib import flash_attention
from scan_lib.runtime import DEVICE, ON_GPU

TOLERANCE = {torch.float32: 5e-5, torch.float16: 2e-2, torch.bfloat16: 1.5e-1, torch.float64: 1e-10}


def reference(q, k, v, causal=False, sm_scale=None):
    """(output, lse) in float64: PyTorch's math attention and the log-sum-exp of the scores. k and v may have
    fewer heads (enable_gqa) and another length than q; causal is the mask aligned bottom-right (query i sees the
    keys j <= i + Lk - Lq, torch.nn.attention.bias.causal_lower_right's)."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    queries, keys = q.shape[-2], k.shape[-2]
    mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries) if causal else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    scores = q @ k.repeat_interleave(q.shape[-3] // k.shape[-3], -3).transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(~mask, float("-inf"))
    return out, torch.logsumexp(scores, -1)


def make_inputs(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype) for _ in range(4)]


def max_error(got, want):
    return (got.double() - want.double()).abs().max().item()


def test_exported_in_package():
    assert scan_lib.flash_attention is flash_attention and "flash_attention" in scan_lib.__all__
    assert flash_attention.__module__ == "scan_lib.flash_attention"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [1, 7, 33, 129])
def test_forward_and_lse(length, causal):
    q, k, v, _ = make_inputs((1, 2, length, 64), seed=length)
    out, lse = torch.ops.scan_lib.flash_attention_fwd(q, k, v, causal, 0.125)
    want_out, want_lse = reference(q, k, v, causal, 0.125)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (1, 2, length)
    assert max_error(out, want_out) < TOLERANCE[torch.float32]
    assert max_error(lse, want_lse) < 1e-4


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [1, 7, 33, 129])
def test_every_gradient(length, causal):
    q, k, v, grad = make_inputs((1, 2, length, 32), seed=10 + length)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=causal, sm_scale=0.3)
    ours = [out, *torch.autograd.grad(out, leaves, grad)]
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out = reference(*leaves64, causal, 0.3)[0]
    theirs = [want_out, *torch.autograd.grad(want_out, leaves64, grad.double())]
    for name, got, want in zip(("out", "dq", "dk", "dv"), ours, theirs):
        assert got.dtype == torch.float32 and max_error(got, want) < TOLERANCE[torch.float32], name


@pytest.mark.parametrize("head_dim, dtype, length, causal", [
    (32, torch.bfloat16, 33, True), (64, torch.float16, 33, True), (128, torch.bfloat16, 33, True),
    (128, torch.float32, 33, True), (32, torch.float64, 33, True),
    # L = 300: on a GPU the bfloat16 tiles (up to 128 x 128) have whole blocks, run unmasked, before the
    # diagonal and the partial last block (the interpreter's small tiles do already at L = 129)
    (64, torch.bfloat16, 300, False), (128, torch.bfloat16, 300, True)])
def test_head_dims_and_dtypes(head_dim, dtype, length, causal):
    """Output and gradients in the input dtype, accumulated in float32 (float64 for float64)."""
    q, k, v, grad = make_inputs((1, 1, length, head_dim), dtype, seed=head_dim)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=causal)
    ours = [out, *torch.autograd.grad(out, leaves, grad)]
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out = reference(*leaves64, causal)[0]
    theirs = [want_out, *torch.autograd.grad(want_out, leaves64, grad.double())]
    for got, want in zip(ours, theirs):
        assert got.dtype == dtype and max_error(got, want) < TOLERANCE[dtype]


def test_gradcheck_float64():
    q, k, v, _ = make_inputs((1, 1, 3, 32), torch.float64, seed=4)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *x: flash_attention(*x, causal=True), leaves, fast_mode=True)


def test_non_contiguous_inputs_and_default_scale():
    gen = torch.Generator().manual_seed(5)
    q, k, v = [torch.randn(2, 40, 3, 64, generator=gen).to(DEVICE).transpose(1, 2) for _ in range(3)]
    assert not q.is_contiguous()
    assert max_error(flash_attention(q, k, v), reference(q, k, v)[0]) < TOLERANCE[torch.float32]


class ZeroDelta:
    """Stands in for the preprocessing kernel: writes D = 0, as if dS = P * dP (rowsum(dO * O) forgotten)."""
    def __getitem__(self, grid):
        return lambda out, grad_out, delta, *args, **kwargs: delta.zero_()


def test_the_gradient_check_catches_a_missing_row_sum(monkeypatch):
    q, k, v, grad = make_inputs((1, 1, 9, 32), seed=6)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(reference(*leaves64, False, 0.5)[0], leaves64, grad.double())
    module = sys.modules["scan_lib.flash_attention"]
    out, lse = module.flash_attention_forward(q, k, v, False, 0.5)
    monkeypatch.setattr(module, "flash_bwd_preprocess_kernel", ZeroDelta())
    dq, dk, dv = module.flash_attention_backward(q, k, v, out, lse, grad, False, 0.5)
    assert max_error(dq, want[0]) > 1e-2 and max_error(dk, want[1]) > 1e-2
    assert max_error(dv, want[2]) < TOLERANCE[torch.float32]  # dV does not use D


@pytest.mark.parametrize("shape", [(1, 2, 0, 32), (0, 2, 5, 64)])
def test_empty(shape):
    q, k, v = [torch.randn(shape, device=DEVICE, requires_grad=True) for _ in range(3)]
    out = flash_attention(q, k, v, causal=True)
    assert out.shape == shape
    out.sum().backward()
    assert q.grad.shape == shape and not q.grad.any()


def _bad_calls():
    q = torch.randn(1, 2, 5, 32, device=DEVICE)
    calls = [
        (ValueError, "v must have the shape of k .* one length Lk", lambda: flash_attention(q, q, q[:, :, :4])),
        (ValueError, "v must have the shape of k .* one number of heads", lambda: flash_attention(q, q, q[:, :1])),
        (ValueError, "k must have 4 dims", lambda: flash_attention(q, q[0], q)),
        (ValueError, "k and v must have q's batch", lambda: flash_attention(q, *[q.expand(2, 2, 5, 32)] * 2)),
        (ValueError, "k and v must have q's .* head_dim",
         lambda: flash_attention(q, *[torch.randn(1, 2, 5, 48, device=DEVICE)] * 2)),
        (ValueError, "k's and v's heads .* must divide q's heads 2 .* got 3",
         lambda: flash_attention(q, *[torch.randn(1, 3, 5, 32, device=DEVICE)] * 2)),
        (ValueError, "k's and v's heads .* must divide q's heads 2 .* got 0",
         lambda: flash_attention(q, *[torch.randn(1, 0, 5, 32, device=DEVICE)] * 2)),
        (ValueError, "head_dim .* a multiple of 16 from 16 to 256, got 40",
         lambda: flash_attention(*[torch.randn(1, 2, 5, 40, device=DEVICE)] * 3)),
        (ValueError, "head_dim .* a multiple of 16 from 16 to 256, got 8",
         lambda: flash_attention(*[torch.randn(1, 2, 5, 8, device=DEVICE)] * 3)),
        (ValueError, "head_dim .* a multiple of 16 from 16 to 256, got 272",
         lambda: flash_attention(*[torch.randn(1, 1, 2, 272, device=DEVICE)] * 3)),
        (ValueError, "q must have 4 dims", lambda: flash_attention(q[0], q[0], q[0])),
        (TypeError, "v must be float16", lambda: flash_attention(q, q, q.long())),
        (TypeError, "q must be a torch.Tensor", lambda: flash_attention(q.tolist(), q, q)),
        (TypeError, "one dtype", lambda: flash_attention(q, q.half(), q.half())),
        (TypeError, "causal", lambda: flash_attention(q, q, q, causal=1)),
        (TypeError, "sm_scale", lambda: flash_attention(q, q, q, sm_scale="0.1")),
        (TypeError, "sm_scale", lambda: flash_attention(q, q, q, sm_scale=True)),
    ]
    if ON_GPU:
        calls.append((ValueError, "one device", lambda: flash_attention(q, q.cpu(), q.cpu())))
        calls.append((ValueError, "CUDA", lambda: flash_attention(q.cpu(), q.cpu(), q.cpu())))
    return calls


@pytest.mark.parametrize("error, words, call", _bad_calls())
def test_bad_input(error, words, call):
    with pytest.raises(error, match=words):
        call()


def test_decoding_lengths_share_one_autotuning_search():
    """Autotuning keys on the lengths rounded up to powers of two: a decoding loop whose Lk grows by one per step
    searches once per doubling, not at every step."""
    if not ON_GPU:
        pytest.skip("the interpreter runs one fixed tile: nothing is searched")
    fa = sys.modules["scan_lib.flash_attention"]
    q = torch.randn(1, 2, 1, 48, device=DEVICE)  # head dim 48: a key no other test uses
    for length in range(65, 81):
        kv = torch.randn(1, 2, length, 48, device=DEVICE)
        flash_attention(q, kv, kv)
    lengths = {key[:2] for key in fa.flash_fwd.cache if key[2] == 48}
    assert lengths == {(1, 128)}, lengths


# torch.compile, fake tensors and the torch.func transforms: the kernels are custom ops with fake impls and vmap rules.

def test_fake_tensor_gives_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 3, 17, 64, dtype=torch.bfloat16)
        out, lse = torch.ops.scan_lib.flash_attention_fwd(q, q, q, True, 0.125)
        dq, dk, dv = torch.ops.scan_lib.flash_attention_bwd(q, q, q, out, lse, out, True, 0.125)
    assert out.shape == dq.shape == dk.shape == dv.shape == (2, 3, 17, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 3, 17) and lse.dtype == torch.float32


def test_compile_fullgraph():
    q, k, v, _ = make_inputs((1, 2, 40, 64), seed=7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(lambda q, k, v: flash_attention(2 * q, k, v, causal=True) * 3, fullgraph=True,
                             backend="aot_eager")
    out = compiled(*leaves)
    ours = torch.autograd.grad(out.sum(), leaves)
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = flash_attention(2 * plain[0], plain[1], plain[2], causal=True) * 3
    torch.testing.assert_close(out, expected)
    for got, want in zip(ours, torch.autograd.grad(expected.sum(), plain)):
        torch.testing.assert_close(got, want)


def test_func_grad():
    q, k, v, _ = make_inputs((1, 1, 12, 32), torch.float64, seed=8)
    ours = torch.func.grad(lambda *x: flash_attention(*x, causal=True).pow(2).sum(), argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = torch.autograd.grad(reference(*leaves, True)[0].pow(2).sum(), leaves)
    for got, want in zip(ours, theirs):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_vmap_and_vmap_of_grad():
    q, k, v, _ = make_inputs((3, 1, 2, 9, 32), torch.float64, seed=9)
    # vmapped dim 1 of q, 0 of k, and an unbatched v shared by every sample
    batched = torch.func.vmap(lambda q, k: flash_attention(q, k, v[0]), in_dims=(1, 0))(q.transpose(0, 1), k)
    torch.testing.assert_close(batched, reference(q, k, v[0].expand_as(q))[0], rtol=1e-10, atol=1e-10)
    grads = torch.func.vmap(torch.func.grad(lambda q, k: flash_attention(q, k, k, causal=True).pow(2).sum(),
                                            argnums=(0, 1)))(q, k)
    leaves = [t.clone().requires_grad_() for t in (q, k)]
    theirs = torch.autograd.grad(reference(leaves[0], leaves[1], leaves[1], True)[0].pow(2).sum(), leaves)
    for got, want in zip(grads, theirs):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_double_backward_is_refused_not_wrong():
    q, k, v, _ = make_inputs((1, 1, 5, 32), torch.float64, seed=11)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    (dq,) = torch.autograd.grad(flash_attention(*leaves).pow(2).sum(), leaves[0], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(dq.sum(), leaves)


def test_lse_is_not_differentiable():
    q, k, v, _ = make_inputs((1, 1, 5, 32), seed=12)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, lse = scan_lib.runtime.apply(sys.modules["scan_lib.flash_attention"].FlashAttentionFunction, *leaves, False, 0.2)
    assert out.requires_grad and not lse.requires_grad


# Attention as people call it (issue 22): head dims up to 256, grouped-query attention, Lq != Lk with the causal
# diagonal aligned bottom-right, and the (batch, L, heads, head_dim) layout read in place.

def check_against_reference(q, k, v, causal, grad, dtype=torch.float32, sm_scale=None):
    """flash_attention's output and dq, dk, dv against the float64 reference's autograd, within TOLERANCE[dtype].
    q, k, v are passed as they are (detached: the same memory at the same strides)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=causal, sm_scale=sm_scale)
    ours = [out, *torch.autograd.grad(out, leaves, grad)]
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out = reference(*leaves64, causal, sm_scale)[0]
    theirs = [want_out, *torch.autograd.grad(want_out, leaves64, grad.double())]
    for name, got, want in zip(("out", "dq", "dk", "dv"), ours, theirs):
        assert got.dtype == dtype and got.shape == want.shape, name
        assert max_error(got, want) < TOLERANCE[dtype], (name, max_error(got, want))
    return ours


def attention_case(batch, heads, kv_heads, q_length, k_length, head_dim, dtype=torch.float32, seed=0):
    """q (batch, heads, Lq, head_dim), k and v (batch, kv_heads, Lk, head_dim), grad_out like q: N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, q_length), (batch, kv_heads, k_length), (batch, kv_heads, k_length),
              (batch, heads, q_length)]
    return [torch.randn(*shape, head_dim, generator=gen, dtype=torch.float64).to(DEVICE, dtype) for shape in shapes]


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")  # SDPA's other backends would
def test_the_reference_is_sdpa_with_gqa_and_the_lower_right_mask():
    """The chapter's attention_reference (repeat_interleave, triu) and SDPA (enable_gqa, causal_lower_right)."""
    from torch.nn.attention.bias import causal_lower_right
    from scan_lib.flash_attention import attention_reference
    for q_length, k_length in ((5, 37), (37, 5), (9, 9)):
        q, k, v, _ = attention_case(2, 6, 2, q_length, k_length, 32, torch.float64, seed=q_length)
        for causal in (False, True):
            mask = causal_lower_right(q_length, k_length) if causal else None
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            out, lse = attention_reference(q, k, v, causal)
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(lse, reference(q, k, v, causal)[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("head_dim", [16, 48, 80, 96, 160, 192, 256])
def test_head_dims_padded_to_a_power_of_two(head_dim):
    """Every multiple of 16 up to 256: the kernels pad the head dim to a power of two with masks."""
    q, k, v, grad = attention_case(1, 2, 2, 19, 19, head_dim, seed=head_dim)
    check_against_reference(q, k, v, True, grad)


def test_padding_reads_and_writes_nothing_outside_the_head_dim():
    """head_dim 80, every tensor a slice [..., :80] of rows of 128 whose last 48 columns are NaN: a read of the
    padding's columns would bring NaN in, and a write past them into dq, dk, dv (contiguous) would land in the
    next row; the results match the reference."""
    def with_nan_beyond(t):
        wide = torch.full((*t.shape[:-1], 128), float("nan"), device=DEVICE)
        wide[..., :80] = t
        return wide[..., :80]
    q, k, v, grad = [with_nan_beyond(t) for t in attention_case(1, 2, 1, 21, 13, 80, seed=3)]
    assert q.stride(-2) == 128 and grad.isnan().sum() == 0
    check_against_reference(q, k, v, True, grad)


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_and_multi_query_attention(heads, kv_heads, causal):
    """k and v with fewer heads: query head h reads kv head h // (heads / kv_heads); dk and dv of a kv head sum
    the terms of its group of query heads (SDPA's enable_gqa)."""
    q, k, v, grad = attention_case(2, heads, kv_heads, 23, 23, 32, seed=heads)
    check_against_reference(q, k, v, causal, grad)


# Lk - Lq = 33 and -33, 1 past a multiple of every interpreter block: the forward's and dQ's last key block holds only
# the block's last visible key, and a dK/dV program's first query block only the first query that sees its keys.
@pytest.mark.parametrize("q_length, k_length", [(5, 37), (37, 5), (1, 40), (33, 17), (47, 80), (80, 47)])
@pytest.mark.parametrize("causal", [False, True])
def test_queries_and_keys_of_other_lengths(q_length, k_length, causal):
    """Lq != Lk, with 2 query heads per kv head; causal: aligned bottom-right (query i sees keys j <= i + Lk - Lq)."""
    q, k, v, grad = attention_case(1, 4, 2, q_length, k_length, 32, seed=q_length + k_length)
    check_against_reference(q, k, v, causal, grad)
    out, lse = torch.ops.scan_lib.flash_attention_fwd(q, k, v, causal, 0.2)
    want_lse = reference(q, k, v, causal, 0.2)[1]
    assert lse.shape == (1, 4, q_length)
    assert torch.equal(lse.isinf(), want_lse.isinf())
    assert max_error(lse[lse.isfinite()], want_lse[want_lse.isfinite()]) < 1e-4


def test_queries_that_see_no_key_get_zeros_not_nan():
    """Causal with Lq = 37 > Lk = 20: queries 0..16 see no key, and share a block of queries with some that do
    (where the online softmax would compute 2^(-inf - (-inf)) if nothing guarded it). As flash-attn (and SDPA's
    math backend with causal_lower_right): output 0, gradients 0, no NaN; their log-sum-exp is -inf, the log of
    no terms."""
    q, k, v, grad = attention_case(1, 2, 1, 37, 20, 32, seed=13)
    out, dq, dk, dv = check_against_reference(q, k, v, True, grad)
    assert not out[:, :, :17].any() and not dq[:, :, :17].any()
    assert out[:, :, 17:].abs().amax(-1).min() > 0 and all(t.isfinite().all() for t in (out, dq, dk, dv))
    _, lse = torch.ops.scan_lib.flash_attention_fwd(q, k, v, True, 0.2)
    assert (lse[:, :, :17] == float("-inf")).all() and lse[:, :, 17:].isfinite().all()


@pytest.mark.parametrize("dtype, heads, kv_heads, q_length, k_length, head_dim", [
    (torch.bfloat16, 4, 1, 37, 20, 96), (torch.float16, 6, 3, 20, 45, 80), (torch.float64, 4, 2, 9, 14, 48)])
def test_all_of_it_in_every_dtype(dtype, heads, kv_heads, q_length, k_length, head_dim):
    q, k, v, grad = attention_case(1, heads, kv_heads, q_length, k_length, head_dim, dtype, seed=head_dim)
    check_against_reference(q, k, v, True, grad, dtype)


def blhd_views(batch, heads, kv_heads, q_length, k_length, head_dim, seed):
    """q, k, v, grad_out as (batch, heads, L, head_dim) views of (batch, L, heads, head_dim) tensors."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(q_length, heads), (k_length, kv_heads), (k_length, kv_heads), (q_length, heads)]
    return [torch.randn(batch, length, h, head_dim, generator=gen).to(DEVICE).transpose(1, 2) for length, h in shapes]


def test_the_blhd_layout_is_read_in_place(monkeypatch):
    """The launchers get the views themselves (their data pointers and strides), not copies, for q, k, v and
    grad_out; the output and dq take q's layout, dk and dv k's and v's; the results match the reference."""
    module = sys.modules["scan_lib.flash_attention"]
    q, k, v, grad = blhd_views(2, 4, 2, 21, 30, 48, seed=14)
    assert not any(t.is_contiguous() for t in (q, k, v, grad))
    received = []

    def recording(launcher):
        def launch(*args):
            received.append([(t.data_ptr(), t.stride()) for t in args if isinstance(t, torch.Tensor)])
            return launcher(*args)
        return launch
    monkeypatch.setattr(module, "flash_attention_forward", recording(module.flash_attention_forward))
    monkeypatch.setattr(module, "flash_attention_backward", recording(module.flash_attention_backward))
    out, dq, dk, dv = check_against_reference(q, k, v, True, grad)
    views = [(t.data_ptr(), t.stride()) for t in (q, k, v)]
    assert received[0] == views  # the forward: q, k, v
    assert received[1][:3] == views and received[1][5] == (grad.data_ptr(), grad.stride())  # backward: ..., grad_out
    assert out.stride() == dq.stride() == q.stride() and dk.stride() == k.stride() and dv.stride() == v.stride()


def test_strides_of_zero_are_read_in_place():
    """k and v expanded over the heads (stride 0), and the gradient of a sum (every stride 0), not materialised."""
    q, k, v, _ = attention_case(1, 4, 1, 17, 17, 32, seed=15)
    k_wide, v_wide = k.expand(1, 4, 17, 32), v.expand(1, 4, 17, 32)
    assert k_wide.stride(1) == 0
    check_against_reference(q, k_wide, v_wide, True, torch.ones(1, 4, 17, 32, device=DEVICE))
    leaves = [t.clone().requires_grad_() for t in (q, k_wide, v_wide)]
    flash_attention(*leaves, causal=True).sum().backward()
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k_wide, v_wide)]
    reference(*leaves64, True)[0].sum().backward()
    for ours, theirs in zip(leaves, leaves64):
        assert max_error(ours.grad, theirs.grad) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("q_length, k_length", [(0, 5), (5, 0)])
def test_no_queries_or_no_keys_as_sdpa(q_length, k_length):
    """No query: an empty output. No key: every output 0 (SDPA's), gradients 0."""
    q, k, v, _ = attention_case(1, 4, 2, q_length, k_length, 32, seed=16)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=True)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert out.shape == want.shape == (1, 4, q_length, 32) and torch.equal(out, want)
    out.sum().backward()
    assert all(t.grad.shape == t.shape and not t.grad.any() for t in leaves)


def test_gqa_under_vmap_compile_and_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k = torch.empty(2, 6, 7, 80), torch.empty(2, 3, 11, 80)
        out, lse = torch.ops.scan_lib.flash_attention_fwd(q, k, k, True, 0.1)
        dq, dk, dv = torch.ops.scan_lib.flash_attention_bwd(q, k, k, out, lse, out, True, 0.1)
    assert out.shape == dq.shape == (2, 6, 7, 80) and dk.shape == dv.shape == (2, 3, 11, 80) and lse.shape == (2, 6, 7)
    q, k, v, _ = attention_case(3, 4, 2, 9, 13, 32, torch.float64, seed=17)
    batched = torch.func.vmap(lambda q, k, v: flash_attention(q[None], k[None], v[None], causal=True)[0])(q, k, v)
    torch.testing.assert_close(batched, reference(q, k, v, True)[0], rtol=1e-10, atol=1e-10)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(lambda q, k, v: flash_attention(q, k, v, causal=True), fullgraph=True, backend="aot_eager")
    grads = torch.autograd.grad(compiled(*leaves).pow(2).sum(), leaves)
    leaves64 = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(reference(*leaves64, True)[0].pow(2).sum(), leaves64)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_gpu_tiles_shrink_with_the_head_dim():
    """Past head dim 128 both blocks shrink in proportion (BLOCK x head dim stays what it is at 128) and the
    pipeline keeps 2 stages at most; up to 128 the tiles are GPU_TILES'."""
    module = sys.modules["scan_lib.flash_attention"]
    for name, by_size in module.GPU_TILES.items():
        for size, tiles in by_size.items():
            for dim in (16, 32, 64, 128):
                assert module.gpu_tiles(name, size, dim) == tiles
            for (m, n, warps, stages), (m2, n2, warps2, stages2) in zip(tiles, module.gpu_tiles(name, size, 256)):
                assert (m2, n2, warps2) == (max(16, m // 2), max(16, n // 2), warps) and stages2 == min(stages, 2)


@pytest.mark.parametrize("dtype, q_length, k_length", [
    (torch.float16, 300, 429), (torch.bfloat16, 429, 300), (torch.bfloat16, 300, 40)])
def test_lengths_past_the_gpu_blocks(dtype, q_length, k_length):
    """Lq != Lk causal at lengths that span several of the GPU's blocks (up to 128): Lk - Lq = +-129 is 1 past a
    multiple of every block size, so the last visible key (or the first query that sees a key block) is alone in
    its block; at Lq = 300, Lk = 40 the first two query blocks of 128 see no key at all."""
    q, k, v, grad = attention_case(1, 2, 1, q_length, k_length, 80, dtype, seed=q_length + k_length)
    out, dq, dk, dv = check_against_reference(q, k, v, True, grad, dtype)
    no_key = max(0, q_length - k_length)
    assert not out[:, :, :no_key].any() and not dq[:, :, :no_key].any()


def test_views_whose_heads_span_2_to_the_31_elements_are_copied(monkeypatch):
    """The kernels' offsets inside a head are 32-bit: a view whose heads span OFFSET_LIMIT elements or more (here
    the (batch, L, heads, head_dim) layout with the limit lowered to 2^11 < 21 x 4 x 48) reaches the launchers as
    a contiguous copy, and so does such a gradient of the output; a view within it is read in place; and an
    L x head_dim of the limit or more is refused."""
    module = sys.modules["scan_lib.flash_attention"]
    monkeypatch.setattr(module, "OFFSET_LIMIT", 2**11)
    q, k, v, grad = blhd_views(1, 4, 2, 21, 30, 48, seed=18)
    k, v = k.contiguous(), v.contiguous()  # 30 x 48 < 2^11: fits
    received = []

    def recording(launcher):
        def launch(*args):
            received.append([t for t in args if isinstance(t, torch.Tensor)])
            return launcher(*args)
        return launch
    monkeypatch.setattr(module, "flash_attention_forward", recording(module.flash_attention_forward))
    monkeypatch.setattr(module, "flash_attention_backward", recording(module.flash_attention_backward))
    check_against_reference(q, k, v, True, grad)
    forward, backward = received
    assert forward[0].is_contiguous() and forward[0].data_ptr() != q.data_ptr()
    assert forward[1].data_ptr() == k.data_ptr() and forward[2].data_ptr() == v.data_ptr()
    assert backward[5].is_contiguous() and backward[5].data_ptr() != grad.data_ptr()
    too_long = torch.randn(1, 1, 2**7, 16, device=DEVICE)  # 128 x 16 = 2^11
    with pytest.raises(ValueError, match="q's L x head_dim must be below 2\\^31"):
        flash_attention(too_long, too_long[:, :, :4], too_long[:, :, :4])
