"""npformer.runtime.host_memory: freed arrays' pages are reused (glibc), and the setting can be turned off."""
import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# 50 rounds of two 8 MiB arrays made and freed, after one round to warm up: the page faults counted
FAULTS = """
import resource
import numpy as np
import npformer
a = np.ones(1 << 21, np.float32); b = a * 2; del a, b
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    a = np.ones(1 << 21, np.float32); b = a * 2; del a, b
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode):
    env = dict(os.environ, NPFORMER_HOST_MEMORY=mode, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the malloc parameters are glibc's")
def test_freed_pages_are_reused():
    # glibc's defaults unmap every 8 MiB block at free: >= 2 faults per round even with 2 MiB huge
    # pages, 4,096 with 4 KiB pages; kept, the heap's pages serve every round after the first
    released, kept = faults("release"), faults("keep")
    assert released >= 100
    assert kept < 50, (kept, released)


def test_bad_mode_is_refused(monkeypatch):
    from npformer.runtime import host_memory
    monkeypatch.setenv("NPFORMER_HOST_MEMORY", "sometimes")
    with pytest.raises(ValueError, match="NPFORMER_HOST_MEMORY must be one of .*'sometimes'"):
        host_memory.keep_freed_memory()
    monkeypatch.setenv("NPFORMER_HOST_MEMORY", "release")
    assert host_memory.keep_freed_memory() is False
