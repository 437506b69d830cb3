"""Plain Orbax against orbax-lossy on the same training run's states, side by side.

Trains the digits MLP (AdamW) once, keeps the TrainState every ``--every`` steps, then saves
the same sequence of states through plain Orbax (``StandardCheckpointHandler`` via
``StandardSave``, default settings) and through orbax-lossy for several base intervals, each
in its own fresh directory of the same run. Prints bytes on disk per checkpoint (bases,
deltas, and the average over the run with bases included), the time ``save()`` blocks, the
time until the save is committed, and the restore time of the newest step at the end of the
longest chain the configuration allows; and the ratios against plain Orbax.

    python benchmarks/orbax_vs_lossy.py [--steps 400 --every 20 --hidden 512]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

import orbax_lossy as ol
from orbax_lossy.demo import training_run


def dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def state_tree(state: Any) -> dict[str, Any]:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


def run_config(name, root, states, make_manager, make_save, make_restore, kind_of):
    directory = os.path.join(root, name)
    mngr = make_manager(directory)
    block, commit, sizes = [], [], []
    for step, state in states:
        t0 = time.perf_counter()
        mngr.save(step, args=make_save(state))
        t1 = time.perf_counter()
        mngr.wait_until_finished()
        t2 = time.perf_counter()
        block.append(t1 - t0)
        commit.append(t2 - t0)
        sizes.append((kind_of(directory, step), dir_bytes(os.path.join(directory, str(step)))))
    mngr.close()
    # restore the newest step whose chain is the longest, in a fresh manager
    chain_end = max(
        (s for s, _ in states), key=lambda s: (kind_chain(directory, s), s)
    )
    target = state_tree(states[-1][1])
    fresh = make_manager(directory)
    t0 = time.perf_counter()
    restored = fresh.restore(chain_end, args=make_restore(target))
    jax.block_until_ready(restored)
    t_restore = time.perf_counter() - t0
    fresh.close()
    bases = [b for k, b in sizes if k == "base"]
    deltas = [b for k, b in sizes if k == "delta"]
    return {
        "name": name,
        "base_bytes": statistics.mean(bases) if bases else 0,
        "delta_bytes": statistics.mean(deltas) if deltas else 0,
        "avg_bytes": statistics.mean(b for _, b in sizes),
        "block_s": statistics.median(block),
        "commit_s": statistics.median(commit),
        "restore_s": t_restore,
        "restore_chain": kind_chain(directory, chain_end),
    }


def kind_chain(directory: str, step: int) -> int:
    item = os.path.join(directory, str(step), "default")
    if not os.path.exists(os.path.join(item, "manifest.msgpack")):
        return 0
    return ol.format.read_manifest(item).header.chain_length


def lossy_kind(directory: str, step: int) -> str:
    return ol.format.read_manifest(os.path.join(directory, str(step), "default")).header.save_type


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intervals", default="1,5,10,20")
    args = parser.parse_args()
    states = [
        (step, jax.tree.map(lambda x: x, state))
        for step, state in training_run(args.steps, "adamw", hidden=args.hidden)
        if step % args.every == 0
    ]
    n_params = sum(x.size for x in jax.tree.leaves(states[0][1].params))
    raw = sum(x.nbytes for x in jax.tree.leaves(state_tree(states[0][1])))
    print(f"digits MLP hidden={args.hidden} AdamW: {n_params} params, {raw} B of TrainState "
          f"(params + adam mu/nu + counts), {len(states)} checkpoints every {args.every} steps")
    root = tempfile.mkdtemp(prefix="orbax_lossy_bench_")
    results = []
    try:
        run_config(  # warm-up of plain Orbax too (not printed)
            "warm-up plain", root, states[:2],
            lambda d: ocp.CheckpointManager(d),
            lambda s: ocp.args.StandardSave(state_tree(s)),
            lambda t: ocp.args.StandardRestore(t),
            lambda d, s: "base",
        )
        results.append(
            run_config(
                "plain orbax", root, states,
                lambda d: ocp.CheckpointManager(d),
                lambda s: ocp.args.StandardSave(state_tree(s)),
                lambda t: ocp.args.StandardRestore(t),
                lambda d, s: "base",
            )
        )
        # warm-up (not printed): compile the encode/decode programs and numba kernels once, so
        # the rows below compare steady-state costs, as in a long training run
        for warm in (ol.LeafPolicy(), ol.LeafPolicy.create(defaults={
                "param": ol.LC(3), "first_moment": ol.LC(3), "second_moment": ol.LC(3)})):
            run_config(
                f"warm-up {id(warm)}", root, states[:3],
                lambda d, p=warm: ol.checkpoint_manager(d, policy=p, base_interval=2),
                lambda s: ol.LossySave(state_tree(s)),
                lambda t: ol.LossyRestore(t),
                lossy_kind,
            )
        policies = {
            "default (whole state)": ol.LeafPolicy(),
            "all floats LC": ol.LeafPolicy.create(
                defaults={"param": ol.LC(3), "first_moment": ol.LC(3), "second_moment": ol.LC(3)}
            ),
        }
        for label, policy in policies.items():
            for interval in [int(i) for i in args.intervals.split(",")]:
                results.append(
                    run_config(
                        f"{label}, base/{interval}", root, states,
                        lambda d, p=policy, i=interval: ol.checkpoint_manager(
                            d, policy=p, base_interval=i, max_to_keep=None
                        ),
                        lambda s: ol.LossySave(state_tree(s)),
                        lambda t: ol.LossyRestore(t),
                        lossy_kind,
                    )
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    plain = results[0]
    print(f"{'config':<28} {'base B':>9} {'delta B':>9} {'avg B':>9} {'avg x':>6} "
          f"{'block ms':>9} {'commit ms':>10} {'restore ms':>11} {'(chain)':>7}")
    for r in results:
        print(
            f"{r['name']:<28} {r['base_bytes']:>9.0f} {r['delta_bytes']:>9.0f} "
            f"{r['avg_bytes']:>9.0f} {plain['avg_bytes'] / r['avg_bytes']:>5.1f}x "
            f"{1e3 * r['block_s']:>9.1f} {1e3 * r['commit_s']:>10.1f} "
            f"{1e3 * r['restore_s']:>11.1f} {r['restore_chain']:>7}"
        )
    print("ratios against plain Orbax (>1 = orbax-lossy smaller/faster):")
    for r in results[1:]:
        delta_ratio = plain["avg_bytes"] / r["delta_bytes"] if r["delta_bytes"] else float("nan")
        print(
            f"  {r['name']:<28} bytes avg {plain['avg_bytes'] / r['avg_bytes']:.1f}x, "
            f"deltas {delta_ratio:.1f}x | block {plain['block_s'] / r['block_s']:.2f}x | "
            f"commit {plain['commit_s'] / r['commit_s']:.2f}x | "
            f"restore {plain['restore_s'] / r['restore_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
