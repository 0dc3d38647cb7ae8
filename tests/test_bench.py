"""benchmarks/bench.py with tiny shapes and fake timers (on the CPU interpreter, or on a GPU): its correctness
checks pass on scan_lib, catch a wrong kernel, and the CSV, table and plots are written."""
import csv
import importlib.util
import math
from pathlib import Path

import pytest
import torch

import scan_lib

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.DEVICE = str(scan_lib.runtime.DEVICE)      # bench.py itself assumes a GPU
    module.ROOT = tmp_path
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    module.SIZES.update(cumsum=[6], linear_scan=(1, 2, 20), selective=(1, 2, 9, 2), block=(1, 5, 4), mamba2=(1, 5, 16, 8, 4),
                        block_check_length=3, ssd=[(1, 20, 3, 2, 4)], ssd_chunk=16,
                        conv=[((2, 3, 7), torch.float32)], conv_more=[], conv_check_channels=2, host_calls=2)
    monkeypatch.setattr(module, "time_both", lambda fn, graph=True: (fn(), (2.0, 1.0, 0.5))[1])
    if not torch.cuda.is_available():   # bench.py synchronises; step_split times with do_bench, which needs the real one
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setenv("SCAN_COURSE_FIGURES", str(tmp_path / "figures"))
    return module


def test_checks_pass_and_the_report_is_written(bench):
    for run in (bench.bench_cumsum, bench.bench_linear_scan, bench.bench_selective_scan, bench.bench_block, bench.bench_mamba2,
                bench.bench_ssd, bench.bench_conv, bench.bench_host):
        run(1e11, True)
    ours = [r for r in bench.ROWS if r["impl"].startswith("scan_lib") and not r["workload"].startswith("host")]
    assert {r["workload"] for r in ours} == {"cumsum", "linear_scan", "selective_scan", "selective_scan full",
                                             "selective_scan full, 2 groups", "block", "mamba2",
                                             "ssd", "causal_conv1d"}
    assert all(r["correct"] is True for r in ours), [r for r in ours if r["correct"] is not True]
    host = {(r["workload"], r["mode"]) for r in bench.ROWS if r["workload"].startswith("host") and r["impl"] == "scan_lib"
            and math.isfinite(r["call_us"]) and r["call_us"] > 0}
    spec = importlib.util.spec_from_file_location("host_time", ROOT / "benchmarks" / "host_time.py")
    host_time = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_time)
    ops = {f"host {name}" for name in host_time.empty_calls(False)}
    assert host == {(op, mode) for op in ops for mode in ("empty", "empty, grad")}, host   # every op, timed
    assert any(r.get("note", "").startswith("missing") for r in bench.ROWS)  # mamba_ssm has no CPU build
    bench.add_ratios()
    torch_row = next(r for r in bench.ROWS if r["impl"] == "torch.cumsum")
    assert torch_row["ratio_vs_scan_lib"] == 1.0 and math.isfinite(torch_row["pct_of_floor"])
    env = dict(gpu="CPU test", driver="-", torch=torch.__version__, triton="-", date="2026-01-01")
    path = bench.write_csv(env)
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(bench.ROWS) and rows[0]["gpu"] == "CPU test"
    bench.print_table()
    bench.plot(env)


def test_a_wrong_kernel_fails_its_check(bench, monkeypatch):
    right = scan_lib.selective_scan
    monkeypatch.setattr(scan_lib, "selective_scan", lambda *a, **k: right(*a, **k) * 1.1)   # 10%: beyond bf16's tolerance too
    bench.SIZES.update(selective=(1, 2, 5, 2))
    bench.bench_selective_scan(1e11, True)
    ours = [r for r in bench.ROWS if r["impl"] == "scan_lib.selective_scan"]
    assert ours and not any(r["correct"] for r in ours)
    assert all(math.isnan(r["gpu_us"]) for r in ours)   # a failed check is not timed


