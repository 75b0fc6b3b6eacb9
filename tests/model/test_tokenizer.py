"""Tokenizer built from the bundled GGUF: published SmolLM2 token ids, round trips, the chat
template, incremental detokenisation and stop strings."""

from __future__ import annotations

import json
import re

import pytest
from jinja2.exceptions import SecurityError

from kvserve.model.loader import default_model_path
from kvserve.model.tokenizer import (
    IncrementalDetokenizer,
    StopChecker,
    Tokenizer,
    UnsupportedTokenizerError,
    load_tokenizer,
)

SYSTEM_PREFIX = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28,
                 7018, 411, 407, 19712, 8182, 2, 198]  # the default system turn
ASSISTANT_PROMPT = [1, 520, 9531, 198]  # "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


# --- token ids ----------------------------------------------------------------------------------

# Ids published for SmolLM2's tokenizer (HF tokenizers / llama.cpp runs of the same vocabulary).
PUBLISHED = {
    "Hello world": [19556, 905],
    "The quick brown fox jumps over the lazy dog":
        [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767],
    "  leading spaces": [216, 2899, 5600],
    "Write a haiku about the ocean.\n": [19161, 253, 421, 30614, 563, 260, 5065, 30, 198],
    "": [],
}


@pytest.mark.parametrize("text", list(PUBLISHED))
def test_published_token_ids(tokenizer, text):
    assert tokenizer.encode(text) == PUBLISHED[text]
    # add_bos_token is false in the GGUF: no BOS even when asked for special tokens.
    assert tokenizer.encode(text, add_special_tokens=True) == PUBLISHED[text]


def test_special_tokens(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.encode("<|endoftext|>") == [0]
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.id_to_token(1) == "<|im_start|>"
    assert tokenizer.id_to_token(19556) == "Hello"
    assert tokenizer.token_to_id("<|im_end|>") == 2


def test_digits_are_split_one_by_one(tokenizer):
    # SmolLM2's pre-tokenizer ("smollm" in llama.cpp) isolates every digit: '2','0','2','4'.
    ids = tokenizer.encode("in 2024")
    assert [tokenizer.id_to_token(i) for i in ids] == ["in", "Ġ", "2", "0", "2", "4"]


def test_published_chat_prompt_ids(tokenizer):
    hello = tokenizer.encode_chat([{"role": "user", "content": "hello world"}])
    assert hello == [*SYSTEM_PREFIX, 1, 4093, 198, 28120, 905, 2, 198, *ASSISTANT_PROMPT]
    capital = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert capital == [*SYSTEM_PREFIX, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198,
                       *ASSISTANT_PROMPT]
    french = tokenizer.encode_chat([{
        "role": "user",
        "content": "Quelle est la capitale de la France ? Réponds en une phrase."}])
    assert french == [
        *SYSTEM_PREFIX,
        1, 4093, 198, 65, 2726, 290, 1264, 2618, 47765, 1121, 367, 2618, 4649, 9148, 428, 2756,
        96, 19870, 430, 16520, 8715, 30, 2, 198,
        *ASSISTANT_PROMPT]


ROUND_TRIP_TEXTS = [
    "Hello, world! It's 3.14159 o'clock.",
    "héllo wörld — naïve café, 日本語のテキスト, 한국어, Ελληνικά, עברית",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "tabs\tand\n\nnewlines\r\n   indented    code:\n    def f(x):\n        return x",
    "combining e\u0301 and zero\u200bwidth",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_decode_skips_special_tokens_by_default(tokenizer):
    ids = [1, 19556, 905, 2]
    assert tokenizer.decode(ids) == "Hello world"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>Hello world<|im_end|>"


def test_from_file_matches_from_gguf(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
        "chat_template": tokenizer.chat_template}))
    loaded = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert (loaded.bos_token_id, loaded.eos_token_id) == (1, 2)
    for text in [*PUBLISHED, *ROUND_TRIP_TEXTS]:
        assert loaded.encode(text) == tokenizer.encode(text)
    messages = [{"role": "user", "content": "hello world"}]
    assert loaded.encode_chat(messages) == tokenizer.encode_chat(messages)
    from_directory = load_tokenizer(tmp_path)  # an HF model directory
    assert from_directory.encode("Hello world") == [19556, 905]
    assert from_directory.chat_template == tokenizer.chat_template


