"""The HF server when clients leave and when it is stopped: a request nobody waits for stops generating, and a
shutdown ends the requests still running (503, or an error event in a stream) and the engine's thread, without a
traceback or an abort, however it is signalled."""

import json
import signal
import socket
import sys
import threading
import time

import httpx
import pytest

from helpers import cli_env, dies_with_parent
from serve_common import MODEL
from steer.procgroup import free_port, started

LONG = {"model": MODEL, "prompt": ["Once upon a time"] * 16, "max_tokens": 200, "temperature": 0}


def _server(cache_dir, run_dir):
    port = free_port()
    cmd = [sys.executable, "-m", "steer.serve", "engine=hf", "model=tiny", f"serve.port={port}", "serve.log_level=info",
           f"serve.model_name={MODEL}", f"hydra.run.dir={run_dir}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    return started(cmd, port, run_dir / "server.log", env=cli_env(cache_dir), cwd=run_dir,
                   preexec_fn=dies_with_parent())


def _wait_for(what, seconds: float = 300):
    """Until `what()` holds; generous, so that only a server that never gets there fails, not a slow machine."""
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, f"not within {seconds} s"
        time.sleep(0.05)


def _generations(url) -> int:
    return httpx.get(f"{url}/health", timeout=60).json()["generations"]


def test_a_request_whose_client_left_stops_generating(cache_dir, tiny_spec, tmp_path):
    with _server(cache_dir, tmp_path) as (url, proc):
        # The client sends a request of 64 prompts (far more work than the test waits for), sees it generating,
        # and leaves without reading the answer.
        body = json.dumps({**LONG, "prompt": LONG["prompt"] * 4}).encode()
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            _wait_for(lambda: _generations(url) == 1)
        log = tmp_path / "server.log"
        _wait_for(lambda: "generation stopped" in log.read_text())
        short = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, timeout=300)
        assert short.status_code == 200 and len(short.json()["choices"]) == 1
        assert httpx.get(f"{url}/health", timeout=60).json() == {"status": "ok", "generations": 0}
        text = log.read_text()
    [gone] = [line for line in text.splitlines() if "client gone:" in line]
    rid = gone.split("client gone: ")[1].split()[0]
    [stopped] = [line for line in text.splitlines() if "generation stopped" in line]
    assert f"{rid}#" in stopped and int(stopped.split("after ")[1].split()[0]) < 200, stopped
    cut = int(stopped.split(f"{rid}#")[1].split(":")[0])  # the prompt it was on
    assert cut < 63 and f"{rid}#{cut + 1}" not in text  # the request's later prompts never started


@pytest.mark.parametrize("signals", [[signal.SIGINT], [signal.SIGTERM], [signal.SIGINT, signal.SIGINT]],
                         ids=["ctrl-c", "sigterm", "ctrl-c-twice"])
def test_shutdown_ends_the_requests_running_and_the_engine_thread(cache_dir, tiny_spec, tmp_path, signals):
    got = {"stream": []}
    with _server(cache_dir, tmp_path) as (url, proc):
        def stream():
            with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=300) as r:
                for line in r.iter_lines():
                    got["stream"] += [line] if line else []

        def whole():
            got["whole"] = httpx.post(f"{url}/v1/completions", json=LONG, timeout=300)

        clients = [threading.Thread(target=stream), threading.Thread(target=whole)]
        clients[0].start()
        _wait_for(lambda: got["stream"])
        clients[1].start()
        # Both taken: the stream generating, the other waiting for the engine
        _wait_for(lambda: _generations(url) == 2)
        proc.send_signal(signals[0])
        for c in clients:  # the shutdown answers both
            c.join(300)
            assert not c.is_alive(), "a client got no answer from the shutdown"
        for sig in signals[1:]:  # a second Ctrl-C while the first one's shutdown is under way, or done
            proc.send_signal(sig)
        proc.wait(300)
        log = (tmp_path / "server.log").read_text()
    stream_lines = got["stream"]
    assert stream_lines[-1] == "data: [DONE]"
    error = json.loads(stream_lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and len(stream_lines) > 3  # it had sent text before
    assert got["whole"].status_code == 503
    assert got["whole"].json()["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in log and "terminate called" not in log, log[-3000:]
    stopped = "the engine's thread has stopped" in log  # SIGTERM too, before it ends the process
    if len(signals) == 2:  # a second Ctrl-C may come while the thread is in a step: the process leaves it
        assert stopped or "exiting without it (130)" in log, log[-3000:]
    else:
        assert stopped, log[-3000:]
    # Ctrl-C: 130, as every steer command; SIGTERM: its default action (uvicorn raises it again once shut down)
    assert proc.returncode == (-signal.SIGTERM if signals == [signal.SIGTERM] else 130), log[-3000:]
