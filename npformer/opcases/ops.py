"""The cases of npformer.functional's ops: each op folder's `cases.py` (npformer/functional/<op>/),
imported in the order of `npformer.functional.OPS`, registers its families and cases: each op on
ordinary inputs and on its edge cases (masks of every kind, fully masked rows, masks that require
grad, broadcast inputs, ignored targets, padding rows, extreme logits), with the PyTorch reference
written once beside the op."""
import importlib

import npformer.functional as F

for _folder in F.OPS:
    importlib.import_module(f"npformer.functional.{_folder}.cases")
