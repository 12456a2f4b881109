"""Flattens one step's scheduled tokens into a varlen batch and runs the model on it.

Batch layout (DESIGN.md): ``input_ids[T]``, ``positions[T]``, ``slot_mapping[T]``,
``query_start_loc[B+1]``, ``seq_lens[B]``, ``request_lens[B]``, ``block_tables[B, max_blocks]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modserve.core.contract import AttentionBackend, AttentionMetadata, CausalLM, KVBackend, SchedulerOutput
from modserve.core.decode_graphs import DecodeGraphs
from modserve.core.piecewise_graphs import PiecewiseGraphs


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


class ModelRunner:
    """Runs one process's model; :class:`~modserve.core.distributed.tp_runner.TPModelRunner`
    drives tensor-parallel workers beside it."""

    dead: str | None = None  # why this runner can never run again (a worker died), else None

    def __init__(
        self, model: CausalLM, kv: KVBackend, attention: AttentionBackend, device: torch.device,
        graphs: DecodeGraphs | None = None, pieces: PiecewiseGraphs | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.kv = kv
        self.attention = attention
        self.device = device
        self.block_size = kv.block_size
        self.graphs = graphs  # decode steps replayed from captured graphs, where the platform has them
        self.pieces = pieces  # other steps replayed as graph pieces between eager attention calls

    def prepare(self, sched: SchedulerOutput) -> StepBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_list: list[int] = []
        query_lens, seq_lens, request_lens, tables = [], [], [], []
        bs = self.block_size
        for s in sched.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            end = start + s.num_tokens
            tokens = req.all_token_ids[start:end]
            if len(tokens) < s.num_tokens:  # draft tokens follow the known ones
                tokens = tokens + req.spec_token_ids[: s.num_tokens - len(tokens)]
            input_ids += tokens
            positions += range(start, end)
            table = self.kv.block_table(req)
            for b in range(start // bs, (end - 1) // bs + 1):  # each block's run of slots, not a tensor op per step
                first = table[b] * bs - b * bs  # the slot of position 0 if it were in this block
                slot_list += range(first + max(start, b * bs), first + min(end, (b + 1) * bs))
            query_lens.append(s.num_tokens)
            seq_lens.append(end)
            request_lens.append(req.num_tokens)
            tables.append(table)
        dev = self.device
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.int64)
        slots = torch.tensor(slot_list, dtype=torch.int64)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        meta = AttentionMetadata(
            num_tokens=len(input_ids),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=seq.to(dev),
            context_lens=(seq - torch.tensor(query_lens, dtype=torch.int32)).to(dev),
            slot_mapping=slots.to(dev),
            block_tables=block_tables.to(dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            request_lens=torch.tensor(request_lens, dtype=torch.int32, device=dev),
        )
        return StepBatch(torch.tensor(input_ids, dtype=torch.int64, device=dev), pos.to(dev), meta)

    @torch.inference_mode()
    def capture_graphs(self) -> str | None:
        """Capture every graph size now (decode graphs, then graph pieces); what was captured, or
        None where this runner replays none."""
        done = [f"{n} {what}" for what, graphs in (("decode batch sizes", self.graphs), ("piece token sizes", self.pieces))
                if graphs is not None and (n := graphs.capture_all())]
        return ", ".join(done) or None

    def shutdown(self) -> None:
        """Stop what this runner started (nothing for a single process). Idempotent."""

    @torch.inference_mode()
    def execute(self, batch: StepBatch, logits_rows: list[int]) -> torch.Tensor:
        """Run the model; return float32 logits for the flat token rows in ``logits_rows``."""
        hidden = self.graphs.run(batch) if self.graphs is not None else None
        if hidden is None:
            self.attention.prepare(batch.meta)
            hidden = self.pieces.run(batch) if self.pieces is not None else None
        if hidden is None:
            hidden = self.model(batch.input_ids, batch.positions, self.kv.layer_caches(), batch.meta)
        rows = torch.tensor(logits_rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden[rows])
