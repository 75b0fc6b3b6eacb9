#!/usr/bin/env python
"""What structured outputs cost (docs/structured-outputs.md): the sampler per row and step
under each constraint, on SmolLM2's vocabulary (49,152) and random logits, and the offline
engine's wall time with a JSON schema against without for the same tokens, alternated.

    python benchmarks/structured_outputs.py [--write-docs] [--pairs N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import sys
import time

import torch

from ab_protocol import cpu, cpu_slug, cpu_title
from docs_section import publish
from kvserve.core import SamplingParams
from kvserve.model.sampler import Sampler, SamplingRow
from kvserve.model.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "story"],
          "properties": {"title": {"type": "string"}, "story": {"type": "string"}}}
# pydantic's Field(max_length=200) and Field(ge=1, le=5): a string counted in characters, an
# integer held to its bounds (each state's text in the state: more states, each built once)
BOUNDED = {"type": "object", "additionalProperties": False, "required": ["title", "stars"],
           "properties": {"title": {"type": "string", "maxLength": 200},
                          "stars": {"type": "integer", "minimum": 1, "maximum": 5}}}
PROMPTS = ["Tell a story about a cat as JSON with a title:",
           "Tell a story about a ship as JSON with a title:"] * 4


def per_row_ms(sampler: Sampler, params: SamplingParams, output: list[int],
               repeats: int = 50) -> float:
    """The sampler's median time for one row whose output so far is ``output``."""
    vocab = len(sampler.json_vocabulary().token_bytes)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 3
    row = SamplingRow(params, [1, *output], 1)
    sampler(logits, [row])  # warm-up: the state's tokens worked out, its mask built
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, [row])
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def first_time_ms(tokenizer, text: str, schema: dict = SCHEMA) -> float:
    """A state's first step: its tokens worked out and its mask built (a fresh sampler)."""
    token_bytes = [tokenizer.token_bytes(t) for t in range(tokenizer.vocab_size)]
    sampler = Sampler(0, token_bytes=lambda: token_bytes)
    sampler.json_vocabulary()
    params = SamplingParams(temperature=1.0, json_schema=json.dumps(schema), eos_token_id=0)
    logits = torch.randn(1, tokenizer.vocab_size)
    start = time.perf_counter()
    sampler(logits, [SamplingRow(params, [1, *tokenizer.encode(text)], 1)])
    return 1000 * (time.perf_counter() - start)


def walk_ms(tokenizer, schema: dict) -> float:
    """A fresh sampler's mean time per step along one answer's first 40 tokens inside a
    string (every state new to it): what a long string costs as it is written."""
    token_bytes = [tokenizer.token_bytes(t) for t in range(tokenizer.vocab_size)]
    sampler = Sampler(0, token_bytes=lambda: token_bytes)
    sampler.json_vocabulary()
    params = SamplingParams(temperature=1.0, json_schema=json.dumps(schema), eos_token_id=0)
    text = tokenizer.encode('{"title": "' + "Once upon a time, in a town by the sea, " * 6)
    start_at = len(tokenizer.encode('{"title": "'))
    logits = torch.randn(1, tokenizer.vocab_size)
    start = time.perf_counter()
    for end in range(start_at, start_at + 40):
        sampler(logits.clone(), [SamplingRow(params, [1, *text[:end]], 1)])
    return 1000 * (time.perf_counter() - start) / 40


