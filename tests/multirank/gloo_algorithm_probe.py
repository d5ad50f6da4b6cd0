"""Gloo all-reduces on either side of hvrep's switch to Gloo's halving-doubling algorithm (run by
test_gloo_algorithms.py, under ``horovodrun --gloo`` with 3 ranks: not a power of 2, so chunks are uneven).

For ``HVREP_GLOO_BCUBE_BYTES`` unset (hvrep's default: halving-doubling up to 1 MiB) and ``0`` (Gloo's ring for
every size), each dtype and each length, from one element (fewer than the ranks) to just past the default's
limit: values whose sum is exact in the dtype (the sum must equal the one computed here) and random values (the
ranks must agree bit for bit). One JSON line per rank.

    horovodrun --gloo -np 3 -H localhost:3 python tests/multirank/gloo_algorithm_probe.py
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hvrep import compat
from hvrep.compat.horovod_patches import GLOO_BCUBE_BYTES as LIMIT

PREFIX = "GLOO_ALGORITHM_PROBE "


def main() -> int:
    hvd = compat.import_horovod()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict = {"rank": rank, "size": size, "exact": [], "digests": {}}
    for setting in ("default", "0"):
        if setting == "default":
            os.environ.pop("HVREP_GLOO_BCUBE_BYTES", None)
        else:
            os.environ["HVREP_GLOO_BCUBE_BYTES"] = setting
        for dtype in (np.float32, np.float16, np.int32, np.float64):
            width = np.dtype(dtype).itemsize
            for n in (1, 2, size, 7, 1000, 4096 + 1, LIMIT // width, LIMIT // width + 3):
                ramp = np.arange(n) % 97  # sums stay exact in fp16
                got = hvd.allreduce(tf.constant((ramp * (rank + 1)).astype(dtype)), op=hvd.Sum,
                                    name=f"exact_{setting}_{np.dtype(dtype).name}_{n}").numpy()
                want = (ramp * sum(range(1, size + 1))).astype(dtype)
                out["exact"].append([setting, np.dtype(dtype).name, n, bool(np.array_equal(got, want))])
                if dtype in (np.float32, np.float16):
                    rng = np.random.default_rng(1000 * rank + n)
                    noisy = hvd.allreduce(tf.constant(rng.standard_normal(n).astype(dtype)), op=hvd.Sum,
                                          name=f"noisy_{setting}_{np.dtype(dtype).name}_{n}").numpy()
                    out["digests"][f"{setting}/{np.dtype(dtype).name}/{n}"] = hashlib.sha256(
                        noisy.tobytes()).hexdigest()[:16]
    print(PREFIX + json.dumps(out), flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
