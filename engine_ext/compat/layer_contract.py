"""Where a decoder layer's residual stream is, read from the dataflow of its ``forward``.

A model class is not steered because of its name but because its layers' code shows where the
stream is. :func:`layer_contract` reads the source of a layer's ``forward`` (its AST) and runs
it abstractly: every tensor is a sum of *terms* — the layer's input stream (``h``, and ``r``
for the ``residual`` argument of vLLM's two-stream layers), the attention (or token-mixer)
branch ``attn`` and the MLP branch ``mlp`` — or a value derived from them that is not part of
the stream (a norm's output, the input of a branch). Norms that take ``(x, residual)`` are asked
what they do with the residual (:func:`norm_residual`): vLLM's fused add + RMSNorm returns
``x + residual``, Cohere's norm returns it untouched.

From that run:

* the layer's **input stream**: ``hidden_states + residual`` when the residual reaches the
  output, ``hidden_states`` alone when the layer overwrites or ignores it (MiniCPM, Exaone 4,
  Cohere take a ``residual`` they do not use: a name-based reading would steer them wrongly);
* its **output**: one tensor holding the stream, a tuple whose first item holds it, or a pair
  whose sum is the stream (``(hidden_states, residual)``);
* ``post_attn`` (``resid_mid``): input + attention branch, if that sum exists as a tensor. In
  a fused add + norm (``mid`` is that norm: the site steers its residual input) or as a tensor
  the layer computes and hands first to a module (a norm, or the MLP in post-norm layers such
  as OLMo's), whose input the site then steers in place, so the layer's later residual add
  (the same tensor) carries the steering too. Parallel attention + MLP layers (GPT-J, Cohere)
  have no such tensor and no ``post_attn``.

Anything the run does not recognize — a statement kind, a module it cannot place, a scaled
stream, a dataflow that depends on something it cannot evaluate — refuses the layer with the
line and the reason (:class:`Refused`): a wrong site that looks right is worse than none.

Conditions on the layer's attributes (``if self.tp_size > 1``) and on the dtype are evaluated
on the layer instance when there is one (at engine start-up); without one (the registry
census), both branches are run and must agree.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn

IN, H, R, ATTN, MLP = "in", "h", "r", "attn", "mlp"
S0 = frozenset({IN})
S1 = frozenset({IN, ATTN})
S2 = frozenset({IN, ATTN, MLP})

ATTN_NAMES = ("attn", "attention", "mixer", "mamba", "conv")
"""Substrings of a module attribute that make its output the token-mixing branch."""
MLP_NAMES = ("mlp", "ffn", "feed_forward", "moe", "experts", "fc1", "dense_h_to_4h")
"""Substrings of a module attribute that make its output the MLP branch."""
SHAPE_METHODS = frozenset({"view", "reshape", "contiguous", "clone", "to", "float", "type_as",
                           "squeeze", "unsqueeze"})
"""Tensor methods that keep a value's meaning (a branch stays a branch)."""

Output = Literal["tensor", "first", "split"]


class Refused(Exception):
    """A layer whose stream dynsteer cannot place; the message names the line and the reason."""


@dataclass(frozen=True)
class LayerContract:
    """Where the stream of one decoder layer class is (see the module docstring)."""

    stream_arg: str
    """The ``forward`` parameter that carries the (first part of the) stream."""
    split_input: bool
    """The stream entering is ``hidden_states + residual`` (vLLM's two-stream layers)."""
    output: Output
    """``tensor``: the layer returns the stream; ``first``: a tuple whose first item is the
    stream; ``split``: a pair whose sum is the stream."""
    mid: str | None
    """The module attribute where ``post_attn`` runs; None: the layer has no such point."""
    mid_fused: bool
    """``mid`` is a fused add + norm whose residual input is steered (else ``mid``'s input is
    steered in place)."""
    entry_norm: str | None
    """Split input: the fused norm that first adds the two incoming parts (a ``post_block``
    site of the layer before can run inside it)."""
    kind: str
    """A short name of the layout, for the architectures table."""
    params: tuple[str, ...] = ()
    """``forward``'s parameter names after ``self``."""

    @property
    def hooks(self) -> tuple[str, ...]:
        return ("pre_attn", "post_attn", "post_block") if self.mid else ("pre_attn", "post_block")


