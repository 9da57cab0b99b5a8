"""Probes over HTTP on a real `dynsteer serve`: train on captured activations, upload, gate by
name, bad uploads, a restart that keeps the uploaded probes (probe store on disk), concurrent
registrations against the registry caps, and a restart that brings back exactly what was
registered (the oldest first under a lowered cap)."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import threading
import time

import numpy as np
import pytest
from server_utils import Server, http

from dynsteer.controller.client import DynsteerClient, DynsteerHTTPError
from dynsteer.probes import ModelFingerprint, Probe, ProbeSite, from_sklearn, upload

pytestmark = pytest.mark.engine

KEY = "probe-key"
LAYER = 1
FINGERPRINT = ModelFingerprint(architecture="LlamaForCausalLM", hidden_size=128, num_layers=4)
POSITIVE = ["The storm hit the ship hard.", "Waves crashed over the deck.",
            "The sailors fought the sea.", "Thunder rolled across the ocean."]
NEGATIVE = ["I like quiet gardens.", "The cat sleeps on the sofa.",
            "We baked bread this morning.", "The library was calm today."]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("probe_store")


CAPS = {"max_vectors": 8, "max_probes": 6, "capture_max_bytes": 128 * 128 * 4}
"""Small registry caps (engine options), so that filling a registry takes a few requests, and
a capture of 128 rows of one site at most."""


def _serve(chat_model, store, log, **caps: int) -> Server:
    """`dynsteer serve` with this module's key, store, body limit and :data:`CAPS` (``caps``
    override them; they are runtime options, so no recompilation); not yet ready."""
    config = json.dumps({"dynsteer": {**CAPS, **caps}})
    return Server(chat_model, log, "--dynsteer-api-key", KEY, "--dynsteer-probe-store",
                  str(store), "--dynsteer-max-body-bytes", "200000",
                  "--additional-config", config)


@pytest.fixture(scope="module")
def server(chat_model, store, tmp_path_factory):
    srv = _serve(chat_model, store, tmp_path_factory.mktemp("logs") / "serve1.log")
    holder = {"server": srv}
    srv.wait_ready()
    yield holder
    holder["server"].stop()


def _client(server) -> DynsteerClient:
    return DynsteerClient(server["server"].url, api_key=KEY)


def _capture(server, prompts, reduce):
    return _client(server).capture(prompts, [f"post_block@{LAYER}"], reduce=reduce)[
        f"post_block@{LAYER}"]


@pytest.fixture(scope="module")
def trained(server):
    """A logistic-regression probe trained on the server's own captured activations."""
    from sklearn.linear_model import LogisticRegression

    x = _capture(server, POSITIVE + NEGATIVE, "mean")
    y = np.array([1] * len(POSITIVE) + [0] * len(NEGATIVE))
    estimator = LogisticRegression(C=10.0, max_iter=2000).fit(x, y)
    probe = from_sklearn(estimator, layer=LAYER, name="storm")
    return probe.replace(fingerprint=FINGERPRINT, sharpness=1.0)


def _gated_completion(server, prompt: str, probe: str = "storm"):
    spec = {"gate": {"probe": probe, "layer": LAYER, "trace": True,
                     "steer": [{"vector": [0.5] * 128, "layers": [2]}]}}
    url = server["server"].url
    model = http("GET", url + "/v1/models")[1]["data"][0]["id"]
    status, body = http("POST", url + "/v1/completions",
                        {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                         "dynsteer": spec})
    assert status == 200, body
    return body["id"]


def test_upload_list_and_read_back(server, trained):
    summary = upload(trained, server["server"].url, api_key=KEY)
    assert summary["name"] == "storm" and summary["site"] == f"post_block@{LAYER}"
    client = _client(server)
    assert [p.name for p in client.probes()] == ["storm"]
    back = client.get_probe("storm")
    np.testing.assert_array_equal(back.weights, trained.weights)
    assert (back.threshold, back.fingerprint) == (trained.threshold, trained.fingerprint)


