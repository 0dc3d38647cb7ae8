"""Where a Triton kernel's sm_90 instructions come from, without a GPU: per Python source line, the SASS
instructions of its H100/H200 compile, their opcodes and the spill instructions (STL, LDL) among them.
The static counterpart of Nsight Compute's SourceCounters section.

    python benchmarks/sass_lines.py ssd-grad|ssd-grad-bc|ssd-adjoint|ssd-output|ssd-state|ssd-steps|ssd-walk [--dtype bf16|fp32]
                                             [--n-states 64] [--head-dim 64] [--chunk 64] [--warps 4] [--top 25] [--by kernel|innermost] [--bare]
    python benchmarks/sass_lines.py scan-fwd|scan-bwd [--dtype bf16|fp32] [--bare] [--top 25] [--by kernel|innermost]
    python benchmarks/sass_lines.py conv-bwd [--dtype bf16|fp32] [--top 25] [--by kernel|innermost]

ssd-grad is chapter 10's `ssd_chunk_grad_kernel` as `_backward_kernels` launches it (ssd-grad-bc, ssd-adjoint,
ssd-output, ssd-state, ssd-steps: the grad kernel of dB and dC, the adjoint, output, chunk-state and steps kernels;
ssd-steps as the backward launches it, writing the softplus's slope too; ssd-walk: the forward's walk over the
chunks, blocks of at most 64 of P, no initial state) at (8, 2048, 32 heads x P, N, one group),
contiguous inputs, with D, z, dt_bias and dt_softplus as the training step of bench.py passes them (--bare: none of
them, as `ssd_backward` calls it); scan-fwd and scan-bwd are chapter 07's selective-scan kernels at sass_count's
base shape (8, 1024, 2048, N 16) with D, z, delta_bias and the softplus (--bare: without); conv-bwd is chapter 06's
`causal_conv1d_bwd_kernel` at (8, 2048, 2048), width 4, bias, SiLU, with the launch config `causal_conv1d_bwd`
takes on the GPU.

How a SASS instruction finds its line: Triton compiles with line info (PTX `.loc`, ptxas -lineinfo). The
cubin's own line table (`nvdisasm -g`) names only the innermost location, the line of an inlined @triton.jit
helper (or of triton/language/standard.py) rather than the kernel's line that called it; `-gi` adds nothing
here, because Triton 3.6's `.loc` directives carry no `inlined_at` (the chain is only in their comment,
`ssd.py:132:23 @[ ssd.py:148:63 @[ ssd.py:509:71 ] ]`). So: `nvdisasm -gp` maps each instruction to its PTX
line (the .nv_debug_line_sass table), and the `.loc` before that line gives the whole chain. `.loc` with line
0 (code LLVM gives no line) are skipped: their instructions stay with the line before, and the few
instructions before the first `.loc` go to it (the kernel's `def` line). On both kernels here this
attribution agrees with ptxas's own table (-g) on the innermost line for all but 0.1-0.3 % of the
instructions.

What the counts are: static counts, each instruction of the kernel's text once (its trailing padding
included), charged to the kernel's own source line (--by kernel: a helper's instructions go to the line that
calls it) or to the innermost line (--by innermost). For a kernel without loops (both here: their
tl.static_range loops are unrolled) that is the instructions one thread executes, counted per warp issue,
give or take the branches not taken; in a kernel with a loop, the loop's body is counted once. They are not
time: no stalls, latencies, occupancy or memory traffic (Nsight Compute on a GPU measures those), and one
HGMMA is a warpgroup's 64 x N x K product (K 16 in bf16, 8 in TF32), not one FMA.
"""
import argparse
import ast
import functools
import linecache
import re
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]   # rows name files relative to it
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]   # sass_count, scan_lib
from sass_count import INSTRUCTION, TOOLS, compile_sm90, kernel_args, opcode, sass_and_resources  # noqa: E402  (TRITON_INTERPRET=0)
from sass_count import fast                  # noqa: E402  (chapter 07's kernels, scan_lib.fast_selective_scan)
import triton                                # noqa: E402
import torch                                 # noqa: E402

import scan_lib.causal_conv1d                # noqa: E402
from scan_lib import ssd                     # noqa: E402

conv = sys.modules["scan_lib.causal_conv1d"]   # the module (scan_lib.causal_conv1d is also a function)

LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+\d+\s*(?://\s*(.*))?$")
FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')
PTX_LINE = re.compile(r'^\s*//## File "[^"]*", line (\d+)')
FRAME = re.compile(r"([^\s@\[\]:]+):(\d+):\d+")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SPILL = re.compile(r"\b(STL|LDL)(\.[\w.]+)?\s")
CLASSES = (   # (class, opcodes): the totals printed per class; an opcode in none of them counts as "other"
    ("tensor core (HGMMA, HMMA, WARPGROUP)", {"HGMMA", "HMMA", "IMMA", "WARPGROUP"}),
    ("fp32 FFMA/FMUL/FADD", {"FFMA", "FMUL", "FADD"}),
    ("fp32 compare/select (FSETP, FSEL, FMNMX)", {"FSETP", "FSEL", "FMNMX", "FCHK"}),
    ("MUFU (exp2, log2, rcp)", {"MUFU"}),
    ("SHFL", {"SHFL"}),
    ("shared LDS/STS/LDSM/STSM", {"LDS", "STS", "LDSM", "STSM"}),
    ("global LDG/STG/LDGSTS", {"LDG", "STG", "LDGSTS", "LDGDEPBAR"}),
    ("RED/ATOM", {"RED", "ATOM", "ATOMS", "ATOMG", "REDG"}),
    ("spills STL/LDL", {"STL", "LDL"}),
    ("barriers BAR/DEPBAR/WARPSYNC", {"BAR", "DEPBAR", "WARPSYNC", "MEMBAR", "SYNCS", "FENCE"}),
    ("conversion F2F/F2FP/I2F/F2I", {"F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "FRND"}),
    ("integer/address IMAD/IADD3/LEA/ISETP/LOP3/SHF", {"IMAD", "IADD3", "IADD", "LEA", "ISETP", "LOP3", "SHF",
                                                        "SGXT", "IABS", "IMNMX", "POPC", "FLO", "BMSK", "BREV",
                                                        "VIADD", "IMUL"}),
    ("moves/predicates MOV/PRMT/SEL/LDC/S2R", {"MOV", "PRMT", "SEL", "LDC", "S2R", "CS2R", "P2R", "R2P", "PLOP3",
                                              "VOTE", "R2UR", "HFMA2"}),   # HFMA2.MMA R, -RZ, RZ, c: a constant
    ("uniform datapath U*/S2UR", set()),   # by prefix: opcode_class
    ("control BRA/EXIT/BSSY/BSYNC/NOP", {"BRA", "EXIT", "BSSY", "BSYNC", "NOP", "CALL", "RET", "BREAK"}),
)


class Row(NamedTuple):
    """One source line's share of a kernel: its file and line, the line's text (line_text), the SASS
    instructions charged to it, how many of them are spills (STL, LDL), and its opcodes (a Counter:
    .most_common() gives the top ones)."""
    file: str
    line: int
    text: str
    count: int
    spills: int
    opcodes: Counter


def opcode_class(name):
    """The class of CLASSES an opcode (as sass_count.opcode gives it) belongs to."""
    for label, members in CLASSES:
        if name in members:
            return label
    if name.startswith("U") or name == "S2UR":
        return "uniform datapath U*/S2UR"
    return "other"


def frame_chain(loc, files):
    """The frames of a PTX `.loc` match, innermost first, as (file, line): the innermost from its file
    index, the callers from its comment's `@[ file:line:col ]` chain (file names there are basenames,
    resolved through the `.file` table)."""
    index, line, comment = loc
    by_name = {Path(path).name: path for path in files.values()}
    callers = FRAME.findall(comment or "")[1:]
    return [(files[int(index)], int(line))] + [(by_name.get(name, name), int(n)) for name, n in callers]


def ptx_chains(ptx):
    """For each line of the PTX (index 0 is line 1), the frame chain of the `.loc` in force there (None
    before the first). `.loc` with line 0 are skipped: the location before them stays in force."""
    files = {int(m.group(1)): m.group(2) for m in map(FILE.match, ptx.splitlines()) if m}
    chains, current = [], None
    for text in ptx.splitlines():
        loc = LOC.match(text)
        if loc and loc.group(2) != "0":
            current = frame_chain(loc.groups(), files)
        chains.append(current)
    return chains


def sass_with_ptx_lines(cubin, name):
    """The instructions of kernel `name` in the cubin file, in order, as (text, PTX line) pairs
    (`nvdisasm -gp`)."""
    listing = subprocess.run([TOOLS / "nvdisasm", "-gp", cubin], capture_output=True, text=True, check=True).stdout
    start = listing.index(f".text.{name}:")
    end = listing.find("//------", start)
    pairs, ptx_line = [], None
    for text in listing[start:end if end >= 0 else None].splitlines():
        line = PTX_LINE.match(text)
        if line:
            ptx_line = int(line.group(1))
        for _, instruction in INSTRUCTION.findall(text):
            pairs.append((instruction, ptx_line))
    return pairs


def instruction_frames(compiled):
    """Each SASS instruction of the compiled kernel as (text, frame chain innermost first); instructions
    before the first line get the kernel's first `.loc` (its `def` line)."""
    chains = ptx_chains(compiled.asm["ptx"])
    first = next(chain for chain in chains if chain)
    with tempfile.TemporaryDirectory() as scratch:
        cubin = Path(scratch) / f"{compiled.name}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        pairs = sass_with_ptx_lines(cubin, compiled.name)
    return [(text, chains[line - 1] if line and chains[line - 1] else first) for text, line in pairs]


def statement_start(path, line):
    """The first line of the innermost Python statement holding `line` of the file (line itself when
    the file cannot be parsed or no statement holds it)."""
    try:
        tree = _parsed(path)
    except (OSError, SyntaxError, ValueError):
        return line
    starts = [node.lineno for node in ast.walk(tree)
              if isinstance(node, ast.stmt) and node.lineno <= line <= node.end_lineno]
    return max(starts, default=line)


@functools.lru_cache(maxsize=None)
def _parsed(path):
    return ast.parse(Path(path).read_text())


def line_text(path, line):
    """The source line, its alignment before a comment squeezed; a line that continues a statement says
    where the statement starts."""
    text = re.sub(r"\s{2,}#", "  #", linecache.getline(path, line).strip())
    start = statement_start(path, line)
    return text if start == line else f"{text}  (in line {start}'s statement)"


def line_profile(compiled, by="kernel"):
    """Rows (Row), most instructions first, of a kernel compiled for sm_90 (sass_count.compile_sm90): every
    SASS instruction charged to one source line, the kernel's own (by="kernel": the outermost frame) or the
    innermost (by="innermost": a helper's or triton.language's line). The counts sum to the kernel's."""
    opcodes, spills = defaultdict(Counter), Counter()
    for text, chain in instruction_frames(compiled):
        key = chain[-1] if by == "kernel" else chain[0]
        opcodes[key][opcode(text)] += 1
        spills[key] += bool(SPILL.search(text))
    rows = [Row(path, line, line_text(path, line), sum(ops.values()), spills[path, line], ops)
            for (path, line), ops in opcodes.items()]
    return sorted(rows, key=lambda row: -row.count)


def spill_bytes(sass):
    """(bytes of spill stores, bytes of spill loads) in the SASS: the sizes of its STL and LDL, as ptxas -v
    reports them."""
    sizes = {".128": 16, ".64": 8, ".U16": 2, ".S16": 2, ".U8": 1, ".S8": 1}
    totals = Counter()
    for _, text in INSTRUCTION.findall(sass):
        spill = SPILL.search(text)
        if spill:
            suffixes = spill.group(2) or ""
            totals[spill.group(1)] += next((size for key, size in sizes.items() if key in suffixes), 4)
    return totals["STL"], totals["LDL"]


SSD_KERNELS = {"ssd-grad": "ssd_chunk_grad_kernel", "ssd-grad-bc": "ssd_chunk_grad_bc_kernel",
               "ssd-adjoint": "ssd_chunk_adjoint_kernel",
               "ssd-output": "ssd_chunk_output_kernel", "ssd-state": "ssd_chunk_state_kernel",
               "ssd-steps": "ssd_chunk_steps_kernel", "ssd-walk": "ssd_chunk_walk_kernel"}


def ssd_args(which, dtype, n_states, head_dim, chunk, bare, batch=8, length=2048, heads=32, groups=1):
    """One of chapter 10's chunk kernels (SSD_KERNELS) and its arguments as the launchers pass them for
    contiguous (batch, length, heads, head_dim) inputs of `dtype` ('bf16', 'fp32'), A, D, dt_bias float32,
    with D, z, dt_bias and dt_softplus (bench.py's training step) unless bare."""
    kernel = getattr(ssd, SSD_KERNELS[which]).kernel   # the @triton.jit kernel inside its RememberedLaunches
    tiles = ssd._tiles(chunk, head_dim, n_states)
    if which == "ssd-walk":   # its programs hold at most WALK_BLOCK_P rows of P
        tiles["BLOCK_P"] = min(ssd.WALK_BLOCK_P, tiles["BLOCK_P"])
    n_chunks = triton.cdiv(length, tiles["CHUNK"])
    x, f32 = f"*{dtype}", "*fp32"
    optional = (lambda kind: None) if bare else (lambda kind: kind)
    every = dict(
        X=x, DT=x, DT_BIAS=optional(f32), A=f32, B=x, C=x, D=optional(f32), Z=optional(x), DY=x, ENTERING=f32,
        LOCAL=f32, Y=x, DYBAR=optional(x), DSTATE=f32, DX=x, DDT=x, DB=f32, DC=f32, DZ=optional(x), DA_PART=f32,
        DD_PART=f32, DBIAS_PART=optional(f32), STATES=f32, DECAY=f32, STEPS=f32, A_CUM=f32, SLOPE=optional(f32),
        START=None, FINAL=f32,
        length=length, heads=heads, groups=groups, head_dim=head_dim, n_states=n_states, n_chunks=n_chunks,
        HAS_D=not bare, HAS_Z=not bare, HAS_DT_BIAS=not bare, DT_SOFTPLUS=not bare,
        BLOCK_H=32, **tiles)   # BLOCK_H: as _scan_chunks launches the steps kernel
    return kernel, {name: every[name] for name in kernel.arg_names}


def scan_args(kind, dtype, bare, batch=8, dim=1024, length=2048):
    """Chapter 07's selective-scan kernel `kind` ('fwd', 'bwd') with sass_count's arguments at its base shape
    (batch, dim, L, N 16), block layout, GPU_CONFIG, plus D, z, delta_bias and the softplus (the Mamba
    block's call) unless bare; and its warps."""
    kernel, args = kernel_args(kind, dtype, batch, dim, length)
    if not bare:
        args.update(D="*fp32", Z=f"*{dtype}", BIAS="*fp32", HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True,
                    sz_b=dim * length, sz_d=length, sz_l=1)
        if kind == "bwd":
            args.update(DZ=f"*{dtype}", DD="*fp32", DBIAS="*fp32")
    return kernel, args, fast.GPU_CONFIG[kind]["num_warps"]


def conv_bwd_args(dtype, batch=8, dim=2048, length=2048, width=4):
    """causal_conv1d_bwd_kernel's arguments and warps as causal_conv1d_bwd launches it on the GPU (its
    _launch_config with the interpreter off) for contiguous x and dout of `dtype`, weight and bias of x's
    dtype, SiLU, no initial states, dfinal or seq_idx."""
    x = torch.empty(0, dtype=DTYPES[dtype])
    with mock.patch.object(conv, "INTERPRET", False):
        config = conv._launch_config(dim, length, backward_element_size=x.element_size())
    pointer = f"*{dtype}"
    strides = dict(stride_xb=dim * length, stride_xd=length, stride_xl=1, stride_wd=width, stride_wk=1, stride_bias=1,
                   stride_hb=0, stride_hd=0, stride_hl=0, stride_gb=dim * length, stride_gd=length, stride_gl=1,
                   stride_fb=0, stride_fd=0, stride_fl=0, stride_sb=0, stride_sl=0,
                   stride_dxb=dim * length, stride_dxd=length, stride_dxl=1)
    return conv.causal_conv1d_bwd_kernel, dict(
        X=pointer, WEIGHT=pointer, BIAS=pointer, H0=None, DOUT=pointer, DFINAL=None, SEQ=None, DX=pointer,
        DW_PART="*fp32", DBIAS_PART="*fp32", DH0=pointer, dim=dim, length=length,
        n_blocks_l=triton.cdiv(length, config["block_l"]), **strides, WIDTH=width, HAS_BIAS=True, HAS_H0=False,
        HAS_DFINAL=False, SILU=True, HAS_SEQ_IDX=False, ACC=conv.accumulator_dtype(conv._acc_dtype(x, x)),
        BLOCK_D=config["block_d"], BLOCK_L=config["block_l"], ITEMS=conv._items(x)), config["num_warps"]


def where(row):
    """file:line of a row, the file relative to the repository (or to site-packages)."""
    path = Path(row.file)
    if "site-packages" in path.parts:
        path = Path(*path.parts[path.parts.index("site-packages") + 1:])
    elif path.is_relative_to(ROOT):
        path = path.relative_to(ROOT)
    return f"{path}:{row.line}"


def print_profile(rows, top):
    """The `top` lines by instructions, each with its share, spills, text and opcode mix."""
    total = sum(row.count for row in rows)
    print(f"top {min(top, len(rows))} of {len(rows)} source lines by instructions:")
    for row in rows[:top]:
        spills = f"{row.spills:4d} spill" if row.spills else " " * 9
        print(f"{row.count:6d} {100 * row.count / total:5.1f}% {spills}  {where(row):32s} {row.text[:90]}")
        print(" " * 24 + ", ".join(f"{name} {n}" for name, n in row.opcodes.most_common(8)))


def print_classes(rows):
    """Totals per opcode class (CLASSES), largest first, with the class's opcodes."""
    by_class, members = Counter(), defaultdict(Counter)
    for row in rows:
        for name, n in row.opcodes.items():
            by_class[opcode_class(name)] += n
            members[opcode_class(name)][name] += n
    total = sum(by_class.values())
    print("by opcode class:")
    for label, n in by_class.most_common():
        print(f"{n:6d} {100 * n / total:5.1f}%  {label:48s} "
              + ", ".join(f"{name} {k}" for name, k in members[label].most_common(6)))


def report(kernel, args, num_warps, top, by):
    """Compile for sm_90, then print resources, totals, the top lines and the opcode classes."""
    compiled = compile_sm90(kernel, args, num_warps)
    with tempfile.TemporaryDirectory() as scratch:
        sass, registers, stack = sass_and_resources(compiled, scratch)
    rows = line_profile(compiled, by)
    total = len(INSTRUCTION.findall(sass))
    if sum(row.count for row in rows) != total:
        raise RuntimeError(f"nvdisasm's listing has {sum(row.count for row in rows)} instructions, cuobjdump's {total}")
    stores, loads = spill_bytes(sass)
    spills = sum(row.spills for row in rows)
    print(f"{compiled.name}, sm_90, {num_warps} warps: {registers} registers, {stack} bytes of stack, "
          f"{compiled.metadata.shared} bytes of shared memory")
    print(f"{total} instructions, {spills} of them spills ({stores} bytes stored, {loads} loaded)")
    print_profile(rows, top)
    print_classes(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", choices=[*SSD_KERNELS, "scan-fwd", "scan-bwd", "conv-bwd"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--n-states", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64, help="chunk_size (the kernel runs min(chunk, 64))")
    parser.add_argument("--warps", type=int, default=4, help="the ssd kernels' num_warps (their launch: Triton's 4)")
    parser.add_argument("--bare", action="store_true", help="the ssd and scan kernels without their options (D, z, the "
                        "step's bias and softplus)")
    parser.add_argument("--matmul-precision", default="highest", choices=["highest", "high"],
                        help="torch.set_float32_matmul_precision for the ssd kernels' float32 products (high: TF32)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--by", default="kernel", choices=["kernel", "innermost"],
                        help="charge a helper's instructions to the kernel's line calling it, or to its own line")
    options = parser.parse_args(argv)
    if options.kernel in SSD_KERNELS:
        torch.set_float32_matmul_precision(options.matmul_precision)
        kernel, args = ssd_args(options.kernel, options.dtype, options.n_states, options.head_dim, options.chunk,
                                options.bare)
        num_warps = options.warps
        print(f"{SSD_KERNELS[options.kernel]} at (8, 2048, 32 x {options.head_dim}, N {options.n_states}), chunk "
              f"{args['CHUNK']}, {options.dtype}, {'bare' if options.bare else 'D, z, dt_bias, dt_softplus'}"
              + (f", float32 products {args['DOT']}" if options.dtype == "fp32" and "DOT" in args else ""))
    elif options.kernel.startswith("scan-"):
        kind = options.kernel.removeprefix("scan-")
        kernel, args, num_warps = scan_args(kind, options.dtype, options.bare)
        print(f"{kernel.fn.__name__} at (8, 1024, 2048, N 16), block layout, GPU_CONFIG {fast.GPU_CONFIG[kind]}, "
              f"{options.dtype}, {'bare' if options.bare else 'D, z, delta_bias, softplus'} (loops counted once)")
    else:
        kernel, args, num_warps = conv_bwd_args(options.dtype)
        print(f"causal_conv1d_bwd_kernel at (8, 2048, 2048), width 4, bias, SiLU, {options.dtype}, block "
              f"{args['BLOCK_D']} x {args['BLOCK_L']}, ITEMS {args['ITEMS']}")
    report(kernel, args, num_warps, options.top, options.by)


if __name__ == "__main__":
    main()
