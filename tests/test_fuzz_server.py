"""Hostile HTTP clients against one live `dynsteer serve` with an API key.

One server (the tiny chat model of ``test_server``, ``--dynsteer-api-key``) is started for
the module. Every route is taken from its ``/openapi.json`` at test time, so a route added
later is covered (or fails the test) without anyone editing this file:

* every mutating dynsteer route refuses requests without the key, with a wrong key or a
  wrong scheme (401), and a refused request changes nothing; with the key the same request
  works. The GET routes are split by the code's rule (open, or guarded because they return
  another client's data), and vLLM's own routes are checked for what they really do when only
  ``--dynsteer-api-key`` is set: they are open (vLLM's ``--api-key`` is what guards them);
* every dynsteer route with a JSON body gets bodies generated from its schema
  (``hypothesis-jsonschema``), fully random JSON and mutated valid bodies, with and without the
  key; path parameters get random names; completions get random and mutated ``dynsteer``
  specs. No answer may be a 5xx, and afterwards the engine still serves the same outputs as
  before (and vLLM's ``http_requests_total{status="5xx"}`` did not move);
* concurrent requests affect only their own output, internal ``extra_args`` keys smuggled in
  ``vllm_xargs`` are ignored, and a pickle sent as a body is never unpickled.

The number of fuzz cases is printed and written to ``fuzz_server_cases.json`` in pytest's
base temporary directory. Hypothesis runs derandomized and bounded (CI stability).
"""

from __future__ import annotations

import json
import pickle
import re
import types
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote

import httpx
import hypothesis_jsonschema._from_schema as jsonschema_strategies
import numpy as np
import pytest
from fuzz_report import report_cases
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import utils as conjecture_utils
from hypothesis_jsonschema import from_schema
from server_utils import Server
from test_fuzz_spec import json_like, mutated
from test_fuzz_zmq import Trap

from dynsteer.controller.contract import encode_f32

pytestmark = pytest.mark.engine

KEY = "fuzz-key"
PREFIX = "/v1/dynsteer"
HIDDEN = 128
VECTOR = (np.random.default_rng(7).standard_normal(HIDDEN) * 4).tolist()
STATIC = {"steer": [{"vector": VECTOR, "layers": [1, 2]}]}
GATED = {"gate": {"probe": {"weights": VECTOR, "threshold": 0.0}, "layer": 1,
                  "steer": [{"vector": VECTOR, "layers": [2], "scale": 2.0}]}}
PROMPT = "The sea is"
MAX_TOKENS = 8
STARTUP_TIMEOUT_S = 900  # other engine tests may share the 2 cores

KNOWN_MUTATING = {("PUT", "/global"), ("DELETE", "/global"), ("POST", "/vectors"),
                  ("DELETE", "/vectors/{name}"), ("POST", "/probes"),
                  ("DELETE", "/probes/{name}"), ("POST", "/capture")}
"""The mutating dynsteer routes today; the OpenAPI list must contain at least these."""
GUARDED_GETS = {"/requests/{request_id}", "/capture/global"}
"""GET routes that need the key: they return another client's data (request telemetry) or
where the operator collects traffic (the global capture and its sink)."""
OPEN_GETS = {"/health", "/info", "/global", "/vectors", "/vectors/{name}", "/probes",
             "/probes/{name}"}
"""GET routes readable without the key (the served model, the registry and the global
steering are not secret: any request can name and use them)."""
MUTATING = ("post", "put", "patch", "delete")

VALID_BODIES: dict[tuple[str, str], Any] = {
    ("PUT", "/global"): {"steer": [{"vector": VECTOR, "layers": [1]}]},
    ("POST", "/vectors"): {"name": "intruder", "vector": VECTOR},
    ("POST", "/probes"): {"name": "intruder", "weights_b64": encode_f32(VECTOR),
                          "threshold": 0.0, "sharpness": 1.0,
                          "site": {"layer": 1, "hook": "post_block"}},
    ("POST", "/capture"): {"prompts": [[1, 2, 3]], "sites": "post_block@1"},
}
"""A body each body-taking route accepts (so only the key decides)."""

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
"""Bounded and reproducible: the whole module stays within a few minutes on 2 cores."""