def test_gate_by_name_matches_probe_on_captured_activations(server, trained):
    prompt = POSITIVE[0] + " " + NEGATIVE[0]
    request_id = _gated_completion(server, prompt)
    report = _client(server).request(request_id)
    gates = np.array(report.telemetry.gates, dtype=float)
    (acts,) = _capture(server, [prompt], "all")
    expected = trained.gate(acts)
    np.testing.assert_allclose(gates[: len(expected)], expected, atol=2e-4)
    assert report.telemetry.tokens_monitored >= len(expected)


def _bad_uploads(trained: Probe) -> list[tuple[str, object, str | None, tuple[int, ...], str]]:
    good = trained.to_json_dict()
    nan = {**trained.to_json_dict(weights_format="list"), "name": "nan"}
    nan["weights"][3] = math.nan
    list_weights = trained.to_json_dict(weights_format="list")
    return [
        ("wrong size", {**good, "name": "small",
                        "weights_b64": Probe(name="s", weights=np.ones(3, np.float32),
                                             site=ProbeSite(layer=1)).to_json_dict()[
                            "weights_b64"]}, KEY, (400,), "weights have 3 entries"),
        ("nan", nan, KEY, (400, 422), ""),
        ("huge body", {**trained.to_json_dict(weights_format="list"), "name": "huge",
                       "metadata": {"blob": "x" * 300000}}, KEY, (413,), "larger than"),
        ("bad name", {**good, "name": "../../etc"}, KEY, (400, 422), "name"),
        ("missing key", {**good, "name": "nokey"}, None, (401,), "API key"),
        ("wrong key", {**good, "name": "nokey"}, "nope", (401,), ""),
        ("unconfigured site", {**good, "name": "site", "site": {"layer": 1, "hook": "pre_attn"}},
         KEY, (400,), "pre_attn@1 is not a monitor site"),
        ("layer out of range", {**good, "name": "deep", "site": {"layer": 9}}, KEY, (400,),
         "site.layer 9 is out of range"),
        ("layer not served", {**good, "name": "deep", "site": {"layer": 9}, "fingerprint": None},
         KEY, (400,), "site.layer: 9 does not exist"),
        ("other model", {**good, "name": "other", "fingerprint": {
            "architecture": "Qwen3ForCausalLM", "hidden_size": 128, "num_layers": 4}}, KEY,
         (400,), "fingerprint: architecture"),
        ("both weights", {**good, "name": "both", "weights": [0.0] * 128}, KEY, (400, 422),
         "exactly one"),
        ("inf in fp32", {**list_weights, "name": "big", "weights": [1e39] * 128}, KEY, (400,),
         "weights[0]: 1e+39 is not finite in float32"),
        ("huge weights", {**list_weights, "name": "big", "weights": [1e30] * 128}, KEY, (400,),
         "weights: magnitudes must be at most"),
        ("huge threshold", {**good, "name": "big", "threshold": 1e30}, KEY, (400,),
         "threshold: must be finite and at most"),
        ("string weights", {**list_weights, "name": "big", "weights": ["1"] * 128}, KEY, (400,),
         "weights[0]"),
        # 20000 characters, 120008 bytes in the file: over the 64 KiB a probe header may hold.
        ("metadata over 64 KiB stored", {**good, "name": "accents", "metadata": {"a": "é" * 20000}},
         KEY, (400,), "metadata: 120008 bytes as stored"),
    ]


def test_bad_uploads_are_4xx_and_change_nothing(server, trained, store):
    url = server["server"].url + "/v1/dynsteer/probes"
    files_before = sorted(p.name for p in store.iterdir())
    for label, body, key, statuses, fragment in _bad_uploads(trained):
        raw = json.dumps(body).encode()  # json.dumps writes NaN as a bare token
        status, answer = http("POST", url, raw=raw, api_key=key)
        assert status in statuses, (label, answer)
        assert fragment in json.dumps(answer), (label, answer)
    assert [p.name for p in _client(server).probes()] == ["storm"]
    assert sorted(p.name for p in store.iterdir()) == files_before
    with pytest.raises(DynsteerHTTPError) as info:
        DynsteerClient(server["server"].url).delete_probe("storm")
    assert info.value.status == 401


