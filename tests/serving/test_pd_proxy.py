"""The two-step P/D proxy (calibrate.serving.pd_proxy) against two fake servers: what it sends
to each, what it relays back. No vLLM, no sleeps beyond the sockets'."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from calibrate.serving import client
from calibrate.serving.pd_proxy import PdProxy

KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
      "remote_engine_id": "p0", "remote_request_id": "r0", "remote_host": "localhost", "remote_port": 5600}


class Fake:
    """A fake server that records each request's path and JSON body."""

    def __init__(self, role: str, prefill_status: int = 200) -> None:
        self.seen: list[tuple[str, str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                fake.seen.append(("GET", self.path, {}))
                body = json.dumps({"role": role}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.seen.append(("POST", self.path, body))
                if role == "prefill":
                    out = (json.dumps({"choices": [{"text": " w5"}], "kv_transfer_params": KV}).encode()
                           if prefill_status == 200 else b'{"error": {"message": "prompt too long"}}')
                    self.send_response(prefill_status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for k in range(1, body["max_tokens"] + 1):
                    event = {"choices": [{"text": f" w{k}"}], "usage": {"prompt_tokens": 3, "completion_tokens": k}}
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made: list[Fake] = []

    def make(prefill_status: int = 200) -> tuple[Fake, Fake]:
        made.extend([Fake("prefill", prefill_status), Fake("decode")])
        return made[-2], made[-1]
    yield make
    for f in made:
        f.close()


def test_two_steps_and_the_stream_relayed(servers) -> None:
    prefill, decode = servers()
    with PdProxy(prefill.url, decode.url) as proxy:
        res = client.run(client.stream_completion(proxy.url, "m", [5, 6, 7], 4))
        assert len(proxy.hops) == 1 and proxy.hops[0].prefill_status == 200
    assert res.error is None and res.num_output_tokens == 4 and len(res.token_times_s) == 4
    (method, path, first), = prefill.seen
    assert (method, path) == ("POST", "/v1/completions")
    # the prefill: one token, no stream, no min_tokens (4 > max_tokens 1 would be refused), a remote decode asked
    assert first["max_tokens"] == 1 and first["stream"] is False
    assert "min_tokens" not in first and "stream_options" not in first
    assert first["kv_transfer_params"]["do_remote_decode"] is True
    assert first["prompt"] == [5, 6, 7] and first["ignore_eos"] is True
    (_, _, second), = decode.seen
    # the decode: the client's own request, with the prefill's kv_transfer_params
    assert second["kv_transfer_params"] == KV
    assert second["max_tokens"] == 4 and second["min_tokens"] == 4 and second["stream"] is True


def test_other_requests_go_to_the_decode_server(servers) -> None:
    prefill, decode = servers()
    with PdProxy(prefill.url, decode.url) as proxy:
        with urllib.request.urlopen(proxy.url + "/v1/models", timeout=10) as resp:
            assert json.loads(resp.read()) == {"role": "decode"}
    assert decode.seen == [("GET", "/v1/models", {})] and prefill.seen == []


def test_a_prefill_refusal_comes_back_as_it_is(servers) -> None:
    prefill, decode = servers(prefill_status=400)
    with PdProxy(prefill.url, decode.url) as proxy:
        res = client.run(client.stream_completion(proxy.url, "m", [5, 6, 7], 4))
    assert res.error is not None and "HTTP 400" in res.error and "prompt too long" in res.error
    assert decode.seen == []


def test_bad_urls_are_refused() -> None:
    with pytest.raises(ValueError, match="plain HTTP"):
        PdProxy("https://example:1", "http://127.0.0.1:2")
