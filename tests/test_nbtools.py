"""The output fingerprint: `make check` fails on a notebook whose code changed after its outputs were recorded."""
import os
import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import nbtools  # noqa: E402


def _notebook(*sources):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_markdown_cell("# a chapter")] + [nbformat.v4.new_code_cell(s) for s in sources]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return notebook


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """A two-cell notebook that imports scan_lib.cumsum, run and stamped by `nbtools.py execute`."""
    path = tmp_path_factory.mktemp("nb") / "chapter.ipynb"
    nbformat.write(_notebook("from scan_lib.runtime import DEVICE", "print(1 + 1)"), path)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(nbtools.ROOT), saved]))  # the kernel imports scan_lib
    try:
        nbtools.execute([path], timeout=600)
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return path


def test_execute_records_a_fingerprint_that_check_accepts(executed):
    notebook = nbformat.read(executed, as_version=4)
    stamp = notebook.metadata["scan_course"]["fingerprint"]
    assert stamp["scan_lib_hashes"] == nbtools.scan_lib_hashes(["runtime"])
    assert stamp["device"] == nbtools.device_name()
    assert [c.execution_count for c in notebook.cells if c.cell_type == "code"] == [1, 2]
    assert notebook.cells[2].outputs[0]["text"] == "2\n"
    assert nbtools._check_outputs(executed) == []


def test_execute_names_each_slow_cell_as_it_finishes(tmp_path, monkeypatch, capsys):
    """A recording cut off by a device call's time limit must still say which cells took the time."""
    path = tmp_path / "slow.ipynb"
    nbformat.write(_notebook("x = 1", "import time\ntime.sleep(0.6)", "print(x)"), path)
    monkeypatch.setattr(nbtools, "SLOW_CELL_S", 0.5)
    assert nbtools.execute([path], timeout=600) == []
    slow = [line for line in capsys.readouterr().out.splitlines() if line.startswith("   cell ")]
    assert len(slow) == 1 and slow[0].startswith("   cell 2 ran "), slow  # cell 0 is the markdown heading
    assert slow[0].endswith(": import time"), slow


def _changed(executed, tmp_path, change):
    notebook = nbformat.read(executed, as_version=4)
    change(notebook)
    path = tmp_path / "changed.ipynb"
    nbformat.write(notebook, path)
    return " ".join(nbtools._check_outputs(path))


def test_check_fails_when_code_changed_after_the_run(executed, tmp_path):
    def edit(notebook):
        notebook.cells[2].source = "print(1 + 2)"
    assert "its code changed after its outputs were recorded" in _changed(executed, tmp_path, edit)


def test_check_ignores_markdown_edits(executed, tmp_path):
    def edit(notebook):
        notebook.cells[0].source = "# a chapter, reworded"
    assert _changed(executed, tmp_path, edit) == ""


def test_check_fails_on_a_cell_without_execution_count(executed, tmp_path):
    def edit(notebook):
        notebook.cells[1].execution_count = None
    assert "not run once each, in order" in _changed(executed, tmp_path, edit)


def test_check_fails_on_a_notebook_never_stamped(executed, tmp_path):
    def edit(notebook):
        del notebook.metadata["scan_course"]
    assert "has no output fingerprint" in _changed(executed, tmp_path, edit)


def test_scan_lib_dependencies_follow_imports():
    notebook = _notebook("from scan_lib.linear_scan import linear_scan", "y = scan_lib.cumsum(x)")
    modules = nbtools.scan_lib_dependencies(notebook)
    assert {"runtime", "cumsum", "linear_scan", "ema"} <= set(modules)  # ema: imported by linear_scan
    assert "selective_scan" not in modules


def test_scan_lib_dependencies_follow_public_names():
    """A public name runs the module that defines it, whatever the module is called."""
    modules = nbtools.scan_lib_dependencies(_notebook("block = scan_lib.Mamba(16)", "y = scan_lib.selective_scan(*args)"))
    assert {"mamba", "causal_conv1d", "fast_selective_scan", "selective_scan"} <= set(modules)


def test_an_import_from_a_module_runs_that_module_not_a_public_name_of_the_same_name():
    """`from scan_lib.selective_scan import ...` is chapter 05's module; `scan_lib.selective_scan(...)`
    may be the public function, chapter 07's (fast_selective_scan): only the second runs it."""
    from_module = nbtools.scan_lib_dependencies(_notebook("from scan_lib.selective_scan import _vmap_by_loop"))
    assert "selective_scan" in from_module and "fast_selective_scan" not in from_module
    assert "fast_selective_scan" in nbtools.scan_lib_dependencies(_notebook("y = scan_lib.selective_scan(*args)"))


