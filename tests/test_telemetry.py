"""Gate telemetry folded in whole arrays (CPU, no engine) against a per-position reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynsteer.engine_ext.worker import layout
from dynsteer.engine_ext.worker.telemetry import DYNAMIC_EPSILON, GATE_ON, GateTelemetry

SITES = ["post_block@0", "post_block@1"]
BLOCK = 4


class _Tele(GateTelemetry):
    """The telemetry with the token index it reads (filled by :func:`step` as the token index
    would be)."""

    index: torch.Tensor


def make() -> tuple[_Tele, torch.Tensor]:
    values = torch.zeros(2, 64)
    index = torch.zeros(layout.INDEX_ROWS, 64, dtype=torch.int32)
    tele = _Tele(values, index, SITES, BLOCK, max_slots=4)
    tele.index = index
    return tele, values


def step(tele, values, rng, batch):
    """One step: ``batch`` is [(slot, first position, count)]; random gates and scores; the
    index holds the tokens' probe rows, slots and positions, as the worker fills it. The
    forward's values are written after ``before_step``, as the engine would."""
    tokens = sum(n for _, _, n in batch)
    slot = np.concatenate([np.full(n, s) for s, _, n in batch])
    pos = np.concatenate([np.arange(p, p + n) for _, p, n in batch])
    if tele.wants_tokens:
        tele.before_step(tokens, True, np.arange(tokens), slot, pos)
    else:
        tele.before_step(tokens, True)
    tele.index.zero_()
    tele.index[layout.INDEX_PROBE, :tokens] = 1
    tele.index[layout.INDEX_SLOT, :tokens] = torch.from_numpy(slot)
    tele.index[layout.INDEX_POS, :tokens] = torch.from_numpy(pos | layout.POS_ABSOLUTE)
    values[:, :tokens] = torch.from_numpy(rng.random((2, tokens)).astype(np.float32))
    values[1, :tokens] = values[1, :tokens] * 10 - 5
    return {(int(s), int(p)): (float(values[0, i]), float(values[1, i]))
            for i, (s, p) in enumerate(zip(slot, pos, strict=True))}


def expected(seen: dict[int, tuple[float, float]], prompt_len: int, dynamic_from: int | None):
    pos = sorted(seen)
    gates = np.array([seen[p][0] for p in pos])
    on = gates > GATE_ON
    decode_on = [p for p in pos if seen[p][0] > GATE_ON and p >= prompt_len]
    return {
        "tokens_monitored": len(pos),
        "gated_prefill": int(sum(o for p, o in zip(pos, on, strict=True) if p < prompt_len)),
        "gated_decode": len(decode_on),
        "first_decode_gated": decode_on[0] - prompt_len if decode_on else None,
        "first_gated": next((p for p, o in zip(pos, on, strict=True) if o), None),
        "max_score": max(seen[p][1] for p in pos),
        "first_dynamic": next((p for p in pos if dynamic_from is not None and p >= dynamic_from
                               and seen[p][0] > DYNAMIC_EPSILON), None),
    }


