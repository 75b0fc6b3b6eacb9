"""Multi-turn sessions on the real engine and over HTTP (docs/scheduler.md U1-U8): greedy
answers are the same with sessions on and off, later turns prefill only their new tokens,
a turn that does not extend its session replaces it, DELETE /v1/sessions/{id} releases one
(404 when unknown or another tenant's), and the metrics count it all."""

from __future__ import annotations

import json

import httpx
import pytest

from kvserve.core import SamplingParams
from kvserve.engine.llm import LLM
from kvserve.server.auth import ApiKey

from .helpers import TINY, LiveServer, engine_spec, metric_values, tokenizer, wait_for

NEW = [[(11 * i) % 900 + 20 for i in range(21)], [(5 * i) % 700 + 30 for i in range(9)],
       [(3 * i) % 500 + 40 for i in range(13)]]  # each turn's new tokens


def conversation(llm: LLM, session: str | None) -> list[tuple[list[int], list[int], int]]:
    """Three greedy turns, each prompt the conversation so far plus new tokens: (prompt,
    answer, prefix-hit tokens) per turn."""
    history: list[int] = []
    turns = []
    for index, new in enumerate(NEW):
        prompt = history + new
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                session_id=session)
        result = llm.generate(prompt, params, use_tqdm=False)[0]
        assert result.metrics is not None, index
        turns.append((prompt, result.token_ids, result.metrics.num_cached_tokens))
        history = prompt + result.token_ids
    return turns


def test_greedy_turns_are_identical_with_sessions_on_and_off():  # U2 U3 L1
    args = {"tokenizer": tokenizer(), "num_kv_blocks": 64, "max_model_len": 512,
            "enable_prefix_caching": False}  # off: only the session can save prefill
    off = conversation(LLM(TINY, **args), None)
    llm = LLM(TINY, max_session_kv=0.5, **args)
    on = conversation(llm, "chat-1")
    assert [answer for _, answer, _ in on] == [answer for _, answer, _ in off]
    assert [hits for _, _, hits in off] == [0, 0, 0]
    # turns 2 and 3 start from the held KV: the previous prompt and answer but the answer's
    # last token, whose KV was never computed
    assert [hits for _, _, hits in on] == [0, 21 + 6 - 1, 21 + 6 + 9 + 6 - 1]
    stats = llm.engine.scheduler.stats()
    assert (stats.num_session_hits, stats.num_sessions_held) == (2, 1)