@dataclass(frozen=True)
class _Val:
    """An abstract value: ``terms`` of the stream summed (``kind="sum"``), a value derived from
    the stream that is not part of it (``derived``), ``None``, a tuple, a tensor to be written
    by a call (``empty``), or anything else (``opaque``)."""

    kind: str = "opaque"
    terms: frozenset[str] = frozenset()
    items: tuple[_Val, ...] = ()
    uid: int = 0
    python: Any = None
    """A concrete Python value where known (attributes of the instance, constants)."""
    known: bool = False


OPAQUE = _Val()
NONE = _Val("none", python=None, known=True)


@dataclass
class _Event:
    """A module call that reads the stream: its attribute, the stream state it reads, and how."""

    attr: str
    terms: frozenset[str]
    how: str  # "fused" | "input"
    earlier_reads: int = 0
    """How often the value was read before this call (an in-place site must be the first)."""


@dataclass
class _State:
    env: dict[str, _Val]
    events: list[_Event] = field(default_factory=list)
    reads: list[int] = field(default_factory=list)
    returned: _Val | None = None
    dead: bool = False


_ids = itertools.count(1)


def _new(terms: frozenset[str]) -> _Val:
    return _Val("sum", terms, uid=next(_ids))


def _is_stream(v: _Val) -> bool:
    return v.kind == "sum" and bool(v.terms & {H, R, IN})


def _is_branch(v: _Val) -> bool:
    return v.kind == "sum" and bool(v.terms) and not (v.terms & {H, R, IN})


def _category(attr: str, module: nn.Module | None) -> str:
    """``norm``, ``attn``, ``mlp`` or ``other`` for a module attribute of the layer."""
    low = attr.lower()
    cls = type(module).__name__.lower() if module is not None else ""
    if "norm" in cls or "norm" in low or low.startswith("ln"):
        return "norm"
    if any(n in low for n in MLP_NAMES):
        return "mlp"
    if any(n in low for n in ATTN_NAMES):
        return "attn"
    return "other"


