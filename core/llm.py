"""The offline API, named like vLLM's: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import os
from typing import Any

from modserve.core.parallel_sampling import Finals
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
        for (token_ids, _), params in zip(encoded, params_list):  # all or nothing
            self.engine.validate(token_ids, params)
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
        finals = Finals()
        ids: list[str] = []
        try:
            for i, ((token_ids, _), params) in enumerate(zip(encoded, params_list)):
                ids.append(f"llm-{id(self)}-{engine._step}-{i}")
                engine.enqueue(token_ids, params, request_id=ids[-1])
            while engine.has_unfinished():
                for out in engine.step():
                    finals.add(out)
        except BaseException:
            engine.abort_request(ids)
            raise
        outputs = [finals.get(rid) for rid in ids]
        for out, (_, text) in zip(outputs, encoded):
            out.prompt = text
        return outputs
