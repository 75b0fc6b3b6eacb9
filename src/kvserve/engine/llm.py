"""Offline inference: ``LLM(...).generate(prompts, params)`` and the engine builder.

    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    [result] = llm.generate("The capital of France is", SamplingParams(max_tokens=8,
                                                                      temperature=0))
    print(result.text)
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import dataclasses
import gc
import itertools
import logging
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvserve.core import (
    CacheConfig,
    ConfigError,
    RequestMetrics,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from kvserve.core.checks import is_int, is_one_of
from kvserve.core.config import DEFAULT_BLOCK_SIZE, MAX_BLOCKS, MAX_HOST_BLOCKS, swaps
from kvserve.core.router import make_router
from kvserve.engine.data_parallel import check_local_replicas, replicas_on_this_machine
from kvserve.engine.engine import (
    DEFAULT_MAX_LOGPROBS,
    CompletionChunk,
    Engine,
    Prompt,
    encode_prompt,
)
from kvserve.engine.llm_parallel import ReplicatedEngines, refused_in_batch
from kvserve.engine.text import Tokenizer
from kvserve.flags import parse_bytes, vllm_noop
from kvserve.model import paged_kernel
from kvserve.model.attention import invariant_paged_attention, paged_attention
from kvserve.model.config import ModelConfig
from kvserve.model.device import check_device_options, resolve_device
from kvserve.model.device import describe as describe_device
from kvserve.model.dtype import checkpoint_dtype, resolve_dtype
from kvserve.model.generation_config import model_eos_ids
from kvserve.model.kernel_info import boot_lines, kernel_report, prefill_attention_choice
from kvserve.model.kv_cache import (
    allocate_kv_cache,
    kv_cache_bytes_per_block,
    num_blocks_for_memory,
)
from kvserve.model.kv_swap import HostKVCache
from kvserve.model.llama import LlamaForCausalLM, invariant_projections
from kvserve.model.quantization import check_quantization
from kvserve.model.runner import ModelRunner
from kvserve.model.sampler import Sampler

logger = logging.getLogger(__name__)
DEFAULT_KV_CACHE_MEMORY = 1 << 30


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None
    # with SamplingParams(logprobs=k): per output token, token id -> logprob for it and the
    # top k; None when none were asked for, as vLLM's
    logprobs: list[dict[int, float]] | None = None
    # vLLM's prompt_logprobs (SamplingParams.prompt_logprobs): per prompt token, None for the
    # first, then token id -> logprob for the token and the top ones
    prompt_logprobs: list[dict[int, float] | None] | None = None
    index: int = 0  # which of the prompt's n samples (vLLM's CompletionOutput.index)
    # vLLM's RequestOutput.prompt: the prompt's text (a chat's rendered through its
    # template); None for a prompt given as token ids
    prompt: str | None = None
    # With SamplingParams(n > 1): samples 1 .. n-1 (this result is sample 0).
    more: list[GenerationResult] = field(default_factory=list, repr=False)

    def start_over(self) -> None:
        """Drop what was read of this sample (placed again on another replica)."""
        self.token_ids, self.text, self.logprobs, self.prompt_logprobs = [], "", None, None

    @property
    def finished(self) -> bool:
        """vLLM's ``RequestOutput.finished``: every sample has finished."""
        return all(out.finish_reason is not None for out in self.outputs)

    @property
    def num_cached_tokens(self) -> int | None:
        """vLLM's ``RequestOutput.num_cached_tokens``: the prompt's tokens its first admission
        found in the prefix cache (None before then)."""
        cached = None if self.metrics is None else self.metrics.num_cached_tokens
        return None if cached is None or cached < 0 else cached

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the sampled tokens' logprobs, where logprobs were asked for."""
        if self.logprobs is None:
            return None
        return sum(entry[token] for token, entry in zip(self.token_ids, self.logprobs,
                                                        strict=False))

    @property
    def outputs(self) -> list[GenerationResult]:
        """vLLM's ``RequestOutput.outputs``: the prompt's n sequences, this one first, so a
        script ported from vLLM reads ``result.outputs[i].text`` (and ``token_ids``,
        ``finish_reason``) as it did."""
        return [self, *self.more]


def load_model(model: str | Path | ModelConfig | None, dtype: torch.dtype,
               load_format: str = "auto", seed: int = 0, batch_invariant: bool = False,
               quantization: str | None = None, device: torch.device | None = None,
               max_positions: int | None = None, with_tokenizer: bool = True
               ) -> tuple[LlamaForCausalLM, Tokenizer | None]:
    """The network with its weights, and the tokenizer (None without ``with_tokenizer``:
    the caller has its own, and a GGUF whose vocabulary this tokenizer cannot read still
    loads; the model pass).

    ``model`` is a GGUF file, a Hugging Face directory, None (the bundled model), or a
    ModelConfig (random weights, no tokenizer). ``load_format="dummy"`` keeps the file's
    config and tokenizer but draws random weights (benchmarks, calibration).
    ``quantization``: None or "int8" (:mod:`kvserve.model.quantization`).
    ``device``: where the network runs (default the CPU; docs/device.md).
    ``max_positions``: the longest sequence served (max_model_len): the rotary tables'
    rows, at most the model's context.
    """
    from kvserve.model import loader
    from kvserve.model.tokenizer import load_tokenizer

    if load_format not in ("auto", "dummy"):
        raise ValueError(f"unknown load format {load_format!r}; choose auto or dummy")
    if isinstance(model, ModelConfig):
        config, weights, tokenizer = model, loader.dummy_weights(model, dtype, seed), None
    elif load_format == "dummy":
        config = loader.model_config_from_path(model)
        weights = loader.dummy_weights(config, dtype, seed)
        tokenizer = load_tokenizer(model) if with_tokenizer else None
    else:
        config, weights = loader.load_model_weights(model, dtype)
        tokenizer = load_tokenizer(model) if with_tokenizer else None
    network = LlamaForCausalLM.from_weights(config, weights, batch_invariant, quantization,
                                            device, max_positions)
    loader.clear_gguf_cache()  # weights and tokenizer are built: unmap the file
    gc.collect()
    _return_freed_heap()
    return network, tokenizer


def portable_model(model: Any) -> Any:
    """``model`` as a process started in another directory finds it: a relative path that
    exists here made absolute (QA: a Ray replica's worker runs elsewhere, and ``m.gguf`` did
    not exist there); anything else as it is."""
    if isinstance(model, str | Path) and os.path.exists(model):
        return os.path.abspath(model)
    return model


