"""The trainer tests' fixtures (tests/train/conftest.py: the small corpus, its token cache, run and model configs),
for the placement tests that train whole runs (test_host.py)."""

from tests.train.conftest import _token_cache, make_model_config, make_train_config, train_assets

__all__ = ["_token_cache", "make_model_config", "make_train_config", "train_assets"]
