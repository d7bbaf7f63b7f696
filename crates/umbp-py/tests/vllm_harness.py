"""The engine harness test_vllm.py, test_vllm_hma.py and test_vllm_pool.py share: the package's
own (``umbp.vllm._harness``, which ``python -m umbp.vllm.check`` and the vLLM bench drive
too): vLLM's own v1 Scheduler with umbp.vllm.UmbpConnector loaded by module path, a small
model config.json (no weights, no tokenizer), one worker-side connector per tensor-parallel
rank over CPU tensors vLLM's ``allocate_kv_cache`` lays out, stepped in the order vLLM's model
runner calls them. Its docstring says what a subclass provides.

Where vLLM is absent, importing this module skips the test module that imports it, with the
reason printed (and fails where UMBP_REQUIRE_VLLM=1): `bash .ci/vllm-venv` installs vLLM.
"""

import os

import pytest

try:
    import torch  # noqa: F401
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("UMBP_REQUIRE_VLLM") == "1":
        raise
    pytest.skip(f"vLLM is not installed ({e}); run: bash .ci/vllm-venv", allow_module_level=True)

from umbp.vllm._harness import (  # noqa: E402,F401  (re-exported to the test files)
    BS,
    EOS,
    HEAD,
    KV_HEADS,
    POISON,
    EngineHarness,
    PrefixModelHarness,
    Rank,
    WrongBytes,
    first_step_of,
    prompt,
    vllm_config,
    write_model_dir,
)