def _return_freed_heap() -> None:
    """Give the heap that loading freed back to the OS. glibc keeps freed chunks mapped, so
    without this the dequantisation buffers and the plain copies of packed bf16 weights
    (~200 MB for SmolLM2-135M) stay in the process's resident memory. No-op off glibc."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    malloc_trim(0)


def build_engine(model: str | Path | ModelConfig | None = None, *, dtype: str | torch.dtype =
                 "auto", device: str | torch.device = "auto", load_format: str = "auto",
                 block_size: int = DEFAULT_BLOCK_SIZE,
                 num_kv_blocks: int | None = None,
                 kv_cache_memory: int | None = None, enable_prefix_caching: bool = True,
                 swap_space: int | None = None, num_host_blocks: int | None = None,
                 prefix_caching_hash_algo: str = "blake2b",
                 preemption_prices: Any | None = None,
                 seed: int | None = 0, record_events: bool = False, detokenize: bool = True,
                 tokenizer: Tokenizer | str | Path | None = None,
                 batch_invariant: bool = False,
                 quantization: str | None = None,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, _check_only: bool = False,
                 _replicas_here: int = 1,
                 **scheduler_settings: Any) -> Engine:
    """Load the model, size and allocate the KV cache once, and wire scheduler + runner.
    (``_check_only``: raise what these arguments would raise before the model loads, and
    return None: :func:`check_engine_args`; ``_replicas_here`` engines of these arguments
    share this machine's memory.)

    ``dtype`` takes vLLM's spellings; ``auto`` is the checkpoint's own dtype where this CPU
    computes it natively, else float32 (:mod:`kvserve.model.dtype`; a ModelConfig, random
    weights, counts as float32). The choice and its reason are logged.
    ``device``: ``cpu``, ``cuda`` (``cuda:N``) or ``auto``, cuda where torch sees one
    (:mod:`kvserve.model.device`, docs/device.md); logged likewise. The CPU kernels' options
    (``batch_invariant``, ``quantization``) are refused on a GPU.
    ``scheduler_settings`` are SchedulerConfig fields; unknown ones raise ConfigError.
    ``tokenizer`` overrides the model's own: a Tokenizer, or a path (a tokenizer.json, a
    directory holding one, or a GGUF), as vLLM's ``tokenizer=`` (e.g. a tiny random
    ModelConfig in tests, given the bundled tokenizer so it can take text).
    ``kv_cache_memory`` and ``swap_space`` are bytes, or sizes as the flags take them
    ("1GiB"; vLLM's ``swap_space`` is GiB: give "4GiB" for its 4).

    The host KV tier (docs/preemption.md) holds ``num_host_blocks`` blocks, or as many as
    ``swap_space`` bytes hold (``--swap-space``). Under ``preemption_mode="auto"`` the
    scheduler prices each victim with ``preemption_prices``, by default measured here once
    (:mod:`kvserve.engine.preemption_prices`). Under ``"recompute"`` (the default) nothing
    swaps, so no host tier is allocated whatever they say (a line is logged), as vLLM V1
    ignores its ``swap_space``.

    ``batch_invariant`` (``--batch-invariant``, docs/tenants.md): kernels whose reduction
    order does not depend on the batch, chunking or prefix-cache hits, and a sampler that
    takes each row alone, so a greedy or seeded request's tokens do not depend on other
    traffic. Needs the C++ kernels and float32 or bfloat16; refused otherwise.

    ``quantization="int8"`` (``--quantization int8``, docs/quantization.md): the projections
    in dynamic W8A8 int8 (:mod:`kvserve.model.quantization`); needs the C++ kernels on an
    AVX2 CPU, refused (ValueError) otherwise, as is an unknown name.

    ``max_logprobs`` (vLLM's, default 20): the most ``logprobs`` or ``prompt_logprobs`` a
    request may ask for (ValueError beyond); -1: the whole vocabulary.
    """
    if model is not None and not isinstance(model, (str, Path, ModelConfig)):
        raise TypeError(f"model must be a path (a GGUF file or a Hugging Face directory) or "
                        f"None for the bundled model, got {type(model).__name__}")  # QA
    check_quantization(quantization)
    _check_keywords(scheduler_settings)
    kv_cache_memory = _size(kv_cache_memory, "kv_cache_memory", minimum=1)
    swap_space = _size(swap_space, "swap_space", minimum=0)
    _check_count(num_kv_blocks, "num_kv_blocks", 1, MAX_BLOCKS)
    _check_count(num_host_blocks, "num_host_blocks", 0, MAX_HOST_BLOCKS)
    _check_count(max_logprobs, "max_logprobs", -1, 1 << 30)
    if isinstance(tokenizer, (str, Path)):  # a path, as vLLM's tokenizer= takes one
        from kvserve.model.loader import ModelNotFoundError
        from kvserve.model.tokenizer import load_tokenizer
        try:
            tokenizer = load_tokenizer(tokenizer)
        except ModelNotFoundError as error:
            raise ModelNotFoundError(f"tokenizer: {error}") from None
    # a bad block size, caching switch or hash, before any load (QA: after a 10 s load)
    CacheConfig(num_blocks=1, block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                prefix_caching_hash_algo=prefix_caching_hash_algo)
    if seed is None:  # vLLM's: unseeded, a run that does not repeat
        seed = secrets.randbits(63)
        logger.info("seed None: %d, drawn at random (give it as seed= to repeat this run)",
                    seed)
    if not is_int(seed) or \
            not -(1 << 63) <= seed < 1 << 64:
        raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {seed!r}")
    if isinstance(model, ModelConfig):
        header = model
    else:  # a bad path or setting fails before anything loads (the header alone is read)
        from kvserve.model.loader import model_config_from_path

        header = model_config_from_path(model)
    _check_max_model_len(scheduler_settings, header)
    SchedulerConfig.from_dict({"max_model_len": header.max_position_embeddings,
                               **scheduler_settings})
    torch_device, where = resolve_device(device)
    check_device_options(torch_device, batch_invariant, quantization)
    stored = "float32" if isinstance(model, ModelConfig) or dtype != "auto" \
        else checkpoint_dtype(model)
    torch_dtype, why = resolve_dtype(dtype, stored, device=torch_device)
    if batch_invariant:
        check_batch_invariant(torch_dtype)
    prefill_attention_choice()  # KVSERVE_PREFILL_ATTENTION, refused before anything is built
    num_kv_blocks = _pool_blocks(header, block_size, torch_dtype, torch_device, num_kv_blocks,
                                 kv_cache_memory, _replicas_here)
    if swaps(scheduler_settings) and not (swap_space or num_host_blocks):
        raise ConfigError(f"preemption_mode={scheduler_settings['preemption_mode']!r} needs "
                          "a host KV tier: give swap_space (--swap-space) or num_host_blocks")
    if swap_space or num_host_blocks:  # the host tier in this machine's memory, checked
        # as vLLM checks its swap space, whether or not it swaps
        host_bytes = swap_space or num_host_blocks * kv_cache_bytes_per_block(
            header, block_size, torch_dtype)
        _check_host_memory(host_bytes, "swap space" if swap_space else
                           f"num_host_blocks={num_host_blocks}'s host tier", refuse=0.7,
                           warn=0.4, copies=_replicas_here)
    if _check_only:  # check_engine_args: nothing is built
        return None  # type: ignore[return-value]
    if (swap_space or num_host_blocks) and not swaps(scheduler_settings):
        # The host tier's only user is a preemption that swaps (sessions and the prefix
        # cache keep their blocks on the device): allocated here, it was RAM held for
        # nothing (QA: --swap-space 2 took the RSS from 1.9 to 4 GB).
        logger.info("--swap-space is unused under --preemption-mode recompute, which never "
                    "swaps (vLLM V1 ignores it too): no host KV tier allocated")
        swap_space, num_host_blocks = None, 0
    logger.info("device %s (%s)", torch_device, where)
    logger.info("dtype %s (%s)", str(torch_dtype).removeprefix("torch."), why)
    if torch_device.type != "cpu":
        logger.info("%s", describe_device(torch_device))
    else:
        if not paged_kernel.available():  # build (or load) it now, not in the first step
            logger.warning("paged attention kernel unavailable (%s); using the torch path",
                           paged_kernel.unavailable_reason())
        for line in boot_lines(kernel_report(), torch_dtype, quantization):  # CPU, ISA, ops
            logger.info("%s", line)
    if batch_invariant:
        logger.info("batch-invariant: projections by %s, attention per query row in whole "
                    "KV tiles, sampling per request", invariant_projections(torch_dtype))
    network, own_tokenizer = load_model(model, torch_dtype, load_format, seed,
                                        batch_invariant, quantization, torch_device,
                                        scheduler_settings.get("max_model_len"),
                                        with_tokenizer=tokenizer is None)
    tokenizer = tokenizer or own_tokenizer
    config = network.config
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        # QA: ids past the model's embedding passed every check (made against the
        # tokenizer's), and one request's IndexError took the engine and the server down
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} token ids but the model's "
                         f"vocab_size is {config.vocab_size}: the ids past it have no "
                         "embedding (a tokenizer of another model?)")
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is not None and not 0 <= eos < tokenizer.vocab_size:  # QA: loaded, and every
        raise ValueError(f"the tokenizer's end-of-sequence id {eos} is outside its "  # request
                         f"{tokenizer.vocab_size} ids")  # failed, blamed on its prompt
    if num_host_blocks is None:
        num_host_blocks = 0 if not swap_space else num_blocks_for_memory(
            config, block_size, torch_dtype, swap_space, what="swap space")
    scheduler_settings.setdefault("max_model_len", config.max_position_embeddings)
    scheduler_config = SchedulerConfig.from_dict(scheduler_settings)
    cache_config = CacheConfig(num_blocks=num_kv_blocks, block_size=block_size,
                               enable_prefix_caching=enable_prefix_caching,
                               num_host_blocks=num_host_blocks,
                               prefix_caching_hash_algo=prefix_caching_hash_algo)
    kv_caches = allocate_kv_cache(config, num_kv_blocks, block_size, torch_dtype, torch_device)
    host = HostKVCache(kv_caches, num_host_blocks) if num_host_blocks else None
    runner = ModelRunner(network, kv_caches, block_size,
                         attention=invariant_paged_attention if batch_invariant
                         else paged_attention,
                         sampler=Sampler(seed, batch_invariant,
                                         token_bytes=_token_bytes_of(tokenizer)),
                         host_kv_cache=host)
    if preemption_prices is None and host is not None and \
            scheduler_config.preemption_mode == "auto":
        from kvserve.engine.preemption_prices import measure_prices
        preemption_prices = measure_prices(runner, host, num_kv_blocks)
        logger.info("%s", preemption_prices.describe())
    scheduler = Scheduler(scheduler_config, cache_config, record_events=record_events,
                          preemption_prices=preemption_prices)
    engine = Engine(scheduler, runner, tokenizer, detokenize=detokenize,
                    max_logprobs=config.vocab_size if max_logprobs == -1 else max_logprobs,
                    vocab_size=config.vocab_size)
    own_eos = tokenizer.eos_token_id if tokenizer is not None else None
    engine.extra_eos_ids = tuple(i for i in model_eos_ids(
        model if isinstance(model, (str, Path)) else None)
        if i != own_eos and i < config.vocab_size)
    if engine.extra_eos_ids:
        logger.info("end of sequence also at token ids %s (the model's generation config)",
                    ", ".join(map(str, engine.extra_eos_ids)))
    elif tokenizer is not None and own_eos is None:  # the model pass: said nothing
        logger.warning("the model names no end-of-sequence token: an answer stops only at "
                       "its max_tokens, a stop string or stop_token_ids")
    return engine


def _token_bytes_of(tokenizer: Tokenizer | None) -> Callable[[], list[bytes]] | None:
    """The vocabulary as bytes, for JSON mode, made when first asked for."""
    if tokenizer is None:
        return None
    own = getattr(tokenizer, "token_bytes", None)  # a protocol tokenizer may lack it
    return lambda: [own(token_id) if own is not None else tokenizer.decode([token_id]).encode()
                    for token_id in range(tokenizer.vocab_size)]


def _size(value: Any, name: str, minimum: int) -> int | None:
    """A byte count given as an integer or a size ("1GiB"); ValueError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = parse_bytes(value)
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"{name}: {error}") from None
    if not is_int(value):
        raise ValueError(f"{name} must be bytes (an integer) or a size like '1GiB', got "
                         f"{value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} bytes, got {value}")
    return value


def _check_host_memory(size: int | None, what: str, *, refuse: float, warn: float,
                       copies: int = 1) -> None:
    """``size`` bytes of ``what`` in this machine's memory, for each of ``copies`` engines
    on it (checked before the model loads: past it, torch's allocator failed after the
    load): refused above ``refuse`` of it, a warning above ``warn``. The host tier as vLLM
    checks its swap space (refused above 70%, a warning above 40%, over the workers of a
    node; the sessions pass: --num-host-blocks was not checked, and --swap-space above 70%
    only warned; the data-parallel pass: -dp 2 checked one replica's of the two); a KV pool
    on the CPU refused past the whole."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return
    if not size or total <= 0:
        return
    each = f" ({copies} replicas on this machine, {size / 2**30:.1f} GiB each)" \
        if copies > 1 else ""
    size *= copies
    share = f"{size / 2**30:.1f} GiB{each}, {100 * size / total:.0f}% of this machine's " \
        f"memory ({total / 2**30:.1f} GiB)"
    if size > refuse * total:
        most = "its memory" if refuse >= 1 else f"{refuse:.0%} of it"
        raise ValueError(f"{what} of {share}: more than {most} is refused")
    if size > warn * total:
        logger.warning("%s of %s: possibly too large", what, share)


def _pool_blocks(header: ModelConfig, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_kv_blocks: int | None,
                 kv_cache_memory: int | None, copies: int = 1) -> int:
    """The KV pool's blocks, from the model's header before its weights load (QA: a size
    that holds no block, or more blocks than a pool may have, was refused after the load,
    the latter naming num_blocks, a setting the caller never gave; one past the machine's
    memory failed in the allocator)."""
    if num_kv_blocks is None:
        memory = kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        num_kv_blocks = num_blocks_for_memory(header, block_size, dtype, memory)
        if num_kv_blocks > MAX_BLOCKS:
            raise ValueError(f"kv_cache_memory of {memory / 2**30:.1f} GiB is {num_kv_blocks} "
                             f"blocks of {block_size} tokens, more than a pool holds "
                             f"({MAX_BLOCKS}): give less, or a larger block_size")
    else:
        memory = num_kv_blocks * kv_cache_bytes_per_block(header, block_size, dtype)
    if device.type == "cpu":
        _check_host_memory(memory, "the KV cache", refuse=1.0, warn=0.7, copies=copies)
    return num_kv_blocks


def _check_count(value: Any, name: str, low: int, high: int) -> None:
    """An integer in [low, high], or None; ValueError naming ``name``."""
    if value is None:
        return
    if not is_int(value) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def check_engine_args(model: str | Path | ModelConfig | None = None, replicas_here: int = 1,
                      **engine_args: Any) -> None:
    """Raise what :func:`build_engine` would raise for these arguments before it loads the
    model (ConfigError, ValueError, ModelNotFoundError), loading nothing: data-parallel
    replicas are started only for arguments every one of them will take. ``replicas_here``:
    how many such engines this machine holds (its memory checked for all of them)."""
    build_engine(model, **engine_args, _check_only=True, _replicas_here=replicas_here)


# vLLM's LLM arguments that change nothing here (the serve flags of the same names:
# flags.VLLM_NOOPS): taken, each logging why, so a vLLM script runs unchanged
_LLM_NOOPS = ("trust_remote_code", "tokenizer_mode", "enforce_eager", "max_seq_len_to_capture",
              "compilation_config", "disable_custom_all_reduce", "tensor_parallel_size",
              "pipeline_parallel_size", "download_dir", "revision", "kv_cache_dtype",
              "distributed_executor_backend", "disable_sliding_window", "cuda_graph_sizes",
              "async_scheduling", "logprobs_mode")
_NOTHING_DOWNLOADED = "nothing is downloaded: the model is a path"
_NO_MEDIA = "the models served here take text only"
# vLLM's LLM arguments with no serve flag here that change nothing either: the values each
# is taken at (None: any), and why (the offline pass: LLM(disable_log_stats=True) refused)
_LLM_ONLY_NOOPS: dict[str, tuple[tuple[Any, ...] | None, str]] = {
    "disable_log_stats": (None, "the offline engine logs no periodic stats"),
    "disable_async_output_proc": (None, "outputs are processed in the step that makes them"),
    "served_model_name": (None, "the offline API answers by result, not by model name"),
    "tokenizer_revision": (None, _NOTHING_DOWNLOADED),
    "hf_token": (None, _NOTHING_DOWNLOADED),
    "enable_lora": ((False,), "there are no LoRA adapters"),
    "skip_tokenizer_init": ((False,), "the model's tokenizer is always loaded"),
    "cpu_offload_gb": ((0,), "the weights are in host memory already"),
    "hf_overrides": ((None, {}), "the model's config is taken as its files give it"),
    "task": (("auto", "generate"), "the engine generates text"),
    "runner": (("auto", "generate"), "the engine generates text"),
    "mm_processor_kwargs": ((None, {}), _NO_MEDIA),
    "limit_mm_per_prompt": ((None, {}), _NO_MEDIA),
    "allowed_local_media_path": (("",), _NO_MEDIA),
}


def _take_vllm_noops(engine_args: dict[str, Any]) -> None:
    """Take vLLM's no-op arguments out of ``engine_args``, logging why each changes
    nothing; ConfigError for one at another value than the only one(s) it is taken at
    (``tensor_parallel_size=2``). QA: ``LLM(enforce_eager=True)`` was refused."""
    for name in (*_LLM_NOOPS, *_LLM_ONLY_NOOPS):
        if name not in engine_args:
            continue
        value = engine_args.pop(name)
        if name in _LLM_ONLY_NOOPS:
            neutral, why = _LLM_ONLY_NOOPS[name]
        else:
            found = vllm_noop(name)
            assert found is not None, name  # every name of _LLM_NOOPS is a serve flag's
            taken, why = found
            neutral = None if taken is None else (taken,)
        if neutral is not None and not is_one_of(value, neutral):
            hint = _GPU_ARGUMENTS.get(name)
            only = " or ".join(map(repr, neutral))
            raise ConfigError(f"{name}={value!r} is not taken here ({why}); only {only}"
                              + (f"; give {hint}" if hint else ""))
        logger.info("%s=%r is taken and changes nothing: %s", name, value, why)


# vLLM's GPU arguments and what sizes the same thing here.
_GPU_ARGUMENTS = {"gpu_memory_utilization": "kv_cache_memory (bytes) or num_kv_blocks",
                  "num_gpu_blocks_override": "num_kv_blocks",
                  "tensor_parallel_size": "nothing (no tensor parallelism here); "
                                          "data_parallel_size runs replicas"}


def _check_keywords(settings: dict[str, Any]) -> None:
    """ConfigError naming an argument neither build_engine (LLM) nor SchedulerConfig takes,
    with what to give instead of a vLLM GPU argument."""
    import inspect

    own = [name for name, parameter in inspect.signature(build_engine).parameters.items()
           if parameter.kind is inspect.Parameter.KEYWORD_ONLY and not name.startswith("_")]
    fields = [f.name for f in dataclasses.fields(SchedulerConfig)]
    unknown = sorted(set(settings) - set(fields))
    if not unknown:
        return
    hints = [f"{name}: give {_GPU_ARGUMENTS[name]}" for name in unknown if name in _GPU_ARGUMENTS]
    raise ConfigError(f"unknown argument(s) {', '.join(unknown)}"
                      + (f" ({'; '.join(hints)})" if hints else "")
                      + f"; the engine takes {', '.join(own)} and the scheduler's "
                      f"{', '.join(fields)}")


def _check_max_model_len(settings: dict[str, Any], config: ModelConfig) -> None:
    """A max_model_len beyond the model's context (max_position_embeddings) is refused, as
    vLLM refuses it: positions past it have no rotary embedding here."""
    asked = settings.get("max_model_len")
    limit = config.max_position_embeddings
    if not isinstance(asked, int) or isinstance(asked, bool):
        return  # absent (the model's own), or SchedulerConfig names the bad value
    if asked < 1:
        raise ConfigError(f"max_model_len must be >= 1, got {asked}")
    if asked > limit:
        raise ConfigError(f"max_model_len {asked} is longer than this model's context "
                          f"(max_position_embeddings {limit}); give max_model_len "
                          f"(--max-model-len) {limit} or less (vLLM's "
                          "VLLM_ALLOW_LONG_MAX_MODEL_LEN is not taken here: there is no rotary "
                          "scaling past the model's context)")


def check_batch_invariant(dtype: torch.dtype) -> None:
    """Raise ValueError, naming why, where --batch-invariant cannot hold."""
    if dtype not in paged_kernel.DTYPES:
        raise ValueError(f"--batch-invariant supports float32 and bfloat16, not "
                         f"{str(dtype).removeprefix('torch.')}; pass --dtype float32 or "
                         "bfloat16")
    if not paged_kernel.available():
        raise ValueError("--batch-invariant needs kvserve's C++ kernels, which are "
                         f"unavailable: {paged_kernel.unavailable_reason()}")


class LLM:
    """Offline batch generation; keyword arguments go to :func:`build_engine`.

    ``data_parallel_size`` N > 1 runs N engine replicas (each its own scheduler, KV pool and
    model, in a process of its own, or a Ray actor with ``data_parallel_backend="ray"``)
    behind the router the server uses (``router``: ``round-robin``, ``least-loaded`` or
    ``prefix-affinity``), ``threads_per_replica`` torch threads each (default: the CPUs split
    evenly). Results still come back in the prompts' order. Call :meth:`close` (or use the
    LLM as a context manager) to stop the replicas; N=1 runs the engine in this process.

    ``generation_config`` (vLLM's): ``"auto"`` (default) takes the model directory's
    ``generation_config.json`` sampling defaults for :meth:`get_default_sampling_params`,
    what ``generate`` and ``chat`` use without ``sampling_params`` (a GGUF, the bundled model
    too, has none); ``"vllm"`` none; a directory that directory's file.
    ``override_generation_config`` (a dict in the file's names) overrides or extends them.
    """

    def __init__(self, model: str | Path | ModelConfig | None = None, *,
                 data_parallel_size: int = 1, data_parallel_backend: str = "mp",
                 router: str = "least-loaded", threads_per_replica: int | None = None,
                 generation_config: str = "auto",
                 override_generation_config: dict[str, Any] | None = None,
                 **engine_args: Any) -> None:
        from kvserve.model.generation_config import sampling_defaults

        _take_vllm_noops(engine_args)
        self._ids = itertools.count()
        self._detokenize = engine_args.get("detokenize", True)
        self._scheduling_policy = engine_args.get("scheduling_policy",
                                                  SchedulerConfig.scheduling_policy)
        self._sampling_defaults = sampling_defaults(
            None if isinstance(model, ModelConfig) else model, generation_config,
            override_generation_config)
        if self._sampling_defaults:
            logger.info("sampling defaults from the generation config: %s",
                        self._sampling_defaults)
        self.replicas: ReplicatedEngines | None = None
        self._closed = False
        if not is_int(data_parallel_size) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got "
                             f"{data_parallel_size!r}")
        make_router(router, data_parallel_size)  # an unknown router, with one replica too
        check_local_replicas(data_parallel_size, data_parallel_backend)
        self._engine: Engine | None = None
        if data_parallel_size == 1:
            self._engine = build_engine(model, **engine_args)
            self.tokenizer = self._engine.tokenizer
            return
        check_engine_args(model, replicas_on_this_machine(  # as one engine raises, before
            data_parallel_size, data_parallel_backend), **engine_args)  # any spawn
        self.tokenizer = _own_tokenizer(model, engine_args)
        self.replicas = ReplicatedEngines(
            model, engine_args, self.tokenizer, size=data_parallel_size,
            backend=data_parallel_backend, router=router,
            threads_per_replica=threads_per_replica)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling params of a ``generate`` or ``chat`` given none, the
        generation config's defaults over SamplingParams'."""
        return SamplingParams(**self._sampling_defaults)

    def _decode(self, token_ids: list[int]) -> str | None:
        """A logprob's decoded_token, a special token as written (None without a
        tokenizer)."""
        return None if self.tokenizer is None else \
            self.tokenizer.decode(token_ids, skip_special_tokens=False)

    @property
    def engine(self) -> Engine:
        """The one engine (its scheduler, runner, stats), when data_parallel_size is 1."""
        if self._engine is None:
            raise AttributeError("an LLM with data_parallel_size > 1 has no single engine: "
                                 "its replicas run in processes of their own (llm.replicas)")
        return self._engine

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, priority: Sequence[int] | None = None,
                 lora_request: None = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[GenerationResult]:
        """Generate for every prompt; results come back in the prompts' order (none for an
        empty list, as vLLM's).

        A prompt is a string, a list of token ids, a list of chat messages, or vLLM's
        ``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` (either with vLLM's
        ``"cache_salt"``); pass a list of them for a batch. ``sampling_params`` is one for
        all, or one per prompt. ``priority``, as vLLM's: one per prompt (lower first under
        ``scheduling_policy="priority"``), in place of its sampling params' own.
        ``lora_request`` and ``tokenization_kwargs``, vLLM's, are taken as None (or ``{}``)
        only. A prompt or a setting that is refused raises before any prompt runs, and
        leaves nothing queued.
        """
        if self._closed:
            raise RuntimeError("this LLM is closed (close() or its with block ended); make "
                               "another")
        if lora_request is not None:
            raise ValueError("lora_request: there are no LoRA adapters here (serve a model "
                             "directory with the adapter merged)")
        if tokenization_kwargs:
            raise ValueError("tokenization_kwargs are not taken here: a prompt is encoded "
                             "as the model's tokenizer encodes it (give token ids to choose)")
        plain, salts = _as_batch(prompts)
        batch = [self._render(prompt, f"prompts[{index}]: ") if _is_conversation(prompt)
                 else prompt for index, prompt in enumerate(plain)]
        params = _params_for(sampling_params if sampling_params is not None
                             else self.get_default_sampling_params(), len(batch))
        if not batch:
            return []
        for index, salt in salts.items():  # a dict prompt's own, over its params'
            params[index] = [dataclasses.replace(p, cache_salt=salt) for p in params[index]]
        if priority is not None:
            params = _with_priorities(params, priority)
        _check_priorities(params, self._scheduling_policy)
        if not self._detokenize and any(p.stop for samples in params for p in samples):
            raise ValueError("stop strings need the text, and this LLM was built with "
                             "detokenize=False: give stop_token_ids instead")  # QA: ignored
        sequences, results, firsts = self._sequences(batch, params)
        if self.replicas is not None:
            progress = _Progress(firsts, use_tqdm)

            def start_over(request_ids: list[str]) -> None:  # placed again: from the start
                for request_id in request_ids:
                    results[request_id].start_over()
            try:
                self.replicas.run([(sub_id, ids, param) for _, sub_id, ids, param in sequences],
                                  lambda chunk: _absorb(results[chunk.request_id], chunk,
                                                        progress, self._decode), start_over)
            finally:
                progress.close()
            return firsts
        added: list[str] = []
        try:
            for index, sub_id, ids, param in sequences:
                try:
                    self.engine.add_request(sub_id, ids, param)
                except ValueError as error:
                    raise refused_in_batch(index, error) from None
                added.append(sub_id)
            self._run(results, firsts, use_tqdm)
        except BaseException:  # a refused prompt, or an interrupt: this call leaves nothing
            for request_id in added:
                if results[request_id].finish_reason is None:
                    self.engine.abort(request_id)
            raise
        return firsts

    def _sequences(self, batch: list[Prompt], params: list[list[SamplingParams]]
                   ) -> tuple[list[tuple[int, str, list[int], SamplingParams]],
                              dict[str, GenerationResult], list[GenerationResult]]:
        """Every prompt encoded (a chat rendered once for its n samples; ValueError named by
        its place in the batch, before anything is queued) and its samples named: the
        sequences (prompt index, request id, token ids, params), their results by request
        id, and each prompt's first (sample 0's, which holds the others)."""
        sequences, results, firsts = [], {}, []
        for index, (prompt, samples) in enumerate(zip(batch, params, strict=True)):
            try:
                ids, text = self._encode(prompt), self._prompt_text(prompt)
            except ValueError as error:
                raise type(error)(f"prompts[{index}]: {error}") from None
            request_id = str(next(self._ids))
            for sample, param in enumerate(samples):
                sub_id = _sample_id(request_id, sample)
                sequences.append((index, sub_id, ids, param))
                results[sub_id] = _sample_result(firsts, sub_id, sample, list(ids), text)
        return sequences, results, firsts

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, _RenderedChat):
            return prompt.ids
        return encode_prompt(self.tokenizer, prompt)

    def _prompt_text(self, prompt: Prompt) -> str | None:
        """vLLM's ``RequestOutput.prompt`` for a plain prompt (already encoded without
        error, so a conversation renders)."""
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, _RenderedChat):
            return prompt.text
        return None

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             tools: Sequence[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             chat_template: str | None = None,
             chat_template_content_format: str = "auto",
             lora_request: None = None) -> list[GenerationResult]:
        """One conversation (a list of {"role", "content"} messages) or several, through the
        model's chat template. vLLM's options: ``add_generation_prompt`` (open the
        assistant's turn), ``continue_final_message`` (go on with the last, assistant's,
        message instead; not with the former), ``tools`` (OpenAI's function tools, the
        template's ``tools``), ``chat_template_kwargs`` (more template variables) and
        ``chat_template`` (a Jinja template's text, in place of the model's). A message's
        content is text, a list of ``{"type": "text", "text": ...}`` parts (joined: the
        template sees a string, vLLM's ``chat_template_content_format="string"``, which
        ``"auto"`` is here), or None on an assistant's message (one that made tool calls)."""
        if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) \
                or not messages:
            raise TypeError("chat() takes a conversation (a non-empty list of {'role', "
                            "'content'} messages) or a list of them")
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r}"
                             " is not taken here: a message's text parts reach the template "
                             "joined, as 'string' (or 'auto') says")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        variables = _template_variables(tools, chat_template_kwargs)
        tokenizer = self.tokenizer
        if chat_template is not None and tokenizer is not None:
            tokenizer = copy.copy(tokenizer)  # this call's template; the model's stays
            tokenizer.set_chat_template(chat_template)  # ValueError: not valid Jinja
        rendered = [self._render(_check_conversation(conversation),
                                 "" if len(conversations) == 1 else f"conversation {i}: ",
                                 add_generation_prompt, continue_final_message, variables,
                                 tokenizer)
                    for i, conversation in enumerate(conversations)]
        return self.generate(rendered, sampling_params, use_tqdm,  # type: ignore[arg-type]
                             lora_request=lora_request)

    def _render(self, messages: list[dict[str, Any]], where: str,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                variables: dict[str, Any] | None = None,
                tokenizer: Tokenizer | None = None) -> _RenderedChat:
        """A checked conversation through the chat template (``tokenizer``'s, by default
        this LLM's), once: its text (a result's ``prompt``) and its ids; ValueError
        beginning with ``where``."""
        tokenizer = tokenizer or self.tokenizer
        if tokenizer is None:
            raise ValueError(f"{where}a conversation needs a tokenizer (its chat template): "
                             "this LLM has none; give token ids")
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt, continue_final_message, **(variables or {}))
        except (ValueError, RecursionError) as error:  # continue_final_message's
            raise ValueError(f"{where}{error}") from None
        except Exception as error:  # the caller's variables in the template: anything
            raise ValueError(f"{where}cannot apply the chat template: "
                             f"{type(error).__name__}: {error}") from None
        try:
            ids = tokenizer.encode(text)
        except ValueError as error:  # text that is not Unicode, named by its place
            raise ValueError(f"{where}{error}") from None
        return _RenderedChat(text, ids)

    def close(self) -> None:
        """Stop the data-parallel replicas, if any (idempotent); the LLM takes no more
        prompts."""
        self._closed = True
        if self.replicas is not None:
            self.replicas.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, results: dict[str, GenerationResult], firsts: list[GenerationResult],
             use_tqdm: bool) -> None:
        progress = _Progress(firsts, use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for chunk in self.engine.step().chunks:
                    _absorb(results[chunk.request_id], chunk, progress, self._decode)
        finally:
            progress.close()


def _sample_id(request_id: str, sample: int) -> str:
    """A prompt's request id for sample 0 (and when n is 1), ``id-k`` for sample k."""
    return f"{request_id}-{sample}" if sample else request_id


def _sample_result(firsts: list[GenerationResult], request_id: str, sample: int,
                   prompt_token_ids: list[int], prompt: str | None) -> GenerationResult:
    """Sample ``sample``'s result: a prompt's first starts ``firsts``, the others join it."""
    result = GenerationResult(request_id, prompt_token_ids, index=sample, prompt=prompt)
    if sample:
        firsts[-1].more.append(result)
    else:
        firsts.append(result)
    return result


class Logprob(float):
    """A logprob as kvserve gives it (a float) that reads as vLLM's ``Logprob`` too:
    ``.logprob``, ``.rank`` (1: the likeliest; the sampled and prompt tokens' over the whole
    vocabulary, a tie counted before them) and ``.decoded_token``, so
    ``entry[token].logprob`` works as it did."""

    rank: int | None
    decoded_token: str | None

    def __new__(cls, value: float, rank: int | None = None,
                decoded_token: str | None = None) -> Logprob:
        made = super().__new__(cls, value)
        made.rank, made.decoded_token = rank, decoded_token
        return made

    @property
    def logprob(self) -> float:
        return float(self)


def _entry(entry: dict[int, float], decode: Any, own: tuple[int, int] | None = None
           ) -> dict[int, float]:
    """A logprob entry (the sampled or prompt token first, then the top k) with vLLM's
    Logprob values: the top ones ranked by order of logprob; the prompt token's rank from
    ``own`` (token id, its rank), the sampled one's from the entry (LogprobEntry.rank), both
    the engine's, over the whole vocabulary."""
    order = sorted(entry, key=lambda token: -entry[token])
    ranks: dict[int, int | None] = {token: index + 1 for index, token in enumerate(order)}
    if own is not None:
        ranks[own[0]] = own[1]
    else:
        ranks[next(iter(entry))] = getattr(entry, "rank", None)
    return {token: Logprob(value, ranks[token], None if decode is None else decode([token]))
            for token, value in entry.items()}


def _absorb(result: GenerationResult, chunk: CompletionChunk, progress: _Progress,
            decode: Any = None) -> None:
    result.token_ids += chunk.new_token_ids
    result.text += chunk.new_text
    if chunk.prompt_logprobs is not None:
        result.prompt_logprobs = [
            None if item is None else _entry(item[0], decode, (token, item[1]))
            for token, item in zip(result.prompt_token_ids, chunk.prompt_logprobs,
                                   strict=True)]
    if chunk.logprobs:
        result.logprobs = (result.logprobs or []) + [
            _entry(entry, decode) for entry in chunk.logprobs]
    if chunk.finished:
        result.finish_reason = chunk.finish_reason
        result.stop_reason = chunk.stop_reason
        result.metrics = chunk.metrics
        progress.finished(result.request_id)


def _own_tokenizer(model: str | Path | ModelConfig | None,
                   engine_args: dict[str, Any]) -> Tokenizer | None:
    """The tokenizer the replicas will use, loaded here too (prompts are tokenized here)."""
    from kvserve.model.tokenizer import load_tokenizer

    given = engine_args.get("tokenizer")
    if isinstance(given, (str, Path)):  # a path (build_engine loads it in each replica)
        return load_tokenizer(given)
    if given is not None:
        return given
    if isinstance(model, ModelConfig):
        return None
    return load_tokenizer(model)


PROMPT_FORMS = ("a string, a list of token ids, a list of chat messages, "
                "{'prompt': text} or {'prompt_token_ids': ids}")


def _as_batch(prompts: Any) -> tuple[list[Prompt], dict[int, str]]:
    """``generate``'s prompts as a list of plain prompts (text, token ids or messages), and
    the cache salts of those given as dicts with vLLM's ``cache_salt``, by their index."""
    single = isinstance(prompts, (str, dict))  # one prompt (a dict: vLLM's form)
    if single:
        prompts = [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be {PROMPT_FORMS}, or a list of them; got "
                        f"{type(prompts).__name__}")
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items], {}  # one prompt of token ids
    if not single and items and all(isinstance(t, dict) and "role" in t for t in items):
        items = [items]  # one conversation (one message alone is refused by _plain)
    salts = {index: _cache_salt(item, index) for index, item in enumerate(items)
             if isinstance(item, dict) and "cache_salt" in item}
    batch = [_plain(item, index) for index, item in enumerate(items)]
    for index, prompt in enumerate(batch):  # as chat() checks them (QA: the chat template
        # failed on a bad message with a TypeError or jinja2's UndefinedError, unnamed)
        if _is_conversation(prompt):
            try:
                batch[index] = _check_conversation(prompt)
            except TypeError as error:
                raise TypeError(f"prompts[{index}]: {error}") from None
    return batch, salts