def test_sass_count_compiles_for_sm90_without_a_gpu(tmp_path):
    """benchmarks/sass_count.py (a fresh process: it compiles for the GPU target, not the interpreter) counts
    the loop over states of both kernels; the forward's loop holds its exp, one MUFU.EX2 per element."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_count.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = {line.split(":")[0].strip(): line for line in run.stdout.splitlines() if "per (position, state)" in line}
    assert set(lines) == {"fwd", "bwd"}, run.stdout
    assert "MUFU" in (tmp_path / "strided_fwd_kernel.sass").read_text()
    for kind, line in lines.items():
        per_pair = float(line.split(":")[1].split("instructions")[0])
        assert 3 < per_pair < 1000, line   # at least the arithmetic of a step; a count, not a runaway parse


def test_host_time_prints_a_row_per_op(capsys, monkeypatch):
    """benchmarks/host_time.py runs here (empty inputs never reach a kernel) and reports every op, timed
    or refusing its empty input."""
    spec = importlib.util.spec_from_file_location("host_time", ROOT / "benchmarks" / "host_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr("sys.argv", ["host_time.py", "--calls", "2"])
    module.main()
    printed = capsys.readouterr().out
    for name in module.empty_calls(False):
        row = [line for line in printed.splitlines() if line.startswith(name)]
        assert row and "raises" not in row[0], (name, printed)   # every op takes an empty input, as torch's do


def test_step_split_times_a_step_and_names_host_operations(bench, capsys, monkeypatch):
    """benchmarks/step_split.py (on the inputs bench.py builds) prints, per shape, the step, host and kernel
    times and the host's largest operations; here on the interpreter, at a tiny shape."""
    import sys
    monkeypatch.setitem(sys.modules, "bench", bench)
    spec = importlib.util.spec_from_file_location("step_split", ROOT / "benchmarks" / "step_split.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--dtype", "fp32", "--shapes", "1,2,9,2", "--rows", "3", "--calls", "1", "--samples", "2"])
    lines = capsys.readouterr().out.splitlines()
    shape_line = next(line for line in lines if line.startswith("(1, 2, 9, 2)") and "scan_lib" in line)
    assert all(word in shape_line for word in ("step", "host", "cpu", "kernels")), lines
    operations = lines[lines.index(shape_line) + 1:]
    assert len(operations) == 3 and all(line.strip().split()[1] == "us" for line in operations), lines
    module.SSD_CHUNK = 16
    module.main(["--workload", "ssd", "--dtype", "fp32", "--shapes", "1,20,2,4,4", "--rows", "2", "--calls", "1",
                 "--samples", "1"])
    lines = capsys.readouterr().out.splitlines()
    shape_line = next(line for line in lines if line.startswith("(1, 20, 2, 4, 4)") and "scan_lib" in line)
    assert all(word in shape_line for word in ("step", "host", "cpu", "kernels")), lines


@pytest.mark.parametrize("states", [[], ["--states", "table", "1"]])
def test_tune_fast_selective_scan_smoke(monkeypatch, states):
    """benchmarks/tune_fast_selective_scan.py's plumbing on tiny shapes: every candidate measured,
    a report per pass, and the launch configs as they were afterwards (its numbers are the GPU's); with
    --states, the forward's candidates with the table's states per step (unroll removed) and with one."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("tune_fast", ROOT / "benchmarks" / "tune_fast_selective_scan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = {kind: dict(config) for kind, config in module.active_config().items()}
    reports = module.main(["--smoke", "--budget", "600", *states])
    (report,) = reports.values()
    assert set(report) == {"fwd", "bwd"} and all(default is not None and best_us is not None
                                                 for default, _, best_us in report.values())
    assert module.active_config() == before


def test_a_wrong_ssd_fails_its_check(bench, monkeypatch):
    right = scan_lib.mamba_chunk_scan_combined
    monkeypatch.setattr(scan_lib, "mamba_chunk_scan_combined", lambda *a, **k: right(*a, **k) * 1.1)
    bench.SIZES.update(ssd=[(1, 20, 3, 2, 4)], ssd_chunk=16)
    bench.bench_ssd(1e11, True)
    ours = [r for r in bench.ROWS if r["impl"] == "scan_lib.mamba_chunk_scan_combined"]
    assert len(ours) == 4 and not any(r["correct"] for r in ours)


def test_a_wrong_conv_fails_its_check(bench, monkeypatch):
    right = scan_lib.causal_conv1d
    monkeypatch.setattr(scan_lib, "causal_conv1d", lambda *a, **k: right(*a, **k) * 1.1)
    bench.bench_conv(1e11, True)
    ours = [r for r in bench.ROWS if r["impl"] == "scan_lib.causal_conv1d"]
    assert len(ours) == 2 and not any(r["correct"] for r in ours)
    assert all(math.isnan(r["gpu_us"]) for r in ours)


def compile_in_fresh_process(script, tmp_path):
    """The stdout of `python -c script tmp_path` in a fresh process run in tmp_path, with Triton's compiler rather
    than its interpreter (TRITON_INTERPRET unset, as sass_count needs) and the repository and benchmarks/ on
    PYTHONPATH; the test fails with the process's stderr if it does."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_sass_lines_charges_every_instruction_to_a_kernel_line(tmp_path):
    """benchmarks/sass_lines.py (a fresh process, as sass_count) on chapter 10's grad kernel at a small size
    (chunk, P and N 16, no options): its rows' counts sum to the kernel's instruction count in cuobjdump's
    SASS, every row is a line of ssd_chunk_grad_kernel's source (helpers charged to the lines calling them),
    and the CLI prints its report."""
    import inspect
    import json
    import triton
    from scan_lib import ssd
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    missing = [tool for tool in ("nvdisasm", "cuobjdump") if not (tools / tool).exists()]
    if missing:
        pytest.skip(f"Triton's wheel has no {', '.join(missing)} in {tools}")
    script = (
        "import json, sys\n"
        "import sass_lines as s\n"
        "kernel, args = s.ssd_args('ssd-grad', 'bf16', 16, 16, 16, bare=True)\n"
        "compiled = s.compile_sm90(kernel, args, 4)\n"
        "sass, _, _ = s.sass_and_resources(compiled, sys.argv[1])\n"
        "rows = [(r.file, r.line, r.text, r.count, r.spills) for r in s.line_profile(compiled)]\n"
        "print(json.dumps(dict(total=len(s.INSTRUCTION.findall(sass)), rows=rows)))\n"
        "s.main(['ssd-grad', '--chunk', '16', '--head-dim', '16', '--n-states', '16', '--bare', '--top', '3'])\n")
    profile, report = compile_in_fresh_process(script, tmp_path).split("\n", 1)
    profile = json.loads(profile)
    assert sum(row[3] for row in profile["rows"]) == profile["total"] > 100
    source, first = inspect.getsourcelines(ssd.ssd_chunk_grad_kernel.fn)
    for file, line, text, _, _ in profile["rows"]:
        assert Path(file).name == "ssd.py" and first <= line < first + len(source), (file, line, text)
        assert text.startswith(source[line - first].split("#")[0].strip()), (text, source[line - first])
    assert "instructions" in report and "by opcode class:" in report and "HGMMA" in report, report


