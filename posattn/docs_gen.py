"""The documentation's generated pages, built from the code at every ``mkdocs build`` (docs/hooks.py).

- :func:`mechanism_reference`: every registered mechanism (:mod:`posattn.mechanisms.registry`) with its
  docstring, equation, paper, options (type and default from the constructor's signature, meaning from
  the class docstring's ``Options:`` section) and the properties computed from the built module;
- :func:`cli_reference`: every ``posattn`` command and sub-command from the argparse parsers of
  :func:`posattn.cli.parser`: usage, description, options with defaults and help, and the files each
  command writes (declared beside its parser as ``parser.set_defaults(writes={path: meaning})``);
- :func:`results_pages`: one page per recipe of the results store (``results/``), the text of
  ``posattn report RECIPE --markdown``, with the plots it links (PNG, rendered at build time);
- :func:`examples_page`: every script of ``examples/`` with its docstring; the changelog, the
  licence and the citation metadata from the repository's own files.

Nothing here is written by hand about a mechanism, an option or a command: a new mechanism or option
appears in the reference as soon as it is registered. Options are documented in the class docstring::

    Options:
        kernel_size: the window 2k + 1 (odd); offsets beyond ±k share the edge weight.
        depthwise: True: one filter per channel; False: one filter shared by all channels
            (continuation lines are indented further).

(``Args:`` is read the same way, and an option may carry a type in brackets, ``name (int): ...``.)
"""
from __future__ import annotations

import argparse
import ast
import inspect
import re
import typing
from pathlib import Path
from typing import Any

import torch

from .mechanisms import COST_CLASSES, Context, Dims, Mechanism, build, properties
from .mechanisms.registry import REGISTRY