def _edited_module(monkeypatch, module):
    """Make Path.read_text return scan_lib/<module>.py with one line more, as an edit would."""
    original = Path.read_text

    def edited(path, *args, **kwargs):
        text = original(path, *args, **kwargs)
        return text + "\n# edited" if path.name == f"{module}.py" and path.parent == nbtools.PACKAGE else text
    monkeypatch.setattr(Path, "read_text", edited)


def test_check_names_the_module_that_changed(monkeypatch):
    notebook = _notebook("from scan_lib.linear_scan import linear_scan")
    stamp = nbtools.fingerprint(notebook, "a GPU")
    assert nbtools.changed_modules(notebook, stamp) == []
    _edited_module(monkeypatch, "ema")     # linear_scan imports ema
    assert nbtools.changed_modules(notebook, stamp) == ["ema"]


def test_scan_lib_change_invalidates_the_fingerprint(monkeypatch):
    notebook = _notebook("import scan_lib.cumsum")
    modules = nbtools.scan_lib_dependencies(notebook)
    before = nbtools.scan_lib_hashes(modules)
    original = Path.read_text

    def edited(path, *args, **kwargs):
        text = original(path, *args, **kwargs)
        return text + "\n# edited" if path.name == "cumsum.py" else text
    monkeypatch.setattr(Path, "read_text", edited)
    assert nbtools.scan_lib_hashes(modules) != before


def test_sync_keeps_the_fingerprint(executed, tmp_path):
    """`make sync` rewrites a notebook's inputs from its .py; the fingerprint in its metadata survives."""
    import jupytext
    notebook = nbformat.read(executed, as_version=4)
    source = tmp_path / "chapter.py"
    jupytext.write(notebook, source, fmt="py:percent")
    nbformat.write(notebook, tmp_path / "chapter.ipynb")
    synced = nbtools.paired_notebook(source)
    assert synced.metadata["scan_course"] == notebook.metadata["scan_course"]
    assert synced.cells[2].outputs == notebook.cells[2].outputs


# ---- solution markers (tools/exercises.py): invisible to the fingerprint and to the export ----

MARKED = '''\
#| export
def combine(a, b):
    """Doc."""
    ### BEGIN SOLUTION
    ### HINT: add them
    return a + b
    ### END SOLUTION'''
PLAIN = '''\
#| export
def combine(a, b):
    """Doc."""
    return a + b'''


def test_code_hash_ignores_solution_markers_and_nothing_else():
    assert nbtools.code_hash(_notebook(MARKED)) == nbtools.code_hash(_notebook(PLAIN))
    assert nbtools.strip_solution_markers(MARKED) == PLAIN
    # a HINT line counts as a marker only right after BEGIN SOLUTION; any other edit changes the hash
    for edited in [PLAIN + "\n    ### HINT: add them", PLAIN + "\n# a comment", PLAIN.replace("a + b", "b + a"),
                   MARKED.replace("### END SOLUTION", "### END SOLUTION!")]:
        assert nbtools.code_hash(_notebook(edited)) != nbtools.code_hash(_notebook(PLAIN)), edited


def test_export_drops_solution_markers(tmp_path, monkeypatch):
    import jupytext
    notebook = _notebook("#| default_exp toy", MARKED)
    source = tmp_path / "99_toy.py"
    jupytext.write(notebook, source, fmt="py:percent")
    monkeypatch.setattr(nbtools, "chapter_sources", lambda: [source])
    (text,) = nbtools.exported_modules().values()
    assert text.endswith(PLAIN.split("\n", 1)[1] + "\n") and "SOLUTION" not in text and "HINT" not in text


def test_the_chapters_markers_leave_scan_lib_and_the_fingerprints_alone():
    """The committed notebooks/02_ema has markers; scan_lib/ema.py, generated from it, has none and is
    up to date, and the chapter's fingerprint (recorded before the markers) still matches."""
    assert nbtools.BEGIN_SOLUTION in (nbtools.NOTEBOOKS / "02_ema.py").read_text()
    wanted = nbtools.exported_modules()
    assert all(nbtools.BEGIN_SOLUTION not in text for text in wanted.values())
    assert wanted[nbtools.PACKAGE / "ema.py"] == (nbtools.PACKAGE / "ema.py").read_text()
    assert nbtools._check_outputs(nbtools.NOTEBOOKS / "02_ema.ipynb") == []


