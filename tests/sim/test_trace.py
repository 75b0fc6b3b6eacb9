"""Trace files: round trip, validation with line numbers, synthetic token ids."""

import json
import re

import pytest

from kvserve.sim.tokens import EOS_TOKEN_ID, stream_key, stream_token, stream_tokens
from kvserve.sim.trace import TraceError, TraceRequest, parse_request, read_trace, write_trace


def test_write_then_read_round_trips(tmp_path):
    requests = [
        TraceRequest("a", 0.0, 5, prompt_len=10),
        TraceRequest("b", 0.25, 7, prompt_len=40, prefix_id="sys", prefix_len=32,
                     max_tokens=6, priority=2, deadline=3.0, cancel_time=2.0,
                     ignore_eos=True),
        TraceRequest("c", 1.5, 0, prompt_token_ids=(5, 6, 7)),
        TraceRequest("d", 2.0, 3, prompt_len=8, replica=1, received_time=1.75),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, requests)
    assert read_trace(path) == requests
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"request_id": "a", "arrival_time": 0.0, "prompt_len": 10, "output_len": 5}


@pytest.mark.parametrize("line, message", [
    ('{"request_id": "x", "arrival_time": 0, "prompt_len": 4}', "missing output_len"),
    ('{"request_id": "x", "arrival_time": -1, "prompt_len": 4, "output_len": 1}',
     "arrival_time must be a number of seconds in [0, 1e+10], got -1"),
    ('{"request_id": "x", "arrival_time": 1e308, "prompt_len": 4, "output_len": 1}',
     "arrival_time must be a number of seconds in [0, 1e+10]"),
    ('{"request_id": "x", "arrival_time": 0, "cancel_time": 2e10, "prompt_len": 4, '
     '"output_len": 1}', "cancel_time must be a number of seconds in [0, 1e+10]"),
    ('{"request_id": "x", "arrival_time": 0, "output_len": 1}', "exactly one of"),
    ('{"request_id": "x", "arrival_time": 0, "prompt_len": 4, "output_len": 1, "foo": 1}',
     "unknown field(s) foo"),
    ('{"request_id": "x", "arrival_time": 0, "prompt_len": 4, "output_len": 1, '
     '"prefix_id": "p", "prefix_len": 9}', "longer than prompt_len"),
    ('{"request_id": "x", "arrival_time": 0, "prompt_len": 0, "output_len": 1}',
     "prompt_len must be an integer >= 1"),
    ('[1, 2]', "must be a JSON object"),
    ('{"request_id": "x", "arrival_time": 1, "received_time": 2, "prompt_len": 4, '
     '"output_len": 1}', "received_time 2 is after arrival_time 1"),
    ('{"request_id": "x", "arrival_time": 1, "replica": -1, "prompt_len": 4, '
     '"output_len": 1}', "replica must be an integer >= 0"),
    ('{"request_id": "x", "arrival_time": 0', "not valid JSON"),
])
def test_malformed_line_names_its_line_number(tmp_path, line, message):
    good = '{"request_id": "ok", "arrival_time": 0, "prompt_len": 4, "output_len": 1}'
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert f"{path}:3:" in str(info.value)
    assert message in str(info.value)


