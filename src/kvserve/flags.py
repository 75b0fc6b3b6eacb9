"""Command-line plumbing shared by every subcommand: the scheduler and cache flags
(docs/architecture.md, "Flags"), so a simulated deployment is written exactly like a served one, the
model flags of the commands that load one, and :class:`CLIError`. Flags left unset keep the
core's defaults. Imports only the core.

Parsed flags become a flat ``settings`` dict (scheduler fields, cache fields, batching);
``--sweep NAME=...`` overrides one of its keys per run. The commands that load a model turn
their flags into ``build_engine``'s keyword arguments with :func:`engine_args`, in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from kvserve.core import CacheConfig, SchedulerConfig
from kvserve.core.checks import is_int
from kvserve.core.config import (
    ADMISSION_POLICIES,
    DEFAULT_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_HOST_BLOCKS,
    PREEMPTION_MODES,
    PREFIX_CACHE_SCOPES,
    PREFIX_CACHING_HASH_ALGOS,
    SCHEDULING_POLICIES,
    STEP_MIXES,
    TENANT_FAIRNESS,
    VICTIM_POLICIES,
    swaps,
)

logger = logging.getLogger("kvserve.cli")


class CLIError(Exception):
    """Bad input on the command line: printed as one line, exit code 2."""


_SCHEDULER_FLAGS: tuple[tuple[str, Any, str], ...] = (  # (dest, type or "tokens", help)
    ("max_num_seqs", int, "most requests running at once (default 256; simulating a "
     "recording: as recorded)"),
    ("max_num_batched_tokens", "tokens", "token budget of one step (default 2048; simulating "
     "a recording: as recorded)"),
    ("max_model_len", "tokens", "longest sequence (prompt + output; 4k, 32K as vLLM "
                                "reads them); default: the model's "
                           "context in serve and generate, 2048 in simulate, plan and whatif "
                           "(a recording: as recorded)"),
    ("long_prefill_token_threshold", int, "cap on one request's prefill chunk; 0: off "
     "(default)"),
    ("watermark", float, "fraction of KV blocks kept free when admitting (default 0)"),
    ("max_num_queued_reqs", int, "reject arrivals beyond this many waiting requests (per "
     "data-parallel replica, as max_num_seqs)"),
    ("max_num_queued_tokens", int, "reject arrivals beyond this many waiting tokens (per "
     "replica)"),
    ("max_queue_delay", float, "abort a request that waited this many seconds unscheduled"),
    ("max_num_queued_reqs_per_tenant", int, "reject a tenant's arrivals beyond this many of "
     "its requests waiting (per replica)"),
    ("lpm_max_queue", int, "lpm and dfs-weight sort a waiting queue of at most this many "
     "requests and serve a longer one FCFS (default 128)"),
    ("schedule_aging_s", float, "aging, off by default: under priority a waiting request's "
     "priority value drops by one per this many seconds waited; under lpm and dfs-weight it "
     "is promoted ahead of cache hits after this many seconds"),
    ("max_session_kv", float, "sessions, off by default: the fraction of KV blocks that "
     "finished turns of multi-turn sessions may keep held for their next turn"),
    ("session_ttl_s", float, "seconds a session's KV is held after its turn (default 30; a "
     "request's session ttl overrides it)"),
    ("max_held_first", int, "at most this many session turns holding KV admitted ahead of a "
     "waiting ordinary request before it is served (default 0: no bound; held turns go "
     "first, rules L1, L6)"),
)
CACHE_KEYS = ("block_size", "num_kv_blocks", "kv_cache_memory", "enable_prefix_caching",
              "swap_space", "num_host_blocks", "prefix_caching_hash_algo")
# The simulator hashes blocks with the cheap algorithm unless told otherwise: a hash decides
# only whether two blocks are equal (docs/scheduler.md, G3). The engine's default: blake2b.
SIM_HASH_ALGO = "builtin"
# vLLM's --dtype spellings, for the engine and the simulator alike (docs/dtype.md)
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
# kvserve.model.device (not imported: that imports torch); cuda:N is taken too
DEVICES = ("auto", "cpu", "cuda")
# kvserve.model.quantization.QUANTIZATIONS (not imported: that imports torch)
QUANTIZATIONS = ("int8",)
# A host tier past this is a typo (vLLM's --swap-space is GiB per device; 1 PiB is absurd).
MAX_SWAP_SPACE = 2**50
SCHEDULER_KEYS = tuple(f.name for f in dataclasses.fields(SchedulerConfig))

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10, "m": 10**6,
          "mb": 10**6, "mib": 2**20, "mi": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30,
          "gi": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40, "ti": 2**40}


def write_file_atomically(path: str | os.PathLike[str], text: str) -> None:
    """``text`` into ``path`` whole or not at all: written beside it and moved over it, so a
    write that fails (a full disk, a file-size limit) leaves the file as it was (the
    calibration pass: a half-written model replaced the good one)."""
    target = os.fspath(path)
    if os.path.islink(target) or (os.path.exists(target) and not os.path.isfile(target)):
        with open(target, "w", encoding="utf-8") as handle:  # a link or a device (the
            handle.write(text)  # review: /dev/stdout was replaced by a file): written
        return  # through, in place
    temporary = f"{target}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
        if os.path.exists(target):  # the file's own permissions kept (0600 became 0644)
            os.chmod(temporary, os.stat(target).st_mode & 0o7777)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def check_output_file(flag: str, path: str) -> None:
    """CLIError unless ``path`` can be written as a file (its folder exists, it is not a
    folder): checked before long work, so that the work's result is not lost at the end."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CLIError(f"{flag} {path}: is a directory; give a file name")
    if os.path.exists(path) and not os.path.isfile(path):  # QA: /dev/full, at the end
        raise CLIError(f"{flag} {path}: is not a regular file; give a file name")
    if not os.path.isdir(folder):
        raise CLIError(f"{flag} {path}: no such directory {folder}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CLIError(f"{flag} {path}: permission denied")
    if not os.path.exists(path):  # as root, os.access says yes to anything (QA: /proc/x)
        try:
            with open(path, "x"):
                pass
        except OSError as error:
            raise CLIError(f"{flag} {path}: {error.strerror or error}") from None
        os.remove(path)


# Where a command writes (its args' dest -> the flag) and the dests that hold paths it reads.
OUTPUT_FLAGS = {"report": "--report", "html": "--html", "events": "--events",
                "output": "--output", "plot": "--plot", "result_filename": "--result-filename"}
INPUT_DESTS = ("trace", "recording", "step_logs", "calibration", "replay_step_times")


def check_output_paths(args: Any) -> None:
    """CLIError where an output path is empty, is "-" (no file: standard output is what a
    command prints anyway; ``workload gen -o -`` is taken as that), is a file the command
    reads (QA: ``simulate --trace t.jsonl --report t.jsonl`` replaced the trace; a file in
    a recording directory counts), or is given to two outputs (the last one won)."""
    if getattr(args, "command", None) == "workload" and getattr(args, "output", None) == "-":
        args.output = None  # standard output, as --trace - reads standard input
    outputs = [(flag, getattr(args, dest)) for dest, flag in OUTPUT_FLAGS.items()
               if isinstance(getattr(args, dest, None), str)]
    inputs: dict[str, str] = {}  # real path -> the input it is part of
    for dest in INPUT_DESTS:
        value = getattr(args, dest, None)
        for path in (value if isinstance(value, list) else [value]):
            if not isinstance(path, str) or path in ("", "-"):
                continue
            files = [os.path.join(path, name) for name in os.listdir(path)] \
                if os.path.isdir(path) else [path]
            inputs.update((os.path.realpath(file), path) for file in files)
    written: dict[str, str] = {}
    for flag, path in outputs:
        if path in ("", "-"):
            raise CLIError(f"{flag} needs a file name, got {path!r}")
        where = os.path.join(getattr(args, "result_dir", None) or "", path) \
            if flag == "--result-filename" else path  # bench's file is in --result-dir
        real = os.path.realpath(where)
        if real in inputs:
            source = "" if inputs[real] == path else f" (in {inputs[real]})"
            raise CLIError(f"{flag} {path} is a file this command reads{source}: writing it "
                           "would replace it; give another file")
        if real in written:
            raise CLIError(f"{flag} and {written[real]} are both {path}: give each its own")
        written[real] = flag


# vLLM's flags that have nothing to do here: taken so a vLLM command line runs unchanged,
# each given one logging why it does nothing (docs/vllm-compat.md). (flags, add_argument's
# keywords, why.) --tensor-parallel-size, --pipeline-parallel-size, --tokenizer-mode and
# --kv-cache-dtype are taken at their neutral value only (VLLM_NOOP_NEUTRAL).
_NO_GRAPHS = "there are no CUDA graphs or torch.compile here: every step runs eagerly"
VLLM_NOOPS: tuple[tuple[tuple[str, ...], dict[str, Any], str], ...] = (
    (("--trust-remote-code",), {"action": "store_true"},
     "no model code is run: kvserve implements the Llama family itself"),
    (("--tokenizer-mode",), {"metavar": "auto"},
     "the tokenizer is the model's own (auto is the only mode)"),
    (("--enforce-eager",), {"action": "store_true"}, _NO_GRAPHS),
    (("--enable-reasoning",), {"action": "store_true"},
     "--reasoning-parser alone splits the reasoning out (vLLM 0.10 dropped this flag)"),
    (("--max-seq-len-to-capture",), {"type": int, "metavar": "N"}, _NO_GRAPHS),
    (("--compilation-config", "-O"), {"metavar": "LEVEL_OR_JSON"}, _NO_GRAPHS),
    (("--disable-custom-all-reduce",), {"action": "store_true"},
     "there is no tensor parallelism, so no all-reduce"),
    (("--tensor-parallel-size", "-tp"), {"type": int, "metavar": "1"},
     "one engine holds the whole model (--data-parallel-size runs replicas)"),
    (("--pipeline-parallel-size", "-pp"), {"type": int, "metavar": "1"},
     "one engine holds the whole model (--data-parallel-size runs replicas)"),
    (("--disable-frontend-multiprocessing",), {"action": "store_true"},
     "the API server already runs in one process, as vLLM V1's, and the engine in its own "
     "(--no-engine-process runs it on a thread instead)"),
    (("--download-dir",), {"metavar": "DIR"}, "nothing is downloaded: the model is a path"),
    (("--revision",), {"metavar": "REV"}, "nothing is downloaded: the model is a path"),
    (("--kv-cache-dtype",), {"metavar": "auto"},
     "the KV cache is in the model's dtype (--dtype), as auto asks"),
    (("--disable-fastapi-docs",), {"action": "store_true"},
     "the server has no /docs, /redoc or /openapi.json pages to turn off"),
    (("--enable-request-id-headers",), {"action": "store_true"},
     "every answer carries X-Request-Id here already"),
    (("--enable-server-load-tracking",), {"action": "store_true"},
     "GET /load always answers the requests under way here"),
    (("--enable-log-outputs",), {"action": "store_true"},
     "no prompt or answer text is logged here (a log is read by more people than the "
     "prompts' authors); --enable-log-requests logs their lengths"),
    (("--async-scheduling",), {"action": "store_true"},
     "each step is scheduled once the last one's tokens are back (the engine process "
     "already keeps the HTTP server off the step's way)"),
    (("--distributed-executor-backend",), {"metavar": "mp|ray"},
     "there are no tensor- or pipeline-parallel workers to place (--data-parallel-backend "
     "places replicas)"),
    (("--disable-sliding-window",), {"action": "store_true"},
     "kvserve's attention keeps no window: a sliding window shorter than the context caps "
     "the context at it always, as vLLM does with this flag"),
    (("--show-hidden-metrics-for-version",), {"metavar": "VERSION"},
     "no metric is hidden here"),
    (("--cuda-graph-sizes",), {"nargs": "+", "metavar": "N"}, _NO_GRAPHS),
    (("--structured-outputs-config", "--guided-decoding-backend"), {"metavar": "BACKEND"},
     "structured outputs have one backend here, the sampler's own (docs/structured-"
     "outputs.md)"),
    (("--api-server-count",), {"type": int, "metavar": "1"},
     "one API server process; --data-parallel-size runs engine replicas behind it"),
    (("--logprobs-mode",), {"metavar": "raw_logprobs"},
     "logprobs are the model's own distribution, before the sampling parameters shape it "
     "(raw_logprobs, vLLM's default)"),
)
# The value each of these takes (another value is refused with flags.VLLM_FLAG_HINTS' hint)
VLLM_NOOP_NEUTRAL: dict[str, Any] = {
    "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "tokenizer_mode": "auto",
    "kv_cache_dtype": "auto", "api_server_count": 1, "logprobs_mode": "raw_logprobs"}


def vllm_noop(dest: str) -> tuple[Any, str] | None:
    """(the value it is taken at, or None for any; why it does nothing) for a vLLM flag or
    argument by its Python name (``enforce_eager``), or None where it is not a no-op."""
    for names, _, why in VLLM_NOOPS:
        if any(name.lstrip("-").replace("-", "_") == dest for name in names):
            return VLLM_NOOP_NEUTRAL.get(dest), why
    return None


# vLLM serving flags a command here does not take: whether each takes a value, and what to
# do instead (kvserve.cli refuses them before a value could be read as the model; a command
# that defines one of these names, as simulate does --gpu-memory-utilization, takes it).
# docs/vllm-compat.md lists them.
_NO_TP = "there is no tensor parallelism; --data-parallel-size runs replicas"
_NO_PP = "there is no pipeline parallelism; --data-parallel-size runs replicas"
_NO_LORA = "there are no LoRA adapters: serve a model directory with the adapter merged"
VLLM_FLAG_HINTS: dict[str, tuple[bool, str]] = {
    "--gpu-memory-utilization": (True, "the KV cache is sized by --kv-cache-memory (e.g. "
                                       "4GiB) or --num-kv-blocks"),
    "--tensor-parallel-size": (True, _NO_TP),
    "-tp": (True, _NO_TP),
    "--pipeline-parallel-size": (True, _NO_PP),
    "-pp": (True, _NO_PP),
    "--enable-lora": (False, _NO_LORA),
    "--lora-modules": (True, _NO_LORA),
    "--middleware": (True, "no ASGI middleware is loaded from the command line: put a proxy "
                           "in front, or mount kvserve.server.app.build_app in your own app"),
    "--limit-mm-per-prompt": (True, "there is no multimodal input: text models only "
                                    "(image and audio parts are refused)"),
    "--logprobs-mode": (True, "logprobs are the model's own distribution (raw_logprobs); "
                              "the sampled token and its rank tell what the sampler drew"),
    "--kv-cache-dtype": (True, "the engine's KV cache is in the model's dtype (--dtype); "
                               "kvserve simulate --kv-cache-dtype models an fp8 one"),
    "--tokenizer-mode": (True, "the tokenizer is the model's own (its tokenizer.json or GGUF "
                               "vocabulary)"),
    "--tokenizer": (True, "the tokenizer is the model's own: a GGUF file carries its "
                          "vocabulary, a directory its tokenizer.json (the offline "
                          "LLM(tokenizer=PATH) takes another)"),
    "--api-server-count": (True, "one API server process serves here (the engine runs in its "
                                 "own); --data-parallel-size N runs N engine replicas behind it"),
}


def vllm_refusal(flag: str, value: str | None = None) -> str:
    """The one line that refuses vLLM's ``flag`` (given ``value``) with what to do instead."""
    shown = f"{flag} {value}" if value else flag
    return f"vLLM's {shown} is not taken here: {VLLM_FLAG_HINTS[flag][1]}"


def refused_vllm_flag(argv: list[str], known: Any) -> str | None:
    """The refusal of the first vLLM flag of VLLM_FLAG_HINTS in ``argv`` (flags spelt with
    dashes; before any ``--``) that ``known`` (the command's option strings) lacks, naming
    the value it was given, or None."""
    end = argv.index("--") if "--" in argv else len(argv)
    for index, token in enumerate(argv[:end]):
        name, eq, value = token.partition("=")
        if name not in VLLM_FLAG_HINTS or name in known:
            continue
        if not eq and VLLM_FLAG_HINTS[name][0] and index + 1 < end and \
                not argv[index + 1].startswith("-"):
            value = argv[index + 1]
        return vllm_refusal(name, value or None)
    return None


def check_url(flag: str, url: str) -> str:
    """``url`` without a trailing slash, or CLIError unless it is an http(s) URL with a
    host (QA: "http://[::1" was a ValueError's traceback)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError as error:
        raise CLIError(f"{flag} {url!r} is not a URL: {error}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CLIError(f"{flag} {url!r} is not an http(s) URL")
    host = parts.hostname
    if host.replace(".", "").isdigit():  # QA: http://256.1.1.1 was httpx's traceback
        import ipaddress

        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise CLIError(f"{flag} {url!r} is not a URL: {host} is not an IPv4 "
                           "address") from None
    return url.rstrip("/")


def finite_float(text: str) -> float:
    """A number flag's value: a float that is finite (QA: ``--gpu-memory-gib inf`` and
    ``--prefill-flops inf`` were tracebacks, ``nan`` a message naming no flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


SEED_RANGE = (-(1 << 63), 1 << 64)  # what a torch generator takes (and the API's seed)


def parse_seed(text: str) -> int:
    """A sampling seed: an integer in [-2**63, 2**64)."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"{seed} is out of range: a seed is in "
                                         "[-2**63, 2**64)")
    return seed


_COUNT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtKMGT]?)\s*$")


def parse_token_count(text: str) -> int:
    """A count of tokens as vLLM's human_readable_int reads it: 2048, 4k (4,000), 25.6k
    (25,600), 4K (4,096: an upper-case unit is binary, and whole)."""
    match = _COUNT.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of tokens (e.g. 2048, "
                                         "4k = 4000, 4K = 4096)")
    number, unit = match.groups()
    if not unit:
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
        return int(number)
    power = "kmgt".index(unit.lower()) + 1
    if unit.isupper():
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: a binary unit ({unit}) takes a whole "
                                             f"number; use {unit.lower()} for a decimal one")
        return int(number) * 1024 ** power
    value = Fraction(number) * 1000 ** power
    if value.denominator != 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


def parse_bytes(text: str) -> int:
    """'2147483648', '2GiB', '1.5 GB' -> bytes."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 8GiB or 2000000000")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def parse_gib(text: str) -> int:
    """--swap-space: a number of GiB, as vLLM takes it ('4', '0.5'), or a size with a unit
    ('512MiB') -> bytes."""
    try:
        return int(float(text) * 2**30)
    except (ValueError, OverflowError):
        return parse_bytes(text)


