"""Shared fixtures: one `device` fixture runs a test on every backend; `torch` is the
reference, and under CI (CI set) a missing torch, or playwright and chromium for the browser
tests, fails the run instead of skipping. At the end,
every numpy name the tests used on the "test" device must exist in CuPy, else the run fails."""
import functools
import gc
import importlib
import os
import pathlib
import sys

import numpy as np
import pytest

from autograd import backend
from npformer.runtime import threads as _parallel
from npformer.runtime import deferred, testdevice

IN_CI = bool(os.environ.get("CI"))


@pytest.fixture(params=["cpu", "test", "cuda"])
def device(request):
    """Each available backend: numpy ("cpu"), numpy presented as a second device ("test"),
    and CuPy ("cuda", skipped with a reason when there is no GPU)."""
    if request.param == "cuda" and not backend.cuda_available():
        pytest.skip("cuda: CuPy or a GPU is not available on this machine")
    return request.param


@pytest.fixture
def frequent_switches():
    """Switch threads every 10 us instead of 5 ms, so that races show up in a short test."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(saved)


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


def dev_package(name):
    """The dev-extra package `name`, skipping the test when it is missing (failing under CI)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if IN_CI:
            pytest.fail(f"{name} is required under CI: install the dev extra (`make test`)")
        pytest.skip(f"{name} is not installed: `pip install -e .[dev]`")


CHROMIUM = "/usr/bin/chromium"  # Debian's package (.ci/run installs it); playwright's own browsers are not used


@pytest.fixture(scope="session")
def chromium():
    """(playwright.sync_api, the chromium executable) for the browser tests: skipped with the
    reason where playwright (dev extra) or Debian's chromium is missing; under CI a failure."""
    dev_package("playwright")
    if not os.access(CHROMIUM, os.X_OK):
        if IN_CI:
            pytest.fail(f"{CHROMIUM} is required under CI for the browser tests (.ci/run: apt-get install chromium)")
        pytest.skip(f"no browser: {CHROMIUM} is missing (apt-get install chromium)")
    return importlib.import_module("playwright.sync_api"), CHROMIUM


@pytest.fixture(scope="session")
def transformers(torch):
    """Hugging Face transformers (test dependency only), quiet: no progress bars or warnings."""
    module = dev_package("transformers")
    module.logging.set_verbosity_error()
    module.utils.logging.disable_progress_bar()
    return module


@pytest.fixture(scope="session")
def safetensors():
    """The safetensors package (npformer's optional extra, in the dev extra)."""
    return dev_package("safetensors")


@pytest.fixture
def threads(monkeypatch):
    """use(n): n threads with GEMM splitting, every op big enough to split; restored afterwards."""
    saved = _parallel.get_num_threads()
    monkeypatch.setattr(_parallel, "MIN_PARALLEL_ENTRIES", 0)
    monkeypatch.setattr(_parallel, "MIN_PARALLEL_MACS", 0)
    monkeypatch.setattr(_parallel, "MIN_BLAS_THREADS_MACS", 0)
    yield _parallel.set_num_threads
    _parallel.set_num_threads(saved)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def no_gc():
    """Only reference counting frees objects during the test (as torch frees a graph)."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.fixture(autouse=True)
def no_pending_checks_between_tests():
    """A deferred device check that a test left unread (npformer.runtime.deferred) must not raise in the next."""
    yield
    deferred.discard_pending()


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
    missing = names_missing_in_cupy(testdevice._OnTestDevice.names_used)
    if missing:
        session.exitstatus = 1
        print(f"\nCode run on the 'test' device used names that CuPy lacks, so it would fail on 'cuda': {missing}")


@functools.lru_cache(maxsize=1)
def _cupy_api():
    lines = pathlib.Path(__file__).with_name("cupy_api.txt").read_text().splitlines()
    return frozenset(line for line in lines if not line.startswith("#"))


def _in_cupy(name):
    obj = backend.cupy
    for part in name.split(".")[1:]:
        obj = getattr(obj, part, None)
    return obj is not None


def names_missing_in_cupy(names):
    """The names ("numpy.add.at", "numpy.random.Generator.random", ...) that CuPy lacks: asked of
    CuPy itself where it is installed, else looked up in tests/cupy_api.txt (scripts/cupy_api.py)."""
    if backend.cupy is not None:
        return sorted(n for n in names if not _in_cupy(n))
    return sorted(set(names) - _cupy_api())


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"torch reference tests passed: {_torch_results['passed']}")
