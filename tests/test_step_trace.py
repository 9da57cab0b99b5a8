"""benchmarks/step_trace.py: engine steps read from a torch-profiler trace (session 30).

A hand-built Kineto trace checks the GPU side (launches matched to their kernels by
correlation id, a graph replay's many kernels included, work launched outside a step left
out); a real CPU trace from torch's profiler checks that vLLM's step annotations are found
in what Kineto writes. ``serving.py --torch-profile`` gives the servers a profiler config
that vLLM's own argument parser accepts."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serving
import step_trace


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 7, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid,
            "args": args}


def _trace(norm_us: float) -> list[dict]:
    """An admitting step (a graph replay of two kernels, an eager attention kernel) then a
    decode step (one graph replay); a launch between the steps and one on another thread."""
    return [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
        _x("user_annotation", "execute_context_1(128)_generation_9(9)", 100.0, 50.0),
        _x("cuda_runtime", "cudaGraphLaunch", 110.0, 5.0, correlation=1),
        _x("cpu_op", "vllm::unified_attention_with_output", 115.0, 13.0),
        _x("cuda_driver", "cuLaunchKernelEx", 120.0, 3.0, correlation=2),
        _x("cpu_op", "aten::copy_", 140.0, 2.0),
        _x("kernel", "triton_red_fused_add_rms_norm_3", 130.0, norm_us, tid=20, correlation=1),
        _x("kernel", "triton_red_fused_add_rms_norm_12", 140.0 + norm_us, 4.0, tid=20,
           correlation=1),
        _x("kernel", "flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64>>", 170.0, 20.0,
           tid=20, correlation=2),
        _x("cuda_runtime", "cudaLaunchKernel", 160.0, 1.0, correlation=3),  # between steps
        _x("kernel", "stray", 200.0, 99.0, tid=20, correlation=3),
        _x("user_annotation", "execute_context_0(0)_generation_10(10)", 300.0, 20.0),
        _x("cuda_runtime", "cudaGraphLaunch", 305.0, 5.0, correlation=4),
        _x("cuda_runtime", "cudaLaunchKernel", 306.0, 1.0, tid=8, correlation=5),  # other thread
        _x("kernel", "triton_red_fused_add_rms_norm_3", 330.0, 6.0, tid=20, correlation=4),
        _x("kernel", "other_thread", 331.0, 50.0, tid=20, correlation=5),
        _x("user_annotation", "some_other_annotation", 100.0, 500.0),
    ]


def test_steps_match_kernels_to_their_step() -> None:
    admit, decode = step_trace.steps(_trace(norm_us=10.0))
    assert (admit["kind"], admit["context_tokens"], admit["tokens"]) == ("admit", 128, 137)
    assert admit["host_us"] == 50.0 and admit["kernels"] == 3
    assert admit["gpu_busy_us"] == pytest.approx(10.0 + 4.0 + 20.0)
    assert admit["gpu_span_us"] == pytest.approx(190.0 - 130.0)
    assert admit["first_wait_us"] == pytest.approx(30.0)
    assert admit["by_kernel"] == {"triton_red_fused_add_rms_norm": 14.0, "flash_fwd_kernel": 20.0}
    assert (decode["kind"], decode["kernels"], decode["gpu_busy_us"]) == ("decode", 1, 6.0)


def test_host_side_of_a_step() -> None:
    """Calls and time per host operation inside the step, nested ones under their own name;
    Python is the step less the union of the operations (the launch inside the attention op
    is covered once); the launch between the steps and the other thread's are left out."""
    admit, decode = step_trace.steps(_trace(norm_us=10.0))
    assert admit["by_host_op"] == {
        "cudaGraphLaunch": [1, 5.0], "vllm::unified_attention_with_output": [1, 13.0],
        "cuLaunchKernelEx": [1, 3.0], "aten::copy_": [1, 2.0]}
    assert admit["python_us"] == pytest.approx(50.0 - (5.0 + 13.0 + 2.0))
    assert decode["by_host_op"] == {"cudaGraphLaunch": [1, 5.0]}
    assert decode["python_us"] == pytest.approx(15.0)
    base = step_trace.summary([admit, decode])
    assert base["admit"]["host_op_per_step"]["aten::copy_"] == {"calls": 1.0, "us": 2.0}


def test_compare_ranks_the_kernel_that_grew() -> None:
    base = step_trace.summary(step_trace.steps(_trace(norm_us=10.0)))
    extra = _x("cpu_op", "dynsteer::fill", 143.0, 4.0)  # an operation only the other calls
    other = step_trace.summary(step_trace.steps([*_trace(norm_us=110.0), extra]))
    table = step_trace.compare(base, other, top=2)
    assert set(table) == {"admit", "decode"}
    assert table["admit"]["gpu_busy_us"] == [34.0, 134.0]
    assert table["admit"]["kernels_grown_us"][0] == ["triton_red_fused_add_rms_norm", 14.0, 114.0]
    assert table["decode"]["kernels_grown_us"][0][1:] == [6.0, 6.0]
    assert table["admit"]["host_us_deciles"] == [[50.0] * 9, [50.0] * 9]
    assert table["admit"]["python_us"] == [30.0, 26.0]
    assert table["admit"]["host_ops_grown"][0] == ["dynsteer::fill", 0.0, 1.0, 0.0, 4.0]
    assert base["decode"]["host_us_in_order"] == [20.0]


def test_reads_a_gzipped_trace_in_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "trace_vllm"
    folder.mkdir()
    with gzip.open(folder / "rank0.123.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": _trace(norm_us=10.0)}, f)
    assert len(step_trace.steps(step_trace.load_events(folder))) == 2
    (folder / "rank1.456.pt.trace.json.gz").write_bytes(b"")
    with pytest.raises(SystemExit, match="expected one"):
        step_trace.load_events(folder)


def test_finds_vllms_annotations_in_a_real_cpu_trace(tmp_path: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for name in ("execute_context_2(40)_generation_3(3)",
                     "execute_context_0(0)_generation_5(5)"):
            with record_function(name):
                torch.ones(64, 64).sum()
    prof.export_chrome_trace(str(tmp_path / "cpu.pt.trace.json"))
    found = step_trace.steps(step_trace.load_events(tmp_path))
    assert [(s["kind"], s["tokens"]) for s in found] == [("admit", 43), ("decode", 5)]
    assert all(s["host_us"] > 0 and s["kernels"] == 0 for s in found)
    assert all(s["by_host_op"]["aten::ones"][0] == 1 for s in found)  # Kineto's cpu_op events
    assert all(0 <= s["python_us"] < s["host_us"] for s in found)


def test_profiler_arguments_parse_in_vllm(tmp_path: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = serving.serve_args(tmp_path / "model", 0.3, tmp_path / "trace_x", 300)
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    config = parser.parse_args(args[args.index("--profiler-config"):]).profiler_config
    assert (config.profiler, config.max_iterations, config.delay_iterations) == ("torch", 300, 100)
    assert config.torch_profiler_dir == str((tmp_path / "trace_x").resolve())
    assert config.ignore_frontend and not config.torch_profiler_with_stack
    assert "--profiler-config" not in serving.serve_args(tmp_path / "model", 0.3)