def test_probe_ssd_variants_finds_two_copies_of_one_version_equal(monkeypatch, capsys):
    """benchmarks/probe_ssd_variants.py with a tiny shape and fake timers: two copies of scan_lib/ssd.py run,
    and the second's results equal the first's (difference 0 in every row)."""
    import sys
    spec = importlib.util.spec_from_file_location("probe_ssd_variants", ROOT / "benchmarks" / "probe_ssd_variants.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    monkeypatch.setattr(sys.modules["bench"], "DEVICE", str(scan_lib.runtime.DEVICE))   # bench.py assumes a GPU
    monkeypatch.setitem(probe.SIZES, "ssd", [(1, 20, 2, 4, 4)])
    monkeypatch.setitem(probe.SIZES, "ssd_chunk", 16)
    monkeypatch.setattr(probe, "graph_us", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(probe, "do_bench", lambda fn, return_mode: (fn(), 2.0)[1])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "test")
    path = str(ROOT / "scan_lib" / "ssd.py")
    monkeypatch.setattr(sys, "argv", ["probe", f"a={path}", f"b={path}", "--quick"])
    probe.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith(("a ", "b "))]
    assert [row[0] for row in rows] == ["a", "b"] * 2, rows              # bf16 and float32
    assert all(float(row[4]) == 0.0 for row in rows), rows


def test_every_chunk_kernels_float32_products_follow_torchs_matmul_precision(tmp_path):
    """Chapter 10's chunk kernels compiled for sm_90 (a fresh process, as sass_lines), float32 at a small size:
    every tt.dot in their TTIR has input precision tf32x3 under torch's default "highest" and tf32 under "high"
    (the interpreter computes float32 either way, so only the compiled kernels show a DOT that does not reach
    tl.dot; Triton's tl.dot without input_precision is tf32). Every kernel of scan_lib.ssd but those without
    products (the state passing one, the gated norm's two) is one of sass_lines' SSD_KERNELS, so a new kernel
    is checked too."""
    import json
    script = (
        "import json, re, torch\n"
        "import sass_lines as s\n"
        "from scan_lib import ssd\n"
        "found = {'kernels': sorted(n for n in dir(ssd) if n.endswith('_kernel')), 'dots': {}}\n"
        "for setting in ('highest', 'high'):\n"
        "    torch.set_float32_matmul_precision(setting)\n"
        "    for which in s.SSD_KERNELS:\n"
        "        kernel, args = s.ssd_args(which, 'fp32', 16, 16, 16, bare=False)\n"
        "        ttir = s.compile_sm90(kernel, args, 4).asm['ttir']\n"
        "        dots = [line for line in ttir.splitlines() if 'tt.dot' in line]\n"
        "        found['dots'][f'{setting} {which}'] = [(re.findall(r'inputPrecision = (\\w+)', d) or [None])[0]\n"
        "                                            for d in dots]\n"
        "print(json.dumps(dict(found, names=sorted(s.SSD_KERNELS.values()))))\n")
    found = json.loads(compile_in_fresh_process(script, tmp_path).splitlines()[-1])
    no_products = ["ssd_state_passing_kernel", "rms_norm_gated_fwd_kernel", "rms_norm_gated_bwd_kernel"]
    assert found["kernels"] == sorted(found["names"] + no_products), found["kernels"]
    products = {"ssd-state": 1, "ssd-output": 3, "ssd-adjoint": 4, "ssd-grad": 5, "ssd-grad-bc": 5, "ssd-steps": 0,
                "ssd-walk": 4}
    assert len(found["dots"]) == 2 * len(products), found["dots"]
    for key, precisions in found["dots"].items():
        setting, which = key.split()
        assert precisions == [{"highest": "tf32x3", "high": "tf32"}[setting]] * products[which], (key, precisions)