class _Interpreter:
    """One abstract run of a ``forward`` (see the module docstring)."""

    def __init__(self, fn: ast.FunctionDef, source_line: int, globals_: dict[str, Any],
                 layer: nn.Module | None, dtype: torch.dtype | None,
                 norm_of: Callable[[str], str]) -> None:
        self.fn = fn
        self.line0 = source_line
        self.globals = globals_
        self.layer = layer
        self.dtype = dtype
        self.norm_of = norm_of
        self.assume: dict[str, bool] = {}

    def refuse(self, node: ast.AST, why: str) -> Refused:
        return Refused(f"line {self.line0 + getattr(node, 'lineno', 1) - 1}: {why}")

    # ---- statements ----------------------------------------------------------------------

    def run(self, env: dict[str, _Val]) -> _State:
        state = _State(dict(env))
        self.block(self.fn.body, state)
        return state

    def block(self, body: list[ast.stmt], state: _State) -> None:
        for stmt in body:
            if state.dead or state.returned is not None:
                return
            self.stmt(stmt, state)

    def stmt(self, node: ast.stmt, state: _State) -> None:
        if isinstance(node, ast.Assign):
            value = self.expr(node.value, state, alias_ok=True)
            for target in node.targets:
                self.bind(target, value, state)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self.bind(node.target, self.expr(node.value, state, alias_ok=True), state)
        elif isinstance(node, ast.AugAssign):
            if not isinstance(node.target, ast.Name):
                return
            left = state.env.get(node.target.id, OPAQUE)
            right = self.expr(node.value, state)
            state.reads.append(left.uid)
            self.bind(node.target, self.binop(node.op, left, right, node), state)
        elif isinstance(node, ast.Return):
            state.returned = NONE if node.value is None else self.expr(node.value, state)
        elif isinstance(node, ast.If):
            self.branch(node, state)
        elif isinstance(node, ast.Expr):
            self.expr(node.value, state)
        elif isinstance(node, ast.Raise):
            state.dead = True
        elif isinstance(node, ast.With):
            self.block(node.body, state)
        elif isinstance(node, (ast.Pass, ast.Assert, ast.Import, ast.ImportFrom, ast.Delete)):
            return
        else:
            raise self.refuse(node, f"a {type(node).__name__} statement is not followed")

    def bind(self, target: ast.expr, value: _Val, state: _State) -> None:
        if isinstance(target, ast.Name):
            state.env[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            n = len(target.elts)
            items = value.items if value.kind == "tuple" and len(value.items) == n else (
                (value,) + (OPAQUE,) * (n - 1) if _is_branch(value) else (OPAQUE,) * n)
            for t, v in zip(target.elts, items, strict=True):
                self.bind(t, v, state)
        # attributes and subscripts of other objects are not the stream

    def branch(self, node: ast.If, state: _State) -> None:
        if self.decide(node.test, state):
            self.block(node.body, state)
        else:
            self.block(node.orelse, state)

    def decide(self, test: ast.expr, state: _State) -> bool:
        """A condition's value; one not known here is taken as assumed for this run (see
        :func:`analyze`), or asked for with :class:`_Choose`."""
        value = self.condition(test, state)
        if value is not None:
            return value
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return not self.decide(test.operand, state)
        if isinstance(test, ast.BoolOp):
            want = isinstance(test.op, ast.Or)  # the value that ends the evaluation early
            return want if any(self.decide(v, state) == want for v in test.values) else not want
        key = ast.unparse(test)
        if key not in self.assume:
            raise _Choose(key)
        return self.assume[key]

    # ---- conditions ----------------------------------------------------------------------

    def condition(self, node: ast.expr, state: _State) -> bool | None:
        """True / False where the test is known, else None."""
        if isinstance(node, ast.BoolOp):
            values = [self.condition(v, state) for v in node.values]
            if isinstance(node.op, ast.And):
                return False if False in values else (None if None in values else True)
            return True if True in values else (None if None in values else False)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            v = self.condition(node.operand, state)
            return None if v is None else not v
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            op = node.ops[0]
            if isinstance(op, (ast.Is, ast.IsNot)) and _is_none(node.comparators[0]):
                left = self.expr(node.left, state, read=False)
                if left.kind == "none":
                    result = True
                elif left.kind in ("sum", "derived", "empty"):
                    result = False
                elif left.known:
                    result = left.python is None
                else:
                    return None
                return result if isinstance(op, ast.Is) else not result
            left = self.python(node.left, state)
            right = self.python(node.comparators[0], state)
            if left is _UNKNOWN or right is _UNKNOWN:
                return None
            try:
                return bool(_COMPARE[type(op)](left, right))
            except (KeyError, TypeError):
                return None
        value = self.python(node, state)
        if value is _UNKNOWN:
            v = self.expr(node, state, read=False)
            if v.kind == "none":
                return False
            return None
        try:
            return bool(value)
        except (TypeError, RuntimeError):
            return None

    def python(self, node: ast.expr, state: _State) -> Any:
        """The concrete value of a non-tensor expression, or ``_UNKNOWN``."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Attribute) and node.attr == "dtype":
            inner = self.expr(node.value, state, read=False)
            if inner.kind in ("sum", "derived"):
                return self.dtype if self.dtype is not None else _UNKNOWN
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "isinstance" and len(node.args) == 2:
            obj = self.python(node.args[0], state)
            cls = self.python(node.args[1], state)
            if obj is _UNKNOWN or cls is _UNKNOWN:
                return _UNKNOWN
            try:
                return isinstance(obj, cls)
            except TypeError:
                return _UNKNOWN
        v = self.expr(node, state, read=False)
        return v.python if v.known else _UNKNOWN

    # ---- expressions ---------------------------------------------------------------------

    def expr(self, node: ast.expr, state: _State, alias_ok: bool = False,
             read: bool = True) -> _Val:
        if isinstance(node, ast.Name):
            if node.id in state.env:
                v = state.env[node.id]
                if read and not alias_ok and v.uid:
                    state.reads.append(v.uid)
                return v
            if node.id in self.globals:
                return _Val(python=self.globals[node.id], known=True)
            return OPAQUE
        if isinstance(node, ast.Constant):
            return NONE if node.value is None else _Val(python=node.value, known=True)
        if isinstance(node, ast.Attribute):
            base = self.expr(node.value, state, read=False)
            if base.known:
                try:
                    return _Val(python=getattr(base.python, node.attr), known=True)
                except AttributeError:
                    return OPAQUE
            return OPAQUE
        if isinstance(node, (ast.Tuple, ast.List)):
            return _Val("tuple", items=tuple(self.expr(e, state) for e in node.elts))
        if isinstance(node, ast.BinOp):
            return self.binop(node.op, self.expr(node.left, state),
                              self.expr(node.right, state), node)
        if isinstance(node, ast.UnaryOp):
            v = self.expr(node.operand, state)
            if _is_stream(v):
                raise self.refuse(node, "the stream is negated")
            return v if _is_branch(v) else OPAQUE
        if isinstance(node, ast.Subscript):
            v = self.expr(node.value, state)
            if v.kind == "tuple" and isinstance(node.slice, ast.Constant) \
                    and isinstance(node.slice.value, int) and node.slice.value < len(v.items):
                return v.items[node.slice.value]
            return v if v.kind == "sum" else (v if v.kind == "derived" else OPAQUE)
        if isinstance(node, (ast.BoolOp, ast.Compare)) or (
                isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)):
            known = self.condition(node, state)
            if known is not None:
                return _Val(python=known, known=True)
            if isinstance(node, ast.BoolOp):
                return _Val(python=self.decide(node, state), known=True)
            return OPAQUE
        if isinstance(node, ast.IfExp):
            chosen = node.body if self.decide(node.test, state) else node.orelse
            return self.expr(chosen, state)
        if isinstance(node, ast.Call):
            return self.call(node, state)
        if isinstance(node, ast.Starred):
            return self.expr(node.value, state)
        return OPAQUE

    def binop(self, op: ast.operator, left: _Val, right: _Val, node: ast.AST) -> _Val:
        if isinstance(op, ast.Add):
            if left.kind == "sum" and right.kind == "sum":
                if _is_branch(left) and left.terms == right.terms and left.uid != right.uid:
                    return left  # two parts of one branch (routed and shared experts)
                if left.terms & right.terms:
                    raise self.refuse(node, "a part of the stream is added twice")
                return _new(left.terms | right.terms)
            for a, b in ((left, right), (right, left)):
                if a.kind == "sum" and b.kind != "sum":
                    if _is_branch(a):
                        return a  # a bias or a shared expert added to a branch
                    raise self.refuse(node, "something other than a branch is added to "
                                      "the stream")
            return OPAQUE if not (left.kind == "derived" or right.kind == "derived") \
                else _Val("derived")
        if isinstance(op, (ast.Mult, ast.Div)):
            for a, b in ((left, right), (right, left)):
                if a.kind == "sum":
                    if b.kind == "sum" or b.kind == "derived":
                        return _Val("derived")
                    if _is_branch(a):
                        return a
                    raise self.refuse(node, "the stream is scaled")
        if left.kind == "sum" or right.kind == "sum":
            if _is_stream(left) or _is_stream(right):
                return _Val("derived")
            return left if left.kind == "sum" else right
        return OPAQUE

    def call(self, node: ast.Call, state: _State) -> _Val:
        func = node.func
        args = [self.expr(a, state) for a in node.args]
        kwargs = {k.arg: self.expr(k.value, state) for k in node.keywords if k.arg}
        tensors = [v for v in [*args, *kwargs.values()] if v.kind in ("sum", "derived",
                                                                      "empty")]
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                and func.value.id == "self":
            return self.module_call(func.attr, node, args, kwargs, state)
        if isinstance(func, ast.Attribute):
            target = self.expr(func.value, state, read=False)
            if func.attr in SHAPE_METHODS and target.kind in ("sum", "derived"):
                return target
            if func.attr.endswith("_") and target.kind == "sum":  # in place: x.add_(y)
                if not isinstance(func.value, ast.Name):
                    return target
                op = ast.Add() if func.attr == "add_" else ast.Mult()
                other = args[0] if args else OPAQUE
                state.env[func.value.id] = self.binop(op, target, other, node)
                return state.env[func.value.id]
            if target.known:  # torch.empty_like, torch.nn.functional.pad, ...
                name = func.attr
                if name in ("empty_like", "zeros_like") and tensors:
                    return _Val("empty", uid=next(_ids))
                return self.function(name, tensors, node)
            if target.kind in ("sum", "derived"):
                return _Val("derived") if _is_stream(target) else target
            return OPAQUE
        if isinstance(func, ast.Name):
            if func.id == "super":
                raise self.refuse(node, "the layer calls super()")
            return self.function(func.id, tensors, node)
        return OPAQUE

    def function(self, name: str, tensors: list[_Val], node: ast.AST) -> _Val:
        """A free function on tensors: a branch through any function stays that branch (an
        all-reduce, an activation); the stream through a function is no longer the stream."""
        sums = [t for t in tensors if t.kind == "sum"]
        if not sums:
            return _Val("derived") if tensors else OPAQUE
        if len(sums) == 1 and _is_branch(sums[0]) and all(
                t.kind != "derived" for t in tensors):
            return sums[0]
        return _Val("derived")

    def module_call(self, attr: str, node: ast.Call, args: list[_Val], kwargs: dict[str, _Val],
                    state: _State) -> _Val:
        module = getattr(self.layer, attr, None) if self.layer is not None else None
        category = _category(attr, module)
        inputs = [*args, *kwargs.values()]
        streams = [v for v in inputs if _is_stream(v)]
        if category == "norm":
            tensors = [v for v in args if v.kind in ("sum", "derived")]
            if len(args) >= 2 and args[1].kind in ("sum", "derived"):
                how = self.norm_of(attr)
                x, res = args[0], args[1]
                if how == "adds":
                    if x.kind != "sum" or res.kind != "sum":
                        raise self.refuse(node, f"{attr} adds a value that is not a part of "
                                          "the stream")
                    total = self.binop(ast.Add(), x, res, node)
                    state.events.append(_Event(attr, total.terms, "fused"))
                    return _Val("tuple", items=(_Val("derived"), total))
                if how == "passes":
                    return _Val("tuple", items=(self.norm_one(attr, x, state), res))
                raise self.refuse(node, f"{attr} takes a residual and what it does with it "
                                  "is not known")
            if not tensors:
                return OPAQUE
            return self.norm_one(attr, tensors[0], state)
        for v in streams:
            state.events.append(_input_event(attr, v, state))
        if category in ("attn", "mlp"):
            term = ATTN if category == "attn" else MLP
            empties = [i for i, v in enumerate(node.args) if args[i].kind == "empty"]
            if empties:  # the module writes its output into a tensor it is handed
                out = node.args[empties[-1]]
                if isinstance(out, ast.Name):
                    state.env[out.id] = _Val("sum", frozenset({term}), uid=next(_ids))
                return OPAQUE
            return _Val("sum", frozenset({term}), uid=next(_ids))
        branches = [v for v in inputs if _is_branch(v)]
        if branches and not streams:
            return branches[0]
        if streams:
            raise self.refuse(node, f"the stream goes into self.{attr}, which is neither a "
                              "norm, an attention nor an MLP")
        return _Val("derived") if any(v.kind == "derived" for v in inputs) else OPAQUE

    def norm_one(self, attr: str, x: _Val, state: _State) -> _Val:
        if _is_branch(x):
            return x  # a post-norm of a branch (Gemma, OLMo): still that branch
        if _is_stream(x):
            state.events.append(_input_event(attr, x, state))
        return _Val("derived")


def _input_event(attr: str, v: _Val, state: _State) -> _Event:
    return _Event(attr, v.terms, "input", max(state.reads.count(v.uid) - 1, 0))


class _Choose(Exception):
    """A condition this run cannot evaluate: the run is repeated with it true and false."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _Unknown:
    pass


_UNKNOWN = _Unknown()
_COMPARE = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
            ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
            ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _forward_ast(cls: type) -> tuple[ast.FunctionDef, int, dict[str, Any]]:
    forward = getattr(cls, "forward", None)
    if forward is None or not callable(forward):
        raise Refused(f"{cls.__name__} has no forward")
    forward = inspect.unwrap(forward)
    try:
        lines, start = inspect.getsourcelines(forward)
    except (OSError, TypeError) as exc:
        raise Refused(f"the source of {cls.__name__}.forward is not available ({exc})") from None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef):
        raise Refused(f"{cls.__name__}.forward is not a plain function")
    return fn, start, getattr(forward, "__globals__", {})


