"""`python -m npformer.explore` on a saved run: from the run's explorer.json, or recomputed from its
checkpoints (equal to what the demo collected while training, bit for bit), and a clear one-line
error (exit status 2) for a source it cannot use. And the demo's side: the explorer changes nothing
in the training, --explorer-every 0 writes none, a resumed run continues its explorer."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import npformer
from explorer_run import ROOT, RUN_ARGS, demo, short_run  # noqa: F401  (short_run: a fixture)
from npformer.explore.__main__ import main

MARKER = '<script id="explorer-data" type="application/json">'


def page_data(path):
    text = open(path, encoding="utf-8").read()
    return json.loads(text.split(MARKER, 1)[1].split("</script>", 1)[0])


def saved(run):
    return json.loads((run / "explorer.json").read_text())


def test_a_run_folder_gives_a_page_with_its_explorer_json(short_run, tmp_path):
    out = main([str(short_run), "--out", str(tmp_path / "e.html")])
    assert page_data(out) == saved(short_run)
    assert page_data(short_run / "explorer.html") == saved(short_run)   # the demo's own page


def test_the_module_runs_from_the_command_line(short_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(short_run, run)
    (run / "explorer.html").unlink()
    done = subprocess.run([sys.executable, "-m", "npformer.explore", str(run)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"wrote {run / 'explorer.html'}" in done.stdout
    assert page_data(run / "explorer.html") == saved(short_run)


def test_recomputed_from_checkpoints_equals_what_the_demo_collected_while_training(short_run, tmp_path):
    collected = saved(short_run)
    for sources in ([str(short_run), "--recompute"],
                    [str(short_run / "checkpoint-step8.npz"), str(short_run / "checkpoint.npz")]):
        data = page_data(main(sources + ["--examples", "2", "--out", str(tmp_path / "e.html")]))
        assert [s["step"] for s in data["snapshots"]] == [8, 12]
        assert data["snapshots"] == [s for s in collected["snapshots"] if s["step"] in (8, 12)]
        assert {k: v for k, v in data.items() if k not in ("snapshots", "title")} == \
            {k: v for k, v in collected.items() if k not in ("snapshots", "title")}


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", "{source}: no such file or folder"),
    (lambda d: d / "notes.txt", "{source}: not a checkpoint npformer can read"),
    (lambda d: d, "{source}: expected a run folder of demos/reverse.py, with explorer.json or checkpoint files "
                  "(*.npz); found neither"),
    (lambda d: d / "bare.npz", "{source}: expected a checkpoint of demos/reverse.py (its 'demo' entry names the "
                               "task's settings and seed"),
])
def test_a_source_it_cannot_use_is_one_line_with_exit_status_2(make, message, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    npformer.save_checkpoint(tmp_path / "bare.npz", npformer.nn.Linear(2, 2))
    source = make(tmp_path)
    if source == tmp_path:
        (tmp_path / "notes.txt").unlink()
        (tmp_path / "bare.npz").unlink()
    with pytest.raises(SystemExit) as exit_info:
        main([str(source)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m npformer.explore: error: " + message.format(source=source)), err
    assert err.count("\n") == 1 and not os.path.exists(tmp_path / "explorer.html")


def test_checkpoints_of_two_runs_or_a_foreign_json_are_refused(short_run, tmp_path, capsys):
    other = tmp_path / "other"
    demo("reverse").main(RUN_ARGS[:-6] + ["--seed", "1", "--steps", "2", "--out", str(other), "--explorer-every", "0",
                                          "--no-plots", "--quiet"])
    with pytest.raises(SystemExit):
        main([str(short_run / "checkpoint.npz"), str(other / "checkpoint.npz")])
    err = capsys.readouterr().err
    assert f"{other / 'checkpoint.npz'}: from another run than {short_run / 'checkpoint.npz'}" in err
    (other / "explorer.json").write_text('{"format": "something else"}')
    with pytest.raises(SystemExit):
        main([str(other)])
    assert "explorer.json: expected the explorer's data (format 'npformer-explorer/1')" in capsys.readouterr().err


def test_the_explorer_changes_nothing_in_the_training_and_every_0_writes_none(short_run, tmp_path):
    demo("reverse").main(RUN_ARGS + ["--out", str(tmp_path), "--explorer-every", "0"])
    assert not {"explorer.html", "explorer.json"} & set(os.listdir(tmp_path))
    with_explorer = npformer.load_checkpoint(short_run / "checkpoint.npz", restore_rng=False)
    without = npformer.load_checkpoint(tmp_path / "checkpoint.npz", restore_rng=False)
    assert with_explorer["model"].keys() == without["model"].keys()
    for name, weights in with_explorer["model"].items():
        np.testing.assert_array_equal(weights, without["model"][name], err_msg=name)
    assert with_explorer["trainer"]["history"]["loss"] == without["trainer"]["history"]["loss"]


def test_a_resumed_run_continues_its_explorer(short_run, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("checkpoint-step8.npz", "explorer.json"):
        shutil.copy(short_run / name, run / name)
    args = [a for a in RUN_ARGS if a not in ("--preset", "seed", "--min-len", "3", "--max-len", "6")]
    demo("reverse").main(["--resume", str(run / "checkpoint-step8.npz")] + args[args.index("--steps"):])
    assert saved(run)["snapshots"] == saved(short_run)["snapshots"]


def test_the_page_template_is_package_data():
    """page.html and explorer.js are read with importlib.resources: setup.cfg ships them with the package."""
    import configparser

    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    patterns = [p.strip() for p in config["options.package_data"]["npformer.explore"].split(",")]
    folder = os.path.join(ROOT, "npformer", "explore")
    shipped = {name for name in os.listdir(folder) if any(name.endswith(p.lstrip("*")) for p in patterns)}
    assert shipped == {"page.html", "explorer.js"}
