"""Grade a student's exercise notebook: run it in a fresh kernel, then the hidden checks, per exercise.

    python tools/grade.py exercises/02_ema.ipynb [--json out.json]     (make grade NB=...)

(from the repository's root or anywhere else: the grader puts the repository on the path itself).

1. The notebook runs top to bottom in a fresh Jupyter kernel (nbclient), from a temporary folder, with
   scan_lib importable and figures written to that folder. Its setup cell picks the GPU or Triton's
   CPU interpreter as in the course. Errors do not stop the run; a cell that runs longer than
   --cell-timeout is interrupted, and once --timeout seconds have passed the remaining cells are
   skipped. A hard limit backs both: a cell still running --grace seconds after its time limit (or
   after the notebook's), because it ignores the interrupt say, gets the kernel killed with its whole
   process group (the processes it started included), whatever it does with signals. With --needed-only the run stops after the last code cell that holds an exercise or
   defines a name the checks use (`nb.NAME` in checks_NN.py): the checks need the definitions, not
   the chapter's own demonstrations, which on the CPU interpreter take most of the time.
2. In the same kernel, the checks of tools/grading/checks_NN.py (NN: the chapter, from the notebook's
   metadata or its file name) run against the names the notebook defined: one function
   `exercise_K(nb)` per exercise NN.K, which raises (an AssertionError with the reason) when the
   exercise is not solved. Each check has a time limit of its own.
3. The result, per exercise passed or failed with the reason, is printed and written as JSON
   (default build/grades/<path>.json, the notebook's path with its folders joined by "__", so that
   two students' 02_ema.ipynb in different folders get different files).

A notebook that crashes, hangs, kills its kernel or prints garbage is graded (its exercises fail with
the reason); the grader exits non-zero only when it cannot grade at all (no such notebook or checks).
It is not a sandbox: the student's code runs with your permissions, so grade untrusted submissions in
a container or a throwaway machine.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
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


# ---- inside the student's kernel -------------------------------------------------------------

class Namespace:
    """The student's notebook as the checks see it: `nb.first_order_op` is the name the notebook defined."""

    def __init__(self, names: dict):
        self._names = names

    def __getattr__(self, name):
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


