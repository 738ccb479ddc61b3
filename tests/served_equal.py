"""The check the checkpoint tests share: every request served, in shared batches (but under `none`), and each image
within 1 of diffusers' reference (uint8)."""

import numpy as np


def assert_served_equal(results, params, references, strategy: str, label="") -> None:
    assert all(r.ok for r in results), [r.error for r in results]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in results) > 1, "the requests never shared a batch"
    for r, p, ref in zip(results, params, references):
        diff = np.abs(np.asarray(r.image.convert("RGB"), dtype=np.int16) - ref)
        assert diff.max() <= 1, (label, p, diff.max())
