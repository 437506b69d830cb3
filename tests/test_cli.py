"""The command line: demo (the main job), inspect and verify, with real checkpoints."""

from __future__ import annotations

import os
import pathlib

from orbax_lossy import format as fmt
from orbax_lossy.cli import main


def test_demo_inspect_verify_and_corruption(tmp_path, capsys) -> None:
    assert main(["demo", "--steps", "50", "--every", "10", "--base-interval", "3",
                 "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "deltas alone" in out and "smaller than plain Orbax" in out
    item = tmp_path / "lossy" / "50" / "default"
    assert main(["inspect", str(item)]) == 0
    out = capsys.readouterr().out
    assert "step 40: base" in out and "step 50: delta" in out and "lc(bits=3" in out
    assert main(["verify", str(item)]) == 0
    assert "verified" in capsys.readouterr().out
    data = pathlib.Path(tmp_path / "lossy" / "40" / "default" / fmt.data_file_name(0))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 1
    data.write_bytes(bytes(raw))
    assert main(["verify", str(item)]) == 2
    err = capsys.readouterr().err
    assert "ChecksumError" in err and os.path.join("40", "default") in err
