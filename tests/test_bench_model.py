"""The benchmarks' dummy model folders (benchmarks/bench_model.py): one path per content, so
vLLM's compile cache, keyed by the model's path among the rest, holds from call to call."""

from __future__ import annotations

import json

import bench_model

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}


def test_same_content_same_folder_written_once(tmp_path, monkeypatch):
    monkeypatch.setenv(bench_model.ROOT_ENV, str(tmp_path))
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    first = bench_model.dummy_model("m", CONFIG, [tok])
    stamp = (first / "config.json").stat().st_mtime_ns
    again = bench_model.dummy_model("m", dict(reversed(CONFIG.items())), [tok])

    assert again == first and first.parent == tmp_path and first.name.startswith("m-")
    assert json.loads((first / "config.json").read_text()) == CONFIG
    assert (first / "tokenizer.json").read_text() == "{}"
    assert (first / "config.json").stat().st_mtime_ns == stamp  # not written again
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_other_content_other_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(bench_model.ROOT_ENV, str(tmp_path))
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    base = bench_model.dummy_model("m", CONFIG)
    other_config = bench_model.dummy_model("m", {**CONFIG, "hidden_size": 128})
    with_file = bench_model.dummy_model("m", CONFIG, [tok])
    tok.write_text('{"v": 2}')
    file_changed = bench_model.dummy_model("m", CONFIG, [tok])

    assert len({base, other_config, with_file, file_changed}) == 4


def test_root_argument_and_a_folder_made_meanwhile(tmp_path, monkeypatch):
    """``root`` overrides the cache; a folder another process put in place between the check
    and the rename is kept, and this call's staging copy removed."""
    monkeypatch.setenv(bench_model.ROOT_ENV, str(tmp_path / "unused"))
    folder = bench_model.dummy_model("m", CONFIG, root=tmp_path / "fresh")
    assert folder.parent == tmp_path / "fresh"
    assert not (tmp_path / "unused").exists()

    (folder / "config.json").unlink()  # looks unmade, but the rename target is taken
    (folder / "other").write_text("x")
    assert bench_model.dummy_model("m", CONFIG, root=tmp_path / "fresh") == folder
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == [folder.name]


def test_memory_need_of_the_8b_shape():
    """Llama-3-8B: 8.03e9 parameters in bf16 (14.96 GiB) and 128 KiB of KV cache a token."""
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "tie_word_embeddings": False}
    weights = bench_model.memory_need_gib(config, 0, margin_gib=0)
    assert abs(weights * 2**30 / 2 - 8.03e9) < 0.01e9
    per_token = bench_model.memory_need_gib(config, 1, margin_gib=0) - weights
    assert per_token * 2**30 == 128 * 1024
    tied = bench_model.memory_need_gib({**config, "tie_word_embeddings": True}, 0, margin_gib=0)
    assert abs((weights - tied) * 2**30 - 2 * 128256 * 4096) < 1
