"""One step's flattened batch: every scheduled token of every request in one forward.

Token order in the batch: all decode tokens first (one per request), then each prefill chunk
(a chunk of a prompt, or of a resumed request's recomputed sequence) in turn::

    input_ids  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      T tokens
    positions  [41 97 12 | 0  1  2  3  | 64 65 ]
    decode:    3 requests, context lengths [42, 98, 13], padded block tables [3, max_blocks]
    prefills:  (start 3, 4 tokens, context 4, blocks), (start 7, 2 tokens, context 66, blocks)

``slot_mapping[i] = block_id * block_size + offset`` is where token i's K and V are written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillChunk:
    start: int  # first token's index in the batch
    num_tokens: int
    context_len: int  # tokens of KV after this chunk: computed before + num_tokens
    block_table: torch.Tensor  # [num_blocks] long


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] long, padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] long
    # The same lengths on the host, so code that sizes work by them (the torch path's decode
    # groups) reads no device tensor: on a GPU each read waited for the queue to drain.
    decode_context_lens_host: tuple[int, ...]
    prefills: list[PrefillChunk]
    # [S + P] long: the last token of each sequence that samples, then the prompt rows
    logits_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> ForwardBatch:
        """This batch with every tensor on ``device`` (itself on the CPU, where it is built)."""
        if device.type == "cpu":
            return self
        def move(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device, non_blocking=True)
        return dataclasses.replace(
            self, input_ids=move(self.input_ids), positions=move(self.positions),
            slot_mapping=move(self.slot_mapping),
            decode_block_tables=move(self.decode_block_tables),
            decode_context_lens=move(self.decode_context_lens),
            prefills=[dataclasses.replace(chunk, block_table=move(chunk.block_table))
                      for chunk in self.prefills],
            logits_indices=move(self.logits_indices))


@dataclass
class SequenceSlice:
    """One request's part of a step, as the runner hands it to :func:`build_batch`."""

    token_ids: Sequence[int]  # the tokens scheduled now
    start_position: int  # = tokens already computed
    block_ids: Sequence[int]
    samples: bool  # does this chunk reach the end of the sequence?
    # Leading tokens of the chunk whose logits are wanted as well (prompt logprobs, G8):
    # their rows follow every sampling row in ``logits_indices``, in slice order.
    prompt_rows: int = 0
    request_id: str = ""  # whose (the runner's bookkeeping)


def build_batch(decodes: Sequence[SequenceSlice], prefills: Sequence[SequenceSlice],
                block_size: int) -> ForwardBatch:
    """Flatten decode slices (one token each) and prefill slices into a ForwardBatch."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    prompt_indices: list[int] = []

    def add(piece: SequenceSlice) -> None:
        start = piece.start_position
        block_ids = piece.block_ids
        prompt_indices.extend(range(len(input_ids), len(input_ids) + piece.prompt_rows))
        for offset, token_id in enumerate(piece.token_ids):
            position = start + offset
            input_ids.append(token_id)
            positions.append(position)
            slots.append(block_ids[position // block_size] * block_size
                         + position % block_size)
        if piece.samples:
            logits_indices.append(len(input_ids) - 1)

    for piece in decodes:
        add(piece)
    max_blocks = max((len(p.block_ids) for p in decodes), default=0)
    padded = [list(p.block_ids) + [0] * (max_blocks - len(p.block_ids)) for p in decodes]
    tables = torch.tensor(padded, dtype=torch.long).view(len(decodes), max_blocks)
    lens = tuple(p.start_position + 1 for p in decodes)
    context_lens = torch.tensor(lens, dtype=torch.long)
    chunks = []
    for piece in prefills:
        start = len(input_ids)
        add(piece)
        context_len = piece.start_position + len(piece.token_ids)
        num_blocks = -(-context_len // block_size)
        chunks.append(PrefillChunk(start, len(piece.token_ids), context_len,
                                   torch.tensor(piece.block_ids[:num_blocks], dtype=torch.long)))
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        num_decodes=len(decodes),
        decode_block_tables=tables,
        decode_context_lens=context_lens,
        decode_context_lens_host=lens,
        prefills=chunks,
        logits_indices=torch.tensor(logits_indices + prompt_indices, dtype=torch.long),
    )
