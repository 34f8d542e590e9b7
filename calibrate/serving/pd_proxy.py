"""A two-step proxy in front of a vLLM prefill server and a vLLM decode server (NixlConnector).

It does what batchsim's disaggregation models (``sim.loop.handoff``) for each
``POST /v1/completions``:

1. it sends the request to the prefill server with ``max_tokens`` 1, no streaming and
   ``kv_transfer_params`` asking for a remote decode (``do_remote_decode``); the prefill
   server computes the prompt, samples one token (dropped here) and keeps the KV blocks,
   answering with the ``kv_transfer_params`` that name them;
2. it sends the original request, with those ``kv_transfer_params``, to the decode server,
   which reads the KV from the prefill server (NIXL) and streams the output, relayed to the
   client byte for byte.

Any other request (``GET /v1/models``, ``/metrics``, ``/server_info``, ``/health``...) is
relayed to the decode server, so ``client.server_info`` on the proxy describes the decode
side. A prefill answer other than 200 is returned to the client as it came. The standard
library only (asyncio), in a thread of its own: ``PdProxy(prefill_url, decode_url)`` as a
context manager; ``hops`` records each completion's times (``Hop``).

CLI: ``python -m calibrate.serving.pd_proxy --prefill URL --decode URL [--port N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from calibrate.serving.client import _body_pieces, _read_head
from calibrate.serving.launch import free_port

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
HOP_HEADERS = ("host", "connection", "content-length", "transfer-encoding", "keep-alive")


@dataclass
class Hop:
    """One completion through the proxy, ``time.perf_counter()`` seconds: received from the
    client, prefill answer in, decode request sent; ``prefill_status`` the prefill's HTTP status."""

    received_s: float
    prefill_done_s: float
    decode_sent_s: float | None
    prefill_status: int


def _endpoint(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the proxy speaks plain HTTP: a server URL must be http://host[:port][/prefix], "
                         f"got {url!r}")
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


