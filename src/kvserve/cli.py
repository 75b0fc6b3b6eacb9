"""`kvserve` command line: one subcommand per capability.

Each subcommand lives beside the layer it drives and registers itself here with
``add_parser(subparsers)``; bad input prints one line naming the problem and exits with 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvserve import __version__
from kvserve.flags import CLIError, refused_vllm_flag

__all__ = ["CLIError", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``kvserve simulate: error: ...``), exit 2;
    ``--help`` still prints the full usage. Subcommand parsers inherit this class.

    As vLLM's parser: ``--max_num_seqs`` is ``--max-num-seqs``. Unlike argparse's default, a
    flag is never taken from its prefix (``--max-num`` silently meant ``--max-num-seqs``, and
    a new flag sharing the prefix would change what an old command line means)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        args = list(sys.argv[1:] if args is None else args)
        end = args.index("--") if "--" in args else len(args)  # after it: not flags
        return super().parse_known_args([*map(_dashed, args[:end]), *args[end:]], namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _dashed(arg: str) -> str:
    """``--a_b=c_d`` as ``--a-b=c_d``: a long flag's name with dashes, its value as given."""
    if not arg.startswith("--") or "_" not in arg:
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvserve",
        description="LLM serving with a transparent scheduler, and a simulator that drives it.",
    )
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from kvserve.bench import cli_bench
    from kvserve.engine import cli_calibrate, cli_generate
    from kvserve.model import cli_info
    from kvserve.server import cli_record, cli_serve
    from kvserve.sim.commands import register as register_sim

    register_sim(subparsers)
    cli_generate.add_parser(subparsers)
    cli_calibrate.add_parser(subparsers)
    cli_serve.add_parser(subparsers)
    cli_record.add_parser(subparsers)
    cli_bench.add_parser(subparsers)
    cli_info.add_parser(subparsers)
    return parser


def set_process_defaults() -> None:
    """What the ``kvserve`` command sets for its own process (and the processes it starts)
    before anything imports torch; a value the user set is kept.

    OMP_WAIT_POLICY=PASSIVE: PyTorch's CPU kernels run on OpenMP threads that spin while they
    wait for each other. When anything else wants a core (the server's event loop, another
    process), a spinning thread keeps the one it waits for off the CPU: a decode step measured
    9.2 s with spinning against 0.45 s with passive waiting on the 2-core machine under load.
    On an idle machine spinning is about 20% faster in decode (0.23 vs 0.27 s), so a dedicated
    offline run may set OMP_WAIT_POLICY=ACTIVE itself. Library use (``LLM()``) leaves the
    environment as the caller set it.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: Sequence[str] | None = None) -> int:
    set_process_defaults()
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(given)
    command = _subparser(parser, args)
    # A vLLM flag the command does not take is refused by name, with its value and what to
    # give instead (flags.VLLM_FLAG_HINTS), before "unrecognized arguments" could list the
    # value it left as the model path (--gpu-memory-utilization 0.9 MODEL).
    refused = refused_vllm_flag([_dashed(arg) for arg in given], command._option_string_actions)
    if refused is not None:
        command.error(refused)
    if extra:  # named by the subcommand
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.run(args) or 0)
    except CLIError as error:
        print(f"kvserve {args.command}: error: {error}", file=sys.stderr)
        return 2


def _subparser(parser: argparse.ArgumentParser,
               args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command ``args`` ran, however deep (``kvserve bench serve``'s, not
    ``kvserve bench``'s: its flags are the ones to read)."""
    while True:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, actions[0].dest, None) if actions else None
        if chosen is None:
            return parser
        parser = actions[0].choices[chosen]


if __name__ == "__main__":
    sys.exit(main())