def norm_residual(norm: nn.Module) -> str:
    """What a norm module does with a second argument: ``adds`` (returns ``(norm(x + r),
    x + r)``, vLLM's fused add + norm), ``passes`` (returns ``r`` untouched) or ``unknown``.
    Asked by running it on a few rows of its own width, device and dtype."""
    weight = next(iter(norm.parameters()), None)
    width = weight.shape[-1] if weight is not None and weight.dim() >= 1 else None
    if width is None:
        width = getattr(norm, "hidden_size", None)
    if not width:
        return "unknown"
    device = weight.device if weight is not None else torch.device("cpu")
    dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.float32
    if device.type == "meta":
        return "unknown"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, width, generator=gen).to(device=device, dtype=dtype)
    r = torch.randn(3, width, generator=gen).to(device=device, dtype=dtype)
    want_sum, want_r = (x + r).float(), r.clone().float()
    try:
        with torch.no_grad():
            out = norm(x.clone(), r.clone())
    except Exception:  # a norm that cannot take a residual is "unknown"
        return "unknown"
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor)):
        return "unknown"
    got = out[1].float()
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-5
    if torch.allclose(got, want_sum, atol=tol, rtol=tol):
        return "adds"
    if torch.allclose(got, want_r, atol=tol, rtol=tol):
        return "passes"
    return "unknown"


