"""The GPU check's scripts, run here as far as a machine without a GPU allows: the parity script
and the training-step benchmark on the "test" device (the cuda code paths) against torch on the
CPU, scripts/gpu_check.sh's dry run and its clear stop without CuPy, the launch count."""
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from autograd import backend

ROOT = pathlib.Path(__file__).resolve().parents[2]


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


def test_gpu_check_script_is_valid_bash_and_stops_clearly_without_cupy(tmp_path):
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    if backend.cuda_available():
        pytest.skip("a GPU is present: the script would run in full")
    result = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode != 0
    assert "cupy" in (result.stdout + result.stderr).lower()
    assert "gpu_check status: 1" in (tmp_path / "gpu_check.log").read_text()


def test_gpu_check_dry_run_plans_every_piece_within_six_minutes(tmp_path):
    """The dry run prints each piece's command and cap (their budget fits in 6 minutes) and checks
    that every script it calls exists and parses its options."""
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    log = (tmp_path / "gpu_check.log").read_text()
    assert result.returncode == 0, log
    for piece in ("-k cuda tests", "scripts/gpu_parity.py", "--config base --device cuda", "--config paper --device cuda",
                  "benchmarks/attention.py --device cuda --lengths 1024 4096 16384", "demos/reverse.py --device cuda"):
        assert piece in log, piece
    for script in ("scripts/gpu_parity.py", "benchmarks/train_step.py", "benchmarks/attention.py", "demos/reverse.py"):
        assert f"{script}: parses its options" in log
    budget = int(re.search(r"of a (\d+)s budget", log).group(1))
    assert budget <= 360


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_train_step_benchmark_runs_eager_and_graphed_on_the_test_device(torch):
    """benchmarks/train_step.py --device test: the cuda code path (eager and a captured graph,
    emulated) beside torch, as gpu_check runs it on a GPU."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--config", "tiny",
                             "--device", "test", "--steps", "2", "--no-memory", "--threads", "1", "--dropout", "0"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    for line in ("   ours:", "graphed:", "  torch:", "ratio graphed/torch"):
        assert line in result.stdout, result.stdout


def test_launch_count_shows_one_fused_adam_kernel_per_parameter():
    """benchmarks/launch_count.py on the test device (the cuda code paths, kernel launches counted):
    Adam is one kernel launch per parameter (its reference would make 13)."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "launch_count.py"), "--config", "base"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    adam, parameters = re.search(r"Adam ([\d,]+) \(([\d,]+) parameters\)", result.stdout).groups()
    assert adam == parameters and int(parameters) > 50, result.stdout
