"""The grader (tools/grade.py) on chapter 02's exercise notebook: untouched, partly solved, solved, and broken;
and on every chapter's notebook solved but for its first exercise.

Cost on 2 shared CPU cores, with -n 2: about 3 minutes for the file (measured 183 s, of which the
one-wrong-exercise tests add about 60 s). Each chapter 02 case starts a kernel and runs the notebook
on Triton's interpreter, 5-12 s each: the untouched and partly solved notebooks run in full (their
later cells fail fast); the solved ones run with --needed-only, up to linear_scan_rows (the full
solved chapter takes 65-85 s here, so it is graded by hand: `make grade NB=notebooks/02_ema.ipynb`).
The one-wrong-exercise test of each chapter runs the checks' process alone (`checks_alone`), 8-16 s; the
same notebooks graded in full, a kernel each, are slow (`make test-slow`). What the checks' process alone
decides (a library's own solution, a patched torch) is tested with it alone too. The solved, off-by-one and forging
notebooks are graded once, by test_grade_all_writes_the_gradebook, which checks each one's report too.
"""
import os
import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import exercises  # noqa: E402
import grade  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXERCISE = ROOT / "exercises" / "02_ema.ipynb"
# Chapter 02's exercises written wrong: (a line of the solution, the wrong one)
WRONG_COMBINE = ("return a_left * a_right, a_right * b_left + b_right",   # 02.1: the right step first
                 "return a_left * a_right, a_left * b_right + b_left")
FORGOTTEN_CARRY = ("b = tl.where(idx == entry, a * carry + b, b)", "b = b")   # 02.2
OFF_BY_ONE = ("t = ((length - 1) // CHUNK - k) * CHUNK + idx", "t = (length // CHUNK - k) * CHUNK + idx")   # 02.3


def solved(name: str, ids: set[str], tmp_path: Path) -> Path:
    """exercises/<name>.ipynb with the chapter's solutions of `ids` put back in place of their stubs
    (every chapter's grading test uses it)."""
    notebook = nbformat.read(ROOT / "exercises" / f"{name}.ipynb", as_version=4)
    chapter = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    number = 0
    for cell in (c for c in chapter.cells if c.cell_type == "code"):
        lines = cell.source.split("\n")
        for begin, end, indent, hint in exercises.solution_regions(cell.source):
            number += 1
            exercise_id = f"{name[:2]}.{number}"
            if exercise_id not in ids:
                continue
            stub = "\n".join(exercises.stub(exercise_id, indent, hint))
            first = begin + 2 if lines[begin + 1].strip().startswith("### HINT:") else begin + 1
            solution = "\n".join(lines[first:end])
            holders = [c for c in notebook.cells if stub in c.source]
            assert len(holders) == 1, exercise_id
            holders[0].source = holders[0].source.replace(stub, solution)
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(notebook, path)
    return path


def solved_but(name: str, ids: set[str], tmp_path: Path, right: str, wrong: str) -> Path:
    """solved(name, ids, tmp_path) with the one line of solution code `right` replaced by `wrong`."""
    return replaced(solved(name, ids, tmp_path), right, wrong)


def replaced(path: Path, right: str, wrong: str) -> Path:
    """The notebook at path, rewritten with `right` replaced by `wrong` in the first cell that holds it."""
    notebook = nbformat.read(path, as_version=4)
    cell = next(c for c in notebook.cells if right in c.source)
    cell.source = cell.source.replace(right, wrong)
    nbformat.write(notebook, path)
    return path


def untouched_fails_every_exercise(name: str, ids: list[str]) -> None:
    """exercises/<name>.ipynb as it is, graded with --needed-only: every exercise fails, on its own stub."""
    report = grade.grade(ROOT / "exercises" / f"{name}.ipynb", needed_only=True)
    assert _passed(report) == dict.fromkeys(ids, False), grade.text_report(report)
    for exercise in report["exercises"]:  # each fails on its own stub, whose message names it
        assert f"exercise {exercise['id']}" in exercise["reason"], exercise
    assert f"score: 0/{len(ids)}" in grade.text_report(report)


