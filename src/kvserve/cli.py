"""`kvserve` command line: one subcommand per capability.

Each subcommand lives beside the layer it drives and registers itself here with
``add_parser(subparsers)``; bad input prints one line naming the problem and exits with 2.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvserve import __version__
from kvserve.flags import (
    VLLM_FLAG_HINTS,
    CLIError,
    check_output_paths,
    refused_vllm_flag,
    vllm_refusal,
)

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
    if given[:1] == ["serve"]:  # serve's own (QA: `bench serve --config` read it as serve's)
        try:
            given = with_config_file(given, _subparser_named(parser, "serve"))
        except CLIError as error:
            print(f"kvserve serve: error: {error}", file=sys.stderr)
            return 2
    args, extra = parser.parse_known_args(given)
    command = _subparser(parser, args)
    # A vLLM flag the command does not take is refused by name, with its value and what to
    # give instead (flags.VLLM_FLAG_HINTS), before "unrecognized arguments" could list the
    # value it left as the model path (--gpu-memory-utilization 0.9 MODEL).
    refused = refused_vllm_flag([_dashed(arg) for arg in given], command._option_string_actions)
    if refused is not None:
        command.error(refused)
    leftover = _boolean_leftover(given, [getattr(args, "model", None), *extra])
    if leftover is not None:
        command.error(leftover)
    if extra:  # named by the subcommand
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        check_output_paths(args)
        return int(args.run(args) or 0)
    except CLIError as error:
        print(f"kvserve {_command_name(args)}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line and a shell's 130 (QA: a traceback)
        print(f"kvserve {_command_name(args)}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # standard output's reader left (| head): nothing more to say
        _stdout_to_devnull()
        return 1
    except OSError as error:  # the machine's, not a bug: a full disk or standard output, a
        # path the OS refuses (QA: `kvserve info > /dev/full`, `calibrate -o /proc/x`)
        where = error.filename or "writing the output"
        print(f"kvserve {_command_name(args)}: error: {where}: {error.strerror or error}",
              file=sys.stderr)
        return 2


def _boolean_leftover(given: list[str], leftovers: list[Any]) -> str | None:
    """vLLM's older boolean flags took a value (``--enable-chunked-prefill False``); here
    they take none, so the value was read as the model path or left over, and the message
    blamed the model (the flags pass). The refusal names the flag and the spelling."""
    for word in leftovers:
        if not isinstance(word, str) or word.lower() not in ("true", "false") or \
                os.path.exists(word) or word not in given:
            continue
        index = given.index(word)
        flag = given[index - 1] if index and given[index - 1].startswith("--") else None
        if flag is None:
            continue
        name = flag.removeprefix("--no-").removeprefix("--")
        return (f"{flag} {word}: {flag} takes no value here (vLLM's older boolean form): "
                f"write --{name} for true, --no-{name} for false")
    return None


def _stdout_to_devnull() -> None:
    """Standard output to /dev/null, so the interpreter's flush at exit does not fail on the
    closed pipe again (with an "Exception ignored" message)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _command_name(args: argparse.Namespace) -> str:
    """A nested command by its whole name (QA: `kvserve workload gen`'s said `workload`)."""
    sub = getattr(args, f"{args.command}_command", None)
    return args.command if sub is None else f"{args.command} {sub}"


def _subparser_named(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices[name]


def with_config_file(argv: list[str], serve: argparse.ArgumentParser) -> list[str]:
    """vLLM's ``--config FILE``: a YAML mapping of serve's flags (``max-model-len: 4096``,
    ``enable-prefix-caching: false``, ``served-model-name: [a, b]``, ``model: PATH``), read
    as if given on the command line, which wins where it gives the same flag. CLIError
    naming what cannot be read."""
    end = argv.index("--") if "--" in argv else len(argv)
    at = next((i for i, arg in enumerate(argv[:end])
               if arg == "--config" or arg.startswith("--config=")), None)
    if at is None:
        return argv
    path = argv[at].partition("=")[2] if "=" in argv[at] else (
        argv[at + 1] if at + 1 < end else None)
    rest = argv[:at] + argv[at + (1 if "=" in argv[at] else 2):]
    flags_end = rest.index("--") if "--" in rest else len(rest)
    if any(arg == "--config" or arg.startswith("--config=") for arg in rest[:flags_end]):
        raise CLIError("give one --config file (QA: the second was ignored)")
    if not path:
        raise CLIError("--config needs a YAML file")
    try:
        import yaml

        with open(path, encoding="utf-8") as file:
            settings = yaml.safe_load(file)
    except ImportError:
        raise CLIError("--config needs PyYAML (pip install pyyaml)") from None
    except OSError as error:
        raise CLIError(f"--config {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:  # QA: a traceback
        raise CLIError(f"--config {path}: not UTF-8 text (a YAML file of serve's flags)"
                       ) from None
    except yaml.YAMLError as error:
        raise CLIError(f"--config {path}: not YAML: {str(error).splitlines()[0]}") from None
    if settings is None:
        return rest
    if not isinstance(settings, dict):
        raise CLIError(f"--config {path}: a mapping of flags to values is expected, got a "
                       f"{type(settings).__name__}")
    end = rest.index("--") if "--" in rest else len(rest)  # the flags end there
    given = {_dashed(arg).partition("=")[0] for arg in rest[:end] if arg.startswith("--")}
    known = serve._option_string_actions
    extra: list[str] = []
    model: list[str] = []
    for key, value in settings.items():
        flag = "--" + str(key).replace("_", "-")
        if key == "model":
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                if value is not None:  # QA: a list became the path "['a', 'b']"
                    raise CLIError(f"--config {path}: model must be a path, got {value!r}")
                continue
            model = [str(value)]
            continue
        if flag in VLLM_FLAG_HINTS and flag not in known:  # as on the command line (the
            raise CLIError(f"--config {path}: {vllm_refusal(flag, str(value))}")  # flags pass)
        if flag not in known or flag == "--config":  # QA: a nested config: ignored
            raise CLIError(f"--config {path}: {key!r} is not a flag of kvserve serve")
        if flag in given or f"--no-{flag[2:]}" in given:
            continue  # the command line wins
        switch = known[flag].nargs == 0  # takes no value: true or false (QA: a quoted
        if switch and not isinstance(value, bool) and value is not None:  # 'no' was the model)
            raise CLIError(f"--config {path}: {key} takes true or false, got "
                           f"{value!r}"[:300])
        if value is True:
            extra.append(flag)
        elif value is False:
            if f"--no-{flag[2:]}" in known:
                extra.append(f"--no-{flag[2:]}")
        elif isinstance(value, list):
            if known[flag].nargs in (None, 1, "?"):  # QA: its second value became the model
                raise CLIError(f"--config {path}: {key} takes one value, got a list")
            extra += [flag, *(str(item) for item in value)]
        elif value is not None:
            extra.append(f"{flag}={value}")  # one token: a value may start with "-" (QA)
    if model and not _has_model(rest, serve):
        index = rest.index("serve") + 1
        rest = rest[:index] + model + rest[index:]
        end += len(model)
    return rest[:end] + extra + rest[end:]  # before a "--", where flags are still read


def _has_model(argv: list[str], serve: argparse.ArgumentParser) -> bool:
    """Whether the command line names a model (serve's positional)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the real parse says it, once
            args, _ = serve.parse_known_args(argv[argv.index("serve") + 1:])
    except SystemExit:
        return True
    return getattr(args, "model", None) is not None


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
