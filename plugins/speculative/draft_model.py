"""Speculative proposer ``draft_model``: a smaller model proposes ``k`` tokens greedily.

The draft is either another checkpoint with the same tokenizer (``path``), or the
target's own first ``N`` layers plus its norm and head (``draft: {layers: N}``), which
needs no second model file: the target module runs only as many layers as the draft's
KV cache has. The draft keeps its own paged KV; after verification only the tokens the
target kept stay valid there (the longest common prefix), the rest is recomputed.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch

from modserve.core.contract import BuildContext, KVSpec, Proposer, ScheduledRequest, SchedulerOutput, SpeculativeConfig, hookimpl
from modserve.core.request import Request
from modserve.core.runner import ModelRunner
from modserve.plugins.kv_backends.paged import PagedConfig, PagedKVBackend

MODSERVE_CONTRACT = "2.0"


class DraftLayers(msgspec.Struct, forbid_unknown_fields=True):
    layers: Annotated[int, msgspec.Meta(ge=1)]


class DraftConfig(SpeculativeConfig, kw_only=True):
    path: str | None = None  # a draft checkpoint with the target's tokenizer
    draft: DraftLayers | None = None  # or {layers: N}: the target's first N layers
    num_blocks: Annotated[int, msgspec.Meta(ge=1)] = 1024  # the draft's own KV capacity
    block_size: Annotated[int, msgspec.Meta(ge=1)] = 16  # the draft's KV block size

    def __post_init__(self) -> None:
        if (self.path is None) == (self.draft is None):
            raise ValueError("draft: give exactly one of `path` (a draft checkpoint) or `draft: {layers: N}`")


class DraftModelProposer(Proposer):
    Config = DraftConfig

    def __init__(self, config: DraftConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        target = ctx.target
        if config.draft is not None:
            if config.draft.layers >= ctx.model.num_layers:
                raise ValueError(
                    f"speculative.draft.layers: must be < the target's {ctx.model.num_layers} layers, got {config.draft.layers}"
                )
            model, spec, num_layers = target.module, ctx.model, config.draft.layers
        else:
            loaded = target.load(config.path)
            if loaded.tokenizer.tokenizer.get_vocab() != target.tokenizer.tokenizer.get_vocab():
                raise ValueError(f"speculative.path: the draft model {config.path!r} has a different tokenizer from the target")
            model, spec, num_layers = loaded.model, loaded.spec, loaded.spec.num_layers
        kv_cfg = PagedConfig(block_size=config.block_size, num_blocks=config.num_blocks, prefix_caching=False)
        kv_spec = KVSpec(num_layers, spec.num_kv_heads, spec.head_dim, ctx.dtype, ctx.device, ctx.max_model_len)
        self.kv = PagedKVBackend(kv_cfg, ctx.with_(model=spec, kv_spec=kv_spec, kv=None))
        attention = model.layers[0].self_attn.backend
        self.runner = ModelRunner(model, self.kv, attention, ctx.device)
        self._shadows: dict[str, Request] = {}  # per request: the tokens whose KV the draft holds

    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        shadows = [self._catch_up(r) for r in requests]
        active = [(s, s.num_tokens - s.num_computed_tokens) for s in shadows if s is not None]
        for _ in range(k):
            active = [(s, n) for s, n in active if self.kv.allocate(s, n)]
            if not active:
                break
            sched = SchedulerOutput([ScheduledRequest(s, n) for s, n in active])
            batch = self.runner.prepare(sched)
            rows = list(torch.tensor([n for _, n in active]).cumsum(0).sub(1).tolist())
            tokens = self.runner.execute(batch, rows).argmax(dim=-1).tolist()
            for (s, n), tok in zip(active, tokens):
                s.num_computed_tokens += n
                s.all_token_ids.append(tok)
            active = [(s, 1) for s, _ in active]
        return [s.all_token_ids[r.num_tokens :] if s is not None else [] for r, s in zip(requests, shadows)]

    def _catch_up(self, request: Request) -> Request | None:
        """The request's shadow with KV kept for the longest prefix the target agrees with."""
        shadow = self._shadows.get(request.request_id)
        if shadow is None:
            shadow = self._shadows[request.request_id] = Request(request.request_id, [], request.sampling_params)
        valid = _common_prefix(shadow.all_token_ids, request.all_token_ids, shadow.num_computed_tokens)
        shadow.num_computed_tokens = min(valid, request.num_tokens - 1)
        shadow.all_token_ids = list(request.all_token_ids)
        self.kv.trim(shadow, shadow.num_computed_tokens)
        return shadow

    def release(self, request: Request) -> None:
        shadow = self._shadows.pop(request.request_id, None)
        if shadow is not None:
            self.kv.free(shadow)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@hookimpl
def register_speculative_decoders():
    return {"draft_model": DraftModelProposer}