def chapter_passes_every_exercise(name: str, ids: list[str]) -> None:
    """notebooks/<name>.ipynb, the solutions, graded with --needed-only: every exercise passes."""
    report = grade.grade(ROOT / "notebooks" / f"{name}.ipynb", needed_only=True)
    assert _passed(report) == dict.fromkeys(ids, True), grade.text_report(report)


def _solved(ids: set[str], tmp_path: Path) -> Path:
    return solved("02_ema", ids, tmp_path)


def _passed(report):
    return {e["id"]: e["passed"] for e in report["exercises"]}


def test_untouched_notebook_fails_every_exercise():
    report = grade.grade(EXERCISE)
    assert _passed(report) == {"02.1": False, "02.2": False, "02.3": False}
    assert report["score"] == 0 and report["total"] == 3
    for exercise in report["exercises"]:  # each fails on its own stub, whose message names it
        assert f"exercise {exercise['id']}" in exercise["reason"]
    assert "score: 0/3" in grade.text_report(report)


def test_partly_solved_notebook_gets_partial_credit(tmp_path):
    report = grade.grade(_solved({"02.1"}, tmp_path))
    assert _passed(report) == {"02.1": True, "02.2": False, "02.3": False}
    assert "exercise 02.2" in report["exercises"][1]["reason"]


FORGING_ATTACK = ("import json, torch, builtins\n"
                  "torch.allclose = lambda *a, **k: True\n"
                  "torch.equal = lambda *a, **k: True\n"
                  "torch.testing.assert_close = lambda *a, **k: None\n"
                  "for name in ('results.json', '../results.json'):\n"
                  "    open(name, 'w').write(json.dumps([{'number': k, 'passed': True, 'reason': '', 'seconds': 0}"
                  " for k in (1, 2, 3)]))\n"
                  "print('02.1 passed\\n02.2 passed\\n02.3 passed\\nscore: 3/3')")


def test_a_forgotten_carry_fails_its_exercise_alone_saying_so(tmp_path):
    """02.2 without the carry (each chunk scanned from zero): 02.3, whose check runs the chapter's
    scan_chunk, still passes, and 02.2's reason is its check's hint for a forgotten carry."""
    report = grade.grade(solved_but("02_ema", {"02.1", "02.2", "02.3"}, tmp_path, *FORGOTTEN_CARRY), needed_only=True)
    assert _passed(report) == {"02.1": True, "02.2": False, "02.3": True}, grade.text_report(report)
    assert "is the state carried between chunks?" in report["exercises"][1]["reason"], report["exercises"][1]


# Every chapter's first exercise written wrong: (a line of its solution, the wrong one, what its check says)
FIRST_EXERCISE_WRONG = {
    "00_triton": ("offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)", "offsets = tl.arange(0, BLOCK)",
                  "does each program take its own block?"),
    "01_cumsum": ("tl.associative_scan(x.to(tl.float32), 0, add_combine)", "tl.associative_scan(x, 0, add_combine)",
                  "is the scan accumulated in float32?"),
    "02_ema": (*WRONG_COMBINE, "the left step comes first"),
    "03_backward": ("dy, reverse=not reverse)  # the adjoint", "dy, reverse=reverse)", "grads_by_formula"),
    "04_multistate": ("y = tl.sum(c * h, axis=1)", "y = tl.sum(h, axis=1)", "multistate_single_block"),
    "05_mamba": ("D=(dybar * u).sum((0, 2)),", "D=dybar.sum((0, 2)),", "d D,"),
    "06_mamba_block": ("WEIGHT + ds * WIDTH + k,", "WEIGHT + ds * WIDTH + (WIDTH - 1 - k),", "out (width"),
    "07_performance": ("4 * big + 2 * small", "3 * big + 2 * small", "are the bytes counted as the docstring says"),
    "08_flash_attention": ("scale_x = torch.where(m_x == m, 1.0, torch.exp(m_x - m))", "scale_x = torch.exp(m_x - m)",
                           "must count as 1, not NaN"),
    "10_mamba2": ("state = torch.exp(a_cum[:, :, c, -1])[..., None, None] * state + chunk_states[:, c]",
                  "state = state + chunk_states[:, c]", "decayed by the chunk's total decay"),
}