def add_scheduler_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scheduler and KV cache (same flags as kvserve serve)")
    for name, kind, text in _SCHEDULER_FLAGS:
        group.add_argument("--" + name.replace("_", "-"), dest=name,
                           type=parse_token_count if kind == "tokens" else kind, help=text)
    group.add_argument("--enable-chunked-prefill", dest="enable_chunked_prefill",
                       action=argparse.BooleanOptionalAction,
                       help="split long prompts (on by default)")
    group.add_argument("--step-mix", dest="step_mix", choices=STEP_MIXES,
                       help="mixed (default, vLLM V1): decodes and prefill chunks share each "
                            "step; prefill-first (SGLang's default): while prefill work is "
                            "pending a step runs prefills only and decodes wait, for a lower "
                            "TTFT under load at the cost of the inter-token tail")
    group.add_argument("--max-prefill-only-steps", dest="max_prefill_only_steps", type=int,
                       help="with --step-mix prefill-first: at most this many prefill-only "
                            "steps in a row before one that decodes (default 0: no bound)")
    group.add_argument("--scheduling-policy", dest="scheduling_policy",
                       choices=SCHEDULING_POLICIES,
                       help="waiting-queue order: fcfs (default), priority, lpm (longest "
                            "cached prefix first), dfs-weight (SGLang's walk of the shared "
                            "prefix tree)")
    group.add_argument("--preemption-mode", dest="preemption_mode", choices=PREEMPTION_MODES,
                       help="what a preempted request's KV does: recompute (default), swap "
                            "to the host tier, or auto (the cheaper per victim)")
    group.add_argument("--swap-space", dest="swap_space", type=parse_gib,
                       help="host KV tier per device, GiB (e.g. 4) or a size (e.g. 512MiB); "
                            "needed by --preemption-mode swap/auto; under recompute, which "
                            "never swaps, none is allocated (vLLM V1 ignores it)")
    group.add_argument("--num-host-blocks", dest="num_host_blocks", type=int,
                       help="host KV tier in blocks, instead of --swap-space")
    group.add_argument("--enable-priority-preemption", dest="enable_priority_preemption",
                       action="store_true", default=None,
                       help="an urgent arrival preempts running requests (needs "
                            "--scheduling-policy priority)")
    group.add_argument("--priority-scheduling-preemption-threshold",
                       dest="priority_preemption_threshold", type=int,
                       help="only requests whose priority value exceeds the arrival's by more "
                            "than this are preempted (default 10)")
    group.add_argument("--max-preemptions-per-request", dest="max_preemptions_per_request",
                       type=int, help="a request preempted this many times is no longer "
                                      "a victim, except to let the earliest running request "
                                      "advance; with no victim left, the request that needed "
                                      "room waits a step (default: no limit; P1-P3)")
    group.add_argument("--victim-policy", dest="victim_policy", choices=VICTIM_POLICIES,
                       help="which running request a short pool preempts: vllm (default: "
                            "the newest admitted, or under priority the least urgent), sglang "
                            "(fewest output tokens first), least-computed (fewest computed "
                            "tokens first) (K1)")
    group.add_argument("--admission-policy", dest="admission_policy",
                       choices=ADMISSION_POLICIES,
                       help="room an admission leaves for running requests' next tokens: "
                            "optimistic (default, vLLM), reserve (their whole max_tokens), "
                            "adaptive (SGLang's decaying new-token ratio) (K2)")
    group.add_argument("--block-size", dest="block_size", type=int,
                       help="tokens per KV block, 1 to 1024 (default 16)")
    group.add_argument("--num-gpu-blocks-override", "--num-kv-blocks", dest="num_kv_blocks",
                       type=int, help="KV blocks in the pool (default: sized from memory)")
    group.add_argument("--kv-cache-memory", dest="kv_cache_memory", type=parse_bytes,
                       help="KV cache bytes per device (e.g. 20GiB) instead of a block count "
                            "(default: 1GiB in serve and generate; in simulate and plan, what "
                            "the device's memory leaves)")
    group.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                       action=argparse.BooleanOptionalAction,
                       help="reuse the KV of full blocks a previous prompt computed (on by "
                            "default)")
    group.add_argument("--prefix-caching-hash-algo", dest="prefix_caching_hash_algo",
                       type=parse_hash_algo,
                       metavar="{" + ",".join(PREFIX_CACHING_HASH_ALGOS) + "}",
                       help="how full blocks are hashed for the prefix cache: blake2b, "
                            "collision resistant (the engine's default), or builtin, a "
                            "64-bit non-cryptographic hash several times cheaper (the "
                            "simulator's default; not for untrusted multi-tenant serving)")
    group.add_argument("--prefix-cache-scope", dest="prefix_cache_scope",
                       choices=PREFIX_CACHE_SCOPES, help="tenant: each tenant's blocks hash "
                       "apart, nothing is shared or hinted across tenants (serve's default "
                       "with API keys); global: shared by all (the default otherwise)")
    group.add_argument("--tenant-fairness", dest="tenant_fairness", choices=TENANT_FAIRNESS,
                       help="vtc: admit from the tenant with the least weighted service "
                            "(Virtual Token Counter), within each priority level")


