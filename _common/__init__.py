"""The bottom layer: what the runner and the collectives both stand on, importing neither.

The wire protocol and its authenticated client and listener, the rendezvous store, the rank's
context and topology, the progress records behind the stall report, the rank's side of the
driver's commit service, and every setting. ``runner`` and ``collective`` meet only here
(docs/layout.md; the tests check it with import-linter).
"""
