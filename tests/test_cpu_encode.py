"""The numba encode kernels of ``engine/cpu_encode.py`` against the codecs' XLA programs.

The property a restore relies on: the kernel's reconstruction is, bit for bit, what the XLA
decode computes from the stored fields and side arrays (subnormals included). LC in the
linear domain must also reproduce the XLA program's symbols and representatives exactly;
the guard must decide as the XLA program's does; each codec's error bound must hold.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax_lossy as ol
from orbax_lossy.codecs.base import Encoded
from orbax_lossy.engine import cpu_encode, device

CODECS = [ol.LC(1), ol.LC(2), ol.LC(3), ol.LC(8), ol.LC(3, mode="direct"),
          ol.LC(2, domain="log"), ol.LC(4, domain="log"),
          ol.Step(0.05), ol.Step(2.5), ol.Step(4.0, mode="direct"),
          ol.Cluster(1), ol.Cluster(3), ol.Cluster(8), ol.Cluster(3, mode="delta"),
          ol.Cluster(8, mode="delta", iters=4, sample=1024)]
IDS = [str(c).replace(" ", "") for c in CODECS]


def _signed(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    ref = rng.standard_normal(n).astype(np.float32)
    value = ref + (1e-3 * rng.standard_t(3, n)).astype(np.float32)
    unchanged = rng.random(n) < 0.2
    value[unchanged] = ref[unchanged]
    if n >= 16:
        value[:8] = [1e-39, -1e-39, 0.0, -0.0, 3e3, -3e3, 1e-30, 5.0]
        ref[8:12] = [1e-39, -1e-39, 0.0, 2e-39]
    return value, ref


def _nonnegative(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    ref = np.exp(rng.normal(-8, 1.5, n)).astype(np.float32)
    if n >= 16:
        ref[:5] = 0.0  # newborn elements
        ref[5:7] = 1e-39  # subnormal references
    value = (ref * 0.99 + np.exp(rng.normal(-10, 1, n))).astype(np.float32)
    if n >= 16:
        value[7:10] = 0.0
        value[10] = 1e-39
    return value, ref


def _cases() -> list:
    rng = np.random.default_rng(7)
    out = []
    for n in (1, 3, 4095, 4096, 4097, 70_001):
        out.append(pytest.param(*_signed(rng, n), id=f"signed-{n}"))
        out.append(pytest.param(*_nonnegative(rng, n), id=f"nonneg-{n}"))
    out.append(pytest.param(np.zeros(300, np.float32), np.zeros(300, np.float32), id="zeros"))
    out.append(pytest.param(np.full(300, 2.0, np.float32), np.full(300, 1.0, np.float32),
                            id="constant"))
    big = np.float32(1e30) * np.random.default_rng(1).standard_normal(500).astype(np.float32)
    out.append(pytest.param(big, big * np.float32(0.999), id="large"))
    return out


def _xla(codec, value: jax.Array, ref: jax.Array | None) -> dict:
    return device.encode_tree([value], [ref], plan=(codec,), shardings=(value.sharding,))[0]


def _xla_decode(codec, out: dict, ref: jax.Array | None) -> np.ndarray:
    fields = {k: jnp.asarray(v) for k, v in out["fields"].items()}
    side = {k: jnp.asarray(v) for k, v in out["side"].items()}
    return np.asarray(device.decode_tree([fields], [side], [ref], plan=(codec,),
                                         dtypes=(jnp.float32,), shardings=(None,))[0])


def _bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).view(np.uint32)


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
@pytest.mark.parametrize(("value", "reference"), _cases())
def test_kernel_matches_the_xla_program(codec, value: np.ndarray, reference: np.ndarray):
    v = jnp.asarray(value)
    ref = jnp.asarray(reference) if codec.needs_reference else None
    kind = cpu_encode.host_kernel(v, ref, codec)
    assert kind is not None
    host = cpu_encode.encode(v, ref, codec, kind)
    xla = jax.device_get(_xla(codec, v, ref))
    assert bool(host["safe"]) == bool(xla["safe"])
    assert host["recon"].shape == v.shape and host["recon"].dtype == jnp.float32
    if not bool(host["safe"]):  # stored exactly: the value itself, bit for bit
        np.testing.assert_array_equal(_bits(host["recon"]), _bits(value))
        return
    assert host["fields"]["sym"].dtype == np.uint8 and host["fields"]["sym"].shape == v.shape
    # the restore's decode (XLA) reproduces the reconstruction the save keeps as reference
    np.testing.assert_array_equal(_bits(_xla_decode(codec, host, ref)), _bits(host["recon"]))
    if isinstance(codec, ol.LC | ol.Cluster) and codec.domain == "linear":
        np.testing.assert_array_equal(host["fields"]["sym"], xla["fields"]["sym"])
        assert set(host["side"]) == set(xla["side"])
        for name, side in host["side"].items():
            np.testing.assert_array_equal(_bits(side), _bits(xla["side"][name]))
        np.testing.assert_array_equal(_bits(host["recon"]), _bits(xla["recon"]))
    else:  # a step from another summation order, ratios from another log: nearly the same
        agree = np.mean(host["fields"]["sym"] == xla["fields"]["sym"])
        assert agree >= 0.999 or value.size < 1000 and agree >= 0.6
        # (XLA's log(v) - log(r) loses a few ulps of |log v|, the kernels' log(v / r) does not)
        for name, side in host["side"].items():
            np.testing.assert_allclose(side, xla["side"][name], rtol=2e-5, atol=0)
    xla_err = float(xla["rel_error"])
    if np.isfinite(xla_err) and xla_err > 1e-6:
        assert float(host["rel_error"]) == pytest.approx(xla_err, rel=2e-3)
    encoded = Encoded(host["fields"], host["side"], np.asarray(host["recon"]))
    bound = codec.error_bound(value, reference if codec.needs_reference else None, encoded)
    error = np.abs(np.asarray(host["recon"], np.float64) - value.astype(np.float64))
    # the bounds are numpy arithmetic, blind to XLA's flushing of subnormal operands (a
    # subnormal reference is 0 there, so its element is "newborn"): those elements aside
    tiny = np.finfo(np.float32).tiny
    normal = ~(((np.abs(value) < tiny) & (value != 0))
               | ((np.abs(reference) < tiny) & (reference != 0)))
    ok = (error <= bound + 1e-37) | ~normal
    assert np.all(ok), float(np.max((error - bound)[~ok]))


@pytest.mark.parametrize("codec", [ol.LC(3), ol.LC(3, mode="direct"), ol.LC(2, domain="log"),
                                   ol.Step(2.5), ol.Step(4.0, mode="direct"), ol.Cluster(8),
                                   ol.Cluster(3, mode="delta")], ids=str)
@pytest.mark.parametrize("bad", ["nan value", "-inf value", "inf reference", "nan reference",
                                 "overflowing delta", "negative recon"])
def test_guard_decides_as_the_xla_program(codec, bad: str):
    rng = np.random.default_rng(3)
    ref = np.abs(rng.standard_normal(1000)).astype(np.float32) + 1
    value = ref * np.float32(1.01)
    if bad == "nan value":
        value[17] = np.nan
    elif bad == "-inf value":
        value[400] = -np.inf
    elif bad == "inf reference":
        ref[3] = np.inf
    elif bad == "nan reference":
        ref[999] = np.nan
    elif bad == "overflowing delta":
        value[5], ref[5] = np.float32(3e38), np.float32(-3e38)
    else:  # a large decrease on a non-negative leaf: Step would decode it below zero
        value[9] = np.float32(1e-3)
        ref[9] = np.float32(400.0)
    v, r = jnp.asarray(value), jnp.asarray(ref) if codec.needs_reference else None
    host = cpu_encode.encode(v, r, codec, cpu_encode.host_kernel(v, r, codec))
    xla = jax.device_get(_xla(codec, v, r))
    assert bool(host["safe"]) == bool(xla["safe"]), bad
    if not bool(host["safe"]):
        np.testing.assert_array_equal(_bits(host["recon"]), _bits(value))
        assert float(host["rel_error"]) == 0.0


def test_subnormal_probe_matches_xla():
    """The kernels flush subnormals exactly when XLA:CPU does (it does on x86 and arm)."""
    a = jnp.asarray(np.asarray([1e-39, 2e-39], np.float32))
    flushed = float(np.asarray(jax.jit(lambda x: x + x)(a))[0]) == 0.0
    assert cpu_encode.xla_flushes_subnormals() == flushed


def test_which_leaves_take_the_kernel(monkeypatch):
    x = jnp.ones((64,), jnp.float32)
    assert cpu_encode.host_kernel(x, x, ol.LC(3)) is not None
    assert cpu_encode.host_kernel(x, None, ol.Step(4.0, mode="direct")) is not None
    assert cpu_encode.host_kernel(x, None, ol.LC(3)) is None  # a delta without reference
    assert cpu_encode.host_kernel(x.astype(jnp.bfloat16), x, ol.LC(3)) is None
    assert cpu_encode.host_kernel(x, None, ol.Cluster(8)) is not None
    assert cpu_encode.host_kernel(x, x, ol.Cluster(3, mode="delta")) is not None
    assert cpu_encode.host_kernel(x, None, ol.Cluster(4, domain="log")) is None
    assert cpu_encode.host_kernel(x, x, ol.Uniform(4)) is None
    assert cpu_encode.host_kernel(x, x[:32], ol.LC(3)) is None
    monkeypatch.setenv(cpu_encode.ENV, "0")
    assert cpu_encode.host_kernel(x, x, ol.LC(3)) is None


def test_saved_chain_is_identical_with_and_without_kernels(tmp_path, monkeypatch):
    """LC and linear Cluster saves write the same bytes through the kernels as through XLA;
    Step and log saves restore to the handler's reference bit for bit."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 300)).astype(np.float32)
    states = []
    for _ in range(4):
        w = w + (1e-2 * rng.standard_normal(w.shape)).astype(np.float32)
        states.append({"w": jnp.asarray(w), "nu": jnp.asarray(w * w + 1e-6),
                       "mu": jnp.asarray(0.1 * w)})
    policies = {
        "lc": ol.LeafPolicy.create(rules=[(r"nu", ol.LC(3)), (r"mu", ol.LC(3, mode="direct"))],
                                   defaults={"param": ol.LC(3)},
                                   base_defaults={"param": ol.Exact()}),
        "default": ol.LeafPolicy.create(rules=[(r"nu", ol.LC(2, domain="log")),
                                               (r"mu", ol.Step(4.0, mode="direct"))],
                                        defaults={"param": ol.Step(2.5)},
                                        base_defaults={"param": ol.Exact()}),
        "cluster": ol.LeafPolicy.create(rules=[(r"mu", ol.Cluster(4))],
                                        defaults={"param": ol.Cluster(3, mode="delta")},
                                        base_defaults={"param": ol.Cluster(8)}),
    }
    for name, policy in policies.items():
        payloads = {}
        for env in ("1", "0"):
            monkeypatch.setenv(cpu_encode.ENV, env)
            root = tmp_path / f"{name}-{env}"
            handler = ol.LossyCheckpointHandler(policy, base_interval=10)
            mngr = ol.checkpoint_manager(root, handler=handler, max_to_keep=10)
            for step, state in enumerate(states):
                mngr.save(step, args=ol.LossySave(state))
            mngr.wait_until_finished()
            expected = {k: np.asarray(v) for k, v in
                        zip(("mu", "nu", "w"), handler.reference.values, strict=True)}
            mngr.close()
            fresh = ol.checkpoint_manager(root, max_to_keep=10)
            restored = fresh.restore(3)
            fresh.close()
            for key, value in expected.items():
                np.testing.assert_array_equal(_bits(restored[key]), _bits(value), err_msg=key)
            payloads[env] = [(root / str(step) / "default" / "data.p0.bin").read_bytes()
                             for step in range(len(states))]
        if name in ("lc", "cluster"):
            assert payloads["1"] == payloads["0"]



