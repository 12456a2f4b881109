"""Per-step counters handed to ``on_step_finished`` observers (metrics, tracing, loggers)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    step: int
    num_running: int
    num_waiting: int
    kv_usage: float  # 0.0 .. 1.0
    num_scheduled_tokens: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed this step (prefix hits excluded)
    num_generation_tokens: int = 0  # tokens appended to outputs this step
    num_preemptions: int = 0
    prefix_queries: int = 0  # tokens looked up in the prefix cache this step
    prefix_hits: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # per verified request: drafts accepted
    inter_token_latencies: list[float] = field(default_factory=list)  # per request that got tokens: gap since its last
    step_time_s: float = 0.0
    # where the step's wall time went: the forward is the model, the rest is engine overhead
    schedule_time_s: float = 0.0  # the scheduler plugin (and the KV allocations it makes)
    prepare_time_s: float = 0.0  # flattening the batch into tensors
    model_time_s: float = 0.0  # inside the model forward, attention backend included
    sample_time_s: float = 0.0  # the sampler plugin and token selection
    output_time_s: float = 0.0  # appending tokens, stop checks, detokenizing, finishing, drafts
    finished_request_ids: list[str] = field(default_factory=list)
