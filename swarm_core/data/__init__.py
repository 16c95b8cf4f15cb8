"""Datasets by name and tokenizers; deterministic train/validation split and batches."""

from swarm_core.data.datasets import DataError, TokenData, load_token_data

__all__ = ["DataError", "TokenData", "load_token_data"]
