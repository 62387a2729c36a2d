"""The database layer: statements, connections and their pools, wake-ups, migrations, the start-up check."""
