"""The offline API, named like vLLM's: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import os
from typing import Any

from modserve.core import parallel_sampling
from modserve.core.engine import Engine
from modserve.core.outputs import RequestOutput
from modserve.core.sampling_params import SamplingParams

PromptLike = str | dict[str, Any] | list[int]


class LLM:
    """``LLM("pipeline.yaml")``, ``LLM({...})`` or ``LLM(model="path", **top_level_overrides)``."""

    def __init__(self, config: str | os.PathLike | dict | None = None, *, model: str | dict | None = None, **overrides: Any):
        """``model`` is a path (``LLM(model="dir")``) or a partial model section to merge."""
        if isinstance(model, dict):
            overrides["model"] = model
        elif model is not None:
            overrides["model"] = {"path": model}
        self.engine = Engine.from_config(config, **overrides)
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptLike | list[PromptLike],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        for token_ids, _ in encoded:
            self.engine.check_prompt(token_ids)
        return self._run(encoded, params_list)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation, or a list of them, rendered through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.tokenizer.encode_chat(conv, add_generation_prompt)} for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    # ----------------------------------------------------------------- internals

    def _encode(self, prompt: PromptLike) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, list):
            return list(prompt), None
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"]), prompt.get("prompt")
        if "prompt" in prompt:
            return self.tokenizer.encode(prompt["prompt"]), prompt["prompt"]
        raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")

    def _run(self, encoded: list[tuple[list[int], str | None]], params_list: list[SamplingParams]) -> list[RequestOutput]:
        engine = self.engine
        finished: dict[str, RequestOutput] = {}
        groups: list[tuple[str, str | None, list[str]]] = []
        try:
            for i, ((token_ids, text), params) in enumerate(zip(encoded, params_list)):
                parent = f"llm-{id(self)}-{engine._step}-{i}"
                seqs = engine.add_request(token_ids, params, request_id=parent)
                groups.append((parent, text, [s.request_id for s in seqs]))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        except BaseException:
            engine.abort_request([cid for _, _, ids in groups for cid in ids])
            raise
        return [parallel_sampling.merge(parent, text, [finished[c] for c in ids]) for parent, text, ids in groups]
