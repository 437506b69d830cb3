"""``orbax-lossy`` command line: list, inspect, verify and export checkpoints; run the demo.

    orbax-lossy list ROOT                     steps: base/delta, what each needs, bytes, ratio
    orbax-lossy inspect PATH [--step N]       per-leaf codec, bytes, ratio, error; the chain
    orbax-lossy verify PATH [--step N]        read every payload byte of the chain, check CRCs
    orbax-lossy export PATH DST [--step N]    write a plain Orbax checkpoint of a step
    orbax-lossy demo [--steps 300 ...]        train on digits with lossy checkpoints

PATH is a checkpoint root (latest step unless ``--step``), a step or an item directory.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

REL_ERR_NOTE = (
    "rel err = ||reconstruction - value|| / ||value|| of the leaf, measured on device when it "
    "was saved (for a delta: of the value, not of the change); 0 = stored exactly"
)


def _console() -> Any:
    from rich.console import Console

    # Piped output (a log, a test) is not cut at 80 columns; a terminal keeps its width.
    return Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _codec_name(config: dict[str, Any]) -> str:
    args = ",".join(f"{k}={v}" for k, v in config.items() if k != "id")
    return config["id"] + (f"({args})" if args else "")


def _list(root: str, item: str | None) -> int:
    from rich.table import Table

    from orbax_lossy.format.locate import committed_steps, lossy_items
    from orbax_lossy.format.manifest import read_manifest

    steps = committed_steps(root)
    if not steps:
        raise SystemExit(f"error: {root} holds no orbax-lossy steps")
    table = Table(title=f"{root}", caption="ratio = raw bytes of the state / bytes stored")
    for name, justify in (("step", "right"), ("item", "left"), ("type", "left"),
                          ("depends on", "left"), ("stored", "right"), ("raw", "right"),
                          ("ratio", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for step, step_dir in steps.items():
        for name, item_dir in lossy_items(step_dir).items():
            if item is not None and name != item:
                continue
            m = read_manifest(item_dir)
            raw = sum(leaf.raw_bytes for leaf in m.leaves)
            stored = sum(leaf.stored_bytes for leaf in m.leaves)
            deps = ", ".join(str(s) for s in m.header.depends_on) or "-"
            table.add_row(str(step), name, m.header.save_type, deps, _human(stored), _human(raw),
                          f"{raw / max(stored, 1):.1f}x")
    _console().print(table)
    return 0


def _inspect(item_dir: str) -> int:
    from rich.table import Table

    from orbax_lossy.format.chain import walk_chain

    chain = walk_chain(item_dir)
    console = _console()
    links = " -> ".join(f"{m.header.step} ({m.header.save_type})" for _, m in chain)
    console.print(f"[bold]{item_dir}[/bold]\nchain, base first: {links}")
    manifest = chain[-1][1]
    table = Table(caption=REL_ERR_NOTE)
    for name, justify in (("leaf", "left"), ("role", "left"), ("codec", "left"),
                          ("shape", "left"), ("raw", "right"), ("stored", "right"),
                          ("ratio", "right"), ("rel err", "right")):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for leaf in manifest.leaves:
        stored = leaf.stored_bytes
        ratio = f"{leaf.raw_bytes / stored:.1f}x" if stored else "-"
        table.add_row(leaf.name, leaf.role or "-", _codec_name(leaf.codec_config),
                      str(leaf.shape), _human(leaf.raw_bytes), _human(stored), ratio,
                      f"{leaf.rel_error:.2e}")
    console.print(table)
    raw = sum(leaf.raw_bytes for leaf in manifest.leaves)
    stored = sum(leaf.stored_bytes for leaf in manifest.leaves)
    console.print(f"whole state: {_human(raw)} raw, {_human(stored)} stored in this step, "
                  f"{raw / max(stored, 1):.1f}x smaller than the raw state")
    return 0


def _verify(item_dir: str) -> int:
    from rich.progress import Progress

    from orbax_lossy.format.chain import walk_chain
    from orbax_lossy.format.payload import PayloadReader

    chain = walk_chain(item_dir)
    pieces = [(link, leaf, p) for link, m in chain for leaf in m.leaves for p in leaf.pieces]
    total = sum(p.length for _, _, p in pieces)
    readers = {link: PayloadReader(link) for link, _ in chain}
    with Progress(transient=True) as progress:
        task = progress.add_task("reading payloads", total=total)
        for link, leaf, p in pieces:
            readers[link].read(p, f"{link}: leaf {leaf.name!r}")
            progress.advance(task, p.length)
    console = _console()
    for link, m in chain:
        console.print(f"ok  step {m.header.step} ({m.header.save_type}): "
                      f"{_human(readers[link].bytes_read)} read, checksums match")
    console.print(f"verified {_human(total)} of payload in {len(chain)} checkpoint(s)")
    return 0


def _export(source: str, destination: str, step: int | None, item: str | None,
            overwrite: bool) -> int:
    from rich.console import Console

    from orbax_lossy.export import export_step
    from orbax_lossy.format.steps import abspath

    with Console().status("restoring and writing a plain Orbax checkpoint"):
        item_dir = export_step(source, destination, step=step, item=item, overwrite=overwrite)
    print(f"exported {item_dir} -> {abspath(destination)} "
          "(read it with ocp.StandardCheckpointer().restore(path))")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orbax-lossy", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train on digits with lossy checkpoints, print sizes")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--every", type=int, default=10)
    demo.add_argument("--bits", type=int, default=None,
                      help="LC bits for parameters (default: the library's default policy)")
    demo.add_argument("--base-interval", type=int, default=10)
    demo.add_argument("--dir", default=None, help="keep the checkpoints here (default: a "
                      "temporary folder, removed at the end)")
    listing = sub.add_parser("list", help="the steps of a checkpoint root")
    listing.add_argument("root")
    listing.add_argument("--item", default=None)
    for name, text in (("inspect", "per-leaf codecs, sizes and errors of a step"),
                       ("verify", "read every payload byte of a step's chain")):
        p = sub.add_parser(name, help=text)
        p.add_argument("path", help="a root, step or item directory")
        p.add_argument("--step", type=int, default=None)
        p.add_argument("--item", default=None)
    export = sub.add_parser("export", help="write a step as a plain Orbax checkpoint")
    export.add_argument("path", help="a root, step or item directory")
    export.add_argument("destination")
    export.add_argument("--step", type=int, default=None)
    export.add_argument("--item", default=None)
    export.add_argument("--overwrite", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 on a checkpoint error)."""
    args = _parser().parse_args(argv)
    from orbax_lossy.errors import LossyError

    try:
        if args.command == "demo":
            from orbax_lossy import demo as demo_mod

            demo_mod.run(args.dir, args.steps, args.every, args.bits, args.base_interval)
            return 0
        if args.command == "list":
            from orbax_lossy.format.steps import abspath

            return _list(abspath(args.root), args.item)  # keeps a URI's scheme://
        if args.command == "export":
            return _export(args.path, args.destination, args.step, args.item, args.overwrite)
        from orbax_lossy.format.locate import resolve_item_dir

        item_dir = resolve_item_dir(args.path, step=args.step, item=args.item)
        return _inspect(item_dir) if args.command == "inspect" else _verify(item_dir)
    except LossyError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
