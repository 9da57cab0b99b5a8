"""Every text-generation class in vLLM's registry, sorted by what dynsteer does with it.

Each class is in exactly one group:

* ``verified``: its layers' contract is recognized (:mod:`.layer_contract`) and a test checks
  steering, gating and capture on it against HF transformers (:data:`VERIFIED`); configuration
  paths the reading does not recognize (DeepSeek's sequence-parallel MoE) are listed and
  refused at start-up;
* ``contract``: its layers' contract is recognized on every configuration path, not yet
  verified against HF; the engine starts with a warning;
* ``depends``: recognized on some configuration paths only; the engine decides at start-up
  from the loaded layers and refuses the others;
* ``refused``: not recognized (the reason is given); the engine refuses it at start-up.

The census reads source code only (no model is built), so a new vLLM release that adds a
class puts it in one of these groups without anyone marking it supported. Classes vLLM serves
through its Transformers backend (OLMo 2 / 3, GPT-NeoX, Phi, Starcoder2, ...) run HF
transformers' own decoder layers, so those are the layers read.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .layer_contract import LayerContract, Refused, analyze, norm_residual

VERIFIED: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "GemmaForCausalLM": "gemma",
    "OlmoeForCausalLM": "olmoe",
    "NemotronForCausalLM": "nemotron",
    "Ernie4_5ForCausalLM": "ernie4_5",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeSharedForCausalLM": "granitemoeshared",
    "StableLmForCausalLM": "stablelm",
    "GPT2LMHeadModel": "gpt2",
    "OPTForCausalLM": "opt",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "Glm4ForCausalLM": "glm4",
    "Exaone4ForCausalLM": "exaone4",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Llama4ForCausalLM": "llama4",
    "ApertusForCausalLM": "apertus",
    "Ministral3ForCausalLM": "ministral3",
    "AfmoeForCausalLM": "afmoe",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "Olmo3ForCausalLM": "olmo3",
    "GPTNeoXForCausalLM": "gpt_neox",
    "PhiForCausalLM": "phi",
    "CohereForCausalLM": "cohere",
}
"""Registry class -> the tiny test model (``tests/tiny_models.ARCHITECTURES``) that checks it
against HF transformers in ``tests/test_architectures.py``."""

_NOT_LAYERS = ("Moe", "MoE", "MLP", "Attention", "Mixer", "Norm", "Expert", "Sparse",
               "Laurel", "Embed", "Conv", "Router", "Gate")


@dataclass(frozen=True)
class CensusRow:
    architecture: str
    module: str
    group: str
    """``verified``, ``contract``, ``depends`` or ``refused``."""
    layers: tuple[str, ...]
    kinds: tuple[str, ...]
    hooks: tuple[str, ...]
    why: str = ""
    """For ``depends`` and ``refused``: the conditions or the reason."""


TRANSFORMERS_BACKEND = ("TransformersForCausalLM", "TransformersMoEForCausalLM")
"""vLLM's classes that run an HF transformers model's own layers (its Transformers backend)."""


def registry() -> dict[str, tuple[str, str]]:
    """vLLM's text-generation registry, with the text-generation classes it serves through
    its Transformers backend: class -> (module, class name)."""
    from vllm.model_executor.models.registry import (
        _TEXT_GENERATION_MODELS,
        _TRANSFORMERS_SUPPORTED_MODELS,
    )

    backend = {arch: entry for arch, entry in _TRANSFORMERS_SUPPORTED_MODELS.items()
               if entry[1] in TRANSFORMERS_BACKEND}
    return {**backend, **_TEXT_GENERATION_MODELS}


def architecture_of(model: nn.Module) -> str:
    """The registry class a loaded vLLM model serves: its class name, or for the Transformers
    backend the HF architecture of its configuration."""
    name = type(model).__name__
    if name in TRANSFORMERS_BACKEND:
        config = getattr(model, "config", None)
        return next(iter(getattr(config, "architectures", None) or []), name)
    return name


def hf_layer_classes(architecture: str) -> list[type]:
    """The decoder-layer class of an HF transformers model (the first of its
    ``_no_split_modules``), for classes vLLM serves through its Transformers backend."""
    import transformers

    hf_cls = getattr(transformers, architecture, None)
    names = getattr(hf_cls, "_no_split_modules", None) or []
    module = inspect.getmodule(hf_cls)
    return [c for c in (getattr(module, n, None) for n in names[:1]) if isinstance(c, type)]


def _module_name(module: str) -> str:
    return module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"


def _takes_stream(cls: type) -> bool:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(p in params for p in ("hidden_states", "hidden_state"))


def layer_classes(module) -> list[type]:
    """The decoder-layer classes of a model module: the layer-like classes its ``*Model``
    classes' constructors name (or, failing that, every layer-like class it defines)."""
    def layer_like(obj) -> bool:
        if not (isinstance(obj, type) and issubclass(obj, nn.Module) and _takes_stream(obj)):
            return False
        name = obj.__name__
        return name.endswith("DecoderLayer") or (
            name.endswith(("Block", "Layer")) and not any(n in name for n in _NOT_LAYERS))

    named: set[str] = set()
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        tree = ast.Module(body=[], type_ignores=[])
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name.endswith("Model"):
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    named |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    found = [getattr(module, n) for n in sorted(named)
             if layer_like(getattr(module, n, None))]
    if found:
        return found
    return [obj for obj in vars(module).values()
            if layer_like(obj) and obj.__module__ == module.__name__]