@pytest.mark.parametrize("domain", ["linear", "log"])
@pytest.mark.parametrize("subnormal", [False, True], ids=["normal", "subnormal"])
def test_widths_sharing_one_statistics_pass_encode_as_each_alone(domain: str, subnormal: bool):
    """``encode_lc_widths`` (an adaptive policy's whole-leaf trials) gives, per width, what
    ``encode`` gives for that codec alone, bit for bit."""
    rng = np.random.default_rng(12)
    ref = np.exp(rng.normal(-8, 2, 5000)).astype(np.float32)
    value = ref * np.exp(rng.normal(0, 0.1, ref.size)).astype(np.float32)
    if subnormal:
        value[7], ref[11] = np.float32(1e-39), np.float32(2e-39)
    v, r = jnp.asarray(value), jnp.asarray(ref)
    codecs = [ol.LC(b, domain=domain) for b in (2, 3, 4)]
    kind = cpu_encode.host_kernel(v, r, codecs[0])
    shared = list(cpu_encode.encode_lc_widths(v, r, codecs, kind))
    assert len(shared) == len(codecs)
    for codec, got in zip(codecs, shared, strict=True):
        alone = cpu_encode.encode(v, r, codec, kind)
        assert bool(got["safe"]) == bool(alone["safe"])
        assert float(got["rel_error"]) == float(alone["rel_error"])
        np.testing.assert_array_equal(got["fields"]["sym"], alone["fields"]["sym"])
        np.testing.assert_array_equal(_bits(got["recon"]), _bits(alone["recon"]))
        assert got["side"].keys() == alone["side"].keys()
        for name in alone["side"]:
            np.testing.assert_array_equal(_bits(got["side"][name]), _bits(alone["side"][name]))


