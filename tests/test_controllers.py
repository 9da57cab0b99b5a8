"""Controllers without an engine: the built-ins' device fold against a sequential reference
(torch, and the Triton kernel in Triton's interpreter), the spec's controller field, actions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from triton_interpreter import run_interpreted

from dynsteer.controller.contract import SpecError
from dynsteer.controller.controllers import BUILTINS, Action, Actions
from dynsteer.controller.spec import ModelShape, check_against_model, parse_spec
from dynsteer.engine_ext.worker import layout, ops

NAN = float("nan")


def reference_fold(row: list[float], gates: list[float], scores: list[float]) -> list[float]:
    """One step of one built-in controller's row, token by token in plain Python (what the
    module docstring of :mod:`dynsteer.controller.controllers` promises)."""
    kind, floor, scale, count, p0, p1, p2 = row[:7]
    if not gates:
        return row
    if kind == layout.KIND_LATCH:
        count += sum((s > p1) if not math.isnan(p1) else (g > 0.5)
                     for g, s in zip(gates, scores, strict=True))
        floor = 1.0 if count >= p0 else floor
    elif kind == layout.KIND_HYSTERESIS:
        for s in scores:
            if s > p0:
                scale = 1.0
            elif s < p1:
                scale = 0.0
    elif kind == layout.KIND_PROPORTIONAL:
        if not math.isnan(scores[-1]):
            scale = p0 * min(max(scores[-1] - p1, 0.0), p2)
    elif kind == layout.KIND_BUDGET:
        count += sum(g > 0.5 for g in gates)
        scale = 0.0 if count >= p0 else scale
    return [kind, floor, scale, count, p0, p1, p2, row[7]]


def _rows() -> torch.Tensor:
    """Row 0 unused; then every kind, one Python row (kind 0), and variants."""
    return torch.tensor([
        [0, 0, 0, 0, 0, 0, 0, 0],
        [layout.KIND_LATCH, 0, 1, 0, 6, NAN, NAN, 0],
        [layout.KIND_LATCH, 0, 1, 0, 4, 0.8, NAN, 0],
        [layout.KIND_HYSTERESIS, 1, 0, 0, 0.6, -0.4, NAN, 0],
        [layout.KIND_PROPORTIONAL, 1, 0, 0, 2.0, 0.2, 0.5, 0],
        [layout.KIND_BUDGET, 0, 1, 0, 9, NAN, NAN, 0],
        [0, 0.5, 0.25, 0, NAN, NAN, NAN, 0],
        [layout.KIND_HYSTERESIS, 1, 1, 0, 0.0, 0.0, NAN, 0],
    ], dtype=torch.float32)


def _steps(seed: int, n_steps: int = 12, width: int = 64):
    """Random steps: (tokens, index, gate_score) with some NaN scores and chunks; columns past
    the step's tokens are zero, as the worker's token index keeps them (the CUDA fold reads
    them all), and their gates and scores are noise."""
    g = torch.Generator().manual_seed(seed)
    for step in range(n_steps):
        tokens = 1 + int(torch.randint(0, width - 4, (1,), generator=g))
        index = torch.zeros(layout.INDEX_ROWS, width, dtype=torch.int32)
        index[layout.INDEX_CONTROL, :tokens] = torch.randint(0, 8, (tokens,), generator=g,
                                                          dtype=torch.int32)
        gate_score = torch.rand(2, width, generator=g)
        gate_score[layout.SCORE] = torch.randn(width, generator=g)
        if step % 3 == 0:
            gate_score[layout.SCORE, 0] = NAN
        yield tokens, index, gate_score


def _reference_run(seed: int) -> torch.Tensor:
    rows = _rows().tolist()
    for tokens, index, gate_score in _steps(seed):
        k = index[layout.INDEX_CONTROL, :tokens].tolist()
        for r in range(1, len(rows)):
            if rows[r][layout.CTL_KIND] == 0:
                continue
            mine = [t for t in range(tokens) if k[t] == r]
            rows[r] = reference_fold(rows[r], [float(gate_score[layout.GATE, t]) for t in mine],
                                     [float(gate_score[layout.SCORE, t]) for t in mine])
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_control_step_matches_the_sequential_reference(seed):
    control = _rows()
    for tokens, index, gate_score in _steps(seed):
        ops.control_step(index, gate_score, control, tokens)
    torch.testing.assert_close(control, _reference_run(seed), equal_nan=True)


TRITON_CHECK = """
import json
from test_controllers import _rows, _steps
from dynsteer.engine_ext.worker.kernels import _tl, control_fold
_tl.FOLD_BLOCK = 16  # a step spans several blocks
out = []
for seed in (0, 1, 2):
    control = _rows()
    scratch = control_fold.new_fold_scratch(control)
    for tokens, index, gate_score in _steps(seed):
        control_fold.control_step_triton(index, gate_score, control, scratch)
    out.append(control.tolist())