MAX_PATHS = 128
"""Paths through a layer's unknown conditions that :func:`analyze` follows at most."""

Outcome = tuple[dict[str, bool], "LayerContract | Refused"]


def analyze(cls: type, layer: nn.Module | None = None, dtype: torch.dtype | None = None,
            norm_of: Callable[[str], str] | None = None) -> list[Outcome]:
    """The contract of decoder layer class ``cls`` on each path through the conditions that
    cannot be evaluated here: ``[(assumed conditions, contract or refusal)]``.

    ``layer``: an instance, whose attributes decide its ``if``s and whose norms are asked what
    they do with a residual (``norm_of(attr)`` answers instead, as :func:`norm_residual`
    does); ``dtype``: the model's, for conditions on it (vLLM's DeepSeek layers rescale the
    stream in float16)."""
    fn, start, globals_ = _forward_ast(cls)
    params = tuple(a.arg for a in fn.args.args[1:])
    name = cls.__name__
    stream_arg = next((p for p in params if p in ("hidden_states", "hidden_state", "x")), None)
    if stream_arg is None:
        return [({}, Refused(f"{name}.forward takes no hidden_states"))]
    if norm_of is None:
        def norm_of(attr: str) -> str:
            module = getattr(layer, attr, None) if layer is not None else None
            return norm_residual(module) if isinstance(module, nn.Module) else "unknown"
    interp = _Interpreter(fn, start, globals_, layer, dtype, functools.cache(norm_of))
    base = {p: OPAQUE for p in params}
    base["self"] = _Val(python=layer, known=layer is not None)
    h = _Val("sum", frozenset({H}), uid=1)
    scenarios = {"first": {**base, stream_arg: h}}
    if "residual" in params:
        scenarios["first"]["residual"] = NONE
        scenarios["split"] = {**base, stream_arg: h, "residual": _Val("sum", frozenset({R}),
                                                                       uid=2)}
    outcomes: list[Outcome] = []
    pending: list[dict[str, bool]] = [{}]
    while pending:
        assume = pending.pop()
        interp.assume = assume
        try:
            contracts = {k: _read(name, interp.run(env), split=(k == "split"))
                         for k, env in scenarios.items()}
            outcomes.append((assume, _combine(name, contracts, stream_arg, params)))
        except _Choose as choice:
            if len(outcomes) + len(pending) >= MAX_PATHS:
                return [({}, Refused(f"{name}.forward has too many paths that depend on its "
                                     "configuration"))]
            pending += [{**assume, choice.key: False}, {**assume, choice.key: True}]
        except Refused as exc:
            outcomes.append((assume, Refused(f"{name}.forward {exc}")))
    return outcomes