def test_counters_trace_recompute_and_block_reports():
    rng = np.random.default_rng(0)
    tele, values = make()
    tele.admit("a", 1, prompt_len=6, site=SITES[0], dynamic_from=6, trace=True)
    tele.admit("b", 3, prompt_len=3, site=SITES[1], dynamic_from=0, trace=False)
    seen: dict[str, dict[int, tuple[float, float]]] = {"a": {}, "b": {}}
    slots = {"a": 1, "b": 3}
    batches = [[(1, 0, 6), (3, 0, 3)], [(1, 6, 1), (3, 3, 1)], [(1, 7, 1), (3, 4, 1)],
               [(1, 8, 1)], [(1, 9, 1)]]
    reports = []
    for batch in batches:
        got = step(tele, values, rng, batch)
        for name, slot in slots.items():
            seen[name].update({p: v for (s, p), v in got.items() if s == slot})
        reports.append(tele.cache_report())
    tele.drain()
    # "b" is preempted and recomputed from position 2: positions 2-4 are not counted again.
    tele.finish("b")
    tele.admit("b", 2, prompt_len=3, site=SITES[1], dynamic_from=0, trace=False)
    step(tele, values, rng, [(2, 2, 3)])
    for name, prompt_len, dynamic_from in (("a", 6, 6), ("b", 3, 0)):
        report = tele.report(name)
        want = expected(seen[name], prompt_len, dynamic_from)
        for key in ("tokens_monitored", "gated_prefill", "gated_decode", "first_decode_gated",
                    "first_gated"):
            assert report[key] == want[key], (name, key)
        # "b"'s recomputed positions were scored again (new random values): its max only grows
        assert report["max_score"] >= want["max_score"] - 1e-5
        assert name == "b" or abs(report["max_score"] - want["max_score"]) < 1e-5
    trace = tele.report("a")["gates"]
    np.testing.assert_allclose(trace, [seen["a"][p][0] for p in range(10)], rtol=1e-6)
    assert tele.report("b")["gates"] is None
    # Reports: only when the clean prefix (below the first dynamic position) grows a block.
    want_a = expected(seen["a"], 6, 6)["first_dynamic"]
    clean = [min(end, want_a if want_a is not None else end) // BLOCK
             for end in (6, 7, 8, 9, 10)]
    reported = [bool(r.get("a")) for r in reports]
    assert reported == [clean[0] > 0] + [clean[i] > clean[i - 1] for i in range(1, 5)]
    assert tele.tokens_monitored == {SITES[0]: 10, SITES[1]: 8}


def test_no_gated_tokens_costs_nothing_and_reports_nothing():
    tele, _ = make()
    tele.before_step(0, False)
    assert tele.cache_report() == {} and tele.tokens_monitored == {}
    assert tele.report("nope") is None


def test_the_report_reads_the_slots_only_after_a_new_snapshot(monkeypatch):
    """The prefix-guard report runs after every step: it passes over the slot arrays only when
    a gated request is live and a statistics snapshot landed since the last report; the
    report it then makes is the one a pass every step would have made."""
    rng = np.random.default_rng(2)
    tele, values = make()
    passes = []
    frontiers = tele._stats.frontiers
    monkeypatch.setattr(tele._stats, "frontiers", lambda: passes.append(1) or frontiers())
    tele.before_step(0, False)  # nothing gated is live: no pass
    assert tele.cache_report() == {} and passes == []
    tele.admit("a", 1, prompt_len=5, site=SITES[0], dynamic_from=100, trace=False)
    step(tele, values, rng, [(1, 0, 5)])
    assert tele.cache_report() == {"a": (5, None)} and len(passes) == 1
    assert tele.cache_report() == {} and len(passes) == 1  # the same snapshot: no pass
    step(tele, values, rng, [(1, 5, 2)])
    assert tele.cache_report() == {} and len(passes) == 2  # 7 positions: still one block
    step(tele, values, rng, [(1, 7, 1)])
    assert tele.cache_report() == {"a": (8, None)} and len(passes) == 3
    tele.admit("b", 2, prompt_len=3, site=SITES[1], dynamic_from=100, trace=False)
    tele.finish("a")
    step(tele, values, rng, [(2, 0, 3)])  # a new snapshot, but no gated request is live
    tele.finish("b")
    assert tele.cache_report() == {} and len(passes) == 3


def test_settled_frontiers_stop_the_report_until_an_admission(monkeypatch):
    """Once every live gated request was processed past its first dynamic position (its clean
    prefix ends there for good) and that was reported, the report stops reading the slots;
    an admission starts the passes again, and the reports are those of a telemetry that
    passes over the slots after every step."""
    rng = np.random.default_rng(4)
    tele, values = make()
    twin, twin_values = make()  # the same steps, its report passing over the slots always
    passes = []
    frontiers = tele._stats.frontiers
    monkeypatch.setattr(tele._stats, "frontiers", lambda: passes.append(1) or frontiers())

    def both(batch):
        step(tele, values, rng, batch)
        step(twin, twin_values, rng, batch)
        twin_values.copy_(values)  # both fold the same gates
        got = tele.cache_report()
        twin._settled = False
        assert got == twin.cache_report()
        return got

    for t in (tele, twin):
        t.admit("a", 1, prompt_len=6, site=SITES[0], dynamic_from=0, trace=False)
    assert both([(1, 0, 6)]) == {}  # gates ~U(0, 1): dynamic from position 0, no clean block
    assert len(passes) == 1
    for pos in range(6, 12):  # settled: no pass, and nothing to report
        assert both([(1, pos, 1)]) == {}
    assert len(passes) == 1
    for t in (tele, twin):
        t.admit("b", 2, prompt_len=5, site=SITES[1], dynamic_from=100, trace=False)
    assert both([(1, 12, 1), (2, 0, 5)]) == {"b": (5, None)}
    assert len(passes) == 2
    assert both([(1, 13, 1), (2, 5, 1)]) == {}  # "b" never settles: a pass a step
    assert both([(1, 14, 1), (2, 6, 2)]) == {"b": (8, None)}
    assert len(passes) == 4