CASES: Counter[str] = Counter()
"""Fuzz requests sent, by test."""
STATUSES: Counter[int] = Counter()
"""Every fuzz answer's status."""


# ---- hypothesis-jsonschema on current Hypothesis ---------------------------------------------
class _LegacyMany:
    """hypothesis-jsonschema 0.23 (the latest) drives ``conjecture.utils.many`` through
    ``more()`` / ``reject()``, which current Hypothesis replaced by a context manager and an
    iterator (object schemas then fail with AttributeError); this presents the old interface
    over the new one."""

    _DONE = object()

    def __init__(self, data: Any, min_size: int, max_size: float, average_size: float) -> None:
        self._many = conjecture_utils.many(data, min_size=min_size, max_size=max_size,
                                           average_size=average_size)
        self._many.__enter__()
        self._steps = iter(self._many)

    def more(self) -> bool:
        if next(self._steps, self._DONE) is self._DONE:
            self._many.__exit__(None, None, None)
            return False
        return True

    def reject(self, why: str | None = None) -> None:
        self._many.reject(why)


if not hasattr(conjecture_utils.many, "more"):
    jsonschema_strategies.cu = types.SimpleNamespace(many=_LegacyMany)  # type: ignore[attr-defined]


def resolve(node: Any, components: dict[str, Any]) -> Any:
    """An OpenAPI schema with its ``$ref``s to ``components/schemas`` inlined (FastAPI's
    schemas here are not recursive) and OpenAPI-only keys dropped."""
    if isinstance(node, dict):
        if "$ref" in node:
            return resolve(components[node["$ref"].rsplit("/", 1)[1]], components)
        return {k: resolve(v, components) for k, v in node.items() if k != "discriminator"}
    if isinstance(node, list):
        return [resolve(v, components) for v in node]
    return node


# ---- the server and its clients ----------------------------------------------------------------
@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory) -> Iterator[Server]:
    srv = Server(chat_model, tmp_path_factory.mktemp("fuzz-server") / "serve.log",
                 "--dynsteer-api-key", KEY, "--dynsteer-max-body-bytes", "1048576")
    try:
        srv.wait_ready(STARTUP_TIMEOUT_S)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=180) as c:
        yield c


@pytest.fixture(scope="module")
def openapi(client) -> dict[str, Any]:
    r = client.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


def complete(client: httpx.Client, model: str, **extra: Any) -> str:
    r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT,
                                             "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                             "seed": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def five_xx(client: httpx.Client) -> float:
    """vLLM's count of 5xx answers (``http_requests_total{status="5xx"}``, all handlers)."""
    text = client.get("/metrics").text
    return sum(float(v) for v in re.findall(r'^http_requests_total\{[^}]*status="5xx"[^}]*\} '
                                            r"(\S+)$", text, re.M))


@pytest.fixture(scope="module")
def baseline(client, model) -> dict[str, Any]:
    """Outputs and the 5xx count before any hostile traffic."""
    plain = complete(client, model)
    steered = complete(client, model, dynsteer=STATIC)
    assert steered != plain
    return {"plain": plain, "steered": steered, "5xx": five_xx(client)}