def test_every_chapter_s_first_exercise_is_tried_wrong():
    assert sorted(FIRST_EXERCISE_WRONG) == sorted(p.stem for p in (ROOT / "exercises").glob("*.ipynb")), \
        "a chapter with exercises joins FIRST_EXERCISE_WRONG with its first exercise written wrong"


def _first_exercise_wrong(name: str, tmp_path: Path) -> Path:
    ids = nbformat.read(ROOT / "exercises" / f"{name}.ipynb", as_version=4).metadata["scan_course"]["exercises"]["ids"]
    return solved_but(name, set(ids), tmp_path, *FIRST_EXERCISE_WRONG[name][:2])


def _only_the_first_fails(name: str, exercises: list[dict]) -> None:
    assert [e["passed"] for e in exercises] == [False] + [True] * (len(exercises) - 1), exercises
    assert FIRST_EXERCISE_WRONG[name][2] in exercises[0]["reason"], exercises[0]


def checks_alone(notebook, chapter: str) -> list[dict]:
    """The hidden checks' results (one dict per exercise: passed, reason) on a notebook's definitions, run
    as grade.grade runs them once the kernel is done, here without the kernel: the definitions of every
    code cell up to the last that the checks need (the cells --needed-only runs), in the checks' own
    process. Whatever the checks decide (a library's own solution, a patched torch) they decide there."""
    checks = grade.CHECKS / f"checks_{chapter}.py"
    cells = [i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and i <= grade.last_needed_cell(notebook, checks)]
    package = grade.checks_package(notebook, cells, chapter)
    results, why_not = grade._check_in_own_process(package, checks, 120, 600, dict(os.environ, PYTHONPATH=str(ROOT)))
    assert results is not None, why_not
    return results


@pytest.mark.parametrize("name", sorted(FIRST_EXERCISE_WRONG))
def test_one_wrong_exercise_costs_only_its_own_point(name, tmp_path):
    """Each chapter solved but for its first exercise: the hidden checks fail that exercise alone, with its
    own check's reason for the bug: the other checks run with the chapter's solution of it."""
    _only_the_first_fails(name, checks_alone(nbformat.read(_first_exercise_wrong(name, tmp_path), as_version=4), name[:2]))


def test_an_exercise_written_as_a_call_of_another_exercise_s_function_fails(tmp_path):
    """03.1 left as a call of 03.4's _backward_by_scan, 03.4 unsolved: the other exercises' solutions stand in
    for the notebook's only where the chapter's 03.1 uses them, so 03.1 is checked on the notebook's stub."""
    path = solved("03_backward", {"03.2", "03.3"}, tmp_path)
    notebook = nbformat.read(path, as_version=4)
    holders = [c for c in notebook.cells if c.cell_type == "code" and "NotImplementedError(\"exercise 03.1" in c.source]
    assert len(holders) == 1 and "def grads_by_formula" in holders[0].source
    stub_line = next(line for line in holders[0].source.split("\n") if "NotImplementedError(\"exercise 03.1" in line)
    holders[0].source = holders[0].source.replace(stub_line, "    return (h, *_backward_by_scan(a, h, dy, h0, reverse, 16))")
    results = checks_alone(notebook, "03")
    assert [r["passed"] for r in results] == [False, True, True, False], results


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIRST_EXERCISE_WRONG))
def test_one_wrong_exercise_costs_only_its_own_point_when_graded(name, tmp_path):
    """The same notebooks graded in full (a kernel runs each with --needed-only): 15-45 s a chapter."""
    report = grade.grade(_first_exercise_wrong(name, tmp_path), needed_only=True)
    _only_the_first_fails(name, report["exercises"])
    assert report["score"] == report["total"] - 1, grade.text_report(report)


