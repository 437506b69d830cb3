"""Partial Experts Checkpoint: save K of 8 experts per MoE layer, crash, restore, continue.

Trains a small NNX Mixture-of-Experts char-LM (2 MoE layers, 8 experts, top-2 routing, AdamW)
on Python standard library text. Every save stores all non-expert state plus K experts of
every MoE layer (weights *and* their Adam moments), rotating through the experts; the router's
token counts feed the lost-token accounting. After a simulated crash a fresh manager restores
every expert from its newest saved copy, reports the lost tokens and PLT (Dynamic-K raises K
when PLT exceeds 3.75%), and training continues.

    python examples/moe_partial_experts.py [--dir /tmp/moe_run] [--steps 120] [--k 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import numpy as np
from flax import nnx

import orbax_lossy as ol
from orbax_lossy.experts import toy

GROUPS = ["blocks/0/moe", "blocks/1/moe"]


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--crash-at", type=int, default=65)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--k", type=int, default=2)
    args = parser.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="orbax_lossy_moe_")
    data = toy.CharData(toy.stdlib_text(100_000), context=8)
    batch = 32
    total = args.steps * batch * 2  # expert assignments per MoE layer over the run (top-2)

    def manager() -> tuple[object, ol.PartialExperts]:
        pec = ol.PartialExperts(k=args.k, rules=[(r"moe/(w_in|b_in|w_out|b_out)$", 0)],
                                total_assignments=total)
        return ol.checkpoint_manager(directory, partial_experts=pec, max_to_keep=2,
                                     base_interval=20), pec

    def train(model, opt, mngr, steps, routed) -> None:
        """Train over ``steps``; save every ``--every`` steps with the tokens routed since."""
        for step in steps:
            _, counts = toy.train_step(model, opt, *data.batch(step, batch))
            routed += np.asarray(counts)
            if step % args.every == 0:
                mngr.save(step, args=ol.LossySave(nnx.state((model, opt)), expert_tokens={
                    g: routed[i] for i, g in enumerate(GROUPS)}))
                routed[:] = 0
        mngr.wait_until_finished()

    model, opt = toy.build(data.vocab, d=16, h=32)
    mngr, _ = manager()
    routed = np.zeros((2, 8), np.int64)
    train(model, opt, mngr, range(1, args.crash_at + 1), routed)
    before = float(toy.eval_loss(model, *data.batch(0, 512, valid=True)))
    latest = mngr.latest_step()
    rep = ol.partial_experts_report(f"{directory}/{latest}/default")
    print(f"crash after step {args.crash_at} (validation loss {before:.3f}); kept steps "
          f"{mngr.all_steps()}; step {latest} holds experts {rep['held']}")
    print(f"  bytes of step {latest}: {dir_bytes(f'{directory}/{latest}')}")
    mngr.close()

    # --- a new process: restore every expert from its newest saved copy
    model, opt = toy.build(data.vocab, d=16, h=32, seed=1)
    mngr, pec = manager()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamic-K's warning; the report below says it
        restored = mngr.restore(latest, args=ol.LossyRestore(nnx.state((model, opt))))
    nnx.update((model, opt), restored)
    report = pec.last_restore_report
    after = float(toy.eval_loss(model, *data.batch(0, 512, valid=True)))
    print(f"restored step {latest} (validation loss {after:.3f}): experts from steps "
          f"{report['expert_steps']}")
    print(f"  lost tokens {report['lost_tokens']}, PLT {report['plt']:.2%} "
          f"({report['plt_denominator']}), K {report['k']} -> {report['k_next']}")
    train(model, opt, mngr, range(latest + 1, args.steps + 1), routed)
    final = mngr.latest_step()
    final_loss = float(toy.eval_loss(model, *data.batch(0, 512, valid=True)))
    print(f"finished {args.steps} steps: validation loss {final_loss:.3f}; step {final} holds "
          f"{ol.partial_experts_report(f'{directory}/{final}/default')['held']} "
          f"(K now {pec.k_for()})")
    mngr.close()


if __name__ == "__main__":
    main()
