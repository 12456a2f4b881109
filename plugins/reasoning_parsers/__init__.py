"""Reasoning parsers (``reasoning_parser:``): ``<think>...</think>`` thinking before the answer."""