@pytest.mark.parametrize("codec", [ol.LC(3), ol.LC(3, mode="direct")], ids=str)
def test_a_non_finite_element_in_a_later_range_is_seen(codec):
    """A leaf split over the cores' ranges (``SPLIT_ELEMENTS``): a NaN in the last range
    makes the save store it exactly, as XLA's guard decides."""
    n = 2 * cpu_encode.SPLIT_ELEMENTS + 7
    rng = np.random.default_rng(5)
    ref = rng.standard_normal(n).astype(np.float32)
    value = ref + np.float32(1e-3)
    value[n - 2] = np.nan
    v, r = jnp.asarray(value), jnp.asarray(ref)
    host = cpu_encode.encode(v, r, codec, cpu_encode.host_kernel(v, r, codec))
    assert not bool(host["safe"])
    assert not bool(jax.device_get(_xla(codec, v, r if codec.needs_reference else None))["safe"])


def test_kernel_cache_key_tells_constants_apart():
    """Kernels of other constants (here: the inlined helper's ``nonnegative``) get other
    cache keys; the same constants the same key."""
    from orbax_lossy.engine.kernel_cache import describe

    def key(*flags):
        return describe(cpu_encode.lc_write_kernel(cpu_encode.LC_DELTA, *flags).py_func)

    assert key(False, False, True, True) == key(False, False, True, True)
    assert len({key(False, False, nonneg, lift) for nonneg in (False, True)
                for lift in (False, True)}) == 4
    assert key(False, False, True, True) != key(True, False, True, True)


