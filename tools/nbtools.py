"""Notebook tooling: export `#| export` cells into scan_lib, keep .py/.ipynb pairs in sync, check both.

The jupytext percent files `notebooks/NN_name.py` are the sources people edit. From them:

    python tools/nbtools.py export   # write scan_lib/<module>.py from the `#| export` cells
    python tools/nbtools.py sync     # write each paired .ipynb's inputs from its .py (outputs kept)
    python tools/nbtools.py check    # fail if either of the above would change a file, if a
                                     # notebook's setup cell or Colab link is not the standard one, if
                                     # its committed outputs are not from its current code, or if
                                     # exercises/ is stale (tools/exercises.py)
    python tools/nbtools.py execute NB...   # run notebooks in place and record their fingerprint
    python tools/nbtools.py main-line [NB.py...]   # each chapter's main line: words, code, a reading time

Export markers follow nbdev: a cell starting with `#| default_exp name` sets the notebook's module
(`scan_lib/name.py`); a cell starting with `#| export` is copied there, in notebook order.
`#| export other` sends one cell to `scan_lib/other.py` instead.

Fingerprints: `execute` runs a notebook top to bottom in a fresh kernel and records in its metadata
(`scan_course.fingerprint`) a hash of its code cells, a hash of the scan_lib modules it depends on
(those it imports, followed through their own scan_lib imports; one hash per module), and the device
it ran on. `check` recomputes the hashes and fails when one differs, or when a code cell has no execution
count or the counts are not 1, 2, 3, ... in order: the outputs would not be one run of today's code.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import re
import sys
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
PACKAGE = ROOT / "scan_lib"

# The one place the public repository is named: Colab links and setup cells are checked against it.
REPOSITORY = "scan-course/scans-the-hard-way"
COLAB_URL = "https://colab.research.google.com/github/{repo}/blob/main/notebooks/{name}.ipynb"

SETUP_CELL = f"""\
# Setup, the same in every chapter. On Colab, install scan_lib (Colab already has torch and triton).
# Importing scan_lib comes first: without a GPU it switches Triton to its CPU interpreter,
# which must happen before any @triton.jit function is defined.
import subprocess, sys
if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "git+https://github.com/{REPOSITORY}"], check=True)
import scan_lib
from scan_lib.runtime import DEVICE, ON_GPU
print(scan_lib.runtime.describe())"""


def chapter_sources() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def colab_link(name: str) -> str:
    return COLAB_URL.format(repo=REPOSITORY, name=name)


def _directive(cell_source: str) -> tuple[str, str] | None:
    """`#| export foo` -> ("export", "foo"); None when the cell has no directive on its first line."""
    first = cell_source.lstrip().split("\n", 1)[0].strip()
    if not first.startswith("#|"):
        return None
    words = first[2:].split()
    return (words[0], words[1] if len(words) > 1 else "") if words else None


# Solution markers (nbgrader's): around the lines a student writes in the exercise notebooks
# (tools/exercises.py). Each on a line of its own in a code cell; an optional `### HINT: ...` line
# right after BEGIN SOLUTION gives the stub's hint. The library export and the output fingerprint
# ignore these lines and nothing else, so adding markers changes neither scan_lib nor a chapter's code.
BEGIN_SOLUTION = "### BEGIN SOLUTION"
END_SOLUTION = "### END SOLUTION"
HINT = "### HINT:"


def marker_lines(source: str) -> set[int]:
    """Indices of the lines of `source` that are solution markers: `### BEGIN SOLUTION`,
    `### END SOLUTION`, and a `### HINT: ...` line directly after a BEGIN SOLUTION."""
    lines = source.split("\n")
    found = set()
    for i, line in enumerate(lines):
        if line.strip() in (BEGIN_SOLUTION, END_SOLUTION):
            found.add(i)
            if line.strip() == BEGIN_SOLUTION and i + 1 < len(lines) and lines[i + 1].strip().startswith(HINT):
                found.add(i + 1)
    return found


def strip_solution_markers(source: str) -> str:
    """`source` without its solution marker lines (the solutions stay)."""
    markers = marker_lines(source)
    return "\n".join(line for i, line in enumerate(source.split("\n")) if i not in markers)


def _strip_first_line(source: str) -> str:
    return source.lstrip().split("\n", 1)[1] if "\n" in source.lstrip() else ""


def exported_modules() -> dict[Path, str]:
    """Every generated module's path and the text it should hold."""
    chunks: dict[str, list[str]] = {}
    origin: dict[str, set[str]] = {}
    for source in chapter_sources():
        notebook = jupytext.read(source)
        default = None
        for cell in notebook.cells:
            if cell.cell_type != "code":
                continue
            directive = _directive(cell.source)
            if directive is None:
                continue
            kind, arg = directive
            if kind not in ("default_exp", "export"):
                sys.exit(f"{source.name}: unknown directive `#| {kind}` (expected `#| default_exp name` or `#| export`)")
            if arg and not arg.isidentifier():
                sys.exit(f"{source.name}: `#| {kind} {arg}`: the module name must be a Python identifier")
            if kind == "default_exp":
                if not arg:
                    sys.exit(f"{source.name}: `#| default_exp` needs a module name")
                default = arg
            else:
                module = arg or default
                if not module:
                    sys.exit(f"{source.name}: an `#| export` cell comes before any `#| default_exp`")
                chunks.setdefault(module, []).append(_strip_first_line(strip_solution_markers(cell.source)).strip("\n"))
                origin.setdefault(module, set()).add(f"notebooks/{source.name}")
    modules = {}
    for module, parts in chunks.items():
        header = (
            f"# AUTOGENERATED from {', '.join(sorted(origin[module]))} by `make export`.\n"
            "# Do not edit: change the notebook and run `make export`.\n"
        )
        modules[PACKAGE / f"{module}.py"] = header + "\n\n".join(parts) + "\n"
    return modules


