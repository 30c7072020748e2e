"""The explorer's HTML file: page.html with explorer.js and the data inlined (one self-contained
file: no server, no network; the page's Content-Security-Policy refuses every request)."""
from __future__ import annotations

import json
import os
from importlib import resources
from typing import Any

from ..files import atomic_write


def _resource(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def render(data: dict[str, Any]) -> str:
    """The page for `data` (collect.Collector.data(), or read_data's), as one HTML string."""
    # "</" inside the JSON would end the <script> element early; "<\/" is the same JSON string
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    page = _resource("page.html")
    for marker, text in (("/*SCRIPT*/", _resource("explorer.js")), ("/*DATA*/", payload)):
        before, found, after = page.partition(marker)
        if not found:
            raise RuntimeError(f"npformer/explore/page.html: the marker {marker} is missing")
        page = before + text + after
    return page


def write_page(path: str | os.PathLike, data: dict[str, Any]) -> str | os.PathLike:
    """The explorer for `data` written to `path` atomically (missing folders are made). Returns path."""
    text = render(data)

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    atomic_write(path, write)
    return path


def write_data(path: str | os.PathLike, data: dict[str, Any]) -> str | os.PathLike:
    """The explorer's data as JSON (what `python -m npformer.explore RUN` reads back). Returns path."""
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"), allow_nan=False)
    atomic_write(path, write)
    return path