def test_duplicate_ids_and_empty_traces_are_errors(tmp_path):
    line = '{"request_id": "a", "arrival_time": 0, "prompt_len": 4, "output_len": 1}\n'
    (tmp_path / "dup.jsonl").write_text(line + line)
    with pytest.raises(TraceError, match=re.escape("dup.jsonl:2: duplicate request_id 'a'")):
        read_trace(tmp_path / "dup.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(tmp_path / "empty.jsonl")


def test_stream_is_the_same_at_every_length_and_never_eos():
    key = stream_key(7, "x")
    long = stream_tokens(key, 0, 500)
    assert stream_tokens(key, 0, 100) == long[:100]
    assert stream_tokens(key, 100, 500) == long[100:]
    assert [stream_token(key, p) for p in range(50)] == long[:50]
    assert EOS_TOKEN_ID not in long and min(long) >= 3
    assert stream_tokens(stream_key(8, "x"), 0, 500) != long


def test_requests_with_one_prefix_id_share_exactly_prefix_len_tokens():
    a = parse_request({"request_id": "a", "arrival_time": 0, "prompt_len": 50,
                       "prefix_id": "sys", "prefix_len": 32, "output_len": 1})
    b = parse_request({"request_id": "b", "arrival_time": 0, "prompt_len": 60,
                       "prefix_id": "sys", "prefix_len": 32, "output_len": 1})
    ids_a, ids_b = a.synthesise_prompt(0), b.synthesise_prompt(0)
    assert (len(ids_a), len(ids_b)) == (50, 60)
    assert ids_a[:32] == ids_b[:32]
    assert ids_a[32] != ids_b[32]


def test_next_turn_prompt_contains_previous_prompt_and_simulated_answer():
    # Turn 0: prompt 20 from the conversation stream, answer 7 tokens; turn 1's prompt is
    # those 27 tokens plus 5 new ones. The simulated model answers from the stream its
    # prompt ended in, so turn 1's first 27 ids are exactly turn 0's prompt + answer.
    turn0 = TraceRequest("c-t0", 0.0, 7, prompt_len=20, prefix_id="c", prefix_len=20)
    turn1 = TraceRequest("c-t1", 9.0, 3, prompt_len=32, prefix_id="c", prefix_len=32)
    answer = [stream_token(turn0.continuation_key(0), p) for p in range(20, 27)]
    assert turn1.synthesise_prompt(0)[:27] == turn0.synthesise_prompt(0) + answer
    # A request whose prompt goes past its prefix answers from its own stream.
    solo = TraceRequest("s", 0.0, 3, prompt_len=40, prefix_id="c", prefix_len=20)
    assert solo.continuation_key(0) != turn0.continuation_key(0)


@pytest.mark.parametrize("request_", [
    TraceRequest("plain", 0.0, 9, prompt_len=40),
    TraceRequest("prefixed", 0.0, 5, prompt_len=40, prefix_id="sys", prefix_len=16),
    TraceRequest("turn", 0.0, 6, prompt_len=32, prefix_id="c", prefix_len=32),
    TraceRequest("given", 0.0, 4, prompt_token_ids=(5, 6, 7)),
    TraceRequest("hashed", 0.0, 3, prompt_len=20, prompt_hashes=("h0", "h1"),
                 hash_block_size=8),
    TraceRequest("silent", 0.0, 0, prompt_len=8),
])
def test_a_prompt_and_its_answer_drawn_together_are_the_separate_draws(request_):
    """The simulator draws a prompt and its model answer in one pass where both come from
    the request's own stream (issue 15, speed): the same ids as synthesise_prompt and the
    answer's own draw; elsewhere it says so (None) and the answer is drawn apart."""
    prompt, answer = request_.synthesise_with_answer(3)
    assert prompt == request_.synthesise_prompt(3)
    n = request_.num_prompt_tokens
    expected = stream_tokens(request_.continuation_key(3), n, n + request_.output_len)
    if request_.request_id in ("turn", "given", "hashed"):
        assert answer is None
    else:
        assert answer == expected and len(answer) == request_.output_len


def test_hashed_prompts_share_exactly_the_blocks_whose_hashes_match():
    """A recorded prompt (docs/recording.md): block i comes from its hash's stream, so equal
    hash chains give equal token prefixes and the prefix cache hits as it did (G3)."""
    from kvserve.sim.trace import parse_request

    a = parse_request({"request_id": "a", "arrival_time": 0, "prompt_len": 40,
                       "prompt_hashes": ["x1", "y1"], "hash_block_size": 16, "output_len": 3})
    b = parse_request({"request_id": "b", "arrival_time": 0, "prompt_len": 35,
                       "prompt_hashes": ["x1", "z1"], "hash_block_size": 16, "output_len": 3})
    ta, tb = a.synthesise_prompt(0), b.synthesise_prompt(0)
    assert (len(ta), len(tb)) == (40, 35)
    assert ta[:16] == tb[:16] and ta[16:32] != tb[16:32]
    assert parse_request(a.to_json()) == a


@pytest.mark.parametrize(("row", "needle"), [
    ({"prompt_len": 40, "prompt_hashes": ["x"], "hash_block_size": 16}, "has 1 hashes"),
    ({"prompt_len": 40, "prompt_hashes": ["x", "y"]}, "needs hash_block_size"),
    ({"prompt_token_ids": [1, 2], "prompt_hashes": [], "hash_block_size": 16},
     "needs hash_block_size and prompt_len"),
])
def test_bad_hashed_prompts_are_named(row, needle):
    from kvserve.sim.trace import parse_request

    with pytest.raises(ValueError, match=needle):
        parse_request({"request_id": "a", "arrival_time": 0, "output_len": 1, **row})


def test_a_session_id_reaches_the_scheduler():
    """A recorded turn of a session (docs/recording.md) keeps its session (U1)."""
    request = parse_request({"request_id": "t2", "arrival_time": 1.0, "prompt_len": 8,
                             "output_len": 2, "session_id": "chat-1"})
    assert request.sampling_params(64, sessions=True).session_id == "chat-1"
    assert request.sampling_params(64).session_id is None  # sessions off: not named (U1)
    assert parse_request(request.to_json()) == request
    with pytest.raises(ValueError, match="session_id must be a non-empty string"):
        parse_request({"request_id": "t", "arrival_time": 0, "prompt_len": 8,
                       "output_len": 2, "session_id": ""})


def test_a_binary_file_is_named_as_no_trace(tmp_path, capsys):
    from kvserve.cli import main

    path = tmp_path / "bin.jsonl"
    path.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(TraceError, match=r"bin.jsonl: not a trace: it is not UTF-8 text"):
        read_trace(path)
    assert main(["simulate", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert "bin.jsonl: not a trace: it is not UTF-8 text" in err and err.count("\n") == 1


def test_a_request_s_own_queue_deadline_is_a_trace_field_and_times_it_out():  # K4
    """The record -> replay pass: a body's max_queue_delay was in no trace, so a recording's
    queue timeouts (503s) vanished from every changed run (whatif, plan) with no word."""
    from kvserve.core import SchedulerConfig
    from kvserve.core.config import CacheConfig
    from kvserve.sim.cost_models import UnitCostModel
    from kvserve.sim.simulator import Simulator

    row = {"request_id": "w", "arrival_time": 0.5, "prompt_len": 8, "output_len": 4,
           "max_queue_delay": 0.4}
    waits = parse_request(row)
    assert waits.max_queue_delay == 0.4 and waits.to_json()["max_queue_delay"] == 0.4
    assert waits.sampling_params(64).max_queue_delay == 0.4
    for bad in (0, -1, "soon", 86401):
        with pytest.raises(ValueError, match="max_queue_delay must be a number of seconds in "
                                             r"\(0, 86400\]"):
            parse_request({**row, "max_queue_delay": bad})
    hog = parse_request({"request_id": "hog", "arrival_time": 0, "prompt_len": 8,
                         "output_len": 500, "ignore_eos": True})
    result = Simulator(SchedulerConfig(max_num_seqs=1), CacheConfig(num_blocks=100),
                       UnitCostModel()).run([hog, waits])
    [record] = [r for r in result.records if r.request_id == "w"]
    assert (record.finish_reason, record.stop_reason) == ("abort", "queue_timeout")


def test_a_salted_prompt_recorded_as_ids_keeps_its_salt_apart():  # G3
    """The record -> replay pass: a recording with --record-prompts ids dropped the requests'
    cache_salt, so the replay shared blocks the server kept apart, diverged and failed."""
    from kvserve.core import SchedulerConfig
    from kvserve.core.config import CacheConfig
    from kvserve.sim.cost_models import UnitCostModel
    from kvserve.sim.simulator import Simulator

    ids = list(range(100, 164))  # four full blocks of 16
    rows = [{"request_id": name, "arrival_time": float(k), "prompt_token_ids": ids,
             "output_len": 2, **({"cache_salt": salt} if salt else {})}
            for k, (name, salt) in enumerate([("x1", "5f3a"), ("y", "9b1c"), ("none", None),
                                              ("x2", "5f3a")])]
    trace = [parse_request(row) for row in rows]
    assert trace[0].to_json()["cache_salt"] == "5f3a"
    assert trace[0].sampling_params(512).cache_salt == "5f3a"
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        parse_request({**rows[0], "cache_salt": 5})
    result = Simulator(SchedulerConfig(), CacheConfig(num_blocks=100),
                       UnitCostModel()).run(trace)
    hits = {r.request_id: r.metrics.num_cached_tokens for r in result.records}
    assert hits == {"x1": 0, "y": 0, "none": 0, "x2": 48}  # only x's salt again
