"""scan_lib.runtime: where kernels run, input checks, deterministic figures."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
import torch

from scan_lib.runtime import DEVICE, INTERPRET, ON_GPU, check_float_tensor, check_same_device, save_figure


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
    contents = []
    for _ in range(2):
        fig, ax = plt.subplots()
        ax.plot([0, 1, 2], [1, 0, 1])
        contents.append(save_figure(fig, "line.png").read_bytes())
        plt.close(fig)
    assert (tmp_path / "figures" / "line.png").exists() and contents[0] == contents[1]
