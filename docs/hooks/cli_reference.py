"""MkDocs hook: the CLI reference page (``reference/cli.md``), rendered from the Typer app.

The page is generated at build time from ``moelab.cli.app`` (``typer.main.get_command`` gives
the click group; each command's usage line, help text and options come from click's own
``get_usage`` / ``get_help_record``), so it always matches ``moelab COMMAND --help``. Commands
appear in the order of :data:`ORDER`; a command missing from it is appended in name order, so a
new command is documented without editing anything here.

Run as a script to print the page: ``python docs/hooks/cli_reference.py``.
"""

from __future__ import annotations

import re

ORDER = [
    "train",
    "eval",
    "analyze",
    "generate",
    "serve",
    "convert",
    "upcycle",
    "expand",
    "merge-lora",
    "prune",
    "quantize",
    "compress",
    "consolidate",
]
PAGE = "reference/cli.md"
_MD_SPECIAL = re.compile(r"[\\`*_\[\]|<>]")
_HTML = {"<": "&lt;", ">": "&gt;"}


def escape(text: str) -> str:
    """``text`` with Markdown's and HTML's special characters escaped (help texts hold
    ``runs/<name>``, ``--keep 0.5|16`` and the like)."""
    return _MD_SPECIAL.sub(lambda m: _HTML.get(m.group(0), "\\" + m.group(0)), text)


def inline(text: str) -> str:
    """Help text as Markdown: ``code`` and `code` spans kept as code, the rest escaped."""
    pieces = re.split(r"``(.+?)``|`(.+?)`", text)
    out = []
    for i, piece in enumerate(pieces):
        if piece is None:
            continue
        out.append(f"`{piece}`" if i % 3 else escape(piece))
    return "".join(out)


def _help_blocks(help_text: str) -> list[str]:
    """Markdown for a command's help: prose paragraphs, and each "Examples:" section (an
    unindented line ending in ':' followed by indented lines) as a bash code block."""
    out: list[str] = []
    paragraphs = re.split(r"\n\s*\n", help_text.strip())
    for para in paragraphs:
        lines = para.splitlines()
        head, body = lines[0], lines[1:]
        if head.rstrip().endswith(":") and body and all(ln.startswith(" ") for ln in body):
            out.append(f"**{escape(head.strip())}**")
            out.append("```bash\n" + "\n".join(ln.strip() for ln in body) + "\n```")
        else:
            out.append(inline(" ".join(ln.strip() for ln in lines)))
    return out


def _usage(command, ctx) -> str:
    usage = command.get_usage(ctx).removeprefix("Usage: ")
    return re.sub(r"\{(\w+)\}", lambda m: m.group(1).upper(), usage)


def _options_table(command, ctx) -> list[str]:
    rows = ["| option | description |", "|---|---|"]
    for param in command.params:
        if getattr(param, "hidden", False):
            continue
        record = param.get_help_record(ctx)
        if record is None:
            continue
        names, text = record
        names = re.sub(r"^(\w+) ", lambda m: m.group(1).upper() + " ", names)
        rows.append(f"| `{names}` | {inline(text)} |")
    return rows


def command_markdown(group, name: str, parent_ctx) -> str:
    """The section of one command: heading, usage, help text, options table."""
    command = group.commands[name]
    ctx = command.context_class(command, info_name=name, parent=parent_ctx)
    parts = [f"## moelab {name}", "", f"```text\n{_usage(command, ctx)}\n```", ""]
    parts += [block + "\n" for block in _help_blocks(command.help or "")]
    parts += _options_table(command, ctx)
    return "\n".join(parts) + "\n"


def render() -> str:
    """The whole CLI reference page as Markdown."""
    import typer

    from moelab.cli import app

    group = typer.main.get_command(app)
    root = group.context_class(group, info_name="moelab")
    names = [n for n in ORDER if n in group.commands]
    names += sorted(n for n in group.commands if n not in ORDER)
    parts = [
        "# CLI reference",
        "",
        "Generated from the `moelab` Typer app when the site is built: each section is what "
        "`moelab COMMAND --help` prints. `torchrun -m moelab.cli COMMAND ...` runs the same "
        "commands under `torch.distributed` (see [Scale out with torchrun]"
        "(../how-to/scale-out.md)).",
        "",
        f"```text\n{_usage(group, root)}\n```",
        "",
        escape(group.help or ""),
        "",
        *_options_table(group, root),
        "",
        "User errors (bad flags, files, config values) print one `error:` line and exit with "
        "code 2; `moelab --debug COMMAND ...` shows their tracebacks too.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for name in names:
        first = re.split(r"\n\s*\n", (group.commands[name].help or "").strip())[0]
        parts.append(f"| [`{name}`](#moelab-{name}) | {inline(' '.join(first.split()))} |")
    parts.append("")
    parts += [command_markdown(group, name, root) for name in names]
    return "\n".join(parts)


def on_files(files, config):
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    print(render())
