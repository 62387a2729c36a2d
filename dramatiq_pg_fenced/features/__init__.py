"""The optional features: results, rate limits, schedules, the fenced transaction."""