def post(live: LiveServer, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(live.url + "/v1/completions", json=body, headers=headers, timeout=60)


def test_http_turns_report_held_tokens_and_replace_an_edited_history():  # U3 U8
    reference = conversation(LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=64,
                                 max_model_len=512), None)
    with LiveServer(max_model_len=512, num_kv_blocks=64, max_session_kv=0.5) as live:
        hits, lengths = [], []
        for prompt, _answer, _ in reference:
            response = post(live, {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                   "ignore_eos": True, "session": {"id": "c", "ttl": 60}})
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            hits.append(choice["kvserve"]["prefix_hit_tokens"])
            lengths.append(response.json()["usage"]["completion_tokens"])
        assert lengths == [6, 6, 6]  # the answers' identity: the engine test above
        assert hits[1:] == [26, 41]  # turns 2 and 3 prefilled only their new tokens
        response = post(live, {"prompt": [1, 2], "n": 2, "session": {"id": "d"}})
        assert response.status_code == 400 and "one sequence" in response.text
        values = metric_values(httpx.get(live.url + "/metrics").text)
        labels = (("engine", "0"), ("model_name", "tiny"))
        assert values[("kvserve:sessions_held", labels)] == 1
        assert values[("kvserve:session_kv_blocks", labels)] == -(-(55 + 6 - 1) // 16)
        assert values[("kvserve:session_hits_total", labels)] == 2
        # another version of the conversation (a regenerated answer): it replaces the
        # session's KV and starts from what the prefix cache still has of it (U3)
        edited = [*reference[2][0][:40], 5, 6, 7]
        response = post(live, {"prompt": edited, "max_tokens": 2, "session": {"id": "c"}})
        assert response.status_code == 200, response.text
        extension = response.json()["choices"][0]["kvserve"]
        assert extension["prefix_hit_tokens"] == 32 and extension["session_held_tokens"] == 44
        values = metric_values(httpx.get(live.url + "/metrics").text)
        replaced = (("engine", "0"), ("model_name", "tiny"), ("reason", "replaced"))
        assert values[("kvserve:session_releases_total", replaced)] == 1
        assert values[("kvserve:sessions_held", labels)] == 1
        response = httpx.delete(live.url + "/v1/sessions/c", timeout=30)
        assert response.status_code == 200 and response.json()["deleted"] is True
        response = httpx.delete(live.url + "/v1/sessions/c", timeout=30)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "session_not_found"
        wait_for(live.idle, what="the pool to be all free after the delete")
        values = metric_values(httpx.get(live.url + "/metrics").text)
        deleted = (("engine", "0"), ("model_name", "tiny"), ("reason", "deleted"))
        assert values[("kvserve:session_releases_total", deleted)] == 1


def test_sessions_are_per_tenant_and_off_by_default():  # U1 U8
    keys = [ApiKey("key-a", "A"), ApiKey("key-b", "B"), ApiKey("root", "ops", admin=True)]
    with LiveServer(keys=keys, max_session_kv=0.5) as live:
        body = {"prompt": NEW[0], "max_tokens": 2, "session": {"id": "s"}}
        assert post(live, body, "key-a").status_code == 200
        assert post(live, body, "key-b").status_code == 200  # B's own "s", not A's
        gone = httpx.delete(live.url + "/v1/sessions/s", timeout=30,
                            headers={"Authorization": "Bearer key-b"})
        assert gone.status_code == 200
        again = httpx.delete(live.url + "/v1/sessions/s", timeout=30,
                             headers={"Authorization": "Bearer key-b"})
        assert again.status_code == 404  # A's is there, but B cannot see it
        assert live.scheduler.stats().num_sessions_held == 1
        root = httpx.delete(live.url + "/v1/sessions/s", timeout=30,
                            headers={"Authorization": "Bearer root"})
        assert root.status_code == 200 and live.scheduler.stats().num_sessions_held == 0
    with LiveServer() as live:
        response = post(live, {"prompt": NEW[0], "max_tokens": 2, "session": {"id": "s"}})
        assert response.status_code == 400
        assert "sessions are off" in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "session"  # QA: it was null
        bad = post(live, {"prompt": NEW[0], "session": {"id": "", "ttl": -1}})
        assert bad.status_code == 400 and "session" in bad.json()["error"]["param"]
        for name in (".", ".."):  # a DELETE could not name it: clients normalise the path
            bad = post(live, {"prompt": NEW[0], "session": {"id": name}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "session.id"
        assert httpx.delete(live.url + "/v1/sessions/s", timeout=30).status_code == 404


def test_delete_reaches_an_engine_process():  # U8
    from .helpers import engine_spec

    with LiveServer(spec=engine_spec(max_session_kv=0.5)) as live:
        body = {"prompt": NEW[0], "max_tokens": 2, "session": {"id": "p"}}
        assert post(live, body).status_code == 200
        wait_for(lambda: live.state.engine.stats.num_sessions_held == 1, what="the hold")
        assert httpx.delete(live.url + "/v1/sessions/p", timeout=30).status_code == 200
        assert httpx.delete(live.url + "/v1/sessions/p", timeout=30).status_code == 404
        wait_for(lambda: live.state.engine.stats.num_session_blocks == 0, what="the release")


@pytest.mark.parametrize("engine_process", [False, True])
def test_an_idle_server_releases_a_session_when_its_ttl_runs_out(engine_process):  # U6
    """A step released expired sessions, so on an idle server a held session outlived its
    ttl, its KV in use and sessions_held at 1 until some other request came (QA)."""
    settings = {"max_model_len": 512, "num_kv_blocks": 64, "max_session_kv": 0.5}
    server = LiveServer(spec=engine_spec(**settings)) if engine_process else \
        LiveServer(**settings)
    with server as live:
        response = post(live, {"prompt": NEW[0], "max_tokens": 4, "ignore_eos": True,
                               "session": {"id": "brief", "ttl": 0.3}})
        assert response.status_code == 200, response.text
        assert live.state.engine.stats.num_sessions_held == 1
        wait_for(lambda: live.state.engine.stats.num_sessions_held == 0, timeout=20,
                 what="the idle engine to release the expired session")
        assert live.state.engine.stats.num_free_blocks == 64
        values = metric_values(httpx.get(live.url + "/metrics").text)
        assert [value for (name, labels), value in values.items()
                if name == "kvserve:session_releases_total" and ("reason", "ttl") in labels
                ] == [1]


def test_a_turn_sent_while_the_previous_one_runs_is_a_conflict():  # U4
    """409 Conflict, not 400: the same turn succeeds once the other has finished (QA)."""
    import threading

    from .helpers import slow_engine

    engine = slow_engine(0.01, max_model_len=512, num_kv_blocks=64, max_session_kv=0.5)
    with LiveServer(engine) as live:
        first = threading.Thread(target=post, args=(live, {
            "prompt": NEW[0], "max_tokens": 200, "ignore_eos": True,
            "session": {"id": "busy"}}))
        first.start()
        wait_for(lambda: live.state.engine.stats.num_running == 1, what="the first turn")
        second = post(live, {"prompt": NEW[0] + NEW[1], "max_tokens": 2,
                             "session": {"id": "busy"}})
        assert second.status_code == 409, second.text
        assert second.headers["retry-after"] == "1"  # as a 503's: the turn may come again
        assert second.headers["x-request-id"]  # the id it was given, as an answer's
        error = second.json()["error"]
        assert error["code"] == "session_busy" and "already has a turn in flight" in \
            error["message"]
        live.state.engine.abort(live.scheduler.running[0].request_id)
        first.join(timeout=60)
        wait_for(live.idle, what="idle")


def test_a_turn_says_how_many_tokens_its_session_holds():  # U2 U5
    """A turn too big for --max-session-kv was silently not held; the response now says
    what the next turn will find (kvserve.session_held_tokens; 0: nothing held)."""
    with LiveServer(max_model_len=512, num_kv_blocks=64, max_session_kv=0.05) as live:
        small = post(live, {"prompt": NEW[0], "max_tokens": 4, "ignore_eos": True,
                            "session": {"id": "small"}})
        assert small.json()["kvserve"]["session_held_tokens"] == 21 + 4 - 1
        big = post(live, {"prompt": list(range(20, 120)), "max_tokens": 4, "ignore_eos": True,
                          "session": {"id": "big"}})  # 7 blocks; the bound is 3
        assert big.json()["kvserve"]["session_held_tokens"] == 0
        plain = post(live, {"prompt": NEW[0], "max_tokens": 2})
        assert "session_held_tokens" not in plain.json()["kvserve"]


def test_a_sessions_turns_follow_it_across_replicas():  # R6 U2 U8
    """Behind two replicas and the round-robin router, a conversation's turns all go to the
    replica holding its session (router reason "session") and start from its held KV, as on
    one engine; after a DELETE the next turn still goes there, where the prefix cache keeps
    the released blocks (QA: routed afresh, it landed on the other replica and hit
    nothing)."""
    from kvserve.core.router import make_router
    from kvserve.engine.data_parallel import DataParallelEngine
    from kvserve.engine.engine_process import LocalLauncher

    reference = conversation(LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=64,
                                 max_model_len=512), None)
    spec = engine_spec(max_model_len=512, num_kv_blocks=64, max_session_kv=0.5)
    engine = DataParallelEngine(spec, tokenizer(), [LocalLauncher(f"r{i}") for i in range(2)],
                                make_router("round-robin", 2))
    with LiveServer(serving=engine) as live:
        hits = []
        for prompt, _answer, _ in reference:
            response = post(live, {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                   "ignore_eos": True, "session": {"id": "c"}})
            assert response.status_code == 200, response.text
            hits.append(response.json()["choices"][0]["kvserve"]["prefix_hit_tokens"])
        assert hits[1:] == [26, 41]  # as on one engine (the test above)
        assert httpx.delete(live.url + "/v1/sessions/c", timeout=30).status_code == 200
        response = post(live, {"prompt": reference[2][0], "max_tokens": 2,
                               "session": {"id": "c"}})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["kvserve"]["prefix_hit_tokens"] == 48
        values = metric_values(httpx.get(live.url + "/metrics").text)
        decisions: dict[tuple[str, str], float] = {
            (dict(labels)["reason"], dict(labels)["replica"]): value
            for (name, labels), value in values.items()
            if name == "kvserve:router_decisions_total" and value}
        assert decisions == {("round_robin", "0"): 1, ("session", "0"): 3}, decisions


def test_session_ids_are_checked_alike_in_a_body_and_in_a_delete():  # U1 U8
    """A C1 control character got through the body's check (only C0 and DEL were refused),
    a DEL was echoed raw (invisible) in the message, and a DELETE of an id no body could
    carry was a 404 repeating it (QA)."""
    with LiveServer(max_model_len=512, num_kv_blocks=64, max_session_kv=0.5) as live:
        # ... nor invisible ones: a right-to-left override or a line separator could make
        # an id echoed in a message or the event log read as another (QA)
        for bad, shown in (("a\u0085b", "a\\u0085b"), ("a\x7fb", "a\\u007fb"),
                           ("\u202eevil", "\\u202eevil"), ("a\u2028b", "a\\u2028b")):
            response = post(live, {"prompt": [1, 2, 3], "max_tokens": 1,
                                   "session": {"id": bad}})
            assert response.status_code == 400, bad
            message = response.json()["error"]["message"]
            assert "may not contain '/', control characters or invisible" in message, message
            assert f'(got "{shown}")' in message, message
        blank = post(live, {"prompt": [1, 2, 3], "max_tokens": 1, "session": {"id": "  "}})
        assert "may not be only blanks" in blank.json()["error"]["message"]
        for path, words in (("x" * 300, "at most 256 characters"),
                            ("%00", "control characters")):
            response = httpx.delete(f"{live.url}/v1/sessions/{path}", timeout=30)
            assert response.status_code == 400, path
            error = response.json()["error"]
            assert error["message"].startswith("session id: ") and words in error["message"]
        assert httpx.delete(live.url + "/v1/sessions/fine", timeout=30).status_code == 404


def test_return_token_ids_gives_what_a_session_turn_sends_back():  # U3, vLLM's field
    """A chat answer sent back as text may not tokenize to the ids the model produced, and
    the turn then replaced its session (QA); with vLLM's return_token_ids the client sends
    back the exact ids, and the next turn starts from the held KV."""
    with LiveServer(max_model_len=512, num_kv_blocks=64, max_session_kv=0.5) as live:
        base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        response = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
            **base, "messages": [{"role": "user", "content": "hello there"}],
            "session": {"id": "ids"}})
        body = response.json()
        prompt, answer = body["prompt_token_ids"], body["choices"][0]["token_ids"]
        assert len(prompt) == body["usage"]["prompt_tokens"] and len(answer) == 6
        turn = post(live, {**base, "prompt": [*prompt, *answer, 11, 12, 13],
                           "session": {"id": "ids"}})
        choice = turn.json()["choices"][0]
        assert choice["kvserve"]["prefix_hit_tokens"] == len(prompt) + 6 - 1  # a session hit
        assert choice["prompt_token_ids"] == [*prompt, *answer, 11, 12, 13]
        # streamed: the choice's first chunk carries the prompt's ids, each chunk its own
        with httpx.stream("POST", live.url + "/v1/completions", timeout=60, json={
                **base, "prompt": [5, 6, 7], "stream": True}) as stream:
            events = [json.loads(line[6:]) for line in stream.iter_lines()
                      if line.startswith("data: {")]
        chunks = [event["choices"][0] for event in events]
        assert chunks[0]["prompt_token_ids"] == [5, 6, 7]
        assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
        streamed = [t for chunk in chunks for t in chunk["token_ids"]]
        alone = post(live, {**base, "prompt": [5, 6, 7]}).json()["choices"][0]["token_ids"]
        assert streamed == alone and len(alone) == 6
        plain = post(live, {"prompt": [5, 6, 7], "max_tokens": 2}).json()["choices"][0]
        assert "token_ids" not in plain and "prompt_token_ids" not in plain
