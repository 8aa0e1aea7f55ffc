"""ARCHITECTURE.md stays true: the files it cites exist, the names it cites are defined, its layers are the contract."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "ARCHITECTURE.md"
PACKAGES = ("models", "adapters", "routing", "training", "serving", "fedmosaic", "demos")
# Files cited before they exist (each only in a paragraph marked to be checked); none now.
PENDING: set[str] = set()


def cited() -> list[str]:
    """Every backticked span of the document (code blocks excluded)."""
    text = re.sub(r"```.*?```", "", DOC.read_text(), flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def defined_names() -> set[str]:
    """Names defined anywhere in our packages: functions, classes, module and class attributes."""
    pattern = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)|^\s*(\w+)\s*(?::[^=\n]*)?=|^\s+(\w+)\s*:", re.M)
    names: set[str] = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            names.update(n for match in pattern.findall(path.read_text()) for n in match if n)
    return names


def test_every_cited_path_exists() -> None:
    paths = [span for span in cited() if re.fullmatch(r"[\w./-]+(/|\.py|\.toml|\.md)", span)]
    assert len(paths) > 30
    missing = [p for p in paths if p not in PENDING and not (REPO / p).exists()]
    assert not missing, missing
    for pending in PENDING:
        paragraph = DOC.read_text().split(pending)[0].rsplit("\n\n", 1)[-1]
        assert "<!-- round loop: keep in sync -->" in paragraph, f"{pending} is cited outside its marked paragraph"


def test_every_cited_name_is_defined() -> None:
    names = defined_names()
    spans = [s.split("(")[0] for s in cited() if re.fullmatch(r"[A-Za-z_][\w.]*(\(.*\))?", s)]
    qualified = [s for s in spans if "." in s and not s.endswith((".py", ".toml", ".md"))]
    code_names = [s for s in spans if "." not in s and (re.search(r"[A-Z]", s) or "_" in s)]  # not plain words
    undefined = [s for s in qualified + code_names if s.rsplit(".", 1)[-1] not in names]
    assert not undefined, undefined


def test_the_layers_table_is_the_import_contract() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers" and "containers" not in c]
    assert "ignore_imports" not in layers
    contract = [sorted(part.strip() for part in layer.split("|")) for layer in layers["layers"]]
    table = re.findall(r"^\| (\w+) \| `(\w+)/` \|", DOC.read_text(), re.M)
    rows: dict[str, list[str]] = {}
    for layer, package in table:
        rows.setdefault(layer, []).append(package)
    assert [sorted(packages) for packages in rows.values()] == contract
    assert set(config["root_packages"]) == set(PACKAGES)


def inside_table_and_contract(package: str) -> tuple[list[list[str]], list[list[str]]]:
    """``package``'s floors as ARCHITECTURE.md's "Inside" table lists them, and as its container contract does."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (inside,) = [c for c in config["contracts"] if c.get("containers") == [package]]
    assert "ignore_imports" not in inside
    contract = [sorted(part.strip() for part in layer.split("|")) for layer in inside["layers"]]
    section = DOC.read_text().split(f"## Inside `{package}/`")[1].split("\n## ")[0]
    floors = [re.findall(rf"`{package}/([\w.]+?)(?:\.py|/)`", row.split("|")[2])
              for row in section.splitlines() if re.match(rf"^\| \w+ \| `{package}/", row)]
    return [sorted(modules) for modules in floors], contract


def test_the_serving_table_is_the_serving_contract() -> None:
    table, contract = inside_table_and_contract("serving")
    assert table == contract


def test_the_training_table_is_the_training_contract() -> None:
    table, contract = inside_table_and_contract("training")
    assert table == contract
    # every module and package of training/ stands on one floor
    listed = {m for floor in table for m in floor}
    present = {p.stem for p in (REPO / "training").iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert listed == present