def _cache_salt(prompt: dict[str, Any], index: int) -> str:
    salt = prompt["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"prompts[{index}]: cache_salt must be a non-empty string, got "
                         f"{salt!r}"[:200])
    return salt


def _plain(prompt: Any, index: int) -> Prompt:
    """One prompt of a batch as text, token ids or messages (vLLM's dict forms unpacked)."""
    if isinstance(prompt, _RenderedChat):
        return prompt  # type: ignore[return-value]
    if isinstance(prompt, dict):
        keys = set(prompt) - {"cache_salt"}  # _as_batch takes it
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
            return prompt["prompt_token_ids"]
        if "role" in keys:
            raise TypeError(f"prompts[{index}] is one chat message: pass a conversation as "
                            "a list of messages (or use chat())")
        raise TypeError(f"prompts[{index}]: a dict prompt is {{'prompt': text}} or "
                        f"{{'prompt_token_ids': ids}}, got keys {sorted(keys)}")
    if isinstance(prompt, list) and not prompt:
        raise ValueError(f"prompts[{index}] is empty: a prompt is text, a non-empty list of "
                         "token ids or a conversation")
    if isinstance(prompt, (str, list)):
        return prompt
    raise TypeError(f"prompts[{index}] must be {PROMPT_FORMS}; got {type(prompt).__name__}")


