"""Where does stock vLLM 0.26 wait when it starts with tensor_parallel_size=2 (issue 18)?

On the 2x H200 host, TP=2 engines crashed once (``CUBLAS_STATUS_INTERNAL_ERROR``, then an illegal
memory access in the custom / symmetric-memory all-reduce) and later did not finish starting
within 250 s, with or without the custom and symmetric-memory all-reduce; where they waited
was never captured. This script starts a dummy 1B-shaped Llama (``load_format="dummy"``, no
plugin: ``VLLM_PLUGINS=""``) with TP=2 under a list of variants, each in a fresh process
session with its own deadline, and generates 4 tokens for 2 prompts. When a deadline passes it
saves ``nvidia-smi``, freezes the whole process tree (SIGSTOP), then aborts one process at a
time (SIGABRT + SIGCONT) so that faulthandler (``PYTHONFAULTHANDLER=1``) writes every thread's
Python stack of that process, un-interleaved, into the log; then it SIGKILLs what is left.

Variants, in run order (all keep torch.compile and CUDA graphs unless said otherwise; the
knobs are those of vLLM 0.26):

- ``defaults``: stock settings (O2: custom all-reduce, torch symmetric-memory all-reduce,
  the FlashInfer all-reduce + RMSNorm fusion pass with its ``auto`` = mnnvl workspace).
- ``no_custom_ar``: ``disable_custom_all_reduce=True`` and ``VLLM_ALLREDUCE_USE_SYMM_MEM=0``
  (the FlashInfer fusion pass stays on).
- ``no_ipc_all``: also every other IPC / symmetric-memory user off: the FlashInfer fusion
  pass, sequence parallelism and async TP (``pass_config``), the standalone FlashInfer
  all-reduce and NCCL symmetric memory (env); all-reduce is plain NCCL (pynccl).
- ``fi_trtllm``: ``no_custom_ar`` with ``VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm`` (keeps the
  fusion pass, on the IPC workspace instead of the multicast one).
- ``nccl_p2p_off`` (only when named): ``no_ipc_all`` with ``NCCL_P2P_DISABLE=1``.

A total budget (``--budget``, default 480 s) shortens the last deadlines and skips the
variants that no longer fit, so one call stays under 9 minutes.

tp_startup.json holds per variant: status (ok; error: the start failed; timeout: the deadline
passed before the 4 tokens; exit_hang: tokens printed but the process did not exit; skipped),
the last phase reached (start / imported / ready / done), seconds to ready and in all, the
tokens, the last 30 log lines (and at the deadline), the lines naming errors, GPU use before
the start, and for timeouts every process of the tree: its title, /proc state and wchan
before the freeze, and its distinct thread stacks (8 innermost frames each).

Usage (on the 2-GPU machine; OUT receives tp_<variant>.log, tp_topo.txt and tp_startup.json):
    python -u experiments/tp_startup.py $OUT
    python -u experiments/tp_startup.py $OUT --variants no_ipc_all --deadline 150
    python -u experiments/tp_startup.py $OUT --variants selftest_hang --deadline 10   (no GPU:
        a sleeping process tree, to check the timeout path)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MARK = "@@tp_startup@@"
"""Prefix of the lines the variant process prints (phase, then a JSON payload)."""

LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "torch_dtype": "bfloat16",
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
PROMPTS = [[1, 17, 42, 99, 7, 250, 3, 64], [1, 300, 5, 77, 8]]
ENGINE_KWARGS: dict[str, Any] = {
    "tensor_parallel_size": 2,
    "gpu_memory_utilization": 0.3,
    "max_model_len": 512,
    "max_num_seqs": 8,
    "load_format": "dummy",
    "skip_tokenizer_init": True,
}
BASE_ENV = {
    "PYTHONFAULTHANDLER": "1",
    "VLLM_LOGGING_LEVEL": "DEBUG",
    "NCCL_DEBUG": "INFO",
    # Init and env lines only: NCCL version, transports (P2P/CUMEM, SHM), NVLS state.
    "NCCL_DEBUG_SUBSYS": "INIT,ENV",
    "VLLM_PLUGINS": "",  # stock vLLM: dynsteer's entry point is not loaded
}
HOST_ENV = (
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
    "CUDA_VISIBLE_DEVICES",
    "VLLM_WORKER_MULTIPROC_METHOD",
)

# vLLM 0.26 knobs: vllm/envs.py (VLLM_ALLREDUCE_USE_SYMM_MEM default 1,
# VLLM_ALLREDUCE_USE_FLASHINFER 0, VLLM_USE_NCCL_SYMM_MEM 0, VLLM_FLASHINFER_ALLREDUCE_BACKEND
# auto), vllm/config/compilation.py PassConfig (fuse_allreduce_rms, enable_sp, fuse_gemm_comms),
# vllm/config/vllm.py OPTIMIZATION_LEVEL_02 (the default level: fuse_allreduce_rms on for TP>1 on
# sm90/sm100 with FlashInfer installed).
NO_AR_ENV = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
NO_IPC_ENV = {**NO_AR_ENV, "VLLM_ALLREDUCE_USE_FLASHINFER": "0", "VLLM_USE_NCCL_SYMM_MEM": "0"}
NO_IPC_KWARGS: dict[str, Any] = {
    "disable_custom_all_reduce": True,
    "compilation_config": {
        "pass_config": {"fuse_allreduce_rms": False, "enable_sp": False, "fuse_gemm_comms": False}
    },
}
SELFTEST = "selftest_hang"
"""Hidden variant: a process tree that sleeps past its deadline (tests the timeout path)."""


@dataclass(frozen=True)
class Variant:
    env: dict[str, str] = field(default_factory=dict)
    kwargs: dict[str, Any] = field(default_factory=dict)


VARIANTS = {
    "defaults": Variant(),
    "no_custom_ar": Variant(NO_AR_ENV, {"disable_custom_all_reduce": True}),
    "no_ipc_all": Variant(NO_IPC_ENV, NO_IPC_KWARGS),
    "fi_trtllm": Variant(
        {**NO_AR_ENV, "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm"},
        {"disable_custom_all_reduce": True},
    ),
    "nccl_p2p_off": Variant({**NO_IPC_ENV, "NCCL_P2P_DISABLE": "1"}, NO_IPC_KWARGS),
    SELFTEST: Variant(),
}
DEFAULT_ORDER = "defaults,no_custom_ar,no_ipc_all,fi_trtllm"
DUMP_RESERVE_S = 25.0
"""Time kept back from the budget for a timed-out variant's dump and kill."""
MIN_DEADLINE_S = 60.0
"""A variant that would get less is skipped (a compiled start needs about that much)."""


