"""``kvserve bench serve``: load any OpenAI-compatible server (kvserve, vLLM, llama.cpp) and
report TTFT, TPOT, ITL and E2E percentiles, throughput, errors, and preemptions from /metrics;
vLLM's ``bench serve`` flags and result keys where it has them."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from typing import Any

# vLLM's --backend values that name an OpenAI-compatible API, and the endpoint each is
BACKEND_ENDPOINTS = {"vllm": "/v1/completions", "openai": "/v1/completions",
                     "openai-chat": "/v1/chat/completions"}

# The random workload's lengths when no flag gives them (a trace's lines carry their own)
DEFAULT_INPUT_LEN = "64:512"
DEFAULT_OUTPUT_LEN = "32:256"


def add_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks against a running server",
                                  description="Benchmarks against a running server.")
    commands = bench.add_subparsers(dest="bench_command", metavar="COMMAND", required=True)
    parser = commands.add_parser(
        "serve", help="load an OpenAI-compatible server and report latencies",
        description="Send a workload to an OpenAI-compatible server (streaming) and report "
                    "TTFT, TPOT (per output token after the first), inter-token latency and "
                    "E2E p50/p90/p99, throughput, errors, and the preemptions the server "
                    "counted in /metrics meanwhile. vLLM's bench serve flags are taken "
                    "where they mean the same (--random-input-len, --ignore-eos, "
                    "--save-result, ...), and the JSON result carries vLLM's keys "
                    "(mean_/median_/std_/p99_ttft_ms, ..., duration, total_input_tokens) and "
                    "the run's settings. A request completes when its answer is whole (a "
                    "stream ended by [DONE], or a JSON body); an answer that breaks the "
                    "protocol, or takes longer than --timeout, fails it with the reason. "
                    "Output tokens are each answer's usage (a server that sends none has "
                    "its text events counted, with a warning). Exit status 1 when requests "
                    "failed and none completed.")
    parser.add_argument("--base-url", default=None,
                        help="the server (kvserve, vLLM, llama.cpp, ...; default "
                             "http://127.0.0.1:8000)")
    parser.add_argument("--host", default=None,
                        help="vLLM's: the server's host, with --port (instead of --base-url)")
    parser.add_argument("--port", type=int, default=None,
                        help="vLLM's: the server's port, with --host (default 8000)")
    parser.add_argument("--endpoint", default=None,
                        choices=("/v1/completions", "/v1/chat/completions"),
                        help="the API the requests go to (default /v1/completions)")
    parser.add_argument("--backend", default=None, choices=tuple(BACKEND_ENDPOINTS),
                        help="vLLM's: openai-chat is --endpoint /v1/chat/completions, vllm "
                             "and openai /v1/completions")
    parser.add_argument("--model", help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=None,
                        help="sent as Authorization: Bearer KEY (default: $OPENAI_API_KEY, "
                             "as vLLM's bench)")
    source = parser.add_argument_group("workload")
    source.add_argument("--trace", help="a kvserve trace (JSONL) or a server's recording "
                                        "directory (kvserve serve --record): each request "
                                        "asks for its output_len + 1 tokens (its answer and "
                                        "EOS) within max_tokens, an ignore_eos line for its "
                                        "max_tokens; its arrival times are used "
                                        "unless --request-rate or --max-concurrency is "
                                        "given; a line's cancel_time is its client's "
                                        "timeout (the client goes away then, counted "
                                        "disconnected); a session's turn is sent once its "
                                        "previous turn has ended, as simulate sends it")
    source.add_argument("--num-prompts", type=int, default=None,
                        help="requests to send (default 100); with --trace, its first N by "
                             "arrival time (default: all), as vLLM's of a dataset")
    source.add_argument("--input-len", "--random-input-len", default=None,
                        help="prompt length, N or LOW:HIGH (uniform; default 64:512; vLLM's "
                             "is 1024); not with --trace")
    source.add_argument("--output-len", "--random-output-len", default=None,
                        help="max_tokens, N or LOW:HIGH (uniform; default 32:256; vLLM's is "
                             "128); with --trace, a cap on the lines without max_tokens "
                             "(default: none)")
    source.add_argument("--dataset-name", choices=("random",), default="random",
                        help="vLLM's: random is the workload drawn here (--trace for a "
                             "file of requests)")
    source.add_argument("--prompt-kind", choices=("ids", "text"), default=None,
                        help="ids: token ids (no tokenizer differences; the default for "
                             "completions); text: random words (the default for chat, "
                             "whose messages are text: ids sent as text are several tokens "
                             "each)")
    source.add_argument("--seed", type=int, default=0,
                        help="seed of the drawn lengths, prompts and arrivals")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float,
                      help="Poisson arrivals at this many req/s (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="vLLM's: with --request-rate, the arrival gaps' gamma shape (1.0: "
                           "Poisson; below 1 burstier, above 1 steadier)")
    load.add_argument("--max-concurrency", type=int,
                      help="at most this many requests in flight")
    load.add_argument("--disconnect-prob", type=float, default=0.0,
                      help="fraction of clients that go away mid-stream at a random token")
    load.add_argument("--no-stream", dest="stream", action="store_false",
                      help="ask for whole answers (TTFT then equals E2E)")
    load.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", default=True,
                      help="send ignore_eos (the default here; vLLM's tool sends it only "
                           "when given this flag)")
    load.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                      help="do not send ignore_eos (for servers that refuse it)")
    load.add_argument("--sessions", action="store_true",
                      help="send a trace turn's session_id as kvserve's session field (and "
                           "its tenant as user), so a server with --max-session-kv holds its "
                           "KV between turns: a hit needs a turn's prompt to begin with the "
                           "previous prompt and the answer the server gave, which a trace's "
                           "synthesised prompts do not (a turn is sent once its session's "
                           "previous turn has ended either way)")
    load.add_argument("--temperature", type=float, default=0.0,
                      help="sampling temperature sent with each request")
    load.add_argument("--timeout", type=float, default=600.0,
                      help="seconds a request's whole answer may take (default 600)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the summary as JSON")
    out.add_argument("--output", help="also write the summary (JSON) to this file")
    out.add_argument("--save-result", action="store_true",
                     help="vLLM's: write the summary to --result-dir/--result-filename")
    out.add_argument("--result-dir", default=".", help="with --save-result (default .)")
    out.add_argument("--result-filename",
                     help="with --save-result (default: kvserve-<rate>qps-<model>-<date>.json)")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                     help="vLLM's: the metrics whose mean/median/std/percentile keys the JSON "
                          "result carries, of ttft,tpot,itl,e2el (default: all four)")
    out.add_argument("--metric-percentiles", default="99",
                     help="vLLM's: the percentiles of those keys, comma-separated (e.g. "
                          "50,90,99.9; default 99)")
    out.add_argument("--save-detailed", action="store_true",
                     help="add each request's lengths, TTFT, ITLs, generated text and error "
                          "to the JSON summary (vLLM's keys: input_lens, output_lens, ttfts, "
                          "itls, generated_texts, errors)")
    out.add_argument("--no-progress", "--disable-tqdm", dest="progress", action="store_false",
                     help="no progress bar on stderr (vLLM's --disable-tqdm)")
    parser.set_defaults(run=run)


def _requests(args: argparse.Namespace) -> list[Any]:
    from kvserve.bench.workload import (
        MAX_WORKLOAD_TOKENS,
        parse_range,
        poisson_arrivals,
        random_requests,
        trace_requests,
    )
    from kvserve.flags import CLIError
    from kvserve.sim.trace import MAX_TIME

    try:
        if args.num_prompts is not None and args.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        if args.sessions and args.trace is None:
            raise ValueError("--sessions sends a trace's session ids: give --trace")
        if args.trace is not None:
            if not args.trace:  # QA: '' ran the random workload, and said all was well
                raise ValueError("--trace needs a file name, got ''")
            if args.input_len is not None or args.prompt_kind is not None:
                raise ValueError("--input-len and --prompt-kind shape the random workload; "
                                 "a trace's lines carry their prompts")
            cap = None if args.output_len is None else \
                parse_range(args.output_len, "--output-len")[1]
            requests = trace_requests(args.trace, args.seed, cap, args.num_prompts)
        else:
            num = 100 if args.num_prompts is None else args.num_prompts
            input_len = parse_range(args.input_len or DEFAULT_INPUT_LEN, "--input-len")
            if num * input_len[1] > MAX_WORKLOAD_TOKENS:
                raise ValueError(f"--num-prompts {num} of up to {input_len[1]} "
                                 f"tokens may hold more than {MAX_WORKLOAD_TOKENS:,} prompt "
                                 "tokens: send fewer or shorter prompts")
            kind = args.prompt_kind or ("text" if "chat" in args.endpoint else "ids")
            output_len = parse_range(args.output_len or DEFAULT_OUTPUT_LEN, "--output-len")
            requests = random_requests(num, input_len, output_len, args.seed, kind == "text")
    except (ValueError, OSError) as error:
        raise CLIError(str(error).splitlines()[0]) from None
    rate = args.request_rate
    if not 0 < args.burstiness < math.inf:
        raise CLIError(f"--burstiness must be a positive number, got {args.burstiness}")
    if rate is not None:
        if not rate > 0:
            raise CLIError("--request-rate must be > 0")
        if math.isinf(rate):
            return [_at(r, None) for r in requests]
        timed = poisson_arrivals(requests, rate, args.seed, args.burstiness)
        if timed[-1].arrival_time > MAX_TIME:  # QA: 1e-300 req/s hung at the second request
            raise CLIError(f"--request-rate {rate:g} sends the last request at "
                           f"{timed[-1].arrival_time:.3g} s, past the {MAX_TIME:.0e} s a run "
                           "may span")
        return timed
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
    from kvserve.flags import CLIError, check_output_file, check_url

    _server_flags(args)
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise CLIError("--max-concurrency must be >= 1")
    if not 0 <= args.disconnect_prob <= 1:
        raise CLIError("--disconnect-prob must be in [0, 1]")
    if args.disconnect_prob and not args.stream:  # QA: it did nothing
        raise CLIError("--disconnect-prob drops streams part-way: it needs --stream (the "
                       "default), not --no-stream")
    if not 0 < args.timeout < math.inf:
        raise CLIError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if not math.isfinite(args.temperature):  # QA: each request failed as a "bad answer"
        raise CLIError(f"--temperature must be a finite number, got {args.temperature}")
    if args.save_result and args.output:
        raise CLIError("give --output or --save-result (with --result-dir and "
                       "--result-filename), not both")
    if args.save_result:
        _check_result_dir(args)
    if args.output:
        check_output_file("--output", args.output)
    metrics, percentiles = _flat_keys(args)
    requests = _requests(args)
    base_url = check_url("--base-url", args.base_url)
    try:
        model = args.model or asyncio.run(runner.first_model(base_url, args.api_key))
    except httpx.HTTPStatusError as error:
        status = error.response.status_code
        hint = ": give --api-key" if status == 401 and not args.api_key else \
            _said(error.response)  # QA: a wrong key's "invalid API key" was dropped
        raise CLIError(f"cannot list the models at {base_url}/v1/models: HTTP {status}"
                       f"{hint}") from None
    except (httpx.HTTPError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CLIError(f"cannot list the models at {base_url}/v1/models: {reason}") from None
    if args.save_result:  # named after the model served (QA: "model" without --model)
        args.output = _result_path(args, model)
        check_output_file("--result-dir", args.output)
    target = Target(base_url, model, args.endpoint, args.api_key, args.stream,
                    args.ignore_eos, args.temperature, args.sessions)
    progress = _progress(len(requests), args.progress)
    finished: list[Any] = []  # for a summary of what ended, should the run be interrupted

    def done(one: Any) -> None:
        finished.append(one)
        if progress is not None:
            progress.update(1)
    start = time.perf_counter()
    interrupted = False
    try:
        result = asyncio.run(runner.run(
            requests, target, max_concurrency=args.max_concurrency,
            disconnect_prob=args.disconnect_prob, seed=args.seed, timeout=args.timeout,
            on_done=done))
    except KeyboardInterrupt:  # Ctrl-C: the requests that ended, not a traceback (QA)
        interrupted = True
        result = runner.RunResult(finished, time.perf_counter() - start, None, None)
    if progress is not None:
        progress.close()
    summary = {"model": model, "base_url": base_url,
               **summarize(result, metrics, percentiles),
               **_settings(args, model, len(requests))}
    if interrupted:  # the requests not ended (under way, or not sent yet) are no figures,
        summary["num_requests"] = len(requests)  # but the run had them (QA: "of 1" where
        summary["interrupted"] = len(requests) - len(finished)  # 4 were sent)
    table = format_table(summary)  # before vLLM's detailed keys, whose "errors" is per request
    if args.save_detailed:
        summary.update(detailed(result))
    if args.output:  # before the summary is printed: a closed standard output (| head, a
        try:  # terminal gone) must not lose the run's file (QA)
            with open(args.output, "w") as file:
                json.dump(summary, file, indent=2)
        except OSError as error:  # it changed since the check: the summary is printed below
            print(json.dumps(summary, indent=2) if args.json else table)
            raise CLIError(f"cannot write {args.output}: {error.strerror}") from None
    print(json.dumps(summary, indent=2) if args.json else table)
    if interrupted:
        print(f"kvserve bench serve: interrupted: {len(finished)} of {len(requests)} requests "
              "had ended; the summary covers those", file=sys.stderr)
        return 130
    if summary["failed"] and not summary["completed"]:  # as vLLM's tool stops on its test
        # request, so scripts notice (clients told to go away are not failures)
        print(f"kvserve bench serve: no request completed ({summary['failed']} failed)",
              file=sys.stderr)
        return 1
    return 0


def _said(response: Any) -> str:
    """": MESSAGE" from an OpenAI-style error body, or "" where it has none."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return f": {str(message).splitlines()[0][:200]}" if message else ""


