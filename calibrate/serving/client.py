"""A standard-library streaming client for OpenAI-compatible ``/v1/completions``.

asyncio streams, HTTP/1.1 (chunked transfer encoding) and server-sent events:
no torch, no vLLM, no third-party package. ``stream_completion`` sends one
token-id prompt with a forced output length and times every output token
(and, asked, keeps the ids the server generated); ``replay`` sends a timed
schedule of them concurrently, a request that waits for earlier ones (a
session's next turn) a think time after their replies; ``server_info`` reads
a server's model length, KV-cache capacity and scheduler knobs and which
engine it is (vLLM, SGLang, TensorRT-LLM: ``engines``);
``metric_totals`` reads its Prometheus counters.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import random
import re
import ssl
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")
ERROR_BODY_CHARS = 500


@dataclass
class StreamResult:
    """One request's outcome. Times are ``time.perf_counter()`` seconds.

    ``send_s`` is taken just before connecting. ``token_times_s`` has one
    entry per output token, in order; tokens that arrived in one event share
    its time. ``num_output_tokens`` is the server's final usage count when
    given, else ``len(token_times_s)``; they differ only if a server without
    continuous usage stats packs several tokens in one event. On failure
    ``error`` says why and the other fields keep what arrived before it.
    ``token_ids``: the output token ids the server sent (vLLM's
    ``return_token_ids``), None unless asked for. ``scheduled_s``: when
    ``replay`` meant to send it (None outside ``replay``); ``end_s``: when
    its exchange ended.
    """

    index: int
    send_s: float
    token_times_s: list[float]
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None
    token_ids: list[int] | None = None
    scheduled_s: float | None = None
    end_s: float | None = None


@dataclass
class ServerInfo:
    """What a server says about itself; None where it does not say."""

    model: str
    max_model_len: int | None
    num_gpu_blocks: int | None
    block_size: int | None
    enable_prefix_caching: bool | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    raw: dict[str, Any] = field(default_factory=dict)
    engine_kind: str = "unknown"        # engines.ENGINE_KINDS: vllm | sglang | tensorrt_llm | unknown
    engine_version: str | None = None
    engine_knobs: dict[str, Any] = field(default_factory=dict)   # what it said, under the engine's names


class _HttpError(Exception):
    """An HTTP error status, or an error event in the stream."""


class _StreamEnded(Exception):
    """The body ended without the ``[DONE]`` event."""


async def stream_completion(url: str, model: str, prompt_token_ids: list[int], max_tokens: int, *,
                            index: int = 0, timeout_s: float = 600.0,
                            return_token_ids: bool = False) -> StreamResult:
    """Stream one completion of exactly ``max_tokens`` tokens (``ignore_eos``, greedy).

    ``url`` is the server root (``http://host:port``, optionally with a path
    prefix). ``return_token_ids``: ask for the generated ids (vLLM's
    ``return_token_ids``: each event's ``token_ids`` holds its new ones) and
    keep them in ``token_ids``. Never raises for network or server failures
    (see StreamResult); the whole exchange is bounded by ``timeout_s``.
    """
    result = StreamResult(index, time.perf_counter(), [], len(prompt_token_ids), 0,
                          token_ids=[] if return_token_ids else None)
    body = {"model": model, "prompt": prompt_token_ids, "max_tokens": max_tokens,
            "min_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if return_token_ids:
        body["return_token_ids"] = True
    try:
        await asyncio.wait_for(_exchange(url, json.dumps(body).encode(), result), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"timed out after {timeout_s:g} s"
    except _HttpError as exc:
        result.error = str(exc)
    except (asyncio.IncompleteReadError, _StreamEnded):
        result.error = "connection closed before the stream ended"
    except Exception as exc:  # a broken connection or malformed answer, whatever its form
        result.error = f"{type(exc).__name__}: {exc}"
    if result.error is not None:
        result.error += f" ({len(result.token_times_s)} tokens received)"
    if result.num_output_tokens == 0:
        result.num_output_tokens = len(result.token_times_s)
    result.end_s = time.perf_counter()
    return result


async def _exchange(url: str, payload: bytes, result: StreamResult) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"URL must be http(s)://host[:port][/prefix], got {url!r}")
    tls = ssl.create_default_context() if parts.scheme == "https" else None
    result.send_s = time.perf_counter()
    port = parts.port or (443 if tls else 80)
    reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=tls)
    try:
        path = parts.path.rstrip("/") + "/v1/completions"
        head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
        writer.write(head.encode("latin-1") + payload)
        await writer.drain()
        status, headers = await _read_head(reader)
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if status != 200:
            body = b"".join([piece async for piece in _body_pieces(reader, headers, chunked)])
            raise _HttpError(f"HTTP {status}: {_error_message(body)}")
        await _read_events(_body_pieces(reader, headers, chunked), result)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = (await reader.readuntil(b"\r\n")).decode("latin-1")
    fields = status_line.split(" ", 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/"):
        raise ValueError(f"not an HTTP response: {status_line.strip()!r}")
    headers: dict[str, str] = {}
    while (line := (await reader.readuntil(b"\r\n")).decode("latin-1").strip()):
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(fields[1]), headers


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[str, str],
                       chunked: bool) -> AsyncIterator[bytes]:
    """Yield the body as it arrives, de-chunked, until its end."""
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the CRLF closing each chunk
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while piece := await reader.read(65536):
            yield piece


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, else the body's text (truncated)."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        err = json.loads(text)
    except ValueError:
        return text[:ERROR_BODY_CHARS] or "(empty body)"
    err = err.get("error", err) if isinstance(err, dict) else err
    if isinstance(err, dict):
        err = err.get("message") or err.get("detail") or err
    return str(err)[:ERROR_BODY_CHARS]


async def _read_events(pieces: AsyncIterator[bytes], result: StreamResult) -> None:
    """Parse server-sent events, stamping each with the arrival time of its last byte."""
    buffer = b""
    usage_tokens = 0  # latest cumulative completion_tokens seen
    async for piece in pieces:
        now = time.perf_counter()
        buffer = (buffer + piece).replace(b"\r\n", b"\n")
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            data = "\n".join(line[5:].strip() for line in event.decode("utf-8").split("\n")
                             if line.startswith("data:"))
            if not data:
                continue
            if data == "[DONE]":
                return
            obj = json.loads(data)
            if "error" in obj:
                raise _HttpError(f"server error in stream: {_error_message(data.encode())}")
            result.token_times_s.extend([now] * _new_tokens(obj, usage_tokens))
            if result.token_ids is not None and (obj.get("choices") or [{}])[0].get("token_ids"):
                result.token_ids.extend(int(t) for t in obj["choices"][0]["token_ids"])
            usage = obj.get("usage") or {}
            if isinstance(usage.get("completion_tokens"), int):
                usage_tokens = usage["completion_tokens"]
                result.num_output_tokens = usage_tokens
            if isinstance(usage.get("prompt_tokens"), int):
                result.num_prompt_tokens = usage["prompt_tokens"]
    raise _StreamEnded


def _new_tokens(obj: dict[str, Any], usage_tokens: int) -> int:
    """Output tokens an event adds: by continuous usage stats, else its token ids, else one."""
    choices = obj.get("choices") or []
    if not choices:
        return 0
    completion = (obj.get("usage") or {}).get("completion_tokens")
    if isinstance(completion, int):
        return max(0, completion - usage_tokens)
    token_ids = choices[0].get("token_ids")
    return len(token_ids) if isinstance(token_ids, list) else 1


async def replay(url: str, model: str, schedule: Sequence[tuple[float, list[int], int]], *,
                 max_concurrency: int | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 waits_for: Sequence[Sequence[int]] | None = None, think_time_s: float = 0.0,
                 prompt_at_send: Callable[[int, Sequence[StreamResult | None]], list[int]] | None = None,
                 return_token_ids: Sequence[bool] | bool = False) -> list[StreamResult]:
    """Send each ``(offset_s, prompt_token_ids, max_tokens)`` at ``offset_s`` after the start.

    All run concurrently; with ``max_concurrency`` later ones wait for a slot
    (``send_s`` is when each was actually sent, ``scheduled_s`` when it was
    due). ``waits_for[i]``: earlier items that item ``i`` follows (a
    session's next turn): it is due ``think_time_s`` after the last of them
    ended, whatever its offset. ``prompt_at_send(i, results)``, if given,
    makes item ``i``'s prompt when it is due, from the results so far (None:
    not ended yet); else the schedule's prompt is sent. ``return_token_ids``
    (one flag, or one per item) asks for the generated ids. ``progress(done,
    total)`` is called as each finishes. Returns the results in schedule order.
    """
    n = len(schedule)
    after = [list(w) for w in waits_for] if waits_for is not None else [[] for _ in range(n)]
    if len(after) != n:
        raise ValueError(f"waits_for has {len(after)} entries for {n} schedule items")
    for i, deps in enumerate(after):
        if any(not 0 <= j < i for j in deps):
            raise ValueError(f"item {i} waits for {deps}: only earlier items can be waited for")
    ids_wanted = [return_token_ids] * n if isinstance(return_token_ids, bool) else list(return_token_ids)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    start = time.perf_counter()
    done = 0
    results: list[StreamResult | None] = [None] * n
    ended = [asyncio.Event() for _ in range(n)]

    async def one(i: int, offset_s: float, prompt: list[int], max_tokens: int) -> StreamResult:
        nonlocal done
        try:
            if after[i]:
                for j in after[i]:
                    await ended[j].wait()
                due = max(results[j].end_s or start for j in after[i]) + think_time_s  # type: ignore[union-attr]
            else:
                due = start + offset_s
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if prompt_at_send is not None:
                prompt = prompt_at_send(i, results)
            async with limit:
                res = await stream_completion(url, model, prompt, max_tokens, index=i,
                                              return_token_ids=bool(ids_wanted[i]))
            res.scheduled_s = due
            results[i] = res
        finally:
            ended[i].set()
        done += 1
        if progress is not None:
            progress(done, n)
        return res

    return list(await asyncio.gather(*(one(i, *item) for i, item in enumerate(schedule))))


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, also under a running event loop (then on a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


_INFO_LINE = re.compile(r"^([A-Za-z_:][\w:]*_info)\{(.*)\}\s+\S+\s*$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def server_info(url: str, timeout_s: float = 10.0, *, warm: bool = True) -> ServerInfo:
    """What the server says about itself, and which engine it is (``engines.detect``).

    ``/v1/models`` is required (ConnectionError if it fails). vLLM: ``/metrics``'
    ``*_info`` gauges, ``/version`` and, in its dev mode, ``/server_info`` (scheduler
    knobs). SGLang: ``/get_server_info``. TensorRT-LLM: ``/metrics``' iteration stats
    and ``/version``; with ``warm``, an empty stats list (nothing ran since the last
    read) is read again after one 2-token completion. See ``engines`` for the fields."""
    from calibrate.serving import engines

    base = url.rstrip("/")
    try:
        models = json.loads(_get(base + "/v1/models", timeout_s))
    except (OSError, ValueError) as exc:
        raise ConnectionError(f"GET {base}/v1/models failed: {exc}") from exc
    card = models["data"][0]
    metrics_text = _get_text(base + "/metrics", timeout_s)
    info_gauges: dict[str, dict[str, str]] = {}
    for line in (metrics_text or "").splitlines():
        if (m := _INFO_LINE.match(line)) and m.group(1) not in info_gauges:
            info_gauges[m.group(1)] = dict(_LABEL.findall(m.group(2)))
    sglang = None
    if "vllm:" not in (metrics_text or ""):
        sglang = _get_json(base + "/get_server_info", timeout_s)
    kind = engines.detect(models, metrics_text, sglang)
    model_len = _int(card.get("max_model_len"))
    raw: dict[str, Any] = {"models": models, "info_gauges": info_gauges}
    if kind == "sglang" and isinstance(sglang, dict):
        facts = engines.sglang_facts(sglang, model_len)
        raw["sglang_server_info"] = sglang
    elif kind == "tensorrt_llm":
        stats = _json_or_none(metrics_text)
        if warm and stats == []:
            run(stream_completion(base, str(card["id"]), [1, 2, 3, 4], 2, timeout_s=timeout_s))
            stats = _get_json(base + "/metrics", timeout_s)
        version = _get_json(base + "/version", timeout_s)
        facts = engines.trtllm_facts(stats, version.get("version") if isinstance(version, dict) else None)
        raw["iteration_stats"] = stats
    else:
        facts, raw["vllm_config"] = _vllm_facts(base, kind, info_gauges, model_len, timeout_s)
    b = facts.batchsim
    return ServerInfo(
        model=card["id"], max_model_len=model_len or b["max_model_len"], num_gpu_blocks=b["num_gpu_blocks"],
        block_size=b["block_size"], enable_prefix_caching=b["enable_prefix_caching"],
        max_num_seqs=b["max_num_seqs"], max_num_batched_tokens=b["max_num_batched_tokens"], raw=raw,
        engine_kind=kind, engine_version=facts.version, engine_knobs=facts.knobs)


def _vllm_facts(base: str, kind: str, info_gauges: dict[str, dict[str, str]], model_len: int | None,
                timeout_s: float) -> tuple[Any, Any]:
    """(vLLM's facts, its dev-mode config or None); also for a server that says nothing
    (``unknown``). The KV pool from ``vllm:cache_config_info``, the scheduler knobs from
    the dev-mode ``/server_info``."""
    from calibrate.serving.engines import EngineFacts

    try:
        config = json.loads(_get(base + "/server_info?config_format=json", timeout_s))["vllm_config"]
    except (OSError, ValueError, KeyError, TypeError):
        config = None
    cache = info_gauges.get("vllm:cache_config_info", {})
    sched = config.get("scheduler_config", {}) if isinstance(config, dict) else {}
    batchsim = {"num_gpu_blocks": _int(cache.get("num_gpu_blocks")), "block_size": _int(cache.get("block_size")),
                "enable_prefix_caching": {"True": True, "False": False}.get(cache.get("enable_prefix_caching", "")),
                "max_num_seqs": _int(sched.get("max_num_seqs")),
                "max_num_batched_tokens": _int(sched.get("max_num_batched_tokens")), "max_model_len": model_len}
    version = _get_json(base + "/version", timeout_s)
    knobs = {k: v for k, v in batchsim.items() if v is not None}
    return EngineFacts(kind, version.get("version") if isinstance(version, dict) else None, knobs, batchsim), config


def _get_text(url: str, timeout_s: float) -> str | None:
    try:
        return _get(url, timeout_s).decode("utf-8", "replace")
    except (OSError, ValueError):
        return None


def _json_or_none(text: str | None) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def _get_json(url: str, timeout_s: float) -> Any:
    """The parsed JSON body, None when there is no answer or it is not JSON."""
    return _json_or_none(_get_text(url, timeout_s))


def metric_totals(url: str, names: Iterable[str], timeout_s: float = 5.0) -> dict[str, float | None]:
    """Each Prometheus counter of ``names`` summed over its label sets, from the
    server's ``/metrics``; None for a name it does not export or when
    ``/metrics`` cannot be read."""
    names = list(names)
    try:
        text = _get(url.rstrip("/") + "/metrics", timeout_s).decode("utf-8", "replace")
    except (OSError, ValueError):
        return dict.fromkeys(names)
    out: dict[str, float | None] = {}
    for name in names:
        values = [float(m.group(1)) for m in
                  re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
        out[name] = sum(values) if values else None
    return out


def _get(url: str, timeout_s: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return bytes(resp.read())


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, str)) and str(value).isdigit() else None


def prompt_ids(num_tokens: int, seed: int, vocab_size: int, *, avoid: Iterable[int] = ()) -> list[int]:
    """``num_tokens`` ids in ``[0, vocab_size)`` outside ``avoid``, a function of the arguments."""
    banned = {t for t in avoid if 0 <= t < vocab_size}
    if num_tokens > 0 and len(banned) >= vocab_size:
        raise ValueError(f"avoid covers the whole vocabulary of {vocab_size} tokens")
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < num_tokens:
        t = rng.randrange(vocab_size)
        if t not in banned:
            out.append(t)
    return out