# The sizes at which the reference counts positional parameters: those of `posattn mechanisms`' defaults
# (BERT-base), and a small model for the learned structures.
REFERENCE_DIMS = Dims(d_model=768, n_heads=12, n_layers=12, max_len=512, n_segments=2, causal=False)
SMALL_DIMS = Dims(d_model=64, n_heads=4, n_layers=1, max_len=32, n_segments=2, causal=False)
STRUCTURE_LENGTH = 16
SECTION = re.compile(r"^(\s*)(Options|Args|Arguments|Parameters):\s*$")
ENTRY = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj):`~?\.?([^`]+)`")


# -- docstrings ---------------------------------------------------------------------------------------
def own_docstring(cls: type) -> str:
    """The class's own docstring (not inherited), dedented; empty when it has none."""
    doc = cls.__dict__.get("__doc__")
    return inspect.cleandoc(doc) if doc else ""


def split_options(doc: str) -> tuple[str, dict[str, str]]:
    """A docstring's text without its ``Options:`` (or ``Args:``) section, and that section as
    option name -> description (continuation lines joined)."""
    lines = doc.splitlines()
    text: list[str] = []
    options: dict[str, str] = {}
    i = 0
    while i < len(lines):
        m = SECTION.match(lines[i])
        if not m:
            text.append(lines[i])
            i += 1
            continue
        indent, current, entry_indent = len(m.group(1)), None, 0
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            line = lines[i].strip()
            entry = ENTRY.match(line)
            deeper = current is not None and len(lines[i]) - len(lines[i].lstrip()) > entry_indent
            if entry and not deeper:
                current, entry_indent = entry.group(1), len(lines[i]) - len(lines[i].lstrip())
                options[current] = entry.group(2)
            elif line and current is not None:
                options[current] += " " + line
            i += 1
    return "\n".join(text).strip(), {k: v.strip() for k, v in options.items()}


def markdown_text(doc: str) -> str:
    """Docstring text as Markdown: Sphinx roles become code spans, ``::`` literal markers colons."""
    return ROLE.sub(r"`\1`", doc).replace("::\n", ":\n")


# -- mechanisms ---------------------------------------------------------------------------------------
def _type_text(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("|", "\\|")


def _annotation(func: Any, annotation: Any) -> Any:
    """A string annotation (``from __future__ import annotations``) evaluated where the function was
    defined, so that aliases such as ``Sharing`` show their ``Literal`` values; the string itself
    where it names something that module imports only for type checking."""
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, func.__globals__)  # noqa: S307 - the package's own annotations
    except NameError:
        return annotation


def mechanism_options(cls: type[Mechanism]) -> list[dict[str, str]]:
    """Each constructor option of a mechanism: name, type, default and meaning (from its docstring)."""
    described = split_options(own_docstring(cls))[1]
    rows = []
    for name in cls.option_names():
        param = inspect.signature(cls.__init__).parameters[name]
        default = "required" if param.default is inspect.Parameter.empty else repr(param.default)
        rows.append({"name": name, "type": _type_text(_annotation(cls.__init__, param.annotation)),
                     "default": default, "meaning": described.get(name, "")})
    return rows


def _structures(name: str) -> list[str]:
    """The learned position structures a mechanism exposes to the analyses (kind and label), built small."""
    built = build([name], SMALL_DIMS)
    mechs = built.input or built.layers[0]
    n = STRUCTURE_LENGTH
    ctx = Context(positions=torch.arange(n)[None], segments=torch.zeros(1, n, dtype=torch.long), keep=None,
                  causal=False)
    return [f"{s.kind} (`{s.label}`, shape {list(s.data.shape)})" for m in mechs for s in m.position_structures(n, ctx)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def mechanism_reference() -> str:
    """The mechanism reference page (Markdown): a summary table, then one section per mechanism."""
    rows = {name: properties(name, REFERENCE_DIMS) for name in REGISTRY}
    out = ["# Mechanisms", "",
           "Generated from the registry (`posattn.mechanisms.registry`) at every build of this site: each "
           "mechanism's docstring, equation and paper, its options (type and default from its constructor, "
           "meaning from its docstring) and the properties computed from the built module. `posattn "
           "mechanisms` prints the same properties for any model size. Notation: s_ij = q_i·k_j/√d_h + "
           "position terms, r = j − i.", "",
           "Give mechanisms to a model as a list of names or dicts: `mechanisms=[\"cat\", {\"name\": \"tisa\", "
           "\"n_kernels\": 3}]`; options are the dict's other keys.", "",
           "| name | acts on | cost class | inductive | translation invariant | decoder | paper |",
           "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        out.append(f"| [`{name}`](#{name}) | {', '.join(r['acts_on']) or '–'} | {REGISTRY[name].cost_class} | "
                   f"{_yes(r['inductive'])} | {_yes(r['translation_invariant'])} | {_yes(r['decoder'])} | "
                   f"{_cell(r['paper'])} |")
    for name, cls in REGISTRY.items():
        out += ["", *mechanism_section(name, cls, rows[name])]
    out += ["", "## Cost classes", "",
            "What the attention layer computes for a mechanism on top of plain softmax attention "
            "(`posattn.mechanisms.COST_CLASSES`; the benchmarks' targets are set per class).", "",
            "| cost class | meaning |", "|---|---|",
            *[f"| `{k}` | {_cell(v)} |" for k, v in COST_CLASSES.items()]]
    return "\n".join(out) + "\n"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def mechanism_section(name: str, cls: type[Mechanism], props: dict[str, Any]) -> list[str]:
    """One mechanism's section of the reference."""
    text, _ = split_options(own_docstring(cls))
    module = inspect.getmodule(cls)
    out = [f"## `{name}` {{#{name}}}", "",
           f"`{cls.__module__}.{cls.__qualname__}` · {props['paper']}", "",
           "```text", cls.equation or "(no equation)", "```", ""]
    if text:
        out += [markdown_text(text), ""]
    options = mechanism_options(cls)
    if options:
        out += ["| option | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{o['name']}` | {o['type']} | `{_cell(o['default'])}` | {_cell(o['meaning'])} |" for o in options]
    else:
        out.append("No options.")
    structures = _structures(name)
    scalings = ", ".join(f"`{k}`" for k in cls.length_scalings) or "none"
    out += ["", "Computed properties:", "",
            f"- acts on: {', '.join(props['acts_on']) or 'nothing (no position)'}; placement: "
            f"{cls.placement_for({})}; replaces softmax attention (a mixer): {_yes(cls.mixes)}",
            f"- inductive: {_yes(props['inductive'])}; translation invariant: "
            f"{_yes(props['translation_invariant'])}; runs in a decoder: {_yes(props['decoder'])}",
            f"- cost class: `{cls.cost_class}` ({COST_CLASSES[cls.cost_class]})",
            f"- positional parameters at d_model 768, 12 heads, 12 layers, max_len 512: "
            f"{props['positional_params']:,}",
            f"- length rescalings (`length_scaled`): {scalings}",
            f"- learned position structures (what `posattn analyze kernels` plots; shapes at d_model "
            f"{SMALL_DIMS.d_model}, {SMALL_DIMS.n_heads} heads, n = {STRUCTURE_LENGTH}): "
            f"{'; '.join(structures) or 'none'}"]
    if module is not None and module.__doc__:
        body = "\n".join("    " + line if line.strip() else "" for line in
                         markdown_text(inspect.cleandoc(module.__doc__)).splitlines())
        out += ["", f'??? note "Module `{module.__name__}`"', "", body]
    return out


