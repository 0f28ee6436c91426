"""The driver service: the authenticated listener every rank talks to (``service.py``) and its handlers by job
(registration and ranks, reports, commits, the rendezvous store), the frozen status snapshot the policy reads,
the driver's commit store, and the run's logs. It runs in the driver. Tests: tests/runner/service/.
"""
