"""Inductor (torch 2.11, vLLM 0.26's): one launch decision for the kernels a fused site is in.

On CUDA a site that is not a monitor site is plain tensor ops (:func:`.ops.steer_add` in
dynsteer's worker), which Inductor fuses into the next layer's add + RMSNorm kernel. Inductor
writes that kernel as a *looped* reduction: each program walks the row twice in blocks of
2048 (the sum of squares, then the normalization), storing the steered sum between the loops
and reading it back. Stock's add + RMSNorm kernels are also written looped, but they are marked
``add_persistent_rblock``, so their autotuner may pick a persistent config (the whole row in
registers, one pass), and at decode batches it does. The site kernel's extra loads and stores
fail that mark's memory-saving test (``TritonKernel.codegen_kernel``: looped bytes at least 1.3x
persistent), so it runs looped with no alternative, slower than stock's persistent kernel at
decode batch sizes, once per layer and decode step.

The choice between a persistent and a looped reduction is Inductor's extension point
``InductorChoices.should_use_persistent_reduction``. :func:`install` configures a subclass
(:class:`PersistentSites`) whose answer is "persistent" for a reduction kernel holding a node
traced inside the named function (its FX origins' stack traces) when its row is at most
``max_row`` elements; every other kernel gets Inductor's own answer, so a kernel with no site
in it is compiled exactly as Inductor would compile it alone.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from torch._inductor import config
from torch._inductor.choices import InductorChoices
from torch._inductor.virtualized import V

logger = logging.getLogger(__name__)


class PersistentSites(InductorChoices):
    """Inductor's choices, but a reduction kernel that holds a node traced inside
    :attr:`function` is persistent when its row is at most :attr:`max_row` elements.

    A module-level class with its settings on the class: Inductor keeps its configuration,
    this class included, in the compiled artifact vLLM pickles for its compile cache, and
    torch's cache key asks the handler for :meth:`uuid`."""

    function: ClassVar[str] = ""
    max_row: ClassVar[int] = 0

    def uuid(self) -> str:
        return f"dynsteer.persistent-sites:{self.function}:{self.max_row}"

    def should_use_persistent_reduction(self, features: Any,
                                        cooperative_reduction: bool) -> bool:
        fits = V.graph.sizevars.statically_known_leq(features.reduction_numel, self.max_row)
        if not cooperative_reduction and fits and _holds(features, f", in {self.function}\n"):
            return True
        return super().should_use_persistent_reduction(features, cooperative_reduction)


def install(function: str, max_row: int) -> None:
    """Make reduction kernels that hold code traced in ``function`` (a function name, as a
    stack trace prints it) persistent up to ``max_row`` elements per row, in this process, for
    what compiles next; a later call's arguments replace the earlier ones. Where another
    choices class is configured already, it is left alone (the site kernels are then
    Inductor's own looped ones).

    Inductor makes its handler lazily, once per thread, from ``inductor_choices_class``: set
    there for threads that have not made theirs yet, and as this thread's handler."""
    configured = config.inductor_choices_class
    if configured not in (None, PersistentSites):
        logger.warning("dynsteer: Inductor's choices are %r already; the kernels sites are "
                       "fused into keep Inductor's launch decision", configured)
        return
    PersistentSites.function = function
    PersistentSites.max_row = max_row
    config.inductor_choices_class = PersistentSites
    V.set_choices_handler(PersistentSites())


def remove() -> None:
    """Undo :func:`install` for what compiles next in this process (an engine started with
    ``persistent_sites: false`` after one with it on, as the benchmarks do): Inductor's own
    choices again, and a configuration without the class, so no compile cache entry of the
    persistent kernels matches."""
    if config.inductor_choices_class is PersistentSites:
        config.inductor_choices_class = None
    if isinstance(V.choices, PersistentSites):
        V.set_choices_handler(InductorChoices())


def _holds(features: Any, frame: str) -> bool:
    """Whether a kernel's nodes include one traced inside the function of ``frame``."""
    for node in features.scheduler_nodes():
        for trace in node.node.get_stack_traces():
            if frame in trace + "\n":
                return True
    return False
