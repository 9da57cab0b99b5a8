"""`dynsteer serve` argument handling, without starting a server (the extra_body rewrite:
``test_middleware.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynsteer.engine_ext.server import cli as serve_cli
from dynsteer.engine_ext.server.cli import ServeError, prepare
from dynsteer.engine_ext.server.settings import ServerSettings


def _additional(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--additional-config") + 1])


def test_model_and_vllm_flags_pass_through(monkeypatch):
    env: dict[str, str] = {}
    argv = prepare(["/m", "--port", "9000", "--dynsteer-api-key=k", "--max-model-len", "64"],
                   env)
    assert argv[:2] == ["--model", "/m"]
    assert argv[2:8] == ["--port", "9000", "--max-model-len", "64", "--api-server-count", "1"]
    assert _additional(argv) == {"dynsteer": {}}
    assert env["DYNSTEER_API_KEY"] == "k"
    assert "dynsteer" in env["VLLM_PLUGINS"].split(",")


@pytest.mark.parametrize("given", [["--api-server-count", "1"], ["-asc=1"], ["--headless"]])
def test_one_api_server_unless_told_otherwise(given):
    """vLLM would start one API server per data-parallel rank; dynsteer's registry lives in
    the API server, so ``dynsteer serve`` asks for one, but passes a given count of one and
    headless nodes (no API server) through untouched."""
    argv = prepare(["/m", "--data-parallel-size", "2"], {})
    assert argv[argv.index("--api-server-count") + 1] == "1"
    argv = prepare(["/m", *given], {})
    assert argv.count("--api-server-count") == given.count("--api-server-count")


def test_no_model_serves_the_embedded_default(monkeypatch, tmp_path):
    monkeypatch.setattr("dynsteer.engine_ext.default_model.default_model_path", lambda: tmp_path)
    env: dict[str, str] = {}
    argv = prepare(["--port", "9000"], env)
    assert argv[:2] == ["--model", str(tmp_path)]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert argv[argv.index("--served-model-name") + 1] == serve_cli.DEFAULT_SERVED_NAME
    assert prepare(["--model", "/x"], {})[:2] == ["--model", "/x"]


def test_existing_plugin_allowlist_is_extended():
    env = {"VLLM_PLUGINS": "other"}
    prepare(["/m"], env)
    assert env["VLLM_PLUGINS"] == "other,dynsteer"


def test_additional_config_is_merged(tmp_path):
    argv = prepare(["/m", "--additional-config", '{"foo": 1}'], {})
    assert _additional(argv) == {"foo": 1, "dynsteer": {}}
    assert argv.count("--additional-config") == 1
    argv = prepare(["/m", '--additional-config={"dynsteer": {"max_rows": 4}}'], {})
    assert _additional(argv) == {"dynsteer": {"max_rows": 4}}


def test_config_file_yaml_and_json(tmp_path: Path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("engine:\n  sites: post_block@0-1\n  max_rows: 8\n"
                         "server:\n  max_body_bytes: 4096\n")
    env: dict[str, str] = {}
    argv = prepare(["/m", "--dynsteer-config", str(yaml_file)], env)
    assert _additional(argv)["dynsteer"] == {"sites": "post_block@0-1", "max_rows": 8}
    assert env["DYNSTEER_MAX_BODY_BYTES"] == "4096"
    json_file = tmp_path / "c.json"
    json_file.write_text(json.dumps({"engine": {"max_rows": 2}}))
    assert _additional(prepare(["/m", "--dynsteer-config", str(json_file)], {})) == {
        "dynsteer": {"max_rows": 2}}


@pytest.mark.parametrize("argv,message", [
    (["/m", "--dynsteer-api-key"], "--dynsteer-api-key: expects a value"),
    (["/m", "--dynsteer-max-body-bytes", "12"], "DYNSTEER_MAX_BODY_BYTES"),
    (["/m", "--dynsteer-config", "/nonexistent.yaml"], "cannot read"),
    (["/m", "--additional-config", "{x"], "--additional-config: not valid JSON"),
    (["/m", "--api-server-count", "2"], r"--api-server-count 2: --api-server-count > 1 is not"),
    (["/m", "-asc=3"], r"-asc 3: --api-server-count > 1 is not supported"),
])
def test_bad_arguments_name_the_flag(argv, message):
    with pytest.raises(ServeError, match=message):
        prepare(argv, {})


def test_bad_config_file_names_the_field(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"engine": {"max_rows": 0}}))
    with pytest.raises(ServeError, match=r"engine.max_rows"):
        prepare(["/m", "--dynsteer-config", str(bad)], {})
    both = tmp_path / "ok.json"
    both.write_text(json.dumps({"engine": {"max_rows": 3}}))
    with pytest.raises(ServeError, match="give them once"):
        prepare(["/m", "--dynsteer-config", str(both),
                 "--additional-config", '{"dynsteer": {}}'], {})


def test_cli_reports_bad_arguments(capsys):
    from dynsteer.engine_ext.cli import main

    assert main(["serve", "/m", "--dynsteer-api-key"]) == 2
    assert "dynsteer serve: error: --dynsteer-api-key" in capsys.readouterr().err


def test_settings_from_env():
    s = ServerSettings.from_env({"DYNSTEER_API_KEY": "k", "DYNSTEER_PROBE_STORE": "/tmp/p"})
    assert s.api_key == "k" and str(s.probe_store) == "/tmp/p"
    with pytest.raises(ValueError, match="DYNSTEER_MAX_BODY_BYTES"):
        ServerSettings.from_env({"DYNSTEER_MAX_BODY_BYTES": "lots"})
