"""The serving benchmark's interleaved mode (``benchmarks/serving.py --interleave``): every server
alive at once and measured in turn, the order reversed every other segment, and the ratio to
plain vLLM taken segment by segment; and how ``benchmarks/serving_pool.py`` pools calls. The
servers are replaced by recorders (what is checked is the orchestration; the GPU figures are in
benchmarks/RESULTS.md)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bench_model
import numpy as np
import pytest
import serving


@pytest.fixture(autouse=True)
def _models_in_tmp(tmp_path, monkeypatch):
    """serving.main writes its dummy model folder; here, not under the user's cache."""
    monkeypatch.setenv(bench_model.ROOT_ENV, str(tmp_path / "models"))


def _server(name: str, log: list[tuple[Any, ...]], stopped: list[str] | None = None,
            on_load: Any = None) -> Any:
    """A stand-in for ``serving.plain_server``/``dynsteer_server``: requests take a
    server-specific time to the first token and between tokens. ``stopped`` gets the name
    when the server stops; ``on_load(n)`` runs before the n-th load of this server (from 0)."""
    scale = {"vllm": 1.0, "vllm-b": 1.25, "dynsteer": 1.5}[name]

    @contextlib.contextmanager
    def server() -> Iterator[serving.Load]:
        def load(bodies: list[dict[str, Any]], rate: float) -> dict[str, Any]:
            if on_load is not None:
                on_load(sum(entry[0] == name for entry in log) - 1)
            log.append((name, len(bodies)))
            done = [{"ttft": 0.02 * scale, "itl": [0.005 * scale] * 3, "sent": 0.0,
                     "stamps": np.arange(4.0), "kind": serving.kind_of(b), "end": 1.0}
                    for b in bodies]
            return {"requests": len(bodies), "errors": 0, "first_errors": [],
                    **serving.latencies(done), "requests_per_s": 10.0, "by_kind": {},
                    "_done": done, "worker_host": {}}

        log.append((name, -1))  # started
        try:
            yield load
        finally:
            if stopped is not None:
                stopped.append(name)

    return server()


def _serving_argv(tmp_path: Path, monkeypatch: Any, log: list[tuple[Any, ...]],
                  *flags: str) -> list[str]:
    """serving.py's servers replaced by recorders logging into ``log``; its command line with
    a tokenizer folder, ``--runs vllm,dynsteer`` and ``flags``."""
    monkeypatch.setattr(serving, "plain_server", lambda *a: _server("vllm", log))
    monkeypatch.setattr(serving, "dynsteer_server", lambda *a: _server("dynsteer", log))
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    return ["serving.py", "--out", str(tmp_path), "--tokenizer", str(tokenizer), "--runs",
            "vllm,dynsteer", *flags]


def test_serving_servers_are_all_up_and_serve_each_segment_in_turn(tmp_path, monkeypatch,
                                                                   capsys):
    log: list[tuple[Any, ...]] = []
    monkeypatch.setattr(sys, "argv", _serving_argv(tmp_path, monkeypatch, log, "--requests",
                                                   "40", "--interleave", "4"))
    serving.main()

    assert log[:2] == [("vllm", -1), ("dynsteer", -1)]  # both up before the first segment
    assert log[2:] == [("vllm", 10), ("dynsteer", 10), ("dynsteer", 10), ("vllm", 10),
                       ("vllm", 10), ("dynsteer", 10), ("dynsteer", 10), ("vllm", 10)]
    result = json.loads((tmp_path / "serving.json").read_text())
    assert [r["segment"] for r in result["runs"] if r["name"] == "dynsteer"] == [0, 1, 2, 3]
    assert result["ratios"]["dynsteer"]["itl_ms_p99"] == pytest.approx(1.5)
    assert result["pair_ratios"]["dynsteer"]["ttft_ms_p50"] == pytest.approx([1.5] * 4)
    assert "dynsteer / vllm, pooled" in capsys.readouterr().out