# --- the variant process --------------------------------------------------------------------


def emit(phase: str, **payload: Any) -> None:
    """One marker line, written in a single call so worker output cannot split it."""
    sys.stdout.write(f"{MARK} {phase} {json.dumps(payload)}\n")
    sys.stdout.flush()


def run_variant(name: str, model: str) -> None:
    t0 = time.monotonic()
    emit("start", variant=name, pid=os.getpid())
    if name == SELFTEST:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        time.sleep(600)
    import vllm
    from vllm import LLM, SamplingParams

    emit("imported", vllm=vllm.__version__, seconds=time.monotonic() - t0)
    llm = LLM(model=model, **ENGINE_KWARGS, **VARIANTS[name].kwargs)
    emit("ready", seconds=time.monotonic() - t0)
    params = SamplingParams(max_tokens=4, temperature=0, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    emit("done", tokens=tokens, seconds=time.monotonic() - t0)


# --- process tree handling (parent) ---------------------------------------------------------


def proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, session id, state) from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        table[int(entry)] = (int(fields[1]), int(fields[3]), fields[0])
    return table


def tree(root: int) -> list[int]:
    """Live (non-zombie) members of root's session and descendants, deepest first."""
    table = proc_table()

    def depth(pid: int) -> int | None:
        d = 0
        while pid != root:
            if pid not in table or d > 64:
                return None
            pid, d = table[pid][0], d + 1
        return d

    members = []
    for pid, (_, sid, state) in table.items():
        d = depth(pid)
        if state != "Z" and (sid == root or d is not None):
            members.append((-(d if d is not None else 99), pid))
    return [pid for _, pid in sorted(members)]


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def describe(pid: int) -> dict[str, Any]:
    def read(name: str) -> str:
        try:
            return Path(f"/proc/{pid}/{name}").read_text().replace("\0", " ").strip()
        except OSError:
            return ""

    stat = read("stat")
    return {
        "pid": pid,
        "cmdline": read("cmdline")[:160],
        "state": stat.rsplit(")", 1)[1].split()[0] if stat else "?",
        "wchan": read("wchan"),
    }


def kill_tree(root: int, grace_s: float = 10.0) -> list[int]:
    """SIGKILL the tree until it is gone; returns the pids still alive after grace_s."""
    end = time.monotonic() + grace_s
    while (pids := tree(root)) and time.monotonic() < end:
        signal_all(pids, signal.SIGKILL)
        time.sleep(0.2)
    return tree(root)


