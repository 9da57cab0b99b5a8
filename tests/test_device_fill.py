"""The device fill of the token index (V2 runner on CUDA) against the host fill, driven
through :meth:`.StepIndex.fill` as the runner hook drives it: here the kernel's code runs in
Triton's CPU interpreter; ``gpu/test_gpu_kernels.py`` runs :func:`compare_fills` compiled, on
CUDA (and the engine tests there run the device fill under graph replay)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from triton_interpreter import run_interpreted

SITES = (("post_block", 0), ("post_block", 1), ("post_block", 2))
WIDTH = 48
MAX_BATCH = 8
"""Requests a step can hold (the runner's ``max_num_reqs``)."""


def _kinds() -> dict[str, Any]:
    from dynsteer.controller.extra_args import WIRE_KEY
    from dynsteer.controller.spec import parse_spec
    from dynsteer.controller.wire import spec_to_wire

    def resolved(spec: dict[str, Any]) -> dict[str, Any]:
        return {WIRE_KEY: spec_to_wire(parse_spec(spec))}

    return {
        "by_phase": resolved({"steer": [
            {"vector": [1, 0, 0, 0], "layers": [0], "phase": "prefill"},
            {"vector": [0, 1, 0, 0], "layers": [1, 2], "phase": "decode"}]}),
        "static": resolved({"steer": [{"vector": [0, 0, 1, 0], "layers": [2]}]}),
        "gated": resolved({"gate": {"probe": {"weights": [1, 0, 0, 0], "threshold": 0.5},
                                    "layer": 1, "hook": "post_block",
                                    "steer": [{"vector": [0, 0, 0, 1], "layers": [2]}]}}),
        "plain": None,
    }


class _Pair:
    """Two identical states, one filled on the host and one by the device fill, and the
    runner's persistent batch buffers (rewritten in place each step, as vLLM does)."""

    def __init__(self, device: str) -> None:
        import torch

        from dynsteer.engine_ext.worker.state import SteeringState

        self.on = torch.device(device)
        self.host, self.dev = (SteeringState(SITES, 4, max_rows=8, max_tokens=WIDTH,
                                             max_slots=8, device=self.on, block_size=2)
                               for _ in range(2))
        self.query_start = torch.zeros(MAX_BATCH + 1, dtype=torch.int32, device=self.on)
        self.positions = torch.zeros(WIDTH, dtype=torch.int64, device=self.on)
        self.dev.enable_device_fill(self.query_start, self.positions)

    def add(self, req_id: str, slot: int, extra: Any, prompt_len: int) -> None:
        for s in (self.host, self.dev):
            s.add_request(req_id, slot, extra, prompt_len)

    def remove(self, req_id: str) -> None:
        for s in (self.host, self.dev):
            s.remove_request(req_id)

    def fill(self, slots: list[int], comp: np.ndarray, sched: np.ndarray) -> list[Any]:
        """One step filled by both; how the device's index differs from the host's (slots
        and positions compared where a probe reads them, positions absolute where the host's
        are relative; columns past the step must be zero)."""
        import torch

        from dynsteer.engine_ext.worker import layout
        from dynsteer.engine_ext.worker.token_rows import expand_positions

        tokens = int(sched.sum())
        positions = expand_positions(comp, sched)
        starts = np.full(MAX_BATCH + 1, tokens, np.int32)  # padded with the token count
        starts[: len(slots) + 1] = np.concatenate([[0], np.cumsum(sched)])
        self.query_start.copy_(torch.from_numpy(starts))
        self.positions[:tokens] = torch.from_numpy(positions)
        self.positions[tokens:] = 7  # stale values past the step: never read
        self.host.fill(np.array(slots), comp, sched)
        self.dev.fill(np.array(slots), comp, sched,
                      torch.tensor(slots, dtype=torch.int32).to(self.on))
        a = self.host.token_rows.buffer.cpu().numpy()
        b = self.dev.token_rows.buffer.cpu().numpy()
        mismatch: list[Any] = []
        for row in (layout.INDEX_ROW, layout.INDEX_PROBE, layout.INDEX_CAPTURE,
                    layout.INDEX_CONTROL):
            if not np.array_equal(a[row], b[row]):
                mismatch.append([row, a[row, :tokens + 2].tolist(), b[row, :tokens + 2].tolist()])
        probe = b[layout.INDEX_PROBE, :tokens] != 0  # slot and position: read for these only
        entry = b[layout.INDEX_POS, :tokens]  # the position, or (relative) the host's offset
        right = np.where(entry & layout.POS_ABSOLUTE, entry == positions | layout.POS_ABSOLUTE,
                         entry == a[layout.INDEX_POS, :tokens])
        if np.count_nonzero(probe & ~right):
            mismatch.append(["pos", a[layout.INDEX_POS, :tokens].tolist(), entry.tolist()])
        if not np.array_equal(np.where(probe, a[layout.INDEX_SLOT, :tokens], 0),
                              np.where(probe, b[layout.INDEX_SLOT, :tokens], 0)):
            mismatch.append(["slot"])
        if b[:, tokens:].any():
            mismatch.append(["past the step's tokens"])
        return mismatch

    def forward(self, tokens: int, rng: np.random.Generator) -> list[Any]:
        """The step's forward as both see it (the same random gates and scores); how the
        device's prefix-guard report differs from the host's."""
        import torch

        gates = torch.from_numpy(rng.random(tokens).astype(np.float32)).to(self.on)
        for s in (self.host, self.dev):
            s.gate[:tokens] = gates
            s.score[:tokens] = gates * 2 - 1
        reports = [self.host.after_forward(), self.dev.after_forward()]
        return [] if reports[0] == reports[1] else [["after_forward", *map(str, reports)]]

    def reports(self, ids: list[str]) -> list[list[Any]]:
        """Both states' gate reports of each request, once every step is folded."""
        for s in (self.host, self.dev):
            s.telemetry.drain()
        return [[self.host.telemetry.report(i), self.dev.telemetry.report(i)] for i in ids]


def compare_fills(seed: int, device: str) -> dict[str, Any]:
    """Two identical states driven through the same random steps (admissions, finishes,
    prefill chunks, decode steps, recomputed requests of every kind), one filled on the host
    and one by the device fill; returns the steps compared, every mismatch (index rows,
    positions, prefix-guard reports) and both states' final gate reports per request."""
    kinds = _kinds()
    pair = _Pair(device)
    rng = np.random.default_rng(seed)
    live: dict[int, list[Any]] = {}  # slot -> [request id, prompt length, computed]
    out: dict[str, Any] = {"steps": 0, "mismatch": [], "reports": []}
    serial = 0
    previous: list[int] = []
    for step in range(40):
        for slot in range(1, 8):  # admissions and finishes, the same on both
            if slot in live and rng.random() < 0.15:
                pair.remove(live[slot][0])
                del live[slot]
            elif slot not in live and rng.random() < 0.4:
                kind = list(kinds)[rng.integers(len(kinds))]
                prompt = int(rng.integers(1, 9))
                serial += 1
                pair.add(f"{kind}-{serial}", slot, kinds[kind], prompt)
                live[slot] = [f"{kind}-{serial}", prompt, 0]
        if not live or rng.random() < 0.1:
            continue
        # Often the batch before again, in its order: decode steps where the device fill
        # keeps the index (every request continuing where its step ended) or refills it.
        repeat = bool(previous) and set(previous) <= set(live) and rng.random() < 0.5
        slots = previous if repeat else [k for k in live if rng.random() < 0.85] or list(live)
        if not repeat:
            rng.shuffle(slots)
        previous = slots
        computed, scheduled = [], []
        for k in slots:
            _, prompt, done = live[k]
            if done and rng.random() < 0.1 and not repeat:
                done = int(rng.integers(0, done))  # preempted and recomputed
            n = min(prompt - done, int(rng.integers(1, 5))) if done < prompt else 1
            computed.append(done)
            scheduled.append(n)
            live[k][2] = done + n
        comp, sched = np.array(computed, np.int64), np.array(scheduled, np.int64)
        tokens = int(sched.sum())
        if tokens > WIDTH - 8:
            continue
        out["mismatch"] += [[step, *m] for m in pair.fill(slots, comp, sched)]
        out["mismatch"] += [[step, *m] for m in pair.forward(tokens, rng)]
        out["steps"] += 1
    out["reports"] = pair.reports([rid for rid, _, _ in live.values()])
    return out


INTERPRETED = """
import json
from test_device_fill import compare_fills
print(json.dumps(compare_fills({seed}, "cpu")))
"""


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_fill_matches_the_host_fill_in_the_interpreter(seed):
    """Random admissions, finishes, prefill chunks, decode steps and recomputed requests of
    every kind (by-phase static, static, gated, plain), and decode steps of the batch before
    (where the device keeps its index, gated requests too): the device-filled index equals
    the host's in every row (slots and positions where a probe reads them; positions absolute
    where the host's are relative), columns past the step are zero, and the gate statistics
    and prefix-guard reports built from either are equal."""
    pytest.importorskip("triton")
    got = run_interpreted(INTERPRETED.replace("{seed}", str(seed)))
    assert got["steps"] > 20
    assert got["mismatch"] == []
    assert got["reports"] and all(a == b for a, b in got["reports"])
    assert any(a is not None for a, _ in got["reports"])


def steady_steps(device: str) -> dict[str, Any]:
    """A batch of static, by-phase and plain requests through its prefill and decode steps,
    then a gated request joining it (its prefill, decode, one step with a draft token that
    is then rejected), then leaving: per step, whether the device fill launched its kernel
    and whether its index and prefix-guard report equal the host's; the gated request's
    gate report from either."""
    kinds = _kinds()
    pair = _Pair(device)
    rng = np.random.default_rng(0)
    launches = []
    launch = pair.dev.device_fill._launch
    pair.dev.device_fill._launch = lambda **kw: launches.append(1) or launch(**kw)
    computed = {}
    for slot, kind in ((3, "static"), (1, "by_phase"), (5, "plain")):
        pair.add(kind, slot, kinds[kind], 3)
        computed[slot] = 0
    out: dict[str, Any] = {"launched": [], "equal": []}
    for step in range(12):
        if step == 4:
            pair.add("gated", 2, kinds["gated"], 3)
            computed[2] = 0
        if step == 10:
            out["reports"] = pair.reports(["gated"])
            pair.remove("gated")
            del computed[2]
        slots = list(computed)
        comp = np.array([computed[k] for k in slots], np.int64)
        sched = np.array([3 if computed[k] == 0 else 1 for k in slots], np.int64)
        if step == 6:
            sched[slots.index(2)] = 2  # a draft token, rejected after the step
        before = len(launches)
        mismatch = pair.fill(slots, comp, sched)
        out["launched"].append(len(launches) > before)
        out["equal"].append(mismatch + pair.forward(int(sched.sum()), rng) == [])
        for k, n in zip(slots, sched, strict=True):
            computed[k] += 1 if step == 6 else int(n)
    out["index_fills"] = pair.dev.index_fills
    return out


def test_a_decode_step_of_the_same_batch_keeps_the_index():
    """The device fill launches nothing for a decode step of the batch before (its index,
    with positions relative to where each request's step before ended, is that step's), gated
    requests included; it refills for the first decode step (rows change phase), for a
    prefill or a draft token, after a rejected token (the request does not continue where its
    step ended: positions absolute), and when the batch changes. Every step's index, and the
    gate statistics and prefix-guard reports made from it, equal the host fill's."""
    pytest.importorskip("triton")
    got = run_interpreted(INTERPRETED_STEADY)
    assert got["equal"] == [True] * 12
    # prefill, first decode, kept x2, +gated (its prefill), first decode, a draft, after the
    # rejection, continuing, kept, -gated (the batch changed), kept
    assert got["launched"] == [True, True, False, False, True, True, True, True, True, False,
                               True, False]
    assert got["index_fills"] == {"device": 8, "host": 0, "kept": 4}
    host, dev = got["reports"][0]
    assert host == dev and host["tokens_monitored"] == 8  # positions 0-7, 5 counted once


INTERPRETED_STEADY = """
import json
from test_device_fill import steady_steps
print(json.dumps(steady_steps("cpu")))
"""


def slot_reuse_steps(device: str) -> dict[str, Any]:
    """A static request beside a slot that holds in turn a gated request, a plain one (a
    longer prompt), another plain one (a shorter prompt) and a by-phase one, each through its
    prefill and two decode steps: per step, whether the device's index equals the host's,
    and the slot-table uploads of the step."""
    kinds = _kinds()
    pair = _Pair(device)
    rng = np.random.default_rng(0)
    upload = pair.dev.uploads
    uploads: list[int] = []
    changed = upload.changed
    upload.changed = lambda name: (name == "slot_table" and uploads.append(1)) or changed(name)
    pair.add("static", 1, kinds["static"], 3)
    out: dict[str, Any] = {"equal": [], "uploads": []}
    computed = {1: 3}
    for n, (kind, prompt) in enumerate((("gated", 3), ("plain", 6), ("plain", 2),
                                        ("by_phase", 4))):
        pair.add(f"{kind}-{n}", 2, kinds[kind], prompt)
        computed[2] = 0
        for _ in range(3):
            slots = [1, 2]
            comp = np.array([computed[1], computed[2]], np.int64)
            sched = np.array([1, prompt if computed[2] == 0 else 1], np.int64)
            before = len(uploads)
            mismatch = pair.fill(slots, comp, sched)
            out["uploads"].append(len(uploads) - before)
            out["equal"].append(mismatch + pair.forward(int(sched.sum()), rng) == [])
            computed[1] += 1
            computed[2] += int(sched[1])
        pair.remove(f"{kind}-{n}")
    return out


def test_an_unsteered_request_uploads_no_slot_table():
    """The slot table follows steered requests only: a plain request admitted into a slot a
    steered one left (its rows zeroed at that release) or leaving it changes nothing the
    device fill reads, so its first step uploads nothing, and the device's index still
    equals the host's every step (its prompt length in the table is stale and picks
    between two zero rows)."""
    pytest.importorskip("triton")
    got = run_interpreted(INTERPRETED_REUSE)
    assert got["equal"] == [True] * 12
    # the first step's (the gated request admitted); the gated one's release; none between
    # two plain requests; the by-phase one's admission
    assert got["uploads"] == [1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0]


INTERPRETED_REUSE = """
import json
from test_device_fill import slot_reuse_steps
print(json.dumps(slot_reuse_steps("cpu")))
"""


def _gated_spec(trace: bool = False, **extra: Any) -> dict[str, Any]:
    from dynsteer.controller.extra_args import WIRE_KEY
    from dynsteer.controller.spec import parse_spec
    from dynsteer.controller.wire import spec_to_wire

    gate = {"probe": {"weights": [1, 0, 0, 0], "threshold": 0.5}, "layer": 1, "trace": trace,
            "hook": "post_block", "steer": [{"vector": [0, 0, 0, 1], "layers": [2]}]}
    return {WIRE_KEY: spec_to_wire(parse_spec({"gate": gate, **extra}))}


@pytest.mark.parametrize("case", ["controller", "trace", "capture", "slot past the table"])
def test_steps_that_need_the_host_are_filled_there(case):
    """A step with a controlled request, a traced gate or a captured prompt needs per-token
    values on the host, and a slot past the slot table has no device entry: the host fills
    those steps (the device fill's kernel is not launched, so this runs without Triton's
    interpreter) and the index is the host's."""
    import torch

    from dynsteer.controller.extra_args import ACTIVATIONS_KEY
    from dynsteer.engine_ext.worker.state import SteeringState

    states = [SteeringState(SITES, 4, max_rows=8, max_tokens=WIDTH, max_slots=4,
                            device=torch.device("cpu"), capture_lanes=2, capture_tokens=8)
              for _ in range(2)]
    states[1].enable_device_fill(torch.zeros(4 + 1, dtype=torch.int32),  # a batch of 4 at most
                                 torch.zeros(WIDTH, dtype=torch.int64))
    slot, extra = 1, _gated_spec()
    if case == "controller":
        extra = _gated_spec(controller={"name": "latch", "k": 2})
    elif case == "trace":
        extra = _gated_spec(trace=True)
    elif case == "capture":
        extra = {ACTIVATIONS_KEY: {"sites": ["post_block@1"], "rows": 3, "positions": "prompt",
                                   "dtype": "float32"}}
    else:  # a static request (the V1 adapter's slots stay below the table; tests may not)
        slot, extra = 6, _kinds()["static"]
    for state in states:
        state.add_request("r", slot, extra, prompt_len=3)
        state.fill(np.array([slot]), np.zeros(1, np.int64), np.array([3]),
                   *([torch.tensor([slot], dtype=torch.int32)] if state is states[1] else []))
    assert states[1].index_fills == {"device": 0, "host": 1, "kept": 0}
    assert torch.equal(states[0].token_rows.buffer, states[1].token_rows.buffer)
    assert states[1].token_rows.buffer.any()


def kept_path_steps(device: str) -> dict[str, Any]:
    """A static and a gated request decoding as one batch, with in between an idle forward
    (a data-parallel dummy batch clears the index), a plain request admitted outside the
    step's batch and one removed: per decode step, which path :meth:`.StepIndex.fill`
    took (``fast``: kept by the byte comparisons alone; ``full``: the slot look-ups ran),
    whether the kernel was launched, and whether the index and the prefix-guard report equal
    the host fill's."""
    kinds = _kinds()
    pair = _Pair(device)
    rng = np.random.default_rng(3)
    launches: list[int] = []
    full: list[int] = []
    launch = pair.dev.device_fill._launch
    pair.dev.device_fill._launch = lambda **kw: launches.append(1) or launch(**kw)
    on_device = pair.dev.index._fill_on_device
    pair.dev.index._fill_on_device = lambda *a: full.append(1) or on_device(*a)
    pair.add("static", 1, kinds["static"], 3)
    pair.add("gated", 4, kinds["gated"], 3)
    slots, computed = [4, 1], np.array([0, 0], np.int64)
    out: dict[str, Any] = {"path": [], "launched": [], "equal": []}
    for step in range(10):
        if step == 4:  # an idle forward: the index is cleared
            for s in (pair.host, pair.dev):
                s.skip_step()
        if step == 6:
            pair.add("plain", 6, kinds["plain"], 2)  # admitted; scheduled from the next step
        if step == 8:
            pair.remove("plain")
        sched = np.array([3, 3] if step == 0 else [1, 1], np.int64)
        before = len(launches), len(full)
        mismatch = pair.fill(slots, computed, sched) + pair.forward(int(sched.sum()), rng)
        out["launched"].append(len(launches) > before[0])
        out["path"].append("full" if len(full) > before[1] else "fast")
        out["equal"].append(mismatch == [])
        computed += sched
    out["index_fills"] = pair.dev.index_fills
    out["reports"] = pair.reports(["gated"])
    return out


def test_a_kept_step_of_a_steady_batch_takes_the_byte_comparison_path():
    """Once a decode batch is steady, its next steps are kept without the per-slot look-ups
    (three byte comparisons), and the index still equals the host's every step. The full
    path runs again after an idle forward cleared the index (which it refills) and after an
    admission or a removal elsewhere (where the index is kept, but only after checking the
    slots), never on an equal step's say-so alone."""
    pytest.importorskip("triton")
    got = run_interpreted(INTERPRETED_KEPT)
    assert got["equal"] == [True] * 10
    # prefill, first decode (steady from here), fast x2, refill after the idle forward, fast,
    # checked after the admission, fast, checked after the removal, fast
    assert got["path"] == ["full", "full", "fast", "fast", "full", "fast", "full", "fast",
                           "full", "fast"]
    assert got["launched"] == [True, True, False, False, True, False, False, False, False,
                               False]
    assert got["index_fills"] == {"device": 3, "host": 0, "kept": 7}
    host, dev = got["reports"][0]
    assert host == dev and host["tokens_monitored"] == 12


INTERPRETED_KEPT = """
import json
from test_device_fill import kept_path_steps
print(json.dumps(kept_path_steps("cpu")))
"""
