"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

* Generated reference: a line ``<!-- generate: cli -->`` in a page becomes the reference of
  every ``nefl-zoo`` command, read from the typer app (usage, arguments, options, defaults,
  help); ``<!-- generate: schema MODULE:MODEL -->`` becomes a table per pydantic model (the
  model and every model it nests), read from ``MODEL.model_json_schema()``;
  ``<!-- generate: layers -->`` becomes the table of the package's parts (job, imports), read
  from ``[tool.nefl-zoo.structure]`` of ``pyproject.toml``. An unknown directive stops the
  build.
* Docstrings: the Sphinx roles they use (``:func:`name```, ``:class:`~pkg.Name```) render as
  code, and a paragraph's ``::`` (reST's literal block marker) as ``:``.
* The version: ``nefl_zoo.__version__``, shown beside the repository link (``extra.version``,
  read by ``docs/overrides/partials/source.html``).
* Checks of every rendered page, generated reference included (a warning each, so
  ``mkdocs build --strict`` fails): no line of a code block wider than :data:`MAX_COLUMNS`, and
  outside the developer section (:data:`DEVELOPER_SECTION`) no trace of how the software was
  made (:data:`HISTORY`: issue numbers, commit hashes, test-file paths).
"""

from __future__ import annotations

import html
import json
import logging
import re
import sys
import warnings
from importlib import import_module
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.nefl_zoo")

MAX_COLUMNS = 88
DEVELOPER_SECTION = "develop/"  # pages under docs/develop/ are for contributors
HISTORY = {
    "an issue number": re.compile(r"\bissues?\s*#?\d", re.IGNORECASE),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "a test file's path": re.compile(r"\btests/"),
}


def on_config(config):
    """The package's version, for the header (``extra.version``)."""
    from nefl_zoo import __version__

    config.extra["version"] = __version__
    return config

DIRECTIVE = re.compile(r"^<!--\s*generate:\s*(?P<kind>\w+)\s*(?P<args>.*?)\s*-->$", re.MULTILINE)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Replace each ``<!-- generate: ... -->`` line with what it names."""

    def generate(match: re.Match) -> str:
        kind, args = match["kind"], match["args"]
        if kind == "cli" and not args:
            return cli_reference()
        if kind == "schema" and ":" in args:
            return schema_reference(args)
        if kind == "layers" and not args:
            return layers_reference()
        raise ValueError(f"{page.file.src_uri}: unknown directive 'generate: {kind} {args}' "
                         "(expected 'generate: cli', 'generate: schema MODULE:MODEL' or 'generate: layers')")

    return DIRECTIVE.sub(generate, markdown)


ROLE = re.compile(r":(?:func|class|mod|data|attr|meth|exc|obj):<code>(~)?([^<]*)</code>")


def on_page_content(html: str, page, config, files) -> str:
    """Docstrings' Sphinx roles as plain code (``~`` keeps the last name), ``::`` as ``:``;
    then the page's checks (:func:`page_problems`), each a warning."""
    html = ROLE.sub(lambda m: f"<code>{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}</code>", html)
    html = html.replace("::</p>", ":</p>")
    for problem in page_problems(page.file.src_uri, html):
        log.warning(problem)
    return html


PRE = re.compile(r"<pre\b[^>]*>(.*?)</pre>", re.DOTALL)
TAG = re.compile(r"<[^>]+>")


def page_problems(src_uri: str, content: str) -> list[str]:
    """What is wrong with a page's rendered HTML ``content``: each code block line wider than
    :data:`MAX_COLUMNS`, and (outside :data:`DEVELOPER_SECTION`) each match of :data:`HISTORY`."""
    problems = []
    for block in PRE.findall(content):
        for line in html.unescape(TAG.sub("", block)).splitlines():
            if len(line) > MAX_COLUMNS:
                problems.append(f"{src_uri}: a code line of {len(line)} columns (at most {MAX_COLUMNS}): {line.strip()[:60]!r}")
    if not src_uri.startswith(DEVELOPER_SECTION):
        text = html.unescape(TAG.sub(" ", content))
        for what, pattern in HISTORY.items():
            for match in pattern.finditer(text):
                context = " ".join(text[max(0, match.start() - 30):match.end() + 30].split())
                problems.append(f"{src_uri}: {what} on a user page: ...{context}...")
    return problems


# ---- the package's layers, from pyproject.toml ---------------------------------------------------
def layers_reference() -> str:
    """The package's parts, highest first: each one's job and the parts it imports, as declared
    in ``[tool.nefl-zoo.structure]`` of ``pyproject.toml`` (read by ``tools/structure.py``)."""
    tools = Path(__file__).resolve().parent
    sys.path.insert(0, str(tools))
    try:
        structure = import_module("structure")
    finally:
        sys.path.pop(0)
    layout = structure.read_layout(tools.parent / "pyproject.toml")
    rows = [f"| `{part.name}` | {part.job} | {', '.join(f'`{name}`' for name in part.imports) or 'nothing'} |"
            for part in reversed(layout.parts.values())]
    return "| part | its job | imports |\n|---|---|---|\n" + "\n".join(rows) + "\n"


# ---- the CLI, from the typer app ----------------------------------------------------------------
def cli_reference() -> str:
    """A section per ``nefl-zoo`` command, in the order ``nefl-zoo --help`` lists them."""
    import click

    with warnings.catch_warnings():  # typer's own imports of deprecated click names
        warnings.simplefilter("ignore", DeprecationWarning)
        import typer.main

        from nefl_zoo_cli.app import app

    group = typer.main.get_command(app)
    root = click.Context(group, info_name="nefl-zoo")
    sections = []
    for name in group.list_commands(root):
        command = group.get_command(root, name)
        if command is None or command.hidden:
            continue
        context = click.Context(command, info_name=name, parent=root)
        usage = " ".join(command.collect_usage_pieces(context))
        rows = [_param_row(param) for param in command.params if not getattr(param, "hidden", False)]
        sections.append(
            f"## `nefl-zoo {name}`\n\n{_cell_text(command.help or '', table=False)}\n\n"
            f"```text\nnefl-zoo {name} {usage}\n```\n\n"
            "| argument or option | type | default | what it does |\n|---|---|---|---|\n" + "\n".join(rows)
        )
    return "\n\n".join(sections) + "\n"


