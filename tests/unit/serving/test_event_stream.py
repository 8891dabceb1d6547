"""``EventStream``, our one adapter over Starlette's ``StreamingResponse`` (it sends the headers and the
first events from the request's task): pinned on the ASGI messages it sends, so a Starlette release
that changes how ``StreamingResponse`` streams fails here, not in a served stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from llmpipe.serving.openai_api import EventStream


async def _events(n: int) -> AsyncIterator[str]:
    for i in range(n):
        yield f"data: {i}\n\n"
        await asyncio.sleep(0)


def _serve(n: int, lead: int, asgi: str) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()  # the client stays: Starlette's disconnect listener waits until the stream ends
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": asgi}, "method": "POST", "path": "/"}
    response = EventStream(_events(n), lead=lead, media_type="text/event-stream")
    asyncio.run(asyncio.wait_for(response(scope, receive, send), 10))
    return sent


@pytest.mark.parametrize("asgi", ["2.0", "2.4"])  # with and without Starlette's disconnect listener
@pytest.mark.parametrize(("n", "lead"), [(5, 1), (5, 3), (2, 3), (0, 1)])
def test_headers_once_then_every_event_in_order_then_the_end(n: int, lead: int, asgi: str) -> None:
    sent = _serve(n, lead, asgi)
    assert [m["type"] for m in sent].count("http.response.start") == 1 and sent[0]["type"] == "http.response.start"
    assert sent[0]["status"] == 200 and (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    bodies = [m for m in sent[1:] if m["type"] == "http.response.body"]
    assert len(bodies) == len(sent) - 1
    assert b"".join(m["body"] for m in bodies) == "".join(f"data: {i}\n\n" for i in range(n)).encode()
    assert [m.get("more_body", False) for m in bodies] == [True] * (len(bodies) - 1) + [False]
    assert bodies[-1]["body"] == b""
