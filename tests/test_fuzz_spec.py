"""Hostile input to spec parsing, admission and the control plane, without an engine.

Everything a client can send (a request's spec, a global-steering body, a vector, a probe, a
controller's session steering) reaches the frontend as JSON-shaped data, and the frontend's
contract is that bad input is a ``ValueError`` whose message starts with the field at fault:
the routes turn that into HTTP 400, vLLM's input processor into a 400 for completions, the
command socket into an error reply. Any other exception type (``TypeError``,
``OverflowError``, ``RecursionError``, ``KeyError``, ...) would be an HTTP 500, an unanswered
controller or a crashed engine step, so property tests feed arbitrary JSON values and
mutations of valid specs to every entry point and check exactly that. Accepted specs must
also resolve into a wire form that msgpack can carry to the engine core.

Hypothesis runs derandomized (the same examples every run) so CI is stable; the number of
cases each test ran is printed at the end of the module and written to
``fuzz_spec_cases.json`` in pytest's base temporary directory.
"""

from __future__ import annotations

import base64
import json
import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from fuzz_report import report_cases
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dynsteer.controller.contract import SpecError, encode_f32
from dynsteer.controller.extra_args import SPEC_KEY
from dynsteer.controller.http_models import GlobalSteering, ProbeUpload, VectorIn
from dynsteer.controller.spec import parse_gate, validation_message
from dynsteer.engine_ext.compat.frontend import Generation
from dynsteer.engine_ext.frontend.admission import FrontendState, admit, admitted
from dynsteer.engine_ext.frontend.control_plane import ControlError, ControlPlane
from dynsteer.engine_ext.options import EngineOptions

HIDDEN = 4
LAYERS = 3
SITES = (("pre_attn", 0), ("post_block", 0), ("post_attn", 1), ("post_block", 1),
         ("post_block", 2))
MONITORS = frozenset({("post_block", 0), ("post_block", 1)})
VECTOR = [0.5, -1.0, 0.25, 2.0]
PROBE_WEIGHTS = [1.0, 0.0, -1.0, 0.5]

FUZZ = settings(max_examples=250, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
"""Every property here: bounded, reproducible (derandomized), no per-example deadline (CI
machines are slow and shared)."""

CASES: Counter[str] = Counter()
"""Examples run per test (reported when the module finishes)."""


@pytest.fixture(scope="module", autouse=True)
def cases_report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[None]:
    yield
    report_cases(request, tmp_path_factory, "test_fuzz_spec", "fuzz cases", CASES)


# ---- a frontend like a served model's, with one of everything registered ----------------------
def make_state() -> FrontendState:
    """A frontend for a 3-layer model of hidden size 4: sites at every hook kind, two monitor
    sites, projection slots (so ablate / clamp reach their checks), a registered vector, a
    registered probe and a session with steering (so admission merges it)."""
    state = FrontendState(options=EngineOptions(max_projections=2, max_vectors=4, max_probes=4),
                          hidden_size=HIDDEN, num_layers=LAYERS, sites=SITES,
                          monitor_sites=MONITORS, architecture="LlamaForCausalLM")
    plane = ControlPlane(state)
    plane.register_vector("v", VECTOR).commit()
    plane.register_probe("p", PROBE_WEIGHTS, 0.0, 1.0).commit()
    state.set_session("s", plane.session_steering([{"vector": "v", "layers": [2]}], None))
    return state


# ---- strategies ---------------------------------------------------------------------------------
HOSTILE_NUMBERS = st.sampled_from([
    math.nan, math.inf, -math.inf, 1e39, -1e39, 1e308, 5e-324, -0.0, 2**31, 2**63, -(2**63) - 1,
    2**64, 10**30, 10**400, -(10**400),
])
"""Numbers that are fine Python values but not fine steering numbers (non-finite, beyond
float32, beyond int64, beyond float64)."""

HOSTILE_STRINGS = st.sampled_from([
    "", " ", "\x00", "\ud800", "..", ".hidden", "a/b", "../../etc/passwd", "x" * 300, "NaN",
    "Infinity", "1e39", "null", "post_block", "v", "p", "latch", "{", "[[[[", "é",
])
"""Strings that look like names, numbers, JSON or paths."""

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), HOSTILE_NUMBERS,
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), HOSTILE_STRINGS,
)


