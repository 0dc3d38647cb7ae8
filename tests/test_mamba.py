"""scan_lib.Mamba (the block of notebooks/06_mamba_block.py) against an independent float64 reference of
mamba_ssm's forward (F.conv1d, F.softplus, selective_scan_ref and the block's projections), every gradient,
both backends; mamba_ssm's parameter layout and initialisation; inference three ways (whole sequence,
chunks through InferenceParams, token by token); selective_state_update against one step of the scan; bad
input; and, on a GPU where it is installed, mamba_ssm's own module."""
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import scan_lib  # first: without a GPU it switches Triton to its interpreter, before triton.language loads
from scan_lib import InferenceParams, Mamba, selective_state_update
from scan_lib.mamba import _mamba_ssm_block, inverse_softplus, s4d_real_A, selective_scan_loop
from scan_lib.runtime import DEVICE, ON_GPU
from scan_lib.selective_scan import selective_scan_ref

# Size profiles: the triton backend runs in Triton's (slow) CPU interpreter without a GPU.
TRITON = dict(d_model=64, d_state=16, batch=2) if ON_GPU else dict(d_model=4, d_state=4, batch=1)
TRITON_LENGTHS = (1, 7, 129, 1000) if ON_GPU else (1, 7, 33)   # CPU: 33 = 2 chunks of 16 (fwd), 4 of 8 (bwd), and 1
TORCH = dict(d_model=8, d_state=4, batch=2)
# Relative to the reference's largest value. float64 blocks keep A_log and D in float32 and compute
# A = -exp(A_log.float()) in float32, as mamba_ssm does: that limits them to about float32's 6e-8 per
# value; 1e-6 leaves room for the sums and still catches any wrong term. float32 blocks: a few hundred
# products per output (and L terms per gradient of A_log, D, B, C), 1e-4.
TOL = {torch.float64: 1e-6, torch.float32: 1e-4}


pytestmark = pytest.mark.usefixtures("one_cpu_thread")   # conftest.py: tiny tensors, one intra-op thread


def rel_err(x, ref):
    """Max abs error relative to the reference's largest magnitude; an all-zero reference must be matched exactly."""
    scale, err = ref.double().abs().max().item(), (x.double() - ref.double()).abs().max().item()
    return (0.0 if err == 0.0 else float("inf")) if scale == 0.0 else err / scale


def make_block(d_model, d_state, backend, dtype=torch.float64, seed=0, perturb=True, **options):
    torch.manual_seed(seed)
    block = Mamba(d_model, d_state=d_state, backend=backend, device=DEVICE, dtype=dtype, **options)
    if perturb:   # A, D and the biases off their initial values, to catch a wrong index or a dropped term
        with torch.no_grad():
            block.A_log.add_(0.3 * torch.randn_like(block.A_log))
            block.D.add_(0.5 * torch.randn_like(block.D))
            for name, p in block.named_parameters():
                if name.endswith("bias"):
                    p.add_(0.2 * torch.randn_like(p))
    return block


def reference_forward(P, hidden, d_conv, d_state, dt_rank):
    """mamba_ssm's Mamba.forward (use_fast_path=False) in float64, from parameters P (name -> tensor)."""
    length = hidden.shape[1]
    xz = F.linear(hidden, P["in_proj.weight"], P.get("in_proj.bias")).transpose(1, 2)   # batch x 2 d_inner x L
    x, z = xz.chunk(2, dim=1)
    x = F.silu(F.conv1d(x, P["conv1d.weight"], P.get("conv1d.bias"), padding=d_conv - 1,
                        groups=x.shape[1])[..., :length])
    x_dbl = F.linear(x.transpose(1, 2), P["x_proj.weight"])                             # batch x L x (R + 2N)
    dt, B, C = torch.split(x_dbl, [dt_rank, d_state, d_state], dim=-1)
    delta = F.linear(dt, P["dt_proj.weight"]).transpose(1, 2)                           # batch x d_inner x L
    A = -torch.exp(P["A_log"])
    y = selective_scan_ref(x, delta, A, B.transpose(1, 2), C.transpose(1, 2), P["D"], z=z,
                           delta_bias=P["dt_proj.bias"], delta_softplus=True)
    return F.linear(y.transpose(1, 2), P["out_proj.weight"], P.get("out_proj.bias"))


