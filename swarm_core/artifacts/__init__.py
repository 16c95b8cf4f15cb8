"""Run artifacts: shard export (fellow side), manifests, and (later) glue into one model."""
