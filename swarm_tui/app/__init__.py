"""The Textual console (``swarm-tui``).

``model`` and ``cells`` are plain Python (the cluster as the console sees it, and how it is
written into table cells); everything else here imports Textual. ``swarm_tui.cli`` imports this
package only when the console starts, so headless commands never load Textual.
"""
