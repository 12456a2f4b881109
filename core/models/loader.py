"""Finds a model by path or name and builds it: HF directory, ``.gguf`` file, or the embedded default."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open

from modserve.core.interfaces import AttentionBackend
from modserve.core.models import cpu_fused
from modserve.core.models.cpu_linear import can_pack, pack_linears
from modserve.core.models.gguf_reader import find_smollm2_gguf, read_gguf
from modserve.core.models.llama import LlamaForCausalLM
from modserve.core.models.spec import ModelSpec
from modserve.core.tokenizer import TokenizerBundle

EMBEDDED_MODELS = {"smollm2-135m-instruct": find_smollm2_gguf}


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
class LoadedModel:
    spec: ModelSpec
    model: LlamaForCausalLM
    tokenizer: TokenizerBundle


def load_model(
    source: ModelSource,
    make_backend: Callable[[ModelSpec], AttentionBackend],
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None,
    tokenizer_path: str | None = None,
    num_layers: int | None = None,
    tp=None,
    pack_weights: bool = True,
    fuse_ops: bool = True,
) -> LoadedModel:
    """Read config, tokenizer and weights; build the model on ``device`` in ``dtype``.

    ``make_backend`` builds the attention backend once the model's shape is known. With
    ``tp`` (a :class:`modserve.core.distributed.sharding.TPShard`) only this rank's shard
    is built and read: safetensors slices are read straight from the file; a GGUF file is
    dequantized whole (tensor by tensor, the full tensors freed as they are sliced).
    ``pack_weights``: on the CPU, hold linear weights in oneDNN's layout (:mod:`cpu_linear`).
    ``fuse_ops``: on the CPU in float32, run the elementwise ops fused (:mod:`cpu_fused`).
    """
    if source.kind == "hf":
        spec = read_spec(source)
        tokenizer = TokenizerBundle.from_hf_dir(tokenizer_path or source.path, spec.eos_token_ids)
        tensors: Iterator[tuple[str, torch.Tensor]] = _safetensors(source.path, spec, tp)
    else:
        g = read_gguf(source.path, dtype=dtype)
        spec = ModelSpec.from_hf_config(g.config, source.path)
        tokenizer = TokenizerBundle(g.tokenizer, g.chat_template, g.bos_token, g.eos_token, list(g.eos_token_ids))
        if tokenizer_path:
            tokenizer = TokenizerBundle.from_hf_dir(tokenizer_path, g.eos_token_ids)
        tensors = iter(g.tensors.items()) if tp is None else _sliced(g.tensors, spec, tp)
    if tp is not None:
        from modserve.core.distributed.sharding import check_divisible

        check_divisible(spec, tp.world_size)
    spec.eos_token_ids = tokenizer.eos_token_ids or spec.eos_token_ids
    tokenizer.eos_token_ids = spec.eos_token_ids
    if max_model_len is not None and max_model_len > spec.max_position_embeddings:
        raise ValueError(
            f"model.max_model_len: {max_model_len} exceeds the model's max_position_embeddings "
            f"{spec.max_position_embeddings}"
        )
    with torch.device("meta"):
        model = LlamaForCausalLM(spec, make_backend(spec), max_model_len or spec.max_position_embeddings, num_layers, tp)
    model.to_empty(device="cpu")
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(tensors)
    model.to_device(device, dtype)
    model.eval().requires_grad_(False)
    if pack_weights and can_pack(device, dtype):
        pack_linears(model)
    if fuse_ops and cpu_fused.can_fuse(device, dtype):
        model.fuse_cpu_ops()
    return LoadedModel(spec, model, tokenizer)


def read_spec(source: ModelSource) -> ModelSpec:
    """An HF checkpoint's shape from its config files, without reading weights."""
    cfg = _hf_config(source.path)
    gen = _read_json(os.path.join(source.path, "generation_config.json"))
    if "eos_token_id" in gen:
        cfg = {**cfg, "eos_token_id": gen["eos_token_id"]}
    return ModelSpec.from_hf_config(cfg, os.path.join(source.path, "config.json"))


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
