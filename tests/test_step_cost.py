"""Per-step host work does not grow with the number of requests (no engine, CPU).

A decode step of the worker's steering state (index fill, telemetry fold, prefix-guard report)
is traced line by line: the number of lines of dynsteer's Python it executes must be the same
with 8 and with 200 gated and statically steered requests in the batch, whatever numpy does.
This is the CI guard of the serving-scale issue: a Python loop over requests on the step path
fails it, deterministically (a timing check would be flaky on shared CI machines).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import dynsteer
import dynsteer.engine_ext
import dynsteer.probes
from dynsteer.controller.extra_args import ACTIVATIONS_KEY, WIRE_KEY
from dynsteer.controller.spec import parse_spec
from dynsteer.controller.wire import spec_to_wire
from dynsteer.engine_ext.worker.capture_sink import EngineSink
from dynsteer.engine_ext.worker.state import SteeringState

PACKAGE = tuple(str(Path(module.__file__).parent) for module in
                (dynsteer, dynsteer.engine_ext, dynsteer.controller, dynsteer.probes))
"""Lines are counted in dynsteer's own code: a loop over requests is a loop there; library
code it calls and code the interpreter runs in between (a signal handler, a finalizer) is not
the step's to count."""
HIDDEN = 64
SITES = tuple(("post_block", layer) for layer in range(4))
PROMPT = 5
BLOCK = 16


CONTROLLERS = [None, {"name": "latch", "k": 10**6}, {"name": "budget", "tokens": 10**6},
               {"name": "hysteresis", "t_on": 1e5, "t_off": -1e5}]
"""Built-in controllers whose mode never changes in these steps (a change is an event: a
little Python once per request, not per step)."""


