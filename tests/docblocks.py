"""The fenced blocks of the docs (README.md, docs/**/*.md) that tests run, and how they are marked.

A page marks each shell block (```bash, ```sh, ```console, ```shell) one of two ways:

- **run by a test**: its info string carries `e31-test`, optionally with a name that groups
  the blocks one test step runs: ```` ```bash e31-test=drain ````. GitHub and other
  renderers use only the first word of an info string, so the mark does not show;
- **not run by the tests**: its first line is a visible comment saying why, e.g.
  `# not run by the tests: Docker Compose only`.

Where a line may not be added to a block (the README's test command, which CI runs
verbatim), an HTML comment right before the fence marks it the same way, unseen:
`<!-- not run by the tests: CI runs it -->` or `<!-- e31-test=name -->`.

A shell block with neither mark fails tests/e2e/test_docs.py, so a new command cannot slip
into the docs untested and unsaid. Other blocks (yaml, python, sql...) may carry `e31-test`
too, for a test that reads them.

API (for a page's own test, e.g. a runbook's in tests/e2e/test_runbooks.py):

    page = doc("docs/runbooks/drain-a-worker.md")
    for block in page.run_blocks("drain"):       # in page order; name=None: all e31-test blocks
        result = run_block(block, env=stack_env, cwd=tmp_path)   # bash -eo pipefail
        assert result.returncode == 0, result.output
    console = page.run_blocks("upgrade")[0]      # ```console e31-test=upgrade
    for command, shown in console_steps(console):
        output = run_command(command, env=..., cwd=...).output
        assert output_matches(shown, output)     # "..." in a shown line matches any text
        assert output_contains(shown, output)    # the same, with other lines among them

`unmarked_shell_blocks(paths)` lists the blocks with no mark.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from markdown_it import MarkdownIt

ROOT = Path(__file__).parents[1]
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
RUN_TAG = "e31-test"
NOT_RUN = re.compile(r"^#\s*not run by the tests:\s*(?P<why>\S.*)$", re.IGNORECASE)
HTML_MARK = re.compile(r"^<!--\s*(?:(?P<run>e31-test(?:=\S+)?)"
                       r"|not run by the tests:\s*(?P<why>.+?))\s*-->$", re.IGNORECASE | re.DOTALL)
PROMPT = "$ "
ELLIPSIS = "..."


@dataclass(frozen=True)
class Block:
    path: Path          # relative to the repository's root
    line: int           # 1-based line of the opening fence
    lang: str           # the info string's first word
    tags: tuple[str, ...]
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def run_name(self) -> str | None:
        """"" for a plain `e31-test`, the name of `e31-test=NAME`, None if not run."""
        for tag in self.tags:
            if tag == RUN_TAG:
                return ""
            if tag.startswith(RUN_TAG + "="):
                return tag.partition("=")[2]
        return None

    @property
    def not_run_reason(self) -> str | None:
        first = self.text.lstrip("\n").partition("\n")[0].strip()
        m = NOT_RUN.match(first)
        return m.group("why") if m else None

    @property
    def is_shell(self) -> bool:
        return self.lang in SHELL_LANGS


@dataclass(frozen=True)
class Page:
    path: Path
    blocks: tuple[Block, ...]

    def run_blocks(self, name: str | None = None) -> list[Block]:
        """The blocks marked `e31-test` (`name`: only those marked `e31-test=name`)."""
        found = [b for b in self.blocks
                 if b.run_name is not None and (name is None or b.run_name == name)]
        assert found, f"{self.path}: no block marked {RUN_TAG}{'=' + name if name else ''}"
        return found


@cache
def doc(path: str | Path) -> Page:
    """The fenced blocks of one page (relative to the repository's root, or absolute)."""
    full = Path(path) if Path(path).is_absolute() else ROOT / path
    shown = full.relative_to(ROOT) if full.is_relative_to(ROOT) else full
    tokens = MarkdownIt("commonmark").parse(full.read_text())
    blocks = []
    for i, t in enumerate(tokens):
        if t.type != "fence":
            continue
        words = t.info.split()
        tags, text = tuple(words[1:]), t.content
        before = tokens[i - 1] if i else None
        comment = (HTML_MARK.match(before.content.strip())
                   if before is not None and before.type == "html_block" else None)
        if comment and comment.group("run"):
            tags += (comment.group("run"),)
        elif comment:
            text = f"# not run by the tests: {comment.group('why')}\n{text}"
        blocks.append(Block(path=shown, line=(t.map[0] + 1) if t.map else 0,
                            lang=words[0] if words else "", tags=tags, text=text))
    return Page(shown, tuple(blocks))


def doc_paths() -> list[Path]:
    """README.md and every page under docs/, relative to the repository's root."""
    return [Path("README.md"), *sorted(p.relative_to(ROOT) for p in (ROOT / "docs").rglob("*.md"))]


def unmarked_shell_blocks(paths: Iterable[str | Path]) -> list[Block]:
    return [b for p in paths for b in doc(p).blocks
            if b.is_shell and b.run_name is None and b.not_run_reason is None]


@dataclass(frozen=True)
class Ran:
    returncode: int
    output: str         # stdout and stderr, interleaved as a terminal shows them


def run_command(script: str, *, env: Mapping[str, str], cwd: Path,
                timeout_s: float = 180) -> Ran:
    """`script` under `bash -eo pipefail` (a failing line stops it), as a reader pastes it."""
    proc = subprocess.run(["bash", "-eo", "pipefail", "-c", script], env=dict(env), cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout_s)
    return Ran(proc.returncode, proc.stdout)


def run_block(block: Block, *, env: Mapping[str, str], cwd: Path, timeout_s: float = 180) -> Ran:
    """Run a bash block as written; a console block's `$ ` commands in order (see
    `console_steps` to compare their output)."""
    if block.lang == "console":
        script = "\n".join(command for command, _ in console_steps(block))
    else:
        script = block.text
    return run_command(script, env=env, cwd=cwd, timeout_s=timeout_s)


def console_steps(block: Block) -> list[tuple[str, list[str]]]:
    """A console block's commands (the lines after `$ `, with `\\` continuations) and the
    output lines shown under each."""
    steps: list[tuple[str, list[str]]] = []
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(PROMPT):
            command = line[len(PROMPT):]
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command + "\n" + lines[i]
            steps.append((command, []))
        elif steps:
            steps[-1][1].append(line)
        i += 1
    return steps


def output_matches(shown: list[str], output: str) -> bool:
    """Whether `output` is what the page shows: line for line (blank lines aside), where
    `...` or `…` in a shown line stands for any text (a whole shown line `...`: any number
    of lines)."""
    shown = [line.replace("…", ELLIPSIS) for line in shown]
    pattern = "\n".join(".*?" if line.strip() == ELLIPSIS else
                        ".*?".join(re.escape(part) for part in line.rstrip().split(ELLIPSIS))
                        for line in shown if line.strip())
    got = "\n".join(line.rstrip() for line in output.splitlines() if line.strip())
    return re.fullmatch(pattern, got, flags=re.DOTALL) is not None


def _line_pattern(line: str) -> str:
    return ".*?".join(re.escape(part) for part in line.replace("…", ELLIPSIS).rstrip()
                      .split(ELLIPSIS))


def output_contains(shown: list[str], output: str) -> bool:
    """Whether the shown lines are in `output` in their order (`...` as in `output_matches`),
    other lines allowed before, between and after them: a progress bar on stderr, the
    headers a page leaves out."""
    got = [line.rstrip() for line in output.splitlines() if line.strip()]
    i = 0
    for line in shown:
        if not line.strip() or line.strip() in (ELLIPSIS, "…"):
            continue
        pattern = _line_pattern(line)
        while i < len(got) and not re.fullmatch(pattern, got[i]):
            i += 1
        if i == len(got):
            return False
        i += 1
    return True


def python_shown_output(block: Block) -> list[str]:
    """What a Python block shows its prints print: a print's trailing `# comment`, or the
    `# ` comment lines right under it; a print with neither shows `...` (anything)."""
    shown: list[str] = []
    lines = block.text.splitlines()
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("print("):
            continue
        code, sep, comment = line.partition("  # ")
        under = []
        for nxt in lines[i + 1:]:
            if not nxt.startswith("# "):
                break
            under.append(nxt[2:])
        if sep:
            shown.append(comment.strip())
        elif under:
            shown.extend(under)
        else:
            shown.append(ELLIPSIS)
    return shown
