"""The class at a glance, written beside the gradebook (`python -m parlab grade DIR --gradebook grades.csv`):

    grades_summary.md     per lab: how many attempted (of those handed in), and over them the mean, median, range
                          and the distribution of points; per check: the pass rate (which part the class found
                          hard); who did not attempt which lab
    grades_summary.html   the same, with a bar chart of each lab's distribution (inline SVG: no script, no network)
    grades_wide.csv       one row per student, one column per lab (the points), what a course system imports

Everything is computed from the gradebook's rows and the report's checks; nothing here runs student code. A student
"did not attempt" a lab when the class has no notebook of theirs for it, or when every part of their notebook is
still the handout's stub.
"""

from __future__ import annotations

import csv
import html
import statistics
from pathlib import Path

NOT_ATTEMPTED_MARK = "not attempted"


def attempted(grade: dict) -> bool:
    """False when every check of the notebook failed because its answer is still the handout's stub."""
    checks = grade.get("checks", [])
    return not checks or not all(NOT_ATTEMPTED_MARK in (c.get("detail") or "") for c in checks)


def name_order(name: str) -> tuple[str, str]:
    """How students are sorted everywhere: by the name whatever its case (Zoë after alice), then as written."""
    return name.casefold(), name


def class_summary(table: list[dict], grades: list[dict], students: list[str], skipped=()) -> dict:
    """The figures of the summary, as data: labs, checks and who did not attempt, from the gradebook's rows
    (`table`) and the report's grades (one per row's notebook, with their students)."""
    roster = sorted(set(students), key=name_order)
    labs: dict[str, dict] = {}
    for grade, student in zip(grades, students, strict=True):
        lab = labs.setdefault(
            grade["lab"], {"points": [], "max_points": grade["max_points"], "checks": {}, "idle": set(), "by": set()}
        )
        lab["by"].add(student)
        if not attempted(grade):
            lab["idle"].add(student)
            continue
        lab["points"].append(grade["points"])
        for check in grade["checks"]:
            passed, total, points = lab["checks"].get(check["check"], (0, 0, check["max_points"]))
            lab["checks"][check["check"]] = (passed + bool(check["passed"]), total + 1, points)
    out = {"students": roster, "notebooks": len(table), "labs": {}, "skipped": [list(s) for s in skipped]}
    for name in sorted(labs):
        lab = labs[name]
        points = lab["points"]
        out["labs"][name] = {
            "max_points": lab["max_points"],
            "submissions": len(points),  # attempted: the statistics are over these
            "handed_in": len(lab["by"]),
            "mean": round(statistics.fmean(points), 2) if points else None,
            "median": statistics.median(points) if points else None,
            "min": min(points) if points else None,
            "max": max(points) if points else None,
            "distribution": [points.count(p) for p in range(lab["max_points"] + 1)],
            "checks": [
                {"check": c, "points": pts, "passed": p, "attempted": n, "rate": round(p / n, 3) if n else None}
                for c, (p, n, pts) in lab["checks"].items()
            ],
            "not_attempted": sorted(lab["idle"] | (set(roster) - lab["by"])),
        }
    return out


def wide_rows(table: list[dict]) -> tuple[list[str], list[dict]]:
    """(columns, rows): one row per student, one column per lab with the points of its best notebook ('' when the
    student has none), and the total."""
    labs = sorted({row["lab"] for row in table})
    best: dict[str, dict[str, int]] = {}
    for row in table:
        own = best.setdefault(row["student"], {})
        own[row["lab"]] = max(int(row["points"]), own.get(row["lab"], 0))
    rows = [
        {"student": student, **{lab: own.get(lab, "") for lab in labs}, "total": sum(own.values())}
        for student, own in sorted(best.items(), key=lambda item: name_order(item[0]))
    ]
    return ["student", *labs, "total"], rows


