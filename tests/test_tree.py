"""The test tree mirrors the code's wings: tests of trainer/<wing>/ live in tests/trainer/<wing>/, so a maintainer
changing one wing finds its tests in one folder (issue 29). Folders that hold inputs rather than tests are named here."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOT_A_WING = {"fixtures", "data", "fakes", "__pycache__"}  # captured inputs (tests/trainer/fixtures, tests/resolver/data)


def test_every_test_folder_is_a_wing_of_the_code():
    for side in ("trainer", "resolver"):
        for folder in sorted(p for p in (REPO / "tests" / side).iterdir() if p.is_dir() and p.name not in NOT_A_WING):
            assert (REPO / side / folder.name / "__init__.py").is_file(), (
                f"tests/{side}/{folder.name}/ mirrors no package {side}/{folder.name}/"
            )
            assert (folder / "__init__.py").is_file(), f"tests/{side}/{folder.name}/ lacks __init__.py"


def test_a_wing_with_tests_keeps_them_in_its_folder():
    """A top-level test file in tests/trainer/ may only be a whole-trainer journey (it imports no single wing more than
    any other); one whose imports all come from one wing belongs in that wing's folder."""
    import re

    wings = {p.name for p in (REPO / "trainer").iterdir() if (p / "__init__.py").is_file()}
    for path in sorted((REPO / "tests" / "trainer").glob("test_*.py")):
        used = set(re.findall(r"^\s*(?:from|import) trainer\.(\w+)", path.read_text(), re.M)) & wings
        (only,) = used if len(used) == 1 else (None,)
        assert only is None, f"{path.relative_to(REPO)} tests only trainer/{only}/: move it to tests/trainer/{only}/"
