"""The NNX example runs end to end (crash, restore into a fresh model, continue)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # subprocess: deselect with -m 'not slow'

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_nnx_training_example(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "nnx_training.py"), "--dir", str(tmp_path),
         "--steps", "40", "--crash-at", "20"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restored step 20; optimizer step counter 20" in proc.stdout
    assert "finished 40 steps" in proc.stdout
    assert (tmp_path / "40" / "default" / "manifest.msgpack").exists()