@pytest.mark.parametrize("body,key,status,fragment", [
    ({"prompts": ["hi"], "sites": ["pre_attn@1"]}, KEY, 400, "pre_attn@1"),
    ({"prompts": ["hi"], "sites": ["post_block@1"], "reduce": "max"}, KEY, 400, "reduce"),
    ({"prompts": [], "sites": ["post_block@1"]}, KEY, 400, "prompts"),
    ({"prompts": ["hi"], "sites": ["post_block@1"]}, None, 401, "API key"),
    ({"prompts": ["hi"] * 129, "sites": ["post_block@1"]}, KEY, 400,
     "prompts: the capture returns 66048 bytes (129 rows x 1 sites x 128 float32); this engine "
     "returns at most 65536 per capture (dynsteer.capture_max_bytes)"),
])
def test_capture_errors_are_4xx(server, body, key, status, fragment):
    code, answer = http("POST", server["server"].url + "/v1/dynsteer/capture", body,
                        api_key=key)
    assert code == status, answer
    assert fragment in json.dumps(answer), answer


def test_duplicate_upload_is_409_unless_replacing(server, trained):
    url = server["server"].url
    with pytest.raises(DynsteerHTTPError) as taken:
        upload(trained, url, api_key=KEY)
    assert taken.value.status == 409 and "already registered" in taken.value.message
    assert upload(trained, url, api_key=KEY, replace=True)["name"] == "storm"
    for name in (".hidden", "..", "."):
        status, answer = http("POST", url + "/v1/dynsteer/probes",
                              {**trained.to_json_dict(), "name": name}, api_key=KEY)
        assert status == 400 and "name" in json.dumps(answer), (name, answer)


def test_listing_leaves_out_large_metadata_which_the_probe_keeps(server, trained):
    url = server["server"].url
    wordy = trained.replace(name="wordy", metadata={"notes": "ü" * 1000})
    assert upload(wordy, url, api_key=KEY)["metadata_omitted"]
    listed = {p.name: p for p in _client(server).probes()}
    assert listed["wordy"].metadata == {} and listed["wordy"].metadata_omitted
    assert listed["storm"].metadata == trained.metadata
    assert _client(server).get_probe("wordy").metadata == wordy.metadata
    _client(server).delete_probe("wordy")


def test_restart_after_kill_9_mid_upload_serves_whole_probes_and_vectors(
        server, trained, chat_model, store, tmp_path_factory):
    """``kill -9`` of the server while probes are being replaced and vectors registered:
    the restarted server (same store) serves every probe and vector registered before, each
    whole (a probe is the old or a new version, never a torn file), removes leftovers of
    interrupted writes, and gates with them."""
    url = server["server"].url
    upload(trained.replace(name="storm2", threshold=trained.threshold + 1.0), url, api_key=KEY)
    _client(server).delete_probe("storm2")
    vector = np.random.default_rng(5).standard_normal(128).astype(np.float32)
    _client(server).register_vector("calm", vector)
    _client(server).register_vector("gone", vector)
    _client(server).delete_vector("gone")
    thresholds = {trained.threshold, *(trained.threshold + k for k in (0.25, 0.5, 0.75))}
    replaced: list[float] = []
    stop = threading.Event()

    def churn() -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            threshold = trained.threshold + 0.25 * (1 + i % 3)
            try:
                upload(trained.replace(threshold=threshold), url, api_key=KEY, replace=True)
                _client(server).register_vector(f"churn{i % 4}", vector, replace=True)
            except (OSError, DynsteerHTTPError):
                return
            replaced.append(threshold)

    writer = threading.Thread(target=churn)
    writer.start()
    deadline = time.monotonic() + 60
    while len(replaced) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(server["server"].proc.pid, signal.SIGKILL)
    stop.set()
    writer.join(timeout=60)
    server["server"].stop()
    assert len(replaced) >= 3, "the uploads never ran"
    (store / ".storm.safetensors.deadbeef.tmp").write_bytes(b"interrupted write")
    restarted = _serve(chat_model, store, tmp_path_factory.mktemp("logs") / "serve2.log")
    server["server"] = restarted
    restarted.wait_ready()
    client = _client(server)
    assert [p.name for p in client.probes()] == ["storm"]
    served = client.get_probe("storm")
    np.testing.assert_array_equal(served.weights, trained.weights)
    assert min(abs(served.threshold - t) for t in thresholds) < 1e-5, served.threshold
    assert set(client.vectors()) - {"calm"} <= {f"churn{i}" for i in range(4)}
    assert "calm" in client.vectors()
    np.testing.assert_array_equal(np.float32(client.get_vector("calm")), vector)
    assert not list(store.rglob("*.tmp")), "leftovers of interrupted writes"
    report = client.request(_gated_completion(server, POSITIVE[1]))
    assert report.gated and report.telemetry.tokens_monitored > 0