# ---- exercises/: generated from the chapters, and `check` fails when they drift ----

def test_exercise_notebook_stubs_hints_outputs_and_badge(tmp_path):
    import exercises
    notebook = _notebook(nbtools.SETUP_CELL, MARKED, "x = 1\nif x:\n    ### BEGIN SOLUTION\n    y = 2\n    ### END SOLUTION",
                         "print(3)")
    notebook.cells[0].source = f"# 99 · Toy\n\n[badge]({nbtools.colab_link('99_toy')})"
    for cell in notebook.cells[1:]:
        cell.outputs = [nbformat.v4.new_output("stream", text="out\n")]
        cell.execution_count = 1
    path = tmp_path / "99_toy.ipynb"
    nbformat.write(notebook, path)
    student, found = exercises.exercise_notebook(path)
    assert found == [("99.1", "combine", "add them"), ("99.2", None, exercises.GENERIC_HINT)]
    code = [c for c in student.cells if c.cell_type == "code"]
    assert code[1].source.endswith('    """Doc."""\n    # YOUR CODE HERE (exercise 99.1)\n'
                                   "    raise NotImplementedError('exercise 99.1: add them')")
    assert f"    raise NotImplementedError('exercise 99.2: {exercises.GENERIC_HINT}')" in code[2].source
    assert "y = 2" not in code[2].source and "return a + b" not in code[1].source
    assert code[1].outputs == [] and code[2].outputs == [] and code[1].metadata["tags"] == ["exercise"]
    assert code[0].outputs and code[3].outputs  # the cells without solutions keep theirs
    assert exercises.colab_link("99_toy") in student.cells[0].source
    assert nbtools.colab_link("99_toy") not in student.cells[0].source
    assert student.cells[1].cell_type == "markdown" and "make grade" in student.cells[1].source
    assert student.metadata["scan_course"] == {"exercises": {"chapter": "99_toy", "ids": ["99.1", "99.2"]}}
    nbformat.validate(student)


def test_check_fails_when_exercises_drift(tmp_path, monkeypatch):
    import exercises
    assert exercises.check() == []  # the committed exercises/ matches the chapters
    copy = tmp_path / "exercises"
    copy.mkdir()
    for path in exercises.EXERCISES.glob("*.ipynb"):
        (copy / path.name).write_text(path.read_text())
    monkeypatch.setattr(exercises, "EXERCISES", copy)
    assert exercises.check() == []
    edited = copy / "02_ema.ipynb"
    edited.write_text(edited.read_text().replace("exercise 02.1:", "exercise 02.1 (edited):"))
    (copy / "07_orphan.ipynb").write_text("{}")
    problems = " ".join(exercises.check())
    assert "02_ema.ipynb is stale" in problems and "07_orphan.ipynb comes from no chapter" in problems
    assert any("exercises/" in p or "02_ema" in p for p in nbtools.check(outputs=False))
    exercises.write()
    assert exercises.check() == [] and not (copy / "07_orphan.ipynb").exists()


def test_main_line_counts_what_comes_before_going_deeper():
    """Prose words and code lines up to the first '## Going deeper' heading; the lines of a @triton.jit
    function count as kernel lines, a plain function after it in the same cell as code again."""
    import jupytext
    source = "\n".join([
        "# %% [markdown]", "# One two three.", "",
        "# %%", "import triton", "", "x = 1", "",
        "# %%", "@triton.jit", "def kernel(X):", "    pass", "", "", "def launcher(x):", "    return x", "",
        "# %% [markdown]", "# Four five.", "#", "# ## Going deeper: more", "# Not counted at all.", "",
        "# %%", "y = 2"])
    size = nbtools.main_line(jupytext.reads(source, fmt="py:percent"))
    assert size == {"words": 5, "code": 4, "kernel": 3}, size
    assert nbtools.reading_minutes(size) == pytest.approx(5 / 130 + 4 / 12 + 3 / 6)


def test_every_chapter_main_line_reads_in_45_minutes():
    """The course's rule for a chapter's main line (CONTRIBUTING.md): at most 45 minutes at the reading
    rates above. Kernels placed in the main line cost the most (six lines a minute): a change that adds them there
    pays for them elsewhere in the main line, or moves what does not carry the idea to "Going deeper"."""
    import jupytext
    minutes = {path.stem: nbtools.reading_minutes(nbtools.main_line(jupytext.read(path)))
               for path in nbtools.chapter_sources()}
    assert minutes and all(m <= 45.0 for m in minutes.values()), {k: round(m, 2) for k, m in minutes.items() if m > 45}
