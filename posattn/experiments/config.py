"""The config layer shared by every sweep (``compare``, ``finetune``, ``pretrain`` recipes).

Each kind of config declares its keys once, as a pydantic model derived from :class:`Schema`
(:mod:`posattn.synthetic.schema`, :mod:`posattn.finetune.schema`, :class:`posattn.pretrain.config.PretrainSchema`;
:data:`posattn.experiments.schemas.CONFIG_SCHEMAS` lists them): type, default and a description per key.
From that one declaration come

- validation: :func:`check` reports every problem of a config at once, one readable line per
  problem (``key.path: reason``), unknown keys named with the valid ones; a command raises them as
  one :class:`ConfigError`, the one error a bad config raises whichever command reads it. A check
  that combines keys (lengths against ``max_len``, a model built from its sizes and mechanisms)
  runs once the keys it reads are valid on their own, and its problems join the others;
- the ``--help`` text of each command (:func:`schema_text`) and the documentation's tables
  (:func:`schema_markdown`), so that neither is written by hand.

:func:`load_config` reads a raw config (a YAML path, a built-in name from a package's ``configs/``
folder, a dict or None for the default) and :func:`read_yaml` any YAML mapping; :func:`is_int` is
the integer check code outside the schemas shares.
"""
from __future__ import annotations

import inspect
import json
import re
import textwrap
import types
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticUndefined

from posattn.errors import PositionError
from posattn.mechanisms import registry
from posattn.runtime.files import name_problem

WIDTH = 100     # columns of the --help text


class ConfigError(PositionError):
    """A config (compare sweep, fine-tuning suite or pretraining recipe) is invalid; the message lists
    every problem found."""


def is_int(value: Any, low: int = 1) -> bool:
    """``value`` is an integer (not a bool) of at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


# ---------------------------------------------------------------------------------------------------
# Declaring a schema

class Schema(BaseModel):
    """Base of every config schema: an unknown key is an error, and nothing is coerced (``"3"`` is
    not 3, ``true`` is not 1, 3.0 is not the integer 3), as a config's values are kept as written."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Problems(ValueError):
    """Several problems found by one check of a schema (a validator), each a whole line that names
    its key; :func:`check` lists them as they are."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = list(lines)


def report(problems: list[str]) -> None:
    """Raise :class:`Problems` if a validator found any."""
    if problems:
        raise Problems(problems)


@dataclass(frozen=True)
class Shown:
    """How a type is written in the help text and the documentation (``int | [int]``), where the
    annotation alone would read worse (a list a scalar is wrapped into, a custom check)."""

    text: str


def as_list(value: Any) -> Any:
    """A scalar as a one-item list, a tuple as a list, anything else as it is (for types that take
    ``x`` or ``[x, ...]``)."""
    if isinstance(value, tuple):
        return list(value)
    return value if isinstance(value, list) else [value]


def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number, got {value!r}")
    return value


# A number kept as written: an integer stays an integer (cell ids hash a config's values, so 100 and
# 100.0 must not become one another); bounds go in Field (gt=, ge=, lt=, le=).
Number = Annotated[int | float, BeforeValidator(_number), Shown("number")]


def _safe_name(name: str) -> str:
    if problem := name_problem(name, "name"):
        raise ValueError(problem)
    return name


# A name that becomes a folder name (a sweep's output folder, a run): one path component.
Name = Annotated[str, AfterValidator(_safe_name)]


def _mechanism(spec: Any) -> Any:
    name = spec if isinstance(spec, str) else spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"a mechanism is a name or {{name: ..., option: value}}, got {spec!r}")
    if name not in registry.names():
        raise ValueError(f"unknown mechanism {name!r}; valid mechanisms: {', '.join(registry.names())}")
    return spec


# A mechanism spec (posattn.mechanisms): a registered name, or a mapping of its name and options (the
# options are checked where the model is built, as they depend on its sizes).
Mechanism = Annotated[Any, AfterValidator(_mechanism), Shown("name | {name: ..., option: value}")]


def several(item: Any, shown: str) -> Any:
    """The type of a key given as one ``item`` or a non-empty list of them, read as a list."""
    return Annotated[list[item], BeforeValidator(as_list), Field(min_length=1), Shown(f"{shown} | [{shown}]")]


# ---------------------------------------------------------------------------------------------------
# Validation

def check(schema: type[BaseModel], raw: Any) -> tuple[Any, list[str]]:
    """``(config, [])`` when ``raw`` fits ``schema``, else ``(None, problems)``: one readable line per
    problem, every problem of ``raw`` at once."""
    try:
        return schema.model_validate(raw), []
    except ValidationError as e:
        return None, problem_lines(e, schema)


def fail(what: str, problems: list[str]) -> None:
    """Raise one :class:`ConfigError` listing ``problems`` of the ``what`` config (nothing if none)."""
    if problems:
        raise ConfigError(f"invalid {what}:\n  - " + "\n  - ".join(problems))


def problem_lines(error: ValidationError, schema: type[BaseModel]) -> list[str]:
    """pydantic's errors as lines ``key.path: reason``. Unknown keys come first, the top level's
    before nested ones (a misspelt key often explains the rest); those of one mapping make one line
    that names the valid keys."""
    unknown: dict[tuple, list[str]] = {}
    lines = []
    for e in error.errors(include_url=False):
        loc = e["loc"]
        if e["type"] == "extra_forbidden":
            unknown.setdefault(loc[:-1], []).append(str(loc[-1]))
        elif isinstance(e.get("ctx", {}).get("error"), Problems):
            lines += e["ctx"]["error"].lines
        else:
            lines.append(f"{key_path(loc)}: {_reason(e)}" if loc else _reason(e))
    first = [f"{key_path(parent) + ': ' if parent else ''}unknown key(s) {', '.join(keys)}; "
             f"valid keys: {', '.join(_fields_at(schema, parent))}"
             for parent, keys in sorted(unknown.items(), key=lambda item: len(item[0]))]
    return first + lines


def key_path(loc: tuple[Any, ...]) -> str:
    """``("models", 0, "layers")`` as ``models[0].layers``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def _reason(error: dict[str, Any]) -> str:
    kind, msg = error["type"], error["msg"]
    if kind == "missing":
        return "required"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == "too_short" and error.get("ctx", {}).get("min_length") == 1:
        return f"must not be empty, got {error['input']!r}"
    if kind in ("too_short", "too_long"):
        bound = "at least" if kind == "too_short" else "at most"
        count = error["ctx"]["min_length" if kind == "too_short" else "max_length"]
        return f"must have {bound} {count} item(s), got {error['input']!r}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a mapping of keys, got {error['input']!r}"
    msg = msg.replace("Input should be", "must be").replace("should have", "must have")
    if "input" in error:
        msg += f", got {error['input']!r}"
    return msg[0].lower() + msg[1:]