def spec(i: int) -> dict:
    rng = np.random.default_rng(i)
    vector = (rng.standard_normal(HIDDEN) * 0.1).tolist()
    if i % 2:
        return {"steer": [{"vector": vector, "layers": [1, 2]}]}
    gated: dict = {"gate": {"probe": {"weights": rng.standard_normal(HIDDEN).tolist()},
                            "layer": 1, "steer": [{"vector": vector, "layers": [1, 3]}]}}
    controller = CONTROLLERS[(i // 2) % len(CONTROLLERS)]
    return gated if controller is None else {**gated, "controller": controller}


CAPTURE = {"sites": ["post_block@1", "post_block@3"], "rows": PROMPT + 8, "positions": "all",
           "dtype": "float32", "when": "always"}
"""A request capturing its own activations (what the frontend writes, ``ACTIVATIONS_KEY``)."""


def make_state(requests: int, spec_of: Callable[[int], dict],
               capture: bool = False, sink: Path | None = None) -> SteeringState:
    """A worker state with ``requests`` requests, request ``i`` in slot ``i + 1`` with spec
    ``spec_of(i)``; with ``capture``, every request also captures its activations (into an
    engine sink in the folder ``sink``, if given)."""
    state = SteeringState(SITES, HIDDEN, max_rows=requests + 1, max_tokens=4096,
                          max_slots=requests + 1, device=torch.device("cpu"), block_size=BLOCK,
                          capture_lanes=2 if capture else 0,
                          capture_tokens=requests * CAPTURE["rows"] + 1)
    if sink is not None:
        state.capture.sinks = {"s": EngineSink("s", str(sink))}
    for i in range(requests):
        extra = {WIRE_KEY: spec_to_wire(parse_spec(spec_of(i)))}
        if capture:
            extra[ACTIVATIONS_KEY] = CAPTURE if sink is None else {**CAPTURE, "sink": "s"}
        state.add_request(f"r{i}", i + 1, extra, PROMPT)
    return state


def decode_lines(state: SteeringState, slots: np.ndarray, steps: int, gate: float,
                 *device_slots: torch.Tensor) -> int:
    """Python lines executed by the last of ``steps`` decode steps of the batch ``slots``
    (the steps before it, from the first decode position on, are not counted; no block
    crossing, so the prefix-guard report has nothing to say), every token's gate ``gate``:
    0 never steers, so no gated request's clean prefix settles and the report passes over
    the slots every step; 1 steers from the first decode position on, so every one settles
    after that step (random gates would make the two batch sizes differ in which of those
    they see)."""
    requests = len(slots)
    counted = 0

    def tracer(frame, event, arg):
        nonlocal counted
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None  # numpy's, torch's or anything the interpreter runs in between
        if event == "line":
            counted += 1
        return tracer

    for k in range(steps):
        state.gate[:requests] = gate
        if k == steps - 1:
            # A garbage collection inside the traced step would run the finalizers of objects
            # that earlier tests in this process left behind.
            gc.collect()
            gc.disable()
            sys.settrace(tracer)
        try:
            state.fill(slots, np.full(requests, PROMPT + k), np.ones(requests, np.int64),
                       *device_slots)
            assert state.after_forward() == {}
        finally:
            sys.settrace(None)
            gc.enable()
    return counted


def positioned(i: int) -> dict:
    """:func:`spec` with its entries on some positions only (stretches, see
    ``worker/position_rows.py``), different per request."""
    def narrow(entries: list[dict]) -> list[dict]:
        return [{**e, "positions": [-1 - i % 3, f"g{i % 2}:g{3 + i % 4}"]} for e in entries]

    found = spec(i)
    if "steer" in found:
        return {**found, "steer": narrow(found["steer"])}
    return {**found, "gate": {**found["gate"], "steer": narrow(found["gate"]["steer"])}}


def lines_per_step(requests: int, gate: float, capture: bool = False,
                   spec_of: Callable[[int], dict] = spec, sink: Path | None = None) -> int:
    """Python lines executed by one decode step with ``requests`` requests (the one after the
    first decode step)."""
    state = make_state(requests, spec_of, capture, sink)
    slots = np.arange(1, requests + 1)
    state.fill(slots, np.zeros(requests, np.int64), np.full(requests, PROMPT))  # prefill
    state.after_forward()
    return decode_lines(state, slots, 2, gate)


@pytest.mark.parametrize("gate", [0.0, 1.0])
def test_step_lines_do_not_depend_on_the_number_of_requests(gate):
    small, large = lines_per_step(8, gate), lines_per_step(200, gate)
    assert small > 0
    assert large == small, f"{small} Python lines per step with 8 requests, {large} with 200"


def test_capturing_step_lines_do_not_depend_on_the_number_of_requests():
    """The same with every request capturing its own activations at two sites (rows noted
    per step for prompt and generated positions)."""
    small, large = lines_per_step(8, 1.0, capture=True), lines_per_step(200, 1.0, capture=True)
    assert large == small, f"{small} Python lines per step with 8 requests, {large} with 200"


def test_sink_step_lines_do_not_depend_on_the_number_of_requests(tmp_path):
    """The same with every request's rows going to an engine sink: a step that sends no
    stretch (they go every 16 positions) does what a capturing step does."""
    small = lines_per_step(8, 1.0, capture=True, sink=tmp_path / "small")
    large = lines_per_step(200, 1.0, capture=True, sink=tmp_path / "large")
    assert large == small, f"{small} Python lines per step with 8 requests, {large} with 200"


def test_positioned_step_lines_do_not_depend_on_the_number_of_requests():
    """The same with every request's entries on some positions only: each token's row is
    looked up among its request's stretches, vectorized."""
    small = lines_per_step(8, 1.0, spec_of=positioned)
    large = lines_per_step(200, 1.0, spec_of=positioned)
    assert large == small, f"{small} Python lines per step with 8 requests, {large} with 200"


def lines_per_kept_step(requests: int) -> tuple[int, dict[str, int]]:
    """Python lines executed by a decode step of the batch before, filled on the device as on
    vLLM's V2 runner (the index kept), with ``requests`` gated and statically steered requests
    (no controllers: their tokens go to the host); and the state's index-fill counts. The
    kernel is not launched here (its index is checked in ``test_device_fill.py``): the steps
    count the host's lines only (and with the index left empty no token reaches the gate
    statistics, so the report passes over the slots every step)."""
    state = make_state(requests, lambda i: {"gate": spec(2 * i)["gate"]} if i % 2
                       else spec(2 * i + 1))
    state.enable_device_fill(torch.zeros(requests + 1, dtype=torch.int32),
                             torch.zeros(4096, dtype=torch.int64))
    state.device_fill._launch = lambda **kw: None
    slots = np.arange(1, requests + 1)
    device_slots = torch.from_numpy(slots.astype(np.int32))
    state.fill(slots, np.zeros(requests, np.int64), np.full(requests, PROMPT), device_slots)
    state.after_forward()
    # the first decode step (filled), one kept (after the slot checks), the measured one
    return decode_lines(state, slots, 3, 0.0, device_slots), state.index_fills


def test_kept_step_lines_do_not_depend_on_the_number_of_requests():
    """The same guard for the steps most of a serving load is made of on vLLM's V2 runner:
    decode steps of the batch before, whose index the device keeps."""
    (small, fills), (large, _) = lines_per_kept_step(8), lines_per_kept_step(200)
    assert fills == {"device": 2, "host": 0, "kept": 2}
    assert small > 0
    assert large == small, f"{small} Python lines per kept step with 8 requests, {large} with 200"


def test_the_report_names_only_requests_that_crossed_a_block():
    """At a block boundary the report holds the gated requests whose clean prefix grew."""
    state = SteeringState(SITES, HIDDEN, max_rows=8, max_tokens=64, max_slots=8,
                          device=torch.device("cpu"), block_size=4)
    state.add_request("g", 1, {WIRE_KEY: spec_to_wire(parse_spec(spec(0)))}, prompt_len=3)
    state.fill(np.array([1]), np.array([0]), np.array([3]))
    state.gate[:3] = 0.0  # not fired: the clean prefix is everything processed
    assert state.after_forward() == {}  # 3 positions: no whole block yet
    state.fill(np.array([1]), np.array([3]), np.array([1]))
    state.skip_step()
    assert state.after_forward() == {"g": (4, None)}