def log_note(log: Path, text: str) -> None:
    with log.open("a") as f:
        f.write(f"\n===== [tp_startup] {text} =====\n")


def shell(cmd: list[str], timeout: float = 15.0) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{cmd[0]}: {exc}"
    return res.stdout + res.stderr


FRAME = re.compile(r'^\s*File "(.+)", line (\d+) in (.+)$')
THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+.*most recent call first")


def short_path(path: str) -> str:
    """Path below site-packages (or the stdlib folder)."""
    return re.sub(r"^.*/(site-packages|dist-packages|lib/python3\.\d+)/", "", path)


def parse_dump(text: str, depth: int = 8) -> list[dict[str, Any]]:
    """Faulthandler dump -> unique thread stacks (innermost first, ``depth`` frames) with counts."""
    stacks: list[list[str]] = []
    for line in text.splitlines():
        if THREAD.match(line):
            stacks.append([])
        elif stacks and (m := FRAME.match(line)) and len(stacks[-1]) < depth:
            stacks[-1].append(f"{short_path(m[1])}:{m[2]} {m[3]}")
    unique: dict[tuple[str, ...], int] = {}
    for stack in stacks:
        unique[tuple(stack)] = unique.get(tuple(stack), 0) + 1
    return [{"threads": n, "frames": list(s)} for s, n in unique.items()]


def dump_stacks(root: int, log: Path) -> list[dict[str, Any]]:
    """Freeze the tree, abort its processes one at a time, parse each one's faulthandler dump."""
    log_note(log, "nvidia-smi at the deadline")
    with log.open("a") as f:
        f.write(shell(["nvidia-smi"]))
    procs = [describe(pid) for pid in tree(root)]  # state and wchan while still running
    signal_all([p["pid"] for p in procs], signal.SIGSTOP)
    time.sleep(0.3)
    for info in procs:
        pid = info["pid"]
        log_note(log, f"SIGABRT pid {pid} ({info['cmdline']}) state {info['state']}")
        start = log.stat().st_size
        signal_all([pid], signal.SIGABRT)
        signal_all([pid], signal.SIGCONT)
        end = time.monotonic() + 3.0
        while alive(pid) and time.monotonic() < end:
            time.sleep(0.05)
        with log.open("rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        info["stacks"] = parse_dump(text)
    signal_all(tree(root), signal.SIGCONT)
    end = time.monotonic() + 5.0
    while tree(root) and time.monotonic() < end:
        time.sleep(0.2)
    return procs


# --- the driver (parent) --------------------------------------------------------------------


def gpu_snapshot() -> str:
    return shell(
        ["nvidia-smi", "--query-gpu=index,memory.used,memory.total,utilization.gpu",
         "--format=csv,noheader"]
    ) + shell(
        ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
         "--format=csv,noheader"]
    )


def read_markers(log: Path) -> dict[str, dict[str, Any]]:
    markers = {}
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(rf"{MARK} (\w+) (\{{.*\}})\s*$", line)
        if m:
            markers[m[1]] = json.loads(m[2])
    return markers


NOISE = re.compile(r"Waiting for \d+ local|Poller timed out")
"""vLLM's periodic DEBUG lines while it waits; they would fill the tail of a hung start."""


def tail(log: Path, n: int = 30, upto: int | None = None) -> list[str]:
    """The last n lines (the first upto bytes only, if given), without NOISE lines."""
    with log.open("rb") as f:
        data = f.read(upto)
    lines = data.decode(errors="replace").splitlines()
    return [line for line in lines if not NOISE.search(line)][-n:]


ERROR_LINE = re.compile(r"Error\b|Exception\b|CUBLAS_STATUS|illegal memory|Fatal Python error")


def error_lines(log: Path, upto: int | None, n: int = 20) -> list[str]:
    """The first n distinct non-DEBUG lines that name an error (in the first upto bytes)."""
    found: dict[str, None] = {}
    with log.open("rb") as f:
        data = f.read(upto)
    for line in data.decode(errors="replace").splitlines():
        if ERROR_LINE.search(line) and " DEBUG " not in line and len(found) < n:
            found[line.strip()[:300]] = None
    return list(found)


