"""Fresh single-process restore of a directory written by ``mp_worker.py crash``.

Usage: python restore_fresh.py OUT_DIR

Opens ``OUT_DIR/ckpt`` with a new manager in one process (8 fake CPU devices), checks that
the committed steps are listed (and the interrupted one is not), restores each of them and
compares bit for bit with ``OUT_DIR/expected.npz``. Writes ``OUT_DIR/fresh.json``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_lossy  # noqa: E402

SHAPES = {"w": (512, 256), "u": (256, 128), "b": (64,)}


def main(out: str) -> None:
    assert jax.process_count() == 1
    expected = np.load(os.path.join(out, "expected.npz"))
    root = os.path.join(out, "ckpt")
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("x",))
    target = {
        "params": {
            k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P("x")))
            for k, s in SHAPES.items()
        },
        "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
        "step": 0,
    }
    mngr = orbax_lossy.checkpoint_manager(root, max_to_keep=2)
    steps = list(mngr.all_steps())
    result = {"all_steps": steps, "listing": sorted(os.listdir(root)), "restored": {}}
    for s in steps:
        out_tree = mngr.restore(s, args=orbax_lossy.LossyRestore(target))
        ok = int(out_tree["count"]) == s and out_tree["step"] == s
        for k in SHAPES:
            got = np.asarray(out_tree["params"][k])
            want = expected[f"{s}/{k}"]
            ok &= got.shape == want.shape and np.array_equal(
                got.view(np.uint32), want.view(np.uint32)
            )
        result["restored"][str(s)] = bool(ok)
    mngr.close()
    with open(os.path.join(out, "fresh.json"), "w") as f:
        json.dump(result, f)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
