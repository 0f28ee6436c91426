"""A multi-host Spark standalone cluster made of Linux network namespaces, and the tests on it.

See docs/cluster-tests.md. ``_netns`` builds the hosts, ``_cluster`` starts Spark on them and
drives runs through a driver subprocess (``_driver``), ``_faults`` breaks them.
"""