def test_kernel_cache_key_sees_constants_and_globals_the_bytecode_does_not():
    """Two kernels with the same bytecode get other keys when a literal constant differs,
    or a module global they read (numba compiles its value in) holds another value."""
    import types

    from orbax_lossy.engine.kernel_cache import describe

    def scaled(x):
        return x * 0.5

    def scaled_more(x):
        return x * 0.25

    assert scaled.__code__.co_code == scaled_more.__code__.co_code
    assert describe(scaled) != describe(scaled_more)

    source = "def kernel(x):\n    return x * SCALE + helper(x)\n"

    def build(scale, offset):
        scope = {"SCALE": scale}
        exec(f"def helper(x):\n    return x + {offset}\n", scope)
        exec(source, scope)
        return scope["kernel"]

    assert describe(build(2.0, 1)) == describe(build(2.0, 1))
    assert describe(build(2.0, 1)) != describe(build(3.0, 1))  # a global's value
    assert describe(build(2.0, 1)) != describe(build(2.0, 2))  # a helper's constant
    assert isinstance(build(2.0, 1), types.FunctionType)


_CACHE_PROBE = """
import gc, json
import jax.numpy as jnp, numpy as np
import orbax_lossy as ol
from numba.core.registry import CPUDispatcher
from orbax_lossy.engine import cpu_encode
rng = np.random.default_rng(0)
ref = rng.standard_normal(4096).astype(np.float32)
value = ref + 1e-3 * rng.standard_normal(4096).astype(np.float32)
for codec in [ol.LC(3), ol.LC(3, mode="direct"), ol.LC(2, domain="log"), ol.Step(0.05),
              ol.Cluster(3)]:
    log = getattr(codec, "domain", "linear") == "log"
    v = jnp.asarray(np.abs(value) if log else value)
    r = jnp.asarray(np.abs(ref) if log else ref)
    kind = cpu_encode.host_kernel(v, r if codec.needs_reference else None, codec)
    assert kind is not None, codec
    cpu_encode.encode(v, r if codec.needs_reference else None, codec, kind)
stats = {}
for obj in gc.get_objects():
    if isinstance(obj, CPUDispatcher) and obj.py_func.__module__ == cpu_encode.__name__:
        s = obj.stats
        if s.cache_hits or s.cache_misses:
            stats[obj.py_func.__qualname__] = [sum(s.cache_hits.values()),
                                               sum(s.cache_misses.values())]
print(json.dumps(stats))
"""


