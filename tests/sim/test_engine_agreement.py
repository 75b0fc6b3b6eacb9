"""The engine's step loop and the simulator's make the same decisions (docs/architecture.md,
"The one seam": the same decisions, bit for bit).

The engine is driven exactly as in production (Engine.step: schedule -> execute -> update),
with the simulator's executor in place of the model runner and the cost model advancing a
virtual clock; arrivals are added when their time has come. Every step's scheduled tokens
and every request's first-token and finish times must equal the simulator's.
"""

from kvserve.core import CacheConfig, Scheduler, SchedulerConfig
from kvserve.engine.engine import Engine
from kvserve.sim.cost_models import RooflineCostModel
from kvserve.sim.executor import SimExecutor
from kvserve.sim.presets import get_hardware, get_model
from kvserve.sim.simulator import Simulator
from kvserve.sim.workloads import WorkloadSpec, generate

CONFIG = SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=256, max_model_len=1024)
CACHE = CacheConfig(num_blocks=60)  # tight: the run preempts
COST = RooflineCostModel(get_model("llama-3.1-8b"), get_hardware("l4"))
TRACE = generate(WorkloadSpec(num_requests=50, rate=3.0, prompt_len="uniform:32,400",
                              output_len="uniform:1,120", prefix_groups=2, seed=4))


class PricedExecutor:
    """The simulator's executor; each step advances the virtual clock by its cost."""

    def __init__(self) -> None:
        self.executor = SimExecutor()
        self.now = 0.0

    def execute(self, out):  # type: ignore[no-untyped-def]
        model_output = self.executor.execute(out)
        self.now += COST.step_time(out, self.executor.view)
        return model_output


def run_engine() -> tuple[list[int], dict[str, tuple[float | None, float]]]:
    priced = PricedExecutor()
    engine = Engine(Scheduler(CONFIG, CACHE), priced, clock=lambda: priced.now,
                    detokenize=False)
    pending = sorted(TRACE, key=lambda r: (r.arrival_time, r.request_id))
    times: dict[str, tuple[float | None, float]] = {}
    steps: list[int] = []
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival_time <= priced.now:
            r = pending.pop(0)
            priced.executor.register(r.request_id, r.num_prompt_tokens, r.output_len,
                                     r.ignore_eos, r.continuation_key(0))
            engine.add_request(r.request_id, r.synthesise_prompt(0),
                               r.sampling_params(CONFIG.max_model_len), r.arrival_time)
        if not engine.has_unfinished_requests():
            priced.now = pending[0].arrival_time
            continue
        record = engine.step()
        if record.num_scheduled_tokens:
            steps.append(record.num_scheduled_tokens)
        for chunk in record.chunks:
            if chunk.finished:
                times[chunk.request_id] = (chunk.metrics.first_token_time,
                                           chunk.metrics.finished_time)
    return steps, times


def test_engine_loop_and_simulator_agree_step_by_step():
    result = Simulator(CONFIG, CACHE, COST).run(TRACE)
    steps, times = run_engine()
    assert result.num_preemptions > 0  # the comparison covers preemption and recompute
    assert steps == list(result.steps.num_scheduled_tokens)
    assert times == {r.request_id: (r.metrics.first_token_time, r.metrics.finished_time)
                     for r in result.records}