def layer_contract(cls: type, layer: nn.Module | None = None,
                   dtype: torch.dtype | None = None,
                   norm_of: Callable[[str], str] | None = None) -> LayerContract:
    """The contract of decoder layer class ``cls`` (see :func:`analyze`), or :class:`Refused`
    naming the reason, or the conditions the contract depends on where paths disagree."""
    outcomes = [(a, c) for a, c in analyze(cls, layer, dtype, norm_of)
                if not (isinstance(c, Refused) and str(c).endswith(_DEAD))]
    if not outcomes:
        raise Refused(f"{cls.__name__}.forward raises on every path")
    results = {c for _, c in outcomes if isinstance(c, LayerContract)}
    refusals = [c for _, c in outcomes if isinstance(c, Refused)]
    if refusals and not results:
        raise refusals[0]
    if len(results) == 1 and not refusals:
        return results.pop()
    conditions = sorted({k for a, _ in outcomes for k in a})
    raise Refused(f"{cls.__name__}.forward: where the stream is depends on "
                  + ", ".join(f"`{c}`" for c in conditions)
                  + (f" ({refusals[0]})" if refusals else ""))


_DEAD = "raises on this path"


def _combine(name: str, contracts: dict[str, LayerContract], stream_arg: str,
             params: tuple[str, ...]) -> LayerContract:
    """One contract from the run without a residual (``first``) and, for layers that take
    one, the run with it (``split``)."""
    first = replace(contracts["first"], stream_arg=stream_arg, params=params)
    split = contracts.get("split")
    if split is None:
        return first
    split = replace(split, stream_arg=stream_arg, params=params)
    if not split.split_input:  # the residual handed in is overwritten or ignored
        if (split.output, split.mid) != (first.output, first.mid):
            raise Refused(f"{name}: its dataflow differs with and without a residual")
        return split
    if split.output != "split" or first.output != "split" \
            or (split.mid, split.mid_fused) != (first.mid, first.mid_fused):
        raise Refused(f"{name}: with a residual it does not return the stream as a "
                      "(hidden_states, residual) pair as it does at the first layer")
    return split


