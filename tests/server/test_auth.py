"""Keys files and the priority rules, without a server."""

from __future__ import annotations

import pytest

from kvserve.server.auth import (
    ApiKey,
    KeyFileError,
    KeyRing,
    load_keys,
    operator_key,
    resolve_priority,
)
from kvserve.server.errors import APIError


def test_plain_json_and_toml_keys_files(tmp_path):
    plain = tmp_path / "keys.txt"
    plain.write_text("# team keys\nsk-one\n\nsk-two\n")
    assert [(k.key, k.tenant) for k in load_keys(plain)] == [("sk-one", "key-1"),
                                                             ("sk-two", "key-2")]
    marked = tmp_path / "keys-bom.json"  # a byte-order mark an editor wrote is no key (QA)
    marked.write_text('\ufeff[{"key": "sk-b", "tenant": "team-b"}]', encoding="utf-8")
    assert [(k.key, k.tenant) for k in load_keys(marked)] == [("sk-b", "team-b")]
    # a key the file grants no urgency may ask for none beyond its default (it could ask
    # for any, -1000 included, above the operator's own default; QA)
    assert {(k.most_urgent_priority, k.default_priority) for k in load_keys(plain)} == {(0, 0)}
    with pytest.raises(APIError) as error:
        resolve_priority(-1000, load_keys(plain)[0], source="body",
                         scheduling_policy="priority")
    assert error.value.status == 403
    assert resolve_priority(50, load_keys(plain)[0], source="body",
                            scheduling_policy="priority") == 50
    toml = tmp_path / "keys.toml"
    toml.write_text('[[keys]]\nkey = "a"\ntenant = "gold"\nmost_urgent_priority = -5\n'
                    'default_priority = 0\nadmin = true\n')
    assert load_keys(toml) == [ApiKey("a", "gold", -5, 0, True)]
    as_list = tmp_path / "keys.json"
    as_list.write_text('[{"key": "b", "most_urgent_priority": 3}]')
    assert load_keys(as_list) == [ApiKey("b", "key-1", 3, 3, False)]


@pytest.mark.parametrize(("text", "needle"), [
    ('[{"key": "a", "colour": "red"}]', "unknown field(s) colour"),
    ('[{"key": ""}]', "'key' must be a non-empty string"),
    ('[{"key": "a", "most_urgent_priority": 5, "default_priority": 1}]',
     "more urgent than most_urgent_priority"),
    ("{broken", "not valid JSON"),
    ("# nothing\n", "no keys found"),
    ('[{"key": "a", "most_urgent_priority": "high"}]', "'most_urgent_priority' must be an int"),
    ('[{"key": "a", "tenant": "t"}, {"key": "a", "tenant": "u"}]',
     "key #2 is key #1 again; each key may appear once"),
    ('[{"key": "a", "tenant": ""}]', "'tenant' must be a non-empty string of printable"),
    ('[{"key": "a", "tenant": "x\\ny"}]', "'tenant' must be a non-empty string of printable"),
    ("sk-a extra words\n", "'key' must be a non-empty string of printable ASCII without "
                           "spaces"),
    ('[{"key": "a", "tenant": "operator"}]', "tenant 'operator' is the --api-key keys' own"),
    (b"\xff\xfe\x00garbage", "not UTF-8 text (byte 0)"),
    # two keys silently one tenant, sharing cache, sessions and series (QA)
    ('[{"key": "x", "tenant": "key-2"}, {"key": "y"}]',
     "key #2 has no tenant, and its default name 'key-2' is another key's tenant"),
    ('[{"key": "x", "tenant": "team a "}]', "without spaces at either end"),
    # QA: a key past ASCII never matched (a header is read as Latin-1); a priority past a
    # body's range; JSON too deep to read was a traceback
    ('[{"key": "sk-caf\u00e9"}]', "'key' must be a non-empty string of printable ASCII"),
    ('[{"key": "a", "most_urgent_priority": -99999999999999999999}]',
     "'most_urgent_priority' must be an integer from -2"),
    ('[{"key": "a", "default_priority": 2147483648}]', "'default_priority' must be an int"),
    ("[" * 100_000, "JSON nested too deeply to be a keys file"),
])
def test_bad_keys_files_name_the_problem(tmp_path, text, needle):
    path = tmp_path / "keys"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(KeyFileError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_keys(path)


def test_keyring_open_when_empty():
    assert KeyRing([]).authenticate(None).admin


def test_resolve_priority():
    key = ApiKey("k", "t", most_urgent_priority=2, default_priority=5)
    assert resolve_priority(None, key, source="body", scheduling_policy="priority") == 5
    assert resolve_priority(2, key, source="body", scheduling_policy="priority") == 2
    with pytest.raises(APIError) as error:
        resolve_priority(1, key, source="body", scheduling_policy="priority")
    assert error.value.status == 403
    with pytest.raises(APIError) as error:
        resolve_priority(7, key, source="key", scheduling_policy="priority")
    assert error.value.status == 403
    # an --api-key key may ask for any priority, whatever the source
    assert resolve_priority(-5, operator_key("op"), source="key",
                            scheduling_policy="priority") == -5
    with pytest.raises(APIError) as error:
        resolve_priority(1, ApiKey("k", "t"), source="body", scheduling_policy="fcfs")
    assert error.value.status == 400 and "not enabled" in error.value.message
