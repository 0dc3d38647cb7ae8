"""scan_lib.ssd (chapter 10): Mamba-2's recurrence as a loop, as one masked matrix and in chunks, in
float64, at awkward lengths, groups of heads, initial and final states, and gradients through autograd;
the Triton forward in float32 against the loop, on strided A and D, empty sequences and bad arguments."""
import contextlib
import sys

import pytest
import torch

import scan_lib  # (first: without a GPU it switches Triton to its interpreter)
from scan_lib.runtime import DEVICE, ON_GPU
from scan_lib.ssd import segsum, ssd_backward, ssd_chunked, ssd_chunked_backward, ssd_loop, ssd_quadratic


def problem(batch, length, heads, head_dim, groups, n_states, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)   # noqa: E731
    return dict(x=rand(batch, length, heads, head_dim), dt=torch.nn.functional.softplus(rand(batch, length, heads) - 1),
                A=-torch.exp(rand(heads) * 0.5), B=rand(batch, length, groups, n_states),
                C=rand(batch, length, groups, n_states), D=rand(heads), initial_state=rand(batch, heads, head_dim, n_states))


def rel(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def test_segsum_is_the_sum_of_the_terms_between():
    a = torch.randn(7, dtype=torch.float64)
    s = segsum(a)
    for t in range(7):
        for u in range(7):
            want = a[u + 1:t + 1].sum() if u <= t else torch.tensor(float("-inf"), dtype=torch.float64)
            assert torch.equal(s[t, u], want) or abs(s[t, u] - want) < 1e-14, (t, u)


@pytest.mark.parametrize("length, chunk, heads, groups", [(37, 8, 4, 2), (32, 8, 4, 4), (5, 16, 2, 1), (1, 4, 2, 2), (17, 1, 3, 1)])
def test_chunked_and_matrix_forms_match_the_loop(length, chunk, heads, groups):
    p = problem(2, length, heads, 3, groups, 5, seed=length)
    y, final = ssd_loop(**p)
    y_chunked, final_chunked = ssd_chunked(p["x"], p["dt"], p["A"], p["B"], p["C"], chunk, p["D"], p["initial_state"])
    assert rel(y_chunked, y) < 1e-12 and rel(final_chunked, final) < 1e-12
    no_state = {k: v for k, v in p.items() if k != "initial_state"}
    assert rel(ssd_quadratic(**no_state), ssd_loop(**no_state)[0]) < 1e-12


def test_gradients_of_the_chunked_form_match_the_loop():
    """Autograd through both, every input: the chunked algorithm is the same function, not only the same values."""
    p = {k: v.requires_grad_() for k, v in problem(1, 11, 2, 2, 1, 3, seed=5).items()}
    weights = torch.randn(1, 11, 2, 2, dtype=torch.float64)
    y, final = ssd_loop(**p)
    want = torch.autograd.grad((y * weights).sum() + final.sum(), list(p.values()))
    y, final = ssd_chunked(p["x"], p["dt"], p["A"], p["B"], p["C"], 4, p["D"], p["initial_state"])
    got = torch.autograd.grad((y * weights).sum() + final.sum(), list(p.values()))
    for name, g, w in zip(p, got, want):
        assert rel(g, w) < 1e-12, name


@pytest.mark.parametrize("length, chunk, heads, groups, options, final_grad",
                         [(37, 8, 4, 2, True, True), (32, 8, 4, 4, False, True), (5, 16, 2, 1, True, False),
                          (1, 4, 2, 2, True, True), (24, 24, 3, 3, True, True), (17, 1, 2, 1, False, False)])
def test_the_chunked_backward_matches_autograd_through_the_loop(length, chunk, heads, groups, options, final_grad):
    """ssd_chunked_backward (chapter 10's derivation, step by step in reverse) against autograd through
    the sequential loop: every gradient, with and without D, the initial state and a final-state gradient."""
    p = problem(2, length, heads, 3, groups, 5, seed=length)
    if not options:
        p["D"] = p["initial_state"] = None
    leaves = {k: v.clone().requires_grad_() for k, v in p.items() if v is not None}
    y, final = ssd_loop(**{k: leaves.get(k) for k in p})
    g = torch.Generator().manual_seed(length + 1)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    dfinal = torch.randn(final.shape, generator=g, dtype=torch.float64) if final_grad else None
    loss = (y * dy).sum() + ((final * dfinal).sum() if final_grad else 0)
    want = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    got = dict(zip(p, ssd_chunked_backward(p["x"], p["dt"], p["A"], p["B"], p["C"], chunk, dy, dfinal, p["D"],
                                           p["initial_state"])))
    for name in p:
        if name in want:
            assert got[name].shape == want[name].shape and rel(got[name], want[name]) < 1e-12, name
        else:
            assert got[name] is None, name


def test_zero_steps_leave_the_state_alone():
    """dt = 0 neither decays the state nor adds to it: the padding rule of the last chunk."""
    p = problem(1, 6, 2, 2, 2, 3)
    p["dt"] = torch.zeros_like(p["dt"])
    _, final = ssd_chunked(p["x"], p["dt"], p["A"], p["B"], p["C"], 4, initial_state=p["initial_state"])
    assert torch.equal(final, p["initial_state"])


@pytest.mark.parametrize("length, chunk, heads, groups, head_dim, n_states",
                         [(37, 16, 4, 2, 3, 5), (70, 32, 2, 1, 8, 4), (1, 16, 2, 2, 4, 4)])
def test_the_triton_forward_matches_the_loop(length, chunk, heads, groups, head_dim, n_states):
    """ssd_forward (two kernels and linear_scan) on float32 inputs against the float64 loop."""
    from scan_lib.runtime import DEVICE
    from scan_lib.ssd import ssd_forward
    p = {k: v.float().to(DEVICE) for k, v in problem(2, length, heads, head_dim, groups, n_states, seed=length).items()}
    y_want, final_want = ssd_loop(**p)
    y, final = ssd_forward(p["x"], p["dt"], p["A"], p["B"], p["C"], chunk, p["D"], p["initial_state"])
    assert y.dtype == torch.float32 and rel(y.double(), y_want) < 1e-5 and rel(final.double(), final_want) < 1e-5


def float32_problem(batch=1, length=20, heads=4, head_dim=3, groups=2, n_states=5, seed=0):
    from scan_lib.runtime import DEVICE
    return {k: v.float().to(DEVICE) for k, v in problem(batch, length, heads, head_dim, groups, n_states, seed).items()}


def forward(p, chunk=16):
    from scan_lib.ssd import ssd_forward
    return ssd_forward(p["x"], p["dt"], p["A"], p["B"], p["C"], chunk, p.get("D"), p.get("initial_state"))


@pytest.mark.parametrize("with_D, with_h0", [(False, True), (True, False), (False, False)])
def test_the_triton_forward_without_D_or_initial_state(with_D, with_h0):
    p = float32_problem(length=23, seed=11)
    p["D"], p["initial_state"] = (p["D"] if with_D else None), (p["initial_state"] if with_h0 else None)
    y_want, final_want = ssd_loop(**p)
    y, final = forward(p)
    assert rel(y.double(), y_want) < 1e-5 and rel(final.double(), final_want) < 1e-5


def test_the_triton_forward_reads_strided_A_and_D():
    """The kernels index A and D by head: a view with stride 2 must give the contiguous answer."""
    p = float32_problem(length=20, seed=2)
    y_want, final_want = ssd_loop(**p)
    p["A"], p["D"] = p["A"].repeat_interleave(2)[::2], p["D"].repeat_interleave(2)[::2]
    assert p["A"].stride() == (2,) and p["D"].stride() == (2,)
    y, final = forward(p)
    assert rel(y.double(), y_want) < 1e-5 and rel(final.double(), final_want) < 1e-5


@pytest.mark.parametrize("batch, length", [(2, 0), (0, 5)])
@pytest.mark.parametrize("with_h0", [True, False])
def test_the_triton_forward_of_an_empty_sequence(batch, length, with_h0):
    """Like the loop: an empty y of x's shape and dtype, the final state the initial state (float32) or zeros."""
    p = float32_problem(batch=batch, length=length)
    p["x"] = p["x"].half()
    if not with_h0:
        p["initial_state"] = None
    y, final = forward(p)
    assert y.shape == p["x"].shape and y.dtype == torch.float16
    want = torch.zeros(batch, 4, 3, 5) if p["initial_state"] is None else p["initial_state"]
    assert final.dtype == torch.float32 and torch.equal(final.cpu(), want.cpu())


@pytest.mark.parametrize("with_h0", [True, False])
def test_the_chunked_form_of_an_empty_sequence_is_the_loop(with_h0):
    p = problem(2, 0, 4, 3, 2, 5)
    if not with_h0:
        p["initial_state"] = None
    y_want, final_want = ssd_loop(**p)
    y, final = ssd_chunked(p["x"], p["dt"], p["A"], p["B"], p["C"], 8, p["D"], p["initial_state"])
    assert y.shape == y_want.shape == p["x"].shape and torch.equal(final, final_want)


def test_the_triton_forward_refuses_groups_that_do_not_divide_heads():
    p = float32_problem(heads=4, groups=3)
    with pytest.raises(ValueError, match=r"^B and C: the number of groups \(3\) must divide heads \(4"):
        forward(p)


@pytest.mark.parametrize("chunk", [24, 8, 0, 16.0, True, "16"])
def test_the_triton_forward_refuses_a_chunk_that_is_not_a_power_of_two_from_16(chunk):
    with pytest.raises(ValueError, match="^chunk_size must be a power of two >= 16"):
        forward(float32_problem(), chunk)


BAD_ARGUMENTS = [   # (argument, what is wrong, what it becomes, exception): batch 1, L 20, heads 4, P 3, groups 2, N 5
    ("x", "3-D", lambda p: p["x"][..., 0], ValueError),
    ("x", "int", lambda p: p["x"].int(), TypeError),
    ("dt", "2 heads", lambda p: p["dt"][:, :, :2], ValueError),
    ("dt", "a list", lambda p: p["dt"].tolist(), TypeError),
    ("A", "heads + 1", lambda p: torch.cat([p["A"], p["A"][:1]]), ValueError),
    ("A", "2-D", lambda p: p["A"][None], ValueError),
    ("B", "another L", lambda p: p["B"][:, :7], ValueError),
    ("B", "3-D", lambda p: p["B"][0], ValueError),
    ("B", "N = 0", lambda p: p["B"][..., :0], ValueError),
    ("C", "N unlike B's", lambda p: p["C"][..., :4], ValueError),
    ("C", "groups unlike B's", lambda p: p["C"][:, :, :1], ValueError),
    ("D", "2 heads", lambda p: p["D"][:2], ValueError),
    ("D", "int64", lambda p: p["D"].to(torch.int64), TypeError),
    ("initial_state", "N = 4", lambda p: p["initial_state"][..., :4], ValueError),
    ("initial_state", "3-D", lambda p: p["initial_state"][0], ValueError),
]


@pytest.mark.parametrize("name, why, make_bad, error", BAD_ARGUMENTS, ids=[f"{c[0]}: {c[1]}" for c in BAD_ARGUMENTS])
def test_the_triton_forward_names_a_bad_argument(name, why, make_bad, error):
    p = float32_problem()
    p[name] = make_bad(p)
    with pytest.raises(error, match=rf"^{name} "):
        forward(p)


def test_the_triton_forward_wants_one_device():
    p = float32_problem()
    p["A"] = p["A"].to("meta")
    with pytest.raises(ValueError, match="one device.*A on meta"):
        forward(p)


def test_the_triton_forward_refuses_float64_and_gradients_it_cannot_give():
    """No silent loss: float64 inputs would be summed in float32, and the launcher keeps no graph."""
    from scan_lib.runtime import DEVICE
    from scan_lib.ssd import ssd_forward
    x, dt, A, B, C = (v.to(DEVICE) for k, v in problem(1, 20, 2, 2, 1, 3).items() if k in ("x", "dt", "A", "B", "C"))
    with pytest.raises(TypeError, match="x: ssd_forward computes in float32"):
        ssd_forward(x, dt.float(), A.float(), B.float(), C.float(), 16)
    x32, dt32, A32, B32, C32 = (t.float() for t in (x, dt, A, B, C))
    with pytest.raises(RuntimeError, match="not differentiable: call mamba_chunk_scan_combined"):
        ssd_forward(x32.requires_grad_(), dt32, A32, B32, C32, 16)
    with torch.no_grad():
        y, _ = ssd_forward(x32, dt32, A32, B32, C32, 16)
    assert y.shape == x32.shape and not y.requires_grad


@pytest.mark.parametrize("length, chunk, heads, groups, head_dim, n_states, options",
                         [(37, 16, 4, 2, 3, 5, "D h0 dfinal"), (32, 16, 2, 2, 16, 16, "D h0 dfinal"),
                          (70, 32, 2, 1, 8, 4, ""), (1, 16, 2, 2, 4, 4, "D h0 dfinal"), (48, 16, 4, 4, 5, 3, ""),
                          (40, 16, 2, 1, 4, 4, "h0"), (40, 16, 2, 1, 4, 4, "dfinal")])
def test_the_triton_backward_matches_the_chunked_backward(length, chunk, heads, groups, head_dim, n_states, options):
    """ssd_backward (chapter 10's three kernels and two linear_scans) on float32 inputs against
    ssd_chunked_backward in float64 on the same values: every gradient, dA held a little looser (a
    sum over every position), with and without D, the initial state and the final state's gradient,
    each on its own."""
    p = problem(2, length, heads, head_dim, groups, n_states, seed=length)
    g = torch.Generator().manual_seed(length)
    dy = torch.randn(p["x"].shape, generator=g, dtype=torch.float64)
    dfinal = torch.randn(p["initial_state"].shape, generator=g, dtype=torch.float64) if "dfinal" in options else None
    p["D"] = p["D"] if "D" in options else None
    p["initial_state"] = p["initial_state"] if "h0" in options else None
    want = ssd_chunked_backward(p["x"], p["dt"], p["A"], p["B"], p["C"], chunk, dy, dfinal, p["D"], p["initial_state"])
    f32 = {k: None if v is None else v.float().to(DEVICE) for k, v in p.items()}
    got = ssd_backward(f32["x"], f32["dt"], f32["A"], f32["B"], f32["C"], chunk, dy.float().to(DEVICE),
                       None if dfinal is None else dfinal.float().to(DEVICE), f32["D"], f32["initial_state"])
    for name, g_, w in zip(["x", "dt", "A", "B", "C", "D", "initial_state"], got, want):
        assert (g_ is None) == (w is None), name
        if w is not None:
            assert g_.dtype == torch.float32 and rel(g_.double().cpu(), w) < (5e-5 if name == "A" else 1e-5), name


def test_the_triton_backward_of_an_empty_sequence():
    p = {k: v.float().to(DEVICE) for k, v in problem(1, 5, 2, 3, 1, 4, seed=1).items()}
    dfinal = torch.randn_like(p["initial_state"])
    empty = ssd_backward(p["x"][:, :0], p["dt"][:, :0], p["A"], p["B"][:, :0], p["C"][:, :0], 16, p["x"][:, :0],
                         dfinal, p["D"], p["initial_state"])
    assert torch.equal(empty[-1], dfinal) and empty[-1] is not dfinal and (empty[2] == 0).all() and (empty[5] == 0).all()
    assert empty[0].shape == p["x"][:, :0].shape and empty[3].shape == p["B"][:, :0].shape


def test_the_triton_backward_refuses_a_missing_or_misshapen_gradient():
    p = {k: v.float().to(DEVICE) for k, v in problem(1, 5, 2, 3, 1, 4, seed=1).items()}
    with pytest.raises(ValueError, match="dy must have shape"):
        ssd_backward(p["x"], p["dt"], p["A"], p["B"], p["C"], 16, p["x"][:, :4])
    with pytest.raises(TypeError, match="dy must be a torch.Tensor"):
        ssd_backward(p["x"], p["dt"], p["A"], p["B"], p["C"], 16, None)
    with pytest.raises(ValueError, match="dfinal must have shape"):
        ssd_backward(p["x"], p["dt"], p["A"], p["B"], p["C"], 16, p["x"], p["initial_state"][..., :2])


def test_the_chunked_backward_of_an_empty_sequence():
    p = problem(1, 5, 2, 3, 1, 4, seed=2)
    dfinal = torch.randn_like(p["initial_state"])
    got = ssd_chunked_backward(p["x"][:, :0], p["dt"][:, :0], p["A"], p["B"][:, :0], p["C"][:, :0], 4,
                               p["x"][:, :0], dfinal, p["D"], p["initial_state"])
    assert torch.equal(got[-1], dfinal) and got[-1] is not dfinal and (got[2] == 0).all() and (got[5] == 0).all()


# mamba_chunk_scan_combined: the differentiable op, with mamba_ssm's interface

def combined_reference(x, dt, A, B, C, chunk, D, z, dt_bias, h0, softplus):
    """The op's (y, final) composed from ssd_chunked in float64 (autograd differentiates it)."""
    dt = dt if dt_bias is None else dt + dt_bias
    y, final = ssd_chunked(x, torch.nn.functional.softplus(dt) if softplus else dt, A, B, C, chunk, D, h0)
    return (y if z is None else y * torch.nn.functional.silu(z)), final


def combined_problem(length, heads, head_dim, groups, n_states, options, seed=0):
    p = problem(2, length, heads, head_dim, groups, n_states, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    p["z"] = torch.randn(p["x"].shape, generator=g, dtype=torch.float64) if "z" in options else None
    p["dt_bias"] = torch.randn(heads, generator=g, dtype=torch.float64) * 0.5 if "bias" in options else None
    p["D"] = p["D"] if "D" in options else None
    p["initial_state"] = p["initial_state"] if "h0" in options else None
    if "softplus" in options:
        p["dt"] = torch.randn(p["dt"].shape, generator=g, dtype=torch.float64)   # raw steps, any sign
    return p


@contextlib.contextmanager
def float32_matmul_precision(setting):
    """torch.set_float32_matmul_precision(setting) for the block, the previous setting restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("setting, products", [("highest", "tf32x3"), ("high", "tf32"), ("medium", "tf32")])
def test_float32_products_follow_torchs_matmul_precision(setting, products):
    """_tiles, whose DOT every chunk kernel passes to tl.dot, reads torch's float32 matmul precision at each call:
    three TF32 products (float32's accuracy) at "highest", torch's default, one (mamba_ssm's) at "high" or "medium"."""
    from scan_lib.ssd import _tiles
    with float32_matmul_precision(setting):
        assert _tiles(64, 64, 64)["DOT"] == products


def combined_grads(p, chunk, options, dtypes, weights):
    """(y, final and the gradients of <y, w_y> + <final, w_final>) by the op (dtypes given) or, with
    dtypes None, by the float64 reference; {name: tensor}."""
    names = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_state"]
    leaves = {k: p[k].to(DEVICE) if dtypes is None else p[k].to(dtypes.get(k, torch.float32)).to(DEVICE)
              for k in names if p[k] is not None}
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}
    args = [leaves.get(k) for k in names]
    if dtypes is None:
        y, final = combined_reference(*args[:5], chunk, *args[5:], "softplus" in options)
    else:
        x, dt, A, B, C, D, z, dt_bias, h0 = args
        y, final = scan_lib.mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D, z, dt_bias, h0,
                                                      dt_softplus="softplus" in options, return_final_states=True)
    loss = (y.double() * weights[0].to(DEVICE)).sum() + (final.double() * weights[1].to(DEVICE)).sum()
    return {"y": y, "final": final, **dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))}


