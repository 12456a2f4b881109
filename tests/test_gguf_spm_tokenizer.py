"""GGUF SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`) against transformers' GGUF loader.

A small SentencePiece-style vocabulary is written here: the specials, the 256 `<0xNN>` byte tokens
(type BYTE), `▁`-prefixed words and their sub-pieces with scores (some tied) so that the merges
derived from the scores decide the split. transformers reads the same file
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) and is the oracle, for the three flavours it
distinguishes: Llama-style (Metaspace, prefix space), Phi-3 (prefix by a normalizer) and Gemma
(merges by file order, no prefix, space tokens stored as real spaces).
"""

from __future__ import annotations

import json
import random

import gguf
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from modserve.core.models.gguf_reader import build_tokenizer, read_gguf
from modserve.core.models.gguf_spm import SPACE
from modserve.core.tokenizer import TokenizerBundle
from test_gguf_reader import TINY_SHAPE, _finish, _shape_writer, gguf_tensor_name, llama_cpp_permute

NORMAL, UNKNOWN, CONTROL, BYTE = gguf.TokenType.NORMAL, gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.BYTE
WORDS = ["hello", "world", "the", "token", "tokenizer", "unbelievable", "believe", "test", "testing", "is", "a", "in",
         "Hello", "The", "sentence", "piece", "ab", "abab"]
TEXTS = [
    "",
    "hello world",
    "Hello, world!",
    "the tokenizer is testing unbelievable sentencepiece",
    "tokenizertokenizer abababab",
    " leading space",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple     spaces  inside",
    "newlines\nand\n\nmore\r\n\ttabs",
    "é漢字🙂",
    "caf\u00e9 na\u00efve 漢字 and 🙂 emoji",
    "digits 0123456789 x7",
    "ALL CAPS UNSEEN QZX",
    "<s>hello</s> specials in text <unk>",
    "not special: <s  > </ s>",
]


def spm_vocab(gemma: bool = False, seed: int = 0) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types): specials, the byte tokens, then characters, words and their pieces."""
    rng = random.Random(seed)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] if gemma else ["<unk>", "<s>", "</s>"]
    types = [UNKNOWN if t == "<unk>" else CONTROL for t in specials]
    pieces: list[str] = [SPACE, *"abcdefghijklmnopqrstuvwxyzHTW,.!"]
    for word in WORDS:
        for spelled in (SPACE + word, word):
            for start in range(len(spelled)):
                for end in range(start + 2, len(spelled) + 1):
                    if rng.random() < (0.9 if start == 0 else 0.25):
                        pieces.append(spelled[start:end])
            pieces.append(spelled)
    pieces += [SPACE * 2, SPACE * 4] if not gemma else ["  ", "    "]  # Gemma stores these as real spaces
    pieces = list(dict.fromkeys(pieces))
    scores = [round(-rng.random() * 8, 1) for _ in pieces]  # rounded: some ties
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types += [BYTE] * 256 + [NORMAL] * len(pieces)
    return tokens, [0.0] * (len(specials) + 256) + scores, types


def write_spm_gguf(path, arch: str = "llama", model: torch.nn.Module | None = None, add_space_prefix: bool | None = None,
                   chat_template: str | None = None) -> str:
    """A GGUF with an SPM vocabulary; with `model`, its tensors too (so the file loads as a whole model)."""
    gemma = arch.startswith("gemma")
    tokens, scores, types = spm_vocab(gemma)
    if model is None:
        writer = gguf.GGUFWriter(str(path), arch)
    else:
        writer = _shape_writer(path, arch, model.config)
        writer.add_rope_dimension_count(model.config.hidden_size // model.config.num_attention_heads)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(tokens.index("<bos>" if gemma else "<s>"))
    writer.add_eos_token_id(tokens.index("<eos>" if gemma else "</s>"))
    writer.add_unk_token_id(tokens.index("<unk>"))
    if gemma:
        writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, tensor in (model.state_dict().items() if model is not None else ()):
        if ".q_proj." in name:
            tensor = llama_cpp_permute(tensor, model.config.num_attention_heads)
        elif ".k_proj." in name:
            tensor = llama_cpp_permute(tensor, model.config.num_key_value_heads)
        writer.add_tensor(gguf_tensor_name(name), tensor.numpy())
    return _finish(writer, path)


def read_meta(path: str) -> dict:
    return {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}


ARCHS = ("llama", "phi3", "gemma2")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Tokenizer, object]]:
    """arch -> (ours, transformers' tokenizer) for the same file."""
    directory = tmp_path_factory.mktemp("spm")
    out = {}
    for arch in ARCHS:
        path = write_spm_gguf(directory / f"{arch}.gguf", arch)
        hf = transformers.AutoTokenizer.from_pretrained(str(directory), gguf_file=f"{arch}.gguf")
        out[arch] = (build_tokenizer(read_meta(path)), hf)
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_decoding_match_transformers(files, arch, text):
    ours, hf = files[arch]
    ids = ours.encode(text).ids
    assert ids == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False).ids == hf.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    if not text.startswith(" ") and "<" not in text:  # a leading space is eaten by the prefix strip, as in HF
        assert ours.decode(ids) == text