@pytest.fixture(scope="module", autouse=True)
def cases_report(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[None]:
    yield
    statuses = dict(sorted(STATUSES.items()))
    report_cases(request, tmp_path_factory, "test_fuzz_server", "fuzz requests", CASES,
                 {"statuses": {str(k): v for k, v in statuses.items()}},
                 f"; statuses {statuses}")


def send(client: httpx.Client, method: str, path: str, bucket: str, body: Any = None, *,
         raw: bytes | None = None, key: str | None = None,
         headers: dict[str, str] | None = None, params: dict[str, str] | None = None
         ) -> httpx.Response:
    """One fuzz request (counted); a 5xx fails the test with what was sent."""
    content = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    sent = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    r = client.request(method, path, content=content, headers=sent, params=params)
    CASES[bucket] += 1
    STATUSES[r.status_code] += 1
    assert r.status_code < 500, (method, path, (content or b"")[:300], r.status_code, r.text[:500])
    return r


def snapshot(client: httpx.Client) -> dict[str, Any]:
    """Everything a mutating dynsteer route can change, read through the open GET routes."""
    vectors = client.get(f"{PREFIX}/vectors").json()["names"]
    return {"global": client.get(f"{PREFIX}/global").json(),
            "vectors": {n: client.get(f"{PREFIX}/vectors/{n}").json() for n in vectors},
            "probes": client.get(f"{PREFIX}/probes").json()}


def routes(openapi: dict[str, Any], methods: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(m.upper(), p) for p, ops in openapi["paths"].items() for m in ops if m in methods]


def fill(path: str, value: str = "guarded") -> str:
    return re.sub(r"\{[^}]+\}", value, path)


# ---- authentication, route by route -------------------------------------------------------------
BAD_CREDENTIALS = [None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer{KEY}", f"Bearer {KEY}x",
                   f"Bearer {KEY.upper()}", "Bearer", f"Token {KEY}", ""]


def test_every_mutating_dynsteer_route_needs_the_key(client, openapi, baseline):
    """Every POST/PUT/PATCH/DELETE under /v1/dynsteer from the live OpenAPI list: 401 without
    the key, with a wrong one or a wrong scheme, even with a body it would accept; nothing
    changes; then the key makes the same request work."""
    ours = [(m, p[len(PREFIX):]) for m, p in routes(openapi, MUTATING) if p.startswith(PREFIX)]
    assert ours and set(ours) >= KNOWN_MUTATING, ours
    for kind in ("vectors", "probes"):  # something the DELETE routes would remove
        body = {**VALID_BODIES[("POST", f"/{kind}")], "name": "guarded"}
        assert client.post(f"{PREFIX}/{kind}", json=body,
                           headers={"Authorization": f"Bearer {KEY}"}).status_code == 201
    before = snapshot(client)
    for method, path in ours:
        body = VALID_BODIES.get((method, path), {} if method != "DELETE" else None)
        for credential in BAD_CREDENTIALS:
            headers = {} if credential is None else {"Authorization": credential}
            r = send(client, method, PREFIX + fill(path), "auth", body, headers=headers)
            assert r.status_code == 401 and "API key" in r.text, (method, path, credential,
                                                                    r.status_code, r.text)
    assert snapshot(client) == before
    for method, path in ours:  # the key is all that was missing (lower-case scheme too)
        r = send(client, method, PREFIX + fill(path), "auth", VALID_BODIES.get((method, path)),
                 headers={"Authorization": f"bearer {KEY}"})
        if (method, path) in KNOWN_MUTATING:
            assert 200 <= r.status_code < 300, (method, path, r.status_code, r.text)
        else:
            assert r.status_code != 401, (method, path, r.text)
    assert snapshot(client) != before
    client.delete(f"{PREFIX}/global", headers={"Authorization": f"Bearer {KEY}"})
    for kind in ("vectors", "probes"):
        client.delete(f"{PREFIX}/{kind}/intruder", headers={"Authorization": f"Bearer {KEY}"})


def test_get_routes_are_open_or_guarded_by_rule(client, openapi):
    """Every dynsteer GET is listed as open or guarded (a new one must be classified); the
    guarded ones (another client's data) refuse without the key, the open ones answer."""
    gets = {p[len(PREFIX):] for m, p in routes(openapi, ("get",)) if p.startswith(PREFIX)}
    assert gets == OPEN_GETS | GUARDED_GETS, gets ^ (OPEN_GETS | GUARDED_GETS)
    for path in sorted(gets):
        for credential in (None, "Bearer wrong"):
            headers = {} if credential is None else {"Authorization": credential}
            r = send(client, "GET", PREFIX + fill(path, "nope"), "auth", headers=headers)
            if path in GUARDED_GETS:
                assert r.status_code == 401, (path, r.text)
            else:
                assert r.status_code in (200, 404), (path, r.status_code, r.text)
    r = send(client, "GET", PREFIX + "/requests/nope", "auth", key=KEY)
    assert r.status_code == 404


def test_vllm_routes_are_open_with_only_the_dynsteer_key(client, openapi, model):
    """What a deployment with only ``--dynsteer-api-key`` really exposes: vLLM's own POST
    routes answer without a key (vLLM's ``--api-key`` is what guards them, and then only
    under /v1, /v2, /inference and /cohere), and none of them changes dynsteer's state."""
    theirs = [(m, p) for m, p in routes(openapi, MUTATING) if not p.startswith(PREFIX)]
    assert ("POST", "/v1/completions") in theirs and ("POST", "/v1/chat/completions") in theirs
    before = snapshot(client)
    for method, path in theirs:
        if path == "/v1/completions":
            body: Any = {"model": model, "prompt": PROMPT, "max_tokens": 2,
                         "dynsteer": STATIC}
        elif path == "/v1/chat/completions":
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2, "dynsteer": STATIC}
        else:
            body = {}  # never a valid body: /scale_elastic_ep & co. must not do anything
        r = send(client, method, fill(path, "nope"), "vllm_routes", body)
        assert r.status_code != 401, (method, path)
        if path.endswith("completions"):
            assert r.status_code == 200, (path, r.text)
    assert snapshot(client) == before