def test_a_directory_s_chat_template_jinja_is_its_chat_template(tokenizer, tmp_path):
    """Newer transformers save the template as chat_template.jinja, not in
    tokenizer_config.json: it was not read, and chat answered 400 "this tokenizer has no
    chat template" (QA). As transformers reads them, the file goes before the config's
    entry; a template given (--chat-template) goes before both."""
    tokenizer.save(tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    assert load_tokenizer(tmp_path).apply_chat_template(messages) == "[user] hi\n"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config"}))
    assert load_tokenizer(tmp_path).apply_chat_template(messages) == "[user] hi\n"
    (tmp_path / "chat_template.jinja").unlink()
    assert load_tokenizer(tmp_path).apply_chat_template(messages) == "config"
    given = Tokenizer.from_file(tmp_path / "tokenizer.json", chat_template="given")
    assert given.apply_chat_template(messages) == "given"


def test_set_chat_template_replaces_the_model_s_and_refuses_bad_jinja(tokenizer):
    replaced = Tokenizer.from_gguf(default_model_path())
    replaced.apply_chat_template([{"role": "user", "content": "x"}])  # compiled: replaced too
    replaced.set_chat_template("{{ messages[0]['content'] | upper }}")
    assert replaced.apply_chat_template([{"role": "user", "content": "x"}]) == "X"
    with pytest.raises(ValueError, match=r"the chat template is not valid Jinja: .* \(line 1\)"):
        replaced.set_chat_template("{% for %}")
    assert replaced.chat_template == "{{ messages[0]['content'] | upper }}"  # unchanged


def test_load_tokenizer_defaults_to_the_bundled_gguf(tokenizer, tmp_path):
    assert load_tokenizer(None).encode("Hello world") == [19556, 905]
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path)


def write_tokenizer_gguf(path, pre: str, add_bos: bool = False,
                         bos: int | None = None) -> None:
    """A byte-level BPE vocabulary of the 256 byte symbols plus "12", "123", "1234", "12345",
    with BOS "<s>" (control) at the end: which tokens appear shows how digits were split."""
    from gguf import GGUFWriter
    from tokenizers import pre_tokenizers

    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "12", "123", "1234", "12345", "<s>"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(["1 2", "12 3", "123 4", "1234 5"])
    writer.add_bos_token_id(len(tokens) - 1 if bos is None else bos)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("pre", "pieces"), [
    ("gpt2", ["a", "Ġ", "12345"]),  # " 12345" is one pre-token; merges reach "12345"
    ("smollm", ["a", "Ġ", "1", "2", "3", "4", "5"]),  # every digit on its own
    ("llama-bpe", ["a", "Ġ", "123", "4", "5"]),  # digits in runs of at most three
])
def test_gguf_pre_tokenizer_names(tmp_path, pre, pieces):
    path = tmp_path / f"{pre}.gguf"
    write_tokenizer_gguf(path, pre)
    tokenizer = Tokenizer.from_gguf(path)
    ids = tokenizer.encode("a 12345")
    assert [tokenizer.id_to_token(i) for i in ids] == pieces
    assert tokenizer.decode(ids) == "a 12345"


def test_gguf_add_bos_token_prepends_bos_only_with_special_tokens(tmp_path):
    path = tmp_path / "bos.gguf"
    write_tokenizer_gguf(path, "gpt2", add_bos=True)
    tokenizer = Tokenizer.from_gguf(path)
    bos = tokenizer.bos_token_id
    assert tokenizer.encode("12", add_special_tokens=True) == [bos, tokenizer.token_to_id("12")]
    assert tokenizer.encode("12") == [tokenizer.token_to_id("12")]


