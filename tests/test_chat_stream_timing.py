"""The chat stream's role chunk goes out with the first generated token, not at admission, so
a client measuring time to first chunk (``vllm bench serve --backend openai-chat``) measures
the model."""

from __future__ import annotations

import threading
import time

import httpx
from server_helpers import MODEL_NAME, LiveServer


def test_role_chunk_waits_for_the_first_token():
    with LiveServer(scheduler={"max_num_seqs": 1}) as s:  # one seat: the second request waits for the first
        url = f"{s.url}/v1/chat/completions"
        done_at: list[float] = []

        def long_request():
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}], "max_tokens": 120, "ignore_eos": True}
            assert httpx.post(url, json=body, timeout=120).status_code == 200
            done_at.append(time.monotonic())

        first = threading.Thread(target=long_request)
        first.start()
        time.sleep(0.2)  # the long request holds the seat
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "b"}], "max_tokens": 3, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            lines = r.iter_lines()
            first_event = next(line for line in lines if line.startswith("data: "))
            first_event_at = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
        first.join()
        assert '"role":"assistant"' in first_event
        assert done_at and first_event_at >= done_at[0] - 0.05  # not while it was waiting for the seat
        assert rest[-1] == "data: [DONE]" and any('"content":' in line for line in rest[:-1])