# ---- a request can only affect its own output --------------------------------------------------
def test_concurrent_requests_affect_only_their_own_output(client, model, baseline):
    """Plain, statically steered, gated and key-smuggling requests in one batch: each plain one
    gets the unsteered output, each steered one its own steering, and one sending internal
    keys in ``vllm_xargs`` (the resolved spec, the prefix guard, the global fingerprint) is
    refused with a 400 naming the first of them."""
    smuggled = {"vllm_xargs": {"dynsteer_wire": json.dumps({"steer": [["post_block", [1]]]}),
                               "dynsteer_guard": "forged", "dynsteer_global": "00" * 16}}
    jobs = [{}, {"dynsteer": STATIC}, {"dynsteer": GATED}, smuggled, {}, {"dynsteer": STATIC}]

    def send_job(extra: dict[str, Any]) -> str | httpx.Response:
        if extra is smuggled:
            return client.post("/v1/completions", json={
                "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, **extra})
        return complete(client, model, **extra)

    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(send_job, jobs))
    CASES["isolation"] += len(jobs)
    refused = texts.pop(3)
    assert refused.status_code == 400, refused.text
    assert "vllm_xargs.dynsteer_global: reserved" in refused.text
    assert texts[0] == texts[3] == baseline["plain"]
    assert texts[1] == texts[4] == baseline["steered"]


def test_pickled_bodies_are_never_unpickled(client, model, tmp_path):
    """The server runs on this machine, so a pickle whose loading creates a file shows whether
    anything unpickled it."""
    marker = tmp_path / "unpickled"
    payload = [pickle.dumps(Trap(marker), protocol=p) for p in (0, 2, 5)]
    targets = [("PUT", f"{PREFIX}/global"), ("POST", f"{PREFIX}/vectors"),
               ("POST", f"{PREFIX}/probes"), ("POST", f"{PREFIX}/capture"),
               ("POST", "/v1/completions")]
    for method, path in targets:
        for raw in payload:
            for content_type in ("application/octet-stream", "application/python-pickle",
                                 "application/json"):
                r = send(client, method, path, "pickle", raw=raw, key=KEY,
                         headers={"Content-Type": content_type})
                assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
    assert not marker.exists()


# ---- schema-driven fuzzing ---------------------------------------------------------------------
@st.composite
def server_spec(draw: st.DrawFn) -> dict[str, Any]:
    """A spec the served model accepts (4 layers, hidden 128, monitors at layers 1-3)."""
    entries = draw(st.lists(st.fixed_dictionaries(
        {"layers": st.lists(st.integers(0, 3), min_size=1, max_size=3)},
        optional={"vector_b64": st.just(encode_f32(VECTOR)),
                  "scale": st.floats(-2, 2), "phase": st.sampled_from(["all", "decode"])}),
        max_size=2))
    for entry in entries:
        entry.setdefault("vector_b64", encode_f32(VECTOR))
    spec: dict[str, Any] = {"steer": entries}
    if draw(st.booleans()):
        spec["gate"] = {"probe": {"weights_b64": encode_f32(VECTOR)}, "layer": 1,
                        "steer": [{"vector_b64": encode_f32(VECTOR), "layers": [2]}]}
        if draw(st.booleans()):
            spec["controller"] = {"name": "latch", "k": draw(st.integers(1, 3))}
    return spec


def test_schema_driven_fuzzing_of_every_dynsteer_body(client, openapi, baseline):
    """Every dynsteer route with a JSON body in the OpenAPI list: bodies from its schema, random
    JSON, mutated valid bodies and random bytes, with the key, a wrong key and none; every
    query parameter random too. Never a 5xx; never anything but 401 without the key."""
    components = openapi["components"]["schemas"]
    targets = []
    for path, ops in openapi["paths"].items():
        for method, op in ops.items():
            content = (op.get("requestBody") or {}).get("content", {})
            if path.startswith(PREFIX) and "application/json" in content:
                schema = resolve(content["application/json"]["schema"], components)
                query = [p["name"] for p in op.get("parameters", []) if p["in"] == "query"]
                targets.append((method.upper(), path, schema, query))
    assert {(m, p[len(PREFIX):]) for m, p, _, _ in targets} >= set(VALID_BODIES)
    for method, path, schema, query in targets:
        fuzz_body_route(client, method, path, schema, query)


def fuzz_body_route(client: httpx.Client, method: str, path: str, schema: dict[str, Any],
                    query: list[str]) -> None:
    """Fuzz one route's body and query parameters (see the test above)."""
    valid = VALID_BODIES.get((method, path[len(PREFIX):]), {})
    bodies = st.one_of(from_schema(schema).map(lambda b: ("json", b)),
                       json_like().map(lambda b: ("json", b)),
                       # mutated bodies may be JSON text, possibly truncated: sent as is
                       mutated(st.just(valid)).map(
                           lambda b: ("raw", b) if isinstance(b, (str, bytes)) else ("json", b)),
                       st.binary(max_size=200).map(lambda b: ("raw", b)))
    query_values = st.one_of(st.sampled_from(["true", "false", "1", "maybe", ""]),
                             st.text(max_size=8))

    @FUZZ
    @given(bodies, st.sampled_from([None, KEY, "wrong"]),
           st.fixed_dictionaries({}, optional={q: query_values for q in query}))
    def run(body: tuple[str, Any], key: str | None, params: dict[str, str]) -> None:
        kind, value = body
        if kind == "raw":
            raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
            r = send(client, method, path, "schema_fuzz", raw=raw, key=key, params=params)
        else:
            r = send(client, method, path, "schema_fuzz", value, key=key, params=params)
        if key != KEY:
            # FastAPI parses the JSON before the key check runs: a body that is not JSON
            # at all is refused as such (400) without the key, anything else is 401.
            refused = (401, 400) if kind == "raw" and not is_json(raw) else (401,)
            assert r.status_code in refused, (path, r.status_code, r.text)
            assert r.status_code == 401 or "JSON decode error" in r.text \
                or "error parsing the body" in r.text, r.text

    run()


def is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def test_path_parameters_fuzzed(client, openapi):
    """Every dynsteer route with a path parameter, with random names (dots, slashes, unicode,
    percent-escapes), with and without the key."""
    targets = [(m, p) for m, p in routes(openapi, ("get", "delete")) if p.startswith(PREFIX)
               and "{" in p]
    assert len(targets) >= 5, targets
    guarded = {(m, PREFIX + p) for m, p in KNOWN_MUTATING} | {
        ("GET", PREFIX + p) for p in GUARDED_GETS}

    @settings(FUZZ, max_examples=150)
    @given(st.sampled_from(targets), st.one_of(
        st.text(min_size=1, max_size=70), st.sampled_from(["..", ".", "%2e%2e", "a/b", "\x00",
                                                           "guarded", "x" * 5000])),
        st.sampled_from([None, KEY]))
    def run(target: tuple[str, str], name: str, key: str | None) -> None:
        method, path = target
        r = send(client, method, fill(path, quote(name, safe="")), "path_fuzz", key=key)
        # A name with a slash (%2F is decoded) or a dot segment (httpx normalizes it) makes
        # it another path (the list route, or none): only "no 5xx" applies then.
        pattern = re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(path))
        if key is None and (method, path) in guarded and re.fullmatch(
                pattern, r.request.url.path):
            assert r.status_code == 401, (method, path, name, r.text)

    run()


