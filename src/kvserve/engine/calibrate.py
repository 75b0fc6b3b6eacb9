"""``kvserve calibrate``: measure the engine's step time over a grid of batch shapes and fit
the simulator's ``calibrated`` cost model to it.

Each grid point is one step shape: some decodes at given context lengths and some prefill
chunks (n tokens after c already computed). The runner executes it as a real step (batch
building, forward, logits, sampling) on a KV pool whose contents do not matter for timing;
after warm-up runs, the median of the repeats is the sample.

Blocks are dealt scattered over the pool, as in an engine that has served a while. Where
the KV blocks lie matters too (:mod:`kvserve.sim.layout`); with ``layout_twins`` every shape
that reads cached context is measured again on consecutive block ids, and the fit gets the
layout term (off by default: docs/fidelity.md shows it helps batch workloads and hurts
Poisson ones on this machine).
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvserve.core import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from kvserve.core.config import DEFAULT_BLOCK_SIZE
from kvserve.engine.engine import Engine
from kvserve.engine.trace_runner import run_trace
from kvserve.model.runner import ModelRunner
from kvserve.sim.calibration import fit, goodness
from kvserve.sim.cost_models import CALIBRATED_FORMAT, CalibratedCostModel
from kvserve.sim.executor import BatchView
from kvserve.sim.machine import cpu_identity
from kvserve.sim.presets import MODEL_SHAPE
from kvserve.sim.trace import TraceRequest

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class StepShape:
    decode_contexts: tuple[int, ...] = ()  # tokens already computed, per decode
    prefills: tuple[tuple[int, int], ...] = ()  # (tokens already computed, tokens now)
    scattered: bool = True  # each sequence's blocks dealt from a shuffled pool, or in order
    block_size: int = DEFAULT_BLOCK_SIZE  # the pool's: how many context tokens share a block

    def view(self) -> BatchView:
        """The simulator's description of this batch.

        Scattered, every block after a sequence's first is counted as scattered (in a
        shuffled pool of N blocks one follows its predecessor by chance with probability
        1/N, too rare to count); consecutive, none is."""
        pieces = [(c, 1) for c in self.decode_contexts] + list(self.prefills)
        scattered = sum(c - min(c, self.block_size) for c, _ in pieces) \
            if self.scattered else 0
        return BatchView(
            num_seqs=len(pieces), num_tokens=sum(n for _, n in pieces),
            num_sampled=len(pieces), num_decode_seqs=len(self.decode_contexts),
            context_tokens=sum(c for c, _ in pieces),
            attention_pairs=sum(n * c + n * (n + 1) // 2 for c, n in pieces),
            scattered_context_tokens=scattered)

    def reads_context(self) -> bool:
        """Whether any sequence reads context past its first block: only then does the
        block layout change what the step reads."""
        return any(c > self.block_size
                   for c in (*self.decode_contexts, *(c for c, _ in self.prefills)))


def grid(quick: bool = False, block_size: int = DEFAULT_BLOCK_SIZE, layout_twins: bool = False
         ) -> list[StepShape]:
    """Prefill chunks, decode batches at several contexts, and mixed steps, each on
    scattered blocks; with ``layout_twins`` a shape that reads context is followed by its
    consecutive twin."""
    shapes = [replace(s, block_size=block_size) for s in _shapes(quick)]
    if not layout_twins:
        return shapes
    with_twins = []
    for shape in shapes:
        with_twins.append(shape)
        if shape.reads_context():  # measured back to back, so drift hits both alike
            with_twins.append(replace(shape, scattered=False))
    return with_twins


def _shapes(quick: bool) -> list[StepShape]:
    if quick:
        return [StepShape(prefills=((0, n),)) for n in (8, 32, 96)] + \
            [StepShape(decode_contexts=(c,) * b) for b in (1, 4, 8) for c in (16, 64)] + \
            [StepShape(decode_contexts=(32,) * 4, prefills=((0, 32),))]
    shapes = [StepShape(prefills=((0, n),)) for n in (16, 64, 256, 512, 1024, 2048)]
    shapes += [StepShape(prefills=((c, 256),)) for c in (512, 1536)]
    shapes += [StepShape(decode_contexts=(c,) * b) for b in (1, 8, 32, 64, 128)
               for c in (128, 512, 1024)]
    shapes += [StepShape(decode_contexts=(c,) * b, prefills=((0, n),))
               for b, c, n in ((16, 256, 512), (64, 512, 256), (32, 1024, 1024))]
    # What a busy engine runs: several prompts packed into one chunk, and decode batches of
    # mixed lengths with a prompt riding along.
    shapes += [StepShape(prefills=((0, n),) * k) for k, n in ((4, 500), (8, 128))]
    shapes += [StepShape(decode_contexts=tuple(range(64, 64 + 8 * b, 8)), prefills=((0, n),))
               for b, n in ((24, 300), (96, 200), (48, 1000))]
    return shapes


def _scheduler_output(shape: StepShape, num_blocks: int) -> SchedulerOutput:
    """A step the runner has never seen: every sequence arrives as a new request whose first
    ``c`` tokens count as computed (KV contents are irrelevant to timing).

    Block ids are dealt from a shuffled pool (``shape.scattered``), as a pool looks after an
    engine has served a churn of requests, or in order, as a fresh pool hands them out;
    consecutive blocks let the hardware prefetcher stream the KV cache."""
    block_size = shape.block_size
    order = list(range(num_blocks))
    if shape.scattered:
        random.Random(num_blocks).shuffle(order)
    next_block = 0
    new_reqs = []
    scheduled = {}
    pieces = [(c, 1) for c in shape.decode_contexts] + list(shape.prefills)
    for index, (computed, num_new) in enumerate(pieces):
        total = computed + num_new
        count = -(-total // block_size)
        block_ids = [order[(next_block + i) % num_blocks] for i in range(count)]
        next_block += count
        request_id = f"calibrate-{index}"
        new_reqs.append(NewRequestData(request_id, [100 + (i % 1000) for i in range(total)],
                                       total, block_ids, computed, False, _GREEDY))
        scheduled[request_id] = num_new
    return SchedulerOutput(new_reqs, CachedRequestData(), scheduled,
                           sum(scheduled.values()), [], [])


def measure(runner: ModelRunner, shape: StepShape, num_blocks: int, *, warmup: int = 1,
            repeats: int = 3) -> float:
    """Median seconds of ``runner.execute`` on this shape."""
    if shape.block_size != runner.block_size:
        raise ValueError(f"shape has block size {shape.block_size}, the runner "
                         f"{runner.block_size}")
    times = []
    for run in range(warmup + repeats):
        out = _scheduler_output(shape, num_blocks)
        start = time.perf_counter()
        runner.execute(out)
        elapsed = time.perf_counter() - start
        runner.requests.clear()
        if run >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def calibrate(runner: ModelRunner, num_blocks: int, shapes: Sequence[StepShape], *,
              warmup: int = 1, repeats: int = 3, progress: bool = False,
              kind_term: bool = False) -> tuple[CalibratedCostModel, list[float]]:
    """Measure every shape and fit; returns the model and the measured seconds. The layout
    term is fitted when the shapes include consecutive twins (``grid(layout_twins=True)``),
    the step-kind term when asked."""
    iterator: Any = shapes
    if progress:
        from tqdm import tqdm
        iterator = tqdm(shapes, desc="calibrate", unit="shape", dynamic_ncols=True)
    seconds = [measure(runner, shape, num_blocks, warmup=warmup, repeats=repeats)
               for shape in iterator]
    layout_term = any(not s.scattered and s.reads_context() for s in shapes)
    return fit([s.view() for s in shapes], seconds, layout_term=layout_term,
               kind_term=kind_term), seconds


def calibrate_in_service(engine: Engine, trace: Sequence[TraceRequest], *,
                         greedy: bool = True, kind_term: bool = True
                         ) -> tuple[CalibratedCostModel, dict[str, Any]]:
    """Run ``trace`` on ``engine`` (arrivals on the wall clock) and fit the model on the
    steps it ran: each step's shape as the engine recorded it, and its time to the next
    step's start or, before an idle wait, to the moment the loop went idle (the wait is not
    the step's cost). Returns the model and what the fit saw.

    Single steps in service scatter by ~10%, so the fit's error is relative to the model's
    price, not to the noisy measured time (``fit(relative_to="priced")``: it does not
    under-price the sum); ``kind_term`` fits the fixed cost of a step with prefill chunks
    (docs/fidelity.md, "Step kinds").

    ``greedy`` samples at temperature 0, as the grid does; otherwise each request samples
    with default parameters (temperature 1), which costs a little more per sequence per
    step (benchmarks/sampler.py), and the fit prices that in."""
    recorded = [step for step in run_trace(engine, trace, greedy=greedy).steps
                if step.shape is not None]
    views = [step.shape for step in recorded]
    seconds = [step.duration for step in recorded]
    model = fit(views, seconds, source=f"in service: {len(views)} steps", kind_term=kind_term,
                relative_to="priced")
    return model, {"num_steps": len(views), **goodness(model, views, seconds)}


def model_meta(config: Any) -> dict[str, Any]:
    """The model a calibration times, for its file's ``meta``: its name and its shape (the
    simulator warns when --model prices another: kvserve.sim.calibration.fitted_on_warning).
    ``config`` is the engine's ModelConfig."""
    return {"model": config.name,
            "model_shape": {name: getattr(config, name) for name in MODEL_SHAPE}}


