"""docs/flags.md (from the config models) and docs/requests.md (from the request field tables) are
generated and must not go stale."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_flags_doc_is_current():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_flags_doc.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_flags_doc_lists_every_flag():
    from heterollm.config import FLAG_SPECS
    text = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    missing = [n for n in FLAG_SPECS if f"`--{n}`" not in text]
    assert not missing


def test_requests_doc_is_current():
    """docs/requests.md (every request field of OpenAI's and vLLM's schemas, with its status)."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_requests_doc.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
