"""Host <-> device copies of a save's and a restore's fields, plain against engine/transfer.py.

    python benchmarks/transfer_bandwidth.py [--mb 256]

D2H: ``np.asarray`` after ``copy_to_host_async`` (plain) against ``transfer.HostCopy`` (uint8
as uint32 words into pinned host memory on an accelerator); H2D: ``make_array_from_callback``
(plain) against ``transfer.upload``. GB/s of the field's own bytes, median of 5.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.engine import transfer


def gbps(nbytes: int, run, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256)
    args = parser.parse_args()
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind})")
    n = args.mb << 20
    sharding = jax.sharding.SingleDeviceSharding(device)
    for dtype in (jnp.uint8, jnp.float32):
        shape = (n // np.dtype(dtype).itemsize // 1024, 1024)
        x = jax.block_until_ready(jnp.ones(shape, dtype))
        row = []
        for mode in ("plain", "auto"):
            os.environ[transfer.TRANSFER_ENV] = mode

            def d2h(x=x):
                fresh = jax.block_until_ready(x + 0)  # a new buffer: nothing cached on host
                transfer.HostCopy(fresh).result()

            host = np.ones(shape, np.dtype(dtype))

            def h2d(host=host, shape=shape, dtype=dtype):
                jax.block_until_ready(transfer.upload(shape, np.dtype(dtype), sharding,
                                                      lambda i: host[i]))

            d2h(), h2d()  # compile the pack/unpack programs
            row.append(f"{mode}: D2H {gbps(n, d2h):6.2f} GB/s, H2D {gbps(n, h2d):6.2f} GB/s")
        print(f"{np.dtype(dtype).name:>8} {args.mb} MB | " + " | ".join(row))
    os.environ.pop(transfer.TRANSFER_ENV, None)


if __name__ == "__main__":
    main()
