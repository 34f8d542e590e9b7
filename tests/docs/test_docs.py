"""The front door stays true to the code.

Every command of README.md and docs/tutorial.md (the ``$ sim ...`` lines of their
``console`` blocks) is run, in order, in a fresh folder, as a user runs it (a new
process, stdout and stderr together), and its output compared with what the page
shows: line for line, where ``...`` on a line of its own stands for any lines, after
leaving out only what varies from run to run (the timings of ``sim run``'s last line,
and the progress lines printed every 10 wall seconds). The policy table of
docs/policies.md is built from the registry (docs/hooks.py) and must name every
policy and knob; the site builds with warnings as errors where MkDocs is installed.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from policies import POLICIES, knob_docs

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "tutorial.md"]

# What varies between runs of the same command, and nothing else.
TIMINGS = re.compile(r"simulated in [\d.,]+ s, [\d.,]+ s in all")
PROGRESS = re.compile(r"^simulated [\d,.]+ s: [\d,]+/[\d,]+ requests done, [\d,.]+ requests per wall second$")


def console_blocks(page: Path) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) of every ``$ sim`` line in the page's console blocks."""
    commands: list[tuple[str, list[str]]] = []
    for block in re.findall(r"^```console\n(.*?)^```$", page.read_text(), re.S | re.M):
        for line in block.splitlines():
            if line.startswith("$ "):
                commands.append((line[2:], []))
            else:
                assert commands, f"{page.name}: output before any command in a console block"
                commands[-1][1].append(line)
    return commands


def normalize(lines: list[str]) -> list[str]:
    return [TIMINGS.sub("simulated in <s> s, <s> s in all", line) for line in lines if not PROGRESS.match(line)]


def shows(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` is what ``expected`` shows, ``...`` lines standing for any lines."""
    pattern = "".join(r"(?:.*\n)*?" if line == "..." else re.escape(line) + r"\n" for line in expected)
    return re.fullmatch(pattern, "".join(line + "\n" for line in actual)) is not None


def run(command: str, cwd: Path) -> tuple[int, list[str]]:
    argv = shlex.split(command)
    assert argv[0] == "sim", f"only sim commands are run: {command}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}            # this checkout's code, whatever is installed
    done = subprocess.run([sys.executable, "-m", "sim.cli", *argv[1:]], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    return done.returncode, done.stdout.splitlines()


def test_console_blocks_parse_and_hold_commands() -> None:
    # Not a check of nothing: both pages show commands, and "..." only ever elides lines.
    for page in PAGES:
        commands = console_blocks(page)
        assert len(commands) >= 2, page
        assert all(lines for _, lines in commands), page
    assert shows(["a", "...", "d"], ["a", "b", "c", "d"]) and shows(["a", "...", "b"], ["a", "b"])
    assert not shows(["a", "...", "d"], ["a", "b", "c"]) and not shows(["a"], ["a", "b"])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_prints_what_the_page_shows(page: Path, tmp_path: Path) -> None:
    (tmp_path / "workloads").symlink_to(ROOT / "workloads")   # the commands name workloads/...
    for command, expected in console_blocks(page):
        code, actual = run(command, tmp_path)
        expected_code = 2 if expected[0].startswith("error:") else 0
        assert code == expected_code, f"{page.name}: `{command}` exited {code}:\n" + "\n".join(actual)
        want, got = normalize(expected), normalize(actual)
        assert shows(want, got), (f"{page.name}: `{command}` printed what the page does not show:\n"
                                  + "\n".join(difflib.unified_diff(want, got, "page", "printed", lineterm="")))


def load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_policy_table_names_every_kind_and_knob() -> None:
    hooks = load_hooks()
    page = (ROOT / "docs" / "policies.md").read_text()
    assert page.count(hooks.MARKER) == 1, "docs/policies.md lost the marker its policy table is built at"
    rendered = hooks.on_page_markdown(page, None, None, None)
    table = rendered.split("## Server fields under each engine")[0]       # the server fields' table follows
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", table, re.M)}
    assert list(rows) == list(POLICIES)
    for kind in POLICIES:
        missing = [name for name, _, _ in knob_docs(kind) if f"`{name}` (" not in rows[kind]]
        assert not missing, f"{kind}'s row does not name {missing}"
    # vllm_v1's first paragraph and one knob with its default, as the page shows them
    assert "| `vllm_v1` | vLLM v1 (the engine of today's vLLM): one token budget, running requests first. |" \
        in rendered
    assert "`max_queue_delay_s` (0.1): a batch launches once its oldest request waited" in rows["dynamic"]


def test_the_server_fields_table_names_each_engines_own_knob() -> None:
    # Built from the policies' server_knobs: a field a policy reads says so, one it does not
    # names the policy's own knob or says it has none.
    hooks = load_hooks()
    page = (ROOT / "docs" / "policies.md").read_text()
    assert page.count(hooks.SERVER_MARKER) == 1, "docs/policies.md lost the marker of its server fields table"
    rendered = hooks.on_page_markdown(page, None, None, None)
    table = rendered.split("## Server fields under each engine")[1].split("\n## ")[0]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", table, re.M)}
    assert list(rows) == list(POLICIES)
    assert rows["vllm"].count("| read") == 5                    # every server field, the watermark too
    assert "refused: `policy.page_size`" in rows["sglang"] and "refused: `policy.mem_fraction_static`" in rows["sglang"]
    assert "refused: `policy.tokens_per_block`" in rows["tensorrt_llm"]
    assert "refused: `policy.cache_max_entry_count`" in rows["lmdeploy"]
    assert "refused: `policy.attention`" in rows["tgi"] and "refused: none (TGI's pool" in rows["tgi"]
    assert "refused: `policy.watermark`" in rows["vllm_v1"] and "refused: none" in rows["orca"]


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("MkDocs is not installed (pip install -e '.[docs]'); CI builds the site in .ci/run")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    html = (tmp_path / "site" / "policies" / "index.html").read_text()
    for kind in POLICIES:
        assert f"<code>{kind}</code>" in html, kind
    assert (tmp_path / "site" / "tutorial" / "index.html").is_file()
