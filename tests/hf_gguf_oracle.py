"""transformers reading a GGUF file (the oracle for the embedded SmolLM2), without its repeated work.

transformers 5 parses the file with gguf-py twice (config, then weights) and rebuilds gguf-py's
tensor-name map once per module of the model (397 times for SmolLM2): 25-30 s of a 35 s load.
Both are pure functions of their arguments, so inside :func:`remembering_gguf_reads` they are
memoized; what transformers computes from them is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import os
from unittest import mock

import gguf


@contextlib.contextmanager
def remembering_gguf_reads():
    with mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)), \
         mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        yield


def smollm2_from_transformers(path: str):
    """transformers' float32 model read from the GGUF file at ``path``, in eval mode."""
    from transformers import AutoModelForCausalLM

    with remembering_gguf_reads():
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype="float32")
    return model.eval()