def _check_conversation(conversation: Any) -> list[dict[str, Any]]:
    """A conversation's messages each with a string role and content (as the server checks
    a chat request's), so a bad one is named before the chat template runs; returned as the
    template takes them: a content of text parts joined, an assistant's None as "" (its
    tool calls are the message), as the server's chat endpoint sends them."""
    if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence) \
            or not conversation:
        raise TypeError("a conversation is a non-empty list of {'role', 'content'} messages")
    normal = []
    for index, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TypeError(f"messages[{index}] must be a dict with a string 'role'")
        content = message.get("content")
        if isinstance(content, list) and content and all(
                isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str) for part in content):
            content = "\n".join(part["text"] for part in content)  # OpenAI's text parts
        elif content is None and message["role"] == "assistant" and "content" in message:
            content = ""
        if not isinstance(content, str):
            raise TypeError(f"messages[{index}] ({message['role']}) has no string 'content' "
                            "(text, or a list of {'type': 'text', 'text': ...} parts)")
        normal.append(message if content is message.get("content") else
                      {**message, "content": content})
    return normal


# What the chat template is rendered with already: chat_template_kwargs may not set them.
_TEMPLATE_OWN = ("messages", "add_generation_prompt", "continue_final_message", "bos_token",
                 "eos_token")


