"""Files people write or hand us (specs, training configs, manifests): one reader and one
pydantic-error formatter, both giving a one-line ``FILE: FIELD: message`` error.

* :func:`read_yaml` reads a file with ``yaml.safe_load`` (:func:`parse_yaml` a string); an
  unreadable file, text that is not UTF-8, invalid YAML, values PyYAML cannot convert and
  nesting too deep to parse all become ``error_cls(source, "", message)``.
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

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

E = TypeVar("E", bound=Exception)

UNKNOWN_KEY = "unknown key (check the spelling)"
MISSING_KEY = "required key is missing"
_FIELD_ERROR = "named_field"  # the pydantic error type of field_error()
_LINE_BREAKS = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


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


def read_text(path: str | Path, error_cls: Callable[[str, str, str], E] = FileError, what: str = "the file") -> str:
    """The UTF-8 text of ``path``; ``error_cls(str(path), "", "cannot read the file (...)")``
    when it cannot be read (``what`` names the file in that message)."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error_cls(str(path), "", f"cannot read {what} ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise error_cls(str(path), "", f"not UTF-8 text (byte {exc.start})") from None
    except ValueError as exc:  # a path no OS accepts, e.g. with a NUL character
        raise error_cls(str(path), "", f"cannot read {what} ({exc})") from None


def read_yaml(path: str | Path, error_cls: Callable[[str, str, str], E] = FileError) -> Any:
    """The data of a YAML file, read with ``yaml.safe_load`` (no Python object tags).

    Every problem is ``error_cls(str(path), "", message)``: the file cannot be read, is not
    UTF-8, is not valid YAML (``not valid YAML at line N: ...``) or nests too deeply to parse.
    """
    return parse_yaml(read_text(path, error_cls), str(path), error_cls)


def parse_yaml(text: str, source: str, error_cls: Callable[[str, str, str], E] = FileError) -> Any:
    """``yaml.safe_load(text)``; any problem is ``error_cls(source, "", message)``."""
    import yaml  # here, so the torch-free runtime (manifests are JSON) does not need PyYAML

    try:
        return yaml.safe_load(text)
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


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


__all__ = [
    "MISSING_KEY",
    "UNKNOWN_KEY",
    "FileError",
    "field_error",
    "format_loc",
    "format_validation_error",
    "one_line",
    "parse_yaml",
    "read_text",
    "read_yaml",
]
