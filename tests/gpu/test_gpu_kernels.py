"""The compiled kernels on CUDA, without an engine (a minute): the fused Triton op against the
float64 reference of ``test_ops.py`` (fp32 and bf16, random rows with row 0, monitor tokens,
extreme scores, capture), the Inductor-compiled add of sites without a monitor, the op on
overflowing rows (input safety), the Triton fold of the built-in controllers against the
sequential reference of ``test_controllers.py``, and the gate statistics: the Triton step
against numpy (``test_gate_stats.py``), ``GateStats`` on CUDA against the CPU one (graph
replays, staging, quiet flushes), the device index fill against the host fill
(``test_device_fill.py``), the step's shared uploads (``test_step_upload.py``) and
``TokenRows``' publish."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from dynsteer.engine_ext.worker import layout

KERNEL_SHAPES = [(1, 2048), (33, 4096), (4096, 4096), (16384, 8192), (7, 576)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("extreme", [False, True], ids=["normal", "extreme"])
@pytest.mark.parametrize("tokens,hidden", KERNEL_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_op_matches_float64(dtype: torch.dtype, tokens: int, hidden: int,
                                  extreme: bool) -> None:
    """Steered values within 1e-4 (fp32) / 8e-3 (bf16, one rounding) relative to float64,
    gates within 1e-4, capture rows within 1e-4; finite, and row-0 tokens untouched."""
    from test_ops import capture_reference, make_inputs, on, reference, steer


    x, h, b = make_inputs(tokens, hidden, dtype, seed=tokens + hidden, extreme=extreme)
    want, gates, scores = reference(x, h, b)
    want_capture = capture_reference(x, h, b)
    xc, hc, bc = on("cuda", x, h, b)
    out = steer(xc, hc, bc).cpu()
    gate = bc.gate_score[layout.GATE].cpu()
    capture = bc.capture.cpu()
    monitored = ~torch.isnan(scores[:tokens])
    row0 = b.index[layout.INDEX_ROW, :tokens] == 0
    rel = ((out.double() - want).abs() / (want.abs() + 1)).max().item()
    assert rel <= (1e-4 if dtype == torch.float32 else 8e-3)
    if monitored.any():
        assert (gate[:tokens][monitored].double() - gates[:tokens][monitored]).abs().max() <= 1e-4
    assert torch.isfinite(out).all() and torch.isfinite(gate).all()
    assert torch.equal(out[row0], x[row0])
    assert (capture.double() - want_capture).abs().max().item() <= 1e-4


@pytest.mark.parametrize("tokens,hidden", [(1, 4096), (33, 4096), (4096, 4096)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_matches_float64(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    """``ops.steer_add`` (sites without a monitor), compiled by Inductor for CUDA, against the
    float64 reference (``test_ops.py``'s assertions)."""
    from test_ops import test_steer_add_matches_float64 as check

    check(tokens, hidden, dtype, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_poisoned_rows_are_never_written(dtype: torch.dtype) -> None:
    """The op on ``test_ops.py``'s overflowing rows: every output finite and within the
    stream limit, poisoned rows untouched, NaN scores gate nothing."""
    from test_ops import on, poison_inputs, steer

    from dynsteer.engine_ext.worker import ops

    x, h, b = on("cuda", *poison_inputs(64, 4096, dtype, seed=3))
    out = steer(x, h, b)
    rows, probe_rows = b.index[layout.INDEX_ROW, :64], b.index[layout.INDEX_PROBE, :64]
    gate = b.gate_score[layout.GATE, :64]
    assert torch.isfinite(out).all()
    assert (out.float().abs() <= ops.stream_limit(dtype)).all()
    assert torch.equal(out[rows == 1], x[rows == 1])
    assert (gate[probe_rows == 1] == 0).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_control_fold_matches_the_sequential_reference(seed: int) -> None:
    """The compiled Triton fold of the built-in controllers, step by step."""
    from test_controllers import _reference_run, _rows, _steps

    from dynsteer.engine_ext.worker import ops

    control = _rows().cuda()
    for tokens, index, gate_score in _steps(seed):
        ops.control_step(index.cuda(), gate_score.cuda(), control, tokens)
    assert torch.isclose(control.cpu(), _reference_run(seed), atol=1e-5, equal_nan=True).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gate_statistics_step_matches_numpy(seed: int) -> None:
    """The compiled Triton step of the gate statistics (read-outs, writes, fold)."""
    from test_gate_stats import OPS, _initial, _numpy_run, _steps

    from dynsteer.engine_ext.worker.kernels.gate_stats import stats_step_triton

    stats, sites = (torch.from_numpy(a).cuda() for a in _initial())
    ops = torch.zeros(layout.OPS_HEAD + (2 + layout.STAT_COLS) * stats.shape[1], dtype=torch.int64,
                      device="cuda")
    readout = torch.zeros_like(stats)
    readouts = []
    for i, (index, gate_score) in enumerate(_steps(seed)):
        reads, writes = OPS.get(i, ([], {}))
        values = [len(reads), len(writes), 1, *reads, *writes]
        values += [int(v) for column in writes.values() for v in column]
        ops[:len(values)] = torch.tensor(values)
        stats_step_triton(ops, torch.from_numpy(index).cuda(), torch.from_numpy(gate_score).cuda(),
                          stats, sites, readout)
        readouts.append(readout[:, :len(reads)].T.tolist())
    want = _numpy_run(seed)
    assert np.array_equal(stats.cpu().numpy(), want[0])
    assert np.array_equal(sites.cpu().numpy(), want[1])
    assert readouts == want[2]


def _gate_stats_run(device: str, quiet: bool = False) -> dict[str, Any]:
    """``GateStats`` driven as the worker drives it; ``quiet``: two flushes in three ask for no
    snapshot (refused where the replay reads out or writes; the drain's snapshot must still be
    current)."""
    from test_gate_stats import _initial, _steps

    from dynsteer.engine_ext.worker import gate_stats as gs

    steps = _steps(3) + _steps(4)
    width = steps[0][0].shape[1]
    index = torch.zeros(steps[0][0].shape, dtype=torch.int32, device=device)
    gate_score = torch.zeros(2, width, device=device)
    stats = gs.GateStats(index, gate_score, 3, 6)
    initial = _initial()[0]
    for slot in range(1, 6):
        stats.write(slot, initial[:, slot].copy())
    taken = []
    for i, (ix, gsc) in enumerate(steps):
        stats.flush(quiet=quiet and i % 3 != 0)
        taken += [(o, c.tolist()) for o, c in stats.take()]  # as the report hook does
        if i in (5, 9):  # slot 2 finishes and is given to a new request at once
            stats.read(2, f"old {i}")
            stats.write(2, gs.fresh_column(1, 0, 0))
        stats.begin_step(width, True)
        index.copy_(torch.from_numpy(ix))
        gate_score.copy_(torch.from_numpy(gsc))
        stats.frontiers()
        taken += [(o, c.tolist()) for o, c in stats.take()]
    stats.flush(quiet=quiet)  # the last step's: the drain brings its snapshot back
    stats.drain()
    drained = [a.tolist() for a in stats.frontiers()]
    stats.read(4, "last")
    stats.drain()
    taken += [(o, c.tolist()) for o, c in stats.take(wait=True)]
    return {"stats": stats.stats.cpu().numpy(), "sites": stats.site_totals(),
            "taken": sorted(taken),
            "frontiers": [drained, [a.tolist() for a in stats.frontiers()]]}


@pytest.mark.parametrize("quiet", [False, True], ids=["every flush", "quiet flushes"])
def test_gate_stats_on_cuda_equal_the_cpu_ones(quiet: bool) -> None:
    """``GateStats`` on CUDA (replays of its CUDA graphs, op uploads, read-backs) against the
    same calls on CPU: the counters, the site totals, the read-outs and the frontiers."""
    cpu = _gate_stats_run("cpu")
    gpu = _gate_stats_run("cuda", quiet)
    assert np.array_equal(gpu["stats"], cpu["stats"])
    assert np.array_equal(gpu["sites"], cpu["sites"])
    assert len(cpu["taken"]) == 3 and gpu["taken"] == cpu["taken"]
    assert gpu["frontiers"] == cpu["frontiers"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_index_fill_matches_the_host_fill(seed: int) -> None:
    """The device fill, compiled, against the host fill over ``test_device_fill.py``'s steps."""
    from test_device_fill import compare_fills

    got = compare_fills(seed, "cuda")
    assert got["steps"] > 20
    assert not got["mismatch"], got["mismatch"][:3]
    assert got["reports"] and all(a == b for a, b in got["reports"])


def test_cuda_events_record_on_the_current_stream() -> None:
    from dynsteer.engine_ext.worker import cuda_events

    side, event = torch.cuda.Stream(), torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s on the side stream
        cuda_events.record(event, torch.cuda.current_device())
    on_side = not event.query()  # recorded behind the sleep
    cuda_events.record(event, torch.cuda.current_device())  # the default stream is idle
    torch.cuda.current_stream().synchronize()
    assert on_side and event.query()


def test_step_upload_regions_read_what_was_last_written() -> None:
    from test_step_upload import upload_steps

    seen = upload_steps("cuda")
    assert len(seen) == 20
    assert all(device == want for step in seen for device, want in step.values())


def _publish(device: str) -> list[np.ndarray]:
    """TokenRows' publish (whole-buffer staging, two turns) over widths that grow, shrink and
    clear."""
    from dynsteer.engine_ext.worker.token_rows import TokenRows

    rows = TokenRows(64, torch.device(device))
    rng = np.random.default_rng(5)
    seen = []
    for n in (10, 40, 3, 0, 64, 17, 0, 0, 33):
        rows._publish(rng.integers(1, 100, (layout.INDEX_ROWS, n)).astype(np.int32))
        seen.append(rows.buffer.cpu().numpy().copy())
    return seen


def test_token_rows_publish_on_cuda_equals_cpu() -> None:
    assert all(np.array_equal(a, b)
               for a, b in zip(_publish("cuda"), _publish("cpu"), strict=True))
