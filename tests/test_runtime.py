"""scan_lib.runtime: where kernels run, input checks, deterministic figures, compiled code, rounding."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
import torch

import scan_lib  # noqa: F401  (before triton: without a GPU it switches Triton to its interpreter)
import triton
import triton.language as tl

from scan_lib.runtime import (DEVICE, INTERPRET, ON_GPU, apply, check_float_tensor, check_same_device, custom_op, gpu_assembly,
                              rounds_to_nearest, save_figure)


def test_device_and_interpreter_agree():
    assert ON_GPU == (DEVICE.type == "cuda" and not INTERPRET)
    assert ON_GPU or INTERPRET


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_float_tensors_pass(dtype):
    check_float_tensor("x", torch.ones(2, dtype=dtype))


@pytest.mark.parametrize("value,words", [
    ([1.0], "x must be a torch.Tensor, got list"),
    (torch.ones(2, dtype=torch.int32), "x must be float16"),
    (torch.ones(2, dtype=torch.complex64), "x must be float16"),
])
def test_non_float_rejected_with_name(value, words):
    with pytest.raises(TypeError, match=words):
        check_float_tensor("x", value)


@triton.jit
def _sum_by_blocks_kernel(X, OUT, n, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):   # a `for` over a bound given at run time
        offsets = start + tl.arange(0, BLOCK)
        acc += tl.load(X + offsets, mask=offsets < n, other=0.0)
    tl.store(OUT, tl.sum(acc, axis=0))


def test_a_for_loop_over_a_runtime_bound_runs():
    """The loop Triton 3.6's interpreter could not run under NumPy 2.4 before runtime mended it."""
    x, out = torch.randn(100, device=DEVICE), torch.empty(1, device=DEVICE)
    _sum_by_blocks_kernel[(1,)](x, out, 100, BLOCK=16)
    torch.testing.assert_close(out[0], x.sum(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="the mend is for Triton's CPU interpreter")
def test_the_interpreter_turns_a_one_element_scalar_into_an_int_by_squeezing_it():
    """NumPy 2.4 refuses int() of an array of one dimension; a scalar's index must squeeze it first
    (Triton 3.9 does; runtime gives 3.5 and 3.6 the same line)."""
    from triton.runtime import interpreter

    class OneDimensional:   # int() of it fails as NumPy 2.4's does for shape (1,); its squeeze is a 0-d value
        def __int__(self):
            raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

        def squeeze(self):
            return 7

    class Tensor:
        def __init__(self):
            self.handle = type("Handle", (), {"data": OneDimensional()})()

    if not hasattr(interpreter, "_patch_lang_tensor"):
        pytest.skip(f"Triton {triton.__version__}'s interpreter is laid out differently")
    # as the kernels run: 3.5 and 3.6 mended, 3.9 its own; 3.6 and 3.9 patch through a scope, 3.5 directly
    scope = (interpreter._LangPatchScope(),) if hasattr(interpreter, "_LangPatchScope") else ()
    interpreter._patch_lang_tensor(Tensor, *scope)
    assert int(Tensor.__index__(Tensor())) == 7


def test_same_device_returns_it_and_skips_none():
    a, c = torch.ones(1, device=DEVICE), torch.ones(2, device=DEVICE)
    assert check_same_device(a=a, b=None, c=c) == a.device      # cuda:0 on a GPU, not the bare "cuda"


def test_mixed_devices_rejected_naming_each():
    with pytest.raises(ValueError, match="a on .*, b on meta"):
        check_same_device(a=torch.ones(1, device=DEVICE), b=torch.ones(1, device="meta"))


def test_only_none_rejected_naming_the_arguments():
    with pytest.raises(ValueError, match="a, b: no tensor given"):
        check_same_device(a=None, b=None)


def test_meta_tensor_rejected():
    with pytest.raises(ValueError, match="x must be"):
        check_same_device(x=torch.ones(1, device="meta"))


def test_save_figure_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SCAN_COURSE_FIGURES", raising=False)
    contents = []
    for _ in range(2):
        fig, ax = plt.subplots()
        ax.plot([0, 1, 2], [1, 0, 1])
        assert save_figure(fig, "line.png") is None             # nothing to echo as the cell's output
        contents.append((tmp_path / "figures" / "line.png").read_bytes())
        assert not plt.fignum_exists(fig.number)                # closed: not drawn a second time
    assert contents[0] == contents[1]


def test_figures_go_where_scan_course_figures_says(tmp_path, monkeypatch):
    """make test and make course set SCAN_COURSE_FIGURES so that a CPU run leaves figures/ alone."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SCAN_COURSE_FIGURES", str(tmp_path / "elsewhere"))
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    save_figure(fig, "line.png")
    assert (tmp_path / "elsewhere" / "line.png").exists() and not (tmp_path / "figures").exists()


def truncate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 -> dtype conversion that drops the low bits (towards zero), as Triton 3.6's
    interpreter does for bfloat16: the bug rounds_to_nearest must catch."""
    dropped = 23 - round(-torch.log2(torch.tensor(torch.finfo(dtype).eps)).item())   # 16 for bf16, 13 for fp16
    bits = x.float().view(torch.int32) & ~((1 << dropped) - 1)
    return bits.view(torch.float32).to(dtype)                                 # now exact in dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_check_catches_a_truncating_cast(dtype):
    assert rounds_to_nearest(lambda x, dtype: x.to(dtype), dtype)
    assert not rounds_to_nearest(truncate, dtype)


def test_old_rounding_value_could_not_catch_truncation_in_float16():
    x = torch.tensor([1 + 2**-8 + 2**-10, -(1 + 2**-8 + 2**-10)])           # exact in float16
    assert torch.equal(truncate(x, torch.float16), x.to(torch.float16))


@triton.jit
def _scale_kernel(X, Y, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(Y + offsets, tl.exp(tl.load(X + offsets, mask=mask)), mask=mask)


@pytest.mark.parametrize("num_warps", [2, 8])
def test_gpu_assembly_shows_the_layout_and_the_fast_exp(num_warps):
    code = gpu_assembly(_scale_kernel, {"X": "*fp32", "Y": "*fp32", "n": "i32"}, num_warps=num_warps, BLOCK=512)
    assert f"warpsPerCTA = [{num_warps}]" in code["ttgir"] and "threadsPerWarp = [32]" in code["ttgir"]
    assert "ex2.approx.f32" in code["ptx"]


class _Square(torch.autograd.Function):
    """A new-style Function (forward without ctx, setup_context), as scan_lib's ops are."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, scale):
        return x * x * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, scale = inputs
        ctx.save_for_backward(x)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return apply(_Square, x, 2.0 * ctx.scale) / x * grad, None  # 2 x scale grad, through the Function again


def test_apply_runs_the_function_in_eager_mode_and_under_transforms():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = apply(_Square, x, 3.0)
    assert type(y.grad_fn).__name__ == "_SquareBackward"            # the eager twin, named like the Function
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert torch.allclose(g, 6 * x)
    (gg,) = torch.autograd.grad(g.sum(), x)                          # double backward through the twin
    assert torch.allclose(gg, torch.full_like(x, 6.0))
    func_grad = torch.func.grad(lambda t: apply(_Square, t, 3.0).sum())(x.detach())
    assert torch.allclose(func_grad, 6 * x.detach())
    assert torch.allclose(torch.func.vmap(lambda t: apply(_Square, t, 3.0))(x.detach()[:, None]), 3 * x.detach()[:, None] ** 2)
    compiled = torch.compile(lambda t: apply(_Square, t, 3.0), fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(x), 3 * x * x)


def _counted_op():
    """A custom op made by runtime.custom_op, and a list that grows by one per call through the dispatcher."""
    through_dispatcher = []

    @custom_op("double_it", __name__)
    def double_it(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @double_it.register_fake
    def _(x):
        return torch.empty_like(x)

    double_it.register_vmap(lambda info, dims, t: (t * 2, dims[0]))
    op = double_it._op
    double_it._op = lambda *args: through_dispatcher.append(1) or op(*args)
    return double_it, through_dispatcher


def test_a_plain_eager_call_skips_the_dispatcher():
    double_it, through_dispatcher = _counted_op()
    assert torch.equal(double_it(torch.ones(3)), torch.full((3,), 2.0))
    assert through_dispatcher == []


def test_parameters_and_keywords_keep_the_fast_path():
    double_it, through_dispatcher = _counted_op()
    assert torch.equal(double_it(x=torch.nn.Parameter(torch.ones(3), requires_grad=False)), torch.full((3,), 2.0))
    assert through_dispatcher == [] and double_it.__name__ == "double_it"


@pytest.mark.parametrize("context", ["requires_grad", "fake", "compile", "vmap", "profiler", "jit_trace"])
def test_calls_that_need_the_dispatcher_go_through_it(context):
    """Gradients through the op, fake tensors, torch.compile, torch.func and the profiler's op names
    are the dispatcher's business: those calls go through the registered op, and give its result."""
    double_it, through_dispatcher = _counted_op()
    x = torch.ones(3)
    if context == "requires_grad":
        with pytest.raises(RuntimeError):   # the op has no autograd formula: the dispatcher says so
            double_it(x.requires_grad_()).sum().backward()
    elif context == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode() as mode:
            assert double_it(mode.from_tensor(x)).shape == (3,)
    elif context == "compile":
        assert torch.equal(torch.compile(double_it, backend="eager", fullgraph=True)(x), x * 2)
    elif context == "vmap":
        assert torch.equal(torch.func.vmap(double_it)(torch.ones(2, 3)), torch.full((2, 3), 2.0))
    elif context == "profiler":
        with torch.profiler.profile():
            assert torch.equal(double_it(x), x * 2)
    else:   # the tracer records the op, so the trace computes it again on new inputs
        traced = torch.jit.trace(lambda t: double_it(t), x)
        assert torch.equal(traced(torch.full((3,), 5.0)), torch.full((3,), 10.0))
    assert through_dispatcher, f"{context}: the call did not go through the op"


def _opcheck_cases():
    """(custom op, arguments) for torch.library.opcheck: the registered ops behind the public ones."""
    import importlib
    cumsum, conv = importlib.import_module("scan_lib.cumsum"), importlib.import_module("scan_lib.causal_conv1d")
    multistate = importlib.import_module("scan_lib.multistate")
    x, weight, bias = torch.randn(2, 4, 9, device=DEVICE), torch.randn(4, 4, device=DEVICE), torch.randn(4, device=DEVICE)
    a = torch.rand(2, 3, 9, device=DEVICE)
    ssd = importlib.import_module("scan_lib.ssd")
    g = torch.Generator().manual_seed(0)
    scan = [torch.randn(*shape, generator=g).to(DEVICE) for shape in ((2, 20, 4, 3), (2, 20, 4), (4,), (2, 20, 2, 5),
                                                                       (2, 20, 2, 5), (4,), (2, 4, 3, 5))]
    scan[1], scan[2] = scan[1].sigmoid(), -scan[2].exp()                  # positive steps, negative decays
    u, dt, A, B, C, D, h0 = scan
    z, dt_bias = torch.randn(u.shape, generator=g).to(DEVICE), torch.randn(4, generator=g).to(DEVICE)
    return {"cumsum": (cumsum.cumsum_op, (x[0], -1)),
            "causal_conv1d_fwd": (conv.causal_conv1d_fwd, (x, weight, bias, None, True)),
            "causal_conv1d_bwd": (conv.causal_conv1d_bwd, (x, weight, bias, None, torch.randn_like(x), None, True)),
            "multistate_fwd": (multistate.multistate_fwd, (a, a, a, x[:, 0], None, 16, False)),
            "ssd_fwd": (ssd.ssd_fwd, (u, dt, A, B, C, 16, D, None, None, h0, False)),
            "ssd_fwd with the gate and the step's options": (ssd.ssd_fwd, (u, dt, A, B, C, 16, D, z, dt_bias, h0, True)),
            "ssd_bwd": (ssd.ssd_bwd, (u, dt, A, B, C, 16, torch.randn_like(u), torch.randn_like(h0), D, None, None, h0,
                                      False)),
            "ssd_bwd with the gate and the step's options": (
                ssd.ssd_bwd, (u, dt, A, B, C, 16, torch.randn_like(u), torch.randn_like(h0), D, z, dt_bias, h0, True)),
            "ssd_bwd without options": (ssd.ssd_bwd, (u, dt, A, B, C, 16, torch.randn_like(u), None, None, None, None,
                                                      None, False))}


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_the_registered_ops_pass_opcheck(name):
    """The dispatcher's checks (schema, fake tensors, autograd registration, AOT dispatch) on the ops
    EagerFastOp skips in plain calls: the registered op must stay correct for the calls that use it."""
    op, args = _opcheck_cases()[name]
    results = torch.library.opcheck(op._op, args)
    assert all(result == "SUCCESS" for result in results.values()), results
