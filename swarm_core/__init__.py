"""SilentSwarm core: leader, fellows, pipeline and artifacts. Nothing here imports Textual."""

__version__ = "0.1.0"
