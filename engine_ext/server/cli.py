"""`dynsteer serve [MODEL] [vllm serve flags] [--dynsteer-* flags]`: vLLM's server, steered.

Runs vLLM's own OpenAI-compatible server in this process with the plugin enabled and the
dynsteer routes mounted on the same app and port (vLLM's endpoint-plugin hook). Every flag that
is not a ``--dynsteer-*`` flag goes to vLLM untouched, so the server binds, authenticates and
logs exactly as ``vllm serve`` would. Without MODEL (and without ``--model``) it serves the
embedded default model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib.metadata import distributions
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ..options import CONFIG_KEY, EngineOptions
from ..parent_watch import ENV as EXIT_WITH_PARENT_ENV
from ..zmq_security import CLIENT_KEYS_ENV, SERVER_KEY_ENV
from .settings import (
    API_KEY_ENV,
    CAPTURE_SINKS_ENV,
    MAX_BODY_ENV,
    MAX_REQUEST_ENV,
    PROBE_STORE_ENV,
    ServerSettings,
)

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
_OURS = {  # flag -> environment variable read by the server (ServerSettings)
    "--dynsteer-api-key": API_KEY_ENV,
    "--dynsteer-max-body-bytes": MAX_BODY_ENV,
    "--dynsteer-max-request-bytes": MAX_REQUEST_ENV,
    "--dynsteer-probe-store": PROBE_STORE_ENV,
    "--dynsteer-capture-sinks": CAPTURE_SINKS_ENV,
    "--dynsteer-zmq-server-key": SERVER_KEY_ENV,
    "--dynsteer-zmq-client-keys": CLIENT_KEYS_ENV,
}
_ENGINE_FLAGS = {  # flag -> engine option
    "--dynsteer-events": "events_address",
    "--dynsteer-events-every": "events_every",
    "--dynsteer-commands": "commands_address",
}
_CONFIG_FLAG = "--dynsteer-config"


class ServeError(ValueError):
    """Bad `dynsteer serve` arguments; the message names the flag."""


class ConfigFile(BaseModel):
    """A ``--dynsteer-config`` file: engine options, plus an optional ``server`` section."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineOptions = EngineOptions()
    server: ServerSettings = ServerSettings()


def add_serve_command(commands: argparse._SubParsersAction) -> None:
    """List `dynsteer serve` in the help; `cli.main` hands its arguments to :func:`run_serve`
    unparsed, since they are mostly vLLM's."""
    commands.add_parser(
        "serve", add_help=False,
        help="vLLM's OpenAI-compatible server with dynsteer routes (all vllm serve flags work)")


def help_text() -> str:
    return f"""usage: dynsteer serve [MODEL] [vllm serve flags] [dynsteer flags]

Starts vLLM's OpenAI-compatible server with the dynsteer plugin enabled and its routes under
/v1/dynsteer/ on the same port. MODEL defaults to the embedded SmolLM2-135M-Instruct.
Every flag of `vllm serve` works (--host, --port, --api-key, --max-model-len, ...).

dynsteer flags:
  {_CONFIG_FLAG} FILE     YAML or JSON: {{"engine": {{sites, max_rows, ...}},
                             "server": {{api_key, max_body_bytes, max_request_bytes,
                                         probe_store, capture_sinks}}}}
  --dynsteer-api-key KEY     key required by mutating dynsteer routes (vLLM's --api-key
                             also works, and then guards every /v1 route)
  --dynsteer-max-body-bytes N  largest body a dynsteer route accepts (default 16 MiB)
  --dynsteer-max-request-bytes N  largest body of any other POST/PUT/PATCH, vLLM's
                             completion routes included (default 32 MiB; HTTP 413 above)
  --dynsteer-probe-store DIR   folder where uploaded probes persist across restarts
  --dynsteer-capture-sinks NAME=DIR[,NAME=DIR]  capture sinks a request's capture.sink
                             names (a folder of safetensors shards; NAME=@plugin:ARG for
                             one of the dynsteer.capture_sinks entry points)
  --dynsteer-events ADDR     publish controller events (ZeroMQ PUB), e.g.
                             tcp://127.0.0.1:5557 (loopback unless CURVE keys are set)
  --dynsteer-events-every N  engine steps per monitor-summary event (default 16)
  --dynsteer-commands ADDR   take controller commands (ZeroMQ ROUTER), e.g.
                             tcp://127.0.0.1:5558
  --dynsteer-zmq-server-key FILE   the sockets' CURVE secret certificate
                             (zmq.auth.create_certificates); requires CURVE of every client
  --dynsteer-zmq-client-keys DIR   public certificates of the clients allowed in
  -h, --help                 this help, then vLLM's
"""


def split_args(argv: list[str]) -> tuple[str | None, dict[str, str], list[str]]:
    """(MODEL or None, our flags by name, the rest for vLLM)."""
    model = None
    if argv and not argv[0].startswith("-"):
        model, argv = argv[0], argv[1:]
    ours: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in _OURS or flag in _ENGINE_FLAGS or flag == _CONFIG_FLAG:
            if not eq:
                if i + 1 >= len(argv):
                    raise ServeError(f"{flag}: expects a value")
                value = argv[i + 1]
                i += 1
            ours[flag] = value
        else:
            rest.append(argv[i])
        i += 1
    return model, ours, rest