def test_a_second_plain_server_brackets_dynsteer_and_shows_the_start_order(tmp_path, monkeypatch,
                                                                           capsys):
    """``--runs vllm,dynsteer,vllm-b``: a second plain vLLM, started after dynsteer, gets plain
    vLLM's stream; its ratio to ``vllm`` is the start order's effect, and dynsteer is compared
    with both plain servers pooled as well (``bracketed``)."""
    log: list[tuple[Any, ...]] = []
    argv = _serving_argv(tmp_path, monkeypatch, log, "--requests", "20", "--interleave", "2")
    monkeypatch.setattr(serving, "plain_server", lambda model, out, name, launch:
                        _server(name, log))
    argv[argv.index("--runs") + 1] = "vllm,dynsteer,vllm-b"
    monkeypatch.setattr(sys, "argv", argv)
    serving.main()

    assert log == [("vllm", -1), ("dynsteer", -1), ("vllm-b", -1),
                   ("vllm", 10), ("dynsteer", 10), ("vllm-b", 10),
                   ("vllm-b", 10), ("dynsteer", 10), ("vllm", 10)]
    kinds = np.load(tmp_path / "latencies.npz")
    assert set(np.concatenate([kinds[k] for k in kinds.files if k.endswith("vllm-b_kind")])) \
        == {"plain"}
    result = json.loads((tmp_path / "serving.json").read_text())
    assert result["ratios"]["vllm-b"]["itl_ms_p99"] == pytest.approx(1.25)
    assert result["ratios"]["dynsteer"]["itl_ms_p99"] == pytest.approx(1.5)
    # pooled over both plain servers' tokens, half at 5 ms and half at 6.25 ms: the p99 is
    # the slower one's
    assert result["bracketed"]["dynsteer"]["itl_ms_p50"] == pytest.approx(1.5 / 1.125, rel=0.02)
    assert result["bracketed"]["dynsteer"]["itl_ms_p99"] == pytest.approx(1.5 / 1.25)
    assert "vllm-b" not in result.get("bracketed", {})
    assert "dynsteer / both plain servers, pooled" in capsys.readouterr().out
    argv[argv.index("--runs") + 1] = "vllm,dynsteer,vllm-b-variant"  # no such server
    with pytest.raises(SystemExit):
        serving.main()


def test_serving_warms_every_server_up_before_the_segments_and_reports_it_apart(
        tmp_path, monkeypatch, capsys):
    """``--warmup``: each server serves a stream of its own first (other prompts and vectors,
    the same mix); its latencies are kept apart, with the ratio to vLLM's, and the segments
    are measured as without it."""
    log: list[tuple[Any, ...]] = []
    argv = _serving_argv(tmp_path, monkeypatch, log, "--requests", "20", "--warmup", "6")
    monkeypatch.setattr(sys, "argv", [*argv, "--interleave", "2"])
    serving.main()

    assert log == [("vllm", -1), ("dynsteer", -1), ("vllm", 6), ("dynsteer", 6),
                   ("vllm", 10), ("dynsteer", 10), ("dynsteer", 10), ("vllm", 10)]
    result = json.loads((tmp_path / "serving.json").read_text())
    assert [r["segment"] for r in result["runs"]] == [0, 0, 1, 1]  # the warm-up not pooled
    assert result["warmup"]["requests"] == 6
    assert result["warmup"]["ratios"]["dynsteer"]["itl_ms_p99"] == pytest.approx(1.5)
    assert "dynsteer / vllm, warm-up" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", argv)  # one server at a time: refused
    with pytest.raises(SystemExit):
        serving.main()


