"""Test and drill harnesses: real platform processes arranged as a deployment would be.

Not imported by the platform itself; management commands for people (`sites`, `sites_drill`)
and the tests use it.
"""
