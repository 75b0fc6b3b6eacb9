"""``kvserve generate``: offline generation from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvserve.core import ConfigError, RequestError, SamplingParams

SUMMARY = "generate text offline with the real model"
DESCRIPTION = ("Generate text for one or more prompts with the real model on this "
               "machine, through the same scheduler the server uses.")


def add_parser(subparsers: Any) -> None:
    from kvserve.flags import add_command, add_model_flags, add_scheduler_flags

    parser = add_command(subparsers, "generate", run, SUMMARY, DESCRIPTION)
    add_model_flags(parser)
    parser.add_argument("--prompt", action="append", default=[],
                        help="a prompt (repeat for a batch); '-' reads one per line from stdin")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user message through the chat template")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="most tokens generated per prompt")
    parser.add_argument("--min-tokens", type=int, default=0,
                        help="tokens generated before EOS or a stop may end the answer")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling: the smallest set of tokens with this much "
                             "probability (1: off)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k most likely tokens (0 or -1: off)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens below this fraction of the top token's probability "
                             "(0: off)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeat)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate past the end-of-sequence token, to --max-tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_scheduler_flags(parser)


def _prompts(args: argparse.Namespace) -> list[Any]:
    prompts: list[str] = []
    for prompt in args.prompt:
        prompts += [line for line in sys.stdin.read().splitlines() if line] if prompt == "-" \
            else [prompt]
    from kvserve.flags import CLIError
    from kvserve.model.tokenizer import text_problem

    if not prompts:
        raise CLIError("standard input held no prompt (one per line)" if "-" in args.prompt
                       else "give at least one --prompt")
    for number, prompt in enumerate(prompts, 1):  # before the model loads, not after
        problem = text_problem(prompt)
        if problem is not None:
            raise CLIError(f"prompt {number}: {problem}")
    empty = next((i for i, p in enumerate(prompts) if not p), None)
    if empty is not None and not args.chat:  # a chat's template has tokens of its own
        raise CLIError(f"prompt {empty + 1} is empty: a completion needs at least one token")
    if args.chat:
        return [[{"role": "user", "content": p}] for p in prompts]
    return prompts


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.llm import LLM
    from kvserve.flags import CLIError, configure_logging, engine_args, resolve_model_option

    prompts = _prompts(args)
    # Boot lines (CPU, ISA, kernel per op) and warnings on stderr; stdout is the answers.
    configure_logging("%(levelname)s %(name)s: %(message)s")
    resolve_model_option(args)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, min_tokens=args.min_tokens,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
        llm = LLM(args.model, **engine_args(args))
        results = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    except (ConfigError, RequestError, ValueError, FileNotFoundError) as error:
        raise CLIError(str(error).splitlines()[0]) from error
    for number, (prompt, result) in enumerate(zip(prompts, results, strict=True), 1):
        if args.json:
            metrics = result.metrics
            print(json.dumps({
                "prompt": prompt, "text": result.text, "token_ids": result.token_ids,
                "finish_reason": result.finish_reason, "stop_reason": result.stop_reason,
                "num_prompt_tokens": len(result.prompt_token_ids),
                "num_preemptions": metrics.num_preemptions if metrics else 0}))
        else:
            if len(prompts) > 1:  # answers may span lines: each under its prompt's number
                print(f"--- prompt {number} ---")
            print(result.text)
    return 0
