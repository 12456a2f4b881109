"""Where the model forward's time goes: the linears, the attention backend, the rest.

MFU and the wall-time shares say how far the engine is from the machine's limits, not which
part keeps it there. A linear layer cannot beat the matmul library on its own shape, and
attention cannot read the KV cache faster than memory delivers it; what remains (norms, RoPE,
activations, the embedding, copies) and the engine around the forward is what an engine can
still shrink. So ``bench roofline`` times every call of the model's linear modules and of its
attention backend (wall-clock timers around each call, CPU only: on an asynchronous device a
timer measures the launch, not the work) and reports each part and the throughput ceilings
they imply: output tokens over the linears' time alone, and over the linears' and attention's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # torch only when timing: the CLI builds its parsers from this package
    from torch import nn

PARTS = ("linears", "attention")


STEP_KINDS = ("decode_only", "with_prompt")  # steps of one new token a sequence; the others (prompt chunks, drafts)


def _no_steps() -> dict[str, dict[str, float]]:
    return {kind: {"steps": 0, "model": 0.0, **dict.fromkeys(PARTS, 0.0)} for kind in STEP_KINDS}


@dataclass
class ForwardParts:
    """Seconds and calls per part, added up while attached, and per kind of step: a decode-only
    step and a step with prompt chunks spend their time very differently (at 64 requests, decode
    attention reads the KV cache; prefill products run at the FMA peak), which the totals hide."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    by_step: dict[str, dict[str, float]] = field(default_factory=_no_steps)  # kind: steps, model (s), parts (s)
    _at_last_step: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.calls = dict.fromkeys(PARTS, 0)
        self.by_step = _no_steps()
        self._at_last_step = dict.fromkeys(PARTS, 0.0)

    def step_done(self, kind: str, model_time_s: float) -> None:
        """A step of ``kind`` (one of STEP_KINDS) ended: its model time and the parts' seconds
        since the previous step go to that kind."""
        k = self.by_step[kind]
        k["steps"] += 1
        k["model"] += model_time_s
        for part in PARTS:
            k[part] += self.seconds[part] - self._at_last_step[part]
        self._at_last_step = dict(self.seconds)

    def attach(self, model: nn.Module, attention: Any) -> Callable[[], None]:
        """Time every linear module under ``model`` and ``attention.forward``; returns the detach.

        The timers shadow ``forward`` on each instance: the model calls ``module.forward(...)``
        directly, which module hooks would not see."""
        from torch import nn

        from modserve.plugins.platforms.cpu_linear import PackedLinear
        from modserve.plugins.platforms.cpu_panel_linear import PanelLinear
        from modserve.plugins.platforms.cpu_quant import QuantizedLinear

        targets = [(m, "linears") for m in _outermost(model, (nn.Linear, PackedLinear, PanelLinear, QuantizedLinear))]
        targets.append((attention, "attention"))
        for obj, part in targets:
            obj.forward = self._timed(obj.forward, part)

        def detach() -> None:
            for obj, _ in targets:
                del obj.forward  # the class's forward again

        return detach

    def _timed(self, fn: Callable, part: str) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0
                self.calls[part] += 1

        return timed


def _outermost(module: nn.Module, kinds: tuple[type, ...]) -> list[nn.Module]:
    """The modules of ``kinds`` under ``module`` that no other such module holds: a quantized
    layer held as pieces (a GGUF layer mixing kinds) is one linear call, not one per piece."""
    found = []
    for child in module.children():
        found += [child] if isinstance(child, kinds) else _outermost(child, kinds)
    return found


def report(parts: ForwardParts, model_time_s: float, wall_s: float, output_tokens: int,
           linear_flops: float, peak_flops_per_s: float) -> dict[str, Any]:
    """The parts as seconds and shares of the wall time, the linears' achieved FLOP/s, and the
    output tok/s the run would reach if nothing but the linears (and the attention) took time."""
    lin, att = parts.seconds["linears"], parts.seconds["attention"]
    rest = max(0.0, model_time_s - lin - att)
    return {
        "seconds": {"linears": lin, "attention": att, "rest_of_forward": rest},
        "shares": {"linears": lin / wall_s, "attention": att / wall_s, "rest_of_forward": rest / wall_s},
        "calls": dict(parts.calls),
        "linear_flops": linear_flops,
        "linear_flops_per_s": linear_flops / lin if lin > 0 else 0.0,
        "linear_peak_share": linear_flops / lin / peak_flops_per_s if lin > 0 else 0.0,
        "ceiling_linears_tok_s": output_tokens / lin if lin > 0 else 0.0,
        "ceiling_linears_attention_tok_s": output_tokens / (lin + att) if lin + att > 0 else 0.0,
        "by_step_kind": {
            kind: {"steps": k["steps"], "model_s": k["model"], "linears_s": k["linears"], "attention_s": k["attention"],
                   "rest_s": max(0.0, k["model"] - k["linears"] - k["attention"])}
            for kind, k in parts.by_step.items()
        },
    }
