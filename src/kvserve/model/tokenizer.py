"""Text <-> token ids, and the chat template, for the model being served.

Built with the ``tokenizers`` library, either from a GGUF's ``tokenizer.ggml.*`` metadata
(byte-level BPE: tokens, merges, token types, special ids) or from a ``tokenizer.json``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from kvserve.model.detokenizer import IncrementalDetokenizer, StopChecker

__all__ = ["IncrementalDetokenizer", "StopChecker", "Tokenizer", "UnsupportedTokenizerError",
           "load_tokenizer"]


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte value has one printable character, the
    byte's own where it is printable Latin-1 (33-126, 161-172, 174-255), else 256 + its rank
    among the rest. Character -> byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [value for value in range(256) if value not in printable]
    chars = {value: chr(value) for value in printable}
    chars.update({value: chr(256 + rank) for rank, value in enumerate(others)})
    return {char: value for value, char in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


class UnsupportedTokenizerError(ValueError):
    """A tokenizer kind or pre-tokenizer this module does not implement."""


# The chat template's own file in a Hugging Face directory (transformers >= 4.47 write it
# there instead of tokenizer_config.json's "chat_template").
CHAT_TEMPLATE_FILE = "chat_template.jinja"


# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp's pre-tokenizer names -> the Hugging Face pre-tokenizer that splits the same way.
# "smollm" (like StarCoder's) splits every digit on its own (llama.cpp's first regex, \p{N}),
# then applies the GPT-2 regex: in HF terms Digits(individual_digits) + ByteLevel(use_regex).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell")
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise UnsupportedTokenizerError(
        f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
        f"{', '.join(_GPT2_PRE + _DIGITS_PRE + _LLAMA3_PRE)}")


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _template_text(template: Any, where: str) -> str | None:
    """A chat template as transformers stores it: a string, or a list of {"name",
    "template"} objects (the "default" one is taken); ValueError naming ``where`` for
    anything else (QA: a number, an object or a list of strings was a traceback)."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and all(
            isinstance(entry, Mapping) and isinstance(entry.get("template"), str)
            for entry in template):
        return {entry.get("name"): entry["template"] for entry in template}.get("default")
    raise ValueError(f"{where} must be a string or a list of {{\"name\", \"template\"}} "
                     f"objects, got {template!r:.60}")


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> Any:
    """``template`` compiled as chat templates are rendered; ValueError naming what makes it
    invalid Jinja. Compiled once per text (the review: ``chat(chat_template=...)`` compiled
    it again on every call, 3.7 ms for the bundled template)."""
    from jinja2 import TemplateSyntaxError

    try:
        return _environment().from_string(template)
    except TemplateSyntaxError as error:
        raise ValueError(f"the chat template is not valid Jinja: {error.message} (line "
                         f"{error.lineno})") from None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: the keys in their order, the text as it is. Jinja's own
    sorts the keys and escapes non-ASCII and ``<>&'`` (QA: a tool's schema and a call's
    arguments reached the model otherwise than it was trained on, and than vLLM sends)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _generation_tag() -> type:
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's text
    with it (for training masks) and renders what it holds; a template using it was refused
    as invalid Jinja (QA)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return GenerationTag


