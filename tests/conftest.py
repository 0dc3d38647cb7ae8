def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a grading run of one chapter's untouched or partly solved exercise notebook on "
        "Triton's interpreter (tens of seconds each); `make test-slow` runs them, `make test` (CI) does not: "
        "it grades chapter 02's notebooks in every state, and every chapter's own solutions. Also a test "
        "whose checks a chapter that make test runs under nbval makes too (its docstring says which)")
