"""The op-case registry (npformer.opcases) is complete and consistent: every public op belongs to
a family, every family has cases and the Function classes it names, a family that names a test
file has one that runs the registry's checks; case names are unique and every library case
names its inputs."""
import ast
import importlib
import pathlib

import numpy as np
import pytest

import npformer.functional as F
from npformer import nn, opcases

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_public_op_belongs_to_a_family():
    covered = {op for family in opcases.FAMILIES.values() for op in family.ops}
    assert {f"F.{name}" for name in F.__all__} <= covered
    for family in opcases.FAMILIES.values():
        for op in family.ops:
            prefix, name = op.split(".", 1)
            assert hasattr({"F": F, "nn": nn}[prefix], name), op


def test_case_names_are_unique_and_every_family_has_cases():
    names = [c.name for c in opcases.CASES]
    assert len(names) == len(set(names))
    assert {c.family for c in opcases.CASES if c.family is not None} == set(opcases.FAMILIES)


def test_every_library_case_names_its_inputs():
    for case in opcases.CASES:
        labels = opcases.instantiate(case, np.random.default_rng(0)).labels
        assert not any(label.startswith("input ") for label in labels), (case.name, labels)
    attention = opcases.instantiate(opcases.select("F.sdpa (causal)")[0], np.random.default_rng(0))
    assert attention.labels == ["q", "k", "v"]
    norm = opcases.instantiate(opcases.select("nn.LayerNorm")[0], np.random.default_rng(0))
    assert norm.labels == ["x", "parameter weight", "parameter bias"]


@pytest.mark.parametrize("family", opcases.FAMILIES.values(), ids=lambda f: f.name)
def test_each_family_has_its_code_and_the_test_file_it_names_runs_its_cases(family):
    module = importlib.import_module(family.source.removesuffix(".py").rstrip("/").replace("/", "."))   # a file or a folder
    for name in family.functions:
        assert hasattr(module, name), f"{family.source} has no {name}"
    if family.tests is None:  # tests/opcases/test_registered_cases.py runs its cases
        return
    tests = ROOT / family.tests
    tree = ast.parse(tests.read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "op_tests"]
    assert [ast.literal_eval(call.args[0]) for call in calls] == [family.name], tests


def test_cases_can_be_selected_by_name_or_family():
    assert [c.name for c in opcases.select("F.relu")] == ["F.relu"]
    assert {c.family for c in opcases.select("layer_norm")} == {"layer_norm"}
    assert all(c.module is None for c in opcases.select("", modules=False))
    assert opcases.select("swish") == []
    with pytest.raises(KeyError, match="no op family 'swish'"):
        opcases.cases("swish")


def test_the_library_cases_come_in_through_register():
    """Each op folder's cases.py registers its op's cases; npformer.opcases.modules the modules'."""
    assert {c.name for c in opcases.from_module("npformer.functional")} == {
        c.name for c in opcases.CASES if c.module is None}
    assert {c.name for c in opcases.from_module("npformer.functional.softmax")} == {
        c.name for c in opcases.cases("softmax")}
    assert len(opcases.from_module("npformer.functional")) + len(opcases.from_module("npformer.opcases")) \
        == len(opcases.CASES)
