"""Renders the generated parts of ``docs/options.md`` from ``EngineOptions``' field docstrings.

    .venv/bin/python docs/gen_options.py           # rewrite the generated blocks in place
    .venv/bin/python docs/gen_options.py --check   # exit 1 if they are stale (make docs-check)

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``;
everything outside the blocks is hand-written and kept as it is. ``tests/test_docs.py`` fails
while a block differs from what this renders.

A field's row: its name, its type (from the annotation and its bounds), its default (as JSON;
``set by the plugin`` for a field whose docstring says so), and its docstring with reST's
``code`` as Markdown code and ``docs/PAGE.md#anchor`` as a link.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import re
import sys
import types
import typing
from pathlib import Path

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo

PAGE = Path(__file__).resolve().parent / "options.md"
COMMAND = ".venv/bin/python docs/gen_options.py"
"""What regenerates the page (also ``make docs``)."""

BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)",
                   re.DOTALL)
SET_BY_PLUGIN = "Set by the plugin"
"""A field whose docstring starts with this is written by the plugin, not by users."""


def field_docstrings(model: type[BaseModel]) -> dict[str, str]:
    """Each field's docstring (the string literal after its annotated assignment)."""
    tree = ast.parse(inspect.getsource(model))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def markdown(doc: str) -> str:
    """A docstring as one Markdown table cell."""
    text = " ".join(doc.split())
    text = re.sub(r":\w+:`~?\.?([^`]+)`", r"``\1``", text)            # :mod:`x` -> ``x``
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    text = re.sub(r"\bdocs/([\w-]+)\.md(#[\w-]+)?",
                  lambda m: f"[{m.group(1)}]({m.group(1)}.md{m.group(2) or ''})", text)
    return text.replace("|", "\\|")


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _bounds(info: FieldInfo) -> str:
    """`` 1-4096``-style bounds of a number field (``, 1-4096``, `` ≥ 1``, `` > 0, ≤ 1e+12``)."""
    low = high = None
    for item in info.metadata:
        if isinstance(item, Ge):
            low = ("≥", item.ge)
        elif isinstance(item, Gt):
            low = (">", item.gt)
        elif isinstance(item, Le):
            high = ("≤", item.le)
        elif isinstance(item, Lt):
            high = ("<", item.lt)
    if low and high and low[0] == "≥" and high[0] == "≤":
        return f", {_number(low[1])}-{_number(high[1])}"
    parts = [f"{b[0]} {_number(b[1])}" for b in (low, high) if b]
    return " " + ", ".join(parts) if parts else ""


def type_name(tp: typing.Any) -> str:
    """A JSON reader's name for an annotation (``int | None``: ``integer or null``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}s"
    if origin is dict:
        return f"object: name → {type_name(args[1])}"
    names = {bool: "boolean", int: "integer", float: "number", str: "string", Path: "path",
             type(None): "null", typing.Any: "any"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def default_cell(info: FieldInfo, doc: str) -> str:
    if doc.startswith(SET_BY_PLUGIN):
        return "set by the plugin"
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    return f"`{json.dumps(str(value) if isinstance(value, Path) else value)}`"


def options_table(model: type[BaseModel]) -> str:
    """The ``| field | type | default | meaning |`` table of ``model``'s fields, in order."""
    docs = field_docstrings(model)
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        if name not in docs:
            raise ValueError(f"{model.__name__}.{name} has no docstring to document it by")
        kind = type_name(info.annotation)
        if kind in ("integer", "number"):
            kind += _bounds(info)
        rows.append(f"| `{name}` | {kind} | {default_cell(info, docs[name])} | "
                    f"{markdown(docs[name])} |")
    return "\n".join(rows) + "\n"


def engine_options() -> str:
    """``EngineOptions``' table, the ``dynsteer serve`` flags of options, and the options that
    do not recompile the model."""
    from dynsteer.engine_ext.options import RUNTIME_OPTIONS, EngineOptions
    from dynsteer.engine_ext.server.cli import _ENGINE_FLAGS

    fields = list(EngineOptions.model_fields)
    flags = ", ".join(f"`{flag}` (`{option}`)" for flag, option in _ENGINE_FLAGS.items())
    runtime = [f"`{name}`" for name in fields if name in RUNTIME_OPTIONS]
    listed = ", ".join(runtime[:-1]) + f" and {runtime[-1]}"
    return (
        options_table(EngineOptions)
        + f"\n`dynsteer serve` also takes these options as flags: {flags}.\n"
        + f"\n{listed} never reach the compiled graph: they are left out of vLLM's compile-cache"
        + " key (`RUNTIME_OPTIONS`), so changing them does not recompile the model. Every other"
        + " option shapes the graph.\n"
    )


RENDERERS = {"EngineOptions": engine_options}
"""Block name -> what renders its body."""


def update(text: str) -> str:
    """``text`` with every generated block rendered anew (ValueError for an unknown one)."""
    names = [m.group("name") for m in BLOCK.finditer(text)]
    unknown = set(names) - set(RENDERERS)
    if unknown:
        raise ValueError(f"no renderer for generated blocks {sorted(unknown)}")
    missing = set(RENDERERS) - set(names)
    if missing:
        raise ValueError(f"{PAGE.name} has no generated block {sorted(missing)}")
    return BLOCK.sub(lambda m: m.group(1) + RENDERERS[m.group("name")]() + m.group(4), text)


def main(argv: list[str]) -> int:
    text = PAGE.read_text()
    new = update(text)
    if "--check" in argv:
        if new != text:
            print(f"{PAGE} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        PAGE.write_text(new)
        print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
