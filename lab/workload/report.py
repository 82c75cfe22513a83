"""How every benchmark reports: the figures as indented JSON on stdout, and in a file too."""

from __future__ import annotations

import json
from pathlib import Path


def emit_json(figures: dict, path: str | Path | None = None) -> None:
    text = json.dumps(figures, indent=2, default=str)
    print(text, flush=True)
    if path:
        Path(path).write_text(text + "\n")