def add_command(subparsers: Any, name: str, run: Callable[[argparse.Namespace], int],
                summary: str, description: str) -> argparse.ArgumentParser:
    """A ``kvserve NAME`` subcommand whose parsed arguments go to ``run``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(name, help=summary,
                                                            description=description)
    parser.set_defaults(run=run)
    return parser


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The model and weights flags of the commands that load one (generate, serve,
    calibrate)."""
    parser.add_argument("model", nargs="?", default=None,
                        help="a GGUF file or a Hugging Face directory (default: the bundled "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--model", dest="model_option", metavar="MODEL",
                        help="the model, as vLLM's deprecated --model takes it (a warning "
                             "says so): give it as the positional argument instead; both "
                             "given must agree")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="weights, activations and KV cache; auto (default): the model's "
                             "own, bfloat16 for the bundled model, where this CPU computes "
                             "bf16 natively (AMX or AVX512-BF16) and on a GPU, else float32")
    parser.add_argument("--device", default="auto", type=parse_device,
                        help="where the model and KV cache run: cpu, cuda (or cuda:N; plain "
                             "torch ops on an NVIDIA GPU, docs/device.md); auto (default): "
                             "cuda where this torch sees a CUDA device, else cpu")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                        help="dummy: random weights with the model's shapes (benchmarks)")
    parser.add_argument("--seed", type=parse_seed, default=0,
                        help="seed for unseeded sampling")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="a greedy or seeded request gives the same tokens whatever else "
                             "runs (batch size, chunking, prefix hits, preemption), at a "
                             "speed cost (docs/tenants.md); vLLM's VLLM_BATCH_INVARIANT=1")
    parser.add_argument("--quantization", "-q", default=None, type=parse_quantization,
                        metavar="{" + ",".join(QUANTIZATIONS) + "}",
                        help="int8: the projections in dynamic W8A8 int8, quantized at load "
                             "(faster; greedy text differs from the float model's; "
                             "docs/quantization.md); default: none")


