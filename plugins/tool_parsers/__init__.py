"""Tool-call parsers (``tool_parser:``): Hermes/Qwen's ``<tool_call>`` tags and Llama 3's JSON."""
