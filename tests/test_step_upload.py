"""The step's shared uploads (engine_ext/worker/step_upload.py): regions of one device buffer
written through a host mirror and sent by one copy. On CUDA (gpu/test_gpu_kernels.py runs
:func:`upload_steps` there) a send copies a span through two staging buffers in turn; here,
on the host, the mirror is the device buffer, so the same steps check the layout and that a
region reads what was written."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

LAYOUT = {"slots": ((5,), np.int32), "table": ((3, 7), np.int32), "ops": ((11,), np.int64)}


def upload_steps(device: str) -> list[dict[str, Any]]:
    """Random writes into random regions, a send each step, the device read back every
    other step (so two sends sometimes run back to back, through both staging buffers): per
    read-back, each region's device contents and what was last written to it."""
    import torch

    from dynsteer.engine_ext.worker.step_upload import StepUpload

    upload = StepUpload(LAYOUT, torch.device(device))
    rng = np.random.default_rng(0)
    written = {name: np.zeros(shape, dtype) for name, (shape, dtype) in LAYOUT.items()}
    seen = []
    for step in range(40):
        for name in LAYOUT:
            if rng.random() < 0.4:
                values = rng.integers(-1000, 1000, written[name].shape)
                upload.host(name)[...] = values
                written[name] = values.astype(written[name].dtype)
                upload.changed(name)
        upload.send()
        if step % 2:
            seen.append({name: (upload.region(name).cpu().numpy().tolist(),
                                written[name].tolist()) for name in LAYOUT})
    return seen


def test_regions_read_what_was_last_written():
    seen = upload_steps("cpu")
    assert len(seen) == 20
    assert all(device == want for step in seen for device, want in step.values())


def test_regions_are_aligned_views_of_one_buffer():
    import torch

    from dynsteer.engine_ext.worker.step_upload import ALIGN, StepUpload

    upload = StepUpload(LAYOUT, torch.device("cpu"))
    base = upload.region("slots").data_ptr()
    for name, (shape, dtype) in LAYOUT.items():
        region = upload.region(name)
        assert tuple(region.shape) == shape and region.dtype == torch.from_numpy(
            np.zeros(0, dtype)).dtype
        assert (region.data_ptr() - base) % ALIGN == 0
    upload.host("table")[1, 2] = 9
    assert upload.region("table")[1, 2].item() == 9  # the host's mirror is the buffer here
    with pytest.raises(KeyError):
        upload.changed("nowhere")