def _spelled(model: str) -> str:
    """A model path as compared: "m/" and "./m" name "m" (QA: refused as two models)."""
    return os.path.normpath(model)


_SIZE_UNITS = frozenset({"b", "k", "kb", "kib", "m", "mb", "mib", "g", "gb", "gib", "t", "tb",
                         "tib"})


def resolve_model_option(args: argparse.Namespace) -> None:
    """vLLM's deprecated ``--model X`` as the positional model (a warning says so); CLIError
    where both are given and differ. Called first by the commands that load a model."""
    model = getattr(args, "model", None)
    option = getattr(args, "model_option", None)
    if "" in (model, option):  # QA: read as the current directory ("$MODEL" unset)
        raise CLIError("the model path is empty: give a GGUF file or a Hugging Face "
                       "directory, or none for the bundled model")
    if option is not None and model is not None and _spelled(model) != _spelled(option):
        raise CLIError(f"the model is given twice, {model} and --model {option}: give "
                       "one (as the positional argument)")  # first (QA: "b" read as a unit)
    if isinstance(model, str) and model.lower() in _SIZE_UNITS and not os.path.exists(model):
        raise CLIError(f"model path {model!r} looks like a size's unit left over from a flag "
                       "(--kv-cache-memory 1 GiB): write a size without a space, e.g. 1GiB")
    if option is None:
        return
    logger.warning("--model is deprecated, as in vLLM: give the model as the positional "
                   "argument (kvserve %s %s ...)", getattr(args, "command", "serve"), option)
    args.model, args.model_option = option, None


