"""Files people write or hand us (specs, training configs, manifests): one reader and one
pydantic-error formatter, both giving a one-line ``FILE: FIELD: message`` error.

* :func:`read_yaml` reads a file with PyYAML's safe loader (:func:`parse_yaml` a string), and
  :func:`read_json` a JSON file; an unreadable file, a file over :data:`MAX_FILE_BYTES`, text
  that is not UTF-8, invalid YAML/JSON, values PyYAML cannot convert, and data that nests
  deeper than :data:`MAX_DEPTH` or expands (through YAML aliases) to more than
  :data:`MAX_VALUES` values all become ``error_cls(source, "", message)``. The limits are
  checked on the parsed node graph, before any alias is expanded into Python data.
* :func:`format_validation_error` turns the first error of a pydantic ``ValidationError`` into
  ``error_cls(source, field, message)``, the field written ``a.b[0].c`` (:func:`format_loc`).
  A validator names a field of its own by raising :func:`field_error`.
* :class:`FileError` is the base of ``SpecError``, ``ConfigError`` and ``ManifestError``; line
  breaks in any part of its message are shown escaped, so it always prints as one line.

Imports only the standard library and pydantic at module level (the torch-free runtime uses
it); PyYAML when YAML is read.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

E = TypeVar("E", bound=Exception)

UNKNOWN_KEY = "unknown key (check the spelling)"
MISSING_KEY = "required key is missing"
_FIELD_ERROR = "named_field"  # the pydantic error type of field_error()

# Resource limits on user files, checked before their data is built (specs and configs are a
# few KB, manifests tens of KB): a file larger than this is refused before it is read ...
MAX_FILE_BYTES = 2 * 2**20
# ... and so is data nested deeper than this, or that expands to more values (every scalar,
# list and mapping, counted once per use of a YAML alias) than this.
MAX_DEPTH = 64
MAX_VALUES = 1_000_000
_LINE_BREAKS = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


class Strict(BaseModel):
    """A config section: unknown keys are errors, and so are NaN and infinite numbers."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class FileError(ValueError):
    """A problem in a user file, printed as ``FILE: FIELD: message`` (``FILE: message``
    without a field) on one line."""

    def __init__(self, source: str, field: str, message: str):
        self.source, self.field, self.message = source, field, message
        where = f"{source}: {field}: " if field else f"{source}: "
        super().__init__(one_line(where + message))


def one_line(text: str) -> str:
    """``text`` with every line break written as its escape (``\\n``, ``\\u2028``, ...)."""
    return _LINE_BREAKS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def format_loc(loc: Iterable[str | int]) -> str:
    """A pydantic error location as a field path: ``("tiers", 0, "steps")`` -> ``tiers[0].steps``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def field_error(field: str, message: str) -> PydanticCustomError:
    """Raise this from a validator to report ``message`` against ``field`` (a path such as
    ``tiers[1].name``, relative to the model being validated)."""
    return PydanticCustomError(_FIELD_ERROR, "{field}: {message}", {"field": field, "message": message})


def format_validation_error(
    source: str,
    exc: ValidationError,
    error_cls: Callable[[str, str, str], E] = FileError,
    *,
    unknown_key: str = UNKNOWN_KEY,
) -> E:
    """The first error of ``exc`` as ``error_cls(source, field, message)``.

    Missing keys read ``required key is missing``, keys the model forbids ``unknown_key``, and
    ``ValueError``s raised by validators lose pydantic's ``Value error, `` prefix.
    """
    err = exc.errors()[0]
    field = format_loc(err["loc"])
    if err["type"] == _FIELD_ERROR:
        own = err["ctx"]["field"]  # relative to the model whose validator raised it, at err["loc"]
        if own and field:
            own = field + (own if own.startswith("[") else f".{own}")
        return error_cls(source, own or field, err["ctx"]["message"])
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        message = unknown_key
    elif err["type"] == "missing":
        message = MISSING_KEY
    return error_cls(source, field, message)


def is_file(path: str | Path) -> bool:
    """Whether ``path`` is a file; False, not an error, for a name the OS refuses (too long).

    Args:
        path: the path.

    Returns:
        Whether it names a file.
    """
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def read_text(path: str | Path, error_cls: Callable[[str, str, str], E] = FileError, what: str = "the file") -> str:
    """The UTF-8 text of ``path``; ``error_cls(str(path), "", "cannot read the file (...)")``
    when it cannot be read (``what`` names the file in that message)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:  # at most one byte past the limit (/dev/zero is not read whole)
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise error_cls(str(path), "", f"cannot read {what} ({exc.strerror or exc})") from None
    except ValueError as exc:  # a path no OS accepts, e.g. with a NUL character
        raise error_cls(str(path), "", f"cannot read {what} ({exc})") from None
    if len(data) > MAX_FILE_BYTES:
        raise error_cls(str(path), "", f"larger than {MAX_FILE_BYTES // 2**20} MiB, too large for a spec, config or manifest")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error_cls(str(path), "", f"not UTF-8 text (byte {exc.start})") from None


