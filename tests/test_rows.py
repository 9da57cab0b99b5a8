"""Row table and per-token index fill (CPU tensors, no engine)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynsteer.controller.extra_args import GLOBAL_KEY, WIRE_KEY
from dynsteer.controller.spec import parse_entries, parse_spec
from dynsteer.controller.wire import entry_to_wire, spec_to_wire
from dynsteer.engine_ext.worker import layout
from dynsteer.engine_ext.worker.global_steering import GLOBAL_HISTORY
from dynsteer.engine_ext.worker.resolve import Projection
from dynsteer.engine_ext.worker.rows import RowTable
from dynsteer.engine_ext.worker.state import SteeringState
from dynsteer.engine_ext.worker.token_rows import TokenRows

SITES = (("pre_attn", 0), ("post_block", 0), ("post_block", 1))


def table(max_rows=3):
    return RowTable(SITES, hidden_size=4, max_rows=max_rows, device=torch.device("cpu"))


def site_rows(rows, site, part="table"):
    return getattr(rows, part)[rows.site_index(site)]


def resolved(spec):
    """``extra_args`` as the frontend leaves them: the spec in its resolved (wire) form."""
    return {WIRE_KEY: spec_to_wire(parse_spec(spec))}


def resolved_entries(entries):
    return [entry_to_wire(e) for e in parse_entries(entries)]


def set_global(state, entries, key="g"):
    """Global steering as the control plane sets it: resolved entries under their key."""
    state.set_global(resolved_entries(entries), key)


def under(key, extra=None):
    """``extra_args`` of a request the frontend admitted under global steering ``key``."""
    return {**(extra or {}), GLOBAL_KEY: key}


def test_identical_contents_share_a_row():
    rows = table()
    v = np.arange(4, dtype=np.float32)
    a = rows.acquire({("post_block", 1): v})
    b = rows.acquire({("post_block", 1): v.copy()})
    assert a == b != 0 and rows.in_use == 1
    np.testing.assert_array_equal(site_rows(rows, ("post_block", 1))[a].numpy(), v)
    assert not site_rows(rows, ("post_block", 0))[a].any()


def test_a_rows_index_entry_names_the_site_groups_it_steers():
    """A row's token-index entry is the row plus the group bits of the sites its contents
    occupy (static, dynamic or projections); rewritten contents rewrite them. Without site
    groups an entry is the plain row (the fused sites' form before the groups reads it at
    every site)."""
    n = len(SITES)
    rows = RowTable(SITES, hidden_size=4, max_rows=2, device=torch.device("cpu"),
                    max_projections=1)
    v = np.ones(4, np.float32)
    a = rows.acquire({("post_block", 1): v})
    b = rows.acquire({}, {("pre_attn", 0): v})
    assert rows.entries[0] == 0
    assert rows.entries[a] == a | layout.site_bit(2, n)
    assert rows.entries[b] == b | layout.site_bit(0, n)
    assert layout.site_bit(1, n) & (rows.entries[a] | rows.entries[b]) == 0
    rows.release(a)
    c = rows.acquire({}, projections={("post_block", 0): (Projection(v, 1.0, 0.0, 0.0),)})
    assert c == a and rows.entries[c] == c | layout.site_bit(1, n)
    every = RowTable(SITES, hidden_size=4, max_rows=2, device=torch.device("cpu"),
                     site_groups=False)
    d = every.acquire({("post_block", 1): v})
    assert every.entries[d] == d
    groups = {layout.site_bit(i, 32) for i in range(32)}
    assert len(groups) == layout.SITE_GROUPS
    assert max(groups) < 2**31 and min(groups) > layout.ROW_MASK


def test_empty_contents_use_row_zero():
    rows = table()
    assert rows.acquire({}) == 0
    assert rows.acquire({("post_block", 0): np.zeros(4, np.float32)}) == 0


def test_full_table_refuses_and_counts():
    rows = table(max_rows=1)
    assert rows.acquire({("pre_attn", 0): np.ones(4, np.float32)}) == 1
    assert rows.acquire({("pre_attn", 0): 2 * np.ones(4, np.float32)}) is None
    assert rows.rejected == 1


def test_released_rows_are_reused():
    rows = table(max_rows=1)
    r = rows.acquire({("pre_attn", 0): np.ones(4, np.float32)})
    rows.release(r)
    assert rows.in_use == 0
    assert rows.acquire({("pre_attn", 0): 3 * np.ones(4, np.float32)}) == r
    assert site_rows(rows, ("pre_attn", 0))[r][0] == 3


def test_a_reused_row_keeps_nothing_of_its_old_contents():
    """A row rewritten for new contents copies only the sites either contents use, and the
    sites only the old contents used are zero again (values and flags), whatever the tier."""
    rows = table(max_rows=1)
    old = rows.acquire({SITES[0]: np.ones(4, np.float32)}, {SITES[1]: np.full(4, 2, np.float32)})
    rows.release(old)
    new = rows.acquire({SITES[2]: np.full(4, 3, np.float32)})
    assert new == old
    for site, value in zip(SITES, (0, 0, 3), strict=True):
        assert (site_rows(rows, site)[new] == value).all()
        assert not site_rows(rows, site, "dyn")[new].any()
    assert rows.flags[:, new].tolist() == [0, 0, 1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(1, 6),
                          st.integers(0, 12), st.integers(1, 9)), min_size=1, max_size=8))
def test_fill_matches_per_token_loop(reqs):
    """Vectorized fill == a plain loop over tokens: prompt positions take the prefill row."""
    index = TokenRows(max_tokens=128, device=torch.device("cpu"))
    index.fill(np.full(3, 7), np.full(3, 7), np.full(3, 2), np.zeros(3), np.zeros(3),
               np.array([9, 9, 9]))
    prow, drow, plen, comp, nsch = (np.array(x) for x in zip(*reqs, strict=True))
    probes = np.arange(len(reqs)) % 3
    index.fill(prow, drow, probes, plen, comp, nsch)
    want = [p if c + k < pl else d for p, d, pl, c, n in reqs for k in range(n)]
    want_probe = [probes[i] for i, r in enumerate(reqs) for _ in range(r[4])]
    got = index.rows.numpy()
    np.testing.assert_array_equal(got[: len(want)], want)
    np.testing.assert_array_equal(index.probe_rows.numpy()[: len(want)], want_probe)
    assert not index.buffer.numpy()[:, len(want):].any(), "padding tokens must map to 0"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 6),
                          st.integers(0, 12), st.integers(1, 9), st.integers(0, 1) | st.just(40)),
                min_size=1, max_size=8))
def test_fill_captures_positions_below_its_rows(reqs):
    """A captured request's token at position p gets capture row start + p while p is below
    its number of rows (here its prompt length plus 3); later tokens and uncaptured requests
    get 0, and so does padding."""
    index = TokenRows(max_tokens=128, device=torch.device("cpu"))
    prow, drow, plen, comp, nsch, start = (np.array(x) for x in zip(*reqs, strict=True))
    index.fill(prow, drow, np.zeros(len(reqs)), plen, comp, nsch, (start, plen + 3))
    want = [s + c + k if s and c + k < pl + 3 else 0
            for _, _, pl, c, n, s in reqs for k in range(n)]
    want_rows = [p if c + k < pl else d for p, d, pl, c, n, _ in reqs for k in range(n)]
    np.testing.assert_array_equal(index.capture_rows.numpy()[: len(want)], want)
    np.testing.assert_array_equal(index.rows.numpy()[: len(want)], want_rows)
    assert not index.buffer.numpy()[:, len(want):].any(), "padding tokens must map to 0"


def token_row(state: SteeringState, token: int = 0) -> int:
    """The steering row of a token of the last filled step (its entry without the site-group
    bits)."""
    return int(state.token_rows.rows[token]) & layout.ROW_MASK


def _post_block_1(state, slot):
    """The ``post_block@1`` row contents of a request's first token (None: row 0)."""
    state.fill(np.array([slot]), np.array([0]), np.array([1]))
    row = token_row(state)
    return site_rows(state.rows, ("post_block", 1))[row].tolist() if row else None