@pytest.mark.parametrize("length, chunk, heads, groups, head_dim, n_states, options, precision",
                         [(37, 16, 4, 2, 3, 5, "D z bias softplus h0", "float32"), (70, 32, 2, 1, 8, 4, "", "float32"),
                          (1, 16, 2, 2, 4, 4, "D z bias softplus h0", "float32"),
                          (33, 16, 4, 4, 5, 3, "z softplus", "float32"), (40, 16, 2, 1, 4, 4, "bias h0", "float32"),
                          (17, 16, 2, 1, 16, 16, "D", "float32"), (45, 16, 4, 2, 3, 5, "D bias softplus", "float32"),
                          (21, 16, 2, 2, 4, 3, "z bias h0", "float32"), (52, 32, 3, 1, 5, 4, "z", "float32"),
                          (37, 16, 4, 2, 3, 5, "D z bias softplus h0", "bfloat16"), (70, 32, 2, 1, 8, 4, "", "bfloat16"),
                          (37, 16, 4, 2, 3, 5, "D z bias softplus h0 half-dt", "bfloat16"),
                          (37, 16, 4, 2, 3, 5, "D z bias softplus h0", "float16"), (17, 16, 2, 1, 16, 16, "D", "float16"),
                          (37, 16, 4, 2, 3, 5, "D z bias softplus h0", "tf32"), (70, 32, 2, 1, 8, 4, "", "tf32")])
