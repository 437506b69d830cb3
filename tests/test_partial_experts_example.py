"""examples/moe_partial_experts.py runs end to end (crash, restore from holders, continue)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # subprocess: deselect with -m 'not slow'

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_moe_partial_experts_example(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "moe_partial_experts.py"), "--dir",
         str(tmp_path), "--steps", "20", "--crash-at", "10", "--every", "5"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restored step 10" in proc.stdout
    assert "lost tokens" in proc.stdout and "PLT" in proc.stdout
    assert "finished 20 steps" in proc.stdout
    assert (tmp_path / "20" / "default" / "manifest.msgpack").exists()
