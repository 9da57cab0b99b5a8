"""More distinct steering configurations than ``max_rows`` in flight: requests wait for a row.

Unit tests of the budget (what the scheduler holds back, what frees a row) and of the claims
the frontend writes; then a real engine with ``max_rows=1`` given six distinct static
configurations and a gated one at once: every request is steered exactly as HF steers it
alone (none ran without its row), some waited, the workers never ran out of rows; and the
registry changing while requests wait does not change their steering.
"""

from __future__ import annotations

import pytest
from engine_utils import params, run, start_llm, stop_llm
from hf_reference import assert_logprobs_match_hf
from tiny_models import vec

from dynsteer.controller.spec import parse_spec
from dynsteer.controller.wire import entry_to_wire, spec_to_wire
from dynsteer.engine_ext import Steering
from dynsteer.engine_ext.row_budget import Claims, RowBudget, check_claims, claims_for

PROMPT = [1, 17, 42, 99, 7, 250, 3, 64]


def claims(*rows: str, gates: tuple[str, ...] = ()) -> Claims:
    return Claims(rows=frozenset(rows), gates=frozenset(gates))


def test_requests_whose_new_rows_do_not_fit_wait_and_others_go_past():
    """Held back: a request whose new rows would exceed the budget; not held: requests
    reusing held rows, taking none, or fitting; a freed row lets the first waiter in."""
    budget = RowBudget(max_rows=2, max_gates=1)
    budget.take("a", claims("x|all"))
    budget.take("b", claims("y|all"))
    waiting = [("c", claims("z|all")), ("d", claims("x|all")), ("e", None),
               ("f", claims("w|all", gates=("p",)))]
    assert budget.plan(waiting, slots=8) == {"c", "f"}
    budget.release("a")
    assert budget.plan(waiting, slots=8) == {"d", "f"}  # c took the freed row
    budget.release("b")
    assert budget.plan(waiting, slots=8) == {"f"}  # c and d fill both rows again
    assert budget.plan([("g", claims(gates=("p",))), ("h", claims(gates=("q",)))], 8) == {"h"}


def test_a_preempted_request_keeps_its_rows_and_planning_stops_at_the_free_slots():
    budget = RowBudget(max_rows=1, max_gates=4)
    budget.take("a", claims("x|all"))
    assert budget.plan([("a", claims("x|all")), ("b", claims("y|all"))], slots=8) == {"b"}
    assert budget.plan([("c", None), ("b", claims("y|all"))], slots=1) == set()
    budget.take("a", claims("x|all"))  # resumed: taken once
    budget.release("a")
    assert budget.plan([("b", claims("y|all"))], slots=8) == set()


def _wire(spec: dict) -> dict:
    return spec_to_wire(parse_spec(spec))


def test_claims_name_what_determines_the_rows():
    """Equal specs claim equal rows; phases that steer differently claim a row each; the
    global steering, the registry generation and a gate change the claims; a request that
    steers nothing claims nothing."""
    v = vec(1)
    same = claims_for(_wire({"steer": [{"vector": v, "layers": [1]}]}), [], None, 0)
    assert same == claims_for(_wire({"steer": [{"vector": v, "layers": [1]}]}), [], None, 0)
    assert len(same.rows) == 1 and not same.gates
    phased = claims_for(_wire({"steer": [{"vector": v, "layers": [1], "phase": "prefill"},
                                         {"vector": v, "layers": [2], "phase": "decode"}]}),
                        [], None, 0)
    assert len(phased.rows) == 2
    assert claims_for(None, [], None, 0) is None
    glob = [entry_to_wire(parse_spec({"steer": [{"vector": v, "layers": [2]}]}).steer[0])]
    plain_under_global = claims_for(None, glob, "g", 0)
    assert len(plain_under_global.rows) == 1
    assert claims_for(None, glob, "g", 1) != plain_under_global
    gated = claims_for(_wire({"gate": {"probe": {"weights": vec(2, norm=1.0)}, "layer": 1,
                                       "steer": [{"vector": v, "layers": [2]}]}}), [], None, 0)
    assert len(gated.gates) == 1 and len(gated.rows) == 1
    with pytest.raises(ValueError, match=r"^dynsteer.max_rows: this request needs 2"):
        check_claims(phased, max_rows=1, max_gates=1)