print(json.dumps(out))
"""


def test_triton_control_kernel_matches_torch_in_the_interpreter():
    """The CUDA kernels' code, run by Triton's CPU interpreter (blocks of 16 tokens, so a
    step spans several blocks and atomics meet), equals the sequential reference (the GPU
    check runs it compiled)."""
    pytest.importorskip("triton")
    for seed, got in zip((0, 1, 2), run_interpreted(TRITON_CHECK), strict=True):
        want = _reference_run(seed)
        torch.testing.assert_close(torch.tensor(got), want, equal_nan=True)


SHAPE = ModelShape(hidden_size=4, num_layers=2,
                   sites=frozenset({("post_block", 0), ("post_block", 1)}))
GATE = {"probe": {"weights": [1.0, 0, 0, 0]}, "layer": 0, "steer": [{"vector": [0, 1.0, 0, 0],
                                                                       "layers": [1]}]}


def check(spec: dict) -> None:
    check_against_model(parse_spec(spec), SHAPE)


def test_builtin_controllers_are_accepted():
    for spec in ({"name": "latch"}, {"name": "latch", "k": 3, "threshold": 0.5},
                 {"name": "hysteresis", "t_on": 1.0, "t_off": -1.0},
                 {"name": "proportional", "gain": 2.0, "threshold": 0.1, "max": 3.0},
                 {"name": "budget", "tokens": 10}):
        check({"gate": GATE, "controller": spec, "session": "user-1/conv:7"})
    assert set(BUILTINS) == {"latch", "hysteresis", "proportional", "budget"}


@pytest.mark.parametrize(("controller", "message"), [
    ({"name": "nope"}, "dynsteer.controller.name: unknown controller 'nope' (known: budget, "),
    ({"name": "latch", "k": 0}, "dynsteer.controller.k: Input should be greater than or equal"),
    ({"name": "latch", "bogus": 1}, "dynsteer.controller.bogus: Extra inputs are not"),
    ({"name": "hysteresis", "t_on": 0.0, "t_off": 1.0},
     "dynsteer.controller: t_off must be at most t_on"),
    ({"name": "hysteresis", "t_on": 0.0}, "dynsteer.controller.t_off: Field required"),
    ({"name": "budget", "tokens": float("nan")}, "dynsteer.controller.tokens: "),
])
def test_bad_controllers_name_the_field(controller, message):
    with pytest.raises(SpecError) as e:
        check({"gate": GATE, "controller": controller})
    assert str(e.value).startswith(message), str(e.value)


def test_a_controller_needs_a_gate():
    with pytest.raises(SpecError, match=r"^dynsteer.controller: a controller acts on the gate"):
        check({"controller": {"name": "latch"}})


@pytest.mark.parametrize("session", ["", "a b", "x" * 257, "é"])
def test_bad_sessions_are_refused(session):
    with pytest.raises(SpecError, match=r"^dynsteer.session: "):
        parse_spec({"session": session})


def test_actions_are_checked():
    ok = Actions.of([3, 4], Action.SCALE, [0.5, 2.0])
    assert len(ok.check()) == 2
    with pytest.raises(ValueError, match="unknown action"):
        Actions(np.array([1]), np.array([42], np.int8), np.array([0.0], np.float32)).check()
    with pytest.raises(ValueError, match="finite"):
        Actions.of([1], Action.SCALE, float("inf")).check()
    with pytest.raises(ValueError, match="index into names"):
        Actions.of([1], Action.SWITCH_VECTOR, 0.0).check()
    assert len(Actions.of([1], Action.SWITCH_VECTOR, 0.0, names=("v",)).check()) == 1
