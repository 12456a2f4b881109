"""The pipeline config: one YAML file (or dict) describing model, plugins, server.

Validation is two-stage. The fixed sections are ``msgspec`` structs; each plugin section
is ``{plugin: name, **options}`` and its options are validated against the chosen
implementation's own ``Config`` struct (see :func:`resolve_plugin_config`). Every error
is a :class:`ConfigError` whose message starts with the dotted path of the bad key.
"""

from __future__ import annotations

import os
import re
import typing
from typing import Annotated, Any, Literal

import msgspec
import yaml

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class ConfigError(ValueError):
    """A bad pipeline or CLI value; the message names the field."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelSection(_Section):
    path: str = "smollm2-135m-instruct"  # HF directory, .gguf file, or an embedded model name
    name: str | None = None  # served model name; defaults to the path's last component
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"  # weights and activations; auto: the platform's choice (bf16 on CUDA; on the CPU bf16 where it is native, AMX-BF16 or AVX512_BF16, else fp32)
    max_model_len: Annotated[int, msgspec.Meta(ge=2)] | None = None  # prompt + output tokens; default: the model's max_position_embeddings
    tokenizer: str | None = None  # an HF directory, if not beside the weights


class ServerSection(_Section):
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: Port = 8000  # 0 picks a free port
    api_keys: list[str] | None = None  # accepted Bearer keys; none configured means no auth
    api_keys_env: str | None = None  # name of an env var with comma-separated keys
    auth_exempt_paths: list[str] = msgspec.field(default_factory=lambda: ["/health"])
    max_waiting_requests: PositiveInt = 1024  # beyond this queue length: 503 with Retry-After
    max_body_bytes: PositiveInt = 4 * 1024 * 1024  # larger request bodies get 413
    max_n: PositiveInt = 16  # largest `n` a request may ask for
    max_stop_strings: PositiveInt = 16  # most stop strings per request
    max_stop_string_len: PositiveInt = 256  # longest stop string, in characters
    max_top_logprobs: Annotated[int, msgspec.Meta(ge=0)] = 20  # largest `logprobs` / `top_logprobs`
    max_messages: PositiveInt = 512  # most messages per chat request
    max_prompt_tokens: PositiveInt | None = None  # longest prompt in tokens; above it 400 prompt_too_long (none: only max_model_len)
    max_output_tokens: PositiveInt | None = None  # largest max_tokens / max_completion_tokens; also caps chat's default
    burst_window_ms: Annotated[float, msgspec.Meta(ge=0, le=100)] = 2.0  # an idle engine's first step waits while requests keep arriving this close together (10x this at most); 0: step at once
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None  # wall-time limit per request
    shutdown_grace_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0  # SIGTERM: time in-flight requests get to finish
    log_requests: bool = True  # one access-log line per request
    log_prompts: bool = False  # include prompt and output text in logs


class ParallelSection(_Section):
    tensor_parallel_size: PositiveInt = 1  # ranks each layer is sharded over (Megatron-style); >1 starts workers
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # torch.distributed backend; auto: the platform's (nccl on CUDA, gloo on CPU)
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0  # a collective waiting longer fails the engine
    data_parallel_size: PositiveInt = 1  # engine replicas behind one server (prefix-aware routing); `serve --replicas` overrides


class RayAutoscalingSection(_Section):
    min_replicas: PositiveInt = 1
    max_replicas: PositiveInt = 2
    target_active_per_replica: PositiveInt = 16  # running + waiting requests per replica the autoscaler aims for
    kv_usage_high: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9  # a replica's KV cache fuller than this asks for one more replica
    look_back_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0  # the window the replicas' counters are averaged over (Ray's default)
    upscale_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 5.0  # how long a scale-up decision must hold before replicas start
    downscale_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0  # how long a scale-down decision must hold before replicas stop

    def __post_init__(self) -> None:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas: {self.max_replicas} is below min_replicas {self.min_replicas}")


class RaySection(_Section):
    address: str = "auto"  # the Ray cluster to deploy on (auto: the one this node belongs to); `modserve ray serve --address` overrides
    app_name: str = "modserve"  # the Ray Serve application's name
    num_replicas: PositiveInt | None = None  # engine replicas (default 1); leave unset with autoscaling
    autoscaling: RayAutoscalingSection | None = None  # scale replicas on the engines' waiting requests and KV usage
    num_cpus_per_replica: Annotated[float, msgspec.Meta(gt=0)] = 1.0  # CPUs Ray reserves per engine replica (and its torch threads); per rank with tensor parallelism
    num_gpus_per_replica: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # GPUs Ray reserves per engine replica; per rank with tensor parallelism
    router: Literal["prefix", "power_of_two"] = "prefix"  # prefix: a prompt's leading blocks go where they are cached, else least loaded; power_of_two: Ray Serve's default
    max_ongoing_requests: PositiveInt = 64  # requests one replica holds at once; more wait at the ingress
    max_retries: Annotated[int, msgspec.Meta(ge=0)] = 1  # a request whose replica died before sending anything is retried this often
    routing_stats_period_s: Annotated[float, msgspec.Meta(gt=0)] = 0.5  # how often the router reads each engine's counters

    def __post_init__(self) -> None:
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("num_replicas: give either num_replicas or autoscaling, not both")


class PipelineConfig(_Section):
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    device: str | dict[str, Any] = "cpu"  # a platform plugin (cpu, cuda, an installed one) or auto; {plugin: cpu, ...} for its options
    seed: int = 0  # seeds the per-request seeds of requests that give none
    scheduler: dict[str, Any] = msgspec.field(default_factory=lambda: {"plugin": "fcfs"})
    kv_cache: dict[str, Any] = msgspec.field(default_factory=lambda: {"plugin": "paged"})
    attention: dict[str, Any] = msgspec.field(default_factory=lambda: {"plugin": "auto"})  # auto: the platform's default
    sampler: dict[str, Any] = msgspec.field(default_factory=lambda: {"plugin": "default"})
    logits_processors: list[dict[str, Any]] = msgspec.field(  # per-request biases and constraints
        default_factory=lambda: [{"plugin": p} for p in ("logit_bias", "structured_outputs", "bad_words", "allowed_token_ids")]
    )
    speculative: dict[str, Any] | None = None  # null: no speculative decoding
    tool_parser: str | dict[str, Any] | None = "hermes"  # reads tool calls from the output (tool_choice auto); null: auto is refused
    reasoning_parser: str | dict[str, Any] | None = None  # splits thinking into reasoning_content (e.g. think); null: none
    observers: list[dict[str, Any]] = msgspec.field(default_factory=lambda: [{"plugin": "metrics"}])  # metrics, tracing, third-party loggers
    server: ServerSection = msgspec.field(default_factory=ServerSection)
    parallel: ParallelSection = msgspec.field(default_factory=ParallelSection)
    ray: RaySection | None = None  # deployment on Ray Serve (`modserve ray serve`); `serve` runs on one machine and says so


PLUGIN_SECTIONS = {  # pipeline key -> plugin kind
    "device": "platforms",
    "scheduler": "schedulers",
    "kv_cache": "kv_backends",
    "attention": "attention_backends",
    "sampler": "samplers",
    "logits_processors": "logits_processors",
    "speculative": "speculative_decoders",
    "tool_parser": "tool_parsers",
    "reasoning_parser": "reasoning_parsers",
    "observers": "observers",
}
NESTED_PLUGIN_KEYS = {"kv_cache.eviction": "eviction_policies"}  # a plugin named inside another's options


def load_pipeline(source: str | os.PathLike | dict | PipelineConfig | None = None, **overrides: Any) -> PipelineConfig:
    """Read a pipeline from a YAML path, a dict or an existing config, applying top-level overrides."""
    if isinstance(source, PipelineConfig):
        raw: dict[str, Any] = msgspec.to_builtins(source)
    elif isinstance(source, dict):
        raw = dict(source)
    elif source is None:
        raw = {}
    else:
        raw = _read_yaml(str(source))
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict) and key in ("model", "server", "parallel"):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return convert(raw, PipelineConfig)


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"pipeline file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


_PATH_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def convert(raw: Any, struct: type, prefix: str = "") -> Any:
    """``msgspec.convert`` with errors rewritten as ``path.to.key: expected X, got Y``."""
    try:
        return msgspec.convert(raw, struct)
    except msgspec.ValidationError as e:
        raise ConfigError(format_validation_error(e, raw, prefix, struct)) from None


def format_validation_error(err: msgspec.ValidationError, raw: Any, prefix: str = "", struct: type | None = None) -> str:
    m = _PATH_RE.match(str(err))
    assert m is not None
    msg, path = m.group("msg"), m.group("path") or ""
    keys = [k for k in re.split(r"\.|\[(\d+)\]", path) if k]
    if msg.startswith("Object contains unknown field"):
        keys.append(msg.split("`")[1])
        msg = "unknown key"
    elif sub := re.match(r"^(\w+): (.*)$", msg, re.S):  # a __post_init__ check naming its field
        keys.append(sub.group(1))
        msg = sub.group(2)
    elif msg.startswith("Invalid enum value"):
        choices = _literal_choices(struct, keys)
        msg = f"expected one of {', '.join(map(str, choices))}" if choices else "invalid value"
        value = _lookup(raw, keys)
        msg += f", got {value!r}" if value is not _MISSING else ""
    msg = msg.replace("`", "")
    if msg.startswith("Expected"):
        msg = "e" + re.sub(r", got \w+$", "", msg[1:])
        value = _lookup(raw, keys)
        if value is not _MISSING:
            msg += f", got {value!r}"
    dotted = ".".join(filter(None, [prefix, *keys])) or "(top level)"
    return f"{dotted}: {msg}"


def _literal_choices(struct: type | None, keys: list[str]) -> tuple:
    """The allowed values of a ``Literal`` field at ``keys`` inside ``struct``, if it is one."""
    tp: Any = struct
    for key in keys:
        fields = {f.name: f.type for f in msgspec.structs.fields(tp)} if msgspec.inspect.type_info(tp) else {}
        tp = fields.get(key)
        for arg in typing.get_args(tp) or ():  # Optional[Struct] -> Struct
            if isinstance(arg, type) and issubclass(arg, msgspec.Struct):
                tp = arg
        if tp is None:
            return ()
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        return args
    return tuple(a for arg in args if typing.get_origin(arg) is Literal for a in typing.get_args(arg))


_MISSING = object()


def _lookup(raw: Any, keys: list[str]) -> Any:
    for k in keys:
        if isinstance(raw, dict) and k in raw:
            raw = raw[k]
        elif isinstance(raw, list) and k.isdigit() and int(k) < len(raw):
            raw = raw[int(k)]
        else:
            return _MISSING
    return raw


def api_keys(server: ServerSection) -> list[str]:
    """The configured API keys: the explicit list plus those in ``api_keys_env``."""
    keys = list(server.api_keys or [])
    if server.api_keys_env:
        keys += [k.strip() for k in os.environ.get(server.api_keys_env, "").split(",") if k.strip()]
    return keys
