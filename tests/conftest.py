import os
import sys

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