def _environment() -> Any:
    """The sandboxed Jinja environment with the settings Hugging Face renders chat templates
    with, so templates written for it render the same here."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _generation_tag()])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special ids and chat template that go with it;
    implements the engine's :class:`kvserve.engine.text.Tokenizer` protocol."""

    def __init__(self, tokenizer: HFTokenizer, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, chat_template: str | None = None,
                 unk_token_id: int | None = None, pad_token_id: int | None = None) -> None:
        self._tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self._compiled_template: Any = None

    def compiled_chat_template(self) -> Any:
        """The chat template, compiled on first use; ValueError if it is not valid Jinja
        (``kvserve serve`` asks at start, so a broken model template is not a 500 a chat)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template)
        return self._compiled_template

    def set_chat_template(self, template: str) -> None:
        """Replace the model's chat template (``--chat-template``); ValueError naming a
        template that is not valid Jinja, checked now rather than at the first chat."""
        self._compiled_template = compile_chat_template(template)
        self.chat_template = template

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the compiled chat template (jinja2's code does not pickle; it is
        compiled again on first use), so an engine spec can carry the tokenizer to a replica
        process after it has rendered a chat."""
        return {**self.__dict__, "_compiled_template": None}

    # --- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_file: Any) -> Tokenizer:
        """Build from a GGUF file's metadata (``tokenizer.ggml.model`` must be ``gpt2``); a
        path or a parsed :class:`~kvserve.model.gguf_reader.GGUFFile`."""
        from kvserve.model.loader import open_gguf

        meta = open_gguf(path_or_file).get

        kind = meta("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedTokenizerError(
                f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, byte-level "
                "BPE)")
        tokens: list[str] = meta("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:  # QA: "NoneType has no len()"
            raise UnsupportedTokenizerError("the GGUF file has no vocabulary "
                                            "(tokenizer.ggml.tokens)")
        merges = [tuple(merge.split(" ")) for merge in meta("tokenizer.ggml.merges", [])]
        if any(len(merge) != 2 for merge in merges):
            raise UnsupportedTokenizerError("GGUF merges must be pairs separated by one space")
        token_types: list[int] = meta("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {token: token_id for token_id, token in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise UnsupportedTokenizerError("GGUF vocabulary has duplicate token strings")

        tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tokenizer.pre_tokenizer = _pre_tokenizer(meta("tokenizer.ggml.pre", "default"))
        tokenizer.decoder = decoders.ByteLevel()
        added = [AddedToken(tokens[i], special=token_types[i] == _TOKEN_TYPE_CONTROL,
                            normalized=False)
                 for i in range(len(tokens))
                 if token_types[i] in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)]
        tokenizer.add_special_tokens([t for t in added if t.special])
        tokenizer.add_tokens([t for t in added if not t.special])

        bos = meta("tokenizer.ggml.bos_token_id")
        eos = meta("tokenizer.ggml.eos_token_id")
        if bos is not None and not (isinstance(bos, int) and 0 <= bos < len(tokens)):
            raise UnsupportedTokenizerError(  # QA: "list index out of range"
                f"GGUF tokenizer.ggml.bos_token_id {bos!r} is outside its {len(tokens)} tokens")
        if meta("tokenizer.ggml.add_bos_token", False) and bos is not None:
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B:1",
                special_tokens=[(tokens[bos], bos)])
        return cls(tokenizer, bos_token_id=bos, eos_token_id=eos,
                   chat_template=_template_text(meta("tokenizer.chat_template"),
                                                "GGUF tokenizer.chat_template"),
                   unk_token_id=meta("tokenizer.ggml.unknown_token_id"),
                   pad_token_id=meta("tokenizer.ggml.padding_token_id"))

    @classmethod
    def from_file(cls, tokenizer_json: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Build from a ``tokenizer.json``; BOS/EOS tokens come from a
        ``tokenizer_config.json`` beside it when there is one. The chat template, unless
        given: a ``chat_template.jinja`` beside it (newer transformers write the template
        there), else the config's ``chat_template``, in the order transformers reads them
        (the file takes priority over the config's entry)."""
        path = Path(tokenizer_json)
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as error:  # the tokenizers library raises a bare Exception (QA:
            # a truncated download, a Git LFS pointer, a GGUF without its suffix: tracebacks)
            raise ValueError(f"{path} is not a tokenizer.json that loads ({error})") from None
        config_path = path.with_name("tokenizer_config.json")
        try:
            config: Mapping[str, Any] = (json.loads(config_path.read_text())
                                         if config_path.is_file() else {})
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{config_path}: not valid JSON ({error})") from None
        if not isinstance(config, Mapping):
            raise ValueError(f"{config_path}: not a JSON object")

        def token_id(key: str) -> int | None:
            token = config.get(key)
            if isinstance(token, Mapping):
                token = token.get("content")
            return tokenizer.token_to_id(token) if isinstance(token, str) else None

        template_path = path.with_name(CHAT_TEMPLATE_FILE)
        try:
            template = chat_template or (template_path.read_text(encoding="utf-8")
                                         if template_path.is_file() else None) \
                or config.get("chat_template")
        except UnicodeDecodeError as error:
            raise ValueError(f"{template_path}: not UTF-8 text ({error})") from None
        return cls(tokenizer, bos_token_id=token_id("bos_token"),
                   eos_token_id=token_id("eos_token"),
                   chat_template=_template_text(template, f"{config_path}: chat_template"),
                   unk_token_id=token_id("unk_token"), pad_token_id=token_id("pad_token"))

    def save(self, tokenizer_json: str | Path) -> None:
        """Write the vocabulary, merges and pre-tokenizer as a ``tokenizer.json``."""
        self._tokenizer.save(str(tokenizer_json))

    # --- ids and text --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, a partial UTF-8 character included (OpenAI's logprob
        ``bytes``: joined over tokens they give the text back): a byte-level BPE token's
        characters each stand for one byte; a ``<0xHH>`` byte-fallback token is that
        byte; any other token is its decoded text's UTF-8."""
        text = self.decode([token_id])
        if "\ufffd" not in text:
            return text.encode()
        piece = self.id_to_token(token_id) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if piece and all(char in _BYTE_OF_CHAR for char in piece):
            return bytes(_BYTE_OF_CHAR[char] for char in piece)
        return text.encode()

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special tokens written in ``text`` (``<|im_start|>``) always map to their ids;
        ``add_special_tokens`` adds BOS only where the model's tokenizer asks for it.
        ValueError for text that is not Unicode (a lone surrogate: bytes that were not UTF-8,
        read with ``surrogateescape`` as a command line is)."""
        try:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            problem = text_problem(text) if isinstance(text, str) else None
            if problem is None:
                raise
            raise ValueError(problem) from None

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # --- streaming (the kvserve.engine.text.Tokenizer protocol) -------------------------------

    def detokenizer(self, prompt_token_ids: Sequence[int],
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)

    def stop_checker(self, stop: Sequence[str],
                     include_stop_str_in_output: bool = False) -> StopChecker:
        return StopChecker(stop, include_stop_str_in_output)

    # --- chat ----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """Render ``messages`` with the model's Jinja chat template (sandboxed).
        ``continue_final_message`` (vLLM's and Hugging Face's): the last message, the
        assistant's, is left open, so the model goes on with it (a reply's start given)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if continue_final_message:
            return self._continued(messages, add_generation_prompt, **kwargs)
        # as transformers renders: tools and documents none unless given (QA: undefined,
        # `tools is not none` held and a template wrote an empty tools block), and the
        # special tokens by name
        variables = {"tools": None, "documents": None, **kwargs}
        return self.compiled_chat_template().render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id),
            unk_token=self._token_text(self.unk_token_id),
            pad_token=self._token_text(self.pad_token_id), **variables)

    def _continued(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                   **kwargs: Any) -> str:
        """The conversation rendered and cut right after the final message's content (the
        template's end of turn dropped), whatever its role, as transformers cuts it (a
        client may have the model go on with a user's text). An empty final message of the
        assistant is its turn opened, as ``add_generation_prompt`` opens it."""
        if add_generation_prompt:
            raise ValueError("continue_final_message continues the last message; it cannot "
                             "be used with add_generation_prompt (set it to false)")
        final = messages[-1] if messages else {}
        content = final.get("content") or ""
        if not content.strip():
            if final.get("role") != "assistant":
                raise ValueError("continue_final_message: the final message "
                                 f"({final.get('role')!r}) is empty; there is nothing to "
                                 "continue")
            return self.apply_chat_template(messages[:-1], True, **kwargs)
        rendered = self.apply_chat_template(messages, False, **kwargs)
        for text in (content, content.strip()):
            end = rendered.rfind(text)
            if end >= 0:
                return rendered[:end + len(text)]
        raise ValueError("continue_final_message: the chat template does not render the "
                         "final message's content as given, so it cannot be continued")

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    **template_kwargs: Any) -> list[int]:
        """``template_kwargs``: more variables for the template (vLLM's
        ``chat_template_kwargs``, e.g. a template's own switches)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt,
                                                    continue_final_message,
                                                    **template_kwargs))

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._tokenizer.id_to_token(token_id) or ""


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be tokenized, or None: a lone surrogate (bytes that were not UTF-8,
    read with ``surrogateescape`` as a command line is)."""
    at = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
    if at is None:
        return None
    after = f" (after {text[max(0, at - 10):at]!r})" if at else ""
    return (f"the text is not valid UTF-8: character {at}{after} is an undecodable byte or "
            "a lone surrogate")


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The tokenizer for a model path as ``load_model_weights`` takes it: ``None`` -> the
    bundled GGUF; a ``.gguf`` file; a ``tokenizer.json``; or a directory holding one."""
    from kvserve.model.loader import ModelNotFoundError, default_model_path

    resolved = default_model_path() if path is None else Path(path)
    if not resolved.exists():
        raise ModelNotFoundError(f"model path {resolved} does not exist")
    if resolved.is_dir():
        resolved = resolved / "tokenizer.json"
    if not resolved.is_file():
        raise ModelNotFoundError(f"no tokenizer at {resolved}")
    if resolved.suffix.lower() == ".gguf":
        from kvserve.model.weights import file_named

        with file_named(resolved):
            return Tokenizer.from_gguf(resolved)
    return Tokenizer.from_file(resolved)