def test_completion_specs_fuzzed(client, model, baseline):
    """Random, mutated and valid ``dynsteer`` specs on both completion routes, as a top-level
    field and in ``vllm_xargs``, with and without the key: 200 or 4xx, both seen."""
    statuses: Counter[int] = Counter()

    @settings(FUZZ, max_examples=150)
    @given(st.one_of(server_spec(), mutated(server_spec()), json_like()),
           st.sampled_from(["top", "xargs", "chat"]), st.sampled_from([None, KEY]))
    def run(spec: Any, form: str, key: str | None) -> None:
        if isinstance(spec, bytes):
            spec = spec.decode("utf-8", "surrogatepass")
        if form == "chat":
            path, body = "/v1/chat/completions", {
                "model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1, "dynsteer": spec}
        else:
            path, body = "/v1/completions", {"model": model, "prompt": PROMPT,
                                             "max_tokens": 1}
            if form == "top":
                body["dynsteer"] = spec
            else:
                body["vllm_xargs"] = {"dynsteer": spec if isinstance(spec, str)
                                      else json.dumps(spec)}
        statuses[send(client, "POST", path, "completion_specs", body, key=key).status_code] += 1

    run()
    assert statuses[200] > 0 and statuses[400] > 0, statuses


def test_the_engine_still_serves_after_fuzzing(client, model, baseline):
    """After everything above: workers answer, no 5xx was counted by vLLM either, and once the
    fuzzers' registrations and global steering are removed the outputs are the ones from
    before, plain and steered."""
    assert client.get(f"{PREFIX}/health").status_code == 200
    auth = {"Authorization": f"Bearer {KEY}"}
    assert client.delete(f"{PREFIX}/global", headers=auth).status_code == 200
    for name in client.get(f"{PREFIX}/vectors").json()["names"]:
        assert client.delete(f"{PREFIX}/vectors/{quote(name, safe='')}",
                             headers=auth).status_code == 200
    for probe in client.get(f"{PREFIX}/probes").json()["probes"]:
        assert client.delete(f"{PREFIX}/probes/{quote(probe['name'], safe='')}",
                             headers=auth).status_code == 200
    assert complete(client, model) == baseline["plain"]
    assert complete(client, model, dynsteer=STATIC) == baseline["steered"]
    assert five_xx(client) == baseline["5xx"]
    assert sum(CASES.values()) > 0
