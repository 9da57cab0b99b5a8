"""The device-side gate statistics' fold: numpy (the CPU implementation) against a per-token
reference in plain Python, and the Triton kernel (in Triton's interpreter) against numpy."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dynsteer.engine_ext.prefix_guard.guard import DYNAMIC_EPSILON, NONE
from dynsteer.engine_ext.worker import gate_stats as gs
from dynsteer.engine_ext.worker import ops

SLOTS, SITES, WIDTH = 6, 3, 40


def _initial() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slots 1-4 hold requests (prompt lengths, dynamic-from positions and sites differ)."""
    stats = np.zeros((gs.STAT_COLS, SLOTS), dtype=np.int64)
    for k, (prompt, dynamic_from, site) in enumerate(
            [(3, 0, 0), (5, 5, 1), (2, NONE, 2), (4, 0, 1)], start=1):
        stats[:, k] = gs.fresh_column(prompt, dynamic_from, site)
    return stats, np.full(SLOTS, -np.inf, dtype=np.float32), np.zeros((SITES, 2), np.int64)


def _steps(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Steps of (index, gate_score): chunks of positions per slot, some recomputed (a
    preempted request), NaN scores, gates at the thresholds, a slot past the table, padding
    without probe rows."""
    rng = np.random.default_rng(seed)
    frontier = dict.fromkeys(range(1, 5), 0)
    steps = []
    for _ in range(6):
        index = np.zeros((ops.INDEX_ROWS, WIDTH), dtype=np.int32)
        gate_score = np.zeros((2, WIDTH), dtype=np.float32)
        t = 0
        for k in rng.permutation(4) + 1:
            start = frontier[k] - (2 if rng.random() < 0.2 and frontier[k] > 2 else 0)
            n = int(rng.integers(1, 6))
            index[ops.INDEX_PROBE, t:t + n] = 1
            index[ops.INDEX_SLOT, t:t + n] = k
            index[ops.INDEX_POS, t:t + n] = np.arange(start, start + n)
            frontier[k] = max(frontier[k], start + n)
            t += n
        index[ops.INDEX_PROBE, t] = 1
        index[ops.INDEX_SLOT, t] = SLOTS + 3  # ignored
        gates = rng.choice([0.0, DYNAMIC_EPSILON, 0.002, 0.5, 0.7, 1.0], size=t + 1)
        scores = rng.normal(size=t + 1).astype(np.float32) * 4
        scores[rng.random(t + 1) < 0.1] = np.nan
        gate_score[ops.GATE, : t + 1], gate_score[ops.SCORE, : t + 1] = gates, scores
        steps.append((index, gate_score))
    return steps


def _numpy_run(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    stats, max_score, sites = _initial()
    for index, gate_score in _steps(seed):
        gs.fold_numpy(index, gate_score, stats, max_score, sites)
    return stats, max_score, sites


def test_numpy_fold_matches_a_per_token_reference():
    stats, max_score, sites = _initial()
    for index, gate_score in _steps(0):
        frontier = stats[gs.UPTO].copy()
        for t in range(WIDTH):
            k, p = int(index[ops.INDEX_SLOT, t]), int(index[ops.INDEX_POS, t])
            if not index[ops.INDEX_PROBE, t] or k >= SLOTS:
                continue
            g, s = float(gate_score[ops.GATE, t]), float(gate_score[ops.SCORE, t])
            on = g > gs.GATE_ON
            sites[stats[gs.SITE, k]] += (1, on)
            if p >= frontier[k]:
                stats[gs.MONITORED, k] += 1
                prompt = p < stats[gs.PROMPT_LEN, k]
                stats[gs.GATED_PREFILL, k] += on and prompt
                stats[gs.GATED_DECODE, k] += on and not prompt
                if on and not prompt:
                    stats[gs.FIRST_DECODE_GATED, k] = min(stats[gs.FIRST_DECODE_GATED, k], p)
            if not math.isnan(s):
                max_score[k] = max(max_score[k], s)
            if g > DYNAMIC_EPSILON and p >= stats[gs.DYNAMIC_FROM, k]:
                stats[gs.FIRST_DYNAMIC, k] = min(stats[gs.FIRST_DYNAMIC, k], p)
            stats[gs.UPTO, k] = max(stats[gs.UPTO, k], p + 1)
        stats[gs.FRONTIER] = stats[gs.UPTO]
    got = _numpy_run(0)
    np.testing.assert_array_equal(got[0], stats)
    np.testing.assert_array_equal(got[1], max_score)
    np.testing.assert_array_equal(got[2], sites)
    assert (stats[gs.MONITORED, 1:5] > 0).all() and stats[gs.FIRST_DYNAMIC, 3] == NONE


TRITON_CHECK = """
import json, sys
import numpy as np, torch
sys.path.insert(0, {tests!r})
from test_gate_stats import _initial, _steps
from dynsteer.engine_ext.worker import triton_kernels as tk
tk.FOLD_BLOCK = 16  # a step spans several blocks
out = []
for seed in (0, 1):
    stats, max_score, sites = (torch.from_numpy(a) for a in _initial())
    for index, gate_score in _steps(seed):
        tk.stats_fold_triton(torch.from_numpy(index), torch.from_numpy(gate_score), stats,
                             max_score, sites)
    out.append([stats.tolist(), max_score.tolist(), sites.tolist()])
print(json.dumps(out))
"""


def test_triton_stats_kernel_matches_numpy_in_the_interpreter():
    """The CUDA kernels' code, run by Triton's CPU interpreter (blocks of 16 tokens, so a
    step spans several blocks and atomics meet), equals the numpy fold (the GPU check runs it
    compiled)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = TRITON_CHECK.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for seed, (stats, max_score, sites) in zip((0, 1), json.loads(done.stdout), strict=True):
        want = _numpy_run(seed)
        np.testing.assert_array_equal(np.array(stats), want[0])
        torch.testing.assert_close(torch.tensor(max_score), torch.from_numpy(want[1]))
        np.testing.assert_array_equal(np.array(sites), want[2])
