"""An explorer of attention and its gradients in the browser: one self-contained HTML file (the
data inline, plain JavaScript, no network) with a slider over the saved training steps, selectors
for the example, attention kind, layer and head, P, dL/dP and dL/dS side by side (masked cells
hatched), the numbers of the hovered cell, and the loss, accuracy and per-layer gradient norms.

    python -m npformer.explore runs/reverse                 # -> runs/reverse/explorer.html
    python -m npformer.explore a.npz b.npz --out e.html     # snapshots recomputed from checkpoints

demos/reverse.py collects the data while it trains (`Collector`) and writes explorer.html and
explorer.json; see docs/explorer.md.
"""
from .collect import FORMAT, Collector, pick_examples, snapshot
from .page import render, write_data, write_page
from .sources import DATA_FILE, ExploreError, from_checkpoints, from_source, read_data

__all__ = ["Collector", "pick_examples", "snapshot", "render", "write_page", "write_data", "read_data",
           "from_checkpoints", "from_source", "ExploreError", "DATA_FILE", "FORMAT"]