def sampler_rows(tokenizer) -> list[tuple[str, float]]:
    token_bytes = [tokenizer.token_bytes(t) for t in range(tokenizer.vocab_size)]
    sampler = Sampler(0, token_bytes=lambda: token_bytes)
    in_story = tokenizer.encode('{"title": "A day", "story": "Once upon a time there')
    after_key = tokenizer.encode('{"title": "A day", "story"')
    schema = json.dumps(SCHEMA)
    cases = [
        ("no constraint", SamplingParams(temperature=1.0), in_story),
        ("choice of 3", SamplingParams(temperature=1.0, eos_token_id=0, choice_token_ids=[
            tuple(tokenizer.encode(c)) for c in ("red", "green", "light blue")]), []),
        ("JSON mode, in a string", SamplingParams(temperature=1.0, json_object=True,
                                                  eos_token_id=0), in_story),
        ("JSON schema, in a string", SamplingParams(temperature=1.0, json_schema=schema,
                                                    eos_token_id=0), in_story),
        ("JSON schema, after a key", SamplingParams(temperature=1.0, json_schema=schema,
                                                    eos_token_id=0), after_key),
        ("JSON schema, in a string of at most 200 characters",
         SamplingParams(temperature=1.0, json_schema=json.dumps(BOUNDED), eos_token_id=0),
         tokenizer.encode('{"title": "Once upon a time there')),
        ("JSON schema, in an integer from 1 to 5",
         SamplingParams(temperature=1.0, json_schema=json.dumps(BOUNDED), eos_token_id=0),
         tokenizer.encode('{"title": "A day", "stars": ')),
    ]
    rows = [(name, per_row_ms(sampler, params, output)) for name, params, output in cases]
    rows.append(("JSON schema, a state's first step",
                 statistics.median(first_time_ms(tokenizer, '{"title": "A day", "story": "x')
                                   for _ in range(5))))
    rows.append(("JSON schema, a counted string's state, its first step",
                 statistics.median(first_time_ms(tokenizer, '{"title": "x', BOUNDED)
                                   for _ in range(5))))
    free = {**BOUNDED, "properties": {**BOUNDED["properties"], "title": {"type": "string"}}}
    # an enum of 2,000 random 20-letter values: its texts' run found by bisection (read text
    # by text, a first step took 3.6 s here, and 150,000 values hung the engine; QA)
    values = ["".join(random.Random(index).choices(string.ascii_letters, k=20))
              for index in range(2000)]
    enum = {"type": "object", "required": ["v"], "additionalProperties": False,
            "properties": {"v": {"enum": values}}}
    rows.append(("JSON schema, in an enum of 2,000 strings, a state's first step",
                 statistics.median(first_time_ms(tokenizer, '{"v": "', enum)
                                   for _ in range(5))))
    rows.append(("40 steps into a free string, fresh (mean per step)", walk_ms(tokenizer, free)))
    rows.append(("40 steps into a string of at most 200 characters, fresh (mean per step)",
                 walk_ms(tokenizer, BOUNDED)))
    return rows


def engine_seconds(llm, lengths: list[int] | None) -> tuple[float, list[int]]:
    """Wall time of the 8 prompts, greedy: with the schema (``lengths`` None), each ending
    where its object closes; without, each run to the length it had with the schema
    (ignore_eos), so both make the same tokens in the same batches."""
    schema = json.dumps(SCHEMA)
    params = [SamplingParams(max_tokens=96, temperature=0.0, json_schema=schema)
              for _ in PROMPTS] if lengths is None else \
        [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    results = llm.generate(PROMPTS, params, use_tqdm=False)
    return time.perf_counter() - start, [len(r.token_ids) for r in results]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--pairs", type=int, default=5, help="A/B pairs (default 5)")
    args = parser.parse_args()
    from kvserve.engine.llm import LLM

    model, flags = cpu()
    tokenizer = load_tokenizer(None)
    sampler_figures = sampler_rows(tokenizer)
    llm = LLM(max_model_len=512, num_kv_blocks=128)
    _, lengths = engine_seconds(llm, None)  # warm-up, and the lengths both sides make
    plain, constrained = [], []
    for _ in range(args.pairs):  # A B A B: the machine is shared and noisy
        plain.append(engine_seconds(llm, lengths)[0])
        seconds, made = engine_seconds(llm, None)
        assert made == lengths, (made, lengths)  # greedy: the same answers each time
        constrained.append(seconds)
    ratios = [c / p for p, c in zip(plain, constrained, strict=True)]
    command = f"python benchmarks/structured_outputs.py {' '.join(sys.argv[1:])}".strip()
    section = "\n".join([
        f"## Structured outputs on {cpu_title(model, flags)}", "",
        f"`{command}`; CPU {model}, ISA {flags or 'none read'}, "
        f"{torch.get_num_threads()} threads.", "",
        "The sampler alone, one row of SmolLM2's 49,152-entry vocabulary, median of 50 "
        "calls (a state's first step: median of 5 fresh samplers):", "",
        "| constraint | ms per row and step |", "|---|---|",
        *(f"| {name} | {ms:.3f} |" for name, ms in sampler_figures), "",
        f"The offline engine (bundled model, {torch.get_num_threads()} threads, "
        f"8 prompts, greedy), the wall time of the 8 answers with the schema of two strings "
        f"(each ends where its object closes: {sum(lengths)} tokens) and without it (each "
        f"run to the same length), {args.pairs} pairs alternated, seconds:", "",
        "| | min | median |", "|---|---|---|",
        f"| without | {min(plain):.3f} | {statistics.median(plain):.3f} |",
        f"| JSON schema | {min(constrained):.3f} | {statistics.median(constrained):.3f} |",
        "",
        f"With the schema / without: ratio of minima {min(constrained) / min(plain):.2f}, "
        f"median of the pair ratios {statistics.median(ratios):.2f} (pairs: "
        f"{', '.join(f'{r:.2f}' for r in ratios)})."])
    publish(f"structured-outputs-{cpu_slug(model, flags)}", section, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
