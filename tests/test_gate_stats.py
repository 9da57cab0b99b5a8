"""The device-side gate statistics' fold: numpy (the CPU implementation) against a per-token
reference in plain Python, and the Triton kernel (in Triton's interpreter) against numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from triton_interpreter import run_interpreted

from dynsteer.engine_ext.prefix_guard.guard import DYNAMIC_EPSILON, NONE
from dynsteer.engine_ext.worker import gate_stats as gs
from dynsteer.engine_ext.worker import layout

SLOTS, SITES, WIDTH = 6, 3, 40


def _initial() -> tuple[np.ndarray, np.ndarray]:
    """Slots 1-4 hold requests (prompt lengths, dynamic-from positions and sites differ)."""
    stats = np.zeros((layout.STAT_COLS, SLOTS), dtype=np.int64)
    for k, (prompt, dynamic_from, site) in enumerate(
            [(3, 0, 0), (5, 5, 1), (2, NONE, 2), (4, 0, 1)], start=1):
        stats[:, k] = gs.fresh_column(prompt, dynamic_from, site)
    return stats, np.zeros((SITES, 2), np.int64)


OPS = {2: ([3], {}), 3: ([2], {2: gs.fresh_column(1, 0, 0), 5: gs.fresh_column(2, 2, 2)}),
       4: ([5, 1], {1: gs.fresh_column(3, 3, 1)})}
"""Read-outs and writes before the fold of some steps: slot 2 is read out and rewritten at
once (a finished request's slot given to a new one), slot 5 joins, slot 1 is replaced."""


def _steps(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Steps of (index, gate_score): chunks of positions per slot, some recomputed (a
    preempted request), NaN scores, gates at the thresholds, a slot past the table, padding
    without probe rows. Positions are entered as offsets where a slot continues where its
    last step ended, else (and sometimes anyway) as positions with ``POS_ABSOLUTE``."""
    rng = np.random.default_rng(seed)
    frontier = dict.fromkeys(range(1, 6), 0)
    ended = dict.fromkeys(range(1, 6), 0)
    steps = []
    for i in range(6):
        index = np.zeros((layout.INDEX_ROWS, WIDTH), dtype=np.int32)
        gate_score = np.zeros((2, WIDTH), dtype=np.float32)
        t = 0
        for k in rng.permutation(5 if i >= 3 else 4) + 1:
            if i in OPS and k in OPS[i][1]:
                frontier[k] = ended[k] = 0
            start = frontier[k] - (2 if rng.random() < 0.2 and frontier[k] > 2 else 0)
            n = int(rng.integers(1, 6))
            index[layout.INDEX_PROBE, t:t + n] = 1
            index[layout.INDEX_SLOT, t:t + n] = k
            if start == ended[k] and rng.random() < 0.8:
                index[layout.INDEX_POS, t:t + n] = np.arange(n)
            else:
                index[layout.INDEX_POS, t:t + n] = np.arange(start, start + n) | layout.POS_ABSOLUTE
            frontier[k] = max(frontier[k], start + n)
            ended[k] = start + n
            t += n
        index[layout.INDEX_PROBE, t] = 1
        index[layout.INDEX_SLOT, t] = SLOTS + 3  # ignored
        gates = rng.choice([0.0, DYNAMIC_EPSILON, 0.002, 0.5, 0.7, 1.0], size=t + 1)
        scores = rng.normal(size=t + 1).astype(np.float32) * 4
        scores[rng.random(t + 1) < 0.1] = np.nan
        scores[rng.random(t + 1) < 0.1] = -0.0
        gate_score[layout.GATE, : t + 1], gate_score[layout.SCORE, : t + 1] = gates, scores
        steps.append((index, gate_score))
    return steps


def _numpy_run(seed: int) -> tuple[np.ndarray, np.ndarray, list[list[list[int]]]]:
    """The numpy fold of every step, after that step's read-outs and writes; returns the
    statistics, the site counts and each step's read-outs."""
    stats, sites = _initial()
    readouts = []
    for i, (index, gate_score) in enumerate(_steps(seed)):
        reads, writes = OPS.get(i, ([], {}))
        readouts.append(stats[:, reads].T.tolist())
        for slot, column in writes.items():
            stats[:, slot] = column
        gs.fold_numpy(index, gate_score, stats, sites)
    return stats, sites, readouts


def test_numpy_fold_matches_a_per_token_reference():
    stats, sites = _initial()
    best: dict[int, float] = {}
    ended = dict.fromkeys(range(SLOTS), 0)
    for i, (index, gate_score) in enumerate(_steps(0)):
        for slot, column in OPS.get(i, ([], {}))[1].items():
            stats[:, slot] = column
            best.pop(slot, None)
            ended[slot] = 0
        frontier = stats[layout.UPTO].copy()
        started = dict(ended)
        for t in range(WIDTH):
            k, e = int(index[layout.INDEX_SLOT, t]), int(index[layout.INDEX_POS, t])
            if not index[layout.INDEX_PROBE, t] or k >= SLOTS:
                continue
            p = e - layout.POS_ABSOLUTE if e >= layout.POS_ABSOLUTE else started[k] + e
            ended[k] = p + 1
            g, s = gate_score[layout.GATE, t], gate_score[layout.SCORE, t]  # compared in float32
            on = g > layout.GATE_ON
            sites[stats[layout.SITE, k]] += (1, on)
            if p >= frontier[k]:
                stats[layout.MONITORED, k] += 1
                prompt = p < stats[layout.PROMPT_LEN, k]
                stats[layout.GATED_PREFILL, k] += on and prompt
                stats[layout.GATED_DECODE, k] += on and not prompt
                if on and not prompt:
                    first = layout.FIRST_DECODE_GATED
                    stats[first, k] = min(stats[first, k], p)
                if on:
                    stats[layout.FIRST_GATED, k] = min(stats[layout.FIRST_GATED, k], p)
            if not math.isnan(s):
                best[k] = max(best.get(k, -math.inf), float(s))
            if g > DYNAMIC_EPSILON and p >= stats[layout.DYNAMIC_FROM, k]:
                stats[layout.FIRST_DYNAMIC, k] = min(stats[layout.FIRST_DYNAMIC, k], p)
            stats[layout.UPTO, k] = max(stats[layout.UPTO, k], p + 1)
        stats[layout.FRONTIER] = stats[layout.UPTO]
    got, got_sites, _ = _numpy_run(0)
    for k in range(1, SLOTS):  # slot 0 holds no request
        assert gs.key_score(int(got[layout.MAX_SCORE, k])) == best.get(k), k
    got[layout.MAX_SCORE] = stats[layout.MAX_SCORE]
    got[[layout.START, layout.NEXT]] = stats[[layout.START, layout.NEXT]]
    np.testing.assert_array_equal(got, stats)
    np.testing.assert_array_equal(got_sites, sites)
    assert (stats[layout.MONITORED, 1:6] > 0).all() and stats[layout.FIRST_DYNAMIC, 3] == NONE


def test_score_keys_order_like_the_floats():
    values = np.array([-np.inf, -3e38, -2.5, -1e-30, -0.0, 0.0, 1e-30, 1.0, 3e38, np.inf],
                      dtype=np.float32)
    keys = gs.score_key(values)
    assert (np.diff(keys) > 0).all()
    assert [gs.key_score(int(k)) for k in keys] == values.tolist()
    assert gs.key_score(gs.NO_SCORE) is None and (keys > gs.NO_SCORE).all()


TRITON_CHECK = """
import json
import numpy as np, torch
from test_gate_stats import OPS, _initial, _steps
from dynsteer.engine_ext.worker import layout, gate_stats as gs
from dynsteer.engine_ext.worker.kernels import _tl, gate_stats as kernels
_tl.FOLD_BLOCK = 16  # a step spans several blocks
out = []
for seed in (0, 1):
    stats, sites = (torch.from_numpy(a) for a in _initial())
    ops = torch.zeros(layout.OPS_HEAD + (2 + layout.STAT_COLS) * stats.shape[1], dtype=torch.int64)
    readout = torch.zeros_like(stats)
    readouts = []
    for i, (index, gate_score) in enumerate(_steps(seed)):
        reads, writes = OPS.get(i, ([], {{}}))
        values = [len(reads), len(writes), 1, *reads, *writes]
        values += [int(v) for column in writes.values() for v in column]
        ops[:len(values)] = torch.tensor(values)
        kernels.stats_step_triton(ops, torch.from_numpy(index), torch.from_numpy(gate_score),
                             stats, sites, readout)
        readouts.append(readout[:, :len(reads)].T.tolist())
        assert ops[:3].tolist() == [0, 0, 1]
    before = (stats.clone(), sites.clone())
    ops[2] = 0  # an ops-only replay (a query between steps) folds nothing
    kernels.stats_step_triton(ops, torch.from_numpy(index), torch.from_numpy(gate_score), stats,
                         sites, readout)
    assert torch.equal(stats, before[0]) and torch.equal(sites, before[1])
    out.append([stats.tolist(), sites.tolist(), readouts])
print(json.dumps(out))
"""


def test_triton_stats_kernels_match_numpy_in_the_interpreter():
    """The CUDA kernels' code, run by Triton's CPU interpreter (blocks of 16 tokens, so a
    step spans several blocks and atomics meet), equals the numpy fold with the same
    read-outs and writes (the GPU check runs it compiled)."""
    pytest.importorskip("triton")
    for seed, (stats, sites, readouts) in zip((0, 1), run_interpreted(TRITON_CHECK),
                                              strict=True):
        want = _numpy_run(seed)
        np.testing.assert_array_equal(np.array(stats), want[0])
        np.testing.assert_array_equal(np.array(sites), want[1])
        assert readouts == want[2]
