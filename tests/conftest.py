import os
import sys

import matplotlib
import pytest
import torch
from hypothesis import settings

matplotlib.use("Agg")

# CI gates a merge, so it replays the same examples every run (a failure there is then
# reproducible); local runs keep exploring new random examples.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
