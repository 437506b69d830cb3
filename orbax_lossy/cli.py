"""``orbax-lossy`` command line: run the demo, inspect and verify checkpoints.

    orbax-lossy demo [--steps 300 --every 10 --bits 3 --base-interval 10 --dir DIR]
    orbax-lossy inspect ITEM_DIR        per-leaf codec, bytes, ratio, error; chain
    orbax-lossy verify ITEM_DIR         read every payload of the chain and check checksums
"""

from __future__ import annotations

import argparse
import sys

from orbax_lossy import format as fmt
from orbax_lossy.errors import LossyError
from orbax_lossy.stats import checkpoint_stats


def _inspect(item_dir: str) -> int:
    chain = fmt.walk_chain(item_dir)
    print("chain (base first):")
    for link, manifest in chain:
        print(f"  step {manifest.header.step}: {manifest.header.save_type} ({link})")
    rows = checkpoint_stats(item_dir)
    width = max(len(r["path"]) for r in rows)
    print(f"{'leaf':<{width}} {'codec':<22} {'raw B':>10} {'stored B':>10} {'ratio':>8} "
          f"{'rel err':>9}")
    for r in rows:
        codec = ",".join(f"{k}={v}" for k, v in r["codec"].items() if k != "id")
        codec = r["codec"]["id"] + (f"({codec})" if codec else "")
        print(f"{r['path']:<{width}} {codec:<22} {r['raw_bytes']:>10} {r['stored_bytes']:>10} "
              f"{r['ratio']:>8.1f} {r['rel_error']:>9.2e}")
    raw = sum(r["raw_bytes"] for r in rows)
    stored = sum(r["stored_bytes"] for r in rows)
    print(f"total: {raw} raw bytes, {stored} stored bytes, {raw / max(stored, 1):.1f}x")
    return 0


def _verify(item_dir: str) -> int:
    chain = fmt.walk_chain(item_dir)
    total = 0
    for link, manifest in chain:
        reader = fmt.PayloadReader(link)
        for leaf in manifest.leaves:
            for p in leaf.pieces:
                reader.read(p, f"{link}: leaf {leaf.name!r}")
        total += reader.bytes_read
        print(f"ok  step {manifest.header.step} ({manifest.header.save_type}): "
              f"{reader.bytes_read} bytes")
    print(f"verified {total} payload bytes in {len(chain)} checkpoint(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orbax-lossy", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train on digits with lossy checkpoints, print sizes")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--every", type=int, default=10)
    demo.add_argument("--bits", type=int, default=3)
    demo.add_argument("--base-interval", type=int, default=10)
    demo.add_argument("--dir", default=None)
    for name in ("inspect", "verify"):
        p = sub.add_parser(name, help=f"{name} a saved item directory (<root>/<step>/<item>)")
        p.add_argument("item_dir")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from orbax_lossy import demo as demo_mod

            demo_mod.run(args.dir, args.steps, args.every, args.bits, args.base_interval)
            return 0
        if args.command == "inspect":
            return _inspect(args.item_dir)
        return _verify(args.item_dir)
    except LossyError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
