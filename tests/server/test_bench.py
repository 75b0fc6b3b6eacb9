"""`kvserve bench serve` against a live kvserve."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

from kvserve.bench.report import percentile
from kvserve.bench.workload import parse_range, poisson_arrivals, random_requests
from kvserve.cli import main

from .helpers import LiveServer, wait_for


def bench(capsys, url: str, *argv: str) -> dict:
    assert main(["bench", "serve", "--base-url", url, "--json", "--no-progress", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_reports_latencies_throughput_and_preemptions(capsys):
    with LiveServer(num_kv_blocks=10, max_model_len=512) as live:
        summary = bench(capsys, live.url, "--num-prompts", "8", "--input-len", "30:40",
                        "--output-len", "60:80", "--max-concurrency", "8")
        assert summary["model"] == "tiny"
        assert (summary["completed"], summary["failed"]) == (8, 0)
        assert summary["ttft"]["p50_ms"] > 0 and summary["itl"]["p99_ms"] > 0
        assert summary["output_tokens"] >= 8 * 60
        assert summary["preemptions"] > 0  # 10 blocks cannot hold 8 growing requests
        assert summary["kv_cache_usage_after"] == 0
        wait_for(live.idle, what="idle")
    from kvserve.bench.report import format_table

    line = format_table(summary).splitlines()[-1]  # counters read as floats: shown whole
    assert line == f"preemptions (from /metrics): {int(summary['preemptions']):,}, " \
        f"recomputed tokens: {int(summary['recomputed_tokens']):,}"


def test_bench_clients_that_disconnect_leave_nothing_behind(capsys):
    with LiveServer(num_kv_blocks=64, max_model_len=512) as live:
        summary = bench(capsys, live.url, "--num-prompts", "20", "--input-len", "10:20",
                        "--output-len", "100:120", "--request-rate", "200",
                        "--disconnect-prob", "1", "--prompt-kind", "text")
        assert summary["disconnected"] == 20 and summary["failed"] == 0
        wait_for(live.idle, what="every request aborted and the pool whole")
        assert live.state.engine.stats.num_finished.get("abort", 0) >= 1


def test_bench_counts_refusals_as_errors_and_fails_when_nothing_completed(capsys):
    """A run where every request failed exited 0, so scripts took it for a result (QA; vLLM's
    tool stops on its test request)."""
    with LiveServer(max_model_len=64) as live:
        assert main(["bench", "serve", "--base-url", live.url, "--json", "--no-progress",
                     "--num-prompts", "3", "--input-len", "100", "--output-len", "4"]) == 1
        captured = capsys.readouterr()
        summary = json.loads(captured.out)
        assert summary["failed"] == 3
        [(message, count)] = summary["errors"].items()
        assert message.startswith("HTTP 400") and count == 3
        assert "no request completed (3 failed)" in captured.err


def test_vllms_bench_flags_keys_and_tpot(capsys, tmp_path):
    """vLLM's bench serve command lines run (--ignore-eos, --random-input-len, --dataset-name
    random, --save-result ...), the result has its keys (TPOT among them) and says how it
    was made; without streaming TTFT is E2E, as the help says (QA: all missing)."""
    with LiveServer(max_model_len=512) as live:
        assert main(["bench", "serve", "--base-url", live.url, "--no-progress",
                     "--dataset-name", "random", "--random-input-len", "16",
                     "--random-output-len", "8", "--num-prompts", "3", "--ignore-eos",
                     "--seed", "4", "--max-concurrency", "2", "--save-result",
                     "--result-dir", str(tmp_path), "--result-filename", "r.json"]) == 0
        assert "TPOT" in capsys.readouterr().out
        summary = json.loads((tmp_path / "r.json").read_text())
        plain = bench(capsys, live.url, "--num-prompts", "2", "--input-len", "8",
                      "--output-len", "4", "--no-stream")
    assert summary["completed"] == summary["num_prompts"] == 3
    assert summary["total_output_tokens"] == 3 * 8 and summary["total_input_tokens"] == 3 * 16
    assert (summary["max_concurrency"], summary["seed"], summary["request_rate"],
            summary["backend"], summary["model_id"]) == (2, 4, "inf", "openai", "tiny")
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert {f"{kind}_{name}_ms" for kind in ("mean", "median", "std", "p99")} <= set(
            summary), name
    assert summary["mean_tpot_ms"] > 0 and summary["median_ttft_ms"] == summary["ttft"]["p50_ms"]
    assert plain["ttft"] == plain["e2e"] and plain["mean_ttft_ms"] == plain["mean_e2el_ms"]


def test_vllms_percentile_flags_choose_the_flat_keys(capsys):
    with LiveServer(max_model_len=512) as live:
        summary = bench(capsys, live.url, "--num-prompts", "3", "--input-len", "8",
                        "--output-len", "4", "--percentile-metrics", "ttft,e2el",
                        "--metric-percentiles", "50,99.9")
    assert {"p50_ttft_ms", "p99.9_ttft_ms", "p99.9_e2el_ms", "std_e2el_ms"} <= set(summary)
    assert not {"p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms"} & set(summary)
    assert summary["p50_ttft_ms"] == summary["median_ttft_ms"]


def test_workload_helpers():
    assert parse_range("64:512", "--x") == (64, 512) and parse_range("7", "--x") == (7, 7)
    with pytest.raises(ValueError, match=r"--input-len '9:3': need 1 <= LOW <= HIGH"):
        parse_range("9:3", "--input-len")
    requests = random_requests(50, (64, 512), (32, 256), seed=1, text=False)
    assert all(64 <= len(r.prompt) <= 512 and 32 <= r.max_tokens <= 256 for r in requests)
    timed = poisson_arrivals(requests, 4.0, seed=1)
    assert timed[0].arrival_time == 0 and timed[-1].arrival_time > 5
    # vLLM's --burstiness: gamma gaps of that shape, the same mean rate; 1.0 is Poisson
    many = random_requests(4000, (8, 8), (4, 4), seed=2, text=False)

    def gaps(burstiness):
        times = [r.arrival_time for r in poisson_arrivals(many, 10.0, 3, burstiness)]
        return [b - a for a, b in pairwise(times)]
    for burstiness in (0.25, 1.0, 4.0):
        spread = gaps(burstiness)
        mean = sum(spread) / len(spread)
        cv2 = sum((g - mean) ** 2 for g in spread) / len(spread) / mean ** 2
        assert mean == pytest.approx(0.1, rel=0.1)  # the rate holds
        assert cv2 == pytest.approx(1 / burstiness, rel=0.2)  # a gamma's CV^2 is 1/shape
    assert gaps(1.0) == gaps(1)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 50) is None


@pytest.mark.parametrize(("argv", "needle"), [
    (["--output", "."], "--output .: is a directory; give a file name"),
    (["--output", "/nonexistent/x.json"], "--output /nonexistent/x.json: no such directory"),
    (["--timeout", "-1"], "--timeout must be a positive number of seconds, got -1.0"),
    (["--timeout", "inf"], "--timeout must be a positive number of seconds, got inf"),
    (["--input-len", "-5"], "--input-len '-5': need 1 <= LOW <= HIGH"),
    (["--output-len", "x"], "--output-len 'x' is not N or LOW:HIGH"),
    (["--percentile-metrics", "ttft,goodput"], "--percentile-metrics 'ttft,goodput': choose "
     "from ttft,tpot,itl,e2el"),
    (["--metric-percentiles", "99,101"], "--metric-percentiles '99,101': comma-separated "
     "numbers in (0, 100]"),
    (["--save-result", "--output", "x.json"], "give --output or --save-result"),
    (["--burstiness", "0"], "--burstiness must be a positive number, got 0.0"),
    (["--base-url", "http://256.1.1.1:1"], "is not a URL: 256.1.1.1 is not an IPv4 address"),
    (["--num-prompts", "1000", "--input-len", "1000000"], "--num-prompts 1000 of up to "
     "1000000 tokens may hold more than 100,000,000 prompt tokens"),
    (["--save-result", "--result-dir", "/nonexistent"], "--result-dir /nonexistent: not a "
     "directory this user may write in"),
    # the CLI pass: '' ran the random workload; nan failed every request as a "bad answer"
    (["--trace", ""], "--trace needs a file name, got ''"),
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    (["--sessions"], "--sessions sends a trace's session ids: give --trace"),
    (["--disconnect-prob", "1", "--no-stream"], "--disconnect-prob drops streams part-way: "
                                                "it needs --stream"),
    (["--request-rate", "1e-300", "--num-prompts", "3"], "--request-rate 1e-300 sends the "
     "last request at "),
])
def test_bench_serve_refuses_bad_flags_before_any_load(capsys, argv, needle):
    """Checked before a request is sent (no server listens on port 9 here): a bad --output
    used to fail with a traceback after the whole benchmark had run."""
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_bench_serve_names_a_refused_key_in_one_line(capsys, monkeypatch):
    from kvserve.server.auth import ApiKey

    with LiveServer(keys=[ApiKey("k", "t")]) as live:
        assert main(["bench", "serve", "--base-url", live.url, "--num-prompts", "1"]) == 2
        err = capsys.readouterr().err
        assert err.endswith(f"cannot list the models at {live.url}/v1/models: HTTP 401: give "
                            "--api-key\n") and err.count("\n") == 1
        # a wrong key says so (the CLI pass: a bare "HTTP 401"); vLLM's $OPENAI_API_KEY
        assert main(["bench", "serve", "--base-url", live.url, "--api-key", "wrong"]) == 2
        err = capsys.readouterr().err
        assert err.endswith("/v1/models: HTTP 401: invalid API key\n"), err
        monkeypatch.setenv("OPENAI_API_KEY", "k")
        assert main(["bench", "serve", "--base-url", live.url, "--num-prompts", "1",
                     "--input-len", "4", "--output-len", "2", "--no-progress"]) == 0


def test_vllms_host_port_backend_and_disable_tqdm_are_taken(capsys):
    """The CLI pass: a vLLM bench command line (--backend vllm --host H --port P
    --disable-tqdm) failed on its first flag."""
    from urllib.parse import urlsplit

    with LiveServer(max_model_len=512) as live:
        port = str(urlsplit(live.url).port)
        assert main(["bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port",
                     port, "--disable-tqdm", "--json", "--num-prompts", "2",
                     "--random-input-len", "8", "--random-output-len", "3"]) == 0
        captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert (summary["completed"], summary["base_url"]) == (2, live.url)
    assert summary["endpoint"] == "/v1/completions" and "%|" not in captured.err
    for argv, said in ((["--base-url", live.url, "--port", port],
                        "give --base-url or --host/--port, not both"),
                       (["--backend", "openai-chat", "--endpoint", "/v1/completions"],
                        "--backend openai-chat sends to /v1/chat/completions, not --endpoint "
                        "/v1/completions")):
        assert main(["bench", "serve", *argv]) == 2
        assert said in capsys.readouterr().err


def test_a_model_list_of_another_shape_is_one_line(capsys, monkeypatch):
    """The CLI pass: a /v1/models answer that was a JSON list ended in a TypeError
    traceback; an empty list said "list index out of range"."""
    for listed in ([1, 2], {"data": []}):
        class Reply:
            def raise_for_status(self) -> None:
                pass

            def json(self, listed=listed):
                return listed

        async def get(self, url, headers=None):
            return Reply()

        monkeypatch.setattr("httpx.AsyncClient.get", get)
        assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9"]) == 2
        err = capsys.readouterr().err
        assert err.endswith("/v1/models: the server lists no model (an OpenAI list's "
                            "data[0].id): give --model\n"), err


def test_the_result_file_is_written_before_the_summary_is_printed(capsys, tmp_path,
                                                                   monkeypatch):
    """The CLI pass: a closed standard output (| head, a terminal gone) failed the print
    before the file was written, so the run's --output was lost, with a traceback."""
    import builtins

    out = tmp_path / "b.json"

    def closed(*args, **kwargs):
        if kwargs.get("file") is None:
            raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(builtins, "print", closed)
    monkeypatch.setattr("kvserve.cli._stdout_to_devnull", lambda: None)
    with LiveServer(max_model_len=512) as live:
        assert main(["bench", "serve", "--base-url", live.url, "--no-progress",
                     "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                     "--output", str(out)]) == 1
    assert json.loads(out.read_text())["completed"] == 2


def test_save_detailed_prints_the_table_and_writes_the_file(capsys, tmp_path):
    """--save-detailed without --json used to fail after the whole load (vLLM's per-request
    "errors" list replaced the counts the table reads) and write nothing."""
    out = tmp_path / "b.json"
    with LiveServer(max_model_len=512) as live:
        assert main(["bench", "serve", "--base-url", live.url, "--no-progress",
                     "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                     "--save-detailed", "--output", str(out)]) == 0
    assert "requests: 2 completed, 0 failed" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["errors"] == ["", ""] and len(data["ttfts"]) == 2


def test_a_recording_directory_is_a_trace_to_send_again(capsys, tmp_path):
    """bench serve --trace DIR sends a server's recording again (its requests, at the times
    the server received them); it used to say 'Is a directory'."""
    from tests.sim.test_replica_replay import build

    directory = build(tmp_path / "rec")
    with LiveServer(max_model_len=512) as live:
        summary = bench(capsys, live.url, "--trace", str(directory))
        assert (summary["completed"], summary["failed"]) == (4, 0)


def test_a_traces_answer_length_is_what_is_asked_for(tmp_path):
    """output_len tokens and then EOS: bench asks for output_len + 1 tokens (with
    ignore_eos, the answer's length whatever the served model says), within max_tokens; an
    ignore_eos line runs to its max_tokens (it asked for max_tokens whatever output_len)."""
    from kvserve.bench.workload import trace_requests

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in [
        {"request_id": "a", "arrival_time": 0, "prompt_len": 8, "output_len": 3,
         "max_tokens": 32},
        {"request_id": "b", "arrival_time": 0, "prompt_len": 8, "output_len": 0},
        {"request_id": "c", "arrival_time": 0, "prompt_len": 8, "output_len": 3,
         "max_tokens": 12, "ignore_eos": True}]))
    assert [r.max_tokens for r in trace_requests(trace, 0, 64)] == [4, 1, 12]


def test_a_trace_is_sent_whole_in_arrival_order_capped_only_when_asked(tmp_path, capsys):
    """The CLI pass: every line without max_tokens was cut to 256 (--output-len's default
    for the random workload; the README's trace lost 32% of its tokens); lines out of time
    order were sent in file order; --num-prompts did not take the first N, as vLLM's does
    of a dataset; an ignore_eos line without max_tokens was sent 256 (it runs to the model's
    length in simulate)."""
    from kvserve.bench.workload import trace_requests

    trace = tmp_path / "t.jsonl"
    rows = [{"request_id": "late", "arrival_time": 2, "prompt_len": 4, "output_len": 300},
            {"request_id": "early", "arrival_time": 0, "prompt_len": 4, "output_len": 500},
            {"request_id": "mid", "arrival_time": 1, "prompt_len": 4, "output_len": 5}]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sent = trace_requests(trace, 0)
    assert [(r.arrival_time, r.max_tokens) for r in sent] == [(0, 501), (1, 6), (2, 301)]
    assert [r.max_tokens for r in trace_requests(trace, 0, 256)] == [256, 6, 256]
    assert len(trace_requests(trace, 0, num=2)) == 2
    endless = tmp_path / "e.jsonl"
    endless.write_text(json.dumps({"request_id": "x", "arrival_time": 0, "prompt_len": 4,
                                   "output_len": 5, "ignore_eos": True}) + "\n")
    with pytest.raises(ValueError, match="request x has ignore_eos and no max_tokens"):
        trace_requests(endless, 0)
    assert [r.max_tokens for r in trace_requests(endless, 0, 64)] == [64]
    # on the command line: a trace with the random workload's shaping flags is refused
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--trace", str(trace),
                 "--input-len", "8"]) == 2
    assert "--input-len and --prompt-kind shape the random workload" in capsys.readouterr().err