def test_unknown_gguf_pre_tokenizer_is_named(tmp_path):
    path = tmp_path / "odd.gguf"
    write_tokenizer_gguf(path, "no-such-pre")
    with pytest.raises(UnsupportedTokenizerError, match="'no-such-pre'"):
        Tokenizer.from_gguf(path)


def write_bare_tokenizer_gguf(path, model: str) -> None:
    """A GGUF file that names its tokenizer model and holds nothing else."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_gguf_tokenizer_is_named(tmp_path):
    path = tmp_path / "spm.gguf"
    write_bare_tokenizer_gguf(path, "llama")
    with pytest.raises(UnsupportedTokenizerError, match="'llama'"):
        Tokenizer.from_gguf(path)


# --- chat template ------------------------------------------------------------------------------

def test_chat_template_renders_a_two_turn_conversation(tokenizer):
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_chat_template_keeps_a_given_system_prompt_and_can_omit_the_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\nHi<|im_end|>\n")
    ids = tokenizer.encode_chat(messages, add_generation_prompt=False)
    assert ids[0] == 1 and ids[-2:] == [2, 198]
    assert ids.count(1) == 2 and ids.count(2) == 2


def test_chat_template_is_sandboxed_and_can_raise(tokenizer):
    custom = Tokenizer(tokenizer._tokenizer, bos_token_id=1, eos_token_id=2, chat_template=(
        "{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}"
        "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"))
    assert custom.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|im_start|>x<|im_end|>")
    with pytest.raises(ValueError, match="no messages"):
        custom.apply_chat_template([])
    looping = Tokenizer(tokenizer._tokenizer, chat_template=(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m['content'] }}{% endfor %}"))
    assert looping.apply_chat_template([{"content": "a"}, {"content": "b"}]) == "a"
    unsafe = Tokenizer(tokenizer._tokenizer, chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(SecurityError):
        unsafe.apply_chat_template([])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tokenizer._tokenizer).apply_chat_template([])


def test_chat_templates_render_as_transformers_renders_them(tokenizer):
    """QA (chat templates pass): Jinja's own tojson sorted the keys and escaped non-ASCII and
    <>&'; {% generation %} was refused as invalid Jinja; tools and documents were undefined
    (so `tools is not none` held); unk_token and pad_token rendered empty."""
    custom = Tokenizer(tokenizer._tokenizer, unk_token_id=0, pad_token_id=2, chat_template=(
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}"
        "{% endfor %}{{ messages[0].arguments | tojson }}|{{ tools is none }}"
        "{{ documents is none }}|{{ unk_token }}{{ pad_token }}"))
    rendered = custom.apply_chat_template(
        [{"role": "user", "content": "x", "arguments": {"zeta": "ü<&'", "alpha": 1}}])
    assert rendered == ('[x]{"zeta": "ü<&\'", "alpha": 1}|TrueTrue|'
                        '<|endoftext|><|im_end|>')
    assert custom.apply_chat_template([{"content": "x", "arguments": {}}],
                                      tools=[{"a": 1}]).endswith(
        "|FalseTrue|<|endoftext|><|im_end|>")
    indented = Tokenizer(tokenizer._tokenizer, chat_template="{{ {'b': 1} | tojson(indent=2) }}")
    assert indented.apply_chat_template([]) == '{\n  "b": 1\n}'


def test_continue_final_message_continues_any_role(tokenizer):
    """QA (chat templates pass): a user's final message was refused; transformers and vLLM
    cut the conversation after it whatever its role."""
    custom = Tokenizer(tokenizer._tokenizer, chat_template=(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"))
    assert custom.apply_chat_template([{"role": "user", "content": "Once upon"}], False,
                                      continue_final_message=True) == "<user>Once upon"
    with pytest.raises(ValueError, match=r"the final message \('user'\) is empty"):
        custom.apply_chat_template([{"role": "user", "content": ""}], False,
                                   continue_final_message=True)


# --- incremental detokenisation -----------------------------------------------------------------

MULTIBYTE = "Grüße 😀 aus 東京! 👨‍👩‍👧 ok"


def test_incremental_detokenisation_matches_full_decode(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    # The emoji's four UTF-8 bytes are split over two tokens ('ĠðŁĺ', 'Ģ').
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.step(i) for i in ids]
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE
    assert detokenizer.text == MULTIBYTE
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # something was held back until its character completed
    assert detokenizer.flush() == ""
    assert detokenizer.output_token_ids == ids


def test_incremental_detokenisation_after_a_prompt_and_with_special_tokens(tokenizer):
    prompt = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    output = [*tokenizer.encode("Bonjour, ça va? 🙂"), 2]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    deltas = [detokenizer.step([i]) for i in output]
    assert "".join(deltas) == "Bonjour, ça va? 🙂"
    assert deltas[-1] == ""  # <|im_end|> is skipped
    keep = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)
    assert "".join(keep.step(i) for i in output) == "Bonjour, ça va? 🙂<|im_end|>"


def test_incomplete_character_is_held_but_what_precedes_it_is_not(tokenizer):
    ids = tokenizer.encode("a 😀")
    assert [tokenizer.id_to_token(i) for i in ids] == ["a", "ĠðŁĺ", "Ģ"]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.step(ids[:2]) == "a "  # the space byte is complete, the emoji is not
    assert detokenizer.step(ids[2]) == "😀"
    assert detokenizer.text == "a 😀"
    ended = IncrementalDetokenizer(tokenizer)
    assert ended.step(ids[:2]) == "a "
    assert ended.flush() == "\ufffd"  # generation ended mid-character


def test_several_tokens_per_step(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.step(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(deltas) == MULTIBYTE


# --- stop strings -------------------------------------------------------------------------------

def feed(checker: StopChecker, pieces: list[str]) -> tuple[list[str], str | None]:
    text, emitted, matched = "", [], None
    for piece in pieces:
        out, matched = checker.check(text, piece)
        emitted.append(out)
        text += piece
        if matched:
            break
    return emitted, matched


def test_stop_string_spanning_steps_is_found_and_cut():
    emitted, matched = feed(StopChecker(["STOP"]), ["Hello S", "TO", "P and more"])
    assert matched == "STOP"
    assert emitted == ["Hello ", "", ""]  # "S" and "STO" held: they could start "STOP"


def test_stop_found_whatever_the_caller_passes_as_text_so_far():
    """Callers may pass the text emitted so far (held tail excluded) or the full text."""
    checker = StopChecker(["STOP"])
    emitted = ""
    for piece in ["Hello S", "TO", "P and more"]:
        out, matched = checker.check(emitted, piece)
        emitted += out
        if matched:
            break
    assert (emitted, matched) == ("Hello ", "STOP")


def test_stop_string_included_when_asked():
    emitted, matched = feed(StopChecker(["\n\n"], include_stop_str_in_output=True),
                            ["one\n", "\ntwo"])
    assert matched == "\n\n"
    assert "".join(emitted) == "one\n\n"


def test_held_tail_is_released_when_it_cannot_be_a_stop_any_more():
    checker = StopChecker(["</answer>"])
    emitted, matched = feed(checker, ["x </an", "swered", " yes"])
    assert matched is None
    assert emitted == ["x ", "</answered", " yes"]
    assert checker.flush() == ""
    checker = StopChecker(["</answer>"])
    emitted, _ = feed(checker, ["done </ans"])
    assert emitted == ["done "]
    assert checker.flush() == "</ans"  # finished for another reason: nothing is lost


def test_earliest_of_several_stops_wins():
    emitted, matched = feed(StopChecker(["world", "lo w"]), ["hel", "lo world"])
    assert matched == "lo w"
    assert "".join(emitted) == "hel"


def test_streamed_output_is_never_retracted():
    """Whatever the chunking, the emitted pieces concatenate to the text before the stop."""
    text = "alpha beta <stop> gamma"
    for size in range(1, 8):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        checker = StopChecker(["<stop>", "zzz"])
        emitted, matched = feed(checker, pieces)
        assert matched == "<stop>"
        assert "".join(emitted) == "alpha beta "
        assert checker.check(text, "") == ("", "<stop>")  # finished: nothing more


def test_the_tokenizer_pickles_after_rendering_a_chat(tokenizer):
    """LLM(data_parallel_size=N) sends the tokenizer to each replica process in its engine
    spec: the compiled chat template is left behind and compiled again there."""
    import pickle

    messages = [{"role": "user", "content": "Hi"}]
    ids = tokenizer.encode_chat(messages)
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy._compiled_template is None and tokenizer._compiled_template is not None
    assert copy.encode_chat(messages) == ids


def test_a_tokenizer_file_that_does_not_read_is_named(tokenizer, tmp_path):
    """QA: a truncated tokenizer.json was a bare Exception from the tokenizers library (a
    traceback from serve); a bad tokenizer_config.json or chat_template.jinja named no
    file."""
    path = tmp_path / "tokenizer.json"
    path.write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} is not a tokenizer"):
        Tokenizer.from_file(path)
    tokenizer.save(path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text('{"bos_token": ')
    with pytest.raises(ValueError, match=f"^{re.escape(str(config))}: not valid JSON"):
        Tokenizer.from_file(path)
    config.write_text("{}")
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ValueError, match=r"chat_template\.jinja: not UTF-8 text"):
        Tokenizer.from_file(path)



def test_a_stop_string_begun_in_the_min_tokens_text_cuts_the_output_at_its_start(tokenizer):
    """QA (detokenization pass): stop=[".\\n"], min_tokens=2 on " Paris" "." "\\n" answered
    " Paris." (the "." already sent) where vLLM answers " Paris": the min_tokens text is not
    searched, but its tail that may begin a stop string is held as any text's."""
    from kvserve.engine.text import TextStream

    ids = tokenizer.encode(" Paris.\n")
    stream = TextStream(tokenizer, tokenizer.encode("The capital of France is"), [".\n"],
                        min_tokens=2)
    steps = [stream.step([token], finished=False) for token in ids]
    assert "".join(text for text, _ in steps) == " Paris" and steps[-1][1] == ".\n"
    ended = TextStream(tokenizer, [], [".\n"], min_tokens=5)
    texts = [ended.step([token], finished=index == len(ids) - 2)
             for index, token in enumerate(ids[:-1])]
    assert "".join(text for text, _ in texts) == " Paris."  # finished: the held "." let out


