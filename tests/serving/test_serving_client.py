"""The streaming client against a fake OpenAI-compatible SSE server (stdlib asyncio)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from calibrate.serving.client import metric_totals, prompt_ids, replay, run, server_info, stream_completion
from calibrate.serving.launch import free_port

GROUPS = (1, 3, 2)  # tokens per event in the "ok" stream, cycled
GAP_S = 0.003       # pause between events, so separate events get distinct times
METRICS = (
    '# TYPE vllm:cache_config_info gauge\n'
    'vllm:cache_config_info{block_size="128",enable_prefix_caching="False",engine="0",'
    'num_gpu_blocks="2048",num_cpu_blocks="None",sliding_window="None"} 1.0\n'
    'vllm:num_requests_running{engine="0"} 0.0\n'
    '# TYPE vllm:prefix_cache_hits_total counter\n'
    'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 256.0\n'
    'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 128.0\n'
    'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09\n')


def _event(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\r\n\r\n".encode()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _choice(k: int, token_ids: bool = False) -> dict[str, object]:
    return {"index": 0, "text": " w7" * k, "finish_reason": None,
            "token_ids": [7] * k if token_ids else None}


class FakeServer:
    """An HTTP/1.1 server on a background event loop; the request's model picks the behaviour."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, object]] = []
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(5)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _shutdown(self) -> None:
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        method, path = head.split(" ")[:2]
        length = next((int(line.split(":")[1]) for line in head.split("\r\n")
                       if line.lower().startswith("content-length:")), 0)
        body = json.loads(await reader.readexactly(length)) if length else {}
        try:
            if method == "GET":
                await self._get(path, writer)
            else:
                self.bodies.append(body)
                await getattr(self, "_" + str(body["model"]))(body, writer)
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _get(self, path: str, writer: asyncio.StreamWriter) -> None:
        answers = {"/v1/models": json.dumps({"data": [{"id": "fake", "max_model_len": 4096}]}),
                   "/metrics": METRICS}
        if path not in answers:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return
        data = answers[path].encode()
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)

    async def _start_stream(self, writer: asyncio.StreamWriter, chunked: bool = True) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n" +
                     (b"Transfer-Encoding: chunked\r\n\r\n" if chunked else b"\r\n"))
        await writer.drain()

    async def _ok(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        """Continuous usage stats, GROUPS tokens per event; event 1 split over two chunks,
        events 3 and 4 packed into one chunk, CRLF line endings."""
        await self._start_stream(writer)
        n, sent, i = int(body["max_tokens"]), 0, 0
        pending = b""
        while sent < n:
            k = min(GROUPS[i % len(GROUPS)], n - sent)
            sent += k
            event = _event({"choices": [_choice(k)], "usage": {
                "prompt_tokens": len(body["prompt"]), "completion_tokens": sent}})
            if i == 1:
                writer.write(_chunk(event[:20]))
                await writer.drain()
                await asyncio.sleep(GAP_S)
                writer.write(_chunk(event[20:]))
            elif i == 3:
                pending = event
                i += 1
                continue
            else:
                writer.write(_chunk(pending + event))
                pending = b""
            await writer.drain()
            await asyncio.sleep(GAP_S)
            i += 1
        final = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
        writer.write(_chunk(pending + _event(final) + b"data: [DONE]\r\n\r\n") + _chunk(b""))
        await writer.drain()

    async def _ids(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        """No continuous usage: token_ids carry the count; final usage only; no chunking."""
        await self._start_stream(writer, chunked=False)
        n, sent = int(body["max_tokens"]), 0
        while sent < n:
            k = min(2, n - sent)
            sent += k
            writer.write(_event({"choices": [_choice(k, token_ids=True)]}))
            await asyncio.sleep(GAP_S)
        writer.write(_event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}))
        writer.write(b"data: [DONE]\n\n")

    async def _next(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        """Continuous usage, one token an event, with token_ids (asked or not): output token j
        is the prompt's last id + 1 + j, so a follow-up prompt shows which reply it holds."""
        await self._start_stream(writer)
        n, last = int(body["max_tokens"]), int(body["prompt"][-1])
        for j in range(n):
            writer.write(_chunk(_event({"choices": [{"index": 0, "text": "x", "token_ids": [last + 1 + j]}],
                                        "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": j + 1}})))
            await writer.drain()
            await asyncio.sleep(GAP_S)
        writer.write(_chunk(b"data: [DONE]\r\n\r\n") + _chunk(b""))
        await writer.drain()

    async def _bad(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        data = json.dumps({"error": {"message": "max_tokens is too large", "code": 400}}).encode()
        writer.write(f"HTTP/1.1 400 Bad Request\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)

    async def _cut(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await self._start_stream(writer)
        writer.write(_chunk(_event({"choices": [_choice(1)], "usage": {"completion_tokens": 1}})))

    async def _boom(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await self._start_stream(writer)
        writer.write(_chunk(_event({"choices": [_choice(1)], "usage": {"completion_tokens": 1}})))
        writer.write(_chunk(_event({"error": {"message": "engine died"}})))

    async def _hang(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await self._start_stream(writer)
        await asyncio.sleep(30)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.close()


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 32])
def test_exact_token_count_and_monotone_times(fake: FakeServer, max_tokens: int) -> None:
    prompt = [5, 6, 7, 8]
    res = run(stream_completion(fake.url, "ok", prompt, max_tokens, index=3))
    assert res.error is None
    assert (res.index, res.num_prompt_tokens, res.num_output_tokens) == (3, 4, max_tokens)
    assert len(res.token_times_s) == max_tokens
    assert res.send_s <= res.token_times_s[0]
    assert all(a <= b for a, b in zip(res.token_times_s, res.token_times_s[1:]))
    # tokens of one event share a time, each chunk has its own; events 3 and 4 share a chunk
    num_events, sent = 0, 0
    while sent < max_tokens:
        sent += GROUPS[num_events % len(GROUPS)]
        num_events += 1
    # A client the machine left waiting longer than GAP_S reads two chunks at once and stamps them
    # alike: the count of distinct times can only fall under load, so the best of three tries
    # must reach it (a client that stamped chunks alike would never).
    distinct = len(set(res.token_times_s))
    for _ in range(2):
        if distinct == num_events - (num_events >= 5):
            break
        distinct = max(distinct, len(set(run(stream_completion(fake.url, "ok", prompt, max_tokens)).token_times_s)))
    assert distinct == num_events - (num_events >= 5)


def test_request_body_asks_for_a_forced_greedy_stream(fake: FakeServer) -> None:
    run(stream_completion(fake.url, "ok", [1, 2, 3], 4))
    body = fake.bodies[-1]
    assert body == {"model": "ok", "prompt": [1, 2, 3], "max_tokens": 4, "min_tokens": 4,
                    "ignore_eos": True, "stream": True, "temperature": 0,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def test_counts_token_ids_without_continuous_usage(fake: FakeServer) -> None:
    res = run(stream_completion(fake.url, "ids", [1, 2, 3], 9))
    assert res.error is None
    assert res.num_output_tokens == len(res.token_times_s) == 9
    # 5 events (2, 2, 2, 2, 1 tokens), each its own time, unless the machine made the client read
    # two at once: the best of three tries (see test_exact_token_count_and_monotone_times).
    distinct = len(set(res.token_times_s))
    for _ in range(2):
        if distinct == 5:
            break
        distinct = max(distinct, len(set(run(stream_completion(fake.url, "ids", [1, 2, 3], 9)).token_times_s)))
    assert distinct == 5


def test_http_error_carries_the_server_message(fake: FakeServer) -> None:
    res = run(stream_completion(fake.url, "bad", [1], 5))
    assert res.error == "HTTP 400: max_tokens is too large (0 tokens received)"
    assert res.token_times_s == [] and res.num_output_tokens == 0


@pytest.mark.parametrize("model, words", [("cut", "closed before the stream ended"),
                                                ("boom", "engine died")])
def test_broken_stream_keeps_what_arrived(fake: FakeServer, model: str, words: str) -> None:
    res = run(stream_completion(fake.url, model, [1], 5))
    assert res.error is not None and words in res.error
    assert res.num_output_tokens == len(res.token_times_s) == 1


def test_timeout_and_refused_connection_become_errors(fake: FakeServer) -> None:
    t0 = time.perf_counter()
    res = run(stream_completion(fake.url, "hang", [1], 5, timeout_s=0.3))
    assert time.perf_counter() - t0 < 5
    assert res.error is not None and "timed out after 0.3 s" in res.error
    res = run(stream_completion(f"http://127.0.0.1:{free_port()}", "ok", [1], 5, timeout_s=5))
    assert res.error is not None and ("Connect" in res.error or "refused" in res.error)
    res = run(stream_completion("ftp://example", "ok", [1], 5))
    assert res.error is not None and "http" in res.error


def test_replay_sends_at_offsets_in_schedule_order(fake: FakeServer) -> None:
    offsets = [0.2, 0.0, 0.1, 0.1]
    schedule = [(off, [1, 2], n) for off, n in zip(offsets, [3, 4, 5, 6])]
    calls: list[tuple[int, int]] = []
    start = time.perf_counter()
    results = run(replay(fake.url, "ok", schedule, progress=lambda d, t: calls.append((d, t))))
    assert [r.index for r in results] == [0, 1, 2, 3]
    assert [r.num_output_tokens for r in results] == [3, 4, 5, 6]
    for r, off in zip(results, offsets):
        assert off - 0.005 <= r.send_s - start <= off + 0.05
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_replay_max_concurrency(fake: FakeServer) -> None:
    results = run(replay(fake.url, "ok", [(0.0, [1], 8)] * 6, max_concurrency=2))
    assert all(r.error is None and r.num_output_tokens == 8 for r in results)
    spans = [(r.send_s, r.token_times_s[-1]) for r in results]
    in_flight = [sum(a <= s < b for a, b in spans) for s, _ in spans]
    assert max(in_flight) == 2


def test_run_works_inside_a_running_loop(fake: FakeServer) -> None:
    async def outer() -> int:
        return run(stream_completion(fake.url, "ok", [1], 3)).num_output_tokens

    assert asyncio.run(outer()) == 3


def test_server_info_from_models_and_metrics(fake: FakeServer) -> None:
    info = server_info(fake.url)
    assert (info.model, info.max_model_len, info.num_gpu_blocks, info.block_size) == ("fake", 4096, 2048, 128)
    assert info.enable_prefix_caching is False
    assert info.max_num_seqs is None and info.max_num_batched_tokens is None  # no /server_info
    assert info.raw["info_gauges"]["vllm:cache_config_info"]["num_cpu_blocks"] == "None"
    with pytest.raises(ConnectionError):
        server_info(f"http://127.0.0.1:{free_port()}", timeout_s=2)


def test_prompt_ids_deterministic_and_avoiding() -> None:
    a = prompt_ids(500, 7, 50, avoid=[0, 1, 2])
    assert a == prompt_ids(500, 7, 50, avoid=(0, 1, 2))
    assert a != prompt_ids(500, 8, 50, avoid=(0, 1, 2))
    assert len(a) == 500 and set(a) == set(range(3, 50))
    assert prompt_ids(0, 1, 5, avoid=range(5)) == []
    with pytest.raises(ValueError):
        prompt_ids(3, 1, 5, avoid=range(5))


def test_generated_ids_are_kept_when_asked(fake: FakeServer) -> None:
    res = run(stream_completion(fake.url, "next", [4, 9], 3, return_token_ids=True))
    assert fake.bodies[-1]["return_token_ids"] is True
    assert res.error is None and res.token_ids == [10, 11, 12]          # last prompt id 9, + 1 + j
    assert run(stream_completion(fake.url, "next", [4, 9], 3)).token_ids is None
    assert "return_token_ids" not in fake.bodies[-1]


def test_replay_sends_a_next_turn_a_think_time_after_the_reply_it_holds(fake: FakeServer) -> None:
    """Item 1 follows item 0: due 0.15 s after item 0 ended, whatever its offset (0.0), its
    prompt made then from item 0's generated ids; item 2 keeps its offset."""
    schedule = [(0.0, [1, 2], 4), (0.0, [0], 2), (0.05, [5], 2)]
    made = []

    def prompt_at_send(i, results):
        made.append((i, results[0] is not None))
        return [1, 2] + results[0].token_ids + [50] if i == 1 else schedule[i][1]

    start = time.perf_counter()
    results = run(replay(fake.url, "next", schedule, waits_for=[[], [0], []], think_time_s=0.15,
                         prompt_at_send=prompt_at_send, return_token_ids=[True, False, False]))
    first, turn, other = results
    assert first.token_ids == [3, 4, 5, 6] and turn.token_ids is None
    assert [1, 2, 3, 4, 5, 6, 50] in [b["prompt"] for b in fake.bodies[-3:]] and turn.num_prompt_tokens == 7
    assert turn.scheduled_s == pytest.approx(first.end_s + 0.15)
    assert turn.scheduled_s - 0.001 <= turn.send_s <= turn.scheduled_s + 0.05
    assert other.scheduled_s == pytest.approx(start + 0.05, abs=0.01)
    assert (1, True) in made
    with pytest.raises(ValueError, match="only earlier items"):
        run(replay(fake.url, "next", schedule, waits_for=[[1], [], []]))


def test_metric_totals_sum_label_sets(fake: FakeServer) -> None:
    got = metric_totals(fake.url, ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"])
    assert got == {"vllm:prefix_cache_hits_total": 384.0, "vllm:prefix_cache_queries_total": None}
    assert metric_totals(f"http://127.0.0.1:{free_port()}", ["x_total"]) == {"x_total": None}