def _code_notebook(path: Path, *sources: str) -> Path:
    """A python3 notebook of code cells with these sources, written to path."""
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    nbformat.write(notebook, path)
    return path


def test_a_hanging_garbage_printing_crashing_notebook_is_graded(tmp_path):
    path = _code_notebook(
        tmp_path / "02_crash.ipynb",
        "import time\nwhile True:\n    time.sleep(0.1)",  # hangs: interrupted after the cell time limit
        "import sys\nprint('\\x00\\x1b[2J' + 'garbage ' * 10000)\nsys.stdout.write('{\"passed\": true}')",
        "def first_order_op(a_left, b_left, a_right, b_right):\n    return a_right, b_right",  # wrong
        "import os\nos._exit(3)")  # kills the kernel
    report = grade.grade(path, cell_timeout=3)
    assert report["score"] == 0 and report["total"] == 3
    assert report["execution"]["errors"][0]["error"].startswith("interrupted after 3 s")
    assert all("kernel died" in e["reason"] for e in report["exercises"])

    path.write_bytes(b"\x89PNG not a notebook")
    report = grade.grade(path)
    assert report["score"] == 0 and all("cannot be read" in e["reason"] for e in report["exercises"])


def test_json_and_text_reports(tmp_path):
    report = {"notebook": "x.ipynb", "chapter": "02", "score": 1, "total": 2,
              "execution": {"cells": 3, "ran": 3, "errors": [], "skipped": 0, "timed_out": False, "seconds": 1.0},
              "exercises": [{"id": "02.1", "title": "a", "passed": True, "reason": "", "seconds": 0.1},
                            {"id": "02.2", "title": "b", "passed": False, "reason": "why", "seconds": 0.1}]}
    text = grade.text_report(report)
    assert "02.1   passed" in text and "02.2   FAILED  b: why" in text and "score: 1/2" in text


def test_every_chapter_with_exercises_has_checks_for_each():
    """A chapter joins the grader with tools/grading/checks_NN.py, one exercise_K per exercise NN.K."""
    import importlib.util
    for path in sorted((ROOT / "exercises").glob("*.ipynb")):
        ids = nbformat.read(path, as_version=4).metadata["scan_course"]["exercises"]["ids"]
        checks = ROOT / "tools" / "grading" / f"checks_{path.name[:2]}.py"
        assert checks.exists(), f"{path.name} has exercises but no {checks.relative_to(ROOT)}"
        spec = importlib.util.spec_from_file_location("checks", checks)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        titles = grade.exercise_titles(checks)   # read from the source, without importing it
        assert [f"{path.name[:2]}.{k}" for k in titles] == ids
        defined = sorted(int(name.split("_")[1]) for name in dir(module) if grade.EXERCISE_FUNCTION.match(name))
        assert list(titles) == defined   # every exercise_K the module defines, none missed by the source's reading
        assert titles == {k: (getattr(module, f"exercise_{k}").__doc__ or "").strip().split("\n")[0] for k in titles}


@pytest.mark.parametrize("bad", ["### BEGIN SOLUTION\nx = 1", "x = 1\n### END SOLUTION",
                                 "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION"])
def test_malformed_markers_are_reported(bad):
    with pytest.raises(exercises.MarkerError):
        exercises.solution_regions(bad)


def test_the_total_time_limit_skips_the_remaining_cells(tmp_path):
    path = _code_notebook(tmp_path / "02_slow.ipynb", *["import time\ntime.sleep(1.5)"] * 3)
    report = grade.grade(path, timeout=1)
    assert report["execution"]["timed_out"] and report["execution"]["skipped"] == 2
    assert all(not e["passed"] for e in report["exercises"])  # the checks still ran: nothing is defined
    assert "defines no `first_order_op`" in report["exercises"][0]["reason"]