def test_a_gguf_without_a_vocabulary_or_with_a_bos_outside_it_is_named(tmp_path):
    """The model pass: "object of type 'NoneType' has no len()" and "list index out of
    range" were all a broken GGUF tokenizer said."""
    bare = tmp_path / "bare.gguf"
    write_bare_tokenizer_gguf(bare, "gpt2")
    with pytest.raises(UnsupportedTokenizerError, match=r"no vocabulary \(tokenizer.ggml."
                                                        r"tokens\)"):
        Tokenizer.from_gguf(bare)
    path = tmp_path / "bos.gguf"
    write_tokenizer_gguf(path, "gpt2", add_bos=True, bos=999999)
    with pytest.raises(UnsupportedTokenizerError, match="bos_token_id 999999 is outside its "
                                                        "261 tokens"):
        Tokenizer.from_gguf(path)


def test_a_character_the_prompt_begins_and_the_answer_ends_is_the_answer_s(tokenizer):
    """The streaming pass: a token-id prompt ending inside a character (its first bytes)
    and an answer whose first token ends it lost the character: the prompt's undecodable
    tail was counted as text already shown."""
    ids = tokenizer.encode("a 😀")
    assert [tokenizer.id_to_token(i) for i in ids] == ["a", "ĠðŁĺ", "Ģ"]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=ids[:2])
    assert detokenizer.step(ids[2]) == "😀"
    assert detokenizer.step(tokenizer.encode("!")) == "!"
    assert detokenizer.text == "😀!"
