"""Backprop exercises: write eight backward passes by hand (softmax, log-softmax, cross-entropy,
LayerNorm, linear, GELU, embedding, attention) and have a checker say where and how each is wrong.

    python -m npformer.exercises                       # writes my_backprop.py: forwards given, backwards blank
    python -m npformer.exercises check my_backprop.py  # one row per function; exit status 1 while one is wrong

From a notebook: `check("attention_backward", my_attention_backward)` prints the same row and
returns it as a `Result`; `ForwardSteps` cuts a forward into named steps and judges each
intermediate gradient you derive (attention's dP, dS, ...) the same way. docs/exercises.md says
what each verdict and diagnosis means.
"""
from .checker import GradientResult, Result, SolutionImportError, check, check_file
from .problems import EXERCISES
from .steps import ForwardSteps
from .starter import write_starter

__all__ = ["EXERCISES", "ForwardSteps", "GradientResult", "Result", "SolutionImportError", "check", "check_file",
           "write_starter"]
