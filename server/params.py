"""Request fields -> ``SamplingParams``, with the server's limits and the context-length rule.

Ranges that ``SamplingParams`` checks itself come back as its ``field: rule`` message
(a 400 naming the field). The engine's own check of a request (``Engine.validate``: the
prompt, stop ids, logits-processor fields) runs in ``fit_to_prompt``, for every prompt
of a request before any is admitted; the engine does not check again.
"""

from __future__ import annotations

from modserve.core.config import convert
from modserve.core.sampling_params import SamplingParams, StructuredOutputs
from modserve.server.errors import bad_request, from_value_error
from modserve.server.protocol import SamplingFields
from modserve.server.state import ServerState

def sampling_params(
    body: SamplingFields,
    state: ServerState,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    logprobs_param: str,
    prompt_logprobs: int | None = None,
    tool_constraint: StructuredOutputs | None = None,
) -> SamplingParams:
    cfg, vocab = state.limits, state.engine.vocab_size
    max_output = cfg.max_output_tokens
    if max_tokens is not None and max_output is not None and max_tokens > max_output:
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise bad_request(f"{param}: must be <= {max_output} (server.max_output_tokens), got {max_tokens}", param)
    if body.n > cfg.max_n:
        raise bad_request(f"n: must be <= {cfg.max_n} (server.max_n), got {body.n}", "n")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > cfg.max_stop_strings:
        raise bad_request(
            f"stop: at most {cfg.max_stop_strings} stop strings (server.max_stop_strings), got {len(stop)}", "stop"
        )
    if any(len(s) > cfg.max_stop_string_len for s in stop):
        raise bad_request(f"stop: each stop string must be <= {cfg.max_stop_string_len} characters", "stop")
    max_logprobs = min(cfg.max_top_logprobs, vocab)
    if logprobs is not None and logprobs > max_logprobs:
        raise bad_request(f"{logprobs_param}: must be <= {max_logprobs}, got {logprobs}", logprobs_param)
    asked = getattr(body, "prompt_logprobs", None)
    if asked is not None and asked > max_logprobs:
        raise bad_request(f"prompt_logprobs: must be <= {max_logprobs}, got {asked}", "prompt_logprobs")
    options = body.stream_options
    if options is not None and options.continuous_usage_stats and not options.include_usage:
        raise bad_request(
            "stream_options.continuous_usage_stats: needs stream_options.include_usage: true",
            "stream_options.continuous_usage_stats",
        )
    logit_bias = _token_keys(body.logit_bias, "logit_bias")
    constraint = structured_outputs(body, tool_constraint)
    optional = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": 0 if body.top_k is not None and body.top_k >= vocab else body.top_k,  # >= vocab: no cut
        "min_p": body.min_p,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
    }
    try:
        return SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            seed=body.seed,
            stop=stop,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=logit_bias,
            structured_outputs=constraint,
            bad_words=body.bad_words,
            allowed_token_ids=body.allowed_token_ids,
            **{k: v for k, v in optional.items() if v is not None},
        )
    except ValueError as e:
        raise from_value_error(e) from None


def structured_outputs(body: SamplingFields, tool_constraint: StructuredOutputs | None = None) -> StructuredOutputs | None:
    """The one output constraint a request asks for: ``tool_choice`` required or named (chat),
    ``response_format`` (chat), vLLM's ``structured_outputs``, or its older ``guided_*``
    fields; 400 naming the field if it asks for more than one or one is malformed."""
    found: list[tuple[str, StructuredOutputs]] = [("tool_choice", tool_constraint)] if tool_constraint else []
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(("response_format", StructuredOutputs(json_object=True)))
        elif fmt.json_schema is None or fmt.json_schema.schema is None:
            raise bad_request("response_format.json_schema.schema: required for type json_schema", "response_format")
        elif fmt.json_schema.description:  # OpenAI shows it to the model; the grammar cannot
            raise bad_request(
                "response_format.json_schema.description: not supported by this server: describe the format in the messages",
                "response_format",
            )
        else:
            found.append(("response_format", StructuredOutputs(json=fmt.json_schema.schema)))
    if body.structured_outputs is not None:
        try:
            found.append(("structured_outputs", convert(body.structured_outputs, StructuredOutputs, prefix="structured_outputs")))
        except ValueError as e:
            raise from_value_error(e) from None
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            try:
                found.append((f"guided_{kind}", StructuredOutputs(**{kind: value})))
            except ValueError as e:
                raise bad_request(f"guided_{kind}: {str(e).split(': ', 1)[-1]}", f"guided_{kind}") from None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"{found[1][0]}: one output constraint per request, got {names}", found[1][0])
    return found[0][1] if found else None


def _token_keys(mapping: dict[str, float] | None, param: str) -> dict[int, float] | None:
    """JSON object keys are strings: ``{"7042": -100}`` -> ``{7042: -100.0}``."""
    if mapping is None:
        return None
    try:
        return {int(k): float(v) for k, v in mapping.items()}
    except ValueError:
        bad = next(k for k in mapping if not k.lstrip("-").isdigit())
        raise bad_request(f"{param}: keys must be token ids, got {bad!r}", param) from None


def fit_to_prompt(
    params: SamplingParams, prompt_token_ids: list[int], state: ServerState, param: str
) -> SamplingParams:
    """Check the prompt; default ``max_tokens`` to the room left; 400 if prompt + max_tokens > max_model_len."""
    max_len, n_prompt = state.engine.max_model_len, len(prompt_token_ids)
    max_prompt = state.limits.max_prompt_tokens
    if max_prompt is not None and n_prompt > max_prompt:
        raise bad_request(
            f"{param}: {n_prompt} prompt tokens, more than server.max_prompt_tokens {max_prompt}", param, "prompt_too_long"
        )
    max_tokens = params.max_tokens
    if max_tokens is None:  # the room left, within server.max_output_tokens
        max_tokens = max(1, min(max_len - n_prompt, state.limits.max_output_tokens or max_len))
    if n_prompt + max_tokens > max_len:
        raise bad_request(
            f"This model's maximum context length is {max_len} tokens, but {n_prompt + max_tokens} were requested: "
            f"{n_prompt} in the prompt plus max_tokens {max_tokens}. Shorten the prompt or lower max_tokens.",
            param,
            "context_length_exceeded",
        )
    try:
        params = params if params.max_tokens == max_tokens else params.with_changes(max_tokens=max_tokens)
        state.engine.validate(prompt_token_ids, params)  # the engine's one check: prompt, stop ids, processor fields
    except ValueError as e:
        raise from_value_error(e) from None
    return params