def _request(method: str, path: str, host: str, port: int, headers: dict[str, str], body: bytes) -> bytes:
    kept = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k not in HOP_HEADERS)
    return (f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{kept}Content-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode("latin-1") + body


class PdProxy:
    """The proxy on ``host:port`` (a free port if None), started by ``start()`` or entering the
    context, stopped by ``stop()``; ``url`` is its root."""

    def __init__(self, prefill_url: str, decode_url: str, *, host: str = "127.0.0.1",
                 port: int | None = None, timeout_s: float = 600.0) -> None:
        self.prefill = _endpoint(prefill_url)
        self.decode = _endpoint(decode_url)
        self.host, self.port = host, port if port is not None else free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.timeout_s = timeout_s
        self.hops: list[Hop] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> PdProxy:
        if self._thread is not None:
            raise RuntimeError("proxy already started")
        ready = threading.Event()
        failed: list[BaseException] = []

        def serve() -> None:
            async def main() -> None:
                self._stopped = asyncio.Event()
                try:
                    server = await asyncio.start_server(self._handle, self.host, self.port)
                except OSError as exc:
                    failed.append(exc)
                    ready.set()
                    return
                ready.set()
                async with server:
                    await self._stopped.wait()
                    # connections still open (a relay's tail) end here, while the loop runs
                    for task in list(self._handlers):
                        task.cancel()
                    await asyncio.gather(*self._handlers, return_exceptions=True)
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(main())
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=serve, name="pd-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            self._thread.join()
            self._thread = None
            raise OSError(f"the proxy could not listen on {self.host}:{self.port}: {failed[0]}")
        return self

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._loop is not None and self._stopped is not None:
            with contextlib.suppress(RuntimeError):        # the loop already closed
                self._loop.call_soon_threadsafe(self._stopped.set)
        thread.join()

    def __enter__(self) -> PdProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ---- one client connection -----------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            await asyncio.wait_for(self._serve_one(reader, writer), self.timeout_s)
        except Exception as exc:  # a client or server that broke off: answer if still possible
            with contextlib.suppress(Exception):
                body = json.dumps({"error": {"message": f"proxy: {type(exc).__name__}: {exc}"}}).encode()
                writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: application/json\r\n"
                             + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
                await writer.drain()
        finally:
            if task is not None:
                self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = (await reader.readuntil(b"\r\n")).decode("latin-1").split()
        if len(line) < 3:
            raise ValueError(f"not an HTTP request line: {' '.join(line)!r}")
        method, target = line[0], line[1]
        headers: dict[str, str] = {}
        while (row := (await reader.readuntil(b"\r\n")).decode("latin-1").strip()):
            name, _, value = row.partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
        if method == "POST" and target.rstrip("/").endswith("/v1/completions"):
            await self._completion(headers, body, writer)
        else:
            await self._relay(self.decode, method, target, headers, body, writer)

    async def _completion(self, headers: dict[str, str], body: bytes, writer: asyncio.StreamWriter) -> None:
        received = time.perf_counter()
        request: dict[str, Any] = json.loads(body)
        first = {k: v for k, v in request.items() if k not in ("stream", "stream_options", "min_tokens")}
        first.update(max_tokens=1, stream=False, kv_transfer_params=dict(REMOTE_DECODE))
        host, port, prefix = self.prefill
        status, head, answer = await self._fetch(self.prefill, _request(
            "POST", prefix + "/v1/completions", host, port, {"content-type": "application/json"},
            json.dumps(first).encode()))
        done = time.perf_counter()
        if status != 200:
            self.hops.append(Hop(received, done, None, status))
            writer.write(head + answer)
            await writer.drain()
            return
        params = json.loads(answer).get("kv_transfer_params")
        hop = Hop(received, done, None, status)
        self.hops.append(hop)
        hop.decode_sent_s = time.perf_counter()
        await self._relay(self.decode, "POST", "/v1/completions", headers,
                          json.dumps({**request, "kv_transfer_params": params}).encode(), writer)

    async def _fetch(self, endpoint: tuple[str, int, str], raw: bytes) -> tuple[int, bytes, bytes]:
        """(status, the head to return as is with a Content-Length, the whole body)."""
        host, port, _ = endpoint
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(raw)
            await writer.drain()
            status, headers = await _read_head(reader)
            chunked = "chunked" in headers.get("transfer-encoding", "").lower()
            body = b"".join([piece async for piece in _body_pieces(reader, headers, chunked)])
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        kept = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k not in HOP_HEADERS)
        head = f"HTTP/1.1 {status} -\r\n{kept}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        return status, head.encode("latin-1"), body

    async def _relay(self, endpoint: tuple[str, int, str], method: str, target: str, headers: dict[str, str],
                     body: bytes, writer: asyncio.StreamWriter) -> None:
        """Send the request to ``endpoint`` and copy its answer to the client as it arrives."""
        host, port, prefix = endpoint
        up_reader, up_writer = await asyncio.open_connection(host, port)
        try:
            up_writer.write(_request(method, prefix + target, host, port, headers, body))
            await up_writer.drain()
            while piece := await up_reader.read(65536):
                writer.write(piece)
                await writer.drain()
        finally:
            up_writer.close()
            with contextlib.suppress(OSError):
                await up_writer.wait_closed()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m calibrate.serving.pd_proxy",
                                     description="Serve a prefill and a decode vLLM server as one (NixlConnector).")
    parser.add_argument("--prefill", required=True, help="the prefill server, http://host:port")
    parser.add_argument("--decode", required=True, help="the decode server, http://host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    try:
        proxy = PdProxy(args.prefill, args.decode, host=args.host, port=args.port)
    except ValueError as exc:
        parser.error(str(exc))
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with proxy:
            print(proxy.url, flush=True)
            while True:
                time.sleep(1.0)
    except OSError as exc:
        print(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