def test_definitions_that_hang_in_the_checks_process_fail_within_the_check_time(tmp_path):
    """The checks' process runs the notebook's definitions again for each exercise (an assignment may call
    anything): that has the check's time limit too, and the grade says why it failed."""
    import time
    path = _code_notebook(
        tmp_path / "02_stall.ipynb", "import time",
        "def first_order_op(a_left, b_left, a_right, b_right):\n    return a_left * a_right, a_right * b_left + b_right",
        "stall = time.sleep(4)")
    start = time.time()
    report = grade.grade(path, check_timeout=1)
    assert time.time() - start < 60
    assert report["score"] == 0 and report["total"] == 3, grade.text_report(report)
    assert all(e["reason"] == "running the notebook's definitions took longer than 1 s" for e in report["exercises"]), \
        grade.text_report(report)


def test_a_check_that_runs_out_of_time_says_so(tmp_path):
    """A student's operator that hangs when the check calls it: the check stops at check_timeout and the
    reason says so in words, without the grader's own exception class."""
    path = _code_notebook(tmp_path / "02_slow.ipynb",
                          "import time\n"
                          "def first_order_op(a_left, b_left, a_right, b_right):\n"
                          "    time.sleep(30)\n"
                          "    return a_left * a_right, a_right * b_left + b_right")
    report = grade.grade(path, check_timeout=1)
    first = report["exercises"][0]
    assert not first["passed"] and first["reason"] == "the check took longer than 1 s", grade.text_report(report)


def test_a_cell_that_ignores_the_interrupt_is_killed_with_its_processes(tmp_path):
    """The hard limit: a cell that ignores SIGINT (nbclient's interrupt) and has started a child process
    keeps its kernel busy; the kernel is killed with that child grace seconds after the next cell's time
    limit, and the notebook is still graded."""
    import time
    child_pid = tmp_path / "child.pid"
    path = _code_notebook(
        tmp_path / "02_stubborn.ipynb",
        "import signal, subprocess, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        f"child = subprocess.Popen(['sleep', '300'])\nopen({str(child_pid)!r}, 'w').write(str(child.pid))\n"
        "while True:\n    try:\n        time.sleep(0.1)\n    except BaseException:\n        pass",
        "x = 1")   # waits for the busy kernel: the hard limit ends the wait
    start = time.time()
    report = grade.grade(path, cell_timeout=2, timeout=30, grace=2)
    assert time.time() - start < 60, "the hard limit did not hold"
    assert report["execution"]["killed"] and report["score"] == 0
    assert all("hard time limit" in e["reason"] for e in report["exercises"]), grade.text_report(report)
    pid = int(child_pid.read_text())
    deadline = time.time() + 10
    while _running(pid):              # killed, it may take a moment to be reaped
        assert time.time() < deadline, f"the cell's child process {pid} outlived the kernel"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    """Whether process pid exists and is not a zombie (dead, waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_default_report_paths_do_not_collide(tmp_path, monkeypatch):
    """Two students' 02_ema.ipynb in different folders get different default JSON files."""
    monkeypatch.chdir(tmp_path)
    alice, bob = Path("alice") / "02_ema.ipynb", Path("bob") / "02_ema.ipynb"
    assert grade.default_json_path(alice) != grade.default_json_path(bob)
    assert grade.default_json_path(alice).name == "alice__02_ema.json"
    assert grade.default_json_path(alice).parent == ROOT / "build" / "grades"
    assert grade.default_json_path(tmp_path / "carol" / "02_ema.ipynb").name == "carol__02_ema.json"


