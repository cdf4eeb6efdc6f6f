"""The README's list of families is the registry's: every supported model type, then those refused."""

import re
from pathlib import Path

from moestream.families import FAMILIES, supported

README = Path(__file__).resolve().parents[1] / "README.md"


def listed() -> tuple[list[str], list[str]]:
    block = re.search(r"<!-- families:.*?-->(.*?)<!-- /families -->", README.read_text(), flags=re.S).group(1)
    loaded, refused = block.split("cannot run")
    return re.findall(r"`(\w+)`", loaded), re.findall(r"`(\w+)`", refused)


def test_the_readme_lists_every_family_and_every_refusal():
    loaded, refused = listed()
    assert loaded == supported()
    assert refused == [name for name in FAMILIES.names() if FAMILIES.get(name).reason() is not None]