def _server_flags(args: argparse.Namespace) -> None:
    """vLLM's --host/--port and --backend, read into --base-url and --endpoint (a
    contradiction refused), so a vLLM bench command line runs as it is (the CLI pass)."""
    from kvserve.flags import CLIError

    if args.base_url is not None and (args.host is not None or args.port is not None):
        raise CLIError("give --base-url or --host/--port, not both")
    if args.port is not None and not 0 < args.port < 65536:
        raise CLIError(f"--port must be in [1, 65535], got {args.port}")
    if args.base_url is None:
        host = args.host or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        args.base_url = f"http://{host}:{args.port or 8000}"
    if args.backend is not None:
        endpoint = BACKEND_ENDPOINTS[args.backend]
        if args.endpoint is not None and args.endpoint != endpoint:
            raise CLIError(f"--backend {args.backend} sends to {endpoint}, not --endpoint "
                           f"{args.endpoint}")
        args.endpoint = endpoint
    args.endpoint = args.endpoint or "/v1/completions"


def _flat_keys(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """--percentile-metrics and --metric-percentiles, checked (CLIError naming the value)."""
    from kvserve.bench.report import VLLM_METRICS
    from kvserve.flags import CLIError

    metrics = tuple(name.strip() for name in args.percentile_metrics.split(",") if name.strip())
    unknown = [name for name in metrics if name not in VLLM_METRICS]
    if unknown or not metrics:
        raise CLIError(f"--percentile-metrics {args.percentile_metrics!r}: choose from "
                       f"{','.join(VLLM_METRICS)}")
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        percentiles = ()
    if not percentiles or not all(0 < p < 100 or p == 100 for p in percentiles):
        raise CLIError(f"--metric-percentiles {args.metric_percentiles!r}: comma-separated "
                       "numbers in (0, 100]")
    return metrics, percentiles


def _settings(args: argparse.Namespace, model: str, num_prompts: int) -> dict[str, Any]:
    """What the run asked for, under vLLM's keys where it has them, so a result file says
    how it was made."""
    import datetime

    return {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": "openai-chat" if "chat" in args.endpoint else "openai",
            "model_id": model, "endpoint": args.endpoint, "num_prompts": num_prompts,
            "request_rate": _rate(args), "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency, "seed": args.seed,
            "input_len": None if args.trace else args.input_len or DEFAULT_INPUT_LEN,
            "output_len": args.output_len if args.trace else
            args.output_len or DEFAULT_OUTPUT_LEN, "trace": args.trace, "stream": args.stream,
            "ignore_eos": args.ignore_eos, "temperature": args.temperature}


def _rate(args: argparse.Namespace) -> float | str:
    """The arrival rate asked for: req/s, "inf" (all at once) or "trace" (its times)."""
    if args.request_rate is not None:
        return "inf" if math.isinf(args.request_rate) else args.request_rate
    return "trace" if args.trace and args.max_concurrency is None else "inf"


def _check_result_dir(args: argparse.Namespace) -> None:
    """--save-result's file, before any request: the whole path where --result-filename
    names it, else the directory (the name waits for the model's)."""
    from kvserve.flags import CLIError, check_output_file

    if args.result_filename:
        check_output_file("--result-filename",
                          os.path.join(args.result_dir, args.result_filename))
    elif not (os.path.isdir(args.result_dir) and os.access(args.result_dir, os.W_OK)):
        raise CLIError(f"--result-dir {args.result_dir}: not a directory this user may "
                       "write in")


def _result_path(args: argparse.Namespace, model: str) -> str:
    """--save-result's file, named as vLLM names its own unless --result-filename."""
    import datetime

    if args.result_filename:
        return os.path.join(args.result_dir, args.result_filename)
    rate = _rate(args)
    rate = rate if isinstance(rate, str) else f"{rate:g}"
    model = model.split("/")[-1]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(args.result_dir, f"kvserve-{rate}qps-{model}-{stamp}.json")


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="bench", unit="req", file=sys.stderr, dynamic_ncols=True)