def json_like(max_leaves: int = 20) -> st.SearchStrategy[Any]:
    """Arbitrary JSON-shaped values (string keys, as JSON has), numbers of every kind."""
    return st.recursive(
        SCALARS,
        lambda children: st.one_of(
            st.lists(children, max_size=6),
            st.dictionaries(st.one_of(st.text(max_size=8), FIELD_NAMES), children, max_size=6),
        ),
        max_leaves=max_leaves,
    )


FIELD_NAMES = st.sampled_from([
    "version", "steer", "gate", "controller", "session", "vector", "vector_b64", "layers",
    "hook", "scale", "phase", "op", "value", "probe", "layer", "threshold", "sharpness", "trace",
    "weights", "weights_b64", "name", "k", "t_on", "t_off", "gain", "max", "tokens",
])
"""The spec's own vocabulary, so random dictionaries reach validation past the key check."""

B64_GARBAGE = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=",
            max_size=40),
    st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()),
    st.sampled_from([
        encode_f32([math.nan] * HIDDEN), encode_f32([math.inf] * HIDDEN),
        encode_f32([3e38] * HIDDEN), encode_f32([1.0] * (HIDDEN + 1)), encode_f32([]),
        encode_f32([0.0] * HIDDEN), "AAAA", "AAA=", "====", "é", "\ud800",
        base64.urlsafe_b64encode(b"\xfb\xff" * 8).decode(),
    ]),
)
"""``*_b64`` values that are not base64, not float32-sized, or decode to non-finite floats."""


def floats_vector(draw: st.DrawFn) -> list[float]:
    return draw(st.lists(st.floats(-2, 2, allow_nan=False), min_size=HIDDEN, max_size=HIDDEN))


@st.composite
def valid_entry(draw: st.DrawFn, sites: tuple[tuple[str, int], ...] = SITES) -> dict[str, Any]:
    """A steer entry the model above accepts: an add with a bounded, nonzero vector (inline
    floats, base64 or the registered name) at configured sites of one hook."""
    hook = draw(st.sampled_from(sorted({h for h, _ in sites})))
    layers = draw(st.lists(st.sampled_from([layer for h, layer in sites if h == hook]),
                           min_size=1, max_size=3))
    form = draw(st.sampled_from(["name", "floats", "b64"]))
    vector = VECTOR if form != "floats" else [v + 0.5 for v in floats_vector(draw)]
    entry: dict[str, Any] = {"layers": layers, "hook": hook}
    if form == "name":
        entry["vector"] = "v"
    elif form == "b64":
        entry["vector_b64"] = encode_f32(vector)
    else:
        entry["vector"] = vector
    entry["scale"] = draw(st.floats(-3, 3, allow_nan=False))
    entry["phase"] = draw(st.sampled_from(["all", "prefill", "decode"]))
    return entry


@st.composite
def valid_gate(draw: st.DrawFn) -> dict[str, Any]:
    """A gate on a monitor site with gated entries at or after it."""
    hook, layer = draw(st.sampled_from(sorted(MONITORS)))
    later = tuple(s for s in SITES if (s[1], s[0]) >= (layer, hook) and s[0] == "post_block")
    probe: Any = draw(st.sampled_from(
        ["p", {"weights": PROBE_WEIGHTS, "threshold": 0.5},
         {"weights_b64": encode_f32(PROBE_WEIGHTS), "sharpness": 2.0}]))
    gate = {"probe": probe, "layer": layer, "hook": hook,
            "steer": draw(st.lists(valid_entry(later), min_size=1, max_size=2))}
    if draw(st.booleans()):
        gate["trace"] = True
    return gate