MAX_ROWS = 1
STATIC = [[{"vector": vec(60 + i), "layers": [1 + i % 3]}] for i in range(6)]
GATED = {"probe": {"weights": vec(70, norm=1.0), "threshold": -1e6}, "layer": 1,
         "steer": [{"vector": vec(71), "layers": [2]}]}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = start_llm(tiny_model_dir("llama"), dynsteer={"max_rows": MAX_ROWS})
    yield llm
    stop_llm(llm)


@pytest.fixture(scope="module")
def crowded(llm):
    """Six distinct static configurations, a gated one and two plain requests at once on an
    engine with one steering row; then a spec whose phases steer differently (two rows)."""
    steering = Steering(llm)
    before = steering.cache_stats()["requests_waited_for_rows"]
    specs = [*({"steer": s} for s in STATIC), {"gate": GATED}, None, None]
    outs = run(llm, [PROMPT] * len(specs), [params(8, spec=s) for s in specs])
    stats = steering.cache_stats()
    info = steering.info()
    with pytest.raises(ValueError) as refused:
        run(llm, [PROMPT], [params(spec={"steer": [
            {"vector": vec(80), "layers": [1], "phase": "prefill"},
            {"vector": vec(81), "layers": [2], "phase": "decode"},
            {"vector": vec(82), "layers": [3]}]})])
    return specs, outs, stats["requests_waited_for_rows"] - before, info, refused


@pytest.mark.engine
def test_every_request_is_steered_as_alone(crowded, hf_llama):
    """No request ran without its row: each equals HF steered with its own spec."""
    specs, outs, waited, info, _ = crowded
    for spec, out in zip(specs, outs, strict=True):
        spec = spec or {}
        assert_logprobs_match_hf(hf_llama, out, spec.get("steer", ()), gate=spec.get("gate"))
    assert waited > 0, "the budget never held a request back"
    assert all(rank["rows_rejected"] == 0 for rank in info)
    assert all(rank["rows_in_use"] == 0 for rank in info)


@pytest.mark.engine
def test_a_request_needing_more_rows_than_the_engine_has_is_refused(crowded):
    message = str(crowded[-1].value)
    assert message.startswith("dynsteer.max_rows: this request needs 2 steering rows"), message
    assert f"the engine has {MAX_ROWS}" in message


@pytest.mark.engine
def test_waiting_requests_keep_the_named_vectors_and_probes_they_were_admitted_with(
        llm, hf_llama):
    """The registry changes while requests wait in the scheduler's queue (deterministically:
    a long request holds the only row): a vector replaced, a vector deleted and a probe
    deleted after admission still steer those requests as they were when admitted, and a
    request admitted after the replacement gets the new vector."""
    steering = Steering(llm)
    probe = {"weights": vec(92, norm=1.0), "threshold": 0.0, "sharpness": 2.0}
    steering.register_vector("kept", vec(90))
    steering.register_vector("gone", vec(91))
    steering.register_probe("qp", weights=probe["weights"], threshold=probe["threshold"],
                            sharpness=probe["sharpness"])
    specs = {
        "replaced": {"steer": [{"vector": "kept", "layers": [2]}]},
        "deleted": {"steer": [{"vector": "gone", "layers": [1, 3]}]},
        "probe-deleted": {"gate": {"probe": "qp", "layer": 1,
                                   "steer": [{"vector": vec(93), "layers": [2]}]}},
    }
    engine = llm.llm_engine
    before = steering.cache_stats()["requests_waited_for_rows"]
    engine.add_request("holder", {"prompt_token_ids": PROMPT},
                       params(128, spec={"steer": STATIC[0]}))
    for request_id, spec in specs.items():
        engine.add_request(request_id, {"prompt_token_ids": PROMPT}, params(6, spec=spec))
    steering.register_vector("kept", vec(94), replace=True)
    engine.add_request("after", {"prompt_token_ids": PROMPT}, params(6, spec=specs["replaced"]))
    steering.unregister_vector("gone")
    steering.unregister_probe("qp")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert steering.cache_stats()["requests_waited_for_rows"] - before >= 4
    assert_logprobs_match_hf(hf_llama, outs["replaced"], specs["replaced"]["steer"],
                             vectors={"kept": vec(90)})
    assert_logprobs_match_hf(hf_llama, outs["deleted"], specs["deleted"]["steer"],
                             vectors={"gone": vec(91)})
    assert_logprobs_match_hf(hf_llama, outs["probe-deleted"],
                             gate=specs["probe-deleted"]["gate"], probes={"qp": probe})
    assert_logprobs_match_hf(hf_llama, outs["after"], specs["replaced"]["steer"],
                             vectors={"kept": vec(94)})
    steering.unregister_vector("kept")