def test_a_forward_without_requests_folds_the_last_step_then_clears_the_index():
    """Before a forward no request is in (a data-parallel rank's idle batch), the previous
    step's gates are folded into the built-in controllers against the index it ran with, and
    only then is the index cleared: the idle batch's tokens read no request's rows, and the
    controller saw its step once."""
    state = SteeringState(SITES, 4, max_rows=4, max_tokens=16, max_slots=4,
                          device=torch.device("cpu"))
    spec = resolved({"gate": {"probe": {"weights": [1, 0, 0, 0], "threshold": 0.5},
                              "layer": 0, "hook": "post_block",
                              "steer": [{"vector": [0, 1, 0, 0], "layers": [1]}]},
                     "controller": {"name": "latch", "k": 2}})
    state.add_request("g", 2, spec, prompt_len=3)
    state.fill(np.array([2]), np.array([0]), np.array([3]))
    row = int(state.token_rows.buffer[layout.INDEX_CONTROL, 0])
    assert row != 0
    state.gate[:3] = torch.tensor([0.9, 0.2, 0.9])
    state.score[:3] = torch.tensor([1.0, -1.0, 1.0])
    state.skip_step()  # what the runner's _dummy_run hook calls
    assert not state.token_rows.buffer.any()
    assert float(state.control.table[row, layout.CTL_FLOOR]) == 1.0  # latched: two above
    state.fill(np.array([2]), np.array([3]), np.array([1]))
    state.gate[:1] = 0.0
    state.skip_step()
    assert float(state.control.table[row, layout.CTL_FLOOR]) == 1.0


