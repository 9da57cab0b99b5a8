"""The probe format: validation, numerics, files, JSON, calibration (no sklearn needed)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from dynsteer.probes import (
    ModelFingerprint,
    Probe,
    ProbeFileError,
    _io,
    calibrate_threshold,
    stable_sigmoid,
)

H = 8


def make_probe(**overrides: object) -> Probe:
    rng = np.random.default_rng(0)
    fields: dict[str, object] = {
        "name": "toxicity.v1",
        "weights": rng.standard_normal(H).astype(np.float32),
        "threshold": 0.25,
        "sharpness": 3.0,
        "site": {"layer": 2, "hook": "post_attn"},
        "fingerprint": {"architecture": "LlamaForCausalLM", "hidden_size": H, "num_layers": 4},
        "metadata": {"dataset": "civil_comments", "epochs": 3, "lr": 1e-3, "balanced": True},
    }
    fields.update(overrides)
    return Probe.model_validate(fields)


# --- construction and validation -----------------------------------------------------------------


def test_defaults_and_types() -> None:
    p = Probe(name="p", weights=[1, 2, 3], site={"layer": 0})
    assert p.weights.dtype == np.float32 and p.weights.shape == (3,)
    assert p.threshold == 0.0 and p.sharpness == 1.0
    assert p.site.hook == "post_block"
    assert p.fingerprint is None and p.metadata == {}
    assert p.hidden_size == 3


def test_weights_are_a_private_read_only_copy() -> None:
    source = np.ones(H, dtype=np.float32)
    p = make_probe(weights=source)
    source[0] = 5.0
    assert p.weights[0] == 1.0
    with pytest.raises(ValueError):
        p.weights[0] = 2.0


def test_probe_is_frozen_and_replace_revalidates() -> None:
    p = make_probe()
    with pytest.raises(ValueError, match="frozen"):
        p.threshold = 1.0  # type: ignore[misc]
    q = p.replace(threshold=1.5)
    assert q.threshold == 1.5 and p.threshold == 0.25
    assert q != p and p == make_probe()
    with pytest.raises(ValueError, match="threshold"):
        p.replace(threshold=float("nan"))


def test_metadata_types_preserved() -> None:
    p = make_probe()
    assert p.metadata == {"dataset": "civil_comments", "epochs": 3, "lr": 1e-3, "balanced": True}
    assert type(p.metadata["balanced"]) is bool and type(p.metadata["epochs"]) is int


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"weights": [1.0, float("nan")]}, r"finite; weights\[1\]"),
        ({"weights": [float("inf"), 1.0]}, r"finite; weights\[0\]"),
        ({"weights": np.array([1e39, 1.0])}, "overflows float32"),
        ({"weights": np.ones((2, 4))}, "1-D"),
        ({"weights": []}, "empty"),
        ({"weights": ["a", "b"]}, "real numbers"),
        ({"weights": [True, False]}, "real numbers"),
        ({"weights": [[1.0], [1.0, 2.0]]}, "weights"),
        ({"name": "has space"}, "probe name"),
        ({"name": ""}, "probe name"),
        ({"name": "x" * 65}, "probe name"),
        ({"name": "a/b"}, "probe name"),
        ({"name": "naïve"}, "probe name"),
        ({"name": "ok\n"}, "probe name"),
        ({"site": {"layer": -1}}, "layer"),
        ({"site": {"layer": 0, "hook": "mlp_out"}}, "hook"),
        ({"site": {"layer": 0, "extra": 1}}, "extra"),
        ({"threshold": float("nan")}, "threshold"),
        ({"threshold": float("inf")}, "threshold"),
        ({"sharpness": 0.0}, "sharpness"),
        ({"sharpness": -1.0}, "sharpness"),
        ({"sharpness": float("inf")}, "sharpness"),
        ({"metadata": {"k": [1, 2]}}, "metadata"),
        ({"metadata": {"k": float("nan")}}, "metadata"),
        ({"colour": "red"}, "colour"),
        ({"fingerprint": {"architecture": "X", "hidden_size": H + 1, "num_layers": 4}}, "hidden"),
        ({"fingerprint": {"architecture": "X", "hidden_size": H, "num_layers": 2}}, "layer 2"),
        ({"fingerprint": {"architecture": "X", "hidden_size": H, "num_layers": 4, "v": 1}}, "v"),
    ],
)
def test_validation_errors(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_probe(**overrides)


@pytest.mark.parametrize("name", ["a", "A-b_c.9", "x" * 64, "llama-3.1_refusal"])
def test_valid_names(name: str) -> None:
    assert make_probe(name=name).name == name


def test_import_without_sklearn() -> None:
    """The probe package must stay importable by clients without sklearn (vLLM and torch:
    ``test_imports.py``)."""
    code = "import sys, dynsteer.probes; assert 'sklearn' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- numerics ------------------------------------------------------------------------------------


def test_score_decision_gate_match_reference() -> None:
    p = make_probe()
    X = np.random.default_rng(1).standard_normal((5, H)).astype(np.float32)
    w = p.weights.astype(np.float64)
    score = X.astype(np.float64) @ w
    np.testing.assert_allclose(p.score(X), score, rtol=1e-12)
    np.testing.assert_allclose(p.decision_function(X), score - 0.25, rtol=1e-12)
    np.testing.assert_allclose(p.gate(X), 1 / (1 + np.exp(-3.0 * (score - 0.25))), rtol=1e-12)
    assert p.score(X).dtype == np.float64


def test_inputs_of_any_leading_shape_and_single_vectors() -> None:
    p = make_probe()
    X = np.random.default_rng(2).standard_normal((2, 3, H))
    assert p.gate(X).shape == (2, 3)
    single = p.gate(X[0, 0])
    assert np.ndim(single) == 0
    assert single == pytest.approx(p.gate(X)[0, 0])


@pytest.mark.parametrize("shape", [(H + 1,), (3, H - 1), ()])
def test_wrong_width_is_a_clear_error(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=rf"shape \(\.\.\., {H}\)"):
        make_probe().score(np.zeros(shape))


def test_gate_is_stable_at_extreme_scores() -> None:
    w = np.zeros(H, dtype=np.float32)
    w[0] = 1.0
    p = make_probe(weights=w, threshold=0.0, sharpness=1.0)
    X = np.zeros((4, H))
    X[:, 0] = [1e4, -1e4, 1e30, -1e30]
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        gates = p.gate(X)
        big = p.replace(sharpness=1e300).gate(X)  # sharpness * score overflows float64
    np.testing.assert_array_equal(gates, [1.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(big, [1.0, 0.0, 1.0, 0.0])


def test_stable_sigmoid_is_symmetric_and_exact_at_zero() -> None:
    z = np.linspace(-40, 40, 161)
    np.testing.assert_allclose(stable_sigmoid(z) + stable_sigmoid(-z), 1.0, rtol=0, atol=1e-15)
    assert stable_sigmoid(0.0) == 0.5
    assert np.isnan(stable_sigmoid(float("nan")))


# --- fingerprints --------------------------------------------------------------------------------


def test_check_compatible_accepts_the_training_model() -> None:
    p = make_probe()
    p.check_compatible(
        ModelFingerprint(architecture="LlamaForCausalLM", hidden_size=H, num_layers=4)
    )


def test_check_compatible_names_both_values() -> None:
    p = make_probe()
    other = ModelFingerprint(architecture="Qwen2ForCausalLM", hidden_size=16, num_layers=24)
    with pytest.raises(ValueError) as e:
        p.check_compatible(other)
    msg = str(e.value)
    for part in ("toxicity.v1", "'LlamaForCausalLM'", "'Qwen2ForCausalLM'", "8", "16", "24"):
        assert part in msg
    assert "architecture" in msg and "hidden_size" in msg and "num_layers" in msg


def test_check_compatible_without_fingerprint_checks_shape() -> None:
    p = make_probe(fingerprint=None, site={"layer": 5})
    p.check_compatible(ModelFingerprint(architecture="Any", hidden_size=H, num_layers=6))
    with pytest.raises(ValueError, match=rf"probe has {H} weights, model has 4096"):
        p.check_compatible(ModelFingerprint(architecture="Any", hidden_size=4096, num_layers=6))
    with pytest.raises(ValueError, match=r"site.layer: 5 does not exist \(the model has 5 layers"):
        p.check_compatible(ModelFingerprint(architecture="Any", hidden_size=H, num_layers=5))


def test_fingerprint_check_matches() -> None:
    a = ModelFingerprint(architecture="A", hidden_size=4, num_layers=2)
    a.check_matches(a.model_copy())
    with pytest.raises(ValueError, match="architecture: probe was trained on 'A', model has 'B'"):
        a.check_matches(ModelFingerprint(architecture="B", hidden_size=4, num_layers=2))


# --- files ---------------------------------------------------------------------------------------


def test_save_load_round_trip_is_bit_exact(tmp_path: Path) -> None:
    weights = np.random.default_rng(3).standard_normal(H).astype(np.float32)
    weights[0] = np.float32(1e-45)  # a subnormal survives too
    weights[1] = -0.0
    p = make_probe(weights=weights, threshold=0.1 + 0.2)
    path = p.save(tmp_path / "p.safetensors")
    q = Probe.load(path)
    assert q == p
    assert q.weights.view(np.uint32).tolist() == p.weights.view(np.uint32).tolist()
    assert q.threshold == 0.1 + 0.2
    assert not q.weights.flags.writeable
    assert (path.stat().st_mode & 0o777) == 0o644


def test_file_is_plain_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open

    p = make_probe()
    path = p.save(tmp_path / "p.safetensors")
    with safe_open(str(path), framework="np") as f:
        assert list(f.keys()) == ["weights"]
        np.testing.assert_array_equal(f.get_tensor("weights"), p.weights)
        meta = f.metadata()
    assert meta["format"] == "dynsteer.probe" and meta["format_version"] == "1"
    assert json.loads(meta["probe"])["name"] == "toxicity.v1"


def test_save_overwrites_and_accepts_str_paths(tmp_path: Path) -> None:
    path = str(tmp_path / "p.safetensors")
    make_probe().save(path)
    make_probe(threshold=9.0).save(path)
    assert Probe.load(path).threshold == 9.0
    assert sorted(os.listdir(tmp_path)) == ["p.safetensors"]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "too short"),
        (b"\x00" * 4, "too short"),
        (b"\xff" * 64, "header length"),
        (b"\x04\x00\x00\x00\x00\x00\x00\x00{{{{", "not JSON"),
        (b"\x02\x00\x00\x00\x00\x00\x00\x00[]", "not an object"),
        (b"\x80\x03cos\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03.", "header"),
        (os.urandom(256), "not a safetensors probe file"),
    ],
)
def test_load_refuses_garbage(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ProbeFileError, match=match):
        Probe.load(path)


def test_load_refuses_other_safetensors_files(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    path = tmp_path / "model.safetensors"
    save_file({"weights": np.ones(H, dtype=np.float32)}, str(path))
    with pytest.raises(ProbeFileError, match="not a dynsteer probe"):
        Probe.load(path)


def test_load_detects_corrupted_weights(tmp_path: Path) -> None:
    path = make_probe().save(tmp_path / "p.safetensors")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # flip a bit of the last weight
    path.write_bytes(bytes(data))
    with pytest.raises(ProbeFileError, match="checksum"):
        Probe.load(path)


def test_load_detects_truncation(tmp_path: Path) -> None:
    path = make_probe().save(tmp_path / "p.safetensors")
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ProbeFileError, match="corrupt"):
        Probe.load(path)


def test_load_refuses_invalid_fields_in_header(tmp_path: Path) -> None:
    from safetensors.numpy import save

    weights = np.ones(H, dtype=np.float32)
    header = {**make_probe()._header(), "name": "bad name"}
    meta = {
        "format": "dynsteer.probe",
        "format_version": "1",
        "probe": json.dumps(header),
        "weights_sha256": _io._weights_sha256(weights),
    }
    path = tmp_path / "p.safetensors"
    path.write_bytes(save({"weights": weights}, metadata=meta))
    with pytest.raises(ProbeFileError, match="probe name 'bad name' is invalid"):
        Probe.load(path)
    path.write_bytes(save({"weights": weights}, metadata={**meta, "format_version": "2"}))
    with pytest.raises(ProbeFileError, match="version '2' is not supported"):
        Probe.load(path)


def test_load_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Probe.load(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("failing", ["fsync", "replace", "write"])
def test_save_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    path = tmp_path / "p.safetensors"
    make_probe().save(path)
    before = path.read_bytes()

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    if failing == "write":
        # Fail half-way through the data: the temp file holds a partial probe when it breaks.
        real_fdopen = os.fdopen

        class HalfWriter:
            def __init__(self, f):  # type: ignore[no-untyped-def]
                self.f = f

            def __enter__(self):  # type: ignore[no-untyped-def]
                return self

            def __exit__(self, *exc):  # type: ignore[no-untyped-def]
                self.f.close()

            def write(self, data: bytes) -> None:
                self.f.write(data[: len(data) // 2])
                self.f.flush()
                raise OSError("disk full")

        monkeypatch.setattr(_io.os, "fdopen", lambda fd, mode: HalfWriter(real_fdopen(fd, mode)))
    else:
        monkeypatch.setattr(_io.os, failing, boom)
    with pytest.raises(OSError, match="disk full"):
        make_probe(threshold=5.0).save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["p.safetensors"]
    assert Probe.load(path).threshold == 0.25


def test_failed_first_save_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object) -> None:
        raise OSError("no")

    monkeypatch.setattr(_io.os, "replace", boom)
    with pytest.raises(OSError):
        make_probe().save(tmp_path / "p.safetensors")
    assert os.listdir(tmp_path) == []


# --- JSON ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("weights_format", ["b64", "list"])
def test_json_round_trip(weights_format: str) -> None:
    weights = np.random.default_rng(4).standard_normal(H).astype(np.float32)
    weights[0] = np.float32(1e-45)
    p = make_probe(weights=weights)
    d = p.to_json_dict(weights_format=weights_format)  # type: ignore[arg-type]
    wire = json.loads(json.dumps(d, allow_nan=False))
    q = Probe.from_json_dict(wire)
    assert q == p
    assert q.weights.view(np.uint32).tolist() == p.weights.view(np.uint32).tolist()


def test_json_b64_is_little_endian_float32() -> None:
    p = make_probe()
    d = p.to_json_dict()
    assert "weights" not in d and d["version"] == 1
    raw = base64.b64decode(d["weights_b64"])
    np.testing.assert_array_equal(np.frombuffer(raw, dtype="<f4"), p.weights)


def test_json_accepts_minimal_hand_written_payload() -> None:
    q = Probe.from_json_dict({"name": "x", "site": {"layer": 1}, "weights": [1, 2.5]})
    assert q.weights.tolist() == [1.0, 2.5] and q.site.hook == "post_block"


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.pop("weights_b64"), "exactly one"),
        (lambda d: d.update(weights=[1.0] * H), "exactly one"),
        (lambda d: d.update(weights_b64="!!!!"), "not valid base64"),
        (lambda d: d.update(weights_b64="AAAA"), "multiple of 4"),
        (lambda d: d.update(weights_b64=""), "multiple of 4"),
        (lambda d: d.update(weights_b64=12), "must be a string"),
        (lambda d: d.update(weights_b64=base64.b64encode(b"\x00\x00\xc0\x7f").decode()), "finite"),
        (lambda d: d.update(version=2), "version 2"),
        (lambda d: d.update(surprise=1), "surprise"),
        (lambda d: d["site"].update(layer=-3), "layer"),
    ],
)
def test_json_rejects_bad_payloads(mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    d = make_probe().to_json_dict()
    mutate(d)
    with pytest.raises(ValueError, match=match):
        Probe.from_json_dict(d)


@pytest.mark.parametrize("weights", [["1.0"], [True], [None], "1,2", [float("nan")]])
def test_json_rejects_bad_weight_lists(weights: object) -> None:
    with pytest.raises(ValueError, match="weights"):
        Probe.from_json_dict({"name": "x", "site": {"layer": 0}, "weights": weights})


def test_json_rejects_non_objects() -> None:
    with pytest.raises(ValueError, match="must be an object"):
        Probe.from_json_dict([1, 2])  # type: ignore[arg-type]


# --- calibration ---------------------------------------------------------------------------------


def _gaussian_probe() -> Probe:
    w = np.zeros(H, dtype=np.float32)
    w[0] = 1.0
    return make_probe(weights=w, threshold=0.0, fingerprint=None)


@pytest.mark.parametrize("target", [0.0, 0.01, 0.05, 0.29, 0.5])
def test_calibration_meets_target_on_calibration_set(target: float) -> None:
    negatives = np.random.default_rng(5).standard_normal((1000, H))
    p = calibrate_threshold(_gaussian_probe(), negatives, target)
    fpr = np.mean(p.decision_function(negatives) > 0)
    assert fpr <= target
    assert fpr == pytest.approx(target, abs=1e-3)  # continuous scores: exactly floor(t * n) fire
    assert p.metadata["calibration.fpr"] == fpr
    assert p.metadata["calibration.n_negatives"] == 1000
    assert p.metadata["calibration.target_fpr"] == target


def test_calibration_generalises_to_held_out_negatives() -> None:
    rng = np.random.default_rng(6)
    calib, held_out = rng.standard_normal((20_000, H)), rng.standard_normal((20_000, H))
    p = calibrate_threshold(_gaussian_probe(), calib, 0.05)
    assert p.threshold == pytest.approx(1.645, abs=0.05)  # the N(0,1) 95th percentile
    held_out_fpr = np.mean(p.gate(held_out) > 0.5)
    assert abs(held_out_fpr - 0.05) < 0.006


def test_calibration_ties_never_exceed_target() -> None:
    negatives = np.zeros((10, H))
    negatives[:, 0] = [0, 1, 1, 1, 1, 1, 1, 1, 2, 3]
    p = calibrate_threshold(_gaussian_probe(), negatives, 0.1)  # 1 allowed
    assert p.threshold == 2.0 and p.metadata["calibration.fpr"] == 0.1
    p = calibrate_threshold(_gaussian_probe(), negatives, 0.3)  # 3 allowed; the cut is in the 1s
    assert p.threshold == 1.0
    assert np.sum(p.decision_function(negatives) > 0) == 2  # ties stay below: 0.2 <= 0.3
    assert p.metadata["calibration.fpr"] == 0.2
    p = calibrate_threshold(_gaussian_probe(), negatives, 0.85)  # 8 allowed: still only 2 fire
    assert p.threshold == 1.0


def test_calibration_returns_a_copy() -> None:
    p = _gaussian_probe()
    q = calibrate_threshold(p, np.random.default_rng(7).standard_normal((50, H)), 0.1)
    assert p.threshold == 0.0 and "calibration.fpr" not in p.metadata
    assert np.array_equal(q.weights, p.weights) and q.name == p.name and q.site == p.site


@pytest.mark.parametrize(
    ("negatives", "target", "match"),
    [
        (np.zeros((5, H)), 1.0, r"\[0, 1\)"),
        (np.zeros((5, H)), -0.1, r"\[0, 1\)"),
        (np.zeros((5, H)), float("nan"), r"\[0, 1\)"),
        (np.zeros((5, H)), "0.1", "number"),
        (np.zeros((5, H)), True, "number"),
        (np.zeros((0, H)), 0.1, "empty"),
        (np.zeros(H), 0.1, "2-D"),
        (np.zeros((5, H + 1)), 0.1, "expects inputs"),
        (np.full((5, H), np.nan), 0.1, "non-finite"),
    ],
)
def test_calibration_validation(negatives: np.ndarray, target: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        calibrate_threshold(_gaussian_probe(), negatives, target)  # type: ignore[arg-type]