def parse_hash_algo(text: str) -> str:
    """--prefix-caching-hash-algo's value; vLLM's sha256 and sha256_cbor are refused with
    the choice that does their job here (the flags pass: a bare "invalid choice")."""
    if text in PREFIX_CACHING_HASH_ALGOS:
        return text
    if text in ("sha256", "sha256_cbor"):
        raise argparse.ArgumentTypeError(f"vLLM's {text} is not taken here: blake2b is the "
                                         "collision-resistant hash (the engine's default)")
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from "
                                     f"{', '.join(PREFIX_CACHING_HASH_ALGOS)})")


def parse_quantization(text: str) -> str:
    """--quantization: one of QUANTIZATIONS; vLLM's other methods, named, with what there is
    instead."""
    if text not in QUANTIZATIONS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not supported here: --quantization int8 quantizes the projections "
            "at load (dynamic W8A8, docs/quantization.md); a checkpoint quantized ahead "
            "(awq, gptq, fp8, ...) cannot be loaded: serve its float weights")
    return text


def is_device_name(text: str) -> bool:
    """One of DEVICES, or ``cuda:N``."""
    kind, colon, index = text.partition(":")
    return kind in DEVICES and (not colon or (kind == "cuda" and index.isdigit()))


def parse_device(text: str) -> str:
    """``--device``: one of DEVICES or ``cuda:N`` (whether the device exists is checked when
    the engine starts, :func:`kvserve.model.device.resolve_device`)."""
    if not is_device_name(text):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; choose one of "
                                         f"{', '.join(DEVICES)} (or cuda:N)")
    return text


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """``build_engine``'s keyword arguments from the model, scheduler and cache flags; the
    flags left unset are left out, so build_engine's defaults apply. With neither
    --kv-cache-memory nor --num-kv-blocks, vLLM's VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV
    cache where it is set (:func:`env_kv_cache_space`)."""
    settings = settings_from_args(args)
    if "kv_cache_memory" not in settings and "num_kv_blocks" not in settings:
        space = env_kv_cache_space()
        if space is not None:
            settings["kv_cache_memory"] = space
    return {"dtype": args.dtype, "device": args.device, "load_format": args.load_format,
            "seed": args.seed,
            **({"batch_invariant": True} if getattr(args, "batch_invariant", False) else {}),
            **({"quantization": args.quantization}
               if getattr(args, "quantization", None) is not None else {}),
            **settings}