def compare_with_reference(block, length, batch, seed=1):
    """Relative errors of the block's output, input gradient and every parameter's gradient against
    reference_forward on float64 copies of the same parameters and input."""
    dtype = block.in_proj.weight.dtype
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, block.d_model, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    hidden.requires_grad_(True)
    out = block(hidden)
    weight = torch.randn(out.shape, generator=g, dtype=torch.float64).to(DEVICE)
    (out.double() * weight).sum().backward()
    P = {name: p.detach().double().requires_grad_(True) for name, p in block.named_parameters()}
    hidden64 = hidden.detach().double().requires_grad_(True)
    ref = reference_forward(P, hidden64, block.d_conv, block.d_state, block.dt_rank)
    (ref * weight).sum().backward()
    assert out.dtype == dtype and out.shape == ref.shape
    errors = {"out": rel_err(out, ref), "hidden_states.grad": rel_err(hidden.grad, hidden64.grad)}
    for name, p in block.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        errors[name] = rel_err(p.grad, P[name].grad)
    return errors


# ----------------------------------------------------------------------------------------- the forward pass
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("length", TRITON_LENGTHS)
def test_triton_block_matches_float64_reference(length, dtype):
    sizes = dict(TRITON)
    batch = sizes.pop("batch")
    errors = compare_with_reference(make_block(**sizes, backend="triton", dtype=dtype), length, batch)
    assert max(errors.values()) < TOL[dtype], errors


VARIANTS = [dict(bias=True), dict(conv_bias=False), dict(bias=True, conv_bias=False, d_conv=3),
            dict(d_model=3, d_state=3, dt_rank=2, expand=3, d_conv=2, batch=2)]


