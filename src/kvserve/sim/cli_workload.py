"""``kvserve workload gen``: write a seeded synthetic trace."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvserve.flags import check_output_file, finite_float
from kvserve.sim.cli_common import cli_errors, seed


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("workload", help="synthetic workloads and traces")
    commands = parser.add_subparsers(dest="workload_command", metavar="COMMAND", required=True)
    gen = commands.add_parser(
        "gen", help="generate a trace (JSONL)",
        description="Generate a seeded trace. Lengths are distributions written "
                    "NAME:k=v,... : fixed:128, uniform:low=64,high=512, "
                    "normal:mean=1000,std=200, lognormal:mean=1000,sigma=0.6, "
                    "zipf:a=2.5,scale=64 (a bare value is the next parameter in that "
                    "order: uniform:64,512, lognormal:1000,0.6); each also takes min= and "
                    "max= to clip "
                    "(every draw is clipped to 1e9 tokens; a zipf a <= 2 has no finite "
                    "mean: give it a max=).")
    gen.add_argument("--num-requests", "-n", type=int, default=100,
                     help="requests in the trace (a conversation's turns count one each)")
    gen.add_argument("--rate", type=finite_float, default=1.0,
                     help="mean arrivals (conversations) per second")
    gen.add_argument("--arrival", default="poisson", choices=("poisson", "gamma", "burst"),
                     help="the arrival process: poisson, gamma (--cv), or bursts "
                          "(--burst-size) arriving at once")
    gen.add_argument("--cv", type=finite_float, default=None,
                     help="gamma: coefficient of variation of the gaps (>1: burstier; "
                          "default 1)")
    gen.add_argument("--burst-size", type=int, default=None,
                     help="burst: requests per burst (default 8)")
    gen.add_argument("--prompt-len", default="uniform:64,512", metavar="DIST",
                     help="prompt lengths: each request's own text (a turn's new text in a "
                          "conversation); with --prefix-groups a request's shared prefix "
                          "comes on top of it")
    gen.add_argument("--output-len", default="uniform:32,256", metavar="DIST",
                     help="answer lengths before EOS (the trace's output_len)")
    gen.add_argument("--max-tokens", type=int, help="max_tokens of every request")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="every request runs to its max_tokens (the trace's ignore_eos; "
                          "needs --max-tokens)")
    gen.add_argument("--prefix-groups", type=int, default=0,
                     help="number of shared system prompts (0: none)")
    gen.add_argument("--prefix-len", default=None, metavar="DIST",
                     help="length of each shared system prompt (default fixed:256)")
    gen.add_argument("--prefix-fraction", type=finite_float, default=None,
                     help="share of requests that start with a shared prompt (default 1)")
    gen.add_argument("--turns", default="fixed:1", metavar="DIST",
                     help="turns per conversation; each turn's prompt holds the previous "
                          "prompt and answer")
    gen.add_argument("--think-time", type=finite_float, default=None,
                     help="mean seconds between turns (exponential; default 5)")
    gen.add_argument("--sessions", action="store_true",
                     help="multi-turn conversations name their session (session_id "
                          "conv<N>), for simulate --max-session-kv")
    gen.add_argument("--priorities", default="",
                     help="priority classes and weights, e.g. 0:0.2,1:0.8")
    gen.add_argument("--seed", type=seed, default=0,
                     help="seed of every draw (the same seed, the same trace)")
    gen.add_argument("--output", "-o", metavar="PATH.jsonl", help="default: stdout")
    gen.set_defaults(run=run_gen)


def run_gen(args: argparse.Namespace) -> int:
    with cli_errors():
        from kvserve.sim.trace import dump_trace
        from kvserve.sim.workloads import WorkloadSpec, generate

        for flag, value, arrival in (("--cv", args.cv, "gamma"),
                                     ("--burst-size", args.burst_size, "burst")):
            if value is not None and args.arrival != arrival:
                raise ValueError(f"{flag} shapes --arrival {arrival}, not {args.arrival}")
        if not args.prefix_groups:
            for flag, value in (("--prefix-len", args.prefix_len),
                                ("--prefix-fraction", args.prefix_fraction)):
                if value is not None:
                    raise ValueError(f"{flag} shapes the shared system prompts: give "
                                     "--prefix-groups N")
        if args.ignore_eos and args.max_tokens is None:  # QA: output_len then shaped nothing
            raise ValueError("--ignore-eos runs every request to its max_tokens: give "
                             "--max-tokens N (without it a request runs to the model's "
                             "length, whatever --output-len says)")
        if args.output:  # before the work, not after it (QA: 97 s for 10^6, then refused)
            check_output_file("--output", args.output)
        given = {name: getattr(args, name) for name in (  # else WorkloadSpec's defaults
            "cv", "burst_size", "prefix_len", "prefix_fraction", "think_time")
            if getattr(args, name) is not None}
        spec = WorkloadSpec(
            num_requests=args.num_requests, rate=args.rate, arrival=args.arrival,
            prompt_len=args.prompt_len, output_len=args.output_len,
            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
            prefix_groups=args.prefix_groups, turns=args.turns, priorities=args.priorities,
            seed=args.seed, sessions=args.sessions, **given)
        requests = generate(spec)
        _check_used(args, requests)
        text = dump_trace(requests)
        if args.output:
            try:
                with open(args.output, "w", encoding="utf-8") as handle:
                    handle.write(text)
            except OSError as error:
                raise ValueError(f"cannot write {args.output}: {error.strerror}") from None
            print(f"wrote {spec.num_requests} requests to {args.output}", file=sys.stderr)
        else:
            sys.stdout.write(text)
    return 0


def _check_used(args: argparse.Namespace, requests: list[Any]) -> None:
    """Flags that shaped no request are named: --sessions names multi-turn conversations'
    sessions, and a shared system prompt goes to single-turn requests only (a trace line
    names one prefix, and a turn's is its conversation so far)."""
    from kvserve.sim.workloads import is_turn

    turns = sum(1 for r in requests if is_turn(r))
    for flag, given in (("--sessions", args.sessions),
                        ("--think-time", args.think_time is not None)):
        if given and not turns:
            raise ValueError(f"{flag} shapes multi-turn conversations, and this trace has "
                             "none: give --turns with more than one turn")
    if args.prefix_groups and turns:
        if turns == len(requests):
            raise ValueError("--prefix-groups gives single-turn requests a shared system "
                             "prompt, and every request here is a turn of a conversation "
                             "(whose prefix is the conversation so far)")
        print(f"note: the {turns} turns of multi-turn conversations take no shared system "
              "prompt (--prefix-groups applies to the single-turn requests)", file=sys.stderr)
