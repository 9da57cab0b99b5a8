"""The server's durable registry: probes and vectors, atomic writes, crash leftovers, bad files
skipped, oldest first under a cap, one lock around check and commit, metadata that loads again.
Registry changes run through the server's real control plane and store, on workers stood in
for by an engine that answers every RPC (:class:`test_routes_unit.FakeEngine`)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_routes_unit import FakeEngine

from dynsteer.controller.http_models import LISTED_METADATA_BYTES, ProbeSummary, ProbeUpload
from dynsteer.engine_ext.frontend.admission import FrontendState
from dynsteer.engine_ext.options import EngineOptions
from dynsteer.engine_ext.server.probe_routes import restore_registry
from dynsteer.engine_ext.server.registry_store import OVER_LIMIT, REGISTERED_NS, RegistryStore
from dynsteer.engine_ext.server.runtime import DynsteerServer
from dynsteer.engine_ext.server.settings import ServerSettings
from dynsteer.probes import Probe, ProbeFileError, ProbeSite
from dynsteer.probes._io import MAX_METADATA_BYTES, json_size


def _probe(name: str, seed: int = 0) -> Probe:
    weights = np.random.default_rng(seed).standard_normal(16).astype(np.float32)
    return Probe(name=name, weights=weights, threshold=0.5, sharpness=2.0,
                 site=ProbeSite(layer=1), metadata={"seed": seed})


def test_save_load_delete_round_trip(tmp_path):
    store = RegistryStore(tmp_path / "store")
    store.save_probe(_probe("a"))
    store.save_probe(_probe("b", seed=1))
    loaded = {p.name: p for p in RegistryStore(tmp_path / "store").load_probes()}
    assert sorted(loaded) == ["a", "b"]
    np.testing.assert_array_equal(loaded["b"].weights, _probe("b", seed=1).weights)
    assert loaded["b"].metadata == {"seed": 1}
    store.delete_probe("a")
    store.delete_probe("a")  # idempotent
    assert [p.name for p in store.load_probes()] == ["b"]


def test_a_failed_write_leaves_the_old_probe(tmp_path, monkeypatch):
    store = RegistryStore(tmp_path)
    store.save_probe(_probe("a", seed=0))

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        store.save_probe(_probe("a", seed=5))
    monkeypatch.undo()
    (loaded,) = store.load_probes()
    np.testing.assert_array_equal(loaded.weights, _probe("a", seed=0).weights)
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was removed


def test_leftovers_and_bad_files_are_skipped(tmp_path, caplog):
    store = RegistryStore(tmp_path)
    store.save_probe(_probe("good"))
    (tmp_path / ".good.safetensors.abc123.tmp").write_bytes(b"half a probe")
    (tmp_path / "torn.safetensors").write_bytes(b"\x00" * 10)
    _probe("other").save(tmp_path / "renamed.safetensors")  # file name != probe name
    assert [p.name for p in store.load_probes()] == ["good"]
    assert not (tmp_path / ".good.safetensors.abc123.tmp").exists()
    assert "torn.safetensors" in caplog.text and "renamed.safetensors" in caplog.text


def test_vectors_round_trip_beside_probes(tmp_path, caplog):
    store = RegistryStore(tmp_path)
    values = np.random.default_rng(3).standard_normal(16).astype(np.float32)
    store.save_vector("calm", values)
    store.save_probe(_probe("calm"))  # the same name as a probe is a different file
    store.save_vector("calm", values * 2)  # replaced atomically
    (tmp_path / "vectors" / "bad.safetensors").write_bytes(b"\x00" * 10)
    _probe("p").save(tmp_path / "vectors" / "p.safetensors")  # a probe is not a vector
    reopened = RegistryStore(tmp_path)
    ((name, loaded),) = reopened.load_vectors()
    assert name == "calm"
    np.testing.assert_array_equal(loaded, values * 2)
    assert [p.name for p in reopened.load_probes()] == ["calm"]
    assert "bad.safetensors" in caplog.text and "p.safetensors" in caplog.text
    reopened.delete_vector("calm")
    assert reopened.load_vectors() == []


# ---- order, caps at restore, concurrent changes --------------------------------------------


def _vector(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(16).astype(np.float32)


def test_loaders_return_the_oldest_registration_first(tmp_path):
    store = RegistryStore(tmp_path)
    for i, name in enumerate(["z", "a", "m"]):
        store.save_vector(name, _vector(i))
        store.save_probe(_probe(name, seed=i))
    store.save_vector("z", _vector(9))  # replacing a name keeps its age
    store.save_probe(_probe("z").replace(threshold=3.0))  # so does a new threshold
    assert [name for name, _ in RegistryStore(tmp_path).load_vectors()] == ["z", "a", "m"]
    assert [p.name for p in RegistryStore(tmp_path).load_probes()] == ["z", "a", "m"]
    store.delete_vector("z")
    store.save_vector("z", _vector(9))  # a name registered again is new
    assert [name for name, _ in store.load_vectors()] == ["a", "m", "z"]


def test_a_probe_copied_in_by_hand_counts_from_its_modification_time(tmp_path):
    store = RegistryStore(tmp_path)
    store.save_probe(_probe("saved"))
    copied = _probe("copied").save(tmp_path / "copied.safetensors")  # no registration order
    os.utime(copied, ns=(1, 1))
    assert [p.name for p in store.load_probes()] == ["copied", "saved"]


def test_new_names_come_after_the_stored_ones_when_the_clock_is_behind(tmp_path):
    ahead = str(time.time_ns() + 10**18)  # written by a host whose clock was far ahead
    _probe("ahead").save(tmp_path / "ahead.safetensors", extra={REGISTERED_NS: ahead})
    store = RegistryStore(tmp_path)
    store.load_probes()
    store.save_probe(_probe("new"))
    assert [p.name for p in store.load_probes()] == ["ahead", "new"]


class YieldingEngine(FakeEngine):
    """Workers that take a moment, as real ones do: concurrent changes interleave at the RPC."""

    async def collective_rpc(self, method: str, timeout: Any = None,
                             args: tuple[Any, ...] = ()) -> list[Any]:
        await asyncio.sleep(0.001)
        return await super().collective_rpc(method, timeout=timeout, args=args)


def _server(store: Path, **options: int) -> DynsteerServer:
    frontend = FrontendState(options=EngineOptions(**options), hidden_size=16, num_layers=2,
                             sites=(("post_block", 0), ("post_block", 1)))
    return DynsteerServer(YieldingEngine(), frontend, ServerSettings(probe_store=store), [],
                          "tiny")


def test_a_cap_at_restore_keeps_the_oldest_and_sets_the_rest_aside(tmp_path, caplog):
    store = RegistryStore(tmp_path)
    for i, name in enumerate(["old", "older-name-sorts-later", "new", "newest"]):
        store.save_vector(name, _vector(i))
        store.save_probe(_probe(name, seed=i))
    server = _server(tmp_path, max_vectors=2, max_probes=3)
    asyncio.run(restore_registry(server))
    assert list(server.frontend.vectors) == ["old", "older-name-sorts-later"]
    assert list(server.frontend.probes) == ["old", "older-name-sorts-later", "new"]
    assert ("2 stored vectors not restored: the registry is full at 2, the limit (engine "
            "option dynsteer.max_vectors), and they are the newest: 'new', 'newest'"
            in caplog.text)
    assert "1 stored probes not restored" in caplog.text and "max_probes" in caplog.text
    assert "does not fit this model" not in caplog.text
    # The store holds what the registry holds; the rest waits in over-limit/ for a higher cap.
    assert [name for name, _ in store.load_vectors()] == list(server.frontend.vectors)
    assert [p.name for p in store.load_probes()] == list(server.frontend.probes)
    assert sorted(f.name for f in (tmp_path / "vectors" / OVER_LIMIT).iterdir()) == [
        "new.safetensors", "newest.safetensors"]
    assert [f.name for f in (tmp_path / OVER_LIMIT).iterdir()] == ["newest.safetensors"]


async def _register_at_once(server: DynsteerServer, names: list[str]) -> list[str]:
    """Register ``names`` concurrently; the outcome of each ("ok" or the error's class)."""
    results = await asyncio.gather(*(server.register_vector(name, _vector(i))
                                     for i, name in enumerate(names)), return_exceptions=True)
    return ["ok" if r is None else type(r).__name__ for r in results]


def test_concurrent_registrations_respect_the_cap_and_taken_names(tmp_path):
    server = _server(tmp_path / "store", max_vectors=6)
    store = server.store
    assert store is not None

    async def scenario() -> list[list[str]]:
        await _register_at_once(server, ["a", "b", "c", "d"])
        outcomes = [await _register_at_once(server, [f"new{i}" for i in range(8)])]
        server.frontend.options = EngineOptions(max_vectors=16)
        return [*outcomes, await _register_at_once(server, ["same"] * 8)]

    near_cap, one_name = asyncio.run(scenario())
    assert sorted(near_cap) == ["ConflictError"] * 6 + ["ok"] * 2
    assert sorted(one_name) == ["ConflictError"] * 7 + ["ok"]
    registered = sorted(server.frontend.vectors)
    assert len(registered) == 7
    assert sorted(name for name, _ in store.load_vectors()) == registered
    stored = dict(store.load_vectors())
    for name in registered:  # the values that won are the ones stored
        np.testing.assert_array_equal(stored[name], server.frontend.vectors[name])


# ---- metadata size ---------------------------------------------------------------------------


def _metadata_of_size(size: int, char: str = "é") -> dict[str, str]:
    """Metadata of exactly ``size`` bytes as stored (``char`` escaped as one ``\\uXXXX``)."""
    base = {"a": ""}
    escaped = json_size({"a": char}) - json_size(base)
    count, rest = divmod(size - json_size(base), escaped)
    return {"a": char * count + "x" * rest}


def test_non_ascii_metadata_at_the_limit_round_trips(tmp_path):
    metadata = _metadata_of_size(MAX_METADATA_BYTES)
    probe = _probe("accents").replace(metadata=metadata)
    assert probe.metadata_bytes == MAX_METADATA_BYTES
    store = RegistryStore(tmp_path)
    store.save_probe(probe)
    (loaded,) = RegistryStore(tmp_path).load_probes()
    assert loaded == probe


@pytest.mark.parametrize("char", ["é", "\U0001f600", "\x01", '"'])
def test_metadata_over_the_limit_is_refused_naming_field_and_limit(char):
    metadata = _metadata_of_size(MAX_METADATA_BYTES + 1, char)
    assert len(metadata["a"]) < MAX_METADATA_BYTES  # the limit counts bytes, not characters
    message = f"more than the {MAX_METADATA_BYTES}-byte limit"
    with pytest.raises(ValueError, match=message):
        _probe("big").replace(metadata=metadata)
    upload = {**_probe("big").to_json_dict(), "metadata": metadata}
    with pytest.raises(ValueError, match="metadata"):
        ProbeUpload.model_validate(upload)


def test_a_header_beyond_the_loader_limit_is_named(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes((16 * 1024 * 1024 + 1).to_bytes(8, "little") + b"{}")
    with pytest.raises(ProbeFileError, match="header length, 16777217 bytes, is larger than the "
                                             "16 MiB limit"):
        Probe.load(path)


def test_listing_leaves_large_metadata_out():
    small = _probe("small").replace(metadata={"source": "é" * 10})
    big = _probe("big").replace(metadata=_metadata_of_size(LISTED_METADATA_BYTES + 1))
    assert ProbeSummary.of(small).metadata == small.metadata
    assert not ProbeSummary.of(small).metadata_omitted
    assert ProbeSummary.of(big).metadata == {} and ProbeSummary.of(big).metadata_omitted
