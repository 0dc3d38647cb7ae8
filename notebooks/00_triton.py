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
# # 00 · Triton in one sitting
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/scan-course/scans-the-hard-way/blob/main/notebooks/00_triton.ipynb)

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

# %% [markdown]
# ## The setup cell, opened up
#
# What `import scan_lib` did above lives in `scan_lib/runtime.py`, which is written from the cells
# below marked `#| export`. Triton decides *when a kernel is defined* whether it will compile it for
# the GPU or run it in its CPU interpreter, by reading the environment variable `TRITON_INTERPRET`.
# So the variable must be set before the first `@triton.jit`: that is why every chapter imports
# `scan_lib` in its first cell.

# %%
#| default_exp runtime

# %%
#| export
"""Where kernels run: the GPU when there is one, else Triton's CPU interpreter; shared input checks."""
import os
from pathlib import Path

import torch


def use_interpreter_without_gpu() -> bool:
    """Set TRITON_INTERPRET=1 when no CUDA GPU is visible. Call before any @triton.jit is defined."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


INTERPRET: bool = use_interpreter_without_gpu()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU: bool = DEVICE.type == "cuda" and not INTERPRET


def describe() -> str:
    """One line saying where kernels will run, for the top of every notebook and benchmark."""
    if ON_GPU:
        return f"GPU: {torch.cuda.get_device_name(DEVICE)} (torch {torch.__version__})"
    return f"no GPU: Triton's CPU interpreter, small problem sizes (torch {torch.__version__})"


def figure_path(name: str) -> Path:
    """Where a notebook saves a figure: the repository's figures/ folder, or ./figures elsewhere (Colab)."""
    here = Path.cwd()
    folder = (here.parent if here.name == "notebooks" else here) / "figures"
    folder.mkdir(exist_ok=True)
    return folder / name


def save_figure(fig, name: str) -> Path:
    """Save a matplotlib figure to figures/<name> with no timestamp or version in the file,
    so that re-running a notebook rewrites the same bytes and leaves git clean."""
    path = figure_path(name)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    return path

# %%
#| export
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float_tensor(name: str, value) -> None:
    """Raise a TypeError naming `name` unless `value` is a tensor of a floating dtype we support."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {value.dtype}")


def check_same_device(**tensors) -> torch.device:
    """Raise a ValueError naming the arguments unless all given tensors (None skipped) share one device
    on which the kernels can run, and return that device.

    On a GPU machine kernels need CUDA tensors; under the interpreter, CPU tensors (the interpreter
    also copies CUDA tensors through the host, so those are accepted too). Meta tensors never are."""
    named = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in named.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in named.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    device = devices.pop()
    if INTERPRET and device.type not in ("cpu", "cuda"):
        raise ValueError(f"{', '.join(named)} must be CPU tensors for Triton's interpreter (got {device})")
    if not INTERPRET and device.type != "cuda":
        raise ValueError(
            f"{', '.join(named)} must be CUDA tensors (got {device}); to run Triton kernels on the CPU "
            "set TRITON_INTERPRET=1 before importing scan_lib"
        )
    return device
