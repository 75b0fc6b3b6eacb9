"""The helpers that give each scheduling idea one home (issue 17, "one name per idea")."""

from __future__ import annotations

import json

import pytest

from kvserve.core import EventType, ModelOutput, RequestOutput
from kvserve.core.outputs import unfinished_output
from kvserve.core.scheduler import tokens_to_schedule
from tests.conftest import make_request, make_scheduler, run_to_completion

# -- tokens_to_schedule (D1, D5) -------------------------------------------------------------


@pytest.mark.parametrize(("num_tokens", "num_computed", "threshold", "max_model_len", "n"), [
    (1000, 0, 0, 4096, 1000),  # the whole prompt: no cap binds
    (1000, 0, 256, 4096, 256),  # the long-prefill threshold caps it
    (1000, 900, 256, 4096, 100),  # the last chunk is under the threshold
    (1000, 999, 256, 4096, 1),  # a decode
    (1000, 1000, 0, 4096, 0),  # nothing left: the running pass skips it (D2)
    (1000, 0, 0, 512, 511),  # max_model_len - num_computed - 1
    (1000, 500, 0, 512, 11),
])
def test_tokens_to_schedule_applies_every_cap_of_d1(num_tokens, num_computed, threshold,
                                                     max_model_len, n):  # D1
    assert tokens_to_schedule(num_tokens, num_computed, threshold, max_model_len) == n


@pytest.mark.parametrize("threshold", [0, 1, 7])
def test_a_decode_is_one_token_whatever_the_caps(threshold):  # D1
    # The running pass skips the call when one token is left; this is the reason it may.
    for max_model_len in (2, 3, 100):
        for num_computed in range(max_model_len - 1):  # unfinished: num_tokens < max_model_len
            assert tokens_to_schedule(num_computed + 1, num_computed, threshold,
                                      max_model_len) == 1


def test_both_passes_cap_a_prompt_at_the_threshold():  # D1, D5
    # Pass 2 admits r0's first chunk; pass 1 grows it by the next; a resumed request would
    # go through pass 2 again, with the same caps.
    scheduler = make_scheduler(long_prefill_token_threshold=64)
    scheduler.add_request(make_request("r0", 200))
    assert scheduler.schedule(0.0).num_scheduled_tokens == {"r0": 64}  # waiting pass
    assert scheduler.schedule(1.0).num_scheduled_tokens == {"r0": 64}  # running pass


# -- the update() fast path's output ---------------------------------------------------------


def test_request_output_field_order_is_the_one_unfinished_output_writes():
    # unfinished_output builds the tuple by position: a reordered RequestOutput fails here.
    assert RequestOutput._fields == ("request_id", "new_token_ids", "finished",
                                     "finish_reason", "stop_reason", "metrics")
    built = unfinished_output("r", [5])
    assert type(built) is RequestOutput
    assert built == RequestOutput(request_id="r", new_token_ids=[5])
    assert (built.request_id, built.new_token_ids, built.finished, built.finish_reason,
            built.stop_reason, built.metrics) == ("r", [5], False, None, None, None)


def test_one_and_several_tokens_take_the_same_append_and_stop_path():  # H2, B3
    scheduler = make_scheduler()
    scheduler.add_request(make_request("one", 4, max_tokens=3))
    scheduler.add_request(make_request("many", 4, max_tokens=3))
    out = scheduler.schedule(1.0)
    first = scheduler.update(out, ModelOutput({"one": [7], "many": [7, 8]}), 1.0)
    assert first == [RequestOutput("one", [7]), RequestOutput("many", [7, 8])]
    out = scheduler.schedule(2.0)
    second = {o.request_id: o for o in scheduler.update(
        out, ModelOutput({"one": [9], "many": [9, 10]}), 2.0)}
    assert second["one"] == RequestOutput("one", [9])
    many = second["many"]  # max_tokens reached at its third token: the fourth is dropped
    assert (many.new_token_ids, many.finished, many.finish_reason) == ([9], True, "length")
    assert many.metrics is not None and many.metrics.first_token_time == 1.0


# -- one event vocabulary (B3) ---------------------------------------------------------------


def test_the_request_timeline_and_the_event_log_share_one_vocabulary():  # B3
    scheduler = make_scheduler(num_blocks=10, block_size=16, record_events=True)
    requests = [make_request(n, 80, max_tokens=3, ignore_eos=True) for n in ("r0", "r1")]
    r1 = requests[1]
    run_to_completion(scheduler, requests)
    log = [e for e in scheduler.take_events() if e.request_id == "r1"]
    assert all(type(e.kind) is EventType for e in log)
    # The log has every timeline event, in order, plus the waiting pass's "blocked" lines.
    assert [e.type for e in r1.events] == [e.kind for e in log
                                           if e.kind is not EventType.BLOCKED]
    assert [e.type for e in r1.events] == [EventType.ARRIVED, EventType.ADMITTED,
                                          EventType.PREEMPTED, EventType.RESUMED,
                                          EventType.FINISHED]


def test_an_event_kind_is_written_and_compared_as_its_value():  # B3
    assert [k.value for k in EventType] == ["arrived", "admitted", "resumed", "blocked",
                                            "promoted", "preempted", "finished", "held",
                                            "released"]
    assert EventType.PREEMPTED == "preempted" and str(EventType.PREEMPTED) == "preempted"
    assert f"{EventType.ADMITTED}" == "admitted"
    assert json.dumps({"kind": EventType.BLOCKED}) == '{"kind": "blocked"}'
    assert EventType("resumed") is EventType.RESUMED
