"""Rebuild ``explore_kimi_k3.ipynb`` (without outputs) from ``explore_kimi_k3.py``.

    python examples/build_notebook.py

The script is the source: ``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell
whose lines are comments. ``tests/test_examples.py`` checks the two files agree.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

HERE = Path(__file__).parent
SCRIPT = HERE / "explore_kimi_k3.py"
NOTEBOOK = HERE / "explore_kimi_k3.ipynb"


def cells(script: str) -> list[tuple[str, str]]:
    """``(kind, source)`` per cell, kind ``"code"`` or ``"markdown"``."""
    out: list[tuple[str, list[str]]] = []
    for line in script.splitlines():
        if line.startswith("# %%"):
            out.append(("markdown" if "[markdown]" in line else "code", []))
        elif out:
            kind, body = out[-1]
            body.append(_uncomment(line) if kind == "markdown" else line)
        elif line.strip():
            raise ValueError(f"{SCRIPT}: text before the first '# %%' cell marker")
    return [(kind, "\n".join(body).strip("\n")) for kind, body in out]


def _uncomment(line: str) -> str:
    return line[2:] if line.startswith("# ") else line.removeprefix("#")


def notebook(script: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    make = {"code": nbformat.v4.new_code_cell, "markdown": nbformat.v4.new_markdown_cell}
    nb.cells = [make[kind](source) for kind, source in cells(script)]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i}"  # stable ids: rebuilding an unchanged script changes nothing
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    }
    return nb


def main():
    nbformat.write(notebook(SCRIPT.read_text()), NOTEBOOK)
    print(f"wrote {NOTEBOOK}")


if __name__ == "__main__":
    main()