def _body(kind: str, name: str, trained: Probe) -> dict:
    if kind == "probe":
        return {**trained.to_json_dict(), "name": name}
    return {"name": name, "vector": [0.01] * 128}


def _post_at_once(server, kind: str, names: list[str], trained: Probe) -> list[int]:
    """POST one registration per name from as many threads, released together by a barrier;
    the statuses, in the order of ``names``."""
    url = f"{server['server'].url}/v1/dynsteer/{kind}s"
    barrier = threading.Barrier(len(names))
    statuses = [0] * len(names)

    def post(i: int) -> None:
        body = _body(kind, names[i], trained)
        barrier.wait()
        statuses[i] = http("POST", url, body, api_key=KEY)[0]

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(names))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


def _names(server, kind: str) -> list[str]:
    client = _client(server)
    return client.vectors() if kind == "vector" else [p.name for p in client.probes()]


@pytest.mark.parametrize("kind", ["vector", "probe"])
def test_concurrent_registrations_hold_the_cap_and_taken_names(server, trained, kind):
    """8 registrations at once: of one new name, exactly one is 201; of new names with two
    places left, exactly two are; the others are 409 and the registry ends exactly full."""
    cap = CAPS[f"max_{kind}s"]
    for i in range(cap - 3 - len(_names(server, kind))):
        status, answer = http("POST", f"{server['server'].url}/v1/dynsteer/{kind}s",
                              _body(kind, f"fill{i}", trained), api_key=KEY)
        assert status == 201, answer
    one_name = _post_at_once(server, kind, ["same"] * 8, trained)
    assert sorted(one_name) == [201] + [409] * 7
    new_names = [f"race{i}" for i in range(8)]
    near_cap = _post_at_once(server, kind, new_names, trained)
    assert sorted(near_cap) == [201] * 2 + [409] * 6
    winners = {name for name, status in zip(new_names, near_cap, strict=True) if status == 201}
    names = set(_names(server, kind))
    assert len(names) == cap and winners | {"same"} <= names
    assert not (set(new_names) - winners) & names


def test_restart_brings_back_what_was_registered_oldest_first_under_a_lower_cap(
        server, chat_model, store, tmp_path_factory):
    """After ``kill -9`` of an idle server, a restart serves exactly the registered vectors.
    Restarted with a lower ``max_probes``, it serves the probes registered longest ago (not
    the first by name), and the log names the ones it left out and the option."""
    vectors = {name: _client(server).get_vector(name) for name in _client(server).vectors()}
    probes = _names(server, "probe")
    os.kill(server["server"].proc.pid, signal.SIGKILL)
    server["server"].stop()
    log = tmp_path_factory.mktemp("logs") / "serve3.log"
    kept = CAPS["max_probes"] - 3  # the probes registered before the concurrent ones
    server["server"] = _serve(chat_model, store, log, max_probes=kept)
    server["server"].wait_ready()
    client = _client(server)
    assert {name: client.get_vector(name) for name in client.vectors()} == vectors
    restored = _names(server, "probe")
    newest = {"same"} | {name for name in probes if name.startswith("race")}
    assert set(restored) == set(probes) - newest and len(restored) == kept
    text = log.read_text()
    assert "3 stored probes not restored" in text and "dynsteer.max_probes" in text
    assert all(repr(name) in text for name in newest)
    assert "does not fit this model" not in text
    assert sorted(p.name for p in (store / "over-limit").iterdir()) == sorted(
        f"{name}.safetensors" for name in newest)