def class_norms(cls: type) -> Callable[[str], str]:
    """What each norm attribute of layer class ``cls`` does with a residual, found without an
    instance: the class its constructor builds (through one local name or a helper function's
    return values), built small and asked (:func:`.layer_contract.norm_residual`)."""
    built: dict[str, list[str]] = {}
    globals_: dict = {}
    for base in reversed(cls.__mro__):  # a subclass's constructor has the last word
        init = vars(base).get("__init__")
        try:
            tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError):
            continue
        globals_ = {**globals_, **init.__globals__}
        _constructed(tree, init.__globals__, built)
    answers: dict[str, str] = {}

    def norm_of(attr: str) -> str:
        if attr not in answers:
            found = {_ask(_resolve(name, globals_)) for name in built.get(attr, [])}
            answers[attr] = found.pop() if len(found) == 1 else "unknown"
        return answers[attr]

    return norm_of


def _constructed(tree: ast.AST, globals_: dict, built: dict[str, list[str]]) -> None:
    """``built[attr]``: the names of the classes a constructor assigns to ``self.attr``."""
    locals_: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            names = target.elts if isinstance(target, ast.Tuple) else [target]
            call = node.value
            if not isinstance(call, ast.Call):
                continue
            callee = ast.unparse(call.func)
            for i, t in enumerate(names):
                if isinstance(t, ast.Name):
                    locals_.setdefault(t.id, []).extend(_returned(globals_.get(callee), i))
                elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id == "self":
                    built[t.attr] = list(locals_.get(callee, [callee]))


def _returned(fn, index: int) -> list[str]:
    """The names a helper returns at tuple position ``index`` (``norm_cls, eps = pick(cfg)``)."""
    try:
        tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) \
                and index < len(node.value.elts):
            out.append(ast.unparse(node.value.elts[index]))
    return out


def _resolve(name: str, globals_: dict) -> object:
    head, *rest = name.split(".")
    obj = globals_.get(head)
    for part in rest:
        obj = getattr(obj, part, None)
    return obj


def _ask(cls: object) -> str:
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        return "unknown"
    from vllm.config import VllmConfig, set_current_vllm_config

    try:
        with set_current_vllm_config(VllmConfig()):
            return norm_residual(cls(16))
    except Exception:  # a class that cannot be built small is not known
        return "unknown"