def _template_variables(tools: Any, kwargs: Any) -> dict[str, Any]:
    """chat()'s tools and chat_template_kwargs as the template's variables (the kwargs'
    own ``tools`` wins, as vLLM's)."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict, got {type(kwargs).__name__}")
    taken = [name for name in _TEMPLATE_OWN if name in (kwargs or {})]
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {taken[0]!r}: chat() renders the "
                         "template with it (give it as chat()'s own argument)")
    if tools is not None and (isinstance(tools, (str, bytes, dict))
                              or not isinstance(tools, Sequence)
                              or not all(isinstance(tool, dict) for tool in tools)):
        raise TypeError("tools must be a list of OpenAI tool dicts ({'type': 'function', "
                        "'function': {...}})")
    return {**({"tools": list(tools)} if tools else {}), **(kwargs or {})}


def _is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


@dataclass(frozen=True)
class _RenderedChat:
    """A conversation chat() rendered with its options: its text and token ids."""

    text: str
    ids: list[int]


def _params_for(sampling_params: Any, count: int) -> list[list[SamplingParams]]:
    """Each prompt's sequences (n of them, each one request) from sampling_params: None
    (the defaults), one for all, or one per prompt. Raises before anything is queued."""
    if sampling_params is None:
        return [[SamplingParams()]] * count
    params = [sampling_params] * count if isinstance(sampling_params, SamplingParams) \
        else sampling_params
    if not isinstance(params, Sequence) or \
            not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError("sampling_params must be a SamplingParams (kvserve.core), a list of "
                        f"them or None; got {type(sampling_params).__name__}")
    if len(params) != count:  # as vLLM: one for all is a SamplingParams, not a list
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    try:
        return [param.samples() for param in params]
    except ValueError as error:
        raise ValueError(f"sampling_params: {error}") from None


def _with_priorities(params: list[list[SamplingParams]],
                     priority: Sequence[int]) -> list[list[SamplingParams]]:
    """Each prompt's sequences with its priority (vLLM's ``generate(priority=[...])``)."""
    if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence) or \
            len(priority) != len(params):
        raise ValueError(f"priority must be a list of one integer per prompt ({len(params)}), "
                         f"got {priority!r}"[:200])
    return [[dataclasses.replace(param, priority=value) for param in samples]
            for samples, value in zip(params, priority, strict=True)]


def _check_priorities(params: list[list[SamplingParams]], policy: str) -> None:
    """vLLM's refusal of a priority its scheduling policy would ignore (0 is everyone's)."""
    if policy == "priority":
        return
    for index, samples in enumerate(params):
        for param in samples:
            if param.priority != 0:
                raise ValueError(f"prompts[{index}]: priority {param.priority} was given but "
                                 "priority scheduling is not enabled (this LLM runs "
                                 f"scheduling_policy={policy!r}); build it with "
                                 "scheduling_policy='priority'")


class _Progress:
    """generate's progress bar (tqdm, where installed and asked for), over prompts as
    vLLM's: a prompt is done when all its n samples are."""

    def __init__(self, firsts: list[GenerationResult], enabled: bool) -> None:
        self.bar: Any = None
        self.owner = {out.request_id: first for first in firsts for out in first.outputs}
        if enabled and len(firsts) > 1:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=len(firsts), desc="generate", unit="prompt",
                            dynamic_ncols=True)

    def finished(self, request_id: str) -> None:
        first = self.owner[request_id]
        if self.bar is not None and all(out.finish_reason is not None
                                        for out in first.outputs):
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
