"""modserve: a plugin-based, modular LLM serving engine.

The top-level package re-exports the offline API lazily, so that light commands
(``modserve validate``, ``modserve plugins``) do not pay for importing torch.
The engine lives in ``modserve.core`` and the shipped plugins in ``modserve.plugins``.
"""

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from modserve.core.llm import LLM

        return LLM
    if name == "SamplingParams":
        from modserve.core.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from modserve.core import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'modserve' has no attribute {name!r}")