def env_kv_cache_space() -> int | None:
    """vLLM's VLLM_CPU_KVCACHE_SPACE, the CPU KV cache in GiB ('4', '0.5'; a size with a unit
    is taken too) as bytes, logged as coming from there; None where it is unset, empty or 0
    (vLLM's "not set": kvserve's own default then). CLIError for anything else."""
    text = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if not text:
        return None
    try:
        space = parse_gib(text)
    except argparse.ArgumentTypeError:
        space = -1
    if space < 0 or space > MAX_SWAP_SPACE:
        raise CLIError(f"VLLM_CPU_KVCACHE_SPACE {text!r}: give the KV cache's size in GiB, "
                       "like 4")
    if space == 0:
        return None
    bare = text.replace(".", "", 1).isdigit()  # GiB; a size names its own unit (QA: "MiB GiB")
    logger.info("KV cache memory: %s%s from VLLM_CPU_KVCACHE_SPACE (neither "
                "--kv-cache-memory nor --num-kv-blocks given)", text, " GiB" if bare else "")
    return space


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def configures_logging() -> bool:
    """False where vLLM's VLLM_CONFIGURE_LOGGING=0 asks kvserve to leave the logging
    configuration alone (no handler, no level set); CLIError for a value other than 0 or
    1."""
    value = os.environ.get("VLLM_CONFIGURE_LOGGING", "1").strip() or "1"
    if value not in ("0", "1"):
        raise CLIError(f"VLLM_CONFIGURE_LOGGING {value!r}: give 1 (kvserve configures its "
                       "log, the default) or 0 (it leaves logging alone)")
    return value == "1"


