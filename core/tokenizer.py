"""Tokenizer, chat template and incremental detokenization behind one small object.

Backed by the ``tokenizers`` library (fast, no ``transformers`` at run time); chat
templates render with jinja2's sandbox, as HF does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class ChatTemplateError(ValueError):
    """The chat template could not render these messages."""


@dataclass
class TokenizerBundle:
    tokenizer: Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf_dir(cls, path: str, eos_token_ids: list[int]) -> TokenizerBundle:
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_file):
            raise FileNotFoundError(f"tokenizer not found: expected {tok_file}")
        tokenizer = Tokenizer.from_file(tok_file)
        tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = tcfg.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        bos, eos = _token_text(tcfg.get("bos_token")), _token_text(tcfg.get("eos_token"))
        ids = list(eos_token_ids)
        if eos is not None and (eos_id := tokenizer.token_to_id(eos)) is not None and eos_id not in ids:
            ids.append(eos_id)
        return cls(tokenizer, template, bos, eos, ids)

    @cached_property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text a single token decodes to (for logprob entries)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, **template_kwargs: Any,
    ) -> str:
        """Render as HF does: ``tools`` (OpenAI function dicts) and any extra template
        variables (``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``) are passed through."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use the completions API instead")
        try:
            return _compile(self.chat_template).render(
                **template_kwargs,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, **template_kwargs: Any,
    ) -> list[int]:
        """Chat templates carry their own special tokens, so none are added here (as vLLM does)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads (``tools`` among them if it renders tools)."""
        if not self.chat_template:
            return frozenset()
        env = jinja2.sandbox.ImmutableSandboxedEnvironment()
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(self.chat_template)))

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, token_id) or ""


def _raise(message: str):
    raise jinja2.TemplateError(message)


_TEMPLATE_CACHE: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    if source not in _TEMPLATE_CACHE:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        _TEMPLATE_CACHE[source] = env.from_string(source)
    return _TEMPLATE_CACHE[source]


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(tok: Any) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok
