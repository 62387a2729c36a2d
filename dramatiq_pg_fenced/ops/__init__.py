"""The operators' tools: inspect, cancel, re-drive, search, bulk actions, charts, metrics, several databases at once."""
