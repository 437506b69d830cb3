"""Device programs: one per class of leaves for saves, dispatched on the leaf pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax_lossy as ol
from orbax_lossy.engine import cpu_encode, device


def _pairs(n: int, rng: np.random.Generator) -> dict:
    """``n`` matrices and ``n`` weakly typed vectors (``jnp.full`` of a Python float)."""
    return {"params": {**{f"w{i}": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
                          for i in range(n)},
                       **{f"b{i}": jnp.full((8,), 0.5) for i in range(n)}}}


def test_saves_compile_one_program_per_class_of_leaves(tmp_path, monkeypatch) -> None:
    """The encode programs are cached per class of leaves (shape, dtype, sharding, codec), so
    a tree with 3x the leaves of the same classes compiles nothing new, and weakly typed
    leaves (copied at a first save, held without a copy later, restored strong) do not
    compile their programs again either. (The XLA path, as on GPU/TPU: the CPU kernels of
    float32 LC/Step leaves are off here.)"""
    monkeypatch.setenv(cpu_encode.ENV, "0")
    rng = np.random.default_rng(1)
    device.encode_tree.clear_cache()
    counts = []
    for n in (4, 12):
        state = _pairs(n, rng)
        assert all(x.weak_type for k, x in state["params"].items() if k.startswith("b"))
        mngr = ol.checkpoint_manager(tmp_path / str(n), max_to_keep=None)
        for step in range(4):
            state = jax.tree.map(lambda x, d=1e-3 * (step + 1): x + d, state)
            mngr.save(step, args=ol.LossySave(state))
            mngr.wait_until_finished()
            counts.append(device.encode_tree._cache_size())
        restored = mngr.restore(3)
        mngr.save(4, args=ol.LossySave(jax.tree.map(lambda x: x + 1e-3, restored)))
        mngr.wait_until_finished()
        counts.append(device.encode_tree._cache_size())
        mngr.close()
    # base: Cluster(8) on both shapes; deltas: Cluster(3, delta) on both shapes
    assert counts == [2] + [4] * 9, counts


def test_per_leaf_programs_run_on_the_leaf_pool_and_their_failures_surface(
        tmp_path, monkeypatch, assert_bitwise) -> None:
    """A single-process save runs its per-leaf encode programs on the leaf pool's threads
    (not one after another on the commit thread); an exception in one of them fails that
    save in ``wait_until_finished`` and the next save is a base that restores. (The XLA
    programs: the CPU kernels are off; their failures: the next test.)"""
    import threading

    monkeypatch.setenv(cpu_encode.ENV, "0")

    from orbax_lossy.format.manifest import read_manifest

    rng = np.random.default_rng(2)
    state = _pairs(6, rng)
    threads: set[str] = set()
    real = device.encode_tree
    fail = {"on": False}

    def recording(values, references, **statics):
        threads.add(threading.current_thread().name)
        if fail["on"] and values[0].shape == (8,):
            raise RuntimeError("injected encode failure")
        return real(values, references, **statics)

    monkeypatch.setattr(device, "encode_tree", recording)
    mngr = ol.checkpoint_manager(tmp_path, max_to_keep=None,
                                 policy=ol.LeafPolicy.create(base_defaults={"param": ol.Exact()}))
    mngr.save(0, args=ol.LossySave(state))
    mngr.wait_until_finished()
    assert threads and all(t.startswith("orbax_lossy_encode") for t in threads), threads
    fail["on"] = True
    mngr.save(1, args=ol.LossySave(jax.tree.map(lambda x: x + 1e-3, state)))
    with pytest.raises(RuntimeError, match="injected encode failure"):
        mngr.wait_until_finished()
    fail["on"] = False
    later = jax.tree.map(lambda x: x + 2e-3, state)
    mngr.save(2, args=ol.LossySave(later))
    mngr.wait_until_finished()
    assert read_manifest(tmp_path / "2" / "default").header.save_type == "base"
    restored = mngr.restore(2)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(later), strict=True):
        assert_bitwise(np.asarray(a), np.asarray(b))
    mngr.close()


def test_cpu_kernels_run_on_the_leaf_pool_and_their_failures_surface(
        tmp_path, monkeypatch, assert_bitwise) -> None:
    """On CPU, float32 LC/Step leaves take the numba kernels, on the leaf pool's threads, and
    compile no XLA encode program; an exception in a kernel fails that save in
    ``wait_until_finished`` and the next save is a base that restores."""
    import threading

    from orbax_lossy.format.manifest import read_manifest

    rng = np.random.default_rng(2)
    state = {"params": {f"w{i}": jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
                        for i in range(4)}}
    threads: set[str] = set()
    real = cpu_encode.encode
    fail = {"on": False}

    def recording(value, reference, codec, kind):
        threads.add(threading.current_thread().name)
        if fail["on"]:
            raise RuntimeError("injected kernel failure")
        return real(value, reference, codec, kind)

    monkeypatch.setattr(cpu_encode, "encode", recording)
    policy = ol.LeafPolicy.create(defaults={"param": ol.LC(3)},
                                  base_defaults={"param": ol.Exact()})
    mngr = ol.checkpoint_manager(tmp_path, max_to_keep=None, policy=policy)
    mngr.save(0, args=ol.LossySave(state))
    mngr.wait_until_finished()
    device.encode_tree.clear_cache()
    mngr.save(1, args=ol.LossySave(jax.tree.map(lambda x: x + 1e-3, state)))
    mngr.wait_until_finished()
    assert device.encode_tree._cache_size() == 0  # every delta leaf took a kernel
    assert threads and all(t.startswith("orbax_lossy_encode") for t in threads), threads
    fail["on"] = True
    mngr.save(2, args=ol.LossySave(jax.tree.map(lambda x: x + 2e-3, state)))
    with pytest.raises(RuntimeError, match="injected kernel failure"):
        mngr.wait_until_finished()
    fail["on"] = False
    later = jax.tree.map(lambda x: x + 3e-3, state)
    mngr.save(3, args=ol.LossySave(later))
    mngr.wait_until_finished()
    assert read_manifest(tmp_path / "3" / "default").header.save_type == "base"
    restored = mngr.restore(3)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(later), strict=True):
        assert_bitwise(np.asarray(a), np.asarray(b))
    mngr.close()


_ORDERED = r"""
import os, sys, json, threading
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
# every leaf through the XLA encode programs (on CPU the host kernels would take the
# single-device float32 leaves, and this test is about the programs' dispatch)
os.environ["ORBAX_LOSSY_HOST_ENCODE"] = "0"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import orbax_lossy as ol
from orbax_lossy.engine import device
threads, real = [], device.encode_tree
def recording(values, references, **statics):
    threads.append(threading.current_thread().name)
    return real(values, references, **statics)