def test_finishing_never_waits_and_a_reused_slot_starts_a_new_record():
    """A request that finishes while its last step is unfolded keeps its record until the fold
    (finish does not drain); the runner may hand its slot to a new request at once, and the two
    requests' counters stay apart."""
    rng = np.random.default_rng(1)
    tele, values = make()
    tele.admit("a", 1, prompt_len=3, site=SITES[0], dynamic_from=0, trace=True)
    seen_a = {p: v for (_, p), v in step(tele, values, rng, [(1, 0, 3)]).items()}
    tele.launch_copy()  # the forward ran: its read-back is in flight, not folded (as on a GPU)
    tele.finish("a")
    assert tele._in_flight, "the step of 'a' must still be unfolded"
    tele.admit("b", 1, prompt_len=2, site=SITES[1], dynamic_from=0, trace=True)
    seen_b = {p: v for (_, p), v in step(tele, values, rng, [(1, 0, 2)]).items()}
    for name, seen, prompt_len in (("a", seen_a, 3), ("b", seen_b, 2)):
        report = tele.report(name)
        want = expected(seen, prompt_len, 0)
        assert report["tokens_monitored"] == want["tokens_monitored"], name
        assert report["gated_prefill"] == want["gated_prefill"], name
        assert report["max_score"] == want["max_score"], name
        assert report["gates"] == [pytest.approx(seen[p][0]) for p in sorted(seen)], name


class _Recorded:
    """Stands where :class:`..events.EngineEvents` goes: keeps what it is given."""

    every = 2

    def __init__(self) -> None:
        self.monitors: list[tuple] = []
        self.finished: list[tuple] = []

    def monitor(self, step, ids, sessions, tokens, gated, max_score):
        self.monitors.append((step, ids, sessions, tokens.tolist(), gated.tolist(),
                              max_score.tolist()))

    def request_finished(self, req_id, session, telemetry):
        self.finished.append((req_id, session, telemetry["tokens_monitored"]))


def test_monitor_summaries_and_finished_events():
    """Every ``every`` folded steps one summary of the window per request (ids and sessions
    gathered per record); a finished request's event carries its whole report."""
    tele, values = make()
    events = tele.events = _Recorded()
    rng = np.random.default_rng(3)
    tele.admit("a", 1, prompt_len=2, site=SITES[0], dynamic_from=0, trace=False, session="s1")
    tele.admit("b", 2, prompt_len=2, site=SITES[1], dynamic_from=0, trace=False)
    seen = [step(tele, values, rng, [(1, 0, 2), (2, 0, 2)])]
    for k in range(2, 5):
        tele.drain()
        seen.append(step(tele, values, rng, [(1, k, 1), (2, k, 1)]))
    tele.drain()
    tele.finish("a")
    tele.before_step(0, False)  # its counters are read out with the next step,
    tele.cache_report()  # and taken by the step's one fold of what landed
    assert [m[0] for m in events.monitors] == [0, 2]
    _, ids, sessions, tokens, gated, _ = events.monitors[0]
    assert ids == ["a", "b"] and sessions == ["s1", None] and tokens == [2, 2]
    on = [sum(g > GATE_ON for (s, _), (g, _) in seen[0].items() if s == slot)
          for slot in (1, 2)]
    assert gated == on
    assert events.monitors[1][3] == [2, 2]  # steps 1 and 2
    assert events.finished == [("a", "s1", 5)]