def run_one(name: str, model: Path, out: Path, deadline: float) -> dict[str, Any]:
    log = out / f"tp_{name}.log"
    log.unlink(missing_ok=True)
    spec = VARIANTS[name]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_LAUNCH_BLOCKING"}
    env.update(BASE_ENV)
    env.update(spec.env)
    cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--variant", name,
           "--model", str(model)]
    result: dict[str, Any] = {
        "env": spec.env,
        "kwargs": spec.kwargs,
        "deadline_s": round(deadline, 1),
        "gpus_before": gpu_snapshot(),
    }
    upto: int | None = None  # the log's size at the deadline, when it passed
    t0 = time.monotonic()
    with log.open("ab") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)),
        )
    try:
        while proc.poll() is None and time.monotonic() - t0 < deadline:
            time.sleep(0.5)
        timed_out = proc.poll() is None
        if timed_out:
            upto = log.stat().st_size
            result["processes"] = dump_stacks(proc.pid, log)
            result["tail_at_deadline"] = tail(log, upto=upto)
    finally:
        result["leftover"] = [describe(pid) for pid in kill_tree(proc.pid)]
        proc.wait()
    markers = read_markers(log)
    phase = next((p for p in ("done", "ready", "imported", "start") if p in markers), "none")
    if timed_out:
        status = "exit_hang" if phase == "done" else "timeout"
    else:
        status = "ok" if proc.returncode == 0 and phase == "done" else "error"
    result.update(
        status=status,
        phase=phase,
        returncode=proc.returncode,
        vllm=markers.get("imported", {}).get("vllm"),
        ready_s=markers.get("ready", {}).get("seconds"),
        total_s=round(time.monotonic() - t0, 1),
        tokens=markers.get("done", {}).get("tokens"),
        log_tail=tail(log),
        error_lines=error_lines(log, upto),
    )
    return result


def where(procs: list[dict[str, Any]]) -> list[str]:
    """Short lines for the table: each process and the innermost frames of its busy threads."""
    idle = ("threading.py", "selectors.py", "queue.py")
    lines = []
    for p in procs:
        tops = {s["frames"][0] for s in p["stacks"] if s["frames"]}
        busy = sorted(t for t in tops if not t.split(":")[0].endswith(idle)) or sorted(tops)
        lines.append(f"    {p['pid']} {p['cmdline'][:40]} [{p['state']}]: "
                     + ("; ".join(busy[:4]) or "no Python dump"))
    return lines


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'variant':<14}{'status':<11}{'phase':<10}{'ready_s':>9}{'total_s':>9}  tokens")
    for name, r in results.items():
        ready = r.get("ready_s")
        print(f"{name:<14}{r['status']:<11}{r.get('phase', ''):<10}"
              f"{'' if ready is None else f'{ready:.1f}':>9}{r.get('total_s', ''):>9}  "
              f"{r.get('tokens') or r.get('reason', '')}")
        for line in where(r.get("processes", [])):
            print(line)


def drive(args: argparse.Namespace) -> int:
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp_topo.txt").write_text(shell(["nvidia-smi", "topo", "-m"]) + gpu_snapshot())
    summary: dict[str, Any] = {
        "host_env": {k: os.environ.get(k) for k in HOST_ENV},
        "base_env": BASE_ENV,
        "engine_kwargs": ENGINE_KWARGS,
        "variants": {},
    }
    results: dict[str, dict[str, Any]] = summary["variants"]
    model = Path(tempfile.mkdtemp(prefix="tp_startup_model_"))
    (model / "config.json").write_text(json.dumps(LLAMA_1B, indent=1))
    start = time.monotonic()
    try:
        for name in names:
            left = args.budget - (time.monotonic() - start) - DUMP_RESERVE_S
            if left < MIN_DEADLINE_S:
                results[name] = {"status": "skipped", "reason": "budget"}
            else:
                print(f"[tp_startup] {name}: deadline {min(args.deadline, left):.0f} s",
                      flush=True)
                results[name] = run_one(name, model, out, min(args.deadline, left))
                print(f"[tp_startup] {name}: {results[name]['status']} "
                      f"({results[name]['total_s']} s)", flush=True)
            (out / "tp_startup.json").write_text(json.dumps(summary, indent=1))
    finally:
        shutil.rmtree(model, ignore_errors=True)
    print_table(results)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="output folder")
    parser.add_argument("--variants", default=DEFAULT_ORDER,
                        help=f"comma list, in order (known: {', '.join(VARIANTS)})")
    parser.add_argument("--deadline", type=float, default=100.0, help="seconds per variant")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all variants")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        run_variant(args.variant, args.model)
        return 0
    if not args.out:
        parser.error("OUT is required")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # cleanup runs on SIGTERM too
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
