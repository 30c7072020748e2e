"""The README's code runs as written and its first two commands are the set-up commands."""
import contextlib
import io
import pathlib
import re

from threadpoolctl import threadpool_limits

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_setup_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    assert README.index("```bash") < README.index("\n## ")


def test_readme_python_examples_run(tmp_path, monkeypatch):
    """Every python block, as written; the GPT-style model continues its text and the
    classifier learns its task (loosely: training on another CPU may round differently)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 4
    printed = io.StringIO()
    with threadpool_limits(1, "blas"), contextlib.redirect_stdout(printed):  # small matrices: one BLAS thread
        for block in blocks:
            exec(compile(block, "README.md", "exec"), {})
    assert (tmp_path / "runs" / "tour.npz").exists()
    out = printed.getvalue()
    assert re.search(r"^to be, or not to be, that is the q", out, re.M), out
    accuracy = float(re.search(r"^held-out accuracy (\S+)$", out, re.M).group(1))
    assert accuracy >= 0.9, out
    recorded = re.findall(r"^encoder\.layers\.(\d)\.self_attn \(1, 4, 10, 10\) (\S+)$", out, re.M)
    assert [layer for layer, _ in recorded] == ["0", "1"] and all(float(g) > 0 for _, g in recorded), out


def test_project_files_are_there():
    """What users expect: a version, single-sourced with setup.cfg; the license setup.cfg
    names; a changelog that has this version."""
    import npformer

    setup = (ROOT / "setup.cfg").read_text()
    assert re.search(r"^version = attr: npformer\.__version__$", setup, re.M)
    assert re.fullmatch(r"\d+\.\d+\.\d+", npformer.__version__)
    assert re.search(r"^license = MIT$", setup, re.M)
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and "npformer contributors" in license_text
    assert f"## [{npformer.__version__}]" in (ROOT / "CHANGELOG.md").read_text()


def test_the_repository_stands_on_its_own():
    """No file points outside the repository (to a reference file or a shared folder), and every
    relative link of the Markdown files leads to a file that exists."""
    outside = re.compile("REFERENCE" + r"\.md|\.\./shared|/wor" + "k/")
    skip = {".git", ".venv", "build", "runs", "__pycache__", ".pytest_cache", ".hypothesis"}
    for path in ROOT.rglob("*"):
        if skip & set(path.relative_to(ROOT).parts) or not path.is_file() or path.suffix in (".pyc", ".npz", ".png"):
            continue
        text = path.read_text(errors="replace")
        assert not outside.search(text), f"{path.relative_to(ROOT)}: {outside.search(text).group(0)}"
    for page in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", page.read_text()):
            if not re.match(r"[a-z]+:", target):
                assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


def test_the_files_the_docs_name_exist():
    """Every path into the repository that README.md or a page of docs/ names (`tests/test_x.py`,
    `npformer/functional/cuda/`, `tests/test_x.py::test_name`) is there, the test too."""
    named = re.compile(r"(?<![\w/.])((?:autograd|npformer|tests|demos|benchmarks|scripts|docs|notebooks)/[\w./-]*?)"
                       r"(?:::(\w+))?(?=[`\s),:;]|$)")
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for path, function in named.findall(page.read_text()):
            path = path.rstrip(".")
            assert (ROOT / path).exists(), f"{page.name} names {path}, which does not exist"
            if function:
                assert f"def {function}(" in (ROOT / path).read_text(), f"{page.name}: {path} has no {function}"


def test_the_reading_order_of_the_core_names_each_of_its_files_once():
    """README's "Reading the core" table: every file of autograd/ but __init__.py, in one row each."""
    section = README.split("## Reading the core", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| \d+ \| `autograd/(\w+\.py)` \|", section, re.M)
    files = sorted(p.name for p in (ROOT / "autograd").glob("*.py") if p.name != "__init__.py")
    assert sorted(listed) == files and len(set(listed)) == len(listed), (listed, files)


def test_the_line_counts_the_reading_order_states_are_true():
    """README's "Reading the core": each file's line count within 10% of what it has, and the first
    read (the table before the second read's) at most 3 files and 650 lines, the README's own total
    the true one within 10%."""
    section = README.split("## Reading the core", 1)[1].split("\n## ", 1)[0]
    first, second = section.split("**second read**", 1)
    row = re.compile(r"^\| \d+ \| `autograd/(\w+\.py)` \| ~?([\d,]+) \|", re.M)
    for name, stated in row.findall(section):
        lines = len((ROOT / "autograd" / name).read_text().splitlines())
        assert abs(int(stated.replace(",", "")) - lines) <= 0.1 * lines, \
            f"autograd/{name}: README says {stated} lines, it has {lines}"
    first_read = row.findall(first)
    total = sum(len((ROOT / "autograd" / name).read_text().splitlines()) for name, _ in first_read)
    assert 1 <= len(first_read) <= 3 and total <= 650, (first_read, total)
    stated = int(re.search(r"Three files, about ([\d,]+)\s+lines", first).group(1).replace(",", ""))
    assert abs(stated - total) <= 0.1 * total, f"the first read: README says {stated} lines, it is {total}"
    whole = sum(len(p.read_text().splitlines()) for p in (ROOT / "autograd").glob("*.py"))
    layout_row = next(line for line in README.splitlines() if line.startswith("| `autograd/` |"))
    for said in re.findall(r"~([\d,]+) lines", layout_row)[:1] + re.findall(r"about ([\d,]+) lines that import", section):
        assert abs(int(said.replace(",", "")) - whole) <= 0.1 * whole, f"README says autograd/ has {said} lines: {whole}"
