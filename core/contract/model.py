"""Models: an architecture family as a plugin (HF config -> spec -> module, weight names).

Adding an architecture is a ``register_models`` plugin; the core's loader reads files
(safetensors, GGUF), asks the registry for the architecture whose ``model_types`` holds
the checkpoint's ``model_type``, and hands it the tensors. The module it builds is a
:class:`~modserve.core.contract.causal_lm.CausalLM`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from modserve.core.contract.plugin import Plugin

if TYPE_CHECKING:
    from modserve.core.contract.attention import AttentionBackend
    from modserve.core.contract.causal_lm import CausalLM
    from modserve.core.contract.model_spec import ModelSpec


class ModelArchitecture(Plugin):
    """An architecture family, e.g. ``llama`` serving Llama, Mistral and Qwen2 checkpoints."""

    model_types: ClassVar[tuple[str, ...]]  # HF ``model_type`` values (GGUF ``general.architecture``) served

    @abstractmethod
    def spec(self, hf_config: dict[str, Any], source: str) -> ModelSpec:
        """The model's shape from an HF ``config.json`` dict; raise ``ValueError`` naming
        ``source`` and the unsupported setting."""

    def supports_tensor_parallel(self, spec: ModelSpec) -> bool:
        """Whether the core's Megatron-style sharding of q/k/v, o, gate/up and down projections
        serves this model (``parallel.tensor_parallel_size > 1`` is refused otherwise)."""
        return True

    @abstractmethod
    def build(
        self, spec: ModelSpec, attention: AttentionBackend, max_positions: int, num_layers: int | None, tp: Any
    ) -> CausalLM:
        """The module, built on the meta device by the caller. ``num_layers`` truncates (a draft
        made of the first layers); ``tp`` is the tensor-parallel group or None."""
