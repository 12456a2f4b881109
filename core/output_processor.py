"""Turns new tokens into text deltas and finished outputs; applies stop strings.

Text that could still grow into a stop string is held back until it cannot, so a
stream never shows text that the final output drops. Streamed deltas concatenated equal
the final text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modserve.core.outputs import CompletionOutput, Logprob, RequestOutput
from modserve.core.request import Request
from modserve.core.tokenizer import IncrementalDetokenizer, TokenizerBundle


@dataclass
class _TextState:
    detok: IncrementalDetokenizer
    text: str = ""  # all decoded text (truncated at a stop string when one is found)
    emitted: int = 0  # chars of ``text`` already sent
    emitted_tokens: int = 0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: TokenizerBundle | None) -> None:
        self.tokenizer = tokenizer
        self._state: dict[str, _TextState] = {}

    def add(self, request: Request) -> None:
        detok = self.tokenizer.detokenizer(request.sampling_params.skip_special_tokens) if self.tokenizer else None
        self._state[request.request_id] = _TextState(detok)

    def process(self, request: Request, new_tokens: list[int]) -> bool:
        """Decode ``new_tokens``; returns True when a stop string ended the request."""
        st = self._state[request.request_id]
        if st.detok is None:
            return False
        sp = request.sampling_params
        start = len(st.text)
        for tok in new_tokens:
            if request.finish_reason is not None and tok == request.stop_reason:
                continue  # a stop token id is not part of the text
            if request.finish_reason == "stop" and request.stop_reason is None and tok in request.eos_token_ids:
                continue
            st.text += st.detok.step(tok)
        if not sp.stop:
            return False
        window = max(0, start - max(len(s) for s in sp.stop) + 1)
        hits = [(st.text.find(s, window), s) for s in sp.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        idx, stop = min(hits)
        st.text = st.text[: idx + len(stop) if sp.include_stop_str_in_output else idx]
        request.stop_reason = stop
        return True

    def output(self, request: Request) -> RequestOutput:
        """The request's output so far, with the delta since the previous call."""
        st = self._state[request.request_id]
        finished = request.finish_reason is not None
        emit_to = len(st.text) if finished else len(st.text) - _held_back(st.text, request.sampling_params.stop)
        emit_to = max(emit_to, st.emitted)
        delta = st.text[st.emitted : emit_to]
        st.emitted = emit_to
        token_ids = request.output_token_ids
        new_ids = token_ids[st.emitted_tokens :]
        st.emitted_tokens = len(token_ids)
        if request.sampling_params.logprobs is not None:
            st.logprobs += [self._logprob_entry(rec, tok) for rec, tok in zip(request.logprobs[len(st.logprobs) :], new_ids)]
        completion = CompletionOutput(
            index=0,
            text=st.text[:emit_to],
            token_ids=list(token_ids),
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=list(st.logprobs) if request.sampling_params.logprobs is not None else None,
            text_delta=delta,
            token_ids_delta=list(new_ids),
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )
        if finished:
            del self._state[request.request_id]
        prompt_logprobs = None
        if request.sampling_params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [
                self._logprob_entry(rec, tok) for rec, tok in zip(request.prompt_logprobs, request.prompt_token_ids[1:])
            ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=None,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            error=request.error,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def drop(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def _logprob_entry(self, record, token_id: int) -> dict[int, Logprob]:
        chosen, top = record
        text = self.tokenizer.token_text if self.tokenizer else (lambda _t: None)
        entry = {token_id: Logprob(token_id, chosen, text(token_id))}
        for tok, lp in top:
            entry.setdefault(tok, Logprob(tok, lp, text(tok)))
        return entry


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
