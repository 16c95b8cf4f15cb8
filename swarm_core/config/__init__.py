"""Experiment configuration: attrs schemas (torch-free, the leader validates job payloads)."""

from swarm_core.config.schemas import ModelConfig, TrainingConfig, parse_compression

__all__ = ["ModelConfig", "TrainingConfig", "parse_compression"]
