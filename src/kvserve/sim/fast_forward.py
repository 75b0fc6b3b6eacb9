"""The simulator's side of the decode lane (kvserve.core.decode_lane, docs/simulator-speed.md).

The executor knows every token a request will sample (its answer, then its stream), so it can
tell the lane when a request will stop and which tokens it appends. While a request is in the
lane the executor's state of it and its run record fall behind; :meth:`SimLaneModel.advance`
brings both up to date the way the per-step path would have: one computed token and one
sampled token per lane step, and one inter-token gap per step, added to the record in step
order (so the sums are the same floating-point sums).

:class:`SimLaneModel` reads and advances the executor's private per-request state
(``SimExecutor._state``, ``_answers``): it is the executor's other half, for the lane.
"""

from __future__ import annotations

import struct
from contextlib import suppress
from functools import reduce
from operator import add

from kvserve.core import Request
from kvserve.core.decode_lane import DecodeLane
from kvserve.runs import RunRecorder
from kvserve.sim.executor import SimExecutor
from kvserve.sim.tokens import EOS_TOKEN_ID, stream_tokens

_pack_double = struct.Struct("=d").pack  # native order: array("d")'s byte layout


class SimLaneModel:
    """:class:`kvserve.core.decode_lane.LaneModel` over a SimExecutor and a RunRecorder."""

    def __init__(self, executor: SimExecutor, recorder: RunRecorder) -> None:
        self.executor = executor
        self.recorder = recorder
        self.gaps: list[float] = []  # per lane step: its end minus its start
        self.lane: DecodeLane | None = None

    def can_join(self, request: Request, now: float) -> bool:
        seq = self.executor._state.get(request.request_id)
        return (seq is not None and seq.num_computed == request.num_computed_tokens
                and seq.seq_len == request.num_computed_tokens + 1
                and self.recorder.records[request.request_id].last_token_time == now)

    def finish_count(self, request: Request, length_limit: int) -> int | None:
        """check_stop's verdict ahead of time: the length stop (max_tokens or the length
        limit) unless a stop token comes first, at or after min_tokens."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        finish = min(params.max_tokens, length_limit - len(request.prompt_token_ids))
        if finish <= num_output:
            return None
        stops = set(params.stop_token_ids)
        if not params.ignore_eos and params.eos_token_id is not None:
            stops.add(params.eos_token_id)
        if not stops:
            return finish
        answer = self.executor._answers[request.request_id][1]
        # Beyond the answer the stream samples any id but EOS: a stop id there is unknown.
        if finish - 1 > len(answer) and stops - {EOS_TOKEN_ID}:
            return None
        start = max(num_output, params.min_tokens - 1, 0)
        end = min(finish - 1, len(answer))
        for stop in stops:
            with suppress(ValueError):  # searched in place: slicing the answer copied it
                finish = min(finish, answer.index(stop, start, end) + 1)
        return finish

    def tokens(self, request: Request, count: int) -> list[int]:
        num_prompt, answer, stream = self.executor._answers[request.request_id]
        start = len(request.output_token_ids)
        out = answer[start:start + count]
        if len(out) < count:  # ignore_eos: the stream goes on past the drawn answer
            first = num_prompt + start + len(out)
            out += stream_tokens(stream, first, num_prompt + start + count)
        return out

    def advance(self, request: Request, first_step: int, end_step: int) -> None:
        count = end_step - first_step
        seq = self.executor._state[request.request_id]
        seq.num_computed += count
        seq.seq_len += count
        record = self.recorder.records[request.request_id]
        gaps = self.gaps[first_step:end_step]
        # The same left-to-right float additions as one `+=` per step, looped in C (not
        # sum(), which compensates its float sums from Python 3.12 on).
        record.itl_sum = reduce(add, gaps, record.itl_sum)
        record.itl_max = max(record.itl_max, max(gaps))
        record.num_output_tokens += count
        assert self.lane is not None
        record.last_token_time = self.lane.ends[end_step - 1]

    def end_step(self, start: float, now: float, num_steady: int) -> None:
        """After a lane step's update: its gap, once per member that did not finish (their
        ITL samples, in running order ahead of everything the step's outputs add)."""
        gap = now - start
        self.gaps.append(gap)
        if num_steady:
            # The same doubles as extend([gap] * num_steady), copied as bytes: a list of
            # ~200 floats converted one by one took ~9% of a busy run.
            self.recorder.itl.frombytes(_pack_double(gap) * num_steady)
