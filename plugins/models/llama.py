"""Model plugin ``llama``: the Llama-family decoder (Llama, Mistral, Qwen2) over one flat varlen batch.

Differences between the three are config switches (q/k/v bias, tied embeddings,
head_dim, RoPE scaling). Attention is delegated to the chosen attention backend, which
reads and writes the paged KV cache; the model itself holds no per-request state.

On the hot path submodules are called through ``.forward``: ``nn.Module.__call__`` costs
about 2 us of hook bookkeeping a call, 270 calls in a decode step, and modserve registers
no module hooks.

With ``tp`` (a :class:`modserve.core.distributed.tp.TPGroup`) the model is one rank's
shard (Megatron-style): this rank's heads and MLP columns, an all-reduce after
``o_proj`` and ``down_proj``, a vocab-parallel embedding and head whose logits are
gathered to rank 0. Without it (``tp=None``) nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from typing import Any

from modserve.core.contract import (
    AttentionBackend,
    AttentionMetadata,
    CausalLM,
    LayerKVCache,
    ModelArchitecture,
    ModelSpec,
    hookimpl,
)
from modserve.core.models import cpu_fused
from modserve.core.models.rope import RotaryTable, apply_rotary

MODSERVE_CONTRACT = "2.0"


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale.

    Called on the residual stream with the previous sublayer's output as ``add``, it first
    adds it in place (``residual += add``), so the add and the norm can run as one kernel.
    """

    fused = False  # set by LlamaForCausalLM.use_cpu_fused_ops

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, residual: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        if self.fused:
            return cpu_fused.add_rms_norm(residual, add, self.weight, self.eps)
        if add is not None:
            residual.add_(add)
        xf = residual.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(residual.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, tp=None) -> None:
        super().__init__()
        n = tp.world_size if tp is not None else 1
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads // n, spec.num_kv_heads // n, spec.head_dim
        self.tp = tp
        q_size, kv_size = self.num_heads * spec.head_dim, self.num_kv_heads * spec.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(spec.hidden_size, sum(self.split), bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=False)
        self.backend = backend
        self.fused = False  # set by LlamaForCausalLM.use_cpu_fused_ops

    def forward(self, x, cos, sin, cache: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)
        t = x.shape[0]
        if self.fused:  # rotate q and k in place inside the fused qkv rows
            cpu_fused.rope_(qkv, cos.squeeze(1), sin.squeeze(1), self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split(self.split, dim=-1)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        if not self.fused:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.backend.forward(q, k, v.view(t, self.num_kv_heads, self.head_dim), cache, meta)
        out = self.o_proj.forward(out.reshape(t, -1))
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp=None) -> None:
        super().__init__()
        self.intermediate = spec.intermediate_size // (tp.world_size if tp is not None else 1)
        self.tp = tp
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, spec.hidden_size, bias=False)
        self.fused = False  # set by LlamaForCausalLM.use_cpu_fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if self.fused:
            out = self.down_proj.forward(cpu_fused.silu_mul(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            out = self.down_proj.forward(F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, tp=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, backend, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, tp)

    def forward(self, residual, add, cos, sin, cache, meta) -> torch.Tensor:
        """Adds ``add`` (the previous layer's MLP output) and this layer's attention output to
        ``residual`` in place; returns this layer's MLP output, for the next one to add."""
        attn = self.self_attn.forward(self.input_layernorm.forward(residual, add), cos, sin, cache, meta)
        return self.mlp.forward(self.post_attention_layernorm.forward(residual, attn))


class LlamaForCausalLM(CausalLM):
    def __init__(
        self, spec: ModelSpec, backend: AttentionBackend, max_positions: int, num_layers: int | None = None, tp=None
    ):
        super().__init__()
        self.spec = spec
        self.tp = tp
        if tp is None:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        else:
            from modserve.core.distributed.tp import VocabParallelEmbedding

            self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(spec, backend, tp) for _ in range(num_layers or spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        vocab = spec.vocab_size if tp is None else tp.vocab_shard(spec.vocab_size)
        self.lm_head = nn.Linear(spec.hidden_size, vocab, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_positions = max_positions
        self.rotary: RotaryTable | None = None  # built by to_device, never on the meta device
        self._logits = torch.empty(0, 0)  # compute_logits' float32 rows, grown on demand

    def to_device(self, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
        self.to(device=device, dtype=dtype)
        s = self.spec
        self.rotary = RotaryTable(s.head_dim, self.max_positions, s.rope_theta, s.rope_scaling, device)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[LayerKVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm."""
        residual = self.embed_tokens(input_ids)  # a fresh tensor: the layers add into it
        cos, sin = self.rotary.lookup(positions, residual.dtype)
        add = None
        for layer, cache in zip(self.layers, caches):
            add = layer.forward(residual, add, cos, sin, cache, meta)
        return self.norm.forward(residual, add)

    def use_cpu_fused_ops(self) -> bool:
        """Run norms, SiLU·mul and RoPE as the fused C++ kernels (:mod:`cpu_fused`) where they
        support the device and dtype."""
        if not cpu_fused.can_fuse(self.embed_tokens.weight.device, self.embed_tokens.weight.dtype):
            return False
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.fused = True
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits ``[R, vocab]``; under tensor parallelism only rank 0 gets them (others None).

        A half-precision model's logits are widened into a buffer kept from step to step, so
        they stay valid until this model's next call: a fresh float32 tensor per step is
        too big for malloc to reuse (above its 32 MB mmap limit at 171+ rows of a 49k
        vocabulary), and its page faults cost 8.2 ms against 1.9 for the copy at 256 rows."""
        logits = self.lm_head.forward(hidden)
        if self.tp is not None:
            return self.tp.gather_vocab(logits.float(), self.spec.vocab_size)
        if logits.dtype == torch.float32:
            return logits
        rows, vocab = logits.shape
        if self._logits.shape[0] < rows or self._logits.shape[1] != vocab:  # the first call, or more rows
            self._logits = logits.new_empty(rows, vocab, dtype=torch.float32)
        return self._logits[:rows].copy_(logits)

    # ----------------------------------------------------------------- weight loading

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; unknown or missing names are errors."""
        if self.spec.tie_word_embeddings:  # to_empty gave the head a storage of its own
            self.lm_head.weight = self.embed_tokens.weight
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        num_layers = len(self.layers)
        for name, tensor in tensors:
            name = name.removeprefix("model.")
            if name.startswith("layers."):
                if int(name.split(".")[1]) >= num_layers:
                    continue  # a truncated (draft) model keeps only its first layers
            if "rotary_emb" in name:
                continue
            target, part = _fused_target(name)
            if part is None:
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} for {self.spec.model_type}")
                _copy(params[target], tensor, name)
                loaded.add(target)
                continue
            group = pending.setdefault(target, {})
            group[part] = tensor
            parts = ("q", "k", "v") if "qkv" in target else ("gate", "up")
            if all(p in group for p in parts):
                _copy(params[target], torch.cat([group[p] for p in parts], dim=0), target)
                loaded.add(target)
                del pending[target]
        if self.spec.tie_word_embeddings:
            loaded.add("lm_head.weight")
        missing = sorted(set(params) - loaded - {"lm_head.weight"} if self.spec.tie_word_embeddings else set(params) - loaded)
        if missing or pending:
            raise ValueError(f"weights missing from checkpoint: {(missing or sorted(pending))[:5]}")


_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _fused_target(name: str) -> tuple[str, str | None]:
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in _FUSED:
            fused, part = _FUSED[p]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), part
    return name, None


def _copy(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name!r}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


class LlamaFamily(ModelArchitecture):
    """Llama, Mistral and Qwen2: the differences are config switches (q/k/v bias, tied
    embeddings, head_dim, RoPE scaling)."""

    model_types = ("llama", "mistral", "qwen2")

    def spec(self, hf_config: dict[str, Any], source: str) -> ModelSpec:
        return ModelSpec.from_hf_config(hf_config, source)

    def build(self, spec: ModelSpec, attention: AttentionBackend, max_positions: int, num_layers: int | None, tp: Any) -> CausalLM:
        return LlamaForCausalLM(spec, attention, max_positions, num_layers, tp)


@hookimpl
def register_models():
    return {"llama": LlamaFamily}