def generated_files() -> list[Path]:
    return [p for p in PACKAGE.glob("*.py") if p.read_text().startswith("# AUTOGENERATED from ")]


def paired_notebook(source: Path) -> nbformat.NotebookNode:
    """The .ipynb as it should be: inputs from the .py, outputs kept from the existing .ipynb."""
    notebook = jupytext.read(source)
    target = source.with_suffix(".ipynb")
    if target.exists():
        notebook = jupytext.combine.combine_inputs_with_outputs(notebook, jupytext.read(target), fmt="py:percent")
    return notebook


def _sha(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def code_hash(notebook) -> str:
    """Hash of the notebook's code cells, in order (whitespace at either end of a cell and solution
    marker lines ignored)."""
    return _sha([strip_solution_markers(c.source).strip() for c in notebook.cells if c.cell_type == "code"])


# `from scan_lib.name import ...` (name: a module), `scan_lib.name` (a module or a public name),
# `from scan_lib import names`
_SCAN_LIB_NAME = re.compile(r"from scan_lib\.(\w+)(?:\.\w+)* import|\bscan_lib\.([A-Za-z_]\w*)"
                            r"|from scan_lib import ([\w, ()\n]+)")


def _public_names() -> dict[str, set[str]]:
    """The scan_lib module each public name comes from, by scan_lib/__init__.py's `from .module import
    names` lines: `scan_lib.Mamba` runs mamba.py, and `scan_lib.selective_scan` fast_selective_scan.py."""
    sources: dict[str, set[str]] = {}
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                sources.setdefault(alias.asname or alias.name, set()).add(node.module)
    return sources


def _scan_lib_modules_named(code: str) -> set[str]:
    """Modules of scan_lib that `code` refers to: `from scan_lib.name import` (the module name),
    `scan_lib.name` and `from scan_lib import name`, where name is a module or a public name (then the
    module that defines it; a name that is both, like selective_scan, counts as both)."""
    public = _public_names()
    found = set()
    for module, dotted, imported in _SCAN_LIB_NAME.findall(code):
        if module:
            found |= {module} if (PACKAGE / f"{module}.py").exists() else set()
            continue
        for name in [dotted] if dotted else re.findall(r"\w+", imported):
            found |= public.get(name, set()) | ({name} if (PACKAGE / f"{name}.py").exists() else set())
    return found


def scan_lib_dependencies(notebook) -> list[str]:
    """The scan_lib modules a notebook runs with: the runtime (the setup cell), those its code names,
    and, transitively, those they import."""
    todo = {"runtime"} | _scan_lib_modules_named("\n".join(c.source for c in notebook.cells if c.cell_type == "code"))
    done: set[str] = set()
    while todo:
        module = todo.pop()
        done.add(module)
        todo |= _scan_lib_modules_named((PACKAGE / f"{module}.py").read_text()) - done
    return sorted(done)


def scan_lib_hashes(modules: list[str]) -> dict[str, str]:
    """One hash per module: `check` then names the modules that changed."""
    return {m: _sha([f"{m}\n{(PACKAGE / f'{m}.py').read_text()}"]) for m in modules}


def fingerprint(notebook, device: str) -> dict:
    modules = scan_lib_dependencies(notebook)
    return {"code": code_hash(notebook), "scan_lib_hashes": scan_lib_hashes(modules), "device": device}


def changed_modules(notebook, stamp: dict) -> list[str]:
    """The scan_lib modules the notebook runs with that changed since its stamp was recorded: those of
    today's dependencies whose hash differs from the stamp's, or that the stamp lacks."""
    recorded = stamp.get("scan_lib_hashes", {})
    return [m for m, h in scan_lib_hashes(scan_lib_dependencies(notebook)).items() if recorded.get(m) != h]


def device_name() -> str:
    """The device the kernels ran on, as the setup cell's scan_lib.runtime saw it."""
    import torch
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return f"CPU, Triton interpreter (torch {torch.__version__})"


SLOW_CELL_S = 5  # execute prints each cell that takes this long, as it finishes: a run cut off still says where it was


def _print_if_slow(cell, cell_index, execute_reply):
    """nbclient's on_cell_executed hook: the cell's time from the timestamps nbclient records in its metadata."""
    from datetime import datetime
    timing = cell.metadata.get("execution", {})
    if "iopub.execute_input" not in timing or "shell.execute_reply" not in timing:
        return
    seconds = (datetime.fromisoformat(timing["shell.execute_reply"])
               - datetime.fromisoformat(timing["iopub.execute_input"])).total_seconds()
    if seconds >= SLOW_CELL_S:
        first_line = next((line for line in cell.source.splitlines() if line.strip()), "")
        print(f"   cell {cell_index} ran {seconds:.1f} s: {first_line[:70]}", flush=True)


def execute(paths: list[Path], timeout: int = 3600) -> list[Path]:
    """Run each notebook in place in a fresh kernel (from notebooks/, as Jupyter would), then record
    its fingerprint, computed before the run from the code that runs. A notebook whose run fails is
    left as it was, and the others still run. Returns the notebooks that failed."""
    import time
    from nbclient.exceptions import CellExecutionError
    from nbconvert.preprocessors import ExecutePreprocessor
    failed = []
    for path in paths:
        notebook = nbformat.read(path, as_version=4)
        stamp = fingerprint(notebook, device_name())
        print(f"== {path}", flush=True)
        start = time.time()
        try:
            ExecutePreprocessor(timeout=timeout, kernel_name="python3", on_cell_executed=_print_if_slow).preprocess(
                notebook, {"metadata": {"path": str(path.parent)}})
        except CellExecutionError as error:
            print(f"FAILED {path} (left unchanged):\n{error}", flush=True)
            failed.append(path)
            continue
        notebook.metadata["scan_course"] = {"fingerprint": stamp}
        nbformat.write(notebook, path)
        print(f"   ran in {time.time() - start:.0f} s", flush=True)
    return failed


def _check_outputs(ipynb: Path) -> list[str]:
    """The committed outputs are one top-to-bottom run of the current code (see the module docstring)."""
    notebook = nbformat.read(ipynb, as_version=4)
    name = ipynb.relative_to(ROOT) if ipynb.is_relative_to(ROOT) else ipynb
    redo = "re-record it on a GPU: `make outputs PY=python3 NB=" + str(name) + "`"
    stamp = notebook.metadata.get("scan_course", {}).get("fingerprint")
    if stamp is None:
        return [f"{name} has no output fingerprint: {redo}"]
    problems = []
    if stamp.get("code") != code_hash(notebook):
        problems.append(f"{name}: its code changed after its outputs were recorded ({stamp.get('device')}): {redo}")
    changed = changed_modules(notebook, stamp)
    if changed:
        problems.append(f"{name}: scan_lib ({', '.join(changed)}) changed after its outputs were recorded: {redo}")
    counts = [c.get("execution_count") for c in notebook.cells if c.cell_type == "code"]
    if counts != list(range(1, len(counts) + 1)):
        problems.append(f"{name}: code cells were not run once each, in order (execution counts {counts}): {redo}")
    return problems


def _inputs(notebook) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in notebook.cells]