def test_a_request_keeps_the_global_steering_it_was_admitted_under():
    """A global change steers requests admitted after it; live ones keep theirs (their
    prefix-cache key names it), also when re-added after a preemption."""
    state = SteeringState(SITES, 4, max_rows=4, max_tokens=16, max_slots=4,
                          device=torch.device("cpu"))
    state.add_request("plain", 1, None, prompt_len=2)
    set_global(state, [{"vector": [1, 0, 0, 0], "layers": [1]}], "one")
    assert not state.any_steered and _post_block_1(state, 1) is None
    state.add_request("a", 2, under("one"), prompt_len=2)
    assert _post_block_1(state, 2) == [1, 0, 0, 0]
    set_global(state, [{"vector": [0, 2, 0, 0], "layers": [1]}], "two")
    state.add_request("b", 3, under("two"), prompt_len=2)
    assert _post_block_1(state, 2) == [1, 0, 0, 0]
    assert _post_block_1(state, 3) == [0, 2, 0, 0]
    state.add_request("a", 2, under("one"), prompt_len=2)  # preempted and resumed
    assert _post_block_1(state, 2) == [1, 0, 0, 0]
    state.set_global([], "-")
    state.add_request("c", 0, None, prompt_len=2)
    assert _post_block_1(state, 0) is None and _post_block_1(state, 3) == [0, 2, 0, 0]
    for req_id in ("a", "b"):
        state.remove_request(req_id)
    assert not state.any_steered and state.rows.in_use == 0


def test_replaced_global_steerings_are_forgotten_once_unused():
    """A worker holds the global steerings live requests were admitted under and a short
    history (a request admitted just before a change may arrive after it); older ones go."""
    state = SteeringState(SITES, 4, max_rows=4, max_tokens=16, max_slots=4,
                          device=torch.device("cpu"))
    set_global(state, [{"vector": [1, 0, 0, 0], "layers": [1]}], "held")
    state.add_request("a", 1, under("held"), prompt_len=2)
    set_global(state, [{"vector": [3, 0, 0, 0], "layers": [1]}], "late")
    for i in range(GLOBAL_HISTORY + 3):
        set_global(state, [{"vector": [0, 0, i + 1, 0], "layers": [1]}], f"g{i}")
    assert state.info()["global_steerings_held"] == GLOBAL_HISTORY + 3  # none, held, current
    assert _post_block_1(state, 1) == [1, 0, 0, 0]
    state.add_request("b", 2, under("late"), prompt_len=2)  # beyond the history: current
    assert _post_block_1(state, 2) == [0, 0, GLOBAL_HISTORY + 3, 0]
    state.remove_request("a")
    state.add_request("c", 3, under("held"), prompt_len=2)  # still within the history
    assert _post_block_1(state, 3) == [1, 0, 0, 0]


def test_bad_request_runs_unsteered_instead_of_failing():
    """A spec the worker cannot resolve is logged and served unsteered (the step goes on)."""
    state = SteeringState(SITES, 4, max_rows=4, max_tokens=16, max_slots=4,
                          device=torch.device("cpu"))
    state.add_request("a", 0, resolved({"steer": [{"vector": "gone", "layers": [0]}]}), 2)
    assert not state.any_steered and state.has_request("a")


