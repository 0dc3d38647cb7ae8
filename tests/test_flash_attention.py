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
    """(output, lse) in float64: PyTorch's math attention and the log-sum-exp of the scores."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        length = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
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
        (ValueError, "k must have the shape of q", lambda: flash_attention(q, q[:, :, :4], q)),
        (ValueError, "v must have the shape of q", lambda: flash_attention(q, q, q[:, :1])),
        (ValueError, "k must have the shape of q", lambda: flash_attention(q, q[0], q)),
        (ValueError, "head_dim .* 32, 64, 128, got 48", lambda: flash_attention(*[torch.randn(1, 2, 5, 48, device=DEVICE)] * 3)),
        (ValueError, "q must have 4 dims", lambda: flash_attention(q[0], q[0], q[0])),
        (TypeError, "v must be float16", lambda: flash_attention(q, q, q.long())),
        (TypeError, "q must be a torch.Tensor", lambda: flash_attention(q.tolist(), q, q)),
        (TypeError, "one dtype", lambda: flash_attention(q, q.half(), q)),
        (TypeError, "causal", lambda: flash_attention(q, q, q, causal=1)),
        (TypeError, "sm_scale", lambda: flash_attention(q, q, q, sm_scale="0.1")),
        (TypeError, "sm_scale", lambda: flash_attention(q, q, q, sm_scale=True)),
    ]
    if ON_GPU:
        calls.append((ValueError, "one device", lambda: flash_attention(q, q.cpu(), q)))
        calls.append((ValueError, "CUDA", lambda: flash_attention(q.cpu(), q.cpu(), q.cpu())))
    return calls


@pytest.mark.parametrize("error, words, call", _bad_calls())
def test_bad_input(error, words, call):
    with pytest.raises(error, match=words):
        call()


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
