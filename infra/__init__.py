"""The operations of the servers: serve, workers, process supervision, auth, PostgreSQL, alerts."""