@st.composite
def valid_spec(draw: st.DrawFn) -> dict[str, Any]:
    """A spec the model above accepts (static entries, a gate, a controller, a session)."""
    spec: dict[str, Any] = {"steer": draw(st.lists(valid_entry(), max_size=3))}
    if draw(st.booleans()):
        spec["gate"] = draw(valid_gate())
        if draw(st.booleans()):
            spec["controller"] = draw(st.sampled_from([
                {"name": "latch", "k": 2}, {"name": "hysteresis", "t_on": 1.0, "t_off": 0.0},
                {"name": "budget", "tokens": 5}, {"name": "proportional", "gain": 0.5}]))
    if draw(st.booleans()):
        spec["session"] = draw(st.sampled_from(["s", "user-7/conv-3", "a:b@c.d"]))
    return spec


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every position in a JSON value (the root included)."""
    yield path
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*path, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _paths(child, (*path, i))


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _replace(value[path[0]], path[1:], new)
    return copy


def _nested(value: Any, depth: int) -> Any:
    for _ in range(depth):
        value = [value]
    return value


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[Any]) -> Any:
    """A value from ``base`` with one hostile change somewhere: a wrong-typed or non-finite
    value, base64 garbage, a huge list, deep nesting, an unknown field, a dropped field; then
    possibly sent as JSON text, possibly truncated (as ``vllm_xargs`` would carry it)."""
    value = draw(base)
    path = draw(st.sampled_from(list(_paths(value))))
    target = value
    for part in path:
        target = target[part]
    kind = draw(st.sampled_from(["replace", "b64", "huge", "deep", "unknown", "drop"]))
    if kind == "replace":
        value = _replace(value, path, draw(json_like(8)))
    elif kind == "b64":
        value = _replace(value, path, draw(B64_GARBAGE))
    elif kind == "huge":
        filler = draw(st.one_of(SCALARS, st.just(target)))
        value = _replace(value, path, [filler] * draw(st.sampled_from([65, 1025, 20000])))
    elif kind == "deep":
        value = _replace(value, path, _nested(target, draw(st.sampled_from([63, 64, 65, 300]))))
    elif kind == "unknown" and isinstance(target, dict):
        key = draw(st.one_of(FIELD_NAMES, st.text(min_size=1, max_size=8)))
        value = _replace(value, path, {**target, key: draw(json_like(4))})
    elif kind == "drop" and isinstance(target, dict) and target:
        key = draw(st.sampled_from(sorted(target)))
        value = _replace(value, path, {k: v for k, v in target.items() if k != key})
    form = draw(st.sampled_from(["object", "object", "text", "bytes", "truncated"]))
    if form == "object":
        return value
    text = json.dumps(value)  # NaN / Infinity tokens, as a lax client would send them
    if form == "truncated":
        return text[:draw(st.integers(0, max(0, len(text) - 1)))]
    return text.encode() if form == "bytes" else text


SPEC_INPUTS = st.one_of(json_like(), mutated(valid_spec()),
                        json_like().map(lambda v: json.dumps(v)))


# ---- the property -----------------------------------------------------------------------------
def outcome(call: Callable[[], Any], fields: tuple[str, ...]) -> str:
    """Run ``call``: ``"ok"``, or ``"refused"`` when it raised a SpecError / ControlError whose
    message starts with one of ``fields`` followed by ``:``, ``.`` or ``[`` (the field path).
    Anything else fails the test with the exception."""
    try:
        call()
    except (SpecError, ControlError) as e:
        message = str(e)
        assert any(message.startswith(f) and message[len(f):len(f) + 1] in (":", ".", "[")
                   for f in fields), f"message does not start with one of {fields}: {message!r}"
        return "refused"
    return "ok"


def test_valid_specs_are_admitted_and_resolve_to_a_transportable_wire_form():
    """The generator of valid specs really produces accepted ones (else every mutation test
    would pass trivially), and what admission produces crosses the process boundary."""
    state = make_state()
    outcomes: Counter[str] = Counter()

    @FUZZ
    @given(valid_spec())
    def run(spec: dict[str, Any]) -> None:
        CASES["valid_specs"] += 1
        parsed, wire = admit(state, {SPEC_KEY: spec})
        assert len(wire["steer"]) == len(spec["steer"]) + (spec.get("session") == "s")
        extra = admitted(state, "r", (parsed, wire), 7, Generation(16), {SPEC_KEY: spec})
        msgspec.msgpack.decode(msgspec.msgpack.encode(extra))
        outcomes["ok"] += 1

    run()
    assert outcomes["ok"] >= 200


def test_any_spec_value_is_admitted_or_refused_naming_the_field():
    """Arbitrary JSON values, mutated valid specs and their (possibly truncated) JSON text, as
    ``extra_args["dynsteer"]``: admitted, or a SpecError starting with ``dynsteer``. Both
    outcomes must occur, so the property is not vacuous."""
    state = make_state()
    outcomes: Counter[str] = Counter()

    @settings(FUZZ, max_examples=800)
    @given(SPEC_INPUTS)
    def run(raw: Any) -> None:
        CASES["spec_inputs"] += 1

        def admit_and_resolve() -> None:
            result = admit(state, {SPEC_KEY: raw})
            extra = admitted(state, "r", result, 5, Generation(16), {SPEC_KEY: raw})
            msgspec.msgpack.encode(extra)

        outcomes[outcome(admit_and_resolve, (SPEC_KEY,))] += 1

    run()
    assert outcomes["ok"] > 0 and outcomes["refused"] > 0, outcomes
    assert state.counters.requests_rejected == outcomes["refused"]


def test_spec_text_with_an_integer_beyond_pythons_digit_limit_is_a_spec_error():
    """``json.loads`` refuses integers of more than 4300 digits with a plain ValueError (not a
    JSONDecodeError); a spec text carrying one is still malformed JSON naming the field."""
    state = make_state()
    for text in ('{"steer": [{"vector": "v", "layers": [1' + "0" * 5000 + "]}]}",
                 '{"version": ' + "9" * 4301 + "}"):
        with pytest.raises(SpecError, match=r"^dynsteer: malformed JSON"):
            admit(state, {SPEC_KEY: text})
    with pytest.raises(SpecError, match=r"^dynsteer: malformed JSON"):
        admit(state, {SPEC_KEY: b'{"steer": "\x80\xff"}'})  # not UTF-8


# ---- the control plane: what HTTP bodies and controller commands reach ---------------------------
NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), HOSTILE_NUMBERS.filter(
    lambda x: isinstance(x, float) or -(2**63) <= x < 2**64), st.integers(-(2**63), 2**64 - 1))
"""What a JSON body or a msgpack command can carry as a number (msgpack: 64-bit integers)."""

ENTRY_LISTS = st.one_of(st.lists(st.one_of(mutated(valid_entry()), json_like(6)), max_size=4),
                        st.lists(valid_entry(), min_size=65, max_size=66))
"""Lists of steer entries as a body carries them (the containers are lists: the body models
and the command schema guarantee that much)."""

VECTORS = st.one_of(json_like(8), st.lists(NUMBERS, min_size=HIDDEN, max_size=HIDDEN),
                    st.lists(st.floats(-10, 10), min_size=0, max_size=HIDDEN * 3),
                    st.sampled_from([np.ones(HIDDEN, np.float16), np.ones((2, 2)),
                                     np.array(["a"] * HIDDEN), np.array([True] * HIDDEN),
                                     np.full(HIDDEN, np.nan), np.array([1 + 1j] * HIDDEN),
                                     np.ones(HIDDEN, np.int64) * 2**62]))
NAMES = st.one_of(HOSTILE_STRINGS, st.text(max_size=70), st.from_regex(r"[A-Za-z0-9_.-]{1,64}",
                                                                        fullmatch=True))


def test_register_vector_any_values():
    plane = ControlPlane(make_state())
    outcomes: Counter[str] = Counter()

    @FUZZ
    @given(NAMES, VECTORS, st.booleans())
    def run(name: str, vector: Any, replace: bool) -> None:
        CASES["register_vector"] += 1
        outcomes[outcome(lambda: plane.register_vector(name, vector, replace=replace),
                         ("name", "vector"))] += 1

    run()
    assert outcomes["refused"] > 0, outcomes


def test_register_probe_any_values():
    plane = ControlPlane(make_state())
    outcomes: Counter[str] = Counter()

    @FUZZ
    @given(NAMES, VECTORS, NUMBERS, NUMBERS)
    def run(name: str, weights: Any, threshold: Any, sharpness: Any) -> None:
        CASES["register_probe"] += 1
        outcomes[outcome(lambda: plane.register_probe(name, weights, threshold, sharpness),
                         ("name", "weights", "threshold", "sharpness"))] += 1

    run()
    assert outcomes["refused"] > 0, outcomes


def test_update_probe_any_numbers():
    """The numbers a ``set_probe_threshold`` command can carry, for known and unknown names."""
    plane = ControlPlane(make_state())

    @FUZZ
    @given(st.one_of(st.just("p"), NAMES), NUMBERS, st.one_of(st.none(), NUMBERS))
    def run(name: str, threshold: Any, sharpness: Any) -> None:
        CASES["update_probe"] += 1
        outcome(lambda: plane.update_probe(name, threshold, sharpness),
                ("name", "threshold", "sharpness"))

    run()


def test_set_global_any_entries():
    plane = ControlPlane(make_state())
    outcomes: Counter[str] = Counter()

    @FUZZ
    @given(ENTRY_LISTS)
    def run(entries: list[Any]) -> None:
        CASES["set_global"] += 1
        outcomes[outcome(lambda: plane.set_global(entries), ("steer",))] += 1

    run()
    assert outcomes["ok"] > 0 and outcomes["refused"] > 0, outcomes


def test_session_steering_any_entries_and_gate():
    """What a ``set_session`` command carries: entries, and a gate parsed like the offline
    API's ``Steering.set_session`` parses one."""
    plane = ControlPlane(make_state())
    outcomes: Counter[str] = Counter()

    @FUZZ
    @given(ENTRY_LISTS, st.one_of(st.none(), valid_gate(), mutated(valid_gate()), json_like(8)))
    def run(entries: list[Any], gate: Any) -> None:
        CASES["session_steering"] += 1

        def call() -> None:
            parsed = None if gate is None else parse_gate(gate)
            plane.session_steering(entries, parsed)

        outcomes[outcome(call, ("steer", "gate"))] += 1

    run()
    assert outcomes["ok"] > 0 and outcomes["refused"] > 0, outcomes


# ---- the HTTP bodies, as the routes handle them (model, then the control plane) ------------------
def route_outcome(model: type, raw: Any, then: Callable[[Any], Any]) -> str:
    """A route's handling of ``raw`` without a server: the body model (a failure there is the
    route's HTTP 400 worded by ``validation_message``, which must name a field), then the
    route's own logic (a ValueError naming a field)."""
    try:
        body = model.model_validate(raw)
    except ValidationError as e:
        message = validation_message(list(e.errors()))
        field = message.partition(":")[0]
        assert field and not field.startswith(" "), f"no field named: {message!r}"
        return "invalid"
    try:
        then(body)
    except ValueError as e:
        message = str(e)
        field = message.partition(":")[0]
        assert field and " " not in field, f"no field named: {message!r}"
        return "refused"
    return "ok"


@st.composite
def valid_vector_body(draw: st.DrawFn) -> dict[str, Any]:
    form = draw(st.sampled_from(["vector", "vector_b64"]))
    return {"name": draw(st.from_regex(r"[a-z]{1,8}", fullmatch=True)),
            form: VECTOR if form == "vector" else encode_f32(VECTOR)}


@st.composite
def probe_bodies(draw: st.DrawFn) -> dict[str, Any]:
    form = draw(st.sampled_from(["weights", "weights_b64"]))
    body: dict[str, Any] = {
        "name": "q", form: PROBE_WEIGHTS if form == "weights" else encode_f32(PROBE_WEIGHTS),
        "threshold": 0.25, "sharpness": 2.0,
        "site": {"layer": draw(st.sampled_from([0, 1])), "hook": "post_block"},
        "metadata": {"source": "fuzz"}}
    if draw(st.booleans()):
        body["fingerprint"] = {"architecture": "LlamaForCausalLM", "hidden_size": HIDDEN,
                               "num_layers": LAYERS}
    return body


def test_vector_bodies():
    """``POST /v1/dynsteer/vectors``: VectorIn, then registration of its values."""
    plane = ControlPlane(make_state())
    outcomes: Counter[str] = Counter()

    @FUZZ
    @given(st.one_of(json_like(), valid_vector_body(), mutated(valid_vector_body())))
    def run(raw: Any) -> None:
        CASES["vector_bodies"] += 1
        outcomes[route_outcome(VectorIn, raw,
                               lambda b: plane.register_vector(b.name, b.values()))] += 1

    run()
    assert outcomes["ok"] > 0 and outcomes["invalid"] > 0, outcomes


def test_probe_bodies():
    """``POST /v1/dynsteer/probes``: ProbeUpload, ``to_probe`` and the compatibility checks."""
    plane = ControlPlane(make_state())
    outcomes: Counter[str] = Counter()

    @FUZZ
    @given(st.one_of(json_like(), probe_bodies(), mutated(probe_bodies())))
    def run(raw: Any) -> None:
        CASES["probe_bodies"] += 1
        outcomes[route_outcome(ProbeUpload, raw,
                               lambda b: plane.register_probe_object(b.to_probe()))] += 1

    run()
    assert outcomes["ok"] > 0 and outcomes["invalid"] > 0, outcomes


def test_global_bodies():
    """``PUT /v1/dynsteer/global``: GlobalSteering, then the control plane."""
    plane = ControlPlane(make_state())
    outcomes: Counter[str] = Counter()

    @FUZZ
    @given(st.one_of(json_like(), mutated(st.fixed_dictionaries(
        {"steer": st.lists(valid_entry(), max_size=3)}))))
    def run(raw: Any) -> None:
        CASES["global_bodies"] += 1
        outcomes[route_outcome(GlobalSteering, raw, lambda b: plane.set_global(b.steer))] += 1

    run()
    assert outcomes["ok"] > 0 and outcomes["invalid"] > 0, outcomes


# ---- the Python API's parameters given any value ------------------------------------------------
def test_control_plane_python_api_with_any_value():
    """The offline ``Steering`` API hands its arguments to the control plane as given: any
    value is accepted or refused with a ValueError naming the field (no TypeError or
    OverflowError from a wrong type or a huge integer)."""
    plane = ControlPlane(make_state())

    @settings(FUZZ, max_examples=300)
    @given(json_like(6), st.sampled_from(range(5)))
    def run(a: Any, which: int) -> None:
        CASES["python_api"] += 1
        calls: list[tuple[Callable[[], Any], tuple[str, ...]]] = [
            (lambda: plane.set_global(a), ("steer",)),
            (lambda: plane.session_steering(a, None), ("steer",)),
            (lambda: plane.update_probe("p", a, None), ("threshold",)),
            (lambda: plane.register_probe("q", PROBE_WEIGHTS, a, 1.0), ("threshold",)),
            (lambda: plane.unregister_vector(a), ("name",)),
        ]
        call, fields = calls[which]
        outcome(call, fields)

    run()
