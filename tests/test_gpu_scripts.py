"""The GPU check's parity script, run here on the "test" device against torch on the CPU, so
CI exercises the same code the GPU machine runs (scripts/gpu_check.sh)."""
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from autograd import backend

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_gpu_parity_script_passes_on_the_test_device(torch, capsys):
    parity = load_script("gpu_parity")
    status = parity.main(["--device", "test", "--torch-device", "cpu", "--d-model", "64", "--layers", "1",
                          "--atol", "1e-5", "--rtol", "1e-4"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "PASS" in out and "gradients" in out


def test_gpu_check_script_is_valid_bash_and_stops_clearly_without_cupy():
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    if backend.cuda_available():
        pytest.skip("a GPU is present: the script would run in full")
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "cupy" in (result.stdout + result.stderr).lower()


def test_launch_count_shows_one_fused_adam_kernel_per_parameter():
    """benchmarks/launch_count.py on the test device (the cuda code paths, kernel launches counted):
    Adam is one kernel launch per parameter (its reference would make 13)."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "launch_count.py"), "--config", "base"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    adam, parameters = re.search(r"Adam ([\d,]+) \(([\d,]+) parameters\)", result.stdout).groups()
    assert adam == parameters and int(parameters) > 50, result.stdout
