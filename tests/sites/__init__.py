"""Pools on other hosts: least-privilege credentials, multi-site runs."""
