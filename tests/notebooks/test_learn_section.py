"""The README's Learn section as a learner follows it (issue 44 items 1 and 4): the exercises
come before the notebooks that work them out; one command installs what Jupyter needs (the
`learn` extra, no torch); the demo's rows name the folder each run writes."""
import configparser
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
LEARN = README[README.index("## Learn\n"):README.index("\n## ", README.index("## Learn\n") + 1)]


def learn_rows():
    return [line for line in LEARN.splitlines() if re.match(r"\| \d+ \|", line)]


def test_the_exercises_come_before_the_notebooks_that_solve_them():
    rows = learn_rows()
    order = [int(r.split("|")[1]) for r in rows]
    assert order == list(range(1, len(rows) + 1))
    position = {key: next(i for i, r in enumerate(rows) if key in r)
                for key in ("npformer.exercises check", "notebooks/01_", "notebooks/02_")}
    assert position["npformer.exercises check"] < position["notebooks/01_"] < position["notebooks/02_"]
    assert "npformer.exercises train my_backprop.py" in LEARN


def test_one_command_installs_the_learn_extra_without_torch():
    extras = configparser.ConfigParser()
    extras.read(ROOT / "setup.cfg")
    learn = extras["options.extras_require"]["learn"].split()
    assert "matplotlib" in learn and any(p.startswith("ipykernel") for p in learn)
    assert not any(p.startswith(("torch", "transformers", "mpich", "nvidia")) for p in learn)
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q -e '.[learn]'" in makefile and re.search(r"^learn: notebooks$", makefile, re.M)
    assert "make learn" in LEARN and "runs/notebooks/<notebook>/" in LEARN


def test_the_demo_rows_name_the_folder_each_run_writes():
    row = next(line for line in README.splitlines() if line.startswith("| `python demos/reverse.py --steps 20`"))
    assert "`runs/reverse-steps20/`" in row and "never replaces `runs/reverse/`" in row


def test_the_notebooks_that_solve_exercises_say_so_first():
    for name in ("01_attention_backprop.py", "02_softmax_layernorm_ce.py"):
        text = (ROOT / "notebooks" / name).read_text()
        head = text[text.index("# # "):]
        assert head.split("\n#\n")[1].startswith("# **Solutions ahead.**"), name
