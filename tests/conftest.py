"""Shared fixtures: one `device` fixture runs a test on every backend; `torch` is the
reference, and under CI (CI set) a missing torch fails the run instead of skipping."""
import importlib
import os

import numpy as np
import pytest

from autograd import backend

IN_CI = bool(os.environ.get("CI"))


@pytest.fixture(params=["cpu", "test", "cuda"])
def device(request):
    """Each available backend: numpy ("cpu"), numpy presented as a second device ("test"),
    and CuPy ("cuda", skipped with a reason when there is no GPU)."""
    if request.param == "cuda" and not backend.cuda_available():
        pytest.skip("cuda: CuPy or a GPU is not available on this machine")
    return request.param


@pytest.fixture(scope="session")
def torch():
    """PyTorch, the reference implementation (test dependency only)."""
    try:
        module = importlib.import_module("torch")
    except ImportError:
        if IN_CI:
            pytest.fail("torch is required under CI: install the dev extra (`make test`)")
        pytest.skip("torch is not installed: `pip install -e .[dev]`")
    module.set_num_threads(max(1, os.cpu_count() or 1))
    return module


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def pytest_collection_modifyitems(items):
    for item in items:
        if "torch" in getattr(item, "fixturenames", ()):
            item.add_marker("uses_torch")


def pytest_configure(config):
    config.addinivalue_line("markers", "uses_torch: compares against PyTorch")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


_torch_results = {"passed": 0, "skipped": 0}


def pytest_runtest_logreport(report):
    if "uses_torch" in report.keywords and (report.when == "call" or report.skipped):
        if report.passed:
            _torch_results["passed"] += 1
        elif report.skipped:
            _torch_results["skipped"] += 1


def pytest_sessionfinish(session, exitstatus):
    if IN_CI and not _torch_results["passed"]:
        session.exitstatus = 1
        print("\nCI: no torch-based test passed (skipped or missing); failing.")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"torch reference tests passed: {_torch_results['passed']}")
