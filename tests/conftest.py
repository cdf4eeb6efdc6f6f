from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DEEPSEEK_DEV = SHARED_DATA / "routing" / "deepseek-v2-lite" / "puffin_dev.npz"


@pytest.fixture
def deepseek_dev_path() -> Path:
    if not DEEPSEEK_DEV.exists():
        pytest.skip(f"real routing data not found at {DEEPSEEK_DEV}")
    return DEEPSEEK_DEV
