"""Grade a student's exercise notebook: run it in a fresh kernel, then the hidden checks, per exercise.

    python tools/grade.py exercises/02_ema.ipynb [--json out.json]     (make grade NB=...)
    python tools/grade.py --all SUBMISSIONS/ [--jobs N]                  (make grade-all SUBMISSIONS=...)

(from the repository's root or anywhere else: the grader puts the repository on the path itself).

1. The notebook runs top to bottom in a fresh Jupyter kernel (nbclient), from a temporary folder, with
   scan_lib importable and figures written to that folder. Its setup cell picks the GPU or Triton's
   CPU interpreter as in the course. Errors do not stop the run; a cell that runs longer than
   --cell-timeout is interrupted, and once --timeout seconds have passed the remaining cells are
   skipped. A hard limit backs both: a cell still running --grace seconds after its time limit (or
   after the notebook's), because it ignores the interrupt say, gets the kernel killed with its whole
   process group (the processes it started included), whatever it does with signals. With
   --needed-only the run stops after the last code cell that holds an exercise or defines a name the
   checks use (`nb.NAME` in checks_NN.py): the checks need the definitions, not
   the chapter's own demonstrations, which on the CPU interpreter take most of the time.
2. The checks of tools/grading/checks_NN.py (NN: the chapter, from the notebook's metadata or its file
   name) run in a fresh Python process of the grader's, not in the student's kernel: one function
   `exercise_K(nb)` per exercise NN.K, which raises (an AssertionError with the reason) when the
   exercise is not solved. That process rebuilds the notebook's names from the definitions in the
   code cells that ran (imports, functions, classes, assignments to plain names), one statement at a
   time, and nothing else: top-level statements that patch torch or scan_lib, write files or print a
   score never run there. It rebuilds them for each exercise, with the chapter's solutions of the
   other exercises (the definitions that hold them in notebooks/NN_*.ipynb, each run right after the
   notebook's definition of its name) in place of the notebook's: each exercise is graded on its own,
   so one mistake costs one exercise and fails with that exercise's reason. It snapshots the modules
   the checks rely on (builtins, torch, numpy, math, triton, scan_lib) and fails every exercise if the
   notebook's definitions change them, and an exercise if its check leaves them changed (then puts
   them back). An exercise's name bound to scan_lib's own object, or a function that uses a library's
   function of its own name, fails the checks that use it: the library ships the solutions. The
   verdict travels back on the process's stdout behind a random token the grader gave it on stdin;
   nothing the notebook's kernel wrote is read. Each check has a time limit of its own, and the
   process one in total.
3. The result, per exercise passed or failed with the reason, is printed and written as JSON
   (default build/grades/<path>.json, the notebook's path with its folders joined by "__", so that
   two students' 02_ema.ipynb in different folders get different files).
4. With --all, every notebook below a folder is graded, --jobs at a time (default: the cores), each
   its chapter's checks (from its metadata, else its file name, else the exercise ids in its cells);
   build/grades/gradebook.csv gets one row per notebook (file, student, chapter, points per exercise,
   total, seconds, a hash of the checks that graded it), and build/grades/feedback/ one JSON and one
   HTML page per notebook with every exercise's reason. An exercise is worth POINTS[K] (a dict in
   checks_NN.py) or 1 point.

A notebook that crashes, hangs, kills its kernel or prints garbage is graded (its exercises fail with
the reason); the grader exits non-zero only when it cannot grade at all (no such notebook or checks).
It is not a sandbox: the student's code runs with your permissions, and the functions the checks call
run in the checks' process, where code written to attack the grader (walking the interpreter's frames
for the token, say) could still reach it. Grade untrusted submissions in a container or a throwaway
machine.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import json
import linecache
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the checks import scan_lib: run from anywhere without PYTHONPATH
    sys.path.insert(0, str(ROOT))
CHECKS = ROOT / "tools" / "grading"
EXERCISE_FUNCTION = re.compile(r"exercise_(\d+)$")


# ---- in the checks' own process (grade.py --run-checks) ----------------------------------------------

class Namespace:
    """The student's notebook as the checks see it: `nb.first_order_op` is the name the notebook defined."""

    def __init__(self, names: dict, borrowed: dict | None = None):
        self._names, self._borrowed = names, borrowed or {}

    def __getattr__(self, name):
        if name in self._borrowed:
            raise AssertionError(self._borrowed[name])
        if name not in self._names:
            raise AssertionError(f"the notebook defines no `{name}` (did a cell fail before it?)")
        return self._names[name]


