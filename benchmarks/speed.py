"""Speed of orbax-lossy against plain Orbax (issue 10), interleaved in one process.

State: float32 ``params`` plus Adam-like ``opt_state/mu`` and ``opt_state/nu`` trees (a third
of the bytes each) that evolve between saves (params move slightly, mu/nu follow a gradient).
For every size and config a ``CheckpointManager`` saves a base and 9 deltas; configs take turns
at every step (after a warm-up run of each), so machine noise hits all of them alike.

Printed per size and config (medians; ratio = lossy / plain Orbax in the same run):

* ``block base`` / ``block delta``: time ``save()`` blocks;
* ``async_save``: of that, the time inside the lossy handler's ``async_save`` (delta saves;
  the rest is Orbax's manager and the chain-aware retention policy); its ratio is to plain
  Orbax's whole ``block delta``;
* ``fresh base`` / ``fresh delta``: the same for the first two saves of a fresh process (run in
  a subprocess: compilation and numba caches cold, unless the persistent caches are on);
* ``after restore``: ``save()`` blocking right after restoring the chain's newest step;
* ``commit delta`` / ``commit base``: ``save()`` call to committed (``wait_until_finished``),
  the median of the 9 delta saves / of the run's base and ``--bases`` more base saves after
  the chain (``LossySave(force_base=True)``; plain Orbax saves as always), configs taking
  turns and the state evolving between them as before (programs compiled in the warm-up; a
  base codes every leaf whole, with the policy's base codecs); ``block base`` is the median
  of the same saves;
* ``restore``: restore of the newest step of the 9-delta chain in a fresh manager (after an
  untimed restore of the same step, so the decode programs are compiled);
* ``fresh restore``: the same restore as the first of a fresh process (a subprocess, as a
  job restarted after a failure restores: decode programs compiled and numba kernels loaded
  inside it; the Python imports and the target's construction are not timed);
* ``fresh restore mf``: the same, with the manager created before the target is built (as a
  training script creates its manager, then its state: the lossy handler's background
  warm-up of numba's kernels overlaps the state's construction);
* ``RSS save`` / ``RSS restore``: peak extra resident memory (sampled every ms) over the
  process's RSS before the call, during a delta save+commit and during the restore.

Also the device encode throughput of the jitted program alone for LC(3) float32.

Where a size's configs would not fit the machine's available memory in one process (1 GB with
three configs on 24 GB: :func:`config_groups`), they run in groups, one process and one table
each, every table with its own plain Orbax rows.

    python benchmarks/speed.py                 # 64 MB and 256 MB
    python benchmarks/speed.py --sizes 64,256,1024 --configs default,lc
    python benchmarks/speed.py --sizes 64 --leaves 120   # 360 leaves, as a 12-layer model
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import orbax_lossy as ol

MB = 1 << 20
#: leaves per tree (params, mu, nu): ``--leaves`` (the environment carries it to the
#: fresh-process children); many small leaves show per-leaf costs that 4 big ones hide
LEAVES_PER_TREE = int(os.environ.get("ORBAX_LOSSY_SPEED_LEAVES", "4"))
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------- state


def make_state(total_bytes: int, seed: int = 0) -> dict[str, Any]:
    """params + mu + nu, each ``total_bytes / 3`` split over LEAVES_PER_TREE 2-D leaves."""
    per_leaf = max(total_bytes // (3 * LEAVES_PER_TREE * 4), 1024)
    cols = 1024
    rows = max(per_leaf // cols, 1)
    keys = jax.random.split(jax.random.key(seed), 3 * LEAVES_PER_TREE)
    params, mu, nu = {}, {}, {}
    for j in range(LEAVES_PER_TREE):
        name = f"layer_{j}"
        params[name] = 0.05 * jax.random.normal(keys[3 * j], (rows, cols), jnp.float32)
        g = 1e-3 * jax.random.normal(keys[3 * j + 1], (rows, cols), jnp.float32)
        mu[name] = 0.1 * g
        nu[name] = 1e-3 * jnp.square(g)
    return {"params": params, "opt_state": {"mu": mu, "nu": nu}}


@jax.jit
def _evolve(state: dict[str, Any], key: jax.Array) -> dict[str, Any]:
    p, mu, nu = state["params"], state["opt_state"]["mu"], state["opt_state"]["nu"]
    out_p, out_mu, out_nu = {}, {}, {}
    for j, name in enumerate(sorted(p)):
        k = jax.random.fold_in(key, j)
        g = 1e-3 * jax.random.normal(k, p[name].shape, jnp.float32)
        m = 0.9 * mu[name] + 0.1 * g
        v = 0.999 * nu[name] + 0.001 * jnp.square(g)
        out_p[name] = p[name] - 1e-3 * m / (jnp.sqrt(v) + 1e-8)
        out_mu[name], out_nu[name] = m, v
    return {"params": out_p, "opt_state": {"mu": out_mu, "nu": out_nu}}


def evolve(state: dict[str, Any], step: int) -> dict[str, Any]:
    """A few optimizer steps' worth of change (outside every timed region)."""
    return jax.block_until_ready(_evolve(state, jax.random.key(1000 + step)))


