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
    assert stamp["scan_lib_modules"] == ["runtime"]
    assert stamp["device"] == nbtools.device_name()
    assert [c.execution_count for c in notebook.cells if c.cell_type == "code"] == [1, 2]
    assert notebook.cells[2].outputs[0]["text"] == "2\n"
    assert nbtools._check_outputs(executed) == []


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


def test_scan_lib_change_invalidates_the_fingerprint(monkeypatch):
    notebook = _notebook("import scan_lib.cumsum")
    modules = nbtools.scan_lib_dependencies(notebook)
    before = nbtools.scan_lib_hash(modules)
    original = Path.read_text

    def edited(path, *args, **kwargs):
        text = original(path, *args, **kwargs)
        return text + "\n# edited" if path.name == "cumsum.py" else text
    monkeypatch.setattr(Path, "read_text", edited)
    assert nbtools.scan_lib_hash(modules) != before


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