def in_service_json(model: CalibratedCostModel, meta: dict[str, Any]) -> str:
    return _model_file(model, meta)


def to_json(model: CalibratedCostModel, shapes: Sequence[StepShape],
            seconds: Sequence[float], meta: dict[str, Any]) -> str:
    samples = [{"decode_contexts": list(s.decode_contexts),
                "prefills": [list(p) for p in s.prefills], "scattered": s.scattered,
                "seconds": t,
                "fitted": model.step_time(None, s.view())}  # type: ignore[arg-type]
               for s, t in zip(shapes, seconds, strict=True)]
    quality = goodness(model, [s.view() for s in shapes], seconds)
    return _model_file(model, {**meta, **quality}, samples)


def _model_file(model: CalibratedCostModel, meta: dict[str, Any],
                samples: list[dict[str, Any]] | None = None) -> str:
    """The cost-model JSON: the model, what made it (``meta``, plus this machine: its CPU
    model and ISA extensions in ``meta.cpu``, which the simulator checks against the CPU it
    runs on, unless ``meta`` gives its own: None where the steps were measured elsewhere),
    and the grid's samples when there are any."""
    data: dict[str, Any] = {
        "format": CALIBRATED_FORMAT, "coefficients": model.coefficients,
        "min_tokens": model.min_tokens, "source": model.source,
        "meta": {"machine": platform.machine(), "processor": platform.processor(),
                 "python": platform.python_version(), "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "cpu": cpu_identity(), **meta}}
    if samples is not None:
        data["samples"] = samples
    return json.dumps(data, indent=1) + "\n"


def plot(path: str | Path, shapes: Sequence[StepShape], seconds: Sequence[float],
         model: CalibratedCostModel) -> None:
    """Measured and fitted step time per grid point, sorted by measured time (SVG)."""
    from kvserve.sim.svg import line_chart, standalone

    order = sorted(range(len(shapes)), key=lambda i: seconds[i])
    xs = list(range(len(order)))
    fitted = [model.step_time(None, shapes[i].view()) for i in order]  # type: ignore[arg-type]
    svg = line_chart("step time: measured vs calibrated model",
                     [("measured", xs, [seconds[i] for i in order]), ("fitted", xs, fitted)],
                     "grid point (by measured time)", "seconds", markers=True,
                     width=720, height=320)
    Path(path).write_text(standalone(svg), encoding="utf-8")
