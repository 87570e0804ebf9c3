"""Kernel tests: every test starts from the same random state."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
