"""Reading user files (``nefl_zoo.userfiles``): every limit at its boundary and every refusal
word for word, for YAML, JSON and plain text."""

import json

import pytest

from nefl_zoo import userfiles
from nefl_zoo.userfiles import FileError, data_problem, one_line, parse_yaml, read_json, read_text


def message(call, *args):
    with pytest.raises(FileError) as refused:
        call(*args)
    return str(refused.value)


def test_line_breaks_are_written_as_escapes():
    assert one_line("a\nb\r\nc\u2028d") == "a\\nb\\r\\nc\\u2028d"
    assert one_line("plain") == "plain"


def test_unreadable_text_files_are_one_line(tmp_path):
    missing = tmp_path / "missing.yaml"
    assert message(read_text, missing) == f"{missing}: cannot read the file (No such file or directory)"
    assert message(read_text, "bad\0name") == "bad\0name: cannot read the file (embedded null byte)"
    (tmp_path / "latin.yaml").write_bytes(b"ok\xe9")
    assert message(read_text, tmp_path / "latin.yaml") == f"{tmp_path / 'latin.yaml'}: not UTF-8 text (byte 2)"


def test_a_file_of_exactly_the_limit_is_read_and_one_byte_more_is_refused(tmp_path):
    assert userfiles.MAX_FILE_BYTES == 2 * 2**20  # the documented limit
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (2 * 2**20))
    assert len(read_text(path)) == 2 * 2**20
    path.write_bytes(b"#" * (2 * 2**20 + 1))
    assert message(read_text, path) == f"{path}: larger than 2 MiB, too large for a spec, config or manifest"
    assert message(parse_yaml, "#" * (2 * 2**20 + 1), "given") == "given: larger than 2 MiB of YAML"
    assert parse_yaml("#" * (2 * 2**20 - 5) + "\na: 1", "given") == {"a": 1}  # exactly 2 MiB


def test_yaml_errors_name_the_source_and_the_problem():
    assert message(parse_yaml, "a: [1, 2", "x.yaml").startswith("x.yaml: not valid YAML at line 1: ")
    assert message(parse_yaml, "a: !!int x", "x.yaml") == (
        "x.yaml: not valid YAML: ValueError: invalid literal for int() with base 10: 'x'")
    assert message(parse_yaml, "a: \x07", "x.yaml").startswith("x.yaml: not valid YAML: unacceptable character")
    assert message(parse_yaml, "a: &a [*a]", "x.yaml") == (
        "x.yaml: a YAML alias refers to a collection that contains it (recursive data)")
    assert parse_yaml("", "x.yaml") is None and parse_yaml("# only a comment", "x.yaml") is None


def nested_yaml(depth: int) -> str:
    """A document of ``depth`` levels: lists in lists around one number (the number is a level)."""
    return "[" * (depth - 1) + "1" + "]" * (depth - 1)


def test_yaml_nesting_is_refused_one_level_past_the_limit():
    assert parse_yaml(nested_yaml(64), "x.yaml") is not None
    assert parse_yaml("[" * 64 + "]" * 64, "x.yaml") is not None  # the innermost, empty list is the 64th level
    assert message(parse_yaml, nested_yaml(65), "x.yaml") == "x.yaml: nested deeper than 64 levels"
    assert message(parse_yaml, "[" * 65 + "]" * 65, "x.yaml") == "x.yaml: nested deeper than 64 levels"


def test_yaml_aliases_that_expand_past_the_limit_are_refused_before_they_are_built(monkeypatch):
    monkeypatch.setattr(userfiles, "MAX_VALUES", 21)
    # a: 4 values (the list and 3 numbers) used 4 times in b (17 with b itself); the mapping
    # holds the keys "a", "b", a and b: 1 + 1 + 1 + 4 + 17 = 24 values
    laughs = "a: &a [1, 2, 3]\nb: [*a, *a, *a, *a]\n"
    assert message(parse_yaml, laughs, "x.yaml") == "x.yaml: expands to more than 21 values (YAML aliases used over and over?)"
    monkeypatch.setattr(userfiles, "MAX_VALUES", 24)
    assert parse_yaml(laughs, "x.yaml") == {"a": [1, 2, 3], "b": [[1, 2, 3]] * 4}


def test_data_limits_hold_at_their_boundaries(monkeypatch):
    nested = 1
    for _ in range(63):
        nested = [nested]
    assert data_problem(nested) == ""  # 64 levels
    assert data_problem([nested]) == "nested deeper than 64 levels"
    monkeypatch.setattr(userfiles, "MAX_VALUES", 5)
    assert data_problem([1, 2, 3, 4]) == ""  # the list and its 4 items
    assert data_problem([1, 2, 3, 4, 5]) == "more than 5 values"
    assert data_problem({"a": 1, "b": 2}) == ""  # keys count
    assert data_problem({"a": 1, "b": [2]}) == "more than 5 values"
    shared = [1]
    assert data_problem([shared, shared]) == ""  # 1 + 2 x 2
    loop = []
    loop.append(loop)
    assert data_problem(loop) == "data that contains itself"


def test_json_errors_name_the_file_and_the_problem(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    path.write_text('{"a": [1, 2}')
    assert message(read_json, path) == f"{path}: not valid JSON (line 1: Expecting ',' delimiter)"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert message(read_json, path) == f"{path}: JSON nested too deeply to read"
    path.write_text(json.dumps([[[[1]]]]))
    monkeypatch.setattr(userfiles, "MAX_DEPTH", 4)
    assert message(read_json, path) == f"{path}: JSON nested deeper than 4 levels"
    monkeypatch.setattr(userfiles, "MAX_DEPTH", 5)
    assert read_json(path) == [[[[1]]]]
    assert message(read_json, tmp_path / "none.json", FileError, "the manifest") == (
        f"{tmp_path / 'none.json'}: cannot read the manifest (No such file or directory)")
