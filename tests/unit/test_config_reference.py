"""docs/configuration.md is the reference made from the settings' own docs, and stays so."""

from pathlib import Path

from common.config import daemons, reference, settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_configuration_reference_is_current() -> None:
    assert DOC.read_text() == reference(daemons()), (
        "docs/configuration.md is out of date: run `make config-doc`"
    )


def test_it_lists_every_setting_of_both_daemons_with_its_doc() -> None:
    text = DOC.read_text()
    for cls in daemons().values():
        for setting in settings(cls).values():
            assert f"| `{setting.name}` |" in text
            assert setting.doc, f"setting {setting.name} has no docstring"