def _reason(error: BaseException) -> str:
    if isinstance(error, AssertionError) and str(error):
        return str(error)
    while error.__cause__ is not None:  # Triton's compiler chains the error in the called function, the stub's
        error = error.__cause__
    text = f"{type(error).__name__}: {error}".strip()
    if type(error).__name__ == "InterpreterError" and error.args:  # Triton's interpreter wraps a kernel's error
        text = f"in a kernel (Triton's interpreter): {error.args[0]}"
    lines = [line for line in text.splitlines() if line.strip()]
    text = " / ".join(lines[-3:]) if lines else type(error).__name__
    return text if len(text) <= 400 else text[:397] + "..."


WATCHED = ("builtins", "math", "numpy", "torch", "torch.testing", "torch.nn.functional", "triton",
           "triton.language", "scan_lib")


def _watched_modules() -> dict:
    """The modules whose attributes the checks rely on: those of WATCHED and every scan_lib module."""
    import importlib
    modules = {name: importlib.import_module(name) for name in WATCHED}
    modules.update({name: m for name, m in sys.modules.items() if name.startswith("scan_lib.") and m is not None})
    return modules


def _snapshot(modules: dict) -> dict:
    return {(name, attr): value for name, module in modules.items() for attr, value in list(vars(module).items())}


def _changed(modules: dict, snapshot: dict) -> list[str]:
    """The attributes of the watched modules that no longer hold what the snapshot saw."""
    return sorted(f"{name}.{attr}" for (name, attr), value in snapshot.items()
                  if vars(modules[name]).get(attr, _MISSING) is not value)


def _restore(modules: dict, snapshot: dict) -> None:
    for (name, attr), value in snapshot.items():
        if vars(modules[name]).get(attr, _MISSING) is not value:
            setattr(modules[name], attr, value)


_MISSING = object()


