"""The user documentation matches the code: every spec field and engine option is documented
with its default and every documented one exists, links resolve, and the README stays short.

Convention: a model is documented under a heading that starts with its name in backticks
(``## `SteerEntry` ``); the table rows under it whose first cell is a name in backticks are its
fields, in the columns ``| field | type | default | meaning |``. A default cell is ``required``,
a JSON value in backticks (checked against the model), or free text (not checked).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from dynsteer.controller.controllers import BUILTINS
from dynsteer.controller.spec import SteeringSpec
from dynsteer.engine_ext.options import EngineOptions
from dynsteer.engine_ext.server.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_BYTES = 20 * 1024
HISTORY = re.compile(r"session\s*[0-9]+", re.IGNORECASE)
"""A development session's number ("session 13", "Session 4", "session48" in a file name)."""
PRODUCT_DIRS = ("api", "engine_ext", "controller", "probes")
BENCHMARK_DOCS = ("benchmarks/RESULTS.md", "benchmarks/README.md")

MODEL_HEADING = re.compile(r"^#{2,4} `(\w+)`", re.MULTILINE)
FIELD_ROW = re.compile(r"^\|\s*`(\w+)`\s*\|", re.MULTILINE)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _models_under(model: type[BaseModel], found: dict[str, type[BaseModel]]) -> None:
    """``model`` and every model its fields can hold, by class name."""
    found[model.__name__] = model
    for field in model.model_fields.values():
        stack = [field.annotation]
        while stack:
            tp = stack.pop()
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                if tp.__name__ not in found:
                    _models_under(tp, found)
            else:
                stack.extend(typing.get_args(tp))


def spec_models() -> dict[str, type[BaseModel]]:
    """The spec's models, recursively, and the built-in controllers' parameter models."""
    found: dict[str, type[BaseModel]] = {}
    _models_under(SteeringSpec, found)
    for controller in BUILTINS.values():
        found[controller.Params.__name__] = controller.Params
    return found


DOCUMENTED = {
    "spec.md": spec_models(),
    "options.md": {m.__name__: m for m in (EngineOptions, ServerSettings)},
}


def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def documented_fields(path: Path) -> dict[str, dict[str, list[str]]]:
    """Per model heading in ``path``: field name -> the cells of its table row."""
    text = path.read_text()
    headings = list(MODEL_HEADING.finditer(text))
    sections: dict[str, dict[str, list[str]]] = {}
    for i, heading in enumerate(headings):
        end = headings[i + 1].start() if i + 1 < len(headings) else len(text)
        body = text[heading.end():end]
        body = body[:next((m.start() for m in re.finditer(r"^#{1,4} ", body, re.MULTILINE)),
                          len(body))]
        rows = {}
        for line in body.splitlines():
            match = FIELD_ROW.match(line)
            if match:
                rows[match.group(1)] = _cells(line)
        sections[heading.group(1)] = rows
    return sections


@pytest.mark.parametrize("page", sorted(DOCUMENTED))
def test_every_model_has_a_section_and_no_section_names_an_unknown_model(page):
    """The page documents exactly the models it is for."""
    documented, expected = set(documented_fields(DOCS / page)), set(DOCUMENTED[page])
    assert documented == expected, (f"docs/{page}: sections missing {expected - documented}, "
                                    f"unknown {documented - expected}")


@pytest.mark.parametrize(("page", "model"), [(p, m) for p, ms in DOCUMENTED.items() for m in ms])
def test_documented_fields_are_the_model_fields(page, model):
    """Every field of the model is in its table, and every row of the table is a field."""
    documented = set(documented_fields(DOCS / page).get(model, {}))
    fields = set(DOCUMENTED[page][model].model_fields)
    assert documented == fields, (f"docs/{page}, section `{model}`: undocumented "
                                  f"{fields - documented}, not fields {documented - fields}")


@pytest.mark.parametrize(("page", "model"), [(p, m) for p, ms in DOCUMENTED.items() for m in ms])
def test_documented_defaults_are_the_model_defaults(page, model):
    """A default documented as a JSON value or ``required`` is the model's."""
    fields = DOCUMENTED[page][model].model_fields
    for name, cells in documented_fields(DOCS / page).get(model, {}).items():
        if name not in fields:
            continue  # test_documented_fields_are_the_model_fields names it
        assert len(cells) == 4, f"docs/{page} `{model}.{name}`: expected 4 columns, got {cells}"
        default, field = cells[2], fields[name]
        where = f"docs/{page} `{model}.{name}`"
        if default == "required":
            assert field.is_required(), f"{where} is documented as required"
            continue
        assert not field.is_required(), f"{where} is required; document it as `required`"
        if default.startswith("`") and default.endswith("`"):
            value = json.loads(default.strip("`"))
            actual = field.get_default(call_default_factory=True)
            actual = str(actual) if isinstance(actual, Path) else actual
            assert value == actual, f"{where}: documented {value!r}, the model has {actual!r}"


def _generator():
    """``docs/gen_options.py``, which renders the page's generated blocks."""
    spec = importlib.util.spec_from_file_location("gen_options", DOCS / "gen_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()


def test_generated_blocks_of_the_options_page_are_current():
    """The ``EngineOptions`` table is its field docstrings, rendered: a changed option, default
    or docstring changes the page with it."""
    page = DOCS / "options.md"
    text = page.read_text()
    rendered = GEN.update(text)
    if rendered != text:
        diff = "".join(difflib.unified_diff(text.splitlines(True), rendered.splitlines(True),
                                            "docs/options.md", "rendered", n=0))
        pytest.fail(f"docs/options.md is stale: regenerate it with `make docs` "
                    f"(or `{GEN.COMMAND}`)\n{diff}")


def test_the_generator_renders_docstrings_as_markdown_cells():
    assert GEN.markdown("A ``x|y`` (:mod:`.ops`),\n    see docs/gating.md#controllers.") == (
        "A `x\\|y` (`ops`), see [gating](gating.md#controllers).")
    with pytest.raises(ValueError, match="no renderer"):
        GEN.update("<!-- generated: Nothing -->\n<!-- end generated -->")


def test_readme_is_at_most_20_kib():
    """The README is a user's document, not a notebook."""
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES})"


def _history_files() -> list[Path]:
    files = [README, *sorted(DOCS.rglob("*.md")), *(ROOT / p for p in BENCHMARK_DOCS)]
    for folder in PRODUCT_DIRS:
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def test_no_development_history_in_docs_or_product_code():
    """Product docs, docstrings, option help and the benchmarks' pages speak of the present
    ("session N" is git's), also where the number is on the next line."""
    found = []
    for path in _history_files():
        text = path.read_text()
        for match in HISTORY.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}")
    assert not found, "\n".join(found)


def test_the_history_check_sees_session_numbers():
    """The pattern catches the forms a session number takes."""
    for text in ("session 13", "Session 4", "## Session 52: x", "session\n 7", "a_session48_b"):
        assert HISTORY.search(text), text
    for text in ("a session's steering", "sessions", "SessionGuard", "session: 2x"):
        assert not HISTORY.search(text), text


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading (its text lowercased, punctuation dropped, spaces to -)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.MULTILINE)}


@pytest.mark.parametrize("page", [README, *sorted(DOCS.rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    """Every relative link (and its #anchor, within a Markdown page) points at something."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        missing_anchor = bool(anchor) and resolved.suffix == ".md" and (
            not resolved.exists() or anchor not in _anchors(resolved))
        if not resolved.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"