def test_dynamic_rows_flag_what_they_use():
    """Flags say which part (static, gated) a row uses at each site; unused parts stay zero."""
    rows = table()
    one = np.ones(4, np.float32)
    r = rows.acquire({("pre_attn", 0): one}, {("post_block", 1): 2 * one})
    assert site_rows(rows, ("pre_attn", 0), "flags")[r] == 1
    assert site_rows(rows, ("post_block", 1), "flags")[r] == 2
    assert site_rows(rows, ("post_block", 1), "dyn")[r][0] == 2
    assert not site_rows(rows, ("post_block", 1), "table")[r].any()
    # the same static contents without the gated part is a different row
    assert rows.acquire({("pre_attn", 0): one}) != r


def test_gated_request_gets_probe_row_and_telemetry():
    """A gated request takes a probe row at its monitor site and gets a telemetry record."""
    state = SteeringState(SITES, 4, max_rows=4, max_tokens=16, max_slots=4,
                          device=torch.device("cpu"))
    spec = resolved({"gate": {"probe": {"weights": [1, 0, 0, 0], "threshold": 0.5},
                              "layer": 0, "hook": "post_block",
                              "steer": [{"vector": [0, 1, 0, 0], "layers": [1]}]}})
    state.add_request("g", 2, spec, prompt_len=3)
    assert state.any_steered and state.probe_table.in_use == 1
    state.fill(np.array([2]), np.array([0]), np.array([3]))
    assert state.token_rows.probe_rows[:3].tolist() == [1, 1, 1]
    params = state.probe_table.params[1].tolist()
    assert params == [0.5, 1.0, float(state.rows.site_index(("post_block", 0)))]
    state.gate[:3] = torch.tensor([0.2, 0.7, 0.9])
    state.score[:3] = torch.tensor([-1.0, 1.0, 2.0])
    state.skip_step()
    report = state.telemetry.report("g")
    assert report["gated_prefill"] == 2 and report["max_score"] == 2.0
    state.remove_request("g")
    assert state.probe_table.in_use == 0 and state.telemetry.report("g") is not None


def test_gated_positions_are_relative_until_a_request_jumps():
    """The index holds each gated token's offset from where its request's last step ended,
    so consecutive decode steps leave it unchanged; a request that did not continue there
    (just admitted, recomputed after preemption, speculative tokens rejected) gets absolute
    positions. The counters see the true positions either way: a recomputed position counts
    once, and the prefix guard's frontier follows."""
    state = SteeringState(SITES, 4, max_rows=4, max_tokens=16, max_slots=4,
                          device=torch.device("cpu"), block_size=2)
    spec = resolved({"gate": {"probe": {"weights": [1, 0, 0, 0], "threshold": 0.5},
                              "layer": 0, "hook": "post_block",
                              "steer": [{"vector": [0, 1, 0, 0], "layers": [1]}]}})
    state.add_request("a", 1, spec, prompt_len=3)
    state.add_request("b", 2, spec, prompt_len=2)
    absolute = layout.POS_ABSOLUTE

    def step(slots, computed, scheduled):
        state.fill(np.array(slots), np.array(computed), np.array(scheduled))
        n = sum(scheduled)
        state.gate[:n] = 0.9
        state.score[:n] = 1.0
        entries = state.token_rows.buffer[layout.INDEX_POS, :n].tolist()
        state.after_forward()
        return entries

    assert step([1, 2], [0, 0], [3, 2]) == [absolute, absolute + 1, absolute + 2,
                                              absolute, absolute + 1]
    assert step([1, 2], [3, 2], [1, 1]) == [0, 0]  # both continue: relative
    before = state.token_rows.buffer.clone()
    assert step([1, 2], [4, 3], [1, 1]) == [0, 0] and torch.equal(state.token_rows.buffer,
                                                                  before)
    assert step([2, 1], [1, 5], [2, 1]) == [absolute + 1, absolute + 2, 0]  # "b" recomputes
    assert step([1], [6], [1]) == [0]  # "b" not in this step
    assert step([2, 1], [3, 7], [1, 1]) == [0, 0]
    state.telemetry.drain()
    a, b = state.telemetry.report("a"), state.telemetry.report("b")
    assert a["tokens_monitored"] == 8 and a["gated_prefill"] == 3 and a["gated_decode"] == 5
    assert b["tokens_monitored"] == 4 and b["gated_prefill"] == 2 and b["gated_decode"] == 2
    assert a["first_decode_gated"] == 0 and b["first_decode_gated"] == 0