def run_checks_isolated(statements_path: str, checks_path: str, check_timeout: float) -> None:
    """The checks' process (`grade.py --run-checks`): for every exercise_K, rebuild the notebook's names
    from its definitions, the other exercises' pieces from the chapter's solutions, and run it; print the
    results behind the token read from stdin."""
    token = sys.stdin.readline().strip()
    package = json.loads(Path(statements_path).read_text())
    import scan_lib  # noqa: F401 - first, as the notebook's setup cell: it picks the device and the interpreter
    import torch._dynamo  # noqa: F401 - imported on first use of torch.compile, it wraps torch.manual_seed
    spec = importlib.util.spec_from_file_location("_hidden_checks", checks_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = [_grade_exercise(number, getattr(module, f"exercise_{number}"), package, check_timeout)
               for number in exercise_titles(Path(checks_path))]
    sys.stdout.write("\n" + token + json.dumps(results) + "\n")
    sys.stdout.flush()


class _OutOfTime(TimeoutError):
    """Raised by the alarm of _time_limit; _rebuild lets it through where it swallows the notebook's errors."""


@contextlib.contextmanager
def _time_limit(seconds: float, what: str):
    """Raise _OutOfTime in the body once `seconds` have passed, and again every second after (code that
    swallows the first is hit again; the process's own limit is the last resort)."""
    def on_alarm(signum, frame):
        raise _OutOfTime(f"{what} took longer than {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _grade_exercise(number: int, function, package: dict, check_timeout: float) -> dict:
    """exercise_K's result on the notebook's definitions with the chapter's solutions of the other exercises;
    rebuilding the definitions and running the check each have check_timeout seconds."""
    solutions = _other_solutions(number, package["solutions"], package["statements"])
    try:
        with _time_limit(check_timeout, "running the notebook's definitions"):
            names, changed = _rebuild(_with_solutions(package["statements"], solutions))
    except _OutOfTime as error:
        return {"number": number, "passed": False, "reason": str(error), "seconds": check_timeout}
    if changed:
        reason = f"the notebook's definitions change the libraries the checks use ({', '.join(changed[:3])}): not graded"
        return {"number": number, "passed": False, "reason": reason, "seconds": 0}
    replaced = {name for defined, _ in solutions for name in defined}
    borrowed = {name: why for name, why in package["borrowed"].items() if name not in replaced}
    borrowed.update(_library_objects(names, package["exercise_names"]))
    return _run_check(number, function, Namespace(names, borrowed), check_timeout)


def _other_solutions(number: int, solutions: list, statements: list[str]) -> list:
    """The chapter's solution definitions (names, source) of every exercise but K, less those that also
    hold exercise K's piece (one definition with two exercises stays the notebook's), those outside any
    definition, and those that the notebook's exercise K calls where the chapter's does not (exercise K
    written as a call of another exercise's function is graded on the notebook's version of that one)."""
    own_names, own_source = solutions[number - 1]
    own = set(own_names)
    notebook_uses = set().union(*(_names_used(s) for s in statements if _defined_names(s) & own))
    borrowed = notebook_uses - _names_used(own_source)
    return [(names, source) for k, (names, source) in enumerate(solutions, 1)
            if k != number and names and not own & set(names) and not borrowed & set(names)]


def _names_used(source: str) -> set[str]:
    """The names a source reads; none if it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def _with_solutions(statements: list[str], solutions: list) -> list[tuple[str, str]]:
    """(file name, source) of the notebook's statements, each followed by the solutions that define a name
    it defines (so that they take its place from there on); the solutions of names it never defines last."""
    placed, found = [], set()
    for number, source in enumerate(statements):
        placed.append((f"<notebook statement {number}>", source))
        defined = _defined_names(source)
        for k, (names, solution) in enumerate(solutions):
            if defined & set(names):
                placed.append((f"<the chapter's {', '.join(names)}>", solution))
                found.add(k)
    return placed + [(f"<the chapter's {', '.join(names)}>", solution)
                     for k, (names, solution) in enumerate(solutions) if k not in found]


def _rebuild(statements: list[tuple[str, str]]) -> tuple[dict, list[str]]:
    """The names that the statements define, run one at a time, and the libraries' attributes that a
    definition changed (each put back)."""
    modules = _watched_modules()
    snapshot = _snapshot(modules)
    names: dict = {"__name__": "__notebook__"}
    changed = []
    for filename, source in statements:   # its source where inspect finds it (Triton reads kernels' source)
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            exec(compile(source, filename, "exec"), names)   # noqa: S102 - the student's definitions
        except _OutOfTime:
            _restore(modules, snapshot)
            raise
        except BaseException:  # noqa: BLE001 - a failing definition leaves its name undefined, as in the notebook
            pass
        if _is_import(source):   # what an installed module does to the others on import is not the student's
            modules = _watched_modules()
            snapshot = _snapshot(modules)
        elif patched := _changed(modules, snapshot):   # a definition patched a library: remember it, put it back
            changed += patched
            _restore(modules, snapshot)
    return names, changed


def _run_check(number: int, function, notebook: Namespace, check_timeout: float) -> dict:
    modules = _watched_modules()
    snapshot = _snapshot(modules)
    start = time.time()
    try:
        with _time_limit(check_timeout, "the check"):
            function(notebook)
        passed, reason = True, ""
    except _OutOfTime as error:   # its message says it all; the class is the grader's own
        passed, reason = False, str(error)
    except BaseException as error:  # noqa: BLE001 - a student's code may raise anything
        passed, reason = False, _reason(error)
    changed = _changed(modules, snapshot)
    if changed:   # the student's code patched a library while the check ran: not graded, put back
        passed, reason = False, f"the code under test changed {', '.join(changed[:3])}: not graded"
        _restore(modules, snapshot)
    return {"number": number, "passed": passed, "reason": reason, "seconds": round(time.time() - start, 2)}


def _library_objects(names: dict, exercise_names: list[str]) -> dict:
    """The exercises' names that hold scan_lib's own function, class or kernel (imported, or assigned from
    it), with why that fails: the library ships the solutions. Modules and values (`torch`, `DEVICE`)
    an exercise cell imports are not answers."""
    import types
    found = {}
    for name in exercise_names:
        value = names.get(name, _MISSING)
        if isinstance(value, types.ModuleType) or not callable(value):
            continue
        for module_name, module in list(sys.modules.items()):
            if module_name.startswith("scan_lib") and module is not None and vars(module).get(name, _MISSING) is value:
                found[name] = (f"`{name}` is scan_lib's own {module_name}.{name}: the exercise asks for your code, "
                               "not the library's (practise with the library closed)")
                break
    return found


def borrowed_calls(notebook) -> dict:
    """Exercise cells' functions whose body uses a function of the same name from a module (scan_lib's
    `ema.first_order_op`, `torch.cumsum` for `cumsum`), by attribute or by import: name -> why that fails."""
    found = {}
    for index in _exercise_cells(notebook):
        try:
            tree = ast.parse(notebook.cells[index].source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                calls = [ast.unparse(n) for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr == node.name]
                calls += [f"{n.module}.{node.name}" for n in ast.walk(node) if isinstance(n, ast.ImportFrom)
                          and any(alias.name == node.name for alias in n.names)]
                if calls:
                    found[node.name] = (f"`{node.name}` uses {calls[0]}, a library's own `{node.name}`: the "
                                        "exercise asks you to write it")
    return found


def _is_import(source: str) -> bool:
    return isinstance(ast.parse(source).body[0], (ast.Import, ast.ImportFrom))


def definitions(notebook, cells: list[int]) -> list[str]:
    """The statements of the given code cells that define names, in order: imports, functions and classes
    (with their decorators), assignments whose targets are plain names. Cells that do not parse (IPython
    magics, say) give none."""
    statements = []
    for index in cells:
        source = notebook.cells[index].source
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        statements += [_source_of(node, lines) for node in tree.body if _defines(node)]
    return statements


def _source_of(node, lines: list[str]) -> str:
    """A top-level statement's lines, with its decorators."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(lines[first - 1:node.end_lineno])


def solution_definitions(chapter: str) -> list[tuple[list[str], str]]:
    """For each exercise NN.K in order, the names and source of the definition that holds its solution in
    the chapter (notebooks/NN_*.ipynb, between the solution markers that tools/exercises.py turns into
    the stubs): the checks of the other exercises run with it in place of the notebook's."""
    import nbformat
    import exercises
    chapter_path = next((ROOT / "notebooks").glob(f"{chapter}_*.ipynb"))
    found = []
    for cell in nbformat.read(chapter_path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        regions = exercises.solution_regions(cell.source)
        tree = ast.parse(cell.source) if regions else None
        for begin, *_ in regions:   # a solution outside a definition has none (the checks' process runs none of it)
            node = next((n for n in filter(_defines, tree.body) if n.lineno <= begin + 1 <= n.end_lineno), None)
            source = _source_of(node, cell.source.splitlines()) if node else ""
            found.append((sorted(_defined_names(source)), source))
    return found


def _defines(node) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return all(all(isinstance(n, ast.Name) for n in (t.elts if isinstance(t, ast.Tuple) else [t]))
                   for t in targets)
    return False


# ---- in the grader ---------------------------------------------------------------------------

def exercise_titles(checks_path: Path) -> dict[int, str]:
    """K -> the first line of exercise_K's docstring, for every check function (a top-level `def
    exercise_K`) of a checks file, in order; read from its source, so the grader itself never imports what
    the checks import (torch, scan_lib: seconds of every grading, which the checks' process spends anyway).
    The checks' process runs the same functions, in the same order."""
    tree = ast.parse(checks_path.read_text())
    found = [(int(m.group(1)), (ast.get_docstring(node) or "").split("\n")[0]) for node in tree.body
             if isinstance(node, ast.FunctionDef) and (m := EXERCISE_FUNCTION.match(node.name))]
    return dict(sorted(found))


def chapter_of(path: Path, notebook) -> str | None:
    meta = (notebook.metadata.get("scan_course", {}) or {}).get("exercises", {}) if notebook is not None else {}
    match = re.match(r"(\d\d)_", str(meta.get("chapter", ""))) or re.match(r"(\d\d)", path.name)
    return match.group(1) if match else None


def _exercise_cells(notebook) -> list[int]:
    """Code cells that hold an exercise: a stub, an answer in a cell the exercises tool tagged, or the
    solution markers of a chapter notebook."""
    return [i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and (
        "exercise" in c.metadata.get("tags", []) or "### BEGIN SOLUTION" in c.source
        or 'NotImplementedError("exercise ' in c.source or "NotImplementedError('exercise " in c.source)]


def _defined_names(source: str) -> set[str]:
    """Top-level names a cell defines: those of its statements the checks' process runs (_defines);
    none if it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set()
    for node in filter(_defines, tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        else:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def last_needed_cell(notebook, checks_path: Path) -> int | None:
    """Index of the last code cell that holds an exercise or defines a name the checks use."""
    used = set(re.findall(r"\bnb\.(\w+)", checks_path.read_text()))
    cells = set(_exercise_cells(notebook)) | {
        i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and _defined_names(c.source) & used}
    return max(cells, default=None)


class Watchdog:
    """Kills a kernel's whole process group (SIGKILL, which no code can catch or ignore) once the
    deadline set last has passed."""

    def __init__(self, pgid: int):
        self.pgid, self.deadline, self.fired = pgid, float("inf"), False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self):
        while not self._stop.wait(0.1):
            if time.time() > self.deadline:
                try:
                    os.killpg(self.pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.fired = True
                return

    def stop(self):
        self._stop.set()
        self._thread.join()


def socket_transport(folder: Path):
    """Kernel settings under which the kernel talks to the grader over Unix sockets in `folder`, not
    over TCP (jupyter_client's default). Over TCP the grader picks five free ports and closes them
    before the kernel binds them, so two kernels started at once (grade_all's jobs, or another
    program's kernels) can pick the same port: the second kernel dies before its first cell, and its
    student would get no points for the grader's race. The sockets' path is absolute because the
    kernel runs in another directory than the grader."""
    from traitlets.config import Config
    config = Config()
    config.KernelManager.transport = "ipc"
    config.KernelManager.ip = str(folder.resolve() / "kernel")
    return config


def _kernel_process_group(client) -> int:
    """The process group of the client's kernel (jupyter_client starts kernels in a session of their own)."""
    provisioner = client.km.provisioner
    return provisioner.pgid if getattr(provisioner, "pgid", None) else os.getpgid(provisioner.pid)


def grade(path: Path, chapter: str | None = None, cell_timeout: float = 300, timeout: float = 900,
          check_timeout: float = 120, needed_only: bool = False, grace: float = 10) -> dict:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    path = Path(path)
    report = {"notebook": str(path), "chapter": chapter, "exercises": [], "execution": {}}
    try:
        notebook = nbformat.read(path, as_version=4)
    except Exception as error:  # noqa: BLE001 - not a notebook at all
        notebook, unreadable = None, f"the notebook cannot be read: {_reason(error)}"
    else:
        unreadable = None
    chapter = chapter or chapter_of(path, notebook)
    checks_path = CHECKS / f"checks_{chapter}.py"
    if chapter is None or not checks_path.exists():
        raise SystemExit(f"no hidden checks for {path} (chapter {chapter}): expected {checks_path}")
    report["chapter"] = chapter
    exercises = exercise_titles(checks_path)

    execution = report["execution"]
    results = None
    if unreadable:
        failure = unreadable
    else:
        failure = None
        with tempfile.TemporaryDirectory(prefix="grade-") as work:
            results, failure = _execute(notebook, Path(work), chapter, checks_path, cell_timeout, timeout,
                                        check_timeout, needed_only, grace, len(exercises), execution,
                                        NotebookClient, DeadKernelError)
    by_number = {r["number"]: r for r in results or []}
    for number, title in exercises.items():
        result = by_number.get(number, {"passed": False, "reason": failure or "the checks did not run", "seconds": 0})
        report["exercises"].append({"id": f"{chapter}.{number}", "title": title, "passed": result["passed"],
                                    "reason": result["reason"], "seconds": result["seconds"]})
    report["score"] = sum(e["passed"] for e in report["exercises"])
    report["total"] = len(report["exercises"])
    return report


def _execute(notebook, work: Path, chapter: str, checks_path: Path, cell_timeout, timeout, check_timeout, needed_only,
             grace, n_exercises, execution: dict, NotebookClient, DeadKernelError):
    """Run the notebook in its kernel, then the checks in a process of their own on the definitions of the
    cells that ran; return (check results or None, why not)."""
    code = [i for i, c in enumerate(notebook.cells) if c.cell_type == "code"]
    last = last_needed_cell(notebook, checks_path) if needed_only else None
    if last is not None:
        code = [i for i in code if i <= last]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               SCAN_COURSE_FIGURES=str(work / "figures"), MPLBACKEND="Agg")
    client = NotebookClient(notebook, timeout=cell_timeout, allow_errors=True, interrupt_on_timeout=True,
                            error_on_timeout={"ename": "TimeoutError", "evalue": f"the cell ran over {cell_timeout:.0f} s"},
                            kernel_name="python3", resources={"metadata": {"path": str(work)}},
                            config=socket_transport(work))
    start = time.time()
    errors, skipped, failure = [], 0, None
    execution.update(cells=len(code), ran=0, errors=errors, skipped=0, timed_out=False, killed=False)
    watchdog = None
    try:
        with client.setup_kernel(env=env):
            watchdog = Watchdog(_kernel_process_group(client))
            start = time.time()  # the limit is on the notebook's cells, not on starting the kernel
            for position, index in enumerate(code):
                if time.time() - start > timeout:
                    skipped = len(code) - position
                    execution["timed_out"] = True
                    break
                cell = notebook.cells[index]
                cell_start = time.time()
                watchdog.deadline = min(start + timeout, cell_start + cell_timeout) + grace
                client.execute_cell(cell, index)
                execution["ran"] += 1
                error = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)
                if time.time() - cell_start >= cell_timeout:
                    errors.append({"cell": index, "error": f"interrupted after {cell_timeout:.0f} s"})
                elif error is not None:
                    errors.append({"cell": index, "error": _reason_from(error)})
    except DeadKernelError:
        if watchdog is not None and watchdog.fired:
            execution["killed"] = True
            failure = (f"the kernel was killed at the hard time limit ({grace:.0f} s past a time limit, after "
                       f"{execution['ran']} of {len(code)} code cells): a cell did not stop when interrupted")
        else:
            failure = f"the kernel died (after {execution['ran']} of {len(code)} code cells)"
    except Exception as error:  # noqa: BLE001 - the grader survives whatever the notebook does
        failure = f"running the notebook failed: {_reason(error)}"
    finally:
        if watchdog is not None:
            watchdog.stop()
            try:   # the kernel is gone; what it started in its session goes too
                os.killpg(watchdog.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    execution["skipped"] = skipped
    execution["seconds"] = round(time.time() - start, 1)
    if skipped:
        failure = failure or f"the notebook ran over the time limit of {timeout:.0f} s"
    package = checks_package(notebook, code[:execution["ran"]], chapter)
    results, why_not = _check_in_own_process(package, checks_path, check_timeout,
                                             check_timeout * n_exercises + 60 + grace, env)
    if results is None:
        return None, failure or why_not
    if failure:  # the checks ran on what the notebook defined before it stopped: say why where they fail
        for result in results:
            if not result["passed"]:
                result["reason"] = f"{result['reason']} ({failure})"
    return results, None


def checks_package(notebook, cells: list[int], chapter: str) -> dict:
    """What the checks' process gets: the definitions of the given code cells, the names the exercise
    cells define, those that use a library's own function, and the chapter's solution definitions."""
    exercise_names = sorted(set().union(*(_defined_names(notebook.cells[i].source) for i in _exercise_cells(notebook))))
    return {"statements": definitions(notebook, cells), "exercise_names": exercise_names,
            "borrowed": borrowed_calls(notebook), "solutions": solution_definitions(chapter)}


def _check_in_own_process(package: dict, checks_path: Path, check_timeout: float, limit: float, env: dict):
    """Run the checks in a fresh process (its own session, killed with its group at `limit` seconds) on
    the notebook's definitions (package: checks_package's); return (results or None, why not)."""
    import secrets
    import subprocess
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="checks-") as folder:
        statements_path = Path(folder) / "definitions.json"
        statements_path.write_text(json.dumps(package))
        command = [sys.executable, str(Path(__file__).resolve()), "--run-checks", str(statements_path),
                   str(checks_path), str(check_timeout)]
        out_path, err_path = Path(folder) / "stdout", Path(folder) / "stderr"
        with open(out_path, "w") as out_file, open(err_path, "w") as err_file:   # files: no pipe to hold open
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out_file, stderr=err_file, text=True,
                                       cwd=folder, env=dict(env, SCAN_COURSE_FIGURES=folder), start_new_session=True)
            try:
                process.stdin.write(token + "\n")
                process.stdin.close()
                process.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:   # whatever the definitions started in the process's session goes with it
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
        out, err = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    if timed_out:
        return None, f"the checks ran over their time limit of {limit:.0f} s"
    lines = [line for line in out.splitlines() if line.startswith(token)]
    if not lines:
        tail = " / ".join(line for line in err.strip().splitlines()[-3:])
        return None, f"the checks could not run: {tail[-300:] or 'no result'}"
    return json.loads(lines[-1][len(token):]), None


def _reason_from(error_output) -> str:
    text = f"{error_output.get('ename', 'Error')}: {error_output.get('evalue', '')}"
    wrapped = re.fullmatch(r"InterpreterError: InterpreterError\((['\"])(.*)\1\)", text, re.S)
    if wrapped:  # Triton's interpreter wraps the kernel's error: show that one
        text = f"in a kernel: {wrapped.group(2)}"
    return text if len(text) <= 300 else text[:297] + "..."


def text_report(report: dict) -> str:
    execution = report["execution"]
    lines = [f"Grading {report['notebook']} (chapter {report['chapter']}, {report['total']} exercises)"]
    if execution.get("cells"):
        errors = execution["errors"]
        line = f"ran {execution['ran']} of {execution['cells']} code cells in {execution.get('seconds', 0):.0f} s"
        line += f", {len(errors)} raised an error" if errors else ", none raised an error"
        if errors:
            line += f" (first: cell {errors[0]['cell']}, {errors[0]['error']})"
        if execution.get("timed_out"):
            line += f"; {execution['skipped']} skipped after the time limit"
        lines.append(line)
    for exercise in report["exercises"]:
        status = "passed" if exercise["passed"] else "FAILED"
        reason = f": {exercise['reason']}" if exercise["reason"] else ""
        lines.append(f"  {exercise['id']:6} {status:7} {exercise['title']}{reason}")
    lines.append(f"score: {report['score']}/{report['total']}")
    return "\n".join(lines)


def notebooks_below(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def chapter_of_cells(path: Path) -> str | None:
    """The chapter of a notebook whose metadata and name do not say: from its exercise stubs' ids."""
    import nbformat
    try:
        notebook = nbformat.read(path, as_version=4)
    except Exception:  # noqa: BLE001 - grade() reports it unreadable
        return None
    chapter = chapter_of(path, notebook)
    if chapter is None:
        found = re.findall(r"exercise (\d\d)\.\d+", "\n".join(c.source for c in notebook.cells if c.cell_type == "code"))
        chapter = max(set(found), key=found.count) if found else None
    return chapter


def student_of(path: Path, folder: Path) -> str:
    """The student: the first folder below the submissions folder, or the file's name when it lies there."""
    relative = Path(path).relative_to(folder)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def points_of(chapter: str) -> dict[int, float]:
    """Points per exercise K: checks_NN.py's POINTS, 1 where it says nothing."""
    source = (CHECKS / f"checks_{chapter}.py").read_text()
    numbers = [int(k) for k in re.findall(r"^def exercise_(\d+)\(", source, re.M)]
    declared = re.search(r"^POINTS\s*=\s*(\{[^}]*\})", source, re.M)
    points = ast.literal_eval(declared.group(1)) if declared else {}
    return {k: float(points.get(k, 1)) for k in sorted(numbers)}


def _grade_one(args):
    path, options = args
    chapter = chapter_of_cells(path)
    if chapter is None or not (CHECKS / f"checks_{chapter}.py").exists():
        return {"notebook": str(path), "chapter": chapter, "exercises": [], "execution": {},
                "error": "no chapter with hidden checks found for it"}
    return grade(path, chapter, **options)


def grade_all(folder: Path, jobs: int, **options) -> list[dict]:
    """Grade every notebook below folder, jobs at a time; each report gains student, points and checks."""
    from concurrent.futures import ProcessPoolExecutor
    import hashlib
    folder = Path(folder)
    paths = notebooks_below(folder)
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        reports = list(pool.map(_grade_one, [(p, options) for p in paths]))
    for path, report in zip(paths, reports):
        report["file"], report["student"] = str(path.relative_to(folder)), student_of(path, folder)
        chapter = report.get("chapter")
        if report["exercises"]:
            points = points_of(chapter)
            for exercise in report["exercises"]:
                worth = points[int(exercise["id"].split(".")[1])]
                exercise.update(worth=worth, points=worth if exercise["passed"] else 0.0)
            # what decides a grade: the checks, and the chapter's solutions that stand in for the others
            decided_by = (CHECKS / f"checks_{chapter}.py").read_text() + repr(solution_definitions(chapter))
            report["checks"] = hashlib.sha256(decided_by.encode()).hexdigest()[:12]
    return reports


def write_gradebook(reports: list[dict], out_dir: Path) -> Path:
    """out_dir/gradebook.csv (one row per notebook) and out_dir/feedback/<file>.json and .html."""
    import csv
    import html
    out_dir = Path(out_dir)
    (out_dir / "feedback").mkdir(parents=True, exist_ok=True)
    ids = sorted({e["id"] for r in reports for e in r["exercises"]})
    with open(out_dir / "gradebook.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["file", "student", "chapter", *ids, "total", "max", "seconds", "checks", "note"])
        for r in reports:
            by_id = {e["id"]: e for e in r["exercises"]}
            writer.writerow([r["file"], r["student"], r.get("chapter") or "",
                             *[by_id[i]["points"] if i in by_id else "" for i in ids],
                             sum(e["points"] for e in r["exercises"]), sum(e["worth"] for e in r["exercises"]),
                             r.get("execution", {}).get("seconds", ""), r.get("checks", ""), r.get("error", "")])
    for r in reports:
        name = "__".join(Path(r["file"]).with_suffix("").parts)
        (out_dir / "feedback" / f"{name}.json").write_text(json.dumps(r, indent=1) + "\n")
        rows = "".join(f"<tr><td>{html.escape(e['id'])}</td><td>{html.escape(e['title'])}</td>"
                       f"<td>{'passed' if e['passed'] else 'failed'}</td><td>{e['points']:g} / {e['worth']:g}</td>"
                       f"<td>{html.escape(e['reason'])}</td></tr>" for e in r["exercises"])
        total = sum(e["points"] for e in r["exercises"]), sum(e["worth"] for e in r["exercises"])
        page = (f"<!doctype html><meta charset=utf-8><title>{html.escape(r['file'])}</title>"
                f"<h1>{html.escape(r['student'])}: {html.escape(r['file'])}</h1>"
                f"<p>chapter {html.escape(str(r.get('chapter')))}, {total[0]:g} of {total[1]:g} points"
                f"{html.escape(' (' + r['error'] + ')') if r.get('error') else ''}</p>"
                "<table border=1 cellpadding=4><tr><th>exercise</th><th>title</th><th>result</th>"
                f"<th>points</th><th>reason</th></tr>{rows}</table>\n")
        (out_dir / "feedback" / f"{name}.html").write_text(page)
    return out_dir / "gradebook.csv"


def default_json_path(notebook: Path) -> Path:
    """build/grades/<the notebook's path, folders joined by "__">.json: relative to the current folder when
    the notebook is below it, else its absolute path; distinct notebooks get distinct files."""
    path = Path(os.path.abspath(notebook))
    try:
        parts = path.relative_to(Path.cwd()).parts
    except ValueError:
        parts = path.parts[1:]
    return ROOT / "build" / "grades" / ("__".join(parts[:-1] + (path.stem,)) + ".json")


def main() -> None:
    if sys.argv[1:2] == ["--run-checks"]:   # the checks' own process (see _check_in_own_process)
        run_checks_isolated(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebook", type=Path, help="the notebook, or with --all the folder of submissions")
    parser.add_argument("--all", action="store_true", help="grade every notebook below the folder into a gradebook")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="notebooks graded at once with --all")
    parser.add_argument("--json", type=Path,
                        help="where to write the JSON report (default build/grades/<path>.json, its folders joined by __)")
    parser.add_argument("--chapter", help="the chapter's number, NN (default: from the notebook)")
    parser.add_argument("--cell-timeout", type=float, default=300, help="seconds per cell (default 300)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole notebook (default 900)")
    parser.add_argument("--check-timeout", type=float, default=120,
                        help="seconds per hidden check, and again for running the notebook's definitions "
                             "before it (default 120)")
    parser.add_argument("--grace", type=float, default=10,
                        help="seconds past a time limit before the kernel is killed with its processes (default 10)")
    parser.add_argument("--needed-only", action="store_true",
                        help="run the code cells only up to the last one that holds an exercise or defines a name the checks use")
    arguments = parser.parse_args()
    if not arguments.notebook.exists():
        sys.exit(f"no such notebook: {arguments.notebook}")
    if arguments.all:
        reports = grade_all(arguments.notebook, arguments.jobs, cell_timeout=arguments.cell_timeout,
                            timeout=arguments.timeout, check_timeout=arguments.check_timeout,
                            needed_only=arguments.needed_only, grace=arguments.grace)
        gradebook = write_gradebook(reports, ROOT / "build" / "grades")
        for r in reports:
            total = sum(e["points"] for e in r["exercises"]), sum(e["worth"] for e in r["exercises"])
            print(f"{r['file']:50s} {r['student']:20s} {total[0]:g}/{total[1]:g}  {r.get('error', '')}")
        print(f"gradebook: {gradebook}   feedback: {gradebook.parent / 'feedback'}")
        return
    report = grade(arguments.notebook, arguments.chapter, arguments.cell_timeout, arguments.timeout,
                   arguments.check_timeout, arguments.needed_only, arguments.grace)
    out = arguments.json or default_json_path(arguments.notebook)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(text_report(report))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
