"""docs/recipes.md is the recipe field reference generated from the config dataclasses
(`trainer/config/recipe_doc.py`): it must be current, and every field must carry its own comment."""

from __future__ import annotations

from pathlib import Path

from trainer.config import recipe_doc

ROOT = Path(__file__).resolve().parents[2]


def test_every_recipe_field_is_documented_in_the_code() -> None:
    assert recipe_doc.undocumented() == [], (
        "give these config fields a comment (the line above, or a trailing # ...): "
        + ", ".join(recipe_doc.undocumented()))


def test_the_recipe_reference_page_is_current() -> None:
    page = (ROOT / "docs" / "recipes.md").read_text()
    assert page == recipe_doc.render(), (
        f"docs/recipes.md is stale; regenerate it: {recipe_doc.COMMAND}")


def test_a_field_row_carries_its_type_default_and_comment() -> None:
    from trainer.config.training import OptimConfig

    rows = {r.name: r for r in recipe_doc.field_docs(OptimConfig)}
    assert rows["lr"].annotation == "float" and rows["lr"].default == "3e-3"
    assert rows["lr"].doc.startswith("peak learning rate")
    assert rows["nesterov"].default == "false"
    assert [name for name, _ in recipe_doc.sections()][:3] == ["model", "data", "optim"]
