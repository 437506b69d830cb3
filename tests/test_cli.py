"""The command line on real checkpoints: list, inspect, verify, export, demo."""

from __future__ import annotations

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_lossy as ol
from orbax_lossy.cli import main
from orbax_lossy.format import data_file_name


def _state(t: int) -> dict:
    w = jnp.sin(jnp.arange(4096, dtype=jnp.float32).reshape(64, 64) * 0.01 + 0.02 * t)
    return {"params": {"a_rather_long_module_name": {"kernel": w}}, "step": t,
            "rng": jax.random.key(t)}


@pytest.fixture
def root(tmp_path) -> pathlib.Path:
    with ol.checkpoint_manager(tmp_path / "ckpt", policy=ol.LeafPolicy.params_only(),
                               base_interval=3, max_to_keep=None) as mngr:
        for t in range(5):
            mngr.save(t, args=ol.LossySave(_state(t)))
    return tmp_path / "ckpt"


def test_list_inspect_verify_accept_root_step_and_item(root, capsys) -> None:
    assert main(["list", str(root)]) == 0
    out = capsys.readouterr().out
    assert "base" in out and "delta" in out and "depends on" in out and "ratio" in out
    outputs = []
    for path, extra in ((root, []), (root / "4", []), (root / "4" / "default", []),
                        (root, ["--step", "4"])):
        assert main(["inspect", str(path), *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert len(set(outputs)) == 1  # the same step, however it is named
    out = outputs[0]
    assert "3 (base) -> 4 (delta)" in out and "lc(bits=3" in out
    assert "rel err = ||reconstruction - value||" in out and "whole state" in out
    assert main(["inspect", str(root), "--step", "1"]) == 0
    assert "0 (base) -> 1 (delta)" in capsys.readouterr().out
    assert main(["verify", str(root)]) == 0
    assert "verified" in capsys.readouterr().out
    assert main(["inspect", str(root), "--step", "9"]) == 2
    assert "no step 9" in capsys.readouterr().err


def test_verify_reports_the_damaged_file(root, capsys) -> None:
    data = root / "3" / "default" / data_file_name(0)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 1
    data.write_bytes(bytes(raw))
    assert main(["verify", str(root)]) == 2
    err = capsys.readouterr().err
    assert "ChecksumError" in err and os.path.join("3", "default") in err


def test_export_is_a_plain_orbax_checkpoint(root, tmp_path, capsys) -> None:
    expected = ol.checkpoint_manager(root).restore(2)
    assert main(["export", str(root), str(tmp_path / "plain"), "--step", "2"]) == 0
    got = ocp.StandardCheckpointer().restore(tmp_path / "plain")
    w = ["params", "a_rather_long_module_name", "kernel"]
    np.testing.assert_array_equal(np.asarray(got[w[0]][w[1]][w[2]]),
                                  np.asarray(expected[w[0]][w[1]][w[2]]))
    assert int(got["step"]) == 2
    np.testing.assert_array_equal(np.asarray(got["rng"]),
                                  np.asarray(jax.random.key_data(expected["rng"])))
    assert main(["export", str(root), str(tmp_path / "plain")]) == 2  # exists: no overwrite
    assert main(["export", str(root), str(tmp_path / "plain"), "--overwrite"]) == 0


@pytest.mark.slow
def test_demo(tmp_path, capsys) -> None:
    assert main(["demo", "--steps", "50", "--every", "10", "--base-interval", "3",
                 "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "deltas alone" in out and "smaller than plain Orbax" in out

