"""Sampler ``default``: penalties, min-tokens, temperature, top-k, top-p, min-p; greedy or seeded.

All batched tensor math. A sampled row draws one uniform from its (seed, counter) and
inverts the row's CDF, so a seeded request's tokens do not depend on its batch mates.
Logprobs are those of the model's raw distribution (as vLLM reports them).
"""

from __future__ import annotations

import torch

from modserve.core.contract import BuildContext, NoOptions, Sampler, SamplerOutput, hookimpl
from modserve.core.row_argmax import load as load_row_argmax
from modserve.core.row_argmax import row_argmax
from modserve.core.sampling_batch import SamplingBatch, inverse_cdf, row_uniforms

MODSERVE_CONTRACT = "2.0"


class DefaultSampler(Sampler):
    Config = NoOptions

    def __init__(self, config: NoOptions, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.vocab_size = ctx.model.vocab_size
        load_row_argmax()  # compiled at start-up (~1 s on a new machine), not on the first request

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs >= 0 else None
        logits = self.process(logits, batch)
        greedy_ids = row_argmax(logits)  # torch.argmax's indices, threaded on the CPU
        if batch.all_greedy:
            token_ids = greedy_ids
        else:
            probs = self._filtered_probs(logits, batch)
            token_ids = torch.where(batch.greedy, greedy_ids, inverse_cdf(probs, row_uniforms(batch.seeds, batch.counters)))
        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
            if batch.max_logprobs > 0:
                out.top_logprobs, out.top_token_ids = raw_logprobs.topk(batch.max_logprobs, dim=-1)
        return out

    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = self.process(logits, batch)
        probs = self._filtered_probs(logits, batch)
        if batch.greedy.any():
            one_hot = torch.zeros_like(probs).scatter_(1, row_argmax(logits)[:, None], 1.0)
            probs = torch.where(batch.greedy[:, None], one_hot, probs)
        return probs

    # ----------------------------------------------------------------- steps

    def process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Penalties and min-tokens bans (these also apply to greedy rows)."""
        if batch.repetition is not None:
            logits = apply_penalties(logits, batch, self.vocab_size)
        if batch.banned_rows is not None:
            logits = logits.index_put((batch.banned_rows, batch.banned_tokens), torch.tensor(float("-inf")))
        return logits

    def _filtered_probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits / batch.temperature[:, None]
        if batch.top_k is not None or batch.top_p is not None:
            logits = top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        if batch.min_p is not None:
            keep = probs >= batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = torch.where(keep, probs, 0.0)
        return probs


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch, vocab: int) -> torch.Tensor:
    """Repetition (prompt + output, HF/vLLM style), then frequency and presence (output only)."""
    r, _ = logits.shape
    counts = torch.zeros(r, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, batch.output_ids, torch.ones_like(batch.output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros(r, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, batch.seen_ids, True)
    seen = seen[:, :vocab]
    rep = batch.repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - batch.frequency[:, None] * counts - batch.presence[:, None] * (counts > 0).to(logits.dtype)


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask everything outside each row's top-k and nucleus (at least one token survives)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= torch.arange(vocab, device=logits.device)[None, :] >= top_k[:, None]
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop |= before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


@hookimpl
def register_samplers():
    return {"default": DefaultSampler}
