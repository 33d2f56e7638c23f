"""Start-up and shutdown: readiness follows the real state, systemd hears about it, bad models fail fast."""

from __future__ import annotations

import gc
import json
import shutil
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from conftest import Server, free_port, run_tool
from vlserve.api.app import create_app
from vlserve.runtime.engine import Engine
from vlserve.settings import SETTINGS_MODELS, LimitSettings, ModelSettings, ServerSettings, Settings


class GatedEngine(Engine):
    """The real engine, held before loading until the test lets it go."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def load(self, status=lambda message: None):
        self.state = "loading"
        self.gate.wait(60)
        super().load(status)


def test_not_ready_until_loaded_and_warmed_up(tiny_model):
    settings = Settings(ServerSettings(port=free_port()), ModelSettings(model=tiny_model), LimitSettings())
    engine = GatedEngine(settings.model, settings.limits)
    app = create_app(settings, engine=engine)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.server.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = "http://127.0.0.1:%d" % settings.server.port
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                alive = httpx.get(url + "/healthz", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert alive.json() == {"status": "alive", "model_state": "loading"}
        not_ready = httpx.get(url + "/readyz")
        assert not_ready.status_code == 503 and not_ready.headers["Retry-After"] == "5"
        assert not_ready.json()["error"]["code"] == "not_ready"
        refused = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
        assert "vlserve_ready 0.0" in httpx.get(url + "/metrics").text
        engine.gate.set()
        deadline = time.monotonic() + 60
        while httpx.get(url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.05)
        assert engine.state == "ready"
        assert "vlserve_ready 1.0" in httpx.get(url + "/metrics").text
    finally:
        engine.gate.set()
        server.should_exit = True
        thread.join(30)
    assert engine.state == "stopped"


def test_systemd_hears_status_then_ready(tiny_model, tmp_path):
    path = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    listener.settimeout(120)
    server = Server(tiny_model, env={"NOTIFY_SOCKET": path})
    try:
        messages = []
        while not any(m.startswith("READY=1") for m in messages):
            messages.append(listener.recv(4096).decode())
        statuses = [m for m in messages if m.startswith("STATUS=")]
        assert any("loading" in m for m in statuses) and any("warming up" in m for m in statuses)
        assert "STATUS=ready: qwen3-vl-2b-instruct" in messages[-1]
        assert httpx.get(server.url + "/readyz", timeout=5).status_code == 200  # READY=1 means it can answer
    finally:
        server.stop()
        listener.close()


def test_a_missing_model_directory_fails_fast_with_a_message(tmp_path):
    started = time.monotonic()
    result = run_tool("vlserve", "serve", "--model", str(tmp_path / "nowhere"), "--port", str(free_port()), timeout=60)
    assert result.returncode == 1
    assert "does not exist" in result.stderr
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("damage", ["no config", "not qwen3_vl", "no weights", "corrupt weights"])
def test_a_broken_model_directory_stops_the_worker_with_its_reason(tiny_model, tmp_path, damage):
    broken = tmp_path / "model"
    shutil.copytree(tiny_model, broken)
    expected = {
        "no config": "has no config.json",
        "not qwen3_vl": "not qwen3_vl",
        "no weights": "no *.safetensors",
        "corrupt weights": "unreadable safetensors header",
    }[damage]
    if damage == "no config":
        (broken / "config.json").unlink()
    elif damage == "not qwen3_vl":
        config = json.loads((broken / "config.json").read_text())
        (broken / "config.json").write_text(json.dumps(dict(config, model_type="llama")))
    elif damage == "no weights":
        (broken / "model.safetensors").unlink()
    else:
        (broken / "model.safetensors").write_bytes(b"\0" * 1000)
    result = run_tool("vlserve", "serve", "--model", str(broken), "--port", str(free_port()), timeout=120)
    assert result.returncode == 1, result.stderr
    assert expected in result.stderr


def test_serve_help_lists_every_setting_with_its_variable():
    result = run_tool("vlserve", "serve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for model in SETTINGS_MODELS:
        for name in model.model_fields:
            assert "--" + name.replace("_", "-") in text, name
            assert "VLSERVE_" + name.upper() in text, name


def test_settings_come_from_the_environment_and_the_memory_guard_sheds_load(tiny_model):
    env = {
        "VLSERVE_SERVED_MODEL_NAME": "from-env",
        "VLSERVE_MAX_CONTEXT_TOKENS": "2048",
        "VLSERVE_MEMORY_LIMIT_BYTES": str(64 * 2**20),
    }  # below any worker's resident memory
    server = Server(tiny_model, env=env)
    try:
        server.wait_ready()
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert (card["id"], card["max_model_len"]) == ("from-env", 2048)
        shed = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert shed.status_code == 503 and shed.json()["error"]["code"] == "memory_pressure"
        assert int(shed.headers["Retry-After"]) > 0
    finally:
        server.stop()


def test_bad_settings_are_refused_with_the_field_name():
    result = run_tool("vlserve", "serve", "--max-pixels", "10", "--model", "/tmp")
    assert result.returncode == 2
    assert "max_pixels" in result.stderr


def test_the_start_collects_nothing_while_importing_and_collects_again_after_even_on_failure():
    from vlserve.cli.serve import _collecting_nothing  # noqa: PLC0415

    frozen = gc.get_freeze_count()
    try:
        with pytest.raises(ImportError), _collecting_nothing():
            assert not gc.isenabled()
            kept = [[] for _ in range(1000)]  # objects built while importing: frozen with the rest
            import vlserve_no_such_module  # noqa: F401, PLC0415
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(kept)
    finally:
        gc.unfreeze()
        gc.enable()
