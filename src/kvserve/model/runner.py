"""The model runner: the core's Executor for a real model.

It keeps its own copy of each request's tokens and block table, built from SchedulerOutput
alone (new and resumed requests arrive whole, running ones as deltas), turns the step into one
flattened batch, runs one forward over all scheduled tokens, computes logits only where a
token is sampled, and samples. With a host KV tier (:mod:`kvserve.model.kv_swap`) it first
runs the step's block copies: every swap-out, then every swap-in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.core import ModelOutput, SamplingParams, SchedulerOutput
from kvserve.core.outputs import PromptLogprobs
from kvserve.model.attention import paged_attention
from kvserve.model.host_heap import HeapTrimmer
from kvserve.model.input_batch import SequenceSlice, build_batch
from kvserve.model.kv_swap import HostKVCache
from kvserve.model.llama import AttentionFn, LlamaForCausalLM
from kvserve.model.sampler import Sampler, SamplingRow, logprob_entries

# Prompt-logprob rows run through the LM head at once (G8): bounds the step's extra memory.
PROMPT_ROWS_AT_ONCE = 256


@dataclass
class _RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, *,
                 attention: AttentionFn = paged_attention, sampler: Sampler | None = None,
                 host_kv_cache: HostKVCache | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.attention = attention
        self.sampler = sampler or Sampler()
        self.requests: dict[str, _RequestState] = {}
        self.host_kv_cache = host_kv_cache
        self.device = kv_caches[0][0].device if kv_caches else torch.device("cpu")
        # the heap keeps the steps' freed activations: given back past 128 MiB of growth
        self.heap = HeapTrimmer()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        try:
            return self._execute(scheduler_output)
        finally:
            self.heap.after_step()

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        if scheduler_output.blocks_to_swap_out or scheduler_output.blocks_to_swap_in:
            self._swap(scheduler_output)
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelOutput({})
        decodes, prefills, sampling_ids = self._slices(scheduler_output)
        batch = build_batch(decodes, prefills, self.block_size).to(self.device)
        num_sampling = len(sampling_ids)
        with torch.inference_mode():
            hidden = self.model(batch, self.kv_caches, self.attention)
            sampled = self._sample(hidden[:num_sampling], sampling_ids) if sampling_ids \
                else None
            prompt = self._prompt_logprobs(hidden[num_sampling:], decodes + prefills) \
                if hidden.shape[0] > num_sampling else None
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_tokens
        if sampled is None:
            if self.device.type == "cuda":  # the step ends when its kernels do (timings)
                torch.cuda.synchronize(self.device)
            return ModelOutput({}, prompt_logprobs=prompt)
        token_ids, logprobs = sampled
        for request_id, token_id in zip(sampling_ids, token_ids, strict=True):
            self.requests[request_id].token_ids.append(token_id)
        return ModelOutput(
            {rid: [tok] for rid, tok in zip(sampling_ids, token_ids, strict=True)},
            None if logprobs is None else {  # only the requests that asked (the sampler
                # gives the others {}, which read as "logprobs": QA, null entries)
                rid: [entry] for rid, entry in zip(sampling_ids, logprobs, strict=True)
                if self.requests[rid].sampling_params.logprobs is not None},
            prompt)

    def _swap(self, out: SchedulerOutput) -> None:
        """The step's KV copies, before anything reads or writes the device cache. A
        swapped-out request is also in ``preempted_req_ids`` (its state is dropped); it comes
        back as a resumed request whose computed tokens are the blocks swapped in."""
        if self.host_kv_cache is None:
            raise RuntimeError("the scheduler asked for KV block copies, but this runner has "
                               "no host KV tier (--swap-space)")
        self.host_kv_cache.run(out.blocks_to_swap_out, out.blocks_to_swap_in)

    def _update_states(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_req_ids + out.preempted_req_ids:
            self.requests.pop(request_id, None)
        for new in out.scheduled_new_reqs:
            self.requests[new.request_id] = _RequestState(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                new.num_computed_tokens, new.sampling_params)
        cached = out.scheduled_cached_reqs
        for request_id, new_block_ids, num_computed in zip(
                cached.request_ids, cached.new_block_ids, cached.num_computed_tokens,
                strict=True):
            state = self.requests[request_id]
            if state.num_computed_tokens != num_computed:
                raise RuntimeError(f"runner and scheduler disagree on request {request_id}: "
                                   f"{state.num_computed_tokens} vs {num_computed} computed")
            state.block_ids += new_block_ids

    def _slices(self, out: SchedulerOutput
                ) -> tuple[list[SequenceSlice], list[SequenceSlice], list[str]]:
        """Decode slices, prefill slices, and the ids of requests that sample, in batch
        order: decodes first, by context length (attention pads each group of them to its
        longest), then prefill chunks."""
        decodes: list[tuple[SequenceSlice, str]] = []
        prefills: list[tuple[SequenceSlice, str]] = []
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[request_id]
            start = state.num_computed_tokens
            end = start + num_tokens
            # G8: positions start .. whose logits give the next prompt token's logprob (the
            # last prompt position's are the first sample's)
            rows = max(0, min(end, state.num_prompt_tokens - 1) - start) \
                if state.sampling_params.prompt_logprobs is not None else 0
            piece = SequenceSlice(state.token_ids[start:end], start, state.block_ids,
                                  samples=end == len(state.token_ids), prompt_rows=rows,
                                  request_id=request_id)
            (decodes if num_tokens == 1 else prefills).append((piece, request_id))
        decodes.sort(key=lambda entry: entry[0].start_position)
        sampling_ids = [rid for piece, rid in decodes + prefills if piece.samples]
        return [p for p, _ in decodes], [p for p, _ in prefills], sampling_ids

    def _prompt_logprobs(self, hidden: torch.Tensor, pieces: list[SequenceSlice]
                         ) -> dict[str, PromptLogprobs]:
        """The prompt rows' logprobs (G8), from the raw logits as vLLM gives them: each
        piece's rows are its first ``prompt_rows`` tokens, predicting the token after each.
        A piece's rows go through the head PROMPT_ROWS_AT_ONCE at a time: a 2,048-token
        chunk's logits at once are 400 MB at a 49k vocabulary."""
        out: dict[str, PromptLogprobs] = {}
        row = 0
        for piece in pieces:
            if not piece.prompt_rows:
                continue
            state = self.requests[piece.request_id]
            first = piece.start_position + 1  # the token the first row predicts
            wanted = state.sampling_params.prompt_logprobs
            entries: list[dict[int, float]] = []
            ranks: list[int] = []
            for at in range(0, piece.prompt_rows, PROMPT_ROWS_AT_ONCE):
                count = min(PROMPT_ROWS_AT_ONCE, piece.prompt_rows - at)
                targets = state.token_ids[first + at:first + at + count]
                rows = torch.log_softmax(self.model.compute_logits(
                    hidden[row + at:row + at + count]).float(), dim=-1)
                part = logprob_entries(rows, targets, [wanted] * count)
                ranks += [entry.rank for entry in part]  # vLLM's count: a tie before it
                entries += part
            row += piece.prompt_rows
            out[piece.request_id] = PromptLogprobs(first, entries, ranks)
        return out


    def _sample(self, hidden: torch.Tensor, request_ids: list[str]
                ) -> tuple[list[int], list[dict[int, float]] | None]:
        rows = []
        for request_id in request_ids:
            state = self.requests[request_id]
            rows.append(SamplingRow(state.sampling_params, state.token_ids,
                                    state.num_prompt_tokens))
        if self.sampler.plain_greedy(rows):
            # the same tokens without the float32 logits (docs/kernels.md, "sampling")
            return self.model.greedy_tokens(hidden).tolist(), None
        logits = self.model.compute_logits(hidden)
        result = self.sampler(logits, rows)
        return result.token_ids, result.logprobs