def test_the_warm_up_stream_has_the_mix_but_not_the_prompts_or_vectors_of_the_measured_one():
    measured = serving.requests(8, "mixed")
    warm = serving.requests(8, "mixed", serving.WARMUP_SEED)
    assert [serving.kind_of(b) for b in warm] == [serving.kind_of(b) for b in measured]
    assert all(a["prompt"] != b["prompt"] for a, b in zip(measured, warm, strict=True))
    static = [(a["dynsteer"], b["dynsteer"]) for a, b in zip(measured, warm, strict=True)
              if serving.kind_of(a) == "static"]
    assert static and all(a != b for a, b in static)
    assert serving.requests(8, "mixed") == measured  # the measured stream is fixed


def test_serving_stops_its_servers_on_sigterm_and_keeps_the_segments_before(tmp_path,
                                                                          monkeypatch):
    """A device call's ``timeout`` sends SIGTERM: the servers must stop (else they keep their
    GPU memory and the next call's servers fail to start) and the finished segments stay."""
    import os
    import signal

    log: list[tuple[Any, ...]] = []
    stopped: list[str] = []

    def term_at_second_segment(n: int) -> None:
        if n == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(serving, "plain_server", lambda *a: _server("vllm", log, stopped))
    monkeypatch.setattr(serving, "dynsteer_server", lambda *a: _server(
        "dynsteer", log, stopped, term_at_second_segment))
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    monkeypatch.setattr(sys, "argv", ["serving.py", "--out", str(tmp_path), "--tokenizer",
                                      str(tokenizer), "--runs", "vllm,dynsteer",
                                      "--requests", "40", "--interleave", "4"])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        serving.main()

    assert stop.value.code == 128 + signal.SIGTERM
    assert sorted(stopped) == ["dynsteer", "vllm"]
    kept = json.loads((tmp_path / "serving.json").read_text())["runs"]
    assert [(r["name"], r["segment"]) for r in kept] == [("vllm", 0), ("dynsteer", 0)]
    assert sorted(np.load(tmp_path / "latencies.npz").files) == sorted(  # kept with them
        f"{k}_{name}_{what}" for k, name in enumerate(("vllm", "dynsteer"))
        for what in ("ttft_s", "itl_s", "sent_s", "chunks", "stamps_s", "kind"))
    assert signal.getsignal(signal.SIGTERM) is before


def test_serving_begins_no_segment_that_would_end_past_the_deadline(tmp_path, monkeypatch,
                                                                    capsys):
    """``--deadline``: a segment as long as the last one must end inside it, or the call
    stops there and reports the segments measured (each load here takes 10 s of a clock
    that moves only with the loads)."""
    log: list[tuple[Any, ...]] = []
    offset = [0.0]
    real = time.monotonic
    monkeypatch.setattr(serving.time, "monotonic", lambda: real() + offset[0])

    def ten_seconds(n: int) -> None:
        offset[0] += 10.0

    monkeypatch.setattr(serving, "plain_server", lambda *a: _server("vllm", log, None,
                                                                   ten_seconds))
    monkeypatch.setattr(serving, "dynsteer_server", lambda *a: _server("dynsteer", log, None,
                                                                      ten_seconds))
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    argv = ["serving.py", "--out", str(tmp_path), "--tokenizer", str(tokenizer), "--runs",
            "vllm,dynsteer", "--requests", "40", "--interleave", "4", "--deadline", "50"]
    monkeypatch.setattr(sys, "argv", argv)
    serving.main()

    # segments of 20 s: the second ends at 40 s; a third would end at 60 s, past 50
    result = json.loads((tmp_path / "serving.json").read_text())
    assert [r["segment"] for r in result["runs"]] == [0, 0, 1, 1]
    assert result["ratios"]["dynsteer"]["itl_ms_p99"] == pytest.approx(1.5)
    assert "2 of 4 segments measured" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [a for a in argv if a not in ("--interleave", "4")])
    with pytest.raises(SystemExit):  # one server at a time: refused
        serving.main()


