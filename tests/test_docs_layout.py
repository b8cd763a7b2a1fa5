"""The docs and the tree agree: every repository path and relative link named in README.md and the user
docs exists (anchors included), and scripts/lab/README.md's table lists exactly the files of scripts/lab/.

The dated run logs under docs/measurements/ are kept verbatim, paths of their time included, so only their
index (docs/measurements/README.md) is checked."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "scripts" / "lab"
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "docs" / "measurements" / "README.md",
    LAB / "README.md",
]
# A repository path: starts a word (not `$REPO/server`, not `.../docs/x`), ends on a name character.
PATH = re.compile(r"(?<![\w./$-])((?:scripts|docs|server|tests)/[\w./*-]*[\w*/])")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def named_paths(text: str) -> set[str]:
    return {m.rstrip(".") for m in PATH.findall(text)}


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+ (.+)$", doc.read_text(), flags=re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_exists(doc):
    missing = []
    for name in sorted(named_paths(doc.read_text())):
        found = any(ROOT.glob(name)) if "*" in name else (ROOT / name).exists()
        if not found:
            missing.append(name)
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_exists(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to what does not exist: {broken}"


def test_lab_readme_table_lists_exactly_the_lab_files():
    rows = re.findall(r"^\| `([^`]+)` \|", (LAB / "README.md").read_text(), flags=re.M)
    assert len(rows) == len(set(rows)), f"listed twice: {sorted({r for r in rows if rows.count(r) > 1})}"
    files = {p.name for p in LAB.iterdir() if p.is_file() and p.name != "README.md"}
    assert not files - set(rows), f"in scripts/lab/ but not in its README's table: {sorted(files - set(rows))}"
    assert not set(rows) - files, (
        f"in scripts/lab/README.md's table but not in scripts/lab/: {sorted(set(rows) - files)}"
    )


def test_the_checks_see_paths_and_anchors():
    # The patterns must find what the docs name, or the tests above pass on nothing.
    text = "run `scripts/lab/device_stack_bench.sh`, see docs/gpu.md. Not $REPO/server/x nor a/docs/y."
    assert named_paths(text) == {"scripts/lab/device_stack_bench.sh", "docs/gpu.md"}
    assert slug("Tensor parallelism and multi-node serving") == "tensor-parallelism-and-multi-node-serving"
    assert slug("Quantization: `QUANT_TYPE`") == "quantization-quant_type"
    assert "current-figures" in anchors(ROOT / "docs" / "gpu.md")
