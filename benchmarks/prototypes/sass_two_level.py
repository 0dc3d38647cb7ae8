"""Static sm_90 SASS of the two-level prototype's loop over states, as benchmarks/sass_count.py counts
chapter 07's kernels (no GPU needed): python benchmarks/prototypes/sass_two_level.py"""
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1])]
import tempfile
from collections import Counter
import triton.language as tl
import sass_count as sc
from two_level_bwd import two_level_bwd_kernel

def count(dt, items, chunk, block_d, dim=1024, length=2048, n=16):
    args = dict(U=f"*{dt}", DELTA=f"*{dt}", A="*fp32", B=f"*{dt}", C=f"*{dt}", STATES="*fp32", DOUT=f"*{dt}",
                DU=f"*{dt}", DDELTA=f"*{dt}", DB="*fp32", DC="*fp32", DA_PART="*fp32", ADJ_CARRY="*fp32",
                dim=dim, length=length, n_chunks=length // chunk, per_group_b=dim, per_group_c=dim,
                su_b=dim * length, su_d=length, su_l=1, sdt_b=dim * length, sdt_d=length, sdt_l=1, sa_d=n, sa_n=1,
                sb_b=n * length, sb_g=n * length, sb_n=length, sb_l=1, sc_b=n * length, sc_g=n * length, sc_n=length, sc_l=1,
                so_b=dim * length, so_d=length, so_l=1, N_STATES=n, ACC=tl.float32, BLOCK_D=block_d,
                SEGS=chunk // items, ITEMS=items)
    ck = sc.compile_sm90(two_level_bwd_kernel, args, 1)
    d = tempfile.mkdtemp()
    sass, regs, stack = sc.sass_and_resources(ck, d)
    loop = sc.innermost_loop(sass)
    per = block_d * chunk / 32
    ops = Counter(sc.opcode(t) for _, t in loop)
    spill = ops['LDL'] + ops['STL']
    print(f"{dt} items {items} chunk {chunk} bd {block_d}: {len(loop)/per:.1f}/pair (loop {len(loop)}) regs {regs} stack {stack} spills-in-loop {spill} convs {ck.asm['ttgir'].count('convert_layout')}")
    print("    ", dict(ops.most_common(14)))
    return sass

if __name__ == "__main__":
    count("bf16", 8, 256, 2)
    count("bf16", 8, 256, 1)
    count("fp32", 4, 128, 2)
    count("fp32", 4, 256, 2)
