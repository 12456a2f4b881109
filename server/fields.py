"""No request field is silently ignored: each one is implemented, known but not supported, or unknown.

- **implemented**: a field of the endpoint's request struct (:mod:`modserve.server.protocol`);
- **known, not supported**: a field of OpenAI's or vLLM's API that changes what the answer
  must be and that this server does not implement yet: a 400 naming the field, unless its
  value asks for nothing (``function_call: "none"``, ``response_format: {"type": "text"}``,
  ``best_of: 1``, an empty list);
- **unknown**: ignored for client compatibility (as vLLM does) and logged once per name.

``docs/server.md`` lists the three groups.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from modserve.server.errors import bad_request, from_undecodable

log = logging.getLogger("modserve.server")


def _absent(value: Any) -> bool:
    return value in (None, False, "", [], {})


def _is(*harmless: Any) -> Callable[[Any], bool]:
    return lambda value: _absent(value) or value in harmless


# field -> (why it is refused, the values that ask for nothing and pass)
_COMMON: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "guided_decoding_backend": ("only llguidance serves constraints here ('auto', 'guidance' or 'llguidance')",
                                _is("auto", "guidance", "llguidance")),
    "use_beam_search": ("beam search is not implemented", _absent),
    "length_penalty": ("beam search is not implemented", _is(1, 1.0)),
    "truncate_prompt_tokens": ("prompt truncation is not implemented; shorten the prompt", _absent),
    "return_tokens_as_token_ids": ("token-id output is not implemented", _absent),
    "vllm_xargs": ("extra sampling arguments are not accepted over HTTP", _absent),
}

UNSUPPORTED: dict[str, dict[str, tuple[str, Callable[[Any], bool]]]] = {
    "completions": {
        **_COMMON,
        "best_of": ("best_of is not implemented (n samples are all returned)", _is(1)),
        "suffix": ("insertion (suffix) is not implemented", _absent),
    },
    "chat": {
        **_COMMON,
        "functions": ("the deprecated functions API is not implemented: use tools", _absent),
        "function_call": ("the deprecated functions API is not implemented: use tool_choice", _is("none")),
        "audio": ("audio output is not supported", _absent),
        "modalities": ("only text output is supported", lambda v: _absent(v) or v == ["text"]),
        "prediction": ("predicted outputs are not supported", _absent),
        "web_search_options": ("web search is not supported", _absent),
        "reasoning_effort": ("reasoning controls are not supported", _absent),
        "verbosity": ("verbosity controls are not supported", _absent),
        "store": ("this server stores nothing (store: true)", _absent),
        "chat_template": ("a request's own chat template is not accepted", _absent),
        "documents": ("documents for the chat template are not accepted", _absent),
        "continue_final_message": ("continuing the final message is not implemented", _absent),
        "echo": ("echo on chat is not implemented", _absent),
    },
    "responses": {
        "previous_response_id": ("this server stores no responses; send the whole conversation as input", _absent),
        "store": ("this server stores nothing (store: true)", _absent),
        "conversation": ("this server stores no conversations; send the whole conversation as input", _absent),
        "background": ("background responses are not supported", _absent),
        "include": ("no extra output data (include) is supported", _absent),
        "reasoning": ("reasoning controls are not supported", lambda v: _absent(v) or (isinstance(v, dict) and all(x is None for x in v.values()))),
        "truncation": ("only truncation 'disabled' is supported", _is("disabled")),
        "max_tool_calls": ("max_tool_calls is not supported", _absent),
        "top_logprobs": ("logprobs are not supported on responses; use chat completions", _is(0)),
        "prompt": ("stored prompt templates are not supported", _absent),
        "service_tier": ("service tiers are not supported", _is("auto", "default")),
    },
}

_logged: set[str] = set()


def check_fields(raw: bytes, struct: type, endpoint: str) -> None:
    """400 for a known field this server does not support (naming it); log unknown ones once."""
    try:
        top = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return  # the typed decode reports the malformed body
    implemented = {f.name for f in msgspec.structs.fields(struct)}
    refused = UNSUPPORTED[endpoint]
    for name, value in top.items():
        if name in implemented and name != "stream_options":
            continue
        if name == "stream_options":
            options = _value(value)
            if isinstance(options, dict):
                for key, inner in options.items():
                    _check(f"stream_options.{key}", inner, refused, endpoint, known={"include_usage", "continuous_usage_stats"})
            continue
        _check(name, value, refused, endpoint, known=implemented)


def _check(name: str, value: Any, refused: dict, endpoint: str, known: set[str]) -> None:
    if name.split(".")[-1] in known:
        return
    if name in refused:
        why, harmless = refused[name]
        decoded = _value(value)
        if not harmless(decoded):
            raise bad_request(f"{name}: not supported by this server: {why}", name, "unsupported_parameter")
        return
    if name not in _logged:
        _logged.add(name)
        log.info("ignoring unknown request field %r (%s); it has no effect", name, endpoint)


def _value(raw: Any) -> Any:
    """A field's raw JSON decoded (the typed decode skipped it unread: it may still hold bad
    UTF-8 or deep nesting, each a 400 as decode_body gives it)."""
    if isinstance(raw, msgspec.Raw):
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return raw
        except (UnicodeDecodeError, RecursionError) as e:
            raise from_undecodable(e) from None
    return raw
