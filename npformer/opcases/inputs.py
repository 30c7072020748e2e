"""What the op folders' registry cases (npformer/functional/<op>/cases.py) are made of: a case of
one of npformer's own ops (`op_case`, checked against its composite twin), its family (`op_family`:
the folder, its Functions, its derivation's heading, its test file), and inputs drawn from a
Generator (`normal`, `away_from_zero`, `fixed`) or made once (`CONSTANTS`)."""
import numpy as np

from npformer.runtime import random

from .case import COMPOSITE, REQUIREMENTS, OpCase
from .registry import Family

CONSTANTS = np.random.default_rng(1234)  # masks and class weights: drawn once, at import (the folders in order)


def op_case(name, family, inputs, fn, torch=None, **options):
    """A case of one of npformer's own ops: in `family`, checked against its composite twin
    (twin=None for an op that has none in npformer/functional/composite.py), with every higher
    column required (a missing double backward or jvp rule fails, never reads "not defined")."""
    return OpCase(name, inputs, fn, torch, family=family, **{"twin": COMPOSITE, "require": REQUIREMENTS, **options})


def normal(*shapes, scale=1.0, offset=0.0):
    """inputs: standard normal arrays of these shapes, times scale, plus offset."""
    return lambda rng: [offset + scale * rng.standard_normal(shape) for shape in shapes]


def away_from_zero(shape):
    """inputs: |x| >= 0.1, so finite differences never straddle ReLU's kink."""
    return lambda rng: [np.sign(rng.standard_normal(shape)) * (0.1 + np.abs(rng.standard_normal(shape)))]


def fixed(*arrays):
    """inputs: these arrays (float64)."""
    return lambda rng: [np.array(a, dtype=np.float64) for a in arrays]


def seeded(seed, like):
    """A fresh dropout stream for a dropout inside a case: every evaluation, on every device
    (`like`'s included), draws the same mask."""
    return random.Philox(seed)


def op_family(name, ops, folder, functions, section):
    """The Family of npformer's op `name`: its public names, its code (the folder
    npformer/functional/<folder>/ and its Function classes), its derivation's heading in
    docs/backprop.md and its test file, tests/functional/test_op_<name>.py."""
    return Family(name, ops, f"npformer/functional/{folder}/", functions, section, f"tests/functional/test_op_{name}.py")