def test_grade_py_runs_from_anywhere_without_pythonpath(tmp_path):
    """`python tools/grade.py NB` as its docstring shows, from another folder and with no PYTHONPATH: it
    grades (here a notebook that defines nothing: every exercise fails, with the checks' reason)."""
    import subprocess
    path = _code_notebook(tmp_path / "02_empty.ipynb", "x = 1")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    tools_found = subprocess.run([sys.executable, "-c", "import nbformat, nbclient, torch"], cwd=tmp_path, env=env,
                                 capture_output=True)
    if tools_found.returncode != 0:   # e.g. notebook tools installed outside site-packages, on PYTHONPATH only
        pytest.skip("this python cannot import nbformat, nbclient and torch without PYTHONPATH: nothing to test here")
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "grade.py"), str(path), "--json", str(tmp_path / "r.json")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "score: 0/3" in run.stdout and "defines no `first_order_op`" in run.stdout, run.stdout


def _every_exercise_wrong_and(attack: str, tmp_path: Path) -> Path:
    """Chapter 02's exercises each written wrong (the combine in the wrong order, the carry forgotten,
    the reverse positions off by one), with `attack` in a cell right after the setup cell."""
    path = _wrong_reverse_positions(tmp_path)
    for right, wrong in (WRONG_COMBINE, FORGOTTEN_CARRY):
        replaced(path, right, wrong)
    notebook = nbformat.read(path, as_version=4)
    setup = next(i for i, c in enumerate(notebook.cells) if c.cell_type == "code")
    notebook.cells.insert(setup + 1, nbformat.v4.new_code_cell(attack))
    nbformat.write(notebook, path)
    return path


def test_a_definition_that_patches_torch_is_caught(tmp_path):
    """A patch hidden in an assignment (which the checks' process does run) changes torch there: every
    exercise fails, saying so. (The checks alone: the kernel's run decides nothing here; a patch at top
    level, graded in full, is test_grade_all_writes_the_gradebook's cy.)"""
    patch = "import torch\n_ = setattr(torch, 'allclose', lambda *a, **k: True)"
    results = checks_alone(nbformat.read(_every_exercise_wrong_and(patch, tmp_path), as_version=4), "02")
    assert len(results) == 3 and not any(r["passed"] for r in results), results
    assert all("torch.allclose" in r["reason"] and "not graded" in r["reason"] for r in results), results


def test_a_patch_before_an_import_is_caught_too(tmp_path):
    """The checks' process trusts what imports do to the libraries, not what the definitions before them did."""
    patch = "import torch\n_ = setattr(torch, 'allclose', lambda *a, **k: True)\nimport math"
    results = checks_alone(nbformat.read(_every_exercise_wrong_and(patch, tmp_path), as_version=4), "02")
    assert len(results) == 3 and all("torch.allclose" in r["reason"] for r in results), results


def test_the_kernel_talks_to_the_grader_over_unix_sockets(tmp_path):
    """Not over TCP ports, which two kernels starting at once can both pick (a kernel of grade_all's
    died that way here, and its student got no points)."""
    path = _code_notebook(
        tmp_path / "02_transport.ipynb",
        "import json\nfrom ipykernel.connect import get_connection_info\n"
        "assert json.loads(get_connection_info())['transport'] == 'ipc', get_connection_info()")
    report = grade.grade(path)
    assert report["execution"]["ran"] == 1 and report["execution"]["errors"] == [], report["execution"]


