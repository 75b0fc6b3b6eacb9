"""Factories and a fake executor shared by the tests (docs/architecture.md, rule 3: fakes over
weights)."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import pytest

from kvserve.core import (
    CacheConfig,
    ModelOutput,
    Request,
    RequestOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    check_invariants,
)

EOS = 2


def token_for(request_id: str, position: int) -> int:
    """The fake model's token at ``position``: a fixed function of the request and position,
    so outputs are identical however the work was scheduled."""
    return 1000 + zlib.crc32(f"{request_id}:{position}".encode()) % 30000


def make_scheduler(num_blocks: int = 1000, block_size: int = 16, *,
                   enable_prefix_caching: bool = True, record_events: bool = False,
                   num_host_blocks: int = 0, preemption_prices: object = None,
                   **config: object) -> Scheduler:
    config.setdefault("max_model_len", 4096)
    config.setdefault("max_num_seqs", min(256, int(config.get("max_num_batched_tokens", 2048))))
    return Scheduler(SchedulerConfig(**config),  # type: ignore[arg-type]
                     CacheConfig(num_blocks=num_blocks, block_size=block_size,
                                 enable_prefix_caching=enable_prefix_caching,
                                 num_host_blocks=num_host_blocks),
                     record_events=record_events,
                     preemption_prices=preemption_prices)  # type: ignore[arg-type]


def make_request(request_id: str | int, num_prompt_tokens: int = 16, *,
                 prompt_token_ids: Sequence[int] | None = None, arrival_time: float = 0.0,
                 **params: object) -> Request:
    request_id = str(request_id)
    if prompt_token_ids is None:
        prompt_token_ids = [token_for(request_id + "/prompt", i)
                            for i in range(num_prompt_tokens)]
    return Request(request_id, list(prompt_token_ids),
                   SamplingParams(**params),  # type: ignore[arg-type]
                   arrival_time=arrival_time)


def make_group(lengths: Sequence[int], group_id: str = "g", **params: object) -> list[Request]:
    """A group's sequences as the server makes them (``<group_id>-<index>``), one per
    prompt length."""
    return [make_request(f"{group_id}-{index}", length, **params)
            for index, length in enumerate(lengths)]


def occupy_every_seat(scheduler: Scheduler) -> None:
    """Admit one long request into a scheduler of max_num_seqs 1, so new arrivals wait: the
    queue limits count a backlog, not what the next step would admit (K4)."""
    assert scheduler.config.max_num_seqs == 1
    scheduler.add_request(make_request("busy", 4, max_tokens=1000, ignore_eos=True))
    scheduler.schedule(0.0)
    assert len(scheduler.running) == 1


class FakeExecutor:
    """A runner that keeps its own per-request state from SchedulerOutput alone, as a real
    model runner must, and samples ``token_fn(request_id, position)``.

    It also models the KV cache: each scheduled token id is written to its slot through the
    request's block table, and before sampling the whole sequence is read back through the
    block table. A wrong prefix-cache hit, or a block reused while still in use, fails here.
    The host tier is modelled the same way: the step's swap-out copies (device -> host) run
    first, then its swap-in copies (host -> device), slot by slot, so a wrong or missing copy
    fails the read-back of the swapped request.
    """

    def __init__(self, token_fn: Callable[[str, int], int] = token_for,
                 block_size: int | None = None) -> None:
        self.token_fn = token_fn
        self.tokens: dict[str, list[int]] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> token id
        self.host_slots: dict[tuple[int, int], int] = {}  # (host block id, offset) -> token id
        self.block_size = block_size
        self.num_steps = 0

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        for request_id in out.finished_req_ids + out.preempted_req_ids:
            for table in (self.tokens, self.block_ids, self.computed):
                table.pop(request_id, None)
        for device_id, host_id in out.blocks_to_swap_out:
            self._copy_block(self.slots, device_id, self.host_slots, host_id)
        for device_id, host_id in out.blocks_to_swap_in:
            self._copy_block(self.host_slots, host_id, self.slots, device_id)
        for new in out.scheduled_new_reqs:
            self.tokens[new.request_id] = list(new.token_ids)
            self.block_ids[new.request_id] = list(new.block_ids)
            self.computed[new.request_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for request_id, new_block_ids, num_computed in zip(
                cached.request_ids, cached.new_block_ids, cached.num_computed_tokens,
                strict=True):
            assert self.computed[request_id] == num_computed, request_id
            self.block_ids[request_id] += new_block_ids
        sampled: dict[str, list[int]] = {}
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            start = self.computed[request_id]
            end = start + num_tokens
            tokens = self.tokens[request_id]
            assert end <= len(tokens), (request_id, end, len(tokens))
            self._write(request_id, start, end)
            self.computed[request_id] = end
            if end == len(tokens):
                self._check_read_back(request_id, end)
                token = self.token_fn(request_id, end)
                sampled[request_id] = [token]
                tokens.append(token)
        self.num_steps += 1
        return ModelOutput(sampled)

    def _copy_block(self, source: dict[tuple[int, int], int], source_id: int,
                    target: dict[tuple[int, int], int], target_id: int) -> None:
        assert self.block_size is not None, "set block_size, or drive it through step()"
        for offset in range(self.block_size):
            value = source.get((source_id, offset))
            if value is None:
                target.pop((target_id, offset), None)
            else:
                target[(target_id, offset)] = value

    def _slot(self, request_id: str, position: int) -> tuple[int, int]:
        assert self.block_size is not None, "set block_size, or drive it through step()"
        block_index, offset = divmod(position, self.block_size)
        return self.block_ids[request_id][block_index], offset

    def _write(self, request_id: str, start: int, end: int) -> None:
        tokens = self.tokens[request_id]
        for position in range(start, end):
            self.slots[self._slot(request_id, position)] = tokens[position]

    def _check_read_back(self, request_id: str, end: int) -> None:
        tokens = self.tokens[request_id]
        for position in range(end):
            slot = self._slot(request_id, position)
            assert self.slots.get(slot) == tokens[position], (
                f"KV of {request_id} at position {position} (block {slot[0]}) holds "
                f"{self.slots.get(slot)}, not {tokens[position]}")


def step(scheduler: Scheduler, executor: FakeExecutor, now: float = 0.0,
         check: bool = True) -> tuple[SchedulerOutput, list[RequestOutput]]:
    if executor.block_size is None:
        executor.block_size = scheduler.cache_config.block_size
    out = scheduler.schedule(now)
    outputs = scheduler.update(out, executor.execute(out), now)
    if check:
        check_invariants(scheduler)
    return out, outputs


def run_to_completion(scheduler: Scheduler, requests: Sequence[Request] = (),
                      max_steps: int = 100_000,
                      executor: FakeExecutor | None = None) -> dict[str, RequestOutput]:
    """Add ``requests``, step until nothing is left, return each request's final output
    with all its tokens (those from this call's steps). Pass the ``executor`` that ran the
    scheduler's earlier steps, if any: it holds the running requests' state."""
    for request in requests:
        scheduler.add_request(request)
    if executor is None:
        executor = FakeExecutor(block_size=scheduler.cache_config.block_size)
    tokens: dict[str, list[int]] = {}
    final: dict[str, RequestOutput] = {}
    for n in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        _, outputs = step(scheduler, executor, float(n))
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                final[output.request_id] = RequestOutput(
                    output.request_id, tokens[output.request_id], True, output.finish_reason,
                    output.stop_reason, output.metrics)
    else:
        raise AssertionError(f"requests left after {max_steps} steps")
    return final


@pytest.fixture
def executor() -> FakeExecutor:
    return FakeExecutor()
