"""A pytest plugin for transformers' own test suite: attnscore's attention runs wherever a
test asks for ``"sdpa"`` (``-p sdpa_is_attnscore``, with this folder on ``PYTHONPATH``).

``AttentionInterface.register("sdpa", ...)`` replaces the function behind the name in
transformers' global table, so every model built with ``attn_implementation="sdpa"`` (the
default where a model supports it) calls :func:`attnscore.integrations.transformers.
attention_function` ``("softmax")`` instead; the mask function stays transformers'
``sdpa_mask``, which is what ``register`` pairs with attnscore's names too. Loaded by
``tools/hf_suite/run.py``; nothing else in the project imports it.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    from attnscore.integrations.transformers import attention_function, register

    register()
    AttentionInterface.register("sdpa", attention_function("softmax"))
    AttentionMaskInterface.register("sdpa", sdpa_mask)
    if AttentionInterface()["sdpa"] is not attention_function("softmax"):
        raise pytest.UsageError("sdpa_is_attnscore: 'sdpa' could not be replaced")


def pytest_report_header(config: pytest.Config) -> str:
    import attnscore

    return f"sdpa_is_attnscore: 'sdpa' runs attnscore {attnscore.__version__}"