def test_importing_the_benchmarks_leaves_the_environment_alone():
    """Tests import these modules; an environment variable set at import (a benchmark once set
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` there) changes how every later test starts engines."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    code = ("import os; before = dict(os.environ); "
            "import serving, serving_pool, serving_steps, overhead, load_test, kernel_bench, "
            "bench_model, bench_controllers, sigterm, tp_settings; "
            "changed = sorted(set(before.items()) ^ set(os.environ.items())); "
            "assert not changed, changed")
    # Without the VLLM_ variables: this module's own imports above would otherwise have set
    # them already in this process, which the child inherits. The benchmarks import each
    # other as scripts do (their folder first on the path).
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "benchmarks"),
                                                      env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)


_TINY_SERVER = '''
import argparse, http.server, json, os, subprocess, sys
ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int)
ap.add_argument("--host")
a = ap.parse_args()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"cpus": sorted(os.sched_getaffinity(0)), "child": child.pid,
                           "child_cpus": sorted(os.sched_getaffinity(child.pid))}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


http.server.HTTPServer((a.host, a.port), Health).serve_forever()
'''


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_server_process_pins_the_server_and_stops_its_whole_group(tmp_path):
    """A server pinned with ``cpus`` runs there with what it starts; on exit its group goes
    too, so a child its server leaves behind (as vLLM's engine core can) holds no GPU."""
    import urllib.request

    script = tmp_path / "server.py"
    script.write_text(_TINY_SERVER)
    with serving.server_process([sys.executable, str(script)], "/health", tmp_path / "s.log",
                                timeout=60, cpus="0") as (url, proc):
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            seen = json.loads(r.read())
        assert _running(seen["child"])
    assert seen["cpus"] == [0] and seen["child_cpus"] == [0]
    assert proc.returncode is not None
    deadline = time.monotonic() + 10  # SIGKILL lands asynchronously
    while _running(seen["child"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(seen["child"])


def test_serving_pins_each_server_in_order_and_refuses_bad_lists(tmp_path, monkeypatch,
                                                                 capsys):
    log: list[tuple[Any, ...]] = []
    pinned: dict[str, str | None] = {}

    def server(name: str) -> Any:
        def make(model: Path, out: Path, run: str, launch: serving.Launch, *rest: Any) -> Any:
            pinned[run] = launch.cpus
            return _server(name, log)
        return make

    monkeypatch.setattr(serving, "plain_server", server("vllm"))
    monkeypatch.setattr(serving, "dynsteer_server", server("dynsteer"))
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    argv = ["serving.py", "--out", str(tmp_path), "--tokenizer", str(tokenizer), "--runs",
            "vllm,dynsteer", "--requests", "20", "--interleave", "2", "--pin-cpus"]
    monkeypatch.setattr(sys, "argv", [*argv, "1", "0"])
    serving.main()
    assert pinned == {"vllm": "1", "dynsteer": "0"}
    assert json.loads((tmp_path / "serving.json").read_text())["pin_cpus"] == pinned

    for bad, message in ((["0"], "1 CPU lists for 2 servers"),
                         (["0", "a-b"], "is not a taskset -c list"),
                         (["0", "0,4096"], "CPU 4096")):
        monkeypatch.setattr(sys, "argv", [*argv, *bad])
        with pytest.raises(SystemExit):
            serving.main()
        assert message in capsys.readouterr().err


def test_the_admitting_step_is_the_gap_running_requests_saw_before_a_first_chunk():
    """Three requests decode at 5 ms a step; a fourth is admitted by a 12 ms step, and its
    first chunk comes with the burst after it (async scheduling): that step is the reading,
    whatever the kinds; a load with no admission beside running requests has none."""
    import serving_steps

    gaps = np.array([5.0] * 20 + [12.0] + [5.0] * 20) / 1e3
    steps = np.concatenate([[0.0], np.cumsum(gaps)])
    running = [{"stamps": steps + 1e-4 * i, "kind": "plain"} for i in range(3)]
    admitted = {"stamps": steps[22:], "kind": "gated"}
    assert serving_steps.admitting_step_ms([*running, admitted]) == pytest.approx(12.0, abs=0.01)
    assert serving_steps.admitting_step_ms([admitted]) is None
    assert serving_steps.admitting_step_ms([]) is None


def test_admissions_pool_over_calls_per_server_without_the_warm_up(tmp_path):
    """``serving_steps.pooled``: every file's runs per server and kind admitted, each
    server's first run in each file left out with ``skip_first`` (serving.py's warm-up)."""
    import serving_steps

    def run(step_ms: float) -> dict[str, np.ndarray]:
        gaps = np.array([5.0] * 20 + [step_ms] + [5.0] * 20) / 1e3
        steps = np.concatenate([[0.0], np.cumsum(gaps)])
        stamps = [steps + 1e-4 * i for i in range(3)] + [steps[22:]]
        return {"stamps_s": np.concatenate(stamps),
                "chunks": np.array([len(s) for s in stamps]),
                "kind": np.array(["plain"] * 3 + ["gated"])}

    calls = ([("vllm", 30.0), ("dynsteer", 30.0), ("vllm", 9.0), ("dynsteer", 12.0)],
             [("dynsteer", 30.0), ("vllm", 30.0), ("dynsteer", 10.0), ("vllm", 11.0)])
    files = []
    for call, runs in enumerate(calls):  # each server's first run: a 30 ms warm-up
        arrays = {f"{index}_{server}_{key}": value
                  for index, (server, ms) in enumerate(runs) for key, value in run(ms).items()}
        np.savez(tmp_path / f"{call}.npz", **arrays)
        files.append(np.load(tmp_path / f"{call}.npz"))
    measured = serving_steps.pooled(files, skip_first=True)
    assert set(measured) == {"vllm", "dynsteer"}
    assert measured["vllm"]["gated"][:, serving_steps.OFFSETS.index(-1)] * 1e3 \
        == pytest.approx([9.0, 11.0], abs=0.01)
    assert measured["dynsteer"]["gated"][:, serving_steps.OFFSETS.index(-1)] * 1e3 \
        == pytest.approx([12.0, 10.0], abs=0.01)
    every = serving_steps.pooled(files, skip_first=False)
    assert len(every["vllm"]["gated"]) == 4  # the warm-up runs (30 ms) are in


def test_pooled_calls_are_also_split_by_the_server_started_first(tmp_path, monkeypatch, capsys):
    """serving_pool: each call's first-started server is read from its file; the ITL p99 ratio
    pooled per start order and, with both orders there, their geometric mean, which cancels
    a penalty for starting first that is the same for either server."""
    import serving_pool

    def call(name: str, first: str, slow_first: float) -> Path:
        # 100 gaps per server, the last 2 slow: a server's p99 is its slow gap, scaled by
        # slow_first for the server started first
        gaps = np.r_[np.full(98, 0.005), 0.012, 0.012]
        order = (first, "dynsteer" if first == "vllm" else "vllm")
        arrays = {}
        for i, server in enumerate(order):
            scale = (1.1 if server == "dynsteer" else 1.0) * (slow_first if i == 0 else 1.0)
            arrays[f"{i}_{server}_itl_s"] = gaps * scale
            arrays[f"{i}_{server}_ttft_s"] = np.full(10, 0.02)
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        return path

    files = [call("a", "vllm", 1.2), call("b", "dynsteer", 1.2)]
    out = tmp_path / "pool.json"
    monkeypatch.setattr(sys, "argv", ["serving_pool.py", *map(str, files), "--json", str(out)])
    serving_pool.main()

    result = json.loads(out.read_text())
    assert result["started_first"] == ["vllm", "dynsteer"]
    assert result["itl_p99_by_first"] == pytest.approx({"vllm": 1.1 / 1.2,
                                                        "dynsteer": 1.1 * 1.2})
    assert result["itl_p99_order_balanced"] == pytest.approx(1.1)
    assert "both start orders weighted equally" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["serving_pool.py", str(files[0]), "--json", str(out)])
    serving_pool.main()  # one order only: no balanced figure
    assert "itl_p99_order_balanced" not in json.loads(out.read_text())


def test_pooled_calls_pool_the_servers_of_a_comma_list(tmp_path, monkeypatch):
    """serving_pool ``--base vllm,vllm-b --server dynsteer,dynsteer-variant``: a call that
    started two servers of each kind in the order A B B A pools each kind's runs, so a start
    order effect that grows with position cancels; a name that is in no file stops it."""
    import serving_pool

    gaps = np.r_[np.full(96, 0.005), np.full(4, 0.012)]  # p99 of two pooled: the slower's
    arrays = {}
    for i, server in enumerate(("vllm", "dynsteer", "dynsteer-variant", "vllm-b")):
        scale = (1.04 if server.startswith("dynsteer") else 1.0) * (1 + 0.1 * i)
        arrays[f"{i}_{server}_itl_s"] = gaps * scale
        arrays[f"{i}_{server}_ttft_s"] = np.full(10, 0.02)
    path = tmp_path / "abba.npz"
    np.savez(path, **arrays)
    out = tmp_path / "pool.json"
    argv = ["serving_pool.py", str(path), "--json", str(out), "--base", "vllm,vllm-b",
            "--server", "dynsteer,dynsteer-variant"]
    monkeypatch.setattr(sys, "argv", argv)
    serving_pool.main()
    # p99 of each pool: its slowest server's slow gaps (scaled 1.3 for vllm-b, 1.04 x 1.2)
    assert json.loads(out.read_text())["itl"]["p99"] == pytest.approx(1.04 * 1.2 / 1.3)
    monkeypatch.setattr(sys, "argv", [*argv[:-1], "dynsteer-b"])
    with pytest.raises(SystemExit, match="dynsteer-b"):
        serving_pool.main()


def test_each_load_is_read_against_the_plain_loads_of_its_own_segment(tmp_path):
    """serving_pool.by_segment: every plugin load's ITL p99 over the geometric mean of its
    segment's plain loads, and the second plain load over the first as the control; medians
    over loads, bootstrapped over segments, and the share of loads over SLOW. A segment in
    which every server ran slow (the host) moves no ratio."""
    import serving_pool

    def run(name: str, segment: int, p99: float) -> dict[str, Any]:
        return {"name": name, "segment": segment, "itl_ms_p99": p99}

    runs = [run("vllm", 0, 10.0), run("vllm-b", 0, 10.0), run("dynsteer", 0, 10.3),
            run("vllm", 1, 20.0), run("vllm-b", 1, 22.0), run("dynsteer", 1, 20.0 * 1.1 ** 0.5
                                                              * 1.03),  # the host slow: x2
            run("vllm-b", 2, 9.0), run("vllm", 2, 10.0), run("dynsteer", 2, 13.0),
            run("dynsteer-variant", 3, 30.0)]  # no plain load in its segment: left out
    (tmp_path / "serving.json").write_text(json.dumps({"runs": runs}))
    np.savez(tmp_path / "latencies.npz", x=np.zeros(1))
    report = serving_pool.call_report(tmp_path / "latencies.npz")

    result = serving_pool.by_segment([report, None], "vllm,vllm-b", "dynsteer,dynsteer-variant",
                                     np.random.default_rng(0), draws=200)

    assert result["segments"] == 3
    server, control = result["server"], result["control"]
    ratios = [1.03, 1.03, 13.0 / 90 ** 0.5]
    assert server["loads"] == 3 and server["median"] == pytest.approx(1.03)
    assert server["share_slow"] == pytest.approx(1 / 3)  # 13 over sqrt(10 * 9): 1.37
    low, mid, high = server["bootstrap_5_50_95"]
    assert min(ratios) - 1e-9 <= low <= mid <= high <= max(ratios) + 1e-9
    assert control["loads"] == 3 and control["median"] == pytest.approx(1.0)
    assert control["share_slow"] == 0.0  # vllm-b over vllm: 1.0, 1.1 (not over), 0.9
