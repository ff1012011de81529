"""The engine: lock, journal, apply in order, roll back, tear down from the journal."""
