"""LC-Checkpoint codec on the deltas of a real training run, and lossless coding of weights.

Trains the digits MLP (scikit-learn's digits, AdamW), takes a checkpoint every ``--every``
steps, and codes each checkpoint as a closed-loop delta against the previous
reconstruction. Prints per bit width b: compression ratio against the raw float32 bytes,
bits per element against the order-0 entropy bound of the symbol stream, and encode/decode
throughput in MB/s of float32 input. Then the lossless byte-plane coder against zstd-3 on
the trained float32 and bfloat16 weights.

    python benchmarks/codec_bench.py [--steps 400 --every 20 --hidden 512]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs import lossless
from orbax_lossy.codecs.lc import LC
from orbax_lossy.demo import training_run
from orbax_lossy.engine import device as program
from orbax_lossy.entropy import decode_symbols, encode_symbols, order0_entropy_bits


def checkpoints(steps: int, every: int, hidden: int) -> list[list[jax.Array]]:
    return [
        jax.tree.leaves(state.params)
        for step, state in training_run(steps, "adamw", hidden=hidden)
        if step % every == 0
    ]


def bench_bits(ckpts: list[list[jax.Array]], bits: int) -> dict[str, float]:
    codec = LC(bits)
    plan = tuple([codec] * len(ckpts[0]))
    shardings = tuple(x.sharding for x in ckpts[0])
    recon = ckpts[0]
    raw = coded = entropy = n_elem = 0
    t_enc = t_dec = 0.0
    for values in ckpts[1:]:
        t0 = time.perf_counter()
        out = program.encode_tree(values, recon, plan=plan, shardings=shardings)
        syms = [np.asarray(o["fields"]["sym"]).reshape(-1) for o in out]
        blobs = [encode_symbols(s) for s in syms]
        t_enc += time.perf_counter() - t0
        t0 = time.perf_counter()
        decoded_syms = [
            jnp.asarray(decode_symbols(b, s.size).reshape(v.shape))
            for b, s, v in zip(blobs, syms, values, strict=True)
        ]
        decoded = program.decode_tree(
            [{"sym": s} for s in decoded_syms],
            [o["side"] for o in out],
            recon,
            plan=plan,
            dtypes=tuple(np.dtype(v.dtype) for v in values),
            shardings=shardings,
        )
        jax.block_until_ready(decoded)
        t_dec += time.perf_counter() - t0
        recon = [o["recon"] for o in out]
        for d, r in zip(decoded, recon, strict=True):
            assert np.array_equal(np.asarray(d), np.asarray(r)), "decode != reconstruction"
        raw += sum(v.size * 4 for v in values)
        side = sum(o["side"]["rep"].size * 4 for o in out)
        coded += sum(len(b) for b in blobs) + side
        entropy += sum(order0_entropy_bits(s) for s in syms) / 8
        n_elem += sum(v.size for v in values)
    return {
        "ratio": raw / coded,
        "bits_per_elem": 8 * coded / n_elem,
        "entropy_bits": 8 * entropy / n_elem,
        "enc_mbs": raw / t_enc / 1e6,
        "dec_mbs": raw / t_dec / 1e6,
    }


def lossless_vs_zstd(weights: list[jax.Array]) -> None:
    try:
        import zstandard
    except ImportError:
        print("zstandard not installed; skipping the zstd-3 comparison")
        return
    for name, dtype in (("float32", np.float32), ("bfloat16", jnp.bfloat16)):
        arrays = [np.asarray(jnp.asarray(w).astype(dtype)) for w in weights]
        raw = sum(a.nbytes for a in arrays)
        t0 = time.perf_counter()
        ours = sum(len(lossless.encode_array(a)) for a in arrays)
        t_ours = time.perf_counter() - t0
        z = zstandard.ZstdCompressor(level=3)
        t0 = time.perf_counter()
        zstd = sum(len(z.compress(a.tobytes())) for a in arrays)
        t_z = time.perf_counter() - t0
        print(
            f"{name:>9} trained weights: raw {raw} B | orbax-lossy {raw / ours:.3f}x "
            f"({raw / t_ours / 1e6:.0f} MB/s) | zstd-3 {raw / zstd:.3f}x "
            f"({raw / t_z / 1e6:.0f} MB/s) | ours/zstd size {ours / zstd:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    ckpts = checkpoints(args.steps, args.every, args.hidden)
    n = sum(x.size for x in ckpts[0])
    print(f"digits MLP hidden={args.hidden}: {n} float32 params, {len(ckpts) - 1} deltas "
          f"(every {args.every} steps of AdamW)")
    for bits in range(1, 9):
        bench_bits(ckpts[:2], bits)  # warm up: compile each program, numba kernels
    print(f"{'b':>2} {'ratio':>8} {'bits/elem':>10} {'entropy':>8} {'overhead':>9} "
          f"{'enc MB/s':>9} {'dec MB/s':>9}")
    for bits in range(1, 9):
        r = bench_bits(ckpts, bits)
        over = r["bits_per_elem"] / max(r["entropy_bits"], 1e-12) - 1
        print(f"{bits:>2} {r['ratio']:>7.1f}x {r['bits_per_elem']:>10.3f} "
              f"{r['entropy_bits']:>8.3f} {100 * over:>8.1f}% {r['enc_mbs']:>9.0f} "
              f"{r['dec_mbs']:>9.0f}")
    lossless_vs_zstd(ckpts[-1])


if __name__ == "__main__":
    main()
