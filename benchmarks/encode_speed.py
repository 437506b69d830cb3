"""Throughput of the jitted on-device encode programs alone (issue 10).

For 64 MB and 256 MB float32 leaves (a realistic delta: a reference plus a small gaussian
update) times, after a warm-up compile, ``jax.jit(codec.encode)`` and the save program
``engine.device.encode_tree`` (the encode plus the guard and the error, as
``benchmarks/speed.py --encode-only`` measures it) for Step(2.5) delta, Step(4.0) direct,
LC(3) delta, LC(2, domain="log") on a positive leaf, LC(3, mode="direct") and
Cluster(3, mode="delta"), and prints GB/s of input (median of ``--repeats``).

``--against REV`` also loads ``lc.py``, ``cluster.py`` and ``step.py`` from git revision
``REV`` and times the old and the new programs alternately in the same run (the CPUs are
shared, so only figures measured side by side compare), checking that their outputs are
bit-identical.

    python benchmarks/encode_speed.py [--sizes 64,256] [--repeats 7] [--against HEAD~1]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs import base
from orbax_lossy.codecs import cluster as new_cluster
from orbax_lossy.codecs import lc as new_lc
from orbax_lossy.codecs import step as new_step
from orbax_lossy.engine import device

MB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_revision(rev: str, path: str, name: str) -> ModuleType:
    """The module at ``path`` (repository-relative) as of git revision ``rev``."""
    source = subprocess.run(
        ["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, f.name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    registry = dict(base._REGISTRY)  # the old class reuses the codec id: register it aside
    base._REGISTRY.clear()
    try:
        spec.loader.exec_module(module)
    finally:
        base._REGISTRY.clear()
        base._REGISTRY.update(registry)
        os.unlink(f.name)
    return module


def codecs(lc: ModuleType, cl: ModuleType, st: ModuleType) -> dict[str, Any]:
    """The benchmarked configurations, built from the given ``lc``, ``cluster`` and ``step``
    modules (the default policy's codecs: ``Step(2.5)`` parameter deltas, ``Step(4.0)`` direct
    first moments, ``LC(2, log)`` second moments)."""
    return {
        "Step(2.5) delta": st.Step(2.5),
        "Step(4.0) direct": st.Step(4.0, mode="direct"),
        "LC(3) delta": lc.LC(3),
        "LC(2, log) delta": lc.LC(2, domain="log"),
        "LC(3) direct": lc.LC(3, mode="direct"),
        "Cluster(3) delta": cl.Cluster(3, mode="delta"),
    }


def inputs(mb: int, positive: bool) -> tuple[jax.Array, jax.Array]:
    """``(value, reference)`` of ``mb`` MB float32: reference + 1e-3 gaussian update."""
    n = mb * MB // 4
    ref = jax.random.normal(jax.random.key(0), (n // 1024, 1024), jnp.float32)
    upd = 1e-3 * jax.random.normal(jax.random.key(1), ref.shape, jnp.float32)
    if positive:  # a second moment: positive, multiplicative update
        ref = jnp.square(ref) + 1e-8
        return jax.block_until_ready((ref * (1 + upd), ref))
    return jax.block_until_ready((ref + upd, ref))


def programs(codec: Any) -> dict[str, Callable[[jax.Array, jax.Array], Any]]:
    """The encode alone and the whole save program of ``codec``, both jitted."""
    plan = {"plan": (codec,), "shardings": (None,)}
    return {
        "encode": jax.jit(codec.encode),
        "encode_tree": lambda v, r: device.encode_tree([v], [r], **plan),
    }


def time_once(fn: Callable[..., Any], *args: Any) -> float:
    """Seconds of one call, until its outputs are ready."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def same_bits(a: Any, b: Any) -> bool:
    """Whether two output pytrees are bit-identical (NaN-safe, byte comparison)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb, strict=True)
    )


def main() -> None:
    """Print GB/s per codec, program and size (old and new side by side with ``--against``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="64,256", help="leaf sizes in MB")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs (median)")
    parser.add_argument("--against", default=None, help="git revision of the old codecs")
    parser.add_argument("--only", default=None, help="comma list of codec names to run")
    parser.add_argument("--program", default="encode,encode_tree", help="programs to time")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs")
    versions = {"new": codecs(new_lc, new_cluster, new_step)}
    if args.against:
        old_lc = load_revision(args.against, "orbax_lossy/codecs/lc.py", "_old_lc")
        old_cl = load_revision(args.against, "orbax_lossy/codecs/cluster.py", "_old_cluster")
        old_st = load_revision(args.against, "orbax_lossy/codecs/step.py", "_old_step")
        versions = {"old": codecs(old_lc, old_cl, old_st), **versions}
    names = list(versions["new"])
    if args.only:
        names = [n for n in names if any(o.strip() in n for o in args.only.split(","))]
    for mb in (int(s) for s in args.sizes.split(",")):
        for name in names:
            value, ref = inputs(mb, positive="log" in name)
            for prog in args.program.split(","):
                fns = {ver: programs(cs[name])[prog] for ver, cs in versions.items()}
                outs = {ver: jax.block_until_ready(fn(value, ref)) for ver, fn in fns.items()}
                identical = ""
                if "old" in outs:
                    identical = "  identical" if same_bits(outs["old"], outs["new"]) else (
                        "  OUTPUTS DIFFER")
                del outs
                times: dict[str, list[float]] = {ver: [] for ver in fns}
                for _ in range(args.repeats):
                    for ver, fn in fns.items():
                        times[ver].append(time_once(fn, value, ref))
                figures = "  ".join(
                    f"{ver} {value.nbytes / statistics.median(t) / 1e9:6.3f} GB/s"
                    for ver, t in times.items()
                )
                print(f"{mb:4d} MB  {name:18s} {prog:12s} {figures}{identical}", flush=True)
            del value, ref


if __name__ == "__main__":
    main()
