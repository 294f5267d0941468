"""The committed stubs in common/generated must be exactly what `make proto` writes."""

from common.protogen import stale_files


def test_generated_code_is_fresh() -> None:
    assert stale_files() == [], "run `make proto` and commit the result"
