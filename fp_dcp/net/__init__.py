"""Moving bytes between the ranks of a job: process groups of fp-dcp's own, and a bounded-memory transport.

One transport serves the tiers (a step's files copied to peer nodes,
fetched on restore) and loads (an item read from storage once and sent to
every rank that needs it).
"""
