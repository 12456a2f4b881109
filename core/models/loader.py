"""Finds a model by path or name and builds it: HF directory, ``.gguf`` file, or the embedded default."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from modserve.core.contract import AttentionBackend, BuildContext, CausalLM, ModelArchitecture, ModelSpec
from modserve.core.contract.experts import ExpertMLP
from modserve.core.models.kept_weights import FloatWeight, KeptLinear, load_keeping_weights
from modserve.core.models.prequantized import QuantFormat, quantized_tensors, read_format
from modserve.core.models.gguf_reader import find_smollm2_gguf, read_gguf
from modserve.core.config import ConfigError
from modserve.core.tokenizer import TokenizerBundle

EMBEDDED_MODELS = {"smollm2-135m-instruct": find_smollm2_gguf}
log = logging.getLogger("modserve.loader")


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass
class ModelSource:
    """What was found at a model path, before any weights are read."""

    path: str
    kind: str  # "hf" | "gguf"
    default_name: str


def locate(path: str) -> ModelSource:
    """Resolve ``path`` to an HF directory, a GGUF file or an embedded model name."""
    if path in EMBEDDED_MODELS:
        return ModelSource(EMBEDDED_MODELS[path](), "gguf", path)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ModelNotFoundError(f"model directory {path!r} has no config.json")
        return ModelSource(path, "hf", os.path.basename(os.path.normpath(path)))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(path, "gguf", os.path.basename(path).removesuffix(".gguf"))
    raise ModelNotFoundError(
        f"model not found: {path!r} is not an HF directory (with config.json), a .gguf file, "
        f"or a known model name ({', '.join(EMBEDDED_MODELS)})"
    )


@dataclass
class Checkpoint:
    """An opened checkpoint: its architecture plugin, shape, tokenizer and (lazy) tensors."""

    arch: ModelArchitecture
    spec: ModelSpec
    tokenizer: TokenizerBundle
    tensors: Iterator[tuple[str, torch.Tensor]]  # with kept_weights, quantized linear weights are KeptTensor
    kept_weights: bool = False  # linear weights stay as the file stores them until the platform builds them
    quantization: QuantFormat | None = None  # a pre-quantized HF checkpoint's format


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: CausalLM
    tokenizer: TokenizerBundle


def architecture(model_type: str | None, ctx: BuildContext, source: str) -> ModelArchitecture:
    """The registered model plugin serving ``model_type``; an unsupported one is refused with the list."""
    served: dict[str, type[ModelArchitecture]] = {}
    for impl in ctx.registry.implementations("models").values():
        for t in impl.cls.model_types:
            served.setdefault(t, impl.cls)
    if model_type not in served:
        raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(served)}")
    cls = served[model_type]
    return cls(cls.Config(), ctx)


def open_checkpoint(source: ModelSource, ctx: BuildContext, tokenizer_path: str | None = None, tp=None) -> Checkpoint:
    """Read config and tokenizer and pick the architecture; tensors are read as they are consumed.

    With ``tp`` (a :class:`modserve.core.distributed.sharding.TPShard`) only this rank's shard
    is read: safetensors slices are read straight from the file; a GGUF file is dequantized
    whole (tensor by tensor, the full tensors freed as they are sliced)."""
    if source.kind == "hf":
        cfg = _hf_config_with_generation(source.path)
        where = os.path.join(source.path, "config.json")
        arch = architecture(cfg.get("model_type"), ctx, where)
        quant = read_format(cfg, where) if cfg.get("quantization_config") else None
        if quant is not None and tp is not None:
            raise ConfigError(
                f"parallel.tensor_parallel_size: {where} is a pre-quantized checkpoint ({quant.kind}), which is not sharded "
                "yet; use tensor_parallel_size 1"
            )
        spec = arch.spec(cfg, where)
        tokenizer = TokenizerBundle.from_hf_dir(tokenizer_path or source.path, spec.eos_token_ids)
        tensors: Iterator[tuple[str, torch.Tensor]] = _safetensors(source.path, spec, tp)
        if quant is not None:
            tensors = quantized_tensors(tensors, quant)
    else:
        quant = None
        g = read_gguf(source.path, dtype=ctx.dtype, keep_blocks=tp is None)
        arch = architecture(g.config.get("model_type"), ctx, source.path)
        spec = arch.spec(g.config, source.path)
        tokenizer = TokenizerBundle(g.tokenizer, g.chat_template, g.bos_token, g.eos_token, list(g.eos_token_ids))
        if tokenizer_path:
            tokenizer = TokenizerBundle.from_hf_dir(tokenizer_path, g.eos_token_ids)
        tensors = iter(g.tensors.items()) if tp is None else _sliced(g.tensors, spec, tp)
    if tp is not None:
        from modserve.core.distributed.sharding import check_divisible

        if not arch.supports_tensor_parallel(spec):
            raise ConfigError(
                f"parallel.tensor_parallel_size: {spec.model_type} models cannot be sharded yet; use tensor_parallel_size 1"
            )
        check_divisible(spec, tp.world_size)
    spec.eos_token_ids = tokenizer.eos_token_ids or spec.eos_token_ids
    tokenizer.eos_token_ids = spec.eos_token_ids
    return Checkpoint(arch, spec, tokenizer, tensors, kept_weights=(source.kind == "gguf" and tp is None) or quant is not None,
                      quantization=quant)


def check_max_model_len(spec: ModelSpec, max_model_len: int | None) -> int:
    """The engine's context length: the pipeline's, within what the model supports."""
    if max_model_len is not None and max_model_len > spec.max_position_embeddings:
        raise ValueError(
            f"model.max_model_len: {max_model_len} exceeds the model's max_position_embeddings "
            f"{spec.max_position_embeddings}"
        )
    # A sliding window shorter than this is served through each layer's attention view
    # (AttentionBackend.for_layer, asked for by the model at build time): a backend without
    # windows refuses there, naming itself; one within max_model_len needs no window at all.
    return max_model_len or spec.max_position_embeddings


def build_model(
    ckpt: Checkpoint, attention: AttentionBackend, ctx: BuildContext, max_positions: int, num_layers: int | None = None, tp=None
) -> CausalLM:
    """Build the architecture's module on the meta device, load the tensors, move it to the
    platform's device and dtype, and let the platform adapt it (its mixtures of experts, its
    linear layers, fused ops).

    From a GGUF file or a pre-quantized HF checkpoint (``ckpt.kept_weights``) the quantized
    linear weights are not loaded: each layer goes to the platform as a :class:`KeptLinear`
    holding the file's blocks or codes, dequantized only if the platform reads its ``weight``
    (module doc of :mod:`~modserve.core.models.kept_weights`), so no float copy of the whole
    model is ever made."""
    with torch.device("meta"):
        model = ckpt.arch.build(ckpt.spec, attention, max_positions, num_layers, tp)
    if ckpt.kept_weights:
        kept = load_keeping_weights(model, ckpt.tensors, ctx.dtype)
        for name, parts in kept.items():  # before to_device: a meta weight cannot be moved
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent)
            setattr(owner, attr, KeptLinear(getattr(owner, attr), parts, ctx.device, ctx.dtype))
    else:
        model.to_empty(device="cpu")
        model.load_weights(ckpt.tensors)
    model.to_device(ctx.device, ctx.dtype)
    model.eval().requires_grad_(False)
    for parent, qualified, name, child in _children(model, lambda m: isinstance(m, ExpertMLP)):
        setattr(parent, name, ctx.platform.experts(qualified, child))  # before the linears: its router is one
    dequantized = 0
    for parent, qualified, name, child in _children(model, lambda m: type(m) in (nn.Linear, KeptLinear)):
        module = ctx.platform.linear(qualified, child)
        if isinstance(child, KeptLinear):
            if module is child:
                child.weight  # kept as an nn.Linear: dequantize it now, not in the first step
            dequantized += child.dequantized and not all(isinstance(p, FloatWeight) for p in child.parts)
        setattr(parent, name, module)
    if ckpt.quantization is not None and dequantized:
        log.warning(
            "%d linear layers of this %s checkpoint were dequantized to %s: the platform does not keep them "
            "(on the cpu platform, device.quantization: %s keeps them quantized)",
            dequantized, ckpt.quantization.kind, str(ctx.dtype).removeprefix("torch."), ckpt.quantization.method,
        )
    ctx.platform.prepare_model(model)
    return model


def _children(model: nn.Module, which: Callable[[nn.Module], bool]) -> list[tuple[nn.Module, str, str, nn.Module]]:
    """(parent, qualified name, attribute, module) of every module ``which`` takes, listed before
    any is replaced."""
    return [
        (parent, f"{prefix}.{name}".lstrip("."), name, child)
        for prefix, parent in model.named_modules() for name, child in parent.named_children() if which(child)
    ]


def load_model(
    source: ModelSource, make_attention: Callable[[ModelSpec], AttentionBackend], ctx: BuildContext
) -> LoadedModel:
    """Open and build in one call (a draft checkpoint beside the target)."""
    ckpt = open_checkpoint(source, ctx)
    max_len = check_max_model_len(ckpt.spec, ctx.max_model_len)
    model = build_model(ckpt, make_attention(ckpt.spec), ctx, max_len)
    return LoadedModel(ckpt.spec, model, ckpt.tokenizer)


def read_spec(source: ModelSource, ctx: BuildContext) -> ModelSpec:
    """An HF checkpoint's shape from its config files, without reading weights."""
    where = os.path.join(source.path, "config.json")
    cfg = _hf_config_with_generation(source.path)
    return architecture(cfg.get("model_type"), ctx, where).spec(cfg, where)


def _hf_config_with_generation(path: str) -> dict:
    cfg = _hf_config(path)
    gen = _read_json(os.path.join(path, "generation_config.json"))
    if "eos_token_id" in gen:
        cfg = {**cfg, "eos_token_id": gen["eos_token_id"]}
    return cfg


def _hf_config(path: str) -> dict:
    return _read_json(os.path.join(path, "config.json"))


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _sliced(tensors: dict[str, torch.Tensor], spec: ModelSpec, tp) -> Iterator[tuple[str, torch.Tensor]]:
    from modserve.core.distributed.sharding import take

    for name in list(tensors):
        yield name, take(name, tensors.pop(name), spec, tp)


def _safetensors(path: str, spec: ModelSpec | None = None, tp=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint; with ``tp`` only this rank's shard of each (read as a slice)."""
    if tp is not None:
        from modserve.core.distributed.sharding import plan, take

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted({os.path.join(path, f) for f in _read_json(index)["weight_map"].values()})
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {path!r}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if tp is not None and plan(name, spec, tp) is not None:
                    yield name, take(name, f.get_slice(name), spec, tp)
                else:
                    yield name, f.get_tensor(name)
