"""npformer's default number of threads, like torch's intra-op threads: the cores this process may
run on (its affinity mask), NPFORMER_NUM_THREADS when set, and 1 without a word when threadpoolctl
is missing (numpy's BLAS then threads the GEMMs itself). Each case runs in a fresh process,
since the default is chosen once per process."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import json, os, sys, warnings
{setup}
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import numpy as np
    import npformer
    import npformer.functional as F
    from autograd import Tensor
    from npformer.runtime import threads
    x = Tensor(np.ones((512, 256)))
    F.layer_norm(x, 256)  # the first op chooses the default
    n = npformer.get_num_threads()
print(json.dumps({{"threads": n, "warnings": [str(w.message) for w in caught],
                   "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}}))
"""


def probe(setup="", env=None):
    environment = {k: v for k, v in os.environ.items() if k != "NPFORMER_NUM_THREADS"}
    environment.update(env or {}, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", PROBE.format(setup=textwrap.dedent(setup))], env=environment,
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_default_is_the_available_cores():
    pytest.importorskip("threadpoolctl")
    out = probe()
    assert out["threads"] == out["cores"] and out["warnings"] == []


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_default_follows_the_affinity_mask():
    pytest.importorskip("threadpoolctl")
    out = probe("os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})")
    assert out["threads"] == 1 and out["cores"] == 1


def test_environment_variable_overrides():
    assert probe(env={"NPFORMER_NUM_THREADS": "1"})["threads"] == 1
    pytest.importorskip("threadpoolctl")
    assert probe(env={"NPFORMER_NUM_THREADS": "3"})["threads"] == 3


def test_bad_environment_variable_is_named():
    environment = dict(os.environ, PYTHONPATH=ROOT, NPFORMER_NUM_THREADS="two")
    result = subprocess.run([sys.executable, "-c", "import npformer; npformer.get_num_threads()"], env=environment,
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode != 0 and "NPFORMER_NUM_THREADS must be an integer >= 1, got 'two'" in result.stderr


def test_without_threadpoolctl_the_default_is_one_thread_and_silent():
    out = probe("sys.modules['threadpoolctl'] = None  # as if it were not installed")
    assert out["threads"] == 1 and out["warnings"] == []
