"""What the GPU executes, without a GPU: compile chapter 07's selective-scan kernels for sm_90 (H100/H200)
with the ptxas that ships in Triton's wheel, disassemble them with its cuobjdump, and count the
instructions of the loop over states per (position, state) a thread handles.

    python benchmarks/sass_count.py [--dtype bf16|fp32] [--out DIR]

Static counts: the instructions of one trip through the innermost loop (one chunk, for the forward
UNROLL states of it, for the backward one), divided by the (position, state) pairs each thread holds
in it (UNROLL x BLOCK_D x CHUNK / (32 x num_warps)); the registers and stack frame ptxas reports. They say where instructions go (the opcode
mix), not how fast a kernel runs: occupancy and latency decide that (Nsight Compute on the GPU
measures both).
"""
import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"        # compile for the GPU target even where no GPU is visible
import triton                               # noqa: E402
import triton.language as tl                # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource       # noqa: E402

import scan_lib.fast_selective_scan as fast  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?);", re.M)


def compile_sm90(kernel, args, num_warps):
    """kernel compiled for sm_90: args maps each parameter to a pointer type ('*bf16'), an int (1 is
    specialised away, multiples of 16 marked as such, as Triton's launcher does) or a constexpr value."""
    signature, constants, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = args[name]
        if param.is_constexpr or value is None or isinstance(value, bool) or value == 1:
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, str):
            signature[name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def sass_and_resources(compiled, out_dir):
    cubin = Path(out_dir) / f"{compiled.name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([TOOLS / "cuobjdump", "--dump-sass", cubin], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([TOOLS / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True,
                           check=True).stdout
    (Path(out_dir) / f"{compiled.name}.sass").write_text(sass)
    return sass, int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


def innermost_loop(sass):
    """The instructions of the shortest backward branch's body: (address, text) pairs."""
    instructions = [(int(a, 16), text) for a, text in INSTRUCTION.findall(sass)]
    loops = []
    for address, text in instructions:
        target = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            loops.append([(a, t) for a, t in instructions if start <= a <= address])
    return min(loops, key=len)


def opcode(text):
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def gpu_chunk(kind, dtype):
    """The chunk GPU_CONFIG gives `kind` on `dtype` inputs (fast.launch_config: the backward's scales)."""
    chunk, size = fast.GPU_CONFIG[kind]["chunk"], 2 if dtype == "bf16" else 4
    return chunk * 4 // size if kind == "bwd" else chunk


def kernel_args(kind, dtype, batch=8, dim=1024, length=2048, n_states=16):
    """The arguments of a launch at the benchmark's base shape, contiguous inputs, no D, z, delta_bias."""
    config = fast.GPU_CONFIG[kind]
    chunk, size = gpu_chunk(kind, dtype), 2 if dtype == "bf16" else 4
    big = dict(su_b=dim * length, su_d=length, su_l=1, sdt_b=dim * length, sdt_d=length, sdt_l=1,
               sz_b=0, sz_d=0, sz_l=0, sa_d=n_states, sa_n=1, sb_b=n_states * length, sb_g=n_states * length,
               sb_n=length, sb_l=1, sc_b=n_states * length, sc_g=n_states * length, sc_n=length, sc_l=1)
    shared = dict(U=f"*{dtype}", DELTA=f"*{dtype}", A="*fp32", B=f"*{dtype}", C=f"*{dtype}", D=None, Z=None,
                  BIAS=None, dim=dim, length=length, n_chunks=length // chunk,
                  seg_chunks=length // chunk, per_group_b=dim, per_group_c=dim, N_STATES=n_states,
                  HAS_D=False, HAS_Z=False, HAS_BIAS=False, B_PER_STEP=True, C_PER_STEP=True, SOFTPLUS=False,
                  ACC=tl.float32, BLOCK_D=config["block_d"], BLOCK_N=n_states, CHUNK=chunk, **big)
    if kind == "fwd":
        return fast.strided_fwd_kernel, dict(shared, H0=None, OUT=f"*{dtype}", STATES="*fp32", LAST="*fp32",
                                             DSUM=None, HAS_H0=False, SAVE=False, SAVE_EVERY=chunk, SUMMARY=False,
                                             so_b=dim * length, so_d=length, so_l=1,
                                             UNROLL=fast.states_per_step(config, chunk, n_states,
                                                                         batch * dim // config["block_d"], 132))
    items = min(chunk, 16 // size)                                          # fast.run_items
    shared = {name: value for name, value in shared.items() if name not in ("BLOCK_N", "CHUNK")}
    shared.update(SEGS=chunk // items, ITEMS=items)
    return fast.strided_bwd_kernel, dict(shared, STATES="*fp32", DOUT=f"*{dtype}", DLAST=None, DU=f"*{dtype}",
                                         DDELTA=f"*{dtype}", DZ=None, DB="*fp32", DC="*fp32", DA_PART="*fp32",
                                         DA="*fp32", DD=None, DBIAS=None, DH0="*fp32", HAS_DLAST=False,
                                         so_b=dim * length, so_d=length, so_l=1, sg_b=dim * length, sg_d=length,
                                         sg_l=1)


def count(kind, dtype, out_dir):
    """(instructions per (position, state) per thread, registers, stack bytes, opcode counts)."""
    kernel, args = kernel_args(kind, dtype)
    config = fast.GPU_CONFIG[kind]
    sass, registers, stack = sass_and_resources(compile_sm90(kernel, args, config["num_warps"]), out_dir)
    loop = innermost_loop(sass)
    per_thread = args.get("UNROLL", 1) * config["block_d"] * gpu_chunk(kind, dtype) // (32 * config["num_warps"])
    return len(loop) / per_thread, registers, stack, Counter(opcode(text) for _, text in loop)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--out", default=None, help="folder for the cubin and SASS files (default: a temporary one)")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out_dir = options.out or scratch
        os.makedirs(out_dir, exist_ok=True)
        print(f"sm_90 SASS of chapter 07's kernels, (8, 1024, 2048, N=16), {options.dtype}, GPU_CONFIG {fast.GPU_CONFIG}")
        for kind in ("fwd", "bwd"):
            per_pair, registers, stack, ops = count(kind, options.dtype, out_dir)
            print(f"  {kind}: {per_pair:5.1f} instructions per (position, state) per thread; {registers} registers, "
                  f"{stack} bytes of stack")
            print("       " + ", ".join(f"{name} {n}" for name, n in ops.most_common(10)))


if __name__ == "__main__":
    main()