def run_checks(checks_path: str, names: dict, check_timeout: float, out_path: str) -> None:
    """Run every exercise_K of checks_path against the notebook's names; write the results to out_path.
    Runs in the student's kernel (the grader's last cell)."""
    spec = importlib.util.spec_from_file_location("_hidden_checks", checks_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    notebook = Namespace(names)
    results = []

    def on_alarm(signum, frame):
        raise TimeoutError(f"the check took longer than {check_timeout:.0f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        for number, function in exercises_of(module):
            start = time.time()
            signal.setitimer(signal.ITIMER_REAL, check_timeout)
            try:
                function(notebook)
                passed, reason = True, ""
            except BaseException as error:  # noqa: BLE001 - a student's code may raise anything
                passed, reason = False, _reason(error)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            results.append({"number": number, "passed": passed, "reason": reason,
                            "seconds": round(time.time() - start, 2)})
    finally:
        signal.signal(signal.SIGALRM, previous)
    Path(out_path).write_text(json.dumps(results))


# ---- in the grader ---------------------------------------------------------------------------

def exercises_of(module) -> list[tuple[int, object]]:
    """(K, exercise_K) for every check function of a checks module, in order."""
    found = [(int(m.group(1)), getattr(module, name)) for name in dir(module) if (m := EXERCISE_FUNCTION.match(name))]
    return sorted(found, key=lambda item: item[0])


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
    """Top-level names a cell defines (functions, classes, assignments, imports); none if it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
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
    spec = importlib.util.spec_from_file_location(f"checks_{chapter}", checks_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    exercises = {number: (function.__doc__ or "").strip().split("\n")[0] for number, function in exercises_of(module)}

    execution = report["execution"]
    results = None
    if unreadable:
        failure = unreadable
    else:
        failure = None
        with tempfile.TemporaryDirectory(prefix="grade-") as work:
            results, failure = _execute(notebook, Path(work), checks_path, cell_timeout, timeout, check_timeout,
                                        needed_only, grace, len(exercises), execution, NotebookClient,
                                        DeadKernelError)
    by_number = {r["number"]: r for r in results or []}
    for number, title in exercises.items():
        result = by_number.get(number, {"passed": False, "reason": failure or "the checks did not run", "seconds": 0})
        report["exercises"].append({"id": f"{chapter}.{number}", "title": title, "passed": result["passed"],
                                    "reason": result["reason"], "seconds": result["seconds"]})
    report["score"] = sum(e["passed"] for e in report["exercises"])
    report["total"] = len(report["exercises"])
    return report


def _execute(notebook, work: Path, checks_path: Path, cell_timeout, timeout, check_timeout, needed_only, grace,
             n_exercises, execution: dict, NotebookClient, DeadKernelError):
    """Run the notebook, then the checks cell, in one kernel; return (check results or None, why not)."""
    import nbformat
    code = [i for i, c in enumerate(notebook.cells) if c.cell_type == "code"]
    last = last_needed_cell(notebook, checks_path) if needed_only else None
    if last is not None:
        code = [i for i in code if i <= last]
    out_path = work / "results.json"
    checks_cell = nbformat.v4.new_code_cell(
        "import importlib.util as _u\n"
        f"_s = _u.spec_from_file_location('_grader', {str(Path(__file__).resolve())!r})\n"
        "_g = _u.module_from_spec(_s); _s.loader.exec_module(_g)\n"
        f"_g.run_checks({str(checks_path)!r}, globals(), {check_timeout!r}, {str(out_path)!r})")
    notebook.cells.append(checks_cell)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               SCAN_COURSE_FIGURES=str(work / "figures"), MPLBACKEND="Agg")
    client = NotebookClient(notebook, timeout=cell_timeout, allow_errors=True, interrupt_on_timeout=True,
                            error_on_timeout={"ename": "TimeoutError", "evalue": f"the cell ran over {cell_timeout:.0f} s"},
                            kernel_name="python3", resources={"metadata": {"path": str(work)}})
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
            client.timeout = check_timeout * n_exercises + 60
            watchdog.deadline = time.time() + client.timeout + grace
            client.execute_cell(checks_cell, len(notebook.cells) - 1)
            error = next((o for o in checks_cell.get("outputs", []) if o.get("output_type") == "error"), None)
            if error is not None and not out_path.exists():
                failure = f"the checks could not run: {_reason_from(error)}"
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
    execution["skipped"] = skipped
    execution["seconds"] = round(time.time() - start, 1)
    if skipped:
        failure = failure or f"the notebook ran over the time limit of {timeout:.0f} s"
    if out_path.exists():
        try:
            return json.loads(out_path.read_text()), failure
        except ValueError:
            failure = failure or "the checks' results could not be read"
    return None, failure or "the checks did not run"


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--json", type=Path,
                        help="where to write the JSON report (default build/grades/<path>.json, its folders joined by __)")
    parser.add_argument("--chapter", help="the chapter's number, NN (default: from the notebook)")
    parser.add_argument("--cell-timeout", type=float, default=300, help="seconds per cell (default 300)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole notebook (default 900)")
    parser.add_argument("--check-timeout", type=float, default=120, help="seconds per hidden check (default 120)")
    parser.add_argument("--grace", type=float, default=10,
                        help="seconds past a time limit before the kernel is killed with its processes (default 10)")
    parser.add_argument("--needed-only", action="store_true",
                        help="run the code cells only up to the last one that holds an exercise or defines a name the checks use")
    arguments = parser.parse_args()
    if not arguments.notebook.exists():
        sys.exit(f"no such notebook: {arguments.notebook}")
    report = grade(arguments.notebook, arguments.chapter, arguments.cell_timeout, arguments.timeout,
                   arguments.check_timeout, arguments.needed_only, arguments.grace)
    out = arguments.json or default_json_path(arguments.notebook)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(text_report(report))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