def _read(name: str, state: _State, split: bool) -> LayerContract:
    """The contract one abstract run shows (``split``: a residual was handed in)."""
    if state.dead:
        raise Refused(_DEAD)
    out = state.returned
    if out is None:
        raise Refused("returns nothing the stream can be read from")
    used: set[str] = set()
    for v in [out, *out.items]:
        used |= v.terms
    split_input = split and R in used and H in used
    if split and R in used and not split_input:
        raise Refused("returns its residual without its hidden_states")

    def norm(terms: frozenset[str]) -> frozenset[str]:
        if split_input and {H, R} <= terms:
            return (terms - {H, R}) | {IN}
        if not split_input and H in terms and R not in terms:
            return (terms - {H}) | {IN}
        return terms

    def whole(terms: frozenset[str]) -> bool:
        t = norm(terms)
        return IN in t and t - {IN} and t <= S2

    items = out.items
    if out.kind == "sum" and whole(out.terms):
        output: Output = "tensor"
        total = norm(out.terms)
    elif out.kind == "tuple" and items and items[0].kind == "sum" and whole(items[0].terms):
        output, total = "first", norm(items[0].terms)
    elif out.kind == "tuple" and len(items) == 2 and all(v.kind == "sum" for v in items) \
            and not (items[0].terms & items[1].terms) and whole(items[0].terms | items[1].terms):
        output, total = "split", norm(items[0].terms | items[1].terms)
    else:
        raise Refused("does not return its input plus its branches (attention, MLP)")
    entry = next((e.attr for e in state.events if e.how == "fused" and norm(e.terms) == S0),
                 None)
    mid, fused = None, False
    mid_events = [e for e in state.events if norm(e.terms) == S1]
    if total == S2 and mid_events:
        first = mid_events[0]
        mid, fused = first.attr, first.how == "fused"
        if not fused and first.earlier_reads:
            mid = None  # read before the module: an in-place site would come too late
    if total != S2:
        kind = "token mixer only" if ATTN in total else "MLP only"
    elif fused:
        kind = "two streams, fused add + norm" if split_input else "one stream, fused norm"
    else:
        kind = "one stream" if mid else "parallel attention + MLP"
    return LayerContract(stream_arg="hidden_states", split_input=split_input, output=output,
                         mid=mid, mid_fused=fused, entry_norm=entry if split_input else None,
                         kind=kind)
