"""The decoder-only language model the model plugins share: embedding, a stack of layers over
the residual stream, final norm, LM head, RoPE table and weight loading by HF names.

A plugin builds its layers and says where each checkpoint tensor goes (:meth:`DecoderLM.route`);
the rest is here. Layers follow one protocol, ``forward(residual, add, cos, sin, cache, meta)
-> add``: ``residual`` is the stream (updated in place), ``add`` the previous layer's last
sublayer output, so the add and the next norm run as one fused kernel.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from modserve.core.contract import AttentionMetadata, CausalLM, LayerKVCache, ModelSpec
from modserve.core.models import cpu_fused
from modserve.core.models.rope import RotaryTable
from modserve.plugins.models.layers import MLP, Attention, RMSNorm

Index = tuple[int | slice, ...]

# checkpoint projection -> (fused module, which part)
FUSED_PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class PreNormLayer(nn.Module):
    """Llama's layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``mlp`` may be a mixture of experts."""

    def __init__(self, spec: ModelSpec, attention: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = mlp

    def forward(self, residual, add, cos, sin, cache, meta) -> torch.Tensor:
        """Adds ``add`` (the previous layer's MLP output) and this layer's attention output to
        ``residual`` in place; returns this layer's MLP output, for the next one to add."""
        attn = self.self_attn.forward(self.input_layernorm.forward(residual, add), cos, sin, cache, meta)
        return self.mlp.forward(self.post_attention_layernorm.forward(residual, attn))


class DecoderLM(CausalLM):
    """Embedding -> layers -> norm -> LM head. Subclasses pass their layers and may override
    :meth:`route` for checkpoint names of their own.

    Gemma's switches: ``embed_scale`` multiplies the embeddings (rounded to the model's dtype,
    as HF does), ``norm_offset`` makes the final norm scale by ``1 + weight``, and
    ``final_logit_softcap`` caps the logits at ``cap * tanh(logits / cap)``. Each layer whose
    attention differs from plain causal (``spec.layer_window``, ``spec.attn_logit_softcap``)
    gets its backend's per-layer view (:meth:`AttentionBackend.for_layer`); a window that
    covers ``max_positions`` changes nothing and is not asked for."""

    capturable = True  # no host waits in forward (a mixture of experts' model says otherwise)
    fused_lookups = False  # embedding and RoPE rows by cpu_fused.gather_rows (set by use_cpu_fused_ops)

    def __init__(
        self, spec: ModelSpec, layers: Iterable[nn.Module], max_positions: int, tp=None, *,
        embed_scale: float | None = None, norm_offset: bool = False, final_logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        if tp is None:
            # given its (empty) weight: no random init, which on the meta device imports torch._dynamo (2-3 s)
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, _weight=torch.empty(spec.vocab_size, spec.hidden_size))
        else:
            from modserve.core.distributed.tp import VocabParallelEmbedding

            self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self._per_layer_attention(spec, max_positions)
        self.embed_scale = embed_scale
        self.final_logit_softcap = final_logit_softcap
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, norm_offset)
        vocab = spec.vocab_size if tp is None else tp.vocab_shard(spec.vocab_size)
        self.lm_head = nn.Linear(spec.hidden_size, vocab, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_positions = max_positions
        self.rotary: RotaryTable | None = None  # built by to_device, never on the meta device
        self._logits = torch.empty(0, 0)  # compute_logits' float32 rows, grown on demand

    def _per_layer_attention(self, spec: ModelSpec, max_positions: int) -> None:
        for i, layer in enumerate(self.layers):
            window = spec.layer_window(i)
            window = window if window is not None and window < max_positions else None
            if window is None and spec.attn_logit_softcap is None:
                continue
            for module in layer.modules():
                if isinstance(module, Attention):
                    module.backend = module.backend.for_layer(window, spec.attn_logit_softcap)

    def to_device(self, device: torch.device, dtype: torch.dtype) -> DecoderLM:
        self.to(device=device, dtype=dtype)
        s = self.spec
        self.rotary = RotaryTable(s.rotary_dim or s.head_dim, self.max_positions, s.rope_theta, s.rope_scaling, device)
        if self.embed_scale is not None:  # the scale rounded to the model's dtype, made once (no tensor during a capture)
            self.embed_scale_rounded = float(torch.tensor(self.embed_scale, dtype=dtype))
        return self

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerKVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm."""
        residual = self.embed(input_ids)
        cos, sin = self.rotary_rows(self.rotary, positions, residual.dtype, meta)
        add = None
        for layer, cache in zip(self.layers, caches):
            add = layer.forward(residual, add, cos, sin, cache, meta)
        return self.norm.forward(residual, add)

    def rotary_rows(self, table: RotaryTable, positions: torch.Tensor, dtype: torch.dtype, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """``table``'s cos/sin rows for the step, looked up by the fused kernels where they run."""
        kernels = (cpu_fused.gather_rows, cpu_fused.longrope_rows) if self.fused_lookups else (None, None)
        return table.lookup(positions, dtype, meta, *kernels)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings, a fresh tensor (the layers add into it), scaled by ``embed_scale``."""
        if self.fused_lookups:
            x = cpu_fused.gather_rows(self.embed_tokens.weight, input_ids, self.embed_tokens.weight.dtype)
        else:
            x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # HF's normalizer: the scale in the model's dtype
            if self.fused_lookups:
                cpu_fused.scale_(x, self.embed_scale_rounded)
            else:
                x.mul_(torch.tensor(self.embed_scale, dtype=x.dtype))
        return x

    def use_cpu_fused_ops(self) -> bool:
        """Run norms, SiLU·mul and RoPE as the fused C++ kernels (:mod:`cpu_fused`) where they
        support the device and dtype: every submodule with a ``fused`` switch."""
        if not cpu_fused.can_fuse(self.embed_tokens.weight.device, self.embed_tokens.weight.dtype):
            return False
        for module in self.modules():
            if hasattr(module, "fused"):
                module.fused = True
        self.fused_lookups = self.tp is None  # a vocabulary-parallel embedding looks up its own shard
        for module in self.modules():
            if isinstance(module, MLP):
                module.fuse_gated_product()
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits ``[R, vocab]``; under tensor parallelism only rank 0 gets them (others None).

        A half-precision model's logits are widened into a buffer kept from step to step, so
        they stay valid until this model's next call: a fresh float32 tensor per step is
        too big for malloc to reuse (above its 32 MB mmap limit at 171+ rows of a 49k
        vocabulary), and its page faults cost 8.2 ms against 1.9 for the copy at 256 rows."""
        logits = self.lm_head.forward(hidden)
        if self.tp is not None:
            out = self.tp.gather_vocab(logits.float(), self.spec.vocab_size)
        elif logits.dtype == torch.float32:
            out = logits
        else:
            rows, vocab = logits.shape
            if self._logits.shape[0] < rows or self._logits.shape[1] != vocab:  # the first call, or more rows
                self._logits = logits.new_empty(rows, vocab, dtype=torch.float32)
            out = self._logits[:rows].copy_(logits)
        if out is not None and self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            out.div_(cap).tanh_().mul_(cap)
        return out

    # ----------------------------------------------------------------- weight loading

    def route(self, name: str) -> tuple[str, Index | None] | None:
        """Where checkpoint tensor ``name`` (``model.`` stripped) goes: a parameter name and the
        part of it (None: all of it), or None to skip the tensor. By default q/k/v and
        gate/up projections fill their fused module's rows in order."""
        if "rotary_emb" in name:
            return None
        parts = name.split(".")
        for i, p in enumerate(parts):
            if p in FUSED_PARTS:
                fused, which = FUSED_PARTS[p]
                target = ".".join(parts[:i] + [fused] + parts[i + 1 :])
                return target, (self._fused_rows(target, which),)
        return name, None

    def _fused_rows(self, target: str, which: int) -> slice:
        """Rows of part ``which`` of a fused projection: q, k, v of the attention's split, or gate, up."""
        linear = target.rsplit(".", 1)[0]  # layers.0.self_attn.qkv_proj
        owner = self.get_submodule(linear.rsplit(".", 1)[0])  # its Attention or MLP
        sizes = owner.split if linear.endswith("qkv_proj") else (owner.intermediate,) * 2
        start = sum(sizes[:which])
        return slice(start, start + sizes[which])

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; an unknown name, a wrong shape or a parameter left partly
        unfilled is an error."""
        if self.spec.tie_word_embeddings:  # to_empty gave the head a storage of its own
            self.lm_head.weight = self.embed_tokens.weight
        params = dict(self.named_parameters())  # a tied head is the embedding's parameter, listed once
        filled: dict[str, int] = {}
        num_layers = len(self.layers)
        for name, tensor in tensors:
            name = name.removeprefix("model.")
            if name.startswith("layers.") and int(name.split(".")[1]) >= num_layers:
                continue  # a truncated (draft) model keeps only its first layers
            routed = self.route(name)
            if routed is None:
                continue
            target, index = routed
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {self.spec.model_type}")
            dest = params[target].data if index is None else params[target].data[index]
            if dest.shape != tensor.shape:
                raise ValueError(f"weight {name!r}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dest.shape)}")
            with torch.no_grad():
                dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + tensor.numel()
        missing = sorted(n for n, p in params.items() if filled.get(n, 0) != p.numel())
        if missing:
            raise ValueError(f"weights missing from checkpoint: {missing[:5]}")


def llama_layers(spec: ModelSpec, backend, tp, num_layers: int | None, qk_norm=None) -> list[PreNormLayer]:
    """Pre-norm layers with a dense gated MLP (Llama, Mistral, Qwen2, Qwen3, Phi-3)."""
    return [PreNormLayer(spec, Attention(spec, backend, tp, qk_norm), MLP(spec, tp)) for _ in range(num_layers or spec.num_layers)]
