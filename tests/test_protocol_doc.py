"""docs/protocol.md reads as a reference a stranger can write a peer from: every section is in
the table of contents, every link inside it lands, it names no path of a development machine,
no issue and no proposal, and what the code and the other documents cite of it exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .conftest import REPO

DOC = REPO / "docs" / "protocol.md"
#: where citations of protocol.md live (comments, docstrings, messages, other documents)
CITING = ("hmpnode", "tests", "scripts", "docs", "config", "README.md")
CITING_SUFFIXES = {".py", ".md", ".json", ".js", ".html", ".toml", ".sh", ""}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped,
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def outside_code(text: str) -> list[str]:
    """The lines of `text` that are not inside a fenced code block."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def headings(text: str) -> list[tuple[int, str]]:
    """(level, text) of every heading outside code blocks."""
    out = []
    for line in outside_code(text):
        m = re.match(r"(#{1,6}) (.+)$", line)
        if m:
            out.append((len(m.group(1)), m.group(2)))
    return out


def anchors(text: str) -> set[str]:
    """Every anchor a link may name: heading slugs (GitHub's -1, -2 for repeats) and <a id>."""
    seen: dict[str, int] = {}
    out = set()
    for _, heading in headings(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(re.findall(r'<a id="([^"]+)"></a>', text))
    return out


def toc(text: str) -> list[tuple[str, str]]:
    """(title, anchor) of the table of contents: the numbered list after 'Contents'."""
    lines = text.splitlines()
    start = lines.index("Contents")
    out = []
    for line in lines[start + 1:]:
        m = re.match(r"\d+\. \[(.+)\]\(#([^)]+)\)$", line)
        if m:
            out.append((m.group(1), m.group(2)))
        elif line.strip() and out:
            break
    return out


def citing_files() -> list[Path]:
    files = []
    for top in CITING:
        for path in sorted((REPO / top).rglob("*")) if (REPO / top).is_dir() else [REPO / top]:
            if path.is_file() and path.suffix in CITING_SUFFIXES and path != DOC \
                    and ".venv" not in path.parts and "__pycache__" not in path.parts:
                files.append(path)
    return files


def citations(pattern: str) -> list[tuple[str, str]]:
    """(file:line, cited text) of every match of `pattern` in the citing files."""
    out = []
    for path in citing_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            for m in re.finditer(pattern, line):
                out.append((f"{path.relative_to(REPO)}:{i}", m.group(1)))
    return out


TEXT = DOC.read_text(encoding="utf-8")


def test_every_section_is_in_the_table_of_contents():
    sections = [h for level, h in headings(TEXT) if level == 2]
    listed = toc(TEXT)
    assert [slug(h) for h in sections] == [anchor for _, anchor in listed]
    assert [re.sub(r"^\d+\. ", "", h) for h in sections] == [title for title, _ in listed]


def test_sections_are_numbered_in_order():
    numbers = [int(re.match(r"(\d+)\. ", h).group(1)) for level, h in headings(TEXT) if level == 2]
    assert numbers == list(range(1, len(numbers) + 1))


def test_every_link_inside_the_document_lands():
    known = anchors(TEXT)
    links = re.findall(r"\]\(#([^)\s]+)\)", TEXT)
    assert links
    assert sorted({a for a in links if a not in known}) == []


def test_anchors_are_unique():
    ids = re.findall(r'<a id="([^"]+)"></a>', TEXT)
    assert len(ids) == len(set(ids))
    assert not set(ids) & {slug(h) for _, h in headings(TEXT)}


def test_no_machine_paths_issue_numbers_or_proposals():
    bad = []
    for i, line in enumerate(TEXT.splitlines(), 1):
        if re.search(r"(?<![\w.])/(work|home|tmp|root|Users|mnt)/", line):
            bad.append((i, "machine path", line))
        if re.search(r"\b[Ii]ssues? \d+", line):
            bad.append((i, "issue number", line))
        if re.search(r"[Pp]roposal (for|:)|\(proposal:", line):
            bad.append((i, "proposal", line))
        if re.search(r"\b17\.(?:[2-9]|\d\d)\b", line):
            bad.append((i, "numbered decision of old section 17", line))
    assert bad == []


def test_the_peer_protocol_versions_are_stated_once():
    """The node speaks hmp-peer/2 only: no example offers v1, no dialler picks among versions."""
    assert '["hmp-peer/1", "hmp-peer/2"]' not in TEXT and '["hmp-peer/1","hmp-peer/2"]' not in TEXT
    assert "picks the highest version" not in TEXT


def test_anchor_citations_elsewhere_resolve():
    known = anchors(TEXT)
    cited = citations(r"protocol\.md#([\w-]+)")
    assert sorted({(where, a) for where, a in cited if a not in known}) == []


def test_numbered_citations_elsewhere_name_a_section():
    """`protocol.md 21.3` (or `protocol.md section 21`) names a heading that exists."""
    numbers = set()
    for _, heading in headings(TEXT):
        m = re.match(r"(\d+(?:\.\d+)*)\.? ", heading)
        if m:
            numbers.add(m.group(1))
    cited = citations(r"protocol\.md(?:,)? (?:section |§)?(\d+(?:\.\d+)*)\b")
    assert cited
    assert sorted((where, n) for where, n in cited if n not in numbers) == []


def section_of_anchors(text: str) -> dict[str, str]:
    """Each `<a id>` anchor and the number of the (sub)section it stands in."""
    out, number, fenced = {}, None, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        m = re.match(r"#{2,4} (\d+(?:\.\d+)*)\.? ", line)
        if m:
            number = m.group(1)
        for anchor in re.findall(r'<a id="([^"]+)"></a>', line):
            out[anchor] = number
    return out


def rule_list(text: str) -> list[tuple[str, str, str]]:
    """(link text, anchor, section number given) of each entry of section 17's list."""
    start = text.index("\n## 17. ")
    end = text.index("\n### 17.1 ", start)
    return re.findall(r"^- \[(.+)\]\(#(rule-[\w-]+)\) \(([\d.]+)\)$", text[start:end], re.M)


def test_section_17_lists_every_rule_where_it_stands():
    """Every rule anchored outside section 17 is linked from its list, once, in the order
    of the sections, and the number beside the link is the section the rule stands in."""
    where = section_of_anchors(TEXT)
    listed = rule_list(TEXT)
    anchors_listed = [anchor for _, anchor, _ in listed]
    rules = {a for a, n in where.items() if a.startswith("rule-") and n != "17"}
    assert len(anchors_listed) == len(set(anchors_listed))
    assert sorted(rules - set(anchors_listed)) == []
    assert sorted({a for a in anchors_listed if a not in where}) == []
    assert [(a, n, where[a]) for _, a, n in listed if where.get(a) != n] == []
    order = [tuple(int(x) for x in n.split(".")) for _, _, n in listed]
    assert order == sorted(order), "the list follows the order of the sections"


def test_no_history_wording():
    """A reference states the rules in force: no 'no longer', 'used to', 'as before',
    'previously', 'formerly', 'decision N' or development-branch talk."""
    bad = []
    words = (r"\bno\s+longer\b", r"\bused to\b", r"\bas\s+before\b", r"\bpreviously\b",
             r"\bformerly\b", r"\bdecisions? \d+\b", r"\bmain now\b", r"\bbranch\b",
             r"\bthis work\b")
    # a paragraph at a time, so a phrase broken over two lines is found too
    for para in re.split(r"\n\s*\n", "\n".join(outside_code(TEXT))):
        for word in words:
            if re.search(word, para, re.I):
                bad.append((word, para[:120]))
    assert bad == []


def test_class_table_names_what_the_schemas_require():
    """11.2's table of required payload members is what schemas/classes/*.json require
    (`required`, or the alternatives of `anyOf`), for every class with a schema file."""
    start = TEXT.index("\n### 11.2 ")
    table = {}
    for line in TEXT[start:TEXT.index("\n## 12. ", start)].splitlines():
        m = re.match(r"\| `([\w-]+)` \| (.+) \|$", line)
        if m:
            table[m.group(1)] = set(re.findall(r"`(\w+)`", re.sub(r"\([^()]*\)", "", m.group(2))))
    schemas = {}
    for path in sorted((REPO / "schemas" / "classes").glob("*.json")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        required = set(schema.get("required", []))
        for alternative in schema.get("anyOf", []):
            required |= set(alternative.get("required", []))
        schemas[path.stem] = required
    assert sorted(table) == sorted(schemas)
    assert {c: r for c, r in table.items() if r != schemas[c]} == {}
