"""`kvserve serve`: flags, one-line errors, and the real bundled model behind the API."""

from __future__ import annotations

import json
import logging
import os

import openai
import pytest

from kvserve.cli import build_parser, main
from kvserve.server.cli_serve import build_state

from .helpers import LiveServer, wait_for


def test_serve_flags_parse():
    args = build_parser().parse_args([
        "serve", "--port", "9000", "--served-model-name", "m", "--api-key", "a",
        "--priority-source", "key", "--scheduling-policy", "priority", "--max-num-seqs", "4",
        "--max-queue-delay", "2.5", "--num-gpu-blocks-override", "100",
        "--max-request-body", "1MiB"])
    assert (args.port, args.served_model_name, args.api_key, args.priority_source) == \
        (9000, ["m"], ["a"], "key")
    assert (args.max_num_seqs, args.max_queue_delay, args.num_kv_blocks) == (4, 2.5, 100)
    assert args.max_request_body == 1 << 20
    assert args.host == "127.0.0.1"
    assert args.engine_process  # the faster layout, measured (docs/engine-process.md)
    # vLLM's logging flags, as its unit files carry them
    args = build_parser().parse_args([
        "serve", "--disable-log-requests", "--disable-log-stats", "--uvicorn-log-level",
        "warning", "--disable-uvicorn-access-log"])
    assert (args.disable_log_requests, args.enable_log_requests, args.disable_log_stats,
            args.uvicorn_log_level, args.disable_uvicorn_access_log) == \
        (True, False, True, "warning", True)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--api-keys", "/nonexistent/keys"], "cannot read API keys file"),
    (["--port", "70000"], "is not a port number"),
    (["--max-request-body", "0"], "--max-request-body 0: every request would get 413"),
    (["--log-stats-interval", "-1"], "--log-stats-interval must be >= 0 seconds"),
    (["--max-session-kv", "1.5"], "max_session_kv=1.5 is out of range"),
    (["--max-num-seqs", "0"], "max_num_seqs=0 is out of range"),
    (["--record-max-file-size", "0"], "--record-max-file-size must be at least 1KiB"),
    (["--router", "prefix-affinity"], "--router prefix-affinity picks a replica: it needs "
                                      "--data-parallel-size 2 or more"),
    (["--data-parallel-size", "2", "--no-engine-process"],
     "--no-engine-process steps one engine on a thread of the server; data-parallel "
     "replicas are engine processes"),
    # the data-parallel pass: every one of them was launched at once, a fork storm
    (["--data-parallel-size", "100000"], "data_parallel_size (--data-parallel-size) 100000 "
                                         "would start 100000 engine processes on this "
                                         "machine's"),
    (["--api-key", ""], "--api-key: a key must be a non-empty string"),
    (["--api-key", "two words"], "--api-key: a key must be a non-empty string"),  # (never
    (["--api-key", "sk-\u00e9"], "--api-key: a key must be a non-empty string"),  # shown)
    (["--engine-step-timeout", "-1"],
     "--engine-step-timeout must be a finite number of seconds >= 0 (0: never), got -1.0"),
    (["--engine-step-timeout", "nan"], "--engine-step-timeout must be a finite number"),
    (["--engine-step-timeout", "inf"], "--engine-step-timeout must be a finite number"),
    (["--engine-step-timeout", "30", "--no-engine-process"],
     "--engine-step-timeout watches an engine process: it cannot be used with "
     "--no-engine-process"),
    (["--priority-source", "key"], "--priority-source key takes each request's priority "
                                   "from its API key: give --api-key or --api-keys"),
    (["--served-model-name", " "], "--served-model-name must not be empty"),
    (["--enable-log-requests", "--disable-log-requests"],
     "--enable-log-requests and --disable-log-requests contradict each other"),
    (["--host", "999.1.1.1"], "--host '999.1.1.1': cannot resolve it"),
    # the flags pass: taken and ignored, or read as something else
    (["--record", ""], "--record needs a directory, got ''"),
    (["--session-ttl-s", "5"], "--session-ttl-s is how long a session holds KV: sessions "
                               "are off (give --max-session-kv)"),
    (["--lpm-max-queue", "5"], "--lpm-max-queue bounds the queue that lpm and dfs-weight "
                               "sort: give --scheduling-policy lpm or dfs-weight, not fcfs"),
    (["--engine-step-timeout", "0.001"], "--engine-step-timeout is in seconds: 0.001 s is "
                                         "less than one real step takes"),
    (["--disable-log-stats", "--log-stats-interval", "5"],
     "--disable-log-stats and --log-stats-interval contradict each other"),
    (["--responses-store-size", "5"], "--responses-store-size bounds the responses store, "
                                      "which is off: give --enable-responses-store"),
    (["--router-imbalance-bound", "4"], "--router-imbalance-bound bounds the router's "
                                        "choice of a replica: it needs --data-parallel-size"),
    (["-dp", "2", "--router-imbalance-bound", "4"],  # QA: told to add replicas
     "bounds --router prefix-affinity, not least-loaded (the default): give --router "
     "prefix-affinity"),
    (["-dp", "2", "--router", "prefix-affinity", "--router-imbalance-bound", "-1"],
     "--router-imbalance-bound must be >= 0, got -1"),
])
def test_serve_errors_are_one_line(capsys, argv, needle):
    assert main(["serve", "/nonexistent/model", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


@pytest.mark.parametrize(("argv", "needle"), [
    (["--prefix-caching-hash-algo", "sha256"], "vLLM's sha256 is not taken here: blake2b is "
                                               "the collision-resistant hash"),
    # vLLM's older boolean form: False was read as the model path, or the model left over
    (["--enable-chunked-prefill", "False"], "--enable-chunked-prefill False: "
     "--enable-chunked-prefill takes no value here (vLLM's older boolean form): write "
     "--enable-chunked-prefill for true, --no-enable-chunked-prefill for false"),
    (["--no-enable-prefix-caching", "true", "/nonexistent/m.gguf"],
     "--no-enable-prefix-caching true: --no-enable-prefix-caching takes no value here"),
])
def test_vllm_values_a_flag_here_takes_differently_are_named(capsys, argv, needle):
    """The flags pass: a bare "invalid choice", and "model path False does not exist"."""
    with pytest.raises(SystemExit) as stopped:
        main(["serve", *argv])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and needle in err and err.count("\n") == 1, err


def free_port() -> str:
    """A port free now (serve binds its address before the model loads)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def test_a_model_path_that_does_not_exist_is_named(capsys):
    assert main(["serve", "/nonexistent/model.gguf", "--port", free_port()]) == 2
    assert capsys.readouterr().err == \
        "kvserve serve: error: model path /nonexistent/model.gguf does not exist\n"


def test_a_model_whose_tokenizer_does_not_parse_is_named(tmp_path, capsys):
    """QA: a truncated tokenizer.json (a Git LFS pointer) was a traceback from the
    tokenizers library and exit 1; so was a GGUF without its suffix."""
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 100}))
    (model / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\n")
    assert main(["serve", str(model), "--port", free_port()]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvserve serve: error: {model}/tokenizer.json is not a "
                          "tokenizer.json that loads (") and err.count("\n") == 1, err
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(b"GGUF" + bytes(64))
    assert main(["serve", str(renamed), "--port", free_port()]) == 2
    err = capsys.readouterr().err
    assert err == f"kvserve serve: error: {renamed}: expected a .gguf file or a Hugging " \
                  "Face directory with config.json and *.safetensors\n"


def test_an_address_in_use_is_one_line_before_the_model_loads(capsys):
    """The address is bound before the engine is built (as vLLM binds first): a port taken
    is named at once, not after a model load and then by uvicorn with exit code 3. The
    model path here does not exist, so reaching the engine would be a different error."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "/nonexistent/model", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"kvserve serve: error: cannot listen on 127.0.0.1:{port}: Address already " \
                  "in use\n"


def test_urgent_default_priority_needs_the_priority_policy(tmp_path, capsys):
    keys = tmp_path / "keys.json"
    keys.write_text('[{"key": "k", "default_priority": -1}]')
    assert main(["serve", "--api-keys", str(keys)]) == 2
    assert "need --scheduling-policy priority" in capsys.readouterr().err


def test_a_tenants_key_that_is_also_an_operator_key_is_refused(tmp_path, capsys,
                                                              monkeypatch):
    """The tenants pass: the operator's key won, silently (admin, any priority, the
    operator's cache), so the file's limits for that tenant held nothing."""
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-a\nsk-x\n")
    assert main(["serve", "--api-keys", str(keys), "--api-key", "sk-x"]) == 2
    assert capsys.readouterr().err == (
        f"kvserve serve: error: {keys}: key #2 (tenant 'key-2') is also an operator key "
        "(--api-key); give the tenant another key\n")
    monkeypatch.setenv("VLLM_API_KEY", "sk-a")
    assert main(["serve", "--api-keys", str(keys)]) == 2
    assert "key #1 (tenant 'key-1') is also an operator key (VLLM_API_KEY)" in \
        capsys.readouterr().err


def test_the_bundled_model_answers_through_the_api():
    args = build_parser().parse_args(["serve", "--max-model-len", "512",  # float32's answer
                                      "--num-kv-blocks", "64", "--dtype", "float32",
                                      "--no-engine-process"])
    state = build_state(args)
    assert state.model_name == "SmolLM2-135M-Instruct"
    with LiveServer(state.engine.engine, model_name=state.model_name) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop"
        wait_for(live.idle, what="idle")


def wait_until_serving(process, port: int | str, deadline_s: float = 180) -> None:
    """Until ``kvserve serve`` answers /health (generous: start-up on a loaded 2-core
    machine); fails with its output if it exits first."""
    import time

    import httpx

    deadline = time.monotonic() + deadline_s
    while True:
        assert process.poll() is None, process.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "kvserve serve did not come up"
        time.sleep(0.1)


def test_kvserve_serve_process_boots_logs_and_stops_on_sigint():
    import re
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    kvserve = str(Path(sys.executable).with_name("kvserve"))
    process = subprocess.Popen(
        [kvserve, "serve", "--engine-process", "--port", str(port), "--load-format", "dummy",
         "--max-model-len", "256", "--num-kv-blocks", "32", "--served-model-name", "d",
         "--swap-space", "8MiB", "--preemption-mode", "auto", "--enable-log-requests"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # as a job started in the background: SIGINT ignored (the server still stops on it)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_until_serving(process, port)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                           json={"model": "d", "prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 200
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
    assert process.returncode == -signal.SIGINT, output  # ends by it: a shell's 130 (QA: 0)
    # vLLM's logging: uvicorn's access line and its shutdown's progress at info, and with
    # --enable-log-requests a line per request, without its text (QA: a silent server)
    assert '"POST /v1/completions HTTP/1.1" 200' in output, output
    assert "Shutting down" in output and "Finished server process" in output, output
    assert re.search(r"request \w+ queued: tenant 'addr:127\.0\.0\.1', prompt tokens \d+, "
                     r"sequences 1, max_tokens 2, temperature 1,", output), output
    assert "'hi'" not in output
    assert "KV cache size: 512 tokens (32 blocks of 16)" in output
    assert "Maximum concurrency for 256 tokens per request: 2.00x" in output
    # --swap-space reaches the engine: 8 MiB hold 11 SmolLM2 KV blocks of 16 tokens in fp32
    # (737,280 B each; 22 in bf16), and auto is accepted with it (docs/preemption.md).
    host = re.search(r"Host KV cache \(swap space\): (\d+) tokens \((\d+) blocks of 16, "
                     r"7\.7 MiB\); preemption mode: auto", output)
    assert host is not None, output
    assert (int(host[1]), int(host[2])) in ((176, 11), (352, 22))
    # the engine ran in a process of its own, which ended with the server
    pid = int(output.split("engine process pid ")[1].split()[0])
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "State:\tZ" in status.read_text(), output


def _state(tmp_path, *flags: str):
    keys = tmp_path / "keys.json"
    weight = ', "weight": 2' if "vtc" in flags else ""  # weights need the fair share
    keys.write_text(f'[{{"key": "a", "tenant": "gold"{weight}}}, '
                    '{"key": "b", "tenant": "free"}]')
    argv = ["serve", "--load-format", "dummy", "--max-model-len", "256",
            "--num-kv-blocks", "32", "--no-engine-process", *flags]
    return build_state(build_parser().parse_args(
        [part.replace("KEYS", str(keys)) for part in argv]))


@pytest.mark.parametrize(("flags", "scope"), [
    ((), "global"),                                   # no keys: nobody to keep apart
    (("--api-keys", "KEYS"), "tenant"),               # keys: each tenant's cache its own
    (("--api-keys", "KEYS", "--prefix-cache-scope", "global"), "global"),
])
def test_keys_scope_the_prefix_cache_by_default(tmp_path, flags, scope):  # T7
    assert _state(tmp_path, *flags).scheduler_config.prefix_cache_scope == scope


def test_tenant_flags_reach_the_scheduler_and_the_server(tmp_path):  # T1, T4, T6
    from kvserve.server.limits import FanOutLimits

    state = _state(tmp_path, "--api-keys", "KEYS", "--tenant-fairness", "vtc",
                   "--max-num-queued-reqs-per-tenant", "5", "--max-prompts-per-request", "8")
    config = state.scheduler_config
    assert (config.tenant_fairness, config.tenant_weights,
            config.max_num_queued_reqs_per_tenant) == ("vtc", (("gold", 2.0),), 5)
    assert state.fan_out == FanOutLimits(8, 512)


def test_keys_file_weights_without_the_fair_share_are_refused(tmp_path):
    from kvserve.flags import CLIError

    keys = tmp_path / "keys.json"
    keys.write_text('[{"key": "a", "tenant": "gold", "weight": 2}]')
    with pytest.raises(CLIError, match=r"gives tenants weights \(gold=2\).*--tenant-fairness"):
        build_state(build_parser().parse_args(["serve", "--load-format", "dummy",
                                               "--api-keys", str(keys)]))


def test_fan_out_flags_must_be_positive(capsys):
    assert main(["serve", "--max-sequences-per-request", "0"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--max-sequences-per-request must be >= 1")


def test_the_step_watchdog_is_on_by_default_and_zero_turns_it_off():
    from kvserve.engine.engine_process import DEFAULT_STEP_TIMEOUT
    from kvserve.server.cli_serve import _step_timeout

    def timeout(*flags: str) -> float | None:
        args = build_parser().parse_args(["serve", *flags])
        return _step_timeout(args, args.max_num_batched_tokens)
    assert timeout() == DEFAULT_STEP_TIMEOUT  # the default budget, 2048 tokens
    # a step of more tokens takes longer: the default grows past 8192 tokens of budget
    assert timeout("--max-num-batched-tokens", "8192") == DEFAULT_STEP_TIMEOUT
    assert timeout("--max-num-batched-tokens", "32768") == 4 * DEFAULT_STEP_TIMEOUT
    assert timeout("--max-num-batched-tokens", "32768", "--engine-step-timeout", "30") == 30
    assert timeout("--engine-step-timeout", "0") is None
    assert timeout("--engine-step-timeout", "0", "--no-engine-process") is None
    assert timeout("--engine-step-timeout", "7.5", "--data-parallel-size", "2") == 7.5


def test_a_setting_the_engine_process_refuses_is_one_plain_line(capsys):
    """Refused in the engine process (it knows the model's context): the message, not the
    exception's class name before it."""
    assert main(["serve", "--max-model-len", "100k", "--port", free_port()]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == ("kvserve serve: error: max_model_len 100000 is longer than this model's "
                   "context (max_position_embeddings 8192); give max_model_len (--max-model-len) "
                   "8192 or less "
                   "(vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN is not taken here: there is no "
                   "rotary scaling past the model's context)")


def test_the_server_exits_1_when_its_engine_dies_so_a_supervisor_restarts_it():
    """A single engine is not started again: the server used to answer 503 for ever, its
    stats line still printing (QA); it stops with status 1, as vLLM's does."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    port = free_port()
    kvserve = str(Path(sys.executable).with_name("kvserve"))
    process = subprocess.Popen(
        [kvserve, "serve", "--port", port, "--load-format", "dummy", "--max-model-len", "256",
         "--num-kv-blocks", "32", "--uvicorn-log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_serving(process, port)
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        [engine] = [int(pid) for pid in children  # beside it, multiprocessing's tracker
                    if "engine" in Path(f"/proc/{pid}/comm").read_text()]
        os.kill(engine, signal.SIGKILL)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1, output
    assert "the engine died (the engine process (pid " in output
    assert "died (signal 9, SIGKILL)): the server stops with status 1" in output


@pytest.mark.parametrize(("flags", "signals", "said"), [
    (["--shutdown-timeout", "0.5"], 1,
     "shutdown timeout (0.5s): aborting the 2 request(s) still under way"),
    ([], 2, "a second SIGTERM: aborting the requests still under way"),
])
def test_shutdown_timeout_aborts_what_is_still_running_then_exits(flags, signals, said):
    """vLLM's --shutdown-timeout: SIGTERM stops taking connections, lets the requests under
    way run for that long, then aborts them, so a stream ends with finish_reason abort and
    [DONE] and a whole answer says abort, instead of the shutdown waiting on the longest
    generation (the default) or cutting the connection. A second SIGTERM aborts them at
    once (QA: it did nothing; a second Ctrl-C cut the connections, with tracebacks). A body
    still arriving is cut short by the abort too, with a 503 (QA: a slow upload held the
    exit 30-60 s and ended in uvicorn's plain 500, with a traceback)."""
    import json
    import signal
    import socket
    import subprocess
    import sys
    import threading
    from pathlib import Path

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    kvserve = str(Path(sys.executable).with_name("kvserve"))
    process = subprocess.Popen(
        [kvserve, "serve", "--port", str(port), "--load-format", "dummy", "--max-model-len",
         "1024", "--num-kv-blocks", "128", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/v1/completions"
    long = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True}
    answers: dict = {}

    def whole() -> None:
        answers["whole"] = httpx.post(url, json=long, timeout=120).json()

    def streamed() -> None:
        with httpx.stream("POST", url, json={**long, "stream": True}, timeout=120) as reply:
            answers["stream"] = [line for line in reply.iter_lines() if line]

    try:
        wait_until_serving(process, port)
        threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
        for thread in threads:
            thread.start()
        def running() -> float:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("vllm:num_requests_running{"))

        wait_for(lambda: running() == 2, what="both requests running", timeout=120)
        half = socket.create_connection(("127.0.0.1", port), timeout=60)
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        # answered on a later connection, so the server accepted the half one (connections
        # are accepted in order): signalled before that, under load, its shutdown closed the
        # listening socket with it still queued, and it was reset, not answered
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        process.send_signal(signal.SIGTERM)
        if signals == 2:  # once the shutdown began: the server takes no connection
            wait_for(lambda: not accepts(port), what="the shutdown to begin", timeout=60)
            process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=60)
        output, _ = process.communicate(timeout=60)
        cut_short = half.recv(4096)
        half.close()
    finally:
        if process.poll() is None:
            process.kill()
    assert cut_short.startswith(b"HTTP/1.1 503") and b"shutting_down" in cut_short, cut_short
    assert answers["whole"]["choices"][0]["finish_reason"] == "abort", output
    assert answers["stream"][-1] == "data: [DONE]", output
    last = json.loads(answers["stream"][-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort"
    assert said in output and process.returncode == -signal.SIGTERM, output
    assert "Traceback" not in output and "Finished server process" in output, output


def accepts(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_sigterm_lets_background_responses_finish():
    """QA: no connection waits for a background response, so the shutdown did not, and the
    engine stopped under it (the process exited in 3 s, six responses lost). Now the
    shutdown waits for them (new requests are 503s meanwhile)."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    port = free_port()
    kvserve = str(Path(sys.executable).with_name("kvserve"))
    process = subprocess.Popen(
        [kvserve, "serve", "--port", port, "--load-format", "dummy", "--max-model-len",
         "512", "--num-kv-blocks", "64", "--enable-responses-store"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(process, port)
        made = httpx.post(base + "/v1/responses", timeout=60, json={
            "input": "hi", "background": True, "max_output_tokens": 150,
            "ignore_eos": True}).json()
        assert made["status"] == "queued", made
        process.send_signal(signal.SIGTERM)

        def refused_or_gone() -> bool:
            try:
                return httpx.post(base + "/v1/completions", json={"prompt": "x"},
                                  timeout=5).status_code == 503
            except httpx.TransportError:  # drained already and gone
                return process.poll() is not None

        wait_for(refused_or_gone, what="new requests refused while it drains", timeout=60)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert "waiting for 1 background response(s) to finish" in output, output
    assert "Traceback" not in output, output


def test_the_routers_imbalance_bound_is_the_one_planned(monkeypatch):
    """QA: simulate and plan took --router-imbalance-bound, serve always used 16, so a plan
    made with another bound could not be deployed."""
    from kvserve.server import cli_serve

    args = build_parser().parse_args(["serve", "-dp", "2", "--router", "prefix-affinity",
                                      "--router-imbalance-bound", "4"])
    made = {}

    class Built:
        def __init__(self, spec, tokenizer, launchers, router):
            made["router"] = router

    monkeypatch.setattr("kvserve.engine.data_parallel.DataParallelEngine", Built)
    monkeypatch.setattr("kvserve.model.tokenizer.load_tokenizer", lambda model: None)
    cli_serve._data_parallel(args, {}, None)
    assert made["router"].imbalance_bound == 4


def test_a_second_server_on_the_port_is_refused_in_one_line_when_it_listens():
    """Two servers started together both bind the port (SO_REUSEADDR, which a restart
    needs; neither listens while it loads): the one that listens second is refused in one
    line and its engine stopped (QA: a traceback from uvicorn after the load, named an
    error "writing the output")."""
    import argparse
    import socket

    from kvserve.flags import CLIError
    from kvserve.server.cli_serve import _listen, bind_socket

    first = bind_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    second = bind_socket("127.0.0.1", port)  # taken too: nobody listens yet
    stopped: list[bool] = []

    class Engine:
        async def stop(self) -> None:
            stopped.append(True)

    state = argparse.Namespace(engine=Engine())
    try:
        first.listen()
        with pytest.raises(CLIError, match=rf"^cannot listen on 127\.0\.0\.1:{port}: Address "
                                           r"already in use \(another server took"):
            _listen([second], argparse.Namespace(host="127.0.0.1", port=port), state)
        assert stopped == [True] and second.fileno() == -1  # closed
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the first one's address is untouched
    finally:
        first.close()
        second.close()


def test_a_budget_past_every_sequence_s_length_is_warned_and_the_watchdog_sized_by_it(
        caplog):
    """The flags pass: --max-num-batched-tokens 10^14 was taken silently, and the step
    watchdog's default, which grows with the budget, never fired (1.5e12 s); vLLM warns."""
    from kvserve.server.cli_serve import _reachable_budget

    with caplog.at_level(logging.WARNING, logger="kvserve.server"):
        assert _reachable_budget({"max_num_batched_tokens": 10**14, "max_num_seqs": 4,
                                  "max_model_len": 1024}, None) == 4096
        assert _reachable_budget({"max_num_batched_tokens": 2048, "max_model_len": 1024},
                                 None) == 2048  # 256 sequences of 1024 hold more
        # the review: without --max-model-len, the model's context (the bundled 8,192)
        assert _reachable_budget({"max_num_batched_tokens": 10**14}, None) == 256 * 8192
        # chunked prefill off raises the budget to the context: the watchdog waits for it
        assert _reachable_budget({"enable_chunked_prefill": False}, None) == 8192
        # as serve calls it, with the engine's settings beside the scheduler's (the second
        # review: every real command line's call failed, and the warning was gone)
        from kvserve.flags import engine_args
        settings = engine_args(build_parser().parse_args(["serve", "--max-num-seqs", "4",
                                                          "--max-num-batched-tokens",
                                                          str(10**14)]))
        assert _reachable_budget(settings, None) == 4 * 8192
    assert [r.getMessage() for r in caplog.records] == [
        "max_num_batched_tokens 100000000000000 is past max_num_seqs x max_model_len (4096): "
        "no step schedules more than that",
        "max_num_batched_tokens 100000000000000 is past max_num_seqs x max_model_len "
        "(2097152): no step schedules more than that",
        "max_num_batched_tokens 100000000000000 is past max_num_seqs x max_model_len "
        "(32768): no step schedules more than that"]


def test_an_engine_process_is_given_the_model_path_it_can_find_from_anywhere(
        tmp_path, monkeypatch):
    """QA: ``kvserve serve m.gguf -dp 2 --data-parallel-backend ray`` failed ("model path
    m.gguf does not exist"): a Ray replica's worker runs in another directory."""
    from kvserve.engine.llm import portable_model
    from kvserve.server.cli_serve import _engine_spec

    (tmp_path / "m.gguf").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    spec = _engine_spec("m.gguf", {}, 1, None)
    assert spec.factory.args == (str(tmp_path / "m.gguf"),)
    assert portable_model("nowhere.gguf") == "nowhere.gguf"  # its refusal names it as given
    assert portable_model(None) is None


def test_local_replicas_host_tiers_are_checked_together(capsys, monkeypatch):
    """The data-parallel pass: `-dp 2 --swap-space` of 45% of the memory each was one
    replica's warning, and the two allocated 90% (each replica holds its own tier)."""
    import kvserve.engine.data_parallel as data_parallel

    def no_start(*args, **kwargs):  # (never two replicas of 45% each on a shared machine)
        raise AssertionError("replicas were started for a host tier the machine lacks")

    monkeypatch.setattr(data_parallel, "replica_launchers", no_start)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    each = f"{int(0.45 * total) >> 20}MiB"
    assert main(["serve", "-dp", "2", "--swap-space", each, "--port", free_port()]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert "swap space of" in err and "(2 replicas on this machine," in err and \
        "more than 70% of it is refused" in err