device.encode_tree = recording
mesh = Mesh(np.array(jax.devices()), ("a",))
out = {}
for name, sharded in (("single", False), ("sharded", True)):
    state = {f"v{i}": jnp.full((8, 16), float(i + 1)) for i in range(4)}
    if sharded:
        state["w"] = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("a")))
    mngr = ol.checkpoint_manager(os.path.join(sys.argv[1], name))
    threads.clear()
    for step in range(2):
        mngr.save(step, args=ol.LossySave(jax.tree.map(lambda x: x * (1 + step / 8), state)))
        mngr.wait_until_finished()
    restored = mngr.restore(1)
    assert set(restored) == set(state)
    out[name] = sorted({"pool" if t.startswith("orbax_lossy_encode") else t for t in threads})
    mngr.close()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_programs_over_several_devices_are_dispatched_in_one_order(tmp_path,
                                                                   run_cpu_script) -> None:
    """A tree with a leaf sharded over several devices (its program has collectives) runs
    every encode program on one thread in leaf order; a tree of single-device leaves uses
    the leaf pool."""
    import json

    stdout = run_cpu_script(["-c", _ORDERED, str(tmp_path)])
    threads = json.loads(stdout.strip().splitlines()[-1])
    assert threads["single"] == ["pool"], threads
    assert "pool" not in threads["sharded"] and len(threads["sharded"]) >= 1, threads