def _strip(annotation: Any) -> Any:
    """``annotation`` without ``Annotated`` and ``| None``."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _strip(members[0])
    return annotation


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The schema model inside ``annotation`` (itself, or the item of a list or dict), if any."""
    annotation = _strip(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (list, dict):
        return _model_in(get_args(annotation)[-1])
    return None


def _fields_at(schema: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys of the mapping at ``loc`` in ``schema`` (the top level for ``()``)."""
    annotation: Any = schema
    for part in loc:
        annotation = _strip(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            annotation = annotation.model_fields[part].annotation
        elif get_origin(annotation) in (list, dict):
            annotation = get_args(annotation)[-1]
    model = _model_in(annotation)
    return list(model.model_fields) if model else []


# ---------------------------------------------------------------------------------------------------
# Help text and documentation, generated from the schema

@dataclass(frozen=True)
class Row:
    """One key of a schema as the help text and the documentation show it."""

    key: str
    type: str
    default: str
    meaning: str
    depth: int


def inherited(key: str) -> Any:
    """``Field`` extras of a key whose default is another key's value (shown so in the documentation)."""
    return {"shown_default": f"the top-level {key}"}


def type_name(annotation: Any) -> str:
    """How a key's type is written: ``int``, ``number``, ``[int]``, ``int | [int]``, ``a | b`` for a
    choice, ``{...}`` for a mapping of keys, ``X | null``."""
    if get_origin(annotation) is Annotated:
        shown = [m for m in get_args(annotation)[1:] if isinstance(m, Shown)]
        return shown[-1].text if shown else type_name(get_args(annotation)[0])
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        members = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(members + (["null"] if type(None) in args else []))
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin is list:
        return f"[{type_name(args[0])}]"
    if origin is dict:
        return f"{{{type_name(args[0])}: {type_name(args[1])}}}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "{...}"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _default_text(field: Any) -> str:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "shown_default" in extra:
        return str(extra["shown_default"])
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default is PydanticUndefined else field.default
    if isinstance(value, BaseModel):
        return ""                       # its keys' rows give their defaults
    if isinstance(value, str):
        return value
    return json.dumps(value)


def rows(schema: type[BaseModel], prefix: str = "", depth: int = 0, seen: set | None = None) -> list[Row]:
    """Every key of ``schema``, a nested schema's keys after their parent (``training.lr``,
    ``models[].layers``); a nested schema already listed is not listed again (``task_training``
    holds the keys of ``training``)."""
    seen = {schema} if seen is None else seen
    out = []
    for name, field in schema.model_fields.items():
        key = prefix + name
        shown = [m for m in field.metadata if isinstance(m, Shown)]     # pydantic moves Annotated's extras here
        kind = shown[-1].text if shown else type_name(field.annotation)
        out.append(Row(key, kind, _default_text(field), field.description or "", depth))
        nested = _model_in(field.annotation)
        if nested is not None and nested not in seen:
            seen.add(nested)
            origin = get_origin(_strip(field.annotation))
            inner = "[]" if origin is list else ".<key>" if origin is dict else ""
            out.extend(rows(nested, f"{key}{inner}.", depth + 1, seen))
    return out


def schema_text(schema: type[BaseModel], title: str) -> str:
    """The ``--help`` text of a config: ``title``, every key (type, default, meaning) and the schema's
    docstring as notes."""
    lines = [f"{title} (YAML):"]
    for row in rows(schema):
        indent = "  " + "    " * row.depth
        name = row.key.rsplit(".", 1)[-1]
        default = {"required": " (required)", "": ""}.get(row.default, f" = {row.default}")
        lines.append(f"{indent}{name}: {row.type}{default}")
        if row.meaning:
            lines.append(textwrap.fill(row.meaning, WIDTH, initial_indent=indent + "    ",
                                       subsequent_indent=indent + "    ", break_on_hyphens=False))
    notes = inspect.cleandoc(schema.__doc__ or "")
    for paragraph in notes.split("\n\n") if notes else []:
        lines += ["", textwrap.fill(paragraph.replace("\n", " "), WIDTH, break_on_hyphens=False)]
    return "\n".join(lines)


def schema_markdown(schema: type[BaseModel]) -> str:
    """A markdown table of every key of ``schema``: key, type, default, meaning (for the documentation)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{row.key}` | `{cell(row.type)}` | {f'`{cell(row.default)}`' if row.default else ''} | "
              f"{cell(row.meaning)} |" for row in rows(schema)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# Reading configs

def builtin_configs(package: str) -> list[str]:
    """Names of the configs shipped in ``<package>/configs`` (file names without ``.yaml``)."""
    folder = resources.files(package) / "configs"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last
    silently, so a typo'd override would vanish) and reads ``1e-3`` as a number as YAML 1.2 does
    (YAML 1.1 wants ``1.0e-3`` and makes ``1e-3`` a string)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):  # config keys are strings; others are left to the schema
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError("while reading a mapping", node.start_mark,
                                                        f"key {key!r} given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def yaml_problem(error: yaml.YAMLError, text: str) -> str:
    """A YAML syntax error in ``text`` on one line: where the parser stopped (line and column, from 1),
    its short reason and what it was reading since where (PyYAML's own message spans several lines,
    quoting the text with a caret below it)."""
    def at(line: int, column: int) -> str:
        return f"line {line + 1}, column {column + 1}"

    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark, since = error.problem_mark, error.context_mark
        message = f"{at(mark.line, mark.column)}: {error.problem}"
        if error.context:
            moved = since is not None and (since.line, since.column) != (mark.line, mark.column)
            message += f" ({error.context}{f' from {at(since.line, since.column)}' if moved else ''})"
    elif isinstance(error, yaml.reader.ReaderError) and isinstance(error.character, int):   # by its offset
        line, start = text.count("\n", 0, error.position), text.rfind("\n", 0, error.position) + 1
        message = f"{at(line, error.position - start)}: character #x{error.character:04x}: {error.reason}"
    else:
        message = str(error)
    return " ".join(message.split())


def parse_yaml(text: str, where: str, *, empty: dict[str, Any] | None = None) -> dict[str, Any]:
    """The mapping a YAML text holds; ``empty`` stands for an empty text (None: an empty text is an
    error); one :class:`ConfigError` naming ``where`` otherwise, on one line (:func:`yaml_problem`)."""
    try:
        raw = yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {yaml_problem(e, text)}") from None
    if raw is None and empty is not None:
        return dict(empty)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of config keys")
    return raw


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML file holds; one :class:`ConfigError` naming the file otherwise."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a readable file ({e})") from None
    return parse_yaml(text, str(path))


def find_config(source: str | Path, package: str, what: str = "config") -> tuple[str, str, str]:
    """``(text, where, stem)`` of a YAML file path or a built-in config name of ``package``."""
    name = str(source)
    path = Path(name)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8"), str(path), path.stem
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not a readable file ({e})") from None
    stem = name.removesuffix(".yaml")
    if stem in builtin_configs(package):
        return (resources.files(package) / "configs" / f"{stem}.yaml").read_text(), stem, stem
    raise ConfigError(f"config {name!r} is neither a file nor a built-in {what}; "
                      f"built-in {what}s: {', '.join(builtin_configs(package))}")


def load_config(source: str | Path | dict | None, *, package: str, default: str) -> dict[str, Any]:
    """A raw config from a YAML path, a built-in name of ``package`` (see :func:`builtin_configs`), a dict
    or ``None`` (the built-in ``default``); a file's config is named by its stem unless it names itself.
    Problems raise :class:`ConfigError`."""
    if isinstance(source, dict):
        return dict(source)
    text, where, stem = find_config(default if source is None else source, package)
    raw = parse_yaml(text, f"config {where}")
    raw.setdefault("name", stem)
    return raw
