"""tests/docblocks.py, the docs tests' extractor: what counts as marked, run or shown."""

from __future__ import annotations

from pathlib import Path

from tests.docblocks import (
    console_steps,
    doc,
    output_contains,
    output_matches,
    python_shown_output,
    unmarked_shell_blocks,
)

PAGE = '''# A page

```bash e31-test=first
e31 ls
```

```bash
# not run by the tests: Docker Compose only
docker compose ps
```

<!-- not run by the tests: CI runs it -->
```bash
python -m pytest -q
```

<!-- e31-test=hidden -->
```bash
e31 queue
```

```bash
e31 submit --wait -- echo new
```

```console e31-test=shown
$ e31 db upgrade
store at newest revision: sqlite:///.../e31.db
$ echo a \\
  b
a b
```

```python e31-test=py
print(1 + 1)      # 2
print("x")
# x
print("y")
```

```yaml
name: not a shell block
```
'''


def test_marks_runs_and_the_unmarked(tmp_path: Path) -> None:
    path = tmp_path / "page.md"
    path.write_text(PAGE)
    page = doc(path)
    assert [b.run_name for b in page.blocks] == ["first", None, None, "hidden", None, "shown",
                                                  "py", None]
    assert page.blocks[1].not_run_reason == "Docker Compose only"
    assert page.blocks[2].not_run_reason == "CI runs it"
    # the one shell block with no mark, and only it, is reported
    assert [b.text for b in unmarked_shell_blocks([path])] == ["e31 submit --wait -- echo new\n"]


def test_console_steps_and_shown_output(tmp_path: Path) -> None:
    path = tmp_path / "page.md"
    path.write_text(PAGE)
    [block] = doc(path).run_blocks("shown")
    steps = console_steps(block)
    assert steps == [("e31 db upgrade", ["store at newest revision: sqlite:///.../e31.db"]),
                     ("echo a \\\n  b", ["a b"])]
    assert output_matches(steps[0][1], "store at newest revision: sqlite:////tmp/h/e31.db\n")
    assert not output_matches(steps[0][1], "store at revision 0007\n")
    [py] = doc(path).run_blocks("py")
    assert python_shown_output(py) == ["2", "x", "..."]
    assert output_matches(python_shown_output(py), "2\nx\nanything\n")
    assert not output_matches(python_shown_output(py), "3\nx\nanything\n")


def test_shown_lines_in_order_among_others() -> None:
    shown = ["HTTP/1.1 200 OK", "x-e31-log-size: 13", "", "hell"]
    answer = "HTTP/1.1 200 OK\r\ndate: today\r\nx-e31-log-size: 13\r\nserver: u\r\n\r\nhell"
    assert output_contains(shown, answer)
    assert not output_matches(shown, answer)                # other lines: not line for line
    assert not output_contains(shown, answer.replace("13", "14"))   # a wrong value fails
    assert not output_contains(list(reversed(shown)), answer)        # and so does another order
    assert output_contains(["workdir: sha256:72ba… …"], "workdir: sha256:72ba30 already held")
