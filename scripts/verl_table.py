"""Write docs/verl.md's key table from the code (``hybridlab.verl.keys.markdown_table``):

    python scripts/verl_table.py

``tests/test_verl_keys.py`` fails when the page and the code differ."""
from __future__ import annotations

from pathlib import Path

from hybridlab.verl.keys import markdown_table

PAGE = Path(__file__).resolve().parents[1] / "docs" / "verl.md"
START, END = "<!-- key table: scripts/verl_table.py -->", "<!-- end of key table -->"


def table_section(text: str) -> str:
    """Return the part of the page between the table's markers."""
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def main() -> None:
    """Replace the table between the page's markers with the code's; prints the page's path."""
    text = PAGE.read_text()
    head, rest = text.split(START, 1)
    PAGE.write_text(f"{head}{START}\n{markdown_table()}\n{END}{rest.split(END, 1)[1]}")
    print(PAGE)


if __name__ == "__main__":
    main()
