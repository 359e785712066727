"""Where users' models live: attnscore inside other libraries' models and runtimes.

Each submodule imports its client library only when it is used, so ``import attnscore``
never needs them:

- :mod:`attnscore.integrations.transformers`: Hugging Face transformers models select
  attnscore's attention by name (``attn_implementation="attnscore"``); extra ``[hf]``.
- :mod:`attnscore.integrations.export`: conveniences over ``torch.export`` and
  ``torch.onnx.export(..., dynamo=True)``, which take any model holding the library's
  modules as they are; ONNX files run by ONNX Runtime; extra ``[onnx]``.
"""