def test_grade_all_writes_the_gradebook(tmp_path):
    """A folder of three students' chapter 02 notebooks: solved, one exercise wrong, every exercise wrong
    with an attack on the checks; the gradebook has 3, 2 and 0 points, and each student a feedback page.

    Each notebook is also the one of a check of its own, on its report (grade_all grades it as
    grade.grade(path, needed_only=True) does; one grading run serves both):
    - ada, the solutions put back: every exercise passes, with --needed-only running fewer cells than the
      notebook has (the chapter itself passes too: every chapter's test_grade_NN.py grades it that way);
    - ben, an off-by-one in 02.3: the hidden checks try a length that is a multiple of the chunk and say
      so; the other exercises still pass;
    - cy, FORGING_ATTACK: the checks run in a process of the grader's on the notebook's definitions, so a
      notebook that patches torch's comparisons at top level, writes a results file and prints a perfect
      score still scores 0."""
    import csv
    submissions = tmp_path / "submissions"
    for student, make in (("ada", lambda d: _solved({"02.1", "02.2", "02.3"}, d)),
                          ("ben", lambda d: _wrong_reverse_positions(d)),
                          ("cy", lambda d: _every_exercise_wrong_and(FORGING_ATTACK, d))):
        folder = submissions / student
        folder.mkdir(parents=True)
        work = tmp_path / f"work_{student}"
        work.mkdir()
        made = make(work)
        (folder / "homework.ipynb").write_bytes(made.read_bytes())
    reports = grade.grade_all(submissions, jobs=2, needed_only=True)
    by_student = {r["student"]: r for r in reports}

    ada = by_student["ada"]   # the solution passes every exercise
    assert _passed(ada) == {"02.1": True, "02.2": True, "02.3": True}, grade.text_report(ada)
    assert ada["execution"]["cells"] < sum(c.cell_type == "code" for c in nbformat.read(EXERCISE, 4).cells)
    ben = by_student["ben"]   # wrong reverse positions fail with a reason
    assert _passed(ben) == {"02.1": True, "02.2": True, "02.3": False}
    assert "reverse" in ben["exercises"][2]["reason"] and "L = " in ben["exercises"][2]["reason"]
    cy = by_student["cy"]     # patching torch, forging results and printing a score gets nothing
    assert cy["score"] == 0, grade.text_report(cy)

    rows = {row["student"]: row for row in csv.DictReader(open(grade.write_gradebook(reports, tmp_path / "grades")))}
    assert {s: float(r["total"]) for s, r in rows.items()} == {"ada": 3.0, "ben": 2.0, "cy": 0.0}, rows
    assert rows["ben"]["02.3"] == "0.0" and rows["ben"]["chapter"] == "02" and rows["ada"]["max"] == "3.0"
    page = (tmp_path / "grades" / "feedback" / "ben__homework.html").read_text()
    assert "02.3" in page and "failed" in page and "reverse" in page


def _wrong_reverse_positions(tmp_path: Path) -> Path:
    """Chapter 02 solved but for 02.3's off-by-one: length // CHUNK for (length - 1) // CHUNK, right
    unless the length is a multiple of the chunk."""
    return solved_but("02_ema", {"02.1", "02.2", "02.3"}, tmp_path, *OFF_BY_ONE)


def test_the_library_s_own_solution_is_refused(tmp_path):
    """02.1 answered with scan_lib's own first_order_op (imported, or called from the student's function)
    fails, saying why; the other exercises, written by the student, pass. The checks' process decides it
    (grade._library_objects, borrowed_calls), so the checks alone run each case (graded in full, their
    reasons reach the report as every check's do: test_grade_all_writes_the_gradebook)."""
    answers = ("    from scan_lib.ema import first_order_op as library_op\n    return library_op.fn(a_left, b_left, a_right, b_right)",
               "    import scan_lib\n    return scan_lib.ema.first_order_op.fn(a_left, b_left, a_right, b_right)")
    for answer in answers:
        path = solved_but("02_ema", {"02.1", "02.2", "02.3"}, tmp_path,
                          "    return a_left * a_right, a_right * b_left + b_right", answer)
        results = checks_alone(nbformat.read(path, as_version=4), "02")
        assert [r["passed"] for r in results] == [False, True, True], results
        assert "library" in results[0]["reason"], results[0]
    notebook = nbformat.read(path, as_version=4)
    cell = next(c for c in notebook.cells if "def first_order_op" in c.source)
    cell.source = "from scan_lib.ema import first_order_op"
    results = checks_alone(notebook, "02")
    assert not results[0]["passed"] and "scan_lib's own" in results[0]["reason"], results[0]