def classify(architecture: str, module: str, registry_class: str | None = None) -> CensusRow:
    """One registry class's group (see the module docstring)."""
    if registry_class in TRANSFORMERS_BACKEND:
        import transformers

        if not hasattr(transformers, architecture):
            return CensusRow(architecture, module, "refused", (), (), (),
                             "the installed HF transformers has no such class")
        return _classify(architecture, module, hf_layer_classes(architecture),
                         lambda cls: lambda attr: "unknown")  # HF norms take no residual
    try:
        mod = importlib.import_module(_module_name(module))
        model_cls = getattr(mod, registry_class or architecture, None)
    except Exception as exc:  # a module this build cannot import
        return CensusRow(architecture, module, "refused", (), (), (),
                         f"its module does not import here ({type(exc).__name__})")
    classes = layer_classes(mod)
    for base in getattr(model_cls, "__mro__", ())[1:]:  # Phi-3 is Llama's model and layers
        if classes:
            break
        base_mod = inspect.getmodule(base)
        if base_mod is not None and base_mod.__name__.startswith("vllm."):
            classes = layer_classes(base_mod)
    return _classify(architecture, module, classes, class_norms)


def _classify(architecture: str, module: str, classes: list[type],
              norms: Callable[[type], Callable[[str], str]]) -> CensusRow:
    if not classes:
        return CensusRow(architecture, module, "refused", (), (), (),
                         "no decoder-layer class found")
    contracts: list[LayerContract] = []
    refusals: list[str] = []
    conditions: set[str] = set()
    for cls in classes:
        outcomes = analyze(cls, dtype=torch.bfloat16, norm_of=norms(cls))
        for assumed, result in outcomes:
            if isinstance(result, Refused):
                if "raises on this path" not in str(result):
                    refusals.append(str(result))
                    conditions |= set(assumed)
            else:
                contracts.append(result)
    names = tuple(c.__name__ for c in classes)
    kinds = tuple(sorted({c.kind for c in contracts}))
    hooks = tuple(h for h in ("pre_attn", "post_attn", "post_block")
                  if contracts and all(h in c.hooks for c in contracts))
    if not contracts:
        return CensusRow(architecture, module, "refused", names, (), (), refusals[0])
    why = ""
    if refusals:
        why = ("refused where " + ", ".join(f"`{c}`" for c in sorted(conditions))
               if conditions else refusals[0])
    group = ("verified" if architecture in VERIFIED else "depends" if refusals
             else "contract")
    return CensusRow(architecture, module, group, names, kinds, hooks, why)


@functools.cache
def missing_hook(architecture: str, hook: str) -> str | None:
    """Why the layers of the served ``architecture`` (``config.architectures[0]``) have no
    ``hook``, naming the layer class and its layout, for a spec that asks for it; None where
    they have it or the class is not one the census reads. Read from source on first use, which
    imports the model's module (seconds), so only the first spec refused for it pays; the
    server admits requests off its event loop."""
    entry = registry().get(architecture)
    if entry is None:
        return None
    row = classify(architecture, *entry)
    if not row.kinds or hook in row.hooks:
        return None
    return f"({', '.join(row.layers)}: {', '.join(row.kinds)}) has no {hook}"


def census() -> list[CensusRow]:
    """Every registry class, classified."""
    return [classify(arch, module, name) for arch, (module, name) in sorted(registry().items())]


GROUP_TEXT = {"verified": "verified against HF", "contract": "by contract, not verified",
              "depends": "decided at start-up", "refused": "refused"}


def render(rows: list[CensusRow]) -> str:
    """The architectures table of docs/architectures.md (Markdown)."""
    lines = ["| class | status | layers | contract | hooks | note |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        test = f" (`{VERIFIED[r.architecture]}`)" if r.group == "verified" else ""
        why = r.why.replace("|", "\\|")
        lines.append(f"| `{r.architecture}` | {GROUP_TEXT[r.group]}{test} | "
                     f"{', '.join(r.layers)} | {'; '.join(r.kinds)} | "
                     f"{', '.join(r.hooks)} | {why} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(census()))
