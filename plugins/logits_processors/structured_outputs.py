"""Logits processor ``structured_outputs``: the output matches a JSON schema, regex, choice or grammar.

Backed by llguidance (Microsoft's guidance engine, Rust, no dependencies). Why not
xgrammar, which vLLM and SGLang also use: it requires ``transformers`` at run time, which
this project keeps as a test-only oracle; llguidance builds its tokenizer from the
``tokenizers`` object the engine already holds.

- Grammars are compiled when a request is validated (``check``: the server's event loop, not
  the engine thread) into a template matcher, cached by constraint (LRU); each sequence gets a
  cheap copy. An invalid schema, regex or grammar is a ``ValueError`` naming the field.
- Once per step, one bitmask for every constrained row (llguidance fills them in parallel,
  dropping the GIL), applied to those rows only; unconstrained rows share the batch untouched.
- Speculative decoding: a request's verification rows are consecutive, and llguidance fills
  the mask of each draft position in one call (the matcher's state is restored after), so a
  draft the grammar forbids gets probability 0 and is rejected.
- The matcher follows each sequence's accepted tokens at the start of every step, so
  preemption, ``n > 1`` forks and rejected drafts need nothing else.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Annotated

import llguidance
import llguidance.gbnf_to_lark
import msgspec
import torch

from modserve.core.contract import BuildContext, LogitsProcessor, LogitsRow, hookimpl
from modserve.core.request import Request
from modserve.core.sampling_params import SamplingParams, StructuredOutputs

MODSERVE_CONTRACT = "2.0"


class StructuredOutputsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_cached_grammars: Annotated[int, msgspec.Meta(ge=1)] = 256  # compiled constraints kept (LRU)
    threads: Annotated[int, msgspec.Meta(ge=1)] | None = None  # llguidance threads filling a step's masks (default: one per core; the forward is not running then)
    json_whitespace: bool = False  # let JSON outputs put whitespace between tokens (a model may pad until max_tokens)


def grammar_of(constraint: StructuredOutputs, json_whitespace: bool = False) -> str:
    """The llguidance grammar for one constraint (not yet checked: the matcher says if it is valid)."""
    kind = constraint.kind
    layout = {"whitespace_flexible": json_whitespace, "item_separator": ", ", "key_separator": ": "}
    if kind == "json":
        schema = constraint.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=layout)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json: invalid JSON schema: {e}") from None
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=layout)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choice))
    text = constraint.grammar
    if "::=" in text:  # GBNF
        try:
            text = llguidance.gbnf_to_lark.gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions
            raise ValueError(f"structured_outputs.grammar: invalid GBNF grammar: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


class StructuredOutputsProcessor(LogitsProcessor):
    Config = StructuredOutputsConfig
    request_field = "structured_outputs"

    def __init__(self, config: StructuredOutputsConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.vocab_size = ctx.model.vocab_size
        eos = list(ctx.model.eos_token_ids) or None
        self.tokenizer = llguidance.LLTokenizer(ctx.tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        # llguidance writes masks as wide as its own vocabulary (it may hold tokens the model's
        # embedding lacks): size every row by it, or a row's tail lands in the next one
        self.mask_words = (self.tokenizer.vocab_size + 31) // 32
        self.executor = llguidance.LLExecutor(num_threads=config.threads or os.cpu_count() or 1)
        self._templates: OrderedDict[bytes, llguidance.LLMatcher] = OrderedDict()
        self._live: dict[str, list] = {}  # sequence id -> [matcher, output tokens it has consumed]
        # byte -> its 8 bits, least significant first: a mask row's bytes index it straight into
        # one bool per token (half the time of shifting and masking 32-bit words)
        self._bits = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()

    def check(self, params: SamplingParams) -> None:
        self._template(params.structured_outputs)

    def _template(self, constraint: StructuredOutputs) -> llguidance.LLMatcher:
        key = msgspec.json.encode(constraint)
        template = self._templates.get(key)
        if template is None:
            matcher = llguidance.LLMatcher(self.tokenizer, grammar_of(constraint, self.config.json_whitespace), log_level=0)
            if matcher.is_error():
                raise ValueError(f"structured_outputs.{constraint.kind}: {matcher.get_error()}")
            template = self._templates[key] = matcher
            while len(self._templates) > self.config.max_cached_grammars:
                self._templates.popitem(last=False)
        self._templates.move_to_end(key)
        return template

    def _matcher(self, request: Request) -> llguidance.LLMatcher:
        """The sequence's matcher, advanced over the tokens it accepted since the last step."""
        live = self._live.get(request.request_id)
        if live is None:
            live = self._live[request.request_id] = [self._template(request.sampling_params.structured_outputs).deep_copy(), 0]
        matcher, consumed = live
        new = request.output_token_ids[consumed:]
        if matcher.is_stopped():  # complete: its mask allows only EOS, which ignore_eos keeps sampling
            new = []
        else:  # tokens up to the grammar's end, then EOS tokens once it stopped
            accepted = matcher.try_consume_tokens(new)
            new = [t for t in new[accepted:] if not matcher.is_stopped()]
        if new and not matcher.consume_tokens(new):
            raise ValueError(f"structured_outputs: the output left the constraint: {matcher.get_error()}")
        live[1] = len(request.output_token_ids)
        return matcher

    def apply(self, logits: torch.Tensor, rows: list[LogitsRow], which: list[int]) -> None:
        plain, drafted = [], []  # (matcher, first mask row[, drafts]); a request's rows are consecutive
        i = 0
        while i < len(rows):
            request = rows[i].request
            end = i
            while end + 1 < len(rows) and rows[end + 1].request is request:
                end += 1
            drafts = list(rows[end].drafts_before)
            if len(drafts) != end - i:  # llguidance writes len(drafts) + 1 mask rows: never past ours
                raise RuntimeError(f"structured_outputs: {end - i + 1} rows for {len(drafts)} drafts of {request.request_id}")
            if drafts:
                drafted.append((self._matcher(request), i, drafts))
            else:
                plain.append((self._matcher(request), i))
            i = end + 1
        masks = torch.full((len(rows), self.mask_words), -1, dtype=torch.int32)
        # (llguidance.torch wraps these two calls, but it applies torch.compile at import)
        row_bytes, ptr = self.mask_words * 4, masks.data_ptr()
        if plain:
            self.executor.unsafe_compute_mask_ptr(plain, ptr, row_bytes, len(rows))
        if drafted:  # fills len(drafts) + 1 rows per request, from its first row
            self.executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, row_bytes, len(rows))
        allowed = self._bits[masks.view(torch.uint8).long()].view(len(rows), -1)
        width = logits.shape[1]
        if allowed.shape[1] < width:  # logits past the tokenizer's vocabulary are never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(len(rows), width - allowed.shape[1])], dim=1)
        forbidden = ~allowed[:, :width].to(logits.device)
        if which[-1] - which[0] == len(which) - 1:  # consecutive rows (the usual case): in place
            logits[which[0] : which[-1] + 1].masked_fill_(forbidden, float("-inf"))
        else:
            index = torch.tensor(which, device=logits.device)
            logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(forbidden, float("-inf")))

    def release(self, request: Request) -> None:
        self._live.pop(request.request_id, None)


@hookimpl
def register_logits_processors():
    return {"structured_outputs": StructuredOutputsProcessor}
