"""vLLM's OpenAI-compatible server: its entry point and version (the routes themselves use
vLLM's public endpoint-plugin entry point)."""

from __future__ import annotations


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def run_api_server(argv: list[str]) -> None:
    """Run vLLM's OpenAI-compatible server (``python -m`` style) with ``argv``; blocks."""
    import runpy
    import sys

    sys.argv = ["dynsteer serve", *argv]
    try:
        from vllm.entrypoints.launchers.api_server.entry import main  # vLLM >= 0.32
    except ImportError:  # vLLM 0.26: the module's __main__ block is the entry point
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__",
                         alter_sys=True)
        return
    main()
