"""controller/ and probes/ are usable without vLLM (and without torch)."""

from __future__ import annotations

import subprocess
import sys


def test_controller_and_probes_import_without_vllm_or_torch():
    code = (
        "import sys; import dynsteer.controller, dynsteer.probes; "
        "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