def load_config(path: str) -> ConfigFile:
    """Parse a ``--dynsteer-config`` file; errors name the file and the field."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as e:
        raise ServeError(f"{_CONFIG_FLAG}: cannot read {path}: {e}") from e
    try:
        if file.suffix in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text) or {}
        else:
            raw = json.loads(text)
    except ValueError as e:  # json.JSONDecodeError and yaml.YAMLError both are
        raise ServeError(f"{_CONFIG_FLAG}: {path} is not valid: {e}") from e
    try:
        return ConfigFile.model_validate(raw)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ServeError(f"{_CONFIG_FLAG}: {path}: {field}: {first['msg']}") from e


def _option_value(rest: list[str], flag: str) -> tuple[int, str] | None:
    """Index and value of a vLLM flag given as ``--flag v`` or ``--flag=v``."""
    for i, arg in enumerate(rest):
        name, eq, value = arg.partition("=")
        if name == flag:
            if eq:
                return i, value
            if i + 1 < len(rest):
                return i, rest[i + 1]
    return None


def _with_additional_config(rest: list[str], engine: dict[str, Any]) -> list[str]:
    """``rest`` with ``engine`` merged into ``--additional-config`` under our key."""
    found = _option_value(rest, "--additional-config")
    additional: dict[str, Any] = {}
    if found is not None:
        i, text = found
        try:
            additional = json.loads(text)
        except ValueError as e:
            raise ServeError(f"--additional-config: not valid JSON: {e}") from e
        if not isinstance(additional, dict):
            raise ServeError("--additional-config: expected a JSON object")
        rest = rest[:i] + rest[i + (1 if "=" in rest[i] else 2):]
    own = additional.get(CONFIG_KEY)
    if own is not None and engine:
        raise ServeError(f"--additional-config.{CONFIG_KEY} and {_CONFIG_FLAG} both give the "
                         "engine options; give them once")
    additional[CONFIG_KEY] = own if own is not None else engine
    return [*rest, "--additional-config", json.dumps(additional)]


def plugin_allowlist(current: str | None) -> str:
    """``VLLM_PLUGINS`` with dynsteer added; unset means "every installed plugin" to vLLM, so
    that set is spelled out (endpoint plugins excepted, which vLLM never loads unasked)."""
    if current is not None:
        names = [n.strip() for n in current.split(",") if n.strip()]
    else:
        names = sorted({ep.name for dist in distributions() for ep in dist.entry_points
                        if ep.group.startswith("vllm.") and ep.group != "vllm.endpoint_plugins"})
    return ",".join(dict.fromkeys([*names, "dynsteer"]))


def prepare(argv: list[str], environ: dict[str, str]) -> list[str]:
    """vLLM's argv for ``argv``; sets the server's environment in ``environ``."""
    model, ours, rest = split_args(argv)
    config = load_config(ours[_CONFIG_FLAG]) if _CONFIG_FLAG in ours else ConfigFile()
    settings = config.server.model_dump(exclude_defaults=True)
    for key, env in (("api_key", API_KEY_ENV), ("max_body_bytes", MAX_BODY_ENV),
                     ("max_request_bytes", MAX_REQUEST_ENV), ("probe_store", PROBE_STORE_ENV)):
        if key in settings:
            environ[env] = str(settings[key])
    if "capture_sinks" in settings:
        environ[CAPTURE_SINKS_ENV] = ",".join(f"{k}={v}"
                                              for k, v in settings["capture_sinks"].items())
    for flag, env in _OURS.items():
        if flag in ours:
            environ[env] = ours[flag]
    try:
        ServerSettings.from_env(environ)
    except ValueError as e:
        raise ServeError(str(e)) from e
    if model is None and _option_value(rest, "--model") is None:
        from ..default_model import default_model_path

        model = str(default_model_path())
        # A 135M model: on the CPU build a 2 GiB KV cache, not 92% of the host's memory
        # (the variable is ignored on GPUs).
        environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        if _option_value(rest, "--served-model-name") is None:
            rest = [*rest, "--served-model-name", DEFAULT_SERVED_NAME]
    if model is not None:
        rest = ["--model", model, *rest]
    engine = config.engine.model_dump(exclude_defaults=True) if _CONFIG_FLAG in ours else {}
    flags = {option: ours[flag] for flag, option in _ENGINE_FLAGS.items() if flag in ours}
    if flags:
        try:
            engine = EngineOptions.model_validate({**engine, **flags}).model_dump(
                exclude_defaults=True)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            flag = next((f for f, o in _ENGINE_FLAGS.items() if o == first["loc"][0]),
                        _CONFIG_FLAG)
            raise ServeError(f"{flag}: {first['msg']}") from e
    for flag in ("-asc", "--api-server-count"):
        found = _option_value(rest, flag)
        if found is not None and found[1].strip() not in ("0", "1"):
            raise ServeError(
                f"{flag} {found[1]}: --api-server-count > 1 is not supported (each API server "
                "process would keep its own registry and prefix-cache fingerprints); use 1")
    if not any(a.partition("=")[0] in ("-asc", "--api-server-count", "--headless")
               for a in rest):
        # vLLM starts one API server per local data-parallel rank unless told otherwise; the
        # registry and prefix-cache fingerprints live in the API server, so there is one
        # (a headless node runs engines only).
        rest = [*rest, "--api-server-count", "1"]
    environ["VLLM_PLUGINS"] = plugin_allowlist(environ.get("VLLM_PLUGINS"))
    # EngineCore and workers exit when this process dies, even by kill -9 (parent_watch).
    environ.setdefault(EXIT_WITH_PARENT_ENV, "1")
    return _with_additional_config(rest, engine)


def run_serve(argv: list[str]) -> int:
    """`dynsteer serve ARGV...`; returns the exit code once the server stops."""
    from ..compat.server import run_api_server

    if any(a in ("-h", "--help") for a in argv):
        print(help_text(), flush=True)
        run_api_server(["--help"])
        return 0
    try:
        vllm_argv = prepare(argv, os.environ)  # type: ignore[arg-type]
    except ServeError as e:
        print(f"dynsteer serve: error: {e}", file=sys.stderr)
        return 2
    run_api_server(vllm_argv)
    return 0
