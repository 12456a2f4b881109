"""The typed context every plugin is built with: ``cls(config, ctx)``.

The engine builds the kinds in a fixed order and fills the context as it goes:
platform -> model spec -> KV backend -> attention -> model -> scheduler -> sampler ->
logits processors -> speculative proposer -> observers. The table says which fields a
kind may rely on; a field marked "later" is ``None`` while that kind is built.

| field | platform | KV, eviction | attention | scheduler, sampler, logits, observer | proposer |
|---|---|---|---|---|---|
| registry, max_model_len | yes | yes | yes | yes | yes |
| platform, device, dtype | later | yes | yes | yes | yes |
| model, tokenizer, kv_spec | later | yes | yes | yes | yes |
| kv | later | later | yes | yes | yes |
| target | later | later | later | later | yes |
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from modserve.core.contract.attention import AttentionSpec
    from modserve.core.contract.kv import KVBackend, KVSpec
    from modserve.core.contract.model_spec import ModelSpec
    from modserve.core.contract.platform import Platform
    from modserve.core.contract.speculative import TargetModel
    from modserve.core.tokenizer import TokenizerBundle


@dataclass(frozen=True)
class BuildContext:
    registry: Any  # modserve.core.plugin_manager.PluginRegistry: build sub-plugins through it
    max_model_len: int | None  # the pipeline's model.max_model_len (None: the model's own limit)
    model_name: str = ""  # the served model name
    replica: int | None = None  # data-parallel replica index (None: a single engine)
    shards: int = 1  # tensor-parallel world size: attention and KV hold 1/shards of the KV heads
    platform: Platform | None = None
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    model: ModelSpec | None = None  # the architecture's shape (full, not sharded)
    tokenizer: TokenizerBundle | None = None  # the checkpoint's tokenizer (set with ``model``)
    kv_spec: KVSpec | None = None  # what the KV backend must hold (this rank's KV heads)
    kv: KVBackend | None = None  # the built KV backend (its ``block_size`` is attention's)
    target: TargetModel | None = None  # the loaded target model, for speculative proposers
    attention: AttentionSpec | None = None  # an attention shape of its own (a kernel test); default: derived

    def with_(self, **changes: Any) -> BuildContext:
        return replace(self, **changes)

    def attention_spec(self, model: ModelSpec | None = None) -> AttentionSpec:
        """The attention shape for ``model`` (default: this engine's) on this rank, with the KV
        backend's block size."""
        from modserve.core.contract.attention import AttentionSpec

        if self.attention is not None and model is None:
            return self.attention
        m = model or self.model
        assert m is not None and self.kv is not None, "attention is built after the model spec and the KV backend"
        return AttentionSpec(
            m.num_heads // self.shards, m.num_kv_heads // self.shards, m.head_dim, m.attention_scale or m.head_dim**-0.5,
            self.dtype, self.device, self.kv.block_size, m.sliding_window,
        )
