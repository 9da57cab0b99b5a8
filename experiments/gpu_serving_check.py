"""GPU checks of serving and the prefix-cache guard (vLLM 0.26, V2 runner, CUDA graphs on).

1. Prefix guard: a gated request whose gate fires first at a decode position; a follow-up with
   the same gate hits exactly the blocks before it and generates what a cold run generates;
   decode-only steering keeps the prompt's blocks shared; blocks withheld are counted. This
   runs the CPU test functions of tests/test_prefix_cache.py on the GPU engine.
2. `dynsteer serve` (vLLM 0.26's server + our endpoint plugin): per-request steering through
   the openai client both ways, bad specs are 400 naming the field, global steering, gate
   telemetry and /metrics. Runs tests/test_server.py's functions against a GPU server.

The prefix checks run with async scheduling on (the next step is scheduled before this
step's output is processed).

Usage: python experiments/gpu_serving_check.py OUT_DIR TOKENIZER_DIR  (writes gpu_serving.json)
       DYNSTEER_CHECK_ONLY=prefix ...   (prefix-guard checks only, e.g. with
       VLLM_USE_V2_MODEL_RUNNER=0 for the V1 runner)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
os.environ.setdefault("DYNSTEER_TEST_GPU_MEMORY", "0.25")


def _run(name: str, fn: Any, *args: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        fn(*args)
        ok, error = True, None
    except Exception:
        ok, error = False, traceback.format_exc(limit=6)
    result = {"check": name, "ok": ok, "seconds": round(time.perf_counter() - start, 1)}
    if error:
        result["error"] = error
    print(json.dumps(result), flush=True)
    return result


def prefix_checks(work: Path) -> list[dict[str, Any]]:
    import test_prefix_cache as t
    from engine_utils import start_llm, stop_llm
    from hf_reference import load_hf
    from tiny_models import make_tiny_model

    path = make_tiny_model("llama", work / "tiny_llama")
    llm = start_llm(path, dynsteer=t.DYNSTEER,
                    enable_prefix_caching=True, block_size=t.BLOCK, gpu_memory_utilization=0.25,
                    async_scheduling=True)
    hf = load_hf(path)
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    print(json.dumps({"async_scheduling": scheduler.async_scheduling}), flush=True)
    assert scheduler.async_scheduling, "the guard must be checked under async scheduling"
    try:
        return [_run(name, getattr(t, name), llm, hf) for name in (
            "test_prefill_steered_request_does_not_hit_unsteered_blocks",
            "test_identically_steered_requests_share_blocks",
            "test_phase_specific_steering_never_reuses_decode_kv_as_prompt",
            "test_decode_only_steering_does_not_fork_prompt_blocks",
            "test_gated_follow_up_hits_only_blocks_before_the_first_dynamic_position",
        )] + [_run("test_unsteered_traffic_keeps_full_prefix_hits",
                   t.test_unsteered_traffic_keeps_full_prefix_hits, llm)]
    finally:
        stop_llm(llm)


def serving_checks(work: Path, tokenizer_dir: Path) -> list[dict[str, Any]]:
    import openai
    import test_server as t
    from engine_utils import start_llm, stop_llm
    from server_utils import Server, make_chat_model

    from dynsteer.controller.client import DynsteerClient

    model = make_chat_model(work / "chat_model", tokenizer_dir)
    server = Server(model, work / "serve.log", "--dynsteer-api-key", t.KEY)
    results = []
    try:
        server.wait_ready()
        offline = start_llm(model, dynsteer={}, skip_tokenizer_init=False, max_num_seqs=8,
                            gpu_memory_utilization=0.25)
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key=t.KEY, max_retries=0)
        client = DynsteerClient(server.url, api_key=t.KEY)
        results += [
            _run("openapi", t.test_openapi_lists_the_routes, server, offline),
            _run("steered_chat_equals_offline", t.test_steered_chat_both_ways_equals_offline,
                 oai, offline),
            _run("completions", t.test_completions_route_takes_the_spec, oai, server),
            _run("global", t.test_global_steering_changes_outputs_and_returns_to_baseline,
                 oai, client),
            _run("gated_telemetry", t.test_gated_request_telemetry_matches_offline, oai, client,
                 offline),
            _run("metrics", t.test_metrics_move, oai, server),
        ]
        for spec, fragment in [({"steer": [{"vector": [1.0], "layers": [1]}]},
                                "dynsteer.steer[0].vector"), ("{broken", "malformed JSON")]:
            results.append(_run(f"bad_spec_400:{fragment}",
                                t.test_bad_specs_are_400_naming_the_field, oai, spec, fragment))
        stop_llm(offline)
    except Exception:
        results.append({"check": "serving", "ok": False, "error": traceback.format_exc(limit=6),
                        "log": server.log_tail(80)})
    finally:
        server.stop()
    return results


def main() -> None:
    out, tokenizer_dir = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import vllm

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0),
                              "vllm": vllm.__version__,
                              "v2_runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "default")}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        report["prefix_guard"] = prefix_checks(work)
        if os.environ.get("DYNSTEER_CHECK_ONLY") != "prefix":
            report["serving"] = serving_checks(work, tokenizer_dir)
    parts = [k for k in ("prefix_guard", "serving") if k in report]
    report["all_ok"] = all(r["ok"] for k in parts for r in report[k])
    name = "gpu_serving.json" if "serving" in report else "gpu_prefix.json"
    (out / name).write_text(json.dumps(report, indent=2))
    print("ALL OK" if report["all_ok"] else "FAILURES", flush=True)


if __name__ == "__main__":
    main()
