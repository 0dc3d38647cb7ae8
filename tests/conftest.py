import pytest

def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a grading run of one chapter's untouched or partly solved exercise notebook on "
        "Triton's interpreter (tens of seconds each); `make test-slow` runs them, `make test` (CI) does not: "
        "it grades chapter 02's notebooks in every state, and every chapter's own solutions. Also a test "
        "whose checks a chapter that make test runs under nbval makes too (its docstring says which)")


def pytest_addoption(parser):
    parser.addoption(
        "--whole-notebooks", action="store_true",
        help="with -n: hand each notebook's cells (nbval) to one worker as one unit, the notebooks first, "
             "largest first, then the tests one by one (make test runs the tests and the chapters so)")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs the tests and the chapters under nbval in one pytest run, so that neither waits
    for the other's last, longest item with a core idle. A chapter's cells must run in order in one
    kernel, on one worker: this scheduler (xdist's loadscope, largest scope first) takes a notebook as one
    scope and each test as its own. (xdist's --dist loadgroup would do it with marks, but with pytest 9.2
    and xdist 3.8 it does not group: it renames items through an attribute pytest no longer reads.)"""
    if not config.getoption("whole_notebooks"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WholeNotebooks(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return path if path.endswith(".ipynb") else nodeid

    return WholeNotebooks(config, log)