def markdown(summary: dict) -> str:
    lines = [f"# Class summary: {len(summary['students'])} students, {summary['notebooks']} notebooks", ""]
    lines += [
        "| lab | attempted (of handed in) | mean | median | range | distribution (points: notebooks) |",
        "|---|---|---|---|---|---|",
    ]
    for name, lab in summary["labs"].items():
        spread = ", ".join(f"{p}: {n}" for p, n in enumerate(lab["distribution"]) if n)
        figures = "- | - | -" if lab["mean"] is None else f"{lab['mean']} | {lab['median']} | {lab['min']}-{lab['max']}"
        attempted = f"{lab['submissions']} (of {lab['handed_in']})"
        lines.append(f"| {name} (/{lab['max_points']}) | {attempted} | {figures} | {spread or '-'} |")
    lines += [
        "",
        "## Pass rate per check (the hardest first)",
        "",
        "| lab | check | passed | rate |",
        "|---|---|---|---|",
    ]
    for name, lab in summary["labs"].items():
        for check in sorted(lab["checks"], key=lambda c: (c["rate"] if c["rate"] is not None else 2, c["check"])):
            passed = f"{check['passed']}/{check['attempted']}"
            lines.append(f"| {name} | {check['check']} ({check['points']} pts) | {passed} | {_rate(check)} |")
    lines += ["", "## Did not attempt", ""]
    idle = [(name, lab["not_attempted"]) for name, lab in summary["labs"].items() if lab["not_attempted"]]
    lines += [f"- {name}: {', '.join(who)}" for name, who in idle] or ["- everyone attempted every lab they were given"]
    if summary["skipped"]:
        lines += ["", "## Files not graded", ""] + [f"- {path}: {why}" for path, why in summary["skipped"]]
    return "\n".join(lines) + "\n"


def _rate(check: dict) -> str:
    return "-" if check["rate"] is None else f"{check['rate']:.0%}"


def _bars(distribution: list[int], width: int = 360, height: int = 120) -> str:
    """An inline SVG bar chart of a lab's points (x: points, y: notebooks)."""
    top = max(distribution) or 1
    slot = width / len(distribution)
    bars = []
    for points, count in enumerate(distribution):
        h = (height - 20) * count / top
        x = points * slot
        bars.append(
            f'<rect x="{x + 2:.1f}" y="{height - 16 - h:.1f}" width="{slot - 4:.1f}" height="{h:.1f}" fill="#4c72b0">'
            f"<title>{points} points: {count} notebook(s)</title></rect>"
            f'<text x="{x + slot / 2:.1f}" y="{height - 3}" font-size="10" text-anchor="middle">{points}</text>'
        )
    return f'<svg width="{width}" height="{height}" role="img" aria-label="points per notebook">{"".join(bars)}</svg>'


def html_page(summary: dict) -> str:
    e = html.escape
    parts = [
        "<!doctype html><meta charset='utf-8'><title>Class summary</title>",
        "<style>body{font:15px sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:4px 8px;text-align:left}</style>",
        f"<h1>Class summary: {len(summary['students'])} students, {summary['notebooks']} notebooks</h1>",
    ]
    for name, lab in summary["labs"].items():
        figures = (
            "no attempt"
            if lab["mean"] is None
            else (f"mean {lab['mean']}, median {lab['median']}, range {lab['min']}-{lab['max']} of {lab['max_points']}")
        )
        parts.append(
            f"<h2>{e(name)}</h2><p>{lab['submissions']} attempted of {lab['handed_in']} handed in; over those "
            f"attempted: {figures}</p>{_bars(lab['distribution'])}"
        )
        rows = "".join(
            f"<tr><td>{e(c['check'])}</td><td>{c['points']}</td><td>{c['passed']}/{c['attempted']}</td>"
            f"<td>{_rate(c)}</td></tr>"
            for c in lab["checks"]
        )
        parts.append(f"<table><tr><th>check</th><th>points</th><th>passed</th><th>rate</th></tr>{rows}</table>")
        if lab["not_attempted"]:
            parts.append(f"<p>Did not attempt: {e(', '.join(lab['not_attempted']))}</p>")
    if summary["skipped"]:
        items = "".join(f"<li>{e(path)}: {e(why)}</li>" for path, why in summary["skipped"])
        parts.append(f"<h2>Files not graded</h2><ul>{items}</ul>")
    return "\n".join(parts) + "\n"


def write_summary(paths: dict[str, Path], table: list[dict], grades, students, skipped, safe) -> None:
    """Write the summary's three files (`paths`: md, html, wide); `safe` makes a CSV cell spreadsheet-safe."""
    summary = class_summary(table, grades, students, skipped)
    paths["md"].write_text(markdown(summary), encoding="utf-8")
    paths["html"].write_text(html_page(summary), encoding="utf-8")
    columns, rows = wide_rows(table)
    with open(paths["wide"], "w", newline="", encoding="utf-8-sig") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows({key: safe(value) for key, value in row.items()} for row in rows)