def read_yaml(path: str | Path, error_cls: Callable[[str, str, str], E] = FileError) -> Any:
    """The data of a YAML file, read with ``yaml.safe_load`` (no Python object tags).

    Every problem is ``error_cls(str(path), "", message)``: the file cannot be read, is not
    UTF-8, is not valid YAML (``not valid YAML at line N: ...``) or nests too deeply to parse.
    """
    return parse_yaml(read_text(path, error_cls), str(path), error_cls)


def parse_yaml(text: str, source: str, error_cls: Callable[[str, str, str], E] = FileError) -> Any:
    """``yaml.safe_load(text)``, refusing before construction a document that nests deeper than
    :data:`MAX_DEPTH` or expands to more than :data:`MAX_VALUES` values (aliases counted once
    per use: a "billion laughs" document is refused while it is still a small node graph);
    any problem is ``error_cls(source, "", message)``."""
    import yaml  # here, so the torch-free runtime (manifests are JSON) does not need PyYAML

    if len(text) > MAX_FILE_BYTES:
        raise error_cls(source, "", f"larger than {MAX_FILE_BYTES // 2**20} MiB of YAML")
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()  # the node graph: aliases are still shared nodes
            problem = _graph_problem(node) if node is not None else ""
            data = None if node is None or problem else loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}" if mark else ""
        problem = exc.problem or exc.context or _first_line(exc)
        raise error_cls(source, "", f"not valid YAML{where}: {problem}") from None
    except yaml.YAMLError as exc:  # e.g. ReaderError: a character YAML does not allow
        raise error_cls(source, "", f"not valid YAML: {_first_line(exc)}") from None
    except RecursionError:
        raise error_cls(source, "", "YAML nested too deeply to read") from None
    except MemoryError:
        raise
    except Exception as exc:  # PyYAML's converters fail on some values: 2001-02-30, `!!int`, `!!bool x`
        raise error_cls(source, "", f"not valid YAML: {type(exc).__name__}: {_first_line(exc)}") from None
    if problem:
        raise error_cls(source, "", problem)
    return data


def _graph_problem(root: Any) -> str:
    """Why a composed YAML node graph is too big to build ("" when it is not): its depth and
    its size as a tree (each alias counted as a copy of its anchor), computed without
    expanding anything, in time linear in the number of distinct nodes."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        children = _children(node)
        if not children_done:
            on_path.add(key)
            stack.append((node, True))
            for child in children:
                if id(child) in on_path:
                    return "a YAML alias refers to a collection that contains it (recursive data)"
                if id(child) not in sizes:
                    stack.append((child, False))
            continue
        on_path.discard(key)
        sizes[key] = 1 + sum(sizes[id(c)] for c in children)
        depths[key] = 1 + max((depths[id(c)] for c in children), default=0)
        if depths[key] > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels"
        if sizes[key] > MAX_VALUES:
            return f"expands to more than {MAX_VALUES:,} values (YAML aliases used over and over?)"
    return ""


def _children(node: Any) -> list:
    value = getattr(node, "value", None)
    if not isinstance(value, list):
        return []  # a scalar
    if value and isinstance(value[0], tuple):  # a mapping: (key, value) pairs
        return [part for pair in value for part in pair]
    return value


def data_problem(data: Any) -> str:
    """Why loaded data (JSON, or Python objects) is too big for a user file ("" when it is
    not): deeper than :data:`MAX_DEPTH` or more than :data:`MAX_VALUES` values; shared
    objects count once per use, a self-containing one is refused."""
    count = 0
    stack: list[tuple[Any, int, tuple[int, ...]]] = [(data, 1, ())]
    while stack:
        item, depth, path = stack.pop()
        count += 1
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels"
        if count > MAX_VALUES:
            return f"more than {MAX_VALUES:,} values"
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            children = list(item)
        else:
            continue
        if id(item) in path:
            return "data that contains itself"
        inner = (*path, id(item))
        stack.extend((child, depth + 1, inner) for child in children)
    return ""


def read_json(path: str | Path, error_cls: Callable[[str, str, str], E] = FileError, what: str = "the file") -> Any:
    """The data of a JSON file (within :data:`MAX_FILE_BYTES`, :data:`MAX_DEPTH` and
    :data:`MAX_VALUES`); every problem is ``error_cls(str(path), "", message)``."""
    import json

    text = read_text(path, error_cls, what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error_cls(str(path), "", f"not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise error_cls(str(path), "", "JSON nested too deeply to read") from None
    problem = data_problem(data)
    if problem:
        raise error_cls(str(path), "", f"JSON {problem}")
    return data


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_VALUES",
    "MISSING_KEY",
    "UNKNOWN_KEY",
    "FileError",
    "field_error",
    "format_loc",
    "format_validation_error",
    "one_line",
    "data_problem",
    "parse_yaml",
    "read_json",
    "read_text",
    "read_yaml",
]
