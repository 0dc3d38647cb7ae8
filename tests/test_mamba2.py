"""scan_lib.Mamba2 and scan_lib.RMSNormGated (the Mamba-2 block of notebooks/10_mamba2.py) against an
independent float64 reference of mamba_ssm's Mamba2 (minus tensor parallelism): a loop over positions written
from the recurrence, itself checked against a second, vectorised form (F.conv1d, scan_lib.ssd's chunked scan,
F.rms_norm); the block's output and every gradient on both backends and for each option; gradcheck; mamba_ssm's
parameter layout and initialisation; the seqlen= form; inference three ways (whole, chunks through
InferenceParams, token by token) with their cached states; bad input; RMSNormGated alone; and, on a GPU where
it is installed, mamba_ssm's own module."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import scan_lib  # first: without a GPU it switches Triton to its interpreter, before triton.language loads
from scan_lib import InferenceParams
from scan_lib import Mamba2, RMSNormGated
from scan_lib.mamba import inverse_softplus
from scan_lib.runtime import DEVICE, ON_GPU
from scan_lib.ssd import _mamba_ssm_mamba2, ssd_chunked

# Relative to the reference's largest value. float64 blocks compute in float64 (measured: at most 1.3e-15), but D
# is a float32 parameter in every block, so its gradient is float32's (within_tolerance). float32 blocks (the
# Triton backend's kernels sum in float32; measured at most 4.5e-6): a few hundred products per output, sums
# over every position per gradient.
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}
# Between the block's own three ways of running a prompt (whole, chunks, token by token): the same arithmetic
# up to the order of the sums (float32 measured at 2.3e-7).
AGREE = {torch.float64: 1e-10, torch.float32: 2e-6}


def within_tolerance(errors, dtype):
    """Every error within TOL[dtype], D's gradient (a float32 parameter) within float32's."""
    return all(e < TOL[torch.float32 if name == "D" else dtype] for name, e in errors.items())
RMS_EPS = 1e-5   # mamba_ssm's Mamba2 builds its norm with eps=1e-5

# Sizes: the triton backend runs in Triton's (slow) CPU interpreter without a GPU. 16 x 2 = 32 channels, 4 heads
# of 8; chunk_size 16 (the Triton op's smallest), so L = 40 is two chunks and a part.
SMALL = dict(d_model=16, d_state=8, headdim=8, chunk_size=16)
DT_LIMIT = (0.01, 0.05)   # perturb_'s weights put dt below, inside and above it
# Everything that changes the computation at once: 2 heads of 8 in 2 groups, a gated MLP of 16 channels beside
# them, D per channel, biases on the projections but not on the convolution, the norm before the gate, dt clamped.
EVERYTHING = dict(ngroups=2, D_has_hdim=True, d_ssm=16, bias=True, conv_bias=False, norm_before_gate=True,
                  dt_limit=DT_LIMIT)


pytestmark = pytest.mark.usefixtures("one_cpu_thread")   # conftest.py: tiny tensors, one intra-op thread


def rel_err(x, ref, zero_scale=None):
    """Max abs error relative to the reference's largest magnitude. An all-zero reference must be matched exactly,
    or, where zero_scale is given, the error is taken relative to zero_scale."""
    scale, err = ref.double().abs().max().item(), (x.double() - ref.double().to(x.device)).abs().max().item()
    if scale == 0.0:
        return err / zero_scale if zero_scale else (0.0 if err == 0.0 else float("inf"))
    return err / scale


# ------------------------------------------------------------------------------- the float64 reference
def block_sizes(d_model, d_state=128, d_conv=4, expand=2, headdim=64, d_ssm=None, ngroups=1, D_has_hdim=False,
                rmsnorm=True, norm_before_gate=False, dt_limit=(0.0, math.inf), bias=False, conv_bias=True, **unused):
    """Mamba2(d_model, ...)'s options that the computation depends on, and the sizes they give (mamba_ssm's)."""
    d_inner = expand * d_model
    d_ssm = d_inner if d_ssm is None else d_ssm
    nheads = d_ssm // headdim
    return dict(d_model=d_model, d_state=d_state, d_conv=d_conv, headdim=headdim, ngroups=ngroups,
                D_has_hdim=D_has_hdim, rmsnorm=rmsnorm, norm_before_gate=norm_before_gate, dt_limit=tuple(dt_limit),
                bias=bias, conv_bias=conv_bias, d_inner=d_inner, d_ssm=d_ssm, nheads=nheads, d_mlp=d_inner - d_ssm,
                conv_dim=d_ssm + 2 * ngroups * d_state, d_in_proj=2 * d_inner + 2 * ngroups * d_state + nheads)


def mamba2_layout(sizes):
    """The names and shapes of mamba_ssm.modules.mamba2.Mamba2(...).state_dict() for these sizes."""
    s = sizes
    layout = {"dt_bias": (s["nheads"],), "A_log": (s["nheads"],),
              "D": (s["d_ssm"] if s["D_has_hdim"] else s["nheads"],),
              "in_proj.weight": (s["d_in_proj"], s["d_model"]), "conv1d.weight": (s["conv_dim"], 1, s["d_conv"]),
              "out_proj.weight": (s["d_model"], s["d_inner"])}
    if s["conv_bias"]:
        layout["conv1d.bias"] = (s["conv_dim"],)
    if s["bias"]:
        layout.update({"in_proj.bias": (s["d_in_proj"],), "out_proj.bias": (s["d_model"],)})
    if s["rmsnorm"]:
        layout["norm.weight"] = (s["d_ssm"],)
    return layout


def perturb_(params, sizes, seed=0):
    """In place, on name -> tensor (a block's parameters or a dict of tensors): every parameter off its initial
    value, to catch a wrong index or a dropped term. Decays spread over the heads, from a long memory (head 0:
    dt about 0.01, A about -0.3, across chunks) to a short one; the dt rows of in_proj scaled up so that each
    head's dt spreads over a factor of about 30 (below, inside and above DT_LIMIT)."""
    g = torch.Generator().manual_seed(1000 + seed)
    heads = sizes["nheads"]

    def noise(t, scale):
        return (scale * torch.randn(t.shape, generator=g, dtype=torch.float64)).to(t.device)

    with torch.no_grad():
        device = params["A_log"].device
        A = torch.linspace(0.3, 3.0, heads, dtype=torch.float64, device=device)
        params["A_log"].copy_(torch.log(A) + noise(params["A_log"], 0.1))
        dt = torch.logspace(-2, -0.7, heads, dtype=torch.float64, device=device)
        params["dt_bias"].copy_(inverse_softplus(dt) + noise(params["dt_bias"], 0.1))
        params["in_proj.weight"][-heads:].mul_(3.0)
        params["D"].add_(noise(params["D"], 0.5))
        for name in ("norm.weight", "in_proj.bias", "conv1d.bias", "out_proj.bias"):
            if name in params:
                params[name].add_(noise(params[name], 0.3 if name == "norm.weight" else 0.2))
    return params


def random_parameters(sizes, seed=0):
    """A float64 parameter dict with mamba_ssm's layout and initial-like values, perturbed: the reference's
    checks run on it without a block."""
    g = torch.Generator().manual_seed(seed)
    fan_in = {"in_proj.weight": sizes["d_model"], "conv1d.weight": sizes["d_conv"], "out_proj.weight": sizes["d_inner"]}
    params = {}
    for name, shape in mamba2_layout(sizes).items():
        if name in ("D", "norm.weight"):
            params[name] = torch.ones(shape, dtype=torch.float64)
        elif name in ("A_log", "dt_bias"):
            params[name] = torch.zeros(shape, dtype=torch.float64)
        else:
            params[name] = torch.randn(shape, generator=g, dtype=torch.float64) / math.sqrt(fan_in.get(name, 4))
    return {k: v.to(DEVICE) for k, v in perturb_(params, sizes, seed).items()}


def step_sizes(dt, dt_bias, dt_limit):
    """dt per position and head: softplus(dt + dt_bias), clamped to dt_limit."""
    return torch.clamp(F.softplus(dt + dt_bias), dt_limit[0], dt_limit[1])


def rms_norm_gated_reference(x, weight, z=None, eps=RMS_EPS, group_size=None, norm_before_gate=False):
    """RMSNormGated's formula in float64: gate x by silu(z) (unless norm_before_gate), divide each group of
    group_size features by its root mean square (+ eps under the root), scale by weight, gate after if
    norm_before_gate."""
    x, weight = x.double(), weight.double()
    z = None if z is None else z.double()
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    groups = x.unflatten(-1, (-1, group_size or x.shape[-1]))
    out = (groups / torch.sqrt(groups.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight
    if z is not None and norm_before_gate:
        out = out * F.silu(z)
    return out


def mamba2_reference(params, u, sizes, conv_state=None, ssm_state=None):
    """mamba_ssm's Mamba2 forward in float64, one position at a time, from params (name -> tensor, the block's
    state_dict layout; differentiable). u: (batch, L, d_model); conv_state (batch, conv_dim, d_conv), the last
    d_conv inputs of the convolution, oldest first, and ssm_state (batch, nheads, headdim, d_state) to continue
    from (zeros if None). Returns (out (batch, L, d_model), conv_state, ssm_state) after the last position."""
    s = sizes
    P = {name: t.double() for name, t in params.items()}
    u = u.double()
    batch, length, _ = u.shape
    heads, head_dim, n, groups = s["nheads"], s["headdim"], s["d_state"], s["ngroups"]
    group_of_head = torch.arange(heads, device=u.device) // (heads // groups)
    window = u.new_zeros(batch, s["conv_dim"], s["d_conv"]) if conv_state is None else conv_state.double()
    state = u.new_zeros(batch, heads, head_dim, n) if ssm_state is None else ssm_state.double()
    A = -torch.exp(P["A_log"])                                                      # heads
    D = P["D"].view(heads, head_dim) if s["D_has_hdim"] else P["D"][:, None]        # heads x P, or heads x 1
    outs = []
    for t in range(length):
        zxbcdt = F.linear(u[:, t], P["in_proj.weight"], P.get("in_proj.bias"))
        z0, x0, z, xBC, dt = torch.split(zxbcdt, [s["d_mlp"], s["d_mlp"], s["d_ssm"], s["conv_dim"], heads], dim=-1)
        window = torch.cat([window[:, :, 1:], xBC[:, :, None]], dim=-1)              # newest last
        xBC = (window * P["conv1d.weight"][:, 0]).sum(-1)
        if "conv1d.bias" in P:
            xBC = xBC + P["conv1d.bias"]
        x, B, C = torch.split(F.silu(xBC), [s["d_ssm"], groups * n, groups * n], dim=-1)
        x = x.view(batch, heads, head_dim)
        B = B.view(batch, groups, n)[:, group_of_head]                              # batch x heads x N
        C = C.view(batch, groups, n)[:, group_of_head]
        delta = step_sizes(dt, P["dt_bias"], s["dt_limit"])                          # batch x heads
        state = (torch.exp(delta * A)[:, :, None, None] * state
                 + (delta[:, :, None] * x)[:, :, :, None] * B[:, :, None, :])       # batch x heads x P x N
        y = (torch.einsum("bhpn,bhn->bhp", state, C) + D * x).reshape(batch, s["d_ssm"])
        if s["rmsnorm"]:
            y = rms_norm_gated_reference(y, P["norm.weight"], z, RMS_EPS, s["d_ssm"] // groups, s["norm_before_gate"])
        else:
            y = y * F.silu(z)
        if s["d_mlp"] > 0:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        outs.append(F.linear(y, P["out_proj.weight"], P.get("out_proj.bias")))
    out = torch.stack(outs, dim=1) if outs else u.new_zeros(batch, 0, s["d_model"])
    return out, window, state


def mamba2_vectorised(params, u, sizes, chunk_size=5):
    """The same function written another way, to check the loop: the whole sequence at once, F.conv1d,
    scan_lib.ssd's chunked scan (float64), F.rms_norm over the groups. From zero states; returns the same triple."""
    s = sizes
    P = {name: t.double() for name, t in params.items()}
    u = u.double()
    batch, length, _ = u.shape
    heads, head_dim, n, groups = s["nheads"], s["headdim"], s["d_state"], s["ngroups"]
    zxbcdt = F.linear(u, P["in_proj.weight"], P.get("in_proj.bias"))
    z0, x0, z, xBC, dt = torch.split(zxbcdt, [s["d_mlp"], s["d_mlp"], s["d_ssm"], s["conv_dim"], heads], dim=-1)
    xBC_t = xBC.transpose(1, 2)                                                       # batch x conv_dim x L
    conv_state = torch.cat([xBC_t.new_zeros(batch, s["conv_dim"], s["d_conv"]), xBC_t], dim=-1)[..., -s["d_conv"]:]
    conv = F.conv1d(xBC_t, P["conv1d.weight"], P.get("conv1d.bias"), padding=s["d_conv"] - 1, groups=s["conv_dim"])
    x, B, C = torch.split(F.silu(conv[..., :length]).transpose(1, 2), [s["d_ssm"], groups * n, groups * n], dim=-1)
    x = x.unflatten(-1, (heads, head_dim))
    delta = step_sizes(dt, P["dt_bias"], s["dt_limit"])
    y, ssm_state = ssd_chunked(x, delta, -torch.exp(P["A_log"]), B.unflatten(-1, (groups, n)),
                               C.unflatten(-1, (groups, n)), chunk_size)
    D = P["D"].view(heads, head_dim) if s["D_has_hdim"] else P["D"][:, None]
    y = (y + D * x).flatten(-2)
    if s["rmsnorm"]:
        group_size = s["d_ssm"] // groups
        if not s["norm_before_gate"]:
            y = y * F.silu(z)
        y = F.rms_norm(y.unflatten(-1, (groups, group_size)), (group_size,), eps=RMS_EPS).flatten(-2) * P["norm.weight"]
        if s["norm_before_gate"]:
            y = y * F.silu(z)
    else:
        y = y * F.silu(z)
    if s["d_mlp"] > 0:
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    return F.linear(y, P["out_proj.weight"], P.get("out_proj.bias")), conv_state, ssm_state


def reference_input(sizes, length, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, sizes["d_model"], generator=g, dtype=torch.float64).to(DEVICE)


def unclamped_steps(params, u, sizes):
    """softplus(dt + dt_bias) at every position before the clamp: (batch, L, nheads)."""
    zxbcdt = F.linear(u.double(), params["in_proj.weight"].double(),
                      None if "in_proj.bias" not in params else params["in_proj.bias"].double())
    return F.softplus(zxbcdt[..., -sizes["nheads"]:] + params["dt_bias"].double())


# The reference's own checks: they need no block.
REFERENCE_OPTIONS = [{}, dict(ngroups=2), dict(D_has_hdim=True), dict(rmsnorm=False),
                     dict(norm_before_gate=True, ngroups=2), dict(d_ssm=16), dict(bias=True, conv_bias=False, d_conv=3),
                     dict(dt_limit=DT_LIMIT), EVERYTHING]
REFERENCE_IDS = ["default", "ngroups2", "D_has_hdim", "no_rmsnorm", "norm_before_gate", "d_mlp",
                 "bias_no_conv_bias_d_conv3", "dt_limit", "everything"]


@pytest.mark.parametrize("options", REFERENCE_OPTIONS, ids=REFERENCE_IDS)
@pytest.mark.parametrize("length", [1, 3, 23])
def test_reference_loop_matches_the_vectorised_form(options, length):
    """Output and final states of the loop against the whole-sequence form, which shares no code with it but
    step_sizes (the chunked scan is scan_lib.ssd's float64 ssd_chunked, in chunks of 5)."""
    sizes = block_sizes(**{**SMALL, **options})
    params = random_parameters(sizes, seed=length)
    u = reference_input(sizes, length)
    got, want = mamba2_reference(params, u, sizes), mamba2_vectorised(params, u, sizes)
    for name, g, w in zip(["out", "conv_state", "ssm_state"], got, want):
        assert g.shape == w.shape and rel_err(g, w) < 1e-12, name


@pytest.mark.parametrize("options", [{}, EVERYTHING], ids=["default", "everything"])
def test_reference_continues_from_its_states(options):
    """The loop in pieces, each from the states the last left, gives what it gives on the whole sequence:
    what chunked prefill and token-by-token generation must give."""
    sizes = block_sizes(**{**SMALL, **options})
    params = random_parameters(sizes, seed=3)
    u = reference_input(sizes, 23)
    whole, conv_state, ssm_state = mamba2_reference(params, u, sizes)
    pieces, states = [], (None, None)
    for start, stop in [(0, 2), (2, 3), (3, 17), (17, 23)]:
        out, *states = mamba2_reference(params, u[:, start:stop], sizes, *states)
        pieces.append(out)
    assert rel_err(torch.cat(pieces, 1), whole) < 1e-13
    assert rel_err(states[0], conv_state) < 1e-13 and rel_err(states[1], ssm_state) < 1e-13


def test_reference_states_have_mamba_ssms_meaning():
    """The conv state holds the convolution's last d_conv inputs (xBC before the convolution), oldest first,
    zeros before the first position, as mamba_ssm's forward leaves it (F.pad of xBC); the SSM state is
    zero before any position."""
    sizes = block_sizes(**SMALL)
    params = random_parameters(sizes)
    u = reference_input(sizes, 2)
    _, conv_state, ssm_state = mamba2_reference(params, u, sizes)
    xBC = F.linear(u, params["in_proj.weight"])[..., 2 * sizes["d_mlp"] + sizes["d_ssm"]:-sizes["nheads"]]
    assert torch.equal(conv_state[..., :2], torch.zeros_like(conv_state[..., :2]))
    assert rel_err(conv_state[..., 2:], xBC.transpose(1, 2)) < 1e-14
    assert ssm_state.abs().max() > 0
    _, empty_conv, empty_ssm = mamba2_reference(params, u[:, :0], sizes)
    assert not empty_conv.any() and not empty_ssm.any()


def test_reference_dt_limit_binds_on_these_weights():
    """perturb_'s weights put softplus(dt + dt_bias) below, inside and above DT_LIMIT, so the dt_limit cases
    test the clamp (and the clamp changes the output)."""
    sizes = block_sizes(**SMALL, dt_limit=DT_LIMIT)
    params = random_parameters(sizes)
    u = reference_input(sizes, 40)
    steps = unclamped_steps(params, u, sizes)
    assert (steps < DT_LIMIT[0]).any() and (steps > DT_LIMIT[1]).any()
    assert ((steps > DT_LIMIT[0]) & (steps < DT_LIMIT[1])).any()
    unclamped = mamba2_reference(params, u, block_sizes(**SMALL))[0]
    assert rel_err(mamba2_reference(params, u, sizes)[0], unclamped) > 1e-3


@pytest.mark.parametrize("group_size", [None, 4])
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_rms_norm_reference_matches_torch_rms_norm(norm_before_gate, group_size):
    g = torch.Generator().manual_seed(0)
    x, z = (torch.randn(3, 5, 12, generator=g, dtype=torch.float64) for _ in range(2))
    weight = 1 + 0.3 * torch.randn(12, generator=g, dtype=torch.float64)
    size = group_size or 12
    gated = x if norm_before_gate else x * F.silu(z)
    want = F.rms_norm(gated.unflatten(-1, (-1, size)), (size,), eps=RMS_EPS).flatten(-2) * weight
    want = want * F.silu(z) if norm_before_gate else want
    got = rms_norm_gated_reference(x, weight, z, RMS_EPS, group_size, norm_before_gate)
    assert rel_err(got, want) < 1e-14
    no_gate = F.rms_norm(x.unflatten(-1, (-1, size)), (size,), eps=RMS_EPS).flatten(-2) * weight
    assert rel_err(rms_norm_gated_reference(x, weight, None, RMS_EPS, group_size, norm_before_gate), no_gate) < 1e-14


# ---- end of the reference: the tests of scan_lib.Mamba2 and RMSNormGated follow ----
def make_block(backend, dtype=torch.float64, seed=0, perturb=True, **options):
    """Mamba2 built with options (d_model among them) on DEVICE, perturbed; and the reference's sizes."""
    torch.manual_seed(seed)
    block = Mamba2(**options, backend=backend, device=DEVICE, dtype=dtype)
    sizes = block_sizes(**options)
    if perturb:
        perturb_(dict(block.named_parameters()), sizes, seed)
    return block, sizes


def reference_parameters(block):
    """The block's state_dict as float64 leaves (the reference's gradients land in their .grad)."""
    return {name: t.detach().double().requires_grad_(True) for name, t in block.state_dict().items()}


def compare_with_reference(block, sizes, length, batch=2, seed=1):
    """Relative errors of the block's output, input gradient and every parameter's gradient against the
    reference on float64 copies of the same parameters and input. A gradient that is exactly zero in the
    reference (A_log's at L = 1: the one step's decay multiplies the zero initial state) comes out of the
    kernels as terms that cancel, which a GPU's fused multiply-adds leave at rounding size: its error is
    taken relative to the largest reference gradient of the block instead."""
    dtype = block.in_proj.weight.dtype
    u64 = reference_input(sizes, length, batch, seed)
    u = u64.to(dtype).requires_grad_(True)
    out = block(u)
    assert out.dtype == dtype and out.shape == (batch, length, sizes["d_model"])
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(DEVICE)
    (out.double() * weight).sum().backward()
    params = reference_parameters(block)
    u_ref = u.detach().double().requires_grad_(True)
    ref = mamba2_reference(params, u_ref, sizes)[0]
    (ref * weight).sum().backward()
    errors = {"out": rel_err(out, ref.detach()), "u.grad": rel_err(u.grad, u_ref.grad)}
    named = dict(block.named_parameters())
    assert set(named) == set(params), "the parameters are the state_dict's entries"
    gradient_scale = max(p.grad.abs().max().item() for p in [u_ref, *params.values()])
    for name, p in named.items():
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.dtype == p.dtype, name
        errors[name] = rel_err(p.grad, params[name].grad, zero_scale=gradient_scale)
    return errors


# ----------------------------------------------------------------------------------------- the forward pass
BLOCK_OPTIONS = list(zip(REFERENCE_IDS, REFERENCE_OPTIONS)) + [("use_mem_eff_path_False", dict(use_mem_eff_path=False))]


@pytest.mark.parametrize("name, options", BLOCK_OPTIONS, ids=[name for name, _ in BLOCK_OPTIONS])
def test_torch_block_matches_float64_reference(name, options):
    """Output and every gradient, float64, L = 40: two chunks of 16 and a part."""
    block, sizes = make_block("torch", **SMALL, **options)
    if sizes["dt_limit"] != (0.0, math.inf):   # the clamp binds on these weights and this input
        steps = unclamped_steps(block.state_dict(), reference_input(sizes, 40), sizes)
        assert (steps < sizes["dt_limit"][0]).any() and (steps > sizes["dt_limit"][1]).any()
    errors = compare_with_reference(block, sizes, 40)
    assert within_tolerance(errors, torch.float64), errors


@pytest.mark.parametrize("length, chunk_size", [(1, 16), (16, 16), (17, 16), (40, 256)],
                         ids=["L1", "L16_one_whole_chunk", "L17", "L40_default_chunk_size"])
def test_torch_block_lengths_match_float64_reference(length, chunk_size):
    block, sizes = make_block("torch", **dict(SMALL, chunk_size=chunk_size))
    errors = compare_with_reference(block, sizes, length)
    assert within_tolerance(errors, torch.float64), errors


def test_torch_block_float32_matches_float64_reference(no_tf32):
    """The torch backend convolves with F.conv1d, where cuDNN allows TF32 by default on a GPU: full float32 here."""
    block, sizes = make_block("torch", torch.float32, **SMALL, **EVERYTHING)
    errors = compare_with_reference(block, sizes, 40)
    assert within_tolerance(errors, torch.float32), errors


TRITON_CASES = [("default", {}, 40), ("everything", EVERYTHING, 33),
                ("no_rmsnorm_ngroups2_D_has_hdim_L1", dict(rmsnorm=False, ngroups=2, D_has_hdim=True, d_conv=3), 1)]


@pytest.mark.parametrize("name, options, length", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_block_matches_float64_reference(name, options, length):
    """The Triton backend's kernels compute in float32: a float32 block against the float64 reference."""
    block, sizes = make_block("triton", torch.float32, **SMALL, **options)
    errors = compare_with_reference(block, sizes, length)
    assert within_tolerance(errors, torch.float32), errors


CHANGES = {"A_log[0]": ("A_log", (0,), 0.05), "dt_bias[0]": ("dt_bias", (0,), 0.1), "D[0]": ("D", (0,), 0.1),
           "norm.weight[0]": ("norm.weight", (0,), 0.1),
           "conv1d.weight[B, oldest tap]": ("conv1d.weight", (SMALL["d_model"] * 2, 0, 0), 0.1),
           "in_proj.weight[dt of head 3]": ("in_proj.weight", (-1, 0), 0.1)}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_reference_comparison_catches_a_changed_parameter(change):
    """The reference built, then one value of the block changed a little: the comparison must fail by far
    (a head's decay, step or skip, one norm weight, the convolution's oldest tap of one B channel, which only
    matters through the window over past positions)."""
    name, index, delta = CHANGES[change]
    block, sizes = make_block("torch", **SMALL)
    u = reference_input(sizes, 40)
    want = mamba2_reference(reference_parameters(block), u, sizes)[0]
    with torch.no_grad():
        assert rel_err(block(u), want) < TOL[torch.float64]
        dict(block.named_parameters())[name][index] += delta
        assert rel_err(block(u), want) > 100 * TOL[torch.float64]


# ---------------------------------------------------------------------------------------------- gradients
GRADCHECK_OPTIONS = [{}, dict(ngroups=2, D_has_hdim=True, d_ssm=4, bias=True, norm_before_gate=True),
                     dict(rmsnorm=False, conv_bias=False, d_conv=3)]


@pytest.mark.parametrize("options", GRADCHECK_OPTIONS, ids=["default", "groups_hdim_mlp_bias_norm_first", "no_rmsnorm"])
def test_torch_block_gradcheck(options):
    """gradcheck (float64, finite differences) of the torch backend's block with respect to u and every
    parameter but D, a float32 parameter whose finite differences would be float32's (its gradient is checked
    against the reference's autograd above). The Triton backend's kernels are float32 (no gradcheck)."""
    block, _ = make_block("torch", d_model=4, d_state=2, headdim=2, chunk_size=16, **options)
    names = [name for name, _ in block.named_parameters() if name != "D"]
    values = [dict(block.named_parameters())[name].detach().clone().requires_grad_(True) for name in names]
    u = torch.randn(1, 5, 4, dtype=torch.float64, device=DEVICE, requires_grad=True)

    def forward(u, *values):
        return functional_call(block, dict(zip(names, values)), (u,))
    assert torch.autograd.gradcheck(forward, (u, *values), fast_mode=False)


# ---------------------------------------------------------------------------- parameters and initialisation
LAYOUTS = [dict(d_model=64), dict(d_model=32, d_state=16, headdim=16),
           dict(d_model=32, d_state=8, headdim=16, ngroups=2, D_has_hdim=True, rmsnorm=False, bias=True,
                conv_bias=False, d_conv=3),
           dict(d_model=24, d_state=8, headdim=8, d_ssm=16, expand=3, ngroups=2), dict(SMALL, **EVERYTHING)]


@pytest.mark.parametrize("options", LAYOUTS, ids=["d_model64_defaults", "headdim16", "groups_hdim_no_norm_bias",
                                                  "d_ssm16_expand3", "everything"])
def test_state_dict_layout_is_mamba_ssms(options):
    block = Mamba2(**options, backend="torch")
    assert {name: tuple(t.shape) for name, t in block.state_dict().items()} == mamba2_layout(block_sizes(**options))
    assert {name for name, _ in block.named_parameters()} == set(block.state_dict())


def test_dtypes_of_a_bf16_block():
    """dt_bias, A_log, norm.weight and the projections' and convolution's weights follow dtype; D stays float32."""
    block = Mamba2(32, d_state=8, headdim=16, bias=True, dtype=torch.bfloat16, backend="torch")
    dtypes = {name: t.dtype for name, t in block.state_dict().items()}
    assert dtypes.pop("D") == torch.float32
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes


def test_a_bf16_block_runs_forward():
    block, sizes = make_block("torch", torch.bfloat16, **SMALL)
    u = reference_input(sizes, 20)
    with torch.no_grad():
        out = block(u.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == u.shape and torch.isfinite(out).all()
    assert rel_err(out, mamba2_reference(block.state_dict(), u.bfloat16(), sizes)[0]) < 0.1


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_blocks_with_every_option(backend, dtype):
    """A 16-bit block with every option (D per channel among them, a float32 parameter): forward, backward
    and a generation step run and stay near the float64 reference: 3e-2 for the output and u's gradient
    (16-bit values), 0.1 for the parameters' gradients (sums over every position of 16-bit products, with
    cancellation: A_log's is the worst, about 4e-2 in bf16)."""
    block, sizes = make_block(backend, dtype, **SMALL, **EVERYTHING, layer_idx=0)
    errors = compare_with_reference(block, sizes, 20)
    assert all(e < (3e-2 if name in ("out", "u.grad") else 0.1) for name, e in errors.items()), errors
    u = reference_input(sizes, 3).to(dtype)
    params = InferenceParams(max_seqlen=3, max_batch_size=2)
    with torch.no_grad():
        whole = block(u)
        block(u[:, :2], inference_params=params)
        params.seqlen_offset = 2
        last = block(u[:, 2:], inference_params=params)
    assert last.dtype == dtype and rel_err(last, whole[:, 2:]) < 3e-2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batch_and_float64_on_either_backend(backend):
    """Batch 0 gives an empty output of the right shape; a float64 block on the triton backend scans in float64
    (section 3's ssd_chunked) and matches the reference to float64's rounding."""
    block, sizes = make_block(backend, torch.float64, **SMALL)
    out = block(torch.empty(0, 5, sizes["d_model"], dtype=torch.float64, device=DEVICE))
    assert out.shape == (0, 5, sizes["d_model"])
    assert within_tolerance(compare_with_reference(block, sizes, 17), torch.float64)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_cache_of_another_dtype(backend):
    """A float32 block generating into a float64 cache (allocate_inference_cache(dtype=torch.float64)), as
    mamba_ssm allows: the prompt and the steps run and agree with the whole sequence."""
    block, sizes = make_block(backend, torch.float32, **SMALL, layer_idx=0)
    u = reference_input(sizes, 6).float()
    params = InferenceParams(max_seqlen=6, max_batch_size=2)
    params.key_value_memory_dict[0] = block.allocate_inference_cache(2, 6, dtype=torch.float64)
    with torch.no_grad():
        whole = block(u)
        pieces = [block(u[:, :4], inference_params=params)]
        for t in (4, 5):
            params.seqlen_offset = t
            pieces.append(block(u[:, t:t + 1], inference_params=params))
    assert params.key_value_memory_dict[0][1].dtype == torch.float64
    assert rel_err(torch.cat(pieces, dim=1), whole) < AGREE[torch.float32]


def test_autocast_runs_a_float32_block_in_bfloat16():
    block, sizes = make_block("torch", torch.float32, **SMALL)
    u = reference_input(sizes, 9).float()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = block(u.bfloat16())
    assert rel_err(out, block(u)) < 3e-2


def test_parameter_flags_and_initial_values():
    torch.manual_seed(0)
    block = Mamba2(64, d_state=8, headdim=8, backend="torch")
    assert block.dt_bias._no_weight_decay and block.A_log._no_weight_decay and block.D._no_weight_decay
    assert torch.equal(block.D.detach(), torch.ones(16))
    assert torch.equal(block.norm.weight.detach(), torch.ones(128))
    assert block.norm.weight.dtype == torch.float32


@pytest.mark.parametrize("dt_min, dt_max", [(0.001, 0.1), (0.01, 0.02)])
def test_dt_bias_init_within_dt_min_dt_max(dt_min, dt_max):
    torch.manual_seed(0)
    block = Mamba2(256, d_state=8, headdim=8, dt_min=dt_min, dt_max=dt_max, backend="torch")   # 64 heads
    dt = F.softplus(block.dt_bias.detach().double())
    assert dt.shape == (64,)
    assert dt.min() >= dt_min * (1 - 1e-5) and dt.max() <= dt_max * (1 + 1e-5)
    spread = (dt.log().max() - dt.log().min()) / (math.log(dt_max) - math.log(dt_min))   # log-uniform: spread out
    assert spread > 0.8


def test_dt_bias_init_floor():
    torch.manual_seed(0)
    block = Mamba2(64, d_state=8, headdim=8, dt_min=1e-6, dt_max=1e-5, dt_init_floor=1e-4, backend="torch")
    dt = F.softplus(block.dt_bias.detach().double())
    assert torch.allclose(dt, torch.full_like(dt, 1e-4), rtol=1e-4)


@pytest.mark.parametrize("A_init_range", [(1, 16), (2.0, 3.0)])
def test_A_log_init_within_A_init_range(A_init_range):
    torch.manual_seed(0)
    block = Mamba2(256, d_state=8, headdim=8, A_init_range=A_init_range, backend="torch")
    A = torch.exp(block.A_log.detach().double())
    low, high = A_init_range
    assert A.min() >= low * (1 - 1e-6) and A.max() <= high * (1 + 1e-6)
    assert (A.max() - A.min()) > 0.8 * (high - low)   # uniform over the range


def test_conv_init_bounds():
    torch.manual_seed(0)
    weight = Mamba2(32, d_state=8, headdim=8, conv_init=0.05, backend="torch").conv1d.weight.detach()
    assert weight.abs().max() <= 0.05 and weight.abs().max() > 0.04 and weight.std() > 0.02
    default = Mamba2(32, d_state=8, headdim=8, backend="torch").conv1d.weight.detach()
    assert default.abs().max() > 0.1   # nn.Conv1d's init (bound 1/sqrt(d_conv) = 0.5) when conv_init is None


def test_seeded_construction_is_deterministic():
    def state(seed):
        torch.manual_seed(seed)
        return Mamba2(32, d_state=8, headdim=8, bias=True, conv_init=0.1, backend="torch").state_dict()
    first, second, other = state(3), state(3), state(4)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    for name in ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log"):
        assert not torch.equal(first[name], other[name]), name


def test_state_dict_round_trip_gives_identical_outputs():
    block, sizes = make_block("torch", torch.float32, **SMALL, **EVERYTHING)
    fresh = Mamba2(**SMALL, **EVERYTHING, backend="torch", device=DEVICE)
    u = reference_input(sizes, 9).float()
    with torch.no_grad():
        assert not torch.equal(fresh(u), block(u))
        fresh.load_state_dict(block.state_dict())
        assert torch.equal(fresh(u), block(u))


def test_default_backend():
    assert Mamba2(16, d_state=8, headdim=8).backend == ("triton" if ON_GPU else "torch")


# ------------------------------------------------------------------------------------------- seqlen= form
BACKENDS = pytest.mark.parametrize("backend, dtype", [("torch", torch.float64), ("triton", torch.float32)],
                                   ids=["torch", "triton"])   # the Triton backend's kernels compute in float32


@BACKENDS
def test_seqlen_form_is_the_3d_form_reshaped(backend, dtype):
    """u of (batch * L, d_model) with seqlen=L (mamba_ssm's sequence-parallel form): the same output, as
    (batch * L, d_model)."""
    block, sizes = make_block(backend, dtype, **SMALL, **EVERYTHING)
    u = reference_input(sizes, 20, batch=3).to(dtype)
    with torch.no_grad():
        flat = block(u.reshape(3 * 20, sizes["d_model"]), seqlen=20)
        whole = block(u)
    assert flat.shape == (3 * 20, sizes["d_model"]) and flat.dtype == dtype
    assert rel_err(flat, whole.reshape(3 * 20, sizes["d_model"])) < AGREE[dtype]


# ------------------------------------------------------------------------------------ inference three ways
def three_ways(backend, dtype, length, chunks, options, batch=2, seed=0):
    """Whole sequence, chunks through InferenceParams, token by token through step. Returns the relative
    differences (chunks and tokens from the whole; the cached states from the token-by-token ones), those of
    each chunk's cached states from the reference's after that many positions, of the whole output from the
    reference, and how many times step ran in each chunk. The input is a strided view."""
    block, sizes = make_block(backend, dtype, seed, **SMALL, **options, layer_idx=3)
    u = torch.randn(batch, length, 2 * sizes["d_model"], dtype=dtype,
                    generator=torch.Generator().manual_seed(seed + 7)).to(DEVICE)[..., ::2]   # not contiguous
    params64 = {k: v.double() for k, v in block.state_dict().items()}
    step_calls = []
    step = block.step
    block.step = lambda *args: step_calls.append(args[0].shape) or step(*args)
    chunk_errors, calls_per_chunk = [], []
    with torch.no_grad():
        whole = block(u)
        params = InferenceParams(max_seqlen=length, max_batch_size=batch)
        pieces, start = [], 0
        for size in chunks:
            before = len(step_calls)
            pieces.append(block(u[:, start:start + size], inference_params=params))
            calls_per_chunk.append(len(step_calls) - before)
            params.seqlen_offset += size
            start += size
            _, ref_conv, ref_ssm = mamba2_reference(params64, u[:, :start], sizes)
            conv_state, ssm_state = params.key_value_memory_dict[3]
            chunk_errors.append(max(rel_err(conv_state, ref_conv), rel_err(ssm_state, ref_ssm)))
        assert start == length
        chunked = torch.cat(pieces, dim=1)
        conv_state, ssm_state = block.allocate_inference_cache(batch, length)
        tokens = []
        for t in range(length):
            out, conv_back, ssm_back = step(u[:, t:t + 1], conv_state, ssm_state)
            assert conv_back is conv_state and ssm_back is ssm_state and out.shape == (batch, 1, sizes["d_model"])
            tokens.append(out)
        tokens = torch.cat(tokens, dim=1)
    cached_conv, cached_ssm = params.key_value_memory_dict[3]
    agreement = {"chunks": rel_err(chunked, whole), "tokens": rel_err(tokens, whole),
                 "conv_state": rel_err(cached_conv, conv_state), "ssm_state": rel_err(cached_ssm, ssm_state)}
    reference = {"whole": rel_err(whole, mamba2_reference(params64, u, sizes)[0]), "chunk states": max(chunk_errors)}
    return agreement, reference, calls_per_chunk


THREE_WAYS = [("torch", torch.float64, 40, [16, 1, 2, 3, 1, 17], "default", {}),
              ("torch", torch.float64, 40, [5, 1, 34], "everything", EVERYTHING),
              ("torch", torch.float64, 1, [1], "default", {}),
              ("torch", torch.float64, 23, [1, 1, 21], "no_rmsnorm_ngroups2", dict(rmsnorm=False, ngroups=2)),
              ("torch", torch.float32, 21, [10, 1, 10], "everything", EVERYTHING),
              ("triton", torch.float32, 1, [1], "default", {}),
              ("triton", torch.float32, 21, [10, 1, 2, 8], "everything", EVERYTHING)]


@pytest.mark.parametrize("backend, dtype, length, chunks, name, options", THREE_WAYS,
                         ids=[f"{b}-{str(d)[6:]}-L{n}-{c}-{name}" for b, d, n, c, name, _ in THREE_WAYS])
def test_inference_three_ways_agree(backend, dtype, length, chunks, name, options):
    """A prompt whole, in chunks (chunked prefill, chunks shorter than the convolution's window among them)
    and token by token: the same outputs and final states; each call leaves the states the reference has
    after as many positions; a later call of one position runs step, one of several does not."""
    agreement, reference, calls_per_chunk = three_ways(backend, dtype, length, chunks, options)
    assert max(agreement.values()) < AGREE[dtype], agreement
    assert max(reference.values()) < TOL[dtype], reference
    assert calls_per_chunk[1:] == [1 if size == 1 else 0 for size in chunks[1:]], calls_per_chunk


@BACKENDS
def test_a_reused_inference_params_starts_a_new_prompt_afresh(backend, dtype):
    """After reset (seqlen_offset back to 0) the next prompt starts from zero states, not the previous
    prompt's, and gives what a fresh InferenceParams gives; so does a cache that holds anything at offset 0."""
    block, sizes = make_block(backend, dtype, **SMALL, layer_idx=0)
    g = torch.Generator().manual_seed(5)
    first, second = (torch.randn(1, 5, sizes["d_model"], generator=g, dtype=dtype).to(DEVICE) for _ in range(2))
    with torch.no_grad():
        params = InferenceParams(max_seqlen=8, max_batch_size=1)
        block(first, inference_params=params)
        params.seqlen_offset += 5
        block(first[:, :1], inference_params=params)                          # one generation step
        params.reset(max_seqlen=8, max_batch_size=1)
        reused = block(second, inference_params=params)
        reused_states = [t.clone() for t in params.key_value_memory_dict[0]]
        fresh_params = InferenceParams(max_seqlen=8, max_batch_size=1)
        fresh = block(second, inference_params=fresh_params)
        noisy = InferenceParams(max_seqlen=8, max_batch_size=1)
        noisy.key_value_memory_dict[0] = tuple(torch.randn_like(t) for t in block.allocate_inference_cache(1, 8))
        from_noise = block(second, inference_params=noisy)
        whole = block(second)
    assert params.seqlen_offset == 0
    torch.testing.assert_close(reused, fresh, rtol=0, atol=0)
    for reused_state, fresh_state in zip(reused_states, fresh_params.key_value_memory_dict[0]):
        torch.testing.assert_close(reused_state, fresh_state, rtol=0, atol=0)
    assert rel_err(from_noise, fresh) < AGREE[dtype]
    assert rel_err(fresh, whole) < AGREE[dtype]


def test_allocate_inference_cache_shapes_and_dtypes():
    block = Mamba2(32, d_state=8, headdim=16, ngroups=2, backend="torch")      # conv_dim 64 + 32, 4 heads of 16
    conv_state, ssm_state = block.allocate_inference_cache(3, 100)
    assert conv_state.shape == (3, 64 + 2 * 2 * 8, 4) and ssm_state.shape == (3, 4, 16, 8)
    assert conv_state.dtype == ssm_state.dtype == torch.float32
    assert not conv_state.any() and not ssm_state.any()
    conv_state, ssm_state = block.allocate_inference_cache(2, 10, dtype=torch.float64)
    assert conv_state.dtype == ssm_state.dtype == torch.float64
    bf16 = Mamba2(32, d_state=8, headdim=16, dtype=torch.bfloat16, backend="torch")
    assert all(t.dtype == torch.bfloat16 for t in bf16.allocate_inference_cache(1, 10))


# ----------------------------------------------------------------------------------------------- bad input
def small_block(**options):
    return Mamba2(**SMALL, backend="torch", **options)


def test_process_group_is_not_implemented():
    with pytest.raises(NotImplementedError, match="process_group"):
        Mamba2(**SMALL, backend="torch", process_group=object())


@pytest.mark.parametrize("name", ["seq_idx", "cu_seqlens"])
def test_varlen_arguments_are_not_implemented(name):
    value = torch.zeros(1, 5, dtype=torch.int32) if name == "seq_idx" else torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=name):
        small_block()(torch.randn(1, 5, 16), **{name: value})


@pytest.mark.parametrize("u, kwargs", [
    (torch.randn(1, 5, 15), {}), (torch.randn(5, 16), {}), (torch.randn(1, 1, 5, 16), {}),
    (torch.ones(1, 5, 16, dtype=torch.int64), {}), (torch.ones(1, 5, 16, dtype=torch.float64), {}),
    (torch.randn(10, 15), dict(seqlen=5)),
], ids=["d_model", "2d_without_seqlen", "rank4", "int64", "float64_in_float32_block", "2d_d_model"])
def test_forward_bad_u_names_it(u, kwargs):
    with pytest.raises((ValueError, TypeError), match=r"\bu\b"):
        small_block()(u, **kwargs)


@pytest.mark.parametrize("options", [dict(d_ssm=20), dict(d_model=20, headdim=16)], ids=["d_ssm20", "d_inner40"])
def test_d_ssm_not_a_multiple_of_headdim(options):
    with pytest.raises(ValueError, match="d_ssm|headdim|d_inner"):
        Mamba2(**{**SMALL, **options}, backend="torch")


def test_inference_params_without_layer_idx():
    with pytest.raises(ValueError, match="layer_idx"):
        small_block()(torch.randn(1, 3, 16), inference_params=InferenceParams(max_seqlen=3, max_batch_size=1))


# -------------------------------------------------------------------------------------------- RMSNormGated
@pytest.mark.parametrize("group_size", [None, 4])
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("gated", [False, True], ids=["z_None", "z"])
def test_rms_norm_gated_matches_float64_formula(gated, norm_before_gate, group_size):
    torch.manual_seed(0)
    norm = RMSNormGated(12, group_size=group_size, norm_before_gate=norm_before_gate, device=DEVICE,
                        dtype=torch.float64)
    assert set(norm.state_dict()) == {"weight"}
    assert torch.equal(norm.weight.detach().cpu(), torch.ones(12, dtype=torch.float64))
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn_like(norm.weight))
    x = torch.randn(3, 5, 12, dtype=torch.float64, device=DEVICE)
    z = torch.randn(3, 5, 12, dtype=torch.float64, device=DEVICE) if gated else None
    with torch.no_grad():
        out = norm(x, z)
    want = rms_norm_gated_reference(x, norm.weight.detach(), z, RMS_EPS, group_size, norm_before_gate)
    assert out.dtype == torch.float64 and out.shape == x.shape
    assert rel_err(out, want) < 1e-10


def test_rms_norm_gated_default_eps_and_gate_order():
    """eps 1e-5 and norm_before_gate=True by default, as mamba_ssm's RMSNorm (its Mamba2 always passes the
    block's own option, whose default is False: test_torch_block_matches_float64_reference's default)."""
    norm = RMSNormGated(8, dtype=torch.float64)
    x, z = torch.full((1, 8), 1e-3, dtype=torch.float64), torch.randn(1, 8, dtype=torch.float64)
    want = rms_norm_gated_reference(x, norm.weight.detach(), z, 1e-5, None, True)
    with torch.no_grad():
        assert rel_err(norm(x, z), want) < 1e-10   # at rms 1e-3 eps matters: 1e-6 + 1e-5 under the root


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)], ids=["bf16", "fp32"])
def test_rms_norm_gated_returns_the_input_dtype(dtype, tol):
    torch.manual_seed(0)
    norm = RMSNormGated(16, group_size=8, norm_before_gate=False, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn_like(norm.weight))
    x, z = (torch.randn(4, 16, device=DEVICE).to(dtype) for _ in range(2))
    with torch.no_grad():
        out = norm(x, z)
    assert out.dtype == dtype and norm.weight.dtype == dtype
    assert rel_err(out, rms_norm_gated_reference(x, norm.weight.detach(), z, RMS_EPS, 8, False)) < tol


# ------------------------------------------------------------------------------------ mamba_ssm (GPU only)
MambaSSM2, MAMBA_SSM_MISSING = _mamba_ssm_mamba2() if torch.cuda.is_available() else (None, "needs a CUDA GPU")
needs_mamba_ssm = pytest.mark.skipif(MambaSSM2 is None, reason=MAMBA_SSM_MISSING or "")
GPU_SIZES = dict(d_model=128, d_state=64, headdim=32, chunk_size=64)     # 8 heads of 32
# mamba_ssm convolves the in_proj output's xBC columns in place, and causal-conv1d's channel-last kernel wants that
# output's row stride (its width, 2 d_mlp + 2 d_ssm + 2 ngroups d_state + nheads) a multiple of 8: so 8 heads where
# there is an MLP beside them (expand 3: d_inner 384, the SSM 256 of it, the MLP 128).
MLP = dict(expand=3, d_ssm=256)
MLP_GROUPS = dict(MLP, ngroups=2)   # 8 heads of 32, 4 a group
GPU_OPTIONS = {"groups": dict(ngroups=2),
               "mlp_hdim_no_norm_bias_dt_limit": dict(MLP, D_has_hdim=True, rmsnorm=False, bias=True, conv_bias=False,
                                                      dt_limit=(0.01, 0.5)),
               "norm_first_groups_mlp": dict(norm_before_gate=True, **MLP_GROUPS)}


def mamba_ssm_pair(dtype, options):
    """scan_lib's block (perturbed) and mamba_ssm's (use_mem_eff_path=False) with the same weights."""
    ours, _ = make_block("triton", dtype, **GPU_SIZES, **options, layer_idx=0)
    assert ours.in_proj.out_features % 8 == 0, "causal-conv1d's channel-last kernel (mamba_ssm's) needs it"
    theirs = MambaSSM2(**GPU_SIZES, **options, use_mem_eff_path=False, layer_idx=0, device=DEVICE, dtype=dtype)
    theirs.load_state_dict(ours.state_dict())   # strict
    assert {k: v.dtype for k, v in ours.state_dict().items()} == {k: v.dtype for k, v in theirs.state_dict().items()}
    return ours, theirs


# mamba_ssm's chunk kernels call tl.dot on float32 with Triton's default precision, TF32 (2^-11 per operand).
MAMBA_SSM_TOL = {torch.float32: 5e-3, torch.bfloat16: 5e-2}


@needs_mamba_ssm
@pytest.mark.parametrize("options", list(GPU_OPTIONS.values()), ids=list(GPU_OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_matches_mamba_ssm(dtype, options, no_tf32):
    """Both blocks against the float64 reference with the same weights (their summation orders differ, so
    they are not compared with each other): the output and every gradient of ours within twice mamba_ssm's
    error, or within the suite's float32 bound (TOL), or eight roundings of bfloat16."""
    ours, theirs = mamba_ssm_pair(dtype, options)
    sizes = block_sizes(**GPU_SIZES, **options)
    ours_errors, theirs_errors = (compare_with_reference(block, sizes, 300) for block in (ours, theirs))
    floor = TOL[torch.float32] if dtype == torch.float32 else 8 * torch.finfo(dtype).eps
    assert all(e <= max(2 * theirs_errors[name], floor) for name, e in ours_errors.items()), (ours_errors,
                                                                                            theirs_errors)


@needs_mamba_ssm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_generation_matches_mamba_ssm(dtype, no_tf32):
    """A prompt of 48 through InferenceParams, then 8 tokens (mamba_ssm's step: neither D_has_hdim nor
    dt_limit, which its step does not support)."""
    ours, theirs = mamba_ssm_pair(dtype, MLP_GROUPS)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    u = torch.randn(2, 56, GPU_SIZES["d_model"], device=DEVICE, generator=g).to(dtype)
    outs, states = [], []
    with torch.no_grad():
        for block in (ours, theirs):
            params = InferenceParams(max_seqlen=56, max_batch_size=2)
            pieces = [block(u[:, :48], inference_params=params)]
            params.seqlen_offset = 48
            for t in range(48, 56):
                pieces.append(block(u[:, t:t + 1], inference_params=params))
                params.seqlen_offset += 1
            outs.append(torch.cat(pieces, dim=1))
            states.append(params.key_value_memory_dict[0])
    errors = {"out": rel_err(outs[0], outs[1]), "conv_state": rel_err(states[0][0], states[1][0]),
              "ssm_state": rel_err(states[0][1], states[1][1])}
    assert max(errors.values()) < MAMBA_SSM_TOL[dtype], errors


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_block_compiles_fullgraph(backend):
    """torch.compile(fullgraph=True) of the block, output and every gradient as in eager mode."""
    torch._dynamo.reset()
    block, _ = make_block(backend, torch.float32, d_model=16, d_state=8, headdim=8, chunk_size=16, ngroups=2)
    u = torch.randn(2, 21, 16, device=DEVICE, requires_grad=True)
    leaves = [u, *block.parameters()]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    got, want = compiled(u), block(u)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ the fused norm (interpreter on CPU)
def fused_norm_inputs(dtype, rows_shape, hidden, gated, seed=0):
    """x (rows_shape x hidden), z a strided slice of a wider tensor (as Mamba2's in_proj output), a weight off 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows_shape, hidden, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    z = torch.randn(*rows_shape, hidden + 5, generator=g, dtype=torch.float64).to(DEVICE, dtype)[..., 2:2 + hidden]
    weight = (1 + 0.3 * torch.randn(hidden, generator=g, dtype=torch.float64)).to(DEVICE, dtype)
    return [t.requires_grad_() if t is not None else None for t in (x, z if gated else None, weight)]


FUSED_TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("gated, norm_before_gate", [(False, False), (True, False), (True, True)],
                         ids=["no_z", "gate_then_norm", "norm_then_gate"])
@pytest.mark.parametrize("rows_shape, hidden, group_size", [((2, 7), 12, 4), ((70,), 24, 24), ((3, 50), 10, 5)])
def test_fused_norm_matches_the_pytorch_form(dtype, gated, norm_before_gate, rows_shape, hidden, group_size):
    """RMSNormGatedFn (the kernels) against _rms_norm_gated_torch differentiated by autograd: the output and the
    gradients of x, z and the weight; 70 and 150 rows make the backward's programs walk several blocks of rows."""
    from scan_lib.ssd import RMSNormGatedFn, _rms_norm_gated_torch
    x, z, weight = fused_norm_inputs(dtype, rows_shape, hidden, gated)
    leaves = [t for t in (x, z, weight) if t is not None]
    dout = torch.randn(x.shape, dtype=torch.float64).to(DEVICE, dtype)
    got = RMSNormGatedFn.apply(x, z, weight, 1e-5, group_size, norm_before_gate)[0]
    want = _rms_norm_gated_torch(x, z, weight, 1e-5, group_size, norm_before_gate)
    assert got.dtype == dtype and rel_err(got, want) < FUSED_TOL[dtype]
    for g, w in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout)):
        assert g.dtype == w.dtype and rel_err(g, w) < FUSED_TOL[dtype]


def test_fused_norm_keeps_eps_at_float64_precision():
    """Rows whose mean square is near eps (x of size 1e-3): a float64 eps rounded to float32 (what a Python float
    passed as a runtime argument becomes in a compiled kernel; the interpreter keeps it whole) moves the output by
    about 1e-8 relative; the kernels must agree with PyTorch's form. Under the interpreter only the first assert
    can fail: eps must be a constexpr of the forward kernel, compiled in at the kernel's precision."""
    import inspect
    import triton.language as tl
    from scan_lib.ssd import RMSNormGatedFn, _rms_norm_gated_torch, rms_norm_gated_fwd_kernel
    jitted = rms_norm_gated_fwd_kernel.kernel   # inside its RememberedLaunches
    assert inspect.signature(jitted.fn).parameters["EPS"].annotation is tl.constexpr
    x, z, weight = fused_norm_inputs(torch.float64, (4, 9), 16, True, seed=5)
    small = (x.detach() * 1e-3).requires_grad_()
    got = RMSNormGatedFn.apply(small, z, weight, 1e-5, 8, False)[0]
    want = _rms_norm_gated_torch(small, z, weight, 1e-5, 8, False)
    assert rel_err(got, want) < 1e-14, rel_err(got, want)


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_fused_norm_gradcheck_and_second_derivatives(norm_before_gate):
    """gradcheck through the backward kernel; gradgradcheck through the create_graph path (PyTorch's form)."""
    from scan_lib.ssd import RMSNormGatedFn
    x, z, weight = fused_norm_inputs(torch.float64, (3,), 8, True, seed=2)
    f = lambda x, z, w: RMSNormGatedFn.apply(x, z, w, 1e-5, 4, norm_before_gate)[0]   # noqa: E731
    assert torch.autograd.gradcheck(f, (x, z, weight))
    assert torch.autograd.gradgradcheck(f, (x, z, weight))


def test_fused_norm_of_no_rows():
    """Empty inputs (a batch of 0) give empty outputs and gradients, and a zero weight gradient."""
    from scan_lib.ssd import RMSNormGatedFn
    x, z, weight = fused_norm_inputs(torch.float32, (0, 5), 8, True)
    out = RMSNormGatedFn.apply(x, z, weight, 1e-5, 4, False)[0]
    dx, dz, dweight = torch.autograd.grad(out.sum(), (x, z, weight))
    assert out.shape == dx.shape == dz.shape == (0, 5, 8) and torch.equal(dweight, torch.zeros_like(weight))


def test_fused_norm_compiles_fullgraph():
    from scan_lib.ssd import RMSNormGatedFn
    torch._dynamo.reset()
    x, z, weight = fused_norm_inputs(torch.float32, (2, 5), 8, True)
    f = lambda x, z, w: RMSNormGatedFn.apply(x, z, w, 1e-5, 4, False)[0]   # noqa: E731
    got, want = torch.compile(f, fullgraph=True, backend="aot_eager")(x, z, weight), f(x, z, weight)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(torch.autograd.grad(got.sum(), (x, z, weight)), torch.autograd.grad(want.sum(), (x, z, weight))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
