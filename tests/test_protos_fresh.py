"""The committed generated code matches what proto/generate.py makes from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "federation" / "api" / "v1"


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    """Regenerating into a scratch folder gives byte-identical files (run 'make protos')."""
    subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "federation/api/v1").iterdir()}
    committed = {
        p.name: p.read_bytes()
        for p in GENERATED.iterdir()
        if p.name != "__init__.py" and p.suffix in (".py", ".pyi")
    }
    assert sorted(fresh) == sorted(committed), "generated files were added or removed"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code: {stale}; run 'make protos' and commit"