def test_mamba_chunk_scan_combined_matches_autograd_through_the_chunked_form(length, chunk, heads, groups, head_dim,
                                                                             n_states, options, precision):
    """Every output and gradient of the op (z, dt_bias, softplus, D, the initial state and the final
    state's gradient, each where the case has it: the step with and without its bias and softplus, the
    gate with and without z) against autograd through ssd_chunked in float64 on the same values. float32
    inputs: float32 rounding (A and dt_bias, sums over every position, a little looser); x, z, B and C
    (and dt with half-dt) in half precision: a few roundings of 2^-8 (bf16) or 2^-11 (fp16); tf32: float32
    inputs under torch.set_float32_matmul_precision("high"), one TF32 product (2^-11 per operand) on a GPU."""
    p = combined_problem(length, heads, head_dim, groups, n_states, options, seed=length)
    g = torch.Generator().manual_seed(length + 2)
    weights = [torch.randn(shape, generator=g, dtype=torch.float64)
               for shape in (p["x"].shape, (2, heads, head_dim, n_states))]
    half = {"float32": torch.float32, "tf32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[precision]
    dtypes = {k: half for k in ("x", "z", "B", "C", *(["dt"] if "half-dt" in options else []))}
    want = combined_grads(p, chunk, options, None, weights)
    with float32_matmul_precision("high" if precision == "tf32" else "highest"):
        got = combined_grads(p, chunk, options, dtypes, weights)
    assert set(got) == set(want)
    assert got["y"].dtype == half and got["final"].dtype == torch.float32
    for name, w in want.items():
        if name not in ("y", "final"):   # each gradient in its input's dtype
            assert got[name].dtype == dtypes.get(name, torch.float32), name
        error = rel(got[name].double().cpu(), w.detach().cpu())
        bound = {"float32": 5e-5 if name in ("A", "dt_bias") else 1e-5, "bfloat16": 3e-2, "float16": 5e-3,
                 "tf32": 5e-3}[precision]
        assert error < bound, (name, error)


def _small_combined(seed=0):
    p = {k: v.float().to(DEVICE) for k, v in problem(1, 20, 4, 3, 2, 5, seed=seed).items()}
    return p["x"], p["dt"], p["A"], p["B"], p["C"], p["D"], p["initial_state"]


def test_mamba_chunk_scan_combined_returns_what_mamba_ssm_returns():
    """y alone by default, (y, final states) on request; the final state is the chunked form's."""
    x, dt, A, B, C, D, h0 = _small_combined()
    y = scan_lib.mamba_chunk_scan_combined(x, dt, A, B, C, 16)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape
    y2, final = scan_lib.mamba_chunk_scan_combined(x, dt, A, B, C, 16, D, initial_states=h0, return_final_states=True)
    y_want, final_want = ssd_chunked(*(t.double() for t in (x, dt, A, B, C)), 16, D.double(), h0.double())
    assert rel(y2.double(), y_want) < 1e-5 and rel(final.double(), final_want) < 1e-5 and final.shape == h0.shape


def test_mamba_chunk_scan_combined_folds_the_softplus_and_the_gate_into_its_kernels():
    """Issue 24: the step's bias and softplus and the gate silu(z) run inside the kernels, forward and
    backward: the profiler sees the op's two custom ops and no PyTorch softplus, silu, sigmoid or their
    gradients, and autograd runs one node for the op (before, F.softplus, F.silu and the bias's add each
    recorded theirs)."""
    x, dt, A, B, C, D, h0 = (t.requires_grad_() for t in _small_combined())
    z, dt_bias = torch.randn_like(x).requires_grad_(), torch.randn_like(A).requires_grad_()
    with torch.profiler.profile() as prof:
        y = scan_lib.mamba_chunk_scan_combined(x, dt, A, B, C, 16, D, z, dt_bias, h0, dt_softplus=True)
        y.sum().backward()
    names = {event.name for event in prof.events()}
    assert {"scan_lib::ssd_fwd", "scan_lib::ssd_bwd"} <= names, sorted(names)
    elementwise = {n for n in names if any(op in n.lower() for op in ("softplus", "silu", "sigmoid"))}
    assert not elementwise, sorted(elementwise)
    nodes = {n.split(": ")[1] for n in names if n.startswith("autograd::engine::evaluate_function: ")}
    assert nodes == {"SSDFnBackward", "SumBackward0", "torch::autograd::AccumulateGrad"}, sorted(nodes)
    assert all(t.grad is not None for t in (x, dt, A, B, C, D, h0, z, dt_bias))


def test_the_gate_promotes_y_as_pytorch_would():
    """y = ybar silu(z) has the dtype PyTorch's product gives (x bf16, z float32: float32); each
    gradient has its input's dtype."""
    x, dt, A, B, C, D, h0 = _small_combined()
    x = x.bfloat16().requires_grad_()
    z = torch.randn(x.shape, device=DEVICE).requires_grad_()
    y = scan_lib.mamba_chunk_scan_combined(x, dt, A, B, C, 16, D, z)
    assert y.dtype == torch.float32
    y_want = ssd_chunked(*(t.double() for t in (x, dt, A, B, C)), 16, D.double())[0] * torch.nn.functional.silu(z.double())
    assert rel(y.double(), y_want) < 2e-2
    dx, dz = torch.autograd.grad(y.sum(), [x, z])
    assert dx.dtype == torch.bfloat16 and dz.dtype == torch.float32


def test_a_float64_step_is_taken_with_a_bias_or_softplus_as_before():
    """With a bias or softplus the step is computed in float32 from dt, as it was when PyTorch computed
    it: a float64 dt is taken there (its gradient float64), and refused without them."""
    x, dt, A, B, C, D, h0 = _small_combined()
    dt64 = dt.double().requires_grad_()
    y = scan_lib.mamba_chunk_scan_combined(x, dt64, A, B, C, 16, dt_softplus=True)
    y_want = scan_lib.mamba_chunk_scan_combined(x, dt, A, B, C, 16, dt_softplus=True)
    assert torch.equal(y, y_want)
    (ddt,) = torch.autograd.grad(y.sum(), [dt64])
    assert ddt.dtype == torch.float64
    with pytest.raises(TypeError, match="dt: ssd_forward computes in float32"):
        scan_lib.mamba_chunk_scan_combined(x, dt64, A, B, C, 16)


def test_mamba_chunk_scan_combined_of_an_empty_sequence_is_differentiable():
    x, dt, A, B, C, D, h0 = (t.requires_grad_() for t in _small_combined())
    y, final = scan_lib.mamba_chunk_scan_combined(x[:, :0], dt[:, :0], A, B[:, :0], C[:, :0], 16, D,
                                                  initial_states=h0, return_final_states=True)
    assert y.shape == x[:, :0].shape and torch.equal(final, h0.detach())
    dh0, dA = torch.autograd.grad((final * 3).sum(), [h0, A], allow_unused=True)
    assert torch.equal(dh0, torch.full_like(h0, 3.0)) and (dA is None or (dA == 0).all())


@pytest.mark.parametrize("name, make_bad, error, message", [
    ("z", lambda a: dict(a, z=a["x"][:, :5]), ValueError, "z must have shape"),
    ("z", lambda a: dict(a, z=a["x"].long()), TypeError, "z must be float16"),
    ("dt_bias", lambda a: dict(a, dt_bias=a["A"][:2]), ValueError, r"dt_bias must have shape \(heads,\)"),
    ("D", lambda a: dict(a, D=a["x"][0, 0]), ValueError, r"D must have shape \(heads,\)"),
    ("dt", lambda a: dict(a, dt=None), TypeError, "dt must be a torch.Tensor"),
    ("x", lambda a: dict(a, x=a["x"].tolist()), TypeError, "x must be a torch.Tensor"),
    ("chunk_size", lambda a: dict(a, chunk_size=24), ValueError, "chunk_size must be a power of two"),
    ("initial_states", lambda a: dict(a, initial_states=a["x"]), ValueError, "initial_state must have shape")])
def test_mamba_chunk_scan_combined_names_a_bad_argument(name, make_bad, error, message):
    x, dt, A, B, C, D, h0 = _small_combined()
    good = dict(x=x, dt=dt, A=A, B=B, C=C, chunk_size=16, D=D, z=x, dt_bias=A, initial_states=h0)
    bad = make_bad(good)
    with pytest.raises(error, match=message):
        scan_lib.mamba_chunk_scan_combined(bad.pop("x"), bad.pop("dt"), bad.pop("A"), bad.pop("B"), bad.pop("C"),
                                           bad.pop("chunk_size"), **bad)


def test_mamba_chunk_scan_combined_takes_its_options_by_keyword_only():
    """mamba_ssm has seq_idx and cu_seqlens between initial_states and dt_softplus: a positional
    dt_softplus would mean something else there, so it is refused here."""
    x, dt, A, B, C, D, h0 = _small_combined()
    with pytest.raises(TypeError):
        scan_lib.mamba_chunk_scan_combined(x, dt, A, B, C, 16, D, None, None, h0, True)


def test_mamba_chunk_scan_combined_has_no_silent_second_derivative():
    x, dt, A, B, C, D, h0 = _small_combined()
    x.requires_grad_()
    (gx,) = torch.autograd.grad(scan_lib.mamba_chunk_scan_combined(x, dt, A, B, C, 16, D).pow(2).sum(), x,
                                create_graph=True)
    with pytest.raises(RuntimeError, match="mamba_chunk_scan_combined has no second derivative"):
        torch.autograd.grad((gx ** 2).sum(), x)


def test_mamba_chunk_scan_combined_under_vmap_and_torch_func_grad():
    xs, dt, A, B, C, D, h0 = _small_combined()
    xs = torch.stack([xs, 2 * xs])                                 # a leading dimension to map over
    f = lambda x: scan_lib.mamba_chunk_scan_combined(x, dt, A, B, C, 16, D)   # noqa: E731
    batched = torch.func.vmap(f)(xs)
    grads = torch.func.vmap(torch.func.grad(lambda x: (f(x) ** 2).sum()))(xs)
    for i in range(2):
        assert torch.allclose(batched[i], f(xs[i]), rtol=0, atol=1e-6)
        leaf = xs[i].clone().requires_grad_()
        (expected,) = torch.autograd.grad((f(leaf) ** 2).sum(), leaf)
        assert torch.allclose(grads[i], expected, rtol=0, atol=1e-5)


def test_mamba_chunk_scan_combined_compiles_fullgraph():
    torch._dynamo.reset()
    x, dt, A, B, C, D, h0 = (t.requires_grad_() for t in _small_combined())
    z, dt_bias = torch.randn_like(x), torch.randn_like(A)

    def f(x, dt, A, B, C, D, h0):
        y, final = scan_lib.mamba_chunk_scan_combined(x, dt, A, B, C, 16, D, z, dt_bias, h0, dt_softplus=True,
                                                      return_final_states=True)
        return 2 * y, final

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, dt, A, B, C, D, h0)
    want = f(x, dt, A, B, C, D, h0)
    leaves = [x, dt, A, B, C, D, h0]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, w in zip(torch.autograd.grad(sum(t.sum() for t in got), leaves),
                    torch.autograd.grad(sum(t.sum() for t in want), leaves)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_start", [False, True])
def test_pass_states_is_linear_scan_over_the_chunks(reverse, with_start):
    """Chapter 10's state-passing kernel against chapter 03's linear_scan on the same recurrence, the
    entries as rows: the carry before each chunk (in the order walked) and the carry at the end, with
    a state of 5 x 7 entries in blocks of 16 (the last block partly masked)."""
    from scan_lib.ssd import pass_states
    g = torch.Generator().manual_seed(3 + reverse + 2 * with_start)
    batch, heads, n_chunks, head_dim, n_states = 2, 3, 6, 5, 7
    local = torch.randn(batch, heads, n_chunks, head_dim, n_states, generator=g).to(DEVICE)
    decay = torch.rand(batch, heads, n_chunks, generator=g).to(DEVICE)
    start = torch.randn(batch, heads, head_dim, n_states, generator=g).to(DEVICE) if with_start else None
    passed, end = pass_states(local, decay, start, reverse=reverse, block=16)
    rows = local.permute(0, 1, 3, 4, 2).reshape(batch, heads, -1, n_chunks)            # entries as rows
    after = scan_lib.linear_scan(decay[:, :, None, :], rows, None if start is None else start.reshape(batch, heads, -1),
                                 reverse=reverse)
    begin = torch.zeros_like(rows[..., :1]) if start is None else start.reshape(batch, heads, -1, 1)
    before = torch.cat([after[..., 1:], begin], -1) if reverse else torch.cat([begin, after[..., :-1]], -1)
    want_passed = before.reshape(batch, heads, head_dim, n_states, n_chunks).permute(0, 1, 4, 2, 3)
    want_end = (after[..., 0] if reverse else after[..., -1]).reshape(batch, heads, head_dim, n_states)
    assert rel(passed.cpu().double(), want_passed.cpu().double()) < 1e-6
    assert rel(end.cpu().double(), want_end.cpu().double()) < 1e-6


def test_a_chunk_longer_than_the_kernels_tile_is_the_same_computation():
    """chunk_size above KERNEL_CHUNK runs in chunks of KERNEL_CHUNK: the op's output, final state and
    gradients at chunk 128 against the float64 chunked form at chunk 128, float32 inputs, 150 positions."""
    from scan_lib.ssd import KERNEL_CHUNK
    assert KERNEL_CHUNK < 128
    p = combined_problem(150, 2, 4, 1, 4, "D h0", seed=5)
    g = torch.Generator().manual_seed(6)
    weights = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in (p["x"].shape, (2, 2, 4, 4))]
    want = combined_grads(p, 128, "D h0", None, weights)
    got = combined_grads(p, 128, "D h0", {}, weights)
    for name, w in want.items():
        assert rel(got[name].double().cpu(), w.detach().cpu()) < (5e-5 if name == "A" else 1e-5), name


