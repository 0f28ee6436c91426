"""What travels from the driver to the ranks: the pickled function and its arguments with their source lines, a
script and its folder, and the driver's MLflow run. Packed in the driver, unpacked in the rank.
Tests: tests/runner/payload/.
"""