def test_a_step_that_schedules_nothing_publishes_the_finished_events():
    """A finished request's counters are read out with the next step; a step that schedules
    no token (vLLM's last one before going idle, which only carries the finished ids) reads
    them out at once, so the finished event does not wait for a request that may never
    come."""

    class Events:
        every = 1 << 20

        def __init__(self) -> None:
            self.finished: list[tuple[str, int]] = []

        def request_started(self, req_id, wire):
            pass

        def monitor(self, *args):
            pass

        def request_finished(self, req_id, session, telemetry):
            self.finished.append((req_id, telemetry["tokens_monitored"]))

    state = SteeringState(SITES, 4, max_rows=4, max_tokens=16, max_slots=4,
                          device=torch.device("cpu"))
    events = Events()
    state.events = state.telemetry.events = events  # what set_events wires, minus ZeroMQ
    spec = resolved({"gate": {"probe": {"weights": [1, 0, 0, 0]}, "layer": 0,
                              "hook": "post_block",
                              "steer": [{"vector": [0, 1, 0, 0], "layers": [1]}]}})
    state.add_request("a", 1, spec, prompt_len=3)
    state.after_updates(False)
    state.fill(np.array([1]), np.array([0]), np.array([3]))
    state.after_forward()
    state.remove_request("a")
    state.after_updates(False)  # a step with tokens follows: it reads "a" out
    assert events.finished == []
    state.after_updates(True)  # none follows
    assert events.finished == [("a", 3)]


def test_released_rows_stay_warm_until_their_slot_is_needed(monkeypatch):
    """A row whose requests all finished keeps its contents: the next request with the same
    contents takes it without a table write; new contents reuse idle rows least recently
    used first, once no never-used row is left."""
    rows = table(max_rows=2)
    writes = []
    original = RowTable._write
    monkeypatch.setattr(RowTable, "_write",
                        lambda self, row, *a: (writes.append(row), original(self, row, *a)))
    a, b, c = (np.full(4, v, np.float32) for v in (1, 2, 3))
    ra = rows.acquire({("post_block", 1): a})
    rows.release(ra)
    assert rows.in_use == 0
    assert rows.acquire({("post_block", 1): a}) == ra and writes == [ra]  # warm: no write
    rb = rows.acquire({("post_block", 1): b})
    rows.release(ra)
    rows.release(rb)
    rc = rows.acquire({("post_block", 1): c})  # evicts a (least recently used)
    assert rc == ra and writes == [ra, rb, ra]
    assert site_rows(rows, ("post_block", 1))[rc][0] == 3
    assert rows.acquire({("post_block", 1): b}) == rb and writes == [ra, rb, ra]
    assert rows.acquire({("post_block", 1): a}) is None  # both rows referenced: full


def test_specs_with_equal_contents_share_one_row():
    """Rows are shared by content, not by spec: 32 distinct gates (distinct probes) gating the
    same vector in both phases take one row between them (keyed by spec and phase they took
    64, so past ``max_rows`` requests ran unsteered). A repeated spec finds its row by key."""
    state = SteeringState(SITES, 4, max_rows=2, max_tokens=64, max_slots=40,
                          device=torch.device("cpu"), block_size=4, max_gates=32)
    rng = np.random.default_rng(0)
    for i in range(32):
        spec = {"gate": {"probe": {"weights": rng.standard_normal(4).tolist()}, "layer": 1,
                         "steer": [{"vector": [1.0, 2.0, 3.0, 4.0], "layers": [1]}]}}
        state.add_request(f"r{i}", i + 1, {WIRE_KEY: spec_to_wire(parse_spec(spec))}, 3)
    info = state.info()
    assert (info["rows_in_use"], info["rows_rejected"], info["probe_rows_in_use"]) == (1, 0, 32)
    state.fill(np.arange(1, 33), np.zeros(32, np.int64), np.full(32, 2))
    rows = (state.token_rows.rows[:64] & layout.ROW_MASK).tolist()
    assert len(set(rows)) == 1 and rows[0] != 0
    state.remove_request("r0")
    state.add_request("again", 1, {WIRE_KEY: spec_to_wire(parse_spec(spec))}, 3)
    assert state.info()["rows_in_use"] == 1


