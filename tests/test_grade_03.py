"""The grader (tools/grade.py) on chapter 03's exercise notebook: untouched, partly solved, solved.

Cost on 2 shared CPU cores: about 5 minutes for the file (measured 302 s), over the 60 s aimed at.
Every case runs with --needed-only (up to the op-wiring export cell in "Going deeper: autograd
plumbing", where the last exercise is); the untouched notebook's stubs fail fast, but the solved
chapter still runs its whole main line before that cell (the formulas, the one-block and blocked
kernels on Triton's interpreter, section 5's checks); the hidden checks themselves take about 10 s. The exercise notebook with every solution put back is not run again: its
code cells are compared with the chapter's instead (same code, same grade). Every grading run here is
marked slow (`make test-slow`; CI runs only the comparison).
"""
import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grade  # noqa: E402
from test_grade import _passed, chapter_passes_every_exercise, solved, solved_but, untouched_fails_every_exercise  # noqa: E402,E501

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "notebooks" / "03_backward.ipynb"
IDS = ["03.1", "03.2", "03.3", "03.4"]


def _solved(ids: set[str], tmp_path: Path) -> Path:
    return solved("03_backward", ids, tmp_path)


def _code(notebook_path):
    """The code cells' sources without the marker lines."""
    markers = ("### BEGIN SOLUTION", "### END SOLUTION", "### HINT:")
    return ["\n".join(line for line in c.source.split("\n") if not line.strip().startswith(markers))
            for c in nbformat.read(notebook_path, as_version=4).cells if c.cell_type == "code"]


@pytest.mark.slow
def test_untouched_notebook_fails_every_exercise():
    untouched_fails_every_exercise("03_backward", IDS)


@pytest.mark.slow
def test_partly_solved_notebook_gets_partial_credit(tmp_path):
    """03.1 and 03.4 solved, 03.2 untouched, 03.3 written without the carry (each chunk's adjoint scanned
    from zero): each exercise is graded on its own, and 03.3's reason points at the carry."""
    path = solved_but("03_backward", {"03.1", "03.3", "03.4"}, tmp_path,
                      "scan_chunk(a_later, dy, delta_carry, SCAN_REVERSE)", "scan_chunk(a_later, dy, 0.0, SCAN_REVERSE)")
    report = grade.grade(path, needed_only=True)
    assert _passed(report) == {"03.1": True, "03.2": False, "03.3": False, "03.4": True}, grade.text_report(report)
    assert "exercise 03.2" in report["exercises"][1]["reason"]
    reason = report["exercises"][2]["reason"]
    assert "linear_scan_rows_backward" in reason and "carried between chunks" in reason, reason
    assert "score: 2/4" in grade.text_report(report)


def test_solutions_put_back_give_the_chapter():
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        assert _code(_solved(set(IDS), Path(folder))) == _code(CHAPTER)


@pytest.mark.slow
def test_the_chapter_passes_every_exercise():
    chapter_passes_every_exercise("03_backward", IDS)
