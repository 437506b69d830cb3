"""Partial Experts Checkpoint (issue 13) on a small MoE char-LM trained on stdlib text.

For every (K, C): train ``--steps`` steps saving every C steps through
``checkpoint_manager(partial_experts=PartialExperts(k=K, ...))`` (Dynamic-K on), "fail" at
``--fail-at``, restore the newest save at or before it into a fresh model, finish the run, and
compare with the uninterrupted run. Two storage settings: ``exact`` (every leaf lossless:
PEC alone) and ``lossy`` (the library's default whole-state policy: ``Step`` deltas for
parameters, log-domain LC for second moments, ..., with LC(4) first-moment deltas). Plain
Orbax (``StandardCheckpointer``, zstd) of the same state is the size baseline.

Columns: bytes per save (mean over the run's saves, all files of the step directory) and its
ratio to plain Orbax; the mean over *partial* saves only; bytes written per process (one
process here: the same); PLT of the restore (Eq. 7 with the run's total assignments as the
denominator) and K after it; final validation loss and its gap to the uninterrupted run.

    python benchmarks/moe.py                      # short default (a few minutes on 2 cores)
    python benchmarks/moe.py --full               # K in {1,2,4,8} x C in {10,25}, exact+lossy
    python benchmarks/moe.py --ks 1 2 --intervals 10 --storages exact --steps 400
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
import time
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

import orbax_lossy as ol
from orbax_lossy.experts import toy
from orbax_lossy.policy.base import ROLES

RULES = [(r"moe/(w_in|b_in|w_out|b_out)$", 0)]


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def policies() -> dict[str, ol.LeafPolicy]:
    # lossy: the default whole-state policy, with first moments LC-coded (not dropped);
    # lossy-base: the same, and the engine bases (the run's first, full save) coded too:
    # parameters by 8-bit k-means, first moments by direct 4-bit LC (instead of exact)
    lossy = {"first_moment": ol.LC(bits=4)}
    return {"exact": ol.LeafPolicy.create(defaults={r: ol.Exact() for r in ROLES}),
            "lossy": ol.LeafPolicy.create(defaults=lossy),
            "lossy-base": ol.LeafPolicy.create(defaults=lossy, base_defaults={
                "param": ol.Cluster(bits=8), "first_moment": ol.LC(bits=4, mode="direct")})}


EXPERT = re.compile(r"moe/(w_in|b_in|w_out|b_out)(/value)?$")


def breakdown(step_dir: str) -> dict[str, int]:
    """Stored bytes of a save by part: expert / dense x role, the PEC record, and the files'
    overhead (manifest, headers)."""
    out: dict[str, int] = {}
    for row in ol.checkpoint_stats(os.path.join(step_dir, "default")):
        part = ("record" if "__pec__" in row["path"] else
                f"{'expert' if EXPERT.search(row['path']) else 'dense'} {row['role']}")
        out[part] = out.get(part, 0) + int(row["stored_bytes"])
    out["files"] = dir_bytes(step_dir) - sum(out.values())
    return out


def groups_of(layers: int) -> list[str]:
    return [f"blocks/{i}/moe" for i in range(layers)]


def uninterrupted(data, cfg, steps: int, batch: int) -> tuple[float, list[float]]:
    model, opt = toy.build(data.vocab, **cfg)
    for step in range(1, steps + 1):
        toy.train_step(model, opt, *data.batch(step, batch))
    return valid_loss(model, data), []


def valid_loss(model, data, batches: int = 8) -> float:
    return float(np.mean([float(toy.eval_loss(model, *data.batch(i, 256, valid=True)))
                          for i in range(batches)]))


def plain_orbax_bytes(state, workdir: str) -> int:
    path = os.path.join(workdir, "plain_orbax")
    shutil.rmtree(path, ignore_errors=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, state)
    ckptr.wait_until_finished()
    ckptr.close()
    return dir_bytes(path)


def run(data, cfg, *, k: int, interval: int, storage: str, steps: int, fail_at: int,
        batch: int, workdir: str, base_interval: int) -> dict:
    layers, top_k = cfg["layers"], cfg["top_k"]
    total_assignments = steps * batch * top_k  # T_i * TopK_i per MoE layer (the paper's)
    directory = os.path.join(workdir, f"pec_k{k}_c{interval}_{storage}")
    shutil.rmtree(directory, ignore_errors=True)
    policy = policies()[storage]

    def manager(pec):
        return ol.checkpoint_manager(directory, partial_experts=pec, policy=policy,
                                     base_interval=base_interval, max_to_keep=2)

    pec = ol.PartialExperts(k=k, rules=RULES, total_assignments=total_assignments)
    model, opt = toy.build(data.vocab, **cfg)
    mngr = manager(pec)
    acc = np.zeros((layers, cfg["experts"]), np.int64)
    save_bytes, partial_bytes, save_time, parts = {}, [], 0.0, {}
    for step in range(1, fail_at + 1):
        _, counts = toy.train_step(model, opt, *data.batch(step, batch))
        acc += np.asarray(counts)
        if step % interval == 0:
            t0 = time.perf_counter()
            mngr.save(step, args=ol.LossySave(nnx.state((model, opt)), expert_tokens={
                g: acc[i] for i, g in enumerate(groups_of(layers))}))
            mngr.wait_until_finished()
            save_time += time.perf_counter() - t0
            acc[:] = 0
            save_bytes[step] = dir_bytes(os.path.join(directory, str(step)))
            parts[step] = breakdown(os.path.join(directory, str(step)))
            if k < cfg["experts"]:
                rep = ol.partial_experts_report(os.path.join(directory, str(step), "default"))
                if not rep["full"]:
                    partial_bytes.append(save_bytes[step])
    plain = plain_orbax_bytes(nnx.state((model, opt)), workdir)
    mngr.close()
    # --- failure: a new process restores the newest save into a fresh model
    restored_step = max(s for s in save_bytes if s <= fail_at)
    pec2 = ol.PartialExperts(k=k, rules=RULES, total_assignments=total_assignments)
    mngr = manager(pec2)
    model, opt = toy.build(data.vocab, **{**cfg, "seed": 123})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamic-K announces itself with a warning
        tree = mngr.restore(restored_step, args=ol.LossyRestore(nnx.state((model, opt))))
    nnx.update((model, opt), tree)
    report = pec2.last_restore_report or {"plt": 0.0, "k_next": k}
    for step in range(restored_step + 1, steps + 1):
        _, counts = toy.train_step(model, opt, *data.batch(step, batch))
        acc += np.asarray(counts)
        if step % interval == 0:
            mngr.save(step, args=ol.LossySave(nnx.state((model, opt)), expert_tokens={
                g: acc[i] for i, g in enumerate(groups_of(layers))}))
            acc[:] = 0
    mngr.wait_until_finished()
    mngr.close()
    mean = float(np.mean(list(save_bytes.values())))
    return {
        "k": k, "interval": interval, "storage": storage, "saves": len(save_bytes),
        "bytes_per_save": mean, "plain_orbax_bytes": plain, "ratio": mean / plain,
        "partial_ratio": float(np.mean(partial_bytes)) / plain if partial_bytes else mean / plain,
        "bytes_per_process": mean, "save_seconds": save_time / max(1, len(save_bytes)),
        "restored_step": restored_step, "plt": report["plt"], "k_next": report["k_next"],
        "final_loss": valid_loss(model, data),
        "first_save_parts": parts[min(parts)],
        "last_save_parts": parts[max(parts)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="the whole grid of issue 13")
    parser.add_argument("--ks", type=int, nargs="+", default=None)
    parser.add_argument("--intervals", type=int, nargs="+", default=None)
    parser.add_argument("--storages", nargs="+", default=None,
                        choices=["exact", "lossy", "lossy-base"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--fail-at", type=int, default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--base-interval", type=int, default=20)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--parts", action="store_true",
                        help="print the first and last save's bytes by part (x plain Orbax)")
    args = parser.parse_args()
    ks = args.ks or ([1, 2, 4, 8] if args.full else [2])
    intervals = args.intervals or ([10, 25] if args.full else [10])
    storages = args.storages or ["exact", "lossy-base"]
    steps = args.steps or (400 if args.full else 250)
    fail_at = args.fail_at or int(steps * 0.65)
    cfg = {"context": 8, "d": 32, "h": 64, "experts": 8, "top_k": 2, "layers": 2}
    data = toy.CharData(toy.stdlib_text(), context=cfg["context"])
    model, _ = toy.build(data.vocab, **cfg)
    sizes = {"/".join(str(getattr(k, "key", k)) for k in p): int(np.size(v))
             for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model))}
    expert = sum(v for n, v in sizes.items() if "/moe/" in n and "router" not in n)
    print(f"model: {sum(sizes.values())} parameters, {expert / sum(sizes.values()):.1%} in "
          f"experts; {steps} steps, batch {args.batch}, failure at step {fail_at}; "
          f"vocab {data.vocab}")
    workdir = args.dir or tempfile.mkdtemp(prefix="orbax_lossy_moe_")
    base_loss, _ = uninterrupted(data, cfg, steps, args.batch)
    print(f"uninterrupted final validation loss {base_loss:.4f}\n")
    header = (f"{'K':>2} {'C':>3} {'storage':<7} {'saves':>5} {'B/save':>9} {'x Orbax':>8} "
              f"{'partial':>8} {'B/proc':>9} {'s/save':>6} {'restore':>7} {'PLT':>7} "
              f"{'K next':>6} {'loss':>7} {'gap':>7}")
    print(header)
    rows = []
    for storage in storages:
        for interval in intervals:
            for k in ks:
                r = run(data, cfg, k=k, interval=interval, storage=storage, steps=steps,
                        fail_at=fail_at, batch=args.batch, workdir=workdir,
                        base_interval=args.base_interval)
                r["gap"] = r["final_loss"] / base_loss - 1
                r["uninterrupted_loss"] = base_loss
                rows.append(r)
                print(f"{k:>2} {interval:>3} {storage:<7} {r['saves']:>5} "
                      f"{r['bytes_per_save']:>9.0f} {r['ratio']:>8.3f} {r['partial_ratio']:>8.3f} "
                      f"{r['bytes_per_process']:>9.0f} {r['save_seconds']:>6.2f} "
                      f"{r['restored_step']:>7} {r['plt']:>7.2%} {r['k_next']:>6} "
                      f"{r['final_loss']:>7.4f} {r['gap']:>+7.2%}", flush=True)
                if args.parts:
                    for label in ("first_save_parts", "last_save_parts"):
                        print(f"   {label}: " + ", ".join(
                            f"{k} {v / r['plain_orbax_bytes']:.4f}"
                            for k, v in sorted(r[label].items())), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if not args.dir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