def configure_logging(format: str) -> None:
    """A command's log: lines in ``format`` on stderr from INFO, kvserve's loggers at vLLM's
    VLLM_LOGGING_LEVEL where it is set; nothing at all under VLLM_CONFIGURE_LOGGING=0, as
    vLLM (the embedding application's configuration stands). CLIError for a level that is
    not one of LOG_LEVELS."""
    if not configures_logging():
        return
    level = os.environ.get("VLLM_LOGGING_LEVEL", "").strip().upper()
    if level == "WARN":
        level = "WARNING"
    if level and level not in LOG_LEVELS:
        raise CLIError(f"VLLM_LOGGING_LEVEL {os.environ['VLLM_LOGGING_LEVEL']!r}: give one of "
                       f"{', '.join(LOG_LEVELS)}")
    logging.basicConfig(level=logging.INFO, format=format)
    if level:
        logging.getLogger("kvserve").setLevel(level)


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags the user set, as config keys; unset flags are left out. Raises CLIError
    for preemption flags that contradict each other (:func:`check_preemption_flags`)."""
    keys = (*SCHEDULER_KEYS, *CACHE_KEYS, "batching")
    settings = {k: getattr(args, k) for k in keys
                if getattr(args, k, None) is not None}
    if not 1 <= settings.get("num_kv_blocks", 1) <= MAX_BLOCKS:  # named as the flag
        raise CLIError(f"--num-kv-blocks must be in [1, {MAX_BLOCKS}], got "
                       f"{settings['num_kv_blocks']}")
    if "kv_cache_memory" in settings and "num_kv_blocks" in settings:
        raise CLIError("give --kv-cache-memory or --num-kv-blocks, not both (each sizes the "
                       "KV pool)")
    check_preemption_flags(settings)
    return settings


def check_preemption_flags(settings: dict[str, Any]) -> None:
    """Issue 12's flags, checked together: one line naming the flags, or None."""
    swap_space, num_host_blocks = settings.get("swap_space"), settings.get("num_host_blocks")
    if swap_space is not None and num_host_blocks is not None:
        raise CLIError("give --swap-space or --num-host-blocks, not both")
    if swap_space is not None and not 0 <= swap_space <= MAX_SWAP_SPACE:
        raise CLIError(f"--swap-space {swap_space / 2**30:g} GiB is out of range: "
                       f"must be 0 to {MAX_SWAP_SPACE // 2**30} GiB")
    if num_host_blocks is not None and not 0 <= num_host_blocks <= MAX_HOST_BLOCKS:
        raise CLIError(f"--num-host-blocks {num_host_blocks} is out of range: must be 0 to "
                       f"{MAX_HOST_BLOCKS}")
    if swaps(settings) and not (swap_space or num_host_blocks):
        raise CLIError(f"--preemption-mode {settings['preemption_mode']} needs a host KV "
                       "tier: give --swap-space GiB (or --num-host-blocks N)")
    urgent = settings.get("enable_priority_preemption", False)
    if "priority_preemption_threshold" in settings:
        if not urgent:
            raise CLIError("--priority-scheduling-preemption-threshold needs "
                           "--enable-priority-preemption")
        if settings["priority_preemption_threshold"] < 0:
            raise CLIError("--priority-scheduling-preemption-threshold must be >= 0, got "
                           f"{settings['priority_preemption_threshold']}")
    if urgent and settings.get("scheduling_policy", "fcfs") != "priority":
        raise CLIError("--enable-priority-preemption needs --scheduling-policy priority")
    limit = settings.get("max_preemptions_per_request")
    if limit is not None and limit < 1:
        raise CLIError(f"--max-preemptions-per-request must be >= 1, got {limit}")