# -- the command line ---------------------------------------------------------------------------------
def commands(parser: argparse.ArgumentParser, prefix: str = "posattn") -> list[tuple[str, argparse.ArgumentParser]]:
    """Every (full command name, parser) under ``parser``, depth first, the parser itself first."""
    out = [(prefix, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += commands(sub, f"{prefix} {name}")
    return out


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            metavar = formatter._format_args(action, action.dest.upper()) if action.nargs != 0 else ""
            flags = ", ".join(f"{s} {metavar}".strip() for s in action.option_strings)
        else:
            flags = formatter._metavar_formatter(action, action.dest)(1)[0]
        help_text = formatter._expand_help(action) if action.help else ""
        default = "" if action.default in (None, argparse.SUPPRESS, False) or action.nargs == 0 \
            else repr(action.default)
        choices = ", ".join(map(str, action.choices)) if action.choices and not isinstance(action.choices, dict) \
            else ""
        rows.append(f"| `{_cell(flags)}` | {_cell(help_text)}{'; one of: ' + _cell(choices) if choices else ''} | "
                    f"{'`' + _cell(default) + '`' if default else ''} |")
    return rows


def _takes(parser: argparse.ArgumentParser, option: str) -> bool:
    return any(option in a.option_strings for a in parser._actions)


def cli_reference() -> str:
    """The command-line reference page (Markdown), from :func:`posattn.cli.parser`."""
    from .cli import parser

    out = ["# Command line", "",
           "Generated from the argparse parsers of `posattn.cli` at every build of this site; `posattn "
           "COMMAND --help` prints the same options. Each command that writes files lists them, as "
           "declared beside its parser."]
    for name, p in commands(parser()):
        depth = name.count(" ")
        out += ["", f"{'#' * min(depth + 1, 4)} `{name}` {{#{name.replace(' ', '-')}}}", ""]
        if p.description:
            out += ["```text", p.description.strip(), "```", ""]
        out += ["```text", p.format_usage().strip(), "```", ""]
        rows = _option_rows(p)
        if rows:
            out += ["| option | meaning | default |", "|---|---|---|", *rows]
        writes = p.get_default("writes")
        if writes:
            out += ["", "Files it writes (`OUT`: the `--out` folder):" if _takes(p, "--out") else "Files it writes:",
                    "", "| file | what it holds |", "|---|---|",
                    *[f"| `{_cell(path)}` | {_cell(meaning)} |" for path, meaning in writes.items()]]
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        for action in subs:
            helps = {c.dest: c.help for c in action._choices_actions}
            out += ["", "| command | what it does |", "|---|---|"]
            out += [f"| [`{name} {c}`](#{name.replace(' ', '-')}-{c}) | {_cell(helps.get(c) or '')} |"
                    for c in action.choices]
        if p.epilog:
            out += ["", "```text", p.epilog.strip(), "```"]
    return "\n".join(out) + "\n"


# -- results ------------------------------------------------------------------------------------------
def results_pages(root: str | None = None, figures: dict[str, bytes] | None = None) -> dict[str, str]:
    """recipe -> its page: the text of ``posattn report RECIPE --markdown`` (nothing is written in the
    repository). The report is built in a temporary folder; a plot its text links
    (``![...](NAME.png)``) is added to ``figures`` as ``results/<recipe>/NAME.png`` and the link
    rewritten to it."""
    import tempfile

    from .experiments import store
    from .experiments.report import build as build_report

    pages = {}
    for recipe in store.recipes(root):
        got, text = build_report(recipe, root)
        if FIGURE_LINK.search(text):   # built again, with its plots, only where the page shows them
            with tempfile.TemporaryDirectory() as tmp:
                got, text = build_report(recipe, root, out=tmp)
                for name in dict.fromkeys(FIGURE_LINK.findall(text)):
                    if (Path(tmp) / name).is_file():
                        if figures is not None:
                            figures[f"results/{recipe}/{name}"] = (Path(tmp) / name).read_bytes()
                        text = text.replace(f"]({name})", f"]({recipe}/{name})")
        pages[recipe] = (f"{text.rstrip()}\n\n---\n\nGenerated from `results/{recipe}/` with "
                         f"`posattn report {recipe} --markdown` ({got.counts()}).\n")
    return pages


FIGURE_LINK = re.compile(r"!\[[^\]]*\]\(([\w.-]+\.png)\)")   # an image a report links beside itself


def results_index(pages: dict[str, str]) -> str:
    """The results section's front page: every recipe with its title."""
    out = ["# Results", "",
           "Every table on these pages is generated at build time from the results store (`results/`, one "
           "record per finished cell, or a measured table's summary data, each with its date, hardware and "
           "command) by `posattn report RECIPE --markdown`. [Experiments](../experiments.md) explains the "
           "store and how to add to it.", "", "| recipe | report |", "|---|---|"]
    for recipe, text in pages.items():
        title = next((line[2:] for line in text.splitlines() if line.startswith("# ")), recipe)
        out.append(f"| [`{recipe}`]({recipe}.md) | {_cell(title)} |")
    return "\n".join(out) + "\n"


# -- examples and the project's own files -------------------------------------------------------------
def examples_page(root: str | Path) -> str:
    """Every script of ``root/examples`` with its module docstring (what it shows, how to run it)."""
    out = ["# Examples", "",
           "Short scripts in `examples/` that use the public Python API, each runnable as it is and with "
           "`--tiny` in seconds (the test suite runs every one that way). This page is generated from their "
           "docstrings."]
    for path in sorted(Path(root, "examples").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if not doc:
            raise ValueError(f"{path}: an example needs a module docstring")
        first, _, rest = doc.partition("\n\n")
        out += ["", f"## `examples/{path.name}`", "", markdown_text(first.replace("\n", " ")), "",
                *_docstring_blocks(rest)]
    return "\n".join(out) + "\n"


def _docstring_blocks(text: str) -> list[str]:
    """Docstring paragraphs as Markdown: indented blocks (commands) become fenced bash blocks."""
    out = []
    for block in text.split("\n\n"):
        lines = block.splitlines()
        if lines and all(line.startswith("    ") for line in lines if line.strip()):
            out += ["```bash", *(line[4:] for line in lines), "```", ""]
        elif block.strip():
            out += [markdown_text(block.replace("\n", " ")), ""]
    return out


def license_page(root: str | Path) -> str:
    """How to cite posattn (``CITATION.cff``) and its licence (``LICENSE``), as they are in the repository."""
    return "\n".join(["# Citing and licence", "",
                      "To cite posattn, use the metadata of `CITATION.cff` (GitHub's \"Cite this repository\" "
                      "and `cffconvert` read it):", "", "```yaml", Path(root, "CITATION.cff").read_text().strip(),
                      "```", "", "posattn is released under the MIT licence (`LICENSE`):", "", "```text",
                      Path(root, "LICENSE").read_text().strip(), "```"]) + "\n"


def config_reference() -> str:
    """The config reference page (Markdown): every key of every config kind, from its schema
    (:data:`posattn.experiments.schemas.CONFIG_SCHEMAS`)."""
    from posattn.experiments.config import schema_markdown
    from posattn.experiments.schemas import CONFIG_SCHEMAS

    lines = ["# Config files", "",
             "Every key each command's YAML config accepts, generated from the config schemas. A config is "
             "checked whole before anything runs: every problem is listed in one error, unknown keys with "
             "the valid ones.", ""]
    for command, schema in CONFIG_SCHEMAS.items():
        lines += [f"## `posattn {command}`", "", schema_markdown(schema), ""]
    return "\n".join(lines)


def pages(results_root: str | None = None, root: str | Path | None = None) -> dict[str, str | bytes]:
    """Every generated file: path under docs/ -> Markdown (or a results page's PNG plot). ``root``:
    the repository (examples, CHANGELOG.md, CITATION.cff, LICENSE); default: the one this package is in."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[1]
    figures: dict[str, bytes] = {}
    results = results_pages(results_root, figures)
    return {"reference/mechanisms.md": mechanism_reference(), "reference/cli.md": cli_reference(),
            "reference/configs.md": config_reference(),
            "results/index.md": results_index(results),
            **{f"results/{recipe}.md": text for recipe, text in results.items()}, **figures,
            "examples.md": examples_page(root), "citing.md": license_page(root),
            "changelog.md": Path(root, "CHANGELOG.md").read_text()}
