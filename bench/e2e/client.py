"""The benchmarks' streaming client: one ``/v1/completions`` request with token ids in, the
client-side TTFT out (``bench/e2e/run.py``'s cells, ``serve.py``'s warm-up, ``multiround.py``'s
rounds)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx

SERVED_MODEL = "bench"  # the e2e stack's --served-model-name


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: list[int],
                            max_tokens: int, *, request_id: str | None = None,
                            timeout_s: float = 600.0) -> dict[str, Any]:
    """One streaming ``/v1/completions`` request with token ids in and out.

    Returns ``ttft`` (s, first streamed token), ``total`` (s), ``token_ids`` (the answer, from
    vLLM's ``return_token_ids``), ``text``, ``error`` and the request id it sent.
    """
    rid = request_id or uuid.uuid4().hex
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    ttft: float | None = None
    ids: list[int] = []
    text = ""
    error: str | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers={"X-Request-Id": rid}, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                error = f"http {resp.status_code}: {(await resp.aread())[:300]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        error = str(payload["error"])[:300]
                        break
                    for choice in payload.get("choices") or []:
                        piece_ids = choice.get("token_ids") or []
                        piece = choice.get("text") or ""
                        if ttft is None and (piece or piece_ids):
                            ttft = time.perf_counter() - t0
                        ids += piece_ids
                        text += piece
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"rid": rid, "ttft": ttft, "total": time.perf_counter() - t0, "token_ids": ids,
            "text": text, "error": error}
