"""docs/BENCHMARKS.md is a reference: the current figures first, each reproducible.

The figures table must stay the first section, every row must say how to reproduce it
(a command naming a script that exists), where (the machine) and when (a date); headings
carry no issue/session/round history, which lives in the journal the document links to.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "BENCHMARKS.md"
JOURNAL = ROOT / "docs" / "benchmarks-journal.md"
COLUMNS = ["area", "figure", "value", "target", "command", "machine", "date"]
AREAS = ["container core", "node", "mesh", "recall", "consensus/index", "hostile",
         "transport/reconcile", "delivery faults", "simulator", "circuits", "NAT"]


def _sections(text):
    """(heading, body) of every `## ` section, in order."""
    parts = re.split(r"^## (.*)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _figures_table():
    """The rows of the first section's tables (one per area, each with the same columns)."""
    heading, body = _sections(DOC.read_text())[0]
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]
    assert lines, "the first ## section (%r) holds no table" % heading
    rows = []
    for i, line in enumerate(lines):
        cells = _cells(line)
        if [c.lower() for c in cells] == COLUMNS:
            continue
        if all(re.fullmatch(r":?-+:?", c) for c in cells):
            header = [c.lower() for c in _cells(lines[i - 1])] if i else []
            assert header == COLUMNS, "a figures table's columns are %r, want %r" % (header, COLUMNS)
            continue
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


def _slug(heading):
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_first_section_is_the_table_of_current_figures_grouped_by_area():
    rows = _figures_table()
    assert len(rows) >= len(AREAS)
    seen = [r["area"] for r in rows]
    order = [a for i, a in enumerate(seen) if i == 0 or seen[i - 1] != a]
    assert len(order) == len(set(order)), "rows of one area are not together: %r" % order
    assert set(AREAS) <= set(order), "areas without a row: %r" % (set(AREAS) - set(order))


def test_every_figure_names_an_existing_script_a_machine_and_a_date():
    for row in _figures_table():
        where = "row %r" % row["figure"]
        assert row["figure"] and row["value"], where
        scripts = re.findall(r"scripts/([A-Za-z0-9_./-]+)", row["command"])
        assert scripts, "%s: its command names no scripts/ file: %r" % (where, row["command"])
        for name in scripts:
            assert (ROOT / "scripts" / name.rstrip(".")).exists(), "%s: no scripts/%s" % (where, name)
        assert row["machine"], where + ": no machine"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", row["date"]), where + ": no date: %r" % row["date"]


def test_headings_carry_no_history():
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            assert not re.search(r"\bissue\s*\d+|\bsession|\bround", line, re.I), line


def test_the_journal_exists_is_linked_and_dated():
    assert "](benchmarks-journal.md)" in DOC.read_text()
    entries = _sections(JOURNAL.read_text())
    assert entries
    for heading, _ in entries:
        assert re.match(r"20\d\d-\d\d-\d\d\b", heading), "undated journal entry: %r" % heading


def test_every_area_link_at_the_top_leads_to_its_rows():
    """One step from the top to any figure: each area is linked, and every link resolves."""
    text = DOC.read_text()
    anchors = {_slug(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    for link in links:
        assert link in anchors, "link to #%s: no such heading" % link
    heading, body = _sections(text)[0]
    top = body.split("|", 1)[0]
    areas = re.findall(r"^### (.*)$", body, flags=re.M)
    assert len(areas) >= len(AREAS), "one ### heading per area's rows: %r" % areas
    for area in areas:
        assert "](#%s)" % _slug(area) in top, "area %r is not linked before the tables" % area


def test_every_benchmark_script_is_described():
    """A script that measures (bench_*, probe_*, sim, fault_delivery) has its place in the doc."""
    text = DOC.read_text()
    names = {p.stem for p in (ROOT / "scripts").iterdir()
             if re.match(r"(bench_|probe_|sim|fault_)", p.name) and not p.name.endswith(".sh")}
    missing = sorted(n for n in names if not re.search(r"scripts/%s\b" % re.escape(n), text))
    assert not missing, "scripts not in docs/BENCHMARKS.md: %r" % missing


def test_journal_entries_are_oldest_first_with_one_heading_form():
    dates = []
    for heading, _ in _sections(JOURNAL.read_text()):
        assert re.match(r"20\d\d-\d\d-\d\d — \S", heading), \
            "journal heading not 'YYYY-MM-DD — title': %r" % heading
        dates.append(heading[:10])
    assert dates == sorted(dates), "journal entries out of order: %r" % dates


def test_every_row_is_dated_on_a_day_the_journal_has_a_run():
    """A figure's run is in the journal: its day appears there."""
    journal = JOURNAL.read_text()
    for row in _figures_table():
        day = re.search(r"20\d\d-\d\d-\d\d", row["date"]).group(0)
        assert day in journal, "row %r: no run on %s in the journal" % (row["figure"], day)


def _help(script, command):
    """The script's --help for the subcommand the command names (options built from a config)."""
    words = command.split()
    after = words[next(i for i, w in enumerate(words) if "scripts/" in w) + 1:][:1]
    sub = [w for w in after if not w.startswith("-")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts")]))
    done = subprocess.run([sys.executable, str(script), *sub, "--help"], capture_output=True,
                          text=True, env=env, timeout=60)
    return done.stdout


def test_every_flag_of_a_command_is_one_its_script_takes():
    """A command that reproduces a figure names only options its script still has."""
    for row in _figures_table():
        for command in re.findall(r"`([^`]*)`", row["command"]):
            script = re.search(r"scripts/([A-Za-z0-9_/.]+)", command)
            if not script:
                continue
            paths = [ROOT / "scripts" / (script.group(1) + ".py"), ROOT / "scripts" / script.group(1)]
            files = [p for p in paths if p.is_file()]
            if not files:
                continue  # a directory (a PYTHONPATH entry), not a command
            source, helptext = files[0].read_text(), None
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", command):
                if '"%s"' % flag in source:
                    continue
                helptext = helptext if helptext is not None else _help(files[0], command)
                assert re.search(r"(?<![\w-])%s\b" % flag, helptext), "row %r: %s has no option %s" % (
                    row["figure"], script.group(0), flag)