def test_a_traces_client_timeout_is_replayed(tmp_path):
    """A trace's cancel_time is its client's timeout: bench closes the request that many
    seconds after sending it (mid-stream, or before it is sent where the client left first)
    and counts it disconnected. Bench used to ignore cancel_time and run every request to its
    end."""
    import asyncio

    import httpx

    from kvserve.bench.client import Target, send
    from kvserve.bench.workload import trace_requests

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in [
        {"request_id": "a", "arrival_time": 1, "prompt_len": 8, "output_len": 3},
        {"request_id": "b", "arrival_time": 1, "prompt_len": 8, "output_len": 3,
         "cancel_time": 1},
        {"request_id": "c", "arrival_time": 1, "prompt_len": 8, "output_len": 3,
         "cancel_time": 1.25}]))
    requests = trace_requests(trace, 0, 64)
    assert [r.cancel_after for r in requests] == [None, 0.0, 0.25]

    sent: list[str] = []

    async def one_token_then_silence():
        yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
        await asyncio.Event().wait()  # a server that never answers again

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        return httpx.Response(200, content=one_token_then_silence())

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            target = Target("http://test", "m")
            return [await send(client, target, r) for r in requests[1:]]

    before_sent, timed_out = asyncio.run(go())
    assert sent == ["/v1/completions"]  # the client that left first sent nothing
    assert before_sent.disconnected and before_sent.ttft is None
    assert timed_out.disconnected and not timed_out.ok and timed_out.ttft is not None
    assert timed_out.e2e >= 0.25 and timed_out.error is None


