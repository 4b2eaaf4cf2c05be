"""What the generated docs share: write the rendered text to its file, or with `--check` exit 1 when
the file on disk differs (tests/test_docs.py runs the check)."""
from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(target: Path, text: str, argv: list[str], command: str) -> int:
    if "--check" in argv:
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            print(f"{target} is stale: run `{command}`", file=sys.stderr)
            return 1
        return 0
    target.write_text(text, encoding="utf-8")
    print(f"wrote {target}")
    return 0
