"""The training engine: model, placement, schedules, codecs, wire frames, shaped links."""
