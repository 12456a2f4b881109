"""INT8 KV quality on SmolLM2: teacher-forced top-1 agreement and perplexity against full precision.

Shared by ``tests/test_int8_kv.py`` (which bounds the figures) and
``benchmarks/int8_kv_capacity.py`` (which prints them). Both engines score every position
of a fixed English text through ``prompt_logprobs``; the text is processed in chunks of
``max_num_batched_tokens``, and since the attention backends read every key and value back
from the cache, each position of the INT8 engine attends over quantized K/V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from modserve import LLM, SamplingParams

SMOLLM2 = "smollm2-135m-instruct"
CHUNK_TOKENS = 64  # max_num_batched_tokens: small, so later chunks read earlier ones from the cache

TEXT = """\
The lighthouse stood at the end of a narrow spit of rock, a mile from the nearest village, \
and for most of the last century it was kept by the same family. Every evening the keeper \
climbed the one hundred and twelve steps to the lamp room, trimmed the wick, polished the \
great glass lens and wound the clockwork that turned it. The light could be seen for twenty \
miles on a clear night, and sailors coming home from the fishing grounds used it to find the \
channel between the sandbanks. In winter the storms were so strong that spray reached the top \
of the tower, and the keeper's children learned to sleep through the noise of the wind and the \
waves breaking against the walls.

When the light was finally automated, the family moved to a house in the village, but the old \
keeper still walked out along the rocks each evening to watch it come on. He said that a machine \
could turn a lamp as well as any man, but it could not tell when a boat was in trouble, and he \
kept a pair of binoculars by his window until the end of his life. Today the tower is a small \
museum. Visitors can climb the stairs, look at the lens, and read the logbooks in which three \
generations recorded the weather, the ships that passed and the occasional rescue. The entries \
are short and plain, yet together they tell the story of a coast, a community and the sea that \
shaped both of them.

Scientists who study the region today rely on those same logbooks. Because the keepers wrote \
down the wind, the temperature and the height of the tide at the same hours every day, their \
notes form one of the longest continuous weather records in the country. Researchers have used \
them to show how storms have become more frequent and how the sandbanks have shifted over time."""


def smollm2_config(kv_dtype: str = "auto", chunk_tokens: int = CHUNK_TOKENS, num_blocks: int = 512) -> dict[str, Any]:
    """The SmolLM2 pipeline both engines use; only ``kv_dtype`` differs between them."""
    return {
        "model": {"path": SMOLLM2, "max_model_len": 2048},
        "scheduler": {"plugin": "fcfs", "max_num_batched_tokens": chunk_tokens},
        "kv_cache": {"plugin": "paged", "num_blocks": num_blocks, "kv_dtype": kv_dtype},
    }


@dataclass
class TeacherForced:
    """Per position p >= 1 of the text: logprob of the actual token p and the top-1 token id."""

    logprobs: list[float]
    top1: list[int]

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))


@dataclass
class Quality:
    positions: int
    agreement: float  # fraction of positions whose top-1 token is the same in both engines
    ppl_ref: float
    ppl_test: float

    @property
    def ppl_rise(self) -> float:
        """Relative perplexity increase of the test engine over the reference (0.01 = 1%)."""
        return self.ppl_test / self.ppl_ref - 1.0

    def summary(self, label: str = "int8 KV") -> str:
        return (
            f"{label}: top-1 agreement {100 * self.agreement:.2f}% over {self.positions} positions; "
            f"perplexity {self.ppl_ref:.4f} -> {self.ppl_test:.4f} ({100 * self.ppl_rise:+.3f}%)"
        )


def teacher_forced(llm: LLM, token_ids: list[int]) -> TeacherForced:
    """Score every next token of ``token_ids`` in one request (``prompt_logprobs=1``)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    out = llm.generate({"prompt_token_ids": token_ids}, params)[0]
    entries = out.prompt_logprobs
    assert entries is not None and entries[0] is None and len(entries) == len(token_ids)
    logprobs, top1 = [], []
    for tok, entry in zip(token_ids[1:], entries[1:]):
        logprobs.append(entry[tok].logprob)  # the actual token is always in the entry
        top1.append(max(entry.values(), key=lambda lp: lp.logprob).token_id)  # plus the top-1
    return TeacherForced(logprobs, top1)


def compare(ref: TeacherForced, test: TeacherForced) -> Quality:
    n = len(ref.top1)
    assert n == len(test.top1)
    agree = sum(a == b for a, b in zip(ref.top1, test.top1))
    return Quality(n, agree / n, ref.perplexity, test.perplexity)


def measure(ref_llm: LLM, test_llm: LLM, text: str = TEXT) -> Quality:
    """Teacher-force ``text`` through both engines and compare them."""
    token_ids = ref_llm.tokenizer.encode(text)
    return compare(teacher_forced(ref_llm, token_ids), teacher_forced(test_llm, token_ids))