@pytest.mark.parametrize("options", VARIANTS, ids=["bias", "no_conv_bias", "bias_no_conv_bias_d_conv3", "odd_sizes_d_conv2"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_block_variants_match_float64_reference(backend, options):
    sizes = dict(TRITON if backend == "triton" else TORCH)
    options = dict(options)
    batch = options.pop("batch", sizes.pop("batch"))
    sizes.pop("batch", None)
    sizes.update({k: options.pop(k) for k in ("d_model", "d_state") if k in options})
    block = make_block(**sizes, backend=backend, dtype=torch.float32, **options)
    assert (block.in_proj.bias is not None) == options.get("bias", False)
    assert (block.conv1d.bias is not None) == options.get("conv_bias", True)
    errors = compare_with_reference(block, 7 if backend == "triton" else 129, batch)
    assert max(errors.values()) < TOL[torch.float32], errors


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("length", [1, 7, 129, 1000])
def test_torch_block_matches_float64_reference(length, dtype):
    sizes = dict(TORCH)
    batch = sizes.pop("batch")
    errors = compare_with_reference(make_block(**sizes, backend="torch", dtype=dtype), length, batch)
    assert max(errors.values()) < TOL[dtype], errors


def test_reference_comparison_catches_an_injected_bug():
    """The sketch's bug (C taken as B) in the block's selection must fail the comparison."""
    block = make_block(**{k: v for k, v in TORCH.items() if k != "batch"}, backend="torch")
    good = block.ssm_parameters
    block.ssm_parameters = lambda x: (lambda d, B, C: (d, B, B))(*good(x))
    errors = compare_with_reference(block, 7, TORCH["batch"])
    assert errors["out"] > 1e-3, errors


def test_triton_block_gradcheck_input():
    block = make_block(2, 2, backend="triton", dtype=torch.float64)
    hidden = torch.randn(1, 2, 2, dtype=torch.float64, device=DEVICE, requires_grad=True)
    assert torch.autograd.gradcheck(block, (hidden,), fast_mode=False)


class _Copies(TorchDispatchMode):
    """Records every copy an operation makes (clone, contiguous, copy_, a dtype cast): its name and size."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("clone", "contiguous", "copy_", "_to_copy"):
            source = args[1] if name == "copy_" else args[0]
            self.seen.append((name, tuple(source.shape), source.numel()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_block_training_step_copies_no_activation(dtype, monkeypatch):
    """One forward+backward of the block on its kernels copies nothing of an activation's size (d_inner
    values per position): the projections read and write (features, batch L) matrices, the scan writes in
    its input's layout. What is left is small: dB and dC into x_proj's output gradient (N values per
    position each; in bf16 the scan casts the two in one op, 2N), casts of parameters and of those
    gradients. And the output gradient reaches the scan's
    backward with stride 1 along L (out_proj's backward returns it in y's layout)."""
    batch, length, d_model, d_state = 2, 12, 8, 4
    fast = sys.modules["scan_lib.fast_selective_scan"]
    backward, dout_strides = fast.run_backward, []

    def recording_backward(*args):
        dout_strides.append(args[10].stride())   # run_backward(plan, u, delta, A, B, C, D, z, bias, states, dout, dlast)
        return backward(*args)
    monkeypatch.setattr(fast, "run_backward", recording_backward)
    block = Mamba(d_model, d_state=d_state, backend="triton", device=DEVICE, dtype=dtype)
    hidden = torch.randn(batch, length, d_model, device=DEVICE, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(hidden)
    with _Copies() as copies:
        block(hidden).backward(grad)
    per_position = {numel // (batch * length) for _, _, numel in copies.seen if numel >= batch * length}
    assert 2 * d_state < block.d_inner and all(values <= 2 * d_state for values in per_position), copies.seen
    assert len(dout_strides) == 1 and dout_strides[0][-1] == 1, dout_strides
    assert hidden.grad is not None and block.in_proj.weight.grad is not None


# ---------------------------------------------------------------------------- parameters and initialisation
def mamba_ssm_layout(d_model, d_state=16, d_conv=4, expand=2, dt_rank="auto", conv_bias=True, bias=False):
    """The names and shapes of mamba_ssm.modules.mamba_simple.Mamba(d_model, ...).state_dict()."""
    d_inner = expand * d_model
    rank = math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank
    layout = {"A_log": (d_inner, d_state), "D": (d_inner,), "in_proj.weight": (2 * d_inner, d_model),
              "conv1d.weight": (d_inner, 1, d_conv), "x_proj.weight": (rank + 2 * d_state, d_inner),
              "dt_proj.weight": (d_inner, rank), "dt_proj.bias": (d_inner,), "out_proj.weight": (d_model, d_inner)}
    if conv_bias:
        layout["conv1d.bias"] = (d_inner,)
    if bias:
        layout.update({"in_proj.bias": (2 * d_inner,), "out_proj.bias": (d_model,)})
    return layout


LAYOUTS = [dict(d_model=40), dict(d_model=16), dict(d_model=17, d_state=8, d_conv=3, expand=3, conv_bias=False, bias=True),
           dict(d_model=24, dt_rank=5, d_conv=2)]


@pytest.mark.parametrize("options", LAYOUTS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_state_dict_layout_is_mamba_ssms(options):
    block = Mamba(**options, backend="torch")
    shapes = {name: tuple(t.shape) for name, t in block.state_dict().items()}
    assert shapes == mamba_ssm_layout(**options)
    assert block.dt_rank == (math.ceil(options["d_model"] / 16) if "dt_rank" not in options else options["dt_rank"])


@pytest.mark.parametrize("options", LAYOUTS[2:], ids=["bias", "dt_rank"])
def test_state_dict_round_trip_gives_identical_outputs(options):
    options = dict(options)
    block = make_block(options.pop("d_model"), options.pop("d_state", 16), "torch", torch.float32, **options)
    fresh = Mamba(block.d_model, d_state=block.d_state, backend="torch", device=DEVICE, **options)
    hidden = torch.randn(2, 9, block.d_model, device=DEVICE)
    assert not torch.equal(fresh(hidden), block(hidden))
    fresh.load_state_dict(block.state_dict())
    assert torch.equal(fresh(hidden), block(hidden))


def test_A_log_and_D_stay_float32_in_a_bf16_block():
    block = Mamba(32, dtype=torch.bfloat16, backend="torch")
    dtypes = {name: p.dtype for name, p in block.named_parameters()}
    assert dtypes.pop("A_log") == torch.float32 and dtypes.pop("D") == torch.float32
    assert set(dtypes.values()) == {torch.bfloat16}
    assert block(torch.randn(1, 5, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_seeded_construction_is_deterministic():
    def state(seed):
        torch.manual_seed(seed)
        return Mamba(20, d_state=8, bias=True, backend="torch").state_dict()
    first, second, other = state(3), state(3), state(4)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["in_proj.weight"], other["in_proj.weight"])
    assert not torch.equal(first["dt_proj.bias"], other["dt_proj.bias"])


@pytest.mark.parametrize("dt_min, dt_max", [(0.001, 0.1), (0.01, 0.02)])
def test_dt_bias_init_within_dt_min_dt_max(dt_min, dt_max):
    torch.manual_seed(0)
    block = Mamba(64, dt_min=dt_min, dt_max=dt_max, backend="torch")
    dt = F.softplus(block.dt_proj.bias.detach().double())
    assert dt.min() >= dt_min * (1 - 1e-5) and dt.max() <= dt_max * (1 + 1e-5)
    # log-uniform: the logs spread over the interval, not bunched at one end
    spread = (dt.log().max() - dt.log().min()) / (math.log(dt_max) - math.log(dt_min))
    assert spread > 0.8
    assert block.dt_proj.bias._no_reinit


def test_dt_bias_init_floor():
    torch.manual_seed(0)
    block = Mamba(16, dt_min=1e-6, dt_max=1e-5, dt_init_floor=1e-4, backend="torch")
    dt = F.softplus(block.dt_proj.bias.detach().double())
    assert torch.allclose(dt, torch.full_like(dt, 1e-4), rtol=1e-4)


def test_inverse_softplus():
    y = torch.tensor([1e-6, 1e-4, 1e-2, 0.5, 3.0, 20.0], dtype=torch.float64)
    assert torch.allclose(F.softplus(inverse_softplus(y)), y, rtol=1e-10, atol=0)


def test_A_init_is_minus_one_to_N():
    block = Mamba(8, d_state=5, backend="torch")
    expected = -torch.arange(1.0, 6.0).repeat(block.d_inner, 1)
    assert torch.allclose(-torch.exp(block.A_log.detach()), expected, rtol=1e-6)
    assert torch.equal(s4d_real_A(3, 4), torch.arange(1.0, 5.0).repeat(3, 1))
    assert torch.equal(block.D.detach(), torch.ones(block.d_inner))
    assert block.A_log._no_weight_decay and block.D._no_weight_decay


@pytest.mark.parametrize("dt_scale", [1.0, 2.5])
def test_dt_init_constant_and_random(dt_scale):
    std = math.ceil(40 / 16) ** -0.5 * dt_scale
    constant = Mamba(40, dt_init="constant", dt_scale=dt_scale, backend="torch").dt_proj.weight.detach()
    assert torch.allclose(constant, torch.full_like(constant, std))
    random = Mamba(40, dt_init="random", dt_scale=dt_scale, backend="torch").dt_proj.weight.detach()
    assert random.abs().max() <= std and random.std() > 0.3 * std


def test_invalid_dt_init_raises():
    with pytest.raises(ValueError, match="dt_init"):
        Mamba(8, dt_init="uniform", backend="torch")


# ------------------------------------------------------------------------------------ inference three ways
def three_ways(backend, length, chunks, d_model, d_state, batch, dtype=torch.float64, seed=0):
    """Max differences of chunked and token-by-token outputs from the whole sequence's, and of the cached
    states from the token-by-token ones; and how many chunks went through step. The input is a strided view."""
    block = make_block(d_model, d_state, backend, dtype=dtype, seed=seed, layer_idx=3)
    hidden = torch.randn(batch, length, 2 * d_model, device=DEVICE, dtype=dtype)[..., ::2]   # not contiguous
    calls = []
    step = block.step
    block.step = lambda *args: calls.append(args[0].shape[1]) or step(*args)
    with torch.no_grad():
        whole = block(hidden)
        params = InferenceParams(max_seqlen=length, max_batch_size=batch)
        pieces, start = [], 0
        for size in chunks:
            pieces.append(block(hidden[:, start:start + size], params))
            params.seqlen_offset += size
            start += size
        assert start == length
        chunked = torch.cat(pieces, dim=1)
        n_step_chunks = len(calls)
        conv_state, ssm_state = block.allocate_inference_cache(batch, length)
        assert conv_state.dtype == dtype and ssm_state.dtype == dtype
        tokens = torch.cat([step(hidden[:, t:t + 1], conv_state, ssm_state)[0] for t in range(length)], 1)
    cached_conv, cached_ssm = params.key_value_memory_dict[3]
    return {"chunks": rel_err(chunked, whole), "tokens": rel_err(tokens, whole),
            "conv_state": rel_err(cached_conv, conv_state), "ssm_state": rel_err(cached_ssm, ssm_state)}, n_step_chunks


def expected_step_chunks(chunks):
    return sum(1 for i, size in enumerate(chunks) if size == 1 and i > 0)


THREE_WAYS = [("triton", 1, [1]), ("triton", 7, [1, 2, 4]),
              ("triton", 24 if not ON_GPU else 1000, [10, 1, 13] if not ON_GPU else [500, 1, 299, 200]),
              ("torch", 1, [1]), ("torch", 7, [2, 1, 4]), ("torch", 129, [64, 1, 64]), ("torch", 1000, [500, 300, 1, 199])]


@pytest.mark.parametrize("backend, length, chunks", THREE_WAYS, ids=[f"{b}-L{n}-{c}" for b, n, c in THREE_WAYS])
def test_inference_three_ways_agree(backend, length, chunks):
    sizes = TRITON if backend == "triton" else TORCH
    diffs, n_step_chunks = three_ways(backend, length, chunks, **sizes)
    assert max(diffs.values()) < 1e-10, diffs
    assert n_step_chunks == expected_step_chunks(chunks)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_step_float32_matches_forward(backend):
    sizes = TRITON if backend == "triton" else TORCH
    diffs, _ = three_ways(backend, 7, [3, 1, 3], **sizes, dtype=torch.float32)
    assert max(diffs.values()) < 1e-5, diffs


# ------------------------------------------------------------------------------------ selective_state_update
def step_inputs(batch, dim, n, dtype, seed=0, strided=True):
    """state, x, dt, A, B, C, D, z, dt_bias; x, dt, z, B, C as column slices of bigger tensors (stride 1 along
    the last dimension, row strides larger than their widths) when strided."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, pad=3):
        if not strided or len(shape) == 1:
            return torch.randn(*shape, generator=g, dtype=dtype).to(DEVICE)
        big = torch.randn(shape[0], shape[1] + pad, generator=g, dtype=dtype).to(DEVICE)
        return big[:, 1:1 + shape[1]]
    state = torch.randn(batch, dim, n, generator=g, dtype=dtype).to(DEVICE)
    A = -(0.5 + torch.rand(dim, n, generator=g, dtype=dtype)).to(DEVICE)
    return dict(state=state, x=rand(batch, dim), dt=0.5 * rand(batch, dim), A=A, B=rand(batch, n), C=rand(batch, n),
                D=rand(dim), z=rand(batch, dim), dt_bias=0.3 * rand(dim))


STEP_OPTIONS = [dict(D=True, z=True, dt_bias=True, softplus=True), dict(D=False, z=False, dt_bias=False, softplus=False),
                dict(D=True, z=False, dt_bias=True, softplus=False), dict(D=False, z=True, dt_bias=False, softplus=True)]


@pytest.mark.parametrize("options", STEP_OPTIONS, ids=lambda o: "-".join(k for k, v in o.items() if v) or "plain")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_selective_state_update_matches_one_scan_step(dtype, options):
    t = step_inputs(2, 5, 3, dtype)
    assert t["x"].stride(0) != t["x"].shape[1] and t["B"].stride(-1) == 1
    kw = dict(D=t["D"] if options["D"] else None, z=t["z"] if options["z"] else None,
              dt_bias=t["dt_bias"] if options["dt_bias"] else None)
    h0 = t["state"].clone()
    state = t["state"]
    pointer = state.data_ptr()
    y = selective_state_update(state, t["x"], t["dt"], t["A"], t["B"], t["C"], **kw, dt_softplus=options["softplus"])
    assert y.dtype == dtype and y.shape == t["x"].shape
    assert state.data_ptr() == pointer
    col = lambda v: None if v is None else v[..., None]   # noqa: E731  (batch x dim -> batch x dim x 1)
    args = (t["x"][..., None], t["dt"][..., None], t["A"], t["B"][..., None], t["C"][..., None], kw["D"], col(kw["z"]),
            kw["dt_bias"], options["softplus"])
    y_loop, h_loop = selective_scan_loop(*args, return_last_state=True, initial_state=h0)
    y_ref, h_ref = selective_scan_ref(*args, return_last_state=True, initial_state=h0)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_err(y, y_ref[..., 0]) < tol and rel_err(state, h_ref) < tol
    assert rel_err(y, y_loop[..., 0]) < tol and rel_err(state, h_loop) < tol
    assert not torch.equal(state, h0)


@pytest.mark.parametrize("batch, dim", [(0, 5), (2, 0)], ids=["batch0", "dim0"])
def test_selective_state_update_of_an_empty_step_launches_nothing(batch, dim, monkeypatch):
    """An empty y and the state as it was, without a kernel launch (issue 21's host time for empty calls)."""
    import scan_lib.mamba as module
    monkeypatch.setattr(module, "selective_state_update_kernel", None)   # a launch would raise TypeError
    t = step_inputs(batch, dim, 3, torch.float32, strided=False)
    state_before = t["state"].clone()
    y = selective_state_update(**t, dt_softplus=True)
    assert y.shape == (batch, dim) and torch.equal(t["state"], state_before)


@pytest.mark.parametrize("batch, dim, n", [(1, 1, 1), (2, 300, 16), (3, 200, 17)])
def test_selective_state_update_shapes(batch, dim, n):
    """Several programs along the channels (the last one masked), N not a power of two."""
    t = step_inputs(batch, dim, n, torch.float64)
    h0 = t["state"].clone()
    y = selective_state_update(**t, dt_softplus=True)
    y_ref, h_ref = selective_scan_ref(t["x"][..., None], t["dt"][..., None], t["A"], t["B"][..., None],
                                      t["C"][..., None], t["D"], t["z"][..., None], t["dt_bias"], True,
                                      return_last_state=True, initial_state=h0)
    assert rel_err(y, y_ref[..., 0]) < 1e-12 and rel_err(t["state"], h_ref) < 1e-12


def test_selective_state_update_strided_A():
    """A as a column slice of a bigger tensor (stride 1 along N, row stride 2N): the check accepts it, so
    the kernel must read it with its row stride."""
    t = step_inputs(2, 5, 3, torch.float64)
    A = torch.cat([t["A"], -torch.ones_like(t["A"])], dim=1)[:, :3]
    assert A.stride() == (6, 1) and torch.equal(A, t["A"])
    h0 = t["state"].clone()
    y = selective_state_update(t["state"], t["x"], t["dt"], A, t["B"], t["C"], t["D"], t["z"], t["dt_bias"], True)
    y_ref, h_ref = selective_scan_ref(t["x"][..., None], t["dt"][..., None], t["A"], t["B"][..., None],
                                      t["C"][..., None], t["D"], t["z"][..., None], t["dt_bias"], True,
                                      return_last_state=True, initial_state=h0)
    assert rel_err(y, y_ref[..., 0]) < 1e-12 and rel_err(t["state"], h_ref) < 1e-12


def test_selective_state_update_transposed_dt_B_C():
    """dt, B and C as the block's step passes them, columns of (features, batch) matrices (stride 1 along
    the batch): the kernel reads them with their element strides."""
    t = step_inputs(3, 5, 4, torch.float64)
    h0 = t["state"].clone()
    columns = {name: t[name].t().contiguous().t() for name in ("dt", "B", "C")}
    assert all(v.stride() == (1, v.shape[0]) for v in columns.values())
    y = selective_state_update(t["state"], t["x"], columns["dt"], t["A"], columns["B"], columns["C"], t["D"],
                               t["z"], t["dt_bias"], True)
    y_ref, h_ref = selective_scan_ref(t["x"][..., None], t["dt"][..., None], t["A"], t["B"][..., None],
                                      t["C"][..., None], t["D"], t["z"][..., None], t["dt_bias"], True,
                                      return_last_state=True, initial_state=h0)
    assert rel_err(y, y_ref[..., 0]) < 1e-12 and rel_err(t["state"], h_ref) < 1e-12


def test_selective_state_update_mixed_state_dtype():
    """A float32 state with float64 inputs: the update runs in float64 and stores float32."""
    t = step_inputs(1, 4, 2, torch.float64, strided=False)
    h0 = t["state"].float()
    state = h0.clone()
    selective_state_update(state, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"], t["dt_bias"], True)
    _, h_ref = selective_scan_ref(t["x"][..., None], t["dt"][..., None], t["A"], t["B"][..., None], t["C"][..., None],
                                  t["D"], t["z"][..., None], t["dt_bias"], True, return_last_state=True, initial_state=h0)
    assert state.dtype == torch.float32 and rel_err(state, h_ref) < 1e-6


def test_selective_state_update_refuses_autograd():
    t = step_inputs(1, 4, 2, torch.float64, strided=False)
    x = t.pop("x").requires_grad_(True)
    with pytest.raises(RuntimeError, match="selective_state_update.*no autograd"):
        selective_state_update(x=x, **t)
    with torch.no_grad():
        selective_state_update(x=x, **t)


BAD_SHAPES = {"state": lambda t: t["state"][0], "x": lambda t: t["x"][:, :-1], "dt": lambda t: t["dt"][:1],
              "A": lambda t: t["A"][:, :-1], "B": lambda t: t["B"][:, :-1], "C": lambda t: t["C"][:1],
              "D": lambda t: t["D"][:-1], "z": lambda t: t["z"][:, :-1], "dt_bias": lambda t: t["dt_bias"][None]}


@pytest.mark.parametrize("name", list(BAD_SHAPES))
def test_selective_state_update_bad_shape_names_argument(name):
    t = step_inputs(2, 4, 3, torch.float64)
    t[name] = BAD_SHAPES[name](t)
    with pytest.raises(ValueError, match=f"^{name} must have shape"):
        selective_state_update(**t)


@pytest.mark.parametrize("name", ["x", "z", "A", "dt_bias"])
def test_selective_state_update_bad_layout_or_dtype_names_argument(name):
    t = step_inputs(2, 4, 3, torch.float64)
    t[name] = t[name].to(torch.int64)
    with pytest.raises(TypeError, match=f"^{name} must"):
        selective_state_update(**t)
    t = step_inputs(2, 4, 3, torch.float64)
    v = t[name]
    t[name] = torch.stack([v, v], dim=-1)[..., 0]   # same shape, stride 2 along the last dimension
    with pytest.raises(ValueError, match=f"^{name} must have stride 1"):
        selective_state_update(**t)
    t = step_inputs(2, 4, 3, torch.float64)
    t["state"] = t["state"].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="^state must be contiguous"):
        selective_state_update(**t)


# ----------------------------------------------------------------------------------------------- bad input
def small_block(**options):
    return Mamba(4, d_state=2, backend="torch", **options)


@pytest.mark.parametrize("hidden, error, pattern", [
    (torch.randn(1, 5, 3), ValueError, r"hidden_states must have shape \(batch, L, d_model=4\)"),
    (torch.randn(5, 4), ValueError, r"hidden_states must have shape"),
    (torch.randn(1, 1, 5, 4), ValueError, r"hidden_states must have shape"),
    (torch.randn(1, 0, 4), ValueError, r"hidden_states must hold at least one position"),
    (torch.ones(1, 5, 4, dtype=torch.int64), TypeError, r"hidden_states must be float"),
    (torch.ones(1, 5, 4, dtype=torch.float64), TypeError, r"hidden_states must have the block's dtype torch.float32"),
    ([[0.0] * 4], TypeError, r"hidden_states must be a torch.Tensor"),
], ids=["d_model", "rank2", "rank4", "empty_L", "int64", "float64", "list"])
def test_forward_bad_hidden_states(hidden, error, pattern):
    with pytest.raises(error, match=pattern):
        small_block()(hidden)


def test_step_bad_input():
    block = small_block()
    conv_state, ssm_state = block.allocate_inference_cache(2, 10)
    with pytest.raises(ValueError, match="step takes one position"):
        block.step(torch.randn(2, 3, 4), conv_state, ssm_state)
    token = torch.randn(2, 1, 4)
    with pytest.raises(ValueError, match=r"^conv_state must have shape \(2, 8, 4\)"):
        block.step(token, conv_state[:, :, 1:].contiguous(), ssm_state)
    with pytest.raises(ValueError, match=r"^ssm_state must have shape \(2, 8, 2\)"):
        block.step(token, conv_state, ssm_state[:1].contiguous())
    with pytest.raises(ValueError, match="^conv_state must be contiguous"):
        block.step(token, conv_state.transpose(1, 2).contiguous().transpose(1, 2), ssm_state)
    with pytest.raises(ValueError, match="^ssm_state must be contiguous"):
        block.step(token, conv_state, ssm_state.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(TypeError, match="^ssm_state must be"):
        block.step(token, conv_state, ssm_state.long())


def test_inference_params_bad_input():
    with pytest.raises(ValueError, match="layer_idx"):
        small_block()(torch.randn(1, 3, 4), InferenceParams(max_seqlen=3, max_batch_size=1))
    block = small_block(layer_idx=0)
    params = InferenceParams(max_seqlen=6, max_batch_size=2)
    block(torch.randn(2, 3, 4), params)
    with pytest.raises(ValueError, match="^conv_state must have shape"):   # cached for batch 2
        block(torch.randn(1, 3, 4), params)


@pytest.mark.parametrize("options, pattern", [(dict(backend="cuda"), "^backend must be"), (dict(d_conv=5), "^d_conv must be"),
                                              (dict(d_conv=1), "^d_conv must be")], ids=["backend_cuda", "d_conv5", "d_conv1"])
def test_constructor_bad_arguments(options, pattern):
    with pytest.raises(ValueError, match=pattern):
        Mamba(4, **options)


def test_default_backend():
    assert Mamba(4).backend == ("triton" if ON_GPU else "torch")


# ------------------------------------------------------------------------------------ mamba_ssm (GPU only)
MambaSSM, MISSING = _mamba_ssm_block() if ON_GPU else (None, "needs a GPU")
needs_mamba_ssm = pytest.mark.skipif(not ON_GPU or MambaSSM is None, reason=MISSING or "needs a GPU")
# mamba_ssm takes its fused path (mamba_inner_fn) only where the causal-conv1d package imported in mamba_simple
FAST_PATHS = [False, True] if getattr(sys.modules.get(getattr(MambaSSM, "__module__", "")), "causal_conv1d_fn", None) else [False]


def ssm_pair(dtype, fast_path, d_model=64, seed=0):
    """scan_lib's block and mamba_ssm's with the same weights: theirs loads ours, a second of ours loads theirs."""
    ours = make_block(d_model, 16, backend="triton", dtype=dtype, seed=seed, layer_idx=0)
    theirs = MambaSSM(d_model, use_fast_path=fast_path, layer_idx=0, device=DEVICE, dtype=dtype)
    theirs.load_state_dict(ours.state_dict())
    back = Mamba(d_model, backend="triton", layer_idx=0, device=DEVICE, dtype=dtype)
    back.load_state_dict(theirs.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(ours.state_dict().values(), back.state_dict().values()))
    assert {k: v.dtype for k, v in ours.state_dict().items()} == {k: v.dtype for k, v in theirs.state_dict().items()}
    return ours, theirs


@needs_mamba_ssm
@pytest.mark.parametrize("fast_path", FAST_PATHS, ids=lambda f: "fast_path" if f else "unfused")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-4), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
def test_block_matches_mamba_ssm(dtype, tol, fast_path, no_tf32):
    ours, theirs = ssm_pair(dtype, fast_path)
    hidden = torch.randn(2, 1000, 64, device=DEVICE, dtype=dtype)
    weight = torch.randn_like(hidden, dtype=torch.float32)
    results = []
    for m in (ours, theirs):
        x = hidden.clone().requires_grad_(True)
        out = m(x)
        (out.float() * weight).sum().backward()
        results.append((out, x.grad, {name: p.grad for name, p in m.named_parameters()}))
    diffs = {"out": rel_err(results[0][0], results[1][0]), "hidden_states.grad": rel_err(results[0][1], results[1][1])}
    for name, grad in results[0][2].items():
        diffs[name] = rel_err(grad, results[1][2][name])
    assert max(diffs.values()) < tol, diffs


@needs_mamba_ssm
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
def test_step_matches_mamba_ssm(dtype, tol, no_tf32):
    ours, theirs = ssm_pair(dtype, fast_path=False)
    hidden = torch.randn(2, 24, 64, device=DEVICE, dtype=dtype)
    outs, states = [], []
    with torch.no_grad():
        for m in (ours, theirs):
            params = InferenceParams(max_seqlen=24, max_batch_size=2)
            pieces = [m(hidden[:, :16], params)]
            params.seqlen_offset = 16
            for t in range(16, 24):   # one position after the first: both modules run their step
                pieces.append(m(hidden[:, t:t + 1], params))
                params.seqlen_offset += 1
            outs.append(torch.cat(pieces, dim=1))
            states.append(params.key_value_memory_dict[0])
    assert rel_err(outs[0], outs[1]) < tol
    assert rel_err(states[0][0], states[1][0]) < tol and rel_err(states[0][1], states[1][1]) < tol


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_empty_batch_gives_an_empty_result(backend):
    """As torch's modules do: batch 0 in, batch 0 out, and a backward that gives zero gradients."""
    block = Mamba(4, d_state=2, backend=backend, device=DEVICE)
    hidden = torch.randn(0, 5, 4, device=DEVICE, requires_grad=True)
    out = block(hidden)
    assert out.shape == (0, 5, 4)
    grads = torch.autograd.grad(out.sum(), [hidden, *block.parameters()])
    assert grads[0].shape == hidden.shape and not any(g.any() for g in grads)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_reused_inference_params_starts_a_new_prompt_afresh(backend):
    """As mamba_ssm: after reset (seqlen_offset back to 0) the next prompt starts from zero states,
    not from the previous prompt's, and gives what a fresh InferenceParams gives."""
    block = Mamba(4, d_state=2, backend=backend, layer_idx=0, device=DEVICE, dtype=torch.float64)
    first, second = (torch.randn(1, 5, 4, device=DEVICE, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        params = InferenceParams(max_seqlen=8, max_batch_size=1)
        block(first, params)
        params.seqlen_offset += 5
        block(first[:, :1], params)                           # one generation step
        params.reset(max_seqlen=8, max_batch_size=1)
        reused = block(second, params)
        fresh = block(second, InferenceParams(max_seqlen=8, max_batch_size=1))
    assert params.seqlen_offset == 0
    torch.testing.assert_close(reused, fresh, rtol=0, atol=0)
    torch.testing.assert_close(fresh, block(second), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_float32_cache_steps_a_bfloat16_block(backend):
    """allocate_inference_cache(dtype=torch.float32) on a bf16 block, as its docs offer: prefill and steps
    run on both backends and agree with the bf16 cache's outputs to bf16 rounding."""
    block = Mamba(8, d_state=4, backend=backend, layer_idx=0, device=DEVICE, dtype=torch.bfloat16)
    hidden = torch.randn(2, 6, 8, device=DEVICE).to(torch.bfloat16)
    outs = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            params = InferenceParams(max_seqlen=8, max_batch_size=2)
            params.key_value_memory_dict[0] = block.allocate_inference_cache(2, 8, dtype=dtype)
            pieces = [block(hidden[:, :5], params)]
            params.seqlen_offset += 5
            pieces.append(block(hidden[:, 5:], params))
            outs[dtype] = torch.cat(pieces, dim=1)
    assert outs[torch.float32].dtype == torch.bfloat16
    torch.testing.assert_close(outs[torch.float32], outs[torch.bfloat16], rtol=2**-6, atol=2**-6)
