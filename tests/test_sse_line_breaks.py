"""Streamed events survive clients that split lines the way Python does: JSON leaves U+0085,
U+2028 and U+2029 raw inside strings, and httpx's ``iter_lines`` (``str.splitlines``) took them
for line ends, so a generated text holding one reached such a client as a cut JSON line (seen
in the soak test). The server escapes them; the JSON means the same."""

from __future__ import annotations

import json

from httpx._decoders import LineDecoder

from modserve.server.protocol import encoder
from modserve.server.streaming import event_json, sse

TEXT = "a\u0085b\u2028c\u2029d\r\ne\x0bf é 漢"


def test_an_event_is_one_line_for_httpx_and_decodes_to_the_same_text():
    raw = encoder.encode({"content": TEXT})
    assert len(LineDecoder().decode((b"data: " + raw + b"\n\n").decode())) > 2  # the bug: cut in pieces
    lines = [line for line in LineDecoder().decode(sse({"content": TEXT}).decode()) if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:]) == {"content": TEXT}


def test_plain_text_is_encoded_as_before():
    obj = {"content": "plain é 漢 \" \\ \n"}
    assert event_json(obj) == encoder.encode(obj)
