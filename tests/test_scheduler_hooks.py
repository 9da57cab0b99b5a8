"""The scheduler adapter's withholding hook (no engine): the KV-cache coordinator caches
through the prefix guard exactly while a request whose blocks are withheld is live, whatever
class the coordinator is (vLLM 0.26's hybrid coordinator overrides ``cache_blocks``)."""

from __future__ import annotations

from types import SimpleNamespace

from dynsteer.engine_ext.compat.scheduler import _Withholding


class Coordinator:
    def __init__(self) -> None:
        self.cached: list[tuple[str, int]] = []

    def cache_blocks(self, request, num_computed_tokens):
        self.cached.append((request.request_id, num_computed_tokens))


class Hybrid(Coordinator):
    def cache_blocks(self, request, num_computed_tokens):  # its own, as in vLLM 0.26
        self.cached.append((request.request_id, -num_computed_tokens))


class Held:
    withhold = True

    def cacheable(self, num_computed: int) -> int:
        return min(num_computed, 32)


def test_the_guard_runs_only_while_a_withheld_request_is_live():
    for cls, sign in ((Coordinator, 1), (Hybrid, -1)):
        coordinator = cls()
        withholding = _Withholding(coordinator)
        plain, gated = SimpleNamespace(request_id="plain"), SimpleNamespace(request_id="gated-1")
        assert "cache_blocks" not in vars(coordinator)  # nothing withheld: vLLM's method
        withholding.add("gated-1", Held())
        withholding.add("gated-2", Held())
        coordinator.cache_blocks(gated, 100)
        coordinator.cache_blocks(plain, 100)
        assert coordinator.cached == [("gated-1", sign * 32), ("plain", sign * 100)]
        withholding.discard("gated-1")
        withholding.discard("never-added")
        assert "cache_blocks" in vars(coordinator)  # gated-2 is still live
        withholding.discard("gated-2")
        assert "cache_blocks" not in vars(coordinator)
        coordinator.cache_blocks(gated, 100)  # the hook is gone: vLLM's own method, unclamped
        assert coordinator.cached[-1] == ("gated-1", sign * 100)
