"""The README and the documentation site hold together: every relative link in
`README.md`, `docs/*.md` and `tests/README.md` points at a file that exists (and, for a
Markdown target with `#anchor`, at a heading it has), every page is in the site's nav,
and the README stays a front page (its sections, in order: README_SECTIONS). No services, no Markdown library:
headings are turned into anchors the way Python-Markdown's `toc` extension (MkDocs) does.
`mkdocs build --strict` in tools/test.sh checks the built site on top of this."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# The README is the front page: these sections, in this order, whatever their length
# (what the project is comes before the first of them).
README_SECTIONS = ["The two commands", "Your own Kafka and Redis", "Measured numbers", "Documentation"]

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXPLICIT_ID = re.compile(r"\{\s*#([\w-]+)[^}]*\}\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def slugify(text: str) -> str:
    """Python-Markdown's toc slug of a heading's text (markup already removed)."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def heading_text(raw: str) -> str:
    """The text a heading renders to: code spans keep their content, links their text,
    emphasis markers go (an underscore inside a word is not one)."""
    parts = INLINE_CODE.split(raw)  # [text, ticks, code, text, ticks, code, ...]
    out = []
    for i in range(0, len(parts), 3):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", parts[i])
        text = re.sub(r"\*{1,3}(\S.*?\S|\S)\*{1,3}", r"\1", text)
        text = re.sub(r"(?<!\w)_{1,3}(\S.*?\S|\S)_{1,3}(?!\w)", r"\1", text)
        out.append(text)
        if i + 2 < len(parts):
            out.append(parts[i + 2])
    return "".join(out)


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path):
        m = HEADING.match(line)
        if not m:
            continue
        text = m.group(2)
        explicit = EXPLICIT_ID.search(text)
        if explicit:
            found.add(explicit.group(1))
            continue
        slug = slugify(heading_text(text))
        if slug in seen:  # toc makes duplicates unique: slug, slug_1, slug_2, ...
            seen[slug] += 1
            found.add(f"{slug}_{seen[slug]}")
        else:
            seen[slug] = 0
            found.add(slug)
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    links = []
    for n, line in prose_lines(path):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
                continue  # http:, https:, mailto: ... are not files of this repository
            links.append((n, target))
    return links


def broken_links(path: Path) -> list[str]:
    problems = []
    for n, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{n}: {target}"
        if target.startswith("/"):
            problems.append(f"{where} (absolute path: use a relative link)")
        elif not dest.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where} (no heading with anchor #{anchor} in {dest.relative_to(ROOT)})")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert path.exists()
    assert broken_links(path) == []


def test_the_link_check_finds_a_broken_link_and_a_broken_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# Some `code` heading\n\n## Tenants: fair share\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#some-code-heading) [ok](b.md#tenants-fair-share) [ok](#here)\n"
                    "## Here\n"
                    "[file](missing.md) [anchor](b.md#nope) `[code](missing.md)`\n"
                    "```\n[fenced](missing.md)\n```\n[web](https://example.org/x.md)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        problems = broken_links(page)
    finally:
        ROOT = saved
    assert problems == ["a.md:3: missing.md (no such file)",
                        "a.md:3: b.md#nope (no heading with anchor #nope in b.md)"]


def test_slugs_match_python_markdown_toc():
    assert slugify(heading_text("Preflight: `inflight check`")) == "preflight-inflight-check"
    assert slugify(heading_text("What `bench_e2e` and `bench_pipeline` measure")) == \
        "what-bench_e2e-and-bench_pipeline-measure"
    assert slugify(heading_text("Settings (`gateway` section)")) == "settings-gateway-section"


def readme_sections(text: str) -> dict[str, str]:
    """{`## ` heading: its body}, in order; the text before the first under ""."""
    sections, name = {"": []}, ""
    for line in text.splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
            sections[name] = []
        else:
            sections[name].append(line)
    return {k: "\n".join(v) for k, v in sections.items()}


def test_readme_is_a_front_page():
    """What it is, the two commands, your own Kafka and Redis, the measured numbers and the
    docs map, in that order (its length is its own business)."""
    sections = readme_sections((ROOT / "README.md").read_text(encoding="utf-8"))
    names = [n for n in sections if n in README_SECTIONS]
    assert names == README_SECTIONS, list(sections)
    assert "Kafka" in sections[""] and "Redis" in sections[""]  # what it is, before anything else
    commands = sections["The two commands"]
    assert "tools/demo.sh" in commands and "tools/test.sh" in commands and ".ci/run" in commands
    assert "inflight worker --config" in sections["Your own Kafka and Redis"]
    assert re.search(r"\d+(\.\d+)?\s*(×|x|tok/s|ms|s\b)", sections["Measured numbers"])  # numbers, not promises
    assert "docs/" in sections["Documentation"]


def test_the_readme_check_finds_a_missing_section():
    assert list(readme_sections("intro\n## The two commands\nx\n## Documentation\ny")) == [
        "", "The two commands", "Documentation"]


def nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        if isinstance(item, str):
            pages.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                pages.extend(nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    docs = ROOT / config.get("docs_dir", "docs")
    listed = set(nav_pages(config["nav"]))
    present = {p.relative_to(docs).as_posix() for p in docs.rglob("*.md")}
    assert listed == present
