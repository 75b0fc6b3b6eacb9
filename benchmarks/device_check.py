#!/usr/bin/env python
"""The engine on a GPU (``--device cuda``, docs/device.md): correctness against the CPU's
torch path, preemption (recompute and swap) on the device, W1/W2 offline throughput, a quick
``kvserve calibrate`` (the simulator's cost model of the GPU), and the server (one engine
process, then two data-parallel replicas) answering on 127.0.0.1.

Made for a lent machine with little time on it, so it runs as one command. The bundled GGUF
(98 MB) is too large to take along, so the check runs the bundled model's shapes and
tokenizer with random weights (``--load-format dummy``) from a stub Hugging Face directory
made here first::

    python benchmarks/device_check.py --make-stub .gpu/smollm2      # here (needs the GGUF)
    python benchmarks/device_check.py --model .gpu/smollm2 --out DIR  # on the GPU machine

Writes DIR/device_check.json and prints each figure as it comes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from kvserve.core import SamplingParams
from kvserve.engine.llm import LLM
from offline_throughput import w1_prompts


def make_stub(directory: Path) -> None:
    """config.json (bfloat16, the bundled model's shapes) and the bundled tokenizer as
    tokenizer.json + tokenizer_config.json: enough for ``--load-format dummy``."""
    from kvserve.model.loader import default_model_path, model_config_from_path
    from kvserve.model.tokenizer import load_tokenizer

    config = model_config_from_path(None)
    tokenizer = load_tokenizer(default_model_path())
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "_name_or_path": config.name, "torch_dtype": "bfloat16",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}, indent=1))
    tokenizer._tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": tokenizer.chat_template}))
    print(f"wrote {directory}")


def _torch_path_on_cpu() -> None:
    """The CPU side of the comparison runs the pure-torch reference path (no C++ build)."""
    from kvserve.model import paged_kernel

    paged_kernel._tried, paged_kernel._module = True, None
    paged_kernel._error = "not built: device_check compares against the torch path"


def greedy_runs(model: str, device: str, dtype: str, prompts: list[list[int]],
                max_tokens: int, **settings: Any) -> tuple[list[list[int]], dict[str, Any]]:
    llm = LLM(model, device=device, dtype=dtype, load_format="dummy", detokenize=False,
              **settings)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    scheduler = llm.engine.scheduler
    stats = scheduler.stats()
    info = {"wall_s": round(wall, 3), "preemptions": stats.num_preemptions,
            "recomputed_tokens": stats.num_recomputed_tokens, "steps": stats.num_steps,
            "free_blocks_after": scheduler.kv.num_free_blocks,
            "num_blocks": scheduler.cache_config.num_blocks}
    tokens = [list(r.token_ids) for r in results]
    info["output_tok_s"] = round(sum(map(len, tokens)) / wall, 1)
    info["total_tok_s"] = round((sum(map(len, tokens)) + sum(map(len, prompts))) / wall, 1)
    del llm
    return tokens, info


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many sequences are identical, and where the others first differ."""
    firsts = [next((i for i, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), None)
              for s, t in zip(a, b, strict=True)]
    differ = [f for f in firsts if f is not None]
    return {"identical": len(a) - len(differ), "of": len(a), "first_differences": differ}


def serve_check(model: str, device: str, port: int, extra: list[str],
                deadline_s: float = 150) -> dict:
    """Start ``kvserve serve`` on the GPU, wait for /health, send a completion and a
    streamed chat, read /metrics, stop it."""
    command = [sys.executable, "-m", "kvserve", "serve", model, "--load-format", "dummy",
               "--device", device, "--host", "127.0.0.1", "--port", str(port), *extra]
    log = open(f"/tmp/serve-{port}.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {"command": " ".join(command[1:])}
    try:
        start, up = time.monotonic(), False
        while time.monotonic() - start < deadline_s and server.poll() is None:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as reply:
                    up = reply.status == 200
                    break
            except OSError:
                time.sleep(0.5)
        result["boot_s"] = round(time.monotonic() - start, 1)
        if not up:
            result["error"] = "no /health"
            return result

        def post(path: str, body: dict) -> bytes:
            request = urllib.request.Request(base + path, json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.read()

        with urllib.request.urlopen(base + "/v1/models", timeout=10) as reply:
            name = json.loads(reply.read())["data"][0]["id"]
        completion = json.loads(post("/v1/completions", {
            "model": name, "prompt": "The capital of France is", "max_tokens": 16,
            "temperature": 0}))
        result["completion_tokens"] = completion["usage"]["completion_tokens"]
        stream = post("/v1/chat/completions", {
            "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "stream": True, "temperature": 0.7, "seed": 1})
        result["chat_chunks"] = stream.count(b"data: ")
        result["chat_done"] = stream.rstrip().endswith(b"data: [DONE]")
        # a bounded concurrent load: 32 completions of 64 tokens at once
        start = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            replies = list(pool.map(lambda i: json.loads(post("/v1/completions", {
                "model": name, "prompt": f"Request {i}: tell me a story", "max_tokens": 64,
                "temperature": 0.8, "seed": i, "ignore_eos": True})), range(32)))
        result["load_32x64"] = {
            "wall_s": round(time.monotonic() - start, 2),
            "completion_tokens": sum(r["usage"]["completion_tokens"] for r in replies)}
        with urllib.request.urlopen(base + "/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
        result["metrics_success"] = [line for line in metrics.splitlines()
                                     if line.startswith("vllm:request_success_total")]
    except Exception as error:  # recorded: the check goes on
        result["error"] = f"{type(error).__name__}: {error}"
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        result["log_tail"] = Path(f"/tmp/serve-{port}.log").read_text()[-1500:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--make-stub", type=Path, help="write the stub model directory")
    parser.add_argument("--model", help="the stub directory (--make-stub)")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n", type=int, default=128,
                        help="W1/W2 requests (the squeeze and comparisons take a quarter)")
    parser.add_argument("--only-serve", action="store_true",
                        help="only the server checks (one engine process, two replicas)")
    args = parser.parse_args()
    if args.make_stub:
        make_stub(args.make_stub)
        return 0
    report: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                              "cpu": platform.processor() or platform.machine()}
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name(0)
    args.out.mkdir(parents=True, exist_ok=True)

    def note(key: str, value: Any) -> None:
        report[key] = value
        print(key, json.dumps(value), flush=True)
        (args.out / "device_check.json").write_text(json.dumps(report, indent=1))

    if not args.only_serve:
        offline_checks(args, note)
    serve_checks(args, note)
    return 0


def offline_checks(args: argparse.Namespace, note: Any) -> None:
    """Greedy tokens against the CPU, the squeeze with recompute and swap, W1/W2 throughput
    and a quick calibration."""
    _torch_path_on_cpu()
    small = max(1, args.n // 8)
    prompts = w1_prompts(small)
    cpu, cpu_info = greedy_runs(args.model, "cpu", "float32", prompts, 32)
    gpu, gpu_info = greedy_runs(args.model, args.device, "float32", prompts, 32)
    note("greedy_float32_cpu_vs_device", {**agreement(cpu, gpu), "cpu": cpu_info,
                                          "device": gpu_info})
    # W2's squeeze on the device: 32 requests in 4,096 KV tokens, recompute then swap
    w2 = {"max_num_seqs": 64, "num_kv_blocks": 256}
    plain, _ = greedy_runs(args.model, args.device, "float32", w1_prompts(2 * small), 128)
    for mode, extra in (("recompute", {}),
                        ("swap", {"swap_space": 1 << 30, "preemption_mode": "swap"})):
        squeezed, info = greedy_runs(args.model, args.device, "float32", w1_prompts(2 * small),
                                     128,
                                     **w2, **extra)
        note(f"w2_{2 * small}_{mode}", {**agreement(plain, squeezed), **info})
    for workload, settings in (("w1", {"max_num_seqs": 256, "max_num_batched_tokens": 2048}),
                               ("w2", {"max_num_seqs": 64, "num_kv_blocks": 256})):
        for dtype in ("bfloat16", "float32"):
            _, info = greedy_runs(args.model, args.device, dtype, w1_prompts(args.n), 128,
                                  **settings)
            note(f"{workload}_{dtype}", info)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    calibration = args.out / "device_calibration.json"  # the simulator's model of this GPU
    done = subprocess.run([sys.executable, "-m", "kvserve", "calibrate", args.model,
                           "--load-format", "dummy", "--device", args.device, "--quick",
                           "--output", str(calibration)], capture_output=True, text=True,
                          timeout=300)
    note("calibrate", {"rc": done.returncode, "out": done.stdout[-1500:],
                       "err": done.stderr[-800:]})


def serve_checks(args: argparse.Namespace, note: Any) -> None:
    note("serve", serve_check(args.model, args.device, 8000, []))
    # two replicas get a GPU each (cuda); on a machine of one GPU they share it (cuda:0)
    dp_device = "cuda:0" if args.device == "cuda" and torch.cuda.device_count() < 2 else \
        args.device
    note("serve_dp2", serve_check(args.model, dp_device, 8001, ["--data-parallel-size", "2"]))


if __name__ == "__main__":
    sys.exit(main())
