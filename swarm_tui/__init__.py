"""SilentSwarm's console: the ``swarm`` / ``swarm-tui`` CLI and the Textual app."""