def _param_row(param) -> str:
    """One table row: names, type (choices listed), default, help."""
    import click

    if isinstance(param, click.Argument):
        names = param.human_readable_name + ("" if param.required else " (optional)")
    else:
        names = ", ".join(param.opts) + "".join(f" / {opt}" for opt in param.secondary_opts)
    choices = getattr(param.type, "choices", None)
    kind = " \\| ".join(str(c) for c in choices) if choices else param.type.name.upper()
    if getattr(param, "is_flag", False) and not param.secondary_opts:
        kind, default = "flag", ""
    elif getattr(param, "multiple", False):
        kind, default = f"{kind}, repeatable", ""
    else:
        default = _default(param)
    if param.required:
        default = "required"
    return f"| `{names}` | {kind} | {default} | {_cell_text(getattr(param, 'help', None) or '')} |"


def _default(param) -> str:
    value = param.default
    if value is None:
        return ""
    if isinstance(value, bool) and param.secondary_opts:
        return f"`{param.opts[0] if value else param.secondary_opts[0]}`"
    return f"`{getattr(value, 'value', value)}`"


def _cell_text(text: str, table: bool = True) -> str:
    """Help text as Markdown: click's ``\\b`` paragraph markers dropped; in a table cell, on one
    line with ``|`` escaped."""
    text = text.replace("\b", "").strip()
    return " ".join(text.split()).replace("|", "\\|") if table else text


# ---- schemas, from the pydantic models -----------------------------------------------------------
def schema_reference(target: str) -> str:
    """A table per model of ``MODULE:MODEL``'s JSON Schema: the model first, then the models it
    refers to, in the order they are first referred to, each with the key it is found at."""
    module, name = target.split(":", 1)
    schema = getattr(import_module(module), name).model_json_schema()
    nodes = {name: schema, **schema.pop("$defs", {})}
    found_at, queue = {name: ""}, [name]
    while queue:
        title = queue.pop(0)
        for field, spec in nodes[title].get("properties", {}).items():
            for ref in re.findall(r'"\$ref": "#/\$defs/([^"]+)"', json.dumps(spec)):
                if ref not in found_at:
                    found_at[ref] = f"{found_at[title]}.{field}".lstrip(".")
                    queue.append(ref)
    return "\n\n".join(_model_table(title, nodes[title], key) for title, key in found_at.items()) + "\n"


# A docstring's first Google section (pydantic takes a model's docstring as its description):
# the tables show the text before it; the Python API pages show the rest.
SECTION = re.compile(r"^(?:Args|Attributes|Examples?|Raises|Returns|Yields):[ \t]*$", re.MULTILINE)


def _model_table(title: str, node: dict, key: str) -> str:
    required = set(node.get("required", ()))
    rows = []
    for field, spec in node.get("properties", {}).items():
        default = "required" if field in required else (f"`{json.dumps(spec['default'])}`" if "default" in spec else "")
        rows.append(f"| `{field}` | {_type(spec)} | {default} | {_cell_text(spec.get('description', ''))} |")
    extra = "" if node.get("additionalProperties", True) else "\n\nOther keys are refused."
    description = SECTION.split(node.get("description", ""), 1)[0].strip()
    head = f"### {title}\n\n" + (f"At `{key}`. " if key else "") + (f"{description}\n\n" if description else "\n\n")
    if not rows:
        return head + "No fields." + extra
    return head + "| field | type | default | meaning |\n|---|---|---|---|\n" + "\n".join(rows) + extra


BOUNDS = {"exclusiveMinimum": "> {}", "minimum": "≥ {}", "exclusiveMaximum": "< {}", "maximum": "≤ {}",
          "minLength": "at least {} characters", "maxLength": "at most {} characters",
          "minItems": "at least {} items", "maxItems": "at most {} items", "exactItems": "{} items", "pattern": "matches `{}`"}


def _type(spec: dict) -> str:
    """A JSON Schema node as short Markdown: ``integer ≥ 1``, ``a \\| b``, a link to a model."""
    if "$ref" in spec:
        ref = spec["$ref"].rsplit("/", 1)[1]
        return f"[{ref}](#{ref.lower()})"
    for union in ("anyOf", "oneOf"):
        if union in spec:
            return " or ".join(_type(option) for option in spec[union])
    if "enum" in spec:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in spec["enum"])
    if "const" in spec:
        return f"`{json.dumps(spec['const'])}`"
    kind = spec.get("type", "any")
    if kind == "array":
        kind = f"list of {_type(spec['items'])}" if "items" in spec else "list"
        if "prefixItems" in spec:
            kind = "[" + ", ".join(_type(item) for item in spec["prefixItems"]) + "]"
    elif kind == "object" and isinstance(spec.get("additionalProperties"), dict):
        kind = f"map to {_type(spec['additionalProperties'])}"
    if spec.get("minItems") is not None and spec.get("minItems") == spec.get("maxItems"):
        spec = {**spec, "exactItems": spec.pop("minItems")}
        del spec["maxItems"]
    bounds = [text.format(spec[key]).replace("|", "\\|") for key, text in BOUNDS.items() if key in spec]
    return f"{kind} ({', '.join(bounds)})" if bounds else kind