def test_ctrl_c_prints_the_summary_of_what_ended(capsys, monkeypatch):
    """Ctrl-C printed a 74-line traceback and no figures (QA): the requests that had ended
    are summarized, the exit status is 130."""
    from kvserve.bench import runner
    from kvserve.bench.client import RequestResult

    async def model(base_url, api_key):
        return "m"

    async def interrupted_run(requests, target, on_done=None, **kwargs):
        for index in range(2):
            on_done(RequestResult(index=index, ok=True, ttft=0.1, e2e=0.5,
                                  num_prompt_tokens=8, num_output_tokens=4))
        raise KeyboardInterrupt
    monkeypatch.setattr(runner, "first_model", model)
    monkeypatch.setattr(runner, "run", interrupted_run)
    assert main(["bench", "serve", "--json", "--no-progress", "--num-prompts", "5",
                 "--input-len", "8", "--output-len", "4"]) == 130
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    # the 3 still under way were sent: counted, as interrupted (QA: "of 2" for 5 sent)
    assert (summary["completed"], summary["num_requests"], summary["interrupted"],
            summary["total_output_tokens"]) == (2, 5, 3, 8)
    assert "interrupted: 2 of 5 requests had ended" in captured.err


def test_a_result_file_that_is_the_trace_is_refused(capsys, tmp_path):
    """QA: --result-filename was compared with the inputs as given, not inside --result-dir,
    so ``--trace D/t.jsonl --result-dir D --result-filename t.jsonl`` would have replaced the
    trace with the summary. One line, exit 2, before any request; the trace untouched."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"request_id": "a", "arrival_time": 0, "prompt_len": 8, '
                     '"output_len": 2}\n')
    before = trace.read_text()
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--trace", str(trace),
                 "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "t.jsonl"]) == 2
    assert "--result-filename t.jsonl is a file this command reads" in capsys.readouterr().err
    assert trace.read_text() == before


def test_save_result_names_the_file_after_the_model_served(capsys, monkeypatch, tmp_path):
    """QA: without --model the file was kvserve-...-model-<date>.json, whatever was served."""
    from kvserve.bench import runner
    from kvserve.bench.client import RequestResult

    async def model(base_url, api_key):
        return "org/served-model"

    async def one_run(requests, target, on_done=None, **kwargs):
        return runner.RunResult([RequestResult(index=0, ok=True, ttft=0.1, e2e=0.5,
                                               num_output_tokens=4)], 1.0, None, None)
    monkeypatch.setattr(runner, "first_model", model)
    monkeypatch.setattr(runner, "run", one_run)
    assert main(["bench", "serve", "--no-progress", "--num-prompts", "1", "--input-len", "8",
                 "--output-len", "4", "--save-result", "--result-dir", str(tmp_path)]) == 0
    [written] = tmp_path.iterdir()
    assert written.name.startswith("kvserve-inf" + "qps-served-model-")
    assert json.loads(written.read_text())["model_id"] == "org/served-model"
