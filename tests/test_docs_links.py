"""Every relative link of the project's markdown (README.md, docs/, benchmarks/) names a file
of the repository, resolved from the file that holds it, and every `#anchor` into a markdown
file names one of its headings (GitHub's slugs). No network: links with a scheme are left
alone. Also the size limits of issue 62: README.md within 200 lines, docs/DESIGN.md within
300, no line of either over 200 characters."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "benchmarks").rglob("*.md"))]


def _prose(text: str) -> str:
    """The text outside fenced code blocks (code may hold `](` that is no link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces ->
    dashes."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    out, seen = set(), {}
    for line in _prose(path.read_text()).splitlines():
        match = re.match(r"#{1,6} (.*)", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: pathlib.Path) -> list[str]:
    bad = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        resolved = path if not file else (path.parent / file)
        if not resolved.exists():
            bad.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            bad.append(f"{target}: no such heading")
    return bad


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    bad = broken_links(path)
    assert not bad, f"{path.relative_to(ROOT)}: broken links:\n" + "\n".join(bad)


def test_the_link_check_sees_broken_links(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.md").write_text("# A title\n## Its `part` (two)\n## Its part (two)\n")
    page = tmp_path / "sub" / "b.md"
    page.write_text("[ok](../a.md#its-part-two) [again](../a.md#its-part-two-1) "
                    "[web](https://example.com/x.md) [root-relative](sub/b.md) "
                    "[anchor](../a.md#nope)\n```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["sub/b.md: no such file", "../a.md#nope: no such heading"]


@pytest.mark.parametrize("name,most_lines", [("README.md", 200), ("docs/DESIGN.md", 300)])
def test_sizes(name, most_lines):
    lines = (ROOT / name).read_text().splitlines()
    assert len(lines) <= most_lines, f"{name}: {len(lines)} lines (at most {most_lines})"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 200]
    assert not long, f"{name}: lines over 200 characters: {long}"
