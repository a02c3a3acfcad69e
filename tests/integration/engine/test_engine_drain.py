"""SIGTERM drains: a pod being deleted finishes the requests it accepted (within its grace period)
and refuses new connections, so the router retries them elsewhere."""
from __future__ import annotations

import json
import signal
import socket
import time
import urllib.request

import procs


def test_sigterm_finishes_in_flight_streams_then_exits_zero(demo_model, engine_logs):
    eng = procs.start_engine(demo_model, engine_logs, "--num-blocks", "128", "--drain-timeout", "30", name="drain")
    try:
        body = json.dumps({"model": "drain", "prompt": "int main() {", "max_tokens": 160, "ignore_eos": True, "stream_options": {"include_usage": True},
                           "stream": True}).encode()
        req = urllib.request.Request(eng.url + "/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            first = resp.readline()
            assert first.startswith(b"data: "), first
            t_term = time.monotonic()
            eng.proc.popen.send_signal(signal.SIGTERM)
            # The listener closes at once: new connections are refused while the stream goes on.
            deadline = time.monotonic() + 10
            refused = False
            while time.monotonic() < deadline and not refused:
                try:
                    socket.create_connection((eng.host, eng.port), timeout=1).close()
                    time.sleep(0.1)
                except OSError:
                    refused = True
            rest = resp.read().decode()
        events = [json.loads(line[6:]) for line in (first.decode() + rest).splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert rest.rstrip().endswith("data: [DONE]"), rest[-300:]
        assert refused, "the engine kept accepting connections after SIGTERM"
        assert [e for e in events if e["choices"]][-1]["choices"][0]["finish_reason"] == "length"
        usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
        assert usage["completion_tokens"] == 160
        code = eng.proc.popen.wait(30)
        assert code == 0, eng.proc.tail()
        assert "draining" in eng.proc.tail(), eng.proc.tail()
        assert time.monotonic() - t_term < 30
    finally:
        eng.stop()
