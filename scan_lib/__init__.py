"""scan_lib: parallel scans in Triton, from cumulative sums to Mamba's selective scan and block.

The kernel modules are generated from the notebooks in notebooks/ (see their headers); this file,
written by hand, is the public API. `runtime` is imported first: without a GPU it switches Triton
to its CPU interpreter before any kernel is defined.
"""
from . import runtime  # noqa: F401  (must come before any module that defines kernels)
from .cumsum import cumsum
from .linear_scan import linear_scan
from .multistate import multistate_scan
from .fast_selective_scan import selective_scan  # chapter 07's kernels; chapter 05's stay in .selective_scan
from .causal_conv1d import causal_conv1d, causal_conv1d_update
from .mamba import InferenceParams, Mamba, selective_state_update
from .flash_attention import flash_attention
from .ssd import Mamba2, RMSNormGated, mamba_chunk_scan_combined

__all__ = ["runtime", "cumsum", "linear_scan", "multistate_scan", "selective_scan", "causal_conv1d",
           "causal_conv1d_update", "Mamba", "InferenceParams", "selective_state_update", "flash_attention",
           "mamba_chunk_scan_combined", "Mamba2", "RMSNormGated"]
