"""Client-side orchestration: experiment configs run on a leader (``runner``), benchmark suites
over cluster shapes (``suites``), and reports over the run directories they write
(``report``). Everything here goes through :class:`swarm_core.client.SwarmClient`."""