def projecting_state(slots: int = 2) -> SteeringState:
    return SteeringState(SITES, 4, max_rows=4, max_tokens=16, max_slots=4,
                         device=torch.device("cpu"), max_projections=slots)


def test_projections_fill_their_slots_in_order():
    """A row's projection slots at a site: global entries first, then the request's own, then
    its gated ones; unit directions (from huge and tiny vectors alike), coefficients, target,
    the Gram matrix, and the flag; other sites and unused slots stay zero."""
    state = projecting_state(3)
    set_global(state, [{"vector": [0, 3e30, 0, 0], "layers": [1], "op": "ablate"}])
    spec = resolved({
        "steer": [{"vector": [4e-30, 3e-30, 0, 0], "layers": [1], "op": "clamp", "value": 2.0,
                   "scale": 0.5}],
        "gate": {"probe": {"weights": [1, 0, 0, 0]}, "layer": 1,
                 "steer": [{"vector": [0, 0, 0, -2], "layers": [1], "op": "ablate"}]}})
    state.add_request("a", 1, under("g", spec), prompt_len=2)
    state.fill(np.array([1]), np.array([0]), np.array([2]))
    row = token_row(state)
    i = state.rows.site_index(("post_block", 1))
    assert int(state.rows.flags[i, row]) & layout.PROJECT_FLAG
    directions = state.rows.proj_dir[i, row].numpy()
    np.testing.assert_allclose(directions, [[0, 1, 0, 0], [0.8, 0.6, 0, 0], [0, 0, 0, -1]],
                               rtol=1e-6)
    np.testing.assert_allclose(state.rows.proj_par[i, row].numpy(),
                               [[1, 0, 0, 0], [0.5, 0, 2, 0], [0, 1, 0, 0]])
    np.testing.assert_allclose(state.rows.proj_gram[i, row].numpy(),
                               directions @ directions.T, atol=1e-7)
    assert np.isfinite(directions).all()
    j = state.rows.site_index(("post_block", 0))
    assert not int(state.rows.flags[j, row]) & layout.PROJECT_FLAG
    assert not state.rows.proj_dir[j].any()


def test_projections_past_the_slots_leave_the_request_unsteered():
    """Global + own projections beyond ``max_projections`` at a site: the request runs
    unsteered (logged), never with some of them dropped."""
    state = projecting_state(1)
    set_global(state, [{"vector": [0, 1, 0, 0], "layers": [1], "op": "ablate"}])
    state.add_request("a", 1, under("g", resolved({"steer": [{"vector": [1, 0, 0, 0],
                                                              "layers": [1], "op": "ablate"}]})),
                      prompt_len=2)
    state.fill(np.array([1]), np.array([0]), np.array([2]))
    assert token_row(state) == 0


def test_gated_projections_count_as_dynamic_steering():
    """A gate whose only entries are projections still makes its tokens dynamically steered:
    the prefix guard withholds KV from their first gated position (a decode-only projection:
    from the first generated position)."""
    state = projecting_state(1)
    for req_id, phase, want in (("all", "all", 0), ("decode", "decode", 5)):
        spec = resolved({"gate": {"probe": {"weights": [1, 0, 0, 0]}, "layer": 1, "steer": [
            {"vector": [0, 1, 0, 0], "layers": [1], "op": "ablate", "phase": phase}]}})
        state.add_request(req_id, 1 if req_id == "all" else 2, spec, prompt_len=5)
        assert state.telemetry._live[req_id].dynamic_from == want


def test_a_plain_request_in_a_steered_requests_old_slot_reads_no_rows():
    """A plain admission under no global steering skips its row keys: the slot's rows are
    zero again from the steered occupant's release, so its tokens read nothing."""
    state = SteeringState(SITES, 4, max_rows=4, max_tokens=16, max_slots=4,
                          device=torch.device("cpu"))
    state.add_request("steered", 1, resolved({"steer": [{"vector": [1, 0, 0, 0],
                                                        "layers": [1]}]}), prompt_len=2)
    assert _post_block_1(state, 1) == [1, 0, 0, 0]
    state.remove_request("steered")
    state.add_request("plain", 1, None, prompt_len=2)
    assert _post_block_1(state, 1) is None and not state.any_steered
    state.fill(np.array([1]), np.array([0]), np.array([3]))
    assert not state.token_rows.buffer.any()