@pytest.mark.slow
def test_encode_kernels_load_from_the_disk_cache_in_a_new_process(tmp_path):
    """The kernels compiled per set of constants (closures over an inlined ``@njit``
    function) are keyed the same in every process (``kernel_cache``): a second process
    loads every one of them from numba's cache, compiling none (before, each process
    compiled them all again, ~2 s per kernel on the commit path)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "ORBAX_LOSSY_WARMUP": "0"}

    def run() -> dict[str, list[int]]:
        out = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    first = run()
    closures = [name for name in first if ".<locals>." in name]
    assert len(closures) >= 4, first  # LC statistics and write, Step and Cluster writes
    assert all(misses > 0 for _, misses in first.values()), first
    second = run()
    assert second.keys() == first.keys()
    for name, (hits, misses) in second.items():
        assert misses == 0 and hits > 0, (name, second)


@pytest.mark.parametrize("cores", [1, 2, 3, 16])
def test_ranges_cover_the_leaf_one_per_core_and_split(monkeypatch, cores: int) -> None:
    split = cpu_encode.SPLIT_ELEMENTS
    monkeypatch.setattr(cpu_encode, "available_cores", lambda: cores)
    for n in [0, 1, split - 1, split, 2 * split - 1, 2 * split, 2 * split + 1, 5 * split + 7]:
        ranges = cpu_encode._ranges(n)
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert len(ranges) == min(cores, max(1, n // split)), (n, cores, ranges)