def num_host_blocks(settings: dict[str, Any], bytes_per_block: int,
                    num_devices: int = 1) -> int:
    """The host tier in blocks: --num-host-blocks, or --swap-space (bytes per device, as
    vLLM's flag) over the bytes one KV block takes on all ``num_devices``; 0 without
    either, and 0 under --preemption-mode recompute, which never swaps (the engine
    allocates none then either, as vLLM V1 ignores --swap-space). A swap space smaller than
    one block is an error, not an empty tier. Either value is checked under any mode (QA:
    ``--sweep num_host_blocks=abc,-5`` ran as two rows under recompute)."""
    given, swap_space = settings.get("num_host_blocks"), settings.get("swap_space")
    if given is not None and (not is_int(given) or given < 0):
        raise CLIError(f"num_host_blocks must be an integer >= 0, got {given!r}")
    if swap_space is not None and (isinstance(swap_space, bool) or
                                   not isinstance(swap_space, (int, float)) or
                                   not 0 <= swap_space < float("inf")):
        raise CLIError(f"swap_space must be a size >= 0 (e.g. 4GiB), got {swap_space!r}")
    if not swaps(settings):
        return 0
    if given is not None:
        return given
    if not swap_space:
        return 0
    num_blocks = int(swap_space) * num_devices // bytes_per_block
    if num_blocks == 0:
        raise CLIError(f"--swap-space {int(swap_space)} bytes holds no KV block "
                       f"({bytes_per_block} bytes each)")
    return num_blocks


def sweep_key(name: str, verb: str = "sweep") -> str:
    """The setting a --sweep (or whatif's --set: ``verb`` "set") names; ValueError naming
    the known ones."""
    key = name.strip().lstrip("-").replace("-", "_")
    if key in ("num_gpu_blocks_override",):
        key = "num_kv_blocks"
    known = (*SCHEDULER_KEYS, *CACHE_KEYS, "batching")
    if key == "data_parallel_size" and verb == "sweep":  # QA: whatif --set takes it
        raise ValueError("cannot sweep 'data_parallel_size': kvserve plan --max-replicas M "
                         "runs 1, 2, 4, ... M replicas side by side (and simulate "
                         "--data-parallel-size N one count)")
    if key not in known:
        raise ValueError(f"cannot {verb} {name!r}; known: {', '.join(known)}")
    return key


def parse_value(text: str) -> Any:
    text = text.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    lowered = text.lower()
    if lowered in ("true", "on", "yes"):
        return True
    if lowered in ("false", "off", "no"):
        return False
    return text


# The scheduler settings counted in tokens (their flags take 4k, 32K)
TOKEN_KEYS = frozenset(name for name, kind, _ in _SCHEDULER_FLAGS if kind == "tokens")


def comma_values(text: str, what: str) -> list[str]:
    """``text``'s comma-separated values; ValueError beginning with ``what`` for an empty
    one (the simulator pass: 8,,16 ran 8 and 16, silently). No values at all: []."""
    if not text.strip():
        return []
    items = text.split(",")
    if any(not item.strip() for item in items):
        raise ValueError(f"{what}: an empty value (two commas together, or one at an end)")
    return items


def parse_sweep(spec: str) -> tuple[str, list[Any]]:
    name, eq, values = spec.partition("=")
    items = comma_values(values, f"--sweep {spec!r}")
    if not eq or not items:
        raise ValueError(f"--sweep {spec!r}: write NAME=V1,V2,... (e.g. max_num_seqs=64,128)")
    key = sweep_key(name)
    parsed = [parse_value(v) for v in items]
    if key in TOKEN_KEYS:  # as their flags read them (QA: --max-model-len 4k, not here)
        try:
            parsed = [parse_token_count(v) for v in items]
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"--sweep {spec!r}: {error}") from None
    if key == "num_kv_blocks" and not all(  # named as the flag's (QA: "num_blocks must...")
            isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_BLOCKS
            for v in parsed):
        raise ValueError(f"--sweep {spec!r}: num_kv_blocks values must be integers in "
                         f"[1, {MAX_BLOCKS}]")
    if key in ("kv_cache_memory", "swap_space"):
        parse = parse_bytes if key == "kv_cache_memory" else parse_gib
        try:
            parsed = [parse(v) for v in items]
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"--sweep {spec!r}: {error}") from None
    return key, parsed


def scheduler_config(settings: dict[str, Any]) -> SchedulerConfig:
    return SchedulerConfig.from_dict({k: v for k, v in settings.items() if k in SCHEDULER_KEYS})


def cache_config(settings: dict[str, Any], num_blocks: int,
                 num_host_blocks: int = 0) -> CacheConfig:
    return CacheConfig(num_blocks=num_blocks,
                       block_size=settings.get("block_size", DEFAULT_BLOCK_SIZE),
                       enable_prefix_caching=settings.get("enable_prefix_caching", True),
                       num_host_blocks=num_host_blocks,
                       prefix_caching_hash_algo=settings.get("prefix_caching_hash_algo",
                                                             SIM_HASH_ALGO))