def test_the_steps_kernel_covers_heads_past_its_first_block_of_32():
    """ssd_chunk_steps_kernel runs 32 heads a program: at 33 heads (groups of 11) the second program holds
    one head and 31 masked rows, with every option and a length not a multiple of the chunk."""
    options = "D z bias softplus h0"
    p = combined_problem(9, 33, 2, 3, 2, options, seed=9)
    p = {k: (v[:1] if k in ("x", "dt", "B", "C", "z", "initial_state") and v is not None else v) for k, v in p.items()}
    g = torch.Generator().manual_seed(10)
    weights = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in (p["x"].shape, (1, 33, 2, 2))]
    want = combined_grads(p, 16, options, None, weights)
    got = combined_grads(p, 16, options, {}, weights)
    for name, w in want.items():
        assert rel(got[name].double().cpu(), w.detach().cpu()) < (5e-5 if name in ("A", "dt_bias") else 1e-5), name


def test_the_gate_gradient_survives_a_float16_ybar_beyond_float16s_range():
    """float16 x and z: ybar = D x reaches 2e5, past float16's 65504, while y = ybar silu(z) (z = -10) stays
    in range. The adjoint kernel stages ybar through DYBAR, float32 for a float16 dy: dz stays finite and
    right (in float16, ybar would come back inf and dz inf or nan)."""
    x = torch.full((1, 5, 2, 2), 2000.0, dtype=torch.float64)
    dt, A = torch.full((1, 5, 2), 1e-3, dtype=torch.float64), torch.full((2,), -1.0, dtype=torch.float64)
    B = C = torch.full((1, 5, 1, 2), 1e-3, dtype=torch.float64)
    D, z = torch.full((2,), 100.0, dtype=torch.float64), torch.full(x.shape, -10.0, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (x.half(), z.half())]
    y = scan_lib.mamba_chunk_scan_combined(leaves[0].to(DEVICE), dt.float().to(DEVICE), A.float().to(DEVICE),
                                           B.half().to(DEVICE), C.half().to(DEVICE), 16, D.float().to(DEVICE),
                                           leaves[1].to(DEVICE))
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    (dz,) = torch.autograd.grad(y.double().sum(), [leaves[1]])
    z64 = z.requires_grad_()
    want = combined_reference(x, dt, A, B, C, 16, D, z64, None, None, False)[0]
    (dz_want,) = torch.autograd.grad(want.sum(), [z64])
    assert torch.isfinite(dz).all() and rel(dz.double().cpu(), dz_want) < 5e-3


