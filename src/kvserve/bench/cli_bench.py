"""``kvserve bench serve``: load any OpenAI-compatible server (kvserve, vLLM, llama.cpp) and
report TTFT, ITL and E2E percentiles, throughput, errors, and preemptions from /metrics."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks against a running server",
                                  description="Benchmarks against a running server.")
    commands = bench.add_subparsers(dest="bench_command", metavar="COMMAND", required=True)
    parser = commands.add_parser(
        "serve", help="load an OpenAI-compatible server and report latencies",
        description="Send a workload to an OpenAI-compatible server (streaming) and report "
                    "TTFT, inter-token latency and E2E p50/p90/p99, throughput, errors, and "
                    "the preemptions the server counted in /metrics meanwhile.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server (kvserve, vLLM, llama.cpp, ...)")
    parser.add_argument("--endpoint", default="/v1/completions",
                        choices=("/v1/completions", "/v1/chat/completions"),
                        help="the API the requests go to")
    parser.add_argument("--model", help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    source = parser.add_argument_group("workload")
    source.add_argument("--trace", help="a kvserve trace (JSONL) or a server's recording "
                                        "directory (kvserve serve --record): each request "
                                        "asks for its output_len + 1 tokens (its answer and "
                                        "EOS) within max_tokens, an ignore_eos line for its "
                                        "max_tokens; its arrival times are used "
                                        "unless --request-rate or --max-concurrency is "
                                        "given; a line's cancel_time is its client's "
                                        "timeout (the client goes away then, counted "
                                        "disconnected)")
    source.add_argument("--num-prompts", type=int, default=100,
                        help="requests to send (without --trace)")
    source.add_argument("--input-len", default="64:512",
                        help="prompt length, N or LOW:HIGH (uniform)")
    source.add_argument("--output-len", default="32:256",
                        help="max_tokens, N or LOW:HIGH (uniform)")
    source.add_argument("--prompt-kind", choices=("ids", "text"), default="ids",
                        help="ids: token ids (no tokenizer differences); text: random words")
    source.add_argument("--seed", type=int, default=0,
                        help="seed of the drawn lengths, prompts and arrivals")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float,
                      help="Poisson arrivals at this many req/s (inf: all at once)")
    load.add_argument("--max-concurrency", type=int,
                      help="at most this many requests in flight")
    load.add_argument("--disconnect-prob", type=float, default=0.0,
                      help="fraction of clients that go away mid-stream at a random token")
    load.add_argument("--no-stream", dest="stream", action="store_false",
                      help="ask for whole answers (TTFT then equals E2E)")
    load.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                      help="do not send ignore_eos (for servers that refuse it)")
    load.add_argument("--temperature", type=float, default=0.0,
                      help="sampling temperature sent with each request")
    load.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the summary as JSON")
    out.add_argument("--output", help="also write the summary (JSON) to this file")
    out.add_argument("--save-detailed", action="store_true",
                     help="add each request's lengths, TTFT, ITLs, generated text and error "
                          "to the JSON summary (vLLM's keys: input_lens, output_lens, ttfts, "
                          "itls, generated_texts, errors)")
    out.add_argument("--no-progress", dest="progress", action="store_false",
                     help="no progress bar on stderr")
    parser.set_defaults(run=run)


def _requests(args: argparse.Namespace) -> list[Any]:
    from kvserve.bench.workload import (
        parse_range,
        poisson_arrivals,
        random_requests,
        trace_requests,
    )
    from kvserve.flags import CLIError

    try:
        if args.trace:
            longest = parse_range(args.output_len, "--output-len")[1]
            requests = trace_requests(args.trace, args.seed, longest)
        else:
            if args.num_prompts < 1:
                raise ValueError("--num-prompts must be >= 1")
            requests = random_requests(args.num_prompts, parse_range(args.input_len, "--input-len"),
                                       parse_range(args.output_len, "--output-len"), args.seed,
                                       args.prompt_kind == "text")
    except (ValueError, OSError) as error:
        raise CLIError(str(error).splitlines()[0]) from None
    rate = args.request_rate
    if rate is not None:
        if not rate > 0:
            raise CLIError("--request-rate must be > 0")
        if math.isinf(rate):
            return [_at(r, None) for r in requests]
        return poisson_arrivals(requests, rate, args.seed)
    if args.max_concurrency is not None or not args.trace:
        return [_at(r, None) for r in requests]
    return requests


def _at(request: Any, arrival: float | None) -> Any:
    import dataclasses

    return dataclasses.replace(request, arrival_time=arrival)


def run(args: argparse.Namespace) -> int:
    import httpx

    from kvserve.bench import runner
    from kvserve.bench.client import Target
    from kvserve.bench.report import detailed, format_table, summarize
    from kvserve.flags import CLIError, check_output_file

    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise CLIError("--max-concurrency must be >= 1")
    if not 0 <= args.disconnect_prob <= 1:
        raise CLIError("--disconnect-prob must be in [0, 1]")
    if not 0 < args.timeout < math.inf:
        raise CLIError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.output:
        check_output_file("--output", args.output)
    requests = _requests(args)
    base_url = args.base_url.rstrip("/")
    try:
        model = args.model or asyncio.run(runner.first_model(base_url, args.api_key))
    except httpx.HTTPStatusError as error:
        status = error.response.status_code
        hint = ": give --api-key" if status == 401 and not args.api_key else ""
        raise CLIError(f"cannot list the models at {base_url}/v1/models: HTTP {status}"
                       f"{hint}") from None
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CLIError(f"cannot list the models at {base_url}/v1/models: {reason}") from None
    target = Target(base_url, model, args.endpoint, args.api_key, args.stream,
                    args.ignore_eos, args.temperature)
    progress = _progress(len(requests), args.progress)
    result = asyncio.run(runner.run(
        requests, target, max_concurrency=args.max_concurrency,
        disconnect_prob=args.disconnect_prob, seed=args.seed, timeout=args.timeout,
        on_done=(lambda _: progress.update(1)) if progress is not None else None))
    if progress is not None:
        progress.close()
    summary = {"model": model, "base_url": base_url, **summarize(result)}
    table = format_table(summary)  # before vLLM's detailed keys, whose "errors" is per request
    if args.save_detailed:
        summary.update(detailed(result))
    print(json.dumps(summary, indent=2) if args.json else table)
    if args.output:
        try:
            with open(args.output, "w") as file:
                json.dump(summary, file, indent=2)
        except OSError as error:  # it changed since the check: the summary is printed above
            raise CLIError(f"cannot write {args.output}: {error.strerror}") from None
    return 0


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="bench", unit="req", file=sys.stderr, dynamic_ncols=True)
