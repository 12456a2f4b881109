"""A `tokenizers.Tokenizer` for a GGUF SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`).

Llama 2, Mistral 7B v0.1, TinyLlama, Phi-3-mini and the Gemmas store a SentencePiece vocabulary in
GGUF: `tokenizer.ggml.tokens` with a score and a type per token, no merges. It is rebuilt as a BPE
model, the same way transformers' GGUF loader does (`integrations/gguf/gguf_tokenizer_mapping.py`),
which is the oracle the tests compare against:

* merges: every split of a vocabulary token into two vocabulary tokens, best merged token first --
  ranked by the merged token's score, or for the Gemmas by its position in the file (their scores
  do not follow the merge order);
* byte fallback: text no piece covers becomes the `<0x00>`..`<0xFF>` byte tokens, and decoding
  fuses those bytes back into UTF-8;
* spaces become `▁`, with a `▁` put in front of the text when `add_space_prefix` (absent: yes, as
  llama.cpp) -- by a `Metaspace` pre-tokenizer (only when the text does not already start with a
  space), or for Phi-3 by a normalizer (always); the Gemmas have no prefix;
* decoding turns `▁` back into spaces and strips the one prefix space it added.

Special tokens and the BOS/EOS post-processor are added by the caller
(:func:`modserve.core.models.gguf_reader.build_tokenizer`), shared with byte-level BPE.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"  # ▁, SentencePiece's spelling of a space

GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")  # merges by file order, no prefix space, spaces stored as " "
PREFIX_BY_NORMALIZER_ARCHS = ("phi3",)  # "  hi" -> ▁▁▁hi (always prepend), not ▁▁hi (Metaspace)


def build_spm_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Model, normalizer, pre-tokenizer and decoder for a `tokenizer.ggml.model = "llama"` vocabulary."""
    arch = meta.get("general.architecture")
    tokens = spm_tokens(meta)
    gemma = arch in GEMMA_ARCHS
    if gemma:
        ranks = {token: -index for index, token in enumerate(tokens)}
    else:
        scores = meta.get("tokenizer.ggml.scores")
        ranks = dict(zip(tokens, scores)) if scores is not None else {t: -i for i, t in enumerate(tokens)}
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    else:
        merges = derive_merges(vocab, ranks)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if gemma and unk_id is not None else None  # as transformers: Gemma names it, Llama not
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))

    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    if gemma:
        prefix = False
        tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    elif arch in PREFIX_BY_NORMALIZER_ARCHS:
        steps = [normalizers.Prepend(SPACE)] if prefix else []
        tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    else:
        scheme = "first" if prefix else "never"
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=False)

    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def spm_tokens(meta: dict[str, Any]) -> list[str]:
    """The vocabulary as the tokenizer spells it: Gemma files store the tokens of two or more
    spaces as real spaces, while the text (spaces normalized to ▁) looks them up as ▁▁."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    if meta.get("general.architecture") in GEMMA_ARCHS:
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    return tokens


def derive_merges(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a merges-less vocabulary implies (transformers' `generate_merges`).

    Each token that splits into two vocabulary tokens gives a merge for each such split, ranked
    by the merged token's score (higher first); ties go to the longer left, then longer right
    piece, then the token's order and the pieces' ids.
    """
    merges = []
    for merged, rank in ranks.items():
        splits = [(merged[:i], merged[i:]) for i in range(1, len(merged))]
        local = sorted(((l, r) for l, r in splits if l in vocab and r in vocab), key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges.extend((l, r, rank) for l, r in local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: equal keys keep their order
    return [(l, r) for l, r, _ in merges]