# ---------------------------------------------------------------------------- configs


def lossy_policy(config: str) -> ol.Policy | None:
    if config == "default":
        return None  # ol.checkpoint_manager's default: LeafPolicy() (docs/whole_state.md)
    if config == "lc":
        return ol.LeafPolicy.create(defaults={
            "param": ol.LC(3), "first_moment": ol.LC(3),
            "second_moment": ol.LC(3, domain="log")})
    if config == "adaptive":
        return ol.AdaptivePolicy.create()
    raise SystemExit(f"unknown config {config!r}")


class TimedHandler(ol.LossyCheckpointHandler):
    """The lossy handler, timing its own ``async_save`` (the rest of ``save()`` is Orbax's
    manager and the retention policy)."""

    async def async_save(self, directory: Any, args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await super().async_save(directory, args)
        finally:
            self.async_save_s = time.perf_counter() - t0


class Config:
    """One manager per config: a save, its args and a restore."""

    def __init__(self, name: str, directory: str, base_interval: int) -> None:
        self.name = name
        self.directory = directory
        self.base_interval = base_interval
        self.mngr = self.manager()

    def manager(self) -> ocp.CheckpointManager:
        if self.name == "plain":
            return ocp.CheckpointManager(self.directory)
        self.handler = TimedHandler(lossy_policy(self.name), base_interval=self.base_interval)
        return ol.checkpoint_manager(self.directory, handler=self.handler, max_to_keep=None)

    def save_args(self, state: Any, force_base: bool = False) -> Any:
        if self.name == "plain":
            return ocp.args.StandardSave(state)
        return ol.LossySave(state, force_base=force_base)

    def restore_args(self, target: Any) -> Any:
        return (ocp.args.StandardRestore(target) if self.name == "plain"
                else ol.LossyRestore(target))

    def fresh(self) -> None:
        self.mngr.close()
        self.mngr = self.manager()


# ---------------------------------------------------------------------------- measuring


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Peak RSS above the value at entry, sampled every millisecond in a thread."""

    def __enter__(self) -> PeakRSS:
        self.start = rss()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def timed_save(cfg: Config, step: int, state: Any, force_base: bool = False
               ) -> dict[str, float]:
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        cfg.mngr.save(step, args=cfg.save_args(state, force_base), force=True)
        t1 = time.perf_counter()
        cfg.mngr.wait_until_finished()
        t2 = time.perf_counter()
    handler = getattr(cfg, "handler", None) if cfg.name != "plain" else None
    return {"block": t1 - t0, "commit": t2 - t0, "rss": mem.extra,
            "handler": handler.async_save_s if handler is not None else float("nan")}


def timed_restore(cfg: Config, step: int, target: Any) -> tuple[dict[str, float], Any]:
    cfg.fresh()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        restored = jax.block_until_ready(cfg.mngr.restore(step, args=cfg.restore_args(target)))
        t1 = time.perf_counter()
    return {"restore": t1 - t0, "rss_restore": mem.extra}, restored


def first_touch_ms_per_mb(mb: int = 256) -> tuple[float, float]:
    """Milliseconds per MB to touch fresh anonymous memory (one write per page): twice, the
    second right after the first was unmapped.

    On a virtual machine whose host backs guest memory lazily and takes freed pages back
    (a balloon's free page reporting, DAMON ``pageout``), a first touch faults on the host
    too: on the 2-core benchmark machine 4-9 ms per MB against ~0.1 ms right after a touch
    of the same size, and freed memory turns cold again within seconds. Every timing below
    that allocates memory pays this, plain Orbax's as much as ours, which is why the two are
    interleaved and compared as ratios in one run; the line records what the machine did.
    """
    out = []
    for _ in range(2):
        region = mmap.mmap(-1, mb * MB)
        try:
            pages = np.frombuffer(region, np.uint8)
            t0 = time.perf_counter()
            pages[::mmap.PAGESIZE] = 1
            out.append((time.perf_counter() - t0) * 1e3 / mb)
            del pages
        finally:
            region.close()
    return out[0], out[1]


def device_encode_gbps(mb: int = 64, repeats: int = 9, path: str = "xla") -> float:
    """GB/s of input through the LC(3) float32 delta encode of one leaf alone: the jitted XLA
    program (``path="xla"``), or what a save runs for it (``"save"``: on CPU the numba
    kernels of ``engine/cpu_encode.py``, elsewhere the same XLA program)."""
    from orbax_lossy.engine import device, save

    n = mb * MB // 4
    ref = jax.random.normal(jax.random.key(0), (n // 1024, 1024), jnp.float32)
    value = ref + 1e-3 * jax.random.normal(jax.random.key(1), ref.shape, jnp.float32)

    def run() -> None:
        if path == "xla":
            jax.block_until_ready(device.encode_tree([value], [ref], plan=(ol.LC(3),),
                                                     shardings=(None,)))
        else:
            out, copies = save._encode_leaf(value, ref, ol.LC(3), value.sharding)
            jax.block_until_ready(out["recon"])
            [c.result() for shards in copies.values() for _, c in shards]

    run()  # compiles (XLA program, or loads the numba kernels)
    times = []
    for _ in range(repeats):  # the median of several: this shared machine's runs vary 2x
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return value.nbytes / statistics.median(times) / 1e9


# ---------------------------------------------------------------------------- fresh process


def fresh_child(config: str, size_mb: int, directory: str) -> None:
    """In a subprocess: the first base and first delta save of a fresh process."""
    state = make_state(size_mb * MB)
    cfg = Config(config, directory, base_interval=10)
    out = {}
    for step, kind in ((0, "base"), (1, "delta")):
        if step:
            state = evolve(state, step)
        t0 = time.perf_counter()
        cfg.mngr.save(step, args=cfg.save_args(state), force=True)
        out[kind] = time.perf_counter() - t0
        cfg.mngr.wait_until_finished()
    cfg.mngr.close()
    print("RESULT " + json.dumps(out))


def restore_child(config: str, size_mb: int, directory: str, manager_first: bool = False) -> None:
    """In a subprocess: restore the newest step of ``directory`` (a fresh process's first
    restore, as after a failure: decode programs compiled, numba kernels loaded on the way).
    ``manager_first``: the manager is created before the target is built, as a training
    script creates it before its state (the handler's background warm-up then overlaps it)."""
    if manager_first:
        cfg = Config(config, directory, base_interval=10)
        target = make_state(size_mb * MB)
    else:
        target = make_state(size_mb * MB)
        cfg = Config(config, directory, base_interval=10)
    step = cfg.mngr.latest_step()
    t0 = time.perf_counter()
    jax.block_until_ready(cfg.mngr.restore(step, args=cfg.restore_args(target)))
    out = {"restore": time.perf_counter() - t0}
    cfg.mngr.close()
    print("RESULT " + json.dumps(out))


def child(mode: str, config: str, size_mb: int, directory: str) -> dict[str, float]:
    """Run ``--<mode>-child`` in a new Python process and return what it measured."""
    proc = subprocess.run(
        [sys.executable, __file__, f"--{mode}-child", config, str(size_mb), directory],
        capture_output=True, text=True, check=False, timeout=1800,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{mode} child failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def fresh_process(config: str, size_mb: int, root: str) -> dict[str, float]:
    directory = os.path.join(root, f"fresh-{config}-{size_mb}")
    try:
        return child("fresh", config, size_mb, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------------------- memory

#: what a :func:`run_size` takes from the machine's available memory at its peak, in states
#: (conservative; the page cache of the checkpoints it writes is counted as available): this
#: much for the states it evolves, plain Orbax and a restore child ...
RUN_STATES = 6.0
#: ... and this much more per lossy config (its manager's references, its restores). Three
#: configs at 1 GB, where these give 22.5 states, were killed on a 23 GiB machine.
CONFIG_STATES = 5.5


def available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def config_groups(configs: list[str], size_mb: int, memory: int | None) -> list[list[str]]:
    """``configs`` cut into runs that fit ``memory`` (each run measures plain Orbax too, so
    its ratios stay paired): all in one run when they fit or ``memory`` is unknown, else as
    many per run as fit, at least one. (A 1 GB run of three configs in one process peaked
    above 14.5 GB and was killed on a 23 GiB machine.)"""
    if memory is None:
        return [configs]
    state = size_mb * MB
    per_run = max(1, int((memory / state - RUN_STATES) // CONFIG_STATES))
    return [configs[i:i + per_run] for i in range(0, len(configs), per_run)]


# ---------------------------------------------------------------------------- one size


def run_size(size_mb: int, configs: list[str], root: str, restores: int,
             fresh: bool, bases: int = 3) -> dict[str, dict[str, float]]:
    names = ["plain", *configs]
    state0 = make_state(size_mb * MB)
    # warm-up: a base and two deltas through every config (compiles programs, numba kernels)
    warm = [Config(n, os.path.join(root, f"warm-{n}-{size_mb}"), base_interval=10)
            for n in names]
    state = state0
    for step in range(3):
        for cfg in warm:
            timed_save(cfg, step, state)
        state = evolve(state, step + 1)
    for cfg in warm:  # and a restore: the timed restores below find their programs compiled
        timed_restore(cfg, 2, jax.tree.map(lambda x: x, state0))
        cfg.mngr.close()
        shutil.rmtree(cfg.directory, ignore_errors=True)

    cfgs = [Config(n, os.path.join(root, f"run-{n}-{size_mb}"), base_interval=20)
            for n in names]
    rows: dict[str, dict[str, list[float]]] = {n: {} for n in names}

    def add(name: str, key: str, value: float) -> None:
        rows[name].setdefault(key, []).append(value)

    state = state0
    for step in range(10):  # a base and 9 deltas, configs interleaved (rotating order)
        order = cfgs[step % len(cfgs):] + cfgs[: step % len(cfgs)]
        for cfg in order:
            r = timed_save(cfg, step, state)
            kind = "base" if step == 0 else "delta"
            add(cfg.name, f"block {kind}", r["block"])
            add(cfg.name, f"commit {kind}", r["commit"])
            if step:
                add(cfg.name, "rss save", r["rss"])
                if cfg.name != "plain":
                    add(cfg.name, "async_save", r["handler"])
        state = evolve(state, step + 1)
    # more base saves after the chain (one base per run is one sample): steps 10 .. 9 + bases
    for i in range(bases):
        step = 10 + i
        order = cfgs[step % len(cfgs):] + cfgs[: step % len(cfgs)]
        for cfg in order:
            r = timed_save(cfg, step, state, force_base=True)
            add(cfg.name, "block base", r["block"])
            add(cfg.name, "commit base", r["commit"])
        state = evolve(state, step + 1)
    after = 10 + bases  # the step of the first save after a restore
    target = jax.tree.map(lambda x: x, state0)
    # "restore" is warm: one untimed restore of the same step first. The warm-up's 3-link
    # chain compiles the programs of LC's windows, not those of the codecs AdaptivePolicy
    # chose along this 9-link chain (28 programs, ~1 s), which otherwise land in a timed
    # sample; a new process's first restore, compiles included, is "fresh restore".
    for cfg in cfgs:
        timed_restore(cfg, 9, target)
    for rep in range(restores):
        for cfg in (cfgs if rep % 2 == 0 else cfgs[::-1]):
            r, restored = timed_restore(cfg, 9, target)
            add(cfg.name, "restore", r["restore"])
            add(cfg.name, "rss restore", r["rss_restore"])
            del restored
    if fresh:  # the first restore of a fresh process (after a failure), configs interleaved
        for cfg in cfgs:
            cfg.mngr.close()
        for rep in range(restores):
            for cfg in (cfgs if rep % 2 == 0 else cfgs[::-1]):
                add(cfg.name, "fresh restore",
                    child("restore", cfg.name, size_mb, cfg.directory)["restore"])
                add(cfg.name, "fresh restore mf",
                    child("restore-mf", cfg.name, size_mb, cfg.directory)["restore"])
        for cfg in cfgs:
            cfg.mngr = cfg.manager()
    # the first save after a restore (a delta against the restored step)
    for cfg in cfgs:
        timed_restore(cfg, 9, target)
        r = timed_save(cfg, after, state)
        add(cfg.name, "after restore", r["block"])
        cfg.mngr.close()
        shutil.rmtree(cfg.directory, ignore_errors=True)
    if fresh:
        for name in names:
            f = fresh_process(name, size_mb, root)
            add(name, "fresh base", f["base"])
            add(name, "fresh delta", f["delta"])
    return {n: {k: statistics.median(v) for k, v in d.items()} for n, d in rows.items()}


COLUMNS = ("block base", "block delta", "async_save", "fresh base", "fresh delta",
           "after restore", "commit delta", "commit base", "restore", "fresh restore",
           "fresh restore mf", "rss save", "rss restore")


def report(size_mb: int, table: dict[str, dict[str, float]]) -> None:
    """Medians, then per lossy config its ratio to plain Orbax (RSS: the excess over plain
    Orbax's, in units of the state size; the target allows 1.0, one reference copy)."""
    plain = table["plain"]
    print(f"\n== {size_mb} MB float32 state (params + mu + nu) ==")
    print(f"{'config':<10}" + "".join(f"{c:>17}" for c in COLUMNS))
    for name, row in table.items():
        cells = []
        for c in COLUMNS:
            if c not in row:
                cells.append(f"{'-':>17}")
            elif c.startswith("rss"):
                cells.append(f"{row[c] / MB:>14.0f} MB")
            else:
                cells.append(f"{row[c] * 1e3:>14.0f} ms")
        print(f"{name:<10}" + "".join(cells))
        if name != "plain":
            ratios = []
            for c in COLUMNS:
                if c.startswith("rss") and c in row and c in plain:
                    excess = (row[c] - plain[c]) / (size_mb * MB)
                    ratios.append(f"{excess:>+12.2f} state")
                elif c == "async_save" and c in row:
                    ratios.append(f"{row[c] / plain['block delta']:>16.2f}x")
                elif c in row and c in plain and plain[c] > 0:
                    ratios.append(f"{row[c] / plain[c]:>16.2f}x")
                else:
                    ratios.append(f"{'-':>17}")
            print(f"{'  / plain':<10}" + "".join(ratios))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--fresh-child", "--restore-child",
                                             "--restore-mf-child"):
        if sys.argv[1] == "--fresh-child":
            fresh_child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        else:
            restore_child(sys.argv[2], int(sys.argv[3]), sys.argv[4],
                          manager_first=sys.argv[1] == "--restore-mf-child")
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64,256", help="state sizes in MB (1024 = 1 GB)")
    parser.add_argument("--configs", default="default,lc,adaptive")
    parser.add_argument("--restores", type=int, default=3, help="restore repeats per config")
    parser.add_argument("--no-fresh", action="store_true", help="skip the fresh-process saves")
    parser.add_argument("--bases", type=int, default=3,
                        help="base saves after the 9-delta chain, for the base medians")
    parser.add_argument("--encode-only", action="store_true", help="only device encode GB/s")
    parser.add_argument("--leaves", type=int, default=LEAVES_PER_TREE,
                        help="leaves per tree (params, mu and nu each)")
    parser.add_argument("--tables-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.leaves != LEAVES_PER_TREE:  # re-run with it in the environment (children too)
        os.environ["ORBAX_LOSSY_SPEED_LEAVES"] = str(args.leaves)
        os.execv(sys.executable, [sys.executable, *sys.argv])
    if not args.tables_only:
        print(f"{3 * LEAVES_PER_TREE} leaves")
        print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs")
        xla, ours = device_encode_gbps(), device_encode_gbps(path="save")
        print(f"encode of one 64 MB leaf, LC(3) float32 delta: XLA program {xla:.2f} GB/s, "
              f"the save's encode {ours:.2f} GB/s", flush=True)
        cold, warm = first_touch_ms_per_mb()
        print(f"fresh memory, first touch of 256 MB: {cold:.2f} ms/MB, again right after: "
              f"{warm:.2f} ms/MB", flush=True)
    if args.encode_only:
        return
    configs = args.configs.split(",")
    for size in (int(s) for s in args.sizes.split(",")):
        groups = config_groups(configs, size, available_memory())
        if len(groups) == 1:
            root = tempfile.mkdtemp(prefix="orbax_lossy_speed_")
            try:
                report(size, run_size(size, configs, root, args.restores, not args.no_fresh,
                                      args.bases))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            continue
        print(f"\n({size} MB: {len(configs)} configs do not fit this machine's memory in one "
              f"process; they run as {' | '.join(','.join(g) for g in groups)}, one process "
              f"each, every one with plain Orbax: compare ratios within a table)", flush=True)
        for group in groups:  # a process each: a run's memory is returned when it ends
            subprocess.run(
                [sys.executable, __file__, "--tables-only", "--sizes", str(size),
                 "--configs", ",".join(group), "--restores", str(args.restores),
                 "--bases", str(args.bases),
                 *(["--no-fresh"] if args.no_fresh else [])],
                check=True)


if __name__ == "__main__":
    main()