def test_merges_and_byte_fallback_are_exercised(files):
    ours, _ = files["llama"]
    assert ours.encode("tokenizer", add_special_tokens=False).tokens == [SPACE + "tokenizer"]
    assert ours.encode(" hello", add_special_tokens=False).tokens[0] == SPACE + "hello"
    assert ours.encode("漢", add_special_tokens=False).tokens == [SPACE, "<0xE6>", "<0xBC>", "<0xA2>"]
    assert ours.encode("hi").ids[0] == 1  # BOS
    gemma, _ = files["gemma2"]
    assert gemma.encode("a    b", add_special_tokens=False).tokens == ["a", SPACE * 2, SPACE, SPACE + "b"]  # "  " respelled


def _altered(tokenizer: Tokenizer, **model_changes) -> Tokenizer:
    spec = json.loads(tokenizer.to_str())
    spec["model"].update(model_changes)
    return Tokenizer.from_str(json.dumps(spec))


def test_comparison_fails_without_byte_fallback_or_merges(files):
    """The oracle comparison can fail: a tokenizer without byte fallback, or without the derived
    merges, gives different ids from transformers."""
    ours, hf = files["llama"]
    assert _altered(ours, byte_fallback=False).encode("漢").ids != hf.encode("漢")
    assert _altered(ours, merges=[]).encode("hello world").ids != hf.encode("hello world")


def test_add_space_prefix_false_is_followed(tmp_path):
    """llama.cpp puts no ▁ in front when the file says `add_space_prefix = false`; transformers
    ignores the key (always prefixes for Llama-style vocabularies), so it is no oracle here."""
    meta = read_meta(write_spm_gguf(tmp_path / "noprefix.gguf", add_space_prefix=False))
    tokenizer = build_tokenizer(meta)
    assert tokenizer.encode("hello world", add_special_tokens=False).tokens[0] != SPACE + "hello"
    assert "".join(tokenizer.encode("hello world", add_special_tokens=False).tokens) == "hello" + SPACE + "world"
    assert tokenizer.decode(tokenizer.encode(" hello").ids) == " hello"
    prefixed = build_tokenizer(read_meta(write_spm_gguf(tmp_path / "prefix.gguf", add_space_prefix=True)))
    assert prefixed.encode("hello", add_special_tokens=False).tokens == [SPACE + "hello"]


def test_unknown_tokenizer_models_are_named(tmp_path):
    meta = read_meta(write_spm_gguf(tmp_path / "t5.gguf"))
    with pytest.raises(NotImplementedError, match=r"'t5'.*'gpt2'.*'llama'"):
        build_tokenizer({**meta, "tokenizer.ggml.model": "t5"})


def test_whole_llama_gguf_with_spm_vocab_and_chat_template(tmp_path):
    """A tiny Llama with an SPM vocabulary loads as a model; its chat template applies and the
    rendered prompt tokenizes as transformers tokenizes it."""
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    vocab_size = len(spm_vocab()[0])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_SHAPE, "vocab_size": vocab_size, "bos_token_id": 1,
                                                                     "eos_token_id": 2})).eval()
    path = write_spm_gguf(tmp_path / "tiny-spm.gguf", "llama", model, chat_template=template)
    read = read_gguf(path)
    assert (read.bos_token, read.bos_token_id, read.eos_token, read.eos_token_ids) == ("<s>", 1, "</s>", [2])
    assert read.tensors["model.embed_tokens.weight"].shape[0] == vocab_size
    bundle = TokenizerBundle(read.tokenizer, read.chat_template, read.bos_token, read.eos_token, read.eos_token_ids)
    messages = [{"role": "user", "content": "hello world, the tokenizer 漢字🙂"}]
    text = bundle.apply_chat_template(messages)
    assert text == "<s>[user] hello world, the tokenizer 漢字🙂\n[assistant]"
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny-spm.gguf")
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert expected == text
    assert bundle.encode_chat(messages) == hf.encode(text, add_special_tokens=False)
    assert bundle.encode_chat(messages)[0] == 1