class FakeCompiled:
    """Stands in for a compiled kernel: compiled[grid](*args) records (grid, args)."""
    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        assert len(grid) == 3, grid  # Triton 3.6's compiled launcher reads grid[0], grid[1] and grid[2]
        return lambda *args: self.calls.append(("compiled", grid, args))


class FakeJit:
    """Stands in for a @triton.jit kernel K(X, n, SIZE: constexpr): a call through it records ("triton", grid evaluated,
    args, constexprs) and returns a FakeCompiled."""
    arg_names = ["X", "n", "SIZE"]

    def __init__(self):
        self.calls, self.cache = [], {"the kernel's": "cache"}

    def config(self):
        return {}

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            meta = {**constexprs, **self.config()}
            self.calls.append(("triton", grid(meta) if callable(grid) else grid, args, constexprs))
            return FakeCompiled(self.calls)
        return launch


class FakeTuned(FakeJit):
    """Stands in for triton.autotune over K(X, n, SIZE: constexpr, BLOCK: constexpr): a call picks BLOCK = 32."""
    arg_names = ["X", "n", "SIZE", "BLOCK"]

    def config(self):
        import triton
        self.best_config = triton.Config({"BLOCK": 32}, num_warps=4)
        return self.best_config.all_kwargs()


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """scan_lib.ssd with its launches taken as on a GPU (no interpreter; device 0 current)."""
    ssd_module = sys.modules["scan_lib.ssd"]
    monkeypatch.setattr(ssd_module, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return ssd_module


def test_remembered_launches_go_through_triton_once_per_key(as_on_a_gpu, monkeypatch):
    """The first call for a key goes through Triton; later ones to the compiled kernel with the grid from the remembered
    configuration and every parameter after the arguments; another dtype, alignment or integer is another key."""
    ssd_module = as_on_a_gpu
    tuned = FakeTuned()
    kernel = ssd_module.RememberedLaunches(tuned)
    x = torch.zeros(64)
    grid = lambda meta: (100 // meta["BLOCK"],)  # noqa: E731
    kernel[grid](x, 100, SIZE=8)
    kernel[grid](x, 100, SIZE=8)
    kernel[(5, 2)](x, 100, SIZE=8)  # the grid is evaluated at each call: not part of the key
    assert tuned.calls == [("triton", (3,), (x, 100), {"SIZE": 8}), ("compiled", (3, 1, 1), (x, 100, 8, 32)),
                           ("compiled", (5, 2, 1), (x, 100, 8, 32))]
    tuned.calls.clear()
    kernel[grid](x[1:], 100, SIZE=8)  # 4 bytes off: not 16-byte aligned
    kernel[grid](x.double(), 100, SIZE=8)
    kernel[grid](x, 101, SIZE=8)
    kernel[grid](x, 100, SIZE=16)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    kernel[grid](x, 100, SIZE=8)
    assert [call[0] for call in tuned.calls] == ["triton"] * 5
    assert kernel.cache == {"the kernel's": "cache"}  # the rest is the wrapped kernel's
    assert ssd_module.RememberedLaunches(kernel).kernel is tuned  # wrapping twice (a cell run again) wraps once
    monkeypatch.setattr(ssd_module.RememberedLaunches, "through_triton", True)
    tuned.calls.clear()
    kernel[grid](x, 100, SIZE=8)
    assert [call[0] for call in tuned.calls] == ["triton"]


def test_remembered_launches_of_a_kernel_not_autotuned(as_on_a_gpu):
    """A plain @triton.jit kernel has no configuration: the parameters after the arguments are the constexprs."""
    jit = FakeJit()
    kernel = as_on_a_gpu.RememberedLaunches(jit)
    x = torch.zeros(64)
    for _ in range(2):
        kernel[(4, 2, 1)](x, 100, SIZE=8)
    assert jit.calls == [("triton", (4, 2, 1), (x, 100), {"SIZE": 8}), ("compiled", (4, 2, 1), (x, 100, 8))]


def test_the_op_launches_remembered_kernels():
    """Every kernel of scan_lib.ssd is launched through RememberedLaunches (the launchers look the names up at each
    call), so a new kernel is covered too."""
    from scan_lib import ssd
    from scan_lib.ssd import RememberedLaunches
    kernels = [name for name in dir(ssd) if name.endswith("_kernel")]
    assert len(kernels) == 10 and all(isinstance(getattr(ssd, name), RememberedLaunches) for name in kernels), kernels


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: under the interpreter every launch goes through Triton")
def test_remembered_launches_give_the_same_bits_as_triton(monkeypatch):
    """A training step with every option at an awkward length: through Triton's launch path, then twice from the
    remembered launches (the first records the keys, the second launches the compiled kernels): the same bits."""
    from scan_lib.ssd import RememberedLaunches
    p = {k: v.float().to(DEVICE) for k, v in combined_problem(37, 4, 8, 2, 16, ("D", "z", "bias", "h0", "softplus"),
                                                               seed=3).items() if v is not None}
    dy = torch.randn_like(p["x"])

    def step():
        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        y = scan_lib.mamba_chunk_scan_combined(*[leaves[k] for k in ("x", "dt", "A", "B", "C")], 16, leaves["D"],
                                               leaves["z"], leaves["dt_bias"], leaves["initial_state"],
                                               dt_softplus=True)
        return (y, *torch.autograd.grad(y, list(leaves.values()), dy))

    monkeypatch.setattr(RememberedLaunches, "through_triton", True)
    want = step()
    monkeypatch.setattr(RememberedLaunches, "through_triton", False)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(step(), want))


@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("length, chunk, heads, groups, head_dim, n_states, options", [
    (37, 16, 4, 2, 3, 5, "D z bias softplus h0"), (70, 32, 2, 1, 80, 16, "z h0"), (5, 16, 2, 2, 4, 4, ""),
    (130, 64, 2, 1, 16, 8, "D bias softplus")])
def test_the_walk_over_the_chunks_matches_the_chunked_form(dtype, bound, length, chunk, heads, groups, head_dim,
                                                          n_states, options):
    """_walk_forward (one program per batch, head and block of P walking the chunks, the state in registers): y and
    the final state against the float64 chunked form on the inputs rounded to dtype, at lengths that are not
    multiples of the chunk, P = 80 (two blocks of 64), groups and every option; bounds as the op's tests'."""
    from scan_lib.ssd import _walk_forward
    p = combined_problem(length, heads, head_dim, groups, n_states, options.split())
    for name in ("x", "B", "C", "z"):
        if p[name] is not None:
            p[name] = p[name].to(dtype).double()   # the reference sees the rounded inputs
    y_want, final_want = combined_reference(p["x"], p["dt"], p["A"], p["B"], p["C"], chunk, p["D"], p["z"],
                                            p["dt_bias"], p["initial_state"], "softplus" in options)
    cast = {k: None if v is None else v.to(DEVICE, dtype if k in ("x", "B", "C", "z") else torch.float32)
            for k, v in p.items()}
    y, final = _walk_forward(cast["x"], cast["dt"], cast["A"], cast["B"], cast["C"], chunk, cast["D"],
                             cast["initial_state"], cast["z"], cast["dt_bias"], "softplus" in options)
    assert y.dtype == dtype and final.dtype == torch.float32 and final.shape == (2, heads, head_dim, n_states)
    assert rel(y.double().cpu(), y_want) < bound and rel(final.double().cpu(), final_want) < bound


def test_the_op_walks_the_chunks_for_16_bit_inputs_with_enough_programs(monkeypatch):
    """_walks: 16-bit x only; on a GPU, only with at least as many programs (batch x heads x blocks of 64 of P) as
    multiprocessors; under the interpreter (no multiprocessors) wherever x is 16-bit. The op's forward follows it."""
    from scan_lib import ssd
    x = torch.zeros(2, 8, 4, 80, dtype=torch.bfloat16)   # 2 x 4 x 2 programs
    monkeypatch.setattr(ssd, "multiprocessor_count", lambda device: None)
    assert ssd._walks(x) and ssd._walks(x.half()) and not ssd._walks(x.float())
    monkeypatch.setattr(ssd, "multiprocessor_count", lambda device: 16)
    assert ssd._walks(x) and not ssd._walks(x[:1])
    monkeypatch.setattr(ssd, "multiprocessor_count", lambda device: None)
    walked = []
    monkeypatch.setattr(ssd, "_walk_forward", lambda *args: walked.append(args[0].dtype) or ssd._forward_kernels(*args))
    p = {k: v.float().to(DEVICE) for k, v in problem(1, 20, 4, 3, 2, 5).items()}
    for dtype in (torch.bfloat16, torch.float32):
        scan_lib.mamba_chunk_scan_combined(p["x"].to(dtype), p["dt"], p["A"], p["B"].to(dtype), p["C"].to(dtype), 16)
    assert walked == [torch.bfloat16]


def test_the_walk_falls_back_to_section_5s_kernels_where_the_gpu_refuses_it(monkeypatch):
    """A GPU whose shared memory cannot hold the walk's pipelined tiles (an L4's at N 128 in bf16) makes Triton raise
    OutOfResources at the launch: _walk_forward then returns _forward_kernels' results (the same bits) and does not
    try that walk again; another key still walks. Simulated: the interpreter has no shared memory to run out of."""
    from triton.runtime.errors import OutOfResources
    from scan_lib import ssd
    tries, walk = [], ssd.ssd_chunk_walk_kernel

    class Refusing:
        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                tries.append(constexprs["BLOCK_N"])
                if constexprs["BLOCK_N"] > 16:
                    raise OutOfResources(200_000, 101_376, "shared memory")
                walk[grid](*args, **constexprs)
            return launch

    monkeypatch.setattr(ssd, "ssd_chunk_walk_kernel", Refusing())
    monkeypatch.setattr(ssd, "_WALK_REFUSED", set())
    for n_states in (20, 20, 8):
        p = {k: v.to(DEVICE, torch.bfloat16 if k in ("x", "B", "C") else torch.float32)
             for k, v in problem(2, 37, 4, 8, 2, n_states).items()}
        args = (p["x"], p["dt"], p["A"], p["B"], p["C"], 16, p["D"], p["initial_state"])
        got, want = ssd._walk_forward(*args), ssd._forward_kernels(*args)
        assert n_states != 20 or all(torch.equal(g, w) for g, w in zip(got, want))
        y_want, final_want = ssd_chunked(*(t.double().cpu() for t in args[:5]), 16, *(t.double().cpu() for t in args[6:]))
        assert rel(got[0].double().cpu(), y_want) < 3e-2 and rel(got[1].double().cpu(), final_want) < 3e-2
    assert tries == [32, 16], tries   # N 20 (BLOCK_N 32) refused once, then not tried; N 8 walked


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: under the interpreter the op walks every 16-bit input")
def test_the_op_walks_the_chunks_on_a_gpu_with_enough_programs():
    """On a GPU the op's bf16 forward walks the chunks when batch x heads x blocks of P reaches the multiprocessors
    (here 2 x heads, at least the count, P 16): y and the final state against the float64 chunked form."""
    from scan_lib import ssd
    heads = -(-ssd.multiprocessor_count(torch.device(DEVICE)) // 2)
    p = combined_problem(70, heads, 16, 1, 16, ["D", "z", "h0"], seed=5)
    for name in ("x", "B", "C", "z"):
        p[name] = p[name].bfloat16().double()
    y_want, final_want = combined_reference(p["x"], p["dt"], p["A"], p["B"], p["C"], 32, p["D"], p["z"], None,
                                            p["initial_state"], False)
    cast = {k: None if v is None else v.to(DEVICE, torch.bfloat16 if k in ("x", "B", "C", "z") else torch.float32)
            for k, v in p.items()}
    assert ssd._walks(cast["x"])
    y, final = scan_lib.mamba_chunk_scan_combined(cast["x"], cast["dt"], cast["A"], cast["B"], cast["C"], 32,
                                                  cast["D"], cast["z"], initial_states=cast["initial_state"],
                                                  return_final_states=True)
    assert rel(y.double().cpu(), y_want) < 3e-2 and rel(final.double().cpu(), final_want) < 3e-2
