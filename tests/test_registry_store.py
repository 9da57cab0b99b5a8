"""The server's durable registry: probes and vectors, atomic writes, crash leftovers, bad files
skipped."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dynsteer.engine_ext.server.registry_store import RegistryStore
from dynsteer.probes import Probe, ProbeSite


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