def export() -> None:
    wanted = exported_modules()
    for stale in set(generated_files()) - set(wanted):
        stale.unlink()
        print(f"removed {stale.relative_to(ROOT)}")
    for path, text in wanted.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")


def sync() -> None:
    for source in chapter_sources():
        target = source.with_suffix(".ipynb")
        notebook = paired_notebook(source)
        if not target.exists() or _inputs(jupytext.read(target)) != _inputs(notebook):
            jupytext.write(notebook, target)
            print(f"wrote {target.relative_to(ROOT)}")


def check(outputs: bool = True) -> list[str]:
    """Every problem `make check` reports; outputs=False leaves out the fingerprints (before `execute`)."""
    problems = []
    wanted = exported_modules()
    for path, text in wanted.items():
        if not path.exists() or path.read_text() != text:
            problems.append(f"{path.relative_to(ROOT)} is stale: run `make export`")
    for stale in set(generated_files()) - set(wanted):
        problems.append(f"{stale.relative_to(ROOT)} is generated by no notebook: run `make export`")
    sources = chapter_sources()
    for ipynb in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        if not ipynb.with_suffix(".py").exists():
            problems.append(f"{ipynb.relative_to(ROOT)} has no paired .py")
    for source in sources:
        target = source.with_suffix(".ipynb")
        notebook = jupytext.read(source)
        if not target.exists():
            problems.append(f"{target.relative_to(ROOT)} is missing: run `make sync`")
        elif _inputs(jupytext.read(target)) != _inputs(notebook):
            problems.append(f"{target.relative_to(ROOT)} differs from {source.name}: run `make sync`")
        problems += _check_front_matter(source.stem, notebook)
        if outputs and target.exists():
            problems += _check_outputs(target)
        if colab_link(source.stem) not in (ROOT / "README.md").read_text():
            problems.append(f"README.md does not link to {colab_link(source.stem)}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import exercises  # tools/exercises.py: the student notebooks must match the chapters' markers
    problems += exercises.check()
    return problems


def _check_front_matter(name: str, notebook) -> list[str]:
    """The first markdown cell links to Colab; the first code cell is the standard setup cell."""
    first_md = next((c for c in notebook.cells if c.cell_type == "markdown"), None)
    first_code = next((c for c in notebook.cells if c.cell_type == "code"), None)
    problems = []
    if first_md is None or colab_link(name) not in first_md.source:
        problems.append(f"notebooks/{name}.py: the first markdown cell must link to {colab_link(name)}")
    if first_code is None or first_code.source.strip() != SETUP_CELL:
        problems.append(f"notebooks/{name}.py: the first code cell must be the setup cell in tools/nbtools.py")
    return problems


# Reading speeds of the main-line estimate: a rough model for comparing chapters and edits, not a reader
PROSE_WORDS_PER_MINUTE, CODE_LINES_PER_MINUTE, KERNEL_LINES_PER_MINUTE = 130, 12, 6


def main_line(notebook) -> dict[str, int]:
    """The size of a chapter's main line, everything before its first `## Going deeper` heading: words
    of prose, non-blank lines of ordinary code, and non-blank lines of `@triton.jit` functions."""
    size = {"words": 0, "code": 0, "kernel": 0}
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            heading = re.search(r"^## Going deeper", cell.source, re.M)
            size["words"] += len(cell.source[:heading.start() if heading else None].split())
            if heading:
                break
            continue
        jit = in_kernel = False
        for line in (line for line in cell.source.splitlines() if line.strip()):
            if not line[0].isspace() and not line.startswith("#"):   # a top-level statement starts
                if line.startswith("@"):   # a decorator: @triton.jit's line is the kernel's first
                    jit = in_kernel = jit or line.startswith("@triton.jit")
                else:
                    in_kernel, jit = jit and line.startswith("def "), False
            size["kernel" if in_kernel else "code"] += 1
    return size


def reading_minutes(size: dict[str, int]) -> float:
    return (size["words"] / PROSE_WORDS_PER_MINUTE + size["code"] / CODE_LINES_PER_MINUTE
            + size["kernel"] / KERNEL_LINES_PER_MINUTE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["export", "sync", "check", "execute", "setup-cell", "main-line"])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="execute: the .ipynb files; main-line: the .py sources (default: every chapter)")
    parser.add_argument("--inputs-only", action="store_true", help="check: leave out the output fingerprints")
    arguments = parser.parse_args()
    command = arguments.command
    if command == "execute":
        if execute([p.resolve() for p in arguments.notebooks] or [s.with_suffix(".ipynb") for s in chapter_sources()]):
            sys.exit(1)
    elif command == "export":
        export()
    elif command == "sync":
        sync()
    elif command == "setup-cell":
        print(SETUP_CELL)
    elif command == "main-line":
        print(f"main line (before the first '## Going deeper'); minutes at {PROSE_WORDS_PER_MINUTE} words, "
              f"{CODE_LINES_PER_MINUTE} code lines, {KERNEL_LINES_PER_MINUTE} kernel lines a minute")
        for source in arguments.notebooks or chapter_sources():
            size = main_line(jupytext.read(source))
            print(f"{Path(source).stem:22s} {size['words']:6d} words {size['code']:5d} code {size['kernel']:5d} kernel "
                  f"~{reading_minutes(size):4.0f} min")
    else:
        problems = check(outputs=not arguments.inputs_only)
        for problem in problems:
            print(f"FAIL {problem}")
        if problems:
            sys.exit(1)
        print(f"ok: {len(chapter_sources())} notebook pairs in sync, scan_lib and exercises/ up to date")


if __name__ == "__main__":
    main()
